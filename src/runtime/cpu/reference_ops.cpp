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

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>

#include "metile/discovery.h"
#include "metile/quant.h"
#include "parallel.h"
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

// flash_attention evaluated with the law it is certified by (src/discovery): per query row, the
// scores s_j = scale * q.k_j (f64 dot products of the f32 inputs) of the visible keys are lifted
// with their value rows and merged in blocks of kKeyBlock keys, the block states merged in order,
// and the state finalized (o / l). Masked keys are skipped: they contribute the identity. A row with
// no visible key finalizes the identity, 0 / 0 = NaN, as softmax over an all -inf row does.
// Overflow as the chain has it: the chain stores q.k in the dtype (f16's largest value, 65504, is
// within reach of real activations; from 65520 on a value rounds to inf), then its scale op multiplies
// that stored value in f32 and stores the product; a row holding +inf is NaN. Where either stored
// value is infinite the score here is that infinity; otherwise it stays the unrounded scale * q.k (the
// numeric gate covers that rounding). The rewrite takes one scale op: between two, the chain rounds.
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
  // The scale op's factor, which multiplies in f32: the chain's function is x * f32(factor), so a scale
  // f32 cannot hold (1/sqrt(96), 1 + 2^-25) scales by its f32 value here too (with the double the rewrite
  // differed from the chain it replaced by up to tens of f32 ulps); the kernels start from the same f32
  // factor and fold it with log2(e) into one f32 (flash_attention_scale_log2).
  const double scale = static_cast<float>(call.node.attributes.get_double("scale"));
  const DType score_dtype = q_spec.dtype;
  const auto score_as_the_chain_overflows = [score_dtype, scale](double dot) {
    const double stored = round_double_to_dtype(dot, score_dtype);
    if (std::isinf(stored)) return stored * scale;  // the scale op's f32 product of an infinity
    const double scaled =
        round_double_to_dtype(static_cast<double>(static_cast<float>(stored) * static_cast<float>(scale)), score_dtype);
    return std::isinf(scaled) ? scaled : scale * dot;
  };
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
      // Saturated: an offset of +-2^63 must not overflow row + offset (causal_mask, which compares
      // key - row with the offset, cannot); beyond the keys every key, or none, is visible.
      if (mask == "causal") last_visible = offset >= keys ? keys - 1 : offset <= -(rows + keys) ? -1 : row + offset;
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
          element[0] = score_as_the_chain_overflows(dot);
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
// first (a norm's weight and bias) are one row every row shares. The row's f64 results are rounded
// once to the output dtype.
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
  std::vector<double> out(static_cast<std::size_t>(call.output.element_count()));
  std::vector<float> row(static_cast<std::size_t>(length));
  std::vector<double> out_row(static_cast<std::size_t>(out_length));
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

// Eight dot products at once: x [K] with the eight weight rows stored interleaved,
// w[d * 8 + j] = row j, element d. Each lane of the two vectors is one row's sum,
// accumulated in f64 in index order, so every sum equals the obvious scalar loop's
// (an f32 product is exact in f64); the vectors only run eight of those loops side
// by side. Cloned for AVX2, where the eight sums are two 256-bit registers.
using Double4 = double __attribute__((vector_size(32)));

__attribute__((target_clones("avx2", "default"))) void dot_eight(const float* x, const float* w, std::int64_t k,
                                                                  double* sums) {
  Double4 low = {0, 0, 0, 0};
  Double4 high = {0, 0, 0, 0};
  for (std::int64_t depth = 0; depth < k; ++depth) {
    const double value = x[depth];
    const Double4 broadcast = {value, value, value, value};
    const float* row = w + depth * 8;
    const Double4 first = {row[0], row[1], row[2], row[3]};
    const Double4 second = {row[4], row[5], row[6], row[7]};
    low += broadcast * first;
    high += broadcast * second;
  }
  for (int lane = 0; lane < 4; ++lane) {
    sums[lane] = low[lane];
    sums[lane + 4] = high[lane];
  }
}

