// Every fused row region, in every tuning variant, matches the CPU reference on fresh random
// inputs: the seed's residual add + RMSNorm at decode and prefill sizes and at lengths that are
// not multiples of the vector width, softmax after scale and causal mask, layer_norm after an
// elementwise prologue, an elementwise chain with two outputs, and rows too long for registers.
#include <gtest/gtest.h>

#include <optional>
#include <random>

#include "gpu_test_support.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing_support::CudaDeviceTest;
using testing_support::expect_outputs_match;

class FusedRegions : public CudaDeviceTest {
 protected:
  void SetUp() override {
    CudaDeviceTest::SetUp();
    if (!IsSkipped()) stream_.emplace();
  }

  // Runs every variant of the whole-graph region and gates it; returns how many variants ran.
  int check_every_variant(const ComputeGraph& graph, const std::string& what) {
    FusionRegion region;
    region.rule = "test";
    for (const Node& node : graph.nodes()) region.nodes.push_back(node.id);
    region.inputs = graph.inputs();
    region.outputs = graph.outputs();
    const std::uint64_t seed = next_seed();
    const TensorMap inputs = random_inputs(graph, seed);
    const TensorMap reference = run_reference(graph, inputs);
    DeviceValues values(graph);
    values.upload_inputs(inputs);
    int variants = 0;
    for (const RowKernelOptions& options : row_kernel_variants(graph, region)) {
      const GeneratedKernel kernel = generate_region_kernel(graph, region, options);
      const DeviceStep step = bind_kernel(load_generated_kernel(kernel), values);
      values.poison_computed_values();
      step(*stream_);
      stream_->synchronize();
      const double error = expect_outputs_match(graph, values.download_outputs(), reference,
                                                fmt::format("{} [{}] seed {}", what, kernel.summary, seed));
      std::printf("  %-44s %-80s rel L2 %.2e\n", what.c_str(), kernel.summary.c_str(), error);
      ++variants;
    }
    return variants;
  }

  std::optional<CudaStream> stream_;  // made once the device is open
};

using metile::testing::seed_graph;

TEST_F(FusedRegions, ResidualAddRmsNorm) {
  struct Case {
    std::int64_t rows, length;
    DType dtype;
  };
  const Case cases[] = {{1, 2048, DType::f16},  {1, 4096, DType::bf16}, {512, 4096, DType::bf16}, {3, 2050, DType::f16},
                        {1, 2051, DType::bf16}, {33, 8, DType::f32},    {5, 24, DType::f16},      {2, 70001, DType::f32},
                        {4, 300000, DType::bf16}};
  for (const Case& c : cases) {
    EXPECT_GE(check_every_variant(seed_graph(c.rows, c.length, c.dtype),
                                  fmt::format("add+rms_norm {}x{} {}", c.rows, c.length, dtype_name(c.dtype))),
              1);
  }
}

TEST_F(FusedRegions, ScaledMaskedSoftmax) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (std::int64_t length : {33, 128, 1031}) {
      GraphBuilder builder;
      auto scores = builder.input("scores", {{2, 3, length, length}, dtype});
      auto masked = builder.causal_mask(builder.scale(scores, 0.125, "scaled"), 0, "masked");
      const ComputeGraph graph = builder.build({builder.softmax(masked, -1, "probabilities")});
      check_every_variant(graph, fmt::format("scale+mask+softmax {} {}", length, dtype_name(dtype)));
    }
  }
  GraphBuilder builder;
  auto logits = builder.input("logits", {{3, 150000}, DType::f32});
  check_every_variant(builder.build({builder.softmax(builder.scale(logits, 2.0, "sharpened"), -1, "probabilities")}),
                      "long-row softmax 150000 f32");
}

TEST_F(FusedRegions, LayerNormAfterElementwisePrologue) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (std::int64_t length : {768, 1000, 5}) {
      GraphBuilder builder;
      auto x = builder.input("x", {{9, length}, dtype});
      auto gamma = builder.input("gamma", {{length}, dtype});
      auto beta = builder.input("beta", {{length}, dtype});
      auto shifted = builder.add(builder.multiply(x, gamma, "scaled"), beta, "shifted");
      const ComputeGraph graph = builder.build({shifted, builder.layer_norm(shifted, gamma, beta, 1e-5, "normalized")});
      check_every_variant(graph, fmt::format("mul+add+layer_norm {} {}", length, dtype_name(dtype)));
    }
  }
}

TEST_F(FusedRegions, ElementwiseChainWithTwoOutputs) {
  for (DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (std::int64_t length : {14336, 1003}) {
      GraphBuilder builder;
      auto gate = builder.input("gate", {{4, length}, dtype});
      auto up = builder.input("up", {{4, length}, dtype});
      auto hidden = builder.multiply(builder.silu(gate, "activated"), up, "hidden");
      auto smoothed = builder.exp(builder.scale(builder.gelu(hidden, "none", "gelu"), -0.5, "halved"), "decayed");
      const ComputeGraph graph = builder.build({hidden, builder.cast(smoothed, DType::f32, "widened")});
      check_every_variant(graph, fmt::format("silu*up->gelu->scale->exp->cast {} {}", length, dtype_name(dtype)));
    }
  }
}

TEST_F(FusedRegions, BroadcastTablesOverRows) {
  // A [S, H] table (e.g. position embeddings) added to [B, S, H] rows, then RMSNorm.
  GraphBuilder builder;
  auto x = builder.input("x", {{3, 5, 256}, DType::bf16});
  auto table = builder.input("table", {{5, 256}, DType::bf16});
  auto weight = builder.input("weight", {{256}, DType::bf16});
  auto summed = builder.add(x, table, "summed");
  check_every_variant(builder.build({builder.rms_norm(summed, weight, 1e-6, "normalized")}), "add [S,H] table + rms_norm");
}

}  // namespace
}  // namespace metile
