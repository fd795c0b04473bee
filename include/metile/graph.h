// metile graph module: the typed tensor graph every other module reads.
// A GraphBuilder records ops (shape and dtype inferred and checked per op);
// build() yields an immutable, verified, topologically ordered ComputeGraph.
// Also here: host tensors (the data on a graph's edges), the op registry,
// JSON graph files, Graphviz DOT and safetensors files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "metile/error.h"

namespace metile {

// ---------------------------------------------------------------- dtypes
enum class DType : std::uint8_t { f16, bf16, f32, i8, u8, i32, u32 };

std::string_view dtype_name(DType dtype);          // "f16", "bf16", ...
DType parse_dtype(std::string_view name);          // throws InputError on unknown names
std::size_t dtype_size(DType dtype);               // bytes per element
bool is_floating(DType dtype);                     // f16, bf16, f32

// Exact IEEE conversions, round to nearest even; NaN stays NaN, overflow goes to inf.
std::uint16_t f32_to_f16_bits(float value);
float f16_bits_to_f32(std::uint16_t bits);
std::uint16_t f32_to_bf16_bits(float value);
float bf16_bits_to_f32(std::uint16_t bits);
// Rounds value to the nearest value representable in dtype (identity for f32;
// integer dtypes round to nearest and saturate).
float round_to_dtype(float value, DType dtype);
// The value a tensor of dtype holds after HostTensor::store(value): a double rounded once, straight to
// the dtype (never through f32 first); overflow goes to inf; integer dtypes round and saturate.
double round_double_to_dtype(double value, DType dtype);

// Why `scale`, a factor the scale op takes (within f32's range, not 0 in f32 unless 0), cannot be a
// flash_attention node's scale, or nullopt. The fused kernels scale by it times log2(e) in f32: past
// f32's range there a score of 0 became NaN on the GPU where the chain gives 0. The op's inference
// and the attention rewrite both ask this.
std::optional<std::string> flash_attention_scale_problem(double scale);
// What the fused attention kernels multiply scores by before exp2: the scale op's f32 factor times
// log2(e), rounded to f32 (the CPU reference scales by the same f32 factor).
float flash_attention_scale_log2(double scale);

// ---------------------------------------------------------------- tensors
struct TensorSpec {
  std::vector<std::int64_t> shape;
  DType dtype = DType::f32;

  TensorSpec() = default;
  TensorSpec(std::vector<std::int64_t> shape_, DType dtype_) : shape(std::move(shape_)), dtype(dtype_) {}

  int rank() const { return static_cast<int>(shape.size()); }
  // Both throw InputError for a negative dimension or a count above int64 (never wrap).
  std::int64_t element_count() const;
  std::int64_t bytes() const;
  std::int64_t row_length() const { return shape.empty() ? 1 : shape.back(); }  // last axis
  std::int64_t row_count() const { return row_length() == 0 ? 0 : element_count() / row_length(); }
  std::string to_string() const;  // "f16[1, 2048]"
  bool operator==(const TensorSpec&) const = default;
};

// Limits every recorded tensor meets (README, "Input limits"): 2^48 elements keeps
// bytes() and every planner cost in picoseconds far from int64 overflow.
inline constexpr std::int64_t kMaximumElements = std::int64_t{1} << 48;
inline constexpr int kMaximumRank = 32;
// Throws InputError "OWNER: ..." for a rank above kMaximumRank, a dimension that is
// not positive, or more than kMaximumElements elements.
void check_tensor_spec(const TensorSpec& spec, std::string_view owner);

// Tensor data on the host, stored in its dtype's bit layout (f16/bf16 as bit
// patterns), row-major. Element access converts through double exactly for
// every dtype; store() rounds to the dtype.
class HostTensor {
 public:
  HostTensor() = default;
  explicit HostTensor(TensorSpec spec);  // zero-filled
  static HostTensor from_values(TensorSpec spec, std::span<const double> values);
  // The tensor whose bytes are `bytes` (exactly spec.bytes() of them, else InputError), copied once:
  // not zero-filled first (a checkpoint's weights are read through this).
  static HostTensor from_bytes(TensorSpec spec, std::span<const std::byte> bytes);

