// Dead-node removal (graph.h, "dead nodes") against a brute-force oracle: a node is live when a
// graph output's producer reaches it in the transitive closure of "reads a value of". The graph
// without the dead nodes keeps its inputs, outputs and names, and computes the same outputs
// bit for bit on the CPU reference.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "metile/cpu_runtime.h"
#include "metile/graph.h"
#include "metile_test_support.h"
#include "random_graph.h"

namespace metile {
namespace {

// depends[a][b]: node a reads, directly or through other nodes, a value node b produced. Closed
// by repeated passes until nothing changes (no topological order assumed).
std::vector<bool> live_by_closure(const ComputeGraph& graph) {
  const std::size_t count = graph.nodes().size();
  std::vector<std::vector<bool>> depends(count, std::vector<bool>(count, false));
  for (const Node& node : graph.nodes()) {
    for (ValueId input : node.inputs) {
      const NodeId producer = graph.value(input).producer;
      if (producer >= 0) depends[static_cast<std::size_t>(node.id)][static_cast<std::size_t>(producer)] = true;
    }
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t a = 0; a < count; ++a) {
      for (std::size_t b = 0; b < count; ++b) {
        if (!depends[a][b]) continue;
        for (std::size_t c = 0; c < count; ++c) {
          if (depends[b][c] && !depends[a][c]) depends[a][c] = changed = true;
        }
      }
    }
  }
  std::vector<bool> live(count, false);
  for (ValueId output : graph.outputs()) {
    const auto producer = static_cast<std::size_t>(graph.value(output).producer);
    live[producer] = true;
    for (std::size_t b = 0; b < count; ++b) live[b] = live[b] || depends[producer][b];
  }
  return live;
}

TEST(DeadNodes, MatchTheClosureAndTheRemainingGraphComputesTheSameOutputs) {
  const auto first = static_cast<std::uint32_t>(testing::test_seed("DeadNodes.MatchTheClosure"));
  int graphs_with_dead_nodes = 0;
  for (std::uint32_t seed = first; seed < first + 60; ++seed) {
    SCOPED_TRACE("graph seed " + std::to_string(seed));
    const ComputeGraph graph = testing::random_graph(seed);
    const std::vector<bool> live = nodes_outputs_depend_on(graph);
    ASSERT_EQ(live, live_by_closure(graph)) << write_graph_json(graph);

    std::vector<NodeId> removed;
    const ComputeGraph kept = without_dead_nodes(graph, &removed);
    std::vector<NodeId> dead;
    std::vector<std::string> live_names;
    for (const Node& node : graph.nodes()) {
      if (live[static_cast<std::size_t>(node.id)]) {
        live_names.push_back(node.name);
      } else {
        dead.push_back(node.id);
      }
    }
    EXPECT_EQ(removed, dead);
    graphs_with_dead_nodes += !dead.empty();
    std::vector<std::string> kept_names;
    for (const Node& node : kept.nodes()) kept_names.push_back(node.name);
    EXPECT_EQ(kept_names, live_names);
    ASSERT_EQ(kept.inputs().size(), graph.inputs().size());
    for (std::size_t i = 0; i < graph.inputs().size(); ++i) {
      EXPECT_EQ(kept.value(kept.inputs()[i]).name, graph.value(graph.inputs()[i]).name);
      EXPECT_EQ(kept.value(kept.inputs()[i]).spec, graph.value(graph.inputs()[i]).spec);
    }
    ASSERT_EQ(kept.outputs().size(), graph.outputs().size());
    for (std::size_t i = 0; i < graph.outputs().size(); ++i) {
      EXPECT_EQ(kept.value(kept.outputs()[i]).name, graph.value(graph.outputs()[i]).name);
    }
    for (const Node& node : kept.nodes()) {  // each kept node as recorded: op, attributes, operand names
      const Node& original = graph.node(*graph.find_node(node.name));
      EXPECT_EQ(node.op, original.op);
      EXPECT_EQ(node.attributes, original.attributes);
      for (std::size_t i = 0; i < node.inputs.size(); ++i) {
        EXPECT_EQ(kept.value(node.inputs[i]).name, graph.value(original.inputs[i]).name);
      }
    }
    if (dead.empty()) {
      EXPECT_EQ(kept, graph);
    }
    const TensorMap inputs = random_inputs(graph, seed);
    EXPECT_EQ(run_reference(kept, inputs), run_reference(graph, inputs));
    if (HasFailure()) break;
  }
  EXPECT_GT(graphs_with_dead_nodes, 10);  // the random graphs do hold dead nodes
}

TEST(DeadNodes, AnInputOnlyADeadNodeReadsStaysAnInput) {
  GraphBuilder builder;
  const ValueRef x = builder.input("x", {{4}, DType::f32});
  const ValueRef unused = builder.input("only_dead_reads_me", {{4}, DType::f32});
  builder.add(x, unused, "dead_sum");
  const ValueRef doubled = builder.scale(x, 2.0, "doubled");
  const ComputeGraph graph = builder.build({doubled});
  std::vector<NodeId> removed;
  const ComputeGraph kept = without_dead_nodes(graph, &removed);
  EXPECT_EQ(removed, std::vector<NodeId>{*graph.find_node("dead_sum")});
  ASSERT_EQ(kept.nodes().size(), 1u);
  EXPECT_EQ(kept.nodes()[0].name, "doubled");
  ASSERT_EQ(kept.inputs().size(), 2u);
  EXPECT_EQ(kept.value(kept.inputs()[1]).name, "only_dead_reads_me");
}

}  // namespace
}  // namespace metile
