// The GEMV mainloop generator: y[m, n] = epilogue(sum_k x[m, k] W_p[n, k]) for M = 1..16
// activation rows, reading each weight byte once. Memory-bound by design, so the shape is
// chosen around the loads:
//
//   block  = `warps` warps x `tiles` 16-row tiles of W; the warps split K (iteration i goes to
//            warp i mod warps) and meet in shared memory at the end
//   split-K: with k_splits > 1, that many blocks share a tile's K range (a narrow N still gives
//            every SM blocks); each writes fp32 partials to the workspace, the last to arrive
//            adds them in split order and applies the epilogue
//   warp   : per iteration, per tile and matrix, two 16-byte loads per lane (rows 0..7 and
//            8..15 of the tile), `in_flight` iterations issued before any math: into registers,
//            or (shared_stages) by cp.async into a per-warp ring of shared-memory slots that
//            many batches deep, read back just before the math
//   math   : tensor-core mma.m16n8k16 with the weight tile as A (16 rows x 16 columns) and up
//            to 8 activation rows as B (two B halves for M > 8); f32 accumulation
//   affine : codes become f16/bf16 with one shift-and-mask-or per pair (the "magic number"
//            trick: 0x4300 | q is bf16 128 + q), so per group
//                acc += scale * sum((offset + q) x) + (bias - offset * scale) * sum(x)
//            with sum(x) from one extra mma against a tile of ones
//
// Dense weights are read in their own [N, K] layout. The A-fragment columns a lane holds are a
// permutation of the physical columns (lane t owns columns 8t..8t+7 of each 32-column chunk);
// the B fragments use the same permutation, so the dot product is unchanged. Affine weights
// are read in the repacked layout of gemv_weight_layout.cpp.
//
// The generated source is self-contained (no includes): its constants come first, then the device
// helpers both mainloops share (gemv_device_helpers.cpp), then this file's register-batch body,
// the op table's device functions, then the epilogue expression (gemv_epilogue.cpp) inside the
// store loop. The other mainloop, shared-memory stages fed by bulk copies on a persistent grid,
// is gemv_streamed.cpp.
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>

#include "codegen_internal.h"
#include "gemv_internal.h"
#include "metile/gemv.h"

namespace metile {
using namespace gemv_detail;
namespace {

constexpr std::string_view register_mainloop_body = R"CUDA(
// The block timeline: a diagnostic that costs nothing unless the source is compiled with
// METILE_TIMELINE_BASE defined (gemv_timeline_source). Each warp keeps %globaltimer stamps in its 32
// u64 slots of shared memory (so that the loop holds no global address and stores nothing to global
// memory) and copies them, at the block's end, to record (block * kWarps + warp) * 32 of the buffer at
// METILE_TIMELINE_BASE: 0 the block's start,
// 1 the wait for the previous kernel returned, 2 the warp's accumulate done, 3 the block's store done,
// then per register batch b < 8: 4 + 3b its loads issued, 5 + 3b its last load landed, 6 + 3b its math
// done (later batches share slots 25-27); slot 31 the SM's id. "Landed" waits on the batch's last
// register, so with the timeline the math starts only once the whole batch is in.
#ifdef METILE_TIMELINE_BASE
__shared__ u64 timeline_slots[kWarps * 32];
__device__ __forceinline__ void timeline_stamp(int slot) {
  u64 now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  timeline_slots[(threadIdx.x >> 5) * 32 + slot] = now;  // every lane the same value: no branch
}
__device__ __forceinline__ void timeline_stamp_landed(int slot, u32 last_loaded) {
  u64 now;
  asm volatile("mov.u64 %0, %%globaltimer; // %1" : "=l"(now) : "r"(last_loaded));
  timeline_slots[(threadIdx.x >> 5) * 32 + slot] = now;
}
__device__ __forceinline__ void timeline_start() {
  const int lane = threadIdx.x & 31;
  u32 sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  timeline_slots[threadIdx.x] = lane == 31 ? sm : 0;  // kThreads == kWarps * 32 slots
  __syncwarp();
  timeline_stamp(0);
}
__device__ __forceinline__ void timeline_flush() {
  __syncwarp();
  reinterpret_cast<u64*>(METILE_TIMELINE_BASE)[(u64)blockIdx.x * kThreads + threadIdx.x] = timeline_slots[threadIdx.x];
}
#else
__device__ __forceinline__ void timeline_stamp(int) {}
__device__ __forceinline__ void timeline_stamp_landed(int, u32) {}
__device__ __forceinline__ void timeline_start() {}
__device__ __forceinline__ void timeline_flush() {}
#endif
// The weights (and scales/biases) of kInFlight iterations of one warp: the unit the mainloop
// keeps in flight. x is not part of it: every warp of the SM reads the same x, so its loads hit L1
// and are issued just before the math.
// kXWithBatch (GemvKernelConfig::x_with_batch): a batch also carries its iterations' x fragments, loaded
// with its weights once the wait has returned (load_batch_x), so that the math never waits on x.
static_assert(!kXWithBatch || (kDoubleBuffered && kSharedStages < 2 && !kNormedX && !kXStaged && !kXWrittenInKernel),
              "x travels with double-buffered register batches of x as stored");
template <int P>
struct Batch {
  uint4 w[kInFlight][P][kTiles][kLoadsPerIteration][2];
  uint2 sb[kInFlight][P][kTiles][kGroupsPerIteration];
  uint4 x[kXWithBatch ? kInFlight : 1][kRowHalves][kChunksPerIteration];
};

// The timeline's three stamps of the warp's b-th batch: only with METILE_TIMELINE_BATCHES as well,
// since they change the code they measure (ptxas no longer sinks a batch's later loads into its
// math: 4-bit g64 gate/up w4 f2 batch spills 240 bytes at its 64 registers with them, none without).
template <int P>
__device__ __forceinline__ void timeline_batch_landed(int b, const Batch<P>& batch) {
#ifdef METILE_TIMELINE_BATCHES
  timeline_stamp_landed(min(5 + 3 * b, 26), batch.w[kInFlight - 1][P - 1][kTiles - 1][kLoadsPerIteration - 1][1].w);
#endif
}
__device__ __forceinline__ void timeline_batch_issued(int b) {
#ifdef METILE_TIMELINE_BATCHES
  timeline_stamp(min(4 + 3 * b, 25));
#endif
}
__device__ __forceinline__ void timeline_batch_done(int b) {
#ifdef METILE_TIMELINE_BATCHES
  timeline_stamp(min(6 + 3 * b, 27));
#endif
}

// The tile loop's double buffer, kept by the kernel entry across its units (accumulate, kMayCarry):
// a unit requests the next unit's first two batches as its own buffers free up, so that they are in
// flight during its join and epilogue instead of after them.
template <int P>
struct CarriedBatches {
  Batch<P> batch[2];    // even, odd
  bool loaded = false;  // both requested (with their x) for the unit that comes next
};

// kBatchesWhole (gemv_batches_whole, emitted with the constants; never for the persistent kernel's
// pieces): every batch the mainloop issues lies whole inside the matrix, so no load needs a predicate
// or its register zeroed first, and no x fragment a bound check: ~2 instructions per 4-bit weight word
// fewer (gemv_sass_benchmark).

// Visits every 16-byte weight vector and every 8-byte scale/bias pair of the batch whose iterations
// are first, first + kWarps, ... (live: inside [.., end) and inside the matrix). One place for the
// addresses, whether the batch goes to registers (load_batch) or to shared memory (issue_batch).
// Each address is a per-(matrix, tile) base plus a compile-time offset, so that the unrolled loads
// take immediate offsets instead of a 64-bit multiply each.
template <int P, class Vector, class Pair>
__device__ __forceinline__ void for_each_load(const u32* const (&weights)[P], const u16* const (&scale_bias)[P], int first,
                                              int end, int lane, int first_tile, Vector&& vector, Pair&& pair) {
  const int g = lane >> 2, t = lane & 3;
  // The batch's first vector and scale/bias pair per matrix and tile (repacked layout), or row g of the
  // dense matrix at the batch's first column.
  const u32* vectors[P][kTiles];
  const u16* pairs[P][kTiles];
#pragma unroll
  for (int p = 0; p < P; ++p) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const int tile = first_tile + i;
      if constexpr (kAffine) {
        vectors[p][i] = weights[p] + ((u64)tile * kLoadBlocks + (u64)first * kLoadsPerIteration) * 256 + lane * 4;
        pairs[p][i] = scale_bias[p] + (((u64)tile * kGroupCount + (u64)first * kGroupsPerIteration) * 8 + g) * 4;
      } else {
        vectors[p][i] = reinterpret_cast<const u32*>(reinterpret_cast<const u16*>(weights[p]) + (u64)(tile * 16 + g) * kK +
                                                     first * kColumnsPerIteration + 8 * t);
        pairs[p][i] = nullptr;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kInFlight; ++u) {
    const int it = first + u * kWarps;
    const bool live = kBatchesWhole || it < end;
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const int tile = first_tile + i;
#pragma unroll
        for (int l = 0; l < kLoadsPerIteration; ++l) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if constexpr (kAffine) {
              vector(u, p, i, l, h, vectors[p][i] + ((u * kWarps * kLoadsPerIteration + l) * 2 + h) * 128,
                     kBatchesWhole || (live && tile < kTileCount));
            } else {
              const int row = tile * 16 + 8 * h + g;
              const int k = it * kColumnsPerIteration + 8 * t;
              vector(u, p, i, l, h,
                     reinterpret_cast<const u16*>(vectors[p][i]) + 8 * h * kK + u * kWarps * kColumnsPerIteration,
                     kBatchesWhole || (live && row < kN && k < kK));
            }
          }
        }
        if constexpr (kAffine) {
#pragma unroll
          for (int q = 0; q < kGroupsPerIteration; ++q)
            pair(u, p, i, q, pairs[p][i] + (u * kWarps * kGroupsPerIteration + q) * 32, kBatchesWhole || (live && tile < kTileCount));
        }
      }
    }
  }
}

// Loads a batch into registers (zeros where not live).
template <int P>
__device__ __forceinline__ void load_batch(Batch<P>& batch, const u32* const (&weights)[P],
                                           const u16* const (&scale_bias)[P], int first, int end, int lane, int first_tile) {
  for_each_load<P>(
      weights, scale_bias, first, end, lane, first_tile,
      [&](int u, int p, int i, int l, int h, const void* address, bool live) {
        // Zero, then a predicated load: ptxas keeps ~25 more registers live for a select (95 -> 120
        // for 4-bit g64 gate/up w4). Whole batches need neither.
        if constexpr (kBatchesWhole) {
          batch.w[u][p][i][l][h] = load_weights(address);
        } else {
          batch.w[u][p][i][l][h] = make_uint4(0u, 0u, 0u, 0u);
          if (live) batch.w[u][p][i][l][h] = load_weights(address);
        }
      },
      [&](int u, int p, int i, int q, const void* address, bool live) {
        if constexpr (kBatchesWhole) {
          batch.sb[u][p][i][q] = load_scale_bias(address);
        } else {
          batch.sb[u][p][i][q] = make_uint2(0u, 0u);
          if (live) batch.sb[u][p][i][q] = load_scale_bias(address);
        }
      });
}

// The x fragments of iteration `it` (zeros past the matrix where batches are not whole).
__device__ __forceinline__ void load_iteration_x(uint4 (&xv)[kRowHalves][kChunksPerIteration], const u16* __restrict__ x,
                                                 const u16* __restrict__ norm_weight, int it, int end, int lane) {
  load_x_fragments(
      xv, lane, [&](int column) { return kBatchesWhole || (it < end && it * kColumnsPerIteration + column < kK); },
      [&](int m, int column) { return load_x(x, norm_weight, m, it * kColumnsPerIteration + column); });
}

// A batch's x fragments (kXWithBatch; after the wait only: x may be the previous kernel's output).
template <int P>
__device__ __forceinline__ void load_batch_x(Batch<P>& batch, const u16* __restrict__ x, const u16* __restrict__ norm_weight,
                                             int first, int end, int lane) {
  if constexpr (kXWithBatch) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) load_iteration_x(batch.x[u], x, norm_weight, first + u * kWarps, end, lane);
  }
}

