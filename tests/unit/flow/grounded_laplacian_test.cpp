// The interior-point engine's Laplacian solver (src/flow/grounded_laplacian.h) against L computed
// here arc by arc in float64: on random trees whose edges are bundles of parallel and antiparallel
// arcs (with self loops) both tree preconditioners are L itself, so z = M^-1 r must solve L z = r to
// rounding (componentwise backward error, which the 12 decades of conductances do not inflate as they
// would the forward error); on random connected multigraphs each preconditioner must be symmetric
// positive definite, and the raced and unraced CG solves must reach their tolerance on the residual
// computed here. A dense Gaussian elimination is the oracle where the tree's choice is the question.
// Fresh seeds, printed (METILE_TEST_SEED=N replays).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "grounded_laplacian.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using flow_detail::GroundedLaplacian;
using Preconditioner = GroundedLaplacian::Preconditioner;

struct Graph {
  int vertices = 0;
  int ground = 0;
  std::vector<int> tail, head;
  std::vector<double> conductance;
  void arc(int a, int b, double c) {
    tail.push_back(a);
    head.push_back(b);
    conductance.push_back(c);
  }
};

// x = (L + diag(extra))^-1 r with L grounded (the ground's row and column dropped, its x 0), by
// Gaussian elimination with partial pivoting on the dense matrix built from the arcs one by one.
std::vector<double> dense_solve(const Graph& g, const std::vector<double>& r, const std::vector<double>& extra = {}) {
  const int n = g.vertices;
  std::vector<std::vector<double>> a(n, std::vector<double>(n + 1, 0.0));
  for (std::size_t v = 0; v < extra.size(); ++v) a[v][v] += extra[v];
  for (std::size_t k = 0; k < g.tail.size(); ++k) {
    const int u = g.tail[k], v = g.head[k];
    const double c = g.conductance[k];
    a[u][u] += c;
    a[v][v] += c;
    a[u][v] -= c;
    a[v][u] -= c;
  }
  for (int i = 0; i < n; ++i) {
    a[i][n] = r[i];
    a[g.ground][i] = a[i][g.ground] = 0;
  }
  a[g.ground][g.ground] = 1;
  a[g.ground][n] = 0;
  for (int col = 0; col < n; ++col) {
    int pivot = col;
    for (int i = col + 1; i < n; ++i) {
      if (std::abs(a[i][col]) > std::abs(a[pivot][col])) pivot = i;
    }
    std::swap(a[col], a[pivot]);
    for (int i = col + 1; i < n; ++i) {
      const double factor = a[i][col] / a[col][col];
      for (int j = col; j <= n; ++j) a[i][j] -= factor * a[col][j];
    }
  }
  std::vector<double> x(n, 0.0);
  for (int i = n - 1; i >= 0; --i) {
    double sum = a[i][n];
    for (int j = i + 1; j < n; ++j) sum -= a[i][j] * x[j];
    x[i] = sum / a[i][i];
  }
  return x;
}

double log_uniform(std::mt19937_64& random, double low, double high) {
  return std::exp(std::uniform_real_distribution<double>(std::log(low), std::log(high))(random));
}

// A random tree on `vertices`, each edge 1-4 arcs either way round, plus a few self loops.
Graph random_tree(std::mt19937_64& random, int vertices, double low, double high) {
  Graph g;
  g.vertices = vertices;
  g.ground = std::uniform_int_distribution<int>(0, vertices - 1)(random);
  for (int v = 1; v < vertices; ++v) {
    const int parent = std::uniform_int_distribution<int>(0, v - 1)(random);
    const int arcs = std::uniform_int_distribution<int>(1, 4)(random);
    for (int k = 0; k < arcs; ++k) {
      if (random() % 2) g.arc(v, parent, log_uniform(random, low, high));
      else g.arc(parent, v, log_uniform(random, low, high));
    }
  }
  for (int k = 0; k < vertices / 4; ++k) {
    const int v = std::uniform_int_distribution<int>(0, vertices - 1)(random);
    g.arc(v, v, log_uniform(random, low, high));
  }
  return g;
}

std::vector<double> random_vector(std::mt19937_64& random, int n) {
  std::vector<double> r(n);
  for (double& value : r) value = std::uniform_real_distribution<double>(-1, 1)(random);
  return r;
}

