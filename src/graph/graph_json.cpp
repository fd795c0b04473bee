// JSON graph files (docs/architecture.md, "Formats"): reading with a JSON path in every
// error, nodes accepted in any order (sorted topologically, a cycle reported by
// naming the nodes on it), and a deterministic writer with one input or node per
// line so that files diff well and parse_graph_json(write_graph_json(g)) == g.
#include <algorithm>
#include <limits>
#include <string>
#include <unordered_set>

#include "json_input.h"
#include "metile/graph.h"
#include "metile/io.h"

namespace metile {
namespace {

using Json = nlohmann::json;

struct ParsedNode {
  std::string path;  // "/nodes/3"
  std::string name;  // empty: the builder picks one
  std::string op;
  std::vector<std::string> inputs;
  Attributes attributes;
  std::vector<std::size_t> dependencies;  // indices of nodes whose values this one reads
};

class GraphFileReader {
 public:
  explicit GraphFileReader(std::string_view source) : source_(source) {}

  ComputeGraph read(std::string_view text) {
    const Json document = parse_json_input(text, source_);
    if (!document.is_object()) fail("", "a graph file must be a JSON object with inputs, nodes and outputs");
    check_keys(document, "", {"inputs", "nodes", "outputs", "description"});
    read_inputs(required(document, "", "inputs"));
    std::vector<ParsedNode> nodes = parse_nodes(required(document, "", "nodes"));
    for (std::size_t index : topological_order(nodes)) add_node(nodes[index]);
    return build(required(document, "", "outputs"));
  }

 private:
  // The path and message may quote the file's strings (a key, an unknown value, the names on a
  // cycle): their control bytes are spelled \xNN, since a NUL would end the message (what() is a C
  // string) and an escape sequence would reach the terminal. Other bytes stay: UTF-8 reads as written.
  [[noreturn]] void fail(const std::string& path, const std::string& message) const {
    throw InputError(source_ + ": " + control_bytes_spelled((path.empty() ? "/" : path) + ": " + message));
  }

  const Json& required(const Json& object, const std::string& path, const char* key) const {
    auto found = object.find(key);
    if (found == object.end()) fail(path, std::string("missing '") + key + "'");
    return *found;
  }

  void check_keys(const Json& object, const std::string& path, std::initializer_list<std::string_view> known) const {
    for (const auto& [key, value] : object.items()) {
      if (std::find(known.begin(), known.end(), key) == known.end()) fail(path, "unknown key '" + key + "'");
    }
  }

  std::string string_at(const Json& value, const std::string& path, std::string_view what) const {
    if (!value.is_string()) fail(path, std::string(what) + " must be a string, got " + json_excerpt(value));
    return value.get<std::string>();
  }

  std::int64_t integer_at(const Json& value, const std::string& path) const {
    if (value.is_number_unsigned() && value.get<std::uint64_t>() > std::numeric_limits<std::int64_t>::max()) {
      fail(path, "integer " + json_excerpt(value) + " is too large");
    }
    if (!value.is_number_integer()) fail(path, "expected an integer, got " + json_excerpt(value));
    return value.get<std::int64_t>();
  }

  void read_inputs(const Json& inputs) {
    if (!inputs.is_array()) fail("/inputs", "must be an array");
    for (std::size_t index = 0; index < inputs.size(); ++index) {
      const std::string path = "/inputs/" + std::to_string(index);
      const Json& input = inputs[index];
      if (!input.is_object()) fail(path, "an input must be an object with name, shape and dtype");
      check_keys(input, path, {"name", "shape", "dtype"});
      const std::string name = string_at(required(input, path, "name"), path + "/name", "name");
      TensorSpec spec;
      const Json& shape = required(input, path, "shape");
      if (!shape.is_array()) fail(path + "/shape", "must be an array of integers");
      for (std::size_t axis = 0; axis < shape.size(); ++axis) {
        spec.shape.push_back(integer_at(shape[axis], path + "/shape/" + std::to_string(axis)));
      }
      const std::string dtype = string_at(required(input, path, "dtype"), path + "/dtype", "dtype");
      try {
        spec.dtype = parse_dtype(dtype);
      } catch (const InputError& error) {
        fail(path + "/dtype", error.what());
      }
      if (auto clash = paths_by_name_.find(name); clash != paths_by_name_.end()) {
        fail(path + "/name", "duplicate name '" + name + "' (also " + clash->second + ")");
      }
      paths_by_name_.emplace(name, path);
      try {
        values_.emplace(name, builder_.input(name, spec));
      } catch (const InputError& error) {
        fail(path, error.what());
      }
    }
  }

