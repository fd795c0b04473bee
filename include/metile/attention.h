// metile fused attention on the GPU: the CUDA lowerings of the `flash_attention` op
//
//   out [..., Hkv, R, Dv] = softmax(scale · q kᵀ + mask) v
//   q [..., Hkv, R, D], k [..., Hkv, T, D], v [..., Hkv, T, Dv], positions i32 [S] (mask "positions")
//
// Grouped-query attention is the reshape q [Hq, S, D] → [Hkv, G·S, D] (rows head-major), so the
// G query heads of one KV head are rows of one problem and share one read of its K and V. Masks:
//   none       every key is visible
//   causal     row r sees key j where j <= r + offset            (the causal_mask op's rows)
//   positions  row r sees key j where j <= positions[r mod S]    (the position_mask op)
// A row that sees no key gives NaN, as softmax over an all -inf row does in the CPU reference.
//
// Both kernels keep a running softmax state per row — (max m, normalizer l, weighted sum acc) —
// and fold key blocks into it with the softmax law's merge: the side with the smaller max is
// rescaled by exp(m_side − m). Every merge runs in a fixed order, so results are deterministic.
//
//   decode   R = 1..16 rows (one 16-row tensor-core tile). The keys are split along the sequence
//            (flash-decoding); the warps of a split's block take interleaved 16-key steps, loading
//            K and V straight from global memory into mma fragments (no shared memory), then meet
//            in shared memory; each split writes its partial state, and the last split of a head
//            to finish (an arrival counter) merges all of them in split order — or, with the
//            splits of a head as one thread-block cluster, every split merges a slice of the
//            output from the others' shared memory. The splits are sized on the device from the
//            keys some row may see; with the positions mask, keys past the largest position are
//            never read (but for split 0's first step, below). Up to two steps per warp of
//            visible keys a head is one split whatever the grid: no split merge at all. In the
//            short-cache shapes (one split, or a cluster) split 0 loads each warp's first step
//            together with Q and the positions, one dependent global round trip instead of two.
//            Few heads at short caches: one-warp blocks, a head's splits one cluster, so 2 heads
//            still occupy 16 multiprocessors at 128 keys. Optionally (l2_prefetch) each block asks
//            the L2 for a window of its K and V rows by bulk prefetches ahead of its loads.
//   prefill  any R: blocks of 16-row warps over a row tile, K and V tiles of 64 keys staged in
//            shared memory (cp.async, two stages), causal / positions tiles past a row tile's last
//            visible key skipped.
//
// This header is the codegen side: the problem description and kernel generation, text only
// (NVRTC compiles it without a GPU, src/codegen/attention_kernels.cpp); it includes no runtime
// header. The launcher, FlashAttention (include/metile/attention_runtime.h), compiles, owns the
// scratch and launches.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "metile/codegen.h"
#include "metile/graph.h"

namespace metile {

enum class AttentionMask : std::uint8_t { none, causal, positions };
std::string_view attention_mask_name(AttentionMask mask);        // "none", "causal", "positions"
AttentionMask parse_attention_mask(std::string_view name);       // InputError for another name

// One flash_attention problem, with the leading batch dimensions folded into `heads`.
struct AttentionProblem {
  DType dtype = DType::bf16;        // of q, k, v and out: f16 or bf16
  std::int64_t heads = 1;           // product of q's dimensions before R (batch · Hkv)
  std::int64_t rows = 1;            // R = G·S
  std::int64_t keys = 1;            // T
  std::int64_t head_dim = 128;      // D: 64 or 128
  std::int64_t value_dim = 128;     // Dv: 64 or 128
  double scale = 1.0;
  AttentionMask mask = AttentionMask::none;
  std::int64_t offset = 0;          // causal only
  std::int64_t position_count = 0;  // S, positions only; R must be a multiple of it

