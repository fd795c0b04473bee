// Private to src/flow: weighted graph Laplacians grounded at one vertex, solved by conjugate
// gradient preconditioned on a heavy spanning tree. The interior-point engine (ipm.cpp) solves
// one per Newton step; tests/unit/flow/grounded_laplacian_test.cpp checks it against L computed
// arc by arc in float64.
//
// L = A diag(conductance) A^T over a graph's arcs, its ground vertex's row and column removed (the
// ground's potential is 0), which makes L positive definite on a connected graph. Arcs between the
// same two vertices, either way round, act as one edge of their summed conductance; self loops
// contribute nothing.
//
// Two preconditioners are built on a heavy spanning tree T of those edges (Kruskal over the edges
// bucketed by binary exponent: each choice within a factor 2 of the heaviest available, O(m)):
//   tree           M = L_T, the tree's own Laplacian. It follows the long chains of similar
//                  conductances along which a diagonal scaling does nothing (GENRMF's frames,
//                  grids); where the graph is a tree, M = L.
//   tree+diagonal  M = L_T + diag(L - L_T): L's own diagonal with the tree's off-diagonal
//                  entries. The Jacobi (diagonal) scaling where the tree is light, fewer steps
//                  than it on expander-like and layered networks, ten times more than `tree` on
//                  GENRMF.
// Both are solved exactly by elimination on the tree, leaves first (no fill): O(n) a step.
// Neither wins on every family and the better one changes along an interior-point path, so a
// raced solve runs the two (one CG step each in turn; the first to converge gives the answer, and
// one far behind stops early) and remembers the winner for the next unraced solve
// (docs/ipm.md measures all three). Where the edges of positive finite conductance do not span
// the vertices, the Jacobi preconditioner alone.
#pragma once

#include <vector>

namespace metile::flow_detail {

class GroundedLaplacian {
 public:
  enum class Preconditioner { tree, tree_and_diagonal, jacobi };

  // Arc k runs tail[k] -> head[k] over vertices 0..vertex_count-1; both vectors are read, not kept.
  GroundedLaplacian(int vertex_count, const std::vector<int>& tail, const std::vector<int>& head, int ground);

  // One conductance per arc (summed into the edges; the vector is not kept); builds the tree.
  void set_conductances(const std::vector<double>& conductance);
  bool has_tree() const { return has_tree_; }
  Preconditioner last_winner() const { return last_winner_; }

  struct Outcome {
    int steps = 0;  // CG steps, every racer's counted
    bool converged = false;
  };

  // Preconditioned CG on L p = rhs; `potential` is the start and the answer. Stops when the
  // residual's 2-norm is at most relative_tolerance times the right-hand side's, or after
  // max_steps steps of each racer (the answer then the racer's of the smaller residual).
  // `race`: both tree preconditioners race (where there is a tree); else the last race's winner.
  Outcome solve(const std::vector<double>& rhs, std::vector<double>& potential, double relative_tolerance,
                int max_steps, bool race);

  // z = M^-1 r for one preconditioner (z at the ground 0; r's ground entry ignored). `tree` and
  // `tree_and_diagonal` need has_tree().
  void apply_preconditioner(Preconditioner preconditioner, const std::vector<double>& r, std::vector<double>& z);

 private:
  // One conjugate-gradient iteration's vectors, a racer's own.
  struct Run {
    Preconditioner preconditioner = Preconditioner::jacobi;
    std::vector<double> potential, residual, preconditioned, direction, product;
    double residual_dot = 0;   // residual . preconditioned
    double residual_norm = 0;  // the residual's 2-norm
    bool broken = false;       // a step found no positive curvature: it can go no further
    bool lagging = false;      // far behind the other racer: it steps only if that one breaks
  };
  struct TreeFactor {
    std::vector<double> fold;           // c / pivot by breadth-first position: what passes to the parent
    std::vector<double> inverse_pivot;
  };

  void start(Run& run, const std::vector<double>& rhs, const std::vector<double>& potential);
  bool step(Run& run);
  bool build_tree();
  void multiply(const std::vector<double>& potential, std::vector<double>& out) const;

  const int vertex_count_;
  const int ground_;
  // The edges: distinct unordered vertex pairs of the arcs (self loops left out), and each arc's.
  std::vector<int> edge_low_, edge_high_, edge_of_arc_;
  std::vector<double> edge_conductance_;  // summed over the edge's arcs; NaN where one is not finite
  std::vector<double> inverse_diagonal_;  // the Jacobi preconditioner (0 at the ground)
  bool has_tree_ = false;
  Preconditioner last_winner_ = Preconditioner::tree_and_diagonal;
  std::vector<int> bucket_begin_, edge_order_, union_find_, tree_edges_, adjacency_begin_, adjacency_;
  // The tree, breadth first from the ground: each vertex's position, and by position (the ground at
  // 0) its vertex, its parent's position and the conductance of the edge to its parent.
  std::vector<int> position_, tree_order_, tree_parent_position_;
  std::vector<double> tree_conductance_;
  std::vector<double> excess_;              // by position: `tree_and_diagonal`'s pivot less that conductance
  TreeFactor tree_factor_, diagonal_factor_;
  std::vector<double> eliminated_;          // apply_preconditioner's scratch
  Run runs_[2];
};

}  // namespace metile::flow_detail
