// The decode-MLP model without a GPU: the float64 oracle (decode_mlp_reference_*, which reads
// weights through the quant module's dequantization) agrees with the CPU reference executor
// running DecodeMlpWeights::graph() (f32 math, every value rounded to its dtype), for dense and
// affine formats; and malformed weights are rejected naming the matrix.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <cstdlib>
#include <iostream>

#include "gemv_test_support.h"
#include "metile/cpu_runtime.h"
#include "metile/decode_mlp.h"
#include "metile_test_support.h"

namespace metile {
namespace {


// The f16 numeric gate of the dispatch module (dispatch.h), which GPU candidates must pass too.
constexpr double numeric_gate_threshold_f16 = 2e-3;

TEST(DecodeMlpModel, Float64OracleMatchesTheCpuReferenceOfTheGraph) {
  std::uint64_t seed = metile::testing::test_seed("decode MLP model");
  const std::int64_t hidden = 128, intermediate = 192, rows = 3;
  for (const GemvWeightFormat& format : {GemvWeightFormat::dense(DType::f16), GemvWeightFormat::affine(4, 32, DType::f16),
                                         GemvWeightFormat::affine(8, 64, DType::f16)}) {
    const std::string label = format.to_string();
    const DecodeMlpWeights weights = DecodeMlpWeights::random(format, hidden, intermediate, ++seed);
    const ComputeGraph graph = weights.graph(rows);
    ASSERT_EQ(graph.outputs().size(), 1u);
    TensorMap inputs = weights.weight_inputs();
    inputs["x"] = gemv_testing::random_tensor(TensorSpec({rows, hidden}, format.activation), ++seed);
    const std::vector<double> hidden_oracle = decode_mlp_reference_hidden(weights, inputs["x"]);
    ASSERT_EQ(hidden_oracle.size(), static_cast<std::size_t>(rows * intermediate));
    const HostTensor hidden_tensor =
        HostTensor::from_values(TensorSpec({rows, intermediate}, format.activation), hidden_oracle);
    // A zero residual first, so the MLP's own output is compared (it is small next to a residual
    // of O(1)); then a random one, for the whole block. Both round gate, up and silu to f16 on the
    // way; the graph's f32 sums against the oracle's float64 ones: a few f16 ulps.
    for (const bool zero_residual : {true, false}) {
      inputs["residual"] = zero_residual ? HostTensor(TensorSpec({rows, hidden}, format.activation))
                                         : gemv_testing::random_tensor(TensorSpec({rows, hidden}, format.activation), ++seed);
      const HostTensor out = run_reference(graph, inputs).at("out");
      const std::vector<double> out_oracle = decode_mlp_reference_out(weights, hidden_tensor, inputs["residual"]);
      const gemv_testing::ScaledError error = gemv_testing::scaled_error(out.to_values(), out_oracle);
      const std::string what = fmt::format("{}, {} residual", label, zero_residual ? "zero" : "random");
      EXPECT_LE(error.relative_max, numeric_gate_threshold_f16) << what;
      EXPECT_LE(error.relative_norm, numeric_gate_threshold_f16) << what;
      std::cout << fmt::format("[figures] {}: graph vs float64 oracle: L2 {:.2e} max {:.2e}\n", what,
                               error.relative_norm, error.relative_max);
    }
  }
}

TEST(DecodeMlpModel, MalformedWeightsAreRejectedNamingTheMatrix) {
  const DecodeMlpWeights good = DecodeMlpWeights::random(GemvWeightFormat::dense(DType::bf16), 64, 96, 1);
  DecodeMlpWeights wrong = good;
  wrong.down = HostTensor(TensorSpec({64, 64}, DType::bf16));
  EXPECT_EQ(testing::error_of([&] { wrong.validate(); }),
            "decode MLP: down is bf16[64, 64], expected bf16[64, 96]");
  EXPECT_EQ(testing::error_of([&] { good.validate(); }), "(no InputError)");
}

}  // namespace
}  // namespace metile