// L2 prefetch (kPrefetchRounds > 0). A round is the block's iterations [first, first + kStride):
// one batch of every warp. Its weights and scales/biases are contiguous per tile and matrix in the
// repacked layout (per tile row for dense), so lane j of warp 0 requests range j with one bulk
// prefetch into L2 (cp.async.bulk.prefetch: no registers, no completion to wait for). Warp 0
// requests the first kPrefetchRounds rounds before the wait for the previous kernel (weights never
// depend on it) and round r + kPrefetchRounds when it starts round r: the block's requests run
// that many rounds ahead of its loads, which then find their lines in L2 or on their way, however
// few registers the batches leave for loads in flight.
__device__ __forceinline__ void prefetch_l2(const void* address, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address), "r"(bytes) : "memory");
}

template <int P>
__device__ __forceinline__ void prefetch_round(const u32* const (&weights)[P], const u16* const (&scale_bias)[P], int first,
                                               int end, int lane, int first_tile) {
  if (first >= end) return;
  const int last = min(first + kWarps * kInFlight, end);
  if constexpr (kAffine) {
    constexpr int kRanges = P * kTiles;  // per matrix and tile: its weights, then its scales/biases
    static_assert(2 * kRanges <= 32, "one lane per prefetched range");
    if (lane >= 2 * kRanges) return;
    const int range = lane < kRanges ? lane : lane - kRanges;
    const int p = range / kTiles, tile = first_tile + range % kTiles;
    if (tile >= kTileCount) return;
    if (lane < kRanges) {
      const u64 block = (u64)tile * kLoadBlocks + (u64)first * kLoadsPerIteration;
      prefetch_l2(weights[p] + block * 256, (u32)(last - first) * kLoadsPerIteration * 1024);
    } else {
      const u64 group = (u64)tile * kGroupCount + (u64)first * kGroupsPerIteration;
      prefetch_l2(scale_bias[p] + group * 32, (u32)(last - first) * kGroupsPerIteration * 64);
    }
  } else {
    const int column = first * kColumnsPerIteration;
    const int columns = min(last * kColumnsPerIteration, kK) - column;
    for (int range = lane; range < P * kTiles * 16; range += 32) {
      const int p = range / (kTiles * 16), row = first_tile * 16 + range % (kTiles * 16);
      if (row < kN) prefetch_l2(reinterpret_cast<const u16*>(weights[p]) + (u64)row * kK + column, (u32)columns * 2);
    }
  }
}

// Warp 0's requests for the rounds starting at `first`, `first` + kStride, ... (`rounds` of them).
template <int P>
__device__ __forceinline__ void prefetch_rounds(const u32* const (&weights)[P], const u16* const (&scale_bias)[P], int first,
                                                int end, int rounds, int warp, int lane, int first_tile) {
  if constexpr (kPrefetchRounds == 0) return;  // no loop to compile (NVRTC: "loop is not reachable")
  if (warp != 0) return;
  for (int r = 0; r < rounds; ++r) prefetch_round<P>(weights, scale_bias, first + r * kWarps * kInFlight, end, lane, first_tile);
}

// A batch staged in shared memory (shared_stages >= 2): the same vectors, each lane's at
// [vector][lane] so that a warp's 32 vectors are 512 contiguous bytes (no bank conflicts). Every
// lane copies, and later reads back, only its own vectors: no barrier between lanes is needed.
template <int P>
struct SharedSlot {
  static constexpr int kWordBytes = kInFlight * P * kTiles * kLoadsPerIteration * 2 * 512;
  static constexpr int kBytes = kWordBytes + (kAffine ? kInFlight * P * kTiles * kGroupsPerIteration * 256 : 0);
  __device__ static int word(int u, int p, int i, int l, int h) {
    return ((((u * P + p) * kTiles + i) * kLoadsPerIteration + l) * 2 + h) * 512;
  }
  __device__ static int pair(int u, int p, int i, int q) {
    return kWordBytes + (((u * P + p) * kTiles + i) * kGroupsPerIteration + q) * 256;
  }
};

template <int P>
__device__ __forceinline__ void issue_batch(unsigned char* slot, const u32* const (&weights)[P],
                                            const u16* const (&scale_bias)[P], int first, int end, int lane, int first_tile) {
  for_each_load<P>(
      weights, scale_bias, first, end, lane, first_tile,
      [&](int u, int p, int i, int l, int h, const void* address, bool live) {
        copy_async_16(slot + SharedSlot<P>::word(u, p, i, l, h) + lane * 16, live ? address : weights[p], live);
      },
      [&](int u, int p, int i, int q, const void* address, bool live) {
        copy_async_8(slot + SharedSlot<P>::pair(u, p, i, q) + lane * 8, live ? address : scale_bias[p], live);
      });
}

template <int P>
__device__ __forceinline__ void read_batch(Batch<P>& batch, const unsigned char* slot, int lane) {
#pragma unroll
  for (int u = 0; u < kInFlight; ++u)
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
#pragma unroll
        for (int l = 0; l < kLoadsPerIteration; ++l)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            batch.w[u][p][i][l][h] = *reinterpret_cast<const uint4*>(slot + SharedSlot<P>::word(u, p, i, l, h) + lane * 16);
        if constexpr (kAffine) {
#pragma unroll
          for (int q = 0; q < kGroupsPerIteration; ++q)
            batch.sb[u][p][i][q] = *reinterpret_cast<const uint2*>(slot + SharedSlot<P>::pair(u, p, i, q) + lane * 8);
        }
      }
}

// shared_group_sums: sum(x) per group of the block's iterations, rows kM..kPaddedM-1 zero.
constexpr int kGroupSumFloats = kSharedGroupSums ? kGroupCount * kPaddedM : 1;
__shared__ __align__(8) float group_sums[kGroupSumFloats];

// Fills group_sums for the iterations [begin, end) (x through the pointer the wait returned); the
// caller synchronizes the block.
__device__ __forceinline__ void fill_group_sums(const u16* __restrict__ x, const u16* __restrict__ norm_weight, int begin,
                                                int end) {
  const int first_group = begin * kGroupsPerIteration, groups = (end - begin) * kGroupsPerIteration;
  for (int unit = threadIdx.x; unit < groups * kPaddedM; unit += kThreads) {
    const int m = unit / groups, group = first_group + (unit - m * groups);
    float total = 0.0f;
    if (m < kM) {
      for (int v = 0; v < kGroup / 8; ++v) {
        const int k = group * kGroup + 8 * v;
        if (k >= kK) break;
        total += sum_of_eight(load_x(x, norm_weight, m, k));
      }
    }
    group_sums[group * kPaddedM + m] = total;
  }
}

// What the block computes from x once, after the wait (x through the pointer it returned): the
// RMSNorm's row scales (kNormedX), the f16 staging of half products, then the shared group sums (of
// the normalized x). fill_sums is the same for the whole block, so every warp reaches the barriers or
// none does.
__device__ __forceinline__ void prepare_x(const u16* __restrict__ x, const u16* __restrict__ norm_weight,
                                          const NormWeights& preloaded, int begin, int end, bool fill_sums) {
  if (!fill_sums) return;
  compute_x_row_scales(x, norm_weight, preloaded);
  stage_half_x(x);
  if constexpr (kSharedGroupSums) {
    fill_group_sums(x, norm_weight, begin, end);
    __syncthreads();
  }
}

// The math of one batch: x fragments, then per group the mma products and the scale/bias fold.
template <int P>
__device__ __forceinline__ void compute_batch(float (&acc)[P][kTiles][kRowHalves][4], const Batch<P>& batch,
                                              const u16* __restrict__ x, const u16* __restrict__ norm_weight, int first,
                                              int end, int lane) {
#pragma unroll
  for (int u = 0; u < kInFlight; ++u) {
    const int it = first + u * kWarps;
    uint4 xv[kRowHalves][kChunksPerIteration];
    if constexpr (kXWithBatch) {
#pragma unroll
      for (int h = 0; h < kRowHalves; ++h)
#pragma unroll
        for (int c = 0; c < kChunksPerIteration; ++c) xv[h][c] = batch.x[u][h][c];
    } else {
      load_iteration_x(xv, x, norm_weight, it, end, lane);
    }
    if constexpr (kAffine) {
#pragma unroll
      for (int q = 0; q < kGroupsPerIteration; ++q) {
        float xsum[kRowHalves][4];
        if constexpr (kSharedGroupSums) {
          read_group_sums(xsum, group_sums + (it * kGroupsPerIteration + q) * kPaddedM, lane, kBatchesWhole || it < end);
        } else {
#pragma unroll
          for (int h = 0; h < kRowHalves; ++h) {
            xsum[h][0] = xsum[h][1] = xsum[h][2] = xsum[h][3] = 0.0f;
#pragma unroll
            for (int j = 0; j < kChunksPerGroup; ++j) {
              const uint4 b = xv[h][q * kChunksPerGroup + j];
              if constexpr (kHalfProducts) {
                // A registers 0, 2: rows 0..7; 1: rows 8..15 at the even pairs' columns; 3: at the odd ones'.
                mma_in<true>(xsum[h], kHalfOnes, kHalfOnes, kHalfOnes, kHalfOddScales, b.x, b.y);
                mma_in<true>(xsum[h], kHalfOnes, kHalfOnes, kHalfOnes, kHalfOddScales, b.z, b.w);
              } else {
                mma(xsum[h], kOnes, kOnes, kOnes, kOnes, b.x, b.y);
                mma(xsum[h], kOnes, kOnes, kOnes, kOnes, b.z, b.w);
              }
            }
          }
        }
#pragma unroll
        for (int p = 0; p < P; ++p) {
#pragma unroll
          for (int i = 0; i < kTiles; ++i) {
            affine_group_product(acc[p][i], xv, q, batch.sb[u][p][i][q], xsum,
                                 [&](int chunk, u32(&step0)[4], u32(&step1)[4]) {
                                   const int l = chunk / kChunksPerLoad;
                                   affine_fragments(batch.w[u][p][i][l][0], batch.w[u][p][i][l][1], chunk % kChunksPerLoad,
                                                    step0, step1);
                                 });
          }
        }
      }
    } else {
#pragma unroll
      for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const uint4 low = batch.w[u][p][i][0][0], high = batch.w[u][p][i][0][1];
#pragma unroll
          for (int h = 0; h < kRowHalves; ++h) {
            const uint4 b = xv[h][0];
            mma(acc[p][i][h], low.x, high.x, low.y, high.y, b.x, b.y);
            mma(acc[p][i][h], low.z, high.z, low.w, high.w, b.z, b.w);
          }
        }
      }
    }
  }
}

