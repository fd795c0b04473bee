// Highest-label push-relabel (Goldberg-Tarjan with the Cherkassky-Goldberg heuristics),
// shaped like LEMON's Preflow: init(), first_phase(), second_phase(), one call to run.
//
//   first phase:  preflow; always discharge an active vertex of the highest label < n;
//                 gap heuristic (an emptied label cuts off everything above it) and a
//                 global relabel (reverse BFS from the sink) whenever the relabel work
//                 since the last one exceeds a multiple of n and m. When no vertex is
//                 active, excess(sink) is the maximum flow value, and the canonical
//                 minimum cut is read off the preflow (see minimum_cut_side).
//   second phase: only when per-edge flows are wanted: push the excess stranded on
//                 the source side back to the source, turning the preflow into a flow.
//
// O(V^2 sqrt(E)) for the first phase. Hot loops touch only flat arrays: CSR heads and
// reverse arcs, residual capacities, labels, and intrusive per-label lists; nothing is
// allocated after init().
#include <algorithm>
#include <type_traits>
#include <vector>

#include "residual_graph.h"

namespace metile {
namespace {

template <typename Capacity>
class HighestLabelPreflow {
 public:
  HighestLabelPreflow(const FlowNetwork<Capacity>& network, int source, int sink)
      : network_(network),
        vertex_count_(network.vertex_count()),
        source_(source),
        sink_(sink),
        tolerance_(network, source, sink),
        heads_(network.arc_heads().data()),
        reverse_(network.reverse_arcs().data()),
        offsets_(network.arc_offsets().data()) {}

  void init() {
    const int n = vertex_count_;
    residual_.assign(network_.arc_capacities().begin(), network_.arc_capacities().end());
    excess_.assign(n, Capacity{});
    label_.assign(n, n);
    current_arc_.assign(offsets_, offsets_ + n);
    active_first_.assign(n + 1, kNone);
    active_next_.assign(n, kNone);
    level_first_.assign(n + 1, kNone);
    level_next_.assign(n, kNone);
    level_previous_.assign(n, kNone);
    queue_.resize(n);
    // Saturate every arc out of the source; the source's own excess is never looked at.
    for (int arc = offsets_[source_]; arc < offsets_[source_ + 1]; ++arc) {
      const Capacity amount = residual_[arc];
      if (!tolerance_.arc_positive(arc, amount)) continue;
      residual_[arc] = 0;
      residual_[reverse_[arc]] += amount;
      excess_[heads_[arc]] += amount;
    }
    const long arc_count = network_.arc_count();
    global_relabel_threshold_ = static_cast<long>(kGlobalRelabelFrequency * (kAlpha * n + arc_count / 2));
    global_relabel();
  }

  // Returns false when the deadline passed before the preflow was maximum.
  bool first_phase(flow_detail::Deadline& deadline) {
    while (highest_active_ >= 0) {
      if (deadline.expired()) return false;
      const int vertex = active_first_[highest_active_];
      if (vertex == kNone) {
        --highest_active_;
        continue;
      }
      active_first_[highest_active_] = active_next_[vertex];
      discharge(vertex);
      if (work_since_global_relabel_ > global_relabel_threshold_) global_relabel();
    }
    return true;
  }

