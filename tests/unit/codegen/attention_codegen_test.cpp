// The fused attention kernels (include/metile/attention.h) compile with NVRTC for sm_90 without a
// GPU, for both dtypes, head dimensions 64/128, every mask and both kernels, and ptxas keeps the
// fragments in registers (no spills). Also: the op's operand shapes become a problem (or a
// one-line error), the split covers every key, and configurations the kernels cannot take are refused.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <algorithm>
#include <future>
#include <optional>
#include <iostream>
#include <vector>

#include "metile/attention.h"
#include "metile/attention_runtime.h"
#include "metile/cuda_runtime.h"
#include "ptxas_report.h"

namespace metile {
namespace {

AttentionProblem problem_of(DType dtype, std::int64_t rows, std::int64_t keys, std::int64_t head_dim,
                            std::int64_t value_dim, AttentionMask mask) {
  AttentionProblem problem;
  problem.dtype = dtype;
  problem.heads = 3;
  problem.rows = rows;
  problem.keys = keys;
  problem.head_dim = head_dim;
  problem.value_dim = value_dim;
  problem.scale = 0.125;
  problem.mask = mask;
  problem.offset = mask == AttentionMask::causal ? keys - rows : 0;
  problem.position_count = mask == AttentionMask::positions ? (rows % 2 == 0 ? rows / 2 : rows) : 0;
  return problem;
}

// A decode launch over 1000 keys of problem_of's heads: a test case's fields (any struct with
// dtype, rows, head_dim, value_dim, mask and warps), the rest set by the caller.
template <class Case>
DecodeAttentionConfig decode_config_of(const Case& c) {
  DecodeAttentionConfig config;
  config.problem = problem_of(c.dtype, c.rows, 1000, c.head_dim, c.value_dim, c.mask);
  config.warps = c.warps;
  return config;
}

// ptxas -v's report within testing::expect_no_spills' bounds (tests/support/ptxas_report.h).
// The kernels compile in parallel (NVRTC needs no device), then each log is checked.
void expect_compile_without_spills(const std::vector<AttentionKernelSource>& kernels) {
  std::vector<std::future<CompiledProgram>> programs;
  for (const AttentionKernelSource& kernel : kernels) {
    programs.push_back(std::async(std::launch::async, [&kernel] {
      return testing::compile_for_sm90_with_ptxas_report(kernel.source, kernel.kernel_name);
    }));
  }
  for (std::size_t i = 0; i < kernels.size(); ++i) {
    const std::string& name = kernels[i].kernel_name;
    CompiledProgram program;
    try {
      program = programs[i].get();
    } catch (const CudaError& error) {
      ADD_FAILURE() << name << ": " << error.what();
      continue;
    }
    EXPECT_GT(program.cubin.size(), 0u);
    EXPECT_EQ(program.log.find("warning"), std::string::npos) << name << ":\n" << program.log;
    testing::expect_no_spills(program.log, name);
    const auto used = program.log.rfind("Used");
    std::cout << "[ptxas] " << name << ": " << program.log.substr(used == std::string::npos ? 0 : used) << "\n";
  }
}

TEST(AttentionCodegen, DecodeKernelsCompileForSm90) {
  // Every dtype, head dimension and mask is met at least once, with row counts on both sides of 8.
  const struct {
    DType dtype;
    std::int64_t rows, head_dim, value_dim;
    AttentionMask mask;
    int warps, stages;
    bool cluster;
    std::int64_t keys_per_split;  // 0: the default
    bool cache_before_wait = false;
  } cases[] = {
      {DType::bf16, 4, 128, 128, AttentionMask::none, 8, 0, false, 0},
      {DType::bf16, 16, 128, 128, AttentionMask::positions, 8, 3, false, 0},
      {DType::f16, 1, 64, 64, AttentionMask::causal, 4, 0, false, 0},
      {DType::f16, 12, 128, 64, AttentionMask::positions, 2, 0, false, 0},
      {DType::bf16, 7, 64, 128, AttentionMask::causal, 4, 4, false, 0},
      {DType::bf16, 4, 128, 128, AttentionMask::none, 4, 2, false, 0},
      // Clusters: Llama's 16 splits (non-portable size), 16 rows with the ring, 64-wide f16 with 8.
      {DType::bf16, 4, 128, 128, AttentionMask::positions, 8, 0, true, 64},
      {DType::bf16, 16, 128, 128, AttentionMask::causal, 8, 3, true, 64},
      {DType::f16, 3, 64, 64, AttentionMask::none, 4, 0, true, 128},
      // The model engine's decode: Llama-3.2-1B (4 rows of 64) and Qwen2.5-1.5B (6 rows of 128) as
      // the short-cache default (one 8-warp block per head), and Llama's previous default (4-warp
      // clusters of 8), which collapses to one split on the device at short contexts.
      {DType::bf16, 4, 64, 64, AttentionMask::positions, 8, 0, false, 1008},
      {DType::bf16, 6, 128, 128, AttentionMask::positions, 8, 0, false, 1008},
      {DType::bf16, 4, 64, 64, AttentionMask::positions, 4, 0, true, 128},
      // The same three with the positions and the cache below them read before the wait (the
      // flash_attention lowering's choice in a decode step), and Qwen's two-warp cluster default.
      {DType::bf16, 4, 64, 64, AttentionMask::positions, 8, 0, false, 1008, true},
      {DType::bf16, 6, 128, 128, AttentionMask::positions, 2, 0, true, 64, true},
      {DType::f16, 12, 128, 64, AttentionMask::positions, 8, 0, false, 0, true},
  };
  std::vector<AttentionKernelSource> kernels;
  for (const auto& c : cases) {
    DecodeAttentionConfig config = decode_config_of(c);
    config.stages = c.stages;
    config.cluster = c.cluster;
    config.keys_per_split = c.keys_per_split;
    config.cache_before_wait = c.cache_before_wait;
    const AttentionKernelSource kernel = generate_decode_attention_kernel(config);
    EXPECT_EQ(kernel.source.find("kCacheBeforeWait = true") != std::string::npos, c.cache_before_wait);
    EXPECT_GE(kernel.splits * kernel.keys_per_split, 1000);
    EXPECT_LT((kernel.splits - 1) * kernel.keys_per_split, 1000) << "an empty split";
    EXPECT_EQ(kernel.cluster, c.cluster);
    EXPECT_EQ(kernel.source.find("__cluster_dims__") != std::string::npos, c.cluster) << kernel.kernel_name;
    // Split 0's first step is loaded with the positions in the short-cache shapes only (and not
    // guessed where the positions are read before the wait).
    EXPECT_EQ(kernel.source.find("kSpeculate = true") != std::string::npos,
              c.stages == 0 && (kernel.splits == 1 || c.cluster) && !c.cache_before_wait)
        << kernel.kernel_name;
    kernels.push_back(kernel);
  }
  expect_compile_without_spills(kernels);
}

TEST(AttentionCodegen, PrefillKernelsCompileForSm90) {
  const struct {
    DType dtype;
    std::int64_t head_dim, value_dim;
    AttentionMask mask;
    int warps;
  } cases[] = {
      {DType::bf16, 128, 128, AttentionMask::causal, 4},
      {DType::f16, 64, 64, AttentionMask::none, 8},
      {DType::bf16, 128, 64, AttentionMask::positions, 8},
  };
  std::vector<AttentionKernelSource> kernels;
  for (const auto& c : cases) {
    PrefillAttentionConfig config;
    config.problem = problem_of(c.dtype, 300, 300, c.head_dim, c.value_dim, c.mask);
    config.warps = c.warps;
    const AttentionKernelSource kernel = generate_prefill_attention_kernel(config);
    EXPECT_EQ(kernel.launch.grid_x, static_cast<std::uint32_t>((300 + 16 * c.warps - 1) / (16 * c.warps)));
    EXPECT_EQ(kernel.launch.grid_y, 3u);
    kernels.push_back(kernel);
  }
  expect_compile_without_spills(kernels);
}

// grouped_query is the problem from_specs makes of a decoder's operands (scale 1/sqrt(D)).
TEST(AttentionCodegen, GroupedQueryIsTheDecodersProblem) {
  for (const AttentionMask mask : {AttentionMask::positions, AttentionMask::none}) {
    const AttentionProblem grouped = AttentionProblem::grouped_query(DType::f16, 8, 4, 3, 512, 64, mask);
    const std::optional<TensorSpec> positions =
        mask == AttentionMask::positions ? std::optional<TensorSpec>(TensorSpec({3}, DType::i32)) : std::nullopt;
    const AttentionProblem from = AttentionProblem::from_specs(
        TensorSpec({8, 12, 64}, DType::f16), TensorSpec({8, 512, 64}, DType::f16), TensorSpec({8, 512, 64}, DType::f16),
        positions, 0.125, attention_mask_name(mask));
    EXPECT_EQ(grouped.to_string(), from.to_string());
    EXPECT_EQ(grouped.scale, from.scale);
    EXPECT_EQ(grouped.position_count, from.position_count);
    EXPECT_EQ(grouped.value_dim, from.value_dim);
  }
}

TEST(AttentionCodegen, OperandShapesBecomeAProblem) {
  // GQA at Llama-3-8B shapes with a batch of 2: q [2, 8, 4·3, 128] over k, v [2, 8, 500, 128].
  const AttentionProblem problem = AttentionProblem::from_specs(
      TensorSpec({2, 8, 12, 128}, DType::bf16), TensorSpec({2, 8, 500, 128}, DType::bf16),
      TensorSpec({2, 8, 500, 64}, DType::bf16), TensorSpec({3}, DType::i32), 0.088, "positions");
  EXPECT_EQ(problem.heads, 16);
  EXPECT_EQ(problem.rows, 12);
  EXPECT_EQ(problem.keys, 500);
  EXPECT_EQ(problem.value_dim, 64);
  EXPECT_EQ(problem.position_count, 3);
  EXPECT_TRUE(problem.is_decode());
  EXPECT_EQ(problem.key_value_bytes(), 16 * 500 * (128 + 64) * 2);

  auto error_of = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const InputError& error) {
      return error.what();
    }
    return "";
  };
  const TensorSpec q({8, 4, 128}, DType::bf16), k({8, 64, 128}, DType::bf16);
  EXPECT_NE(error_of([&] { AttentionProblem::from_specs(q, TensorSpec({8, 64, 96}, DType::bf16), k, {}, 1, "none"); })
                .find("head dimension"),
            std::string::npos);
  EXPECT_NE(error_of([&] { AttentionProblem::from_specs(q, k, TensorSpec({8, 65, 128}, DType::bf16), {}, 1, "none"); })
                .find("keys"),
            std::string::npos);
  EXPECT_NE(error_of([&] { AttentionProblem::from_specs(q, k, k, {}, 1, "sliding"); }).find("mask 'sliding'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { AttentionProblem::from_specs(q, k, k, {}, 1, "positions"); }).find("positions i32"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              AttentionProblem::from_specs(q, k, k, TensorSpec({3}, DType::i32), 1, "positions");
            }).find("multiple of 3 positions"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              AttentionProblem::from_specs(TensorSpec({8, 4, 96}, DType::bf16), TensorSpec({8, 64, 96}, DType::bf16),
                                           TensorSpec({8, 64, 96}, DType::bf16), {}, 1, "none");
            }).find("head dimension 96"),
            std::string::npos);

  DecodeAttentionConfig decode;
  decode.problem = problem_of(DType::bf16, 17, 64, 128, 128, AttentionMask::none);
  EXPECT_NE(error_of([&] { generate_decode_attention_kernel(decode); }).find("17 rows"), std::string::npos);
  decode.problem.rows = 4;
  decode.stages = 4;  // 8 warps x 4 stages x 16 keys x 288 values ... > 227 KiB
  EXPECT_NE(error_of([&] { generate_decode_attention_kernel(decode); }).find("shared memory"), std::string::npos);
  decode.stages = 1;
  EXPECT_NE(error_of([&] { generate_decode_attention_kernel(decode); }).find("1 stages"), std::string::npos);
  decode.stages = 0;
  decode.keys_per_split = 24;
  EXPECT_NE(error_of([&] { generate_decode_attention_kernel(decode); }).find("multiple of 16"), std::string::npos);
  decode.problem.keys = 1000;
  decode.keys_per_split = 16;  // 63 splits of 16 keys: more than a cluster holds
  decode.cluster = true;
  EXPECT_NE(error_of([&] { generate_decode_attention_kernel(decode); }).find("63 splits in one cluster (at most 16)"),
            std::string::npos);
}

