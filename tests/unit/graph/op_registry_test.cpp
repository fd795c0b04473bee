// The op registry: every op of the op table (docs/architecture.md) is registered with its kind,
// infers the output spec a person would compute by hand, canonicalises its
// attributes, and rejects bad shapes/attributes with a precise message.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "metile/graph.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using Shape = std::vector<std::int64_t>;

TensorSpec spec(Shape shape, DType dtype = DType::f16) { return TensorSpec(std::move(shape), dtype); }

std::vector<TensorSpec> infer(std::string_view op, std::vector<TensorSpec> inputs, Attributes& attributes) {
  const OpDefinition* definition = find_op(op);
  if (definition == nullptr) throw std::logic_error("no op " + std::string(op));
  return definition->infer(inputs, attributes);
}

TensorSpec infer_one(std::string_view op, std::vector<TensorSpec> inputs, Attributes attributes = {}) {
  std::vector<TensorSpec> outputs = infer(op, std::move(inputs), attributes);
  EXPECT_EQ(outputs.size(), 1u);
  return outputs.front();
}

std::string infer_error(std::string_view op, std::vector<TensorSpec> inputs, Attributes attributes = {}) {
  return testing::error_of([&] { infer(op, std::move(inputs), attributes); });
}

Attributes attrs(std::initializer_list<std::pair<const char*, AttributeValue>> entries) {
  Attributes attributes;
  for (const auto& [name, value] : entries) attributes.set(name, value);
  return attributes;
}

TEST(OpRegistryTest, EveryDesignOpIsRegisteredWithItsKind) {
  const std::vector<std::pair<std::string_view, OpKind>> expected{
      {"add", OpKind::elementwise},          {"subtract", OpKind::elementwise},   {"multiply", OpKind::elementwise},
      {"scale", OpKind::elementwise},        {"silu", OpKind::elementwise},       {"gelu", OpKind::elementwise},
      {"exp", OpKind::elementwise},          {"causal_mask", OpKind::elementwise}, {"rms_norm", OpKind::row_reduction},
      {"layer_norm", OpKind::row_reduction}, {"softmax", OpKind::row_reduction}, {"sum", OpKind::row_reduction},
      {"mean", OpKind::row_reduction},       {"matmul", OpKind::contraction},
      {"quantized_matmul", OpKind::contraction}, {"rope", OpKind::layout},       {"reshape", OpKind::layout},
      {"transpose", OpKind::layout},         {"cast", OpKind::layout},
      // the decode-step ops of src/model
      {"embedding", OpKind::layout},         {"quantized_embedding", OpKind::layout},
      {"position_mask", OpKind::layout},     {"kv_cache_write", OpKind::layout},
      {"flash_attention", OpKind::contraction},
      // greedy decoding's next token: an index, not a value, so not a row reduction
      {"argmax", OpKind::layout}};
  for (const auto& [name, kind] : expected) {
    const OpDefinition* definition = find_op(name);
    ASSERT_NE(definition, nullptr) << name;
    EXPECT_EQ(definition->name, name);
    EXPECT_EQ(definition->kind, kind) << name;
  }
  EXPECT_EQ(registered_op_names().size(), expected.size());
  EXPECT_EQ(find_op("conv2d"), nullptr);
  EXPECT_EQ(find_op("quantized_matmul")->input_names, (std::vector<std::string_view>{"x", "packed", "scales", "biases"}));
  EXPECT_EQ(op_kind_name(OpKind::row_reduction), "row_reduction");
}

// The f32 constants written into generated CUDA: a value the kernel reads back as the double
// rounded to f32 (random doubles over f32's range, the oracle the f32 cast), and the values past
// f32's range, inf and NaN as bit patterns (a finite 1e39 once printed "inf.0f", not CUDA).
TEST(OpRegistryTest, CudaFloatLiteralsAreTheValueRoundedToF32) {
  std::mt19937_64 generator(testing::test_seed("cuda float literals"));
  std::uniform_real_distribution<double> exponent(-40, 38.5), sign(-1, 1);
  for (int trial = 0; trial < 2000; ++trial) {
    const double value = std::copysign(std::pow(10.0, exponent(generator)), sign(generator));
    const std::string literal = cuda_float_literal(value);
    ASSERT_EQ(literal.back(), 'f') << literal;
    ASSERT_EQ(std::strtof(literal.substr(0, literal.size() - 1).c_str(), nullptr), static_cast<float>(value))
        << value << " -> " << literal;
  }
  EXPECT_EQ(cuda_float_literal(1e39), "__int_as_float(0x7f800000)");
  EXPECT_EQ(cuda_float_literal(-1e300), "__int_as_float(0xff800000)");
  EXPECT_EQ(cuda_float_literal(std::numeric_limits<double>::infinity()), "__int_as_float(0x7f800000)");
  EXPECT_EQ(cuda_float_literal(std::nan("")), "__int_as_float(0x7fc00000)");
  EXPECT_EQ(cuda_float_literal(2.0), "2.0f");
}

