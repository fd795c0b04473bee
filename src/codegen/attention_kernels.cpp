// The fused attention kernels (include/metile/attention.h): decode (flash-decoding over a long
// K/V cache, 1..16 query rows) and prefill (tiled, causal), both on tensor-core mma.m16n8k16.
//
// Fragment layout, shared by both kernels. One warp owns 16 query rows (the mma's M) and walks
// the keys 16 at a time. Within a 16-key step the logical key order of the mma is a permutation
// of the physical one, chosen so that a lane's operands are whole 16-byte vectors:
//   logical key 2t, 2t+1, 2t+8, 2t+9  ->  physical key t, t+4, t+8, t+12       (t = lane % 4)
//   * scores S = Q Kᵀ: K is the B operand (k = head dim, n = key); lane (g, t) (g = lane / 4) needs
//     keys π(g) and π(g + 8), and per 32-column chunk c of the head dim the logical columns
//     2t, 2t+1, 2t+8, 2t+9 (+16) — mapped to the physical columns 32c + 8t .. 32c + 8t + 7, one
//     16-byte load; Q's A fragments use the same column map, so the dot products are unchanged;
//   * the C fragment of S (two n8 tiles) is, element for element, the A fragment of P for P V
//     (the FlashAttention-2 register reuse), so P never leaves registers;
//   * V is the B operand of P V (k = key, n = value column): lane (g, t) needs keys t, t+4, t+8,
//     t+12 at value column n = g of each n8 tile j, mapped to the physical column
//     64·(j / 8) + 8g + j % 8: per key one 16-byte vector per 64 columns, and a byte permute pairs
//     two keys' halves into one B register;
//   * the output C fragment then holds, for row g (and g + 8), the physical columns
//     64h + 16t + 0..7 and 64h + 16t + 8..15 over the eight tiles of half h: two 16-byte stores.
// Softmax runs in base 2: scores are multiplied by scale·log2(e) and exponentiated with exp2.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "codegen_internal.h"
#include "metile/attention.h"

namespace metile {
namespace {

// Pieces both kernels use, after the tensor-core helpers (codegen_internal.h: types, mma,
// component); the generator prepends the constants (kHalf, kHeadDim, kValueDim,
// kWarps, kMask, ...) they read.
constexpr std::string_view common_body = R"CUDA(

constexpr int kThreads = kWarps * 32;
constexpr int kKeyChunks = kHeadDim / 32;     // 16-byte vectors of one key's K row per lane
constexpr int kQuerySteps = kHeadDim / 16;    // mma k-steps of Q Kᵀ
constexpr int kValueHalves = kValueDim / 64;  // 16-byte vectors of one key's V row per lane
constexpr int kValueTiles = kValueDim / 8;    // n8 tiles of P V
enum MaskKind { kMaskNone = 0, kMaskCausal = 1, kMaskPositions = 2 };
constexpr int kNoLimit = 0x7fffffff;

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

__device__ __forceinline__ u32 pack_pair(float low, float high) {
  u32 pair;
  if constexpr (kHalf) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(high), "f"(low));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(high), "f"(low));
  }
  return pair;
}

__device__ __forceinline__ uint4 pack_vector(float e0, float e1, float e2, float e3, float e4, float e5, float e6,
                                             float e7) {
  return make_uint4(pack_pair(e0, e1), pack_pair(e2, e3), pack_pair(e4, e5), pack_pair(e6, e7));
}

// K and V are streamed once per use: keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const void* address) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(address));
  return v;
}

// The last key row r may see (kNoLimit: all of them).
__device__ __forceinline__ int row_limit(int row, const int* __restrict__ positions, int position_count, int offset) {
  if constexpr (kMask == kMaskCausal) {
    return row + offset;
  } else if constexpr (kMask == kMaskPositions) {
    return positions[row % position_count];
  } else {
    return kNoLimit;
  }
}

// Q's A fragments for rows `row_low` and row_low + 8 (a row at or past `rows` reads zeros).
__device__ __forceinline__ void load_query(u32 (&qa)[kQuerySteps][4], const u16* __restrict__ q, int row_low,
                                           int rows, int t) {
#pragma unroll
  for (int c = 0; c < kKeyChunks; ++c) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const uint4 low = row_low < rows ? *reinterpret_cast<const uint4*>(q + (u64)row_low * kHeadDim + 32 * c + 8 * t) : zero;
    const uint4 high =
        row_low + 8 < rows ? *reinterpret_cast<const uint4*>(q + (u64)(row_low + 8) * kHeadDim + 32 * c + 8 * t) : zero;
    qa[2 * c][0] = low.x; qa[2 * c][1] = high.x; qa[2 * c][2] = low.y; qa[2 * c][3] = high.y;
    qa[2 * c + 1][0] = low.z; qa[2 * c + 1][1] = high.z; qa[2 * c + 1][2] = low.w; qa[2 * c + 1][3] = high.w;
  }
}

// One 16-key step's operands as this lane holds them.
struct StepKeys {
  uint4 key[2][kKeyChunks];      // K rows π(g) and π(g + 8)
};
struct StepValues {
  uint4 value[4][kValueHalves];  // V rows t, t+4, t+8, t+12
};

// Physical key (0..15 within the step) of logical score column n.
__device__ __forceinline__ int permuted_key(int n) { return (n & 7) / 2 + 4 * (n & 1) + 8 * (n / 8); }

// s[tile][i]: scores of the step (tile 0: logical keys 0..7, tile 1: 8..15); c0, c1 row g, c2, c3 row g + 8.
__device__ __forceinline__ void step_scores(float (&s)[2][4], const u32 (&qa)[kQuerySteps][4], const StepKeys& step) {
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
    s[tile][0] = s[tile][1] = s[tile][2] = s[tile][3] = 0.0f;
#pragma unroll
    for (int c = 0; c < kKeyChunks; ++c) {
      const uint4 kv = step.key[tile][c];
      mma(s[tile], qa[2 * c][0], qa[2 * c][1], qa[2 * c][2], qa[2 * c][3], kv.x, kv.y);
      mma(s[tile], qa[2 * c + 1][0], qa[2 * c + 1][1], qa[2 * c + 1][2], qa[2 * c + 1][3], kv.z, kv.w);
    }
  }
}

// o += P V for one step; p as the S C fragments (already exponentiated).
__device__ __forceinline__ void step_values(float (&o)[kValueTiles][4], const float (&p)[2][4], const StepValues& step) {
  const u32 a0 = pack_pair(p[0][0], p[0][1]), a1 = pack_pair(p[0][2], p[0][3]);
  const u32 a2 = pack_pair(p[1][0], p[1][1]), a3 = pack_pair(p[1][2], p[1][3]);
#pragma unroll
  for (int j = 0; j < kValueTiles; ++j) {
    const int half = j / 8, element = j % 8;
    const u32 selector = (element & 1) ? 0x7632u : 0x5410u;
    const u32 b0 = __byte_perm(component(step.value[0][half], element / 2), component(step.value[1][half], element / 2), selector);
    const u32 b1 = __byte_perm(component(step.value[2][half], element / 2), component(step.value[3][half], element / 2), selector);
    mma(o[j], a0, a1, a2, a3, b0, b1);
  }
}

