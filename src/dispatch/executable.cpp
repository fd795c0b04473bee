// A fusion plan made runnable on the GPU. For each region:
//
//   candidates  = native (one kernel per node), native graph (the same, as a CUDA graph),
//                 fused variants from the lowerings (each also as a CUDA graph)
//   gate        = every candidate on fresh random inputs of the region alone vs run_reference
//   tournament  = gated candidates, order-interleaved (dispatch.h)
//   choice      = fused only with >= 10% headroom over the best native (5% for a single node)
//
// then binds the chosen step to the plan's device buffers, orders all steps topologically and
// (optionally) captures them as one CUDA graph. METILE_DISPATCH=native|fused skips the race.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>

#include "metile/cpu_runtime.h"
#include "metile/dispatch.h"

namespace metile {

// ---------------------------------------------------------------- mode
DispatchMode parse_dispatch_mode(std::string_view text) {
  if (text == "native") return DispatchMode::native;
  if (text == "fused") return DispatchMode::fused;
  if (text == "auto" || text.empty()) return DispatchMode::automatic;
  throw InputError(fmt::format("METILE_DISPATCH must be native, fused or auto, got '{}'", text));
}

DispatchMode dispatch_mode_from_environment() {
  const char* value = std::getenv("METILE_DISPATCH");
  return parse_dispatch_mode(value == nullptr ? "" : value);
}

std::string_view dispatch_mode_name(DispatchMode mode) {
  switch (mode) {
    case DispatchMode::native: return "native";
    case DispatchMode::fused: return "fused";
    case DispatchMode::automatic: return "auto";
  }
  return "auto";
}

// ---------------------------------------------------------------- lowerings
std::vector<FusedCandidate> row_region_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  if (!is_row_region(graph, region)) return {};
  std::vector<FusedCandidate> candidates;
  for (const RowKernelOptions& options : row_kernel_variants(graph, region)) {
    GeneratedKernel generated = generate_region_kernel(graph, region, options);
    FusedCandidate candidate;
    candidate.name = options.variant_name.empty() ? "fused" : "fused " + options.variant_name;
    candidate.source = generated.source;
    candidate.summary = generated.summary;
    candidate.bind = [generated](DeviceValues& values) { return bind_kernel(load_generated_kernel(generated), values); };
    candidates.push_back(std::move(candidate));
  }
  return candidates;
}

