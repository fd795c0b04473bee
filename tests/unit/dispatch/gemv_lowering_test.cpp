// The GEMV lowerings without a GPU (src/dispatch/gemv_lowering.cpp): which regions each accepts and
// why it refuses the others, that operands come from the regions' roles (the test graphs' value
// names say nothing about roles, and the multiply and the residual add come either way round),
// the M = 1..16 limit, and NVRTC compiles (sm_90) of the kernels each lowering generates.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <future>
#include <random>
#include <set>

#include "gemv_region_graphs.h"
#include "metile/decode_mlp.h"
#include "metile/dispatch.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing::LinearFormat;

using testing::region_of_rule;

std::string value_name(const ComputeGraph& graph, ValueId id) { return id < 0 ? "-" : graph.value(id).name; }

// The epilogue evaluated on a few products, against the formula it must compute.
void expect_epilogue(const GemvEpilogue& epilogue, const std::function<double(double, double, double)>& formula,
                     const std::string& where) {
  // Products that no 16-bit dtype holds exactly, so that rounding them is seen; tensors are stored values.
  for (auto [a, b, t] : {std::tuple{0.7, -1.3, 2.0}, std::tuple{-3.1234567, 0.7654321, -0.5}, std::tuple{1.2345678, 2.1, 0.0}}) {
    const double accumulators[] = {a, b};
    const double tensors[] = {t};
    EXPECT_NEAR(epilogue.evaluate(std::span(accumulators, epilogue.product_count()),
                                  std::span(tensors, epilogue.tensor_inputs().size())),
                formula(a, b, t), 1e-12)
        << where << ": " << epilogue.to_string();
  }
}

double silu(double x) { return x / (1 + std::exp(-x)); }
// A bf16 value of the graph, as the unfused op stores it (round_to_dtype is checked on every bf16
// pattern by DTypeTest).
double bf16(double x) { return round_to_dtype(static_cast<float>(x), DType::bf16); }

// A one-row stage of N x K weights (bits 16: dense bf16; else affine, group 64), one product
// (the accumulator) or two (SwiGLU's gate and up).
GemvKernelConfig stage_base(std::int64_t n, std::int64_t k, int bits, int products) {
  GemvKernelConfig base;
  base.format = bits == 16 ? GemvWeightFormat::dense(DType::bf16) : GemvWeightFormat::affine(bits, 64, DType::bf16);
  base.rows = 1;
  base.out_features = n;
  base.in_features = k;
  base.epilogue = products == 2 ? GemvEpilogue::multiply(GemvEpilogue::silu(GemvEpilogue::accumulator(0)), GemvEpilogue::accumulator(1))
                                : GemvEpilogue::accumulator(0);
  return base;
}

TEST(GemvLowering, SwigluReadsItsOperandsFromTheRegionsRoles) {
  for (int bits : {16, 4, 8}) {
    for (bool swapped : {false, true}) {
      for (std::int64_t rows : {1, 5, 16}) {
        const std::string where = fmt::format("bits {} swapped {} M {}", bits, swapped, rows);
        const ComputeGraph graph = testing::swiglu_test_graph(rows, 192, 320, {bits, 64, DType::bf16}, swapped);
        const FusionPlan plan = plan_graph_fusion(graph);
        const FusionRegion* region = region_of_rule(plan, "swiglu_mlp");
        ASSERT_NE(region, nullptr) << plan.explain();
        const GemvRegionPlan lowered = plan_gemv_swiglu(*plan.graph, *region);
        ASSERT_TRUE(lowered.decision) << where << ": " << lowered.decision.reason;
        ASSERT_EQ(lowered.stages.size(), 2u);
        const GemvStage& gate_up = lowered.stages[0];
        const GemvStage& down = lowered.stages[1];
        // p1 is the gate (it goes through silu), p0 the up projection, p2 down: by role, not by name.
        EXPECT_EQ(gate_up.matrices[0].weight, *region->role("gate_weight")) << where;
        EXPECT_EQ(gate_up.matrices[1].weight, *region->role("up_weight")) << where;
        EXPECT_EQ(down.matrices[0].weight, *region->role("down_weight")) << where;
        const std::string suffix = bits == 16 ? ".w" : ".q";
        EXPECT_EQ(value_name(graph, gate_up.matrices[0].weight), "p1" + suffix);
        EXPECT_EQ(value_name(graph, gate_up.matrices[1].weight), "p0" + suffix);
        EXPECT_EQ(value_name(graph, down.matrices[0].weight), "p2" + suffix);
        if (bits != 16) {
          EXPECT_EQ(value_name(graph, gate_up.matrices[0].scales), "p1.s");
          EXPECT_EQ(value_name(graph, down.matrices[0].biases), "p2.b");
        }
        EXPECT_EQ(gate_up.input, *region->role("input"));
        EXPECT_EQ(value_name(graph, gate_up.output), "n1");
        EXPECT_EQ(down.input, gate_up.output);
        EXPECT_EQ(value_name(graph, down.output), "n2");
        EXPECT_EQ(gate_up.rows, rows);
        EXPECT_EQ(down.rows, rows);
        EXPECT_EQ(gate_up.matrices[0].format, bits == 16 ? GemvWeightFormat::dense(DType::bf16)
                                                         : GemvWeightFormat::affine(bits, 64, DType::bf16));
        EXPECT_EQ(gate_up.matrices[0].out_features, 320);
        EXPECT_EQ(gate_up.matrices[0].in_features, 192);
        EXPECT_EQ(down.matrices[0].out_features, 192);
        EXPECT_EQ(down.matrices[0].in_features, 320);
        // gate, up and silu(gate) are bf16 values of the graph: rounded where the epilogue reads them.
        expect_epilogue(gate_up.epilogue, [](double g, double u, double) { return bf16(silu(bf16(g))) * bf16(u); }, where);
        ASSERT_EQ(down.epilogue_tensors.size(), 1u);
        EXPECT_EQ(down.epilogue_tensors[0], *region->role("residual"));
        expect_epilogue(down.epilogue, [](double d, double, double r) { return bf16(d) + r; }, where);
      }
    }
  }
}

// The decode-MLP executor plans its graph the same way (decode_mlp_executor.cpp): one swiglu_mlp
// region whose stages read x, the three weights and the residual by role.
TEST(GemvLowering, TheDecodeMlpGraphPlansToTwoStages) {
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::f16), GemvWeightFormat::affine(4, 64, DType::bf16)}) {
    const DecodeMlpWeights weights = DecodeMlpWeights::random(format, 128, 256, 1);
    const ComputeGraph graph = weights.graph(3);
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion* region = region_of_rule(plan, "swiglu_mlp");
    ASSERT_NE(region, nullptr) << plan.explain();
    const GemvRegionPlan stages = plan_gemv_swiglu(*plan.graph, *region);
    ASSERT_TRUE(stages.decision) << stages.decision.reason;
    EXPECT_EQ(value_name(graph, stages.stages[0].input), "x");
    EXPECT_EQ(value_name(graph, stages.stages[0].output), "hidden_state");
    EXPECT_EQ(value_name(graph, stages.stages[1].output), "out");
    EXPECT_EQ(stages.stages[0].matrices[0].format, format);
    ASSERT_EQ(stages.stages[1].epilogue_tensors.size(), 1u);
    EXPECT_EQ(value_name(graph, stages.stages[1].epilogue_tensors[0]), "residual");
  }
}