TEST(AttentionCodegen, DefaultSplitFillsTheMachine) {
  // Llama-3-8B decode: 8 KV heads. Long contexts split into one wave of blocks, a block per
  // multiprocessor; short ones stop at one 16-key step per warp.
  AttentionProblem problem = problem_of(DType::bf16, 4, 32768, 128, 128, AttentionMask::none);
  problem.heads = 8;
  const std::int64_t keys = decode_keys_per_split(problem, 8, 132);
  const std::int64_t splits = (32768 + keys - 1) / keys;
  EXPECT_EQ(keys % 16, 0);
  EXPECT_GE(splits * 8, 132 - 8);  // one wave, as full as the heads allow
  EXPECT_LE(splits * 8, 132);
  problem.keys = 100;
  EXPECT_EQ(decode_keys_per_split(problem, 4, 132), 64);  // 2 splits: a step per warp

  // A cluster holds a head's splits: at most 16 of them, however many multiprocessors there are.
  DecodeAttentionConfig config;
  config.problem = problem;
  config.problem.keys = 32768;
  config.cluster = true;
  EXPECT_EQ(decode_split_count(config), 16);
  config.problem.heads = 2;
  EXPECT_EQ(decode_split_count(config), 16);
  config.cluster = false;
  EXPECT_EQ(decode_split_count(config), 64);  // 66 blocks' worth, in 16-key steps: 64 splits of 512

  // The default shape: up to 512 keys, one 8-warp block per head (no split merge) where the
  // heads are 4 or more (8 here), two-warp clusters where they are fewer; clusters of 4-warp blocks
  // up to 4096 keys (measured), 8 warps and the global merge beyond.
  problem.keys = 512;
  problem.heads = kClusteredShortCacheHeads - 1;
  EXPECT_EQ(default_decode_shape(problem).warps, 2);
  EXPECT_TRUE(default_decode_shape(problem).cluster);
  EXPECT_FALSE(default_decode_shape(problem).one_split);
  problem.heads = kClusteredShortCacheHeads;
  EXPECT_EQ(default_decode_shape(problem).warps, 8);
  EXPECT_FALSE(default_decode_shape(problem).cluster);
  EXPECT_TRUE(default_decode_shape(problem).one_split);
  problem.heads = 8;
  problem.keys = 513;
  EXPECT_EQ(default_decode_shape(problem).warps, 4);
  EXPECT_TRUE(default_decode_shape(problem).cluster);
  EXPECT_FALSE(default_decode_shape(problem).one_split);
  problem.keys = 4096;
  EXPECT_TRUE(default_decode_shape(problem).cluster);
  problem.keys = 4097;
  EXPECT_EQ(default_decode_shape(problem).warps, 8);
  EXPECT_FALSE(default_decode_shape(problem).cluster);
  EXPECT_FALSE(default_decode_shape(problem).one_split);
}

}  // namespace
}  // namespace metile