// The running softmax state of this lane's two rows (g and g + 8): max m (the same in the 4
// lanes of a quad), the lane's share of the normalizer l, and the weighted sums in o.
struct RowState {
  float m[2];
  float l[2];
};

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Folds scores s[steps] (base-2, masked to -inf) into the state: the softmax law's merge of the
// running state with the block's summary. Returns the block's probabilities in s.
template <int kSteps>
__device__ __forceinline__ void fold_scores(RowState& state, float (&o)[kValueTiles][4], float (&s)[kSteps][2][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float block_max = negative_infinity();
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      block_max = fmaxf(block_max, fmaxf(fmaxf(s[st][0][2 * r], s[st][0][2 * r + 1]), fmaxf(s[st][1][2 * r], s[st][1][2 * r + 1])));
    }
    const float m_new = fmaxf(state.m[r], quad_max(block_max));
    // No key seen yet: exponentiate against 0 so that -inf - -inf never makes a NaN.
    const float m_use = m_new == negative_infinity() ? 0.0f : m_new;
    const float alpha = exp2f(state.m[r] - m_use);
    state.m[r] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(s[st][tile][2 * r + e] - m_use);
          s[st][tile][2 * r + e] = p;
          sum += p;
        }
      }
    }
    state.l[r] = state.l[r] * alpha + sum;
#pragma unroll
    for (int j = 0; j < kValueTiles; ++j) {
      o[j][2 * r] *= alpha;
      o[j][2 * r + 1] *= alpha;
    }
  }
}

// Scales a step's scores to base 2 and masks them: key `first + physical` is visible to a row
// when it is below `stop` and at or below the row's limit.
__device__ __forceinline__ void scale_and_mask(float (&s)[2][4], float scale_log2, bool needs_mask, int first, int stop,
                                               int limit_low, int limit_high, int t) {
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = first + t + 4 * e + 8 * tile;
      const bool inside = key < stop;
      s[tile][e] = needs_mask && !(inside && key <= limit_low) ? negative_infinity() : s[tile][e] * scale_log2;
      s[tile][2 + e] = needs_mask && !(inside && key <= limit_high) ? negative_infinity() : s[tile][2 + e] * scale_log2;
    }
  }
}

// Staged keys: K and V rows of kKeys keys in shared memory, K first. Padded rows keep the
// fragment loads free of bank conflicts: a K row is read by lanes whose keys differ by 4
// (4 · stride ≡ 64 bytes mod 128), a V row by lanes whose keys differ by 1 (stride ≡ 32 bytes mod 128).
constexpr int kKeyStride = kHeadDim + 8;
constexpr int kValueStride = kValueDim + 16;

__device__ __forceinline__ void copy_async_16(u16* shared, const u16* global) {
  const u32 address = (u32)__cvta_generic_to_shared(shared);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global));
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;"); }
template <int kPending>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;" ::"n"(kPending)); }

// Keys first .. first + kKeys - 1 of K and V into a stage (keys past last_readable repeat it),
// copied by kCopiers threads of which this is number `copier`.
template <int kKeys, int kCopiers>
__device__ __forceinline__ void copy_keys(u16* stage, const u16* __restrict__ k, const u16* __restrict__ v, int first,
                                          int last_readable, int copier) {
  constexpr int kKeyVectors = kHeadDim / 8, kValueVectors = kValueDim / 8;
#pragma unroll 4
  for (int i = copier; i < kKeys * kKeyVectors; i += kCopiers) {
    const int row = i / kKeyVectors, vector = i % kKeyVectors;
    const int key = min(first + row, last_readable);
    copy_async_16(stage + row * kKeyStride + 8 * vector, k + (u64)key * kHeadDim + 8 * vector);
  }
  u16* values = stage + kKeys * kKeyStride;
#pragma unroll 4
  for (int i = copier; i < kKeys * kValueVectors; i += kCopiers) {
    const int row = i / kValueVectors, vector = i % kValueVectors;
    const int key = min(first + row, last_readable);
    copy_async_16(values + row * kValueStride + 8 * vector, v + (u64)key * kValueDim + 8 * vector);
  }
}

template <int kKeys>
__device__ __forceinline__ void load_keys_shared(StepKeys& step, const u16* stage, int step_index, int g, int t) {
  const u16* keys = stage + 16 * step_index * kKeyStride;
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
    const int row = permuted_key(g + 8 * tile);
#pragma unroll
    for (int c = 0; c < kKeyChunks; ++c) {
      step.key[tile][c] = *reinterpret_cast<const uint4*>(keys + row * kKeyStride + 32 * c + 8 * t);
    }
  }
}

template <int kKeys>
__device__ __forceinline__ void load_values_shared(StepValues& step, const u16* stage, int step_index, int g, int t) {
  const u16* values = stage + kKeys * kKeyStride + 16 * step_index * kValueStride;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < kValueHalves; ++h) {
      step.value[i][h] = *reinterpret_cast<const uint4*>(values + (t + 4 * i) * kValueStride + 64 * h + 8 * g);
    }
  }
}
)CUDA";

constexpr std::string_view decode_body = R"CUDA(
constexpr int kPaddedRows = 16;
// Up to this many visible keys (two 16-key steps per warp: both in flight at once) a head is one
// split, whatever the grid: the other splits leave at once, and the one left writes the output
// without a split merge (no cluster barrier, no global partials).
constexpr int kOneSplitKeys = 32 * kWarps;

// kPrefetchRounds > 0 (DecodeAttentionConfig::l2_prefetch): the block asks the L2 for its keys
// ahead of its loads, kPrefetchRounds rounds of 16·kWarps keys, K and V each one contiguous range
// per round (a head's cache is [T, D]). One bulk prefetch per range, issued by the copy engine (TMA)
// without registers or load slots, so the DRAM sees the block's whole window requested at once;
// the loads below then meet those lines in (or on their way to) the L2. Only keys below `stop`
// (the split's visible end) are asked for, so nothing past the written cache is touched.
__device__ __forceinline__ void prefetch_keys_l2(const u16* __restrict__ k, const u16* __restrict__ v, int first, int stop) {
  const int count = min(16 * kWarps, stop - first);
  if (count <= 0) return;
  // Byte counts are multiples of 16 (a row is 128 or 256 bytes), addresses 16-byte aligned as
  // every vector load here already requires.
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(k + (u64)first * kHeadDim),
               "r"((u32)(count * kHeadDim * 2)) : "memory");
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(v + (u64)first * kValueDim),
               "r"((u32)(count * kValueDim * 2)) : "memory");
}

