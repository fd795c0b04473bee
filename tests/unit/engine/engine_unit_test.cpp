// The GPU decode engine's host side, on the CPU (include/metile/engine.h, model.h):
//   * engine_plan: the native path is the step graph untouched with no region (every node its
//     own native step); the fused path rewrites each layer's attention into one flash_attention
//     node and plans regions, each node in at most one region;
//   * compare_logits: KL divergence and logit error against a long-double sum written here, on
//     fresh random logits; a NaN logit shows as a NaN figure and misses every threshold;
//   * compare_sessions on scripted sessions: non-finite reference logits are counted and named as the
//     reference's miss;
//   * weight_stream_percent: a kind's weight bytes at the copy rate over its replay cost, against
//     the same ratio in long double; NaN where a figure is missing.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include "metile/engine.h"
#include "metile_test_support.h"

namespace metile {
namespace {

TEST(EnginePlan, NativeRunsTheGraphAsItIsAndFusedRewritesAttention) {
  const std::filesystem::path directory =
      std::filesystem::temp_directory_path() / ("metile_engine_plan_" + std::to_string(::getpid()));
  std::filesystem::remove_all(directory);
  SynthOptions synth;
  synth.seed = testing::test_seed("EnginePlan");
  synthesize_model(directory, synth);
  const DecoderModel model = DecoderModel::load(directory);
  std::filesystem::remove_all(directory);
  for (std::int64_t steps : {1, 16}) {
    SCOPED_TRACE(steps);
    const ComputeGraph& graph = model.step_graph(steps);
    const FusionPlan native = engine_plan(graph, EnginePath::native);
    EXPECT_TRUE(native.regions.empty());
    EXPECT_EQ(native.unfused.size(), graph.nodes().size());
    EXPECT_EQ(native.graph->nodes().size(), graph.nodes().size());

    const FusionPlan fused = engine_plan(graph, EnginePath::fused);
    int attention_nodes = 0;
    for (const Node& node : fused.graph->nodes()) attention_nodes += node.op == "flash_attention" ? 1 : 0;
    EXPECT_EQ(attention_nodes, model.config().num_hidden_layers);  // one per layer
    EXPECT_FALSE(fused.regions.empty());
    std::set<NodeId> seen;
    std::size_t covered = 0;
    for (const FusionRegion& region : fused.regions) {
      EXPECT_FALSE(region.rule.empty());
      for (NodeId node : region.nodes) EXPECT_TRUE(seen.insert(node).second) << "node " << node << " in two regions";
      covered += region.nodes.size();
    }
    EXPECT_EQ(covered + fused.unfused.size(), fused.graph->nodes().size());
  }
}

TEST(EngineVerificationFigures, KlAndLogitErrorAgainstALongDoubleSum) {
  std::mt19937_64 generator(testing::test_seed("EngineVerificationFigures"));
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> reference(97), candidate(97);
    for (std::size_t i = 0; i < reference.size(); ++i) {
      reference[i] = normal(generator);
      candidate[i] = reference[i] + 0.05f * normal(generator);
    }
    long double p_sum = 0, q_sum = 0;
    for (std::size_t i = 0; i < reference.size(); ++i) {
      p_sum += std::exp(static_cast<long double>(reference[i]));
      q_sum += std::exp(static_cast<long double>(candidate[i]));
    }
    long double kl = 0, error = 0, largest = 0;
    for (std::size_t i = 0; i < reference.size(); ++i) {
      const long double p = std::exp(static_cast<long double>(reference[i])) / p_sum;
      const long double q = std::exp(static_cast<long double>(candidate[i])) / q_sum;
      kl += p * std::log(p / q);
      error = std::max(error, std::fabs(static_cast<long double>(reference[i]) - candidate[i]));
      largest = std::max(largest, std::fabs(static_cast<long double>(reference[i])));
    }
    const LogitsComparison comparison = compare_logits(reference, candidate);
    EXPECT_NEAR(comparison.kl, static_cast<double>(kl), 1e-9 + 1e-6 * static_cast<double>(kl));
    EXPECT_DOUBLE_EQ(comparison.max_abs_error, static_cast<double>(error));
    EXPECT_DOUBLE_EQ(comparison.max_abs_logit, static_cast<double>(largest));
    EXPECT_EQ(comparison.same_argmax, argmax_index(reference) == argmax_index(candidate));
  }
}

TEST(EngineVerificationFigures, ANanLogitMissesEveryThreshold) {
  std::vector<float> reference = {1, 2, 3, 4};
  std::vector<float> candidate = {1, 2, std::numeric_limits<float>::quiet_NaN(), 4};
  const LogitsComparison comparison = compare_logits(reference, candidate);
  EXPECT_TRUE(std::isnan(comparison.kl));
  EXPECT_TRUE(std::isnan(comparison.max_abs_error));

  AgreementFigures figures;
  figures.positions = figures.agreements = 4;
  const EngineThresholds thresholds;
  EXPECT_TRUE(meets(figures, thresholds));
  figures.kl_mean = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(meets(figures, thresholds));
  EXPECT_NE(first_miss(figures, thresholds).find("KL mean"), std::string::npos);
  figures.kl_mean = 0;
  figures.max_logit_error = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(first_miss(figures, thresholds).find("logit error"), std::string::npos);
  figures.max_logit_error = 0;
  figures.agreements = 3;
  figures.first_disagreement = 2;
  EXPECT_NE(first_miss(figures, thresholds).find("agreement 0.7500 < 0.9 (first difference at position 2)"),
            std::string::npos);
  // A decided position that differs misses whatever the overall agreement.
  figures.agreements = 4;
  figures.first_disagreement = -1;
  figures.decided_positions = 3;
  figures.decided_agreements = 2;
  figures.first_decided_disagreement = 1;
  EXPECT_NE(first_miss(figures, thresholds).find("1 of 3 decided next tokens differ (the first at position 1)"),
            std::string::npos);
}

// A session whose logits are given: position p's row is rows[p] (the token fed does not matter).
class ScriptedSession : public LogitsSession {
 public:
  explicit ScriptedSession(std::vector<std::vector<float>> rows) : rows_(std::move(rows)) {}
  std::vector<float> feed(std::span<const std::int32_t> tokens) override {
    std::vector<float> logits;
    for (std::size_t index = 0; index < tokens.size(); ++index) {
      const std::vector<float>& row = rows_.at(static_cast<std::size_t>(position_++));
      logits.insert(logits.end(), row.begin(), row.end());
    }
    return logits;
  }
  std::int64_t position() const override { return position_; }
  std::int64_t capacity() const override { return static_cast<std::int64_t>(rows_.size()); }
  const std::string& capacity_source() const override { return source_; }