TEST(GemvLowering, SwigluRefusesWithTheReason) {
  const LinearFormat dense{16, 64, DType::bf16};
  auto reason = [](const ComputeGraph& graph, const std::function<void(FusionRegion&)>& edit = {}) {
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion* found = region_of_rule(plan, "swiglu_mlp");
    if (found == nullptr) return std::string("(no swiglu_mlp region)");
    FusionRegion region = *found;
    if (edit) edit(region);
    const Lowered lowered = gemv_swiglu_candidates(*plan.graph, region);
    EXPECT_EQ(lowered.decision.ok, !lowered.candidates.empty());
    return lowered.decision.ok ? std::string("(accepted)") : lowered.decision.reason;
  };
  EXPECT_EQ(reason(testing::swiglu_test_graph(17, 64, 128, dense)),
            "node 'p1' has M = 17 activation rows: the GEMV kernels take 1..16 (decode)");
  EXPECT_EQ(reason(testing::swiglu_test_graph(16, 64, 128, dense)), "(accepted)");
  EXPECT_EQ(reason(testing::swiglu_test_graph(4, 64, 128, {16, 64, DType::f32})),
            "node 'p1' multiplies f32 activations: the GEMV kernels read f16 or bf16");
  EXPECT_EQ(reason(testing::swiglu_test_graph(4, 64, 128, dense),
                   [](FusionRegion& region) {
                     std::erase_if(region.roles, [](const RegionRole& role) { return role.role == "up_weight"; });
                   }),
            "the region has no role 'up_weight' (its pattern bound none)");
  EXPECT_EQ(reason(testing::swiglu_test_graph(4, 64, 128, dense),
                   [](FusionRegion& region) { region.rule = "contraction_epilogue"; }),
            "not a swiglu_mlp region (rule 'contraction_epilogue')");

  // Weights stored [K, N] (no transpose_right): the GEMV reads [N, K] rows in place.
  GraphBuilder builder;
  const ValueRef x = builder.input("a", TensorSpec({2, 64}, DType::f16));
  const ValueRef g = builder.matmul(x, builder.input("g", TensorSpec({64, 128}, DType::f16)), false, "gate");
  const ValueRef u = builder.matmul(x, builder.input("u", TensorSpec({64, 128}, DType::f16)), false, "up");
  const ValueRef h = builder.multiply(builder.silu(g, "s"), u, "h");
  const ValueRef d = builder.matmul(h, builder.input("d", TensorSpec({128, 64}, DType::f16)), false, "down");
  EXPECT_EQ(reason(builder.build({d})),
            "node 'gate': the weight 'g' f16[64, 128] is [K, N] (no transpose_right); the GEMV reads [N, K] rows in "
            "place");
}

TEST(GemvLowering, ContractionEpilogueTakesResidualOrBiasAndUnfusedNodesTakeAStore) {
  for (int bits : {16, 4, 8}) {
    const LinearFormat format{bits, 64, DType::bf16};
    for (const std::string epilogue : {"residual", "bias"}) {
      const std::string where = fmt::format("bits {} {}", bits, epilogue);
      const ComputeGraph graph = testing::projection_test_graph(5, 100, 320, format, epilogue);
      const FusionPlan plan = plan_graph_fusion(graph);
      const FusionRegion* region = region_of_rule(plan, "contraction_epilogue");
      ASSERT_NE(region, nullptr) << where << "\n" << plan.explain();
      // The rule binds input, weight and the add's other operand.
      EXPECT_EQ(value_name(graph, *region->role("input")), "a");
      EXPECT_EQ(value_name(graph, *region->role("weight")), bits == 16 ? "p0.w" : "p0.q");
      EXPECT_EQ(value_name(graph, *region->role("addend")), epilogue == "residual" ? "r" : "c");
      const GemvRegionPlan lowered = plan_gemv_contraction(*plan.graph, *region);
      ASSERT_TRUE(lowered.decision) << where << ": " << lowered.decision.reason;
      ASSERT_EQ(lowered.stages.size(), 1u);
      const GemvStage& stage = lowered.stages[0];
      EXPECT_EQ(stage.rows, 5);
      EXPECT_EQ(stage.matrices[0].out_features, 100);
      ASSERT_EQ(stage.epilogue_tensors.size(), 1u);
      EXPECT_EQ(stage.epilogue_tensors[0], *region->role("addend"));
      EXPECT_EQ(stage.epilogue.tensor_inputs()[0].broadcast_rows, epilogue == "bias") << where;
      expect_epilogue(stage.epilogue, [](double y, double, double t) { return bf16(y) + t; }, where);
    }
    // A projection alone stays unfused in the plan; the Executable offers it as a one-node region.
    const ComputeGraph graph = testing::projection_test_graph(1, 130, 256, format, "none");
    const FusionPlan plan = plan_graph_fusion(graph);
    ASSERT_EQ(plan.unfused.size(), 1u);
    const FusionRegion region = contraction_node_region(*plan.graph, plan.unfused[0]);
    EXPECT_EQ(region.rule, "contraction");
    const GemvRegionPlan lowered = plan_gemv_region(*plan.graph, region);
    ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
    EXPECT_EQ(lowered.stages[0].epilogue.to_string(), GemvEpilogue::store().to_string());
    EXPECT_EQ(value_name(graph, lowered.stages[0].output), "p0");
  }
}

// An LM head (N = 128256, K = 4096) at M = 1 and 16, dense and 4-bit: both mainloops' shapes, the
// register shapes twice (plain and with their weights prefetched into L2), as many as a one-stage
// region races; at M = 1 (4-bit) the tile loop is among them.
TEST(GemvLowering, AnLmHeadGetsRegisterAndStreamedShapes) {
  for (int bits : {16, 4}) {
    for (std::int64_t rows : {1, 16}) {
      const ComputeGraph graph = testing::projection_test_graph(rows, 128256, 4096, {bits, 64, DType::bf16}, "none");
      const FusionPlan plan = plan_graph_fusion(graph);
      const Lowered lowered = gemv_region_candidates(*plan.graph, contraction_node_region(*plan.graph, plan.unfused.at(0)));
      ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
      int streamed = 0, prefetching = 0, looped = 0, half = 0;
      for (const FusedCandidate& candidate : lowered.candidates) {
        streamed += candidate.id.variant.find("streamed") != std::string::npos ? 1 : 0;
        prefetching += candidate.id.variant.find("prefetch") != std::string::npos ? 1 : 0;
        looped += candidate.id.variant.find("loop") != std::string::npos ? 1 : 0;
        half += candidate.id.variant.find("half") != std::string::npos ? 1 : 0;
      }
      const int per_family = gemv_lowering_shapes_per_family_one_stage;
      EXPECT_EQ(streamed, per_family) << bits << " bits, M " << rows;
      EXPECT_EQ(prefetching, per_family) << bits << " bits, M " << rows;
      if (rows == 1) {
        EXPECT_GE(looped, 2) << bits << " bits, M " << rows;
      }
      // The half-products twins: affine weights whose x the block can stage (M = 1 of K = 4096, not 16 rows).
      const int expected_half = bits == 4 && rows == 1 ? per_family : 0;
      EXPECT_EQ(half, expected_half) << bits << " bits, M " << rows;
      EXPECT_EQ(lowered.candidates.size(), 3u * per_family + static_cast<unsigned>(expected_half));
    }
  }
}

