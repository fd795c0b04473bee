// The fused attention kernels (include/metile/attention.h) against a float64 reference written
// here (two passes over the scores, no online softmax), on fresh random inputs: decode and
// prefill, head dims 64/128, sequence lengths that are multiples of neither the 16-key step, the
// split nor the 64-key tile, masks none / causal / positions, grouped-query rows, both dtypes.
// Outputs are poisoned (NaN) before each launch, so an unwritten element fails; with the positions
// mask the cache past the last position holds NaN, so reading it fails. Each case runs twice and
// must give the same bits (the split merge is deterministic). Seed printed;
// METILE_TEST_SEED replays a run. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "../unit/gemv/gemv_test_support.h"
#include "gpu_test_support.h"
#include "metile_test_support.h"
#include "metile/attention_runtime.h"

namespace metile {
namespace {

// One seed per process (printed once), each case offset from it.
std::uint64_t seed_base() {
  static const std::uint64_t seed = testing::test_seed("attention kernels") % (std::uint64_t{1} << 40);
  return seed;
}

struct AttentionInputs {
  HostTensor q, k, v;
  std::vector<std::int32_t> positions;
};

// The last key row r may see, or T - 1 without a mask.
std::int64_t visible_limit(const AttentionProblem& p, const std::vector<std::int32_t>& positions, std::int64_t row) {
  switch (p.mask) {
    case AttentionMask::causal: return row + p.offset;
    case AttentionMask::positions: return positions[static_cast<std::size_t>(row % p.position_count)];
    case AttentionMask::none: break;
  }
  return p.keys - 1;
}

// out[h, r, :] = sum_j softmax_j(scale q·k_j over visible j) v_j in float64, rounded once to the dtype.
HostTensor reference_attention(const AttentionProblem& p, const AttentionInputs& in) {
  const std::vector<double> q = in.q.to_values(), k = in.k.to_values(), v = in.v.to_values();
  std::vector<double> out(static_cast<std::size_t>(p.output_elements()));
  std::vector<double> weights(static_cast<std::size_t>(p.keys));
  for (std::int64_t h = 0; h < p.heads; ++h) {
    for (std::int64_t r = 0; r < p.rows; ++r) {
      const std::int64_t last = std::min(visible_limit(p, in.positions, r), p.keys - 1);
      const double* qr = q.data() + (h * p.rows + r) * p.head_dim;
      double maximum = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j <= last; ++j) {
        const double* kj = k.data() + (h * p.keys + j) * p.head_dim;
        double dot = 0;
        for (std::int64_t d = 0; d < p.head_dim; ++d) dot += qr[d] * kj[d];
        weights[static_cast<std::size_t>(j)] = p.scale * dot;
        maximum = std::max(maximum, p.scale * dot);
      }
      double sum = 0;
      for (std::int64_t j = 0; j <= last; ++j) sum += weights[static_cast<std::size_t>(j)] = std::exp(weights[static_cast<std::size_t>(j)] - maximum);
      double* o = out.data() + (h * p.rows + r) * p.value_dim;
      for (std::int64_t c = 0; c < p.value_dim; ++c) {
        double value = 0;
        for (std::int64_t j = 0; j <= last; ++j) value += weights[static_cast<std::size_t>(j)] * v[static_cast<std::size_t>((h * p.keys + j) * p.value_dim + c)];
        o[c] = last < 0 ? std::numeric_limits<double>::quiet_NaN() : value / sum;
      }
    }
  }
  return HostTensor::from_values(TensorSpec({p.heads, p.rows, p.value_dim}, p.dtype), out);
}

AttentionInputs random_inputs(const AttentionProblem& p, std::uint64_t seed) {
  AttentionInputs in;
  in.q = gemv_testing::random_tensor(TensorSpec({p.heads, p.rows, p.head_dim}, p.dtype), seed);
  in.k = gemv_testing::random_tensor(TensorSpec({p.heads, p.keys, p.head_dim}, p.dtype), seed + 1);
  in.v = gemv_testing::random_tensor(TensorSpec({p.heads, p.keys, p.value_dim}, p.dtype), seed + 2);
  return in;
}

// The problem of a test case's fields (dtype, heads, rows, keys, head_dim, value_dim, mask) with the
// scale 2/sqrt(D) (scores wider than a model's, so the softmax is not nearly flat); the caller sets
// the offset or the positions.
template <class Case>
AttentionProblem problem_of_case(const Case& c) {
  AttentionProblem problem;
  problem.dtype = c.dtype;
  problem.heads = c.heads;
  problem.rows = c.rows;
  problem.keys = c.keys;
  problem.head_dim = c.head_dim;
  problem.value_dim = c.value_dim;
  problem.scale = 2.0 / std::sqrt(static_cast<double>(c.head_dim));
  problem.mask = c.mask;
  return problem;
}

// NaN bits in every K and V row past `last` (a cache slot not yet written).
void poison_cache_after(const AttentionProblem& p, AttentionInputs& in, std::int64_t last) {
  for (HostTensor* tensor : {&in.k, &in.v}) {
    const std::int64_t width = tensor->spec().shape.back();
    for (std::int64_t h = 0; h < p.heads; ++h) {
      for (std::int64_t j = last + 1; j < p.keys; ++j) {
        for (std::int64_t c = 0; c < width; ++c) tensor->store((h * p.keys + j) * width + c, std::nan(""));
      }
    }
  }
}

class AttentionKernels : public testing_support::CudaDeviceTest {
 protected:
  // Runs the kernel twice on poisoned outputs; gates the first against the reference and requires
  // the second to be bit-identical.
  void check(const AttentionProblem& problem, const FlashAttentionOptions& options, const AttentionInputs& in,
             const std::string& what) {
    SCOPED_TRACE(what + ": " + problem.to_string());
    const FlashAttention attention = FlashAttention::build(problem, options);
    const DeviceBuffer q = DeviceBuffer::from_tensor(in.q), k = DeviceBuffer::from_tensor(in.k),
                       v = DeviceBuffer::from_tensor(in.v);
    DeviceBuffer positions;
    if (!in.positions.empty()) positions = DeviceBuffer::from_vector<std::int32_t>(in.positions);
    const TensorSpec out_spec({problem.heads, problem.rows, problem.value_dim}, problem.dtype);
    DeviceBuffer out(static_cast<std::size_t>(out_spec.bytes()));
    const HostTensor reference = reference_attention(problem, in);
    CudaStream stream;
    HostTensor first;
    for (int run = 0; run < 2; ++run) {
      out.fill_bytes(0xFF);
      attention.enqueue(stream, q.address(), k.address(), v.address(), positions.address(), out.address());
      stream.synchronize();
      HostTensor result = out.download(out_spec);
      if (run == 0) {
        const NumericGateResult gate = numeric_gate(result, reference);
        EXPECT_TRUE(gate.passed) << attention.kernel().summary << ": " << gate.detail;
        std::cout << fmt::format("[figures] {:<34} {:<46} {:<40} rel_l2 {:.2e} rel_max {:.2e}\n", what,
                                 problem.to_string(), attention.kernel().summary, gate.relative_l2, gate.relative_max);
        first = std::move(result);
      } else {
        EXPECT_TRUE(result == first) << "a second run gave other bits";
      }
    }
  }
};

TEST_F(AttentionKernels, DecodeMatchesFloat64Reference) {
  std::uint64_t seed = seed_base() * 1000;
  const struct {
    DType dtype;
    std::int64_t heads, rows, keys, head_dim, value_dim;
    AttentionMask mask;
    std::int64_t keys_per_split;  // 0: the default split
    int warps, stages;
    bool cluster;
  } cases[] = {
      {DType::bf16, 8, 4, 4097, 128, 128, AttentionMask::none, 0, 8, 0, false},    // Llama-3-8B GQA, T one past 4096
      {DType::bf16, 8, 4, 4097, 128, 128, AttentionMask::none, 0, 8, 3, false},    // the same through the cp.async ring
      {DType::bf16, 8, 4, 4097, 128, 128, AttentionMask::none, 0, 8, 0, true},     // the same as clusters of 16
      {DType::bf16, 8, 4, 4096, 128, 128, AttentionMask::none, 0, 4, 0, true},     // 4-warp clusters of 16
      {DType::bf16, 3, 1, 1000, 128, 128, AttentionMask::none, 32, 4, 0, false},   // many splits
      {DType::f16, 2, 16, 333, 64, 64, AttentionMask::none, 0, 8, 2, false},
      {DType::f16, 2, 16, 333, 64, 64, AttentionMask::none, 32, 8, 2, true},       // 11 splits, ring, cluster
      {DType::bf16, 5, 8, 777, 64, 64, AttentionMask::causal, 64, 2, 0, false},
      {DType::bf16, 5, 8, 777, 64, 64, AttentionMask::causal, 64, 2, 0, true},     // 13 splits, cluster
      {DType::f16, 4, 7, 1500, 128, 128, AttentionMask::causal, 0, 4, 4, false},
      {DType::bf16, 2, 13, 50, 128, 64, AttentionMask::none, 0, 4, 0, false},      // one split, a partial step
      {DType::bf16, 3, 5, 2000, 128, 128, AttentionMask::causal, 0, 8, 3, false},
      {DType::bf16, 3, 5, 2000, 128, 128, AttentionMask::causal, 256, 8, 0, true},  // 8 splits (portable cluster)
      // One split of a whole short cache (the default up to 512 keys): 4 steps per warp.
      {DType::bf16, 8, 4, 512, 64, 64, AttentionMask::none, 512, 8, 0, false},      // Llama-3.2-1B's heads
      {DType::bf16, 2, 6, 500, 128, 128, AttentionMask::causal, 512, 8, 0, false},  // Qwen2.5-1.5B's heads
  };
  for (const auto& c : cases) {
    AttentionProblem problem = problem_of_case(c);
    problem.offset = c.mask == AttentionMask::causal ? c.keys - c.rows - 5 : 0;  // the last 5 keys hidden
    FlashAttentionOptions options;
    options.decode_warps = c.warps;
    options.keys_per_split = c.keys_per_split;
    options.decode_stages = c.stages;
    options.decode_cluster = c.cluster;
    check(problem, options, random_inputs(problem, seed += 10), c.cluster ? "decode cluster" : "decode");
  }
}

TEST_F(AttentionKernels, DecodePositionsNeverReadPastTheLastPosition) {
  std::uint64_t seed = seed_base() * 1000 + 500;
  // GQA with S tokens: R = G·S rows, row r at position positions[r mod S]. The cache holds T slots,
  // those after the last position are NaN. The splits are sized on the device from the largest
  // position: a short prefix of a long cache splits its few keys over the grid (some splits
  // empty), and a row at position -1 sees nothing (NaN, every split empty).
  const struct {
    DType dtype;
    std::int64_t heads, groups, tokens, keys, head_dim;
    std::int64_t last_position;
  } cases[] = {
      {DType::bf16, 2, 4, 1, 32768, 128, 4095},  // one token at 4095 in a 32768-slot cache
      {DType::bf16, 4, 4, 3, 3000, 128, 1234},    // three tokens
      {DType::f16, 2, 2, 4, 900, 64, 899},        // the cache full
      {DType::bf16, 3, 1, 2, 200, 64, 17},        // inside the first split
      {DType::bf16, 8, 4, 1, 4096, 128, 127},     // the model engine: 128 tokens in a 4096-slot cache
      {DType::bf16, 8, 4, 1, 4096, 128, 300},     // 301 keys over 16 splits: a partial last split
      {DType::f16, 2, 4, 1, 1000, 64, -1},        // nothing written yet: NaN rows
      // Short caches (default: one 8-warp block per head, each warp's first step read with the
      // positions, NaN slots past the last position zeroed or masked); with 4-warp clusters and the
      // 8-warp global merge the same context collapses to one split on the device.
      {DType::bf16, 8, 4, 1, 512, 64, 127},       // Llama-3.2-1B, 128 tokens in a 512-slot cache
      {DType::bf16, 2, 6, 1, 512, 128, 127},      // Qwen2.5-1.5B
      {DType::bf16, 8, 4, 1, 512, 64, 300},       // 301 keys: up to 3 steps per warp
      {DType::f16, 2, 2, 3, 64, 64, 40},          // three tokens, a partial step
  };
  for (const auto& c : cases) {
    const AttentionProblem problem = AttentionProblem::grouped_query(c.dtype, c.heads, c.groups, c.tokens, c.keys, c.head_dim,
                                                                            AttentionMask::positions);
    AttentionInputs in = random_inputs(problem, seed += 10);
    for (std::int64_t s = 0; s < c.tokens; ++s) {
      in.positions.push_back(static_cast<std::int32_t>(c.last_position - c.tokens + 1 + s));
    }
    poison_cache_after(problem, in, c.last_position);
    check(problem, {}, in, "decode positions (default shape)");
    FlashAttentionOptions global_merge;
    global_merge.decode_warps = 8;
    check(problem, global_merge, in, "decode positions, 8 warps");
    FlashAttentionOptions ring;
    ring.decode_warps = 8;
    ring.decode_stages = 3;
    check(problem, ring, in, "decode positions, ring");
    FlashAttentionOptions cluster;
    cluster.decode_warps = 4;
    cluster.decode_cluster = true;
    check(problem, cluster, in, "decode positions, cluster");
  }
}

// Issue 13/14: decode over few KV heads (2 KV heads x 6 query rows: Qwen2.5-1.5B's groups) at key
// counts that are no multiple of the 16-key step (1, 17, 500) and 128, in every launch shape the
// flash_attention lowering races (decode_attention_variants) and the explicit small-block and L2
// prefetch shapes: one- and two-warp clusters (the few-heads default), a one-warp global merge,
// the one-split grid, the prefetch on the global merge, a 4-warp and a one-warp cluster. With the
// positions mask the cache holds 512 slots, NaN past the last position (the model engine's case:
// the splits sized on the device from the visible keys, the prefetch never past them).
// One case per head dim, mask and key count (16 test instances, each its own process in
// benchmarks/attention/device_run.sh: each compiles ~8 kernels).
struct FewHeadsCase {
  DType dtype;
  std::int64_t head_dim;
  AttentionMask mask;
  std::int64_t keys;
};

class FewHeadsAttention : public AttentionKernels, public ::testing::WithParamInterface<FewHeadsCase> {};

TEST_P(FewHeadsAttention, EveryShapeMatchesFloat64Reference) {
  const FewHeadsCase c = GetParam();
  AttentionProblem problem;
  problem.dtype = c.dtype;
  problem.heads = 2;
  problem.rows = 6;
  problem.keys = c.mask == AttentionMask::positions ? 512 : c.keys;
  problem.head_dim = problem.value_dim = c.head_dim;
  problem.scale = 2.0 / std::sqrt(static_cast<double>(c.head_dim));
  problem.mask = c.mask;
  problem.position_count = c.mask == AttentionMask::positions ? 1 : 0;
  AttentionInputs in =
      random_inputs(problem, seed_base() * 1000 + 600 + static_cast<std::uint64_t>(c.head_dim + 7 * c.keys) +
                                 (c.mask == AttentionMask::positions ? 5000 : 0));
  if (c.mask == AttentionMask::positions) {
    in.positions = {static_cast<std::int32_t>(c.keys - 1)};
    poison_cache_after(problem, in, c.keys - 1);
  }
  std::vector<DecodeVariant> shapes = decode_attention_variants(problem);
  auto explicit_shape = [&](const std::string& name, int warps, bool cluster, bool prefetch) {
    FlashAttentionOptions options;
    options.decode_warps = warps;
    options.decode_cluster = cluster;
    options.decode_l2_prefetch = prefetch;
    shapes.push_back({name, options});
  };
  explicit_shape("cluster w1", 1, true, false);  // (the default here: checked once, below)
  explicit_shape("global merge w1", 1, false, false);
  explicit_shape("l2 prefetch, global merge w8", 8, false, true);
  explicit_shape("l2 prefetch, cluster w4", 4, true, true);
  explicit_shape("l2 prefetch, cluster w1", 1, true, true);
  std::vector<std::string> checked;
  for (const DecodeVariant& shape : shapes) {
    const AttentionKernelSource kernel =
        generate_decode_attention_kernel(decode_attention_config(problem, shape.options, device().info().multiprocessor_count));
    const std::string identity = fmt::format("{} {}", kernel.source, kernel.splits);
    if (std::find(checked.begin(), checked.end(), identity) != checked.end()) continue;
    checked.push_back(identity);
    check(problem, shape.options, in, fmt::format("decode few heads T={} {}", c.keys, shape.name.empty() ? "default" : shape.name));
  }
  EXPECT_GE(checked.size(), 5u);
}

std::vector<FewHeadsCase> few_heads_cases() {
  std::vector<FewHeadsCase> cases;
  for (const auto& [dtype, head_dim] : {std::pair{DType::bf16, std::int64_t{128}}, std::pair{DType::f16, std::int64_t{64}}}) {
    for (const AttentionMask mask : {AttentionMask::none, AttentionMask::positions}) {
      // (positions: bf16 at both head dims)
      for (const std::int64_t keys : {1, 17, 128, 500}) {
        cases.push_back({mask == AttentionMask::positions ? DType::bf16 : dtype, head_dim, mask, keys});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Qwen, FewHeadsAttention, ::testing::ValuesIn(few_heads_cases()),
                         [](const ::testing::TestParamInfo<FewHeadsCase>& info) {
                           return fmt::format("{}_D{}_{}_T{}", dtype_name(info.param.dtype), info.param.head_dim,
                                              attention_mask_name(info.param.mask), info.param.keys);
                         });

// The L2 prefetch at long contexts, where its window slides ahead of the loads (more rounds than
// the split's first window): Llama-3-8B's groups over 4097 keys, the prefetch on the default
// shape, the 8-warp global merge and 4-warp clusters; the positions mask with a token at 3000 in
// a 4096-slot cache (NaN after it: nothing past the last position is read).
TEST_F(AttentionKernels, L2PrefetchAtLongContexts) {
  std::uint64_t seed = seed_base() * 1000 + 400;
  for (const AttentionMask mask : {AttentionMask::none, AttentionMask::positions}) {
    const AttentionProblem problem =
        AttentionProblem::grouped_query(DType::bf16, 8, 4, 1, mask == AttentionMask::positions ? 4096 : 4097, 128, mask);
    AttentionInputs in = random_inputs(problem, seed += 10);
    if (mask == AttentionMask::positions) {
      in.positions = {3000};
      poison_cache_after(problem, in, 3000);
    }
    for (const auto& [warps, cluster, keys_per_split] :
         {std::tuple{0, false, std::int64_t{0}}, std::tuple{8, false, std::int64_t{0}}, std::tuple{8, false, std::int64_t{1024}},
          std::tuple{4, true, std::int64_t{0}}}) {
      FlashAttentionOptions options;
      options.decode_warps = warps;
      options.decode_cluster = cluster;
      options.keys_per_split = keys_per_split;
      options.decode_l2_prefetch = true;
      check(problem, options, in, fmt::format("decode L2 prefetch w{}{}", warps, cluster ? " cluster" : ""));
    }
  }
}

// DecodeAttentionConfig::cache_before_wait (the flash_attention lowering's choice in a decode step):
// the positions and the cache rows below the smallest position are read before griddepcontrol.wait,
// q and the new rows after it. A writer kernel lets the attention kernel launch at once (a
// programmatic dependent), spins for 50 us, then writes q and the new K/V rows (the q/k/v GEMV's
// part in a step); until then q and those rows hold NaN, as do the slots past the last position.
// A kernel that read any of them before the wait gives NaN rows, which the gate fails.
TEST_F(AttentionKernels, TheCacheBeforeTheWaitReadsTheNewRowsAfterIt) {
  std::uint64_t seed = seed_base() * 1000 + 700;
  const CompiledKernel writer = compile_cuda(std::string(testing_support::kReleaseDependentsThenSpinSource) + R"CUDA(
extern "C" __global__ void late_writer(unsigned short* q, const unsigned short* q_final, long long q_count,
                                       unsigned short* k, const unsigned short* k_final, long long k_width,
                                       unsigned short* v, const unsigned short* v_final, long long v_width,
                                       long long heads, long long keys, long long first_row, long long end_row,
                                       long long spin_ns) {
  release_dependents_then_spin(spin_ns);
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long i = id; i < q_count; i += stride) q[i] = q_final[i];
  const long long rows = end_row - first_row;
  for (long long i = id; i < heads * rows * k_width; i += stride) {
    const long long at = ((i / (rows * k_width)) * keys + first_row + i / k_width % rows) * k_width + i % k_width;
    k[at] = k_final[at];
  }
  for (long long i = id; i < heads * rows * v_width; i += stride) {
    const long long at = ((i / (rows * v_width)) * keys + first_row + i / v_width % rows) * v_width + i % v_width;
    v[at] = v_final[at];
  }
}
)CUDA",
                                             "late_writer");
  const struct {
    DType dtype;
    std::int64_t heads, groups, tokens, keys, head_dim, last_position;
    std::vector<std::int64_t> order = {};  // the tokens' positions less last_position; empty: ascending
  } cases[] = {
      {DType::bf16, 8, 4, 1, 512, 64, 127},     // Llama-3.2-1B's step: one 8-warp block per head
      {DType::bf16, 2, 6, 1, 512, 128, 127},    // Qwen2.5-1.5B's: two-warp clusters
      {DType::bf16, 8, 4, 1, 4096, 128, 300},   // Llama-3-8B at 301 keys: 4-warp clusters
      {DType::bf16, 4, 4, 3, 3000, 128, 1234},  // three new rows
      {DType::bf16, 2, 4, 1, 32768, 128, 4095}, // the global merge
      {DType::f16, 2, 2, 4, 900, 64, 899},      // the cache full
      {DType::bf16, 3, 1, 2, 200, 64, 17},      // every row inside the first split
      {DType::bf16, 4, 4, 3, 3000, 128, 1234, {0, -2, -1}},  // the smallest position is not row 0's
      {DType::bf16, 8, 2, 3, 512, 64, 140, {-1, 0, -1}},     // a position named twice
  };
  for (const auto& c : cases) {
    const AttentionProblem problem = AttentionProblem::grouped_query(c.dtype, c.heads, c.groups, c.tokens, c.keys, c.head_dim,
                                                                            AttentionMask::positions);
    AttentionInputs in = random_inputs(problem, seed += 10);
    std::vector<std::int64_t> order = c.order;
    if (order.empty()) {
      for (std::int64_t s = 0; s < c.tokens; ++s) order.push_back(s - c.tokens + 1);
    }
    for (const std::int64_t offset : order) in.positions.push_back(static_cast<std::int32_t>(c.last_position + offset));
    ASSERT_EQ(static_cast<std::int64_t>(in.positions.size()), c.tokens);  // one position a token
    const std::int64_t first_new = c.last_position + *std::min_element(order.begin(), order.end());
    poison_cache_after(problem, in, c.last_position);
    // What the device holds before the writer runs: q and the new rows NaN too.
    AttentionInputs before = in;
    poison_cache_after(problem, before, first_new - 1);
    for (std::int64_t i = 0; i < before.q.element_count(); ++i) before.q.store(i, std::nan(""));
    FlashAttentionOptions options;
    options.decode_cache_before_wait = true;
    const FlashAttention attention = FlashAttention::build(problem, options);
    SCOPED_TRACE(problem.to_string() + ", " + attention.kernel().summary);
    EXPECT_NE(attention.kernel().summary.find("cache before the wait"), std::string::npos);
    const DeviceBuffer q_final = DeviceBuffer::from_tensor(in.q), k_final = DeviceBuffer::from_tensor(in.k),
                       v_final = DeviceBuffer::from_tensor(in.v);
    const DeviceBuffer positions = DeviceBuffer::from_vector<std::int32_t>(in.positions);
    const TensorSpec out_spec({problem.heads, problem.rows, problem.value_dim}, problem.dtype);
    DeviceBuffer out(static_cast<std::size_t>(out_spec.bytes()));
    const HostTensor reference = reference_attention(problem, in);
    CudaStream stream;
    stream.set_programmatic_dependent_launch(true);
    HostTensor first;
    for (int run = 0; run < 2; ++run) {
      const DeviceBuffer q = DeviceBuffer::from_tensor(before.q), k = DeviceBuffer::from_tensor(before.k),
                         v = DeviceBuffer::from_tensor(before.v);
      out.fill_bytes(0xFF);
      stream.synchronize();
      launch(writer, Dim3{64}, Dim3{256}, 0, stream, q, q_final, static_cast<long long>(in.q.element_count()), k,
             k_final, static_cast<long long>(problem.head_dim), v, v_final, static_cast<long long>(problem.value_dim),
             static_cast<long long>(problem.heads), static_cast<long long>(problem.keys),
             static_cast<long long>(first_new), static_cast<long long>(c.last_position + 1), 50'000LL);
      attention.enqueue(stream, q.address(), k.address(), v.address(), positions.address(), out.address());
      stream.synchronize();
      HostTensor result = out.download(out_spec);
      if (run == 0) {
        const NumericGateResult gate = numeric_gate(result, reference);
        EXPECT_TRUE(gate.passed) << gate.detail;
        std::cout << fmt::format("[figures] decode, cache before the wait {:<46} {:<56} rel_l2 {:.2e}\n",
                                 problem.to_string(), attention.kernel().summary, gate.relative_l2);
        first = std::move(result);
      } else {
        EXPECT_TRUE(result == first) << "a second run gave other bits";
      }
    }
  }
  // The control, so that the test cannot pass without the overlap it depends on: positions that
  // claim the new row is old (200, where the writer writes row 127 alone and every other row up to
  // 200 holds its final value) make the kernel read row 127 before the wait. It reads NaN only if
  // it ran while the writer spun, which the NaN in its output shows.
  const AttentionProblem problem = AttentionProblem::grouped_query(DType::bf16, 8, 4, 1, 512, 64, AttentionMask::positions);
  AttentionInputs in = random_inputs(problem, seed += 10);
  in.positions = {200};
  AttentionInputs before = in;
  for (HostTensor* tensor : {&before.k, &before.v}) {
    for (std::int64_t h = 0; h < problem.heads; ++h) {
      for (std::int64_t c = 0; c < problem.head_dim; ++c) tensor->store((h * problem.keys + 127) * problem.head_dim + c, std::nan(""));
    }
  }
  FlashAttentionOptions options;
  options.decode_cache_before_wait = true;
  const FlashAttention attention = FlashAttention::build(problem, options);
  const DeviceBuffer q = DeviceBuffer::from_tensor(in.q), k = DeviceBuffer::from_tensor(before.k),
                     v = DeviceBuffer::from_tensor(before.v), k_final = DeviceBuffer::from_tensor(in.k),
                     v_final = DeviceBuffer::from_tensor(in.v);
  const DeviceBuffer positions = DeviceBuffer::from_vector<std::int32_t>(in.positions);
  const TensorSpec out_spec({problem.heads, problem.rows, problem.value_dim}, problem.dtype);
  DeviceBuffer out(static_cast<std::size_t>(out_spec.bytes()));
  CudaStream stream;
  stream.set_programmatic_dependent_launch(true);
  launch(writer, Dim3{64}, Dim3{256}, 0, stream, q, q, static_cast<long long>(in.q.element_count()), k, k_final,
         static_cast<long long>(problem.head_dim), v, v_final, static_cast<long long>(problem.value_dim),
         static_cast<long long>(problem.heads), static_cast<long long>(problem.keys), 127LL, 128LL, 50'000LL);
  attention.enqueue(stream, q.address(), k.address(), v.address(), positions.address(), out.address());
  stream.synchronize();
  const std::vector<double> control = out.download(out_spec).to_values();
  EXPECT_TRUE(std::any_of(control.begin(), control.end(), [](double x) { return std::isnan(x); }))
      << "the attention kernel did not run while the writer spun: the cases above prove nothing";
}

TEST_F(AttentionKernels, PrefillMatchesFloat64Reference) {
  std::uint64_t seed = seed_base() * 1000 + 800;
  const struct {
    DType dtype;
    std::int64_t heads, rows, keys, head_dim, value_dim;
    AttentionMask mask;
    std::int64_t offset;
    int warps;
  } cases[] = {
      {DType::bf16, 3, 300, 300, 128, 128, AttentionMask::causal, 0, 4},  // square causal, partial tiles
      {DType::f16, 2, 200, 517, 64, 64, AttentionMask::none, 0, 8},
      {DType::bf16, 2, 250, 400, 64, 128, AttentionMask::causal, 150, 8},  // new rows after a 150-key prefix
      {DType::f16, 2, 7, 130, 128, 128, AttentionMask::causal, 100, 4},    // few rows through the tiled kernel
  };
  for (const auto& c : cases) {
    AttentionProblem problem = problem_of_case(c);
    problem.offset = c.offset;
    FlashAttentionOptions options;
    options.prefill_warps = c.warps;
    options.force_prefill = true;
    check(problem, options, random_inputs(problem, seed += 10), "prefill");
  }
}

TEST_F(AttentionKernels, PrefillGroupedQueryCausalByPositions) {
  // Llama-style GQA prefill: G = 4 query heads per KV head, S = 129 tokens appended to a cache
  // whose first 71 slots are filled: row r (head r / S, token r mod S) sees keys up to 71 + r mod S.
  std::uint64_t seed = seed_base() * 1000 + 900;
  for (std::int64_t head_dim : {64, 128}) {
    AttentionProblem problem;
    problem.dtype = DType::bf16;
    problem.heads = 2;
    problem.rows = 4 * 129;
    problem.keys = 256;
    problem.head_dim = problem.value_dim = head_dim;
    problem.scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    problem.mask = AttentionMask::positions;
    problem.position_count = 129;
    AttentionInputs in = random_inputs(problem, seed += 10);
    for (std::int32_t s = 0; s < 129; ++s) in.positions.push_back(71 + s);
    poison_cache_after(problem, in, 71 + 128);
    check(problem, {}, in, "prefill positions (GQA)");
  }
}

TEST_F(AttentionKernels, RowsThatSeeNoKeyAreNaN) {
  // causal with offset -3: rows 0..2 see nothing (NaN, as softmax over an all -inf row), row 3 one key.
  AttentionProblem problem;
  problem.dtype = DType::bf16;
  problem.heads = 2;
  problem.rows = 6;
  problem.keys = 40;
  problem.head_dim = problem.value_dim = 64;
  problem.scale = 0.125;
  problem.mask = AttentionMask::causal;
  problem.offset = -3;
  const AttentionInputs in = random_inputs(problem, seed_base() * 1000 + 950);
  const HostTensor reference = reference_attention(problem, in);
  ASSERT_TRUE(std::isnan(reference.at(0)));
  ASSERT_FALSE(std::isnan(reference.at(3 * 64)));
  check(problem, {}, in, "decode no visible key");
  FlashAttentionOptions prefill;
  prefill.force_prefill = true;
  check(problem, prefill, in, "prefill no visible key");
}

}  // namespace
}  // namespace metile
