// GraphBuilder and ComputeGraph: the seed graph comes out as docs/architecture.md says
// (multi-output, consumers, kinds), names are unique and generated predictably,
// and every mistake is one InputError naming the node and the problem.
#include <string>

#include <gtest/gtest.h>

#include "metile/graph.h"
#include "metile_test_support.h"

namespace metile {
namespace {

using testing::error_of;

struct SeedGraph {
  GraphBuilder builder;
  ValueRef values, residual, weight, summed, normalized;
  SeedGraph() {
    values = builder.input("values", {{1, 2048}, DType::f16});
    residual = builder.input("residual", {{1, 2048}, DType::f16});
    weight = builder.input("weight", {{2048}, DType::f16});
    summed = builder.add(values, residual, "summed");
    normalized = builder.rms_norm(summed, weight, 1e-5, "normalized");
  }
};

TEST(GraphBuilderTest, SeedGraphIsMultiOutput) {
  SeedGraph seed;
  const ComputeGraph graph = seed.builder.build({seed.summed, seed.normalized});
  ASSERT_EQ(graph.nodes().size(), 2u);
  ASSERT_EQ(graph.values().size(), 5u);
  EXPECT_EQ(graph.inputs(), (std::vector<ValueId>{0, 1, 2}));
  EXPECT_EQ(graph.outputs(), (std::vector<ValueId>{3, 4}));
  const Node& add = graph.node(0);
  EXPECT_EQ(add.name, "summed");
  EXPECT_EQ(add.op, "add");
  EXPECT_EQ(add.kind, OpKind::elementwise);
  EXPECT_EQ(add.inputs, (std::vector<ValueId>{0, 1}));
  const Node& norm = graph.node(1);
  EXPECT_EQ(norm.kind, OpKind::row_reduction);
  EXPECT_EQ(norm.attributes.get_double("eps"), 1e-5);
  EXPECT_EQ(graph.value(4).spec, TensorSpec({1, 2048}, DType::f16));
  EXPECT_EQ(graph.value(4).producer, 1);
  EXPECT_EQ(graph.value(0).producer, -1);
  EXPECT_EQ(graph.consumers(3), (std::vector<NodeId>{1}));
  EXPECT_EQ(graph.consumers(2), (std::vector<NodeId>{1}));
  EXPECT_TRUE(graph.consumers(4).empty());
  EXPECT_TRUE(graph.is_output(3));
  EXPECT_FALSE(graph.is_output(0));
  EXPECT_EQ(graph.find_value("summed"), std::optional<ValueId>(3));
  EXPECT_EQ(graph.find_node("normalized"), std::optional<NodeId>(1));
  EXPECT_EQ(graph.find_node("values"), std::nullopt);
  EXPECT_EQ(seed.builder.spec(seed.normalized).to_string(), "f16[1, 2048]");
  EXPECT_EQ(seed.builder.name(seed.summed), "summed");
}

TEST(GraphBuilderTest, NodesThatNoOutputNeedsAreKept) {
  SeedGraph seed;
  const ComputeGraph graph = seed.builder.build({seed.normalized});
  EXPECT_EQ(graph.nodes().size(), 2u);
  EXPECT_EQ(graph.outputs(), (std::vector<ValueId>{4}));
}

TEST(GraphBuilderTest, ConsumersListEachReadingNodeOnce) {
  GraphBuilder builder;
  auto x = builder.input("x", {{4, 8}, DType::f32});
  auto squared = builder.multiply(x, x);
  auto gated = builder.silu(x);
  auto both = builder.add(squared, gated);
  const ComputeGraph graph = builder.build({both});
  EXPECT_EQ(graph.consumers(x.id), (std::vector<NodeId>{0, 1}));
  EXPECT_EQ(graph.node(0).inputs, (std::vector<ValueId>{0, 0}));
}

TEST(GraphBuilderTest, GeneratedNamesCountPerOpAndSkipTakenNames) {
  GraphBuilder builder;
  auto x = builder.input("x", {{4, 8}, DType::f32});
  auto first = builder.add(x, x);
  auto second = builder.add(first, x);
  auto taken = builder.exp(second, "add_2");
  auto third = builder.add(taken, x);
  auto scaled = builder.scale(third, 0.5);
  EXPECT_EQ(builder.name(first), "add_0");
  EXPECT_EQ(builder.name(second), "add_1");
  EXPECT_EQ(builder.name(third), "add_3");
  EXPECT_EQ(builder.name(scaled), "scale_0");
}

TEST(GraphBuilderTest, NodeErrorsNameTheNodeAndTheProblem) {
  GraphBuilder builder;
  auto x = builder.input("x", {{1, 2048}, DType::f16});
  auto weight = builder.input("weight", {{1024}, DType::f16});
  EXPECT_EQ(error_of([&] { builder.rms_norm(x, weight, 1e-5, "normalized"); }),
            "node 'normalized' (rms_norm): weight f16[1024] does not match the last axis of x f16[1, 2048] "
            "(expected [2048])");
  EXPECT_EQ(error_of([&] { builder.rms_norm(x, x, 1e-5); }),
            "node 'rms_norm_0' (rms_norm): weight f16[1, 2048] does not match the last axis of x f16[1, 2048] "
            "(expected [2048])");
  EXPECT_EQ(error_of([&] { builder.add_node("conv", {x}, {}, "c"); }), "node 'c' (conv): unknown op 'conv'");
  EXPECT_EQ(error_of([&] { builder.add_node("add", {x}, {}, "s"); }), "node 's' (add): expects 2 inputs (a, b), got 1");
  EXPECT_EQ(error_of([&] { builder.add(x, ValueRef{42}, "s"); }),
            "node 's' (add): input 1 (b) is not a value of this GraphBuilder (id 42)");
  GraphBuilder other;
  auto foreign = other.input("y", {{1, 2048}, DType::f16});
  EXPECT_EQ(error_of([&] { builder.add(x, foreign, "s"); }), "node 's' (add): input 1 (b) is a value of another GraphBuilder");
  // A failed node records nothing: its name stays free and auto names do not advance.
  auto normalized = builder.rms_norm(x, builder.input("w", {{2048}, DType::f16}), 1e-5, "normalized");
  EXPECT_EQ(builder.name(normalized), "normalized");
  EXPECT_EQ(builder.name(builder.rms_norm(x, builder.input("w2", {{2048}, DType::f16}), 1e-5)), "rms_norm_0");
}

// A copy of a builder (a graph forked after a shared prefix) takes the values recorded before the copy;
// a value either one records afterwards is "a value of another GraphBuilder" to the other. The copy
// kept the builder's id, so such a value passed the check and stood for whatever value of the same id
// the other had recorded: copy.build({in_original}) returned the copy's silu, not the original's exp.
TEST(GraphBuilderTest, ACopyTakesTheValuesBeforeItAndRefusesTheOriginalsAfterIt) {
  GraphBuilder original;
  const ValueRef x = original.input("x", {{4}, DType::f32});
  GraphBuilder copy = original;
  const ValueRef in_original = original.exp(x, "e");
  const ValueRef in_copy = copy.silu(x, "s");  // x was recorded before the copy: it is the copy's too
  ASSERT_EQ(in_original.id, in_copy.id);
  EXPECT_EQ(error_of([&] { copy.build({in_original}); }), "build: output 0 is a value of another GraphBuilder");
  EXPECT_EQ(error_of([&] { original.exp(in_copy, "t"); }), "node 't' (exp): input 0 (x) is a value of another GraphBuilder");
  EXPECT_EQ(copy.build({in_copy}).node(0).op, "silu");
  EXPECT_EQ(original.build({in_original}).node(0).op, "exp");
  // A copy of the copy (copy assignment) takes what both had recorded before it, and nothing later.
  GraphBuilder grandchild;
  grandchild = copy;
  EXPECT_EQ(grandchild.name(x), "x");
  EXPECT_EQ(grandchild.name(in_copy), "s");
  EXPECT_EQ(error_of([&] { grandchild.name(in_original); }), "value is a value of another GraphBuilder");
  const ValueRef later = copy.exp(in_copy, "later");
  EXPECT_EQ(error_of([&] { grandchild.spec(later); }), "value is a value of another GraphBuilder");
  // A move hands the values over; the moved-from builder starts again as a new one.
  GraphBuilder moved = std::move(original);
  EXPECT_EQ(moved.name(in_original), "e");
  EXPECT_EQ(error_of([&] { original.name(x); }), "value is a value of another GraphBuilder");  // NOLINT(bugprone-use-after-move)
  const ValueRef fresh = original.input("y", {{4}, DType::f32});  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(error_of([&] { moved.name(fresh); }), "value is a value of another GraphBuilder");
}

TEST(GraphBuilderTest, DuplicateNamesAreRejected) {
  GraphBuilder builder;
  auto x = builder.input("x", {{4}, DType::f32});
  EXPECT_EQ(error_of([&] { builder.input("x", {{4}, DType::f32}); }),
            "input 'x': duplicate name 'x', already used by input 'x'");
  builder.exp(x, "e");
  EXPECT_EQ(error_of([&] { builder.silu(x, "e"); }), "node 'e' (silu): duplicate name 'e', already used by node 'e' (exp)");
  EXPECT_EQ(error_of([&] { builder.silu(x, "x"); }), "node 'x' (silu): duplicate name 'x', already used by input 'x'");
}

// A name is printed a line each: control characters (a newline forging a summary line, NUL, DEL)
// are refused wherever a name is given; other bytes, UTF-8 included, are kept.
TEST(GraphBuilderTest, NamesHoldNoControlCharacters) {
  GraphBuilder builder;
  EXPECT_EQ(error_of([&] { builder.input("a\nb", {{4}, DType::f32}); }),
            "input 'a\\x0ab': a name may not hold a control character (\\x0a at offset 1)");
  auto x = builder.input("x", {{4}, DType::f32});
  EXPECT_EQ(error_of([&] { builder.exp(x, std::string("e\0", 2)); }),
            "node 'e\\x00' (exp): a name may not hold a control character (\\x00 at offset 1)");
  // Checked before the op's own checks, whose messages would carry the raw name.
  EXPECT_EQ(error_of([&] { builder.softmax(x, 5, "c\nforged"); }),
            "node 'c\\x0aforged' (softmax): a name may not hold a control character (\\x0a at offset 1)");
  const ValueRef e = builder.exp(x, "\xc3\xa9t\xc3\xa9");  // été
  EXPECT_EQ(error_of([&] { builder.rename(e, "del\x7f"); }),
            "node 'del\\x7f' (exp): a name may not hold a control character (\\x7f at offset 3)");
  EXPECT_EQ(builder.name(e), "\xc3\xa9t\xc3\xa9");
  // C1 controls (U+0080..U+009F; U+009B is CSI to a terminal in UTF-8 mode) are control characters too;
  // U+00A0 is not, nor a 0xC2 that starts no C1 control.
  EXPECT_EQ(error_of([&] { builder.exp(x, "csi\xc2\x9b" "31m"); }),
            "node 'csi\\xc2\\x9b31m' (exp): a name may not hold a control character (\\xc2\\x9b at offset 3)");
  EXPECT_EQ(error_of([&] { builder.exp(x, "\xc2\x80"); }),
            "node '\\xc2\\x80' (exp): a name may not hold a control character (\\xc2\\x80 at offset 0)");
  EXPECT_EQ(builder.name(builder.exp(x, "\xc2\xa0\xc2" "A\xc2")), "\xc2\xa0\xc2" "A\xc2");
  // Bidirectional formatting characters reorder what is printed after them (a name could show as
  // another); each is refused, spelled as bytes and said to be one; their neighbours (U+2029, U+202F, U+2065, U+206A,
  // U+061B) and a name ending inside one's bytes are kept.
  const std::pair<const char*, const char*> bidi[] = {{"\xe2\x80\xae", "\\xe2\\x80\\xae"}, {"\xe2\x80\xaa", "\\xe2\\x80\\xaa"},
                                                      {"\xe2\x80\x8f", "\\xe2\\x80\\x8f"}, {"\xe2\x81\xa6", "\\xe2\\x81\\xa6"},
                                                      {"\xe2\x81\xa9", "\\xe2\\x81\\xa9"}, {"\xd8\x9c", "\\xd8\\x9c"}};
  for (const auto& [character, spelled] : bidi) {
    EXPECT_EQ(error_of([&] { builder.exp(x, std::string("ab") + character + "c"); }),
              std::string("node 'ab") + spelled + "c' (exp): a name may not hold a bidirectional formatting character (" + spelled +
                  " at offset 2)");
  }
  for (const char* kept : {"\xe2\x80\xa9", "\xe2\x80\xaf", "\xe2\x81\xa5", "\xe2\x81\xaa", "\xd8\x9b", "x\xe2\x80", "y\xe2"}) {
    EXPECT_EQ(builder.name(builder.exp(x, kept)), kept);
  }
  // The refused rename kept the old name taken.
  EXPECT_EQ(error_of([&] { builder.exp(x, "\xc3\xa9t\xc3\xa9"); }),
            "node '\xc3\xa9t\xc3\xa9' (exp): duplicate name '\xc3\xa9t\xc3\xa9', already used by node '\xc3\xa9t\xc3\xa9' (exp)");
}

TEST(GraphBuilderTest, InputsNeedPositiveDimensionsAndAName) {
  GraphBuilder builder;
  EXPECT_EQ(error_of([&] { builder.input("x", {{4, 0}, DType::f32}); }),
            "input 'x': dimension 1 of f32[4, 0] is not positive");
  EXPECT_EQ(error_of([&] { builder.input("y", {{-3}, DType::f32}); }), "input 'y': dimension 0 of f32[-3] is not positive");
  EXPECT_EQ(error_of([&] { builder.input("", {{3}, DType::f32}); }), "an input needs a name");
  EXPECT_NO_THROW(builder.input("scalar", {{}, DType::f32}));
  EXPECT_EQ(error_of([&] { builder.input("huge", {{std::int64_t{1} << 40, std::int64_t{1} << 40}, DType::f32}); }),
            "input 'huge': f32[1099511627776, 1099511627776] has more than 2^48 elements");
}

TEST(GraphBuilderTest, OutputsMustBeProducedOnceByThisGraph) {
  SeedGraph seed;
  EXPECT_EQ(error_of([&] { seed.builder.build({}); }), "build: a graph needs at least one output");
  EXPECT_EQ(error_of([&] { seed.builder.build({seed.summed, seed.summed}); }), "build: output 'summed' is listed twice");
  EXPECT_EQ(error_of([&] { seed.builder.build({seed.values}); }),
            "build: output 0 'values' is a graph input, not a value produced by the graph");
  EXPECT_EQ(error_of([&] { seed.builder.build({seed.summed, ValueRef{17}}); }),
            "build: output 1 is not a value of this GraphBuilder (id 17)");
  SeedGraph other;
  EXPECT_EQ(error_of([&] { seed.builder.build({other.summed}); }), "build: output 0 is a value of another GraphBuilder");
}

TEST(GraphBuilderTest, RenameMovesNodeAndValueNames) {
  GraphBuilder builder;
  auto x = builder.input("x", {{4}, DType::f32});
  auto y = builder.exp(x);
  builder.rename(y, "exponent");
  builder.rename(x, "source");
  EXPECT_EQ(error_of([&] { builder.rename(y, "source"); }),
            "renaming 'exponent': duplicate name 'source', already used by input 'source'");
  EXPECT_EQ(error_of([&] { builder.rename(y, ""); }), "renaming 'exponent': the new name is empty");
  const ComputeGraph graph = builder.build({y});
  EXPECT_EQ(graph.node(0).name, "exponent");
  EXPECT_EQ(graph.value(y.id).name, "exponent");
  EXPECT_EQ(graph.value(x.id).name, "source");
  // The old names are free again.
  EXPECT_NO_THROW(builder.input("x", {{4}, DType::f32}));
  EXPECT_NO_THROW(builder.silu(x, "exp_0"));
}

TEST(GraphBuilderTest, EqualityIsStructural) {
  SeedGraph first;
  SeedGraph second;
  EXPECT_EQ(first.builder.build({first.summed, first.normalized}), second.builder.build({second.summed, second.normalized}));
  EXPECT_NE(first.builder.build({first.summed, first.normalized}), first.builder.build({first.normalized, first.summed}));
  GraphBuilder different;
  auto values = different.input("values", {{1, 2048}, DType::f16});
  auto residual = different.input("residual", {{1, 2048}, DType::f16});
  auto weight = different.input("weight", {{2048}, DType::f16});
  auto summed = different.add(values, residual, "summed");
  auto normalized = different.rms_norm(summed, weight, 1e-6, "normalized");
  EXPECT_NE(different.build({summed, normalized}), first.builder.build({first.summed, first.normalized}));
}

TEST(GraphBuilderTest, EveryBuilderMethodRecordsItsOp) {
  GraphBuilder builder;
  auto x = builder.input("x", {{2, 8, 64}, DType::bf16});
  auto weight = builder.input("weight", {{64}, DType::bf16});
  auto bias = builder.input("bias", {{64}, DType::bf16});
  auto positions = builder.input("positions", {{8}, DType::i32});
  auto packed = builder.input("packed", {{32, 8}, DType::u32});
  auto scales = builder.input("scales", {{32, 2}, DType::bf16});
  auto biases = builder.input("biases", {{32, 2}, DType::bf16});
  auto v = builder.subtract(x, weight);
  v = builder.multiply(v, bias);
  v = builder.scale(v, 0.125);
  v = builder.gelu(v, "tanh");
  v = builder.exp(v);
  v = builder.layer_norm(v, weight, bias, 1e-6);
  v = builder.rope(v, positions, 10000.0, 64);
  auto scores = builder.matmul(v, v, true);
  scores = builder.causal_mask(scores, 0);
  scores = builder.softmax(scores, -1);
  auto projected = builder.quantized_matmul(v, packed, scales, biases, 4, 32);
  auto moved = builder.transpose(projected, {1, 0, 2});
  auto flat = builder.reshape(moved, {-1});
  auto wide = builder.cast(flat, DType::f32);
  const ComputeGraph graph = builder.build({scores, wide});
  std::vector<std::string> ops;
  for (const Node& node : graph.nodes()) ops.push_back(node.op);
  EXPECT_EQ(ops, (std::vector<std::string>{"subtract", "multiply", "scale", "gelu", "exp", "layer_norm", "rope", "matmul",
                                           "causal_mask", "softmax", "quantized_matmul", "transpose", "reshape", "cast"}));
  EXPECT_EQ(graph.value(scores.id).spec, TensorSpec({2, 8, 8}, DType::bf16));
  EXPECT_EQ(graph.value(projected.id).spec, TensorSpec({2, 8, 32}, DType::bf16));
  EXPECT_EQ(graph.value(moved.id).spec, TensorSpec({8, 2, 32}, DType::bf16));
  EXPECT_EQ(graph.value(wide.id).spec, TensorSpec({512}, DType::f32));
  EXPECT_EQ(graph.node(*graph.find_node("matmul_0")).attributes.get_int("transpose_right"), 1);
}

}  // namespace
}  // namespace metile
