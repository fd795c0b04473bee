// Dinic's algorithm: repeat { distances to the sink by reverse BFS over residual arcs;
// a blocking flow along shortest augmenting paths } until the source cannot reach the
// sink. The blocking flow is an iterative DFS with a current-arc pointer per vertex and
// an explicit path stack, so depth is bounded by memory, not by the call stack.
//
//   phase:  sink ◄─BFS─ distances          source ─DFS(dist-1 steps)─► sink, augment, retreat
//
// O(V^2 E) in general; on the planner's small layered networks it finishes in a few phases.
// augment_to_maximum runs the same phases from a given flow (the interior-point engine's
// repair of its rounded flow).
#include <algorithm>
#include <vector>

#include "residual_graph.h"

namespace metile {
namespace {

template <typename Capacity>
class DinicSolver {
 public:
  DinicSolver(const FlowNetwork<Capacity>& network, int source, int sink)
      : DinicSolver(network, source, sink,
                    std::vector<Capacity>(network.arc_capacities().begin(), network.arc_capacities().end()),
                    Capacity{}) {}

  // Warm start: augment from the flow whose residual graph is `residual` and value `value`.
  DinicSolver(const FlowNetwork<Capacity>& network, int source, int sink, std::vector<Capacity> residual,
              Capacity value)
      : network_(network),
        source_(source),
        sink_(sink),
        tolerance_(network, source, sink),
        residual_(std::move(residual)),
        distance_(network.vertex_count()),
        current_arc_(network.vertex_count()),
        value_(value) {
    queue_.reserve(network.vertex_count());
    path_.reserve(network.vertex_count());
  }

  // Returns false when the deadline passed before the flow was maximum.
  bool run(flow_detail::Deadline& deadline) {
    deadline_ = &deadline;
    while (compute_distances()) {
      ++phases_;
      if (!augment_blocking_flow()) return false;
    }
    return true;
  }

  Capacity value() const { return value_; }
  const std::vector<Capacity>& residual() const { return residual_; }
  std::vector<Capacity>& residual() { return residual_; }
  flow_detail::AugmentingCounts counts() const { return {paths_, phases_}; }
  const flow_detail::SolverTolerance<Capacity>& tolerance() const { return tolerance_; }

 private:
  static constexpr int kUnreached = -1;
  static constexpr int kDeadEnd = -3;  // never equal to (a live vertex's distance - 1) >= -1

  // Reverse BFS from the sink: distance_[v] = residual hops from v to the sink. Stops as
  // soon as the source is reached, since the DFS never goes beyond the source's distance.
  bool compute_distances() {
    std::fill(distance_.begin(), distance_.end(), kUnreached);
    const int* heads = network_.arc_heads().data();
    const int* reverse = network_.reverse_arcs().data();
    const int* offsets = network_.arc_offsets().data();
    queue_.clear();
    distance_[sink_] = 0;
    queue_.push_back(sink_);
    for (std::size_t next = 0; next < queue_.size(); ++next) {
      const int vertex = queue_[next];
      const int next_distance = distance_[vertex] + 1;
      for (int arc = offsets[vertex]; arc < offsets[vertex + 1]; ++arc) {
        const int tail = heads[arc];  // the arc tail -> vertex is reverse[arc]
        if (distance_[tail] == kUnreached && tolerance_.arc_positive(reverse[arc], residual_[reverse[arc]])) {
          distance_[tail] = next_distance;
          if (tail == source_) return true;
          queue_.push_back(tail);
        }
      }
    }
    return false;
  }

