// gemv_timeline_benchmark: where one decode MLP's time goes inside its two kernels, block by block.
//
// The two stage kernels (gate/up + SwiGLU, then down + residual) are compiled with the block
// timeline (gemv_timeline_source, src/codegen/gemv_mainloop.cpp): every warp stamps %globaltimer when
// its block starts, when the wait for the previous kernel returns, when the warp's accumulation ends
// and when the block's store is done (with --batches also when each register batch's loads are
// issued, when its last load has landed and when its math is done: those stamps change the loop they
// measure, so they are off by default). Each stamped kernel is bound to the blocks an SM its plain
// build keeps resident, so that the grid runs the same waves. The MLP runs round-robin
// over weight replicas (past 3x the L2, so the weights come from DRAM), each kernel launched as a
// programmatic dependent of the one before, as in the decode step; the last replica's records are
// read back and printed as distributions (min, p10, p50, p90, max over warps, in us from the first
// gate/up block's start), so that the ramp (first block to first bytes), each round of batches and the
// tail (the last blocks' end, the down kernel's first blocks) can be told apart. The whole-MLP time
// printed last is the stamped kernels' beside the plain ones' in the same harness.
//
//   gemv_timeline_benchmark                         Llama-3-8B, 4-bit g64, M = 1, the usual race winners
//   --model llama3-8b|qwen2.5-1.5b|llama3.2-1b
//   --bits 4|8|16 --group-size 64|128 --rows M
//   --batches                                       the per-batch stamps too (they perturb the loop)
//   --cap-gate-up N --cap-down N                    at most N blocks of that stage an SM (the dynamic shared memory
//                                                   LoadedGemv::load gives for GemvKernelSource::
//                                                   blocks_per_multiprocessor_cap): how the blocks spread over the
//                                                   SMs, against the plain grid
//   --carveout P                                    every kernel's preferred shared-memory carveout, percent of
//                                                   the SM's L1/shared storage (GemvKernelSource::
//                                                   shared_memory_carveout_percent): a capped stage and the
//                                                   other with one split, so that they may share an SM
//   --serial-down                                   the down kernel launched after gate/up completes (no
//                                                   programmatic dependent launch): its blocks then spread
//                                                   over the SMs instead of filling those gate/up leaves first
//   --gate-up NAME --down NAME                      shapes by their race names ("register_resident w4 t1 f2
//                                                   batch", "w8 t1 f2 db resident2"); a wrong name lists them
// Prints "no CUDA device: ..." and exits 0 where there is none.
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "metile/cuda_runtime.h"
#include "metile/decode_mlp.h"
#include "metile/dispatch.h"
#include "../support/benchmark_device.h"
#include "../support/benchmark_options.h"
#include "../support/decode_mlp_stages.h"

namespace {

using namespace metile;

constexpr int kSlots = 32;  // u64 a warp (gemv_mainloop.cpp's timeline)

struct Stage {
  std::string label;
  GemvKernelConfig config;
  GemvKernelSource kernel;
  std::uint64_t offset = 0;  // of its records in the timeline buffer, bytes
  std::size_t warps() const { return std::size_t{kernel.grid_blocks} * static_cast<std::size_t>(config.warps_per_block); }
};

GemvKernelConfig find_shape(const GemvKernelConfig& base, const std::string& name, int multiprocessors) {
  const std::vector<GemvKernelConfig> configs = gemv_stage_configs(base, 12, multiprocessors, false);
  for (const GemvKernelConfig& config : configs) {
    if (gemv_shape_name(config) == name) return config;
  }
  std::string names;
  for (const GemvKernelConfig& config : configs) names += fmt::format("\n  {}", gemv_shape_name(config));
  throw InputError(fmt::format("no shape named '{}'; this stage's shapes:{}", name, names));
}

struct Distribution {
  std::size_t count = 0;
  double min = 0, p10 = 0, p50 = 0, p90 = 0, max = 0;
};

Distribution distribution(std::vector<double> values) {
  Distribution d;
  d.count = values.size();
  if (values.empty()) return d;
  std::sort(values.begin(), values.end());
  auto at = [&](double q) { return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1) + 0.5)]; };
  d.min = values.front();
  d.p10 = at(0.1);
  d.p50 = at(0.5);
  d.p90 = at(0.9);
  d.max = values.back();
  return d;
}

