// The attention rewrite: the chain with and without scale and mask, grouped-query heads, batched
// heads, every refusal, the executor's refusal of uncertified nodes, the plan's certificate, and
// random graphs whose rewritten CPU outputs equal the unrewritten graph's within the numeric gate
// (seed printed; METILE_TEST_SEED overrides it).
#include <gtest/gtest.h>

#include <limits>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <random>

#include <fmt/format.h>

#include "metile/cpu_runtime.h"
#include "metile/discovery.h"
#include "metile/dispatch.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using metile::testing::error_of;

std::uint64_t test_seed() { return metile::testing::test_seed("attention rewrite"); }

struct AttentionShape {
  std::vector<std::int64_t> batch;  // leading dims before the head axis
  std::int64_t query_heads = 2, kv_heads = 2, tokens = 3, keys = 5, depth = 8, value_depth = 8;
  bool scale = true;
  std::string mask = "causal";  // none | causal | positions
  DType dtype = DType::f32;
};

std::vector<std::int64_t> dims(std::vector<std::int64_t> batch, std::initializer_list<std::int64_t> rest) {
  batch.insert(batch.end(), rest);
  return batch;
}

// Plain ops in the model's form (COMMON: q [.., Hq, S, D] reshaped to [.., Hkv, G·S, D]).
ComputeGraph attention_graph(const AttentionShape& shape) {
  GraphBuilder builder;
  const std::int64_t group = shape.query_heads / shape.kv_heads;
  auto q = builder.input("q", {dims(shape.batch, {shape.query_heads, shape.tokens, shape.depth}), shape.dtype});
  auto k = builder.input("k", {dims(shape.batch, {shape.kv_heads, shape.keys, shape.depth}), shape.dtype});
  auto v = builder.input("v", {dims(shape.batch, {shape.kv_heads, shape.keys, shape.value_depth}), shape.dtype});
  if (group > 1) q = builder.reshape(q, dims(shape.batch, {shape.kv_heads, group * shape.tokens, shape.depth}), "q_grouped");
  auto scores = builder.matmul(q, k, true, "scores");
  if (shape.scale) scores = builder.scale(scores, 1.0 / std::sqrt(static_cast<double>(shape.depth)), "scaled");
  if (shape.mask == "causal") scores = builder.causal_mask(scores, shape.keys - shape.tokens, "masked");
  if (shape.mask == "positions") {
    auto positions = builder.input("positions", {{shape.tokens}, DType::i32});
    scores = builder.position_mask(scores, positions, "masked");
  }
  auto probabilities = builder.softmax(scores, -1, "probabilities");
  auto out = builder.matmul(probabilities, v, false, "attention");
  return builder.build({out});
}

void expect_equal_within_gate(const ComputeGraph& original, const ComputeGraph& rewritten, std::uint64_t seed) {
  const TensorMap inputs = random_inputs(original, seed);
  const TensorMap expected = run_reference(original, inputs);
  const TensorMap actual = run_reference(rewritten, inputs);
  ASSERT_EQ(expected.size(), actual.size());
  for (const auto& [name, reference] : expected) {
    const NumericGateResult gate = numeric_gate(actual.at(name), reference);
    EXPECT_TRUE(gate.passed) << name << ": " << gate.detail << " (relative L2 " << gate.relative_l2 << ")";
  }
}

const Node& only_node(const ComputeGraph& graph, std::string_view op) {
  const Node* found = nullptr;
  for (const Node& node : graph.nodes()) {
    if (node.op == op) {
      EXPECT_EQ(found, nullptr) << "two " << op << " nodes";
      found = &node;
    }
  }
  if (found == nullptr) throw std::runtime_error("no " + std::string(op) + " node");
  return *found;
}

TEST(AttentionRewrite, ChainWithAndWithoutScaleAndMask) {
  const std::uint64_t seed = test_seed();
  for (bool scale : {false, true}) {
    for (const char* mask : {"none", "causal", "positions"}) {
      AttentionShape shape;
      shape.scale = scale;
      shape.mask = mask;
      const ComputeGraph graph = attention_graph(shape);
      const AttentionRewrite rewrite = rewrite_attention(graph);
      ASSERT_EQ(rewrite.candidates.size(), 1u) << mask;
      EXPECT_TRUE(rewrite.refusals.empty());
      const Node& flash = only_node(rewrite.graph, "flash_attention");
      EXPECT_EQ(flash.name, "attention");
      EXPECT_EQ(flash.attributes.get_string("mask"), mask);
      EXPECT_DOUBLE_EQ(flash.attributes.get_double("scale"), scale ? 1.0 / std::sqrt(8.0) : 1.0);
      if (std::string(mask) == "causal") {
        EXPECT_EQ(flash.attributes.get_int("offset"), 2);
      }
      EXPECT_EQ(flash.inputs.size(), std::string(mask) == "positions" ? 4u : 3u);
      EXPECT_EQ(rewrite.graph.nodes().size(), 1u);
      EXPECT_TRUE(Certificate::from_json(flash.attributes.get_string("certificate")).verified);
      // scores [2, 3, 5] f32 and each later intermediate, written once and read once.
      const std::int64_t intermediates = 2 + (scale ? 1 : 0) + (std::string(mask) == "none" ? 0 : 1);
      EXPECT_EQ(rewrite.candidates[0].avoided_bytes, intermediates * 2 * (2 * 3 * 5 * 4));
      expect_equal_within_gate(graph, rewrite.graph, seed);
    }
  }
}

TEST(AttentionRewrite, GroupedQueryAndBatchedHeads) {
  const std::uint64_t seed = test_seed();
  AttentionShape grouped;
  grouped.query_heads = 8;
  grouped.kv_heads = 2;
  grouped.mask = "positions";
  grouped.dtype = DType::bf16;
  AttentionShape batched;
  batched.batch = {2};
  batched.query_heads = 4;
  batched.kv_heads = 2;
  batched.dtype = DType::f16;
  batched.value_depth = 6;
  for (const AttentionShape& shape : {grouped, batched}) {
    const ComputeGraph graph = attention_graph(shape);
    const AttentionRewrite rewrite = rewrite_attention(graph);
    const Node& flash = only_node(rewrite.graph, "flash_attention");
    const TensorSpec& q = rewrite.graph.value(flash.inputs[0]).spec;
    EXPECT_EQ(q.shape, dims(shape.batch, {shape.kv_heads, shape.query_heads / shape.kv_heads * shape.tokens, shape.depth}));
    EXPECT_EQ(rewrite.graph.value(flash.outputs[0]).spec.shape.back(), shape.value_depth);
    EXPECT_NE(rewrite.graph.find_node("q_grouped"), std::nullopt) << "the reshape stays: flash reads the grouped rows";
    expect_equal_within_gate(graph, rewrite.graph, seed);
  }
}

// One refusal per case: the graph is changed from the plain chain by `edit`, and the reason is exact.
struct RefusalCase {
  std::string name;
  std::function<ComputeGraph()> graph;
  std::string reason;
};