// Adds this warp's share of the block's iterations [begin, end) (begin + warp, begin + warp + kWarps,
// ...) for P weight matrices into acc. Three schedules:
//   staged (kSharedStages >= 2): batches go to a ring of shared-memory slots by cp.async,
//     kSharedStages - 1 batches ahead of the math; each is read back into registers just before it;
//   double-buffered: the next batch's register loads are outstanding during the current batch's math
//     (the second batch's already during the x prologue, where it has work);
//   otherwise each batch is loaded, then computed.
// Only weights are read before the wait: x may be the previous kernel's output (or, in the
// persistent decode MLP's down phase, other blocks' output before a grid-wide barrier), and every x
// load goes through the pointer activations_ready() returns; the generator defines it before this body.
// `after_wait` runs once the wait has returned, before the mainloop (the kernel entry loads its
// epilogue's tensors there, so that their round trip overlaps the mainloop instead of following it).
struct NothingAfterWait {
  __device__ __forceinline__ void operator()() const {}
};
//
// kMayCarry (the kernel entry's one-pass accumulators): with the tile loop and a double buffer whose
// second batch goes out before the wait (kPrologueWork), the buffers are `carried`'s, the unit's
// first two batches come from the unit before it where it requested them, and the unit requests
// those of the tile block at next_first_tile (< 0: none) as its own buffers free up: measured on the
// H200 (Llama-3-8B's LM head, notes/mlp_decode.md, session 33), the tile blocks' joins otherwise left
// the loop's warps with nothing in flight between two tiles.
template <int P, bool kMayCarry = false, class AfterWait = NothingAfterWait>
__device__ __forceinline__ void accumulate(float (&acc)[P][kTiles][kRowHalves][4], const u32* const (&weights)[P],
                                           const u16* const (&scale_bias)[P], const u16* __restrict__ x,
                                           const u16* __restrict__ norm_weight, const int warp, const int lane, const int first_tile, const int split_begin,
                                           const int split_end, unsigned char* ring, const bool fill_sums,
                                           AfterWait after_wait = AfterWait{}, CarriedBatches<P>* carried = nullptr,
                                           const int next_first_tile = -1) {
  constexpr int kStride = kWarps * kInFlight;
  // kSplits == 0: the caller's bounds (the persistent decode MLP's stream-K pieces).
  // Without split-K the bounds are the compile-time ones (a run-time bound here costs ptxas ~7
  // registers, 120 -> 127 for 4-bit g64 gate/up w4, even where it folds to the same constant).
  const int begin = kSplits == 1 ? 0 : split_begin;
  const int end = kSplits == 1 ? kIterations : split_end;
  // Before the wait: the first rounds' weights into L2 (a no-op without kPrefetchRounds).
  prefetch_rounds<P>(weights, scale_bias, begin, end, kPrefetchRounds, warp, lane, first_tile);
  // The round that starts at `first` (warp 0's batch) requests the one kPrefetchRounds ahead.
  auto prefetch_ahead = [&](int first) {
    prefetch_rounds<P>(weights, scale_bias, first + kPrefetchRounds * kStride, end, 1, warp, lane, first_tile);
  };
  if constexpr (kSharedStages >= 2) {
    int issue = begin + warp;
#pragma unroll
    for (int s = 0; s < kSharedStages - 1; ++s) {
      if (issue < end) issue_batch<P>(ring + s * SharedSlot<P>::kBytes, weights, scale_bias, issue, end, lane, first_tile);
      copy_async_commit();
      issue += kStride;
    }
    const NormWeights preloaded = preload_norm_weights(norm_weight, fill_sums);  // weights: before the wait
    x = activations_ready(x);
    timeline_stamp(1);
    after_wait();
    prepare_x(x, norm_weight, preloaded, begin, end, fill_sums);
    int slot = 0;
#pragma unroll 1
    for (int first = begin + warp; first < end; first += kStride) {
      // The slot computed last time round takes the batch kSharedStages - 1 ahead.
      const int refill = slot == 0 ? kSharedStages - 1 : slot - 1;
      if (issue < end) issue_batch<P>(ring + refill * SharedSlot<P>::kBytes, weights, scale_bias, issue, end, lane, first_tile);
      copy_async_commit();
      issue += kStride;
      copy_async_wait<kSharedStages - 1>();
      prefetch_ahead(first);
      Batch<P> batch;
      read_batch<P>(batch, ring + slot * SharedSlot<P>::kBytes, lane);
      compute_batch(acc, batch, x, norm_weight, first, end, lane);
      slot = slot + 1 == kSharedStages ? 0 : slot + 1;
    }
    copy_async_wait<0>();
  } else if constexpr (kDoubleBuffered) {
    // The first batch is requested before the wait. Where the x prologue has work (the RMSNorm's
    // row scales: L2 round trips and block barriers; shared group sums) the second is requested
    // before the wait too (weights never depend on the previous kernel), so that the prologue runs
    // with two batches in flight (after the wait: Llama-3-8B bf16 4.197 -> 4.014 ms/token, session
    // 16; before it: Qwen2.5-1.5B 4-bit 0.705 -> 0.679, Llama-3.2-1B 0.408 -> 0.402, session 18;
    // notes/mlp_decode.md). Elsewhere it is requested at the top of the first iteration: about the
    // same point in time, in the loop code that measured faster there (the early request everywhere
    // cost Llama-3.2-1B 4-bit 0.396 -> 0.444 ms/token, session 17). Each later batch is requested as
    // soon as its registers are free, so the loop computes one batch while the next one's loads are
    // outstanding.
    constexpr bool kPrologueWork = kNormedX || kSharedGroupSums || kHalfProducts;
    constexpr bool kCarry = kMayCarry && kTileLoop && kPrologueWork;
    Batch<P> own[2];
    Batch<P>* const buffers = kCarry ? carried->batch : own;
    Batch<P>& even = buffers[0];
    Batch<P>& odd = buffers[1];
    // A unit's first two batches (x too), for the tile block at `tile` (this one's, or the next one's).
    auto load_first = [&](Batch<P>& batch, int u, int tile) {
      const int it = begin + warp + u * kStride;
      if (it < end) {
        load_batch(batch, weights, scale_bias, it, end, lane, tile);
        load_batch_x(batch, x, norm_weight, it, end, lane);
      }
    };
    const bool requested = kCarry && carried->loaded;  // by the unit before this one
    if (!requested) {
      timeline_batch_issued(0);
      if (begin + warp < end) load_batch(even, weights, scale_bias, begin + warp, end, lane, first_tile);
      if constexpr (kPrologueWork) {
        timeline_batch_issued(1);
        if (begin + warp + kStride < end) load_batch(odd, weights, scale_bias, begin + warp + kStride, end, lane, first_tile);
      }
    }
    const NormWeights preloaded = preload_norm_weights(norm_weight, fill_sums);  // weights: before the wait
    x = activations_ready(x);
    timeline_stamp(1);
    after_wait();
    prepare_x(x, norm_weight, preloaded, begin, end, fill_sums);
    if (!requested) {
      if (begin + warp < end) load_batch_x(even, x, norm_weight, begin + warp, end, lane);
      if constexpr (kPrologueWork) {
        if (begin + warp + kStride < end) load_batch_x(odd, x, norm_weight, begin + warp + kStride, end, lane);
      }
    }
    const bool carry_next = kCarry && next_first_tile >= 0;
    bool even_next = false, odd_next = false;  // requested for the next unit already
    int batch_number = 0;                      // the timeline's count (even's batch)
#pragma unroll 1
    for (int first = begin + warp; first < end; first += 2 * kStride, batch_number += 2) {
      const int second = first + kStride;
      prefetch_ahead(first);
      if constexpr (!kPrologueWork) {
        if (second < end) {
          timeline_batch_issued(batch_number + 1);
          load_batch(odd, weights, scale_bias, second, end, lane, first_tile);
          load_batch_x(odd, x, norm_weight, second, end, lane);
        }
      }
      timeline_batch_landed(batch_number, even);
      compute_batch(acc, even, x, norm_weight, first, end, lane);
      timeline_batch_done(batch_number);
      if (second >= end) break;
      prefetch_ahead(second);
      if (second + kStride < end) {
        timeline_batch_issued(batch_number + 2);
        load_batch(even, weights, scale_bias, second + kStride, end, lane, first_tile);
        load_batch_x(even, x, norm_weight, second + kStride, end, lane);
      } else if (carry_next) {  // this unit's last even batch is computed: the next unit's first
        load_first(even, 0, next_first_tile);
        even_next = true;
      }
      timeline_batch_landed(batch_number + 1, odd);
      compute_batch(acc, odd, x, norm_weight, second, end, lane);
      timeline_batch_done(batch_number + 1);
      if constexpr (kPrologueWork) {
        if (second + 2 * kStride < end) {
          timeline_batch_issued(batch_number + 3);
          load_batch(odd, weights, scale_bias, second + 2 * kStride, end, lane, first_tile);
          load_batch_x(odd, x, norm_weight, second + 2 * kStride, end, lane);
        } else if (carry_next) {
          load_first(odd, 1, next_first_tile);
          odd_next = true;
        }
      }
    }
    if constexpr (kCarry) {
      if (carry_next && !even_next) load_first(even, 0, next_first_tile);
      if (carry_next && !odd_next) load_first(odd, 1, next_first_tile);
      carried->loaded = carry_next;
    }
  } else {
    // The wait comes before the loop: with it inside the first iteration (after the first weight
    // loads) a dependent launch inside a CUDA graph read x before the previous kernel wrote it on
    // the H200 (gemv_schedules_test, notes/mlp_decode.md), though the PTX orders every x load
    // after the wait. This schedule is the unpipelined one; it loses no overlap worth keeping.
    Batch<P> batch;
    const NormWeights preloaded = preload_norm_weights(norm_weight, fill_sums);  // weights: before the wait
    x = activations_ready(x);
    timeline_stamp(1);
    after_wait();
    prepare_x(x, norm_weight, preloaded, begin, end, fill_sums);  // every warp must reach its barriers
    int batch_number = 0;  // the timeline's count
#pragma unroll 1
    for (int first = begin + warp; first < end; first += kStride, ++batch_number) {
      prefetch_ahead(first);
      timeline_batch_issued(batch_number);
      load_batch(batch, weights, scale_bias, first, end, lane, first_tile);
      timeline_batch_landed(batch_number, batch);
      compute_batch(acc, batch, x, norm_weight, first, end, lane);
      timeline_batch_done(batch_number);
    }
  }
}

__device__ __forceinline__ int partial_index(int warp, int product, int tile, int row, int m) {
  return (((warp * kProducts + product) * kTiles + tile) * 16 + row) * kPaddedM + m;
}

// Writes a warp's accumulators for `product` (C fragment: rows g and g + 8, columns 2t, 2t + 1);
// half products' sums in their rows' 2^e_m units are unscaled here (exact: powers of two).
__device__ __forceinline__ void spill(const float (&acc)[kTiles][kRowHalves][4], float* partial, int warp,
                                      int product, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int h = 0; h < kRowHalves; ++h) {
      const int m = 8 * h + 2 * t;
      float sums[4] = {acc[i][h][0], acc[i][h][1], acc[i][h][2], acc[i][h][3]};
      if constexpr (kHalfProducts) {
        sums[0] *= x_row_unscale[m];
        sums[1] *= x_row_unscale[m + 1];
        sums[2] *= x_row_unscale[m];
        sums[3] *= x_row_unscale[m + 1];
      }
      partial[partial_index(warp, product, i, g, m)] = sums[0];
      partial[partial_index(warp, product, i, g, m + 1)] = sums[1];
      partial[partial_index(warp, product, i, g + 8, m)] = sums[2];
      partial[partial_index(warp, product, i, g + 8, m + 1)] = sums[3];
    }
  }
}
)CUDA";

