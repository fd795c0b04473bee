// Tensor summaries for `metile run`; see tensor_summary.h.
#include "tensor_summary.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace metile::cli {

TensorSummary summarize_tensor(const HostTensor& tensor) {
  TensorSummary summary;
  summary.minimum = std::numeric_limits<double>::infinity();
  summary.maximum = -std::numeric_limits<double>::infinity();
  double sum = 0;
  for (std::int64_t index = 0; index < tensor.element_count(); ++index) {
    const double value = tensor.at(index);
    if (std::isnan(value)) {
      ++summary.nan_count;
      continue;
    }
    summary.minimum = std::min(summary.minimum, value);
    summary.maximum = std::max(summary.maximum, value);
    sum += value;
  }
  const std::int64_t counted = tensor.element_count() - summary.nan_count;
  if (counted == 0) {
    summary.minimum = summary.maximum = summary.mean = std::numeric_limits<double>::quiet_NaN();
  } else {
    summary.mean = sum / static_cast<double>(counted);
  }
  summary.checksum = fnv1a_64(tensor.bytes());
  return summary;
}

std::string format_summary_line(std::string_view name, const HostTensor& tensor) {
  const TensorSummary summary = summarize_tensor(tensor);
  std::string line =
      fmt::format("{} {} min={:.6g} max={:.6g} mean={:.6g} checksum={:016x}", name, tensor.spec().to_string(),
                  summary.minimum, summary.maximum, summary.mean, summary.checksum);
  if (summary.nan_count > 0) line += fmt::format(" nan={}", summary.nan_count);
  return line;
}

void print_output_summaries(const ComputeGraph& graph, const TensorMap& outputs) {
  for (ValueId output : graph.outputs()) {
    const std::string& name = graph.value(output).name;
    const auto found = outputs.find(name);
    if (found == outputs.end())
      throw std::logic_error("the backend returned no tensor for output '" + name + "'");
    fmt::print("{}\n", format_summary_line(name, found->second));
  }
}

}  // namespace metile::cli
