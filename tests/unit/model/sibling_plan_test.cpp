// The decode-step graphs of synthetic models as the GPU plans them (plan_with_discovery, h200):
// every layer's q, k and v projections (quantized or not, with Qwen2's biases or without) are one
// sibling_contractions region bound by role, the MLP stays one swiglu_mlp region, each with the
// layer's RMSNorm of its input (the input prologue: no norm is a kernel of its own but the final
// one, which the GPU Executable gives the LM head), the rope and cache writes after q, k and v one
// rope_kv_cache region, and the planned graph runs on the CPU plan executor exactly as the
// unplanned one.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "metile/cpu_runtime.h"
#include "metile/discovery.h"
#include "model_test_support.h"

namespace metile {
namespace {

class SiblingPlanTest : public testing::ModelDirectoryTest {};

// Every node of a decode-step graph feeds an output: the native engine runs every node and the fused one
// only those plan_with_discovery keeps, so a dead node would be a kernel only one engine launches.
TEST_F(SiblingPlanTest, StepGraphsHaveNoDeadNodes) {
  for (const ModelArchitecture architecture :
       {ModelArchitecture::llama, ModelArchitecture::qwen2, ModelArchitecture::mistral}) {
    for (const bool quantized_and_tied : {false, true}) {
      const std::string name = std::string(architecture_class_name(architecture)) + (quantized_and_tied ? "4tied" : "");
      SynthOptions options;
      options.architecture = architecture;
      options.layers = 2;
      options.tie_word_embeddings = quantized_and_tied;
      if (quantized_and_tied) options.quantize = AffineQuantization{4, 32};
      const DecoderModel model =
          DecoderModel::load(synth(name, options), {.quantize = std::nullopt, .max_sequence = 32});
      for (const std::int64_t steps : {1, 16}) {
        for (const StepOutputs outputs : {StepOutputs::logits, StepOutputs::logits_and_next_tokens}) {
          const ComputeGraph& graph = model.step_graph(steps, outputs);
          const std::vector<bool> live = nodes_outputs_depend_on(graph);
          for (const Node& node : graph.nodes()) {
            EXPECT_TRUE(live[static_cast<std::size_t>(node.id)]) << name << " S=" << steps << ": " << node.name;
          }
        }
      }
    }
  }
}

// without_dead_nodes rebuilds a graph through a GraphBuilder, so every op's inference runs again on the
// attributes it filled in once: a quantized step graph (embedding, quantized matmuls, rope, cache
// writes, position masks, argmax) and its attention-rewritten form (flash_attention with its
// certificate), each with a dead node added through its JSON file, come back as they were.
TEST_F(SiblingPlanTest, RemovingADeadNodeGivesTheStepGraphBack) {
  SynthOptions options;
  options.architecture = ModelArchitecture::qwen2;
  options.layers = 2;
  options.quantize = AffineQuantization{4, 32};
  const DecoderModel model = DecoderModel::load(synth("qwen", options), {.quantize = std::nullopt, .max_sequence = 32});
  const ComputeGraph& step = model.step_graph(3, StepOutputs::logits_and_next_tokens);
  for (const ComputeGraph& graph : {step, rewrite_attention(step).graph}) {
    nlohmann::json file = nlohmann::json::parse(write_graph_json(graph));
    file["nodes"].push_back({{"name", "dead_probe"}, {"op", "argmax"}, {"inputs", {"logits"}}});
    const ComputeGraph with_dead = parse_graph_json(file.dump());
    ASSERT_EQ(with_dead.nodes().size(), graph.nodes().size() + 1);
    std::vector<NodeId> removed;
    const ComputeGraph kept = without_dead_nodes(with_dead, &removed);
    EXPECT_EQ(write_graph_json(kept), write_graph_json(graph));
    ASSERT_EQ(removed.size(), 1u);
    EXPECT_EQ(with_dead.node(removed[0]).name, "dead_probe");
  }
}

TEST_F(SiblingPlanTest, EveryLayersQkvIsOneRegionAndThePlanRunsLikeTheGraph) {
  struct Case {
    ModelArchitecture architecture;
    std::optional<AffineQuantization> quantize;
    std::int64_t steps;
  };
  const std::vector<Case> cases = {{ModelArchitecture::qwen2, std::nullopt, 1},
                                   {ModelArchitecture::qwen2, AffineQuantization{4, 32}, 3},
                                   {ModelArchitecture::llama, AffineQuantization{8, 32}, 1}};
  for (const Case& test_case : cases) {
    const std::string name = std::string(architecture_class_name(test_case.architecture)) +
                             (test_case.quantize ? std::to_string(test_case.quantize->bits) : "dense");
    SynthOptions options;
    options.architecture = test_case.architecture;
    options.layers = 2;
    const DecoderModel model =
        DecoderModel::load(synth(name, options), {.quantize = test_case.quantize, .max_sequence = 16});
    const FusionPlan plan = plan_with_discovery(model.step_graph(test_case.steps), FusionTarget::h200());
    const bool biased = test_case.architecture == ModelArchitecture::qwen2;
    int siblings = 0, mlps = 0, ropes = 0, joined = 0;
    // Each layer's q/k/v GEMV and its rope and cache writes are one qkv_rope_kv_cache region whose
    // parts are the two regions.
    std::vector<const FusionRegion*> regions;
    for (const FusionRegion& region : plan.regions) {
      regions.push_back(&region);
      if (region.rule != "qkv_rope_kv_cache") continue;
      ++joined;
      ASSERT_EQ(region.parts.size(), 2u) << name;
      EXPECT_EQ(region.parts[0].rule, "sibling_contractions") << name;
      EXPECT_EQ(region.parts[1].rule, "rope_kv_cache") << name;
      EXPECT_EQ(region.nodes.size(), region.parts[0].nodes.size() + region.parts[1].nodes.size()) << name;
      for (const FusionRegion& part : region.parts) regions.push_back(&part);
    }
    EXPECT_EQ(joined, 2) << name << "\n" << plan.explain();
    for (const FusionRegion* part_or_region : regions) {
      const FusionRegion& region = *part_or_region;
      mlps += region.rule == "swiglu_mlp";
      if (region.rule == "rope_kv_cache") {
        // One layer's chains: q and v of k's own layer, its caches.
        ++ropes;
        EXPECT_EQ(region.nodes.size(), 10u) << name;
        const std::string k_cache = plan.graph->value(*region.role("k_cache")).name;
        const std::string layer = k_cache.substr(0, k_cache.find(".k_cache"));
        for (const char* role : {"q", "k", "v", "v_cache"}) {
          EXPECT_EQ(plan.graph->value(*region.role(role)).name.rfind(layer + ".", 0), 0u) << name << " " << role;
        }
      }
      if (region.rule != "sibling_contractions") continue;
      ++siblings;
      EXPECT_EQ(region.nodes.size(), biased ? 7u : 4u) << name;  // the norm, q, k, v (and their bias adds)
      EXPECT_EQ(region.outputs.size(), 3u) << name;
      std::string roles;
      for (const RegionRole& role : region.roles) roles += role.role + " ";
      EXPECT_EQ(roles, biased ? "input weight.0 bias.0 weight.1 bias.1 weight.2 bias.2 norm_input norm_weight "
                              : "input weight.0 weight.1 weight.2 norm_input norm_weight ")
          << name;
      // weight.1 is the layer's k projection: the role follows the graph's order, whatever its name.
      const std::string k_weight = plan.graph->value(*region.role("weight.1")).name;
      EXPECT_NE(k_weight.find("self_attn.k_proj.weight"), std::string::npos) << k_weight;
    }
    EXPECT_EQ(siblings, 2) << name << "\n" << plan.explain();
    EXPECT_EQ(mlps, 2) << name << "\n" << plan.explain();
    EXPECT_EQ(ropes, 2) << name << "\n" << plan.explain();
    std::vector<std::string> norms_in_regions, norms_alone;
    for (const FusionRegion& region : plan.regions) {
      for (NodeId node : region.nodes) {
        if (plan.graph->node(node).op == "rms_norm") norms_in_regions.push_back(region.rule);
      }
    }
    for (NodeId node : plan.unfused) {
      if (plan.graph->node(node).op == "rms_norm") norms_alone.push_back(plan.graph->node(node).name);
    }
    EXPECT_EQ(norms_in_regions, (std::vector<std::string>{"qkv_rope_kv_cache", "swiglu_mlp", "qkv_rope_kv_cache",
                                                          "swiglu_mlp"}))
        << name << "\n" << plan.explain();
    EXPECT_EQ(norms_alone, std::vector<std::string>{"final_norm"}) << name << "\n" << plan.explain();
    const TensorMap inputs = random_inputs(*plan.graph, testing::model_test_seed());
    EXPECT_EQ(run_plan_reference(plan, inputs), run_reference(*plan.graph, inputs)) << name;
  }
}

}  // namespace
}  // namespace metile