  const TensorSpec& spec() const { return spec_; }
  std::int64_t element_count() const { return spec_.element_count(); }
  std::span<std::byte> bytes() { return data_; }
  std::span<const std::byte> bytes() const { return data_; }

  double at(std::int64_t index) const;
  void store(std::int64_t index, double value);
  std::vector<double> to_values() const;

  bool operator==(const HostTensor&) const = default;  // same spec, same bits

 private:
  TensorSpec spec_;
  std::vector<std::byte> data_;
};

using TensorMap = std::map<std::string, HostTensor, std::less<>>;

// FNV-1a 64 of bytes, the one stable hash of the project (tensor checksums, kernel cache keys,
// per-name random streams): the same value on every platform and run. A non-zero seed is folded
// into the offset basis to derive independent hashes of the same bytes.
std::uint64_t fnv1a_64(std::span<const std::byte> bytes, std::uint64_t seed = 0);
std::uint64_t fnv1a_64(std::string_view text, std::uint64_t seed = 0);

// SplitMix64, the project's seeded random stream (random graph inputs, synthetic
// checkpoints): written out so the same seed gives the same bits with every
// standard library (std::uniform_*_distribution is implementation-defined).
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += kGamma);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // [0, 1) on a grid of 2^-24: exact in f32, so float arithmetic on it is
  // reproducible and rounding to f16/bf16 happens once.
  float unit() { return static_cast<float>(next() >> 40) * 0x1.0p-24f; }
  float uniform(float low, float high) { return low + (high - low) * unit(); }
  std::int64_t integer(std::int64_t low, std::int64_t high) {  // [low, high], small ranges
    return low + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(high - low + 1));
  }
  // Jumps over `draws` draws exactly (the state advances by one constant per draw, modulo
  // 2^64): a thread can start a stream at any index and produce the sequential stream's bits.
  void skip(std::uint64_t draws) { state_ += draws * kGamma; }

 private:
  static constexpr std::uint64_t kGamma = 0x9E3779B97F4A7C15ull;
  std::uint64_t state_;
};

// safetensors files (https://github.com/huggingface/safetensors format):
// 8-byte little-endian header length, JSON header, raw data. Malformed files
// throw InputError naming the file and the problem.
TensorMap read_safetensors(const std::filesystem::path& path);
// The same file mapped read-only into memory: the header is checked exactly as
// read_safetensors checks it, tensor data stays in the page cache and is read in
// place (model checkpoints of many GB are never copied whole).
class MappedSafetensors {
 public:
  struct TensorView {
    TensorSpec spec;
    std::span<const std::byte> bytes;  // little-endian, valid while the file object lives
    HostTensor copy() const;
  };
  explicit MappedSafetensors(const std::filesystem::path& path);
  ~MappedSafetensors();
  MappedSafetensors(const MappedSafetensors&) = delete;
  MappedSafetensors& operator=(const MappedSafetensors&) = delete;
  const std::filesystem::path& path() const { return path_; }
  // The tensors of dtypes metile reads; a tensor of another dtype of the format (I64, BOOL, F64, ...)
  // is in unreadable() (name -> dtype) and refused only when asked for by name.
  const std::map<std::string, TensorView, std::less<>>& tensors() const { return tensors_; }
  const std::map<std::string, std::string, std::less<>>& unreadable() const { return unreadable_; }
  const TensorView* find(std::string_view name) const;  // nullptr if absent; InputError for an unreadable dtype
  bool contains(std::string_view name) const;           // readable or not
  std::vector<std::string> names() const;               // every tensor's, readable or not, sorted

 private:
  void parse_header(std::uint64_t file_bytes);
  std::filesystem::path path_;
  const std::byte* mapping_ = nullptr;
  std::size_t mapped_bytes_ = 0;
  std::map<std::string, TensorView, std::less<>> tensors_;
  std::map<std::string, std::string, std::less<>> unreadable_;
};
// Written by write_output_file (metile/io.h): atomic for regular files, in place for FIFOs and devices.
// Each name is checked by check_safetensors_tensor_name first.
void write_safetensors(const std::filesystem::path& path, const TensorMap& tensors);
// A name write_safetensors can give a tensor in `path`: not "__metadata__" (the header's key for the
// string map), UTF-8 (the header is JSON); an InputError naming the file otherwise. For a check made
// before the work whose tensors the file will hold (`metile run --output`).
void check_safetensors_tensor_name(const std::filesystem::path& path, const std::string& name);

