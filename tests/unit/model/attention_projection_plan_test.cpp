// Attention and the output projection that reads it, in the decode-step graphs of synthetic models
// as the GPU plans them (plan_with_discovery, h200): each layer's certified flash_attention node, the
// layout ops that merge its heads and the o-projection with its residual add are one
// attention_output_projection region carrying the node's certificate; at one token the GEMV lowering
// plans the projection with the attention prologue (the heads and dims of the model), and the region
// also races its two kernels one after the other (the attention kernel, then each projection shape);
// at several tokens only those. The planned graph still runs on the CPU plan executor exactly as the
// unplanned one.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "metile/cpu_runtime.h"
#include "metile/discovery.h"
#include "metile/dispatch.h"
#include "model_test_support.h"

namespace metile {
namespace {

class AttentionProjectionPlanTest : public testing::ModelDirectoryTest {};

TEST_F(AttentionProjectionPlanTest, AttentionAndItsProjectionAreOneRegionWhoseGemvAttendsFirst) {
  struct Case {
    ModelArchitecture architecture;
    std::optional<AffineQuantization> quantize;
  };
  for (const Case& test_case : {Case{ModelArchitecture::llama, AffineQuantization{4, 32}}, Case{ModelArchitecture::qwen2, std::nullopt}}) {
    const std::string name = std::string(architecture_class_name(test_case.architecture));
    SynthOptions options;
    options.preset = "small";  // head dim 64: the attention kernels take 64 or 128
    options.architecture = test_case.architecture;
    options.layers = 2;
    const DecoderModel model = DecoderModel::load(synth(name, options), {.quantize = test_case.quantize, .max_sequence = 24});
    const ModelConfig& config = model.config();
    for (const std::int64_t steps : {std::int64_t{1}, std::int64_t{3}}) {
      const FusionPlan plan = plan_with_discovery(model.step_graph(steps), FusionTarget::h200());
      const ComputeGraph& graph = *plan.graph;
      int regions = 0;
      for (const FusionRegion& region : plan.regions) {
        bool holds_attention = false;
        for (NodeId id : region.nodes) holds_attention = holds_attention || graph.node(id).op == "flash_attention";
        if (!holds_attention) continue;
        ASSERT_EQ(region.rule, "attention_output_projection") << name << "\n" << plan.explain();
        ++regions;
        EXPECT_FALSE(region.certificate.empty()) << name;
        EXPECT_EQ(region.outputs.size(), 1u) << name;  // the projection plus the residual, nothing between
        for (const char* role : {"q", "k", "v", "positions", "weight", "addend"}) {
          EXPECT_TRUE(region.role(role)) << name << ": role " << role;
        }
        const std::vector<FusionRegion> parts = attention_projection_parts(graph, region);
        ASSERT_EQ(parts.size(), 2u) << name;
        EXPECT_EQ(graph.node(parts[0].nodes.front()).op, "flash_attention");
        EXPECT_EQ(parts[0].nodes.size(), 4u) << name;  // attention, reshape, transpose, reshape
        EXPECT_EQ(parts[1].rule, "contraction_epilogue");
        EXPECT_EQ(parts[0].nodes.size() + parts[1].nodes.size(), region.nodes.size());
        const GemvRegionPlan gemv = plan_gemv_attention_projection(graph, region);
        const RegionLowerings lowered = lower_region(graph, region);
        int attending = 0, one_after_the_other = 0, projection_native = 0;
        for (const FusedCandidate& candidate : lowered.candidates) {
          attending += candidate.id.variant.find(" attend") != std::string::npos;
          one_after_the_other += candidate.id.variant.rfind("attention decode, then ", 0) == 0;
          projection_native += candidate.id.variant == "attention decode, then native";
          // At one token the layout ops between are views (alias_of): two launches, attention and the GEMV.
          if (steps == 1 && candidate.id.variant.rfind("attention decode, then gemv w", 0) == 0) {
            EXPECT_EQ(candidate.launches, 2) << name << ": " << candidate.id.variant;
          }
        }
        EXPECT_GE(one_after_the_other, 2) << name << ": the attention kernel, then each projection shape";
        // The projection as a region of its own would race cuBLASLt too: so does it here.
        EXPECT_EQ(projection_native, 1) << name << ": " << lowered.refusals;
        if (steps == 1) {
          ASSERT_TRUE(gemv.decision) << name << ": " << gemv.decision.reason;
          ASSERT_EQ(gemv.stages.size(), 1u);
          const GemvStage& stage = gemv.stages.front();
          ASSERT_TRUE(stage.attention) << name;
          EXPECT_EQ(stage.attention->kv_heads, config.num_key_value_heads) << name;
          EXPECT_EQ(stage.attention->groups, config.num_attention_heads / config.num_key_value_heads) << name;
          EXPECT_EQ(stage.attention->head_dim, config.head_dim) << name;
          EXPECT_EQ(stage.attention->keys, 24) << name;
          EXPECT_EQ(stage.attention_values.q, *region.role("q"));
          EXPECT_EQ(stage.attention_values.positions, *region.role("positions"));
          EXPECT_EQ(stage.input, parts[1].role("input"));
          EXPECT_GE(attending, 2) << name << ": " << lowered.refusals;
        } else {
          EXPECT_FALSE(gemv.decision) << name;
          EXPECT_NE(gemv.decision.reason.find("one token"), std::string::npos) << gemv.decision.reason;
          EXPECT_EQ(attending, 0) << name;
        }
      }
      EXPECT_EQ(regions, 2) << name << " steps " << steps << "\n" << plan.explain();
      const TensorMap inputs = random_inputs(graph, testing::model_test_seed());
      EXPECT_EQ(run_plan_reference(plan, inputs), run_reference(graph, inputs)) << name;
    }
  }
}

// One decode step's attention and projection recorded by hand (Hkv 2, G 2, D 64, 16 cache rows, bf16):
// the flash_attention node as the certified rewrite leaves it, or changed in one respect each time.
struct HandAttention {
  std::optional<std::string> certificate = prove(stable_weighted_softmax_law()).to_json();
  std::int64_t value_dim = 64;
  std::vector<std::int64_t> by_head = {4, 1, 64};  // [Hq, S, D]: the heads in the attention's order
};

ComputeGraph hand_attention_graph(const HandAttention& shape) {
  GraphBuilder b;
  const auto q = b.input("q", {{2, 2, 64}, DType::bf16});
  const auto k = b.input("k_cache", {{2, 16, 64}, DType::bf16});
  const auto v = b.input("v_cache", {{2, 16, shape.value_dim}, DType::bf16});
  const auto positions = b.input("positions", {{1}, DType::i32});
  Attributes attributes;
  attributes.set("scale", 0.125);
  attributes.set("mask", std::string("positions"));
  attributes.set("offset", std::int64_t{0});
  if (shape.certificate) attributes.set("certificate", *shape.certificate);
  const auto attention = b.add_node("flash_attention", {q, k, v, positions}, attributes, "attention").front();
  const auto by_head = b.reshape(attention, shape.by_head, "by_head");
  const auto by_token = b.transpose(by_head, {1, 0, 2}, "by_token");
  const std::int64_t width = 4 * shape.value_dim;
  const auto merged = b.reshape(by_token, {1, width}, "merged");
  const auto projected = b.matmul(merged, b.input("o_proj.weight", {{width, width}, DType::bf16}), true, "o_proj");
  return b.build({b.add(projected, b.input("residual", {{1, width}, DType::bf16}), "out")});
}

const FusionRegion* attention_region(const FusionPlan& plan) {
  for (const FusionRegion& region : plan.regions) {
    if (region.rule == "attention_output_projection") return &region;
  }
  return nullptr;
}

// What the rule and the attending GEMV's plan refuse, each with its reason.
TEST(AttentionProjectionRefusals, EachRefusalSaysWhy) {
  {  // As the rewrite leaves it: one region, and the GEMV attends.
    const ComputeGraph graph = hand_attention_graph({});
    const FusionPlan plan = plan_graph_fusion(graph, FusionTarget::h200());
    const FusionRegion* region = attention_region(plan);
    ASSERT_NE(region, nullptr) << plan.explain();
    const GemvRegionPlan gemv = plan_gemv_attention_projection(*plan.graph, *region);
    ASSERT_TRUE(gemv.decision) << gemv.decision.reason;
    EXPECT_EQ(gemv.stages.front().attention->kv_heads, 2);
    EXPECT_EQ(gemv.stages.front().attention->groups, 2);
  }
  {  // No certificate: the rule's certified entry takes no such node.
    HandAttention shape;
    shape.certificate.reset();
    const FusionPlan plan = plan_graph_fusion(hand_attention_graph(shape), FusionTarget::h200());
    EXPECT_EQ(attention_region(plan), nullptr) << plan.explain();
    for (const FusionRegion& region : plan.regions) {
      for (NodeId id : region.nodes) EXPECT_NE(plan.graph->node(id).op, "flash_attention") << plan.explain();
    }
  }
  auto gemv_refusal = [](const HandAttention& shape) {
    const FusionPlan plan = plan_graph_fusion(hand_attention_graph(shape), FusionTarget::h200());
    const FusionRegion* region = attention_region(plan);
    if (region == nullptr) return "no region: " + plan.explain();
    const GemvRegionPlan gemv = plan_gemv_attention_projection(*plan.graph, *region);
    return gemv.decision ? std::string("(allowed)") : gemv.decision.reason;
  };
  HandAttention other_law;
  other_law.certificate = prove(sum_law()).to_json();
  EXPECT_NE(gemv_refusal(other_law).find("its certificate is for law 'sum', the op needs 'stable_weighted_softmax'"),
            std::string::npos)
      << gemv_refusal(other_law);
  HandAttention wide_values;
  wide_values.value_dim = 128;
  wide_values.by_head = {4, 1, 128};
  EXPECT_NE(gemv_refusal(wide_values).find("the attention prologue writes x in the projection's dtype with D = Dv"),
            std::string::npos)
      << gemv_refusal(wide_values);
  HandAttention reordered;
  reordered.by_head = {2, 2, 64};  // [Hkv, G, D] transposed to [G, Hkv, D]: the heads change places
  EXPECT_NE(gemv_refusal(reordered).find("'by_token' (transpose) reorders the attention output before the projection"),
            std::string::npos)
      << gemv_refusal(reordered);
}

}  // namespace
}  // namespace metile
