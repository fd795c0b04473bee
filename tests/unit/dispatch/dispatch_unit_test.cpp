// The parts of measured dispatch that need no GPU: the numeric gate's figures and thresholds (an
// argmax against the candidate's own values), the headroom rule, METILE_DISPATCH parsing, the decision file (round trip, corruption),
// cutting a region out of its graph, and the lowerings' reasons for every example region.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "metile/attention_runtime.h"
#include "metile/cpu_runtime.h"
#include "metile/discovery.h"
#include "metile/dispatch.h"
#include "metile_test_support.h"

namespace metile {
namespace {

HostTensor tensor(DType dtype, const std::vector<double>& values) {
  return HostTensor::from_values({{static_cast<std::int64_t>(values.size())}, dtype}, values);
}

TEST(NumericGate, FiguresAreScaleNormalized) {
  const HostTensor reference = tensor(DType::f32, {3.0, -4.0, 0.0, 1.0});
  const HostTensor output = tensor(DType::f32, {3.0, -4.0, 0.001, 1.0});
  const NumericGateResult result = numeric_gate(output, reference);
  EXPECT_NEAR(result.relative_l2, 0.001 / std::sqrt(26.0), 1e-9);
  EXPECT_NEAR(result.relative_max, 0.001 / 4.0, 1e-9);
  EXPECT_FALSE(result.passed) << "2.5e-4 is far above f32's 1e-5";
  EXPECT_NE(result.detail.find("relative L2 error"), std::string::npos) << result.detail;
  // The same error, scaled by 1000 with its reference, gives the same figures.
  const NumericGateResult scaled = numeric_gate(tensor(DType::f32, {3000.0, -4000.0, 1.0, 1000.0}),
                                                tensor(DType::f32, {3000.0, -4000.0, 0.0, 1000.0}));
  EXPECT_NEAR(scaled.relative_l2, result.relative_l2, 1e-9);
}

TEST(NumericGate, ThresholdsFollowTheDtype) {
  EXPECT_EQ(numeric_gate_threshold(DType::f32), 1e-5);
  EXPECT_EQ(numeric_gate_threshold(DType::f16), 2e-3);
  EXPECT_EQ(numeric_gate_threshold(DType::bf16), 1e-2);
  EXPECT_EQ(numeric_gate_threshold(DType::i32), 0.0);
  // The same 0.5% error passes bf16's gate and fails f16's.
  std::mt19937_64 random(testing::test_seed("NumericGate.ThresholdsFollowTheDtype"));
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  std::vector<double> values(4096);
  for (double& value : values) value = uniform(random);
  std::vector<double> perturbed = values;
  for (double& value : perturbed) value *= 1.005;
  for (DType dtype : {DType::bf16, DType::f16}) {
    const NumericGateResult result = numeric_gate(HostTensor::from_values({{4096}, dtype}, perturbed),
                                                  HostTensor::from_values({{4096}, dtype}, values));
    EXPECT_GT(result.relative_l2, 3e-3) << dtype_name(dtype);
    EXPECT_LT(result.relative_l2, 8e-3) << dtype_name(dtype);
    EXPECT_EQ(result.passed, dtype == DType::bf16) << dtype_name(dtype) << ": " << result.detail;
  }
}

TEST(NumericGate, NonFiniteValuesPassOnlyWhereTheReferenceHasThem) {
  const double inf = INFINITY;
  const HostTensor reference = tensor(DType::f16, {1.0, -inf, 2.0});
  EXPECT_TRUE(numeric_gate(tensor(DType::f16, {1.0, -inf, 2.0}), reference).passed);
  const NumericGateResult nan_output = numeric_gate(tensor(DType::f16, {1.0, -inf, NAN}), reference);
  EXPECT_FALSE(nan_output.passed);
  EXPECT_NE(nan_output.detail.find("element 2"), std::string::npos) << nan_output.detail;
  EXPECT_FALSE(numeric_gate(tensor(DType::f16, {1.0, inf, 2.0}), reference).passed) << "the other infinity";
  EXPECT_FALSE(numeric_gate(tensor(DType::f16, {1.0, 0.0, 2.0}), reference).passed) << "a finite value for -inf";
  EXPECT_FALSE(numeric_gate(tensor(DType::f32, {1.0, -inf, 2.0}), reference).passed) << "another dtype";
}

// An argmax the region computes from values it also writes is checked against the candidate's own
// values, exactly: a near tie rounded the other way is right, an index that is not the largest of
// what the candidate wrote is not, and wrong values still fail the numeric gate.
TEST(NumericGate, AnArgmaxIsCheckedAgainstTheCandidatesOwnValues) {
  GraphBuilder builder;
  const ValueRef x = builder.input("x", TensorSpec({2, 8}, DType::bf16));
  const ValueRef logits = builder.matmul(x, builder.input("w", TensorSpec({6, 8}, DType::bf16)), true, "logits");
  const ComputeGraph graph = builder.build({logits, builder.argmax(logits, "next")});
  auto ids = [](std::vector<double> values) { return HostTensor::from_values({{2}, DType::i32}, values); };
  // Row 0 has a near tie (index 1 and 4), rounded apart in the candidate; row 1 none.
  const std::vector<double> reference_values = {0.5, 2.0, -1.0, 0.25, 1.984375, 0.0, 1.0, -2.0, 8.0, 0.5, 0.75, -0.5};
  std::vector<double> candidate_values = reference_values;
  candidate_values[4] = 2.015625;  // within bf16's gate of the reference, now the row's largest
  const TensorMap reference = {{"logits", HostTensor::from_values({{2, 6}, DType::bf16}, reference_values)},
                               {"next", ids({1, 2})}};
  auto outputs = [&](const std::vector<double>& values, std::vector<double> next) {
    return TensorMap{{"logits", HostTensor::from_values({{2, 6}, DType::bf16}, values)},
                     {"next", ids(next)}};
  };
  EXPECT_TRUE(gate_region_outputs(graph, outputs(candidate_values, {4, 2}), reference).passed);
  EXPECT_TRUE(gate_region_outputs(graph, outputs(reference_values, {1, 2}), reference).passed);
  const NumericGateResult stale = gate_region_outputs(graph, outputs(candidate_values, {1, 2}), reference);
  EXPECT_FALSE(stale.passed);
  EXPECT_EQ(stale.detail, "output 'next': row 0: index 1, the argmax of the candidate's own 'logits' is 4");
  EXPECT_FALSE(gate_region_outputs(graph, outputs(candidate_values, {4, 3}), reference).passed);
  std::vector<double> wrong_values = candidate_values;
  wrong_values[8] = -3.0;  // row 1's largest value gone: its own argmax is index 0
  const NumericGateResult wrong = gate_region_outputs(graph, outputs(wrong_values, {4, 0}), reference);
  EXPECT_FALSE(wrong.passed);
  EXPECT_NE(wrong.detail.find("output 'logits'"), std::string::npos) << wrong.detail;
  // Without the values among the outputs, the index is compared with the reference's, exactly.
  const ComputeGraph index_only = [] {
    GraphBuilder b;
    const ValueRef v = b.input("v", TensorSpec({2, 6}, DType::bf16));
    return b.build({b.argmax(v, "next")});
  }();
  const TensorMap index_reference = {{"next", ids({1, 2})}};
  EXPECT_TRUE(gate_region_outputs(index_only, {{"next", ids({1, 2})}},
                                  index_reference).passed);
  EXPECT_FALSE(gate_region_outputs(index_only, {{"next", ids({4, 2})}},
                                   index_reference).passed);
}

TEST(Headroom, FusedNeedsTenPercent) {
  EXPECT_TRUE(beats_with_headroom(1.0, 1.10, 0.10));
  EXPECT_FALSE(beats_with_headroom(1.0, 1.09, 0.10));
  EXPECT_TRUE(beats_with_headroom(1.0, 1.05, 0.05));
  EXPECT_FALSE(beats_with_headroom(1.0, 0.5, 0.10));
  EXPECT_FALSE(beats_with_headroom(0.0, 1.0, 0.10)) << "a zero time is a failed measurement, not a win";
}

// plan_weight_prefetch: a Llama-3-8B-like step by hand (MB: each layer q/k/v 14, attention 0,
// o-projection 9, the MLP 99; then the LM head 296), then random steps against a brute-force
// statement of the rule: each GEMV over the budget, forked at the earliest step from which the
// steps up to it stream at most the budget (a step of unknown weights streams more), unless that is
// the GEMV itself; a step of unknown weights gets none.
TEST(WeightPrefetchPlan, HeavyGemvsArePrefetchedDuringTheLightStepsBeforeThem) {
  constexpr std::uint64_t MB = 1000000;
  std::vector<std::optional<std::uint64_t>> step;
  for (int layer = 0; layer < 3; ++layer) {
    for (std::uint64_t bytes : {14 * MB, 0 * MB, 9 * MB, 99 * MB}) step.push_back(bytes);
  }
  step.push_back(296 * MB);
  const std::vector<WeightPrefetchFork> llama = plan_weight_prefetch(step, 24 * MB);
  ASSERT_EQ(llama.size(), 3u);  // each MLP, from its layer's q/k/v on; the LM head follows an MLP: none
  for (std::size_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(llama[layer].gemv, 4 * layer + 3);
    EXPECT_EQ(llama[layer].fork, 4 * layer);
    EXPECT_EQ(llama[layer].bytes, 24 * MB);
  }
  const std::vector<WeightPrefetchFork> tight = plan_weight_prefetch(step, 12 * MB);  // q/k/v is heavy now
  ASSERT_EQ(tight.size(), 3u);  // the MLPs from attention on (q/k/v right after an MLP gets none)
  for (std::size_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(tight[layer].gemv, 4 * layer + 3);
    EXPECT_EQ(tight[layer].fork, 4 * layer + 1);
  }
  EXPECT_TRUE(plan_weight_prefetch({}, 24 * MB).empty());
  EXPECT_TRUE(plan_weight_prefetch({99 * MB}, 24 * MB).empty());
  // A layer whose o-projection ran natively (its weights unknown): the run before the MLP stops at it.
  std::vector<std::optional<std::uint64_t>> native_o = step;
  native_o[6] = std::nullopt;  // layer 1's o-projection
  const std::vector<WeightPrefetchFork> around = plan_weight_prefetch(native_o, 24 * MB);
  ASSERT_EQ(around.size(), 2u);  // layer 1's MLP has no light step right before it: none
  EXPECT_EQ(around[0].gemv, 3u);
  EXPECT_EQ(around[0].fork, 0u);
  EXPECT_EQ(around[1].gemv, 11u);
  EXPECT_EQ(around[1].fork, 8u);

  std::mt19937_64 generator(testing::test_seed("WeightPrefetchPlan.HeavyGemvsArePrefetchedDuringTheLightStepsBeforeThem"));
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<std::optional<std::uint64_t>> bytes(generator() % 30);
    for (std::optional<std::uint64_t>& b : bytes) {
      const std::uint64_t draw = generator() % 10;
      b = draw < 3 ? std::optional<std::uint64_t>(0) : draw == 3 ? std::nullopt : std::optional<std::uint64_t>(generator() % 100);
    }
    const std::uint64_t budget = generator() % 60;
    std::vector<WeightPrefetchFork> expected;
    for (std::size_t gemv = 0; gemv < bytes.size(); ++gemv) {
      if (!bytes[gemv] || *bytes[gemv] <= budget) continue;
      for (std::size_t fork = 0; fork < gemv; ++fork) {
        std::uint64_t streamed = 0;
        bool unknown = false;
        for (std::size_t s = fork; s < gemv; ++s) {
          unknown = unknown || !bytes[s];
          streamed += bytes[s].value_or(0);
        }
        if (!unknown && streamed <= budget) {
          expected.push_back({gemv, fork, budget});
          break;
        }
      }
    }
    const std::vector<WeightPrefetchFork> planned = plan_weight_prefetch(bytes, budget);
    ASSERT_EQ(planned.size(), expected.size()) << "trial " << trial;
    for (std::size_t i = 0; i < planned.size(); ++i) {
      EXPECT_EQ(planned[i].gemv, expected[i].gemv) << "trial " << trial;
      EXPECT_EQ(planned[i].fork, expected[i].fork) << "trial " << trial;
      EXPECT_EQ(planned[i].bytes, expected[i].bytes) << "trial " << trial;
    }
  }
}

TEST(DispatchMode, ParsesTheEnvironmentValues) {
  EXPECT_EQ(parse_dispatch_mode("native"), DispatchMode::native);
  EXPECT_EQ(parse_dispatch_mode("fused"), DispatchMode::fused);
  EXPECT_EQ(parse_dispatch_mode("auto"), DispatchMode::automatic);
  EXPECT_EQ(parse_dispatch_mode(""), DispatchMode::automatic);
  try {
    parse_dispatch_mode("fastest");
    FAIL() << "expected InputError";
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find("'fastest'"), std::string::npos) << error.what();
  }
  EXPECT_EQ(dispatch_mode_name(DispatchMode::automatic), "auto");
}

