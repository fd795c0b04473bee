// One-line summaries of tensors for `metile run` (any backend): range, mean
// and a checksum of the exact bytes, so two runs can be compared by eye or by
// diff without writing the tensors out.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "metile/graph.h"

namespace metile::cli {

struct TensorSummary {
  double minimum = 0;  // over the values that are not NaN (NaN when all are)
  double maximum = 0;
  double mean = 0;  // over the values that are not NaN
  std::int64_t nan_count = 0;
  std::uint64_t checksum = 0;  // metile::fnv1a_64 of the tensor's bytes (its dtype's little-endian layout)
};

TensorSummary summarize_tensor(const HostTensor& tensor);

// "name f16[1, 2048] min=-3.1 max=2.9 mean=0.0012 checksum=0123456789abcdef",
// with " nan=N" appended when some values are NaN.
std::string format_summary_line(std::string_view name, const HostTensor& tensor);

// Prints one summary line per graph output, in the graph's output order.
void print_output_summaries(const ComputeGraph& graph, const TensorMap& outputs);

}  // namespace metile::cli