// A step's K and V fragments straight from global memory (keys past last_readable repeat it).
struct KeyStep {
  StepKeys keys;
  StepValues values;
};
__device__ __forceinline__ void load_step(KeyStep& step, const u16* __restrict__ k, const u16* __restrict__ v, int first,
                                          int last_readable, int g, int t) {
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
    const int key = min(first + permuted_key(g + 8 * tile), last_readable);
#pragma unroll
    for (int c = 0; c < kKeyChunks; ++c) step.keys.key[tile][c] = load_stream(k + (u64)key * kHeadDim + 32 * c + 8 * t);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = min(first + t + 4 * i, last_readable);
#pragma unroll
    for (int h = 0; h < kValueHalves; ++h) {
      step.values.value[i][h] = load_stream(v + (u64)key * kValueDim + 64 * h + 8 * g);
    }
  }
}

// Thread-block clusters (kCluster): the CTAs of one head read each other's shared memory.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_address(const void* shared, int rank) {
  u32 address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(address) : "r"((u32)__cvta_generic_to_shared(shared)), "r"(rank));
  return address;
}
__device__ __forceinline__ float2 load_cluster_float2(u32 address) {
  float2 x;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(x.x), "=f"(x.y) : "r"(address) : "memory");
  return x;
}
__device__ __forceinline__ float4 load_cluster_float4(u32 address) {
  float4 x;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(address) : "memory");
  return x;
}

extern "C" __global__ void CLUSTER_DIMENSIONS __launch_bounds__(kThreads) KERNEL_NAME(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const int* __restrict__ positions,
    u16* __restrict__ out, float* __restrict__ partial_values, float2* __restrict__ partial_states,
    unsigned* __restrict__ arrivals, int keys, float scale_log2, int offset) {
  // Programmatic dependent launch (attention_runtime.h): the next kernel may launch now; this one
  // reads q, the caches and the positions, and writes anything, only after the kernel before it
  // (which wrote q and the new cache rows) has finished. No-ops when launched plainly.
  // kCacheBeforeWait (DecodeAttentionConfig::cache_before_wait): the positions and every cache row
  // below the smallest of them are the graph's inputs, which no kernel of this run writes; they are
  // read before the wait, so the first step's DRAM round trip overlaps the previous kernel's tail.
  allow_dependent_launch();
  // Every pointer but those read before the wait is pinned after it (ordered_after_wait).
  auto pin_after_wait = [&] {
    out = ordered_after_wait(out), partial_values = ordered_after_wait(partial_values);
    partial_states = ordered_after_wait(partial_states), arrivals = ordered_after_wait(arrivals);
  };
  if constexpr (!kCacheBeforeWait) {
    q = after_previous_kernel(q);
    k = ordered_after_wait(k), v = ordered_after_wait(v), positions = ordered_after_wait(positions);
    pin_after_wait();
  }
  extern __shared__ float4 shared_words[];
  float2* shared_states = reinterpret_cast<float2*>(shared_words);              // [kWarps][kPaddedRows]
  float* shared_values = reinterpret_cast<float*>(shared_states + kWarps * kPaddedRows);  // [kWarps][kRows][kValueDim]
  __shared__ int last_arrival;
  __shared__ float2 block_states[kPaddedRows];  // kCluster: this CTA's merged (m, l) per row

  const int head = blockIdx.y, split = blockIdx.x, grid_splits = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  q += (u64)head * kRows * kHeadDim;
  k += (u64)head * keys * kHeadDim;
  v += (u64)head * keys * kValueDim;

  // kSpeculate: issued before the positions are read, in the same round trip: Q's fragments and,
  // in split 0 (its keys start at key 0 however the splits are sized), each warp's first step,
  // read up to the cache's capacity. Keys past the last visible one may hold anything (an
  // unwritten slot: NaN): below, their V rows become zeros and their scores are masked.
  // kSpeculateEverySplit (clusters over a short cache with the positions mask: the few-heads
  // default in the model engine's decode step): every split guesses that the visible keys give one
  // step per warp (a split of 16 · kWarps keys, as they do from kOneSplitKeys up to 16 · kWarps ·
  // grid_splits visible keys: 33..256 for Qwen's one-warp clusters of 16) and loads that step with
  // the positions; a wrong guess is dropped and the split's first step loaded after the positions.
  u32 qa[kQuerySteps][4];
  if constexpr (kSpeculate) load_query(qa, q, g, kRows, t);
  const bool speculative = kSpeculate && (split == 0 || kSpeculateEverySplit);
  const int guessed_begin = split * 16 * kWarps;
  KeyStep current;
  if (speculative) load_step(current, k, v, guessed_begin + 16 * warp, keys - 1, g, t);

  // Keys past the last one any row may see are never read (but for the speculative step above).
  int key_end = 0, min_limit = kNoLimit;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int limit = row_limit(r, positions, kPositionCount, offset);
    key_end = max(key_end, min(limit, keys - 1) + 1);
    min_limit = min(min_limit, limit);
  }
  const int limit_low = g < kRows ? row_limit(g, positions, kPositionCount, offset) : kNoLimit;
  const int limit_high = g + 8 < kRows ? row_limit(g + 8, positions, kPositionCount, offset) : kNoLimit;
  // The split follows the keys some row may see (key_end, from the positions read here or the
  // causal offset), not the cache's capacity: the grid's splits share them evenly in 16-key steps,
  // so a short prefix of a long cache keeps its splits short. Splits past key_end read nothing and
  // leave at once (in a cluster they still take part in the merge, as empty states). Up to
  // kOneSplitKeys visible keys the head is one split (split 0 alone, no merge of any kind).
  const int keys_per_split = key_end <= kOneSplitKeys
                                 ? max(16, (key_end + 15) / 16 * 16)
                                 : max(16, (key_end + 16 * grid_splits - 1) / (16 * grid_splits) * 16);
  const int splits = max(1, (key_end + keys_per_split - 1) / keys_per_split);
  // (splits is the same in every CTA of a cluster: with one split nothing reads another's memory.)
  if ((!kCluster || splits == 1) && split >= splits) {
    if constexpr (kCacheBeforeWait) wait_for_previous_kernel();  // its completion still follows the previous kernel's
    return;
  }
  const int split_begin = split * keys_per_split;
  const int split_end = min(split_begin + keys_per_split, key_end);
  const int last_readable = key_end - 1;
  const bool speculated = speculative && split_begin == guessed_begin;  // always so for split 0

  // kCacheBeforeWait: each warp's first step, if every one of its keys lies below the smallest
  // position (rows the previous kernel cannot have written), is loaded before the wait; the step
  // holding a new row, q and everything after them come after it.
  bool loaded_before_wait = false;
  if constexpr (kCacheBeforeWait) {
    const int first = split_begin + 16 * warp;
    if (first < split_end && first + 15 < min_limit) {
      load_step(current, k, v, first, last_readable, g, t);
      loaded_before_wait = true;
    }
    q = after_previous_kernel(q);
    k = ordered_after_wait(k), v = ordered_after_wait(v);
    pin_after_wait();
  }
  if constexpr (!kSpeculate) load_query(qa, q, g, kRows, t);
  RowState state = {{negative_infinity(), negative_infinity()}, {0.0f, 0.0f}};
  float o[kValueTiles][4];
