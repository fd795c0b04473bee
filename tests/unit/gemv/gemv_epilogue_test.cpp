// Tests of GEMV epilogues: building them from a graph's elementwise ops (the SwiGLU and the
// residual add of a decode MLP, in either operand order), the host evaluation against values
// computed here by hand, the CUDA expression text, and the errors for what cannot be an epilogue.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "metile/gemv.h"
#include "metile/graph.h"

namespace metile {
namespace {

double silu(double x) { return x / (1 + std::exp(-x)); }

// x rounded to nearest, ties to even, with `bits` stored mantissa bits (bf16: 7, f16: 10), for
// normal values: the rounding an unfused op applies when it stores its result (an oracle written
// here, apart from the library's round_to_dtype).
double round_mantissa(double x, int bits) {
  if (x == 0) return x;
  const double unit = std::ldexp(1.0, std::ilogb(x) - bits);
  return std::nearbyint(x / unit) * unit;
}
double bf16(double x) { return round_mantissa(x, 7); }
double f16(double x) { return round_mantissa(x, 10); }

TEST(GemvEpilogue, SwigluFromGraphInEitherOperandOrder) {
  for (bool up_first : {false, true}) {
    GraphBuilder builder;
    auto x = builder.input("x", TensorSpec({1, 64}, DType::bf16));
    auto gate_weight = builder.input("gate_weight", TensorSpec({96, 64}, DType::bf16));
    auto up_weight = builder.input("up_weight", TensorSpec({96, 64}, DType::bf16));
    auto gate = builder.matmul(x, gate_weight, true, "gate");
    auto up = builder.matmul(x, up_weight, true, "up");
    auto activated = builder.silu(gate, "activated");
    auto hidden = up_first ? builder.multiply(up, activated, "hidden") : builder.multiply(activated, up, "hidden");
    const ComputeGraph graph = builder.build({hidden});
    const std::vector<ValueId> accumulators = {*graph.find_value("gate"), *graph.find_value("up")};
    const GemvEpilogue epilogue = GemvEpilogue::from_graph(graph, *graph.find_value("hidden"), accumulators);
    EXPECT_EQ(epilogue.product_count(), 2);
    EXPECT_TRUE(epilogue.tensor_inputs().empty());
    // gate, up and silu(gate) are bf16 values of the graph: each is rounded where it is read, as the
    // unfused ops store them; the product is the output (the store rounds it).
    const std::vector<double> values = {0.7, -1.3};
    const double expected = bf16(silu(bf16(0.7))) * bf16(-1.3);
    EXPECT_NE(expected, silu(0.7) * -1.3);
    EXPECT_DOUBLE_EQ(epilogue.evaluate(values, {}), expected);
    const std::string gate_text = "to_f32(from_f32(silu_f32(to_f32(from_f32(acc0)))))", up_text = "to_f32(from_f32(acc1))";
    EXPECT_EQ(epilogue.cuda_expression(),
              up_first ? "(" + up_text + " * " + gate_text + ")" : "(" + gate_text + " * " + up_text + ")");
    EXPECT_EQ(epilogue.to_string(), up_first ? "bf16(acc1) * bf16(silu(bf16(acc0)))" : "bf16(silu(bf16(acc0))) * bf16(acc1)");
  }
}

TEST(GemvEpilogue, F32GraphsRoundNothingOnTheWay) {
  GraphBuilder builder;
  auto x = builder.input("x", TensorSpec({1, 64}, DType::f32));
  auto gate = builder.matmul(x, builder.input("gate_weight", TensorSpec({96, 64}, DType::f32)), true, "gate");
  auto up = builder.matmul(x, builder.input("up_weight", TensorSpec({96, 64}, DType::f32)), true, "up");
  auto hidden = builder.multiply(builder.silu(gate, "activated"), up, "hidden");
  const ComputeGraph graph = builder.build({hidden});
  const std::vector<ValueId> accumulators = {*graph.find_value("gate"), *graph.find_value("up")};
  const GemvEpilogue epilogue = GemvEpilogue::from_graph(graph, *graph.find_value("hidden"), accumulators);
  EXPECT_EQ(epilogue.cuda_expression(), "(silu_f32(acc0) * acc1)");
  const std::vector<double> values = {0.7, -1.3};
  EXPECT_DOUBLE_EQ(epilogue.evaluate(values, {}), silu(0.7) * -1.3);
  EXPECT_THROW(GemvEpilogue::rounded(GemvEpilogue::accumulator(0), DType::f32), InputError);
  EXPECT_THROW(GemvEpilogue::rounded(GemvEpilogue::accumulator(0), DType::i8), InputError);
  EXPECT_THROW(GemvEpilogue::elementwise("causal_mask", {}, {GemvEpilogue::accumulator(0)}), InputError);
  EXPECT_THROW(GemvEpilogue::elementwise("silu", {}, {}), InputError);  // one operand, not none
  // A kernel rounds only to its own activation dtype: a bf16 GEMV with an f16 rounding is refused.
  GemvKernelConfig config;
  config.format = GemvWeightFormat::affine(4, 64, DType::bf16);
  config.out_features = 64;
  config.in_features = 256;
  config.epilogue = GemvEpilogue::swiglu(DType::f16);
  EXPECT_FALSE(config.epilogue.rounds_only_to(DType::bf16));
  EXPECT_THROW(generate_gemv_kernel(config), InputError);
  config.epilogue = GemvEpilogue::swiglu(DType::bf16);
  EXPECT_TRUE(config.epilogue.rounds_only_to(DType::bf16));
  EXPECT_EQ(config.epilogue.to_string(), "bf16(silu(bf16(acc0))) * bf16(acc1)");
  EXPECT_NO_THROW(generate_gemv_kernel(config));
}

TEST(GemvEpilogue, ResidualAndBroadcastTensorsFromGraph) {
  GraphBuilder builder;
  auto hidden = builder.input("hidden", TensorSpec({2, 32}, DType::f16));
  auto down_weight = builder.input("down_weight", TensorSpec({16, 32}, DType::f16));
  auto residual = builder.input("residual", TensorSpec({2, 16}, DType::f16));
  auto bias = builder.input("bias", TensorSpec({16}, DType::f16));
  auto down = builder.matmul(hidden, down_weight, true, "down");
  auto with_bias = builder.add(down, bias, "with_bias");
  auto scaled = builder.scale(with_bias, 0.5, "scaled");
  auto out = builder.add(residual, builder.gelu(scaled, "tanh", "activated"), "out");
  const ComputeGraph graph = builder.build({out});
  const std::vector<ValueId> accumulators = {*graph.find_value("down")};
  const GemvEpilogue epilogue = GemvEpilogue::from_graph(graph, *graph.find_value("out"), accumulators);
  const auto tensors = epilogue.tensor_inputs();
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors[0], (GemvEpilogue::TensorInput{"residual", false}));
  EXPECT_EQ(tensors[1], (GemvEpilogue::TensorInput{"bias", true}));
  // f16 values: down, with_bias, scaled and activated are each rounded to f16 (tensors are f16 already).
  const double acc = 1.2345678, residual_value = -0.5, bias_value = 0.25;
  const double inner = f16(f16(f16(acc) + bias_value) * 0.5);
  const double gelu = 0.5 * inner * (1 + std::tanh(std::sqrt(2 / 3.14159265358979323846) * (inner + 0.044715 * inner * inner * inner)));
  const std::vector<double> accumulator_values = {acc}, tensor_values = {residual_value, bias_value};
  EXPECT_NEAR(epilogue.evaluate(accumulator_values, tensor_values), residual_value + f16(gelu), 1e-15);
  EXPECT_EQ(epilogue.cuda_expression(),
            "(tensor_value0 + to_f32(from_f32(gelu_tanh_f32(to_f32(from_f32((to_f32(from_f32((to_f32(from_f32(acc0)) + "
            "tensor_value1))) * 0.5f)))))))");
}

TEST(GemvEpilogue, RejectsOpsAndShapesAnEpilogueCannotTake) {
  GraphBuilder builder;
  auto x = builder.input("x", TensorSpec({1, 32}, DType::bf16));
  auto weight = builder.input("weight", TensorSpec({16, 32}, DType::bf16));
  auto norm_weight = builder.input("norm_weight", TensorSpec({16}, DType::bf16));
  auto narrow_weight = builder.input("narrow_weight", TensorSpec({8, 32}, DType::bf16));
  auto product = builder.matmul(x, weight, true, "product");
  auto masked = builder.causal_mask(product, 0, "masked");
  auto normalized = builder.rms_norm(product, norm_weight, 1e-5, "normalized");
  auto combined = builder.add(normalized, product, "combined");
  auto narrow = builder.matmul(x, narrow_weight, true, "narrow");
  const ComputeGraph graph = builder.build({masked, combined, narrow});
  const std::vector<ValueId> accumulators = {*graph.find_value("product")};
  // A row reduction is computed elsewhere: the epilogue reads its result as a tensor.
  const GemvEpilogue through_norm = GemvEpilogue::from_graph(graph, *graph.find_value("combined"), accumulators);
  ASSERT_EQ(through_norm.tensor_inputs().size(), 1u);
  EXPECT_EQ(through_norm.tensor_inputs().front().name, "normalized");
  EXPECT_EQ(through_norm.to_string(), "(normalized + bf16(acc0))");
  try {
    GemvEpilogue::from_graph(graph, *graph.find_value("masked"), accumulators);
    FAIL() << "causal_mask was accepted as an epilogue op";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("node 'masked' (causal_mask)"), std::string::npos) << error.what();
  }
  try {
    GemvEpilogue::from_graph(graph, *graph.find_value("narrow"), accumulators);
    FAIL() << "an [1, 8] output was accepted for a [1, 16] GEMV";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("output 'narrow'"), std::string::npos) << error.what();
  }
  EXPECT_THROW(GemvEpilogue::accumulator(2), InputError);
  EXPECT_THROW(GemvEpilogue::constant(NAN), InputError);
}

