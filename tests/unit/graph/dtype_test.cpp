// dtype conversions against independent oracles: every f16 and bf16 bit
// pattern round trips, and f32 -> f16/bf16 rounding matches a nearest-value
// search over a table of all representable values (ties to the even pattern),
// plus the compiler's own _Float16 conversion where the compiler has one.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "metile/graph.h"
#include "metile_test_support.h"

namespace metile {
namespace {

// Value of an f16 bit pattern from its fields, written independently of the library.
double f16_reference_value(std::uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0x1f) return mantissa ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// All non-negative finite f16 values, ascending (pattern == index).
const std::vector<double>& f16_table() {
  static const std::vector<double> table = [] {
    std::vector<double> values;
    for (std::uint32_t bits = 0; bits <= 0x7bff; ++bits) values.push_back(f16_reference_value(static_cast<std::uint16_t>(bits)));
    return values;
  }();
  return table;
}

// Nearest f16 by search: the oracle for any double (hence any float), no bit tricks.
std::uint16_t f16_reference_round(double value) {
  if (std::isnan(value)) return 0x7e00;
  const std::uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  const double magnitude = std::fabs(value);
  const std::vector<double>& table = f16_table();
  // Beyond the largest finite value, IEEE rounds as if the exponent were
  // unbounded: the next value up would be 65536, so the midpoint is 65520.
  if (magnitude >= 65520.0) return sign | 0x7c00;
  auto upper = std::upper_bound(table.begin(), table.end(), magnitude);  // first value > magnitude
  const std::size_t low = static_cast<std::size_t>(upper - table.begin()) - 1;
  if (table[low] == magnitude || upper == table.end()) return static_cast<std::uint16_t>(sign | low);
  const double below = magnitude - table[low];
  const double above = table[low + 1] - magnitude;
  const std::size_t chosen = below < above ? low : above < below ? low + 1 : (low % 2 == 0 ? low : low + 1);
  return static_cast<std::uint16_t>(sign | chosen);
}

// Nearest bf16 by comparing against the two bf16 neighbours (as doubles).
std::uint16_t bf16_reference_round(float value) {
  if (std::isnan(value)) return 0x7fc0;
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = bits & 0x80000000u;
  const std::uint32_t magnitude_bits = bits & 0x7fffffffu;
  const std::uint32_t low_bits = magnitude_bits & 0xffff0000u;
  const double magnitude = std::fabs(static_cast<double>(value));
  const double low = std::fabs(static_cast<double>(std::bit_cast<float>(low_bits)));
  if (low == magnitude) return static_cast<std::uint16_t>((sign | low_bits) >> 16);
  // The neighbour above; past the largest finite bf16 it is 2^128 (rounds to inf).
  const std::uint32_t high_bits = low_bits + 0x10000u;
  const double high = high_bits >= 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(std::bit_cast<float>(high_bits));
  const double below = magnitude - low;
  const double above = high - magnitude;
  const bool take_high = above < below || (above == below && ((low_bits >> 16) & 1u));
  return static_cast<std::uint16_t>((sign | (take_high ? high_bits : low_bits)) >> 16);
}

bool is_f16_nan(std::uint16_t bits) { return (bits & 0x7c00) == 0x7c00 && (bits & 0x3ff) != 0; }
bool is_bf16_nan(std::uint16_t bits) { return (bits & 0x7f80) == 0x7f80 && (bits & 0x7f) != 0; }

TEST(DTypeTest, NamesSizesAndParsing) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32, DType::i8, DType::u8, DType::i32, DType::u32}) {
    EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype);
  }
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::i8), 1u);
  EXPECT_EQ(dtype_size(DType::u32), 4u);
  EXPECT_TRUE(is_floating(DType::bf16));
  EXPECT_FALSE(is_floating(DType::i32));
  try {
    parse_dtype("f64");
    FAIL() << "f64 parsed";
  } catch (const InputError& error) {
    EXPECT_STREQ(error.what(), "unknown dtype 'f64' (expected f16, bf16, f32, i8, u8, i32 or u32)");
  }
}

