// The device helpers both GEMV mainloops start from (gemv_internal.h): the layout's derived
// constants, conversions, activations, and the affine code unpacking (after the tensor-core helpers of tensor_core_helpers.cpp).
// Kept apart from either generator so that the register-batch and the streamed mainloop share
// one definition of how a repacked word becomes an m16n8k16 A fragment.
#include <fmt/core.h>

#include <algorithm>

#include "codegen_internal.h"
#include "gemv_internal.h"

namespace metile::gemv_detail {
namespace {

constexpr std::string_view device_helpers = R"CUDA(

constexpr bool kAffine = kBits != 16;
constexpr int kChunksPerLoad = kBits == 16 ? 1 : (kBits == 8 ? 2 : 4);  // 32-column chunks per 16-byte vector
constexpr int kColumnsPerLoad = 32 * kChunksPerLoad;
constexpr int kLoadsPerIteration = kColumnsPerIteration / kColumnsPerLoad;
constexpr int kChunksPerIteration = kColumnsPerIteration / 32;
constexpr int kIterations = (kK + kColumnsPerIteration - 1) / kColumnsPerIteration;
constexpr int kLoadBlocks = kIterations * kLoadsPerIteration;           // per tile, repacked layout
constexpr int kGroupsPerIteration = kAffine ? kColumnsPerIteration / kGroup : 1;
[[maybe_unused]] constexpr int kChunksPerGroup = kChunksPerIteration / kGroupsPerIteration;
constexpr int kGroupCount = kIterations * kGroupsPerIteration;          // per tile, padded
constexpr int kRowHalves = (kM + 7) / 8;                                // mma B halves
constexpr int kPaddedM = 8 * kRowHalves;
constexpr int kTileCount = (kN + 15) / 16;
constexpr int kThreads = kWarps * 32;
[[maybe_unused]] constexpr u32 kOnes = kHalf ? 0x3C003C00u : 0x3F803F80u;  // (1, 1) in the activation dtype
// The dtype the weights meet x in: f16 with half products (GemvKernelConfig::half_products), else the
// activation dtype.
[[maybe_unused]] constexpr bool kProductsHalf = kHalf || kHalfProducts;
// half_products' sum(x) mma: A's rows 0..7 all ones give sum(x') of the staged x (the offset's term),
// rows 8..15 ones at the even pairs' columns and the odd pairs' code scale at theirs give sum(x) times
// the row's power of two (the bias's term). f16 (1, 1) and (16, 16).
[[maybe_unused]] constexpr u32 kHalfOnes = 0x3C003C00u;
[[maybe_unused]] constexpr u32 kHalfOddScales = kOddCodeScale == 16.0f ? 0x4C004C00u : 0x3C003C00u;

// Every global load below is `asm volatile`: a load guarded by a bound (`if (live) v = load(...)`, the
// last partial iteration, a tile's rows past N, x's vectors past K) must stay under its guard. Plain
// `asm` is a pure function to the compiler, which hoisted such loads out of their guards and read past
// the buffers: compute-sanitizer's memcheck found the normalized LM head (K = 200, a 4-warp block)
// reading 48 bytes past x and past the norm's weight (session 45, notes/gpu_check.md). Where the loads
// run relative to the math is the source's order (the batches, the double buffer), as it was.
// Weights are read once: keep them out of L1, where x lives. Dense weights stay in the graph's row-major
// layout, so one warp-wide load touches 64 bytes of each of 8 rows: the L2::256B hint has L2 fetch 256
// bytes of each row from DRAM, which the next iterations' loads then find in L2 (Llama-3-8B bf16 gate/up
// 61.4 -> 58.8 us, notes/mlp_decode.md, session 15). The affine layouts are repacked so that a warp's load
// is 512 contiguous bytes already; there the hint measured no gain.
__device__ __forceinline__ uint4 load_weights(const void* address) {
  uint4 v;
  if constexpr (kBits == 16) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(address));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(address));
  }
  return v;
}
// x is read by every warp of every block: let L1 and L2 serve the repeats. x written by this same
// kernel (kXWrittenInKernel, gemv_internal.h) is not read-only for the kernel's lifetime, so not
// through the .nc path: a plain (weak, L1-cached) load, which the memory model orders after the
// reading thread's ld.acquire of the release it waited for (or a barrier after it), so it sees the
// writers' data; the acquire leaves no stale line in this SM's L1 (an L2 round trip per x load,
// ld.global.cg, cost the persistent MLP's down phase one per batch: notes/mlp_decode.md, session 31).
__device__ __forceinline__ uint4 load_activations(const void* address) {
  uint4 v;
  if constexpr (kXWrittenInKernel) {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(address));
  } else {
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(address));
  }
  return v;
}
__device__ __forceinline__ uint2 load_scale_bias(const void* address) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(address));
  return v;
}

__device__ __forceinline__ u32 shared_address(const void* pointer) {
  u32 address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
  return address;
}

// fp32 partial sums another block (on another SM) adds: st/ld .cg bypass L1 and meet in L2.
__device__ __forceinline__ void store_partial(float* address, float value) {
  asm volatile("st.global.cg.f32 [%0], %1;" :: "l"(address), "f"(value) : "memory");
}
__device__ __forceinline__ float load_partial(const float* address) {
  float value;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(value) : "l"(address) : "memory");
  return value;
}

// Asynchronous copies into shared memory (cp.async): `live` false copies nothing and fills zeros
// (the source must still be a valid address).
__device__ __forceinline__ void copy_async_16(void* destination, const void* source, bool live) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(shared_address(destination)), "l"(source), "r"(live ? 16 : 0) : "memory");
}
__device__ __forceinline__ void copy_async_8(void* destination, const void* source, bool live) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;"
               :: "r"(shared_address(destination)), "l"(source), "r"(live ? 8 : 0) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(Pending) : "memory"); }

// The sum of the eight activation values of one 16-byte vector (the affine fold's sum(x) per group).
__device__ __forceinline__ float sum_of_eight(const uint4& value) {
  return to_f32(value.x & 0xFFFFu) + to_f32(value.x >> 16) + to_f32(value.y & 0xFFFFu) + to_f32(value.y >> 16) +
         to_f32(value.z & 0xFFFFu) + to_f32(value.z >> 16) + to_f32(value.w & 0xFFFFu) + to_f32(value.w >> 16);
}

