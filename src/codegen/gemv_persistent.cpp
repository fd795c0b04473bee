// The persistent decode MLP (gemv.h, "the persistent decode MLP"): gate/up, a grid-wide barrier and
// down in ONE launch, so that the boundary between the two stage kernels (a grid's drain, the next
// one's ramp) becomes a barrier inside one grid (notes/mlp_decode.md). Two partitions of the work:
//
//   stage blocks  each phase is its stage kernel's own block: the register-batch kernel's body
//           (gemv_unit_loop_body: the warps split K and join in shared memory, the x prologue, the
//           split-K join across blocks) as a device function of the block's units, block b taking
//           units b, b + grid, ... of that phase (a unit: a tile block and a K split).
//   warp pieces  per phase, the (16-row tile, iteration) positions, tile-major, in equal contiguous
//           shares, one per warp of the grid (the register mainloop with kWarps = 1), a tile split
//           between warps joined through fp32 partials by the last piece to arrive (the stream-K
//           join of gemv_streamed.cpp). Every SM gets equal work for any N.
//
//   text    one copy of the tensor-core helpers and the barrier, then each phase in a namespace of
//           its own (gate_up, down): its problem constants, helpers, mainloop and epilogue.
//   barrier after phase 1 every block makes its writes visible and arrives (grid_barrier below); a
//           warp of phase 2 issues its first batch of down weights (they need nothing from phase
//           1), then waits (activations_ready) for its block's release before it reads the hidden
//           state, through L2 (kXWrittenInKernel).
//
// Why it cannot deadlock: a block waits only for the other blocks' arrivals, and every block
// arrives unconditionally once its own phase 1 is done (phase 1 waits for nothing but memory). So
// the barrier completes as soon as every block has been scheduled, which holds when all of them
// fit on the device at once: the grid is multiprocessors x blocks_per_multiprocessor, the kernel
// is compiled with __launch_bounds__(threads, blocks_per_multiprocessor), and LoadedGemv::load
// refuses it unless the driver reports that occupancy for the compiled kernel
// (co_resident_blocks_per_multiprocessor) and that many SMs. A kernel sharing the device delays
// the last blocks but does not wait on this one, so they are scheduled when it ends. A dependent
// kernel (programmatic dependent launch) starts only once every block of this grid has let it
// (griddepcontrol.launch_dependents), that is, once all of them run, so it cannot take the SMs
// that blocks of this grid are still waiting for; launched itself as a programmatic dependent, its
// blocks that start early wait (griddepcontrol.wait) for a kernel that waits on nothing of theirs,
// and the rest are scheduled as that kernel's blocks leave.
#include <fmt/core.h>

#include <algorithm>

#include "codegen_internal.h"
#include "gemv_internal.h"
#include "metile/gemv.h"

namespace metile {
using namespace gemv_detail;
namespace {

// The grid-wide barrier between the phases. Every block bumps one arrival counter once; the last
// to arrive re-arms it and releases every block through a flag of the block's own (one 128-byte
// line each, so that the waiting warps poll lines spread over the L2 slices: thousands of warps
// polling the counter itself queue behind one another on its slice, the arrivals with them, and
// slow every load that slice serves). A block's flag is cleared when the block leaves, after it
// has seen it set, so the next launch (or graph replay) on the stream starts from zero.
// Memory order: each block's writes, __threadfence, its arrival (a chain of atomics on one counter)
// -> the last arrival, __threadfence, the flags (st.release) -> a waiter's ld.acquire of its flag.
// Workspace: the counter, then kBlocks flags 32 words apart (grid_barrier_words).
constexpr std::string_view grid_barrier = R"CUDA(
// This block's release flag, set by thread 0 before the block's first barrier.
__shared__ const u32* grid_release;

// Waits until every block of the grid has arrived.
// (The flag is 0 or 1: the arrival wait with a target of 1 is the flag wait.)
__device__ __forceinline__ void wait_for_every_block() { wait_for_arrivals(grid_release, 1u); }

// Binds this block's flag (thread 0, before the block's first __syncthreads).
__device__ __forceinline__ void join_grid_barrier(u32* words) {
  if (threadIdx.x == 0) grid_release = words + 32 * (1 + blockIdx.x);
}

// The whole block, once its phase 1 is done: its writes made visible, then its arrival; the last
// block to arrive re-arms the counter and sets every block's flag.
__device__ __forceinline__ void arrive_at_grid_barrier(u32* words) {
  __shared__ u32 last_to_arrive;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last_to_arrive = atomicAdd(words, 1u) == (u32)kBlocks - 1;
  }
  __syncthreads();
  if (!last_to_arrive) return;
  __threadfence();
  if (threadIdx.x == 0) atomicExch(words, 0u);
  for (int b = threadIdx.x; b < kBlocks; b += blockDim.x) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(words + 32 * (1 + b)), "r"(1u) : "memory");
  }
}

