// Random graphs, SwiGLU variants and the independent plan checker (see the header).
#include "fusion_test_support.h"

#include <algorithm>
#include <map>
#include <set>

namespace metile::fusion_test {
namespace {

class RandomGraphMaker {
 public:
  RandomGraphMaker(std::mt19937_64& random, int node_count, int far_window)
      : random_(random), node_count_(node_count), far_window_(far_window) {
    rows_ = pick(2) == 0 ? 1 : 2;
    dtype_ = pick(3) == 0 ? DType::f16 : DType::f32;
    wide_.push_back(builder_.input("x", {{rows_, width_}, dtype_}));
    if (pick(2) == 0) wide_.push_back(builder_.input("x2", {{rows_, width_}, dtype_}));
  }

  ComputeGraph make() {
    int recorded = 0;
    while (recorded < node_count_) recorded += add_op(node_count_ - recorded);
    std::vector<ValueRef> outputs;
    for (ValueRef value : all_) {
      if (!consumed_.count(value.id) || pick(6) == 0) outputs.push_back(value);
    }
    return builder_.build(outputs);
  }

 private:
  int pick(int count) { return static_cast<int>(std::uniform_int_distribution<int>(0, count - 1)(random_)); }

  // Mostly one of the last few values, sometimes any.
  ValueRef activation(std::vector<ValueRef>& pool) {
    const int size = static_cast<int>(pool.size());
    if (pick(4) == 0) {
      const int span = far_window_ > 0 ? std::min(size, far_window_) : size;
      return pool[static_cast<std::size_t>(size - 1 - pick(span))];
    }
    const int back = std::min(size - 1, pick(3));
    return pool[static_cast<std::size_t>(size - 1 - back)];
  }

  ValueRef fresh_input(std::vector<std::int64_t> shape, DType dtype) {
    return builder_.input("in" + std::to_string(input_counter_++), {std::move(shape), dtype});
  }

  ValueRef record(ValueRef value, std::initializer_list<ValueRef> inputs, bool wide = true) {
    for (ValueRef input : inputs) consumed_.insert(input.id);
    all_.push_back(value);
    (wide ? wide_ : narrow_).push_back(value);
    return value;
  }

  ValueRef dense(ValueRef a, std::int64_t from, std::int64_t to) {
    return builder_.matmul(a, fresh_input({from, to}, dtype_));
  }

  ValueRef quantized(ValueRef a, std::int64_t from, std::int64_t to) {
    const int bits = pick(2) == 0 ? 4 : 8;
    // Named in a fixed order (argument evaluation order is unspecified).
    ValueRef packed = fresh_input({to, from * bits / 32}, DType::u32);
    ValueRef scales = fresh_input({to, from / 32}, dtype_);
    ValueRef biases = fresh_input({to, from / 32}, dtype_);
    return builder_.quantized_matmul(a, packed, scales, biases, bits, 32);
  }

  ValueRef contraction(ValueRef a, std::int64_t from, std::int64_t to) {
    return pick(3) == 0 ? quantized(a, from, to) : dense(a, from, to);
  }

  int add_op(int room) {
    if (room >= 5 && pick(12) == 0) return add_swiglu();
    if (!narrow_.empty() && pick(4) == 0) {
      ValueRef n = activation(narrow_);
      switch (pick(3)) {
        case 0: record(contraction(n, narrow_width_, width_), {n}); return 1;
        case 1: record(builder_.silu(n), {n}, false); return 1;
        default: {
          ValueRef other = activation(narrow_);
          record(builder_.multiply(n, other), {n, other}, false);
          return 1;
        }
      }
    }
    ValueRef a = activation(wide_);
    switch (pick(16)) {
      case 0:
      case 1: {
        ValueRef b = pick(3) == 0 ? fresh_input({width_}, dtype_) : activation(wide_);
        record(builder_.add(a, b), {a, b});
        return 1;
      }
      case 2: {
        ValueRef b = pick(2) == 0 ? fresh_input({rows_, width_}, dtype_) : activation(wide_);
        record(builder_.multiply(a, b), {a, b});
        return 1;
      }
      case 3: {
        ValueRef b = activation(wide_);
        record(builder_.subtract(a, b), {a, b});
        return 1;
      }
      case 4: record(builder_.scale(a, 0.5), {a}); return 1;
      case 5: record(builder_.silu(a), {a}); return 1;
      case 6: record(builder_.exp(builder_.scale(a, 0.125)), {a}); return 2;
      case 7: record(builder_.gelu(a, pick(2) == 0 ? "none" : "tanh"), {a}); return 1;
      case 8:
      case 9: record(builder_.rms_norm(a, fresh_input({width_}, dtype_), 1e-5), {a}); return 1;
      case 10: record(builder_.softmax(a), {a}); return 1;
      case 11:
        record(builder_.layer_norm(a, fresh_input({width_}, dtype_), fresh_input({width_}, dtype_), 1e-5), {a});
        return 1;
      case 12: record(contraction(a, width_, width_), {a}); return 1;
      case 13: record(contraction(a, width_, narrow_width_), {a}, false); return 1;
      case 14: record(builder_.reshape(a, {rows_, width_}), {a}); return 1;
      default: {
        // A broadcast weight computed in the graph: a shape the kernel cannot share.
        ValueRef weight = builder_.scale(fresh_input({width_}, dtype_), 2.0);
        all_.push_back(weight);
        record(builder_.multiply(a, weight), {a, weight});
        return 2;
      }
    }
  }

