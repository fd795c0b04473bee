// Every op of the CPU reference against an independent oracle: known values
// (gelu, a hand-packed quantized row, a hand-rotated rope pair), closed forms
// evaluated here in long double, naive loops, and exact f16/bf16 rounding of
// the f32 (or f64-accumulated) result.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "metile/cpu_runtime.h"
#include "metile/quant.h"
#include "test_support.h"

namespace metile {
namespace {

using testing::close_in_ulps;
using testing::random_tensor;

// Builds {output} and runs it on `inputs`; returns the single output.
HostTensor run_one(const GraphBuilder& builder, ValueRef output, const TensorMap& inputs) {
  const ComputeGraph graph = builder.build({output});
  TensorMap outputs = run_reference(graph, inputs);
  EXPECT_EQ(outputs.size(), 1u);
  return outputs.at(builder.name(output));
}

long double as_long(const HostTensor& tensor, std::int64_t index) { return tensor.at(index); }

// ---------------------------------------------------------------- elementwise

TEST(ReferenceElementwise, BinaryOpsAreSingleF32OperationsWithSuffixBroadcast) {
  const TensorSpec a_spec({3, 4, 8}, DType::f32);
  for (const std::vector<std::int64_t>& b_shape : {std::vector<std::int64_t>{8}, {4, 8}, {}, {3, 4, 8}}) {
    GraphBuilder builder;
    const ValueRef a = builder.input("a", a_spec);
    const ValueRef b = builder.input("b", TensorSpec(b_shape, DType::f32));
    const ValueRef sum = builder.add(a, b, "sum");
    const ValueRef difference = builder.subtract(a, b, "difference");
    const ValueRef product = builder.multiply(a, b, "product");
    const ComputeGraph graph = builder.build({sum, difference, product});
    const TensorMap inputs = {{"a", random_tensor(a_spec, 1)},
                              {"b", random_tensor(TensorSpec(b_shape, DType::f32), 2)}};
    const TensorMap outputs = run_reference(graph, inputs);
    const HostTensor& a_values = inputs.at("a");
    const HostTensor& b_values = inputs.at("b");
    for (std::int64_t index = 0; index < a_values.element_count(); ++index) {
      const long double left = as_long(a_values, index);
      const long double right = as_long(b_values, index % b_values.element_count());
      // The exact result of one operation on two floats, rounded once to f32.
      EXPECT_EQ(outputs.at("sum").at(index), static_cast<float>(left + right)) << index;
      EXPECT_EQ(outputs.at("difference").at(index), static_cast<float>(left - right)) << index;
      EXPECT_EQ(outputs.at("product").at(index), static_cast<float>(left * right)) << index;
    }
  }
}

TEST(ReferenceElementwise, HalfPrecisionResultsAreTheF32ResultRoundedOnce) {
  for (DType dtype : {DType::f16, DType::bf16}) {
    const TensorSpec spec({5, 16}, dtype);
    GraphBuilder builder;
    const ValueRef a = builder.input("a", spec);
    const ValueRef b = builder.input("b", TensorSpec({16}, dtype));
    const ValueRef product = builder.multiply(a, b, "product");
    const TensorMap inputs = {{"a", random_tensor(spec, 3, -4, 4)},
                              {"b", random_tensor(TensorSpec({16}, dtype), 4)}};
    const HostTensor out = run_one(builder, product, inputs);
    ASSERT_EQ(out.spec(), spec);
    for (std::int64_t index = 0; index < out.element_count(); ++index) {
      const auto exact = static_cast<float>(inputs.at("a").at(index) * inputs.at("b").at(index % 16));
      EXPECT_EQ(out.at(index), round_to_dtype(exact, dtype)) << dtype_name(dtype) << " " << index;
    }
  }
}

TEST(ReferenceElementwise, ScaleSiluExpMatchClosedForms) {
  const TensorSpec spec({4, 33}, DType::f32);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef scaled = builder.scale(x, 0.37, "scaled");
  const ValueRef activated = builder.silu(x, "activated");
  const ValueRef exponential = builder.exp(x, "exponential");
  const ComputeGraph graph = builder.build({scaled, activated, exponential});
  const TensorMap inputs = {{"x", random_tensor(spec, 5, -6, 6)}};
  const TensorMap outputs = run_reference(graph, inputs);
  for (std::int64_t index = 0; index < spec.element_count(); ++index) {
    const long double value = as_long(inputs.at("x"), index);
    EXPECT_TRUE(close_in_ulps(outputs.at("scaled").at(index), value * 0.37L, DType::f32, 1.5)) << index;
    EXPECT_TRUE(
        close_in_ulps(outputs.at("activated").at(index), value / (1 + std::exp(-value)), DType::f32, 4, 1e-7))
        << index;
    EXPECT_TRUE(close_in_ulps(outputs.at("exponential").at(index), std::exp(value), DType::f32, 2)) << index;
  }
}

// scale multiplies in f32, so it takes only factors whose f32 value is finite: random factors of
// 1e30..1e39 are either refused (beyond FLT_MAX, where x · inf gave inf, or NaN for 0, whatever x was)
// or give the f64 product x · factor within two f32 ulps (the factor and the product are each rounded to f32).
TEST(ReferenceElementwise, ScaleTakesOnlyFactorsItCanMultiplyInF32) {
  std::mt19937_64 generator(testing::process_seed() + 22);
  const TensorSpec spec({16}, DType::f32);
  constexpr double largest = std::numeric_limits<float>::max();
  std::vector<double> factors = {1e39, -1e39, largest, -largest};
  for (int trial = 0; trial < 64; ++trial) {
    const double magnitude = std::pow(10.0, 30 + 9 * (static_cast<double>(generator() >> 11) * 0x1.0p-53));
    factors.push_back(trial % 2 == 0 ? magnitude : -magnitude);
  }
  for (std::size_t trial = 0; trial < factors.size(); ++trial) {
    const double factor = factors[trial];
    GraphBuilder builder;
    const ValueRef x = builder.input("x", spec);
    if (std::fabs(factor) > largest * 1.0000001) {
      EXPECT_THROW(builder.scale(x, factor), InputError) << "factor " << factor;
      continue;
    }
    if (std::fabs(factor) > largest) continue;  // within a rounding of FLT_MAX
    const HostTensor input = random_tensor(spec, 23 + trial, -1e-30, 1e-30);
    const HostTensor out = run_one(builder, builder.scale(x, factor), {{"x", input}});
    for (std::int64_t index = 0; index < spec.element_count(); ++index) {
      const long double expected = as_long(input, index) * factor;
      EXPECT_TRUE(close_in_ulps(out.at(index), expected, DType::f32, 2)) << "factor " << factor << " at " << index;
    }
  }
}

TEST(ReferenceElementwise, GeluMatchesKnownValues) {
  const std::vector<double> points = {1.0, -1.0, 2.0, 0.5, -3.0, -6.0};
  // 0.5 x (1 + erf(x / sqrt 2)) and the tanh form, evaluated independently to 16 digits.
  // The negative tail is tiny but not zero: a form that computes 1 + erf(...) in f32 fails there.
  // Up to 32 f32 ulps: erfc(4.24) changes 8.5 times faster, relatively, than its argument,
  // which carries the rounding of x / sqrt 2.
  const std::vector<double> exact = {0.8413447460685429,  -0.15865525393145707, 1.9544997361036416,
                                     0.34573123063700656, -0.00404969409489031, -5.919525870226207e-09};
  const std::vector<double> tanh_form = {0.8411919906082768,  -0.15880800939172324,   1.954597694087775,
                                         0.34571400982514394, -0.0036373920817729943, -8.43964670076231e-11};
  const TensorSpec spec({6}, DType::f32);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef with_erf = builder.gelu(x, "none", "with_erf");
  const ValueRef with_tanh = builder.gelu(x, "tanh", "with_tanh");
  const ComputeGraph graph = builder.build({with_erf, with_tanh});
  const TensorMap outputs = run_reference(graph, {{"x", HostTensor::from_values(spec, points)}});
  for (std::size_t index = 0; index < points.size(); ++index) {
    const auto at = static_cast<std::int64_t>(index);
    EXPECT_TRUE(close_in_ulps(outputs.at("with_erf").at(at), exact[index], DType::f32, 32)) << points[index];
    EXPECT_TRUE(close_in_ulps(outputs.at("with_tanh").at(at), tanh_form[index], DType::f32, 32))
        << points[index];
  }
}

// gelu's negative tail carries the f32 rounding of its argument through erfc (or exp, in the tanh form), which
// magnifies it by about 2z^2, z = -x / sqrt 2 (~36 at -6): every f32 in [-6, 6] a 1/1024 apart against long double
// forms, within 64 ulps (the README quotes the largest errors this prints).
TEST(ReferenceElementwise, GeluStaysWithinItsTailBoundFromMinusSixToSix) {
  std::vector<double> points;
  for (int k = -6 * 1024; k <= 6 * 1024; ++k) points.push_back(k / 1024.0);
  const TensorSpec spec({static_cast<std::int64_t>(points.size())}, DType::f32);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ComputeGraph graph = builder.build({builder.gelu(x, "none", "with_erf"), builder.gelu(x, "tanh", "with_tanh")});
  const TensorMap outputs = run_reference(graph, {{"x", HostTensor::from_values(spec, points)}});
  const long double pi = 3.141592653589793238462643383279502884L;
  double worst_erf = 0, worst_tanh = 0;
  for (std::size_t index = 0; index < points.size(); ++index) {
    const long double v = points[index];
    const long double erf_form = 0.5L * v * std::erfc(-v / std::sqrt(2.0L));
    const long double tanh_form = v / (1 + std::exp(-2 * std::sqrt(2 / pi) * (v + 0.044715L * v * v * v)));
    const auto at = static_cast<std::int64_t>(index);
    const auto ulps = [](double actual, long double expected) {
      return static_cast<double>(std::fabs(actual - expected) / testing::ulp_of(expected, DType::f32));
    };
    worst_erf = std::max(worst_erf, ulps(outputs.at("with_erf").at(at), erf_form));
    worst_tanh = std::max(worst_tanh, ulps(outputs.at("with_tanh").at(at), tanh_form));
  }
  std::printf("gelu over [-6, 6]: worst %.1f f32 ulps (erf form), %.1f (tanh form)\n", worst_erf, worst_tanh);
  EXPECT_LE(worst_erf, 64);
  EXPECT_LE(worst_tanh, 64);
  EXPECT_GT(worst_erf, 4);  // the magnification is there: a sweep that missed the tail would see ~1 ulp
}

// silu and gelu at their limits, as PyTorch computes them in f32 (transformers is the models' oracle):
// NaN at -inf (-inf / inf, -inf · 0), -0 where e^-x overflows f32 (silu below about -88.7), inf at inf.
TEST(ReferenceElementwise, SiluAndGeluAtTheirLimitsAreWhatPyTorchGives) {
  const std::vector<double> points = {-HUGE_VAL, -89.0, HUGE_VAL};
  const TensorSpec spec({3}, DType::f32);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ComputeGraph graph =
      builder.build({builder.silu(x, "silu"), builder.gelu(x, "none", "gelu"), builder.gelu(x, "tanh", "gelu_tanh")});
  const TensorMap outputs = run_reference(graph, {{"x", HostTensor::from_values(spec, points)}});
  for (const char* op : {"silu", "gelu", "gelu_tanh"}) {
    SCOPED_TRACE(op);
    EXPECT_TRUE(std::isnan(outputs.at(op).at(0)));
    EXPECT_EQ(outputs.at(op).at(1), 0.0);
    EXPECT_TRUE(std::signbit(outputs.at(op).at(1)));
    EXPECT_EQ(outputs.at(op).at(2), HUGE_VAL);
  }
}

TEST(ReferenceElementwise, GeluMatchesErfFormulaOnRandomInputs) {
  const TensorSpec spec({2, 50}, DType::bf16);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef y = builder.gelu(x);
  const TensorMap inputs = {{"x", random_tensor(spec, 6, -5, 5)}};
  const HostTensor out = run_one(builder, y, inputs);
  for (std::int64_t index = 0; index < spec.element_count(); ++index) {
    const long double value = as_long(inputs.at("x"), index);
    const long double expected = 0.5L * value * (1 + std::erf(value / std::sqrt(2.0L)));
    // The f32 result is within a few f32 ulps; rounding to bf16 adds at most half a bf16 ulp.
    EXPECT_TRUE(close_in_ulps(out.at(index), expected, DType::bf16, 0.51, 1e-6)) << value;
  }
}

TEST(ReferenceElementwise, CausalMaskSetsMinusInfinityAboveTheShiftedDiagonal) {
  for (DType dtype : {DType::f32, DType::f16}) {
    for (std::int64_t offset : {-1, 0, 2}) {
      const TensorSpec spec({2, 4, 6}, dtype);
      GraphBuilder builder;
      const ValueRef x = builder.input("x", spec);
      const ValueRef masked = builder.causal_mask(x, offset);
      const TensorMap inputs = {{"x", random_tensor(spec, 7)}};
      const HostTensor out = run_one(builder, masked, inputs);
      for (std::int64_t batch = 0; batch < 2; ++batch) {
        for (std::int64_t i = 0; i < 4; ++i) {
          for (std::int64_t j = 0; j < 6; ++j) {
            const std::int64_t index = (batch * 4 + i) * 6 + j;
            if (j > i + offset) {
              EXPECT_EQ(out.at(index), -std::numeric_limits<double>::infinity()) << i << "," << j;
            } else {
              EXPECT_EQ(out.at(index), inputs.at("x").at(index)) << i << "," << j;
            }
          }
        }
      }
    }
  }
}

TEST(ReferenceElementwise, PositionMaskHidesKeysPastEachTokensPosition) {
  // 2 groups of 3 tokens (grouped-query rows): row r is token r mod 3.
  const TensorSpec spec({2, 6, 5}, DType::bf16);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef positions = builder.input("positions", {{3}, DType::i32});
  const ValueRef masked = builder.position_mask(x, positions);
  HostTensor position_values({{3}, DType::i32});
  const int last_visible[] = {4, 0, 2};
  for (int token = 0; token < 3; ++token) position_values.store(token, last_visible[token]);
  const TensorMap inputs = {{"x", random_tensor(spec, 11)}, {"positions", position_values}};
  const HostTensor out = run_one(builder, masked, inputs);
  for (std::int64_t index = 0; index < spec.element_count(); ++index) {
    const std::int64_t key = index % 5;
    const std::int64_t row = index / 5 % 6;
    if (key > last_visible[row % 3]) {
      EXPECT_EQ(out.at(index), -std::numeric_limits<double>::infinity()) << row << "," << key;
    } else {
      EXPECT_EQ(out.at(index), inputs.at("x").at(index)) << row << "," << key;
    }
  }
}

// ---------------------------------------------------------------- row reductions

TEST(ReferenceRowReduction, RmsNormOfAKnownVector) {
  GraphBuilder builder;
  const ValueRef x = builder.input("x", TensorSpec({1, 4}, DType::f32));
  const ValueRef weight = builder.input("weight", TensorSpec({4}, DType::f32));
  const ValueRef y = builder.rms_norm(x, weight, 1e-5);
  const std::vector<double> values = {1, 2, 3, 4};
  const std::vector<double> weights = {0.5, -1, 2, 1};
  const HostTensor out = run_one(builder, y,
                                 {{"x", HostTensor::from_values(TensorSpec({1, 4}, DType::f32), values)},
                                  {"weight", HostTensor::from_values(TensorSpec({4}, DType::f32), weights)}});
  // mean of squares (1 + 4 + 9 + 16) / 4 = 7.5; 1 / sqrt(7.5 + 1e-5) = 0.3651481282381064
  for (std::int64_t index = 0; index < 4; ++index) {
    const double expected = values[static_cast<std::size_t>(index)] * 0.3651481282381064 *
                            weights[static_cast<std::size_t>(index)];
    EXPECT_TRUE(close_in_ulps(out.at(index), expected, DType::f32, 2)) << index;
  }
}

TEST(ReferenceRowReduction, RmsNormMatchesLongDoubleOnRandomRows) {
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    const TensorSpec spec({3, 96}, dtype);
    GraphBuilder builder;
    const ValueRef x = builder.input("x", spec);
    const ValueRef weight = builder.input("weight", TensorSpec({96}, dtype));
    const ValueRef y = builder.rms_norm(x, weight, 1e-6);
    const TensorMap inputs = {{"x", random_tensor(spec, 8, -3, 3)},
                              {"weight", random_tensor(TensorSpec({96}, dtype), 9, 0.5, 1.5)}};
    const HostTensor out = run_one(builder, y, inputs);
    for (std::int64_t row = 0; row < 3; ++row) {
      long double sum_of_squares = 0;
      for (std::int64_t d = 0; d < 96; ++d)
        sum_of_squares += as_long(inputs.at("x"), row * 96 + d) * as_long(inputs.at("x"), row * 96 + d);
      const long double inverse_rms = 1 / std::sqrt(sum_of_squares / 96 + 1e-6L);
      for (std::int64_t d = 0; d < 96; ++d) {
        const long double expected =
            as_long(inputs.at("x"), row * 96 + d) * inverse_rms * as_long(inputs.at("weight"), d);
        // f32: three roundings; f16/bf16: the f32 value then half an ulp of the dtype.
        EXPECT_TRUE(
            close_in_ulps(out.at(row * 96 + d), expected, dtype, dtype == DType::f32 ? 3 : 0.51, 1e-30))
            << dtype_name(dtype) << " " << row << "," << d;
      }
    }
  }
}

TEST(ReferenceRowReduction, LayerNormMatchesLongDouble) {
  const TensorSpec spec({4, 80}, DType::f32);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef weight = builder.input("weight", TensorSpec({80}, DType::f32));
  const ValueRef bias = builder.input("bias", TensorSpec({80}, DType::f32));
  const ValueRef y = builder.layer_norm(x, weight, bias, 1e-5);
  const TensorMap inputs = {{"x", random_tensor(spec, 10, 2, 5)},  // a mean far from 0
                            {"weight", random_tensor(TensorSpec({80}, DType::f32), 11)},
                            {"bias", random_tensor(TensorSpec({80}, DType::f32), 12)}};
  const HostTensor out = run_one(builder, y, inputs);
  for (std::int64_t row = 0; row < 4; ++row) {
    long double sum = 0;
    for (std::int64_t d = 0; d < 80; ++d) sum += as_long(inputs.at("x"), row * 80 + d);
    const long double mean = sum / 80;
    long double squares = 0;
    for (std::int64_t d = 0; d < 80; ++d)
      squares += std::pow(as_long(inputs.at("x"), row * 80 + d) - mean, 2);
    const long double inverse_std = 1 / std::sqrt(squares / 80 + 1e-5L);
    for (std::int64_t d = 0; d < 80; ++d) {
      const long double expected =
          (as_long(inputs.at("x"), row * 80 + d) - mean) * inverse_std * as_long(inputs.at("weight"), d) +
          as_long(inputs.at("bias"), d);
      EXPECT_NEAR(out.at(row * 80 + d), static_cast<double>(expected), 2e-6) << row << "," << d;
    }
  }
}

// layer_norm centres each element on the mean its variance is taken around, in f64. Centring on the
// mean rounded to f32 gave [0, 2, 0, 2] for [2^24, 2^24 + 2, 2^24, 2^24 + 2] (the oracle: [-1, 1, -1, 1]
// over sqrt(1 + eps)) and 5e-4 off on rows of 100 plus noise of 1e-3; x - mean in f32 overflowed for
// [3.4e38, -3.4e38, ...]. The oracle is long double; weight 1 and bias 0, so the output is the
// normalized value rounded once to f32: within 1 ulp.
TEST(ReferenceRowReduction, LayerNormCentresOnTheMeanItsVarianceUses) {
  constexpr std::int64_t kLength = 256;
  std::vector<double> rows(4 * kLength);
  std::mt19937_64 generator(testing::process_seed() + 41);
  for (std::int64_t d = 0; d < kLength; ++d) {
    rows[static_cast<std::size_t>(d)] = 0x1.0p24 + 2.0 * static_cast<double>(d % 2);
    rows[static_cast<std::size_t>(kLength + d)] = d == 0 ? 3.4e38 : -3.4e38;
    for (std::int64_t row : {2, 3}) {
      const double noise = (static_cast<double>(generator() >> 11) * 0x1.0p-53 - 0.5) * 2e-3;
      rows[static_cast<std::size_t>(row * kLength + d)] = 100.0 + noise;
    }
  }
  const TensorSpec spec({4, kLength}, DType::f32);
  const TensorSpec row_spec({kLength}, DType::f32);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef y = builder.layer_norm(x, builder.input("weight", row_spec), builder.input("bias", row_spec), 1e-5);
  const HostTensor input = HostTensor::from_values(spec, rows);
  const HostTensor out = run_one(builder, y,
                                 {{"x", input},
                                  {"weight", HostTensor::from_values(row_spec, std::vector<double>(kLength, 1.0))},
                                  {"bias", HostTensor(row_spec)}});
  for (std::int64_t row = 0; row < 4; ++row) {
    long double sum = 0;
    for (std::int64_t d = 0; d < kLength; ++d) sum += as_long(input, row * kLength + d);
    const long double mean = sum / kLength;
    long double squares = 0;
    for (std::int64_t d = 0; d < kLength; ++d) squares += std::pow(as_long(input, row * kLength + d) - mean, 2);
    const long double inverse_std = 1 / std::sqrt(squares / kLength + 1e-5L);
    for (std::int64_t d = 0; d < kLength; ++d) {
      const long double expected = (as_long(input, row * kLength + d) - mean) * inverse_std;
      EXPECT_TRUE(close_in_ulps(out.at(row * kLength + d), expected, DType::f32, 1)) << "row " << row << " at " << d;
    }
  }
}

// softmax: exp(x - max) in f32, the sum in f64, each quotient rounded once to the output's dtype. Through
// f32 first, a quotient within half an f32 ulp of an f16 tie rounded to the tie and then to even (7 of
// 65536 f16 elements in one draw, ~3 on average). The oracle replays that definition here and rounds the long double
// quotient once; it also counts the elements where rounding through f32 would differ, so that the draw
// is known to reach the case.
TEST(ReferenceRowReduction, SoftmaxRoundsEachQuotientOnceToTheDtype) {
  constexpr std::int64_t kRows = 512;  // ~3 quotients in 65536 sit there: 512 rows miss none with p < 1e-9
  const TensorSpec spec({kRows, 1024}, DType::f16);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const HostTensor input = random_tensor(spec, 42, -4, 4);
  const HostTensor out = run_one(builder, builder.softmax(x), {{"x", input}});
  int through_f32_differs = 0;
  for (std::int64_t row = 0; row < kRows; ++row) {
    float maximum = -std::numeric_limits<float>::infinity();
    for (std::int64_t d = 0; d < 1024; ++d) maximum = std::max(maximum, static_cast<float>(input.at(row * 1024 + d)));
    std::vector<float> exponentials(1024);
    long double sum = 0;
    for (std::int64_t d = 0; d < 1024; ++d) {
      exponentials[static_cast<std::size_t>(d)] = std::exp(static_cast<float>(input.at(row * 1024 + d)) - maximum);
      sum += exponentials[static_cast<std::size_t>(d)];
    }
    for (std::int64_t d = 0; d < 1024; ++d) {
      const long double quotient = exponentials[static_cast<std::size_t>(d)] / sum;
      const double expected = round_double_to_dtype(static_cast<double>(quotient), DType::f16);
      EXPECT_EQ(out.at(row * 1024 + d), expected) << "row " << row << " at " << d;
      through_f32_differs += round_to_dtype(static_cast<float>(quotient), DType::f16) != expected;
    }
  }
  EXPECT_GT(through_f32_differs, 0) << "no quotient of this draw sits where rounding through f32 differs";
}

TEST(ReferenceRowReduction, SoftmaxOverEveryAxisMatchesTheExpFormula) {
  const TensorSpec spec({2, 3, 5}, DType::f32);
  for (std::int64_t axis : {0, 1, 2, -1}) {
    GraphBuilder builder;
    const ValueRef x = builder.input("x", spec);
    const ValueRef y = builder.softmax(x, axis);
    // Large values: a softmax that skipped the max subtraction would overflow exp.
    const TensorMap inputs = {{"x", random_tensor(spec, 13, 95, 105)}};
    const HostTensor out = run_one(builder, y, inputs);
    const std::int64_t positive_axis = axis < 0 ? axis + 3 : axis;
    const std::vector<std::int64_t> strides = {15, 5, 1};
    const std::int64_t stride = strides[static_cast<std::size_t>(positive_axis)];
    const std::int64_t length = spec.shape[static_cast<std::size_t>(positive_axis)];
    for (std::int64_t index = 0; index < spec.element_count(); ++index) {
      const std::int64_t position = index / stride % length;
      const std::int64_t first = index - position * stride;
      long double denominator = 0;
      double sum_of_outputs = 0;
      for (std::int64_t other = 0; other < length; ++other) {
        denominator += std::exp(as_long(inputs.at("x"), first + other * stride) - 100);
        sum_of_outputs += out.at(first + other * stride);
      }
      const long double expected = std::exp(as_long(inputs.at("x"), index) - 100) / denominator;
      EXPECT_TRUE(close_in_ulps(out.at(index), expected, DType::f32, 4, 1e-12))
          << "axis " << axis << " at " << index;
      EXPECT_NEAR(sum_of_outputs, 1.0, 2e-6) << "axis " << axis << " at " << index;
    }
  }
}

TEST(ReferenceRowReduction, MaskedSoftmaxGivesExactZeros) {
  const TensorSpec spec({4, 4}, DType::f16);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef y = builder.softmax(builder.causal_mask(x));
  const HostTensor out = run_one(builder, y, {{"x", random_tensor(spec, 14)}});
  for (std::int64_t i = 0; i < 4; ++i) {
    double row_sum = 0;
    for (std::int64_t j = 0; j < 4; ++j) {
      row_sum += out.at(i * 4 + j);
      if (j > i) {
        EXPECT_EQ(out.at(i * 4 + j), 0.0) << i << "," << j;
      } else {
        EXPECT_GT(out.at(i * 4 + j), 0.0) << i << "," << j;
      }
    }
    EXPECT_NEAR(row_sum, 1.0, 2e-3);  // four f16 roundings
  }
  EXPECT_EQ(out.at(0), 1.0);  // row 0 sees only itself
}

// sum and mean round the exact total once, straight to the dtype. Rows x + ulp(x)/2 + 2^-24 (every term
// an f16 and a bf16) sit just above a tie of the dtype: through f32 the 2^-24 is lost (half an f32 ulp,
// rounded to even) and the tie then rounds to even, where the exact total rounds away from x. The oracle
// is the long double total (exact for these terms), rounded once by HostTensor::store; random rows too.
TEST(ReferenceRowReduction, SumAndMeanRoundTheExactTotalOnceToTheDtype) {
  std::mt19937_64 generator(testing::process_seed() + 21);
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    const int mantissa_bits = dtype == DType::f16 ? 10 : dtype == DType::bf16 ? 7 : 23;
    const std::int64_t rows = 64, length = 4;
    std::vector<double> values;
    for (std::int64_t row = 0; row < rows; ++row) {
      if (row % 2 == 0) {  // just above a tie: x in [1, 2) on the dtype's grid, its half ulp, 2^-24; mean's total x4
        const double x = 1 + std::ldexp(static_cast<double>(generator() % (1u << mantissa_bits)), -mantissa_bits);
        for (double term : {x, std::ldexp(1.0, -mantissa_bits - 1), std::ldexp(1.0, -24), 0.0}) values.push_back(term * 4);
      } else {
        for (std::int64_t column = 0; column < length; ++column) {
          values.push_back(static_cast<double>(generator() >> 11) * 0x1.0p-53 * 8 - 4);
        }
      }
    }
    const TensorSpec spec({rows, length}, dtype);
    const HostTensor x = HostTensor::from_values(spec, values);
    for (bool mean : {false, true}) {
      GraphBuilder builder;
      const ValueRef input = builder.input("x", spec);
      const HostTensor out = run_one(builder, mean ? builder.mean(input) : builder.sum(input), {{"x", x}});
      for (std::int64_t row = 0; row < rows; ++row) {
        long double total = 0;
        for (std::int64_t column = 0; column < length; ++column) total += as_long(x, row * length + column);
        HostTensor expected(TensorSpec({1}, dtype));
        expected.store(0, static_cast<double>(mean ? total / length : total));
        EXPECT_EQ(out.at(row), expected.at(0)) << dtype_name(dtype) << (mean ? " mean" : " sum") << ", row " << row;
      }
    }
  }
}