constexpr std::int64_t kColumnBlock = 8;  // weight rows per dot_eight

// Dot products of every row of a [M, K] with `columns` weight rows:
// out[row * out_stride + column]. fill_block(first, count, w) writes weight rows
// first .. first + count - 1 interleaved as dot_eight reads them (w[d * 8 + j]).
// Each dot product is one f64 sum in index order (dot_eight), so a column's
// result never depends on the blocking or the thread count. Speed comes from
// taking eight weight rows at once (eight independent sums in flight, each row
// of a read once per eight columns) and spreading column blocks over threads.
template <typename FillBlock>
void contract_rows(const float* a, std::int64_t m, std::int64_t k, std::int64_t columns, FillBlock fill_block,
                   double* out, std::int64_t out_stride) {
  const auto body = [&](std::int64_t first_block, std::int64_t end_block) {
    std::vector<float> interleaved(static_cast<std::size_t>(kColumnBlock * k), 0.0f);
    FillBlock fill = fill_block;  // a copy per thread: it may carry a scratch row
    double sums[kColumnBlock];
    for (std::int64_t block_index = first_block; block_index < end_block; ++block_index) {
      const std::int64_t first = block_index * kColumnBlock;
      const std::int64_t count = std::min(kColumnBlock, columns - first);
      fill(first, count, interleaved.data());  // lanes past count keep stale values, never stored
      for (std::int64_t row = 0; row < m; ++row) {
        dot_eight(a + row * k, interleaved.data(), k, sums);
        for (std::int64_t j = 0; j < count; ++j) out[row * out_stride + first + j] = sums[j];
      }
    }
  };
  const std::int64_t blocks = (columns + kColumnBlock - 1) / kColumnBlock;
  parallel_for(blocks, m * k * columns, body);
}

// fill_block for rows that come one at a time (fill_row(column, span of K floats)).
template <typename FillRow>
auto interleaving(std::int64_t k, FillRow fill_row) {
  return [k, fill_row, row = std::vector<float>(static_cast<std::size_t>(k))](
             std::int64_t first, std::int64_t count, float* interleaved) mutable {
    for (std::int64_t j = 0; j < count; ++j) {
      fill_row(first + j, std::span<float>(row));
      for (std::int64_t depth = 0; depth < k; ++depth) {
        interleaved[depth * kColumnBlock + j] = row[static_cast<std::size_t>(depth)];
      }
    }
  };
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
  std::vector<double> out(static_cast<std::size_t>(batches * m * n));
  for (std::int64_t batch = 0; batch < batches; ++batch) {
    const std::int64_t b_first = b_is_batched ? batch * k * n : 0;
    if (!transpose_right && (batch == 0 || b_is_batched)) {
      b_batch.resize(static_cast<std::size_t>(k * n));
      read_floats(b, b_first, b_batch);
    }
    const auto fill_row = [&](std::int64_t column, std::span<float> row) {
      if (transpose_right) {
        read_floats(b, b_first + column * k, row);
      } else {
        for (std::int64_t depth = 0; depth < k; ++depth) {
          row[static_cast<std::size_t>(depth)] = b_batch[static_cast<std::size_t>(depth * n + column)];
        }
      }
    };
    double* batch_out = out.data() + batch * m * n;
    if (transpose_right && b.spec().dtype == DType::bf16) {
      // The weights of a bf16 model: widened straight into the interleaved block
      // (bf16 is the top half of an f32), the hot loop of CPU decoding.
      const auto* weights = reinterpret_cast<const std::uint16_t*>(b.bytes().data()) + b_first;
      const auto fill_block = [&](std::int64_t first, std::int64_t count, float* interleaved) {
        for (std::int64_t j = 0; j < count; ++j) {
          const std::uint16_t* source = weights + (first + j) * k;
          for (std::int64_t depth = 0; depth < k; ++depth) {
            interleaved[depth * kColumnBlock + j] = std::bit_cast<float>(static_cast<std::uint32_t>(source[depth]) << 16);
          }
        }
      };
      contract_rows(a.data() + batch * m * k, m, k, n, fill_block, batch_out, n);
    } else {
      contract_rows(a.data() + batch * m * k, m, k, n, interleaving(k, fill_row), batch_out, n);
    }
  }
  return store_values(call.output, out);
}

