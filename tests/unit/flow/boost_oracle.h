// Boost.Graph's push_relabel_max_flow as an independent oracle for the flow tests:
// a different code base, a different graph representation, the same answer expected.
#pragma once

// Boost checks its own flow with exact equalities (BOOST_ASSERT(is_flow())), which rounding
// breaks on irregular real capacities in debug builds; its value is still right within
// tolerance, which is all the tests ask of it.
#ifndef BOOST_DISABLE_ASSERTS
#define BOOST_DISABLE_ASSERTS
#endif

#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/push_relabel_max_flow.hpp>
#include <vector>

#include "metile/flow.h"

namespace metile::testing {

// Our edges as a Boost.Graph flow network: each edge with a zero-capacity reverse twin,
// as Boost's max-flow algorithms expect. Shared with benchmarks/max_flow, which races
// push_relabel and boykov_kolmogorov on the same representation.
using BoostFlowTraits = boost::adjacency_list_traits<boost::vecS, boost::vecS, boost::directedS>;
template <typename Capacity>
using BoostFlowGraph = boost::adjacency_list<
    boost::vecS, boost::vecS, boost::directedS, boost::no_property,
    boost::property<
        boost::edge_capacity_t, Capacity,
        boost::property<boost::edge_residual_capacity_t, Capacity,
                        boost::property<boost::edge_reverse_t, BoostFlowTraits::edge_descriptor>>>>;

template <typename Capacity>
BoostFlowGraph<Capacity> make_boost_flow_graph(int vertex_count,
                                               const std::vector<FlowEdge<Capacity>>& edges) {
  BoostFlowGraph<Capacity> graph(vertex_count);
  auto capacity = boost::get(boost::edge_capacity, graph);
  auto reverse = boost::get(boost::edge_reverse, graph);
  for (const FlowEdge<Capacity>& edge : edges) {
    if (edge.from == edge.to) continue;  // Boost mishandles loops; they carry no flow anyway
    const auto forward = boost::add_edge(edge.from, edge.to, graph).first;
    const auto backward = boost::add_edge(edge.to, edge.from, graph).first;
    capacity[forward] = edge.capacity;
    capacity[backward] = 0;
    reverse[forward] = backward;
    reverse[backward] = forward;
  }
  return graph;
}

template <typename Capacity>
Capacity boost_max_flow(int vertex_count, const std::vector<FlowEdge<Capacity>>& edges, int source,
                        int sink) {
  BoostFlowGraph<Capacity> graph = make_boost_flow_graph(vertex_count, edges);
  return boost::push_relabel_max_flow(graph, boost::vertex(source, graph), boost::vertex(sink, graph));
}

// The same, on a network's own edges.
template <typename Capacity>
Capacity boost_max_flow(const FlowNetwork<Capacity>& network, int source, int sink) {
  const std::vector<FlowEdge<Capacity>> edges(network.edges().begin(), network.edges().end());
  return boost_max_flow(network.vertex_count(), edges, source, sink);
}

}  // namespace metile::testing
