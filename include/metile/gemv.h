// metile GEMV codegen: the decode-time matrix-vector kernels (1..16 activation rows) as CUDA
// C++ source, plus the weight layouts they read (docs/architecture.md, "Lowering"). Pure source generation
// and host-side repacking: no driver, no GPU, no runtime (the decode-MLP model is in
// decode_mlp.h, its CUDA executor in decode_mlp_executor.h).
//
//   * weight formats and repacking: dense f16/bf16 matrices are read in place; MLX affine
//     matrices (quant.h) are repacked once at load into the fragment order the kernels read;
//   * kernel generation (src/codegen/gemv_*): one GEMV mainloop skeleton (tensor-core
//     m16n8k16 products, the weight tile as the A operand and the activation rows as B) plus
//     an epilogue expression built from the region's elementwise ops. Changing the epilogue
//     changes one generated expression, never the mainloop.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "metile/graph.h"
#include "metile/quant.h"

namespace metile {

// ---------------------------------------------------------------- weight formats
// How a GEMV's weight W [N, K] is stored. Activations x [M, K], scales, biases, dense
// weights and outputs are all in `activation` (f16 or bf16).
struct GemvWeightFormat {
  int bits = 16;        // 16: dense in the activation dtype; 4 or 8: MLX affine
  int group_size = 0;   // 32, 64 or 128 when affine; 0 when dense
  DType activation = DType::bf16;