// Eight weight rows' codes, dequantized straight into dot_eight's interleaved block:
// w[d * 8 + j] = scale_j * q_j[d] + bias_j in f32, the product rounded before the add,
// exactly as dequantize_affine_row computes each value. Depth d of the eight rows is
// one 8-lane vector (lane j = row j): word `word` of each row, shifted and masked per
// slot, so every store is a whole block row. Cloned for AVX2 (8 f32 lanes).
using Float8 = float __attribute__((vector_size(32)));
using Word8 = std::uint32_t __attribute__((vector_size(32)));

__attribute__((target_clones("avx2", "default"))) void dequantize_eight(const std::uint32_t* words, const float* scales,
                                                                         const float* biases, std::int64_t k,
                                                                         int bits, int group_size, float* interleaved) {
  const int per_word = 32 / bits;
  const std::int64_t words_per_row = k / per_word;
  const std::uint32_t max_code = (std::uint32_t{1} << bits) - 1;
  const Word8 mask = {max_code, max_code, max_code, max_code, max_code, max_code, max_code, max_code};
  for (std::int64_t word = 0; word < words_per_row; ++word) {
    const std::int64_t group = word * per_word / group_size;
    Word8 codes;
    Float8 scale;
    Float8 bias;
    for (int lane = 0; lane < 8; ++lane) {
      codes[lane] = words[lane * words_per_row + word];
      scale[lane] = scales[group * 8 + lane];
      bias[lane] = biases[group * 8 + lane];
    }
    float* out = interleaved + word * per_word * kColumnBlock;
    for (int slot = 0; slot < per_word; ++slot) {
      const Float8 code = __builtin_convertvector((codes >> (bits * slot)) & mask, Float8);
      const Float8 product = scale * code;  // kept apart from the add: no fused multiply-add
      const Float8 value = product + bias;
      std::memcpy(out + slot * kColumnBlock, &value, sizeof value);
    }
  }
}

// y = x . dequant(W)^T, W [N, K] dequantized eight rows at a time in f32 (the same
// values dequantize_affine_row gives), dot products in f64, k ascending.
HostTensor evaluate_quantized_matmul(const OpCall& call) {
  const AffineQuantization format{static_cast<int>(call.node.attributes.get_int("bits")),
                                  static_cast<int>(call.node.attributes.get_int("group_size"))};
  const std::vector<float> x = load_floats(call.input(0));
  const std::int64_t k = call.input(0).spec().row_length();
  const std::int64_t n = call.output.shape.back();
  const std::int64_t rows = k == 0 ? 0 : static_cast<std::int64_t>(x.size()) / k;
  const HostTensor& packed = call.input(1);
  const HostTensor& scales = call.input(2);
  const HostTensor& biases = call.input(3);
  const std::int64_t words_per_row = format.packed_columns(k);
  const std::int64_t groups = format.group_count(k);
  // The op's shape inference guarantees these; checked again because the kernel reads raw words.
  if (packed.element_count() != n * words_per_row || scales.element_count() != n * groups ||
      biases.element_count() != n * groups) {
    throw InputError(fmt::format("node '{}' (quantized_matmul): packed {} / scales {} / biases {} do not match [{}, {}]",
                                 call.node.name, packed.spec().to_string(), scales.spec().to_string(),
                                 biases.spec().to_string(), n, k));
  }
  const auto* all_words = reinterpret_cast<const std::uint32_t*>(packed.bytes().data());
  std::vector<double> out(static_cast<std::size_t>(rows * n));
  const auto fill_block = [&, words = std::vector<std::uint32_t>(static_cast<std::size_t>(kColumnBlock * words_per_row)),
                           block_scales = std::vector<float>(static_cast<std::size_t>(kColumnBlock * groups)),
                           block_biases = std::vector<float>(static_cast<std::size_t>(kColumnBlock * groups))](
                              std::int64_t first, std::int64_t count, float* interleaved) mutable {
    // Rows past count (the last, ragged block) decode zeros into lanes that are never stored.
    std::fill(words.begin(), words.end(), 0u);
    std::fill(block_scales.begin(), block_scales.end(), 0.0f);
    std::fill(block_biases.begin(), block_biases.end(), 0.0f);
    std::memcpy(words.data(), all_words + first * words_per_row,
                static_cast<std::size_t>(count * words_per_row) * sizeof(std::uint32_t));
    for (std::int64_t j = 0; j < count; ++j) {
      for (std::int64_t group = 0; group < groups; ++group) {
        // scales.at widens f16/bf16/f32 exactly; the f32 value is dequantize_affine_row's.
        block_scales[static_cast<std::size_t>(group * kColumnBlock + j)] =
            static_cast<float>(scales.at((first + j) * groups + group));
        block_biases[static_cast<std::size_t>(group * kColumnBlock + j)] =
            static_cast<float>(biases.at((first + j) * groups + group));
      }
    }
    dequantize_eight(words.data(), block_scales.data(), block_biases.data(), k, format.bits, format.group_size,
                     interleaved);
  };
  contract_rows(x.data(), rows, k, n, fill_block, out.data(), n);
  return store_values(call.output, out);
}