class DecisionFile : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() / ("metile-decisions-" + std::to_string(std::random_device{}()));
    path_ = directory_ / "nested" / "dispatch.json";
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }
  std::filesystem::path directory_;
  std::filesystem::path path_;
};

TEST_F(DecisionFile, RoundTripsAndReplacesByKey) {
  {
    DecisionCache cache(path_);
    EXPECT_EQ(cache.size(), 0u);
    EXPECT_FALSE(cache.found_corrupt_file());
    const CandidateId native = CandidateId::native(), wide = CandidateId::fused("wide");
    cache.store({"key one", wide, {{native, 0.5}, {wide, 0.25}}, "region R0: fused wide, 2.00x"});
    cache.store({"key two", native.as_graph(), {{native.as_graph(), 0.1}}, "region R1: native graph"});
    cache.store({"key one", CandidateId::fused(), {{CandidateId::fused(), 0.2}}, "region R0: fused, 2.50x"});
  }
  const DecisionCache reloaded(path_);
  EXPECT_EQ(reloaded.size(), 2u);
  const auto one = reloaded.find("key one");
  ASSERT_TRUE(one.has_value());
  EXPECT_EQ(one->chosen.name(), "fused");
  EXPECT_EQ(one->chosen, CandidateId::fused());
  EXPECT_EQ(reloaded.find("key two")->chosen, CandidateId::native().as_graph());
  ASSERT_EQ(one->timings_ms.size(), 1u);
  EXPECT_EQ(one->timings_ms[0].second, 0.2);
  EXPECT_EQ(reloaded.find("key two")->report, "region R1: native graph");
  EXPECT_FALSE(reloaded.find("key three").has_value());
  for (const auto& entry : std::filesystem::directory_iterator(path_.parent_path())) {
    EXPECT_EQ(entry.path().filename(), "dispatch.json") << "no temporary file is left behind";
  }
}

