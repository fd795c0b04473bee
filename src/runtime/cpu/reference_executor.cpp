// The CPU reference executors: a whole graph in node order, and a FusionPlan
// kernel by kernel. Both evaluate each node with evaluate_reference_node, so a
// plan that respects the graph's data flow reproduces run_reference bit for
// bit; what run_plan_reference adds is the check that the plan's kernels can
// be scheduled at all with only their declared outputs published.
//
//   published values ──► kernel (region or single node) ──► its outputs published
//        ▲                 intermediates stay in the kernel          │
//        └───────────────────────────────────────────────────────────┘
#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string>

#include "metile/cpu_runtime.h"
#include "metile/io.h"
#include "reference_ops.h"

namespace metile {
namespace {

// The values one scope can see, by value id: graph inputs are borrowed from the
// caller's map (weights can be large), computed values are owned.
class ValueSlots {
 public:
  explicit ValueSlots(std::size_t count) : borrowed_(count, nullptr), owned_(count) {}
  const HostTensor* find(ValueId id) const {
    const auto slot = static_cast<std::size_t>(id);
    return owned_[slot] ? &*owned_[slot] : borrowed_[slot];
  }
  HostTensor* find_owned(ValueId id) {
    auto& slot = owned_[static_cast<std::size_t>(id)];
    return slot ? &*slot : nullptr;
  }
  // Moves an owned value out, leaving the slot empty.
  HostTensor take(ValueId id) {
    auto& slot = owned_[static_cast<std::size_t>(id)];
    HostTensor value = std::move(*slot);
    slot.reset();
    return value;
  }
  void borrow(ValueId id, const HostTensor& tensor) { borrowed_[static_cast<std::size_t>(id)] = &tensor; }
  void own(ValueId id, HostTensor tensor) { owned_[static_cast<std::size_t>(id)] = std::move(tensor); }
  void release(ValueId id) {
    borrowed_[static_cast<std::size_t>(id)] = nullptr;
    owned_[static_cast<std::size_t>(id)].reset();
  }
  // Moves a value out of this scope into `target` (a kernel publishing its output).
  void move_to(ValueId id, ValueSlots& target) {
    const auto slot = static_cast<std::size_t>(id);
    if (owned_[slot]) target.own(id, std::move(*owned_[slot]));
    owned_[slot].reset();
  }

 private:
  std::vector<const HostTensor*> borrowed_;
  std::vector<std::optional<HostTensor>> owned_;
};

// How many node inputs still read each value; a value no later node reads and that is not a graph
// output is freed at once (a long graph holds only the values still needed).
class ReadsLeft {
 public:
  explicit ReadsLeft(const ComputeGraph& graph) : graph_(graph), reads_(graph.values().size(), 0) {
    for (const Node& node : graph.nodes()) {
      for (ValueId input : node.inputs) ++reads_[static_cast<std::size_t>(input)];
    }
  }
  // True when the next node to read `value` (once) is its last reader and the graph does not return it.
  bool last_reader(ValueId value) const {
    return reads_[static_cast<std::size_t>(value)] == 1 && !graph_.is_output(value);
  }
  // After `node` ran: frees, in every scope given, the values it was the last to read, and its own
  // outputs that nothing reads (a dead node's).
  void done(const Node& node, std::initializer_list<ValueSlots*> scopes) {
    for (ValueId input : node.inputs) {
      if (--reads_[static_cast<std::size_t>(input)] == 0 && !graph_.is_output(input)) {
        for (ValueSlots* scope : scopes) scope->release(input);
      }
    }
    for (ValueId output : node.outputs) release_if_unread(output, scopes);
  }
  // Frees the graph's inputs that no node reads and the graph does not return (handed-over ones).
  void drop_unread_inputs(ValueSlots& slots) {
    for (ValueId input : graph_.inputs()) release_if_unread(input, {&slots});
  }

 private:
  void release_if_unread(ValueId value, std::initializer_list<ValueSlots*> scopes) {
    if (reads_[static_cast<std::size_t>(value)] == 0 && !graph_.is_output(value)) {
      for (ValueSlots* scope : scopes) scope->release(value);
    }
  }

