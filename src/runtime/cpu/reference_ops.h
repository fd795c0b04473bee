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

// kv_cache_write's work on the cache itself: row positions[s] of every head becomes update[:, s, :]
// (cache [H, T, D], update [H, S, D]). InputError naming `node` when a position is outside [0, T),
// raised before any row is written. evaluate_reference_node's kv_cache_write is this on a copy.
void write_cache_rows(HostTensor& cache, const Node& node, const HostTensor& update, const HostTensor& positions);

}  // namespace metile::cpu
