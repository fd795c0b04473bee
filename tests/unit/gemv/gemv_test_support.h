// Helpers shared by the GEMV / decode-MLP tests (unit and gpu): seeded random activations,
// dense and affine weight matrices, a float64 GEMV oracle and the scale-normalized error the
// numeric gates use. The oracle reads the original MLX layout, never the repacked one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "metile/gemv.h"
#include "metile/graph.h"
#include "metile/quant.h"

namespace metile::gemv_testing {

// A GEMV of `rows` activation rows, `n` outputs over `k` inputs in `format`, with `epilogue`; the
// other fields (schedule, launch shape) at their defaults.
inline GemvKernelConfig gemv_config(const GemvWeightFormat& format, std::int64_t rows, std::int64_t n, std::int64_t k,
                                    GemvEpilogue epilogue) {
  GemvKernelConfig config;
  config.format = format;
  config.rows = rows;
  config.out_features = n;
  config.in_features = k;
  config.epilogue = std::move(epilogue);
  return config;
}

inline double unit_uniform(std::mt19937_64& generator) {
  return static_cast<double>(generator() >> 11) * 0x1.0p-53;  // [0, 1), same on every standard library
}

// Uniform in [low, high), rounded to the dtype.
inline HostTensor random_tensor(TensorSpec spec, std::uint64_t seed, double low = -1.0, double high = 1.0) {
  std::mt19937_64 generator(seed);
  std::vector<double> values(static_cast<std::size_t>(spec.element_count()));
  for (double& value : values) value = low + (high - low) * unit_uniform(generator);
  return HostTensor::from_values(std::move(spec), values);
}

// Random codes over the whole range, scales of either sign with magnitudes spread over two
// octaves (as real checkpoints have), biases around zero: every code value and every bit of the
// packing matters to the result.
inline QuantizedMatrix random_affine_matrix(std::int64_t rows, std::int64_t columns, int bits, int group_size,
                                            DType dtype, std::uint64_t seed, double weight_scale = 1.0) {
  std::mt19937_64 generator(seed);
  const AffineQuantization format{bits, group_size};
  std::vector<std::uint32_t> codes(static_cast<std::size_t>(rows * columns));
  for (auto& code : codes) code = static_cast<std::uint32_t>(generator() >> 20) & format.max_code();
  const std::vector<std::uint32_t> words = pack_codes(codes, bits);
  std::vector<double> word_values(words.begin(), words.end());
  HostTensor packed = HostTensor::from_values(TensorSpec({rows, columns * bits / 32}, DType::u32), word_values);
  const std::int64_t groups = columns / group_size;
  std::vector<double> scales(static_cast<std::size_t>(rows * groups)), biases(scales.size());
  const double code_span = static_cast<double>(format.max_code());
  for (std::size_t i = 0; i < scales.size(); ++i) {
    const double magnitude = weight_scale * (0.5 + 1.5 * unit_uniform(generator)) / code_span;
    scales[i] = (generator() & 1) ? magnitude : -magnitude;
    biases[i] = weight_scale * (unit_uniform(generator) - 0.5);
  }
  HostTensor scale_tensor = HostTensor::from_values(TensorSpec({rows, groups}, dtype), scales);
  HostTensor bias_tensor = HostTensor::from_values(TensorSpec({rows, groups}, dtype), biases);
  return QuantizedMatrix::from_tensors(format, std::move(packed), std::move(scale_tensor), std::move(bias_tensor));
}

// W [N, K] as doubles, from a dense tensor or by the quant module's dequantization (f32, as
// every backend must compute it).
inline std::vector<double> weight_values(const HostTensor& dense) { return dense.to_values(); }
inline std::vector<double> weight_values(const QuantizedMatrix& matrix) {
  return dequantize_affine(matrix, DType::f32).to_values();
}

// y[m, n] = sum_k x[m, k] w[n, k] in double (threads over n: model-sized oracles stay quick).
inline std::vector<double> reference_gemv(const std::vector<double>& x, const std::vector<double>& weights,
                                          std::int64_t rows, std::int64_t out_features, std::int64_t in_features) {
  std::vector<double> y(static_cast<std::size_t>(rows * out_features));
  auto work = [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t n = begin; n < end; ++n) {
      const double* w = weights.data() + n * in_features;
      for (std::int64_t m = 0; m < rows; ++m) {
        const double* xr = x.data() + m * in_features;
        double sum = 0;
        for (std::int64_t k = 0; k < in_features; ++k) sum += xr[k] * w[k];
        y[static_cast<std::size_t>(m * out_features + n)] = sum;
      }
    }
  };
  const std::int64_t threads = std::clamp<std::int64_t>(std::thread::hardware_concurrency(), 1, 32);
  const std::int64_t per_thread = (out_features + threads - 1) / threads;
  std::vector<std::thread> workers;
  for (std::int64_t begin = 0; begin < out_features; begin += per_thread) {
    workers.emplace_back(work, begin, std::min(out_features, begin + per_thread));
  }
  for (std::thread& worker : workers) worker.join();
  return y;
}

// The numeric gate's two figures: ||out - ref|| / ||ref|| and max |out - ref| / max |ref|.
// A NaN or infinity anywhere makes both infinite.
struct ScaledError {
  double relative_norm = 0;
  double relative_max = 0;
};
inline ScaledError scaled_error(const std::vector<double>& actual, const std::vector<double>& expected) {
  double difference_squares = 0, reference_squares = 0, max_difference = 0, max_reference = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (!std::isfinite(actual[i])) return {INFINITY, INFINITY};
    const double difference = actual[i] - expected[i];
    difference_squares += difference * difference;
    reference_squares += expected[i] * expected[i];
    max_difference = std::max(max_difference, std::fabs(difference));
    max_reference = std::max(max_reference, std::fabs(expected[i]));
  }
  return {std::sqrt(difference_squares / std::max(reference_squares, 1e-300)),
          max_difference / std::max(max_reference, 1e-300)};
}

}  // namespace metile::gemv_testing
