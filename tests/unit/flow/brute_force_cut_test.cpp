// Tiny networks against exhaustive enumeration: every vertex subset containing the
// source and not the sink is a cut; the smallest capacity is the max-flow value
// (max-flow/min-cut theorem), and the intersection of all minimum cuts is the smallest
// minimum cut, which is exactly the source side both engines must report, and
// IncrementalMinCut after each vertex it forces to the sink side.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "metile/flow.h"
#include "network_families.h"
#include "metile_test_support.h"

namespace metile {
namespace {

struct BruteForceCut {
  double value = 0;
  std::vector<bool> smallest_side;
  int minimum_cut_count = 0;
};

template <typename Capacity>
BruteForceCut enumerate_cuts(const FlowNetwork<Capacity>& network, int source, int sink) {
  const int n = network.vertex_count();
  BruteForceCut best;
  bool found = false;
  std::vector<bool> intersection(n, true);
  std::vector<bool> side(n, false);
  for (std::uint32_t mask = 0; mask < (1u << n); ++mask) {
    if (!(mask >> source & 1u) || (mask >> sink & 1u)) continue;
    for (int v = 0; v < n; ++v) side[v] = (mask >> v & 1u) != 0;
    const double value = static_cast<double>(cut_capacity(network, side));
    if (!found || value < best.value) {
      found = true;
      best.value = value;
      best.minimum_cut_count = 1;
      intersection = side;
    } else if (value == best.value) {
      ++best.minimum_cut_count;
      for (int v = 0; v < n; ++v) intersection[v] = intersection[v] && side[v];
    }
  }
  best.smallest_side = intersection;
  return best;
}

TEST(BruteForceMinCut, TinyIntegerNetworks) {
  std::mt19937_64 random(testing::test_seed("BruteForceMinCut.TinyIntegerNetworks"));
  int networks_with_ties = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    const int vertices = static_cast<int>(flow_families::draw(random, 2, 9));
    const int edge_count = static_cast<int>(flow_families::draw(random, 0, 3 * vertices));
    // Small capacities (0..4) make ties between minimum cuts common.
    const flow_families::GeneratedNetwork generated =
        flow_families::multigraph_network(vertices, edge_count, 4, random);
    const int source = static_cast<int>(flow_families::draw(random, 0, vertices - 1));
    int sink = static_cast<int>(flow_families::draw(random, 0, vertices - 2));
    if (sink >= source) ++sink;
    const IntegerFlowNetwork network = generated.integer_network();
    const BruteForceCut expected = enumerate_cuts(network, source, sink);
    for (const MaxFlowResult<std::int64_t>& result :
         {dinic(network, source, sink), hlpp(network, source, sink),
          hlpp(network, source, sink, {.edge_flows = true})}) {
      ASSERT_EQ(static_cast<double>(result.value), expected.value) << result.solver << " trial " << trial;
      ASSERT_EQ(result.source_side, expected.smallest_side) << result.solver << " trial " << trial;
    }
    networks_with_ties += static_cast<int>(expected.minimum_cut_count > 1);
  }
  EXPECT_GT(networks_with_ties, 300);  // the property is only interesting where cuts tie
}

TEST(BruteForceMinCut, TinyRealNetworks) {
  std::mt19937_64 random(testing::test_seed("BruteForceMinCut.TinyRealNetworks"));
  for (int trial = 0; trial < 500; ++trial) {
    const int vertices = static_cast<int>(flow_families::draw(random, 2, 8));
    const flow_families::GeneratedNetwork generated = flow_families::multigraph_network(
        vertices, static_cast<int>(flow_families::draw(random, 0, 20)), 9, random);
    const std::vector<FlowEdge<double>> edges = flow_families::real_edges(generated, true, random);
    const RealFlowNetwork network(vertices, edges);
    const BruteForceCut expected = enumerate_cuts(network, generated.source, generated.sink);
    for (const MaxFlowResult<double>& result : {dinic(network, generated.source, generated.sink),
                                                hlpp(network, generated.source, generated.sink)}) {
      ASSERT_NEAR(result.value, expected.value, 1e-9 * (1 + expected.value))
          << result.solver << " trial " << trial;
      ASSERT_NEAR(cut_capacity(network, result.source_side), expected.value, 1e-9 * (1 + expected.value));
    }
  }
}

// The network of `edges` plus an infinite edge from every forced vertex to the sink: what an
// IncrementalMinCut that forced those vertices must cut as a fresh solve does.
IntegerFlowNetwork with_forced(int vertex_count, const std::vector<FlowEdge<std::int64_t>>& edges,
                               const std::vector<std::uint8_t>& infinite, const std::vector<int>& forced, int sink) {
  FlowNetworkBuilder<std::int64_t> builder(vertex_count);
  for (std::size_t e = 0; e < edges.size(); ++e) {
    if (infinite[e] != 0) {
      builder.add_infinite_edge(edges[e].from, edges[e].to);
    } else {
      builder.add_edge(edges[e].from, edges[e].to, edges[e].capacity);
    }
  }
  for (int vertex : forced) builder.add_infinite_edge(vertex, sink);
  return builder.build();
}

// Each force against the enumeration of the network with the forced vertices' infinite edges: the
// value and the smallest minimum cut, the warm-started flow's as a fresh one's. Some edges are
// infinite (the planner's legality edges), so that a force can leave no finite cut.
TEST(BruteForceMinCut, IncrementalCutAfterEachForcedVertex) {
  std::mt19937_64 random(testing::test_seed("BruteForceMinCut.IncrementalCutAfterEachForcedVertex"));
  int without_finite_cut = 0;
  int warm_augmentations = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int vertices = static_cast<int>(flow_families::draw(random, 3, 9));
    const flow_families::GeneratedNetwork generated = flow_families::multigraph_network(
        vertices, static_cast<int>(flow_families::draw(random, 0, 3 * vertices)), 4, random);
    std::vector<std::uint8_t> infinite(generated.edges.size(), 0);
    FlowNetworkBuilder<std::int64_t> builder(vertices);
    for (std::size_t e = 0; e < generated.edges.size(); ++e) {
      const FlowEdge<std::int64_t>& edge = generated.edges[e];
      infinite[e] = flow_families::draw(random, 0, 5) == 0;
      if (infinite[e] != 0) {
        builder.add_infinite_edge(edge.from, edge.to);
      } else {
        builder.add_edge(edge.from, edge.to, edge.capacity);
      }
    }
    const int source = generated.source;
    const int sink = generated.sink;
    IncrementalMinCut cut(builder, source, sink);
    std::vector<int> order;
    for (int vertex = 0; vertex < vertices; ++vertex) {
      if (vertex != source) order.push_back(vertex);
    }
    std::shuffle(order.begin(), order.end(), random);
    order.resize(static_cast<std::size_t>(flow_families::draw(random, 1, static_cast<std::int64_t>(order.size()))));
    std::vector<int> forced;
    long long paths_before = 0;
    for (std::size_t step = 0; step <= order.size(); ++step) {
      const IntegerFlowNetwork network = with_forced(vertices, generated.edges, infinite, forced, sink);
      const BruteForceCut expected = enumerate_cuts(network, source, sink);
      ASSERT_EQ(static_cast<double>(cut.value()), expected.value) << "trial " << trial << " step " << step;
      ASSERT_EQ(cut.source_side(), expected.smallest_side) << "trial " << trial << " step " << step;
      if (step > 0 && cut.augmenting_paths() > paths_before) ++warm_augmentations;
      paths_before = cut.augmenting_paths();
      without_finite_cut += static_cast<int>(cut.value() >= network.infinite_capacity());
      if (step == order.size()) break;
      cut.force_to_sink(order[step]);
      forced.push_back(order[step]);
      if (step % 3 == 0) {
        cut.force_to_sink(order[step]);  // again: changes nothing
      }
    }
  }
  // Both things the warm start must get right happen often: a force that adds flow to the last
  // maximum, and one that leaves no finite cut.
  EXPECT_GT(warm_augmentations, 100);  // 188-230 in six runs
  EXPECT_GT(without_finite_cut, 20);
}

