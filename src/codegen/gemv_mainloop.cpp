// The GEMV mainloop generator: y[m, n] = epilogue(sum_k x[m, k] W_p[n, k]) for M = 1..16
// activation rows, reading each weight byte once. Memory-bound by design, so the shape is
// chosen around the loads:
//
//   block  = `warps` warps x `tiles` 16-row tiles of W; the warps split K (iteration i goes to
//            warp i mod warps) and meet in shared memory at the end
//   warp   : per iteration, per tile and matrix, two 16-byte loads per lane (rows 0..7 and
//            8..15 of the tile), `in_flight` iterations issued before any math
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

#include <algorithm>

#include "gemv_internal.h"
#include "metile/gemv.h"

namespace metile {
using namespace gemv_detail;
namespace {

constexpr std::string_view register_mainloop_body = R"CUDA(
// The weights (and scales/biases) of kInFlight iterations of one warp: the unit the mainloop
// keeps in flight. x is not part of it: every warp of the SM reads the same x, so its loads hit L1
// and are issued just before the math.
template <int P>
struct Batch {
  uint4 w[kInFlight][P][kTiles][kLoadsPerIteration][2];
  uint2 sb[kInFlight][P][kTiles][kGroupsPerIteration];
};

// Issues the loads of iterations first, first + kWarps, ... (zeros past the end of K).
template <int P>
__device__ __forceinline__ void load_batch(Batch<P>& batch, const u32* const (&weights)[P],
                                           const u16* const (&scale_bias)[P], int first, int lane, int first_tile) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < kInFlight; ++u) {
    const int it = first + u * kWarps;
    const bool live = it < kIterations;
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const int tile = first_tile + i;
#pragma unroll
        for (int l = 0; l < kLoadsPerIteration; ++l) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            batch.w[u][p][i][l][h] = make_uint4(0u, 0u, 0u, 0u);
            if constexpr (kAffine) {
              const u64 block = (u64)tile * kLoadBlocks + (u64)it * kLoadsPerIteration + l;
              if (live && tile < kTileCount) batch.w[u][p][i][l][h] = load_weights(weights[p] + (block * 2 + h) * 128 + lane * 4);
            } else {
              const int row = tile * 16 + 8 * h + g;
              const int k = it * kColumnsPerIteration + 8 * t;
              if (live && row < kN && k < kK) {
                batch.w[u][p][i][l][h] = load_weights(reinterpret_cast<const u16*>(weights[p]) + (u64)row * kK + k);
              }
            }
          }
        }
#pragma unroll
        for (int q = 0; q < kGroupsPerIteration; ++q) {
          batch.sb[u][p][i][q] = make_uint2(0u, 0u);
          if constexpr (kAffine) {
            const u64 group = (u64)tile * kGroupCount + (u64)it * kGroupsPerIteration + q;
            if (live && tile < kTileCount) batch.sb[u][p][i][q] = load_scale_bias(scale_bias[p] + (group * 8 + g) * 4);
          }
        }
      }
    }
  }
}

