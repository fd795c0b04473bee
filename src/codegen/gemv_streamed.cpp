// The streamed GEMV mainloop: loads decoupled from the math, a persistent stream-K grid.
//
//   grid   = multiprocessors x blocks_per_multiprocessor blocks of `warps` warps, all resident
//   work   = the positions (K slice s, 16-row tile t, iteration i of the slice), in that order;
//            warp w of W owns positions [w * T / W, (w + 1) * T / W): equal shares for any N
//   stages : lane 0 of each warp streams its next `stages` stages (stage_iterations iterations of
//            one tile, both matrices of a gate/up pair) into a private shared-memory ring with
//            cp.async.bulk (L2 evict-first), each completing on its own mbarrier; the warp waits
//            on a stage, computes it from shared memory and re-issues the buffer at once, so the
//            bytes in flight depend on the ring, not on registers or on how far the math has got
//   x      : each block stages the x columns of the K slices its warps touch (all M rows) in
//            shared memory, with the per-group sums the affine fold needs, once
//   join   : a warp whose share covers a whole tile (one slice) applies the epilogue itself;
//            otherwise each piece of a tile writes fp32 partials to its own slot of the workspace,
//            bumps the tile's counter, and the last piece to arrive adds the slots in a fixed
//            order (slice, then warp) and applies the epilogue: deterministic whatever the timing.
//            It resets the counter, so the next launch finds the workspace ready.
//
// K is split into slices only so far as x must fit shared memory: the split is the smallest
// divisor of the iteration count whose layout fits.
//
// The math is the register mainloop's (gemv_device_helpers.cpp): m16n8k16 with the weight tile as
// A and up to 8 activation rows as B; affine codes by the magic-number conversion, the offset and
// bias folded per group through sum(x), here read from shared memory instead of recomputed.
#include <fmt/core.h>

#include <algorithm>

#include "gemv_internal.h"

namespace metile::gemv_detail {
namespace {

constexpr std::string_view streamed_body = R"CUDA(
constexpr int kSliceIterations = kIterations / kSlices;
constexpr int kSliceColumns = kSliceIterations * kColumnsPerIteration;
constexpr int kSliceGroups = kAffine ? kSliceColumns / kGroup : 1;
constexpr long long kPositions = (long long)kSlices * kTileCount * kSliceIterations;
constexpr long long kTotalWarps = (long long)kBlocks * kWarps;
constexpr int kXRowElements = kXRowStride / 2;
constexpr int kPartialFloats = 16 * kM;  // one product of one piece of a tile

__device__ __forceinline__ void wait_stage(u32 barrier, u32 parity) {
  u32 done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
  } while (!done);
}

__device__ __forceinline__ void bulk_copy(u32 destination, const void* source, u32 bytes, u32 barrier, u64 policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      :: "r"(destination), "l"(source), "r"(bytes), "r"(barrier), "l"(policy) : "memory");
}

// The iterations of the stage starting at `position` (it never crosses a tile piece's end).
__device__ __forceinline__ int stage_count(long long position, long long end) {
  const long long item_end = (position / kSliceIterations + 1) * kSliceIterations;
  return (int)min((long long)kStageIterations, min(end, item_end) - position);
}

// Lane 0 arms the stage's barrier with its byte count; the copies follow (all lanes call this).
__device__ __forceinline__ void issue_stage(long long position, long long end, unsigned char* stage, u32 barrier,
                                            const u32* const (&weights)[kProducts],
                                            const u16* const (&scale_bias)[kProducts], u64 policy, int lane) {
  const long long item = position / kSliceIterations;
  const int tile = (int)(item % kTileCount);
  const int iteration = (int)(item / kTileCount) * kSliceIterations + (int)(position - item * kSliceIterations);
  const int count = stage_count(position, end);
  if constexpr (kAffine) {
    const u32 word_bytes = count * kLoadsPerIteration * 1024, scale_bytes = count * kGroupsPerIteration * 64;
    if (lane == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                   :: "r"(barrier), "r"(kProducts * (word_bytes + scale_bytes)) : "memory");
#pragma unroll
      for (int p = 0; p < kProducts; ++p) {
        bulk_copy(shared_address(stage + p * kStageWordBytes),
                  reinterpret_cast<const unsigned char*>(weights[p]) +
                      ((u64)tile * kLoadBlocks + (u64)iteration * kLoadsPerIteration) * 1024,
                  word_bytes, barrier, policy);
        bulk_copy(shared_address(stage + kProducts * kStageWordBytes + p * kStageScaleBytes),
                  reinterpret_cast<const unsigned char*>(scale_bias[p]) +
                      ((u64)tile * kGroupCount + (u64)iteration * kGroupsPerIteration) * 64,
                  scale_bytes, barrier, policy);
      }
    }
  } else {
    // Dense rows are 16 separate row segments: one copy per (matrix, row), one lane each.
    const int rows = min(16, kN - tile * 16);
    const int row_bytes = (min(kK, (iteration + count) * 32) - iteration * 32) * 2;
    if (lane == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                   :: "r"(barrier), "r"(kProducts * rows * row_bytes) : "memory");
    }
    __syncwarp();
    const int p = lane >> 4, r = lane & 15;
    if (p < kProducts && r < rows) {
      bulk_copy(shared_address(stage + p * kStageWordBytes + r * kDenseRowStride),
                reinterpret_cast<const u16*>(weights[p]) + (u64)(tile * 16 + r) * kK + (u64)iteration * 32, row_bytes,
                barrier, policy);
    }
  }
}

