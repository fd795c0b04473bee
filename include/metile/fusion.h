// metile fusion module: plan_graph_fusion selects legal, profitable,
// multi-output fusion regions with exact min-cut models (docs/architecture.md,
// "Neighborhood cut models", "Conflict selection", "Rules").
//
//   ComputeGraph ──► per rule, per anchor: neighborhood ──one min cut──► candidate region
//                ──► conflict graph (shared ops, kernel cycles) ──► components
//                ──► bipartite: one min cut │ small: branch and bound │ large: greedy ──► FusionPlan
//
// A target (FusionTarget) states costs and limits; a rule (FusionRule) states, as
// data, what may share a kernel and what resources that takes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "metile/decision.h"
#include "metile/graph.h"

namespace metile {

// ---------------------------------------------------------------- targets

// What a kernel costs and what one kernel may use on a machine. Times in
// nanoseconds, bandwidths in bytes per nanosecond (1 byte/ns = 1 GB/s). The
// member defaults are the h200 preset.
struct FusionTarget {
  std::string name = "h200";
  double launch_overhead_ns = 2500;               // one more kernel in a stream of launches
  double memory_bandwidth_bytes_per_ns = 4200;    // global memory, achievable copy rate
  double on_chip_bandwidth_bytes_per_ns = 33000;  // registers/shared memory, whole device
  int registers_per_thread = 255;
  int registers_per_multiprocessor = 65536;
  int threads_per_block = 256;                    // the block size register needs are checked at
  // A region's shared memory must fit the smaller of the two (within_limits): a block's is its multiprocessor's.
  std::int64_t shared_memory_per_block_bytes = 232448;          // 227 KiB, opt-in maximum
  std::int64_t shared_memory_per_multiprocessor_bytes = 233472;  // 228 KiB
  int max_kernel_inputs = 64;
  int max_kernel_outputs = 16;

