// Certificates for a max-flow result: a flow that respects capacities and
// conservation, and a cut whose capacity equals the flow's value, prove each other
// optimal (weak duality), so verify() needs no second solver.
#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>

#include "capacity_text.h"
#include "metile/flow.h"

namespace metile {
namespace {

template <typename Capacity>
FlowCheck failure(std::string problem) {
  return FlowCheck{false, std::move(problem)};
}

}  // namespace

template <typename Capacity>
Capacity cut_capacity(const FlowNetwork<Capacity>& network, const std::vector<bool>& side) {
  if (static_cast<int>(side.size()) != network.vertex_count()) {
    throw InputError("cut_capacity: the side has " + std::to_string(side.size()) + " entries for " +
                     std::to_string(network.vertex_count()) + " vertices");
  }
  Capacity total{};
  for (const FlowEdge<Capacity>& edge : network.edges()) {
    if (side[edge.from] && !side[edge.to]) total += edge.capacity;
  }
  return total;
}

template <typename Capacity>
std::vector<int> cut_edges(const FlowNetwork<Capacity>& network, const std::vector<bool>& side) {
  if (static_cast<int>(side.size()) != network.vertex_count()) {
    throw InputError("cut_edges: the side has " + std::to_string(side.size()) + " entries for " +
                     std::to_string(network.vertex_count()) + " vertices");
  }
  std::vector<int> crossing;
  for (int e = 0; e < network.edge_count(); ++e) {
    const FlowEdge<Capacity>& edge = network.edge(e);
    if (side[edge.from] && !side[edge.to]) crossing.push_back(e);
  }
  return crossing;
}

template <typename Capacity>
FlowCheck verify(const FlowNetwork<Capacity>& network, int source, int sink,
                 const MaxFlowResult<Capacity>& result,
                 std::optional<FlowTolerance<Capacity>> tolerance_override) {
  const FlowTolerance<Capacity> tolerance =
      tolerance_override.value_or(FlowTolerance<Capacity>::for_network(network));
  const int n = network.vertex_count();
  if (source < 0 || source >= n || sink < 0 || sink >= n || source == sink) {
    return failure<Capacity>("source " + std::to_string(source) + " / sink " + std::to_string(sink) +
                             " are not two distinct vertices of a " + std::to_string(n) + "-vertex network");
  }
  if constexpr (std::is_floating_point_v<Capacity>) {
    if (!std::isfinite(result.value))
      return failure<Capacity>("flow value " + capacity_text(result.value) + " is not finite");
  }
  if (static_cast<int>(result.source_side.size()) != n) {
    return failure<Capacity>("source side has " + std::to_string(result.source_side.size()) +
                             " entries for " + std::to_string(n) + " vertices");
  }
  if (!result.source_side[source]) return failure<Capacity>("the source is not on the source side");
  if (result.source_side[sink]) return failure<Capacity>("the sink is on the source side");
  const Capacity cut = cut_capacity(network, result.source_side);
  if (!tolerance.equal(cut, result.value)) {
    return failure<Capacity>("cut capacity " + capacity_text(cut) + " differs from the flow value " +
                             capacity_text(result.value));
  }
  if (result.edge_flows.empty()) return {};

  if (static_cast<int>(result.edge_flows.size()) != network.edge_count()) {
    return failure<Capacity>("edge_flows has " + std::to_string(result.edge_flows.size()) + " entries for " +
                             std::to_string(network.edge_count()) + " edges");
  }
  std::vector<Capacity> net_outflow(n, Capacity{});
  for (int e = 0; e < network.edge_count(); ++e) {
    const FlowEdge<Capacity>& edge = network.edge(e);
    const Capacity flow = result.edge_flows[e];
    if constexpr (std::is_floating_point_v<Capacity>) {
      if (!std::isfinite(flow))
        return failure<Capacity>("edge " + std::to_string(e) + " carries a non-finite flow");
    }
    if (tolerance.less(flow, Capacity{}) || tolerance.less(edge.capacity, flow)) {
      return failure<Capacity>("edge " + std::to_string(e) + " (" + std::to_string(edge.from) + " -> " +
                               std::to_string(edge.to) + ") carries " + capacity_text(flow) +
                               " outside [0, " + capacity_text(edge.capacity) + "]");
    }
    if (edge.from == edge.to) continue;
    net_outflow[edge.from] += flow;
    net_outflow[edge.to] -= flow;
  }
  for (int v = 0; v < n; ++v) {
    if (v == source || v == sink) continue;
    if (!tolerance.equal(net_outflow[v], Capacity{})) {
      return failure<Capacity>("conservation fails at vertex " + std::to_string(v) + ": net outflow " +
                               capacity_text(net_outflow[v]));
    }
  }
  if (!tolerance.equal(net_outflow[source], result.value)) {
    return failure<Capacity>("the source's net outflow " + capacity_text(net_outflow[source]) +
                             " differs from the value " + capacity_text(result.value));
  }
  return {};
}

std::string_view solver_choice_name(SolverChoice choice) {
  switch (choice) {
    case SolverChoice::automatic:
      return "auto";
    case SolverChoice::dinic:
      return "dinic";
    case SolverChoice::hlpp:
      return "hlpp";
    case SolverChoice::ipm:
      return "ipm";
  }
  return "auto";
}

SolverChoice parse_solver_choice(std::string_view name) {
  if (name == "auto" || name == "automatic") return SolverChoice::automatic;
  if (name == "dinic") return SolverChoice::dinic;
  if (name == "hlpp") return SolverChoice::hlpp;
  if (name == "ipm") return SolverChoice::ipm;
  throw InputError("unknown max-flow solver '" + std::string(name) + "' (expected auto, dinic, hlpp or ipm)");
}

template std::int64_t cut_capacity(const FlowNetwork<std::int64_t>&, const std::vector<bool>&);
template double cut_capacity(const FlowNetwork<double>&, const std::vector<bool>&);
template std::vector<int> cut_edges(const FlowNetwork<std::int64_t>&, const std::vector<bool>&);
template std::vector<int> cut_edges(const FlowNetwork<double>&, const std::vector<bool>&);
template FlowCheck verify(const FlowNetwork<std::int64_t>&, int, int, const MaxFlowResult<std::int64_t>&,
                          std::optional<FlowTolerance<std::int64_t>>);
template FlowCheck verify(const FlowNetwork<double>&, int, int, const MaxFlowResult<double>&,
                          std::optional<FlowTolerance<double>>);

}  // namespace metile
