// The GEMV that normalizes its x (GemvKernelConfig::x_rms_norm_eps: a region took the RMSNorm of its
// input as its input prologue) on the GPU: every candidate of the q/k/v group, the SwiGLU MLP and the
// LM head with its argmax, each reading rms_norm(a, g), against a float64 evaluation of the graph
// written here (the norm, the weights dequantized exactly, the products and epilogues, no rounding
// in between); dense bf16 and 4/8-bit affine weights, M = 1 and 16, K not a multiple of the
// mainloop's columns per iteration; and the LM head through the Executable, where the final norm
// joins the contraction_argmax region. Inputs are fresh per run (seed printed, METILE_TEST_SEED
// replays).
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "gemv_region_graphs.h"
#include "gpu_test_support.h"
#include "metile/quant.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing::LinearFormat;
using testing_support::CudaDeviceTest;

// Every value of `graph` in float64 from `inputs`, for the ops these graphs hold (an argmax's value
// is left empty: its oracle is the brute-force argmax of the candidate's own logits).
std::map<ValueId, std::vector<double>> evaluate_f64(const ComputeGraph& graph, const TensorMap& inputs) {
  std::map<ValueId, std::vector<double>> values;
  for (ValueId id : graph.inputs()) values[id] = inputs.at(graph.value(id).name).to_values();
  for (const Node& node : graph.nodes()) {
    auto in = [&](std::size_t slot) -> const std::vector<double>& { return values.at(node.inputs[slot]); };
    const TensorSpec& x = graph.value(node.inputs[0]).spec;
    std::vector<double> out(static_cast<std::size_t>(graph.value(node.outputs[0]).spec.element_count()));
    if (node.op == "rms_norm") {
      const std::size_t k = static_cast<std::size_t>(x.row_length());
      for (std::size_t m = 0; m < out.size() / k; ++m) {
        double squares = 0;
        for (std::size_t c = 0; c < k; ++c) squares += in(0)[m * k + c] * in(0)[m * k + c];
        const double scale = 1 / std::sqrt(squares / static_cast<double>(k) + node.attributes.get_double("eps"));
        for (std::size_t c = 0; c < k; ++c) out[m * k + c] = in(0)[m * k + c] * scale * in(1)[c];
      }
    } else if (node.op == "matmul" || node.op == "quantized_matmul") {
      const std::size_t k = static_cast<std::size_t>(x.row_length()), rows = static_cast<std::size_t>(x.row_count());
      const std::size_t n = out.size() / rows;
      std::vector<double> weight = in(1);  // matmul: [N, K] (transpose_right)
      if (node.op == "quantized_matmul") {
        const int bits = static_cast<int>(node.attributes.get_int("bits"));
        const std::size_t group = static_cast<std::size_t>(node.attributes.get_int("group_size"));
        std::vector<std::uint32_t> words;
        for (double word : in(1)) words.push_back(static_cast<std::uint32_t>(word));
        const std::vector<std::uint32_t> codes = unpack_codes(words, bits);
        weight.assign(n * k, 0);
        for (std::size_t j = 0; j < n; ++j) {
          for (std::size_t c = 0; c < k; ++c) {
            const std::size_t g = j * (k / group) + c / group;
            weight[j * k + c] = in(2)[g] * codes[j * k + c] + in(3)[g];
          }
        }
      }
      for (std::size_t m = 0; m < rows; ++m) {
        for (std::size_t j = 0; j < n; ++j) {
          double sum = 0;
          for (std::size_t c = 0; c < k; ++c) sum += in(0)[m * k + c] * weight[j * k + c];
          out[m * n + j] = sum;
        }
      }
    } else if (node.op == "add" || node.op == "multiply") {
      for (std::size_t i = 0; i < out.size(); ++i) {
        const double a = in(0)[i % in(0).size()], b = in(1)[i % in(1).size()];  // a bias broadcasts over rows
        out[i] = node.op == "add" ? a + b : a * b;
      }
    } else if (node.op == "silu") {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = in(0)[i] / (1 + std::exp(-in(0)[i]));
    } else if (node.op == "argmax") {
      out.clear();
    } else {
      ADD_FAILURE() << "evaluate_f64: no float64 rule for " << node.op;
    }
    values[node.outputs[0]] = std::move(out);
  }
  return values;
}

