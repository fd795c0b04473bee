// The op table: one entry per op (table at the end of this file) with everything about it: its
// kind, its shape/dtype rule, the math of an elementwise op (CPU f32 reference, float64 oracle and
// the CUDA device expression every generated kernel uses), the per-row math and row-kernel hook of
// a row reduction, and a sample graph for the tests. docs/architecture.md, "The op table", says
// how to add an op. Shape inference also validates and canonicalises attributes
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
#include <cstdio>
#include <deque>
#include <initializer_list>
#include <limits>
#include <numbers>
#include <sstream>
#include <string>

#include "attributes_of.h"
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
    throw InputError("unknown attribute '" + printable_bytes(name) + "' (" + (allowed.empty() ? "this op takes none" : "allowed: " + allowed) +
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

}  // namespace

float flash_attention_scale_log2(double scale) {
  return static_cast<float>(static_cast<double>(static_cast<float>(scale)) * std::numbers::log2e);
}

std::optional<std::string> flash_attention_scale_problem(double scale) {
  if (std::isinf(flash_attention_scale_log2(scale))) {
    return "times log2(e) is beyond f32's range (the fused attention kernels scale by it in f32)";
  }
  return std::nullopt;
}

namespace {

// The scale op multiplies in f32 (scale_math): a factor that rounds to an f32 infinity would turn every
// element into inf or NaN (0 · inf) whatever its value, and a non-zero one that rounds to 0 every
// finite element into 0 (1e30 scaled by 1e-50 is 1e-20, an f32 value). `name` is the attribute.
double f32_factor(Attributes& attributes, std::string_view name) {
  const double factor = finite_number(attributes, name);
  if (std::isinf(static_cast<float>(factor))) {
    throw InputError(std::string(name) + " " + number_text(factor) + " is beyond f32's range (scale multiplies in f32)");
  }
  if (factor != 0 && static_cast<float>(factor) == 0) {
    throw InputError(std::string(name) + " " + number_text(factor) + " is 0 in f32 (scale multiplies in f32)");
  }
  return factor;
}

std::vector<TensorSpec> infer_scale(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"factor"});
  require_floating(inputs[0], "x");
  f32_factor(attributes, "factor");
  return {inputs[0]};
}

std::vector<TensorSpec> infer_gelu(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"approximate"});
  require_floating(inputs[0], "x");
  if (!attributes.has("approximate")) attributes.set("approximate", std::string("none"));
  const std::string& approximate = attributes.get_string("approximate");
  if (approximate != "none" && approximate != "tanh") {
    throw InputError("approximate must be 'none' or 'tanh', got '" + printable_bytes(approximate) + "'");
  }
  return {inputs[0]};
}

std::vector<TensorSpec> infer_rms_norm(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"eps"});
  const TensorSpec& x = inputs[0];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 1);
  require_row_vector(inputs[1], "weight", x);
  check_norm_eps(positive_number(attributes, "eps"));
  return {x};
}

std::vector<TensorSpec> infer_layer_norm(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"eps"});
  const TensorSpec& x = inputs[0];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 1);
  require_row_vector(inputs[1], "weight", x);
  require_row_vector(inputs[2], "bias", x);
  check_norm_eps(positive_number(attributes, "eps"));
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
  // The op is its plain-op chain (scale, mask, softmax, matmul), whose scale multiplies in f32: a scale
  // past f32's range or 0 only in f32 is refused as the scale op refuses it (a -inf score times a
  // factor 0 in f32 is NaN in the chain, -inf in a double product).
  const double scale = f32_factor(attributes, "scale");
  if (const std::optional<std::string> problem = flash_attention_scale_problem(scale)) {
    throw InputError("scale " + number_text(scale) + " " + *problem);
  }
  if (!attributes.has("mask")) attributes.set("mask", std::string(inputs.size() == 4 ? "positions" : "none"));
  const std::string& mask = attributes.get_string("mask");
  if (mask != "none" && mask != "causal" && mask != "positions") {
    throw InputError("mask must be 'none', 'causal' or 'positions', got '" + printable_bytes(mask) + "'");
  }
  if ((mask == "positions") != (inputs.size() == 4)) {
    throw InputError("mask '" + mask + "' " + (inputs.size() == 4 ? "takes no positions input" : "needs a positions input"));
  }
  if (inputs.size() == 4) require_row_positions(inputs[3], q.shape[rank - 2], "q");
  // The offset shifts the causal mask only: under another mask it would do nothing, likely a mistyped mask.
  if (const std::int64_t offset = integer_or_default(attributes, "offset", 0); offset != 0 && mask != "causal") {
    throw InputError("offset " + std::to_string(offset) + " is the causal mask's; mask '" + mask + "' takes none");
  }
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

