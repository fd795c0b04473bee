// The decode-MLP executor: tunes the gate/up stage and the down stage separately, then joins
// the two selected callables into one warmed CUDA graph.
//
//   stage      candidates                                              writes
//   gate_up    native (cuBLASLt, or dequantize + cuBLASLt), native     hidden_state
//              graph; affine: unfused GEMV (+ graph); fused SwiGLU
//              GEMV, register-resident and scratch-spilled, per shape
//   down       native, native graph; affine: unfused GEMV (+ graph);   out
//              fused GEMV with the residual epilogue, per shape
//
// Per stage: every candidate runs on seeded random inputs and must pass the dispatch module's
// numeric gate against the float64 oracle (decode_mlp_reference_*) before it is timed; the
// gated candidates meet in one order-interleaved tournament; a fused candidate replaces the
// best native one only with the headroom (10%) of the MLP boundary. Native stays a candidate at
// both boundaries. Weights are uploaded once: dense matrices are read in place by every
// candidate, affine ones are also repacked (repack_for_gemv) for the generated kernels.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <random>

#include "metile/cpu_runtime.h"
#include "metile/decode_mlp.h"

namespace metile {
namespace {

// A candidate as something to time (run) and something to capture into the final graph (eager:
// the same work without an inner graph launch).
struct StageCandidate {
  DecodeMlpCandidate report;
  DeviceStep run;
  DeviceStep eager;
  std::string source;  // every kernel source it runs, for the decision key
};

struct GemvLaunch {
  GemvKernelConfig config;
  LoadedGemv loaded;
};

// Device copies of one affine matrix in the repacked layout.
struct RepackedOnDevice {
  DeviceBuffer words;
  DeviceBuffer scale_bias;
};

RepackedOnDevice upload_repacked(const QuantizedMatrix& matrix) {
  const RepackedAffineMatrix repacked = repack_for_gemv(matrix);
  RepackedOnDevice device;
  device.words = DeviceBuffer::from_vector<std::uint32_t>(repacked.words);
  device.scale_bias = DeviceBuffer::from_vector<std::uint16_t>(repacked.scale_bias);
  return device;
}

std::string shape_name(const GemvKernelConfig& config) {
  if (config.mainloop == GemvMainloop::streamed) {
    return fmt::format("streamed w{} u{} s{} g{}x{}", config.warps_per_block, config.stage_iterations, config.stages,
                       config.multiprocessors, config.blocks_per_multiprocessor);
  }
  return fmt::format("w{} t{} f{} {}", config.warps_per_block, config.tiles_per_block, config.iterations_in_flight,
                     config.double_buffered ? "db" : "batch");
}

HostTensor to_tensor(const std::vector<double>& values, std::int64_t rows, std::int64_t columns, DType dtype) {
  return HostTensor::from_values(TensorSpec({rows, columns}, dtype), values);
}

HostTensor random_activations(std::int64_t rows, std::int64_t columns, DType dtype, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::vector<double> values(static_cast<std::size_t>(rows * columns));
  for (double& value : values) value = 2.0 * (static_cast<double>(generator() >> 11) * 0x1.0p-53) - 1.0;
  return HostTensor::from_values(TensorSpec({rows, columns}, dtype), values);
}

DeviceStep sequence(std::vector<DeviceStep> steps) {
  return [steps = std::move(steps)](const CudaStream& stream) {
    for (const DeviceStep& step : steps) step(stream);
  };
}

// A graph replay as a step; the graph is captured from `eager` on `stream` once, after one eager
// run: libraries initialise lazily on their first call (cuBLASLt loads its kernels), which must
// not happen inside a capture.
DeviceStep as_graph(const DeviceStep& eager, const CudaStream& stream) {
  eager(stream);
  stream.synchronize();
  auto graph = std::make_shared<CudaGraph>(CudaGraph::capture(stream, eager));
  return [graph](const CudaStream& s) { graph->replay(s); };
}

}  // namespace

double DecodeMlpStageReport::chosen_ms() const {
  return chosen >= 0 ? candidates[static_cast<std::size_t>(chosen)].score_ms : -1;
}
double DecodeMlpStageReport::native_ms() const {
  return best_native >= 0 ? candidates[static_cast<std::size_t>(best_native)].score_ms : -1;
}

struct DecodeMlpExecutor::State {
  DecodeMlpWeights weights;  // shapes and format only (matrices are dropped after upload)
  std::int64_t rows = 0;
  DecodeMlpOptions options;
  CudaDevice device;
  std::shared_ptr<const ComputeGraph> graph;
  std::unique_ptr<DeviceValues> values;
  NativeRuntime native;
  CudaStream stream;
  std::vector<RepackedOnDevice> repacked;  // gate, up, down (affine only)
  std::vector<std::shared_ptr<GemvLaunch>> launches;
  DecodeMlpStageReport gate_up, down;
  DeviceStep chosen_gate_up, chosen_down, native_gate_up, native_down;
  CudaGraph executor_graph, native_graph;