TEST(OpRegistryTest, BinaryOpsBroadcastASuffixOnly) {
  for (std::string_view op : {"add", "subtract", "multiply"}) {
    EXPECT_EQ(infer_one(op, {spec({4, 8}), spec({4, 8})}), spec({4, 8}));
    EXPECT_EQ(infer_one(op, {spec({2, 4, 8}), spec({8})}), spec({2, 4, 8}));
    EXPECT_EQ(infer_one(op, {spec({2, 4, 8}), spec({4, 8})}), spec({2, 4, 8}));
    EXPECT_EQ(infer_one(op, {spec({2, 4, 8}), spec({})}), spec({2, 4, 8}));
  }
  EXPECT_EQ(infer_error("add", {spec({1, 2048}), spec({1024})}),
            "b f16[1024] does not broadcast against a f16[1, 2048] (b's shape must be a suffix of a's, or [])");
  EXPECT_EQ(infer_error("add", {spec({8}), spec({4, 8})}),
            "b f16[4, 8] does not broadcast against a f16[8] (b's shape must be a suffix of a's, or [])");
  EXPECT_EQ(infer_error("multiply", {spec({4, 8}), spec({4, 8}, DType::bf16)}),
            "b bf16[4, 8] must have the dtype of a f16[4, 8]");
  EXPECT_EQ(infer_error("add", {spec({4}, DType::i32), spec({4}, DType::i32)}),
            "a i32[4] must have a floating dtype (f16, bf16 or f32)");
  EXPECT_EQ(infer_error("add", {spec({4}), spec({4})}, attrs({{"alpha", 2.0}})),
            "unknown attribute 'alpha' (this op takes none)");
}

TEST(OpRegistryTest, UnaryOps) {
  for (std::string_view op : {"silu", "exp"}) EXPECT_EQ(infer_one(op, {spec({3, 5}, DType::bf16)}), spec({3, 5}, DType::bf16));
  Attributes scale = attrs({{"factor", std::int64_t{2}}});
  EXPECT_EQ(infer("scale", {spec({3})}, scale).front(), spec({3}));
  EXPECT_EQ(scale.entries().at("factor"), AttributeValue(2.0)) << "factor is stored as a double";
  EXPECT_EQ(infer_error("scale", {spec({3})}), "missing attribute 'factor'");
  EXPECT_EQ(infer_error("scale", {spec({3})}, attrs({{"factor", std::string("two")}})),
            "attribute 'factor' must be a number, got a string");
  EXPECT_EQ(infer_error("scale", {spec({3})}, attrs({{"factor", INFINITY}})), "attribute 'factor' must be finite");
  EXPECT_EQ(infer_error("scale", {spec({3})}, attrs({{"factor", 1e39}})),
            "factor 1e+39 is beyond f32's range (scale multiplies in f32)");
  // A factor that is 0 only in f32 zeroed every finite element (1e30 · 1e-50 is an f32 value); 0 itself
  // and a subnormal f32 factor are taken.
  EXPECT_EQ(infer_error("scale", {spec({3})}, attrs({{"factor", 1e-50}})), "factor 1e-50 is 0 in f32 (scale multiplies in f32)");
  for (const double factor : {0.0, -0.0, 1e-45}) EXPECT_EQ(infer_one("scale", {spec({3})}, attrs({{"factor", factor}})), spec({3}));
  Attributes gelu;
  infer("gelu", {spec({3})}, gelu);
  EXPECT_EQ(gelu.get_string("approximate"), "none");
  EXPECT_EQ(infer_one("gelu", {spec({3})}, attrs({{"approximate", std::string("tanh")}})), spec({3}));
  EXPECT_EQ(infer_error("gelu", {spec({3})}, attrs({{"approximate", std::string("erf")}})),
            "approximate must be 'none' or 'tanh', got 'erf'");
}

