// Differential tests: on thousands of seeded random networks from every family, Dinic,
// HLPP (with and without its second phase) and Boost's push_relabel_max_flow agree on
// the value, every result passes verify() (a flow and a cut of equal value certify each
// other), and both engines report the same canonical cut: the smallest source side.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>

#include "boost_oracle.h"
#include "metile/flow.h"
#include "network_families.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using flow_families::GeneratedNetwork;
using flow_families::Random;

// Runs every engine on one network and checks them against each other and Boost.
// Exact comparisons for integers and for real capacities that are multiples of 1/8.
template <typename Capacity>
void check_engines_agree(const FlowNetwork<Capacity>& network, const std::vector<FlowEdge<Capacity>>& edges,
                         int source, int sink, bool exact, const std::string& label) {
  SCOPED_TRACE(label);
  const MaxFlowResult<Capacity> by_dinic = dinic(network, source, sink, {.edge_flows = true});
  const MaxFlowResult<Capacity> by_hlpp = hlpp(network, source, sink, {.edge_flows = true});
  const MaxFlowResult<Capacity> by_hlpp_first_phase = hlpp(network, source, sink);
  const Capacity by_boost = testing::boost_max_flow(network.vertex_count(), edges, source, sink);

  const FlowCheck dinic_check = verify(network, source, sink, by_dinic);
  const FlowCheck hlpp_check = verify(network, source, sink, by_hlpp);
  const FlowCheck first_phase_check = verify(network, source, sink, by_hlpp_first_phase);
  ASSERT_TRUE(dinic_check) << dinic_check.problem;
  ASSERT_TRUE(hlpp_check) << hlpp_check.problem;
  ASSERT_TRUE(first_phase_check) << first_phase_check.problem;
  EXPECT_TRUE(by_hlpp_first_phase.edge_flows.empty());
  EXPECT_EQ(by_hlpp.source_side, by_hlpp_first_phase.source_side);
  if (exact) {
    ASSERT_EQ(by_dinic.value, by_boost);
    ASSERT_EQ(by_hlpp.value, by_boost);
    ASSERT_EQ(by_hlpp_first_phase.value, by_boost);
    ASSERT_EQ(cut_capacity(network, by_dinic.source_side), by_boost);
    // The smallest minimum cut is unique, so both engines must land on it.
    ASSERT_EQ(by_dinic.source_side, by_hlpp.source_side);
  } else {
    const FlowTolerance<Capacity> tolerance = FlowTolerance<Capacity>::for_network(network);
    ASSERT_TRUE(tolerance.equal(by_dinic.value, by_boost)) << by_dinic.value << " vs boost " << by_boost;
    ASSERT_TRUE(tolerance.equal(by_hlpp.value, by_boost)) << by_hlpp.value << " vs boost " << by_boost;
    ASSERT_TRUE(tolerance.equal(cut_capacity(network, by_hlpp.source_side), by_boost));
  }
}

// Checks one generated network three ways: integer capacities, exact reals (c / 8) and
// irregular reals (tolerance comparisons).
void check_all_capacity_types(const GeneratedNetwork& generated, Random& random, const std::string& label) {
  check_engines_agree(generated.integer_network(), generated.edges, generated.source, generated.sink, true,
                      label + " int64");
  const std::vector<FlowEdge<double>> dyadic = flow_families::real_edges(generated, false, random);
  check_engines_agree(RealFlowNetwork(generated.vertex_count, dyadic), dyadic, generated.source,
                      generated.sink, true, label + " double/8");
  const std::vector<FlowEdge<double>> irregular = flow_families::real_edges(generated, true, random);
  check_engines_agree(RealFlowNetwork(generated.vertex_count, irregular), irregular, generated.source,
                      generated.sink, false, label + " double irregular");
}

// Draws `count` networks from `make` with sizes growing from tiny to `largest`.
// The seed is the test's (printed, METILE_TEST_SEED replays it) plus the family's offset.
void run_family(int count, std::uint64_t family,
                const std::function<GeneratedNetwork(int index, Random&)>& make) {
  Random random(testing::test_seed(::testing::UnitTest::GetInstance()->current_test_info()->name()) + family);
  for (int index = 0; index < count; ++index) {
    const GeneratedNetwork generated = make(index, random);
    check_all_capacity_types(generated, random,
                             generated.family + " #" + std::to_string(index) + " (" +
                                 std::to_string(generated.vertex_count) + " vertices, " +
                                 std::to_string(generated.edges.size()) + " edges)");
    if (::testing::Test::HasFatalFailure()) return;
  }
}

int small_size(Random& random, int low, int high) {
  return static_cast<int>(flow_families::draw(random, low, high));
}

