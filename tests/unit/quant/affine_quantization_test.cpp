// Tests for MLX's affine quantization format: the bit layout against
// hand-packed words, quantize/dequantize against hand-computed groups and
// against error bounds recomputed here from each group's own min and max.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "metile/quant.h"
#include "metile_test_support.h"

namespace metile {
namespace {

HostTensor random_matrix(std::int64_t rows, std::int64_t columns, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::vector<double> values(static_cast<std::size_t>(rows * columns));
  // Each row gets its own offset and spread so groups are not all alike.
  for (std::int64_t row = 0; row < rows; ++row) {
    const double center = static_cast<double>(generator() % 2001) / 1000.0 - 1.0;
    const double spread = 0.01 + static_cast<double>(generator() % 1000) / 500.0;
    for (std::int64_t column = 0; column < columns; ++column) {
      const double unit = static_cast<double>(generator() >> 11) * 0x1.0p-53;  // [0, 1)
      values[static_cast<std::size_t>(row * columns + column)] = center + spread * (unit - 0.5);
    }
  }
  return HostTensor::from_values(TensorSpec({rows, columns}, DType::f32), values);
}

std::vector<std::uint32_t> codes_of(const QuantizedMatrix& matrix) {
  std::vector<std::uint32_t> words(static_cast<std::size_t>(matrix.packed.element_count()));
  for (std::size_t index = 0; index < words.size(); ++index) {
    words[index] = static_cast<std::uint32_t>(matrix.packed.at(static_cast<std::int64_t>(index)));
  }
  return unpack_codes(words, matrix.format.bits);
}

TEST(PackCodes, LowBitsFirstForFourAndEightBits) {
  const std::vector<std::uint32_t> nibbles = {1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 9};
  EXPECT_EQ(pack_codes(nibbles, 4), (std::vector<std::uint32_t>{0x87654321u, 0x9000000Fu}));
  const std::vector<std::uint32_t> bytes = {0x11, 0x22, 0x33, 0xFF};
  EXPECT_EQ(pack_codes(bytes, 8), (std::vector<std::uint32_t>{0xFF332211u}));
  EXPECT_EQ(unpack_codes(std::vector<std::uint32_t>{0xFF332211u}, 8), bytes);
}

TEST(PackCodes, RoundTripsRandomCodes) {
  std::mt19937_64 generator(testing::test_seed("PackCodes.RoundTripsRandomCodes"));
  for (int bits : {4, 8}) {
    std::vector<std::uint32_t> codes(static_cast<std::size_t>(32 / bits) * 97);
    for (auto& code : codes) code = static_cast<std::uint32_t>(generator()) & ((1u << bits) - 1);
    const std::vector<std::uint32_t> words = pack_codes(codes, bits);
    ASSERT_EQ(words.size(), codes.size() * static_cast<std::size_t>(bits) / 32);
    EXPECT_EQ(unpack_codes(words, bits), codes) << bits << " bits";
    // And the other way: any word is a valid packing.
    std::vector<std::uint32_t> random_words(31);
    for (auto& word : random_words) word = static_cast<std::uint32_t>(generator());
    EXPECT_EQ(pack_codes(unpack_codes(random_words, bits), bits), random_words) << bits << " bits";
  }
}

TEST(PackCodes, RejectsBadInput) {
  EXPECT_THROW(pack_codes(std::vector<std::uint32_t>{16, 0, 0, 0, 0, 0, 0, 0}, 4), InputError);
  EXPECT_THROW(pack_codes(std::vector<std::uint32_t>{1, 2, 3}, 4), InputError);
  EXPECT_THROW(pack_codes(std::vector<std::uint32_t>{1, 2, 3, 4}, 3), InputError);
  EXPECT_THROW(unpack_codes(std::vector<std::uint32_t>{1}, 2), InputError);
}

TEST(AffineQuantization, ValidatesBitsAndGroupSize) {
  for (int bits : {4, 8}) {
    for (int group_size : {32, 64, 128}) EXPECT_NO_THROW((AffineQuantization{bits, group_size}.validate()));
  }
  for (int bits : {0, 1, 2, 3, 5, 16, 32, -4})
    EXPECT_THROW((AffineQuantization{bits, 64}.validate()), InputError);
  for (int group_size : {0, 16, 48, 100, 256, -64}) {
    EXPECT_THROW((AffineQuantization{4, group_size}.validate()), InputError);
  }
  EXPECT_THROW((AffineQuantization{4, 64}.check_columns(96)), InputError);
  EXPECT_THROW((AffineQuantization{4, 64}.check_columns(0)), InputError);
  EXPECT_NO_THROW((AffineQuantization{4, 64}.check_columns(192)));
  try {
    AffineQuantization{4, 100}.validate();
    FAIL() << "group size 100 accepted";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("group_size"), std::string::npos) << error.what();
  }
}

// One group of 32 values on an exact grid: w[k] = 0.5 * (k % 16) - 2.
HostTensor grid_row() {
  std::vector<double> values(32);
  for (int column = 0; column < 32; ++column)
    values[static_cast<std::size_t>(column)] = 0.5 * (column % 16) - 2.0;
  return HostTensor::from_values(TensorSpec({1, 32}, DType::f32), values);
}

TEST(QuantizeAffine, HandComputedMinMaxGroup) {
  const QuantizedMatrix matrix = quantize_affine(grid_row(), {4, 32}, DType::f16);
  // min -2, max 5.5: scale 7.5 / 15 = 0.5, bias -2, codes k % 16.
  EXPECT_EQ(matrix.scales.at(0), 0.5);
  EXPECT_EQ(matrix.biases.at(0), -2.0);
  EXPECT_EQ(matrix.packed.spec(), TensorSpec({1, 4}, DType::u32));
  EXPECT_EQ(matrix.packed.at(0), 0x76543210u);
  EXPECT_EQ(matrix.packed.at(1), 0xFEDCBA98u);
  EXPECT_EQ(matrix.packed.at(2), 0x76543210u);
  EXPECT_EQ(matrix.packed.at(3), 0xFEDCBA98u);
  EXPECT_EQ(dequantize_affine(matrix), grid_row());
}

TEST(QuantizeAffine, HandComputedMlxGroup) {
  const QuantizedMatrix matrix = quantize_affine(grid_row(), {4, 32}, DType::f32, AffineRounding::mlx);
  // |max| 5.5 >= |min| 2: the bias is the max and the scale is negative;
  // q0 = round(5.5 / -0.5) = -11 keeps scale = 5.5 / -11 = -0.5, codes 15 - k % 16.
  EXPECT_EQ(matrix.scales.at(0), -0.5);
  EXPECT_EQ(matrix.biases.at(0), 5.5);
  EXPECT_EQ(matrix.packed.at(0), 0x89ABCDEFu);
  EXPECT_EQ(matrix.packed.at(1), 0x01234567u);
  EXPECT_EQ(dequantize_affine(matrix), grid_row());
}

TEST(QuantizeAffine, HandComputedRoundingAndEightBits) {
  // 4 bits: min 0, max 1.5 -> scale 0.1 (as f32), bias 0.
  std::vector<double> values(32, 0.74);
  const std::vector<double> head = {0.0, 1.5, 0.04, 0.16, 0.33, 0.76, 1.46};
  std::copy(head.begin(), head.end(), values.begin());
  const HostTensor weight = HostTensor::from_values(TensorSpec({1, 32}, DType::f32), values);
  const QuantizedMatrix matrix = quantize_affine(weight, {4, 32}, DType::f32);
  EXPECT_EQ(matrix.scales.at(0), static_cast<double>(0.1f));
  EXPECT_EQ(matrix.biases.at(0), 0.0);
  const std::vector<std::uint32_t> codes = codes_of(matrix);
  const std::vector<std::uint32_t> expected_head = {0, 15, 0, 2, 3, 8, 15};
  EXPECT_TRUE(std::equal(expected_head.begin(), expected_head.end(), codes.begin()));
  EXPECT_EQ(codes[31], 7u);

  // 8 bits on a ramp from -1 to 1.4893: the ends take codes 0 and 255, the
  // rest round((w - bias) / scale).
  std::vector<double> wide(32, 0.0);
  for (int column = 0; column < 32; ++column) wide[static_cast<std::size_t>(column)] = -1.0 + 0.0803 * column;
  const HostTensor wide_weight = HostTensor::from_values(TensorSpec({1, 32}, DType::f32), wide);
  const QuantizedMatrix eight = quantize_affine(wide_weight, {8, 32}, DType::f32);
  const double scale = eight.scales.at(0);
  EXPECT_NEAR(scale, (wide_weight.at(31) - wide_weight.at(0)) / 255.0, 1e-8);
  const std::vector<std::uint32_t> eight_codes = codes_of(eight);
  for (int column = 0; column < 32; ++column) {
    const double expected = std::round((wide_weight.at(column) - eight.biases.at(0)) / scale);
    EXPECT_EQ(eight_codes[static_cast<std::size_t>(column)], static_cast<std::uint32_t>(expected)) << column;
  }
  EXPECT_EQ(eight_codes[0], 0u);
  EXPECT_EQ(eight_codes[31], 255u);
}

// |w - dequant(quant(w))| <= |scale| / 2 wherever the code did not clamp; the
// bound is widened only by the rounding of scale and bias to their dtype, which
// this test measures against the exact scale and bias it computes itself.
TEST(QuantizeAffine, ErrorIsBoundedByHalfAScale) {
  const HostTensor weight = random_matrix(6, 256, testing::test_seed("QuantizeAffine.ErrorIsBoundedByHalfAScale"));
  for (DType scale_dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (int bits : {4, 8}) {
      for (int group_size : {32, 64, 128}) {
        const AffineQuantization format{bits, group_size};
        const QuantizedMatrix matrix = quantize_affine(weight, format, scale_dtype);
        const HostTensor restored = dequantize_affine(matrix);
        ASSERT_EQ(restored.spec(), weight.spec());
        const std::int64_t groups = 256 / group_size;
        for (std::int64_t row = 0; row < 6; ++row) {
          for (std::int64_t group = 0; group < groups; ++group) {
            double minimum = INFINITY;
            double maximum = -INFINITY;
            for (std::int64_t k = 0; k < group_size; ++k) {
              minimum = std::min(minimum, weight.at(row * 256 + group * group_size + k));
              maximum = std::max(maximum, weight.at(row * 256 + group * group_size + k));
            }
            const double exact_scale = (maximum - minimum) / ((1 << bits) - 1);
            const double stored_scale = matrix.scales.at(row * groups + group);
            const double stored_bias = matrix.biases.at(row * groups + group);
            const double rounding_slack = std::abs(stored_bias - minimum) +
                                          ((1 << bits) - 1) * std::abs(stored_scale - exact_scale) +
                                          4e-7 * (std::abs(maximum) + std::abs(minimum));
            if (scale_dtype == DType::f32) {
              ASSERT_LT(rounding_slack, 1e-5);
            }
            for (std::int64_t k = 0; k < group_size; ++k) {
              const std::int64_t index = row * 256 + group * group_size + k;
              const double error = std::abs(restored.at(index) - weight.at(index));
              ASSERT_LE(error, stored_scale / 2 + rounding_slack)
                  << dtype_name(scale_dtype) << " bits " << bits << " group " << group_size << " at "
                  << index;
            }
          }
        }
      }
    }
  }
}

TEST(QuantizeAffine, MlxRoundingErrorIsBoundedByOneScale) {
  const HostTensor weight = random_matrix(4, 128, testing::test_seed("QuantizeAffine.MlxRoundingErrorIsBoundedByOneScale"));
  for (int bits : {4, 8}) {
    const QuantizedMatrix matrix = quantize_affine(weight, {bits, 32}, DType::f32, AffineRounding::mlx);
    const HostTensor restored = dequantize_affine(matrix);
    for (std::int64_t index = 0; index < weight.element_count(); ++index) {
      const double scale = std::abs(matrix.scales.at(index / 32));
      ASSERT_LE(std::abs(restored.at(index) - weight.at(index)), scale * (1 + 1e-5)) << index;
    }
    // The larger-magnitude edge of every group is its bias, reproduced within f32 rounding.
    for (std::int64_t group = 0; group < weight.element_count() / 32; ++group) {
      double minimum = INFINITY;
      double maximum = -INFINITY;
      for (std::int64_t k = 0; k < 32; ++k) {
        minimum = std::min(minimum, weight.at(group * 32 + k));
        maximum = std::max(maximum, weight.at(group * 32 + k));
      }
      const double edge = std::abs(minimum) > std::abs(maximum) ? minimum : maximum;
      EXPECT_NEAR(matrix.biases.at(group), edge, 1e-6) << group;
      EXPECT_EQ(matrix.scales.at(group) > 0, std::abs(minimum) > std::abs(maximum)) << group;
    }
  }
}

TEST(DequantizeAffine, RoundsTheF32ValueToTheOutputDtype) {
  const QuantizedMatrix matrix = quantize_affine(random_matrix(3, 64, testing::test_seed("DequantizeAffine.RoundsTheF32ValueToTheOutputDtype")), {4, 32}, DType::bf16);
  const HostTensor as_f32 = dequantize_affine(matrix);
  const HostTensor as_f16 = dequantize_affine(matrix, DType::f16);
  ASSERT_EQ(as_f16.spec(), TensorSpec({3, 64}, DType::f16));
  for (std::int64_t index = 0; index < as_f32.element_count(); ++index) {
    // The f32 value itself is scale * q + bias with both operations rounded to f32.
    const auto scale = static_cast<float>(matrix.scales.at(index / 32));
    const auto bias = static_cast<float>(matrix.biases.at(index / 32));
    const auto code = static_cast<float>(codes_of(matrix)[static_cast<std::size_t>(index)]);
    const float product = scale * code;
    EXPECT_EQ(as_f32.at(index), static_cast<double>(product + bias));
    EXPECT_EQ(as_f16.at(index),
              static_cast<double>(round_to_dtype(static_cast<float>(as_f32.at(index)), DType::f16)));
  }
  EXPECT_THROW(dequantize_affine(matrix, DType::i32), InputError);
}

TEST(QuantizeAffine, ConstantGroupsDoNotDivideByZero) {
  std::vector<double> values(64, 0.375);
  std::fill(values.begin() + 32, values.end(), -3.0);
  const HostTensor weight = HostTensor::from_values(TensorSpec({1, 64}, DType::f32), values);
  for (AffineRounding rounding : {AffineRounding::min_max, AffineRounding::mlx}) {
    const HostTensor restored = dequantize_affine(quantize_affine(weight, {4, 32}, DType::f16, rounding));
    for (std::int64_t index = 0; index < 64; ++index) EXPECT_NEAR(restored.at(index), weight.at(index), 1e-6);
  }
}

TEST(QuantizeAffine, RejectsBadInput) {
  const HostTensor weight = random_matrix(2, 64, 5);
  EXPECT_THROW(quantize_affine(weight, {3, 32}, DType::f16), InputError);
  EXPECT_THROW(quantize_affine(weight, {4, 128}, DType::f16), InputError);  // 64 columns, group 128
  EXPECT_THROW(quantize_affine(weight, {4, 32}, DType::i32), InputError);
  EXPECT_THROW(quantize_affine(HostTensor(TensorSpec({64}, DType::f32)), {4, 32}, DType::f16), InputError);
  EXPECT_THROW(quantize_affine(HostTensor(TensorSpec({2, 64}, DType::i8)), {4, 32}, DType::f16), InputError);
  std::vector<double> values = weight.to_values();
  values[70] = NAN;
  try {
    quantize_affine(HostTensor::from_values(weight.spec(), values), {4, 32}, DType::f16);
    FAIL() << "NaN weight accepted";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("[1, 6]"), std::string::npos) << error.what();
  }
}

