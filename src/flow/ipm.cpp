// The experimental interior-point max-flow engine (docs/ipm.md). Four phases:
//
//   1. the LP      max F  s.t.  the flow x plus F on a return arc t -> s is a circulation,
//                  0 <= x <= u. Only arcs that can lie on an s-t path take part (forward
//                  reachable from s, backward from t, none into s or out of t, capacity > 0),
//                  so the LP is strictly feasible and its graph connected.
//   2. the IPM     Mehrotra predictor-corrector primal-dual path following from the
//                  infeasible start x = u/2. Each Newton system reduces to one weighted
//                  Laplacian L = A diag(theta) A^T (theta = 1/(z/x + w/(u-x)), the arcs'
//                  conductances): the potentials solve L dy = rhs, and the flow step
//                  dx = theta (A^T dy - rho) is an electrical flow. L is solved by conjugate
//                  gradient preconditioned on a heavy spanning tree (grounded_laplacian.h). Stops on
//                  the duality gap.
//   3. rounding    integers: each arc's flow to the nearest integer in [0, u]; reals: flows
//                  within a hair of a bound snapped onto it. The rounded flow does not
//                  conserve; excesses are walked back and deficits forward along the flow
//                  (reducing it along paths, cancelling cycles met on the way) until every
//                  vertex but s and t conserves, giving a feasible flow. Its s-t paths are
//                  then pushed from zero into the residual graph, as Dinic pushes its paths:
//                  the value is what reaches t, whatever rounding the reals left (below).
//   4. repair      shortest augmenting paths (Dinic's phases, warm-started) from that flow
//                  to a maximum one: the value is exact whatever phases 2-3 achieved, and the
//                  cut is the canonical one (what the final residual graph reaches from s).
//
// Why a spanning tree: the interior-point Laplacians' conductances spread over many orders of
// magnitude. The diagonal (Jacobi) scaling used before removes the spread that is per vertex but
// none of the spread along paths, so its CG steps grew with the network's depth (a 10^4-vertex
// chain took 9.6 s). A tree's Laplacian is solved exactly in O(n) and follows the heavy paths; the
// almost-linear theory's low-stretch trees and dynamic structures are not built (docs/ipm.md).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "grounded_laplacian.h"
#include "residual_graph.h"