  bool augment_blocking_flow() {
    const int* heads = network_.arc_heads().data();
    const int* reverse = network_.reverse_arcs().data();
    const int* offsets = network_.arc_offsets().data();
    Capacity* residual = residual_.data();
    int* distance = distance_.data();
    std::copy(offsets, offsets + network_.vertex_count(), current_arc_.begin());
    int* current_arc = current_arc_.data();

    path_.clear();
    int vertex = source_;
    while (true) {
      if (deadline_->expired()) return false;
      if (vertex == sink_) {
        Capacity bottleneck = residual[path_.front()];
        for (const int arc : path_) bottleneck = std::min(bottleneck, residual[arc]);
        std::size_t first_saturated = path_.size();
        for (std::size_t i = 0; i < path_.size(); ++i) {
          const int arc = path_[i];
          residual[arc] -= bottleneck;
          residual[reverse[arc]] += bottleneck;
          if (first_saturated == path_.size() && !tolerance_.arc_positive(arc, residual[arc])) first_saturated = i;
        }
        value_ += bottleneck;
        ++paths_;
        // Retreat to the tail of the first saturated arc: everything before it still has room.
        path_.resize(first_saturated);
        vertex = path_.empty() ? source_ : heads[path_.back()];
        continue;
      }
      const int wanted = distance[vertex] - 1;
      const int end = offsets[vertex + 1];
      int arc = current_arc[vertex];
      while (arc < end && !(distance[heads[arc]] == wanted && tolerance_.arc_positive(arc, residual[arc]))) ++arc;
      current_arc[vertex] = arc;
      if (arc < end) {
        path_.push_back(arc);
        vertex = heads[arc];
        continue;
      }
      // Dead end: no admissible arc left. Remove the vertex from this phase and retreat.
      if (vertex == source_) return true;
      distance[vertex] = kDeadEnd;
      path_.pop_back();
      vertex = path_.empty() ? source_ : heads[path_.back()];
      ++current_arc[vertex];
    }
  }

  const FlowNetwork<Capacity>& network_;
  const int source_;
  const int sink_;
  const flow_detail::SolverTolerance<Capacity> tolerance_;
  std::vector<Capacity> residual_;
  std::vector<int> distance_;
  std::vector<int> current_arc_;
  std::vector<int> queue_;
  std::vector<int> path_;  // arcs from the source to the DFS's current vertex
  Capacity value_{};
  long long paths_ = 0;
  int phases_ = 0;
  flow_detail::Deadline* deadline_ = nullptr;
};

}  // namespace

namespace flow_detail {

template <typename Capacity>
std::optional<MaxFlowResult<Capacity>> dinic_until(const FlowNetwork<Capacity>& network, int source, int sink,
                                                   const MaxFlowOptions& options, Deadline deadline) {
  check_terminals(network, source, sink, "dinic");
  DinicSolver<Capacity> solver(network, source, sink);
  if (!solver.run(deadline)) return std::nullopt;
  MaxFlowResult<Capacity> result;
  result.value = solver.value();
  result.source_side = reachable_in_residual(network, solver.residual(), {source}, solver.tolerance());
  if (options.edge_flows) result.edge_flows = edge_flows_from_residual(network, solver.residual());
  result.solver = "dinic";
  return result;
}

template <typename Capacity>
AugmentingCounts augment_to_maximum(const FlowNetwork<Capacity>& network, int source, int sink,
                                    std::vector<Capacity>& residual, Capacity& value) {
  DinicSolver<Capacity> solver(network, source, sink, std::move(residual), value);
  Deadline never;
  solver.run(never);
  value = solver.value();
  residual = std::move(solver.residual());
  return solver.counts();
}

template AugmentingCounts augment_to_maximum(const FlowNetwork<std::int64_t>&, int, int,
                                             std::vector<std::int64_t>&, std::int64_t&);
template AugmentingCounts augment_to_maximum(const FlowNetwork<double>&, int, int, std::vector<double>&,
                                             double&);

template std::optional<MaxFlowResult<std::int64_t>> dinic_until(const FlowNetwork<std::int64_t>&, int, int,
                                                                const MaxFlowOptions&, Deadline);
template std::optional<MaxFlowResult<double>> dinic_until(const FlowNetwork<double>&, int, int,
                                                          const MaxFlowOptions&, Deadline);

}  // namespace flow_detail

template <typename Capacity>
MaxFlowResult<Capacity> dinic(const FlowNetwork<Capacity>& network, int source, int sink,
                              const MaxFlowOptions& options) {
  return *flow_detail::dinic_until(network, source, sink, options, flow_detail::Deadline());
}

template MaxFlowResult<std::int64_t> dinic(const FlowNetwork<std::int64_t>&, int, int, const MaxFlowOptions&);
template MaxFlowResult<double> dinic(const FlowNetwork<double>&, int, int, const MaxFlowOptions&);

}  // namespace metile
