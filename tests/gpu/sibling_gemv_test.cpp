// Sibling contractions (q, k, v) as one GEMV over their weights stacked by rows
// (src/dispatch/gemv_lowering.cpp, plan_gemv_siblings): every candidate of the lowering, dense
// bf16, 4-bit and 8-bit (f16 activations), M = 1, 5, 16, with Qwen-like biases on some parts,
// part widths that split 16-row tiles, against a float64 oracle written here (the weights
// dequantized exactly, the dot products and bias in double); then the same graph through the
// Executable (the region gated and raced like any other). A tiny model's step with the regions
// fused runs in gemv_lowering_test.cpp (its 4-bit case Qwen2-like, with q/k/v biases).
// The attention inputs after the projections (rope_kv_cache regions: rope on q and k, k and v
// into their caches as one kernel) against a float64 oracle of the unfused ops written here, with
// Llama 3.2's shapes and rope scaling and Qwen2.5's (biased projections), M = 1 and 16, positions
// scattered over the cache, each cache in place and copied; and bit for bit against the native path.
// Inputs are fresh per run (seed printed, METILE_TEST_SEED replays).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

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

// ---------------------------------------------------------------- rope_kv_cache
// rope (rotate-half: element i pairs with i + dims/2, angle position · rope_frequencies) and the
// cache writes, in double from the inputs' values: q rotated [Hq, S, D], both caches [Hkv, T, D].
struct AttentionInputsOracle {
  std::vector<double> q_rotated, k_cache, v_cache;
};
AttentionInputsOracle attention_inputs_oracle(const TensorMap& inputs, const testing::AttentionInputsShape& shape,
                                              const Attributes& rope, const std::string& q, const std::string& k,
                                              const std::string& v) {
  const std::int64_t rows = shape.rows, dim = shape.head_dim, half = rope.get_int("dims") / 2;
  const std::vector<double> frequencies = rope_frequencies(rope);
  const std::vector<double> positions = inputs.at("positions").to_values();
  // Row s of head h of x [S, H·D], rotated at positions[s].
  auto rotated = [&](const std::vector<double>& x, std::int64_t heads, std::int64_t h, std::int64_t s) {
    std::vector<double> row(x.begin() + (s * heads + h) * dim, x.begin() + (s * heads + h + 1) * dim);
    std::vector<double> out = row;
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = positions[static_cast<std::size_t>(s)] * frequencies[static_cast<std::size_t>(i)];
      out[static_cast<std::size_t>(i)] = row[static_cast<std::size_t>(i)] * std::cos(angle) - row[static_cast<std::size_t>(i + half)] * std::sin(angle);
      out[static_cast<std::size_t>(i + half)] = row[static_cast<std::size_t>(i)] * std::sin(angle) + row[static_cast<std::size_t>(i + half)] * std::cos(angle);
    }
    return out;
  };
  AttentionInputsOracle oracle;
  const std::vector<double> qs = inputs.at(q).to_values(), ks = inputs.at(k).to_values(), vs = inputs.at(v).to_values();
  for (std::int64_t h = 0; h < shape.q_heads; ++h) {
    for (std::int64_t s = 0; s < rows; ++s) {
      const std::vector<double> row = rotated(qs, shape.q_heads, h, s);
      oracle.q_rotated.insert(oracle.q_rotated.end(), row.begin(), row.end());
    }
  }
  oracle.k_cache = inputs.at("k_cache").to_values();
  oracle.v_cache = inputs.at("v_cache").to_values();
  for (std::int64_t h = 0; h < shape.kv_heads; ++h) {
    for (std::int64_t s = 0; s < rows; ++s) {
      const auto at = static_cast<std::size_t>((h * shape.capacity + static_cast<std::int64_t>(positions[static_cast<std::size_t>(s)])) * dim);
      const std::vector<double> row = rotated(ks, shape.kv_heads, h, s);
      std::copy(row.begin(), row.end(), oracle.k_cache.begin() + static_cast<std::ptrdiff_t>(at));
      std::copy(vs.begin() + (s * shape.kv_heads + h) * dim, vs.begin() + (s * shape.kv_heads + h + 1) * dim,
                oracle.v_cache.begin() + static_cast<std::ptrdiff_t>(at));
    }
  }
  return oracle;
}

class RopeKvCache : public CudaDeviceTest {};