// x normalized as it is loaded (GemvKernelConfig::x_rms_norm_eps: the RMSNorm before the GEMV).
// Each block reduces every activation row over the whole of K for the norm's scale, then every load
// of x multiplies by the row's scale and the norm's weight as rms_norm's CPU reference does
// (rms_norm_math, src/graph/op_registry.cpp): (x * scale) * weight, each product rounded in f32, the
// result rounded to the activation dtype (the normalized value a native rms_norm would have written).
// x_norm_scratch: per warp and row a partial sum of squares, then per row the scale.
__shared__ float x_norm_scratch[kNormedX ? (kWarps + 1) * kPaddedM : 1];
// kXStaged (x_staged_in_shared_memory): the block normalizes all M rows once, into shared memory,
// and every later load of x reads them there. Without it each x fragment of every iteration and
// warp is re-read from L2 with its norm weights and normalized again (Llama-3.2-1B's gate/up with
// its norm took 15.7 us under ncu, the MLP benchmark's plain gate/up about 9).
__shared__ __align__(16) u16 x_staged[kXStaged ? kM * kK : 8];

__device__ __forceinline__ float sum_of_eight_squares(const uint4& value) {
  const u32 words[4] = {value.x, value.y, value.z, value.w};
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float low = to_f32(words[i] & 0xFFFFu), high = to_f32(words[i] >> 16);
    total = fmaf(low, low, total);
    total = fmaf(high, high, total);
  }
  return total;
}

__device__ __forceinline__ u32 normalized_pair(u32 pair, u32 weight_pair, float scale) {
  const float low = __fmul_rn(__fmul_rn(to_f32(pair & 0xFFFFu), scale), to_f32(weight_pair & 0xFFFFu));
  const float high = __fmul_rn(__fmul_rn(to_f32(pair >> 16), scale), to_f32(weight_pair >> 16));
  return (u32)from_f32(low) | ((u32)from_f32(high) << 16);
}

__device__ __forceinline__ uint4 normalized_vector(const uint4& value, const uint4& weight, float scale) {
  return make_uint4(normalized_pair(value.x, weight.x, scale), normalized_pair(value.y, weight.y, scale),
                    normalized_pair(value.z, weight.z, scale), normalized_pair(value.w, weight.w, scale));
}

// Row m's eight normalized values at columns k .. k + 7 (the row scales computed already).
__device__ __forceinline__ uint4 normalized_x(const u16* __restrict__ x, const u16* __restrict__ norm_weight, int m, int k) {
  const uint4 value = load_activations(x + (m * kK + k));
  const uint4 weight = load_activations(norm_weight + k);
  return normalized_vector(value, weight, x_norm_scratch[kWarps * kPaddedM + m]);
}

// The norm's weight, which no kernel writes, loaded before the wait for the previous kernel
// (kNormPreloaded: x staged, at most four 8-value vectors a thread): thread t's vectors are
// t, t + kThreads, ..., the ones its staging pass below normalizes, so after the wait the staging
// waits on x alone (in L1 from the sum of squares) instead of one more round trip to L2 for these.
constexpr int kNormVectors = (kK / 8 + kThreads - 1) / kThreads;
// Only where x is normalized: half_products stages x without a norm, and its norm_weight is null.
constexpr bool kNormPreloaded = kNormedX && kXStaged && kK % 8 == 0 && kNormVectors <= 4;
struct NormWeights {
  uint4 vectors[kNormPreloaded ? kNormVectors : 1];
};
__device__ __forceinline__ NormWeights preload_norm_weights(const u16* __restrict__ norm_weight, bool load) {
  NormWeights preloaded;
  if constexpr (kNormPreloaded) {
#pragma unroll
    for (int j = 0; j < kNormVectors; ++j) {
      const int vector = threadIdx.x + j * kThreads;
      preloaded.vectors[j] = make_uint4(0u, 0u, 0u, 0u);
      if (load && vector < kK / 8) preloaded.vectors[j] = load_activations(norm_weight + 8 * vector);
    }
  } else {
    (void)norm_weight, (void)load;
  }
  return preloaded;
}

