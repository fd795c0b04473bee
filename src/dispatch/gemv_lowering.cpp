// The GEMV lowerings (include/metile/dispatch.h, "GEMV lowerings"; docs/architecture.md,
// "Lowering"): decode-time regions of the planner onto the generated GEMV kernels of gemv.h.
//
//   region                 launches                                   operands from roles
//   swiglu_mlp             gate/up GEMV (two matrices share x) ─ h    input, gate_weight, up_weight,
//                          down GEMV (its epilogue: the residual add)  down_weight
//   contraction_epilogue   one GEMV, the region's elementwise ops as    input, weight
//                          its epilogue (residual add, bias add, ...)
//   contraction            one GEMV with a plain store                 input, weight
//   contraction_argmax     one GEMV with a plain store and the rows'   input, weight
//                          argmax (argmax_rows: the LM head's greedy token)
//   sibling_contractions   one GEMV over the stacked weights (q, k, v)  input, weight.i, bias.i
//   qkv_rope_kv_cache      the same GEMV, rope on q and k and both      the parts' roles (FusionRegion::parts:
//                          cache writes in its epilogue                 sibling_contractions, rope_kv_cache)
//
// A region that holds the RMSNorm of its input (the rules' input prologue: norm_input, norm_weight)
// launches nothing for it: the GEMV reading the normalized value reads the norm's x and weight and
// normalizes x as it loads it (GemvKernelConfig::x_rms_norm_eps).
//
// Planning happens on the region graph (region_graph): every value the region reads from outside
// is an input there, so GemvEpilogue::from_graph stops at the region's boundary and the kernel
// applies exactly the region's ops, whether it was lowered for the gate (on the region graph) or
// for the whole plan. Dense weights are read in place ([N, K], transpose_right); MLX affine weights
// are repacked (repack_for_gemv) when a candidate is bound, once per weight and device values
// (DeviceValues::keep_derived repeats it only when the weights are uploaded again).
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "metile/attention.h"
#include "metile/codegen.h"
#include "metile/discovery.h"
#include "metile/dispatch.h"
#include "metile/quant.h"

