// GraphBuilder and ComputeGraph. The builder checks every op as it is recorded
// (through the registry), so a ComputeGraph is verified by construction: values
// only ever refer to earlier nodes, which makes node order a topological order.
#include <algorithm>
#include <atomic>
#include <bit>
#include <string>
#include <utility>

#include "attributes_of.h"
#include "metile/graph.h"

namespace metile {
namespace {

std::string node_label(std::string_view name, std::string_view op) {
  return "node '" + std::string(name) + "' (" + std::string(op) + ")";
}

}  // namespace

// ---------------------------------------------------------------- TensorSpec limits

void check_tensor_spec(const TensorSpec& spec, std::string_view owner) {
  const std::string who(owner);
  if (spec.shape.size() > static_cast<std::size_t>(kMaximumRank)) {
    throw InputError(who + ": rank " + std::to_string(spec.shape.size()) + " is above the limit of " +
                     std::to_string(kMaximumRank));
  }
  for (std::size_t axis = 0; axis < spec.shape.size(); ++axis) {
    if (spec.shape[axis] <= 0) {
      throw InputError(who + ": dimension " + std::to_string(axis) + " of " + spec.to_string() + " is not positive");
    }
  }
  // Every later size computation (bytes(), a reshape's product, a planner cost) must not overflow.
  std::int64_t elements = 1;
  for (std::int64_t dim : spec.shape) {
    if (__builtin_mul_overflow(elements, dim, &elements) || elements > kMaximumElements) {
      throw InputError(who + ": " + spec.to_string() + " has more than 2^" +
                       std::to_string(std::countr_zero(static_cast<std::uint64_t>(kMaximumElements))) + " elements");
    }
  }
}

// ---------------------------------------------------------------- ComputeGraph

bool ComputeGraph::is_output(ValueId id) const {
  return id >= 0 && static_cast<std::size_t>(id) < value_is_output_.size() && value_is_output_[static_cast<std::size_t>(id)];
}

std::optional<ValueId> ComputeGraph::find_value(std::string_view name) const {
  for (const Value& value : values_) {
    if (value.name == name) return value.id;
  }
  return std::nullopt;
}

std::optional<NodeId> ComputeGraph::find_node(std::string_view name) const {
  for (const Node& node : nodes_) {
    if (node.name == name) return node.id;
  }
  return std::nullopt;
}

bool ComputeGraph::operator==(const ComputeGraph& other) const {
  // Values by name and spec, not by id: a graph file lists its inputs before its nodes, where a
  // builder may record an input between two nodes, and both are one graph (parse_graph_json of
  // write_graph_json gave an unequal graph for it). Node ids are positions, so order still counts.
  // consumers_ and each value's producer follow from the rest.
  const auto same = [&](ValueId mine, ValueId theirs) {
    return values_[static_cast<std::size_t>(mine)].name == other.values_[static_cast<std::size_t>(theirs)].name &&
           values_[static_cast<std::size_t>(mine)].spec == other.values_[static_cast<std::size_t>(theirs)].spec;
  };
  const auto same_list = [&](const std::vector<ValueId>& mine, const std::vector<ValueId>& theirs) {
    if (mine.size() != theirs.size()) return false;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      if (!same(mine[i], theirs[i])) return false;
    }
    return true;
  };
  if (values_.size() != other.values_.size() || nodes_.size() != other.nodes_.size()) return false;
  if (!same_list(inputs_, other.inputs_) || !same_list(outputs_, other.outputs_)) return false;
  for (std::size_t n = 0; n < nodes_.size(); ++n) {
    const Node& mine = nodes_[n];
    const Node& theirs = other.nodes_[n];
    if (mine.name != theirs.name || mine.op != theirs.op || mine.kind != theirs.kind || mine.attributes != theirs.attributes ||
        !same_list(mine.inputs, theirs.inputs) || !same_list(mine.outputs, theirs.outputs)) {
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------- GraphBuilder

std::uint64_t GraphBuilder::next_builder_id() {
  static std::atomic<std::uint64_t> counter{0};
  return ++counter;
}

GraphBuilder::GraphBuilder(const GraphBuilder& other)
    : graph_(other.graph_),
      name_counters_(other.name_counters_),
      name_owners_(other.name_owners_),
      copied_from_(other.copied_from_),
      builder_id_(next_builder_id()) {
  copied_from_.emplace_back(other.builder_id_, other.graph_.values_.size());
}

GraphBuilder& GraphBuilder::operator=(const GraphBuilder& other) {
  if (this != &other) *this = GraphBuilder(other);
  return *this;
}

GraphBuilder::GraphBuilder(GraphBuilder&& other) noexcept
    : graph_(std::exchange(other.graph_, {})),
      name_counters_(std::exchange(other.name_counters_, {})),
      name_owners_(std::exchange(other.name_owners_, {})),
      copied_from_(std::exchange(other.copied_from_, {})),
      builder_id_(std::exchange(other.builder_id_, next_builder_id())) {}

GraphBuilder& GraphBuilder::operator=(GraphBuilder&& other) noexcept {
  if (this != &other) {
    graph_ = std::exchange(other.graph_, {});
    name_counters_ = std::exchange(other.name_counters_, {});
    name_owners_ = std::exchange(other.name_owners_, {});
    copied_from_ = std::exchange(other.copied_from_, {});
    builder_id_ = std::exchange(other.builder_id_, next_builder_id());
  }
  return *this;
}

const Value& GraphBuilder::checked_value(ValueRef value, std::string_view role) const {
  const auto recorded_before_a_copy = [&] {
    return std::any_of(copied_from_.begin(), copied_from_.end(), [&](const auto& source) {
      return source.first == value.builder_id && value.id >= 0 && static_cast<std::size_t>(value.id) < source.second;
    });
  };
  if (value.builder_id != 0 && value.builder_id != builder_id_ && !recorded_before_a_copy()) {
    throw InputError(std::string(role) + " is a value of another GraphBuilder");
  }
  if (value.id < 0 || static_cast<std::size_t>(value.id) >= graph_.values_.size()) {
    throw InputError(std::string(role) + " is not a value of this GraphBuilder (id " + std::to_string(value.id) + ")");
  }
  return graph_.values_[static_cast<std::size_t>(value.id)];
}

std::string GraphBuilder::fresh_name(std::string_view op) const {
  auto counter = name_counters_.find(op);
  int next = counter == name_counters_.end() ? 0 : counter->second;
  std::string name;
  do {
    name = std::string(op) + "_" + std::to_string(next++);
  } while (name_owners_.find(name) != name_owners_.end());
  return name;
}


void GraphBuilder::claim_name(const std::string& name, std::string owner) {
  auto [existing, inserted] = name_owners_.try_emplace(name, owner);
  if (!inserted) throw InputError(owner + ": duplicate name '" + name + "', already used by " + existing->second);
}

ValueRef GraphBuilder::input(std::string name, TensorSpec spec) {
  const std::string owner = "input '" + name + "'";
  if (name.empty()) throw InputError("an input needs a name");
  refuse_control_bytes_in_name(name, control_bytes_spelled(owner) + ": ");
  check_tensor_spec(spec, owner);
  claim_name(name, owner);
  Value value;
  value.id = static_cast<ValueId>(graph_.values_.size());
  value.name = std::move(name);
  value.spec = std::move(spec);
  graph_.values_.push_back(std::move(value));
  graph_.inputs_.push_back(graph_.values_.back().id);
  return ValueRef{graph_.values_.back().id, builder_id_};
}

std::vector<ValueRef> GraphBuilder::add_node(std::string_view op, std::vector<ValueRef> inputs, Attributes attributes,
                                             std::string name) {
  if (name.empty()) name = fresh_name(op.empty() ? std::string_view("node") : op);
  // The op is quoted as printable bytes: an unknown one is the file's text, and a NUL in it would
  // end the message (what() is a C string) before it says what is wrong.
  const std::string owner = node_label(name, printable_bytes(op));
  refuse_control_bytes_in_name(name, control_bytes_spelled(owner) + ": ");
  const OpDefinition* definition = find_op(op);
  if (definition == nullptr) throw InputError(owner + ": unknown op '" + printable_bytes(op) + "'");
  const std::size_t required_inputs = definition->input_names.size() - definition->optional_inputs;
  if (inputs.size() < required_inputs || inputs.size() > definition->input_names.size()) {
    std::string expected;
    for (std::size_t index = 0; index < definition->input_names.size(); ++index) {
      const bool optional = index >= required_inputs;
      expected += (expected.empty() ? "" : ", ") + std::string(optional ? "[" : "") +
                  std::string(definition->input_names[index]) + (optional ? "]" : "");
    }
    const std::string count = definition->optional_inputs == 0
                                  ? std::to_string(required_inputs)
                                  : std::to_string(required_inputs) + " to " + std::to_string(definition->input_names.size());
    throw InputError(owner + ": expects " + count + " inputs (" + expected + "), got " + std::to_string(inputs.size()));
  }
  std::vector<TensorSpec> input_specs;
  std::vector<ValueId> input_ids;
  for (std::size_t index = 0; index < inputs.size(); ++index) {
    const std::string role = "input " + std::to_string(index) + " (" + std::string(definition->input_names[index]) + ")";
    try {
      const Value& value = checked_value(inputs[index], role);
      input_specs.push_back(value.spec);
      input_ids.push_back(value.id);
    } catch (const InputError& error) {
      throw InputError(owner + ": " + error.what());
    }
  }
  std::vector<TensorSpec> output_specs;
  OpKind kind;
  try {
    output_specs = definition->infer(input_specs, attributes);
    kind = op_kind_for(*definition, input_specs, attributes);
  } catch (const InputError& error) {
    throw InputError(owner + ": " + error.what());
  }
  for (const TensorSpec& spec : output_specs) check_tensor_spec(spec, owner + ": output");
  claim_name(name, owner);

  Node node;
  node.id = static_cast<NodeId>(graph_.nodes_.size());
  node.name = name;
  node.op = std::string(op);
  node.kind = kind;
  node.inputs = std::move(input_ids);
  node.attributes = std::move(attributes);
  std::vector<ValueRef> refs;
  for (std::size_t index = 0; index < output_specs.size(); ++index) {
    Value value;
    value.id = static_cast<ValueId>(graph_.values_.size());
    value.name = output_specs.size() == 1 ? name : name + ":" + std::to_string(index);
    if (output_specs.size() > 1) claim_name(value.name, owner);
    value.spec = std::move(output_specs[index]);
    value.producer = node.id;
    value.output_index = static_cast<int>(index);
    node.outputs.push_back(value.id);
    refs.push_back(ValueRef{value.id, builder_id_});
    graph_.values_.push_back(std::move(value));
  }
  graph_.nodes_.push_back(std::move(node));
  // Advance the op's counter past an auto name so the next one does not rescan.
  const std::string prefix = std::string(op) + "_";
  if (name.starts_with(prefix)) {
    const std::string suffix = name.substr(prefix.size());
    if (!suffix.empty() && suffix.size() < 9 && std::all_of(suffix.begin(), suffix.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      int& counter = name_counters_[std::string(op)];
      counter = std::max(counter, std::stoi(suffix) + 1);
    }
  }
  return refs;
}

using graph_detail::attributes_of;

ValueRef GraphBuilder::add(ValueRef a, ValueRef b, std::string name) {
  return add_node("add", {a, b}, {}, std::move(name)).front();
}
ValueRef GraphBuilder::subtract(ValueRef a, ValueRef b, std::string name) {
  return add_node("subtract", {a, b}, {}, std::move(name)).front();
}
ValueRef GraphBuilder::multiply(ValueRef a, ValueRef b, std::string name) {
  return add_node("multiply", {a, b}, {}, std::move(name)).front();
}
ValueRef GraphBuilder::scale(ValueRef x, double factor, std::string name) {
  return add_node("scale", {x}, attributes_of({{"factor", factor}}), std::move(name)).front();
}
ValueRef GraphBuilder::silu(ValueRef x, std::string name) { return add_node("silu", {x}, {}, std::move(name)).front(); }
ValueRef GraphBuilder::gelu(ValueRef x, std::string approximate, std::string name) {
  return add_node("gelu", {x}, attributes_of({{"approximate", std::move(approximate)}}), std::move(name)).front();
}
ValueRef GraphBuilder::exp(ValueRef x, std::string name) { return add_node("exp", {x}, {}, std::move(name)).front(); }
ValueRef GraphBuilder::rms_norm(ValueRef x, ValueRef weight, double eps, std::string name) {
  return add_node("rms_norm", {x, weight}, attributes_of({{"eps", eps}}), std::move(name)).front();
}
ValueRef GraphBuilder::layer_norm(ValueRef x, ValueRef weight, ValueRef bias, double eps, std::string name) {
  return add_node("layer_norm", {x, weight, bias}, attributes_of({{"eps", eps}}), std::move(name)).front();
}
ValueRef GraphBuilder::softmax(ValueRef x, std::int64_t axis, std::string name) {
  return add_node("softmax", {x}, attributes_of({{"axis", axis}}), std::move(name)).front();
}
ValueRef GraphBuilder::sum(ValueRef x, std::string name) { return add_node("sum", {x}, {}, std::move(name)).front(); }
ValueRef GraphBuilder::mean(ValueRef x, std::string name) { return add_node("mean", {x}, {}, std::move(name)).front(); }
ValueRef GraphBuilder::causal_mask(ValueRef x, std::int64_t offset, std::string name) {
  return add_node("causal_mask", {x}, attributes_of({{"offset", offset}}), std::move(name)).front();
}

ValueRef GraphBuilder::position_mask(ValueRef x, ValueRef positions, std::string name) {
  return add_node("position_mask", {x, positions}, {}, std::move(name)).front();
}
ValueRef GraphBuilder::matmul(ValueRef a, ValueRef b, bool transpose_right, std::string name) {
  return add_node("matmul", {a, b}, attributes_of({{"transpose_right", std::int64_t{transpose_right ? 1 : 0}}}),
                  std::move(name))
      .front();
}
ValueRef GraphBuilder::quantized_matmul(ValueRef x, ValueRef packed, ValueRef scales, ValueRef biases, int bits,
                                        int group_size, std::string name) {
  return add_node("quantized_matmul", {x, packed, scales, biases},
                  attributes_of({{"bits", std::int64_t{bits}}, {"group_size", std::int64_t{group_size}}}),
                  std::move(name))
      .front();
}
ValueRef GraphBuilder::rope(ValueRef x, ValueRef positions, double theta, std::int64_t dims, std::string name) {
  return add_node("rope", {x, positions}, attributes_of({{"theta", theta}, {"dims", dims}}), std::move(name)).front();
}
ValueRef GraphBuilder::argmax(ValueRef x, std::string name) {
  return add_node("argmax", {x}, {}, std::move(name)).front();
}
ValueRef GraphBuilder::embedding(ValueRef ids, ValueRef table, std::string name) {
  return add_node("embedding", {ids, table}, {}, std::move(name)).front();
}
ValueRef GraphBuilder::quantized_embedding(ValueRef ids, ValueRef packed, ValueRef scales, ValueRef biases, int bits,
                                           int group_size, std::string name) {
  return add_node("quantized_embedding", {ids, packed, scales, biases},
                  attributes_of({{"bits", std::int64_t{bits}}, {"group_size", std::int64_t{group_size}}}),
                  std::move(name))
      .front();
}
ValueRef GraphBuilder::kv_cache_write(ValueRef cache, ValueRef update, ValueRef positions, std::string name) {
  return add_node("kv_cache_write", {cache, update, positions}, {}, std::move(name)).front();
}
ValueRef GraphBuilder::reshape(ValueRef x, std::vector<std::int64_t> shape, std::string name) {
  return add_node("reshape", {x}, attributes_of({{"shape", std::move(shape)}}), std::move(name)).front();
}
ValueRef GraphBuilder::transpose(ValueRef x, std::vector<std::int64_t> perm, std::string name) {
  return add_node("transpose", {x}, attributes_of({{"perm", std::move(perm)}}), std::move(name)).front();
}
ValueRef GraphBuilder::cast(ValueRef x, DType dtype, std::string name) {
  return add_node("cast", {x}, attributes_of({{"dtype", std::string(dtype_name(dtype))}}), std::move(name)).front();
}

const TensorSpec& GraphBuilder::spec(ValueRef value) const { return checked_value(value, "value").spec; }

const std::string& GraphBuilder::name(ValueRef value) const { return checked_value(value, "value").name; }

void GraphBuilder::rename(ValueRef value, std::string name) {
  const Value& current = checked_value(value, "renamed value");
  if (current.name == name) return;
  const std::string owner = "renaming '" + current.name + "'";
  if (name.empty()) throw InputError(owner + ": the new name is empty");
  Node* node = current.producer >= 0 ? &graph_.nodes_[static_cast<std::size_t>(current.producer)] : nullptr;
  const bool renames_node = node != nullptr && node->outputs.size() == 1;
  const std::string new_owner =
      renames_node ? node_label(name, node->op) : (node ? "value '" + name + "'" : "input '" + name + "'");
  refuse_control_bytes_in_name(name, control_bytes_spelled(new_owner) + ": ");  // before the old name is given up
  if (auto existing = name_owners_.find(name); existing != name_owners_.end()) {
    throw InputError(owner + ": duplicate name '" + name + "', already used by " + existing->second);
  }
  name_owners_.erase(current.name);
  claim_name(name, new_owner);
  if (renames_node) node->name = name;
  graph_.values_[static_cast<std::size_t>(value.id)].name = std::move(name);
}

ComputeGraph GraphBuilder::build(const std::vector<ValueRef>& outputs) const {
  if (outputs.empty()) throw InputError("build: a graph needs at least one output");
  ComputeGraph graph = graph_;
  graph.value_is_output_.assign(graph.values_.size(), false);
  for (std::size_t index = 0; index < outputs.size(); ++index) {
    const std::string role = "output " + std::to_string(index);
    const Value& value = checked_value(outputs[index], "build: " + role);
    if (value.producer < 0) {
      throw InputError("build: " + role + " '" + value.name + "' is a graph input, not a value produced by the graph");
    }
    if (graph.is_output(value.id)) throw InputError("build: output '" + value.name + "' is listed twice");
    graph.outputs_.push_back(value.id);
    graph.value_is_output_[static_cast<std::size_t>(value.id)] = true;
  }
  graph.consumers_.assign(graph.values_.size(), {});
  for (const Node& node : graph.nodes_) {
    for (ValueId input : node.inputs) {
      // A node reading one value twice (multiply(x, x)) is one consumer.
      std::vector<NodeId>& consumers = graph.consumers_[static_cast<std::size_t>(input)];
      if (consumers.empty() || consumers.back() != node.id) consumers.push_back(node.id);
    }
  }
  return graph;
}

}  // namespace metile