__device__ __forceinline__ uint4 shared_vector(const void* address) { return *reinterpret_cast<const uint4*>(address); }

// The math of one stage: `count` iterations starting at `first` within the slice whose x rows
// start at xs (row stride kXRowElements) and whose group sums start at xsum.
__device__ __forceinline__ void compute_stage(float (&acc)[kProducts][kRowHalves][4], const unsigned char* stage,
                                              const u16* xs, const float* xsum, int first, int count, int iteration,
                                              int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < kStageIterations; ++u) {
    if (u >= count) break;
    const int column = (first + u) * kColumnsPerIteration;
    uint4 xv[kRowHalves][kChunksPerIteration];
    load_x_fragments(
        xv, lane, [](int) { return true; },
        [&](int m, int offset) { return shared_vector(xs + m * kXRowElements + column + offset); });
    if constexpr (kAffine) {
#pragma unroll
      for (int q = 0; q < kGroupsPerIteration; ++q) {
        float xsum_h[kRowHalves][4];
        read_group_sums(xsum_h, xsum + ((first + u) * kGroupsPerIteration + q) * kPaddedM, lane, true);
#pragma unroll
        for (int p = 0; p < kProducts; ++p) {
          const uint2 s = *reinterpret_cast<const uint2*>(stage + kProducts * kStageWordBytes + p * kStageScaleBytes +
                                                          ((u * kGroupsPerIteration + q) * 8 + g) * 8);
          affine_group_product(acc[p], xv, q, s, xsum_h, [&](int chunk, u32(&step0)[4], u32(&step1)[4]) {
            const unsigned char* words =
                stage + p * kStageWordBytes + (u * kLoadsPerIteration + chunk / kChunksPerLoad) * 1024 + lane * 16;
            affine_fragments(shared_vector(words), shared_vector(words + 512), chunk % kChunksPerLoad, step0, step1);
          });
        }
      }
    } else {
      // Columns past K (a partial last iteration) hold stale bytes: zero them (x there is zero,
      // but stale bits could be a NaN).
      const bool live = kK % 32 == 0 || (iteration + u) * 32 + 8 * t < kK;
#pragma unroll
      for (int p = 0; p < kProducts; ++p) {
        const unsigned char* row = stage + p * kStageWordBytes + g * kDenseRowStride + u * 64 + t * 16;
        uint4 low = shared_vector(row), high = shared_vector(row + 8 * kDenseRowStride);
        if (!live) low = high = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int h = 0; h < kRowHalves; ++h) {
          const uint4 b = xv[h][0];
          mma(acc[p][h], low.x, high.x, low.y, high.y, b.x, b.y);
          mma(acc[p][h], low.z, high.z, low.w, high.w, b.z, b.w);
        }
      }
    }
  }
}

)CUDA";

// The stream-K join (gemv_internal.h), shared with the persistent decode MLP (gemv_persistent.cpp).
constexpr std::string_view stream_k_join = R"CUDA(
// The first position of warp w's share; owner(x) is the warp whose share holds position x.
__device__ __forceinline__ long long share_begin(long long warp) { return warp * kPositions / kTotalWarps; }
__device__ __forceinline__ long long owner(long long position) {
  return ((position + 1) * kTotalWarps - 1) / kPositions;
}

