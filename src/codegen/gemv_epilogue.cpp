// GEMV epilogues: the per-output expression a generated GEMV applies after its reduction,
// as a small immutable tree. It is what makes a mainloop reusable: SwiGLU, a residual add, a
// plain store or a scaled activation differ only in the expression this file emits, never in
// the mainloop (gemv_mainloop.cpp). from_graph builds the tree from a region's elementwise
// ops, so the epilogue a kernel applies is the one the graph recorded.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>

#include "metile/gemv.h"

namespace metile {

struct GemvEpilogue::Term {
  Kind kind = Kind::accumulator;
  int product = 0;            // accumulator
  std::string tensor_name;    // tensor
  bool broadcast_rows = false;
  double value = 0;           // constant, scale factor
  DType dtype = DType::f32;   // rounded: the dtype rounded to
  std::string op;             // op: the op table's name
  Attributes attributes;      // op: the node's attributes
  std::vector<std::shared_ptr<const Term>> operands;
};

namespace {

using NodePointer = std::shared_ptr<const GemvEpilogue::Term>;

void collect_tensors(const GemvEpilogue::Term& node, std::vector<GemvEpilogue::TensorInput>& tensors) {
  if (node.kind == GemvEpilogue::Kind::tensor) {
    const GemvEpilogue::TensorInput input{node.tensor_name, node.broadcast_rows};
    auto same_name = [&](const GemvEpilogue::TensorInput& t) { return t.name == input.name; };
    auto found = std::find_if(tensors.begin(), tensors.end(), same_name);
    if (found == tensors.end()) {
      tensors.push_back(input);
    } else if (found->broadcast_rows != input.broadcast_rows) {
      throw InputError(fmt::format("epilogue: tensor '{}' is read both per row and broadcast", input.name));
    }
  }
  for (const NodePointer& operand : node.operands) collect_tensors(*operand, tensors);
}

int highest_product(const GemvEpilogue::Term& node) {
  int highest = node.kind == GemvEpilogue::Kind::accumulator ? node.product : -1;
  for (const NodePointer& operand : node.operands) highest = std::max(highest, highest_product(*operand));
  return highest;
}

// The op-table op a term applies, with its attributes; empty for leaves.
std::pair<std::string, Attributes> table_op(const GemvEpilogue::Term& node) {
  using Kind = GemvEpilogue::Kind;
  Attributes attributes;
  switch (node.kind) {
    case Kind::accumulator:
    case Kind::tensor:
    case Kind::constant: return {};
    case Kind::add: return {"add", attributes};
    case Kind::subtract: return {"subtract", attributes};
    case Kind::multiply: return {"multiply", attributes};
    case Kind::scale: attributes.set("factor", node.value); return {"scale", attributes};
    case Kind::silu: return {"silu", attributes};
    case Kind::gelu: attributes.set("approximate", std::string("none")); return {"gelu", attributes};
    case Kind::gelu_tanh: attributes.set("approximate", std::string("tanh")); return {"gelu", attributes};
    case Kind::exp: return {"exp", attributes};
    case Kind::op: return {node.op, node.attributes};
    case Kind::rounded: return {};
  }
  return {};
}

const ElementwiseMath& math_of(const std::string& op) {
  const OpDefinition* definition = find_op(op);
  if (definition == nullptr || !definition->elementwise) throw InputError(fmt::format("epilogue: '{}' is not an elementwise op", op));
  return *definition->elementwise;
}

std::string emit(const GemvEpilogue::Term& node, const std::vector<GemvEpilogue::TensorInput>& tensors) {
  using Kind = GemvEpilogue::Kind;
  switch (node.kind) {
    case Kind::accumulator: return fmt::format("acc{}", node.product);
    case Kind::tensor: {
      auto found = std::find_if(tensors.begin(), tensors.end(),
                                [&](const GemvEpilogue::TensorInput& t) { return t.name == node.tensor_name; });
      return fmt::format("tensor_value{}", found - tensors.begin());
    }
    case Kind::constant: return cuda_float_literal(node.value);
    // from_f32 rounds to the kernel's activation dtype, the only one a rounded term names.
    case Kind::rounded: return fmt::format("to_f32(from_f32({}))", emit(*node.operands[0], tensors));
    default: break;
  }
  std::vector<std::string> operands;
  for (const NodePointer& operand : node.operands) operands.push_back(emit(*operand, tensors));
  const auto [op, attributes] = table_op(node);
  return math_of(op).cuda(operands, CudaElementSite{}, attributes, {});
}

std::string describe(const GemvEpilogue::Term& node) {
  using Kind = GemvEpilogue::Kind;
  auto operand = [&](int index) { return describe(*node.operands[static_cast<std::size_t>(index)]); };
  switch (node.kind) {
    case Kind::accumulator: return fmt::format("acc{}", node.product);
    case Kind::tensor: return node.broadcast_rows ? node.tensor_name + "[n]" : node.tensor_name;
    case Kind::constant: return fmt::format("{}", node.value);
    case Kind::add: return fmt::format("({} + {})", operand(0), operand(1));
    case Kind::subtract: return fmt::format("({} - {})", operand(0), operand(1));
    case Kind::multiply: return fmt::format("{} * {}", operand(0), operand(1));
    case Kind::scale: return fmt::format("{} * {}", operand(0), node.value);
    case Kind::silu: return fmt::format("silu({})", operand(0));
    case Kind::gelu: return fmt::format("gelu({})", operand(0));
    case Kind::gelu_tanh: return fmt::format("gelu_tanh({})", operand(0));
    case Kind::exp: return fmt::format("exp({})", operand(0));
    case Kind::op: {
      std::string text = node.op + "(";
      for (std::size_t i = 0; i < node.operands.size(); ++i) text += (i ? ", " : "") + operand(static_cast<int>(i));
      return text + ")";
    }
    case Kind::rounded: return fmt::format("{}({})", dtype_name(node.dtype), operand(0));
  }
  return "?";
}

double evaluate_node(const GemvEpilogue::Term& node, std::span<const double> accumulators,
                     std::span<const double> tensor_values, const std::vector<GemvEpilogue::TensorInput>& tensors) {
  using Kind = GemvEpilogue::Kind;
  switch (node.kind) {
    case Kind::accumulator: return accumulators[static_cast<std::size_t>(node.product)];
    case Kind::tensor: {
      auto found = std::find_if(tensors.begin(), tensors.end(),
                                [&](const GemvEpilogue::TensorInput& t) { return t.name == node.tensor_name; });
      return tensor_values[static_cast<std::size_t>(found - tensors.begin())];
    }
    case Kind::constant: return node.value;
    case Kind::rounded:
      return round_to_dtype(static_cast<float>(evaluate_node(*node.operands[0], accumulators, tensor_values, tensors)),
                            node.dtype);
    default: break;
  }
  std::vector<double> operands;
  for (const NodePointer& operand : node.operands) operands.push_back(evaluate_node(*operand, accumulators, tensor_values, tensors));
  const auto [op, attributes] = table_op(node);
  return math_of(op).bind(attributes, {}).f64(operands, ElementSite{});
}

NodePointer make(GemvEpilogue::Kind kind, std::vector<NodePointer> operands, double value = 0) {
  auto node = std::make_shared<GemvEpilogue::Term>();
  node->kind = kind;
  node->operands = std::move(operands);
  node->value = value;
  return node;
}

void require_finite(double value) {
  if (!std::isfinite(value)) throw InputError(fmt::format("epilogue: constant {} is not finite", value));
}

// The op table's definition of `op` if a GEMV epilogue can apply it (elementwise, reading no
// position), else null.
const OpDefinition* epilogue_op(const std::string& op) {
  const OpDefinition* definition = find_op(op);
  return definition != nullptr && definition->elementwise && !definition->elementwise->reads_site ? definition : nullptr;
}

// The term of elementwise node `node`, its operands built by input(i).
template <typename Input>
GemvEpilogue elementwise_term(const Node& node, Input&& input) {
  if (node.op == "add") return GemvEpilogue::add(input(0), input(1));
  if (node.op == "subtract") return GemvEpilogue::subtract(input(0), input(1));
  if (node.op == "multiply") return GemvEpilogue::multiply(input(0), input(1));
  if (node.op == "scale") return GemvEpilogue::scale(input(0), node.attributes.get_double("factor"));
  if (node.op == "silu") return GemvEpilogue::silu(input(0));
  if (node.op == "exp") return GemvEpilogue::exp(input(0));
  if (node.op == "gelu") return GemvEpilogue::gelu(input(0), node.attributes.get_string("approximate") == "tanh");
  if (epilogue_op(node.op) == nullptr) {
    throw InputError(fmt::format("epilogue: node '{}' ({}) is not an op a GEMV epilogue applies", node.name, node.op));
  }
  std::vector<GemvEpilogue> operands;
  for (std::size_t index = 0; index < node.inputs.size(); ++index) operands.push_back(input(index));
  return GemvEpilogue::elementwise(node.op, node.attributes, operands);
}

}  // namespace

GemvEpilogue GemvEpilogue::accumulator(int product) {
  if (product < 0 || product > 1) throw InputError(fmt::format("epilogue: accumulator {} (a GEMV has 1 or 2)", product));
  auto node = std::make_shared<Term>();
  node->kind = Kind::accumulator;
  node->product = product;
  return GemvEpilogue(node);
}

GemvEpilogue GemvEpilogue::tensor(std::string name, bool broadcast_rows) {
  if (name.empty()) throw InputError("epilogue: a tensor needs a name");
  auto node = std::make_shared<Term>();
  node->kind = Kind::tensor;
  node->tensor_name = std::move(name);
  node->broadcast_rows = broadcast_rows;
  return GemvEpilogue(node);
}

GemvEpilogue GemvEpilogue::constant(double value) {
  require_finite(value);  // rejects non-finite values now rather than at generation
  return GemvEpilogue(make(Kind::constant, {}, value));
}
GemvEpilogue GemvEpilogue::add(const GemvEpilogue& a, const GemvEpilogue& b) {
  return GemvEpilogue(make(Kind::add, {a.node_, b.node_}));
}
GemvEpilogue GemvEpilogue::subtract(const GemvEpilogue& a, const GemvEpilogue& b) {
  return GemvEpilogue(make(Kind::subtract, {a.node_, b.node_}));
}
GemvEpilogue GemvEpilogue::multiply(const GemvEpilogue& a, const GemvEpilogue& b) {
  return GemvEpilogue(make(Kind::multiply, {a.node_, b.node_}));
}
GemvEpilogue GemvEpilogue::scale(const GemvEpilogue& x, double factor) {
  require_finite(factor);
  return GemvEpilogue(make(Kind::scale, {x.node_}, factor));
}
GemvEpilogue GemvEpilogue::silu(const GemvEpilogue& x) { return GemvEpilogue(make(Kind::silu, {x.node_})); }
GemvEpilogue GemvEpilogue::gelu(const GemvEpilogue& x, bool tanh_approximation) {
  return GemvEpilogue(make(tanh_approximation ? Kind::gelu_tanh : Kind::gelu, {x.node_}));
}
GemvEpilogue GemvEpilogue::exp(const GemvEpilogue& x) { return GemvEpilogue(make(Kind::exp, {x.node_})); }
GemvEpilogue GemvEpilogue::elementwise(std::string op, Attributes attributes, const std::vector<GemvEpilogue>& operands) {
  const OpDefinition* definition = epilogue_op(op);
  if (definition == nullptr) {
    throw InputError(fmt::format("epilogue: '{}' is not an elementwise op that a GEMV epilogue applies", op));
  }
  if (operands.size() != definition->input_names.size()) {
    throw InputError(fmt::format("epilogue: '{}' takes {} operands, got {}", op, definition->input_names.size(), operands.size()));
  }
  auto node = std::make_shared<Term>();
  node->kind = Kind::op;
  node->op = std::move(op);
  node->attributes = std::move(attributes);
  for (const GemvEpilogue& operand : operands) node->operands.push_back(operand.node_);
  return GemvEpilogue(node);
}
GemvEpilogue GemvEpilogue::rounded(const GemvEpilogue& x, DType dtype) {
  if (dtype != DType::bf16 && dtype != DType::f16) {
    throw InputError(fmt::format("epilogue: values are rounded to f16 or bf16, not {}", dtype_name(dtype)));
  }
  auto node = std::make_shared<Term>();
  node->kind = Kind::rounded;
  node->dtype = dtype;
  node->operands = {x.node_};
  return GemvEpilogue(node);
}
GemvEpilogue GemvEpilogue::stored_as(const GemvEpilogue& x, DType dtype) {
  return dtype == DType::f32 ? x : rounded(x, dtype);
}

GemvEpilogue GemvEpilogue::swiglu(DType stored) {
  return multiply(stored_as(silu(stored_as(accumulator(0), stored)), stored), stored_as(accumulator(1), stored));
}
GemvEpilogue GemvEpilogue::residual_add(std::string name, DType stored) {
  return add(stored_as(accumulator(0), stored), tensor(std::move(name)));
}

GemvEpilogue::Kind GemvEpilogue::kind() const { return node_->kind; }

bool GemvEpilogue::rounds_only_to(DType activation) const {
  auto visit = [activation](auto&& self, const Term& node) -> bool {
    if (node.kind == Kind::rounded && node.dtype != activation) return false;
    return std::all_of(node.operands.begin(), node.operands.end(), [&](const NodePointer& operand) { return self(self, *operand); });
  };
  return visit(visit, *node_);
}

int GemvEpilogue::product_count() const { return std::max(1, highest_product(*node_) + 1); }

std::vector<GemvEpilogue::TensorInput> GemvEpilogue::tensor_inputs() const {
  std::vector<TensorInput> tensors;
  collect_tensors(*node_, tensors);
  return tensors;
}

std::string GemvEpilogue::cuda_expression() const { return emit(*node_, tensor_inputs()); }

std::string GemvEpilogue::to_string() const { return describe(*node_); }

double GemvEpilogue::evaluate(std::span<const double> accumulators, std::span<const double> tensors) const {
  const std::vector<TensorInput> inputs = tensor_inputs();
  if (accumulators.size() < static_cast<std::size_t>(product_count()) || tensors.size() != inputs.size()) {
    throw InputError(fmt::format("epilogue {}: evaluate needs {} accumulators and {} tensors, got {} and {}",
                                 to_string(), product_count(), inputs.size(), accumulators.size(), tensors.size()));
  }
  return evaluate_node(*node_, accumulators, tensors, inputs);
}

GemvEpilogue GemvEpilogue::from_graph(const ComputeGraph& graph, ValueId output, std::span<const ValueId> accumulators) {
  if (accumulators.empty() || accumulators.size() > 2) {
    throw InputError(fmt::format("epilogue: a GEMV has 1 or 2 accumulators, got {}", accumulators.size()));
  }
  const TensorSpec& accumulator_spec = graph.value(accumulators[0]).spec;
  const TensorSpec& output_spec = graph.value(output).spec;
  for (ValueId id : accumulators) {
    if (graph.value(id).spec != accumulator_spec) {
      throw InputError(fmt::format("epilogue: accumulators '{}' {} and '{}' {} differ", graph.value(accumulators[0]).name,
                                   accumulator_spec.to_string(), graph.value(id).name, graph.value(id).spec.to_string()));
    }
  }
  if (output_spec != accumulator_spec) {
    throw InputError(fmt::format("epilogue: output '{}' {} is not the GEMV's {}", graph.value(output).name,
                                 output_spec.to_string(), accumulator_spec.to_string()));
  }
  const std::int64_t features = accumulator_spec.row_length();

  // A value the graph stores in the activation dtype is rounded to it where the tree reads it;
  // the output is rounded by the store. f32 values stay as computed.
  const DType activation = accumulator_spec.dtype;
  auto as_stored = [&](ValueId id, GemvEpilogue term) {
    const Value& value = graph.value(id);
    if (id == output) return term;
    if (value.spec.dtype != DType::f32 && value.spec.dtype != activation) {
      throw InputError(fmt::format("epilogue: value '{}' is {}, the GEMV computes {}", value.name,
                                   dtype_name(value.spec.dtype), dtype_name(activation)));
    }
    return stored_as(term, value.spec.dtype);
  };
  // Depth-first from the output; a value reached twice is rebuilt twice, which is harmless for
  // the small trees epilogues are.
  auto build = [&](auto&& self, ValueId id) -> GemvEpilogue {
    for (std::size_t i = 0; i < accumulators.size(); ++i) {
      if (accumulators[i] == id) return as_stored(id, accumulator(static_cast<int>(i)));
    }
    const Value& value = graph.value(id);
    if (value.producer < 0 || graph.node(value.producer).kind != OpKind::elementwise) {
      // Computed outside the epilogue: read as a tensor at the output position.
      const bool per_row = value.spec.shape == output_spec.shape;
      const bool broadcast = value.spec.rank() == 1 && value.spec.shape[0] == features;
      if (!per_row && !broadcast) {
        throw InputError(fmt::format("epilogue: tensor '{}' {} is neither {} nor [{}]", value.name,
                                     value.spec.to_string(), output_spec.to_string(), features));
      }
      if (value.spec.dtype != accumulator_spec.dtype) {
        throw InputError(fmt::format("epilogue: tensor '{}' is {}, the GEMV computes {}", value.name,
                                     dtype_name(value.spec.dtype), dtype_name(accumulator_spec.dtype)));
      }
      return tensor(value.name, !per_row);
    }
    const Node& node = graph.node(value.producer);
    auto input = [&](std::size_t index) { return self(self, node.inputs.at(index)); };
    return as_stored(id, elementwise_term(node, input));
  };
  return build(build, output);
}

}  // namespace metile
