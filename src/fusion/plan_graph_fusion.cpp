// plan_graph_fusion: the planner's driver. Every rule proposes one candidate
// region per anchor (neighborhood_model.cpp), identical proposals merge, conflict
// selection picks a non-overlapping set (conflict_selection.cpp), and a kernel
// cycle found among the picks becomes one more conflict before selecting again.
// While a losing candidate holds ops no pick took, the rules propose again over
// what is left (a later selection round). Last, every node gets the reason it is
// or is not fused.
#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

#include <fmt/core.h>

#include "planner_internal.h"

namespace metile {
namespace {

using namespace fusion_internal;

struct ProposedRegion {
  int rule = -1;
  NodeId anchor = -1;
  std::vector<NodeId> nodes;
  double benefit_ns = 0;
  std::vector<RegionRole> roles;  // region_roles() of the match
  std::vector<int> parts = {};    // a composed rule's region: the two proposals it joins
};

// What the neighborhood models said about each node, for its reason.
struct NodeNotes {
  std::vector<std::string> refusals;  // "<rule> refused: <why>" for pattern nodes
  // Why the first model that kept it out of a region did so: the reason an unfused op is given. Only
  // the first is kept (a list of every distinct one, each searched before the next was added, took a
  // tenth of planning where thousands of neighborhoods leave the same ops out).
  std::string left_out;
  bool considered = false;
  void note_left_out(std::string text) {
    if (left_out.empty()) left_out = std::move(text);
  }
};

void add_distinct(std::vector<std::string>& list, std::string text) {
  if (std::find(list.begin(), list.end(), text) == list.end()) list.push_back(std::move(text));
}

// Whether a single-op pattern could grow at all: saves building a model per op.
bool may_grow(const ComputeGraph& graph, const FusionRule& rule, NodeId anchor) {
  const Node& node = graph.node(anchor);
  auto takes = [](const GrowthSpec& growth, OpKind kind) {
    return growth.max_depth != 0 && std::find(growth.kinds.begin(), growth.kinds.end(), kind) != growth.kinds.end();
  };
  if (node.kind != OpKind::contraction) {
    for (ValueId input : node.inputs) {
      const NodeId producer = graph.value(input).producer;
      if (producer >= 0 && takes(rule.prologue, graph.node(producer).kind)) return true;
    }
  }
  for (ValueId output : node.outputs) {
    for (NodeId consumer : graph.consumers(output)) {
      if (takes(rule.epilogue, graph.node(consumer).kind)) return true;
    }
  }
  return false;
}

// Whether `node`, left outside a region of a sink-anchored rule, may anchor that rule itself: its
// consumers of its kind all lie in regions the rule already proposed, so it ends what is left of
// the chain.
bool continues_chain(const ComputeGraph& graph, NodeId node, const std::vector<char>& claimed) {
  const Node& candidate = graph.node(node);
  if (claimed[static_cast<std::size_t>(node)]) return false;
  for (ValueId output : candidate.outputs) {
    for (NodeId consumer : graph.consumers(output)) {
      if (graph.node(consumer).kind == candidate.kind && !claimed[static_cast<std::size_t>(consumer)]) return false;
    }
  }
  return true;
}

// `proposal` with its rule's input prologue (FusionRule::input_prologue: the RMSNorm before a GEMV
// region) when that may join; else nothing, and a matching producer that must stay out gets why.
// The kernel normalizes x while it loads it (no row of it is staged), so joining saves the norm's
// launch and its value's write and read, and takes no register or shared memory the region did not
// already hold; it does read the norm's inputs in place of its output (x and the weight for xn), which
// the target's input limit must still allow (a region with a limit of 3 read 4 before).
std::optional<ProposedRegion> with_input_prologue(const ComputeGraph& graph, const FusionTarget& target,
                                                  const FusionRule& rule, const ProposedRegion& proposal,
                                                  std::vector<NodeNotes>& notes) {
  const PrologueMatch prologue = match_input_prologue(graph, proposal.nodes, proposal.roles, *rule.input_prologue);
  if (!prologue.decision) {
    if (prologue.node >= 0) {
      notes[static_cast<std::size_t>(prologue.node)].note_left_out(
          fmt::format("{}: not the input prologue of the region at `{}`: {}", rule.name,
                      graph.node(proposal.anchor).name, prologue.decision.reason));
    }
    return std::nullopt;
  }
  ProposedRegion extended = proposal;
  extended.nodes.insert(std::upper_bound(extended.nodes.begin(), extended.nodes.end(), prologue.node), prologue.node);
  RegionEstimate inputs_and_outputs = estimate_region(graph, extended.nodes, target, rule.resources);
  inputs_and_outputs.registers_per_thread = 0;  // the region's own, checked when it was proposed
  inputs_and_outputs.shared_memory_bytes = 0;
  if (const Decision fits = within_limits(inputs_and_outputs, target); !fits) {
    notes[static_cast<std::size_t>(prologue.node)].note_left_out(
        fmt::format("{}: not the input prologue of the region at `{}`: with it the kernel {}", rule.name,
                    graph.node(proposal.anchor).name, fits.reason));
    return std::nullopt;
  }
  extended.roles.insert(extended.roles.end(), prologue.roles.begin(), prologue.roles.end());
  std::int64_t value_bytes = 0;
  for (ValueId output : graph.node(prologue.node).outputs) value_bytes += graph.value(output).spec.bytes();
  extended.benefit_ns += target.launch_overhead_ns +
                         2.0 * static_cast<double>(value_bytes) / target.memory_bandwidth_bytes_per_ns;
  return extended;
}

// A composed rule's regions (FusionRule::composes): each proposal of the producer rule joined to the
// proposal of the consumer rule that reads every value it writes (none of them a graph output).
// Disjoint, and convex because no value leaves the producer for anything but the consumer.
std::vector<ProposedRegion> compose_regions(const ComputeGraph& graph, const FusionTarget& target, const RuleSet& rules,
                                            int rule_index, const std::vector<ProposedRegion>& proposals,
                                            const GraphIndex& index) {
  const FusionRule& rule = rules.rules[static_cast<std::size_t>(rule_index)];
  auto rule_named = [&](const std::string& name) {
    for (std::size_t k = 0; k < rules.rules.size(); ++k) {
      if (rules.rules[k].name == name) return static_cast<int>(k);
    }
    return -1;
  };
  const int producer_rule = rule_named(rule.composes[0]);
  const int consumer_rule = rule_named(rule.composes[1]);
  std::vector<ProposedRegion> composed;
  for (std::size_t p = 0; p < proposals.size(); ++p) {
    const ProposedRegion& producer = proposals[p];
    if (producer.rule != producer_rule) continue;
    // The readers outside the producer of the values it writes, and those values' bytes.
    std::vector<NodeId> readers;
    std::int64_t between_bytes = 0;
    bool escapes = false;
    for (NodeId id : producer.nodes) {
      for (ValueId output : graph.node(id).outputs) {
        bool read_outside = false;
        for (NodeId reader : graph.consumers(output)) {
          if (std::binary_search(producer.nodes.begin(), producer.nodes.end(), reader)) continue;
          readers.push_back(reader);
          read_outside = true;
        }
        if (read_outside) between_bytes += graph.value(output).spec.bytes();
        escapes = escapes || index.value_is_output[static_cast<std::size_t>(output)];
      }
    }
    if (escapes || readers.empty()) continue;
    for (std::size_t c = 0; c < proposals.size(); ++c) {
      const ProposedRegion& consumer = proposals[c];
      if (consumer.rule != consumer_rule) continue;
      auto inside = [&](NodeId id) { return std::binary_search(consumer.nodes.begin(), consumer.nodes.end(), id); };
      if (!std::all_of(readers.begin(), readers.end(), inside)) continue;
      if (std::any_of(producer.nodes.begin(), producer.nodes.end(), inside)) continue;
      ProposedRegion joined;
      joined.rule = rule_index;
      joined.anchor = consumer.anchor;
      joined.nodes = producer.nodes;
      joined.nodes.insert(joined.nodes.end(), consumer.nodes.begin(), consumer.nodes.end());
      std::sort(joined.nodes.begin(), joined.nodes.end());
      const RegionEstimate estimate = estimate_region(graph, joined.nodes, target, rule.resources, index.value_is_output);
      if (!within_limits(estimate, target)) continue;
      // One launch fewer, and the values between the two written and read back no more.
      joined.benefit_ns = producer.benefit_ns + consumer.benefit_ns + target.launch_overhead_ns +
                          2.0 * static_cast<double>(between_bytes) / target.memory_bandwidth_bytes_per_ns;
      joined.roles = producer.roles;
      for (const RegionRole& role : consumer.roles) {
        const bool bound = std::any_of(joined.roles.begin(), joined.roles.end(),
                                       [&](const RegionRole& r) { return r.role == role.role; });
        if (!bound) joined.roles.push_back(role);
      }
      joined.parts = {static_cast<int>(p), static_cast<int>(c)};
      composed.push_back(std::move(joined));
    }
  }
  return composed;
}

// `anchors`: the nodes that may anchor a rule's region, one flag a node; empty, every node.
std::vector<ProposedRegion> propose_regions(const ComputeGraph& graph, const FusionTarget& target,
                                            const RuleSet& rules, NeighborhoodScratch& scratch,
                                            std::vector<NodeNotes>& notes, const std::vector<char>& anchors) {
  std::vector<ProposedRegion> proposals;
  std::set<std::vector<NodeId>> seen;
  const std::size_t node_count = graph.nodes().size();
  for (std::size_t rule_index = 0; rule_index < rules.rules.size(); ++rule_index) {
    const FusionRule& rule = rules.rules[rule_index];
    if (!rule.composes.empty()) {
      for (ProposedRegion& joined : compose_regions(graph, target, rules, static_cast<int>(rule_index), proposals, scratch.index)) {
        if (seen.insert(joined.nodes).second) proposals.push_back(std::move(joined));
      }
      continue;
    }
    // A sink-anchored rule walks the graph backwards. A chain longer than one neighborhood
    // (rules.max_neighborhood_nodes) would otherwise end in one region and leave the rest of its
    // ops unfused, as no op before the cut is a sink: the op a region could not take (left out or
    // beyond the limit) anchors the next region, whose end is the previous region's input.
    FusionRule continuation = rule;
    continuation.anchor_must_be_sink = false;
    std::vector<char> claimed(node_count, 0);
    std::vector<char> chain_anchor(node_count, 0);
    std::vector<ProposedRegion> rule_proposals;
    SiblingClasses sibling_classes;  // this rule's, found as its anchors need them
    for (std::size_t position = 0; position < node_count; ++position) {
      const Node& node = graph.node(static_cast<NodeId>(rule.anchor_must_be_sink ? node_count - 1 - position : position));
      const bool continues = rule.anchor_must_be_sink && chain_anchor[static_cast<std::size_t>(node.id)] &&
                             !claimed[static_cast<std::size_t>(node.id)];
      const FusionRule& anchored = continues ? continuation : rule;
      if (!anchors.empty() && !anchors[static_cast<std::size_t>(node.id)]) continue;
      if (scratch.is_taken(node.id) || !can_anchor(graph, anchored, node.id)) continue;
      if (anchored.pattern.size() == 1 && !anchored.siblings && !may_grow(graph, anchored, node.id)) continue;
      const auto match = match_pattern(graph, anchored, node.id);
      if (!match) continue;
      if (!rule.companions.empty()) {
        SiblingOutcome group = solve_companions(graph, target, rule, match, scratch.index);
        if (!group.decision) {
          for (NodeId member : match.nodes) {
            add_distinct(notes[static_cast<std::size_t>(member)].refusals, rule.name + " refused: " + group.decision.reason);
          }
          continue;
        }
        for (NodeId member : group.region) notes[static_cast<std::size_t>(member)].considered = true;
        if (to_picoseconds(group.benefit_ns) <= 0 || !seen.insert(group.region).second) continue;
        rule_proposals.push_back(
            {static_cast<int>(rule_index), node.id, std::move(group.region), group.benefit_ns, std::move(group.roles)});
        continue;
      }
      if (rule.siblings) {
        SiblingOutcome group = solve_siblings(graph, target, rule, match, scratch.index, &sibling_classes);
        if (group.follower) continue;
        if (!group.alone) notes[static_cast<std::size_t>(node.id)].considered = true;
        // A lone contraction is no refusal worth a line in every reason; a reader that differs is.
        if (!group.decision && !group.alone) {
          add_distinct(notes[static_cast<std::size_t>(node.id)].refusals, rule.name + " refused: " + group.decision.reason);
        }
        for (auto& [left_out, reason] : group.left_out) {
          notes[static_cast<std::size_t>(left_out)].note_left_out(rule.name + ": " + reason);
        }
        if (group.region.size() < 2 || to_picoseconds(group.benefit_ns) <= 0) continue;
        if (!seen.insert(group.region).second) continue;
        rule_proposals.push_back(
            {static_cast<int>(rule_index), node.id, std::move(group.region), group.benefit_ns, std::move(group.roles)});
        continue;
      }
      const std::vector<NodeId>* pattern_nodes = &match.nodes;
      NeighborhoodOutcome outcome =
          solve_neighborhood(graph, target, anchored, *pattern_nodes, rules.max_neighborhood_nodes, scratch);
      for (NodeId considered : outcome.considered) notes[static_cast<std::size_t>(considered)].considered = true;
      if (!outcome.decision) {
        for (NodeId member : *pattern_nodes) {
          add_distinct(notes[static_cast<std::size_t>(member)].refusals, rule.name + " refused: " + outcome.decision.reason);
        }
      }
      if (outcome.decision && outcome.region.size() < 2 && !outcome.left_out.empty()) {
        // The anchor stayed alone: say which neighbour could not join and why.
        const auto& [neighbour, why] = outcome.left_out.front();
        notes[static_cast<std::size_t>(node.id)].note_left_out(
            fmt::format("{} around it: `{}` cannot join: {}", rule.name, graph.node(neighbour).name, why));
      }
      std::vector<NodeId> outside;
      for (NodeId considered : outcome.considered) {
        if (!std::binary_search(outcome.region.begin(), outcome.region.end(), considered)) outside.push_back(considered);
      }
      for (auto& [left_out, reason] : outcome.left_out) {
        outside.push_back(left_out);
        notes[static_cast<std::size_t>(left_out)].note_left_out(std::move(reason));
      }
      if (outcome.region.size() < 2 || to_picoseconds(outcome.benefit_ns) <= 0) continue;
      if (!seen.insert(outcome.region).second) continue;
      if (rule.anchor_must_be_sink) {
        for (NodeId member : outcome.region) claimed[static_cast<std::size_t>(member)] = 1;
        for (NodeId candidate : outside) {
          if (graph.node(candidate).kind == node.kind && continues_chain(graph, candidate, claimed)) {
            chain_anchor[static_cast<std::size_t>(candidate)] = 1;
          }
        }
      }
      std::vector<RegionRole> roles = region_roles(graph, anchored, match, outcome.region);
      rule_proposals.push_back(
          {static_cast<int>(rule_index), node.id, std::move(outcome.region), outcome.benefit_ns, std::move(roles)});
    }
    // Proposals in the order of their anchors, whichever way the rule walked.
    if (rule.anchor_must_be_sink) std::reverse(rule_proposals.begin(), rule_proposals.end());
    if (rule.input_prologue) {
      // Each region again with its input's producer (the RMSNorm): both compete in conflict selection.
      const std::size_t proposed = rule_proposals.size();
      for (std::size_t k = 0; k < proposed; ++k) {
        std::optional<ProposedRegion> extended = with_input_prologue(graph, target, rule, rule_proposals[k], notes);
        if (extended && seen.insert(extended->nodes).second) rule_proposals.push_back(std::move(*extended));
      }
    }
    for (ProposedRegion& proposal : rule_proposals) proposals.push_back(std::move(proposal));
  }
  return proposals;
}

// One selection round of plan_graph_fusion over its candidates (`sets`, `weights`): select; while the
// picks close cycles between kernels (`earlier`, the regions earlier rounds chose, are kernels too,
// fixed), the lightest of this round's regions on each cycle found and the lightest other one of
// them conflict from now on, and the components that changed are solved again. A region that closes
// a cycle with earlier rounds' regions alone is dropped, as is, after a bounded number of rounds
// (only tangled random graphs get there), the lightest region of each cycle still found; the method
// says so.
struct RoundSelection {
  SelectionOutcome selection;
  ConflictGroups conflicts;  // overlaps, and the pairs cycles added
  // Per candidate: -1, or what it would have closed a cycle with: another candidate of the round
  // (its index), or with earlier regions alone (-2 - the index of one of them in `earlier`).
  std::vector<int> dropped_for_cycle;
};

RoundSelection select_round(const ComputeGraph& graph, const std::vector<std::vector<NodeId>>& sets,
                            const std::vector<std::int64_t>& weights, const std::vector<std::vector<NodeId>>& earlier,
                            int max_exact_component_size) {
  constexpr int exact_rounds = 32;
  constexpr int cycles_per_component = 16;
  RoundSelection round;
  round.conflicts = find_overlaps(graph.nodes().size(), sets);
  round.selection = select_candidates(weights, round.conflicts, max_exact_component_size);
  round.dropped_for_cycle.assign(sets.size(), -1);
  const auto drop = [&](int lightest, int partner) {
    SelectionOutcome& selection = round.selection;
    if (!selection.selected[static_cast<std::size_t>(lightest)]) return;
    selection.selected[static_cast<std::size_t>(lightest)] = false;
    round.dropped_for_cycle[static_cast<std::size_t>(lightest)] = partner;
    std::string& method =
        selection.components[static_cast<std::size_t>(selection.component_of[static_cast<std::size_t>(lightest)])].method;
    if (method.find("+cycle_drops") == std::string::npos) method += "+cycle_drops";
  };
  const auto lighter = [&](int a, int b) { return weights[static_cast<std::size_t>(a)] < weights[static_cast<std::size_t>(b)]; };
  const auto earlier_count = static_cast<int>(earlier.size());
  // The kernels: every earlier round's region (never the lightest), then this round's picks.
  std::vector<std::vector<NodeId>> kernel_sets = earlier;
  std::vector<std::int64_t> kernel_weights(earlier.size(), std::numeric_limits<std::int64_t>::max());
  for (int cycle_round = 1;; ++cycle_round) {
    kernel_sets.resize(earlier.size());
    kernel_weights.resize(earlier.size());
    std::vector<int> picks;
    for (std::size_t index = 0; index < sets.size(); ++index) {
      if (!round.selection.selected[index]) continue;
      picks.push_back(static_cast<int>(index));
      kernel_sets.push_back(sets[index]);
      kernel_weights.push_back(weights[index]);
    }
    const auto cycles = find_kernel_cycles(graph, kernel_sets, kernel_weights, cycles_per_component);
    if (cycles.empty()) break;
    std::vector<bool> changed(sets.size(), false);
    for (const std::vector<int>& cycle : cycles) {
      if (cycle.size() < 2) throw std::logic_error("fusion: a candidate region is not convex");
      // This round's regions on the cycle (earlier rounds' regions are acyclic among themselves,
      // so there is one at least), the one the search started from first when it is one of them.
      std::vector<int> members;
      int earlier_member = -1;
      for (int position : cycle) {
        if (position >= earlier_count) {
          members.push_back(picks[static_cast<std::size_t>(position - earlier_count)]);
        } else if (earlier_member < 0) {
          earlier_member = position;
        }
      }
      if (members.empty()) throw std::logic_error("fusion: earlier rounds' regions close a cycle");
      const int lightest =
          cycle.front() >= earlier_count ? members.front() : *std::min_element(members.begin(), members.end(), lighter);
      int partner = -1;
      for (int other : members) {
        if (other != lightest && (partner < 0 || lighter(other, partner))) partner = other;
      }
      if (partner < 0) {
        drop(lightest, -2 - earlier_member);  // with earlier rounds' regions alone
        continue;
      }
      if (cycle_round > exact_rounds) {
        drop(lightest, partner);
        continue;
      }
      round.conflicts.add_group({lightest, partner});
      changed[static_cast<std::size_t>(lightest)] = true;
      changed[static_cast<std::size_t>(partner)] = true;
    }
    if (cycle_round <= exact_rounds) {
      round.selection = reselect_candidates(weights, round.conflicts, max_exact_component_size, round.selection, changed);
    }
  }
  return round;
}

std::string unfused_reason(const Node& node, const NodeNotes& notes) {
  if (!notes.refusals.empty()) {
    std::string text = notes.refusals.front();
    for (std::size_t k = 1; k < notes.refusals.size(); ++k) text += "; " + notes.refusals[k];
    return text;
  }
  if (!notes.left_out.empty()) return notes.left_out;
  if (notes.considered) return "no rule found a region around it that saves time";
  if (node.kind == OpKind::layout) return fmt::format("no rule matches: no rule fuses layout ops ({})", node.op);
  return fmt::format("no rule matches: no fusable {} neighbour", op_kind_name(node.kind));
}

}  // namespace

FusionPlan plan_graph_fusion(const ComputeGraph& input_graph, const FusionTarget& target, const RuleSet& rules) {
  target.check();
  validate_rule_set(rules);
  FusionPlan plan;
  plan.graph = std::make_shared<const ComputeGraph>(input_graph);
  plan.target_name = target.name;
  const ComputeGraph& graph = *plan.graph;
  const std::size_t node_count = graph.nodes().size();

  std::vector<NodeNotes> notes(node_count);
  NeighborhoodScratch scratch(graph);
  // Every round's candidates, in round order, with their conflicts, components and whether they
  // were selected.
  std::vector<ProposedRegion> proposals;
  std::vector<std::vector<NodeId>> node_sets;
  std::vector<std::int64_t> weights;
  ConflictGroups conflicts;
  SelectionOutcome selection;
  std::vector<int> dropped_for_cycle;  // the region it would have closed a cycle with
  std::vector<int> chosen;             // the selected candidates of every round, ascending
  std::vector<std::vector<NodeId>> chosen_sets;  // their node sets, in the same order
  std::map<std::vector<NodeId>, int> candidate_of_nodes;
  std::set<std::vector<NodeId>> raced_again;  // cycle losers a later round raced again
  // Selection rounds: the first over every proposal; each later one proposes again with the nodes
  // of the regions chosen so far taken (no neighborhood grows into them), so that the ops of
  // candidates that lost (a producer shared by many readers is in every reader's candidate; one
  // wins, and each other reader's ops kept no kernel) form the regions that are left. A later
  // round anchors only at the ops the last round's losers hold and no region took: an anchor whose
  // region lost nothing proposed what it will propose again, or nothing better, as taking ops only
  // narrows its neighborhood. It ends when there are none, or after kSelectionRounds rounds.
  constexpr int kSelectionRounds = 8;
  std::vector<char> anchors;  // empty: every node (the first round)
  for (int round = 1; round <= kSelectionRounds; ++round) {
    std::vector<ProposedRegion> fresh = propose_regions(graph, target, rules, scratch, notes, anchors);
    // A proposal holding a taken node is dropped, and one an earlier round weighed is not raced again
    // (a composed proposal's parts may name it: they get its index), unless it lost to a cycle alone
    // (below, where a round ends).
    const auto offset = static_cast<int>(proposals.size());
    std::vector<int> index_of(fresh.size(), -1);
    std::vector<ProposedRegion> kept;
    for (std::size_t k = 0; k < fresh.size(); ++k) {
      const auto taken = [&](NodeId id) { return scratch.is_taken(id); };
      if (std::any_of(fresh[k].nodes.begin(), fresh[k].nodes.end(), taken)) continue;
      if (const auto earlier = candidate_of_nodes.find(fresh[k].nodes); earlier != candidate_of_nodes.end()) {
        index_of[k] = earlier->second;
        continue;
      }
      index_of[k] = offset + static_cast<int>(kept.size());
      kept.push_back(std::move(fresh[k]));
    }
    if (kept.empty()) break;
    std::vector<std::vector<NodeId>> round_sets;
    std::vector<double> round_benefits;
    for (ProposedRegion& proposal : kept) {
      for (int& part : proposal.parts) part = index_of[static_cast<std::size_t>(part)];
      candidate_of_nodes.emplace(proposal.nodes, offset + static_cast<int>(round_sets.size()));
      round_sets.push_back(proposal.nodes);
      round_benefits.push_back(proposal.benefit_ns);
    }
    const std::vector<std::int64_t> round_weights = selection_weights(round_benefits);
    RoundSelection picked = select_round(graph, round_sets, round_weights, chosen_sets, rules.max_exact_component_size);
    SelectionOutcome& round_selection = picked.selection;
    conflicts.append(picked.conflicts);

    // This round's candidates join the plan's, their indices shifted past the earlier rounds'.
    const auto component_offset = static_cast<int>(selection.components.size());
    for (std::size_t index = 0; index < kept.size(); ++index) {
      const bool selected = round_selection.selected[index] != 0;
      selection.selected.push_back(selected);
      selection.component_of.push_back(round_selection.component_of[index] + component_offset);
      const int partner = picked.dropped_for_cycle[index];
      dropped_for_cycle.push_back(partner >= 0    ? offset + partner
                                  : partner <= -2 ? chosen[static_cast<std::size_t>(-2 - partner)]
                                                  : -1);
      if (selected) {
        chosen.push_back(offset + static_cast<int>(index));
        chosen_sets.push_back(round_sets[index]);
        for (NodeId node : round_sets[index]) scratch.taken[static_cast<std::size_t>(node)] = 1;
      }
    }
    // The next round anchors at the ops this round's losers hold and no region took. A loser none of
    // whose ops a region took lost to a cycle between kernels (a conflict added for one, a drop, or
    // a rival dropped after it won), not to an overlap: with this round's regions fixed it may close
    // no cycle, so the next round may race it again, once (racing such losers in every round made
    // the tangled 20k-op DAG of planner_benchmark run all 8 rounds over 30k candidates, 4x slower,
    // for more kernels). One that closed a cycle with earlier rounds' regions alone closes it
    // whatever is chosen later: it is not raced again (it would win again over the rivals it beat,
    // and be dropped again).
    anchors.assign(node_count, 0);
    bool loser_left = false;
    for (std::size_t index = 0; index < kept.size(); ++index) {
      if (round_selection.selected[index]) continue;
      const std::vector<NodeId>& nodes = round_sets[index];
      std::size_t free = 0;
      for (NodeId node : nodes) {
        if (scratch.is_taken(node)) continue;
        anchors[static_cast<std::size_t>(node)] = 1;
        ++free;
      }
      loser_left = loser_left || free > 0;
      if (free == nodes.size() && picked.dropped_for_cycle[index] > -2 && raced_again.insert(nodes).second) {
        candidate_of_nodes.erase(nodes);
      }
    }
    for (ConflictComponent& component : round_selection.components) {
      for (int& candidate : component.candidates) candidate += offset;
      component.round = round;
      selection.components.push_back(std::move(component));
    }
    for (ProposedRegion& proposal : kept) proposals.push_back(std::move(proposal));
    for (std::size_t index = 0; index < round_sets.size(); ++index) {
      node_sets.push_back(std::move(round_sets[index]));
      weights.push_back(round_weights[index]);
    }
    if (!loser_left) break;
  }

  // Regions in the order of their first node: the selected candidates, and each node a certified
  // rewrite made (already one kernel; only a rule entry that says so takes it, OpPattern::certified)
  // that no selected candidate holds, as a region of its own. Either region carries the certificate.
  struct RegionSource {
    NodeId first = -1;
    int candidate = -1;  // -1: the certified node `first`
  };
  std::vector<RegionSource> sources;
  std::vector<char> in_chosen(node_count, 0);
  for (int candidate : chosen) {
    sources.push_back({node_sets[static_cast<std::size_t>(candidate)].front(), candidate});
    for (NodeId node : node_sets[static_cast<std::size_t>(candidate)]) in_chosen[static_cast<std::size_t>(node)] = 1;
  }
  for (const Node& node : graph.nodes()) {
    if (is_certified_node(node) && !in_chosen[static_cast<std::size_t>(node.id)]) sources.push_back({node.id, -1});
  }
  std::stable_sort(sources.begin(), sources.end(),
                   [](const RegionSource& a, const RegionSource& b) { return a.first < b.first; });
  std::vector<int> region_of_node(node_count, -1);
  for (const RegionSource& source : sources) {
    FusionRegion region;
    if (source.candidate >= 0) {
      const ProposedRegion& proposal = proposals[static_cast<std::size_t>(source.candidate)];
      auto region_of_proposal = [&](const ProposedRegion& chosen) {
        FusionRegion made = region_of_nodes(graph, chosen.nodes, rules.rules[static_cast<std::size_t>(chosen.rule)].name);
        made.benefit_ns = chosen.benefit_ns;
        made.roles = chosen.roles;
        return made;
      };
      region = region_of_proposal(proposal);
      for (int part : proposal.parts) region.parts.push_back(region_of_proposal(proposals[static_cast<std::size_t>(part)]));
      for (NodeId id : region.nodes) {
        if (is_certified_node(graph.node(id))) region.certificate = graph.node(id).attributes.get_string("certificate");
      }
    } else {
      const Node& node = graph.node(source.first);
      region = region_of_nodes(graph, {node.id}, node.op);
      region.certificate = node.attributes.get_string("certificate");
    }
    for (NodeId node : region.nodes) region_of_node[static_cast<std::size_t>(node)] = static_cast<int>(plan.regions.size());
    plan.regions.push_back(std::move(region));
  }

  for (std::size_t index = 0; index < proposals.size(); ++index) {
    FusionCandidate candidate;
    candidate.rule = rules.rules[static_cast<std::size_t>(proposals[index].rule)].name;
    candidate.anchor = proposals[index].anchor;
    candidate.nodes = proposals[index].nodes;
    candidate.benefit_ns = proposals[index].benefit_ns;
    candidate.component = selection.component_of[index];
    if (selection.selected[index]) candidate.region = region_of_node[static_cast<std::size_t>(candidate.nodes.front())];
    plan.candidates.push_back(std::move(candidate));
  }
  plan.components = std::move(selection.components);
  plan.conflicts = std::move(conflicts);

  // The best losing candidate of each node, and the region that beat it.
  std::vector<int> best_loser(node_count, -1);
  for (std::size_t index = 0; index < plan.candidates.size(); ++index) {
    const FusionCandidate& candidate = plan.candidates[index];
    if (candidate.region >= 0) continue;
    for (NodeId node : candidate.nodes) {
      int& best = best_loser[static_cast<std::size_t>(node)];
      if (best < 0 || weights[index] > weights[static_cast<std::size_t>(best)]) best = static_cast<int>(index);
    }
  }
  // The selected candidate of each conflict group, if any: reading it per group, not per pair, keeps
  // the reasons linear when thousands of candidates share one op.
  std::vector<int> region_in_group(plan.conflicts.groups().size(), -1);
  for (std::size_t group = 0; group < region_in_group.size(); ++group) {
    for (int member : plan.conflicts.groups()[group]) {
      if (plan.candidates[static_cast<std::size_t>(member)].region >= 0) region_in_group[group] = member;
    }
  }
  plan.node_reasons.resize(node_count);
  for (const Node& node : graph.nodes()) {
    const auto id = static_cast<std::size_t>(node.id);
    const int region = region_of_node[id];
    std::string& reason = plan.node_reasons[id];
    if (region >= 0 && is_certified_node(node)) {
      const std::string& rule = plan.regions[static_cast<std::size_t>(region)].rule;
      reason = rule == node.op ? fmt::format("in region R{} ({}): a kernel of its own, a certified op (its certificate is "
                                             "checked before it runs)",
                                             region + 1, node.op)
                               : fmt::format("in region R{} ({}): a certified op the rule takes (its certificate is "
                                             "checked before it runs)",
                                             region + 1, rule);
      continue;
    }
    if (region >= 0) {
      reason = fmt::format("in region R{} ({})", region + 1, plan.regions[static_cast<std::size_t>(region)].rule);
      for (const std::string& refusal : notes[id].refusals) reason += "; " + refusal;
      continue;
    }
    plan.unfused.push_back(node.id);
    if (best_loser[id] < 0) {
      reason = unfused_reason(node, notes[id]);
      continue;
    }
    const FusionCandidate& loser = plan.candidates[static_cast<std::size_t>(best_loser[id])];
    const int partner = dropped_for_cycle[static_cast<std::size_t>(best_loser[id])];
    if (partner >= 0) {
      const int partner_region = plan.candidates[static_cast<std::size_t>(partner)].region;
      reason = fmt::format("its {} region was dropped: with {} it would close a cycle between kernels", loser.rule,
                           partner_region >= 0 ? fmt::format("region R{}", partner_region + 1) : "other regions");
    } else {
      // The heaviest region among the loser's groups (each holds one at most).
      int winner = -1;
      for (int group : plan.conflicts.groups_of(best_loser[id])) {
        const int other = region_in_group[static_cast<std::size_t>(group)];
        // Ties go to the lower candidate index (the groups come in op order, not candidate order).
        if (other >= 0 && (winner < 0 || weights[static_cast<std::size_t>(other)] > weights[static_cast<std::size_t>(winner)] ||
                           (weights[static_cast<std::size_t>(other)] == weights[static_cast<std::size_t>(winner)] && other < winner))) {
          winner = other;
        }
      }
      reason = winner >= 0 ? fmt::format("its {} region lost to region R{} in conflict component {}", loser.rule,
                                         plan.candidates[static_cast<std::size_t>(winner)].region + 1, loser.component + 1)
                           : fmt::format("its {} region was not selected in conflict component {}", loser.rule,
                                         loser.component + 1);
    }
    for (const std::string& refusal : notes[id].refusals) reason += "; " + refusal;
  }
  return plan;
}

}  // namespace metile
