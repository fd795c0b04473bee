// Every generated GEMV kernel and schedule against a float64 reference on fresh random inputs:
// the decode-MLP stages (SwiGLU gate/up in both schedules, down with the residual epilogue, the
// plain store) at the sizes of Llama-3-8B, Qwen2.5-1.5B and Llama-3.2-1B, and standalone GEMVs
// whose N is not a multiple of the 16-row tile and whose K is not a multiple of the load block.
// Outputs are poisoned (NaN) before each launch, so an unwritten element fails. The figures
// (scale-normalized L2 and max error) are printed for the notes. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <cstring>
#include <future>
#include <iostream>
#include <stdexcept>
#include <tuple>

#include "../unit/gemv/gemv_test_support.h"
#include "gpu_test_support.h"
#include "metile/decode_mlp_executor.h"

namespace metile {
namespace {

using gemv_testing::scaled_error;

// One weight matrix on the device as the kernels read it, with its float64 view.
struct MatrixUnderTest {
  DeviceBuffer weights, scale_bias;
  std::vector<double> values;  // W [N, K]
};

MatrixUnderTest make_matrix(const GemvWeightFormat& format, std::int64_t n, std::int64_t k, std::uint64_t seed) {
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

Problem make_problem(const GemvWeightFormat& format, std::int64_t n, std::int64_t k, int matrices, std::uint64_t seed) {
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

// Compiles every config (in parallel; NVRTC needs no device) and loads them.
std::vector<LoadedGemv> compile_all(const std::vector<GemvKernelSource>& kernels, const CudaDevice& device) {
  std::vector<std::future<CompiledProgram>> programs;
  for (const GemvKernelSource& kernel : kernels) {
    programs.push_back(std::async(std::launch::async, [&kernel, architecture = device.info().architecture()] {
      CompileOptions options;
      options.architecture = architecture;
      return compile_cuda_program(kernel.source, kernel.kernel_name, options);
    }));
  }
  std::vector<LoadedGemv> loaded;
  for (std::size_t i = 0; i < kernels.size(); ++i) loaded.push_back(LoadedGemv::load(kernels[i], programs[i].get()));
  return loaded;
}

// Runs one kernel on the problem's first `rows` rows and returns the scale-normalized error
// against the float64 epilogue of the float64 products. A kernel with a workspace (streamed) runs
// twice on fresh poison: the second launch must find the workspace ready and, the join order
// being fixed, write the same bits.
gemv_testing::ScaledError run_and_compare(const Problem& problem, const GemvKernelConfig& config,
                                          const LoadedGemv& gemv) {
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
  std::vector<std::string> tensor_names;
  for (const GemvEpilogue::TensorInput& tensor : config.epilogue.tensor_inputs()) {
    arguments.add_pointer(tensor.name == "bias" ? bias_device : residual_device);
    tensor_names.push_back(tensor.name);
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

  std::vector<double> expected(static_cast<std::size_t>(rows * n));
  const std::vector<double> residual_values = problem.residual.to_values(), bias_values = problem.bias.to_values();
  for (std::int64_t m = 0; m < rows; ++m) {
    for (std::int64_t j = 0; j < n; ++j) {
      const std::size_t index = static_cast<std::size_t>(m * n + j);
      std::vector<double> accumulators;
      for (int p = 0; p < products; ++p) accumulators.push_back(problem.products[p][index]);
      std::vector<double> tensors;
      for (const std::string& name : tensor_names) tensors.push_back(name == "bias" ? bias_values[static_cast<std::size_t>(j)] : residual_values[index]);
      expected[index] = config.epilogue.evaluate(accumulators, tensors);
    }
  }
  return scaled_error(actual, expected);
}

struct Case {
  GemvKernelConfig config;
  GemvKernelSource kernel;
};

// Runs every case against the problem and checks each within the dtype's gate.
void check_cases(const Problem& problem, const std::vector<GemvKernelConfig>& configs, const CudaDevice& device,
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

GemvKernelConfig config_for(const Problem& problem, std::int64_t rows, GemvEpilogue epilogue,
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

// All tuning candidates at 1 and 16 rows, the first one at the rows in between.
std::vector<GemvKernelConfig> stage_configs(const Problem& problem, GemvEpilogue epilogue, bool both_schedules) {
  std::vector<GemvKernelConfig> configs;
  for (std::int64_t rows : {1, 3, 8, 9, 16}) {
    for (GatedSchedule schedule : {GatedSchedule::register_resident, GatedSchedule::scratch_spilled}) {
      if (!both_schedules && schedule == GatedSchedule::scratch_spilled) continue;
      const std::vector<GemvKernelConfig> candidates =
          gemv_tuning_candidates(config_for(problem, rows, epilogue, schedule));
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

class GemvKernels : public testing_support::CudaDeviceTest {};

TEST_F(GemvKernels, DecodeMlpStagesMatchFloat64AtModelSizes) {
  const DType bf16 = DType::bf16, f16 = DType::f16;
  const std::vector<Model> models = {
      {"Llama-3-8B", 4096, 14336,
       {GemvWeightFormat::dense(bf16), GemvWeightFormat::affine(4, 64, bf16), GemvWeightFormat::affine(4, 128, bf16),
        GemvWeightFormat::affine(8, 64, bf16)}},
      {"Qwen2.5-1.5B", 1536, 8960,
       {GemvWeightFormat::dense(bf16), GemvWeightFormat::dense(f16), GemvWeightFormat::affine(4, 32, bf16),
        GemvWeightFormat::affine(4, 64, f16), GemvWeightFormat::affine(8, 128, bf16), GemvWeightFormat::affine(8, 32, f16)}},
      {"Llama-3.2-1B", 2048, 8192,
       {GemvWeightFormat::affine(4, 64, bf16), GemvWeightFormat::affine(8, 64, f16), GemvWeightFormat::affine(4, 128, f16)}},
  };
  std::uint64_t seed = 0x5eed0000 + static_cast<std::uint64_t>(::testing::UnitTest::GetInstance()->random_seed());
  for (const Model& model : models) {
    for (const GemvWeightFormat& format : model.formats) {
      const std::string label = fmt::format("{} {}", model.name, format.to_string());
      {
        const Problem gate_up = make_problem(format, model.intermediate, model.hidden, 2, seed += 100);
        check_cases(gate_up, stage_configs(gate_up, GemvEpilogue::swiglu(), true), device(), label + " gate/up");
        check_cases(gate_up, {config_for(gate_up, 1, GemvEpilogue::store())}, device(), label + " gate store");
      }
      const Problem down = make_problem(format, model.hidden, model.intermediate, 1, seed += 100);
      check_cases(down, stage_configs(down, GemvEpilogue::residual_add(), false), device(), label + " down+residual");
    }
  }
}

TEST_F(GemvKernels, RaggedShapesMatchFloat64ForEveryFormat) {
  std::uint64_t seed = 0xabc000 + static_cast<std::uint64_t>(::testing::UnitTest::GetInstance()->random_seed());
  for (DType dtype : {DType::bf16, DType::f16}) {
    std::vector<GemvWeightFormat> formats = {GemvWeightFormat::dense(dtype)};
    for (int bits : {4, 8}) {
      for (int group : {32, 64, 128}) formats.push_back(GemvWeightFormat::affine(bits, group, dtype));
    }
    for (const GemvWeightFormat& format : formats) {
      // N not a multiple of 16; K not a multiple of the 32..128-column load block.
      const std::int64_t k = format.is_affine() ? format.group_size * 11 : 1000;
      for (std::int64_t n : {1000, 77}) {
        const Problem problem = make_problem(format, n, k, 2, seed += 100);
        std::vector<GemvKernelConfig> configs;
        for (std::int64_t rows : {1, 7, 16}) {
          configs.push_back(config_for(problem, rows, GemvEpilogue::store()));
          configs.push_back(config_for(problem, rows, GemvEpilogue::residual_add()));
          for (GatedSchedule schedule : {GatedSchedule::register_resident, GatedSchedule::scratch_spilled}) {
            configs.push_back(gemv_tuning_candidates(config_for(problem, rows, GemvEpilogue::swiglu(), schedule)).front());
          }
        }
        check_cases(problem, configs, device(), fmt::format("ragged {} N={} K={}", format.to_string(), n, k));
      }
    }
  }
}

TEST_F(GemvKernels, OtherEpiloguesOnTheSameMainloop) {
  const GemvEpilogue bias_gelu = GemvEpilogue::gelu(GemvEpilogue::add(GemvEpilogue::accumulator(0), GemvEpilogue::tensor("bias", true)));
  const GemvEpilogue scaled_tanh_gelu = GemvEpilogue::scale(GemvEpilogue::gelu(GemvEpilogue::accumulator(0), true), 0.5);
  const GemvEpilogue gated_gelu_minus_residual = GemvEpilogue::subtract(
      GemvEpilogue::multiply(GemvEpilogue::gelu(GemvEpilogue::accumulator(0), true), GemvEpilogue::accumulator(1)),
      GemvEpilogue::tensor("residual"));
  const GemvEpilogue exp_of_scaled = GemvEpilogue::exp(GemvEpilogue::scale(GemvEpilogue::accumulator(0), 0.25));
  for (const GemvWeightFormat& format : {GemvWeightFormat::affine(4, 64, DType::bf16), GemvWeightFormat::dense(DType::f16)}) {
    const Problem problem = make_problem(format, 300, 512, 2, 4242);
    std::vector<GemvKernelConfig> configs;
    for (const GemvEpilogue& epilogue : {bias_gelu, scaled_tanh_gelu, gated_gelu_minus_residual, exp_of_scaled}) {
      configs.push_back(config_for(problem, 2, epilogue));
      configs.push_back(config_for(problem, 11, epilogue, GatedSchedule::scratch_spilled));
    }
    check_cases(problem, configs, device(), "epilogues " + format.to_string());
  }
}

// Split-K (several blocks per tile, joined in split order through the workspace), staged batches
// (cp.async into shared-memory rings) and per-block group sums of x in shared memory (affine), alone
// and together, in every format, at shapes whose N is
// smaller than the SM count and not a multiple of 16 and whose K is not a multiple of the load
// block; M on both sides of 8; both gate/up schedules. Kernels with a workspace run twice and must
// write the same bits (run_and_compare).
TEST_F(GemvKernels, SplitKStagedAndSharedGroupSumsMatchFloat64) {
  std::uint64_t seed = 0x5b1700 + static_cast<std::uint64_t>(::testing::UnitTest::GetInstance()->random_seed());
  std::cout << "seed " << seed << " (gtest --gtest_random_seed changes it)\n";
  for (DType dtype : {DType::bf16, DType::f16}) {
    std::vector<GemvWeightFormat> formats = {GemvWeightFormat::dense(dtype)};
    for (int bits : {4, 8}) {
      for (int group : {32, 64, 128}) formats.push_back(GemvWeightFormat::affine(bits, group, dtype));
    }
    for (const GemvWeightFormat& format : formats) {
      const std::int64_t k = format.is_affine() ? format.group_size * 11 : 1000;
      for (std::int64_t n : {77, 200}) {
        const Problem problem = make_problem(format, n, k, 2, seed += 100);
        std::vector<GemvKernelConfig> configs;
        int variant = 0;
        for (std::int64_t rows : {1, 9, 16}) {
          for (const GemvEpilogue& epilogue : {GemvEpilogue::swiglu(), GemvEpilogue::residual_add(), GemvEpilogue::store()}) {
            for (const auto& [splits, stages, group_sums] :
                 {std::tuple{3, 0, false}, std::tuple{1, 3, false}, std::tuple{2, 2, true}, std::tuple{1, 0, true}}) {
              GemvKernelConfig config = config_for(problem, rows, epilogue,
                                                   ++variant % 2 == 0 ? GatedSchedule::scratch_spilled
                                                                      : GatedSchedule::register_resident);
              config.warps_per_block = variant % 3 == 0 ? 8 : 4;
              config.iterations_in_flight = format.is_affine() ? 1 : 2;
              config.double_buffered = variant % 4 != 0;
              config.k_splits = std::max(1, std::min<int>(splits, static_cast<int>(k / format.columns_per_iteration())));
              config.shared_stages = stages;
              config.shared_group_sums = group_sums && format.is_affine();
              configs.push_back(config);
            }
          }
        }
        check_cases(problem, configs, device(), fmt::format("split-K/staged {} N={} K={}", format.to_string(), n, k));
      }
    }
  }
}

// Programmatic dependent launch: a GEMV launched as a programmatic dependent of the GEMV that
// writes its x waits for it (x is poisoned with NaN before the first kernel, so reading it early
// fails), eagerly and inside a captured CUDA graph, for each kind of mainloop schedule.
TEST_F(GemvKernels, ProgrammaticDependentLaunchWaitsForThePreviousKernel) {
  std::uint64_t seed = 0x9d1000 + static_cast<std::uint64_t>(::testing::UnitTest::GetInstance()->random_seed());
  std::cout << "seed " << seed << "\n";
  const GemvWeightFormat format = GemvWeightFormat::affine(4, 64, DType::bf16);
  const std::int64_t rows = 2, hidden = 1024, intermediate = 4096, n = 300;
  const Problem first = make_problem(format, intermediate, hidden, 1, seed);        // y = W1 x
  const Problem second = make_problem(format, n, intermediate, 1, seed + 1000);     // z = W2 y
  GemvKernelConfig producer = config_for(first, rows, GemvEpilogue::store());
  producer.warps_per_block = 2;
  std::vector<GemvKernelConfig> consumers;
  for (const auto& [splits, stages, double_buffered, group_sums] :
       {std::tuple{1, 0, true, false}, std::tuple{1, 0, false, false}, std::tuple{4, 0, true, false}, std::tuple{1, 4, false, false},
        std::tuple{3, 3, false, false}, std::tuple{1, 0, false, true}, std::tuple{2, 0, true, true}}) {
    GemvKernelConfig config = config_for(second, rows, GemvEpilogue::store());
    config.warps_per_block = 8;
    config.iterations_in_flight = 1;
    config.k_splits = splits;
    config.shared_stages = stages;
    config.double_buffered = double_buffered;
    config.shared_group_sums = group_sums;
    consumers.push_back(config);
  }
  std::vector<GemvKernelSource> kernels = {generate_gemv_kernel(producer)};
  for (const GemvKernelConfig& config : consumers) kernels.push_back(generate_gemv_kernel(config));
  const std::vector<LoadedGemv> loaded = compile_all(kernels, device());

  HostTensor x(TensorSpec({rows, hidden}, format.activation));
  std::copy_n(first.x.bytes().data(), x.bytes().size(), x.bytes().data());
  const DeviceBuffer x_device = DeviceBuffer::from_tensor(x);
  DeviceTensor y(TensorSpec({rows, intermediate}, format.activation)), z(TensorSpec({rows, n}, format.activation));
  KernelArguments produce;
  produce.add_pointer(first.matrices[0].weights);
  produce.add_pointer(first.matrices[0].scale_bias);
  produce.add_pointer(x_device);
  produce.add_pointer(y.buffer);
  KernelArguments consume;
  consume.add_pointer(second.matrices[0].weights);
  consume.add_pointer(second.matrices[0].scale_bias);
  consume.add_pointer(y.buffer);
  consume.add_pointer(z.buffer);
  CudaStream stream;
  const double threshold = numeric_gate_threshold(format.activation);
  for (std::size_t c = 0; c < consumers.size(); ++c) {
    const auto work = [&](const CudaStream& s) {
      y.buffer.fill_bytes(0xFF, &s);  // NaN until the producer has written y
      z.buffer.fill_bytes(0xFF, &s);
      loaded[0].launch(s, produce);
      loaded[c + 1].launch(s, consume, true);
    };
    const CudaGraph graph = CudaGraph::capture(stream, work);
    for (int round = 0; round < 6; ++round) {
      if (round % 2 == 0) {
        work(stream);
      } else {
        graph.replay(stream);
      }
      stream.synchronize();
      const std::vector<double> y_values = y.to_host().to_values();
      const std::vector<double> expected = gemv_testing::reference_gemv(y_values, second.matrices[0].values, rows, n, intermediate);
      const gemv_testing::ScaledError error = scaled_error(z.to_host().to_values(), expected);
      EXPECT_LE(error.relative_max, threshold) << consumers[c].to_string() << (round % 2 ? " (graph)" : " (eager)");
    }
  }
}

// The streamed mainloop (bulk copies into shared-memory stages, stream-K over a persistent grid):
// every tuning shape at the model sizes, M on both sides of 8, and ragged shapes whose N is
// smaller than the SM count (most warps then join tiles through the workspace) or not a multiple
// of 16, and whose K is not a multiple of the load block. The grid is the device's.
TEST_F(GemvKernels, StreamedMainloopMatchesFloat64) {
  const int multiprocessors = device().info().multiprocessor_count;
  auto streamed = [&](GemvKernelConfig config) {
    config.mainloop = GemvMainloop::streamed;
    std::vector<GemvKernelConfig> shapes = gemv_tuning_candidates(config, multiprocessors);
    EXPECT_FALSE(shapes.empty()) << config.to_string();
    if (shapes.empty()) throw std::runtime_error("no streamed shape for " + config.to_string());
    return shapes;
  };
  std::uint64_t seed = 0x57e0000 + static_cast<std::uint64_t>(::testing::UnitTest::GetInstance()->random_seed());
  const DType bf16 = DType::bf16, f16 = DType::f16;
  const std::vector<Model> models = {
      {"Llama-3-8B", 4096, 14336,
       {GemvWeightFormat::dense(bf16), GemvWeightFormat::affine(4, 64, bf16), GemvWeightFormat::affine(8, 64, bf16)}},
      {"Qwen2.5-1.5B", 1536, 8960, {GemvWeightFormat::affine(4, 64, bf16), GemvWeightFormat::affine(4, 128, f16)}},
      {"Llama-3.2-1B", 2048, 8192, {GemvWeightFormat::affine(4, 64, bf16), GemvWeightFormat::dense(f16)}},
  };
  for (const Model& model : models) {
    for (const GemvWeightFormat& format : model.formats) {
      const std::string label = fmt::format("streamed {} {}", model.name, format.to_string());
      const Problem gate_up = make_problem(format, model.intermediate, model.hidden, 2, seed += 100);
      const Problem down = make_problem(format, model.hidden, model.intermediate, 1, seed += 100);
      std::vector<GemvKernelConfig> gate_up_configs, down_configs;
      for (std::int64_t rows : {1, 5, 16}) {
        const std::vector<GemvKernelConfig> gated = streamed(config_for(gate_up, rows, GemvEpilogue::swiglu()));
        const std::vector<GemvKernelConfig> residual = streamed(config_for(down, rows, GemvEpilogue::residual_add()));
        // Every shape at one and sixteen rows, the first in between.
        gate_up_configs.insert(gate_up_configs.end(), gated.begin(), rows == 5 ? gated.begin() + 1 : gated.end());
        down_configs.insert(down_configs.end(), residual.begin(), rows == 5 ? residual.begin() + 1 : residual.end());
      }
      check_cases(gate_up, gate_up_configs, device(), label + " gate/up");
      check_cases(down, down_configs, device(), label + " down+residual");
    }
  }
  for (DType dtype : {bf16, f16}) {
    std::vector<GemvWeightFormat> formats = {GemvWeightFormat::dense(dtype)};
    for (int bits : {4, 8}) {
      for (int group : {32, 64, 128}) formats.push_back(GemvWeightFormat::affine(bits, group, dtype));
    }
    for (const GemvWeightFormat& format : formats) {
      const std::int64_t k = format.is_affine() ? format.group_size * 11 : 1000;
      for (std::int64_t n : {77, 1000}) {
        const Problem problem = make_problem(format, n, k, 2, seed += 100);
        std::vector<GemvKernelConfig> configs;
        for (std::int64_t rows : {1, 9}) {
          for (const GemvEpilogue& epilogue : {GemvEpilogue::swiglu(), GemvEpilogue::residual_add()}) {
            const std::vector<GemvKernelConfig> shapes = streamed(config_for(problem, rows, epilogue));
            configs.push_back(shapes.front());
            configs.push_back(shapes.back());
          }
        }
        check_cases(problem, configs, device(), fmt::format("streamed ragged {} N={} K={}", format.to_string(), n, k));
      }
    }
  }
}

}  // namespace
}  // namespace metile