std::vector<FusedCandidate> contraction_row_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  std::vector<NodeId> nodes = region.nodes;
  std::sort(nodes.begin(), nodes.end());
  std::vector<NodeId> before;  // contractions the row part reads
  std::vector<NodeId> after;   // contractions reading the row part
  FusionRegion rows;
  rows.rule = region.rule;
  std::set<ValueId> row_values;
  std::set<ValueId> after_values;
  for (NodeId id : nodes) {
    const Node& node = graph.node(id);
    const bool reads_rows = std::any_of(node.inputs.begin(), node.inputs.end(), [&](ValueId input) {
      return row_values.contains(input) || after_values.contains(input);
    });
    if (node.kind == OpKind::contraction) {
      (reads_rows ? after : before).push_back(id);
      if (reads_rows) after_values.insert(node.outputs.begin(), node.outputs.end());
      continue;
    }
    // A row op reading a contraction that itself reads the row part: no single row kernel fits.
    if (std::any_of(node.inputs.begin(), node.inputs.end(), [&](ValueId input) { return after_values.contains(input); })) {
      return {};
    }
    rows.nodes.push_back(id);
    row_values.insert(node.outputs.begin(), node.outputs.end());
  }
  if (before.empty() && after.empty()) return {};
  if (rows.nodes.empty()) return {};
  const std::set<NodeId> row_nodes(rows.nodes.begin(), rows.nodes.end());
  for (NodeId id : rows.nodes) {
    for (ValueId input : graph.node(id).inputs) {
      if (!row_values.contains(input) && std::find(rows.inputs.begin(), rows.inputs.end(), input) == rows.inputs.end()) {
        rows.inputs.push_back(input);
      }
    }
    for (ValueId output : graph.node(id).outputs) {
      const auto& consumers = graph.consumers(output);
      const bool escapes = graph.is_output(output) || std::any_of(consumers.begin(), consumers.end(), [&](NodeId consumer) {
                             return !row_nodes.contains(consumer);
                           });
      if (escapes) rows.outputs.push_back(output);
    }
  }
  if (!is_row_region(graph, rows)) return {};
  std::vector<FusedCandidate> candidates;
  for (const RowKernelOptions& options : row_kernel_variants(graph, rows)) {
    GeneratedKernel generated = generate_region_kernel(graph, rows, options);
    FusedCandidate candidate;
    candidate.name = options.variant_name.empty() ? "fused epilogue" : "fused epilogue " + options.variant_name;
    candidate.source = generated.source;
    for (NodeId id : before) candidate.source += "\n" + NativeRuntime::node_source(graph, id);
    for (NodeId id : after) candidate.source += "\n" + NativeRuntime::node_source(graph, id);
    candidate.summary = fmt::format("{} contraction(s) through cuBLASLt around one {}", before.size() + after.size(),
                                    generated.summary);
    candidate.launches = static_cast<int>(1 + before.size() + after.size());
    candidate.bind = [generated, before, after](DeviceValues& values) {
      auto native = std::make_shared<NativeRuntime>();
      auto steps = std::make_shared<std::vector<DeviceStep>>();
      for (NodeId id : before) steps->push_back(native->node_step(values.graph(), id, values));
      steps->push_back(bind_kernel(load_generated_kernel(generated), values));
      for (NodeId id : after) steps->push_back(native->node_step(values.graph(), id, values));
      return DeviceStep([native, steps](const CudaStream& stream) { run_steps(*steps, stream); });
    };
    candidates.push_back(std::move(candidate));
  }
  return candidates;
}

// ---------------------------------------------------------------- executable
struct Executable::State {
  CudaDevice device;
  std::shared_ptr<const ComputeGraph> graph;
  std::unique_ptr<DeviceValues> values;
  std::unique_ptr<NativeRuntime> native;
  CudaStream stream;
  std::vector<DeviceStep> steps;
  CudaGraph replay;
  std::vector<RegionReport> reports;
  int kernel_count = 0;

  explicit State(CudaDevice device_) : device(std::move(device_)) {}
};

Executable::Executable(std::unique_ptr<State> state) : state_(std::move(state)) {}
Executable::~Executable() = default;
Executable::Executable(Executable&&) noexcept = default;
Executable& Executable::operator=(Executable&&) noexcept = default;