 private:
  std::vector<std::vector<float>> rows_;
  std::int64_t position_ = 0;
  std::string source_ = "scripted";
};

// Logits the reference path itself makes NaN or inf (a NaN weight row: both paths agree bit for bit)
// read as "KL nan" and blamed the candidate (the GPU engine declined region kinds for it); they are
// counted, and the miss names the reference.
TEST(EngineVerificationFigures, NonFiniteReferenceLogitsAreTheReferencesMiss) {
  std::mt19937_64 generator(testing::test_seed("EngineVerificationFigures.NonFiniteReferenceLogitsAreTheReferencesMiss"));
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  std::vector<std::vector<float>> rows(5, std::vector<float>(32));
  for (auto& row : rows) {
    for (float& value : row) value = uniform(generator);
  }
  ScriptedSession clean_reference(rows), clean_candidate(rows);
  const std::vector<std::int32_t> prompt = {1, 2};
  const AgreementFigures clean = compare_sessions(clean_reference, clean_candidate, prompt, 4);
  EXPECT_EQ(clean.nonfinite_reference_positions, 0);
  EXPECT_TRUE(meets(clean, EngineThresholds{}));
  rows[2][7] = std::numeric_limits<float>::quiet_NaN();
  rows[4][0] = std::numeric_limits<float>::infinity();
  ScriptedSession reference(rows), candidate(rows);
  const AgreementFigures figures = compare_sessions(reference, candidate, prompt, 4);
  EXPECT_EQ(figures.positions, 4);
  EXPECT_EQ(figures.nonfinite_reference_positions, 2);  // the rows of positions 1 and 3 (the prompt fed two)
  EXPECT_EQ(first_miss(figures, EngineThresholds{}),
            "the reference path's own logits are not finite at 2 of 4 positions (the weights, the prompt or the "
            "reference path itself, not the plan compared)");
}

// The reference margin: the two largest reference logits' difference over max |logit|, whatever
// the candidate; decided positions are counted by compare_sessions from it (kDecidedMargin).
TEST(EngineVerificationFigures, ReferenceMarginIsTheGapOfTheTwoBestLogits) {
  std::mt19937_64 generator(testing::test_seed("EngineVerificationFigures.ReferenceMarginIsTheGapOfTheTwoBestLogits"));
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<float> reference(50), candidate(50);
    std::uniform_real_distribution<float> uniform(-8.0f, 8.0f);
    for (float& value : reference) value = uniform(generator);
    for (float& value : candidate) value = uniform(generator);
    std::vector<float> sorted = reference;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    double largest = 0;
    for (float value : reference) largest = std::max(largest, std::abs(static_cast<double>(value)));
    const LogitsComparison comparison = compare_logits(reference, candidate);
    EXPECT_NEAR(comparison.reference_margin, (static_cast<double>(sorted[0]) - sorted[1]) / largest, 1e-12);
  }
  const std::vector<float> tie = {3, 1, 3, -2};
  EXPECT_EQ(compare_logits(tie, tie).reference_margin, 0.0);
  const std::vector<float> one = {5};
  EXPECT_EQ(compare_logits(one, one).reference_margin, 1.0);
}

