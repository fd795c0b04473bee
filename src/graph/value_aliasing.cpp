// Which values of a graph may share another value's buffer (docs/architecture.md, "Device values
// and aliasing"). Pure graph analysis: DeviceValues (src/runtime/cuda/native_runtime.cpp) gives an
// aliased value a view of its owner's buffer, and the native steps of aliased nodes launch nothing
// (reshape, a transpose of size-1 axes) or write only the new rows (kv_cache_write in place).
#include <algorithm>

#include "metile/graph.h"

namespace metile {

bool transpose_moves_only_unit_axes(const ComputeGraph& graph, const Node& node) {
  if (node.op != "transpose") return false;
  const TensorSpec& in = graph.value(node.inputs[0]).spec;
  const std::vector<std::int64_t>& perm = node.attributes.get_ints("perm");
  const auto rank = static_cast<std::int64_t>(in.rank());
  // The axes longer than one, in the order the output walks them, must keep their input order:
  // then the row-major bytes are the same.
  std::int64_t previous = -1;
  for (std::int64_t axis : perm) {
    if (axis < 0) axis += rank;
    if (in.shape.at(static_cast<std::size_t>(axis)) == 1) continue;
    if (axis < previous) return false;
    previous = axis;
  }
  return true;
}

bool is_view_of_its_input(const ComputeGraph& graph, const Node& node) {
  return node.op == "reshape" || transpose_moves_only_unit_axes(graph, node);
}

std::vector<ValueId> alias_of(const ComputeGraph& graph, const std::vector<bool>& owns_buffer) {
  const std::size_t count = graph.values().size();
  std::vector<ValueId> owner(count);
  for (std::size_t v = 0; v < count; ++v) owner[v] = static_cast<ValueId>(v);
  auto forced_owner = [&](ValueId id) {
    return static_cast<std::size_t>(id) < owns_buffer.size() && owns_buffer[static_cast<std::size_t>(id)];
  };
  std::vector<bool> aliasing_node(graph.nodes().size(), false);  // its output shares its input's buffer
  // Nodes are in topological order, so an input's owner is final when its consumer is reached.
  for (const Node& node : graph.nodes()) {
    if (node.outputs.size() != 1) continue;
    const ValueId out = node.outputs[0];
    if (forced_owner(out)) continue;
    const ValueId source = owner[static_cast<std::size_t>(node.inputs[0])];
    if (is_view_of_its_input(graph, node)) {
      owner[static_cast<std::size_t>(out)] = source;
      aliasing_node[static_cast<std::size_t>(node.id)] = true;
      continue;
    }
    if (node.op != "kv_cache_write") continue;
    // In place only when nothing else can see the old cache: of every read of a value sharing the
    // cache's buffer (reads by the nodes that alias it excepted: they move no byte), this node's is
    // the only one, and none of those values is a graph output. A later reshape of the old cache is
    // a read too (its output is not in the buffer's class yet), so it keeps the copy.
    int reads = 0;
    for (const Node& reader : graph.nodes()) {
      if (aliasing_node[static_cast<std::size_t>(reader.id)]) continue;
      for (ValueId input : reader.inputs) reads += owner[static_cast<std::size_t>(input)] == source ? 1 : 0;
    }
    bool escapes = false;
    for (std::size_t v = 0; v < count; ++v) {
      escapes = escapes || (owner[v] == source && graph.is_output(static_cast<ValueId>(v)));
    }
    if (reads == 1 && !escapes) owner[static_cast<std::size_t>(out)] = source;
  }
  return owner;
}

}  // namespace metile