// The whole block, at its end: once every warp is past its waits, the flag is cleared for the next
// launch (after it was set: a block that never waited must not clear it before the release).
__device__ __forceinline__ void leave_grid_barrier() {
  __syncthreads();
  if (threadIdx.x == 0) {
    wait_for_every_block();
    *const_cast<u32*>(grid_release) = 0u;
  }
}
)CUDA";

// The down phase's x is the hidden state: ready once every block has arrived. The pointer comes out
// of the asm statement after the wait, so no load through it can be hoisted above the wait.
constexpr std::string_view activations_after_grid_barrier = R"CUDA(
template <class T>
__device__ __forceinline__ T* activations_ready(T* pointer) {
  wait_for_every_block();
  asm volatile("mov.b64 %0, %0;" : "+l"(pointer) :: "memory");
  return pointer;
}
)CUDA";

// The barrier's words in the workspace: the counter, then a 32-word line per block.
std::int64_t grid_barrier_words(std::int64_t blocks) { return 32 * (1 + blocks); }

// One phase: this warp's share of the positions, piece by piece (a piece never crosses a tile).
constexpr std::string_view phase_body = R"CUDA(
__device__ __forceinline__ void run_phase(const u32* const (&weights)[kProducts], const u16* const (&scale_bias)[kProducts],
                                          const u16* x, const Outputs& outputs, float* partials, u32* counters,
                                          long long worker, int lane) {
  const long long begin = share_begin(worker), end = share_begin(worker + 1);
#pragma unroll 1
  for (long long position = begin; position < end;) {
    const long long item = position / kIterations;
    const int first = (int)(position - item * kIterations);
    const int last = (int)(min(end, (item + 1) * kIterations) - item * kIterations);
    float acc[kProducts][1][kRowHalves][4];
#pragma unroll
    for (int p = 0; p < kProducts; ++p)
#pragma unroll
      for (int h = 0; h < kRowHalves; ++h) acc[p][0][h][0] = acc[p][0][h][1] = acc[p][0][h][2] = acc[p][0][h][3] = 0.0f;
    accumulate<kProducts>(acc, weights, scale_bias, x, nullptr, 0, lane, (int)item, first, last, nullptr, false);
    float piece[kProducts][kRowHalves][4];
#pragma unroll
    for (int p = 0; p < kProducts; ++p)
#pragma unroll
      for (int h = 0; h < kRowHalves; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) piece[p][h][e] = acc[p][0][h][e];
    finish_piece(piece, item, worker, partials, counters, outputs, lane);
    position = item * kIterations + last;
  }
}
)CUDA";

std::int64_t tiles_of(const GemvKernelConfig& config) { return (config.out_features + 15) / 16; }
std::int64_t iterations_of(const GemvKernelConfig& config) {
  const int columns = config.format.columns_per_iteration();
  return (config.in_features + columns - 1) / columns;
}

// The most warps whose shares meet one tile (the partial slots per tile), as finish_piece counts them.
std::int64_t max_pieces(const GemvKernelConfig& config, std::int64_t warps) {
  const std::int64_t iterations = iterations_of(config), positions = tiles_of(config) * iterations;
  auto owner = [&](std::int64_t position) { return ((position + 1) * warps - 1) / positions; };
  std::int64_t most = 1;
  for (std::int64_t tile = 0; tile < tiles_of(config); ++tile) {
    most = std::max(most, owner((tile + 1) * iterations - 1) - owner(tile * iterations) + 1);
  }
  return most;
}

std::int64_t partial_floats(const GemvKernelConfig& config, std::int64_t warps) {
  return tiles_of(config) * max_pieces(config, warps) * config.epilogue.product_count() * 16 * config.rows;
}

