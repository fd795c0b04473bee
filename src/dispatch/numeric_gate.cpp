// The numeric gate: a candidate may be timed only after its outputs match the CPU reference.
// Errors are scale-normalized (relative L2 and max error over max |ref|) so one threshold per
// dtype serves tensors of any magnitude; non-finite values pass only where the reference has
// the very same one.
#include <fmt/core.h>

#include <cmath>

#include "metile/dispatch.h"

namespace metile {

double numeric_gate_threshold(DType dtype) {
  switch (dtype) {
    case DType::f32: return 1e-5;
    case DType::f16: return 2e-3;
    case DType::bf16: return 1e-2;
    default: return 0.0;  // integers: exact
  }
}

NumericGateResult numeric_gate(const HostTensor& output, const HostTensor& reference) {
  NumericGateResult result;
  result.threshold = numeric_gate_threshold(reference.spec().dtype);
  if (output.spec() != reference.spec()) {
    result.relative_l2 = result.relative_max = INFINITY;
    result.detail = fmt::format("output is {}, the reference {}", output.spec().to_string(), reference.spec().to_string());
    return result;
  }
  double squared_difference = 0;
  double squared_reference = 0;
  double largest_difference = 0;
  double largest_reference = 0;
  for (std::int64_t i = 0; i < reference.element_count(); ++i) {
    const double out = output.at(i);
    const double ref = reference.at(i);
    if (!std::isfinite(ref)) {
      const bool same = (std::isnan(ref) && std::isnan(out)) || out == ref;
      if (!same && result.detail.empty()) result.detail = fmt::format("element {}: {} where the reference has {}", i, out, ref);
      continue;
    }
    if (!std::isfinite(out)) {
      if (result.detail.empty()) result.detail = fmt::format("element {}: {} where the reference has {}", i, out, ref);
      continue;
    }
    const double difference = std::abs(out - ref);
    squared_difference += difference * difference;
    squared_reference += ref * ref;
    largest_difference = std::max(largest_difference, difference);
    largest_reference = std::max(largest_reference, std::abs(ref));
  }
  auto normalized = [](double error, double scale) { return scale > 0 ? error / scale : (error > 0 ? INFINITY : 0.0); };
  result.relative_l2 = normalized(std::sqrt(squared_difference), std::sqrt(squared_reference));
  result.relative_max = normalized(largest_difference, largest_reference);
  if (!result.detail.empty()) {
    result.relative_l2 = result.relative_max = INFINITY;
    return result;
  }
  if (result.relative_l2 > result.threshold) {
    result.detail = fmt::format("relative L2 error {:.2e} > {:.0e}", result.relative_l2, result.threshold);
  } else if (result.relative_max > result.threshold) {
    result.detail = fmt::format("relative max error {:.2e} > {:.0e}", result.relative_max, result.threshold);
  }
  result.passed = result.detail.empty();
  return result;
}

}  // namespace metile
