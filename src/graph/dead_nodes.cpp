// Dead-node removal (include/metile/graph.h, "dead nodes"): the nodes no graph output depends on,
// and the graph rebuilt without them through a GraphBuilder, so the result is checked like any
// recorded graph and keeps every name.
#include <algorithm>

#include "metile/graph.h"

namespace metile {

std::vector<bool> nodes_outputs_depend_on(const ComputeGraph& graph) {
  std::vector<bool> live(graph.nodes().size(), false);
  std::vector<NodeId> pending;
  const auto reach = [&](ValueId value) {
    const NodeId producer = graph.value(value).producer;
    if (producer >= 0 && !live[static_cast<std::size_t>(producer)]) {
      live[static_cast<std::size_t>(producer)] = true;
      pending.push_back(producer);
    }
  };
  for (ValueId output : graph.outputs()) reach(output);
  while (!pending.empty()) {
    const NodeId node = pending.back();
    pending.pop_back();
    for (ValueId input : graph.node(node).inputs) reach(input);
  }
  return live;
}

ComputeGraph without_dead_nodes(const ComputeGraph& graph, std::vector<NodeId>* removed) {
  const std::vector<bool> live = nodes_outputs_depend_on(graph);
  if (removed != nullptr) removed->clear();
  if (std::find(live.begin(), live.end(), false) == live.end()) return graph;
  // Inputs and nodes are recorded again in the order of the values they make, as the graph recorded
  // them: value and node ids stay those of `graph`, less the removed ones.
  GraphBuilder builder;
  std::vector<ValueRef> refs(graph.values().size());
  for (const Value& value : graph.values()) {
    if (value.producer < 0) {
      refs[static_cast<std::size_t>(value.id)] = builder.input(value.name, value.spec);
      continue;
    }
    if (value.output_index != 0) continue;  // recorded with its node's first output
    const Node& node = graph.node(value.producer);
    if (!live[static_cast<std::size_t>(node.id)]) {
      if (removed != nullptr) removed->push_back(node.id);
      continue;
    }
    std::vector<ValueRef> inputs;
    for (ValueId input : node.inputs) inputs.push_back(refs[static_cast<std::size_t>(input)]);
    const std::vector<ValueRef> outputs = builder.add_node(node.op, std::move(inputs), node.attributes, node.name);
    for (std::size_t index = 0; index < outputs.size(); ++index) {
      const std::string& name = graph.value(node.outputs[index]).name;
      if (builder.name(outputs[index]) != name) builder.rename(outputs[index], name);  // a renamed value of a multi-output node
      refs[static_cast<std::size_t>(node.outputs[index])] = outputs[index];
    }
  }
  std::vector<ValueRef> outputs;
  for (ValueId output : graph.outputs()) outputs.push_back(refs[static_cast<std::size_t>(output)]);
  return builder.build(outputs);
}

}  // namespace metile