// A phase's namespace, for either partition: the problem's constants as `view` has them (the
// mainloop's view of the config: one warp a piece for warp pieces, the stage's own for stage
// blocks) and `splits` (gemv_register_constants), the format helpers, x ready after the previous
// kernel (phase 1) or the grid barrier (phase 2), the register mainloop and `config`'s epilogue,
// then the partition's `body`.
std::string phase_namespace(std::string_view name, const GemvKernelConfig& config, const GemvKernelConfig& view,
                            int splits, bool x_written_in_kernel, std::string_view body) {
  std::string source = fmt::format("\n// ---------------- {}: {}\nnamespace {} {{\n", name, config.to_string(), name);
  source += gemv_problem_constants(view, x_written_in_kernel);
  source += gemv_register_constants(view, splits);
  source += gemv_format_helpers();
  source += x_written_in_kernel ? activations_after_grid_barrier : gemv_activations_after_previous_kernel();
  source += gemv_register_mainloop();
  source += "\n// The op table's device functions (src/graph/op_registry.cpp), which epilogue expressions call.\n";
  source += cuda_elementwise_helpers();
  source += gemv_output_functions(config);
  source += body;
  return source + fmt::format("}}  // namespace {}\n", name);
}

// A warp-pieces phase: the mainloop one warp a piece, the stream-K join, run_phase.
std::string phase_source(std::string_view name, const GemvKernelConfig& config, bool x_written_in_kernel,
                         std::int64_t warps) {
  GemvKernelConfig alone = config;  // the mainloop's view: one warp per piece
  alone.warps_per_block = 1;
  const std::string body = fmt::format(
      "constexpr int kSlices = 1;\nconstexpr int kSliceIterations = kIterations;\n"
      "constexpr long long kPositions = (long long)kTileCount * kIterations;\n"
      "constexpr long long kTotalWarps = {};\nconstexpr int kMaxPieces = {};\nconstexpr int kPartialFloats = 16 * kM;\n",
      warps, max_pieces(config, warps)) + std::string(gemv_stream_k_join()) + std::string(phase_body);
  return phase_namespace(name, config, alone, 0, x_written_in_kernel, body);
}

// A phase's parameters in gemv.h's order, each prefixed; `x` and `out` are named by the caller
// (the hidden state is one phase's out and the other's x: neither is __restrict__).
std::string phase_parameters(const GemvKernelConfig& config, std::string_view prefix, std::string_view x,
                             std::string_view out) {
  std::string text;
  for (int p = 0; p < config.epilogue.product_count(); ++p) {
    text += fmt::format("    const u32* __restrict__ {}_weights{}, ", prefix, p);
    if (config.format.is_affine()) text += fmt::format("const u16* __restrict__ {}_scale_bias{}, ", prefix, p);
    text += "\n";
  }
  text += fmt::format("    {},\n", x);
  // The norm's weight right after x (gemv.h's order; only the stage-blocks partition takes a normalized phase).
  if (config.x_rms_norm_eps) {
    text += fmt::format("    const u16* __restrict__ {}_x_norm_weight,  // [K], the RMSNorm's weight\n", prefix);
  }
  const std::vector<GemvEpilogue::TensorInput> tensors = config.epilogue.tensor_inputs();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    text += fmt::format("    const u16* __restrict__ {}_tensor{},  // {}\n", prefix, i, codegen_detail::comment_text(tensors[i].name));
  }
  return text + fmt::format("    {},\n", out);
}

// The call of one phase with its arguments bound: `weights`, `scale_bias` and `outputs` from the
// kernel's parameters (named by `prefix`), then `call`, the phase's entry with its arguments.
std::string phase_call(const GemvKernelConfig& config, std::string_view prefix, std::string_view out,
                       std::string_view call) {
  const int products = config.epilogue.product_count();
  const bool affine = config.format.is_affine();
  std::string text = "  {\n";
  text += fmt::format("    const u32* const weights[{}] = {{{}_weights0{}}};\n", products, prefix,
                      products == 2 ? fmt::format(", {}_weights1", prefix) : "");
  if (affine) {
    text += fmt::format("    const u16* const scale_bias[{}] = {{{}_scale_bias0{}}};\n", products, prefix,
                        products == 2 ? fmt::format(", {}_scale_bias1", prefix) : "");
  } else {
    text += fmt::format("    const u16* const scale_bias[{}] = {{nullptr{}}};\n", products, products == 2 ? ", nullptr" : "");
  }
  text += fmt::format("    {}::Outputs outputs;\n", prefix);
  for (std::size_t i = 0; i < config.epilogue.tensor_inputs().size(); ++i) {
    text += fmt::format("    outputs.tensor{} = {}_tensor{};\n", i, prefix, i);
  }
  text += fmt::format("    outputs.out = {};\n", out);
  return text + fmt::format("    {}::{};\n  }}\n", prefix, call);
}

