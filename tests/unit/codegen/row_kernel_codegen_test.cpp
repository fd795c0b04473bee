// The row-kernel generator: structure of the seed's fused kernel, vector widths and block shapes
// chosen from the row length, rejection of regions it cannot lower, and that every variant
// compiles with NVRTC for sm_90.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "codegen_test_support.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing_support::count_occurrences;
using testing_support::expect_compiles_for_sm90;
using testing_support::kernel_body;
using testing_support::whole_graph_region;

using metile::testing::seed_graph;

TEST(RowKernelCodegen, SeedRegionIsOneKernelWithTwoStoresAndOneReduction) {
  const ComputeGraph graph = seed_graph(1, 2048, DType::f16);
  const GeneratedKernel kernel = generate_region_kernel(graph, whole_graph_region(graph, "residual_add_rms_norm"));
  const std::string body = kernel_body(kernel);
  EXPECT_EQ(count_occurrences(body, "store_vector<__half"), 2) << body;
  EXPECT_EQ(count_occurrences(body, "row_reduce<"), 1) << body;
  EXPECT_EQ(count_occurrences(body, "load_vector<__half"), 3) << body;
  EXPECT_NE(kernel.source.find("summed = add(values, residual)"), std::string::npos);
  EXPECT_NE(kernel.source.find("normalized = rms_norm(summed, weight)"), std::string::npos);
  EXPECT_NE(kernel.source.find("rule 'residual_add_rms_norm'"), std::string::npos);
  EXPECT_NE(body.find("constexpr int kVec = 8;"), std::string::npos) << "16-byte vectors of f16";
  EXPECT_NE(kernel.source.find("(row held in registers)"), std::string::npos);
  ASSERT_EQ(kernel.parameters.size(), 5u);
  const char* expected_names[] = {"values", "residual", "weight", "summed", "normalized"};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(graph.value(kernel.parameters[i].value).name, expected_names[i]);
    EXPECT_EQ(kernel.parameters[i].kind, i < 3 ? KernelParameter::Kind::input : KernelParameter::Kind::output);
  }
  EXPECT_EQ(kernel.launch.grid_x, 1u);
  EXPECT_EQ(kernel.launch.block_x, 64u) << "2048 f16 = 256 vectors, 4 per thread";
  expect_compiles_for_sm90(kernel);
}

// A grid past CUDA's 2^31 - 1 blocks is refused: the block count was cast to 32 bits, and 2^40 rows
// (within the graph's 2^48 elements) launched 0 blocks; 2^20 rows still lower.
TEST(RowKernelCodegen, AGridPastCudasLimitIsRefused) {
  const ComputeGraph huge = seed_graph(std::int64_t{1} << 40, 16, DType::f16);
  const std::string error = testing::error_of([&] { (void)generate_region_kernel(huge, whole_graph_region(huge, "residual_add_rms_norm")); });
  EXPECT_NE(error.find("rows take"), std::string::npos) << error;
  EXPECT_NE(error.find("past CUDA's 2^31 - 1"), std::string::npos) << error;
  const ComputeGraph fine = seed_graph(std::int64_t{1} << 20, 16, DType::f16);
  EXPECT_GT(generate_region_kernel(fine, whole_graph_region(fine, "residual_add_rms_norm")).launch.grid_x, 0u);
}

// Rows of length 1 with a row reduction and a reader of its result: the decision refuses (it threw
// std::out_of_range, the reader's operand never stored); one such node alone still lowers.
TEST(RowKernelCodegen, RowsOfLengthOneWithAReductionAreRefused) {
  GraphBuilder builder;
  auto x = builder.input("x", {{4, 1}, DType::f32});
  auto mean = builder.mean(x, "m");
  auto y = builder.silu(mean, "y");
  const ComputeGraph graph = builder.build({y});
  Decision decision;
  ASSERT_NO_THROW(decision = row_region_decision(graph, whole_graph_region(graph)));
  EXPECT_FALSE(decision);
  EXPECT_NE(decision.reason.find("rows of length 1"), std::string::npos) << decision.reason;
  EXPECT_THROW((void)generate_region_kernel(graph, whole_graph_region(graph)), InputError);
  EXPECT_TRUE(row_region_decision(graph, single_node_region(graph, graph.value(mean.id).producer)));
  EXPECT_TRUE(row_region_decision(graph, single_node_region(graph, graph.value(y.id).producer)));
}

