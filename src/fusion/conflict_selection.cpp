// Conflict selection (docs/architecture.md, "Conflict selection"): which candidate regions
// become kernels. Candidates that share an op, or that were found to close a
// cycle between kernels, conflict; each connected component of the conflict
// graph is a maximum-weight independent set problem:
//
//   bipartite (sides X, Y)   s ──w(x)──► x ──∞──► y ──w(y)──► t   one min cut: the cut is a
//                            minimum-weight vertex cover, its complement the best independent set
//                            (where the flow library's arithmetic carries the weights)
//   otherwise, ≤ N members   branch and bound, exact
//   otherwise                by weight, largest first, skipping conflicts (deterministic)
#include <algorithm>
#include <bit>
#include <cstdint>
#include <numeric>
#include <span>
#include <stdexcept>

#include "metile/flow.h"
#include "planner_internal.h"

namespace metile::fusion_internal {

ConflictGroups find_overlaps(std::size_t node_count, std::span<const std::vector<NodeId>> candidates) {
  // One holder list per node up to the largest one used: what costs is the sets, not node_count (a
  // select_disjoint_node_sets caller may name a large id space and use little of it).
  NodeId largest = -1;
  for (const std::vector<NodeId>& set : candidates) {
    for (NodeId node : set) largest = std::max(largest, node);
  }
  std::vector<std::vector<int>> holders(std::min(node_count, static_cast<std::size_t>(largest + 1)));
  for (std::size_t index = 0; index < candidates.size(); ++index) {
    for (NodeId node : candidates[index]) {
      // A node listed twice in one set is held once (add_group would drop the repeat as well).
      auto& holding = holders[static_cast<std::size_t>(node)];
      if (holding.empty() || holding.back() != static_cast<int>(index)) holding.push_back(static_cast<int>(index));
    }
  }
  ConflictGroups conflicts(candidates.size());
  for (std::vector<int>& sharing : holders) {
    if (sharing.size() >= 2) conflicts.add_group(std::move(sharing));
  }
  return conflicts;
}

std::vector<std::vector<int>> find_kernel_cycles(const ComputeGraph& graph, std::span<const std::vector<NodeId>> regions,
                                                 std::span<const std::int64_t> region_weights,
                                                 int max_cycles_per_component) {
  const int region_count = static_cast<int>(regions.size());
  // Kernels: the regions first, then one per node left out of every region.
  std::vector<std::vector<NodeId>> kernels(regions.begin(), regions.end());
  std::vector<bool> in_region(graph.nodes().size(), false);
  for (const auto& region : regions) {
    for (NodeId node : region) in_region[static_cast<std::size_t>(node)] = true;
  }
  for (const Node& node : graph.nodes()) {
    if (!in_region[static_cast<std::size_t>(node.id)]) kernels.push_back({node.id});
  }
  // The one cycle check (graph.h); only a cyclic kernel graph is searched for cycles to break.
  const std::vector<std::vector<std::size_t>> waits_on = kernel_dependencies(graph, kernels);
  if (schedule(waits_on).acyclic()) return {};
  const int kernel_count = static_cast<int>(kernels.size());
  std::vector<std::pair<int, int>> edges;
  for (int kernel = 0; kernel < kernel_count; ++kernel) {
    for (std::size_t before : waits_on[static_cast<std::size_t>(kernel)]) {
      edges.emplace_back(static_cast<int>(before), kernel);
    }
  }
  std::sort(edges.begin(), edges.end());
  std::vector<int> offsets(static_cast<std::size_t>(kernel_count) + 1, 0);
  for (const auto& edge : edges) ++offsets[static_cast<std::size_t>(edge.first) + 1];
  for (int kernel = 0; kernel < kernel_count; ++kernel) {
    offsets[static_cast<std::size_t>(kernel) + 1] += offsets[static_cast<std::size_t>(kernel)];
  }
  auto successors = [&](int kernel) {
    return std::span(edges).subspan(static_cast<std::size_t>(offsets[static_cast<std::size_t>(kernel)]),
                                    static_cast<std::size_t>(offsets[static_cast<std::size_t>(kernel) + 1] -
                                                             offsets[static_cast<std::size_t>(kernel)]));
  };

  // Tarjan's strongly connected components, iteratively. Only region kernels can
  // start a cycle (a convex region plus singletons is acyclic), so searches start there.
  std::vector<int> order(static_cast<std::size_t>(kernel_count), -1);
  std::vector<int> low(static_cast<std::size_t>(kernel_count), 0);
  std::vector<int> component(static_cast<std::size_t>(kernel_count), -1);
  std::vector<bool> on_stack(static_cast<std::size_t>(kernel_count), false);
  std::vector<int> stack;
  std::vector<std::pair<int, std::size_t>> calls;  // (kernel, next successor position)
  int counter = 0;
  int component_count = 0;
  std::vector<std::vector<int>> cyclic_components;
  for (int root = 0; root < region_count; ++root) {
    if (order[static_cast<std::size_t>(root)] >= 0) continue;
    calls.emplace_back(root, 0);
    while (!calls.empty()) {
      auto& [kernel, position] = calls.back();
      const auto k = static_cast<std::size_t>(kernel);
      if (position == 0 && order[k] < 0) {
        order[k] = low[k] = counter++;
        stack.push_back(kernel);
        on_stack[k] = true;
      }
      const auto next_edges = successors(kernel);
      if (position < next_edges.size()) {
        const int next = next_edges[position++].second;
        const auto n = static_cast<std::size_t>(next);
        if (order[n] < 0) {
          calls.emplace_back(next, 0);
        } else if (on_stack[n]) {
          low[k] = std::min(low[k], order[n]);
        }
        continue;
      }
      if (low[k] == order[k]) {
        std::vector<int> members;
        int member = -1;
        do {
          member = stack.back();
          stack.pop_back();
          on_stack[static_cast<std::size_t>(member)] = false;
          component[static_cast<std::size_t>(member)] = component_count;
          members.push_back(member);
        } while (member != kernel);
        ++component_count;
        if (members.size() > 1) cyclic_components.push_back(std::move(members));
      }
      const int finished = kernel;
      calls.pop_back();
      if (!calls.empty()) {
        const auto parent = static_cast<std::size_t>(calls.back().first);
        low[parent] = std::min(low[parent], low[static_cast<std::size_t>(finished)]);
      }
    }
  }

  // Shortest cycles (BFS inside the component) through its lightest regions.
  std::vector<std::vector<int>> cycles;
  std::vector<int> parent(static_cast<std::size_t>(kernel_count), -1);
  for (const auto& members : cyclic_components) {
    std::vector<int> starts;
    for (int member : members) {
      if (member < region_count) starts.push_back(member);
    }
    std::sort(starts.begin(), starts.end(), [&](int a, int b) {
      const auto weight_a = region_weights[static_cast<std::size_t>(a)];
      const auto weight_b = region_weights[static_cast<std::size_t>(b)];
      return weight_a != weight_b ? weight_a < weight_b : a < b;
    });
    if (static_cast<int>(starts.size()) > max_cycles_per_component) starts.resize(static_cast<std::size_t>(max_cycles_per_component));
    for (int start : starts) {
      const int inside = component[static_cast<std::size_t>(start)];
      std::vector<int> queue = {start};
      int last = -1;
      for (std::size_t head = 0; head < queue.size() && last < 0; ++head) {
        for (const auto& edge : successors(queue[head])) {
          const int next = edge.second;
          if (component[static_cast<std::size_t>(next)] != inside) continue;
          if (next == start) {
            last = queue[head];
            break;
          }
          if (parent[static_cast<std::size_t>(next)] >= 0) continue;
          parent[static_cast<std::size_t>(next)] = queue[head];
          queue.push_back(next);
        }
      }
      std::vector<int> cycle = {start};
      for (int kernel = last; kernel != start; kernel = parent[static_cast<std::size_t>(kernel)]) {
        if (kernel < region_count) cycle.push_back(kernel);
      }
      for (int visited : queue) parent[static_cast<std::size_t>(visited)] = -1;
      cycles.push_back(std::move(cycle));
    }
  }
  return cycles;
}

namespace {

// Local view of one component: members in ascending candidate order, and the conflict groups among
// them. Neighbour lists (local indices) are built only where every group is a pair (the min cut's
// network); a group of three or more is a triangle, so such a component is not bipartite.
struct Component {
  std::vector<int> members;
  std::vector<int> groups;  // indices into ConflictGroups::groups(), ascending
  std::vector<std::vector<int>> neighbours;
};

std::vector<int> colour_two_ways(const Component& component) {
  std::vector<int> colour(component.members.size(), -1);
  for (std::size_t start = 0; start < colour.size(); ++start) {
    if (colour[start] >= 0) continue;
    colour[start] = 0;
    std::vector<std::size_t> queue = {start};
    for (std::size_t head = 0; head < queue.size(); ++head) {
      const std::size_t current = queue[head];
      for (int next : component.neighbours[current]) {
        const auto n = static_cast<std::size_t>(next);
        if (colour[n] < 0) {
          colour[n] = 1 - colour[current];
          queue.push_back(n);
        } else if (colour[n] == colour[current]) {
          return {};
        }
      }
    }
  }
  return colour;
}

std::vector<bool> select_by_min_cut(const Component& component, const std::vector<int>& colour,
                                    std::span<const std::int64_t> weights) {
  const int count = static_cast<int>(component.members.size());
  constexpr int source = 0;
  constexpr int sink = 1;
  FlowNetworkBuilder<std::int64_t> network(count + 2);
  for (int local = 0; local < count; ++local) {
    const std::int64_t weight = weights[static_cast<std::size_t>(component.members[static_cast<std::size_t>(local)])];
    if (colour[static_cast<std::size_t>(local)] == 0) {
      network.add_edge(source, local + 2, weight);
      for (int next : component.neighbours[static_cast<std::size_t>(local)]) network.add_infinite_edge(local + 2, next + 2);
    } else {
      network.add_edge(local + 2, sink, weight);
    }
  }
  // The source side reachable in the residual graph is the same for every
  // maximum flow, so the choice does not depend on which engine dispatch picks.
  const MaxFlowResult<std::int64_t> cut = solve(network.build(), source, sink);
  std::vector<bool> chosen(static_cast<std::size_t>(count));
  for (int local = 0; local < count; ++local) {
    const bool source_side = cut.source_side[static_cast<std::size_t>(local + 2)];
    chosen[static_cast<std::size_t>(local)] = colour[static_cast<std::size_t>(local)] == 0 ? source_side : !source_side;
  }
  return chosen;
}

// Exact maximum-weight independent set for up to 63 members: heaviest first,
// take-before-skip, pruned by the weight still available.
class BranchAndBound {
 public:
  BranchAndBound(const Component& component, const ConflictGroups& conflicts, std::span<const std::int64_t> weights) {
    const std::size_t count = component.members.size();
    order_.resize(count);
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) {
      return weights[static_cast<std::size_t>(component.members[static_cast<std::size_t>(a)])] >
             weights[static_cast<std::size_t>(component.members[static_cast<std::size_t>(b)])];
    });
    std::vector<int> position(count);
    for (std::size_t k = 0; k < count; ++k) position[static_cast<std::size_t>(order_[k])] = static_cast<int>(k);
    weight_.resize(count);
    for (std::size_t k = 0; k < count; ++k) {
      weight_[k] = weights[static_cast<std::size_t>(component.members[static_cast<std::size_t>(order_[k])])];
    }
    // Each group as a mask of positions; a member conflicts with every other position of its groups.
    conflicts_.assign(count, 0);
    for (int group : component.groups) {
      std::uint64_t mask = 0;
      for (int member : conflicts.groups()[static_cast<std::size_t>(group)]) mask |= std::uint64_t{1} << position_of(component, position, member);
      for (std::size_t k = 0; k < count; ++k) {
        if (mask >> k & 1U) conflicts_[k] |= mask & ~(std::uint64_t{1} << k);
      }
    }
  }