namespace metile {
namespace {

// ---------------------------------------------------------------- phase 1: the LP

// The max-flow LP in circulation form over the vertices and arcs that matter. Capacities
// are divided by `scale` (the largest one), so the LP's numbers lie in (0, 1].
struct MaxFlowProgram {
  int vertex_count = 0;
  int source = 0;  // program vertex numbers
  int sink = 0;
  std::vector<int> tail;
  std::vector<int> head;
  std::vector<double> upper;
  std::vector<int> edge;  // input edge number per arc; -1 for the return arc
  int return_arc = 0;
  double scale = 1;
};

template <typename Capacity>
std::optional<MaxFlowProgram> build_program(const FlowNetwork<Capacity>& network, int source, int sink) {
  const int n = network.vertex_count();
  // A forward arc out of `tail` can lie on a simple s-t path only if it carries capacity,
  // does not enter s and does not leave t. For reals the program leaves out arcs of at most 1e-13 of
  // the largest finite capacity (their barrier terms would swamp the rest): what they can carry is
  // added by the repair (augment_to_maximum), whose tolerance is each arc's own.
  Capacity smallest_modelled{};
  if constexpr (std::is_floating_point_v<Capacity>) {
    smallest_modelled = flow_detail::SolverTolerance<Capacity>::kRelative * flow_detail::largest_finite_capacity(network);
  }
  auto usable = [&](int tail, int arc) {
    return network.arc_capacity(arc) > smallest_modelled && network.arc_head(arc) != source && tail != sink;
  };
  std::vector<char> from_source(n, 0);
  std::vector<char> to_sink(n, 0);
  std::vector<int> queue{source};
  from_source[source] = 1;
  for (std::size_t next = 0; next < queue.size(); ++next) {
    const int vertex = queue[next];
    for (int arc = network.arc_begin(vertex); arc < network.arc_end(vertex); ++arc) {
      const int head = network.arc_head(arc);
      if (network.arc_edge(arc) >= 0 && !from_source[head] && usable(vertex, arc)) {
        from_source[head] = 1;
        queue.push_back(head);
      }
    }
  }
  if (!from_source[sink]) return std::nullopt;
  queue.assign(1, sink);
  to_sink[sink] = 1;
  for (std::size_t next = 0; next < queue.size(); ++next) {
    const int vertex = queue[next];
    for (int arc = network.arc_begin(vertex); arc < network.arc_end(vertex); ++arc) {
      const int tail = network.arc_head(arc);  // reverse arc here: the edge runs tail -> vertex
      if (network.arc_edge(arc) < 0 && !to_sink[tail] && usable(tail, network.reverse_arc(arc))) {
        to_sink[tail] = 1;
        queue.push_back(tail);
      }
    }
  }

  MaxFlowProgram program;
  std::vector<int> number(n, -1);
  for (int v = 0; v < n; ++v) {
    if (from_source[v] && to_sink[v]) number[v] = program.vertex_count++;
  }
  program.source = number[source];
  program.sink = number[sink];
  double out_of_source = 0;
  double into_sink = 0;
  double largest = 0;
  for (int vertex = 0; vertex < n; ++vertex) {
    if (number[vertex] < 0) continue;
    for (int arc = network.arc_begin(vertex); arc < network.arc_end(vertex); ++arc) {
      const int head = network.arc_head(arc);
      if (network.arc_edge(arc) < 0 || number[head] < 0 || !usable(vertex, arc)) continue;
      const double capacity = static_cast<double>(network.arc_capacity(arc));
      program.tail.push_back(number[vertex]);
      program.head.push_back(number[head]);
      program.upper.push_back(capacity);
      program.edge.push_back(network.arc_edge(arc));
      if (vertex == source) out_of_source += capacity;
      if (head == sink) into_sink += capacity;
      largest = std::max(largest, capacity);
    }
  }
  // The return arc's bound never binds below the maximum: no flow exceeds either total.
  program.return_arc = static_cast<int>(program.tail.size());
  program.tail.push_back(program.sink);
  program.head.push_back(program.source);
  program.upper.push_back(std::min(out_of_source, into_sink));
  program.edge.push_back(-1);
  program.scale = std::max(largest, program.upper.back());
  for (double& bound : program.upper) bound /= program.scale;
  return program;
}

// ---------------------------------------------------------------- phase 2: path following

// Primal-dual path following for  min c'x  s.t.  A x = 0, 0 <= x <= u  (c = -1 on the
// return arc, 0 elsewhere; A the vertex-arc incidence, +1 at an arc's tail). Dual
// variables: potentials y, z >= 0 for x >= 0, w >= 0 for x <= u; the slack s = u - x is
// kept as its own variable so flows near their capacity keep their precision.
class PathFollowing {
 public:
  struct Targets {
    double gap = 0;          // stop once x'z + s'w is at most this (program units)
    double infeasibility = 0;  // ... and no vertex's conservation is off by more
  };

  PathFollowing(const MaxFlowProgram& program, Targets targets)
      : program_(program),
        targets_(targets),
        arcs_(static_cast<int>(program.tail.size())),
        laplacian_(program.vertex_count, program.tail, program.head, program.source) {}