TEST(AttentionRewrite, EveryRefusalHasItsReason) {
  auto chain = [](auto edit) {
    return [edit] {
      GraphBuilder b;
      auto q = b.input("q", {{2, 3, 8}, DType::f32});
      auto k = b.input("k", {{2, 5, 8}, DType::f32});
      auto v = b.input("v", {{2, 5, 8}, DType::f32});
      return edit(b, q, k, v);
    };
  };
  const std::vector<RefusalCase> cases = {
      {"softmax over the query axis",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef) {
         auto scores = b.matmul(q, k, true, "scores");
         auto p = b.softmax(scores, 1, "probabilities");
         auto v2 = b.input("v2", {{2, 5, 8}, DType::f32});
         return b.build({b.matmul(p, v2, false, "attention")});
       }),
       "softmax axis is not the key axis"},
      {"scores escape",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto scores = b.matmul(q, k, true, "scores");
         auto p = b.softmax(scores, -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention"), scores});
       }),
       "scores escape to a graph output"},
      {"probabilities read twice",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto p = b.softmax(b.matmul(q, k, true, "scores"), -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention"), b.exp(p, "side")});
       }),
       "probabilities are also read by 'side' (exp)"},
      {"scaled scores escape",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto scaled = b.scale(b.matmul(q, k, true, "scores"), 0.5, "scaled");
         auto p = b.softmax(scaled, -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention"), scaled});
       }),
       "scaled scores escape to a graph output"},
      {"k not transposed",
       chain([](GraphBuilder& b, ValueRef q, ValueRef, ValueRef v) {
         auto kt = b.input("k_t", {{2, 8, 5}, DType::f32});
         auto p = b.softmax(b.matmul(q, kt, false, "scores"), -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention")});
       }),
       "the scores come from a matmul without transpose_right (k must be [..., T, D])"},
      {"shared k",
       chain([](GraphBuilder& b, ValueRef q, ValueRef, ValueRef v) {
         auto shared = b.input("k_shared", {{5, 8}, DType::f32});
         auto p = b.softmax(b.matmul(q, shared, true, "scores"), -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention")});
       }),
       "k is shared by every batch (rank 2), not [..., Hkv, T, D]"},
      {"two masks",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto masked = b.causal_mask(b.causal_mask(b.matmul(q, k, true, "scores"), 2, "mask_a"), 1, "mask_b");
         auto p = b.softmax(masked, -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention")});
       }),
       "'mask_b' is a second mask on the scores"},
      {"negative scale after the mask",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto scaled = b.scale(b.causal_mask(b.matmul(q, k, true, "scores"), 2, "masked"), -0.5, "flipped");
         auto p = b.softmax(scaled, -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention")});
       }),
       "'flipped' scales by -0.5 after the mask (only a positive factor keeps masked scores at -inf)"},
      {"an additive bias",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto bias = b.input("bias", {{2, 3, 5}, DType::f32});
         auto p = b.softmax(b.add(b.matmul(q, k, true, "scores"), bias, "biased"), -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention")});
       }),
       "'biased' (add) between the scores and the softmax is not part of the pattern (scale, causal_mask, position_mask, "
       "a cast to f32 at the softmax)"},
      // The foreign op right before the softmax, after a scale and a mask: it was found, but its input was not
      // the scores matmul's own output, so no refusal was given.
      {"an op after the scale and the mask",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto masked = b.causal_mask(b.scale(b.matmul(q, k, true, "scores"), 0.5, "scaled"), 2, "masked");
         auto p = b.softmax(b.silu(masked, "squashed"), -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention")});
       }),
       "'squashed' (silu) between the scores and the softmax is not part of the pattern (scale, causal_mask, "
       "position_mask, a cast to f32 at the softmax)"},
      {"an additive bias after a cast",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto bias = b.input("bias", {{2, 3, 5}, DType::f32});
         auto widened = b.cast(b.matmul(q, k, true, "scores"), DType::f32, "widened");
         auto p = b.softmax(b.add(widened, bias, "biased"), -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention")});
       }),
       "'biased' (add) between the scores and the softmax is not part of the pattern (scale, causal_mask, position_mask, "
       "a cast to f32 at the softmax)"},
      {"a narrowing cast before the softmax",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef) {
         auto p = b.softmax(b.cast(b.matmul(q, k, true, "scores"), DType::f16, "narrowed"), -1, "probabilities");
         auto v16 = b.input("v16", {{2, 5, 8}, DType::f16});
         return b.build({b.matmul(p, v16, false, "attention")});
       }),
       "'narrowed' casts the scores from f32 to f16 before the softmax (only a widening cast to f32 keeps them)"},
      {"a cast between the mask and the scale",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto masked = b.causal_mask(b.matmul(q, k, true, "scores"), 2, "masked");
         auto p = b.softmax(b.scale(b.cast(masked, DType::f32, "recast"), 0.5, "scaled"), -1, "probabilities");
         return b.build({b.matmul(p, v, false, "attention")});
       }),
       "'recast' (cast) between the scores and the softmax is not part of the pattern (scale, causal_mask, "
       "position_mask, a cast to f32 at the softmax)"},
      {"probabilities cast to another dtype than q's",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef) {
         auto p = b.softmax(b.matmul(q, k, true, "scores"), -1, "probabilities");
         auto v16 = b.input("v16", {{2, 5, 8}, DType::f16});
         return b.build({b.matmul(b.cast(p, DType::f16, "rounded"), v16, false, "attention")});
       }),
       "v is f16 and q f32 (flash_attention reads q, k and v in one dtype)"},
      {"cast probabilities read twice",
       chain([](GraphBuilder& b, ValueRef q, ValueRef k, ValueRef v) {
         auto p = b.cast(b.softmax(b.matmul(q, k, true, "scores"), -1, "probabilities"), DType::f32, "rounded");
         return b.build({b.matmul(p, v, false, "attention"), b.exp(p, "side")});
       }),
       "probabilities cast to f32 are also read by 'side' (exp)"},
  };
  for (const RefusalCase& refusal : cases) {
    const ComputeGraph graph = refusal.graph();
    const AttentionRewrite rewrite = rewrite_attention(graph);
    EXPECT_TRUE(rewrite.candidates.empty()) << refusal.name;
    ASSERT_EQ(rewrite.refusals.size(), 1u) << refusal.name;
    EXPECT_EQ(rewrite.refusals[0].reason, refusal.reason) << refusal.name;
    EXPECT_EQ(graph.node(rewrite.refusals[0].node).op, "softmax");
    EXPECT_EQ(rewrite.graph, graph) << refusal.name << ": nothing rewritten";
    const FusionPlan plan = plan_with_discovery(graph);
    const auto softmax = plan.graph->find_node("probabilities");
    EXPECT_NE(plan.node_reasons[static_cast<std::size_t>(*softmax)].find("flash_attention refused: " + refusal.reason),
              std::string::npos)
        << plan.explain();
  }
}

