// Decode-time graphs for the GEMV lowerings' tests (tests/unit/dispatch, tests/gpu): a SwiGLU
// MLP, sibling projections and the attention inputs after them (rope, cache writes), a single projection, dense or MLX affine, with value names that say nothing about the
// roles (the lowerings must read the regions' roles, not names) and, where asked, the operands
// of the multiply and the residual add the other way round.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "metile/fusion.h"
#include "metile/graph.h"

namespace metile::testing {

struct LinearFormat {
  int bits = 16;  // 16: dense in the activation dtype; 4 or 8: MLX affine
  int group_size = 64;
  DType dtype = DType::bf16;
};

// x [rows, k] · W[n, k]ᵀ, W named after `prefix`: dense "<prefix>.w" (transpose_right), or
// "<prefix>.q" u32 [n, k·bits/32], "<prefix>.s" and "<prefix>.b" [n, k/group].
inline ValueRef test_linear(GraphBuilder& builder, ValueRef x, const std::string& prefix, std::int64_t n,
                            std::int64_t k, const LinearFormat& format) {
  if (format.bits == 16) {
    const ValueRef weight = builder.input(prefix + ".w", TensorSpec({n, k}, format.dtype));
    return builder.matmul(x, weight, true, prefix);
  }
  const ValueRef packed = builder.input(prefix + ".q", TensorSpec({n, k * format.bits / 32}, DType::u32));
  const ValueRef scales = builder.input(prefix + ".s", TensorSpec({n, k / format.group_size}, format.dtype));
  const ValueRef biases = builder.input(prefix + ".b", TensorSpec({n, k / format.group_size}, format.dtype));
  return builder.quantized_matmul(x, packed, scales, biases, format.bits, format.group_size, prefix);
}

// The activation "a" [rows, k] and, when `normalized`, rms_norm(a, "g" [k], eps 1e-5) named "m0":
// the RMSNorm a GEMV region takes as its input prologue (normalized_input_prologue).
inline constexpr double kTestNormEps = 1e-5;
inline ValueRef test_activation(GraphBuilder& builder, std::int64_t rows, std::int64_t k, DType dtype, bool normalized) {
  const ValueRef x = builder.input("a", TensorSpec({rows, k}, dtype));
  if (!normalized) return x;
  return builder.rms_norm(x, builder.input("g", TensorSpec({k}, dtype)), kTestNormEps, "m0");
}

// out = silu(x·Gᵀ) * (x·Uᵀ) · Dᵀ + residual, with G named "p1", U "p0", D "p2", x "a", the
// residual "b"; `swapped`: multiply(up, silu(gate)) and add(residual, down); `normalized`: x is
// rms_norm(a) (test_activation).
inline ComputeGraph swiglu_test_graph(std::int64_t rows, std::int64_t hidden, std::int64_t intermediate,
                                      const LinearFormat& format, bool swapped = false, bool residual = true,
                                      bool normalized = false) {
  GraphBuilder builder;
  const ValueRef x = test_activation(builder, rows, hidden, format.dtype, normalized);
  const ValueRef up = test_linear(builder, x, "p0", intermediate, hidden, format);
  const ValueRef gate = test_linear(builder, x, "p1", intermediate, hidden, format);
  const ValueRef activated = builder.silu(gate, "n0");
  const ValueRef hidden_state = swapped ? builder.multiply(up, activated, "n1") : builder.multiply(activated, up, "n1");
  const ValueRef down = test_linear(builder, hidden_state, "p2", hidden, intermediate, format);
  if (!residual) return builder.build({down});
  const ValueRef skip = builder.input("b", TensorSpec({rows, hidden}, format.dtype));
  const ValueRef out = swapped ? builder.add(skip, down, "n2") : builder.add(down, skip, "n2");
  return builder.build({out});
}

// One projection y = x·Wᵀ [rows, n], then by `epilogue`: "none", "residual" (+ r [rows, n]),
// "bias" (+ c [n]) or "argmax" (an LM head: y and n0 = argmax(y), i32 [rows], both outputs);
// `normalized`: x is rms_norm(a) (test_activation: the final norm before the LM head).
inline ComputeGraph projection_test_graph(std::int64_t rows, std::int64_t n, std::int64_t k, const LinearFormat& format,
                                          const std::string& epilogue, bool normalized = false) {
  GraphBuilder builder;
  const ValueRef x = test_activation(builder, rows, k, format.dtype, normalized);
  const ValueRef y = test_linear(builder, x, "p0", n, k, format);
  if (epilogue == "residual") return builder.build({builder.add(y, builder.input("r", TensorSpec({rows, n}, format.dtype)), "n0")});
  if (epilogue == "bias") return builder.build({builder.add(y, builder.input("c", TensorSpec({n}, format.dtype)), "n0")});
  if (epilogue == "argmax") return builder.build({y, builder.argmax(y, "n0")});
  return builder.build({y});
}

// Sibling projections of one x [rows, k] (q, k, v): projection p "p<p>" has widths[p] outputs
// and, where biased[p], adds its bias "c<p>" [widths[p]]; each result is a graph output
// ("y<p>"), as the q, k and v of a decode step are read by layout ops outside; `normalized`: x is
// rms_norm(a) (test_activation: the attention block's input norm).
inline ComputeGraph sibling_test_graph(std::int64_t rows, const std::vector<std::int64_t>& widths, std::int64_t k,
                                       const LinearFormat& format, const std::vector<bool>& biased,
                                       bool normalized = false) {
  GraphBuilder builder;
  const ValueRef x = test_activation(builder, rows, k, format.dtype, normalized);
  std::vector<ValueRef> outputs;
  for (std::size_t p = 0; p < widths.size(); ++p) {
    const std::string name = "p" + std::to_string(p);
    ValueRef y = test_linear(builder, x, name, widths[p], k, format);
    if (biased[p]) y = builder.add(y, builder.input("c" + std::to_string(p), TensorSpec({widths[p]}, format.dtype)), "y" + std::to_string(p));
    outputs.push_back(y);
  }
  return builder.build(outputs);
}

// The attention inputs of a decode step as src/model/step_graph.cpp records them: q, k and v
// projections of one x [rows, hidden] (biased or not), each split into heads ([rows, H·D] →
// [rows, H, D] → [H, rows, D]), rope on q and k at "positions", k and v written into the caches
// "k_cache" and "v_cache" [kv_heads, capacity, D]. Outputs: q rotated, both updated caches. The
// probes break what the rope_kv_cache rule needs, one at a time.
struct AttentionInputsShape {
  std::int64_t rows = 1, q_heads = 4, kv_heads = 2, head_dim = 64, capacity = 32, hidden = 128;
  bool bias = false;
  bool llama3_scaling = false;  // Llama 3.2's rope scaling (factor 32, 1, 4, 8192)
  double theta = 500000;
  LinearFormat format;
  bool k_rope_escapes = false;      // probe: k rotated is a graph output too
  double q_theta = 0;               // probe (when not 0): q's rope turns with another theta
  bool v_from_other_input = false;  // probe: v projects another input, so it is no sibling of k
  bool q_escapes = false;           // probe: q (before rope) is a graph output too
};

inline ComputeGraph attention_inputs_test_graph(const AttentionInputsShape& shape) {
  GraphBuilder builder;
  const DType dtype = shape.format.dtype;
  const ValueRef x = builder.input("a", TensorSpec({shape.rows, shape.hidden}, dtype));
  const ValueRef positions = builder.input("positions", TensorSpec({shape.rows}, DType::i32));
  auto rope_attributes = [&](double theta) {
    Attributes attributes;
    attributes.set("theta", theta);
    attributes.set("dims", shape.head_dim);
    if (shape.llama3_scaling) {
      attributes.set("scaling", std::string("llama3"));
      attributes.set("factor", 32.0);
      attributes.set("low_freq_factor", 1.0);
      attributes.set("high_freq_factor", 4.0);
      attributes.set("original_max_position_embeddings", 8192.0);
    }
    return attributes;
  };
  std::vector<ValueRef> projections;  // q, k, v before their heads are split
  auto project = [&](ValueRef input, const std::string& name, std::int64_t heads) {
    ValueRef y = test_linear(builder, input, name, heads * shape.head_dim, shape.hidden, shape.format);
    if (shape.bias) y = builder.add(y, builder.input(name + ".c", TensorSpec({heads * shape.head_dim}, dtype)), name + ".y");
    projections.push_back(y);
    const ValueRef split = builder.reshape(y, {shape.rows, heads, shape.head_dim}, name + ".heads");
    return builder.transpose(split, {1, 0, 2}, name + ".by_head");
  };
  const ValueRef other = shape.v_from_other_input ? builder.input("a2", TensorSpec({shape.rows, shape.hidden}, dtype)) : x;
  const ValueRef q = project(x, "p0", shape.q_heads);
  const ValueRef k = project(x, "p1", shape.kv_heads);
  const ValueRef v = project(other, "p2", shape.kv_heads);
  const ValueRef q_rotated = builder.add_node("rope", {q, positions}, rope_attributes(shape.q_theta != 0 ? shape.q_theta : shape.theta), "q.rope").front();
  const ValueRef k_rotated = builder.add_node("rope", {k, positions}, rope_attributes(shape.theta), "k.rope").front();
  const TensorSpec cache({shape.kv_heads, shape.capacity, shape.head_dim}, dtype);
  const ValueRef k_all = builder.kv_cache_write(builder.input("k_cache", cache), k_rotated, positions, "k_cache_out");
  const ValueRef v_all = builder.kv_cache_write(builder.input("v_cache", cache), v, positions, "v_cache_out");
  std::vector<ValueRef> outputs = {q_rotated, k_all, v_all};
  if (shape.k_rope_escapes) outputs.push_back(k_rotated);
  if (shape.q_escapes) outputs.push_back(projections.front());
  return builder.build(outputs);
}

// The plan's first region of `rule`, or nullptr.
inline const FusionRegion* region_of_rule(const FusionPlan& plan, std::string_view rule) {
  for (const FusionRegion& region : plan.regions) {
    if (region.rule == rule) return &region;
    // A composed region (qkv_rope_kv_cache) holds the regions of its rules as parts.
    for (const FusionRegion& part : region.parts) {
      if (part.rule == rule) return &part;
    }
  }
  return nullptr;
}

}  // namespace metile::testing