  // Returns the flow x (program units) at the stop.
  std::vector<double> run(InteriorPointStatistics& statistics) {
    constexpr int kMaxIterations = 200;
    constexpr double kDualFeasibility = 1e-9;  // c and y are of order 1
    const int n = program_.vertex_count;
    x_.resize(arcs_);
    slack_.resize(arcs_);
    for (int arc = 0; arc < arcs_; ++arc) x_[arc] = slack_[arc] = program_.upper[arc] / 2;
    z_.assign(arcs_, 1.0);
    w_.assign(arcs_, 1.0);
    y_.assign(n, 0.0);
    primal_residual_.resize(n);
    dual_residual_.resize(arcs_);
    conductance_.resize(arcs_);
    rhs_.resize(n);
    dy_.assign(n, 0.0);
    dx_.resize(arcs_);
    dz_.resize(arcs_);
    dw_.resize(arcs_);
    rxz_.resize(arcs_);
    rsw_.resize(arcs_);
    rho_.resize(arcs_);

    double best_gap = std::numeric_limits<double>::infinity();
    int iterations_without_progress = 0;
    statistics.stop_reason = "iteration limit";
    for (int iteration = 0;; ++iteration) {
      const double gap = compute_residuals();
      statistics.duality_gap = gap * program_.scale;
      if (!std::isfinite(gap)) {
        statistics.stop_reason = "stalled";
        break;
      }
      if (gap <= targets_.gap && primal_infeasibility_ <= targets_.infeasibility &&
          dual_infeasibility_ <= kDualFeasibility) {
        statistics.stop_reason = "duality gap";
        break;
      }
      // No tenfold gap reduction in eight iterations: rounding in the Laplacian solves
      // dominates, and the repair finishes faster than more iterations would.
      if (gap < 0.1 * best_gap) {
        best_gap = gap;
        iterations_without_progress = 0;
      } else if (++iterations_without_progress >= 8) {
        statistics.stop_reason = "stalled";
        break;
      }
      if (iteration >= kMaxIterations) break;
      ++statistics.iterations;
      const double mu = gap / (2.0 * arcs_);
      for (int arc = 0; arc < arcs_; ++arc) {
        conductance_[arc] = 1 / (z_[arc] / x_[arc] + w_[arc] / slack_[arc]);
      }
      laplacian_.set_conductances(conductance_);

      // Predictor: the affine-scaling direction (no centering).
      for (int arc = 0; arc < arcs_; ++arc) {
        rxz_[arc] = -x_[arc] * z_[arc];
        rsw_[arc] = -slack_[arc] * w_[arc];
      }
      solve_newton_system(statistics, /*race=*/true);
      const auto [affine_primal, affine_dual] = step_lengths();
      double affine_gap = 0;
      for (int arc = 0; arc < arcs_; ++arc) {
        affine_gap += (x_[arc] + affine_primal * dx_[arc]) * (z_[arc] + affine_dual * dz_[arc]) +
                      (slack_[arc] - affine_primal * dx_[arc]) * (w_[arc] + affine_dual * dw_[arc]);
      }
      const double sigma = std::pow(std::clamp(affine_gap / gap, 0.0, 1.0), 3);

      // Corrector: centering toward sigma * mu plus Mehrotra's second-order term.
      for (int arc = 0; arc < arcs_; ++arc) {
        rxz_[arc] = sigma * mu - x_[arc] * z_[arc] - dx_[arc] * dz_[arc];
        rsw_[arc] = sigma * mu - slack_[arc] * w_[arc] + dx_[arc] * dw_[arc];
      }
      solve_newton_system(statistics, /*race=*/false);
      if (!direction_is_finite()) {
        // A flow or slack so close to 0 that its reciprocal overflowed: the iterate is as
        // good as double precision makes it; keep it rather than step into NaN.
        statistics.stop_reason = "stalled";
        break;
      }
      auto [primal_step, dual_step] = step_lengths();
      constexpr double kFractionToBoundary = 0.99;
      primal_step = std::min(1.0, kFractionToBoundary * primal_step);
      dual_step = std::min(1.0, kFractionToBoundary * dual_step);
      if (!std::isfinite(primal_step) || !std::isfinite(dual_step)) {
        statistics.stop_reason = "stalled";
        break;
      }
      for (int arc = 0; arc < arcs_; ++arc) {
        x_[arc] += primal_step * dx_[arc];
        slack_[arc] -= primal_step * dx_[arc];
        z_[arc] += dual_step * dz_[arc];
        w_[arc] += dual_step * dw_[arc];
      }
      for (int v = 0; v < n; ++v) y_[v] += dual_step * dy_[v];
    }
    return x_;
  }

 private:
  // r_p = -A x, r_d = c - A^T y - z + w; returns the complementarity gap x'z + s'w.
  double compute_residuals() {
    std::fill(primal_residual_.begin(), primal_residual_.end(), 0.0);
    double gap = 0;
    dual_infeasibility_ = 0;
    for (int arc = 0; arc < arcs_; ++arc) {
      const int tail = program_.tail[arc];
      const int head = program_.head[arc];
      primal_residual_[tail] -= x_[arc];
      primal_residual_[head] += x_[arc];
      const double cost = arc == program_.return_arc ? -1.0 : 0.0;
      dual_residual_[arc] = cost - (y_[tail] - y_[head]) - z_[arc] + w_[arc];
      dual_infeasibility_ = std::max(dual_infeasibility_, std::abs(dual_residual_[arc]));
      gap += x_[arc] * z_[arc] + slack_[arc] * w_[arc];
    }
    primal_infeasibility_ = 0;
    for (const double value : primal_residual_) primal_infeasibility_ = std::max(primal_infeasibility_, std::abs(value));
    return gap;
  }