  // The op's operands, as the lowering sees them: shapes checked against each other (same leading
  // dimensions, D and T shared by k and v), InputError naming the operand otherwise.
  static AttentionProblem from_specs(const TensorSpec& q, const TensorSpec& k, const TensorSpec& v,
                                     const std::optional<TensorSpec>& positions, double scale,
                                     std::string_view mask, std::int64_t offset = 0);
  // A decoder's attention over a cache of `keys` slots: `groups` query heads of each of `kv_heads`
  // KV heads for each of `tokens` tokens (R = groups · tokens), D = Dv = head_dim, the scale
  // 1/sqrt(D), with the positions mask (S = tokens) or none.
  static AttentionProblem grouped_query(DType dtype, std::int64_t kv_heads, std::int64_t groups, std::int64_t tokens,
                                        std::int64_t keys, std::int64_t head_dim, AttentionMask mask);
  void validate() const;           // InputError naming the field the kernels cannot take
  bool is_decode() const { return rows <= 16; }
  std::string to_string() const;   // "bf16 heads 8 R 4 T 4096 D 128 Dv 128 causal(+0)"
  std::int64_t key_value_bytes() const;  // K and V of every head, once
  std::int64_t output_elements() const { return heads * rows * value_dim; }
};

struct DecodeAttentionConfig {
  AttentionProblem problem;
  int warps = 8;                    // per block: 1, 2, 4 or 8 (1 and 2: small splits over many
                                    // blocks when the heads are few)
  std::int64_t keys_per_split = 0;  // a multiple of 16; 0: decode_keys_per_split()
  int stages = 0;                   // 0: K/V fragments double-buffered in registers; 2..4: a per-warp
                                    // shared-memory ring of that many 16-key steps filled by cp.async
  bool cluster = false;             // the splits of a head form one thread-block cluster and merge
                                    // through distributed shared memory (no global scratch, no
                                    // arrival counter); at most kMaxClusterSplits splits
  bool l2_prefetch = false;         // registers only (stages 0): each block first asks the L2 for its
                                    // next kL2PrefetchWindowBytes of K and V by bulk prefetches
                                    // (cp.async.bulk.prefetch.L2, sm_90) and keeps that window
                                    // ahead of its loads, so the DRAM holds more of the block's
                                    // bytes in flight than its registers can
  bool cache_before_wait = false;   // positions mask, registers only: the positions and every K/V row
                                    // below the smallest position are read before griddepcontrol.wait
                                    // (each warp's first step, where all its keys lie there), q and
                                    // the rows at or past it after. Only where no kernel of the run
                                    // writes those: the positions a graph input and the caches a
                                    // graph input written only at the positions (a decode step's
                                    // kv_cache_write; flash_attention_candidates checks the graph)
  void validate() const;
};
constexpr std::int64_t kMaxClusterSplits = 16;  // Hopper's largest (non-portable) cluster
// The prefetch window of a block (K and V together), in whole rounds of 16·warps keys (at least
// one, at most 32: one lane of a warp each). 128 KiB a block is a whole split at 4096 keys of
// Llama-3-8B's 8 heads (16 splits of 256 keys), and 132 blocks' windows (17 MB) stay a third of
// the H200's 50 MB L2, so lines prefetched are not evicted before they are read.
constexpr std::int64_t kL2PrefetchWindowBytes = 128 * 1024;
int decode_prefetch_rounds(const DecodeAttentionConfig& config);  // 0 without l2_prefetch
// The grid's splits: from keys_per_split, or the default (for a cluster: at most 16 per head).
std::int64_t decode_split_count(const DecodeAttentionConfig& config);
std::int64_t decode_ring_bytes(const DecodeAttentionConfig& config);  // 0 without a ring

// The default split: about one block per multiprocessor, at least one 16-key step per warp.
std::int64_t decode_keys_per_split(const AttentionProblem& problem, int warps, int multiprocessors = 132);

// The decode launch shape FlashAttention picks when none is given. Caches of up to
// kLongestOneSplit keys (the model engine's short contexts) over at least kClusteredShortCacheHeads
// heads: one 8-warp block per head, no split merge at all (notes/attention.md, session 6: a
// latency-bound kernel, one dependent global round trip and one block barrier). Over fewer heads
// that grid leaves the GPU nearly empty (Qwen2.5-1.5B's 2 KV heads: 2 blocks), so there the keys
// are split over two-warp blocks, a head's splits one cluster (merged on the chip): measured
// 5.17 against 5.78 us at 128 keys (session 7; the one-warp cluster 5.47, and both lose to the
// one-split grid over Llama-3.2-1B's 8 heads: 3.94 / 4.15 against 3.45 us). Up to 4096 keys, as measured on the H200 (device call 4): 4 warps
// with a head's splits as one cluster (14 clusters of 16 fit at once, the merge never leaves the
// chip: 4.97 vs 6.81 us at 512 keys, 11.12 vs 11.39 us at 4096); beyond, 8 warps and the global
// merge (the cluster's one 4-warp block per multiprocessor keeps too few bytes in flight: 49.6 vs
// 39.3 us at 32768, and 8-warp clusters of 16 fit only 7 at once).
struct DecodeShape {
  int warps = 8;
  bool cluster = false;
  bool one_split = false;  // the grid is one block per head (keys_per_split covers the cache)
};
constexpr std::int64_t kLongestOneSplit = 512;
constexpr std::int64_t kOneSplitHeads = 16;            // below: decode_attention_variants lists small clusters
constexpr std::int64_t kClusteredShortCacheHeads = 4;   // below: the short-cache default is a 2-warp cluster
constexpr std::int64_t kLongestClustered = 4096;  // measured at 512, 4096 and 32768 keys
DecodeShape default_decode_shape(const AttentionProblem& problem);

struct PrefillAttentionConfig {
  AttentionProblem problem;
  int warps = 4;  // per block, 16 query rows each: 4 or 8
  void validate() const;
};

// A generated attention kernel and its launch shape (grid_x: splits or row tiles, grid_y: heads).
// The decode kernel sizes its splits on the device: the grid's splits share the keys that some
// row may see (up to the largest position, or the causal limit) evenly in 16-key steps, so with
// the positions mask a short prefix of a long cache is split as finely as a full one, and splits
// past the last visible key read nothing.
struct AttentionKernelSource {
  std::string kernel_name;
  std::string source;  // self-contained CUDA C++ for NVRTC
  KernelLaunchShape launch;
  std::int64_t splits = 1;          // decode only: the grid's splits (the most a launch uses)
  std::int64_t keys_per_split = 0;  // decode only: a split's keys when every key is visible
  bool cluster = false;             // decode only: launched as clusters of `splits` CTAs
  std::string summary;              // one line for notes and benchmark tables
};

// Decode kernel arguments: q, k, v, positions (may be null unless mask is positions), out,
// partial_values f32 [heads, splits, R, Dv], partial_states f32x2 [heads, splits, R],
// arrivals u32 [heads] (zero before the first launch; the kernel leaves it zero), then
// int keys, float scale·log2(e), int offset.
AttentionKernelSource generate_decode_attention_kernel(const DecodeAttentionConfig& config);
// Prefill kernel arguments: q, k, v, positions, out, then int rows, int keys, float scale·log2(e), int offset.
AttentionKernelSource generate_prefill_attention_kernel(const PrefillAttentionConfig& config);

}  // namespace metile