// Fragment element e of row half h: tile row g (+8 for e >= 2), activation row 8h + 2t (+1 for odd e).
__device__ __forceinline__ int fragment_row(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int fragment_m(int lane, int h, int e) { return 8 * h + 2 * (lane & 3) + (e & 1); }

__device__ __forceinline__ void store_tile(const float (&v)[kProducts][kRowHalves][4], int tile, const Outputs& outputs,
                                           int lane) {
#pragma unroll
  for (int h = 0; h < kRowHalves; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = tile * 16 + fragment_row(lane, e), m = fragment_m(lane, h, e);
      if (n < kN && m < kM) store_output(outputs, m, n, v[0][h][e], v[kProducts - 1][h][e]);
    }
  }
}

__device__ __forceinline__ long long partial_offset(long long item, long long piece, int product, int lane, int h, int e) {
  return ((item * kMaxPieces + piece) * kProducts + product) * kPartialFloats + fragment_row(lane, e) * kM +
         fragment_m(lane, h, e);
}

// The end of one piece of tile `item`'s work (positions started by warp `warp`).
__device__ __forceinline__ void finish_piece(const float (&acc)[kProducts][kRowHalves][4], long long item,
                                             long long warp, float* partials, u32* counters, const Outputs& outputs,
                                             int lane) {
  const int tile = (int)(item % kTileCount);
  const long long first_owner = owner(item * kSliceIterations);
  if (kSlices == 1 && first_owner == owner((item + 1) * kSliceIterations - 1)) {
    store_tile(acc, tile, outputs, lane);
    return;
  }
#pragma unroll
  for (int p = 0; p < kProducts; ++p)
#pragma unroll
    for (int h = 0; h < kRowHalves; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (fragment_m(lane, h, e) < kM) store_partial(partials + partial_offset(item, warp - first_owner, p, lane, h, e), acc[p][h][e]);
  __threadfence();
  __syncwarp();
  // Pieces of this tile: the warps whose non-empty shares meet one of its slices' positions.
  int pieces = 0;
  for (int s = 0; s < kSlices; ++s) {
    const long long other = (long long)s * kTileCount + tile;
    const long long last = owner((other + 1) * kSliceIterations - 1);
    for (long long w = owner(other * kSliceIterations); w <= last; ++w) pieces += share_begin(w) < share_begin(w + 1);
  }
  u32 arrived = 0;
  if (lane == 0) arrived = atomicAdd(counters + tile, 1u);
  arrived = __shfl_sync(0xFFFFFFFFu, arrived, 0);
  if ((int)arrived != pieces - 1) return;
  // The last piece: add every slot in (slice, warp) order, whoever wrote it when.
  __threadfence();
  float sum[kProducts][kRowHalves][4];
#pragma unroll
  for (int p = 0; p < kProducts; ++p)
#pragma unroll
    for (int h = 0; h < kRowHalves; ++h) sum[p][h][0] = sum[p][h][1] = sum[p][h][2] = sum[p][h][3] = 0.0f;
  for (int s = 0; s < kSlices; ++s) {
    const long long other = (long long)s * kTileCount + tile;
    const long long first = owner(other * kSliceIterations), last = owner((other + 1) * kSliceIterations - 1);
    for (long long piece = 0; piece <= last - first; ++piece) {
      if (share_begin(first + piece) == share_begin(first + piece + 1)) continue;  // an empty share wrote nothing
#pragma unroll
      for (int p = 0; p < kProducts; ++p)
#pragma unroll
        for (int h = 0; h < kRowHalves; ++h)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (fragment_m(lane, h, e) < kM) sum[p][h][e] += load_partial(partials + partial_offset(other, piece, p, lane, h, e));
    }
  }
  store_tile(sum, tile, outputs, lane);
  if (lane == 0) atomicExch(counters + tile, 0u);
}

)CUDA";