  // Given rxz_ and rsw_ (the complementarity right-hand sides), solves the Newton system:
  //   rho = r_d - rxz / x + rsw / s,  L dy = r_p + A theta rho,  dx = theta (A^T dy - rho),
  //   dz = (rxz - z dx) / x,  dw = (rsw + w dx) / s.
  void solve_newton_system(InteriorPointStatistics& statistics, bool race) {
    std::copy(primal_residual_.begin(), primal_residual_.end(), rhs_.begin());
    for (int arc = 0; arc < arcs_; ++arc) {
      rho_[arc] = dual_residual_[arc] - rxz_[arc] / x_[arc] + rsw_[arc] / slack_[arc];
      const double current = conductance_[arc] * rho_[arc];
      rhs_[program_.tail[arc]] += current;
      rhs_[program_.head[arc]] -= current;
    }
    // The corrector starts from the predictor's potentials: same matrix, nearby right side.
    constexpr double kRelativeTolerance = 1e-10;
    const int max_steps = std::max(200, 2 * program_.vertex_count);
    const flow_detail::GroundedLaplacian::Outcome outcome = laplacian_.solve(rhs_, dy_, kRelativeTolerance, max_steps, race);
    statistics.cg_steps += outcome.steps;
    ++statistics.laplacian_solves;
    if (!outcome.converged) ++statistics.unconverged_solves;
    for (int arc = 0; arc < arcs_; ++arc) {
      dx_[arc] = conductance_[arc] * ((dy_[program_.tail[arc]] - dy_[program_.head[arc]]) - rho_[arc]);
      dz_[arc] = (rxz_[arc] - z_[arc] * dx_[arc]) / x_[arc];
      dw_[arc] = (rsw_[arc] + w_[arc] * dx_[arc]) / slack_[arc];
    }
  }

  bool direction_is_finite() const {
    auto finite = [](const std::vector<double>& values) {
      return std::all_of(values.begin(), values.end(), [](double value) { return std::isfinite(value); });
    };
    return finite(dx_) && finite(dz_) && finite(dw_) && finite(dy_);
  }

  // The longest primal and dual steps that keep x, s, z, w nonnegative.
  std::pair<double, double> step_lengths() const {
    double primal = std::numeric_limits<double>::infinity();
    double dual = std::numeric_limits<double>::infinity();
    for (int arc = 0; arc < arcs_; ++arc) {
      if (dx_[arc] < 0) primal = std::min(primal, -x_[arc] / dx_[arc]);
      if (dx_[arc] > 0) primal = std::min(primal, slack_[arc] / dx_[arc]);
      if (dz_[arc] < 0) dual = std::min(dual, -z_[arc] / dz_[arc]);
      if (dw_[arc] < 0) dual = std::min(dual, -w_[arc] / dw_[arc]);
    }
    return {std::min(primal, 1.0), std::min(dual, 1.0)};
  }

