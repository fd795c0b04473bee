// metile CPU reference backend: runs any graph, every op, f32 math with f64
// accumulation in reductions and contractions. It is the oracle every other
// backend is gated against.
#pragma once

#include <cstdint>

#include "metile/graph.h"

namespace metile {

// Runs the graph; inputs by graph-input name, outputs by output value name.
// Throws InputError on a missing input or one whose spec differs.
TensorMap run_reference(const ComputeGraph& graph, const TensorMap& inputs);

// Fresh, seeded random inputs suited to each graph input (never zeros):
// floats in [-1, 1), rope positions in [0, S), packed quantized weights as
// random bits, quantization scales small and positive.
TensorMap random_inputs(const ComputeGraph& graph, std::uint64_t seed);

}  // namespace metile
