// The op table from the outside: every registered op's sample graph goes through JSON, the CPU
// reference, the planner (its plan run kernel by kernel equals the reference bit for bit) and, for
// ops a row kernel computes, NVRTC for sm_90. sum and mean (rows to [..., 1]) against a float64
// sum written here. Last, an op added through register_op alone works in all of them and in a
// GEMV epilogue.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "codegen_test_support.h"
#include "metile/codegen.h"
#include "metile/cpu_runtime.h"
#include "metile/decode_mlp.h"
#include "metile/discovery.h"
#include "metile/gemv.h"
#include "metile/fusion.h"
#include "metile/graph.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing_support::expect_compiles_for_sm90;

bool row_kernel_computes(const Node& node) {
  const OpDefinition& definition = *find_op(node.op);
  return node.op == "cast" || definition.elementwise ||
         (definition.row_reduction && node.kind == OpKind::row_reduction);
}

// The same one-node graph with the certificate of the law flash_attention is built on.
ComputeGraph with_certificate(const ComputeGraph& graph) {
  const Node& node = graph.nodes().front();
  GraphBuilder builder;
  std::vector<ValueRef> inputs;
  for (ValueId input : node.inputs) inputs.push_back(builder.input(graph.value(input).name, graph.value(input).spec));
  Attributes attributes = node.attributes;
  attributes.set("certificate", prove(stable_weighted_softmax_law()).to_json());
  return builder.build(builder.add_node(node.op, inputs, attributes, node.name));
}

TEST(OpTable, EverySampleGraphRunsThroughEveryConsumer) {
  const std::uint64_t seed = testing::test_seed("OpTable.EverySampleGraphRunsThroughEveryConsumer");
  for (std::string_view op : registered_op_names()) {
    SCOPED_TRACE(std::string(op));
    const OpDefinition& definition = *find_op(op);
    ASSERT_TRUE(definition.sample_graph) << op << " has no sample graph";
    ComputeGraph graph = definition.sample_graph();
    ASSERT_EQ(graph.nodes().size(), 1u);
    if (op == "flash_attention") {
      // The executor refuses a flash_attention node without a verified certificate of its law;
      // the sample, built in the graph module, has none: the rewrite (src/discovery) attaches it.
      EXPECT_NE(testing::error_of([&] { run_reference(graph, random_inputs(graph, seed)); }).find("carries no certificate"),
                std::string::npos);
      graph = with_certificate(graph);
    }
    const Node& node = graph.nodes().front();
    EXPECT_EQ(node.op, op);
    EXPECT_EQ(parse_graph_json(write_graph_json(graph), "sample.json"), graph);

    const TensorMap inputs = random_inputs(graph, seed);
    const TensorMap outputs = run_reference(graph, inputs);
    const Value& out = graph.value(graph.outputs().front());
    ASSERT_EQ(outputs.at(out.name).spec(), out.spec);
    for (double value : outputs.at(out.name).to_values()) {
      if (op != "causal_mask" && op != "position_mask") {
        EXPECT_TRUE(std::isfinite(value)) << value;
      }
    }

    const FusionPlan plan = plan_graph_fusion(graph);
    ASSERT_EQ(plan.node_reasons.size(), 1u);
    EXPECT_FALSE(plan.node_reasons.front().empty());
    EXPECT_EQ(run_plan_reference(plan, inputs), outputs);

    EXPECT_EQ(row_kernel_computes(node), row_region_decision(graph, single_node_region(graph, node.id)).ok);
    if (row_kernel_computes(node)) expect_compiles_for_sm90(generate_node_kernel(graph, node.id));
  }
}

// Each built-in elementwise op's value written here in long double, from its textbook formula, not
// from the op table's math (which writes the f32 reference and the f64 oracle as one template, so a
// wrong formula there would pass a comparison of the two).
using ClosedForm = std::function<long double(const std::vector<long double>& operands, const Node& node)>;

