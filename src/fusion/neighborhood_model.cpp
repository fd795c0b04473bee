// The neighborhood cut model of one anchor under one rule (docs/architecture.md,
// "Neighborhood cut models"): which of the ops around the anchor join its kernel,
// decided exactly by one minimum s-t cut. Source side = joins the kernel.
//
//      s ──∞──► anchor, pattern ops            (always in the kernel)
//      s ──launch + reads──► growth op          (cut when it stays separate)
//      growth op ──on-chip cost──► t            (cut when it joins)
//      reader ──► producer  (bytes / bandwidth: the intermediate is read back from memory)
//      s ──► write aux ──∞──► producer, consumers (the write is saved only if all join)
//      legality: ∞ edges (convexity, escapes the rule cannot write, shapes, limits)
//
// The cut value is a constant minus the estimate_region() benefit of the source
// side, so the source side is the region of largest benefit; the smallest one
// among ties, since the solver returns the source side reachable in the residual
// graph. Two constraints are not cut constraints: a path from a producer-side op
// that leaves the neighborhood and comes back at a consumer-side op forbids its
// ends joining together (not submodular), so up to kExactChoicePairs such paths
// the cut is solved for each way of keeping their ends apart and the best region
// kept; and resource limits are not additive, so a region that exceeds one loses
// growth ops until it fits, two ways (the farthest first; the best single drop),
// the larger region kept (NeighborhoodOutcome::exact says whether either fallback ran).
#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>

#include "metile/flow.h"
#include "planner_internal.h"

namespace metile::fusion_internal {
namespace {

enum class Side : std::uint8_t { anchor, pattern, prologue, epilogue };

std::string quoted(const std::string& name) { return "`" + name + "`"; }

bool allows(const GrowthSpec& growth, OpKind kind, int depth) {
  if (growth.max_depth >= 0 && depth > growth.max_depth) return false;
  return std::find(growth.kinds.begin(), growth.kinds.end(), kind) != growth.kinds.end();
}

// A path from local op `from` that leaves the neighborhood through `exit` and comes back at `to`.
struct Reentry {
  int from;
  int to;
  NodeId exit;
};

// Up to this many choice re-entry paths a neighborhood is solved for every way of keeping their
// ends apart (2^k cuts); beyond it, by the consumer-side rule alone.
constexpr std::size_t kExactChoicePairs = 6;

class NeighborhoodModel {
 public:
  NeighborhoodModel(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule, int max_nodes,
                    NeighborhoodScratch& scratch)
      : graph_(graph), target_(target), rule_(rule), max_nodes_(max_nodes), scratch_(scratch) {}

  NeighborhoodModel(const NeighborhoodModel&) = delete;
  NeighborhoodModel& operator=(const NeighborhoodModel&) = delete;
  ~NeighborhoodModel() {
    for (NodeId node : nodes_) scratch_.local_index[static_cast<std::size_t>(node)] = -1;
  }

  NeighborhoodOutcome run(std::span<const NodeId> pattern_nodes) {
    const NodeId anchor = pattern_nodes.back();
    add_node(anchor, Side::anchor, 0);
    for (NodeId node : pattern_nodes.first(pattern_nodes.size() - 1)) add_node(node, Side::pattern, 0);
    outcome_.decision = pattern_escapes_allowed(pattern_nodes);
    if (outcome_.decision) outcome_.decision = within_limits(estimate(pattern_nodes), target_);
    if (!outcome_.decision) return finish({});

    // The kernel's iteration space: the anchor's output, or the rows a row reduction reads (sum and
    // mean shorten them to one value, which the row kernel stores once per row).
    const Node& anchor_node = graph_.node(anchor);
    const TensorSpec& anchor_output =
        graph_.value(anchor_node.kind == OpKind::row_reduction ? anchor_node.inputs.front() : anchor_node.outputs.front())
            .spec;
    grow_prologue(anchor_output);
    grow_epilogue(anchor, anchor_output);

    // Before the pattern alone is taken too: a path from one pattern op through an op outside back
    // into the pattern (a may_escape value feeding another operand) makes the pattern not convex.
    outcome_.decision = add_legality_constraints();
    if (!outcome_.decision) return finish({});
    if (nodes_.size() == pattern_nodes.size()) return finish(sorted(nodes_));
    // Each choice path keeps either end out, and the cut is solved for every combination; the best
    // region wins, ties to the earliest combination (mask 0: every consumer-side end out). The
    // constraint "not both ends" is not a cut constraint (it is not submodular), so exactness comes
    // from the enumeration, not from one cut. Beyond kExactChoicePairs paths only mask 0 is solved
    // (deterministic, not exact).
    const bool enumerated = choices_.size() <= kExactChoicePairs;
    const std::uint32_t combinations = enumerated ? 1U << choices_.size() : 1U;
    const std::vector<bool> forbidden = forbidden_;
    const std::size_t left_out = outcome_.left_out.size();
    std::vector<NodeId> best_region;
    std::vector<std::pair<NodeId, std::string>> best_left_out;
    bool best_exact = true;
    double best_benefit = -std::numeric_limits<double>::infinity();
    for (std::uint32_t mask = 0; mask < combinations; ++mask) {
      forbidden_ = forbidden;
      outcome_.left_out.resize(left_out);
      outcome_.exact = true;
      for (std::size_t k = 0; k < choices_.size(); ++k) separate_if_both_can_join(choices_[k], (mask >> k & 1U) != 0);
      std::vector<NodeId> region = solve_within_limits();
      const double benefit = region.size() > 1 ? estimate(region).benefit_ns : 0;
      if (benefit > best_benefit) {
        best_benefit = benefit;
        best_region = std::move(region);
        best_left_out = outcome_.left_out;
        best_exact = outcome_.exact;
      }
    }
    outcome_.left_out = std::move(best_left_out);
    outcome_.exact = best_exact && enumerated;
    return finish(std::move(best_region));
  }

