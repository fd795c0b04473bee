// Thousands of small random graphs against independent oracles:
//  - each neighborhood's min cut equals the best legal subset found by brute force;
//  - each conflict component's selection equals the best independent set found by
//    brute force, wherever the component is bipartite or small (solved exactly);
//  - every plan is legal (disjoint, convex, acyclic between kernels) and runs on
//    the CPU reference to the unfused graph's outputs bit for bit.
#include <algorithm>
#include <limits>
#include <set>

#include <gtest/gtest.h>

#include "fusion_test_support.h"
#include "metile/cpu_runtime.h"
#include "metile/flow.h"
#include "metile/fusion.h"
#include "planner_internal.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using fusion_internal::to_picoseconds;

// Brute-force legality of a region inside a neighborhood: contains the pattern,
// avoids what the model was told to leave out, is convex, writes no escaping
// value the rule cannot write, and fits the target.
bool legal_by_definition(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule,
                         const std::vector<NodeId>& region, const std::vector<NodeId>& pattern) {
  if (!fusion_test::is_convex(graph, region)) return false;
  if (!rule.materializes_escaping_values) {
    const std::set<NodeId> inside(region.begin(), region.end());
    for (NodeId node : region) {
      if (std::find(pattern.begin(), pattern.end(), node) != pattern.end() && node != pattern.back()) continue;
      for (ValueId output : graph.node(node).outputs) {
        bool read_inside = false;
        bool read_outside = graph.is_output(output);
        for (NodeId consumer : graph.consumers(output)) (inside.count(consumer) ? read_inside : read_outside) = true;
        if (read_inside && read_outside) return false;
      }
    }
  }
  return within_limits(estimate_region(graph, region, target, rule.resources), target).ok;
}

// The largest benefit of any legal region of the neighborhood (the pattern, plus any subset of the
// considered ops), by trying every subset. Legality is legal_by_definition's alone: the model's own
// left_out list is not trusted (it once hid a re-entry path whose wrong end the model kept out).
double brute_force_best_benefit(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule,
                                const fusion_internal::NeighborhoodOutcome& outcome, const std::vector<NodeId>& pattern) {
  std::vector<NodeId> free;
  for (NodeId candidate : outcome.considered) {
    if (std::find(pattern.begin(), pattern.end(), candidate) == pattern.end()) free.push_back(candidate);
  }
  double best = -1e300;
  for (std::uint32_t mask = 0; mask < (1U << free.size()); ++mask) {
    std::vector<NodeId> region(pattern.begin(), pattern.end());
    for (std::size_t bit = 0; bit < free.size(); ++bit) {
      if (mask >> bit & 1U) region.push_back(free[bit]);
    }
    std::sort(region.begin(), region.end());
    if (!legal_by_definition(graph, target, rule, region, pattern)) continue;
    best = std::max(best, estimate_region(graph, region, target, rule.resources).benefit_ns);
  }
  return best;
}

TEST(RandomGraphs, EveryNeighborhoodCutIsTheBruteForceOptimum) {
  std::mt19937_64 random(testing::test_seed("RandomGraphs.EveryNeighborhoodCutIsTheBruteForceOptimum"));
  const FusionTarget targets[] = {FusionTarget::h200(), FusionTarget::cpu()};
  const RuleSet rules = default_rules();
  int compared = 0, inexact = 0;
  for (int round = 0; round < 1000; ++round) {
    const ComputeGraph graph = fusion_test::random_graph(random, 4 + round % 12);
    const FusionTarget& target = targets[round % 2];
    fusion_internal::NeighborhoodScratch scratch(graph);
    for (const FusionRule& rule : rules.rules) {
      for (const Node& node : graph.nodes()) {
        const auto match = fusion_internal::match_pattern(graph, rule, node.id);
        if (!match) continue;
        const std::vector<NodeId>* pattern = &match.nodes;
        const auto outcome = fusion_internal::solve_neighborhood(graph, target, rule, *pattern, 64, scratch);
        // Pruning growth that must re-enter changes the model's size, never its answer.
        scratch.prune_certain_reentry = false;
        const auto unpruned = fusion_internal::solve_neighborhood(graph, target, rule, *pattern, 64, scratch);
        scratch.prune_certain_reentry = true;
        ASSERT_EQ(outcome.region, unpruned.region) << rule.name << " at " << node.name << "\n" << write_graph_json(graph);
        ASSERT_EQ(outcome.decision.ok, unpruned.decision.ok);
        ASSERT_EQ(outcome.decision.reason, unpruned.decision.reason);
        if (!outcome.decision || outcome.considered.size() > 14) continue;
        ASSERT_TRUE(legal_by_definition(graph, target, rule, outcome.region, *pattern)) << rule.name;
        const double best = brute_force_best_benefit(graph, target, rule, outcome, *pattern);
        const double found = estimate_region(graph, outcome.region, target, rule.resources).benefit_ns;
        // Capacities are whole picoseconds: allow one per edge the rounding touched. Where a fallback
        // ran (a resource limit dropped ops farthest first, or over six choice paths kept their
        // consumer-side ends out) the region is legal but may not be the best.
        if (!outcome.exact) {
          ++inexact;
          continue;
        }
        EXPECT_GE(found, best - 0.05) << rule.name << " at " << node.name << "\n" << write_graph_json(graph);
        ++compared;
      }
    }
  }
  std::printf("%d neighborhoods against the brute force, %d not exact (a resource limit or over six choice paths; not compared)\n", compared,
              inexact);
  EXPECT_GT(compared, 1500);
}

