// Matching a rule's pattern (FusionRule::pattern) at an anchor: a small
// backtracking matcher that walks from the anchor to producers through the
// roles named in input slots. Patterns are a handful of entries, so trying both
// orders of each commutative entry costs nothing that matters.
#include <algorithm>
#include <map>
#include <set>

#include "planner_internal.h"

namespace metile::fusion_internal {
namespace {

struct MatchState {
  std::vector<NodeId> bound;                        // per pattern entry, -1 while unbound
  std::map<std::string, ValueId, std::less<>> values;  // "$name" bindings
};

bool entry_accepts(const OpPattern& entry, const Node& node) {
  if (node.kind != entry.kind || is_certified_node(node)) return false;
  return entry.ops.empty() || std::find(entry.ops.begin(), entry.ops.end(), node.op) != entry.ops.end();
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
    if (actual_slot >= graph_node.inputs.size()) return false;
    const ValueId value = graph_node.inputs[actual_slot];
    if (source.front() == '$') {
      const auto [bound, inserted] = state.values.emplace(source, value);
      if (!inserted && bound->second != value) return false;
      continue;
    }
    const NodeId producer = graph.value(value).producer;
    if (producer < 0) return false;
    const int producer_entry = entry_index(rule, source);
    const NodeId already = state.bound[static_cast<std::size_t>(producer_entry)];
    if (already >= 0) {
      if (already != producer) return false;
      continue;
    }
    if (!match_entry(graph, rule, producer_entry, producer, state)) return false;
  }
  return true;
}

bool match_entry(const ComputeGraph& graph, const FusionRule& rule, int entry, NodeId node, MatchState& state) {
  const OpPattern& pattern = rule.pattern[static_cast<std::size_t>(entry)];
  if (!entry_accepts(pattern, graph.node(node))) return false;
  // Two roles never share a node.
  if (std::find(state.bound.begin(), state.bound.end(), node) != state.bound.end()) return false;
  std::vector<std::size_t> identity(pattern.inputs.size());
  for (std::size_t slot = 0; slot < identity.size(); ++slot) identity[slot] = slot;
  std::vector<std::vector<std::size_t>> orders = {identity};
  if (pattern.commutative && identity.size() >= 2) {
    std::vector<std::size_t> swapped = identity;
    std::swap(swapped[0], swapped[1]);
    orders.push_back(swapped);
  }
  for (const auto& order : orders) {
    MatchState attempt = state;
    attempt.bound[static_cast<std::size_t>(entry)] = node;
    if (match_inputs(graph, rule, entry, node, order, attempt)) {
      state = std::move(attempt);
      return true;
    }
  }
  return false;
}

}  // namespace

bool can_anchor(const ComputeGraph& graph, const FusionRule& rule, NodeId node) {
  const Node& anchor = graph.node(node);
  if (!entry_accepts(rule.pattern.back(), anchor)) return false;
  if (!rule.anchor_must_be_sink) return true;
  for (ValueId output : anchor.outputs) {
    for (NodeId consumer : graph.consumers(output)) {
      if (graph.node(consumer).kind == anchor.kind) return false;
    }
  }
  return true;
}

std::optional<std::vector<NodeId>> match_pattern(const ComputeGraph& graph, const FusionRule& rule, NodeId anchor) {
  if (!can_anchor(graph, rule, anchor)) return std::nullopt;
  MatchState state;
  state.bound.assign(rule.pattern.size(), -1);
  const int anchor_entry = static_cast<int>(rule.pattern.size()) - 1;
  if (!match_entry(graph, rule, anchor_entry, anchor, state)) return std::nullopt;
  // Entries no input slot reaches would be unconstrained: validate_rule_set forbids them.
  if (std::find(state.bound.begin(), state.bound.end(), -1) != state.bound.end()) return std::nullopt;
  return state.bound;
}

void validate_rule_set(const RuleSet& rules) {
  if (rules.max_neighborhood_nodes < 1) throw InputError("rule set: max_neighborhood_nodes must be at least 1");
  if (rules.max_exact_component_size < 1 || rules.max_exact_component_size > 40) {
    throw InputError("rule set: max_exact_component_size must be between 1 and 40");
  }
  std::set<std::string> names;
  for (const FusionRule& rule : rules.rules) {
    const std::string where = "rule '" + rule.name + "'";
    if (rule.name.empty()) throw InputError("rule set: a rule has no name");
    if (!names.insert(rule.name).second) throw InputError("rule set: two rules are named '" + rule.name + "'");
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
    for (const GrowthSpec* growth : {&rule.prologue, &rule.epilogue}) {
      if (growth->max_depth < -1) throw InputError(where + ": a growth depth must be -1 (unbounded) or more");
    }
  }
}

}  // namespace metile::fusion_internal