  std::vector<bool> run() {
    search(0, 0, 0, 0);
    std::vector<bool> chosen(order_.size(), false);
    for (std::size_t k = 0; k < order_.size(); ++k) {
      if (best_set_ >> k & 1U) chosen[static_cast<std::size_t>(order_[k])] = true;
    }
    return chosen;
  }

 private:
  static int position_of(const Component& component, const std::vector<int>& position, int member) {
    const auto local = std::lower_bound(component.members.begin(), component.members.end(), member) - component.members.begin();
    return position[static_cast<std::size_t>(local)];
  }

  void search(std::size_t position, std::uint64_t chosen, std::uint64_t blocked, std::int64_t weight) {
    std::int64_t available = weight;
    for (std::size_t k = position; k < weight_.size(); ++k) {
      if (!(blocked >> k & 1U)) available += weight_[k];
    }
    if (available <= best_weight_) return;
    if (position == weight_.size()) {
      best_weight_ = weight;
      best_set_ = chosen;
      return;
    }
    const std::uint64_t bit = std::uint64_t{1} << position;
    if (!(blocked & bit)) search(position + 1, chosen | bit, blocked | conflicts_[position], weight + weight_[position]);
    search(position + 1, chosen, blocked | bit, weight);
  }

  std::vector<int> order_;
  std::vector<std::int64_t> weight_;
  std::vector<std::uint64_t> conflicts_;
  std::int64_t best_weight_ = -1;
  std::uint64_t best_set_ = 0;
};