TEST(BenchmarkBreakdown, WeightStreamPercentIsTheCopyTimeOfTheWeightsOverTheReplayCost) {
  std::mt19937_64 generator(testing::test_seed("BenchmarkBreakdown"));
  std::uniform_int_distribution<std::uint64_t> bytes(1, std::uint64_t{1} << 34);
  std::uniform_real_distribution<double> milliseconds(1e-4, 10.0), bandwidth(100.0, 8000.0);
  for (int trial = 0; trial < 200; ++trial) {
    StepKindTime time;
    time.weight_bytes = bytes(generator);
    time.replay_ms = milliseconds(generator);
    const double gbps = bandwidth(generator);
    const long double expected = 100.0L * (static_cast<long double>(time.weight_bytes) / (static_cast<long double>(gbps) * 1e9L)) /
                                 (static_cast<long double>(time.replay_ms) * 1e-3L);
    EXPECT_NEAR(weight_stream_percent(time, gbps), static_cast<double>(expected), 1e-12 * static_cast<double>(expected));
  }
  // 88.1 MB in 33.5 us at 4240 GB/s: the Llama-3-8B 4-bit MLP's figures, 62% of copy.
  StepKindTime mlp;
  mlp.weight_bytes = 88'100'000;
  mlp.replay_ms = 0.0335;
  EXPECT_NEAR(weight_stream_percent(mlp, 4240), 62.02, 0.01);
  // No figure where one is missing: no weights named, no replay cost, a cost of ~0 or below (a kind
  // that overlaps others), no bandwidth measured.
  StepKindTime none = mlp;
  none.weight_bytes = 0;
  EXPECT_TRUE(std::isnan(weight_stream_percent(none, 4240)));
  StepKindTime unmeasured = mlp;
  unmeasured.replay_ms = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(weight_stream_percent(unmeasured, 4240)));
  for (double cost : {0.0, -0.002}) {
    StepKindTime overlapped = mlp;
    overlapped.replay_ms = cost;
    EXPECT_TRUE(std::isnan(weight_stream_percent(overlapped, 4240))) << cost;
  }
  EXPECT_TRUE(std::isnan(weight_stream_percent(mlp, 0)));
}

}  // namespace
}  // namespace metile
