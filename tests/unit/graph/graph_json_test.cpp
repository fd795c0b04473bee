// JSON graph files and DOT: the example files parse to the graphs they describe,
// writing is deterministic and parse(write(g)) == g on random graphs, nodes may
// come in any order, and each bad file gives one error with source and JSON path.
#include <algorithm>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "metile/graph.h"
#include "metile_test_support.h"
#include "random_graph.h"

namespace metile {
namespace {

using Json = nlohmann::json;

using testing::error_of;
using testing::read_text;
using testing::seed_graph;

std::string parse_error(const std::string& text) {
  return error_of([&] { parse_graph_json(text, "g.json"); });
}

const std::filesystem::path kExamples = METILE_EXAMPLES_DIR;

TEST(GraphJsonTest, SeedExampleIsTheBuilderGraphAndItsWrittenForm) {
  const ComputeGraph graph = read_graph(kExamples / "add_rms_norm.json");
  EXPECT_EQ(graph, seed_graph());
  EXPECT_EQ(write_graph_json(graph), read_text(kExamples / "add_rms_norm.json"));
}

TEST(GraphJsonTest, DesignDocumentSnippetParses) {
  const ComputeGraph graph = parse_graph_json(R"({
    "inputs":  [{"name": "values", "shape": [1, 2048], "dtype": "f16"},
                {"name": "residual", "shape": [1, 2048], "dtype": "f16"},
                {"name": "weight", "shape": [2048], "dtype": "f16"}],
    "nodes":   [{"name": "summed", "op": "add", "inputs": ["values", "residual"]},
                {"name": "normalized", "op": "rms_norm", "inputs": ["summed", "weight"], "attrs": {"eps": 1e-5}}],
    "outputs": ["summed", "normalized"]})");
  EXPECT_EQ(graph, seed_graph());
}

TEST(GraphJsonTest, DecoderLayerExample) {
  const ComputeGraph graph = read_graph(kExamples / "decoder_layer.json");
  ASSERT_EQ(graph.outputs().size(), 1u);
  const Value& output = graph.value(graph.outputs()[0]);
  EXPECT_EQ(output.spec, TensorSpec({8, 512}, DType::bf16));
  std::map<std::string, int> op_counts;
  for (const Node& node : graph.nodes()) ++op_counts[node.op];
  EXPECT_EQ(op_counts["quantized_matmul"], 7);  // q, k, v, o, gate, up, down
  EXPECT_EQ(op_counts["rms_norm"], 2);
  EXPECT_EQ(op_counts["rope"], 2);
  EXPECT_EQ(op_counts["softmax"], 1);
  EXPECT_EQ(op_counts["causal_mask"], 1);
  EXPECT_EQ(op_counts["matmul"], 2);
  EXPECT_EQ(op_counts["add"], 2);
  EXPECT_EQ(op_counts["silu"], 1);
  for (const Node& node : graph.nodes()) {
    if (node.op != "quantized_matmul") continue;
    EXPECT_EQ(node.attributes.get_int("bits"), 4) << node.name;
    EXPECT_EQ(node.attributes.get_int("group_size"), 64) << node.name;
  }
  const Node& scores = graph.node(*graph.find_node("scores"));
  EXPECT_EQ(graph.value(scores.outputs[0]).spec, TensorSpec({8, 8, 8}, DType::bf16));  // heads, queries, keys
  EXPECT_EQ(write_graph_json(parse_graph_json(write_graph_json(graph))), write_graph_json(graph));
}

TEST(GraphJsonTest, SwigluMlpExample) {
  const ComputeGraph graph = read_graph(kExamples / "swiglu_mlp.json");
  ASSERT_EQ(graph.outputs().size(), 1u);
  EXPECT_EQ(graph.value(graph.outputs()[0]).spec, TensorSpec({1, 4096}, DType::bf16));
  const Value& hidden = graph.value(*graph.find_value("hidden"));
  EXPECT_EQ(hidden.spec, TensorSpec({1, 14336}, DType::bf16));
  int matmuls = 0;
  for (const Node& node : graph.nodes()) {
    if (node.op != "matmul") continue;
    ++matmuls;
    EXPECT_EQ(node.attributes.get_int("transpose_right"), 1);
  }
  EXPECT_EQ(matmuls, 3);
}

TEST(GraphJsonTest, AttributeTypesFollowTheJsonNumbers) {
  const ComputeGraph graph = parse_graph_json(R"({
    "inputs": [{"name": "a", "shape": [4, 8], "dtype": "f32"}, {"name": "b", "shape": [6, 8], "dtype": "f32"}],
    "nodes": [{"name": "m", "op": "matmul", "inputs": ["a", "b"], "attrs": {"transpose_right": true}},
              {"name": "s", "op": "scale", "inputs": ["m"], "attrs": {"factor": 2}},
              {"name": "t", "op": "scale", "inputs": ["s"], "attrs": {"factor": 2.0}},
              {"name": "r", "op": "reshape", "inputs": ["t"], "attrs": {"shape": [2, -1]}}],
    "outputs": ["r"]})");
  EXPECT_EQ(graph.node(0).attributes.entries().at("transpose_right"), AttributeValue(std::int64_t{1}));
  EXPECT_EQ(graph.node(1).attributes.entries().at("factor"), AttributeValue(2.0));  // canonicalised by scale
  EXPECT_EQ(graph.node(3).attributes.get_ints("shape"), (std::vector<std::int64_t>{2, 12}));
  EXPECT_EQ(graph.value(graph.outputs()[0]).spec, TensorSpec({2, 12}, DType::f32));
}