constexpr std::string_view streamed_tail = R"CUDA(
__device__ __forceinline__ void streamed_gemv(const u32* const (&weights)[kProducts],
                                              const u16* const (&scale_bias)[kProducts], const u16* __restrict__ x,
                                              const u16* __restrict__ norm_weight, const Outputs& outputs, float* partials, u32* counters) {
  extern __shared__ __align__(128) unsigned char shared[];
  allow_dependent_launch();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u64* barriers = reinterpret_cast<u64*>(shared);
  unsigned char* ring = shared + kRingOffset + warp * kStages * kStageBytes;
  u16* xs = reinterpret_cast<u16*>(shared + kXOffset);
  float* xsum = reinterpret_cast<float*>(shared + kXSumOffset);
  const u32 my_barriers = shared_address(barriers + warp * kStages);

  const long long global_warp = (long long)blockIdx.x * kWarps + warp;
  const long long begin = share_begin(global_warp), end = share_begin(global_warp + 1);
  u64 policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(my_barriers + 8 * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncwarp();

  // The weights need nothing from an earlier kernel: their first stages fly before x is read.
  long long issue = begin;
  for (int s = 0; s < kStages && issue < end; ++s) {
    issue_stage(issue, end, ring + s * kStageBytes, my_barriers + 8 * s, weights, scale_bias, policy, lane);
    issue += stage_count(issue, end);
  }

  // x of the slices this block's warps touch, all M rows (normalized when kNormedX: the row scales
  // come from the whole of K first), and the per-group sums of each row; x may be the previous
  // kernel's output.
  x = after_previous_kernel(x);
  compute_x_row_scales(x, norm_weight);
  constexpr long long kSlicePositions = (long long)kTileCount * kSliceIterations;
  const long long block_begin = share_begin((long long)blockIdx.x * kWarps);
  const long long block_end = share_begin((long long)(blockIdx.x + 1) * kWarps);
  const int first_slice = block_begin < block_end ? (int)(block_begin / kSlicePositions) : 0;
  const int slices = block_begin < block_end ? (int)((block_end - 1) / kSlicePositions) - first_slice + 1 : 0;
  constexpr int kVectorsPerUnit = kAffine ? kGroup / 8 : 1;
  constexpr int kUnitsPerRow = kSliceColumns / (8 * kVectorsPerUnit);
  for (int unit = threadIdx.x; unit < slices * kM * kUnitsPerRow; unit += kThreads) {
    const int slice = unit / (kM * kUnitsPerRow), rest = unit - slice * (kM * kUnitsPerRow);
    const int m = rest / kUnitsPerRow, c = rest - m * kUnitsPerRow;
    const int first_column = c * 8 * kVectorsPerUnit;
    float total = 0.0f;
#pragma unroll
    for (int v = 0; v < kVectorsPerUnit; ++v) {
      const int column = (first_slice + slice) * kSliceColumns + first_column + 8 * v;
      uint4 value = make_uint4(0u, 0u, 0u, 0u);
      if (column < kK) value = load_x(x, norm_weight, m, column);
      *reinterpret_cast<uint4*>(xs + (slice * kM + m) * kXRowElements + first_column + 8 * v) = value;
      if constexpr (kAffine) total += sum_of_eight(value);
    }
    if constexpr (kAffine) xsum[(slice * kSliceGroups + c) * kPaddedM + m] = total;
  }
  constexpr int kPadRows = kPaddedM > kM ? kPaddedM - kM : 1;
  if constexpr (kAffine && kPaddedM > kM) {
    for (int i = threadIdx.x; i < slices * kSliceGroups * kPadRows; i += kThreads) {
      const int group = i / kPadRows, m = kM + i % kPadRows;
      xsum[group * kPaddedM + m] = 0.0f;
    }
  }
  __syncthreads();

  float acc[kProducts][kRowHalves][4];
#pragma unroll
  for (int p = 0; p < kProducts; ++p)
#pragma unroll
    for (int h = 0; h < kRowHalves; ++h) acc[p][h][0] = acc[p][h][1] = acc[p][h][2] = acc[p][h][3] = 0.0f;
  int stage = 0;
  for (long long position = begin; position < end; ++stage) {
    const int buffer = stage % kStages;
    wait_stage(my_barriers + 8 * buffer, (stage / kStages) & 1);
    const long long item = position / kSliceIterations;
    const int slice = (int)(item / kTileCount);
    const int first = (int)(position - item * kSliceIterations);
    const int count = stage_count(position, end);
    const int local_slice = slice - first_slice;
    compute_stage(acc, ring + buffer * kStageBytes, xs + local_slice * kM * kXRowElements,
                  xsum + local_slice * kSliceGroups * kPaddedM, first, count, slice * kSliceIterations + first, lane);
    __syncwarp();
    if (issue < end) {
      issue_stage(issue, end, ring + buffer * kStageBytes, my_barriers + 8 * buffer, weights, scale_bias, policy, lane);
      issue += stage_count(issue, end);
    }
    position += count;
    if (position == end || position == (item + 1) * kSliceIterations) {
      finish_piece(acc, item, global_warp, partials, counters, outputs, lane);
#pragma unroll
      for (int p = 0; p < kProducts; ++p)
#pragma unroll
        for (int h = 0; h < kRowHalves; ++h) acc[p][h][0] = acc[p][h][1] = acc[p][h][2] = acc[p][h][3] = 0.0f;
    }
  }
}
)CUDA";