// An LM head whose values an argmax reads (greedy decoding's next tokens) is offered with it as
// one region; the GEMV writes both (argmax_rows), on the register mainloop only (the streamed one
// has no argmax join; its kernels compile in EveryLoweringsKernelsCompileForSm90). Without the
// values as an output, or with two argmaxes, it is not one GEMV's work.
TEST(GemvLowering, AnLmHeadWithItsArgmaxIsOneGemvWritingBoth) {
  for (int bits : {16, 4}) {
    for (std::int64_t rows : {1, 5}) {
      const std::string where = fmt::format("bits {} M {}", bits, rows);
      const ComputeGraph graph = testing::projection_test_graph(rows, 1000, 512, {bits, 64, DType::bf16}, "argmax");
      const FusionPlan plan = plan_graph_fusion(graph);
      ASSERT_EQ(plan.unfused.size(), 2u) << where << "\n" << plan.explain();
      const FusionRegion region = contraction_node_region(*plan.graph, plan.unfused.at(0));
      EXPECT_EQ(region.rule, "contraction_argmax") << where;
      EXPECT_EQ(region.nodes.size(), 2u) << where;
      EXPECT_EQ(region.outputs.size(), 2u) << where;
      const GemvRegionPlan lowered = plan_gemv_region(*plan.graph, region);
      ASSERT_TRUE(lowered.decision) << where << ": " << lowered.decision.reason;
      ASSERT_EQ(lowered.stages.size(), 1u);
      EXPECT_EQ(value_name(graph, lowered.stages[0].output), "p0");
      EXPECT_EQ(value_name(graph, lowered.stages[0].argmax_output), "n0");
      EXPECT_EQ(lowered.stages[0].epilogue.to_string(), GemvEpilogue::store().to_string());
      EXPECT_TRUE(lowered.stages[0].base_config().argmax_rows);
      const Lowered candidates = gemv_region_candidates(*plan.graph, region);
      ASSERT_TRUE(candidates.decision) << candidates.decision.reason;
      EXPECT_GE(candidates.candidates.size(), 1u) << where;
      for (const FusedCandidate& candidate : candidates.candidates) {
        EXPECT_EQ(candidate.id.variant.find("streamed"), std::string::npos) << candidate.id.name();
        EXPECT_NE(candidate.source.find("argmax_rows"), std::string::npos) << candidate.id.name();
      }
      const GemvKernelSource kernel =
          generate_gemv_kernel(gemv_stage_configs(lowered.stages[0].base_config(), gemv_lowering_shapes_per_family).front());
      EXPECT_EQ(kernel.workspace_bytes, static_cast<std::uint64_t>(2 * kernel.grid_blocks * rows * 4 + 4)) << where;
    }
  }
  // The values read by the argmax only: the GEMV's join reads the values it wrote.
  const ComputeGraph hidden_values = [] {
    GraphBuilder b;
    const ValueRef x = b.input("a", TensorSpec({1, 64}, DType::bf16));
    return b.build({b.argmax(b.matmul(x, b.input("w", TensorSpec({32, 64}, DType::bf16)), true, "y"), "next")});
  }();
  const FusionPlan hidden_plan = plan_graph_fusion(hidden_values);
  const FusionRegion hidden_region = contraction_node_region(*hidden_plan.graph, hidden_plan.unfused.at(0));
  EXPECT_EQ(plan_gemv_region(*hidden_plan.graph, hidden_region).decision.reason,
            "'y' is read by the argmax only: the GEMV's argmax join reads the values it wrote");
  // Two argmaxes of one LM head: the plain contraction region.
  const ComputeGraph two = [] {
    GraphBuilder b;
    const ValueRef x = b.input("a", TensorSpec({1, 64}, DType::bf16));
    const ValueRef y = b.matmul(x, b.input("w", TensorSpec({32, 64}, DType::bf16)), true, "y");
    return b.build({y, b.argmax(y, "first"), b.argmax(y, "second")});
  }();
  const FusionPlan two_plan = plan_graph_fusion(two);
  EXPECT_EQ(contraction_node_region(*two_plan.graph, two_plan.unfused.at(0)).rule, "contraction");
}

// The RMSNorm a region takes as its input prologue (the planner's q/k/v group and SwiGLU MLP, the
// Executable's LM head with its argmax): the GEMV stage that reads it reads the norm's x and weight
// instead and normalizes x as it loads it (x_rms_norm_eps), every candidate's kernel takes the
// weight after x; the down projection reads h as it is. A norm the region would also have to write
// is refused with the reason, and a norm in another region stays out of the LM head's.
TEST(GemvLowering, AnRmsNormInTheRegionNormalizesTheGemvsX) {
  const LinearFormat format{4, 64, DType::bf16};
  auto expect_normalized = [](const ComputeGraph& graph, const GemvStage& stage, const std::string& where) {
    EXPECT_EQ(value_name(graph, stage.input), "a") << where;
    EXPECT_EQ(value_name(graph, stage.norm_weight), "g") << where;
    EXPECT_EQ(stage.base_config().x_rms_norm_eps, testing::kTestNormEps) << where;
  };
  auto expect_candidates_normalize = [](const ComputeGraph& graph, const FusionRegion& region, const std::string& where) {
    const Lowered lowered = gemv_region_candidates(graph, region);
    ASSERT_TRUE(lowered.decision) << where << ": " << lowered.decision.reason;
    ASSERT_FALSE(lowered.candidates.empty()) << where;
    for (const FusedCandidate& candidate : lowered.candidates) {
      // The stage kernels' parameter, or the persistent MLP's gate/up phase's.
      const bool stage = candidate.source.find("__restrict__ x_norm_weight,") != std::string::npos;
      const bool persistent = candidate.source.find("__restrict__ gate_up_x_norm_weight,") != std::string::npos;
      EXPECT_TRUE(stage || persistent) << where << ", " << candidate.id.name();
    }
  };
  struct Planned {
    std::string rule;
    ComputeGraph graph;
    std::size_t stages;
  };
  for (const Planned& planned :
       {Planned{"sibling_contractions", testing::sibling_test_graph(1, {96, 32, 32}, 320, format, {true, false, false}, true), 1},
        Planned{"swiglu_mlp", testing::swiglu_test_graph(16, 192, 320, format, true, true, true), 2}}) {
    const FusionPlan plan = plan_graph_fusion(planned.graph);
    const FusionRegion* region = region_of_rule(plan, planned.rule);
    ASSERT_NE(region, nullptr) << plan.explain();
    const GemvRegionPlan lowered = plan_gemv_region(*plan.graph, *region);
    ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
    ASSERT_EQ(lowered.stages.size(), planned.stages);
    expect_normalized(*plan.graph, lowered.stages[0], planned.rule);
    expect_candidates_normalize(*plan.graph, *region, planned.rule);
    if (planned.stages == 2) {  // the down projection reads h as it is
      EXPECT_EQ(lowered.stages[1].norm_weight, -1);
      EXPECT_FALSE(lowered.stages[1].base_config().x_rms_norm_eps);
    }
  }
  {
    const ComputeGraph graph = testing::projection_test_graph(1, 1000, 320, format, "argmax", true);
    const FusionPlan plan = plan_graph_fusion(graph);
    EXPECT_EQ(plan.kernel_count(), 3) << "the planner leaves the final norm to the Executable's LM head region\n"
                                      << plan.explain();
    const NodeId head = *plan.graph->find_node("p0"), norm = *plan.graph->find_node("m0");
    const FusionRegion region = contraction_node_region(*plan.graph, head);
    EXPECT_EQ(region.rule, "contraction_argmax");
    EXPECT_EQ(region.nodes.size(), 3u);
    EXPECT_EQ(value_name(graph, *region.role("norm_input")), "a");
    const GemvRegionPlan lowered = plan_gemv_region(*plan.graph, region);
    ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
    expect_normalized(*plan.graph, lowered.stages[0], "LM head");
    expect_candidates_normalize(*plan.graph, region, "LM head");
    // The norm in another region: the LM head reads its value as it is.
    const FusionRegion alone = contraction_node_region(*plan.graph, head, {norm});
    EXPECT_EQ(alone.nodes.size(), 2u);
    EXPECT_FALSE(alone.role("norm_input"));
  }
  {
    // Hand-made: the normalized value is also a graph output, so the region would have to write it.
    GraphBuilder builder;
    const ValueRef normalized = testing::test_activation(builder, 1, 128, DType::bf16, true);
    const ValueRef y = testing::test_linear(builder, normalized, "p0", 64, 128, {});
    const ComputeGraph graph = builder.build({y, normalized});
    FusionRegion region = region_of_nodes(graph, {*graph.find_node("m0"), *graph.find_node("p0")}, "contraction");
    region.roles = {{"input", *graph.find_value("m0")}, {"weight", *graph.find_value("p0.w")}};
    EXPECT_EQ(plan_gemv_region(graph, region).decision.reason,
              "'m0' is also written by the region; the GEMV normalizes x as it loads it and writes no normalized x");
    EXPECT_FALSE(contraction_node_region(graph, *graph.find_node("p0")).role("norm_input"));
  }
}

