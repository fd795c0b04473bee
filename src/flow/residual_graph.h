// Private to src/flow: what the engines share about residual graphs — argument
// checks, the solver's notion of "positive" for real capacities, residual
// reachability (the canonical minimum cut), per-edge flows read off a residual, and
// augmenting from a given flow.
#pragma once

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "metile/flow.h"

namespace metile::flow_detail {

template <typename Capacity>
void check_terminals(const FlowNetwork<Capacity>& network, int source, int sink, std::string_view solver) {
  const int n = network.vertex_count();
  auto check = [&](const char* role, int vertex) {
    if (vertex < 0 || vertex >= n) {
      throw InputError(std::string(solver) + ": " + role + " vertex " + std::to_string(vertex) +
                       " outside [0, " + std::to_string(n) + ")");
    }
  };
  check("source", source);
  check("sink", sink);
  if (source == sink) {
    throw InputError(std::string(solver) + ": source and sink are the same vertex " + std::to_string(source));
  }
}

// Inside a solver a residual or an excess counts as positive only above rounding noise: exact (0) for integers. For
// reals each arc's threshold is 1e-13 of its own edge's capacity (its residual, and the flow its reverse arc holds,
// stay within it), and each vertex's 1e-13 of the capacity of the edges into it, each capacity taken at most as large
// as the flow its tail can receive (inflow_bound), so a + b - b leftovers never keep an arc or an excess alive, and an
// arc's leftover is judged by its own size: one threshold of 1e-13 x the largest capacity left 0.9 unused on a 25.9 arc
// beside an unrelated 1e13 one (Dinic and HLPP 99.1 where the maximum is 100, and `auto` failed its two engines'
// cross-check). Flow below a huge edge's threshold can still be left at the vertex it enters or on its reverse arc: at
// most 1e-13 of it, within FlowTolerance::for_network. An infinite (legality) edge counts as the largest finite
// capacity or as the finite sum over the number of infinite edges, the smaller: its own capacity (twice the finite sum
// plus one) would hide the flow it carries, which a finite cut bounds. All of them together take at most 1e-13 of the
// finite sum, at their arcs as in their heads' thresholds, so the flow their thresholds can hold back stays within
// FlowTolerance::for_network however many there are: 30 000 legality edges beside a 1e6 edge raised every head's
// threshold to 1e-7, and the 5e-8 each head was to pass on to the sink stayed there (HLPP 1.5e-3 short; `auto` failed
// its two engines' cross-check); 30 000 beside a 1e15 edge, each arc's threshold 100, held 50 each on their reverse
// arcs (every engine half the maximum).
// The largest capacity of an edge that is neither infinite (legality) nor a self loop.
template <typename Capacity>
Capacity largest_finite_capacity(const FlowNetwork<Capacity>& network) {
  const auto& edges = network.edges();
  Capacity largest{};
  for (std::size_t e = 0; e < edges.size(); ++e) {
    if (!network.edge_is_infinite(static_cast<int>(e)) && edges[e].from != edges[e].to) {
      largest = std::max(largest, edges[e].capacity);
    }
  }
  return largest;
}

// An upper bound on the flow any preflow from `source` brings into each vertex: the source sends at
// most its edges' capacity, and an edge carries at most its capacity and what its tail received. Starts
// from the capacity into each vertex and tightens over a few passes (every pass leaves a bound; a
// chain of vertices longer than the passes keeps a looser one, never a wrong one; a cycle keeps the
// capacity around it).
template <typename Capacity>
std::vector<Capacity> inflow_bound(const FlowNetwork<Capacity>& network, int source) {
  constexpr int kPasses = 8;
  const auto& edges = network.edges();
  const auto n = static_cast<std::size_t>(network.vertex_count());
  std::vector<Capacity> bound(n, Capacity{});
  Capacity source_out{};
  for (const auto& e : edges) {
    if (e.from == e.to) continue;
    bound[static_cast<std::size_t>(e.to)] += e.capacity;
    if (e.from == source) source_out += e.capacity;
  }
  bound[static_cast<std::size_t>(source)] = source_out;
  std::vector<Capacity> next(n);
  for (int pass = 0; pass < kPasses; ++pass) {
    std::fill(next.begin(), next.end(), Capacity{});
    for (const auto& e : edges) {
      if (e.from != e.to) next[static_cast<std::size_t>(e.to)] += std::min(e.capacity, bound[static_cast<std::size_t>(e.from)]);
    }
    bool tightened = false;
    for (std::size_t v = 0; v < n; ++v) {
      if (static_cast<int>(v) != source && next[v] < bound[v]) {
        bound[v] = next[v];
        tightened = true;
      }
    }
    if (!tightened) break;
  }
  return bound;
}

template <typename Capacity>
class SolverTolerance {
 public:
  static constexpr double kRelative = 1e-13;

