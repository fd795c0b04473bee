// Seeded generators of max-flow instances, shared by the flow tests (differential
// oracles) and benchmarks/max_flow (the crossover table), so both speak of the same
// families: the seed's path-plus-random family, layered random graphs (washington-style
// random level graphs), grids with terminals, GENRMF frames, dense random graphs, and
// variants with parallel edges or an unreachable sink. Not part of the public API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "metile/flow.h"

namespace metile::flow_families {

struct GeneratedNetwork {
  std::string family;
  int vertex_count = 0;
  int source = 0;
  int sink = 0;
  std::vector<FlowEdge<std::int64_t>> edges;

  IntegerFlowNetwork integer_network() const { return IntegerFlowNetwork(vertex_count, edges); }
};

using Random = std::mt19937_64;

inline std::int64_t draw(Random& random, std::int64_t low, std::int64_t high) {
  return std::uniform_int_distribution<std::int64_t>(low, high)(random);
}

// The seed project's random family: a path 0 -> 1 -> ... -> n-1 with
// capacities 1..100 keeps the sink reachable, plus degree-1 extra edges from every
// vertex to random vertices. Source 0, sink n-1.
inline GeneratedNetwork seed_random_network(int vertex_count, int degree, Random& random) {
  GeneratedNetwork network{"seed-random", vertex_count, 0, vertex_count - 1, {}};
  for (int v = 0; v + 1 < vertex_count; ++v) {
    network.edges.push_back({v, v + 1, draw(random, 1, 100)});
    for (int extra = 1; extra < degree; ++extra) {
      network.edges.push_back({v, static_cast<int>(draw(random, 0, vertex_count - 1)), draw(random, 1, 100)});
    }
  }
  return network;
}

// Random level graph: `layers` layers of `width` vertices; every vertex sends `degree`
// edges to random vertices of the next layer; the source feeds the first layer and the
// last layer drains into the sink, with capacities large enough not to be the cut.
inline GeneratedNetwork layered_network(int layers, int width, int degree, std::int64_t max_capacity,
                                        Random& random) {
  const int inner = layers * width;
  GeneratedNetwork network{"layered", inner + 2, inner, inner + 1, {}};
  for (int i = 0; i < width; ++i) {
    network.edges.push_back({network.source, i, max_capacity * degree});
    network.edges.push_back({(layers - 1) * width + i, network.sink, max_capacity * degree});
  }
  for (int layer = 0; layer + 1 < layers; ++layer) {
    for (int i = 0; i < width; ++i) {
      for (int d = 0; d < degree; ++d) {
        const int head = (layer + 1) * width + static_cast<int>(draw(random, 0, width - 1));
        network.edges.push_back({layer * width + i, head, draw(random, 1, max_capacity)});
      }
    }
  }
  return network;
}

// rows x columns grid, edges to all four neighbours with random capacities; the source
// feeds the left column, the right column drains into the sink (vision-style cuts).
inline GeneratedNetwork grid_network(int rows, int columns, std::int64_t max_capacity, Random& random) {
  const int inner = rows * columns;
  GeneratedNetwork network{"grid", inner + 2, inner, inner + 1, {}};
  auto at = [columns](int row, int column) { return row * columns + column; };
  for (int row = 0; row < rows; ++row) {
    network.edges.push_back({network.source, at(row, 0), draw(random, 1, 4 * max_capacity)});
    network.edges.push_back({at(row, columns - 1), network.sink, draw(random, 1, 4 * max_capacity)});
    for (int column = 0; column < columns; ++column) {
      if (column + 1 < columns) {
        network.edges.push_back({at(row, column), at(row, column + 1), draw(random, 1, max_capacity)});
        network.edges.push_back({at(row, column + 1), at(row, column), draw(random, 1, max_capacity)});
      }
      if (row + 1 < rows) {
        network.edges.push_back({at(row, column), at(row + 1, column), draw(random, 1, max_capacity)});
        network.edges.push_back({at(row + 1, column), at(row, column), draw(random, 1, max_capacity)});
      }
    }
  }
  return network;
}

// GENRMF (Goldfarb and Grigoriadis): `frames` square grids of side `side`; inside a
// frame, arcs to the four neighbours with capacity c2 * side^2; between consecutive
// frames, vertex i of frame k connects to vertex perm(i) of frame k+1 (a fresh random
// permutation per frame) with capacity uniform in [c1, c2]. Source: first vertex of the
// first frame; sink: last vertex of the last frame. Deep and narrow: hard for Dinic.
inline GeneratedNetwork genrmf_network(int side, int frames, std::int64_t c1, std::int64_t c2,
                                       Random& random) {
  const int frame_size = side * side;
  GeneratedNetwork network{"genrmf", frame_size * frames, 0, frame_size * frames - 1, {}};
  const std::int64_t in_frame = c2 * frame_size;
  std::vector<int> permutation(frame_size);
  for (int frame = 0; frame < frames; ++frame) {
    const int base = frame * frame_size;
    for (int row = 0; row < side; ++row) {
      for (int column = 0; column < side; ++column) {
        const int v = base + row * side + column;
        if (column + 1 < side) {
          network.edges.push_back({v, v + 1, in_frame});
          network.edges.push_back({v + 1, v, in_frame});
        }
        if (row + 1 < side) {
          network.edges.push_back({v, v + side, in_frame});
          network.edges.push_back({v + side, v, in_frame});
        }
      }
    }
    if (frame + 1 < frames) {
      std::iota(permutation.begin(), permutation.end(), 0);
      std::shuffle(permutation.begin(), permutation.end(), random);
      for (int i = 0; i < frame_size; ++i) {
        network.edges.push_back({base + i, base + frame_size + permutation[i], draw(random, c1, c2)});
      }
    }
  }
  return network;
}

// Every ordered pair (u, v), u != v, is an edge with probability `density`.
inline GeneratedNetwork dense_network(int vertex_count, double density, std::int64_t max_capacity,
                                      Random& random) {
  GeneratedNetwork network{"dense", vertex_count, 0, vertex_count - 1, {}};
  std::bernoulli_distribution keep(density);
  for (int u = 0; u < vertex_count; ++u) {
    for (int v = 0; v < vertex_count; ++v) {
      if (u != v && keep(random)) network.edges.push_back({u, v, draw(random, 1, max_capacity)});
    }
  }
  return network;
}

// Sparse random edges with many duplicates, self loops and zero capacities: the input
// shapes a builder must keep (parallel edges), drop (loops) or tolerate (zeros).
inline GeneratedNetwork multigraph_network(int vertex_count, int edge_count, std::int64_t max_capacity,
                                           Random& random) {
  GeneratedNetwork network{"multigraph", vertex_count, 0, vertex_count - 1, {}};
  for (int e = 0; e < edge_count; ++e) {
    if (!network.edges.empty() && draw(random, 0, 3) == 0) {
      FlowEdge<std::int64_t> copy =
          network.edges[draw(random, 0, static_cast<std::int64_t>(network.edges.size()) - 1)];
      copy.capacity = draw(random, 0, max_capacity);
      network.edges.push_back(copy);
    } else {
      network.edges.push_back({static_cast<int>(draw(random, 0, vertex_count - 1)),
                               static_cast<int>(draw(random, 0, vertex_count - 1)),
                               draw(random, 0, max_capacity)});
    }
  }
  return network;
}

// Random edges everywhere except into the sink, which only has out-edges: the value is 0
// and the source side is everything the source reaches.
inline GeneratedNetwork unreachable_sink_network(int vertex_count, int edge_count, std::int64_t max_capacity,
                                                 Random& random) {
  GeneratedNetwork network{"unreachable-sink", vertex_count, 0, vertex_count - 1, {}};
  for (int e = 0; e < edge_count; ++e) {
    const int from = static_cast<int>(draw(random, 0, vertex_count - 1));
    int to = static_cast<int>(draw(random, 0, vertex_count - 2));
    network.edges.push_back({from, to, draw(random, 1, max_capacity)});
  }
  return network;
}

// The same network with real capacities: each integer capacity c becomes c / 8 (exactly
// representable, so exact oracles still apply) or, with `irregular`, c times a random
// factor in [0.5, 1.5) (rounding everywhere, so comparisons need a tolerance).
inline std::vector<FlowEdge<double>> real_edges(const GeneratedNetwork& network, bool irregular,
                                                Random& random) {
  std::uniform_real_distribution<double> factor(0.5, 1.5);
  std::vector<FlowEdge<double>> edges;
  edges.reserve(network.edges.size());
  for (const FlowEdge<std::int64_t>& edge : network.edges) {
    const double capacity = static_cast<double>(edge.capacity);
    edges.push_back({edge.from, edge.to, irregular ? capacity * factor(random) : capacity / 8.0});
  }
  return edges;
}

}  // namespace metile::flow_families
