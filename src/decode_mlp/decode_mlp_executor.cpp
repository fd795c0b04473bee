// The decode-MLP executor: tunes the gate/up stage and the down stage separately, then joins
// the two selected callables into one warmed CUDA graph.
//
//   stage      candidates                                              writes
//   gate_up    native (cuBLASLt, or dequantize + cuBLASLt), native     hidden_state
//              graph; affine: unfused GEMV (+ graph); fused SwiGLU
//              GEMV, register-resident and scratch-spilled, per shape
//   down       native, native graph; affine: unfused GEMV (+ graph);   out
//              fused GEMV with the residual epilogue, per shape
//   whole      native graph, the chosen stages' graph, the gate/up       out (and hidden_state)
//              race's near tie with the chosen down, the persistent
//              decode-MLP kernels (both stages in one launch, gemv.h)
//
// Per stage: every candidate runs on seeded random inputs and is gated against the float64
// oracle (decode_mlp_reference_*); the dispatch module's engine (choose_measured) then admits,
// races and chooses with the headroom (10%) of the MLP boundary, exactly as it does for the
// whole-graph Executable. The library path stays a candidate at both boundaries. Weights are uploaded once: dense matrices are read in place by every
// candidate, affine ones are also repacked (repack_for_gemv) for the generated kernels.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "metile/cpu_runtime.h"
#include "metile/decode_mlp_executor.h"

namespace metile {
namespace {

// The whole MLP's candidates that are the stages' kernels (the chosen pair, and the gate/up near tie
// with the chosen down) rather than one persistent kernel.
constexpr const char* kNearTieVariant = "stages near tie";
bool is_stages_variant(const CandidateId& id) { return id.variant == "stages" || id.variant == kNearTieVariant; }

// A candidate as something to time (run) and something to capture into the final graph (eager:
// the same work without an inner graph launch).
struct StageCandidate {
  DecodeMlpCandidate report;
  bool library_path = false;  // cuBLASLt / dequantize + cuBLASLt: the graph's own semantics
  DeviceStep run;
  DeviceStep eager;
  std::string source;  // every kernel source it runs, for the decision key
  // A generated GEMV's eager step launched as a programmatic dependent of the previous kernel
  // (empty for every other candidate).
  DeviceStep dependent = {};
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

// A graph replay as a step; the graph is captured from `eager` once (with `stream`'s launch settings), after one
// eager run on `stream`: libraries initialise lazily on their first call (cuBLASLt loads its kernels), which must
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
  // The MLP's swiglu_mlp region as the GEMV lowering plans it (plan_gemv_swiglu): the gate/up
  // and down launches with their operands taken from the region's roles.
  GemvStage gate_up_stage, down_stage;
  std::vector<std::shared_ptr<GemvLaunch>> launches;
  DecodeMlpStageReport gate_up, down, whole;
  std::vector<std::string> persistent_refusals;  // persistent kernels not raced, and why
  bool persistent = false;                       // the executor's graph is one persistent kernel
  DeviceStep chosen_gate_up, chosen_down, native_gate_up, native_down, chosen_down_dependent;
  CudaGraph executor_graph, native_graph, serialized_graph;
  CudaGraph stages_graph;      // the chosen stages (what executor_graph is unless a persistent kernel won)
  CudaGraph persistent_graph;  // the fastest persistent kernel that passed the gate (empty: none)
  bool programmatic_dependent = false;
  std::string programmatic_dependent_reason;
  // The gate/up near tie (DecodeMlpOptions::near_tie_margin) with the chosen down, in the chosen
  // pair's launch order; raced on the whole MLP. near_tie_gate_up < 0: none.
  int near_tie_gate_up = -1;
  DeviceStep near_tie_eager;
  CudaGraph near_tie_graph;
  // Where tune() stored a stage's decision: what a later choice (the near tie that won the whole race)
  // needs to store it again, so that a cached build replays the pair this one kept.
  struct StoredDecision {
    std::string key;
    std::vector<MeasuredCandidate> measured;
    MeasuredChoice choice;
    std::optional<DecisionCache> cache;
  };
  std::optional<StoredDecision> stored_gate_up;