// A report that is not UTF-8 (a gate failure naming an output whose name was set from C++) is stored
// with U+FFFD in place of the bad bytes (dump_json). It threw nlohmann's type_error 316 out of store()
// and left an empty temporary file beside the cache.
TEST_F(DecisionFile, AReportThatIsNotUtf8IsStoredAndLeavesNoTemporaryFile) {
  {
    DecisionCache cache(path_);
    EXPECT_NO_THROW(cache.store({"key", CandidateId::native(), {{CandidateId::native(), 0.5}},
                                 "region R0: output 'x\xff\xfey' failed the gate"}));
  }
  const DecisionCache reloaded(path_);
  ASSERT_TRUE(reloaded.find("key").has_value());
  EXPECT_EQ(reloaded.find("key")->report, "region R0: output 'x\xef\xbf\xbd\xef\xbf\xbdy' failed the gate");
  for (const auto& entry : std::filesystem::directory_iterator(path_.parent_path())) {
    EXPECT_EQ(entry.path().filename(), "dispatch.json") << "no temporary file is left behind";
  }
}

// Two writers storing at once, each its own cache on the file (two processes, or two threads as here):
// every decision of both is kept. Before the directory lock each read the file, added its decision
// and renamed its copy over the other's (two processes of 200 stores each left 269).
TEST_F(DecisionFile, WritersStoringAtOnceKeepEveryDecision) {
  constexpr int kStores = 100;
  std::vector<std::thread> writers;
  for (int writer = 0; writer < 2; ++writer) {
    writers.emplace_back([this, writer] {
      DecisionCache cache(path_);
      for (int index = 0; index < kStores; ++index) {
        cache.store({fmt::format("writer {} key {}", writer, index), CandidateId::native(), {}, "report"});
      }
    });
  }
  for (std::thread& writer : writers) writer.join();
  const DecisionCache reloaded(path_);
  EXPECT_EQ(reloaded.size(), 2u * kStores);
}