// ---------------------------------------------------------------- contractions

// The exact dot product, rounded once to dtype (what f64 accumulation of exact
// products gives for these small K).
double rounded_dot(const HostTensor& a, std::int64_t a_first, std::int64_t a_step, const HostTensor& b,
                   std::int64_t b_first, std::int64_t b_step, std::int64_t k, DType dtype) {
  long double sum = 0;
  for (std::int64_t depth = 0; depth < k; ++depth) {
    sum += as_long(a, a_first + depth * a_step) * as_long(b, b_first + depth * b_step);
  }
  HostTensor rounded(TensorSpec({1}, dtype));
  rounded.store(0, static_cast<double>(sum));
  return rounded.at(0);
}

TEST(ReferenceContraction, MatmulMatchesNaiveLoopsForEveryLayout) {
  const std::int64_t m = 3, k = 7, n = 4;
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (bool transpose_right : {false, true}) {
      for (bool shared_right : {false, true}) {
        const TensorSpec a_spec({2, m, k}, dtype);
        std::vector<std::int64_t> b_shape =
            transpose_right ? std::vector<std::int64_t>{n, k} : std::vector<std::int64_t>{k, n};
        if (!shared_right) b_shape.insert(b_shape.begin(), 2);
        const TensorSpec b_spec(b_shape, dtype);
        GraphBuilder builder;
        const ValueRef a = builder.input("a", a_spec);
        const ValueRef b = builder.input("b", b_spec);
        const ValueRef y = builder.matmul(a, b, transpose_right);
        const TensorMap inputs = {{"a", random_tensor(a_spec, 15)}, {"b", random_tensor(b_spec, 16)}};
        const HostTensor out = run_one(builder, y, inputs);
        ASSERT_EQ(out.spec(), TensorSpec({2, m, n}, dtype));
        for (std::int64_t batch = 0; batch < 2; ++batch) {
          const std::int64_t b_batch_first = shared_right ? 0 : batch * k * n;
          for (std::int64_t row = 0; row < m; ++row) {
            for (std::int64_t column = 0; column < n; ++column) {
              const double expected =
                  transpose_right ? rounded_dot(inputs.at("a"), (batch * m + row) * k, 1, inputs.at("b"),
                                                b_batch_first + column * k, 1, k, dtype)
                                  : rounded_dot(inputs.at("a"), (batch * m + row) * k, 1, inputs.at("b"),
                                                b_batch_first + column, n, k, dtype);
              EXPECT_EQ(out.at((batch * m + row) * n + column), expected)
                  << dtype_name(dtype) << " transpose " << transpose_right << " shared " << shared_right;
            }
          }
        }
      }
    }
  }
}