// A pinned graph's residual add + RMSNorm neighborhood at rms_norm_1 (h200): exact, the expected
// region, and no subset of the neighborhood better.
void expect_pinned_region(const ComputeGraph& graph, const std::vector<std::string>& expected) {
  const FusionTarget target = FusionTarget::h200();
  const FusionRule rule = residual_add_rms_norm_rule();
  const auto match = fusion_internal::match_pattern(graph, rule, *graph.find_node("rms_norm_1"));
  ASSERT_TRUE(match.decision.ok) << match.decision.reason;
  fusion_internal::NeighborhoodScratch scratch(graph);
  const auto outcome = fusion_internal::solve_neighborhood(graph, target, rule, match.nodes, 64, scratch);
  ASSERT_TRUE(outcome.decision.ok) << outcome.decision.reason;
  EXPECT_TRUE(outcome.exact);
  std::vector<std::string> names;
  for (NodeId node : outcome.region) names.push_back(graph.node(node).name);
  EXPECT_EQ(names, expected);
  const double best = brute_force_best_benefit(graph, target, rule, outcome, match.nodes);
  EXPECT_GE(estimate_region(graph, outcome.region, target, rule.resources).benefit_ns, best - 0.05);
}

// Regression: round 586 of the test above with METILE_TEST_SEED=14161574311039533052 (h200). A
// re-entry path from a growth op that must stay out (subtract_0 -> layer_norm_0 -> multiply_0 ->
// add_1) once forbade its other end too, pushing the legal epilogue add_1, scale_2, multiply_1 out
// of the region. The graph is pinned as that seed generated it, so the generator may change.
TEST(RandomGraphs, PinnedSeedResidualNormTakesItsWholeEpilogue) {
  const ComputeGraph graph = parse_graph_json(R"({
    "inputs": [
      {"name": "x", "shape": [2, 32], "dtype": "f32"}, {"name": "x2", "shape": [2, 32], "dtype": "f32"},
      {"name": "in0", "shape": [32], "dtype": "f32"}, {"name": "in1", "shape": [32], "dtype": "f32"},
      {"name": "in2", "shape": [32], "dtype": "f32"}, {"name": "in3", "shape": [32], "dtype": "f32"},
      {"name": "in4", "shape": [32], "dtype": "f32"}, {"name": "in5", "shape": [32, 64], "dtype": "f32"}
    ],
    "nodes": [
      {"name": "rms_norm_0", "op": "rms_norm", "inputs": ["x", "in0"], "attrs": {"eps": 1e-05}},
      {"name": "scale_0", "op": "scale", "inputs": ["x"], "attrs": {"factor": 0.5}},
      {"name": "subtract_0", "op": "subtract", "inputs": ["x2", "scale_0"]},
      {"name": "layer_norm_0", "op": "layer_norm", "inputs": ["subtract_0", "in2", "in1"], "attrs": {"eps": 1e-05}},
      {"name": "add_0", "op": "add", "inputs": ["subtract_0", "layer_norm_0"]},
      {"name": "rms_norm_1", "op": "rms_norm", "inputs": ["add_0", "in3"], "attrs": {"eps": 1e-05}},
      {"name": "scale_1", "op": "scale", "inputs": ["in4"], "attrs": {"factor": 2.0}},
      {"name": "multiply_0", "op": "multiply", "inputs": ["layer_norm_0", "scale_1"]},
      {"name": "reshape_0", "op": "reshape", "inputs": ["multiply_0"], "attrs": {"shape": [2, 32]}},
      {"name": "matmul_0", "op": "matmul", "inputs": ["add_0", "in5"], "attrs": {"transpose_right": 0}},
      {"name": "add_1", "op": "add", "inputs": ["rms_norm_1", "multiply_0"]},
      {"name": "silu_0", "op": "silu", "inputs": ["matmul_0"]},
      {"name": "scale_2", "op": "scale", "inputs": ["add_1"], "attrs": {"factor": 0.5}},
      {"name": "multiply_1", "op": "multiply", "inputs": ["add_1", "scale_2"]}
    ],
    "outputs": ["rms_norm_0", "reshape_0", "matmul_0", "silu_0", "multiply_1"]
  })", "seed 14161574311039533052, round 586");
  expect_pinned_region(graph, {"add_0", "rms_norm_1", "add_1", "scale_2", "multiply_1"});
}