  static GemvWeightFormat dense(DType activation) { return {16, 0, activation}; }
  static GemvWeightFormat affine(int bits, int group_size, DType activation) {
    return {bits, group_size, activation};
  }
  bool is_affine() const { return bits != 16; }
  AffineQuantization quantization() const { return {bits, group_size}; }
  void validate() const;        // throws InputError naming the bad field
  std::string to_string() const;  // "bf16", "bf16 affine4 g64"
  // Columns one mainloop iteration consumes: 32 dense, max(64, group) 8-bit, 128 4-bit.
  // Repacked matrices pad K to a multiple of it.
  int columns_per_iteration() const;
  // Columns one 16-byte load per lane covers (a warp's 512 bytes, half of a 16-row tile's 1 KiB):
  // 32 dense, 64 8-bit, 128 4-bit.
  int columns_per_load() const;
  bool operator==(const GemvWeightFormat&) const = default;
};

// An affine matrix in the order the generated kernel reads it. Per 16-row tile and per
// block of 32·(32/bits) columns, the 32 lanes of a warp each load one 16-byte vector for rows
// 0..7 of the tile and one for rows 8..15; lane (g = lane/4, t = lane%4) finds in it, for
// every 32-column chunk c, row g's columns 32c + 8t .. 32c + 8t + 7, with the nibbles (bytes)
// of each word shuffled so that one shift and mask yields the m16n8k16 A-fragment pairs.
// Scales and biases sit beside each other, per tile and group: [scale, bias] of row g and of
// row g + 8 in one 8-byte vector. Rows pad to 16 and columns to columns_per_iteration() with
// zero codes, scales and biases (a zero scale and bias make a padded weight exactly 0).
struct RepackedAffineMatrix {
  GemvWeightFormat format;
  std::int64_t rows = 0, columns = 0;                // N, K of the original matrix
  std::int64_t padded_rows = 0, padded_columns = 0;  // multiples of 16 and columns_per_iteration()
  std::vector<std::uint32_t> words;                  // padded_rows * padded_columns * bits / 32
  std::vector<std::uint16_t> scale_bias;             // padded_rows * (padded_columns / group) * 2
};

// Repacks `matrix` (its scales' dtype becomes the activation dtype). Throws InputError when
// the scales are not f16/bf16 or the format is not one the GEMV reads.
RepackedAffineMatrix repack_for_gemv(const QuantizedMatrix& matrix);
// The exact inverse: the MLX-layout matrix the repacked one came from.
QuantizedMatrix unpack_from_gemv(const RepackedAffineMatrix& repacked);

// Sibling weights stacked by rows for one GEMV (rule sibling_contractions: q, k and v [N_p, K] as
// one [sum N_p, K]; MLX codes, scales and biases alike): tensors of one dtype and shape but the
// first axis, concatenated along it. Throws InputError when there are none or they do not stack.
HostTensor stack_rows(std::span<const HostTensor> parts);
// Rows of `tensor` in `order` (result row r is row order[r]); InputError unless order names
// shape[0] rows that exist.
HostTensor gather_rows(const HostTensor& tensor, std::span<const std::int64_t> order);

// How the affine mainloops turn a repacked word into m16n8k16 A-fragment registers: pair j (0..3 at
// 4 bits, 0..1 at 8 bits) of a word becomes one 32-bit register of two activation-dtype values (f16
// for half products), (offset + c_j q_low, offset + c_j q_high), exactly, where the code scale c_j
// is 1 but for nibble_classes' odd pairs (16); the kernels fold the offset into the bias through
// sum(x) per group, and divide x by c_j at those columns. The generated kernels take their constants from here (gemv_device_helpers.cpp),
// and decode_affine_code_pair emulates the same bit operations on the host, so that tests can check
// every code value against the reference dequantization.
struct AffineCodeDecode {
  enum class Method : std::uint8_t {
    mask_or,       // (word >> shift j) & mask | magic: one lop3 per pair (the magic's exponent makes
                   // the masked code the low mantissa bits of offset + q), one shift per pair after the first
    byte_permute,  // one prmt per pair: the code bytes under the magic's exponent byte (8-bit f16)
    through_f32,   // 8-bit bf16 (7 mantissa bits cannot hold 128 + q for every q): per code one prmt
                   // into the f32 2^23 + q and one subtract, one cvt per pair
    nibble_classes,  // 4-bit f16 (half products): pairs 2i and 2i + 1 come from the word shifted by 8i
                     // (one shift a word, not three), the even pair masked to the low nibble of each
                     // 16-bit half (offset + q), the odd one to the next nibble (offset + 16 q: f16's 10
                     // mantissa bits hold both); x is divided by 16 at the odd pairs' columns
  };
  Method method = Method::mask_or;
  std::uint32_t mask = 0;      // mask_or, nibble_classes (its even pairs)
  std::uint32_t odd_mask = 0;  // nibble_classes: its odd pairs
  std::uint32_t magic = 0;     // mask_or, byte_permute, nibble_classes: the exponent bits of both halves
  int shift = 0;               // mask_or: bits from one pair to the next
  double offset = 0;           // each decoded value is offset + code_scale(pair) q
  // byte_permute: the prmt selector of pair j (bytes j and j + 2 of the word under the magic's byte).
  std::uint32_t selector(int pair) const;
  // c_j: 16 for nibble_classes' odd pairs, else 1.
  int code_scale(int pair) const;
};
// half_products: the decode of a kernel that multiplies in f16 whatever the activation dtype
// (GemvKernelConfig::half_products).
AffineCodeDecode affine_code_decode(int bits, DType activation, bool half_products = false);
// The fragment register the device computes for pair `pair` of `word` (the bits of two f16/bf16 values).
std::uint32_t decode_affine_code_pair(const AffineCodeDecode& decode, std::uint32_t word, int pair);

// ---------------------------------------------------------------- epilogues
// The per-output expression a GEMV applies after its reduction: a tree over the f32 dot
// products of the kernel's weight matrices ("accumulators"), extra tensors read at the output
// position ([M, N], or [N] broadcast over rows), constants and elementwise ops. Evaluated in
// f32; the result is rounded to the activation dtype when stored, and a `rounded` term rounds
// a value on the way, where the graph stored it in that dtype (from_graph inserts them).
class GemvEpilogue {
 public:
  // `op`: any other elementwise op of the op table (graph.h) that does not read its element's position.
  enum class Kind : std::uint8_t { accumulator, tensor, constant, add, subtract, multiply, scale, silu, gelu,
                                   gelu_tanh, exp, op, rounded };

  static GemvEpilogue accumulator(int product);                 // product 0: gate (or only), 1: up
  static GemvEpilogue tensor(std::string name, bool broadcast_rows = false);
  static GemvEpilogue constant(double value);
  static GemvEpilogue add(const GemvEpilogue& a, const GemvEpilogue& b);
  static GemvEpilogue subtract(const GemvEpilogue& a, const GemvEpilogue& b);
  static GemvEpilogue multiply(const GemvEpilogue& a, const GemvEpilogue& b);
  static GemvEpilogue scale(const GemvEpilogue& x, double factor);
  static GemvEpilogue silu(const GemvEpilogue& x);
  static GemvEpilogue gelu(const GemvEpilogue& x, bool tanh_approximation = false);
  static GemvEpilogue exp(const GemvEpilogue& x);
  // x rounded to `dtype` (f16 or bf16: the GEMV's activation dtype) and read back as f32: what an
  // unfused op writes to memory and the next op reads.
  static GemvEpilogue rounded(const GemvEpilogue& x, DType dtype);
  // x as a value stored in `dtype`: as computed for f32, rounded for f16/bf16.
  static GemvEpilogue stored_as(const GemvEpilogue& x, DType dtype);
  // Any other elementwise op of the op table that does not read its element's position (Kind::op).
  static GemvEpilogue elementwise(std::string op, Attributes attributes, const std::vector<GemvEpilogue>& operands);

