// Affine quantization in MLX's format: validation, bit packing, quantize and
// the reference dequantization (format described in include/metile/quant.h).
// Quantization is offline work, so it computes scales and biases in f64 and
// rounds them once to their dtype; dequantization is on the hot path of the
// CPU reference executor, so it reads the packed words directly.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "metile/quant.h"
#include "parallel.h"

namespace metile {
namespace {

void validate_bits(int bits) {
  if (bits != 4 && bits != 8) {
    throw InputError(fmt::format("affine quantization: bits must be 4 or 8, got {}", bits));
  }
}

std::uint32_t read_word(const HostTensor& tensor, std::int64_t index) {
  std::uint32_t word = 0;
  std::memcpy(&word, tensor.bytes().data() + index * static_cast<std::int64_t>(sizeof word), sizeof word);
  return word;
}

// What every backend makes of a code: the product rounded to f32, then the bias added (no fused
// multiply-add). The one statement of it on the host (dequantize_affine_row, quantize_affine's check).
float dequantize_code(float scale, float bias, std::uint32_t code) {
  const float product = scale * static_cast<float>(code);
  return product + bias;
}

struct GroupParameters {
  double scale = 0;
  double bias = 0;
};

// The scale and bias a group gets before rounding to the scale dtype.
GroupParameters choose_group_parameters(double minimum, double maximum, std::uint32_t max_code,
                                        AffineRounding rounding) {
  // MLX's floor on the scale keeps a constant group from dividing by zero.
  constexpr double smallest_scale = 1e-7;
  const double spread = std::max((maximum - minimum) / max_code, smallest_scale);
  if (rounding == AffineRounding::min_max) return {spread, minimum};
  const bool minimum_is_larger = std::abs(minimum) > std::abs(maximum);
  const double scale = minimum_is_larger ? spread : -spread;
  const double edge = minimum_is_larger ? minimum : maximum;
  const double edge_code = std::nearbyint(edge / scale);
  if (edge_code == 0) return {scale, 0.0};
  return {edge / edge_code, edge};
}

}  // namespace

void AffineQuantization::validate() const {
  validate_bits(bits);
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw InputError(
        fmt::format("affine quantization: group_size must be 32, 64 or 128, got {}", group_size));
  }
}

void AffineQuantization::check_columns(std::int64_t columns) const {
  validate();
  if (columns <= 0 || columns % group_size != 0) {
    throw InputError(fmt::format(
        "affine quantization: {} columns is not a positive multiple of group_size {}", columns, group_size));
  }
}

QuantizedMatrix QuantizedMatrix::from_tensors(AffineQuantization format, HostTensor packed, HostTensor scales,
                                              HostTensor biases) {
  format.validate();
  const TensorSpec& packed_spec = packed.spec();
  if (packed_spec.dtype != DType::u32 || packed_spec.rank() != 2) {
    throw InputError(
        fmt::format("quantized matrix: packed weights must be u32 [rows, packed columns], got {}",
                    packed_spec.to_string()));
  }
  QuantizedMatrix matrix;
  matrix.format = format;
  matrix.rows = packed_spec.shape[0];
  matrix.columns = packed_spec.shape[1] * format.codes_per_word();
  matrix.packed = std::move(packed);
  matrix.scales = std::move(scales);
  matrix.biases = std::move(biases);
  matrix.validate();
  return matrix;
}

void QuantizedMatrix::validate() const {
  format.check_columns(columns);
  if (rows <= 0) throw InputError(fmt::format("quantized matrix: {} rows is not positive", rows));
  const TensorSpec expected_packed({rows, format.packed_columns(columns)}, DType::u32);
  if (packed.spec() != expected_packed) {
    throw InputError(fmt::format("quantized matrix: packed weights are {}, expected {}",
                                 packed.spec().to_string(), expected_packed.to_string()));
  }
  if (!is_floating(scales.spec().dtype)) {
    throw InputError(
        fmt::format("quantized matrix: scales must be f16, bf16 or f32, got {}", scales.spec().to_string()));
  }
  const TensorSpec expected_groups({rows, format.group_count(columns)}, scales.spec().dtype);
  if (scales.spec() != expected_groups) {
    throw InputError(fmt::format("quantized matrix: scales are {}, expected {} (group_size {})",
                                 scales.spec().to_string(), expected_groups.to_string(), format.group_size));
  }
  if (biases.spec() != expected_groups) {
    throw InputError(fmt::format("quantized matrix: biases are {}, expected {} like the scales",
                                 biases.spec().to_string(), expected_groups.to_string()));
  }
}