// A GEMV reads its weights (and its RMSNorm's weight) before the wait for the previous kernel, and
// repacks quantized ones once: a weight some node of the graph computes, outside the region, is
// refused with the node that computes it (the region's own graph sees every outside value as an
// input; the check is on the whole graph).
TEST(GemvLowering, WeightsTheGraphComputesAreRefused) {
  auto reason = [](const ComputeGraph& graph, const std::string& contraction, bool with_norm) {
    std::vector<NodeId> nodes = {*graph.find_node(contraction)};
    if (with_norm) nodes.insert(nodes.begin(), *graph.find_node("m0"));
    FusionRegion region = region_of_nodes(graph, nodes, "contraction");
    region.roles = {{"input", *graph.find_value(with_norm ? "m0" : "a")},
                    {"weight", graph.node(nodes.back()).inputs[1]}};
    return plan_gemv_region(graph, region).decision.reason;
  };
  {  // dense: W = W0 + W1
    GraphBuilder builder;
    const ValueRef x = builder.input("a", TensorSpec({1, 64}, DType::bf16));
    const TensorSpec weight({32, 64}, DType::bf16);
    const ValueRef w = builder.add(builder.input("w0", weight), builder.input("w1", weight), "summed_weight");
    const ComputeGraph graph = builder.build({builder.matmul(x, w, true, "p0")});
    EXPECT_EQ(reason(graph, "p0", false),
              "the weight 'summed_weight' is computed in the graph (by 'summed_weight'); the GEMV reads its weights "
              "before the previous kernel finishes, and a copy of quantized ones made once");
  }
  {  // 4-bit: the scales computed
    GraphBuilder builder;
    const ValueRef x = builder.input("a", TensorSpec({1, 128}, DType::bf16));
    const TensorSpec scales({32, 2}, DType::bf16);
    const ValueRef s = builder.multiply(builder.input("s0", scales), builder.input("s1", scales), "scaled");
    const ValueRef y = builder.quantized_matmul(x, builder.input("q", TensorSpec({32, 16}, DType::u32)), s,
                                                builder.input("b", scales), 4, 64, "p0");
    EXPECT_EQ(reason(builder.build({y}), "p0", false),
              "the weight 'scaled' is computed in the graph (by 'scaled'); the GEMV reads its weights before the "
              "previous kernel finishes, and a copy of quantized ones made once");
  }
  {  // a stacked (sibling) projection's bias computed
    GraphBuilder builder;
    const ValueRef x = builder.input("a", TensorSpec({1, 64}, DType::bf16));
    std::vector<ValueRef> outputs;
    for (int p = 0; p < 3; ++p) {
      const std::string name = "p" + std::to_string(p);
      const ValueRef y = builder.matmul(x, builder.input(name + ".w", TensorSpec({32, 64}, DType::bf16)), true, name);
      const TensorSpec bias({32}, DType::bf16);
      const ValueRef c = p == 1 ? builder.add(builder.input("c1a", bias), builder.input("c1b", bias), "summed_bias")
                                : builder.input("c" + std::to_string(p), bias);
      outputs.push_back(builder.add(y, c, "y" + std::to_string(p)));
    }
    const ComputeGraph graph = builder.build(outputs);
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion* region = region_of_rule(plan, "sibling_contractions");
    ASSERT_NE(region, nullptr) << plan.explain();
    EXPECT_EQ(plan_gemv_region(*plan.graph, *region).decision.reason,
              "the weight 'summed_bias' is computed in the graph (by 'summed_bias'); the GEMV reads its weights "
              "before the previous kernel finishes, and a copy of quantized ones made once");
  }
  {  // the RMSNorm's weight computed
    GraphBuilder builder;
    const ValueRef a = builder.input("a", TensorSpec({1, 64}, DType::bf16));
    const TensorSpec gain({64}, DType::bf16);
    const ValueRef g = builder.add(builder.input("g0", gain), builder.input("g1", gain), "gain");
    const ValueRef normalized = builder.rms_norm(a, g, 1e-5, "m0");
    const ComputeGraph graph = builder.build({builder.matmul(normalized, builder.input("w", TensorSpec({32, 64}, DType::bf16)), true, "p0")});
    EXPECT_EQ(reason(graph, "p0", true),
              "the rms_norm weight 'gain' is computed in the graph (by 'gain'); the GEMV reads it before the previous "
              "kernel finishes");
    // The same graph with the norm's weight an input lowers.
    GraphBuilder plain;
    const ValueRef plain_normalized = plain.rms_norm(plain.input("a", TensorSpec({1, 64}, DType::bf16)), plain.input("g", gain), 1e-5, "m0");
    const ComputeGraph accepted = plain.build({plain.matmul(plain_normalized, plain.input("w", TensorSpec({32, 64}, DType::bf16)), true, "p0")});
    EXPECT_EQ(reason(accepted, "p0", true), "");
  }
}