  // The shapes the decode MLP uses. `stored`: the dtype the unfused ops would store gate, up, silu(gate)
  // and the projection in; f16/bf16 rounds them to it (what from_graph builds for such a graph), f32
  // keeps them as computed.
  static GemvEpilogue store() { return accumulator(0); }
  static GemvEpilogue swiglu(DType stored = DType::f32);
  static GemvEpilogue residual_add(std::string name = "residual", DType stored = DType::f32);

  // Builds the epilogue from a graph: walks back from `output` through elementwise nodes
  // (add, subtract, multiply, scale, silu, gelu, exp, and any op-table elementwise op that does
  // not read its element's position) to the values in `accumulators` (the
  // contractions' outputs, in product order) or to values computed elsewhere, which become
  // tensors named after the value. Every value inside the tree that the graph types in the
  // activation dtype is rounded to it (a `rounded` term), so the kernel computes what the unfused
  // ops compute, bit for bit up to the order of the dot products' sums; f32 values are not
  // rounded. Throws InputError naming the node that cannot be an epilogue op, a value of any other
  // dtype, or a tensor whose shape is neither the output's nor its last axis.
  static GemvEpilogue from_graph(const ComputeGraph& graph, ValueId output, std::span<const ValueId> accumulators);

  Kind kind() const;
  int product_count() const;  // 1 + the highest accumulator index used (at least 1)
  // Whether every rounded term rounds to `activation`: the generated code can round only to the
  // kernel's own activation dtype (GemvKernelConfig::validate refuses the others).
  bool rounds_only_to(DType activation) const;
  struct TensorInput {
    std::string name;
    bool broadcast_rows = false;
    bool operator==(const TensorInput&) const = default;
  };
  std::vector<TensorInput> tensor_inputs() const;  // distinct, first-use order: kernel arguments after x
  // A CUDA C++ f32 expression: accumulators are acc0, acc1; tensor i is read as tensor_value(i).
  // Each op is the op table's CUDA expression (its device functions: cuda_elementwise_helpers()).
  std::string cuda_expression() const;
  std::string to_string() const;  // "silu(acc0) * acc1"
  // Evaluates on the host in double with the op table's f64 math (`tensors` in tensor_inputs() order).
  double evaluate(std::span<const double> accumulators, std::span<const double> tensors) const;

 struct Term;  // one node of the expression tree (defined in gemv_epilogue.cpp)