TEST(DTypeTest, EveryF16PatternRoundTripsAndDecodesExactly) {
  for (std::uint32_t pattern = 0; pattern <= 0xffff; ++pattern) {
    const auto bits = static_cast<std::uint16_t>(pattern);
    const float decoded = f16_bits_to_f32(bits);
    if (is_f16_nan(bits)) {
      ASSERT_TRUE(std::isnan(decoded)) << pattern;
      const std::uint16_t again = f32_to_f16_bits(decoded);
      ASSERT_TRUE(is_f16_nan(again)) << pattern;
      ASSERT_EQ(again, bits | 0x200) << "a quiet NaN keeps its sign and payload: " << pattern;
      continue;
    }
    ASSERT_EQ(static_cast<double>(decoded), f16_reference_value(bits)) << pattern;
    ASSERT_EQ(std::signbit(decoded), (bits & 0x8000) != 0) << pattern;
    ASSERT_EQ(f32_to_f16_bits(decoded), bits) << pattern;
  }
}

TEST(DTypeTest, EveryBf16PatternRoundTripsAndDecodesExactly) {
  for (std::uint32_t pattern = 0; pattern <= 0xffff; ++pattern) {
    const auto bits = static_cast<std::uint16_t>(pattern);
    const float decoded = bf16_bits_to_f32(bits);
    if (is_bf16_nan(bits)) {
      ASSERT_TRUE(std::isnan(decoded)) << pattern;
      ASSERT_EQ(f32_to_bf16_bits(decoded), bits | 0x40) << pattern;
      continue;
    }
    // Independent decode: sign, exponent and mantissa fields.
    const int exponent = (pattern >> 7) & 0xff;
    const int mantissa = pattern & 0x7f;
    const double sign = (pattern & 0x8000) ? -1.0 : 1.0;
    const double expected = exponent == 0xff ? sign * INFINITY
                            : exponent == 0  ? sign * std::ldexp(mantissa, -133)
                                             : sign * std::ldexp(128 + mantissa, exponent - 134);
    ASSERT_EQ(static_cast<double>(decoded), expected) << pattern;
    ASSERT_EQ(f32_to_bf16_bits(decoded), bits) << pattern;
  }
}

// Floats right at, just below and just above every midpoint between adjacent
// f16 values (where rounding decides), in both signs, plus random floats of
// every magnitude.
std::vector<float> f16_rounding_probes() {
  std::vector<float> probes;
  const std::vector<double>& table = f16_table();
  for (std::size_t index = 0; index + 1 < table.size(); ++index) {
    const auto midpoint = static_cast<float>((table[index] + table[index + 1]) / 2);  // exact: 12 significant bits
    for (float probe : {midpoint, std::nextafter(midpoint, 0.0f), std::nextafter(midpoint, INFINITY)}) {
      probes.push_back(probe);
      probes.push_back(-probe);
    }
  }
  for (float special : {65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e30f, 5.960464477539063e-08f, 2.980232238769531e-08f,
                        2.9802326e-08f, 1e-30f, 0.0f, -0.0f, INFINITY, -INFINITY,
                        std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()}) {
    probes.push_back(special);
  }
  std::mt19937 random(static_cast<std::uint32_t>(testing::test_seed("DTypeTest f32 probes")));
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_real_distribution<float> moderate(-70000.0f, 70000.0f);
  for (int draw = 0; draw < 100000; ++draw) {
    probes.push_back(std::bit_cast<float>(any_bits(random)));
    probes.push_back(moderate(random));
    probes.push_back(std::ldexp(moderate(random), -30));  // the subnormal range
  }
  return probes;
}

TEST(DTypeTest, F32ToF16MatchesNearestValueSearch) {
  for (float probe : f16_rounding_probes()) {
    const std::uint16_t expected = f16_reference_round(probe);
    const std::uint16_t actual = f32_to_f16_bits(probe);
    if (std::isnan(probe)) {
      ASSERT_TRUE(is_f16_nan(actual)) << probe;
      continue;
    }
    ASSERT_EQ(actual, expected) << "value " << probe << " bits " << std::bit_cast<std::uint32_t>(probe);
  }
}

