// The row-kernel generator: one fusion region of elementwise ops and row reductions becomes one
// CUDA kernel that reads each input row once and writes every escaping value from registers.
//
//   region (topological)      steps                                   phases
//   summed = add(v, r)        compute v0 = round(x0 + x1)             phase 0: loads, compute, store summed,
//   normalized = rms_norm(..) reduce  r0 = sum(v0 * v0)                        partial sum, row_reduce
//                             compute v1 = round(v0 * s0 * x2)        phase 1: compute, store normalized
//
// A reduction ends a phase (every thread of the row needs its result). When the row fits in
// registers (kItems <= 16 vectors per thread, and every input and computed array within the thread's
// register budget) values computed in one phase stay live for the next; otherwise each phase streams
// the row in tiles of as many vectors as fit and recomputes from the inputs (no extra writes).
// Rows are handled by a power-of-two group of threads: a sub-warp or warp (shuffles only,
// several rows per block) or a whole block (shuffles + shared memory, one row per block).
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "codegen_internal.h"
#include "metile/codegen.h"
#include "metile/discovery.h"

namespace metile {
namespace {

using codegen_detail::comment_text;
using codegen_detail::describe_node;
using codegen_detail::sanitize_identifier;

constexpr int register_item_limit = 16;  // vectors per thread kept in registers
constexpr int streaming_items = 4;       // vectors per thread per tile when streaming, at most
constexpr int register_overhead = 32;    // registers a thread keeps for what is not row data

// How a region input is read for one row.
enum class OperandMode { row, broadcast_rows, scalar };

struct RegionInput {
  ValueId value = -1;
  OperandMode mode = OperandMode::row;
  std::int64_t broadcast_rows = 1;  // broadcast_rows: the operand holds this many rows, reused cyclically
};

struct Step {
  enum class Kind { compute, reduce } kind = Kind::compute;
  ValueId value = -1;       // compute: the value written (array v<k>)
  std::string expression;   // per element, uses [item][e], col, row
  std::string reduce_op;    // reduce: "SumOp" / "MaxOp"
  int scalar = -1;          // reduce: writes r<scalar>
  std::string after;        // reduce: statements deriving per-row scalars from r<scalar>
  ValueId row_result = -1;  // reduce: a [..., 1] value stored once per row after `after`
  std::string row_result_expression;
  std::string comment;
};

struct RowAnalysis {
  std::int64_t rows = 0;
  std::int64_t length = 0;
  std::vector<RegionInput> inputs;
  std::vector<Step> steps;
  std::map<ValueId, std::string> array_of;  // every value the kernel reads or computes -> its register array
  std::set<ValueId> row_results;            // values of one element per row ([..., 1]), not arrays
  int vector_width = 1;
  bool has_reduction = false;
  bool online_softmax = false;  // a reduction over OnlineSoftmaxOp (two floats of state)
};

// A region's analysis, or (decision not ok) why it is no row kernel.
struct Analysed {
  Decision decision;
  RowAnalysis analysis;
};
Analysed refused(std::string reason) { return {Decision::refuse(std::move(reason)), {}}; }

std::string node_label(const Node& node) { return fmt::format("node '{}' ({})", node.name, node.op); }

std::string rounded(const std::string& expression, DType dtype) {
  if (dtype == DType::f32) return expression;
  return fmt::format("metile_device::round_to<{}>({})", cuda_storage_type(dtype), expression);
}

// The steps of the region's nodes, one node at a time: what an op-table hook writes through
// RowKernelSteps becomes compute and reduce steps of the analysis.
class NodeSteps final : public RowKernelSteps {
 public:
  NodeSteps(const ComputeGraph& graph, RowAnalysis& analysis, bool online_softmax)
      : graph_(graph),
        analysis_(analysis),
        length_literal_(std::to_string(analysis.length)),  // exact: an f32 operand divides by its f32 rounding
        online_softmax_(online_softmax) {}

  void add(const Node& node) {
    node_ = &node;
    const OpDefinition& definition = *find_op(node.op);
    if (node.op == "softmax" && online_softmax_) {
      // Max and normalizer in one pass: the running state of the stable_weighted_softmax law.
      const std::string x = operand(0);
      const std::string state = add_reduction("OnlineSoftmaxOp", x, "running max and normalizer in one pass");
      const std::string maximum = scalar(state + ".m");
      const std::string inverse = scalar("1.0f / " + state + ".l");
      analysis_.online_softmax = true;
      element_result("expf(" + x + " - " + maximum + ") * " + inverse);
    } else if (node.op == "cast") {
      element_result(operand(0));  // the rounding to the output dtype is the cast
    } else if (definition.elementwise) {
      std::vector<std::string> operands;
      std::vector<TensorSpec> specs;
      for (std::size_t input = 0; input < node.inputs.size(); ++input) {
        operands.push_back(operand(input));
        specs.push_back(graph_.value(node.inputs[input]).spec);
      }
      element_result(definition.elementwise->cuda(operands, CudaElementSite{"row", "(col + e)"}, node.attributes, specs));
    } else {
      definition.row_reduction->row_kernel(*this, node.attributes);
    }
  }