// matmul(p, p) with p = softmax(q kᵀ): the output matmul's v is the probabilities, a value the
// rewrite would remove. Refused with the reason (it used to fail planning with "input 2 (v) is not a
// value of this GraphBuilder"); the plan runs and equals a float64 oracle of the chain.
TEST(AttentionRewrite, ProbabilitiesThatAreAlsoVAreRefused) {
  const std::uint64_t seed = test_seed();
  GraphBuilder b;
  auto q = b.input("q", {{2, 4, 8}, DType::f32});
  auto k = b.input("k", {{2, 4, 8}, DType::f32});
  auto p = b.softmax(b.matmul(q, k, true, "scores"), -1, "probabilities");
  const ComputeGraph graph = b.build({b.matmul(p, p, false, "attention")});
  const AttentionRewrite rewrite = rewrite_attention(graph);
  EXPECT_TRUE(rewrite.candidates.empty());
  ASSERT_EQ(rewrite.refusals.size(), 1u);
  EXPECT_EQ(rewrite.refusals[0].reason, "the probabilities are also v (both operands of the output matmul)");
  EXPECT_EQ(rewrite.graph, graph);
  const FusionPlan plan = plan_with_discovery(graph);
  const TensorMap inputs = random_inputs(graph, seed);
  const TensorMap outputs = run_plan_reference(plan, inputs);
  // float64 oracle: P = softmax(Q Kᵀ) per head, out = P P.
  const std::vector<double> qv = inputs.at("q").to_values(), kv = inputs.at("k").to_values();
  const std::vector<double> actual = outputs.at("attention").to_values();
  for (std::int64_t head = 0; head < 2; ++head) {
    double probabilities[4][4];
    for (std::int64_t row = 0; row < 4; ++row) {
      double scores[4], maximum = -INFINITY, total = 0;
      for (std::int64_t key = 0; key < 4; ++key) {
        scores[key] = 0;
        for (std::int64_t d = 0; d < 8; ++d) scores[key] += qv[(head * 4 + row) * 8 + d] * kv[(head * 4 + key) * 8 + d];
        maximum = std::max(maximum, scores[key]);
      }
      for (std::int64_t key = 0; key < 4; ++key) total += probabilities[row][key] = std::exp(scores[key] - maximum);
      for (std::int64_t key = 0; key < 4; ++key) probabilities[row][key] /= total;
    }
    for (std::int64_t row = 0; row < 4; ++row) {
      for (std::int64_t column = 0; column < 4; ++column) {
        double expected = 0;
        for (std::int64_t key = 0; key < 4; ++key) expected += probabilities[row][key] * probabilities[key][column];
        EXPECT_NEAR(actual[static_cast<std::size_t>((head * 4 + row) * 4 + column)], expected, 1e-6)
            << "seed " << seed << ", head " << head << ", row " << row << ", column " << column;
      }
    }
  }
}

TEST(AttentionRewrite, SoftmaxOutsideAttentionIsNeitherMatchedNorRefused) {
  GraphBuilder b;
  auto x = b.input("x", {{4, 16}, DType::f32});
  const ComputeGraph graph = b.build({b.softmax(b.scale(x, 2.0), -1, "p")});
  const AttentionRewrite rewrite = rewrite_attention(graph);
  EXPECT_TRUE(rewrite.candidates.empty());
  EXPECT_TRUE(rewrite.refusals.empty());
}

TEST(AttentionRewrite, AnUnverifiedLawRewritesNothing) {
  ReductionLaw wrong = stable_weighted_softmax_law();
  wrong.merge[1] = Term::add(Term::variable("a.l"), Term::variable("b.l"));
  wrong.merge[2] = Term::add(Term::variable("a.o"), Term::variable("b.o"));
  const ComputeGraph graph = attention_graph({});
  const AttentionRewrite rewrite = rewrite_attention(graph, wrong);
  EXPECT_EQ(rewrite.graph, graph);
  ASSERT_EQ(rewrite.refusals.size(), 1u);
  EXPECT_EQ(rewrite.refusals[0].reason,
            "the certificate of law 'stable_weighted_softmax' is not verified (fails: merge_of_lifts)");
}

// A law named stable_weighted_softmax that is another law, verified on its own terms (a plain mean:
// merge and pair both without rescaling). flash_attention evaluates the built-in law, and every
// executor refuses a node whose certificate is not a fresh proof of it; the rewrite used to fire
// anyway ("law stable_weighted_softmax verified") and leave a graph no executor runs. Refused now,
// by the executors' own comparison. Found by an adversarial pass.
TEST(AttentionRewrite, ALawThatOnlySharesTheNameRewritesNothing) {
  ReductionLaw mean = stable_weighted_softmax_law();
  mean.merge[1] = Term::add(Term::variable("a.l"), Term::variable("b.l"));
  mean.merge[2] = Term::add(Term::variable("a.o"), Term::variable("b.o"));
  mean.pair[1] = Term::constant(2);
  mean.pair[2] = Term::add(Term::variable("e1.v"), Term::variable("e2.v"));
  ASSERT_TRUE(prove(mean).verified) << "the impostor is a law of its own";
  const ComputeGraph graph = attention_graph({});
  const AttentionRewrite rewrite = rewrite_attention(graph, mean);
  EXPECT_TRUE(rewrite.candidates.empty());
  EXPECT_EQ(rewrite.graph, graph);
  ASSERT_EQ(rewrite.refusals.size(), 1u);
  EXPECT_EQ(rewrite.refusals[0].reason,
            "law 'stable_weighted_softmax' is not the law flash_attention evaluates (its certificate differs from a "
            "fresh proof of the built-in 'stable_weighted_softmax')");
  EXPECT_NO_THROW(run_reference(rewrite.graph, random_inputs(graph, test_seed())));
}

// A graph holding one flash_attention node with the given certificate attribute (or none).
ComputeGraph flash_graph(const std::optional<std::string>& certificate) {
  GraphBuilder b;
  auto q = b.input("q", {{2, 3, 8}, DType::f32});
  auto k = b.input("k", {{2, 5, 8}, DType::f32});
  auto v = b.input("v", {{2, 5, 8}, DType::f32});
  Attributes attributes;
  if (certificate) attributes.set("certificate", *certificate);
  return b.build(b.add_node("flash_attention", {q, k, v}, attributes, "attention"));
}

// The executor refuses a flash_attention node whose certificate is missing, unverified, for another law
// or not the law's proof; planning with discovery (`metile plan`) refuses it with the same line, where it
// printed the certificate's own claim ("verified (4/4 obligations hold)") for a node the run refused.
TEST(AttentionRewrite, TheExecutorRefusesUnverifiedCertificates) {
  ReductionLaw wrong = stable_weighted_softmax_law();
  wrong.merge[1] = Term::add(Term::variable("a.l"), Term::variable("b.l"));
  Certificate forged = prove(stable_weighted_softmax_law());
  forged.obligations[3].rhs = "(m: 0, l: 0, o: 0)";  // claims verified, but is not the law's proof
  Certificate other_law = prove(sum_law());
  const std::uint64_t seed = test_seed();
  auto run = [&](const std::optional<std::string>& certificate) {
    const std::string ran = error_of([&] {
      const ComputeGraph graph = flash_graph(certificate);
      run_reference(graph, random_inputs(graph, seed));
    });
    EXPECT_EQ(error_of([&] { plan_with_discovery(flash_graph(certificate)); }), ran);
    return ran;
  };
  EXPECT_EQ(run(prove(wrong).to_json()),
            "node 'attention' (flash_attention): refused: the certificate of law 'stable_weighted_softmax' is not "
            "verified (fails: merge_of_lifts)");
  EXPECT_EQ(run(std::nullopt),
            "node 'attention' (flash_attention): refused: it carries no certificate (law 'stable_weighted_softmax' "
            "must be proved first)");
  EXPECT_EQ(run(forged.to_json()),
            "node 'attention' (flash_attention): refused: its certificate does not match a fresh proof of law "
            "'stable_weighted_softmax'");
  EXPECT_EQ(run(other_law.to_json()),
            "node 'attention' (flash_attention): refused: its certificate is for law 'sum', the op needs "
            "'stable_weighted_softmax'");
  EXPECT_EQ(run(prove(stable_weighted_softmax_law()).to_json()), "(no InputError)");
}