// Two caches open on one file (the decode MLP's gate/up stage keeps its own while the down stage
// stores through another): each store keeps what the other stored since it was read. Before, the
// second store wrote its stale list and dropped the first's decision, so a cached build raced down
// again (gpu DecodeMlpExecutorTest.StoredDecisionIsReused, whenever the gate/up near tie won).
TEST_F(DecisionFile, AStoreKeepsWhatAnotherCacheStoredSinceItWasRead) {
  DecisionCache first(path_), second(path_);
  first.store({"gate_up", CandidateId::fused("a"), {}, "gate_up: fused a"});
  second.store({"down", CandidateId::fused("b"), {}, "down: fused b"});
  first.store({"gate_up", CandidateId::fused("c"), {}, "gate_up: fused c (its near tie)"});
  const DecisionCache reloaded(path_);
  EXPECT_EQ(reloaded.size(), 2u);
  ASSERT_TRUE(reloaded.find("down").has_value());
  EXPECT_EQ(reloaded.find("down")->chosen, CandidateId::fused("b"));
  EXPECT_EQ(reloaded.find("gate_up")->chosen, CandidateId::fused("c"));
  EXPECT_TRUE(first.find("down").has_value());  // and the storing cache sees it too
}

TEST_F(DecisionFile, CorruptFilesAreSetAsideAndRewritten) {
  std::filesystem::create_directories(path_.parent_path());
  for (const std::string& damage : {std::string("{\"version\": 1, \"decisions\": [{"), std::string("[1, 2, 3]"),
                                    std::string("{\"version\": 99, \"decisions\": []}"), std::string("\xff\xfe"),
                                    // 2 only when truncated or wrapped to an int (read as version 2 before)
                                    std::string("{\"version\": 2.7, \"decisions\": []}"),
                                    std::string("{\"version\": 4294967298, \"decisions\": []}"),
                                    // past the JSON reader's nesting limit (10 million brackets took 764 MB to refuse)
                                    "{\"version\": 2, \"decisions\": " + std::string(100000, '[') + std::string(100000, ']') + "}"}) {
    {
      std::ofstream file(path_, std::ios::binary | std::ios::trunc);
      file << damage;
    }
    DecisionCache cache(path_);
    EXPECT_TRUE(cache.found_corrupt_file()) << damage;
    EXPECT_EQ(cache.size(), 0u);
    cache.store({"k", CandidateId::native(), {}, "region R0: native"});
    EXPECT_FALSE(cache.found_corrupt_file());
    const DecisionCache reloaded(path_);
    EXPECT_FALSE(reloaded.found_corrupt_file());
    EXPECT_EQ(reloaded.size(), 1u);
  }
}