#pragma unroll
  for (int j = 0; j < kValueTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

  // Warp w takes steps split_begin + 16 (w + kWarps i).
  const int stride = 16 * kWarps;
  if constexpr (kPrefetchRounds > 0) {
    // The first kPrefetchRounds rounds of the split, one lane of warp 0 per round, before this
    // block's first loads; warp 0 keeps the window kPrefetchRounds rounds ahead in the loop below.
    if (warp == 0 && lane < kPrefetchRounds) prefetch_keys_l2(k, v, split_begin + lane * stride, split_end);
  }
  if constexpr (kStages == 0) {
    // Registers: the next step's loads are in flight while this one's math runs.
    int first = split_begin + 16 * warp;
    if (speculated) {
      if (first < split_end) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (first + t + 4 * i > last_readable) {
#pragma unroll
            for (int h = 0; h < kValueHalves; ++h) current.values.value[i][h] = make_uint4(0u, 0u, 0u, 0u);
          }
        }
      }
    } else if (first < split_end && !loaded_before_wait) {
      load_step(current, k, v, first, last_readable, g, t);
    }
#pragma unroll 1
    for (; first < split_end; first += stride) {
      if constexpr (kPrefetchRounds > 0) {
        if (warp == 0 && lane == 0) prefetch_keys_l2(k, v, first + kPrefetchRounds * stride, split_end);
      }
      KeyStep next;
      const int next_first = first + stride;
      if (next_first < split_end) load_step(next, k, v, next_first, last_readable, g, t);
      float s[1][2][4];
      step_scores(s[0], qa, current.keys);
      const bool needs_mask = first + 15 >= split_end || first + 15 > min_limit;
      scale_and_mask(s[0], scale_log2, needs_mask, first, split_end, limit_low, limit_high, t);
      fold_scores<1>(state, o, s);
      step_values(o, s[0], current.values);
      current = next;
    }
  } else {
    // A ring of kStages steps per warp in shared memory, filled by cp.async: kStages - 1 steps in
    // flight without holding registers.
    constexpr int kRing = kStages > 0 ? kStages : 2;  // (this branch is discarded when kStages is 0)
    constexpr int kStepElements = 16 * (kKeyStride + kValueStride);
    u16* const ring = reinterpret_cast<u16*>(shared_words) + warp * kRing * kStepElements;
    int issue = split_begin + 16 * warp;
#pragma unroll
    for (int st = 0; st < kRing - 1; ++st) {
      if (issue < split_end) copy_keys<16, 32>(ring + st * kStepElements, k, v, issue, last_readable, lane);
      commit_copies();  // empty groups too, so that the count of pending groups stays uniform
      issue += stride;
    }
    int slot = 0;
#pragma unroll 1
    for (int first = split_begin + 16 * warp; first < split_end; first += stride) {
      if (issue < split_end) {
        copy_keys<16, 32>(ring + ((slot + kRing - 1) % kRing) * kStepElements, k, v, issue, last_readable, lane);
      }
      commit_copies();
      issue += stride;
      wait_copies<kRing - 1>();
      __syncwarp();  // every lane's copies of this step have landed
      const u16* stage = ring + slot * kStepElements;
      StepKeys step_keys;
      load_keys_shared<16>(step_keys, stage, 0, g, t);
      float s[1][2][4];
      step_scores(s[0], qa, step_keys);
      const bool needs_mask = first + 15 >= split_end || first + 15 > min_limit;
      scale_and_mask(s[0], scale_log2, needs_mask, first, split_end, limit_low, limit_high, t);
      fold_scores<1>(state, o, s);
      StepValues step_values_;
      load_values_shared<16>(step_values_, stage, 0, g, t);
      step_values(o, s[0], step_values_);
      __syncwarp();  // the slot is refilled next iteration
      slot = slot + 1 == kRing ? 0 : slot + 1;
    }
    wait_copies<0>();
    __syncthreads();  // the warp merge below reuses the rings' shared memory
  }

  // The warps meet: each writes its state, then the block merges them in warp order.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const float l = quad_sum(state.l[r]);
    if (t == 0) shared_states[warp * kPaddedRows + row] = make_float2(state.m[r], l);
    if (row < kRows) {
#pragma unroll
      for (int j = 0; j < kValueTiles; ++j) {
        const int column = 64 * (j / 8) + 16 * t + j % 8;
        float* values = shared_values + (warp * kRows + row) * kValueDim;
        values[column] = o[j][2 * r];
        values[column + 8] = o[j][2 * r + 1];
      }
    }
  }
  __syncthreads();

  for (int index = threadIdx.x; index < kRows * kValueDim; index += kThreads) {
    const int row = index / kValueDim, column = index % kValueDim;
    float m = negative_infinity();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, shared_states[w * kPaddedRows + row].x);
    const float m_use = m == negative_infinity() ? 0.0f : m;
    float l = 0.0f, value = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float2 warp_state = shared_states[w * kPaddedRows + row];
      const float weight = exp2f(warp_state.x - m_use);
      l += weight * warp_state.y;
      value += weight * shared_values[(w * kRows + row) * kValueDim + column];
    }
    if (splits == 1) {
      // 0 / 0 = NaN where no key was visible, as the reference.
      out[((u64)head * kRows + row) * kValueDim + column] = from_f32(value / l);
    } else if constexpr (kCluster) {
      if (column == 0) block_states[row] = make_float2(m, l);
      shared_values[row * kValueDim + column] = value;  // warp 0's slot: only this thread reads it
    } else {
      const u64 slot = (u64)head * grid_splits + split;
      if (column == 0) partial_states[slot * kRows + row] = make_float2(m, l);
      partial_values[(slot * kRows + row) * kValueDim + column] = value;  // 0 where the split saw no key
    }
  }
  constexpr int kVectors = kRows * kValueDim / 4;
  if (splits == 1) return;

  if constexpr (kCluster) {
    // The CTAs of this head are one cluster (split = rank): after a cluster barrier each CTA merges
    // a slice of the output vectors from every CTA's shared memory, in split order, with all of
    // its remote loads issued at once; a second barrier keeps every CTA's shared memory alive
    // until the last remote read. No global scratch, no fence, no arrival counter.
    cluster_sync();
    constexpr int kSlice = (kVectors + kClusterSplits - 1) / kClusterSplits;
    for (int index = threadIdx.x; index < kSlice && split * kSlice + index < kVectors; index += kThreads) {
      const int item = split * kSlice + index;
      const int row = item / (kValueDim / 4);
      float2 states[kClusterSplits];
      float4 values[kClusterSplits];
#pragma unroll
      for (int s = 0; s < kClusterSplits; ++s) {
        states[s] = load_cluster_float2(cluster_address(block_states + row, s));
        values[s] = load_cluster_float4(cluster_address(reinterpret_cast<const float4*>(shared_values) + item, s));
      }
      float m = negative_infinity();
#pragma unroll
      for (int s = 0; s < kClusterSplits; ++s) m = fmaxf(m, states[s].x);
      const float m_use = m == negative_infinity() ? 0.0f : m;
      float l = 0.0f;
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int s = 0; s < kClusterSplits; ++s) {
        const float weight = exp2f(states[s].x - m_use);
        l += weight * states[s].y;
        sum.x += weight * values[s].x;
        sum.y += weight * values[s].y;
        sum.z += weight * values[s].z;
        sum.w += weight * values[s].w;
      }
      // 0 / 0 = NaN where no key was visible, as the reference.
      const uint2 bits = make_uint2(pack_pair(sum.x / l, sum.y / l), pack_pair(sum.z / l, sum.w / l));
      *reinterpret_cast<uint2*>(out + (u64)head * kRows * kValueDim + 4 * (u64)item) = bits;
    }
    cluster_sync();
    return;
  }

  // The last split of this head to arrive merges every split's state, in split order. One thread
  // publishes the block's partial state: the barrier orders every thread's writes before its
  // fence, which is cumulative (the pattern of a cooperative grid barrier), then one atomic.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const bool last = atomicAdd(arrivals + head, 1u) == (unsigned)(splits - 1);
    if (last) {
      arrivals[head] = 0u;  // ready for the next launch
      __threadfence();      // the other splits' partial states are visible from here on
    }
    last_arrival = last;
  }
  __syncthreads();
  if (!last_arrival) return;
  // Every load of the merge is issued in one round (a serial walk over the splits would pay one
  // L2 round trip per split): the first kPrefetch splits' value vectors into registers, then the
  // states into shared memory; per row the max, each split's weight exp(m_split - m) and the
  // normalizer (a warp per row, lanes over splits, shuffle trees of fixed shape); then the
  // weighted sums, a 4-column vector per thread and item, in split order.
  float2* split_states = reinterpret_cast<float2*>(shared_words);  // [splits][kRows], reusing the warp merge's space
  __shared__ float normalizers[kPaddedRows];
  const float2* head_states = partial_states + (u64)head * grid_splits * kRows;
  constexpr int kItems = (kVectors + kThreads - 1) / kThreads;
  // A one-warp block over 16 rows of 128 columns has 16 items a thread: its sums alone are 64
  // registers, so it loads no split ahead and walks the splits one at a time (else it spills).
  constexpr int kPrefetch = kItems >= 16 ? 0 : kItems >= 8 ? 2 : 16 / kItems;
  constexpr int kSplitUnroll = kItems >= 16 ? 1 : 4;
  const float4* head_values = reinterpret_cast<const float4*>(partial_values) + (u64)head * grid_splits * kVectors;
  float4 prefetched[kPrefetch > 0 ? kPrefetch : 1][kItems];
