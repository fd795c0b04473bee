// A fusion plan made runnable on the GPU. For each region:
//
//   candidates  = native (one kernel per node), native graph (the same, as a CUDA graph),
//                 fused variants from the lowerings (each also as a CUDA graph)
//   gate        = every candidate on fresh random inputs of the region alone vs run_reference
//   choice      = choose_measured (measured_choice.cpp): admission, stored decision,
//                 order-interleaved tournament, fused only with >= 10% headroom over the best
//                 native (5% for a single node)
//
// then binds the chosen step to the plan's device buffers, orders all steps topologically and
// (optionally) captures them as one CUDA graph. METILE_DISPATCH=native|fused skips the race.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
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
namespace {

// One candidate per row-kernel variant of `rows`, named `fused <prefix> <variant>`.
std::vector<FusedCandidate> row_kernel_candidates(const ComputeGraph& graph, const FusionRegion& rows,
                                                  const std::string& prefix) {
  std::vector<FusedCandidate> candidates;
  for (const RowKernelOptions& options : row_kernel_variants(graph, rows)) {
    GeneratedKernel generated = generate_region_kernel(graph, rows, options);
    FusedCandidate candidate;
    std::string variant = prefix;
    if (!options.variant_name.empty()) variant += (variant.empty() ? "" : " ") + options.variant_name;
    candidate.id = CandidateId::fused(variant);
    candidate.source = generated.source;
    candidate.summary = generated.summary;
    candidate.bind = [generated](DeviceValues& values) { return bind_kernel(load_generated_kernel(generated), values); };
    candidates.push_back(std::move(candidate));
  }
  return candidates;
}

}  // namespace

Lowered row_region_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  Decision decision = row_region_decision(graph, region);
  if (!decision) return {std::move(decision), {}};
  return {Decision::allow(), row_kernel_candidates(graph, region, "")};
}

Lowered contraction_row_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  std::vector<NodeId> nodes = region.nodes;
  std::sort(nodes.begin(), nodes.end());
  std::vector<NodeId> before;  // contractions the row part reads
  std::vector<NodeId> after;   // contractions reading the row part
  std::vector<NodeId> row_nodes;
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
    if (std::any_of(node.inputs.begin(), node.inputs.end(), [&](ValueId input) { return after_values.contains(input); })) {
      return {Decision::refuse(fmt::format("node '{}' reads a contraction that itself reads the row part: no single "
                                           "row kernel fits between the contractions", node.name)),
              {}};
    }
    row_nodes.push_back(id);
    row_values.insert(node.outputs.begin(), node.outputs.end());
  }
  if (before.empty() && after.empty()) return {Decision::refuse("the region has no contraction"), {}};
  if (row_nodes.empty()) return {Decision::refuse("the region is contractions only: nothing to fuse between them"), {}};
  FusionRegion rows = region_of_nodes(graph, row_nodes, region.rule);
  Decision rows_decision = row_region_decision(graph, rows);
  if (!rows_decision) return {Decision::refuse("the ops between the contractions: " + rows_decision.reason), {}};
  std::vector<FusedCandidate> candidates = row_kernel_candidates(graph, rows, "epilogue");
  for (FusedCandidate& candidate : candidates) {
    for (NodeId id : before) candidate.source += "\n" + NativeRuntime::node_source(graph, id);
    for (NodeId id : after) candidate.source += "\n" + NativeRuntime::node_source(graph, id);
    candidate.summary = fmt::format("{} contraction(s) through cuBLASLt around one {}", before.size() + after.size(),
                                    candidate.summary);
    candidate.launches = static_cast<int>(1 + before.size() + after.size());
    candidate.bind = [row_bind = candidate.bind, before, after](DeviceValues& values) {
      auto native = std::make_shared<NativeRuntime>();
      const DeviceStep first = native_nodes_step(native, values, before);
      const DeviceStep rows = row_bind(values);
      const DeviceStep last = native_nodes_step(native, values, after);
      return DeviceStep([first, rows, last](const CudaStream& stream) {
        first(stream);
        rows(stream);
        last(stream);
      });
    };
  }
  return {Decision::allow(), std::move(candidates)};
}

std::vector<RegionLowering> builtin_lowerings() {
  return {{"row kernel", row_region_candidates},
          {"contractions around a row kernel", contraction_row_candidates},
          {"flash attention", flash_attention_candidates},
          {"rope and cache writes", rope_kv_cache_candidates},
          {"gemv", gemv_region_candidates}};
}