// Relative L2 and max error of `output` against the float64 values, within the numeric gate's
// threshold for the output's dtype (the kernel rounds x once after the norm, as a native rms_norm
// writes it, and the result once: a few ulps of the dtype).
void expect_near_f64(const HostTensor& output, const std::vector<double>& oracle, const std::string& what) {
  ASSERT_EQ(static_cast<std::size_t>(output.element_count()), oracle.size()) << what;
  double squared_difference = 0, squared_oracle = 0, largest_difference = 0, largest_oracle = 0;
  for (std::size_t i = 0; i < oracle.size(); ++i) {
    const double difference = std::abs(output.at(static_cast<std::int64_t>(i)) - oracle[i]);
    ASSERT_TRUE(std::isfinite(difference)) << what << ": element " << i << " is " << output.at(static_cast<std::int64_t>(i));
    squared_difference += difference * difference;
    squared_oracle += oracle[i] * oracle[i];
    largest_difference = std::max(largest_difference, difference);
    largest_oracle = std::max(largest_oracle, std::abs(oracle[i]));
  }
  const double threshold = numeric_gate_threshold(output.spec().dtype);
  EXPECT_LE(std::sqrt(squared_difference / squared_oracle), threshold) << what << " (relative L2)";
  EXPECT_LE(largest_difference / largest_oracle, threshold) << what << " (relative max)";
}

bool holds_norm(const ComputeGraph& graph, const FusionRegion& region) {
  const NodeId norm = *graph.find_node("m0");
  return std::find(region.nodes.begin(), region.nodes.end(), norm) != region.nodes.end();
}

class NormalizedGemv : public CudaDeviceTest {
 protected:
  // Every candidate of `region` (which must hold the norm) against the float64 values of every
  // floating output of the graph; an argmax output against its candidate's own logits.
  void expect_every_candidate_matches(const ComputeGraph& graph, const FusionRegion& region, const std::string& what) {
    ASSERT_TRUE(holds_norm(graph, region)) << what;
    const Lowered lowered = gemv_region_candidates(graph, region);
    ASSERT_TRUE(lowered.decision) << what << ": " << lowered.decision.reason;
    ASSERT_FALSE(lowered.candidates.empty()) << what;
    DeviceValues values(graph);
    const TensorMap inputs = random_inputs(graph, next_seed());
    values.upload_inputs(inputs);
    const std::map<ValueId, std::vector<double>> oracle = evaluate_f64(graph, inputs);
    CudaStream stream;
    for (const FusedCandidate& candidate : lowered.candidates) {
      const DeviceStep step = candidate.bind(values);
      values.poison_computed_values();
      step(stream);
      stream.synchronize();
      const TensorMap outputs = values.download_outputs();
      for (ValueId id : graph.outputs()) {
        const std::string& name = graph.value(id).name;
        const std::string where = what + ", " + candidate.id.name() + ", output '" + name + "'";
        if (graph.value(id).spec.dtype != DType::i32) {
          expect_near_f64(outputs.at(name), oracle.at(id), where);
          continue;
        }
        const Node& argmax = graph.node(graph.value(id).producer);
        const HostTensor& logits = outputs.at(graph.value(argmax.inputs[0]).name);
        const std::int64_t n = logits.spec().row_length();
        for (std::int64_t row = 0; row < logits.spec().row_count(); ++row) {
          std::vector<double> own(static_cast<std::size_t>(n));
          for (std::int64_t column = 0; column < n; ++column) own[static_cast<std::size_t>(column)] = logits.at(row * n + column);
          EXPECT_EQ(outputs.at(name).at(row), static_cast<double>(testing::brute_force_argmax(own))) << where << " row " << row;
        }
      }
    }
  }
};