// A group whose range the scale dtype cannot hold (f32 weights past 65504 with f16 scales), or whose
// weights lie so near f32's limit that scale * q + bias overflows f32, is refused: before, the
// scale or bias was stored as inf and the matrix dequantized to inf and NaN, with no error.
// Random rows, one of which gets the hostile group at a random place.
TEST(QuantizeAffine, RefusesGroupsThatDequantizeToInfinity) {
  std::mt19937_64 generator(testing::test_seed("QuantizeAffine.RefusesGroupsThatDequantizeToInfinity"));
  struct Case {
    double low, high;
    DType weight_dtype, scale_dtype;
  };
  for (const Case hostile : {Case{-1e5, 1e5, DType::f32, DType::f16}, Case{-1e6, 1e6, DType::bf16, DType::f16},
                             Case{-7e4, 0, DType::f32, DType::f16}, Case{-3e38, 3e38, DType::f32, DType::f32},
                             Case{-3e38, 3e38, DType::bf16, DType::bf16}}) {
    const std::int64_t rows = 3, columns = 128;
    HostTensor weight(TensorSpec({rows, columns}, hostile.weight_dtype));
    const HostTensor source = random_matrix(rows, columns, generator());
    for (std::int64_t index = 0; index < weight.element_count(); ++index) weight.store(index, source.at(index));
    const std::int64_t row = static_cast<std::int64_t>(generator() % rows);
    const std::int64_t group = static_cast<std::int64_t>(generator() % 4);
    weight.store(row * columns + group * 32 + 3, hostile.low);
    weight.store(row * columns + group * 32 + 17, hostile.high);
    for (AffineRounding rounding : {AffineRounding::min_max, AffineRounding::mlx}) {
      for (int bits : {4, 8}) {
        const std::string what = fmt::format("[{}, {}] in {} with {} scales, {} bits, {}", hostile.low, hostile.high,
                                             dtype_name(hostile.weight_dtype), dtype_name(hostile.scale_dtype), bits,
                                             rounding == AffineRounding::mlx ? "mlx" : "min_max");
        try {
          const QuantizedMatrix matrix = quantize_affine(weight, {bits, 32}, hostile.scale_dtype, rounding);
          const HostTensor restored = dequantize_affine(matrix);
          std::int64_t non_finite = 0;
          for (std::int64_t index = 0; index < restored.element_count(); ++index) {
            non_finite += std::isfinite(restored.at(index)) ? 0 : 1;
          }
          ADD_FAILURE() << what << ": accepted, " << non_finite << " weights dequantize to inf or NaN";
        } catch (const InputError& error) {
          EXPECT_NE(std::string(error.what()).find(fmt::format("[{}, ", row)), std::string::npos)
              << what << ": " << error.what();
        }
      }
    }
  }
  // The edges of what fits still quantize: f16's largest finite values with f16 scales.
  const HostTensor edge = HostTensor::from_values(TensorSpec({1, 32}, DType::f16), std::vector<double>(32, 65504));
  EXPECT_NO_THROW(quantize_affine(edge, {4, 32}, DType::f16));
}