TEST(GraphJsonTest, NodesMayComeInAnyOrder) {
  const ComputeGraph graph = parse_graph_json(R"({
    "inputs": [{"name": "x", "shape": [4], "dtype": "f32"}],
    "nodes": [{"name": "c", "op": "add", "inputs": ["b", "a"]},
              {"name": "b", "op": "exp", "inputs": ["a"]},
              {"name": "a", "op": "silu", "inputs": ["x"]}],
    "outputs": ["c"]})");
  ASSERT_EQ(graph.nodes().size(), 3u);
  EXPECT_EQ(graph.node(0).name, "a");
  EXPECT_EQ(graph.node(1).name, "b");
  EXPECT_EQ(graph.node(2).name, "c");
  EXPECT_EQ(graph.node(2).inputs, (std::vector<ValueId>{2, 1}));
}

// An unnamed node is named op_N past every name the file gives, whichever comes first: the unnamed exp
// took exp_0 before the node the file names exp_0 was added, and the file was refused
// ("node 'exp_0' (silu): duplicate name 'exp_0', already used by node 'exp_0' (exp)").
TEST(GraphJsonTest, UnnamedNodesAvoidNamesTheFileGivesLaterNodes) {
  const std::string input = R"({"inputs": [{"name": "x", "shape": [4], "dtype": "f32"}], )";
  for (const std::string nodes : {R"([{"op": "exp", "inputs": ["x"]}, {"name": "exp_0", "op": "silu", "inputs": ["x"]}])",
                                  R"([{"name": "exp_0", "op": "silu", "inputs": ["x"]}, {"op": "exp", "inputs": ["x"]}])"}) {
    const ComputeGraph graph = parse_graph_json(input + R"("nodes": )" + nodes + R"(, "outputs": ["exp_0", "exp_1"]})");
    ASSERT_TRUE(graph.find_node("exp_0") && graph.find_node("exp_1")) << nodes;
    EXPECT_EQ(graph.node(*graph.find_node("exp_0")).op, "silu") << nodes;
    EXPECT_EQ(graph.node(*graph.find_node("exp_1")).op, "exp") << nodes;
  }
}

TEST(GraphJsonTest, CyclesAreReportedWithANodeOnThem) {
  EXPECT_EQ(parse_error(R"({"inputs": [{"name": "x", "shape": [4], "dtype": "f32"}],
    "nodes": [{"name": "out", "op": "add", "inputs": ["x", "b"]},
              {"name": "b", "op": "exp", "inputs": ["c"]},
              {"name": "c", "op": "add", "inputs": ["x", "b"]}],
    "outputs": ["out"]})"),
            "g.json: /nodes/1: node 'b' is on a cycle (each reads the next): b <- c <- b");
  EXPECT_EQ(parse_error(R"({"inputs": [], "nodes": [{"name": "s", "op": "exp", "inputs": ["s"]}], "outputs": ["s"]})"),
            "g.json: /nodes/0: node 's' is on a cycle (each reads the next): s <- s");
}

