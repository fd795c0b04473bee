// Pieces shared by the two GEMV mainloop generators (gemv_mainloop.cpp: register batches,
// gemv_streamed.cpp: bulk copies into shared-memory stages), private to the codegen module.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "metile/gemv.h"

namespace metile::gemv_detail {

// The device code both mainloops start from (after the problem constants): types, the derived
// constants of the weight layout, dtype conversions, activations, the m16n8k16 product and the
// affine code-to-fragment conversion. Defined in gemv_device_helpers.cpp.
std::string_view gemv_device_helpers();

// "bf16", "bf16_a4g64": the format part of a kernel name.
std::string gemv_format_tag(const GemvWeightFormat& format);

// The constants every generated GEMV begins with (kM, kN, kK, kBits, kGroup, kHalf,
// kColumnsPerIteration, kProducts, kWarps).
std::string gemv_problem_constants(const GemvKernelConfig& config);

// The streamed mainloop (gemv_streamed.cpp).
void validate_streamed(const GemvKernelConfig& config);  // InputError when it cannot be built
GemvKernelSource generate_streamed_gemv_kernel(const GemvKernelConfig& config);
std::vector<GemvKernelConfig> streamed_tuning_candidates(const GemvKernelConfig& base);

}  // namespace metile::gemv_detail