// The kernel entry: accumulate (one of the two schedules), join the warps, apply the epilogue,
// for each unit of work the block takes (kernel_entry_loop_end closes the loop).
constexpr std::string_view kernel_entry_body = R"CUDA(
  __shared__ float partial[kWarps * kProducts * kTiles * 16 * kPaddedM];
  allow_dependent_launch();
  timeline_start();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned char* ring = nullptr;
  if constexpr (kSharedStages >= 2) {
    extern __shared__ __align__(16) unsigned char ring_memory[];
    ring = ring_memory + warp * kSharedStages * SharedSlot<kProducts>::kBytes;
  }
  // A unit is a (tile block, split) pair. Without kTileLoop block b takes unit b and the loop runs
  // once; with it (no split-K) block b takes tile blocks b, b + gridDim.x, ..., and the x prologue
  // (the norm's row scales, the staged x, the group sums) runs for its first one only. The caller
  // names the first unit and the stride (entry_first_unit, entry_unit_stride): the kernel entry
  // from blockIdx and gridDim, a phase of the persistent decode MLP from its block and grid
  // (gemv_persistent.cpp), where a block may take several units of a split-K stage too (kUnitLoop).
  const int first_unit = entry_first_unit;
  const int unit_stride = entry_unit_stride;
  [[maybe_unused]] int joined = 0;  // tile blocks this block stored (the argmax join counts them)
  CarriedBatches<kProducts> carried;  // the tile loop's batches from one unit to the next (accumulate)
  for (int unit = first_unit; unit < kTileBlocks * kSplits; unit += unit_stride) {
  const bool first_of_block = unit == first_unit;
  // Split-K: unit u is tile block u % kTileBlocks and split u / kTileBlocks, whose iterations
  // are [split * I / S, (split + 1) * I / S).
  const int tile_block = kSplits == 1 ? unit : unit % kTileBlocks;
  const int split = kSplits == 1 ? 0 : unit / kTileBlocks;
  const int first_tile = tile_block * kTiles;
  const int begin = split * kIterations / kSplits, end = (split + 1) * kIterations / kSplits;
  // With the tile loop, the block's next tile block is requested into L2 while this one runs.
  if constexpr (kTileLoop) {
    prefetch_rounds<kProducts>(weights, scale_bias, 0, kIterations, kPrefetchRounds, warp, lane,
                               (unit + unit_stride) * kTiles);
  }
  // kPreloadEpilogue: this thread's one output's epilogue tensors (a residual, a bias), loaded
  // right after the wait; the unsplit store below uses them.
  EpilogueTensors preloaded_tensors{};
  auto load_epilogue = [&] {
    if constexpr (kPreloadEpilogue) {
      const int o = threadIdx.x;
      const int n = first_tile * 16 + (o - (o / (kTiles * 16)) * (kTiles * 16));
      if (o < kM * kTiles * 16 && n < kN) preloaded_tensors = load_epilogue_tensors(outputs, o / (kTiles * 16), n);
    }
  };
  // kEpilogueBeforeWait: inputs no kernel of the run writes (the rope epilogue's positions and
  // biases), loaded before the wait; else right after it.
  if constexpr (kEpilogueBeforeWait) load_epilogue();
  auto load_epilogue_after_wait = [&] {
    if constexpr (!kEpilogueBeforeWait) load_epilogue();
  };
  if constexpr (kProducts == 2 && kScratchSpilled) {
    // Finish the gate reduction, park it in shared memory, reuse the same registers for up.
    float acc[1][kTiles][kRowHalves][4];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
#pragma unroll
      for (int i = 0; i < kTiles; ++i)
#pragma unroll
        for (int h = 0; h < kRowHalves; ++h) acc[0][i][h][0] = acc[0][i][h][1] = acc[0][i][h][2] = acc[0][i][h][3] = 0.0f;
      const u32* const one_weights[1] = {weights[p]};
      const u16* const one_scale_bias[1] = {scale_bias[p]};
      accumulate<1>(acc, one_weights, one_scale_bias, x, x_norm_weight, warp, lane, first_tile, begin, end, ring,
                    first_of_block && p == 0, load_epilogue_after_wait);
      spill(acc[0], partial, warp, p, lane);
    }
  } else {
    // Every matrix's accumulators live in registers at once.
    float acc[kProducts][kTiles][kRowHalves][4];
#pragma unroll
    for (int p = 0; p < kProducts; ++p)
#pragma unroll
      for (int i = 0; i < kTiles; ++i)
#pragma unroll
        for (int h = 0; h < kRowHalves; ++h) acc[p][i][h][0] = acc[p][i][h][1] = acc[p][i][h][2] = acc[p][i][h][3] = 0.0f;
    // The tile loop's next unit, whose first batches this one requests as its buffers free up.
    const int next_unit = unit + unit_stride;
    const int next_first_tile = kTileLoop && next_unit < kTileBlocks * kSplits ? next_unit * kTiles : -1;
    accumulate<kProducts, true>(acc, weights, scale_bias, x, x_norm_weight, warp, lane, first_tile, begin, end, ring,
                                first_of_block, load_epilogue_after_wait, &carried, next_first_tile);
#pragma unroll
    for (int p = 0; p < kProducts; ++p) spill(acc[p], partial, warp, p, lane);
  }
  timeline_stamp(2);
  // A warp with no iterations has not waited yet; nothing below may run before the previous kernel.
  wait_for_previous_kernel();
  __syncthreads();

  // One thread per output; consecutive threads take consecutive n so the stores coalesce.
  if constexpr (kSplits == 1) {
    for (int o = threadIdx.x; o < kM * kTiles * 16; o += kThreads) {
      const int m = o / (kTiles * 16);
      const int r = o - m * (kTiles * 16);
      const int n = first_tile * 16 + r;
      if (n >= kN) continue;
      float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        acc0 += partial[partial_index(w, 0, r >> 4, r & 15, m)];
        if constexpr (kProducts == 2) acc1 += partial[partial_index(w, 1, r >> 4, r & 15, m)];
        // The rope epilogue rotates row pairs (2j, 2j + 1): acc1 is the partner row's sum.
        if constexpr (kRopeCache) acc1 += partial[partial_index(w, 0, (r ^ 1) >> 4, (r ^ 1) & 15, m)];
      }
      float stored;
      if constexpr (kPreloadEpilogue) {
        stored = store_output(outputs, m, n, acc0, acc1, preloaded_tensors);
      } else {
        stored = store_output(outputs, m, n, acc0, acc1);
      }
      record_stored(o, stored);  // argmax_rows: the value as stored, for argmax_rows_block
    }
  } else {
    // Each split writes its block's sums to its own workspace slot; the last split of the tile block
    // to arrive adds the slots in split order (the same bits whatever the timing), applies the
    // epilogue and re-arms the counter for the next launch.
    constexpr int kOutputs = kM * kTiles * 16;
    float* const slots = workspace + (long long)tile_block * kSplits * kProducts * kOutputs;
    u32* const counters = reinterpret_cast<u32*>(workspace + (long long)kTileBlocks * kSplits * kProducts * kOutputs);
    for (int o = threadIdx.x; o < kOutputs; o += kThreads) {
      const int m = o / (kTiles * 16);
      const int r = o - m * (kTiles * 16);
      float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        acc0 += partial[partial_index(w, 0, r >> 4, r & 15, m)];
        if constexpr (kProducts == 2) acc1 += partial[partial_index(w, 1, r >> 4, r & 15, m)];
      }
      store_partial(slots + (split * kProducts) * kOutputs + o, acc0);
      if constexpr (kProducts == 2) store_partial(slots + (split * kProducts + 1) * kOutputs + o, acc1);
    }
    __threadfence();
    __syncthreads();
    __shared__ u32 arrived;
    if (threadIdx.x == 0) arrived = atomicAdd(counters + tile_block, 1u);
    __syncthreads();
    // Not `return`: a persistent phase's block goes on to its next unit (and to the next phase).
    if (arrived == kSplits - 1) {
    __threadfence();
    for (int o = threadIdx.x; o < kOutputs; o += kThreads) {
      const int m = o / (kTiles * 16);
      const int r = o - m * (kTiles * 16);
      const int n = first_tile * 16 + r;
      if (n >= kN) continue;
      float acc0 = 0.0f, acc1 = 0.0f;
      for (int s = 0; s < kSplits; ++s) {
        acc0 += load_partial(slots + (s * kProducts) * kOutputs + o);
        if constexpr (kProducts == 2) acc1 += load_partial(slots + (s * kProducts + 1) * kOutputs + o);
        if constexpr (kRopeCache) acc1 += load_partial(slots + (s * kProducts) * kOutputs + (o ^ 1));  // the partner row
      }
      store_output(outputs, m, n, acc0, acc1);
    }
    if (threadIdx.x == 0) atomicExch(counters + tile_block, 0u);
    }
  }
)CUDA";

// Closes the unit loop (the next unit's spill reuses `partial`), then the kernel.
constexpr std::string_view kernel_entry_loop_end = R"CUDA(
  timeline_stamp(3);
  timeline_flush();
  if constexpr (kUnitLoop) __syncthreads();
  }
)CUDA";


// argmax_rows, inside the unit loop after the unsplit store above: for the tile block it just
// stored, the block finds per activation row the largest output (as stored: record_stored kept each
// value in shared memory, so no value is read back from global memory) and folds it into the block's
// own winner for that row (argmax_block_value / argmax_block_index, gemv_output_functions), kept
// across the tile blocks of a tile loop. argmax_rows_tail publishes one winner a block.
constexpr std::string_view argmax_rows_block = R"CUDA(
  __syncthreads();
  for (int m = warp; m < kM; m += kWarps) {
    float best = __int_as_float(0xff800000);  // -inf at index kN: any output replaces it
    int best_index = kN;
    for (int r = lane; r < kTiles * 16; r += 32) {
      const int n = first_tile * 16 + r;
      if (n >= kN) break;
      const float value = argmax_stored[m * kTiles * 16 + r];
      if (metile_device::argmax_beats(value, n, best, best_index)) {
        best = value;
        best_index = n;
      }
    }
    metile_device::argmax_warp(best, best_index);
    // Row m belongs to this warp alone: its lane 0 reads and writes the block's winner.
    if (lane == 0 && (joined == 0 || metile_device::argmax_beats(best, best_index, argmax_block_value[m], argmax_block_index[m]))) {
      argmax_block_value[m] = best;
      argmax_block_index[m] = best_index;
    }
  }
  ++joined;
)CUDA";

// After the unit loop: each block leaves its winner per row, its value's bits and its index in one
// 8-byte word, in the workspace (slot blockIdx.x: one a tile block without the tile loop, a few
// hundred with it; the workspace holds kArgmaxWinners, the most the grid may have) and adds the
// tile blocks it joined to the arrival counter; the one that completes the count reduces every
// block's winners with all its threads (independent loads, a few round trips to L2) by argmax_beats
// (cuda_argmax_helpers), a total order, so the grouping into blocks changes no result; it writes
// next[m] and re-arms the counter.
constexpr std::string_view argmax_rows_tail = R"CUDA(
  int2* const winners = reinterpret_cast<int2*>(workspace);
  u32* const arrivals = reinterpret_cast<u32*>(workspace) + 2 * kArgmaxWinners * kM;
  __syncthreads();  // argmax_block_*: written by each row's warp
  for (int m = threadIdx.x; m < kM; m += kThreads) {
    __stcg(winners + blockIdx.x * kM + m, joined == 0 ? make_int2((int)0xff800000, kN)
                                                      : make_int2(__float_as_int(argmax_block_value[m]), argmax_block_index[m]));
  }
  __threadfence();
  __syncthreads();
  __shared__ u32 argmax_arrived;
  if (threadIdx.x == 0) argmax_arrived = atomicAdd(arrivals, (u32)joined);
  __syncthreads();
  if (joined == 0 || argmax_arrived + (u32)joined != (u32)kTileBlocks) return;
  __threadfence();
  __shared__ float warp_best[kWarps];
  __shared__ int warp_best_index[kWarps];
  for (int m = 0; m < kM; ++m) {
    float best = __int_as_float(0xff800000);
    int best_index = kN;
    // 16 independent loads in flight per thread (a 2-warp LM head without the tile loop has 8016
    // winners to read, 125 a thread).
#pragma unroll 16
    for (int b = threadIdx.x; b < (int)gridDim.x; b += kThreads) {
      const int2 winner = __ldcg(winners + b * kM + m);
      if (metile_device::argmax_beats(__int_as_float(winner.x), winner.y, best, best_index)) {
        best = __int_as_float(winner.x);
        best_index = winner.y;
      }
    }
    metile_device::argmax_warp(best, best_index);
    if (lane == 0) {
      warp_best[warp] = best;
      warp_best_index[warp] = best_index;
    }
    __syncthreads();
    if (warp == 0) {
      best = lane < kWarps ? warp_best[lane] : __int_as_float(0xff800000);
      best_index = lane < kWarps ? warp_best_index[lane] : kN;
      metile_device::argmax_warp(best, best_index);
      if (lane == 0) next[m] = best_index;
    }
    __syncthreads();  // warp_best is reused for the next row
  }
  if (threadIdx.x == 0) atomicExch(arrivals, 0u);
}
)CUDA";

constexpr std::int64_t shared_memory_per_block = 232448;  // sm_90: 227 KiB per block after opting in

// The warps' partial sums, joined in static shared memory.
std::int64_t partial_sum_bytes(const GemvKernelConfig& config) {
  const std::int64_t padded_m = (config.rows + 7) / 8 * 8;
  return std::int64_t{config.warps_per_block} * config.epilogue.product_count() * config.tiles_per_block * 16 * padded_m * 4;
}

// shared_group_sums: one float per (padded) group and padded row (group_sums in the kernel).
std::int64_t group_sum_bytes(const GemvKernelConfig& config) {
  if (!config.shared_group_sums) return 0;
  const std::int64_t columns = config.format.columns_per_iteration();
  const std::int64_t groups = (config.in_features + columns - 1) / columns * (columns / config.format.group_size);
  return groups * ((config.rows + 7) / 8 * 8) * 4;
}