// Regression: round 596 with METILE_TEST_SEED=3 (h200), found by a brute force that no longer trusts
// the model's left_out list. A path from the prologue op add_0 leaves through reshape_0 and comes
// back at the epilogue op add_2: the two cannot both join. The model kept add_2 out (its
// consumer-side rule), losing add_3 and gelu_0 with it (5000 ns); keeping add_0 out instead saves
// two launches (10000 ns). Both ways are solved now and the better one kept.
TEST(RandomGraphs, PinnedSeedReentryKeepsTheCheaperEndOut) {
  const ComputeGraph graph = parse_graph_json(R"({
    "inputs": [
      {"name": "x", "shape": [2, 32], "dtype": "f32"}, {"name": "in0", "shape": [32, 8], "dtype": "u32"},
      {"name": "in1", "shape": [32, 1], "dtype": "f32"}, {"name": "in2", "shape": [32, 1], "dtype": "f32"},
      {"name": "in3", "shape": [2, 32], "dtype": "f32"}, {"name": "in4", "shape": [32], "dtype": "f32"},
      {"name": "in5", "shape": [32], "dtype": "f32"}, {"name": "in6", "shape": [32], "dtype": "f32"},
      {"name": "in7", "shape": [32], "dtype": "f32"}
    ],
    "nodes": [
      {"name": "subtract_0", "op": "subtract", "inputs": ["x", "x"]},
      {"name": "quantized_matmul_0", "op": "quantized_matmul", "inputs": ["x", "in0", "in1", "in2"], "attrs": {"bits": 8, "group_size": 32}},
      {"name": "multiply_0", "op": "multiply", "inputs": ["x", "in3"]},
      {"name": "add_0", "op": "add", "inputs": ["quantized_matmul_0", "in4"]},
      {"name": "rms_norm_0", "op": "rms_norm", "inputs": ["quantized_matmul_0", "in5"], "attrs": {"eps": 1e-05}},
      {"name": "add_1", "op": "add", "inputs": ["rms_norm_0", "add_0"]},
      {"name": "reshape_0", "op": "reshape", "inputs": ["add_0"], "attrs": {"shape": [2, 32]}},
      {"name": "rms_norm_1", "op": "rms_norm", "inputs": ["add_1", "in6"], "attrs": {"eps": 1e-05}},
      {"name": "scale_0", "op": "scale", "inputs": ["add_1"], "attrs": {"factor": 0.5}},
      {"name": "add_2", "op": "add", "inputs": ["reshape_0", "rms_norm_1"]},
      {"name": "add_3", "op": "add", "inputs": ["add_2", "in7"]},
      {"name": "gelu_0", "op": "gelu", "inputs": ["add_3"], "attrs": {"approximate": "none"}}
    ],
    "outputs": ["subtract_0", "quantized_matmul_0", "multiply_0", "rms_norm_0", "scale_0", "gelu_0"]
  })", "seed 3, round 596");
  expect_pinned_region(graph, {"add_1", "rms_norm_1", "add_2", "add_3", "gelu_0"});
}

// A small conflict graph with integer weights: random, bipartite or an odd cycle.
struct ConflictCase {
  std::vector<std::int64_t> weights;
  std::vector<std::vector<int>> conflicts;
};

ConflictCase random_conflicts(std::mt19937_64& random, int count, bool bipartite) {
  ConflictCase result;
  std::uniform_int_distribution<std::int64_t> weight(1, 50);
  for (int k = 0; k < count; ++k) result.weights.push_back(weight(random));
  result.conflicts.resize(static_cast<std::size_t>(count));
  std::bernoulli_distribution edge(0.3);
  for (int a = 0; a < count; ++a) {
    for (int b = a + 1; b < count; ++b) {
      if (bipartite && (a % 2) == (b % 2)) continue;
      if (!edge(random)) continue;
      result.conflicts[static_cast<std::size_t>(a)].push_back(b);
      result.conflicts[static_cast<std::size_t>(b)].push_back(a);
    }
  }
  return result;
}

// The pairwise lists as conflict groups of two.
ConflictGroups groups_of_lists(const std::vector<std::vector<int>>& lists) {
  ConflictGroups groups(lists.size());
  for (std::size_t a = 0; a < lists.size(); ++a) {
    for (int b : lists[a]) groups.add_group({static_cast<int>(a), b});
  }
  return groups;
}

std::int64_t best_independent_set(const ConflictCase& problem) {
  const std::size_t count = problem.weights.size();
  std::int64_t best = 0;
  for (std::uint32_t mask = 0; mask < (1U << count); ++mask) {
    std::int64_t total = 0;
    bool independent = true;
    for (std::size_t a = 0; a < count && independent; ++a) {
      if (!(mask >> a & 1U)) continue;
      total += problem.weights[a];
      for (int b : problem.conflicts[a]) independent = independent && !(mask >> b & 1U);
    }
    if (independent) best = std::max(best, total);
  }
  return best;
}

// The cost model's estimate by its definition, written apart from RegionEstimator: sets of nodes
// and values, recounted from nothing (the oracle of the removals below).
RegionEstimate estimate_by_definition(const ComputeGraph& graph, const std::vector<NodeId>& nodes,
                                      const FusionTarget& target, const ResourceNeeds& needs) {
  const std::set<NodeId> region(nodes.begin(), nodes.end());
  const auto inside = [&](NodeId node) { return region.count(node) != 0; };
  std::int64_t unfused = 0, fused = 0, on_chip = 0, registers = needs.base_registers, shared = 0;
  std::set<ValueId> inputs, outputs;
  for (NodeId id : region) {
    const Node& node = graph.node(id);
    for (ValueId input : std::set<ValueId>(node.inputs.begin(), node.inputs.end())) {
      unfused += graph.value(input).spec.bytes();
      if (!inside(graph.value(input).producer)) inputs.insert(input);
    }
    for (ValueId output : node.outputs) {
      unfused += graph.value(output).spec.bytes();
      on_chip += graph.value(output).spec.bytes();
      bool leaves = graph.is_output(output);
      for (NodeId reader : graph.consumers(output)) leaves = leaves || !inside(reader);
      if (leaves) outputs.insert(output);
    }
    const bool quantized = std::any_of(node.inputs.begin(), node.inputs.end(),
                                       [&](ValueId input) { return !is_floating(graph.value(input).spec.dtype); });
    switch (node.kind) {
      case OpKind::elementwise:
      case OpKind::layout: registers += needs.registers_per_elementwise; break;
      case OpKind::row_reduction: registers += needs.registers_per_row_reduction; break;
      case OpKind::contraction:
        registers += quantized ? needs.registers_per_quantized_contraction : needs.registers_per_contraction;
        break;
    }
    if (node.inputs.empty() || !inside(graph.value(node.inputs[0]).producer)) continue;
    const TensorSpec& staged = graph.value(node.inputs[0]).spec;
    if (node.kind == OpKind::row_reduction && needs.stages_reduction_rows) shared += staged.row_length() * 4;
    if (node.kind == OpKind::contraction && needs.stages_contraction_activations) shared += staged.bytes();
  }
  for (ValueId value : inputs) fused += graph.value(value).spec.bytes();
  for (ValueId value : outputs) fused += graph.value(value).spec.bytes();
  RegionEstimate estimate;
  estimate.input_count = static_cast<int>(inputs.size());
  estimate.output_count = static_cast<int>(outputs.size());
  estimate.shared_memory_bytes = shared;
  estimate.registers_per_thread = static_cast<int>(std::min<std::int64_t>(registers, std::numeric_limits<int>::max()));
  const double bandwidth = target.memory_bandwidth_bytes_per_ns;
  estimate.unfused_ns = static_cast<double>(region.size()) * target.launch_overhead_ns + static_cast<double>(unfused) / bandwidth;
  estimate.fused_ns = target.launch_overhead_ns + static_cast<double>(fused) / bandwidth +
                      static_cast<double>(on_chip) / target.on_chip_bandwidth_bytes_per_ns;
  estimate.benefit_ns = estimate.unfused_ns - estimate.fused_ns;
  estimate.memory_bytes_avoided = unfused - fused;
  return estimate;
}