// By weight, largest first (ties in candidate order), each one taken unless a group of it holds one
// taken before: linear in the groups' sizes, however large a group.
std::vector<bool> select_greedily(const Component& component, const ConflictGroups& conflicts,
                                  std::span<const std::int64_t> weights, std::vector<char>& occupied) {
  std::vector<int> order(component.members.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return weights[static_cast<std::size_t>(component.members[static_cast<std::size_t>(a)])] >
           weights[static_cast<std::size_t>(component.members[static_cast<std::size_t>(b)])];
  });
  // `occupied`: one flag per group of the whole problem, all clear on entry and again on return (only
  // this component's are set), so that many small greedy components cost their own groups alone.
  std::vector<bool> chosen(order.size(), false);
  for (int local : order) {
    const std::vector<int>& groups = conflicts.groups_of(component.members[static_cast<std::size_t>(local)]);
    if (std::any_of(groups.begin(), groups.end(), [&](int group) { return occupied[static_cast<std::size_t>(group)] != 0; })) {
      continue;
    }
    chosen[static_cast<std::size_t>(local)] = true;
    for (int group : groups) occupied[static_cast<std::size_t>(group)] = 1;
  }
  for (int group : component.groups) occupied[static_cast<std::size_t>(group)] = 0;
  return chosen;
}

}  // namespace

