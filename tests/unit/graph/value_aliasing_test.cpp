// alias_of (src/graph/value_aliasing.cpp): which values share a buffer. Hand-built cases (reshape
// chains, transposes of size-1 axes against real ones, caches with a second reader or escaping
// as an output, caller-owned buffers), then random graphs checked against a separately written
// oracle: a buffer-level interpreter that runs the graph with the shared buffers alias_of gives
// (aliased layout nodes do nothing, an in-place cache write stores only its new rows) and must
// produce what run_reference produces, for every graph output.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "metile/cpu_runtime.h"
#include "metile/graph.h"
#include "metile_test_support.h"

namespace metile {
namespace {

TensorSpec f32(std::vector<std::int64_t> shape) { return TensorSpec(std::move(shape), DType::f32); }

TEST(ValueAliasing, ReshapeChainsResolveToTheFirstOwner) {
  GraphBuilder b;
  auto x = b.input("x", f32({2, 3, 4}));
  auto r1 = b.reshape(x, {6, 4}, "r1");
  auto r2 = b.reshape(r1, {24}, "r2");
  auto y = b.add(r2, r2, "y");
  auto r3 = b.reshape(y, {4, 6}, "r3");
  const ComputeGraph graph = b.build({r2, r3});
  const std::vector<ValueId> owner = alias_of(graph);
  EXPECT_EQ(owner[static_cast<std::size_t>(r1.id)], x.id);
  EXPECT_EQ(owner[static_cast<std::size_t>(r2.id)], x.id);  // a graph output may alias an input
  EXPECT_EQ(owner[static_cast<std::size_t>(y.id)], y.id);
  EXPECT_EQ(owner[static_cast<std::size_t>(r3.id)], y.id);
  // A value the caller owns (an external buffer) keeps its own, and what aliases it follows it.
  std::vector<bool> owns(graph.values().size(), false);
  owns[static_cast<std::size_t>(r1.id)] = true;
  const std::vector<ValueId> forced = alias_of(graph, owns);
  EXPECT_EQ(forced[static_cast<std::size_t>(r1.id)], r1.id);
  EXPECT_EQ(forced[static_cast<std::size_t>(r2.id)], r1.id);
}

TEST(ValueAliasing, OnlyTransposesOfSizeOneAxesShare) {
  GraphBuilder b;
  auto x = b.input("x", f32({1, 4, 8}));
  auto moves_unit = b.transpose(x, {1, 0, 2}, "moves_unit");   // [4, 1, 8]: same bytes
  auto real = b.transpose(x, {0, 2, 1}, "real");               // [1, 8, 4]: bytes move
  auto y = b.input("y", f32({4, 1, 8}));
  auto swap_last = b.transpose(y, {2, 1, 0}, "swap_last");     // 4 and 8 swap: bytes move
  const ComputeGraph graph = b.build({moves_unit, real, swap_last});
  const std::vector<ValueId> owner = alias_of(graph);
  EXPECT_EQ(owner[static_cast<std::size_t>(moves_unit.id)], x.id);
  EXPECT_EQ(owner[static_cast<std::size_t>(real.id)], real.id);
  EXPECT_EQ(owner[static_cast<std::size_t>(swap_last.id)], swap_last.id);
}

struct CacheGraph {
  ComputeGraph graph;
  ValueId cache = -1, written = -1;
};

// cache -> [reshape there and back] -> kv_cache_write, with the options that forbid the in-place write.
CacheGraph cache_graph(bool through_reshapes, bool second_reader, bool cache_is_output, bool reshape_after) {
  GraphBuilder b;
  auto cache = b.input("cache", f32({2, 8, 4}));
  auto update = b.input("update", f32({2, 3, 4}));
  auto positions = b.input("positions", TensorSpec({3}, DType::i32));
  ValueRef target = cache;
  if (through_reshapes) target = b.reshape(b.reshape(cache, {16, 4}, "flat"), {2, 8, 4}, "shaped");
  std::vector<ValueRef> outputs;
  if (second_reader) outputs.push_back(b.scale(cache, 2.0, "reader"));
  auto written = b.kv_cache_write(target, update, positions, "written");
  outputs.push_back(written);
  if (cache_is_output) outputs.push_back(b.reshape(cache, {2, 8, 4}, "old_cache"));  // a view of it escapes
  if (reshape_after) outputs.push_back(b.reshape(cache, {64}, "late_view"));
  return {b.build(outputs), cache.id, written.id};
}

TEST(ValueAliasing, CacheWritesInPlaceOnlyWhenNothingElseSeesTheOldCache) {
  for (bool through_reshapes : {false, true}) {
    SCOPED_TRACE(through_reshapes ? "through reshapes" : "direct");
    const CacheGraph plain = cache_graph(through_reshapes, false, false, false);
    EXPECT_EQ(alias_of(plain.graph)[static_cast<std::size_t>(plain.written)], plain.cache);
    for (int blocker = 0; blocker < 3; ++blocker) {
      const CacheGraph blocked = cache_graph(through_reshapes, blocker == 0, blocker == 1, blocker == 2);
      EXPECT_EQ(alias_of(blocked.graph)[static_cast<std::size_t>(blocked.written)], blocked.written) << blocker;
    }
  }
  // The cache's output buffer owned by the caller: a separate buffer, so a copy and write.
  const CacheGraph plain = cache_graph(false, false, false, false);
  std::vector<bool> owns(plain.graph.values().size(), false);
  owns[static_cast<std::size_t>(plain.written)] = true;
  EXPECT_EQ(alias_of(plain.graph, owns)[static_cast<std::size_t>(plain.written)], plain.written);
}

// ---------------------------------------------------------------- the buffer-level oracle
// Runs `graph` over one byte buffer per owner: every node's output is computed by run_reference on
// the node alone (inputs read from the buffers as they are at that moment), then stored, except
// that an aliased reshape or transpose stores nothing, and an in-place kv_cache_write stores only
// the rows it writes. Wrong aliasing shows up as a stale or clobbered value downstream.
TensorMap run_with_shared_buffers(const ComputeGraph& graph, const TensorMap& inputs) {
  const std::vector<ValueId> owner = alias_of(graph);
  std::vector<HostTensor> buffers(graph.values().size());
  auto read = [&](ValueId id) {
    const HostTensor& bytes = buffers[static_cast<std::size_t>(owner[static_cast<std::size_t>(id)])];
    HostTensor tensor(graph.value(id).spec);
    std::copy_n(bytes.bytes().begin(), tensor.bytes().size(), tensor.bytes().begin());
    return tensor;
  };
  for (ValueId id : graph.inputs()) buffers[static_cast<std::size_t>(id)] = inputs.at(graph.value(id).name);
  for (const Node& node : graph.nodes()) {
    const ValueId out = node.outputs[0];
    HostTensor& target = buffers[static_cast<std::size_t>(owner[static_cast<std::size_t>(out)])];
    const bool aliased = owner[static_cast<std::size_t>(out)] != out;
    if (aliased && node.op != "kv_cache_write") continue;  // a view: nothing moves
    GraphBuilder b;
    std::vector<ValueRef> refs;
    TensorMap node_inputs;
    for (std::size_t k = 0; k < node.inputs.size(); ++k) {
      const std::string name = "in" + std::to_string(k);
      refs.push_back(b.input(name, graph.value(node.inputs[k]).spec));
      node_inputs[name] = read(node.inputs[k]);
    }
    const ComputeGraph single = b.build(b.add_node(node.op, refs, node.attributes, "out"));
    const HostTensor result = run_reference(single, node_inputs).at("out");
    if (!aliased) {
      target = result;
      continue;
    }
    // In place: only the written rows (head h, row positions[s]) are stored.
    const std::vector<std::int64_t>& shape = graph.value(out).spec.shape;
    const HostTensor positions = read(node.inputs[2]);
    const std::size_t row_bytes = static_cast<std::size_t>(shape[2]) * dtype_size(graph.value(out).spec.dtype);
    for (std::int64_t s = 0; s < positions.element_count(); ++s) {
      const auto position = static_cast<std::int64_t>(positions.at(s));
      for (std::int64_t h = 0; h < shape[0]; ++h) {
        const std::size_t at = static_cast<std::size_t>(h * shape[1] + position) * row_bytes;
        std::copy_n(result.bytes().begin() + static_cast<std::ptrdiff_t>(at), row_bytes,
                    target.bytes().begin() + static_cast<std::ptrdiff_t>(at));
      }
    }
  }
  TensorMap outputs;
  for (ValueId id : graph.outputs()) outputs[graph.value(id).name] = read(id);
  return outputs;
}

// A random graph over one cache [2, 8, 4]: views of it (reshapes, size-1 transposes), readers,
// cache writes, and random outputs.
ComputeGraph random_cache_graph(std::mt19937_64& random) {
  GraphBuilder b;
  auto cache = b.input("cache", f32({2, 8, 4}));
  auto update = b.input("update", f32({2, 2, 4}));
  auto positions = b.input("positions", TensorSpec({2}, DType::i32));
  std::vector<ValueRef> caches = {cache};  // [2, 8, 4] values
  std::vector<ValueRef> others;
  const int steps = 3 + static_cast<int>(random() % 6);
  for (int step = 0; step < steps; ++step) {
    const ValueRef from = caches[random() % caches.size()];
    const std::string name = "n" + std::to_string(step);
    switch (random() % 5) {
      case 0: caches.push_back(b.reshape(b.reshape(from, {16, 4}, name + "a"), {2, 8, 4}, name)); break;
      case 1:
        caches.push_back(b.reshape(b.transpose(b.reshape(from, {1, 2, 8, 4}, name + "a"), {1, 0, 2, 3}, name + "b"),
                                   {2, 8, 4}, name));
        break;
      case 2: others.push_back(b.scale(from, 0.5, name)); break;
      default: caches.push_back(b.kv_cache_write(from, update, positions, name)); break;
    }
  }
  std::vector<ValueRef> outputs = others;
  for (std::size_t k = 1; k < caches.size(); ++k) {  // caches[0] is the input
    if (random() % 2 == 0) outputs.push_back(caches[k]);
  }
  if (outputs.empty()) outputs.push_back(b.scale(caches.back(), 1.0, "last"));
  return b.build(outputs);
}

TEST(ValueAliasing, RandomGraphsComputeTheSameWithSharedBuffers) {
  const std::uint64_t seed = testing::test_seed("ValueAliasing.RandomGraphsComputeTheSameWithSharedBuffers");
  std::mt19937_64 random(seed);
  int in_place = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const ComputeGraph graph = random_cache_graph(random);
    TensorMap inputs = random_inputs(graph, seed + static_cast<std::uint64_t>(trial));
    // Positions inside the cache, distinct (a repeated position is the kernels' concern, not aliasing's).
    const int first = static_cast<int>(random() % 8);
    const std::vector<double> positions = {static_cast<double>(first), static_cast<double>((first + 3) % 8)};
    inputs["positions"] = HostTensor::from_values(TensorSpec({2}, DType::i32), positions);
    const std::vector<ValueId> owner = alias_of(graph);
    for (const Node& node : graph.nodes()) {
      in_place += node.op == "kv_cache_write" && owner[static_cast<std::size_t>(node.outputs[0])] != node.outputs[0];
    }
    EXPECT_EQ(run_with_shared_buffers(graph, inputs), run_reference(graph, inputs)) << write_graph_json(graph);
    if (HasFailure()) break;
  }
  EXPECT_GT(in_place, 20);  // the random graphs do exercise in-place writes
}

}  // namespace
}  // namespace metile