  std::string operand(std::size_t input) override {
    return analysis_.array_of.at(node_->inputs.at(input)) + "[item][e]";
  }
  std::string row_length() override { return length_literal_; }
  std::string reduce(std::string_view op, std::string expression, std::string_view what) override {
    static const std::map<std::string_view, std::string> reductions = {{"sum", "SumOp"}, {"sum_f64", "SumF64Op"}, {"max", "MaxOp"}};
    const auto found = reductions.find(op);
    if (found == reductions.end()) throw std::logic_error(fmt::format("row kernel: no reduction '{}'", op));
    return add_reduction(found->second, std::move(expression), what);
  }
  std::string add_reduction(std::string reduce_op, std::string expression, std::string_view what) {
    Step step;
    step.kind = Step::Kind::reduce;
    step.reduce_op = std::move(reduce_op);
    step.expression = std::move(expression);
    step.scalar = reductions_++;
    step.comment = fmt::format("{} ({})", describe_node(graph_, *node_), what);
    analysis_.has_reduction = true;
    analysis_.steps.push_back(std::move(step));
    return fmt::format("r{}", analysis_.steps.back().scalar);
  }
  std::string scalar(std::string expression) override {
    const std::string name = fmt::format("s{}", scalars_++);
    // auto: f32 where the expression is (most), f64 where it is (layer_norm's statistics).
    last_reduction().after += fmt::format("{}const auto {} = {};", last_reduction().after.empty() ? "" : " ", name,
                                          expression);
    return name;
  }
  void element_result(std::string expression) override {
    const ValueId out = node_->outputs.front();
    Step step;
    step.kind = Step::Kind::compute;
    step.value = out;
    step.expression = rounded(expression, graph_.value(out).spec.dtype);
    step.comment = describe_node(graph_, *node_);
    analysis_.array_of[out] = fmt::format("v{}", computed_++);
    analysis_.steps.push_back(std::move(step));
  }
  void row_result(std::string expression) override {
    Step& reduction = last_reduction();
    reduction.row_result = node_->outputs.front();
    reduction.row_result_expression = std::move(expression);
  }

 private:
  // Per-row scalars are derived right after the reduction that ends their phase.
  Step& last_reduction() {
    for (auto step = analysis_.steps.rbegin(); step != analysis_.steps.rend(); ++step) {
      if (step->kind == Step::Kind::reduce) return *step;
    }
    throw std::logic_error(fmt::format("row kernel: {} derives a per-row value before any reduction", node_->op));
  }