// Where everything sits in the block's dynamic shared memory, and how the work is split. Both the
// host (launch size, workspace) and the kernel (emitted constants) take it from here.
struct StreamedPlan {
  int slices = 1, x_slices = 1, max_pieces = 1;
  std::int64_t blocks = 0, items = 0, tiles = 0;
  std::int64_t stage_word_bytes = 0, stage_scale_bytes = 0, stage_bytes = 0, dense_row_stride = 0;
  std::int64_t x_row_stride = 0, ring_offset = 0, x_offset = 0, x_sum_offset = 0, shared_bytes = 0;
  std::int64_t workspace_bytes = 0;
};

constexpr std::int64_t shared_per_block_limit = 232448;        // sm_90: 227 KiB per block after opting in
constexpr std::int64_t shared_per_multiprocessor = 233472;     // 228 KiB, 1 KiB of it reserved per block

std::int64_t shared_limit(int blocks_per_multiprocessor) {
  return std::min(shared_per_block_limit, shared_per_multiprocessor / blocks_per_multiprocessor - 1024);
}

// The plan for `slices` K splits; shared_bytes over the limit when x does not fit.
StreamedPlan plan_with_slices(const GemvKernelConfig& config, int slices) {
  const GemvWeightFormat& format = config.format;
  const int products = config.epilogue.product_count();
  const int columns_per_iteration = format.columns_per_iteration();
  const std::int64_t iterations = (config.in_features + columns_per_iteration - 1) / columns_per_iteration;
  const std::int64_t slice_iterations = iterations / slices;
  const std::int64_t padded_m = (config.rows + 7) / 8 * 8;
  StreamedPlan plan;
  plan.slices = slices;
  plan.tiles = (config.out_features + 15) / 16;
  plan.items = slices * plan.tiles;
  const std::int64_t positions = plan.items * slice_iterations;
  // Persistent: one wave of resident blocks, fewer when there are fewer positions than warps.
  plan.blocks = std::min<std::int64_t>(std::int64_t{config.multiprocessors} * config.blocks_per_multiprocessor,
                                       (positions + config.warps_per_block - 1) / config.warps_per_block);
  const std::int64_t warps = plan.blocks * config.warps_per_block;
  auto share_begin = [&](std::int64_t warp) { return warp * positions / warps; };
  auto owner = [&](std::int64_t position) { return ((position + 1) * warps - 1) / positions; };

  plan.x_slices = 0;
  for (std::int64_t block = 0; block < plan.blocks; ++block) {
    const std::int64_t begin = share_begin(block * config.warps_per_block);
    const std::int64_t end = share_begin((block + 1) * config.warps_per_block);
    if (begin >= end) continue;
    const std::int64_t slice_positions = plan.tiles * slice_iterations;
    plan.x_slices = std::max<int>(plan.x_slices, static_cast<int>((end - 1) / slice_positions - begin / slice_positions + 1));
  }
  plan.x_slices = std::max(plan.x_slices, 1);
  plan.max_pieces = 1;
  for (std::int64_t item = 0; item < plan.items; ++item) {
    const std::int64_t pieces = owner((item + 1) * slice_iterations - 1) - owner(item * slice_iterations) + 1;
    plan.max_pieces = std::max<int>(plan.max_pieces, static_cast<int>(pieces));
  }

  if (format.is_affine()) {
    const int loads_per_iteration = columns_per_iteration / (32 * (format.bits == 8 ? 2 : 4));
    plan.stage_word_bytes = std::int64_t{config.stage_iterations} * loads_per_iteration * 1024;
    plan.stage_scale_bytes = std::int64_t{config.stage_iterations} * (columns_per_iteration / format.group_size) * 64;
  } else {
    // Row stride = 64 (mod 128) bytes: the 8 lanes of one shared-memory phase read rows g and
    // g + 1 at the same column and then land in disjoint banks.
    const std::int64_t row_bytes = std::int64_t{config.stage_iterations} * 64;
    plan.dense_row_stride = row_bytes % 128 == 0 ? row_bytes + 64 : row_bytes;
    plan.stage_word_bytes = 16 * plan.dense_row_stride;
  }
  plan.stage_bytes = round_up(products * (plan.stage_word_bytes + plan.stage_scale_bytes), 128);
  const std::int64_t x_row_bytes = slice_iterations * columns_per_iteration * 2;
  plan.x_row_stride = x_row_bytes % 128 == 64 ? x_row_bytes : round_up(x_row_bytes, 128) + 64;
  plan.ring_offset = round_up(std::int64_t{config.warps_per_block} * config.stages * 8, 128);
  plan.x_offset = plan.ring_offset + std::int64_t{config.warps_per_block} * config.stages * plan.stage_bytes;
  plan.x_sum_offset = round_up(plan.x_offset + plan.x_slices * config.rows * plan.x_row_stride, 16);
  const std::int64_t slice_groups = format.is_affine() ? slice_iterations * columns_per_iteration / format.group_size : 0;
  plan.shared_bytes = plan.x_sum_offset + plan.x_slices * slice_groups * padded_m * 4;
  plan.workspace_bytes = plan.items * plan.max_pieces * products * 16 * config.rows * 4 + plan.tiles * 4;
  return plan;
}

