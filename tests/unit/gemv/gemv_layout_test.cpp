// Tests of the repacked affine layout the GEMV kernels read (gemv_weight_layout.cpp):
//  * round trip: unpack_from_gemv(repack_for_gemv(m)) == m, bit for bit, for every format and
//    for shapes that are not multiples of the tile or of the load block;
//  * the kernel's view: an emulation, written here from the PTX ISA's m16n8k16 fragment layout,
//    of how each lane extracts codes from its 16-byte vectors, checked element by element
//    against the original MLX codes (every (row, column) seen exactly once, padding zero);
//  * the scale/bias vectors each lane reads hold the scale and bias of its rows' groups.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <cmath>
#include <map>
#include <random>

#include "gemv_test_support.h"
#include "metile/gemv.h"
#include "metile/quant.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using gemv_testing::random_affine_matrix;

struct Shape {
  std::int64_t rows, columns;
};

std::vector<std::uint32_t> original_codes(const QuantizedMatrix& matrix) {
  std::vector<std::uint32_t> words(static_cast<std::size_t>(matrix.packed.element_count()));
  for (std::size_t i = 0; i < words.size(); ++i) words[i] = static_cast<std::uint32_t>(matrix.packed.at(static_cast<std::int64_t>(i)));
  return unpack_codes(words, matrix.format.bits);
}

std::vector<Shape> shapes_for(int group_size) {
  // Tile-aligned, a ragged last tile, a single partial tile, and K not a multiple of the load block.
  return {{64, 256}, {37, 384}, {5, 128}, {33, static_cast<std::int64_t>(group_size) * 3}};
}

TEST(GemvRepack, RoundTripIsExactForEveryFormat) {
  std::uint64_t seed = testing::test_seed("GemvRepack.RoundTripIsExactForEveryFormat");
  for (DType dtype : {DType::f16, DType::bf16}) {
    for (int bits : {4, 8}) {
      for (int group : {32, 64, 128}) {
        for (const Shape& shape : shapes_for(group)) {
          const QuantizedMatrix matrix = random_affine_matrix(shape.rows, shape.columns, bits, group, dtype, ++seed);
          const RepackedAffineMatrix repacked = repack_for_gemv(matrix);
          const std::string where = fmt::format("{}-bit g{} {} {}x{}", bits, group, dtype_name(dtype), shape.rows,
                                                shape.columns);
          EXPECT_EQ(repacked.padded_rows % 16, 0) << where;
          EXPECT_EQ(repacked.padded_columns % repacked.format.columns_per_iteration(), 0) << where;
          EXPECT_EQ(repacked.words.size(),
                    static_cast<std::size_t>(repacked.padded_rows * repacked.padded_columns * bits / 32))
              << where;
          const QuantizedMatrix back = unpack_from_gemv(repacked);
          EXPECT_EQ(back.format, matrix.format) << where;
          EXPECT_TRUE(back.packed == matrix.packed) << where;
          EXPECT_TRUE(back.scales == matrix.scales) << where;
          EXPECT_TRUE(back.biases == matrix.biases) << where;
        }
      }
    }
  }
}

TEST(GemvRepack, RepackingChangesTheWordsNotJustTheirOrder) {
  // A 4-bit word with distinct nibbles must come out with nibbles 0 2 4 6 1 3 5 7 (low to high).
  std::vector<std::uint32_t> codes(static_cast<std::size_t>(16 * 128));
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint32_t>(i % 8);
  const std::vector<std::uint32_t> words = pack_codes(codes, 4);
  HostTensor packed = HostTensor::from_values(TensorSpec({16, 16}, DType::u32),
                                              std::vector<double>(words.begin(), words.end()));
  HostTensor scales = gemv_testing::random_tensor(TensorSpec({16, 2}, DType::bf16), 7);
  const QuantizedMatrix matrix = QuantizedMatrix::from_tensors({4, 64}, packed, scales, scales);
  const RepackedAffineMatrix repacked = repack_for_gemv(matrix);
  EXPECT_EQ(words[0], 0x76543210u);
  EXPECT_EQ(repacked.words[0], 0x75316420u);
}