  explicit State(const CudaDevice& device_) : device(device_) {}

  ValueId value(std::string_view name) const {
    auto id = graph->find_value(name);
    if (!id) throw CudaError(fmt::format("decode MLP: the graph has no value '{}'", name));
    return *id;
  }
  NodeId node(std::string_view name) const { return *graph->find_node(name); }

  // Kernel arguments for a GEMV over `matrices` (0 gate, 1 up, 2 down), reading `input`,
  // the epilogue's tensors by value name, writing `output`.
  DeviceStep bind_gemv(const std::shared_ptr<GemvLaunch>& launch, std::vector<int> matrices, std::string_view input,
                       std::string_view output) {
    static const char* const dense_names[] = {"gate_weight", "up_weight", "down_weight"};
    KernelArguments arguments;
    for (int matrix : matrices) {
      if (weights.format.is_affine()) {
        arguments.add_pointer(repacked[static_cast<std::size_t>(matrix)].words);
        arguments.add_pointer(repacked[static_cast<std::size_t>(matrix)].scale_bias);
      } else {
        arguments.add_pointer((*values)[value(dense_names[matrix])].address());
      }
    }
    arguments.add_pointer((*values)[value(input)].address());
    for (const GemvEpilogue::TensorInput& tensor : launch->config.epilogue.tensor_inputs()) {
      arguments.add_pointer((*values)[value(tensor.name)].address());
    }
    arguments.add_pointer((*values)[value(output)].address());
    return [gemv = launch, arguments](const CudaStream& stream) { gemv->loaded.launch(stream, arguments); };
  }

  // Compiles every config in parallel (NVRTC needs no device), then loads them here.
  std::vector<std::shared_ptr<GemvLaunch>> compile(const std::vector<GemvKernelConfig>& configs) {
    std::vector<std::shared_ptr<GemvLaunch>> result;
    std::vector<std::future<CompiledProgram>> programs;
    for (const GemvKernelConfig& config : configs) {
      auto launch = std::make_shared<GemvLaunch>();
      launch->config = config;
      launch->loaded.kernel = generate_gemv_kernel(config);
      result.push_back(launch);
      programs.push_back(std::async(std::launch::async, [kernel = launch->loaded.kernel, architecture = device.info().architecture()] {
        CompileOptions options;
        options.architecture = architecture;
        return compile_cuda_program(kernel.source, kernel.kernel_name, options);
      }));
    }
    for (std::size_t i = 0; i < result.size(); ++i) {
      result[i]->loaded = LoadedGemv::load(result[i]->loaded.kernel, programs[i].get());
      launches.push_back(result[i]);
    }
    return result;
  }