// Calls use(v, value) for row vectors v = threadIdx.x, threadIdx.x + kThreads, ... below kCount, in that
// order, with the loads of up to kInFlight of them issued before the first use: a plain loop would wait
// for each load before issuing the next, one round trip to L2 per vector (eight for a two-warp block at
// K = 4096, most of a small GEMV's time: the q/k/v GEMV of Llama-3-8B bf16 took 19.7 us for 12 us of
// weights). `load(v)` returns the vector. The counts are compile-time, so that a whole trip (every
// thread's vector below kCount) carries no predicate; and few in flight: the loads' registers add to
// the kernel's peak (eight 16-byte vectors took the gate/up kernels with the norm from 46 to 94
// registers, bf16 w4 f2, and halved their occupancy: the Llama-3-8B bf16 MLP went from 91 to 101 us).
// Two in flight: across the normalized candidates of seven model shapes (135 kernels) the registers
// average what they were with one load at a time (85.7 against 85.4; eight in flight: 103).
constexpr int kNormLoadsInFlight = 2;
template <int kCount, int kInFlight, class Load, class Use>
__device__ __forceinline__ void for_each_thread_vector(Load&& load, Use&& use) {
  constexpr int kPerThread = (kCount + kThreads - 1) / kThreads;
  constexpr int kBatch = kPerThread < kInFlight ? kPerThread : kInFlight;
#pragma unroll 1
  for (int first = 0; first < kPerThread; first += kBatch) {
    uint4 values[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int v = threadIdx.x + (first + j) * kThreads;
      if (kCount % kThreads == 0 && kPerThread % kBatch == 0) {
        values[j] = load(v);
      } else {
        values[j] = make_uint4(0u, 0u, 0u, 0u);
        if (v < kCount && first + j < kPerThread) values[j] = load(v);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int v = threadIdx.x + (first + j) * kThreads;
      if ((kCount % kThreads == 0 && kPerThread % kBatch == 0) || (v < kCount && first + j < kPerThread)) use(v, values[j]);
    }
  }
}

// The rows' scales 1 / sqrt(mean(x^2) + eps) into x_norm_scratch, then (kXStaged) the normalized rows
// into x_staged; every thread of the block calls it once, after the wait for the previous kernel (x
// may be its output). kXStagedByCopy (GemvKernelConfig::x_staged_by_async_copy): x is first copied
// into x_staged by cp.async, all of it at once, and both passes read it there (the staging pass
// normalizes in place: each thread rewrites the vectors it reads). The sums keep their order, so
// the bits are those of the register prologue.
__device__ __forceinline__ void compute_x_row_scales(const u16* __restrict__ x, const u16* __restrict__ norm_weight,
                                                     const NormWeights& preloaded = NormWeights{}) {
  if constexpr (kNormedX) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Row m's raw vector v (8 values at column 8v).
    auto raw_x = [&](int m, int v) {
      if constexpr (kXStagedByCopy) {
        return *reinterpret_cast<const uint4*>(x_staged + (m * kK + 8 * v));
      } else {
        return load_activations(x + (m * kK + 8 * v));
      }
    };
    if constexpr (kXStagedByCopy) {
      for (int v = threadIdx.x; v < kM * (kK / 8); v += kThreads) copy_async_16(x_staged + 8 * v, x + 8 * v, true);
      copy_async_commit();
      copy_async_wait<0>();
      __syncthreads();
    }
    for (int m = 0; m < kM; ++m) {
      float total = 0.0f;
      for_each_thread_vector<kK / 8, kNormLoadsInFlight>(
          [&](int v) { return raw_x(m, v); },
          [&](int, const uint4& value) { total += sum_of_eight_squares(value); });
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) total += __shfl_xor_sync(0xFFFFFFFFu, total, offset);
      if (lane == 0) x_norm_scratch[warp * kPaddedM + m] = total;
    }
    __syncthreads();
    if (threadIdx.x < kM) {
      float total = 0.0f;
      for (int w = 0; w < kWarps; ++w) total += x_norm_scratch[w * kPaddedM + threadIdx.x];
      // The reference's 1 / sqrt in double, rounded once to f32.
      x_norm_scratch[kWarps * kPaddedM + threadIdx.x] = (float)(1.0 / sqrt((double)total / kK + kNormEps));
    }
    __syncthreads();
    if constexpr (kNormPreloaded) {
#pragma unroll
      for (int j = 0; j < kNormVectors; ++j) {
        const int vector = threadIdx.x + j * kThreads;
        if (vector >= kK / 8) break;
        for (int m = 0; m < kM; ++m) {
          *reinterpret_cast<uint4*>(x_staged + (m * kK + 8 * vector)) =
              normalized_vector(raw_x(m, vector), preloaded.vectors[j], x_norm_scratch[kWarps * kPaddedM + m]);
        }
      }
      __syncthreads();
    } else if constexpr (kXStaged) {
      (void)preloaded;
      // The norm's weight from L2 (x is in L1 from the sum of squares, or staged), two vectors in flight.
      for_each_thread_vector<kK / 8, kNormLoadsInFlight>(
          [&](int v) { return load_activations(norm_weight + 8 * v); },
          [&](int v, const uint4& weight) {
            for (int m = 0; m < kM; ++m) {
              *reinterpret_cast<uint4*>(x_staged + (m * kK + 8 * v)) =
                  normalized_vector(raw_x(m, v), weight, x_norm_scratch[kWarps * kPaddedM + m]);
            }
          });
      __syncthreads();
    } else {
      (void)preloaded;
    }
  }
}

// half_products: after compute_x_row_scales, x_staged holds each row m as f16 x' = v 2^e_m / c,
// v the value as the GEMV reads it (normalized where kNormedX, else as stored: copied in here), e_m
// the power of two that puts the row's largest magnitude in [2^14, 2^15) (f16's largest finite value
// is 65504) and c the code scale of the column's pair (kOddCodeScale at the odd pairs' columns: k & 2,
// uint4 components y and w). v holds 8 significant bits (bf16) or 11 (f16), so x' is exact down to
// f16's subnormals, 2^-29 of the row's largest magnitude and below. x_row_unscale[m] = 2^-e_m undoes
// the scale on the warps' sums (spill). A row whose largest magnitude is 0 (or NaN) keeps e_m = 0.
static_assert(!kHalfProducts || (kXStaged && kK % 8 == 0), "half products read x staged in shared memory");
__shared__ float x_row_largest[kHalfProducts ? kWarps * kPaddedM : 1];
__shared__ float x_row_unscale[kHalfProducts ? kPaddedM : 1];

__device__ __forceinline__ float largest_magnitude(const uint4& value) {
  const u32 words[4] = {value.x, value.y, value.z, value.w};
  float largest = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) largest = fmaxf(largest, fmaxf(fabsf(to_f32(words[i] & 0xFFFFu)), fabsf(to_f32(words[i] >> 16))));
  return largest;
}

// e = 14 - floor(log2(largest)), held to f32's normal powers (an infinity's exponent field gives
// -114: the row's sums are infinite or NaN whatever the others become).
__device__ __forceinline__ int row_exponent(float largest) {
  if (!(largest > 0.0f)) return 0;
  const int exponent = (int)((__float_as_uint(largest) >> 23) & 0xFFu) - 127;
  return max(-126, min(126, 14 - exponent));
}

__device__ __forceinline__ u32 half_pair(u32 pair, float up) {
  const float low = to_f32(pair & 0xFFFFu) * up, high = to_f32(pair >> 16) * up;
  u32 bits;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(high), "f"(low));
  return bits;
}