#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int item = threadIdx.x + i * kThreads;
      prefetched[s][i] = s < splits && item < kVectors ? __ldcg(head_values + (u64)s * kVectors + item)
                                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  for (int i = threadIdx.x; i < splits * kRows; i += kThreads) split_states[i] = __ldcg(head_states + i);
  __syncthreads();
  for (int row = warp; row < kRows; row += kWarps) {
    float m = negative_infinity();
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, split_states[s * kRows + row].x);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    const float m_use = m == negative_infinity() ? 0.0f : m;
    float l = 0.0f;
    for (int s = lane; s < splits; s += 32) {
      const float2 split_state = split_states[s * kRows + row];
      const float weight = exp2f(split_state.x - m_use);
      split_states[s * kRows + row].x = weight;
      l += weight * split_state.y;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) l += __shfl_xor_sync(0xffffffffu, l, offset);
    if (lane == 0) normalizers[row] = l;
  }
  __syncthreads();
  float4 sums[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) sums[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  auto accumulate = [&](int s, int i, const float4& x) {
    const int item = threadIdx.x + i * kThreads;
    const float weight = split_states[s * kRows + item / (kValueDim / 4)].x;
    sums[i].x += weight * x.x;
    sums[i].y += weight * x.y;
    sums[i].z += weight * x.z;
    sums[i].w += weight * x.w;
  };
#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if (s < splits && threadIdx.x + i * kThreads < kVectors) accumulate(s, i, prefetched[s][i]);
    }
  }
#pragma unroll kSplitUnroll
  for (int s = kPrefetch; s < splits; ++s) {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int item = threadIdx.x + i * kThreads;
      if (item < kVectors) accumulate(s, i, __ldcg(head_values + (u64)s * kVectors + item));
    }
  }
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int item = threadIdx.x + i * kThreads;
    if (item < kVectors) {
      // 0 / 0 = NaN where no key was visible, as the reference.
      const float l = normalizers[item / (kValueDim / 4)];
      const uint2 bits = make_uint2(pack_pair(sums[i].x / l, sums[i].y / l), pack_pair(sums[i].z / l, sums[i].w / l));
      *reinterpret_cast<uint2*>(out + (u64)head * kRows * kValueDim + 4 * (u64)item) = bits;
    }
  }
}
)CUDA";