// ---------------------------------------------------------------- executable
namespace {
// A fused region's step as its step-race candidate would run it (step_race_candidate: the chosen
// shape's prefetch twin or the candidate its race nearly chose; race_near_ties); an
// empty step: none. Swapped with what runs the step when the race keeps it.
struct NearTie {
  DeviceStep step;
  CandidateId id;
  std::vector<DeviceByteRange> weights;  // FusedCandidate::weights
  int extra_launches = 0;                // its kernel launches less those of what runs the step
  int report = -1;                       // index of the region's report
};
}  // namespace

struct Executable::State {
  CudaDevice device;
  std::shared_ptr<const ComputeGraph> graph;
  std::unique_ptr<DeviceValues> values;
  std::unique_ptr<NativeRuntime> native;
  CudaStream stream;
  std::vector<DeviceStep> steps;
  std::vector<std::string> step_kinds;  // per step: what profile() sums it under
  std::vector<std::vector<DeviceByteRange>> step_weights;  // per step: the weights it streams (GEMVs)
  std::vector<bool> step_contracts;  // per step: its unit holds a contraction (weights streamed, known or not)
  CudaGraph replay;
  bool programmatic_replay = false;  // the replay launches GEMVs and attention as programmatic dependents
  std::string programmatic_race;     // race_programmatic_replay's figures, for report()
  // race_weight_prefetch: the side stream its replay forks onto, the events of the forks and the
  // join, the prefetches' piece tables (the graph's kernels read them), its figures for report().
  CudaStream prefetch_stream = CudaStream::capture_only();
  std::deque<CudaEvent> prefetch_events;
  std::vector<std::shared_ptr<const L2Prefetch>> prefetches;
  bool weight_prefetch = false;
  std::string prefetch_race;
  std::vector<RegionReport> reports;
  int kernel_count = 0;
  std::vector<NearTie> near_ties;  // per step (race_near_ties)
  std::string near_tie_race;        // race_near_ties's figures, for report()

  explicit State(CudaDevice device_) : device(std::move(device_)) {}
};

Executable::Executable(std::unique_ptr<State> state) : state_(std::move(state)) {}
Executable::~Executable() = default;
Executable::Executable(Executable&&) noexcept = default;
Executable& Executable::operator=(Executable&&) noexcept = default;