std::int32_t read_id(const HostTensor& ids, std::int64_t index) {
  std::int32_t id;
  std::memcpy(&id, ids.bytes().data() + index * 4, 4);
  return id;
}

std::int64_t checked_row(const HostTensor& ids, std::int64_t index, std::int64_t rows, std::string_view what,
                         const Node& node) {
  const std::int32_t id = read_id(ids, index);
  if (id < 0 || id >= rows) {
    throw InputError(fmt::format("node '{}' ({}): {} {} at index {} is outside [0, {})", node.name, node.op, what, id,
                                 index, rows));
  }
  return id;
}

// Row ids[s] of the table, copied bit for bit (the output has the table's dtype).
HostTensor evaluate_embedding(const OpCall& call) {
  const HostTensor& table = call.input(1);
  const std::int64_t rows = table.spec().shape[0];
  const std::size_t row_bytes = static_cast<std::size_t>(table.spec().shape[1]) * dtype_size(table.spec().dtype);
  HostTensor out(call.output);
  for (std::int64_t step = 0; step < call.output.shape[0]; ++step) {
    const std::int64_t id = checked_row(call.input(0), step, rows, "token id", call.node);
    std::memcpy(out.bytes().data() + step * row_bytes, table.bytes().data() + id * row_bytes, row_bytes);
  }
  return out;
}

// Row ids[s] of the quantized table, dequantized in f32 as dequantize_affine_row
// does, then rounded once to the output dtype.
HostTensor evaluate_quantized_embedding(const OpCall& call) {
  const AffineQuantization format{static_cast<int>(call.node.attributes.get_int("bits")),
                                  static_cast<int>(call.node.attributes.get_int("group_size"))};
  const std::int64_t hidden = call.output.shape[1];
  const std::int64_t rows = call.input(1).spec().shape[0];
  HostTensor out(call.output);
  std::vector<float> row(static_cast<std::size_t>(hidden));
  for (std::int64_t step = 0; step < call.output.shape[0]; ++step) {
    const std::int64_t id = checked_row(call.input(0), step, rows, "token id", call.node);
    dequantize_affine_row(format, call.input(1), call.input(2), call.input(3), id, row);
    write_floats(out, step * hidden, row);
  }
  return out;
}