constexpr std::string_view prefill_body = R"CUDA(
constexpr int kTileRows = 16 * kWarps;
constexpr int kTileKeys = 64;
constexpr int kTileSteps = kTileKeys / 16;
constexpr int kStageElements = kTileKeys * (kKeyStride + kValueStride);
__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ __forceinline__ int warp_min(int v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

extern "C" __global__ void __launch_bounds__(kThreads) KERNEL_NAME(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const int* __restrict__ positions,
    u16* __restrict__ out, int rows, int keys, float scale_log2, int offset) {
  // Programmatic dependent launch, as in the decode kernel.
  allow_dependent_launch();
  q = after_previous_kernel(q);
  k = ordered_after_wait(k), v = ordered_after_wait(v), positions = ordered_after_wait(positions);
  out = ordered_after_wait(out);
  extern __shared__ float4 shared_words[];
  u16* const stages = reinterpret_cast<u16*>(shared_words);
  __shared__ int warp_key_ends[kWarps];

  const int head = blockIdx.y;
  const int tile = gridDim.x - 1 - blockIdx.x;  // the longest (last, under a causal mask) row tiles start first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  q += (u64)head * rows * kHeadDim;
  k += (u64)head * keys * kHeadDim;
  v += (u64)head * keys * kValueDim;
  out += (u64)head * rows * kValueDim;

  const int row_low = tile * kTileRows + 16 * warp + g, row_high = row_low + 8;
  const int limit_low = row_low < rows ? row_limit(row_low, positions, kPositionCount, offset) : kNoLimit;
  const int limit_high = row_high < rows ? row_limit(row_high, positions, kPositionCount, offset) : kNoLimit;
  // The warp reads keys up to its rows' last visible one; the block stages up to its warps' last.
  const int warp_key_end = warp_max(max(row_low < rows ? min(limit_low, keys - 1) + 1 : 0,
                                        row_high < rows ? min(limit_high, keys - 1) + 1 : 0));
  const int warp_min_limit = warp_min(min(limit_low, limit_high));
  if (lane == 0) warp_key_ends[warp] = warp_key_end;
  __syncthreads();
  int key_end = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) key_end = max(key_end, warp_key_ends[w]);

  u32 qa[kQuerySteps][4];
  load_query(qa, q, row_low, rows, t);
  RowState state = {{negative_infinity(), negative_infinity()}, {0.0f, 0.0f}};
  float o[kValueTiles][4];
#pragma unroll
  for (int j = 0; j < kValueTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

  const int tiles = (key_end + kTileKeys - 1) / kTileKeys;
  if (tiles > 0) {
    copy_keys<kTileKeys, kThreads>(stages, k, v, 0, key_end - 1, threadIdx.x);
    commit_copies();
  }
#pragma unroll 1
  for (int i = 0; i < tiles; ++i) {
    if (i + 1 < tiles) {
      copy_keys<kTileKeys, kThreads>(stages + ((i + 1) & 1) * kStageElements, k, v, (i + 1) * kTileKeys, key_end - 1,
                                     threadIdx.x);
      commit_copies();
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const int first = i * kTileKeys;
    const u16* stage = stages + (i & 1) * kStageElements;
    if (first < warp_key_end) {
      float s[kTileSteps][2][4];
#pragma unroll
      for (int st = 0; st < kTileSteps; ++st) {
        StepKeys step;
        load_keys_shared<kTileKeys>(step, stage, st, g, t);
        step_scores(s[st], qa, step);
        const int step_first = first + 16 * st;
        const bool needs_mask = step_first + 15 >= keys || step_first + 15 > warp_min_limit;
        scale_and_mask(s[st], scale_log2, needs_mask, step_first, keys, limit_low, limit_high, t);
      }
      fold_scores<kTileSteps>(state, o, s);
#pragma unroll
      for (int st = 0; st < kTileSteps; ++st) {
        StepValues step;
        load_values_shared<kTileKeys>(step, stage, st, g, t);
        step_values(o, s[st], step);
      }
    }
    __syncthreads();  // the stage is refilled two tiles later
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r == 0 ? row_low : row_high;
    const float l = quad_sum(state.l[r]);
    if (row < rows) {
#pragma unroll
      for (int h = 0; h < kValueHalves; ++h) {
        // 0 / 0 = NaN where no key was visible, as the reference.
        float e[2][8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          e[0][j] = o[8 * h + j][2 * r] / l;
          e[1][j] = o[8 * h + j][2 * r + 1] / l;
        }
#pragma unroll
        for (int side = 0; side < 2; ++side) {
          *reinterpret_cast<uint4*>(out + (u64)row * kValueDim + 64 * h + 16 * t + 8 * side) =
              pack_vector(e[side][0], e[side][1], e[side][2], e[side][3], e[side][4], e[side][5], e[side][6], e[side][7]);
        }
      }
    }
  }
}
)CUDA";

std::string constants(const AttentionProblem& problem, int warps, std::string_view kernel_name) {
  return fmt::format(
      "// Generated by metile: flash_attention {}\n"
      "#define KERNEL_NAME {}\n"
      "constexpr bool kHalf = {};\nconstexpr int kHeadDim = {};\nconstexpr int kValueDim = {};\n"
      "constexpr int kWarps = {};\nconstexpr int kMask = {};\nconstexpr int kPositionCount = {};\n",
      problem.to_string(), kernel_name, problem.dtype == DType::f16 ? "true" : "false", problem.head_dim,
      problem.value_dim, warps, static_cast<int>(problem.mask), std::max<std::int64_t>(problem.position_count, 1));
}

std::string problem_tag(const AttentionProblem& problem) {
  return fmt::format("{}_d{}_v{}_{}", dtype_name(problem.dtype), problem.head_dim, problem.value_dim,
                     attention_mask_name(problem.mask));
}

}  // namespace

std::string_view attention_mask_name(AttentionMask mask) {
  switch (mask) {
    case AttentionMask::none: return "none";
    case AttentionMask::causal: return "causal";
    case AttentionMask::positions: return "positions";
  }
  return "unknown";
}

AttentionMask parse_attention_mask(std::string_view name) {
  if (name == "none") return AttentionMask::none;
  if (name == "causal") return AttentionMask::causal;
  if (name == "positions") return AttentionMask::positions;
  throw InputError(fmt::format("flash_attention: mask '{}' is not one of none, causal, positions", name));
}

AttentionProblem AttentionProblem::grouped_query(DType dtype, std::int64_t kv_heads, std::int64_t groups,
                                                 std::int64_t tokens, std::int64_t keys, std::int64_t head_dim,
                                                 AttentionMask mask) {
  AttentionProblem problem;
  problem.dtype = dtype;
  problem.heads = kv_heads;
  problem.rows = groups * tokens;
  problem.keys = keys;
  problem.head_dim = problem.value_dim = head_dim;
  problem.scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  problem.mask = mask;
  problem.position_count = mask == AttentionMask::positions ? tokens : 0;
  return problem;
}

