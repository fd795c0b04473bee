// The default fusion rules, written as data (include/metile/fusion.h, FusionRule).
// Everything the planner knows about which ops may share a kernel is here; the
// neighborhood models and conflict selection never look at an op's name.
#include <algorithm>

#include <fmt/core.h>

#include "metile/fusion.h"

namespace metile {
namespace {

// One pattern entry; the flags say what the kernel may do with its value.
struct EntryFlags {
  bool commutative = false;
  bool may_escape = false;
  bool certified = false;
};
OpPattern entry(std::string role, OpKind kind, std::vector<std::string> ops, std::vector<std::string> inputs,
                EntryFlags flags = {}) {
  OpPattern pattern;
  pattern.role = std::move(role);
  pattern.kind = kind;
  pattern.ops = std::move(ops);
  pattern.inputs = std::move(inputs);
  pattern.commutative = flags.commutative;
  pattern.may_escape = flags.may_escape;
  pattern.certified = flags.certified;
  return pattern;
}

}  // namespace

InputPrologue normalized_input_prologue() {
  // The RMSNorm whose output only the GEMVs read: each GEMV block reduces x's rows itself (x is at
  // most 16 rows at decode) and normalizes x while it loads it (src/codegen/gemv_device_helpers.cpp).
  return {.role = "input",
          .pattern = entry("norm", OpKind::row_reduction, {"rms_norm"}, {"$norm_input", "$norm_weight"})};
}

FusionRule residual_add_rms_norm_rule() {
  FusionRule rule;
  rule.name = "residual_add_rms_norm";
  rule.description = "a residual add feeding an RMSNorm; the sum is written too when it is read elsewhere";
  rule.pattern = {
      // The add's first operand is "values", its second "residual" (both come from outside the
      // pattern, so nothing structural tells them apart: the graph's operand order names them).
      entry("sum", OpKind::elementwise, {"add"}, {"$values", "$residual"}, {.commutative = false, .may_escape = true}),
      entry("norm", OpKind::row_reduction, {"rms_norm"}, {"sum", "$norm_weight"}),
  };
  rule.prologue = {.kinds = {OpKind::elementwise}, .max_depth = 3};
  rule.epilogue = {.kinds = {OpKind::elementwise}, .max_depth = 3};
  rule.materializes_escaping_values = true;
  return rule;
}

FusionRule parallel_epilogue_rule() {
  FusionRule rule;
  rule.name = "swiglu_mlp";
  rule.description =
      "two contractions sharing their activation, silu(gate) * up, consumed by a down contraction (the SwiGLU MLP)";
  rule.pattern = {
      entry("gate", OpKind::contraction, {}, {"$input", "$gate_weight"}),
      entry("up", OpKind::contraction, {}, {"$input", "$up_weight"}),
      entry("activation", OpKind::elementwise, {"silu"}, {"gate"}),
      entry("product", OpKind::elementwise, {"multiply"}, {"activation", "up"}, {.commutative = true, .may_escape = false}),
      entry("down", OpKind::contraction, {}, {"product", "$down_weight"}),
  };
  rule.epilogue_add_operand_role = "residual";
  // The residual add on the down projection is a composable epilogue.
  rule.epilogue = {.kinds = {OpKind::elementwise}, .max_depth = 2};
  rule.materializes_escaping_values = true;
  // gate and up accumulate together into the gated product, which the down projection reads back
  // from global memory (src/dispatch/gemv_lowering.cpp: two GEMV stages; at decode the product is
  // M x intermediate, a few hundred KB at most, and stays in L2). Nothing is staged in shared
  // memory, so the region is not limited by it: staging it on chip refused Llama-3-8B at M >= 8.
  rule.resources.stages_contraction_activations = false;
  rule.input_prologue = normalized_input_prologue();
  return rule;
}

FusionRule contraction_epilogue_rule() {
  FusionRule rule;
  rule.name = "contraction_epilogue";
  rule.description = "a contraction and elementwise ops applied to its output (residual add, activation, scale)";
  // matmul(a, b) and quantized_matmul(x, packed, ...) both take the activation first and the
  // weight (or its packed codes) second; an add on the output binds its other operand as the
  // "addend" (a residual [M, N] or a bias [N], told apart by shape by whoever reads it).
  rule.pattern = {entry("contraction", OpKind::contraction, {}, {"$input", "$weight"})};
  rule.epilogue_add_operand_role = "addend";
  rule.epilogue = {.kinds = {OpKind::elementwise}, .max_depth = 8};
  rule.materializes_escaping_values = true;
  return rule;
}

FusionRule sibling_contractions_rule() {
  FusionRule rule;
  rule.name = "sibling_contractions";
  rule.description =
      "contractions reading one input with alike weights (q, k, v), as one contraction over the weights stacked by "
      "rows, each with its bias add";
  // Every member binds its own weight ("weight.0", "weight.1", ...) and, with a bias add on its
  // output, the bias ("bias.0", ...); all of them bind the one "input".
  rule.pattern = {entry("contraction", OpKind::contraction, {}, {"$input", "$weight"})};
  rule.siblings = SiblingSpec{.shared_role = "input", .member_role = "weight", .max_members = 8};
  rule.epilogue_add_operand_role = "bias";
  rule.materializes_escaping_values = true;
  rule.input_prologue = normalized_input_prologue();
  return rule;
}

FusionRule rope_kv_cache_rule() {
  FusionRule rule;
  rule.name = "rope_kv_cache";
  rule.description =
      "the q, k and v projections' outputs made attention's inputs (src/model/step_graph.cpp): rope on q and k, k "
      "and v written into their caches at the step's positions, as one kernel";
  // k's chain is the pattern; q's and v's chains join it as companions (the outputs of k's sibling
  // contractions, read at the same positions), so each layer's three chains are one region.
  rule.pattern = {
      entry("k_heads", OpKind::layout, {"reshape"}, {"$k"}),
      entry("k_by_head", OpKind::layout, {"transpose"}, {"k_heads"}),
      entry("k_rope", OpKind::layout, {"rope"}, {"k_by_head", "$positions"}),
      entry("k_write", OpKind::layout, {"kv_cache_write"}, {"$k_cache", "k_rope", "$positions"}),
  };
  rule.companion_source_role = "k";
  rule.companions = {
      CompanionChain{.pattern = {entry("q_heads", OpKind::layout, {"reshape"}, {"$q"}),
                                 entry("q_by_head", OpKind::layout, {"transpose"}, {"q_heads"}),
                                 entry("q_rope", OpKind::layout, {"rope"}, {"q_by_head", "$positions"})},
                     .source_role = "q",
                     .same_attributes = {{"q_rope", "k_rope"}}},
      CompanionChain{.pattern = {entry("v_heads", OpKind::layout, {"reshape"}, {"$v"}),
                                 entry("v_by_head", OpKind::layout, {"transpose"}, {"v_heads"}),
                                 entry("v_write", OpKind::layout, {"kv_cache_write"}, {"$v_cache", "v_by_head", "$positions"})},
                     .source_role = "v"},
  };
  rule.materializes_escaping_values = false;
  return rule;
}

FusionRule qkv_rope_kv_cache_rule() {
  FusionRule rule;
  rule.name = "qkv_rope_kv_cache";
  rule.description =
      "the q, k and v projections (one GEMV over their stacked weights) with rope on q and k and the cache writes "
      "in its epilogue";
  rule.composes = {"sibling_contractions", "rope_kv_cache"};
  return rule;
}

FusionRule attention_output_projection_rule() {
  FusionRule rule;
  rule.name = "attention_output_projection";
  rule.description =
      "decode attention, its heads merged into one row, and the output projection that reads them (with its residual "
      "add): one GEMV whose first blocks attend while every block's weights are in flight";
  // The decode step's chain (src/model/step_graph.cpp): out [Hkv, G·S, D] -> [Hq, S, D] -> [S, Hq, D]
  // -> [S, Hq·D], the projection's x. Nothing between attention and the projection may be read
  // elsewhere: the kernel writes only x (materializes_escaping_values false).
  rule.pattern = {
      entry("attention", OpKind::contraction, {"flash_attention"}, {"$q", "$k", "$v", "$positions"}, {.certified = true}),
      entry("by_head", OpKind::layout, {"reshape"}, {"attention"}),
      entry("by_token", OpKind::layout, {"transpose"}, {"by_head"}),
      entry("input", OpKind::layout, {"reshape"}, {"by_token"}),
      entry("contraction", OpKind::contraction, {}, {"input", "$weight"}),
  };
  rule.epilogue_add_operand_role = "addend";
  rule.epilogue = {.kinds = {OpKind::elementwise}, .max_depth = 8};
  rule.materializes_escaping_values = false;
  return rule;
}

FusionRule row_reduction_rule() {
  FusionRule rule;
  rule.name = "row_reduction";
  rule.description = "elementwise ops into a row reduction and the reduction's elementwise epilogue";
  rule.pattern = {entry("reduction", OpKind::row_reduction, {}, {})};
  rule.prologue = {.kinds = {OpKind::elementwise}, .max_depth = 8};
  rule.epilogue = {.kinds = {OpKind::elementwise}, .max_depth = 8};
  // The generic row schedule streams its prologue; only the residual rule above
  // writes a prologue value out as well.
  rule.materializes_escaping_values = false;
  return rule;
}

FusionRule elementwise_chain_rule() {
  FusionRule rule;
  rule.name = "elementwise_chain";
  rule.description = "elementwise ops of any depth ending in one whose consumers are not elementwise";
  rule.pattern = {entry("sink", OpKind::elementwise, {}, {})};
  rule.anchor_must_be_sink = true;
  rule.prologue = {.kinds = {OpKind::elementwise}, .max_depth = -1};
  rule.materializes_escaping_values = true;
  return rule;
}

RuleSet default_rules() {
  RuleSet rules;
  rules.rules = {residual_add_rms_norm_rule(), parallel_epilogue_rule(), contraction_epilogue_rule(),
                 sibling_contractions_rule(), rope_kv_cache_rule(), qkv_rope_kv_cache_rule(),
                 attention_output_projection_rule(), row_reduction_rule(), elementwise_chain_rule()};
  return rules;
}

// The kinds named in fusion.h: the certified op's name is the one attention discovery writes.
std::vector<std::string> region_kinds(const RuleSet& rules) {
  std::set<std::string> kinds{"flash_attention", std::string(kContractionRegionKind),
                              std::string(kContractionArgmaxRegionKind)};
  for (const FusionRule& rule : rules.rules) kinds.insert(rule.name);
  return {kinds.begin(), kinds.end()};
}

void check_region_kinds(const std::set<std::string>& kinds, std::string_view option, const RuleSet& rules) {
  const std::vector<std::string> known = region_kinds(rules);
  for (const std::string& kind : kinds) {
    if (std::binary_search(known.begin(), known.end(), kind)) continue;
    std::string list;
    for (const std::string& name : known) list += (list.empty() ? "" : ", ") + name;
    throw InputError(fmt::format("{}: '{}' is not a region kind (one of: {})", option, control_bytes_spelled(kind), list));
  }
}

}  // namespace metile