  const MaxFlowProgram& program_;
  const Targets targets_;
  const int arcs_;
  flow_detail::GroundedLaplacian laplacian_;
  std::vector<double> x_, slack_, z_, w_, y_;
  std::vector<double> primal_residual_, dual_residual_, conductance_, rhs_;
  std::vector<double> dy_, dx_, dz_, dw_, rxz_, rsw_, rho_;
  double primal_infeasibility_ = 0;
  double dual_infeasibility_ = 0;
};

// ---------------------------------------------------------------- phase 3: rounding

// Input-edge flows from the program's: nearest integer (integers) or snapped onto a bound
// within `snap` (reals), always inside [0, capacity]. Edges outside the program carry 0.
template <typename Capacity>
std::vector<Capacity> rounded_flows(const FlowNetwork<Capacity>& network, const MaxFlowProgram& program,
                                    const std::vector<double>& x) {
  std::vector<Capacity> flows(network.edge_count(), Capacity{});
  for (std::size_t arc = 0; arc < x.size(); ++arc) {
    const int edge = program.edge[arc];
    if (edge < 0) continue;
    const Capacity capacity = network.edge(edge).capacity;
    const double flow = std::isfinite(x[arc]) ? x[arc] * program.scale : 0.0;  // the repair makes up for it
    if constexpr (std::is_integral_v<Capacity>) {
      flows[edge] = std::clamp<Capacity>(static_cast<Capacity>(std::llround(std::max(flow, 0.0))), 0, capacity);
    } else {
      const double snap = 1e-9 * program.scale;
      flows[edge] = flow <= snap ? 0 : capacity - flow <= snap ? capacity : std::clamp(flow, 0.0, capacity);
    }
  }
  return flows;
}

// Makes a flow that respects capacities conserve at every vertex but s and t, by lowering
// it: an excess (inflow > outflow) is walked back against the flow and a deficit forward
// along it, to s, t or a vertex of the opposite imbalance, lowering the flow on the path
// found. By flow decomposition such a path always exists. A cycle met on the way is
// cancelled (lowered by its smallest flow). Each reduction empties an edge or settles an
// imbalance, and flows only go down, so there are at most edges + vertices reductions;
// each costs a path's length, O(n m) in all (dynamic trees would make it O(m log n)).
template <typename Capacity>
class ConservationRepair {
 public:
  ConservationRepair(const FlowNetwork<Capacity>& network, int source, int sink, std::vector<Capacity>& flow)
      : network_(network),
        source_(source),
        sink_(sink),
        flow_(flow),
        imbalance_(network.vertex_count(), Capacity{}),
        current_arc_(network.vertex_count()),
        dead_(network.vertex_count()),
        position_(network.vertex_count(), -1) {
    for (int e = 0; e < network.edge_count(); ++e) {
      const FlowEdge<Capacity>& edge = network.edge(e);
      if (edge.from == edge.to) continue;
      imbalance_[edge.to] += flow[e];
      imbalance_[edge.from] -= flow[e];
    }
  }

  // Returns the number of path and cycle reductions.
  long long run() {
    for (const bool backward : {true, false}) {
      std::copy(network_.arc_offsets().begin(), network_.arc_offsets().end() - 1, current_arc_.begin());
      std::fill(dead_.begin(), dead_.end(), 0);
      for (int v = 0; v < network_.vertex_count(); ++v) {
        if (v != source_ && v != sink_ && tolerance_.positive(backward ? imbalance_[v] : -imbalance_[v])) {
          settle(v, backward);
        }
      }
    }
    return reductions_;
  }

 private:
  // Backward: an excess at `start`, searched against the flow; forward: a deficit, along it.
  void settle(int start, bool backward) {
    auto remaining = [&](int v) { return backward ? imbalance_[v] : -imbalance_[v]; };
    auto is_end = [&](int v) {
      return v == source_ || v == sink_ || tolerance_.positive(backward ? -imbalance_[v] : imbalance_[v]);
    };
    vertices_.assign(1, start);
    edges_.clear();
    position_[start] = 0;
    while (tolerance_.positive(remaining(start))) {
      const int vertex = vertices_.back();
      if (vertex != start && is_end(vertex)) {
        reduce_path(start, vertex, backward);
        continue;
      }
      int next_vertex = -1;
      int next_edge = -1;
      for (int& arc = current_arc_[vertex]; arc < network_.arc_end(vertex); ++arc) {
        // Backward: reverse arcs (edges into vertex); forward: forward arcs (edges out of it).
        const bool forward_arc = network_.arc_edge(arc) >= 0;
        if (forward_arc == backward) continue;
        const int edge = forward_arc ? network_.arc_edge(arc) : network_.arc_edge(network_.reverse_arc(arc));
        const int other = network_.arc_head(arc);
        if (!dead_[other] && tolerance_.positive(flow_[edge])) {
          next_vertex = other;
          next_edge = edge;
          break;
        }
      }
      if (next_vertex < 0) {
        // Nothing reachable from here settles anything now, nor later: flows and
        // imbalances of the opposite sign only shrink.
        dead_[vertex] = 1;
        if (vertex == start) break;  // only rounding noise of real capacities is left
        truncate(vertices_.size() - 2);  // pop it
        continue;
      }
      if (position_[next_vertex] >= 0) {
        cancel_cycle(position_[next_vertex], next_edge);
        continue;
      }
      position_[next_vertex] = static_cast<int>(vertices_.size());
      vertices_.push_back(next_vertex);
      edges_.push_back(next_edge);
    }
    if constexpr (std::is_integral_v<Capacity>) {
      if (imbalance_[start] != 0) {
        throw std::logic_error("ipm: vertex " + std::to_string(start) +
                               " keeps an imbalance no path settles (a flow decomposition says none exists)");
      }
    }
    truncate(0);
    position_[start] = -1;
  }

