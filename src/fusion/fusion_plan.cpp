// FusionPlan's three faces: text for a person (explain), JSON for tools (the
// schema of docs/architecture.md, byte-identical for identical plans) and Graphviz DOT with
// one coloured cluster per region.
#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "json_input.h"
#include "metile/fusion.h"

namespace metile {

std::optional<ValueId> FusionRegion::role(std::string_view name) const {
  for (const RegionRole& bound : roles) {
    if (bound.role == name) return bound.value;
  }
  return std::nullopt;
}

FusionRegion region_of_nodes(const ComputeGraph& graph, std::vector<NodeId> nodes, std::string rule) {
  std::sort(nodes.begin(), nodes.end());  // node ids are topological
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  auto inside = [&](NodeId id) { return std::binary_search(nodes.begin(), nodes.end(), id); };
  FusionRegion region;
  region.rule = std::move(rule);
  for (NodeId id : nodes) {
    const Node& node = graph.node(id);
    for (ValueId input : node.inputs) {
      if (inside(graph.value(input).producer)) continue;
      if (std::find(region.inputs.begin(), region.inputs.end(), input) == region.inputs.end()) region.inputs.push_back(input);
    }
    for (ValueId output : node.outputs) {
      const auto& consumers = graph.consumers(output);
      if (graph.is_output(output) || !std::all_of(consumers.begin(), consumers.end(), inside)) {
        region.outputs.push_back(output);
      }
    }
  }
  region.nodes = std::move(nodes);
  return region;
}
namespace {

std::string duration_text(double nanoseconds) {
  if (std::abs(nanoseconds) >= 1000) return fmt::format("{:.3f} µs", nanoseconds / 1000);
  return fmt::format("{:.1f} ns", nanoseconds);
}

std::string counted(std::size_t count, std::string_view noun) {
  return fmt::format("{} {}{}", count, noun, count == 1 ? "" : "s");
}

const ComputeGraph& graph_of(const FusionPlan& plan) {
  if (!plan.graph) throw InputError("fusion plan: it has no graph");
  return *plan.graph;
}

std::string dot_quoted(std::string_view text) {
  std::string quoted = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') quoted += '\\';
    quoted += c;
  }
  return quoted + "\"";
}

// "certificate: law stable_weighted_softmax, verified (4/4 obligations hold)".
// The line describes what the certificate says, "verified" only where that claim agrees with its own
// obligations (every one holds, and there is one); the run checks it (a node's certificate is proved
// again before it runs, and plan_with_discovery refuses one that is not a fresh proof). A field of the wrong type reads as missing: `{"law": 1}` is "law ?", `"verified": "yes"`
// is not verified (nlohmann's value() threw a type_error for them: plan's text ended as an internal error).
std::string certificate_line(const std::string& certificate_json) {
  const nlohmann::json certificate = nlohmann::json::parse(certificate_json, nullptr, false);
  if (certificate.is_discarded() || !certificate.is_object()) return "certificate: unreadable";
  const auto field = [](const nlohmann::json& object, const char* key) {
    const auto found = object.find(key);
    return found == object.end() ? nlohmann::json() : *found;
  };
  const nlohmann::json law = field(certificate, "law");
  const nlohmann::json obligations = field(certificate, "obligations");
  std::size_t holding = 0;
  std::size_t total = 0;
  if (obligations.is_array()) {
    for (const nlohmann::json& obligation : obligations) {
      ++total;
      if (obligation.is_object() && field(obligation, "holds") == true) ++holding;
    }
  }
  return fmt::format("certificate: law {}, {} ({}/{} obligations hold)",
                     law.is_string() ? control_bytes_spelled(law.get<std::string>()) : "?",
                     field(certificate, "verified") == true && total > 0 && holding == total ? "verified" : "NOT verified",
                     holding, total);
}

}  // namespace

double FusionPlan::total_benefit_ns() const {
  double total = 0;
  for (const FusionRegion& region : regions) total += region.benefit_ns;
  return total;
}

