// Decode-time graphs for the GEMV lowerings' tests (tests/unit/dispatch, tests/gpu): a SwiGLU
// MLP and a single projection, dense or MLX affine, with value names that say nothing about the
// roles (the lowerings must read the regions' roles, not names) and, where asked, the operands
// of the multiply and the residual add the other way round.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace metile::testing