  const ComputeGraph& graph_;
  std::vector<std::size_t> reads_;
};

// Evaluates one node reading its inputs from `local` first, then `published`. A kv_cache_write
// whose cache this executor owns (a handed-over input or a computed value) and no later node reads
// writes its rows into that cache, which becomes the output: no copy of a decode step's caches.
void evaluate_into(const ComputeGraph& graph, const Node& node, ValueSlots& published, ValueSlots& local,
                   const ReadsLeft& reads) {
  std::vector<const HostTensor*> inputs;
  for (ValueId input : node.inputs) {
    const HostTensor* value = local.find(input) ? local.find(input) : published.find(input);
    if (!value) {
      throw std::logic_error(
          fmt::format("node '{}' reads '{}' before it is computed", node.name, graph.value(input).name));
    }
    inputs.push_back(value);
  }
  if (node.op == "kv_cache_write" && reads.last_reader(node.inputs[0])) {
    ValueSlots* holder = local.find_owned(node.inputs[0])       ? &local
                         : published.find_owned(node.inputs[0]) ? &published
                                                                : nullptr;
    if (holder != nullptr) {
      // The rows are checked before any is written; on an error the cache stays where it was.
      cpu::write_cache_rows(*holder->find_owned(node.inputs[0]), node, *inputs[1], *inputs[2]);
      local.own(node.outputs[0], holder->take(node.inputs[0]));
      return;
    }
  }
  std::vector<TensorSpec> output_specs;
  for (ValueId output : node.outputs) output_specs.push_back(graph.value(output).spec);
  std::vector<HostTensor> results = cpu::evaluate_reference_node(node, inputs, output_specs);
  for (std::size_t index = 0; index < node.outputs.size(); ++index) {
    local.own(node.outputs[index], std::move(results[index]));
  }
}

const HostTensor* find_input(std::span<const TensorMap* const> inputs, std::string_view name) {
  for (const TensorMap* map : inputs) {
    const auto found = map->find(name);
    if (found != map->end()) return &found->second;
  }
  return nullptr;
}

// The graph's inputs: those in `owned` moved in (the executor frees them after their last reader),
// the others borrowed from `borrowed` (looked up in order).
ValueSlots published_inputs(const ComputeGraph& graph, TensorMap& owned, std::span<const TensorMap* const> borrowed) {
  std::vector<const TensorMap*> maps = {&owned};
  maps.insert(maps.end(), borrowed.begin(), borrowed.end());
  check_graph_inputs(graph, maps);
  ValueSlots slots(graph.values().size());
  for (ValueId input : graph.inputs()) {
    const auto found = owned.find(graph.value(input).name);
    if (found != owned.end()) {
      slots.own(input, std::move(found->second));
    } else {
      slots.borrow(input, *find_input(borrowed, graph.value(input).name));
    }
  }
  owned.clear();
  return slots;
}

// Outputs computed here are moved out, not copied (a model's KV caches are large).
TensorMap collect_outputs(const ComputeGraph& graph, ValueSlots& slots) {
  TensorMap outputs;
  for (ValueId output : graph.outputs()) {
    if (HostTensor* owned = slots.find_owned(output)) {
      outputs.insert_or_assign(graph.value(output).name, std::move(*owned));
      continue;
    }
    const HostTensor* value = slots.find(output);
    if (!value) {
      throw InputError(
          fmt::format("fusion plan: graph output '{}' is computed inside a region that does not "
                      "list it among its outputs",
                      graph.value(output).name));
    }
    outputs.insert_or_assign(graph.value(output).name, *value);
  }
  return outputs;
}

// One unit of the plan: a region or an unfused node.
struct Kernel {
  std::string label;               // for messages
  std::vector<NodeId> nodes;       // topological (ascending node ids)
  std::vector<ValueId> needs;      // values read from outside the kernel
  std::vector<ValueId> publishes;  // values it makes visible to later kernels
};

std::string node_name(const ComputeGraph& graph, NodeId id) {
  return id >= 0 && static_cast<std::size_t>(id) < graph.nodes().size() ? "'" + graph.node(id).name + "'"
                                                                        : "#" + std::to_string(id);
}

Kernel make_kernel(const ComputeGraph& graph, std::string label, std::vector<NodeId> nodes,
                   std::vector<NodeId>& owner_of_node, int kernel_index) {
  Kernel kernel{std::move(label), std::move(nodes), {}, {}};
  std::sort(kernel.nodes.begin(), kernel.nodes.end());
  for (NodeId id : kernel.nodes) {
    if (id < 0 || static_cast<std::size_t>(id) >= graph.nodes().size()) {
      throw InputError(fmt::format("fusion plan: {} names node {} which the graph does not have",
                                   kernel.label, node_name(graph, id)));
    }
    NodeId& owner = owner_of_node[static_cast<std::size_t>(id)];
    if (owner != -1) {
      throw InputError(fmt::format("fusion plan: node {} is in more than one kernel", node_name(graph, id)));
    }
    owner = kernel_index;
  }
  for (NodeId id : kernel.nodes) {
    for (ValueId input : graph.node(id).inputs) {
      const NodeId producer = graph.value(input).producer;
      const bool inside = std::binary_search(kernel.nodes.begin(), kernel.nodes.end(), producer);
      if (!inside && std::find(kernel.needs.begin(), kernel.needs.end(), input) == kernel.needs.end()) {
        kernel.needs.push_back(input);
      }
    }
  }
  return kernel;
}

std::vector<Kernel> kernels_of(const FusionPlan& plan) {
  const ComputeGraph& graph = *plan.graph;
  std::vector<NodeId> owner_of_node(graph.nodes().size(), -1);
  std::vector<Kernel> kernels;
  for (std::size_t index = 0; index < plan.regions.size(); ++index) {
    const FusionRegion& region = plan.regions[index];
    Kernel kernel = make_kernel(graph, fmt::format("region {} ({})", index, region.rule), region.nodes,
                                owner_of_node, static_cast<int>(kernels.size()));
    for (ValueId output : region.outputs) {
      const bool valid = output >= 0 && static_cast<std::size_t>(output) < graph.values().size();
      if (!valid ||
          !std::binary_search(kernel.nodes.begin(), kernel.nodes.end(), graph.value(output).producer)) {
        throw InputError(
            fmt::format("fusion plan: {} lists output {} which none of its nodes computes", kernel.label,
                        valid ? "'" + graph.value(output).name + "'" : "#" + std::to_string(output)));
      }
    }
    kernel.publishes = region.outputs;
    kernels.push_back(std::move(kernel));
  }
  for (NodeId id : plan.unfused) {
    Kernel kernel = make_kernel(graph, fmt::format("unfused node {}", node_name(graph, id)), {id},
                                owner_of_node, static_cast<int>(kernels.size()));
    kernel.publishes = graph.node(id).outputs;
    kernels.push_back(std::move(kernel));
  }
  for (std::size_t id = 0; id < owner_of_node.size(); ++id) {
    if (owner_of_node[id] == -1) {
      throw InputError(fmt::format("fusion plan: node '{}' is in no kernel", graph.nodes()[id].name));
    }
  }
  return kernels;
}

}  // namespace

void check_graph_inputs(const ComputeGraph& graph, std::span<const TensorMap* const> inputs) {
  for (ValueId id : graph.inputs()) {
    const Value& value = graph.value(id);
    const HostTensor* found = find_input(inputs, value.name);
    if (!found) {
      throw InputError(fmt::format("missing input '{}' ({})", value.name, value.spec.to_string()));
    }
    if (found->spec() != value.spec) {
      throw InputError(fmt::format("input '{}' is {}, the graph expects {}", value.name,
                                   found->spec().to_string(), value.spec.to_string()));
    }
  }
}

void check_is_graph_input(const ComputeGraph& graph, const std::string& name) {
  const std::optional<ValueId> id = graph.find_value(name);
  if (id && graph.value(*id).producer < 0) return;
  std::string known;
  for (ValueId input : graph.inputs()) known += (known.empty() ? "" : ", ") + graph.value(input).name;
  throw InputError(fmt::format("'{}' is not an input of the graph (its inputs: {})", name, known));
}

void check_graph_inputs(const ComputeGraph& graph, const TensorMap& inputs) {
  const TensorMap* maps[] = {&inputs};
  check_graph_inputs(graph, maps);
}

std::uint64_t reference_working_bytes(const ComputeGraph& graph, const Node& node) {
  // The evaluators of reference_ops.cpp load every input with load_floats and gather results in a
  // std::vector<float> (elementwise ops) or <double> (reductions, contractions, attention).
  std::uint64_t bytes = 0;
  for (ValueId input : node.inputs) bytes += 4 * static_cast<std::uint64_t>(graph.value(input).spec.element_count());
  for (ValueId output : node.outputs) bytes += 8 * static_cast<std::uint64_t>(graph.value(output).spec.element_count());
  return bytes;
}

void check_run_memory(const ComputeGraph& graph, bool runs_reference) {
  const std::uint64_t available = physical_memory_bytes();
  std::uint64_t bytes = 0;  // stops at the first excess, so it cannot wrap
  for (const Value& value : graph.values()) {
    bytes += static_cast<std::uint64_t>(value.spec.bytes());
    if (bytes > available) {
      throw InputError(fmt::format("the graph's tensors need more than this machine's {} bytes of memory (value '{}' "
                                   "brings them to {} bytes)",
                                   available, value.name, bytes));
    }
  }
  if (!runs_reference) return;
  for (const Node& node : graph.nodes()) {
    const std::uint64_t working = reference_working_bytes(graph, node);  // below 2^54: no wrap
    if (bytes + working > available) {
      throw InputError(fmt::format("the graph's tensors ({} bytes) and the CPU reference's working copies for node '{}' "
                                   "({} bytes: its inputs as f32, its results as f64) need more than this machine's {} "
                                   "bytes of memory",
                                   bytes, node.name, working, available));
    }
  }
}

TensorMap run_reference(const ComputeGraph& graph, const TensorMap& inputs) {
  const TensorMap* maps[] = {&inputs};
  return run_reference(graph, {}, maps);
}

TensorMap run_plan_reference(const FusionPlan& plan, const TensorMap& inputs) {
  const TensorMap* maps[] = {&inputs};
  return run_plan_reference(plan, {}, maps);
}

TensorMap run_reference(const ComputeGraph& graph, std::span<const TensorMap* const> inputs) {
  return run_reference(graph, {}, inputs);
}

TensorMap run_plan_reference(const FusionPlan& plan, std::span<const TensorMap* const> inputs) {
  return run_plan_reference(plan, {}, inputs);
}

TensorMap run_reference(const ComputeGraph& graph, TensorMap owned, std::span<const TensorMap* const> borrowed) {
  ValueSlots values = published_inputs(graph, owned, borrowed);
  ReadsLeft reads(graph);
  reads.drop_unread_inputs(values);
  for (const Node& node : graph.nodes()) {
    evaluate_into(graph, node, values, values, reads);
    reads.done(node, {&values});
  }
  return collect_outputs(graph, values);
}

TensorMap run_plan_reference(const FusionPlan& plan, TensorMap owned, std::span<const TensorMap* const> borrowed) {
  if (!plan.graph) throw InputError("fusion plan: it has no graph");
  const ComputeGraph& graph = *plan.graph;
  const std::vector<Kernel> kernels = kernels_of(plan);
  std::vector<std::vector<NodeId>> node_sets;
  for (const Kernel& kernel : kernels) node_sets.push_back(kernel.nodes);
  const Schedule order = schedule_kernels(graph, node_sets);
  if (!order.acyclic()) {
    std::string cycle;
    for (std::size_t index : order.cycle) cycle += kernels[index].label + " waits for ";
    throw InputError(fmt::format("fusion plan: the kernels form a cycle: {}{}", cycle, kernels[order.cycle.front()].label));
  }
  ValueSlots published = published_inputs(graph, owned, borrowed);
  ReadsLeft reads(graph);
  reads.drop_unread_inputs(published);
  for (std::size_t index : order.order) {
    const Kernel& kernel = kernels[index];
    for (ValueId value : kernel.needs) {
      if (published.find(value) != nullptr) continue;
      const NodeId producer = graph.value(value).producer;
      const auto owner = std::find_if(kernels.begin(), kernels.end(), [&](const Kernel& other) {
        return std::binary_search(other.nodes.begin(), other.nodes.end(), producer);
      });
      throw InputError(fmt::format("fusion plan: {} waits for '{}', which {} does not publish", kernel.label,
                                   graph.value(value).name, owner->label));
    }
    ValueSlots local(graph.values().size());
    for (NodeId id : kernel.nodes) {
      const Node& node = graph.node(id);
      evaluate_into(graph, node, published, local, reads);
      reads.done(node, {&local, &published});
    }
    for (ValueId value : kernel.publishes) local.move_to(value, published);
  }
  return collect_outputs(graph, published);
}

}  // namespace metile