std::string FusionPlan::explain() const {
  const ComputeGraph& g = graph_of(*this);
  std::string text = fmt::format("fusion plan for target {}: {} in {} ({} fused), estimated saving {}\n",
                                 target_name.empty() ? "?" : target_name, counted(g.nodes().size(), "op"),
                                 counted(static_cast<std::size_t>(kernel_count()), "kernel"),
                                 counted(regions.size(), "region"), duration_text(total_benefit_ns()));
  auto value_list = [&](const std::vector<ValueId>& values) {
    std::string list;
    for (ValueId value : values) {
      list += (list.empty() ? "" : ", ") + g.value(value).name + " " + g.value(value).spec.to_string();
    }
    return list.empty() ? std::string("-") : list;
  };
  for (std::size_t index = 0; index < regions.size(); ++index) {
    const FusionRegion& region = regions[index];
    std::string ops;
    for (NodeId node : region.nodes) ops += (ops.empty() ? "" : ", ") + g.node(node).name + " (" + g.node(node).op + ")";
    text += fmt::format("  R{} {}: {} ops, saves {}\n", index + 1, region.rule, region.nodes.size(),
                        duration_text(region.benefit_ns));
    text += fmt::format("      ops:     {}\n      reads:   {}\n      writes:  {}\n", ops, value_list(region.inputs),
                        value_list(region.outputs));
    if (!region.roles.empty()) {
      std::string roles;
      for (const RegionRole& bound : region.roles) {
        roles += (roles.empty() ? "" : ", ") + bound.role + "=" + g.value(bound.value).name;
      }
      text += "      roles:   " + roles + "\n";
    }
    if (!region.certificate.empty()) text += "      " + certificate_line(region.certificate) + "\n";
  }
  if (!unfused.empty()) {
    std::string list;
    for (NodeId node : unfused) list += (list.empty() ? "" : ", ") + g.node(node).name + " (" + g.node(node).op + ")";
    text += fmt::format("  unfused, one kernel each: {}\n", list);
  }
  std::map<std::string, int> methods;
  for (const ConflictComponent& component : components) ++methods[component.method];
  std::string method_list;
  for (const auto& [method, count] : methods) method_list += fmt::format("{}{} {}", method_list.empty() ? "" : ", ", count, method);
  int rounds = 1;
  for (const ConflictComponent& component : components) rounds = std::max(rounds, component.round);
  text += fmt::format("conflict selection: {} in {}{}{}\n", counted(candidates.size(), "candidate"),
                      counted(components.size(), "component"), method_list.empty() ? "" : " (" + method_list + ")",
                      rounds == 1 ? "" : fmt::format(", {} rounds (each later one over the ops left unfused)", rounds));
  if (!rewrites.empty()) {
    text += "rewrites before planning:\n";
    for (const std::string& line : rewrites) text += "  " + line + "\n";
  }
  text += "why each op is where it is:\n";
  std::size_t width = 0;
  for (const Node& node : g.nodes()) width = std::max(width, node.name.size());
  for (const Node& node : g.nodes()) {
    const std::string& reason = static_cast<std::size_t>(node.id) < node_reasons.size()
                                    ? node_reasons[static_cast<std::size_t>(node.id)]
                                    : std::string("(no reason recorded)");
    text += fmt::format("  {:<{}}  {}\n", node.name, width, reason);
  }
  return text;
}

std::string FusionPlan::to_json() const {
  const ComputeGraph& g = graph_of(*this);
  using Json = nlohmann::ordered_json;
  auto names = [&](const auto& ids, auto name_of) {
    Json list = Json::array();
    for (auto id : ids) list.push_back(name_of(id));
    return list;
  };
  auto node_name = [&](NodeId id) { return g.node(id).name; };
  auto value_name = [&](ValueId id) { return g.value(id).name; };
  // One region per line keeps the file short and diffable; the bytes depend on
  // the plan alone. Names from C++ callers need not be UTF-8: dump_json replaces their bad bytes.
  std::string text = fmt::format("{{\n  \"kernels\": {},\n  \"regions\": [", kernel_count());
  for (std::size_t index = 0; index < regions.size(); ++index) {
    const FusionRegion& region = regions[index];
    Json entry;
    entry["rule"] = region.rule;
    entry["nodes"] = names(region.nodes, node_name);
    entry["inputs"] = names(region.inputs, value_name);
    entry["outputs"] = names(region.outputs, value_name);
    entry["benefit_ns"] = std::round(region.benefit_ns * 1000) / 1000;
    if (!region.roles.empty()) {
      Json roles = Json::object();  // role -> value name, in binding order
      for (const RegionRole& bound : region.roles) roles[bound.role] = value_name(bound.value);
      entry["roles"] = std::move(roles);
    }
    if (!region.certificate.empty()) {
      // A hand-written graph may carry any text: kept as a string when it is not JSON.
      Json certificate = Json::parse(region.certificate, nullptr, false);
      entry["certificate"] = certificate.is_discarded() ? Json(region.certificate) : std::move(certificate);
    }
    text += (index == 0 ? "\n    " : ",\n    ") + dump_json(entry);
  }
  text += regions.empty() ? "],\n" : "\n  ],\n";
  text += "  \"unfused\": " + dump_json(names(unfused, node_name));
  if (!rewrites.empty()) text += ",\n  \"rewrites\": " + dump_json(Json(rewrites));
  text += "\n}\n";
  return text;
}