  // Returns the stranded excess to the source. Every vertex with excess has a residual path
  // back to the source (along the preflow's own paths), so a push-relabel with labels =
  // residual distance to the source drains it; FIFO order is plenty here.
  void second_phase() {
    const int n = vertex_count_;
    std::fill(label_.begin(), label_.end(), kNone);
    int queue_end = 0;
    label_[source_] = 0;
    queue_[queue_end++] = source_;
    for (int next = 0; next < queue_end; ++next) {
      const int vertex = queue_[next];
      for (int arc = offsets_[vertex]; arc < offsets_[vertex + 1]; ++arc) {
        const int tail = heads_[arc];
        if (label_[tail] == kNone && tail != sink_ && tolerance_.arc_positive(reverse_[arc], residual_[reverse_[arc]])) {
          label_[tail] = label_[vertex] + 1;
          queue_[queue_end++] = tail;
        }
      }
    }
    label_[sink_] = kUnreachableLabel;  // never pushed into: the sink's excess is the flow value
    std::vector<int> fifo;
    for (int v = 0; v < n; ++v) {
      current_arc_[v] = offsets_[v];
      if (v != source_ && v != sink_ && tolerance_.excess_positive(v, excess_[v])) fifo.push_back(v);
    }
    for (std::size_t next = 0; next < fifo.size(); ++next) {
      const int vertex = fifo[next];
      while (tolerance_.excess_positive(vertex, excess_[vertex])) {
        int arc = current_arc_[vertex];
        const int end = offsets_[vertex + 1];
        for (; arc < end; ++arc) {
          const int head = heads_[arc];
          if (label_[head] == label_[vertex] - 1 && tolerance_.arc_positive(arc, residual_[arc])) {
            const Capacity amount = std::min(excess_[vertex], residual_[arc]);
            const bool head_was_queued = head == source_ || tolerance_.excess_positive(head, excess_[head]);
            push(arc, vertex, head, amount);
            if (!head_was_queued && tolerance_.excess_positive(head, excess_[head])) fifo.push_back(head);
            if (!tolerance_.excess_positive(vertex, excess_[vertex])) break;
          }
        }
        current_arc_[vertex] = std::min(arc, end);
        // Without a way back (only possible through rounding with real capacities) the
        // excess stays; verify() judges whether it is within tolerance. The vertex leaves the
        // labels, as the sink: a push into it later would find it holding excess, take it for
        // queued, and strand the pushed amount too (1e6 where 9 was stuck).
        if (tolerance_.excess_positive(vertex, excess_[vertex]) && !relabel_towards_source(vertex)) {
          label_[vertex] = kUnreachableLabel;
          break;
        }
      }
    }
  }

  Capacity value() const { return excess_[sink_]; }
  const std::vector<Capacity>& residual() const { return residual_; }

  // The smallest minimum cut: the vertices reachable from the source in the residual of any
  // maximum flow. From a maximum preflow it is what the residual reaches from the source and
  // from every vertex holding excess: returning that excess opens exactly the arcs along
  // its paths, which the preflow's reverse residual arcs already lead back through.
  std::vector<bool> minimum_cut_side() const {
    std::vector<int> roots{source_};
    for (int v = 0; v < vertex_count_; ++v) {
      if (v != sink_ && v != source_ && tolerance_.excess_positive(v, excess_[v])) roots.push_back(v);
    }
    return flow_detail::reachable_in_residual(network_, residual_, roots, tolerance_);
  }

 private:
  static constexpr int kNone = -1;
  static constexpr int kUnreachableLabel = 1 << 30;  // second phase: the sink, never a push target
  // Cherkassky-Goldberg constants (as in their hi_pr): a relabel costs its arc scan plus
  // kRelabelCost; a global relabel is due after kGlobalRelabelFrequency * (alpha n + m) work.
  static constexpr long kAlpha = 6;
  static constexpr long kRelabelCost = 12;
  static constexpr double kGlobalRelabelFrequency = 2.0;

  void push(int arc, int from, int to, Capacity amount) {
    residual_[arc] -= amount;
    residual_[reverse_[arc]] += amount;
    excess_[from] -= amount;
    excess_[to] += amount;
  }

  void add_to_level(int vertex, int level) {
    const int first = level_first_[level];
    level_next_[vertex] = first;
    level_previous_[vertex] = kNone;
    if (first != kNone) level_previous_[first] = vertex;
    level_first_[level] = vertex;
  }

  void remove_from_level(int vertex, int level) {
    const int previous = level_previous_[vertex];
    const int next = level_next_[vertex];
    if (previous != kNone) {
      level_next_[previous] = next;
    } else {
      level_first_[level] = next;
    }
    if (next != kNone) level_previous_[next] = previous;
  }

  void activate(int vertex, int level) {
    active_next_[vertex] = active_first_[level];
    active_first_[level] = vertex;
    if (level > highest_active_) highest_active_ = level;
  }