const std::map<std::string, ClosedForm, std::less<>>& closed_forms() {
  static const std::map<std::string, ClosedForm, std::less<>> forms = {
      {"add", [](const auto& x, const Node&) { return x[0] + x[1]; }},
      {"subtract", [](const auto& x, const Node&) { return x[0] - x[1]; }},
      {"multiply", [](const auto& x, const Node&) { return x[0] * x[1]; }},
      {"scale", [](const auto& x, const Node& node) { return x[0] * node.attributes.get_double("factor"); }},
      {"silu", [](const auto& x, const Node&) { return x[0] / (1 + std::exp(-x[0])); }},
      {"exp", [](const auto& x, const Node&) { return std::exp(x[0]); }},
      {"gelu",
       [](const auto& x, const Node& node) {
         const long double v = x[0];
         if (node.attributes.get_string("approximate") == "tanh") {
           const long double pi = 3.141592653589793238462643383279502884L;
           return 0.5L * v * (1 + std::tanh(std::sqrt(2 / pi) * (v + 0.044715L * v * v * v)));
         }
         return 0.5L * v * (1 + std::erf(v / std::sqrt(2.0L)));
       }},
      // Keys j > i + offset of query row i are -inf (checked in the test's loop); the others pass x.
      {"causal_mask", [](const auto& x, const Node&) { return x[0]; }},
      {"softsign", [](const auto& x, const Node&) { return x[0] / (1 + std::fabs(x[0])); }},
  };
  return forms;
}

TEST(OpTable, ElementwiseMathFollowsClosedFormsWrittenHere) {
  const std::uint64_t seed = testing::test_seed("OpTable.ElementwiseMathFollowsClosedFormsWrittenHere");
  int checked_ops = 0;
  for (std::string_view op : registered_op_names()) {
    const OpDefinition& definition = *find_op(op);
    if (!definition.elementwise) continue;
    SCOPED_TRACE(std::string(op));
    const auto form = closed_forms().find(op);
    ASSERT_NE(form, closed_forms().end()) << "write " << op << "'s closed form in closed_forms()";
    std::vector<ComputeGraph> graphs{definition.sample_graph()};
    if (op == "gelu") {  // the sample takes the tanh form; the erf form too
      const ComputeGraph& sample = graphs.front();
      GraphBuilder builder;
      const ValueRef x = builder.input("x", sample.value(sample.nodes().front().inputs.front()).spec);
      Attributes erf_form;
      erf_form.set("approximate", std::string("none"));
      graphs.push_back(builder.build(builder.add_node("gelu", {x}, erf_form, "out")));
    }
    if (op == "causal_mask") {  // the sample's scores are square; fewer queries than keys too
      GraphBuilder builder;
      const ValueRef x = builder.input("x", {{2, 3, 5}, DType::f32});
      Attributes offset;
      offset.set("offset", std::int64_t{1});
      graphs.push_back(builder.build(builder.add_node("causal_mask", {x}, offset, "out")));
    }
    for (const ComputeGraph& graph : graphs) {
      const Node& node = graph.nodes().front();
      SCOPED_TRACE(write_graph_json(graph));
      const TensorMap inputs = random_inputs(graph, seed);
      std::vector<TensorSpec> specs;
      std::vector<std::vector<double>> values;
      for (ValueId input : node.inputs) {
        specs.push_back(graph.value(input).spec);
        values.push_back(inputs.at(graph.value(input).name).to_values());
      }
      const ElementFunctions math = definition.elementwise->bind(node.attributes, specs);
      const TensorSpec& out_spec = graph.value(node.outputs.front()).spec;
      const std::vector<double> out = run_reference(graph, inputs).at(graph.value(node.outputs.front()).name).to_values();
      // causal_mask's scores are [..., queries, keys]: flat row r is query r mod queries, column the key.
      const std::int64_t queries = out_spec.rank() >= 2 ? out_spec.shape[out_spec.shape.size() - 2] : 1;
      std::vector<double> operands(values.size());
      std::vector<long double> exact_operands(values.size());
      int masked = 0;
      for (std::size_t index = 0; index < out.size(); ++index) {
        for (std::size_t k = 0; k < values.size(); ++k) {
          operands[k] = values[k][index % values[k].size()];
          exact_operands[k] = operands[k];
        }
        const auto flat = static_cast<std::int64_t>(index);
        const ElementSite site{flat / out_spec.row_length(), flat % out_spec.row_length()};
        const double oracle = math.f64(operands, site);
        const std::int64_t query = site.row % queries, key = site.column;
        if (op == "causal_mask" && key > query + node.attributes.get_int("offset")) {
          EXPECT_EQ(out[index], -INFINITY) << index;
          EXPECT_EQ(oracle, -INFINITY) << index;
          ++masked;
          continue;
        }
        const double expected = static_cast<double>(form->second(exact_operands, node));
        // The f64 oracle to a few of its ulps, the f32 reference to a few of f32's (the inputs lie in
        // [-1, 1): gelu's 0.044715 written 0.04472 is ~9e-7 off, past this bound).
        EXPECT_NEAR(oracle, expected, 1e-14 * (1 + std::fabs(expected))) << index;
        EXPECT_NEAR(out[index], expected, 4e-7 * (1 + std::fabs(expected))) << index;
      }
      if (op == "causal_mask") {
        EXPECT_GT(masked, 0);
      }
    }
    ++checked_ops;
  }
  EXPECT_GE(checked_ops, 8);  // add, subtract, multiply, scale, silu, gelu, exp, causal_mask
}

