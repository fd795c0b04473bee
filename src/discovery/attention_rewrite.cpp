// The attention rewrite, run before planning: every chain
//
//   scores = matmul(q, k, transpose_right) → [scale] → [causal_mask | position_mask] → [cast to f32]
//          → softmax(last axis) → [cast] → matmul(probabilities, v)
//
// (at most one scale, before or after the mask; the casts are the mixed-precision softmax models write,
// transformers' softmax(scores, dtype=float32).to(q.dtype): widening the scores is exact and the
// probabilities are rounded to v's dtype, so the chain is still attention in exact arithmetic) whose
// intermediates are private
// (one consumer, not a graph output) becomes a candidate worth the bytes of the
// score and probability tensors it avoids;
// overlapping candidates go through the planner's conflict selection
// (select_disjoint_node_sets); each selected chain becomes one flash_attention
// node carrying the certificate of the stable weighted-softmax law. Grouped-query
// attention needs nothing more: q arrives reshaped to [Hkv, G·S, D] (COMMON
// shape convention), so its rows are simply R = G·S rows per KV head.
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "metile/discovery.h"

namespace metile {
namespace {

constexpr std::string_view required_law = "stable_weighted_softmax";

std::string bytes_text(std::int64_t bytes) {
  if (bytes >= (std::int64_t{1} << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
  if (bytes >= (std::int64_t{1} << 10)) return fmt::format("{:.1f} KiB", static_cast<double>(bytes) / (1 << 10));
  return fmt::format("{} B", bytes);
}

struct ChainOutcome {
  std::optional<AttentionMatch> match;  // none and a decision that is ok: not an attention chain at all
  Decision decision = Decision::allow();  // refused: the shape of a chain is there but it may not be rewritten
};

// Whether a value of the chain may stay inside the fused kernel, and why not.
Decision stays_private(const ComputeGraph& graph, ValueId value, std::string_view role, NodeId expected_consumer) {
  if (graph.is_output(value)) return Decision::refuse(fmt::format("{} escape to a graph output", role));
  for (NodeId consumer : graph.consumers(value)) {
    if (consumer != expected_consumer) {
      return Decision::refuse(
          fmt::format("{} are also read by '{}' ({})", role, graph.node(consumer).name, graph.node(consumer).op));
    }
  }
  return Decision::allow();
}

bool is_scores_op(const std::string& op) { return op == "scale" || op == "causal_mask" || op == "position_mask"; }

// Whether `value` is the scores of a q kᵀ matmul, directly or through scales, masks and casts: an op
// of another kind that reads it stands between the scores and the softmax.
bool comes_from_scores(const ComputeGraph& graph, ValueId value) {
  NodeId source = graph.value(value).producer;
  while (source >= 0 && (is_scores_op(graph.node(source).op) || graph.node(source).op == "cast")) {
    source = graph.value(graph.node(source).inputs.front()).producer;
  }
  return source >= 0 && graph.node(source).op == "matmul" && graph.node(source).attributes.get_int("transpose_right") != 0;
}

ChainOutcome match_chain(const ComputeGraph& graph, const Node& softmax) {
  ChainOutcome outcome;
  const ValueId probabilities = softmax.outputs.front();
  // Forward: the probabilities, or their cast, must be the left operand of a matmul (with v). A
  // softmax that feeds no matmul is not attention at all: no candidate, no refusal.
  const auto matmul_reading = [&](ValueId value) {
    NodeId found = -1;
    for (NodeId consumer : graph.consumers(value)) {
      const Node& node = graph.node(consumer);
      if (node.op == "matmul" && node.inputs[0] == value) found = consumer;
    }
    return found;
  };
  NodeId output_matmul = matmul_reading(probabilities);
  NodeId output_cast = -1;
  for (NodeId consumer : graph.consumers(probabilities)) {
    if (output_matmul >= 0 || graph.node(consumer).op != "cast") continue;
    if (const NodeId reader = matmul_reading(graph.node(consumer).outputs.front()); reader >= 0) {
      output_cast = consumer;
      output_matmul = reader;
    }
  }
  if (output_matmul < 0) return outcome;
  // Backward: a widening cast, then scales and at most one mask, then the scores matmul.
  std::vector<NodeId> between;  // from the softmax backwards
  ValueId value = softmax.inputs.front();
  NodeId producer = graph.value(value).producer;
  NodeId input_cast = -1;
  if (producer >= 0 && graph.node(producer).op == "cast") {
    input_cast = producer;
    value = graph.node(producer).inputs.front();
    producer = graph.value(value).producer;
  }
  while (producer >= 0) {
    if (!is_scores_op(graph.node(producer).op)) break;
    between.push_back(producer);
    value = graph.node(producer).inputs.front();
    producer = graph.value(value).producer;
  }
  if (producer < 0) return outcome;  // the softmax of an input: nothing to fuse
  const Node& scores_matmul = graph.node(producer);
  if (scores_matmul.op != "matmul") {
    const bool reads_scores = std::any_of(scores_matmul.inputs.begin(), scores_matmul.inputs.end(),
                                          [&](ValueId input) { return comes_from_scores(graph, input); });
    if (!between.empty() || reads_scores) {
      outcome.decision = Decision::refuse(fmt::format("'{}' ({}) between the scores and the softmax is not part of "
                                                      "the pattern (scale, causal_mask, position_mask, a cast to f32 "
                                                      "at the softmax)",
                                                      scores_matmul.name, scores_matmul.op));
    }
    return outcome;
  }
  auto refuse = [&](std::string reason) {
    outcome.decision = Decision::refuse(std::move(reason));
    return outcome;
  };
  if (input_cast >= 0) {
    // Only a cast that keeps every score: f16 and bf16 widen exactly to f32. A narrowing cast rounds the
    // scores a second time, which flash_attention (scores in f32) would not.
    const DType from = graph.value(graph.node(input_cast).inputs.front()).spec.dtype;
    const DType to = graph.value(graph.node(input_cast).outputs.front()).spec.dtype;
    if (from != to && !(to == DType::f32 && (from == DType::f16 || from == DType::bf16))) {
      return refuse(fmt::format("'{}' casts the scores from {} to {} before the softmax (only a widening cast to f32 "
                                "keeps them)",
                                graph.node(input_cast).name, dtype_name(from), dtype_name(to)));
    }
  }
  const int rank = graph.value(softmax.inputs.front()).spec.rank();
  if (softmax.attributes.get_int("axis") != rank - 1) return refuse("softmax axis is not the key axis");
  if (scores_matmul.attributes.get_int("transpose_right") == 0) {
    return refuse("the scores come from a matmul without transpose_right (k must be [..., T, D])");
  }
  const Node& out_matmul = graph.node(output_matmul);
  if (out_matmul.attributes.get_int("transpose_right") != 0) {
    return refuse("the output matmul has transpose_right (v must be [..., T, Dv])");
  }
  AttentionMatch match;
  match.q = scores_matmul.inputs[0];
  match.k = scores_matmul.inputs[1];
  match.v = out_matmul.inputs[1];
  // matmul(p, p): v would be a value the rewrite removes.
  if (match.v == probabilities || (output_cast >= 0 && match.v == graph.node(output_cast).outputs.front())) {
    return refuse("the probabilities are also v (both operands of the output matmul)");
  }
  const int q_rank = graph.value(match.q).spec.rank();
  if (q_rank < 3) return refuse("q has no head axis (rank 2): flash_attention needs q [..., Hkv, R, D]");
  if (graph.value(match.k).spec.rank() != q_rank) return refuse("k is shared by every batch (rank 2), not [..., Hkv, T, D]");
  if (graph.value(match.v).spec.rank() != q_rank) return refuse("v is shared by every batch (rank 2), not [..., Hkv, T, Dv]");
  // A cast can carry the probabilities to another dtype than q's; flash_attention reads one dtype.
  if (const DType v_dtype = graph.value(match.v).spec.dtype, q_dtype = graph.value(match.q).spec.dtype; v_dtype != q_dtype) {
    return refuse(fmt::format("v is {} and q {} (flash_attention reads q, k and v in one dtype)", dtype_name(v_dtype),
                              dtype_name(q_dtype)));
  }

  // Private intermediates: every value between the two matmuls is read once, by the next op.
  std::vector<NodeId> chain = {scores_matmul.id};
  chain.insert(chain.end(), between.rbegin(), between.rend());
  if (input_cast >= 0) chain.push_back(input_cast);
  chain.push_back(softmax.id);
  if (output_cast >= 0) chain.push_back(output_cast);
  for (std::size_t position = 0; position < chain.size(); ++position) {
    const Node& node = graph.node(chain[position]);
    const NodeId next = position + 1 < chain.size() ? chain[position + 1] : output_matmul;
    const std::string cast_to = node.op == "cast" ? std::string(dtype_name(graph.value(node.outputs.front()).spec.dtype)) : "";
    const std::string role = position == 0                     ? "scores"
                             : node.op == "softmax"            ? "probabilities"
                             : chain[position] == input_cast   ? fmt::format("scores cast to {}", cast_to)
                             : chain[position] == output_cast  ? fmt::format("probabilities cast to {}", cast_to)
                                                               : fmt::format("{} scores", node.op == "scale" ? "scaled" : "masked");
    if (Decision private_value = stays_private(graph, node.outputs.front(), role, next); !private_value) {
      return refuse(std::move(private_value.reason));
    }
    match.avoided_bytes += 2 * graph.value(node.outputs.front()).spec.bytes();
  }

  // One scale; one mask; a scale after the mask must keep -inf at -inf. A second scale is refused: the
  // chain rounds the scores to their dtype after each, so an intermediate that overflows (inf) or
  // underflows (f16 0) is lost there, which one flash_attention scale by the product never sees.
  bool masked = false;
  bool scaled = false;
  for (auto position = between.rbegin(); position != between.rend(); ++position) {
    const Node& node = graph.node(*position);
    if (node.op == "scale") {
      const double factor = node.attributes.get_double("factor");
      if (scaled) {
        return refuse(fmt::format("'{}' is a second scale on the scores (the chain rounds them to {} between the two; "
                                  "flash_attention scales once)",
                                  node.name, dtype_name(graph.value(node.outputs.front()).spec.dtype)));
      }
      scaled = true;
      // A factor flash_attention cannot take as its scale (past f32's range times log2(e)).
      if (const std::optional<std::string> problem = flash_attention_scale_problem(factor)) {
        return refuse(fmt::format("'{}' scales by {}, which {}", node.name, factor, *problem));
      }
      if (masked && factor <= 0) return refuse(fmt::format("'{}' scales by {} after the mask (only a positive factor keeps masked scores at -inf)", node.name, factor));
      match.scale *= factor;
      continue;
    }
    if (masked) return refuse(fmt::format("'{}' is a second mask on the scores", node.name));
    masked = true;
    if (node.op == "causal_mask") {
      match.mask = "causal";
      match.offset = node.attributes.get_int("offset");
    } else {
      match.mask = "positions";
      match.positions = node.inputs[1];
    }
  }
  match.nodes = chain;
  match.nodes.push_back(output_matmul);
  std::sort(match.nodes.begin(), match.nodes.end());
  match.output_matmul = output_matmul;
  outcome.match = std::move(match);
  return outcome;
}

ComputeGraph rebuild(const ComputeGraph& graph, const std::vector<AttentionMatch>& selected, const Certificate& certificate) {
  std::map<NodeId, const AttentionMatch*> replaced_at;  // output matmul -> its chain
  std::set<NodeId> removed;
  for (const AttentionMatch& match : selected) {
    replaced_at[match.output_matmul] = &match;
    removed.insert(match.nodes.begin(), match.nodes.end());
  }
  const std::string certificate_json = certificate.to_json();
  GraphBuilder builder;
  std::vector<ValueRef> refs(graph.values().size());
  for (ValueId input : graph.inputs()) {
    refs[static_cast<std::size_t>(input)] = builder.input(graph.value(input).name, graph.value(input).spec);
  }
  auto ref = [&](ValueId id) { return refs[static_cast<std::size_t>(id)]; };
  for (const Node& node : graph.nodes()) {
    if (const auto found = replaced_at.find(node.id); found != replaced_at.end()) {
      const AttentionMatch& match = *found->second;
      std::vector<ValueRef> inputs = {ref(match.q), ref(match.k), ref(match.v)};
      if (match.positions >= 0) inputs.push_back(ref(match.positions));
      Attributes attributes;
      attributes.set("scale", match.scale);
      attributes.set("mask", match.mask);
      attributes.set("offset", match.offset);
      attributes.set("certificate", certificate_json);
      refs[static_cast<std::size_t>(node.outputs.front())] =
          builder.add_node("flash_attention", std::move(inputs), std::move(attributes), node.name).front();
      continue;
    }
    if (removed.contains(node.id)) continue;
    std::vector<ValueRef> inputs;
    for (ValueId input : node.inputs) inputs.push_back(ref(input));
    const std::vector<ValueRef> outputs = builder.add_node(node.op, std::move(inputs), node.attributes, node.name);
    for (std::size_t index = 0; index < outputs.size(); ++index) refs[static_cast<std::size_t>(node.outputs[index])] = outputs[index];
  }
  std::vector<ValueRef> outputs;
  for (ValueId output : graph.outputs()) outputs.push_back(ref(output));
  return builder.build(outputs);
}

}  // namespace

AttentionRewrite rewrite_attention(const ComputeGraph& graph, const ReductionLaw& law,
                                   const std::function<Decision(const AttentionMatch&)>& admit) {
  AttentionRewrite rewrite;
  rewrite.certificate = prove(law);
  Decision law_decision = Decision::allow();  // may this law's certificate back flash_attention
  if (law.name != required_law) {
    law_decision = Decision::refuse(fmt::format("flash_attention is built on law '{}', not '{}'", required_law, law.name));
  } else if (!rewrite.certificate.verified) {
    std::string failing;
    for (const Obligation& obligation : rewrite.certificate.obligations) {
      if (!obligation.holds) failing += (failing.empty() ? "" : ", ") + obligation.name;
    }
    law_decision = Decision::refuse(fmt::format("the certificate of law '{}' is not verified (fails: {})", law.name, failing));
  } else if (!(rewrite.certificate == prove(*find_law(required_law)))) {
    // The executors' check (require_verified_certificate): flash_attention evaluates the built-in law,
    // so a law that only shares its name would give nodes every executor refuses.
    law_decision = Decision::refuse(fmt::format("law '{}' is not the law flash_attention evaluates (its certificate "
                                                "differs from a fresh proof of the built-in '{}')",
                                                law.name, required_law));
  }
  for (const Node& node : graph.nodes()) {
    if (node.op != "softmax") continue;
    ChainOutcome outcome = match_chain(graph, node);
    if (!outcome.decision) rewrite.refusals.push_back({node.id, outcome.decision.reason});
    if (!outcome.match) continue;
    if (!law_decision) {
      rewrite.refusals.push_back({node.id, law_decision.reason});
      continue;
    }
    if (admit) {
      if (const Decision admitted = admit(*outcome.match); !admitted) {
        rewrite.refusals.push_back({node.id, admitted.reason});
        continue;
      }
    }
    rewrite.candidates.push_back(std::move(*outcome.match));
  }
  std::vector<std::vector<NodeId>> node_sets;
  std::vector<std::int64_t> weights;
  for (const AttentionMatch& match : rewrite.candidates) {
    node_sets.push_back(match.nodes);
    weights.push_back(std::max<std::int64_t>(match.avoided_bytes, 1));
  }
  NodeSetSelection selection = select_disjoint_node_sets(graph.nodes().size(), node_sets, weights);
  rewrite.components = std::move(selection.components);
  std::vector<AttentionMatch> selected;
  for (std::size_t index = 0; index < rewrite.candidates.size(); ++index) {
    rewrite.candidates[index].selected = selection.selected[index];
    if (selection.selected[index]) selected.push_back(rewrite.candidates[index]);
  }
  rewrite.graph = selected.empty() ? graph : rebuild(graph, selected, rewrite.certificate);
  return rewrite;
}

std::vector<std::string> AttentionRewrite::summary(const ComputeGraph& original) const {
  std::vector<std::string> lines;
  for (const AttentionMatch& match : candidates) {
    std::string ops;
    for (NodeId node : match.nodes) ops += (ops.empty() ? "" : ", ") + original.node(node).name;
    const std::string& name = original.node(match.output_matmul).name;
    if (!match.selected) {
      lines.push_back(fmt::format("flash_attention at '{}' not selected: it overlaps a heavier candidate ({})", name, ops));
      continue;
    }
    lines.push_back(fmt::format("flash_attention '{}' replaces {} ({} of memory traffic saved: the scores and "
                                "probabilities, written and read once; scale {}, mask {}): law {} {}",
                                name, ops, bytes_text(match.avoided_bytes), match.scale,
                                match.mask == "causal" ? fmt::format("causal offset {}", match.offset) : match.mask,
                                certificate.law, certificate.verified ? "verified" : "NOT verified"));
  }
  for (const AttentionRefusal& refusal : refusals) {
    lines.push_back(fmt::format("flash_attention refused at '{}': {}", original.node(refusal.node).name, refusal.reason));
  }
  return lines;
}

FusionPlan plan_with_discovery(const ComputeGraph& recorded, const FusionTarget& target, const RuleSet& rules) {
  // A flash_attention node the graph came with (a saved rewrite) is checked as the executors check
  // it: its certificate's own "verified" is a claim, and a plan printed it as a fact.
  require_verified_certificates(recorded);
  // Nodes no output depends on are removed first: no kernel computes them, and their reads do not
  // make a chain's scores "escape".
  std::vector<NodeId> dead;
  const ComputeGraph graph = without_dead_nodes(recorded, &dead);
  // A chain the target's cost model gives no saving stays plain ops: planning selects profitable
  // regions only, and a rewrite is a region of one kernel. The estimate, by output matmul, is also
  // the benefit of the region the rewritten node becomes. That kernel is held to the target's limits
  // as every region is (a target allowing 2 inputs a kernel got a flash_attention reading 4).
  std::map<NodeId, double> benefit_ns_of_chain;
  const AttentionRewrite rewrite = rewrite_attention(graph, stable_weighted_softmax_law(), [&](const AttentionMatch& match) {
    const RegionEstimate estimate = estimate_region(graph, match.nodes, target);
    benefit_ns_of_chain[match.output_matmul] = estimate.benefit_ns;
    if (const Decision fits = within_limits(estimate, target); !fits) {
      return Decision::refuse(fmt::format("on the target '{}' the kernel {}", target.name, fits.reason));
    }
    if (estimate.benefit_ns > 0) return Decision::allow();
    return Decision::refuse(
        fmt::format("the target '{}' estimates no saving for it ({:.1f} ns)", target.name, estimate.benefit_ns));
  });
  FusionPlan plan = plan_graph_fusion(rewrite.graph, target, rules);
  const ComputeGraph& planned = *plan.graph;
  std::set<NodeId> rewritten_here;
  for (const AttentionMatch& match : rewrite.candidates) {
    if (!match.selected) continue;
    const auto node = planned.find_node(graph.node(match.output_matmul).name);
    if (node) rewritten_here.insert(*node);
    for (FusionRegion& region : plan.regions) {
      if (node && region.nodes == std::vector<NodeId>{*node}) {
        region.benefit_ns = benefit_ns_of_chain.at(match.output_matmul);
      }
    }
  }
  // A flash_attention node the graph came with (a saved rewrite) is estimated as its plain-op expansion,
  // as near as the node tells of the chain it replaced (a chain's casts are not recorded): its saving was 0
  // once saved, the chain's straight after discovery. Where discovery would have left that chain as plain
  // ops (past the target's limits, no saving) it is said, and no saving is counted; the node is one op and
  // is planned as given.
  for (FusionRegion& region : plan.regions) {
    if (region.nodes.size() != 1 || planned.node(region.nodes.front()).op != "flash_attention" ||
        rewritten_here.contains(region.nodes.front())) {
      continue;
    }
    const ComputeGraph chain = flash_attention_as_plain_ops(planned, region.nodes.front());
    std::vector<NodeId> chain_nodes(chain.nodes().size());
    std::iota(chain_nodes.begin(), chain_nodes.end(), NodeId{0});
    const RegionEstimate estimate = estimate_region(chain, chain_nodes, target);
    std::string& reason = plan.node_reasons[static_cast<std::size_t>(region.nodes.front())];
    if (const Decision fits = within_limits(estimate, target); !fits) {
      reason += fmt::format("; on the target '{}' this saved flash_attention kernel {} (planned as given: one op; "
                            "no saving counted)",
                            target.name, fits.reason);
    } else if (estimate.benefit_ns <= 0) {
      reason += fmt::format("; the target '{}' estimates no saving for the chain this saved node stands for "
                            "(planned as given: one op)",
                            target.name);
    } else {
      region.benefit_ns = estimate.benefit_ns;
    }
  }
  for (const AttentionRefusal& refusal : rewrite.refusals) {
    if (const auto node = planned.find_node(graph.node(refusal.node).name)) {
      plan.node_reasons[static_cast<std::size_t>(*node)] += "; flash_attention refused: " + refusal.reason;
    }
  }
  for (NodeId node : dead) {
    plan.rewrites.push_back(fmt::format("removed '{}' ({}): no graph output depends on it", recorded.node(node).name,
                                        recorded.node(node).op));
  }
  const std::vector<std::string> attention = rewrite.summary(graph);
  plan.rewrites.insert(plan.rewrites.end(), attention.begin(), attention.end());
  return plan;
}

ComputeGraph flash_attention_as_plain_ops(const ComputeGraph& graph, NodeId node_id) {
  const Node& node = graph.node(node_id);
  if (node.op != "flash_attention") {
    throw InputError(fmt::format("node '{}' ({}): not a flash_attention node", node.name, node.op));
  }
  require_verified_certificate(node, stable_weighted_softmax_law().name);
  GraphBuilder builder;
  const ValueRef q = builder.input("q", graph.value(node.inputs[0]).spec);
  const ValueRef k = builder.input("k", graph.value(node.inputs[1]).spec);
  const ValueRef v = builder.input("v", graph.value(node.inputs[2]).spec);
  ValueRef scores = builder.matmul(q, k, true, "scores");
  // A chain recorded without a scale is rewritten with scale 1: no node for it (x * 1 is x exactly).
  if (const double scale = node.attributes.get_double("scale"); scale != 1.0) scores = builder.scale(scores, scale, "scaled");
  const std::string& mask = node.attributes.get_string("mask");
  if (mask == "causal") scores = builder.causal_mask(scores, node.attributes.get_int("offset"), "masked");
  if (mask == "positions") {
    scores = builder.position_mask(scores, builder.input("positions", graph.value(node.inputs[3]).spec), "masked");
  }
  return builder.build({builder.matmul(builder.softmax(scores, -1, "probabilities"), v, false, "out")});
}

}  // namespace metile