TEST(GraphJsonTest, ErrorsNameTheSourceAndThePath) {
  const std::string inputs = R"("inputs": [{"name": "values", "shape": [1, 8], "dtype": "f16"},
                                           {"name": "weight", "shape": [8], "dtype": "f16"}])";
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "summed", "op": "add", "inputs": ["values", "values"]},
    {"name": "n", "op": "rms_norm", "inputs": ["sumed", "weight"], "attrs": {"eps": 1e-5}}], "outputs": ["n"]})"),
            "g.json: /nodes/1/inputs/0: unknown value 'sumed'");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "rms_norm", "inputs": ["values", "values"],
    "attrs": {"eps": 1e-5}}], "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n' (rms_norm): weight f16[1, 8] does not match the last axis of x f16[1, 8] "
            "(expected [8])");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "rms_norm", "inputs": ["values", "weight"],
    "attrs": {"eps": 0}}], "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n' (rms_norm): eps must be positive, got 0");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "norm", "inputs": ["values"]}], "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n' (norm): unknown op 'norm'");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "exp", "inputs": ["values", "weight"]}],
    "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n' (exp): expects 1 inputs (x), got 2");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "exp", "inputs": ["values"]},
    {"name": "n", "op": "silu", "inputs": ["values"]}], "outputs": ["n"]})"),
            "g.json: /nodes/1/name: duplicate name 'n' (also /nodes/0)");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "weight", "op": "exp", "inputs": ["values"]}],
    "outputs": ["weight"]})"),
            "g.json: /nodes/0/name: duplicate name 'weight' (also /inputs/1)");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "exp", "inputs": ["values"]}], "outputs": ["m"]})"),
            "g.json: /outputs/0: unknown value 'm'");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "exp", "inputs": ["values"]}],
    "outputs": ["n", "values"]})"),
            "g.json: /outputs/1: 'values' is a graph input, not a value produced by the graph");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "exp", "inputs": ["values"]}],
    "outputs": ["n", "n"]})"),
            "g.json: /outputs/1: 'n' is listed twice");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "exp", "inputs": ["values"]}], "outputs": []})"),
            "g.json: /outputs: build: a graph needs at least one output");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "exp", "inputs": ["values"]}]})"),
            "g.json: /: missing 'outputs'");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "exp", "input": ["values"]}], "outputs": ["n"]})"),
            "g.json: /nodes/0: unknown key 'input'");
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "scale", "inputs": ["values"],
    "attrs": {"factor": {"value": 2}}}], "outputs": ["n"]})"),
            "g.json: /nodes/0/attrs/factor: an attribute must be a number, a string or an integer array, got "
            "{\"value\":2}");
  // A boolean is transpose_right's and no other attribute's: `"axis": true` ran as axis 1 before.
  for (const auto& [op, key] : std::vector<std::pair<std::string, std::string>>{
           {"softmax", "axis"}, {"scale", "factor"}, {"causal_mask", "offset"}}) {
    EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": ")" + op + R"(", "inputs": ["values"],
      "attrs": {")" + key + R"(": true}}], "outputs": ["n"]})"),
              "g.json: /nodes/0/attrs/" + key + ": '" + key + "' takes a number, not a boolean (only transpose_right is a flag)");
  }
  EXPECT_EQ(parse_error("{" + inputs + R"(, "nodes": [{"name": "n", "op": "reshape", "inputs": ["values"],
    "attrs": {"shape": [8, 1.5]}}], "outputs": ["n"]})"),
            "g.json: /nodes/0/attrs/shape/1: expected an integer, got 1.5");
  EXPECT_EQ(parse_error(R"({"inputs": [{"name": "x", "shape": [4], "dtype": "f64"}], "nodes": [], "outputs": []})"),
            "g.json: /inputs/0/dtype: unknown dtype 'f64' (expected f16, bf16, f32, i8, u8, i32 or u32)");
  EXPECT_EQ(parse_error(R"({"inputs": [{"name": "x", "shape": [4, 0], "dtype": "f32"}], "nodes": [], "outputs": []})"),
            "g.json: /inputs/0: input 'x': dimension 1 of f32[4, 0] is not positive");
  EXPECT_EQ(parse_error(R"({"inputs": [{"name": "x", "shape": "4", "dtype": "f32"}], "nodes": [], "outputs": []})"),
            "g.json: /inputs/0/shape: must be an array of integers");
  EXPECT_EQ(parse_error(R"([1, 2])"), "g.json: /: a graph file must be a JSON object with inputs, nodes and outputs");
  const std::string invalid = parse_error("{\"inputs\": [\n  {\"name\": }\n]}");
  EXPECT_EQ(invalid.rfind("g.json: invalid JSON: parse error at line 2, column 12", 0), 0u) << invalid;
  const std::filesystem::path missing = kExamples / "no_such_graph.json";
  EXPECT_EQ(error_of([&] { read_graph(missing); }), missing.string() + ": cannot open the file: No such file or directory");
  EXPECT_EQ(error_of([&] { read_graph(kExamples); }), kExamples.string() + ": is a directory, not a graph file");
}