std::vector<std::uint32_t> pack_codes(std::span<const std::uint32_t> codes, int bits) {
  validate_bits(bits);
  const std::size_t per_word = static_cast<std::size_t>(32 / bits);
  if (codes.size() % per_word != 0) {
    throw InputError(
        fmt::format("pack_codes: {} codes do not fill whole words of {} codes", codes.size(), per_word));
  }
  const std::uint32_t max_code = (std::uint32_t{1} << bits) - 1;
  std::vector<std::uint32_t> words(codes.size() / per_word, 0);
  for (std::size_t index = 0; index < codes.size(); ++index) {
    if (codes[index] > max_code) {
      throw InputError(fmt::format("pack_codes: code {} at position {} does not fit in {} bits", codes[index],
                                   index, bits));
    }
    words[index / per_word] |= codes[index] << (bits * static_cast<int>(index % per_word));
  }
  return words;
}

std::vector<std::uint32_t> unpack_codes(std::span<const std::uint32_t> words, int bits) {
  validate_bits(bits);
  const std::size_t per_word = static_cast<std::size_t>(32 / bits);
  const std::uint32_t max_code = (std::uint32_t{1} << bits) - 1;
  std::vector<std::uint32_t> codes(words.size() * per_word);
  for (std::size_t index = 0; index < codes.size(); ++index) {
    codes[index] = (words[index / per_word] >> (bits * static_cast<int>(index % per_word))) & max_code;
  }
  return codes;
}

QuantizedMatrix quantize_affine(const HostTensor& weight, AffineQuantization format, DType scale_dtype,
                                AffineRounding rounding, std::int64_t ranges) {
  const TensorSpec& spec = weight.spec();
  if (spec.rank() != 2 || !is_floating(spec.dtype)) {
    throw InputError(fmt::format(
        "quantize_affine: weight must be a floating-point [rows, columns] matrix, got {}", spec.to_string()));
  }
  if (!is_floating(scale_dtype)) {
    throw InputError(
        fmt::format("quantize_affine: scales must be f16, bf16 or f32, got {}", dtype_name(scale_dtype)));
  }
  const std::int64_t rows = spec.shape[0];
  const std::int64_t columns = spec.shape[1];
  format.check_columns(columns);
  if (rows <= 0) throw InputError(fmt::format("quantize_affine: {} rows is not positive", rows));

  QuantizedMatrix matrix;
  matrix.format = format;
  matrix.rows = rows;
  matrix.columns = columns;
  matrix.packed = HostTensor(TensorSpec({rows, format.packed_columns(columns)}, DType::u32));
  matrix.scales = HostTensor(TensorSpec({rows, format.group_count(columns)}, scale_dtype));
  matrix.biases = HostTensor(matrix.scales.spec());

  const std::uint32_t max_code = format.max_code();
  const std::int64_t groups = format.group_count(columns);
  const int per_word = format.codes_per_word();
  const DType dtype = spec.dtype;
  const std::byte* source = weight.bytes().data();
  std::byte* packed = matrix.packed.bytes().data();
  // weight.at(index), without its bounds check and dtype dispatch per element: the same double.
  const auto value_at = [dtype, source](std::int64_t index) -> double {
    std::uint16_t bits = 0;
    float value = 0;
    switch (dtype) {
      case DType::bf16: std::memcpy(&bits, source + index * 2, 2); return bf16_bits_to_f32(bits);
      case DType::f16: std::memcpy(&bits, source + index * 2, 2); return f16_bits_to_f32(bits);
      default: std::memcpy(&value, source + index * 4, 4); return value;  // f32 (is_floating above)
    }
  };
  // Rows are independent (each writes its own words, scales and biases), so ranges of rows run
  // at once; the bytes are those of the sequential loop whatever the split.
  const auto quantize_rows = [&](std::int64_t first_row, std::int64_t last_row) {
    std::vector<double> values(static_cast<std::size_t>(format.group_size));
    for (std::int64_t row = first_row; row < last_row; ++row) {
      for (std::int64_t group = 0; group < groups; ++group) {
        const std::int64_t first = row * columns + group * format.group_size;
        double minimum = INFINITY;
        double maximum = -INFINITY;
        for (std::int64_t offset = 0; offset < format.group_size; ++offset) {
          const double value = value_at(first + offset);
          if (!std::isfinite(value)) {
            throw InputError(fmt::format("quantize_affine: weight [{}, {}] is {}", row,
                                         group * format.group_size + offset, value));
          }
          values[static_cast<std::size_t>(offset)] = value;
          minimum = std::min(minimum, value);
          maximum = std::max(maximum, value);
        }
        const GroupParameters exact = choose_group_parameters(minimum, maximum, max_code, rounding);
        const std::int64_t group_index = row * groups + group;
        matrix.scales.store(group_index, exact.scale);
        matrix.biases.store(group_index, exact.bias);
        // Codes are chosen against the stored (rounded) scale and bias.
        const double scale = matrix.scales.at(group_index);
        const double bias = matrix.biases.at(group_index);
        // A range beyond the scale dtype (f32 weights past 65504 with f16 scales) rounds the scale or
        // the bias to infinity: every weight of the group would dequantize to inf or NaN.
        // Finite ones can still overflow f32 in scale * q + bias (weights near f32's limit). The product
        // and the sum round monotonically, so the codes 0 and max_code give the extremes of the group.
        if (!std::isfinite(scale) || !std::isfinite(bias) ||
            !std::isfinite(dequantize_code(static_cast<float>(scale), static_cast<float>(bias), 0)) ||
            !std::isfinite(dequantize_code(static_cast<float>(scale), static_cast<float>(bias), max_code))) {
          throw InputError(fmt::format(
              "quantize_affine: weights [{}, {}..{}] span [{}, {}]: scale {} and bias {} in {} do not dequantize "
              "to finite values",
              row, group * format.group_size, (group + 1) * format.group_size - 1, minimum, maximum, scale, bias,
              dtype_name(scale_dtype)));
        }
        // Packed as pack_codes packs (low bits first); the clamp keeps every code in its bits.
        std::uint32_t word = 0;
        for (std::int64_t offset = 0; offset < format.group_size; ++offset) {
          double code = scale == 0 ? 0.0 : std::nearbyint((values[static_cast<std::size_t>(offset)] - bias) / scale);
          code = std::clamp(code, 0.0, static_cast<double>(max_code));
          const int slot = static_cast<int>(offset % per_word);
          word |= static_cast<std::uint32_t>(code) << (format.bits * slot);
          if (slot == per_word - 1) {
            const std::int64_t word_index = (first + offset) / per_word;
            std::memcpy(packed + word_index * static_cast<std::int64_t>(sizeof word), &word, sizeof word);
            word = 0;
          }
        }
      }
    }
  };
  constexpr std::int64_t kWeightsPerRange = std::int64_t{1} << 20;
  parallel_ranges(rows, ranges > 0 ? ranges : ranges_for(rows * columns, kWeightsPerRange), quantize_rows);
  return matrix;
}