TEST(ReferenceContraction, QuantizedMatmulOfAHandPackedRow) {
  // W row 0: w[k] = 0.5 * (k % 16) - 2 (scale 0.5, bias -2, codes k % 16);
  // row 1: all codes 15 with scale 0.25, bias 1 -> w = 4.75.
  GraphBuilder builder;
  const ValueRef x = builder.input("x", TensorSpec({1, 32}, DType::f32));
  const ValueRef packed = builder.input("packed", TensorSpec({2, 4}, DType::u32));
  const ValueRef scales = builder.input("scales", TensorSpec({2, 1}, DType::f32));
  const ValueRef biases = builder.input("biases", TensorSpec({2, 1}, DType::f32));
  const ValueRef y = builder.quantized_matmul(x, packed, scales, biases, 4, 32);
  std::vector<double> x_values(32);
  for (int k = 0; k < 32; ++k) x_values[static_cast<std::size_t>(k)] = 1.0 + (k % 3);
  const std::vector<double> words = {0x76543210u, 0xFEDCBA98u, 0x76543210u, 0xFEDCBA98u,
                                     0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
  const HostTensor out = run_one(
      builder, y,
      {{"x", HostTensor::from_values(TensorSpec({1, 32}, DType::f32), x_values)},
       {"packed", HostTensor::from_values(TensorSpec({2, 4}, DType::u32), words)},
       {"scales", HostTensor::from_values(TensorSpec({2, 1}, DType::f32), std::vector<double>{0.5, 0.25})},
       {"biases", HostTensor::from_values(TensorSpec({2, 1}, DType::f32), std::vector<double>{-2, 1})}});
  double row0 = 0, row1 = 0;
  for (int k = 0; k < 32; ++k) {
    row0 += x_values[static_cast<std::size_t>(k)] * (0.5 * (k % 16) - 2);
    row1 += x_values[static_cast<std::size_t>(k)] * 4.75;
  }
  EXPECT_EQ(out.at(0), row0);
  EXPECT_EQ(out.at(1), row1);
}

TEST(ReferenceContraction, QuantizedMatmulEqualsDequantizeThenMatmul) {
  const std::int64_t k = 128, n = 6;
  for (const AffineQuantization format :
       {AffineQuantization{4, 32}, AffineQuantization{4, 128}, AffineQuantization{8, 64}}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      const QuantizedMatrix weight =
          quantize_affine(random_tensor(TensorSpec({n, k}, DType::f32), 17), format, dtype);
      const TensorSpec x_spec({2, 3, k}, dtype);
      GraphBuilder builder;
      const ValueRef x = builder.input("x", x_spec);
      const ValueRef y = builder.quantized_matmul(
          x, builder.input("packed", weight.packed.spec()), builder.input("scales", weight.scales.spec()),
          builder.input("biases", weight.biases.spec()), format.bits, format.group_size);
      const HostTensor x_values = random_tensor(x_spec, 18);
      const HostTensor out = run_one(
          builder, y,
          {{"x", x_values}, {"packed", weight.packed}, {"scales", weight.scales}, {"biases", weight.biases}});
      ASSERT_EQ(out.spec(), TensorSpec({2, 3, n}, dtype));
      const HostTensor dequantized = dequantize_affine(weight);  // f32 [n, k]
      for (std::int64_t row = 0; row < 6; ++row) {
        for (std::int64_t column = 0; column < n; ++column) {
          EXPECT_EQ(out.at(row * n + column),
                    rounded_dot(x_values, row * k, 1, dequantized, column * k, 1, k, dtype))
              << format.bits << " bits, group " << format.group_size << ", " << dtype_name(dtype);
        }
      }
      if (dtype != DType::f32) continue;
      // And bit for bit the same as the reference matmul on the dequantized weight.
      GraphBuilder dense;
      const ValueRef dense_y =
          dense.matmul(dense.input("x", x_spec), dense.input("w", dequantized.spec()), true);
      EXPECT_EQ(run_one(dense, dense_y, {{"x", x_values}, {"w", dequantized}}), out);
    }
  }
}