// ---------------------------------------------------------------- attributes
using AttributeValue = std::variant<std::int64_t, double, std::string, std::vector<std::int64_t>>;

// The one attribute that is a flag: transpose_right, stored as 0 or 1, the only one a front end takes
// a boolean for (a JSON true, a Python True); any other refuses one: `"axis": true` is a mistake to
// name, not an axis of 1. The message a front end gives for that mistake is flag_refusal's.
inline bool is_flag_attribute(std::string_view name) { return name == "transpose_right"; }
inline std::string flag_refusal(std::string_view name) {
  return "'" + std::string(name) + "' takes a number, not a boolean (only transpose_right is a flag)";
}

class Attributes {
 public:
  bool has(std::string_view name) const;
  void set(std::string name, AttributeValue value);
  // Typed getters throw InputError when the attribute is missing or has another type
  // (an integer is accepted where a double is asked for).
  std::int64_t get_int(std::string_view name) const;
  double get_double(std::string_view name) const;
  const std::string& get_string(std::string_view name) const;
  const std::vector<std::int64_t>& get_ints(std::string_view name) const;
  const std::map<std::string, AttributeValue, std::less<>>& entries() const { return entries_; }
  bool operator==(const Attributes&) const = default;

 private:
  std::map<std::string, AttributeValue, std::less<>> entries_;
};

// ---------------------------------------------------------------- op table
class ComputeGraph;

// One entry per op holds everything about it (src/graph/op_registry.cpp; docs/architecture.md,
// "The op table"): its kind, shape/dtype rule, the math of an elementwise op (CPU f32 reference,
// float64 oracle and CUDA device expression, used by row kernels and GEMV epilogues alike), the
// math and row-kernel hook of a row reduction, and a sample graph the tests run through every
// backend. The planner reasons about kinds, never op names: adding an elementwise op is one
// entry (register_op) plus its tests.
enum class OpKind : std::uint8_t {
  elementwise,    // one output element from the same-index elements of its inputs (with broadcast)
  row_reduction,  // reduces along the last axis (rms_norm, layer_norm, softmax; sum, mean to [..., 1])
  contraction,    // matmul, quantized_matmul
  layout,         // reshape, transpose, cast, rope
};
std::string_view op_kind_name(OpKind kind);

// Where one element of an output sits: its row (the flat index over every axis but the last)
// and its column (the index along the last axis).
struct ElementSite {
  std::int64_t row = 0;
  std::int64_t column = 0;
};

// The math of one elementwise node with its attributes and input specs bound. `operands` are the
// same-index elements of its inputs (broadcast applied).
struct ElementFunctions {
  // The CPU reference: f32 arithmetic, one rounding per operation (built without contraction).
  std::function<float(std::span<const float> operands, ElementSite site)> f32;
  // The float64 oracle (GEMV epilogue evaluation, the decode MLP's reference).
  std::function<double(std::span<const double> operands, ElementSite site)> f64;
};

// The element's row and column as CUDA expressions of the generated kernel.
struct CudaElementSite {
  std::string row;     // a long long
  std::string column;  // an int
};

struct ElementwiseMath {
  std::function<ElementFunctions(const Attributes& attributes, std::span<const TensorSpec> inputs)> bind;
  // An f32 CUDA expression of the operands' f32 expressions; the same text in row kernels and in
  // GEMV epilogues, so an op computes the same way in every generated kernel.
  std::function<std::string(std::span<const std::string> operands, const CudaElementSite& site,
                            const Attributes& attributes, std::span<const TensorSpec> inputs)>
      cuda;
  std::string cuda_helpers;  // device functions the expression calls (defined in every generated kernel)
  bool reads_site = false;   // depends on the element's position (causal_mask): no GEMV epilogue op
};

