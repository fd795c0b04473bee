// The op registry: one entry per op of DESIGN.md's table, with its kind and its
// shape/dtype inference. Inference also validates and canonicalises attributes
// (defaults filled in, numbers stored as the type the op reads, a reshape's -1
// resolved, a softmax axis made non-negative) so that a graph built in C++ and
// the same graph read from JSON compare equal.
//
// Kind choices worth knowing: rope is `layout` (it pairs element d with d+dims/2
// of the same row, so it is not same-index elementwise); softmax is a
// `row_reduction` only over the last axis, over any other axis it reports
// `layout` so that the planner never treats it as a row-reduction anchor.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <sstream>
#include <string>

#include "metile/graph.h"

namespace metile {
namespace {

using Shape = std::vector<std::int64_t>;

std::string shape_text(const Shape& shape) {
  std::string text = "[";
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    if (axis > 0) text += ", ";
    text += std::to_string(shape[axis]);
  }
  return text + "]";
}

std::string described(std::string_view role, const TensorSpec& spec) {
  return std::string(role) + " " + spec.to_string();
}

void check_known_attributes(const Attributes& attributes, std::initializer_list<std::string_view> known) {
  for (const auto& [name, value] : attributes.entries()) {
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    std::string allowed;
    for (std::string_view known_name : known) allowed += (allowed.empty() ? "" : ", ") + std::string(known_name);
    throw InputError("unknown attribute '" + name + "' (" + (allowed.empty() ? "this op takes none" : "allowed: " + allowed) +
                     ")");
  }
}

void require_floating(const TensorSpec& spec, std::string_view role) {
  if (!is_floating(spec.dtype)) {
    throw InputError(described(role, spec) + " must have a floating dtype (f16, bf16 or f32)");
  }
}

void require_same_dtype(const TensorSpec& spec, std::string_view role, const TensorSpec& reference,
                        std::string_view reference_role) {
  if (spec.dtype != reference.dtype) {
    throw InputError(described(role, spec) + " must have the dtype of " + described(reference_role, reference));
  }
}

void require_rank_at_least(const TensorSpec& spec, std::string_view role, int rank) {
  if (spec.rank() < rank) {
    throw InputError(described(role, spec) + " must have rank " + std::to_string(rank) + " or more");
  }
}

// A weight (or bias) of a normalisation: [H] where H is x's last axis.
void require_row_vector(const TensorSpec& spec, std::string_view role, const TensorSpec& x) {
  require_same_dtype(spec, role, x, "x");
  if (spec.shape != Shape{x.row_length()}) {
    throw InputError(described(role, spec) + " does not match the last axis of " + described("x", x) +
                     " (expected [" + std::to_string(x.row_length()) + "])");
  }
}

std::string number_text(double value) {
  std::ostringstream text;
  text << value;
  return text.str();
}

double finite_number(Attributes& attributes, std::string_view name) {
  const double value = attributes.get_double(name);
  if (!std::isfinite(value)) throw InputError("attribute '" + std::string(name) + "' must be finite");
  attributes.set(std::string(name), value);
  return value;
}

double positive_number(Attributes& attributes, std::string_view name) {
  const double value = finite_number(attributes, name);
  if (value <= 0) throw InputError(std::string(name) + " must be positive, got " + number_text(value));
  return value;
}

std::int64_t integer_or_default(Attributes& attributes, std::string_view name, std::int64_t fallback) {
  if (!attributes.has(name)) attributes.set(std::string(name), fallback);
  return attributes.get_int(name);
}

std::vector<TensorSpec> infer_binary(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {});
  const TensorSpec& a = inputs[0];
  const TensorSpec& b = inputs[1];
  require_floating(a, "a");
  require_same_dtype(b, "b", a, "a");
  const bool suffix = b.shape.size() <= a.shape.size() &&
                      std::equal(b.shape.rbegin(), b.shape.rend(), a.shape.rbegin());
  if (!suffix) {
    throw InputError(described("b", b) + " does not broadcast against " + described("a", a) +
                     " (b's shape must be a suffix of a's, or [])");
  }
  return {a};
}