__device__ __forceinline__ void stage_half_x(const u16* __restrict__ x) {
  if constexpr (kHalfProducts) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int m = 0; m < kM; ++m) {
      float largest = 0.0f;
      for_each_thread_vector<kK / 8, 4>(
          [&](int v) {
            if constexpr (kNormedX) {
              return *reinterpret_cast<const uint4*>(x_staged + (m * kK + 8 * v));
            } else {
              return load_activations(x + (m * kK + 8 * v));
            }
          },
          [&](int v, const uint4& value) {
            if constexpr (!kNormedX) *reinterpret_cast<uint4*>(x_staged + (m * kK + 8 * v)) = value;
            largest = fmaxf(largest, largest_magnitude(value));
          });
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xFFFFFFFFu, largest, offset));
      if (lane == 0) x_row_largest[warp * kPaddedM + m] = largest;
    }
    __syncthreads();
    // Each thread converts the vectors it staged (the same v as above): no barrier between the passes
    // but the one for the largest magnitudes.
    for (int m = 0; m < kM; ++m) {
      float largest = 0.0f;
      for (int w = 0; w < kWarps; ++w) largest = fmaxf(largest, x_row_largest[w * kPaddedM + m]);
      const int exponent = row_exponent(largest);
      const float up = __int_as_float((127 + exponent) << 23), down = __int_as_float((127 - exponent) << 23);
      if (threadIdx.x == 0) x_row_unscale[m] = down;
      const float odd_up = up / kOddCodeScale;  // exact: powers of two
      for (int v = threadIdx.x; v < kK / 8; v += kThreads) {
        uint4* const vector = reinterpret_cast<uint4*>(x_staged + (m * kK + 8 * v));
        const uint4 value = *vector;
        *vector = make_uint4(half_pair(value.x, up), half_pair(value.y, odd_up), half_pair(value.z, up),
                             half_pair(value.w, odd_up));
      }
    }
    if (threadIdx.x >= kM && threadIdx.x < kPaddedM) x_row_unscale[threadIdx.x] = 1.0f;
    __syncthreads();
  } else {
    (void)x;
  }
}

// The eight values of row m at columns k .. k + 7 (k a multiple of 8) as both mainloops read x:
// normalized when kNormedX (after compute_x_row_scales), else as stored.
__device__ __forceinline__ uint4 load_x(const u16* __restrict__ x, const u16* __restrict__ norm_weight, int m, int k) {
  if constexpr (kXStaged) {
    return *reinterpret_cast<const uint4*>(x_staged + (m * kK + k));
  } else if constexpr (kNormedX) {
    return normalized_x(x, norm_weight, m, k);
  } else {
    (void)norm_weight;
    return load_activations(x + (m * kK + k));
  }
}

// The B fragments of one iteration's x for both mainloops: lane (g, t) holds activation rows g and
// g + 8, columns 32c + 8t .. + 7 of each chunk c (the A fragments' column permutation).
// `read(m, column)` reads row m at `column` within the iteration where `live(column)`; columns not
// live are zeros (zero, then a predicated read: a select costs ptxas registers). Lanes of rows past kM
// read row kM - 1: the mma keeps its C columns apart, and no reader looks at the columns of rows past
// kM, so those lanes need neither a predicate nor zeroed registers (at M = 1, 8 of every 16 x registers).
template <class Live, class Read>
__device__ __forceinline__ void load_x_fragments(uint4 (&xv)[kRowHalves][kChunksPerIteration], int lane, Live&& live,
                                                 Read&& read) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < kRowHalves; ++h) {
    const int m = min(g + 8 * h, kM - 1);
#pragma unroll
    for (int c = 0; c < kChunksPerIteration; ++c) {
      xv[h][c] = make_uint4(0u, 0u, 0u, 0u);
      if (live(32 * c + 8 * t)) xv[h][c] = read(m, 32 * c + 8 * t);
    }
  }
}

// sum(x) of one group in the C-fragment layout affine_group_product takes, from a table of kPaddedM
// floats per group (`group` points at the group's row 0; zeros where not `live`).
__device__ __forceinline__ void read_group_sums(float (&xsum)[kRowHalves][4], const float* group, int lane, bool live) {
  const int t = lane & 3;
#pragma unroll
  for (int h = 0; h < kRowHalves; ++h) {
    float2 pair = make_float2(0.0f, 0.0f);
    if (live) pair = *reinterpret_cast<const float2*>(group + 8 * h + 2 * t);
    xsum[h][0] = xsum[h][2] = pair.x;
    xsum[h][1] = xsum[h][3] = pair.y;
  }
}

// Pair j of a repacked word as two activation-dtype values (offset + q_lo, offset + q_hi): the
// decode affine_code_decode describes (gemv_weight_layout.cpp, emulated there on the host). The
// lop3 is written out: from `(w & mask) | magic` ptxas made two LOP3s, each with one immediate.
__device__ __forceinline__ u32 code_pair(u32 word, int j) {
  if constexpr (kCodeMethod == kCodeMaskOr) {
    u32 pair;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(pair) : "r"(word >> (kCodeShift * j)), "n"(kCodeMask), "r"(kCodeMagic));
    return pair;
  } else if constexpr (kCodeMethod == kCodeNibbleClasses) {
    // j is a compile-time constant after unrolling: one of the two lop3 survives.
    u32 pair;
    if (j & 1) {
      asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(pair) : "r"(word >> (8 * (j >> 1))), "n"(kCodeOddMask), "r"(kCodeMagic));
    } else {
      asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(pair) : "r"(word >> (8 * (j >> 1))), "n"(kCodeMask), "r"(kCodeMagic));
    }
    return pair;
  } else if constexpr (kCodeMethod == kCodeBytePermute) {
    return __byte_perm(word, kCodeMagic, j == 0 ? kCodeSelector0 : kCodeSelector1);
  } else {
    // bf16 holds 0..255 exactly but not 128 + q for q >= 128: go through f32 (2^23 + q).
    const float low = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u | j)) - 8388608.0f;
    const float high = __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7540u | (j + 2))) - 8388608.0f;
    u32 pair;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(high), "f"(low));
    return pair;
  }
}