// Graphs of ops with several outputs, which the planner's random graphs lack: "estimator_test_pair"
// (registered here; a row reduction, so it stages its first input when that is computed inside; two
// outputs of its first input's spec) mixed with adds and RMSNorms, each reading values drawn from any
// before it, some one value twice, some both outputs of one pair.
ComputeGraph graph_of_several_outputs(std::mt19937_64& random) {
  if (find_op("estimator_test_pair") == nullptr) {
    OpDefinition pair;
    pair.name = "estimator_test_pair";
    pair.kind = OpKind::row_reduction;
    pair.input_names = {"a", "b"};
    pair.infer = [](std::span<const TensorSpec> inputs, Attributes&) {
      return std::vector<TensorSpec>{inputs[0], inputs[0]};
    };
    register_op(std::move(pair));
  }
  GraphBuilder builder;
  std::vector<ValueRef> values{builder.input("x", {{4, 16}, DType::f32}), builder.input("y", {{4, 16}, DType::f32})};
  const ValueRef weight = builder.input("weight", {{16}, DType::f32});
  const auto any = [&] { return values[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(random)]; };
  std::vector<std::vector<ValueRef>> pairs;
  const int ops = std::uniform_int_distribution<int>(3, 16)(random);
  for (int op = 0; op < ops; ++op) {
    switch (random() % 3) {
      case 0: {
        std::vector<ValueRef> read{any(), any()};
        if (random() % 3 == 0) read[1] = read[0];
        if (!pairs.empty() && random() % 3 == 0) read = pairs[random() % pairs.size()];
        pairs.push_back(builder.add_node("estimator_test_pair", read, {}));
        values.insert(values.end(), pairs.back().begin(), pairs.back().end());
        break;
      }
      case 1: values.push_back(builder.add(any(), any())); break;
      default: values.push_back(builder.rms_norm(any(), weight, 1e-5)); break;
    }
  }
  std::vector<ValueRef> outputs{values.back()};
  for (std::size_t k = 2; k + 1 < values.size(); ++k) {
    if (random() % 4 == 0) outputs.push_back(values[k]);
  }
  return builder.build(outputs);
}

// RegionEstimator's one-op removals (the neighborhood model's drop trials and the ops each next cut
// leaves out) against the estimate by definition of the smaller region: every figure equal, bit for
// bit, so that the drops choose what fresh estimates chose. Regions are random subsets (not convex,
// graph outputs inside, contractions and row reductions staging or not, register needs that pass
// int's range now and then, ops of two outputs in every third graph), the removals in random order.
TEST(RandomGraphs, RegionEstimatorRemovalsEqualFreshEstimates) {
  std::mt19937_64 random(testing::test_seed("RandomGraphs.RegionEstimatorRemovalsEqualFreshEstimates"));
  const FusionTarget target = FusionTarget::h200();
  const auto expect_same = [](const RegionEstimate& got, const RegionEstimate& fresh, const std::string& where) {
    EXPECT_EQ(got.unfused_ns, fresh.unfused_ns) << where;
    EXPECT_EQ(got.fused_ns, fresh.fused_ns) << where;
    EXPECT_EQ(got.benefit_ns, fresh.benefit_ns) << where;
    EXPECT_EQ(got.memory_bytes_avoided, fresh.memory_bytes_avoided) << where;
    EXPECT_EQ(got.registers_per_thread, fresh.registers_per_thread) << where;
    EXPECT_EQ(got.shared_memory_bytes, fresh.shared_memory_bytes) << where;
    EXPECT_EQ(got.input_count, fresh.input_count) << where;
    EXPECT_EQ(got.output_count, fresh.output_count) << where;
  };
  int staged_removals = 0;
  int clamped = 0;
  for (int trial = 0; trial < 150; ++trial) {
    const ComputeGraph graph = trial % 3 == 2 ? graph_of_several_outputs(random)
                                              : fusion_test::random_graph(random, std::uniform_int_distribution<int>(4, 40)(random));
    const fusion_internal::GraphIndex index(graph);
    ResourceNeeds needs;
    needs.stages_reduction_rows = random() % 2 == 0;
    needs.stages_contraction_activations = random() % 2 == 0;
    if (trial % 5 == 0) needs.registers_per_elementwise = std::numeric_limits<int>::max() / 4;
    std::vector<NodeId> region;
    for (const Node& node : graph.nodes()) {
      if (random() % 3 != 0) region.push_back(node.id);
    }
    if (region.empty()) continue;
    fusion_internal::RegionEstimator estimator(graph, region, target, needs, index.value_is_output);
    expect_same(estimator.estimate(), estimate_by_definition(graph, region, target, needs), "whole region");
    std::shuffle(region.begin(), region.end(), random);
    while (!region.empty()) {
      for (NodeId op : region) {
        std::vector<NodeId> rest;
        for (NodeId other : region) {
          if (other != op) rest.push_back(other);
        }
        const std::string where = "trial " + std::to_string(trial) + ", without " + graph.node(op).name;
        expect_same(estimator.without(op), estimate_by_definition(graph, rest, target, needs), where);
      }
      const RegionEstimate before = estimator.estimate();
      estimator.remove(region.back());
      region.pop_back();
      staged_removals += static_cast<int>(estimator.estimate().shared_memory_bytes != before.shared_memory_bytes);
      clamped += static_cast<int>(before.registers_per_thread == std::numeric_limits<int>::max());
      expect_same(estimator.estimate(), estimate_by_definition(graph, region, target, needs),
                  "trial " + std::to_string(trial) + ", after a removal");
      EXPECT_EQ(estimator.region(), [&] {
        std::vector<NodeId> sorted = region;
        std::sort(sorted.begin(), sorted.end());
        return sorted;
      }());
    }
    if (::testing::Test::HasFailure()) break;  // one trial's messages, not 150
  }
  // The staging terms and the saturated register sum were exercised.
  EXPECT_GT(staged_removals, 10);
  EXPECT_GT(clamped, 10);
}