// quantize_affine runs ranges of rows at once: every split gives the bytes of the sequential
// loop (ranges = 1), on row counts that no range count divides, and the codes are the ones
// pack_codes packs from round((w - bias) / scale) against the stored scale and bias.
TEST(QuantizeAffine, RangesOfRowsGiveTheSequentialBytes) {
  const std::uint64_t seed = testing::test_seed("QuantizeAffine.RangesOfRowsGiveTheSequentialBytes");
  struct Shape {
    std::int64_t rows, columns;
    DType dtype;
  };
  // The last one is 2^21 + 2048 weights: the default (ranges = 0) splits it wherever there are
  // two hardware threads.
  for (const Shape shape : {Shape{1, 128, DType::f32}, Shape{37, 192, DType::bf16}, Shape{13, 384, DType::f16},
                            Shape{101, 256, DType::bf16}, Shape{2050, 1024, DType::bf16}}) {
    const HostTensor source = random_matrix(shape.rows, shape.columns, seed + static_cast<std::uint64_t>(shape.rows));
    HostTensor weight(TensorSpec({shape.rows, shape.columns}, shape.dtype));
    for (std::int64_t index = 0; index < weight.element_count(); ++index) weight.store(index, source.at(index));
    for (int bits : {4, 8}) {
      for (int group_size : {32, 64, 128}) {
        if (shape.columns % group_size != 0) continue;
        // The large shape is there for the split into ranges: one format covers it.
        if (shape.rows > 1000 && (bits != 4 || group_size != 64)) continue;
        for (AffineRounding rounding : {AffineRounding::min_max, AffineRounding::mlx}) {
          const AffineQuantization format{bits, group_size};
          const QuantizedMatrix sequential = quantize_affine(weight, format, DType::bf16, rounding, 1);
          // The codes against the stored scale and bias, packed by pack_codes.
          std::vector<std::uint32_t> codes(static_cast<std::size_t>(weight.element_count()));
          for (std::int64_t index = 0; index < weight.element_count(); ++index) {
            const std::int64_t group = index / group_size;
            const double scale = sequential.scales.at(group);
            const double bias = sequential.biases.at(group);
            const double code = scale == 0 ? 0.0 : std::nearbyint((weight.at(index) - bias) / scale);
            codes[static_cast<std::size_t>(index)] =
                static_cast<std::uint32_t>(std::clamp(code, 0.0, static_cast<double>(format.max_code())));
          }
          const std::vector<std::uint32_t> words = pack_codes(codes, bits);
          ASSERT_EQ(sequential.packed.bytes().size(), words.size() * 4);
          ASSERT_EQ(std::memcmp(sequential.packed.bytes().data(), words.data(), words.size() * 4), 0)
              << shape.rows << "x" << shape.columns << " bits " << bits << " group " << group_size;
          if (shape.rows > 200 && (bits != 4 || group_size != 64)) continue;  // the large one: once
          for (std::int64_t ranges : {0, 2, 3, 7, 64}) {
            const QuantizedMatrix split = quantize_affine(weight, format, DType::bf16, rounding, ranges);
            const std::string what = std::to_string(shape.rows) + "x" + std::to_string(shape.columns) + " bits " +
                                     std::to_string(bits) + " group " + std::to_string(group_size) + " ranges " +
                                     std::to_string(ranges);
            EXPECT_TRUE(std::ranges::equal(split.packed.bytes(), sequential.packed.bytes())) << what;
            EXPECT_TRUE(std::ranges::equal(split.scales.bytes(), sequential.scales.bytes())) << what;
            EXPECT_TRUE(std::ranges::equal(split.biases.bytes(), sequential.biases.bytes())) << what;
          }
        }
      }
    }
  }
}

