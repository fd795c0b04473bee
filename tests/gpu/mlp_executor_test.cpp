// The decode-MLP executor on the GPU: its output equals the unfused graph's (the CPU reference
// executor running weights.graph(rows)) within the numeric gate, on fresh inputs other than the
// ones it was gated on; every candidate of both stages went through the gate; the chosen one
// passed it; METILE_DISPATCH's modes force native or fused; a stored decision is reused.
// Skips without a CUDA device.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <filesystem>
#include <unistd.h>
#include <iostream>

#include "../unit/gemv/gemv_test_support.h"
#include "gpu_test_support.h"
#include "metile/cpu_runtime.h"
#include "metile/decode_mlp_executor.h"

namespace metile {
namespace {

DecodeMlpOptions quick_options() {
  DecodeMlpOptions options;
  options.mode = DispatchMode::automatic;
  options.use_decision_cache = false;
  options.tournament.rounds = 3;
  options.tournament.samples_per_round = 2;
  options.tournament.calls_per_sample = 5;
  options.tournament.warmup_calls = 2;
  return options;
}

const DecodeMlpCandidate& chosen(const DecodeMlpStageReport& report) {
  return report.candidates.at(static_cast<std::size_t>(report.chosen));
}

void expect_well_formed(const DecodeMlpStageReport& report, bool affine) {
  ASSERT_GE(report.chosen, 0) << report.sentence;
  if (chosen(report).id.kind == CandidateKind::fused) {
    EXPECT_TRUE(chosen(report).gate.passed) << report.sentence;
  }
  EXPECT_GE(chosen(report).score_ms, 0.0) << report.sentence;
  EXPECT_FALSE(report.sentence.empty());
  int native = 0, fused = 0;
  for (const DecodeMlpCandidate& candidate : report.candidates) {
    (candidate.id.kind == CandidateKind::native ? native : fused) += 1;
    // Every candidate was gated: relative errors are figures, never left at their defaults.
    EXPECT_TRUE(candidate.gate.passed || !candidate.gate.detail.empty()) << candidate.name;
    EXPECT_GT(candidate.gate.threshold, 0.0) << candidate.name;
    if (candidate.id.kind == CandidateKind::fused) {
      EXPECT_TRUE(candidate.gate.passed) << report.stage << " " << candidate.name << ": " << candidate.gate.detail;
    }
  }
  EXPECT_EQ(native, affine ? 4 : 2) << report.stage;  // native (+graph), unfused gemv (+graph) when affine
  EXPECT_GE(fused, 1) << report.stage;
}

class DecodeMlpExecutorTest : public testing_support::CudaDeviceTest {};

TEST_F(DecodeMlpExecutorTest, OutputEqualsTheUnfusedGraphWithinTheGate) {
  struct Case {
    GemvWeightFormat format;
    std::int64_t hidden, intermediate, rows;
  };
  const std::vector<Case> cases = {
      {GemvWeightFormat::affine(4, 64, DType::bf16), 2048, 8192, 1},   // Llama-3.2-1B, 4-bit
      {GemvWeightFormat::dense(DType::bf16), 1536, 8960, 4},            // Qwen2.5-1.5B, bf16
      {GemvWeightFormat::affine(8, 32, DType::f16), 352, 1184, 16},     // small, ragged against the load block
      {GemvWeightFormat::affine(4, 128, DType::bf16), 1536, 8960, 2},   // Qwen2.5-1.5B, 4-bit g128
  };
  std::uint64_t seed = next_seed();
  for (const Case& c : cases) {
    const std::string label = fmt::format("{} {}x{} M={}", c.format.to_string(), c.hidden, c.intermediate, c.rows);
    const DecodeMlpWeights weights = DecodeMlpWeights::random(c.format, c.hidden, c.intermediate, ++seed);
    DecodeMlpExecutor executor = DecodeMlpExecutor::build(weights, c.rows, device(), quick_options());
    std::cout << "[report] " << label << "\n" << executor.report();
    expect_well_formed(executor.gate_up_report(), c.format.is_affine());
    expect_well_formed(executor.down_report(), c.format.is_affine());
    // The whole-MLP race: every persistent kernel was raced (none refused at load) and passed the gate.
    int persistent = 0;
    for (const DecodeMlpCandidate& candidate : executor.whole_report().candidates) {
      if (candidate.id.variant.rfind("persistent", 0) != 0) continue;
      ++persistent;
      EXPECT_TRUE(candidate.gate.passed) << label << " " << candidate.name << ": " << candidate.gate.detail;
    }
    EXPECT_GE(persistent, 1) << label << "\n" << executor.report();
    EXPECT_TRUE(executor.has_persistent()) << label;

    // Fresh inputs, not the gate's.
    const ComputeGraph graph = weights.graph(c.rows);
    TensorMap inputs = weights.weight_inputs();
    inputs["x"] = gemv_testing::random_tensor(TensorSpec({c.rows, c.hidden}, c.format.activation), ++seed);
    inputs["residual"] = gemv_testing::random_tensor(TensorSpec({c.rows, c.hidden}, c.format.activation), ++seed);
    const HostTensor out = executor.run(inputs["x"], inputs["residual"]);
    const TensorMap reference = run_reference(graph, inputs);
    const NumericGateResult against_graph = numeric_gate(out, reference.at("out"));
    EXPECT_TRUE(against_graph.passed) << label << ": " << against_graph.detail;

    // And against the float64 oracle, for the figures.
    const std::vector<double> hidden = decode_mlp_reference_hidden(weights, inputs["x"]);
    const HostTensor hidden_tensor =
        HostTensor::from_values(TensorSpec({c.rows, c.intermediate}, c.format.activation), hidden);
    const std::vector<double> expected = decode_mlp_reference_out(weights, hidden_tensor, inputs["residual"]);
    const gemv_testing::ScaledError error = gemv_testing::scaled_error(out.to_values(), expected);
    std::cout << fmt::format("[figures] executor {:<36} vs graph: L2 {:.2e} max {:.2e}; vs float64: L2 {:.2e} max {:.2e}\n",
                             label, against_graph.relative_l2, against_graph.relative_max, error.relative_norm,
                             error.relative_max);
    EXPECT_LE(error.relative_max, numeric_gate_threshold(c.format.activation)) << label;

    // The fastest persistent kernel (whether chosen or not) computes the same function.
    if (executor.has_persistent()) {
      const_cast<DeviceTensor&>(executor.out()).buffer.fill_bytes(0xFF);  // poison: it must write every element
      executor.enqueue_persistent(executor.stream());
      executor.stream().synchronize();
      const NumericGateResult persistent_gate = numeric_gate(executor.out().to_host(), reference.at("out"));
      EXPECT_TRUE(persistent_gate.passed) << label << " persistent: " << persistent_gate.detail;
    }

    // The native replay computes the same function (poisoned first: the runs above left the answer there).
    const_cast<DeviceTensor&>(executor.out()).buffer.fill_bytes(0xFF);
    executor.enqueue_native(executor.stream());
    executor.stream().synchronize();
    const NumericGateResult native = numeric_gate(executor.out().to_host(), reference.at("out"));
    EXPECT_TRUE(native.passed) << label << " native: " << native.detail;
  }
}

TEST_F(DecodeMlpExecutorTest, DispatchModesForceNativeOrFused) {
  std::uint64_t seed = next_seed();
  const DecodeMlpWeights weights =
      DecodeMlpWeights::random(GemvWeightFormat::affine(4, 64, DType::bf16), 1024, 2816, ++seed);
  EXPECT_THROW(DecodeMlpExecutor::build(weights, 17, device()), InputError);  // decode is 1..16 rows
  DecodeMlpOptions options = quick_options();
  options.mode = DispatchMode::native;
  DecodeMlpExecutor native = DecodeMlpExecutor::build(weights, 1, device(), options);
  EXPECT_EQ(chosen(native.gate_up_report()).id.kind, CandidateKind::native) << native.report();
  EXPECT_EQ(chosen(native.down_report()).id.kind, CandidateKind::native) << native.report();
  options.mode = DispatchMode::fused;
  DecodeMlpExecutor fused = DecodeMlpExecutor::build(weights, 1, device(), options);
  EXPECT_EQ(chosen(fused.gate_up_report()).id.kind, CandidateKind::fused) << fused.report();
  EXPECT_EQ(chosen(fused.down_report()).id.kind, CandidateKind::fused) << fused.report();
  const HostTensor x = gemv_testing::random_tensor(TensorSpec({1, 1024}, DType::bf16), ++seed);
  const HostTensor residual = gemv_testing::random_tensor(TensorSpec({1, 1024}, DType::bf16), ++seed);
  const NumericGateResult same = numeric_gate(fused.run(x, residual), native.run(x, residual));
  EXPECT_LE(same.relative_l2, 2e-2) << same.detail;
}

TEST_F(DecodeMlpExecutorTest, StoredDecisionIsReused) {
  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / fmt::format("metile_mlp_decisions_{}.json", ::getpid());
  std::filesystem::remove(file);
  const DecodeMlpWeights weights = DecodeMlpWeights::random(GemvWeightFormat::dense(DType::f16), 512, 1408, 77);
  DecodeMlpOptions options = quick_options();
  options.use_decision_cache = true;
  options.decision_cache_file = file;
  DecodeMlpExecutor first = DecodeMlpExecutor::build(weights, 3, device(), options);
  EXPECT_FALSE(first.gate_up_report().from_cache);
  DecodeMlpExecutor second = DecodeMlpExecutor::build(weights, 3, device(), options);
  EXPECT_TRUE(second.gate_up_report().from_cache) << second.report();
  EXPECT_TRUE(second.down_report().from_cache) << second.report();
  EXPECT_EQ(chosen(second.gate_up_report()).name, chosen(first.gate_up_report()).name);
  EXPECT_EQ(chosen(second.down_report()).name, chosen(first.down_report()).name);
  std::filesystem::remove(file);
}

// The gate/up shape its race nearly chose is raced again on the whole MLP, with the chosen down after it
// (DecodeMlpOptions::near_tie_margin): with a margin wide enough that every fused shape is near, the whole race
// has that one candidate, gated; whichever wins, the gate/up report names the pair the executor replays, and the
// executor, its plain-order graph and its stages' graph compute the MLP. With the margin 0 it is not raced.
TEST_F(DecodeMlpExecutorTest, TheGateUpNearTieIsRacedOnTheWholeMlp) {
  std::uint64_t seed = next_seed();
  const GemvWeightFormat format = GemvWeightFormat::affine(4, 64, DType::bf16);
  const std::int64_t hidden = 1024, intermediate = 2816, rows = 16;
  const DecodeMlpWeights weights = DecodeMlpWeights::random(format, hidden, intermediate, ++seed);
  auto near_ties = [](const DecodeMlpExecutor& executor) {
    std::vector<DecodeMlpCandidate> found;
    for (const DecodeMlpCandidate& candidate : executor.whole_report().candidates) {
      if (candidate.id.variant == "stages near tie") found.push_back(candidate);
    }
    return found;
  };
  DecodeMlpOptions options = quick_options();
  options.mode = DispatchMode::fused;
  options.near_tie_margin = 0;
  EXPECT_TRUE(near_ties(DecodeMlpExecutor::build(weights, rows, device(), options)).empty());
  options.near_tie_margin = 100;
  DecodeMlpExecutor executor = DecodeMlpExecutor::build(weights, rows, device(), options);
  std::cout << "[report]\n" << executor.report();
  const std::vector<DecodeMlpCandidate> raced = near_ties(executor);
  ASSERT_EQ(raced.size(), 1u) << executor.report();
  EXPECT_TRUE(raced[0].gate.passed) << raced[0].gate.detail;
  EXPECT_GE(raced[0].score_ms, 0.0);
  const DecodeMlpCandidate& whole = chosen(executor.whole_report());
  ASSERT_EQ(chosen(executor.gate_up_report()).id.kind, CandidateKind::fused) << executor.report();
  if (whole.id.variant == "stages near tie" || whole.id.variant == "stages") {
    // The pair the whole MLP chose starts with the gate/up shape the report now names.
    EXPECT_EQ(whole.kernel.rfind(chosen(executor.gate_up_report()).name + " + ", 0), 0u)
        << whole.kernel << " / " << chosen(executor.gate_up_report()).name;
  }
  EXPECT_EQ(whole.id.variant == "stages near tie",
            executor.gate_up_report().sentence.find("near tie") != std::string::npos)
      << executor.gate_up_report().sentence;

  TensorMap inputs = weights.weight_inputs();
  inputs["x"] = gemv_testing::random_tensor(TensorSpec({rows, hidden}, format.activation), ++seed);
  inputs["residual"] = gemv_testing::random_tensor(TensorSpec({rows, hidden}, format.activation), ++seed);
  const HostTensor reference = run_reference(weights.graph(rows), inputs).at("out");
  const NumericGateResult replayed = numeric_gate(executor.run(inputs["x"], inputs["residual"]), reference);
  EXPECT_TRUE(replayed.passed) << replayed.detail;
  for (int graph = 0; graph < 2; ++graph) {
    const_cast<DeviceTensor&>(executor.out()).buffer.fill_bytes(0xFF);  // each graph must write every element
    graph == 0 ? executor.enqueue_serialized(executor.stream()) : executor.enqueue_stages(executor.stream());
    executor.stream().synchronize();
    const NumericGateResult result = numeric_gate(executor.out().to_host(), reference);
    EXPECT_TRUE(result.passed) << (graph == 0 ? "serialized: " : "stages: ") << result.detail;
  }
}

TEST(DecodeMlpWeightsTest, RejectsMismatchedMatrices) {
  const DecodeMlpWeights weights = DecodeMlpWeights::random(GemvWeightFormat::dense(DType::bf16), 64, 96, 1);
  try {
    DecodeMlpWeights::dense(weights.gate, weights.up, weights.gate);
    FAIL() << "a [96, 64] down matrix was accepted for hidden 64, intermediate 96";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("down is bf16[96, 64]"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace metile
