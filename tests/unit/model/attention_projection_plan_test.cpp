// Attention and the output projection that reads it, in the decode-step graphs of synthetic models
// as the GPU plans them (plan_with_discovery, h200): each layer's certified flash_attention node, the
// layout ops that merge its heads and the o-projection with its residual add are one
// attention_output_projection region carrying the node's certificate; at one token the GEMV lowering
// plans the projection with the attention prologue (the heads and dims of the model), and the region
// also races its two kernels one after the other (the attention kernel, then each projection shape);
// at several tokens only those. The planned graph still runs on the CPU plan executor exactly as the
// unplanned one.
#include <gtest/gtest.h>

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
        int attending = 0, one_after_the_other = 0;
        for (const FusedCandidate& candidate : lowered.candidates) {
          attending += candidate.id.variant.find(" attend") != std::string::npos;
          one_after_the_other += candidate.id.variant.rfind("attention decode, then ", 0) == 0;
        }
        EXPECT_GE(one_after_the_other, 2) << name << ": the attention kernel, then each projection shape";
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

}  // namespace
}  // namespace metile