  const ComputeGraph& graph_;
  RowAnalysis& analysis_;
  const Node* node_ = nullptr;
  std::string length_literal_;
  int computed_ = 0;
  int reductions_ = 0;
  int scalars_ = 0;
  bool online_softmax_ = false;
};

Analysed analyse(const ComputeGraph& graph, const FusionRegion& region, bool online_softmax = false) {
  if (region.nodes.empty()) return refused("the region has no nodes");
  if (region.outputs.empty()) return refused("the region has no outputs");
  RowAnalysis analysis;
  std::vector<NodeId> nodes = region.nodes;
  std::sort(nodes.begin(), nodes.end());  // node ids are topological

  // The row shape: that of the first node's first output (a row reduction's input: sum and mean
  // shorten the row); every other computed value must share it.
  const Node& first_node = graph.node(nodes.front());
  const TensorSpec& first = graph.value(first_node.kind == OpKind::row_reduction ? first_node.inputs.front()
                                                                                  : first_node.outputs.front()).spec;
  analysis.length = first.row_length();
  analysis.rows = first.row_count();
  if (analysis.length <= 0 || analysis.rows <= 0) return refused(fmt::format("empty tensor {}", first.to_string()));
  if (analysis.length > (std::int64_t{1} << 30)) {
    return refused(fmt::format("row length {} is beyond the row kernel's limit", analysis.length));
  }
  // Rows of length 1: a reducing op's one value a row ([R, 1]) has the shape of its row, so a reader in
  // the region could not be told from an elementwise reader of the row (mean then silu read a value never
  // stored: std::out_of_range out of this decision). Such a region runs as native kernels.
  if (analysis.length == 1 && nodes.size() > 1 &&
      std::any_of(nodes.begin(), nodes.end(), [&](NodeId id) { return graph.node(id).kind == OpKind::row_reduction; })) {
    return refused("rows of length 1 with a row reduction: its result and its row have one shape");
  }
  std::set<ValueId> produced;
  for (NodeId id : nodes) {
    const Node& node = graph.node(id);
    const OpDefinition* definition = find_op(node.op);
    const bool row_op = node.op == "cast" || (definition != nullptr && definition->elementwise) ||
                        (definition != nullptr && definition->row_reduction && node.kind == OpKind::row_reduction);
    if (!row_op) {
      if (definition != nullptr && definition->row_reduction) {  // softmax over another axis than the last
        return refused(fmt::format("{} reduces axis {} of {}, not the last: no GPU kernel reduces another axis",
                                   node_label(node), node.attributes.get_int("axis"),
                                   graph.value(node.inputs.front()).spec.to_string()));
      }
      return refused(fmt::format("{} is a {} op, not a row op", node_label(node), op_kind_name(node.kind)));
    }
    for (ValueId input : node.inputs) {
      if (analysis.row_results.contains(input)) {
        return refused(fmt::format("{} reads '{}', one value per row, inside the region", node_label(node),
                                   graph.value(input).name));
      }
    }
    for (ValueId output : node.outputs) {
      const TensorSpec& spec = graph.value(output).spec;
      const bool row_result = node.kind == OpKind::row_reduction && spec.row_length() == 1 && analysis.length != 1;
      if ((spec.row_length() != analysis.length && !row_result) || spec.row_count() != analysis.rows) {
        return refused(fmt::format("{} produces {}, not rows of {} x {}", node_label(node), spec.to_string(),
                                   analysis.rows, analysis.length));
      }
      if (row_result) analysis.row_results.insert(output);
      produced.insert(output);
    }
  }
  for (ValueId output : region.outputs) {
    if (!produced.contains(output)) {
      return refused(fmt::format("region output '{}' is not produced by the region", graph.value(output).name));
    }
  }

  // Inputs: full rows, rows reused cyclically (a [H] weight, a [S, H] table), or one scalar.
  std::set<ValueId> region_inputs;
  for (NodeId id : nodes) {
    for (ValueId input : graph.node(id).inputs) {
      if (!produced.contains(input)) region_inputs.insert(input);
    }
  }
  std::vector<ValueId> ordered_inputs = region.inputs;
  for (ValueId input : region_inputs) {
    if (std::find(ordered_inputs.begin(), ordered_inputs.end(), input) == ordered_inputs.end()) {
      ordered_inputs.push_back(input);
    }
  }
  int largest_element = 1;
  for (ValueId input : ordered_inputs) {
    if (!region_inputs.contains(input)) continue;  // listed by the planner but not read: ignore
    const TensorSpec& spec = graph.value(input).spec;
    RegionInput operand;
    operand.value = input;
    const std::int64_t count = spec.element_count();
    if (count == analysis.rows * analysis.length) {
      operand.mode = OperandMode::row;
    } else if (count == 1) {
      operand.mode = OperandMode::scalar;
    } else if (count % analysis.length == 0 && spec.row_length() == analysis.length &&
               analysis.rows % (count / analysis.length) == 0) {
      operand.mode = OperandMode::broadcast_rows;
      operand.broadcast_rows = count / analysis.length;
    } else {
      return refused(fmt::format("input '{}' {} does not broadcast over rows of {} x {}", graph.value(input).name,
                         spec.to_string(), analysis.rows, analysis.length));
    }
    largest_element = std::max<int>(largest_element, static_cast<int>(dtype_size(spec.dtype)));
    analysis.array_of[input] = fmt::format("x{}", analysis.inputs.size());
    analysis.inputs.push_back(operand);
  }
  for (ValueId output : produced) {
    largest_element = std::max<int>(largest_element, static_cast<int>(dtype_size(graph.value(output).spec.dtype)));
  }

  // 16-byte vectors of the widest dtype. Several rows need every row start aligned, so the width
  // must divide the row length; a single row starts aligned and may end in a scalar tail.
  const int widest_vector = 16 / largest_element;
  analysis.vector_width = widest_vector;
  if (analysis.rows > 1) {
    while (analysis.vector_width > 1 && analysis.length % analysis.vector_width != 0) analysis.vector_width /= 2;
  }

  // Steps, in node order: elementwise ops through the op table's CUDA expression, row reductions
  // through their kernel hook.
  NodeSteps steps(graph, analysis, online_softmax);
  for (NodeId id : nodes) steps.add(graph.node(id));
  return {Decision::allow(), std::move(analysis)};
}

// The analysis of a region the caller expects to be a row kernel: InputError with the reason if not.
RowAnalysis analysis_of_row_region(const ComputeGraph& graph, const FusionRegion& region, bool online_softmax = false) {
  Analysed analysed = analyse(graph, region, online_softmax);
  if (!analysed.decision) throw InputError(analysed.decision.reason);
  return std::move(analysed.analysis);
}

// The CUDA spelling of a law term over a state struct (variables "a.m" and "b.l" are member
// accesses) and one element "e.s" (the row element x).
std::string cuda_term(const Term& term) {
  switch (term.kind) {
    case Term::Kind::variable: return term.name == "e.s" ? "x" : term.name;
    case Term::Kind::constant: return cuda_float_literal(term.value);
    case Term::Kind::negative_infinity: return "negative_infinity()";
    case Term::Kind::add: return fmt::format("({} + {})", cuda_term(*term.operands[0]), cuda_term(*term.operands[1]));
    case Term::Kind::subtract:
      return fmt::format("difference({}, {})", cuda_term(*term.operands[0]), cuda_term(*term.operands[1]));
    case Term::Kind::multiply: return fmt::format("({} * {})", cuda_term(*term.operands[0]), cuda_term(*term.operands[1]));
    case Term::Kind::divide: return fmt::format("({} / {})", cuda_term(*term.operands[0]), cuda_term(*term.operands[1]));
    case Term::Kind::max: return fmt::format("fmaxf({}, {})", cuda_term(*term.operands[0]), cuda_term(*term.operands[1]));
    case Term::Kind::exp: return fmt::format("expf({})", cuda_term(*term.operands[0]));
  }
  throw std::logic_error("cuda_term: unknown term kind");
}

// The one-pass softmax reduction, generated from the stable_weighted_softmax law restricted to its
// scalar components (m, l): the weighted numerator o is not needed for a softmax row, and the m
// and l terms do not read it. The law's certificate covers exactly these merge terms.
std::string online_softmax_op_source() {
  const ReductionLaw law = stable_weighted_softmax_law();
  if (!prove(law).verified) throw std::logic_error("the stable_weighted_softmax law does not verify");
  for (std::size_t component = 0; component < 2; ++component) {
    if (law.state[component].per_lane) throw std::logic_error("online softmax: m and l must be scalars");
  }
  auto state = [&](const std::vector<TermRef>& terms) {
    return fmt::format("State{{{}, {}}}", cuda_term(*terms[0]), cuda_term(*terms[1]));
  };
  std::string source = "\n// One-pass softmax statistics, generated from law " + law.name +
                       " (src/discovery): state (m: running max, l: normalizer).\n";
  source += "namespace metile_device {\n";
  source += "struct OnlineSoftmaxOp {\n";
  source += "  struct State { float m, l; };\n";
  source += "  static __device__ __forceinline__ State identity() { return " + state(law.identity) + "; }\n";
  source += "  static __device__ __forceinline__ State combine(State a, State b) { return " + state(law.merge) + "; }\n";
  source += "  static __device__ __forceinline__ State apply(State a, float x) { return combine(a, " + state(law.lift) + "); }\n";
  source += "  static __device__ __forceinline__ State shuffle_xor(State v, int offset) {\n"
            "    return State{__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.l, offset)};\n  }\n";
  source += "  static __device__ __forceinline__ State shuffle(State v, int lane) {\n"
            "    return State{__shfl_sync(0xffffffffu, v.m, lane), __shfl_sync(0xffffffffu, v.l, lane)};\n  }\n";
  source += "};\n}  // namespace metile_device\n";
  return source;
}

struct RowConfig {
  int threads_per_row = 1;
  int rows_per_block = 1;
  int items = 1;  // vectors per thread (per tile when streaming)
  int tiles = 1;
  bool streaming = false;
  bool streaming_cache_hints = false;
};

int next_power_of_two(std::int64_t value) {
  int result = 1;
  while (result < value && result < (1 << 30)) result *= 2;
  return result;
}

// The f32 row values a thread of a block of `block_threads` may keep in registers: under
// __launch_bounds__ ptxas holds a thread to 65536 / block_threads registers (at most 255), less what
// is not row data (row pointers, indices, partial sums).
int register_values(int block_threads) { return std::min(255, 65536 / block_threads) - register_overhead; }

// The arrays a thread holds at once: every input (a thread loads its share of each row first) and each
// computed value read again after a reduction (it stays live across the phase boundary); one read
// widened to f64 after a reduction counts twice (ptxas keeps the widened values: layer_norm's x, read
// by its second and third phases, spilled 68-88 bytes at 512 threads when counted once). A value used
// only within its phase is computed and stored element by element. Calibrated on a survey of 2328
// compiled row kernels: none within the budget below spilled, at 64, 128 or 255 registers.
std::int64_t resident_arrays(const RowAnalysis& analysis) {
  std::vector<int> phase_of(analysis.steps.size());  // a reduction ends its phase
  for (std::size_t index = 1; index < analysis.steps.size(); ++index) {
    phase_of[index] = phase_of[index - 1] + (analysis.steps[index - 1].kind == Step::Kind::reduce);
  }
  // Whether a step of a phase after `phase` reads `array` (as `prefix` + "x0[item]").
  auto read_after = [&](int phase, const std::string& array, const std::string& prefix) {
    for (std::size_t index = 0; index < analysis.steps.size(); ++index) {
      if (phase_of[index] > phase && analysis.steps[index].expression.find(prefix + array + "[item]") != std::string::npos) {
        return true;
      }
    }
    return false;
  };
  const std::string widened = "static_cast<double>(";
  std::int64_t arrays = 0;
  for (const RegionInput& input : analysis.inputs) {  // loaded before phase 0
    arrays += 1 + read_after(0, analysis.array_of.at(input.value), widened);
  }
  for (std::size_t index = 0; index < analysis.steps.size(); ++index) {
    if (analysis.steps[index].kind != Step::Kind::compute) continue;
    const std::string& array = analysis.array_of.at(analysis.steps[index].value);
    arrays += read_after(phase_of[index], array, "") + read_after(phase_of[index], array, widened);
  }
  return arrays;
}

// The launch shape of a region, or nullopt where a requested thread count leaves no room in registers
// for one vector of each of the region's resident arrays (resident_arrays), each `items` vectors a
// thread. The row stays in registers only where they all fit the register budget (rows that did not
// spilled 0.1-8 KB a thread: 16 vectors of 8 for two arrays at 64 registers), else it streams in tiles
// of as many vectors as fit, at most four.
std::optional<RowConfig> choose_config(const RowAnalysis& analysis, const RowKernelOptions& options) {
  const std::int64_t vectors = (analysis.length + analysis.vector_width - 1) / analysis.vector_width;
  const int requested = options.threads_per_row;
  if (requested != 0 && (requested < 1 || requested > 1024 || (requested & (requested - 1)) != 0)) {
    throw InputError(fmt::format("row kernel: threads_per_row {} is not a power of two in 1..1024", requested));
  }
  // Rows a block: a whole block for a row past a warp, else several rows, at least a whole warp of
  // threads (the shuffles name all 32 lanes; rows past the end take part as invalid rows).
  // A requested count past 1024 threads is refused for the shape chosen, not for one only tried.
  auto rows_per_block = [&](int threads) {
    if (threads > 32) return 1;
    int rows = options.rows_per_block != 0 ? options.rows_per_block : 128 / threads;
    rows = std::clamp(rows, 1, 1024 / threads);
    const int warp_rows = std::max(1, 32 / threads);
    rows = static_cast<int>(std::min<std::int64_t>(rows, analysis.rows));
    return (rows + warp_rows - 1) / warp_rows * warp_rows;
  };
  const std::int64_t values_per_item = resident_arrays(analysis) * analysis.vector_width;
  auto items_that_fit = [&](int threads) { return register_values(threads * rows_per_block(threads)) / values_per_item; };

  auto items_of = [&](int threads) { return (vectors + threads - 1) / threads; };
  auto held_in_registers = [&](int threads) {
    return items_of(threads) <= register_item_limit && items_of(threads) <= items_that_fit(threads);
  };

  RowConfig config;
  config.streaming_cache_hints = options.streaming_cache_hints;
  // Default: about four vectors per thread (loads in flight, few threads per reduction); where the row
  // does not fit the registers so, more threads a row (fewer vectors each) while that helps.
  config.threads_per_row = requested != 0 ? requested : std::clamp(next_power_of_two((vectors + 3) / 4), 1, 1024);
  if (requested == 0) {
    for (int threads = config.threads_per_row; !held_in_registers(threads) && threads < 1024 && threads < vectors;) {
      threads *= 2;
      if (held_in_registers(threads)) config.threads_per_row = threads;
    }
  }
  if (held_in_registers(config.threads_per_row)) {
    config.items = static_cast<int>(items_of(config.threads_per_row));
  } else {
    // Streamed. A block of 1024 threads leaves 32 values a thread: where that holds fewer than two
    // vectors of every resident array, fewer threads a row with more registers each (unless the count was
    // asked), while halving gains registers (from 256 threads down a thread has 255 already).
    while (requested == 0 && items_that_fit(config.threads_per_row) < 2 &&
           register_values(config.threads_per_row / 2) > register_values(config.threads_per_row)) {
      config.threads_per_row /= 2;
    }
    const std::int64_t tile_items = std::min<std::int64_t>(streaming_items, items_that_fit(config.threads_per_row));
    if (tile_items < 1) return std::nullopt;
    config.streaming = true;
    config.items = static_cast<int>(tile_items);
    const std::int64_t per_tile = std::int64_t{config.threads_per_row} * tile_items;
    config.tiles = static_cast<int>((vectors + per_tile - 1) / per_tile);
  }
  if (config.threads_per_row <= 32 && options.rows_per_block != 0 &&
      (options.rows_per_block < 1 || options.rows_per_block * config.threads_per_row > 1024)) {
    throw InputError(fmt::format("row kernel: {} rows per block of {} threads exceed 1024 threads",
                                 options.rows_per_block, config.threads_per_row));
  }
  config.rows_per_block = rows_per_block(config.threads_per_row);
  return config;
}

std::string emit_kernel(const ComputeGraph& graph, const FusionRegion& region, const RowAnalysis& analysis,
                        const RowConfig& config, const std::string& kernel_name, GeneratedKernel& kernel) {
  std::string body;
  auto line = [&](int indent, const std::string& text) {
    body += std::string(static_cast<std::size_t>(indent) * 2, ' ') + text + "\n";
  };
  const int block_threads = config.threads_per_row * config.rows_per_block;

  // Parameters: inputs then outputs.
  std::vector<std::string> parameters;
  for (std::size_t i = 0; i < analysis.inputs.size(); ++i) {
    const Value& value = graph.value(analysis.inputs[i].value);
    parameters.push_back(fmt::format("const {}* __restrict__ in{} /* {} {} */", cuda_storage_type(value.spec.dtype),
                                     i, comment_text(value.name), value.spec.to_string()));
    kernel.parameters.push_back({KernelParameter::Kind::input, value.id, fmt::format("in{}", i), 0});
  }
  for (std::size_t i = 0; i < region.outputs.size(); ++i) {
    const Value& value = graph.value(region.outputs[i]);
    parameters.push_back(fmt::format("{}* __restrict__ out{} /* {} {} */", cuda_storage_type(value.spec.dtype), i,
                                     comment_text(value.name), value.spec.to_string()));
    kernel.parameters.push_back({KernelParameter::Kind::output, value.id, fmt::format("out{}", i), 0});
  }

  std::string source = "// Generated by metile (src/codegen/row_kernel.cpp): one row kernel for the region\n";
  source += fmt::format("// rule '{}':\n", region.rule.empty() ? "single node" : region.rule);
  std::vector<NodeId> nodes = region.nodes;
  std::sort(nodes.begin(), nodes.end());
  for (NodeId id : nodes) source += "//   " + describe_node(graph, graph.node(id)) + "\n";
  source += fmt::format("// {} rows of {}; {}-element vectors; {} threads per row, {} rows per block; {} vectors per thread{}\n",
                        analysis.rows, analysis.length, analysis.vector_width, config.threads_per_row,
                        config.rows_per_block, config.items,
                        config.streaming ? fmt::format(" per tile, {} tiles (streamed)", config.tiles)
                                         : " (row held in registers)");
  source += codegen_detail::cuda_device_prelude();
  source += cuda_elementwise_helpers();
  if (analysis.online_softmax) source += online_softmax_op_source();
  source += fmt::format("\nextern \"C\" __global__ void __launch_bounds__({}) {}(\n", block_threads, kernel_name);
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    source += "    " + parameters[i] + (i + 1 < parameters.size() ? ",\n" : ") {\n");
  }