TEST(ConflictSelection, ExactComponentsMatchBruteForce) {
  std::mt19937_64 random(testing::test_seed("ConflictSelection.ExactComponentsMatchBruteForce"));
  for (int round = 0; round < 600; ++round) {
    const ConflictCase problem = random_conflicts(random, 2 + round % 13, round % 2 == 0);
    const auto outcome = fusion_internal::select_candidates(problem.weights, groups_of_lists(problem.conflicts), 24);
    std::int64_t total = 0;
    for (std::size_t a = 0; a < problem.weights.size(); ++a) {
      if (!outcome.selected[a]) continue;
      total += problem.weights[a];
      for (int b : problem.conflicts[a]) ASSERT_FALSE(outcome.selected[static_cast<std::size_t>(b)]);
    }
    EXPECT_EQ(total, best_independent_set(problem)) << "round " << round;
    for (const ConflictComponent& component : outcome.components) {
      if (round % 2 == 0) {
        EXPECT_TRUE(component.bipartite);
      }
      EXPECT_NE(component.method, "greedy");
    }
  }
}

// Groups of two to five candidates (every two of a group conflict), as the planner makes them when
// several candidates hold one op: the exact methods against brute force over the pairs the groups
// imply; greedy (the exact bound cut to one) independent and maximal.
TEST(ConflictSelection, GroupsOfSeveralCandidatesMatchBruteForce) {
  const std::uint64_t seed = testing::test_seed("ConflictSelection.GroupsOfSeveralCandidatesMatchBruteForce");
  std::mt19937_64 random(seed);
  int several = 0;
  for (int round = 0; round < 400; ++round) {
    const int count = 2 + round % 12;
    ConflictCase problem;
    std::uniform_int_distribution<std::int64_t> weight(1, 50);
    for (int k = 0; k < count; ++k) problem.weights.push_back(weight(random));
    ConflictGroups groups(static_cast<std::size_t>(count));
    const int group_count = std::uniform_int_distribution<int>(0, count)(random);
    for (int g = 0; g < group_count; ++g) {
      std::vector<int> members;
      const int size = std::uniform_int_distribution<int>(1, std::min(count, 5))(random);
      for (int m = 0; m < size; ++m) members.push_back(std::uniform_int_distribution<int>(0, count - 1)(random));
      groups.add_group(members);
    }
    problem.conflicts.resize(static_cast<std::size_t>(count));
    for (const std::vector<int>& group : groups.groups()) {
      ASSERT_GE(group.size(), 2u);
      ASSERT_TRUE(std::is_sorted(group.begin(), group.end()));
      several += group.size() > 2;
      for (int a : group) {
        for (int b : group) {
          if (a != b) problem.conflicts[static_cast<std::size_t>(a)].push_back(b);
        }
      }
    }
    for (int a = 0; a < count; ++a) {
      std::vector<int>& list = problem.conflicts[static_cast<std::size_t>(a)];
      std::sort(list.begin(), list.end());
      list.erase(std::unique(list.begin(), list.end()), list.end());
      ASSERT_EQ(groups.conflicts_of(a), list) << "seed " << seed << " round " << round;
      for (int b = 0; b < count; ++b) {
        ASSERT_EQ(groups.conflict(a, b), std::binary_search(list.begin(), list.end(), b)) << "seed " << seed;
      }
    }
    for (const int bound : {24, 1}) {
      const auto outcome = fusion_internal::select_candidates(problem.weights, groups, bound);
      std::int64_t total = 0;
      for (int a = 0; a < count; ++a) {
        const bool taken = outcome.selected[static_cast<std::size_t>(a)];
        total += taken ? problem.weights[static_cast<std::size_t>(a)] : 0;
        bool blocked = false;
        for (int b : problem.conflicts[static_cast<std::size_t>(a)]) {
          ASSERT_FALSE(taken && outcome.selected[static_cast<std::size_t>(b)]) << "seed " << seed << " round " << round;
          blocked = blocked || outcome.selected[static_cast<std::size_t>(b)];
        }
        ASSERT_TRUE(taken || blocked) << "not maximal: seed " << seed << " round " << round;
      }
      if (bound == 24) {
        EXPECT_EQ(total, best_independent_set(problem)) << "seed " << seed << " round " << round;
      }
      for (const ConflictComponent& component : outcome.components) {
        // A group of three is a triangle: no component holding one is bipartite.
        bool triangle = false;
        for (int member : component.candidates) {
          for (int group : groups.groups_of(member)) triangle = triangle || groups.groups()[static_cast<std::size_t>(group)].size() > 2;
        }
        if (triangle) {
          EXPECT_FALSE(component.bipartite);
        }
      }
    }
  }
  EXPECT_GT(several, 100);
}

