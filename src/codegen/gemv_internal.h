// Pieces shared by the two GEMV mainloop generators (gemv_mainloop.cpp: register batches,
// gemv_streamed.cpp: bulk copies into shared-memory stages), private to the codegen module.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "metile/gemv.h"

namespace metile::gemv_detail {

// `value` rounded up to a multiple of `multiple` (positive).
inline std::int64_t round_up(std::int64_t value, std::int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// The device code both mainloops start from (after the problem constants): the tensor-core
// helpers every such generator shares (codegen_internal.h: types, mma, component), then the
// derived constants of the weight layout, dtype conversions, activations and the affine
// code-to-fragment conversion. Defined in gemv_device_helpers.cpp.
std::string gemv_device_helpers();
// The same without the tensor-core helpers (for a kernel that holds several GEMV problems, each in
// a namespace of its own after one copy of those helpers: the persistent decode MLP).
std::string gemv_format_helpers();

// "bf16", "bf16_a4g64": the format part of a kernel name.
std::string gemv_format_tag(const GemvWeightFormat& format);

// The hash of what a kernel does after its reduction (the epilogue and the output splits), part
// of every kernel name.
std::uint64_t gemv_epilogue_hash(const GemvKernelConfig& config);

// The constants every generated GEMV begins with (kM, kN, kK, kBits, kGroup, kHalf,
// kColumnsPerIteration, kProducts, kWarps, kXWrittenInKernel). `x_written_in_kernel`: x is written
// by other blocks of the same kernel before a grid-wide barrier (the persistent decode MLP's down
// phase), so it is read through L2 (ld.global.cg) instead of the read-only path (.nc needs data that
// stays unchanged for the kernel's lifetime).
std::string gemv_problem_constants(const GemvKernelConfig& config, bool x_written_in_kernel = false);

// `activations_ready(x)` for a kernel whose x an earlier kernel on the stream wrote: the
// programmatic-dependent-launch wait (gemv_mainloop.cpp; the persistent MLP's gate/up phase uses it
// too, its down phase waits for the grid barrier instead).
std::string_view gemv_activations_after_previous_kernel();

// `wait_for_arrivals(counter, target)`: spins (ld.acquire.gpu, a short sleep between reads) until a
// counter other blocks bump reaches `target`. Microseconds; seconds means the blocks are not
// co-resident after all (which LoadedGemv::load rules out): the kernel traps, an error the host
// sees, rather than hang. For the kernels whose blocks wait for one another (the persistent decode
// MLP's grid barrier, the attention prologue). Defined in gemv_device_helpers.cpp.
std::string_view gemv_arrival_wait();

// `activations_ready(x)` for a kernel that computes its own x by attention first
// (GemvKernelConfig::attention, gemv_attention.cpp): the wait for the previous kernel, blocks
// 0 .. kv_heads - 1 each attend over one KV head and write its rows into x, then every block waits
// for all of them. Also the `attention_arguments` the kernel entry sets and the counters' re-arming.
std::string gemv_attention_prologue(const GemvKernelConfig& config);
// Static shared memory the attention prologue adds (q and one chunk of scores per block).
std::int64_t gemv_attention_shared_bytes(const GemvKernelConfig& config);

// The register-batch mainloop (gemv_mainloop.cpp): Batch, the loads, compute_batch,
// accumulate<P>(acc, weights, scale_bias, x, warp, lane, first_tile, begin, end, ring, fill_sums),
// spill. It reads x only through `activations_ready(x)`, which the generator defines before it, and
// needs the constants gemv_register_constants emits (`splits` 0: accumulate takes its iteration
// bounds from the caller).
std::string_view gemv_register_mainloop();
std::string gemv_register_constants(const GemvKernelConfig& config, int splits);

// The register-batch kernel's body, from its `partial` sums to the end of its loop over units (a
// unit: a tile block and a K split): accumulate, join the warps, store or join the splits. Needs
// in scope what the kernel entry binds (weights, scale_bias, x, x_norm_weight, outputs, workspace)
// and entry_first_unit, entry_unit_stride and kUnitLoop (a __syncthreads between units). The
// kernel entry (gemv_mainloop.cpp) and each phase of the stage-blocks persistent MLP
// (gemv_persistent.cpp) wrap it.
std::string gemv_unit_loop_body();

// The stream-K join both persistent kernels share (gemv_streamed.cpp): share_begin(warp),
// owner(position), store_tile and finish_piece(acc, item, warp, partials, counters, outputs, lane):
// a warp's piece of a tile is stored directly when it is the whole tile, else written as fp32
// partials to its slot; the last piece to arrive adds every slot in (slice, warp) order,
// applies the epilogue and re-arms the tile's counter. Needs kSlices, kSliceIterations,
// kPositions, kTotalWarps, kMaxPieces and kPartialFloats (16 * kM) besides the problem constants,
// and store_output (gemv_output_functions).
std::string_view gemv_stream_k_join();

// The `extern "C" __global__` entry both mainloops share, up to its body: the parameters in the
// order GemvKernelSource documents (each matrix's weights and affine scale_bias, x, the epilogue
// tensors, out, then `extra_parameters` such as the streamed workspace) and the kProducts-long
// `weights` / `scale_bias` arrays the mainloop bodies index.
std::string gemv_kernel_entry(const GemvKernelConfig& config, const std::string& kernel_name,
                              std::string_view extra_parameters);

// `struct Outputs` (the epilogue tensors and out) and `store_output(outputs, m, n, acc0, acc1)`,
// which applies the epilogue to one output; both mainloops store through it (after the op table's
// device functions). gemv_outputs_binding: the kernel-entry lines that fill `outputs`.
std::string gemv_output_functions(const GemvKernelConfig& config);
std::string gemv_outputs_binding(const GemvKernelConfig& config);

// The register mainloop stages the normalized x rows in shared memory (kXStaged) when the GEMV
// normalizes x (x_rms_norm_eps) and M x K bf16 values fit kMaxStagedXBytes: every decode row (M = 1,
// K <= 8192), not a prefill chunk of 16 rows of 4096; and with half_products, within kMaxHalfStagedXBytes.
constexpr std::int64_t kMaxStagedXBytes = 16 * 1024;
// half_products stages x whatever the norm (the f16 products read nothing else): up to K = 16384 at
// M = 1 (Llama-3-8B's down projection, 14336).
constexpr std::int64_t kMaxHalfStagedXBytes = 32 * 1024;
bool x_staged_in_shared_memory(const GemvKernelConfig& config);
// Static shared memory the x normalization takes (GemvKernelConfig::x_rms_norm_eps: per warp and
// row a partial sum of squares, per row the scale, and the staged x); a few bytes when x is not
// normalized.
std::int64_t x_norm_shared_bytes(const GemvKernelConfig& config);

// The streamed mainloop (gemv_streamed.cpp).
void validate_streamed(const GemvKernelConfig& config);  // InputError when it cannot be built
GemvKernelSource generate_streamed_gemv_kernel(const GemvKernelConfig& config);
std::vector<GemvKernelConfig> streamed_tuning_candidates(const GemvKernelConfig& base);

}  // namespace metile::gemv_detail