// A softmax over another axis than the last has no GPU kernel: the refusal says so (it said "a layout
// op, not a row op", the kind the op table gives such a softmax).
TEST(RowKernelCodegen, SoftmaxOverAnotherAxisIsRefusedByName) {
  GraphBuilder builder;
  auto x = builder.input("x", {{7, 33}, DType::f16});
  auto s = builder.softmax(x, 0, "s");
  const ComputeGraph graph = builder.build({s});
  const Decision decision = row_region_decision(graph, whole_graph_region(graph));
  EXPECT_FALSE(decision);
  EXPECT_EQ(decision.reason, "node 's' (softmax) reduces axis 0 of f16[7, 33], not the last: no GPU kernel reduces another axis");
}

TEST(RowKernelCodegen, VectorWidthFollowsRowLengthAndAlignment) {
  struct Case {
    std::int64_t rows, length;
    DType dtype;
    int vector_width;
  };
  const Case cases[] = {
      {4, 2048, DType::f16, 8},  {4, 2050, DType::f16, 2},  {4, 2051, DType::bf16, 1},
      {1, 2051, DType::bf16, 8},  // one row starts aligned: full vectors and a scalar tail
      {3, 1000, DType::f32, 4},  {3, 1002, DType::f32, 2},
  };
  for (const Case& c : cases) {
    const ComputeGraph graph = seed_graph(c.rows, c.length, c.dtype);
    const GeneratedKernel kernel = generate_region_kernel(graph, whole_graph_region(graph));
    EXPECT_NE(kernel.source.find("constexpr int kVec = " + std::to_string(c.vector_width) + ";"), std::string::npos)
        << c.rows << "x" << c.length << " " << dtype_name(c.dtype) << ": " << kernel.summary;
    expect_compiles_for_sm90(kernel);
  }
}

TEST(RowKernelCodegen, BlockShapeFollowsRowLength) {
  // Short rows: a few threads per row and many rows per block; long rows: a block per row.
  const GeneratedKernel short_rows = generate_region_kernel(seed_graph(1000, 32, DType::f16),
                                                            whole_graph_region(seed_graph(1000, 32, DType::f16)));
  EXPECT_NE(short_rows.source.find("constexpr int kThreadsPerRow = 1;"), std::string::npos) << short_rows.summary;
  EXPECT_EQ(short_rows.launch.block_x, 128u);
  EXPECT_EQ(short_rows.launch.grid_x, 1000u / 128u + 1u);
  const ComputeGraph long_graph = seed_graph(512, 4096, DType::bf16);
  const GeneratedKernel long_rows = generate_region_kernel(long_graph, whole_graph_region(long_graph));
  EXPECT_NE(long_rows.source.find("constexpr int kThreadsPerRow = 128;"), std::string::npos) << long_rows.summary;
  EXPECT_EQ(long_rows.launch.grid_x, 512u);
  EXPECT_NE(long_rows.source.find("__shared__ double reduction_scratch"), std::string::npos);
}

TEST(RowKernelCodegen, VeryLongRowsStreamInTiles) {
  GraphBuilder builder;
  auto x = builder.input("x", {{2, 300000}, DType::f32});
  auto y = builder.softmax(builder.scale(x, 0.125, "scaled"), -1, "probabilities");
  const ComputeGraph graph = builder.build({y});
  const GeneratedKernel kernel = generate_region_kernel(graph, whole_graph_region(graph));
  EXPECT_NE(kernel.source.find("(streamed)"), std::string::npos) << kernel.summary;
  EXPECT_NE(kernel.source.find("for (int tile = 0; tile < kTiles; ++tile)"), std::string::npos);
  EXPECT_EQ(count_occurrences(kernel_body(kernel), "row_reduce<"), 2);
  expect_compiles_for_sm90(kernel);
}

// layer_norm's statistics are f64 sums and f64 scalars (its centring on an f32 mean moved rows far from
// zero; the GPU test LayerNormOfRowsFarFromZeroMatchesTheReference runs them), rms_norm's stay f32;
// both paths (registers, streamed) and a block-wide reduction compile.
TEST(RowKernelCodegen, LayerNormTakesItsStatisticsInF64) {
  for (const std::int64_t length : {37, 4096, 300000}) {
    GraphBuilder builder;
    const TensorSpec row({length}, DType::bf16);
    auto x = builder.input("x", {{3, length}, DType::bf16});
    auto y = builder.layer_norm(x, builder.input("weight", row), builder.input("bias", row), 1e-5, "y");
    const ComputeGraph graph = builder.build({y});
    const GeneratedKernel kernel = generate_region_kernel(graph, whole_graph_region(graph));
    const std::string body = kernel_body(kernel);
    EXPECT_EQ(count_occurrences(body, "row_reduce<metile_device::SumF64Op"), 2) << kernel.summary;
    EXPECT_EQ(count_occurrences(body, "row_reduce<metile_device::SumOp"), 0) << kernel.summary;
    EXPECT_NE(body.find("1.0 / sqrt("), std::string::npos) << body;
    EXPECT_NE(body.find("__fmul_rn(static_cast<float>("), std::string::npos) << body;
    expect_compiles_for_sm90(kernel);
  }
  const ComputeGraph rms = seed_graph(3, 4096, DType::bf16);
  EXPECT_EQ(count_occurrences(kernel_body(generate_region_kernel(rms, whole_graph_region(rms))), "SumF64Op"), 0);
}