 private:
  int local(NodeId node) const { return scratch_.local_index[static_cast<std::size_t>(node)]; }
  bool in_neighborhood(NodeId node) const { return local(node) >= 0; }
  bool fixed(int local_node) const {
    return side_[static_cast<std::size_t>(local_node)] == Side::anchor ||
           side_[static_cast<std::size_t>(local_node)] == Side::pattern;
  }
  Side side(int local_node) const { return side_[static_cast<std::size_t>(local_node)]; }
  const std::string& name(NodeId node) const { return graph_.node(node).name; }
  const std::vector<NodeId>& consumers_of(NodeId node) const {
    return scratch_.index.consumer_nodes[static_cast<std::size_t>(node)];
  }
  RegionEstimate estimate(std::span<const NodeId> nodes) const {
    return estimate_region(graph_, nodes, target_, rule_.resources, scratch_.index.value_is_output);
  }

  static std::vector<NodeId> sorted(std::vector<NodeId> nodes) {
    std::sort(nodes.begin(), nodes.end());
    return nodes;
  }

  void add_node(NodeId node, Side node_side, int depth) {
    scratch_.local_index[static_cast<std::size_t>(node)] = static_cast<int>(nodes_.size());
    nodes_.push_back(node);
    side_.push_back(node_side);
    depth_.push_back(depth);
    forbidden_.push_back(false);
    input_edges_ += graph_.node(node).inputs.size();
  }

  void forbid(int local_node, std::string reason) {
    if (forbidden_[static_cast<std::size_t>(local_node)]) return;
    forbidden_[static_cast<std::size_t>(local_node)] = true;
    outcome_.left_out.emplace_back(nodes_[static_cast<std::size_t>(local_node)], std::move(reason));
  }

  NeighborhoodOutcome finish(std::vector<NodeId> region) {
    outcome_.considered = nodes_;
    if (outcome_.decision) {
      outcome_.benefit_ns = region.size() > 1 ? estimate(region).benefit_ns : 0;
      outcome_.region = std::move(region);
    }
    return std::move(outcome_);
  }

  // A pattern op that may not escape must have all its readers in the pattern.
  Decision pattern_escapes_allowed(std::span<const NodeId> pattern_nodes) const {
    for (std::size_t entry = 0; entry + 1 < pattern_nodes.size(); ++entry) {
      if (rule_.pattern[entry].may_escape) continue;
      const NodeId node = pattern_nodes[entry];
      if (scratch_.index.writes_graph_output(graph_, node)) {
        return Decision::refuse("intermediate " + quoted(name(node)) + " is a graph output");
      }
      for (NodeId consumer : consumers_of(node)) {
        if (std::find(pattern_nodes.begin(), pattern_nodes.end(), consumer) == pattern_nodes.end()) {
          return Decision::refuse("intermediate " + quoted(name(node)) + " escapes to " + quoted(name(consumer)));
        }
      }
    }
    return Decision::allow();
  }

  // Whether a growth op shares the kernel's iteration space, and why not.
  Decision shares_iteration_space(NodeId node, const TensorSpec& anchor_output) const {
    const Node& candidate = graph_.node(node);
    if (candidate.outputs.size() != 1) return Decision::refuse("it has several outputs");
    const TensorSpec& spec = graph_.value(candidate.outputs.front()).spec;
    if (spec.shape != anchor_output.shape) {
      return Decision::refuse("its shape " + spec.to_string() + " differs from the kernel's " + anchor_output.to_string());
    }
    if (!is_floating(spec.dtype)) {
      return Decision::refuse("its dtype " + std::string(dtype_name(spec.dtype)) + " is not a float");
    }
    return Decision::allow();
  }

  // Tries to add a growth op; says why not when the rule would take its kind.
  bool try_grow(NodeId node, Side node_side, int depth, const GrowthSpec& growth, const TensorSpec& anchor_output) {
    if (in_neighborhood(node) || !allows(growth, graph_.node(node).kind, depth)) return false;
    if (is_certified_node(graph_.node(node))) return false;  // a kernel of its own
    if (scratch_.is_taken(node)) return false;               // in a kernel an earlier round chose
    if (const Decision shares = shares_iteration_space(node, anchor_output); !shares) {
      outcome_.left_out.emplace_back(node, "not fusable with " + quoted(name(nodes_.front())) + ": " + shares.reason);
      return false;
    }
    if (scratch_.prune_certain_reentry) {
      if (const Decision convex = no_certain_reentry(node, node_side, anchor_output); !convex) {
        outcome_.left_out.emplace_back(node, "left out so the kernel stays convex: " + convex.reason);
        return false;
      }
    }
    if (static_cast<int>(nodes_.size()) >= max_nodes_) {
      outcome_.left_out.emplace_back(node, "beyond the planner's neighborhood limit of " + std::to_string(max_nodes_) +
                                               " ops around " + quoted(name(nodes_.front())));
      return false;
    }
    add_node(node, node_side, depth);
    return true;
  }

  bool could_join(NodeId node, const TensorSpec& anchor_output) const {
    if (scratch_.is_taken(node)) return false;
    const OpKind kind = graph_.node(node).kind;
    const auto& prologue = rule_.prologue.kinds;
    const auto& epilogue = rule_.epilogue.kinds;
    const bool kind_grows = std::find(prologue.begin(), prologue.end(), kind) != prologue.end() ||
                            std::find(epilogue.begin(), epilogue.end(), kind) != epilogue.end();
    return kind_grows && shares_iteration_space(node, anchor_output).ok;
  }