// A timing that is not finite was written as null, which no reader takes: the next load found the whole
// file corrupt and the store after it dropped every decision. Such a decision is not stored.
TEST_F(DecisionFile, ANonFiniteTimingIsNotStoredAndKeepsTheOthers) {
  DecisionCache cache(path_);
  cache.store({"finite", CandidateId::native(), {{CandidateId::native(), 2.0}}, "region R0: native"});
  for (const double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    cache.store({"bad", CandidateId::fused(), {{CandidateId::fused(), bad}}, "region R1: fused"});
  }
  const DecisionCache reloaded(path_);
  EXPECT_FALSE(reloaded.found_corrupt_file());
  EXPECT_EQ(reloaded.size(), 1u);
  EXPECT_TRUE(reloaded.find("finite").has_value());
  EXPECT_FALSE(reloaded.find("bad").has_value());
}

// A report is printed as its region's sentence: control bytes in a stored one (a hand-edited or planted file)
// come back spelled out, not as an escape sequence for the terminal or a newline forging a line.
TEST_F(DecisionFile, AStoredReportsControlBytesAreSpelled) {
  std::filesystem::create_directories(path_.parent_path());
  {
    std::ofstream file(path_, std::ios::binary | std::ios::trunc);
    file << R"({"version": 2, "decisions": [{"key": "k", "chosen": {"kind": "native", "variant": "", "replay": "eager"},
      "report": "region R0: native\u001b[31m\nregion R9: forged", "timings_ms": []}]})";
  }
  const DecisionCache cache(path_);
  ASSERT_TRUE(cache.find("k").has_value());
  EXPECT_EQ(cache.find("k")->report, "region R0: native\\x1b[31m\\x0aregion R9: forged");
}

// Something other than a decision file at its path: a FIFO was opened and blocked the process until a
// writer came (forever), /dev/zero was read without end. Neither is opened now; each is set aside as a
// corrupt file is, and the next store replaces it with a regular file.
TEST_F(DecisionFile, SpecialFilesInItsPlaceAreSetAsideNotOpened) {
  std::filesystem::create_directories(path_.parent_path());
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  std::optional<DecisionCache> cache;
  EXPECT_TRUE(testing::returns_without_opening_fifo(path_, [&] { cache.emplace(path_); }));
  ASSERT_TRUE(cache.has_value());
  EXPECT_TRUE(cache->found_corrupt_file());
  EXPECT_EQ(cache->size(), 0u);
  cache->store({"k", CandidateId::native(), {}, "region R0: native"});
  EXPECT_TRUE(std::filesystem::is_regular_file(path_));
  EXPECT_EQ(DecisionCache(path_).size(), 1u);

  std::filesystem::remove(path_);
  std::filesystem::create_symlink("/dev/zero", path_);
  const DecisionCache endless(path_);
  EXPECT_TRUE(endless.found_corrupt_file());
  EXPECT_EQ(endless.size(), 0u);
}

TEST(RegionGraph, CutsTheRegionOutWithItsNamesAndComputesTheSame) {
  GraphBuilder builder;
  auto x = builder.input("x", {{3, 64}, DType::f32});
  auto w = builder.input("w", {{64, 64}, DType::f32});
  auto weight = builder.input("weight", {{64}, DType::f32});
  auto projected = builder.matmul(x, w, false, "projected");
  auto summed = builder.add(projected, x, "summed");
  auto normalized = builder.rms_norm(summed, weight, 1e-5, "normalized");
  const ComputeGraph graph = builder.build({builder.silu(normalized, "activated"), summed});
  FusionRegion region;
  region.rule = "residual_add_rms_norm";
  region.nodes = {*graph.find_node("summed"), *graph.find_node("normalized")};
  region.inputs = {projected.id, x.id, weight.id};
  region.outputs = {summed.id, normalized.id};
  const ComputeGraph sub = region_graph(graph, region);
  ASSERT_EQ(sub.inputs().size(), 3u);
  EXPECT_EQ(sub.value(sub.inputs()[0]).name, "projected");
  EXPECT_EQ(sub.value(sub.inputs()[0]).spec, graph.value(projected.id).spec);
  ASSERT_EQ(sub.nodes().size(), 2u);
  EXPECT_EQ(sub.value(sub.outputs()[1]).name, "normalized");
  const FusionRegion mapped = region_in_region_graph(graph, region, sub);
  EXPECT_EQ(mapped.nodes.size(), 2u);
  EXPECT_EQ(sub.value(mapped.outputs[0]).name, "summed");
  // The region graph computes what the region computes inside the whole graph.
  const TensorMap inputs = random_inputs(graph, testing::test_seed("RegionGraph.CutsTheRegionOutWithItsNamesAndComputesTheSame"));
  const TensorMap whole = run_reference(builder.build({summed, normalized}), inputs);
  TensorMap sub_inputs = {{"x", inputs.at("x")}, {"weight", inputs.at("weight")}};
  sub_inputs["projected"] = run_reference(builder.build({projected}), inputs).at("projected");
  const TensorMap part = run_reference(sub, sub_inputs);
  EXPECT_EQ(part.at("summed"), whole.at("summed"));
  EXPECT_EQ(part.at("normalized"), whole.at("normalized"));

  FusionRegion broken = region;
  broken.outputs.push_back(x.id);
  EXPECT_THROW(region_graph(graph, broken), InputError);
}

