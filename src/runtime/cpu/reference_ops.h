// The CPU reference evaluation of one node: the numerical definition of every
// op that other backends are gated against. Private to src/runtime/cpu; the
// executors (whole graph, plan kernel by kernel) both call this one function,
// which is why their results agree bit for bit.
#pragma once

#include <span>
#include <vector>

#include "metile/graph.h"

namespace metile::cpu {

// Evaluates `node` on `inputs` (one tensor per node input, specs already
// checked by the graph) and returns one tensor per entry of output_specs.
std::vector<HostTensor> evaluate_reference_node(const Node& node, std::span<const HostTensor* const> inputs,
                                                std::span<const TensorSpec> output_specs);

}  // namespace metile::cpu