  // The ops after `above` and outside the neighborhood from which a path through ops outside it
  // reaches a neighborhood op up to `last`: walked backward from those ops through producers (node
  // ids are topological, so every op on such a path lies in (above, last]). A path that leaves the
  // neighborhood through a reader of an op at or before `above` and comes back starts at one of
  // them, and goes on through them alone, so forward searches need look at nothing else. The walk
  // costs the neighborhood's ancestors in that range: nullopt once it has looked at more than
  // `budget` edges. What it found is marked in scratch_.reentering (the stamp it returns).
  struct Reentering {
    std::vector<NodeId> ops;
    int stamp;
  };
  std::optional<Reentering> reentering_ops(NodeId above, NodeId last, std::size_t budget) {
    if (budget < input_edges_) return std::nullopt;  // its first step costs more
    const int stamp = ++scratch_.stamp;
    std::vector<NodeId> stack;
    for (NodeId node : nodes_) {
      if (node <= last) stack.push_back(node);
    }
    std::vector<NodeId> found;
    std::size_t edges = 0;
    while (!stack.empty()) {
      const NodeId current = stack.back();
      stack.pop_back();
      for (ValueId input : graph_.node(current).inputs) {
        if (++edges > budget) return std::nullopt;
        const NodeId producer = graph_.value(input).producer;  // -1 for a graph input
        if (producer <= above || in_neighborhood(producer)) continue;
        if (scratch_.reentering[static_cast<std::size_t>(producer)] == stamp) continue;
        scratch_.reentering[static_cast<std::size_t>(producer)] = stamp;
        found.push_back(producer);
        stack.push_back(producer);
      }
    }
    return Reentering{std::move(found), stamp};
  }

  // The ops of `ops` (distinct) that read `node`, ascending, as consumers_of lists them.
  std::vector<NodeId> readers_among(NodeId node, std::span<const NodeId> ops) const {
    std::vector<NodeId> readers;
    for (NodeId op : ops) {
      const auto& inputs = graph_.node(op).inputs;
      const auto reads_node = [&](ValueId input) { return graph_.value(input).producer == node; };
      if (std::any_of(inputs.begin(), inputs.end(), reads_node)) readers.push_back(op);
    }
    std::sort(readers.begin(), readers.end());
    return readers;
  }

  // `node`'s readers in the neighborhood, ascending: by its readers or by the neighborhood's ops,
  // whichever are fewer (a value read by n chains is in n neighborhoods). ReentrySearch::forward
  // scans the readers, ReentrySearch::backward the neighborhood, whatever their sizes.
  std::vector<NodeId> readers_in_neighborhood(NodeId node) const {
    const std::vector<NodeId>& readers = consumers_of(node);
    const ReentrySearch search = scratch_.reentry_search;
    if (search == ReentrySearch::backward || (search == ReentrySearch::cheaper && readers.size() > nodes_.size())) {
      return readers_among(node, nodes_);
    }
    std::vector<NodeId> inside;
    for (NodeId reader : readers) {
      if (in_neighborhood(reader)) inside.push_back(reader);
    }
    return inside;
  }

  // no_certain_reentry's forward search for a producer-side `node`, from each of `exits` (readers of
  // `node`, ascending) that is outside the neighborhood, up to the anchor, and no growth can take;
  // entering, where a backward walk ran, only what it found (forward_searches says why that is the
  // same answer). nullopt past `budget` edges.
  std::optional<Decision> no_reentry_from(NodeId node, std::span<const NodeId> exits, const Reentering* reentering,
                                          const TensorSpec& anchor_output, std::size_t budget) {
    const NodeId anchor = nodes_.front();
    const int stamp = ++scratch_.stamp;
    std::size_t edges = 0;
    std::vector<NodeId> stack;
    for (NodeId exit : exits) {
      if (in_neighborhood(exit) || exit > anchor || could_join(exit, anchor_output)) continue;
      stack.assign(1, exit);
      while (!stack.empty()) {
        const NodeId current = stack.back();
        stack.pop_back();
        for (NodeId next : consumers_of(current)) {
          if (++edges > budget) return std::nullopt;
          if (next > anchor) continue;
          if (in_neighborhood(next)) {
            return Decision::refuse("a path from " + quoted(name(node)) + " leaves through " + quoted(name(exit)) +
                                    " and comes back at " + quoted(name(next)));
          }
          if (scratch_.visit_stamp[static_cast<std::size_t>(next)] == stamp || !found_by(reentering, next)) continue;
          scratch_.visit_stamp[static_cast<std::size_t>(next)] = stamp;
          stack.push_back(next);
        }
      }
    }
    return Decision::allow();
  }

  // Whether a forward search may enter `op`: anything without a walk, else what the walk found.
  bool found_by(const Reentering* reentering, NodeId op) const {
    return reentering == nullptr || scratch_.reentering[static_cast<std::size_t>(op)] == reentering->stamp;
  }

  // A forward search `search(reentering, budget)` (nullopt past `budget` edges; `reentering` the
  // backward walk's ops or null) run the way scratch_.reentry_search says: ::forward without a
  // walk, ::backward after an unbounded one, ::cheaper racing the two with budgets of edges that grow
  // fourfold a round, until the walk or an unrestricted search finishes, so that the cost is within a
  // small factor of the cheaper way's; the first round's budget is `forward_cost`, what the searches
  // cost at least (their readers up to `last`). The searches get kSearchShare times the walk's budget: their
  // edges are cheaper, and every op of a neighborhood searches its own readers' descendants (on the
  // decoders and local random graphs of the planner benchmark an equal share cost 3% of planning in
  // lost rounds).
  template <typename Search>
  auto search_with_walk(NodeId above, NodeId last, std::size_t forward_cost, const Search& search) {
    constexpr std::size_t kUnbounded = std::numeric_limits<std::size_t>::max();
    if (scratch_.reentry_search == ReentrySearch::forward) return *search(nullptr, kUnbounded);
    if (scratch_.reentry_search == ReentrySearch::backward) {
      const auto reentering = reentering_ops(above, last, kUnbounded);  // an unbounded walk always finishes
      return *search(&*reentering, kUnbounded);
    }
    constexpr std::size_t kSearchShare = 8;
    for (std::size_t budget = std::max<std::size_t>(forward_cost, 1);;
         budget = budget > kUnbounded / 4 ? kUnbounded : budget * 4) {
      if (const auto reentering = reentering_ops(above, last, budget)) return *search(&*reentering, kUnbounded);
      const std::size_t search_budget = budget > kUnbounded / kSearchShare ? kUnbounded : budget * kSearchShare;
      if (auto found = search(nullptr, search_budget)) return std::move(*found);
    }
  }