// The A fragments of the two 16-column mma steps of chunk `chunk` of one 16-byte load pair.
__device__ __forceinline__ void affine_fragments(const uint4& rows_low, const uint4& rows_high, int chunk,
                                                 u32 (&step0)[4], u32 (&step1)[4]) {
  if constexpr (kBits == 4) {
    const u32 low = component(rows_low, chunk), high = component(rows_high, chunk);
    step0[0] = code_pair(low, 0); step0[1] = code_pair(high, 0); step0[2] = code_pair(low, 1); step0[3] = code_pair(high, 1);
    step1[0] = code_pair(low, 2); step1[1] = code_pair(high, 2); step1[2] = code_pair(low, 3); step1[3] = code_pair(high, 3);
  } else {
    const u32 low0 = component(rows_low, 2 * chunk), high0 = component(rows_high, 2 * chunk);
    const u32 low1 = component(rows_low, 2 * chunk + 1), high1 = component(rows_high, 2 * chunk + 1);
    step0[0] = code_pair(low0, 0); step0[1] = code_pair(high0, 0); step0[2] = code_pair(low0, 1); step0[3] = code_pair(high0, 1);
    step1[0] = code_pair(low1, 0); step1[1] = code_pair(high1, 0); step1[2] = code_pair(low1, 1); step1[3] = code_pair(high1, 1);
  }
}

// One group q of one matrix's affine product, both mainloops' (the weights come from registers or
// from shared memory through `fragments(chunk, step0, step1)`, the A fragments of one 32-column
// chunk):  acc += scale * sum((offset + q) x) + (bias - offset * scale) * sum(x), per tile row
// (g from the low half of `scale_bias`, g + 8 from the high half); xsum[h] holds sum(x) of the
// group in the C-fragment layout (element e: activation row 8h + 2t + (e & 1)). Four values, not
// two, though e and e + 2 are equal: ptxas spilled with two at M = 16 (4-bit down w8 f2).
template <class Fragments>
__device__ __forceinline__ void affine_group_product(float (&acc)[kRowHalves][4], const uint4 (&xv)[kRowHalves][kChunksPerIteration],
                                                     int q, uint2 scale_bias, const float (&xsum)[kRowHalves][4],
                                                     Fragments&& fragments) {
  float part[kRowHalves][4];
#pragma unroll
  for (int h = 0; h < kRowHalves; ++h) part[h][0] = part[h][1] = part[h][2] = part[h][3] = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunksPerGroup; ++j) {
    const int chunk = q * kChunksPerGroup + j;
    u32 step0[4], step1[4];
    fragments(chunk, step0, step1);
#pragma unroll
    for (int h = 0; h < kRowHalves; ++h) {
      const uint4 b = xv[h][chunk];
      mma_in<kProductsHalf>(part[h], step0[0], step0[1], step0[2], step0[3], b.x, b.y);
      mma_in<kProductsHalf>(part[h], step1[0], step1[1], step1[2], step1[3], b.z, b.w);
    }
  }
  const float scale_low = to_f32(scale_bias.x & 0xFFFFu), bias_low = to_f32(scale_bias.x >> 16);
  const float scale_high = to_f32(scale_bias.y & 0xFFFFu), bias_high = to_f32(scale_bias.y >> 16);
  const float offset_low = fmaf(-kCodeOffset, scale_low, bias_low);
  const float offset_high = fmaf(-kCodeOffset, scale_high, bias_high);
#pragma unroll
  for (int h = 0; h < kRowHalves; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // Odd elements are activation row 8h + 2t + 1: at M = 1 no lane holds a real one.
      if (kM == 1 && (e & 1)) continue;
      if constexpr (kHalfProducts) {
        // xsum[h][e & 1] is sum(x') (the offset's), xsum[h][2 + (e & 1)] sum(x) 2^e_m (the bias's):
        // acc += scale (part - offset sum(x')) + bias sum(x) 2^e_m, in 2^e_m units (spill undoes them).
        const float scale = e < 2 ? scale_low : scale_high;
        const float bias = e < 2 ? bias_low : bias_high;
        acc[h][e] = fmaf(bias, xsum[h][2 + (e & 1)], fmaf(scale, fmaf(-kCodeOffset, xsum[h][e & 1], part[h][e]), acc[h][e]));
        continue;
      }
      const float scale = e < 2 ? scale_low : scale_high, offset = e < 2 ? offset_low : offset_high;
      // Two FFMA either way. With two row halves (M > 8) the bias term goes first: it needs only
      // xsum, known before the mma products, and in this order ptxas keeps the M = 16 shapes without
      // spills (the other order spilled 4-bit gate/up w4 db, and the three-instruction form it was
      // replaced by cost 2 more instructions a weight word: gemv_sass_benchmark --all --rows 16). At
      // M = 1 the order below keeps gate/up w4 f2 batch at 64 registers (72 the other way).
      if constexpr (kRowHalves == 1) {
        acc[h][e] = fmaf(offset, xsum[h][e], fmaf(scale, part[h][e], acc[h][e]));
      } else {
        acc[h][e] = fmaf(scale, part[h][e], fmaf(offset, xsum[h][e], acc[h][e]));
      }
    }
  }
}

)CUDA";

}  // namespace

std::string gemv_device_helpers() {
  return std::string(codegen_detail::tensor_core_device_helpers()) + std::string(device_helpers);
}

std::string gemv_format_helpers() { return std::string(device_helpers); }

std::string_view gemv_arrival_wait() {
  return R"CUDA(
__device__ __forceinline__ u64 global_nanoseconds() {
  u64 now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}
__device__ __forceinline__ void wait_for_arrivals(const u32* counter, u32 target) {
  const u64 start = global_nanoseconds();
  for (;;) {
    u32 seen;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    if (seen >= target) return;
    if (global_nanoseconds() - start > 4000000000ull) asm volatile("trap;");
    __nanosleep(32);
  }
}
)CUDA";
}

std::string gemv_format_tag(const GemvWeightFormat& format) {
  const std::string dtype(dtype_name(format.activation));
  if (!format.is_affine()) return dtype;
  return fmt::format("{}_a{}g{}", dtype, format.bits, format.group_size);
}

