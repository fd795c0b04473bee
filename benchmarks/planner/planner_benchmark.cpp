// planner_benchmark: how long plan_graph_fusion takes and what it buys, on the
// example decoder layer, Llama-style decoders of 32 and 80 layers built with
// GraphBuilder, random DAGs up to 20,000 ops, one value read by many chains or along one chain, one normalized input
// read by many projections. Prints one table:
// kernels before (one per op) and after, regions, the median planning time, the
// global-memory traffic the regions avoid and the estimated time they save.
// Goal (issue 3): a 32-layer decoder plans in under 10 ms on a 2-core machine.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "../support/benchmark_options.h"
#include "fusion_test_support.h"
#include "metile/fusion.h"
#include "metile/graph.h"
#include "planner_internal.h"

namespace {

using namespace metile;

// One decode step (one token) of a Llama-3-8B-shaped model with 4-bit affine
// projections (group 64): the structure of examples/decoder_layer.json, repeated.
ComputeGraph decoder(int layers) {
  const std::int64_t tokens = 1, hidden = 4096, heads = 32, head_dim = 128, intermediate = 14336;
  const int bits = 4, group = 64;
  const DType dtype = DType::bf16;
  GraphBuilder b;
  ValueRef h = b.input("hidden_states", {{tokens, hidden}, dtype});
  ValueRef positions = b.input("positions", {{tokens}, DType::i32});
  for (int layer = 0; layer < layers; ++layer) {
    const std::string p = "l" + std::to_string(layer) + ".";
    auto projection = [&](const std::string& name, ValueRef x, std::int64_t in, std::int64_t out) {
      ValueRef packed = b.input(p + name + "_packed", {{out, in * bits / 32}, DType::u32});
      ValueRef scales = b.input(p + name + "_scales", {{out, in / group}, dtype});
      ValueRef biases = b.input(p + name + "_biases", {{out, in / group}, dtype});
      return b.quantized_matmul(x, packed, scales, biases, bits, group, p + name);
    };
    auto split_heads = [&](const std::string& name, ValueRef x) {
      return b.transpose(b.reshape(x, {tokens, heads, head_dim}, p + name + "_by_token"), {1, 0, 2}, p + name + "_by_head");
    };
    ValueRef attention_input = b.rms_norm(h, b.input(p + "input_norm", {{hidden}, dtype}), 1e-5, p + "attention_input");
    ValueRef q = b.rope(split_heads("q", projection("q", attention_input, hidden, hidden)), positions, 5e5, head_dim,
                        p + "q_rotated");
    ValueRef k = b.rope(split_heads("k", projection("k", attention_input, hidden, hidden)), positions, 5e5, head_dim,
                        p + "k_rotated");
    ValueRef v = split_heads("v", projection("v", attention_input, hidden, hidden));
    ValueRef scores = b.matmul(q, k, true, p + "scores");
    ValueRef masked = b.causal_mask(b.scale(scores, 1.0 / 11.3137, p + "scaled_scores"), 0, p + "masked_scores");
    ValueRef weights = b.softmax(masked, -1, p + "attention_weights");
    ValueRef context = b.reshape(b.transpose(b.matmul(weights, v, false, p + "context_by_head"), {1, 0, 2},
                                             p + "context_by_token"),
                                 {tokens, hidden}, p + "context");
    ValueRef attention_residual = b.add(h, projection("o", context, hidden, hidden), p + "attention_residual");
    ValueRef mlp_input =
        b.rms_norm(attention_residual, b.input(p + "post_attention_norm", {{hidden}, dtype}), 1e-5, p + "mlp_input");
    ValueRef gate = projection("gate", mlp_input, hidden, intermediate);
    ValueRef up = projection("up", mlp_input, hidden, intermediate);
    ValueRef gated = b.multiply(b.silu(gate, p + "gate_activation"), up, p + "gated");
    h = b.add(attention_residual, projection("down", gated, intermediate, hidden), p + "layer_output");
  }
  return b.build({h});
}

// One exp read by `readers` chains (the input scaled, then added to the exp): each chain's best
// region holds the exp, so the first selection round's candidates are one conflict group (as pairs
// they grew with readers squared: 10,000 readers took 8.8 s and 984 MB) and a second round fuses the
// chains that lost.
ComputeGraph shared_producer(int readers) {
  GraphBuilder b;
  ValueRef x = b.input("x", {{1, 4096}, DType::bf16});
  ValueRef shared = b.exp(x, "shared");
  std::vector<ValueRef> outputs;
  for (int k = 0; k < readers; ++k) outputs.push_back(b.add(shared, b.scale(x, 1.0 + k)));
  return b.build(outputs);
}

// Adds each reading two values drawn from every value before it, every one a graph output (an adversarial pass,
// session 57): each region of a neighborhood writes more values than a kernel may, and is shrunk one op at a time
// (NeighborhoodModel::shrink_to_limits), and a neighborhood's ops span the whole order, so its re-entry search may
// too. Counted in session 60 (1,000 / 2,000 ops): the neighborhoods hold 21 / 36 ops on average (64 at most), are
// cut 10 / 27 times each and estimate 86 / 240 regions each; none has a choice path. Session 60 made the drops
// incremental (an IncrementalMinCut kept across them, RegionEstimator's removals in place of fresh estimates), kept
// one left-out reason an op, and raced the re-entry search's two ways (NeighborhoodModel::find_reentries): at
// 8,000 ops half of planning was each neighborhood op's forward search entering almost every later op. The same
// plans, byte for byte; this 2-core machine, loaded (the first figure 7c3ebc7 with these rows, the second 60's):
// 1,000 ops 0.73 -> 0.25-0.29 s, 2,000 4.9 -> 1.3-1.5, 4,000 13.8 -> 3.1-3.4, 8,000 42.7 -> 6.8-7.2, 16,000 128 -> 16.6-17.3.
// Still superlinear (16,000 / 8,000: 2.5x): the forward searches, where the walk is the costlier way, are.
ComputeGraph far_reading_outputs(std::mt19937_64& random, int ops) {
  GraphBuilder b;
  std::vector<ValueRef> values{b.exp(b.input("x", {{2, 64}, DType::f32}))};
  for (int k = 1; k < ops; ++k) {
    std::uniform_int_distribution<std::size_t> earlier(0, values.size() - 1);
    const ValueRef left = values[earlier(random)];
    values.push_back(b.add(left, values[earlier(random)]));
  }
  return b.build(values);
}

// One exp read by every op of one long chain (c0 = silu(e), c_i = c_(i-1) + e): every anchor's
// neighborhood holds the exp, whose readers before the neighborhood lead back into it. Searched from
// each such reader apart, planning took O(n^3): 4,000 ops 0.66 s, 8,000 5.3, 12,000 18.3 (an
// adversarial pass, session 50); one search an op: 0.02 / 0.05 / 0.14 s at 4,000 / 8,000 / 16,000.
ComputeGraph producer_read_along_a_chain(int ops) {
  GraphBuilder b;
  ValueRef x = b.input("x", {{1, 64}, DType::f32});
  ValueRef shared = b.exp(x, "shared");
  ValueRef chain = b.silu(shared, "c0");
  for (int k = 1; k < ops; ++k) chain = b.add(chain, shared);
  return b.build({chain});
}

// One normalized input read by `readers` projections (the sibling rule's shared value): 4- and
// 8-bit quantized ones of several group sizes, bf16 ones with the weight transposed or not, of
// several widths, some with a bias add, and a router. Alike readers (same op, attributes and
// operand shapes but the stacked axis) form nine classes; each class's first reader leads a group
// of at most 8 (SiblingSpec::max_members), the rest stay out. Before the alike readers were found once per
// shared value (SiblingClasses), each reader scanned every reader of the input: 10,000 / 20,000 /
// 50,000 projections took 0.83 / 3.3 / 19 to 29 s to plan (now 0.06 / 0.13 / 0.32 s, the same plans).
ComputeGraph shared_input(int readers) {
  const std::int64_t hidden = 4096;
  const DType dtype = DType::bf16;
  GraphBuilder b;
  ValueRef h = b.input("hidden_states", {{1, hidden}, dtype});
  ValueRef x = b.rms_norm(h, b.input("norm", {{hidden}, dtype}), 1e-5, "normalized");
  // A router of a width no projection has: alike no other reader, its refusal names each of them.
  std::vector<ValueRef> outputs = {b.matmul(x, b.input("router_weight", {{hidden, 64}, dtype}), false, "router")};
  for (int k = 0; k < readers; ++k) {
    const std::string p = "p" + std::to_string(k);
    const std::int64_t width = std::int64_t{128} << (k % 5);  // 128 to 2048
    ValueRef y;
    switch (k % 6) {
      case 0:
      case 1:
      case 2: {
        const int bits = k % 6 == 2 ? 8 : 4, group = k % 6 == 1 ? 32 : 64;
        ValueRef packed = b.input(p + "_packed", {{width, hidden * bits / 32}, DType::u32});
        ValueRef scales = b.input(p + "_scales", {{width, hidden / group}, dtype});
        ValueRef biases = b.input(p + "_biases", {{width, hidden / group}, dtype});
        y = b.quantized_matmul(x, packed, scales, biases, bits, group, p);
        break;
      }
      case 3:
        y = b.matmul(x, b.input(p + "_weight", {{width, hidden}, dtype}), true, p);
        break;
      default:  // [hidden, width]: the width is not the stacked axis, so each width is a class of its own
        y = b.matmul(x, b.input(p + "_weight", {{hidden, width}, dtype}), false, p);
        break;
    }
    if (k % 4 == 0) y = b.add(y, b.input(p + "_bias", {{width}, dtype}), p + "_biased");
    outputs.push_back(y);
  }
  return b.build(outputs);
}

struct Row {
  std::string name;
  int ops = 0;
  int kernels = 0;
  int regions = 0;
  int candidates = 0;
  int exact_components = 0;
  int other_components = 0;  // greedy, or with regions dropped to break kernel cycles
  int rounds = 1;            // selection rounds (ConflictComponent::round)
  double median_ms = 0;
  double bytes_avoided = 0;
  double saving_us = 0;
};

// Everything a plan decided, as text: its explanation (regions, every op's reason), JSON, and each
// candidate, conflict group and component, so two builds' plans can be compared with diff.
std::string plan_record(const FusionPlan& plan) {
  std::string text = plan.explain() + plan.to_json() + "\ncandidates:\n";
  for (const FusionCandidate& candidate : plan.candidates) {
    text += fmt::format("  {} at {}: benefit {:.17g}, component {}, region {}, nodes", candidate.rule, candidate.anchor,
                        candidate.benefit_ns, candidate.component, candidate.region);
    for (NodeId node : candidate.nodes) text += fmt::format(" {}", node);
    text += "\n";
  }
  text += "conflict groups:\n";
  for (const std::vector<int>& group : plan.conflicts.groups()) {
    for (int member : group) text += fmt::format(" {}", member);
    text += "\n";
  }
  text += "components:\n";
  for (const ConflictComponent& component : plan.components) {
    text += fmt::format("  {} bipartite {} round {}:", component.method, component.bipartite, component.round);
    for (int member : component.candidates) text += fmt::format(" {}", member);
    text += "\n";
  }
  return text;
}

// With --plans, each row's plan_record is appended to this file.
std::ofstream plans_file;

Row measure(const std::string& name, const ComputeGraph& graph, int repetitions) {
  std::vector<double> times;
  FusionPlan plan;
  for (int run = 0; run < repetitions; ++run) {
    const auto start = std::chrono::steady_clock::now();
    plan = plan_graph_fusion(graph);
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  Row row;
  row.name = name;
  row.ops = static_cast<int>(graph.nodes().size());
  row.kernels = plan.kernel_count();
  row.regions = static_cast<int>(plan.regions.size());
  row.candidates = static_cast<int>(plan.candidates.size());
  for (const ConflictComponent& component : plan.components) {
    const bool exact = component.method == "single" || component.method == "min_cut" ||
                       component.method == "branch_and_bound";
    (exact ? row.exact_components : row.other_components) += 1;
    row.rounds = std::max(row.rounds, component.round);
  }
  row.median_ms = times[times.size() / 2];
  // The graph-output flags once (the public estimate_region finds them per call: O(regions x outputs)).
  const fusion_internal::GraphIndex index(graph);
  for (const FusionRegion& region : plan.regions) {
    row.bytes_avoided += static_cast<double>(
        fusion_internal::estimate_region(graph, region.nodes, FusionTarget::h200(), {}, index.value_is_output)
            .memory_bytes_avoided);
  }
  row.saving_us = plan.total_benefit_ns() / 1000;
  if (plans_file.is_open()) plans_file << "==== " << name << "\n" << plan_record(plan);
  return row;
}

std::string bytes_text(double bytes) {
  if (bytes >= 1 << 20) return fmt::format("{:.2f} MiB", bytes / (1 << 20));
  if (bytes >= 1 << 10) return fmt::format("{:.1f} KiB", bytes / (1 << 10));
  return fmt::format("{:.0f} B", bytes);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"plan_graph_fusion's speed on decoders and random DAGs (median wall time, one thread)",
               "planner_benchmark"};
  std::string plans_path;
  app.add_option("--plans", plans_path,
                 "write every row's whole plan (regions, reasons, candidates, conflicts) to this file");
  std::string only;
  app.add_option("--only", only, "measure only the rows whose name contains this text");
  if (const std::optional<int> exit_code = metile::benchmarks::parse_benchmark_options(app, argc, argv)) return *exit_code;
  if (!plans_path.empty()) {
    plans_file.open(plans_path);
    if (!plans_file) {
      fmt::print(stderr, "planner_benchmark: error: cannot write {}\n", plans_path);
      return 2;
    }
  }
  std::vector<Row> rows;
  // The graphs are built for every row (the random ones draw from one generator in order).
  const auto measure_row = [&](const std::string& name, const ComputeGraph& graph, int repetitions) {
    if (name.find(only) != std::string::npos) rows.push_back(measure(name, graph, repetitions));
  };
  measure_row("example decoder_layer.json", read_graph(METILE_EXAMPLES_DIR "/decoder_layer.json"), 51);
  measure_row("decoder, 1 layer", decoder(1), 51);
  measure_row("decoder, 32 layers", decoder(32), 21);
  measure_row("decoder, 80 layers", decoder(80), 11);
  measure_row("elementwise chain, 300 ops", fusion_test::elementwise_chain(300), 51);
  // Random DAGs whose far inputs come from the last 64 values (the locality of
  // real models), and tangled ones whose far inputs come from anywhere.
  std::mt19937_64 random(2024);
  for (int ops : {1000, 5000, 20000}) {
    measure_row(fmt::format("random DAG, {} ops", ops), fusion_test::random_graph(random, ops, 64),
                ops >= 20000 ? 3 : 5);
  }
  for (int ops : {5000, 20000}) {
    measure_row(fmt::format("tangled random DAG, {} ops", ops), fusion_test::random_graph(random, ops),
                ops >= 20000 ? 3 : 5);
  }
  for (int ops : {1000, 2000, 4000, 8000, 16000}) {
    measure_row(fmt::format("far reads, outputs, {} ops", ops), far_reading_outputs(random, ops), ops >= 8000 ? 1 : 3);
  }
  for (int readers : {100, 2000, 10000, 20000, 50000}) {
    measure_row(fmt::format("one exp, {} reading chains", readers), shared_producer(readers), readers >= 2000 ? 3 : 11);
  }
  for (int ops : {4000, 32000}) {
    measure_row(fmt::format("one exp read along {} ops", ops), producer_read_along_a_chain(ops), 3);
  }
  for (int readers : {100, 2000, 10000, 20000, 50000}) {
    measure_row(fmt::format("one rms_norm, {} projections", readers), shared_input(readers), readers >= 2000 ? 3 : 11);
  }
  fmt::print("plan_graph_fusion on target h200 (median wall time of repeated runs, one thread)\n\n");
  fmt::print("{:<30} {:>6} {:>8} {:>7} {:>8} {:>11} {:>6} {:>10} {:>14} {:>12}\n", "graph", "ops", "kernels",
             "regions", "cands", "exact/other", "rounds", "plan ms", "bytes avoided", "saving µs");
  for (const Row& row : rows) {
    fmt::print("{:<30} {:>6} {:>8} {:>7} {:>8} {:>11} {:>6} {:>10.3f} {:>14} {:>12.1f}\n", row.name, row.ops,
               row.kernels, row.regions, row.candidates, fmt::format("{}/{}", row.exact_components, row.other_components),
               row.rounds, row.median_ms, bytes_text(row.bytes_avoided), row.saving_us);
  }
  for (const Row& goal : rows) {
    if (goal.name != "decoder, 32 layers") continue;
    fmt::print("\ngoal: a 32-layer decoder plans in under 10 ms: {} ({:.3f} ms)\n", goal.median_ms < 10 ? "met" : "NOT met",
               goal.median_ms);
  }
  return 0;
}
