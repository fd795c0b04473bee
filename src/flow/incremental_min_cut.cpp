// IncrementalMinCut (metile/flow.h): a minimum cut kept current while vertices are forced to the
// sink side, each cut augmenting from the previous maximum flow.
#include <string>

#include "metile/flow.h"
#include "residual_graph.h"

namespace metile {

IncrementalMinCut::IncrementalMinCut(FlowNetworkBuilder<std::int64_t> network, int source, int sink)
    : source_(source), sink_(sink) {
  const int vertex_count = network.vertex_count();
  flow_detail::check_terminals(FlowNetwork<std::int64_t>(vertex_count, std::span<const FlowEdge<std::int64_t>>{}), source,
                              sink, "incremental min cut");
  // One edge from every other vertex to the sink, closed (no residual either way) until its vertex
  // is forced: built in now, so that forcing changes a residual and not the network. Built with
  // capacity 0, so the capacity totals count it only once it is forced (force_to_sink): a fresh
  // network would have its infinite edge then, not before (one of a neighborhood's thousands of
  // ops over huge tensors tipped a planner network past the totals' limit).
  std::vector<int> sink_edge(static_cast<std::size_t>(vertex_count), -1);
  for (int vertex = 0; vertex < vertex_count; ++vertex) {
    if (vertex != source && vertex != sink) sink_edge[static_cast<std::size_t>(vertex)] = network.add_edge(vertex, sink, 0);
  }
  network_ = network.build();
  for (int edge = 0; edge < network_.edge_count(); ++edge) {
    const FlowEdge<std::int64_t>& kept = network_.edge(edge);
    if (network_.edge_is_infinite(edge) && kept.from != kept.to) ++infinite_edges_;
  }
  sink_arc_.assign(static_cast<std::size_t>(vertex_count), -1);
  for (int vertex = 0; vertex < vertex_count; ++vertex) {
    const int edge = sink_edge[static_cast<std::size_t>(vertex)];
    if (edge < 0) continue;
    for (int arc = network_.arc_begin(vertex); arc < network_.arc_end(vertex); ++arc) {
      if (network_.arc_edge(arc) == edge) sink_arc_[static_cast<std::size_t>(vertex)] = arc;
    }
  }
  const auto capacities = network_.arc_capacities();
  residual_.assign(capacities.begin(), capacities.end());
  for (const int arc : sink_arc_) {
    if (arc >= 0) residual_[static_cast<std::size_t>(arc)] = 0;
  }
}

void IncrementalMinCut::force_to_sink(int vertex) {
  if (vertex < 0 || vertex >= network_.vertex_count()) {
    throw InputError("incremental min cut: vertex " + std::to_string(vertex) + " outside [0, " +
                     std::to_string(network_.vertex_count()) + ")");
  }
  if (vertex == source_) throw InputError("incremental min cut: the source cannot be forced to the sink side");
  const int arc = sink_arc_[static_cast<std::size_t>(vertex)];
  if (arc < 0) return;  // the sink
  if (const std::string problem = integer_capacity_totals_problem(network_.finite_capacity_sum(), infinite_edges_ + 1);
      !problem.empty()) {
    throw InputError(problem);
  }
  ++infinite_edges_;
  sink_arc_[static_cast<std::size_t>(vertex)] = -1;  // forced once: later calls change nothing
  // The edge opens as an infinite one with no flow on it: its forward residual is the network's
  // infinite capacity, the reverse stays 0.
  residual_[static_cast<std::size_t>(arc)] = network_.infinite_capacity();
  current_ = false;
}

void IncrementalMinCut::augment() {
  if (current_) return;
  const flow_detail::AugmentingCounts counts =
      flow_detail::augment_to_maximum(network_, source_, sink_, residual_, value_);
  paths_ += counts.paths;
  phases_ += counts.phases;
  source_side_ = flow_detail::reachable_in_residual(network_, residual_, {source_},
                                                    flow_detail::SolverTolerance<std::int64_t>(network_, source_, sink_));
  current_ = true;
}

const std::vector<bool>& IncrementalMinCut::source_side() {
  augment();
  return source_side_;
}

std::int64_t IncrementalMinCut::value() {
  augment();
  return value_;
}

}  // namespace metile
