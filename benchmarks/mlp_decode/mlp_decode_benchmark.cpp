// mlp_decode_benchmark: the decode MLP (gate/up + SwiGLU, down + residual) of Llama-3-8B,
// Qwen2.5-1.5B and Llama-3.2-1B at 1..16 rows, bf16 and MLX affine 4-bit (g64, g128) and 8-bit
// (g64), through DecodeMlpExecutor. Per stage and for the whole MLP: microseconds, effective
// GB/s over the bytes that must move (weights with scales and biases, x, residual, the output;
// the gate/up stage's hidden state as its output and as the down stage's input), that as % of
// the device-to-device copy bandwidth measured in this run, the selected candidate and the
// speedup over the best native candidate. Stage times are the executor's tournament scores;
// whole-MLP times replay the executor's CUDA graph (and the native one) round-robin over
// enough weight replicas to exceed the L2 cache, so weights always come from HBM.
//
//   mlp_decode_benchmark            Llama-3-8B at M = 1, 2, 4, 8, 16; the others at M = 1, 16
//   mlp_decode_benchmark --full     every model at every M
//   mlp_decode_benchmark --quick    Llama-3-8B at M = 1, 16; the others 4-bit g64 at M = 1, 16 (the goals)
//   mlp_decode_benchmark --kernels  every generated stage kernel of Llama-3-8B alone (no executor),
//                                   register-batch and streamed mainloops side by side
//   --candidates N                  launch shapes per fused schedule (DecodeMlpOptions::tuning_candidates;
//                                   5: the register shapes of v3 only, without the staged and split-K ones)
//   --tournament-caches cold|warm   the executors' races with the L2 flushed before every call (cold, the default,
//                                   as bench-model) or back to back (warm: small models' weights then sit in L2)
//   --verbose                       every stage's candidates: gate result and tournament score
//   mlp_decode_benchmark --profile  launches the Llama-3-8B 4-bit M=1 stage kernels once each: the first three
//                                   register shapes (the races' usual winners) and the first of each other kind
//                                   (staged, split-K, L2-prefetching, streamed), and the read-only stream, for
//                                   `ncu --clock-control none` (no timing)
//   --profile-rows M                the same at M activation rows (1 or 16; default 1)
//   --kernels --residency           the affine formats only, and besides each stage's first three plain
//                                   register shapes (one tile, no staging, split or prefetch) with one and two
//                                   times their iterations in flight, compiled with __launch_bounds__ for 2..6
//                                   blocks an SM (resident_blocks_per_multiprocessor): what occupancy against
//                                   bytes in flight does per stage, M = 1 and 16
// The whole-MLP table also gives, per row, the chosen stage kernels and the fastest persistent decode
// MLP (one launch for both stages, gemv.h) timed the same way, and which one the executor runs.
// Every mode also measures a read-only stream of 1 GiB (16-byte loads, nothing written): the
// ceiling of a GEMV, which only reads, beside the copy's. At M = 1 each whole-MLP row also gets the
// floors of its harness: that stream over the MLP's weight bytes as two kernels (gate/up's, then down's)
// and as one, round-robin over the same replicas: what any two kernels, or one, reading those bytes take here.
// Prints "no CUDA device: ..." and exits 0 where there is none.
#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <unistd.h>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "metile/cuda_runtime.h"
#include "metile/decode_mlp_executor.h"
#include "../support/benchmark_device.h"
#include "../support/benchmark_options.h"
#include "../support/decode_mlp_stages.h"