// What both partitions' kernels begin with: the generator's line, kHalf (the tensor-core helpers
// read it) and kBlocks (the barrier), `constants` of the partition's own, the helpers and the
// barrier, the phases' namespaces, then the entry up to its body: `parameters` (both phases') and
// the workspace last.
std::string persistent_kernel_head(const PersistentMlpConfig& config, const std::string& kernel_name, std::int64_t blocks,
                                   std::string_view constants, const std::string& phases, const std::string& parameters) {
  std::string source = fmt::format("// Generated by metile (src/codegen/gemv_persistent.cpp): {}\n", config.to_string());
  source += fmt::format("constexpr bool kHalf = {};\nconstexpr int kBlocks = {};\n",
                        config.gate_up.format.activation == DType::f16 ? "true" : "false", blocks);
  source += constants;
  source += codegen_detail::tensor_core_device_helpers();
  source += gemv_arrival_wait();
  source += grid_barrier;
  source += phases;
  source += fmt::format("\nextern \"C\" __global__ void __launch_bounds__({}, {}) {}(\n", config.warps_per_block * 32,
                        config.blocks_per_multiprocessor, kernel_name);
  return source + parameters + "    float* __restrict__ workspace) {\n";
}

// ---------------------------------------------------------------- stage blocks
// One phase of the stage_blocks partition: the stage kernel's problem, its helpers and mainloop, and
// its body (gemv_unit_loop_body) as run_units(block, grid), in a namespace of its own.
std::string stage_phase_source(std::string_view name, const GemvKernelConfig& config, bool x_written_in_kernel) {
  const std::string body = R"CUDA(
// The stage kernel's body for the units block, block + grid, ... of this phase (a block of a
// split-K phase may take several; __syncthreads between them, kUnitLoop).
constexpr bool kUnitLoop = true;
__device__ __forceinline__ void run_units(const u32* const (&weights)[kProducts], const u16* const (&scale_bias)[kProducts],
                                          const u16* x, const u16* x_norm_weight, const Outputs& outputs,
                                          float* workspace, int entry_first_unit, int entry_unit_stride) {
)CUDA" + gemv_unit_loop_body() + "}\n";
  return phase_namespace(name, config, config, config.k_splits, x_written_in_kernel, body);
}

// The call of a stage phase's run_units for this block, with its arguments bound.
std::string stage_phase_call(const GemvKernelConfig& config, std::string_view prefix, std::string_view x,
                             std::string_view out, std::string_view workspace) {
  return phase_call(config, prefix, out,
                    fmt::format("run_units(weights, scale_bias, {}, {}, outputs, {}, (int)blockIdx.x, (int)gridDim.x)", x,
                                config.x_rms_norm_eps ? fmt::format("{}_x_norm_weight", prefix) : "nullptr", workspace));
}