// The math of one batch: x fragments, then per group the mma products and the scale/bias fold.
template <int P>
__device__ __forceinline__ void compute_batch(float (&acc)[P][kTiles][kRowHalves][4], const Batch<P>& batch,
                                              const u16* __restrict__ x, int first, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < kInFlight; ++u) {
    const int it = first + u * kWarps;
    uint4 xv[kRowHalves][kChunksPerIteration];
#pragma unroll
    for (int h = 0; h < kRowHalves; ++h) {
      const int m = g + 8 * h;
#pragma unroll
      for (int c = 0; c < kChunksPerIteration; ++c) {
        const int k = it * kColumnsPerIteration + 32 * c + 8 * t;
        xv[h][c] = make_uint4(0u, 0u, 0u, 0u);
        if (it < kIterations && m < kM && k < kK) xv[h][c] = load_activations(x + m * kK + k);
      }
    }
    if constexpr (kAffine) {
#pragma unroll
      for (int q = 0; q < kGroupsPerIteration; ++q) {
        float xsum[kRowHalves][4];
#pragma unroll
        for (int h = 0; h < kRowHalves; ++h) {
          xsum[h][0] = xsum[h][1] = xsum[h][2] = xsum[h][3] = 0.0f;
#pragma unroll
          for (int j = 0; j < kChunksPerGroup; ++j) {
            const uint4 b = xv[h][q * kChunksPerGroup + j];
            mma(xsum[h], kOnes, kOnes, kOnes, kOnes, b.x, b.y);
            mma(xsum[h], kOnes, kOnes, kOnes, kOnes, b.z, b.w);
          }
        }
#pragma unroll
        for (int p = 0; p < P; ++p) {
#pragma unroll
          for (int i = 0; i < kTiles; ++i) {
            float part[kRowHalves][4];
#pragma unroll
            for (int h = 0; h < kRowHalves; ++h) part[h][0] = part[h][1] = part[h][2] = part[h][3] = 0.0f;
#pragma unroll
            for (int j = 0; j < kChunksPerGroup; ++j) {
              const int chunk = q * kChunksPerGroup + j;
              const int l = chunk / kChunksPerLoad;
              u32 step0[4], step1[4];
              affine_fragments(batch.w[u][p][i][l][0], batch.w[u][p][i][l][1], chunk % kChunksPerLoad, step0, step1);
#pragma unroll
              for (int h = 0; h < kRowHalves; ++h) {
                const uint4 b = xv[h][chunk];
                mma(part[h], step0[0], step0[1], step0[2], step0[3], b.x, b.y);
                mma(part[h], step1[0], step1[1], step1[2], step1[3], b.z, b.w);
              }
            }
            const uint2 s = batch.sb[u][p][i][q];
            const float scale_low = to_f32(s.x & 0xFFFFu), bias_low = to_f32(s.x >> 16);
            const float scale_high = to_f32(s.y & 0xFFFFu), bias_high = to_f32(s.y >> 16);
            const float offset_low = fmaf(-kCodeOffset, scale_low, bias_low);
            const float offset_high = fmaf(-kCodeOffset, scale_high, bias_high);
#pragma unroll
            for (int h = 0; h < kRowHalves; ++h) {
              acc[p][i][h][0] += fmaf(scale_low, part[h][0], offset_low * xsum[h][0]);
              acc[p][i][h][1] += fmaf(scale_low, part[h][1], offset_low * xsum[h][1]);
              acc[p][i][h][2] += fmaf(scale_high, part[h][2], offset_high * xsum[h][2]);
              acc[p][i][h][3] += fmaf(scale_high, part[h][3], offset_high * xsum[h][3]);
            }
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

// Adds this warp's share of K (iterations warp, warp + kWarps, ...) for P weight matrices into acc.
// Double-buffered: the next batch's loads are issued before the current batch's math, so this
// warp keeps bytes in flight while it computes. Otherwise each batch is loaded, then computed.
template <int P>
__device__ __forceinline__ void accumulate(float (&acc)[P][kTiles][kRowHalves][4], const u32* const (&weights)[P],
                                           const u16* const (&scale_bias)[P], const u16* __restrict__ x,
                                           const int warp, const int lane, const int first_tile) {
  constexpr int kStride = kWarps * kInFlight;
  if constexpr (kDoubleBuffered) {
    Batch<P> even, odd;
    if (warp < kIterations) load_batch(even, weights, scale_bias, warp, lane, first_tile);
#pragma unroll 1
    for (int first = warp; first < kIterations; first += 2 * kStride) {
      const int second = first + kStride;
      if (second < kIterations) load_batch(odd, weights, scale_bias, second, lane, first_tile);
      compute_batch(acc, even, x, first, lane);
      if (second >= kIterations) break;
      if (second + kStride < kIterations) load_batch(even, weights, scale_bias, second + kStride, lane, first_tile);
      compute_batch(acc, odd, x, second, lane);
    }
  } else {
    Batch<P> batch;
#pragma unroll 1
    for (int first = warp; first < kIterations; first += kStride) {
      load_batch(batch, weights, scale_bias, first, lane, first_tile);
      compute_batch(acc, batch, x, first, lane);
    }
  }
}

__device__ __forceinline__ int partial_index(int warp, int product, int tile, int row, int m) {
  return (((warp * kProducts + product) * kTiles + tile) * 16 + row) * kPaddedM + m;
}

// Writes a warp's accumulators for `product` (C fragment: rows g and g + 8, columns 2t, 2t + 1).
__device__ __forceinline__ void spill(const float (&acc)[kTiles][kRowHalves][4], float* partial, int warp,
                                      int product, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int h = 0; h < kRowHalves; ++h) {
      const int m = 8 * h + 2 * t;
      partial[partial_index(warp, product, i, g, m)] = acc[i][h][0];
      partial[partial_index(warp, product, i, g, m + 1)] = acc[i][h][1];
      partial[partial_index(warp, product, i, g + 8, m)] = acc[i][h][2];
      partial[partial_index(warp, product, i, g + 8, m + 1)] = acc[i][h][3];
    }
  }
}
)CUDA";

// The kernel entry: accumulate (one of the two schedules), join the warps, apply the epilogue.
constexpr std::string_view kernel_entry_body = R"CUDA(
  __shared__ float partial[kWarps * kProducts * kTiles * 16 * kPaddedM];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first_tile = blockIdx.x * kTiles;
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
      accumulate<1>(acc, one_weights, one_scale_bias, x, warp, lane, first_tile);
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
    accumulate<kProducts>(acc, weights, scale_bias, x, warp, lane, first_tile);
#pragma unroll
    for (int p = 0; p < kProducts; ++p) spill(acc[p], partial, warp, p, lane);
  }
  __syncthreads();

  // One thread per output; consecutive threads take consecutive n so the stores coalesce.
  for (int o = threadIdx.x; o < kM * kTiles * 16; o += kThreads) {
    const int m = o / (kTiles * 16);
    const int r = o - m * (kTiles * 16);
    const int n = first_tile * 16 + r;
    if (n >= kN) continue;
    const int i = r >> 4, row = r & 15;
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      acc0 += partial[partial_index(w, 0, i, row, m)];
      if constexpr (kProducts == 2) acc1 += partial[partial_index(w, 1, i, row, m)];
    }
    (void)acc1;
)CUDA";


}  // namespace

