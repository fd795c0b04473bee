// FlowNetwork and FlowNetworkBuilder: validation of the input edges and the CSR
// layout every engine reads. The layout puts each kept edge's forward arc in its
// tail's out-list and its reverse arc (capacity 0) in its head's, so a residual graph
// is a single array indexed by arc and the out-list of a vertex is contiguous memory.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "capacity_text.h"
#include "metile/flow.h"

namespace metile {
namespace {

template <typename Capacity>
void check_capacity(int edge_index, Capacity capacity) {
  if constexpr (std::is_floating_point_v<Capacity>) {
    if (!std::isfinite(capacity)) {
      throw FlowEdgeError(edge_index, "flow network: edge " + std::to_string(edge_index) + " has capacity " +
                       capacity_text(capacity) +
                       "; capacities must be finite (use add_infinite_edge "
                       "for legality edges)");
    }
  }
  if (capacity < 0) {
    throw FlowEdgeError(edge_index, "flow network: edge " + std::to_string(edge_index) + " has negative capacity " +
                     capacity_text(capacity));
  }
}

void check_vertex(int edge_index, const char* end_name, int vertex, int vertex_count) {
  if (vertex < 0 || vertex >= vertex_count) {
    throw FlowEdgeError(edge_index, "flow network: edge " + std::to_string(edge_index) + " has " + end_name + " vertex " +
                     std::to_string(vertex) + " outside [0, " + std::to_string(vertex_count) + ")");
  }
}

// SplitMix64 finalizer: cheap and well mixed, enough for a cache key.
std::uint64_t mix(std::uint64_t hash, std::uint64_t value) {
  std::uint64_t z = hash ^ (value + 0x9e3779b97f4a7c15ULL + (hash << 6) + (hash >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

template <typename Capacity>
std::uint64_t capacity_bits(Capacity capacity) {
  std::uint64_t bits = 0;
  static_assert(sizeof(Capacity) == sizeof(bits));
  if constexpr (std::is_floating_point_v<Capacity>) {
    if (capacity == 0) capacity = 0;  // -0.0 and 0.0 are the same network
  }
  std::memcpy(&bits, &capacity, sizeof(bits));
  return bits;
}

}  // namespace

template <typename Capacity>
FlowNetwork<Capacity>::FlowNetwork(int vertex_count, std::span<const FlowEdge<Capacity>> edges) {
  if (vertex_count < 0) {
    throw InputError("flow network: vertex count " + std::to_string(vertex_count) + " is negative");
  }
  vertex_count_ = vertex_count;
  edges_.assign(edges.begin(), edges.end());
  build_storage(std::vector<std::uint8_t>(edges_.size(), 0));
}

template <typename Capacity>
FlowNetwork<Capacity>::FlowNetwork(int vertex_count, std::initializer_list<FlowEdge<Capacity>> edges)
    : FlowNetwork(vertex_count, std::span<const FlowEdge<Capacity>>(edges.begin(), edges.size())) {}

template <typename Capacity>
void FlowNetwork<Capacity>::build_storage(std::vector<std::uint8_t> edge_is_infinite) {
  edge_is_infinite_ = std::move(edge_is_infinite);
  // Arcs are numbered with int, two per edge.
  if (edges_.size() > static_cast<std::size_t>(std::numeric_limits<int>::max() / 2 - 1)) {
    throw InputError("flow network: " + std::to_string(edges_.size()) + " edges are more than the " +
                     std::to_string(std::numeric_limits<int>::max() / 2 - 1) + " supported");
  }
  const int edge_total = static_cast<int>(edges_.size());

  // Validate and total the finite capacities first: infinite edges take their value from the total.
  finite_capacity_sum_ = 0;
  int kept_edges = 0;
  int infinite_edges = 0;
  for (int e = 0; e < edge_total; ++e) {
    const FlowEdge<Capacity>& edge = edges_[e];
    check_vertex(e, "tail", edge.from, vertex_count_);
    check_vertex(e, "head", edge.to, vertex_count_);
    if (edge.from == edge.to) continue;
    ++kept_edges;
    if (edge_is_infinite_[e]) {
      ++infinite_edges;
      continue;
    }
    check_capacity(e, edge.capacity);
    if constexpr (std::is_integral_v<Capacity>) {
      if (edge.capacity > kIntegerCapacitySumLimit - finite_capacity_sum_) {
        // Edges are numbered from 0, as the library numbers them; the DIMACS reader adds the arc's line.
        // Self-loops and infinite edges add nothing: one edge alone is named alone wherever it is.
        const std::string edges = finite_capacity_sum_ == 0
                                      ? "the capacity of edge " + std::to_string(e) + " is"
                                      : "the finite capacities of edges 0 to " + std::to_string(e) + " sum to";
        throw FlowEdgeError(e, "flow network: " + edges + " more than " + std::to_string(kIntegerCapacitySumLimit) +
                                   "; solver arithmetic could overflow");
      }
    }
    finite_capacity_sum_ += edge.capacity;
    if constexpr (std::is_floating_point_v<Capacity>) {
      // A vertex's excess never exceeds this sum, so a finite sum keeps solver arithmetic finite.
      if (!std::isfinite(finite_capacity_sum_)) {
        throw FlowEdgeError(e, "flow network: the finite capacities of edges 0 to " + std::to_string(e) +
                         " sum past the largest double; solver arithmetic could overflow");
      }
    }
  }
  if constexpr (std::is_integral_v<Capacity>) {
    if (const std::string problem = integer_capacity_totals_problem(finite_capacity_sum_, infinite_edges); !problem.empty()) {
      throw InputError(problem);
    }
    infinite_capacity_ = finite_capacity_sum_ + 1;
  } else {
    if (const std::string problem = real_capacity_totals_problem(finite_capacity_sum_, infinite_edges); !problem.empty()) {
      throw InputError(problem);
    }
    infinite_capacity_ = 2 * finite_capacity_sum_ + 1;
    // With no edge to carry it, it only marks "no finite cut", which a finite flow never reaches.
    if (infinite_edges == 0 && !std::isfinite(infinite_capacity_)) infinite_capacity_ = std::numeric_limits<double>::infinity();
  }
  for (int e = 0; e < edge_total; ++e) {
    if (edge_is_infinite_[e]) edges_[e].capacity = infinite_capacity_;
  }

  // CSR by counting sort on tails: out-degree of v counts its forward arcs and the reverse
  // arcs of edges entering v. Within a vertex, arcs keep the edge order (forward and
  // reverse interleaved as the edges come), so the layout is deterministic.
  const int arcs = 2 * kept_edges;
  arc_offsets_.assign(static_cast<std::size_t>(vertex_count_) + 1, 0);
  for (const FlowEdge<Capacity>& edge : edges_) {
    if (edge.from == edge.to) continue;
    ++arc_offsets_[edge.from + 1];
    ++arc_offsets_[edge.to + 1];
  }
  for (int v = 0; v < vertex_count_; ++v) arc_offsets_[v + 1] += arc_offsets_[v];
  std::vector<int> next_slot(arc_offsets_.begin(), arc_offsets_.end() - 1);
  arc_head_.assign(arcs, 0);
  arc_reverse_.assign(arcs, 0);
  arc_capacity_.assign(arcs, Capacity{});
  arc_edge_.assign(arcs, -1);
  for (int e = 0; e < edge_total; ++e) {
    const FlowEdge<Capacity>& edge = edges_[e];
    if (edge.from == edge.to) continue;
    const int forward = next_slot[edge.from]++;
    const int backward = next_slot[edge.to]++;
    arc_head_[forward] = edge.to;
    arc_head_[backward] = edge.from;
    arc_reverse_[forward] = backward;
    arc_reverse_[backward] = forward;
    arc_capacity_[forward] = edge.capacity;
    arc_edge_[forward] = e;
  }

  std::uint64_t hash =
      mix(std::is_integral_v<Capacity> ? 0x1111 : 0x2222, static_cast<std::uint64_t>(vertex_count_));
  hash = mix(hash, static_cast<std::uint64_t>(arcs));
  for (int a = 0; a < arcs; ++a) {
    hash = mix(hash,
               static_cast<std::uint64_t>(arc_head_[a]) << 32 | static_cast<std::uint32_t>(arc_reverse_[a]));
    hash = mix(hash, capacity_bits(arc_capacity_[a]));
  }
  for (int v = 0; v <= vertex_count_; ++v) hash = mix(hash, static_cast<std::uint64_t>(arc_offsets_[v]));
  fingerprint_ = hash;
}

template <typename Capacity>
FlowNetworkBuilder<Capacity>::FlowNetworkBuilder(int vertex_count) : vertex_count_(vertex_count) {
  if (vertex_count < 0) {
    throw InputError("flow network builder: vertex count " + std::to_string(vertex_count) + " is negative");
  }
}

template <typename Capacity>
int FlowNetworkBuilder<Capacity>::add_vertex() {
  return add_vertices(1);
}

template <typename Capacity>
int FlowNetworkBuilder<Capacity>::add_vertices(int count) {
  if (count < 0 || count > std::numeric_limits<int>::max() / 2 - vertex_count_) {
    throw InputError("flow network builder: cannot add " + std::to_string(count) + " vertices");
  }
  const int first = vertex_count_;
  vertex_count_ += count;
  return first;
}

template <typename Capacity>
void FlowNetworkBuilder<Capacity>::check_edge(int from, int to, Capacity capacity) const {
  const int index = edge_count();
  check_vertex(index, "tail", from, vertex_count_);
  check_vertex(index, "head", to, vertex_count_);
  check_capacity(index, capacity);
}

template <typename Capacity>
int FlowNetworkBuilder<Capacity>::add_edge(int from, int to, Capacity capacity) {
  check_edge(from, to, capacity);
  const int index = edge_count();
  edges_.push_back({from, to, capacity});
  edge_is_infinite_.push_back(0);
  return index;
}

template <typename Capacity>
int FlowNetworkBuilder<Capacity>::add_infinite_edge(int from, int to) {
  const int index = edge_count();
  check_vertex(index, "tail", from, vertex_count_);
  check_vertex(index, "head", to, vertex_count_);
  edges_.push_back({from, to, Capacity{}});
  edge_is_infinite_.push_back(1);
  return index;
}

template <typename Capacity>
FlowNetwork<Capacity> FlowNetworkBuilder<Capacity>::build() const {
  FlowNetwork<Capacity> network;
  network.vertex_count_ = vertex_count_;
  network.edges_ = edges_;
  network.build_storage(edge_is_infinite_);
  return network;
}

template <typename Capacity>
FlowTolerance<Capacity> FlowTolerance<Capacity>::for_network(const FlowNetwork<Capacity>& network) {
  FlowTolerance tolerance;
  if constexpr (std::is_floating_point_v<Capacity>) {
    // The finite edges only (self loops excluded, summed in edge order at build): a legality edge's
    // capacity (twice their sum plus one) would loosen the comparison past the flows themselves, so
    // that two engines' values 1 and 0 compared equal.
    tolerance.epsilon = 1e-9 * std::max<Capacity>(1, network.finite_capacity_sum());
  }
  return tolerance;
}

template <typename Capacity>
std::vector<int> MaxFlowResult<Capacity>::source_side_vertices() const {
  std::vector<int> vertices;
  for (std::size_t v = 0; v < source_side.size(); ++v) {
    if (source_side[v]) vertices.push_back(static_cast<int>(v));
  }
  return vertices;
}

std::string integer_capacity_totals_problem(std::int64_t finite_sum, int infinite_edges) {
  // Infinite edges have capacity finite_sum + 1; the flow through them is bounded by their number
  // times that.
  const std::int64_t infinite_capacity = finite_sum + 1;
  if (infinite_edges > 0 && infinite_capacity > kIntegerCapacitySumLimit / (infinite_edges + 1)) {
    return "flow network: " + std::to_string(infinite_edges) + " infinite edges of capacity " +
           std::to_string(infinite_capacity) + " could overflow solver arithmetic; the finite capacities are too large";
  }
  return {};
}

std::string real_capacity_totals_problem(double finite_sum, int infinite_edges) {
  // A vertex's excess never exceeds the finite sum; infinite edges have capacity 2 * sum + 1.
  if (!std::isfinite(finite_sum)) {
    return "flow network: the finite capacities sum past the largest double; solver arithmetic could overflow";
  }
  if (infinite_edges > 0 && !std::isfinite((2 * finite_sum + 1) * (infinite_edges + 1))) {
    return "flow network: the finite capacities (sum " + capacity_text(finite_sum) + ") are too large to represent its " +
           std::to_string(infinite_edges) + " infinite edges";
  }
  return {};
}

template class FlowNetwork<std::int64_t>;
template class FlowNetwork<double>;
template class FlowNetworkBuilder<std::int64_t>;
template class FlowNetworkBuilder<double>;
template struct FlowTolerance<std::int64_t>;
template struct FlowTolerance<double>;
template struct MaxFlowResult<std::int64_t>;
template struct MaxFlowResult<double>;

}  // namespace metile
