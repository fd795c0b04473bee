// Decode attention inside the output projection's GEMV (GemvKernelConfig::attention, gemv.h; the
// attention_output_projection region, src/fusion/rules.cpp). A decode step otherwise runs attention
// as a kernel of its own between the q/k/v GEMV and this one: at 128 cached keys it reads ~0.5 MB
// and costs 4.4 us a layer inside the step, nearly all of it latency and the two kernel boundaries
// around it (notes/attention.md, sessions 11 and 13). Here the GEMV's blocks 0 .. kv_heads - 1 each
// attend over one KV head while every block already has its first weight batches in flight, and the
// projection reads the result through L2 as soon as the last head has arrived: one boundary a layer
// fewer, and the projection's weights stream during attention instead of after it.
//
//   per head   q [G, D] into shared memory (f32); the visible keys (j <= positions[0]) in chunks of
//              kThreads / 2: two lanes a key take half of D each for the G scores (f32 products of
//              the stored values, scaled by scale · log2 e), then per query row a running max and
//              sum over the chunk (exp2, the softmax law's rescale of what came before), then each
//              lane adds its slice of the chunk's keys times V for two value columns; the slices are
//              added by a butterfly of shuffles (the same sum on every lane, in a fixed order), and
//              the rows divided by their sums and rounded to the activation dtype go into x.
//   the grid   every block waits for the previous kernel, then (thread 0) for kv_heads arrivals
//              (ld.acquire.gpu), then departs; the last block to depart re-arms both counters for
//              the next launch or graph replay. x is then read through L2 (kXWrittenInKernel).
//
// Why the grid cannot deadlock: a block waits only for the attention blocks' arrivals, and an
// attention block waits for nothing but the previous kernel and memory. All blocks must be resident
// at once (LoadedGemv::load refuses the kernel otherwise: co_resident_blocks_per_multiprocessor). The
// kernel lets its dependent launch at its start as every GEMV does; that launch happens only once
// every block of this grid has started, so a dependent's blocks never hold an SM that a block of this
// grid still waits for.
#include <fmt/core.h>

#include <cmath>

#include "gemv_internal.h"

namespace metile::gemv_detail {

namespace {

constexpr int kLanesPerKey = 2;

int chunk_keys(const GemvKernelConfig& config) { return config.warps_per_block * 32 / kLanesPerKey; }

constexpr std::string_view attention_body = R"CUDA(
// ---- the attention prologue (src/codegen/gemv_attention.cpp)
constexpr int kAttentionPairsPerWarp = kAttentionDim / 2 / kWarps;  // value-column pairs a warp owns
constexpr int kAttentionSlices = 32 / kAttentionPairsPerWarp;       // lanes sharing one pair: key slices
constexpr int kAttentionPartDim = kAttentionDim / kAttentionLanesPerKey;

struct AttentionArguments {
  const u16* q;          // [Hkv, G, D]
  const u16* k;          // [Hkv, keys, D]
  const u16* v;          // [Hkv, keys, D]
  const int* positions;  // [1]
  u32* counters;         // arrivals, departures
};
__shared__ AttentionArguments attention_arguments;  // thread 0 sets it at the kernel's entry
__shared__ float attention_q[kAttentionGroups][kAttentionDim];
__shared__ float attention_scores[kAttentionGroups][kAttentionChunk];
__shared__ float attention_max[kAttentionGroups], attention_sum[kAttentionGroups], attention_rescale[kAttentionGroups];

#define kAttentionInfinity __int_as_float(0x7F800000)  // NVRTC has no <cmath> INFINITY
// max that keeps a NaN (fmaxf drops it): a NaN score makes its row NaN, as the reference's softmax.
__device__ __forceinline__ float attention_max_of(float a, float b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ float attention_warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value = attention_max_of(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  return value;
}
__device__ __forceinline__ float attention_warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  return value;
}
// K, V and q were written by earlier kernels (the q/k/v GEMV just before this one): read through L2
// after the wait, never through the read-only path.
__device__ __forceinline__ uint4 attention_load16(const u16* address) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(address));
  return v;
}
__device__ __forceinline__ u32 attention_load4(const u16* address) {
  u32 v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(address));
  return v;
}
__device__ __forceinline__ u32 attention_load2(const u16* address) {
  unsigned short v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(address));
  return v;
}

// Before the wait for the previous kernel: KV head `head`'s K and V rows up to the position requested
// into L2 (a hint: the position is read before the wait, so it may be one the previous kernel has yet
// to write, and only bounds which rows are asked for; the L2 is coherent, so no row read later can be
// stale). The rows the previous kernel writes are read after the wait in any case.
__device__ __forceinline__ void attention_prefetch_rows(const AttentionArguments& arguments, const int head) {
  int position;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(position) : "l"(arguments.positions));
  const int rows = min(max(position, 0), kAttentionKeys - 1) + 1;
  constexpr int kLinesPerRow = kAttentionDim * 2 / 128;
  const long long first = (long long)head * kAttentionKeys * kAttentionDim;
  for (int line = threadIdx.x; line < 2 * rows * kLinesPerRow; line += kThreads) {
    const int row_line = line >> 1;
    const u16* base = (line & 1) ? arguments.v : arguments.k;
    const u16* address = base + first + (long long)(row_line / kLinesPerRow) * kAttentionDim + (row_line % kLinesPerRow) * 64;
    asm volatile("prefetch.global.L2 [%0];" :: "l"(address));
  }
}

