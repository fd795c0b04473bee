// FlowNetwork and FlowNetworkBuilder: validation messages, the CSR invariants the
// engines rely on, infinite (legality) edges and the fingerprint used as cache key.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "boost_oracle.h"
#include "metile/flow.h"
#include "network_families.h"
#include "metile_test_support.h"

namespace metile {
namespace {

template <typename Capacity>
std::string construction_error(int vertex_count, std::vector<FlowEdge<Capacity>> edges) {
  try {
    FlowNetwork<Capacity> network(vertex_count, edges);
  } catch (const InputError& error) {
    return error.what();
  }
  return "no error";
}

TEST(FlowNetwork, RejectsBadEdgesNamingTheEdge) {
  EXPECT_EQ(construction_error<std::int64_t>(3, {{0, 1, 5}, {1, 2, -4}}),
            "flow network: edge 1 has negative capacity -4");
  EXPECT_EQ(construction_error<std::int64_t>(3, {{0, 3, 5}}),
            "flow network: edge 0 has head vertex 3 outside [0, 3)");
  EXPECT_EQ(construction_error<std::int64_t>(3, {{0, 1, 1}, {-1, 2, 5}}),
            "flow network: edge 1 has tail vertex -1 outside [0, 3)");
  EXPECT_EQ(construction_error<double>(2, {{0, 1, std::nan("")}}),
            "flow network: edge 0 has capacity NaN; capacities must be finite (use add_infinite_edge for "
            "legality edges)");
  EXPECT_EQ(construction_error<double>(2, {{0, 1, 1.5}, {0, 1, std::numeric_limits<double>::infinity()}}),
            "flow network: edge 1 has capacity inf; capacities must be finite (use add_infinite_edge for "
            "legality edges)");
  EXPECT_EQ(construction_error<double>(2, {{0, 1, -0.25}}),
            "flow network: edge 0 has negative capacity -0.25");
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max() / 6;
  EXPECT_NE(construction_error<std::int64_t>(2, {{0, 1, huge}, {0, 1, huge}}).find("could overflow"),
            std::string::npos);
  EXPECT_THROW(IntegerFlowNetwork(-1, {}), InputError);
}

TEST(FlowNetwork, CsrPairsEveryArcWithItsReverse) {
  std::mt19937_64 random(testing::test_seed("FlowNetwork.CsrPairsEveryArcWithItsReverse"));
  flow_families::GeneratedNetwork generated = flow_families::multigraph_network(40, 300, 50, random);
  // The family draws loops at random: about 1 seed in 250 drew none (METILE_TEST_SEED=6816765770496981409).
  generated.edges.push_back({7, 7, 5});
  const IntegerFlowNetwork network = generated.integer_network();
  int self_loops = 0;
  for (const auto& edge : generated.edges) self_loops += edge.from == edge.to;
  ASSERT_GT(self_loops, 0);  // the family must exercise loop dropping
  EXPECT_EQ(network.edge_count(), static_cast<int>(generated.edges.size()));
  EXPECT_EQ(network.arc_count(), 2 * (network.edge_count() - self_loops));

  std::vector<int> forward_arcs_of_edge(network.edge_count(), 0);
  for (int v = 0; v < network.vertex_count(); ++v) {
    for (int arc = network.arc_begin(v); arc < network.arc_end(v); ++arc) {
      const int reverse = network.reverse_arc(arc);
      ASSERT_EQ(network.reverse_arc(reverse), arc);
      EXPECT_EQ(network.arc_head(reverse), v);  // the reverse arc leads back to this vertex
      EXPECT_TRUE(network.arc_edge(arc) >= 0 || network.arc_edge(reverse) >= 0);
      EXPECT_FALSE(network.arc_edge(arc) >= 0 && network.arc_edge(reverse) >= 0);
      if (network.arc_edge(arc) >= 0) {
        const auto& edge = network.edge(network.arc_edge(arc));
        EXPECT_EQ(edge.from, v);
        EXPECT_EQ(edge.to, network.arc_head(arc));
        EXPECT_EQ(network.arc_capacity(arc), edge.capacity);
        EXPECT_EQ(network.arc_capacity(reverse), 0);
        ++forward_arcs_of_edge[network.arc_edge(arc)];
      }
    }
  }
  for (int e = 0; e < network.edge_count(); ++e) {
    const auto& edge = network.edge(e);
    EXPECT_EQ(forward_arcs_of_edge[e], edge.from == edge.to ? 0 : 1) << "edge " << e;
  }
}

TEST(FlowNetwork, ParallelEdgesAddUpAndLoopsCarryNothing) {
  const IntegerFlowNetwork network(3, {{0, 1, 4}, {0, 1, 3}, {1, 1, 100}, {1, 2, 10}, {1, 2, 1}});
  const MaxFlowResult<std::int64_t> result = dinic(network, 0, 2, {.edge_flows = true});
  EXPECT_EQ(result.value, 7);
  EXPECT_EQ(result.edge_flows[2], 0);
  EXPECT_EQ(result.edge_flows[0] + result.edge_flows[1], 7);
  EXPECT_TRUE(verify(network, 0, 2, result));
}

TEST(FlowNetworkBuilder, InfiniteEdgesExceedEveryFiniteCut) {
  FlowNetworkBuilder<std::int64_t> builder(2);
  const int middle = builder.add_vertex();
  EXPECT_EQ(middle, 2);
  builder.add_edge(0, middle, 30);
  const int legality = builder.add_infinite_edge(middle, 1);
  builder.add_edge(0, 1, 12);  // finite edges added after the infinite one still count
  const IntegerFlowNetwork network = builder.build();
  EXPECT_EQ(network.finite_capacity_sum(), 42);
  EXPECT_EQ(network.infinite_capacity(), 43);
  EXPECT_TRUE(network.edge_is_infinite(legality));
  EXPECT_EQ(network.edge(legality).capacity, 43);
  const MaxFlowResult<std::int64_t> result = solve(network, 0, 1);
  EXPECT_EQ(result.value, 42);
  EXPECT_EQ(cut_edges(network, result.source_side), (std::vector<int>{0, 2}));  // never the infinite edge

  FlowNetworkBuilder<double> real_builder(2);
  real_builder.add_edge(0, 1, 1e17);
  real_builder.add_infinite_edge(1, 0);
  const RealFlowNetwork real_network = real_builder.build();
  EXPECT_GT(real_network.infinite_capacity(), real_network.finite_capacity_sum());

  FlowNetworkBuilder<std::int64_t> bad(2);
  EXPECT_THROW(bad.add_edge(0, 2, 1), InputError);
  EXPECT_THROW(bad.add_edge(0, 1, -1), InputError);
  EXPECT_THROW(bad.add_infinite_edge(5, 1), InputError);
  EXPECT_THROW(bad.add_vertices(-1), InputError);
}

// An infinite (legality) edge cannot change a maximum flow, whatever the other capacities: its
// capacity (twice the finite sum plus one) counted in the solvers' zero threshold, so a unit path
// beside a hundred unrelated 1e11 arcs carried 0 once one was added (the threshold was then 1e-13 x
// the largest capacity: 2e13 x 1e-13 = 2 >= 1; it is each arc's own now, residual_graph.h).
TEST(FlowNetworkBuilder, AnInfiniteEdgeDoesNotRaiseTheRealZeroThreshold) {
  for (const bool legality : {false, true}) {
    FlowNetworkBuilder<double> builder(2);  // 0: source, 1: sink
    const int middle = builder.add_vertex();
    builder.add_edge(0, middle, 1.0);
    builder.add_edge(middle, 1, 1.0);
    for (int j = 0; j < 100; ++j) {
      const int from = builder.add_vertex();
      builder.add_edge(from, builder.add_vertex(), 1e11);
    }
    if (legality) builder.add_infinite_edge(0, middle);
    const RealFlowNetwork network = builder.build();
    // Nor does it loosen the comparison of two values (dispatch's check that the engines agree): it
    // counted there too, 1e-9 x 3e13 = 3e4, so 1 and 0 compared equal.
    EXPECT_DOUBLE_EQ(FlowTolerance<double>::for_network(network).epsilon, 1e-9 * (2 + 100 * 1e11));
    for (const auto& [name, result] : {std::pair{"dinic", dinic(network, 0, 1)}, std::pair{"hlpp", hlpp(network, 0, 1)},
                                       std::pair{"ipm", ipm(network, 0, 1)}}) {
      EXPECT_EQ(result.value, 1.0) << name << (legality ? " with" : " without") << " the legality edge";
      EXPECT_EQ(result.source_side_vertices(), legality ? (std::vector<int>{0, middle}) : (std::vector<int>{0}))
          << name;
    }
  }
}

// A real network's zero threshold is each arc's own (1e-13 of its capacity), not 1e-13 of the largest
// capacity: beside an unrelated 1e13 arc that threshold was 1, and a leftover of 0.9 on a 25.9 arc
// counted as full (Dinic 50 where the maximum is 50.9; Dinic and HLPP 99.1 where it is 100). Oracle:
// closed forms, and on random networks (seeds printed) Boost's push-relabel on the same network
// without the unrelated arc; every engine, and `auto`, whose two engines' values failed their cross-check.
TEST(FlowNetworkBuilder, AnUnrelatedLargeArcTakesNoFlowFromTheOthers) {
  const auto with_and_without = [](const std::vector<FlowEdge<double>>& edges, int vertices) {
    std::vector<FlowEdge<double>> with = edges;
    with.push_back({vertices, vertices + 1, 1e13});  // two vertices of their own
    return std::pair{RealFlowNetwork(vertices + 2, with), RealFlowNetwork(vertices + 2, edges)};
  };
  const auto engines = [](const RealFlowNetwork& network, int source, int sink) {
    return std::vector<MaxFlowResult<double>>{dinic(network, source, sink), hlpp(network, source, sink),
                                             ipm(network, source, sink), solve(network, source, sink, {.use_cache = false})};
  };
  // 0: s, 1: a, 2: t; s->a 25 and 100, a->t 25.9 and 25: 50.9.
  const auto [small, small_alone] = with_and_without({{0, 1, 25}, {0, 1, 100}, {1, 2, 25.9}, {1, 2, 25}}, 3);
  for (const MaxFlowResult<double>& result : engines(small, 0, 2)) {
    EXPECT_NEAR(result.value, 50.9, 1e-12) << result.solver;
    EXPECT_TRUE(verify(small, 0, 2, result)) << result.solver;
  }
  // Two half units meet at h, with a 1e13 edge out of it. Counted in h's excess threshold (1), the first
  // push left h's excess at 0.5, not positive, and listed it active; the second listed it again, a cycle
  // in HLPP's active list (it never ended); listed only once it turned positive, h never did, and HLPP
  // returned 0. Only edges into a vertex count now. 1 (LEMON, Dinic).
  RealFlowNetwork meeting(6, {{0, 1, 0.5}, {0, 2, 0.5}, {1, 3, 0.5}, {2, 3, 0.5}, {3, 5, 10}, {3, 4, 1e13}});
  for (const MaxFlowResult<double>& result : engines(meeting, 0, 5)) {
    EXPECT_NEAR(result.value, 1, 1e-12) << result.solver;
    EXPECT_TRUE(verify(meeting, 0, 5, result)) << result.solver;
  }
  // A 1e13 edge into h from a vertex no flow reaches, and a 7e8 edge out of the sink into the bottleneck's
  // head: both counted in a vertex's threshold as their capacity, and HLPP returned 0 for flows of 1 and
  // 5e-11 (an adversarial pass; `auto` picked it). What can reach an edge's tail bounds it now.
  RealFlowNetwork unreached(4, {{0, 1, 1}, {3, 1, 1e13}, {1, 2, 1}});
  for (const MaxFlowResult<double>& result : engines(unreached, 0, 2)) {
    EXPECT_NEAR(result.value, 1, 1e-12) << result.solver;
    EXPECT_TRUE(verify(unreached, 0, 2, result)) << result.solver;
  }
  RealFlowNetwork out_of_the_sink(4, {{0, 1, 5.6e6}, {1, 2, 5e-11}, {2, 3, 1.1e10}, {3, 2, 6.9e8}, {3, 0, 1e10}});
  for (const MaxFlowResult<double>& result : engines(out_of_the_sink, 0, 3)) {
    EXPECT_NEAR(result.value, 5e-11, 1e-23) << result.solver;
    EXPECT_TRUE(verify(out_of_the_sink, 0, 3, result)) << result.solver;
  }
  // s->a 100, a->t 99.1, a->b 100, b->t 100: 100 (0.9 of it through b).
  const auto [gadget, gadget_alone] = with_and_without({{0, 1, 100}, {1, 3, 99.1}, {1, 2, 100}, {2, 3, 100}}, 4);
  for (const MaxFlowResult<double>& result : engines(gadget, 0, 3)) EXPECT_NEAR(result.value, 100, 1e-12) << result.solver;

  const std::uint64_t seed = testing::test_seed("FlowNetworkBuilder.AnUnrelatedLargeArcTakesNoFlowFromTheOthers");
  std::mt19937_64 random(seed);
  std::uniform_real_distribution<double> capacity(0.1, 100.0);
  for (int round = 0; round < 200; ++round) {
    const int vertices = 2 + static_cast<int>(random() % 30);
    std::vector<FlowEdge<double>> edges;
    const int count = static_cast<int>(random() % (4 * vertices)) + 1;
    double total = 0;
    for (int index = 0; index < count; ++index) {
      const double value = capacity(random);
      edges.push_back({static_cast<int>(random() % vertices), static_cast<int>(random() % vertices), value});
      total += value;
    }
    const auto [network, alone] = with_and_without(edges, vertices);
    const double expected = testing::boost_max_flow(alone, 0, vertices - 1);
    for (const MaxFlowResult<double>& result : engines(network, 0, vertices - 1)) {
      ASSERT_NEAR(result.value, expected, 1e-12 * total) << result.solver << ", round " << round << ", seed " << seed;
      ASSERT_TRUE(verify(network, 0, vertices - 1, result)) << result.solver << ", round " << round;
    }
  }
}

// Legality edges into many vertices must not add up past the tolerance. Each infinite edge into a
// vertex raised its excess threshold by 1e-13 of the largest finite capacity: with 30 000 of them (from a
// vertex that never holds flow) and a 1e6 edge elsewhere, every a_i's threshold was 1e-7, so the 5e-8 that
// s sends to each a_i, on its way to t, stayed there: HLPP 1 where the maximum is 1.0015, 1.5e-3 off
// against a tolerance of 1e-9 x 1e6 = 1e-3, and `auto` failed its two engines' cross-check
// (std::runtime_error). Oracle: the closed form, s->t 1 plus 5e-8 through every a_i.
TEST(FlowNetworkBuilder, ManyLegalityEdgesDoNotHideTheFlowAtTheirHeads) {
  constexpr int kHeads = 30000;
  constexpr double kThrough = 5e-8;
  FlowNetworkBuilder<double> builder(4);  // 0: s, 1: t, 2: h (the large edge's head), 3: d (never holds flow)
  builder.add_edge(0, 2, 1e6);
  builder.add_edge(0, 1, 1.0);
  for (int i = 0; i < kHeads; ++i) {
    const int head = builder.add_vertex();
    builder.add_edge(0, head, kThrough);
    builder.add_edge(head, 1, kThrough);
    builder.add_infinite_edge(3, head);
  }
  const RealFlowNetwork network = builder.build();
  const double expected = 1.0 + kHeads * kThrough;
  const double epsilon = FlowTolerance<double>::for_network(network).epsilon;
  ASSERT_LT(epsilon, kHeads * kThrough);  // the flow through the a_i is more than the engines may lose
  std::vector<MaxFlowResult<double>> results = {dinic(network, 0, 1), hlpp(network, 0, 1)};
  EXPECT_NO_THROW(results.push_back(solve(network, 0, 1, {.use_cache = false})));
  for (const MaxFlowResult<double>& result : results) {
    EXPECT_NEAR(result.value, expected, 1e-9) << result.solver;  // 30 000 additions of 5e-8 round by ~1e-12
    EXPECT_TRUE(verify(network, 0, 1, result)) << result.solver;
  }
}

// Many legality edges' reverse arcs, each of which must give back what was sent along its edge. Each
// gadget's maximum is 100: 50 through s->p->a, which the first search sends on a->b->t, and 50 through
// s->c1->c2->c3->b, which needs b->t, so the first 50 must come back over b->a (the reverse arc of the
// infinite edge a->b) and leave by a->d->e->f->t. The infinite cycle a<->a2 makes a's inflow bound the
// whole source's. With every infinite arc's threshold at 1e-13 x the largest capacity (1e15 here: 100),
// the 50 on b->a counted as nothing and every engine ended at half the maximum, 1.5e6 short, past the
// tolerance (1e6); the arcs now share 1e-13 x the finite sum like the vertices.
TEST(FlowNetworkBuilder, ManyLegalityEdgesGiveBackWhatWasSentAlongThem) {
  constexpr int kGadgets = 30000;
  constexpr double kEdge = 50;
  FlowNetworkBuilder<double> builder(3);  // 0: s, 1: t, 2: the huge edge's dead end
  builder.add_edge(0, 2, 1e15);
  for (int i = 0; i < kGadgets; ++i) {
    const int p = builder.add_vertex(), a = builder.add_vertex(), a2 = builder.add_vertex(), b = builder.add_vertex();
    builder.add_edge(0, p, kEdge);
    builder.add_edge(p, a, kEdge);
    builder.add_infinite_edge(a, a2);
    builder.add_infinite_edge(a2, a);
    builder.add_infinite_edge(a, b);
    builder.add_edge(b, 1, kEdge);
    int tail = 0;
    for (int step = 0; step < 3; ++step) {
      const int next = builder.add_vertex();
      builder.add_edge(tail, next, kEdge);
      tail = next;
    }
    builder.add_edge(tail, b, kEdge);
    tail = a;
    for (int step = 0; step < 3; ++step) {
      const int next = builder.add_vertex();
      builder.add_edge(tail, next, kEdge);
      tail = next;
    }
    builder.add_edge(tail, 1, kEdge);
  }
  const RealFlowNetwork network = builder.build();
  const double expected = 2 * kEdge * kGadgets;
  const std::vector<MaxFlowResult<double>> results = {dinic(network, 0, 1), hlpp(network, 0, 1), ipm(network, 0, 1),
                                                      solve(network, 0, 1, {.use_cache = false})};
  for (const MaxFlowResult<double>& result : results) {
    EXPECT_NEAR(result.value, expected, 1e-6 * expected) << result.solver;
    EXPECT_TRUE(verify(network, 0, 1, result)) << result.solver;
  }
}

// HLPP's second phase (edge flows) returns the excess to the source. Here 10 reaches vertex 7 through
// the 1e15 edge 4->9 and 9->7: on its way back, 9->4's residual (10) is below that edge's threshold
// (1e-13 x 1e15), so 9 of it cannot go back (1 goes on to the sink) and 7 kept it. Vertex 1, processed
// later, pushed 999 999 into 7 (a label below its own); 7 held excess already, so it was taken for
// queued and never processed again: conservation failed at 7 by 1 000 008 (verify), found by
// IpmDifferential.RealCapacitiesOverManyOrdersOfMagnitude (1 seed in about 30) and reduced by hand.
TEST(FlowNetworkBuilder, HlppReturnsExcessPushedIntoAVertexThatCouldNotReturnItsOwn) {
  const RealFlowNetwork network(12, {{2, 11, 1},
                                     {10, 1, 1},
                                     {1, 11, 1},
                                     {1, 7, 1e6},
                                     {7, 2, 1},
                                     {0, 4, 1e9},
                                     {1, 10, 1e6},
                                     {0, 7, 1},
                                     {6, 7, 1},
                                     {4, 1, 1e6},
                                     {4, 9, 1e15},
                                     {9, 7, 10}});
  const MaxFlowResult<double> result = hlpp(network, 0, 11, {.edge_flows = true});
  EXPECT_EQ(result.value, dinic(network, 0, 11).value);
  const FlowCheck check = verify(network, 0, 11, result);
  EXPECT_TRUE(check) << check.problem;
}

TEST(FlowNetwork, FingerprintSeparatesTopologyAndCapacities) {
  const IntegerFlowNetwork a(3, {{0, 1, 4}, {1, 2, 3}});
  const IntegerFlowNetwork same(3, {{0, 1, 4}, {1, 2, 3}});
  const IntegerFlowNetwork other_capacity(3, {{0, 1, 4}, {1, 2, 2}});
  const IntegerFlowNetwork other_topology(3, {{0, 1, 4}, {0, 2, 3}});
  const IntegerFlowNetwork more_vertices(4, {{0, 1, 4}, {1, 2, 3}});
  const RealFlowNetwork real(3, {{0, 1, 4.0}, {1, 2, 3.0}});
  EXPECT_EQ(a.fingerprint(), same.fingerprint());
  EXPECT_NE(a.fingerprint(), other_capacity.fingerprint());
  EXPECT_NE(a.fingerprint(), other_topology.fingerprint());
  EXPECT_NE(a.fingerprint(), more_vertices.fingerprint());
  EXPECT_NE(a.fingerprint(), real.fingerprint());
}

TEST(FlowNetwork, EnginesRejectBadTerminals) {
  const IntegerFlowNetwork network(3, {{0, 1, 4}, {1, 2, 3}});
  EXPECT_THROW(dinic(network, 0, 3), InputError);
  EXPECT_THROW(hlpp(network, -1, 2), InputError);
  EXPECT_THROW(solve(network, 1, 1), InputError);
  EXPECT_EQ(testing::error_of([&] { hlpp(network, 2, 2); }), "hlpp: source and sink are the same vertex 2");
}

TEST(Verify, CatchesBrokenResults) {
  const IntegerFlowNetwork network(4, {{0, 1, 5}, {0, 2, 4}, {1, 3, 3}, {2, 3, 6}, {1, 2, 2}});
  MaxFlowResult<std::int64_t> result = hlpp(network, 0, 3, {.edge_flows = true});
  ASSERT_EQ(result.value, 9);
  ASSERT_TRUE(verify(network, 0, 3, result)) << verify(network, 0, 3, result).problem;

  MaxFlowResult<std::int64_t> wrong_value = result;
  wrong_value.value = 8;
  EXPECT_EQ(verify(network, 0, 3, wrong_value).problem, "cut capacity 9 differs from the flow value 8");

  MaxFlowResult<std::int64_t> over_capacity = result;
  over_capacity.edge_flows[2] = 4;
  EXPECT_EQ(verify(network, 0, 3, over_capacity).problem, "edge 2 (1 -> 3) carries 4 outside [0, 3]");

  MaxFlowResult<std::int64_t> leaking = result;
  leaking.edge_flows[4] -= 1;
  leaking.edge_flows[3] -= 1;  // vertex 2 now keeps nothing but vertex 1 keeps one unit
  EXPECT_EQ(verify(network, 0, 3, leaking).problem, "conservation fails at vertex 1: net outflow -1");

  MaxFlowResult<std::int64_t> bad_side = result;
  bad_side.source_side[3] = true;
  EXPECT_EQ(verify(network, 0, 3, bad_side).problem, "the sink is on the source side");
}

TEST(SolverChoice, NamesRoundTrip) {
  for (const SolverChoice choice : {SolverChoice::automatic, SolverChoice::dinic, SolverChoice::hlpp}) {
    EXPECT_EQ(parse_solver_choice(solver_choice_name(choice)), choice);
  }
  EXPECT_THROW(parse_solver_choice("simplex"), InputError);
}

}  // namespace
}  // namespace metile