// The smallest K split whose layout fits shared memory (every split divides the iterations evenly).
StreamedPlan plan_streamed(const GemvKernelConfig& config) {
  const int columns_per_iteration = config.format.columns_per_iteration();
  const std::int64_t iterations = (config.in_features + columns_per_iteration - 1) / columns_per_iteration;
  // The x normalization's few static bytes share the block's limit with the dynamic layout.
  const std::int64_t limit = shared_limit(config.blocks_per_multiprocessor) - x_norm_shared_bytes(config);
  StreamedPlan smallest;
  for (std::int64_t slices = 1; slices <= iterations; ++slices) {
    if (iterations % slices != 0) continue;
    const StreamedPlan plan = plan_with_slices(config, static_cast<int>(slices));
    if (plan.shared_bytes <= limit) return plan;
    if (smallest.blocks == 0 || plan.shared_bytes < smallest.shared_bytes) smallest = plan;
  }
  throw InputError(fmt::format("GEMV {}: the streamed layout needs {} bytes of shared memory per block (at most {})",
                               config.to_string(), smallest.shared_bytes, limit));
}

}  // namespace

std::string_view gemv_stream_k_join() { return stream_k_join; }

void validate_streamed(const GemvKernelConfig& config) {
  if (config.stage_iterations < 1 || config.stage_iterations > 8) {
    throw InputError(fmt::format("GEMV: stage_iterations must be 1..8, not {}", config.stage_iterations));
  }
  if (config.stages < 2 || config.stages > 16) throw InputError(fmt::format("GEMV: stages must be 2..16, not {}", config.stages));
  if (config.multiprocessors < 1 || config.multiprocessors > 1024) {
    throw InputError(fmt::format("GEMV: multiprocessors must be 1..1024, not {}", config.multiprocessors));
  }
  if (config.blocks_per_multiprocessor < 1 || config.blocks_per_multiprocessor > 4) {
    throw InputError(fmt::format("GEMV: blocks_per_multiprocessor must be 1..4, not {}", config.blocks_per_multiprocessor));
  }
  if (config.warps_per_block < 2) throw InputError("GEMV: the streamed mainloop needs at least 2 warps per block");
  plan_streamed(config);
}

