// metile quant module: MLX's affine quantization format for weight matrices,
// the format `quantized_matmul` consumes (docs/architecture.md, op table). This is the
// reference: quantize, dequantize and the bit packing every backend must match.
//
// A weight W [N, K] (row n, column k) is cut along K into groups of
// `group_size` columns; each group of each row has one scale and one bias and
//   w[n, k] = scale[n, k / group_size] * q[n, k] + bias[n, k / group_size],
// q in [0, 2^bits - 1]. Codes are packed into u32 words [N, K * bits / 32],
// low bits first: with 4 bits, word j of a row holds columns 8j..8j+7 and
// column 8j sits in the lowest nibble; with 8 bits, 4 columns per word,
// lowest byte first. Scales and biases are [N, K / group_size] in the
// activation dtype (f16, bf16 or f32).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "metile/graph.h"

namespace metile {

// The format parameters: 4 or 8 bits per code, groups of 32, 64 or 128 columns.
struct AffineQuantization {
  int bits = 4;
  int group_size = 64;

  // Throws InputError naming the bad parameter.
  void validate() const;
  int codes_per_word() const { return 32 / bits; }
  std::uint32_t max_code() const { return (std::uint32_t{1} << bits) - 1; }
  // Throws InputError unless `columns` is a positive multiple of group_size
  // (every group size allowed is a multiple of codes_per_word()).
  void check_columns(std::int64_t columns) const;
  std::int64_t packed_columns(std::int64_t columns) const { return columns / codes_per_word(); }
  std::int64_t group_count(std::int64_t columns) const { return columns / group_size; }
  bool operator==(const AffineQuantization&) const = default;
};

// How quantize_affine picks each group's scale and bias. Both produce the same
// format (dequantization never needs to know which was used).
enum class AffineRounding : std::uint8_t {
  // scale = (max - min) / (2^bits - 1) >= 0, bias = min. Every element then
  // dequantizes within |scale| / 2 of its original value (up to the rounding
  // of scale and bias to their dtype). The default.
  min_max,
  // MLX's mx.quantize (mlx/ops.cpp, affine_quantize): the group edge with the
  // larger magnitude becomes the bias and the scale takes its sign (negative
  // when |max| >= |min|), then the scale is nudged to edge / q0 with
  // q0 = round(edge / scale), so that 0 falls on a code (up to the rounding of
  // scale and bias to their dtype). The element at the far edge may then be
  // off by up to one |scale|. MLX computes in the weight's dtype, we in f64,
  // so a scale can differ from MLX's in its last bit.
  mlx,
};

// A quantized [rows, columns] weight matrix: the three tensors a graph's
// quantized_matmul takes as (packed, scales, biases).
struct QuantizedMatrix {
  AffineQuantization format;
  std::int64_t rows = 0;
  std::int64_t columns = 0;
  HostTensor packed;  // u32 [rows, columns * bits / 32]
  HostTensor scales;  // float dtype [rows, columns / group_size]
  HostTensor biases;  // same spec as scales

  // Assembles a matrix from graph tensors, checking that their specs agree
  // with the format; throws InputError naming the tensor that does not.
  static QuantizedMatrix from_tensors(AffineQuantization format, HostTensor packed, HostTensor scales,
                                      HostTensor biases);
  void validate() const;
};

// Quantizes a 2-D floating-point weight [N, K]. Scales and biases are rounded
// to scale_dtype first and the codes are chosen against the rounded values,
// so that dequantize_affine reproduces exactly what was chosen. Codes are
// round-half-to-even of (w - bias) / scale, clamped to [0, 2^bits - 1].
// Throws InputError on a bad format, shape, dtype or a non-finite weight (the first one in
// row-major order), and on a group whose scale or bias does not fit in scale_dtype or whose
// weights dequantize_affine would turn into inf (a range beyond the dtype: f32 weights past
// 65504 with f16 scales, or weights near f32's limit). Rows are quantized in `ranges`
// contiguous ranges of rows at once: 0 picks one per hardware thread and at most one per 2^20
// weights, 1 is the sequential loop; the bytes are the same for every value.
QuantizedMatrix quantize_affine(const HostTensor& weight, AffineQuantization format, DType scale_dtype,
                                AffineRounding rounding = AffineRounding::min_max, std::int64_t ranges = 0);

// W [N, K] in output_dtype. Each element is computed in f32 as
// float(scale) * float(q) + float(bias) (no fused multiply-add), then rounded
// to output_dtype; this is the value every backend's dot products must use.
HostTensor dequantize_affine(const QuantizedMatrix& matrix, DType output_dtype = DType::f32);
// One row of W in f32 into `row` (size columns): the executor's inner loop.
void dequantize_affine_row(const QuantizedMatrix& matrix, std::int64_t row, std::span<float> out);
// The same row read straight from a graph's three tensors (no QuantizedMatrix is
// assembled, so nothing is copied): the CPU executor's quantized_matmul and
// quantized_embedding. out.size() is the row length K; InputError if the row lies
// outside the tensors.
void dequantize_affine_row(AffineQuantization format, const HostTensor& packed, const HostTensor& scales,
                           const HostTensor& biases, std::int64_t row, std::span<float> out);

// Bit packing, low bits first. pack_codes needs a whole number of words
// (codes.size() a multiple of 32 / bits) and codes below 2^bits; InputError otherwise.
std::vector<std::uint32_t> pack_codes(std::span<const std::uint32_t> codes, int bits);
std::vector<std::uint32_t> unpack_codes(std::span<const std::uint32_t> words, int bits);

}  // namespace metile