TEST(GemvRepack, RejectsWhatTheKernelsCannotRead) {
  QuantizedMatrix matrix = random_affine_matrix(16, 128, 4, 64, DType::bf16, 3);
  HostTensor f32_scales = gemv_testing::random_tensor(TensorSpec({16, 2}, DType::f32), 4);
  const QuantizedMatrix f32_matrix = QuantizedMatrix::from_tensors({4, 64}, matrix.packed, f32_scales, f32_scales);
  try {
    repack_for_gemv(f32_matrix);
    FAIL() << "f32 scales were accepted";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("f16 or bf16"), std::string::npos) << error.what();
  }
  RepackedAffineMatrix repacked = repack_for_gemv(matrix);
  repacked.words.pop_back();
  EXPECT_THROW(unpack_from_gemv(repacked), InputError);
}

// What one lane of the generated kernel reads, rebuilt from the PTX ISA's m16n8k16 layout:
// A register r (0..3) element e (0, 1) of lane (g, t) is A[row g + 8 (r % 2)][column 2t + e + 8 (r / 2)].
// The kernel's column permutation puts that element at physical column
//     chunk_start + 8t + 4 * step + 2 * (r / 2) + e
// and its B fragment reads x at exactly these columns (b0 = x16[2 step], b1 = x16[2 step + 1]).
struct KernelView {
  std::uint32_t code;
  std::int64_t row, column;
};

// One 16-bit half of a fragment register as a number.
double half_value(std::uint32_t pair_bits, int element, DType activation) {
  const auto bits16 = static_cast<std::uint16_t>(pair_bits >> (16 * element));
  return activation == DType::f16 ? f16_bits_to_f32(bits16) : bf16_bits_to_f32(bits16);
}

// The code the kernel's decode (affine_code_decode, emulated on the host) puts at element `element`
// of the fragment register of pair `pair`: its value minus the offset.
std::uint32_t code_from_pair(std::uint32_t word, int bits, DType activation, int pair, int element) {
  const AffineCodeDecode decode = affine_code_decode(bits, activation);
  const double value = half_value(decode_affine_code_pair(decode, word, pair), element, activation);
  return static_cast<std::uint32_t>(value - decode.offset);
}

// Every code value at every place of a word decodes to exactly offset + q, the neighbours to theirs:
// the magic-number bit tricks (lop3, prmt, the f32 route) against integer arithmetic. The slot of
// pair j, element e is the repacked layout's (gemv_weight_layout.cpp): nibble j + 4e at 4 bits, byte
// j + 2e at 8 bits.
// With half products (the kernel multiplies in f16 whatever the activation dtype) the values are f16
// and nibble_classes' odd pairs are offset + 16 q.
TEST(GemvCodeDecode, EveryCodeDecodesExactlyToOffsetPlusCode) {
  const std::uint64_t seed = testing::test_seed("GemvCodeDecode.EveryCodeDecodesExactlyToOffsetPlusCode");
  std::mt19937_64 generator(seed);
  for (const auto& [dtype, half_products] : {std::pair{DType::bf16, false}, std::pair{DType::f16, false},
                                             std::pair{DType::bf16, true}, std::pair{DType::f16, true}}) {
    // The dtype of the decoded values.
    const DType activation = half_products ? DType::f16 : dtype;
    for (int bits : {4, 8}) {
      const AffineCodeDecode decode = affine_code_decode(bits, dtype, half_products);
      if (half_products && bits == 4) {
        EXPECT_EQ(decode.method, AffineCodeDecode::Method::nibble_classes);
      }
      const int codes_per_word = 32 / bits, pairs = codes_per_word / 2;
      const std::uint32_t max_code = (1u << bits) - 1;
      int mismatches = 0;
      for (int pair = 0; pair < pairs; ++pair) {
        for (int element = 0; element < 2; ++element) {
          const int slot = pair + pairs * element;
          for (std::uint32_t q = 0; q <= max_code; ++q) {
            for (int trial = 0; trial < 4; ++trial) {  // the other codes random, then all zeros / all ones
              std::uint32_t word = trial == 0 ? 0u : trial == 1 ? ~0u : static_cast<std::uint32_t>(generator());
              word = (word & ~(max_code << (bits * slot))) | (q << (bits * slot));
              const std::uint32_t pair_bits = decode_affine_code_pair(decode, word, pair);
              for (int e = 0; e < 2; ++e) {
                const std::uint32_t expected = e == element ? q : (word >> (bits * (pair + pairs * e))) & max_code;
                const double value = half_value(pair_bits, e, activation);
                const int scale = decode.code_scale(pair);
                if (value != decode.offset + scale * expected && ++mismatches <= 5) {
                  ADD_FAILURE() << dtype_name(dtype) << (half_products ? " half products " : " ") << bits << "-bit pair "
                                << pair << " element " << e << ": word 0x" << std::hex << word << std::dec
                                << " decodes to " << value << ", not " << decode.offset << " + " << scale << " x "
                                << expected;
                }
              }
            }
          }
        }
      }
      EXPECT_EQ(mismatches, 0) << dtype_name(dtype) << (half_products ? " half products " : " ") << bits << "-bit (seed "
                               << seed << ")";
    }
  }
}