  // Whether a growth op would see its value come back into the neighborhood
  // through an op no growth can ever take: the cut would have to leave it out,
  // so it is not grown at all (this keeps a residual stream from pulling whole
  // layers into one model). Producers search forward up to the anchor,
  // consumers backward down to the neighborhood's first op. Refused with the path that re-enters.
  Decision no_certain_reentry(NodeId node, Side node_side, const TensorSpec& anchor_output) {
    const NodeId anchor = nodes_.front();
    if (node_side == Side::prologue) {
      // Prologue growth runs before epilogue growth: every neighborhood op is the anchor or before it.
      // Searching forward from each reader of `node` costs its fan-out per anchor, and a value read by
      // n chains is grown by each chain's anchor: O(n^2). Only readers the backward walk finds can
      // lead back, so when the walk is cheaper only they are searched (the same answer and path).
      const std::vector<NodeId>& readers = consumers_of(node);
      const std::span<const NodeId> up_to_anchor(readers.begin(),
                                                 std::upper_bound(readers.begin(), readers.end(), anchor));
      return search_with_walk(node, anchor, up_to_anchor.size(), [&](const Reentering* reentering, std::size_t budget) {
        if (reentering == nullptr) return no_reentry_from(node, up_to_anchor, nullptr, anchor_output, budget);
        return no_reentry_from(node, readers_among(node, reentering->ops), reentering, anchor_output, budget);
      });
    }
    const int stamp = ++scratch_.stamp;
    std::vector<NodeId> stack;
    const NodeId first = *std::min_element(nodes_.begin(), nodes_.end());
    for (ValueId input : graph_.node(node).inputs) {
      const NodeId entry = graph_.value(input).producer;
      if (entry < first || in_neighborhood(entry) || could_join(entry, anchor_output)) continue;
      stack.assign(1, entry);
      while (!stack.empty()) {
        const NodeId current = stack.back();
        stack.pop_back();
        for (ValueId value : graph_.node(current).inputs) {
          const NodeId previous = graph_.value(value).producer;
          if (previous < first) continue;
          if (in_neighborhood(previous)) {
            // Only an op reached from the anchor makes the re-entry certain: a
            // producer-side op may itself stay out (add_reentry_constraints).
            if (side(local(previous)) == Side::prologue) continue;
            return Decision::refuse("a path from " + quoted(name(previous)) + " leaves through " + quoted(name(entry)) +
                                    " and comes back at " + quoted(name(node)));
          }
          if (scratch_.visit_stamp[static_cast<std::size_t>(previous)] == stamp) continue;
          scratch_.visit_stamp[static_cast<std::size_t>(previous)] = stamp;
          stack.push_back(previous);
        }
      }
    }
    return Decision::allow();
  }

  // Producers, breadth first from the anchor and pattern ops; a contraction's
  // operands are never computed inside it.
  void grow_prologue(const TensorSpec& anchor_output) {
    if (rule_.prologue.kinds.empty()) return;
    std::vector<int> queue;
    for (std::size_t index = 0; index < nodes_.size(); ++index) queue.push_back(static_cast<int>(index));
    for (std::size_t head = 0; head < queue.size(); ++head) {
      const int current = queue[head];
      const Node& node = graph_.node(nodes_[static_cast<std::size_t>(current)]);
      if (node.kind == OpKind::contraction) continue;
      for (ValueId input : node.inputs) {
        const NodeId producer = graph_.value(input).producer;
        if (producer < 0) continue;
        if (try_grow(producer, Side::prologue, depth_[static_cast<std::size_t>(current)] + 1, rule_.prologue,
                     anchor_output)) {
          queue.push_back(local(producer));
        }
      }
    }
  }

  void grow_epilogue(NodeId anchor, const TensorSpec& anchor_output) {
    if (rule_.epilogue.kinds.empty()) return;
    std::vector<int> queue = {local(anchor)};
    for (std::size_t head = 0; head < queue.size(); ++head) {
      const int current = queue[head];
      for (NodeId consumer : consumers_of(nodes_[static_cast<std::size_t>(current)])) {
        if (try_grow(consumer, Side::epilogue, depth_[static_cast<std::size_t>(current)] + 1, rule_.epilogue,
                     anchor_output)) {
          queue.push_back(local(consumer));
        }
      }
    }
  }

  // The readers of a node outside the neighborhood, or a graph output (-1).
  std::optional<NodeId> escape_witness(NodeId node) const {
    if (scratch_.index.writes_graph_output(graph_, node)) return -1;
    for (NodeId consumer : consumers_of(node)) {
      if (!in_neighborhood(consumer)) return consumer;
    }
    return std::nullopt;
  }

  std::string escape_text(NodeId node, NodeId witness) const {
    const std::string where = witness < 0 ? "is a graph output" : "is also read by " + quoted(name(witness));
    return quoted(name(node)) + " " + where + " and rule " + rule_.name + " does not write it out";
  }