// max over vertices but the ground of |r - L z| / (sum over v's arcs of c (|z_v| + |z_u|) + |r_v|).
double backward_error(const Graph& g, const std::vector<double>& z, const std::vector<double>& r) {
  std::vector<double> residual(r), scale(r.size());
  for (std::size_t v = 0; v < r.size(); ++v) scale[v] = std::abs(r[v]);
  for (std::size_t k = 0; k < g.tail.size(); ++k) {
    const int u = g.tail[k], v = g.head[k];
    const double current = g.conductance[k] * (z[u] - z[v]);
    residual[u] -= current;
    residual[v] += current;
    const double size = g.conductance[k] * (std::abs(z[u]) + std::abs(z[v]));
    scale[u] += size;
    scale[v] += size;
  }
  double worst = 0;
  for (std::size_t v = 0; v < r.size(); ++v) {
    if (static_cast<int>(v) != g.ground && scale[v] > 0) worst = std::max(worst, std::abs(residual[v]) / scale[v]);
  }
  return worst;
}

// ||r - L z||_2 / ||r||_2, the ground left out: what solve() stops on.
double relative_residual(const Graph& g, const std::vector<double>& z, const std::vector<double>& r) {
  std::vector<double> residual(r);
  for (std::size_t k = 0; k < g.tail.size(); ++k) {
    const double current = g.conductance[k] * (z[g.tail[k]] - z[g.head[k]]);
    residual[g.tail[k]] -= current;
    residual[g.head[k]] += current;
  }
  double top = 0, bottom = 0;
  for (std::size_t v = 0; v < r.size(); ++v) {
    if (static_cast<int>(v) == g.ground) continue;
    top += residual[v] * residual[v];
    bottom += r[v] * r[v];
  }
  return std::sqrt(top / bottom);
}

// max |x - y| over max |y|, the ground left out.
double relative_error(const std::vector<double>& x, const std::vector<double>& y, int ground) {
  double error = 0, scale = 0;
  for (std::size_t v = 0; v < y.size(); ++v) {
    if (static_cast<int>(v) == ground) continue;
    error = std::max(error, std::abs(x[v] - y[v]));
    scale = std::max(scale, std::abs(y[v]));
  }
  return error / scale;
}

TEST(GroundedLaplacian, OnATreeBothTreePreconditionersAreLItself) {
  std::mt19937_64 random(testing::test_seed("GroundedLaplacian.OnATreeBothTreePreconditionersAreLItself"));
  for (int trial = 0; trial < 300; ++trial) {
    const Graph g = random_tree(random, std::uniform_int_distribution<int>(2, 30)(random), 1e-6, 1e6);
    GroundedLaplacian laplacian(g.vertices, g.tail, g.head, g.ground);
    laplacian.set_conductances(g.conductance);
    ASSERT_TRUE(laplacian.has_tree());
    const std::vector<double> r = random_vector(random, g.vertices);
    for (const Preconditioner form : {Preconditioner::tree, Preconditioner::tree_and_diagonal}) {
      std::vector<double> z(g.vertices, 1.0);
      laplacian.apply_preconditioner(form, r, z);
      EXPECT_EQ(z[g.ground], 0.0);
      ASSERT_LE(backward_error(g, z, r), 1e-13) << "trial " << trial << ", " << g.vertices << " vertices, form "
                                                << static_cast<int>(form);
    }
  }
}