void print_row(const std::string& event, const Distribution& d) {
  if (d.count == 0) return;
  fmt::print("  {:<26} {:>6} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f}\n", event, d.count, d.min, d.p10, d.p50, d.p90, d.max);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama3-8b", gate_up_name, down_name;
  int bits = 4, group_size = 64;
  bool batches = false, serial_down = false;
  int caps[2] = {0, 0};
  int carveout = -1;
  std::int64_t rows = 1;
  CLI::App app{"one decode MLP's two kernels, block by block (%globaltimer stamps)", "gemv_timeline_benchmark"};
  app.add_option("--model", model, "whose MLP")->check(CLI::IsMember({"llama3-8b", "qwen2.5-1.5b", "llama3.2-1b"}))->capture_default_str();
  app.add_option("--bits", bits, "4, 8 (affine) or 16 (bf16)")->check(CLI::IsMember({4, 8, 16}))->capture_default_str();
  app.add_option("--group-size", group_size, "affine group size")->check(CLI::IsMember({64, 128}))->capture_default_str();
  app.add_option("--rows", rows, "activation rows M")->check(CLI::Range(1, 16))->capture_default_str();
  app.add_flag("--batches", batches, "each register batch's stamps too (they change the loop they measure)");
  app.add_option("--cap-gate-up", caps[0], "at most N gate/up blocks an SM")->check(CLI::Range(1, 32));
  app.add_option("--cap-down", caps[1], "at most N down blocks an SM")->check(CLI::Range(1, 32));
  app.add_flag("--serial-down", serial_down, "launch the down kernel without programmatic dependent launch");
  app.add_option("--carveout", carveout, "every kernel's preferred shared-memory carveout, percent")->check(CLI::Range(0, 100));
  app.add_option("--gate-up", gate_up_name, "the gate/up shape's race name (default: the race's usual winner)");
  app.add_option("--down", down_name, "the down shape's race name (default: the race's usual winner)");
  if (const std::optional<int> exit_code = benchmarks::parse_benchmark_options(app, argc, argv)) return *exit_code;
  const std::optional<CudaDevice> device = benchmarks::open_device_or_say_why("gemv_timeline_benchmark");
  if (!device) return 0;
  try {
    const CudaDeviceInfo& info = device->info();
    const int sms = info.multiprocessor_count;
    const std::map<std::string, std::pair<std::int64_t, std::int64_t>> shapes = {
        {"llama3-8b", {4096, 14336}}, {"qwen2.5-1.5b", {1536, 8960}}, {"llama3.2-1b", {2048, 8192}}};
    const auto [hidden, intermediate] = shapes.at(model);
    const GemvWeightFormat format =
        bits == 16 ? GemvWeightFormat::dense(DType::bf16) : GemvWeightFormat::affine(bits, group_size, DType::bf16);
    // The usual race winners (notes/mlp_decode.md): Llama-3-8B's; the narrow models' down differs.
    if (gate_up_name.empty()) gate_up_name = "register_resident w4 t1 f2 batch";
    if (down_name.empty()) down_name = model == "llama3-8b" ? "w8 t1 f2 db resident2" : "w16 t1 f1 db";

    const benchmarks::DecodeMlpStageConfigs bases = benchmarks::decode_mlp_stage_configs(format, rows, hidden, intermediate);
    std::vector<Stage> stages = {{"gate/up", find_shape(bases.gate_up, gate_up_name, sms), {}, 0},
                                 {"down", find_shape(bases.down, down_name, sms), {}, 0}};
    std::uint64_t timeline_bytes = 0;
    for (Stage& stage : stages) {
      stage.kernel = generate_gemv_kernel(stage.config);
      stage.offset = timeline_bytes;
      timeline_bytes += stage.warps() * kSlots * 8;
    }
    DeviceBuffer timeline(timeline_bytes);
    CudaStream stream;
    timeline.fill_bytes(0, &stream);
    std::vector<LoadedGemv> plain, loaded;
    for (std::size_t s = 0; s < stages.size(); ++s) {
      Stage& stage = stages[s];
      CompileOptions options;
      options.architecture = info.architecture();
      // A cap: the padding LoadedGemv::load gives the kernel, kept for the stamped build below.
      stage.kernel.blocks_per_multiprocessor_cap = caps[s];
      stage.kernel.shared_memory_carveout_percent = carveout;
      plain.push_back(LoadedGemv::load(stage.kernel, compile_cuda_program(stage.kernel.source, stage.kernel.kernel_name, options)));
      stage.kernel = plain.back().kernel;
      auto occupancy = [&](const GemvKernelSource& kernel) {
        return plain.back().compiled.max_active_blocks_per_multiprocessor(static_cast<int>(kernel.block_threads),
                                                                          kernel.dynamic_shared_bytes);
      };
      if (caps[s] > 0) {
        if (occupancy(stage.kernel) > caps[s]) throw InputError(fmt::format("{} cannot be capped at {} blocks an SM", stage.label, caps[s]));
        fmt::print("{}: capped by {} bytes of dynamic shared memory\n", stage.label, stage.kernel.dynamic_shared_bytes);
      }
      const int resident = occupancy(stage.kernel);
      if (batches) options.extra.push_back("-DMETILE_TIMELINE_BATCHES");
      const std::string source = gemv_timeline_source(stage.kernel, timeline.address() + stage.offset, resident);
      loaded.push_back(LoadedGemv::load(stage.kernel, compile_cuda_program(source, stage.kernel.kernel_name, options)));
      const int stamped = loaded.back().compiled.max_active_blocks_per_multiprocessor(static_cast<int>(stage.kernel.block_threads),
                                                                                      stage.kernel.dynamic_shared_bytes);
      fmt::print("{}: {} registers, {} blocks an SM; with the stamps {} registers, {} blocks an SM\n", stage.label,
                 plain.back().compiled.registers_per_thread(), resident, loaded.back().compiled.registers_per_thread(), stamped);
    }

    const DecodeMlpWeights weights = DecodeMlpWeights::random(format, hidden, intermediate, 11);
    const int replicas =
        static_cast<int>(std::clamp<std::int64_t>(3 * info.l2_cache_bytes / weights.weight_bytes() + 1, 1, 8));
    std::vector<std::vector<DeviceBuffer>> words(3), scale_bias(3);
    for (int r = 0; r < replicas; ++r) {
      for (int i = 0; i < 3; ++i) {
        if (format.is_affine()) {
          const QuantizedMatrix* matrices[3] = {&*weights.quantized_gate, &*weights.quantized_up, &*weights.quantized_down};
          const RepackedAffineMatrix repacked = repack_for_gemv(*matrices[i]);
          words[static_cast<std::size_t>(i)].push_back(DeviceBuffer::from_vector<std::uint32_t>(repacked.words));
          scale_bias[static_cast<std::size_t>(i)].push_back(DeviceBuffer::from_vector<std::uint16_t>(repacked.scale_bias));
        } else {
          const HostTensor* matrices[3] = {&weights.gate, &weights.up, &weights.down};
          words[static_cast<std::size_t>(i)].push_back(DeviceBuffer::from_tensor(*matrices[i]));
        }
      }
    }
    DeviceBuffer x(2 * static_cast<std::size_t>(rows * hidden)), hidden_state(2 * static_cast<std::size_t>(rows * intermediate)),
        residual(2 * static_cast<std::size_t>(rows * hidden)), out(2 * static_cast<std::size_t>(rows * hidden));
    for (DeviceBuffer* buffer : {&x, &residual}) buffer->fill_bytes(0x3C, &stream);
    auto arguments = [&](int stage, int r) {
      KernelArguments a;
      for (int matrix : stage == 0 ? std::vector<int>{0, 1} : std::vector<int>{2}) {
        a.add_pointer(words[static_cast<std::size_t>(matrix)][static_cast<std::size_t>(r)]);
        if (format.is_affine()) a.add_pointer(scale_bias[static_cast<std::size_t>(matrix)][static_cast<std::size_t>(r)]);
      }
      a.add_pointer(stage == 0 ? x : hidden_state);
      if (stage == 1) a.add_pointer(residual);
      a.add_pointer(stage == 0 ? hidden_state : out);
      return a;
    };
    // Three rounds over the replicas in one graph (every launch a programmatic dependent of the one
    // before); the records left are the last replica's of the last round.
    auto mlp_graph = [&](const std::vector<LoadedGemv>& kernels) {
      return CudaGraph::capture(stream, [&](const CudaStream& s) {
        for (int round = 0; round < 3; ++round) {
          for (int r = 0; r < replicas; ++r) {
            for (int stage = 0; stage < 2; ++stage) {
              kernels[static_cast<std::size_t>(stage)].launch(s, arguments(stage, r), stage == 0 || !serial_down);
            }
          }
        }
      });
    };
    auto replay_us = [&](const CudaGraph& graph) {  // the mean MLP of the best of five replays
      double best = 1e30;
      for (int sample = 0; sample < 5; ++sample) {
        CudaEvent start, end;
        start.record(stream);
        graph.replay(stream);
        end.record(stream);
        end.synchronize();
        best = std::min(best, CudaEvent::elapsed_ms(start, end) * 1e3 / (3.0 * replicas));
      }
      return best;
    };
    const CudaGraph plain_graph = mlp_graph(plain), graph = mlp_graph(loaded);
    plain_graph.replay(stream);
    const double plain_us = replay_us(plain_graph);
    graph.replay(stream);
    const double mlp_us = replay_us(graph);
    const std::vector<std::uint64_t> records = timeline.to_vector<std::uint64_t>();

    fmt::print("device: {}\n", benchmarks::describe_device(info));
    fmt::print("{} MLP, {}, M = {}, {} replicas; gate/up '{}' ({} blocks of {} warps), down '{}' ({} blocks of {} warps)\n",
               model, format.to_string(), rows, replicas, gate_up_name, stages[0].kernel.grid_blocks,
               stages[0].config.warps_per_block, down_name, stages[1].kernel.grid_blocks, stages[1].config.warps_per_block);
    // The origin: the first gate/up block's start.
    auto record = [&](const Stage& stage, std::size_t warp, int slot) {
      return records[stage.offset / 8 + warp * kSlots + static_cast<std::size_t>(slot)];
    };
    std::uint64_t origin = ~std::uint64_t{0}, smallest_step = ~std::uint64_t{0};
    std::size_t disordered_warps = 0;
    for (std::size_t w = 0; w < stages[0].warps(); ++w) origin = std::min(origin, record(stages[0], w, 0));
    fmt::print("us from the first gate/up block's start; over warps\n");
    fmt::print("  {:<26} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8}\n", "event", "warps", "min", "p10", "p50", "p90", "max");
    for (const Stage& stage : stages) {
      fmt::print("{}\n", stage.label);
      auto slot_distribution = [&](int slot) {
        std::vector<double> values;
        for (std::size_t w = 0; w < stage.warps(); ++w) {
          const std::uint64_t t = record(stage, w, slot);
          if (t != 0) values.push_back(static_cast<double>(static_cast<std::int64_t>(t - origin)) * 1e-3);
        }
        return distribution(values);
      };
      print_row("block started", slot_distribution(0));
      print_row("wait returned", slot_distribution(1));
      for (int b = 0; b < 8; ++b) {
        print_row(fmt::format("batch {} issued", b), slot_distribution(4 + 3 * b));
        print_row(fmt::format("batch {} landed", b), slot_distribution(5 + 3 * b));
        print_row(fmt::format("batch {} done", b), slot_distribution(6 + 3 * b));
      }
      print_row("accumulated", slot_distribution(2));
      print_row("block stored", slot_distribution(3));
      // The stamps' own check: within a warp, a batch is issued, then lands, then is done; the block
      // starts before the warp's accumulation ends, which is before the block's store.
      for (std::size_t w = 0; w < stage.warps(); ++w) {
        auto in_order = [&](std::initializer_list<int> slots) {
          std::uint64_t last = 0;
          for (int slot : slots) {
            const std::uint64_t t = record(stage, w, slot);
            if (t == 0) continue;
            if (t < last) return false;
            last = t;
          }
          return true;
        };
        bool ordered = in_order({0, 2, 3});
        for (int b = 0; b < 8; ++b) ordered = ordered && in_order({0, 4 + 3 * b, 5 + 3 * b, 6 + 3 * b, 2});
        if (!ordered) ++disordered_warps;
      }
      // Blocks an SM and when each SM's last block stored: the tail by SM load.
      std::map<std::uint64_t, std::pair<int, std::uint64_t>> per_sm;  // sm -> (blocks, last store)
      const std::size_t warps_per_block = static_cast<std::size_t>(stage.config.warps_per_block);
      for (std::size_t block = 0; block < stage.kernel.grid_blocks; ++block) {
        auto& [blocks, last] = per_sm[record(stage, block * warps_per_block, 31)];
        ++blocks;
        last = std::max(last, record(stage, block * warps_per_block, 3));
      }
      std::map<int, std::vector<double>> last_store_by_load;
      for (const auto& [sm, entry] : per_sm) {
        last_store_by_load[entry.first].push_back(static_cast<double>(static_cast<std::int64_t>(entry.second - origin)) * 1e-3);
      }
      for (const auto& [blocks, values] : last_store_by_load) {
        const Distribution d = distribution(values);
        fmt::print("  SMs with {:>2} blocks: {:>3}, their last store p50 {:.2f} max {:.2f} us\n", blocks, d.count, d.p50, d.max);
      }
      // The timer's step: the smallest nonzero difference between two warps' stamps of one slot.
      std::vector<std::uint64_t> starts;
      for (std::size_t w = 0; w < stage.warps(); ++w) starts.push_back(record(stage, w, 0));
      std::sort(starts.begin(), starts.end());
      for (std::size_t i = 1; i < starts.size(); ++i) {
        if (starts[i] > starts[i - 1]) smallest_step = std::min(smallest_step, starts[i] - starts[i - 1]);
      }
    }
    fmt::print("%globaltimer's smallest step seen: {} ns\n", smallest_step);
    fmt::print("whole MLP (the best replay's mean): {:.1f} us stamped, {:.1f} us plain\n", mlp_us, plain_us);
    if (disordered_warps > 0) {
      fmt::print(stderr, "gemv_timeline_benchmark: {} warps' stamps are out of order\n", disordered_warps);
      return 1;
    }
    return 0;
  } catch (const std::exception& error) {
    fmt::print(stderr, "gemv_timeline_benchmark: {}\n", error.what());
    return 1;
  }
}