GemvKernelSource generate_stage_blocks_mlp_kernel(const PersistentMlpConfig& config) {
  const std::int64_t blocks = std::int64_t{config.multiprocessors} * config.blocks_per_multiprocessor;
  // Each phase as its own stage kernel would be: its workspace (split-K partials and counters) and shared memory.
  const GemvKernelSource gate_up_alone = generate_gemv_kernel(config.gate_up);
  const GemvKernelSource down_alone = generate_gemv_kernel(config.down);
  const std::uint64_t gate_up_workspace = (gate_up_alone.workspace_bytes + 15) / 16 * 16;
  const std::uint64_t down_workspace = (down_alone.workspace_bytes + 15) / 16 * 16;

  GemvKernelSource result;
  const std::uint64_t hash = fnv1a_64(config.to_string() + "|" + gate_up_alone.kernel_name + "|" + down_alone.kernel_name);
  result.kernel_name = fmt::format("metile_persistent_mlp_blocks_{}_m{}_h{}_i{}_w{}b{}g{}_{:016x}",
                                   gemv_format_tag(config.gate_up.format), config.gate_up.rows, config.gate_up.in_features,
                                   config.gate_up.out_features, config.warps_per_block, config.blocks_per_multiprocessor,
                                   blocks, hash);
  std::string source = persistent_kernel_head(
      config, result.kernel_name, blocks, "",
      stage_phase_source("gate_up", config.gate_up, false) + stage_phase_source("down", config.down, true),
      phase_parameters(config.gate_up, "gate_up", "const u16* __restrict__ gate_up_x", "u16* hidden_out") +
          phase_parameters(config.down, "down", "const u16* hidden_in", "u16* __restrict__ out"));
  source += fmt::format(
      "  // workspace: each phase's split-K partials and counters (as its stage kernel lays them out), the barrier\n"
      "  float* const gate_up_workspace = workspace;\n  float* const down_workspace = workspace + {};\n"
      "  u32* const barrier = reinterpret_cast<u32*>(workspace + {});\n",
      gate_up_workspace / 4, (gate_up_workspace + down_workspace) / 4);
  // Each phase's body lets the next kernel of the stream launch (griddepcontrol.launch_dependents) at
  // its start, as the stage kernels do. That cannot take SMs this grid still needs: a dependent
  // launches only once every block of this grid has triggered, that is, once all of them run.
  source += "  join_grid_barrier(barrier);\n";
  source += stage_phase_call(config.gate_up, "gate_up", "gate_up_x", "hidden_out", "gate_up_workspace");
  source += R"CUDA(  // A block without a phase-1 unit has not waited for the previous kernel; it writes nothing before it.
  wait_for_previous_kernel();
  // Arrive: this block's hidden-state writes (its stores and the split joins it finished) are
  // visible before its arrival.
  arrive_at_grid_barrier(barrier);
)CUDA";
  source += stage_phase_call(config.down, "down", "hidden_in", "out", "down_workspace");
  source += "  leave_grid_barrier();\n}\n";
  result.source = std::move(source);
  result.grid_blocks = static_cast<unsigned>(blocks);
  result.block_threads = static_cast<unsigned>(config.warps_per_block * 32);
  result.static_shared_bytes = gate_up_alone.static_shared_bytes + down_alone.static_shared_bytes + 16;
  result.workspace_bytes = gate_up_workspace + down_workspace + 4 * grid_barrier_words(blocks);
  result.co_resident_blocks_per_multiprocessor = config.blocks_per_multiprocessor;
  return result;
}

}  // namespace

void PersistentMlpConfig::validate() const {
  gate_up.validate();
  down.validate();
  if (warps_per_block < 1 || warps_per_block > 16 || blocks_per_multiprocessor < 1 ||
      warps_per_block * blocks_per_multiprocessor > 32) {
    throw InputError(fmt::format("persistent MLP: {} warps x {} blocks per SM; 1..16 warps, at most 32 warps per SM",
                                 warps_per_block, blocks_per_multiprocessor));
  }
  if (multiprocessors < 1 || multiprocessors > 1024) {
    throw InputError(fmt::format("persistent MLP: multiprocessors must be 1..1024, not {}", multiprocessors));
  }
  if (down.epilogue.product_count() != 1) throw InputError("persistent MLP: the down phase multiplies one matrix");
  if (gate_up.format != down.format || gate_up.rows != down.rows || down.in_features != gate_up.out_features) {
    throw InputError(fmt::format("persistent MLP: down ({}) must read gate/up's output ({}): same format and rows, K = N",
                                 down.to_string(), gate_up.to_string()));
  }
  // The down phase reads the hidden state other blocks write in this launch (kXWrittenInKernel): its
  // x loads wait for the grid barrier, which x_with_batch's loads with the weights would not
  // (register_mainloop_body's static_assert).
  if (down.x_with_batch) {
    throw InputError("persistent MLP: the down phase's x is written in the kernel; it cannot travel with the batches "
                     "(x_with_batch)");
  }
  if (down.x_rms_norm_eps) throw InputError("persistent MLP: the down phase's x (the hidden state) is not normalized");
  if (partition == PersistentPartition::stage_blocks) {
    for (const GemvKernelConfig* phase : {&gate_up, &down}) {
      // What the stage kernel's body does inside one block and its split-K join; not what needs the
      // kernel to itself (a tile loop over the grid, the argmax's last block, dynamic shared rings,
      // the attention prologue's own barrier) or another output layout (splits, the rope cache).
      if (phase->mainloop != GemvMainloop::register_batches || phase->shared_stages != 0 || phase->argmax_rows ||
          phase->tile_loop_blocks_per_multiprocessor > 0 || !phase->output_splits.empty() || phase->rope_cache ||
          phase->attention) {
        throw InputError(fmt::format("persistent MLP (stage blocks): a phase is a register-batch stage without shared "
                                     "stages, argmax, tile loop, output splits, rope or attention, not {}",
                                     phase->to_string()));
      }
      if (phase->warps_per_block != warps_per_block) {
        throw InputError(fmt::format("persistent MLP (stage blocks): a phase has {} warps a block, the kernel {}",
                                     phase->warps_per_block, warps_per_block));
      }
      // The x prologue runs for a block's first unit only; shared group sums cover that unit's split.
      if (phase->shared_group_sums && phase->k_splits > 1) {
        throw InputError("persistent MLP (stage blocks): shared group sums are per split; a block's later units "
                         "would read the first one's");
      }
    }
    return;
  }
  for (const GemvKernelConfig* phase : {&gate_up, &down}) {
    if (phase->mainloop != GemvMainloop::register_batches || phase->shared_stages != 0 || phase->k_splits != 1 ||
        phase->shared_group_sums || phase->argmax_rows || !phase->output_splits.empty() || phase->tiles_per_block != 1 ||
        (phase->epilogue.product_count() == 2 && phase->schedule != GatedSchedule::register_resident)) {
      throw InputError(fmt::format("persistent MLP: a phase is the plain register mainloop (one tile, register-resident, "
                                   "no split-K, staging, group sums, argmax or split outputs), not {}",
                                   phase->to_string()));
    }
  }
  if (gate_up.x_rms_norm_eps) {
    throw InputError("persistent MLP (warp pieces): x normalized as it is loaded (the RMSNorm prologue) is not supported");
  }
  // Half products read x staged as scaled f16 by the block's x prologue (stage_half_x) and unscale the
  // sums in spill(); a phase's pieces run neither (accumulate without fill_sums, finish_piece), so
  // they would multiply whatever x_staged held.
  if (gate_up.half_products || down.half_products) {
    throw InputError("persistent MLP: half products (x staged by the block's prologue) are not supported");
  }
  if (blocks_per_multiprocessor > 4 || warps_per_block * blocks_per_multiprocessor > 16) {
    throw InputError(fmt::format("persistent MLP (warp pieces): {} warps x {} blocks per SM; 1..4 blocks, at most 16 "
                                 "warps per SM (128 registers per thread)",
                                 warps_per_block, blocks_per_multiprocessor));
  }
}