// rope's optional frequency scaling (Llama 3.1 and later, transformers'
// _compute_llama3_parameters): attribute "scaling" = "llama3" with "factor",
// "low_freq_factor", "high_freq_factor" and "original_max_position_embeddings".
// Absent means unscaled; nothing is filled in, so graphs without it are unchanged.
void check_rope_scaling(Attributes& attributes) {
  if (!attributes.has("scaling")) {
    for (const char* name : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
      if (attributes.has(name)) throw InputError(std::string("attribute '") + name + "' needs scaling = 'llama3'");
    }
    return;
  }
  const std::string& scaling = attributes.get_string("scaling");
  if (scaling != "llama3") throw InputError("scaling must be 'llama3', got '" + printable_bytes(scaling) + "'");
  positive_number(attributes, "factor");
  const double low = positive_number(attributes, "low_freq_factor");
  const double high = positive_number(attributes, "high_freq_factor");
  positive_number(attributes, "original_max_position_embeddings");
  if (!(high > low)) {
    throw InputError("high_freq_factor " + number_text(high) + " must exceed low_freq_factor " + number_text(low));
  }
}

std::vector<TensorSpec> infer_rope(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"theta", "dims", "scaling", "factor", "low_freq_factor", "high_freq_factor",
                                      "original_max_position_embeddings"});
  check_rope_scaling(attributes);
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
  check_rope_frequencies(attributes.get_double("theta"), dims,
                         attributes.has("scaling") ? attributes.get_double("factor") : 1.0);
  return {x};
}

// The ops of a decoder's decode step (src/model): token ids and positions are
// runtime i32 inputs, the KV cache is a fixed-capacity tensor [Hkv, T, D].
void require_ids(const TensorSpec& spec, std::string_view role) {
  if (spec.dtype != DType::i32 || spec.rank() != 1) {
    throw InputError(described(role, spec) + " must be i32 [S]");
  }
}

// embedding(ids i32 [S], table [V, H]) -> [S, H]: row ids[s] of the table.
std::vector<TensorSpec> infer_embedding(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {});
  require_ids(inputs[0], "ids");
  const TensorSpec& table = inputs[1];
  require_floating(table, "table");
  if (table.rank() != 2) throw InputError(described("table", table) + " must be [V, H]");
  return {TensorSpec({inputs[0].shape[0], table.shape[1]}, table.dtype)};
}

// quantized_embedding(ids, packed u32 [V, H*bits/32], scales [V, H/g], biases): the rows of
// an affinely quantized table (include/metile/quant.h), dequantized in the scales' dtype.
std::vector<TensorSpec> infer_quantized_embedding(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {"bits", "group_size"});
  require_ids(inputs[0], "ids");
  const TensorSpec& packed = inputs[1];
  const TensorSpec& scales = inputs[2];
  const TensorSpec& biases = inputs[3];
  const std::int64_t bits = attributes.get_int("bits");
  const std::int64_t group_size = attributes.get_int("group_size");
  if (bits != 4 && bits != 8) throw InputError("bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw InputError("group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (packed.dtype != DType::u32 || packed.rank() != 2) {
    throw InputError(described("packed", packed) + " must be u32 [V, H*bits/32]");
  }
  require_floating(scales, "scales");
  const std::int64_t rows = packed.shape[0];
  const std::int64_t hidden = packed.shape[1] * 32 / bits;
  if (hidden % group_size != 0) {
    throw InputError(described("packed", packed) + " holds rows of " + std::to_string(hidden) +
                     " values, not a multiple of group_size " + std::to_string(group_size));
  }
  const Shape groups_expected{rows, hidden / group_size};
  for (const auto& [role, spec] : {std::pair{"scales", &scales}, std::pair{"biases", &biases}}) {
    require_same_dtype(*spec, role, scales, "scales");
    if (spec->shape != groups_expected) {
      throw InputError(described(role, *spec) + " must be [V, H/group_size] = " + shape_text(groups_expected));
    }
  }
  return {TensorSpec({inputs[0].shape[0], hidden}, scales.dtype)};
}

// position_mask(x [..., R, T], positions i32 [S]), R a multiple of S: row r sees key j
// only where j <= positions[r mod S], the rest becomes -inf (the causal mask of a decode
// step whose tokens sit at runtime positions, rows of grouped query heads stacked).
std::vector<TensorSpec> infer_position_mask(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {});
  const TensorSpec& x = inputs[0];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 2);
  require_row_positions(inputs[1], x.shape[x.shape.size() - 2], "x");
  return {x};
}

