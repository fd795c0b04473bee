// The GEMV lowerings on the GPU (src/dispatch/gemv_lowering.cpp): every candidate of each lowering
// (swiglu_mlp, contraction_epilogue with a residual or a bias, an unfused contraction) at sizes
// that are not multiples of the tile, N below the SM count, M = 1, 5, 16, dense bf16/f16 and
// affine 4/8-bit, against the CPU reference; examples/decoder_layer.json through the Executable
// with its swiglu_mlp region fused; and a tiny model's step graph (plan_with_discovery, fused
// mode) against run_reference; and the GEMVs that normalize their x (a region's RMSNorm inside it)
// against a float64 evaluation. Inputs are fresh per run (seed printed, METILE_TEST_SEED replays).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <random>

#include "gemv_region_graphs.h"
#include "gpu_test_support.h"
#include "metile/discovery.h"
#include "metile/model.h"
#include "metile/quant.h"
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
    EXPECT_FALSE(lowered.candidates.empty()) << what << ": no candidate to check";
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

using testing::region_of_rule;

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

// The LM head with its argmax (contraction_argmax): every GEMV candidate writes logits that pass the
// gate against the CPU reference and, in next, exactly each row's argmax of the logits it wrote
// (a brute-force argmax here; near ties may round apart from the reference's, so the reference's
// indices are not the oracle). N = 1000 is not a multiple of the tile; 128256 is Llama 3's
// vocabulary (one dense case: 8016 blocks meet in the join).
TEST_F(GemvLowering, LmHeadArgmaxCandidatesWriteTheArgmaxOfTheirLogits) {
  struct Case {
    LinearFormat format;
    std::int64_t rows, n, k;
  };
  std::vector<Case> cases = {{{16, 0, DType::bf16}, 1, 128256, 512}};
  for (const LinearFormat& format : formats()) {
    for (std::int64_t rows : {1, 5, 16}) cases.push_back({format, rows, 1000, 384});
  }
  for (const Case& c : cases) {
    const ComputeGraph graph = testing::projection_test_graph(c.rows, c.n, c.k, c.format, "argmax");
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion region = contraction_node_region(*plan.graph, plan.unfused.at(0));
    const std::string what = fmt::format("LM head argmax bits {} {} M={} N={}", c.format.bits, dtype_name(c.format.dtype),
                                         c.rows, c.n);
    const Lowered lowered = gemv_region_candidates(*plan.graph, region);
    ASSERT_TRUE(lowered.decision) << what << ": " << lowered.decision.reason;
    ASSERT_FALSE(lowered.candidates.empty()) << what << ": no candidate to check";
    DeviceValues values(*plan.graph);
    const TensorMap inputs = random_inputs(*plan.graph, seed() + 200 + c.rows);
    values.upload_inputs(inputs);
    const TensorMap reference = run_reference(*plan.graph, inputs);
    CudaStream stream;
    for (const FusedCandidate& candidate : lowered.candidates) {
      const DeviceStep step = candidate.bind(values);
      for (int launch = 0; launch < 2; ++launch) {  // the second launch finds the join's counter re-armed
        values.poison_computed_values();
        step(stream);
        stream.synchronize();
        const TensorMap outputs = values.download_outputs();
        const NumericGateResult gate = gate_region_outputs(*plan.graph, outputs, reference);
        EXPECT_TRUE(gate.passed) << what << ", " << candidate.id.name() << " launch " << launch << ": " << gate.detail;
        const HostTensor& logits = outputs.at("p0");
        for (std::int64_t row = 0; row < c.rows; ++row) {
          std::vector<double> own(static_cast<std::size_t>(c.n));
          for (std::int64_t column = 0; column < c.n; ++column) own[static_cast<std::size_t>(column)] = logits.at(row * c.n + column);
          EXPECT_EQ(outputs.at("n0").at(row), static_cast<double>(testing::brute_force_argmax(own)))
              << what << ", " << candidate.id.name() << " launch " << launch << " row " << row;
        }
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
// swiglu_mlp, contraction_epilogue, sibling_contractions and contraction regions all lowered.
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
    // The 4-bit case is Qwen2-like: q, k and v with biases (one sibling_contractions region per layer).
    if (bits == 4) synth.architecture = ModelArchitecture::qwen2;
    const std::filesystem::path directory = root / (bits ? fmt::format("q{}", *bits) : std::string("bf16"));
    synthesize_model(directory, synth);
    const DecoderModel model = DecoderModel::load(directory, {DType::bf16, {}, 64});
    {
      const ComputeGraph& graph = model.step_graph(steps);
      const FusionPlan plan = plan_with_discovery(graph, FusionTarget::h200());
      Executable executable = Executable::build(plan, device(), quick_options());
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

// ---------------------------------------------------------------- the GEMV that normalizes its x
// GemvKernelConfig::x_rms_norm_eps: a region took the RMSNorm of its input as its input prologue.
// Every candidate of the q/k/v group, the SwiGLU MLP and the LM head with its argmax, each reading
// rms_norm(a, g), against a float64 evaluation of the graph written here (the norm, the weights
// dequantized exactly, the products and epilogues, no rounding in between); dense bf16 and 4/8-bit
// affine weights, M = 1 and 16, K not a multiple of the mainloop's columns per iteration; and the
// LM head through the Executable, where the final norm joins the contraction_argmax region.

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

struct NormalizedCase {
  LinearFormat format;
  std::int64_t rows;
  std::int64_t columns = 0;  // K; 0: 200 dense, 320 quantized (not a multiple of 32 (dense) or 128 (4-bit))
  std::int64_t k() const { return columns > 0 ? columns : format.bits == 16 ? 200 : 320; }
  std::string name() const {
    return fmt::format("bits {} {} M={} K={}", format.bits, dtype_name(format.dtype), rows, k());
  }
};

std::vector<NormalizedCase> normalized_cases() {
  std::vector<NormalizedCase> all;
  for (const LinearFormat& format :
       {LinearFormat{16, 0, DType::bf16}, LinearFormat{4, 64, DType::bf16}, LinearFormat{8, 64, DType::bf16}}) {
    for (std::int64_t rows : {1, 16}) all.push_back({format, rows});
  }
  // A K long enough that the threads of an eight-warp block (these N are narrow: 8 and 16 warps) each
  // take more than eight vectors of x for the norm's sum of squares (for_each_thread_vector's batches
  // of eight, the last one partial; x this long is normalized as it is loaded, not staged).
  all.push_back({LinearFormat{16, 0, DType::bf16}, 1, 16648});
  return all;
}

TEST_F(NormalizedGemv, SiblingCandidatesMatchTheFloat64Reference) {
  for (const NormalizedCase& c : normalized_cases()) {
    const ComputeGraph graph = testing::sibling_test_graph(c.rows, {96, 32, 32}, c.k(), c.format, {true, false, true}, true);
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion* region = region_of_rule(plan, "sibling_contractions");
    ASSERT_NE(region, nullptr) << plan.explain();
    expect_every_candidate_matches(*plan.graph, *region, "q/k/v " + c.name());
  }
}

TEST_F(NormalizedGemv, SwigluCandidatesMatchTheFloat64Reference) {
  for (const NormalizedCase& c : normalized_cases()) {
    const std::int64_t intermediate = c.format.bits == 16 ? 328 : 320;
    const ComputeGraph graph = testing::swiglu_test_graph(c.rows, c.k(), intermediate, c.format, c.rows == 16, true, true);
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion* region = region_of_rule(plan, "swiglu_mlp");
    ASSERT_NE(region, nullptr) << plan.explain();
    expect_every_candidate_matches(*plan.graph, *region, "swiglu " + c.name());
  }
}

// N = 1000 for every format and row count; then the decode case of a vocabulary-wide head (4-bit,
// M = 1, 40000 rows: 2500 tile blocks, enough for the candidates whose blocks loop over tile blocks
// with the norm and the staged x computed once per block), at K = 320 and 8192, at M = 16 and 8-bit.
TEST_F(NormalizedGemv, LmHeadArgmaxCandidatesMatchTheFloat64Reference) {
  std::vector<std::pair<NormalizedCase, std::int64_t>> cases;
  for (const NormalizedCase& c : normalized_cases()) cases.emplace_back(c, 1000);
  cases.emplace_back(NormalizedCase{LinearFormat{4, 64, DType::bf16}, 1}, 40000);
  // Two-warp blocks staging a 16 KiB x: 16 vectors a thread for the sum of squares and the staging.
  cases.emplace_back(NormalizedCase{LinearFormat{4, 64, DType::bf16}, 1, 8192}, 40000);
  // The prefill chunk's 16 rows through the looped blocks (batches carried from tile to tile, one
  // argmax winner a block per row: rows belong to different warps) and 8-bit's wider batches.
  cases.emplace_back(NormalizedCase{LinearFormat{4, 64, DType::bf16}, 16}, 40000);
  cases.emplace_back(NormalizedCase{LinearFormat{8, 64, DType::bf16}, 1}, 40000);
  for (const auto& [c, n] : cases) {
    const ComputeGraph graph = testing::projection_test_graph(c.rows, n, c.k(), c.format, "argmax", true);
    const FusionPlan plan = plan_graph_fusion(graph);
    const FusionRegion region = contraction_node_region(*plan.graph, *plan.graph->find_node("p0"));
    EXPECT_EQ(region.rule, "contraction_argmax");
    expect_every_candidate_matches(*plan.graph, region, fmt::format("LM head {} N={}", c.name(), n));
  }
}

// The Executable offers the LM head with the final norm as one region (the norm is unfused in the
// plan); in fused mode its GEMV wins and the step's logits match the float64 values.
TEST_F(NormalizedGemv, TheExecutableTakesTheFinalNormIntoTheLmHead) {
  const ComputeGraph graph = testing::projection_test_graph(1, 1000, 320, {4, 64, DType::bf16}, "argmax", true);
  const FusionPlan plan = plan_graph_fusion(graph);
  Executable executable = Executable::build(plan, device(), quick_options());
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