  // NVIDIA H200 (sm_90): HBM3e copy bandwidth about 4.2 TB/s, 2.5 µs for one
  // more launch, 228 KiB shared memory per SM (227 KiB per block), 64K registers
  // per SM, 255 per thread.
  static FusionTarget h200();
  // The CPU reference backend: one core's streaming bandwidth, an op's dispatch
  // (allocation, loop set-up) as the launch, L2 as the on-chip store.
  static FusionTarget cpu();
  // A JSON object: optional "base" ("h200" or "cpu", default "h200") whose values
  // the other fields override. Unknown fields, wrong types and non-positive
  // values throw InputError naming the source and the field.
  static FusionTarget from_json(std::string_view text, std::string_view source_name = "<string>");
  static FusionTarget from_json_file(const std::filesystem::path& path);
  // "h200", "cpu", or the path of a JSON file.
  static FusionTarget from_name_or_file(std::string_view name_or_path);
  std::string to_json() const;  // every field; from_json(to_json()) gives the same target
  // from_json's rule for every field (positive; real figures in [1e-6, 1e12], integers within their
  // type): InputError "fusion target 'NAME': field '...' ..." for the first one outside it. The
  // planner checks its target with it, so a target set field by field meets a target file's rule.
  void check() const;
};

// ---------------------------------------------------------------- rules

// What a rule's kernel needs from the target, per thread or per block. The
// register model is conservative: every fused op's registers are live at once.
// Register figures are 0 or more: plan_graph_fusion refuses a negative one, naming it.
struct ResourceNeeds {
  int base_registers = 32;                     // indexing, pointers, loop state
  int registers_per_elementwise = 2;
  int registers_per_row_reduction = 8;         // running sum / max and the row statistics
  int registers_per_contraction = 24;          // a 16-wide f32 accumulator tile and its operands
  int registers_per_quantized_contraction = 40;  // plus scales, biases and unpacked weights
  // A row reduction whose input is computed inside the kernel keeps that row
  // (f32) in shared memory for its second pass.
  bool stages_reduction_rows = true;
  // A contraction whose activation is computed inside the kernel keeps all of
  // that activation's rows (in its dtype) in shared memory before the mainloop.
  bool stages_contraction_activations = false;
};
// ResourceNeeds' register figures by name ("base_registers", ...): what validate_rule_set checks (each
// 0 or more) and its errors name.
std::span<const std::pair<const char*, int ResourceNeeds::*>> register_need_fields();

// A value a rule bound, under the name the rule gives it ("gate_weight", "residual", ...).
struct RegionRole {
  std::string role;
  ValueId value = -1;
  bool operator==(const RegionRole&) const = default;
};

// One op of a rule's required structure. Input slots name where each input
// comes from: the role of another entry ("gate"), an outside value bound by a
// name shared between entries ("$input": same name, same value), or ""
// (anything). Each "$name" binding becomes the region role "name" (FusionRegion::roles); a
// "$name" slot the matched node does not have binds nothing.
struct OpPattern {
  std::string role;
  OpKind kind = OpKind::elementwise;
  std::vector<std::string> ops;     // allowed op names; empty: any op of `kind`
  std::vector<std::string> inputs;  // per input slot, as above; missing slots are unconstrained
  bool commutative = false;         // slots 0 and 1 may match either way round
  bool may_escape = false;          // its value may also leave the kernel (written as an extra output)
  // A certified rewrite's op (a node with a certificate: flash_attention) is a kernel of its own, and
  // no entry takes it unless the entry says so here; the region then carries the node's certificate
  // (FusionRegion::certificate), which the lowering checks before anything built on it runs.
  bool certified = false;
};

// Neighbours the cut model may pull in around the required structure.
struct GrowthSpec {
  std::vector<OpKind> kinds;  // empty: no growth on this side
  int max_depth = 0;          // steps from the anchor; -1: unbounded
};

// Sibling grouping: ops that read one value in the same input slot and are alike (same op and
// attributes, their other operands of one dtype and shape but the first axis, outputs of one
// dtype and shape but the last axis) become one kernel, e.g. the q, k and v projections as one
// contraction over their weights stacked by rows. The rule's pattern is one entry; the value its
// `"$" + shared_role` slot binds is the shared one, and each member's `"$" + member_role` binding
// becomes the role `member_role.i` (i: the member's position in topological order). A member's
// only reader that adds a vector as long as the member's last axis (a bias) joins as that
// member's epilogue, binding FusionRule::epilogue_add_operand_role as `<role>.i`.
struct SiblingSpec {
  std::string shared_role;  // "input"
  std::string member_role;  // "weight"
  int max_members = 8;      // readers beyond this many stay out (the kernel writes one value per member)
};

// Companion chains (FusionRule::companions): patterns matched beside the rule's own pattern at
// readers of a value it bound, joining its region as one kernel, e.g. the q chain (reshape,
// transpose, rope) and the v chain (reshape, transpose, kv_cache_write) beside k's (reshape,
// transpose, rope, kv_cache_write). A "$name" the rule's pattern binds must bind the same value
// in the companion (the positions); other "$name"s become roles of the region. The companion's
// `source_role` value and the rule's `FusionRule::companion_source_role` value must come from
// sibling contractions (one input read by both, each directly or through a bias add), so the q and
// v of k's own layer join, and every chain's values but its anchor's output stay in the kernel.
struct CompanionChain {
  std::vector<OpPattern> pattern;  // the last entry is its anchor
  std::string source_role;         // "q"
  // Pairs (companion role, pattern role) whose ops must carry equal attributes: the kernel applies
  // one rotary embedding to q and k ({"q_rope", "k_rope"}).
  std::vector<std::pair<std::string, std::string>> same_attributes = {};
};
// A producer of the value a region's role binds, joining the region when the region is its only
// reader: the RMSNorm before a GEMV region (q/k/v siblings, gate/up), which the GEMV computes
// while it loads x. The producer must match `pattern` (one entry; its "$name" slots bind roles as
// a rule's do; slots naming other entries are not allowed), lie outside the region, and its value
// must be read by region nodes only and be no graph output (the kernel never writes it).
struct InputPrologue {
  std::string role;   // "input"
  OpPattern pattern;  // "norm": rms_norm("$norm_input", "$norm_weight")
};
// The RMSNorm prologue of the GEMV regions (rules.cpp): rms_norm(norm_input, norm_weight) producing
// the role "input".
InputPrologue normalized_input_prologue();
// The node `prologue` adds to a region of `region_nodes` with `roles`, and the roles it binds; or
// why it adds none ("`normed` is also read by `other`", "the role 'input' is a graph input").
struct PrologueMatch {
  Decision decision;
  NodeId node = -1;
  std::vector<RegionRole> roles;
};
PrologueMatch match_input_prologue(const ComputeGraph& graph, std::span<const NodeId> region_nodes,
                                   std::span<const RegionRole> roles, const InputPrologue& prologue);

// A declarative fusion rule: a pattern anchored at its last entry, optional
// growth on the producer side (prologue) and consumer side (epilogue), and the
// resources its kernel takes. Growth ops must produce the anchor's output shape
// in a floating dtype (one iteration space per kernel).
struct FusionRule {
  std::string name;
  std::string description;
  std::vector<OpPattern> pattern;  // at least one entry; the last is the anchor
  bool anchor_must_be_sink = false;  // the anchor has no consumer of its own kind (chain ends)
  GrowthSpec prologue;
  GrowthSpec epilogue;
  // Growth ops (and the anchor) may leave values that are also read outside the
  // kernel; the kernel writes them as extra outputs. Without it, such ops stay out.
  bool materializes_escaping_values = false;
  ResourceNeeds resources;
  // When set, an `add` in the region that reads the anchor's output binds its other operand to this
  // role ("residual": the residual add on a down projection, which is epilogue growth, not pattern).
  std::string epilogue_add_operand_role = {};
  // When set, the rule groups siblings (SiblingSpec) instead of growing a neighborhood.
  std::optional<SiblingSpec> siblings = {};
  // When set, the rule's region is its pattern plus every companion chain, each matched exactly
  // once (CompanionChain), instead of a grown neighborhood; refused, with why, otherwise.
  std::vector<CompanionChain> companions = {};
  std::string companion_source_role = {};  // "k"
  // When set, every region the rule proposes is proposed a second time with this producer of its
  // input (InputPrologue) when it may join; conflict selection keeps the better of the two.
  std::optional<InputPrologue> input_prologue = {};
  // When set (two names of earlier rules in the set, producer first), the rule has no pattern of
  // its own: its regions are one region of the first rule joined to one of the second where every
  // value the first writes is read by the second only (and is no graph output), e.g. the q, k, v
  // sibling contractions and the rope and cache writes that carry them to attention. The joined
  // region keeps both regions' roles and, as FusionRegion::parts, the two regions; it saves one
  // launch and the round trip of the values between them, and competes with its parts in conflict
  // selection like any region.
  std::vector<std::string> composes = {};
};

// The largest conflict component solved exactly (branch and bound keeps a component in 64-bit masks, and
// its time grows exponentially: an odd cycle of 63 sets takes minutes).
inline constexpr int kMaxExactComponentSizeLimit = 40;

// Rules in priority order (an identical region found by two rules keeps the
// first rule's name) plus the planner's search bounds.
struct RuleSet {
  std::vector<FusionRule> rules;
  int max_neighborhood_nodes = 64;      // ops one cut model may consider, anchor included
  int max_exact_component_size = 24;    // non-bipartite conflict components solved exactly up to this size (<= kMaxExactComponentSizeLimit)
};

// The default rules, in default_rules() order:
FusionRule residual_add_rms_norm_rule();  // add → rms_norm, the sum written too when it escapes
FusionRule parallel_epilogue_rule();      // "swiglu_mlp": gate/up contractions, silu(gate)·up, down contraction
FusionRule contraction_epilogue_rule();   // a contraction and elementwise ops on its output
FusionRule sibling_contractions_rule();   // contractions sharing their input (q, k, v), with their bias adds
FusionRule rope_kv_cache_rule();          // rope on q and k, k and v into their caches (companion chains)
FusionRule attention_output_projection_rule();  // flash_attention, its heads merged, the projection (+ residual)
FusionRule qkv_rope_kv_cache_rule();      // composes sibling_contractions and rope_kv_cache: one kernel
FusionRule row_reduction_rule();          // elementwise prologue and epilogue around a row reduction
FusionRule elementwise_chain_rule();      // elementwise ops ending in an elementwise sink
RuleSet default_rules();

// ---------------------------------------------------------------- cost model

// The analytical estimate of running a set of nodes as one kernel. Unfused, each
// node is one launch that reads its inputs and writes its outputs; fused, one
// launch reads the region's inputs once and writes the values that leave it,
// every op's result passing through on-chip storage.
struct RegionEstimate {
  double unfused_ns = 0;
  double fused_ns = 0;
  double benefit_ns = 0;                     // unfused_ns - fused_ns
  std::int64_t memory_bytes_avoided = 0;     // global reads and writes saved
  int registers_per_thread = 0;
  std::int64_t shared_memory_bytes = 0;
  int input_count = 0;
  int output_count = 0;
};
RegionEstimate estimate_region(const ComputeGraph& graph, std::span<const NodeId> nodes, const FusionTarget& target,
                               const ResourceNeeds& needs = {});
// Whether the estimate fits the target; refused with the first limit it exceeds, said for a
// person ("needs 48 KB shared memory, target allows 32 KB").
Decision within_limits(const RegionEstimate& estimate, const FusionTarget& target);

// ---------------------------------------------------------------- plans

// One kernel-to-be: a convex set of nodes and the values crossing its boundary.

struct FusionRegion {
  std::string rule;              // the rule that matched, e.g. "residual_add_rms_norm", "swiglu_mlp"
  std::vector<NodeId> nodes;     // topological order
  std::vector<ValueId> inputs;   // values read from outside the region, first-use order
  std::vector<ValueId> outputs;  // values written by the region (graph outputs or consumed outside)
  double benefit_ns = 0;         // estimated cost saved against running the nodes unfused
  // A region of one node made by a certified rewrite (discovery), or a rule's region holding such a
  // node (OpPattern::certified): that node's certificate, as JSON ({"law", "theory", "obligations",
  // "verified"}); empty for every other region.
  std::string certificate = {};  // (a default initializer: aggregate initializations may leave it out)
  // What the rule's pattern bound, in pattern order (then epilogue roles): lowerings read a
  // region's operands here instead of by value name. Empty for single-op and certified regions.
  std::vector<RegionRole> roles = {};
  // A composed rule's region (FusionRule::composes): the regions it joins, producer first.
  std::vector<FusionRegion> parts = {};
  std::optional<ValueId> role(std::string_view name) const;  // the value bound to `name`, if any
};

// The region of `nodes` (any order; kept in topological order) with its boundary computed from
// the graph: inputs are values read from outside, in first-use order; outputs are values that
// are graph outputs or read outside the region. The one place a region's boundary is derived.
FusionRegion region_of_nodes(const ComputeGraph& graph, std::vector<NodeId> nodes, std::string rule = {});

// Which candidates exclude each other, as groups: every two candidates of one group conflict (at most
// one of a group becomes a region). The candidates holding one op are one group, so n candidates
// sharing a producer cost n entries, not the n^2 of pairwise lists (one exp read by 10,000 chains is
// one group of 10,000); a kernel cycle between two regions adds a group of the two.
class ConflictGroups {
 public:
  explicit ConflictGroups(std::size_t candidate_count = 0) : groups_of_(candidate_count) {}
  std::size_t candidate_count() const { return groups_of_.size(); }
  // Each ascending, of two candidates or more.
  const std::vector<std::vector<int>>& groups() const { return groups_; }
  // The indices of the groups holding `candidate`, ascending.
  const std::vector<int>& groups_of(int candidate) const;
  bool conflict(int a, int b) const;  // a and b in one group (false for a == b)
  // The candidates `candidate` excludes, ascending (its groups' members but itself).
  std::vector<int> conflicts_of(int candidate) const;
  // `members` (any order; repeats ignored) as a group, unless they are fewer than two or the same group
  // is there already; returns whether it added one. std::out_of_range for a member that is no candidate.
  // (A group inside a larger one is kept: it changes no selection, and looking for one cost a
  // candidate's groups per group added.)
  bool add_group(std::vector<int> members);
  // `other`'s candidates appended after these (candidate k of `other` becomes candidate_count() + k),
  // with their groups.
  void append(const ConflictGroups& other);