// plan_graph_fusion describes a node's certificate, whatever it holds ("verified" only where the claim
// agrees with its obligations), and run refuses it: a field of the wrong type
// ended plan's text in nlohmann's type_error (an internal error, exit 1) where its JSON and DOT printed.
TEST(AttentionRewrite, APlanDescribesAnyCertificateAndTheRunRefusesIt) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"law": 1})", "certificate: law ?, NOT verified (0/0 obligations hold)"},
      {R"({"law": [], "verified": true})", "certificate: law ?, NOT verified (0/0 obligations hold)"},
      {R"({"law": "sum", "obligations": [{"holds": true}, {"holds": false}], "verified": true})",
       "certificate: law sum, NOT verified (1/2 obligations hold)"},
      {R"({"law": "sum", "obligations": [{"holds": true}], "verified": true})",
       "certificate: law sum, verified (1/1 obligations hold)"},
      {R"({"law": "stable_weighted_softmax", "verified": "yes"})",
       "certificate: law stable_weighted_softmax, NOT verified (0/0 obligations hold)"},
      {R"({"law": "a\nb", "obligations": [1, {"holds": "y"}, {"holds": true}], "verified": 1})",
       "certificate: law a\\x0ab, NOT verified (1/3 obligations hold)"},
      {R"({"obligations": {"holds": true}})", "certificate: law ?, NOT verified (0/0 obligations hold)"},
      {"[1]", "certificate: unreadable"},
      {"{", "certificate: unreadable"},
  };
  const std::uint64_t seed = test_seed();
  for (const auto& [certificate, line] : cases) {
    const ComputeGraph graph = flash_graph(certificate);
    const FusionPlan plan = plan_graph_fusion(graph);
    std::string text;
    ASSERT_NO_THROW(text = plan.explain()) << certificate;
    EXPECT_NE(text.find(line), std::string::npos) << certificate << "\n" << text;
    EXPECT_NO_THROW(plan.to_json()) << certificate;
    EXPECT_NO_THROW(plan.to_dot()) << certificate;
    EXPECT_NE(error_of([&] { run_reference(graph, random_inputs(graph, seed)); }).find("refused:"), std::string::npos)
        << certificate;
  }
}

// A chain the target's cost model gives no saving (no launch cost, a memory system this fast) stays plain
// ops, refused with the estimate; on the H200 the same chain is rewritten with a positive benefit.
TEST(AttentionRewrite, AChainWithoutASavingOnTheTargetStaysPlainOps) {
  AttentionShape shape;
  shape.mask = "positions";
  const ComputeGraph graph = attention_graph(shape);
  FusionTarget free_launches = FusionTarget::cpu();
  free_launches.name = "free_launches";
  free_launches.launch_overhead_ns = 1e-6;
  free_launches.memory_bandwidth_bytes_per_ns = 1e12;
  const AttentionMatch match = rewrite_attention(graph).candidates.at(0);
  const double benefit_ns = estimate_region(graph, match.nodes, free_launches).benefit_ns;
  ASSERT_LE(benefit_ns, 0) << "the target is meant to make fusing this chain a loss";
  const FusionPlan plan = plan_with_discovery(graph, free_launches);
  EXPECT_FALSE(plan.graph->find_node("attention").has_value() &&
               plan.graph->node(*plan.graph->find_node("attention")).op == "flash_attention")
      << plan.explain();
  EXPECT_EQ(*plan.graph, graph) << "nothing rewritten";
  const auto softmax = plan.graph->find_node("probabilities");
  ASSERT_TRUE(softmax.has_value());
  EXPECT_NE(plan.node_reasons[static_cast<std::size_t>(*softmax)].find(
                fmt::format("flash_attention refused: the target 'free_launches' estimates no saving for it ({:.1f} ns)",
                            benefit_ns)),
            std::string::npos)
      << plan.explain();
  const FusionPlan on_h200 = plan_with_discovery(graph, FusionTarget::h200());
  ASSERT_EQ(on_h200.regions.size(), 1u);
  EXPECT_EQ(on_h200.regions[0].rule, "flash_attention");
  EXPECT_GT(on_h200.regions[0].benefit_ns, 0);
  // The rewritten kernel is held to the target's limits as any region: with two inputs a kernel the
  // chain (q, k, v and the positions) stays plain ops, refused with the limit; every plan's regions
  // keep it.
  FusionTarget two_inputs = FusionTarget::h200();
  two_inputs.name = "two_inputs";
  two_inputs.max_kernel_inputs = 2;
  const FusionPlan narrow = plan_with_discovery(graph, two_inputs);
  EXPECT_EQ(*narrow.graph, graph) << narrow.explain();
  for (const FusionRegion& region : narrow.regions) EXPECT_LE(region.inputs.size(), 2u) << narrow.explain();
  EXPECT_NE(narrow.node_reasons[static_cast<std::size_t>(*narrow.graph->find_node("probabilities"))].find(
                "flash_attention refused: on the target 'two_inputs' the kernel reads 4 inputs, target allows 2 per kernel"),
            std::string::npos)
      << narrow.explain();
}

TEST(AttentionRewrite, PlanCarriesTheCertificate) {
  AttentionShape shape;
  shape.mask = "positions";
  const FusionPlan plan = plan_with_discovery(attention_graph(shape));
  ASSERT_EQ(plan.regions.size(), 1u);
  const FusionRegion& region = plan.regions[0];
  EXPECT_EQ(region.rule, "flash_attention");
  EXPECT_GT(region.benefit_ns, 0);
  EXPECT_EQ(Certificate::from_json(region.certificate), prove(stable_weighted_softmax_law()));
  const std::string json = plan.to_json();
  EXPECT_NE(json.find("\"certificate\":{\"law\":\"stable_weighted_softmax\",\"theory\":"), std::string::npos) << json;
  EXPECT_NE(json.find("\"verified\":true}"), std::string::npos) << json;
  EXPECT_NE(json.find("\"rewrites\": [\"flash_attention 'attention' replaces"), std::string::npos) << json;
  const std::string text = plan.explain();
  EXPECT_NE(text.find("certificate: law stable_weighted_softmax, verified (4/4 obligations hold)"), std::string::npos) << text;
  // The plan runs on the CPU and gives the rewritten graph's outputs bit for bit.
  const TensorMap inputs = random_inputs(*plan.graph, test_seed());
  EXPECT_EQ(run_plan_reference(plan, inputs), run_reference(*plan.graph, inputs));
}