// JSON's \u0000 and \u001b are a NUL and an escape byte in the strings read: every error quoting such
// a string (an op, an attribute key or value, a dtype, a key, a value name, a cycle) spells them \xNN.
// Before, a NUL ended what() there: "g.json: /nodes/0: node 'n' (ex" and nothing of what was wrong.
TEST(GraphJsonTest, ControlBytesInQuotedStringsAreSpelledOut) {
  const std::string input = R"({"inputs": [{"name": "x", "shape": [4], "dtype": "f32"}], )";
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n", "op": "ex\u0000p", "inputs": ["x"]}], "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n' (ex\\x00p): unknown op 'ex\\x00p'");
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n", "op": "exp", "inputs": ["x"], "attrs": {"a\u0000b": 1}}],
    "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n' (exp): unknown attribute 'a\\x00b' (this op takes none)");
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n", "op": "gelu", "inputs": ["x"],
    "attrs": {"approximate": "t\u001b[31m"}}], "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n' (gelu): approximate must be 'none' or 'tanh', got 't\\x1b[31m'");
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n", "op": "cast", "inputs": ["x"], "attrs": {"dtype": "f\u000016"}}],
    "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n' (cast): unknown dtype 'f\\x0016' (expected f16, bf16, f32, i8, u8, i32 or u32)");
  EXPECT_EQ(parse_error(R"({"inputs": [{"name": "x", "shape": [4], "dtype": "f\u00003"}], "nodes": [], "outputs": []})"),
            "g.json: /inputs/0/dtype: unknown dtype 'f\\x003' (expected f16, bf16, f32, i8, u8, i32 or u32)");
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n", "op": "exp", "inputs": ["x\u0000"]}], "outputs": ["n"]})"),
            "g.json: /nodes/0/inputs/0: unknown value 'x\\x00'");
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n", "op": "exp", "inputs": ["x"]}], "outputs": ["n\u0000"]})"),
            "g.json: /outputs/0: unknown value 'n\\x00'");
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n", "op": "exp", "inputs": ["x"], "k\u0000": 1}], "outputs": ["n"]})"),
            "g.json: /nodes/0: unknown key 'k\\x00'");
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n\u0000", "op": "exp", "inputs": ["n\u0000"]}], "outputs": ["n"]})"),
            "g.json: /nodes/0: node 'n\\x00' is on a cycle (each reads the next): n\\x00 <- n\\x00");
  // UTF-8 is not a control byte: it is quoted as written.
  EXPECT_EQ(parse_error(input + R"("nodes": [{"name": "n", "op": "exp", "inputs": ["xé"]}], "outputs": ["n"]})"),
            "g.json: /nodes/0/inputs/0: unknown value 'x\u00e9'");
}

TEST(GraphJsonTest, RandomGraphsRoundTrip) {
  std::set<std::string> ops_seen;
  const auto first = static_cast<std::uint32_t>(testing::test_seed("GraphJsonTest.RandomGraphsRoundTrip"));
  for (std::uint32_t seed = first; seed != first + 60; ++seed) {
    const ComputeGraph graph = testing::random_graph(seed);
    for (const Node& node : graph.nodes()) ops_seen.insert(node.op);
    ASSERT_GE(graph.nodes().size(), 12u) << "seed " << seed;
    const std::string text = write_graph_json(graph);
    const ComputeGraph parsed = parse_graph_json(text, "random.json");
    ASSERT_EQ(parsed, graph) << "seed " << seed << "\n" << text;
    EXPECT_EQ(write_graph_json(parsed), text);
  }
  // The generator reaches every op it draws (so the round trip covers their attributes).
  EXPECT_EQ(ops_seen, (std::set<std::string>{"add", "cast", "causal_mask", "exp", "gelu", "layer_norm", "matmul", "multiply",
                                              "reshape", "rms_norm", "rope", "scale", "silu", "softmax", "subtract",
                                              "transpose"}));
}

