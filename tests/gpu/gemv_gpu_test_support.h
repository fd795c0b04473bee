// What the GEMV GPU suites share (gemv_kernels_test.cpp: register and streamed mainloops;
// gemv_schedules_test.cpp: split-K, staged, shared group sums, programmatic dependent launch):
// device matrices with their float64 values, problems with float64 products, compiling and loading
// configs, and running one against the float64 epilogue with poisoned outputs (a kernel with a
// workspace runs twice and must write the same bits).
#pragma once

#include <gtest/gtest.h>

#include <fmt/core.h>

#include <cstring>
#include <functional>
#include <iostream>

#include "../unit/gemv/gemv_test_support.h"
#include "gpu_test_support.h"
#include "metile/decode_mlp_executor.h"
#include "metile/dispatch.h"

namespace metile::gemv_gpu_testing {

using gemv_testing::scaled_error;

// One weight matrix on the device as the kernels read it, with its float64 view.
struct MatrixUnderTest {
  DeviceBuffer weights, scale_bias;
  std::vector<double> values;  // W [N, K]
};

inline MatrixUnderTest make_matrix(const GemvWeightFormat& format, std::int64_t n, std::int64_t k, std::uint64_t seed) {
  MatrixUnderTest matrix;
  if (format.is_affine()) {
    const QuantizedMatrix quantized = gemv_testing::random_affine_matrix(n, k, format.bits, format.group_size,
                                                                         format.activation, seed, 4.0 / std::sqrt(k));
    const RepackedAffineMatrix repacked = repack_for_gemv(quantized);
    matrix.weights = DeviceBuffer::from_vector<std::uint32_t>(repacked.words);
    matrix.scale_bias = DeviceBuffer::from_vector<std::uint16_t>(repacked.scale_bias);
    matrix.values = gemv_testing::weight_values(quantized);
  } else {
    const HostTensor dense = gemv_testing::random_tensor(TensorSpec({n, k}, format.activation), seed,
                                                         -1.0 / std::sqrt(k), 1.0 / std::sqrt(k));
    matrix.weights = DeviceBuffer::from_tensor(dense);
    matrix.values = gemv_testing::weight_values(dense);
  }
  return matrix;
}

struct Problem {
  GemvWeightFormat format;
  std::int64_t n = 0, k = 0;
  std::vector<MatrixUnderTest> matrices;  // gate (or the only one), up
  HostTensor x, residual, bias;
  std::vector<double> products[2];  // x W_p^T for the 16 rows of x, float64
};

inline Problem make_problem(const GemvWeightFormat& format, std::int64_t n, std::int64_t k, int matrices, std::uint64_t seed) {
  Problem problem;
  problem.format = format;
  problem.n = n;
  problem.k = k;
  problem.x = gemv_testing::random_tensor(TensorSpec({16, k}, format.activation), seed);
  problem.residual = gemv_testing::random_tensor(TensorSpec({16, n}, format.activation), seed + 1);
  problem.bias = gemv_testing::random_tensor(TensorSpec({n}, format.activation), seed + 2);
  const std::vector<double> x_values = problem.x.to_values();
  for (int p = 0; p < matrices; ++p) {
    problem.matrices.push_back(make_matrix(format, n, k, seed + 10 + static_cast<std::uint64_t>(p)));
    problem.products[p] = gemv_testing::reference_gemv(x_values, problem.matrices.back().values, 16, n, k);
  }
  return problem;
}

// Dense and every affine format (4 and 8 bits, groups 32, 64 and 128) over one activation dtype.
inline std::vector<GemvWeightFormat> every_gemv_format(DType dtype) {
  std::vector<GemvWeightFormat> formats = {GemvWeightFormat::dense(dtype)};
  for (int bits : {4, 8}) {
    for (int group : {32, 64, 128}) formats.push_back(GemvWeightFormat::affine(bits, group, dtype));
  }
  return formats;
}

// Compiles every config (in parallel; NVRTC needs no device) and loads them.
inline std::vector<LoadedGemv> compile_all(const std::vector<GemvKernelSource>& kernels, const CudaDevice& device) {
  device.make_current();
  return load_gemvs(kernels);
}

// The float64 epilogue of the float64 products on the problem's first config.rows rows: the
// epilogue's tensor named "bias" is the problem's bias (one a column), any other its residual.
inline std::vector<double> expected_output(const Problem& problem, const GemvKernelConfig& config) {
  const std::int64_t rows = config.rows, n = problem.n;
  const int products = config.epilogue.product_count();
  std::vector<double> expected(static_cast<std::size_t>(rows * n));
  const std::vector<double> residual_values = problem.residual.to_values(), bias_values = problem.bias.to_values();
  for (std::int64_t m = 0; m < rows; ++m) {
    for (std::int64_t j = 0; j < n; ++j) {
      const std::size_t index = static_cast<std::size_t>(m * n + j);
      std::vector<double> accumulators;
      for (int p = 0; p < products; ++p) accumulators.push_back(problem.products[p][index]);
      std::vector<double> tensors;
      for (const GemvEpilogue::TensorInput& tensor : config.epilogue.tensor_inputs()) {
        tensors.push_back(tensor.name == "bias" ? bias_values[static_cast<std::size_t>(j)] : residual_values[index]);
      }
      expected[index] = config.epilogue.evaluate(accumulators, tensors);
    }
  }
  return expected;
}

// Runs one kernel on the problem's first `rows` rows and returns what it wrote, [rows, N]. A kernel
// with a workspace (streamed) runs twice on fresh poison: the second launch must find the workspace
// ready and, the join order being fixed, write the same bits.
inline std::vector<double> run_gemv_outputs(const Problem& problem, const GemvKernelConfig& config, const LoadedGemv& gemv) {
  const std::int64_t rows = config.rows, n = problem.n, k = problem.k;
  const DType dtype = problem.format.activation;
  HostTensor x(TensorSpec({rows, k}, dtype));
  std::copy_n(problem.x.bytes().data(), x.bytes().size(), x.bytes().data());
  HostTensor residual(TensorSpec({rows, n}, dtype));
  std::copy_n(problem.residual.bytes().data(), residual.bytes().size(), residual.bytes().data());
  DeviceBuffer x_device = DeviceBuffer::from_tensor(x);
  DeviceBuffer residual_device = DeviceBuffer::from_tensor(residual);
  DeviceBuffer bias_device = DeviceBuffer::from_tensor(problem.bias);
  DeviceTensor out(TensorSpec({rows, n}, dtype));
  out.buffer.fill_bytes(0xFF);  // NaN: an element the kernel does not write fails

  KernelArguments arguments;
  const int products = config.epilogue.product_count();
  for (int p = 0; p < products; ++p) {
    arguments.add_pointer(problem.matrices[static_cast<std::size_t>(p)].weights);
    if (problem.format.is_affine()) arguments.add_pointer(problem.matrices[static_cast<std::size_t>(p)].scale_bias);
  }
  arguments.add_pointer(x_device);
  for (const GemvEpilogue::TensorInput& tensor : config.epilogue.tensor_inputs()) {
    arguments.add_pointer(tensor.name == "bias" ? bias_device : residual_device);
  }
  arguments.add_pointer(out.buffer);
  CudaStream stream;
  gemv.launch(stream, arguments);
  stream.synchronize();
  const std::vector<double> actual = out.to_host().to_values();
  if (gemv.workspace) {
    out.buffer.fill_bytes(0xFF);
    gemv.launch(stream, arguments);
    stream.synchronize();
    const std::vector<double> again = out.to_host().to_values();
    std::size_t differing = 0;
    for (std::size_t i = 0; i < actual.size(); ++i) {
      differing += std::memcmp(&actual[i], &again[i], sizeof(double)) != 0;
    }
    EXPECT_EQ(differing, 0u) << config.to_string() << ": a second launch wrote other values";
  }
  return actual;
}

// The scale-normalized error of one kernel (run_gemv_outputs) against the float64 epilogue of the
// float64 products.
inline gemv_testing::ScaledError run_and_compare(const Problem& problem, const GemvKernelConfig& config,
                                                 const LoadedGemv& gemv) {
  return scaled_error(run_gemv_outputs(problem, config, gemv), expected_output(problem, config));
}


// Runs every case against the problem and checks each within the dtype's gate.
inline void check_cases(const Problem& problem, const std::vector<GemvKernelConfig>& configs, const CudaDevice& device,
                 const std::string& label) {
  std::vector<GemvKernelSource> kernels;
  for (const GemvKernelConfig& config : configs) kernels.push_back(generate_gemv_kernel(config));
  const std::vector<LoadedGemv> compiled = compile_all(kernels, device);
  const double threshold = numeric_gate_threshold(problem.format.activation);
  double worst_l2 = 0, worst_max = 0;
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const gemv_testing::ScaledError error = run_and_compare(problem, configs[i], compiled[i]);
    EXPECT_LE(error.relative_norm, threshold) << label << ": " << configs[i].to_string();
    EXPECT_LE(error.relative_max, threshold) << label << ": " << configs[i].to_string();
    worst_l2 = std::max(worst_l2, error.relative_norm);
    worst_max = std::max(worst_max, error.relative_max);
  }
  std::cout << fmt::format("[figures] {:<44} {:>3} kernels  worst L2 {:.2e}  worst max {:.2e}  (gate {:.0e})\n", label,
                           configs.size(), worst_l2, worst_max, threshold);
}

