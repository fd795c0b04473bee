// The interior-point engine against Dinic: on thousands of fresh random networks of every
// family in network_families.h (plus 2^40-scale capacities) ipm must report Dinic's value
// and Dinic's canonical cut (the smallest source side), with edge flows that pass verify().
// Integer and dyadic (c / 8) capacities compare exactly; irregular reals within the flow
// module's tolerance. Also: ipm's statistics are consistent, bad terminals are rejected
// like the other engines do, and automatic dispatch never picks ipm. Real capacities from
// 1e-300 to 1e15: ipm's value never exceeds the capacity of its own cut (weak duality).
//
// Every test prints its seed; METILE_TEST_SEED=N replays it. Under AddressSanitizer
// (unoptimized, instrumented) the network counts are divided by kSanitizerDivisor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "metile/flow.h"
#include "metile_test_support.h"
#include "network_families.h"

namespace metile {
namespace {

using flow_families::GeneratedNetwork;
using flow_families::Random;

#if defined(__SANITIZE_ADDRESS__)
constexpr int kSanitizerDivisor = 10;
#else
constexpr int kSanitizerDivisor = 1;
#endif

// A fresh seed per test (METILE_TEST_SEED replays it), printed under the test's name.
std::uint64_t test_seed() {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  return testing::test_seed(std::string(test->test_suite_name()) + "." + test->name());
}

int networks(int count) { return std::max(1, count / kSanitizerDivisor); }

int draw_int(Random& random, int low, int high) { return static_cast<int>(flow_families::draw(random, low, high)); }

// ipm against Dinic on one network; `exact` for integers and dyadic reals.
template <typename Capacity>
void check_ipm_matches_dinic(const FlowNetwork<Capacity>& network, int source, int sink, bool exact,
                             const std::string& label) {
  SCOPED_TRACE(label);
  const MaxFlowResult<Capacity> by_dinic = dinic(network, source, sink);
  const MaxFlowResult<Capacity> by_ipm = ipm(network, source, sink, {.edge_flows = true});
  ASSERT_EQ(by_ipm.solver, "ipm");
  const FlowCheck check = verify(network, source, sink, by_ipm);
  ASSERT_TRUE(check) << check.problem;
  ASSERT_TRUE(by_ipm.interior_point.has_value());
  const InteriorPointStatistics& statistics = *by_ipm.interior_point;
  ASSERT_EQ(statistics.laplacian_solves, 2 * statistics.iterations);
  ASSERT_FALSE(statistics.stop_reason.empty());
  if constexpr (std::is_integral_v<Capacity>) {
    ASSERT_EQ(by_ipm.value, by_dinic.value);
    ASSERT_EQ(by_ipm.source_side, by_dinic.source_side);
    // The repair only ever raises the rounded flow's value.
    ASSERT_LE(statistics.rounded_value, static_cast<double>(by_ipm.value));
  } else {
    const FlowTolerance<Capacity> tolerance = FlowTolerance<Capacity>::for_network(network);
    ASSERT_TRUE(tolerance.equal(by_ipm.value, by_dinic.value)) << by_ipm.value << " vs dinic " << by_dinic.value;
    ASSERT_TRUE(tolerance.equal(cut_capacity(network, by_ipm.source_side), by_dinic.value));
    if (exact) {
      ASSERT_EQ(by_ipm.source_side, by_dinic.source_side);
    }
  }
}

// One generated network as int64, as dyadic reals (c / 8) and as irregular reals.
void check_ipm_on_all_capacity_types(const GeneratedNetwork& generated, Random& random, const std::string& label) {
  check_ipm_matches_dinic(generated.integer_network(), generated.source, generated.sink, true, label + " int64");
  const std::vector<FlowEdge<double>> dyadic = flow_families::real_edges(generated, false, random);
  check_ipm_matches_dinic(RealFlowNetwork(generated.vertex_count, dyadic), generated.source, generated.sink, true,
                          label + " double/8");
  const std::vector<FlowEdge<double>> irregular = flow_families::real_edges(generated, true, random);
  check_ipm_matches_dinic(RealFlowNetwork(generated.vertex_count, irregular), generated.source, generated.sink,
                          false, label + " double irregular");
}

// The same topology with every nonzero capacity redrawn in [1, 2^40] (zeros stay zero).
GeneratedNetwork at_2_40_scale(GeneratedNetwork generated, Random& random) {
  for (FlowEdge<std::int64_t>& edge : generated.edges) {
    if (edge.capacity > 0) edge.capacity = flow_families::draw(random, 1, std::int64_t{1} << 40);
  }
  generated.family += " 2^40";
  return generated;
}

// `count` networks from `make`, each also checked at 2^40 scale (integers only there: the
// reals of that size are the dyadic case again).
void run_family(int count, const std::function<GeneratedNetwork(int index, Random&)>& make) {
  Random random(test_seed());
  for (int index = 0; index < networks(count); ++index) {
    const GeneratedNetwork generated = make(index, random);
    const std::string label = generated.family + " #" + std::to_string(index) + " (" +
                              std::to_string(generated.vertex_count) + " vertices, " +
                              std::to_string(generated.edges.size()) + " edges)";
    check_ipm_on_all_capacity_types(generated, random, label);
    const GeneratedNetwork huge = at_2_40_scale(generated, random);
    check_ipm_matches_dinic(huge.integer_network(), huge.source, huge.sink, true, label + " at 2^40");
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(IpmDifferential, SeedRandomFamily) {
  run_family(500, [](int, Random& random) {
    return flow_families::seed_random_network(draw_int(random, 2, 60), draw_int(random, 1, 8), random);
  });
}

TEST(IpmDifferential, LayeredFamily) {
  run_family(250, [](int, Random& random) {
    return flow_families::layered_network(draw_int(random, 2, 6), draw_int(random, 1, 8), draw_int(random, 1, 4),
                                          100, random);
  });
}

TEST(IpmDifferential, GridFamily) {
  run_family(200, [](int, Random& random) {
    return flow_families::grid_network(draw_int(random, 1, 7), draw_int(random, 2, 7), 50, random);
  });
}

TEST(IpmDifferential, GenrmfFamily) {
  run_family(150, [](int, Random& random) {
    return flow_families::genrmf_network(draw_int(random, 2, 3), draw_int(random, 2, 5), 1, 100, random);
  });
}

TEST(IpmDifferential, DenseFamily) {
  run_family(200, [](int index, Random& random) {
    return flow_families::dense_network(draw_int(random, 2, 20), 0.2 + 0.7 * (index % 5) / 4.0, 1000, random);
  });
}

TEST(IpmDifferential, MultigraphFamilyWithLoopsParallelEdgesAndZeroCapacities) {
  run_family(500, [](int, Random& random) {
    const int vertices = draw_int(random, 2, 30);
    return flow_families::multigraph_network(vertices, draw_int(random, 0, 5 * vertices), 20, random);
  });
}

TEST(IpmDifferential, UnreachableSinkHasZeroFlowAndNoIterations) {
  Random random(test_seed());
  for (int index = 0; index < networks(150); ++index) {
    const int vertices = draw_int(random, 2, 60);
    const GeneratedNetwork generated =
        flow_families::unreachable_sink_network(vertices, draw_int(random, 0, 4 * vertices), 50, random);
    const MaxFlowResult<std::int64_t> result = ipm(generated.integer_network(), generated.source, generated.sink);
    ASSERT_EQ(result.value, 0);
    EXPECT_EQ(result.interior_point->iterations, 0);
    EXPECT_EQ(result.interior_point->stop_reason, "no s-t path");
    check_ipm_on_all_capacity_types(generated, random, "unreachable-sink #" + std::to_string(index));
    if (HasFatalFailure()) return;
  }
}

// A few networks of a few thousand edges (a few hundred under the sanitizer), where the IPM
// runs many CG steps per solve.
TEST(IpmDifferential, LargerNetworks) {
  Random random(test_seed());
  const int shrink = kSanitizerDivisor == 1 ? 1 : 2;
  check_ipm_on_all_capacity_types(flow_families::seed_random_network(400 / shrink, 6, random), random, "seed-random");
  check_ipm_on_all_capacity_types(flow_families::layered_network(8, 40 / shrink, 3, 1000, random), random, "layered");
  check_ipm_on_all_capacity_types(flow_families::grid_network(20 / shrink, 20 / shrink, 100, random), random, "grid");
  check_ipm_on_all_capacity_types(flow_families::genrmf_network(5, 8 / shrink, 1, 1000, random), random, "genrmf");
}

// Legality (infinite) edges: their capacity dwarfs the others, the IPM's scaling with them.
TEST(IpmDifferential, InfiniteEdges) {
  Random random(test_seed());
  for (int index = 0; index < networks(100); ++index) {
    const int vertices = draw_int(random, 3, 25);
    FlowNetworkBuilder<std::int64_t> builder(vertices);
    for (int e = 0; e < 3 * vertices; ++e) {
      const int from = draw_int(random, 0, vertices - 1);
      const int to = draw_int(random, 0, vertices - 1);
      if (draw_int(random, 0, 5) == 0) {
        builder.add_infinite_edge(from, to);
      } else {
        builder.add_edge(from, to, flow_families::draw(random, 0, 1000));
      }
    }
    check_ipm_matches_dinic(builder.build(), 0, vertices - 1, true, "infinite edges #" + std::to_string(index));
    if (HasFatalFailure()) return;
  }
}

// ipm on a real network: verify() and Dinic's value within FlowTolerance::for_network (the
// real-valued contract), and, sharper, no value above its own cut's capacity. The
// contract's tolerance (1e-9 of the total capacity: 2.9e7 on the file below) hides an
// excess of 0.06; weak duality does not. Dinic, the oracle, is held to the same bound.
void check_ipm_value_within_its_cut(const RealFlowNetwork& network, int source, int sink, const std::string& label) {
  SCOPED_TRACE(label);
  const MaxFlowResult<double> by_dinic = dinic(network, source, sink);
  const MaxFlowResult<double> by_ipm = ipm(network, source, sink, {.edge_flows = true});
  const FlowCheck check = verify(network, source, sink, by_ipm);
  ASSERT_TRUE(check) << check.problem;
  const FlowTolerance<double> tolerance = FlowTolerance<double>::for_network(network);
  ASSERT_TRUE(tolerance.equal(by_ipm.value, by_dinic.value)) << by_ipm.value << " vs dinic " << by_dinic.value;
  // HLPP on the same networks: with each vertex's own excess threshold a push could list a vertex twice
  // as active (it looped on some of these, or put the sink on the source side).
  const MaxFlowResult<double> by_hlpp = hlpp(network, source, sink, {.edge_flows = true});
  const FlowCheck hlpp_check = verify(network, source, sink, by_hlpp);
  ASSERT_TRUE(hlpp_check) << "hlpp: " << hlpp_check.problem;
  ASSERT_TRUE(tolerance.equal(by_hlpp.value, by_dinic.value)) << by_hlpp.value << " (hlpp) vs dinic " << by_dinic.value;
  for (const MaxFlowResult<double>* result : {&by_dinic, &by_ipm, &by_hlpp}) {
    const double cut = cut_capacity(network, result->source_side);  // weak duality, up to rounding of the sums
    ASSERT_LE(result->value, cut * (1 + 1e-12))
        << result->solver << "'s value exceeds its cut's capacity by " << result->value - cut;
  }
}

// An adversarial tester's network (18 vertices, 112 edges, capacities 0 and 1e-300 to 1e15):
// 1e15-capacity cycles left imbalances of 0.1 in the rounded flow, and ipm reported the
// source's outflow, 1179749.616571993, above its cut's 1179749.555047602 (Dinic's value).
TEST(IpmDifferential, RealCapacitiesOverManyOrdersOfMagnitudeRegressionFile) {
  const auto problem = std::get<FlowProblem<double>>(
      read_dimacs_max_flow_file(std::filesystem::path(METILE_FLOW_DATA_DIR) / "ipm_real_1e15_cycles.max"));
  check_ipm_value_within_its_cut(problem.network, problem.source, problem.sink, "ipm_real_1e15_cycles.max");
  EXPECT_EQ(ipm(problem.network, problem.source, problem.sink).source_side,
            dinic(problem.network, problem.source, problem.sink).source_side);
}

// Two of the seed-random family's networks at c/8 capacities (seeds 8441860141072261192, #322, and
// 13863156636455935945, #137, of SeedRandomFamily; 2 of 60 runs met one): ipm left a residual of
// 1.5e-14 on a 0.125 edge the exact flow saturates, just above its threshold, and its source side
// reached all but the sink where Dinic's is {s}. The same value; now the same cut (smaller_minimum_cut).
TEST(IpmDifferential, DyadicNetworksWhereRoundingLeftAHairOfResidual) {
  for (const char* name : {"ipm_dyadic_residual_hair_a.max", "ipm_dyadic_residual_hair_b.max"}) {
    SCOPED_TRACE(name);
    const auto problem =
        std::get<FlowProblem<double>>(read_dimacs_max_flow_file(std::filesystem::path(METILE_FLOW_DATA_DIR) / name));
    check_ipm_matches_dinic(problem.network, problem.source, problem.sink, true, name);
  }
}

// Random multigraphs (loops and parallel edges too) whose capacities are each 0, 1e-300, 1e15,
// uniform in [0, 10] or 10^uniform(-12, 12), the tester's mix. About 1 in 500 broke the bound.
TEST(IpmDifferential, RealCapacitiesOverManyOrdersOfMagnitude) {
  Random random(test_seed());
  for (int index = 0; index < networks(4000); ++index) {
    const int vertices = draw_int(random, 2, 40);
    std::vector<FlowEdge<double>> edges(draw_int(random, 1, 120));
    for (FlowEdge<double>& edge : edges) {
      edge.from = draw_int(random, 0, vertices - 1);
      edge.to = draw_int(random, 0, vertices - 1);
      switch (draw_int(random, 0, 4)) {
        case 0: edge.capacity = std::uniform_real_distribution<double>(0, 10)(random); break;
        case 1: edge.capacity = std::pow(10.0, std::uniform_real_distribution<double>(-12, 12)(random)); break;
        case 2: edge.capacity = 0; break;
        case 3: edge.capacity = 1e-300; break;
        default: edge.capacity = 1e15; break;
      }
    }
    check_ipm_value_within_its_cut(RealFlowNetwork(vertices, edges), 0, vertices - 1,
                                   "wide reals #" + std::to_string(index) + " (" + std::to_string(vertices) +
                                       " vertices, " + std::to_string(edges.size()) + " edges)");
    if (HasFatalFailure()) return;
  }
}

TEST(IpmEngine, RejectsBadTerminalsLikeTheOtherEngines) {
  const IntegerFlowNetwork network(3, {{0, 1, 4}, {1, 2, 3}});
  EXPECT_EQ(testing::error_of([&] { ipm(network, 1, 1); }), "ipm: source and sink are the same vertex 1");
  EXPECT_EQ(testing::error_of([&] { ipm(network, 0, 3); }), "ipm: sink vertex 3 outside [0, 3)");
  EXPECT_EQ(testing::error_of([&] { solve(network, 2, 2, {.solver = SolverChoice::ipm}); }),
            "solve: source and sink are the same vertex 2");
}

TEST(IpmEngine, IsReachedByNameOnly) {
  EXPECT_EQ(parse_solver_choice("ipm"), SolverChoice::ipm);
  EXPECT_EQ(solver_choice_name(SolverChoice::ipm), "ipm");
  Random random(test_seed());
  clear_dispatch_cache();
  for (int index = 0; index < networks(40); ++index) {
    const GeneratedNetwork generated =
        flow_families::seed_random_network(draw_int(random, 32, 120), draw_int(random, 1, 8), random);
    const IntegerFlowNetwork network = generated.integer_network();
    const MaxFlowResult<std::int64_t> named = solve(network, generated.source, generated.sink, {.solver = SolverChoice::ipm});
    ASSERT_EQ(named.solver, "ipm");
    // Automatic dispatch, first (tournament) and second (cache) time: never ipm.
    for (int repeat = 0; repeat < 2; ++repeat) {
      const MaxFlowResult<std::int64_t> automatic = solve(network, generated.source, generated.sink);
      ASSERT_TRUE(automatic.solver == "dinic" || automatic.solver == "hlpp") << automatic.solver;
      ASSERT_FALSE(automatic.interior_point.has_value());
      ASSERT_EQ(automatic.value, named.value);
    }
  }
}

// The race of the Laplacian solves' preconditioners (src/flow/grounded_laplacian.h; its own test
// checks each against float64), through the CG steps a solve takes inside ipm. On a chain the LP
// graph is a cycle (the return arc closes it), which either tree form solves in a few steps where the
// Jacobi scaling took steps growing with the length (a 10^4-vertex chain: 9.6 s, session 34). On
// expander-like seed-random networks `tree_and_diagonal` wins the race with ~29 steps a solve (`tree`
// alone: ~250 at n = 1024); on GENRMF `tree` wins with ~110 (`tree_and_diagonal` alone: ~400 at
// b = 16). A race won by the wrong form, or one that no longer stops the racer far behind, fails the
// bounds (breaking `tree_and_diagonal` gave 421 steps a solve on seed-random, `tree` 585 on GENRMF);
// a form made twice as slow would pass. Exactness is the differential tests' business.
TEST(IpmEngine, TreePreconditionersKeepEachFamilysSolvesShort) {
  Random random(test_seed());
  struct Case {
    std::string label;
    GeneratedNetwork network;
    double most_steps_a_solve;
  };
  std::vector<Case> cases;
  for (int k = 0; k < networks(3); ++k) {
    const int length = draw_int(random, 2000, 5000);
    GeneratedNetwork chain;
    chain.family = "chain";
    chain.vertex_count = length;
    chain.source = 0;
    chain.sink = length - 1;
    for (int v = 0; v + 1 < length; ++v) chain.edges.push_back({v, v + 1, flow_families::draw(random, 1, 1000)});
    cases.push_back({"chain of " + std::to_string(length), chain, 6});
    cases.push_back({"seed-random n=1024 d=6", flow_families::seed_random_network(1024, 6, random), 80});
    cases.push_back({"genrmf a=8 b=16", flow_families::genrmf_network(8, 16, 1, 10000, random), 250});
  }
  for (const Case& c : cases) {
    const IntegerFlowNetwork network = c.network.integer_network();
    const MaxFlowResult<std::int64_t> by_ipm = ipm(network, c.network.source, c.network.sink);
    const InteriorPointStatistics& statistics = *by_ipm.interior_point;
    const double per_solve = static_cast<double>(statistics.cg_steps) / std::max(1, statistics.laplacian_solves);
    std::printf("  %-24s %d solves, %lld CG steps (%.1f a solve), stop: %s\n", c.label.c_str(),
                statistics.laplacian_solves, statistics.cg_steps, per_solve, statistics.stop_reason.c_str());
    EXPECT_EQ(by_ipm.value, dinic(network, c.network.source, c.network.sink).value) << c.label;
    EXPECT_EQ(statistics.unconverged_solves, 0) << c.label;
    EXPECT_LE(per_solve, c.most_steps_a_solve) << c.label;
  }
}

}  // namespace
}  // namespace metile