// kv_cache_write(cache [H, T, D], update [H, S, D], positions i32 [S]) -> cache with row
// positions[s] of every head replaced by update[:, s, :]. SSA in the graph; the model
// runtime hands the output back as the next step's cache.
std::vector<TensorSpec> infer_kv_cache_write(std::span<const TensorSpec> inputs, Attributes& attributes) {
  check_known_attributes(attributes, {});
  const TensorSpec& cache = inputs[0];
  const TensorSpec& update = inputs[1];
  require_floating(cache, "cache");
  require_same_dtype(update, "update", cache, "cache");
  if (cache.rank() != 3) throw InputError(described("cache", cache) + " must be [H, T, D]");
  require_ids(inputs[2], "positions");
  const Shape expected{cache.shape[0], inputs[2].shape[0], cache.shape[2]};
  if (update.shape != expected) {
    throw InputError(described("update", update) + " must be " + shape_text(expected) +
                     " (the cache's heads and row length, one row per position)");
  }
  return {cache};
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

// The input of an op over each row's last axis that takes no attribute (sum, mean, argmax): x
// floating, of rank 1 or more, with rows that are not empty.
const TensorSpec& attributeless_floating_rows(std::span<const TensorSpec> inputs, const Attributes& attributes) {
  check_known_attributes(attributes, {});
  const TensorSpec& x = inputs[0];
  require_floating(x, "x");
  require_rank_at_least(x, "x", 1);
  if (x.row_length() == 0) throw InputError(described("x", x) + " has empty rows");
  return x;
}

std::vector<TensorSpec> infer_row_total(std::span<const TensorSpec> inputs, Attributes& attributes) {
  const TensorSpec& x = attributeless_floating_rows(inputs, attributes);
  Shape shape = x.shape;
  shape.back() = 1;
  return {TensorSpec(shape, x.dtype)};
}

// argmax(x [..., L]) -> i32 [...]: the index of each row's maximum (argmax_index's rule). A layout
// op, not a row reduction: its result is an index, not a value in x's dtype, so no row kernel
// computes it and it never fuses into one; its native kernel reduces one row per block.
std::vector<TensorSpec> infer_argmax(std::span<const TensorSpec> inputs, Attributes& attributes) {
  const TensorSpec& x = attributeless_floating_rows(inputs, attributes);
  if (x.row_length() > std::numeric_limits<std::int32_t>::max()) {
    throw InputError(described("x", x) + " has rows longer than an i32 index reaches");
  }
  Shape shape = x.shape;
  shape.pop_back();
  return {TensorSpec(shape, DType::i32)};
}

// ---------------------------------------------------------------- elementwise math helpers
// Host math is written once as a generic lambda; float gives the CPU reference, double the oracle.

template <typename Bind>
std::function<ElementFunctions(const Attributes&, std::span<const TensorSpec>)> unary_math(Bind bind) {
  return [bind](const Attributes& attributes, std::span<const TensorSpec> inputs) {
    auto f = bind(attributes, inputs);
    return ElementFunctions{[f](std::span<const float> x, ElementSite) { return f(x[0]); },
                            [f](std::span<const double> x, ElementSite) { return f(x[0]); }};
  };
}

template <typename F>
std::function<ElementFunctions(const Attributes&, std::span<const TensorSpec>)> binary_math(F f) {
  return [f](const Attributes&, std::span<const TensorSpec>) {
    return ElementFunctions{[f](std::span<const float> x, ElementSite) { return f(x[0], x[1]); },
                            [f](std::span<const double> x, ElementSite) { return f(x[0], x[1]); }};
  };
}

// Math with no attributes: the bind step only hands the function over.
template <typename F>
auto plain(F f) {
  return [f](const Attributes&, std::span<const TensorSpec>) { return f; };
}

using CudaExpression = decltype(ElementwiseMath::cuda);

CudaExpression cuda_infix(std::string symbol) {
  return [symbol](std::span<const std::string> x, const CudaElementSite&, const Attributes&, std::span<const TensorSpec>) {
    return "(" + x[0] + " " + symbol + " " + x[1] + ")";
  };
}

CudaExpression cuda_call(std::string function) {
  return [function](std::span<const std::string> x, const CudaElementSite&, const Attributes&, std::span<const TensorSpec>) {
    return function + "(" + x[0] + ")";
  };
}

// silu(x) = x / (1 + e^-x). CUDA's expf (2 ulp over the whole range) rather than __expf, whose
// error grows with |x|: the CPU reference uses the correctly rounded-ish std::exp, the kernels
// that apply silu are memory-bound, so the accurate form costs nothing measurable. In f32 this is
// PyTorch's silu to the letter: -0 below about -88.7 (e^-x overflows) and NaN at -inf (-inf / inf),
// where the mathematical values are tiny and -0. Handling those took a second expf and a branch,
// and that spilled 40 bytes in the 7-block SwiGLU gate/up GEMV (session 35): left as PyTorch has it.
template <typename T>
T silu(T x) {
  return x / (T(1) + std::exp(-x));
}

// Both gelu forms are written so that no step cancels: the textbook 1 + erf(x / sqrt 2) and
// 1 + tanh(u) lose every significant digit for negative x, where the result is tiny but not zero.
// What f32 element math still leaves in the negative tail (measured by an adversarial pass against
// float64, session 50): the erf form is off by ~2z^2 ulps, z = -x / sqrt 2 (the f32 rounding of z
// times erfc's conditioning: 4-21 ulps for x in [-5, -3), up to ~190 near -14); the tanh form the
// same, and -0 below about -10.06, where exp(-2u) overflows (as silu below -88.7); -inf gives NaN in
// both (-inf x 0, -inf / inf), as in silu and PyTorch. The kernels use the same f32 steps, so they
// agree with this reference; against the numeric gate (error over the largest |ref|) the tail is noise.
// 0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2)
template <typename T>
T gelu_erf(T x) {
  const T half_x = T(0.5) * x;
  return half_x * std::erfc(-x * T(0.7071067811865476));
}
// 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3)
template <typename T>
T gelu_tanh(T x) {
  const T cube = x * x * x;
  const T inner = T(0.7978845608028654) * (x + T(0.044715) * cube);
  return x / (T(1) + std::exp(T(-2) * inner));
}

constexpr std::string_view silu_helper =
    "__device__ __forceinline__ float silu_f32(float x) { return x / (1.0f + expf(-x)); }\n";
constexpr std::string_view gelu_helpers =
    "__device__ __forceinline__ float gelu_f32(float x) { return (0.5f * x) * erfcf(-x * 0.70710678118654752f); }\n"
    "__device__ __forceinline__ float gelu_tanh_f32(float x) {\n"
    "  const float inner = 0.79788456080286536f * (x + 0.044715f * (x * x * x));\n"
    "  return x / (1.0f + expf(-2.0f * inner));\n"
    "}\n";

ElementwiseMath silu_math() {
  return {unary_math(plain([](auto x) { return silu(x); })), cuda_call("silu_f32"), std::string(silu_helper), false};
}

ElementwiseMath gelu_math() {
  ElementwiseMath math;
  math.bind = unary_math([](const Attributes& attributes, std::span<const TensorSpec>) {
    const bool tanh_form = attributes.get_string("approximate") == "tanh";
    return [tanh_form](auto x) { return tanh_form ? gelu_tanh(x) : gelu_erf(x); };
  });
  math.cuda = [](std::span<const std::string> x, const CudaElementSite&, const Attributes& attributes,
                 std::span<const TensorSpec>) {
    return (attributes.get_string("approximate") == "tanh" ? "gelu_tanh_f32(" : "gelu_f32(") + x[0] + ")";
  };
  math.cuda_helpers = gelu_helpers;
  return math;
}

ElementwiseMath scale_math() {
  ElementwiseMath math;
  math.bind = unary_math([](const Attributes& attributes, std::span<const TensorSpec>) {
    const double factor = attributes.get_double("factor");
    return [factor](auto x) { return x * static_cast<decltype(x)>(factor); };
  });
  math.cuda = [](std::span<const std::string> x, const CudaElementSite&, const Attributes& attributes,
                 std::span<const TensorSpec>) {
    return "(" + x[0] + " * " + cuda_float_literal(attributes.get_double("factor")) + ")";
  };
  return math;
}

// Keys j > i + offset of query row i (the row index along axis -2) are -inf.
ElementwiseMath causal_mask_math() {
  ElementwiseMath math;
  math.bind = [](const Attributes& attributes, std::span<const TensorSpec> inputs) {
    const std::int64_t offset = attributes.get_int("offset");
    const std::int64_t queries = inputs[0].shape[inputs[0].shape.size() - 2];
    auto masked = [offset, queries](ElementSite site) { return site.column - site.row % queries > offset; };
    return ElementFunctions{
        [masked](std::span<const float> x, ElementSite site) {
          return masked(site) ? -std::numeric_limits<float>::infinity() : x[0];
        },
        [masked](std::span<const double> x, ElementSite site) {
          return masked(site) ? -std::numeric_limits<double>::infinity() : x[0];
        }};
  };
  math.cuda = [](std::span<const std::string> x, const CudaElementSite& site, const Attributes& attributes,
                 std::span<const TensorSpec> inputs) {
    const std::int64_t queries = inputs[0].shape[inputs[0].shape.size() - 2];
    // column - row % queries > offset, as the CPU path compares: row + offset could overflow. The
    // offset's literal is spelled so that -2^63 is one too ("-9223372036854775808LL" is not C++).
    const std::int64_t offset = attributes.get_int("offset");
    const std::string offset_literal = offset == std::numeric_limits<std::int64_t>::min()
                                           ? std::string("(-9223372036854775807LL - 1)")
                                           : "(" + std::to_string(offset) + "LL)";
    return "((" + site.column + " - " + site.row + " % " + std::to_string(queries) + "LL) > " + offset_literal +
           " ? __int_as_float(0xff800000) : " + x[0] + ")";
  };
  math.reads_site = true;
  return math;
}

// ---------------------------------------------------------------- row reductions
// Per row: element math in f32, accumulation in f64 in index order, each statistic rounded once to
// f32. The kernel hooks compute the same steps in f32 (row_kernel.cpp reduces across threads).

using RowFunction = RowReductionMath::RowFunction;
using RowOperands = std::span<const std::span<const float>>;

// x / sqrt(mean(x^2) + eps) * weight.
RowReductionMath rms_norm_math() {
  RowReductionMath math;
  math.bind = [](const Attributes& attributes) -> RowFunction {
    const double eps = attributes.get_double("eps");
    return [eps](RowOperands in, std::span<double> out) {
      const std::span<const float> x = in[0], weight = in[1];
      double sum_of_squares = 0;
      for (float value : x) sum_of_squares += static_cast<double>(value) * value;
      const auto inverse_rms = static_cast<float>(1.0 / std::sqrt(sum_of_squares / static_cast<double>(x.size()) + eps));
      for (std::size_t d = 0; d < x.size(); ++d) {
        const float normalized = x[d] * inverse_rms;
        out[d] = normalized * weight[d];
      }
    };
  };
  math.row_kernel = [](RowKernelSteps& steps, const Attributes& attributes) {
    const std::string x = steps.operand(0);
    const std::string sum = steps.reduce("sum", x + " * " + x, "sum of squares");
    const std::string inverse = steps.scalar("rsqrtf(" + sum + " / " + steps.row_length() + " + " +
                                             cuda_float_literal(attributes.get_double("eps")) + ")");
    steps.element_result(x + " * " + inverse + " * " + steps.operand(1));
  };
  return math;
}

// (x - mean) / sqrt(var + eps) * weight + bias, the variance in two passes.
RowReductionMath layer_norm_math() {
  RowReductionMath math;
  math.bind = [](const Attributes& attributes) -> RowFunction {
    const double eps = attributes.get_double("eps");
    return [eps](RowOperands in, std::span<double> out) {
      const std::span<const float> x = in[0], weight = in[1], bias = in[2];
      const auto length = static_cast<double>(x.size());
      double sum = 0;
      for (float value : x) sum += value;
      const double mean = sum / length;
      double squared_deviations = 0;
      for (float value : x) squared_deviations += (value - mean) * (value - mean);
      // Centred on the mean the variance was taken around, in f64: centring f32 values on the mean
      // rounded to f32 moved rows with a large offset and a small spread ([2^24, 2^24 + 2] gave
      // [0, 2], not [-1, 1]), and x - mean overflowed f32 near its limit. Rounded once to f32 here,
      // then the weight and bias in f32.
      const double inverse_std = 1.0 / std::sqrt(squared_deviations / length + eps);
      for (std::size_t d = 0; d < x.size(); ++d) {
        const auto normalized = static_cast<float>((x[d] - mean) * inverse_std);
        const float scaled = normalized * weight[d];
        out[d] = scaled + bias[d];
      }
    };
  };
  // The kernel takes the statistics in f64 as the reference does (sums, mean, centring, the inverse
  // root): centred on an f32 mean, a row whose mean is large against its spread moved ([2^24, 2^24 + 2]
  // gave [0, 2]) and x - mean could overflow f32. Then, as the reference, the normalized value rounded
  // to f32 and the weight and bias in f32, each rounded (no fused multiply-add).
  math.row_kernel = [](RowKernelSteps& steps, const Attributes& attributes) {
    const std::string x = "static_cast<double>(" + steps.operand(0) + ")";
    const std::string length = "static_cast<double>(" + steps.row_length() + ")";  // exact, as the reference divides
    const std::string mean = steps.scalar(steps.reduce("sum_f64", x, "sum in f64") + " / " + length);
    const std::string centered = "(" + x + " - " + mean + ")";
    const std::string variance = steps.reduce("sum_f64", centered + " * " + centered, "centered sum of squares in f64");
    char eps[32];
    std::snprintf(eps, sizeof eps, "%.17e", attributes.get_double("eps"));  // a double literal: exact
    const std::string inverse = steps.scalar("1.0 / sqrt(" + variance + " / " + length + " + " + eps + ")");
    steps.element_result("__fadd_rn(__fmul_rn(static_cast<float>(" + centered + " * " + inverse + "), " +
                         steps.operand(1) + "), " + steps.operand(2) + ")");
  };
  return math;
}

// Numerically stable: exp(x - max) in f32, the sum in f64, each quotient rounded once. A row that
// is entirely -inf has no finite maximum and gives NaN, as in PyTorch and MLX.
RowReductionMath softmax_math() {
  RowReductionMath math;
  math.bind = [](const Attributes&) -> RowFunction {
    return [](RowOperands in, std::span<double> out) {
      const std::span<const float> x = in[0];
      float maximum = -std::numeric_limits<float>::infinity();
      for (float value : x) {
        if (value > maximum || std::isnan(value)) maximum = value;
      }
      double sum = 0;
      for (std::size_t d = 0; d < x.size(); ++d) {
        out[d] = std::exp(x[d] - maximum);
        sum += out[d];
      }
      for (double& value : out) value /= sum;  // rounded once, to the output's dtype, by its store
    };
  };
  math.row_kernel = [](RowKernelSteps& steps, const Attributes&) {
    const std::string x = steps.operand(0);
    const std::string maximum = steps.reduce("max", x, "row maximum");
    const std::string sum = steps.reduce("sum", "expf(" + x + " - " + maximum + ")", "sum of exponentials");
    const std::string inverse = steps.scalar("1.0f / " + sum);
    steps.element_result("expf(" + x + " - " + maximum + ") * " + inverse);
  };
  return math;
}

// sum and mean over the last axis, to [..., 1]: the f64 total (divided by the length for the mean), rounded
// once, straight to the output dtype (through f32 first, an f16 or bf16 total could round twice).
RowReductionMath row_total_math(bool mean) {
  RowReductionMath math;
  math.bind = [mean](const Attributes&) -> RowFunction {
    return [mean](RowOperands in, std::span<double> out) {
      double total = 0;
      for (float value : in[0]) total += value;
      out[0] = mean ? total / static_cast<double>(in[0].size()) : total;
    };
  };
  math.row_kernel = [mean](RowKernelSteps& steps, const Attributes&) {
    const std::string total = steps.reduce("sum", steps.operand(0), "sum");
    steps.row_result(mean ? total + " / " + steps.row_length() : total);
  };
  return math;
}

// ---------------------------------------------------------------- sample graphs

using graph_detail::attributes_of;

// One node of `op` over inputs named after the op's input names.
std::function<ComputeGraph()> sample(std::string op, std::vector<TensorSpec> inputs, Attributes attributes = {}) {
  return [op = std::move(op), inputs = std::move(inputs), attributes = std::move(attributes)] {
    const OpDefinition& definition = *find_op(op);
    GraphBuilder builder;
    std::vector<ValueRef> refs;
    for (std::size_t index = 0; index < inputs.size(); ++index) {
      refs.push_back(builder.input(std::string(definition.input_names.at(index)), inputs[index]));
    }
    return builder.build(builder.add_node(op, refs, attributes, "out"));
  };
}

TensorSpec f32(Shape shape) { return TensorSpec(std::move(shape), DType::f32); }

// ---------------------------------------------------------------- the table

std::deque<OpDefinition>& table() {
  static std::deque<OpDefinition> definitions = [] {
    std::deque<OpDefinition> ops;
    auto define = [&ops](std::string_view name, OpKind kind, std::vector<std::string_view> input_names,
                         decltype(OpDefinition::infer) infer, std::function<ComputeGraph()> sample_graph) -> OpDefinition& {
      OpDefinition& definition = ops.emplace_back();
      definition.name = name;
      definition.kind = kind;
      definition.input_names = std::move(input_names);
      definition.infer = std::move(infer);
      definition.sample_graph = std::move(sample_graph);
      return definition;
    };
    const Shape rows{4, 32};
    define("add", OpKind::elementwise, {"a", "b"}, infer_binary, sample("add", {f32(rows), f32({32})}))
        .elementwise = ElementwiseMath{binary_math([](auto a, auto b) { return a + b; }), cuda_infix("+"), "", false};
    define("subtract", OpKind::elementwise, {"a", "b"}, infer_binary, sample("subtract", {f32(rows), f32(rows)}))
        .elementwise = ElementwiseMath{binary_math([](auto a, auto b) { return a - b; }), cuda_infix("-"), "", false};
    define("multiply", OpKind::elementwise, {"a", "b"}, infer_binary, sample("multiply", {f32(rows), f32({})}))
        .elementwise = ElementwiseMath{binary_math([](auto a, auto b) { return a * b; }), cuda_infix("*"), "", false};
    define("scale", OpKind::elementwise, {"x"}, infer_scale, sample("scale", {f32(rows)}, attributes_of({{"factor", 0.375}})))
        .elementwise = scale_math();
    define("silu", OpKind::elementwise, {"x"}, infer_unary, sample("silu", {f32(rows)})).elementwise = silu_math();
    define("gelu", OpKind::elementwise, {"x"}, infer_gelu,
           sample("gelu", {f32(rows)}, attributes_of({{"approximate", std::string("tanh")}})))
        .elementwise = gelu_math();
    define("exp", OpKind::elementwise, {"x"}, infer_unary, sample("exp", {f32(rows)})).elementwise =
        ElementwiseMath{unary_math(plain([](auto x) { return std::exp(x); })), cuda_call("expf"), "", false};
    define("causal_mask", OpKind::elementwise, {"x"}, infer_causal_mask,
           sample("causal_mask", {f32({2, 8, 8})}, attributes_of({{"offset", std::int64_t{1}}})))
        .elementwise = causal_mask_math();
    define("rms_norm", OpKind::row_reduction, {"x", "weight"}, infer_rms_norm,
           sample("rms_norm", {f32(rows), f32({32})}, attributes_of({{"eps", 1e-5}})))
        .row_reduction = rms_norm_math();
    define("layer_norm", OpKind::row_reduction, {"x", "weight", "bias"}, infer_layer_norm,
           sample("layer_norm", {f32(rows), f32({32}), f32({32})}, attributes_of({{"eps", 1e-5}})))
        .row_reduction = layer_norm_math();
    OpDefinition& softmax = define("softmax", OpKind::row_reduction, {"x"}, infer_softmax, sample("softmax", {f32(rows)}));
    softmax.node_kind = softmax_kind;
    softmax.row_reduction = softmax_math();
    define("sum", OpKind::row_reduction, {"x"}, infer_row_total, sample("sum", {f32(rows)})).row_reduction =
        row_total_math(false);
    define("mean", OpKind::row_reduction, {"x"}, infer_row_total, sample("mean", {f32(rows)})).row_reduction =
        row_total_math(true);
    define("argmax", OpKind::layout, {"x"}, infer_argmax, sample("argmax", {f32({5, 37})}));
    define("matmul", OpKind::contraction, {"a", "b"}, infer_matmul,
           sample("matmul", {f32(rows), f32({16, 32})}, attributes_of({{"transpose_right", std::int64_t{1}}})));
    define("quantized_matmul", OpKind::contraction, {"x", "packed", "scales", "biases"}, infer_quantized_matmul,
           sample("quantized_matmul", {f32({2, 64}), TensorSpec({16, 8}, DType::u32), f32({16, 1}), f32({16, 1})},
                  attributes_of({{"bits", std::int64_t{4}}, {"group_size", std::int64_t{64}}})));
    define("rope", OpKind::layout, {"x", "positions"}, infer_rope,
           sample("rope", {f32({2, 4, 16}), TensorSpec({4}, DType::i32)}, attributes_of({{"theta", 1e4}})));
    define("reshape", OpKind::layout, {"x"}, infer_reshape,
           sample("reshape", {f32(rows)}, attributes_of({{"shape", Shape{8, -1}}})));
    define("transpose", OpKind::layout, {"x"}, infer_transpose,
           sample("transpose", {f32({2, 4, 8})}, attributes_of({{"perm", Shape{2, 0, 1}}})));
    define("cast", OpKind::layout, {"x"}, infer_cast,
           sample("cast", {f32(rows)}, attributes_of({{"dtype", std::string("f16")}})));
    // The decode-step ops of src/model: gathers and a cache write are data movement
    // (layout); position_mask also reads a row-indexed runtime input (positions [S]
    // repeat over rows, not a broadcast suffix), so it is not same-index elementwise
    // and stays out of elementwise fusion, like rope.
    define("embedding", OpKind::layout, {"ids", "table"}, infer_embedding,
           sample("embedding", {TensorSpec({3}, DType::i32), f32({10, 16})}));
    define("quantized_embedding", OpKind::layout, {"ids", "packed", "scales", "biases"}, infer_quantized_embedding,
           sample("quantized_embedding",
                  {TensorSpec({3}, DType::i32), TensorSpec({10, 8}, DType::u32), f32({10, 1}), f32({10, 1})},
                  attributes_of({{"bits", std::int64_t{4}}, {"group_size", std::int64_t{64}}})));
    define("position_mask", OpKind::layout, {"x", "positions"}, infer_position_mask,
           sample("position_mask", {f32({2, 8, 6}), TensorSpec({4}, DType::i32)}));
    define("kv_cache_write", OpKind::layout, {"cache", "update", "positions"}, infer_kv_cache_write,
           sample("kv_cache_write", {f32({2, 6, 8}), f32({2, 3, 8}), TensorSpec({3}, DType::i32)}));
    // One kernel made by the attention rewrite (src/discovery): it contracts over D and over T. Its
    // sample carries no certificate, so the CPU reference refuses to run it (the executor's check).
    define("flash_attention", OpKind::contraction, {"q", "k", "v", "positions"}, infer_flash_attention,
           sample("flash_attention", {f32({2, 4, 8}), f32({2, 6, 8}), f32({2, 6, 4})}))
        .optional_inputs = 1;
    return ops;
  }();
  return definitions;
}

// Names of ops registered at run time (the table's string_views point here; a deque never moves them).
std::deque<std::string>& registered_names() {
  static std::deque<std::string> names;
  return names;
}

}  // namespace