namespace {

// Captures `work` (CudaGraph::capture: on a stream of its own with `stream`'s launch settings) with its GEMVs and
// attention launched as programmatic dependents or not (CudaStream::set_programmatic_dependent_launch); `stream`
// launches plainly again afterwards, as eager runs (profile(), no graph) do, also when the capture throws.
CudaGraph capture_launching(CudaStream& stream, bool programmatic, const std::function<void(const CudaStream&)>& work) {
  stream.set_programmatic_dependent_launch(programmatic);
  try {
    CudaGraph graph = CudaGraph::capture(stream, work);
    stream.set_programmatic_dependent_launch(false);
    return graph;
  } catch (...) {
    stream.set_programmatic_dependent_launch(false);
    throw;
  }
}

// Gates the candidates of one region on a graph of its own, then lets the dispatch engine
// (choose_measured) race and choose.
// Choices made earlier in the same build, by a key of the region's structure and its candidates'
// identities (not their sources, whose comments carry value names): the 32 identical layers of a
// model are gated and raced once.
using BuildMemo = std::map<std::string, RegionReport>;

RegionReport choose_for_region(const ComputeGraph& graph, const FusionRegion& region, int region_index,
                               const CudaDevice& device, const ExecutableOptions& options, NativeRuntime& native,
                               DecisionCache* cache, BuildMemo& memo) {
  RegionReport report;
  report.region = region_index;
  report.rule = region.rule;
  for (NodeId id : region.nodes) report.nodes.push_back(graph.node(id).name);
  // Regions are numbered from 1, as `metile plan` prints them (FusionPlan::explain), so a report
  // line and a plan line about the same region say the same R-number. An unfused node offered as a
  // region of its own (region_index -1) is named by its node.
  const std::string label =
      region_index >= 0 ? fmt::format("region R{} ({})", region_index + 1, region.rule.empty() ? "region" : region.rule)
                        : fmt::format("node '{}' ({})", report.nodes.front(), region.rule);
  const DispatchPolicy policy{options.mode, boundary_headroom(region.nodes.size())};
  auto finish = [&](const CandidateId& chosen, const std::string& reason) {
    report.chosen_id = chosen;
    report.chosen = chosen.name();
    report.sentence = fmt::format("{}: {}", label, reason);
    return report;
  };
  if (options.mode == DispatchMode::native) {
    return finish(CandidateId::native(), "native (METILE_DISPATCH=native)");
  }
  if (options.declined_rules.contains(region.rule)) {
    return finish(CandidateId::native(), "native: declined by model verification");
  }
  const ComputeGraph sub = region_graph(graph, region);
  const FusionRegion sub_region = region_in_region_graph(graph, region, sub);
  RegionLowerings lowered = lower_region(sub, sub_region, options);
  if (lowered.candidates.empty()) {
    return finish(CandidateId::native(), fmt::format("native: no fused lowering ({})", lowered.refusals));
  }

  // The candidates, in the order the engine sees them: native, native graph, then each fused
  // lowering eagerly and as a CUDA graph.
  std::vector<MeasuredCandidate> measured = {{CandidateId::native(), {}, true}, {CandidateId::native().as_graph(), {}, true}};
  std::vector<std::pair<CandidateId, std::string>> sources;
  std::string native_source;
  for (const Node& node : sub.nodes()) native_source += NativeRuntime::node_source(sub, node.id);
  sources.emplace_back(CandidateId::native(), native_source);
  for (const FusedCandidate& candidate : lowered.candidates) sources.emplace_back(candidate.id, candidate.source);
  // A race with cold caches measures other figures than a warm one: their decisions never mix.
  const std::string key = dispatch_key(device.info(), sub, sources, options.mode) +
                          (options.tournament.cold_cache_bytes > 0 ? " cold" : "");
  std::vector<std::pair<CandidateId, std::string>> identities;
  for (const auto& [id, source] : sources) identities.emplace_back(id, std::string());
  const std::string memo_key = dispatch_key(device.info(), sub, identities, options.mode);
  if (auto earlier = memo.find(memo_key); earlier != memo.end()) {
    RegionReport same = earlier->second;
    same.region = report.region;
    same.rule = report.rule;
    same.nodes = report.nodes;
    // "region R3 (...)" or "node 'q_proj' (contraction)": the label the earlier choice was made under.
    const std::string& first = earlier->second.sentence;
    same.sentence = fmt::format("{}: {} (as {}, same structure)", label, first.substr(first.find(": ") + 2),
                                first.substr(0, first.find(": ")));
    return same;
  }
  auto remember = [&](RegionReport chosen) {
    memo.emplace(memo_key, chosen);
    return chosen;
  };
  std::optional<DispatchDecision> stored;
  if (cache != nullptr) stored = cache->find(key);
  // A stored decision was gated and raced when it was made, under a key that names every
  // candidate's source. The native path (the library's) is taken as stored. A stored fused choice
  // runs its numeric gate again, alone, before it is taken (no fused kernel replaces the native path
  // without passing it in this process); the race is not run again unless that gate fails. A
  // stored choice that names no candidate offered now is ignored.
  const FusedCandidate* stored_fused = nullptr;
  if (stored) {
    if (stored->chosen == CandidateId::native() || stored->chosen == CandidateId::native().as_graph()) {
      report.from_cache = true;
      for (const auto& [id, ms] : stored->timings_ms) report.timings_ms.emplace_back(id.name(), ms);
      return remember(finish(stored->chosen, stored->report + " (cached)"));
    }
    for (const FusedCandidate& candidate : lowered.candidates) {
      if (stored->chosen == candidate.id || stored->chosen == candidate.id.as_graph()) stored_fused = &candidate;
    }
    if (stored_fused == nullptr) stored.reset();
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
    return gate_region_outputs(sub, values.download_outputs(), reference);
  };
  const std::vector<DeviceStep> native_steps = native.graph_steps(sub, values);
  std::vector<DeviceStep> runs = {[&](const CudaStream& s) { run_steps(native_steps, s); }};
  measured[0].gate = measured[1].gate = run_and_gate(runs[0]);
  const CudaGraph native_graph = CudaGraph::capture(stream, runs[0]);
  runs.push_back([native_graph](const CudaStream& s) { native_graph.replay(s); });
  report.gates.emplace_back("native", measured[0].gate);

  // Gates one candidate and enters it, eagerly and as a CUDA graph; says whether it passed.
  auto gate_and_enter = [&](const FusedCandidate& candidate) {
    DeviceStep step;
    NumericGateResult gate;
    try {
      step = candidate.bind(values);
      gate = run_and_gate(step);
    } catch (const CudaError& error) {
      gate.detail = fmt::format("did not compile or load: {}", error.what());
    }
    report.gates.emplace_back(candidate.id.name(), gate);
    measured.push_back({candidate.id, gate, false});
    runs.push_back(step);
    measured.push_back({candidate.id.as_graph(), gate, false});
    if (gate.passed) {
      const CudaGraph fused_graph = CudaGraph::capture(stream, step);
      runs.push_back([fused_graph](const CudaStream& s) { fused_graph.replay(s); });
    } else {
      runs.push_back(step);  // never admitted: it failed the gate
    }
    return gate.passed;
  };
  std::string stored_failed;
  if (stored_fused != nullptr && !gate_and_enter(*stored_fused)) {
    stored_failed = fmt::format("the stored choice {} failed its numeric gate now, so the region was raced again; ",
                                stored->chosen.name());
    stored.reset();
  }
  if (!stored) {
    for (const FusedCandidate& candidate : lowered.candidates) {
      if (&candidate != stored_fused) gate_and_enter(candidate);
    }
  }

  const MeasuredChoice choice = choose_measured(measured, policy, stored, [&](const std::vector<int>& entrants) {
    std::vector<TournamentCandidate> race;
    for (int index : entrants) race.push_back({measured[static_cast<std::size_t>(index)].id.name(), runs[static_cast<std::size_t>(index)]});
    return run_tournament(race, stream, options.tournament).score_ms;
  });
  if (choice.chosen < 0) return remember(finish(CandidateId::native(), "native: " + choice.reason));
  if (choice.from_cache) {
    // Every candidate the stored race timed. The in-step race binds its step-race candidate (a near tie,
    // a prefetch twin: step_race_candidate) from these timings, and a stored race's runner-up has passed
    // no gate in this process: it runs its gate now, as the stored choice did, and one that fails is left
    // out (the next runner-up is asked the same), so that no fused kernel the step may run skips its gate.
    std::vector<std::pair<CandidateId, double>> timings = stored->timings_ms;
    const auto named = [&] {
      std::vector<std::pair<std::string, double>> names;
      for (const auto& [id, ms] : timings) names.emplace_back(id.name(), ms);
      return names;
    };
    const std::string chosen_name = measured[static_cast<std::size_t>(choice.chosen)].id.name();
    while (options.near_tie_margin > 0) {
      const std::optional<std::string> runner_up = step_race_candidate(named(), chosen_name, options.near_tie_margin);
      if (!runner_up) break;
      bool passed = false;
      for (const FusedCandidate& candidate : lowered.candidates) {
        if (candidate.id.name() != *runner_up) continue;
        const auto gated = std::find_if(measured.begin(), measured.end(),
                                        [&](const MeasuredCandidate& entry) { return entry.id == candidate.id; });
        passed = gated != measured.end() ? gated->gate.passed : gate_and_enter(candidate);
      }
      if (passed) break;
      // Every entry the runner-up was named from (at least one: the loop ends), by the same name rule.
      std::erase_if(timings, [&](const std::pair<CandidateId, double>& timing) {
        return eager_candidate_name(timing.first.name()) == *runner_up;
      });
    }
    report.timings_ms = named();
  } else {
    for (std::size_t i = 0; i < measured.size(); ++i) {
      if (choice.score_ms[i] >= 0) report.timings_ms.emplace_back(measured[i].id.name(), choice.score_ms[i]);
    }
  }
  report.from_cache = choice.from_cache;
  if (cache != nullptr && choice.worth_storing && !choice.from_cache) cache->store(decision_of(key, measured, choice));
  return remember(finish(measured[static_cast<std::size_t>(choice.chosen)].id,
                         stored_failed + choice.reason + (choice.from_cache ? " (cached)" : "")));
}

// Steps of regions and unfused nodes, ordered so every step runs after the producers of what it reads.
struct Unit {
  std::vector<NodeId> nodes;
  std::vector<DeviceStep> steps;
  std::string kind;  // Executable::profile's label
  std::vector<DeviceByteRange> weights;  // what its (one, fused) step streams: FusedCandidate::weights
  NearTie near_tie;  // a fused unit's one step run by its step-race candidate (none: an empty step)
};

struct OrderedSteps {
  std::vector<DeviceStep> steps;
  std::vector<std::string> kinds;
  std::vector<std::vector<DeviceByteRange>> weights;
  std::vector<bool> contracts;  // the step's unit holds a matmul or quantized_matmul (it streams weights)
  std::vector<NearTie> near_ties;
};

OrderedSteps order_units(const ComputeGraph& graph, std::vector<Unit> units) {
  std::vector<std::vector<NodeId>> kernels;
  for (const Unit& unit : units) kernels.push_back(unit.nodes);
  const Schedule order = schedule_kernels(graph, kernels);  // the one scheduler (graph.h)
  if (!order.acyclic()) throw std::runtime_error("Executable: the plan's regions depend on each other in a cycle");
  OrderedSteps ordered;
  for (std::size_t u : order.order) {
    const bool contracts = std::any_of(units[u].nodes.begin(), units[u].nodes.end(),
                                       [&](NodeId node) { return is_gemv_contraction_op(graph.node(node)); });
    for (std::size_t i = 0; i < units[u].steps.size(); ++i) {
      ordered.steps.push_back(std::move(units[u].steps[i]));
      ordered.kinds.push_back(units[u].kind);
      ordered.weights.push_back(i == 0 ? units[u].weights : std::vector<DeviceByteRange>{});
      ordered.contracts.push_back(contracts);
      ordered.near_ties.push_back(i == 0 ? units[u].near_tie : NearTie{});
    }
  }
  return ordered;
}

}  // namespace