namespace {

std::vector<FusedCandidate> lower_region(const ComputeGraph& graph, const FusionRegion& region,
                                         const ExecutableOptions& options) {
  std::vector<FusedCandidate> candidates = row_region_candidates(graph, region);
  for (FusedCandidate& candidate : contraction_row_candidates(graph, region)) candidates.push_back(std::move(candidate));
  for (const RegionLowering& lowering : options.extra_lowerings) {
    for (FusedCandidate& candidate : lowering(graph, region)) candidates.push_back(std::move(candidate));
  }
  return candidates;
}

// The worst output's gate result (the first failure, else the largest relative L2 error).
NumericGateResult gate_outputs(const TensorMap& outputs, const TensorMap& reference) {
  NumericGateResult worst;
  worst.passed = true;
  for (const auto& [name, expected] : reference) {
    NumericGateResult result = numeric_gate(outputs.at(name), expected);
    if (!result.passed) result.detail = fmt::format("output '{}': {}", name, result.detail);
    if ((worst.passed && !result.passed) || (worst.passed == result.passed && result.relative_l2 > worst.relative_l2)) {
      worst = result;
    }
  }
  return worst;
}

struct RegionChoice {
  bool fused = false;
  std::string chosen;  // candidate name
  RegionReport report;
};

// Gates and (in auto mode) races the candidates of one region on a graph of its own.
RegionChoice choose_for_region(const ComputeGraph& graph, const FusionRegion& region, int region_index,
                               const CudaDevice& device, const ExecutableOptions& options, NativeRuntime& native,
                               DecisionCache* cache) {
  RegionChoice choice;
  RegionReport& report = choice.report;
  report.region = region_index;
  report.rule = region.rule;
  for (NodeId id : region.nodes) report.nodes.push_back(graph.node(id).name);
  const std::string label = fmt::format("region R{} ({})", region_index, region.rule.empty() ? "region" : region.rule);
  choice.chosen = "native";

  if (options.mode == DispatchMode::native) {
    report.sentence = fmt::format("{}: native (METILE_DISPATCH=native)", label);
    report.chosen = choice.chosen;
    return choice;
  }
  const ComputeGraph sub = region_graph(graph, region);
  const FusionRegion sub_region = region_in_region_graph(graph, region, sub);
  std::vector<FusedCandidate> candidates = lower_region(sub, sub_region, options);
  if (candidates.empty()) {
    std::string reason;
    is_row_region(sub, sub_region, &reason);
    report.sentence = fmt::format("{}: native: no fused lowering ({})", label, reason);
    report.chosen = choice.chosen;
    return choice;
  }

  std::vector<std::string> sources;
  for (const FusedCandidate& candidate : candidates) sources.push_back(candidate.source);
  for (const Node& node : sub.nodes()) sources.push_back(NativeRuntime::node_source(sub, node.id));
  const std::string key = dispatch_key(device.info(), sub, sources);
  if (cache != nullptr) {
    if (std::optional<DispatchDecision> decision = cache->find(key)) {
      const bool known = decision->chosen.rfind("native", 0) == 0 ||
                         std::any_of(candidates.begin(), candidates.end(), [&](const FusedCandidate& candidate) {
                           return decision->chosen.rfind(candidate.name, 0) == 0;
                         });
      if (known && (options.mode == DispatchMode::automatic || decision->chosen.rfind("fused", 0) == 0)) {
        choice.fused = decision->chosen.rfind("fused", 0) == 0;
        choice.chosen = decision->chosen;
        report.chosen = decision->chosen;
        report.from_cache = true;
        report.timings_ms = decision->timings_ms;
        report.sentence = decision->report + " (cached)";
        return choice;
      }
    }
  }

  // Gate: every candidate on the same fresh random inputs, outputs poisoned before each run.
  const TensorMap inputs = random_inputs(sub, options.gate_seed);
  const TensorMap reference = run_reference(sub, inputs);
  DeviceValues values(sub);
  values.upload_inputs(inputs);
  CudaStream stream;
  auto run_and_gate = [&](const std::function<void(const CudaStream&)>& run) {
    values.poison_computed_values();
    run(stream);
    stream.synchronize();
    return gate_outputs(values.download_outputs(), reference);
  };
  const std::vector<DeviceStep> native_steps = native.graph_steps(sub, values);
  const NumericGateResult native_gate = run_and_gate([&](const CudaStream& s) { run_steps(native_steps, s); });
  report.gates.emplace_back("native", native_gate);

  std::vector<TournamentCandidate> race = {{"native", [&](const CudaStream& s) { run_steps(native_steps, s); }}};
  const CudaGraph native_graph = CudaGraph::capture(stream, [&](const CudaStream& s) { run_steps(native_steps, s); });
  race.push_back({"native graph", [native_graph](const CudaStream& s) { native_graph.replay(s); }});
  const std::size_t native_candidates = race.size();

  std::vector<std::string> gate_failures;
  for (const FusedCandidate& candidate : candidates) {
    DeviceStep step;
    try {
      step = candidate.bind(values);
    } catch (const CudaError& error) {
      NumericGateResult failed;
      failed.detail = fmt::format("did not compile or load: {}", error.what());
      report.gates.emplace_back(candidate.name, failed);
      gate_failures.push_back(fmt::format("{} {}", candidate.name, failed.detail));
      continue;
    }
    const NumericGateResult gate = run_and_gate(step);
    report.gates.emplace_back(candidate.name, gate);
    if (!gate.passed) {
      const double error = std::max(gate.relative_l2, gate.relative_max);
      gate_failures.push_back(std::isfinite(error)
                                  ? fmt::format("{} failed the numeric gate by {:.1e} ({})", candidate.name, error, gate.detail)
                                  : fmt::format("{} failed the numeric gate ({})", candidate.name, gate.detail));
      continue;
    }
    race.push_back({candidate.name, step});
    const CudaGraph fused_graph = CudaGraph::capture(stream, step);
    race.push_back({candidate.name + " graph", [fused_graph](const CudaStream& s) { fused_graph.replay(s); }});
  }

  if (race.size() == native_candidates) {
    report.sentence = fmt::format("{}: native: {}", label, gate_failures.empty() ? "no candidate" : gate_failures.front());
    report.chosen = choice.chosen;
    return choice;  // not cached: a failing candidate is re-examined next time (the source may change)
  }

  const TournamentResult result = run_tournament(race, stream, options.tournament);
  for (std::size_t i = 0; i < race.size(); ++i) report.timings_ms.emplace_back(race[i].name, result.score_ms[i]);
  std::size_t best_native = 0;
  for (std::size_t i = 1; i < native_candidates; ++i) {
    if (result.score_ms[i] < result.score_ms[best_native]) best_native = i;
  }
  std::size_t best_fused = native_candidates;
  for (std::size_t i = native_candidates; i < race.size(); ++i) {
    if (result.score_ms[i] < result.score_ms[best_fused]) best_fused = i;
  }
  const double speedup = result.score_ms[best_native] / result.score_ms[best_fused];
  const double headroom = region.nodes.size() == 1 ? 0.05 : 0.10;
  std::string fused_name = race[best_fused].name;
  if (fused_name.size() > 6 && fused_name.ends_with(" graph")) fused_name.resize(fused_name.size() - 6);
  if (options.mode == DispatchMode::fused) {
    choice.fused = true;
    choice.chosen = fused_name;
    report.sentence = fmt::format("{}: {} (METILE_DISPATCH=fused), {:.2f}x over {}", label, race[best_fused].name,
                                  speedup, race[best_native].name);
  } else if (beats_with_headroom(result.score_ms[best_fused], result.score_ms[best_native], headroom)) {
    choice.fused = true;
    choice.chosen = fused_name;
    report.sentence = fmt::format("{}: {}, {:.2f}x over {}", label, race[best_fused].name, speedup, race[best_native].name);
  } else {
    choice.chosen = race[best_native].name;
    report.sentence = fmt::format("{}: {}: best fused ({}) only {:.2f}x, needs {:.2f}x", label, race[best_native].name,
                                  race[best_fused].name, speedup, 1.0 + headroom);
  }
  if (!gate_failures.empty()) report.sentence += "; " + gate_failures.front();
  report.chosen = choice.chosen;
  if (cache != nullptr && options.mode == DispatchMode::automatic) {
    cache->store({key, choice.chosen, report.timings_ms, report.sentence});
  }
  return choice;
}

// Steps of regions and unfused nodes, ordered so every step runs after the producers of what it reads.
struct Unit {
  std::vector<NodeId> nodes;
  std::vector<DeviceStep> steps;
};

std::vector<DeviceStep> order_units(const ComputeGraph& graph, std::vector<Unit> units) {
  std::map<NodeId, std::size_t> unit_of;
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (NodeId node : units[u].nodes) unit_of[node] = u;
  }
  std::vector<std::set<std::size_t>> successors(units.size());
  std::vector<int> pending(units.size(), 0);
  for (std::size_t u = 0; u < units.size(); ++u) {
    std::set<std::size_t> predecessors;
    for (NodeId node : units[u].nodes) {
      for (ValueId input : graph.node(node).inputs) {
        const NodeId producer = graph.value(input).producer;
        if (producer >= 0 && unit_of.at(producer) != u) predecessors.insert(unit_of.at(producer));
      }
    }
    for (std::size_t p : predecessors) successors[p].insert(u);
    pending[u] = static_cast<int>(predecessors.size());
  }
  // Kahn's algorithm, always taking the ready unit with the smallest first node (deterministic).
  auto first_node = [&](std::size_t u) { return *std::min_element(units[u].nodes.begin(), units[u].nodes.end()); };
  auto later = [&](std::size_t a, std::size_t b) { return first_node(a) > first_node(b); };
  std::vector<std::size_t> ready;
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (pending[u] == 0) ready.push_back(u);
  }
  std::vector<DeviceStep> steps;
  std::size_t done = 0;
  while (!ready.empty()) {
    std::sort(ready.begin(), ready.end(), later);
    const std::size_t u = ready.back();
    ready.pop_back();
    ++done;
    for (DeviceStep& step : units[u].steps) steps.push_back(std::move(step));
    for (std::size_t next : successors[u]) {
      if (--pending[next] == 0) ready.push_back(next);
    }
  }
  if (done != units.size()) throw std::runtime_error("Executable: the plan's regions depend on each other in a cycle");
  return steps;
}

}  // namespace