std::string gemv_kernel_entry(const GemvKernelConfig& config, const std::string& kernel_name,
                              std::string_view extra_parameters) {
  const int products = config.epilogue.product_count();
  const std::vector<GemvEpilogue::TensorInput> tensors = config.epilogue.tensor_inputs();
  const std::string bounds = config.resident_blocks_per_multiprocessor > 0
                                 ? fmt::format("kThreads, {}", config.resident_blocks_per_multiprocessor)
                                 : std::string("kThreads");
  std::string source = fmt::format("\nextern \"C\" __global__ void __launch_bounds__({}) {}(\n", bounds, kernel_name);
  for (int p = 0; p < products; ++p) {
    source += fmt::format("    const u32* __restrict__ weights{}, ", p);
    if (config.format.is_affine()) source += fmt::format("const u16* __restrict__ scale_bias{}, ", p);
    source += "\n";
  }
  source += "    const u16* __restrict__ x,\n";
  if (config.x_rms_norm_eps) source += "    const u16* __restrict__ x_norm_weight,  // [K], the RMSNorm's weight\n";
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    source += fmt::format("    const u16* __restrict__ tensor{},  // {}{}\n", i, codegen_detail::comment_text(tensors[i].name),
                          tensors[i].broadcast_rows ? " [N]" : " [M, N]");
  }
  if (config.output_splits.empty()) {
    source += fmt::format("    u16* __restrict__ out{}) {{\n", extra_parameters);
  } else {
    for (std::size_t s = 0; s < config.output_splits.size(); ++s) {
      source += fmt::format("    u16* __restrict__ out{}{}  // [M, {}]\n", s,
                            s + 1 == config.output_splits.size() ? std::string(extra_parameters) + ") {" : ",",
                            config.output_splits[s]);
    }
  }
  source += fmt::format("  const u32* const weights[kProducts] = {{weights0{}}};\n", products == 2 ? ", weights1" : "");
  if (config.format.is_affine()) {
    source += fmt::format("  const u16* const scale_bias[kProducts] = {{scale_bias0{}}};\n",
                          products == 2 ? ", scale_bias1" : "");
  } else {
    source += fmt::format("  const u16* const scale_bias[kProducts] = {{nullptr{}}};\n", products == 2 ? ", nullptr" : "");
  }
  if (!config.x_rms_norm_eps) source += "  const u16* const x_norm_weight = nullptr;  // x is not normalized\n";
  return source;
}

namespace {
// The rope epilogue (GemvRopeCacheEpilogue): its EpilogueTensors, load_epilogue_tensors and
// store_output. acc1 is the partner row's (n ^ 1) accumulator. Each row's value is rounded to the
// activation dtype first, as the separate GEMV stores it and the rope kernel reads it; then q's and
// k's pairs are rotated (metile_rope_angle and metile_rope_apply, the rope kernel's operations) and
// written: q to [Hq, M, D], k and v to their caches. The loads (the position, the biases at n and
// n ^ 1) are the epilogue's tensors; with kEpilogueBeforeWait the angle's sine and cosine are
// computed with them, before the wait, so nothing after the join waits on a load or on sincos.
std::string rope_cache_output_functions(const GemvKernelConfig& config) {
  const GemvRopeCacheEpilogue& rope = *config.rope_cache;
  const std::size_t tensor_count = config.epilogue.tensor_inputs().size();
  std::string text = codegen_detail::rope_rotation_device_code(rope.rope);
  text += fmt::format(R"(constexpr int kRopeHeadDim = {0};
constexpr int kRopeDims = {1};
constexpr int kQRows = {2};
constexpr int kKvRows = {3};
constexpr long long kCacheRows = {4}LL;
constexpr int kEpilogueTensorCount = {5};
struct EpilogueTensors {{
  float value[kEpilogueTensorCount > 0 ? kEpilogueTensorCount : 1];    // the tensors at n
  float partner[kEpilogueTensorCount > 0 ? kEpilogueTensorCount : 1];  // at n ^ 1 (rotated rows only)
  int position;
  float sine, cosine;  // kEpilogueBeforeWait and a rotated row only
}};
// Row n of the stacked q, k, v: its part (0, 1, 2), its head and its element p within the head.
__device__ __forceinline__ void rope_row(int n, int& part, int& head, int& p) {{
  part = n < kQRows ? 0 : n < kQRows + kKvRows ? 1 : 2;
  const int row = n - (part == 0 ? 0 : part == 1 ? kQRows : kQRows + kKvRows);
  head = row / kRopeHeadDim;
  p = row - head * kRopeHeadDim;
}}
__device__ __forceinline__ EpilogueTensors load_epilogue_tensors(const Outputs& outputs, int m, int n) {{
  EpilogueTensors tensors{{}};
  tensors.position = outputs.positions[m];
  int part, head, p;
  rope_row(n, part, head, p);
)",
                      rope.head_dim, rope.dims(), rope.q_heads * rope.head_dim, rope.kv_heads * rope.head_dim,
                      rope.capacity, tensor_count);
  for (std::size_t i = 0; i < tensor_count; ++i) text += fmt::format("  tensors.value[{0}] = to_f32(ordered_after_wait(outputs.tensor{0})[n]);\n", i);
  text += "  if (part < 2 && p < kRopeDims) {\n";
  for (std::size_t i = 0; i < tensor_count; ++i) text += fmt::format("    tensors.partner[{0}] = to_f32(ordered_after_wait(outputs.tensor{0})[n ^ 1]);\n", i);
  text += "    if constexpr (kEpilogueBeforeWait) metile_rope_angle(p >> 1, tensors.position, tensors.sine, tensors.cosine);\n"
          "  }\n  return tensors;\n}\n";
  text += "// The value the stacked GEMV stores for a row (its epilogue expression), as stored.\n"
          "__device__ __forceinline__ float stored_value(float acc0, const float (&tensor)[kEpilogueTensorCount > 0 ? kEpilogueTensorCount : 1]) {\n"
          "  (void)tensor;\n  const float acc1 = 0.0f;\n  (void)acc1;\n";
  for (std::size_t i = 0; i < tensor_count; ++i) text += fmt::format("  const float tensor_value{0} = tensor[{0}];\n", i);
  text += fmt::format("  return to_f32(from_f32({}));\n}}\n", config.epilogue.cuda_expression());
  text += R"(__device__ __forceinline__ float store_output(const Outputs& outputs, int m, int n, float acc0, float acc1,
                                             const EpilogueTensors& tensors) {
  int part, head, p;
  rope_row(n, part, head, p);
  const int position = tensors.position;
  const float value = stored_value(acc0, tensors.value);
  float result = value;
  int d = p;
  if (part < 2 && p < kRopeDims) {
    // Rows 2j and 2j + 1 of a head hold the pair (j, j + dims/2) (gemv_rope_row_order).
    const float partner = stored_value(acc1, tensors.partner);
    const int pair = p >> 1;
    const bool high = (p & 1) != 0;
    float sine = tensors.sine, cosine = tensors.cosine;
    if constexpr (!kEpilogueBeforeWait) metile_rope_angle(pair, position, sine, cosine);
    float low_value, high_value;
    metile_rope_apply(high ? partner : value, high ? value : partner, sine, cosine, low_value, high_value);
    result = high ? high_value : low_value;
    d = high ? pair + kRopeDims / 2 : pair;
  }
  if (part == 0) {
    outputs.out[0][(static_cast<long long>(head) * kM + m) * kRopeHeadDim + d] = from_f32(result);
    return result;
  }
  // kv_cache_write's rule: a position outside the cache writes nothing, and a position a later row
  // names again is left to that row.
  bool skipped = position < 0 || position >= kCacheRows;
  for (int later = m + 1; later < kM; ++later) skipped = skipped || outputs.positions[later] == position;
  if (!skipped) outputs.out[part][(static_cast<long long>(head) * kCacheRows + position) * kRopeHeadDim + d] = from_f32(result);
  return result;
}
__device__ __forceinline__ float store_output(const Outputs& outputs, int m, int n, float acc0, float acc1) {
  return store_output(outputs, m, n, acc0, acc1, load_epilogue_tensors(outputs, m, n));
}
)";
  return text;
}
}  // namespace

