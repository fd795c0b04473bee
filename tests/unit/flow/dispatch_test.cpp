// solve(): the dispatch rules (Dinic below 32 vertices, tournament above, the 10%
// headroom rule applied to the reported median times, cached winners reused), the
// bounded cache, and concurrent callers sharing it. Values against Boost's push-relabel, on fresh
// random networks (seeds printed).
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "boost_oracle.h"
#include "metile/flow.h"
#include "metile_test_support.h"
#include "network_families.h"

namespace metile {
namespace {

IntegerFlowNetwork seed_network(int vertices, int degree, std::uint64_t seed) {
  flow_families::Random random(seed);
  return flow_families::seed_random_network(vertices, degree, random).integer_network();
}

TEST(Dispatch, SmallNetworksGoStraightToDinic) {
  clear_dispatch_cache();
  const IntegerFlowNetwork network = seed_network(31, 6, testing::test_seed("Dispatch.SmallNetworksGoStraightToDinic"));
  const MaxFlowResult<std::int64_t> result = solve(network, 0, 30);
  EXPECT_EQ(result.solver, "dinic");
  EXPECT_FALSE(result.tournament.has_value());
  EXPECT_FALSE(result.from_cache);
  EXPECT_EQ(dispatch_cache_size(), 0u);
  EXPECT_EQ(result.value, testing::boost_max_flow(network, 0, 30));
}

TEST(Dispatch, TournamentWinnerFollowsHeadroomRuleAndIsCached) {
  clear_dispatch_cache();
  const std::uint64_t seed = testing::test_seed("Dispatch.TournamentWinnerFollowsHeadroomRuleAndIsCached");
  for (int vertices : {32, 128, 700}) {
    const IntegerFlowNetwork network = seed_network(vertices, 12, seed + static_cast<std::uint64_t>(vertices));
    const std::int64_t expected = testing::boost_max_flow(network, 0, vertices - 1);
    const MaxFlowResult<std::int64_t> first = solve(network, 0, vertices - 1, {.edge_flows = true});
    ASSERT_TRUE(first.tournament.has_value());
    EXPECT_FALSE(first.from_cache);
    const bool hlpp_has_headroom =
        first.tournament->hlpp_median_ms <= 0.9 * first.tournament->dinic_median_ms;
    EXPECT_EQ(first.solver, hlpp_has_headroom ? "hlpp" : "dinic");
    EXPECT_EQ(first.value, expected);
    EXPECT_TRUE(verify(network, 0, vertices - 1, first));

    const MaxFlowResult<std::int64_t> second = solve(network, 0, vertices - 1, {.edge_flows = true});
    EXPECT_TRUE(second.from_cache);
    EXPECT_FALSE(second.tournament.has_value());
    EXPECT_EQ(second.solver, first.solver);
    EXPECT_EQ(second.value, expected);
    EXPECT_EQ(second.source_side, first.source_side);

    // Other terminals are another problem, and so is the same one without flows: no cache hit.
    EXPECT_FALSE(solve(network, 1, vertices - 1, {.edge_flows = true}).from_cache);
    EXPECT_FALSE(solve(network, 0, vertices - 1).from_cache);
    EXPECT_TRUE(solve(network, 0, vertices - 1).from_cache);
  }
  EXPECT_EQ(dispatch_cache_size(), 9u);
  clear_dispatch_cache();
  EXPECT_EQ(dispatch_cache_size(), 0u);
}

TEST(Dispatch, ExplicitChoiceAndDisabledCache) {
  clear_dispatch_cache();
  const IntegerFlowNetwork network = seed_network(64, 6, testing::test_seed("Dispatch.ExplicitChoiceAndDisabledCache"));
  EXPECT_EQ(solve(network, 0, 63, {.solver = SolverChoice::hlpp}).solver, "hlpp");
  EXPECT_EQ(solve(network, 0, 63, {.solver = SolverChoice::dinic}).solver, "dinic");
  EXPECT_EQ(dispatch_cache_size(), 0u);
  const MaxFlowResult<std::int64_t> uncached = solve(network, 0, 63, {.use_cache = false});
  EXPECT_TRUE(uncached.tournament.has_value());
  EXPECT_EQ(dispatch_cache_size(), 0u);
  EXPECT_TRUE(solve(network, 0, 63, {.use_cache = false}).tournament.has_value());
}

TEST(Dispatch, RealCapacitiesAgreeWithinTolerance) {
  clear_dispatch_cache();
  flow_families::Random random(testing::test_seed("Dispatch.RealCapacitiesAgreeWithinTolerance"));
  const flow_families::GeneratedNetwork generated = flow_families::grid_network(12, 12, 100, random);
  const RealFlowNetwork network(generated.vertex_count, flow_families::real_edges(generated, true, random));
  const MaxFlowResult<double> result = solve(network, generated.source, generated.sink, {.edge_flows = true});
  EXPECT_TRUE(result.tournament.has_value());
  EXPECT_TRUE(verify(network, generated.source, generated.sink, result));
  EXPECT_NEAR(result.value, testing::boost_max_flow(network, generated.source, generated.sink), 1e-9 * result.value);
}

TEST(Dispatch, CacheIsBounded) {
  clear_dispatch_cache();
  // A 32-vertex path with distinct capacities per network: cheap tournaments, distinct keys.
  for (std::size_t index = 0; index < dispatch_cache_capacity + 50; ++index) {
    std::vector<FlowEdge<std::int64_t>> edges;
    for (int v = 0; v + 1 < 32; ++v) edges.push_back({v, v + 1, static_cast<std::int64_t>(index + 1 + v)});
    const IntegerFlowNetwork network(32, edges);
    ASSERT_EQ(solve(network, 0, 31).value, static_cast<std::int64_t>(index + 1));
  }
  EXPECT_EQ(dispatch_cache_size(), dispatch_cache_capacity);
  clear_dispatch_cache();
}

TEST(Dispatch, ConcurrentCallersShareTheCache) {
  clear_dispatch_cache();
  std::vector<IntegerFlowNetwork> networks;
  std::vector<std::int64_t> expected;
  const std::uint64_t seed = testing::test_seed("Dispatch.ConcurrentCallersShareTheCache");
  for (int i = 0; i < 8; ++i) {
    networks.push_back(seed_network(40 + 10 * i, 6, seed + static_cast<std::uint64_t>(i)));
    expected.push_back(testing::boost_max_flow(networks.back(), 0, networks.back().vertex_count() - 1));
  }
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> workers;
  for (int worker = 0; worker < 4; ++worker) {
    workers.emplace_back([&, worker] {
      for (int round = 0; round < 5; ++round) {
        for (std::size_t i = 0; i < networks.size(); ++i) {
          const int sink = networks[i].vertex_count() - 1;
          if (solve(networks[i], 0, sink).value != expected[i]) ++mismatches[worker];
        }
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
  EXPECT_EQ(dispatch_cache_size(), networks.size());
  clear_dispatch_cache();
}

}  // namespace
}  // namespace metile