// ---------------------------------------------------------------- sum and mean

TEST(OpTable, SumAndMeanReduceRowsToOneValueLikeAFloat64Sum) {
  const std::uint64_t seed = testing::test_seed("OpTable.SumAndMeanReduceRowsToOneValueLikeAFloat64Sum");
  for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (std::int64_t length : {1, 7, 256, 3000}) {
      GraphBuilder builder;
      const ValueRef x = builder.input("x", {{2, 3, length}, dtype});
      const ComputeGraph graph = builder.build({builder.sum(x, "total"), builder.mean(x, "average")});
      const TensorMap inputs = random_inputs(graph, seed);
      const TensorMap outputs = run_reference(graph, inputs);
      const std::vector<double> values = inputs.at("x").to_values();
      const std::vector<double> totals = outputs.at("total").to_values();
      const std::vector<double> averages = outputs.at("average").to_values();
      ASSERT_EQ(outputs.at("total").spec(), TensorSpec({2, 3, 1}, dtype));
      ASSERT_EQ(totals.size(), 6u);
      for (std::size_t row = 0; row < 6; ++row) {
        double total = 0;
        for (std::int64_t d = 0; d < length; ++d) total += values[row * static_cast<std::size_t>(length) + static_cast<std::size_t>(d)];
        // Rounded to f32, then to the dtype: within one ulp of the dtype of the exact value, and
        // within the dtype's subnormal spacing where the value is below its normal range (an f16
        // mean of a long row can be ~2e-5, where f16 steps by 2^-24).
        const double ulp = dtype == DType::f32 ? 0x1p-23 : dtype == DType::f16 ? 0x1p-10 : 0x1p-7;
        const double subnormal_step = dtype == DType::f32 ? 0x1p-149 : dtype == DType::f16 ? 0x1p-24 : 0x1p-133;
        EXPECT_NEAR(totals[row], total, ulp * std::fabs(total) + subnormal_step) << dtype_name(dtype) << " " << length;
        const double average = total / static_cast<double>(length);
        EXPECT_NEAR(averages[row], average, ulp * std::fabs(average) + subnormal_step) << dtype_name(dtype) << " " << length;
      }
    }
  }
}