  line(1, fmt::format("constexpr int kRowLength = {};", analysis.length));
  line(1, fmt::format("constexpr long long kRows = {}LL;", analysis.rows));
  line(1, fmt::format("constexpr int kVec = {};", analysis.vector_width));
  line(1, fmt::format("constexpr int kThreadsPerRow = {};", config.threads_per_row));
  line(1, fmt::format("constexpr int kRowsPerBlock = {};", config.rows_per_block));
  line(1, fmt::format("constexpr int kItems = {};", config.items));
  line(1, fmt::format("constexpr bool kStream = {};  // evict-first hints on row loads and stores",
                      config.streaming_cache_hints ? "true" : "false"));
  if (config.streaming) {
    line(1, fmt::format("constexpr int kTiles = {};", config.tiles));
    line(1, "constexpr int kTileElements = kItems * kThreadsPerRow * kVec;");
  }
  // Reductions across warps meet in shared memory; within a warp they need none.
  const bool block_reduction = analysis.has_reduction && config.threads_per_row > 32;
  if (block_reduction) {
    // One state a warp: 8 bytes holds the widest (a double sum, the online softmax's two floats).
    line(1, "__shared__ double reduction_scratch[kThreadsPerRow / 32];");
  }
  line(1, "const int lane = threadIdx.x % kThreadsPerRow;");
  line(1, "const long long row = static_cast<long long>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreadsPerRow;");
  line(1, "const bool row_valid = row < kRows;");
  line(1, "const long long safe_row = row_valid ? row : 0;");
  for (std::size_t i = 0; i < analysis.inputs.size(); ++i) {
    const RegionInput& input = analysis.inputs[i];
    const std::string type = cuda_storage_type(graph.value(input.value).spec.dtype);
    switch (input.mode) {
      case OperandMode::row:
        line(1, fmt::format("const {0}* __restrict__ in{1}_row = in{1} + safe_row * kRowLength;", type, i));
        break;
      case OperandMode::broadcast_rows:
        line(1, fmt::format("const {0}* __restrict__ in{1}_row = in{1} + (safe_row % {2}LL) * kRowLength;", type, i,
                            input.broadcast_rows));
        break;
      case OperandMode::scalar: break;
    }
  }
  for (std::size_t i = 0; i < region.outputs.size(); ++i) {
    if (analysis.row_results.contains(region.outputs[i])) continue;  // one value per row, stored by lane 0
    // maybe_unused: a reduction over rows of one element (sum of [3, 1] as one node) stores its result
    // per row too, through out{1} itself, and NVRTC warned of the unused pointer (#177-D).
    line(1, fmt::format("[[maybe_unused]] {0}* __restrict__ out{1}_row = out{1} + safe_row * kRowLength;",
                        cuda_storage_type(graph.value(region.outputs[i]).spec.dtype), i));
  }
  std::map<ValueId, int> output_index;
  for (std::size_t i = 0; i < region.outputs.size(); ++i) output_index[region.outputs[i]] = static_cast<int>(i);