TEST(MaxFlowDifferential, SeedRandomFamily) {
  run_family(630, 101, [](int index, Random& random) {
    const int vertices = index < 600 ? small_size(random, 2, 60) : small_size(random, 61, 400);
    return flow_families::seed_random_network(vertices, small_size(random, 1, 12), random);
  });
}

TEST(MaxFlowDifferential, LayeredFamily) {
  run_family(265, 202, [](int index, Random& random) {
    const int layers = small_size(random, 2, index < 250 ? 8 : 40);
    const int width = small_size(random, 1, index < 250 ? 8 : 50);
    return flow_families::layered_network(layers, width, small_size(random, 1, 4), 100, random);
  });
}

TEST(MaxFlowDifferential, GridFamily) {
  run_family(180, 303, [](int index, Random& random) {
    const int side = index < 170 ? 8 : 40;
    return flow_families::grid_network(small_size(random, 1, side), small_size(random, 2, side), 50, random);
  });
}

TEST(MaxFlowDifferential, GenrmfFamily) {
  run_family(130, 404, [](int index, Random& random) {
    const int side = small_size(random, 2, index < 120 ? 4 : 8);
    const int frames = small_size(random, 2, index < 120 ? 6 : 30);
    return flow_families::genrmf_network(side, frames, 1, 100, random);
  });
}

TEST(MaxFlowDifferential, DenseFamily) {
  run_family(190, 505, [](int index, Random& random) {
    const int vertices = small_size(random, 2, index < 180 ? 25 : 90);
    return flow_families::dense_network(vertices, 0.2 + 0.7 * (index % 5) / 4.0, 1000, random);
  });
}

TEST(MaxFlowDifferential, MultigraphFamilyWithLoopsAndZeroCapacities) {
  run_family(470, 606, [](int index, Random& random) {
    const int vertices = small_size(random, 2, index < 450 ? 30 : 300);
    return flow_families::multigraph_network(vertices, small_size(random, 0, 5 * vertices), 20, random);
  });
}

TEST(MaxFlowDifferential, UnreachableSinkHasZeroFlow) {
  Random random(testing::test_seed("MaxFlowDifferential.UnreachableSinkHasZeroFlow"));
  for (int index = 0; index < 200; ++index) {
    const int vertices = small_size(random, 2, 80);
    const GeneratedNetwork generated =
        flow_families::unreachable_sink_network(vertices, small_size(random, 0, 4 * vertices), 50, random);
    const IntegerFlowNetwork network = generated.integer_network();
    for (const auto& result : {dinic(network, generated.source, generated.sink, {.edge_flows = true}),
                               hlpp(network, generated.source, generated.sink, {.edge_flows = true})}) {
      ASSERT_EQ(result.value, 0) << result.solver;
      ASSERT_TRUE(verify(network, generated.source, generated.sink, result));
      ASSERT_FALSE(result.source_side[generated.sink]);
    }
    check_all_capacity_types(generated, random, "unreachable-sink #" + std::to_string(index));
    if (HasFatalFailure()) return;
  }
}

TEST(MaxFlowDifferential, LargeNetworksUpToTwoThousandVertices) {
  Random random(testing::test_seed("MaxFlowDifferential.LargeNetworksUpToTwoThousandVertices"));
  check_all_capacity_types(flow_families::seed_random_network(2000, 6, random), random, "seed-random 2000x6");
  check_all_capacity_types(flow_families::layered_network(40, 50, 3, 1000, random), random, "layered 40x50");
  check_all_capacity_types(flow_families::grid_network(44, 45, 100, random), random, "grid 44x45");
  check_all_capacity_types(flow_families::genrmf_network(10, 20, 1, 1000, random), random, "genrmf 10x10x20");
  check_all_capacity_types(flow_families::multigraph_network(2000, 12000, 30, random), random,
                           "multigraph 2000");
}

// The DIMACS challenge's worst case for naive engines: a long path whose residual graph
// forces Dinic through many phases and the DFS deep; no recursion means no stack overflow.
TEST(MaxFlowDifferential, LongPathIsSolvedWithoutRecursion) {
  const int vertices = 200000;
  std::vector<FlowEdge<std::int64_t>> edges;
  for (int v = 0; v + 1 < vertices; ++v) edges.push_back({v, v + 1, 1000 - v % 997});
  const IntegerFlowNetwork network(vertices, edges);
  const std::int64_t expected = 1000 - 996;
  EXPECT_EQ(dinic(network, 0, vertices - 1).value, expected);
  EXPECT_EQ(hlpp(network, 0, vertices - 1).value, expected);
}

}  // namespace
}  // namespace metile