// A node no output depends on is removed before the rewrite: a dead reader of the scores no longer
// makes them escape, and no kernel is planned for it. plan_graph_fusion alone plans what it is given.
TEST(AttentionRewrite, DeadNodesAreRemovedBeforeTheRewrite) {
  GraphBuilder builder;
  const ValueRef q = builder.input("q", {{2, 3, 8}, DType::f32});
  const ValueRef k = builder.input("k", {{2, 5, 8}, DType::f32});
  const ValueRef v = builder.input("v", {{2, 5, 8}, DType::f32});
  const ValueRef scores = builder.matmul(q, k, true, "scores");
  builder.exp(builder.sum(scores, "dead_sum"), "dead_exp");  // reads the scores; nothing reads it
  const ValueRef out = builder.matmul(builder.softmax(scores, -1, "probabilities"), v, false, "attention");
  const ComputeGraph graph = builder.build({out});

  const FusionPlan plan = plan_with_discovery(graph);
  ASSERT_GE(plan.rewrites.size(), 3u);
  EXPECT_EQ(plan.rewrites[0], "removed 'dead_sum' (sum): no graph output depends on it");
  EXPECT_EQ(plan.rewrites[1], "removed 'dead_exp' (exp): no graph output depends on it");
  EXPECT_EQ(plan.rewrites[2].rfind("flash_attention 'attention' replaces scores, probabilities, attention", 0), 0u)
      << plan.rewrites[2];
  EXPECT_FALSE(plan.graph->find_node("dead_sum").has_value());
  EXPECT_EQ(plan.kernel_count(), 1);
  EXPECT_NE(plan.explain().find("rewrites before planning:\n  removed 'dead_sum' (sum)"), std::string::npos)
      << plan.explain();
  expect_equal_within_gate(graph, *plan.graph, test_seed());

  // Without the removal the dead reader keeps the chain from being rewritten, as it did before.
  const FusionPlan recorded = plan_graph_fusion(rewrite_attention(graph).graph);
  EXPECT_TRUE(recorded.graph->find_node("dead_sum").has_value());
  EXPECT_GT(recorded.kernel_count(), plan.kernel_count());
}

// The mixed-precision softmax models write (transformers: softmax(scores, dtype=float32).to(q.dtype)):
// the f16/bf16 scores widened to f32 at the softmax, the probabilities cast back before P V. Both casts
// are inside the chain: one flash_attention node, equal to the chain within the gate, the casts' bytes
// counted as avoided. Without the casts it was silently not attention (no candidate, no reason).
TEST(AttentionRewrite, TheMixedPrecisionSoftmaxIsAttention) {
  const std::uint64_t seed = test_seed();
  for (const DType dtype : {DType::f16, DType::bf16}) {
    for (const bool cast_back : {true, false}) {
      GraphBuilder b;
      auto q = b.input("q", {{2, 4, 3, 16}, dtype});
      auto k = b.input("k", {{2, 2, 70, 16}, dtype});
      auto v = b.input("v", {{2, 2, 70, 8}, cast_back ? dtype : DType::f32});
      auto grouped = b.reshape(q, {2, 2, 6, 16}, "q_grouped");
      auto masked = b.causal_mask(b.scale(b.matmul(grouped, k, true, "scores"), 0.25, "scaled"), 67, "masked");
      auto p = b.softmax(b.cast(masked, DType::f32, "widened"), -1, "probabilities");
      if (cast_back) p = b.cast(p, dtype, "rounded");
      const ComputeGraph graph = b.build({b.matmul(p, v, false, "attention")});
      const AttentionRewrite rewrite = rewrite_attention(graph);
      SCOPED_TRACE(fmt::format("{}, cast back {}, seed {}", dtype_name(dtype), cast_back, seed));
      if (!cast_back) {  // f32 probabilities against f32 values: q is f16, so not one dtype
        EXPECT_TRUE(rewrite.candidates.empty());
        ASSERT_EQ(rewrite.refusals.size(), 1u);
        EXPECT_EQ(rewrite.refusals[0].reason,
                  fmt::format("v is f32 and q {} (flash_attention reads q, k and v in one dtype)", dtype_name(dtype)));
        continue;
      }
      ASSERT_EQ(rewrite.candidates.size(), 1u);
      EXPECT_TRUE(rewrite.refusals.empty());
      EXPECT_EQ(rewrite.candidates[0].nodes.size(), 7u) << "scores, scaled, masked, widened, softmax, rounded, attention";
      const std::int64_t scores = 2 * 2 * 6 * 70;
      const std::int64_t narrow = scores * 2, wide = scores * 4;  // bytes of an f16/bf16 and an f32 score tensor
      EXPECT_EQ(rewrite.candidates[0].avoided_bytes, 2 * (3 * narrow + 2 * wide + narrow));
      const Node& flash = only_node(rewrite.graph, "flash_attention");
      EXPECT_EQ(rewrite.graph.value(flash.outputs[0]).spec.dtype, dtype);
      EXPECT_EQ(flash.attributes.get_int("offset"), 67);
      EXPECT_DOUBLE_EQ(flash.attributes.get_double("scale"), 0.25);
      EXPECT_EQ(only_node(rewrite.graph, "reshape").name, "q_grouped");
      expect_equal_within_gate(graph, rewrite.graph, seed);
      const FusionPlan plan = plan_with_discovery(graph);
      EXPECT_EQ(plan.graph->find_node("widened"), std::nullopt) << plan.explain();
    }
  }
}