  // Lowers the flow on the stacked path from `start` to `end` by as much as both
  // imbalances and the path's edges allow.
  void reduce_path(int start, int end, bool backward) {
    Capacity amount = backward ? imbalance_[start] : -imbalance_[start];
    const bool end_is_terminal = end == source_ || end == sink_;
    if (!end_is_terminal) amount = std::min(amount, backward ? -imbalance_[end] : imbalance_[end]);
    for (const int edge : edges_) amount = std::min(amount, flow_[edge]);
    lower(edges_.begin(), edges_.end(), amount);
    // The start's inflow (backward) or outflow (forward) drops, and the end's opposite.
    settle_imbalance(start, backward ? -amount : amount);
    settle_imbalance(end, backward ? amount : -amount);
    ++reductions_;
    truncate_at_first_empty(0);
  }

  // The stacked vertex at `first` closes a cycle through `closing_edge`.
  void cancel_cycle(int first, int closing_edge) {
    Capacity amount = flow_[closing_edge];
    for (std::size_t i = first; i < edges_.size(); ++i) amount = std::min(amount, flow_[edges_[i]]);
    lower(edges_.begin() + first, edges_.end(), amount);
    flow_[closing_edge] = flow_[closing_edge] == amount ? Capacity{} : flow_[closing_edge] - amount;
    ++reductions_;
    truncate_at_first_empty(first);
  }

  template <typename Iterator>
  void lower(Iterator begin, Iterator end, Capacity amount) {
    // x - x is exactly 0 in floating point too, so a bottleneck edge empties exactly.
    for (Iterator it = begin; it != end; ++it) flow_[*it] = flow_[*it] == amount ? Capacity{} : flow_[*it] - amount;
  }

  void settle_imbalance(int vertex, Capacity change) {
    imbalance_[vertex] = imbalance_[vertex] == -change ? Capacity{} : imbalance_[vertex] + change;
  }

  // Pops the stack back to the tail of the first emptied edge at or after `from`.
  void truncate_at_first_empty(std::size_t from) {
    for (std::size_t i = from; i < edges_.size(); ++i) {
      if (!tolerance_.positive(flow_[edges_[i]])) {
        truncate(i);
        return;
      }
    }
  }

  // Keeps vertices_[0..keep] and the edges between them.
  void truncate(std::size_t keep) {
    for (std::size_t i = keep + 1; i < vertices_.size(); ++i) position_[vertices_[i]] = -1;
    vertices_.resize(keep + 1);
    edges_.resize(keep);
  }