// What a row reduction's kernel hook asks of the row-kernel generator (src/codegen/row_kernel.cpp).
// Expressions are f32 CUDA expressions evaluated per element of the row.
class RowKernelSteps {
 public:
  virtual std::string operand(std::size_t input) = 0;  // input i at the current element
  virtual std::string row_length() = 0;                // the row length as an exact integer literal
  // Reduces `expression` over the row with "sum", "max" (f32) or "sum_f64" (a double sum); returns the
  // per-row scalar's name.
  virtual std::string reduce(std::string_view op, std::string expression, std::string_view what) = 0;
  // A per-row scalar computed from earlier ones; returns its name.
  virtual std::string scalar(std::string expression) = 0;
  // The output: one value per element (the row keeps its length) or one per row ([..., 1]).
  virtual void element_result(std::string expression) = 0;
  virtual void row_result(std::string expression) = 0;

 protected:
  ~RowKernelSteps() = default;
};

struct RowReductionMath {
  // The CPU reference of one row: operands[i] is input i's row (a weight's one broadcast row),
  // `out` the output row (as long as the input row, or 1). f32 element math (layer_norm centres and
  // normalizes in f64), f64 accumulation; the
  // executor rounds each value of `out` once to the output dtype (a sum's f64 total straight to it).
  using RowFunction = std::function<void(std::span<const std::span<const float>> operands, std::span<double> out)>;
  std::function<RowFunction(const Attributes& attributes)> bind;
  // The row-kernel hook: the steps of one node, in order.
  std::function<void(RowKernelSteps& steps, const Attributes& attributes)> row_kernel;
};

struct OpDefinition {
  std::string_view name;
  OpKind kind;
  std::vector<std::string_view> input_names;  // e.g. {"x", "weight"}
  // Checks inputs and attributes, fills in defaulted attributes, and returns
  // the output specs. Throws InputError with a message that does not repeat
  // the node name (the builder prefixes it).
  std::function<std::vector<TensorSpec>(std::span<const TensorSpec> inputs, Attributes& attributes)> infer;
  // The kind of one node when it depends on its attributes (a softmax over a
  // non-last axis is not a row reduction and reports `layout`); empty: `kind`.
  std::function<OpKind(std::span<const TensorSpec> inputs, const Attributes& attributes)> node_kind;
  std::optional<ElementwiseMath> elementwise;      // elementwise ops
  std::optional<RowReductionMath> row_reduction;   // row reductions (softmax: over its `axis`)
  // A small graph using the op (f32 unless the op says otherwise), which the tests run through
  // JSON, the CPU reference, the planner and, for row ops, the NVRTC-compiled row kernel.
  std::function<ComputeGraph()> sample_graph;
  // How many trailing input_names may be left out (flash_attention's positions).
  std::size_t optional_inputs = 0;
};
// The kind a node of this op with these (inferred) inputs and attributes has.
OpKind op_kind_for(const OpDefinition& definition, std::span<const TensorSpec> inputs,
                   const Attributes& attributes);
const OpDefinition* find_op(std::string_view name);  // nullptr if unknown
// rms_norm's and layer_norm's eps: InputError unless it is a normal f32 (the kernels add it in f32).
void check_norm_eps(double eps);
// rope's theta, rotated dims and llama3 factor (1 when unscaled): InputError where a frequency, divided by
// the factor, would make the angle of some i32 position leave f32's range (transformers computes it in f32;
// far enough past, metile's f64 angles are inf too and every logit NaN).
void check_rope_frequencies(double theta, std::int64_t dims, double factor);
std::vector<std::string_view> registered_op_names();
// Adds an op to the table (its name must be new; InputError otherwise). The name's characters are
// copied, so a definition built from a temporary string is fine. Not thread-safe with lookups.
void register_op(OpDefinition definition);
// The bound math of a registered elementwise op (InputError when the op is not elementwise).
ElementFunctions bind_elementwise(std::string_view op, const Attributes& attributes = {},
                                  std::span<const TensorSpec> inputs = {});