inline GemvKernelConfig config_for(const Problem& problem, std::int64_t rows, GemvEpilogue epilogue,
                            GatedSchedule schedule = GatedSchedule::register_resident) {
  GemvKernelConfig config;
  config.format = problem.format;
  config.rows = rows;
  config.out_features = problem.n;
  config.in_features = problem.k;
  config.epilogue = std::move(epilogue);
  config.schedule = schedule;
  return config;
}

// The tuning candidates `keep` accepts: all at 1 and 16 rows, the first at the rows in between.
inline std::vector<GemvKernelConfig> stage_configs(const Problem& problem, GemvEpilogue epilogue, bool both_schedules,
                                                   const std::function<bool(const GemvKernelConfig&)>& keep) {
  std::vector<GemvKernelConfig> configs;
  for (std::int64_t rows : {1, 3, 8, 9, 16}) {
    for (GatedSchedule schedule : {GatedSchedule::register_resident, GatedSchedule::scratch_spilled}) {
      if (!both_schedules && schedule == GatedSchedule::scratch_spilled) continue;
      std::vector<GemvKernelConfig> candidates;
      for (const GemvKernelConfig& config : gemv_tuning_candidates(config_for(problem, rows, epilogue, schedule))) {
        if (keep(config)) candidates.push_back(config);
      }
      if (candidates.empty()) continue;
      if (rows == 1 || rows == 16) {
        configs.insert(configs.end(), candidates.begin(), candidates.end());
      } else {
        configs.push_back(candidates.front());
      }
    }
  }
  return configs;
}

struct Model {
  const char* name;
  std::int64_t hidden, intermediate;
  std::vector<GemvWeightFormat> formats;
};

// The v3 register shapes (the first five of each tuning list), without split-K, staging or shared
// group sums: those have their own suite (gemv_schedules_test.cpp).
inline bool register_v3_shape(const GemvKernelConfig& config) {
  return config.k_splits == 1 && config.shared_stages == 0 && !config.shared_group_sums;
}

class GemvKernels : public testing_support::CudaDeviceTest {};

}  // namespace metile::gemv_gpu_testing