std::string PersistentMlpConfig::shape_name() const {
  if (partition == PersistentPartition::stage_blocks) {
    const auto phase = [](const GemvKernelConfig& c) {
      return fmt::format("f{} {}{}{}{}", c.iterations_in_flight, c.double_buffered ? "db" : "batch",
                         c.k_splits > 1 ? fmt::format(" split{}", c.k_splits) : "",
                         c.l2_prefetch_rounds > 0 ? fmt::format(" prefetch{}", c.l2_prefetch_rounds) : "",
                         c.half_products ? " half" : "");
    };
    return fmt::format("persistent blocks w{} b{} {} + {}", warps_per_block, blocks_per_multiprocessor, phase(gate_up),
                       phase(down));
  }
  return fmt::format("persistent w{} b{} f{}{} f{}{}", warps_per_block, blocks_per_multiprocessor,
                     gate_up.iterations_in_flight, gate_up.double_buffered ? "db" : "", down.iterations_in_flight,
                     down.double_buffered ? "db" : "");
}

std::string PersistentMlpConfig::to_string() const {
  return fmt::format("{} grid={}x{} | gate_up {} | down {}", shape_name(), multiprocessors, blocks_per_multiprocessor,
                     gate_up.to_string(), down.to_string());
}

GemvKernelSource generate_persistent_mlp_kernel(const PersistentMlpConfig& config) {
  config.validate();
  if (config.partition == PersistentPartition::stage_blocks) return generate_stage_blocks_mlp_kernel(config);
  const std::int64_t blocks = std::int64_t{config.multiprocessors} * config.blocks_per_multiprocessor;
  const std::int64_t warps = blocks * config.warps_per_block;
  const std::int64_t gate_up_partials = partial_floats(config.gate_up, warps);
  const std::int64_t down_partials = partial_floats(config.down, warps);

  GemvKernelSource result;
  const std::uint64_t hash = fnv1a_64(config.to_string() + "|" + config.gate_up.epilogue.cuda_expression() + "|" +
                                      config.down.epilogue.cuda_expression());
  result.kernel_name = fmt::format("metile_persistent_mlp_{}_m{}_h{}_i{}_w{}b{}g{}_f{}{}f{}{}_e{:08x}",
                                   gemv_format_tag(config.gate_up.format), config.gate_up.rows, config.gate_up.in_features,
                                   config.gate_up.out_features, config.warps_per_block, config.blocks_per_multiprocessor,
                                   blocks, config.gate_up.iterations_in_flight, config.gate_up.double_buffered ? "d" : "",
                                   config.down.iterations_in_flight, config.down.double_buffered ? "d" : "",
                                   hash & 0xFFFFFFFFu);
  std::string source = persistent_kernel_head(
      config, result.kernel_name, blocks,
      fmt::format("constexpr int kBlockWarps = {};\n[[maybe_unused]] constexpr int kBlocksPerMultiprocessor = {};\n", config.warps_per_block,
                  config.blocks_per_multiprocessor),
      phase_source("gate_up", config.gate_up, false, warps) + phase_source("down", config.down, true, warps),
      phase_parameters(config.gate_up, "gate_up", "const u16* __restrict__ gate_up_x", "u16* hidden_out") +
          phase_parameters(config.down, "down", "const u16* hidden_in", "u16* __restrict__ out"));
  source += fmt::format(
      "  // workspace: gate_up partials, down partials, the tiles' counters of both phases, the barrier\n"
      "  float* const gate_up_partials = workspace;\n  float* const down_partials = workspace + {};\n"
      "  u32* const gate_up_counters = reinterpret_cast<u32*>(workspace + {});\n"
      "  u32* const down_counters = gate_up_counters + gate_up::kTileCount;\n"
      "  u32* const barrier = down_counters + down::kTileCount;\n",
      gate_up_partials, gate_up_partials + down_partials);
  source += R"CUDA(  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long worker = (long long)blockIdx.x * kBlockWarps + warp;
  join_grid_barrier(barrier);
)CUDA";
  source += phase_call(config.gate_up, "gate_up", "hidden_out",
                       "run_phase(weights, scale_bias, gate_up_x, outputs, gate_up_partials, gate_up_counters, worker, lane)");
  source += R"CUDA(  // Launched as a programmatic dependent (Executable graphs launch every generated GEMV so), a warp
  // writes nothing before the previous kernel is done: a warp with a phase-1 piece waited in its
  // mainloop; one without waits here, before the block's first write (its arrival).
  wait_for_previous_kernel();
  // Arrive: this block's hidden-state writes (the joins it finished) are visible before its arrival.
  arrive_at_grid_barrier(barrier);
)CUDA";
  source += phase_call(config.down, "down", "out",
                       "run_phase(weights, scale_bias, hidden_in, outputs, down_partials, down_counters, worker, lane)");
  source += "  leave_grid_barrier();\n}\n";

  result.source = std::move(source);
  result.grid_blocks = static_cast<unsigned>(blocks);
  result.block_threads = static_cast<unsigned>(config.warps_per_block * 32);
  result.static_shared_bytes = 24;  // grid_release, last_to_arrive and the two unused group-sum floats
  result.workspace_bytes = static_cast<std::uint64_t>(
      (gate_up_partials + down_partials) * 4 +
      (tiles_of(config.gate_up) + tiles_of(config.down) + grid_barrier_words(blocks)) * 4);
  result.co_resident_blocks_per_multiprocessor = config.blocks_per_multiprocessor;
  return result;
}