namespace metile {

// ---------------------------------------------------------------- launch shapes
std::vector<GemvKernelConfig> gemv_stage_configs(const GemvKernelConfig& base, int per_family, int multiprocessors,
                                                 bool streamed) {
  const std::size_t keep = static_cast<std::size_t>(std::max(1, per_family));
  std::vector<GemvKernelConfig> configs;
  // A family the problem does not fit (its base fails validation) is left out; when every family
  // is, the first one's error says why.
  std::optional<InputError> first_error;
  auto add_family = [&](const GemvKernelConfig& family_base) {
    std::vector<GemvKernelConfig> family;
    try {
      family = gemv_tuning_candidates(family_base, multiprocessors);
    } catch (const InputError& error) {
      if (!first_error) first_error = error;
      return family;
    }
    if (family.size() > keep) family.resize(keep);
    configs.insert(configs.end(), family.begin(), family.end());
    return family;
  };
  GemvKernelConfig registers = base;
  registers.mainloop = GemvMainloop::register_batches;
  // Two matrices (gate/up): the register-resident schedule only; the scratch-spilled one never won
  // a race on the H200 (notes/mlp_decode.md) and stays reachable through gemv_tuning_candidates.
  registers.schedule = GatedSchedule::register_resident;
  const std::vector<GemvKernelConfig> register_family = add_family(registers);
  // The same shapes again with their weights requested into L2 ahead of the loads (issue 15: bytes
  // in flight decoupled from the batches' registers).
  for (GemvKernelConfig config : register_family) {
    config.l2_prefetch_rounds = gemv_l2_prefetch_rounds(config, multiprocessors);
    configs.push_back(config);
  }
  // Normalized GEMVs (x_rms_norm_eps, x staged): the same shapes with x copied into shared memory by
  // cp.async and summed and normalized there, one L2 round trip after the wait instead of two or
  // three. Affine GEMVs whose x the block can stage: the same shapes multiplying in f16
  // (half_products: x staged once as scaled f16, one shift a 4-bit weight word instead of three). A
  // shape an option does not fit (staged ring, shared group sums, x carried by batches, x too large)
  // is left out.
  auto append = [&](const std::vector<GemvKernelConfig>& twins) { configs.insert(configs.end(), twins.begin(), twins.end()); };
  append(gemv_valid_twins(register_family, [](GemvKernelConfig& config) { config.x_staged_by_async_copy = true; }));
  append(gemv_half_twins(register_family, multiprocessors));
  if (streamed) {
    GemvKernelConfig streamed_base = base;
    streamed_base.mainloop = GemvMainloop::streamed;
    add_family(streamed_base);
  }
  if (configs.empty() && first_error) throw *first_error;
  return configs;
}

std::string gemv_shape_name(const GemvKernelConfig& config) {
  if (config.mainloop == GemvMainloop::streamed) {
    return fmt::format("streamed w{} u{} s{} g{}x{}", config.warps_per_block, config.stage_iterations, config.stages,
                       config.multiprocessors, config.blocks_per_multiprocessor);
  }
  // Split-K, staged batches and shared group sums are part of the name: two candidates of one
  // stage never share a name (the tournament and the decision cache know them by it).
  std::string shape = fmt::format("w{} t{} f{} {}", config.warps_per_block, config.tiles_per_block,
                                  config.iterations_in_flight, config.double_buffered ? "db" : "batch");
  if (config.k_splits > 1) shape += fmt::format(" split{}", config.k_splits);
  if (config.shared_stages > 0) shape += fmt::format(" staged{}", config.shared_stages);
  if (config.shared_group_sums) shape += " group-sums";
  if (config.tile_loop_blocks_per_multiprocessor > 0) shape += fmt::format(" loop{}", config.tile_loop_blocks_per_multiprocessor);
  if (config.attention) shape += " attend";
  if (config.resident_blocks_per_multiprocessor > 0) shape += fmt::format(" resident{}", config.resident_blocks_per_multiprocessor);
  if (config.l2_prefetch_rounds > 0) shape += fmt::format(" prefetch{}", config.l2_prefetch_rounds);
  if (config.x_staged_by_async_copy) shape += " x-async";
  if (config.x_with_batch) shape += " x-batch";
  if (config.half_products) shape += " half";
  if (config.epilogue.product_count() == 2) return fmt::format("{} {}", gated_schedule_name(config.schedule), shape);
  return shape;
}

GemvKernelConfig GemvStage::base_config() const {
  GemvKernelConfig config;
  config.format = matrices.front().format;
  config.rows = rows;
  config.out_features = matrices.front().out_features;
  config.in_features = matrices.front().in_features;
  config.epilogue = epilogue;
  config.argmax_rows = argmax_output >= 0;
  if (norm_weight >= 0) config.x_rms_norm_eps = norm_eps;
  config.rope_cache = rope_cache;
  config.attention = attention;
  for (const GemvRowPart& part : row_parts) config.output_splits.push_back(part.matrix.out_features);
  return config;
}

bool is_gemv_contraction_op(const Node& node) { return node.op == "matmul" || node.op == "quantized_matmul"; }

FusionRegion contraction_node_region(const ComputeGraph& graph, NodeId node, const std::set<NodeId>& elsewhere) {
  const Node& contraction = graph.node(node);
  std::vector<NodeId> argmaxes;
  for (const Node& reader : graph.nodes()) {
    if (reader.op == "argmax" && reader.inputs[0] == contraction.outputs[0]) argmaxes.push_back(reader.id);
  }
  FusionRegion region = argmaxes.size() == 1
                            ? region_of_nodes(graph, {node, argmaxes.front()}, std::string(kContractionArgmaxRegionKind))
                            : region_of_nodes(graph, {node}, std::string(kContractionRegionKind));
  if (is_gemv_contraction_op(contraction) && contraction.inputs.size() >= 2) {
    region.roles = {{"input", contraction.inputs[0]}, {"weight", contraction.inputs[1]}};
    const PrologueMatch norm = match_input_prologue(graph, region.nodes, region.roles, normalized_input_prologue());
    if (norm.decision && !elsewhere.contains(norm.node)) {
      std::vector<NodeId> nodes = region.nodes;
      nodes.push_back(norm.node);
      std::vector<RegionRole> roles = region.roles;
      roles.insert(roles.end(), norm.roles.begin(), norm.roles.end());
      region = region_of_nodes(graph, std::move(nodes), region.rule);
      region.roles = std::move(roles);
    }
  }
  return region;
}

// ---------------------------------------------------------------- planning
namespace {

GemvRegionPlan refuse(std::string reason) { return {Decision::refuse(std::move(reason)), {}}; }

std::string described(const ComputeGraph& graph, ValueId id) {
  return fmt::format("'{}' {}", graph.value(id).name, graph.value(id).spec.to_string());
}

// The weight matrix of one contraction node and its activation rows, or why the GEMV cannot read it.
Decision gemv_matrix(const ComputeGraph& graph, const Node& node, GemvMatrix& matrix, std::int64_t& rows) {
  if (!is_gemv_contraction_op(node)) {
    return Decision::refuse(fmt::format("node '{}' is {}, not a matmul or quantized_matmul", node.name, node.op));
  }
  const TensorSpec& x = graph.value(node.inputs[0]).spec;
  if (x.dtype != DType::f16 && x.dtype != DType::bf16) {
    return Decision::refuse(fmt::format("node '{}' multiplies {} activations: the GEMV kernels read f16 or bf16",
                                        node.name, dtype_name(x.dtype)));
  }
  const std::int64_t k = x.row_length();
  rows = x.row_count();
  if (rows < 1 || rows > 16) {
    return Decision::refuse(fmt::format("node '{}' has M = {} activation rows: the GEMV kernels take 1..16 (decode)",
                                        node.name, rows));
  }
  matrix.in_features = k;
  matrix.weight = node.inputs[1];
  const TensorSpec& weight = graph.value(matrix.weight).spec;
  if (node.op == "matmul") {
    if (weight.rank() != 2) {
      return Decision::refuse(fmt::format("node '{}': the weight {} is batched; the GEMV reads one [N, K] matrix",
                                          node.name, described(graph, matrix.weight)));
    }
    if (!node.attributes.has("transpose_right") || node.attributes.get_int("transpose_right") != 1) {
      return Decision::refuse(fmt::format("node '{}': the weight {} is [K, N] (no transpose_right); the GEMV reads "
                                          "[N, K] rows in place",
                                          node.name, described(graph, matrix.weight)));
    }
    if (k % 8 != 0) {
      return Decision::refuse(fmt::format("node '{}': K = {} is not a multiple of 8 (16-byte weight rows)", node.name, k));
    }
    matrix.format = GemvWeightFormat::dense(x.dtype);
    matrix.out_features = weight.shape[0];
    return Decision::allow();
  }
  const int bits = static_cast<int>(node.attributes.get_int("bits"));
  const int group_size = static_cast<int>(node.attributes.get_int("group_size"));
  matrix.format = GemvWeightFormat::affine(bits, group_size, x.dtype);
  matrix.out_features = weight.shape[0];
  matrix.scales = node.inputs[2];
  matrix.biases = node.inputs[3];
  return Decision::allow();  // (mapped_to refuses weights the whole graph computes)
}

// A region cut out as a graph of its own; plans are made here and mapped back to `graph`.
// `canonical` is the same graph with its inputs named in0, in1, ... (in input order): epilogues
// are built there, so a kernel's text and name do not depend on value names, and the same region
// in every layer of a model is one kernel, compiled once.
struct RegionView {
  ComputeGraph sub;
  FusionRegion region;
  ComputeGraph canonical;
};

RegionView view_of(const ComputeGraph& graph, const FusionRegion& region) {
  RegionView view{region_graph(graph, region), {}, {}};
  view.region = region_in_region_graph(graph, region, view.sub);
  GraphBuilder builder;
  std::map<ValueId, ValueRef> mapped;
  for (std::size_t i = 0; i < view.sub.inputs().size(); ++i) {
    const ValueId input = view.sub.inputs()[i];
    mapped[input] = builder.input(fmt::format("in{}", i), view.sub.value(input).spec);
  }
  for (const Node& node : view.sub.nodes()) {
    std::vector<ValueRef> inputs;
    for (ValueId input : node.inputs) inputs.push_back(mapped.at(input));
    const std::vector<ValueRef> outputs = builder.add_node(node.op, inputs, node.attributes, node.name);
    for (std::size_t i = 0; i < outputs.size(); ++i) mapped[node.outputs[i]] = outputs[i];
  }
  std::vector<ValueRef> outputs;
  for (ValueId output : view.sub.outputs()) outputs.push_back(mapped.at(output));
  view.canonical = builder.build(outputs);
  return view;
}

// A value of the region graph in the canonical one, and back: inputs by position, computed
// values by name (node names are kept).
ValueId to_canonical(const RegionView& view, ValueId id) {
  const auto& inputs = view.sub.inputs();
  const auto found = std::find(inputs.begin(), inputs.end(), id);
  if (found != inputs.end()) return view.canonical.inputs()[static_cast<std::size_t>(found - inputs.begin())];
  return *view.canonical.find_value(view.sub.value(id).name);
}
ValueId from_canonical(const RegionView& view, ValueId id) {
  const auto& inputs = view.canonical.inputs();
  const auto found = std::find(inputs.begin(), inputs.end(), id);
  if (found != inputs.end()) return view.sub.inputs()[static_cast<std::size_t>(found - inputs.begin())];
  return *view.sub.find_value(view.canonical.value(id).name);
}

ValueId in_graph(const ComputeGraph& graph, const ComputeGraph& sub, ValueId id) {
  return *graph.find_value(sub.value(id).name);
}

// The contraction nodes of the region graph, in topological order.
std::vector<NodeId> contractions(const RegionView& view) {
  std::vector<NodeId> found;
  for (NodeId id : view.region.nodes) {
    if (view.sub.node(id).kind == OpKind::contraction) found.push_back(id);
  }
  return found;
}

// The epilogue from `output` back to `accumulators` (region-graph ids), built on the canonical
// graph, or the reason from_graph gave.
Decision epilogue_of(const RegionView& view, ValueId output, std::vector<ValueId> accumulators, GemvStage& stage,
                     std::string_view what) {
  std::vector<ValueId> canonical_accumulators;
  for (ValueId id : accumulators) canonical_accumulators.push_back(to_canonical(view, id));
  try {
    stage.epilogue = GemvEpilogue::from_graph(view.canonical, to_canonical(view, output), canonical_accumulators);
  } catch (const InputError& error) {
    return Decision::refuse(fmt::format("{}: {}", what, error.what()));
  }
  if (stage.epilogue.product_count() != static_cast<int>(accumulators.size())) {
    return Decision::refuse(fmt::format("{}: the epilogue {} does not read all {} products", what,
                                        stage.epilogue.to_string(), accumulators.size()));
  }
  for (const GemvEpilogue::TensorInput& tensor : stage.epilogue.tensor_inputs()) {
    stage.epilogue_tensors.push_back(from_canonical(view, *view.canonical.find_value(tensor.name)));
  }
  stage.output = output;
  return Decision::allow();
}

// When the region computes the stage's x itself by an RMSNorm (the input prologue), the stage reads
// the norm's x and weight instead and normalizes x as it loads it; the normalized value must stay
// inside the region (the kernel never writes it) and be read only by the stage's contractions.
// Returns the norm's node (or -1: x comes from outside the region), or why the GEMV cannot do it.
Decision normalized_input(const RegionView& view, GemvStage& stage, NodeId& norm_node) {
  const ComputeGraph& sub = view.sub;
  const ValueId normalized = stage.input;
  norm_node = sub.value(normalized).producer;
  if (norm_node < 0) return Decision::allow();
  const Node& norm = sub.node(norm_node);
  if (norm.op != "rms_norm" || norm.inputs.size() != 2) {
    return Decision::refuse(fmt::format("x '{}' is computed in the region by '{}' ({}); the GEMV normalizes x by an "
                                        "rms_norm only", sub.value(normalized).name, norm.name, norm.op));
  }
  const auto& outputs = view.region.outputs;
  if (std::find(outputs.begin(), outputs.end(), normalized) != outputs.end()) {
    return Decision::refuse(fmt::format("'{}' is also written by the region; the GEMV normalizes x as it loads it and "
                                        "writes no normalized x", sub.value(normalized).name));
  }
  for (NodeId reader : sub.consumers(normalized)) {
    const Node& node = sub.node(reader);
    if (!is_gemv_contraction_op(node) || node.inputs[0] != normalized) {
      return Decision::refuse(fmt::format("'{}' is read by '{}' ({}), not only as the GEMV's x", sub.value(normalized).name,
                                          node.name, node.op));
    }
  }
  const TensorSpec& x = sub.value(norm.inputs[0]).spec;
  const TensorSpec& weight = sub.value(norm.inputs[1]).spec;
  if (weight.dtype != x.dtype || weight.rank() != 1 || weight.shape[0] != x.row_length()) {
    return Decision::refuse(fmt::format("the rms_norm weight {} is not [K] in x's dtype {}: the GEMV reads it beside x",
                                        described(sub, norm.inputs[1]), dtype_name(x.dtype)));
  }
  stage.input = norm.inputs[0];
  stage.norm_weight = norm.inputs[1];
  stage.norm_eps = norm.attributes.get_double("eps");
  return Decision::allow();
}

// The stages' value ids, from the region graph's to the graph's.
GemvRegionPlan mapped_to(const ComputeGraph& graph, const ComputeGraph& sub, std::vector<GemvStage> stages) {
  auto map = [&](ValueId& id) {
    if (id >= 0) id = in_graph(graph, sub, id);
  };
  auto map_matrix = [&](GemvMatrix& matrix) {
    map(matrix.weight);
    map(matrix.scales);
    map(matrix.biases);
  };
  for (GemvStage& stage : stages) {
    for (GemvMatrix& matrix : stage.matrices) map_matrix(matrix);
    for (GemvRowPart& part : stage.row_parts) {
      map_matrix(part.matrix);
      map(part.bias);
      map(part.output);
    }
    map(stage.input);
    map(stage.norm_weight);
    map(stage.output);
    map(stage.argmax_output);
    for (ValueId& id : stage.epilogue_tensors) map(id);
  }
  // A GEMV reads its weights, its stacked parts' biases and its norm's weight before the wait for
  // the previous kernel (and copies quantized or stacked ones once, when bound): they must be inputs
  // of the whole graph (checkpoint tensors), never values a kernel of the run computes. In the
  // region's own graph every value from outside looks like an input, so this is asked of `graph`.
  const auto computed = [&](ValueId id) { return id >= 0 && graph.value(id).producer >= 0; };
  const auto producer_name = [&](ValueId id) { return graph.node(graph.value(id).producer).name; };
  for (const GemvStage& stage : stages) {
    std::vector<ValueId> weights;
    for (const GemvMatrix& matrix : stage.matrices) weights.insert(weights.end(), {matrix.weight, matrix.scales, matrix.biases});
    for (const GemvRowPart& part : stage.row_parts) {
      weights.insert(weights.end(), {part.matrix.weight, part.matrix.scales, part.matrix.biases, part.bias});
    }
    for (ValueId id : weights) {
      if (computed(id)) {
        return refuse(fmt::format("the weight '{}' is computed in the graph (by '{}'); the GEMV reads its weights "
                                  "before the previous kernel finishes, and a copy of quantized ones made once",
                                  graph.value(id).name, producer_name(id)));
      }
    }
    if (computed(stage.norm_weight)) {
      return refuse(fmt::format("the rms_norm weight '{}' is computed in the graph (by '{}'); the GEMV reads it before "
                                "the previous kernel finishes",
                                graph.value(stage.norm_weight).name, producer_name(stage.norm_weight)));
    }
  }
  return {Decision::allow(), std::move(stages)};
}

std::optional<std::string> missing_role(const FusionRegion& region, std::initializer_list<std::string_view> roles) {
  for (std::string_view role : roles) {
    if (!region.role(role)) return fmt::format("the region has no role '{}' (its pattern bound none)", role);
  }
  return std::nullopt;
}

// The one contraction reading `input` with the weight `weight`.
std::optional<NodeId> contraction_reading(const RegionView& view, ValueId input, ValueId weight) {
  for (NodeId id : contractions(view)) {
    const Node& node = view.sub.node(id);
    if (node.inputs.size() >= 2 && node.inputs[0] == input && node.inputs[1] == weight) return id;
  }
  return std::nullopt;
}

// Every epilogue tensor must be read from outside the region (or be `written`, a value an
// earlier launch writes): a value computed inside the region and not written by a launch
// would not exist.
Decision tensors_exist(const ComputeGraph& sub, const GemvStage& stage, ValueId written, std::string_view what) {
  for (ValueId id : stage.epilogue_tensors) {
    if (sub.value(id).producer >= 0 && id != written) {
      return Decision::refuse(fmt::format("{}: the epilogue reads '{}', computed inside the region by no GEMV",
                                          what, sub.value(id).name));
    }
  }
  return Decision::allow();
}

}  // namespace

GemvRegionPlan plan_gemv_swiglu(const ComputeGraph& graph, const FusionRegion& region) {
  if (region.rule != "swiglu_mlp") return refuse(fmt::format("not a swiglu_mlp region (rule '{}')", region.rule));
  if (auto missing = missing_role(region, {"input", "gate_weight", "up_weight", "down_weight"})) return refuse(*missing);
  const RegionView view = view_of(graph, region);
  const ComputeGraph& sub = view.sub;
  const ValueId input = *view.region.role("input");
  if (contractions(view).size() != 3) {
    return refuse(fmt::format("{} contractions: the SwiGLU GEMVs compute gate, up and down", contractions(view).size()));
  }
  const std::optional<NodeId> gate = contraction_reading(view, input, *view.region.role("gate_weight"));
  const std::optional<NodeId> up = contraction_reading(view, input, *view.region.role("up_weight"));
  if (!gate || !up || *gate == *up) return refuse("no two contractions read the input with the gate and up weights");
  const ValueId down_weight = *view.region.role("down_weight");
  std::optional<NodeId> down;
  for (NodeId id : contractions(view)) {
    if (id != *gate && id != *up && sub.node(id).inputs.size() >= 2 && sub.node(id).inputs[1] == down_weight) down = id;
  }
  if (!down) return refuse("no contraction reads the down weight");

  GemvStage gate_up;
  GemvMatrix gate_matrix, up_matrix, down_matrix;
  std::int64_t down_rows = 0;
  std::int64_t up_rows = 0;
  for (auto [node, matrix, rows] : {std::tuple{*gate, &gate_matrix, &gate_up.rows}, std::tuple{*up, &up_matrix, &up_rows},
                                    std::tuple{*down, &down_matrix, &down_rows}}) {
    Decision decision = gemv_matrix(sub, sub.node(node), *matrix, *rows);
    if (!decision) return {std::move(decision), {}};
  }
  if (gate_matrix.format != up_matrix.format || gate_matrix.out_features != up_matrix.out_features) {
    return refuse(fmt::format("gate ({}, N = {}) and up ({}, N = {}) differ: one GEMV reads both",
                              gate_matrix.format.to_string(), gate_matrix.out_features, up_matrix.format.to_string(),
                              up_matrix.out_features));
  }
  gate_up.matrices = {gate_matrix, up_matrix};
  gate_up.input = input;
  NodeId norm = -1;
  if (Decision normalized = normalized_input(view, gate_up, norm); !normalized) return {std::move(normalized), {}};
  const ValueId hidden = sub.node(*down).inputs[0];
  Decision decision = epilogue_of(view, hidden, {sub.node(*gate).outputs[0], sub.node(*up).outputs[0]}, gate_up,
                                  "the gate/up epilogue");
  if (!decision) return {std::move(decision), {}};
  if (decision = tensors_exist(sub, gate_up, -1, "the gate/up epilogue"); !decision) return {std::move(decision), {}};

  // The down GEMV writes the one value the region leaves besides h.
  std::vector<ValueId> finals;
  for (ValueId output : view.region.outputs) {
    if (output != hidden) finals.push_back(output);
  }
  if (finals.size() != 1) {
    return refuse(fmt::format("the region writes {} values after the down projection; its GEMV writes one",
                              finals.size()));
  }
  GemvStage down_stage;
  down_stage.matrices = {down_matrix};
  down_stage.input = hidden;
  down_stage.rows = down_rows;
  decision = epilogue_of(view, finals.front(), {sub.node(*down).outputs[0]}, down_stage, "the down epilogue");
  if (!decision) return {std::move(decision), {}};
  if (decision = tensors_exist(sub, down_stage, hidden, "the down epilogue"); !decision) return {std::move(decision), {}};
  return mapped_to(graph, sub, {std::move(gate_up), std::move(down_stage)});
}

GemvRegionPlan plan_gemv_contraction(const ComputeGraph& graph, const FusionRegion& region) {
  if (region.rule != "contraction_epilogue" && region.rule != kContractionRegionKind &&
      region.rule != kContractionArgmaxRegionKind) {
    return refuse(fmt::format("not a contraction region (rule '{}')", region.rule));
  }
  if (auto missing = missing_role(region, {"input", "weight"})) return refuse(*missing);
  const RegionView view = view_of(graph, region);
  const ComputeGraph& sub = view.sub;
  if (contractions(view).size() != 1) {
    return refuse(fmt::format("{} contractions: one GEMV computes one", contractions(view).size()));
  }
  const std::optional<NodeId> node =
      contraction_reading(view, *view.region.role("input"), *view.region.role("weight"));
  if (!node) return refuse("the contraction does not read the input and weight roles");
  GemvStage stage;
  GemvMatrix matrix;
  Decision decision = gemv_matrix(sub, sub.node(*node), matrix, stage.rows);
  if (!decision) return {std::move(decision), {}};
  stage.matrices = {matrix};
  stage.input = *view.region.role("input");
  NodeId norm = -1;
  if (decision = normalized_input(view, stage, norm); !decision) return {std::move(decision), {}};
  std::vector<ValueId> written = view.region.outputs;
  if (region.rule == kContractionArgmaxRegionKind) {
    // The argmax of the contraction's values: the kernel's argmax_rows join; the values are the store.
    const ValueId values = sub.node(*node).outputs[0];
    for (NodeId id : view.region.nodes) {
      const Node& argmax = sub.node(id);
      if (argmax.op == "argmax" && argmax.inputs[0] == values) stage.argmax_output = argmax.outputs[0];
    }
    if (stage.argmax_output < 0) return refuse("no argmax reads the contraction's values");
    if (std::find(written.begin(), written.end(), values) == written.end()) {
      return refuse(fmt::format("'{}' is read by the argmax only: the GEMV's argmax join reads the values it wrote",
                                sub.value(values).name));
    }
    std::erase(written, stage.argmax_output);
  }
  if (written.size() != 1) {
    return refuse(fmt::format("the region writes {} values; one GEMV writes one", written.size()));
  }
  decision = epilogue_of(view, written.front(), {sub.node(*node).outputs[0]}, stage, "the epilogue");
  if (!decision) return {std::move(decision), {}};
  if (decision = tensors_exist(sub, stage, -1, "the epilogue"); !decision) return {std::move(decision), {}};
  return mapped_to(graph, sub, {std::move(stage)});
}

GemvRegionPlan plan_gemv_siblings(const ComputeGraph& graph, const FusionRegion& region) {
  if (region.rule != "sibling_contractions") {
    return refuse(fmt::format("not a sibling_contractions region (rule '{}')", region.rule));
  }
  if (auto missing = missing_role(region, {"input", "weight.0", "weight.1"})) return refuse(*missing);
  const RegionView view = view_of(graph, region);
  const ComputeGraph& sub = view.sub;
  GemvStage stage;
  stage.input = *view.region.role("input");
  std::set<NodeId> covered;
  for (int p = 0; view.region.role(fmt::format("weight.{}", p)); ++p) {
    const std::optional<NodeId> node =
        contraction_reading(view, stage.input, *view.region.role(fmt::format("weight.{}", p)));
    if (!node) return refuse(fmt::format("no contraction reads the input with the role 'weight.{}'", p));
    GemvRowPart part;
    std::int64_t rows = 0;
    if (Decision decision = gemv_matrix(sub, sub.node(*node), part.matrix, rows); !decision) return {decision, {}};
    const GemvMatrix& first = stage.row_parts.empty() ? part.matrix : stage.row_parts.front().matrix;
    if (part.matrix.format != first.format || part.matrix.in_features != first.in_features) {
      return refuse(fmt::format("part {} ({}, K = {}) differs from part 0 ({}, K = {}): one GEMV reads them stacked", p,
                                part.matrix.format.to_string(), part.matrix.in_features, first.format.to_string(),
                                first.in_features));
    }
    stage.rows = rows;
    covered.insert(*node);
    part.output = sub.node(*node).outputs[0];
    if (const auto bias = view.region.role(fmt::format("bias.{}", p))) {
      // The bias add reading this part's product: its result is what the part writes.
      for (NodeId id : view.region.nodes) {
        const Node& add = sub.node(id);
        if (add.op == "add" && add.inputs.size() == 2 &&
            ((add.inputs[0] == part.output && add.inputs[1] == *bias) ||
             (add.inputs[1] == part.output && add.inputs[0] == *bias))) {
          covered.insert(id);
          part.output = add.outputs[0];
          part.bias = *bias;
          break;
        }
      }
      if (part.bias < 0) return refuse(fmt::format("no add reads part {}'s product and the role 'bias.{}'", p, p));
    }
    stage.row_parts.push_back(part);
  }
  NodeId norm = -1;
  if (Decision normalized = normalized_input(view, stage, norm); !normalized) return {std::move(normalized), {}};
  if (norm >= 0) covered.insert(norm);
  for (NodeId id : view.region.nodes) {
    if (!covered.contains(id)) {
      return refuse(fmt::format("node '{}' ({}) is neither a stacked contraction nor its bias add", sub.node(id).name,
                                sub.node(id).op));
    }
  }
  for (const GemvRowPart& part : stage.row_parts) {
    const auto& outputs = view.region.outputs;
    if (std::find(outputs.begin(), outputs.end(), part.output) == outputs.end()) {
      return refuse(fmt::format("'{}' is not written by the region", sub.value(part.output).name));
    }
  }
  if (view.region.outputs.size() != stage.row_parts.size()) {
    return refuse(fmt::format("the region writes {} values; its GEMV writes one per part ({})", view.region.outputs.size(),
                              stage.row_parts.size()));
  }
  GemvMatrix stacked = stage.row_parts.front().matrix;
  stacked.weight = stacked.scales = stacked.biases = -1;
  stacked.out_features = 0;
  for (const GemvRowPart& part : stage.row_parts) stacked.out_features += part.matrix.out_features;
  stage.matrices = {stacked};
  const bool biased = std::any_of(stage.row_parts.begin(), stage.row_parts.end(),
                                  [](const GemvRowPart& part) { return part.bias >= 0; });
  // The product is a value of the graph before its bias is added: rounded to its dtype first, as the
  // unfused matmul stores it (GemvEpilogue::from_graph's rule).
  const GemvEpilogue product =
      GemvEpilogue::stored_as(GemvEpilogue::accumulator(0), sub.value(stage.row_parts.front().output).spec.dtype);
  stage.epilogue = biased ? GemvEpilogue::add(product, GemvEpilogue::tensor("bias", true)) : GemvEpilogue::store();
  return mapped_to(graph, sub, {std::move(stage)});
}

GemvRegionPlan plan_gemv_qkv_rope_cache(const ComputeGraph& graph, const FusionRegion& region) {
  if (region.rule != "qkv_rope_kv_cache" || region.parts.size() != 2) {
    return refuse(fmt::format("not a qkv_rope_kv_cache region of two parts (rule '{}', {} parts)", region.rule,
                              region.parts.size()));
  }
  GemvRegionPlan plan = plan_gemv_siblings(graph, region.parts[0]);
  if (!plan.decision) return plan;
  const RopeCacheRegion rope = rope_cache_region(graph, region.parts[1]);
  if (!rope.decision) return refuse("the rope and cache writes: " + rope.decision.reason);
  GemvStage& stage = plan.stages.front();
  if (stage.row_parts.size() != 3 || stage.row_parts[0].output != rope.q || stage.row_parts[1].output != rope.k ||
      stage.row_parts[2].output != rope.v) {
    return refuse("the stacked GEMV's parts are not the q, k and v the rope and cache writes read, in that order");
  }
  if (rope.dtype != stage.matrices.front().format.activation || stage.rows != rope.steps) {
    return refuse(fmt::format("the rope reads {} [{} rows], the GEMV writes {} [{} rows]", dtype_name(rope.dtype), rope.steps,
                              dtype_name(stage.matrices.front().format.activation), stage.rows));
  }
  GemvRopeCacheEpilogue epilogue{rope.q_heads, rope.kv_heads, rope.head_dim, rope.capacity,
                                 graph.node(rope.rope).attributes};
  // The epilogue's inputs are read before the wait for the previous kernel where no kernel of the run
  // writes them: the parts' biases always qualify (plan_gemv_siblings refuses a computed one: the
  // stacked bias is a copy made once, when bound), the positions where they are a graph input.
  epilogue.inputs_before_wait = graph.value(rope.positions).producer < 0;
  try {
    (void)gemv_rope_row_order(epilogue);
  } catch (const InputError& error) {
    return refuse(error.what());
  }
  stage.rope_cache = std::move(epilogue);
  stage.rope_values = {rope.positions, rope.q_rotated, rope.k_cache, rope.k_cache_out, rope.v_cache, rope.v_cache_out};
  stage.nodes = region.nodes;
  return plan;
}

std::vector<FusionRegion> attention_projection_parts(const ComputeGraph& graph, const FusionRegion& region) {
  if (region.rule != "attention_output_projection") return {};
  const std::optional<ValueId> weight = region.role("weight");
  std::vector<NodeId> heads, projection;
  NodeId contraction = -1;
  for (NodeId id : region.nodes) {
    const Node& node = graph.node(id);
    if (node.op == "flash_attention" || node.kind == OpKind::layout) {
      heads.push_back(id);
    } else {
      projection.push_back(id);
      if (node.kind == OpKind::contraction && weight && node.inputs.size() >= 2 && node.inputs[1] == *weight) contraction = id;
    }
  }
  if (contraction < 0 || heads.empty() || graph.node(heads.front()).op != "flash_attention") return {};
  FusionRegion first = region_of_nodes(graph, heads, "attention_heads");
  first.certificate = region.certificate;
  FusionRegion second = region_of_nodes(graph, projection, "contraction_epilogue");
  second.roles = {{"input", graph.node(contraction).inputs[0]}, {"weight", *weight}};
  if (const std::optional<ValueId> addend = region.role("addend")) second.roles.push_back({"addend", *addend});
  return {std::move(first), std::move(second)};
}

GemvRegionPlan plan_gemv_attention_projection(const ComputeGraph& graph, const FusionRegion& region) {
  const std::vector<FusionRegion> parts = attention_projection_parts(graph, region);
  if (parts.size() != 2) return refuse("not an attention_output_projection region of that rule's structure");
  GemvRegionPlan plan = plan_gemv_contraction(graph, parts[1]);
  if (!plan.decision) return plan;
  GemvStage& stage = plan.stages.front();
  const Node& attention = graph.node(parts[0].nodes.front());
  AttentionProblem problem;
  try {
    // Nothing built on an unproved law runs.
    require_verified_certificate(attention, stable_weighted_softmax_law().name);
    if (attention.inputs.size() != 4) return refuse("the attention has no positions: the kernel attends at decode only");
    problem = AttentionProblem::from_specs(graph.value(attention.inputs[0]).spec, graph.value(attention.inputs[1]).spec,
                                           graph.value(attention.inputs[2]).spec, graph.value(attention.inputs[3]).spec,
                                           attention.attributes.get_double("scale"), attention.attributes.get_string("mask"),
                                           attention.attributes.get_int("offset"));
  } catch (const InputError& error) {
    return refuse(error.what());
  }
  if (problem.mask != AttentionMask::positions || problem.position_count != 1 || stage.rows != 1) {
    return refuse(fmt::format("the attention prologue attends for one token with the positions mask, not {}",
                              problem.to_string()));
  }
  if (problem.dtype != stage.matrices.front().format.activation || problem.head_dim != problem.value_dim) {
    return refuse(fmt::format("the attention prologue writes x in the projection's dtype with D = Dv: {}", problem.to_string()));
  }
  // x must be the attention output in its own order: every op between is a reshape or a transpose
  // that moves only axes of length one.
  for (std::size_t i = 1; i < parts[0].nodes.size(); ++i) {
    const Node& node = graph.node(parts[0].nodes[i]);
    if (!is_view_of_its_input(graph, node)) {
      return refuse(fmt::format("'{}' ({}) reorders the attention output before the projection", node.name, node.op));
    }
  }
  if (problem.output_elements() != stage.matrices.front().in_features) {
    return refuse(fmt::format("the attention writes {} values, the projection reads {}", problem.output_elements(),
                              stage.matrices.front().in_features));
  }
  stage.attention = GemvAttentionPrologue{problem.heads, problem.rows, problem.head_dim, problem.keys, problem.scale};
  stage.attention_values = {attention.inputs[0], attention.inputs[1], attention.inputs[2], attention.inputs[3]};
  stage.nodes = region.nodes;
  return plan;
}

GemvRegionPlan plan_gemv_region(const ComputeGraph& graph, const FusionRegion& region) {
  if (region.rule == "attention_output_projection") return plan_gemv_attention_projection(graph, region);
  if (region.rule == "qkv_rope_kv_cache") return plan_gemv_qkv_rope_cache(graph, region);
  if (region.rule == "swiglu_mlp") return plan_gemv_swiglu(graph, region);
  if (region.rule == "sibling_contractions") return plan_gemv_siblings(graph, region);
  if (region.rule == "contraction_epilogue" || region.rule == kContractionRegionKind ||
      region.rule == kContractionArgmaxRegionKind) {
    return plan_gemv_contraction(graph, region);
  }
  return refuse(fmt::format("the GEMV lowers swiglu_mlp, contraction_epilogue, contraction, contraction_argmax, "
                            "sibling_contractions, qkv_rope_kv_cache and attention_output_projection regions, not {}",
                            region.rule.empty() ? std::string("an unnamed region") : "'" + region.rule + "'"));
}

// ---------------------------------------------------------------- candidates
namespace {

// Device copies of one affine matrix in the repacked layout.
struct RepackedOnDevice {
  DeviceBuffer words;
  DeviceBuffer scale_bias;
};

// Device copies of a stacked matrix (sibling contractions): weights (dense) or repacked words and
// scale_bias (affine), and the stacked bias when a part has one.
struct StackedOnDevice {
  DeviceBuffer words;
  DeviceBuffer scale_bias;
  DeviceBuffer bias;
};

void upload_into(DeviceBuffer& buffer, std::span<const std::byte> bytes) {
  if (buffer.empty()) {
    buffer = DeviceBuffer::from_host(bytes);
  } else {
    buffer.copy_from_host(bytes);
  }
}

// The kernels of one lowering, compiled together (in parallel) on the first bind and loaded as
// candidates need them, and the repacked weights per device values, shared by every candidate.
// The stage kernels and the persistent ones (from `first_persistent` on) compile as two batches, so
// that a persistent kernel that fails to compile costs only the persistent candidates.
struct GemvKernelPool {
  std::vector<GemvKernelSource> kernels;
  std::size_t first_persistent = static_cast<std::size_t>(-1);
  std::mutex mutex;
  std::vector<CompiledProgram> programs;
  bool compiled[2] = {false, false};
  std::string compile_error[2];
  std::vector<std::shared_ptr<LoadedGemv>> loaded;
  // Keyed by DeviceValues::serial(), never by its address. The DeviceValues owns each copy (through
  // the keep_derived function that refreshes it) and so do the steps bound to it: the pool only finds
  // them, so a copy goes with the last of those.
  std::map<std::pair<std::uint64_t, ValueId>, std::weak_ptr<RepackedOnDevice>> repacked;
  std::map<std::pair<std::uint64_t, std::size_t>, std::weak_ptr<StackedOnDevice>> stacked;