TEST(OpRegistryTest, Normalisations) {
  EXPECT_EQ(infer_one("rms_norm", {spec({2, 7, 64}), spec({64})}, attrs({{"eps", 1e-5}})), spec({2, 7, 64}));
  EXPECT_EQ(infer_one("layer_norm", {spec({7, 64}), spec({64}), spec({64})}, attrs({{"eps", 1e-6}})), spec({7, 64}));
  EXPECT_EQ(infer_error("rms_norm", {spec({1, 2048}), spec({1024})}, attrs({{"eps", 1e-5}})),
            "weight f16[1024] does not match the last axis of x f16[1, 2048] (expected [2048])");
  EXPECT_EQ(infer_error("rms_norm", {spec({1, 2048}), spec({1, 2048})}, attrs({{"eps", 1e-5}})),
            "weight f16[1, 2048] does not match the last axis of x f16[1, 2048] (expected [2048])");
  EXPECT_EQ(infer_error("rms_norm", {spec({8}), spec({8})}, attrs({{"eps", 0.0}})), "eps must be positive, got 0");
  EXPECT_EQ(infer_error("rms_norm", {spec({8}), spec({8})}, attrs({{"eps", -1e-5}})),
            "eps must be positive, got -1e-05");
  EXPECT_EQ(infer_error("rms_norm", {spec({8}), spec({8})}), "missing attribute 'eps'");
  // eps must be a normal f32 (the kernels add it in f32): 1e-80 made a row of zeros NaN (the true result is 0).
  for (std::string_view op : {"rms_norm", "layer_norm"}) {
    const std::vector<TensorSpec> inputs =
        op == "rms_norm" ? std::vector<TensorSpec>{spec({8}), spec({8})} : std::vector<TensorSpec>{spec({8}), spec({8}), spec({8})};
    EXPECT_EQ(infer_error(op, inputs, attrs({{"eps", 1e-80}})),
              "eps 1e-80 is outside f32's normal range (1.17549e-38 .. 3.40282e+38): the norm adds it in f32");
    EXPECT_EQ(infer_error(op, inputs, attrs({{"eps", 1e39}})),
              "eps 1e+39 is outside f32's normal range (1.17549e-38 .. 3.40282e+38): the norm adds it in f32");
    EXPECT_EQ(infer_one(op, inputs, attrs({{"eps", static_cast<double>(std::numeric_limits<float>::min())}})), spec({8}));
  }
  EXPECT_EQ(infer_error("rms_norm", {spec({8}), spec({8})}, attrs({{"epsilon", 1e-5}})),
            "unknown attribute 'epsilon' (allowed: eps)");
  EXPECT_EQ(infer_error("layer_norm", {spec({4, 8}), spec({8}), spec({8}, DType::f32)}, attrs({{"eps", 1e-5}})),
            "bias f32[8] must have the dtype of x f16[4, 8]");
  EXPECT_EQ(infer_error("rms_norm", {spec({}), spec({})}, attrs({{"eps", 1e-5}})), "x f16[] must have rank 1 or more");
}

TEST(OpRegistryTest, SumAndMeanShortenTheLastAxisToOne) {
  for (std::string_view op : {"sum", "mean"}) {
    EXPECT_EQ(infer_one(op, {spec({2, 7, 64})}), spec({2, 7, 1}));
    EXPECT_EQ(infer_one(op, {spec({5}, DType::f32)}), spec({1}, DType::f32));
    EXPECT_EQ(infer_error(op, {spec({})}), "x f16[] must have rank 1 or more");
    EXPECT_EQ(infer_error(op, {spec({3, 0})}), "x f16[3, 0] has empty rows");
    EXPECT_EQ(infer_error(op, {spec({3, 4}, DType::i32)}), "x i32[3, 4] must have a floating dtype (f16, bf16 or f32)");
    EXPECT_EQ(infer_error(op, {spec({4})}, attrs({{"axis", std::int64_t{0}}})), "unknown attribute 'axis' (this op takes none)");
  }
}