// KV head `head`'s G output rows, over keys 0 .. last, into out [G, D] (this head's part of x).
__device__ __forceinline__ void attend(const u16* __restrict__ q_all, const u16* __restrict__ k_all,
                                       const u16* __restrict__ v_all, const int last, const int head, u16* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long head_rows = (long long)head * kAttentionKeys;
  // This thread's key of a chunk and its half of D. (Its first chunk's K loads issued before q's
  // cost ptxas 25-60 more registers, spilled beside the weight batches in flight: not done.)
  const int slot = threadIdx.x / kAttentionLanesPerKey, part = threadIdx.x % kAttentionLanesPerKey;
  const u16* q = q_all + (long long)head * kAttentionGroups * kAttentionDim;
  for (int e = threadIdx.x; e < kAttentionGroups * kAttentionDim; e += kThreads) {
    attention_q[e / kAttentionDim][e % kAttentionDim] = to_f32(attention_load2(q + e));
  }
  if (threadIdx.x < kAttentionGroups) {
    attention_max[threadIdx.x] = -kAttentionInfinity;
    attention_sum[threadIdx.x] = 0.0f;
  }
  const int pair = warp * kAttentionPairsPerWarp + (lane % kAttentionPairsPerWarp);
  const int slice = lane / kAttentionPairsPerWarp;
  float acc[kAttentionGroups][2];
#pragma unroll
  for (int i = 0; i < kAttentionGroups; ++i) acc[i][0] = acc[i][1] = 0.0f;
  __syncthreads();
  for (int chunk = 0; chunk <= last; chunk += kAttentionChunk) {
    {  // Scores: two lanes a key, each over half of D.
      const int key = chunk + slot;
      float score[kAttentionGroups];
#pragma unroll
      for (int i = 0; i < kAttentionGroups; ++i) score[i] = 0.0f;
      if (key <= last) {
        const u16* row = k_all + (head_rows + key) * kAttentionDim + part * kAttentionPartDim;
        uint4 words[kAttentionPartDim / 8];
#pragma unroll
        for (int c = 0; c < kAttentionPartDim / 8; ++c) words[c] = attention_load16(row + 8 * c);
#pragma unroll
        for (int c = 0; c < kAttentionPartDim / 8; ++c) {
          const u32 word[4] = {words[c].x, words[c].y, words[c].z, words[c].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float k0 = to_f32(word[e] & 0xFFFFu), k1 = to_f32(word[e] >> 16);
            const int d = part * kAttentionPartDim + 8 * c + 2 * e;
#pragma unroll
            for (int i = 0; i < kAttentionGroups; ++i) {
              score[i] = fmaf(attention_q[i][d + 1], k1, fmaf(attention_q[i][d], k0, score[i]));
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kAttentionGroups; ++i) {
#pragma unroll
        for (int offset = 1; offset < kAttentionLanesPerKey; offset <<= 1) {
          score[i] += __shfl_xor_sync(0xFFFFFFFFu, score[i], offset);
        }
        if (part == 0) attention_scores[i][slot] = key <= last ? score[i] * kAttentionScaleLog2 : -kAttentionInfinity;
      }
    }
    __syncthreads();
    // The running softmax: warp w updates rows w, w + kWarps, ... over this chunk.
    for (int i = warp; i < kAttentionGroups; i += kWarps) {
      float top = -kAttentionInfinity;
      for (int s = lane; s < kAttentionChunk; s += 32) top = attention_max_of(top, attention_scores[i][s]);
      top = attention_warp_max(top);
      const float before = attention_max[i];
      const float now = attention_max_of(before, top);
      float total = 0.0f;
      for (int s = lane; s < kAttentionChunk; s += 32) {
        const float score = attention_scores[i][s];
        const float p = score == -kAttentionInfinity ? 0.0f : exp2f(score - now);  // a masked key weighs nothing
        attention_scores[i][s] = p;
        total += p;
      }
      total = attention_warp_sum(total);
      if (lane == 0) {
        const float rescale = before == -kAttentionInfinity ? 0.0f : exp2f(before - now);
        attention_rescale[i] = rescale;
        attention_sum[i] = attention_sum[i] * rescale + total;
        attention_max[i] = now;
      }
    }
    __syncthreads();
    // P V: this lane's slice of the chunk's keys, for its two value columns.
#pragma unroll
    for (int i = 0; i < kAttentionGroups; ++i) {
      const float rescale = attention_rescale[i];
      acc[i][0] *= rescale;
      acc[i][1] *= rescale;
    }
    const int keys_here = min(kAttentionChunk, last + 1 - chunk);
    // Eight keys' loads in flight at a time (V is in L2: attention_prefetch_rows).
    for (int first = slice; first < keys_here; first += 8 * kAttentionSlices) {
      u32 bits[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int key_slot = first + u * kAttentionSlices;
        bits[u] = key_slot < keys_here ? attention_load4(v_all + (head_rows + chunk + key_slot) * kAttentionDim + 2 * pair) : 0u;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int key_slot = first + u * kAttentionSlices;
        if (key_slot >= keys_here) break;
        const float v0 = to_f32(bits[u] & 0xFFFFu), v1 = to_f32(bits[u] >> 16);
#pragma unroll
        for (int i = 0; i < kAttentionGroups; ++i) {
          const float p = attention_scores[i][key_slot];
          acc[i][0] = fmaf(p, v0, acc[i][0]);
          acc[i][1] = fmaf(p, v1, acc[i][1]);
        }
      }
    }
    __syncthreads();  // the next chunk's scores overwrite these
  }
#pragma unroll
  for (int i = 0; i < kAttentionGroups; ++i) {
#pragma unroll
    for (int offset = kAttentionPairsPerWarp; offset < 32; offset <<= 1) {
      acc[i][0] += __shfl_xor_sync(0xFFFFFFFFu, acc[i][0], offset);
      acc[i][1] += __shfl_xor_sync(0xFFFFFFFFu, acc[i][1], offset);
    }
  }
  if (slice == 0) {
#pragma unroll
    for (int i = 0; i < kAttentionGroups; ++i) {
      const float sum = attention_sum[i];  // 0 for a row that sees no key: 0 / 0, NaN
      const u32 bits = (u32)from_f32(acc[i][0] / sum) | ((u32)from_f32(acc[i][1] / sum) << 16);
      *reinterpret_cast<u32*>(out + ((long long)(head * kAttentionGroups + i) * kAttentionDim + 2 * pair)) = bits;
    }
  }
}

// x is this kernel's own attention output: ready once every KV head's block has written its rows.
// Every thread of the block calls this once (the mainloop's one call a warp), so its barriers hold.
template <class T>
__device__ __forceinline__ T* activations_ready(T* pointer) {
  __syncthreads();  // attention_arguments, set by thread 0 at the entry
  const AttentionArguments arguments = attention_arguments;
  if (blockIdx.x < kAttentionHeads) attention_prefetch_rows(arguments, (int)blockIdx.x);
  wait_for_previous_kernel();
  u32* const counters = ordered_after_wait(arguments.counters);
  if (blockIdx.x < kAttentionHeads) {
    const int last = min(*ordered_after_wait(arguments.positions), kAttentionKeys - 1);
    attend(ordered_after_wait(arguments.q), ordered_after_wait(arguments.k), ordered_after_wait(arguments.v), last,
           (int)blockIdx.x, const_cast<u16*>(reinterpret_cast<const u16*>(pointer)));
    __threadfence();  // this head's rows, before its arrival
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(counters, 1u);
  }
  if (threadIdx.x == 0) {
    wait_for_arrivals(counters, (u32)kAttentionHeads);
    // Depart. Once every block has departed none still reads the arrivals: the last re-arms both.
    if (atomicAdd(counters + 1, 1u) == gridDim.x - 1) {
      atomicExch(counters, 0u);
      atomicExch(counters + 1, 0u);
    }
  }
  __syncthreads();
  asm volatile("mov.b64 %0, %0;" : "+l"(pointer) :: "memory");
  return pointer;
}
)CUDA";

}  // namespace

std::string gemv_attention_prologue(const GemvKernelConfig& config) {
  const GemvAttentionPrologue& attention = config.attention.value();
  const double scale_log2 = flash_attention_scale_log2(attention.scale);  // an f32: 9 digits give it back exactly
  return fmt::format(
             "constexpr int kAttentionHeads = {};\nconstexpr int kAttentionGroups = {};\nconstexpr int kAttentionDim = {};\n"
             "constexpr int kAttentionKeys = {};\nconstexpr float kAttentionScaleLog2 = {:.9g}f;  // scale {:.17g} x log2(e)\n"
             "constexpr int kAttentionLanesPerKey = {};\nconstexpr int kAttentionChunk = {};\n",
             attention.kv_heads, attention.groups, attention.head_dim, attention.keys, scale_log2, attention.scale,
             kLanesPerKey, chunk_keys(config)) +
         std::string(gemv_arrival_wait()) + std::string(attention_body);
}

std::int64_t gemv_attention_shared_bytes(const GemvKernelConfig& config) {
  if (!config.attention) return 0;
  const GemvAttentionPrologue& attention = *config.attention;
  return 4 * attention.groups * (attention.head_dim + chunk_keys(config) + 3) + 48;
}

}  // namespace metile::gemv_detail