// The kernels add eps as an f32 literal and round the inverse root to f32, the CPU reference adds it in
// f64. Below f32's smallest normal number (or past its largest) the two part: an eps of 1e-80 is 0 in
// f32, so a row of zeros divides by zero on the GPU (NaN) while the reference's inverse root, 1e40,
// overflows f32 (0 · inf, NaN again; the true value is 0). From FLT_MIN on, 1 / sqrt(eps) <= 9.2e18 is
// a finite f32 and eps is the same number in both.
void check_norm_eps(double eps) {
  if (eps < std::numeric_limits<float>::min() || std::isinf(static_cast<float>(eps))) {
    throw InputError("eps " + number_text(eps) + " is outside f32's normal range (" +
                     number_text(std::numeric_limits<float>::min()) + " .. " + number_text(std::numeric_limits<float>::max()) +
                     "): the norm adds it in f32");
  }
}

// The angle of pair i at position p is p * theta^(-2i/dims); llama3 scaling divides the low frequencies by
// its factor. metile computes it in f64, transformers (the reference users compare with) in f32, so every
// frequency is held to FLT_MAX / 2^31: then p * frequency is a finite f32 for every i32 position. Past it
// the angles overflow (a theta or factor of 5e-324: inf in f64 too, every logit NaN). The largest
// frequency is 1 at theta >= 1 and theta^(-(dims-2)/dims) below it; dividing by a factor under 1 is
// bounded by dividing every frequency by it. No released model comes near (theta 1e4..1e6, factor >= 1).
void check_rope_frequencies(double theta, std::int64_t dims, double factor) {
  constexpr double kLargestFrequency = static_cast<double>(std::numeric_limits<float>::max()) / 2147483648.0;
  const double exponent = -static_cast<double>(dims - 2) / static_cast<double>(dims);
  const double largest = std::max(1.0, std::pow(theta, exponent));
  const double largest_scaled = largest / std::min(1.0, factor);
  const auto limit = [&] {
    return "past " + number_text(kLargestFrequency) + ", where an i32 position's angle would leave f32";
  };
  if (!(largest <= kLargestFrequency)) {
    throw InputError("theta " + number_text(theta) + " is too small: its largest frequency theta^(-" +
                     std::to_string(dims - 2) + "/" + std::to_string(dims) + ") is " + number_text(largest) + ", " +
                     limit());
  }
  if (!(largest_scaled <= kLargestFrequency)) {
    throw InputError("factor " + number_text(factor) + " is too small: frequencies divided by it reach " +
                     number_text(largest_scaled) + ", " + limit());
  }
}

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
  for (const OpDefinition& definition : table()) {
    if (definition.name == name) return &definition;
  }
  return nullptr;
}