TEST(GroundedLaplacian, PreconditionersAreSymmetricPositiveDefiniteAndSolvesReachTheirTolerance) {
  std::mt19937_64 random(testing::test_seed("GroundedLaplacian.PreconditionersAreSymmetricPositiveDefiniteAndSolvesReachTheirTolerance"));
  for (int trial = 0; trial < 300; ++trial) {
    Graph g = random_tree(random, std::uniform_int_distribution<int>(2, 40)(random), 1e-3, 1e3);
    const int extra = std::uniform_int_distribution<int>(0, 3 * g.vertices)(random);
    for (int k = 0; k < extra; ++k) {
      std::uniform_int_distribution<int> vertex(0, g.vertices - 1);
      g.arc(vertex(random), vertex(random), log_uniform(random, 1e-3, 1e3));
    }
    GroundedLaplacian laplacian(g.vertices, g.tail, g.head, g.ground);
    laplacian.set_conductances(g.conductance);
    ASSERT_TRUE(laplacian.has_tree());
    const std::vector<double> r1 = random_vector(random, g.vertices), r2 = random_vector(random, g.vertices);
    for (const Preconditioner form : {Preconditioner::tree, Preconditioner::tree_and_diagonal, Preconditioner::jacobi}) {
      std::vector<double> z1(g.vertices), z2(g.vertices);
      laplacian.apply_preconditioner(form, r1, z1);
      laplacian.apply_preconditioner(form, r2, z2);
      double r1_z1 = 0, r1_z2 = 0, r2_z1 = 0, scale = 0;
      for (int v = 0; v < g.vertices; ++v) {
        if (v == g.ground) continue;
        r1_z1 += r1[v] * z1[v];
        r1_z2 += r1[v] * z2[v];
        r2_z1 += r2[v] * z1[v];
        scale += std::abs(r1[v] * z2[v]) + std::abs(r2[v] * z1[v]);
      }
      EXPECT_GT(r1_z1, 0) << "trial " << trial << " form " << static_cast<int>(form);
      EXPECT_LE(std::abs(r1_z2 - r2_z1), 1e-12 * scale) << "trial " << trial << " form " << static_cast<int>(form);
    }
    for (const bool race : {true, false, false}) {  // the unraced solves run the race's winner
      std::vector<double> potential(g.vertices, 0.0);
      const GroundedLaplacian::Outcome outcome = laplacian.solve(r1, potential, 1e-10, 10 * g.vertices + 50, race);
      ASSERT_TRUE(outcome.converged) << "trial " << trial << (race ? " raced" : " unraced") << ", " << g.vertices << " vertices, " << g.tail.size() << " arcs, " << outcome.steps << " steps, residual " << relative_residual(g, potential, r1);
      ASSERT_LE(relative_residual(g, potential, r1), 1e-9) << "trial " << trial;  // the recursive residual drifts
      ASSERT_EQ(potential[g.ground], 0.0);
    }
  }
}

// Arcs between the same two vertices are one edge of their summed weight, and the tree takes the
// heaviest edges: a triangle whose sides 0-1 and 1-2 are bundles of 30 arcs of conductance 1 (one
// half of them reversed) and whose side 0-2 is one arc of 2 has the tree {0-1, 1-2}; its `tree`
// preconditioner is then L without the 0-2 arc, and `tree_and_diagonal` that plus the arc's 2 on
// the diagonal of vertices 0 and 2 (vertex 1's pivot then takes some of it from its child 2).
// Ranked arc by arc, the tree would take 0-2.
TEST(GroundedLaplacian, TheTreeRanksBundlesOfArcsByTheirSum) {
  Graph bundles;
  bundles.vertices = 3;
  for (int k = 0; k < 30; ++k) {
    bundles.arc(k % 2 ? 0 : 1, k % 2 ? 1 : 0, 1.0);
    bundles.arc(k % 2 ? 1 : 2, k % 2 ? 2 : 1, 1.0);
  }
  Graph with_chord = bundles;
  with_chord.arc(2, 0, 2.0);
  GroundedLaplacian laplacian(3, with_chord.tail, with_chord.head, 0);
  laplacian.set_conductances(with_chord.conductance);
  const std::vector<double> r = {0.0, 0.3, -1.0};
  std::vector<double> z(3);
  laplacian.apply_preconditioner(Preconditioner::tree, r, z);
  EXPECT_LE(relative_error(z, dense_solve(bundles, r), 0), 1e-12);
  EXPECT_GT(relative_error(z, dense_solve(with_chord, r), 0), 1e-3);
  laplacian.apply_preconditioner(Preconditioner::tree_and_diagonal, r, z);
  EXPECT_LE(relative_error(z, dense_solve(bundles, r, {2.0, 0.0, 2.0}), 0), 1e-12);
}

// An edge of conductance 0 (an arc that underflowed) splits the graph's usable edges: no tree, and
// every solve falls back to the Jacobi preconditioner.
TEST(GroundedLaplacian, WithoutASpanningTreeItFallsBackToJacobi) {
  Graph g;
  g.vertices = 3;
  g.arc(0, 1, 1.0);
  g.arc(1, 2, 0.0);
  GroundedLaplacian laplacian(3, g.tail, g.head, 0);
  laplacian.set_conductances(g.conductance);
  EXPECT_FALSE(laplacian.has_tree());
  EXPECT_EQ(laplacian.last_winner(), Preconditioner::jacobi);
  g.conductance[1] = 0.5;
  laplacian.set_conductances(g.conductance);
  EXPECT_TRUE(laplacian.has_tree());
  EXPECT_EQ(laplacian.last_winner(), Preconditioner::tree_and_diagonal);
}

}  // namespace
}  // namespace metile