// The joins' static shared memory: split-K's arrival flag (`arrived`), the argmax join's arrival flag
// and per-warp winner (argmax_arrived, warp_best, warp_best_index). A few bytes, but a kernel at the
// 48 KiB line does not link with them (a half-products LM head, M = 1, K = 16224, w8 t4: ptxas
// counted 49188 bytes where the check counted 49124).
std::int64_t join_shared_bytes(const GemvKernelConfig& config) {
  std::int64_t bytes = config.k_splits > 1 ? 4 : 0;
  // argmax_rows: the arrival flag, the per-warp winners, the block's winner per row and the tile's
  // stored values (argmax_stored, gemv_output_functions).
  if (config.argmax_rows) {
    bytes += 4 + std::int64_t{config.warps_per_block} * 8 + config.rows * 8 + config.rows * config.tiles_per_block * 16 * 4;
  }
  return bytes;
}

// Every static shared array of a register-batch kernel but the attention prologue's.
std::int64_t static_shared_bytes(const GemvKernelConfig& config) {
  return partial_sum_bytes(config) + group_sum_bytes(config) + x_norm_shared_bytes(config) + join_shared_bytes(config);
}

// The staged batches' rings in dynamic shared memory: per warp, shared_stages slots of one batch
// of every matrix (SharedSlot<kProducts> in the kernel: 512 bytes per weight vector of the warp,
// 256 per scale/bias pair).
std::int64_t staged_ring_bytes(const GemvKernelConfig& config) {
  if (config.shared_stages == 0) return 0;
  const GemvWeightFormat& format = config.format;
  const std::int64_t loads = format.columns_per_iteration() / format.columns_per_load();
  const std::int64_t groups = format.is_affine() ? format.columns_per_iteration() / format.group_size : 0;
  const std::int64_t per_matrix = std::int64_t{config.iterations_in_flight} * config.tiles_per_block * (loads * 2 * 512 + groups * 256);
  return std::int64_t{config.warps_per_block} * config.shared_stages * config.epilogue.product_count() * per_matrix;
}

}  // namespace

namespace gemv_detail {

std::string_view gemv_activations_after_previous_kernel() {
  // x is ready once the previous kernel on the stream has written it (programmatic dependent launch).
  return R"CUDA(
template <class T>
__device__ __forceinline__ T* activations_ready(T* pointer) { return after_previous_kernel(pointer); }
)CUDA";
}

std::string_view gemv_register_mainloop() { return register_mainloop_body; }

std::string gemv_unit_loop_body() { return std::string(kernel_entry_body) + std::string(kernel_entry_loop_end); }

std::string gemv_register_constants(const GemvKernelConfig& config, int splits) {
  const bool scratch = config.epilogue.product_count() == 2 && config.schedule == GatedSchedule::scratch_spilled;
  const std::int64_t tile_count = (config.out_features + 15) / 16;
  const std::int64_t tile_blocks = (tile_count + config.tiles_per_block - 1) / config.tiles_per_block;
  return fmt::format(
      "[[maybe_unused]] constexpr bool kScratchSpilled = {};\nconstexpr int kTiles = {};\n"
      "constexpr int kInFlight = {};\nconstexpr bool kDoubleBuffered = {};\nconstexpr int kSharedStages = {};\n"
      "constexpr int kSplits = {};\n[[maybe_unused]] constexpr int kTileBlocks = {};\nconstexpr bool kSharedGroupSums = {};\n"
      "constexpr bool kTileLoop = {};\nconstexpr int kPrefetchRounds = {};\nconstexpr bool kBatchesWhole = {};\n"
      "constexpr bool kXWithBatch = {};\n",
      scratch ? "true" : "false", config.tiles_per_block, config.iterations_in_flight,
      config.double_buffered ? "true" : "false", config.shared_stages >= 2 ? config.shared_stages : 0, splits,
      tile_blocks, config.shared_group_sums ? "true" : "false",
      config.tile_loop_blocks_per_multiprocessor > 0 ? "true" : "false", config.l2_prefetch_rounds,
      splits == 1 && gemv_batches_whole(config) ? "true" : "false", config.x_with_batch ? "true" : "false");
}

}  // namespace gemv_detail

std::string_view gated_schedule_name(GatedSchedule schedule) {
  return schedule == GatedSchedule::register_resident ? "register_resident" : "scratch_spilled";
}

std::string_view gemv_mainloop_name(GemvMainloop mainloop) {
  return mainloop == GemvMainloop::register_batches ? "register_batches" : "streamed";
}

namespace {
// The most blocks of this many warps an SM keeps at once (sm_90: 64 warps, 32 blocks).
int blocks_an_sm_holds(int warps_per_block) { return std::min(32, 64 / warps_per_block); }
}  // namespace

void GemvKernelConfig::validate() const {
  format.validate();
  if (rows < 1 || rows > 16) throw InputError(fmt::format("GEMV: rows (M) must be 1..16, not {}", rows));
  if (out_features < 1 || out_features > (std::int64_t{1} << 24)) {
    throw InputError(fmt::format("GEMV: out_features (N) {} is out of range", out_features));
  }
  if (in_features < 1 || in_features > (std::int64_t{1} << 24)) {
    throw InputError(fmt::format("GEMV: in_features (K) {} is out of range", in_features));
  }
  if (!format.is_affine() && in_features % 8 != 0) {
    throw InputError(fmt::format("GEMV: dense K must be a multiple of 8 (16-byte rows), not {}", in_features));
  }
  if (format.is_affine() && in_features % format.group_size != 0) {
    throw InputError(fmt::format("GEMV: K {} is not a multiple of the group size {}", in_features, format.group_size));
  }
  if (rows * in_features >= (std::int64_t{1} << 31) || rows * out_features >= (std::int64_t{1} << 31)) {
    throw InputError("GEMV: x or out has 2^31 elements or more");
  }
  if (!epilogue.rounds_only_to(format.activation)) {
    throw InputError(fmt::format("GEMV: epilogue {} rounds to a dtype other than the activations' {}", epilogue.to_string(),
                                 dtype_name(format.activation)));
  }
  // Any count: a K whose iterations 8 and 16 do not divide gets its whole-batch shape from another
  // (gemv_tuning_candidates).
  if (warps_per_block < 1 || warps_per_block > 16) {
    throw InputError(fmt::format("GEMV: warps_per_block must be 1..16, not {}", warps_per_block));
  }
  if (tiles_per_block < 1 || tiles_per_block > 4) {
    throw InputError(fmt::format("GEMV: tiles_per_block must be 1..4, not {}", tiles_per_block));
  }
  if (iterations_in_flight < 1 || iterations_in_flight > 8) {
    throw InputError(fmt::format("GEMV: iterations_in_flight must be 1..8, not {}", iterations_in_flight));
  }
  if (!output_splits.empty()) {
    std::int64_t columns = 0;
    for (std::int64_t width : output_splits) {
      if (width < 1) throw InputError(fmt::format("GEMV: an output split has {} columns", width));
      columns += width;
    }
    if (columns != out_features || output_splits.size() > 16) {
      throw InputError(fmt::format("GEMV: {} output splits of {} columns in all; they must cover N = {} (at most 16)",
                                   output_splits.size(), columns, out_features));
    }
    for (const GemvEpilogue::TensorInput& tensor : epilogue.tensor_inputs()) {
      if (!tensor.broadcast_rows) {
        throw InputError(fmt::format("GEMV: with split outputs the epilogue tensor '{}' must be [N]", tensor.name));
      }
    }
  }
  if (rope_cache) {
    const GemvRopeCacheEpilogue& rope = *rope_cache;
    (void)gemv_rope_row_order(rope);  // its checks of the heads and dims
    const std::int64_t q_width = rope.q_heads * rope.head_dim, kv_width = rope.kv_heads * rope.head_dim;
    if (output_splits != std::vector<std::int64_t>{q_width, kv_width, kv_width}) {
      throw InputError(fmt::format("GEMV: the rope epilogue writes q, k and v: output splits {}+{}+{}, not {}", q_width,
                                   kv_width, kv_width, fmt::join(output_splits, "+")));
    }
    if (epilogue.product_count() != 1 || mainloop != GemvMainloop::register_batches || argmax_rows) {
      throw InputError("GEMV: the rope epilogue needs one matrix, the register-batch mainloop and no argmax");
    }
    if (rope.capacity < 1) throw InputError(fmt::format("GEMV: a rope epilogue's caches hold {} rows", rope.capacity));
  }
  if (attention) {
    const GemvAttentionPrologue& a = *attention;
    if (a.head_dim != 64 && a.head_dim != 128) {
      throw InputError(fmt::format("GEMV: the attention prologue's head dim must be 64 or 128, not {}", a.head_dim));
    }
    if (a.kv_heads < 1 || a.groups < 1 || a.groups > 8 || a.keys < 1) {
      throw InputError(fmt::format("GEMV: the attention prologue takes 1..8 query heads a KV head over at least one "
                                   "key, not {} KV heads x {} over {} keys",
                                   a.kv_heads, a.groups, a.keys));
    }
    if (a.kv_heads * a.groups * a.head_dim != in_features) {
      throw InputError(fmt::format("GEMV: the attention output has {} x {} x {} columns, K is {}", a.kv_heads, a.groups,
                                   a.head_dim, in_features));
    }
    const std::int64_t pairs = a.head_dim / 2;
    if (pairs % warps_per_block != 0 || pairs / warps_per_block > 32) {
      throw InputError(fmt::format("GEMV: the attention prologue shares the {} value pairs of a head between the warps "
                                   "evenly (at most 32 a warp): not with {} warps",
                                   pairs, warps_per_block));
    }
    if (rows != 1 || epilogue.product_count() != 1 || mainloop != GemvMainloop::register_batches || k_splits != 1 ||
        shared_stages >= 2 || tile_loop_blocks_per_multiprocessor > 0 || argmax_rows || x_rms_norm_eps || rope_cache ||
        !output_splits.empty()) {
      throw InputError(fmt::format("GEMV {}: the attention prologue needs one activation row and one matrix in the "
                                   "register-batch mainloop, batches in registers, one output, and no split-K, tile "
                                   "loop, argmax, norm or rope",
                                   to_string()));
    }
    const std::int64_t blocks = ((out_features + 15) / 16 + tiles_per_block - 1) / tiles_per_block;
    if (blocks < a.kv_heads) {
      throw InputError(fmt::format("GEMV {}: fewer blocks than the {} KV heads the attention prologue gives one each",
                                   to_string(), a.kv_heads));
    }
    // Its blocks wait for one another, so all of them must fit the SMs at once (64 warps and 32
    // blocks an SM).
    if (multiprocessors < 1 || blocks > std::int64_t{multiprocessors} * blocks_an_sm_holds(warps_per_block)) {
      throw InputError(fmt::format("GEMV {}: the attention prologue needs its {} blocks of {} warps resident at once "
                                   "on {} SMs",
                                   to_string(), blocks, warps_per_block, multiprocessors));
    }
  }
  if (x_with_batch && (mainloop != GemvMainloop::register_batches || !double_buffered || shared_stages >= 2 ||
                       x_rms_norm_eps || attention)) {
    throw InputError(fmt::format("GEMV {}: x_with_batch needs double-buffered register batches (shared_stages 0) and x "
                                 "as stored (no x_rms_norm_eps, no attention prologue)",
                                 to_string()));
  }
  if (half_products && (!format.is_affine() || mainloop != GemvMainloop::register_batches || shared_stages >= 2 ||
                        shared_group_sums || x_with_batch || attention || !x_staged_in_shared_memory(*this))) {
    throw InputError(fmt::format("GEMV {}: half_products needs affine weights in register batches (shared_stages 0), "
                                 "x as the block stages it (no shared_group_sums, x_with_batch or attention prologue) "
                                 "and M x K values within {} bytes",
                                 to_string(), kMaxHalfStagedXBytes));
  }
  if (x_staged_by_async_copy && (!x_rms_norm_eps || !x_staged_in_shared_memory(*this) || shared_stages >= 2)) {
    throw InputError(fmt::format("GEMV {}: x_staged_by_async_copy needs x normalized and staged in shared memory "
                                 "(x_rms_norm_eps, M x K bf16 values within {} bytes) and batches in registers "
                                 "(the register-batch mainloop, shared_stages 0: the ring's cp.async groups would wait for it)",
                                 to_string(), half_products ? kMaxHalfStagedXBytes : kMaxStagedXBytes));
  }
  if (mainloop == GemvMainloop::streamed) {
    if (argmax_rows) throw InputError("GEMV: argmax_rows needs the register-batch mainloop, not the streamed one");
    validate_streamed(*this);
    return;
  }
  const std::int64_t shared = partial_sum_bytes(*this);
  if (shared > 48 * 1024) {
    throw InputError(fmt::format("GEMV {}: {} bytes of shared memory for partial sums (at most 49152)", to_string(), shared));
  }
  const std::int64_t iterations = (in_features + format.columns_per_iteration() - 1) / format.columns_per_iteration();
  if (k_splits < 1 || k_splits > 16 || k_splits > iterations) {
    throw InputError(fmt::format("GEMV {}: k_splits must be 1..min(16, {} iterations), not {}", to_string(), iterations,
                                 k_splits));
  }
  if (argmax_rows && !output_splits.empty()) {
    throw InputError(fmt::format("GEMV {}: argmax_rows reads back one output [M, N], not output_splits", to_string()));
  }
  if (argmax_rows && k_splits != 1) {
    throw InputError(fmt::format("GEMV {}: argmax_rows needs the unsplit store (k_splits 1, not {})", to_string(), k_splits));
  }
  if (tile_loop_blocks_per_multiprocessor < 0 || tile_loop_blocks_per_multiprocessor > 32) {
    throw InputError(fmt::format("GEMV: tile_loop_blocks_per_multiprocessor must be 0..32, not {}",
                                 tile_loop_blocks_per_multiprocessor));
  }
  if (tile_loop_blocks_per_multiprocessor > 0 && (k_splits != 1 || mainloop != GemvMainloop::register_batches)) {
    throw InputError("GEMV: the tile loop needs the register-batch mainloop without split-K");
  }
  if (tile_loop_blocks_per_multiprocessor > 0 && multiprocessors < 1) {
    throw InputError(fmt::format("GEMV: multiprocessors must be positive, not {}", multiprocessors));
  }
  if (resident_blocks_per_multiprocessor < 0 || resident_blocks_per_multiprocessor > blocks_an_sm_holds(warps_per_block)) {
    throw InputError(fmt::format("GEMV: resident_blocks_per_multiprocessor must be 0..{} for {} warps a block "
                                 "(64 warps and 32 blocks an SM), not {}",
                                 blocks_an_sm_holds(warps_per_block), warps_per_block, resident_blocks_per_multiprocessor));
  }
  if (resident_blocks_per_multiprocessor > 0 && mainloop != GemvMainloop::register_batches) {
    throw InputError("GEMV: resident_blocks_per_multiprocessor is for the register-batch mainloop");
  }
  if (l2_prefetch_rounds < 0 || l2_prefetch_rounds > 1024) {
    throw InputError(fmt::format("GEMV: l2_prefetch_rounds must be 0..1024, not {}", l2_prefetch_rounds));
  }
  if (shared_stages != 0 && (shared_stages < 2 || shared_stages > 8)) {
    throw InputError(fmt::format("GEMV: shared_stages must be 0 (registers) or 2..8, not {}", shared_stages));
  }
  if (shared_group_sums && !format.is_affine()) {
    throw InputError("GEMV: shared_group_sums needs affine weights (dense has no groups)");
  }
  const std::int64_t static_shared = static_shared_bytes(*this);
  if (static_shared > 48 * 1024) {
    throw InputError(fmt::format("GEMV {}: {} bytes of static shared memory for partial and group sums, x and the "
                                 "joins (at most 49152)",
                                 to_string(), static_shared));
  }
  if (static_shared + staged_ring_bytes(*this) > shared_memory_per_block) {
    throw InputError(fmt::format("GEMV {}: {} bytes of shared memory per block (at most {})", to_string(),
                                 static_shared + staged_ring_bytes(*this), shared_memory_per_block));
  }
}