// The blocked, vectorized quantized_matmul against a per-element dequantize-then-dot written
// here from the packing rule (low bits first, w = scale * q + bias with the product rounded to
// f32 before the add, dot products in f64 in index order): bit for bit, on random words, scales
// and biases, and random shapes with N not a multiple of the 8-column block and 1..5 groups.
TEST(ReferenceContraction, QuantizedMatmulEqualsPerElementDequantizeThenDot) {
  std::mt19937_64 generator(testing::test_seed("quantized_matmul random shapes"));
  const auto pick = [&](std::int64_t low, std::int64_t high) {
    return std::uniform_int_distribution<std::int64_t>(low, high)(generator);
  };
  for (int trial = 0; trial < 24; ++trial) {
    const int bits = pick(0, 1) == 0 ? 4 : 8;
    const int group_size = std::array{32, 64, 128}[static_cast<std::size_t>(pick(0, 2))];
    const std::int64_t groups = pick(1, 5);
    const std::int64_t k = groups * group_size;
    const std::int64_t n = pick(1, 41);
    const std::int64_t m = pick(1, 4);
    const DType x_dtype = std::array{DType::f32, DType::bf16, DType::f16}[static_cast<std::size_t>(pick(0, 2))];
    const DType scale_dtype = x_dtype;  // the op takes scales and biases in x's dtype
    const int per_word = 32 / bits;
    const TensorSpec x_spec({m, k}, x_dtype);
    const TensorSpec packed_spec({n, k / per_word}, DType::u32);
    const TensorSpec scales_spec({n, groups}, scale_dtype);
    std::vector<double> words(static_cast<std::size_t>(packed_spec.element_count()));
    for (double& word : words) word = static_cast<double>(static_cast<std::uint32_t>(generator()));
    const HostTensor packed = HostTensor::from_values(packed_spec, words);
    const HostTensor scales = random_tensor(scales_spec, generator(), -0.1, 0.1);
    const HostTensor biases = random_tensor(scales_spec, generator(), -1, 1);
    const HostTensor x = random_tensor(x_spec, generator(), -2, 2);

    GraphBuilder builder;
    const ValueRef y = builder.quantized_matmul(builder.input("x", x_spec), builder.input("packed", packed_spec),
                                                builder.input("scales", scales_spec),
                                                builder.input("biases", scales_spec), bits, group_size);
    const HostTensor out =
        run_one(builder, y, {{"x", x}, {"packed", packed}, {"scales", scales}, {"biases", biases}});

    HostTensor expected(TensorSpec({m, n}, x_dtype));
    for (std::int64_t column = 0; column < n; ++column) {
      std::vector<float> w(static_cast<std::size_t>(k));
      for (std::int64_t depth = 0; depth < k; ++depth) {
        const auto word = static_cast<std::uint32_t>(packed.at((column * k + depth) / per_word));
        const std::uint32_t code = (word >> (bits * (depth % per_word))) & ((1u << bits) - 1);
        const auto scale = static_cast<float>(scales.at(column * groups + depth / group_size));
        const auto bias = static_cast<float>(biases.at(column * groups + depth / group_size));
        // In f64 then rounded: each is exactly the f32 operation (no fused multiply-add possible).
        const auto product = static_cast<float>(static_cast<double>(scale) * code);
        w[static_cast<std::size_t>(depth)] = static_cast<float>(static_cast<double>(product) + bias);
      }
      for (std::int64_t row = 0; row < m; ++row) {
        double sum = 0;
        for (std::int64_t depth = 0; depth < k; ++depth) sum += x.at(row * k + depth) * w[static_cast<std::size_t>(depth)];
        expected.store(row * n + column, sum);
      }
    }
    ASSERT_EQ(out, expected) << "trial " << trial << ": " << bits << " bits, group " << group_size << ", K " << k
                             << ", N " << n << ", M " << m << ", " << dtype_name(x_dtype);
  }
}