  int add_swiglu() {
    ValueRef x = activation(wide_);
    ValueRef gate = contraction(x, width_, narrow_width_);
    ValueRef up = contraction(x, width_, narrow_width_);
    ValueRef activated = builder_.silu(gate);
    ValueRef product = pick(2) == 0 ? builder_.multiply(activated, up) : builder_.multiply(up, activated);
    for (ValueRef value : {gate, up, activated, product}) {
      all_.push_back(value);
      narrow_.push_back(value);
    }
    consumed_.insert({x.id, gate.id, up.id, activated.id, product.id});
    record(contraction(product, narrow_width_, width_), {product});
    return 5;
  }

  std::mt19937_64& random_;
  int node_count_;
  int far_window_;
  GraphBuilder builder_;
  std::int64_t rows_ = 1;
  std::int64_t width_ = 32;
  std::int64_t narrow_width_ = 64;
  DType dtype_ = DType::f32;
  std::vector<ValueRef> wide_;    // [rows, width]
  std::vector<ValueRef> narrow_;  // [rows, narrow_width]
  std::vector<ValueRef> all_;
  std::set<ValueId> consumed_;
  int input_counter_ = 0;
};

}  // namespace

ComputeGraph random_graph(std::mt19937_64& random, int node_count, int far_window) {
  return RandomGraphMaker(random, node_count, far_window).make();
}

ComputeGraph swiglu_graph(const SwigluOptions& options) {
  GraphBuilder builder;
  const std::int64_t hidden = options.hidden;
  const std::int64_t intermediate = options.intermediate;
  ValueRef x = builder.input("x", {{options.rows, hidden}, options.dtype});
  auto contraction = [&](ValueRef input, std::int64_t from, std::int64_t to, const std::string& name) {
    if (!options.quantized) {
      return builder.matmul(input, builder.input(name + "_weight", {{to, from}, options.dtype}), true, name);
    }
    const int bits = 4;
    const int group = 32;
    return builder.quantized_matmul(input, builder.input(name + "_packed", {{to, from * bits / 32}, DType::u32}),
                                    builder.input(name + "_scales", {{to, from / group}, options.dtype}),
                                    builder.input(name + "_biases", {{to, from / group}, options.dtype}), bits, group,
                                    name);
  };
  ValueRef gate = contraction(x, hidden, intermediate, "gate");
  ValueRef up = contraction(x, hidden, intermediate, "up");
  ValueRef activated = builder.silu(gate, "gate_activation");
  ValueRef product = options.up_first ? builder.multiply(up, activated, "hidden")
                                      : builder.multiply(activated, up, "hidden");
  ValueRef down = contraction(product, intermediate, hidden, "down");
  std::vector<ValueRef> outputs;
  if (options.residual) {
    ValueRef residual = builder.input("residual", {{options.rows, hidden}, options.dtype});
    outputs.push_back(options.residual_second ? builder.add(down, residual, "output")
                                              : builder.add(residual, down, "output"));
  } else {
    outputs.push_back(down);
  }
  if (options.gate_escape == "output") {
    outputs.push_back(gate);
  } else if (!options.gate_escape.empty()) {
    outputs.push_back(builder.scale(gate, 1.0, options.gate_escape));
  }
  return builder.build(outputs);
}

bool is_convex(const ComputeGraph& graph, const std::vector<NodeId>& nodes) {
  const std::set<NodeId> inside(nodes.begin(), nodes.end());
  // Forward from every edge that leaves the set; reaching the set again is a violation.
  std::set<NodeId> seen;
  std::vector<NodeId> stack;
  for (NodeId node : nodes) {
    for (ValueId output : graph.node(node).outputs) {
      for (NodeId consumer : graph.consumers(output)) {
        if (!inside.count(consumer) && seen.insert(consumer).second) stack.push_back(consumer);
      }
    }
  }
  while (!stack.empty()) {
    const NodeId current = stack.back();
    stack.pop_back();
    for (ValueId output : graph.node(current).outputs) {
      for (NodeId consumer : graph.consumers(output)) {
        if (inside.count(consumer)) return false;
        if (seen.insert(consumer).second) stack.push_back(consumer);
      }
    }
  }
  return true;
}

ComputeGraph elementwise_chain(int length) {
  GraphBuilder builder;
  ValueRef value = builder.input("x", {{1, 4096}, DType::f16});
  const ValueRef weight = builder.input("weight", {{4096}, DType::f16});
  for (int step = 0; step < length; ++step) {
    const std::string name = "op" + std::to_string(step);
    switch (step % 4) {
      case 0: value = builder.add(value, weight, name); break;
      case 1: value = builder.silu(value, name); break;
      case 2: value = builder.multiply(value, weight, name); break;
      default: value = builder.scale(value, 0.5, name); break;
    }
  }
  return builder.build({value});
}

std::string plan_problems(const FusionPlan& plan) {
  if (!plan.graph) return "the plan has no graph";
  const ComputeGraph& graph = *plan.graph;
  const std::size_t node_count = graph.nodes().size();
  std::vector<int> kernel_of(node_count, -1);
  int kernels = 0;
  for (const FusionRegion& region : plan.regions) {
    if (region.nodes.size() < 2) return "region of " + region.rule + " has fewer than two nodes";
    if (!std::is_sorted(region.nodes.begin(), region.nodes.end())) return "region nodes are not in topological order";
    for (NodeId node : region.nodes) {
      if (kernel_of[static_cast<std::size_t>(node)] >= 0) return "node " + graph.node(node).name + " is in two kernels";
      kernel_of[static_cast<std::size_t>(node)] = kernels;
    }
    if (!is_convex(graph, region.nodes)) return "region of " + region.rule + " is not convex";
    // Inputs: values read inside whose producer is outside, in first-use order.
    std::vector<ValueId> inputs;
    std::vector<ValueId> outputs;
    const std::set<NodeId> inside(region.nodes.begin(), region.nodes.end());
    for (NodeId node : region.nodes) {
      for (ValueId input : graph.node(node).inputs) {
        if (!inside.count(graph.value(input).producer) &&
            std::find(inputs.begin(), inputs.end(), input) == inputs.end()) {
          inputs.push_back(input);
        }
      }
      for (ValueId output : graph.node(node).outputs) {
        bool leaves = graph.is_output(output);
        for (NodeId consumer : graph.consumers(output)) leaves = leaves || !inside.count(consumer);
        if (leaves) outputs.push_back(output);
      }
    }
    if (inputs != region.inputs) return "region of " + region.rule + " lists the wrong inputs";
    if (outputs != region.outputs) return "region of " + region.rule + " lists the wrong outputs";
    ++kernels;
  }
  std::vector<NodeId> expected_unfused;
  for (std::size_t node = 0; node < node_count; ++node) {
    if (kernel_of[node] < 0) {
      expected_unfused.push_back(static_cast<NodeId>(node));
      kernel_of[node] = kernels++;
    }
  }
  if (expected_unfused != plan.unfused) return "the unfused list is not the nodes outside every region";
  // The kernel graph must have a topological order (Kahn's algorithm).
  std::vector<std::set<int>> successors(static_cast<std::size_t>(kernels));
  std::vector<int> waiting(static_cast<std::size_t>(kernels), 0);
  for (const Node& node : graph.nodes()) {
    for (ValueId input : node.inputs) {
      const NodeId producer = graph.value(input).producer;
      if (producer < 0) continue;
      const int from = kernel_of[static_cast<std::size_t>(producer)];
      const int to = kernel_of[static_cast<std::size_t>(node.id)];
      if (from != to && successors[static_cast<std::size_t>(from)].insert(to).second) ++waiting[static_cast<std::size_t>(to)];
    }
  }
  std::vector<int> ready;
  for (int kernel = 0; kernel < kernels; ++kernel) {
    if (waiting[static_cast<std::size_t>(kernel)] == 0) ready.push_back(kernel);
  }
  int ordered = 0;
  while (!ready.empty()) {
    const int kernel = ready.back();
    ready.pop_back();
    ++ordered;
    for (int next : successors[static_cast<std::size_t>(kernel)]) {
      if (--waiting[static_cast<std::size_t>(next)] == 0) ready.push_back(next);
    }
  }
  if (ordered != kernels) return "the kernels form a cycle";
  if (plan.node_reasons.size() != node_count) return "not one reason per node";
  for (std::size_t node = 0; node < node_count; ++node) {
    const std::string& reason = plan.node_reasons[node];
    if (reason.empty()) return "node " + graph.nodes()[node].name + " has no reason";
    const bool fused = kernel_of[node] < static_cast<int>(plan.regions.size());
    const std::string expected = "in region R" + std::to_string(kernel_of[node] + 1) + " (";
    if (fused != (reason.rfind(expected, 0) == 0)) return "node " + graph.nodes()[node].name + " has reason: " + reason;
  }
  return {};
}

const std::string& reason_of(const FusionPlan& plan, const std::string& node) {
  return plan.node_reasons.at(static_cast<std::size_t>(*plan.graph->find_node(node)));
}

}  // namespace metile::fusion_test