TEST(ContractionRowCandidates, SplitContractionsAroundOneRowKernel) {
  GraphBuilder builder;
  auto queries = builder.input("queries", {{16, 64}, DType::bf16});
  auto keys = builder.input("keys", {{16, 64}, DType::bf16});
  auto gate_weight = builder.input("gate_weight", {{128, 16}, DType::bf16});
  auto up_weight = builder.input("up_weight", {{128, 16}, DType::bf16});
  auto down_weight = builder.input("down_weight", {{16, 128}, DType::bf16});
  auto scores = builder.matmul(queries, keys, true, "scores");
  auto probabilities = builder.softmax(builder.causal_mask(builder.scale(scores, 0.125, "scaled"), 0, "masked"), -1,
                                       "probabilities");
  auto gate = builder.matmul(probabilities, gate_weight, true, "gate");
  auto up = builder.matmul(probabilities, up_weight, true, "up");
  auto hidden = builder.multiply(builder.silu(gate, "activated"), up, "hidden");
  auto down = builder.matmul(hidden, down_weight, true, "down");
  const ComputeGraph graph = builder.build({down});
  auto node = [&](const char* name) { return *graph.find_node(name); };

  FusionRegion attention{"contraction_epilogue", {node("scores"), node("scaled"), node("masked"), node("probabilities")},
                         {queries.id, keys.id}, {probabilities.id}, 0};
  const std::vector<FusedCandidate> attention_candidates = contraction_row_candidates(graph, attention).candidates;
  ASSERT_FALSE(attention_candidates.empty());
  EXPECT_EQ(attention_candidates.front().id.name(), "fused epilogue");
  EXPECT_EQ(attention_candidates.front().id, CandidateId::fused("epilogue"));
  EXPECT_EQ(attention_candidates.front().launches, 2);
  EXPECT_NE(attention_candidates.front().source.find("probabilities = softmax(masked)"), std::string::npos);

  FusionRegion mlp{"swiglu_mlp", {node("gate"), node("up"), node("activated"), node("hidden"), node("down")},
                   {probabilities.id, gate_weight.id, up_weight.id, down_weight.id}, {down.id}, 0};
  const std::vector<FusedCandidate> mlp_candidates = contraction_row_candidates(graph, mlp).candidates;
  ASSERT_FALSE(mlp_candidates.empty());
  EXPECT_EQ(mlp_candidates.front().launches, 4) << "gate, up, one silu * up kernel, down";

  // Only contractions, or no contraction: nothing for this lowering, and it says why.
  FusionRegion projections{"x", {node("gate"), node("up")}, {probabilities.id}, {gate.id, up.id}, 0};
  const Lowered only_contractions = contraction_row_candidates(graph, projections);
  EXPECT_TRUE(only_contractions.candidates.empty());
  EXPECT_FALSE(only_contractions.decision.ok);
  EXPECT_NE(only_contractions.decision.reason.find("contractions only"), std::string::npos)
      << only_contractions.decision.reason;
  FusionRegion row_only{"x", {node("activated"), node("hidden")}, {gate.id, up.id}, {hidden.id}, 0};
  const Lowered no_contraction = contraction_row_candidates(graph, row_only);
  EXPECT_TRUE(no_contraction.candidates.empty());
  EXPECT_EQ(no_contraction.decision.reason, "the region has no contraction");
  EXPECT_FALSE(row_region_candidates(graph, row_only).candidates.empty());
  // And the row lowering names the node that keeps it out of a region with a matmul.
  const Lowered not_rows = row_region_candidates(graph, mlp);
  EXPECT_TRUE(not_rows.candidates.empty());
  EXPECT_NE(not_rows.decision.reason.find("node 'gate' (matmul)"), std::string::npos) << not_rows.decision.reason;
}

