// The one topological sort and cycle check (include/metile/graph.h, "scheduling"): Kahn's
// algorithm with a priority queue, so the order is deterministic and input already in order keeps
// it, and, when some vertices never become ready, one cycle among them for the error message.
#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

#include "metile/graph.h"

namespace metile {

Schedule schedule(std::span<const std::vector<std::size_t>> waits_on, std::span<const std::int64_t> priority) {
  const std::size_t count = waits_on.size();
  if (!priority.empty() && priority.size() != count) {
    throw std::invalid_argument("schedule: one priority per vertex, or none");
  }
  std::vector<std::vector<std::size_t>> followers(count);
  std::vector<std::size_t> pending(count, 0);
  for (std::size_t vertex = 0; vertex < count; ++vertex) {
    for (std::size_t before : waits_on[vertex]) {
      if (before >= count) throw std::invalid_argument("schedule: a vertex waits on one out of range");
      followers[before].push_back(vertex);
      ++pending[vertex];
    }
  }
  using Ready = std::pair<std::int64_t, std::size_t>;  // (priority, vertex): the smallest first
  auto ready_entry = [&](std::size_t vertex) {
    return Ready{priority.empty() ? static_cast<std::int64_t>(vertex) : priority[vertex], vertex};
  };
  std::priority_queue<Ready, std::vector<Ready>, std::greater<>> ready;
  for (std::size_t vertex = 0; vertex < count; ++vertex) {
    if (pending[vertex] == 0) ready.push(ready_entry(vertex));
  }
  Schedule result;
  result.order.reserve(count);
  while (!ready.empty()) {
    const std::size_t vertex = ready.top().second;
    ready.pop();
    result.order.push_back(vertex);
    for (std::size_t follower : followers[vertex]) {
      if (--pending[follower] == 0) ready.push(ready_entry(follower));
    }
  }
  if (result.order.size() == count) return result;

  // Every unordered vertex waits on another unordered vertex (pending counts only those), so
  // walking "waits on" edges from one of them must come back to a vertex already seen.
  std::size_t current = 0;
  while (pending[current] == 0) ++current;
  std::vector<std::size_t> walk;
  std::vector<std::size_t> seen_at(count, count);
  while (seen_at[current] == count) {
    seen_at[current] = walk.size();
    walk.push_back(current);
    for (std::size_t before : waits_on[current]) {
      if (pending[before] != 0) {
        current = before;
        break;
      }
    }
  }
  result.cycle.assign(walk.begin() + static_cast<std::ptrdiff_t>(seen_at[current]), walk.end());
  return result;
}

std::vector<std::vector<std::size_t>> kernel_dependencies(const ComputeGraph& graph,
                                                          std::span<const std::vector<NodeId>> kernels) {
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  std::vector<std::size_t> kernel_of(graph.nodes().size(), none);
  for (std::size_t kernel = 0; kernel < kernels.size(); ++kernel) {
    for (NodeId node : kernels[kernel]) {
      if (node < 0 || static_cast<std::size_t>(node) >= kernel_of.size()) {
        throw std::invalid_argument("kernel_dependencies: node " + std::to_string(node) + " is not in the graph");
      }
      std::size_t& owner = kernel_of[static_cast<std::size_t>(node)];
      if (owner != none && owner != kernel) {
        throw std::invalid_argument("kernel_dependencies: node '" + graph.node(node).name + "' is in two kernels");
      }
      owner = kernel;
    }
  }
  std::vector<std::vector<std::size_t>> dependencies(kernels.size());
  for (std::size_t kernel = 0; kernel < kernels.size(); ++kernel) {
    std::vector<std::size_t>& reads_from = dependencies[kernel];
    for (NodeId node : kernels[kernel]) {
      for (ValueId input : graph.node(node).inputs) {
        const NodeId producer = graph.value(input).producer;
        if (producer < 0) continue;
        const std::size_t from = kernel_of[static_cast<std::size_t>(producer)];
        if (from != none && from != kernel) reads_from.push_back(from);
      }
    }
    std::sort(reads_from.begin(), reads_from.end());
    reads_from.erase(std::unique(reads_from.begin(), reads_from.end()), reads_from.end());
  }
  return dependencies;
}

Schedule schedule_kernels(const ComputeGraph& graph, std::span<const std::vector<NodeId>> kernels) {
  const std::vector<std::vector<std::size_t>> dependencies = kernel_dependencies(graph, kernels);
  std::vector<std::int64_t> first_node(kernels.size(), static_cast<std::int64_t>(graph.nodes().size()));
  for (std::size_t kernel = 0; kernel < kernels.size(); ++kernel) {
    for (NodeId node : kernels[kernel]) first_node[kernel] = std::min<std::int64_t>(first_node[kernel], node);
  }
  return schedule(dependencies, first_node);
}

}  // namespace metile
