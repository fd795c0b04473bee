// The CPU reference executor's ops: contractions and layout ops here, elementwise ops and row
// reductions from the op table's math (src/graph/op_registry.cpp).
//
// Numerics, chosen so that a GPU kernel computing in f32 lands within a few
// f32 ulps of this code before its result is rounded to the output dtype:
//   * inputs are read exactly (f16/bf16 widen to f32 without loss);
//   * per-element math is f32, one operation at a time (the library is built
//     with -ffp-contract=off so a*b+c never silently becomes one fma);
//   * reductions (rms_norm and layer_norm statistics, softmax sums) and
//     contractions (matmul, quantized_matmul) accumulate in f64 in index order;
//     products of two f32 values are exact in f64;
//   * every result is rounded once to its value's dtype (HostTensor::store).
// Intermediates between nodes are stored in their dtype, exactly as a backend
// that materialises them would see them.
#include "reference_ops.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>

#include "metile/discovery.h"
#include "metile/quant.h"
#include "tensor_access.h"

namespace metile::cpu {
namespace {

struct OpCall {
  const Node& node;
  std::span<const HostTensor* const> inputs;
  const TensorSpec& output;
  const HostTensor& input(std::size_t index) const { return *inputs[index]; }
};

HostTensor store_values(const TensorSpec& spec, const std::vector<float>& values) {
  HostTensor tensor(spec);
  write_floats(tensor, 0, values);
  return tensor;
}

// f64 results (contractions) round straight to the dtype, never through f32.
HostTensor store_values(const TensorSpec& spec, const std::vector<double>& values) {
  HostTensor tensor(spec);
  for (std::size_t index = 0; index < values.size(); ++index)
    tensor.store(static_cast<std::int64_t>(index), values[index]);
  return tensor;
}

// Elementwise ops: the op table's f32 math per element. An input with fewer elements than the
// output has a suffix of its shape (or none, []), so in row-major order it simply repeats.
HostTensor evaluate_elementwise(const OpCall& call, const ElementwiseMath& math) {
  std::vector<TensorSpec> input_specs;
  std::vector<std::vector<float>> inputs;
  for (const HostTensor* input : call.inputs) {
    input_specs.push_back(input->spec());
    inputs.push_back(load_floats(*input));
  }
  const ElementFunctions functions = math.bind(call.node.attributes, input_specs);
  const std::int64_t columns = call.output.row_length();
  std::vector<float> values(static_cast<std::size_t>(call.output.element_count()));
  std::vector<float> operands(inputs.size());
  for (std::size_t index = 0; index < values.size(); ++index) {
    for (std::size_t input = 0; input < inputs.size(); ++input) operands[input] = inputs[input][index % inputs[input].size()];
    const auto flat = static_cast<std::int64_t>(index);
    values[index] = functions.f32(operands, ElementSite{flat / columns, flat % columns});
  }
  return store_values(call.output, values);
}

// Row r of x [..., R, T] sees key j only where j <= positions[r mod S].
HostTensor evaluate_position_mask(const OpCall& call) {
  const HostTensor& positions = call.input(1);
  const std::int64_t steps = positions.element_count();
  const std::int64_t columns = call.output.shape.back();
  const std::int64_t rows = call.output.shape[call.output.shape.size() - 2];
  std::vector<float> values = load_floats(call.input(0));
  for (std::size_t index = 0; index < values.size(); ++index) {
    const std::int64_t column = static_cast<std::int64_t>(index) % columns;
    const std::int64_t row = static_cast<std::int64_t>(index) / columns % rows;
    if (static_cast<double>(column) > positions.at(row % steps)) values[index] = -std::numeric_limits<float>::infinity();
  }
  return store_values(call.output, values);
}

// flash_attention evaluated with the law it is certified by (src/discovery): per query row, the
// scores s_j = scale * q.k_j (f64 dot products of the f32 inputs) of the visible keys are lifted
// with their value rows and merged in blocks of kKeyBlock keys, the block states merged in order,
// and the state finalized (o / l). Masked keys are skipped: they contribute the identity. A row with
// no visible key finalizes the identity, 0 / 0 = NaN, as softmax over an all -inf row does.
HostTensor evaluate_flash_attention(const OpCall& call) {
  constexpr std::int64_t kKeyBlock = 64;
  constexpr std::string_view law_name = "stable_weighted_softmax";
  require_verified_certificate(call.node, law_name);
  const LawEvaluator law(*find_law(law_name), call.input(2).spec().shape.back());
  const TensorSpec& q_spec = call.input(0).spec();
  const std::size_t rank = q_spec.shape.size();
  const std::int64_t rows = q_spec.shape[rank - 2];
  const std::int64_t depth = q_spec.shape[rank - 1];
  const std::int64_t keys = call.input(1).spec().shape[rank - 2];
  const std::int64_t value_width = call.input(2).spec().shape[rank - 1];
  const std::int64_t batches = rows == 0 ? 0 : q_spec.element_count() / (rows * depth);
  const double scale = call.node.attributes.get_double("scale");
  const std::string& mask = call.node.attributes.get_string("mask");
  const std::int64_t offset = call.node.attributes.get_int("offset");
  const std::vector<float> q = load_floats(call.input(0));
  const std::vector<float> k = load_floats(call.input(1));
  const std::vector<float> v = load_floats(call.input(2));
  std::vector<double> out(static_cast<std::size_t>(batches * rows * value_width));
  std::vector<double> element(law.element_size());
  std::vector<double> lifted(law.state_size());
  std::vector<double> result(static_cast<std::size_t>(value_width));
  for (std::int64_t batch = 0; batch < batches; ++batch) {
    for (std::int64_t row = 0; row < rows; ++row) {
      std::int64_t last_visible = keys - 1;
      if (mask == "causal") last_visible = row + offset;
      if (mask == "positions") {
        const HostTensor& positions = call.input(3);
        last_visible = static_cast<std::int64_t>(positions.at(row % positions.element_count()));
      }
      const float* q_row = q.data() + (batch * rows + row) * depth;
      std::vector<double> total = law.identity();
      for (std::int64_t first = 0; first < keys; first += kKeyBlock) {
        std::vector<double> block = law.identity();
        for (std::int64_t key = first; key < std::min(keys, first + kKeyBlock); ++key) {
          if (key > last_visible) continue;
          const float* k_row = k.data() + (batch * keys + key) * depth;
          double dot = 0;
          for (std::int64_t d = 0; d < depth; ++d) dot += static_cast<double>(q_row[d]) * k_row[d];
          element[0] = scale * dot;
          const float* v_row = v.data() + (batch * keys + key) * value_width;
          for (std::int64_t lane = 0; lane < value_width; ++lane) element[static_cast<std::size_t>(1 + lane)] = v_row[lane];
          law.lift(element, lifted);
          law.merge_into(block, lifted);
        }
        law.merge_into(total, block);
      }
      law.finalize(total, result);
      std::copy(result.begin(), result.end(), out.begin() + (batch * rows + row) * value_width);
    }
  }
  return store_values(call.output, out);
}

// Row reductions: the op table's per-row math over the last axis, or over the node's `axis`
// (softmax), whose strided slices are gathered into a row and scattered back. Inputs after the
// first (a norm's weight and bias) are one row every row shares.
HostTensor evaluate_row_reduction(const OpCall& call, const RowReductionMath& math) {
  const TensorSpec& x_spec = call.input(0).spec();
  const std::size_t last = x_spec.shape.size() - 1;
  const std::size_t axis =
      call.node.attributes.has("axis") ? static_cast<std::size_t>(call.node.attributes.get_int("axis")) : last;
  std::int64_t outer = 1;
  std::int64_t inner = 1;
  for (std::size_t dim = 0; dim < axis; ++dim) outer *= x_spec.shape[dim];
  for (std::size_t dim = axis + 1; dim < x_spec.shape.size(); ++dim) inner *= x_spec.shape[dim];
  const std::int64_t length = x_spec.shape[axis];
  const std::int64_t out_length = call.output.shape[axis];
  const std::vector<float> x = load_floats(call.input(0));
  std::vector<std::vector<float>> shared_rows;
  for (std::size_t input = 1; input < call.inputs.size(); ++input) shared_rows.push_back(load_floats(call.input(input)));
  const RowReductionMath::RowFunction row_function = math.bind(call.node.attributes);
  std::vector<float> out(static_cast<std::size_t>(call.output.element_count()));
  std::vector<float> row(static_cast<std::size_t>(length));
  std::vector<float> out_row(static_cast<std::size_t>(out_length));
  std::vector<std::span<const float>> operands{row};
  for (const std::vector<float>& shared : shared_rows) operands.emplace_back(shared);
  for (std::int64_t before = 0; before < outer; ++before) {
    for (std::int64_t after = 0; after < inner; ++after) {
      for (std::int64_t position = 0; position < length; ++position) {
        row[static_cast<std::size_t>(position)] = x[static_cast<std::size_t>((before * length + position) * inner + after)];
      }
      row_function(operands, out_row);
      for (std::int64_t position = 0; position < out_length; ++position) {
        out[static_cast<std::size_t>((before * out_length + position) * inner + after)] = out_row[static_cast<std::size_t>(position)];
      }
    }
  }
  return store_values(call.output, out);
}

// a [..., M, K] times b [..., K, N] (or [..., N, K] with transpose_right); a
// rank-2 b is shared by every batch. Dot products in f64, k ascending. b is
// read one row of b^T at a time, so a large weight is never copied whole.
HostTensor evaluate_matmul(const OpCall& call) {
  const TensorSpec& a_spec = call.input(0).spec();
  const HostTensor& b = call.input(1);
  const bool transpose_right = call.node.attributes.get_int("transpose_right") != 0;
  const std::int64_t m = a_spec.shape[a_spec.shape.size() - 2];
  const std::int64_t k = a_spec.shape.back();
  const std::int64_t n = call.output.shape.back();
  const std::int64_t batches = m * k == 0 ? 0 : a_spec.element_count() / (m * k);
  const bool b_is_batched = b.spec().rank() > 2;
  const std::vector<float> a = load_floats(call.input(0));
  // Without transpose_right, b^T's rows are columns of b: transpose one batch of b once.
  std::vector<float> b_batch;
  std::vector<float> b_row(static_cast<std::size_t>(k));
  std::vector<double> out(static_cast<std::size_t>(batches * m * n));
  for (std::int64_t batch = 0; batch < batches; ++batch) {
    const std::int64_t b_first = b_is_batched ? batch * k * n : 0;
    if (!transpose_right && (batch == 0 || b_is_batched)) {
      b_batch.resize(static_cast<std::size_t>(k * n));
      read_floats(b, b_first, b_batch);
    }
    for (std::int64_t column = 0; column < n; ++column) {
      if (transpose_right) {
        read_floats(b, b_first + column * k, b_row);
      } else {
        for (std::int64_t depth = 0; depth < k; ++depth) {
          b_row[static_cast<std::size_t>(depth)] = b_batch[static_cast<std::size_t>(depth * n + column)];
        }
      }
      for (std::int64_t row = 0; row < m; ++row) {
        const float* a_row = a.data() + (batch * m + row) * k;
        double sum = 0;
        for (std::int64_t depth = 0; depth < k; ++depth) {
          sum += static_cast<double>(a_row[depth]) * b_row[static_cast<std::size_t>(depth)];
        }
        out[static_cast<std::size_t>((batch * m + row) * n + column)] = sum;
      }
    }
  }
  return store_values(call.output, out);
}

// y = x . dequant(W)^T, W [N, K] dequantized one row at a time in f32 (the
// same values dequantize_affine gives), dot products in f64, k ascending.
HostTensor evaluate_quantized_matmul(const OpCall& call) {
  const AffineQuantization format{static_cast<int>(call.node.attributes.get_int("bits")),
                                  static_cast<int>(call.node.attributes.get_int("group_size"))};
  const QuantizedMatrix weight =
      QuantizedMatrix::from_tensors(format, call.input(1), call.input(2), call.input(3));
  const std::vector<float> x = load_floats(call.input(0));
  const std::int64_t k = weight.columns;
  const std::int64_t n = weight.rows;
  const std::int64_t rows = static_cast<std::int64_t>(x.size()) / k;
  std::vector<double> out(static_cast<std::size_t>(rows * n));
  std::vector<float> weight_row(static_cast<std::size_t>(k));
  for (std::int64_t column = 0; column < n; ++column) {
    dequantize_affine_row(weight, column, weight_row);
    for (std::int64_t row = 0; row < rows; ++row) {
      const float* x_row = x.data() + row * k;
      double sum = 0;
      for (std::int64_t depth = 0; depth < k; ++depth) {
        sum += static_cast<double>(x_row[depth]) * weight_row[static_cast<std::size_t>(depth)];
      }
      out[static_cast<std::size_t>(row * n + column)] = sum;
    }
  }
  return store_values(call.output, out);
}

// Rotate-half rotary embedding (Llama, MLX traditional=False) over the first
// `dims` elements of each row of x [..., S, D]: element i pairs with i + dims/2
// and turns by position * theta^(-2i/dims). The angles and their cos/sin are
// computed in f64 and rounded to f32 (they depend on no tensor data, so a GPU
// kernel may take them from a table); the rotation itself is f32.
HostTensor evaluate_rope(const OpCall& call) {
  const double theta = call.node.attributes.get_double("theta");
  const std::int64_t dims = call.node.attributes.get_int("dims");
  const std::int64_t half = dims / 2;
  const std::int64_t length = call.output.shape.back();
  const std::int64_t sequence = call.output.shape[call.output.shape.size() - 2];
  const HostTensor& positions = call.input(1);
  std::vector<float> cosines(static_cast<std::size_t>(sequence * half));
  std::vector<float> sines(cosines.size());
  for (std::int64_t step = 0; step < sequence; ++step) {
    for (std::int64_t pair = 0; pair < half; ++pair) {
      const double frequency = std::pow(theta, -2.0 * static_cast<double>(pair) / static_cast<double>(dims));
      const double angle = positions.at(step) * frequency;
      cosines[static_cast<std::size_t>(step * half + pair)] = static_cast<float>(std::cos(angle));
      sines[static_cast<std::size_t>(step * half + pair)] = static_cast<float>(std::sin(angle));
    }
  }
  std::vector<float> x = load_floats(call.input(0));
  for (std::size_t first = 0; first < x.size(); first += static_cast<std::size_t>(length)) {
    const std::int64_t step = static_cast<std::int64_t>(first) / length % sequence;
    for (std::int64_t pair = 0; pair < half; ++pair) {
      const float cosine = cosines[static_cast<std::size_t>(step * half + pair)];
      const float sine = sines[static_cast<std::size_t>(step * half + pair)];
      float& low = x[first + static_cast<std::size_t>(pair)];
      float& high = x[first + static_cast<std::size_t>(pair + half)];
      const float low_cosine = low * cosine;
      const float high_sine = high * sine;
      const float low_sine = low * sine;
      const float high_cosine = high * cosine;
      low = low_cosine - high_sine;
      high = low_sine + high_cosine;
    }
  }
  return store_values(call.output, x);
}

HostTensor evaluate_reshape(const OpCall& call) {
  HostTensor out(call.output);
  std::memcpy(out.bytes().data(), call.input(0).bytes().data(), out.bytes().size());
  return out;
}

HostTensor evaluate_transpose(const OpCall& call) {
  const TensorSpec& in_spec = call.input(0).spec();
  const std::vector<std::int64_t>& perm = call.node.attributes.get_ints("perm");
  const std::size_t rank = perm.size();
  std::vector<std::int64_t> in_strides(rank, 1);
  for (std::size_t axis = rank; axis-- > 1;) in_strides[axis - 1] = in_strides[axis] * in_spec.shape[axis];
  HostTensor out(call.output);
  const std::size_t element_size = dtype_size(call.output.dtype);
  const std::byte* source = call.input(0).bytes().data();
  std::byte* target = out.bytes().data();
  std::vector<std::int64_t> out_index(rank, 0);
  for (std::int64_t flat = 0; flat < out.element_count(); ++flat) {
    std::int64_t in_flat = 0;
    for (std::size_t axis = 0; axis < rank; ++axis) {
      in_flat += out_index[axis] * in_strides[static_cast<std::size_t>(perm[axis])];
    }
    std::memcpy(target + static_cast<std::size_t>(flat) * element_size,
                source + static_cast<std::size_t>(in_flat) * element_size, element_size);
    for (std::size_t axis = rank; axis-- > 0;) {  // odometer over the output shape
      if (++out_index[axis] < call.output.shape[axis]) break;
      out_index[axis] = 0;
    }
  }
  return out;
}

// Exact read, one rounding to the target dtype (integers: nearest, saturating).
HostTensor evaluate_cast(const OpCall& call) {
  HostTensor out(call.output);
  for (std::int64_t index = 0; index < out.element_count(); ++index)
    out.store(index, call.input(0).at(index));
  return out;
}

using Evaluator = HostTensor (*)(const OpCall&);

// Contractions and layout ops; elementwise ops and row reductions come from the op table.
const std::unordered_map<std::string_view, Evaluator>& evaluators() {
  static const std::unordered_map<std::string_view, Evaluator> table = {
      {"matmul", evaluate_matmul},       {"quantized_matmul", evaluate_quantized_matmul},
      {"rope", evaluate_rope},           {"reshape", evaluate_reshape},
      {"transpose", evaluate_transpose}, {"cast", evaluate_cast},
      {"position_mask", evaluate_position_mask}, {"flash_attention", evaluate_flash_attention},
  };
  return table;
}

}  // namespace

std::vector<HostTensor> evaluate_reference_node(const Node& node, std::span<const HostTensor* const> inputs,
                                                std::span<const TensorSpec> output_specs) {
  if (output_specs.size() != 1) {
    throw std::logic_error(fmt::format("node '{}' ({}): expected one output, the graph has {}", node.name,
                                       node.op, output_specs.size()));
  }
  const OpCall call{node, inputs, output_specs[0]};
  const OpDefinition* definition = find_op(node.op);
  std::vector<HostTensor> outputs;
  if (const auto evaluator = evaluators().find(node.op); evaluator != evaluators().end()) {
    outputs.push_back(evaluator->second(call));
  } else if (definition != nullptr && definition->elementwise) {
    outputs.push_back(evaluate_elementwise(call, *definition->elementwise));
  } else if (definition != nullptr && definition->row_reduction) {
    outputs.push_back(evaluate_row_reduction(call, *definition->row_reduction));
  } else {
    throw InputError(fmt::format("node '{}': the CPU reference has no op '{}'", node.name, node.op));
  }
  return outputs;
}

}  // namespace metile::cpu
