// Every op's native (unfused) kernel compiles with NVRTC for sm_90, across dtypes and row lengths
// that are and are not multiples of the 16-byte vector width. Contractions have no generated
// kernel (cuBLASLt runs them) but quantized_matmul's dequantization does.
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <limits>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "codegen_test_support.h"
#include "gemv_region_graphs.h"

namespace metile {
namespace {

using testing_support::expect_compiles_for_sm90;

struct OpCase {
  std::string name;
  std::function<ValueRef(GraphBuilder&, ValueRef x, DType dtype, std::int64_t length)> build;
};

std::vector<OpCase> op_cases() {
  return {
      {"add", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.add(x, x, "out"); }},
      {"subtract_broadcast",
       [](GraphBuilder& b, ValueRef x, DType dtype, std::int64_t length) {
         return b.subtract(x, b.input("row", {{length}, dtype}), "out");
       }},
      {"multiply_broadcast",
       [](GraphBuilder& b, ValueRef x, DType dtype, std::int64_t length) {
         return b.multiply(x, b.input("row", {{length}, dtype}), "out");
       }},
      {"scale", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.scale(x, -0.5, "out"); }},
      {"silu", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.silu(x, "out"); }},
      {"gelu", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.gelu(x, "none", "out"); }},
      {"gelu_tanh", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.gelu(x, "tanh", "out"); }},
      {"exp", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.exp(x, "out"); }},
      {"rms_norm",
       [](GraphBuilder& b, ValueRef x, DType dtype, std::int64_t length) {
         return b.rms_norm(x, b.input("weight", {{length}, dtype}), 1e-6, "out");
       }},
      {"layer_norm",
       [](GraphBuilder& b, ValueRef x, DType dtype, std::int64_t length) {
         return b.layer_norm(x, b.input("weight", {{length}, dtype}), b.input("bias", {{length}, dtype}), 1e-5, "out");
       }},
      {"softmax", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.softmax(x, -1, "out"); }},
      {"causal_mask", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.causal_mask(x, 1, "out"); }},
      // The offset's literal at both ends of int64 ("-9223372036854775808LL" alone is not C++).
      {"causal_mask_int64_min",
       [](GraphBuilder& b, ValueRef x, DType, std::int64_t) {
         return b.causal_mask(x, std::numeric_limits<std::int64_t>::min(), "out");
       }},
      {"causal_mask_int64_max",
       [](GraphBuilder& b, ValueRef x, DType, std::int64_t) {
         return b.causal_mask(x, std::numeric_limits<std::int64_t>::max(), "out");
       }},
      {"cast", [](GraphBuilder& b, ValueRef x, DType dtype, std::int64_t) {
         return b.cast(x, dtype == DType::f32 ? DType::bf16 : DType::f32, "out");
       }},
      {"reshape", [](GraphBuilder& b, ValueRef x, DType, std::int64_t length) { return b.reshape(x, {3 * length}, "out"); }},
      {"transpose", [](GraphBuilder& b, ValueRef x, DType, std::int64_t) { return b.transpose(x, {1, 0}, "out"); }},
      {"rope",
       [](GraphBuilder& b, ValueRef x, DType, std::int64_t length) {
         return b.rope(x, b.input("positions", {{3}, DType::i32}), 10000.0, length - length % 2, "out");
       }},
  };
}

class NativeKernelCodegen : public ::testing::TestWithParam<DType> {};