  auto emit_loads = [&](int indent, const std::string& column_base) {
    std::string arrays;
    for (std::size_t i = 0; i < analysis.inputs.size(); ++i) arrays += fmt::format("{}x{}[kItems][kVec]", i ? ", " : "", i);
    if (!arrays.empty()) line(indent, "float " + arrays + ";");
    line(indent, "#pragma unroll");
    line(indent, "for (int item = 0; item < kItems; ++item) {");
    line(indent + 1, fmt::format("const int col = {}(item * kThreadsPerRow + lane) * kVec;", column_base));
    for (std::size_t i = 0; i < analysis.inputs.size(); ++i) {
      const RegionInput& input = analysis.inputs[i];
      const Value& value = graph.value(input.value);
      const std::string type = cuda_storage_type(value.spec.dtype);
      if (input.mode == OperandMode::scalar) {
        line(indent + 1, fmt::format("metile_device::load_scalar<{0}, kVec>(in{1}, x{1}[item]);  // {2}", type, i, comment_text(value.name)));
      } else {
        // Rows are read once: streaming hints. Broadcast rows (weights) are reused by every row: plain.
        line(indent + 1, fmt::format("metile_device::load_vector<{0}, kVec, kRowLength, {3}>(in{1}_row, col, row_valid, x{1}[item]);  // {2}",
                                     type, i, comment_text(value.name), input.mode == OperandMode::row ? "kStream" : "false"));
      }
    }
    line(indent, "}");
  };
  auto declare_computed = [&](int indent, const std::vector<const Step*>& computes) {
    std::string arrays;
    for (const Step* step : computes) arrays += (arrays.empty() ? "" : ", ") + analysis.array_of.at(step->value) + "[kItems][kVec]";
    if (!arrays.empty()) line(indent, "float " + arrays + ";");
  };
  // One loop over this thread's elements: computes, then folds the phase's reduction partial.
  auto emit_compute_loop = [&](int indent, const std::vector<const Step*>& computes, const Step* reduce,
                               const std::string& column_base) {
    if (computes.empty() && reduce == nullptr) return;
    line(indent, "#pragma unroll");
    line(indent, "for (int item = 0; item < kItems; ++item) {");
    line(indent + 1, fmt::format("[[maybe_unused]] const int col = {}(item * kThreadsPerRow + lane) * kVec;", column_base));
    line(indent + 1, "#pragma unroll");
    line(indent + 1, "for (int e = 0; e < kVec; ++e) {");
    for (const Step* step : computes) {
      line(indent + 2, fmt::format("{}[item][e] = {};  // {}", analysis.array_of.at(step->value), step->expression,
                                   step->comment));
    }
    if (reduce != nullptr) {
      line(indent + 2, fmt::format("if (row_valid && col + e < kRowLength) partial{0} = metile_device::{1}::apply(partial{0}, {2});",
                                   reduce->scalar, reduce->reduce_op, reduce->expression));
    }
    line(indent + 1, "}");
    line(indent, "}");
  };
  auto emit_stores = [&](int indent, const std::vector<const Step*>& computes, const std::string& column_base) {
    std::vector<const Step*> stored;
    for (const Step* step : computes) {
      if (output_index.contains(step->value)) stored.push_back(step);
    }
    if (stored.empty()) return;
    line(indent, "#pragma unroll");
    line(indent, "for (int item = 0; item < kItems; ++item) {");
    line(indent + 1, fmt::format("const int col = {}(item * kThreadsPerRow + lane) * kVec;", column_base));
    for (const Step* step : stored) {
      const Value& value = graph.value(step->value);
      line(indent + 1, fmt::format("metile_device::store_vector<{}, kVec, kRowLength, kStream>(out{}_row, col, row_valid, {}[item]);  // {}",
                                   cuda_storage_type(value.spec.dtype), output_index.at(step->value),
                                   analysis.array_of.at(step->value), comment_text(value.name)));
    }
    line(indent, "}");
  };