// ---------------------------------------------------------------- layout

TEST(ReferenceLayout, RopeRotatesAKnownPair) {
  GraphBuilder builder;
  const ValueRef x = builder.input("x", TensorSpec({1, 4}, DType::f32));
  const ValueRef positions = builder.input("positions", TensorSpec({1}, DType::i32));
  const ValueRef y = builder.rope(x, positions, 10000.0, 4);
  const HostTensor out = run_one(
      builder, y,
      {{"x", HostTensor::from_values(TensorSpec({1, 4}, DType::f32), std::vector<double>{1, 0.5, 0.25, 2})},
       {"positions", HostTensor::from_values(TensorSpec({1}, DType::i32), std::vector<double>{3})}});
  // pair (0, 2) turns by 3 rad; pair (1, 3) by 3 * 10000^(-1/2) = 0.03 rad.
  EXPECT_NEAR(out.at(0), 1 * std::cos(3.0) - 0.25 * std::sin(3.0), 1e-6);
  EXPECT_NEAR(out.at(2), 1 * std::sin(3.0) + 0.25 * std::cos(3.0), 1e-6);
  EXPECT_NEAR(out.at(1), 0.5 * std::cos(0.03) - 2 * std::sin(0.03), 1e-6);
  EXPECT_NEAR(out.at(3), 0.5 * std::sin(0.03) + 2 * std::cos(0.03), 1e-6);
}