// Every launch shape a stage races has a name of its own (the tournament and the decision cache
// know candidates by it): all of gemv_tuning_candidates' shapes, split-K, staged and group-sum ones
// included, at wide and narrow sizes, dense and affine, one and two products.
TEST(GemvLowering, EveryStageShapeHasItsOwnName) {
  for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{14336, 4096}, {1536, 8960}, {96, 512}}) {
    for (int bits : {16, 8, 4}) {
      for (int products : {1, 2}) {
        GemvKernelConfig base = stage_base(n, k, bits, products);
        for (bool normalized : {false, true}) {
          if (normalized) base.x_rms_norm_eps = 1e-5;
          const std::vector<GemvKernelConfig> configs = gemv_stage_configs(base, 100);
          std::set<std::string> names;
          int copied = 0;
          for (const GemvKernelConfig& config : configs) {
            EXPECT_TRUE(names.insert(gemv_shape_name(config)).second)
                << gemv_shape_name(config) << " twice (" << config.to_string() << "), N " << n << " K " << k;
            EXPECT_NO_THROW(config.validate()) << config.to_string();
            copied += config.x_staged_by_async_copy ? 1 : 0;
          }
          EXPECT_GE(names.size(), 5u);
          // Whether `config` with the cp.async prologue is a valid kernel.
          auto valid_copied = [](GemvKernelConfig config) {
            config.x_staged_by_async_copy = true;
            try {
              config.validate();
              return true;
            } catch (const InputError&) {
              return false;
            }
          };
          // Only a normalized GEMV whose x fits the shared-memory stage (not K = 8960) races the
          // cp.async prologue, and then at least one shape of it.
          const bool fits = valid_copied(base);
          EXPECT_EQ(fits, normalized && k <= 4096) << "N " << n << " K " << k;
          if (fits) {
            EXPECT_GE(copied, 1) << "N " << n << " K " << k << " bits " << bits;
            // Every register shape without a prefetch or a staged ring has its twin, when the twin is valid.
            for (const GemvKernelConfig& config : configs) {
              if (config.mainloop != GemvMainloop::register_batches || config.x_staged_by_async_copy ||
                  config.l2_prefetch_rounds > 0 || config.shared_stages >= 2 || config.half_products) {
                continue;
              }
              GemvKernelConfig twin = config;
              twin.x_staged_by_async_copy = true;
              if (valid_copied(config)) {
                EXPECT_TRUE(names.contains(gemv_shape_name(twin))) << gemv_shape_name(twin) << " is not raced";
              }
            }
          } else {
            EXPECT_EQ(copied, 0) << "N " << n << " K " << k << " bits " << bits;
          }
          // Affine weights at M = 1 (x of at most 16384 columns fits the block's stage): every plain
          // register shape without a staged ring or shared group sums has its half-products twin raced;
          // dense weights have none.
          int halves = 0;
          for (const GemvKernelConfig& config : configs) {
            halves += config.half_products ? 1 : 0;
            if (config.mainloop != GemvMainloop::register_batches || config.x_staged_by_async_copy ||
                config.l2_prefetch_rounds > 0 || config.shared_stages >= 2 || config.shared_group_sums ||
                config.x_with_batch || config.half_products) {
              continue;
            }
            GemvKernelConfig twin = config;
            twin.half_products = true;
            EXPECT_EQ(names.contains(gemv_shape_name(twin)), bits != 16)
                << gemv_shape_name(twin) << ", N " << n << " K " << k << " bits " << bits;
          }
          if (bits == 16) {
            EXPECT_EQ(halves, 0);
          }
          // Llama-3-8B's gate/up as stored: the unbuffered 4-warp half twin also races bounded to the 7
          // blocks an SM of its one-wave grid (gemv_one_wave_bound).
          if (n == 14336 && bits != 16 && products == 2) {
            EXPECT_EQ(names.contains("register_resident w4 t1 f2 batch resident7 half"), !normalized) << bits;
          }
        }
        // A base that already multiplies in f16 races each shape once: the half twins of its family
        // would be the family itself under the same names.
        if (bits != 16) {
          GemvKernelConfig half_base = stage_base(n, k, bits, products);
          half_base.half_products = true;
          if (k * 2 <= 32 * 1024) {
            std::set<std::string> names;
            for (const GemvKernelConfig& config : gemv_stage_configs(half_base, 100)) {
              EXPECT_TRUE(names.insert(gemv_shape_name(config)).second)
                  << gemv_shape_name(config) << " twice with a half-products base, N " << n << " K " << k;
            }
            EXPECT_GE(names.size(), 3u);
          }
        }
      }
    }
  }
}

// The step's race finds each raced register shape's L2-prefetch twin by name (prefetch_twin_candidate):
// for every shape a stage races at wide and narrow sizes, the twin it finds among the stage's
// candidate names is exactly the shape with l2_prefetch_rounds set, and a shape that has no twin raced
// (x-async, staged, streamed, a twin itself) finds none.
TEST(GemvLowering, EachRacedShapeFindsItsOwnPrefetchTwinByName) {
  for (auto [n, k] : {std::pair<std::int64_t, std::int64_t>{14336, 4096}, {1536, 8960}, {6144, 4096}}) {
    for (int bits : {16, 4}) {
      for (int products : {1, 2}) {
        GemvKernelConfig base = stage_base(n, k, bits, products);
        base.x_rms_norm_eps = 1e-5;
        const std::vector<GemvKernelConfig> configs = gemv_stage_configs(base, 4);
        auto candidate_name = [](const GemvKernelConfig& config) { return "fused gemv " + gemv_shape_name(config); };
        std::vector<std::pair<std::string, double>> timings;
        for (const GemvKernelConfig& config : configs) {
          timings.emplace_back(candidate_name(config), 1.0);
          timings.emplace_back(candidate_name(config) + " graph", 1.0);
        }
        int twins = 0;
        for (const GemvKernelConfig& config : configs) {
          const std::optional<std::string> found = prefetch_twin_candidate(timings, candidate_name(config) + " graph");
          std::optional<std::string> expected;
          for (const GemvKernelConfig& other : configs) {
            GemvKernelConfig plain = other;
            plain.l2_prefetch_rounds = 0;
            if (other.l2_prefetch_rounds > 0 && config.l2_prefetch_rounds == 0 && gemv_shape_name(plain) == gemv_shape_name(config)) {
              expected = candidate_name(other);
            }
          }
          EXPECT_EQ(found, expected) << candidate_name(config) << ", N " << n << " K " << k << " bits " << bits;
          twins += found ? 1 : 0;
        }
        EXPECT_GE(twins, 1) << "N " << n << " K " << k << " bits " << bits << ": no raced shape has a prefetch twin";
      }
    }
  }
}