AttentionProblem AttentionProblem::from_specs(const TensorSpec& q, const TensorSpec& k, const TensorSpec& v,
                                              const std::optional<TensorSpec>& positions, double scale,
                                              std::string_view mask, std::int64_t offset) {
  auto require = [](bool condition, const std::string& message) {
    if (!condition) throw InputError("flash_attention: " + message);
  };
  require(q.rank() >= 2 && k.rank() == q.rank() && v.rank() == q.rank(),
          fmt::format("q {}, k {} and v {} must have the same rank, at least 2", q.to_string(), k.to_string(),
                      v.to_string()));
  const std::size_t rank = q.shape.size();
  AttentionProblem problem;
  problem.heads = 1;
  for (std::size_t d = 0; d + 2 < rank; ++d) {
    require(k.shape[d] == q.shape[d] && v.shape[d] == q.shape[d],
            fmt::format("q {}, k {} and v {} differ in leading dimension {}", q.to_string(), k.to_string(),
                        v.to_string(), d));
    problem.heads *= q.shape[d];
  }
  require(k.dtype == q.dtype && v.dtype == q.dtype,
          fmt::format("q, k and v must share one dtype (q {}, k {}, v {})", dtype_name(q.dtype), dtype_name(k.dtype),
                      dtype_name(v.dtype)));
  problem.dtype = q.dtype;
  problem.rows = q.shape[rank - 2];
  problem.head_dim = q.shape[rank - 1];
  problem.keys = k.shape[rank - 2];
  require(k.shape[rank - 1] == problem.head_dim,
          fmt::format("k {} must have q's head dimension {}", k.to_string(), problem.head_dim));
  require(v.shape[rank - 2] == problem.keys, fmt::format("v {} must have k's {} keys", v.to_string(), problem.keys));
  problem.value_dim = v.shape[rank - 1];
  problem.scale = scale;
  problem.mask = parse_attention_mask(mask);
  problem.offset = offset;
  if (problem.mask == AttentionMask::positions) {
    require(positions.has_value() && positions->dtype == DType::i32 && positions->rank() == 1,
            "mask 'positions' needs positions i32 [S]");
    problem.position_count = positions->shape[0];
  } else {
    require(!positions.has_value(), fmt::format("positions are given but the mask is '{}'", mask));
  }
  problem.validate();
  return problem;
}

void AttentionProblem::validate() const {
  auto require = [](bool condition, const std::string& message) {
    if (!condition) throw InputError("flash_attention kernel: " + message);
  };
  require(dtype == DType::f16 || dtype == DType::bf16, fmt::format("dtype {} (f16 or bf16)", dtype_name(dtype)));
  require(head_dim == 64 || head_dim == 128, fmt::format("head dimension {} (64 or 128)", head_dim));
  require(value_dim == 64 || value_dim == 128, fmt::format("value dimension {} (64 or 128)", value_dim));
  require(heads >= 1 && heads <= 65535, fmt::format("{} heads (1..65535)", heads));
  require(rows >= 1 && keys >= 1, fmt::format("{} rows and {} keys (at least 1 each)", rows, keys));
  // Offsets and element indices are 32-bit inside the kernels, row and key counts too.
  require(keys * std::max(head_dim, value_dim) < (std::int64_t{1} << 31) &&
              rows * std::max(head_dim, value_dim) < (std::int64_t{1} << 31),
          fmt::format("{} rows, {} keys: a head's K, V or q exceeds 2^31 elements", rows, keys));
  require(std::isfinite(scale), "the scale must be finite");
  require(std::abs(offset) < (std::int64_t{1} << 30), fmt::format("causal offset {} out of range", offset));
  if (mask == AttentionMask::positions) {
    require(position_count >= 1 && rows % position_count == 0,
            fmt::format("{} rows are not a multiple of {} positions", rows, position_count));
  }
}

std::string AttentionProblem::to_string() const {
  std::string mask_text(attention_mask_name(mask));
  if (mask == AttentionMask::causal) mask_text += fmt::format("({:+d})", offset);
  if (mask == AttentionMask::positions) mask_text += fmt::format("[{}]", position_count);
  return fmt::format("{} heads {} R {} T {} D {} Dv {} {}", dtype_name(dtype), heads, rows, keys, head_dim, value_dim,
                     mask_text);
}

std::int64_t AttentionProblem::key_value_bytes() const {
  return heads * keys * (head_dim + value_dim) * dtype_size(dtype);
}

std::int64_t decode_keys_per_split(const AttentionProblem& problem, int warps, int multiprocessors) {
  const std::int64_t step_keys = 16;
  // Measured (notes/attention.md): one 8-warp block per multiprocessor (all that fit: ~250
  // registers a thread) beat two 4-warp ones, and the grid must not exceed one wave — 17 splits of
  // 8 heads (136 blocks on 132 multiprocessors) ran slower than 9.
  const std::int64_t target_blocks = std::max(multiprocessors, 1);
  const std::int64_t most_splits = (problem.keys + step_keys * warps - 1) / (step_keys * warps);  // a step per warp
  const std::int64_t splits = std::clamp<std::int64_t>(target_blocks / problem.heads, 1, most_splits);
  const std::int64_t keys = (problem.keys + splits - 1) / splits;
  return (keys + step_keys - 1) / step_keys * step_keys;
}

DecodeShape default_decode_shape(const AttentionProblem& problem) {
  if (problem.keys <= kLongestOneSplit) {
    // Very few heads: two-warp blocks, a head's splits one cluster (measured, notes/attention.md
    // session 7: Qwen2.5-1.5B's 2 heads 5.17 against 5.78 us one-split at 128 keys; Llama-3.2-1B's 8
    // heads keep the one-split grid, 3.45 against 3.94 us).
    if (problem.heads < kClusteredShortCacheHeads) return {2, true, false};
    return {8, false, true};
  }
  if (problem.keys <= kLongestClustered) return {4, true, false};
  return {8, false, false};
}

std::int64_t decode_ring_bytes(const DecodeAttentionConfig& config) {
  const AttentionProblem& p = config.problem;
  return static_cast<std::int64_t>(config.warps) * config.stages * 16 * (p.head_dim + 8 + p.value_dim + 16) * 2;
}

void DecodeAttentionConfig::validate() const {
  problem.validate();
  if (!problem.is_decode()) {
    throw InputError(fmt::format("decode attention: {} rows (the decode kernel takes 1..16)", problem.rows));
  }
  if (warps != 1 && warps != 2 && warps != 4 && warps != 8) {
    throw InputError(fmt::format("decode attention: {} warps (1, 2, 4 or 8)", warps));
  }
  if (stages != 0 && (stages < 2 || stages > 4)) {
    throw InputError(fmt::format("decode attention: {} stages (0: registers, or 2..4)", stages));
  }
  if (l2_prefetch && stages != 0) {
    throw InputError(fmt::format("decode attention: the L2 prefetch runs with the register path (stages 0), not {} stages",
                                 stages));
  }
  if (cache_before_wait && (problem.mask != AttentionMask::positions || stages != 0)) {
    throw InputError("decode attention: the cache is read before the wait only with the positions mask and the "
                     "register path (stages 0)");
  }
  if (decode_ring_bytes(*this) > 227 * 1024) {
    throw InputError(fmt::format("decode attention: {} warps x {} stages need {} bytes of shared memory (227 KiB at most)",
                                 warps, stages, decode_ring_bytes(*this)));
  }
  if (keys_per_split < 0 || keys_per_split % 16 != 0) {
    throw InputError(fmt::format("decode attention: {} keys per split (a multiple of 16)", keys_per_split));
  }
  if (cluster) {
    const std::int64_t splits = decode_split_count(*this);
    if (splits > kMaxClusterSplits) {
      throw InputError(fmt::format("decode attention: {} splits in one cluster (at most {})", splits, kMaxClusterSplits));
    }
  }
}