  void must_follow(int from, int to) {
    if (from == to || fixed(from) || fixed(to)) return;  // a fixed op is always in: the edge is never cut
    follows_.emplace_back(from, to);
  }

  // Refused when the pattern itself cannot be one kernel.
  Decision add_legality_constraints() {
    const int count = static_cast<int>(nodes_.size());
    // Convexity inside the neighborhood: a producer that joins pulls in its
    // consumers on the way to the anchor; a consumer that joins pulls in its
    // producers on the way from the anchor.
    for (int index = 0; index < count; ++index) {
      const NodeId node = nodes_[static_cast<std::size_t>(index)];
      if (side(index) == Side::prologue) {
        for (NodeId consumer : readers_in_neighborhood(node)) {
          if (side(local(consumer)) != Side::epilogue) must_follow(index, local(consumer));
        }
      } else if (side(index) == Side::epilogue) {
        for (ValueId input : graph_.node(node).inputs) {
          const NodeId producer = graph_.value(input).producer;
          if (producer >= 0 && in_neighborhood(producer) && side(local(producer)) == Side::epilogue) {
            must_follow(index, local(producer));
          }
        }
      }
    }
    if (!rule_.materializes_escaping_values) add_no_escape_constraints();
    return add_reentry_constraints();
  }

  // Without materialization a value read inside the kernel is read nowhere else.
  void add_no_escape_constraints() {
    const int count = static_cast<int>(nodes_.size());
    for (int index = 0; index < count; ++index) {
      const NodeId node = nodes_[static_cast<std::size_t>(index)];
      const Side node_side = side(index);
      if (node_side == Side::prologue) {
        if (const auto witness = escape_witness(node)) {
          forbid(index, escape_text(node, *witness));
          continue;
        }
        for (NodeId consumer : consumers_of(node)) must_follow(index, local(consumer));
      } else if (node_side == Side::epilogue || node_side == Side::anchor) {
        std::vector<int> epilogue_readers;
        for (NodeId consumer : consumers_of(node)) {
          if (in_neighborhood(consumer) && side(local(consumer)) == Side::epilogue) {
            epilogue_readers.push_back(local(consumer));
          }
        }
        if (epilogue_readers.empty()) continue;
        if (const auto witness = escape_witness(node)) {
          for (int reader : epilogue_readers) forbid(reader, "it reads " + escape_text(node, *witness));
          continue;
        }
        // All of the value's readers join, or none does.
        for (std::size_t k = 0; k < epilogue_readers.size(); ++k) {
          must_follow(epilogue_readers[k], epilogue_readers[(k + 1) % epilogue_readers.size()]);
        }
      }
    }
  }

  // The paths that leave the neighborhood and come back, each (from, to) pair once with its first exit.
  // Two ways give the same paths in the same order: the forward searches from every reader alone, or
  // a backward walk first (reentering_ops), whose ops are then the searches' only exits and the only
  // ops they enter. Either can be the costly one: for a value read by n chains the readers are n in
  // every reader's neighborhood; along a chain that reads one value the walk is the whole chain; where
  // ops read values from anywhere before them (the planner benchmark's far reads) a search from each
  // op enters almost every later op, and 64 of them a neighborhood made planning quadratic; so the
  // two are raced (search_with_walk).
  std::vector<Reentry> find_reentries() {
    const NodeId first = *std::min_element(nodes_.begin(), nodes_.end());
    const NodeId last = *std::max_element(nodes_.begin(), nodes_.end());
    std::size_t forward_cost = 0;  // the readers up to `last`: what the searches cost at least
    for (NodeId start : nodes_) {
      const std::vector<NodeId>& readers = consumers_of(start);
      forward_cost += static_cast<std::size_t>(std::upper_bound(readers.begin(), readers.end(), last) -
                                               readers.begin());
    }
    return search_with_walk(first, last, forward_cost, [&](const Reentering* reentering, std::size_t budget) {
      return forward_searches(last, reentering, budget);
    });
  }

  // One search an op, its exits in ascending order sharing the visited set: what an op visited by an
  // earlier exit reaches was recorded with that exit, so each (from, to) pair is found once, with its
  // first exit (a search a reader, each walking the whole way back, was O(n^2) an op for an op read
  // along a chain of n: O(n^3) planning). A pair found twice constrained the cut no further and
  // counted twice towards kExactChoicePairs. With the walk's ops (`reentering`), the exits are those
  // of them that read the op and the searches enter no other op: an op the walk did not find reaches
  // no neighborhood op through ops outside, nor does any op it leads to, so what is skipped would
  // have recorded nothing, and the order of what is recorded stays. nullopt past `budget` edges.
  std::optional<std::vector<Reentry>> forward_searches(NodeId last, const Reentering* reentering, std::size_t budget) {
    const int count = static_cast<int>(nodes_.size());
    std::vector<std::vector<NodeId>> reentering_exits;  // per op, ascending
    if (reentering != nullptr) {
      reentering_exits.resize(nodes_.size());
      for (NodeId op : reentering->ops) {
        for (ValueId input : graph_.node(op).inputs) {
          const NodeId producer = graph_.value(input).producer;
          if (producer < 0 || !in_neighborhood(producer)) continue;
          reentering_exits[static_cast<std::size_t>(local(producer))].push_back(op);
        }
      }
      for (std::vector<NodeId>& exits : reentering_exits) {
        std::sort(exits.begin(), exits.end());
        exits.erase(std::unique(exits.begin(), exits.end()), exits.end());
      }
    }
    std::vector<Reentry> reentries;
    std::size_t edges = 0;
    std::vector<NodeId> stack;
    std::vector<int> reached;  // the neighborhood ops one op's search has recorded
    for (int index = 0; index < count; ++index) {
      const NodeId start = nodes_[static_cast<std::size_t>(index)];
      const std::vector<NodeId>& exits =
          reentering == nullptr ? consumers_of(start) : reentering_exits[static_cast<std::size_t>(index)];
      const int stamp = ++scratch_.stamp;
      reached.clear();
      for (NodeId exit : exits) {
        if (exit > last) break;  // exits ascend
        if (in_neighborhood(exit) || scratch_.visit_stamp[static_cast<std::size_t>(exit)] == stamp) continue;
        scratch_.visit_stamp[static_cast<std::size_t>(exit)] = stamp;
        stack.assign(1, exit);
        while (!stack.empty()) {
          const NodeId current = stack.back();
          stack.pop_back();
          for (NodeId next : consumers_of(current)) {
            if (++edges > budget) return std::nullopt;
            if (next > last) continue;
            if (in_neighborhood(next)) {
              if (std::find(reached.begin(), reached.end(), local(next)) == reached.end()) {
                reached.push_back(local(next));
                reentries.push_back({index, local(next), exit});
              }
              continue;
            }
            if (scratch_.visit_stamp[static_cast<std::size_t>(next)] == stamp || !found_by(reentering, next)) continue;
            scratch_.visit_stamp[static_cast<std::size_t>(next)] = stamp;
            stack.push_back(next);
          }
        }
      }
    }
    return reentries;
  }

