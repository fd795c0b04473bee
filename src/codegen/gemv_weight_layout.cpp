// The weight layouts the generated GEMV reads, and the one-time repacking of MLX affine
// matrices into them. The layout is defined here and nowhere else: the mainloop generator
// (gemv_mainloop.cpp) indexes exactly what repack_for_gemv writes, and unpack_from_gemv is its
// exact inverse so that tests can prove nothing was lost.
//
// Per 16-row tile and per "load block" (the columns one 16-byte vector holds per lane: 128 at
// 4 bits, 64 at 8 bits), 256 words: two halves (rows 0..7, rows 8..15) of 32 lanes x 4 words.
// Lane (g, t) = (lane / 4, lane % 4) holds row g (+8) columns 32c + 8t .. 32c + 8t + 7 of each
// 32-column chunk c. Inside a word the codes are reordered so that `(word >> 4j) & 0x000F000F`
// (4-bit) or `(word >> 8j) & 0x00FF00FF` (8-bit) is the pair (column 2j', column 2j'+1) that an
// m16n8k16 A fragment register wants:
//     4-bit word nibbles, low to high:  w0 w2 w4 w6 w1 w3 w5 w7
//     8-bit word bytes,   low to high:  w0 w2 w1 w3       (two words per chunk)
#include <fmt/core.h>

#include <algorithm>
#include <cstring>

#include "gemv_internal.h"
#include "metile/gemv.h"

namespace metile {
namespace {

// Code positions inside one repacked word: repacked slot i holds original code nibble_order[i] (4-bit) or byte_order[i] (8-bit).
constexpr int nibble_order[8] = {0, 2, 4, 6, 1, 3, 5, 7};
constexpr int byte_order[4] = {0, 2, 1, 3};

// The repacking and its exact inverse walk the same table: to_repacked gathers original code
// order[slot] into slot, to_original scatters it back.
enum class CodeMove { to_repacked, to_original };

std::uint32_t move_codes(std::uint32_t word, int bits, CodeMove move) {
  std::uint32_t result = 0;
  const int codes = 32 / bits;
  const std::uint32_t mask = (1u << bits) - 1;
  for (int slot = 0; slot < codes; ++slot) {
    const int original = bits == 4 ? nibble_order[slot] : byte_order[slot];
    const int from = move == CodeMove::to_repacked ? original : slot;
    const int to = move == CodeMove::to_repacked ? slot : original;
    result |= ((word >> (bits * from)) & mask) << (bits * to);
  }
  return result;
}


// For lane (g, t), half h, word `slot` of its 16-byte vector: the original word index in the row
// (relative to the start of the row) and the row offset inside the tile.
struct WordSource {
  std::int64_t original_word;
  int row_in_tile;
};
WordSource word_source(int bits, std::int64_t load_block, int half, int lane, int slot) {
  const int g = lane / 4, t = lane % 4;
  if (bits == 4) {  // one word per 32-column chunk: slot = chunk
    return {16 * load_block + 4 * slot + t, 8 * half + g};
  }
  // 8-bit: two words per chunk; slot = 2 * chunk + which half of the lane's 8 columns
  const int chunk = slot / 2, part = slot % 2;
  return {16 * load_block + 8 * chunk + 2 * t + part, 8 * half + g};
}

// The repacking and its inverse walk the same two placements; each is written once here and the
// callers only choose the copy direction.
// Every word of the repacked stream that holds real data: visit(repacked index, row, original word
// index within the row). Padding words (rows past the matrix, words past the row) are skipped.
template <typename Visit>
void for_each_placed_word(int bits, std::int64_t tiles, std::int64_t load_blocks, std::int64_t rows,
                          std::int64_t words_per_row, Visit visit) {
  std::size_t index = 0;
  for (std::int64_t tile = 0; tile < tiles; ++tile) {
    for (std::int64_t block = 0; block < load_blocks; ++block) {
      for (int half = 0; half < 2; ++half) {
        for (int lane = 0; lane < 32; ++lane) {
          for (int slot = 0; slot < 4; ++slot, ++index) {
            const WordSource source = word_source(bits, block, half, lane, slot);
            const std::int64_t row = tile * 16 + source.row_in_tile;
            if (row >= rows || source.original_word >= words_per_row) continue;
            visit(index, row, source.original_word);
          }
        }
      }
    }
  }
}

// Every (scale, bias) pair of the repacked stream: visit(index of the scale in scale_bias, element
// row * groups + group of the original [rows, groups] tensors); the bias follows its scale.
template <typename Visit>
void for_each_placed_scale_bias(std::int64_t tiles, std::int64_t groups, std::int64_t padded_groups,
                                std::int64_t rows, Visit visit) {
  for (std::int64_t tile = 0; tile < tiles; ++tile) {
    for (std::int64_t group_index = 0; group_index < groups; ++group_index) {
      for (int g = 0; g < 8; ++g) {
        for (int half = 0; half < 2; ++half) {
          const std::int64_t row = tile * 16 + 8 * half + g;
          if (row >= rows) continue;
          visit(static_cast<std::size_t>(((tile * padded_groups + group_index) * 8 + g) * 4 + 2 * half),
                row * groups + group_index);
        }
      }
    }
  }
}

}  // namespace

void GemvWeightFormat::validate() const {
  if (activation != DType::f16 && activation != DType::bf16) {
    throw InputError(fmt::format("GEMV format: activations must be f16 or bf16, not {}", dtype_name(activation)));
  }
  if (bits == 16) {
    if (group_size != 0) throw InputError(fmt::format("GEMV format: a dense matrix has no group size ({})", group_size));
    return;
  }
  if (bits != 4 && bits != 8) throw InputError(fmt::format("GEMV format: bits must be 4, 8 or 16 (dense), not {}", bits));
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw InputError(fmt::format("GEMV format: group size must be 32, 64 or 128, not {}", group_size));
  }
}

