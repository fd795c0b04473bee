// The planner's analytical cost model: what a set of nodes costs unfused and as
// one kernel, and what resources that kernel needs. The neighborhood cut models
// encode exactly this estimate as edge capacities (neighborhood_model.cpp); this
// file is its plain statement, used to report benefits and to check limits.
#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/core.h>

#include "planner_internal.h"

namespace metile {
namespace {

bool contains(const std::vector<NodeId>& sorted_nodes, NodeId node) {
  return std::binary_search(sorted_nodes.begin(), sorted_nodes.end(), node);
}

// A contraction whose weight arrives packed (integer dtype) dequantizes in registers.
bool is_quantized_contraction(const ComputeGraph& graph, const Node& node) {
  return std::any_of(node.inputs.begin(), node.inputs.end(),
                     [&](ValueId input) { return !is_floating(graph.value(input).spec.dtype); });
}

int registers_of(const ComputeGraph& graph, const Node& node, const ResourceNeeds& needs) {
  switch (node.kind) {
    case OpKind::elementwise: return needs.registers_per_elementwise;
    case OpKind::row_reduction: return needs.registers_per_row_reduction;
    case OpKind::contraction:
      return is_quantized_contraction(graph, node) ? needs.registers_per_quantized_contraction
                                                   : needs.registers_per_contraction;
    case OpKind::layout: return needs.registers_per_elementwise;
  }
  return 0;
}

std::string kibibytes(std::int64_t bytes) {
  if (bytes < 1024) return fmt::format("{} bytes", bytes);  // not "0.0 KB" for a limit of a few bytes
  if (bytes % 1024 == 0) return fmt::format("{} KB", bytes / 1024);
  return fmt::format("{:.1f} KB", static_cast<double>(bytes) / 1024.0);
}

}  // namespace


RegionEstimate estimate_region(const ComputeGraph& graph, std::span<const NodeId> nodes, const FusionTarget& target,
                               const ResourceNeeds& needs) {
  std::vector<bool> value_is_output(graph.values().size(), false);
  for (ValueId output : graph.outputs()) value_is_output[static_cast<std::size_t>(output)] = true;
  return fusion_internal::estimate_region(graph, nodes, target, needs, value_is_output);
}

namespace fusion_internal {

std::int64_t to_picoseconds(double nanoseconds) {
  const double picoseconds = nanoseconds * 1000.0;
  if (std::isnan(picoseconds)) return 0;
  const double limit = static_cast<double>(kMaximumCostPicoseconds);
  return std::llround(std::clamp(picoseconds, -limit, limit));
}

std::vector<std::int64_t> selection_weights(std::span<const double> benefits_ns) {
  double largest = 0;
  for (const double benefit : benefits_ns) {
    if (std::isfinite(benefit)) largest = std::max(largest, benefit * 1000.0);
  }
  const double limit = static_cast<double>(kMaximumCostPicoseconds);
  std::vector<std::int64_t> weights;
  weights.reserve(benefits_ns.size());
  for (const double benefit : benefits_ns) {
    if (largest <= limit || !std::isfinite(benefit)) {
      weights.push_back(to_picoseconds(benefit));
      continue;
    }
    const double scaled = benefit * 1000.0 * (limit / largest);
    weights.push_back(benefit > 0 ? std::max<std::int64_t>(1, std::llround(scaled)) : to_picoseconds(scaled / 1000.0));
  }
  return weights;
}

GraphIndex::GraphIndex(const ComputeGraph& graph)
    : consumer_nodes(graph.nodes().size()), value_is_output(graph.values().size(), false) {
  for (ValueId output : graph.outputs()) value_is_output[static_cast<std::size_t>(output)] = true;
  for (const Node& node : graph.nodes()) {
    auto& readers = consumer_nodes[static_cast<std::size_t>(node.id)];
    for (ValueId output : node.outputs) {
      const auto& consumers = graph.consumers(output);
      readers.insert(readers.end(), consumers.begin(), consumers.end());
    }
    std::sort(readers.begin(), readers.end());
    readers.erase(std::unique(readers.begin(), readers.end()), readers.end());
  }
}

bool GraphIndex::writes_graph_output(const ComputeGraph& graph, NodeId node) const {
  const auto& outputs = graph.node(node).outputs;
  return std::any_of(outputs.begin(), outputs.end(),
                     [&](ValueId value) { return value_is_output[static_cast<std::size_t>(value)]; });
}

RegionEstimate estimate_region(const ComputeGraph& graph, std::span<const NodeId> nodes, const FusionTarget& target,
                               const ResourceNeeds& needs, const std::vector<bool>& value_is_output) {
  std::vector<NodeId> region(nodes.begin(), nodes.end());
  std::sort(region.begin(), region.end());
  region.erase(std::unique(region.begin(), region.end()), region.end());

  RegionEstimate estimate;
  std::int64_t unfused_bytes = 0;
  std::int64_t fused_bytes = 0;
  std::int64_t on_chip_bytes = 0;
  std::vector<ValueId> region_inputs;
  // Rules are data (Python sets their needs too): summed in 64 bits and saturated at int's range,
  // so a large per-op figure is refused by the limit check instead of wrapping around under it.
  std::int64_t registers = needs.base_registers;
  for (NodeId id : region) {
    const Node& node = graph.node(id);
    std::vector<ValueId> distinct_inputs = node.inputs;
    std::sort(distinct_inputs.begin(), distinct_inputs.end());
    distinct_inputs.erase(std::unique(distinct_inputs.begin(), distinct_inputs.end()), distinct_inputs.end());
    for (ValueId input : distinct_inputs) {
      const std::int64_t bytes = graph.value(input).spec.bytes();
      unfused_bytes += bytes;
      if (!contains(region, graph.value(input).producer)) region_inputs.push_back(input);
    }
    for (ValueId output : node.outputs) {
      const std::int64_t bytes = graph.value(output).spec.bytes();
      unfused_bytes += bytes;
      on_chip_bytes += bytes;
      const auto& consumers = graph.consumers(output);
      const bool leaves = value_is_output[static_cast<std::size_t>(output)] || std::any_of(consumers.begin(), consumers.end(), [&](NodeId c) {
                            return !contains(region, c);
                          });
      if (leaves) {
        fused_bytes += bytes;
        ++estimate.output_count;
      }
    }
    registers += registers_of(graph, node, needs);
    // Staging: an input computed inside the kernel that the op must see whole.
    if (node.inputs.empty()) continue;
    const Value& first_input = graph.value(node.inputs[0]);
    if (!contains(region, first_input.producer)) continue;
    if (node.kind == OpKind::row_reduction && needs.stages_reduction_rows) {
      estimate.shared_memory_bytes += first_input.spec.row_length() * static_cast<std::int64_t>(sizeof(float));
    } else if (node.kind == OpKind::contraction && needs.stages_contraction_activations) {
      estimate.shared_memory_bytes += first_input.spec.bytes();
    }
  }
  std::sort(region_inputs.begin(), region_inputs.end());
  region_inputs.erase(std::unique(region_inputs.begin(), region_inputs.end()), region_inputs.end());
  for (ValueId input : region_inputs) fused_bytes += graph.value(input).spec.bytes();
  estimate.input_count = static_cast<int>(region_inputs.size());
  estimate.registers_per_thread = static_cast<int>(
      std::clamp<std::int64_t>(registers, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));

  const double bandwidth = target.memory_bandwidth_bytes_per_ns;
  estimate.unfused_ns =
      static_cast<double>(region.size()) * target.launch_overhead_ns + static_cast<double>(unfused_bytes) / bandwidth;
  estimate.fused_ns = target.launch_overhead_ns + static_cast<double>(fused_bytes) / bandwidth +
                      static_cast<double>(on_chip_bytes) / target.on_chip_bandwidth_bytes_per_ns;
  estimate.benefit_ns = estimate.unfused_ns - estimate.fused_ns;
  estimate.memory_bytes_avoided = unfused_bytes - fused_bytes;
  return estimate;
}

}  // namespace fusion_internal

Decision within_limits(const RegionEstimate& estimate, const FusionTarget& target) {
  const std::int64_t shared_memory_limit =
      std::min(target.shared_memory_per_block_bytes, target.shared_memory_per_multiprocessor_bytes);
  if (estimate.shared_memory_bytes > shared_memory_limit) {
    return Decision::refuse(fmt::format("needs {} shared memory, target allows {}",
                                        kibibytes(estimate.shared_memory_bytes), kibibytes(shared_memory_limit)));
  }
  if (estimate.registers_per_thread > target.registers_per_thread) {
    return Decision::refuse(fmt::format("needs {} registers per thread, target allows {}",
                                        estimate.registers_per_thread, target.registers_per_thread));
  }
  const std::int64_t block_registers =
      static_cast<std::int64_t>(estimate.registers_per_thread) * target.threads_per_block;
  if (block_registers > target.registers_per_multiprocessor) {
    return Decision::refuse(fmt::format("needs {} registers per block ({} per thread × {} threads), target allows {}",
                                        block_registers, estimate.registers_per_thread, target.threads_per_block,
                                        target.registers_per_multiprocessor));
  }
  if (estimate.input_count > target.max_kernel_inputs) {
    return Decision::refuse(
        fmt::format("reads {} inputs, target allows {} per kernel", estimate.input_count, target.max_kernel_inputs));
  }
  if (estimate.output_count > target.max_kernel_outputs) {
    return Decision::refuse(fmt::format("writes {} outputs, target allows {} per kernel", estimate.output_count,
                                        target.max_kernel_outputs));
  }
  return Decision::allow();
}

}  // namespace metile