namespace {
// A phase as both partitions' candidates start it: `warps` a block, one tile a block, batches in
// registers, the register-resident gated schedule, and none of the options a phase does not take.
void plain_register_phase(GemvKernelConfig& phase, int warps) {
  phase.mainloop = GemvMainloop::register_batches;
  phase.warps_per_block = warps;
  phase.tiles_per_block = 1;
  phase.k_splits = 1;
  phase.shared_stages = 0;
  phase.shared_group_sums = false;
  phase.schedule = GatedSchedule::register_resident;
  phase.tile_loop_blocks_per_multiprocessor = 0;
  phase.l2_prefetch_rounds = 0;
  phase.x_with_batch = false;
  phase.resident_blocks_per_multiprocessor = 0;
}

// The stage_blocks shapes: blocks of 4 warps, 7 or 6 to an SM (<= 72 or 80 registers a thread: the
// 4-bit gate/up winner `w4 f2 batch` takes 64 alone), each phase split along K into as many units
// as fill the grid once (at least a warp's iteration a split), so that no block takes two.
std::vector<PersistentMlpConfig> stage_blocks_candidates(const GemvKernelConfig& gate_up, const GemvKernelConfig& down,
                                                         int multiprocessors) {
  // down_prefetched: the down phase requests its unit's whole weights into L2 (l2_prefetch_rounds) before
  // the barrier, so that DRAM streams them during gate/up's tail and the barrier instead of after it.
  struct Shape {
    int blocks;
    int gate_up_depth;
    bool gate_up_double_buffered;
    int down_depth;
    bool down_double_buffered;
    bool down_prefetched;
  };
  constexpr int kWarps = 4;
  const std::vector<Shape> shapes = {
      {7, 2, false, 2, false, true}, {7, 2, false, 2, false, false}, {6, 2, false, 2, false, true}};
  std::vector<PersistentMlpConfig> candidates;
  for (const Shape& shape : shapes) {
    PersistentMlpConfig config;
    config.partition = PersistentPartition::stage_blocks;
    config.gate_up = gate_up;
    config.down = down;
    config.warps_per_block = kWarps;
    config.blocks_per_multiprocessor = shape.blocks;
    config.multiprocessors = multiprocessors;
    const std::int64_t grid = std::int64_t{multiprocessors} * shape.blocks;
    for (GemvKernelConfig* phase : {&config.gate_up, &config.down}) {
      const bool first = phase == &config.gate_up;
      plain_register_phase(*phase, kWarps);
      phase->iterations_in_flight = first ? shape.gate_up_depth : shape.down_depth;
      phase->double_buffered = first ? shape.gate_up_double_buffered : shape.down_double_buffered;
      const std::int64_t iterations = iterations_of(*phase);
      phase->k_splits = static_cast<int>(std::clamp<std::int64_t>(
          std::min(grid / tiles_of(*phase), iterations / (kWarps * phase->iterations_in_flight)), 1, 16));
    }
    // Every round of the unit (the budget holds all of down's weights: Llama-3-8B 4-bit's 33 MB).
    if (shape.down_prefetched) {
      config.down.l2_prefetch_rounds = gemv_l2_prefetch_rounds(config.down, multiprocessors, std::int64_t{1} << 40);
    }
    try {
      config.validate();
    } catch (const InputError&) {
      continue;
    }
    candidates.push_back(config);
  }
  return candidates;
}
}  // namespace