std::string GemvWeightFormat::to_string() const {
  if (!is_affine()) return std::string(dtype_name(activation));
  return fmt::format("{} affine{} g{}", dtype_name(activation), bits, group_size);
}

int GemvWeightFormat::columns_per_load() const { return 32 * (bits == 16 ? 1 : bits == 8 ? 2 : 4); }

int GemvWeightFormat::columns_per_iteration() const {
  const int per_load = columns_per_load();
  return is_affine() ? std::max(per_load, group_size) : per_load;
}

RepackedAffineMatrix repack_for_gemv(const QuantizedMatrix& matrix) {
  matrix.validate();
  const DType scale_dtype = matrix.scales.spec().dtype;
  RepackedAffineMatrix result;
  result.format = GemvWeightFormat::affine(matrix.format.bits, matrix.format.group_size, scale_dtype);
  result.format.validate();
  const int bits = result.format.bits;
  const int group = result.format.group_size;
  result.rows = matrix.rows;
  result.columns = matrix.columns;
  result.padded_rows = gemv_detail::round_up(matrix.rows, 16);
  result.padded_columns = gemv_detail::round_up(matrix.columns, result.format.columns_per_iteration());

  const std::int64_t tiles = result.padded_rows / 16;
  const std::int64_t load_blocks = result.padded_columns / result.format.columns_per_load();
  const std::int64_t words_per_row = matrix.columns * bits / 32;
  result.words.assign(static_cast<std::size_t>(tiles * load_blocks * 256), 0);
  auto packed = matrix.packed.bytes();
  auto original_word = [&](std::int64_t row, std::int64_t word) {
    std::uint32_t value = 0;
    std::copy_n(packed.data() + (row * words_per_row + word) * 4, 4, reinterpret_cast<std::byte*>(&value));
    return value;
  };
  for_each_placed_word(bits, tiles, load_blocks, matrix.rows, words_per_row,
                       [&](std::size_t index, std::int64_t row, std::int64_t word) {
                         result.words[index] = move_codes(original_word(row, word), bits, CodeMove::to_repacked);
                       });

  const std::int64_t groups = matrix.columns / group;
  const std::int64_t padded_groups = result.padded_columns / group;
  result.scale_bias.assign(static_cast<std::size_t>(tiles * padded_groups * 32), 0);
  auto read_u16 = [](const HostTensor& tensor, std::int64_t element) {
    std::uint16_t value = 0;
    std::copy_n(tensor.bytes().data() + element * 2, 2, reinterpret_cast<std::byte*>(&value));
    return value;
  };
  for_each_placed_scale_bias(tiles, groups, padded_groups, matrix.rows, [&](std::size_t base, std::int64_t element) {
    result.scale_bias[base] = read_u16(matrix.scales, element);
    result.scale_bias[base + 1] = read_u16(matrix.biases, element);
  });
  return result;
}