 private:
  explicit GemvEpilogue(std::shared_ptr<const Term> node) : node_(std::move(node)) {}
  std::shared_ptr<const Term> node_;
};

// ---------------------------------------------------------------- kernels
// How a two-matrix (gate/up) kernel keeps its accumulators: both reductions live at once in
// registers, or the gate reduction finishes, spills to shared memory and the same registers
// then accumulate up.
enum class GatedSchedule : std::uint8_t { register_resident, scratch_spilled };
std::string_view gated_schedule_name(GatedSchedule schedule);

// How a GEMV gets its weights to the math.
//   register_batches (gemv_mainloop.cpp): one block per 16-row tile; each warp loads batches of
//     16-byte vectors into registers, then computes them.
//   streamed (gemv_streamed.cpp): a persistent grid; each warp owns an equal, contiguous share of
//     the (K slice, tile, iteration) space (stream-K), and its lane 0 streams the weights into a
//     private ring of shared-memory stages with bulk copies (cp.async.bulk, L2 evict-first) that
//     complete on mbarriers, `stages` deep, independently of the math. x and its per-group sums
//     are staged in shared memory once per block. A tile split between warps is joined through
//     fp32 partials in a workspace, in a fixed order, by the last warp to arrive.
enum class GemvMainloop : std::uint8_t { register_batches, streamed };
std::string_view gemv_mainloop_name(GemvMainloop mainloop);

// q, k and v made attention's inputs in the epilogue of their stacked GEMV (the qkv_rope_kv_cache
// region: the sibling contractions and rope_kv_cache as one kernel). The stacked rows are q's
// (q_heads x head_dim), k's and v's (kv_heads x head_dim each), output_splits {Hq·D, Hkv·D, Hkv·D};
// within every head of q and k the rows are reordered (gemv_rope_row_order) so that rotary pair
// (j, j + dims/2) sits in rows 2j and 2j + 1 of one 16-row tile. The epilogue rounds each row's
// value to the activation dtype (as the separate GEMV would store it), rotates the pairs at the
// step's positions as the rope kernel does (the same operations: the same bits), and writes q
// rotated [Hq, M, D], k rotated into the k cache [Hkv, capacity, D] and v into the v cache at
// row positions[m] (a position outside the cache, or named again by a later row, writes nothing:
// kv_cache_write's rule). The caches are written in place; the kernel takes the positions (i32
// [M]) after its outputs.
struct GemvRopeCacheEpilogue {
  std::int64_t q_heads = 0, kv_heads = 0, head_dim = 0, capacity = 0;
  Attributes rope;  // the rope op's attributes (dims, theta, the Llama 3 scaling)
  // The positions and the epilogue's tensors (the biases) are graph inputs that no kernel of the run
  // writes (the lowering checks the graph): each thread loads its output's and computes the rope
  // angle before griddepcontrol.wait, off the path after the mainloop's join. Otherwise right after it.
  bool inputs_before_wait = false;
  std::int64_t dims() const { return rope.get_int("dims"); }
  bool operator==(const GemvRopeCacheEpilogue&) const = default;
};
// Stacked row s of the kernel holds original row order[s] of the stacked [q; k; v] matrix (v's rows,
// and rows past the rotary dims, keep their place). Applied to the weights, scales, biases and the
// bias once, when they are stacked.
std::vector<std::int64_t> gemv_rope_row_order(const GemvRopeCacheEpilogue& rope);

// Decode attention run inside the GEMV that projects its output (the attention_output_projection
// region: flash_attention over a KV cache with the positions mask, its heads merged into one row,
// then the output projection with its residual). x [1, Hkv·G·D] is the attention output: blocks
// 0 .. kv_heads - 1 each compute one KV head's G query rows (q [Hkv, G, D], the caches [Hkv, keys, D],
// keys j <= positions[0] visible, scale · q kᵀ, a softmax by chunks with the running max, then · V,
// in f32 and in a fixed order), write them rounded to the activation dtype into x and bump an
// arrival counter; every block issues its first weight batches, waits for the previous kernel and
// then for all kv_heads arrivals, and reads x through L2. So the grid must be resident at once
// (GemvKernelSource::co_resident_blocks_per_multiprocessor); the last block to leave re-arms the
// counters. A row that sees no key is NaN, as flash_attention's. One activation row only (decode).
struct GemvAttentionPrologue {
  std::int64_t kv_heads = 0, groups = 0, head_dim = 0;  // Hkv, G (query heads a KV head), D = Dv: 64 or 128
  std::int64_t keys = 0;                                // T, the cache's slots
  double scale = 1.0;
  bool operator==(const GemvAttentionPrologue&) const = default;
};

struct GemvKernelConfig {
  GemvWeightFormat format;
  std::int64_t rows = 1;           // M, activation rows: 1..16
  std::int64_t out_features = 0;   // N
  std::int64_t in_features = 0;    // K (dense: a multiple of 8; affine: of the group size)
  GemvEpilogue epilogue = GemvEpilogue::store();  // its product_count() weight matrices share x
  GatedSchedule schedule = GatedSchedule::register_resident;  // two matrices only
  int warps_per_block = 4;         // split K between them; shared memory joins their partial sums
  int tiles_per_block = 1;         // 16-row tiles per block (their x fragments are shared)
  int iterations_in_flight = 2;    // mainloop iterations whose loads are issued before the math
  bool double_buffered = true;      // issue the next iterations' loads before this one's math
  // Register-batch mainloop only:
  //   k_splits > 1: split-K, each 16-row tile's K range is shared by that many blocks (so a narrow
  //     N still fills every SM); each writes fp32 partials to the workspace and the last block to
  //     arrive adds them in split order (deterministic) and applies the epilogue.
  //   shared_stages >= 2: each warp's batches are staged in shared memory by cp.async (16-byte
  //     asynchronous copies, one per lane and vector), that many batches deep, and read back just
  //     before their math: bytes in flight no longer cost registers. 0: batches live in registers.
  //   shared_group_sums (affine): sum(x) of each group is computed once per block into shared
  //     memory (after the wait for the previous kernel) instead of by an mma against a tile of ones
  //     in every iteration: a third fewer tensor instructions for a 4-bit gate/up.
  int k_splits = 1;
  int shared_stages = 0;
  bool shared_group_sums = false;
  // argmax_rows (register-batch mainloop, no split-K): the kernel also writes next [M] (i32), each
  // activation row's argmax over its N outputs as stored (argmax_index's rule, graph.h: ties to the
  // lowest index, a NaN above every number), the LM head's greedy token. Each block reduces its
  // tiles' (value, index) pairs per row and leaves its winners in the workspace; the last block to
  // arrive (a counter, as in the split-K join) reduces them and writes the ids.
  bool argmax_rows = false;
  // tile_loop_blocks_per_multiprocessor > 0 (register-batch mainloop, no split-K): the grid is
  // multiprocessors x this many blocks (at most the tile blocks) and block b computes tile blocks
  // b, b + grid, ...; the x prologue (the norm's scales, the staged x, the group sums) runs once
  // per block instead of once per tile block. For the LM head's thousands of tile blocks.
  int tile_loop_blocks_per_multiprocessor = 0;
  // l2_prefetch_rounds > 0 (register-batch mainloop): warp 0 of each block requests its weights
  // into L2 with bulk prefetches, that many rounds (one batch of every warp) ahead of the loads,
  // the first rounds before the wait for the previous kernel. Loads then find their lines in L2
  // or on their way: the bytes in flight no longer depend on the batches' registers, and the
  // DRAM stream starts before the kernel's activations are ready. A count at least the block's
  // rounds requests everything at once (kernels whose weights fit in L2).
  int l2_prefetch_rounds = 0;
  // x_staged_by_async_copy (x normalized and staged in shared memory, batches in registers, no
  // shared_stages): the prologue copies x into shared memory with cp.async, every vector at once,
  // and sums its squares and normalizes it there: one round trip to L2 after the wait for the
  // previous kernel and no registers held, where the register prologue takes one trip per two
  // vectors a thread for the sums and one more for the staging. Same bits (72 kernel pairs on the
  // H200). gemv_stage_configs races it beside the register prologue (notes/mlp_decode.md, session 12).
  bool x_staged_by_async_copy = false;
  // resident_blocks_per_multiprocessor > 0 (register-batch mainloop): the kernel is compiled with
  // __launch_bounds__(threads, this many), so ptxas holds a thread to the registers that let that
  // many blocks share an SM. For a few-tile stage (Llama-3-8B's q/k/v: 384 tiles of 16 warps) it
  // puts the whole grid in one wave, every weight load issued at once, before the wait for the
  // previous kernel; 0: ptxas chooses (the registers then cap the blocks an SM).
  int resident_blocks_per_multiprocessor = 0;
  // x_with_batch (double-buffered register batches, x as stored: no x_rms_norm_eps, no attention
  // prologue): each batch's x fragments are loaded with its weights (after the wait) instead of
  // when its math begins. A narrow stage's block is alone on its SM and each warp reads x columns
  // no other warp reads, so there every iteration's x was an L2 round trip the math waited on.
  // Measured on the H200 (notes/mlp_decode.md, session 27): Qwen2.5-1.5B's 4-bit down projection
  // 8.9 -> 8.3 us, Llama-3.2-1B's 8.8 -> 8.4; at 16 rows it was slower, and wider stages spill.
  bool x_with_batch = false;
  // half_products (affine weights, register batches in registers, no shared group sums, no attention
  // prologue): the weights times x in f16 whatever the activation dtype. The block stages x in
  // shared memory once (normalized first where x_rms_norm_eps), as f16 scaled per row by a power of
  // two that puts the row's largest magnitude in [2^14, 2^15) (exact for bf16 values: 8 significant
  // bits; the sums are unscaled before the warps join), divided by the code scale of its column
  // (AffineCodeDecode::code_scale). In f16 a 4-bit code pair takes one shift a word instead of three
  // (nibble_classes) and an 8-bit one a prmt a pair instead of two prmt, two subtracts and a cvt:
  // gemv_sass_benchmark counts 11.4 instructions a 4-bit weight word against 13.8 for Llama-3-8B's
  // gate/up w4 f2 batch. Needs M x K values within kMaxHalfStagedXBytes (M = 1 up to K = 16384).
  bool half_products = false;
  GemvMainloop mainloop = GemvMainloop::register_batches;
  // Streamed mainloop only (warps_per_block applies too; tiles, in_flight and double_buffered do not):
  int stage_iterations = 1;          // mainloop iterations (1 KiB of weights per matrix each) per stage
  int stages = 4;                    // ring depth per warp: stages whose bulk copies may be in flight
  int multiprocessors = 132;         // persistent grid: multiprocessors x blocks_per_multiprocessor (and the tile loop's)
  int blocks_per_multiprocessor = 1;