  // The copy `map` finds for `key` while something owns it (made: false), else a new empty one it
  // finds from now on (made: true; the entries of copies gone are dropped then).
  template <class Map>
  static auto found_or_made(Map& map, const typename Map::key_type& key) {
    using Copy = typename Map::mapped_type::element_type;
    if (std::shared_ptr<Copy> found = map[key].lock()) return std::pair{found, false};
    std::erase_if(map, [](const auto& entry) { return entry.second.expired(); });
    auto made = std::make_shared<Copy>();
    map[key] = made;
    return std::pair{made, true};
  }

  std::shared_ptr<LoadedGemv> kernel(std::size_t index) {
    std::lock_guard lock(mutex);
    const int batch = index < first_persistent ? 0 : 1;
    if (!compiled[batch]) {
      compiled[batch] = true;
      programs.resize(kernels.size());
      loaded.resize(kernels.size());
      const std::size_t begin = batch == 0 ? 0 : first_persistent;
      const std::size_t end = batch == 0 ? std::min(first_persistent, kernels.size()) : kernels.size();
      try {
        std::vector<CompiledProgram> batch_programs =
            compile_gemvs(std::vector<GemvKernelSource>(kernels.begin() + static_cast<std::ptrdiff_t>(begin),
                                                        kernels.begin() + static_cast<std::ptrdiff_t>(end)));
        std::move(batch_programs.begin(), batch_programs.end(), programs.begin() + static_cast<std::ptrdiff_t>(begin));
      } catch (const CudaError& error) {
        compile_error[batch] = error.what();
      }
    }
    if (!compile_error[batch].empty()) throw CudaError(compile_error[batch]);
    if (!loaded[index]) loaded[index] = std::make_shared<LoadedGemv>(LoadedGemv::load(kernels[index], programs[index]));
    return loaded[index];
  }

