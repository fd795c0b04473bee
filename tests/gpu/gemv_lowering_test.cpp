// The GEMV lowerings on the GPU (src/dispatch/gemv_lowering.cpp): every candidate of each lowering
// (swiglu_mlp, contraction_epilogue with a residual or a bias, an unfused contraction) at sizes
// that are not multiples of the tile, N below the SM count, M = 1, 5, 16, dense bf16/f16 and
// affine 4/8-bit, against the CPU reference; examples/decoder_layer.json through the Executable
// with its swiglu_mlp region fused; and a tiny model's step graph (plan_with_discovery, fused
// mode) against run_reference. Inputs are fresh per run (seed printed, METILE_TEST_SEED replays).
#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
#include <random>

#include "gemv_region_graphs.h"
#include "gpu_test_support.h"
#include "metile/discovery.h"
#include "metile/model.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing::LinearFormat;
using testing_support::CudaDeviceTest;
using testing_support::expect_outputs_match;

std::uint64_t seed() {
  static const std::uint64_t value = testing::test_seed("gemv lowering") % (std::uint64_t{1} << 40);
  return value;
}

class GemvLowering : public CudaDeviceTest {
 protected:
  // Every candidate the lowering offers for `region` of `graph`, bound on the graph's own device
  // values, gated against the CPU reference on fresh inputs (twice: new weights re-derive the
  // repacked copies). Returns the number of candidates.
  std::size_t expect_every_candidate_matches(const ComputeGraph& graph, const FusionRegion& region,
                                             const std::string& what, std::uint64_t input_seed) {
    const Lowered lowered = gemv_region_candidates(graph, region);
    EXPECT_TRUE(lowered.decision) << what << ": " << lowered.decision.reason;
    DeviceValues values(graph);
    TensorMap inputs = random_inputs(graph, input_seed);
    values.upload_inputs(inputs);
    CudaStream stream;
    std::vector<DeviceStep> steps;
    for (const FusedCandidate& candidate : lowered.candidates) steps.push_back(candidate.bind(values));
    for (int round = 0; round < 2; ++round) {
      if (round == 1) {
        inputs = random_inputs(graph, input_seed + 1);
        values.upload_inputs(inputs);
      }
      const TensorMap reference = run_reference(graph, inputs);
      for (std::size_t c = 0; c < steps.size(); ++c) {
        values.poison_computed_values();
        steps[c](stream);
        stream.synchronize();
        expect_outputs_match(graph, values.download_outputs(), reference,
                             fmt::format("{}, {} (round {})", what, lowered.candidates[c].id.name(), round));
      }
    }
    return lowered.candidates.size();
  }
};

const FusionRegion* region_of_rule(const FusionPlan& plan, std::string_view rule) {
  for (const FusionRegion& region : plan.regions) {
    if (region.rule == rule) return &region;
  }
  return nullptr;
}

// Dense bf16, 4-bit and 8-bit (the 8-bit one with f16 activations).
std::vector<LinearFormat> formats() { return {{16, 0, DType::bf16}, {4, 64, DType::bf16}, {8, 64, DType::f16}}; }

// Correctness, not speed: the shortest tournament the engine accepts.
ExecutableOptions quick_options() {
  ExecutableOptions options;
  options.mode = DispatchMode::fused;
  options.use_decision_cache = false;
  options.tournament = {.warmup_calls = 1, .rounds = 1, .calls_per_sample = 1, .samples_per_round = 1, .quantile = 0.5};
  return options;
}

TEST_F(GemvLowering, SwigluCandidatesMatchTheReference) {
  // Dense: hidden 200 and intermediate 328, neither a multiple of the 16-row tile. Affine (K must
  // be a multiple of the group): hidden 192 (12 tiles, fewer than the SMs) and intermediate 320
  // (not a multiple of the 4-bit iteration's 128 columns: padded columns).
  for (const LinearFormat& format : formats()) {
    for (std::int64_t rows : {1, 5, 16}) {
      const bool dense = format.bits == 16;
      const ComputeGraph graph =
          testing::swiglu_test_graph(rows, dense ? 200 : 192, dense ? 328 : 320, format, rows == 5);
      const FusionPlan plan = plan_graph_fusion(graph);
      const FusionRegion* region = region_of_rule(plan, "swiglu_mlp");
      ASSERT_NE(region, nullptr) << plan.explain();
      const std::string what = fmt::format("swiglu bits {} g{} {} M={}", format.bits, format.group_size,
                                           dtype_name(format.dtype), rows);
      std::printf("%s: %zu candidates\n", what.c_str(), expect_every_candidate_matches(*plan.graph, *region, what, seed() + rows));
    }
  }
}

TEST_F(GemvLowering, ProjectionCandidatesMatchTheReference) {
  for (const LinearFormat& format : formats()) {
    for (std::int64_t rows : {1, 5, 16}) {
      // contraction_epilogue with a residual (and, at M = 5, a bias), and a lone contraction.
      for (const std::string epilogue : {"residual", "bias", "none"}) {
        if (epilogue == "bias" && rows != 5) continue;
        // N = 100: not a multiple of 16; K = 384: 3 iterations of 128 columns.
        const ComputeGraph graph = testing::projection_test_graph(rows, 100, 384, format, epilogue);
        const FusionPlan plan = plan_graph_fusion(graph);
        const FusionRegion region = epilogue == "none" ? contraction_node_region(*plan.graph, plan.unfused.at(0))
                                                       : *region_of_rule(plan, "contraction_epilogue");
        const std::string what = fmt::format("projection {} bits {} g{} {} M={}", epilogue, format.bits,
                                             format.group_size, dtype_name(format.dtype), rows);
        expect_every_candidate_matches(*plan.graph, region, what, seed() + 100 + rows);
      }
    }
  }
}

