// Matching a rule's pattern (FusionRule::pattern) at an anchor: a small
// backtracking matcher that walks from the anchor to producers through the
// roles named in input slots. Patterns are a handful of entries, so trying both
// orders of each commutative entry costs nothing that matters. A pattern that does not match says
// why (the last failure the matcher met), like every other refusal (metile/decision.h).
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

#include "planner_internal.h"

namespace metile::fusion_internal {
namespace {

struct MatchState {
  std::vector<NodeId> bound;                        // per pattern entry, -1 while unbound
  std::map<std::string, ValueId, std::less<>> values;  // "$name" bindings
  std::vector<std::string> binding_order;              // "$name"s in first-binding order
  std::string why;                                     // the last failure, for the refusal
};

std::string label(const Node& node) { return "`" + node.name + "` (" + node.op + ")"; }

Decision entry_accepts(const OpPattern& entry, const Node& node) {
  if (is_certified_node(node) && !entry.certified) return Decision::refuse(label(node) + " is a certified kernel of its own");
  if (entry.certified && !is_certified_node(node)) {
    return Decision::refuse(fmt::format("role '{}' takes a certified rewrite's op, {} has no certificate", entry.role, label(node)));
  }
  if (node.kind != entry.kind) {
    return Decision::refuse(fmt::format("role '{}' takes {} ops, {} is {}", entry.role, op_kind_name(entry.kind),
                                        label(node), op_kind_name(node.kind)));
  }
  if (!entry.ops.empty() && std::find(entry.ops.begin(), entry.ops.end(), node.op) == entry.ops.end()) {
    std::string ops;
    for (const std::string& op : entry.ops) ops += (ops.empty() ? "" : " or ") + op;
    return Decision::refuse(fmt::format("{} is not {} (role '{}')", label(node), ops, entry.role));
  }
  return Decision::allow();
}

int entry_index(const FusionRule& rule, std::string_view role) {
  for (std::size_t index = 0; index < rule.pattern.size(); ++index) {
    if (rule.pattern[index].role == role) return static_cast<int>(index);
  }
  return -1;
}

bool match_entry(const ComputeGraph& graph, const FusionRule& rule, int entry, NodeId node, MatchState& state);

// Binds the entry's input slots, in the given slot order, then recurses into
// the producers they name.
bool match_inputs(const ComputeGraph& graph, const FusionRule& rule, int entry, NodeId node,
                  const std::vector<std::size_t>& slot_order, MatchState& state) {
  const OpPattern& pattern = rule.pattern[static_cast<std::size_t>(entry)];
  const Node& graph_node = graph.node(node);
  for (std::size_t slot = 0; slot < pattern.inputs.size(); ++slot) {
    const std::string& source = pattern.inputs[slot];
    if (source.empty()) continue;
    const std::size_t actual_slot = slot_order[slot];
    if (actual_slot >= graph_node.inputs.size()) {
      if (source.front() == '$') continue;  // a name binds only what is there
      state.why = fmt::format("{} has no input {} for role '{}'", label(graph_node), actual_slot, source);
      return false;
    }
    const ValueId value = graph_node.inputs[actual_slot];
    if (source.front() == '$') {
      const auto [bound, inserted] = state.values.emplace(source, value);
      if (!inserted && bound->second != value) {
        state.why = fmt::format("{} would be both '{}' and '{}'", source, graph.value(bound->second).name,
                                graph.value(value).name);
        return false;
      }
      if (inserted) state.binding_order.push_back(source);
      continue;
    }
    const NodeId producer = graph.value(value).producer;
    if (producer < 0) {
      state.why = fmt::format("input {} of {} is the graph input '{}', role '{}' wants an op", actual_slot,
                              label(graph_node), graph.value(value).name, source);
      return false;
    }
    const int producer_entry = entry_index(rule, source);
    const NodeId already = state.bound[static_cast<std::size_t>(producer_entry)];
    if (already >= 0) {
      if (already != producer) {
        state.why = fmt::format("role '{}' would be both {} and {}", source, label(graph.node(already)),
                                label(graph.node(producer)));
        return false;
      }
      continue;
    }
    if (!match_entry(graph, rule, producer_entry, producer, state)) return false;
  }
  return true;
}

bool match_entry(const ComputeGraph& graph, const FusionRule& rule, int entry, NodeId node, MatchState& state) {
  const OpPattern& pattern = rule.pattern[static_cast<std::size_t>(entry)];
  if (const Decision accepts = entry_accepts(pattern, graph.node(node)); !accepts) {
    state.why = accepts.reason;
    return false;
  }
  // Two roles never share a node.
  if (std::find(state.bound.begin(), state.bound.end(), node) != state.bound.end()) {
    state.why = fmt::format("{} would take two roles", label(graph.node(node)));
    return false;
  }
  std::vector<std::size_t> identity(pattern.inputs.size());
  for (std::size_t slot = 0; slot < identity.size(); ++slot) identity[slot] = slot;
  std::vector<std::vector<std::size_t>> orders = {identity};
  if (pattern.commutative && identity.size() >= 2) {
    std::vector<std::size_t> swapped = identity;
    std::swap(swapped[0], swapped[1]);
    orders.push_back(swapped);
  }
  std::string first_failure;  // the graph's own operand order says the most about a mismatch
  for (const auto& order : orders) {
    MatchState attempt = state;
    attempt.bound[static_cast<std::size_t>(entry)] = node;
    if (match_inputs(graph, rule, entry, node, order, attempt)) {
      state = std::move(attempt);
      return true;
    }
    if (first_failure.empty()) first_failure = std::move(attempt.why);
  }
  state.why = std::move(first_failure);
  return false;
}

}  // namespace

Decision can_anchor(const ComputeGraph& graph, const FusionRule& rule, NodeId node) {
  const Node& anchor = graph.node(node);
  // A composed rule (FusionRule::composes) has no pattern: it joins other rules' regions.
  if (rule.pattern.empty()) return Decision::refuse(fmt::format("rule '{}' has no pattern to anchor", rule.name));
  if (Decision accepts = entry_accepts(rule.pattern.back(), anchor); !accepts) return accepts;
  if (!rule.anchor_must_be_sink) return Decision::allow();
  for (ValueId output : anchor.outputs) {
    for (NodeId consumer : graph.consumers(output)) {
      if (graph.node(consumer).kind == anchor.kind) {
        return Decision::refuse(fmt::format("{} is read by the {} op {}: the chain does not end there", label(anchor),
                                            op_kind_name(anchor.kind), label(graph.node(consumer))));
      }
    }
  }
  return Decision::allow();
}

PatternMatch match_pattern(const ComputeGraph& graph, const FusionRule& rule, NodeId anchor) {
  PatternMatch match;
  match.decision = can_anchor(graph, rule, anchor);
  if (!match.decision) return match;
  MatchState state;
  state.bound.assign(rule.pattern.size(), -1);
  const int anchor_entry = static_cast<int>(rule.pattern.size()) - 1;
  if (!match_entry(graph, rule, anchor_entry, anchor, state)) {
    match.decision = Decision::refuse(std::move(state.why));
    return match;
  }
  // Entries no input slot reaches would be unconstrained: validate_rule_set forbids them.
  if (std::find(state.bound.begin(), state.bound.end(), -1) != state.bound.end()) {
    throw std::logic_error("match_pattern: rule '" + rule.name + "' has an entry no input slot reaches");
  }
  match.nodes = std::move(state.bound);
  for (const std::string& name : state.binding_order) match.roles.push_back({name.substr(1), state.values.at(name)});
  return match;
}

std::vector<RegionRole> region_roles(const ComputeGraph& graph, const FusionRule& rule, const PatternMatch& match,
                                     std::span<const NodeId> region_nodes) {
  std::vector<RegionRole> roles = match.roles;
  if (rule.epilogue_add_operand_role.empty()) return roles;
  const Node& anchor = graph.node(match.nodes.back());
  for (ValueId output : anchor.outputs) {
    for (NodeId consumer : graph.consumers(output)) {
      const Node& add = graph.node(consumer);
      if (add.op != "add" || add.inputs.size() != 2) continue;
      if (std::find(region_nodes.begin(), region_nodes.end(), consumer) == region_nodes.end()) continue;
      // Either operand order: the residual is whichever operand the anchor did not produce.
      const ValueId other = add.inputs[0] == output ? add.inputs[1] : add.inputs[0];
      if (other == output) continue;  // x + x has no residual
      roles.push_back({rule.epilogue_add_operand_role, other});
      return roles;
    }
  }
  return roles;
}

void validate_input_prologue(const FusionRule& rule) {
  if (!rule.input_prologue) return;
  const std::string where = "rule '" + rule.name + "'";
  const InputPrologue& prologue = *rule.input_prologue;
  if (prologue.role.empty() || prologue.pattern.role.empty()) {
    throw InputError(where + ": an input prologue names the role it produces and its entry's role");
  }
  for (const std::string& source : prologue.pattern.inputs) {
    if (!source.empty() && source.front() != '$') {
      throw InputError(where + ": the input prologue's slot '" + source + "' names an entry; it may bind \"$name\"s only");
    }
  }
}

// A rule's register needs are added up per region and compared with the target's limits
// (estimate_region, within_limits): a negative figure (set from C++ or Python) took registers away,
// so a region that needs more than the target has "fit". Large figures stay legal: the sum saturates
// and the limit check refuses it.
void validate_resource_needs(const FusionRule& rule, const std::string& where) {
  for (const auto& [name, member] : register_need_fields()) {
    if (rule.resources.*member < 0) {
      throw InputError(fmt::format("{}: resources field '{}' must be 0 or more, got {}", where, name,
                                   rule.resources.*member));
    }
  }
}

void validate_rule_set(const RuleSet& rules) {
  if (rules.max_neighborhood_nodes < 1) throw InputError("rule set: max_neighborhood_nodes must be at least 1");
  if (rules.max_exact_component_size < 1 || rules.max_exact_component_size > kMaxExactComponentSizeLimit) {
    throw InputError("rule set: max_exact_component_size must be between 1 and " + std::to_string(kMaxExactComponentSizeLimit));
  }
  std::set<std::string> names;
  for (const FusionRule& rule : rules.rules) {
    // A rule's name is printed in explain() and in DOT labels: no control byte (as a graph's names).
    refuse_control_bytes_in_name(rule.name, "rule set: rule '" + control_bytes_spelled(rule.name) + "': ");
    const std::string where = "rule '" + rule.name + "'";
    if (rule.name.empty()) throw InputError("rule set: a rule has no name");
    if (!names.insert(rule.name).second) throw InputError("rule set: two rules are named '" + rule.name + "'");
    validate_resource_needs(rule, where);  // a composed rule's joined regions are priced with its needs too
    if (!rule.composes.empty()) {
      // A composed rule joins two earlier rules' regions (plan_graph_fusion.cpp); it matches nothing itself.
      if (rule.composes.size() != 2 || rule.composes[0] == rule.composes[1]) {
        throw InputError(where + ": a composed rule names two different rules, producer first");
      }
      for (const std::string& part : rule.composes) {
        if (part == rule.name || !names.contains(part)) {
          throw InputError(where + ": it composes '" + part + "', which is not an earlier rule of the set");
        }
      }
      if (!rule.pattern.empty() || rule.siblings || !rule.companions.empty() || rule.input_prologue) {
        throw InputError(where + ": a composed rule has no pattern, siblings, companions or input prologue of its own");
      }
      continue;
    }
    if (rule.pattern.empty()) throw InputError(where + ": the pattern needs at least the anchor entry");
    std::set<std::string> roles;
    std::vector<bool> reached(rule.pattern.size(), false);
    reached.back() = true;
    for (std::size_t index = 0; index < rule.pattern.size(); ++index) {
      const OpPattern& entry = rule.pattern[index];
      if (entry.role.empty() || entry.role.front() == '$') {
        throw InputError(where + ": pattern entry " + std::to_string(index) + " needs a role name not starting with '$'");
      }
      if (!roles.insert(entry.role).second) throw InputError(where + ": role '" + entry.role + "' appears twice");
      // An op name no node can have, or a binding without a name, makes an entry that never matches: a
      // rule that silently fuses nothing.
      for (const std::string& op : entry.ops) {
        if (find_op(op) == nullptr) {
          throw InputError(where + ": role '" + entry.role + "' allows op '" + control_bytes_spelled(op) +
                           "', which is not a registered op");
        }
      }
      for (const std::string& source : entry.inputs) {
        if (source == "$") throw InputError(where + ": role '" + entry.role + "' has an input slot \"$\" that names no binding");
      }
    }
    // Producers come before their readers, so one backward pass finds every
    // entry the anchor reaches.
    for (std::size_t index = rule.pattern.size(); index-- > 0;) {
      const OpPattern& entry = rule.pattern[index];
      for (const std::string& source : entry.inputs) {
        if (source.empty() || source.front() == '$') continue;
        const int producer = entry_index(rule, source);
        if (producer < 0) throw InputError(where + ": role '" + entry.role + "' reads unknown role '" + source + "'");
        if (producer >= static_cast<int>(index)) {
          throw InputError(where + ": role '" + entry.role + "' reads '" + source +
                           "', which must come earlier in the pattern");
        }
        if (reached[index]) reached[static_cast<std::size_t>(producer)] = true;
      }
    }
    for (std::size_t index = 0; index < rule.pattern.size(); ++index) {
      if (!reached[index]) {
        throw InputError(where + ": role '" + rule.pattern[index].role + "' is not reached from the anchor");
      }
    }
    if (rule.siblings) {
      // Siblings are found through the one entry's bindings (src/fusion/sibling_regions.cpp).
      const auto& inputs = rule.pattern.front().inputs;
      auto binds = [&](const std::string& role) {
        return !role.empty() && std::find(inputs.begin(), inputs.end(), "$" + role) != inputs.end();
      };
      if (rule.pattern.size() != 1 || !binds(rule.siblings->shared_role) || !binds(rule.siblings->member_role) ||
          rule.siblings->shared_role == rule.siblings->member_role || rule.siblings->max_members < 2) {
        throw InputError(where + ": a sibling rule has one pattern entry binding its shared and member roles as "
                                 "different \"$name\" slots, and at least 2 members");
      }
    }
    if (!rule.companions.empty()) {
      // Each companion is a pattern of its own, matched by match_pattern (src/fusion/sibling_regions.cpp).
      if (rule.companion_source_role.empty()) throw InputError(where + ": companion chains need companion_source_role");
      for (const CompanionChain& companion : rule.companions) {
        FusionRule chain;
        chain.name = rule.name + " (companion)";
        chain.pattern = companion.pattern;
        RuleSet alone;
        alone.rules = {chain};
        validate_rule_set(alone);
        if (companion.source_role.empty()) throw InputError(where + ": a companion chain needs a source_role");
      }
    }
    validate_input_prologue(rule);
    for (const GrowthSpec* growth : {&rule.prologue, &rule.epilogue}) {
      if (growth->max_depth < -1) throw InputError(where + ": a growth depth must be -1 (unbounded) or more");
    }
  }
}

}  // namespace metile::fusion_internal