  GemvKernelConfig base_config(std::int64_t out_features, std::int64_t in_features, GemvEpilogue epilogue) const {
    GemvKernelConfig config;
    config.format = weights.format;
    config.rows = rows;
    config.out_features = out_features;
    config.in_features = in_features;
    config.epilogue = std::move(epilogue);
    return config;
  }

  std::vector<GemvKernelConfig> tuned(const GemvKernelConfig& base) const {
    std::vector<GemvKernelConfig> configs = gemv_tuning_candidates(base, device.info().multiprocessor_count);
    if (configs.size() > static_cast<std::size_t>(std::max(1, options.tuning_candidates))) {
      configs.resize(static_cast<std::size_t>(std::max(1, options.tuning_candidates)));
    }
    return configs;
  }

  // The streamed mainloop's shapes for the same stage (gemv_streamed.cpp), after the register ones.
  std::vector<GemvKernelConfig> streamed(GemvKernelConfig base) const {
    base.mainloop = GemvMainloop::streamed;
    return tuned(base);
  }

  void add_native(std::vector<StageCandidate>& candidates, const std::vector<std::string>& nodes) {
    std::vector<DeviceStep> steps;
    std::string source;
    for (const std::string& name : nodes) {
      steps.push_back(native.node_step(*graph, node(name), *values));
      source += NativeRuntime::node_source(*graph, node(name));
    }
    const DeviceStep eager = sequence(std::move(steps));
    const std::string what = weights.format.is_affine() ? "dequantize + cuBLASLt" : "cuBLASLt";
    candidates.push_back({{"native", "native", what, {}, -1}, eager, eager, source});
    candidates.push_back({{"native graph", "native", what + ", one CUDA graph", {}, -1}, as_graph(eager, stream), eager, source});
  }

  std::vector<StageCandidate> gate_up_candidates() {
    std::vector<StageCandidate> candidates;
    add_native(candidates, {"gate", "up", "activated", "hidden_state"});
    std::vector<GemvKernelConfig> configs;
    // Unfused GEMV (affine): one plain-store GEMV per matrix, then the native elementwise ops.
    const bool unfused = weights.format.is_affine();
    if (unfused) configs.push_back(tuned(base_config(weights.intermediate, weights.hidden, GemvEpilogue::store())).front());
    for (GatedSchedule schedule : {GatedSchedule::register_resident, GatedSchedule::scratch_spilled}) {
      GemvKernelConfig base = base_config(weights.intermediate, weights.hidden, GemvEpilogue::swiglu());
      base.schedule = schedule;
      for (const GemvKernelConfig& config : tuned(base)) configs.push_back(config);
    }
    for (const GemvKernelConfig& config : streamed(base_config(weights.intermediate, weights.hidden, GemvEpilogue::swiglu()))) {
      configs.push_back(config);
    }
    const std::vector<std::shared_ptr<GemvLaunch>> compiled = compile(configs);
    std::size_t next = 0;
    if (unfused) {
      const auto& store = compiled[next++];
      const DeviceStep eager = sequence({bind_gemv(store, {0}, "x", "gate"), bind_gemv(store, {1}, "x", "up"),
                                         native.node_step(*graph, node("activated"), *values),
                                         native.node_step(*graph, node("hidden_state"), *values)});
      const std::string source = store->loaded.kernel.source + NativeRuntime::node_source(*graph, node("activated")) +
                                 NativeRuntime::node_source(*graph, node("hidden_state"));
      const std::string kernel = store->config.to_string() + " x2, silu, multiply";
      candidates.push_back({{"unfused gemv", "native", kernel, {}, -1}, eager, eager, source});
      candidates.push_back({{"unfused gemv graph", "native", kernel + ", one CUDA graph", {}, -1}, as_graph(eager, stream),
                            eager, source});
    }
    for (; next < compiled.size(); ++next) {
      const auto& launch = compiled[next];
      const DeviceStep step = bind_gemv(launch, {0, 1}, "x", "hidden_state");
      const std::string name =
          launch->config.mainloop == GemvMainloop::streamed
              ? fmt::format("fused {}", shape_name(launch->config))
              : fmt::format("fused {} {}", gated_schedule_name(launch->config.schedule), shape_name(launch->config));
      candidates.push_back({{name, "fused", launch->config.to_string(), {}, -1}, step, step, launch->loaded.kernel.source});
    }
    return candidates;
  }

