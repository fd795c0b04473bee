// The fused lowering of flash_attention regions (docs/architecture.md, "Measured dispatch"): the
// generated attention kernel (decode for R <= 16 query rows, the tiled prefill kernel otherwise;
// include/metile/attention_runtime.h) as a fused candidate (decode: the default launch shape),
// gated against the CPU reference and raced against the native path (the law's definition as plain
// ops, NativeRuntime) like every region.
// Also the lowering of attention's inputs (rope_kv_cache regions): rope on q and k and both cache
// writes as one generated kernel.
#include <fmt/core.h>

#include <utility>
#include <vector>

#include "metile/attention_runtime.h"
#include "metile/discovery.h"
#include "metile/dispatch.h"

namespace metile {

namespace {

// Whether a decode kernel may read the positions and the cache rows below the smallest position
// before the wait for the previous kernel (DecodeAttentionConfig::cache_before_wait): the positions
// are a graph input, and K and V are each a graph input or a kv_cache_write in place (alias_of) of a
// graph-input cache at those same positions, so no kernel of the run writes the positions or any
// other cache row. (The decode step graph, src/model/step_graph.cpp, has this form.) A write that
// copies the cache first is a kernel writing every row: then nothing is read before the wait.
// `in_place` lists each write's (output, cache) pair: the bound buffers must share too (an external
// output buffer forces the copy, DeviceValues), which the binding checks.
struct CacheRowsBeforeWait {
  bool allowed = false;
  std::vector<std::pair<ValueId, ValueId>> in_place;
};
CacheRowsBeforeWait cache_rows_are_run_inputs(const ComputeGraph& graph, const Node& attention) {
  CacheRowsBeforeWait result;
  if (attention.inputs.size() != 4) return result;
  const ValueId positions = attention.inputs[3];
  if (graph.value(positions).producer >= 0) return result;
  const std::vector<ValueId> owner = alias_of(graph);
  for (const ValueId cache : {attention.inputs[1], attention.inputs[2]}) {
    const NodeId producer = graph.value(cache).producer;
    if (producer < 0) continue;  // a graph input: no kernel of the run writes it
    const Node& write = graph.node(producer);
    if (write.op != "kv_cache_write" || write.inputs.size() != 3) return result;
    if (graph.value(write.inputs[0]).producer >= 0 || write.inputs[2] != positions) return result;
    if (owner[static_cast<std::size_t>(cache)] != owner[static_cast<std::size_t>(write.inputs[0])]) return result;
    result.in_place.emplace_back(cache, write.inputs[0]);
  }
  result.allowed = true;
  return result;
}

}  // namespace

Lowered flash_attention_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  if (region.nodes.empty() || graph.node(region.nodes.front()).op != "flash_attention") {
    return {Decision::refuse("the region is not one flash_attention node"), {}};
  }
  // Layout ops after it (an attention_output_projection region's first part) run natively after
  // the kernel; each must read the node or the op before it.
  std::vector<NodeId> layout_after;
  for (std::size_t i = 1; i < region.nodes.size(); ++i) {
    const Node& op = graph.node(region.nodes[i]);
    const ValueId previous = graph.node(region.nodes[i - 1]).outputs[0];
    if (op.kind != OpKind::layout || op.inputs.empty() || op.inputs[0] != previous) {
      return {Decision::refuse("the region is not one flash_attention node (and layout ops reading it)"), {}};
    }
    layout_after.push_back(op.id);
  }
  const Node& node = graph.node(region.nodes.front());
  AttentionProblem problem;
  try {
    // Nothing built on an unproved law runs: the certificate first, then the kernels' limits.
    require_verified_certificate(node, stable_weighted_softmax_law().name);
    std::optional<TensorSpec> positions;
    if (node.inputs.size() == 4) positions = graph.value(node.inputs[3]).spec;
    problem = AttentionProblem::from_specs(graph.value(node.inputs[0]).spec, graph.value(node.inputs[1]).spec,
                                           graph.value(node.inputs[2]).spec, positions,
                                           node.attributes.get_double("scale"), node.attributes.get_string("mask"),
                                           node.attributes.get_int("offset"));
  } catch (const InputError& error) {
    return {Decision::refuse(error.what()), {}};
  }
  // The source that build() will compile, for the decision key: the split is fixed here (the default
  // for an H200's 132 multiprocessors) so that key and kernel agree on every device. Decode offers
  // the default launch shape only: the other shapes of decode_attention_variants won races run
  // alone and lost inside the decode step (include/metile/attention_runtime.h).
  FlashAttentionOptions options;
  CacheRowsBeforeWait cache_rows;
  std::string source;
  std::string variant;
  if (problem.is_decode()) {
    cache_rows = problem.mask == AttentionMask::positions ? cache_rows_are_run_inputs(graph, node) : CacheRowsBeforeWait{};
    options.decode_cache_before_wait = cache_rows.allowed;
    // build() on the device decides the same way (its multiprocessor count in place of 132).
    const DecodeAttentionConfig config = decode_attention_config(problem, options, 132);
    source = generate_decode_attention_kernel(config).source;
    variant = "attention decode";
  } else {
    PrefillAttentionConfig config;
    config.problem = problem;
    config.warps = options.prefill_warps;
    source = generate_prefill_attention_kernel(config).source;
    variant = "attention prefill";
  }
  FusedCandidate candidate;
  candidate.id = CandidateId::fused(variant);
  candidate.source = std::move(source);
  candidate.summary = fmt::format("{} ({})", variant, problem.to_string());
  const std::vector<ValueId> operands = node.inputs;
  const ValueId out = node.outputs[0];
  for (NodeId id : layout_after) candidate.source += "\n" + NativeRuntime::node_source(graph, id);
  // A view of its input launches nothing; any other layout op is a copy kernel.
  for (NodeId id : layout_after) candidate.launches += !is_view_of_its_input(graph, graph.node(id));
  candidate.bind = [problem, options, cache_rows, operands, out, layout_after](DeviceValues& values) {
    FlashAttentionOptions bound = options;
    for (const auto& [written, cache] : cache_rows.in_place) {
      if (!values.shares_buffer(written, cache)) bound.decode_cache_before_wait = false;
    }
    auto attention = std::make_shared<FlashAttention>(FlashAttention::build(problem, bound));
    const std::uint64_t q = values[operands[0]].address();
    const std::uint64_t k = values[operands[1]].address();
    const std::uint64_t v = values[operands[2]].address();
    const std::uint64_t positions = operands.size() == 4 ? values[operands[3]].address() : 0;
    const std::uint64_t output = values[out].address();
    const DeviceStep after = native_nodes_step(std::make_shared<NativeRuntime>(), values, layout_after);
    return DeviceStep([attention, q, k, v, positions, output, after](const CudaStream& stream) {
      attention->enqueue(stream, q, k, v, positions, output);
      after(stream);
    });
  };
  return {Decision::allow(), {std::move(candidate)}};
}

Lowered rope_kv_cache_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  if (region.rule != "rope_kv_cache") return {Decision::refuse("not a rope_kv_cache region"), {}};
  const RopeCacheRegion problem = rope_cache_region(graph, region);
  if (!problem.decision) return {problem.decision, {}};
  FusedCandidate candidate;
  candidate.id = CandidateId::fused("rope kv cache");
  // Which form binds depends on the buffers (a cache written in place or copied), known at bind.
  const GeneratedKernel copied = generate_rope_cache_kernel(graph, problem, false, false);
  candidate.source = copied.source + generate_rope_cache_kernel(graph, problem, true, true).source;
  candidate.summary = copied.summary;
  candidate.bind = [problem](DeviceValues& values) {
    const bool k_in_place = values.shares_buffer(problem.k_cache_out, problem.k_cache);
    const bool v_in_place = values.shares_buffer(problem.v_cache_out, problem.v_cache);
    return bind_kernel(load_generated_kernel(generate_rope_cache_kernel(values.graph(), problem, k_in_place, v_in_place)),
                       values);
  };
  return {Decision::allow(), {std::move(candidate)}};
}

}  // namespace metile