std::string GemvKernelConfig::to_string() const {
  std::string text = fmt::format("{} M={} N={} K={} [{}]", format.to_string(), rows, out_features, in_features,
                                 epilogue.to_string());
  if (x_rms_norm_eps) text += fmt::format(" x=rms_norm(eps={:g})", *x_rms_norm_eps);
  if (!output_splits.empty()) text += fmt::format(" outputs={}", fmt::join(output_splits, "+"));
  if (rope_cache) {
    text += fmt::format(" rope_cache(heads={}/{} D={} dims={} capacity={}{})", rope_cache->q_heads, rope_cache->kv_heads,
                        rope_cache->head_dim, rope_cache->dims(), rope_cache->capacity,
                        rope_cache->inputs_before_wait ? " inputs before the wait" : "");
  }
  if (mainloop == GemvMainloop::streamed) {
    return text + fmt::format(" streamed warps={} stage_iterations={} stages={} grid={}x{}", warps_per_block,
                              stage_iterations, stages, multiprocessors, blocks_per_multiprocessor);
  }
  if (epilogue.product_count() == 2) text += fmt::format(" {}", gated_schedule_name(schedule));
  text += fmt::format(" warps={} tiles={} in_flight={}{}", warps_per_block, tiles_per_block, iterations_in_flight,
                      shared_stages >= 2 ? fmt::format(" shared_stages={}", shared_stages)
                                         : std::string(double_buffered ? " double_buffered" : ""));
  if (k_splits > 1) text += fmt::format(" k_splits={}", k_splits);
  if (shared_group_sums) text += " shared_group_sums";
  if (argmax_rows) text += " argmax_rows";
  if (tile_loop_blocks_per_multiprocessor > 0) {
    text += fmt::format(" tile_loop={}x{}", multiprocessors, tile_loop_blocks_per_multiprocessor);
  }
  if (l2_prefetch_rounds > 0) text += fmt::format(" l2_prefetch_rounds={}", l2_prefetch_rounds);
  if (x_staged_by_async_copy) text += " x_staged_by_async_copy";
  if (x_with_batch) text += " x_with_batch";
  if (half_products) text += " half_products";
  if (resident_blocks_per_multiprocessor > 0) text += fmt::format(" resident_blocks={}", resident_blocks_per_multiprocessor);
  if (attention) {
    text += fmt::format(" attention(heads={}x{} D={} keys={} scale={:g})", attention->kv_heads, attention->groups,
                        attention->head_dim, attention->keys, attention->scale);
  }
  return text;
}

GemvKernelSource generate_gemv_kernel(const GemvKernelConfig& config) {
  config.validate();
  if (config.mainloop == GemvMainloop::streamed) return generate_streamed_gemv_kernel(config);
  const int products = config.epilogue.product_count();
  const bool scratch = products == 2 && config.schedule == GatedSchedule::scratch_spilled;
  const bool staged = config.shared_stages >= 2;
  const std::int64_t tile_count = (config.out_features + 15) / 16;
  const std::int64_t tile_blocks = (tile_count + config.tiles_per_block - 1) / config.tiles_per_block;

  const std::int64_t grid_blocks =
      config.tile_loop_blocks_per_multiprocessor > 0
          ? std::min<std::int64_t>(tile_blocks, std::int64_t{config.multiprocessors} * config.tile_loop_blocks_per_multiprocessor)
          : tile_blocks * config.k_splits;

  GemvKernelSource result;
  const std::uint64_t epilogue_hash = gemv_epilogue_hash(config);
  std::string schedule_tag = staged ? fmt::format("s{}", config.shared_stages) : config.double_buffered ? "d" : "";
  if (config.k_splits > 1) schedule_tag += fmt::format("k{}", config.k_splits);
  if (config.shared_group_sums) schedule_tag += "g";
  if (config.argmax_rows) schedule_tag += "a";
  if (config.tile_loop_blocks_per_multiprocessor > 0) schedule_tag += fmt::format("l{}", config.tile_loop_blocks_per_multiprocessor);
  if (config.l2_prefetch_rounds > 0) schedule_tag += fmt::format("p{}", config.l2_prefetch_rounds);
  if (config.x_staged_by_async_copy) schedule_tag += "c";
  if (config.x_with_batch) schedule_tag += "x";
  if (config.half_products) schedule_tag += "h";
  if (config.resident_blocks_per_multiprocessor > 0) schedule_tag += fmt::format("r{}", config.resident_blocks_per_multiprocessor);
  if (config.attention) {
    // The scale's float bits, as the kernel's constant holds it.
    schedule_tag += fmt::format("_att{}x{}d{}t{}s{:08x}", config.attention->kv_heads, config.attention->groups,
                                config.attention->head_dim, config.attention->keys,
                                std::bit_cast<std::uint32_t>(static_cast<float>(config.attention->scale)));
  }
  result.kernel_name =
      fmt::format("metile_gemv_{}_m{}_n{}_k{}_p{}{}_w{}t{}f{}{}_e{:08x}", gemv_format_tag(config.format), config.rows,
                  config.out_features, config.in_features, products, scratch ? "s" : "r", config.warps_per_block,
                  config.tiles_per_block, config.iterations_in_flight, schedule_tag, epilogue_hash & 0xFFFFFFFFu);

  // The attention prologue's blocks wait for one another: hold the registers to what keeps the
  // whole grid resident (LoadedGemv::load checks the device's count).
  GemvKernelConfig bounded = config;
  if (config.attention && config.resident_blocks_per_multiprocessor == 0) {
    bounded.resident_blocks_per_multiprocessor =
        static_cast<int>((tile_blocks + config.multiprocessors - 1) / config.multiprocessors);
  }
  std::string source = fmt::format("// Generated by metile (src/codegen/gemv_mainloop.cpp): {}\n", config.to_string());
  source += gemv_problem_constants(config, config.attention.has_value());
  source += gemv_register_constants(config, config.k_splits);
  source += gemv_device_helpers();
  if (config.argmax_rows) {
    source += codegen_detail::cuda_argmax_helpers();
    // The most blocks the grid may have (a tile loop's grid may be launched smaller: gridDim.x).
    source += fmt::format("constexpr int kArgmaxWinners = {};  // one winner a block (argmax_rows_tail)\n", grid_blocks);
  }
  if (config.attention) {
    source += gemv_attention_prologue(config);
  } else {
    source += gemv_activations_after_previous_kernel();
  }
  source += register_mainloop_body;
  source += "\n// The op table's device functions (src/graph/op_registry.cpp), which epilogue expressions call.\n";
  source += cuda_elementwise_helpers();
  source += gemv_output_functions(config);

  const bool has_workspace = config.k_splits > 1 || config.argmax_rows || config.attention;
  source += gemv_kernel_entry(bounded, result.kernel_name,
                              std::string(config.rope_cache ? ", const int* __restrict__ positions" : "") +
                                  std::string(config.argmax_rows ? ", int* __restrict__ next" : "") +
                                  std::string(config.attention ? ",\n    const u16* __restrict__ attention_q, "
                                                                 "const u16* __restrict__ attention_k, "
                                                                 "const u16* __restrict__ attention_v, "
                                                                 "const int* __restrict__ attention_positions"
                                                               : "") +
                                  (has_workspace ? ", float* __restrict__ workspace" : ""));
  if (!has_workspace) source += "  float* const workspace = nullptr;  // no split-K join\n";
  if (config.attention) {
    source += "  if (threadIdx.x == 0) {\n    attention_arguments = {attention_q, attention_k, attention_v, attention_positions,\n"
              "                           reinterpret_cast<u32*>(workspace)};\n  }\n";
  }
  source += gemv_outputs_binding(config);
  source += "  constexpr bool kUnitLoop = kTileLoop;\n"
            "  const int entry_first_unit = (int)blockIdx.x;\n"
            "  const int entry_unit_stride = kTileLoop ? (int)gridDim.x : kTileBlocks * kSplits;\n";
  source += kernel_entry_body;
  if (config.argmax_rows) source += argmax_rows_block;  // per tile block, inside the unit loop
  source += kernel_entry_loop_end;
  if (config.argmax_rows) source += argmax_rows_tail;   // ends with the kernel's closing brace
  else source += "}\n";

  result.source = std::move(source);
  result.grid_blocks = static_cast<unsigned>(grid_blocks);
  result.grid_shrinks_to_resident = config.tile_loop_blocks_per_multiprocessor > 0;
  result.block_threads = static_cast<unsigned>(config.warps_per_block * 32);
  result.static_shared_bytes = static_cast<unsigned>(static_shared_bytes(config));
  result.dynamic_shared_bytes = static_cast<unsigned>(staged_ring_bytes(config));
  if (config.k_splits > 1) {
    result.workspace_bytes = static_cast<std::uint64_t>(tile_blocks * config.k_splits * products * config.rows *
                                                            config.tiles_per_block * 16 * 4 +
                                                        tile_blocks * 4);
  }
  if (config.argmax_rows) {  // a value's bits and an index per block and row, then the arrival counter
    result.workspace_bytes = static_cast<std::uint64_t>(2 * std::int64_t{result.grid_blocks} * config.rows * 4 + 4);
  }
  if (config.attention) {  // the arrival and departure counters; the blocks wait for one another
    result.workspace_bytes = 8;
    result.co_resident_blocks_per_multiprocessor = 1;
    result.static_shared_bytes += static_cast<unsigned>(gemv_attention_shared_bytes(config));
  }
  return result;
}

