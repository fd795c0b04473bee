// Pieces shared by the kernel generators of src/codegen/ (private to the module).
#pragma once

#include <string>
#include <string_view>

#include "metile/graph.h"

namespace metile::codegen_detail {

// Device helpers every generated kernel includes: dtype conversions with the rounding the
// CPU reference uses, aligned vector loads/stores with a scalar tail, and row reductions.
std::string_view cuda_device_prelude();

// The integer types (u32, u16, u64), mma() (m16n8k16, f32 accumulators, f16 or bf16 inputs by
// kHalf) and component() (word i of a uint4): the head of every tensor-core kernel's text (the
// GEMV mainloops and the attention kernels), after its constants. tensor_core_helpers.cpp.
std::string_view tensor_core_device_helpers();

// argmax's rule on the device (argmax_index in graph.h): metile_device::argmax_beats(value, index,
// best, best_index) says whether (value, index) replaces the running (best, best_index); a NaN is
// above every number, equal values go to the lower index. A running pair that starts as
// (-inf, row length) is replaced by any element. For the kernels that reduce to an index only.
std::string_view cuda_argmax_helpers();

// The rotary embedding's frequency table and `metile_rope_rotate(first, second, pair, position,
// low, high)` for the rope op with `attributes` (layout_kernels.cpp): the one rotation every rope
// kernel (native, rope_kv_cache, the GEMV's rope epilogue) applies, so all of them give the same bits.
std::string rope_rotation_device_code(const Attributes& attributes);

// Letters, digits and '_' only, for kernel symbols and comments that must stay one token.
std::string sanitize_identifier(std::string_view text);

// Text (a value's name) as it may stand in a comment of generated code: on one line, with no
// line-continuing backslash, no comment delimiter and no trigraph. A name holding "*/" closed a
// /* */ parameter comment and the rest of it was compiled; one ending in '\' commented out the
// next line of code (a load, a store). Every name in generated source goes through it.
std::string comment_text(std::string_view text);

// "summed = add(values, residual)" for comments in generated code (comment_text).
std::string describe_node(const ComputeGraph& graph, const Node& node);

}  // namespace metile::codegen_detail
