// Every generated GEMV kernel and schedule against a float64 reference on fresh random inputs
// (split-K, staged batches, shared group sums and PDL: gemv_schedules_test.cpp): the decode-MLP stages (SwiGLU gate/up in both schedules, down with the residual epilogue, the
// plain store) at the sizes of Llama-3-8B, Qwen2.5-1.5B and Llama-3.2-1B, and standalone GEMVs
// whose N is not a multiple of the 16-row tile and whose K is not a multiple of the load block.
// Outputs are poisoned (NaN) before each launch, so an unwritten element fails. The figures
// (scale-normalized L2 and max error) are printed for the notes. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <cmath>
#include <iostream>
#include <stdexcept>

#include "gemv_gpu_test_support.h"

namespace metile {
namespace {

using namespace gemv_gpu_testing;


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
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
  for (const Model& model : models) {
    for (const GemvWeightFormat& format : model.formats) {
      const std::string label = fmt::format("{} {}", model.name, format.to_string());
      {
        const Problem gate_up = make_problem(format, model.intermediate, model.hidden, 2, seed += 100);
        check_cases(gate_up, stage_configs(gate_up, GemvEpilogue::swiglu(), true, register_v3_shape), device(),
                    label + " gate/up");
        check_cases(gate_up, {config_for(gate_up, 1, GemvEpilogue::store())}, device(), label + " gate store");
      }
      const Problem down = make_problem(format, model.hidden, model.intermediate, 1, seed += 100);
      check_cases(down, stage_configs(down, GemvEpilogue::residual_add(), false, register_v3_shape), device(),
                  label + " down+residual");
    }
  }
}

TEST_F(GemvKernels, RaggedShapesMatchFloat64ForEveryFormat) {
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (const GemvWeightFormat& format : every_gemv_format(dtype)) {
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
    const Problem problem = make_problem(format, 300, 512, 2, next_seed());
    std::vector<GemvKernelConfig> configs;
    for (const GemvEpilogue& epilogue : {bias_gelu, scaled_tanh_gelu, gated_gelu_minus_residual, exp_of_scaled}) {
      configs.push_back(config_for(problem, 2, epilogue));
      configs.push_back(config_for(problem, 11, epilogue, GatedSchedule::scratch_spilled));
    }
    check_cases(problem, configs, device(), "epilogues " + format.to_string());
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
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
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
    for (const GemvWeightFormat& format : every_gemv_format(dtype)) {
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


// GemvKernelSource::blocks_per_multiprocessor_cap (gemv_timeline_benchmark --cap-gate-up): every tuning
// candidate of a Llama-3.2-1B-sized 4-bit gate/up (512 tiles; 64 registers let 8 blocks share an SM)
// and down (128 tiles), a ragged N (77) at M = 1 and 9, and dense bf16, each capped at its grid's even
// share of the SMs (4, 1, 1), against the float64 reference; and the load's padding holds what it
// promises: where the plain kernel kept more blocks an SM than the cap, the device keeps exactly the
// cap (past 48 KiB of padding for a cap of 1), and elsewhere the kernel is not padded; every other
// kernel asks for the largest shared-memory carveout first (GemvKernelSource::shared_memory_carveout_percent).
TEST_F(GemvKernels, CappedGridsMatchFloat64AndKeepTheirCapAnSm) {
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
  int capped = 0;
  for (const GemvWeightFormat& format : {GemvWeightFormat::affine(4, 64, DType::bf16), GemvWeightFormat::dense(DType::bf16)}) {
    struct Case {
      std::int64_t n, k, rows;
      GemvEpilogue epilogue;
    };
    for (const Case& c : {Case{8192, 2048, 1, GemvEpilogue::swiglu()}, Case{2048, 8192, 1, GemvEpilogue::residual_add()},
                          Case{77, format.is_affine() ? 64 * 11 : 1000, 9, GemvEpilogue::swiglu()}}) {
      const Problem problem = make_problem(format, c.n, c.k, c.epilogue.product_count(), seed += 100);
      std::vector<GemvKernelConfig> configs;
      for (const GemvKernelConfig& config : gemv_tuning_candidates(config_for(problem, c.rows, c.epilogue))) {
        if (config.shared_stages < 2 && config.tile_loop_blocks_per_multiprocessor == 0) configs.push_back(config);
      }
      const std::string label = fmt::format("capped {} N={} K={} M={}", format.to_string(), c.n, c.k, c.rows);
      std::vector<GemvKernelSource> plain_sources, sources;
      for (const GemvKernelConfig& config : configs) {
        plain_sources.push_back(generate_gemv_kernel(config));
        GemvKernelSource kernel = plain_sources.back();
        kernel.blocks_per_multiprocessor_cap = static_cast<int>((kernel.grid_blocks + 131) / 132);
        // Every other one with the carveout the timeline benchmark's --carveout 100 asks for: the padding
        // is counted after the carveout is set, so the cap holds there too.
        if (sources.size() % 2 == 1) kernel.shared_memory_carveout_percent = 100;
        sources.push_back(kernel);
      }
      const std::vector<LoadedGemv> plain_loaded = compile_all(plain_sources, device());
      const std::vector<LoadedGemv> loaded = compile_all(sources, device());
      const double threshold = numeric_gate_threshold(format.activation);
      for (std::size_t i = 0; i < configs.size(); ++i) {
        const GemvKernelSource& kernel = loaded[i].kernel;
        const int cap = kernel.blocks_per_multiprocessor_cap;
        const int threads = static_cast<int>(kernel.block_threads);
        const int before = plain_loaded[i].compiled.max_active_blocks_per_multiprocessor(threads, plain_loaded[i].kernel.dynamic_shared_bytes);
        const int after = loaded[i].compiled.max_active_blocks_per_multiprocessor(threads, kernel.dynamic_shared_bytes);
        if (before <= cap) {
          EXPECT_EQ(kernel.dynamic_shared_bytes, plain_loaded[i].kernel.dynamic_shared_bytes) << label << ": " << configs[i].to_string();
        } else {
          EXPECT_EQ(after, cap) << label << ": " << configs[i].to_string() << " (" << before << " an SM unpadded)";
          ++capped;
        }
        const gemv_testing::ScaledError error = run_and_compare(problem, configs[i], loaded[i]);
        EXPECT_LE(error.relative_norm, threshold) << label << ": " << configs[i].to_string();
        EXPECT_LE(error.relative_max, threshold) << label << ": " << configs[i].to_string();
      }
    }
  }
  EXPECT_GT(capped, 0);  // the 1B gate/up's plain shapes keep more than 4 blocks an SM
}

// GemvKernelConfig::half_products: every register shape's half twin (x staged as scaled f16, the codes
// decoded in f16) against the float64 reference, for 4-bit (nibble_classes) and 8-bit codes at each
// group size and both activation dtypes: Llama-3-8B's gate/up and down at M = 1, ragged N (77 < the SM
// count, 1000) and K (11 groups) at M = 1, 3, 9 and 16. Then x far outside f16's range and far below
// it (bf16 rows scaled by 2^40, 2^-60 and a row of 2^-20 with one 2^24 outlier), one row a launch and
// three rows of different scales in one, each row checked against its own reference, and a row holding
// 3.2e38: the per-row power of two must put every row in f16's range and take itself out again exactly.
std::vector<GemvKernelConfig> half_twins(const std::vector<GemvKernelConfig>& configs) {
  return gemv_half_twins(configs);  // the one-wave bounded twins included, as the stages race them
}

TEST_F(GemvKernels, HalfProductsMatchFloat64) {
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
  int kernels = 0;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (const GemvWeightFormat& format : every_gemv_format(dtype)) {
      if (!format.is_affine()) continue;
      const bool model_size = format.group_size == 64 || (format.bits == 4 && format.group_size == 128);
      if (model_size && dtype == DType::bf16) {
        const Problem gate_up = make_problem(format, 14336, 4096, 2, seed += 100);
        const std::vector<GemvKernelConfig> gate_up_configs =
            half_twins(gemv_tuning_candidates(config_for(gate_up, 1, GemvEpilogue::swiglu())));
        ASSERT_FALSE(gate_up_configs.empty()) << format.to_string();
        check_cases(gate_up, gate_up_configs, device(), "half Llama-3-8B gate/up " + format.to_string());
        const Problem down = make_problem(format, 4096, 14336, 1, seed += 100);
        const std::vector<GemvKernelConfig> down_configs =
            half_twins(gemv_tuning_candidates(config_for(down, 1, GemvEpilogue::residual_add())));
        ASSERT_FALSE(down_configs.empty()) << format.to_string();
        check_cases(down, down_configs, device(), "half Llama-3-8B down " + format.to_string());
        kernels += static_cast<int>(gate_up_configs.size() + down_configs.size());
      }
      const std::int64_t k = format.group_size * 11;
      for (std::int64_t n : {77, 1000}) {
        const Problem problem = make_problem(format, n, k, 2, seed += 100);
        std::vector<GemvKernelConfig> configs;
        for (std::int64_t rows : {1, 3, 9, 16}) {
          for (const GemvEpilogue& epilogue : {GemvEpilogue::swiglu(), GemvEpilogue::residual_add()}) {
            const std::vector<GemvKernelConfig> twins = half_twins(gemv_tuning_candidates(config_for(problem, rows, epilogue)));
            configs.insert(configs.end(), twins.begin(), twins.size() > 3 ? twins.begin() + 3 : twins.end());
          }
        }
        ASSERT_FALSE(configs.empty());
        check_cases(problem, configs, device(), fmt::format("half ragged {} N={} K={}", format.to_string(), n, k));
        kernels += static_cast<int>(configs.size());
      }
    }
  }
  // x beyond f16's range and below it (bf16).
  for (int bits : {4, 8}) {
    const GemvWeightFormat format = GemvWeightFormat::affine(bits, 64, DType::bf16);
    Problem problem = make_problem(format, 300, 1024, 2, seed += 100);
    const std::int64_t k = problem.k;
    std::vector<double> x = problem.x.to_values();
    const double row_scales[3] = {std::ldexp(1.0, 40), std::ldexp(1.0, -60), std::ldexp(1.0, -20)};
    for (std::int64_t m = 0; m < 16; ++m) {
      for (std::int64_t c = 0; c < k; ++c) x[static_cast<std::size_t>(m * k + c)] *= row_scales[m % 3];  // exact in bf16
      if (m % 3 == 2) x[static_cast<std::size_t>(m * k + 5)] = std::ldexp(1.0, 24);  // one outlier among small values
    }
    problem.x = HostTensor::from_values(TensorSpec({16, k}, format.activation), x);
    for (int p = 0; p < 2; ++p) {
      problem.products[p] = gemv_testing::reference_gemv(x, problem.matrices[static_cast<std::size_t>(p)].values, 16, problem.n, k);
    }
    std::vector<GemvKernelConfig> configs;
    for (std::int64_t rows : {1, 3}) {
      for (const GemvEpilogue& epilogue : {GemvEpilogue::swiglu(), GemvEpilogue::store()}) {
        const std::vector<GemvKernelConfig> twins = half_twins(gemv_tuning_candidates(config_for(problem, rows, epilogue)));
        configs.insert(configs.end(), twins.begin(), twins.size() > 2 ? twins.begin() + 2 : twins.end());
      }
    }
    std::vector<GemvKernelSource> sources;
    for (const GemvKernelConfig& config : configs) sources.push_back(generate_gemv_kernel(config));
    const std::vector<LoadedGemv> loaded = compile_all(sources, device());
    const double threshold = numeric_gate_threshold(format.activation);
    for (std::size_t i = 0; i < configs.size(); ++i) {
      const std::vector<double> actual = run_gemv_outputs(problem, configs[i], loaded[i]);
      const std::vector<double> expected = expected_output(problem, configs[i]);
      for (std::int64_t m = 0; m < configs[i].rows; ++m) {
        const auto row = [&](const std::vector<double>& values) {
          return std::vector<double>(values.begin() + m * problem.n, values.begin() + (m + 1) * problem.n);
        };
        const gemv_testing::ScaledError error = scaled_error(row(actual), row(expected));
        EXPECT_LE(error.relative_norm, threshold) << configs[i].to_string() << " row " << m << " (x scaled by "
                                                  << row_scales[m % 3] << ")";
        EXPECT_LE(error.relative_max, threshold) << configs[i].to_string() << " row " << m;
      }
    }
    kernels += static_cast<int>(configs.size());
  }
  // The largest finite magnitudes bf16 holds: one 3.2e38 among values of 1 (f16's 65504 and a fixed
  // scale would both fail here), the store epilogue (the products stay finite).
  {
    const GemvWeightFormat format = GemvWeightFormat::affine(4, 64, DType::bf16);
    Problem problem = make_problem(format, 200, 512, 1, seed += 100);
    std::vector<double> x = problem.x.to_values();
    x[7] = 3.2e38;
    problem.x = HostTensor::from_values(TensorSpec({16, problem.k}, format.activation), x);
    problem.products[0] = gemv_testing::reference_gemv(problem.x.to_values(), problem.matrices[0].values, 16, problem.n, problem.k);
    const std::vector<GemvKernelConfig> configs = half_twins(gemv_tuning_candidates(config_for(problem, 1, GemvEpilogue::store())));
    ASSERT_FALSE(configs.empty());
    check_cases(problem, configs, device(), "half products, x of 3.2e38");
    kernels += static_cast<int>(configs.size());
  }
  std::cout << fmt::format("[figures] half products: {} kernels within the gate\n", kernels);
}

// GemvKernelConfig::x_staged_by_async_copy: x copied into shared memory by cp.async, its squares summed
// and its rows normalized there, must write the bits of the register prologue (same sums in the same
// order) for every format, M = 1, 3 and 16; four warps at K = 4096 (four vectors a thread: the norm's
// weight preloaded), K = 3072 (three: a second, partial batch of two) and K = 192 (threads without a
// vector), two warps at K = 4096 (eight a thread: the weight staged through for_each_thread_vector);
// double-buffered and batch-by-batch mainloops, one matrix and the SwiGLU pair; outputs poisoned.
TEST_F(GemvKernels, XStagedByAsyncCopyWritesTheRegisterProloguesBits) {
  const DType bf16 = DType::bf16;
  int compared = 0;
  for (const GemvWeightFormat& format :
       {GemvWeightFormat::dense(bf16), GemvWeightFormat::affine(4, 64, bf16), GemvWeightFormat::affine(8, 64, DType::f16)}) {
    struct Shape {
      std::int64_t rows, k;
      int warps;
    };
    for (const auto& [rows, k, warps] : {Shape{1, 4096, 4}, Shape{1, 3072, 4}, Shape{3, 640, 4}, Shape{16, 448, 4},
                                         Shape{1, 192, 4}, Shape{1, 4096, 2}}) {
      const Problem problem = make_problem(format, 200, k, 2, next_seed());
      const HostTensor norm_weight = gemv_testing::random_tensor(TensorSpec({k}, format.activation), next_seed(), 0.5, 1.5);
      const DeviceBuffer norm_device = DeviceBuffer::from_tensor(norm_weight);
      HostTensor x(TensorSpec({rows, k}, format.activation));
      std::copy_n(problem.x.bytes().data(), x.bytes().size(), x.bytes().data());
      const DeviceBuffer x_device = DeviceBuffer::from_tensor(x);
      for (const GemvEpilogue& epilogue : {GemvEpilogue::store(), GemvEpilogue::swiglu()}) {
        for (bool double_buffered : {true, false}) {
          GemvKernelConfig registers = config_for(problem, rows, epilogue);
          registers.x_rms_norm_eps = 1e-5;
          registers.double_buffered = double_buffered;
          registers.warps_per_block = warps;
          GemvKernelConfig copied = registers;
          copied.x_staged_by_async_copy = true;
          const std::vector<LoadedGemv> loaded = compile_all({generate_gemv_kernel(registers), generate_gemv_kernel(copied)}, device());
          std::vector<std::vector<std::byte>> written;
          for (const LoadedGemv& gemv : loaded) {
            DeviceTensor out(TensorSpec({rows, problem.n}, format.activation));
            out.buffer.fill_bytes(0xFF);  // NaN: an element the kernel does not write fails
            KernelArguments arguments;
            for (int p = 0; p < epilogue.product_count(); ++p) {
              arguments.add_pointer(problem.matrices[static_cast<std::size_t>(p)].weights);
              if (format.is_affine()) arguments.add_pointer(problem.matrices[static_cast<std::size_t>(p)].scale_bias);
            }
            arguments.add_pointer(x_device);
            arguments.add_pointer(norm_device);
            arguments.add_pointer(out.buffer);
            CudaStream stream;
            gemv.launch(stream, arguments);
            stream.synchronize();
            HostTensor host = out.to_host();
            for (double value : host.to_values()) ASSERT_TRUE(std::isfinite(value)) << copied.to_string();
            written.emplace_back(host.bytes().begin(), host.bytes().end());
          }
          EXPECT_TRUE(written[0] == written[1]) << copied.to_string() << ": other bits than the register prologue";
          ++compared;
        }
      }
    }
  }
  std::cout << fmt::format("[figures] x staged by cp.async: {} kernels, each bit-identical to its register prologue\n", compared);
}

}  // namespace
}  // namespace metile
