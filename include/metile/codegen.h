// metile codegen: turns a fusion region, or a single node, into CUDA C++ source (docs/architecture.md,
// "Lowering"). Pure text generation: no driver, no GPU. The CUDA runtime compiles the source
// with NVRTC and binds the parameters in the order given here.
//
// Row regions (elementwise ops, row reductions rms_norm/layer_norm/softmax, causal_mask, cast)
// become one kernel: each row is read once with 16-byte vector loads where the row length and
// alignment allow, held in registers when it fits, reduced with warp shuffles and shared memory
// in f32, and every value that leaves the region is stored from the same kernel.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "metile/decision.h"
#include "metile/fusion.h"
#include "metile/graph.h"

namespace metile {

struct KernelLaunchShape {
  std::uint32_t grid_x = 1, grid_y = 1, grid_z = 1;
  std::uint32_t block_x = 1;
  std::uint32_t shared_memory_bytes = 0;  // dynamic shared memory (static shared memory is in the source)
};

// One pointer argument of a generated kernel, in order.
struct KernelParameter {
  enum class Kind : std::uint8_t {
    input,    // a graph value read by the kernel
    output,   // a graph value written by the kernel
    scratch,  // a device buffer the caller allocates (scratch_bytes), e.g. dequantized weights
  };
  Kind kind = Kind::input;
  ValueId value = -1;  // graph value for input/output; -1 for scratch
  std::string name;    // the C++ parameter name in the source
  std::int64_t scratch_bytes = 0;
};

struct GeneratedKernel {
  std::string kernel_name;  // the extern "C" symbol
  std::string source;       // complete CUDA C++ translation unit
  KernelLaunchShape launch;
  std::vector<KernelParameter> parameters;
  std::string summary;  // one line: "row kernel 1x2048 f16: 8-wide vectors, 64 threads/row, 4 vectors/thread, ..."
};

// Tuning knobs of the row kernel; 0 means "chosen from the row length".
struct RowKernelOptions {
  int threads_per_row = 0;  // a power of two, 1..1024
  int rows_per_block = 0;   // only when threads_per_row <= 32
  std::string variant_name;  // appended to the kernel name and summary ("wide", "narrow")
  bool streaming_cache_hints = false;  // row loads/stores marked evict-first (ld.global.cs / st.global.cs)
  // Softmax max and sum in one pass over the row (running max and normalizer merged by the
  // stable_weighted_softmax law's terms) instead of a max pass and a sum pass.
  bool online_softmax = false;
  bool operator==(const RowKernelOptions&) const = default;
};

// Whether generate_region_kernel can lower the region; when not, the reason says why
// ("node 'y' (matmul) is a contraction, not a row op").
Decision row_region_decision(const ComputeGraph& graph, const FusionRegion& region);

// The region as one row kernel. Throws InputError (naming the node) when the region is not a row region.
// Parameters: the region's inputs (in region.inputs order), then its outputs (region.outputs order).
GeneratedKernel generate_region_kernel(const ComputeGraph& graph, const FusionRegion& region,
                                       const RowKernelOptions& options = {});

// The default options first, then alternatives worth timing (another block shape), without duplicates.
std::vector<RowKernelOptions> row_kernel_variants(const ComputeGraph& graph, const FusionRegion& region);

// A region holding exactly one node, with its inputs filled in from the graph and all its outputs.
FusionRegion single_node_region(const ComputeGraph& graph, NodeId node);

// The native (unfused) kernel of one non-contraction node: elementwise and row-reduction ops through
// the row generator, layout and decode-step ops (reshape, transpose, rope, embedding,
// quantized_embedding, position_mask, kv_cache_write) through simple index kernels, argmax through
// one block per row.
// Throws InputError for matmul / quantized_matmul (those run through cuBLASLt).
GeneratedKernel generate_node_kernel(const ComputeGraph& graph, NodeId node);

// kv_cache_write's native kernel. Copied (in_place false, what generate_node_kernel gives): the
// whole output from the cache with the new rows in it; parameters cache, update, positions, out.
// In place (the output shares the cache's buffer, alias_of in graph.h): only the S new rows of
// every head are written; parameters update, positions, out.
GeneratedKernel generate_kv_cache_write_kernel(const ComputeGraph& graph, NodeId node, bool in_place);

// A rope_kv_cache region (src/fusion/rules.cpp) read back from its roles and nodes: q, k and v
// [S, H·D] (the projections), each split into heads ([S, H, D] → [H, S, D]); rope on q and k with
// one set of attributes; k rotated and v written into k_cache and v_cache [Hkv, T, D] at positions.
// decision says why a region does not have exactly this structure.
struct RopeCacheRegion {
  Decision decision = Decision::allow();
  ValueId q = -1, k = -1, v = -1, positions = -1, k_cache = -1, v_cache = -1;  // inputs
  ValueId q_rotated = -1, k_cache_out = -1, v_cache_out = -1;                  // outputs
  NodeId rope = -1;  // q's rope node (its attributes are k's too)
  std::int64_t steps = 0, q_heads = 0, kv_heads = 0, head_dim = 0, capacity = 0;
  DType dtype = DType::f32;
};
RopeCacheRegion rope_cache_region(const ComputeGraph& graph, const FusionRegion& region);

// The region as one grid-stride kernel, each element computed as the native rope and cache-write
// kernels compute it (so the results are the same bits): q rotated, then each cache. A cache in
// place (its output shares its input's buffer, alias_of) gets only its S new rows; otherwise the
// whole cache is copied with the rows in it. Parameters: q, k, v, positions, k_cache, v_cache,
// q rotated, k_cache_out, v_cache_out. No value name enters the source: every layer shares it.
GeneratedKernel generate_rope_cache_kernel(const ComputeGraph& graph, const RopeCacheRegion& problem, bool k_in_place,
                                           bool v_in_place);

// For a quantized_matmul node: expands the packed affine weights to dense row-major weights for
// cuBLASLt to multiply with transpose_right, without rounding them to x's dtype: with f16/bf16 x
// each weight is two values, hi and lo ([N, 2K]), and x is written twice ([M, 2K]), so one GEMM
// over 2K columns sums both in f32; with f32 x the weights are [N, K] and x is read as it is.
// Parameters: packed, scales, biases, x (inputs), then the weights and the doubled x (scratch).
GeneratedKernel generate_dequantize_kernel(const ComputeGraph& graph, NodeId quantized_matmul_node);

// The CUDA C++ spelling of a dtype's storage type ("__half", "__nv_bfloat16", "float", "int", ...).
std::string cuda_storage_type(DType dtype);

}  // namespace metile