TEST_P(NativeKernelCodegen, EveryOpCompilesForSm90) {
  const DType dtype = GetParam();
  // 3 rows: a multiple of every vector width, one of none, and rows of one element (a sum over them left
  // an unused row pointer, an NVRTC warning).
  for (std::int64_t length : {64, 37, 1}) {
    for (const OpCase& op : op_cases()) {
      if (op.name == "rope" && length < 2) continue;  // rotates pairs
      GraphBuilder builder;
      auto x = builder.input("x", {{3, length}, dtype});
      auto out = op.build(builder, x, dtype, length);
      const ComputeGraph graph = builder.build({out});
      const NodeId node = graph.value(out.id).producer;
      const GeneratedKernel kernel = generate_node_kernel(graph, node);
      SCOPED_TRACE(op.name + " " + std::string(dtype_name(dtype)) + " length " + std::to_string(length));
      EXPECT_EQ(kernel.kernel_name, "metile_native_out");
      EXPECT_NE(kernel.source.find("extern \"C\" __global__"), std::string::npos);
      EXPECT_GT(kernel.launch.grid_x * kernel.launch.block_x, 0u);
      expect_compiles_for_sm90(kernel);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NativeKernelCodegen, ::testing::Values(DType::f16, DType::bf16, DType::f32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(NativeKernelCodegenDequantize, FourAndEightBitCompile) {
  for (int bits : {4, 8}) {
    GraphBuilder builder;
    const std::int64_t n = 48;
    const std::int64_t k = 256;
    const int group = 64;
    auto x = builder.input("x", {{2, k}, DType::bf16});
    auto packed = builder.input("packed", {{n, k * bits / 32}, DType::u32});
    auto scales = builder.input("scales", {{n, k / group}, DType::bf16});
    auto biases = builder.input("biases", {{n, k / group}, DType::bf16});
    auto y = builder.quantized_matmul(x, packed, scales, biases, bits, group, "y");
    const ComputeGraph graph = builder.build({y});
    const GeneratedKernel kernel = generate_dequantize_kernel(graph, graph.value(y.id).producer);
    // packed, scales, biases, x; then the weights as hi and lo ([N, 2K] bf16) and x twice ([2, 2K]).
    ASSERT_EQ(kernel.parameters.size(), 6u);
    EXPECT_EQ(kernel.parameters[3].value, x.id);
    EXPECT_EQ(kernel.parameters[4].kind, KernelParameter::Kind::scratch);
    EXPECT_EQ(kernel.parameters[4].scratch_bytes, n * 2 * k * 2);
    EXPECT_EQ(kernel.parameters[5].kind, KernelParameter::Kind::scratch);
    EXPECT_EQ(kernel.parameters[5].scratch_bytes, 2 * 2 * k * 2);
    EXPECT_NE(kernel.source.find("kSplit = true"), std::string::npos);
    // f32 activations: the weights as computed, [N, K], and x read in place (the second scratch unused).
    GraphBuilder wide;
    auto x32 = wide.input("x", {{2, k}, DType::f32});
    auto y32 = wide.quantized_matmul(x32, wide.input("packed", {{n, k * bits / 32}, DType::u32}),
                                     wide.input("scales", {{n, k / group}, DType::f32}),
                                     wide.input("biases", {{n, k / group}, DType::f32}), bits, group, "y");
    const ComputeGraph graph32 = wide.build({y32});
    const GeneratedKernel kernel32 = generate_dequantize_kernel(graph32, graph32.value(y32.id).producer);
    ASSERT_EQ(kernel32.parameters.size(), 6u);
    EXPECT_EQ(kernel32.parameters[4].scratch_bytes, n * k * 4);
    EXPECT_EQ(kernel32.parameters[5].scratch_bytes, 4);
    EXPECT_NE(kernel32.source.find("kSplit = false"), std::string::npos);
    expect_compiles_for_sm90(kernel32);
    SCOPED_TRACE(bits);
    expect_compiles_for_sm90(kernel);
  }
}

}  // namespace
}  // namespace metile

namespace metile {
namespace {

// The decode step's ops (src/model/step_graph.cpp): embedding, quantized_embedding (4 and 8 bit),
// position_mask, kv_cache_write copied and in place, rope with Llama 3 scaling, argmax (greedy
// decoding's next tokens), in every float dtype.
TEST(NativeKernelCodegenDecodeStep, EveryDecodeStepKernelCompilesForSm90) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    GraphBuilder b;
    auto ids = b.input("ids", {{3}, DType::i32});
    auto positions = b.input("positions", {{3}, DType::i32});
    std::vector<ValueRef> outputs = {b.embedding(ids, b.input("table", {{50, 64}, dtype}), "embedded")};
    for (int bits : {4, 8}) {
      outputs.push_back(b.quantized_embedding(ids, b.input(fmt::format("packed{}", bits), {{50, 64 * bits / 32}, DType::u32}),
                                              b.input(fmt::format("scales{}", bits), {{50, 2}, dtype}),
                                              b.input(fmt::format("biases{}", bits), {{50, 2}, dtype}), bits, 32,
                                              fmt::format("quantized{}", bits)));
    }
    outputs.push_back(b.position_mask(b.input("scores", {{2, 6, 10}, dtype}), positions, "masked"));
    auto cache = b.input("cache", {{2, 10, 8}, dtype});
    outputs.push_back(b.kv_cache_write(cache, b.input("update", {{2, 3, 8}, dtype}), positions, "written"));
    Attributes scaled;
    scaled.set("theta", 500000.0);
    scaled.set("scaling", std::string("llama3"));
    scaled.set("factor", 8.0);
    scaled.set("low_freq_factor", 1.0);
    scaled.set("high_freq_factor", 4.0);
    scaled.set("original_max_position_embeddings", 8192.0);
    outputs.push_back(b.add_node("rope", {b.input("x", {{2, 3, 16}, dtype}), positions}, scaled, "rotated").front());
    outputs.push_back(b.argmax(b.input("logits", {{3, 1001}, dtype}), "next_tokens"));
    const ComputeGraph graph = b.build(outputs);
    for (const Node& node : graph.nodes()) {
      SCOPED_TRACE(node.name);
      const GeneratedKernel kernel = generate_node_kernel(graph, node.id);
      EXPECT_EQ(kernel.parameters.size(), node.inputs.size() + 1);
      expect_compiles_for_sm90(kernel);
      if (node.op == "kv_cache_write") {
        const GeneratedKernel in_place = generate_kv_cache_write_kernel(graph, node.id, true);
        EXPECT_EQ(in_place.parameters.size(), 3u);  // update, positions, out: the cache is the output
        EXPECT_EQ(in_place.launch.grid_x * in_place.launch.block_x, 256u);  // 2 * 3 * 8 rows' elements
        expect_compiles_for_sm90(in_place);
      }
      if (node.op == "rope") {
        EXPECT_NE(kernel.summary.find("llama3"), std::string::npos);
      }
      if (node.op == "argmax") {
        EXPECT_EQ(kernel.launch.grid_x, 3u);  // one block per row
        EXPECT_NE(kernel.source.find("int* __restrict__ out0"), std::string::npos);
      }
    }
  }
}

}  // namespace
}  // namespace metile

