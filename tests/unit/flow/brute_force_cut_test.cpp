// Tiny networks against exhaustive enumeration: every vertex subset containing the
// source and not the sink is a cut; the smallest capacity is the max-flow value
// (max-flow/min-cut theorem), and the intersection of all minimum cuts is the smallest
// minimum cut, which is exactly the source side both engines must report.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace metile