std::vector<std::string_view> registered_op_names() {
  std::vector<std::string_view> names;
  for (const OpDefinition& definition : table()) names.push_back(definition.name);
  return names;
}

void register_op(OpDefinition definition) {
  if (definition.name.empty()) throw InputError("register_op: an op needs a name");
  if (find_op(definition.name) != nullptr) {
    throw InputError("register_op: op '" + std::string(definition.name) + "' is already registered");
  }
  if (!definition.infer) throw InputError("register_op: op '" + std::string(definition.name) + "' has no shape rule");
  definition.name = registered_names().emplace_back(definition.name);
  table().push_back(std::move(definition));
}

ElementFunctions bind_elementwise(std::string_view op, const Attributes& attributes, std::span<const TensorSpec> inputs) {
  const OpDefinition* definition = find_op(op);
  if (definition == nullptr || !definition->elementwise) {
    throw InputError("op '" + std::string(op) + "' has no elementwise math");
  }
  return definition->elementwise->bind(attributes, inputs);
}

std::string cuda_elementwise_helpers() {
  std::string helpers;
  for (const OpDefinition& definition : table()) {
    if (definition.elementwise) helpers += definition.elementwise->cuda_helpers;
  }
  return helpers;
}

std::string cuda_float_literal(double value) {
  // Rounded to f32 first: a finite double past f32's range is inf there (printed, "inf.0f").
  const float single = static_cast<float>(value);
  if (std::isnan(single)) return "__int_as_float(0x7fc00000)";
  if (std::isinf(single)) return single > 0 ? "__int_as_float(0x7f800000)" : "__int_as_float(0xff800000)";
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", static_cast<double>(single));
  std::string literal = text;
  if (literal.find_first_of(".e") == std::string::npos) literal += ".0";
  return literal + "f";
}