  // Split outputs: when not empty, the N output columns are written as several values, output s
  // taking the next output_splits[s] columns as its own [M, output_splits[s]] (the q, k and v of
  // one GEMV over their stacked weights). The widths sum to N; epilogue tensors are then [N]
  // (broadcast over rows) only.
  std::vector<std::int64_t> output_splits = {};

  // x normalized while it is loaded (the RMSNorm before the GEMV, FusionRule::input_prologue): when
  // set, the kernel reads x [M, K] and the norm's weight [K] (the pointer after x) and computes with
  // rms_norm(x, weight, eps) rounded to the activation dtype, each product rounded in f32 as the op's
  // CPU reference does. Every block reduces each whole row for the scale (a split-K or streamed block
  // too, though it reads only part of K for the mainloop: x is at most 16 rows).
  std::optional<double> x_rms_norm_eps = std::nullopt;

  // Rotary embedding and cache writes in the epilogue (GemvRopeCacheEpilogue; register-batch
  // mainloop, one matrix, three output splits).
  std::optional<GemvRopeCacheEpilogue> rope_cache = std::nullopt;

  // Attention before the mainloop, in the same kernel (GemvAttentionPrologue; register-batch mainloop,
  // one matrix, M = 1, no split-K, tile loop, argmax, norm or staged x; K = kv_heads · groups · head_dim).
  std::optional<GemvAttentionPrologue> attention = std::nullopt;

