// Sibling grouping (FusionRule::siblings; docs/architecture.md, "Rules"): ops that read one value in
// the same slot and are alike become one kernel (q, k and v as one contraction over their weights
// stacked by rows), each member with its bias add. Unlike the neighborhood cut models, nothing
// here is a choice between growing and not: the members are siblings (no value flows between
// them), so the region is every alike reader, checked for convexity, escapes and limits. The alike
// readers of a value are found once, as classes (SiblingClasses), not by every reader scanning all
// the others: one input read by n contractions cost O(n^2) that way (planner_benchmark, "one
// rms_norm, 50,000 projections": 19 to 29 s, now 0.3 s, the same plans). An anchor that no reader is
// alike names the first readers that differ and counts the rest (refuse_without_alike_readers).
// Companion chains (FusionRule::companions) group the same way one step later: the chains that
// carry sibling contractions' outputs to attention (rope on q and k, k and v written into their
// caches) join as one kernel.
#include <fmt/core.h>

#include <algorithm>
#include <unordered_map>

#include "planner_internal.h"

namespace metile::fusion_internal {
namespace {

std::string quoted(const Node& node) { return "`" + node.name + "`"; }

// The input slot where `rule`'s one entry binds `"$" + role`, or -1.
int slot_of(const FusionRule& rule, const std::string& role) {
  const auto& inputs = rule.pattern.front().inputs;
  const auto found = std::find(inputs.begin(), inputs.end(), "$" + role);
  return found == inputs.end() ? -1 : static_cast<int>(found - inputs.begin());
}

std::string shape_but(const TensorSpec& spec, bool first_axis) {
  std::string text;
  for (std::size_t axis = 0; axis < spec.shape.size(); ++axis) {
    const bool skipped = first_axis ? axis == 0 : axis + 1 == spec.shape.size();
    text += (axis == 0 ? "" : ", ") + (skipped ? std::string("*") : std::to_string(spec.shape[axis]));
  }
  return std::string(dtype_name(spec.dtype)) + " [" + text + "]";
}

// Whether `other` is alike `anchor` (both read the shared value at `shared_slot`), and how it
// differs when not. Alike: same op and attributes; other operands of one dtype and rank and one
// shape but the first axis (stacked by rows); outputs the same but the last axis.
Decision alike(const ComputeGraph& graph, const Node& anchor, const Node& other, int shared_slot) {
  auto differs = [&](const std::string& what) {
    return Decision::refuse(fmt::format("{} differs from {}: {}", quoted(other), quoted(anchor), what));
  };
  if (other.op != anchor.op) return differs(fmt::format("op {}, not {}", other.op, anchor.op));
  if (other.attributes != anchor.attributes) {
    for (const auto& [key, value] : anchor.attributes.entries()) {
      const auto& entries = other.attributes.entries();
      const auto found = entries.find(key);
      if (found == entries.end() || found->second != value) return differs(fmt::format("attribute '{}'", key));
    }
    return differs("its attributes");
  }
  if (other.inputs.size() != anchor.inputs.size() || other.outputs.size() != anchor.outputs.size()) {
    return differs("operand count");
  }
  for (std::size_t slot = 0; slot < anchor.inputs.size(); ++slot) {
    if (static_cast<int>(slot) == shared_slot) continue;
    const std::string a = shape_but(graph.value(anchor.inputs[slot]).spec, true);
    const std::string b = shape_but(graph.value(other.inputs[slot]).spec, true);
    if (a != b || graph.value(anchor.inputs[slot]).spec.rank() == 0) {
      return differs(fmt::format("operand {} is {}, not {}", slot, b, a));
    }
  }
  for (std::size_t k = 0; k < anchor.outputs.size(); ++k) {
    const std::string a = shape_but(graph.value(anchor.outputs[k]).spec, false);
    const std::string b = shape_but(graph.value(other.outputs[k]).spec, false);
    if (a != b) return differs(fmt::format("output {} is {}, not {}", k, b, a));
  }
  return Decision::allow();
}

NodeId other_reader(const std::vector<NodeId>& readers, NodeId reader) {
  return *std::find_if(readers.begin(), readers.end(), [&](NodeId r) { return r != reader; });
}

// The member's bias add: its one output's only reader, an `add` of a vector as long as the
// output's last axis. Refused (with why) when there is an add that cannot join; nullopt when the
// member has no such reader at all.
struct BiasAdd {
  NodeId add = -1;
  ValueId bias = -1;
};
std::optional<BiasAdd> bias_add_of(const ComputeGraph& graph, const GraphIndex& index, const Node& member,
                                   std::vector<std::pair<NodeId, std::string>>& left_out) {
  if (member.outputs.size() != 1 || graph.value(member.outputs.front()).spec.rank() == 0) return std::nullopt;
  const ValueId output = member.outputs.front();
  const auto& readers = graph.consumers(output);
  for (NodeId reader : readers) {
    const Node& add = graph.node(reader);
    if (add.op != "add" || add.inputs.size() != 2 || is_certified_node(add)) continue;
    const ValueId other = add.inputs[0] == output ? add.inputs[1] : add.inputs[0];
    const TensorSpec& spec = graph.value(output).spec;
    const TensorSpec& bias = graph.value(other).spec;
    if (other == output || bias.rank() != 1 || bias.shape[0] != spec.shape.back() || bias.dtype != spec.dtype ||
        graph.value(add.outputs.front()).spec != spec) {
      continue;  // not a bias: a residual or another operand stays outside
    }
    if (index.value_is_output[static_cast<std::size_t>(output)] || readers.size() > 1) {
      left_out.emplace_back(reader, fmt::format("not a bias epilogue: the intermediate {} is also {}", quoted(member),
                                                index.value_is_output[static_cast<std::size_t>(output)]
                                                    ? "a graph output"
                                                    : "read by " + quoted(graph.node(other_reader(readers, reader)))));
      return std::nullopt;
    }
    return BiasAdd{reader, other};
  }
  return std::nullopt;
}

// Whether `region` (ascending) is convex: no path leaves it and comes back. Refused with the op
// the path passes through outside. Node ids are topological, so searches stop at the last member.
Decision convex(const ComputeGraph& graph, const GraphIndex& index, const std::vector<NodeId>& region) {
  const NodeId last = region.back();
  std::vector<char> reached(graph.nodes().size(), 0);
  std::vector<NodeId> stack;
  auto inside = [&](NodeId node) { return std::binary_search(region.begin(), region.end(), node); };
  for (NodeId start : region) {
    for (NodeId next : index.consumer_nodes[static_cast<std::size_t>(start)]) {
      if (!inside(next) && next < last && !reached[static_cast<std::size_t>(next)]) {
        reached[static_cast<std::size_t>(next)] = 1;
        stack.push_back(next);
      }
    }
  }
  while (!stack.empty()) {
    const NodeId current = stack.back();
    stack.pop_back();
    for (NodeId next : index.consumer_nodes[static_cast<std::size_t>(current)]) {
      if (inside(next)) {
        return Decision::refuse(fmt::format("not convex: a path leaves the group through {} and comes back at {}",
                                            quoted(graph.node(current)), quoted(graph.node(next))));
      }
      if (next < last && !reached[static_cast<std::size_t>(next)]) {
        reached[static_cast<std::size_t>(next)] = 1;
        stack.push_back(next);
      }
    }
  }
  return Decision::allow();
}

ValueId role_value(const std::vector<RegionRole>& roles, std::string_view name) {
  const auto found = std::find_if(roles.begin(), roles.end(), [&](const RegionRole& role) { return role.role == name; });
  return found == roles.end() ? ValueId{-1} : found->value;
}

// The contraction a value comes from: its producer, or the contraction behind a bias add. -1: none.
NodeId source_contraction(const ComputeGraph& graph, ValueId value) {
  const NodeId producer = graph.value(value).producer;
  if (producer < 0) return -1;
  const Node& node = graph.node(producer);
  if (node.kind == OpKind::contraction) return producer;
  if (node.op != "add") return -1;
  for (ValueId operand : node.inputs) {
    const NodeId inner = graph.value(operand).producer;
    if (inner >= 0 && graph.node(inner).kind == OpKind::contraction) return inner;
  }
  return -1;
}

NodeId role_node(const FusionRule& chain, const PatternMatch& match, std::string_view role) {
  for (std::size_t entry = 0; entry < chain.pattern.size(); ++entry) {
    if (chain.pattern[entry].role == role) return match.nodes[entry];
  }
  return -1;
}

// The one match of `companion` beside `match` (whose source contraction is `contraction`), or why none.
struct CompanionMatch {
  Decision decision = Decision::allow();
  PatternMatch match;
};
CompanionMatch match_companion(const ComputeGraph& graph, const FusionRule& rule, const CompanionChain& companion,
                               const PatternMatch& match, NodeId contraction) {
  FusionRule chain;
  chain.name = rule.name;
  chain.pattern = companion.pattern;
  const std::string& anchor_role = companion.pattern.back().role;
  // Candidates: the readers of a value the rule's pattern bound, in the slot where the companion's
  // anchor names it (the positions).
  std::vector<NodeId> candidates;
  const auto& slots = companion.pattern.back().inputs;
  for (std::size_t slot = 0; slot < slots.size(); ++slot) {
    if (slots[slot].empty() || slots[slot].front() != '$') continue;
    const ValueId value = role_value(match.roles, std::string_view(slots[slot]).substr(1));
    if (value < 0) continue;
    for (NodeId reader : graph.consumers(value)) {
      const Node& node = graph.node(reader);
      if (slot < node.inputs.size() && node.inputs[slot] == value &&
          std::find(match.nodes.begin(), match.nodes.end(), reader) == match.nodes.end()) {
        candidates.push_back(reader);
      }
    }
  }
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  const ValueId activation = graph.node(contraction).inputs.front();
  std::vector<PatternMatch> found;
  for (NodeId candidate : candidates) {
    PatternMatch other = match_pattern(graph, chain, candidate);
    if (!other) continue;
    const bool agrees = std::all_of(other.roles.begin(), other.roles.end(), [&](const RegionRole& role) {
      const ValueId shared = role_value(match.roles, role.role);
      return shared < 0 || shared == role.value;
    });
    const ValueId source = role_value(other.roles, companion.source_role);
    const NodeId sibling = source < 0 ? NodeId{-1} : source_contraction(graph, source);
    if (!agrees || sibling < 0 || sibling == contraction || graph.node(sibling).inputs.front() != activation) continue;
    found.push_back(std::move(other));
  }
  if (found.size() != 1) {
    return {Decision::refuse(fmt::format("{} chains ending in '{}' carry the output of a sibling of `{}`, not one",
                                         found.size(), anchor_role, graph.node(contraction).name)),
            {}};
  }
  for (const auto& [mine, theirs] : companion.same_attributes) {
    const NodeId a = role_node(chain, found.front(), mine);
    const NodeId b = role_node(rule, match, theirs);
    if (a >= 0 && b >= 0 && graph.node(a).attributes != graph.node(b).attributes) {
      return {Decision::refuse(fmt::format("{} and {} differ in their attributes: one kernel applies one {}",
                                           quoted(graph.node(a)), quoted(graph.node(b)), graph.node(a).op)),
              {}};
    }
  }
  return {Decision::allow(), std::move(found.front())};
}

// The readers of `shared` in `shared_slot`, ascending, each once: those the sibling rule compares.
std::vector<NodeId> readers_in_slot(const ComputeGraph& graph, ValueId shared, int shared_slot) {
  std::vector<NodeId> readers;
  for (NodeId reader : graph.consumers(shared)) {
    const std::vector<ValueId>& inputs = graph.node(reader).inputs;
    if (inputs.size() > static_cast<std::size_t>(shared_slot) && inputs[static_cast<std::size_t>(shared_slot)] == shared) {
      readers.push_back(reader);
    }
  }
  std::sort(readers.begin(), readers.end());
  readers.erase(std::unique(readers.begin(), readers.end()), readers.end());
  return readers;
}

// The two answers the scan and the classes must word alike (tests compare them): the anchor follows
// an earlier alike reader that leads its group, and a reader past the rule's member limit.
void follow_leader(const Node& leader, SiblingOutcome& outcome) {
  outcome.decision = Decision::refuse(fmt::format("{} leads the group", quoted(leader)));
  outcome.follower = true;
}
std::string beyond_member_limit(const ComputeGraph& graph, const FusionRule& rule, ValueId shared) {
  return fmt::format("beyond rule {}'s {} members reading `{}`", rule.name, rule.siblings->max_members, graph.value(shared).name);
}

// The refusal of an anchor that no other reader of the shared value is alike: the first
// kListedDifferences readers that differ and by what, then how many more. Naming every one cost
// O(readers) of text an anchor, O(readers^2) in all for one input read by many unlike ops (one 3.5 MB
// reason at 50,000). `alone`: no other reader of the pattern's kind at all.
constexpr std::size_t kListedDifferences = 4;
void refuse_without_alike_readers(const ComputeGraph& graph, const Node& anchor, ValueId shared, int shared_slot,
                                  const std::vector<std::string>& listed, std::size_t differing,
                                  SiblingOutcome& outcome) {
  std::string why = fmt::format("no other {} op reads `{}` as its operand {}", op_kind_name(anchor.kind),
                                graph.value(shared).name, shared_slot);
  for (const std::string& difference : listed) why += "; " + difference;
  if (differing > listed.size()) why += fmt::format("; and {} more readers differ", differing - listed.size());
  outcome.decision = Decision::refuse(std::move(why));
  outcome.alone = differing == 0;
}

// The alike readers of the shared value in the same slot, in topological order, the anchor one of
// them: `members` (two at least), or a refusal in `outcome`. The relation is an equality of
// signatures, so every member would find the same group: the first proposes it. Every reader of the
// value is compared with the anchor: O(readers) an anchor.
void scanned_members(const ComputeGraph& graph, const FusionRule& rule, const Node& anchor, int shared_slot,
                     SiblingOutcome& outcome, std::vector<NodeId>& members) {
  const SiblingSpec& spec = *rule.siblings;
  const ValueId shared = anchor.inputs[static_cast<std::size_t>(shared_slot)];
  std::vector<std::string> differences;  // the first kListedDifferences
  std::size_t differing = 0;
  for (NodeId reader : readers_in_slot(graph, shared, shared_slot)) {
    const Node& other = graph.node(reader);
    if (reader != anchor.id) {
      if (!match_pattern(graph, rule, reader)) continue;  // not an op of the pattern's kind
      if (const Decision same = alike(graph, anchor, other, shared_slot); !same) {
        if (differing++ < kListedDifferences) differences.push_back(same.reason);
        continue;
      }
      if (reader < anchor.id) {
        // An earlier member leads the same group (the relation is an equality): it proposes it.
        follow_leader(other, outcome);
        return;
      }
    }
    if (static_cast<int>(members.size()) >= spec.max_members) {
      outcome.left_out.emplace_back(reader, beyond_member_limit(graph, rule, shared));
      continue;
    }
    members.push_back(reader);
  }
  if (std::find(members.begin(), members.end(), anchor.id) == members.end()) {
    outcome.decision = Decision::refuse(fmt::format("{} is beyond the group's {} members", quoted(anchor), spec.max_members));
    return;
  }
  if (members.size() < 2) refuse_without_alike_readers(graph, anchor, shared, shared_slot, differences, differing, outcome);
}

// The shared value's readers in `classes`, found on its first anchor: each reader that the scan
// would compare (in the slot, of the pattern's kind) joins the class whose first member it is
// alike. `alike` is an equality of everything it compares, so one comparison with a class's first
// member decides, and classes are only looked for among those of the reader's signature (the op and
// the formats `alike` compares, without the attributes, which have no hash: attributes alone tell
// few classes apart). A reader with a scalar operand is alike none (`alike` refuses an anchor with
// one): a class of its own, never compared.
const SiblingClasses::OfValue& classes_of(const ComputeGraph& graph, const FusionRule& rule, int shared_slot,
                                          ValueId shared, SiblingClasses& classes) {
  auto [found, fresh] = classes.of_value.try_emplace(shared);
  SiblingClasses::OfValue& of = found->second;
  if (!fresh) return of;
  std::unordered_map<std::string, std::vector<int>> by_signature;
  for (NodeId reader : readers_in_slot(graph, shared, shared_slot)) {
    const Node& node = graph.node(reader);
    if (!match_pattern(graph, rule, reader)) continue;
    std::string signature = fmt::format("{} {} {}", node.op, node.inputs.size(), node.outputs.size());
    bool scalar = false;
    for (std::size_t slot = 0; slot < node.inputs.size(); ++slot) {
      if (static_cast<int>(slot) == shared_slot) continue;
      scalar = scalar || graph.value(node.inputs[slot]).spec.rank() == 0;
      signature += "\n" + shape_but(graph.value(node.inputs[slot]).spec, true);
    }
    for (ValueId output : node.outputs) signature += "\n" + shape_but(graph.value(output).spec, false);
    int joined = -1;
    std::vector<int>* candidates = scalar ? nullptr : &by_signature[signature];
    if (candidates != nullptr) {
      for (int c : *candidates) {
        if (alike(graph, graph.node(of.classes[static_cast<std::size_t>(c)].front()), node, shared_slot)) {
          joined = c;
          break;
        }
      }
    }
    if (joined < 0) {
      joined = static_cast<int>(of.classes.size());
      of.classes.emplace_back();
      if (candidates != nullptr) candidates->push_back(joined);
    }
    of.readers.push_back(reader);
    of.class_of.push_back(joined);
    of.classes[static_cast<std::size_t>(joined)].push_back(reader);
  }
  return of;
}

// scanned_members' answer from the anchor's class (its alike readers, ascending), in the class's
// size: its first member leads (the anchor follows, named as the scan names the first alike reader
// it meets), or the anchor is the first and the class, up to the limit, is the group (the rest left
// out, in the scan's order). An anchor alone in its class is refused with the first readers of the
// others (every other reader differs from it), as the scan words it. false, for the scan to answer,
// where a class of several makes a group of fewer than two ops (a limit under two members) and for
// a reader that is not the pattern's (never, from propose_regions).
bool indexed_members(const ComputeGraph& graph, const FusionRule& rule, const Node& anchor, int shared_slot,
                     SiblingClasses& classes, SiblingOutcome& outcome, std::vector<NodeId>& members) {
  const SiblingSpec& spec = *rule.siblings;
  const ValueId shared = anchor.inputs[static_cast<std::size_t>(shared_slot)];
  const SiblingClasses::OfValue& of = classes_of(graph, rule, shared_slot, shared, classes);
  const auto position = std::lower_bound(of.readers.begin(), of.readers.end(), anchor.id);
  if (position == of.readers.end() || *position != anchor.id) return false;  // not of the pattern's kind
  const std::vector<NodeId>& same = of.classes[static_cast<std::size_t>(of.class_of[position - of.readers.begin()])];
  if (same.front() < anchor.id) {
    follow_leader(graph.node(same.front()), outcome);
    return true;
  }
  if (same.size() == 1 && spec.max_members >= 1) {
    std::vector<std::string> listed;
    for (NodeId reader : of.readers) {
      if (listed.size() == kListedDifferences) break;
      if (reader != anchor.id) listed.push_back(alike(graph, anchor, graph.node(reader), shared_slot).reason);
    }
    refuse_without_alike_readers(graph, anchor, shared, shared_slot, listed, of.readers.size() - 1, outcome);
    return true;
  }
  std::vector<std::pair<NodeId, std::string>> left_out;
  for (NodeId reader : same) {
    if (static_cast<int>(members.size()) >= spec.max_members) {
      left_out.emplace_back(reader, beyond_member_limit(graph, rule, shared));
    } else {
      members.push_back(reader);
    }
  }
  if (members.size() < 2) {
    members.clear();
    return false;
  }
  outcome.left_out = std::move(left_out);
  return true;
}

}  // namespace

SiblingOutcome solve_companions(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule,
                                const PatternMatch& match, const GraphIndex& index) {
  SiblingOutcome outcome;
  auto refuse = [&](std::string why) {
    outcome.decision = Decision::refuse(std::move(why));
    return outcome;
  };
  const ValueId source = role_value(match.roles, rule.companion_source_role);
  const NodeId contraction = source < 0 ? NodeId{-1} : source_contraction(graph, source);
  if (contraction < 0) {
    return refuse(source < 0 ? fmt::format("the pattern binds no '{}'", rule.companion_source_role)
                             : fmt::format("`{}` comes from no contraction (directly or through a bias add)",
                                           graph.value(source).name));
  }
  std::vector<NodeId> region = match.nodes;
  std::vector<NodeId> anchors = {match.nodes.back()};  // the ops whose outputs the kernel writes
  outcome.roles = match.roles;
  for (const CompanionChain& companion : rule.companions) {
    CompanionMatch found = match_companion(graph, rule, companion, match, contraction);
    if (!found.decision) {
      outcome.decision = std::move(found.decision);
      return outcome;
    }
    region.insert(region.end(), found.match.nodes.begin(), found.match.nodes.end());
    anchors.push_back(found.match.nodes.back());
    for (const RegionRole& role : found.match.roles) {
      if (role_value(outcome.roles, role.role) < 0) outcome.roles.push_back(role);
    }
  }
  std::sort(region.begin(), region.end());
  if (std::adjacent_find(region.begin(), region.end()) != region.end()) {
    return refuse("two chains share an op");
  }
  // Only the chains' ends leave the kernel.
  for (NodeId id : region) {
    if (std::find(anchors.begin(), anchors.end(), id) != anchors.end()) continue;
    for (ValueId output : graph.node(id).outputs) {
      if (index.value_is_output[static_cast<std::size_t>(output)]) {
        return refuse(fmt::format("the intermediate {} is a graph output", quoted(graph.node(id))));
      }
      for (NodeId reader : graph.consumers(output)) {
        if (!std::binary_search(region.begin(), region.end(), reader)) {
          return refuse(fmt::format("the intermediate {} is read by {} outside the chains", quoted(graph.node(id)),
                                    quoted(graph.node(reader))));
        }
      }
    }
  }
  if (Decision shape = convex(graph, index, region); !shape) {
    outcome.decision = std::move(shape);
    return outcome;
  }
  const RegionEstimate estimate = estimate_region(graph, region, target, rule.resources, index.value_is_output);
  if (Decision fits = within_limits(estimate, target); !fits) return refuse("the chains " + fits.reason);
  outcome.region = std::move(region);
  outcome.benefit_ns = estimate.benefit_ns;
  return outcome;
}

SiblingOutcome solve_siblings(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule,
                              const PatternMatch& match, const GraphIndex& index, SiblingClasses* classes) {
  SiblingOutcome outcome;
  const SiblingSpec& spec = *rule.siblings;
  const int shared_slot = slot_of(rule, spec.shared_role);
  const int member_slot = slot_of(rule, spec.member_role);
  const Node& anchor = graph.node(match.nodes.back());
  if (shared_slot < 0 || member_slot < 0 || static_cast<std::size_t>(shared_slot) >= anchor.inputs.size() ||
      static_cast<std::size_t>(member_slot) >= anchor.inputs.size()) {
    outcome.decision = Decision::refuse(fmt::format("{} binds no '{}' and '{}'", quoted(anchor), spec.shared_role, spec.member_role));
    return outcome;
  }
  const ValueId shared = anchor.inputs[static_cast<std::size_t>(shared_slot)];

  std::vector<NodeId> members;
  if (classes == nullptr || !indexed_members(graph, rule, anchor, shared_slot, *classes, outcome, members)) {
    scanned_members(graph, rule, anchor, shared_slot, outcome, members);
  }
  if (!outcome.decision) return outcome;

  // Roles: the shared value, then each member's own operand and its bias, member by member.
  std::vector<NodeId> region = members;
  outcome.roles.push_back({spec.shared_role, shared});
  std::vector<NodeId> one_member = {members.front()};
  for (std::size_t m = 0; m < members.size(); ++m) {
    const Node& member = graph.node(members[m]);
    outcome.roles.push_back({fmt::format("{}.{}", spec.member_role, m), member.inputs[static_cast<std::size_t>(member_slot)]});
    if (rule.epilogue_add_operand_role.empty()) continue;
    if (const auto bias = bias_add_of(graph, index, member, outcome.left_out)) {
      region.push_back(bias->add);
      outcome.roles.push_back({fmt::format("{}.{}", rule.epilogue_add_operand_role, m), bias->bias});
      if (m == 0) one_member.push_back(bias->add);
    }
  }
  std::sort(region.begin(), region.end());
  if (Decision shape = convex(graph, index, region); !shape) {
    outcome.decision = std::move(shape);
    return outcome;
  }
  RegionEstimate estimate = estimate_region(graph, region, target, rule.resources, index.value_is_output);
  // The members share one mainloop over the stacked operand: their registers are one member's.
  estimate.registers_per_thread =
      estimate_region(graph, one_member, target, rule.resources, index.value_is_output).registers_per_thread;
  if (Decision fits = within_limits(estimate, target); !fits) {
    outcome.decision = Decision::refuse("the group " + fits.reason);
    return outcome;
  }
  outcome.region = std::move(region);
  outcome.benefit_ns = estimate.benefit_ns;
  return outcome;
}

}  // namespace metile::fusion_internal