std::int64_t argmax_index(std::span<const float> row) {
  std::size_t best = 0;
  for (std::size_t index = 1; index < row.size(); ++index) {
    if (std::isnan(row[best])) break;  // the first NaN is the maximum
    if (std::isnan(row[index]) || row[index] > row[best]) best = index;
  }
  return static_cast<std::int64_t>(best);
}

std::vector<double> rope_frequencies(const Attributes& attributes) {
  const double theta = attributes.get_double("theta");
  const std::int64_t dims = attributes.get_int("dims");
  std::vector<double> frequencies(static_cast<std::size_t>(dims / 2));
  for (std::size_t pair = 0; pair < frequencies.size(); ++pair) {
    const double frequency = std::pow(theta, -2.0 * static_cast<double>(pair) / static_cast<double>(dims));
    frequencies[pair] = frequency;
    if (!attributes.has("scaling")) continue;
    // Llama 3's scaling (transformers' _compute_llama3_parameters): long wavelengths slow down by
    // `factor`, short ones stay, the band between blends linearly in context / wavelength.
    const double factor = attributes.get_double("factor");
    const double low = attributes.get_double("low_freq_factor");
    const double high = attributes.get_double("high_freq_factor");
    const double context = attributes.get_double("original_max_position_embeddings");
    const double wavelength = 2 * M_PI / frequency;
    if (wavelength < context / high) continue;
    if (wavelength > context / low) {
      frequencies[pair] = frequency / factor;
      continue;
    }
    const double smooth = (context / wavelength - low) / (high - low);
    frequencies[pair] = (1 - smooth) * frequency / factor + smooth * frequency;
  }
  return frequencies;
}

OpKind op_kind_for(const OpDefinition& definition, std::span<const TensorSpec> inputs, const Attributes& attributes) {
  return definition.node_kind ? definition.node_kind(inputs, attributes) : definition.kind;
}

}  // namespace metile