  // Paths that leave the neighborhood and come back: the two ends cannot both
  // join, or the kernel would wait on itself. Searches stay below the
  // neighborhood's last node (node ids are topological). A path whose end is
  // already kept out constrains nothing: forbidding its other end as well would
  // over-constrain the cut (a growth op that must stay out would push a legal
  // epilogue out with it), so the certain pairs are applied first, and each
  // choice pair only while both its ends can still join.
  Decision add_reentry_constraints() {
    const std::vector<Reentry> reentries = find_reentries();
    // Certain first: a path from an op the anchor reaches, or into one that
    // reaches the anchor, re-enters whatever else joins; only a path from a
    // producer-side op to a consumer-side op leaves the choice of its ends.
    // A certain pair binds even when its `from` stays out, since kept-out ops
    // are stops on longer paths; a choice pair whose producer stays out is void,
    // as nothing that joins can reach that producer.
    auto certain = [&](const Reentry& path) {
      return side(path.from) != Side::prologue || side(path.to) != Side::epilogue;
    };
    // The choice pairs are left to run(), which tries both ends of each.
    for (const Reentry& path : reentries) {
      if (!certain(path)) {
        choices_.push_back(path);
        continue;
      }
      if (Decision separated = separate(path.from, path.to, path.exit, false); !separated) return separated;
    }
    return Decision::allow();
  }

  // A choice path (producer-side `from`, consumer-side `to`, neither a pattern op) keeps one end out
  // unless one already is: `keep_producer_out` picks which.
  void separate_if_both_can_join(const Reentry& path, bool keep_producer_out) {
    const std::vector<bool> out = kept_out();
    if (out[static_cast<std::size_t>(path.from)] || out[static_cast<std::size_t>(path.to)]) return;
    (void)separate(path.from, path.to, path.exit, keep_producer_out);
  }

  // The cut, then again after each resource-limit exclusion until the region fits the target
  // (deterministic, not exact: the limits are not additive, so they are not cut constraints). Two
  // ways of choosing the op to keep out run, the farthest growth op first and the best single drop
  // (growth_node_to_drop), and the region of the larger benefit is kept, ties to the farthest-first one.
  std::vector<NodeId> solve_within_limits() {
    std::vector<NodeId> region = solve_once();
    if (within_limits(estimate(region), target_)) return region;
    outcome_.exact = false;
    const std::vector<bool> forbidden = forbidden_;
    const std::size_t left_out = outcome_.left_out.size();
    // The best drops first: where each was also the farthest op, the farthest-first pass would drop
    // the same ops in the same order, and is not run.
    bool deviated = false;
    std::vector<NodeId> best_drop = shrink_to_limits(region, true, deviated);
    if (!deviated) return best_drop;
    std::vector<std::pair<NodeId, std::string>> best_drop_left_out(
        outcome_.left_out.begin() + static_cast<std::ptrdiff_t>(left_out), outcome_.left_out.end());
    forbidden_ = forbidden;
    outcome_.left_out.resize(left_out);
    std::vector<NodeId> farthest = shrink_to_limits(std::move(region), false, deviated);
    const auto benefit = [&](const std::vector<NodeId>& nodes) { return nodes.size() > 1 ? estimate(nodes).benefit_ns : 0.0; };
    if (benefit(farthest) > 0 || benefit(farthest) >= benefit(best_drop)) return farthest;
    forbidden_ = forbidden;
    outcome_.left_out.resize(left_out);
    outcome_.left_out.insert(outcome_.left_out.end(), best_drop_left_out.begin(), best_drop_left_out.end());
    return best_drop;
  }

  // Drops growth ops (growth_node_to_drop) and cuts again until the region fits; `deviated` is set
  // when a drop was not the farthest op.
  std::vector<NodeId> shrink_to_limits(std::vector<NodeId> region, bool try_each, bool& deviated) {
    // One cut kept current across the drops: a drop only forces its op to the sink side, and the
    // next cut augments from the last flow (the same source side as a cut from scratch).
    // The estimate likewise: the ops the cut leaves out are taken out of it one by one.
    std::optional<IncrementalMinCut> cut;
    RegionEstimator estimator(graph_, region, target_, rule_.resources, scratch_.index.value_is_output);
    for (;;) {
      const Decision fits = within_limits(estimator.estimate(), target_);
      if (fits) return region;
      const Drop dropped = growth_node_to_drop(region, estimator, try_each);
      if (dropped.op < 0) throw std::logic_error("fusion: a region of pattern ops alone exceeds a limit it was checked against");
      if (!dropped.farthest) deviated = true;
      forbid(dropped.op, "left out of the region: with it the kernel " + fits.reason);
      if (cut) {
        cut->force_to_sink(vertex(dropped.op));
      } else {
        cut.emplace(cut_network(), kSource, kSink);
      }
      std::vector<NodeId> smaller = region_of(cut->source_side());
      // Forcing an op out only shrinks the smallest minimum cut's source side.
      if (!std::includes(region.begin(), region.end(), smaller.begin(), smaller.end())) {
        throw std::logic_error("fusion: a region grew when one of its ops was kept out");
      }
      for (NodeId node : region) {
        if (!std::binary_search(smaller.begin(), smaller.end(), node)) estimator.remove(node);
      }
      region = std::move(smaller);
    }
  }