TEST_F(RopeKvCache, FusedMatchesTheFloat64OracleAndTheNativePath) {
  struct Case {
    std::string name;
    testing::AttentionInputsShape shape;
  };
  testing::AttentionInputsShape llama;  // Llama-3.2-1B: 32/8 heads of 64, rope scaled
  llama.q_heads = 32, llama.kv_heads = 8, llama.head_dim = 64, llama.llama3_scaling = true, llama.theta = 500000;
  testing::AttentionInputsShape qwen;  // Qwen2.5-1.5B: 12/2 heads of 128, biased projections
  qwen.q_heads = 12, qwen.kv_heads = 2, qwen.head_dim = 128, qwen.bias = true, qwen.theta = 1000000;
  std::vector<Case> cases;
  for (std::int64_t rows : {1, 16}) {
    for (auto [name, shape] : {std::pair{"llama", llama}, std::pair{"qwen", qwen}}) {
      shape.rows = rows, shape.capacity = 160, shape.hidden = 256;
      cases.push_back({fmt::format("{} M {}", name, rows), shape});
    }
  }
  for (const Case& test_case : cases) {
    SCOPED_TRACE(test_case.name);
    const ComputeGraph graph = testing::attention_inputs_test_graph(test_case.shape);
    const FusionPlan plan = plan_graph_fusion(graph);
    // The rope and cache writes: the second part of the layer's qkv_rope_kv_cache region.
    const FusionRegion* region = testing::region_of_rule(plan, "rope_kv_cache");
    ASSERT_NE(region, nullptr) << plan.explain();
    const ComputeGraph sub = region_graph(*plan.graph, *region);
    const FusionRegion sub_region = region_in_region_graph(*plan.graph, *region, sub);
    const Lowered lowered = rope_kv_cache_candidates(sub, sub_region);
    ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
    ASSERT_EQ(lowered.candidates.size(), 1u);
    const std::string y = test_case.shape.bias ? ".y" : "";
    // Fresh inputs; positions scattered over the cache, not contiguous, not from zero.
    TensorMap inputs = random_inputs(sub, next_seed());
    std::vector<std::int64_t> rows(static_cast<std::size_t>(test_case.shape.capacity));
    std::iota(rows.begin(), rows.end(), 0);
    SplitMix64 shuffle(next_seed());
    for (std::size_t i = rows.size(); i > 1; --i) std::swap(rows[i - 1], rows[shuffle.next() % i]);
    HostTensor& positions = inputs.at("positions");
    for (std::int64_t s = 0; s < test_case.shape.rows; ++s) positions.store(s, static_cast<double>(rows[static_cast<std::size_t>(s)]));
    const AttentionInputsOracle oracle = attention_inputs_oracle(inputs, test_case.shape, sub.node(*sub.find_node("q.rope")).attributes,
                                                                 "p0" + y, "p1" + y, "p2" + y);
    // In place (the region graph's caches are read by the writes alone), then copied into
    // caller-owned outputs (external values own their buffers).
    const TensorSpec cache_spec = sub.value(*sub.find_value("k_cache_out")).spec;
    std::vector<DeviceBuffer> caches_out;  // per path (native, fused): k, v; never written by the other path
    for (int buffer = 0; buffer < 4; ++buffer) caches_out.emplace_back(static_cast<std::size_t>(cache_spec.bytes()));
    for (bool in_place : {true, false}) {
      SCOPED_TRACE(in_place ? "in place" : "copied");
      TensorMap outputs_of[2];  // native, fused
      for (int fused = 0; fused < 2; ++fused) {
        ExternalValues external;
        if (!in_place) {
          external = {{"k_cache_out", caches_out[static_cast<std::size_t>(2 * fused)].address()},
                      {"v_cache_out", caches_out[static_cast<std::size_t>(2 * fused + 1)].address()}};
        }
        DeviceValues values(sub, external);
        const ValueId k_cache_out = *sub.find_value("k_cache_out");
        ASSERT_EQ(values.shares_buffer(k_cache_out, *sub.find_value("k_cache")), in_place);
        values.upload_inputs(inputs);
        NativeRuntime native;
        const std::vector<DeviceStep> native_steps = native.graph_steps(sub, values);
        const DeviceStep step = fused ? lowered.candidates.front().bind(values)
                                      : DeviceStep([&](const CudaStream& stream) { run_steps(native_steps, stream); });
        values.poison_computed_values();
        CudaStream stream;
        step(stream);
        stream.synchronize();
        outputs_of[fused] = values.download_outputs();
      }
      const TensorMap& outputs = outputs_of[1];
      // The same element math as the native rope and cache-write kernels: the same bits.
      for (const char* name : {"q.rope", "k_cache_out", "v_cache_out"}) {
        EXPECT_TRUE(outputs.at(name) == outputs_of[0].at(name)) << name << " differs from the native path";
      }
      expect_near_oracle(outputs.at("q.rope"), oracle.q_rotated, DType::bf16, "q rotated");
      expect_near_oracle(outputs.at("k_cache_out"), oracle.k_cache, DType::bf16, "k cache");
      // v and every row no step writes are copies: exact.
      EXPECT_EQ(outputs.at("v_cache_out").to_values(), oracle.v_cache);
      const std::vector<double> k_cache = outputs.at("k_cache_out").to_values();
      const std::vector<double> k_before = inputs.at("k_cache").to_values();
      const std::int64_t dim = test_case.shape.head_dim;
      std::int64_t kept = 0;
      for (std::int64_t r = 0; r < test_case.shape.kv_heads * test_case.shape.capacity; ++r) {
        const std::int64_t t = r % test_case.shape.capacity;
        if (std::find(rows.begin(), rows.begin() + test_case.shape.rows, t) != rows.begin() + test_case.shape.rows) continue;
        kept += std::equal(k_cache.begin() + r * dim, k_cache.begin() + (r + 1) * dim, k_before.begin() + r * dim) ? 1 : 0;
      }
      EXPECT_EQ(kept, test_case.shape.kv_heads * (test_case.shape.capacity - test_case.shape.rows));
    }
    // Through the Executable, planned without the joined rule: the region passes the gate and runs
    // fused in fused mode.
    RuleSet rules = default_rules();
    std::erase_if(rules.rules, [](const FusionRule& rule) { return !rule.composes.empty(); });
    Executable executable = Executable::build(plan_graph_fusion(graph, FusionTarget::h200(), rules), device(),
                                              quick_fused_options());
    bool found = false;
    for (const RegionReport& report : executable.reports()) {
      if (report.rule != "rope_kv_cache") continue;
      found = true;
      EXPECT_EQ(report.chosen_id.eager(), CandidateId::fused("rope kv cache")) << report.sentence;
    }
    EXPECT_TRUE(found) << executable.report();
  }
}

