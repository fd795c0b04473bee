// The planner's analytical cost model: what a set of nodes costs unfused and as
// one kernel, and what resources that kernel needs. The neighborhood cut models
// encode exactly this estimate as edge capacities (neighborhood_model.cpp); this
// file is its plain statement, used to report benefits and to check limits.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <fmt/core.h>

#include "planner_internal.h"

namespace metile {
namespace {

// A node's inputs, each value once (an op reading a value twice reads it once).
std::vector<ValueId> distinct_inputs(const Node& node) {
  std::vector<ValueId> inputs = node.inputs;
  std::sort(inputs.begin(), inputs.end());
  inputs.erase(std::unique(inputs.begin(), inputs.end()), inputs.end());
  return inputs;
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
  return RegionEstimator(graph, nodes, target, needs, value_is_output).estimate();
}

RegionEstimator::RegionEstimator(const ComputeGraph& graph, std::span<const NodeId> nodes, const FusionTarget& target,
                                 const ResourceNeeds& needs, const std::vector<bool>& value_is_output)
    : graph_(graph), target_(target), needs_(needs), value_is_output_(value_is_output),
      region_(nodes.begin(), nodes.end()) {
  std::sort(region_.begin(), region_.end());
  region_.erase(std::unique(region_.begin(), region_.end()), region_.end());

  sums_.ops = static_cast<std::int64_t>(region_.size());
  // Rules are data (Python sets their needs too): summed in 64 bits and saturated at int's range,
  // so a large per-op figure is refused by the limit check instead of wrapping around under it.
  sums_.registers = needs.base_registers;
  std::vector<ValueId> region_inputs;
  for (NodeId id : region_) {
    const Node& node = graph.node(id);
    for (ValueId input : distinct_inputs(node)) {
      sums_.unfused_bytes += graph.value(input).spec.bytes();
      if (!contains(graph.value(input).producer)) region_inputs.push_back(input);
    }
    for (ValueId output : node.outputs) {
      const std::int64_t bytes = graph.value(output).spec.bytes();
      sums_.unfused_bytes += bytes;
      sums_.on_chip_bytes += bytes;
      if (output_leaves(output)) {
        sums_.fused_bytes += bytes;
        ++sums_.output_count;
      }
    }
    sums_.registers += registers_of(graph, node, needs);
    // Staging: an input computed inside the kernel that the op must see whole.
    if (!node.inputs.empty() && contains(graph.value(node.inputs[0]).producer)) {
      sums_.shared_memory_bytes += staging_bytes(id);
    }
  }
  std::sort(region_inputs.begin(), region_inputs.end());
  region_inputs.erase(std::unique(region_inputs.begin(), region_inputs.end()), region_inputs.end());
  for (ValueId input : region_inputs) sums_.fused_bytes += graph.value(input).spec.bytes();
  sums_.input_count = static_cast<std::int64_t>(region_inputs.size());
  estimate_ = finish(sums_);
}

bool RegionEstimator::output_leaves(ValueId output) const {
  const auto& consumers = graph_.consumers(output);
  return value_is_output_[static_cast<std::size_t>(output)] ||
         std::any_of(consumers.begin(), consumers.end(), [&](NodeId c) { return !contains(c); });
}

// Built on the first without() or remove(): estimate_region, asked far more often, needs neither.
void RegionEstimator::prepare_removals() const {
  if (removals_prepared_) return;
  removals_prepared_ = true;
  for (NodeId id : region_) {
    const Node& node = graph_.node(id);
    for (ValueId input : distinct_inputs(node)) readers_.emplace_back(input, 1);
    for (ValueId output : node.outputs) {
      if (output_leaves(output)) leaving_.push_back(output);
    }
  }
  std::sort(leaving_.begin(), leaving_.end());
  // One entry a value, counting the ops that read it.
  std::sort(readers_.begin(), readers_.end());
  std::size_t kept = 0;
  for (std::size_t k = 0; k < readers_.size(); ++k) {
    if (kept > 0 && readers_[kept - 1].first == readers_[k].first) {
      ++readers_[kept - 1].second;
    } else {
      readers_[kept++] = readers_[k];
    }
  }
  readers_.resize(kept);
}

// The removal, term by term as the constructor adds them: the op's own inputs, outputs, registers
// and staging go; a value it read from an op inside now leaves the region (the op reads it from
// memory), unless it already did; a value it read from outside stops being a region input when no
// other op reads it; its outputs read inside become region inputs, and a reader staging one stages
// nothing.
RegionEstimate RegionEstimator::without(NodeId op) const { return finish(sums_without(op)); }

RegionEstimator::Sums RegionEstimator::sums_without(NodeId op) const {
  prepare_removals();
  Sums sums = sums_;
  const Node& node = graph_.node(op);
  --sums.ops;
  sums.registers -= registers_of(graph_, node, needs_);
  for (ValueId input : distinct_inputs(node)) {
    const std::int64_t bytes = graph_.value(input).spec.bytes();
    sums.unfused_bytes -= bytes;
    if (contains(graph_.value(input).producer)) {
      if (!leaves(input)) {
        sums.fused_bytes += bytes;
        ++sums.output_count;
      }
    } else if (readers_inside(input) == 1) {
      sums.fused_bytes -= bytes;
      --sums.input_count;
    }
  }
  if (!node.inputs.empty() && contains(graph_.value(node.inputs[0]).producer)) {
    sums.shared_memory_bytes -= staging_bytes(op);
  }
  std::vector<NodeId> staging_readers;
  for (ValueId output : node.outputs) {
    const std::int64_t bytes = graph_.value(output).spec.bytes();
    sums.unfused_bytes -= bytes;
    sums.on_chip_bytes -= bytes;
    if (leaves(output)) {
      sums.fused_bytes -= bytes;
      --sums.output_count;
    }
    if (readers_inside(output) > 0) {
      sums.fused_bytes += bytes;
      ++sums.input_count;
    }
    for (NodeId reader : graph_.consumers(output)) {
      const Node& reading = graph_.node(reader);
      if (contains(reader) && graph_.value(reading.inputs[0]).producer == op) staging_readers.push_back(reader);
    }
  }
  std::sort(staging_readers.begin(), staging_readers.end());
  staging_readers.erase(std::unique(staging_readers.begin(), staging_readers.end()), staging_readers.end());
  for (NodeId reader : staging_readers) sums.shared_memory_bytes -= staging_bytes(reader);
  return sums;
}

void RegionEstimator::remove(NodeId op) {
  if (!contains(op)) throw std::logic_error("fusion: an op removed from a region estimate is not in the region");
  sums_ = sums_without(op);
  // What the sums just counted, made the region's: the values the op read from ops inside now
  // leave, it reads nothing, and its outputs are no longer the region's.
  const Node& node = graph_.node(op);
  for (ValueId input : distinct_inputs(node)) {
    if (contains(graph_.value(input).producer) && !leaves(input)) {
      leaving_.insert(std::lower_bound(leaving_.begin(), leaving_.end(), input), input);
    }
    const auto reading = std::lower_bound(readers_.begin(), readers_.end(), std::pair<ValueId, std::int64_t>{input, 0});
    --reading->second;
  }
  for (ValueId output : node.outputs) {
    const auto leaving = std::lower_bound(leaving_.begin(), leaving_.end(), output);
    if (leaving != leaving_.end() && *leaving == output) leaving_.erase(leaving);
  }
  region_.erase(std::lower_bound(region_.begin(), region_.end(), op));
  estimate_ = finish(sums_);
}

bool RegionEstimator::contains(NodeId node) const { return std::binary_search(region_.begin(), region_.end(), node); }

bool RegionEstimator::leaves(ValueId output) const {
  return std::binary_search(leaving_.begin(), leaving_.end(), output);
}

std::int64_t RegionEstimator::readers_inside(ValueId value) const {
  const auto found = std::lower_bound(readers_.begin(), readers_.end(), std::pair<ValueId, std::int64_t>{value, 0});
  return found != readers_.end() && found->first == value ? found->second : 0;
}

std::int64_t RegionEstimator::staging_bytes(NodeId op) const {
  const Node& node = graph_.node(op);
  if (node.inputs.empty()) return 0;
  const Value& first_input = graph_.value(node.inputs[0]);
  if (node.kind == OpKind::row_reduction && needs_.stages_reduction_rows) {
    return first_input.spec.row_length() * static_cast<std::int64_t>(sizeof(float));
  }
  if (node.kind == OpKind::contraction && needs_.stages_contraction_activations) return first_input.spec.bytes();
  return 0;
}

RegionEstimate RegionEstimator::finish(const Sums& sums) const {
  RegionEstimate estimate;
  estimate.input_count = static_cast<int>(sums.input_count);
  estimate.output_count = static_cast<int>(sums.output_count);
  estimate.shared_memory_bytes = sums.shared_memory_bytes;
  estimate.registers_per_thread = static_cast<int>(
      std::clamp<std::int64_t>(sums.registers, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
  const double bandwidth = target_.memory_bandwidth_bytes_per_ns;
  estimate.unfused_ns = static_cast<double>(sums.ops) * target_.launch_overhead_ns +
                        static_cast<double>(sums.unfused_bytes) / bandwidth;
  estimate.fused_ns = target_.launch_overhead_ns + static_cast<double>(sums.fused_bytes) / bandwidth +
                      static_cast<double>(sums.on_chip_bytes) / target_.on_chip_bandwidth_bytes_per_ns;
  estimate.benefit_ns = estimate.unfused_ns - estimate.fused_ns;
  estimate.memory_bytes_avoided = sums.unfused_bytes - sums.fused_bytes;
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