TEST(OpRegistryTest, SoftmaxAxisIsNormalisedAndDecidesTheKind) {
  const OpDefinition& softmax = *find_op("softmax");
  Attributes last;
  const std::vector<TensorSpec> inputs{spec({2, 3, 4})};
  EXPECT_EQ(softmax.infer(inputs, last).front(), spec({2, 3, 4}));
  EXPECT_EQ(last.get_int("axis"), 2);
  EXPECT_EQ(op_kind_for(softmax, inputs, last), OpKind::row_reduction);
  Attributes middle = attrs({{"axis", std::int64_t{-2}}});
  softmax.infer(inputs, middle);
  EXPECT_EQ(middle.get_int("axis"), 1);
  EXPECT_EQ(op_kind_for(softmax, inputs, middle), OpKind::layout);
  EXPECT_EQ(infer_error("softmax", {spec({2, 3, 4})}, attrs({{"axis", std::int64_t{3}}})),
            "axis 3 is out of range for x f16[2, 3, 4]");
  EXPECT_EQ(infer_error("softmax", {spec({2, 3, 4})}, attrs({{"axis", std::int64_t{-4}}})),
            "axis -4 is out of range for x f16[2, 3, 4]");
  EXPECT_EQ(op_kind_for(*find_op("add"), {}, Attributes{}), OpKind::elementwise);
}

TEST(OpRegistryTest, CausalMask) {
  Attributes attributes;
  EXPECT_EQ(infer("causal_mask", {spec({8, 8, 8})}, attributes).front(), spec({8, 8, 8}));
  EXPECT_EQ(attributes.get_int("offset"), 0);
  EXPECT_EQ(infer_one("causal_mask", {spec({4, 12})}, attrs({{"offset", std::int64_t{8}}})), spec({4, 12}));
  EXPECT_EQ(infer_error("causal_mask", {spec({8})}), "x f16[8] must have rank 2 or more");
  EXPECT_EQ(infer_error("causal_mask", {spec({8, 8})}, attrs({{"offset", 0.5}})),
            "attribute 'offset' must be an integer, got a number");
}

TEST(OpRegistryTest, PositionMask) {
  const TensorSpec positions = spec({4}, DType::i32);
  EXPECT_EQ(infer_one("position_mask", {spec({2, 8, 16}), positions}), spec({2, 8, 16}));  // 8 rows = 2 groups of 4
  EXPECT_EQ(infer_error("position_mask", {spec({2, 6, 16}), positions}),
            "positions i32[4] must be i32[S] with the 6 rows of x a multiple of S");
  EXPECT_EQ(infer_error("position_mask", {spec({2, 8, 16}), spec({4})}),
            "positions f16[4] must be i32[S] with the 8 rows of x a multiple of S");
  EXPECT_EQ(infer_error("position_mask", {spec({16}), positions}), "x f16[16] must have rank 2 or more");
}