  explicit State(const CudaDevice& device_) : device(device_) {}

  ValueId value(std::string_view name) const {
    auto id = graph->find_value(name);
    if (!id) throw CudaError(fmt::format("decode MLP: the graph has no value '{}'", name));
    return *id;
  }
  NodeId node(std::string_view name) const { return *graph->find_node(name); }

  // Kernel arguments for one GEMV of `stage` (gemv.h's order): its matrices (`repacked_index`:
  // their repacked copies, 0 gate, 1 up, 2 down, when affine), x, the epilogue's tensors, out.
  // `output` overrides the stage's (the unfused path writes the bare products);
  // `programmatic_dependent` launches it as a programmatic dependent of the previous kernel.
  DeviceStep bind_gemv(const std::shared_ptr<GemvLaunch>& launch, const GemvStage& stage, std::vector<int> matrices,
                       std::optional<ValueId> output = std::nullopt, bool programmatic_dependent = false) {
    KernelArguments arguments;
    add_stage_arguments(arguments, stage, matrices, output);
    return [gemv = launch, arguments, programmatic_dependent](const CudaStream& stream) {
      gemv->loaded.launch(stream, arguments, programmatic_dependent);
    };
  }

  void add_stage_arguments(KernelArguments& arguments, const GemvStage& stage, const std::vector<int>& matrices,
                           std::optional<ValueId> output = std::nullopt) {
    for (int matrix : matrices) {
      if (weights.format.is_affine()) {
        arguments.add_pointer(repacked[static_cast<std::size_t>(matrix)].words);
        arguments.add_pointer(repacked[static_cast<std::size_t>(matrix)].scale_bias);
      } else {
        const std::size_t in_stage = stage.matrices.size() == 1 ? 0 : static_cast<std::size_t>(matrix);
        arguments.add_pointer((*values)[stage.matrices[in_stage].weight].address());
      }
    }
    arguments.add_pointer((*values)[stage.input].address());
    if (!output) {
      for (ValueId tensor : stage.epilogue_tensors) arguments.add_pointer((*values)[tensor].address());
    }
    arguments.add_pointer((*values)[output.value_or(stage.output)].address());
  }

  // Compiles every config in parallel (load_gemvs), then keeps them loaded.
  std::vector<std::shared_ptr<GemvLaunch>> compile(const std::vector<GemvKernelConfig>& configs) {
    std::vector<GemvKernelSource> kernels;
    for (const GemvKernelConfig& config : configs) kernels.push_back(generate_gemv_kernel(config));
    std::vector<LoadedGemv> loaded = load_gemvs(std::move(kernels));
    std::vector<std::shared_ptr<GemvLaunch>> result;
    for (std::size_t i = 0; i < configs.size(); ++i) {
      result.push_back(std::make_shared<GemvLaunch>(GemvLaunch{configs[i], std::move(loaded[i])}));
      launches.push_back(result.back());
    }
    return result;
  }

  // The stage's launch shapes (gemv_stage_configs, as the lowerings race them).
  std::vector<GemvKernelConfig> tuned(const GemvStage& stage) const {
    return gemv_stage_configs(stage.base_config(), options.tuning_candidates, device.info().multiprocessor_count);
  }
  // The plain-store GEMV of the unfused path: the stage's first register shape without its epilogue.
  std::vector<GemvKernelConfig> plain_store(const GemvStage& stage) const {
    GemvKernelConfig base = stage.base_config();
    base.epilogue = GemvEpilogue::store();
    return {gemv_tuning_candidates(base, device.info().multiprocessor_count).front()};
  }

  static DecodeMlpCandidate described(const CandidateId& id, std::string kernel) {
    return {id, id.name(), std::move(kernel), {}, -1};
  }

  // The unfused GEMV path (generated, so it must pass the gate), eagerly and as a CUDA graph.
  void add_unfused(std::vector<StageCandidate>& candidates, const DeviceStep& eager, const std::string& kernel,
                   const std::string& source) {
    const CandidateId id = CandidateId::native("unfused gemv");
    candidates.push_back({described(id, kernel), false, eager, eager, source});
    candidates.push_back({described(id.as_graph(), kernel + ", one CUDA graph"), false, as_graph(eager, stream), eager, source});
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
    candidates.push_back({described(CandidateId::native(), what), true, eager, eager, source});
    candidates.push_back(
        {described(CandidateId::native().as_graph(), what + ", one CUDA graph"), true, as_graph(eager, stream), eager, source});
  }