const FusionRegion* region_of_rule(const FusionPlan& plan, std::string_view rule) {
  for (const FusionRegion& region : plan.regions) {
    if (region.rule == rule) return &region;
  }
  return nullptr;
}

struct Case {
  LinearFormat format;
  std::int64_t rows;
  std::int64_t k() const { return format.bits == 16 ? 200 : 320; }  // not a multiple of 32 (dense) or 128 (4-bit)
  std::string name() const {
    return fmt::format("bits {} {} M={} K={}", format.bits, dtype_name(format.dtype), rows, k());
  }
};

std::vector<Case> cases() {
  std::vector<Case> all;
  for (const LinearFormat& format :
       {LinearFormat{16, 0, DType::bf16}, LinearFormat{4, 64, DType::bf16}, LinearFormat{8, 64, DType::bf16}}) {
    for (std::int64_t rows : {1, 16}) all.push_back({format, rows});
  }
  return all;
}

TEST_F(NormalizedGemv, SiblingCandidatesMatchTheFloat64Reference) {
  for (const Case& c : cases()) {
    const ComputeGraph graph = testing::sibling_test_graph(c.rows, {96, 32, 32}, c.k(), c.format, {true, false, true}, true);
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion* region = region_of_rule(plan, "sibling_contractions");
    ASSERT_NE(region, nullptr) << plan.explain();
    expect_every_candidate_matches(*plan.graph, *region, "q/k/v " + c.name());
  }
}

TEST_F(NormalizedGemv, SwigluCandidatesMatchTheFloat64Reference) {
  for (const Case& c : cases()) {
    const std::int64_t intermediate = c.format.bits == 16 ? 328 : 320;
    const ComputeGraph graph = testing::swiglu_test_graph(c.rows, c.k(), intermediate, c.format, c.rows == 16, true, true);
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion* region = region_of_rule(plan, "swiglu_mlp");
    ASSERT_NE(region, nullptr) << plan.explain();
    expect_every_candidate_matches(*plan.graph, *region, "swiglu " + c.name());
  }
}

TEST_F(NormalizedGemv, LmHeadArgmaxCandidatesMatchTheFloat64Reference) {
  for (const Case& c : cases()) {
    const ComputeGraph graph = testing::projection_test_graph(c.rows, 1000, c.k(), c.format, "argmax", true);
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion region = contraction_node_region(*plan.graph, *plan.graph->find_node("p0"));
    EXPECT_EQ(region.rule, "contraction_argmax");
    expect_every_candidate_matches(*plan.graph, region, "LM head " + c.name());
  }
}

// The Executable offers the LM head with the final norm as one region (the norm is unfused in the
// plan); in fused mode its GEMV wins and the step's logits match the float64 values.
TEST_F(NormalizedGemv, TheExecutableTakesTheFinalNormIntoTheLmHead) {
  const ComputeGraph graph = testing::projection_test_graph(1, 1000, 320, {4, 64, DType::bf16}, "argmax", true);
  const FusionPlan plan = plan_graph_fusion(graph);
  ExecutableOptions options;
  options.mode = DispatchMode::fused;
  options.use_decision_cache = false;
  options.tournament = {.warmup_calls = 1, .rounds = 1, .calls_per_sample = 1, .samples_per_round = 1, .quantile = 0.5};
  Executable executable = Executable::build(plan, device(), options);
  std::printf("%s", executable.report().c_str());
  ASSERT_EQ(executable.reports().size(), 1u) << executable.report();
  const RegionReport& report = executable.reports().front();
  EXPECT_EQ(report.rule, "contraction_argmax");
  EXPECT_EQ(report.nodes.size(), 3u) << report.sentence;
  EXPECT_EQ(report.chosen_id.kind, CandidateKind::fused) << report.sentence;
  const TensorMap inputs = random_inputs(graph, next_seed());
  const TensorMap outputs = executable.run(inputs);
  expect_near_f64(outputs.at("p0"), evaluate_f64(graph, inputs).at(*graph.find_value("p0")), "executable LM head");
}

}  // namespace
}  // namespace metile