std::vector<TensorSpec> infer_unary(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {});
  require_floating(inputs[0], "x");
  return {inputs[0]};
}

std::vector<TensorSpec> infer_scale(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"factor"});
  require_floating(inputs[0], "x");
  finite_number(attributes, "factor");
  return {inputs[0]};
}

std::vector<TensorSpec> infer_gelu(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"approximate"});
  require_floating(inputs[0], "x");
  if (!attributes.has("approximate")) attributes.set("approximate", std::string("none"));
  const std::string& approximate = attributes.get_string("approximate");
  if (approximate != "none" && approximate != "tanh") {
    throw InputError("approximate must be 'none' or 'tanh', got '" + approximate + "'");
  }
  return {inputs[0]};
}

std::vector<TensorSpec> infer_rms_norm(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"eps"});
  const TensorSpec& x = inputs[0];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 1);
  require_row_vector(inputs[1], "weight", x);
  positive_number(attributes, "eps");
  return {x};
}

std::vector<TensorSpec> infer_layer_norm(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"eps"});
  const TensorSpec& x = inputs[0];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 1);
  require_row_vector(inputs[1], "weight", x);
  require_row_vector(inputs[2], "bias", x);
  positive_number(attributes, "eps");
  return {x};
}

std::vector<TensorSpec> infer_softmax(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"axis"});
  const TensorSpec& x = inputs[0];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 1);
  const std::int64_t axis = integer_or_default(attributes, "axis", -1);
  if (axis < -x.rank() || axis >= x.rank()) {
    throw InputError("axis " + std::to_string(axis) + " is out of range for " + described("x", x));
  }
  attributes.set("axis", axis < 0 ? axis + x.rank() : axis);
  return {x};
}

OpKind softmax_kind(std::span<const TensorSpec> inputs, const Attributes& attributes) {
  return attributes.get_int("axis") == inputs[0].rank() - 1 ? OpKind::row_reduction : OpKind::layout;
}

std::vector<TensorSpec> infer_causal_mask(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"offset"});
  require_floating(inputs[0], "x");
  require_rank_at_least(inputs[0], "x", 2);
  integer_or_default(attributes, "offset", 0);
  return {inputs[0]};
}

// positions i32 [S] for the rows of x [..., R, T]: R must be a multiple of S (grouped-query rows
// are head-major: row r is token r mod S).
void require_row_positions(const TensorSpec& positions, std::int64_t rows, std::string_view rows_role) {
  if (positions.dtype != DType::i32 || positions.rank() != 1 || positions.shape[0] <= 0 || rows % positions.shape[0] != 0) {
    throw InputError(described("positions", positions) + " must be i32[S] with the " + std::to_string(rows) + " rows of " +
                     std::string(rows_role) + " a multiple of S");
  }
}

std::vector<TensorSpec> infer_position_mask(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {});
  const TensorSpec& x = inputs[0];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 2);
  require_row_positions(inputs[1], x.shape[x.shape.size() - 2], "x");
  return {x};
}

