// A fusion region cut out of its graph, so that gates and tournaments can run it alone: its
// inputs become graph inputs with the same names and specs, its nodes are replayed through a
// GraphBuilder with their names and attributes, its outputs become the graph's outputs.
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <set>

#include "metile/dispatch.h"

namespace metile {

ComputeGraph region_graph(const ComputeGraph& graph, const FusionRegion& region) {
  std::vector<NodeId> nodes = region.nodes;
  std::sort(nodes.begin(), nodes.end());
  std::set<ValueId> produced;
  for (NodeId id : nodes) {
    for (ValueId output : graph.node(id).outputs) produced.insert(output);
  }
  GraphBuilder builder;
  std::map<ValueId, ValueRef> mapped;
  auto add_input = [&](ValueId id) {
    if (mapped.contains(id) || produced.contains(id)) return;
    const Value& value = graph.value(id);
    mapped[id] = builder.input(value.name, value.spec);
  };
  for (ValueId input : region.inputs) add_input(input);
  for (NodeId id : nodes) {
    for (ValueId input : graph.node(id).inputs) add_input(input);
  }
  for (NodeId id : nodes) {
    const Node& node = graph.node(id);
    std::vector<ValueRef> inputs;
    for (ValueId input : node.inputs) inputs.push_back(mapped.at(input));
    const std::vector<ValueRef> outputs = builder.add_node(node.op, inputs, node.attributes, node.name);
    for (std::size_t i = 0; i < outputs.size(); ++i) mapped[node.outputs[i]] = outputs[i];
  }
  std::vector<ValueRef> outputs;
  for (ValueId output : region.outputs) {
    if (!produced.contains(output)) {
      throw InputError(fmt::format("region output '{}' is not produced by the region", graph.value(output).name));
    }
    outputs.push_back(mapped.at(output));
  }
  return builder.build(outputs);
}

FusionRegion region_in_region_graph(const ComputeGraph& graph, const FusionRegion& region, const ComputeGraph& sub) {
  FusionRegion mapped;
  mapped.rule = region.rule;
  mapped.benefit_ns = region.benefit_ns;
  auto value_in_sub = [&](ValueId id) {
    const std::string& name = graph.value(id).name;
    const std::optional<ValueId> found = sub.find_value(name);
    if (!found) throw InputError(fmt::format("value '{}' is not in the region graph", name));
    return *found;
  };
  std::vector<NodeId> nodes = region.nodes;
  std::sort(nodes.begin(), nodes.end());
  for (NodeId id : nodes) {
    const std::optional<NodeId> found = sub.find_node(graph.node(id).name);
    if (!found) throw InputError(fmt::format("node '{}' is not in the region graph", graph.node(id).name));
    mapped.nodes.push_back(*found);
  }
  for (ValueId input : region.inputs) mapped.inputs.push_back(value_in_sub(input));
  for (ValueId output : region.outputs) mapped.outputs.push_back(value_in_sub(output));
  for (const RegionRole& bound : region.roles) mapped.roles.push_back({bound.role, value_in_sub(bound.value)});
  // A composed region's parts: every value they name is one of the region's, so in the region graph too.
  for (const FusionRegion& part : region.parts) mapped.parts.push_back(region_in_region_graph(graph, part, sub));
  return mapped;
}

}  // namespace metile