namespace metile {

PrologueMatch match_input_prologue(const ComputeGraph& graph, std::span<const NodeId> region_nodes,
                                   std::span<const RegionRole> roles, const InputPrologue& prologue) {
  PrologueMatch result;
  auto refused = [&](std::string why) {
    result.decision = Decision::refuse(std::move(why));
    return result;
  };
  const auto bound = std::find_if(roles.begin(), roles.end(), [&](const RegionRole& r) { return r.role == prologue.role; });
  if (bound == roles.end()) return refused(fmt::format("the region binds no role '{}'", prologue.role));
  const NodeId producer = graph.value(bound->value).producer;
  if (producer < 0) {
    return refused(fmt::format("'{}' (role '{}') is a graph input", graph.value(bound->value).name, prologue.role));
  }
  auto inside = [&](NodeId node) { return std::find(region_nodes.begin(), region_nodes.end(), node) != region_nodes.end(); };
  if (inside(producer)) return refused(fmt::format("{} is in the region already", fusion_internal::label(graph.node(producer))));
  FusionRule one_entry;
  one_entry.name = "input prologue";
  one_entry.pattern = {prologue.pattern};
  const fusion_internal::PatternMatch match = fusion_internal::match_pattern(graph, one_entry, producer);
  if (!match) return refused(match.decision.reason);
  // From here the producer matches: a refusal names it, so the planner can say why it stays out.
  result.node = producer;
  const auto& graph_outputs = graph.outputs();
  for (ValueId output : graph.node(producer).outputs) {
    if (std::find(graph_outputs.begin(), graph_outputs.end(), output) != graph_outputs.end()) {
      return refused(fmt::format("its value '{}' is a graph output", graph.value(output).name));
    }
    for (NodeId reader : graph.consumers(output)) {
      if (!inside(reader)) {
        return refused(fmt::format("its value '{}' is also read by {}", graph.value(output).name, fusion_internal::label(graph.node(reader))));
      }
    }
  }
  result.decision = Decision::allow();
  result.roles = match.roles;
  return result;
}


std::span<const std::pair<const char*, int ResourceNeeds::*>> register_need_fields() {
  static constexpr std::pair<const char*, int ResourceNeeds::*> fields[] = {
      {"base_registers", &ResourceNeeds::base_registers},
      {"registers_per_elementwise", &ResourceNeeds::registers_per_elementwise},
      {"registers_per_row_reduction", &ResourceNeeds::registers_per_row_reduction},
      {"registers_per_contraction", &ResourceNeeds::registers_per_contraction},
      {"registers_per_quantized_contraction", &ResourceNeeds::registers_per_quantized_contraction},
  };
  return fields;
}

}  // namespace metile