TEST(OpTable, SumFusesItsPrologueAndStoresOneValuePerRow) {
  GraphBuilder builder;
  const ValueRef x = builder.input("x", {{8, 512}, DType::bf16});
  const ValueRef weight = builder.input("weight", {{512}, DType::bf16});
  const ValueRef weighted = builder.multiply(builder.silu(x, "activated"), weight, "weighted");
  const ValueRef total = builder.sum(weighted, "total");
  const ValueRef halved = builder.scale(total, 0.5, "halved");  // [8, 1]: not the kernel's rows
  const ComputeGraph graph = builder.build({halved});
  const FusionPlan plan = plan_graph_fusion(graph);
  ASSERT_EQ(plan.regions.size(), 1u);
  const FusionRegion& region = plan.regions.front();
  EXPECT_EQ(region.rule, "row_reduction");
  EXPECT_EQ(region.nodes.size(), 3u) << "silu, multiply and sum in one kernel";
  EXPECT_NE(plan.node_reasons[static_cast<std::size_t>(*graph.find_node("halved"))].find("shape"), std::string::npos)
      << plan.node_reasons[static_cast<std::size_t>(*graph.find_node("halved"))];
  const TensorMap inputs = random_inputs(graph, testing::test_seed("OpTable.SumFusesItsPrologueAndStoresOneValuePerRow"));
  EXPECT_EQ(run_plan_reference(plan, inputs), run_reference(graph, inputs));

  const Decision rows = row_region_decision(graph, region);
  ASSERT_TRUE(rows.ok) << rows.reason;
  for (const RowKernelOptions& options : row_kernel_variants(graph, region)) {
    const GeneratedKernel kernel = generate_region_kernel(graph, region, options);
    EXPECT_NE(kernel.source.find("if (row_valid && lane == 0) out0[safe_row] = metile_device::from_float<__nv_bfloat16>(r0);"),
              std::string::npos)
        << kernel.source;
  }
  expect_compiles_for_sm90(generate_region_kernel(graph, region));
  // A mean over long rows streams its tiles; the division by the length follows the reduction.
  GraphBuilder long_rows;
  const ValueRef wide = long_rows.input("wide", {{2, 200000}, DType::f32});
  const ComputeGraph mean_graph = long_rows.build({long_rows.mean(wide, "average")});
  const GeneratedKernel mean_kernel = generate_node_kernel(mean_graph, 0);
  EXPECT_NE(mean_kernel.source.find("(streamed)"), std::string::npos) << mean_kernel.summary;
  EXPECT_NE(mean_kernel.source.find("from_float<float>(r0 / 200000)"), std::string::npos);  // the exact length
  expect_compiles_for_sm90(mean_kernel);

  // Reading a [..., 1] value inside the same row kernel is refused, with the reason.
  const FusionRegion whole = testing_support::whole_graph_region(graph);
  const Decision refused = row_region_decision(graph, whole);
  EXPECT_FALSE(refused.ok);
  EXPECT_NE(refused.reason.find("reads 'total', one value per row"), std::string::npos) << refused.reason;
}

// ---------------------------------------------------------------- an op added through the table

template <typename T>
T softsign(T x) {
  return x / (T(1) + std::fabs(x));
}

void register_softsign() {
  if (find_op("softsign") != nullptr) return;
  OpDefinition definition;
  definition.name = "softsign";
  definition.kind = OpKind::elementwise;
  definition.input_names = {"x"};
  definition.infer = [](std::span<const TensorSpec> inputs, Attributes&) {
    if (!is_floating(inputs[0].dtype)) throw InputError("x must have a floating dtype");
    return std::vector<TensorSpec>{inputs[0]};
  };
  ElementwiseMath math;
  math.bind = [](const Attributes&, std::span<const TensorSpec>) {
    return ElementFunctions{[](std::span<const float> x, ElementSite) { return softsign(x[0]); },
                            [](std::span<const double> x, ElementSite) { return softsign(x[0]); }};
  };
  math.cuda = [](std::span<const std::string> x, const CudaElementSite&, const Attributes&, std::span<const TensorSpec>) {
    return "softsign_f32(" + x[0] + ")";
  };
  math.cuda_helpers = "__device__ __forceinline__ float softsign_f32(float x) { return x / (1.0f + fabsf(x)); }\n";
  definition.elementwise = std::move(math);
  definition.sample_graph = [] {
    GraphBuilder builder;
    const ValueRef x = builder.input("x", {{4, 32}, DType::f32});
    return builder.build(builder.add_node("softsign", {x}, {}, "out"));
  };
  register_op(std::move(definition));
}