  // The matrix's repacked copy on `values`' device, made once and kept current.
  std::shared_ptr<RepackedOnDevice> repacked_matrix(DeviceValues& values, const GemvMatrix& matrix) {
    std::lock_guard lock(mutex);
    const auto [slot, made] = found_or_made(repacked, {values.serial(), matrix.weight});
    if (!made) return slot;
    values.keep_derived({matrix.weight, matrix.scales, matrix.biases}, [&values, matrix, device = slot] {
      const QuantizedMatrix host = QuantizedMatrix::from_tensors(
          matrix.format.quantization(), values[matrix.weight].to_host(), values[matrix.scales].to_host(),
          values[matrix.biases].to_host());
      const RepackedAffineMatrix packed = repack_for_gemv(host);
      if (device->words.empty()) {
        device->words = DeviceBuffer::from_vector<std::uint32_t>(packed.words);
        device->scale_bias = DeviceBuffer::from_vector<std::uint16_t>(packed.scale_bias);
      } else {
        device->words.copy_from_host(std::as_bytes(std::span(packed.words)));
        device->scale_bias.copy_from_host(std::as_bytes(std::span(packed.scale_bias)));
      }
    });
    return slot;
  }

  // Stage `index`'s parts stacked by rows on `values`' device (and repacked when affine), made
  // once and kept current like the repacked matrices.
  std::shared_ptr<StackedOnDevice> stacked_matrix(DeviceValues& values, const GemvStage& stage, std::size_t index) {
    std::lock_guard lock(mutex);
    const auto [slot, made] = found_or_made(stacked, {values.serial(), index});
    if (!made) return slot;
    std::vector<ValueId> sources;
    for (const GemvRowPart& part : stage.row_parts) {
      for (ValueId id : {part.matrix.weight, part.matrix.scales, part.matrix.biases, part.bias}) {
        if (id >= 0) sources.push_back(id);
      }
    }
    values.keep_derived(sources, [&values, stage, device = slot] {
      // With the rope epilogue the kernel reads the rows in gemv_rope_row_order.
      const std::vector<std::int64_t> order =
          stage.rope_cache ? gemv_rope_row_order(*stage.rope_cache) : std::vector<std::int64_t>{};
      auto stacked_of = [&](auto value_of) {
        std::vector<HostTensor> parts;
        for (const GemvRowPart& part : stage.row_parts) parts.push_back(value_of(part));
        HostTensor stacked = stack_rows(parts);
        return order.empty() ? stacked : gather_rows(stacked, order);
      };
      const GemvMatrix& format = stage.matrices.front();
      if (format.format.is_affine()) {
        const QuantizedMatrix host = QuantizedMatrix::from_tensors(
            format.format.quantization(), stacked_of([&](const GemvRowPart& p) { return values[p.matrix.weight].to_host(); }),
            stacked_of([&](const GemvRowPart& p) { return values[p.matrix.scales].to_host(); }),
            stacked_of([&](const GemvRowPart& p) { return values[p.matrix.biases].to_host(); }));
        const RepackedAffineMatrix packed = repack_for_gemv(host);
        upload_into(device->words, std::as_bytes(std::span(packed.words)));
        upload_into(device->scale_bias, std::as_bytes(std::span(packed.scale_bias)));
      } else {
        upload_into(device->words,
                    stacked_of([&](const GemvRowPart& p) { return values[p.matrix.weight].to_host(); }).bytes());
      }
      if (stage.epilogue.tensor_inputs().empty()) return;
      // A part without a bias adds zeros (x + 0 is x).
      const HostTensor bias = stacked_of([&](const GemvRowPart& p) {
        return p.bias >= 0 ? values[p.bias].to_host()
                           : HostTensor(TensorSpec{{p.matrix.out_features}, format.format.activation});
      });
      upload_into(device->bias, bias.bytes());
    });
    return slot;
  }
};

// A stage's kernel arguments in gemv.h's order (stacked siblings, or its matrices: repacked when
// affine), keeping alive the device copies they point at.
void add_stage_arguments(GemvKernelPool& pool, DeviceValues& values, const GemvStage& stage, std::size_t index,
                         KernelArguments& arguments, std::vector<std::shared_ptr<RepackedOnDevice>>& repacked,
                         std::vector<std::shared_ptr<StackedOnDevice>>& stacked) {
  if (!stage.row_parts.empty()) {
    stacked.push_back(pool.stacked_matrix(values, stage, index));
    arguments.add_pointer(stacked.back()->words);
    if (stage.matrices.front().format.is_affine()) arguments.add_pointer(stacked.back()->scale_bias);
    arguments.add_pointer(values[stage.input].address());
    if (stage.norm_weight >= 0) arguments.add_pointer(values[stage.norm_weight].address());
    if (!stage.epilogue.tensor_inputs().empty()) arguments.add_pointer(stacked.back()->bias);
    if (stage.rope_cache) {
      // q rotated and the caches (in place), then the positions.
      for (ValueId written : {stage.rope_values.q_rotated, stage.rope_values.k_cache_out, stage.rope_values.v_cache_out}) {
        arguments.add_pointer(values[written].address());
      }
      arguments.add_pointer(values[stage.rope_values.positions].address());
      return;
    }
    for (const GemvRowPart& part : stage.row_parts) arguments.add_pointer(values[part.output].address());
    return;
  }
  for (const GemvMatrix& matrix : stage.matrices) {
    if (matrix.format.is_affine()) {
      repacked.push_back(pool.repacked_matrix(values, matrix));
      arguments.add_pointer(repacked.back()->words);
      arguments.add_pointer(repacked.back()->scale_bias);
    } else {
      arguments.add_pointer(values[matrix.weight].address());
    }
  }
  arguments.add_pointer(values[stage.input].address());
  if (stage.norm_weight >= 0) arguments.add_pointer(values[stage.norm_weight].address());
  for (ValueId tensor : stage.epilogue_tensors) arguments.add_pointer(values[tensor].address());
  arguments.add_pointer(values[stage.output].address());
  if (stage.argmax_output >= 0) arguments.add_pointer(values[stage.argmax_output].address());
  if (stage.attention) {
    for (ValueId id : {stage.attention_values.q, stage.attention_values.k, stage.attention_values.v,
                       stage.attention_values.positions}) {
      arguments.add_pointer(values[id].address());
    }
  }
}

// The weight bytes a bound plan streams: the buffers add_stage_arguments passes (the pool's
// repacked and stacked copies are made once per DeviceValues, so these are the bound step's own).
// A block reads its rows each K in order while the others read theirs, so a range's period is what
// one block's rows take: a 16-row tile of a repacked (affine) buffer (gemv_weight_layout.cpp) or of
// its scales and biases; one row of a dense [N, K] matrix (its 16 rows lie apart, each read front to back).
std::vector<DeviceByteRange> stage_weights(GemvKernelPool& pool, DeviceValues& values, const std::vector<GemvStage>& stages) {
  std::vector<DeviceByteRange> ranges;
  for (std::size_t index = 0; index < stages.size(); ++index) {
    const auto launch = static_cast<unsigned>(index);  // one launch a stage
    // `rows` rows, `rows_a_piece` of them read together front to back (16: a tile; 1: a dense row).
    auto add = [&](std::uint64_t address, std::uint64_t bytes, std::int64_t rows, std::int64_t rows_a_piece) {
      if (bytes == 0) return;
      const auto pieces = static_cast<std::uint64_t>((rows + rows_a_piece - 1) / rows_a_piece);
      ranges.push_back({address, bytes, pieces > 0 && bytes % pieces == 0 ? bytes / pieces : 0, launch});
    };
    auto add_buffer = [&](const DeviceBuffer& buffer, std::int64_t rows, std::int64_t rows_a_piece) {
      if (!buffer.empty()) add(buffer.address(), buffer.size_bytes(), rows, rows_a_piece);
    };
    const GemvStage& stage = stages[index];
    if (!stage.row_parts.empty()) {
      const std::shared_ptr<StackedOnDevice> stacked = pool.stacked_matrix(values, stage, index);
      const bool repacked = stage.matrices.front().format.is_affine();
      add_buffer(stacked->words, stage.matrices.front().out_features, repacked ? 16 : 1);
      add_buffer(stacked->scale_bias, stage.matrices.front().out_features, 16);
      continue;
    }
    for (const GemvMatrix& matrix : stage.matrices) {
      if (matrix.format.is_affine()) {
        const std::shared_ptr<RepackedOnDevice> repacked = pool.repacked_matrix(values, matrix);
        add_buffer(repacked->words, matrix.out_features, 16);
        add_buffer(repacked->scale_bias, matrix.out_features, 16);
      } else {
        add(values[matrix.weight].address(), static_cast<std::uint64_t>(values[matrix.weight].spec.bytes()),
            matrix.out_features, 1);
      }
    }
  }
  return ranges;
}

// The SMs of the current device, for the persistent grid; 132 (the H200's) where there is none
// (lowerings also run on machines without a GPU: the kernel is then refused when it is loaded).
int multiprocessors_or_h200() {
  try {
    return current_device_multiprocessors();
  } catch (const std::exception&) {
    return 132;
  }
}

// `persistent`: a swiglu_mlp plan (gate/up, then down) also gets the persistent decode-MLP kernels
// (gemv.h: both stages in one launch), the first `gemv_lowering_persistent_shapes` shapes.
Lowered candidates_of(const GemvRegionPlan& plan, bool persistent = false) {
  if (!plan.decision) return {plan.decision, {}};
  auto pool = std::make_shared<GemvKernelPool>();
  // Per stage: the configs and their kernels' indices in the pool.
  std::vector<std::vector<GemvKernelConfig>> configs;
  std::vector<std::vector<std::size_t>> kernel_index;
  for (const GemvStage& stage : plan.stages) {
    std::vector<GemvKernelConfig> stage_configs;
    try {
      const bool one_stage = plan.stages.size() == 1;
      stage_configs = gemv_stage_configs(
          stage.base_config(), one_stage ? gemv_lowering_shapes_per_family_one_stage : gemv_lowering_shapes_per_family,
          multiprocessors_or_h200(), one_stage || gemv_lowering_two_stage_streamed);
    } catch (const InputError& error) {
      return {Decision::refuse(fmt::format("no GEMV for {}: {}", stage.base_config().to_string(), error.what())), {}};
    }
    std::vector<std::size_t> indices;
    for (const GemvKernelConfig& config : stage_configs) {
      indices.push_back(pool->kernels.size());
      pool->kernels.push_back(generate_gemv_kernel(config));
    }
    configs.push_back(std::move(stage_configs));
    kernel_index.push_back(std::move(indices));
  }
  auto stages = std::make_shared<const std::vector<GemvStage>>(plan.stages);

  // Every combination of one shape per stage (first stage slowest-varying).
  std::vector<std::vector<std::size_t>> choices = {{}};
  for (const auto& stage_configs : configs) {
    std::vector<std::vector<std::size_t>> extended;
    for (const auto& prefix : choices) {
      for (std::size_t i = 0; i < stage_configs.size(); ++i) {
        extended.push_back(prefix);
        extended.back().push_back(i);
      }
    }
    choices = std::move(extended);
  }
  std::vector<FusedCandidate> candidates;
  for (const std::vector<std::size_t>& choice : choices) {
    FusedCandidate candidate;
    std::string variant = "gemv";
    std::vector<std::size_t> kernels;
    for (std::size_t s = 0; s < choice.size(); ++s) {
      const GemvKernelConfig& config = configs[s][choice[s]];
      variant += (s == 0 ? " " : " + ") + gemv_shape_name(config);
      kernels.push_back(kernel_index[s][choice[s]]);
      candidate.source += pool->kernels[kernel_index[s][choice[s]]].source;
      candidate.summary += (s == 0 ? "" : "; ") + config.to_string();
    }
    candidate.id = CandidateId::fused(variant);
    candidate.launches = static_cast<int>(choice.size());
    candidate.bind = [pool, stages, kernels](DeviceValues& values) {
      struct Launch {
        std::shared_ptr<LoadedGemv> gemv;
        KernelArguments arguments;
        // The rope epilogue writes its caches in place: a cache whose output has a buffer of its
        // own is copied there first (the kernel then writes the new rows).
        struct CacheCopy {
          std::uint64_t to = 0, from = 0;
          std::size_t bytes = 0;
        };
        std::vector<CacheCopy> cache_copies;
      };
      std::vector<Launch> launches;
      std::vector<std::shared_ptr<RepackedOnDevice>> repacked;
      std::vector<std::shared_ptr<StackedOnDevice>> stacked;
      for (std::size_t s = 0; s < stages->size(); ++s) {
        const GemvStage& stage = (*stages)[s];
        Launch launch{pool->kernel(kernels[s]), {}, {}};
        add_stage_arguments(*pool, values, stage, s, launch.arguments, repacked, stacked);
        if (stage.rope_cache) {
          for (auto [cache, written] : {std::pair{stage.rope_values.k_cache, stage.rope_values.k_cache_out},
                                        std::pair{stage.rope_values.v_cache, stage.rope_values.v_cache_out}}) {
            if (values.shares_buffer(written, cache)) continue;
            const std::size_t bytes = static_cast<std::size_t>(values.graph().value(cache).spec.bytes());
            launch.cache_copies.push_back({values[written].address(), values[cache].address(), bytes});
          }
        }
        launches.push_back(std::move(launch));
      }
      return DeviceStep([launches = std::move(launches), repacked = std::move(repacked),
                         stacked = std::move(stacked)](const CudaStream& stream) {
        for (const Launch& launch : launches) {
          for (const Launch::CacheCopy& copy : launch.cache_copies) {
            DeviceBuffer::borrow(copy.to, copy.bytes).copy_from_device(DeviceBuffer::borrow(copy.from, copy.bytes), copy.bytes,
                                                                         &stream);
          }
          launch.gemv->launch(stream, launch.arguments);
        }
      });
    };
    candidate.weights = [pool, stages](DeviceValues& values) { return stage_weights(*pool, values, *stages); };
    candidates.push_back(std::move(candidate));
  }
  if (persistent && plan.stages.size() == 2) {
    std::vector<PersistentMlpConfig> configs;
    try {
      configs = persistent_mlp_candidates(plan.stages[0].base_config(), plan.stages[1].base_config(),
                                          multiprocessors_or_h200());
    } catch (const InputError&) {
      configs.clear();  // a plan the persistent kernel cannot take keeps the two-stage candidates
    }
    if (configs.size() > static_cast<std::size_t>(gemv_lowering_persistent_shapes)) {
      configs.resize(static_cast<std::size_t>(gemv_lowering_persistent_shapes));
    }
    if (!configs.empty()) pool->first_persistent = pool->kernels.size();
    for (const PersistentMlpConfig& config : configs) {
      const std::size_t index = pool->kernels.size();
      pool->kernels.push_back(generate_persistent_mlp_kernel(config));
      FusedCandidate candidate;
      candidate.id = CandidateId::fused("gemv " + config.shape_name());
      candidate.source = pool->kernels.back().source;
      candidate.summary = config.to_string();
      candidate.launches = 1;
      candidate.bind = [pool, stages, index](DeviceValues& values) {
        std::vector<std::shared_ptr<RepackedOnDevice>> repacked;
        std::vector<std::shared_ptr<StackedOnDevice>> stacked;
        KernelArguments arguments;
        for (std::size_t s = 0; s < stages->size(); ++s) {
          add_stage_arguments(*pool, values, (*stages)[s], s, arguments, repacked, stacked);
        }
        return DeviceStep([gemv = pool->kernel(index), arguments, repacked = std::move(repacked),
                           stacked = std::move(stacked)](const CudaStream& stream) { gemv->launch(stream, arguments); });
      };
      candidate.weights = [pool, stages](DeviceValues& values) { return stage_weights(*pool, values, *stages); };
      candidates.push_back(std::move(candidate));
    }
  }
  return {Decision::allow(), std::move(candidates)};
}

}  // namespace

Lowered gemv_swiglu_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  return candidates_of(plan_gemv_swiglu(graph, region), true);
}

Lowered gemv_contraction_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  return candidates_of(plan_gemv_contraction(graph, region));
}

Lowered gemv_region_candidates(const ComputeGraph& graph, const FusionRegion& region) {
  return candidates_of(plan_gemv_region(graph, region), region.rule == "swiglu_mlp");
}

}  // namespace metile