TEST(GemvLowering, OtherRegionsAreRefusedWithTheReason) {
  // A row region: the built-in "gemv" lowering says which rules it takes.
  const FusionPlan rows = plan_graph_fusion(testing::seed_graph(1, 256, DType::f16));
  ASSERT_EQ(rows.regions.size(), 1u);
  const Lowered row_lowered = gemv_region_candidates(*rows.graph, rows.regions[0]);
  EXPECT_FALSE(row_lowered.decision);
  EXPECT_EQ(row_lowered.decision.reason,
            "the GEMV lowers swiglu_mlp, contraction_epilogue, contraction, contraction_argmax, "
            "sibling_contractions, qkv_rope_kv_cache and attention_output_projection regions, not "
            "'residual_add_rms_norm'");
  bool listed = false;
  for (const RegionLowering& lowering : builtin_lowerings()) listed = listed || lowering.name == "gemv";
  EXPECT_TRUE(listed);

  // A batched weight (attention's q·kᵀ) and a contraction whose output also leaves the region.
  GraphBuilder builder;
  const ValueRef q = builder.input("q", TensorSpec({2, 1, 64}, DType::bf16));
  const ValueRef k = builder.input("k", TensorSpec({2, 8, 64}, DType::bf16));
  const ValueRef scores = builder.matmul(q, k, true, "scores");
  const ComputeGraph batched = builder.build({builder.scale(scores, 0.125, "scaled")});
  const FusionPlan batched_plan = plan_graph_fusion(batched);
  const FusionRegion* region = region_of_rule(batched_plan, "contraction_epilogue");
  ASSERT_NE(region, nullptr) << batched_plan.explain();
  EXPECT_EQ(plan_gemv_contraction(*batched_plan.graph, *region).decision.reason,
            "node 'scores': the weight 'k' bf16[2, 8, 64] is batched; the GEMV reads one [N, K] matrix");

  const ComputeGraph two_outputs = [] {
    GraphBuilder b;
    const ValueRef x = b.input("a", TensorSpec({1, 64}, DType::bf16));
    const ValueRef y = b.matmul(x, b.input("w", TensorSpec({32, 64}, DType::bf16)), true, "y");
    return b.build({y, b.silu(y, "z")});
  }();
  const FusionPlan two_plan = plan_graph_fusion(two_outputs);
  region = region_of_rule(two_plan, "contraction_epilogue");
  ASSERT_NE(region, nullptr) << two_plan.explain();
  EXPECT_EQ(plan_gemv_contraction(*two_plan.graph, *region).decision.reason,
            "the region writes 2 values; one GEMV writes one");
}

// Every kernel a lowering's candidates run, generated from the plan the way the lowering does,
// compiles with NVRTC for sm_90; each candidate's source is exactly its kernels' sources.
TEST(GemvLowering, EveryLoweringsKernelsCompileForSm90) {
  struct Case {
    std::string what;
    ComputeGraph graph;
    std::string rule;
  };
  std::vector<Case> cases;
  for (int bits : {16, 4, 8}) {
    const LinearFormat format{bits, 64, DType::bf16};
    cases.push_back({fmt::format("swiglu bits {}", bits), testing::swiglu_test_graph(5, 192, 320, format, true), "swiglu_mlp"});
  }
  cases.push_back({"residual f16", testing::projection_test_graph(16, 100, 320, {16, 64, DType::f16}, "residual"),
                   "contraction_epilogue"});
  cases.push_back({"bias affine8", testing::projection_test_graph(1, 100, 320, {8, 32, DType::bf16}, "bias"),
                   "contraction_epilogue"});
  cases.push_back({"store affine4", testing::projection_test_graph(1, 130, 256, {4, 128, DType::bf16}, "none"), "contraction"});
  cases.push_back({"lm head and argmax dense", testing::projection_test_graph(5, 1000, 512, {16, 64, DType::bf16}, "argmax"),
                   "contraction_argmax"});
  cases.push_back({"lm head and argmax affine4", testing::projection_test_graph(1, 1000, 512, {4, 64, DType::bf16}, "argmax"),
                   "contraction_argmax"});
  // q, k, v as one GEMV: dense and affine, M = 1 and 16, Qwen-like biases (one part without).
  cases.push_back({"siblings dense M16 biased",
                   testing::sibling_test_graph(16, {128, 32, 32}, 256, {16, 64, DType::bf16}, {true, true, true}),
                   "sibling_contractions"});
  cases.push_back({"siblings affine4 M1",
                   testing::sibling_test_graph(1, {128, 32, 32}, 256, {4, 64, DType::bf16}, {false, false, false}),
                   "sibling_contractions"});
  cases.push_back({"siblings affine8 M16 biased",
                   testing::sibling_test_graph(16, {64, 48, 32}, 256, {8, 32, DType::f16}, {true, false, true}),
                   "sibling_contractions"});

  std::vector<std::future<std::string>> compiles;
  for (const Case& test_case : cases) {
    const FusionPlan plan = plan_graph_fusion(test_case.graph);
    const bool unfused = test_case.rule == "contraction" || test_case.rule == "contraction_argmax";
    if (!unfused) {
      ASSERT_NE(region_of_rule(plan, test_case.rule), nullptr) << test_case.what;
    }
    const FusionRegion region = unfused
                                    ? contraction_node_region(*plan.graph, plan.unfused.at(0))
                                    : *region_of_rule(plan, test_case.rule);
    const GemvRegionPlan lowered = plan_gemv_region(*plan.graph, region);
    ASSERT_TRUE(lowered.decision) << test_case.what << ": " << lowered.decision.reason;
    const Lowered candidates = gemv_region_candidates(*plan.graph, region);
    ASSERT_TRUE(candidates.decision) << candidates.decision.reason;
    std::vector<std::vector<GemvKernelSource>> stage_kernels;
    const bool one_stage = lowered.stages.size() == 1;
    const int per_family = one_stage ? gemv_lowering_shapes_per_family_one_stage : gemv_lowering_shapes_per_family;
    for (const GemvStage& stage : lowered.stages) {
      stage_kernels.emplace_back();
      for (const GemvKernelConfig& config :
           gemv_stage_configs(stage.base_config(), per_family, 132, one_stage || gemv_lowering_two_stage_streamed)) {
        stage_kernels.back().push_back(generate_gemv_kernel(config));
      }
    }
    // Every combination of one shape per stage, in the lowering's order; then, for a swiglu_mlp
    // region, the first persistent decode-MLP shapes (one launch for both stages; no device here:
    // the H200's 132 SMs).
    std::size_t expected = 1;
    for (const auto& kernels : stage_kernels) expected *= kernels.size();
    std::vector<PersistentMlpConfig> persistent;
    if (test_case.rule == "swiglu_mlp") {
      persistent = persistent_mlp_candidates(lowered.stages[0].base_config(), lowered.stages[1].base_config(), 132);
      persistent.resize(std::min<std::size_t>(persistent.size(), gemv_lowering_persistent_shapes));
      // With x normalized as it is loaded (the RMSNorm prologue) only the stage-blocks partition, whose
      // phases are the stage kernels' blocks, prologue included; it comes first either way, at one
      // activation row (more rows spill under its register bounds: these graphs have 5, the warp pieces).
      ASSERT_FALSE(persistent.empty()) << test_case.what;
      const bool one_row = lowered.stages[0].base_config().rows == 1;
      for (const PersistentMlpConfig& config : persistent) {
        const bool stage_blocks = config.partition == PersistentPartition::stage_blocks;
        EXPECT_TRUE(one_row ? persistent.front().partition == PersistentPartition::stage_blocks : !stage_blocks)
            << test_case.what << ": " << config.to_string();
      }
      if (lowered.stages[0].norm_weight >= 0) {
        for (const PersistentMlpConfig& config : persistent) {
          EXPECT_EQ(config.partition, PersistentPartition::stage_blocks) << test_case.what;
          EXPECT_TRUE(config.gate_up.x_rms_norm_eps.has_value()) << test_case.what;
        }
      }
    }
    ASSERT_EQ(candidates.candidates.size(), expected + persistent.size()) << test_case.what;
    for (std::size_t p = 0; p < persistent.size(); ++p) {
      const FusedCandidate& candidate = candidates.candidates[expected + p];
      EXPECT_EQ(candidate.source, generate_persistent_mlp_kernel(persistent[p]).source) << test_case.what;
      EXPECT_EQ(candidate.launches, 1);
      EXPECT_EQ(candidate.id.name(), "fused gemv " + persistent[p].shape_name());
    }
    const std::size_t last = stage_kernels.back().size();
    for (std::size_t c = 0; c < expected; ++c) {
      std::string source = stage_kernels.size() == 2 ? stage_kernels[0][c / last].source : "";
      source += stage_kernels.back()[c % last].source;
      EXPECT_EQ(candidates.candidates[c].source, source) << test_case.what << " candidate " << c;
      EXPECT_EQ(candidates.candidates[c].launches, static_cast<int>(stage_kernels.size()));
      EXPECT_EQ(candidates.candidates[c].id.name().rfind("fused gemv ", 0), 0u) << candidates.candidates[c].id.name();
    }
    // The best-guess shape of each stage (the first) of every case compiles (all shapes: gemv_compile_tests).
    for (const auto& kernels : stage_kernels) {
      compiles.push_back(std::async(std::launch::async, [kernel = kernels.front(), what = test_case.what] {
        CompileOptions options;
        options.architecture = "sm_90";
        try {
          const CompiledProgram program = compile_cuda_program(kernel.source, kernel.kernel_name, options);
          return program.cubin.empty() ? what + ": empty cubin" : std::string();
        } catch (const CudaError& error) {
          return what + ": " + error.what();
        }
      }));
    }
  }
  for (auto& compiled : compiles) EXPECT_EQ(compiled.get(), "");
}