// ---------------------------------------------------------------- qkv_rope_kv_cache
// The q/k/v GEMV with rope and the cache writes in its epilogue (GemvKernelConfig::rope_cache):
// every candidate of the joined region (each GEMV shape as one kernel, and as the stacked GEMV
// followed by the rope kernel) against a float64 oracle (the projections in double, rounded to the
// dtype as the graph stores them, then rotated in double), and each one-kernel shape bit for bit
// against the same shape's two kernels: the epilogue rounds and rotates as the rope kernel does.
// Llama-3.2-like (4-bit, rope scaling) and Qwen-like (biases, 12/2 heads of 128) shapes, M = 1, 5,
// 16, positions scattered over the cache; then through the Executable.
TEST_F(RopeKvCache, OneKernelWithTheProjectionsMatchesItsPartsAndTheOracle) {
  struct Case {
    std::string name;
    testing::AttentionInputsShape shape;
    std::int64_t rows;
    std::int64_t hidden = 256;
  };
  testing::AttentionInputsShape llama;
  llama.q_heads = 32, llama.kv_heads = 8, llama.head_dim = 64, llama.llama3_scaling = true, llama.theta = 500000;
  llama.format = {4, 64, DType::bf16};
  testing::AttentionInputsShape qwen;
  qwen.q_heads = 12, qwen.kv_heads = 2, qwen.head_dim = 128, qwen.bias = true, qwen.theta = 1000000;
  qwen.format = {16, 0, DType::bf16};
  testing::AttentionInputsShape half = llama;
  half.format = {8, 64, DType::f16}, half.bias = true;
  // Llama-3-8B's q/k/v at its own size: 384 tiles, 3 a multiprocessor, the few-tiles family of
  // gemv_tuning_candidates (more warps a tile, the one-wave bound), K = 4096 a full model's.
  testing::AttentionInputsShape eight = llama;
  eight.head_dim = 128;
  const std::vector<Case> cases = {{"llama 4-bit M 1", llama, 1},
                                   {"qwen dense M 16", qwen, 16},
                                   {"llama 8-bit f16 M 5", half, 5},
                                   {"llama-3-8b 4-bit M 1", eight, 1, 4096}};
  for (Case test_case : cases) {
    SCOPED_TRACE(test_case.name);
    test_case.shape.rows = test_case.rows, test_case.shape.capacity = 160, test_case.shape.hidden = test_case.hidden;
    const testing::AttentionInputsShape& shape = test_case.shape;
    const ComputeGraph graph = testing::attention_inputs_test_graph(shape);
    const FusionPlan plan = plan_graph_fusion(graph);
    ASSERT_EQ(plan.regions.size(), 1u) << plan.explain();
    const FusionRegion& region = plan.regions.front();
    ASSERT_EQ(region.rule, "qkv_rope_kv_cache") << plan.explain();
    const ComputeGraph sub = region_graph(*plan.graph, region);
    const FusionRegion sub_region = region_in_region_graph(*plan.graph, region, sub);
    const RegionLowerings lowered = lower_region(sub, sub_region, std::span<const RegionLowering>{});
    ASSERT_FALSE(lowered.candidates.empty()) << lowered.refusals;
    TensorMap inputs = random_inputs(sub, next_seed());
    std::vector<std::int64_t> rows(static_cast<std::size_t>(shape.capacity));
    std::iota(rows.begin(), rows.end(), 0);
    SplitMix64 shuffle(next_seed());
    for (std::size_t i = rows.size(); i > 1; --i) std::swap(rows[i - 1], rows[shuffle.next() % i]);
    for (std::int64_t s = 0; s < shape.rows; ++s) inputs.at("positions").store(s, static_cast<double>(rows[static_cast<std::size_t>(s)]));
    // The oracle: each projection in double, stored in the dtype, then rope and the writes in double.
    TensorMap projected = inputs;
    const std::string y = shape.bias ? ".y" : "";
    for (int part = 0; part < 3; ++part) {
      const std::string prefix = "p" + std::to_string(part);
      const std::int64_t width = (part == 0 ? shape.q_heads : shape.kv_heads) * shape.head_dim;
      TensorMap named = inputs;
      if (shape.bias) named["c" + std::to_string(part)] = inputs.at(prefix + ".c");
      const std::vector<double> values = oracle(named, static_cast<std::size_t>(part), shape.rows, width, shape.hidden,
                                                shape.format, shape.bias);
      projected[prefix + y] = HostTensor::from_values(TensorSpec({shape.rows, width}, shape.format.dtype), values);
    }
    const AttentionInputsOracle expected = attention_inputs_oracle(
        projected, shape, sub.node(*sub.find_node("q.rope")).attributes, "p0" + y, "p1" + y, "p2" + y);
    DeviceValues values(sub);
    values.upload_inputs(inputs);
    CudaStream stream;
    std::map<std::string, TensorMap> outputs_of;
    int one_kernel = 0;
    for (const FusedCandidate& candidate : lowered.candidates) {
      SCOPED_TRACE(candidate.id.name());
      const DeviceStep step = candidate.bind(values);
      // The caches are inputs written in place: upload them again before every candidate.
      values.upload_inputs(inputs);
      values.poison_computed_values();
      step(stream);
      stream.synchronize();
      const TensorMap outputs = values.download_outputs();
      expect_near_oracle(outputs.at("q.rope"), expected.q_rotated, shape.format.dtype, "q rotated");
      expect_near_oracle(outputs.at("k_cache_out"), expected.k_cache, shape.format.dtype, "k cache");
      expect_near_oracle(outputs.at("v_cache_out"), expected.v_cache, shape.format.dtype, "v cache");
      outputs_of[candidate.id.variant] = outputs;
      one_kernel += candidate.launches == 1;
    }
    EXPECT_GE(one_kernel, 2) << "the one-kernel shapes are offered";
    int compared = 0;
    for (const auto& [variant, outputs] : outputs_of) {
      const auto parts = outputs_of.find(variant + ", then rope kv cache");
      if (parts == outputs_of.end()) continue;
      ++compared;
      for (const char* name : {"q.rope", "k_cache_out", "v_cache_out"}) {
        EXPECT_TRUE(outputs.at(name) == parts->second.at(name)) << variant << ": " << name << " differs from its two kernels";
      }
    }
    EXPECT_EQ(compared, one_kernel);
    // Through the Executable: the joined region is gated and raced, and its steps agree with the oracle.
    Executable executable = Executable::build(plan, device(), quick_fused_options());
    ASSERT_EQ(executable.reports().size(), 1u) << executable.report();
    EXPECT_EQ(executable.reports().front().chosen_id.kind, CandidateKind::fused) << executable.report();
    for (const auto& [name, gate] : executable.reports().front().gates) {
      EXPECT_TRUE(gate.passed) << name << ": " << gate.detail;
    }
    const TensorMap outputs = executable.run(inputs);
    expect_near_oracle(outputs.at("q.rope"), expected.q_rotated, shape.format.dtype, "executable q rotated");
    expect_near_oracle(outputs.at("k_cache_out"), expected.k_cache, shape.format.dtype, "executable k cache");
  }
}

}  // namespace
}  // namespace metile