// `metile run examples/decoder_layer.json --backend cuda` in C++: the swiglu_mlp region is fused
// (fused mode takes the fastest fused candidate that passes the gate), every GEMV candidate
// passes its gate, and the plan's outputs match the CPU reference.
TEST_F(GemvLowering, DecoderLayerExampleFusesItsSwigluRegion) {
  const ComputeGraph graph = read_graph(std::filesystem::path(METILE_SOURCE_DIR) / "examples" / "decoder_layer.json");
  const FusionPlan plan = plan_graph_fusion(graph);
  Executable executable = Executable::build(plan, device(), quick_options());
  std::printf("%s", executable.report().c_str());
  bool found = false;
  int gemv_gates = 0;
  for (const RegionReport& report : executable.reports()) {
    if (report.rule != "swiglu_mlp") continue;
    found = true;
    EXPECT_EQ(report.chosen_id.kind, CandidateKind::fused) << report.sentence;
    for (const auto& [name, gate] : report.gates) {
      if (name.rfind("fused gemv", 0) != 0) continue;
      ++gemv_gates;
      EXPECT_TRUE(gate.passed) << name << ": " << gate.detail;
    }
  }
  EXPECT_TRUE(found) << plan.explain();
  EXPECT_GT(gemv_gates, 0) << executable.report();
  const TensorMap inputs = random_inputs(graph, seed() + 7);
  expect_outputs_match(graph, executable.run(inputs), run_reference(graph, inputs), "decoder_layer.json, fused");
}

// A tiny synthetic model's decode step (bf16 S = 1, 4-bit S = 5, 8-bit S = 16), planned for the
// GPU (plan_with_discovery) and run by the Executable in fused mode, against run_reference: the
// swiglu_mlp, contraction_epilogue and contraction regions all lowered.
TEST_F(GemvLowering, TinyModelStepMatchesTheReference) {
  const std::filesystem::path root =
      std::filesystem::temp_directory_path() / ("metile_gemv_lowering_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);  // synthesize_model writes into an existing parent
  std::mt19937_64 generator(seed());
  for (auto [bits, steps] : {std::pair{std::optional<int>{}, std::int64_t{1}}, std::pair{std::optional<int>{4}, std::int64_t{5}},
                             std::pair{std::optional<int>{8}, std::int64_t{16}}}) {
    SynthOptions synth;
    synth.seed = seed();
    if (bits) synth.quantize = AffineQuantization{*bits, 64};
    const std::filesystem::path directory = root / (bits ? fmt::format("q{}", *bits) : std::string("bf16"));
    synthesize_model(directory, synth);
    const DecoderModel model = DecoderModel::load(directory, {DType::bf16, {}, 64});
    {
      const ComputeGraph& graph = model.step_graph(steps);
      const FusionPlan plan = plan_with_discovery(graph, FusionTarget::h200());
      std::optional<Executable> built;
      try {
        built.emplace(Executable::build(plan, device(), quick_options()));
      } catch (const std::exception& error) {
        // The step graph's gathers, cache writes and attention get native kernels on branch
        // engine-ops; until they exist here the model cannot run on the GPU at all.
        const std::string message = error.what();
        if (message.find("no native kernel") != std::string::npos || message.find("flash_attention") != std::string::npos ||
            message.find("cuBLASLt, not a generated kernel") != std::string::npos) {
          GTEST_SKIP() << "the step graph has ops without a native GPU path here: " << message;
        }
        throw;
      }
      Executable& executable = *built;
      const std::string what = fmt::format("tiny model {} S={}", bits ? fmt::format("{}-bit", *bits) : "bf16", steps);
      std::printf("%s\n%s", what.c_str(), executable.report().c_str());
      int gemv_regions = 0;
      for (const RegionReport& report : executable.reports()) {
        gemv_regions += report.chosen_id.variant.rfind("gemv", 0) == 0 ? 1 : 0;
      }
      EXPECT_GT(gemv_regions, 0) << what;

      TensorMap inputs = random_inputs(graph, seed() + 11 + steps);
      for (const auto& [name, tensor] : model.weights()) {
        if (inputs.contains(name)) inputs[name] = tensor;
      }
      std::vector<std::int32_t> tokens, positions;
      for (std::int64_t i = 0; i < steps; ++i) {
        tokens.push_back(static_cast<std::int32_t>(generator() % static_cast<std::uint64_t>(model.config().vocab_size)));
        positions.push_back(static_cast<std::int32_t>(7 + i));
      }
      inputs["token_ids"] = HostTensor::from_values(TensorSpec({steps}, DType::i32),
                                                    std::vector<double>(tokens.begin(), tokens.end()));
      inputs["positions"] = HostTensor::from_values(TensorSpec({steps}, DType::i32),
                                                    std::vector<double>(positions.begin(), positions.end()));
      expect_outputs_match(graph, executable.run(inputs), run_reference(graph, inputs), what,
                           testing_support::kWholeStepMaxErrorFactor);
    }
  }
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace metile