// Sibling contractions (q, k, v) lower to one GEMV whose matrix stacks the parts by role (the
// graph's value names say nothing), each part writing its own value after its bias; every shape
// the lowering offers writes the parts as split outputs, and the streamed and split-K mainloops
// (which store through the same function) compile with them too.
TEST(GemvLowering, SiblingsAreOneGemvOverTheirStackedWeights) {
  for (int bits : {16, 4, 8}) {
    for (std::int64_t rows : {1, 16}) {
      const std::string where = fmt::format("bits {} M {}", bits, rows);
      const ComputeGraph graph =
          testing::sibling_test_graph(rows, {96, 32, 32}, 128, {bits, 64, DType::bf16}, {true, false, true});
      const FusionPlan plan = plan_graph_fusion(graph);
      const FusionRegion* region = region_of_rule(plan, "sibling_contractions");
      ASSERT_NE(region, nullptr) << plan.explain();
      const GemvRegionPlan lowered = plan_gemv_region(*plan.graph, *region);
      ASSERT_TRUE(lowered.decision) << where << ": " << lowered.decision.reason;
      ASSERT_EQ(lowered.stages.size(), 1u);
      const GemvStage& stage = lowered.stages[0];
      const ComputeGraph& g = *plan.graph;
      EXPECT_EQ(value_name(g, stage.input), "a");
      ASSERT_EQ(stage.row_parts.size(), 3u);
      const std::string weight = bits == 16 ? ".w" : ".q";
      const std::vector<std::string> outputs = {"y0", "p1", "y2"};
      const std::vector<std::string> biases = {"c0", "-", "c2"};
      for (std::size_t p = 0; p < 3; ++p) {
        const GemvRowPart& part = stage.row_parts[p];
        EXPECT_EQ(value_name(g, part.matrix.weight), fmt::format("p{}{}", p, weight)) << where;
        EXPECT_EQ(value_name(g, part.matrix.scales), bits == 16 ? "-" : fmt::format("p{}.s", p)) << where;
        EXPECT_EQ(value_name(g, part.bias), biases[p]) << where;
        EXPECT_EQ(value_name(g, part.output), outputs[p]) << where;
      }
      ASSERT_EQ(stage.matrices.size(), 1u);
      EXPECT_EQ(stage.matrices[0].out_features, 160);
      EXPECT_EQ(stage.matrices[0].weight, -1) << "the stacked matrix is no value of the graph";
      // The product is a graph value (bf16) before the bias is added.
      expect_epilogue(stage.epilogue, [](double a, double, double t) { return bf16(a) + t; }, where);
      EXPECT_EQ(stage.epilogue.to_string(), "(bf16(acc0) + bias[n])") << where;
      const GemvKernelConfig base = stage.base_config();
      EXPECT_EQ(base.output_splits, (std::vector<std::int64_t>{96, 32, 32}));
      const Lowered candidates = gemv_region_candidates(g, *region);
      ASSERT_TRUE(candidates.decision) << candidates.decision.reason;
      for (const FusedCandidate& candidate : candidates.candidates) {
        EXPECT_EQ(candidate.launches, 1) << "three launches become one";
        EXPECT_NE(candidate.source.find("u16* __restrict__ out2"), std::string::npos) << candidate.id.name();
      }
    }
  }
  // Mismatched splits and per-row tensors are refused by the config.
  GemvKernelConfig config;
  config.format = GemvWeightFormat::dense(DType::bf16);
  config.out_features = 64;
  config.in_features = 128;
  config.output_splits = {32, 16};
  EXPECT_THROW(config.validate(), InputError);
  config.output_splits = {32, 32};
  config.epilogue = GemvEpilogue::residual_add();
  EXPECT_THROW(config.validate(), InputError);
  config.epilogue = GemvEpilogue::add(GemvEpilogue::accumulator(0), GemvEpilogue::tensor("bias", true));
  EXPECT_NO_THROW(config.validate());

  // Streamed and split-K kernels with split outputs and the bias compile for sm_90.
  std::vector<GemvKernelConfig> shapes;
  GemvKernelConfig streamed = config;
  streamed.format = GemvWeightFormat::affine(4, 64, DType::bf16);
  streamed.rows = 16;
  streamed.mainloop = GemvMainloop::streamed;
  shapes.push_back(streamed);
  GemvKernelConfig split = config;
  split.rows = 3;
  split.in_features = 4096;
  split.k_splits = 4;
  shapes.push_back(split);
  std::vector<std::future<std::string>> compiles;
  for (const GemvKernelConfig& shape : shapes) {
    compiles.push_back(std::async(std::launch::async, [kernel = generate_gemv_kernel(shape), what = shape.to_string()] {
      CompileOptions options;
      options.architecture = "sm_90";
      try {
        return compile_cuda_program(kernel.source, kernel.kernel_name, options).cubin.empty() ? what + ": empty cubin"
                                                                                              : std::string();
      } catch (const CudaError& error) {
        return what + ": " + error.what();
      }
    }));
  }
  for (auto& compiled : compiles) EXPECT_EQ(compiled.get(), "");
}