namespace metile {
namespace {

// The rope_kv_cache region's kernel (rope on q and k, both cache writes), with each cache in place
// and copied, Llama 3 scaling or not, one step and a prefill chunk, in every float dtype.
TEST(NativeKernelCodegenDecodeStep, RopeKvCacheKernelCompilesForSm90) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (std::int64_t rows : {1, 16}) {
      testing::AttentionInputsShape shape;
      shape.rows = rows, shape.llama3_scaling = rows == 1, shape.format.dtype = dtype;
      const ComputeGraph graph = testing::attention_inputs_test_graph(shape);
      const FusionPlan plan = plan_graph_fusion(graph);
      const FusionRegion* region = testing::region_of_rule(plan, "rope_kv_cache");
      ASSERT_NE(region, nullptr) << plan.explain();
      const RopeCacheRegion problem = rope_cache_region(graph, *region);
      ASSERT_TRUE(problem.decision) << problem.decision.reason;
      EXPECT_EQ(problem.q_heads, 4);
      EXPECT_EQ(problem.kv_heads, 2);
      EXPECT_EQ(problem.steps, rows);
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(fmt::format("{} rows {} {}", dtype_name(dtype), rows, in_place ? "in place" : "copied"));
        const GeneratedKernel kernel = generate_rope_cache_kernel(graph, problem, in_place, in_place);
        ASSERT_EQ(kernel.parameters.size(), 9u);
        // A thread per unit: q's rotated pairs, k's (in place) or k's whole cache (copied, element
        // by element), v's new rows (in place) or whole cache (copied); no grid-stride loop at these sizes.
        const std::int64_t pairs = shape.head_dim / 2;  // dims = head_dim: every unit a pair
        const std::int64_t units = 4 * rows * pairs + (in_place ? 2 * rows * pairs : 2 * shape.capacity * shape.head_dim) +
                                   2 * (in_place ? rows : shape.capacity) * shape.head_dim;
        EXPECT_NE(kernel.source.find("kQUnits + kKUnits + kVItems"), std::string::npos);
        EXPECT_NE(kernel.source.find("metile_rope_pair(row, j, position, low, high)"), std::string::npos);
        EXPECT_EQ(kernel.source.find("__constant__"), std::string::npos) << "the frequencies are a global table";
        EXPECT_EQ(kernel.launch.block_x, 128u);
        EXPECT_EQ(static_cast<std::int64_t>(kernel.launch.grid_x), (units + 127) / 128);
        EXPECT_EQ(kernel.source.find("q.rope"), std::string::npos) << "no value name in the source";
        EXPECT_EQ(kernel.source.find("k_cache_out"), std::string::npos) << "no value name in the source";
        expect_compiles_for_sm90(kernel);
      }
    }
  }
  // A region that is not the three chains is refused with why.
  testing::AttentionInputsShape shape;
  const ComputeGraph graph = testing::attention_inputs_test_graph(shape);
  FusionRegion rope_only = region_of_nodes(graph, {*graph.find_node("q.rope")}, "rope_kv_cache");
  const RopeCacheRegion refused = rope_cache_region(graph, rope_only);
  EXPECT_FALSE(refused.decision);
  EXPECT_NE(refused.decision.reason.find("binds no role 'q'"), std::string::npos) << refused.decision.reason;
  shape.rows = 16, shape.capacity = 8;
  const ComputeGraph short_cache = testing::attention_inputs_test_graph(shape);
  const FusionPlan plan = plan_graph_fusion(short_cache);
  const FusionRegion* short_region = testing::region_of_rule(plan, "rope_kv_cache");
  ASSERT_NE(short_region, nullptr) << plan.explain();
  const RopeCacheRegion too_short = rope_cache_region(short_cache, *short_region);
  EXPECT_NE(too_short.decision.reason.find("the caches hold 8 rows, fewer than the step's 16 tokens"), std::string::npos)
      << too_short.decision.reason;
}