// q [..., Hkv, R, D], k [..., Hkv, T, D], v [..., Hkv, T, Dv] [, positions i32 [S]] -> [..., Hkv, R, Dv].
std::vector<TensorSpec> infer_flash_attention(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"scale", "mask", "offset", "certificate"});
  const TensorSpec& q = inputs[0];
  const TensorSpec& k = inputs[1];
  const TensorSpec& v = inputs[2];
  require_floating(q, "q");
  require_same_dtype(k, "k", q, "q");
  require_same_dtype(v, "v", q, "q");
  require_rank_at_least(q, "q", 3);
  const auto rank = static_cast<std::size_t>(q.rank());
  const Shape batch(q.shape.begin(), q.shape.end() - 2);
  if (k.rank() != q.rank() || v.rank() != q.rank() || Shape(k.shape.begin(), k.shape.end() - 2) != batch ||
      Shape(v.shape.begin(), v.shape.end() - 2) != batch) {
    throw InputError(described("k", k) + " and " + described("v", v) + " must have the leading dims [..., Hkv] of " +
                     described("q", q));
  }
  if (k.shape[rank - 1] != q.shape[rank - 1]) {
    throw InputError(described("k", k) + " must have the head dim D = " + std::to_string(q.shape[rank - 1]) + " of " +
                     described("q", q));
  }
  if (v.shape[rank - 2] != k.shape[rank - 2]) {
    throw InputError(described("v", v) + " must have the key count T = " + std::to_string(k.shape[rank - 2]) + " of " +
                     described("k", k));
  }
  if (!attributes.has("scale")) attributes.set("scale", 1.0);
  finite_number(attributes, "scale");
  if (!attributes.has("mask")) attributes.set("mask", std::string(inputs.size() == 4 ? "positions" : "none"));
  const std::string& mask = attributes.get_string("mask");
  if (mask != "none" && mask != "causal" && mask != "positions") {
    throw InputError("mask must be 'none', 'causal' or 'positions', got '" + mask + "'");
  }
  if ((mask == "positions") != (inputs.size() == 4)) {
    throw InputError("mask '" + mask + "' " + (inputs.size() == 4 ? "takes no positions input" : "needs a positions input"));
  }
  if (inputs.size() == 4) require_row_positions(inputs[3], q.shape[rank - 2], "q");
  integer_or_default(attributes, "offset", 0);
  if (attributes.has("certificate")) attributes.get_string("certificate");  // a string; the executor checks it
  Shape output = q.shape;
  output.back() = v.shape.back();
  return {TensorSpec(output, q.dtype)};
}

std::vector<TensorSpec> infer_matmul(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"transpose_right"});
  const TensorSpec& a = inputs[0];
  const TensorSpec& b = inputs[1];
  require_floating(a, "a");
  require_same_dtype(b, "b", a, "a");
  require_rank_at_least(a, "a", 2);
  require_rank_at_least(b, "b", 2);
  const std::int64_t transpose_right = integer_or_default(attributes, "transpose_right", 0);
  if (transpose_right != 0 && transpose_right != 1) {
    throw InputError("transpose_right must be 0 or 1 (false or true), got " + std::to_string(transpose_right));
  }
  const std::int64_t m = a.shape[a.shape.size() - 2];
  const std::int64_t k = a.shape.back();
  const std::int64_t b_rows = b.shape[b.shape.size() - 2];
  const std::int64_t b_columns = b.shape.back();
  const std::int64_t b_k = transpose_right ? b_columns : b_rows;
  const std::int64_t n = transpose_right ? b_rows : b_columns;
  if (b_k != k) {
    throw InputError(described("b", b) + " does not contract with " + described("a", a) + ": a has K = " +
                     std::to_string(k) + ", b has " + std::to_string(b_k) +
                     (transpose_right ? " (b is [..., N, K] with transpose_right)" : " (b is [..., K, N])"));
  }
  const Shape a_batch(a.shape.begin(), a.shape.end() - 2);
  const Shape b_batch(b.shape.begin(), b.shape.end() - 2);
  if (!b_batch.empty() && b_batch != a_batch) {
    throw InputError("batch dimensions of " + described("b", b) + " do not match those of " + described("a", a) +
                     " (b's must equal a's, or b must be rank 2)");
  }
  Shape output = a_batch;
  output.push_back(m);
  output.push_back(n);
  return {TensorSpec(output, a.dtype)};
}

