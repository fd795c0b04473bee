// Every op's native (unfused) kernel compiles with NVRTC for sm_90, across dtypes and row lengths
// that are and are not multiples of the 16-byte vector width. Contractions have no generated
// kernel (cuBLASLt runs them) but quantized_matmul's dequantization does.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "codegen_test_support.h"

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
  // 3 rows: a multiple of every vector width, one of none, and a short row.
  for (std::int64_t length : {64, 37}) {
    for (const OpCase& op : op_cases()) {
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
    ASSERT_EQ(kernel.parameters.size(), 4u);
    EXPECT_EQ(kernel.parameters[3].kind, KernelParameter::Kind::scratch);
    EXPECT_EQ(kernel.parameters[3].scratch_bytes, n * k * 2);
    SCOPED_TRACE(bits);
    expect_compiles_for_sm90(kernel);
  }
}

}  // namespace
}  // namespace metile