std::string gemv_timeline_source(const GemvKernelSource& kernel, std::uint64_t address, int blocks_an_sm) {
  const std::string entry = "__launch_bounds__(";
  const std::size_t name = kernel.source.find(") " + kernel.kernel_name + "(");
  const std::size_t bounds = name == std::string::npos ? std::string::npos : kernel.source.rfind(entry, name);
  if (bounds == std::string::npos || blocks_an_sm < 1) {
    throw InputError(fmt::format("gemv_timeline_source: no bounded entry named {} (or {} blocks an SM)", kernel.kernel_name,
                                 blocks_an_sm));
  }
  std::string source = fmt::format("#define METILE_TIMELINE_BASE 0x{:x}ull\n", address) + kernel.source;
  const std::size_t shift = source.size() - kernel.source.size();
  source.replace(bounds + shift, name - bounds + 1, fmt::format("{}{}, {})", entry, kernel.block_threads, blocks_an_sm));
  return source;
}

std::vector<GemvKernelConfig> gemv_tuning_candidates(const GemvKernelConfig& base, int multiprocessors) {
  base.validate();
  if (base.mainloop == GemvMainloop::streamed) {
    GemvKernelConfig streamed = base;
    streamed.multiprocessors = multiprocessors;
    return streamed_tuning_candidates(streamed);
  }
  const int products = base.epilogue.product_count();
  const int products_in_registers = products == 2 && base.schedule == GatedSchedule::register_resident ? 2 : 1;
  const std::int64_t tiles = (base.out_features + 15) / 16;
  const int loads_per_iteration = base.format.columns_per_iteration() / base.format.columns_per_load();
  // About eight 16-byte weight loads in flight per lane keep HBM busy with 16 warps per SM
  // (gemv_compile_test checks that ptxas keeps these shapes in registers). More than 8 rows
  // doubles the x fragments, 16 warps cap a thread at 128 registers (__launch_bounds__), and a
  // double buffer holds two batches: halve the depth for each; `deeper` doubles it again.
  auto in_flight = [&](int warps, bool double_buffered, bool deeper) {
    int depth = 8 / (2 * products_in_registers * loads_per_iteration);
    if (base.rows > 8) depth /= 2;
    if (warps > 8) depth /= 2;
    if (double_buffered) depth /= 2;
    if (deeper) depth = std::max(depth, 1) * 2;
    return std::clamp(depth, 1, 4);
  };
  std::vector<GemvKernelConfig> candidates;
  auto add_config = [&](GemvKernelConfig config) {
    for (const GemvKernelConfig& existing : candidates) {
      if (existing.warps_per_block == config.warps_per_block && existing.tiles_per_block == config.tiles_per_block &&
          existing.double_buffered == config.double_buffered &&
          existing.iterations_in_flight == config.iterations_in_flight && existing.k_splits == config.k_splits &&
          existing.shared_stages == config.shared_stages && existing.shared_group_sums == config.shared_group_sums &&
          existing.tile_loop_blocks_per_multiprocessor == config.tile_loop_blocks_per_multiprocessor &&
          existing.l2_prefetch_rounds == config.l2_prefetch_rounds &&
          existing.resident_blocks_per_multiprocessor == config.resident_blocks_per_multiprocessor &&
          existing.x_with_batch == config.x_with_batch && existing.half_products == config.half_products) {
        return;
      }
    }
    try {
      config.validate();
    } catch (const InputError&) {
      return;
    }
    candidates.push_back(config);
  };
  // A register-batch shape (batches in registers, no staging).
  auto register_shape = [&](int warps, bool double_buffered, bool deeper = false, int k_splits = 1,
                            bool group_sums = false, int tiles_per_block = 1) {
    GemvKernelConfig config = base;
    config.warps_per_block = warps;
    config.tiles_per_block = tiles_per_block;
    config.double_buffered = double_buffered;
    config.iterations_in_flight = std::max(1, in_flight(warps, double_buffered, deeper) / tiles_per_block);
    config.k_splits = k_splits;
    config.shared_stages = 0;
    config.shared_group_sums = group_sums;
    config.multiprocessors = multiprocessors;  // the attention prologue's residency bound is per SM
    return config;
  };
  auto add = [&](int warps, bool double_buffered, bool deeper = false, int k_splits = 1, bool group_sums = false,
                 int tiles_per_block = 1) {
    add_config(register_shape(warps, double_buffered, deeper, k_splits, group_sums, tiles_per_block));
  };
  // Staged batches (shared_stages): one iteration per affine batch (in shared memory the depth
  // comes from the ring, not the batch), the register heuristic's batch for dense; as many slots
  // as fit `ring_bytes` per block, so that several blocks share an SM's 227 KiB.
  auto add_staged = [&](int warps, std::int64_t ring_bytes, int k_splits = 1) {
    GemvKernelConfig config = base;
    config.warps_per_block = warps;
    config.tiles_per_block = 1;
    config.double_buffered = false;
    config.iterations_in_flight = base.format.is_affine() ? 1 : in_flight(warps, false, false);
    config.k_splits = k_splits;
    config.shared_group_sums = false;
    config.shared_stages = 2;
    const std::int64_t slot_bytes = staged_ring_bytes(config) / 2;
    config.shared_stages = static_cast<int>(std::clamp<std::int64_t>(ring_bytes / slot_bytes, 2, 8));
    add_config(config);
  };
  // Measured on the H200 (notes/mlp_decode.md): one tile per block beat two everywhere, and a
  // grid whose blocks do not all fit at once loses a partial wave. A wide N (many tiles) wants
  // few warps per tile so that every block is resident; a narrow N splits K over more warps, and
  // over several blocks (split-K) when there are too few tiles for the SMs. The first five of each
  // list are the register shapes of v3; staged and split-K shapes follow (issue 15), for the
  // register-resident schedule only (the scratch-spilled one has never been chosen).
  const bool narrow = tiles < 2 * multiprocessors;
  const bool extended = products_in_registers == products;
  const bool affine = base.format.is_affine();
  const std::int64_t iterations = (base.in_features + base.format.columns_per_iteration() - 1) / base.format.columns_per_iteration();
  // Split-K only where some SMs would get no tile at all: about two blocks per SM, each split at
  // least 4 iterations long. Measured on the H200 (device call 8, ncu): splitting Llama-3-8B's down
  // projection (256 tiles) three ways took 35 us against 23 us unsplit: shorter blocks only add
  // latency-bound prologues and joins once every SM already has work.
  const int splits = tiles >= multiprocessors ? 1
                                              : static_cast<int>(std::clamp<std::int64_t>(
                                                    std::min<std::int64_t>((2 * multiprocessors + tiles - 1) / tiles,
                                                                           iterations / 4),
                                                    1, 8));
  // Whether every batch of a shape lies whole inside the matrix (kBatchesWhole in the kernel: no
  // predicates, no zeroed registers), and for a K whose iterations neither 8 nor 16 warps divide
  // (Qwen2.5-1.5B's down projection: 70), the most warps from 16 down to 5 whose batches are whole.
  auto whole_warps = [&](bool double_buffered) {  // 0 where none from 16 down to 5 is whole
    for (int warps = 16; warps >= 5; --warps) {
      if (gemv_batches_whole(register_shape(warps, double_buffered))) return warps;
    }
    return 0;
  };
  auto add_whole_warps = [&](bool double_buffered) {
    if (const int warps = whole_warps(double_buffered)) add(warps, double_buffered);
  };
  if (narrow) {
    // Between one and two tiles an SM (Llama-3-8B's down and o-projections: 256 tiles for 132 SMs) the
    // affine double-buffered shapes are compiled for the two blocks an SM the grid puts there
    // (__launch_bounds__(threads, 2)). ptxas then keeps more of the batches live (4-bit g64 down, M = 1,
    // w8 f2 db: 111 -> 127 registers) and, for 16 warps, fits two blocks instead of one (69 -> 64
    // registers). Measured alone on the H200 (`mlp_decode_benchmark --residency`, session 25): 4-bit
    // w8 f2 db 13.1 -> 12.3 us, w16 f1 db 15.0 -> 12.6; 8-bit w8 f2 db 21.0 -> 18.6, w16 f1 db 18.2
    // -> 17.9. At M > 8 the bound only spilled (w16 f1 db 23.7 -> 36.7 us), so it stays unbounded.
    const bool two_blocks_an_sm = affine && base.rows <= 8 && tiles > multiprocessors;
    auto add_narrow = [&](int warps) {
      GemvKernelConfig config = register_shape(warps, true);
      if (two_blocks_an_sm) config.resident_blocks_per_multiprocessor = 2;
      add_config(config);
    };
    // At most one tile an SM (the small models' down and o-projections: 96-128 tiles), affine, M <= 8:
    // first, the one-block shape whose iterations split evenly over the most warps (16, else the
    // whole-warps count) with x carried by its batches (x_with_batch). Measured on the H200
    // (mlp_decode_benchmark --quick, session 27): Qwen2.5-1.5B down w14 f1 db 8.9 -> 8.3 us, Llama-3.2-1B
    // w16 f1 db 8.8 -> 8.4; every shape of the list carrying x, Llama-3-8B's 256-tile down spilled
    // (w8 f2 db resident2: 68 bytes) and M = 16 was slower, so only these. The shapes without it follow,
    // so a region's race (its first three) still has the incumbent.
    if (affine && base.rows <= 8 && tiles <= multiprocessors && !base.x_rms_norm_eps && !base.attention) {
      const int warps = whole_warps(true);
      GemvKernelConfig carrying = register_shape(warps > 0 ? warps : 16, true);
      carrying.x_with_batch = true;
      add_config(carrying);
    }
    add_narrow(8);
    if (!gemv_batches_whole(register_shape(8, true)) && !gemv_batches_whole(register_shape(16, true))) add_whole_warps(true);
    add_narrow(16);
    add(8, true, true);  // deeper (f4 at M = 1: 189 registers, one block an SM; bounded to two it spilled)
    add(4, true);
    add(8, false);
    if (extended) {
      if (splits >= 2) add(8, true, false, splits);
      if (splits >= 2) add(4, true, false, splits);
      add_staged(8, 72 * 1024);
      if (splits >= 2) add_staged(8, 72 * 1024, splits);
      if (affine) add(16, true, false, 1, true);
      if (affine) add(8, true, false, 1, true);
    }
  } else {
    // 4 warps with unbuffered batches come second (but for the vocabulary-wide shapes below): since
    // batches are whole (no zeroing, no predicates) it won every wide gate/up race on the H200
    // (session 10: Llama-3-8B bf16 61.2 us against 65.7 for the first; 4-bit g64 20.8 against 22.3;
    // M = 16 31.2 against 38.9), and a region races only the first few of each family
    // (gemv_lowering_shapes_per_family).
    const bool vocabulary_wide = products == 1 && tiles >= 16 * multiprocessors;
    // Fewer than 6 tiles an SM (Llama-3-8B's q/k/v, 384 tiles): four warps a tile leave under 24 warps
    // an SM. Measured there under ncu (session 12): w4 f2 db 17.5% achieved occupancy, no warp
    // eligible in 89% of the cycles, DRAM 54%; w2 f4 db, the same bytes in flight with half the
    // warps, took the same 20.3 us. Bytes in flight per SM are what is missing, so these shapes lead
    // with more warps a tile (the MLP's stages, at 27-31 warps an SM, run at 87-91% of copy).
    const bool few_tiles = !vocabulary_wide && tiles < 6 * multiprocessors;
    if (few_tiles && products == 1) {
      add(8, true);
      add(16, true);
      // The same 16 warps a tile held to the registers that fit the whole grid on the SMs at once
      // (Llama-3-8B's q/k/v: 384 tiles, 3 blocks an SM, <= 40 registers, against 2 at ptxas's 64):
      // every weight load of the stage is issued before its wait, none waits for a second wave. Two
      // blocks an SM need no bound (64 registers fit them). One activation row only: each row's
      // accumulators take registers the bound does not have (Llama-3-8B's q/k/v at M = 8 parked 180
      // bytes, at M = 16 532; at M = 1 it parks 160 with the rope epilogue and has never won a race).
      const std::int64_t waves_of_blocks = (tiles + multiprocessors - 1) / multiprocessors;
      if (base.rows == 1 && waves_of_blocks >= 3 && waves_of_blocks <= blocks_an_sm_holds(16)) {
        GemvKernelConfig one_wave = register_shape(16, true);
        one_wave.resident_blocks_per_multiprocessor = static_cast<int>(waves_of_blocks);
        add_config(one_wave);
      }
      add(4, true);
    } else if (few_tiles) {
      add(4, false);
      add(4, true);
      add(8, true);
    }
    // A vocabulary-wide head races its tile loops first (below): the unlooped two-warp shape took 2.5x
    // the four-tile loop's time at M = 16 and 1.2-1.4x the winner's at M = 1 (session 45, H100).
    if (!vocabulary_wide) {
      add(2, true);
      add(4, false);
    }
    // A vocabulary-wide N (the LM head: 128256 rows of 2048, 16 iterations of 4-bit) gives each
    // one-tile block a few iterations per warp behind a prologue of its own (the norm of x, the
    // argmax join): 8016 blocks of 2 warps took 117.6 us, 30% of copy, under ncu (Llama-3.2-1B).
    // Blocks of several tiles share that prologue and keep more rows' loads in flight per x
    // fragment, or one-tile blocks loop over the tile blocks, about as many as fit at once (two
    // warps at ~96 registers: 10 a multiprocessor; four: 5), so the prologue runs once per block.
    // One product only: SwiGLU's two at four tiles spill. They come right after the first shape:
    // a one-stage region races the first few of each family (gemv_stage_configs).
    // The loop also takes blocks of two tiles (one iteration in flight a tile: the same bytes in
    // flight a warp), so that one join (the warps' sums, the store, the argmax) serves twice the
    // bytes: at K = 1536 a one-tile block's warps have 1.5 batches each and the join was as long
    // as the mainloop. Raced on the H200 (session 36, notes/mlp_decode.md): Qwen2.5-1.5B's 4-bit
    // head 51.2 -> 44.9 us; Llama-3.2-1B's (K = 2048) kept its one-tile loop.
    // Four tiles a block at three blocks an SM (one join for four tiles' bytes) won the heads' M = 16
    // races on the H100 (session 45, notes/mlp_decode.md): Llama-3-8B 223.0 -> 203.2 us, Qwen2.5-1.5B
    // 138.6 -> 125.1; at M = 1 the two-tile loop kept both (Qwen 53.2 against 54.3). The four
    // shapes a one-stage region races are the four loops.
    if (vocabulary_wide) {
      auto add_looped = [&](int warps, int blocks_per_multiprocessor, int tiles_per_block = 1) {
        GemvKernelConfig looped = register_shape(warps, true, false, 1, false, tiles_per_block);
        looped.multiprocessors = multiprocessors;
        looped.tile_loop_blocks_per_multiprocessor = blocks_per_multiprocessor;
        add_config(looped);
      };
      add_looped(2, 8);
      add_looped(4, 4, 2);
      add_looped(4, 4);
      add_looped(4, 3, 4);
      add_looped(2, 8, 2);
      add(2, true);
      add(4, true, false, 1, false, 2);
      add(4, true, false, 1, false, 4);
      add(8, true, false, 1, false, 4);
    }
    add(4, true);
    add(2, true, true);
    add(8, true);
    add(4, false);
    if (extended) {
      add_staged(4, 64 * 1024);
      add_staged(8, 96 * 1024);
      add_staged(4, 40 * 1024);
      if (affine) add(4, false, false, 1, true);
      if (affine) add(2, true, false, 1, true);
      // SwiGLU's affine gate/up at M > 8: two weight iterations in flight (f2) with the registers held to
      // four 4-warp blocks an SM (<= 128). The unbounded M > 8 shapes keep one iteration in flight at
      // 106-164 registers; under ncu (session 24) the winner, w4 f1 batch, ran at 21.8% occupancy and
      // 37% of DRAM peak with the issue slots 30% busy: too few loads in flight, not too many
      // instructions. This shape doubles the weight bytes in flight at the same 16 warps an SM (4-bit
      // parks 8 bytes in local memory for it, 8-bit none). Raced on the H200 (mlp_decode_benchmark
      // --quick, M = 16): 4-bit g64 gate/up 31.2 -> 29.6 us, 8-bit 40.2 -> 38.1, Llama-3.2-1B 11.5 ->
      // 10.9; g128 27.6 against 27.4 for w2 f1 db.
      // Its one-iteration twin under the same bound (`mlp_decode_benchmark --residency`, session 25: 4-bit
      // g64 w4 f1 batch 32.6 -> 27.5 us alone, 106 -> 128 registers at the same four blocks an SM: the
      // bound lets ptxas keep the batch's loads ahead of the math).
      if (affine && products == 2 && base.rows > 8) {
        for (bool deeper : {true, false}) {
          GemvKernelConfig bounded = register_shape(4, false, deeper);
          bounded.resident_blocks_per_multiprocessor = 4;
          add_config(bounded);
        }
      }
      // No two-tile shape at M > 8: sharing each x fragment between two tiles (4-bit g64 gate/up w4 t2
      // f1 batch: x loads 1.00 -> 0.75 a weight word, 18.03 instructions a word against 18.88, 150
      // registers) raced at 55.7 us against 31.7 for one tile on the H200, its group-sums twin at
      // 63.7 against 31.0 (session 24, notes/mlp_decode.md).
    }
  }
  return candidates;
}