// x[..., r, j] = -inf where j > positions[r mod S].
HostTensor evaluate_position_mask(const OpCall& call) {
  const std::int64_t columns = call.output.shape.back();
  const std::int64_t rows = call.output.shape[call.output.shape.size() - 2];
  const HostTensor& positions = call.input(1);
  const std::int64_t steps = positions.element_count();
  HostTensor out = call.input(0);
  std::vector<float> row(static_cast<std::size_t>(columns));
  for (std::int64_t first = 0; first < out.element_count(); first += columns) {
    const std::int64_t limit = read_id(positions, (first / columns % rows) % steps);
    const std::int64_t visible = std::clamp<std::int64_t>(limit + 1, 0, columns);
    if (visible == columns) continue;
    read_floats(out, first, row);
    std::fill(row.begin() + visible, row.end(), -std::numeric_limits<float>::infinity());
    write_floats(out, first, row);
  }
  return out;
}

// A copy of the cache with row positions[s] of every head replaced by update[:, s, :]. (The
// executors skip the copy where they own the cache and this node is its last reader:
// write_cache_rows on the cache itself, src/runtime/cpu/reference_executor.cpp.)
HostTensor evaluate_kv_cache_write(const OpCall& call) {
  HostTensor out = call.input(0);
  write_cache_rows(out, call.node, call.input(1), call.input(2));
  return out;
}

// Rotate-half rotary embedding (Llama, MLX traditional=False) over the first
// `dims` elements of each row of x [..., S, D]: element i pairs with i + dims/2
// and turns by position * theta^(-2i/dims). The angles and their cos/sin are
// computed in f64 and rounded to f32 (they depend on no tensor data, so a GPU
// kernel may take them from a table); the rotation itself is f32.
HostTensor evaluate_rope(const OpCall& call) {
  const std::int64_t dims = call.node.attributes.get_int("dims");
  const std::int64_t half = dims / 2;
  const std::int64_t length = call.output.shape.back();
  const std::int64_t sequence = call.output.shape[call.output.shape.size() - 2];
  const HostTensor& positions = call.input(1);
  std::vector<float> cosines(static_cast<std::size_t>(sequence * half));
  std::vector<float> sines(cosines.size());
  const std::vector<double> frequencies = rope_frequencies(call.node.attributes);
  for (std::int64_t step = 0; step < sequence; ++step) {
    for (std::int64_t pair = 0; pair < half; ++pair) {
      const double frequency = frequencies[static_cast<std::size_t>(pair)];
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

// Per row of x [..., L], the i32 index of its maximum by argmax_index's rule (graph.h).
HostTensor evaluate_argmax(const OpCall& call) {
  const HostTensor& x = call.input(0);
  const std::int64_t length = x.spec().row_length();
  HostTensor out(call.output);
  std::vector<float> row(static_cast<std::size_t>(length));
  for (std::int64_t index = 0; index < out.element_count(); ++index) {
    read_floats(x, index * length, row);
    out.store(index, static_cast<double>(argmax_index(row)));
  }
  return out;
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
      {"embedding", evaluate_embedding},
      {"quantized_embedding", evaluate_quantized_embedding},
      {"position_mask", evaluate_position_mask},
      {"kv_cache_write", evaluate_kv_cache_write},
      {"flash_attention", evaluate_flash_attention},
      {"argmax", evaluate_argmax},
  };
  return table;
}

}  // namespace

void write_cache_rows(HostTensor& cache, const Node& node, const HostTensor& update, const HostTensor& positions) {
  const std::int64_t heads = cache.spec().shape[0];
  const std::int64_t capacity = cache.spec().shape[1];
  const std::int64_t steps = update.spec().shape[1];
  const std::size_t row_bytes = static_cast<std::size_t>(cache.spec().shape[2]) * dtype_size(cache.spec().dtype);
  // Every position is checked before the first row is written: an error leaves the cache as it was.
  std::vector<std::int64_t> rows;
  for (std::int64_t step = 0; step < steps; ++step) rows.push_back(checked_row(positions, step, capacity, "position", node));
  for (std::int64_t step = 0; step < steps; ++step) {
    for (std::int64_t head = 0; head < heads; ++head) {
      std::memcpy(cache.bytes().data() + (head * capacity + rows[static_cast<std::size_t>(step)]) * row_bytes,
                  update.bytes().data() + (head * steps + step) * row_bytes, row_bytes);
    }
  }
}

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