TEST(ReferenceLayout, RopeMatchesTheRotationFormula) {
  const std::int64_t sequence = 5, length = 16;
  for (std::int64_t dims : {16, 8}) {
    for (double theta : {10000.0, 500000.0}) {
      const TensorSpec spec({2, 3, sequence, length}, DType::f32);  // [batch, heads, S, D]
      GraphBuilder builder;
      const ValueRef x = builder.input("x", spec);
      const ValueRef positions = builder.input("positions", TensorSpec({sequence}, DType::i32));
      const ValueRef y = builder.rope(x, positions, theta, dims);
      const std::vector<double> steps = {0, 7, 99, 1, 42};
      const TensorMap inputs = {
          {"x", random_tensor(spec, 19)},
          {"positions", HostTensor::from_values(TensorSpec({sequence}, DType::i32), steps)}};
      const HostTensor out = run_one(builder, y, inputs);
      const HostTensor& in = inputs.at("x");
      for (std::int64_t row = 0; row < spec.element_count() / length; ++row) {
        const long double position = steps[static_cast<std::size_t>(row % sequence)];
        for (std::int64_t d = 0; d < length; ++d) {
          const std::int64_t index = row * length + d;
          if (d >= dims) {
            EXPECT_EQ(out.at(index), in.at(index)) << "untouched tail " << d;
            continue;
          }
          const std::int64_t pair = d % (dims / 2);
          const long double angle = position * std::pow(static_cast<long double>(theta), -2.0L * pair / dims);
          const long double low = as_long(in, row * length + pair);
          const long double high = as_long(in, row * length + pair + dims / 2);
          const long double expected = d < dims / 2 ? low * std::cos(angle) - high * std::sin(angle)
                                                    : low * std::sin(angle) + high * std::cos(angle);
          EXPECT_NEAR(out.at(index), static_cast<double>(expected), 4e-7)
              << "dims " << dims << " theta " << theta << " row " << row << " d " << d;
        }
      }
    }
  }
}