TEST(OpTable, AnOpAddedThroughTheTableWorksEverywhere) {
  register_softsign();
  EXPECT_EQ(find_op("softsign")->kind, OpKind::elementwise);
  EXPECT_EQ(testing::error_of([] { register_softsign(), register_op(*find_op("softsign")); }),
            "register_op: op 'softsign' is already registered");

  // JSON: the graph file vocabulary knows it.
  const ComputeGraph graph = parse_graph_json(R"({
    "inputs": [{"name": "x", "shape": [3, 1000], "dtype": "bf16"}, {"name": "w", "shape": [1000], "dtype": "bf16"}],
    "nodes": [{"name": "shifted", "op": "add", "inputs": ["x", "w"]},
              {"name": "squashed", "op": "softsign", "inputs": ["shifted"]},
              {"name": "out", "op": "scale", "inputs": ["squashed"], "attrs": {"factor": 3}}],
    "outputs": ["out"]})",
                                              "softsign.json");
  EXPECT_EQ(parse_graph_json(write_graph_json(graph), "again.json"), graph);

  // The CPU reference, against softsign computed here in double from the same bf16 inputs.
  const TensorMap inputs = random_inputs(graph, testing::test_seed("OpTable.AnOpAddedThroughTheTableWorksEverywhere"));
  const TensorMap outputs = run_reference(graph, inputs);
  const std::vector<double> x = inputs.at("x").to_values(), w = inputs.at("w").to_values();
  const std::vector<double> out = outputs.at("out").to_values();
  for (std::size_t index = 0; index < out.size(); ++index) {
    const double shifted = round_to_dtype(static_cast<float>(x[index] + w[index % 1000]), DType::bf16);
    const double squashed = round_to_dtype(static_cast<float>(shifted / (1 + std::fabs(shifted))), DType::bf16);
    EXPECT_NEAR(out[index], 3 * squashed, 0x1p-7 * 3 * std::fabs(squashed) + 1e-12) << index;
  }

  // The planner: one elementwise chain, which runs kernel by kernel like the reference.
  const FusionPlan plan = plan_graph_fusion(graph);
  ASSERT_EQ(plan.regions.size(), 1u);
  EXPECT_EQ(plan.regions.front().nodes.size(), 3u);
  EXPECT_TRUE(plan.unfused.empty());
  EXPECT_EQ(run_plan_reference(plan, inputs), outputs);

  // The row kernel of the region, compiled by NVRTC.
  const GeneratedKernel kernel = generate_region_kernel(graph, plan.regions.front());
  EXPECT_NE(kernel.source.find("softsign_f32(v0[item][e])"), std::string::npos) << kernel.source;
  expect_compiles_for_sm90(kernel);

  // A GEMV epilogue applies it too, with the same device expression and the table's f64 math.
  GraphBuilder builder;
  const ValueRef activations = builder.input("x", {{1, 64}, DType::bf16});
  const ValueRef weights = builder.input("w", {{32, 64}, DType::bf16});
  const ValueRef product = builder.matmul(activations, weights, true, "product");
  const ValueRef squashed = builder.add_node("softsign", {product}, {}, "squashed").front();
  const ComputeGraph gemv_graph = builder.build({squashed});
  const std::vector<ValueId> accumulators{*gemv_graph.find_value("product")};
  const GemvEpilogue epilogue = GemvEpilogue::from_graph(gemv_graph, *gemv_graph.find_value("squashed"), accumulators);
  EXPECT_EQ(epilogue.kind(), GemvEpilogue::Kind::op);
  EXPECT_EQ(epilogue.cuda_expression(), "softsign_f32(to_f32(from_f32(acc0)))");  // the product is a bf16 value
  EXPECT_EQ(epilogue.to_string(), "softsign(bf16(acc0))");
  const std::vector<double> accumulator_values{-3.0};
  EXPECT_DOUBLE_EQ(epilogue.evaluate(accumulator_values, {}), -0.75);
}

}  // namespace
}  // namespace metile