namespace {

using namespace metile;

struct Model {
  const char* name;
  std::int64_t hidden, intermediate;
};

struct Row {
  std::string model, format;
  std::int64_t rows = 0;
  double stage_us[2] = {0, 0}, stage_native_us[2] = {0, 0};
  double stage_bytes[2] = {0, 0};
  std::string stage_choice[2];
  double mlp_us = 0, mlp_native_us = 0, mlp_bytes = 0;
  double mlp_serialized_us = 0;  // the same kernels without programmatic dependent launch
  bool programmatic_dependent = false;
  double mlp_stages_us = 0;      // the chosen stage kernels (two launches), whatever the whole-MLP race chose
  double mlp_persistent_us = -1;  // the fastest gated persistent kernel (one launch); < 0: none passed
  std::string persistent_shape;   // its name; the executor runs it when `persistent`
  bool persistent = false;
  int replicas = 1;
  // The harness's floors for this MLP's bytes, round-robin over the same replicas, M = 1 rows only (< 0:
  // not measured): two read-only kernels (gate/up's weights, then down's), and one over both.
  double floor_us = -1, one_kernel_floor_us = -1;
};

// --kernels: each tuning candidate of each stage kernel, timed alone over weight replicas.
// --profile (profile_only): the stage kernels of 4-bit g64 at profile_rows rows, each launched once.
// A register-batch shape without staging, split-K or L2 prefetch.
bool plain_register_shape(const GemvKernelConfig& config) {
  return config.mainloop == GemvMainloop::register_batches && config.shared_stages < 2 && config.k_splits == 1 &&
         config.l2_prefetch_rounds == 0;
}

// --residency: the bounded variants of each plain register shape besides (residency_variants).
std::vector<GemvKernelConfig> residency_variants(const std::vector<GemvKernelConfig>& configs) {
  std::vector<GemvKernelConfig> variants;
  std::set<std::string> seen;
  for (const GemvKernelConfig& config : configs) seen.insert(config.to_string());
  std::map<int, int> shapes_per_stage;  // by product count: gate/up 2, down 1
  for (const GemvKernelConfig& config : configs) {
    const bool plain = plain_register_shape(config) && config.resident_blocks_per_multiprocessor == 0 &&
                       config.tiles_per_block == 1 && !config.shared_group_sums &&
                       config.schedule == GatedSchedule::register_resident;
    if (!plain || ++shapes_per_stage[config.epilogue.product_count()] > 3) continue;
    for (int depth : {1, 2}) {
      for (int blocks = 2; blocks <= 6; ++blocks) {
        GemvKernelConfig variant = config;
        variant.iterations_in_flight = config.iterations_in_flight * depth;
        variant.resident_blocks_per_multiprocessor = blocks;
        try {
          variant.validate();
        } catch (const InputError&) {
          continue;
        }
        if (seen.insert(variant.to_string()).second) variants.push_back(variant);
      }
    }
  }
  return variants;
}

void time_stage_kernels(const CudaDevice& device, const CudaStream& stream, double copy_gbps, bool profile_only,
                        std::int64_t profile_rows = 1, bool residency = false) {
  const CudaDeviceInfo& info = device.info();
  const std::int64_t hidden = 4096, intermediate = 14336;
  fmt::print("{:<17} {:>2} {:<8} {:<54} {:>8} {:>7} {:>6} {:>5} {:>7}\n", "format", "M", "stage", "kernel", "us", "GB/s",
             "%copy", "regs", "blk/SM");
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16),
                                         GemvWeightFormat::affine(8, 64, DType::bf16)}) {
    if (profile_only && format.bits != 4) continue;  // bf16 was profiled in call 5 (notes/mlp_decode.md)
    if (residency && !format.is_affine()) continue;
    const DecodeMlpWeights weights = DecodeMlpWeights::random(format, hidden, intermediate, 7);
    const int replicas =
        static_cast<int>(std::clamp<std::int64_t>(3 * info.l2_cache_bytes / (weights.weight_bytes() / 3) + 1, 1, 8));
    // Device weights per matrix (gate, up, down), `replicas` copies each.
    std::vector<std::vector<DeviceBuffer>> words(3), scale_bias(3);
    for (int r = 0; r < replicas; ++r) {
      if (format.is_affine()) {
        const QuantizedMatrix* matrices[3] = {&*weights.quantized_gate, &*weights.quantized_up, &*weights.quantized_down};
        for (int i = 0; i < 3; ++i) {
          const RepackedAffineMatrix repacked = repack_for_gemv(*matrices[i]);
          words[static_cast<std::size_t>(i)].push_back(DeviceBuffer::from_vector<std::uint32_t>(repacked.words));
          scale_bias[static_cast<std::size_t>(i)].push_back(DeviceBuffer::from_vector<std::uint16_t>(repacked.scale_bias));
        }
      } else {
        const HostTensor* matrices[3] = {&weights.gate, &weights.up, &weights.down};
        for (int i = 0; i < 3; ++i) words[static_cast<std::size_t>(i)].push_back(DeviceBuffer::from_tensor(*matrices[i]));
      }
    }
    DeviceBuffer x(2 * 16 * static_cast<std::size_t>(intermediate)), residual(2 * 16 * hidden),
        out(2 * 16 * static_cast<std::size_t>(intermediate));
    x.fill_bytes(0x3C, &stream);
    residual.fill_bytes(0x3C, &stream);
    for (std::int64_t rows : {1, 16}) {
      if (profile_only && rows != profile_rows) continue;
      std::vector<GemvKernelConfig> configs;
      const benchmarks::DecodeMlpStageConfigs stages = benchmarks::decode_mlp_stage_configs(format, rows, hidden, intermediate);
      for (GatedSchedule schedule : {GatedSchedule::register_resident, GatedSchedule::scratch_spilled}) {
        GemvKernelConfig base = stages.gate_up;
        base.schedule = schedule;
        for (const GemvKernelConfig& config : gemv_tuning_candidates(base, info.multiprocessor_count)) configs.push_back(config);
      }
      for (const GemvKernelConfig& config : gemv_tuning_candidates(stages.down, info.multiprocessor_count)) configs.push_back(config);
      // Each register-resident shape again with its weights prefetched into L2 ahead of the loads.
      for (std::size_t i = 0, plain = configs.size(); i < plain; ++i) {
        if (configs[i].schedule == GatedSchedule::scratch_spilled && configs[i].epilogue.product_count() == 2) continue;
        GemvKernelConfig prefetching = configs[i];
        prefetching.l2_prefetch_rounds = gemv_l2_prefetch_rounds(prefetching, info.multiprocessor_count);
        configs.push_back(prefetching);
      }
      for (GemvKernelConfig streamed : {stages.gate_up, stages.down}) {
        streamed.mainloop = GemvMainloop::streamed;
        for (const GemvKernelConfig& config : gemv_tuning_candidates(streamed, info.multiprocessor_count)) {
          configs.push_back(config);
        }
      }
      if (residency) {
        const std::vector<GemvKernelConfig> bounded = residency_variants(configs);
        configs.insert(configs.end(), bounded.begin(), bounded.end());
      }
      if (profile_only) {  // per stage, the first shape of each kind: staged, split-K, prefetching, streamed; the
                         // first three plain register shapes (the ones the races choose)
        std::vector<GemvKernelConfig> chosen;
        auto kind = [](const GemvKernelConfig& c) {
          return std::tuple{c.epilogue.product_count(), c.mainloop, c.shared_stages >= 2, c.k_splits > 1, c.l2_prefetch_rounds > 0};
        };
        for (const GemvKernelConfig& config : configs) {
          if (config.schedule == GatedSchedule::scratch_spilled && config.mainloop == GemvMainloop::register_batches) continue;
          const auto same_kind = std::count_if(chosen.begin(), chosen.end(), [&](const GemvKernelConfig& c) { return kind(c) == kind(config); });
          if (same_kind < (plain_register_shape(config) ? 3 : 1)) chosen.push_back(config);
        }
        configs = chosen;
      }
      // NVRTC needs no device: compile every shape at once.
      std::vector<std::future<CompiledProgram>> programs;
      for (const GemvKernelConfig& config : configs) {
        programs.push_back(std::async(std::launch::async, [kernel = generate_gemv_kernel(config), &info] {
          CompileOptions compile_options;
          compile_options.architecture = info.architecture();
          return compile_cuda_program(kernel.source, kernel.kernel_name, compile_options);
        }));
      }
      for (std::size_t index = 0; index < configs.size(); ++index) {
        const GemvKernelConfig& config = configs[index];
        const GemvKernelSource kernel = generate_gemv_kernel(config);
        const LoadedGemv gemv = LoadedGemv::load(kernel, programs[index].get());
        const bool gate_up = config.epilogue.product_count() == 2;
        std::vector<KernelArguments> per_replica;
        for (int r = 0; r < replicas; ++r) {
          KernelArguments arguments;
          for (int matrix : gate_up ? std::vector<int>{0, 1} : std::vector<int>{2}) {
            arguments.add_pointer(words[static_cast<std::size_t>(matrix)][static_cast<std::size_t>(r)]);
            if (format.is_affine()) arguments.add_pointer(scale_bias[static_cast<std::size_t>(matrix)][static_cast<std::size_t>(r)]);
          }
          arguments.add_pointer(x);
          if (!gate_up) arguments.add_pointer(residual);
          arguments.add_pointer(out);
          per_replica.push_back(arguments);
        }
        if (profile_only) {
          gemv.launch(stream, per_replica.front());
          stream.synchronize();
          continue;
        }
        const double ms = time_on_stream_ms(
                              stream,
                              [&](const CudaStream& s) {
                                for (const KernelArguments& arguments : per_replica) gemv.launch(s, arguments);
                              },
                              3, 20, 5) /
                          replicas;
        const double gbps = static_cast<double>(gemv_minimum_bytes(config)) / (ms * 1e-3) / 1e9;
        // The register shapes by the name the races give them (gemv_shape_name: every flag that sets two
        // candidates apart), the streamed ones with their K slices.
        const std::string name =
            config.mainloop == GemvMainloop::streamed
                ? fmt::format("{} streamed w{} u{} s{} x{} k{}", gate_up ? "swiglu" : "residual", config.warps_per_block,
                              config.stage_iterations, config.stages, config.blocks_per_multiprocessor, kernel.k_slices)
                : gemv_shape_name(config);
        const int resident = gemv.compiled.max_active_blocks_per_multiprocessor(static_cast<int>(kernel.block_threads),
                                                                                kernel.dynamic_shared_bytes);
        fmt::print("{:<17} {:>2} {:<8} {:<54} {:>8.1f} {:>7.0f} {:>5.0f}% {:>5} {:>7}\n", format.to_string(), rows,
                   gate_up ? "gate_up" : "down", name, ms * 1e3, gbps, 100 * gbps / copy_gbps,
                   gemv.compiled.registers_per_thread(), resident);
        std::fflush(stdout);
      }
    }
  }
}