  // Split the steps into phases, each ending at a reduction.
  struct Phase {
    std::vector<const Step*> computes;
    const Step* reduce = nullptr;
  };
  std::vector<Phase> phases(1);
  for (const Step& step : analysis.steps) {
    if (step.kind == Step::Kind::compute) {
      phases.back().computes.push_back(&step);
    } else {
      phases.back().reduce = &step;
      phases.emplace_back();
    }
  }
  if (phases.back().computes.empty() && phases.back().reduce == nullptr) phases.pop_back();

  if (!config.streaming) {
    line(1, "// Load this thread's share of every input row once.");
    emit_loads(1, "");
    std::vector<const Step*> all_computes;
    for (const Step& step : analysis.steps) {
      if (step.kind == Step::Kind::compute) all_computes.push_back(&step);
    }
    declare_computed(1, all_computes);
  }
  std::vector<const Step*> earlier_computes;
  for (std::size_t p = 0; p < phases.size(); ++p) {
    const Phase& phase = phases[p];
    line(1, fmt::format("// phase {}{}", p, phase.reduce ? ": up to " + phase.reduce->comment : ""));
    if (phase.reduce) {
      line(1, fmt::format("auto partial{} = metile_device::{}::identity();", phase.reduce->scalar, phase.reduce->reduce_op));
    }
    if (!config.streaming) {
      emit_compute_loop(1, phase.computes, phase.reduce, "");
      emit_stores(1, phase.computes, "");
    } else {
      line(1, "#pragma unroll 1");
      line(1, "for (int tile = 0; tile < kTiles; ++tile) {");
      line(2, "const int tile_base = tile * kTileElements;");
      emit_loads(2, "tile_base + ");
      std::vector<const Step*> live = earlier_computes;
      live.insert(live.end(), phase.computes.begin(), phase.computes.end());
      declare_computed(2, live);
      if (!earlier_computes.empty()) {
        line(2, "// recompute what earlier phases computed (the row does not fit in registers)");
        emit_compute_loop(2, earlier_computes, nullptr, "tile_base + ");
      }
      emit_compute_loop(2, phase.computes, phase.reduce, "tile_base + ");
      emit_stores(2, phase.computes, "tile_base + ");
      line(1, "}");
    }
    earlier_computes.insert(earlier_computes.end(), phase.computes.begin(), phase.computes.end());
    if (phase.reduce) {
      line(1, fmt::format("const auto r{0} = metile_device::row_reduce<metile_device::{1}, kThreadsPerRow>(partial{0}, {2});",
                          phase.reduce->scalar, phase.reduce->reduce_op, block_reduction ? "reduction_scratch" : "nullptr"));
      if (!phase.reduce->after.empty()) line(1, phase.reduce->after);
      if (output_index.contains(phase.reduce->row_result)) {
        const Value& value = graph.value(phase.reduce->row_result);
        line(1, fmt::format("if (row_valid && lane == 0) out{}[safe_row] = metile_device::from_float<{}>({});  // {}",
                            output_index.at(value.id), cuda_storage_type(value.spec.dtype),
                            phase.reduce->row_result_expression, comment_text(value.name)));
      }
    }
  }
  source += body;
  source += "}\n";
  return source;
}

}  // namespace