int decode_prefetch_rounds(const DecodeAttentionConfig& config) {
  if (!config.l2_prefetch) return 0;
  const std::int64_t round_bytes =
      16 * config.warps * (config.problem.head_dim + config.problem.value_dim) * dtype_size(config.problem.dtype);
  return static_cast<int>(std::clamp<std::int64_t>(kL2PrefetchWindowBytes / round_bytes, 1, 32));
}

std::int64_t decode_split_count(const DecodeAttentionConfig& config) {
  const std::int64_t keys_per_split =
      config.keys_per_split > 0 ? config.keys_per_split
                                : decode_keys_per_split(config.problem, config.warps,
                                                        config.cluster ? std::min<std::int64_t>(132, kMaxClusterSplits * config.problem.heads) : 132);
  return (config.problem.keys + keys_per_split - 1) / keys_per_split;
}

void PrefillAttentionConfig::validate() const {
  problem.validate();
  if (warps != 4 && warps != 8) throw InputError(fmt::format("prefill attention: {} warps (4 or 8)", warps));
}

AttentionKernelSource generate_decode_attention_kernel(const DecodeAttentionConfig& config) {
  config.validate();
  const AttentionProblem& problem = config.problem;
  AttentionKernelSource result;
  result.splits = decode_split_count(config);
  result.keys_per_split = (problem.keys + result.splits - 1) / result.splits;
  result.keys_per_split = (result.keys_per_split + 15) / 16 * 16;  // as the kernel sizes a split of `keys` visible keys
  // A cluster of one split is no cluster: that kernel is the plain one.
  const bool cluster = config.cluster && result.splits > 1;
  // Split 0 loads its first step with the positions (kSpeculate) in the short-cache shapes: one
  // split, or a cluster (whose split 0 takes a short context alone). Not in the global-merge
  // kernel: its 8-warp, 128-wide variant (the long-context default) would go from 251 to 255
  // registers, and at long contexts that round trip is not the critical path.
  // With the cache read before the wait (cache_before_wait) the positions are known before q is,
  // so nothing is guessed.
  const bool speculate = config.stages == 0 && (result.splits == 1 || cluster) && !config.cache_before_wait;
  // Every split of a cluster guesses its first step (kSpeculateEverySplit) only where the positions
  // mask makes the split wait for a global round trip, and over short caches (where a context's
  // visible keys are mostly within the guess's range): elsewhere a wrong guess is bytes read twice.
  const bool speculate_every_split =
      speculate && cluster && problem.mask == AttentionMask::positions && problem.keys <= kLongestOneSplit;
  const int prefetch_rounds = decode_prefetch_rounds(config);
  result.kernel_name = fmt::format("metile_attention_decode_{}_r{}_w{}_k{}{}{}{}", problem_tag(problem), problem.rows,
                                   config.warps, config.stages,
                                   cluster ? fmt::format("_cluster{}", result.splits) : std::string(),
                                   prefetch_rounds > 0 ? "_l2prefetch" : "", config.cache_before_wait ? "_cachefirst" : "");
  result.source = constants(problem, config.warps, result.kernel_name);
  result.source += fmt::format(
      "constexpr int kRows = {};\nconstexpr int kStages = {};\nconstexpr bool kCluster = {};\n"
      "constexpr int kClusterSplits = {};\nconstexpr bool kSpeculate = {};\nconstexpr bool kSpeculateEverySplit = {};\n"
      "constexpr int kPrefetchRounds = {};\nconstexpr bool kCacheBeforeWait = {};\n#define CLUSTER_DIMENSIONS {}\n",
      problem.rows, config.stages, cluster ? "true" : "false", cluster ? result.splits : 1, speculate ? "true" : "false",
      speculate_every_split ? "true" : "false", prefetch_rounds, config.cache_before_wait ? "true" : "false",
      cluster ? fmt::format("__cluster_dims__({}, 1, 1)", result.splits) : std::string());
  result.source += codegen_detail::tensor_core_device_helpers();
  result.source += common_body;
  result.source += decode_body;
  result.cluster = cluster;
  result.launch.grid_x = static_cast<std::uint32_t>(result.splits);
  result.launch.grid_y = static_cast<std::uint32_t>(problem.heads);
  result.launch.block_x = static_cast<std::uint32_t>(config.warps * 32);
  // One space reused three times: the warps' rings of staged keys (stages > 0), the warps' states
  // and values, every split's states in the split merge.
  result.launch.shared_memory_bytes = static_cast<std::uint32_t>(
      std::max({decode_ring_bytes(config), config.warps * 16 * 8 + config.warps * problem.rows * problem.value_dim * 4,
                result.splits * problem.rows * 8}));
  result.summary = fmt::format("decode {} warp{}{}{}{}{}, {} splits of {} keys", config.warps, config.warps == 1 ? "" : "s",
                               config.stages > 0 ? fmt::format(" {}-stage ring", config.stages) : "",
                               cluster ? ", cluster" : "",
                               prefetch_rounds > 0 ? fmt::format(", L2 prefetch {} rounds", prefetch_rounds) : "",
                               config.cache_before_wait ? ", cache before the wait" : "", result.splits,
                               result.keys_per_split);
  return result;
}

AttentionKernelSource generate_prefill_attention_kernel(const PrefillAttentionConfig& config) {
  config.validate();
  const AttentionProblem& problem = config.problem;
  AttentionKernelSource result;
  result.kernel_name = fmt::format("metile_attention_prefill_{}_w{}", problem_tag(problem), config.warps);
  result.source = constants(problem, config.warps, result.kernel_name);
  result.source += codegen_detail::tensor_core_device_helpers();
  result.source += common_body;
  result.source += prefill_body;
  const std::int64_t tile_rows = 16 * config.warps;
  result.launch.grid_x = static_cast<std::uint32_t>((problem.rows + tile_rows - 1) / tile_rows);
  result.launch.grid_y = static_cast<std::uint32_t>(problem.heads);
  result.launch.block_x = static_cast<std::uint32_t>(config.warps * 32);
  const std::int64_t stage_elements = 64 * (problem.head_dim + 8 + problem.value_dim + 16);
  result.launch.shared_memory_bytes = static_cast<std::uint32_t>(2 * stage_elements * 2);
  result.summary = fmt::format("prefill {} warps, {}-row x 64-key tiles", config.warps, tile_rows);
  return result;
}

}  // namespace metile