// The read-only stream over 1 GiB (DeviceRead: the kernel of bench-model's read floors too).
double measure_read_bandwidth_gbps(const CudaStream& stream, bool profile_only) {
  const std::size_t bytes = std::size_t{1} << 30;
  DeviceBuffer data(bytes);
  data.fill_bytes(0x3C, &stream);
  const DeviceRead reader({{data.address(), bytes}});
  auto run = [&](const CudaStream& s) { reader.enqueue(s); };
  if (profile_only) {
    run(stream);
    stream.synchronize();
    return 0;
  }
  const double ms = time_on_stream_ms(stream, run, 2, 5, 5);
  return static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  bool full = false, quick = false, kernels = false, profile = false, verbose = false, residency = false;
  bool cold_tournaments = true;
  std::int64_t profile_rows = 1;
  int tuning_candidates = DecodeMlpOptions{}.tuning_candidates;
  CLI::App app{"the decode MLP through DecodeMlpExecutor, % of copy bandwidth", "mlp_decode_benchmark"};
  CLI::Option* full_flag = app.add_flag("--full", full, "every model at every M");
  CLI::Option* quick_flag =
      app.add_flag("--quick", quick, "Llama-3-8B at M = 1, 16; the others 4-bit g64 at M = 1, 16 (the goals)");
  CLI::Option* kernels_flag =
      app.add_flag("--kernels", kernels, "every generated stage kernel of Llama-3-8B alone (no executor)");
  CLI::Option* profile_flag =
      app.add_flag("--profile", profile, "the 4-bit g64 stage kernels launched once each, for ncu (no timing)");
  CLI::Option* rows_option = app.add_option("--profile-rows", profile_rows, "--profile at M activation rows")
                                 ->check(CLI::IsMember({1, 16}))
                                 ->capture_default_str();
  CLI::Option* residency_flag =
      app.add_flag("--residency", residency, "--kernels: the bounded variants of each plain register shape besides");
  std::string caches = "cold";
  CLI::Option* caches_option =
      app.add_option("--tournament-caches", caches, "the executors' races: cold (L2 flushed before every call) or warm")
          ->check(CLI::IsMember({"cold", "warm"}))
          ->capture_default_str();
  CLI::Option* verbose_flag = app.add_flag("--verbose", verbose, "every stage's candidates: gate result and tournament score");
  CLI::Option* candidates_option = app.add_option("--candidates", tuning_candidates, "launch shapes per fused schedule")
                                       ->check(CLI::Validator(
                                           [](std::string& text) {
                                             const bool digits = !text.empty() && text.size() <= 9 &&
                                                                 std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
                                             return digits ? std::string() : text + " is not a whole number";
                                           },
                                           "INT"))
                                       ->check(CLI::Range(1, 1000))
                                       ->capture_default_str();
  // One mode at a time; --profile-rows is --profile's and --residency --kernels' (each implies its mode).
  for (CLI::Option* mode : {full_flag, quick_flag, kernels_flag, profile_flag}) {
    for (CLI::Option* other : {full_flag, quick_flag, kernels_flag, profile_flag}) {
      if (mode != other) mode->excludes(other);
    }
  }
  rows_option->excludes(full_flag)->excludes(quick_flag)->excludes(kernels_flag);
  // The executors' options: --kernels and --profile time kernels alone (no executor, no race).
  for (CLI::Option* executor_option : {caches_option, verbose_flag, candidates_option}) {
    executor_option->excludes(kernels_flag)->excludes(profile_flag)->excludes(rows_option)->excludes(residency_flag);
  }
  if (const std::optional<int> exit_code = benchmarks::parse_benchmark_options(app, argc, argv)) return *exit_code;
  cold_tournaments = caches == "cold";
  if (rows_option->count() > 0) profile = true;
  if (residency) {
    if (full || quick || profile) {
      fmt::print(stderr, "mlp_decode_benchmark: error: --residency goes with --kernels (not --full, --quick, --profile "
                         "or --profile-rows)\n");
      return 2;
    }
    kernels = true;
  }
  const std::optional<CudaDevice> device = benchmarks::open_device_or_say_why("mlp_decode_benchmark");
  if (!device) return 0;
  try {
    const CudaDeviceInfo& info = device->info();
    CudaStream stream;
    if (profile) {
      measure_read_bandwidth_gbps(stream, true);
      time_stage_kernels(*device, stream, 0, true, profile_rows);
      return 0;
    }
    const double copy_gbps = measure_copy_bandwidth_gbps(stream);
    const double read_gbps = measure_read_bandwidth_gbps(stream, false);
    fmt::print("device: {}\n", benchmarks::describe_device(info));
    fmt::print("device-to-device copy (1 GiB, read + write): {:.0f} GB/s\n", copy_gbps);
    fmt::print("read-only stream (1 GiB, 16-byte loads): {:.0f} GB/s = {:.0f}% of copy\n\n", read_gbps,
               100 * read_gbps / copy_gbps);
    if (kernels) {
      time_stage_kernels(*device, stream, copy_gbps, false, 1, residency);
      return 0;
    }

    const std::vector<Model> models = {{"Llama-3-8B", 4096, 14336}, {"Qwen2.5-1.5B", 1536, 8960}, {"Llama-3.2-1B", 2048, 8192}};
    const std::vector<GemvWeightFormat> formats = {GemvWeightFormat::dense(DType::bf16), GemvWeightFormat::affine(4, 64, DType::bf16),
                                                   GemvWeightFormat::affine(4, 128, DType::bf16),
                                                   GemvWeightFormat::affine(8, 64, DType::bf16)};
    DecodeMlpOptions options;
    options.mode = DispatchMode::automatic;
    // A fresh decision file per run: every configuration is measured once, its replicas reuse it.
    options.use_decision_cache = true;
    options.decision_cache_file =
        std::filesystem::temp_directory_path() / fmt::format("metile_mlp_decode_benchmark_{}.json", ::getpid());
    std::filesystem::remove(options.decision_cache_file);
    options.tuning_candidates = tuning_candidates;
    options.tournament.rounds = 5;
    options.tournament.calls_per_sample = 10;
    // The races read the weights from DRAM, as the table below does (replicas past 3x the L2) and as a
    // decode step does (bench-model's default): back to back, a Qwen2.5-1.5B or Llama-3.2-1B MLP (22-28
    // MB) is read from the H200's 50 MB L2, and the shape that wins there need not win from DRAM.
    if (cold_tournaments) options.tournament.cold_cache_bytes = 2 * static_cast<std::size_t>(info.l2_cache_bytes);

    std::vector<Row> table;
    std::string candidate_reports;  // every candidate's gate and time, for a few configurations
    for (const Model& model : models) {
      const bool first_model = &model == &models.front();
      std::vector<std::int64_t> row_counts = {1, 2, 4, 8, 16};
      if (quick || (!full && !first_model)) row_counts = {1, 16};
      for (const GemvWeightFormat& format : formats) {
        if (quick && !first_model && !(format.bits == 4 && format.group_size == 64)) continue;
        // Replicas so that the weights streamed per whole-MLP round exceed 3x the L2 cache.
        const DecodeMlpWeights weights = DecodeMlpWeights::random(format, model.hidden, model.intermediate, 2024);
        const std::int64_t weight_bytes = weights.weight_bytes();
        const int replicas = static_cast<int>(std::clamp<std::int64_t>(3 * info.l2_cache_bytes / weight_bytes + 1, 1, 8));
        for (std::int64_t rows : row_counts) {
          // The replicas hold the same values in their own buffers and take the first one's
          // decision from the decision cache (same device, sources and shapes): no new tournament.
          std::vector<DecodeMlpExecutor> executors;
          for (int r = 0; r < replicas; ++r) executors.push_back(DecodeMlpExecutor::build(weights, rows, *device, options));
          Row row;
          row.model = model.name;
          row.format = format.to_string();
          row.rows = rows;
          row.replicas = replicas;
          const DecodeMlpStageReport* stages[2] = {&executors.front().gate_up_report(), &executors.front().down_report()};
          const std::int64_t activations = 2 * rows;  // bytes per element of x, hidden, residual, out (16-bit)
          const std::int64_t stage_weights[2] = {weight_bytes * 2 / 3, weight_bytes / 3};
          row.stage_bytes[0] = static_cast<double>(stage_weights[0] + activations * (model.hidden + model.intermediate));
          row.stage_bytes[1] = static_cast<double>(stage_weights[1] + activations * (model.intermediate + 2 * model.hidden));
          for (int s = 0; s < 2; ++s) {
            row.stage_us[s] = stages[s]->chosen_ms() * 1e3;
            row.stage_native_us[s] = stages[s]->native_ms() * 1e3;
            row.stage_choice[s] = stages[s]->candidates[static_cast<std::size_t>(stages[s]->chosen)].name;
            if (!verbose) continue;
            fmt::print("  {} {} M={} {}\n", model.name, row.format, rows, stages[s]->sentence);
            for (const DecodeMlpCandidate& candidate : stages[s]->candidates) {
              fmt::print("    {:<48} gate {} (L2 {:.1e}{}{}) {}\n", candidate.name, candidate.gate.passed ? "passed" : "FAILED",
                         candidate.gate.relative_l2, candidate.gate.detail.empty() ? "" : ": ", candidate.gate.detail,
                         candidate.score_ms < 0 ? std::string("not timed") : fmt::format("{:.1f} us", candidate.score_ms * 1e3));
            }
          }
          row.mlp_bytes = static_cast<double>(weight_bytes + activations * 3 * model.hidden);
          enum class Graph { executor, native, serialized, stages, persistent };
          const auto replay = [&](Graph graph) {
            return time_on_stream_ms(
                       stream,
                       [&](const CudaStream& s) {
                         for (const DecodeMlpExecutor& executor : executors) {
                           if (graph == Graph::native) {
                             executor.enqueue_native(s);
                           } else if (graph == Graph::serialized) {
                             executor.enqueue_serialized(s);
                           } else if (graph == Graph::stages) {
                             executor.enqueue_stages(s);
                           } else if (graph == Graph::persistent) {
                             executor.enqueue_persistent(s);
                           } else {
                             executor.enqueue(s);
                           }
                         }
                       },
                       3, 10, 7) /
                   static_cast<double>(executors.size());
          };
          if (model.name == models.front().name && (rows == 1 || rows == 16) && format.bits != 8) {
            candidate_reports += fmt::format("{} {} M={}\n{}", model.name, format.to_string(), rows, executors.front().report());
          }
          if (rows == 1) {
            // Buffers of the same bytes as the replicas' weights, read (DeviceRead) by two plain launches a
            // replica (gate/up's bytes, then down's) or by one.
            const std::uint64_t first = static_cast<std::uint64_t>(stage_weights[0]), second = static_cast<std::uint64_t>(stage_weights[1]);
            std::vector<DeviceBuffer> buffers;
            std::vector<DeviceRead> two_reads, one_read;
            for (int r = 0; r < replicas; ++r) {
              DeviceBuffer& buffer = buffers.emplace_back(first + second);
              buffer.fill_bytes(0x3C, &stream);
              two_reads.emplace_back(std::vector<DeviceByteRange>{{buffer.address(), first}});
              two_reads.emplace_back(std::vector<DeviceByteRange>{{buffer.address() + first, second}});
              one_read.emplace_back(std::vector<DeviceByteRange>{{buffer.address(), first + second}});
            }
            auto floor_us = [&](const std::vector<DeviceRead>& reads) {
              return time_on_stream_ms(
                         stream, [&](const CudaStream& s) { for (const DeviceRead& read : reads) read.enqueue(s); },
                         3, 10, 7) /
                     static_cast<double>(replicas) * 1e3;
            };
            row.floor_us = floor_us(two_reads);
            row.one_kernel_floor_us = floor_us(one_read);
          }
          row.mlp_us = replay(Graph::executor) * 1e3;
          row.mlp_native_us = replay(Graph::native) * 1e3;
          row.mlp_serialized_us = replay(Graph::serialized) * 1e3;
          row.programmatic_dependent = executors.front().programmatic_dependent();
          row.mlp_stages_us = replay(Graph::stages) * 1e3;
          row.persistent = executors.front().persistent();
          const bool every_replica_has_one = std::all_of(executors.begin(), executors.end(), [](const DecodeMlpExecutor& e) {
            return e.has_persistent();
          });
          if (every_replica_has_one) {
            row.mlp_persistent_us = replay(Graph::persistent) * 1e3;
            // The fastest persistent candidate of the whole-MLP race (the tournament's score).
            double best = -1;
            for (const DecodeMlpCandidate& candidate : executors.front().whole_report().candidates) {
              if (candidate.name.find("persistent") == std::string::npos || !candidate.gate.passed) continue;
              if (candidate.score_ms >= 0 && (best < 0 || candidate.score_ms < best)) {
                best = candidate.score_ms;
                row.persistent_shape = candidate.id.variant;
              }
            }
          }
          if (model.name != models.front().name && rows == 1) {
            candidate_reports += fmt::format("{} {} M={}\n{}", model.name, format.to_string(), rows, executors.front().report());
          }
          table.push_back(row);
          fmt::print("{:<13} {:<18} M={:<2} gate/up {:>7.1f} us ({}), down {:>7.1f} us ({}), MLP {:>7.1f} us vs native {:>7.1f} us\n",
                     row.model, row.format, rows, row.stage_us[0], row.stage_choice[0], row.stage_us[1],
                     row.stage_choice[1], row.mlp_us, row.mlp_native_us);
          std::fflush(stdout);
        }
      }
    }

    auto gbps = [](double bytes, double us) { return bytes / (us * 1e-6) / 1e9; };
    fmt::print("\nper stage (tournament scores; GB/s over weights + scales/biases + activations read and written)\n");
    fmt::print("{:<13} {:<17} {:>2} | {:>8} {:>6} {:>5} {:>5} {:<34} | {:>8} {:>6} {:>5} {:>5} {:<30}\n", "model", "format", "M",
               "gate/up", "GB/s", "%copy", "xnat", "selected", "down", "GB/s", "%copy", "xnat", "selected");
    for (const Row& row : table) {
      fmt::print("{:<13} {:<17} {:>2} | {:>6.1f}us {:>6.0f} {:>4.0f}% {:>5.2f} {:<34} | {:>6.1f}us {:>6.0f} {:>4.0f}% {:>5.2f} {:<30}\n",
                 row.model, row.format, row.rows, row.stage_us[0], gbps(row.stage_bytes[0], row.stage_us[0]),
                 100 * gbps(row.stage_bytes[0], row.stage_us[0]) / copy_gbps, row.stage_native_us[0] / row.stage_us[0],
                 row.stage_choice[0], row.stage_us[1], gbps(row.stage_bytes[1], row.stage_us[1]),
                 100 * gbps(row.stage_bytes[1], row.stage_us[1]) / copy_gbps, row.stage_native_us[1] / row.stage_us[1],
                 row.stage_choice[1]);
    }
    fmt::print("\nwhole MLP (executor CUDA graph vs native CUDA graph, round-robin over replicas > 3x L2; PDL: down\n"
               "launched as a programmatic dependent of gate/up, 'no PDL us' the same kernels in plain stream order;\n"
               "'floor us' two read-only kernels over the same weight bytes in the same round robin, M = 1, 'one\n"
               "kernel' one read-only kernel over them, each with the copy percentage it reaches)\n");
    fmt::print("{:<13} {:<17} {:>2} {:>8} {:>9} {:>7} {:>6} {:>10} {:>6} {:>4} {:>10} {:>9} {:>6} {:>10} {:>6}\n", "model",
               "format", "M", "replicas", "us", "GB/s", "%copy", "native us", "xnat", "PDL", "no PDL us", "floor us", "%copy",
               "one kernel", "%copy");
    for (const Row& row : table) {
      fmt::print("{:<13} {:<17} {:>2} {:>8} {:>9.1f} {:>7.0f} {:>5.0f}% {:>10.1f} {:>6.2f} {:>4} {:>10.1f} {}\n", row.model,
                 row.format, row.rows, row.replicas, row.mlp_us, gbps(row.mlp_bytes, row.mlp_us),
                 100 * gbps(row.mlp_bytes, row.mlp_us) / copy_gbps, row.mlp_native_us, row.mlp_native_us / row.mlp_us,
                 row.programmatic_dependent ? "yes" : "no", row.mlp_serialized_us,
                 row.floor_us < 0 ? std::string()
                                  : fmt::format("{:>9.1f} {:>5.0f}% {:>10.1f} {:>5.0f}%", row.floor_us,
                                                100 * gbps(row.mlp_bytes, row.floor_us) / copy_gbps, row.one_kernel_floor_us,
                                                100 * gbps(row.mlp_bytes, row.one_kernel_floor_us) / copy_gbps));
    }

    fmt::print("\npersistent decode MLP (issue 15: gate/up, a grid-wide barrier and down in one launch; same replicas):\n"
               "'stages us' the chosen two stage kernels, 'persistent us' the fastest persistent kernel that passed the\n"
               "float64 gate, 'chosen' whether the whole-MLP race put it in the executor's graph\n");
    fmt::print("{:<13} {:<17} {:>2} {:>10} {:>7} {:>14} {:>7} {:>7} {:<28} {:>6}\n", "model", "format", "M", "stages us",
               "%copy", "persistent us", "%copy", "xstages", "persistent shape", "chosen");
    for (const Row& row : table) {
      if (row.mlp_persistent_us < 0) {
        fmt::print("{:<13} {:<17} {:>2} {:>10.1f} {:>6.0f}% {:>14} {:>7} {:>7} {:<28} {:>6}\n", row.model, row.format,
                   row.rows, row.mlp_stages_us, 100 * gbps(row.mlp_bytes, row.mlp_stages_us) / copy_gbps, "-", "", "",
                   "none passed the gate", "no");
        continue;
      }
      fmt::print("{:<13} {:<17} {:>2} {:>10.1f} {:>6.0f}% {:>14.1f} {:>6.0f}% {:>7.2f} {:<28} {:>6}\n", row.model, row.format,
                 row.rows, row.mlp_stages_us, 100 * gbps(row.mlp_bytes, row.mlp_stages_us) / copy_gbps,
                 row.mlp_persistent_us, 100 * gbps(row.mlp_bytes, row.mlp_persistent_us) / copy_gbps,
                 row.mlp_stages_us / row.mlp_persistent_us, row.persistent_shape, row.persistent ? "yes" : "no");
    }

    // The goals of issue 15, with what this run reached (copy bandwidth of this run).
    auto find = [&](const std::string& model, const std::string& format, std::int64_t rows) -> const Row* {
      for (const Row& row : table) {
        if (row.model == model && row.format == format && row.rows == rows) return &row;
      }
      return nullptr;
    };
    fmt::print("\ngoals (issue 15; whole MLP, % of this run's copy bandwidth)\n");
    struct Goal {
      const char* model;
      const char* format;
      double percent;
    };
    for (const Goal& goal : {Goal{"Llama-3-8B", "bf16 affine4 g64", 80}, Goal{"Llama-3-8B", "bf16", 92},
                             Goal{"Llama-3-8B", "bf16 affine8 g64", 85}, Goal{"Qwen2.5-1.5B", "bf16 affine4 g64", 70},
                             Goal{"Llama-3.2-1B", "bf16 affine4 g64", 70}}) {
      if (const Row* row = find(goal.model, goal.format, 1)) {
        const double percent = 100 * gbps(row->mlp_bytes, row->mlp_us) / copy_gbps;
        const double goal_us = row->mlp_bytes / (goal.percent / 100 * copy_gbps * 1e9) * 1e6;
        fmt::print("  {:<13} {:<17} M=1: >= {:.0f}% (<= {:.1f} us): {:.1f} us = {:.0f}% -> {}\n", goal.model, goal.format,
                   goal.percent, goal_us, row->mlp_us, percent, percent >= goal.percent ? "reached" : "NOT reached");
      }
    }
    for (const char* format : {"bf16", "bf16 affine4 g64", "bf16 affine4 g128", "bf16 affine8 g64"}) {
      const Row* one = find("Llama-3-8B", format, 1);
      const Row* sixteen = find("Llama-3-8B", format, 16);
      if (one && sixteen) {
        const double ratio = sixteen->mlp_us / one->mlp_us;
        fmt::print("  Llama-3-8B    {:<17} M=1 -> 16 within 1.2x: {:.1f} us -> {:.1f} us = {:.2f}x -> {}\n", format,
                   one->mlp_us, sixteen->mlp_us, ratio, ratio <= 1.2 ? "reached" : "NOT reached");
      }
    }
    fmt::print("\ncandidates (numeric gate against float64, tournament score)\n{}", candidate_reports);
    std::filesystem::remove(options.decision_cache_file);
    return 0;
  } catch (const std::exception& error) {
    fmt::print(stderr, "mlp_decode_benchmark: {}\n", error.what());
    return 1;
  }
}