std::string gemv_output_functions(const GemvKernelConfig& config) {
  const std::vector<GemvEpilogue::TensorInput> tensors = config.epilogue.tensor_inputs();
  // record_stored: the unsplit store hands it each output as stored. With argmax_rows it keeps the
  // tile's values in shared memory for the block's argmax (argmax_rows_block, gemv_mainloop.cpp),
  // which so reads no value back from global memory; the block's winner per row lives beside them.
  std::string text = config.argmax_rows
                         ? "__shared__ float argmax_stored[kM * kTiles * 16];\n"
                           "__shared__ float argmax_block_value[kM];\n"
                           "__shared__ int argmax_block_index[kM];\n"
                           "__device__ __forceinline__ void record_stored(int o, float value) { argmax_stored[o] = value; }\n"
                         : "__device__ __forceinline__ void record_stored(int, float) {}\n";
  text += "struct Outputs {\n";
  for (std::size_t i = 0; i < tensors.size(); ++i) text += fmt::format("  const u16* tensor{};\n", i);
  text += config.output_splits.empty() ? "  u16* out;\n"
                                        : fmt::format("  u16* out[{}];\n", config.output_splits.size());
  text += config.rope_cache ? "  const int* positions;  // [M], the rows' positions in the caches\n};\n" : "};\n";
  // kPreloadEpilogue (register mainloop, unsplit, one output a thread): the kernel entry loads each
  // thread's epilogue tensors right after the wait for the previous kernel, so that their round trip
  // to L2 overlaps the mainloop instead of following the join; store_output then takes them.
  // kEpilogueBeforeWait (the rope epilogue whose inputs no kernel of the run writes,
  // GemvRopeCacheEpilogue::inputs_before_wait): before the wait instead.
  const bool one_output_a_thread = config.mainloop == GemvMainloop::register_batches && config.k_splits == 1 &&
                                   config.rows * config.tiles_per_block * 16 <= config.warps_per_block * 32;
  const bool preload = one_output_a_thread && (config.rope_cache || !tensors.empty());
  const bool before_wait = preload && config.rope_cache && config.rope_cache->inputs_before_wait;
  text += fmt::format("[[maybe_unused]] constexpr bool kPreloadEpilogue = {};\n[[maybe_unused]] constexpr bool kEpilogueBeforeWait = {};\n",
                      preload ? "true" : "false", before_wait ? "true" : "false");
  if (config.rope_cache) return text + rope_cache_output_functions(config);
  text += fmt::format("struct EpilogueTensors {{\n  float value[{}];\n}};\n", std::max<std::size_t>(tensors.size(), 1));
  text += "__device__ __forceinline__ EpilogueTensors load_epilogue_tensors(const Outputs& outputs, int m, int n) {\n"
          "  (void)outputs, (void)m, (void)n;\n  EpilogueTensors tensors{};\n";
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    text += fmt::format("  tensors.value[{}] = to_f32(ordered_after_wait(outputs.tensor{})[{}]);\n", i, i,
                        tensors[i].broadcast_rows ? "n" : "m * kN + n");
  }
  text += "  return tensors;\n}\n";
  // The store with the tensors loaded already; the plain one loads them itself.
  text += "__device__ __forceinline__ float store_output(const Outputs& outputs, int m, int n, float acc0, float acc1,\n"
          "                                             const EpilogueTensors& tensors) {\n"
          "  (void)acc1, (void)tensors;\n";
  for (std::size_t i = 0; i < tensors.size(); ++i) text += fmt::format("  const float tensor_value{} = tensors.value[{}];\n", i, i);
  const std::string value = fmt::format("from_f32({})", config.epilogue.cuda_expression());
  const std::string plain_store =
      "__device__ __forceinline__ float store_output(const Outputs& outputs, int m, int n, float acc0, float acc1) {\n"
      "  return store_output(outputs, m, n, acc0, acc1, load_epilogue_tensors(outputs, m, n));\n}\n";
  if (config.output_splits.empty()) {
    return text + fmt::format("  const u16 result = {};\n  outputs.out[m * kN + n] = result;\n  return to_f32(result);\n}}\n", value) +
           plain_store;
  }
  // Split outputs: columns [begin, begin + width) of the stacked matrix are output s's [M, width]
  // (compile-time bounds: the branch is uniform but at the borders of a tile).
  text += "  const u16 result = " + value + ";\n";
  std::int64_t begin = 0;
  for (std::size_t s = 0; s < config.output_splits.size(); ++s) {
    const std::int64_t width = config.output_splits[s];
    const bool last = s + 1 == config.output_splits.size();
    const std::string condition = last ? "" : fmt::format("if (n < {}) ", begin + width);
    text += fmt::format("  {}{}outputs.out[{}][m * {} + (n - {})] = result;\n", s == 0 ? "" : "else ", condition, s,
                        width, begin);
    begin += width;
  }
  return text + "  return to_f32(result);\n}\n" + plain_store;
}