  const FlowNetwork<Capacity>& network_;
  const int source_;
  const int sink_;
  // Zero even for reals: imbalances under the solvers' epsilon, left alone, add up along a
  // path to residuals above it and move the canonical cut. Settled exactly instead (x - x
  // is 0 in floating point too), only rounding in the sums of a vertex's flows is left.
  const FlowTolerance<Capacity> tolerance_{};
  std::vector<Capacity>& flow_;
  std::vector<Capacity> imbalance_;  // inflow - outflow
  std::vector<int> current_arc_;
  std::vector<char> dead_;
  std::vector<int> position_;  // index in vertices_, -1 when not on the stack
  std::vector<int> vertices_;  // the search path from its start
  std::vector<int> edges_;     // edges_[i] joins vertices_[i] and vertices_[i + 1]
  long long reductions_ = 0;
};

// The flow that reaches the sink along `flow`'s s-t paths, pushed from zero into `residual`
// (set to the network's capacities first) with Dinic's arithmetic and tolerance; returns its value.
//
// Why not take `flow` as it is: for reals it conserves only up to rounding at the scale of
// its largest arc flows, and the interior point leaves circulations as large as the largest
// capacity (x starts at u/2). With 1e15-capacity cycles around a 1e6 flow, ConservationRepair
// subtracts amounts of 1e14 whose last bits (0.06) are lost, so vertices keep imbalances
// of 0.1: the source's outflow, once the value, exceeded what reached the sink and the
// capacity of the cut's arcs that can carry flow (tests/data/flow/ipm_real_1e15_cycles.max:
// 1179749.617 against 1179749.555). Here every path pushes the same amount on each
// of its arcs, cycles are cancelled in `flow` without being pushed, and leftover imbalances
// are dead ends: the result is a flow whose value is the sum of what was pushed, exact for
// integers. A depth-first search with current arcs; each push or cancellation empties an arc
// and dead ends stay dead (flows and residuals only go down), so O(n m) in all.
template <typename Capacity>
Capacity push_flow_paths(const FlowNetwork<Capacity>& network, int source, int sink, std::vector<Capacity> flow,
                         const flow_detail::SolverTolerance<Capacity>& tolerance, std::vector<Capacity>& residual) {
  residual.assign(network.arc_capacities().begin(), network.arc_capacities().end());
  // Only forward arcs are walked: what an arc can still pass is the smaller of its flow and residual.
  auto room = [&](int arc) { return std::min(flow[network.arc_edge(arc)], residual[arc]); };
  std::vector<int> current_arc(network.arc_offsets().begin(), network.arc_offsets().end() - 1);
  std::vector<char> dead(network.vertex_count(), 0);
  std::vector<int> position(network.vertex_count(), -1);  // arcs on the path before the vertex; -1 off it
  std::vector<int> path;                                  // arcs from the source
  int vertex = source;
  position[source] = 0;
  // Keeps the first `keep` arcs of the path and continues from the last one's head.
  auto retreat = [&](std::size_t keep) {
    for (std::size_t i = keep; i < path.size(); ++i) position[network.arc_head(path[i])] = -1;
    path.resize(keep);
    vertex = keep == 0 ? source : network.arc_head(path.back());
  };
  // The first arc of the path at or after `from` with no room left (path.size() when none).
  auto first_empty = [&](std::size_t from) {
    while (from < path.size() && tolerance.arc_positive(path[from], room(path[from]))) ++from;
    return from;
  };
  Capacity value{};
  while (true) {
    if (vertex == sink) {
      Capacity amount = room(path.front());
      for (const int arc : path) amount = std::min(amount, room(arc));
      for (const int arc : path) {  // amount <= each term, so nothing goes negative; x - x is 0
        residual[arc] -= amount;
        residual[network.reverse_arc(arc)] += amount;
        flow[network.arc_edge(arc)] -= amount;
      }
      value += amount;
      retreat(first_empty(0));
      continue;
    }
    int& arc = current_arc[vertex];
    while (arc < network.arc_end(vertex) &&
           !(network.arc_edge(arc) >= 0 && !dead[network.arc_head(arc)] && tolerance.arc_positive(arc, room(arc)))) {
      ++arc;
    }
    if (arc == network.arc_end(vertex)) {
      if (vertex == source) return value;
      dead[vertex] = 1;  // flow in, none out toward the sink: an imbalance left by rounding
      retreat(path.size() - 1);
      continue;
    }
    const int head = network.arc_head(arc);
    if (position[head] < 0) {
      position[head] = static_cast<int>(path.size()) + 1;
      path.push_back(arc);
      vertex = head;
      continue;
    }
    // A cycle of the flow (path[position[head]..] and `arc`) carries no value: cancel it.
    const std::size_t first = static_cast<std::size_t>(position[head]);
    Capacity amount = flow[network.arc_edge(arc)];
    for (std::size_t i = first; i < path.size(); ++i) amount = std::min(amount, flow[network.arc_edge(path[i])]);
    for (std::size_t i = first; i < path.size(); ++i) flow[network.arc_edge(path[i])] -= amount;
    flow[network.arc_edge(arc)] -= amount;
    retreat(first_empty(first));  // when only `arc` emptied, the current arc passes over it next
  }
}

// Reals: the flow ipm ends with is maximum up to rounding, so an arc every exact maximum flow saturates
// can keep a residual just above its threshold (1.5e-14 on a 0.125 edge of a network of c/8 capacities:
// 1.2e-13 of it, against 1e-13) and the source side reaches past the smallest minimum cut, Dinic's. The
// side that also takes residuals up to 1e-11 of their arc's capacity as saturated replaces `side` when
// its cut is no larger than `side`'s (both then minimum up to rounding): never larger than `side`, and
// never smaller than the smallest minimum cut, which every minimum cut holds.
std::vector<bool> smaller_minimum_cut(const FlowNetwork<double>& network, int source, const std::vector<double>& residual,
                                      const flow_detail::SolverTolerance<double>& tolerance, std::vector<bool> side) {
  constexpr double kSaturated = 1e-11;  // of the arc's capacity
  std::vector<bool> smaller = flow_detail::reachable_in_residual(network, residual, {source}, tolerance, kSaturated);
  if (smaller != side && cut_capacity(network, smaller) <= cut_capacity(network, side)) side = std::move(smaller);
  return side;
}

}  // namespace

template <typename Capacity>
MaxFlowResult<Capacity> ipm(const FlowNetwork<Capacity>& network, int source, int sink,
                            const MaxFlowOptions& options) {
  flow_detail::check_terminals(network, source, sink, "ipm");
  InteriorPointStatistics statistics;
  std::vector<Capacity> flow(network.edge_count(), Capacity{});
  if (const std::optional<MaxFlowProgram> program = build_program(network, source, sink)) {
    // Integers: a gap below a quarter unit leaves rounding little to fix. Reals: a tenth of
    // verify()'s tolerance. Either way no tighter than double rounding of the total allows.
    double capacity_total = 0;
    for (const double bound : program->upper) capacity_total += bound;
    const double floor_by_precision = 1e-12 * capacity_total;
    const double target = std::is_integral_v<Capacity> ? 0.25 / program->scale : 1e-10 * capacity_total;
    const PathFollowing::Targets targets{std::max(target, floor_by_precision), std::max(target, floor_by_precision)};
    PathFollowing path_following(*program, targets);
    flow = rounded_flows(network, *program, path_following.run(statistics));
  } else {
    statistics.stop_reason = "no s-t path";  // or none the LP models: said after the repair, below
  }
  statistics.conservation_fixes = ConservationRepair<Capacity>(network, source, sink, flow).run();

  // Not the source's net outflow of `flow`: for reals that flow conserves only up to
  // rounding (push_flow_paths says why), and its outflow can exceed what reaches the sink.
  std::vector<Capacity> residual;
  const flow_detail::SolverTolerance<Capacity> tolerance(network, source, sink);
  Capacity value = push_flow_paths(network, source, sink, std::move(flow), tolerance, residual);
  statistics.rounded_value = static_cast<double>(value);
  const flow_detail::AugmentingCounts repair = flow_detail::augment_to_maximum(network, source, sink, residual, value);
  statistics.repair_paths = repair.paths;
  statistics.repair_phases = repair.phases;
  // For reals an s-t path of arcs at most 1e-13 of the largest capacity is not modelled (build_program)
  // and the repair finds its flow: "no s-t path" was said of a network whose flow is 50.
  if (statistics.stop_reason == "no s-t path" && value > Capacity{}) statistics.stop_reason = "no modelled s-t path";

  MaxFlowResult<Capacity> result;
  result.value = value;
  result.source_side = flow_detail::reachable_in_residual(network, residual, {source}, tolerance);
  if constexpr (!std::is_integral_v<Capacity>) {
    result.source_side = smaller_minimum_cut(network, source, residual, tolerance, std::move(result.source_side));
  }
  if (options.edge_flows) result.edge_flows = flow_detail::edge_flows_from_residual(network, residual);
  result.solver = "ipm";
  result.interior_point = statistics;
  return result;
}

template MaxFlowResult<std::int64_t> ipm(const FlowNetwork<std::int64_t>&, int, int, const MaxFlowOptions&);
template MaxFlowResult<double> ipm(const FlowNetwork<double>&, int, int, const MaxFlowOptions&);

}  // namespace metile
