// A random, valid graph for the graph module's tests (JSON round trips, dead-node removal).
#pragma once

#include <cstdint>

#include "metile/graph.h"

namespace metile::testing {

// Ops drawn at random with random operands (elementwise, norms, softmax, matmul, layout, masks,
// rope, casts) over inputs x, y, w, m and positions; an attempt the builder rejects records
// nothing, so only legal ops stay. About a third of the values made are outputs, so most graphs
// hold nodes no output depends on.
ComputeGraph random_graph(std::uint32_t seed);

}  // namespace metile::testing