Executable Executable::build(const FusionPlan& plan, const CudaDevice& device, const ExecutableOptions& options) {
  if (!plan.graph) throw InputError("Executable::build: the plan has no graph");
  device.make_current();
  auto state = std::make_unique<State>(device);
  state->graph = plan.graph;
  const ComputeGraph& graph = *state->graph;
  state->values = std::make_unique<DeviceValues>(graph, options.external_values);
  state->native = std::make_unique<NativeRuntime>();
  std::optional<DecisionCache> cache;
  if (options.use_decision_cache) {
    cache.emplace(options.decision_cache_file.empty() ? DecisionCache::default_path() : options.decision_cache_file);
  }

  std::vector<Unit> units;
  std::set<NodeId> covered;
  BuildMemo memo;
  auto add_region = [&](const FusionRegion& region, int region_index) {
    RegionReport report = choose_for_region(graph, region, region_index, device, options, *state->native,
                                            cache ? &*cache : nullptr, memo);
    Unit unit;
    unit.nodes = region.nodes;
    unit.kind = fmt::format("{} {}", region.rule.empty() ? "region" : region.rule,
                            candidate_kind_name(report.chosen_id.kind));
    if (report.chosen_id.kind == CandidateKind::fused) {
      // The whole plan replays as one CUDA graph: the chosen lowering binds in its eager form, and
      // with a near-tie margin its prefetch twin or the candidate its race nearly chose binds too
      // (step_race_candidate, race_near_ties).
      const std::optional<std::string> near_tie =
          options.near_tie_margin > 0 ? step_race_candidate(report.timings_ms, report.chosen, options.near_tie_margin)
                                      : std::nullopt;
      int chosen_launches = 0;
      for (FusedCandidate& candidate : lower_region(graph, region, options).candidates) {
        if (near_tie && candidate.id.name() == *near_tie) {
          unit.near_tie.step = candidate.bind(*state->values);
          unit.near_tie.id = candidate.id;
          if (candidate.weights) unit.near_tie.weights = candidate.weights(*state->values);
          unit.near_tie.extra_launches = candidate.launches;
          unit.near_tie.report = static_cast<int>(state->reports.size());
        }
        if (candidate.id != report.chosen_id.eager()) continue;
        unit.steps.push_back(candidate.bind(*state->values));
        if (candidate.weights) unit.weights = candidate.weights(*state->values);
        chosen_launches = candidate.launches;
        state->kernel_count += candidate.launches;
      }
      if (unit.near_tie.step) unit.near_tie.extra_launches -= chosen_launches;
      if (unit.steps.empty()) throw std::runtime_error(fmt::format("{}: candidate '{}' vanished", report.sentence, report.chosen));
    } else {
      std::vector<NodeId> nodes = region.nodes;
      std::sort(nodes.begin(), nodes.end());
      for (NodeId node : nodes) unit.steps.push_back(state->native->node_step(graph, node, *state->values));
      state->kernel_count += static_cast<int>(nodes.size());
    }
    covered.insert(region.nodes.begin(), region.nodes.end());
    units.push_back(std::move(unit));
    state->reports.push_back(std::move(report));
  };
  for (std::size_t r = 0; r < plan.regions.size(); ++r) add_region(plan.regions[r], static_cast<int>(r));
  // An unfused matmul / quantized_matmul (q, k, v, the LM head) races its lowerings (the GEMV)
  // against cuBLASLt like a region of its own, with the unfused RMSNorm that only it reads (the
  // final norm): those regions are made before the remaining nodes run natively, as the norm comes
  // first in graph order.
  if (options.mode != DispatchMode::native) {
    for (const Node& node : graph.nodes()) {
      if (!covered.contains(node.id) && is_gemv_contraction_op(node)) {
        add_region(contraction_node_region(graph, node.id, covered), -1);
      }
    }
  }
  for (const Node& node : graph.nodes()) {
    if (covered.contains(node.id)) continue;
    units.push_back({{node.id}, {state->native->node_step(graph, node.id, *state->values)}, node.op, {}, {}});
    state->kernel_count += 1;
  }
  OrderedSteps ordered = order_units(graph, std::move(units));
  state->steps = std::move(ordered.steps);
  state->step_kinds = std::move(ordered.kinds);
  state->step_weights = std::move(ordered.weights);
  state->step_contracts = std::move(ordered.contracts);
  state->near_ties = std::move(ordered.near_ties);
  if (options.capture_cuda_graph && !state->steps.empty()) {
    state->replay = capture_launching(state->stream, options.programmatic_dependent_launch,
                                      [&steps = state->steps](const CudaStream& stream) { run_steps(steps, stream); });
    state->programmatic_replay = options.programmatic_dependent_launch;
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

int Executable::step_count() const { return static_cast<int>(state_->steps.size()); }

std::vector<StepKindTime> Executable::profile(const CudaStream& stream) {
  state_->device.make_current();
  std::vector<CudaEvent> events(state_->steps.size() + 1);
  events[0].record(stream);
  for (std::size_t i = 0; i < state_->steps.size(); ++i) {
    state_->steps[i](stream);
    events[i + 1].record(stream);
  }
  events.back().synchronize();
  std::vector<StepKindTime> times;
  for (std::size_t i = 0; i < state_->steps.size(); ++i) {
    auto entry = std::find_if(times.begin(), times.end(),
                              [&](const StepKindTime& time) { return time.kind == state_->step_kinds[i]; });
    if (entry == times.end()) entry = times.insert(times.end(), StepKindTime{state_->step_kinds[i], 0, 0});
    entry->ms += CudaEvent::elapsed_ms(events[i], events[i + 1]);
    entry->steps += 1;
    for (const DeviceByteRange& range : state_->step_weights[i]) entry->weight_bytes += range.bytes;
  }
  std::stable_sort(times.begin(), times.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
  return times;
}

void Executable::replay_cost_by_kind(std::vector<StepKindTime>& times, const TournamentOptions& tournament) {
  State& state = *state_;
  if (!state.replay || times.empty()) return;
  state.device.make_current();
  // The replay as kept (with its dependent launches); a kept weight prefetch is not reproduced, so
  // the reference is recaptured the same way as the ablated graphs.
  const auto capture_without = [&](const std::string& left_out) {
    return capture_launching(state.stream, state.programmatic_replay, [&](const CudaStream& stream) {
      for (std::size_t i = 0; i < state.steps.size(); ++i) {
        if (state.step_kinds[i] != left_out) state.steps[i](stream);
      }
    });
  };
  // CudaGraph copies share one instantiated graph.
  const CudaGraph whole = capture_without("");
  std::vector<TournamentCandidate> candidates{{"whole step", [whole](const CudaStream& s) { whole.replay(s); }}};
  for (const StepKindTime& time : times) {
    const CudaGraph without = capture_without(time.kind);
    candidates.push_back({"without " + time.kind, [without](const CudaStream& s) { without.replay(s); }});
  }
  const TournamentResult race = run_tournament(candidates, state.stream, tournament);
  state.stream.synchronize();
  for (std::size_t k = 0; k < times.size(); ++k) times[k].replay_ms = race.score_ms[0] - race.score_ms[k + 1];
}

Executable::ReadFloors Executable::read_floors(const TournamentOptions& tournament) {
  State& state = *state_;
  ReadFloors floors;
  if (!state.replay) return floors;
  state.device.make_current();
  std::vector<DeviceRead> chain;
  std::vector<DeviceByteRange> every;
  for (const std::vector<DeviceByteRange>& ranges : state.step_weights) {
    if (ranges.empty()) continue;
    chain.emplace_back(ranges);
    every.insert(every.end(), ranges.begin(), ranges.end());
  }
  if (chain.empty()) return floors;
  const DeviceRead one(every);
  floors.kernels = static_cast<int>(chain.size());
  floors.bytes = one.bytes();
  const CudaGraph whole = state.replay;  // the replay as kept (copies share one instantiated graph)
  // Plain launches: a read kernel has no griddepcontrol, so as a programmatic dependent it would not
  // wait for the one before it at all.
  const CudaGraph chained = capture_launching(state.stream, false, [&](const CudaStream& stream) {
    for (const DeviceRead& read : chain) read.enqueue(stream);
  });
  const CudaGraph single = capture_launching(state.stream, false, [&](const CudaStream& stream) { one.enqueue(stream); });
  const TournamentResult race = run_tournament({{"whole step", [whole](const CudaStream& s) { whole.replay(s); }},
                                                {"read chain", [chained](const CudaStream& s) { chained.replay(s); }},
                                                {"one read", [single](const CudaStream& s) { single.replay(s); }}},
                                               state.stream, tournament);
  state.stream.synchronize();
  floors.replay_ms = race.score_ms[0];
  floors.chain_ms = race.score_ms[1];
  floors.one_kernel_ms = race.score_ms[2];
  return floors;
}

namespace {

// Races another capture of the same steps (same kernels, same bits) against the current replay;
// returns both scores, the other's first.
std::pair<double, double> race_against_replay(const CudaGraph& current, const CudaGraph& other, std::string other_name,
                                              const CudaStream& stream, const TournamentOptions& tournament) {
  const TournamentResult race =
      run_tournament({{"as captured", [current](const CudaStream& s) { current.replay(s); }},
                      {std::move(other_name), [other](const CudaStream& s) { other.replay(s); }}},
                     stream, tournament);
  stream.synchronize();
  return {race.score_ms[1], race.score_ms[0]};
}

}  // namespace

bool Executable::race_programmatic_replay(const TournamentOptions& tournament) {
  // After a kept weight prefetch the replay has its side stream: race launches first (the engine does).
  if (!state_->replay || state_->programmatic_replay || state_->weight_prefetch) return state_->programmatic_replay;
  state_->device.make_current();
  const CudaGraph dependent = capture_launching(
      state_->stream, true, [&steps = state_->steps](const CudaStream& stream) { run_steps(steps, stream); });
  const auto [with, without] =
      race_against_replay(state_->replay, dependent, "programmatic dependents", state_->stream, tournament);
  const bool faster = with < without;
  if (faster) state_->replay = dependent;
  state_->programmatic_replay = faster;
  state_->programmatic_race = fmt::format("programmatic dependent launch raced: {:.4f} ms with, {:.4f} ms without: {}\n",
                                          with, without, faster ? "kept" : "not kept");
  return faster;
}

int Executable::race_near_ties(const TournamentOptions& tournament) {
  State& state = *state_;
  // After a kept weight prefetch the replay has its side stream: race near ties before it.
  if (!state.replay || state.weight_prefetch) return 0;
  state.device.make_current();
  std::vector<std::string> kinds;  // kinds with a bound near tie, in step order
  for (std::size_t i = 0; i < state.steps.size(); ++i) {
    if (state.near_ties[i].step && std::find(kinds.begin(), kinds.end(), state.step_kinds[i]) == kinds.end()) {
      kinds.push_back(state.step_kinds[i]);
    }
  }
  int changed = 0;
  for (const std::string& kind : kinds) {
    std::vector<DeviceStep> trial = state.steps;
    for (std::size_t i = 0; i < trial.size(); ++i) {
      if (state.step_kinds[i] == kind && state.near_ties[i].step) trial[i] = state.near_ties[i].step;
    }
    const CudaGraph other = capture_launching(state.stream, state.programmatic_replay,
                                              [&trial](const CudaStream& stream) { run_steps(trial, stream); });
    const auto [with, without] = race_against_replay(state.replay, other, kind + " near ties", state.stream, tournament);
    // 1%: a margin, so that kernels the step cannot tell apart do not change on noise.
    const bool faster = with < 0.99 * without;
    for (std::size_t i = 0; i < trial.size(); ++i) {
      NearTie& near_tie = state.near_ties[i];
      if (state.step_kinds[i] != kind || !near_tie.step) continue;
      const std::string name = near_tie.id.name();
      RegionReport& report = state.reports[static_cast<std::size_t>(near_tie.report)];
      report.sentence += fmt::format("; raced in the step against '{}': {}", name, faster ? "'" + name + "' kept" : "kept");
      if (faster) {  // the near tie runs the step now; what ran it waits where the near tie was
        std::swap(state.steps[i], near_tie.step);
        std::swap(state.step_weights[i], near_tie.weights);
        std::swap(report.chosen_id, near_tie.id);
        report.chosen = report.chosen_id.name();
        state.kernel_count += near_tie.extra_launches;
        near_tie.extra_launches = -near_tie.extra_launches;
      }
    }
    state.near_tie_race += fmt::format("{}: the prefetch twins and near ties raced in the step: {:.4f} ms with them, "
                                       "{:.4f} ms without: {}\n", kind, with, without, faster ? "kept" : "not kept");
    if (faster) {
      state.replay = other;
      ++changed;
    }
  }
  return changed;
}

std::vector<WeightPrefetchFork> plan_weight_prefetch(const std::vector<std::optional<std::uint64_t>>& step_weight_bytes,
                                                     std::uint64_t budget) {
  std::vector<WeightPrefetchFork> forks;
  for (std::size_t gemv = 0; gemv < step_weight_bytes.size(); ++gemv) {
    const std::optional<std::uint64_t> bytes = step_weight_bytes[gemv];
    if (!bytes || *bytes <= budget) continue;  // unknown weights: nothing to request
    std::size_t fork = gemv;  // the run is [fork, gemv)
    std::uint64_t streamed = 0;
    while (fork > 0 && step_weight_bytes[fork - 1] && streamed + *step_weight_bytes[fork - 1] <= budget) {
      streamed += *step_weight_bytes[--fork];
    }
    if (fork < gemv) forks.push_back({gemv, fork, budget});
  }
  return forks;
}

bool Executable::race_weight_prefetch(const TournamentOptions& tournament, std::uint64_t l2_budget_bytes,
                                      bool keep_without_race) {
  State& state = *state_;
  if (!state.replay || state.weight_prefetch) return state.weight_prefetch;
  state.device.make_current();
  // A step whose weights are not known (a native contraction, cuBLASLt or dequantize + cuBLASLt; a
  // fused candidate that names none) streams weights all the same: none, so no run reaches across it.
  std::vector<std::optional<std::uint64_t>> step_bytes(state.steps.size(), std::uint64_t{0});
  for (std::size_t i = 0; i < state.steps.size(); ++i) {
    for (const DeviceByteRange& range : state.step_weights[i]) *step_bytes[i] += range.bytes;
    if (state.step_weights[i].empty() && state.step_contracts[i]) step_bytes[i] = std::nullopt;
  }
  std::map<std::size_t, std::vector<const L2Prefetch*>> forks;  // step index -> prefetches forked before it
  std::vector<std::shared_ptr<const L2Prefetch>> prefetches;
  std::uint64_t prefetched = 0;
  std::map<std::string, int> where;  // "KIND from FIRST KIND OF ITS RUN" -> how many, for the report
  for (const WeightPrefetchFork& fork : plan_weight_prefetch(step_bytes, l2_budget_bytes)) {
    auto prefetch = std::make_shared<const L2Prefetch>(leading_share(state.step_weights[fork.gemv], fork.bytes));
    if (prefetch->bytes() == 0) continue;
    prefetched += prefetch->bytes();
    forks[fork.fork].push_back(prefetch.get());
    prefetches.push_back(std::move(prefetch));
    ++where[fmt::format("{} from {}", state.step_kinds[fork.gemv], state.step_kinds[fork.fork])];
  }
  if (prefetches.empty()) return false;
  std::string placed;
  for (const auto& [text, count] : where) placed += fmt::format("{}{} x {}", placed.empty() ? "" : ", ", count, text);
  const std::size_t prefetch_count = prefetches.size();
  std::deque<CudaEvent> events;
  const CudaGraph prefetching = capture_launching(state.stream, state.programmatic_replay, [&](const CudaStream& stream) {
    // The capture joins the side stream back, also when a step throws: a side stream left forked
    // would stay in capture mode after the main stream's capture ended.
    const auto join = [&] {
      events.emplace_back().record(state.prefetch_stream);
      stream.wait(events.back());
    };
    bool forked = false;  // a side stream never forked is not in the capture: nothing to join
    try {
      for (std::size_t i = 0; i < state.steps.size(); ++i) {
        if (auto fork = forks.find(i); fork != forks.end()) {
          events.emplace_back().record(stream);  // the side stream waits for the steps before i only
          state.prefetch_stream.wait(events.back());
          forked = true;
          for (const L2Prefetch* prefetch : fork->second) prefetch->enqueue(state.prefetch_stream);
        }
        state.steps[i](stream);
      }
    } catch (...) {
      try {
        if (forked) join();
      } catch (...) {  // the step's error is the one to report
      }
      throw;
    }
    if (forked) join();
  });
  std::pair<double, double> scores{-1, -1};  // with, without
  if (!keep_without_race) {
    scores = race_against_replay(state.replay, prefetching, "weights prefetched", state.stream, tournament);
  }
  const bool faster = keep_without_race || scores.first < scores.second;
  if (faster) {
    state.replay = prefetching;
    state.prefetch_events = std::move(events);
    state.prefetches = std::move(prefetches);
  }
  state.weight_prefetch = faster;
  const std::string what = fmt::format("L2 weight prefetch ({} GEMVs over {:.1f} MB, {:.1f} MB a step: {})", prefetch_count,
                                       static_cast<double>(l2_budget_bytes) / 1e6, static_cast<double>(prefetched) / 1e6,
                                       placed);
  state.prefetch_race = keep_without_race ? what + ": kept without a race\n"
                                          : fmt::format("{} raced: {:.4f} ms with, {:.4f} ms without: {}\n", what,
                                                        scores.first, scores.second, faster ? "kept" : "not kept");
  return faster;
}

const std::string& Executable::near_tie_verdicts() const { return state_->near_tie_race; }

std::string Executable::report() const {
  std::string text;
  for (const RegionReport& report : state_->reports) text += report.sentence + "\n";
  text += state_->programmatic_race;
  text += state_->near_tie_race;
  text += state_->prefetch_race;
  text += fmt::format("{} kernel launches per run{}{}\n", state_->kernel_count,
                      state_->replay ? ", replayed as one CUDA graph" : "",
                      state_->programmatic_replay ? " (GEMVs and attention as programmatic dependents)" : "");
  return text;
}

}  // namespace metile