TEST(OpRegistryTest, FlashAttention) {
  Attributes attributes;
  EXPECT_EQ(infer("flash_attention", {spec({2, 6, 64}), spec({2, 100, 64}), spec({2, 100, 32})}, attributes).front(),
            spec({2, 6, 32}));
  EXPECT_EQ(attributes.get_double("scale"), 1.0);
  EXPECT_EQ(attributes.get_string("mask"), "none");
  EXPECT_EQ(attributes.get_int("offset"), 0);
  Attributes with_positions;
  infer("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 9, 8}), spec({3}, DType::i32)}, with_positions);
  EXPECT_EQ(with_positions.get_string("mask"), "positions");
  EXPECT_EQ(find_op("flash_attention")->optional_inputs, 1u);
  EXPECT_EQ(infer_error("flash_attention", {spec({2, 6, 8}), spec({2, 9, 4}), spec({2, 9, 8})}),
            "k f16[2, 9, 4] must have the head dim D = 8 of q f16[2, 6, 8]");
  EXPECT_EQ(infer_error("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 7, 8})}),
            "v f16[2, 7, 8] must have the key count T = 9 of k f16[2, 9, 8]");
  EXPECT_EQ(infer_error("flash_attention", {spec({2, 6, 8}), spec({3, 9, 8}), spec({3, 9, 8})}),
            "k f16[3, 9, 8] and v f16[3, 9, 8] must have the leading dims [..., Hkv] of q f16[2, 6, 8]");
  EXPECT_EQ(infer_error("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 9, 8})},
                        attrs({{"mask", std::string("positions")}})),
            "mask 'positions' needs a positions input");
  EXPECT_EQ(infer_error("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 9, 8})},
                        attrs({{"mask", std::string("sliding")}})),
            "mask must be 'none', 'causal' or 'positions', got 'sliding'");
  // The offset shifts the causal mask; under another mask it did nothing (a mistyped mask ran unmasked).
  EXPECT_EQ(infer_error("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 9, 8})},
                        attrs({{"mask", std::string("none")}, {"offset", std::int64_t{3}}})),
            "offset 3 is the causal mask's; mask 'none' takes none");
  EXPECT_EQ(infer_error("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 9, 8}), spec({3}, DType::i32)},
                        attrs({{"offset", std::int64_t{-100}}})),
            "offset -100 is the causal mask's; mask 'positions' takes none");
  EXPECT_EQ(infer_one("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 9, 8})},
                      attrs({{"mask", std::string("causal")}, {"offset", std::int64_t{3}}})),
            spec({2, 6, 8}));
  // The scale as its plain-op chain takes it: within f32's range (the scale op's rule), and not 0 in f32
  // unless 0; and within what the fused kernels' f32 scale·log2(e) holds. 1e39 gave all-NaN outputs;
  // 1e-50 attended uniformly.
  for (const auto& [scale, message] : {std::pair{1e39, "scale 1e+39 is beyond f32's range (scale multiplies in f32)"},
                                       std::pair{1e-50, "scale 1e-50 is 0 in f32 (scale multiplies in f32)"},
                                       std::pair{-1e-46, "scale -1e-46 is 0 in f32 (scale multiplies in f32)"},
                                       std::pair{3e38, "scale 3e+38 times log2(e) is beyond f32's range (the fused "
                                                       "attention kernels scale by it in f32)"}}) {
    EXPECT_EQ(infer_error("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 9, 8})}, attrs({{"scale", scale}})),
              message);
  }
  for (const double scale : {0.0, 1e-45, -0.125, 2.3e38}) {
    EXPECT_EQ(infer_one("flash_attention", {spec({2, 6, 8}), spec({2, 9, 8}), spec({2, 9, 8})}, attrs({{"scale", scale}})),
              spec({2, 6, 8}))
        << scale;
  }
  EXPECT_EQ(testing::error_of([] {
              GraphBuilder builder;
              auto q = builder.input("q", spec({2, 6, 8}));
              builder.add_node("flash_attention", {q}, {}, "attention");
            }),
            "node 'attention' (flash_attention): expects 3 to 4 inputs (q, k, v, [positions]), got 1");
}

TEST(OpRegistryTest, Matmul) {
  EXPECT_EQ(infer_one("matmul", {spec({3, 5}), spec({5, 7})}), spec({3, 7}));
  EXPECT_EQ(infer_one("matmul", {spec({1, 4096}), spec({14336, 4096})}, attrs({{"transpose_right", std::int64_t{1}}})),
            spec({1, 14336}));
  EXPECT_EQ(infer_one("matmul", {spec({2, 8, 3, 5}), spec({2, 8, 5, 7})}), spec({2, 8, 3, 7}));
  EXPECT_EQ(infer_one("matmul", {spec({2, 8, 3, 5}), spec({7, 5})}, attrs({{"transpose_right", std::int64_t{1}}})),
            spec({2, 8, 3, 7}));
  EXPECT_EQ(infer_error("matmul", {spec({3, 5}), spec({6, 7})}),
            "b f16[6, 7] does not contract with a f16[3, 5]: a has K = 5, b has 6 (b is [..., K, N])");
  EXPECT_EQ(infer_error("matmul", {spec({3, 5}), spec({5, 7})}, attrs({{"transpose_right", std::int64_t{1}}})),
            "b f16[5, 7] does not contract with a f16[3, 5]: a has K = 5, b has 7 (b is [..., N, K] with transpose_right)");
  EXPECT_EQ(infer_error("matmul", {spec({2, 3, 5}), spec({4, 5, 7})}),
            "batch dimensions of b f16[4, 5, 7] do not match those of a f16[2, 3, 5] (b's must equal a's, or b must be rank 2)");
  EXPECT_EQ(infer_error("matmul", {spec({5}), spec({5, 7})}), "a f16[5] must have rank 2 or more");
  EXPECT_EQ(infer_error("matmul", {spec({3, 5}), spec({5, 7})}, attrs({{"transpose_right", std::int64_t{2}}})),
            "transpose_right must be 0 or 1 (false or true), got 2");
}

TEST(OpRegistryTest, QuantizedMatmul) {
  const auto q = [](int bits, int group) {
    return attrs({{"bits", std::int64_t{bits}}, {"group_size", std::int64_t{group}}});
  };
  EXPECT_EQ(infer_one("quantized_matmul",
                      {spec({8, 512}, DType::bf16), spec({1536, 64}, DType::u32), spec({1536, 8}, DType::bf16),
                       spec({1536, 8}, DType::bf16)},
                      q(4, 64)),
            spec({8, 1536}, DType::bf16));
  EXPECT_EQ(infer_one("quantized_matmul",
                      {spec({2, 3, 256}), spec({10, 64}, DType::u32), spec({10, 2}), spec({10, 2})}, q(8, 128)),
            spec({2, 3, 10}));
  EXPECT_EQ(infer_error("quantized_matmul",
                        {spec({1, 96}), spec({10, 12}, DType::u32), spec({10, 1}), spec({10, 1})}, q(4, 64)),
            "group_size 64 does not divide the row length K = 96 of x f16[1, 96]");
  EXPECT_EQ(infer_error("quantized_matmul",
                        {spec({1, 128}), spec({10, 16}, DType::u32), spec({10, 2}), spec({10, 2})}, q(3, 64)),
            "bits must be 4 or 8, got 3");
  EXPECT_EQ(infer_error("quantized_matmul",
                        {spec({1, 128}), spec({10, 16}, DType::u32), spec({10, 2}), spec({10, 2})}, q(4, 16)),
            "group_size must be 32, 64 or 128, got 16");
  EXPECT_EQ(infer_error("quantized_matmul",
                        {spec({1, 128}), spec({10, 32}, DType::u32), spec({10, 2}), spec({10, 2})}, q(4, 64)),
            "packed u32[10, 32] does not match K = 128 at 4 bits (expected u32[10, 16])");
  EXPECT_EQ(infer_error("quantized_matmul",
                        {spec({1, 128}), spec({10, 16}, DType::i32), spec({10, 2}), spec({10, 2})}, q(4, 64)),
            "packed i32[10, 16] must be u32 [N, K*bits/32]");
  EXPECT_EQ(infer_error("quantized_matmul",
                        {spec({1, 128}), spec({10, 16}, DType::u32), spec({10, 4}), spec({10, 2})}, q(4, 64)),
            "scales f16[10, 4] must be [N, K/group_size] = [10, 2]");
  EXPECT_EQ(infer_error("quantized_matmul",
                        {spec({1, 128}), spec({10, 16}, DType::u32), spec({10, 2}), spec({10, 2}, DType::f32)}, q(4, 64)),
            "biases f32[10, 2] must have the dtype of x f16[1, 128]");
  EXPECT_EQ(infer_error("quantized_matmul",
                        {spec({1, 128}), spec({10, 16}, DType::u32), spec({10, 2}), spec({10, 2})},
                        attrs({{"bits", std::int64_t{4}}})),
            "missing attribute 'group_size'");
}

TEST(OpRegistryTest, Rope) {
  Attributes defaults;
  EXPECT_EQ(infer("rope", {spec({8, 8, 64}, DType::bf16), spec({8}, DType::i32)}, defaults).front(),
            spec({8, 8, 64}, DType::bf16));
  EXPECT_EQ(defaults.get_int("dims"), 64);
  EXPECT_EQ(defaults.get_double("theta"), 10000.0);
  EXPECT_EQ(infer_one("rope", {spec({8, 64}), spec({8}, DType::i32)}, attrs({{"theta", 5e5}, {"dims", std::int64_t{32}}})),
            spec({8, 64}));
  EXPECT_EQ(infer_error("rope", {spec({8, 64}), spec({7}, DType::i32)}),
            "positions i32[7] must be i32[8], one position per row of x f16[8, 64] along axis -2");
  EXPECT_EQ(infer_error("rope", {spec({8, 64}), spec({8}, DType::f32)}),
            "positions f32[8] must be i32[8], one position per row of x f16[8, 64] along axis -2");
  EXPECT_EQ(infer_error("rope", {spec({8, 64}), spec({8}, DType::i32)}, attrs({{"dims", std::int64_t{33}}})),
            "dims 33 must be even, positive and at most the last axis of x f16[8, 64]");
  EXPECT_EQ(infer_error("rope", {spec({8, 64}), spec({8}, DType::i32)}, attrs({{"dims", std::int64_t{66}}})),
            "dims 66 must be even, positive and at most the last axis of x f16[8, 64]");
  EXPECT_EQ(infer_error("rope", {spec({8, 64}), spec({8}, DType::i32)}, attrs({{"theta", -1.0}})),
            "theta must be positive, got -1");
  EXPECT_EQ(infer_error("rope", {spec({64}), spec({1}, DType::i32)}), "x f16[64] must have rank 2 or more");
}

TEST(OpRegistryTest, ReshapeResolvesOneInferredAxis) {
  Attributes attributes = attrs({{"shape", Shape{8, -1, 64}}});
  EXPECT_EQ(infer("reshape", {spec({8, 512})}, attributes).front(), spec({8, 8, 64}));
  EXPECT_EQ(attributes.get_ints("shape"), (Shape{8, 8, 64}));
  EXPECT_EQ(infer_one("reshape", {spec({2, 3})}, attrs({{"shape", Shape{6}}})), spec({6}));
  EXPECT_EQ(infer_one("reshape", {spec({1})}, attrs({{"shape", Shape{}}})), spec({}));
  EXPECT_EQ(infer_error("reshape", {spec({2, 3})}, attrs({{"shape", Shape{4, 2}}})),
            "cannot reshape x f16[2, 3] to [4, 2]: element counts differ (6 vs 8)");
  EXPECT_EQ(infer_error("reshape", {spec({2, 3})}, attrs({{"shape", Shape{4, -1}}})),
            "cannot reshape x f16[2, 3] to [4, -1]: 6 elements are not a multiple of 4");
  EXPECT_EQ(infer_error("reshape", {spec({2, 3})}, attrs({{"shape", Shape{-1, -1}}})),
            "shape [-1, -1] may hold positive sizes and one -1 only");
  EXPECT_EQ(infer_error("reshape", {spec({2, 3})}, attrs({{"shape", Shape{std::int64_t{1} << 62, 4, -1}}})),
            "cannot reshape x f16[2, 3] to [4611686018427387904, 4, -1]: element counts differ");
  EXPECT_EQ(infer_error("reshape", {spec({2, 3})}, attrs({{"shape", Shape{0, 6}}})),
            "shape [0, 6] may hold positive sizes and one -1 only");
}

TEST(OpRegistryTest, TransposeAndCast) {
  EXPECT_EQ(infer_one("transpose", {spec({8, 8, 64})}, attrs({{"perm", Shape{1, 0, 2}}})), spec({8, 8, 64}));
  EXPECT_EQ(infer_one("transpose", {spec({2, 3, 5})}, attrs({{"perm", Shape{2, 0, 1}}})), spec({5, 2, 3}));
  EXPECT_EQ(infer_error("transpose", {spec({2, 3})}, attrs({{"perm", Shape{0, 0}}})),
            "perm [0, 0] is not a permutation of the 2 axes of x f16[2, 3]");
  EXPECT_EQ(infer_error("transpose", {spec({2, 3})}, attrs({{"perm", Shape{0, 1, 2}}})),
            "perm [0, 1, 2] is not a permutation of the 2 axes of x f16[2, 3]");
  EXPECT_EQ(infer_one("cast", {spec({2, 3})}, attrs({{"dtype", std::string("f32")}})), spec({2, 3}, DType::f32));
  EXPECT_EQ(infer_one("cast", {spec({2, 3}, DType::u32)}, attrs({{"dtype", std::string("bf16")}})), spec({2, 3}, DType::bf16));
  EXPECT_EQ(infer_error("cast", {spec({2})}, attrs({{"dtype", std::string("f8")}})),
            "unknown dtype 'f8' (expected f16, bf16, f32, i8, u8, i32 or u32)");
}

TEST(AttributesTest, TypedGetters) {
  Attributes attributes = attrs({{"n", std::int64_t{3}}, {"x", 0.5}, {"s", std::string("hi")}, {"v", Shape{1, 2}}});
  EXPECT_TRUE(attributes.has("n"));
  EXPECT_FALSE(attributes.has("m"));
  EXPECT_EQ(attributes.get_int("n"), 3);
  EXPECT_EQ(attributes.get_double("n"), 3.0);
  EXPECT_EQ(attributes.get_double("x"), 0.5);
  EXPECT_EQ(attributes.get_string("s"), "hi");
  EXPECT_EQ(attributes.get_ints("v"), (Shape{1, 2}));
  EXPECT_THROW(attributes.get_int("x"), InputError);
  EXPECT_THROW(attributes.get_ints("s"), InputError);
  attributes.set("n", 4.5);
  EXPECT_EQ(attributes.get_double("n"), 4.5);
}

}  // namespace
}  // namespace metile