  std::vector<StageCandidate> down_candidates() {
    std::vector<StageCandidate> candidates;
    add_native(candidates, {"down", "out"});
    std::vector<GemvKernelConfig> configs;
    const bool unfused = weights.format.is_affine();
    if (unfused) configs.push_back(tuned(base_config(weights.hidden, weights.intermediate, GemvEpilogue::store())).front());
    for (const GemvKernelConfig& config :
         tuned(base_config(weights.hidden, weights.intermediate, GemvEpilogue::residual_add("residual")))) {
      configs.push_back(config);
    }
    for (const GemvKernelConfig& config :
         streamed(base_config(weights.hidden, weights.intermediate, GemvEpilogue::residual_add("residual")))) {
      configs.push_back(config);
    }
    const std::vector<std::shared_ptr<GemvLaunch>> compiled = compile(configs);
    std::size_t next = 0;
    if (unfused) {
      const auto& store = compiled[next++];
      const DeviceStep eager = sequence({bind_gemv(store, {2}, "hidden_state", "down"),
                                         native.node_step(*graph, node("out"), *values)});
      const std::string kernel = store->config.to_string() + ", add";
      const std::string source = store->loaded.kernel.source + NativeRuntime::node_source(*graph, node("out"));
      candidates.push_back({{"unfused gemv", "native", kernel, {}, -1}, eager, eager, source});
      candidates.push_back({{"unfused gemv graph", "native", kernel + ", one CUDA graph", {}, -1}, as_graph(eager, stream),
                            eager, source});
    }
    for (; next < compiled.size(); ++next) {
      const auto& launch = compiled[next];
      const DeviceStep step = bind_gemv(launch, {2}, "hidden_state", "out");
      candidates.push_back({{fmt::format("fused residual {}", shape_name(launch->config)), "fused",
                             launch->config.to_string(), {}, -1},
                            step, step, launch->loaded.kernel.source});
    }
    return candidates;
  }

  // Gate, then tournament, then the headroom rule. `prepare` re-creates the stage's inputs on the
  // device before each gated run; `output` is the value the stage writes.
  DecodeMlpStageReport tune(const std::string& stage, std::vector<StageCandidate>& candidates,
                            const std::vector<std::string>& stage_nodes, const std::function<void()>& prepare,
                            std::string_view output, const HostTensor& reference, DeviceStep& chosen_step,
                            DeviceStep& native_step) {
    DecodeMlpStageReport report;
    report.stage = stage;
    const ValueId output_id = value(output);
    for (StageCandidate& candidate : candidates) {
      values->poison_computed_values();
      prepare();
      candidate.run(stream);
      stream.synchronize();
      candidate.report.gate = numeric_gate((*values)[output_id].to_host(), reference);
    }

    // The decision key: device, versions, every candidate's source, the stage's ops and shapes.
    FusionRegion region;
    region.rule = "decode_mlp_" + stage;
    for (const std::string& name : stage_nodes) region.nodes.push_back(node(name));
    std::vector<std::string> sources;
    for (const StageCandidate& candidate : candidates) sources.push_back(candidate.report.name + "\n" + candidate.source);
    std::string key;
    std::optional<DispatchDecision> cached;
    std::optional<DecisionCache> cache;
    if (options.use_decision_cache) {
      // region_graph needs the region's boundary values: derive them from the nodes.
      for (NodeId id : region.nodes) {
        for (ValueId input : graph->node(id).inputs) {
          const bool inside = std::any_of(region.nodes.begin(), region.nodes.end(), [&](NodeId other) {
            return graph->value(input).producer == other;
          });
          if (!inside && std::find(region.inputs.begin(), region.inputs.end(), input) == region.inputs.end()) {
            region.inputs.push_back(input);
          }
        }
      }
      region.outputs.push_back(output_id);
      key = dispatch_key(device.info(), region_graph(*graph, region), sources) + fmt::format(" mode={}", dispatch_mode_name(options.mode));
      cache.emplace(options.decision_cache_file.empty() ? DecisionCache::default_path() : options.decision_cache_file);
      cached = cache->find(key);
    }

    // The library path (cuBLASLt, dequantize + cuBLASLt) is the graph's own semantics, intermediate
    // roundings included: it stays a candidate whatever its figures against the float64 oracle
    // (at 16 rows its bf16-rounded gate and up can cost it the 1e-2 max-error gate). Every
    // generated kernel must pass.
    auto library_path = [&](std::size_t i) { return candidates[i].report.name.rfind("native", 0) == 0; };
    std::vector<int> timed;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      const bool allowed = options.mode != DispatchMode::native || candidates[i].report.kind == "native";
      if ((candidates[i].report.gate.passed || library_path(i)) && allowed) timed.push_back(static_cast<int>(i));
    }
    if (timed.empty()) {
      throw CudaError(fmt::format("decode MLP {}: no candidate passed the numeric gate (native: {})", stage,
                                  candidates.front().report.gate.detail));
    }