  std::vector<StageCandidate> gate_up_candidates() {
    std::vector<StageCandidate> candidates;
    add_native(candidates, {"gate", "up", "activated", "hidden_state"});
    // Unfused GEMV (affine): one plain-store GEMV per matrix, then the native elementwise ops.
    const bool unfused = weights.format.is_affine();
    std::vector<GemvKernelConfig> configs;
    if (unfused) configs = plain_store(gate_up_stage);
    for (const GemvKernelConfig& config : tuned(gate_up_stage)) configs.push_back(config);
    const std::vector<std::shared_ptr<GemvLaunch>> compiled = compile(configs);
    std::size_t next = 0;
    if (unfused) {
      const auto& store = compiled[next++];
      const DeviceStep eager = sequence({bind_gemv(store, gate_up_stage, {0}, value("gate")),
                                         bind_gemv(store, gate_up_stage, {1}, value("up")),
                                         native.node_step(*graph, node("activated"), *values),
                                         native.node_step(*graph, node("hidden_state"), *values)});
      const std::string source = store->loaded.kernel.source + NativeRuntime::node_source(*graph, node("activated")) +
                                 NativeRuntime::node_source(*graph, node("hidden_state"));
      const std::string kernel = store->config.to_string() + " x2, silu, multiply";
      add_unfused(candidates, eager, kernel, source);
    }
    for (; next < compiled.size(); ++next) {
      const auto& launch = compiled[next];
      const DeviceStep step = bind_gemv(launch, gate_up_stage, {0, 1});
      const CandidateId id = CandidateId::fused(gemv_shape_name(launch->config));
      candidates.push_back({described(id, launch->config.to_string()), false, step, step, launch->loaded.kernel.source});
    }
    return candidates;
  }

  std::vector<StageCandidate> down_candidates() {
    std::vector<StageCandidate> candidates;
    add_native(candidates, {"down", "out"});
    const bool unfused = weights.format.is_affine();
    std::vector<GemvKernelConfig> configs;
    if (unfused) configs = plain_store(down_stage);
    for (const GemvKernelConfig& config : tuned(down_stage)) configs.push_back(config);
    const std::vector<std::shared_ptr<GemvLaunch>> compiled = compile(configs);
    std::size_t next = 0;
    if (unfused) {
      const auto& store = compiled[next++];
      const DeviceStep eager = sequence({bind_gemv(store, down_stage, {2}, value("down")),
                                         native.node_step(*graph, node("out"), *values)});
      const std::string kernel = store->config.to_string() + ", add";
      const std::string source = store->loaded.kernel.source + NativeRuntime::node_source(*graph, node("out"));
      add_unfused(candidates, eager, kernel, source);
    }
    for (; next < compiled.size(); ++next) {
      const auto& launch = compiled[next];
      const DeviceStep step = bind_gemv(launch, down_stage, {2});
      const CandidateId id = CandidateId::fused(fmt::format("residual {}", gemv_shape_name(launch->config)));
      candidates.push_back({described(id, launch->config.to_string()), false, step, step, launch->loaded.kernel.source,
                            bind_gemv(launch, down_stage, {2}, std::nullopt, true)});
    }
    return candidates;
  }

