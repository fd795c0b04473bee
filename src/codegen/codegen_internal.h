// Pieces shared by the kernel generators of src/codegen/ (private to the module).
#pragma once

#include <string>
#include <string_view>

#include "metile/graph.h"

namespace metile::codegen_detail {

// Device helpers every generated kernel includes: dtype conversions with the rounding the
// CPU reference uses, aligned vector loads/stores with a scalar tail, and row reductions.
std::string_view cuda_device_prelude();

// Letters, digits and '_' only, for kernel symbols and comments that must stay one token.
std::string sanitize_identifier(std::string_view text);

// "summed = add(values, residual)" for comments in generated code.
std::string describe_node(const ComputeGraph& graph, const Node& node);

}  // namespace metile::codegen_detail