  // Which growth op an oversized region keeps out: the farthest from the anchor (ties to the later
  // op); or, `try_each`, the one among up to kDropTrials of its growth ops (the farthest first) whose
  // removal leaves ops that fit with the largest estimated benefit, else the largest benefit; ties to
  // the farthest. The rest is estimated as it stands (RegionEstimator::without, in the op's edges),
  // not cut again (a cut a trial made planning where a limit binds ~18x slower); the next cut, with
  // the op forbidden, is what the region becomes. The farthest alone lost a region over a limit
  // through an op near the anchor, its ops one by one down to the pattern, blaming the op it left out
  // first for a limit that op did not break (found by an adversarial pass).
  struct Drop {
    int op;         // the local op to keep out; -1 where the region has no growth op
    bool farthest;  // whether it is the farthest growth op, the one the farthest-first pass drops
  };
  Drop growth_node_to_drop(const std::vector<NodeId>& region, const RegionEstimator& estimator, bool try_each) {
    constexpr std::size_t kDropTrials = 16;
    std::vector<int> growth;
    for (NodeId node : region) {
      if (!fixed(local(node))) growth.push_back(local(node));
    }
    std::stable_sort(growth.begin(), growth.end(), [&](int a, int b) {
      const int depth_a = depth_[static_cast<std::size_t>(a)], depth_b = depth_[static_cast<std::size_t>(b)];
      return depth_a != depth_b ? depth_a > depth_b : nodes_[static_cast<std::size_t>(a)] > nodes_[static_cast<std::size_t>(b)];
    });
    if (growth.empty()) return {-1, true};
    if (!try_each) return {growth.front(), true};
    if (growth.size() > kDropTrials) growth.resize(kDropTrials);
    int chosen = -1;
    bool chosen_fits = false;
    double chosen_benefit = 0;
    for (const int candidate : growth) {
      const RegionEstimate rest_estimate = estimator.without(nodes_[static_cast<std::size_t>(candidate)]);
      const bool fits = within_limits(rest_estimate, target_).ok;
      const double benefit = region.size() > 2 ? rest_estimate.benefit_ns : 0;
      if (chosen < 0 || (fits && !chosen_fits) || (fits == chosen_fits && benefit > chosen_benefit)) {
        chosen = candidate;
        chosen_fits = fits;
        chosen_benefit = benefit;
      }
    }
    return {chosen, chosen == growth.front()};
  }

  // The ops the cut can never take: the forbidden ones and those that may join
  // only with one of them.
  std::vector<bool> kept_out() const {
    std::vector<bool> out = forbidden_;
    for (bool changed = true; changed;) {
      changed = false;
      for (const auto& [from, to] : follows_) {
        if (out[static_cast<std::size_t>(to)] && !out[static_cast<std::size_t>(from)]) {
          out[static_cast<std::size_t>(from)] = true;
          changed = true;
        }
      }
    }
    return out;
  }

  // `from` reaches `to` through `exit` outside the neighborhood: keeps one end out, refused when
  // both are pattern ops. A choice path keeps `from` out when `keep_producer_out`, else `to`.
  Decision separate(int from, int to, NodeId exit, bool keep_producer_out) {
    const NodeId from_node = nodes_[static_cast<std::size_t>(from)];
    const NodeId to_node = nodes_[static_cast<std::size_t>(to)];
    const std::string path = "a path from " + quoted(name(from_node)) + " leaves through " + quoted(name(exit)) +
                             " and comes back at " + quoted(name(to_node));
    // Keep out the end that is not required, preferring a consumer-side op (unless told otherwise).
    if (!keep_producer_out && (side(to) == Side::epilogue || (fixed(from) && !fixed(to)))) {
      forbid(to, "left out so the kernel stays convex: " + path);
    } else if (!fixed(from)) {
      forbid(from, "left out so the kernel stays convex: " + path);
    } else {
      return Decision::refuse("the pattern is not convex: " + path);
    }
    return Decision::allow();
  }

  std::int64_t transfer_picoseconds(const Value& value) const {
    return to_picoseconds(static_cast<double>(value.spec.bytes()) / target_.memory_bandwidth_bytes_per_ns);
  }

  // The cut network's terminals and the vertex of each neighborhood op.
  static constexpr int kSource = 0;
  static constexpr int kSink = 1;
  static int vertex(int local_node) { return local_node + 2; }

  std::vector<NodeId> solve_once() const { return region_of(dinic(cut_network().build(), kSource, kSink).source_side); }

  // The ops on the source side of a cut, ascending.
  std::vector<NodeId> region_of(const std::vector<bool>& source_side) const {
    std::vector<NodeId> region;
    for (std::size_t index = 0; index < nodes_.size(); ++index) {
      if (source_side[static_cast<std::size_t>(vertex(static_cast<int>(index)))]) region.push_back(nodes_[index]);
    }
    std::sort(region.begin(), region.end());
    return region;
  }