    auto index_of = [&](const std::string& name) {
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        if (candidates[i].report.name == name) return static_cast<int>(i);
      }
      return -1;
    };
    if (cached) {
      const int index = index_of(cached->chosen);
      if (index >= 0 && (candidates[static_cast<std::size_t>(index)].report.gate.passed ||
                         library_path(static_cast<std::size_t>(index)))) {
        report.from_cache = true;
        report.chosen = index;
        for (const auto& [name, ms] : cached->timings_ms) {
          const int timed_index = index_of(name);
          if (timed_index >= 0) candidates[static_cast<std::size_t>(timed_index)].report.score_ms = ms;
        }
      }
    }
    if (!report.from_cache) {
      std::vector<TournamentCandidate> entrants;
      for (int index : timed) entrants.push_back({candidates[static_cast<std::size_t>(index)].report.name,
                                                  candidates[static_cast<std::size_t>(index)].run});
      const TournamentResult result = run_tournament(entrants, stream, options.tournament);
      for (std::size_t i = 0; i < timed.size(); ++i) {
        candidates[static_cast<std::size_t>(timed[i])].report.score_ms = result.score_ms[i];
      }
    }

    int best_native = -1, best_fused = -1;
    for (int index : timed) {
      const DecodeMlpCandidate& candidate = candidates[static_cast<std::size_t>(index)].report;
      if (candidate.score_ms < 0) continue;
      int& best = candidate.kind == "native" ? best_native : best_fused;
      if (best < 0 || candidate.score_ms < candidates[static_cast<std::size_t>(best)].report.score_ms) best = index;
    }
    report.best_native = best_native;
    auto ms = [&](int index) { return candidates[static_cast<std::size_t>(index)].report.score_ms; };
    auto name = [&](int index) { return candidates[static_cast<std::size_t>(index)].report.name; };
    if (!report.from_cache) {
      if (best_native < 0) {
        report.chosen = best_fused;
      } else if (best_fused < 0 || options.mode == DispatchMode::native) {
        report.chosen = best_native;
      } else if (options.mode == DispatchMode::fused || beats_with_headroom(ms(best_fused), ms(best_native), options.headroom)) {
        report.chosen = best_fused;
      } else {
        report.chosen = best_native;
      }
    }
    if (report.chosen < 0) report.chosen = timed.front();