  // Push along admissible arcs (label drops by one) until the excess is gone or none is
  // left, then relabel; repeat while the vertex stays below n.
  void discharge(int vertex) {
    const int n = vertex_count_;
    Capacity* residual = residual_.data();
    Capacity* excess = excess_.data();
    int* label = label_.data();
    while (true) {
      const int wanted = label[vertex] - 1;
      const int end = offsets_[vertex + 1];
      for (int arc = current_arc_[vertex]; arc < end; ++arc) {
        const int head = heads_[arc];
        if (label[head] != wanted || !tolerance_.arc_positive(arc, residual[arc])) continue;
        const Capacity amount = std::min(excess[vertex], residual[arc]);
        // A vertex joins the active list when its excess turns positive, once: with real capacities an
        // amount above this vertex's and the arc's thresholds can stay below the head's, and activating
        // the head before the push (while its excess was not positive) listed it twice, a cycle in the
        // list (HLPP looped, or stopped with the sink on the source side).
        const bool head_was_active = head == sink_ || tolerance_.excess_positive(head, excess[head]);
        residual[arc] -= amount;
        residual[reverse_[arc]] += amount;
        excess[head] += amount;
        excess[vertex] -= amount;
        if (!head_was_active && tolerance_.excess_positive(head, excess[head])) activate(head, wanted);
        if (!tolerance_.excess_positive(vertex, excess[vertex])) {
          current_arc_[vertex] = arc;
          return;
        }
      }
      // No admissible arc: relabel to one above the lowest residual neighbour.
      const int old_level = label[vertex];
      int lowest = 2 * n;
      int lowest_arc = end;
      for (int arc = offsets_[vertex]; arc < end; ++arc) {
        if (tolerance_.arc_positive(arc, residual[arc]) && label[heads_[arc]] < lowest) {
          lowest = label[heads_[arc]];
          lowest_arc = arc;
        }
      }
      work_since_global_relabel_ += kRelabelCost + (end - offsets_[vertex]);
      remove_from_level(vertex, old_level);
      if (level_first_[old_level] == kNone) {
        // Gap: nothing left at old_level, so no vertex above it can reach the sink.
        for (int level = old_level + 1; level <= highest_level_; ++level) {
          for (int other = level_first_[level]; other != kNone; other = level_next_[other]) label[other] = n;
          level_first_[level] = kNone;
          active_first_[level] = kNone;
        }
        highest_level_ = old_level - 1;
        label[vertex] = n;
        return;
      }
      const int new_level = lowest + 1;
      if (new_level >= n) {
        label[vertex] = n;
        return;
      }
      label[vertex] = new_level;
      current_arc_[vertex] = lowest_arc;
      add_to_level(vertex, new_level);
      if (new_level > highest_level_) highest_level_ = new_level;
      highest_active_ = std::max(highest_active_, new_level);
    }
  }

  // Exact labels: residual distance to the sink by reverse BFS; unreachable vertices (and
  // the source) get n and leave the first phase for good.
  void global_relabel() {
    const int n = vertex_count_;
    std::fill(label_.begin(), label_.end(), n);
    std::fill(level_first_.begin(), level_first_.end(), kNone);
    std::fill(active_first_.begin(), active_first_.end(), kNone);
    highest_active_ = -1;
    highest_level_ = 0;
    int queue_end = 0;
    label_[sink_] = 0;
    queue_[queue_end++] = sink_;
    add_to_level(sink_, 0);
    for (int next = 0; next < queue_end; ++next) {
      const int vertex = queue_[next];
      const int level = label_[vertex] + 1;
      for (int arc = offsets_[vertex]; arc < offsets_[vertex + 1]; ++arc) {
        const int tail = heads_[arc];
        if (label_[tail] != n || tail == source_ || !tolerance_.arc_positive(reverse_[arc], residual_[reverse_[arc]])) continue;
        label_[tail] = level;
        queue_[queue_end++] = tail;
        current_arc_[tail] = offsets_[tail];
        add_to_level(tail, level);
        highest_level_ = level;
        if (tolerance_.excess_positive(tail, excess_[tail])) activate(tail, level);
      }
    }
    work_since_global_relabel_ = 0;
  }