QuantizedMatrix unpack_from_gemv(const RepackedAffineMatrix& repacked) {
  const GemvWeightFormat& format = repacked.format;
  format.validate();
  if (!format.is_affine()) throw InputError("unpack_from_gemv: the matrix is dense");
  const int bits = format.bits;
  const std::int64_t tiles = repacked.padded_rows / 16;
  const std::int64_t load_blocks = repacked.padded_columns / format.columns_per_load();
  const std::int64_t words_per_row = repacked.columns * bits / 32;
  const std::int64_t groups = repacked.columns / format.group_size;
  const std::int64_t padded_groups = repacked.padded_columns / format.group_size;
  if (repacked.padded_rows % 16 != 0 || repacked.padded_rows < repacked.rows ||
      repacked.padded_columns % format.columns_per_iteration() != 0 || repacked.padded_columns < repacked.columns ||
      repacked.words.size() != static_cast<std::size_t>(tiles * load_blocks * 256) ||
      repacked.scale_bias.size() != static_cast<std::size_t>(tiles * padded_groups * 32)) {
    throw InputError(fmt::format("unpack_from_gemv: sizes do not describe a {} x {} {} matrix", repacked.rows,
                                 repacked.columns, format.to_string()));
  }

  HostTensor packed(TensorSpec({repacked.rows, words_per_row}, DType::u32));
  HostTensor scales(TensorSpec({repacked.rows, groups}, format.activation));
  HostTensor biases(TensorSpec({repacked.rows, groups}, format.activation));
  for_each_placed_word(bits, tiles, load_blocks, repacked.rows, words_per_row,
                       [&](std::size_t index, std::int64_t row, std::int64_t word) {
                         const std::uint32_t value = move_codes(repacked.words[index], bits, CodeMove::to_original);
                         std::copy_n(reinterpret_cast<const std::byte*>(&value), 4,
                                     packed.bytes().data() + (row * words_per_row + word) * 4);
                       });
  for_each_placed_scale_bias(tiles, groups, padded_groups, repacked.rows, [&](std::size_t base, std::int64_t element) {
    std::copy_n(reinterpret_cast<const std::byte*>(&repacked.scale_bias[base]), 2, scales.bytes().data() + element * 2);
    std::copy_n(reinterpret_cast<const std::byte*>(&repacked.scale_bias[base + 1]), 2,
                biases.bytes().data() + element * 2);
  });
  return QuantizedMatrix::from_tensors(format.quantization(), std::move(packed), std::move(scales), std::move(biases));
}

HostTensor stack_rows(std::span<const HostTensor> parts) {
  if (parts.empty()) throw InputError("stack_rows: no tensors to stack");
  TensorSpec stacked = parts.front().spec();
  if (stacked.rank() < 1) throw InputError("stack_rows: a scalar has no rows to stack");
  stacked.shape[0] = 0;
  for (const HostTensor& part : parts) {
    TensorSpec alike = part.spec();
    if (alike.rank() != stacked.rank() || alike.dtype != stacked.dtype) {
      throw InputError(fmt::format("stack_rows: {} does not stack with {}", alike.to_string(), parts.front().spec().to_string()));
    }
    stacked.shape[0] += alike.shape[0];
    alike.shape[0] = 0;
    TensorSpec first = parts.front().spec();
    first.shape[0] = 0;
    if (alike != first) {
      throw InputError(fmt::format("stack_rows: {} does not stack with {}", part.spec().to_string(), parts.front().spec().to_string()));
    }
  }
  HostTensor result(stacked);
  std::size_t offset = 0;
  for (const HostTensor& part : parts) {
    std::copy(part.bytes().begin(), part.bytes().end(), result.bytes().begin() + static_cast<std::ptrdiff_t>(offset));
    offset += part.bytes().size();
  }
  return result;
}

HostTensor gather_rows(const HostTensor& tensor, std::span<const std::int64_t> order) {
  const TensorSpec& spec = tensor.spec();
  if (spec.rank() < 1 || static_cast<std::int64_t>(order.size()) != spec.shape[0]) {
    throw InputError(fmt::format("gather_rows: {} rows asked of {}", order.size(), spec.to_string()));
  }
  HostTensor result(spec);
  const std::size_t row_bytes = spec.shape[0] == 0 ? 0 : tensor.bytes().size() / static_cast<std::size_t>(spec.shape[0]);
  for (std::size_t row = 0; row < order.size(); ++row) {
    if (order[row] < 0 || order[row] >= spec.shape[0]) {
      throw InputError(fmt::format("gather_rows: row {} of {} does not exist", order[row], spec.to_string()));
    }
    const auto from = tensor.bytes().begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(order[row]) * row_bytes);
    std::copy(from, from + static_cast<std::ptrdiff_t>(row_bytes),
              result.bytes().begin() + static_cast<std::ptrdiff_t>(row * row_bytes));
  }
  return result;
}