 private:
  std::vector<std::vector<int>> groups_;
  std::vector<std::vector<int>> groups_of_;
  std::unordered_multimap<std::uint64_t, int> groups_by_hash_;  // the same group once
};

// A region some rule proposed, and what conflict selection made of it.
struct FusionCandidate {
  std::string rule;
  NodeId anchor = -1;
  std::vector<NodeId> nodes;     // ascending
  double benefit_ns = 0;
  int component = -1;            // index into FusionPlan::components
  int region = -1;               // index into FusionPlan::regions when selected, else -1
};

struct ConflictComponent {
  std::vector<int> candidates;   // ascending candidate indices
  // "single", "min_cut", "branch_and_bound" or "greedy", with "+cycle_drops" where regions it chose were
  // dropped to break kernel cycles. A bipartite component whose weights the min cut's network cannot
  // carry (integer_capacity_totals_problem, flow.h) is solved as a non-bipartite one.
  std::string method;
  bool bipartite = true;
  int round = 1;                 // the selection round that proposed them: 1, or a later round over
                                 // the ops the regions chosen before left (plan_graph_fusion)
};

struct FusionPlan {
  std::shared_ptr<const ComputeGraph> graph;
  std::vector<FusionRegion> regions;
  std::vector<NodeId> unfused;  // nodes that run as their own kernel
  std::vector<std::string> node_reasons;  // per node id: why it is or is not fused
  int kernel_count() const { return static_cast<int>(regions.size() + unfused.size()); }