std::vector<TensorSpec> infer_quantized_matmul(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"bits", "group_size"});
  const TensorSpec& x = inputs[0];
  const TensorSpec& packed = inputs[1];
  const TensorSpec& scales = inputs[2];
  const TensorSpec& biases = inputs[3];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 1);
  const std::int64_t bits = attributes.get_int("bits");
  const std::int64_t group_size = attributes.get_int("group_size");
  if (bits != 4 && bits != 8) throw InputError("bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw InputError("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  const std::int64_t k = x.row_length();
  if (k % group_size != 0) {
    throw InputError("group_size " + std::to_string(group_size) + " does not divide the row length K = " +
                     std::to_string(k) + " of " + described("x", x));
  }
  if (packed.dtype != DType::u32 || packed.rank() != 2) {
    throw InputError(described("packed", packed) + " must be u32 [N, K*bits/32]");
  }
  const std::int64_t n = packed.shape[0];
  const Shape packed_expected{n, k * bits / 32};
  if (packed.shape != packed_expected) {
    throw InputError(described("packed", packed) + " does not match K = " + std::to_string(k) + " at " +
                     std::to_string(bits) + " bits (expected u32" + shape_text(packed_expected) + ")");
  }
  const Shape groups_expected{n, k / group_size};
  for (const auto& [role, spec] : {std::pair{"scales", &scales}, std::pair{"biases", &biases}}) {
    require_same_dtype(*spec, role, x, "x");
    if (spec->shape != groups_expected) {
      throw InputError(described(role, *spec) + " must be [N, K/group_size] = " + shape_text(groups_expected));
    }
  }
  Shape output(x.shape.begin(), x.shape.end() - 1);
  output.push_back(n);
  return {TensorSpec(output, x.dtype)};
}

std::vector<TensorSpec> infer_rope(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"theta", "dims"});
  const TensorSpec& x = inputs[0];
  const TensorSpec& positions = inputs[1];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 2);
  const std::int64_t sequence = x.shape[x.shape.size() - 2];
  if (positions.dtype != DType::i32 || positions.shape != Shape{sequence}) {
    throw InputError(described("positions", positions) + " must be i32[" + std::to_string(sequence) +
                     "], one position per row of " + described("x", x) + " along axis -2");
  }
  if (!attributes.has("theta")) attributes.set("theta", 10000.0);
  positive_number(attributes, "theta");
  const std::int64_t dims = integer_or_default(attributes, "dims", x.row_length());
  if (dims <= 0 || dims % 2 != 0 || dims > x.row_length()) {
    throw InputError("dims " + std::to_string(dims) + " must be even, positive and at most the last axis of " +
                     described("x", x));
  }
  return {x};
}

std::vector<TensorSpec> infer_reshape(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"shape"});
  const TensorSpec& x = inputs[0];
  Shape shape = attributes.get_ints("shape");
  std::int64_t known = 1;
  std::optional<std::size_t> inferred_axis;
  for (std::size_t axis = 0; axis < shape.size(); ++axis) {
    if (shape[axis] == -1 && !inferred_axis) {
      inferred_axis = axis;
    } else if (shape[axis] <= 0) {
      throw InputError("shape " + shape_text(shape) + " may hold positive sizes and one -1 only");
    } else if (__builtin_mul_overflow(known, shape[axis], &known)) {
      throw InputError("cannot reshape " + described("x", x) + " to " + shape_text(shape) + ": element counts differ");
    }
  }
  if (inferred_axis) {
    if (x.element_count() % known != 0) {
      throw InputError("cannot reshape " + described("x", x) + " to " + shape_text(shape) + ": " +
                       std::to_string(x.element_count()) + " elements are not a multiple of " + std::to_string(known));
    }
    shape[*inferred_axis] = x.element_count() / known;
    known *= shape[*inferred_axis];
  }
  if (known != x.element_count()) {
    throw InputError("cannot reshape " + described("x", x) + " to " + shape_text(shape) + ": element counts differ (" +
                     std::to_string(x.element_count()) + " vs " + std::to_string(known) + ")");
  }
  attributes.set("shape", shape);
  return {TensorSpec(shape, x.dtype)};
}

