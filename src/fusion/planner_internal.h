// The planner's internal stages, shared by its source files and its unit tests
// (tests/unit/fusion), never by other modules: pattern matching, the
// neighborhood cut model of one anchor, the conflict graph and its selection.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "metile/fusion.h"

namespace metile::fusion_internal {

// Capacities are integer picoseconds: min cuts are then exact, and equal
// inputs give equal cuts. Saturates at +-kMaximumCostPicoseconds (NaN is 0), so
// huge but legal tensors or extreme target figures never overflow a capacity
// or the sums the flow network checks (README, "Input limits").
inline constexpr std::int64_t kMaximumCostPicoseconds = std::int64_t{1} << 38;  // about 275 ms
std::int64_t to_picoseconds(double nanoseconds);
// The conflict selection's weights of one round's candidates: their benefits in picoseconds, all
// scaled by one factor when the largest is past kMaximumCostPicoseconds, so that the ratios the
// selection compares survive (clamped one by one, every candidate of a target with a launch of
// 1e9 ns weighed the same, and two small regions beat a larger one). A positive benefit scaled stays >= 1.
std::vector<std::int64_t> selection_weights(std::span<const double> benefits_ns);

// ---------------------------------------------------------------- patterns

// A pattern's match: the node bound to each entry (same order as rule.pattern, the anchor last)
// and the outside values its "$name" slots bound, as roles "name" in first-binding order; or,
// refused, why the pattern does not match ("`x` (relu) is not silu (role 'activation')").
struct PatternMatch {
  Decision decision;
  std::vector<NodeId> nodes;
  std::vector<RegionRole> roles;
  explicit operator bool() const { return decision.ok; }
};
// The match at `anchor`. Validates nothing about escapes or resources: that is the cut model's job.
PatternMatch match_pattern(const ComputeGraph& graph, const FusionRule& rule, NodeId anchor);
// The roles a region of `rule` gets: the pattern's, then the epilogue add operand
// (FusionRule::epilogue_add_operand_role) when the region holds such an add.
std::vector<RegionRole> region_roles(const ComputeGraph& graph, const FusionRule& rule, const PatternMatch& match,
                                     std::span<const NodeId> region_nodes);
// Whether the node may anchor the rule: the last entry's kind and ops, and the sink condition.
Decision can_anchor(const ComputeGraph& graph, const FusionRule& rule, NodeId node);
// Throws InputError naming the rule when its pattern is malformed (unknown roles, no entries, ...).
void validate_rule_set(const RuleSet& rules);

// ---------------------------------------------------------------- neighborhoods

// Facts about a graph the planner asks for often, computed once per plan.
struct GraphIndex {
  std::vector<std::vector<NodeId>> consumer_nodes;  // per node: distinct readers of its outputs, ascending
  std::vector<bool> value_is_output;                // per value: a graph output
  explicit GraphIndex(const ComputeGraph& graph);
  bool writes_graph_output(const ComputeGraph& graph, NodeId node) const;
};

// estimate_region with the graph-output flags precomputed.
RegionEstimate estimate_region(const ComputeGraph& graph, std::span<const NodeId> nodes, const FusionTarget& target,
                               const ResourceNeeds& needs, const std::vector<bool>& value_is_output);

// One region's estimate, and the estimate of the region less any one of its ops (cost_model.cpp).
// estimate_region is this class's estimate(); without(op) applies the op's removal to the same
// integer sums, so it equals estimate_region of the smaller region to the last bit, in time of the
// op's inputs and readers rather than of the region; remove(op) makes that the region. The
// neighborhood model's drops ask without() of up to 16 ops and remove() what the next cut leaves
// out: estimated afresh, they were half of planning where a limit binds.
class RegionEstimator {
 public:
  RegionEstimator(const ComputeGraph& graph, std::span<const NodeId> nodes, const FusionTarget& target,
                  const ResourceNeeds& needs, const std::vector<bool>& value_is_output);
  const RegionEstimate& estimate() const { return estimate_; }
  const std::vector<NodeId>& region() const { return region_; }  // ascending
  // `op` must be in the region (remove throws std::logic_error otherwise).
  RegionEstimate without(NodeId op) const;
  void remove(NodeId op);