TEST(AttentionRewrite, RandomGraphsWithTheChainMatchTheOriginal) {
  const std::uint64_t seed = test_seed();
  std::mt19937_64 generator(seed);
  auto pick = [&](std::int64_t low, std::int64_t high) {
    return std::uniform_int_distribution<std::int64_t>(low, high)(generator);
  };
  for (int trial = 0; trial < 12; ++trial) {
    AttentionShape shape;
    if (pick(0, 1)) shape.batch = {pick(1, 2)};
    shape.kv_heads = pick(1, 2);
    shape.query_heads = shape.kv_heads * pick(1, 3);
    shape.tokens = pick(1, 4);
    shape.keys = shape.tokens + pick(0, 70);  // crosses the reference's 64-key blocks
    shape.depth = pick(1, 3) * 8;
    shape.value_depth = pick(1, 3) * 4;
    shape.scale = pick(0, 1) != 0;
    shape.mask = std::vector<std::string>{"none", "causal", "positions"}[static_cast<std::size_t>(pick(0, 2))];
    shape.dtype = std::vector<DType>{DType::f32, DType::f16, DType::bf16}[static_cast<std::size_t>(pick(0, 2))];
    // Around the chain: q computed from an input, the output consumed by an add, both kept as outputs.
    GraphBuilder b;
    const std::int64_t group = shape.query_heads / shape.kv_heads;
    auto q_in = b.input("q_in", {dims(shape.batch, {shape.query_heads, shape.tokens, shape.depth}), shape.dtype});
    auto k = b.input("k", {dims(shape.batch, {shape.kv_heads, shape.keys, shape.depth}), shape.dtype});
    auto v = b.input("v", {dims(shape.batch, {shape.kv_heads, shape.keys, shape.value_depth}), shape.dtype});
    auto q = b.silu(q_in, "q_activated");
    if (group > 1) q = b.reshape(q, dims(shape.batch, {shape.kv_heads, group * shape.tokens, shape.depth}), "q_grouped");
    auto scores = b.matmul(q, k, true, "scores");
    if (shape.scale) scores = b.scale(scores, 0.3, "scaled");
    if (shape.mask == "causal") scores = b.causal_mask(scores, shape.keys - shape.tokens, "masked");
    if (shape.mask == "positions") scores = b.position_mask(scores, b.input("positions", {{shape.tokens}, DType::i32}), "masked");
    auto out = b.matmul(b.softmax(scores, -1, "probabilities"), v, false, "attention");
    auto residual = b.input("residual", {b.spec(out).shape, shape.dtype});
    const ComputeGraph graph = b.build({b.add(out, residual, "summed"), q});
    const AttentionRewrite rewrite = rewrite_attention(graph);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + std::to_string(shape.query_heads) + " heads / " +
                 std::to_string(shape.kv_heads) + " kv, S " + std::to_string(shape.tokens) + ", T " +
                 std::to_string(shape.keys) + ", D " + std::to_string(shape.depth) + ", Dv " +
                 std::to_string(shape.value_depth) + ", mask " + shape.mask + ", " + std::string(dtype_name(shape.dtype)));
    ASSERT_EQ(rewrite.candidates.size(), 1u);
    EXPECT_EQ(only_node(rewrite.graph, "flash_attention").name, "attention");
    expect_equal_within_gate(graph, rewrite.graph, seed + static_cast<std::uint64_t>(trial));
  }
}

}  // namespace
}  // namespace metile