  bool relabel_towards_source(int vertex) {
    int lowest = kUnreachableLabel;
    int lowest_arc = offsets_[vertex];
    for (int arc = offsets_[vertex]; arc < offsets_[vertex + 1]; ++arc) {
      const int head_label = label_[heads_[arc]];
      if (head_label != kNone && head_label < lowest && tolerance_.arc_positive(arc, residual_[arc])) {
        lowest = head_label;
        lowest_arc = arc;
      }
    }
    // Labels of vertices with excess stay below 2n when a path back exists (Goldberg-Tarjan).
    if (lowest >= 2 * vertex_count_) return false;
    label_[vertex] = lowest + 1;
    current_arc_[vertex] = lowest_arc;
    return true;
  }

  const FlowNetwork<Capacity>& network_;
  const int vertex_count_;
  const int source_;
  const int sink_;
  const flow_detail::SolverTolerance<Capacity> tolerance_;
  const int* heads_;
  const int* reverse_;
  const int* offsets_;

  std::vector<Capacity> residual_;
  std::vector<Capacity> excess_;
  std::vector<int> label_;
  std::vector<int> current_arc_;
  // Active vertices per label (singly linked stacks) and all vertices per label (doubly
  // linked, for the gap heuristic). Only labels below n are listed.
  std::vector<int> active_first_;
  std::vector<int> active_next_;
  std::vector<int> level_first_;
  std::vector<int> level_next_;
  std::vector<int> level_previous_;
  std::vector<int> queue_;
  int highest_active_ = -1;
  int highest_level_ = 0;
  long work_since_global_relabel_ = 0;
  long global_relabel_threshold_ = 0;
};

}  // namespace

namespace flow_detail {

template <typename Capacity>
std::optional<MaxFlowResult<Capacity>> hlpp_until(const FlowNetwork<Capacity>& network, int source, int sink,
                                                  const MaxFlowOptions& options, Deadline deadline) {
  check_terminals(network, source, sink, "hlpp");
  HighestLabelPreflow<Capacity> solver(network, source, sink);
  solver.init();
  if (!solver.first_phase(deadline)) return std::nullopt;
  MaxFlowResult<Capacity> result;
  result.value = solver.value();
  result.source_side = solver.minimum_cut_side();
  if constexpr (std::is_floating_point_v<Capacity>) {
    // Reals: an excess at or below its vertex's threshold is never discharged, and where huge arcs
    // raise that threshold (a 1e13 cycle through the vertex: about 1) a whole unit of flow can stay
    // there, short of the sink (tests/data/flow/hlpp_stranded_unit.max: 0 for a flow of 1; 2209 for
    // 2210 beside a layered network). Every cut is at least the maximum, so a value short of its
    // own cut by more than the cut's rounding says so; Dinic, which leaves no excess anywhere,
    // answers instead, and the result names it.
    const Capacity cut = cut_capacity(network, result.source_side);
    if (cut - result.value > 1e-12 * cut) return dinic_until(network, source, sink, options, deadline);
  }
  if (options.edge_flows) {
    solver.second_phase();
    result.edge_flows = edge_flows_from_residual(network, solver.residual());
  }
  result.solver = "hlpp";
  return result;
}

template std::optional<MaxFlowResult<std::int64_t>> hlpp_until(const FlowNetwork<std::int64_t>&, int, int,
                                                               const MaxFlowOptions&, Deadline);
template std::optional<MaxFlowResult<double>> hlpp_until(const FlowNetwork<double>&, int, int,
                                                         const MaxFlowOptions&, Deadline);

}  // namespace flow_detail

template <typename Capacity>
MaxFlowResult<Capacity> hlpp(const FlowNetwork<Capacity>& network, int source, int sink,
                             const MaxFlowOptions& options) {
  return *flow_detail::hlpp_until(network, source, sink, options, flow_detail::Deadline());
}

template MaxFlowResult<std::int64_t> hlpp(const FlowNetwork<std::int64_t>&, int, int, const MaxFlowOptions&);
template MaxFlowResult<double> hlpp(const FlowNetwork<double>&, int, int, const MaxFlowOptions&);

}  // namespace metile