void dequantize_affine_row(const QuantizedMatrix& matrix, std::int64_t row, std::span<float> out) {
  matrix.validate();  // a few shape comparisons; keeps a hand-assembled matrix from reading out of bounds
  if (row < 0 || row >= matrix.rows || static_cast<std::int64_t>(out.size()) != matrix.columns) {
    throw InputError(fmt::format("dequantize_affine_row: row {} of {} into {} values (expected {})", row,
                                 matrix.rows, out.size(), matrix.columns));
  }
  dequantize_affine_row(matrix.format, matrix.packed, matrix.scales, matrix.biases, row, out);
}

void dequantize_affine_row(AffineQuantization format, const HostTensor& packed, const HostTensor& scales,
                           const HostTensor& biases, std::int64_t row, std::span<float> out) {
  const int per_word = format.codes_per_word();
  const std::uint32_t max_code = format.max_code();
  const auto columns = static_cast<std::int64_t>(out.size());
  const std::int64_t groups = format.group_count(columns);
  const std::int64_t words_per_group = format.group_size / per_word;
  if (row < 0 || (row + 1) * groups > scales.element_count() || (row + 1) * groups > biases.element_count() ||
      (row + 1) * columns / per_word > packed.element_count()) {
    throw InputError(fmt::format("dequantize_affine_row: row {} of {} columns lies outside packed {} / scales {}",
                                 row, columns, packed.spec().to_string(), scales.spec().to_string()));
  }
  for (std::int64_t group = 0; group < groups; ++group) {
    const auto scale = static_cast<float>(scales.at(row * groups + group));
    const auto bias = static_cast<float>(biases.at(row * groups + group));
    for (std::int64_t word_in_group = 0; word_in_group < words_per_group; ++word_in_group) {
      const std::int64_t word_index = (row * columns + group * format.group_size) / per_word + word_in_group;
      const std::uint32_t word = read_word(packed, word_index);
      for (int slot = 0; slot < per_word; ++slot) {
        out[static_cast<std::size_t>(group * format.group_size + word_in_group * per_word + slot)] =
            dequantize_code(scale, bias, (word >> (format.bits * slot)) & max_code);
      }
    }
  }
}

HostTensor dequantize_affine(const QuantizedMatrix& matrix, DType output_dtype) {
  if (!is_floating(output_dtype)) {
    throw InputError(
        fmt::format("dequantize_affine: output must be f16, bf16 or f32, got {}", dtype_name(output_dtype)));
  }
  HostTensor weight(TensorSpec({matrix.rows, matrix.columns}, output_dtype));
  std::vector<float> row_values(static_cast<std::size_t>(matrix.columns));
  for (std::int64_t row = 0; row < matrix.rows; ++row) {
    dequantize_affine_row(matrix, row, row_values);
    for (std::int64_t column = 0; column < matrix.columns; ++column) {
      weight.store(row * matrix.columns + column, row_values[static_cast<std::size_t>(column)]);
    }
  }
  return weight;
}

}  // namespace metile