// Value names stand in comments of the generated source and nowhere else: a name holding "*/" closed a
// /* */ parameter comment and the rest of it was compiled (the native reshape and dequantize kernels failed
// to compile), and one ending in '\\' commented out the fused row kernel's next line (a load, a store) with
// only a warning. With such names every kernel compiles without a warning, and its code, comments and
// kernel names aside, is the code of the same graph with plain names.
std::string code_without_comments(const GeneratedKernel& kernel) {
  std::string code;
  const std::string& text = kernel.source;
  for (std::size_t at = 0; at < text.size();) {
    if (text.compare(at, 2, "//") == 0) {
      at = text.find('\n', at);
      if (at == std::string::npos) break;
    } else if (text.compare(at, 2, "/*") == 0) {
      at = text.find("*/", at + 2);
      if (at == std::string::npos) break;
      at += 2;
    } else {
      code += text[at++];
    }
  }
  for (auto found = code.find(kernel.kernel_name); found != std::string::npos; found = code.find(kernel.kernel_name, found)) {
    code.replace(found, kernel.kernel_name.size(), "KERNEL");
  }
  return code;
}

TEST(NativeKernelCodegenNames, NamesInCommentsNeverReachTheCode) {
  struct Kernels {
    std::vector<GeneratedKernel> kernels;
  };
  const auto build = [](const std::vector<std::string>& names) {
    GraphBuilder builder;
    auto x = builder.input(names[0], {{3, 64}, DType::bf16});
    auto weight = builder.input(names[1], {{64}, DType::bf16});
    auto summed = builder.add(x, x, names[2]);
    auto normed = builder.rms_norm(summed, weight, 1e-6, names[3]);
    auto flat = builder.reshape(normed, {192}, names[4]);
    auto packed = builder.input(names[5], {{16, 64 * 4 / 32}, DType::u32});
    auto scales = builder.input(names[6], {{16, 1}, DType::bf16});
    auto biases = builder.input(names[7], {{16, 1}, DType::bf16});
    auto y = builder.quantized_matmul(normed, packed, scales, biases, 4, 64, names[8]);
    const ComputeGraph graph = builder.build({flat, y});
    std::vector<GeneratedKernel> kernels;
    FusionRegion region;
    region.rule = "residual_add_rms_norm";
    region.nodes = {graph.value(summed.id).producer, graph.value(normed.id).producer};
    region.inputs = {x.id, weight.id};
    region.outputs = {normed.id};
    kernels.push_back(generate_region_kernel(graph, region));
    for (const ValueRef value : {summed, normed, flat}) kernels.push_back(generate_node_kernel(graph, graph.value(value.id).producer));
    kernels.push_back(generate_dequantize_kernel(graph, graph.value(y.id).producer));
    return kernels;
  };
  const std::vector<GeneratedKernel> plain = build({"x", "w", "s", "n", "f", "p", "c", "b", "y"});
  const std::vector<GeneratedKernel> hostile =
      build({"x*/ #error", "w\\", "s?\?/", "n/*", "f */ }", "p\\", "c*", "/b", "y*/\\"});
  ASSERT_EQ(plain.size(), hostile.size());
  for (std::size_t index = 0; index < plain.size(); ++index) {
    SCOPED_TRACE(plain[index].summary);
    EXPECT_EQ(code_without_comments(hostile[index]), code_without_comments(plain[index]));
    expect_compiles_for_sm90(hostile[index]);
  }
}

}  // namespace
}  // namespace metile

namespace metile {
namespace {

// The runtime's own kernels (L2 prefetch, read floors, the greedy link, sampling's top-k) are written
// in src/runtime/cuda/cuda_device.cpp, not generated: each compiles for sm_90 without a warning.
TEST(RuntimeKernels, EveryRuntimeKernelCompilesForSm90) {
  const auto sources = runtime_kernel_sources();
  ASSERT_GE(sources.size(), 4u);
  for (const auto& [name, source] : sources) {
    GeneratedKernel kernel;
    kernel.kernel_name = std::string(name);
    kernel.source = std::string(source);
    kernel.summary = std::string(name);
    ASSERT_NE(kernel.source.find(kernel.kernel_name + "("), std::string::npos) << name;
    testing_support::expect_compiles_for_sm90(kernel);
  }
}

}  // namespace
}  // namespace metile