// The kernels fold the offset into the bias: scale * (offset + q) + (bias - offset * scale) * 1 must
// be the reference dequantization scale * q + bias, here in float64 for every code and random
// bf16/f16 scales and biases, up to the f32 rounding of the kernel's per-group terms.
TEST(GemvCodeDecode, FoldedOffsetGivesTheReferenceDequantization) {
  const std::uint64_t seed = testing::test_seed("GemvCodeDecode.FoldedOffsetGivesTheReferenceDequantization");
  std::mt19937_64 generator(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (DType activation : {DType::bf16, DType::f16}) {
    for (int bits : {4, 8}) {
      const AffineCodeDecode decode = affine_code_decode(bits, activation);
      for (int trial = 0; trial < 64; ++trial) {
        const float scale = round_to_dtype(uniform(generator) * 0.05f, activation);
        const float bias = round_to_dtype(uniform(generator), activation);
        // As the kernel computes it: offset term in f32 (fmaf), the code value exact.
        const float folded_bias = std::fmaf(-static_cast<float>(decode.offset), scale, bias);
        for (std::uint32_t q = 0; q < (1u << bits); ++q) {
          const std::uint32_t word = q | (q << (bits * (32 / bits / 2)));  // q in both halves of pair 0
          const double value = half_value(decode_affine_code_pair(decode, word, 0), 0, activation);
          const double kernel = static_cast<double>(scale) * value + static_cast<double>(folded_bias);
          const double reference = static_cast<double>(scale) * q + static_cast<double>(bias);
          // The fold is one f32 rounding of a term of size |offset * scale| + |bias|. Bounded by what the fold does not control (a fraction of a code step, and bias's own f32
          // rounding), so a fold that loses precision fails: the offsets used (0, 128, 1024) cost at most
          // |scale| 2^-14; one of 2^14 would not pass.
          const double tolerance = std::abs(scale) * 0x1p-10 + std::abs(bias) * 0x1p-23;
          ASSERT_NEAR(kernel, reference, tolerance) << dtype_name(activation) << " " << bits << "-bit q " << q
                                                    << " scale " << scale << " bias " << bias << " (seed " << seed << ")";
        }
      }
    }
  }
}

TEST(GemvRepack, KernelFragmentViewSeesEveryOriginalCodeOnce) {
  std::uint64_t seed = testing::test_seed("GemvRepack.KernelFragmentViewSeesEveryOriginalCodeOnce");
  for (int bits : {4, 8}) {
    for (int group : {32, 64, 128}) {
      for (const Shape& shape : shapes_for(group)) {
        // Both activation dtypes at 8 bits (their decodes differ), bf16 at 4 (one lop3 for both).
        const DType activation = bits == 8 && group == 64 ? DType::f16 : DType::bf16;
        const QuantizedMatrix matrix = random_affine_matrix(shape.rows, shape.columns, bits, group, activation, ++seed);
        const RepackedAffineMatrix repacked = repack_for_gemv(matrix);
        const std::vector<std::uint32_t> codes = original_codes(matrix);
        const std::string where = fmt::format("{}-bit g{} {} {}x{}", bits, group, dtype_name(activation), shape.rows, shape.columns);

        const int chunks_per_load = bits == 4 ? 4 : 2;
        const int columns_per_load = 32 * chunks_per_load;
        const int columns_per_iteration = repacked.format.columns_per_iteration();
        const int loads_per_iteration = columns_per_iteration / columns_per_load;
        const std::int64_t iterations = repacked.padded_columns / columns_per_iteration;
        const std::int64_t load_blocks = iterations * loads_per_iteration;
        const std::int64_t tiles = repacked.padded_rows / 16;

        std::map<std::pair<std::int64_t, std::int64_t>, int> seen;
        int mismatches = 0;
        for (std::int64_t tile = 0; tile < tiles; ++tile) {
          for (std::int64_t it = 0; it < iterations; ++it) {
            for (int chunk = 0; chunk < columns_per_iteration / 32; ++chunk) {
              const std::int64_t block = it * loads_per_iteration + chunk / chunks_per_load;
              for (int lane = 0; lane < 32; ++lane) {
                const int g = lane / 4, t = lane % 4;
                for (int step = 0; step < 2; ++step) {
                  for (int r = 0; r < 4; ++r) {
                    const int half = r % 2;  // a1, a3 come from the rows 8..15 vector
                    const std::size_t vector_start = static_cast<std::size_t>(((tile * load_blocks + block) * 2 + half) * 128 + lane * 4);
                    const int in_load = chunk % chunks_per_load;
                    const int slot = bits == 4 ? in_load : 2 * in_load + step;
                    const int pair = bits == 4 ? 2 * step + r / 2 : r / 2;
                    const std::uint32_t word = repacked.words[vector_start + static_cast<std::size_t>(slot)];
                    for (int e = 0; e < 2; ++e) {
                      const std::int64_t row = tile * 16 + g + 8 * half;
                      const std::int64_t column = it * columns_per_iteration + 32 * chunk + 8 * t + 4 * step + 2 * (r / 2) + e;
                      const std::uint32_t code = code_from_pair(word, bits, activation, pair, e);
                      ++seen[{row, column}];
                      const bool inside = row < shape.rows && column < shape.columns;
                      const std::uint32_t expected = inside ? codes[static_cast<std::size_t>(row * shape.columns + column)] : 0u;
                      if (code != expected && ++mismatches <= 5) {
                        ADD_FAILURE() << where << ": row " << row << " column " << column << " kernel reads " << code
                                      << ", MLX layout holds " << expected;
                      }
                    }
                  }
                }
              }
            }
          }
        }
        EXPECT_EQ(mismatches, 0) << where;
        EXPECT_EQ(seen.size(), static_cast<std::size_t>(repacked.padded_rows * repacked.padded_columns)) << where;
        for (const auto& [position, count] : seen) {
          if (count != 1) {
            ADD_FAILURE() << where << ": row " << position.first << " column " << position.second << " read " << count
                          << " times";
            break;
          }
        }
      }
    }
  }
}

TEST(GemvRepack, ScaleBiasVectorsHoldEachLanesGroups) {
  const QuantizedMatrix matrix = random_affine_matrix(37, 384, 4, 64, DType::f16, testing::test_seed("GemvRepack.ScaleBiasVectorsHoldEachLanesGroups"));
  const RepackedAffineMatrix repacked = repack_for_gemv(matrix);
  const std::int64_t groups = 384 / 64, padded_groups = repacked.padded_columns / 64;
  for (std::int64_t tile = 0; tile < repacked.padded_rows / 16; ++tile) {
    for (std::int64_t group = 0; group < padded_groups; ++group) {
      for (int g = 0; g < 8; ++g) {
        const std::size_t base = static_cast<std::size_t>(((tile * padded_groups + group) * 8 + g) * 4);
        for (int half = 0; half < 2; ++half) {
          const std::int64_t row = tile * 16 + 8 * half + g;
          const bool inside = row < 37 && group < groups;
          const double scale = f16_bits_to_f32(repacked.scale_bias[base + 2 * static_cast<std::size_t>(half)]);
          const double bias = f16_bits_to_f32(repacked.scale_bias[base + 2 * static_cast<std::size_t>(half) + 1]);
          EXPECT_EQ(scale, inside ? matrix.scales.at(row * groups + group) : 0.0) << row << " " << group;
          EXPECT_EQ(bias, inside ? matrix.biases.at(row * groups + group) : 0.0) << row << " " << group;
        }
      }
    }
  }
}

}  // namespace
}  // namespace metile