namespace {

SelectionOutcome select(std::span<const std::int64_t> weights, const ConflictGroups& conflicts, int max_exact_size,
                        const SelectionOutcome* previous, const std::vector<bool>* changed) {
  const std::size_t count = weights.size();
  if (conflicts.candidate_count() != count) throw std::invalid_argument("select_candidates: one weight per candidate");
  std::int64_t total_weight = 0;
  for (std::int64_t weight : weights) {
    if (weight <= 0) throw std::invalid_argument("select_candidates: weights must be positive");
    // Branch and bound adds weights in int64 and the min cut takes them as capacities: past the
    // flow library's capacity limit the sums would overflow into a wrong selection.
    if (weight > kIntegerCapacitySumLimit - total_weight) {
      throw std::invalid_argument("select_candidates: weights sum to more than " +
                                  std::to_string(kIntegerCapacitySumLimit));
    }
    total_weight += weight;
  }
  const std::vector<std::vector<int>>& groups = conflicts.groups();
  SelectionOutcome outcome;
  outcome.selected.assign(count, false);
  outcome.component_of.assign(count, -1);
  std::vector<char> group_seen(groups.size(), 0);
  std::vector<char> occupied(groups.size(), 0);  // select_greedily's scratch
  std::vector<int> local_of(count, -1);
  for (std::size_t start = 0; start < count; ++start) {
    if (outcome.component_of[start] >= 0) continue;
    const int component_index = static_cast<int>(outcome.components.size());
    Component component;
    outcome.component_of[start] = component_index;
    component.members.push_back(static_cast<int>(start));
    for (std::size_t head = 0; head < component.members.size(); ++head) {
      for (int group : conflicts.groups_of(component.members[head])) {
        if (group_seen[static_cast<std::size_t>(group)]) continue;
        group_seen[static_cast<std::size_t>(group)] = 1;
        component.groups.push_back(group);
        for (int next : groups[static_cast<std::size_t>(group)]) {
          if (outcome.component_of[static_cast<std::size_t>(next)] >= 0) continue;
          outcome.component_of[static_cast<std::size_t>(next)] = component_index;
          component.members.push_back(next);
        }
      }
    }
    std::sort(component.members.begin(), component.members.end());
    std::sort(component.groups.begin(), component.groups.end());

    if (previous != nullptr &&
        std::none_of(component.members.begin(), component.members.end(),
                     [&](int member) { return (*changed)[static_cast<std::size_t>(member)]; })) {
      // No new conflict touched it: the same members as before, the same answer.
      for (int member : component.members) {
        outcome.selected[static_cast<std::size_t>(member)] = previous->selected[static_cast<std::size_t>(member)];
      }
      outcome.components.push_back(
          previous->components[static_cast<std::size_t>(previous->component_of[static_cast<std::size_t>(start)])]);
      continue;
    }
    ConflictComponent summary;
    summary.candidates = component.members;
    std::vector<int> colour;
    const bool pairs_only = std::all_of(component.groups.begin(), component.groups.end(),
                                        [&](int group) { return groups[static_cast<std::size_t>(group)].size() == 2; });
    if (pairs_only) {
      for (std::size_t local = 0; local < component.members.size(); ++local) {
        local_of[static_cast<std::size_t>(component.members[local])] = static_cast<int>(local);
      }
      component.neighbours.resize(component.members.size());
      for (int group : component.groups) {
        const int a = local_of[static_cast<std::size_t>(groups[static_cast<std::size_t>(group)][0])];
        const int b = local_of[static_cast<std::size_t>(groups[static_cast<std::size_t>(group)][1])];
        component.neighbours[static_cast<std::size_t>(a)].push_back(b);
        component.neighbours[static_cast<std::size_t>(b)].push_back(a);
      }
      colour = colour_two_ways(component);
    }
    summary.bipartite = !colour.empty();
    // The min cut's network: the members' weights as finite capacities, one infinite edge a conflict
    // (its capacity, their sum + 1, times the edges must stay within the flow library's arithmetic;
    // weights near kIntegerCapacitySumLimit / edges are solved as a non-bipartite component is).
    bool cut_fits = summary.bipartite;
    if (cut_fits) {
      std::int64_t sum = 0;
      for (int member : component.members) sum += weights[static_cast<std::size_t>(member)];
      cut_fits = integer_capacity_totals_problem(sum, static_cast<int>(component.groups.size())).empty();
    }
    std::vector<bool> chosen;
    if (component.members.size() == 1) {
      summary.method = "single";
      chosen = {true};
    } else if (cut_fits) {
      summary.method = "min_cut";
      chosen = select_by_min_cut(component, colour, weights);
    } else if (static_cast<int>(component.members.size()) <= max_exact_size) {
      summary.method = "branch_and_bound";
      chosen = BranchAndBound(component, conflicts, weights).run();
    } else {
      summary.method = "greedy";
      chosen = select_greedily(component, conflicts, weights, occupied);
    }
    for (std::size_t local = 0; local < chosen.size(); ++local) {
      outcome.selected[static_cast<std::size_t>(component.members[local])] = chosen[local];
    }
    outcome.components.push_back(std::move(summary));
  }
  return outcome;
}

}  // namespace