// The device functions of every registered elementwise op, for generated kernels' preludes.
std::string cuda_elementwise_helpers();
// rope's angle per position unit for each rotated pair (dims / 2 of them), from a rope node's
// attributes: theta^(-2i/dims), with Llama 3's frequency scaling when "scaling" is set. The CPU
// reference and the native kernel both take their angles from it.
std::vector<double> rope_frequencies(const Attributes& attributes);
// A CUDA f32 literal that reads back to the same float ("1.00000001e-05f"; inf and NaN as bit patterns).
std::string cuda_float_literal(double value);
// argmax's rule, the one place it is written (the CPU reference of the op, greedy decoding on the
// host): the index of the largest value, ties to the lowest index; a NaN counts as larger than any
// number (the first NaN wins, as in NumPy and PyTorch); -0 and +0 are equal. 0 for an empty row.
std::int64_t argmax_index(std::span<const float> row);

// ---------------------------------------------------------------- graph
using ValueId = std::int32_t;
using NodeId = std::int32_t;

struct Value {
  ValueId id = -1;
  std::string name;      // unique in the graph; a node's single output has the node's name, else "node:i"
  TensorSpec spec;
  NodeId producer = -1;  // -1 for a graph input
  int output_index = 0;
  bool operator==(const Value&) const = default;
};

struct Node {
  NodeId id = -1;
  std::string name;  // unique in the graph
  std::string op;
  OpKind kind = OpKind::elementwise;
  std::vector<ValueId> inputs;
  std::vector<ValueId> outputs;
  Attributes attributes;
  bool operator==(const Node&) const = default;
};

// Immutable once built. Node ids are positions in nodes(), which are in a
// topological order; value ids are positions in values().
class ComputeGraph {
 public:
  const std::vector<Value>& values() const { return values_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<ValueId>& inputs() const { return inputs_; }
  const std::vector<ValueId>& outputs() const { return outputs_; }
  const Value& value(ValueId id) const { return values_.at(static_cast<std::size_t>(id)); }
  const Node& node(NodeId id) const { return nodes_.at(static_cast<std::size_t>(id)); }
  const std::vector<NodeId>& consumers(ValueId id) const { return consumers_.at(static_cast<std::size_t>(id)); }
  bool is_output(ValueId id) const;
  std::optional<ValueId> find_value(std::string_view name) const;
  std::optional<NodeId> find_node(std::string_view name) const;
  // The same inputs, nodes (in order: name, op, kind, attributes, operands and results) and outputs,
  // each value by its name and spec: value ids aside (a file lists inputs first, a builder need not).
  bool operator==(const ComputeGraph& other) const;

 private:
  friend class GraphBuilder;
  std::vector<Value> values_;
  std::vector<Node> nodes_;
  std::vector<ValueId> inputs_;
  std::vector<ValueId> outputs_;
  std::vector<std::vector<NodeId>> consumers_;
  std::vector<bool> value_is_output_;  // derived from outputs_ at build(), so is_output is O(1)
};

// ---------------------------------------------------------------- buffer aliasing
// For each value, the value whose device buffer it uses: itself when it owns one. A reshape's
// output, and a transpose's that only moves axes of size 1, share their input's buffer (chains
// resolve to the first owner); a kv_cache_write's output shares its cache's buffer (the write
// happens in place) when no other node reads that buffer and no value in it is a graph output.
// Values marked in `owns_buffer` (e.g. caller-owned external buffers) always own theirs.
std::vector<ValueId> alias_of(const ComputeGraph& graph, const std::vector<bool>& owns_buffer = {});
// A transpose whose permutation keeps every axis longer than one in order (the bytes do not move).
bool transpose_moves_only_unit_axes(const ComputeGraph& graph, const Node& node);
// A reshape, or such a transpose: its output is its input's bytes (alias_of makes it a view, and its
// native step launches nothing).
bool is_view_of_its_input(const ComputeGraph& graph, const Node& node);

// A value recorded by a GraphBuilder (only meaningful with that builder).
struct ValueRef {
  ValueId id = -1;
  // The GraphBuilder that recorded it, so a value used with another builder is
  // reported; 0 (a ref made from a bare id) is only range-checked.
  std::uint64_t builder_id = 0;
  bool operator==(const ValueRef&) const = default;
};

// Records ops; every method checks its inputs and throws InputError naming the
// node ("node 'normalized' (rms_norm): weight f16[1024] does not match ...").
// An empty name gets a fresh one: the op name with a counter ("add_0").
class GraphBuilder {
 public:
  GraphBuilder() = default;
  // A copy (a graph forked after a shared prefix) takes the values recorded so far and records on its
  // own from there: a value either one records later is "a value of another GraphBuilder" to the
  // other, never the other's value of the same id. A move hands the values over and leaves the
  // moved-from builder a new, empty one.
  GraphBuilder(const GraphBuilder& other);
  GraphBuilder& operator=(const GraphBuilder& other);
  GraphBuilder(GraphBuilder&& other) noexcept;
  GraphBuilder& operator=(GraphBuilder&& other) noexcept;