// The joined q/k/v + rope + cache region lowers to the stacked GEMV with the rope epilogue: its
// parts' roles, the rope's heads and cache, the values the kernel writes (q rotated and the caches,
// not q, k and v); its candidates are the one-kernel shapes and, from lower_region, each stacked
// GEMV followed by the rope kernel. A region without its two parts is refused with why.
TEST(GemvLowering, QkvWithRopeAndCacheWritesIsOneGemvWithTheRopeEpilogue) {
  for (bool bias : {false, true}) {
    testing::AttentionInputsShape shape;
    shape.rows = bias ? 16 : 1, shape.bias = bias, shape.llama3_scaling = !bias;
    shape.format = {bias ? 16 : 4, 64, DType::bf16};
    const ComputeGraph graph = testing::attention_inputs_test_graph(shape);
    const FusionPlan plan = plan_graph_fusion(graph);
    ASSERT_EQ(plan.regions.size(), 1u) << plan.explain();
    const FusionRegion& region = plan.regions.front();
    const GemvRegionPlan lowered = plan_gemv_region(*plan.graph, region);
    ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
    ASSERT_EQ(lowered.stages.size(), 1u);
    const GemvStage& stage = lowered.stages.front();
    const ComputeGraph& g = *plan.graph;
    ASSERT_TRUE(stage.rope_cache.has_value());
    EXPECT_EQ(stage.rope_cache->q_heads, 4);
    EXPECT_EQ(stage.rope_cache->kv_heads, 2);
    EXPECT_EQ(stage.rope_cache->head_dim, 64);
    EXPECT_EQ(stage.rope_cache->capacity, 32);
    EXPECT_EQ(stage.rope_cache->rope, g.node(*g.find_node("q.rope")).attributes);
    // The positions and the biases are graph inputs: the epilogue may read them before the wait.
    EXPECT_TRUE(stage.rope_cache->inputs_before_wait);
    EXPECT_EQ(value_name(g, stage.rope_values.positions), "positions");
    EXPECT_EQ(value_name(g, stage.rope_values.q_rotated), "q.rope");
    EXPECT_EQ(value_name(g, stage.rope_values.k_cache_out), "k_cache_out");
    EXPECT_EQ(value_name(g, stage.rope_values.v_cache), "v_cache");
    EXPECT_EQ(stage.nodes.size(), region.nodes.size());
    const GemvKernelConfig base = stage.base_config();
    EXPECT_EQ(base.output_splits, (std::vector<std::int64_t>{256, 128, 128}));
    EXPECT_TRUE(base.rope_cache.has_value());
    const RegionLowerings all = lower_region(g, region, std::span<const RegionLowering>{});
    int one_kernel = 0, two_kernels = 0, a_part_native = 0;
    std::set<std::string> variants;
    for (const FusedCandidate& candidate : all.candidates) variants.insert(candidate.id.variant);
    for (const FusedCandidate& candidate : all.candidates) {
      const bool joined = candidate.launches == 1;
      one_kernel += joined;
      two_kernels += candidate.launches == 2 && candidate.id.variant.ends_with(", then rope kv cache");
      // Each part also runs natively beside the other's first candidate.
      a_part_native += candidate.id.variant.starts_with("native, then ") || candidate.id.variant.ends_with(", then native");
      // Every one-kernel shape races its own two kernels (the streamed stacked GEMVs have no rope
      // epilogue: they race as two kernels only).
      if (joined) {
        EXPECT_TRUE(variants.contains(candidate.id.variant + ", then rope kv cache")) << candidate.id.name();
      }
      EXPECT_EQ(candidate.source.find("metile_rope_rotate(") != std::string::npos, true) << candidate.id.name();
      EXPECT_EQ(candidate.source.find("constexpr bool kRopeCache = true;") != std::string::npos, joined)
          << candidate.id.name();
    }
    EXPECT_GE(one_kernel, 2);
    EXPECT_GT(two_kernels, one_kernel);
    EXPECT_TRUE(variants.contains("native, then rope kv cache")) << all.refusals;
    EXPECT_EQ(a_part_native, 2);
    EXPECT_EQ(static_cast<int>(all.candidates.size()), one_kernel + two_kernels + a_part_native);
  }
  testing::AttentionInputsShape shape;
  const ComputeGraph graph = testing::attention_inputs_test_graph(shape);
  const FusionPlan plan = plan_graph_fusion(graph);
  FusionRegion no_parts = plan.regions.front();
  no_parts.parts.clear();
  const GemvRegionPlan refused = plan_gemv_region(*plan.graph, no_parts);
  EXPECT_FALSE(refused.decision);
  EXPECT_NE(refused.decision.reason.find("0 parts"), std::string::npos) << refused.decision.reason;
}

// What a stacked GEMV reads: stack_rows of the parts' codes, scales and biases dequantizes to the
// parts' own dequantized rows, one after another (checked against each part dequantized alone).
TEST(GemvLowering, StackedAffineMatricesDequantizeToTheirPartsRows) {
  const std::uint64_t seed = testing::test_seed("stacked affine");
  std::mt19937_64 random(seed);
  for (int bits : {4, 8}) {
    const AffineQuantization format{bits, 64};
    std::vector<QuantizedMatrix> parts;
    std::vector<HostTensor> codes, scales, biases;
    for (std::int64_t rows : {48, 16, 16}) {
      std::vector<double> values(static_cast<std::size_t>(rows * 128));
      std::uniform_real_distribution<double> uniform(-1, 1);
      for (double& value : values) value = uniform(random);
      parts.push_back(quantize_affine(HostTensor::from_values(TensorSpec({rows, 128}, DType::f32), values), format, DType::bf16));
      codes.push_back(parts.back().packed);
      scales.push_back(parts.back().scales);
      biases.push_back(parts.back().biases);
    }
    const QuantizedMatrix stacked =
        QuantizedMatrix::from_tensors(format, stack_rows(codes), stack_rows(scales), stack_rows(biases));
    const HostTensor whole = dequantize_affine(stacked, DType::f32);
    std::vector<HostTensor> dequantized;
    for (const QuantizedMatrix& part : parts) dequantized.push_back(dequantize_affine(part, DType::f32));
    // The parts' rows one after another, in order, checked without stack_rows (the function under test).
    ASSERT_EQ(whole.spec(), TensorSpec({48 + 16 + 16, 128}, DType::f32));
    std::size_t at = 0;
    for (std::size_t part = 0; part < dequantized.size(); ++part) {
      const std::span<const std::byte> expected = dequantized[part].bytes();
      EXPECT_TRUE(std::equal(expected.begin(), expected.end(), whole.bytes().begin() + static_cast<std::ptrdiff_t>(at)))
          << "bits " << bits << " part " << part;
      at += expected.size();
    }
    // And the repacked layout round-trips the stacked matrix exactly.
    const QuantizedMatrix back = unpack_from_gemv(repack_for_gemv(stacked));
    EXPECT_EQ(back.packed, stacked.packed);
    EXPECT_EQ(back.scales, stacked.scales);
    EXPECT_EQ(back.biases, stacked.biases);
  }
  EXPECT_THROW(stack_rows({}), InputError);
  const HostTensor a(TensorSpec({2, 4}, DType::bf16));
  const HostTensor b(TensorSpec({2, 5}, DType::bf16));
  EXPECT_THROW(stack_rows(std::vector<HostTensor>{a, b}), InputError);
}

}  // namespace
}  // namespace metile