namespace metile {
namespace {

// flash_attention_as_plain_ops (what the device's native path runs) computes what the node's
// law-based reference computes, for every mask, with batched heads; and it
// refuses a node whose certificate is not verified.
// The causal offset at the ends of int64: the rewritten node's reference compares like causal_mask
// (key - row > offset) without computing row + offset, which overflowed at 2^63 - 1 and hid every key
// of rows past the first (NaN rows) where the chain sees them all. At -2^63 every key is hidden: NaN
// rows in both.
// The f32 chain over q [B, R, D], k [B, T, D], v [B, T, Dv]: matmul(q, k, transpose_right), then
// `edit_scores` (a scale, a mask), softmax, matmul with v; and its rewrite.
struct ChainAndRewrite {
  ComputeGraph graph;
  AttentionRewrite rewrite;
};
ChainAndRewrite f32_chain(const std::vector<std::int64_t>& q_shape, const std::vector<std::int64_t>& k_shape,
                          const std::vector<std::int64_t>& v_shape,
                          const std::function<ValueRef(GraphBuilder&, ValueRef)>& edit_scores) {
  GraphBuilder builder;
  auto q = builder.input("q", {q_shape, DType::f32});
  auto k = builder.input("k", {k_shape, DType::f32});
  auto v = builder.input("v", {v_shape, DType::f32});
  auto scores = edit_scores(builder, builder.matmul(q, k, true, "scores"));
  auto out = builder.matmul(builder.softmax(scores, -1, "probabilities"), v, false, "attention");
  ComputeGraph graph = builder.build({out});
  AttentionRewrite rewrite = rewrite_attention(graph);
  return {std::move(graph), std::move(rewrite)};
}

TEST(AttentionRewrite, CausalOffsetsAtTheEndsOfInt64MatchTheChain) {
  const std::uint64_t seed = test_seed();
  for (const std::int64_t offset : {std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::min(),
                                    std::int64_t{-3}, std::int64_t{1} << 40}) {
    const auto [graph, rewrite] = f32_chain({2, 4, 8}, {2, 6, 8}, {2, 6, 8}, [&](GraphBuilder& builder, ValueRef scores) {
      return builder.causal_mask(scores, offset, "masked");
    });
    ASSERT_EQ(rewrite.candidates.size(), 1u) << offset;
    EXPECT_EQ(only_node(rewrite.graph, "flash_attention").attributes.get_int("offset"), offset);
    SCOPED_TRACE(offset);
    expect_equal_within_gate(graph, rewrite.graph, seed);
  }
}

// A scale f32 cannot hold: the scale op multiplies by its f32 value, so the rewrite does too. With
// q.k = [0, -85], v = [0, 1] and a factor 1 + 0.99 * 2^-24 (1 in f32) the chain gives
// e^-85 / (1 + e^-85) rounded to f32; the rewrite scaled by the double and was 54 f32 ulps away
// (found by an adversarial pass). 1/sqrt(96), a real head dim's scale: within an f32 ulp of exact
// arithmetic with its f32 value.
TEST(AttentionRewrite, AScaleF32CannotHoldScalesByItsF32Value) {
  for (const double factor : {1.0 + 0.99 * std::ldexp(1.0, -24), 1.0 / std::sqrt(96.0)}) {
    const auto [graph, rewrite] = f32_chain({1, 1, 1}, {1, 2, 1}, {1, 2, 1}, [&](GraphBuilder& builder, ValueRef scores) {
      return builder.scale(scores, factor, "scaled");
    });
    ASSERT_EQ(rewrite.candidates.size(), 1u);
    const TensorMap inputs = {{"q", HostTensor::from_values({{1, 1, 1}, DType::f32}, std::vector<double>{1.0})},
                              {"k", HostTensor::from_values({{1, 2, 1}, DType::f32}, std::vector<double>{0.0, -85.0})},
                              {"v", HostTensor::from_values({{1, 2, 1}, DType::f32}, std::vector<double>{0.0, 1.0})}};
    const double chain = run_reference(graph, inputs).at("attention").to_values()[0];
    const double rewritten = run_reference(rewrite.graph, inputs).at("attention").to_values()[0];
    // Exact arithmetic with the f32 factor, rounded once. The chain also rounds the scaled score to
    // f32 (-85 x 1/sqrt(96) is not an f32), which the rewrite does not: equal only where that is exact.
    const double weight = std::exp(-85.0 * static_cast<double>(static_cast<float>(factor)));
    const auto expected = static_cast<float>(weight / (1 + weight));
    const double ulp = std::nextafter(expected, 1.0f) - expected;
    EXPECT_LE(std::abs(rewritten - expected), ulp) << "factor " << factor << ": " << rewritten << " vs " << expected;
    if (static_cast<float>(factor) == 1.0f) {
      EXPECT_EQ(chain, static_cast<double>(expected));
      EXPECT_EQ(rewritten, chain);
    }
  }
}

// Scores that are not finite: the rewritten node gives what the chain gives, by a float64 softmax
// written here (IEEE: a row holding +inf, or all -inf, is NaN; a -inf score among finite ones
// weighs 0). 130 keys: two +inf scores fall in different 64-key blocks of the law's evaluation.
// Found by an adversarial pass: the law evaluator's a - a = 0 shortcut gave one-hot rows for +inf
// and the mean of v for an all -inf row.
TEST(AttentionRewrite, NonFiniteScoresGiveWhatTheChainGives) {
  const std::uint64_t seed = test_seed();
  std::mt19937_64 random(seed);
  std::uniform_real_distribution<float> uniform(0.25f, 1.0f);
  constexpr std::int64_t kRows = 3, kKeys = 130, kDepth = 2, kWidth = 3;
  const double infinity = std::numeric_limits<double>::infinity();
  GraphBuilder builder;
  auto q = builder.input("q", {{1, kRows, kDepth}, DType::f32});
  auto k = builder.input("k", {{1, kKeys, kDepth}, DType::f32});
  auto v = builder.input("v", {{1, kKeys, kWidth}, DType::f32});
  auto out = builder.matmul(builder.softmax(builder.matmul(q, k, true, "scores"), -1, "probabilities"), v, false, "attention");
  const ComputeGraph graph = builder.build({out});
  const AttentionRewrite rewrite = rewrite_attention(graph);
  ASSERT_EQ(rewrite.candidates.size(), 1u);
  struct Case {
    const char* name;
    std::vector<std::pair<std::int64_t, double>> planted;  // key, its first component (q's is positive)
    bool all_negative_infinity = false;
  };
  const std::vector<Case> cases = {{"one +inf score", {{7, infinity}}},
                                   {"two +inf scores in two blocks", {{3, infinity}, {100, infinity}}},
                                   {"every score -inf", {}, true},
                                   {"one -inf score among finite ones", {{70, -infinity}}},
                                   {"-inf and +inf", {{5, -infinity}, {90, infinity}}}};
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    std::vector<double> qv(kRows * kDepth), kv(kKeys * kDepth), vv(kKeys * kWidth);
    for (double& x : qv) x = uniform(random);
    for (double& x : kv) x = uniform(random);
    for (double& x : vv) x = uniform(random);
    for (const auto& [key, first] : test.planted) kv[static_cast<std::size_t>(key * kDepth)] = first;
    if (test.all_negative_infinity) {
      for (std::int64_t key = 0; key < kKeys; ++key) kv[static_cast<std::size_t>(key * kDepth)] = -infinity;
    }
    const TensorMap inputs = {{"q", HostTensor::from_values({{1, kRows, kDepth}, DType::f32}, qv)},
                              {"k", HostTensor::from_values({{1, kKeys, kDepth}, DType::f32}, kv)},
                              {"v", HostTensor::from_values({{1, kKeys, kWidth}, DType::f32}, vv)}};
    for (const auto& [label, candidate] : {std::pair<const char*, const ComputeGraph*>{"the chain", &graph},
                                           {"the rewritten node", &rewrite.graph}}) {
      const HostTensor result = run_reference(*candidate, inputs).at("attention");
      for (std::int64_t row = 0; row < kRows; ++row) {
        std::vector<double> scores(kKeys);
        double top = -infinity;
        for (std::int64_t key = 0; key < kKeys; ++key) {
          scores[key] = 0;
          for (std::int64_t d = 0; d < kDepth; ++d) scores[key] += qv[row * kDepth + d] * kv[key * kDepth + d];
          top = std::max(top, scores[key]);
        }
        double normalizer = 0;
        std::vector<double> weighted(kWidth, 0.0);
        for (std::int64_t key = 0; key < kKeys; ++key) {
          const double weight = std::exp(scores[key] - top);  // IEEE: inf - inf and -inf - -inf are NaN
          normalizer += weight;
          for (std::int64_t c = 0; c < kWidth; ++c) weighted[c] += weight * vv[key * kWidth + c];
        }
        for (std::int64_t c = 0; c < kWidth; ++c) {
          const double expected = weighted[c] / normalizer;
          const double actual = result.at(row * kWidth + c);
          if (std::isnan(expected)) {
            EXPECT_TRUE(std::isnan(actual)) << label << ": row " << row << " column " << c << " gave " << actual;
          } else {
            EXPECT_NEAR(actual, expected, 1e-5 * std::abs(expected) + 1e-6) << label << ": row " << row << " column " << c;
          }
        }
      }
    }
  }
}

// A finite q.k (or a scaled one) the chain cannot store: the chain rounds q.k to the dtype (f16: from
// 65520 on, inf), multiplies the stored value by the scale in f32 and rounds again, so a row with one
// such +inf score is NaN there and must be NaN in the rewritten node too; -inf weighs nothing in both;
// and a q.k that rounds down to a finite value stays finite in both, however near the edge.
TEST(AttentionRewrite, ScoresBeyondTheDtypesRangeGiveWhatTheChainGives) {
  std::mt19937_64 random(test_seed());
  std::uniform_real_distribution<double> uniform(0.25, 1.0);
  constexpr std::int64_t kRows = 3, kKeys = 70, kDepth = 4, kWidth = 3, kPlantedRow = 1, kPlantedKey = 66;
  struct Case {
    const char* name;
    DType dtype;
    double q, k, k_second, scale;  // planted row [q, 1, 0, 0], planted key [k, k_second, 0, 0]: q.k = q k + k_second
    bool planted_row_is_nan;
  };
  const std::vector<Case> cases = {
      {"f16 q.k 76500 stores inf", DType::f16, 255, 300, 0, 0.125, true},
      {"f16 q.k 51000 finite, scaled by 2 stores inf", DType::f16, 255, 200, 0, 2.0, true},
      {"f16 q.k -76500 stores -inf", DType::f16, 255, -300, 0, 0.125, false},
      {"f16 q.k 76500 scaled by -0.125: -inf", DType::f16, 255, 300, 0, -0.125, false},
      {"f16 q.k 76500 scaled by 0: inf * 0", DType::f16, 255, 300, 0, 0.0, true},
      // 65512 stores as 65504; 65504 * 1.0002 = 65517.1 stores as 65504: finite in the chain, although
      // the exact 65512 * 1.0002 = 65525.1 would round to inf.
      {"f16 q.k 65512 stored 65504, scaled by 1.0002 finite", DType::f16, 256, 255.875, 8, 1.0002, false},
      // 65490 stores as 65504 (rounded up); 65504 * 1.0003 = 65523.7 stores as inf, although the
      // exact 65490 * 1.0003 = 65509.6 would not.
      {"f16 q.k 65490 stored 65504, scaled by 1.0003 inf", DType::f16, 256, 255.75, 18, 1.0003, true},
      {"bf16 q.k 2^132 stores inf", DType::bf16, 0x1p66, 0x1p66, 0, 0.125, true},
      {"f32 q.k 2^126 finite, scaled by 8 stores inf", DType::f32, 0x1p63, 0x1p63, 0, 8.0, true},
      {"f32 q.k -2^132 stores -inf", DType::f32, 0x1p66, -0x1p66, 0, 1.0, false}};
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    GraphBuilder builder;
    auto q = builder.input("q", {{1, kRows, kDepth}, test.dtype});
    auto k = builder.input("k", {{1, kKeys, kDepth}, test.dtype});
    auto v = builder.input("v", {{1, kKeys, kWidth}, test.dtype});
    const ValueRef scores = builder.scale(builder.matmul(q, k, true, "scores"), test.scale, "scaled");
    auto out = builder.matmul(builder.softmax(scores, -1, "probabilities"), v, false, "attention");
    const ComputeGraph graph = builder.build({out});
    const AttentionRewrite rewrite = rewrite_attention(graph);
    ASSERT_EQ(rewrite.candidates.size(), 1u);
    std::vector<double> qv(kRows * kDepth), kv(kKeys * kDepth), vv(kKeys * kWidth);
    for (double& x : qv) x = uniform(random);
    for (double& x : kv) x = uniform(random);
    for (double& x : vv) x = uniform(random);
    const std::vector<double> planted_q = {test.q, 1, 0, 0}, planted_k = {test.k, test.k_second, 0, 0};
    std::copy(planted_q.begin(), planted_q.end(), qv.begin() + kPlantedRow * kDepth);
    std::copy(planted_k.begin(), planted_k.end(), kv.begin() + kPlantedKey * kDepth);
    const TensorMap inputs = {{"q", HostTensor::from_values({{1, kRows, kDepth}, test.dtype}, qv)},
                              {"k", HostTensor::from_values({{1, kKeys, kDepth}, test.dtype}, kv)},
                              {"v", HostTensor::from_values({{1, kKeys, kWidth}, test.dtype}, vv)}};
    ASSERT_EQ(inputs.at("k").at(kPlantedKey * kDepth), test.k) << "the planted key is exact in the dtype";
    const HostTensor chain = run_reference(graph, inputs).at("attention");
    const HostTensor rewritten = run_reference(rewrite.graph, inputs).at("attention");
    for (std::int64_t row = 0; row < kRows; ++row) {
      for (std::int64_t c = 0; c < kWidth; ++c) {
        const double expected = chain.at(row * kWidth + c), actual = rewritten.at(row * kWidth + c);
        // The case is what it says: the planted row is NaN in the chain exactly when it says so.
        EXPECT_EQ(std::isnan(expected), row == kPlantedRow && test.planted_row_is_nan) << "row " << row;
        if (std::isnan(expected)) {
          EXPECT_TRUE(std::isnan(actual)) << "row " << row << " column " << c << " gave " << actual;
        } else {
          EXPECT_NEAR(actual, expected, 1e-2 * std::abs(expected)) << "row " << row << " column " << c;
        }
      }
    }
  }
}