SelectionOutcome select_candidates(std::span<const std::int64_t> weights, const ConflictGroups& conflicts,
                                   int max_exact_size) {
  return select(weights, conflicts, max_exact_size, nullptr, nullptr);
}

SelectionOutcome reselect_candidates(std::span<const std::int64_t> weights,
                                     const ConflictGroups& conflicts, int max_exact_size,
                                     const SelectionOutcome& previous, const std::vector<bool>& changed) {
  if (previous.selected.size() != weights.size() || changed.size() != weights.size()) {
    throw std::invalid_argument("reselect_candidates: previous outcome and changed flags must match the candidates");
  }
  return select(weights, conflicts, max_exact_size, &previous, &changed);
}

}  // namespace metile::fusion_internal

namespace metile {

bool is_certified_node(const Node& node) { return node.attributes.has("certificate"); }

namespace {
// A group's members (ascending) hashed: ConflictGroups finds an alike group by it.
std::uint64_t group_hash(const std::vector<int>& members) { return fnv1a_64(std::as_bytes(std::span(members))); }
}  // namespace

const std::vector<int>& ConflictGroups::groups_of(int candidate) const {
  return groups_of_.at(static_cast<std::size_t>(candidate));
}

bool ConflictGroups::conflict(int a, int b) const {
  // Group indices are ascending in each list: a merge finds a shared one.
  const std::vector<int>& first = groups_of(a);
  const std::vector<int>& second = groups_of(b);
  if (a == b) return false;
  for (auto x = first.begin(), y = second.begin(); x != first.end() && y != second.end();) {
    if (*x == *y) return true;
    *x < *y ? ++x : ++y;
  }
  return false;
}

std::vector<int> ConflictGroups::conflicts_of(int candidate) const {
  std::vector<int> others;
  for (int group : groups_of(candidate)) {
    for (int member : groups_[static_cast<std::size_t>(group)]) {
      if (member != candidate) others.push_back(member);
    }
  }
  std::sort(others.begin(), others.end());
  others.erase(std::unique(others.begin(), others.end()), others.end());
  return others;
}

bool ConflictGroups::add_group(std::vector<int> members) {
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  for (int member : members) groups_of(member);  // std::out_of_range for a member that is no candidate
  if (members.size() < 2) return false;
  // The ops of a region are mostly held by the same candidates: the same group comes again and again,
  // found by its hash in constant time.
  const std::uint64_t hash = group_hash(members);
  const auto [first, last] = groups_by_hash_.equal_range(hash);
  for (auto at = first; at != last; ++at) {
    if (groups_[static_cast<std::size_t>(at->second)] == members) return false;
  }
  const auto group = static_cast<int>(groups_.size());
  groups_by_hash_.emplace(hash, group);
  for (int member : members) groups_of_[static_cast<std::size_t>(member)].push_back(group);
  groups_.push_back(std::move(members));
  return true;
}

void ConflictGroups::append(const ConflictGroups& other) {
  if (&other == this) return append(ConflictGroups(other));  // appending to itself: from a copy
  const auto candidate_offset = static_cast<int>(groups_of_.size());
  const auto group_offset = static_cast<int>(groups_.size());
  for (const std::vector<int>& groups : other.groups_of_) {
    std::vector<int>& shifted = groups_of_.emplace_back(groups);
    for (int& group : shifted) group += group_offset;
  }
  for (const std::vector<int>& members : other.groups_) {
    std::vector<int>& shifted = groups_.emplace_back(members);
    for (int& member : shifted) member += candidate_offset;
    groups_by_hash_.emplace(group_hash(shifted), static_cast<int>(groups_.size()) - 1);
  }
}


NodeSetSelection select_disjoint_node_sets(std::size_t node_count, std::span<const std::vector<NodeId>> node_sets,
                                           std::span<const std::int64_t> weights, int max_exact_component_size) {
  if (node_sets.size() != weights.size()) throw std::invalid_argument("select_disjoint_node_sets: one weight per set");
  if (max_exact_component_size < 1 || max_exact_component_size > kMaxExactComponentSizeLimit) {
    throw std::invalid_argument("select_disjoint_node_sets: max_exact_component_size must be between 1 and " +
                                std::to_string(kMaxExactComponentSizeLimit));
  }
  for (const auto& set : node_sets) {
    for (NodeId node : set) {
      if (node < 0 || static_cast<std::size_t>(node) >= node_count) {
        throw std::invalid_argument("select_disjoint_node_sets: a node id outside the graph");
      }
    }
  }
  const auto conflicts = fusion_internal::find_overlaps(node_count, node_sets);
  fusion_internal::SelectionOutcome outcome =
      fusion_internal::select_candidates(weights, conflicts, max_exact_component_size);
  return {std::move(outcome.selected), std::move(outcome.component_of), std::move(outcome.components)};
}

}  // namespace metile