  SolverTolerance(const FlowNetwork<Capacity>& network, int source, int sink) {
    if constexpr (std::is_floating_point_v<Capacity>) {
      const auto& edges = network.edges();
      const Capacity largest = largest_finite_capacity(network);
      // The flow an edge carries, and so its rounding, is at most its capacity and what its tail can
      // receive; and what a preflow leaves anywhere (an excess, or what a push moves on) is at most what
      // the source sent (bound[source], its capacity out). No flow leaves the sink (a preflow stops there,
      // an augmenting path ends there): an edge out of it is a threshold of nothing (a 7e8 edge out of the
      // sink hid the 5e-11 that was the whole flow). A cycle of huge edges keeps its capacity in the bound
      // (inflow_bound); bounding strongly connected components by what enters them was tried and left more
      // flow short, not less: thresholds below what the flow circulating there rounds to.
      std::vector<Capacity> bound = inflow_bound(network, source);
      const Capacity sent = bound[static_cast<std::size_t>(source)];
      for (Capacity& b : bound) b = std::min(b, sent);
      bound[static_cast<std::size_t>(sink)] = Capacity{};
      // An infinite edge counts as the largest finite capacity, or as the finite capacity sum over the
      // number of infinite edges where that is smaller: however many there are, their thresholds add up
      // to at most 1e-13 of that sum, at their arcs as at their heads. (Each at the largest capacity, 30 000
      // of them beside a 1e15 edge hid 100 each on their reverse arcs: flow sent along one could not be
      // sent back, and every engine ended at half the maximum.)
      std::size_t infinite_edges = 0;
      for (std::size_t e = 0; e < edges.size(); ++e) {
        if (network.edge_is_infinite(static_cast<int>(e)) && edges[e].from != edges[e].to) ++infinite_edges;
      }
      const Capacity infinite_share =
          infinite_edges == 0 ? Capacity{}
                              : std::min(largest, network.finite_capacity_sum() / static_cast<Capacity>(infinite_edges));
      const auto edge_threshold = [&](int edge) {
        const FlowEdge<Capacity>& e = edges[static_cast<std::size_t>(edge)];
        return kRelative * std::min(network.edge_is_infinite(edge) ? infinite_share : e.capacity,
                                    bound[static_cast<std::size_t>(e.from)]);
      };
      arc_.resize(static_cast<std::size_t>(network.arc_count()));
      for (int arc = 0; arc < network.arc_count(); ++arc) {
        const int forward = network.arc_edge(arc) >= 0 ? arc : network.reverse_arc(arc);
        arc_[static_cast<std::size_t>(arc)] = edge_threshold(network.arc_edge(forward));
      }
      // A vertex's excess is what its edges in brought (flow sent back along an edge out returns at most
      // what went out, which came in first): its rounding is that of those capacities. An edge out of it,
      // however large, does not count (a 1e13 edge out of a vertex raised its threshold to 1, and two
      // half units meeting there never made it active: HLPP returned 0 for a flow of 1); nor does more of
      // an edge in than its tail can receive (a 1e13 edge in from a vertex no flow reaches did the same).
      vertex_.assign(static_cast<std::size_t>(network.vertex_count()), Capacity{});
      for (std::size_t e = 0; e < edges.size(); ++e) {
        if (edges[e].from == edges[e].to) continue;
        vertex_[static_cast<std::size_t>(edges[e].to)] += edge_threshold(static_cast<int>(e));
      }
    }
  }

