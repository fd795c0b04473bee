// Sibling contractions (q, k, v) as one GEMV over their weights stacked by rows
// (src/dispatch/gemv_lowering.cpp, plan_gemv_siblings): every candidate of the lowering, dense
// bf16, 4-bit and 8-bit (f16 activations), M = 1, 5, 16, with Qwen-like biases on some parts,
// part widths that split 16-row tiles, against a float64 oracle written here (the weights
// dequantized exactly, the dot products and bias in double); then the same graph through the
// Executable (the region gated and raced like any other). A tiny model's step with the regions
// fused runs in gemv_lowering_test.cpp (its 4-bit case Qwen2-like, with q/k/v biases).
// Inputs are fresh per run (seed printed, METILE_TEST_SEED replays).
#include <gtest/gtest.h>

#include <cmath>

#include "gemv_region_graphs.h"
#include "gpu_test_support.h"
#include "metile/quant.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing::LinearFormat;
using testing_support::CudaDeviceTest;

// y_p = x · W_pᵀ (+ c_p) in double, W_p dequantized exactly (dequantize_affine to f32 is exact
// for the f32 products the format defines).
std::vector<double> oracle(const TensorMap& inputs, std::size_t part, std::int64_t rows, std::int64_t width,
                           std::int64_t k, const LinearFormat& format, bool biased) {
  const std::string prefix = "p" + std::to_string(part);
  const HostTensor weight =
      format.bits == 16 ? inputs.at(prefix + ".w")
                        : dequantize_affine(QuantizedMatrix::from_tensors({format.bits, format.group_size},
                                                                          inputs.at(prefix + ".q"), inputs.at(prefix + ".s"),
                                                                          inputs.at(prefix + ".b")),
                                            DType::f32);
  const std::vector<double> w = weight.to_values();
  const std::vector<double> x = inputs.at("a").to_values();
  std::vector<double> bias(static_cast<std::size_t>(width), 0.0);
  if (biased) bias = inputs.at("c" + std::to_string(part)).to_values();
  std::vector<double> y(static_cast<std::size_t>(rows * width));
  for (std::int64_t m = 0; m < rows; ++m) {
    for (std::int64_t n = 0; n < width; ++n) {
      double sum = 0;
      for (std::int64_t j = 0; j < k; ++j) sum += x[static_cast<std::size_t>(m * k + j)] * w[static_cast<std::size_t>(n * k + j)];
      y[static_cast<std::size_t>(m * width + n)] = sum + bias[static_cast<std::size_t>(n)];
    }
  }
  return y;
}

// Scale-normalized: the largest error over the largest |y|, within a few roundings of the
// output dtype (the kernel rounds once, in f32 accumulation order of its own).
void expect_near_oracle(const HostTensor& got, const std::vector<double>& expected, DType dtype, const std::string& what) {
  const std::vector<double> values = got.to_values();
  ASSERT_EQ(values.size(), expected.size()) << what;
  double scale = 1e-30, worst = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    scale = std::max(scale, std::abs(expected[i]));
    worst = std::max(worst, std::isfinite(values[i]) ? std::abs(values[i] - expected[i]) : INFINITY);
  }
  const double tolerance = dtype == DType::bf16 ? 1.6e-2 : 4e-3;
  EXPECT_LE(worst / scale, tolerance) << what << ": worst error " << worst << " against max |y| " << scale;
}

class SiblingGemv : public CudaDeviceTest {};

ExecutableOptions quick_fused_options() {
  ExecutableOptions options;
  options.mode = DispatchMode::fused;
  options.use_decision_cache = false;
  options.tournament = {.warmup_calls = 1, .rounds = 1, .calls_per_sample = 1, .samples_per_round = 1, .quantile = 0.5};
  return options;
}

TEST_F(SiblingGemv, EveryCandidateMatchesTheFloat64Oracle) {
  const std::vector<LinearFormat> formats = {{16, 0, DType::bf16}, {4, 64, DType::bf16}, {8, 64, DType::f16}};
  // 120 + 40 + 40: the parts' borders fall inside 16-row tiles; K = 384.
  const std::vector<std::int64_t> widths = {120, 40, 40};
  const std::int64_t k = 384;
  for (const LinearFormat& format : formats) {
    for (std::int64_t rows : {1, 5, 16}) {
      const std::vector<bool> biased = {rows != 5, true, rows == 16};
      const ComputeGraph graph = testing::sibling_test_graph(rows, widths, k, format, biased);
      const FusionPlan plan = plan_graph_fusion(graph);
      const FusionRegion* region = nullptr;
      for (const FusionRegion& candidate : plan.regions) {
        if (candidate.rule == "sibling_contractions") region = &candidate;
      }
      ASSERT_NE(region, nullptr) << plan.explain();
      const Lowered lowered = gemv_region_candidates(*plan.graph, *region);
      ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
      DeviceValues values(*plan.graph);
      CudaStream stream;
      TensorMap inputs = random_inputs(*plan.graph, next_seed());
      values.upload_inputs(inputs);
      std::vector<DeviceStep> steps;
      for (const FusedCandidate& candidate : lowered.candidates) steps.push_back(candidate.bind(values));
      // Twice: new weights re-derive the stacked copies.
      for (int round = 0; round < 2; ++round) {
        if (round == 1) {
          inputs = random_inputs(*plan.graph, next_seed());
          values.upload_inputs(inputs);
        }
        for (std::size_t c = 0; c < steps.size(); ++c) {
          values.poison_computed_values();
          steps[c](stream);
          stream.synchronize();
          const TensorMap outputs = values.download_outputs();
          for (std::size_t p = 0; p < widths.size(); ++p) {
            const std::string name = biased[p] ? "y" + std::to_string(p) : "p" + std::to_string(p);
            expect_near_oracle(outputs.at(name), oracle(inputs, p, rows, widths[p], k, format, biased[p]), format.dtype,
                               fmt::format("bits {} M {} {} part {} round {}", format.bits, rows,
                                           lowered.candidates[c].id.name(), p, round));
          }
        }
      }
      // Through the Executable: the region is gated and raced; fused mode keeps a passing GEMV.
      Executable executable = Executable::build(plan, device(), quick_fused_options());
      bool found = false;
      for (const RegionReport& report : executable.reports()) {
        if (report.rule != "sibling_contractions") continue;
        found = true;
        EXPECT_EQ(report.chosen_id.kind, CandidateKind::fused) << report.sentence;
        for (const auto& [name, gate] : report.gates) {
          if (name.rfind("fused gemv", 0) == 0) {
            EXPECT_TRUE(gate.passed) << name << ": " << gate.detail;
          }
        }
      }
      EXPECT_TRUE(found) << executable.report();
      inputs = random_inputs(*plan.graph, next_seed());
      const TensorMap outputs = executable.run(inputs);
      for (std::size_t p = 0; p < widths.size(); ++p) {
        const std::string name = biased[p] ? "y" + std::to_string(p) : "p" + std::to_string(p);
        expect_near_oracle(outputs.at(name), oracle(inputs, p, rows, widths[p], k, format, biased[p]), format.dtype,
                           fmt::format("executable bits {} M {} part {}", format.bits, rows, p));
      }
    }
  }
}

}  // namespace
}  // namespace metile