    // The sentence: what runs, against what, and why.
    const int chosen = report.chosen;
    if (candidates[static_cast<std::size_t>(chosen)].report.kind == "fused" && best_native >= 0) {
      report.sentence = fmt::format("{}: {}, {:.2f}x over {} ({:.1f} us vs {:.1f} us)", stage, name(chosen),
                                    ms(best_native) / ms(chosen), name(best_native), ms(chosen) * 1e3,
                                    ms(best_native) * 1e3);
    } else if (best_fused >= 0) {
      report.sentence = fmt::format("{}: {} ({:.1f} us); best fused {} {:.1f} us{}", stage, name(chosen), ms(chosen) * 1e3,
                                    name(best_fused), ms(best_fused) * 1e3,
                                    options.mode == DispatchMode::native ? ", METILE_DISPATCH=native"
                                                                         : fmt::format(", under the {:.0f}% headroom",
                                                                                       options.headroom * 100));
    } else {
      std::string failures;
      for (const StageCandidate& candidate : candidates) {
        if (candidate.report.kind == "fused" && !candidate.report.gate.passed) {
          failures = fmt::format("; fused failed the numeric gate ({})", candidate.report.gate.detail);
          break;
        }
      }
      report.sentence = fmt::format("{}: {} ({:.1f} us){}", stage, name(chosen), ms(chosen) * 1e3, failures);
    }
    if (report.from_cache) report.sentence += " [decision cache]";

    if (cache && !report.from_cache) {
      DispatchDecision decision;
      decision.key = key;
      decision.chosen = name(chosen);
      for (int index : timed) decision.timings_ms.emplace_back(name(index), ms(index));
      decision.report = report.sentence;
      cache->store(decision);
    }

    for (const StageCandidate& candidate : candidates) report.candidates.push_back(candidate.report);
    chosen_step = candidates[static_cast<std::size_t>(chosen)].eager;
    native_step = candidates[static_cast<std::size_t>(best_native >= 0 ? best_native : chosen)].eager;
    return report;
  }
};

DecodeMlpExecutor::DecodeMlpExecutor(std::unique_ptr<State> state) : state_(std::move(state)) {}
DecodeMlpExecutor::~DecodeMlpExecutor() = default;
DecodeMlpExecutor::DecodeMlpExecutor(DecodeMlpExecutor&&) noexcept = default;
DecodeMlpExecutor& DecodeMlpExecutor::operator=(DecodeMlpExecutor&&) noexcept = default;

