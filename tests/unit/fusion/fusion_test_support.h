// Shared by the fusion tests: seeded random graphs with every op kind the rules
// look at, the SwiGLU MLP in its variants, and an independent checker of what a
// legal plan is (written from the definitions, not from the planner's code).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "metile/fusion.h"
#include "metile/graph.h"

namespace metile::fusion_test {

// A random DAG of `node_count` ops over activations [M, 32] (M in {1, 2}):
// elementwise ops with broadcast weights, row reductions, dense and quantized
// contractions (some to another width, so shapes differ), layout ops, and now
// and then a SwiGLU block. Recent values are preferred as inputs, but far ones
// are picked too (one pick in four), so paths leave and re-enter
// neighbourhoods: from anywhere before, or with `far_window` > 0 from the last
// `far_window` values only (the locality of real models).
ComputeGraph random_graph(std::mt19937_64& random, int node_count, int far_window = 0);

struct SwigluOptions {
  bool quantized = false;
  bool up_first = false;           // multiply(up, silu(gate)) instead of multiply(silu(gate), up)
  bool residual = true;            // output = residual + down
  bool residual_second = false;    // output = down + residual instead
  std::int64_t rows = 1;
  std::int64_t hidden = 64;
  std::int64_t intermediate = 256;
  DType dtype = DType::f16;
  std::string gate_escape;         // "": none; "output": gate is a graph output; else a consumer of gate with this name
};
ComputeGraph swiglu_graph(const SwigluOptions& options);

// A chain of `length` elementwise ops over one f16 [1, 4096] activation, each reading the one
// before (add and multiply also read a broadcast [4096] weight, so every op has work and a reason
// to stay in a kernel): the shape that asks whether the planner fuses beyond one neighborhood.
ComputeGraph elementwise_chain(int length);

// Empty when the plan is legal; otherwise what is wrong. Checks: every node in
// exactly one kernel, regions non-empty/ascending/convex, the kernel graph
// acyclic, region inputs and outputs as defined, a reason for every node.
std::string plan_problems(const FusionPlan& plan);

// Whether the nodes (ascending) form a convex set: no path leaves and comes back.
bool is_convex(const ComputeGraph& graph, const std::vector<NodeId>& nodes);

// Why the plan left node `node` (by name) where it is: plan.node_reasons of it.
const std::string& reason_of(const FusionPlan& plan, const std::string& node);

}  // namespace metile::fusion_test