std::vector<GemvKernelConfig> gemv_valid_twins(std::span<const GemvKernelConfig> configs,
                                               const std::function<void(GemvKernelConfig&)>& change) {
  std::vector<GemvKernelConfig> twins;
  for (GemvKernelConfig config : configs) {
    const std::string before = config.to_string();
    change(config);
    // A config that already had the option is not its own twin (two candidates, one name).
    if (config.to_string() == before) continue;
    try {
      config.validate();
    } catch (const InputError&) {
      continue;
    }
    twins.push_back(std::move(config));
  }
  return twins;
}

std::vector<GemvKernelConfig> gemv_half_twins(std::span<const GemvKernelConfig> configs, int multiprocessors) {
  std::vector<GemvKernelConfig> twins = gemv_valid_twins(configs, [](GemvKernelConfig& config) { config.half_products = true; });
  // Half products take more registers than the plain shape (4-bit g64 gate/up w4 f2 batch: 64 -> 80),
  // which can leave a one-wave grid short of one block an SM: Llama-3-8B's 896 gate/up blocks need 7
  // an SM, 80 registers fit 6, and the last 104 blocks run as a second wave.
  const std::vector<GemvKernelConfig> bounded = gemv_valid_twins(twins, [&](GemvKernelConfig& config) {
    if (const int bound = gemv_one_wave_bound(config, multiprocessors)) config.resident_blocks_per_multiprocessor = bound;
  });
  twins.insert(twins.end(), bounded.begin(), bounded.end());
  return twins;
}

int gemv_one_wave_bound(const GemvKernelConfig& config, int multiprocessors) {
  // Double-buffered batches hold two batches' registers, the norm prologue its sums and scales: bounded
  // this tight they spill (4-bit g64 gate/up at 7 blocks an SM, half products: w4 f1 db 152 bytes, w4 f2
  // batch with the norm 80, or 40 without its weights preloaded; w4 f2 batch as stored: none).
  if (config.mainloop != GemvMainloop::register_batches || config.resident_blocks_per_multiprocessor > 0 ||
      config.tile_loop_blocks_per_multiprocessor > 0 || config.double_buffered || config.x_rms_norm_eps ||
      config.rows > 8 || multiprocessors < 1) {
    return 0;
  }
  const std::int64_t tiles = (config.out_features + 15) / 16;
  const std::int64_t blocks = (tiles + config.tiles_per_block - 1) / config.tiles_per_block * config.k_splits;
  const std::int64_t waves = (blocks + multiprocessors - 1) / multiprocessors;
  // Tight: 22..28 warps an SM, i.e. 73..93 registers a thread (a looser bound changes nothing that
  // ptxas does, a tighter one spills the batches).
  const std::int64_t warps = waves * config.warps_per_block;
  return warps >= 22 && warps <= 28 ? static_cast<int>(waves) : 0;
}

bool gemv_batches_whole(const GemvKernelConfig& config) {
  const std::int64_t columns = config.format.columns_per_iteration();
  const std::int64_t iterations = (config.in_features + columns - 1) / columns;
  const std::int64_t tiles = (config.out_features + 15) / 16;
  return config.k_splits == 1 && config.in_features % columns == 0 &&
         iterations % (std::int64_t{config.warps_per_block} * config.iterations_in_flight) == 0 &&
         (config.format.is_affine() ? tiles % config.tiles_per_block == 0 : config.out_features % (16 * config.tiles_per_block) == 0);
}

int gemv_l2_prefetch_rounds(const GemvKernelConfig& config, int multiprocessors, std::int64_t l2_budget_bytes) {
  const std::int64_t columns = config.format.columns_per_iteration();
  const std::int64_t iterations = (config.in_features + columns - 1) / columns;
  const std::int64_t stride = std::int64_t{config.warps_per_block} * config.iterations_in_flight;
  const std::int64_t rounds = ((iterations + config.k_splits - 1) / config.k_splits + stride - 1) / stride;
  const int products = config.epilogue.product_count();
  // One iteration of one 16-row tile: 1 KiB per load (every format), plus its groups' scales and
  // biases (64 bytes a group) when affine.
  const std::int64_t iteration_bytes =
      columns / config.format.columns_per_load() * 1024 + (config.format.is_affine() ? columns / config.format.group_size * 64 : 0);
  const std::int64_t tiles = (config.out_features + 15) / 16;
  if (products * tiles * iterations * iteration_bytes <= l2_budget_bytes) return static_cast<int>(std::min<std::int64_t>(rounds, 1024));
  const std::int64_t tile_blocks = (tiles + config.tiles_per_block - 1) / config.tiles_per_block;
  // Resident blocks: about 32 warps a multiprocessor at the batches' register counts.
  const std::int64_t resident =
      std::min(tile_blocks * config.k_splits, std::int64_t{multiprocessors} * std::max(1, 32 / config.warps_per_block));
  const std::int64_t round_bytes = stride * config.tiles_per_block * products * iteration_bytes;
  // At most 1024 rounds (GemvKernelConfig::validate): a K of 2^20 has 1536 a warp, and the prefetching twin
  // of such a stage threw where the plain shape lowers.
  return static_cast<int>(
      std::clamp<std::int64_t>(l2_budget_bytes / (resident * round_bytes), 1, std::clamp<std::int64_t>(rounds, 1, 1024)));
}

std::int64_t gemv_minimum_bytes(const GemvKernelConfig& config) {
  const std::int64_t n = config.out_features, k = config.in_features, m = config.rows;
  const int products = config.epilogue.product_count();
  std::int64_t weight_bytes = n * k * config.format.bits / 8;
  if (config.format.is_affine()) weight_bytes += n * (k / config.format.group_size) * 2 * 2;
  std::int64_t bytes = products * weight_bytes + m * k * 2 + m * n * 2;
  for (const GemvEpilogue::TensorInput& tensor : config.epilogue.tensor_inputs()) {
    bytes += (tensor.broadcast_rows ? n : m * n) * 2;
  }
  return bytes;
}

}  // namespace metile