// What `metile run --backend cuda` reports for a region no lowering takes, checked without a
// device: for every region of every example graph, each built-in lowering either contributes its
// candidates or stands in the refusals with its own reason, word for word.
TEST(LowerRegion, EveryExampleRegionGetsCandidatesOrEachLoweringsOwnReason) {
  int refused_by_all = 0;
  int regions = 0;
  for (const auto& entry : std::filesystem::directory_iterator(METILE_EXAMPLES_DIR)) {
    if (entry.path().extension() != ".json") continue;
    const ComputeGraph graph = read_graph(entry.path());
    const FusionPlan plan = plan_graph_fusion(graph);
    for (const FusionRegion& region : plan.regions) {
      const std::string what = entry.path().filename().string() + ", region of " + region.rule;
      const ComputeGraph sub = region_graph(graph, region);
      const FusionRegion sub_region = region_in_region_graph(graph, region, sub);
      const RegionLowerings lowered = lower_region(sub, sub_region);
      std::size_t expected_candidates = 0;
      std::string expected_refusals;
      for (const RegionLowering& lowering : builtin_lowerings()) {
        const Lowered own = lowering.lower(sub, sub_region);
        EXPECT_EQ(own.decision.ok, !own.candidates.empty()) << what << ", " << lowering.name;
        if (own.decision) {
          expected_candidates += own.candidates.size();
        } else {
          EXPECT_FALSE(own.decision.reason.empty()) << what << ", " << lowering.name;
          expected_refusals += (expected_refusals.empty() ? "" : "; ") + lowering.name + ": " + own.decision.reason;
        }
      }
      EXPECT_EQ(lowered.candidates.size(), expected_candidates) << what;
      EXPECT_EQ(lowered.refusals, expected_refusals) << what;
      if (lowered.candidates.empty()) {
        std::printf("%s: native: no fused lowering (%s)\n", what.c_str(), lowered.refusals.c_str());
        ++refused_by_all;
      }
      ++regions;
    }
  }
  EXPECT_GE(regions, 5);
  // Since the GEMV lowerings, every example region has some lowering; a region no lowering takes
  // is covered by ALoweringThatOffersNothingIsReportedAsRefusing below.
  std::printf("%d of %d example regions refused by every lowering\n", refused_by_all, regions);
}

// The flash_attention lowering without a GPU: a decode problem (R <= 16 over a position-masked
// cache) and a prefill one each get one candidate, and the decode kernel is the one the device
// build picks by default (default_decode_shape; the lowering once passed 0 warps and divided by
// zero). Two KV heads are few: a short cache's default is the two-warp cluster, a longer one's the
// 4-warp cluster.
TEST(LowerRegion, FlashAttentionLowersDecodeAndPrefillWithTheDefaultShape) {
  const Certificate certificate = prove(stable_weighted_softmax_law());
  for (auto [rows, keys, mask] : {std::tuple{std::int64_t{8}, std::int64_t{203}, "positions"},
                                  std::tuple{std::int64_t{8}, std::int64_t{1203}, "positions"},
                                  std::tuple{std::int64_t{48}, std::int64_t{130}, "causal"}}) {
    GraphBuilder b;
    std::vector<ValueRef> inputs = {b.input("q", {{2, rows, 128}, DType::bf16}), b.input("k", {{2, keys, 128}, DType::bf16}),
                                    b.input("v", {{2, keys, 128}, DType::bf16})};
    Attributes attributes;
    attributes.set("scale", 0.125);
    attributes.set("mask", std::string(mask));
    if (std::string(mask) == "causal") attributes.set("offset", keys - rows);  // the causal mask's alone
    if (std::string(mask) == "positions") inputs.push_back(b.input("positions", {{rows / 2}, DType::i32}));
    attributes.set("certificate", certificate.to_json());
    const ComputeGraph graph = b.build(b.add_node("flash_attention", inputs, attributes, "attention"));
    const Lowered lowered = flash_attention_candidates(graph, region_of_nodes(graph, {0}, "flash_attention"));
    ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
    if (rows > 16) {
      ASSERT_EQ(lowered.candidates.size(), 1u);
      EXPECT_EQ(lowered.candidates[0].id.variant, "attention prefill");
      continue;
    }
    ASSERT_EQ(lowered.candidates.size(), 1u);
    EXPECT_EQ(lowered.candidates[0].id.variant, "attention decode");
    if (keys <= kLongestOneSplit) {
      EXPECT_NE(lowered.candidates[0].source.find("_w2_k0_cluster"), std::string::npos) << "not the two-warp cluster default";
    } else {
      EXPECT_NE(lowered.candidates[0].source.find("_w4_"), std::string::npos) << "not the default 4-warp decode shape";
      EXPECT_NE(lowered.candidates[0].source.find("_cluster"), std::string::npos) << "not the default clustered merge";
    }
  }
}