namespace metile {
namespace {

// The configuration FlashAttention::build and the flash_attention lowering derive from the default
// shape (decode_attention_config, host side): a short cache over many heads is one 8-warp block per
// head whose split 0 loads its first step with the positions; over few heads, one-warp clusters;
// a longer one keeps the 4-warp cluster; an explicit shape is kept as asked.
TEST(AttentionCodegen, ShortCachesAreOneSplitPerHead) {
  AttentionProblem problem = problem_of(DType::bf16, 4, 500, 64, 64, AttentionMask::positions);
  problem.heads = 32;  // Llama-3.2-1B's 8 KV heads of 64, 4 query rows each, at a batch of 4
  DecodeAttentionConfig config = decode_attention_config(problem, {}, 132);
  EXPECT_EQ(config.warps, 8);
  EXPECT_FALSE(config.cluster);
  EXPECT_EQ(config.keys_per_split, 512);
  AttentionKernelSource kernel = generate_decode_attention_kernel(config);
  EXPECT_EQ(kernel.splits, 1);
  EXPECT_EQ(kernel.launch.grid_x, 1u);
  EXPECT_EQ(kernel.launch.grid_y, 32u);
  EXPECT_EQ(kernel.launch.block_x, 256u);
  EXPECT_FALSE(kernel.cluster);
  EXPECT_EQ(kernel.kernel_name, "metile_attention_decode_bf16_d64_v64_positions_r4_w8_k0");
  EXPECT_NE(kernel.source.find("kSpeculate = true"), std::string::npos);

  problem.keys = 513;
  config = decode_attention_config(problem, {}, 132);
  EXPECT_EQ(config.warps, 4);
  EXPECT_TRUE(config.cluster);
  kernel = generate_decode_attention_kernel(config);
  EXPECT_EQ(kernel.splits, 4);  // 132 blocks' worth over 32 heads: 4 splits of 144 keys
  EXPECT_TRUE(kernel.cluster);
  EXPECT_NE(kernel.source.find("kSpeculate = true"), std::string::npos);  // split 0 alone at short contexts

  FlashAttentionOptions explicit_shape;
  explicit_shape.decode_warps = 8;
  problem.heads = 8;
  problem.keys = 500;
  config = decode_attention_config(problem, explicit_shape, 132);
  EXPECT_FALSE(config.cluster);
  EXPECT_EQ(config.keys_per_split, 128);  // the global merge: 4 splits, a step per warp
  kernel = generate_decode_attention_kernel(config);
  EXPECT_EQ(kernel.source.find("kSpeculate = true"), std::string::npos) << "the global merge does not speculate";
}

// Issue 13: decode over few KV heads at short contexts. Qwen2.5-1.5B (2 KV heads, 6 query rows of
// 128) splits its keys over two-warp blocks, a head's splits one cluster; from 4 heads on
// (Llama-3.2-1B's 8, Llama-3-8B's 8, 16 and more) one 8-warp block per head, as measured
// (notes/attention.md, session 7).
TEST(AttentionCodegen, FewHeadsSplitTheKeysOverManyBlocks) {
  // Qwen2.5-1.5B's two KV heads: two-warp blocks, a head's splits one cluster.
  for (std::int64_t keys : {128, 512}) {
    SCOPED_TRACE(fmt::format("Qwen2.5-1.5B T {}", keys));
    AttentionProblem problem = problem_of(DType::bf16, 6, keys, 128, 128, AttentionMask::positions);
    problem.heads = 2;
    const DecodeShape picked = default_decode_shape(problem);
    EXPECT_FALSE(picked.one_split);
    EXPECT_TRUE(picked.cluster);
    EXPECT_EQ(picked.warps, 2);
    const AttentionKernelSource kernel = generate_decode_attention_kernel(decode_attention_config(problem, {}, 132));
    EXPECT_TRUE(kernel.cluster);
    EXPECT_EQ(kernel.launch.block_x, 64u);
    const std::int64_t blocks = static_cast<std::int64_t>(kernel.launch.grid_x) * kernel.launch.grid_y;
    // At least one 16-key step per warp: 128 keys make 4 splits of 32 per head; 512 keys 16 of 32.
    EXPECT_EQ(kernel.splits, keys == 128 ? 4 : 16);
    EXPECT_EQ(kernel.keys_per_split, 32);
    EXPECT_GE(blocks, 4 * problem.heads);
    EXPECT_LE(blocks, 132);
  }
  // From 4 heads on (Llama-3.2-1B's 8), one 8-warp block per head: measured faster than clusters.
  for (std::int64_t heads : {kClusteredShortCacheHeads, std::int64_t{8}, kOneSplitHeads, std::int64_t{64}}) {
    AttentionProblem problem = problem_of(DType::bf16, 4, 128, 128, 128, AttentionMask::positions);
    problem.heads = heads;
    EXPECT_TRUE(default_decode_shape(problem).one_split) << heads << " heads";
    const AttentionKernelSource kernel = generate_decode_attention_kernel(decode_attention_config(problem, {}, 132));
    EXPECT_EQ(kernel.splits, 1);
    EXPECT_EQ(kernel.launch.block_x, 256u);
  }
}

// Every launch shape the benchmark runs (decode_attention_variants): the default first, named "";
// no kernel twice; the few-heads clusters and the one-split grid at short caches, the L2 prefetch
// at long ones; and all of them, with explicit one-warp and prefetch shapes the variants do not
// cover (the global merge of one warp over 16 rows of 128: its registers; a one-warp prefetch of
// 32 rounds), compile for sm_90 without spills.
TEST(AttentionCodegen, DecodeVariantsCompileForSm90) {
  struct Shape {
    std::int64_t heads, rows, head_dim, keys;
    std::vector<std::string> expected;  // the variants' names, in order
  };
  const std::vector<Shape> shapes = {
      {2, 6, 128, 128, {"", "cluster w1", "one split w8"}},             // Qwen2.5-1.5B (default: cluster w2)
      {8, 4, 64, 128, {"", "cluster w1", "cluster w2"}},                // Llama-3.2-1B (default: one split)
      {2, 6, 128, 500, {"", "cluster w1", "one split w8"}},
      {32, 4, 128, 512, {""}},                                          // wide heads: one split, the default
      {8, 4, 128, 4096, {"", "cluster w1", "cluster w2", "l2 prefetch"}},  // Llama-3-8B
      {8, 4, 128, 32768, {"", "l2 prefetch"}},
  };
  std::vector<AttentionKernelSource> kernels;
  std::vector<std::string> seen;
  auto add = [&](const DecodeAttentionConfig& config) {
    AttentionKernelSource kernel = generate_decode_attention_kernel(config);
    if (std::find(seen.begin(), seen.end(), kernel.source) != seen.end()) return kernel;
    seen.push_back(kernel.source);
    kernels.push_back(kernel);
    return kernel;
  };
  for (const Shape& shape : shapes) {
    AttentionProblem problem = problem_of(DType::bf16, shape.rows, shape.keys, shape.head_dim, shape.head_dim,
                                          AttentionMask::positions);
    problem.heads = shape.heads;
    const std::vector<DecodeVariant> variants = decode_attention_variants(problem);
    std::vector<std::string> names;
    for (const DecodeVariant& variant : variants) names.push_back(variant.name);
    EXPECT_EQ(names, shape.expected) << problem.to_string();
    for (const DecodeVariant& variant : variants) {
      const AttentionKernelSource kernel = add(decode_attention_config(problem, variant.options, 132));
      EXPECT_EQ(kernel.source.find("kPrefetchRounds = 0;") == std::string::npos, variant.options.decode_l2_prefetch)
          << kernel.kernel_name;
      EXPECT_EQ(kernel.kernel_name.find("_l2prefetch") != std::string::npos, variant.options.decode_l2_prefetch);
      // Every split of a cluster loads its guessed first step with the positions over short caches only.
      EXPECT_EQ(kernel.source.find("kSpeculateEverySplit = true") != std::string::npos,
                kernel.cluster && shape.keys <= kLongestOneSplit)
          << kernel.kernel_name;
    }
  }
  const struct {
    DType dtype;
    std::int64_t rows, head_dim, value_dim;
    AttentionMask mask;
    int warps;
    bool cluster, prefetch;
    int rounds;  // kPrefetchRounds expected
  } cases[] = {
      {DType::bf16, 16, 128, 128, AttentionMask::none, 1, false, false, 0},      // the global merge's registers
      {DType::f16, 6, 64, 128, AttentionMask::causal, 1, true, false, 0},
      {DType::bf16, 4, 128, 128, AttentionMask::positions, 8, false, true, 2},  // 128 KiB / (128 keys x 512 B)
      {DType::f16, 7, 64, 64, AttentionMask::causal, 1, false, true, 32},       // 256 rounds' worth, 32 lanes
      {DType::bf16, 16, 128, 64, AttentionMask::none, 4, true, true, 5},
  };
  for (const auto& c : cases) {
    DecodeAttentionConfig config = decode_config_of(c);
    config.cluster = c.cluster;
    config.l2_prefetch = c.prefetch;
    config.keys_per_split = c.cluster ? 64 : 0;
    EXPECT_EQ(decode_prefetch_rounds(config), c.rounds);
    const AttentionKernelSource kernel = add(config);
    EXPECT_NE(kernel.source.find(fmt::format("kPrefetchRounds = {};", c.rounds)), std::string::npos) << kernel.kernel_name;
  }
  // The prefetch is the register path's; a ring refuses it.
  DecodeAttentionConfig ring;
  ring.problem = problem_of(DType::bf16, 4, 1000, 128, 128, AttentionMask::none);
  ring.stages = 3;
  ring.l2_prefetch = true;
  EXPECT_THROW(generate_decode_attention_kernel(ring), InputError);
  ring.warps = 3;
  ring.stages = 0;
  EXPECT_THROW(generate_decode_attention_kernel(ring), InputError);
  expect_compile_without_spills(kernels);
}

// The cache is read before the wait only where the positions say which rows are old: with the
// positions mask and the register path; a ring or another mask is refused with the reason.
TEST(AttentionCodegen, TheCacheBeforeTheWaitNeedsThePositionsAndRegisters) {
  DecodeAttentionConfig config;
  config.problem = problem_of(DType::bf16, 4, 1000, 128, 128, AttentionMask::positions);
  config.cache_before_wait = true;
  EXPECT_NO_THROW(generate_decode_attention_kernel(config));
  for (const AttentionMask mask : {AttentionMask::none, AttentionMask::causal}) {
    DecodeAttentionConfig other = config;
    other.problem = problem_of(DType::bf16, 4, 1000, 128, 128, mask);
    try {
      generate_decode_attention_kernel(other);
      ADD_FAILURE() << "mask " << attention_mask_name(mask) << " accepted";
    } catch (const InputError& error) {
      EXPECT_NE(std::string(error.what()).find("positions mask"), std::string::npos) << error.what();
    }
  }
  DecodeAttentionConfig ring = config;
  ring.stages = 3;
  EXPECT_THROW(generate_decode_attention_kernel(ring), InputError);
}

}  // namespace
}  // namespace metile