std::string cuda_storage_type(DType dtype) {
  switch (dtype) {
    case DType::f16: return "__half";
    case DType::bf16: return "__nv_bfloat16";
    case DType::f32: return "float";
    case DType::i8: return "signed char";
    case DType::u8: return "unsigned char";
    case DType::i32: return "int";
    case DType::u32: return "unsigned int";
  }
  throw InputError("cuda_storage_type: unknown dtype");
}

Decision row_region_decision(const ComputeGraph& graph, const FusionRegion& region) {
  const Analysed analysed = analyse(graph, region);
  if (analysed.decision && !choose_config(analysed.analysis, {})) {
    return Decision::refuse(fmt::format("{} resident row arrays of {}-element vectors do not fit a thread's registers",
                                        resident_arrays(analysed.analysis), analysed.analysis.vector_width));
  }
  return analysed.decision;
}

FusionRegion single_node_region(const ComputeGraph& graph, NodeId node_id) {
  // Every output, even one nothing reads: a native kernel writes all its node computes.
  FusionRegion region = region_of_nodes(graph, {node_id});
  region.outputs = graph.node(node_id).outputs;
  return region;
}

GeneratedKernel generate_region_kernel(const ComputeGraph& graph, const FusionRegion& region,
                                       const RowKernelOptions& options) {
  const RowAnalysis analysis = analysis_of_row_region(graph, region, options.online_softmax);
  const Node& anchor = graph.node(*std::max_element(region.nodes.begin(), region.nodes.end()));
  const std::optional<RowConfig> chosen = choose_config(analysis, options);
  if (!chosen) {
    throw InputError(fmt::format("{}: {} threads a row leave no room in registers for a vector of each of the "
                                 "region's {} resident arrays", node_label(anchor), options.threads_per_row,
                                 resident_arrays(analysis)));
  }
  const RowConfig& config = *chosen;
  GeneratedKernel kernel;
  kernel.kernel_name = "metile_row_" + sanitize_identifier(anchor.name);
  if (!options.variant_name.empty()) kernel.kernel_name += "_" + sanitize_identifier(options.variant_name);
  kernel.source = emit_kernel(graph, region, analysis, config, kernel.kernel_name, kernel);
  kernel.launch.block_x = static_cast<std::uint32_t>(config.threads_per_row * config.rows_per_block);
  // One block per rows_per_block rows: past 2^31 - 1 blocks (CUDA's grid limit) the cast truncated
  // silently (2^40 rows launched 0 blocks), so such a region is refused.
  const std::int64_t blocks = (analysis.rows + config.rows_per_block - 1) / config.rows_per_block;
  if (blocks > std::int64_t{0x7fffffff}) {
    throw InputError(fmt::format("{}: {} rows take {} blocks of {} rows, past CUDA's 2^31 - 1", node_label(anchor),
                                 analysis.rows, blocks, config.rows_per_block));
  }
  kernel.launch.grid_x = static_cast<std::uint32_t>(blocks);
  const DType dtype = graph.value(region.outputs.front()).spec.dtype;
  kernel.summary = fmt::format("row kernel {}x{} {}: {}-wide vectors, {} threads/row, {} rows/block, {} vectors/thread{}{}{}{}",
                               analysis.rows, analysis.length, dtype_name(dtype), analysis.vector_width,
                               config.threads_per_row, config.rows_per_block, config.items,
                               config.streaming ? fmt::format(" x {} tiles", config.tiles) : "",
                               config.streaming_cache_hints ? ", evict-first" : "",
                               analysis.online_softmax ? ", one-pass softmax" : "",
                               options.variant_name.empty() ? "" : " (" + options.variant_name + ")");
  return kernel;
}