DecodeMlpExecutor DecodeMlpExecutor::build(const DecodeMlpWeights& weights, std::int64_t rows, const CudaDevice& device,
                                           const DecodeMlpOptions& options) {
  weights.validate();
  if (rows < 1 || rows > 16) throw InputError(fmt::format("decode MLP: rows must be 1..16 (decode), not {}", rows));
  device.make_current();
  auto state = std::make_unique<State>(device);
  State& s = *state;
  s.rows = rows;
  s.options = options;
  s.weights.format = weights.format;
  s.weights.hidden = weights.hidden;
  s.weights.intermediate = weights.intermediate;
  s.graph = std::make_shared<const ComputeGraph>(weights.graph(rows));
  s.values = std::make_unique<DeviceValues>(*s.graph);

  // Weights: the graph's inputs (read by the native path, and in place by dense GEMVs) and,
  // for affine matrices, the repacked copies the generated kernels read.
  for (const auto& [name, tensor] : weights.weight_inputs()) (*s.values)[s.value(name)].buffer.upload(tensor);
  if (weights.format.is_affine()) {
    s.repacked.push_back(upload_repacked(*weights.quantized_gate));
    s.repacked.push_back(upload_repacked(*weights.quantized_up));
    s.repacked.push_back(upload_repacked(*weights.quantized_down));
  }

  // Gate inputs: fresh seeded activations; the down stage gets its own random hidden state.
  const DType dtype = weights.format.activation;
  const HostTensor x = random_activations(rows, weights.hidden, dtype, options.gate_seed);
  const HostTensor residual = random_activations(rows, weights.hidden, dtype, options.gate_seed + 1);
  const HostTensor hidden = random_activations(rows, weights.intermediate, dtype, options.gate_seed + 2);
  const HostTensor hidden_reference =
      to_tensor(decode_mlp_reference_hidden(weights, x), rows, weights.intermediate, dtype);
  const HostTensor out_reference =
      to_tensor(decode_mlp_reference_out(weights, hidden, residual), rows, weights.hidden, dtype);
  const ValueId x_id = s.value("x"), residual_id = s.value("residual"), hidden_id = s.value("hidden_state");

  std::vector<StageCandidate> gate_up = s.gate_up_candidates();
  s.gate_up = s.tune(
      "gate_up", gate_up, {"gate", "up", "activated", "hidden_state"},
      [&] {
        (*s.values)[x_id].buffer.upload(x);
        (*s.values)[residual_id].buffer.upload(residual);
      },
      "hidden_state", hidden_reference, s.chosen_gate_up, s.native_gate_up);
  std::vector<StageCandidate> down = s.down_candidates();
  s.down = s.tune(
      "down", down, {"down", "out"},
      [&] {
        (*s.values)[hidden_id].buffer.upload(hidden);
        (*s.values)[residual_id].buffer.upload(residual);
      },
      "out", out_reference, s.chosen_down, s.native_down);

  // The executor: both selected callables in one graph, warmed by one replay.
  s.executor_graph = CudaGraph::capture(s.stream, sequence({s.chosen_gate_up, s.chosen_down}));
  s.native_graph = CudaGraph::capture(s.stream, sequence({s.native_gate_up, s.native_down}));
  s.executor_graph.replay(s.stream);
  s.native_graph.replay(s.stream);
  s.stream.synchronize();
  return DecodeMlpExecutor(std::move(state));
}

std::int64_t DecodeMlpExecutor::rows() const { return state_->rows; }
DeviceTensor& DecodeMlpExecutor::x() { return (*state_->values)[state_->value("x")]; }
DeviceTensor& DecodeMlpExecutor::residual() { return (*state_->values)[state_->value("residual")]; }
const DeviceTensor& DecodeMlpExecutor::out() const { return (*state_->values)[state_->value("out")]; }
const CudaStream& DecodeMlpExecutor::stream() const { return state_->stream; }
void DecodeMlpExecutor::enqueue(const CudaStream& stream) const { state_->executor_graph.replay(stream); }
void DecodeMlpExecutor::enqueue_native(const CudaStream& stream) const { state_->native_graph.replay(stream); }
const DecodeMlpStageReport& DecodeMlpExecutor::gate_up_report() const { return state_->gate_up; }
const DecodeMlpStageReport& DecodeMlpExecutor::down_report() const { return state_->down; }

HostTensor DecodeMlpExecutor::run(const HostTensor& x_values, const HostTensor& residual_values) {
  x().buffer.upload(x_values);
  residual().buffer.upload(residual_values);
  enqueue(state_->stream);
  state_->stream.synchronize();
  return out().to_host();
}

std::string DecodeMlpExecutor::report() const {
  std::string text;
  for (const DecodeMlpStageReport* stage : {&state_->gate_up, &state_->down}) {
    text += stage->sentence + "\n";
    for (const DecodeMlpCandidate& candidate : stage->candidates) {
      text += fmt::format("  {:<40} gate {} (L2 {:.2e}, max {:.2e}){}\n", candidate.name,
                          candidate.gate.passed ? "pass" : "FAIL", candidate.gate.relative_l2,
                          candidate.gate.relative_max,
                          candidate.score_ms >= 0 ? fmt::format("  {:.2f} us", candidate.score_ms * 1e3) : std::string());
    }
  }
  return text;
}

}  // namespace metile