TEST(GemvEpilogue, ComposesWithoutTouchingTheMainloop) {
  // Same mainloop config, three epilogues: the generated sources differ only after the
  // mainloop text, in the store function (struct Outputs, store_output), the kernel's parameters
  // and the store expression.
  GemvKernelConfig config;
  config.format = GemvWeightFormat::affine(4, 64, DType::bf16);
  config.rows = 1;
  config.out_features = 64;
  config.in_features = 256;
  std::vector<std::string> sources;
  for (const GemvEpilogue& epilogue : {GemvEpilogue::store(), GemvEpilogue::residual_add(),
                                       GemvEpilogue::scale(GemvEpilogue::silu(GemvEpilogue::accumulator(0)), 2.0)}) {
    config.epilogue = epilogue;
    sources.push_back(generate_gemv_kernel(config).source);
  }
  // The first line names the config (epilogue included); the mainloop runs up to the store function.
  auto mainloop_text = [](const std::string& source) {
    const std::size_t start = source.find('\n');
    const std::size_t end = source.find("struct Outputs {");
    EXPECT_LT(end, source.find("extern \"C\" __global__"));
    return source.substr(start, end - start);
  };
  const std::string first = mainloop_text(sources[0]);
  EXPECT_GT(first.size(), 5000u);
  for (const std::string& source : sources) EXPECT_TRUE(mainloop_text(source) == first);
  EXPECT_NE(sources[1].find("from_f32((acc0 + tensor_value0))"), std::string::npos);
  EXPECT_NE(sources[2].find("from_f32((silu_f32(acc0) * 2.0f))"), std::string::npos);
}

}  // namespace
}  // namespace metile