// With several ranges failing at once, the error is still the first bad weight in row order.
TEST(QuantizeAffine, RangesReportTheFirstBadWeight) {
  std::vector<double> values = random_matrix(37, 64, 11).to_values();
  values[30 * 64 + 3] = INFINITY;
  values[2 * 64 + 9] = NAN;
  values[36 * 64] = -INFINITY;
  const HostTensor weight = HostTensor::from_values(TensorSpec({37, 64}, DType::f32), values);
  for (std::int64_t ranges : {1, 2, 5, 37}) {
    try {
      quantize_affine(weight, {4, 32}, DType::f16, AffineRounding::min_max, ranges);
      ADD_FAILURE() << "NaN weight accepted with " << ranges << " ranges";
    } catch (const InputError& error) {
      EXPECT_NE(std::string(error.what()).find("[2, 9]"), std::string::npos) << ranges << ": " << error.what();
    }
  }
}

TEST(QuantizedMatrix, FromTensorsChecksEverySpec) {
  const QuantizedMatrix good = quantize_affine(random_matrix(4, 128, 17), {4, 64}, DType::f16);
  EXPECT_NO_THROW(QuantizedMatrix::from_tensors(good.format, good.packed, good.scales, good.biases));
  const QuantizedMatrix rebuilt =
      QuantizedMatrix::from_tensors(good.format, good.packed, good.scales, good.biases);
  EXPECT_EQ(rebuilt.rows, 4);
  EXPECT_EQ(rebuilt.columns, 128);
  EXPECT_THROW(QuantizedMatrix::from_tensors({4, 32}, good.packed, good.scales, good.biases), InputError);
  EXPECT_THROW(QuantizedMatrix::from_tensors({8, 64}, good.packed, good.scales, good.biases), InputError);
  EXPECT_THROW(QuantizedMatrix::from_tensors(good.format, HostTensor(TensorSpec({4, 16}, DType::i32)),
                                             good.scales, good.biases),
               InputError);
  EXPECT_THROW(QuantizedMatrix::from_tensors(good.format, good.packed, good.scales,
                                             HostTensor(TensorSpec({4, 2}, DType::f32))),
               InputError);
  EXPECT_THROW(QuantizedMatrix::from_tensors(good.format, good.packed,
                                             HostTensor(TensorSpec({4, 2}, DType::i32)), good.biases),
               InputError);
  QuantizedMatrix broken = good;
  broken.rows = 5;
  std::vector<float> row(128);
  EXPECT_THROW(dequantize_affine_row(broken, 0, row), InputError);
  EXPECT_THROW(dequantize_affine_row(good, 4, row), InputError);
}

}  // namespace
}  // namespace metile
