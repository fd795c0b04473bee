// metile decode MLP: the feed-forward block of a transformer at decode time (1..16 rows),
// as a model on the host: its weights (dense or MLX affine), the unfused graph it computes and
// its float64 oracle. CPU-only (library metile_decode_mlp_model); the GPU executor that runs it
// through generated GEMVs is in decode_mlp_executor.h.
//
//   h   = silu(x · Wgateᵀ) * (x · Wupᵀ)        gate/up stage
//   out = h · Wdownᵀ + residual                down stage
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "metile/gemv.h"
#include "metile/graph.h"
#include "metile/quant.h"

namespace metile {

// ---------------------------------------------------------------- the MLP on the host
// One decode MLP's weights: gate and up [intermediate, hidden], down [hidden, intermediate]
// (PyTorch's Linear layout), dense in the activation dtype or MLX affine matrices whose scales
// and biases are in the activation dtype.
struct DecodeMlpWeights {
  GemvWeightFormat format;
  std::int64_t hidden = 0, intermediate = 0;
  HostTensor gate, up, down;                                        // dense formats
  std::optional<QuantizedMatrix> quantized_gate, quantized_up, quantized_down;  // affine formats

  static DecodeMlpWeights dense(HostTensor gate, HostTensor up, HostTensor down);
  static DecodeMlpWeights affine(QuantizedMatrix gate, QuantizedMatrix up, QuantizedMatrix down);
  // Seeded random weights whose products stay O(1) for O(1) inputs: dense uniform / sqrt(K);
  // affine random codes over the whole range, scales of both signs, biases around zero.
  static DecodeMlpWeights random(GemvWeightFormat format, std::int64_t hidden, std::int64_t intermediate,
                                 std::uint64_t seed);
  void validate() const;  // InputError naming the matrix whose shape or dtype is wrong

  // The unfused graph the executor implements, for `rows` activation rows:
  //   inputs  x [rows, hidden], residual [rows, hidden], then the weights (weight_inputs() names)
  //   gate = x·Wgateᵀ, up = x·Wupᵀ, activated = silu(gate), hidden_state = activated * up,
  //   down = hidden_state·Wdownᵀ, out = down + residual        (output: out)
  ComputeGraph graph(std::int64_t rows) const;
  TensorMap weight_inputs() const;  // "gate_weight" ... or "gate_packed", "gate_scales", "gate_biases" ...
  std::int64_t weight_bytes() const;  // codes, scales and biases (or dense elements) of the three matrices
};

// The MLP in float64 (threads over output features), from the quant module's dequantized
// weights: the oracle of the numeric gates. x, residual [rows, hidden]; hidden [rows, intermediate].
// The hidden state's inputs (gate, up, silu(gate)) are rounded to the activation dtype, as the graph
// stores them; the products themselves are exact sums in float64.
std::vector<double> decode_mlp_reference_hidden(const DecodeMlpWeights& weights, const HostTensor& x);
std::vector<double> decode_mlp_reference_out(const DecodeMlpWeights& weights, const HostTensor& hidden,
                                             const HostTensor& residual);

}  // namespace metile
