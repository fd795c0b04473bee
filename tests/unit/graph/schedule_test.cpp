// The one scheduler (schedule, schedule_kernels in graph.h) against brute force: on random DAGs,
// with and without planted cycles, every permutation of the vertices is tried. A graph is acyclic
// exactly when some permutation is a topological order; Kahn's algorithm with the smallest ready
// priority first must return the lexicographically smallest such order (by priority); on a cyclic
// graph the cycle it returns must be one (each vertex waits on the next, the last on the first).
#include <algorithm>
#include <numeric>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "metile/graph.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using WaitsOn = std::vector<std::vector<std::size_t>>;

bool respects(const WaitsOn& waits_on, const std::vector<std::size_t>& order) {
  std::vector<std::size_t> position(order.size());
  for (std::size_t at = 0; at < order.size(); ++at) position[order[at]] = at;
  for (std::size_t vertex = 0; vertex < waits_on.size(); ++vertex) {
    for (std::size_t before : waits_on[vertex]) {
      if (position[before] >= position[vertex]) return false;
    }
  }
  return true;
}

// The smallest valid order by priority, or nothing: permutations in increasing priority order.
std::optional<std::vector<std::size_t>> brute_force_first_order(const WaitsOn& waits_on,
                                                                const std::vector<std::int64_t>& priority) {
  std::vector<std::size_t> order(waits_on.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  auto less = [&](std::size_t a, std::size_t b) {
    return priority[a] != priority[b] ? priority[a] < priority[b] : a < b;
  };
  std::sort(order.begin(), order.end(), less);
  do {
    if (respects(waits_on, order)) return order;
  } while (std::next_permutation(order.begin(), order.end(), less));
  return std::nullopt;
}

bool waits(const WaitsOn& waits_on, std::size_t vertex, std::size_t on) {
  return std::find(waits_on[vertex].begin(), waits_on[vertex].end(), on) != waits_on[vertex].end();
}

void expect_is_cycle(const WaitsOn& waits_on, const std::vector<std::size_t>& cycle, const std::string& what) {
  ASSERT_FALSE(cycle.empty()) << what;
  EXPECT_EQ(std::set<std::size_t>(cycle.begin(), cycle.end()).size(), cycle.size()) << what << ": a vertex repeats";
  for (std::size_t at = 0; at < cycle.size(); ++at) {
    const std::size_t next = cycle[(at + 1) % cycle.size()];
    EXPECT_TRUE(waits(waits_on, cycle[at], next)) << what << ": " << cycle[at] << " does not wait on " << next;
  }
}

// A random DAG on a hidden random order, with repeated edges sometimes; `planted` back edges
// (from an earlier vertex of the hidden order onto a later one, or a self loop) make cycles.
WaitsOn random_graph(std::mt19937_64& random, std::size_t count, int planted) {
  std::vector<std::size_t> hidden(count);
  std::iota(hidden.begin(), hidden.end(), std::size_t{0});
  std::shuffle(hidden.begin(), hidden.end(), random);
  WaitsOn waits_on(count);
  std::bernoulli_distribution edge(0.35);
  for (std::size_t later = 0; later < count; ++later) {
    for (std::size_t earlier = 0; earlier < later; ++earlier) {
      if (!edge(random)) continue;
      waits_on[hidden[later]].push_back(hidden[earlier]);
      if (random() % 8 == 0) waits_on[hidden[later]].push_back(hidden[earlier]);
    }
  }
  std::uniform_int_distribution<std::size_t> pick(0, count - 1);
  for (int k = 0; k < planted; ++k) {
    std::size_t a = pick(random);
    std::size_t b = pick(random);
    if (a > b) std::swap(a, b);
    waits_on[hidden[a]].push_back(hidden[b]);  // earlier waits on later (a == b: a self loop)
  }
  for (auto& list : waits_on) std::shuffle(list.begin(), list.end(), random);
  return waits_on;
}

TEST(Schedule, MatchesBruteForceOnRandomGraphsWithPlantedCycles) {
  std::mt19937_64 random(testing::test_seed("Schedule.MatchesBruteForceOnRandomGraphsWithPlantedCycles"));
  int acyclic = 0;
  int cyclic = 0;
  for (int round = 0; round < 400; ++round) {
    const std::size_t count = 1 + static_cast<std::size_t>(round % 7);
    const WaitsOn waits_on = random_graph(random, count, round % 3 == 0 ? 1 + round % 2 : 0);
    std::vector<std::int64_t> priority(count);
    for (auto& p : priority) p = static_cast<std::int64_t>(random() % 5);  // ties go to the smaller index
    const bool prioritised = round % 2 == 0;
    const std::vector<std::int64_t> used = prioritised ? priority : [&] {
      std::vector<std::int64_t> by_index(count);
      std::iota(by_index.begin(), by_index.end(), std::int64_t{0});
      return by_index;
    }();
    const Schedule result = prioritised ? schedule(waits_on, priority) : schedule(waits_on);
    const auto expected = brute_force_first_order(waits_on, used);
    const std::string what = "round " + std::to_string(round);
    ASSERT_EQ(result.acyclic(), expected.has_value()) << what;
    if (expected) {
      EXPECT_EQ(result.order, *expected) << what;
      ++acyclic;
    } else {
      expect_is_cycle(waits_on, result.cycle, what);
      // What was ordered is ordered right: each vertex after all it waits on, none twice, none on the cycle.
      std::set<std::size_t> done;
      for (std::size_t vertex : result.order) {
        for (std::size_t before : waits_on[vertex]) EXPECT_TRUE(done.count(before)) << what;
        EXPECT_TRUE(done.insert(vertex).second) << what;
      }
      for (std::size_t vertex : result.cycle) EXPECT_FALSE(done.count(vertex)) << what;
      ++cyclic;
    }
  }
  EXPECT_GT(acyclic, 100);
  EXPECT_GT(cyclic, 20);
}

// Kernels: random node sets of a random chain-and-branch graph; the brute-force kernel graph reads
// every (reader, producer) pair, and a region that is not convex plants a cycle.
TEST(Schedule, KernelsMatchBruteForce) {
  std::mt19937_64 random(testing::test_seed("Schedule.KernelsMatchBruteForce"));
  int cyclic = 0;
  for (int round = 0; round < 300; ++round) {
    GraphBuilder builder;
    std::vector<ValueRef> values = {builder.input("x", TensorSpec({4}, DType::f32))};
    const int node_count = 2 + round % 7;
    for (int node = 0; node < node_count; ++node) {
      const ValueRef a = values[random() % values.size()];
      const ValueRef b = values[random() % values.size()];
      values.push_back(builder.add(a, b, "n" + std::to_string(node)));
    }
    const ComputeGraph graph = builder.build({values.back()});
    // Each node into one of up to four kernels, some nodes left out (computed before all of them).
    const std::size_t kernel_count = 1 + random() % 4;
    std::vector<std::vector<NodeId>> kernels(kernel_count);
    for (const Node& node : graph.nodes()) {
      const std::size_t choice = random() % (kernel_count + 1);
      if (choice < kernel_count) kernels[choice].push_back(node.id);
    }
    WaitsOn expected_waits(kernel_count);
    for (std::size_t reader = 0; reader < kernel_count; ++reader) {
      for (std::size_t producer = 0; producer < kernel_count; ++producer) {
        if (reader == producer) continue;
        bool reads = false;
        for (NodeId r : kernels[reader]) {
          for (NodeId p : kernels[producer]) {
            for (ValueId input : graph.node(r).inputs) reads = reads || graph.value(input).producer == p;
          }
        }
        if (reads) expected_waits[reader].push_back(producer);
      }
    }
    const std::string what = "round " + std::to_string(round) + "\n" + write_graph_json(graph);
    EXPECT_EQ(kernel_dependencies(graph, kernels), expected_waits) << what;
    std::vector<std::int64_t> first_node(kernel_count, node_count);
    for (std::size_t kernel = 0; kernel < kernel_count; ++kernel) {
      for (NodeId node : kernels[kernel]) first_node[kernel] = std::min<std::int64_t>(first_node[kernel], node);
    }
    const Schedule result = schedule_kernels(graph, kernels);
    const auto expected = brute_force_first_order(expected_waits, first_node);
    ASSERT_EQ(result.acyclic(), expected.has_value()) << what;
    if (expected) {
      EXPECT_EQ(result.order, *expected) << what;
    } else {
      expect_is_cycle(expected_waits, result.cycle, what);
      ++cyclic;
    }
  }
  EXPECT_GT(cyclic, 10);
}

TEST(Schedule, RefusesMalformedInput) {
  EXPECT_THROW(schedule(WaitsOn{{1}}), std::invalid_argument);
  const std::vector<std::int64_t> two = {0, 1};
  EXPECT_THROW(schedule(WaitsOn{{}}, two), std::invalid_argument);
  GraphBuilder builder;
  const ValueRef x = builder.input("x", TensorSpec({4}, DType::f32));
  const ComputeGraph graph = builder.build({builder.add(x, x, "sum")});
  const std::vector<std::vector<NodeId>> twice = {{0}, {0}};
  EXPECT_THROW(kernel_dependencies(graph, twice), std::invalid_argument);
  const std::vector<std::vector<NodeId>> outside = {{1}};
  EXPECT_THROW(kernel_dependencies(graph, outside), std::invalid_argument);
}

}  // namespace
}  // namespace metile