  ValueRef input(std::string name, TensorSpec spec);

  ValueRef add(ValueRef a, ValueRef b, std::string name = {});
  ValueRef subtract(ValueRef a, ValueRef b, std::string name = {});
  ValueRef multiply(ValueRef a, ValueRef b, std::string name = {});
  ValueRef scale(ValueRef x, double factor, std::string name = {});
  ValueRef silu(ValueRef x, std::string name = {});
  ValueRef gelu(ValueRef x, std::string approximate = "none", std::string name = {});
  ValueRef exp(ValueRef x, std::string name = {});
  ValueRef rms_norm(ValueRef x, ValueRef weight, double eps, std::string name = {});
  ValueRef layer_norm(ValueRef x, ValueRef weight, ValueRef bias, double eps, std::string name = {});
  ValueRef softmax(ValueRef x, std::int64_t axis = -1, std::string name = {});
  ValueRef sum(ValueRef x, std::string name = {});   // over the last axis, to [..., 1]
  ValueRef mean(ValueRef x, std::string name = {});  // over the last axis, to [..., 1]
  // i32 index of each row's maximum over the last axis, [..., L] to [...] (argmax_index's rule).
  ValueRef argmax(ValueRef x, std::string name = {});
  ValueRef causal_mask(ValueRef x, std::int64_t offset = 0, std::string name = {});
  // x [..., R, T], positions i32 [S] with R a multiple of S: row r sees key j only where
  // j <= positions[r mod S]; the rest is -inf.
  ValueRef position_mask(ValueRef x, ValueRef positions, std::string name = {});
  ValueRef matmul(ValueRef a, ValueRef b, bool transpose_right = false, std::string name = {});
  ValueRef quantized_matmul(ValueRef x, ValueRef packed, ValueRef scales, ValueRef biases, int bits,
                            int group_size, std::string name = {});
  ValueRef rope(ValueRef x, ValueRef positions, double theta, std::int64_t dims, std::string name = {});
  // The decode-step ops (src/model): a table row gather, its quantized form and the
  // KV-cache write (semantics in src/graph/op_registry.cpp); position_mask is above.
  ValueRef embedding(ValueRef ids, ValueRef table, std::string name = {});
  ValueRef quantized_embedding(ValueRef ids, ValueRef packed, ValueRef scales, ValueRef biases, int bits,
                               int group_size, std::string name = {});
  ValueRef kv_cache_write(ValueRef cache, ValueRef update, ValueRef positions, std::string name = {});
  ValueRef reshape(ValueRef x, std::vector<std::int64_t> shape, std::string name = {});
  ValueRef transpose(ValueRef x, std::vector<std::int64_t> perm, std::string name = {});
  ValueRef cast(ValueRef x, DType dtype, std::string name = {});

  // The generic entry every method above goes through (and the JSON reader).
  std::vector<ValueRef> add_node(std::string_view op, std::vector<ValueRef> inputs, Attributes attributes,
                                 std::string name = {});

  const TensorSpec& spec(ValueRef value) const;
  const std::string& name(ValueRef value) const;
  // Renames a value before build (its node too, for single-output nodes); used by
  // front ends that learn names late. Throws InputError on a duplicate name.
  void rename(ValueRef value, std::string name);