// Two scale ops in a row: the chain stores the scores in their dtype after each, so an intermediate
// that underflows (f16 below 2^-25 is 0: uniform rows) or overflows (inf: NaN rows, -inf: weight 0)
// is lost there, while one flash_attention scale by the product never sees it. Refused; the plan
// runs the chain and gives what the chain gives. Found by an adversarial pass.
TEST(AttentionRewrite, TwoScalesInARowAreRefused) {
  const std::uint64_t seed = test_seed();
  for (const auto& [first, second] : {std::pair{0x1p-30, 0x1p30}, std::pair{0x1p20, 0x1p-20}}) {
    SCOPED_TRACE(fmt::format("scale by {} then by {}, seed {}", first, second, seed));
    GraphBuilder b;
    auto q = b.input("q", {{2, 4, 8}, DType::f16});
    auto k = b.input("k", {{2, 6, 8}, DType::f16});
    auto v = b.input("v", {{2, 6, 8}, DType::f16});
    auto scaled = b.scale(b.scale(b.matmul(q, k, true, "scores"), first, "scaled"), second, "rescaled");
    auto out = b.matmul(b.softmax(scaled, -1, "probabilities"), v, false, "attention");
    const ComputeGraph graph = b.build({out});
    const AttentionRewrite rewrite = rewrite_attention(graph);
    EXPECT_TRUE(rewrite.candidates.empty());
    ASSERT_EQ(rewrite.refusals.size(), 1u);
    EXPECT_EQ(rewrite.refusals[0].reason,
              "'rescaled' is a second scale on the scores (the chain rounds them to f16 between the two; "
              "flash_attention scales once)");
    expect_equal_within_gate(graph, rewrite.graph, seed);
    const TensorMap inputs = random_inputs(graph, seed);
    const NumericGateResult gate =
        numeric_gate(run_plan_reference(plan_with_discovery(graph), inputs).at("attention"), run_reference(graph, inputs).at("attention"));
    EXPECT_TRUE(gate.passed) << gate.detail;
  }
}

// A factor that is not 0 but is 0 in f32 (1e-50): the scale op multiplies in f32, so the chain's
// -inf scores became -inf * 0 = NaN, and their rows NaN, where flash_attention (scale 1e-50) weighed
// them 0 and was finite; the rewrite refused such a chain. The scale op itself refuses the factor
// now (every finite element would become 0), so neither the chain nor the node can be recorded.
TEST(AttentionRewrite, AFactorThatIsZeroInF32CannotBeRecorded) {
  GraphBuilder b;
  auto q = b.input("q", {{1, 5, 4}, DType::f16});
  auto k = b.input("k", {{1, 5, 4}, DType::f16});
  const ValueRef scores = b.matmul(q, k, true, "scores");
  try {
    b.scale(scores, 1e-50, "tiny");
    ADD_FAILURE() << "a factor of 1e-50 was recorded";
  } catch (const InputError& error) {
    EXPECT_EQ(std::string(error.what()), "node 'tiny' (scale): factor 1e-50 is 0 in f32 (scale multiplies in f32)");
  }
}

TEST(AttentionRewrite, ThePlainOpDefinitionMatchesTheNode) {
  const std::uint64_t seed = test_seed();
  for (const char* mask : {"none", "causal", "positions"}) {
    AttentionShape shape;
    shape.mask = mask;
    shape.batch = {2};
    shape.tokens = 6;  // rows; the keys stay 5, so causal and positions masks hide whole rows too
    const AttentionRewrite rewrite = rewrite_attention(attention_graph(shape));
    const Node& flash = only_node(rewrite.graph, "flash_attention");
    const ComputeGraph plain = flash_attention_as_plain_ops(rewrite.graph, flash.id);
    EXPECT_EQ(plain.outputs().size(), 1u);
    EXPECT_EQ(plain.value(plain.outputs()[0]).name, "out");
    const TensorMap inputs = random_inputs(rewrite.graph, seed);
    TensorMap plain_inputs;
    const std::vector<std::string> ends = {"q", "k", "v", "positions"};
    for (std::size_t k = 0; k < flash.inputs.size(); ++k) plain_inputs[ends[k]] = inputs.at(rewrite.graph.value(flash.inputs[k]).name);
    const HostTensor expected = run_reference(rewrite.graph, inputs).at("attention");
    const HostTensor actual = run_reference(plain, plain_inputs).at("out");
    const NumericGateResult gate = numeric_gate(actual, expected);
    EXPECT_TRUE(gate.passed) << mask << ": " << gate.detail;
  }
  Certificate forged = prove(stable_weighted_softmax_law());
  forged.verified = false;
  const ComputeGraph unproved = flash_graph(forged.to_json());
  EXPECT_NE(error_of([&] { flash_attention_as_plain_ops(unproved, 0); }).find("not verified"), std::string::npos);
}

}  // namespace
}  // namespace metile