GemvKernelSource generate_streamed_gemv_kernel(const GemvKernelConfig& config) {
  const StreamedPlan plan = plan_streamed(config);
  const int products = config.epilogue.product_count();
  GemvKernelSource result;
  const std::uint64_t epilogue_hash = gemv_epilogue_hash(config);
  result.kernel_name = fmt::format("metile_gemv_{}_m{}_n{}_k{}_p{}_streamed_w{}u{}s{}g{}x{}_e{:08x}",
                                   gemv_format_tag(config.format), config.rows, config.out_features, config.in_features,
                                   products, config.warps_per_block, config.stage_iterations, config.stages, plan.blocks,
                                   config.blocks_per_multiprocessor, epilogue_hash & 0xFFFFFFFFu);
  std::string source = fmt::format("// Generated by metile (src/codegen/gemv_streamed.cpp): {}\n", config.to_string());
  source += gemv_problem_constants(config);
  source += fmt::format(
      "constexpr int kStageIterations = {};\nconstexpr int kStages = {};\nconstexpr int kBlocks = {};\n"
      "constexpr int kSlices = {};\nconstexpr int kMaxPieces = {};\nconstexpr int kStageWordBytes = {};\n"
      "constexpr int kStageScaleBytes = {};\nconstexpr int kStageBytes = {};\nconstexpr int kDenseRowStride = {};\n"
      "constexpr int kXRowStride = {};\nconstexpr int kRingOffset = {};\nconstexpr int kXOffset = {};\n"
      "constexpr int kXSumOffset = {};\n",
      config.stage_iterations, config.stages, plan.blocks, plan.slices, plan.max_pieces, plan.stage_word_bytes,
      plan.stage_scale_bytes, plan.stage_bytes, plan.dense_row_stride, plan.x_row_stride, plan.ring_offset,
      plan.x_offset, plan.x_sum_offset);
  source += gemv_device_helpers();
  source += "\n// The op table's device functions (src/graph/op_registry.cpp), which epilogue expressions call.\n";
  source += cuda_elementwise_helpers();
  source += gemv_output_functions(config);
  source += streamed_body;
  source += stream_k_join;
  source += streamed_tail;

  source += gemv_kernel_entry(config, result.kernel_name, ", float* __restrict__ workspace");
  source += gemv_outputs_binding(config);
  source += fmt::format(
      "  streamed_gemv(weights, scale_bias, x, x_norm_weight, outputs, workspace, reinterpret_cast<u32*>(workspace + {}));\n}}\n",
      plan.items * plan.max_pieces * products * 16 * config.rows);

  result.source = std::move(source);
  result.grid_blocks = static_cast<unsigned>(plan.blocks);
  result.block_threads = static_cast<unsigned>(config.warps_per_block * 32);
  result.static_shared_bytes = static_cast<unsigned>(x_norm_shared_bytes(config));
  result.dynamic_shared_bytes = static_cast<unsigned>(plan.shared_bytes);
  result.workspace_bytes = static_cast<std::uint64_t>(plan.workspace_bytes);
  result.k_slices = plan.slices;
  return result;
}

std::vector<GemvKernelConfig> streamed_tuning_candidates(const GemvKernelConfig& base) {
  // A stage of about 2 KiB (both matrices of a gate/up pair in one stage); 8 warps x 4 stages keep
  // up to 64 KiB per SM in flight, which ~4 TB/s at ~1-2 us of loaded latency asks for
  // (notes/mlp_decode.md). The others vary the depth, the stage size and the warps.
  const int products = base.epilogue.product_count();
  const int loads_per_iteration = base.format.is_affine() ? base.format.columns_per_iteration() /
                                                                (32 * (base.format.bits == 8 ? 2 : 4))
                                                          : 1;
  const int unit = std::max(1, 2 / (products * loads_per_iteration));
  struct Shape {
    int warps, stage_iterations, stages, blocks_per_multiprocessor;
  };
  const Shape shapes[] = {{8, unit, 4, 1}, {8, unit, 6, 1}, {16, unit, 3, 1}, {8, 2 * unit, 3, 1}, {4, unit, 6, 2}};
  // Only when none of those fits shared memory (large stages: 8-bit g128 gate/up is 4 KiB per
  // iteration), the smallest rings, first fit: the list is never empty.
  const Shape fallbacks[] = {{8, 1, 2, 1}, {4, 1, 2, 1}, {2, 1, 2, 1}};
  std::vector<GemvKernelConfig> candidates;
  auto add = [&](const Shape& shape) {
    GemvKernelConfig config = base;
    config.mainloop = GemvMainloop::streamed;
    config.warps_per_block = shape.warps;
    config.stage_iterations = shape.stage_iterations;
    config.stages = shape.stages;
    config.blocks_per_multiprocessor = shape.blocks_per_multiprocessor;
    try {
      config.validate();
    } catch (const InputError&) {
      return false;
    }
    candidates.push_back(config);
    return true;
  };
  for (const Shape& shape : shapes) add(shape);
  for (const Shape& shape : fallbacks) {
    if (!candidates.empty() || add(shape)) break;
  }
  if (candidates.empty()) {
    throw InputError(fmt::format("GEMV {}: no streamed shape fits shared memory", base.to_string()));
  }
  return candidates;
}

}  // namespace metile::gemv_detail