TEST(RowKernelCodegen, VariantsAreDistinctAndCompile) {
  const ComputeGraph graph = seed_graph(1, 4096, DType::bf16);
  const FusionRegion region = whole_graph_region(graph);
  const std::vector<RowKernelOptions> variants = row_kernel_variants(graph, region);
  ASSERT_GE(variants.size(), 2u);
  EXPECT_EQ(variants.front(), RowKernelOptions{});
  std::set<std::string> sources;
  for (const RowKernelOptions& options : variants) {
    const GeneratedKernel kernel = generate_region_kernel(graph, region, options);
    EXPECT_TRUE(sources.insert(kernel.source).second) << kernel.summary;
    expect_compiles_for_sm90(kernel);
  }
}

TEST(RowKernelCodegen, LargeRegionsGetAStreamingHintVariant) {
  const ComputeGraph small = seed_graph(512, 4096, DType::bf16);
  for (const RowKernelOptions& options : row_kernel_variants(small, whole_graph_region(small))) {
    EXPECT_FALSE(options.streaming_cache_hints) << "16 MiB stays in L2: no evict-first variant";
  }
  const ComputeGraph large = seed_graph(8192, 8192, DType::bf16);
  const std::vector<RowKernelOptions> variants = row_kernel_variants(large, whole_graph_region(large));
  ASSERT_TRUE(variants.back().streaming_cache_hints);
  const GeneratedKernel kernel = generate_region_kernel(large, whole_graph_region(large), variants.back());
  EXPECT_NE(kernel.source.find("constexpr bool kStream = true;"), std::string::npos);
  EXPECT_NE(kernel.summary.find("evict-first"), std::string::npos) << kernel.summary;
  // The weight is reused by every row, so it is read without the hint.
  EXPECT_NE(kernel.source.find("load_vector<__nv_bfloat16, kVec, kRowLength, false>(in2_row"), std::string::npos);
  expect_compiles_for_sm90(kernel);
}

TEST(RowKernelCodegen, FusedRegionsOfEveryRowReductionCompile) {
  // layer_norm after a broadcast multiply and add; softmax after scale and a causal mask;
  // an elementwise chain (silu(gate) * up, cast) writing two outputs.
  {
    GraphBuilder builder;
    auto x = builder.input("x", {{6, 37}, DType::f16});
    auto gamma = builder.input("gamma", {{37}, DType::f16});
    auto beta = builder.input("beta", {{37}, DType::f16});
    auto shifted = builder.add(builder.multiply(x, gamma, "scaled_x"), beta, "shifted");
    auto normalized = builder.layer_norm(shifted, gamma, beta, 1e-5, "normalized");
    const ComputeGraph graph = builder.build({normalized});
    const GeneratedKernel kernel = generate_region_kernel(graph, whole_graph_region(graph));
    EXPECT_EQ(count_occurrences(kernel_body(kernel), "row_reduce<"), 2) << "mean, then centered variance";
    expect_compiles_for_sm90(kernel);
  }
  {
    GraphBuilder builder;
    auto scores = builder.input("scores", {{2, 3, 17, 17}, DType::bf16});
    auto masked = builder.causal_mask(builder.scale(scores, 0.25, "scaled"), 0, "masked");
    auto probabilities = builder.softmax(masked, -1, "probabilities");
    const ComputeGraph graph = builder.build({probabilities});
    const GeneratedKernel kernel = generate_region_kernel(graph, whole_graph_region(graph));
    EXPECT_NE(kernel.source.find("row % 17LL"), std::string::npos) << "the query index of a [.., 17, 17] mask";
    EXPECT_EQ(count_occurrences(kernel_body(kernel), "row_reduce<metile_device::MaxOp"), 1);
    expect_compiles_for_sm90(kernel);
  }
  {
    GraphBuilder builder;
    auto gate = builder.input("gate", {{3, 1000}, DType::bf16});
    auto up = builder.input("up", {{3, 1000}, DType::bf16});
    auto activated = builder.silu(gate, "activated");
    auto hidden = builder.multiply(activated, up, "hidden");
    auto widened = builder.cast(builder.gelu(hidden, "tanh", "smoothed"), DType::f32, "widened");
    const ComputeGraph graph = builder.build({hidden, widened});
    const GeneratedKernel kernel = generate_region_kernel(graph, whole_graph_region(graph));
    const std::string body = kernel_body(kernel);
    EXPECT_EQ(count_occurrences(body, "store_vector<"), 2);
    EXPECT_EQ(count_occurrences(body, "row_reduce<"), 0);
    EXPECT_NE(body.find("constexpr int kVec = 4;"), std::string::npos) << "the f32 output sets 16-byte vectors of 4";
    expect_compiles_for_sm90(kernel);
  }
}