  // `key`: the attribute's name. A JSON boolean is a flag's value and nothing else (is_flag_attribute).
  AttributeValue attribute_at(const std::string& key, const Json& value, const std::string& path) const {
    if (value.is_boolean()) {
      if (!is_flag_attribute(key)) fail(path, flag_refusal(key));
      return std::int64_t{value.get<bool>() ? 1 : 0};
    }
    if (value.is_number_integer()) return integer_at(value, path);
    if (value.is_number_float()) return value.get<double>();
    if (value.is_string()) return value.get<std::string>();
    if (value.is_array()) {
      std::vector<std::int64_t> integers;
      for (std::size_t index = 0; index < value.size(); ++index) {
        integers.push_back(integer_at(value[index], path + "/" + std::to_string(index)));
      }
      return integers;
    }
    fail(path, "an attribute must be a number, a string or an integer array, got " + json_excerpt(value));
  }

  std::vector<ParsedNode> parse_nodes(const Json& nodes) {
    if (!nodes.is_array()) fail("/nodes", "must be an array");
    std::vector<ParsedNode> parsed(nodes.size());
    std::map<std::string, std::size_t, std::less<>> index_by_name;
    for (std::size_t index = 0; index < nodes.size(); ++index) {
      ParsedNode& node = parsed[index];
      node.path = "/nodes/" + std::to_string(index);
      const Json& description = nodes[index];
      if (!description.is_object()) fail(node.path, "a node must be an object with name, op, inputs and attrs");
      check_keys(description, node.path, {"name", "op", "inputs", "attrs"});
      if (description.contains("name")) {
        node.name = string_at(description["name"], node.path + "/name", "name");
        if (node.name.empty()) fail(node.path + "/name", "name is empty");
        if (auto clash = paths_by_name_.find(node.name); clash != paths_by_name_.end()) {
          fail(node.path + "/name", "duplicate name '" + node.name + "' (also " + clash->second + ")");
        }
        paths_by_name_.emplace(node.name, node.path);
        index_by_name.emplace(node.name, index);
      }
      node.op = string_at(required(description, node.path, "op"), node.path + "/op", "op");
      const Json& inputs = required(description, node.path, "inputs");
      if (!inputs.is_array()) fail(node.path + "/inputs", "must be an array of value names");
      for (std::size_t position = 0; position < inputs.size(); ++position) {
        node.inputs.push_back(string_at(inputs[position], node.path + "/inputs/" + std::to_string(position), "an input"));
      }
      if (description.contains("attrs")) {
        const Json& attributes = description["attrs"];
        if (!attributes.is_object()) fail(node.path + "/attrs", "must be an object");
        for (const auto& [key, value] : attributes.items()) {
          node.attributes.set(key, attribute_at(key, value, node.path + "/attrs/" + key));
        }
      }
    }
    // Resolve what each node reads now that every name is known.
    for (ParsedNode& node : parsed) {
      for (std::size_t position = 0; position < node.inputs.size(); ++position) {
        const std::string& input = node.inputs[position];
        if (values_.find(input) != values_.end()) continue;
        auto producer = index_by_name.find(input);
        if (producer == index_by_name.end() && input.find(':') != std::string::npos) {
          producer = index_by_name.find(std::string_view(input).substr(0, input.rfind(':')));
        }
        if (producer == index_by_name.end()) {
          fail(node.path + "/inputs/" + std::to_string(position), "unknown value '" + input + "'");
        }
        if (std::find(node.dependencies.begin(), node.dependencies.end(), producer->second) == node.dependencies.end()) {
          node.dependencies.push_back(producer->second);
        }
      }
    }
    return parsed;
  }

  // In file order wherever the dependencies allow (schedule takes the earliest ready node), so a
  // file already in topological order keeps its order.
  std::vector<std::size_t> topological_order(const std::vector<ParsedNode>& nodes) const {
    std::vector<std::vector<std::size_t>> waits_on;
    waits_on.reserve(nodes.size());
    for (const ParsedNode& node : nodes) waits_on.push_back(node.dependencies);
    Schedule sorted = schedule(waits_on);
    if (sorted.acyclic()) return std::move(sorted.order);
    const ParsedNode& first = nodes[sorted.cycle.front()];
    std::string cycle;
    for (std::size_t index : sorted.cycle) cycle += nodes[index].name + " <- ";
    cycle += first.name;
    fail(first.path, "node '" + first.name + "' is on a cycle (each reads the next): " + cycle);
  }

  void add_node(const ParsedNode& node) {
    std::vector<ValueRef> inputs;
    for (std::size_t position = 0; position < node.inputs.size(); ++position) {
      auto value = values_.find(node.inputs[position]);
      if (value == values_.end()) {
        fail(node.path + "/inputs/" + std::to_string(position), "unknown value '" + node.inputs[position] + "'");
      }
      inputs.push_back(value->second);
    }
    // An unnamed node is named op_N as the builder would name it, but past the names the file gives
    // to nodes not yet added too: the builder knows only the names recorded so far, so an unnamed exp
    // sorted before a node the file names exp_0 took exp_0 and the file was refused as naming it twice.
    std::string name = node.name;
    if (name.empty() && find_op(node.op) != nullptr) {
      int& next = next_unnamed_[node.op];
      do {
        name = node.op + "_" + std::to_string(next++);
      } while (paths_by_name_.contains(name) || values_.contains(name));
    }
    try {
      for (ValueRef output : builder_.add_node(node.op, inputs, node.attributes, name)) {
        values_.emplace(builder_.name(output), output);
      }
    } catch (const InputError& error) {
      fail(node.path, error.what());
    }
  }

