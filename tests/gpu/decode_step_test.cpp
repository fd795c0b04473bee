// A model's decode step on the GPU (docs/architecture.md, "Device values and aliasing"): the native
// kernels of the step's ops (embedding, quantized_embedding 4/8-bit, position_mask, rope with
// Llama 3 scaling, kv_cache_write copied and in place) and flash_attention (native plain-op path and
// the fused candidate) against the CPU reference on fresh random inputs; an unverified certificate
// refused by both; whole step graphs of synthetic checkpoints (llama, qwen2, mistral; bf16, 4-bit,
// 8-bit) through Executable in native and fused mode against run_reference (fused: every layer's rope
// and cache writes as one rope_kv_cache kernel); and the in-place cache:
// after two steps with caller-owned (borrowed) cache buffers, those buffers hold what the
// reference computes. Seed printed; METILE_TEST_SEED replays a run. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <memory>
#include <unistd.h>

#include "gpu_test_support.h"
#include "metile_test_support.h"
#include "metile/cpu_runtime.h"
#include "metile/discovery.h"
#include "metile/dispatch.h"
#include "metile/model.h"

namespace metile {
namespace {

using testing_support::CudaDeviceTest;
using testing_support::expect_outputs_match;

std::uint64_t seed_base() {
  static const std::uint64_t seed = testing::test_seed("decode step on the GPU");
  return seed;
}

// Runs every node natively (NativeRuntime over one DeviceValues) on `inputs`.
TensorMap run_native(const ComputeGraph& graph, const TensorMap& inputs, DeviceValues& values) {
  values.upload_inputs(inputs);
  values.poison_computed_values();
  NativeRuntime native;
  const std::vector<DeviceStep> steps = native.graph_steps(graph, values);
  CudaStream stream;
  run_steps(steps, stream);
  stream.synchronize();
  return values.download_outputs();
}

Attributes llama3_rope(double theta) {
  Attributes attributes;
  attributes.set("theta", theta);
  attributes.set("scaling", std::string("llama3"));
  attributes.set("factor", 8.0);
  attributes.set("low_freq_factor", 1.0);
  attributes.set("high_freq_factor", 4.0);
  attributes.set("original_max_position_embeddings", 64.0);  // small, so all three bands occur
  return attributes;
}

class DecodeStepKernels : public CudaDeviceTest {};

TEST_F(DecodeStepKernels, EveryNewKernelMatchesTheReference) {
  for (DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    GraphBuilder b;
    auto ids = b.input("ids", {{5}, DType::i32});
    auto positions = b.input("positions", {{5}, DType::i32});
    std::vector<ValueRef> outputs = {b.embedding(ids, b.input("table", {{97, 80}, dtype}), "embedded")};
    for (int bits : {4, 8}) {
      outputs.push_back(b.quantized_embedding(
          ids, b.input(fmt::format("packed{}", bits), {{97, 128 * bits / 32}, DType::u32}),
          b.input(fmt::format("scales{}", bits), {{97, 4}, dtype}), b.input(fmt::format("biases{}", bits), {{97, 4}, dtype}),
          bits, 32, fmt::format("quantized{}", bits)));
    }
    outputs.push_back(b.position_mask(b.input("scores", {{3, 10, 37}, dtype}), positions, "masked"));
    outputs.push_back(
        b.add_node("rope", {b.input("x", {{4, 5, 64}, dtype}), positions}, llama3_rope(500000.0), "rotated").front());
    // One cache written in place (nothing else reads it), one copied (a second reader).
    auto update = b.input("update", {{2, 5, 24}, dtype});
    auto in_place = b.kv_cache_write(b.input("cache", {{2, 41, 24}, dtype}), update, positions, "in_place");
    auto shared = b.input("shared_cache", {{2, 41, 24}, dtype});
    auto copied = b.kv_cache_write(shared, update, positions, "copied");
    outputs.push_back(in_place);
    outputs.push_back(copied);
    outputs.push_back(b.scale(shared, 2.0, "second_reader"));
    const ComputeGraph graph = b.build(outputs);
    const TensorMap inputs = random_inputs(graph, seed_base());
    DeviceValues values(graph);
    EXPECT_TRUE(values.shares_buffer(in_place.id, graph.find_value("cache").value()));
    EXPECT_FALSE(values.shares_buffer(copied.id, shared.id));
    const TensorMap outputs_device = run_native(graph, inputs, values);
    expect_outputs_match(graph, outputs_device, run_reference(graph, inputs), "decode-step kernels");
  }
}

// A token id outside the table (the reference rejects it) reads nothing and yields a NaN row.
TEST_F(DecodeStepKernels, AnOutOfRangeTokenIdGivesANanRowNotAStrayRead) {
  GraphBuilder b;
  auto ids = b.input("ids", {{3}, DType::i32});
  auto out = b.embedding(ids, b.input("table", {{7, 16}, DType::bf16}), "embedded");
  const ComputeGraph graph = b.build({out});
  TensorMap inputs = random_inputs(graph, seed_base() + 1);
  const std::vector<double> bad = {2, 7, -1};
  inputs["ids"] = HostTensor::from_values(TensorSpec({3}, DType::i32), bad);
  DeviceValues values(graph);
  const std::vector<double> rows = run_native(graph, inputs, values).at("embedded").to_values();
  for (int column = 0; column < 16; ++column) {
    EXPECT_EQ(rows[static_cast<std::size_t>(column)], inputs.at("table").at(2 * 16 + column));
    EXPECT_TRUE(std::isnan(rows[static_cast<std::size_t>(16 + column)]));
    EXPECT_TRUE(std::isnan(rows[static_cast<std::size_t>(32 + column)]));
  }
}

// ---------------------------------------------------------------- flash_attention
ComputeGraph attention_graph(std::int64_t heads, std::int64_t rows, std::int64_t keys, std::int64_t dim,
                             const std::string& mask, const Certificate& certificate) {
  GraphBuilder b;
  std::vector<ValueRef> inputs = {b.input("q", {{heads, rows, dim}, DType::bf16}), b.input("k", {{heads, keys, dim}, DType::bf16}),
                                  b.input("v", {{heads, keys, dim}, DType::bf16})};
  Attributes attributes;
  attributes.set("scale", 1.0 / std::sqrt(static_cast<double>(dim)));
  attributes.set("mask", mask);
  if (mask == "causal") attributes.set("offset", std::int64_t{keys - rows});  // the causal mask's alone
  if (mask == "positions") inputs.push_back(b.input("positions", {{rows / 2}, DType::i32}));
  attributes.set("certificate", certificate.to_json());
  return b.build(b.add_node("flash_attention", inputs, attributes, "attention"));
}

TEST_F(DecodeStepKernels, FlashAttentionNativeAndFusedMatchTheReference) {
  const Certificate certificate = prove(stable_weighted_softmax_law());
  ASSERT_TRUE(certificate.verified);
  struct Case {
    std::int64_t rows, keys, dim;
    std::string mask;
  };
  // Decode (R <= 16: grouped rows over a cache, positions) and prefill (causal), keys not a multiple of any tile.
  for (const Case& c : {Case{8, 203, 128, "positions"}, Case{16, 77, 64, "positions"}, Case{48, 130, 64, "causal"},
                        Case{40, 100, 128, "none"}}) {
    SCOPED_TRACE(fmt::format("R {} T {} D {} mask {}", c.rows, c.keys, c.dim, c.mask));
    const ComputeGraph graph = attention_graph(2, c.rows, c.keys, c.dim, c.mask, certificate);
    const TensorMap inputs = random_inputs(graph, seed_base() + static_cast<std::uint64_t>(c.rows * 1000 + c.keys));
    const TensorMap reference = run_reference(graph, inputs);
    DeviceValues values(graph);
    expect_outputs_match(graph, run_native(graph, inputs, values), reference, "native (plain ops)");

    const Lowered lowered = flash_attention_candidates(graph, single_node_region(graph, 0));
    ASSERT_TRUE(lowered.decision.ok) << lowered.decision.reason;
    ASSERT_FALSE(lowered.candidates.empty());
    EXPECT_EQ(lowered.candidates[0].id.variant, c.rows <= 16 ? "attention decode" : "attention prefill");
    if (c.rows > 16) {
      EXPECT_EQ(lowered.candidates.size(), 1u);
    }
    // Every launch shape the tournament may pick (decode: decode_attention_variants) gives the reference.
    for (const FusedCandidate& candidate : lowered.candidates) {
      values.poison_computed_values();
      const DeviceStep step = candidate.bind(values);
      CudaStream stream;
      step(stream);
      stream.synchronize();
      expect_outputs_match(graph, values.download_outputs(), reference, "fused " + candidate.id.name());
    }
  }
}

TEST_F(DecodeStepKernels, AnUnverifiedCertificateIsRefusedByBothPaths) {
  Certificate forged = prove(stable_weighted_softmax_law());
  forged.verified = false;
  const ComputeGraph graph = attention_graph(2, 4, 64, 64, "none", forged);
  const Lowered lowered = flash_attention_candidates(graph, single_node_region(graph, 0));
  EXPECT_FALSE(lowered.decision.ok);
  EXPECT_NE(lowered.decision.reason.find("not verified"), std::string::npos) << lowered.decision.reason;
  DeviceValues values(graph);
  NativeRuntime native;
  EXPECT_NE(testing::error_of([&] { native.node_step(graph, 0, values); }).find("not verified"), std::string::npos);
}

// Attention inside the output projection (the attention_output_projection region, GemvKernelConfig::
// attention): on a one-layer decode step of a synthetic checkpoint with head dim 64 (Llama: 12 query
// heads over 4 KV heads; 4-bit g64 and bf16 weights), every candidate of the region (the GEMV whose
// blocks attend first, each shape; and the attention kernel then the projection) against
// run_reference on the region's graph: random q, caches and residual, the positions at the first
// slot, inside the cache and past its end (every key visible). Each GEMV runs three times eagerly
// and twice as a CUDA graph replay, so a counter left armed by one launch would break the next.
TEST_F(DecodeStepKernels, AttentionInsideTheProjectionMatchesTheReference) {
  for (const std::optional<AffineQuantization> quantize : {std::optional<AffineQuantization>{AffineQuantization{4, 64}},
                                                           std::optional<AffineQuantization>{}}) {
    const std::filesystem::path directory =
        std::filesystem::temp_directory_path() / fmt::format("metile-attention-projection-{}", ::getpid());
    std::filesystem::remove_all(directory);
    SynthOptions synth;
    synth.preset = "small";
    synth.layers = 1;
    synth.seed = seed_base();
    synthesize_model(directory, synth);
    const DecoderModel model = DecoderModel::load(directory, {.quantize = quantize, .max_sequence = 48});
    std::filesystem::remove_all(directory);
    const FusionPlan plan = plan_with_discovery(model.step_graph(1), FusionTarget::h200());
    const ComputeGraph& graph = *plan.graph;  // the rewritten graph: flash_attention in place of the chain
    const FusionRegion* region = nullptr;
    for (const FusionRegion& candidate : plan.regions) {
      if (candidate.rule == "attention_output_projection") region = &candidate;
    }
    ASSERT_NE(region, nullptr) << plan.explain();
    const ComputeGraph sub = region_graph(graph, *region);
    const FusionRegion in_sub = region_in_region_graph(graph, *region, sub);
    const RegionLowerings lowered = lower_region(sub, in_sub);
    int attending = 0;
    for (const std::int32_t position : {0, 29, 400}) {
      SCOPED_TRACE(fmt::format("{} position {}", quantize ? "4-bit" : "bf16", position));
      TensorMap inputs = random_inputs(sub, seed_base() + 77 + static_cast<std::uint64_t>(position));
      HostTensor& positions = inputs.at(sub.value(*in_sub.role("positions")).name);
      positions.store(0, position);
      const TensorMap reference = run_reference(sub, inputs);
      DeviceValues values(sub);
      values.upload_inputs(inputs);
      CudaStream stream;
      for (const FusedCandidate& candidate : lowered.candidates) {
        const bool attends = candidate.id.variant.find(" attend") != std::string::npos;
        if (!attends && candidate.id.variant.rfind("attention decode, then gemv", 0) != 0) continue;
        attending += attends;
        DeviceStep step;
        try {
          step = candidate.bind(values);
        } catch (const CudaError& error) {
          ADD_FAILURE() << candidate.id.name() << " did not load: " << error.what();
          continue;
        }
        for (int run = 0; run < 3; ++run) {
          values.poison_computed_values();
          step(stream);
          stream.synchronize();
          expect_outputs_match(sub, values.download_outputs(), reference, fmt::format("{}, run {}", candidate.id.name(), run));
        }
        const CudaGraph replay = CudaGraph::capture(stream, step);
        for (int run = 0; run < 2; ++run) {
          values.poison_computed_values();
          replay.replay(stream);
          stream.synchronize();
          expect_outputs_match(sub, values.download_outputs(), reference, fmt::format("{}, replay {}", candidate.id.name(), run));
        }
      }
    }
    EXPECT_GE(attending, 6) << lowered.refusals;  // at least two shapes at each position
  }
}

// ---------------------------------------------------------------- whole step graphs
struct Checkpoint {
  ModelArchitecture architecture;
  std::optional<AffineQuantization> quantize;
  std::string name;
};

DecoderModel load_synthetic(const Checkpoint& checkpoint) {
  const std::filesystem::path directory = std::filesystem::temp_directory_path() /
                                          fmt::format("metile-decode-step-{}-{}", checkpoint.name, ::getpid());
  std::filesystem::remove_all(directory);
  SynthOptions synth;
  synth.preset = "tiny";
  synth.architecture = checkpoint.architecture;
  synth.seed = seed_base();
  synthesize_model(directory, synth);
  LoadOptions load;
  load.quantize = checkpoint.quantize;
  load.max_sequence = 48;
  DecoderModel model = DecoderModel::load(directory, load);
  std::filesystem::remove_all(directory);
  return model;
}

// Seeded token ids and caches; the checkpoint's own weights; distinct non-zero positions within the
// 48-row caches (20, 27, 34, ...). random_inputs draws rope positions in [0, S): at S = 1 that is 0,
// where RoPE is the identity and attention sees only the row the step writes, so neither a wrong
// rotation nor a wrong read of the cache could change an output.
TensorMap step_inputs(const DecoderModel& model, const ComputeGraph& graph, std::uint64_t seed) {
  TensorMap inputs = random_inputs(graph, seed);
  for (const auto& [name, weight] : model.weights()) {
    if (inputs.contains(name)) inputs[name] = weight;
  }
  HostTensor& positions = inputs.at("positions");
  for (std::int64_t s = 0; s < positions.element_count(); ++s) positions.store(s, static_cast<double>(20 + 7 * s));
  EXPECT_LT(20 + 7 * (positions.element_count() - 1), 48);
  return inputs;
}

std::vector<Checkpoint> checkpoints() {
  std::vector<Checkpoint> result;
  for (auto [architecture, name] : {std::pair{ModelArchitecture::llama, "llama"}, std::pair{ModelArchitecture::qwen2, "qwen2"},
                                    std::pair{ModelArchitecture::mistral, "mistral"}}) {
    result.push_back({architecture, std::nullopt, std::string(name) + "_bf16"});
    result.push_back({architecture, AffineQuantization{4, 64}, std::string(name) + "_4bit"});
    result.push_back({architecture, AffineQuantization{8, 64}, std::string(name) + "_8bit"});
  }
  return result;
}

class StepGraphOnTheGpu : public CudaDeviceTest, public ::testing::WithParamInterface<Checkpoint> {};

TEST_P(StepGraphOnTheGpu, NativeAndFusedExecutablesMatchTheReference) {
  const DecoderModel model = load_synthetic(GetParam());
  // S = 3 (real head transposes, 3-row attention) on the bf16 checkpoints; every one at S = 1.
  const std::vector<std::int64_t> step_counts = GetParam().quantize ? std::vector<std::int64_t>{1} : std::vector<std::int64_t>{1, 3};
  for (std::int64_t steps : step_counts) {
    const ComputeGraph& graph = model.step_graph(steps);
    const FusionPlan plan = plan_with_discovery(graph, FusionTarget::h200());
    const TensorMap inputs = step_inputs(model, graph, seed_base() + static_cast<std::uint64_t>(steps));
    const TensorMap reference = run_reference(graph, inputs);
    for (DispatchMode mode : {DispatchMode::native, DispatchMode::fused}) {
      SCOPED_TRACE(fmt::format("S {} mode {}", steps, dispatch_mode_name(mode)));
      ExecutableOptions options;
      options.mode = mode;
      options.use_decision_cache = false;
      Executable executable = Executable::build(plan, device(), options);
      if (mode == DispatchMode::fused && steps == 1) std::cerr << executable.report();
      if (mode == DispatchMode::fused) {
        // Each layer's q/k/v projections, rope on q and k and both cache writes: one
        // qkv_rope_kv_cache region whose candidates passed their gates (fused mode keeps a fused
        // candidate exactly then: the GEMV with the rope epilogue, or the stacked GEMV then the rope kernel).
        int rope_regions = 0;
        for (const RegionReport& report : executable.reports()) {
          if (report.rule != "qkv_rope_kv_cache") continue;
          ++rope_regions;
          EXPECT_EQ(report.chosen_id.kind, CandidateKind::fused) << report.sentence;
          for (const auto& [name, gate] : report.gates) {
            if (name.starts_with("fused")) {
              EXPECT_TRUE(gate.passed) << name << ": " << gate.detail;
            }
          }
        }
        EXPECT_EQ(rope_regions, model.config().num_hidden_layers) << executable.report();
      }
      expect_outputs_match(graph, executable.run(inputs), reference, "step graph",
                           testing_support::kWholeStepMaxErrorFactor);
    }
  }
}

// Two steps with the caches borrowed from the caller: after each, the caller's buffers hold the
// cache run_reference computes (the write happened in place, into them).
class BorrowedCaches : public StepGraphOnTheGpu {};

TEST_P(BorrowedCaches, AreUpdatedInPlaceOverTwoSteps) {
  const DecoderModel model = load_synthetic(GetParam());
  const ComputeGraph& graph = model.step_graph(1);
  const FusionPlan plan = plan_with_discovery(graph, FusionTarget::h200());
  TensorMap state = step_inputs(model, graph, seed_base() + 7);
  ExecutableOptions options;
  options.mode = DispatchMode::fused;
  options.use_decision_cache = false;
  std::map<std::string, DeviceTensor> caches;
  for (std::int64_t layer = 0; layer < model.config().num_hidden_layers; ++layer) {
    for (const char* which : {"k", "v"}) {
      const std::string name = fmt::format("layers.{}.{}_cache", layer, which);
      caches.emplace(name, DeviceTensor::from_host(state.at(name)));
      options.external_values[name] = caches.at(name).address();
    }
  }
  Executable executable = Executable::build(plan, device(), options);
  for (std::int32_t position : {5, 6}) {
    SCOPED_TRACE(position);
    const std::vector<double> token = {static_cast<double>(position * 11 % model.config().vocab_size)};
    const std::vector<double> at = {static_cast<double>(position)};
    state["token_ids"] = HostTensor::from_values(TensorSpec({1}, DType::i32), token);
    state["positions"] = HostTensor::from_values(TensorSpec({1}, DType::i32), at);
    const TensorMap reference = run_reference(graph, state);
    TensorMap inputs = state;
    for (const auto& [name, cache] : caches) inputs.erase(name);  // on the device already
    const TensorMap outputs = executable.run(inputs);
    // A whole step: the gate widened by kWholeStepMaxErrorFactor (gpu_test_support.h).
    const auto within = [](const HostTensor& actual, const HostTensor& expected) {
      const NumericGateResult gate = numeric_gate(actual, expected);
      const double limit = testing_support::kWholeStepMaxErrorFactor * gate.threshold;
      return gate.relative_l2 <= limit && gate.relative_max <= limit;
    };
    for (const auto& [name, cache] : caches) {
      const HostTensor expected = reference.at(name + "_out");
      EXPECT_TRUE(within(cache.to_host(), expected)) << name << ": " << numeric_gate(cache.to_host(), expected).detail;
      EXPECT_TRUE(within(outputs.at(name + "_out"), expected)) << name << "_out";
      state[name] = expected;  // the next step reads the cache this one wrote
    }
    EXPECT_TRUE(within(outputs.at("logits"), reference.at("logits")));
  }
}

INSTANTIATE_TEST_SUITE_P(Synthetic, StepGraphOnTheGpu, ::testing::ValuesIn(checkpoints()),
                         [](const auto& info) { return info.param.name; });
// One checkpoint per architecture, one per weight format.
INSTANTIATE_TEST_SUITE_P(Synthetic, BorrowedCaches,
                         ::testing::Values(checkpoints()[0], checkpoints()[4], checkpoints()[8]),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace metile