std::string gemv_outputs_binding(const GemvKernelConfig& config) {
  std::string text = "  Outputs outputs;\n";
  for (std::size_t i = 0; i < config.epilogue.tensor_inputs().size(); ++i) {
    text += fmt::format("  outputs.tensor{} = tensor{};\n", i, i);
  }
  if (config.output_splits.empty()) return text + "  outputs.out = out;\n";
  for (std::size_t s = 0; s < config.output_splits.size(); ++s) text += fmt::format("  outputs.out[{}] = out{};\n", s, s);
  if (config.rope_cache) text += "  outputs.positions = positions;\n";
  return text;
}

std::uint64_t gemv_epilogue_hash(const GemvKernelConfig& config) {
  std::string text = config.epilogue.to_string() + "|" + config.epilogue.cuda_expression();
  // The rope's shape and its frequency table (theta and scaling as they reach the kernel).
  if (config.rope_cache) text += "|rope " + config.to_string() + codegen_detail::rope_rotation_device_code(config.rope_cache->rope);
  for (std::int64_t width : config.output_splits) text += fmt::format("|{}", width);
  if (config.x_rms_norm_eps) text += fmt::format("|rms_norm {:.17g}", *config.x_rms_norm_eps);
  return fnv1a_64(text);
}

bool x_staged_in_shared_memory(const GemvKernelConfig& config) {
  if (config.mainloop != GemvMainloop::register_batches || config.in_features % 8 != 0) return false;
  const std::int64_t bytes = config.rows * config.in_features * 2;
  return (config.x_rms_norm_eps && bytes <= kMaxStagedXBytes) || (config.half_products && bytes <= kMaxHalfStagedXBytes);
}

std::int64_t x_norm_shared_bytes(const GemvKernelConfig& config) {
  const std::int64_t padded_m = (config.rows + 7) / 8 * 8;
  const std::int64_t staged = x_staged_in_shared_memory(config) ? config.rows * config.in_features * 2 : 16;
  // half_products: per warp and row a largest magnitude, per row the unscale (x_row_largest, x_row_unscale).
  const std::int64_t half = config.half_products ? (std::int64_t{config.warps_per_block} + 1) * padded_m * 4 : 8;
  if (!config.x_rms_norm_eps) return 4 + staged + half;
  return (std::int64_t{config.warps_per_block} + 1) * padded_m * 4 + staged + half;
}

namespace {
// The kernel's enum CodeMethod numbers the methods as AffineCodeDecode::Method does.
static_assert(static_cast<int>(AffineCodeDecode::Method::mask_or) == 0 &&
              static_cast<int>(AffineCodeDecode::Method::byte_permute) == 1 &&
              static_cast<int>(AffineCodeDecode::Method::through_f32) == 2 &&
              static_cast<int>(AffineCodeDecode::Method::nibble_classes) == 3);

// The affine code decode's constants (affine_code_decode); dense kernels get the 4-bit ones, unused.
std::string code_decode_constants(const GemvKernelConfig& config) {
  const GemvWeightFormat& format = config.format;
  const AffineCodeDecode decode =
      affine_code_decode(format.is_affine() ? format.bits : 4, format.activation, config.half_products);
  return fmt::format(
      "enum CodeMethod {{ kCodeMaskOr, kCodeBytePermute, kCodeThroughF32, kCodeNibbleClasses }};\n"
      "constexpr CodeMethod kCodeMethod = CodeMethod({});\nconstexpr unsigned kCodeMask = 0x{:08X}u;\n"
      "constexpr unsigned kCodeOddMask = 0x{:08X}u;\nconstexpr unsigned kCodeMagic = 0x{:08X}u;\n"
      "constexpr int kCodeShift = {};\nconstexpr unsigned kCodeSelector0 = 0x{:04X}u, kCodeSelector1 = 0x{:04X}u;\n"
      "[[maybe_unused]] constexpr float kCodeOffset = {:.1f}f;  // the decoded value of code q is kCodeOffset + c q\n"
      "constexpr float kOddCodeScale = {:.1f}f;  // c of the odd pairs (the even ones: 1)\n"
      "constexpr bool kHalfProducts = {};\n",
      static_cast<int>(decode.method), decode.mask, decode.odd_mask, decode.magic, decode.shift, decode.selector(0),
      decode.selector(1), decode.offset, static_cast<double>(decode.code_scale(1)), config.half_products ? "true" : "false");
}
}  // namespace

std::string gemv_problem_constants(const GemvKernelConfig& config, bool x_written_in_kernel) {
  return code_decode_constants(config) + fmt::format(
      "constexpr int kM = {};\nconstexpr int kN = {};\nconstexpr int kK = {};\n"
      "constexpr int kBits = {};\nconstexpr int kGroup = {};\nconstexpr bool kHalf = {};\n"
      "constexpr int kColumnsPerIteration = {};\nconstexpr int kProducts = {};\nconstexpr int kWarps = {};\n"
      "constexpr bool kNormedX = {};\nconstexpr double kNormEps = {:.17g};\nconstexpr bool kXWrittenInKernel = {};\n"
      "constexpr bool kXStaged = {};\nconstexpr bool kXStagedByCopy = {};\n[[maybe_unused]] constexpr bool kRopeCache = {};\n",
      config.rows, config.out_features, config.in_features, config.format.bits, config.format.group_size,
      config.format.activation == DType::f16 ? "true" : "false", config.format.columns_per_iteration(),
      config.epilogue.product_count(), config.warps_per_block, config.x_rms_norm_eps ? "true" : "false",
      config.x_rms_norm_eps.value_or(0.0), x_written_in_kernel ? "true" : "false",
      x_staged_in_shared_memory(config) ? "true" : "false", config.x_staged_by_async_copy ? "true" : "false",
      config.rope_cache ? "true" : "false");
}

}  // namespace metile::gemv_detail