std::vector<TensorSpec> infer_transpose(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"perm"});
  const TensorSpec& x = inputs[0];
  const Shape& perm = attributes.get_ints("perm");
  Shape sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  bool permutation = static_cast<int>(perm.size()) == x.rank();
  for (std::size_t axis = 0; permutation && axis < sorted.size(); ++axis) {
    permutation = sorted[axis] == static_cast<std::int64_t>(axis);
  }
  if (!permutation) {
    throw InputError("perm " + shape_text(perm) + " is not a permutation of the " + std::to_string(x.rank()) +
                     " axes of " + described("x", x));
  }
  Shape shape;
  for (std::int64_t axis : perm) shape.push_back(x.shape[static_cast<std::size_t>(axis)]);
  return {TensorSpec(shape, x.dtype)};
}

std::vector<TensorSpec> infer_cast(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"dtype"});
  return {TensorSpec(inputs[0].shape, parse_dtype(attributes.get_string("dtype")))};
}

const std::vector<OpDefinition>& registry() {
  static const std::vector<OpDefinition> definitions = [] {
    std::vector<OpDefinition> ops;
    auto define = [&ops](std::string_view name, OpKind kind, std::vector<std::string_view> input_names,
                         decltype(OpDefinition::infer) infer, decltype(OpDefinition::node_kind) node_kind = {},
                         std::size_t optional_inputs = 0) {
      ops.push_back(OpDefinition{name, kind, std::move(input_names), std::move(infer), std::move(node_kind),
                                 optional_inputs});
    };
    define("add", OpKind::elementwise, {"a", "b"}, infer_binary);
    define("subtract", OpKind::elementwise, {"a", "b"}, infer_binary);
    define("multiply", OpKind::elementwise, {"a", "b"}, infer_binary);
    define("scale", OpKind::elementwise, {"x"}, infer_scale);
    define("silu", OpKind::elementwise, {"x"}, infer_unary);
    define("gelu", OpKind::elementwise, {"x"}, infer_gelu);
    define("exp", OpKind::elementwise, {"x"}, infer_unary);
    define("causal_mask", OpKind::elementwise, {"x"}, infer_causal_mask);
    // Not elementwise in the planner's sense (it reads a second, differently shaped input per row), so
    // `layout` keeps rules from growing into it; the CPU reference and the attention rewrite know it.
    define("position_mask", OpKind::layout, {"x", "positions"}, infer_position_mask);
    define("rms_norm", OpKind::row_reduction, {"x", "weight"}, infer_rms_norm);
    define("layer_norm", OpKind::row_reduction, {"x", "weight", "bias"}, infer_layer_norm);
    define("softmax", OpKind::row_reduction, {"x"}, infer_softmax, softmax_kind);
    define("matmul", OpKind::contraction, {"a", "b"}, infer_matmul);
    define("quantized_matmul", OpKind::contraction, {"x", "packed", "scales", "biases"}, infer_quantized_matmul);
    // One kernel made by the attention rewrite (src/discovery): it contracts over D and over T.
    define("flash_attention", OpKind::contraction, {"q", "k", "v", "positions"}, infer_flash_attention, {}, 1);
    define("rope", OpKind::layout, {"x", "positions"}, infer_rope);
    define("reshape", OpKind::layout, {"x"}, infer_reshape);
    define("transpose", OpKind::layout, {"x"}, infer_transpose);
    define("cast", OpKind::layout, {"x"}, infer_cast);
    return ops;
  }();
  return definitions;
}

}  // namespace

std::string_view op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::elementwise: return "elementwise";
    case OpKind::row_reduction: return "row_reduction";
    case OpKind::contraction: return "contraction";
    case OpKind::layout: return "layout";
  }
  return "?";
}

const OpDefinition* find_op(std::string_view name) {
  for (const OpDefinition& definition : registry()) {
    if (definition.name == name) return &definition;
  }
  return nullptr;
}

std::vector<std::string_view> registered_op_names() {
  std::vector<std::string_view> names;
  for (const OpDefinition& definition : registry()) names.push_back(definition.name);
  return names;
}

OpKind op_kind_for(const OpDefinition& definition, std::span<const TensorSpec> inputs, const Attributes& attributes) {
  return definition.node_kind ? definition.node_kind(inputs, attributes) : definition.kind;
}

}  // namespace metile