TEST(BruteForceMinCut, IncrementalCutRefusesTheSourceAndVerticesOutOfRange) {
  FlowNetworkBuilder<std::int64_t> builder(3);
  builder.add_edge(0, 1, 2);
  builder.add_edge(1, 2, 1);
  EXPECT_THROW(IncrementalMinCut(builder, 0, 0), InputError);
  EXPECT_THROW(IncrementalMinCut(builder, 0, 3), InputError);
  IncrementalMinCut cut(builder, 0, 2);
  EXPECT_EQ(cut.value(), 1);
  EXPECT_THROW(cut.force_to_sink(0), InputError);
  EXPECT_THROW(cut.force_to_sink(-1), InputError);
  EXPECT_THROW(cut.force_to_sink(3), InputError);
  cut.force_to_sink(2);  // the sink: nothing changes
  EXPECT_EQ(cut.value(), 1);
  cut.force_to_sink(1);
  EXPECT_EQ(cut.value(), 2);
  EXPECT_EQ(cut.source_side(), (std::vector<bool>{true, false, false}));
}

// A force is refused exactly where a fresh network with the forced vertices' infinite edges is: the
// capacity totals count an edge to the sink once it is forced, not the closed ones every vertex has.
TEST(BruteForceMinCut, IncrementalCutRefusesAForceWhereAFreshNetworkWould) {
  // Finite capacities summing to a quarter of the limit leave room for two infinite edges.
  const std::int64_t quarter = kIntegerCapacitySumLimit / 4;
  const std::vector<FlowEdge<std::int64_t>> edges = {{0, 1, quarter - 7}, {1, 4, 3}, {0, 2, 2}, {2, 3, 1}, {3, 4, 1}};
  const std::vector<std::uint8_t> infinite = {0, 0, 0, 0, 0, 1};
  std::vector<FlowEdge<std::int64_t>> with_legality = edges;
  with_legality.push_back({1, 2, 0});  // infinite
  FlowNetworkBuilder<std::int64_t> builder(5);
  for (const FlowEdge<std::int64_t>& edge : edges) builder.add_edge(edge.from, edge.to, edge.capacity);
  builder.add_infinite_edge(1, 2);
  IncrementalMinCut cut(builder, 0, 4);  // five closed edges to the sink: no refusal
  EXPECT_NO_THROW(with_forced(5, with_legality, infinite, {3}, 4));
  cut.force_to_sink(3);
  EXPECT_EQ(cut.value(), dinic(with_forced(5, with_legality, infinite, {3}, 4), 0, 4).value);
  EXPECT_THROW(with_forced(5, with_legality, infinite, {3, 2}, 4), InputError);
  EXPECT_THROW(cut.force_to_sink(2), InputError);
  // The refused force changed nothing.
  EXPECT_EQ(cut.value(), dinic(with_forced(5, with_legality, infinite, {3}, 4), 0, 4).value);
  EXPECT_EQ(cut.source_side(), dinic(with_forced(5, with_legality, infinite, {3}, 4), 0, 4).source_side);
}

}  // namespace
}  // namespace metile