  void validate() const;  // InputError naming the bad field
  std::string to_string() const;
};

// The generated kernel and how to launch it. Arguments, in order: for each weight matrix its
// weights (dense: [N, K] in place; affine: RepackedAffineMatrix::words) and its scale_bias
// (affine only), then x [M, K] (and, with x_rms_norm_eps, the norm's weight [K]), then each epilogue tensor, then out [M, N] (with output_splits:
// one out per split, [M, width] each; with rope_cache: q rotated and the two caches), then (rope_cache)
// the positions [M] i32, then (argmax_rows) next [M] i32, then (attention) q, the k cache, the v cache
// and the positions [1] i32; all pointers. x is then written by the kernel (the attention output).
// A streamed, split-K, argmax or attention kernel takes one more pointer last: its workspace (workspace_bytes,
// zeroed once before the first launch; every launch leaves it ready for the next, so launches on
// one stream may share it, concurrent launches may not).
//
// Every generated kernel is ready for programmatic dependent launch (PDL): each block lets the next
// kernel of the stream launch as soon as it starts (griddepcontrol.launch_dependents), and reads
// nothing but its weights before griddepcontrol.wait (x, the epilogue tensors, the workspace, and
// every write, come after). Launched with the programmatic-stream-serialization attribute, its
// prologue and first weight loads overlap the previous kernel's tail; launched plainly, the wait
// returns at once.
struct GemvKernelSource {
  std::string kernel_name;  // unique per config
  std::string source;       // self-contained CUDA C++ (no includes) for NVRTC
  unsigned grid_blocks = 0;
  unsigned block_threads = 0;
  unsigned static_shared_bytes = 0;
  unsigned dynamic_shared_bytes = 0;   // streamed: the stage rings, x and its group sums; staged: the rings
  std::uint64_t workspace_bytes = 0;   // streamed, split-K: fp32 partials and per-tile arrival counters;
                                       // argmax: per-block winners and an arrival counter
  int k_slices = 1;                    // streamed: K splits (x slices that fit shared memory)
  // A grid whose blocks wait for one another (the persistent decode MLP's grid-wide barrier): all
  // grid_blocks must be resident at once. LoadedGemv::load checks that the device keeps this many
  // blocks per SM resident (the occupancy the driver reports for the compiled kernel) and that
  // grid_blocks <= SMs x that, and refuses the kernel otherwise. 0: no such requirement.
  int co_resident_blocks_per_multiprocessor = 0;
  // A tile loop's grid (its blocks take tile blocks b, b + gridDim.x, ...: any grid size computes the
  // same): LoadedGemv::load shrinks grid_blocks to the blocks the device keeps resident at once for
  // the compiled kernel, so that the loop runs as one wave whatever registers ptxas gave it (the
  // 4-warp LM head at K = 2048 took 136, three blocks an SM where its grid counted four).
  bool grid_shrinks_to_resident = false;
  // > 0: LoadedGemv::load gives the kernel dynamic shared memory it does not use, the least that
  // leaves at most this many blocks an SM where its registers and shared memory would let more share
  // one (gemv_timeline_benchmark --cap-gate-up, --cap-down). Not raced: measured on an H100 (notes/
  // mlp_decode.md, session 47), Llama-3.2-1B's 4-bit gate/up alone at 4 an SM went 15.7 -> 14.0 us an
  // MLP (512 blocks had sat 8 on 15 SMs and 3 on 104), Llama-3-8B's lost 0.5 us and its bf16 one 25%,
  // and raced as twins of every shape inside the decode step the capped kernels won regions by noise
  // and slowed Qwen2.5-1.5B's step 0.657 -> 0.688 ms. With every kernel of the step asking for one
  // carveout (session 48) that loss went (0.661 -> 0.659) but nothing was won, and Llama-3.2-1B's step
  // went 0.417 -> 0.434 ms.
  int blocks_per_multiprocessor_cap = 0;
  // >= 0: the shared-memory carveout (percent of the SM's L1/shared storage) LoadedGemv::load asks
  // for before it counts blocks an SM (gemv_timeline_benchmark --carveout): a capped kernel otherwise
  // runs with another split than the plain kernels beside it. -1: the driver's choice.
  int shared_memory_carveout_percent = -1;
};
GemvKernelSource generate_gemv_kernel(const GemvKernelConfig& config);

// The block timeline, a diagnostic (gemv_timeline_benchmark): `kernel`'s source with
// METILE_TIMELINE_BASE defined as `address`, so that each warp's %globaltimer stamps (32 u64 a warp:
// the layout is at the top of gemv_mainloop.cpp's register body) are copied into the buffer there at
// its block's end, and its entry bound by __launch_bounds__ to `blocks_an_sm` blocks an SM: the
// stamps take registers (4-bit g64 gate/up w4 f2 batch with the per-batch stamps: 64 -> 138 unbound),
// and a kernel with fewer blocks an SM than the one it stands for would time another schedule.
// InputError if the entry is not found.
std::string gemv_timeline_source(const GemvKernelSource& kernel, std::uint64_t address, int blocks_an_sm);

// The launch shapes worth trying for one problem (warps, tiles, loads in flight), best guess
// first; every returned config is valid.
std::vector<GemvKernelConfig> gemv_tuning_candidates(const GemvKernelConfig& base, int multiprocessors = 132);

// Each of `configs` with one option changed by `change` (x staged by cp.async, half products), in
// order, keeping those that still validate and that the change changed: the twins a race adds
// beside the shapes it has.
std::vector<GemvKernelConfig> gemv_valid_twins(std::span<const GemvKernelConfig> configs,
                                               const std::function<void(GemvKernelConfig&)>& change);

// The half-products candidates a stage races beside `configs`: each of them multiplying in f16
// (half_products) where that validates, then those of the twins whose grid is one wave only under a
// tight register bound, so bounded (gemv_one_wave_bound), in that order.
std::vector<GemvKernelConfig> gemv_half_twins(std::span<const GemvKernelConfig> configs, int multiprocessors = 132);
// The blocks an SM `config`'s whole grid needs at once (its register bound, resident_blocks_per_multiprocessor)
// where that bound is tight (22..28 warps an SM) and the shape, unbuffered register batches of x as
// stored at M <= 8, has none yet; 0 otherwise.
int gemv_one_wave_bound(const GemvKernelConfig& config, int multiprocessors);
// Whether every batch of the register-batch mainloop lies whole inside the matrix: no split-K, K a
// multiple of the iteration, the tiles a multiple of the block's, and the warps' batches
// (warps_per_block x iterations_in_flight iterations) tiling K's iterations exactly. The kernel's loads
// then need no predicates and no zeroed registers (kBatchesWhole, gemv_mainloop.cpp).
bool gemv_batches_whole(const GemvKernelConfig& config);

// The L2 prefetch depth for a register-batch config (l2_prefetch_rounds): every round of the
// block's share when all the kernel's weights fit in `l2_budget_bytes` (the decode GEMVs of the
// small models: the whole stream is requested at once), else as many rounds as keep the resident
// blocks' requests within that budget (at least one).
int gemv_l2_prefetch_rounds(const GemvKernelConfig& config, int multiprocessors = 132,
                            std::int64_t l2_budget_bytes = std::int64_t{24} << 20);

// Bytes a GEMV must move at least: weights (codes, scales, biases), x, epilogue tensors, output.
std::int64_t gemv_minimum_bytes(const GemvKernelConfig& config);

// ---------------------------------------------------------------- the persistent decode MLP
// The whole SwiGLU MLP at decode time as ONE launch (gemv_persistent.cpp), for the narrow models
// whose two stage kernels are dominated by ramp, tail and the boundary between them:
//
//   grid    = multiprocessors x blocks_per_multiprocessor blocks of warps_per_block warps, all
//             resident at once (GemvKernelSource::co_resident_blocks_per_multiprocessor)
//   phase 1 = gate_up: the (16-row tile, mainloop iteration) positions of the gate/up problem,
//             tile-major, split into equal contiguous shares, one per warp (stream-K, so every SM
//             gets equal work for any N); each piece of a tile is the register mainloop
//             (gate and up rows of a tile in the same piece) and the stream-K join: fp32 partials,
//             the last piece to arrive adds them in K order and applies the epilogue (silu(gate) * up)
//   barrier = every block arrives once its phase 1 is done; a warp waits for all of them only
//             where it first reads the hidden state, after issuing its first down weight loads
//   phase 2 = down: the same over the down problem, with its epilogue (the residual add)
//
// That is the warp_pieces partition. The stage_blocks partition keeps what wins as two kernels
// instead: each phase is its stage kernel's own block (generate_gemv_kernel's body: its warps
// split K and join in shared memory, its x prologue: the RMSNorm's scales, the staged x; its
// split-K join across blocks), as a device function of the block's units (tile block, K split):
// block b takes units b, b + grid, ... So a phase keeps its config's shape (warps, batches,
// k_splits, the norm prologue) and the grid is whatever keeps every block resident.
//
// Deterministic (fixed shares and a fixed reduction order), and every counter is re-armed inside
// the kernel, so launches and CUDA-graph replays follow each other on one stream. Arguments:
// gate_up's in gemv.h's order (weights, scale_bias, x, with x_rms_norm_eps the norm's weight, its
// epilogue tensors, its out = the hidden state), then down's (weights, scale_bias, its x = the
// same hidden state, its epilogue tensors, out), then the workspace (LoadedGemv appends it).
enum class PersistentPartition { warp_pieces, stage_blocks };
struct PersistentMlpConfig {
  // warp_pieces: register fields used: iterations_in_flight, double_buffered. stage_blocks: the
  // stage's whole register-batch config (its warps_per_block is this config's).
  GemvKernelConfig gate_up;  // N = intermediate, K = hidden
  GemvKernelConfig down;     // N = hidden, K = intermediate, one matrix
  PersistentPartition partition = PersistentPartition::warp_pieces;
  int warps_per_block = 8;
  int blocks_per_multiprocessor = 2;
  int multiprocessors = 132;

  void validate() const;  // InputError naming the bad field
  std::string to_string() const;
  std::string shape_name() const;  // "persistent w8 b2 f1 f2" (candidate names)
};
GemvKernelSource generate_persistent_mlp_kernel(const PersistentMlpConfig& config);
// The launch shapes worth trying for one MLP, best guess first (every returned config is valid).
std::vector<PersistentMlpConfig> persistent_mlp_candidates(const GemvKernelConfig& gate_up, const GemvKernelConfig& down,
                                                           int multiprocessors = 132);

}  // namespace metile