TEST(ConflictSelection, ConflictGroupsKeepEachGroupOnceAndAppendShifted) {
  ConflictGroups groups(4);
  EXPECT_TRUE(groups.add_group({2, 0, 1, 2}));
  EXPECT_FALSE(groups.add_group({1, 2, 0}));   // the same group
  EXPECT_FALSE(groups.add_group({3}));         // fewer than two
  EXPECT_TRUE(groups.add_group({3, 2}));
  EXPECT_THROW(groups.add_group({0, 4}), std::out_of_range);
  EXPECT_EQ(groups.groups(), (std::vector<std::vector<int>>{{0, 1, 2}, {2, 3}}));
  EXPECT_EQ(groups.groups_of(2), (std::vector<int>{0, 1}));
  EXPECT_EQ(groups.conflicts_of(2), (std::vector<int>{0, 1, 3}));
  EXPECT_FALSE(groups.conflict(0, 3));
  ConflictGroups later(2);
  later.add_group({0, 1});
  groups.append(later);
  EXPECT_EQ(groups.candidate_count(), 6u);
  EXPECT_EQ(groups.groups().back(), (std::vector<int>{4, 5}));
  EXPECT_EQ(groups.groups_of(5), (std::vector<int>{2}));
  EXPECT_FALSE(groups.conflict(3, 4));
  EXPECT_FALSE(groups.add_group({5, 4}));  // an appended group is found again
  groups.append(groups);  // itself: from a copy
  EXPECT_EQ(groups.candidate_count(), 12u);
  EXPECT_EQ(groups.groups().back(), (std::vector<int>{10, 11}));
  EXPECT_EQ(groups.conflicts_of(8), (std::vector<int>{6, 7, 9}));
  EXPECT_FALSE(groups.add_group({11, 10}));
  EXPECT_TRUE(groups.add_group({0, 1}));  // inside {0, 1, 2}, yet a group of its own (changes no selection)
}

// Weights within kIntegerCapacitySumLimit whose min-cut network the flow library cannot carry (each
// infinite edge's capacity is their sum + 1): the component is solved as a non-bipartite one, exactly
// when small, instead of the flow library's error (found by an adversarial test, session 45).
TEST(ConflictSelection, BipartiteWeightsTooLargeForTheCutAreSolvedWithoutIt) {
  // A path of sets {i, i + 1}: bipartite. Three sets of 2^59: exact, the two outer ones.
  const std::vector<std::vector<NodeId>> three = {{0, 1}, {1, 2}, {2, 3}};
  const std::vector<std::int64_t> heavy(3, std::int64_t{1} << 59);
  const NodeSetSelection small = select_disjoint_node_sets(4, three, heavy);
  ASSERT_EQ(small.components.size(), 1u);
  EXPECT_TRUE(small.components[0].bipartite);
  EXPECT_EQ(small.components[0].method, "branch_and_bound");
  EXPECT_EQ(small.selected, (std::vector<bool>{true, false, true}));
  // 3,000 sets of 2^40 (sum 3.3e15, far within the limit): beyond the exact bound, greedy, disjoint.
  std::vector<std::vector<NodeId>> path;
  for (int i = 0; i < 3000; ++i) path.push_back({i, i + 1});
  const NodeSetSelection large = select_disjoint_node_sets(3001, path, std::vector<std::int64_t>(3000, std::int64_t{1} << 40));
  ASSERT_EQ(large.components.size(), 1u);
  EXPECT_EQ(large.components[0].method, "greedy");
  for (int i = 0; i + 1 < 3000; ++i) {
    ASSERT_FALSE(large.selected[static_cast<std::size_t>(i)] && large.selected[static_cast<std::size_t>(i) + 1]) << i;
  }
  // The same path at weight 1 stays a min cut.
  EXPECT_EQ(select_disjoint_node_sets(3001, path, std::vector<std::int64_t>(3000, 1)).components[0].method, "min_cut");
}