#ifdef __FLT16_MANT_DIG__
TEST(DTypeTest, F32ToF16MatchesCompilerFloat16) {
  for (float probe : f16_rounding_probes()) {
    if (std::isnan(probe)) continue;
    const auto compiler = static_cast<_Float16>(probe);
    ASSERT_EQ(f32_to_f16_bits(probe), std::bit_cast<std::uint16_t>(compiler)) << probe;
  }
}
#endif

TEST(DTypeTest, F32ToBf16MatchesNeighbourComparison) {
  std::vector<float> probes;
  std::mt19937 random(static_cast<std::uint32_t>(testing::test_seed("DTypeTest.F32ToBf16MatchesNeighbourComparison")));
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int draw = 0; draw < 300000; ++draw) {
    const std::uint32_t bits = any_bits(random);
    probes.push_back(std::bit_cast<float>(bits));
    // Exact ties and their neighbours, where round-to-even decides.
    probes.push_back(std::bit_cast<float>((bits & 0xffff0000u) | 0x8000u));
    probes.push_back(std::bit_cast<float>((bits & 0xffff0000u) | 0x7fffu));
    probes.push_back(std::bit_cast<float>((bits & 0xffff0000u) | 0x8001u));
  }
  for (float special : {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), INFINITY, 0.0f, -0.0f,
                        std::numeric_limits<float>::denorm_min(), std::bit_cast<float>(0x7f7f8000u)}) {
    probes.push_back(special);
  }
  for (float probe : probes) {
    const std::uint16_t actual = f32_to_bf16_bits(probe);
    if (std::isnan(probe)) {
      ASSERT_TRUE(is_bf16_nan(actual)) << std::bit_cast<std::uint32_t>(probe);
      continue;
    }
    ASSERT_EQ(actual, bf16_reference_round(probe)) << "bits " << std::bit_cast<std::uint32_t>(probe);
  }
}

TEST(DTypeTest, OverflowGoesToInfinityAndSignedZerosSurvive) {
  EXPECT_EQ(f32_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16_bits(65519.996f), 0x7bff);
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16_bits(-1e9f), 0xfc00);
  EXPECT_EQ(f32_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(f32_to_bf16_bits(-0.0f), 0x8000);
  // Smallest f16 subnormal is 2^-24; exactly half of it ties to zero, a hair more rounds up.
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(f32_to_f16_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: tie to even
}

TEST(DTypeTest, RoundToDtype) {
  std::mt19937 random(static_cast<std::uint32_t>(testing::test_seed("DTypeTest.RoundToDtype")));
  std::uniform_real_distribution<float> values(-300.0f, 300.0f);
  for (int draw = 0; draw < 10000; ++draw) {
    const float value = values(random);
    EXPECT_EQ(round_to_dtype(value, DType::f32), value);
    EXPECT_EQ(round_to_dtype(value, DType::f16), static_cast<float>(f16_reference_value(f16_reference_round(value))));
    EXPECT_EQ(round_to_dtype(value, DType::bf16), bf16_bits_to_f32(bf16_reference_round(value)));
    const double nearest = std::nearbyint(static_cast<double>(value));
    EXPECT_EQ(round_to_dtype(value, DType::i32), static_cast<float>(nearest));
    EXPECT_EQ(round_to_dtype(value, DType::i8), static_cast<float>(std::clamp(nearest, -128.0, 127.0)));
    EXPECT_EQ(round_to_dtype(value, DType::u8), static_cast<float>(std::clamp(nearest, 0.0, 255.0)));
  }
  EXPECT_EQ(round_to_dtype(2.5f, DType::i32), 2.0f);  // ties to even
  EXPECT_EQ(round_to_dtype(-3.5f, DType::i8), -4.0f);
  EXPECT_EQ(round_to_dtype(-7.0f, DType::u32), 0.0f);
  EXPECT_EQ(round_to_dtype(1e12f, DType::i32), 2147483648.0f);  // saturates (the f32 nearest to INT32_MAX)
  EXPECT_EQ(round_to_dtype(NAN, DType::i8), 0.0f);
  EXPECT_TRUE(std::isnan(round_to_dtype(NAN, DType::f16)));
}

}  // namespace
}  // namespace metile