 private:
  // The integer sums an estimate is made of.
  struct Sums {
    std::int64_t ops = 0;
    std::int64_t unfused_bytes = 0;  // every op's distinct inputs and outputs
    std::int64_t fused_bytes = 0;    // the region's inputs and the outputs that leave it
    std::int64_t on_chip_bytes = 0;  // every op's outputs
    std::int64_t registers = 0;      // the rule's base and every op's
    std::int64_t shared_memory_bytes = 0;
    std::int64_t input_count = 0;
    std::int64_t output_count = 0;
  };

  bool contains(NodeId node) const;
  bool output_leaves(ValueId output) const;     // read outside the region, or a graph output: computed
  void prepare_removals() const;                // readers_ and leaving_
  bool leaves(ValueId output) const;            // output_leaves, as leaving_ keeps it
  std::int64_t readers_inside(ValueId value) const;  // distinct region ops reading it
  // What `op` stages in shared memory when its first input is computed inside: a row reduction's
  // row, a contraction's activations, as the rule's needs say.
  std::int64_t staging_bytes(NodeId op) const;
  Sums sums_without(NodeId op) const;
  RegionEstimate finish(const Sums& sums) const;

  const ComputeGraph& graph_;
  const FusionTarget& target_;
  const ResourceNeeds& needs_;
  const std::vector<bool>& value_is_output_;
  std::vector<NodeId> region_;  // ascending, distinct
  // For removals, built on the first (prepare_removals):
  mutable bool removals_prepared_ = false;
  mutable std::vector<std::pair<ValueId, std::int64_t>> readers_;  // (value, region ops reading it), by value
  mutable std::vector<ValueId> leaving_;                           // the region ops' outputs that leave, ascending
  Sums sums_;
  RegionEstimate estimate_;
};

// How the neighborhood model finds the paths that leave a neighborhood and come back, and a
// producer's readers inside it (neighborhood_model.cpp, find_reentries and reentering_ops).
// `cheaper`: the backward walk from the neighborhood and the forward searches from each reader raced
// with growing budgets, and the walk where it costs no more than scanning a producer's readers.
// `forward` (every reader scanned and searched from, the model's first way) and `backward` (the walk
// always, the searches restricted to what it found) force one way, so tests can check that both give
// the same model.
enum class ReentrySearch : std::uint8_t { cheaper, forward, backward };

// Reused between anchors so one model costs time in its own size, not the graph's.
struct NeighborhoodScratch {
  GraphIndex index;
  std::vector<int> local_index;  // graph node -> position in the current neighborhood, or -1
  std::vector<int> visit_stamp;  // graph node -> search that last visited it
  std::vector<int> reentering;   // graph node -> the last backward walk that found it (reentering_ops)
  int stamp = 0;
  // Skip growing ops the cut would certainly leave out (same regions, smaller
  // models); off only in the test that checks exactly that.
  bool prune_certain_reentry = true;
  ReentrySearch reentry_search = ReentrySearch::cheaper;
  // Nodes in a kernel that an earlier selection round chose (plan_graph_fusion): never grown into a
  // neighborhood, as a certified node is not; a proposal holding one is dropped.
  std::vector<char> taken;
  explicit NeighborhoodScratch(const ComputeGraph& graph)
      : index(graph), local_index(graph.nodes().size(), -1), visit_stamp(graph.nodes().size(), 0),
        reentering(graph.nodes().size(), 0), taken(graph.nodes().size(), 0) {}
  bool is_taken(NodeId node) const { return taken[static_cast<std::size_t>(node)] != 0; }
};

struct NeighborhoodOutcome {
  std::vector<NodeId> considered;  // the neighborhood, anchor first, then the pattern, then growth in BFS order
  std::vector<NodeId> region;      // ascending; the pattern and anchor at least, unless rejected
  double benefit_ns = 0;
  Decision decision = Decision::allow();             // refused: the rule cannot apply at this anchor, and why
  std::vector<std::pair<NodeId, std::string>> left_out;  // ops the model had to keep out, and why
  // The region is the neighborhood's best legal one (the cut, over every way of keeping the ends of
  // its choice re-entry paths apart). false where a resource limit dropped ops (farthest first) or
  // more than kExactChoicePairs choice paths were kept apart by the consumer-side rule alone.
  bool exact = true;
};

// Builds the s-t network of the anchor's neighborhood under the rule and solves
// it with one min cut (again after each resource-limit exclusion).
// `pattern_nodes` is match_pattern's result (the anchor last).
NeighborhoodOutcome solve_neighborhood(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule,
                                       std::span<const NodeId> pattern_nodes, int max_neighborhood_nodes,
                                       NeighborhoodScratch& scratch);

// ---------------------------------------------------------------- sibling groups

// The group a sibling rule (FusionRule::siblings) forms around a matched anchor
// (sibling_regions.cpp): every alike reader of the shared value and each one's bias add.
struct SiblingOutcome {
  Decision decision = Decision::allow();  // refused: no group forms here, and why
  bool alone = false;                     // refused because nothing else reads the shared value alike or not
  bool follower = false;                  // refused because an earlier alike reader proposes the group
  std::vector<NodeId> region;             // ascending
  double benefit_ns = 0;
  std::vector<RegionRole> roles;          // the shared role, then per member its role and bias
  std::vector<std::pair<NodeId, std::string>> left_out;  // readers and adds kept out, and why
};
// Companion chains (FusionRule::companions, sibling_regions.cpp): the match plus each companion
// chain, found exactly once beside it; `alone` and `follower` stay false.
SiblingOutcome solve_companions(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule,
                                const PatternMatch& match, const GraphIndex& index);
// One sibling rule's readers of its shared values in classes of alike ones (sibling_regions.cpp),
// found on a value's first anchor: an anchor's group, or the earlier reader that leads it, is then
// its class. Scanning every reader of the value at each anchor cost O(readers^2) for one input read
// by thousands of contractions.
struct SiblingClasses {
  struct OfValue {
    std::vector<NodeId> readers;               // ascending: the pattern's readers in the shared slot
    std::vector<int> class_of;                 // per reader: its class
    std::vector<std::vector<NodeId>> classes;  // alike readers, each ascending
  };
  std::unordered_map<ValueId, OfValue> of_value;
};
// `classes` null: every reader of the shared value scanned at each anchor (the first way, which
// still answers where the anchor has no alike reader: its refusal names every reader that differs).
// Either way the same outcome; tests compare them.
SiblingOutcome solve_siblings(const ComputeGraph& graph, const FusionTarget& target, const FusionRule& rule,
                              const PatternMatch& match, const GraphIndex& index, SiblingClasses* classes = nullptr);

// ---------------------------------------------------------------- conflicts

// Overlap conflicts of candidate node sets (each ascending): one group per op held by two candidates
// or more (alike groups once).
ConflictGroups find_overlaps(std::size_t node_count, std::span<const std::vector<NodeId>> candidates);

// Cycles of the kernel graph, where each region (an ascending node set; regions
// pairwise disjoint) is one kernel and every other node its own. Per strongly
// connected component of two or more kernels, a shortest cycle through each of
// its `max_cycles_per_component` lightest regions (by `region_weights`), as the
// regions on it, that region first. Empty when the kernel graph is acyclic.
std::vector<std::vector<int>> find_kernel_cycles(const ComputeGraph& graph, std::span<const std::vector<NodeId>> regions,
                                                 std::span<const std::int64_t> region_weights,
                                                 int max_cycles_per_component);

struct SelectionOutcome {
  std::vector<bool> selected;
  std::vector<int> component_of;
  std::vector<ConflictComponent> components;
};

// Maximum-weight independent set per connected component of the conflict graph:
// bipartite components exactly by one min cut (independent set = complement of a
// minimum-weight vertex cover), other components up to `max_exact_size`
// candidates exactly by branch and bound, larger ones greedily by weight.
// Weights must be positive.
SelectionOutcome select_candidates(std::span<const std::int64_t> weights, const ConflictGroups& conflicts,
                                   int max_exact_size);
// The same after conflicts were added: only components holding a candidate marked
// in `changed` are solved again; the others keep their choice from `previous`.
SelectionOutcome reselect_candidates(std::span<const std::int64_t> weights,
                                     const ConflictGroups& conflicts, int max_exact_size,
                                     const SelectionOutcome& previous, const std::vector<bool>& changed);

}  // namespace metile::fusion_internal