// A builder may record an input after a node (a decode step's weights are recorded as they are used);
// the file lists inputs first, so the parsed graph's value ids differ, and it is still the same graph.
// Equality still tells apart a graph that differs in a name, a spec, an attribute or an operand.
TEST(GraphJsonTest, AnInputRecordedAfterANodeRoundTrips) {
  const auto graph = [](double factor, const char* second_input, std::int64_t width, bool swap) {
    GraphBuilder builder;
    const ValueRef x = builder.input("x", {{2, width}, DType::f32});
    const ValueRef scaled = builder.scale(x, factor, "scaled");
    const ValueRef y = builder.input(second_input, {{2, width}, DType::f32});
    return builder.build({swap ? builder.add(y, scaled, "sum") : builder.add(scaled, y, "sum")});
  };
  const ComputeGraph recorded = graph(0.5, "y", 4, false);
  ASSERT_EQ(recorded.value(recorded.inputs()[1]).id, 2);  // recorded after 'scaled'
  const ComputeGraph parsed = parse_graph_json(write_graph_json(recorded));
  EXPECT_EQ(parsed.value(parsed.inputs()[1]).id, 1);
  EXPECT_EQ(parsed, recorded);
  EXPECT_NE(graph(0.25, "y", 4, false), recorded);
  EXPECT_NE(graph(0.5, "z", 4, false), recorded);
  EXPECT_NE(graph(0.5, "y", 8, false), recorded);
  EXPECT_NE(graph(0.5, "y", 4, true), recorded);
}

TEST(GraphJsonTest, ShuffledNodeOrderGivesTheSameNodes) {
  const auto first = static_cast<std::uint32_t>(testing::test_seed("GraphJsonTest.ShuffledNodeOrderGivesTheSameNodes"));
  for (std::uint32_t seed = first; seed != first + 20; ++seed) {
    const ComputeGraph graph = testing::random_graph(seed);
    Json document = Json::parse(write_graph_json(graph));
    std::mt19937 random(seed);
    std::shuffle(document["nodes"].begin(), document["nodes"].end(), random);
    const ComputeGraph parsed = parse_graph_json(document.dump(), "shuffled.json");
    ASSERT_EQ(parsed.nodes().size(), graph.nodes().size());
    for (const Node& node : parsed.nodes()) {
      const Node& original = graph.node(*graph.find_node(node.name));
      EXPECT_EQ(node.op, original.op);
      EXPECT_EQ(node.attributes, original.attributes);
      ASSERT_EQ(node.inputs.size(), original.inputs.size());
      for (std::size_t position = 0; position < node.inputs.size(); ++position) {
        EXPECT_EQ(parsed.value(node.inputs[position]).name, graph.value(original.inputs[position]).name);
        const Value& input = parsed.value(node.inputs[position]);
        EXPECT_LT(input.producer, node.id) << "topological order";
      }
      EXPECT_EQ(parsed.value(node.outputs[0]).spec, graph.value(original.outputs[0]).spec);
    }
  }
}

TEST(GraphDotTest, ContainsEveryNodeInputAndOutput) {
  const ComputeGraph graph = read_graph(kExamples / "decoder_layer.json");
  const std::string dot = graph_to_dot(graph);
  EXPECT_EQ(dot.rfind("digraph metile {", 0), 0u);
  EXPECT_EQ(dot.substr(dot.size() - 2), "}\n");
  for (ValueId id : graph.inputs()) {
    const Value& input = graph.value(id);
    EXPECT_NE(dot.find("input_" + std::to_string(id) + " [shape=ellipse, label=\"" + input.name + "\\n" +
                       input.spec.to_string() + "\"]"),
              std::string::npos)
        << input.name;
  }
  std::size_t edges = 0;
  for (const Node& node : graph.nodes()) {
    const std::string label = node.name + "\\n" + node.op + " " + graph.value(node.outputs[0]).spec.to_string();
    EXPECT_NE(dot.find("node_" + std::to_string(node.id) + " [shape=box, label=\"" + label + "\""), std::string::npos)
        << node.name;
    edges += node.inputs.size();
  }
  std::size_t arrows = 0;
  for (std::size_t at = dot.find("->"); at != std::string::npos; at = dot.find("->", at + 2)) ++arrows;
  EXPECT_EQ(arrows, edges + graph.outputs().size());
  const NodeId output_node = graph.value(graph.outputs()[0]).producer;
  EXPECT_NE(dot.find("node_" + std::to_string(output_node) + " [shape=box"), std::string::npos);
  EXPECT_NE(dot.find("peripheries=2"), std::string::npos);
  EXPECT_NE(dot.find("output_0 [shape=plaintext, label=\"output " + graph.value(graph.outputs()[0]).name + "\"]"),
            std::string::npos);
}