  bool arc_positive(int arc, Capacity residual) const {
    if constexpr (std::is_floating_point_v<Capacity>) {
      return residual > arc_[static_cast<std::size_t>(arc)];
    } else {
      return residual > 0;
    }
  }
  bool excess_positive(int vertex, Capacity excess) const {
    if constexpr (std::is_floating_point_v<Capacity>) {
      return excess > vertex_[static_cast<std::size_t>(vertex)];
    } else {
      return excess > 0;
    }
  }

 private:
  std::vector<Capacity> arc_, vertex_;  // empty for integers
};

// Marks every vertex reachable from the roots along arcs with positive residual capacity (with
// `saturated` > 0, also above that fraction of the capacity of the arc's edge: ipm's smaller cut).
template <typename Capacity>
std::vector<bool> reachable_in_residual(const FlowNetwork<Capacity>& network,
                                        const std::vector<Capacity>& residual, const std::vector<int>& roots,
                                        const SolverTolerance<Capacity>& tolerance, double saturated = 0) {
  const auto open = [&](int arc) {
    if (!tolerance.arc_positive(arc, residual[arc])) return false;
    if (saturated <= 0) return true;
    const int forward = network.arc_edge(arc) >= 0 ? arc : network.reverse_arc(arc);
    return static_cast<double>(residual[arc]) > saturated * static_cast<double>(network.arc_capacity(forward));
  };
  std::vector<bool> reached(network.vertex_count(), false);
  std::vector<int> queue;
  queue.reserve(network.vertex_count());
  for (const int root : roots) {
    if (!reached[root]) {
      reached[root] = true;
      queue.push_back(root);
    }
  }
  for (std::size_t next = 0; next < queue.size(); ++next) {
    const int vertex = queue[next];
    for (int arc = network.arc_begin(vertex); arc < network.arc_end(vertex); ++arc) {
      const int head = network.arc_head(arc);
      if (!reached[head] && open(arc)) {
        reached[head] = true;
        queue.push_back(head);
      }
    }
  }
  return reached;
}

// Flow on each input edge = capacity minus the forward arc's residual (0 on self loops).
template <typename Capacity>
std::vector<Capacity> edge_flows_from_residual(const FlowNetwork<Capacity>& network,
                                               const std::vector<Capacity>& residual) {
  std::vector<Capacity> flows(network.edge_count(), Capacity{});
  for (int arc = 0; arc < network.arc_count(); ++arc) {
    const int edge = network.arc_edge(arc);
    if (edge >= 0) flows[edge] = network.arc_capacity(arc) - residual[arc];
  }
  return flows;
}

// Lets the dispatch tournament stop a run that has already lost its round. Engines call
// expired() in their main loops; it reads the clock only every 1024th call.
class Deadline {
 public:
  using Clock = std::chrono::steady_clock;
  Deadline() = default;
  explicit Deadline(std::optional<Clock::time_point> at) : at_(at) {}

  bool expired() {
    if (!at_ || (++calls_ & 1023u) != 0) return false;
    return Clock::now() >= *at_;
  }

 private:
  std::optional<Clock::time_point> at_;
  unsigned calls_ = 0;
};

// Dinic's phases started from a flow instead of from zero: `residual` and `value` describe a
// feasible flow and are updated in place to a maximum one. Returns the augmenting paths and
// phases it took (the interior-point engine reports them as its repair work).
struct AugmentingCounts {
  long long paths = 0;
  int phases = 0;
};
template <typename Capacity>
AugmentingCounts augment_to_maximum(const FlowNetwork<Capacity>& network, int source, int sink,
                                    std::vector<Capacity>& residual, Capacity& value);

// The engines as the tournament runs them: nullopt when the deadline passed first.
template <typename Capacity>
std::optional<MaxFlowResult<Capacity>> dinic_until(const FlowNetwork<Capacity>& network, int source, int sink,
                                                   const MaxFlowOptions& options, Deadline deadline);
template <typename Capacity>
std::optional<MaxFlowResult<Capacity>> hlpp_until(const FlowNetwork<Capacity>& network, int source, int sink,
                                                  const MaxFlowOptions& options, Deadline deadline);

}  // namespace metile::flow_detail