  FlowNetworkBuilder<std::int64_t> cut_network() const {
    const int count = static_cast<int>(nodes_.size());
    constexpr int source = kSource;
    constexpr int sink = kSink;
    FlowNetworkBuilder<std::int64_t> network(count + 2);
    auto add_finite = [&](int from, int to, std::int64_t capacity) {
      if (capacity > 0) network.add_edge(from, to, capacity);
    };

    for (int index = 0; index < count; ++index) {
      if (fixed(index)) network.add_infinite_edge(source, vertex(index));
      if (forbidden_[static_cast<std::size_t>(index)]) network.add_infinite_edge(vertex(index), sink);
    }
    for (const auto& [from, to] : follows_) network.add_infinite_edge(vertex(from), vertex(to));

    // Launch and reads saved against on-chip cost, per growth op.
    std::vector<std::pair<ValueId, int>> reads;  // (value, reader) over the neighborhood, distinct
    for (int index = 0; index < count; ++index) {
      const Node& node = graph_.node(nodes_[static_cast<std::size_t>(index)]);
      std::vector<ValueId> inputs = node.inputs;
      std::sort(inputs.begin(), inputs.end());
      inputs.erase(std::unique(inputs.begin(), inputs.end()), inputs.end());
      double gain_ns = target_.launch_overhead_ns;
      for (ValueId input : inputs) {
        reads.emplace_back(input, index);
        gain_ns += static_cast<double>(graph_.value(input).spec.bytes()) / target_.memory_bandwidth_bytes_per_ns;
      }
      for (ValueId output : node.outputs) {
        gain_ns -= static_cast<double>(graph_.value(output).spec.bytes()) / target_.on_chip_bandwidth_bytes_per_ns;
      }
      if (fixed(index)) continue;
      const std::int64_t gain = to_picoseconds(gain_ns);
      if (gain > 0) add_finite(source, vertex(index), gain);
      if (gain < 0) add_finite(vertex(index), sink, -gain);
    }

    // A value the kernel reads from memory: some reader joined, its producer did not.
    std::sort(reads.begin(), reads.end());
    for (std::size_t begin = 0; begin < reads.size();) {
      std::size_t end = begin;
      while (end < reads.size() && reads[end].first == reads[begin].first) ++end;
      const Value& value = graph_.value(reads[begin].first);
      const int producer = value.producer >= 0 && in_neighborhood(value.producer) ? local(value.producer) : -1;
      bool fixed_reader = false;
      std::vector<int> free_readers;
      for (std::size_t k = begin; k < end; ++k) {
        if (fixed(reads[k].second)) fixed_reader = true; else free_readers.push_back(reads[k].second);
      }
      begin = end;
      if (producer >= 0 && fixed(producer)) continue;  // produced inside: never read back
      if (producer < 0 && fixed_reader) continue;      // read by the kernel whatever joins
      const int paid_unless = producer >= 0 ? vertex(producer) : sink;
      const std::int64_t cost = transfer_picoseconds(value);
      if (fixed_reader) {
        add_finite(source, paid_unless, cost);
      } else if (free_readers.size() == 1) {
        add_finite(vertex(free_readers.front()), paid_unless, cost);
      } else if (cost > 0) {
        const int any_reader = network.add_vertex();
        for (int reader : free_readers) network.add_infinite_edge(vertex(reader), any_reader);
        network.add_edge(any_reader, paid_unless, cost);
      }
    }

    // A value the kernel need not write: its producer and every reader joined.
    for (int index = 0; index < count; ++index) {
      const NodeId node = nodes_[static_cast<std::size_t>(index)];
      for (ValueId output : graph_.node(node).outputs) {
        const auto& consumers = graph_.consumers(output);
        if (scratch_.index.value_is_output[static_cast<std::size_t>(output)] || consumers.empty()) continue;
        if (std::any_of(consumers.begin(), consumers.end(), [&](NodeId c) { return !in_neighborhood(c); })) continue;
        std::vector<int> free_members;
        if (!fixed(index)) free_members.push_back(index);
        for (NodeId consumer : consumers) {
          if (!fixed(local(consumer))) free_members.push_back(local(consumer));
        }
        std::sort(free_members.begin(), free_members.end());
        free_members.erase(std::unique(free_members.begin(), free_members.end()), free_members.end());
        const std::int64_t saving = transfer_picoseconds(graph_.value(output));
        if (free_members.empty() || saving <= 0) continue;
        if (free_members.size() == 1) {
          network.add_edge(source, vertex(free_members.front()), saving);
          continue;
        }
        const int all_joined = network.add_vertex();
        network.add_edge(source, all_joined, saving);
        for (int member : free_members) network.add_infinite_edge(all_joined, vertex(member));
      }
    }

    return network;
  }

  const ComputeGraph& graph_;
  const FusionTarget& target_;
  const FusionRule& rule_;
  int max_nodes_;
  NeighborhoodScratch& scratch_;
  std::vector<NodeId> nodes_;
  std::vector<Side> side_;
  std::vector<int> depth_;
  std::vector<bool> forbidden_;
  std::size_t input_edges_ = 0;  // the inputs of the neighborhood's ops, summed (reentering_ops)
  std::vector<std::pair<int, int>> follows_;  // (a, b): a joins only if b joins
  std::vector<Reentry> choices_;              // re-entry paths whose kept-out end is a choice (run() makes it)
  NeighborhoodOutcome outcome_;
};

}  // namespace

NeighborhoodOutcome solve_neighborhood(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule,
                                       std::span<const NodeId> pattern_nodes, int max_neighborhood_nodes,
                                       NeighborhoodScratch& scratch) {
  NeighborhoodModel model(graph, target, rule, max_neighborhood_nodes, scratch);
  return model.run(pattern_nodes);
}

}  // namespace metile::fusion_internal