TEST(RowKernelCodegen, RejectsRegionsThatAreNotRowRegions) {
  GraphBuilder builder;
  auto x = builder.input("x", {{4, 64}, DType::f16});
  auto w = builder.input("w", {{64, 32}, DType::f16});
  auto projected = builder.matmul(x, w, false, "projected");
  auto activated = builder.silu(projected, "activated");
  const ComputeGraph graph = builder.build({activated});
  Decision decision = row_region_decision(graph, whole_graph_region(graph));
  EXPECT_FALSE(decision.ok);
  EXPECT_NE(decision.reason.find("node 'projected' (matmul)"), std::string::npos) << decision.reason;
  EXPECT_THROW(generate_region_kernel(graph, whole_graph_region(graph)), InputError);
  EXPECT_THROW(generate_node_kernel(graph, 0), InputError);

  GraphBuilder other;
  auto y = other.input("y", {{4, 64}, DType::f16});
  auto reshaped = other.reshape(other.silu(y, "activated"), {8, 32}, "reshaped");
  const ComputeGraph mixed = other.build({reshaped});
  decision = row_region_decision(mixed, whole_graph_region(mixed));
  EXPECT_FALSE(decision.ok);
  EXPECT_NE(decision.reason.find("reshaped"), std::string::npos) << decision.reason;
}

TEST(RowKernelCodegen, RejectsBadTuningOptions) {
  const ComputeGraph graph = seed_graph(4, 256, DType::f32);
  EXPECT_THROW(generate_region_kernel(graph, whole_graph_region(graph), {48, 0, ""}), InputError);
  EXPECT_THROW(generate_region_kernel(graph, whole_graph_region(graph), {32, 64, ""}), InputError);
}

TEST(RowKernelCodegen, OnlineSoftmaxIsOnePassFromTheLaw) {
  // Registers (short rows), block-wide reduction through shared memory, and streamed tiles.
  for (const auto& [rows, length] : {std::pair<std::int64_t, std::int64_t>{64, 100}, {8, 4096}, {2, 300000}}) {
    GraphBuilder builder;
    auto x = builder.input("x", {{rows, length}, DType::bf16});
    const ComputeGraph graph = builder.build({builder.softmax(builder.scale(x, 0.125, "scaled"), -1, "probabilities")});
    const FusionRegion region = whole_graph_region(graph);
    const std::vector<RowKernelOptions> variants = row_kernel_variants(graph, region);
    ASSERT_TRUE(std::any_of(variants.begin(), variants.end(), [](const RowKernelOptions& o) { return o.online_softmax; }))
        << "softmax regions race the one-pass kernel";
    RowKernelOptions online;
    online.online_softmax = true;
    online.variant_name = "online";
    const GeneratedKernel two_pass = generate_region_kernel(graph, region);
    const GeneratedKernel one_pass = generate_region_kernel(graph, region, online);
    EXPECT_EQ(count_occurrences(kernel_body(two_pass), "row_reduce<"), 2) << two_pass.summary;
    EXPECT_EQ(count_occurrences(kernel_body(one_pass), "row_reduce<"), 1) << one_pass.summary;
    EXPECT_EQ(count_occurrences(kernel_body(one_pass), "row_reduce<metile_device::OnlineSoftmaxOp"), 1);
    // The merge is the law's: each side rescaled by exp(m_side - max(a.m, b.m)).
    EXPECT_NE(one_pass.source.find("State{fmaxf(a.m, b.m), ((a.l * expf(difference(a.m, fmaxf(a.m, b.m)))) + "
                                   "(b.l * expf(difference(b.m, fmaxf(a.m, b.m)))))}"),
              std::string::npos)
        << one_pass.source;
    EXPECT_NE(one_pass.summary.find("one-pass softmax"), std::string::npos);
    expect_compiles_for_sm90(one_pass);  // the two-pass kernels compile in the tests above
  }
}

}  // namespace
}  // namespace metile
