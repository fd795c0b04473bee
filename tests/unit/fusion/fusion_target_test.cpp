// FusionTarget presets, target files and their errors, and the cost model's
// arithmetic against figures worked out by hand from its definition.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include <limits>

#include "metile/fusion.h"
#include "metile_test_support.h"

namespace metile {
namespace {

TEST(FusionTarget, PresetsCarryTheDocumentedLimits) {
  const FusionTarget h200 = FusionTarget::h200();
  EXPECT_EQ(h200.name, "h200");
  EXPECT_DOUBLE_EQ(h200.memory_bandwidth_bytes_per_ns, 4200);
  EXPECT_EQ(h200.shared_memory_per_multiprocessor_bytes, 228 * 1024);
  EXPECT_EQ(h200.shared_memory_per_block_bytes, 227 * 1024);
  EXPECT_EQ(h200.registers_per_multiprocessor, 65536);
  EXPECT_EQ(h200.registers_per_thread, 255);
  const FusionTarget cpu = FusionTarget::cpu();
  EXPECT_EQ(cpu.name, "cpu");
  EXPECT_LT(cpu.memory_bandwidth_bytes_per_ns, h200.memory_bandwidth_bytes_per_ns);
}

TEST(FusionTarget, JsonOverridesItsBase) {
  const FusionTarget target = FusionTarget::from_json(
      R"({"base": "cpu", "name": "small", "shared_memory_per_block_bytes": 32768, "launch_overhead_ns": 10.5})");
  EXPECT_EQ(target.name, "small");
  EXPECT_EQ(target.shared_memory_per_block_bytes, 32768);
  EXPECT_DOUBLE_EQ(target.launch_overhead_ns, 10.5);
  EXPECT_DOUBLE_EQ(target.memory_bandwidth_bytes_per_ns, FusionTarget::cpu().memory_bandwidth_bytes_per_ns);
  const FusionTarget again = FusionTarget::from_json(target.to_json());
  EXPECT_EQ(again.to_json(), target.to_json());
}

void expect_input_error(const std::string& text, const std::string& message) {
  try {
    FusionTarget::from_json(text, "t.json");
    FAIL() << "no error for " << text;
  } catch (const InputError& error) {
    EXPECT_NE(std::string(error.what()).find(message), std::string::npos) << error.what();
  }
}

TEST(FusionTarget, BadFilesSayWhatIsWrong) {
  expect_input_error("{", "t.json: invalid JSON");
  expect_input_error("[1]", "t.json: a target file holds one JSON object");
  expect_input_error(R"({"lanch_overhead_ns": 3})", "t.json: unknown field 'lanch_overhead_ns'");
  expect_input_error(R"({"launch_overhead_ns": -3})", "field 'launch_overhead_ns' must be positive");
  expect_input_error(R"({"registers_per_thread": 12.5})", "field 'registers_per_thread' must be an integer");
  expect_input_error(R"({"memory_bandwidth_bytes_per_ns": "fast"})", "must be a number");
  expect_input_error(R"({"base": "a100"})", "unknown target 'a100'");
  EXPECT_THROW(FusionTarget::from_json_file("/no/such/target.json"), InputError);
  EXPECT_THROW(FusionTarget::from_name_or_file("b200"), InputError);
}

// Issue 11: integers are refused above their field's C++ type, never truncated; real
// figures stay within [1e-6, 1e12]; nesting and 1e400 are input errors.
TEST(FusionTarget, FiguresOutsideTheirRangeAreRefused) {
  EXPECT_EQ(FusionTarget::from_json(R"({"threads_per_block": 2147483647})").threads_per_block, 2147483647);
  expect_input_error(R"({"threads_per_block": 2147483648})",
                     "field 'threads_per_block' is above its limit of 2147483647: 2147483648");
  expect_input_error(R"({"threads_per_block": 4294967552})", "is above its limit of 2147483647");
  EXPECT_EQ(FusionTarget::from_json(R"({"shared_memory_per_block_bytes": 9223372036854775807})")
                .shared_memory_per_block_bytes,
            std::numeric_limits<std::int64_t>::max());
  expect_input_error(R"({"shared_memory_per_block_bytes": 9223372036854775808})",
                     "is above its limit of 9223372036854775807");
  expect_input_error(R"({"launch_overhead_ns": 1e13})", "field 'launch_overhead_ns' is above its limit of 1000000000000.0");
  expect_input_error(R"({"memory_bandwidth_bytes_per_ns": 1e-7})", "is below its limit of 1e-06");
  expect_input_error(R"({"launch_overhead_ns": 1e400})", "t.json: invalid JSON: number overflow parsing '1e400'");
  expect_input_error(R"({"launch_overhead_ns": )" + std::string(1000, '[') + std::string(1000, ']') + "}",
                     "t.json: invalid JSON: nested deeper than 64 levels");
}

TEST(FusionTarget, FileAndPresetNamesResolve) {
  const auto path = std::filesystem::temp_directory_path() / "metile_fusion_target_test.json";
  {
    std::ofstream file(path);
    file << R"({"max_kernel_inputs": 5})";
  }
  const FusionTarget target = FusionTarget::from_name_or_file(path.string());
  std::filesystem::remove(path);
  EXPECT_EQ(target.max_kernel_inputs, 5);
  EXPECT_EQ(target.name, "metile_fusion_target_test");
  EXPECT_EQ(FusionTarget::from_name_or_file("cpu").name, "cpu");
}

// Every figure of the two targets, compared field by field (not through to_json, the function tested).
void expect_same_figures(const FusionTarget& a, const FusionTarget& b) {
  EXPECT_EQ(a.launch_overhead_ns, b.launch_overhead_ns);
  EXPECT_EQ(a.memory_bandwidth_bytes_per_ns, b.memory_bandwidth_bytes_per_ns);
  EXPECT_EQ(a.on_chip_bandwidth_bytes_per_ns, b.on_chip_bandwidth_bytes_per_ns);
  EXPECT_EQ(a.registers_per_thread, b.registers_per_thread);
  EXPECT_EQ(a.registers_per_multiprocessor, b.registers_per_multiprocessor);
  EXPECT_EQ(a.threads_per_block, b.threads_per_block);
  EXPECT_EQ(a.shared_memory_per_block_bytes, b.shared_memory_per_block_bytes);
  EXPECT_EQ(a.shared_memory_per_multiprocessor_bytes, b.shared_memory_per_multiprocessor_bytes);
  EXPECT_EQ(a.max_kernel_inputs, b.max_kernel_inputs);
  EXPECT_EQ(a.max_kernel_outputs, b.max_kernel_outputs);
}

// A target's name is any C++ string (a target file's name is its stem, any bytes on Linux); to_json
// threw nlohmann's type_error 316 on one that is not UTF-8, as FusionPlan::to_json did before.
TEST(FusionTarget, JsonOfANameThatIsNotUtf8ReplacesItsBadBytes) {
  FusionTarget target = FusionTarget::cpu();
  target.name = "tuned\xff";
  target.launch_overhead_ns = 123.25;
  target.max_kernel_inputs = 7;
  std::string json;
  ASSERT_NO_THROW(json = target.to_json());
  EXPECT_NE(json.find("\"name\": \"tuned\xef\xbf\xbd\""), std::string::npos) << json;  // U+FFFD
  const FusionTarget again = FusionTarget::from_json(json);
  EXPECT_EQ(again.name, "tuned\xef\xbf\xbd");
  expect_same_figures(again, target);

  // A name reached through a file, the stem of "tuned\xfe.json", is spelled (NameOfAFileIsText).
  const auto path = std::filesystem::temp_directory_path() / "metile_target_tuned\xfe.json";
  {
    std::ofstream file(path);
    file << R"({"base": "cpu", "max_kernel_outputs": 3})";
  }
  const FusionTarget from_file = FusionTarget::from_json_file(path);
  std::filesystem::remove(path);
  ASSERT_EQ(from_file.name, "metile_target_tuned\\xfe");
  EXPECT_EQ(from_file.max_kernel_outputs, 3);

  // A UTF-8 name (é, a CJK character, an emoji) comes back byte for byte, with every figure.
  target.name = "r\xc3\xa9glage-\xe6\xa0\x87-\xf0\x9f\x9a\x80";
  const FusionTarget utf8 = FusionTarget::from_json(target.to_json());
  EXPECT_EQ(utf8.name, target.name);
  expect_same_figures(utf8, target);
}

using testing::seed_graph;

// A target's name is printed by `metile plan` (its first line, the DOT label) and read by Python.
// A name a target file took from its file name kept the file name's bytes: an escape sequence
// reached the terminal, and a stem that is not UTF-8 raised UnicodeDecodeError on Python's
// FusionTarget.name and FusionPlan.target_name. Now those bytes are spelled \xNN, and a name the
// file or a caller gives is refused, as a graph's names are, when it holds a control byte.
TEST(FusionTarget, NameOfAFileIsText) {
  const auto directory = std::filesystem::temp_directory_path();
  const auto write = [](const std::filesystem::path& path) {
    std::ofstream file(path);
    file << R"({"base": "cpu"})";
  };
  const auto escape = directory / "metile_target_\x1b[31mred.json";
  write(escape);
  const FusionTarget coloured = FusionTarget::from_name_or_file(escape.string());
  std::filesystem::remove(escape);
  EXPECT_EQ(coloured.name, "metile_target_\\x1b[31mred");
  const auto latin1 = directory / "metile_target_caf\xe9.json";  // Latin-1, not UTF-8
  write(latin1);
  const FusionTarget not_utf8 = FusionTarget::from_name_or_file(latin1.string());
  std::filesystem::remove(latin1);
  EXPECT_EQ(not_utf8.name, "metile_target_caf\\xe9");
  const auto utf8 = directory / "metile_target_caf\xc3\xa9.json";  // UTF-8 stays as written
  write(utf8);
  const FusionTarget accented = FusionTarget::from_name_or_file(utf8.string());
  std::filesystem::remove(utf8);
  EXPECT_EQ(accented.name, "metile_target_caf\xc3\xa9");
  EXPECT_NO_THROW(plan_graph_fusion(seed_graph(), accented));

  expect_input_error(R"({"name": "a\u001b[31mb"})",
                     "t.json: field 'name': a name may not hold a control character (\\x1b at offset 1)");
  FusionTarget target = FusionTarget::cpu();
  target.name = std::string("two\nlines\0", 10);
  try {
    plan_graph_fusion(seed_graph(), target);
    FAIL() << "a name with a newline was planned for";
  } catch (const InputError& error) {
    EXPECT_STREQ(error.what(),
                 "fusion target 'two\\x0alines\\x00': field 'name': a name may not hold a control character "
                 "(\\x0a at offset 3)");
  }
}

TEST(CostModel, SeedRegionMatchesHandArithmetic) {
  const ComputeGraph graph = seed_graph();
  const FusionTarget target = FusionTarget::h200();
  const std::vector<NodeId> both = {0, 1};
  const RegionEstimate estimate = estimate_region(graph, both, target);
  const double row = 2048 * 2;  // one f16 [1, 2048] tensor
  const double bandwidth = target.memory_bandwidth_bytes_per_ns;
  // Unfused: add reads 2 rows, writes 1; rms_norm reads the sum and the weight, writes 1.
  const double unfused = 2 * target.launch_overhead_ns + (3 * row + 3 * row) / bandwidth;
  // Fused: reads values, residual, weight; writes summed (a graph output) and normalized.
  const double fused = target.launch_overhead_ns + (3 * row + 2 * row) / bandwidth +
                       2 * row / target.on_chip_bandwidth_bytes_per_ns;
  EXPECT_NEAR(estimate.unfused_ns, unfused, 1e-9);
  EXPECT_NEAR(estimate.fused_ns, fused, 1e-9);
  EXPECT_NEAR(estimate.benefit_ns, unfused - fused, 1e-9);
  EXPECT_EQ(estimate.memory_bytes_avoided, static_cast<std::int64_t>(row));
  EXPECT_EQ(estimate.input_count, 3);
  EXPECT_EQ(estimate.output_count, 2);
  // The row reduction's input is computed inside: its f32 row is staged.
  EXPECT_EQ(estimate.shared_memory_bytes, 2048 * 4);
  EXPECT_EQ(estimate.registers_per_thread, 32 + 2 + 8);
}

// Rules are data, and Python sets their needs: three elementwise ops at INT_MAX registers each summed
// in int, wrapping around to a small figure the limit check let through (a 4-op region on h200).
TEST(CostModel, RegisterNeedsSaturateInsteadOfWrappingAround) {
  GraphBuilder builder;
  auto x = builder.input("x", {{1, 16}, DType::f32});
  auto a = builder.silu(x, "a");
  auto b = builder.exp(a, "b");
  auto c = builder.silu(b, "c");
  auto d = builder.silu(c, "d");
  const ComputeGraph graph = builder.build({d});
  ResourceNeeds needs;
  needs.registers_per_elementwise = std::numeric_limits<int>::max();
  const std::vector<NodeId> nodes = {0, 1, 2, 3};
  const FusionTarget target = FusionTarget::h200();
  const RegionEstimate estimate = estimate_region(graph, nodes, target, needs);
  EXPECT_EQ(estimate.registers_per_thread, std::numeric_limits<int>::max());
  EXPECT_FALSE(within_limits(estimate, target).ok);
  RuleSet rules = default_rules();
  for (FusionRule& rule : rules.rules) rule.resources = needs;
  const FusionPlan plan = plan_graph_fusion(graph, target, rules);
  EXPECT_EQ(plan.kernel_count(), 4);
}

// "fits", or the reason the target refuses the estimate.
std::string said(const Decision& decision) { return decision.ok ? "fits" : decision.reason; }

TEST(CostModel, LimitsAreNamedWithTheirNumbers) {
  FusionTarget target = FusionTarget::h200();
  RegionEstimate estimate;
  estimate.shared_memory_bytes = 48 * 1024;
  estimate.registers_per_thread = 40;
  target.shared_memory_per_block_bytes = 32 * 1024;
  EXPECT_EQ(said(within_limits(estimate, target)), "needs 48 KB shared memory, target allows 32 KB");
  target.shared_memory_per_multiprocessor_bytes = 100;  // the smaller of the two limits binds, printed in bytes
  EXPECT_EQ(said(within_limits(estimate, target)), "needs 48 KB shared memory, target allows 100 bytes");
  target.shared_memory_per_multiprocessor_bytes = FusionTarget::h200().shared_memory_per_multiprocessor_bytes;
  target.shared_memory_per_block_bytes = 64 * 1024;
  EXPECT_EQ(said(within_limits(estimate, target)), "fits");
  target.registers_per_thread = 32;
  EXPECT_EQ(said(within_limits(estimate, target)), "needs 40 registers per thread, target allows 32");
  target.registers_per_thread = 255;
  target.registers_per_multiprocessor = 8192;
  EXPECT_EQ(said(within_limits(estimate, target)),
            "needs 10240 registers per block (40 per thread × 256 threads), target allows 8192");
  target.registers_per_multiprocessor = 65536;
  estimate.input_count = 9;
  target.max_kernel_inputs = 8;
  EXPECT_EQ(said(within_limits(estimate, target)), "reads 9 inputs, target allows 8 per kernel");
}

}  // namespace
}  // namespace metile