// The decode kernel reads the positions and the old cache rows before the wait for the previous
// kernel only where the graph proves no kernel of the run writes them: the positions a graph input,
// K and V graph inputs or kv_cache_writes of graph-input caches at those same positions (a decode
// step's form, the write in place). Anything else (other positions for the write, computed
// positions, a computed K, a write that copies the cache because another node reads the old one)
// keeps every read after the wait.
TEST(LowerRegion, FlashAttentionReadsTheCacheBeforeTheWaitOnlyWhereNoKernelWritesIt) {
  const Certificate certificate = prove(stable_weighted_softmax_law());
  enum class Form { decode_step, other_positions, computed_positions, computed_keys, copied_cache };
  for (const Form form : {Form::decode_step, Form::other_positions, Form::computed_positions, Form::computed_keys,
                          Form::copied_cache}) {
    GraphBuilder b;
    const ValueRef q = b.input("q", {{2, 8, 128}, DType::bf16});
    const ValueRef positions_in = b.input("positions", {{4}, DType::i32});
    const ValueRef positions = form == Form::computed_positions ? b.reshape(positions_in, {4}, "positions.copy") : positions_in;
    const ValueRef write_positions = form == Form::other_positions ? b.input("other", {{4}, DType::i32}) : positions;
    const ValueRef k_cache = b.input("k_cache", {{2, 203, 128}, DType::bf16});
    const ValueRef v_cache = b.input("v_cache", {{2, 203, 128}, DType::bf16});
    const ValueRef k_new = b.input("k_new", {{2, 4, 128}, DType::bf16});
    const ValueRef v_new = b.input("v_new", {{2, 4, 128}, DType::bf16});
    const ValueRef k_all = form == Form::computed_keys ? b.scale(k_cache, 0.5, "k_scaled")
                                                       : b.kv_cache_write(k_cache, k_new, write_positions, "k_all");
    const ValueRef v_all = b.kv_cache_write(v_cache, v_new, write_positions, "v_all");
    Attributes attributes;
    attributes.set("scale", 0.125);
    attributes.set("mask", std::string("positions"));
    attributes.set("offset", std::int64_t{0});
    attributes.set("certificate", certificate.to_json());
    const ValueRef out = b.add_node("flash_attention", {q, k_all, v_all, positions}, attributes, "attention").front();
    std::vector<ValueRef> outputs = {out, k_all, v_all};
    if (form == Form::copied_cache) outputs.push_back(b.scale(k_cache, 0.5, "old_keys_read"));
    const ComputeGraph graph = b.build(outputs);
    const NodeId attention = graph.value(out.id).producer;
    const Lowered lowered = flash_attention_candidates(graph, region_of_nodes(graph, {attention}, "flash_attention"));
    ASSERT_TRUE(lowered.decision) << lowered.decision.reason;
    ASSERT_EQ(lowered.candidates.size(), 1u);
    const bool before_wait = lowered.candidates[0].source.find("kCacheBeforeWait = true") != std::string::npos;
    EXPECT_EQ(before_wait, form == Form::decode_step) << static_cast<int>(form);
  }
}

TEST(LowerRegion, ALoweringThatOffersNothingIsReportedAsRefusing) {
  GraphBuilder builder;
  auto x = builder.input("x", {{4, 64}, DType::f16});
  const ComputeGraph graph = builder.build({builder.silu(builder.scale(x, 0.5, "scaled"), "activated")});
  const FusionRegion region = region_of_nodes(graph, {0, 1}, "test");
  const std::vector<RegionLowering> extra = {
      {"empty", [](const ComputeGraph&, const FusionRegion&) { return Lowered{Decision::allow(), {}}; }},
      {"silent", [](const ComputeGraph&, const FusionRegion&) { return Lowered{Decision::refuse(""), {}}; }},
      {"picky", [](const ComputeGraph&, const FusionRegion&) { return Lowered{Decision::refuse("too small"), {}}; }},
  };
  const RegionLowerings lowered = lower_region(graph, region, extra);
  EXPECT_EQ(lowered.candidates.size(), row_region_candidates(graph, region).candidates.size());
  EXPECT_EQ(lowered.refusals,
            "contractions around a row kernel: the region has no contraction; flash attention: the region is not one "
            "flash_attention node; rope and cache writes: not a rope_kv_cache region; gemv: the GEMV lowers swiglu_mlp, contraction_epilogue, contraction, "
            "contraction_argmax, sibling_contractions, qkv_rope_kv_cache and attention_output_projection regions, not 'test'; empty: it accepted the "
            "region but offered "
            "no candidate; silent: refused without a reason; picky: too small");
}

}  // namespace
}  // namespace metile