TEST(ConflictSelection, MiddleLosesToOuterPairAndOddCycleIsExact) {
  // 0 - 1 - 2: the middle (weight 5) against two outer ones (3 + 3).
  const std::vector<std::int64_t> path_weights = {3, 5, 3};
  const auto path = fusion_internal::select_candidates(path_weights, groups_of_lists({{1}, {0, 2}, {1}}), 24);
  EXPECT_EQ(path.selected, (std::vector<bool>{true, false, true}));
  EXPECT_EQ(path.components.at(0).method, "min_cut");
  // A five-cycle is not bipartite; at most two non-adjacent members. The best
  // pair is {0, 3} (6 + 6), which greedy misses by taking the heaviest (4) first.
  const std::vector<std::int64_t> cycle_weights = {6, 1, 1, 6, 7};
  const auto cycle = fusion_internal::select_candidates(cycle_weights, groups_of_lists({{1, 4}, {0, 2}, {1, 3}, {2, 4}, {3, 0}}), 24);
  EXPECT_EQ(cycle.components.at(0).method, "branch_and_bound");
  EXPECT_FALSE(cycle.components.at(0).bipartite);
  EXPECT_EQ(cycle.selected, (std::vector<bool>{true, false, false, true, false}));
  // Too large for the exact search: greedy, still independent and maximal.
  const auto greedy = fusion_internal::select_candidates(cycle_weights, groups_of_lists({{1, 4}, {0, 2}, {1, 3}, {2, 4}, {3, 0}}), 4);
  EXPECT_EQ(greedy.components.at(0).method, "greedy");
  // Heaviest first (4, blocking 3 and 0), then the heaviest still free (1, before 2 on a tie).
  EXPECT_EQ(greedy.selected, (std::vector<bool>{false, true, false, false, true}));
}

TEST(ConflictSelection, NodeListedTwiceInOneSetIsNoSelfConflict) {
  // Sets {i, i + 1} conflict along a path (bipartite, so one min cut at any length), here longer
  // than the exact search's bound. Listing a node twice in a set must not change the problem.
  std::mt19937_64 random(testing::test_seed("ConflictSelection.NodeListedTwiceInOneSetIsNoSelfConflict"));
  for (int round = 0; round < 200; ++round) {
    const int count = std::uniform_int_distribution<int>(25, 40)(random);
    std::vector<std::vector<NodeId>> sets;
    std::vector<std::int64_t> weights;
    std::bernoulli_distribution repeat(0.2);
    for (int i = 0; i < count; ++i) {
      sets.push_back({i, i + 1});
      if (repeat(random)) sets.back().push_back(repeat(random) ? i : i + 1);
      weights.push_back(std::uniform_int_distribution<std::int64_t>(1, 50)(random));
    }
    // Maximum-weight independent set on a path by dynamic programming.
    std::int64_t with_last = 0;
    std::int64_t without_last = 0;
    for (const std::int64_t weight : weights) {
      const std::int64_t taken = without_last + weight;
      without_last = std::max(with_last, without_last);
      with_last = taken;
    }
    const std::int64_t best = std::max(with_last, without_last);
    const NodeSetSelection selection = select_disjoint_node_sets(static_cast<std::size_t>(count) + 1, sets, weights);
    ASSERT_EQ(selection.components.size(), 1U);
    EXPECT_TRUE(selection.components[0].bipartite) << "round " << round;
    std::int64_t total = 0;
    for (int i = 0; i < count; ++i) {
      if (!selection.selected[static_cast<std::size_t>(i)]) continue;
      total += weights[static_cast<std::size_t>(i)];
      if (i + 1 < count) {
        ASSERT_FALSE(selection.selected[static_cast<std::size_t>(i) + 1]) << "round " << round;
      }
    }
    EXPECT_EQ(total, best) << "round " << round;
  }
}

TEST(ConflictSelection, ExactComponentBoundOutsideRuleSetsRangeIsRefused) {
  // Odd cycles of sets are no bipartite components. Allowed a bound of 100, one of 65 sets went to
  // the exact search, whose masks shift past their width beyond 64 members, and which runs for
  // minutes well before that; the bound is refused whatever the sets.
  auto odd_cycle = [](int count) {
    std::vector<std::vector<NodeId>> sets;
    for (int i = 0; i < count; ++i) sets.push_back({i, (i + 1) % count});
    return sets;
  };
  const std::vector<std::vector<NodeId>> small = odd_cycle(5);
  const std::vector<std::int64_t> small_weights(small.size(), 1);
  for (const int bound : {-1, 0, 41, 64, 100}) {
    EXPECT_THROW(select_disjoint_node_sets(small.size(), small, small_weights, bound), std::invalid_argument)
        << bound;
  }
  const std::vector<std::vector<NodeId>> large = odd_cycle(65);
  const std::vector<std::int64_t> large_weights(large.size(), 1);
  EXPECT_EQ(select_disjoint_node_sets(large.size(), large, large_weights, 40).components.at(0).method, "greedy");
}

TEST(ConflictSelection, WeightsSummingPastTheCapacityLimitAreRefused) {
  // A five-cycle goes to branch and bound, which adds weights in int64: weights this large
  // overflowed it into a wrong selection (often nothing at all) instead of an error.
  std::mt19937_64 random(testing::test_seed("ConflictSelection.WeightsSummingPastTheCapacityLimitAreRefused"));
  const std::vector<std::vector<int>> cycle = {{1, 4}, {0, 2}, {1, 3}, {2, 4}, {3, 0}};
  for (int round = 0; round < 50; ++round) {
    std::vector<std::int64_t> huge;
    for (int i = 0; i < 5; ++i) {
      huge.push_back(std::uniform_int_distribution<std::int64_t>(std::int64_t{1} << 61, INT64_MAX)(random));
    }
    EXPECT_THROW(fusion_internal::select_candidates(huge, groups_of_lists(cycle), 24), std::invalid_argument) << "round " << round;
    // Just within the limit: exact, as for small weights.
    std::vector<std::int64_t> large;
    for (int i = 0; i < 5; ++i) {
      large.push_back(std::uniform_int_distribution<std::int64_t>(1, kIntegerCapacitySumLimit / 5)(random));
    }
    const auto outcome = fusion_internal::select_candidates(large, groups_of_lists(cycle), 24);
    std::int64_t total = 0;
    for (std::size_t i = 0; i < large.size(); ++i) total += outcome.selected[i] ? large[i] : 0;
    EXPECT_EQ(total, best_independent_set({large, cycle})) << "round " << round;
  }
}

