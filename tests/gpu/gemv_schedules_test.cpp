// The register mainloop's issue-15 schedules against a float64 reference on fresh random inputs
// (seeds printed; --gtest_random_seed changes them): split-K (several blocks per tile, joined in a
// fixed order through the workspace), staged batches (cp.async into shared-memory rings) and
// per-block group sums of x in shared memory, at the decode-MLP sizes of Llama-3-8B, Qwen2.5-1.5B
// and Llama-3.2-1B and at ragged shapes whose N is below the SM count; and programmatic dependent
// launch, eager and in a CUDA graph. Skips without a CUDA device.
#include <algorithm>
#include <cmath>
#include <tuple>

#include "gemv_gpu_test_support.h"

namespace metile {
namespace {

using namespace gemv_gpu_testing;

bool issue15_shape(const GemvKernelConfig& config) { return !register_v3_shape(config); }

// Every split-K, staged and group-sum candidate the tuner proposes for the decode-MLP stages, at
// one and sixteen rows (the first one at the rows in between).
TEST_F(GemvKernels, NewSchedulesMatchFloat64AtModelSizes) {
  const DType bf16 = DType::bf16, f16 = DType::f16;
  const std::vector<Model> models = {
      {"Llama-3-8B", 4096, 14336,
       {GemvWeightFormat::dense(bf16), GemvWeightFormat::affine(4, 64, bf16), GemvWeightFormat::affine(8, 64, bf16)}},
      {"Qwen2.5-1.5B", 1536, 8960, {GemvWeightFormat::dense(f16), GemvWeightFormat::affine(4, 64, bf16), GemvWeightFormat::affine(8, 32, f16)}},
      {"Llama-3.2-1B", 2048, 8192, {GemvWeightFormat::affine(4, 128, f16)}},
  };
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
  std::cout << "seed " << seed << "\n";
  for (const Model& model : models) {
    for (const GemvWeightFormat& format : model.formats) {
      const std::string label = fmt::format("{} {}", model.name, format.to_string());
      const Problem gate_up = make_problem(format, model.intermediate, model.hidden, 2, seed += 100);
      check_cases(gate_up, stage_configs(gate_up, GemvEpilogue::swiglu(), false, issue15_shape), device(),
                  label + " gate/up (issue 15 shapes)");
      const Problem down = make_problem(format, model.hidden, model.intermediate, 1, seed += 100);
      check_cases(down, stage_configs(down, GemvEpilogue::residual_add(), false, issue15_shape), device(),
                  label + " down+residual (issue 15 shapes)");
    }
  }
}

// Split-K (several blocks per tile, joined in split order through the workspace), staged batches
// (cp.async into shared-memory rings), per-block group sums of x in shared memory (affine) and the
// L2 prefetch of the weights (one round ahead, two, all at once: a prefetch must change no result,
// and the last round's ranges are clipped to the matrix), alone and together, in every format, at
// shapes whose N is smaller than the SM count and not a multiple of 16 and whose K is not a
// multiple of the load block; M on both sides of 8; both gate/up schedules. Kernels with a
// workspace run twice and must write the same bits (run_and_compare).
TEST_F(GemvKernels, SplitKStagedGroupSumsAndPrefetchMatchFloat64) {
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
  std::cout << "seed " << seed << " (gtest --gtest_random_seed changes it)\n";
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (const GemvWeightFormat& format : every_gemv_format(dtype)) {
      const std::int64_t k = format.is_affine() ? format.group_size * 11 : 1000;
      for (std::int64_t n : {77, 200}) {
        const Problem problem = make_problem(format, n, k, 2, seed += 100);
        std::vector<GemvKernelConfig> configs;
        int variant = 0;
        for (std::int64_t rows : {1, 9, 16}) {
          for (const GemvEpilogue& epilogue : {GemvEpilogue::swiglu(), GemvEpilogue::residual_add(), GemvEpilogue::store()}) {
            // Prefetch depths (l2_prefetch_rounds): none, one round, two, every round (-1).
            for (const auto& [splits, stages, group_sums, prefetch] :
                 {std::tuple{3, 0, false, 0}, std::tuple{1, 3, false, 1}, std::tuple{2, 2, true, 2}, std::tuple{1, 0, true, -1},
                  std::tuple{1, 0, false, 2}, std::tuple{3, 0, false, -1}}) {
              GemvKernelConfig config = config_for(problem, rows, epilogue,
                                                   ++variant % 2 == 0 ? GatedSchedule::scratch_spilled
                                                                      : GatedSchedule::register_resident);
              config.warps_per_block = variant % 3 == 0 ? 8 : 4;
              config.iterations_in_flight = format.is_affine() ? 1 : 2;
              config.double_buffered = variant % 4 != 0;
              config.k_splits = std::max(1, std::min<int>(splits, static_cast<int>(k / format.columns_per_iteration())));
              config.shared_stages = stages;
              config.shared_group_sums = group_sums && format.is_affine();
              config.l2_prefetch_rounds = prefetch >= 0 ? prefetch : std::max(1, gemv_l2_prefetch_rounds(config));
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
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
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
  // The L2 prefetch is issued before the wait (weights only): the result must not change.
  for (int consumer : {0, 3}) {
    GemvKernelConfig prefetching = consumers[static_cast<std::size_t>(consumer)];
    prefetching.l2_prefetch_rounds = 2;
    consumers.push_back(prefetching);
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
    testing_support::run_eager_and_in_a_graph(stream, work, 6, [&](const char* how) {
      const std::vector<double> y_values = y.to_host().to_values();
      const std::vector<double> expected = gemv_testing::reference_gemv(y_values, second.matrices[0].values, rows, n, intermediate);
      const gemv_testing::ScaledError error = scaled_error(z.to_host().to_values(), expected);
      EXPECT_LE(error.relative_max, threshold) << consumers[c].to_string() << " (" << how << ")";
    });
  }
}

// What the numeric gate and the races never see: in a decode step a GEMV is a programmatic
// dependent of the kernel that writes its x and the residual its epilogue adds, and only
// griddepcontrol.wait keeps it from reading them early (session 15: the compiler hoisted a residual
// load above the wait in the w8 f1/f2 double-buffered shapes, and a CUDA-graph step could add a
// stale residual). A writer kernel releases the GEMV at once, spins for 50 us, then writes x and
// the residual, NaN until then; every tuning candidate of a residual-epilogue stage (dense bf16 and
// 4-bit, one and sixteen rows) and the shapes that were hoisted must give the float64 result,
// eagerly and replayed in a CUDA graph; so must the normalized SwiGLU stages (x read by the RMSNorm
// prologue). A control kernel that reads before its wait must see the NaN, or the overlap the test
// depends on did not happen.
constexpr std::string_view kLateWriterKernels = R"CUDA(
extern "C" __global__ void late_writer(unsigned short* a, const unsigned short* a_final, long long a_count,
                                       unsigned short* b, const unsigned short* b_final, long long b_count,
                                       long long spin_ns) {
  release_dependents_then_spin(spin_ns);
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < a_count; i += stride) a[i] = a_final[i];
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < b_count; i += stride) b[i] = b_final[i];
}
extern "C" __global__ void early_reader(const unsigned short* a, unsigned short* copy, long long count) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) copy[i] = a[i];
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
)CUDA";

TEST_F(GemvKernels, EpilogueTensorsAndXAreReadAfterTheWaitForALateWriter) {
  std::uint64_t seed = next_seed();  // printed: METILE_TEST_SEED replays it
  std::cout << "seed " << seed << "\n";
  device().make_current();
  const std::string source = std::string(testing_support::kReleaseDependentsThenSpinSource) + std::string(kLateWriterKernels);
  const CompiledKernel writer = compile_cuda(source, "late_writer");
  const CompiledKernel early_reader = compile_cuda(source, "early_reader");
  constexpr long long kSpinNanoseconds = 50'000;
  const DType dtype = DType::bf16;
  const double threshold = numeric_gate_threshold(dtype);
  int checked = 0;
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(dtype), GemvWeightFormat::affine(4, 64, dtype)}) {
    for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{64, 128}, {1024, 2048}}) {
      const Problem problem = make_problem(format, n, k, 1, seed += 100);
      std::vector<GemvKernelConfig> configs;
      for (std::int64_t rows : {1, 16}) {
        for (const GemvKernelConfig& candidate : gemv_tuning_candidates(config_for(problem, rows, GemvEpilogue::residual_add()))) {
          configs.push_back(candidate);
        }
        // The session-15 shapes (the compile test reads their code for a hoisted load).
        for (int warps : {4, 8, 16}) {
          for (int in_flight : {1, 2}) {
            GemvKernelConfig config = config_for(problem, rows, GemvEpilogue::residual_add());
            config.warps_per_block = warps, config.iterations_in_flight = in_flight, config.double_buffered = true;
            configs.push_back(config);
          }
        }
      }
      std::vector<GemvKernelSource> kernels;
      for (const GemvKernelConfig& config : configs) kernels.push_back(generate_gemv_kernel(config));
      const std::vector<LoadedGemv> loaded = compile_all(kernels, device());
      for (std::size_t c = 0; c < configs.size(); ++c) {
        const GemvKernelConfig& config = configs[c];
        const std::int64_t rows = config.rows;
        HostTensor x(TensorSpec({rows, k}, dtype)), residual(TensorSpec({rows, n}, dtype));
        std::copy_n(problem.x.bytes().data(), x.bytes().size(), x.bytes().data());
        std::copy_n(problem.residual.bytes().data(), residual.bytes().size(), residual.bytes().data());
        const DeviceBuffer x_final = DeviceBuffer::from_tensor(x), residual_final = DeviceBuffer::from_tensor(residual);
        DeviceBuffer x_late(x_final.size_bytes()), residual_late(residual_final.size_bytes());
        DeviceTensor out(TensorSpec({rows, n}, dtype));
        KernelArguments arguments;
        arguments.add_pointer(problem.matrices[0].weights);
        if (format.is_affine()) arguments.add_pointer(problem.matrices[0].scale_bias);
        arguments.add_pointer(x_late);
        arguments.add_pointer(residual_late);
        arguments.add_pointer(out.buffer);
        const std::vector<double> expected = expected_output(problem, config);
        CudaStream stream;
        const auto step = [&](const CudaStream& s) {
          x_late.fill_bytes(0xFF, &s);  // NaN until the writer has spun
          residual_late.fill_bytes(0xFF, &s);
          out.buffer.fill_bytes(0xFF, &s);
          launch(writer, Dim3{32}, Dim3{256}, 0, s, x_late, x_final, static_cast<long long>(x.element_count()), residual_late,
                 residual_final, static_cast<long long>(residual.element_count()), kSpinNanoseconds);
          loaded[c].launch(s, arguments, true);
        };
        testing_support::run_eager_and_in_a_graph(stream, step, 4, [&](const char* how) {
          const gemv_testing::ScaledError error = scaled_error(out.to_host().to_values(), expected);
          EXPECT_LE(error.relative_max, threshold) << config.to_string() << " (" << how << ")";
        });
        ++checked;
      }
    }
  }
  std::cout << fmt::format("[figures] {} residual-epilogue GEMVs behind a late writer, eager and in a graph\n", checked);

  // Normalized stages (x's RMSNorm as the prologue: q/k/v, gate/up, the LM head; the SwiGLU pair here):
  // x is read by the prologue, after the second weight batch is requested; behind the late writer
  // each tuning candidate and its x-async twin must write the bits it writes launched alone.
  int normalized = 0;
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(dtype), GemvWeightFormat::affine(4, 64, dtype)}) {
    const std::int64_t n = 512, k = 2048;
    const Problem problem = make_problem(format, n, k, 2, seed += 100);
    const HostTensor norm_weight = gemv_testing::random_tensor(TensorSpec({k}, dtype), seed + 1, 0.5, 1.5);
    const DeviceBuffer norm_device = DeviceBuffer::from_tensor(norm_weight);
    std::vector<GemvKernelConfig> configs;
    for (std::int64_t rows : {1, 16}) {
      GemvKernelConfig base = config_for(problem, rows, GemvEpilogue::swiglu());
      base.x_rms_norm_eps = 1e-5;
      for (GemvKernelConfig candidate : gemv_tuning_candidates(base)) {
        configs.push_back(candidate);
        candidate.x_staged_by_async_copy = true;  // the twin the lowering races where it fits
        try {
          candidate.validate();
        } catch (const InputError&) {
          continue;
        }
        configs.push_back(candidate);
      }
    }
    std::vector<GemvKernelSource> kernels;
    for (const GemvKernelConfig& config : configs) kernels.push_back(generate_gemv_kernel(config));
    const std::vector<LoadedGemv> loaded = compile_all(kernels, device());
    for (std::size_t c = 0; c < configs.size(); ++c) {
      const std::int64_t rows = configs[c].rows;
      HostTensor x(TensorSpec({rows, k}, dtype));
      std::copy_n(problem.x.bytes().data(), x.bytes().size(), x.bytes().data());
      const DeviceBuffer x_final = DeviceBuffer::from_tensor(x);
      DeviceBuffer x_late(x_final.size_bytes()), unused(16);
      DeviceTensor out(TensorSpec({rows, n}, dtype));
      const auto arguments_reading = [&](const DeviceBuffer& x_buffer) {
        KernelArguments arguments;
        for (const MatrixUnderTest& matrix : problem.matrices) {
          arguments.add_pointer(matrix.weights);
          if (format.is_affine()) arguments.add_pointer(matrix.scale_bias);
        }
        arguments.add_pointer(x_buffer);
        arguments.add_pointer(norm_device);
        arguments.add_pointer(out.buffer);
        return arguments;
      };
      CudaStream stream;
      out.buffer.fill_bytes(0xFF);
      loaded[c].launch(stream, arguments_reading(x_final));
      stream.synchronize();
      const HostTensor alone = out.to_host();
      for (double value : alone.to_values()) ASSERT_TRUE(std::isfinite(value)) << configs[c].to_string() << " launched alone";
      const KernelArguments late_arguments = arguments_reading(x_late);
      const auto step = [&](const CudaStream& s) {
        x_late.fill_bytes(0xFF, &s);  // NaN until the writer has spun
        out.buffer.fill_bytes(0xFF, &s);
        launch(writer, Dim3{32}, Dim3{256}, 0, s, x_late, x_final, static_cast<long long>(x.element_count()), unused, unused,
               0LL, kSpinNanoseconds);
        loaded[c].launch(s, late_arguments, true);
      };
      testing_support::run_eager_and_in_a_graph(stream, step, 4, [&](const char* how) {
        EXPECT_TRUE(out.to_host() == alone) << configs[c].to_string() << " (" << how << "): other bits behind the late writer";
      });
      ++normalized;
    }
  }
  std::cout << fmt::format("[figures] {} normalized SwiGLU GEMVs behind a late writer: the bits of their plain launch\n", normalized);

  // The control: a kernel that copies before its wait, launched the same way (eagerly and in a
  // graph), sees the NaN each time.
  const std::int64_t count = 1 << 16;
  HostTensor values = gemv_testing::random_tensor(TensorSpec({count}, dtype), seed + 1);
  const DeviceBuffer final_values = DeviceBuffer::from_tensor(values);
  DeviceBuffer late(final_values.size_bytes()), copy(final_values.size_bytes()), unused(16);
  KernelArguments copy_arguments;
  copy_arguments.add_pointer(late);
  copy_arguments.add_pointer(copy);
  copy_arguments.add_int64(count);
  CudaStream stream;
  const auto control = [&](const CudaStream& s) {
    late.fill_bytes(0xFF, &s);
    copy.fill_bytes(0, &s);  // zeros: a copy the reader did not make shows no NaN
    launch(writer, Dim3{32}, Dim3{256}, 0, s, late, final_values, static_cast<long long>(count), unused, unused, 0LL,
           kSpinNanoseconds);
    launch_programmatic_dependent(early_reader, Dim3{32}, Dim3{256}, 0, s, copy_arguments);
  };
  testing_support::run_eager_and_in_a_graph(stream, control, 4, [&](const char* how) {
    const std::vector<double> seen = copy.download(TensorSpec({count}, dtype)).to_values();
    EXPECT_TRUE(std::any_of(seen.begin(), seen.end(), [](double v) { return std::isnan(v); }))
        << "the reader did not run while the writer spun (" << how << "): the cases above prove nothing";
  });
}

}  // namespace
}  // namespace metile