  ComputeGraph build(const Json& outputs) {
    if (!outputs.is_array()) fail("/outputs", "must be an array of value names");
    std::vector<ValueRef> refs;
    std::unordered_set<ValueId> listed;
    for (std::size_t index = 0; index < outputs.size(); ++index) {
      const std::string path = "/outputs/" + std::to_string(index);
      const std::string name = string_at(outputs[index], path, "an output");
      auto value = values_.find(name);
      if (value == values_.end()) fail(path, "unknown value '" + name + "'");
      if (paths_by_name_.contains(name) && paths_by_name_.at(name).starts_with("/inputs")) {
        fail(path, "'" + name + "' is a graph input, not a value produced by the graph");
      }
      if (!listed.insert(value->second.id).second) fail(path, "'" + name + "' is listed twice");
      refs.push_back(value->second);
    }
    try {
      return builder_.build(refs);
    } catch (const InputError& error) {
      fail("/outputs", error.what());
    }
  }

  std::string source_;
  GraphBuilder builder_;
  std::map<std::string, ValueRef, std::less<>> values_;               // every value recorded so far
  std::map<std::string, std::string, std::less<>> paths_by_name_;     // where each name was declared
  std::map<std::string, int, std::less<>> next_unnamed_;              // per op: the next N of op_N to try
};

// Names from C++ callers need not be UTF-8: dump_json replaces their bad bytes.
std::string json_text(const std::string& text) { return dump_json(Json(text)); }

std::string integers_text(const std::vector<std::int64_t>& integers) {
  std::string text = "[";
  for (std::size_t index = 0; index < integers.size(); ++index) {
    if (index > 0) text += ", ";
    text += std::to_string(integers[index]);
  }
  return text + "]";
}

std::string attribute_text(const AttributeValue& value) {
  if (const auto* integer = std::get_if<std::int64_t>(&value)) return std::to_string(*integer);
  if (const auto* number = std::get_if<double>(&value)) return Json(*number).dump();  // shortest round-trip form
  if (const auto* text = std::get_if<std::string>(&value)) return json_text(*text);
  return integers_text(std::get<std::vector<std::int64_t>>(value));
}

}  // namespace

ComputeGraph parse_graph_json(std::string_view text, std::string_view source_name) {
  return GraphFileReader(source_name).read(text);
}

ComputeGraph read_graph(const std::filesystem::path& path) {
  return parse_graph_json(read_input_file(path, kMaximumGraphFileBytes, "graph"), path.string());
}

std::string write_graph_json(const ComputeGraph& graph) {
  std::string out = "{\n  \"inputs\": [";
  for (std::size_t index = 0; index < graph.inputs().size(); ++index) {
    const Value& input = graph.value(graph.inputs()[index]);
    out += index == 0 ? "\n" : ",\n";
    out += "    {\"name\": " + json_text(input.name) + ", \"shape\": " + integers_text(input.spec.shape) +
           ", \"dtype\": \"" + std::string(dtype_name(input.spec.dtype)) + "\"}";
  }
  out += graph.inputs().empty() ? "],\n" : "\n  ],\n";
  out += "  \"nodes\": [";
  for (std::size_t index = 0; index < graph.nodes().size(); ++index) {
    const Node& node = graph.nodes()[index];
    out += index == 0 ? "\n" : ",\n";
    out += "    {\"name\": " + json_text(node.name) + ", \"op\": " + json_text(node.op) + ", \"inputs\": [";
    for (std::size_t position = 0; position < node.inputs.size(); ++position) {
      if (position > 0) out += ", ";
      out += json_text(graph.value(node.inputs[position]).name);
    }
    out += "]";
    if (!node.attributes.entries().empty()) {
      out += ", \"attrs\": {";
      bool first = true;
      for (const auto& [name, value] : node.attributes.entries()) {
        out += (first ? "" : ", ") + json_text(name) + ": " + attribute_text(value);
        first = false;
      }
      out += "}";
    }
    out += "}";
  }
  out += graph.nodes().empty() ? "],\n" : "\n  ],\n";
  out += "  \"outputs\": [";
  for (std::size_t index = 0; index < graph.outputs().size(); ++index) {
    if (index > 0) out += ", ";
    out += json_text(graph.value(graph.outputs()[index]).name);
  }
  out += "]\n}\n";
  return out;
}

}  // namespace metile