TEST(RandomGraphs, PlansAreLegalOptimalPerComponentAndRunBitForBit) {
  std::mt19937_64 random(testing::test_seed("RandomGraphs.PlansAreLegalOptimalPerComponentAndRunBitForBit"));
  int exact_components = 0;
  int multi_candidate_components = 0;
  int plans_of_several_rounds = 0;
  for (int round = 0; round < 2000; ++round) {
    const ComputeGraph graph = fusion_test::random_graph(random, 3 + round % 28);
    const FusionPlan plan = plan_graph_fusion(graph, round % 3 == 0 ? FusionTarget::cpu() : FusionTarget::h200());
    ASSERT_EQ(fusion_test::plan_problems(plan), "") << write_graph_json(graph);

    // Every overlap between candidates of one selection round is a conflict, conflicts are symmetric,
    // and candidates of different rounds never conflict: a later round's hold no op of a region chosen
    // before it.
    const auto round_of = [&](const FusionCandidate& candidate) {
      return plan.components[static_cast<std::size_t>(candidate.component)].round;
    };
    int rounds = 1;
    for (std::size_t a = 0; a < plan.candidates.size(); ++a) {
      const FusionCandidate& first = plan.candidates[a];
      rounds = std::max(rounds, round_of(first));
      for (std::size_t b = 0; b < plan.candidates.size(); ++b) {
        if (a == b) continue;
        const FusionCandidate& second = plan.candidates[b];
        std::vector<NodeId> shared;
        std::set_intersection(first.nodes.begin(), first.nodes.end(), second.nodes.begin(), second.nodes.end(),
                              std::back_inserter(shared));
        const bool listed = plan.conflicts.conflict(static_cast<int>(a), static_cast<int>(b));
        if (round_of(first) != round_of(second)) {
          ASSERT_FALSE(listed);
          // The later one holds no op of the earlier one's region.
          const FusionCandidate& earlier = round_of(first) < round_of(second) ? first : second;
          ASSERT_TRUE(earlier.region < 0 || shared.empty()) << write_graph_json(graph);
        } else if (!shared.empty()) {
          ASSERT_TRUE(listed);
        }
        ASSERT_EQ(listed, plan.conflicts.conflict(static_cast<int>(b), static_cast<int>(a)));
        const std::vector<int> others = plan.conflicts.conflicts_of(static_cast<int>(a));
        ASSERT_EQ(listed, std::binary_search(others.begin(), others.end(), static_cast<int>(b)));
      }
    }
    // Round r + 1 runs only while a losing candidate of round r holds an op that no region of rounds
    // 1..r took.
    if (rounds > 1) ++plans_of_several_rounds;
    std::vector<int> taken_in_round(graph.nodes().size(), 0);  // 0: in no region a round chose
    for (const FusionCandidate& candidate : plan.candidates) {
      if (candidate.region < 0) continue;
      for (NodeId node : candidate.nodes) taken_in_round[static_cast<std::size_t>(node)] = round_of(candidate);
    }
    for (int earlier = 1; earlier < rounds; ++earlier) {
      bool loser_left = false;
      for (const FusionCandidate& candidate : plan.candidates) {
        if (round_of(candidate) != earlier || candidate.region >= 0) continue;
        for (NodeId node : candidate.nodes) {
          const int taken = taken_in_round[static_cast<std::size_t>(node)];
          loser_left = loser_left || taken == 0 || taken > earlier;
        }
      }
      ASSERT_TRUE(loser_left) << "round " << earlier << " of " << rounds << "\n" << write_graph_json(graph);
    }
    // Per exactly solved component: the selection's weight is the brute-force best.
    for (const ConflictComponent& component : plan.components) {
      const bool exact = component.method == "single" || component.method == "min_cut" ||
                         component.method == "branch_and_bound";
      if (!exact || component.candidates.size() > 16) continue;
      ConflictCase problem;
      for (int member : component.candidates) {
        problem.weights.push_back(to_picoseconds(plan.candidates[static_cast<std::size_t>(member)].benefit_ns));
        std::vector<int> local;
        for (int other : plan.conflicts.conflicts_of(member)) {
          local.push_back(static_cast<int>(std::lower_bound(component.candidates.begin(), component.candidates.end(), other) -
                                           component.candidates.begin()));
        }
        problem.conflicts.push_back(local);
      }
      std::int64_t chosen = 0;
      for (std::size_t local = 0; local < component.candidates.size(); ++local) {
        if (plan.candidates[static_cast<std::size_t>(component.candidates[local])].region >= 0) chosen += problem.weights[local];
      }
      EXPECT_EQ(chosen, best_independent_set(problem)) << component.method;
      ++exact_components;
      if (component.candidates.size() > 1) ++multi_candidate_components;
    }
    // The plan, run kernel by kernel, computes what the graph computes.
    if (round % 10 == 0) {
      const TensorMap inputs = random_inputs(graph, static_cast<std::uint64_t>(round));
      const TensorMap expected = run_reference(graph, inputs);
      const TensorMap actual = run_plan_reference(plan, inputs);
      ASSERT_EQ(actual.size(), expected.size());
      for (const auto& [name, tensor] : expected) EXPECT_TRUE(actual.at(name) == tensor) << name;
    }
  }
  EXPECT_GT(multi_candidate_components, 500);
  EXPECT_GT(exact_components, 2000);
  EXPECT_GT(plans_of_several_rounds, 100);  // about 250 of the 2000
}

}  // namespace
}  // namespace metile