TEST(ReferenceLayout, TransposeReshapeMoveElementsExactly) {
  const TensorSpec spec({2, 3, 4}, DType::bf16);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef transposed = builder.transpose(x, {2, 0, 1}, "transposed");
  const ValueRef reshaped = builder.reshape(x, {4, -1}, "reshaped");
  const ComputeGraph graph = builder.build({transposed, reshaped});
  const TensorMap inputs = {{"x", random_tensor(spec, 20)}};
  const TensorMap outputs = run_reference(graph, inputs);
  const HostTensor& in = inputs.at("x");
  ASSERT_EQ(outputs.at("transposed").spec(), TensorSpec({4, 2, 3}, DType::bf16));
  for (std::int64_t i = 0; i < 2; ++i) {
    for (std::int64_t j = 0; j < 3; ++j) {
      for (std::int64_t l = 0; l < 4; ++l) {
        EXPECT_EQ(outputs.at("transposed").at((l * 2 + i) * 3 + j), in.at((i * 3 + j) * 4 + l));
      }
    }
  }
  ASSERT_EQ(outputs.at("reshaped").spec(), TensorSpec({4, 6}, DType::bf16));
  EXPECT_TRUE(std::equal(in.bytes().begin(), in.bytes().end(), outputs.at("reshaped").bytes().begin()));
}