  // The whole MLP, once both stages are chosen: the native graph (the library path), the chosen
  // stages as the executor's graph, and the persistent kernels (one launch for both stages,
  // gemv.h). A persistent kernel the device cannot keep resident is refused at load and named in
  // persistent_refusals.
  std::vector<StageCandidate> whole_candidates() {
    std::vector<StageCandidate> candidates;
    const DeviceStep native_eager = sequence({native_gate_up, native_down});
    const std::string native_source =
        "native: " + gate_up.candidates[static_cast<std::size_t>(std::max(gate_up.best_native, 0))].name + " + " +
        down.candidates[static_cast<std::size_t>(std::max(down.best_native, 0))].name;
    candidates.push_back({described(CandidateId::native().as_graph(), native_source), true, as_graph(native_eager, stream),
                          native_eager, native_source});
    const DecodeMlpCandidate& chosen_gate_up_report = gate_up.candidates[static_cast<std::size_t>(gate_up.chosen)];
    const DecodeMlpCandidate& chosen_down_report = down.candidates[static_cast<std::size_t>(down.chosen)];
    // A gate/up candidate followed by the chosen down, as the executor's graph launches them.
    const auto pair_name = [&](const DecodeMlpCandidate& gate_up_report) {
      return gate_up_report.name + " + " + chosen_down_report.name + (programmatic_dependent ? " (programmatic dependent)" : "");
    };
    if (chosen_gate_up_report.id.kind == CandidateKind::fused || chosen_down_report.id.kind == CandidateKind::fused) {
      const std::string what = pair_name(chosen_gate_up_report);
      const DeviceStep replay = [this](const CudaStream& s) { executor_graph.replay(s); };
      candidates.push_back({described(CandidateId::fused("stages").as_graph(), what), false, replay,
                            sequence({chosen_gate_up, chosen_down}), what});
    }
    if (near_tie_gate_up >= 0) {
      const std::string what = pair_name(gate_up.candidates[static_cast<std::size_t>(near_tie_gate_up)]);
      const DeviceStep replay = [this](const CudaStream& s) { near_tie_graph.replay(s); };
      candidates.push_back({described(CandidateId::fused(kNearTieVariant).as_graph(), what), false, replay,
                            near_tie_eager, what});
    }
    if (!options.persistent) return candidates;
    std::vector<PersistentMlpConfig> configs;
    try {
      configs = persistent_mlp_candidates(gate_up_stage.base_config(), down_stage.base_config(),
                                          device.info().multiprocessor_count);
    } catch (const InputError& error) {
      persistent_refusals.push_back(error.what());
    }
    // A kernel that does not generate, compile or load loses its place in the race; it never ends the build.
    std::vector<GemvKernelSource> kernels;
    std::vector<CompiledProgram> programs;
    try {
      for (const PersistentMlpConfig& config : configs) kernels.push_back(generate_persistent_mlp_kernel(config));
      programs = compile_gemvs(kernels);
    } catch (const std::exception& error) {
      persistent_refusals.push_back(error.what());
      return candidates;
    }
    for (std::size_t i = 0; i < configs.size(); ++i) {
      auto launch = std::make_shared<GemvLaunch>();
      launch->config = configs[i].gate_up;
      try {
        launch->loaded = LoadedGemv::load(kernels[i], programs[i]);
      } catch (const std::exception& error) {
        persistent_refusals.push_back(fmt::format("{}: {}", configs[i].shape_name(), error.what()));
        continue;
      }
      launches.push_back(launch);
      KernelArguments arguments;
      add_stage_arguments(arguments, gate_up_stage, {0, 1});
      add_stage_arguments(arguments, down_stage, {2});
      const DeviceStep eager = [launch, arguments](const CudaStream& s) { launch->loaded.launch(s, arguments); };
      const CandidateId id = CandidateId::fused(configs[i].shape_name()).as_graph();
      candidates.push_back({described(id, configs[i].to_string()), false, as_graph(eager, stream), eager,
                            launch->loaded.kernel.source});
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

    // The decision key: device, versions, mode, every candidate's identity and source, the
    // stage's ops and shapes (the same key the Executable uses for a region).
    std::vector<NodeId> nodes;
    for (const std::string& name : stage_nodes) nodes.push_back(node(name));
    FusionRegion region = region_of_nodes(*graph, nodes, "decode_mlp_" + stage);
    region.outputs = {output_id};
    std::vector<MeasuredCandidate> measured;
    std::vector<std::pair<CandidateId, std::string>> sources;
    for (const StageCandidate& candidate : candidates) {
      measured.push_back({candidate.report.id, candidate.report.gate, candidate.library_path});
      sources.emplace_back(candidate.report.id, candidate.source);
    }
    std::string key;
    std::optional<DispatchDecision> stored;
    std::optional<DecisionCache> cache;
    if (options.use_decision_cache) {
      key = dispatch_key(device.info(), region_graph(*graph, region), sources, options.mode);
      cache.emplace(options.decision_cache_file.empty() ? DecisionCache::default_path() : options.decision_cache_file);
      stored = cache->find(key);
    }

    const MeasuredChoice choice =
        choose_measured(measured, {options.mode, options.headroom}, stored, [&](const std::vector<int>& entrants) {
          std::vector<TournamentCandidate> race;
          for (int index : entrants) {
            race.push_back({candidates[static_cast<std::size_t>(index)].report.name,
                            candidates[static_cast<std::size_t>(index)].run});
          }
          return run_tournament(race, stream, options.tournament).score_ms;
        });
    if (choice.chosen < 0) throw CudaError(fmt::format("decode MLP {}: {}", stage, choice.reason));
    for (std::size_t i = 0; i < candidates.size(); ++i) candidates[i].report.score_ms = choice.score_ms[i];
    report.chosen = choice.chosen;
    report.best_native = choice.best_native;
    report.from_cache = choice.from_cache;
    report.sentence = fmt::format("{}: {}{}", stage, choice.reason, choice.from_cache ? " (cached)" : "");
    if (cache && choice.worth_storing && !choice.from_cache) {
      cache->store(decision_of(key, measured, choice));
      if (stage == "gate_up") stored_gate_up = StoredDecision{key, measured, choice, std::move(cache)};
    }

    for (const StageCandidate& candidate : candidates) report.candidates.push_back(candidate.report);
    chosen_step = candidates[static_cast<std::size_t>(choice.chosen)].eager;
    native_step = candidates[static_cast<std::size_t>(choice.best_native >= 0 ? choice.best_native : choice.chosen)].eager;
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
  // The MLP is one swiglu_mlp region; its roles name the operands of both GEMV stages.
  const FusionPlan plan = plan_graph_fusion(*s.graph);
  const auto region = std::find_if(plan.regions.begin(), plan.regions.end(),
                                   [](const FusionRegion& r) { return r.rule == "swiglu_mlp"; });
  if (region == plan.regions.end()) throw std::logic_error("decode MLP: the planner found no swiglu_mlp region");
  const GemvRegionPlan stages = plan_gemv_swiglu(*s.graph, *region);
  if (!stages.decision) throw InputError("decode MLP: " + stages.decision.reason);
  s.gate_up_stage = stages.stages[0];
  s.down_stage = stages.stages[1];

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

  // The executor: both selected callables in one graph, warmed by one replay. A generated down
  // GEMV launches as a programmatic dependent of gate/up where the option asks for it and the
  // driver captures it; the plain-order graph of the same kernels is kept for comparison.
  s.chosen_down_dependent = down[static_cast<std::size_t>(s.down.chosen)].dependent;
  s.serialized_graph = CudaGraph::capture(s.stream, sequence({s.chosen_gate_up, s.chosen_down}));
  if (!options.programmatic_dependent_launch) {
    s.programmatic_dependent_reason = "off (DecodeMlpOptions::programmatic_dependent_launch)";
  } else if (!s.chosen_down_dependent) {
    s.programmatic_dependent_reason = "the chosen down stage is not a generated GEMV";
  } else {
    // Measured, not assumed: on the H200 (device call 8) PDL took ~1 us off the Llama-3-8B MLP and
    // added 1-2 us to the narrow models' (their down blocks, launched early, crowd the SMs that
    // finish gate/up first). The faster graph of the two wins; a tie keeps plain stream order.
    try {
      CudaGraph dependent = CudaGraph::capture(s.stream, sequence({s.chosen_gate_up, s.chosen_down_dependent}));
      // Gated like every candidate: the same kernels in the dependent order must write the same
      // bits as in plain order (an x read before the wait would not), onto a poisoned output.
      DeviceTensor& out = (*s.values)[s.value("out")];
      s.serialized_graph.replay(s.stream);
      s.stream.synchronize();
      const HostTensor plain_out = out.to_host();
      out.buffer.fill_bytes(0xFF);
      dependent.replay(s.stream);
      s.stream.synchronize();
      const HostTensor dependent_out = out.to_host();
      if (!std::ranges::equal(plain_out.bytes(), dependent_out.bytes())) {
        throw CudaError("the dependent graph's output differs from plain stream order's");
      }
      const std::vector<TournamentCandidate> race = {
          {"programmatic dependent", [&dependent](const CudaStream& stream) { dependent.replay(stream); }},
          {"plain stream order", [&s](const CudaStream& stream) { s.serialized_graph.replay(stream); }}};
      const TournamentResult timing = run_tournament(race, s.stream, options.tournament);
      const double with = timing.score_ms[0] * 1e3, without = timing.score_ms[1] * 1e3;
      s.programmatic_dependent = with < without;
      if (s.programmatic_dependent) s.executor_graph = dependent;
      s.programmatic_dependent_reason =
          fmt::format("{} ({:.2f} us with, {:.2f} us without)",
                      s.programmatic_dependent ? "down launches as a programmatic dependent of gate/up"
                                               : "not used, no faster",
                      with, without);
    } catch (const CudaError& error) {
      s.programmatic_dependent_reason = fmt::format("not used: {}", error.what());
    }
  }
  if (!s.programmatic_dependent) s.executor_graph = CudaGraph::capture(s.stream, sequence({s.chosen_gate_up, s.chosen_down}));
  // The gate/up near tie, launched before the chosen down in the order the chosen pair measured faster.
  // Not for a gate/up decision read from the cache: the build that stored it raced the near tie
  // already and stored the winner (below), and racing again could flip a cached choice.
  if (options.near_tie_margin > 0 && s.gate_up.chosen >= 0 && !s.gate_up.from_cache) {
    std::vector<std::pair<std::string, double>> timings;
    for (const DecodeMlpCandidate& candidate : s.gate_up.candidates) timings.emplace_back(candidate.name, candidate.score_ms);
    const std::optional<std::string> near = near_tie_candidate(
        timings, s.gate_up.candidates[static_cast<std::size_t>(s.gate_up.chosen)].name, options.near_tie_margin);
    for (std::size_t i = 0; near && i < gate_up.size(); ++i) {
      if (gate_up[i].report.name != *near || !gate_up[i].report.gate.passed) continue;
      try {
        s.near_tie_eager =
            sequence({gate_up[i].eager, s.programmatic_dependent ? s.chosen_down_dependent : s.chosen_down});
        s.near_tie_graph = CudaGraph::capture(s.stream, s.near_tie_eager);
        s.near_tie_gate_up = static_cast<int>(i);
      } catch (const CudaError&) {
        s.near_tie_eager = {};  // not captured: not raced
      }
      break;
    }
  }
  // The whole MLP: the persistent kernels race the chosen stages and the native graph, gated against
  // the float64 MLP (the hidden state rounded to the activation dtype, as every path stores it). Only
  // a persistent kernel that wins replaces the stages' graph.
  const HostTensor whole_reference = to_tensor(decode_mlp_reference_out(weights, hidden_reference, residual), rows,
                                               weights.hidden, dtype);
  std::vector<StageCandidate> whole = s.whole_candidates();
  DeviceStep whole_step, whole_native;
  s.whole = s.tune(
      "whole", whole, {"gate", "up", "activated", "hidden_state", "down", "out"},
      [&] {
        (*s.values)[x_id].buffer.upload(x);
        (*s.values)[residual_id].buffer.upload(residual);
      },
      "out", whole_reference, whole_step, whole_native);
  s.stages_graph = s.executor_graph;
  int fastest_persistent = -1;
  for (std::size_t i = 0; i < whole.size(); ++i) {
    const DecodeMlpCandidate& candidate = s.whole.candidates[i];
    if (candidate.id.kind != CandidateKind::fused || is_stages_variant(candidate.id) || !candidate.gate.passed) continue;
    const DecodeMlpCandidate* best =
        fastest_persistent < 0 ? nullptr : &s.whole.candidates[static_cast<std::size_t>(fastest_persistent)];
    if (best == nullptr || (candidate.score_ms >= 0 && (best->score_ms < 0 || candidate.score_ms < best->score_ms))) {
      fastest_persistent = static_cast<int>(i);
    }
  }
  if (fastest_persistent >= 0) {
    s.persistent_graph = CudaGraph::capture(s.stream, whole[static_cast<std::size_t>(fastest_persistent)].eager);
  }
  const StageCandidate& whole_chosen = whole[static_cast<std::size_t>(s.whole.chosen)];
  if (whole_chosen.report.id.variant == kNearTieVariant) {
    // The near tie won with down after it: it is the gate/up stage's choice from here on.
    const DecodeMlpCandidate& near = s.gate_up.candidates[static_cast<std::size_t>(s.near_tie_gate_up)];
    s.gate_up.sentence += fmt::format("; the whole MLP then chose its near tie, {}", near.name);
    s.gate_up.chosen = s.near_tie_gate_up;
    s.chosen_gate_up = gate_up[static_cast<std::size_t>(s.near_tie_gate_up)].eager;
    s.executor_graph = s.near_tie_graph;
    s.stages_graph = s.near_tie_graph;
    s.serialized_graph = CudaGraph::capture(s.stream, sequence({s.chosen_gate_up, s.chosen_down}));
    if (s.stored_gate_up) {
      // The stage's stored decision becomes the pair's: a cached build then starts from this gate/up.
      State::StoredDecision& stored = *s.stored_gate_up;
      stored.choice.chosen = s.near_tie_gate_up;
      stored.choice.reason += fmt::format("; the whole MLP then chose its near tie, {}", near.name);
      stored.cache->store(decision_of(stored.key, stored.measured, stored.choice));
    }
  } else if (whole_chosen.report.id.kind == CandidateKind::fused && !is_stages_variant(whole_chosen.report.id)) {
    s.persistent = true;
    s.programmatic_dependent = false;
    s.programmatic_dependent_reason = "not used: one persistent kernel computes both stages";
    s.executor_graph = CudaGraph::capture(s.stream, whole_step);
    s.serialized_graph = CudaGraph::capture(s.stream, whole_step);
  }
  s.native_graph = CudaGraph::capture(s.stream, sequence({s.native_gate_up, s.native_down}));
  s.executor_graph.replay(s.stream);
  s.serialized_graph.replay(s.stream);
  if (s.persistent_graph) s.persistent_graph.replay(s.stream);
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
void DecodeMlpExecutor::enqueue_serialized(const CudaStream& stream) const { state_->serialized_graph.replay(stream); }
bool DecodeMlpExecutor::programmatic_dependent() const { return state_->programmatic_dependent; }
const std::string& DecodeMlpExecutor::programmatic_dependent_reason() const {
  return state_->programmatic_dependent_reason;
}
const DecodeMlpStageReport& DecodeMlpExecutor::gate_up_report() const { return state_->gate_up; }
const DecodeMlpStageReport& DecodeMlpExecutor::down_report() const { return state_->down; }
const DecodeMlpStageReport& DecodeMlpExecutor::whole_report() const { return state_->whole; }
bool DecodeMlpExecutor::persistent() const { return state_->persistent; }
bool DecodeMlpExecutor::has_persistent() const { return static_cast<bool>(state_->persistent_graph); }
void DecodeMlpExecutor::enqueue_persistent(const CudaStream& stream) const {
  if (!state_->persistent_graph) throw CudaError("decode MLP: no persistent kernel passed the gate");
  state_->persistent_graph.replay(stream);
}
void DecodeMlpExecutor::enqueue_stages(const CudaStream& stream) const { state_->stages_graph.replay(stream); }

HostTensor DecodeMlpExecutor::run(const HostTensor& x_values, const HostTensor& residual_values) {
  x().buffer.upload(x_values);
  residual().buffer.upload(residual_values);
  enqueue(state_->stream);
  state_->stream.synchronize();
  return out().to_host();
}

std::string DecodeMlpExecutor::report() const {
  std::string text = fmt::format("programmatic dependent launch: {}\n", state_->programmatic_dependent_reason);
  for (const std::string& refusal : state_->persistent_refusals) text += fmt::format("persistent refused: {}\n", refusal);
  for (const DecodeMlpStageReport* stage : {&state_->gate_up, &state_->down, &state_->whole}) {
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
