// Grounded Laplacian solves (grounded_laplacian.h says what and why).
#include "grounded_laplacian.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>

namespace metile::flow_detail {

GroundedLaplacian::GroundedLaplacian(int vertex_count, const std::vector<int>& tail, const std::vector<int>& head,
                                     int ground)
    : vertex_count_(vertex_count), ground_(ground) {
  const std::size_t n = static_cast<std::size_t>(vertex_count);
  // The edges, numbered in (low, high) order: arcs sorted once by their unordered pair, packed
  // into one key (low above high), ties in arc order.
  const int arcs = static_cast<int>(tail.size());
  std::vector<std::pair<std::uint64_t, int>> by_pair(static_cast<std::size_t>(arcs));
  for (int arc = 0; arc < arcs; ++arc) {
    const auto [low, high] = std::minmax(tail[arc], head[arc]);
    by_pair[arc] = {(static_cast<std::uint64_t>(low) << 32) | static_cast<std::uint32_t>(high), arc};
  }
  std::sort(by_pair.begin(), by_pair.end());
  edge_of_arc_.assign(static_cast<std::size_t>(arcs), -1);
  for (const auto& [key, arc] : by_pair) {
    const int low = static_cast<int>(key >> 32), high = static_cast<int>(key & 0xFFFFFFFFu);
    if (low == high) continue;
    if (edge_low_.empty() || edge_low_.back() != low || edge_high_.back() != high) {
      edge_low_.push_back(low);
      edge_high_.push_back(high);
    }
    edge_of_arc_[arc] = static_cast<int>(edge_low_.size()) - 1;
  }
  edge_conductance_.resize(edge_low_.size());
  inverse_diagonal_.resize(n);
  position_.resize(n);
  eliminated_.resize(n);
  for (Run& run : runs_) {
    for (std::vector<double>* values : {&run.potential, &run.residual, &run.preconditioned, &run.direction, &run.product}) {
      values->resize(n);
    }
  }
}

void GroundedLaplacian::set_conductances(const std::vector<double>& conductance) {
  std::fill(edge_conductance_.begin(), edge_conductance_.end(), 0.0);
  for (std::size_t arc = 0; arc < conductance.size(); ++arc) {
    const int edge = edge_of_arc_[arc];
    if (edge < 0) continue;
    edge_conductance_[edge] += std::isfinite(conductance[arc]) ? conductance[arc] : std::nan("");
  }
  std::fill(inverse_diagonal_.begin(), inverse_diagonal_.end(), 0.0);
  for (std::size_t edge = 0; edge < edge_conductance_.size(); ++edge) {
    inverse_diagonal_[edge_low_[edge]] += edge_conductance_[edge];
    inverse_diagonal_[edge_high_[edge]] += edge_conductance_[edge];
  }
  for (double& entry : inverse_diagonal_) entry = entry > 0 ? 1 / entry : 0;
  inverse_diagonal_[ground_] = 0;
  has_tree_ = build_tree();
  if (!has_tree_) last_winner_ = Preconditioner::jacobi;
  else if (last_winner_ == Preconditioner::jacobi) last_winner_ = Preconditioner::tree_and_diagonal;
}

GroundedLaplacian::Outcome GroundedLaplacian::solve(const std::vector<double>& rhs, std::vector<double>& potential,
                                                    double relative_tolerance, int max_steps, bool race) {
  // A racer whose residual is kLead times the other's after kLeadRounds rounds falls back (it steps
  // again only if the leader breaks down): what the race costs where one preconditioner is far
  // ahead (all of docs/ipm.md's families: 20-30% fewer CG steps than racing to the end).
  constexpr int kLeadRounds = 4;
  constexpr double kLead = 100;
  const int n = vertex_count_;
  potential[ground_] = 0;
  double rhs_norm = 0;
  for (int v = 0; v < n; ++v) {
    if (v != ground_) rhs_norm += rhs[v] * rhs[v];
  }
  const double stop = relative_tolerance * std::sqrt(rhs_norm);
  int racers = 1;
  runs_[0].preconditioner = last_winner_;
  if (race && has_tree_) {
    racers = 2;
    runs_[0].preconditioner = Preconditioner::tree;
    runs_[1].preconditioner = Preconditioner::tree_and_diagonal;
  }
  for (int r = 0; r < racers; ++r) start(runs_[r], rhs, potential);
  Outcome outcome;
  for (int round = 0;; ++round) {
    for (int r = 0; r < racers; ++r) {
      if (runs_[r].residual_norm <= stop) {  // a run broken by an exact answer (no residual left) included
        potential = runs_[r].potential;
        last_winner_ = runs_[r].preconditioner;
        outcome.converged = true;
        return outcome;
      }
    }
    if (racers == 2 && round + 1 >= kLeadRounds) {
      runs_[0].lagging = runs_[0].residual_norm > kLead * runs_[1].residual_norm;
      runs_[1].lagging = runs_[1].residual_norm > kLead * runs_[0].residual_norm;
    }
    bool stepped = false;
    if (round < max_steps) {
      for (int r = 0; r < racers; ++r) {
        Run& run = runs_[r];
        if (run.broken || (run.lagging && !runs_[1 - r].broken)) continue;
        run.broken = !step(run);
        ++outcome.steps;
        stepped = true;
      }
    }
    if (!stepped) {
      const Run& best = racers == 2 && runs_[1].residual_norm < runs_[0].residual_norm ? runs_[1] : runs_[0];
      potential = best.potential;
      last_winner_ = best.preconditioner;
      return outcome;
    }
  }
}

void GroundedLaplacian::start(Run& run, const std::vector<double>& rhs, const std::vector<double>& potential) {
  const int n = vertex_count_;
  run.potential = potential;
  run.broken = false;
  run.lagging = false;
  multiply(run.potential, run.product);
  for (int v = 0; v < n; ++v) run.residual[v] = v == ground_ ? 0 : rhs[v] - run.product[v];
  apply_preconditioner(run.preconditioner, run.residual, run.preconditioned);
  run.residual_dot = 0;
  run.residual_norm = 0;
  for (int v = 0; v < n; ++v) {
    run.direction[v] = run.preconditioned[v];
    run.residual_dot += run.residual[v] * run.preconditioned[v];
    run.residual_norm += run.residual[v] * run.residual[v];
  }
  run.residual_norm = std::sqrt(run.residual_norm);
  if (!(run.residual_dot > 0)) run.broken = true;
}

// False where the direction has no positive curvature (the run can go no further).
bool GroundedLaplacian::step(Run& run) {
  const int n = vertex_count_;
  multiply(run.direction, run.product);
  double curvature = 0;
  for (int v = 0; v < n; ++v) curvature += run.direction[v] * run.product[v];
  if (!(curvature > 0)) return false;
  const double step = run.residual_dot / curvature;
  double residual_norm = 0;
  for (int v = 0; v < n; ++v) {
    run.potential[v] += step * run.direction[v];
    run.residual[v] -= step * run.product[v];
    residual_norm += run.residual[v] * run.residual[v];
  }
  run.residual_norm = std::sqrt(residual_norm);
  apply_preconditioner(run.preconditioner, run.residual, run.preconditioned);
  double next_dot = 0;
  for (int v = 0; v < n; ++v) next_dot += run.residual[v] * run.preconditioned[v];
  const double beta = next_dot / run.residual_dot;
  run.residual_dot = next_dot;
  for (int v = 0; v < n; ++v) run.direction[v] = run.preconditioned[v] + beta * run.direction[v];
  return next_dot > 0;
}

void GroundedLaplacian::apply_preconditioner(Preconditioner preconditioner, const std::vector<double>& r,
                                             std::vector<double>& z) {
  const int n = vertex_count_;
  if (preconditioner == Preconditioner::jacobi) {
    for (int v = 0; v < n; ++v) z[v] = inverse_diagonal_[v] * r[v];
    return;
  }
  // Elimination on the tree, leaves first: eliminated_[k] is the right side of the k-th vertex
  // (breadth first from the ground) with its subtree folded in; then back substitution from the
  // ground outwards. Positions, not vertex numbers, so that every array but r and z streams.
  const TreeFactor& factor = preconditioner == Preconditioner::tree ? tree_factor_ : diagonal_factor_;
  for (int k = 0; k < n; ++k) eliminated_[k] = r[tree_order_[k]];
  for (int k = n - 1; k > 0; --k) eliminated_[tree_parent_position_[k]] += factor.fold[k] * eliminated_[k];
  eliminated_[0] = 0;  // the ground's potential, kept from here on
  for (int k = 1; k < n; ++k) {
    eliminated_[k] = (eliminated_[k] + tree_conductance_[k] * eliminated_[tree_parent_position_[k]]) *
                     factor.inverse_pivot[k];
  }
  for (int k = 0; k < n; ++k) z[tree_order_[k]] = eliminated_[k];
}

// The heavy spanning tree of the edges, rooted at the ground, and both preconditioners' factors.
// False where the edges of positive finite conductance do not span the vertices.
bool GroundedLaplacian::build_tree() {
  const int n = vertex_count_;
  const int edges = static_cast<int>(edge_conductance_.size());
  auto usable = [&](int edge) { return edge_conductance_[edge] > 0 && std::isfinite(edge_conductance_[edge]); };
  // Edges by binary exponent, largest first, each bucket in edge order (a counting sort: O(m)).
  // The biased exponent field, read off the bits (std::ilogb, a library call, cost 10% of a solve
  // on the seed-random networks): 2046 for the largest finite doubles, 0 for every subnormal.
  constexpr int kBuckets = 2047;
  auto bucket = [&](int edge) {
    return 2046 - static_cast<int>(std::bit_cast<std::uint64_t>(edge_conductance_[edge]) >> 52);
  };  // 0 for the largest
  bucket_begin_.assign(kBuckets + 1, 0);
  for (int edge = 0; edge < edges; ++edge) {
    if (usable(edge)) ++bucket_begin_[bucket(edge) + 1];
  }
  for (int b = 0; b < kBuckets; ++b) bucket_begin_[b + 1] += bucket_begin_[b];
  edge_order_.resize(static_cast<std::size_t>(bucket_begin_[kBuckets]));
  for (int edge = 0; edge < edges; ++edge) {
    if (usable(edge)) edge_order_[bucket_begin_[bucket(edge)]++] = edge;
  }
  // Kruskal with path-halving union-find.
  union_find_.resize(static_cast<std::size_t>(n));
  std::iota(union_find_.begin(), union_find_.end(), 0);
  auto find = [&](int v) {
    while (union_find_[v] != v) v = union_find_[v] = union_find_[union_find_[v]];
    return v;
  };
  adjacency_begin_.assign(static_cast<std::size_t>(n) + 1, 0);
  tree_edges_.clear();
  for (const int edge : edge_order_) {
    const int a = find(edge_low_[edge]), b = find(edge_high_[edge]);
    if (a == b) continue;
    union_find_[a] = b;
    tree_edges_.push_back(edge);
    ++adjacency_begin_[edge_low_[edge] + 1];
    ++adjacency_begin_[edge_high_[edge] + 1];
    if (static_cast<int>(tree_edges_.size()) == n - 1) break;
  }
  if (static_cast<int>(tree_edges_.size()) != n - 1) return false;
  // Adjacency lists (edge numbers).
  for (int v = 0; v < n; ++v) adjacency_begin_[v + 1] += adjacency_begin_[v];
  adjacency_.resize(2 * tree_edges_.size());
  std::vector<int>& next_slot = union_find_;  // done with: each vertex's next adjacency slot
  std::copy(adjacency_begin_.begin(), adjacency_begin_.end() - 1, next_slot.begin());
  for (const int edge : tree_edges_) {
    adjacency_[next_slot[edge_low_[edge]]++] = edge;
    adjacency_[next_slot[edge_high_[edge]]++] = edge;
  }
  // Breadth first from the ground: each vertex's position, and by position its vertex, its parent's
  // position and the conductance of the edge to its parent (the ground at 0, its own parent).
  std::fill(position_.begin(), position_.end(), -1);
  position_[ground_] = 0;
  tree_order_.assign(1, ground_);
  tree_parent_position_.assign(1, 0);
  tree_conductance_.assign(1, 0.0);
  for (std::size_t next = 0; next < tree_order_.size(); ++next) {
    const int v = tree_order_[next];
    for (int k = adjacency_begin_[v]; k < adjacency_begin_[v + 1]; ++k) {
      const int edge = adjacency_[k];
      const int u = edge_low_[edge] == v ? edge_high_[edge] : edge_low_[edge];
      if (position_[u] >= 0) continue;
      position_[u] = static_cast<int>(tree_order_.size());
      tree_order_.push_back(u);
      tree_parent_position_.push_back(static_cast<int>(next));
      tree_conductance_.push_back(edge_conductance_[edge]);
    }
  }
  // The off-tree edges are L - L_T; their diagonal is what `tree_and_diagonal` adds. A pivot is
  // its vertex's diagonal less what eliminating its children took,
  //   pivot_v = c_v + off_v + sum_children (c_ch - c_ch^2 / pivot_ch),
  // kept as the excess over c_v so that no term cancels: excess_v = off_v + sum_ch c_ch excess_ch /
  // (c_ch + excess_ch), in place, leaves first. `tree`'s excess is 0: pivot c_v, each subtree's
  // current passing on whole.
  std::vector<double>& excess = excess_;
  excess.assign(static_cast<std::size_t>(n), 0.0);
  for (int edge = 0; edge < edges; ++edge) {
    const int a = position_[edge_low_[edge]], b = position_[edge_high_[edge]];
    if (tree_parent_position_[a] == b || tree_parent_position_[b] == a) continue;  // a tree edge
    excess[a] += edge_conductance_[edge];
    excess[b] += edge_conductance_[edge];
  }
  for (int k = n - 1; k > 0; --k) {
    const double c = tree_conductance_[k];
    excess[tree_parent_position_[k]] += c * excess[k] / (c + excess[k]);
  }
  for (TreeFactor* factor : {&tree_factor_, &diagonal_factor_}) {
    factor->fold.resize(static_cast<std::size_t>(n));
    factor->inverse_pivot.resize(static_cast<std::size_t>(n));
  }
  for (int k = 1; k < n; ++k) {
    const double c = tree_conductance_[k];
    const double pivot = c + excess[k];
    tree_factor_.fold[k] = 1;
    tree_factor_.inverse_pivot[k] = 1 / c;
    diagonal_factor_.fold[k] = c / pivot;
    diagonal_factor_.inverse_pivot[k] = 1 / pivot;
  }
  return true;
}

void GroundedLaplacian::multiply(const std::vector<double>& potential, std::vector<double>& out) const {
  std::fill(out.begin(), out.end(), 0.0);
  for (std::size_t edge = 0; edge < edge_conductance_.size(); ++edge) {
    const int a = edge_low_[edge], b = edge_high_[edge];
    const double current = edge_conductance_[edge] * (potential[a] - potential[b]);
    out[a] += current;
    out[b] -= current;
  }
  out[ground_] = 0;
}

}  // namespace metile::flow_detail