Executable Executable::build(const FusionPlan& plan, const CudaDevice& device, const ExecutableOptions& options) {
  if (!plan.graph) throw InputError("Executable::build: the plan has no graph");
  device.make_current();
  auto state = std::make_unique<State>(device);
  state->graph = plan.graph;
  const ComputeGraph& graph = *state->graph;
  state->values = std::make_unique<DeviceValues>(graph);
  state->native = std::make_unique<NativeRuntime>();
  std::optional<DecisionCache> cache;
  if (options.use_decision_cache) {
    cache.emplace(options.decision_cache_file.empty() ? DecisionCache::default_path() : options.decision_cache_file);
  }

  std::vector<Unit> units;
  std::set<NodeId> covered;
  for (std::size_t r = 0; r < plan.regions.size(); ++r) {
    const FusionRegion& region = plan.regions[r];
    RegionChoice choice = choose_for_region(graph, region, static_cast<int>(r), device, options, *state->native,
                                            cache ? &*cache : nullptr);
    Unit unit;
    unit.nodes = region.nodes;
    if (choice.fused) {
      for (FusedCandidate& candidate : lower_region(graph, region, options)) {
        if (candidate.name != choice.chosen) continue;
        unit.steps.push_back(candidate.bind(*state->values));
        state->kernel_count += candidate.launches;
      }
      if (unit.steps.empty()) throw std::runtime_error(fmt::format("region R{}: candidate '{}' vanished", r, choice.chosen));
    } else {
      std::vector<NodeId> nodes = region.nodes;
      std::sort(nodes.begin(), nodes.end());
      for (NodeId node : nodes) unit.steps.push_back(state->native->node_step(graph, node, *state->values));
      state->kernel_count += static_cast<int>(nodes.size());
    }
    covered.insert(region.nodes.begin(), region.nodes.end());
    units.push_back(std::move(unit));
    state->reports.push_back(std::move(choice.report));
  }
  for (const Node& node : graph.nodes()) {
    if (covered.contains(node.id)) continue;
    units.push_back({{node.id}, {state->native->node_step(graph, node.id, *state->values)}});
    state->kernel_count += 1;
  }
  state->steps = order_units(graph, std::move(units));
  if (options.capture_cuda_graph && !state->steps.empty()) {
    state->replay = CudaGraph::capture(state->stream, [&steps = state->steps](const CudaStream& stream) {
      run_steps(steps, stream);
    });
  }
  return Executable(std::move(state));
}

TensorMap Executable::run(const TensorMap& inputs) {
  state_->device.make_current();
  state_->values->upload_inputs(inputs);
  enqueue(state_->stream);
  state_->stream.synchronize();
  return state_->values->download_outputs();
}

void Executable::enqueue(const CudaStream& stream) {
  if (state_->replay) {
    state_->replay.replay(stream);
  } else {
    run_steps(state_->steps, stream);
  }
}

DeviceValues& Executable::values() { return *state_->values; }
const CudaStream& Executable::stream() const { return state_->stream; }
const std::vector<RegionReport>& Executable::reports() const { return state_->reports; }

std::string Executable::report() const {
  std::string text;
  for (const RegionReport& report : state_->reports) text += report.sentence + "\n";
  text += fmt::format("{} kernel launches per run{}\n", state_->kernel_count,
                      state_->replay ? ", replayed as one CUDA graph" : "");
  return text;
}

}  // namespace metile
