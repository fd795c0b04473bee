// metile CPU reference backend: runs any graph, every op, f32 math with f64
// accumulation in reductions and contractions. It is the oracle every other
// backend is gated against.
#pragma once

#include <cstdint>
#include <span>

#include "metile/fusion.h"
#include "metile/graph.h"

namespace metile {

// Throws InputError naming the first graph input that `inputs` lacks or holds
// with another spec. Tensors the graph does not name are ignored.
void check_graph_inputs(const ComputeGraph& graph, const TensorMap& inputs);
// Throws InputError "'NAME' is not an input of the graph (its inputs: a, b)" unless `name` is one of
// the graph's inputs: what a user's input file or dict holds beyond them is a misspelt name.
void check_is_graph_input(const ComputeGraph& graph, const std::string& name);

// Runs the graph; inputs by graph-input name, outputs by output value name.
// Throws InputError on a missing input or one whose spec differs.
TensorMap run_reference(const ComputeGraph& graph, const TensorMap& inputs);

// Runs a plan kernel by kernel: each region is one unit whose intermediates
// stay inside it and only its `outputs` become visible; each unfused node is
// its own unit. Kernels run in an order where everything they read is already
// visible. The outputs equal run_reference's bit for bit. Throws InputError
// when the plan is malformed (a node in no kernel or in two, a region output
// it does not compute) or cannot be scheduled (a cycle between kernels, or a
// value read outside its region that the region does not publish).
TensorMap run_plan_reference(const FusionPlan& plan, const TensorMap& inputs);

// The same three with the inputs spread over several maps, each name looked up
// in order: a model's weights stay in one map, borrowed, while each step's
// token ids, positions and caches live in another.
void check_graph_inputs(const ComputeGraph& graph, std::span<const TensorMap* const> inputs);
TensorMap run_reference(const ComputeGraph& graph, std::span<const TensorMap* const> inputs);
TensorMap run_plan_reference(const FusionPlan& plan, std::span<const TensorMap* const> inputs);

// The same, with the tensors in `owned` handed over: each is freed after its last reader, and a
// kv_cache_write that is the last reader of its cache writes the new rows into that cache and
// returns it, where the borrowing forms copy it (a decode step's caches: held once, not twice).
// Inputs are looked up in `owned` first, then in `borrowed` in order; `owned` is consumed whatever
// happens (on an error its tensors are lost).
TensorMap run_reference(const ComputeGraph& graph, TensorMap owned, std::span<const TensorMap* const> borrowed);
TensorMap run_plan_reference(const FusionPlan& plan, TensorMap owned, std::span<const TensorMap* const> borrowed);

// An upper bound on the memory the reference executor holds while it evaluates `node`, beyond the
// graph's tensors: its inputs widened to f32 and its results accumulated in f64 before they are
// rounded to their dtype (4 bytes per input element, 8 per output element; a matmul's f16 result is
// 4 times its tensor while it is computed). check_run_memory adds each node's to the graph's tensors.
std::uint64_t reference_working_bytes(const ComputeGraph& graph, const Node& node);

// Every value of the graph at once bounds what a run holds, with the reference's working copies of
// one node (reference_working_bytes) on top where the reference runs; more than this machine's
// physical memory is the graph's fault (README, "Input limits"), an InputError naming the value or
// node that passes it, said before anything is allocated. `metile run` and Python's run() ask it.
void check_run_memory(const ComputeGraph& graph, bool runs_reference);

// Fresh, seeded random inputs suited to each graph input (never zeros), its
// role read from its consumers: floats uniform in [-1, 1), divided by sqrt(K)
// for a matmul's right operand; rope positions in [0, S); packed quantized
// weights as random bits; quantization scales in [0.005, 0.02] and biases
// that centre each group's weights on zero (-scale * (2^bits - 1) / 2 plus
// up to half a scale; [-0.05, 0.05] when the scales are computed); other
// integers uniform over i8/u8, [-1000, 1000] for i32, all bits for u32. Each
// input draws from its own stream (seed and name), so adding an input to a
// graph leaves the others unchanged; the generator is ours and floats are
// drawn on an f32 grid, so the values are the same on every platform.
TensorMap random_inputs(const ComputeGraph& graph, std::uint64_t seed);

}  // namespace metile
