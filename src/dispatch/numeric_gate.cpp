// The numeric gate: a candidate may be timed only after its outputs match the CPU reference.
// Errors are scale-normalized (relative L2 and max error over max |ref|) so one threshold per
// dtype serves tensors of any magnitude; non-finite values pass only where the reference has
// the very same one.
#include <fmt/core.h>

#include <cmath>
#include <optional>
#include <vector>

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

NumericGateResult gate_region_outputs(const ComputeGraph& graph, const TensorMap& outputs, const TensorMap& reference) {
  NumericGateResult worst;
  worst.passed = true;
  for (const auto& [name, expected] : reference) {
    NumericGateResult result;
    const std::optional<ValueId> id = graph.find_value(name);
    const Node* producer = id && graph.value(*id).producer >= 0 ? &graph.node(graph.value(*id).producer) : nullptr;
    const bool own_argmax = producer != nullptr && producer->op == "argmax" &&
                            outputs.contains(graph.value(producer->inputs[0]).name);
    if (own_argmax) {
      // The candidate's own values, row by row, give the index it must have written.
      const HostTensor& values = outputs.at(graph.value(producer->inputs[0]).name);
      const HostTensor& indices = outputs.at(name);
      const std::int64_t length = values.spec().row_length();
      result.passed = indices.spec() == expected.spec();
      result.detail = result.passed ? "" : fmt::format("output is {}, the reference {}", indices.spec().to_string(),
                                                       expected.spec().to_string());
      std::vector<float> row(static_cast<std::size_t>(length));
      for (std::int64_t r = 0; result.passed && r < indices.element_count(); ++r) {
        for (std::int64_t column = 0; column < length; ++column) {
          row[static_cast<std::size_t>(column)] = static_cast<float>(values.at(r * length + column));
        }
        const std::int64_t own = argmax_index(row);
        if (indices.at(r) != static_cast<double>(own)) {
          result.passed = false;
          result.detail = fmt::format("row {}: index {}, the argmax of the candidate's own '{}' is {}", r,
                                      indices.at(r), graph.value(producer->inputs[0]).name, own);
        }
      }
      if (!result.passed) result.relative_l2 = result.relative_max = INFINITY;
    } else {
      result = numeric_gate(outputs.at(name), expected);
    }
    if (!result.passed) result.detail = fmt::format("output '{}': {}", name, result.detail);
    if ((worst.passed && !result.passed) || (worst.passed == result.passed && result.relative_l2 > worst.relative_l2)) {
      worst = result;
    }
  }
  return worst;
}

}  // namespace metile