std::string_view gated_schedule_name(GatedSchedule schedule) {
  return schedule == GatedSchedule::register_resident ? "register_resident" : "scratch_spilled";
}

std::string_view gemv_mainloop_name(GemvMainloop mainloop) {
  return mainloop == GemvMainloop::register_batches ? "register_batches" : "streamed";
}

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
  if (warps_per_block != 1 && warps_per_block != 2 && warps_per_block != 4 && warps_per_block != 8 &&
      warps_per_block != 16) {
    throw InputError(fmt::format("GEMV: warps_per_block must be 1, 2, 4, 8 or 16, not {}", warps_per_block));
  }
  if (tiles_per_block < 1 || tiles_per_block > 4) {
    throw InputError(fmt::format("GEMV: tiles_per_block must be 1..4, not {}", tiles_per_block));
  }
  if (iterations_in_flight < 1 || iterations_in_flight > 8) {
    throw InputError(fmt::format("GEMV: iterations_in_flight must be 1..8, not {}", iterations_in_flight));
  }
  if (mainloop == GemvMainloop::streamed) {
    validate_streamed(*this);
    return;
  }
  const std::int64_t padded_m = (rows + 7) / 8 * 8;
  const std::int64_t shared = std::int64_t{warps_per_block} * epilogue.product_count() * tiles_per_block * 16 * padded_m * 4;
  if (shared > 48 * 1024) {
    throw InputError(fmt::format("GEMV {}: {} bytes of shared memory for partial sums (at most 49152)", to_string(), shared));
  }
}

std::string GemvKernelConfig::to_string() const {
  std::string text = fmt::format("{} M={} N={} K={} [{}]", format.to_string(), rows, out_features, in_features,
                                 epilogue.to_string());
  if (mainloop == GemvMainloop::streamed) {
    return text + fmt::format(" streamed warps={} stage_iterations={} stages={} grid={}x{}", warps_per_block,
                              stage_iterations, stages, multiprocessors, blocks_per_multiprocessor);
  }
  if (epilogue.product_count() == 2) text += fmt::format(" {}", gated_schedule_name(schedule));
  return text + fmt::format(" warps={} tiles={} in_flight={}{}", warps_per_block, tiles_per_block, iterations_in_flight,
                            double_buffered ? " double_buffered" : "");
}