std::string FusionPlan::to_dot() const {
  const ComputeGraph& g = graph_of(*this);
  // Fill and border colours, cycled over regions.
  static constexpr const char* palette[][2] = {
      {"#d6e9f8", "#1f77b4"}, {"#fde2c8", "#e6750a"}, {"#d5f0d5", "#2ca02c"}, {"#f8d4d4", "#d62728"},
      {"#e6dcf2", "#9467bd"}, {"#efe0dc", "#8c564b"}, {"#fbdcf0", "#e377c2"}, {"#e9f5c9", "#7f9f1f"},
  };
  auto node_id = [](NodeId id) { return "n" + std::to_string(id); };
  // Graph inputs and outputs are named by position, so the text depends on the
  // graph's structure and names, not on how its value ids were assigned.
  auto input_id = [&g](ValueId id) {
    const auto position = std::find(g.inputs().begin(), g.inputs().end(), id) - g.inputs().begin();
    return "in" + std::to_string(position);
  };
  std::string dot = "digraph fusion_plan {\n  rankdir=TB;\n"
                    "  node [shape=box, style=\"rounded,filled\", fillcolor=white, fontname=\"Helvetica\"];\n";
  dot += fmt::format("  label={}; labelloc=t;\n",
                     dot_quoted(fmt::format("{} for {} on {}, saving {}", counted(kernel_count(), "kernel"), counted(g.nodes().size(), "op"),
                                            target_name, duration_text(total_benefit_ns()))));
  for (std::size_t index = 0; index < regions.size(); ++index) {
    const FusionRegion& region = regions[index];
    const auto& colours = palette[index % std::size(palette)];
    dot += fmt::format("  subgraph cluster_R{} {{\n    label={};\n    style=\"filled,rounded\"; fillcolor=\"{}\"; color=\"{}\";\n",
                       index + 1, dot_quoted(fmt::format("R{} {} (saves {})", index + 1, region.rule,
                                                         duration_text(region.benefit_ns))),
                       colours[0], colours[1]);
    for (NodeId node : region.nodes) {
      dot += fmt::format("    {} [label={}];\n", node_id(node),
                         dot_quoted(g.node(node).name + "\n" + g.node(node).op));
    }
    dot += "  }\n";
  }
  for (NodeId node : unfused) {
    dot += fmt::format("  {} [label={}];\n", node_id(node), dot_quoted(g.node(node).name + "\n" + g.node(node).op));
  }
  for (ValueId input : g.inputs()) {
    const Value& value = g.value(input);
    dot += fmt::format("  {} [label={}, shape=ellipse, style=solid];\n", input_id(input),
                       dot_quoted(value.name + "\n" + value.spec.to_string()));
  }
  for (const Node& node : g.nodes()) {
    for (ValueId input : node.inputs) {
      const NodeId producer = g.value(input).producer;
      dot += fmt::format("  {} -> {};\n", producer >= 0 ? node_id(producer) : input_id(input), node_id(node.id));
    }
  }
  for (std::size_t position = 0; position < g.outputs().size(); ++position) {
    const ValueId output = g.outputs()[position];
    const Value& value = g.value(output);
    const std::string sink = "out" + std::to_string(position);
    dot += fmt::format("  {} [label={}, shape=ellipse, style=dashed];\n", sink, dot_quoted(value.name));
    dot += fmt::format("  {} -> {};\n", value.producer >= 0 ? node_id(value.producer) : input_id(output), sink);
  }
  return dot + "}\n";
}

}  // namespace metile