TEST(ReferenceLayout, CastRoundsOnceAndSaturatesIntegers) {
  const std::vector<double> values = {3.5, 2.5, -7.6, 3e9, -3e9, 0.1, 65519.0, 70000.0, -300.0, 300.0};
  const TensorSpec spec({10}, DType::f32);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", spec);
  const ValueRef to_i32 = builder.cast(x, DType::i32, "to_i32");
  const ValueRef to_u8 = builder.cast(x, DType::u8, "to_u8");
  const ValueRef to_f16 = builder.cast(x, DType::f16, "to_f16");
  const ComputeGraph graph = builder.build({to_i32, to_u8, to_f16});
  const HostTensor input = HostTensor::from_values(spec, values);
  const TensorMap outputs = run_reference(graph, {{"x", input}});
  const std::vector<double> expected_i32 = {4, 2, -8, 2147483647, -2147483648.0, 0, 65519, 70000, -300, 300};
  const std::vector<double> expected_u8 = {4, 2, 0, 255, 0, 0, 255, 255, 0, 255};
  for (std::int64_t index = 0; index < 10; ++index) {
    EXPECT_EQ(outputs.at("to_i32").at(index), expected_i32[static_cast<std::size_t>(index)]) << index;
    EXPECT_EQ(outputs.at("to_u8").at(index), expected_u8[static_cast<std::size_t>(index)]) << index;
    EXPECT_EQ(outputs.at("to_f16").at(index), round_to_dtype(static_cast<float>(input.at(index)), DType::f16))
        << index;
  }
  EXPECT_EQ(outputs.at("to_f16").at(6), 65504.0);  // rounds down to f16's largest finite value
  EXPECT_EQ(outputs.at("to_f16").at(7), std::numeric_limits<double>::infinity());
}

}  // namespace
}  // namespace metile