GemvKernelSource generate_gemv_kernel(const GemvKernelConfig& config) {
  config.validate();
  if (config.mainloop == GemvMainloop::streamed) return generate_streamed_gemv_kernel(config);
  const int products = config.epilogue.product_count();
  const bool scratch = products == 2 && config.schedule == GatedSchedule::scratch_spilled;
  const std::vector<GemvEpilogue::TensorInput> tensors = config.epilogue.tensor_inputs();
  const std::string expression = config.epilogue.cuda_expression();

  GemvKernelSource result;
  const std::uint64_t epilogue_hash = fnv1a_64(config.epilogue.to_string() + "|" + expression);
  result.kernel_name =
      fmt::format("metile_gemv_{}_m{}_n{}_k{}_p{}{}_w{}t{}f{}{}_e{:08x}", gemv_format_tag(config.format), config.rows,
                  config.out_features, config.in_features, products, scratch ? "s" : "r", config.warps_per_block,
                  config.tiles_per_block, config.iterations_in_flight, config.double_buffered ? "d" : "",
                  epilogue_hash & 0xFFFFFFFFu);

  std::string source = fmt::format("// Generated by metile (src/codegen/gemv_mainloop.cpp): {}\n", config.to_string());
  source += gemv_problem_constants(config);
  source += fmt::format(
      "constexpr bool kScratchSpilled = {};\nconstexpr int kTiles = {};\n"
      "constexpr int kInFlight = {};\nconstexpr bool kDoubleBuffered = {};\n",
      scratch ? "true" : "false", config.tiles_per_block, config.iterations_in_flight,
      config.double_buffered ? "true" : "false");
  source += gemv_device_helpers();
  source += register_mainloop_body;
  source += "\n// The op table's device functions (src/graph/op_registry.cpp), which epilogue expressions call.\n";
  source += cuda_elementwise_helpers();

  source += gemv_kernel_entry(config, result.kernel_name, "");
  source += kernel_entry_body;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    source += fmt::format("    const float tensor_value{} = to_f32(tensor{}[{}]);\n", i, i,
                          tensors[i].broadcast_rows ? "n" : "m * kN + n");
  }
  source += fmt::format("    out[m * kN + n] = from_f32({});\n  }}\n}}\n", expression);

  const std::int64_t tile_count = (config.out_features + 15) / 16;
  result.source = std::move(source);
  result.grid_blocks = static_cast<unsigned>((tile_count + config.tiles_per_block - 1) / config.tiles_per_block);
  result.block_threads = static_cast<unsigned>(config.warps_per_block * 32);
  result.static_shared_bytes = static_cast<unsigned>(config.warps_per_block * products * config.tiles_per_block * 16 *
                                                     ((config.rows + 7) / 8 * 8) * 4);
  return result;
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
  const int columns_per_load = 32 * (base.format.bits == 16 ? 1 : base.format.bits == 8 ? 2 : 4);
  const int loads_per_iteration = base.format.columns_per_iteration() / columns_per_load;
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
  auto add = [&](int warps, bool double_buffered, bool deeper = false) {
    GemvKernelConfig config = base;
    config.warps_per_block = warps;
    config.tiles_per_block = 1;
    config.double_buffered = double_buffered;
    config.iterations_in_flight = in_flight(warps, double_buffered, deeper);
    for (const GemvKernelConfig& existing : candidates) {
      if (existing.warps_per_block == warps && existing.double_buffered == double_buffered &&
          existing.iterations_in_flight == config.iterations_in_flight) {
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
  // Measured on the H200 (notes/mlp_decode.md): one tile per block beat two everywhere, and a
  // grid whose blocks do not all fit at once loses a partial wave. A wide N (many tiles) wants
  // few warps per tile so that every block is resident; a narrow N splits K over more warps.
  const bool narrow = tiles < 2 * multiprocessors;
  if (narrow) {
    add(8, true);
    add(16, true);
    add(8, true, true);
    add(4, true);
    add(8, false);
  } else {
    add(2, true);
    add(4, true);
    add(2, true, true);
    add(8, true);
    add(4, false);
  }
  return candidates;
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