AffineCodeDecode affine_code_decode(int bits, DType activation, bool half_products) {
  GemvWeightFormat::affine(bits, 32, activation).validate();
  const bool half = half_products || activation == DType::f16;
  AffineCodeDecode decode;
  if (bits == 4 && half_products) {
    // Pair 2i: the low nibble of each 16-bit half of word >> 8i (1024 + q); pair 2i + 1: the nibble
    // above it, which f16's 10 mantissa bits hold too (1024 + 16 q). The repacked layout puts pair
    // j's codes at nibbles j and j + 4, so both masks read the same shifted word.
    decode.method = AffineCodeDecode::Method::nibble_classes;
    decode.mask = 0x000F000Fu;
    decode.odd_mask = 0x00F000F0u;
    decode.magic = 0x64006400u;
    decode.offset = 1024.0;
  } else if (bits == 4) {
    // 0x6400 is f16 1024 (10 mantissa bits), 0x4300 is bf16 128 (7 mantissa bits): 4 bits fit both.
    decode.method = AffineCodeDecode::Method::mask_or;
    decode.mask = 0x000F000Fu;
    decode.magic = half ? 0x64006400u : 0x43004300u;
    decode.shift = 4;
    decode.offset = half ? 1024.0 : 128.0;
  } else if (half) {
    decode.method = AffineCodeDecode::Method::byte_permute;
    decode.magic = 0x64646464u;
    decode.offset = 1024.0;
  } else {
    decode.method = AffineCodeDecode::Method::through_f32;
    decode.offset = 0.0;
  }
  return decode;
}

int AffineCodeDecode::code_scale(int pair) const { return method == Method::nibble_classes && pair % 2 == 1 ? 16 : 1; }

std::uint32_t AffineCodeDecode::selector(int pair) const {
  // prmt numbers the bytes of {b, a} 0..7, a's first: byte j and j + 2 of the word, each under byte 4
  // (the magic's low byte).
  return 0x4040u | static_cast<std::uint32_t>(pair) | (static_cast<std::uint32_t>(pair + 2) << 8);
}

namespace {
// PTX prmt (default mode): result byte i is byte selector[i] (its low 3 bits) of the 8 bytes {b, a}.
std::uint32_t byte_permute(std::uint32_t a, std::uint32_t b, std::uint32_t selector) {
  const std::uint64_t bytes = (std::uint64_t{b} << 32) | a;
  std::uint32_t result = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned from = (selector >> (4 * i)) & 7u;
    result |= static_cast<std::uint32_t>((bytes >> (8 * from)) & 0xFFu) << (8 * i);
  }
  return result;
}
}  // namespace

std::uint32_t decode_affine_code_pair(const AffineCodeDecode& decode, std::uint32_t word, int pair) {
  switch (decode.method) {
    case AffineCodeDecode::Method::mask_or:
      return ((word >> (decode.shift * pair)) & decode.mask) | decode.magic;  // lop3 0xEA: (a & b) | c
    case AffineCodeDecode::Method::nibble_classes:
      return ((word >> (8 * (pair / 2))) & (pair % 2 == 1 ? decode.odd_mask : decode.mask)) | decode.magic;
    case AffineCodeDecode::Method::byte_permute:
      return byte_permute(word, decode.magic, decode.selector(pair));
    case AffineCodeDecode::Method::through_f32: {
      // float(2^23 + q) - 2^23 = q, then cvt.rn.bf16x2.f32 (exact: q < 256 has 8 significant bits).
      auto bf16_of_code = [&](int byte) {
        const std::uint32_t biased = byte_permute(word, 0x4B000000u, 0x7540u | static_cast<std::uint32_t>(byte));
        float value = 0.0f;
        std::memcpy(&value, &biased, 4);
        value -= 8388608.0f;
        return f32_to_bf16_bits(value);
      };
      return std::uint32_t{bf16_of_code(pair)} | (std::uint32_t{bf16_of_code(pair + 2)} << 16);
    }
  }
  return 0;
}

std::vector<std::int64_t> gemv_rope_row_order(const GemvRopeCacheEpilogue& rope) {
  const std::int64_t dims = rope.dims();
  if (rope.q_heads < 1 || rope.kv_heads < 1 || rope.head_dim < 2 || rope.head_dim % 2 != 0 || dims < 2 ||
      dims % 2 != 0 || dims > rope.head_dim) {
    throw InputError(fmt::format("GEMV rope epilogue: {} q heads, {} kv heads, head dim {}, rotary dims {}: want heads "
                                 ">= 1 and even dims <= an even head dim",
                                 rope.q_heads, rope.kv_heads, rope.head_dim, dims));
  }
  const std::int64_t half = dims / 2;
  const std::int64_t rows = (rope.q_heads + 2 * rope.kv_heads) * rope.head_dim;
  std::vector<std::int64_t> order(static_cast<std::size_t>(rows));
  for (std::int64_t row = 0; row < rows; ++row) order[static_cast<std::size_t>(row)] = row;
  // Heads of q, then of k: pair j of a head moves to rows 2j (its low element) and 2j + 1 (its high one).
  for (std::int64_t head = 0; head < rope.q_heads + rope.kv_heads; ++head) {
    const std::int64_t first = head * rope.head_dim;
    for (std::int64_t j = 0; j < half; ++j) {
      order[static_cast<std::size_t>(first + 2 * j)] = first + j;
      order[static_cast<std::size_t>(first + 2 * j + 1)] = first + j + half;
    }
  }
  return order;
}

}  // namespace metile
