// Graphviz DOT export of a ComputeGraph: inputs are ellipses, ops are boxes
// labelled "name\nop shape", graph outputs have a double border and an
// "output" marker, edges carry the value they move. `metile plan --format dot`
// and people debugging a graph read this.
#include <string>

#include "metile/graph.h"

namespace metile {
namespace {

// DOT double-quoted string contents: quotes and backslashes escaped; "\n" is
// written by the caller where a line break is wanted.
std::string escaped(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string value_source(const ComputeGraph& graph, ValueId id) {
  const Value& value = graph.value(id);
  return value.producer < 0 ? "input_" + std::to_string(id) : "node_" + std::to_string(value.producer);
}

}  // namespace

std::string graph_to_dot(const ComputeGraph& graph) {
  std::string out = "digraph metile {\n  rankdir=TB;\n  node [fontname=\"monospace\"];\n";
  for (ValueId id : graph.inputs()) {
    const Value& value = graph.value(id);
    out += "  input_" + std::to_string(id) + " [shape=ellipse, label=\"" + escaped(value.name) + "\\n" +
           escaped(value.spec.to_string()) + "\"];\n";
  }
  for (const Node& node : graph.nodes()) {
    std::string shapes;
    bool is_output = false;
    for (ValueId output : node.outputs) {
      shapes += (shapes.empty() ? "" : " ") + graph.value(output).spec.to_string();
      is_output = is_output || graph.is_output(output);
    }
    out += "  node_" + std::to_string(node.id) + " [shape=box, label=\"" + escaped(node.name) + "\\n" +
           escaped(node.op) + " " + escaped(shapes) + "\"" + (is_output ? ", peripheries=2, style=bold" : "") + "];\n";
  }
  for (const Node& node : graph.nodes()) {
    for (ValueId input : node.inputs) {
      out += "  " + value_source(graph, input) + " -> node_" + std::to_string(node.id) + ";\n";
    }
  }
  for (std::size_t index = 0; index < graph.outputs().size(); ++index) {
    const ValueId id = graph.outputs()[index];
    out += "  output_" + std::to_string(index) + " [shape=plaintext, label=\"output " + escaped(graph.value(id).name) +
           "\"];\n";
    out += "  " + value_source(graph, id) + " -> output_" + std::to_string(index) + " [style=dashed];\n";
  }
  out += "}\n";
  return out;
}

}  // namespace metile