TEST(GraphDotTest, EscapesQuotesInNames) {
  GraphBuilder builder;
  auto x = builder.input("say \"hi\"", {{2}, DType::f32});
  const std::string dot = graph_to_dot(builder.build({builder.exp(x, "e\\x")}));
  EXPECT_NE(dot.find("label=\"say \\\"hi\\\"\\nf32[2]\""), std::string::npos) << dot;
  EXPECT_NE(dot.find("label=\"e\\\\x\\nexp f32[2]\""), std::string::npos) << dot;
}

// Issue 11: deep nesting anywhere is one InputError (never a stack overflow while
// parsing, destroying or printing the value); numbers beyond double are InputErrors.
TEST(GraphJsonLimitsTest, DeepNestingAndHugeNumbersAreInputErrors) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const auto graph_with = [](const std::string& shape, const std::string& factor) {
    return R"({"inputs": [{"name": "x", "shape": )" + shape + R"(, "dtype": "f32"}], "nodes": [{"name": "y", "op": "scale", "inputs": ["x"], "attrs": {"factor": )" +
           factor + R"(}}], "outputs": ["y"]})";
  };
  EXPECT_EQ(error_of([&] { parse_graph_json(graph_with(deep, "2.0"), "g.json"); }),
            "g.json: invalid JSON: nested deeper than 64 levels at byte 96");
  EXPECT_EQ(error_of([&] { parse_graph_json(graph_with("[1]", deep), "g.json"); }).substr(0, 54),
            "g.json: invalid JSON: nested deeper than 64 levels at ");
  EXPECT_EQ(error_of([&] { parse_graph_json(graph_with("[1]", "1e400"), "g.json"); }),
            "g.json: invalid JSON: number overflow parsing '1e400'");
  // A field given twice in one object is an error (nlohmann alone keeps the last); the same key in
  // two objects is not.
  EXPECT_EQ(error_of([&] {
              parse_graph_json(R"({"inputs": [{"name": "x", "shape": [1], "shape": [2], "dtype": "f32"}], "nodes": [], "outputs": ["x"]})",
                               "g.json");
            }),
            "g.json: invalid JSON: the key \"shape\" appears twice in one object");
  EXPECT_NO_THROW(parse_graph_json(graph_with("[1]", "2.0"), "g.json"));
  // A value in a message is cut short, however long it is.
  EXPECT_EQ(error_of([&] { parse_graph_json(graph_with("[\"" + std::string(100000, 'a') + "\"]", "2.0"), "g.json"); }),
            "g.json: /inputs/0/shape/0: expected an integer, got \"" + std::string(56, 'a') + "...");
}

// 100k outputs load, every one distinct and in order. The time is not asserted (timings belong in
// benchmarks); README "Input limits" gives the time this test's run prints.
TEST(GraphJsonLimitsTest, AHundredThousandOutputsLoad) {
  // Enough to make anything quadratic in the outputs run for hours; more only costs CI time.
  constexpr int kOutputs = 100000;
  std::string nodes;
  std::string outputs;
  for (int index = 0; index < kOutputs; ++index) {
    const std::string name = "\"y" + std::to_string(index) + "\"";
    nodes += (index ? "," : "") + std::string(R"({"name": )") + name + R"(, "op": "silu", "inputs": ["x"]})";
    outputs += (index ? "," : "") + name;
  }
  const std::string text =
      R"({"inputs": [{"name": "x", "shape": [1], "dtype": "f32"}], "nodes": [)" + nodes + R"(], "outputs": [)" + outputs + "]}";
  const ComputeGraph graph = parse_graph_json(text, "wide.json");
  ASSERT_EQ(graph.outputs().size(), static_cast<std::size_t>(kOutputs));
  EXPECT_EQ(graph.value(graph.outputs()[kOutputs - 1]).name, "y99999");
  EXPECT_TRUE(graph.is_output(graph.outputs()[12345]));
  EXPECT_FALSE(graph.is_output(graph.inputs()[0]));
}

}  // namespace
}  // namespace metile