std::vector<RowKernelOptions> row_kernel_variants(const ComputeGraph& graph, const FusionRegion& region) {
  const RowAnalysis analysis = analysis_of_row_region(graph, region);
  const std::optional<RowConfig> chosen = choose_config(analysis, {});
  if (!chosen) throw InputError(row_region_decision(graph, region).reason);
  const RowConfig& default_config = *chosen;
  std::vector<RowKernelOptions> variants = {RowKernelOptions{}};
  // Wider: fewer vectors per thread, lower latency for short row counts (decode).
  // Narrower: more vectors per thread, fewer reduction steps for many rows. Each only where the row
  // stays in registers under it (a narrow share past the register budget spilled 72 B-3 KB a thread).
  auto held_in_registers = [&](int threads) {
    RowKernelOptions options;
    options.threads_per_row = threads;
    const std::optional<RowConfig> config = choose_config(analysis, options);
    return config && !config->streaming;
  };
  const int wide = std::min(default_config.threads_per_row * 4, 1024);
  const int narrow = std::max(default_config.threads_per_row / 4, 1);
  if (wide != default_config.threads_per_row && held_in_registers(wide)) variants.push_back({wide, 0, "wide"});
  if (narrow != default_config.threads_per_row && held_in_registers(narrow)) variants.push_back({narrow, 0, "narrow"});
  // Streaming hints pay only when the rows are far larger than L2; below that they may evict reuse.
  std::int64_t region_bytes = 0;
  for (const RegionInput& input : analysis.inputs) region_bytes += graph.value(input.value).spec.bytes();
  for (ValueId output : region.outputs) region_bytes += graph.value(output).spec.bytes();
  if (region_bytes >= (std::int64_t{256} << 20)) variants.push_back({0, 0, "stream", true});
  // Softmax: max and sum in one pass (the law's running state) against today's two passes; which is
  // faster depends on whether the row is held in registers or streamed, so both race.
  const bool has_softmax = std::any_of(region.nodes.begin(), region.nodes.end(),
                                       [&](NodeId node) { return graph.node(node).op == "softmax"; });
  if (has_softmax) {
    RowKernelOptions online;
    online.variant_name = "online";
    online.online_softmax = true;
    variants.push_back(online);
  }
  return variants;
}

}  // namespace metile