  // Outputs must be values of this builder, each listed once. Nodes that no
  // output depends on are kept (they are part of what the user recorded).
  ComputeGraph build(const std::vector<ValueRef>& outputs) const;

 private:
  const Value& checked_value(ValueRef value, std::string_view role) const;
  std::string fresh_name(std::string_view op) const;
  void claim_name(const std::string& name, std::string owner);

  ComputeGraph graph_;
  std::map<std::string, int, std::less<>> name_counters_;
  std::map<std::string, std::string, std::less<>> name_owners_;  // name -> "input 'x'" / "node 'y' (add)"
  // The builders this one was copied from (through copies of copies), each with how many values it
  // had then: their values below that count are this builder's too.
  std::vector<std::pair<std::uint64_t, std::size_t>> copied_from_;
  std::uint64_t builder_id_ = next_builder_id();
  static std::uint64_t next_builder_id();
};

// ---------------------------------------------------------------- scheduling
// The one topological sort and cycle check of the tree (docs/architecture.md, "Layering"): graph
// JSON sorts its nodes with it, the plan executor and the GPU Executable order their kernels with
// it, the planner checks its kernel graph with it, and the plan checks of the tests use it.
struct Schedule {
  std::vector<std::size_t> order;  // each vertex after every vertex it waits on; all of them when acyclic
  std::vector<std::size_t> cycle;  // empty when acyclic; else one cycle: each waits on the next, the last on the first
  bool acyclic() const { return cycle.empty(); }
};

// Kahn's algorithm over `waits_on[v]` (the vertices v must follow; repeats allowed), always taking
// the ready vertex of the smallest `priority` (ties and an empty span: the smallest index), so
// vertices already in order keep it. The cycle is walked from the smallest unordered vertex along
// the first unordered vertex each waits on. O(V log V + E).
Schedule schedule(std::span<const std::vector<std::size_t>> waits_on, std::span<const std::int64_t> priority = {});

// Disjoint node sets as kernels: per kernel, the other kernels it reads a value from, ascending.
// A node in no kernel counts as computed before every kernel (its edges are not followed).
// Throws std::invalid_argument when a node is out of range or in two kernels.
std::vector<std::vector<std::size_t>> kernel_dependencies(const ComputeGraph& graph,
                                                          std::span<const std::vector<NodeId>> kernels);
// The kernels in an order where each runs after those it reads from, the one whose first (smallest)
// node comes first when several are ready; or, when they wait on each other, a cycle of kernels.
Schedule schedule_kernels(const ComputeGraph& graph, std::span<const std::vector<NodeId>> kernels);

// ---------------------------------------------------------------- dead nodes
// Per node id: whether a graph output depends on it, directly or through other nodes. A node no
// output depends on computes nothing the graph returns (a value recorded and never used).
std::vector<bool> nodes_outputs_depend_on(const ComputeGraph& graph);
// The graph without the nodes no output depends on (src/graph/dead_nodes.cpp): the same inputs (an
// input only those nodes read stays one: the inputs are the graph's interface), outputs and names,
// recorded again in their order (ids are those of `graph` less the removed ones; `graph` itself when
// none is). `removed`, where given, receives those nodes' ids in `graph`, ascending. plan_with_discovery plans
// this graph, so the GPU runs no kernel for them; run_reference still computes every node.
ComputeGraph without_dead_nodes(const ComputeGraph& graph, std::vector<NodeId>* removed = nullptr);

// ---------------------------------------------------------------- files
// JSON graph files (format in docs/architecture.md). Errors name the source and the JSON
// path: "graph.json: /nodes/1/inputs/0: unknown value 'sumed'".
ComputeGraph read_graph(const std::filesystem::path& path);
ComputeGraph parse_graph_json(std::string_view text, std::string_view source_name = "<string>");
std::string write_graph_json(const ComputeGraph& graph);  // parse_graph_json(write_graph_json(g)) == g
std::string graph_to_dot(const ComputeGraph& graph);

}  // namespace metile