  std::string target_name;
  std::vector<FusionCandidate> candidates;
  ConflictGroups conflicts;  // among `candidates` (the candidates of different rounds never conflict)
  std::vector<ConflictComponent> components;
  // Rewrites made before planning (plan_with_discovery: nodes no output depends on removed, certified
  // attention rewrites made or refused), one line each.
  std::vector<std::string> rewrites;

  double total_benefit_ns() const;
  // The plan for a person: regions with their ops, inputs, outputs and benefit,
  // then every node's reason.
  std::string explain() const;
  // {"kernels": N, "regions": [{"rule", "nodes", "inputs", "outputs", "benefit_ns"}], "unfused": [...]}
  // with node and value names; deterministic, byte for byte.
  std::string to_json() const;
  // Graphviz: each region a coloured cluster, unfused nodes plain.
  std::string to_dot() const;
};

// A node carrying a "certificate" attribute was made by a certified rewrite (discovery): it is a
// kernel of its own, never matched or grown into by a rule.
bool is_certified_node(const Node& node);

// ---------------------------------------------------------------- region kinds
// A region's kind is its `rule`: a rule's name, the op of a certified node (the planner makes a
// flash_attention node a region of that name), or one of the GPU Executable's own kinds for an
// unfused matmul (dispatch.h, contraction_node_region).
inline constexpr std::string_view kContractionRegionKind = "contraction";
inline constexpr std::string_view kContractionArgmaxRegionKind = "contraction_argmax";
// Every region kind a plan of `rules` and an Executable built on it can hold, sorted.
// ExecutableOptions::declined_rules (dispatch.h) takes these names; check_region_kinds refuses any
// other, since a misspelt kind would decline nothing without a word.
std::vector<std::string> region_kinds(const RuleSet& rules = default_rules());
// InputError "OPTION: 'swigl_mlp' is not a region kind (one of: ...)" for the first of `kinds` not in region_kinds(rules).
void check_region_kinds(const std::set<std::string>& kinds, std::string_view option, const RuleSet& rules = default_rules());

// Conflict selection on its own (docs/architecture.md, "Conflict selection"), for passes that propose node sets
// of their own (discovery's rewrites): sets sharing a node conflict; per component of the conflict
// graph the selection of largest total weight (weights positive), exactly where the planner is exact.
// max_exact_component_size is RuleSet's bound (1 to kMaxExactComponentSizeLimit); std::invalid_argument otherwise.
struct NodeSetSelection {
  std::vector<bool> selected;
  std::vector<int> component_of;  // per set: index into components
  std::vector<ConflictComponent> components;
};
NodeSetSelection select_disjoint_node_sets(std::size_t node_count, std::span<const std::vector<NodeId>> node_sets,
                                           std::span<const std::int64_t> weights, int max_exact_component_size = 24);

// The graph is copied into the plan (plan.graph), so the plan outlives it.
FusionPlan plan_graph_fusion(const ComputeGraph& graph, const FusionTarget& target = FusionTarget::h200(),
                             const RuleSet& rules = default_rules());

}  // namespace metile