std::vector<PersistentMlpConfig> persistent_mlp_candidates(const GemvKernelConfig& gate_up, const GemvKernelConfig& down,
                                                           int multiprocessors) {
  // 16 warps per SM (the register kernels' best occupancy, notes/mlp_decode.md) as 2 blocks of 8, 4
  // of 4 or 1 of 16: at 128 registers per thread one double-buffered iteration per batch is what
  // fits without spilling (ptxas, 4-bit M = 1; M > 8 doubles the x fragments and accumulators, so
  // there the batch is not double-buffered); and 8 warps per SM with two-iteration batches (~200
  // registers). A double-buffered down phase issues its first batch before the barrier.
  struct Shape {
    int warps, blocks, gate_up_depth, down_depth;
    bool double_buffered;
  };
  const bool two_halves = gate_up.rows > 8;
  const std::vector<Shape> shapes =
      two_halves ? std::vector<Shape>{{8, 2, 1, 1, false}, {4, 4, 1, 1, false}, {8, 1, 1, 2, true}, {16, 1, 1, 1, false}}
                 : std::vector<Shape>{{8, 2, 1, 1, true}, {4, 4, 1, 1, true}, {8, 1, 2, 2, true}, {16, 1, 1, 1, true}};
  // The stage-blocks shapes first (the lowering races the first gemv_lowering_persistent_shapes), for one
  // activation row: under their 72-80 register bounds more rows' accumulators spill (Llama-3.2-1B's MLP at
  // M = 16 parked 680-732 bytes; at M = 1 the decode steps' shapes park at most 160).
  std::vector<PersistentMlpConfig> candidates;
  if (gate_up.rows == 1) candidates = stage_blocks_candidates(gate_up, down, multiprocessors);
  for (const Shape& shape : shapes) {
    PersistentMlpConfig config;
    config.gate_up = gate_up;
    config.down = down;
    config.warps_per_block = shape.warps;
    config.blocks_per_multiprocessor = shape.blocks;
    config.multiprocessors = multiprocessors;
    config.gate_up.iterations_in_flight = shape.gate_up_depth;
    config.down.iterations_in_flight = shape.down_depth;
    for (GemvKernelConfig* phase : {&config.gate_up, &config.down}) {
      plain_register_phase(*phase, shape.warps);
      phase->double_buffered = shape.double_buffered;
    }
    try {
      config.validate();
    } catch (const InputError&) {
      continue;
    }
    const bool repeated = std::any_of(candidates.begin(), candidates.end(), [&](const PersistentMlpConfig& other) {
      return other.shape_name() == config.shape_name();
    });
    if (!repeated) candidates.push_back(config);
  }
  return candidates;
}

}  // namespace metile
