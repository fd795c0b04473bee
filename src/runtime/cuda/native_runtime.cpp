// The native path: every node of any graph runs on the device, one kernel (or one cuBLASLt call)
// per node, over one device tensor per graph value. It is the baseline every fused candidate
// must beat, and the fallback whenever a fused kernel is unsupported, wrong or slower.
#include <fmt/core.h>

#include <algorithm>
#include <atomic>

#include "cuda_driver.h"
#include "metile/cuda_runtime.h"
#include "metile/discovery.h"

namespace metile {

// ---------------------------------------------------------------- device values
namespace {
std::uint64_t next_device_values_serial() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

DeviceValues::DeviceValues(const ComputeGraph& graph, const ExternalValues& external_values)
    : graph_(&graph), external_(graph.values().size(), false), serial_(next_device_values_serial()) {
  std::vector<std::uint64_t> external_address(graph.values().size(), 0);
  for (const auto& [name, address] : external_values) {
    const std::optional<ValueId> found = graph.find_value(name);
    if (!found) throw InputError(fmt::format("external value '{}' is not a value of the graph", name));
    if (address == 0) throw InputError(fmt::format("external value '{}' has a null device address", name));
    external_[static_cast<std::size_t>(*found)] = true;
    external_address[static_cast<std::size_t>(*found)] = address;
  }
  // Owners first (allocated, or the caller's buffer), then every alias as a view of its owner's.
  const std::vector<ValueId> owner = alias_of(graph, external_);
  tensors_.resize(graph.values().size());
  for (const Value& value : graph.values()) {
    const auto index = static_cast<std::size_t>(value.id);
    if (owner[index] != value.id) continue;
    tensors_[index].spec = value.spec;
    tensors_[index].buffer = external_[index] ? DeviceBuffer::borrow(external_address[index], static_cast<std::size_t>(value.spec.bytes()))
                                              : DeviceBuffer(static_cast<std::size_t>(value.spec.bytes()));
  }
  for (const Value& value : graph.values()) {
    const auto index = static_cast<std::size_t>(value.id);
    if (owner[index] == value.id) continue;
    tensors_[index].spec = value.spec;
    tensors_[index].buffer = DeviceBuffer::borrow(tensors_[static_cast<std::size_t>(owner[index])].address(),
                                                  static_cast<std::size_t>(value.spec.bytes()));
  }
}

bool DeviceValues::shares_buffer(ValueId a, ValueId b) const {
  return (*this)[a].address() == (*this)[b].address() && (*this)[a].spec.bytes() != 0;
}

void DeviceValues::upload_inputs(const TensorMap& inputs) {
  std::vector<ValueId> uploaded;
  for (ValueId id : graph_->inputs()) {
    const Value& value = graph_->value(id);
    auto found = inputs.find(value.name);
    if (found == inputs.end()) {
      if (is_external(id)) continue;  // the caller's buffer already holds it
      throw InputError(fmt::format("missing input '{}' ({})", value.name, value.spec.to_string()));
    }
    if (found->second.spec() != value.spec) {
      throw InputError(fmt::format("input '{}' is {}, the graph expects {}", value.name,
                                   found->second.spec().to_string(), value.spec.to_string()));
    }
    tensors_.at(static_cast<std::size_t>(id)).buffer.upload(found->second);
    uploaded.push_back(id);
  }
  // Derived data follows the inputs just written, and only those (weights bound once stay derived once).
  for (const Derived& derived : derived_) {
    if (std::find_first_of(derived.inputs.begin(), derived.inputs.end(), uploaded.begin(), uploaded.end()) !=
        derived.inputs.end()) {
      derived.derive();
    }
  }
}

void DeviceValues::keep_derived(std::vector<ValueId> inputs, std::function<void()> derive) {
  for (ValueId id : inputs) {
    if (id < 0 || static_cast<std::size_t>(id) >= tensors_.size() || graph_->value(id).producer >= 0) {
      throw std::logic_error("DeviceValues::keep_derived: derived data must come from graph inputs");
    }
  }
  derive();
  derived_.push_back({std::move(inputs), std::move(derive)});
}

TensorMap DeviceValues::download_outputs() const {
  TensorMap outputs;
  for (ValueId id : graph_->outputs()) outputs[graph_->value(id).name] = (*this)[id].to_host();
  return outputs;
}

void DeviceValues::poison_computed_values() {
  for (const Value& value : graph_->values()) {
    DeviceBuffer& buffer = tensors_.at(static_cast<std::size_t>(value.id)).buffer;
    if (value.producer >= 0 && buffer.owns_memory()) buffer.fill_bytes(0xFF);
  }
}

// ---------------------------------------------------------------- generated kernels
LoadedKernel load_generated_kernel(const GeneratedKernel& kernel) {
  LoadedKernel loaded{kernel, compile_cuda(kernel.source, kernel.kernel_name)};
  if (kernel.launch.shared_memory_bytes > 48 * 1024) {
    loaded.compiled.set_max_dynamic_shared_memory(static_cast<int>(kernel.launch.shared_memory_bytes));
  }
  return loaded;
}

DeviceStep bind_kernel(const LoadedKernel& kernel, DeviceValues& values) {
  std::vector<ValueId> ids;
  for (const KernelParameter& parameter : kernel.generated.parameters) ids.push_back(parameter.value);
  return bind_kernel(kernel, values, ids);
}

DeviceStep bind_kernel(const LoadedKernel& kernel, DeviceValues& values, const std::vector<ValueId>& value_for_parameter) {
  const auto& parameters = kernel.generated.parameters;
  if (value_for_parameter.size() != parameters.size()) {
    throw CudaError(fmt::format("bind_kernel({}): {} values for {} parameters", kernel.generated.kernel_name,
                                value_for_parameter.size(), parameters.size()));
  }
  KernelArguments arguments;
  std::vector<std::shared_ptr<DeviceBuffer>> scratch;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    if (parameters[i].kind == KernelParameter::Kind::scratch) {
      scratch.push_back(std::make_shared<DeviceBuffer>(static_cast<std::size_t>(parameters[i].scratch_bytes)));
      arguments.add_pointer(*scratch.back());
    } else {
      arguments.add_pointer(values[value_for_parameter[i]].address());
    }
  }
  const KernelLaunchShape shape = kernel.generated.launch;
  return [compiled = kernel.compiled, arguments, scratch, shape](const CudaStream& stream) {
    launch(compiled, Dim3{shape.grid_x, shape.grid_y, shape.grid_z}, Dim3{shape.block_x, 1, 1},
           shape.shared_memory_bytes, stream, arguments);
  };
}

// ---------------------------------------------------------------- native runtime
NativeRuntime::NativeRuntime() = default;
NativeRuntime::~NativeRuntime() = default;

const LoadedKernel& NativeRuntime::kernel_for(const GeneratedKernel& generated) {
  auto found = kernels_by_source_.find(generated.source);
  if (found == kernels_by_source_.end()) {
    found = kernels_by_source_.emplace(generated.source, load_generated_kernel(generated)).first;
  }
  return found->second;
}

std::string NativeRuntime::node_source(const ComputeGraph& graph, NodeId node_id) {
  const Node& node = graph.node(node_id);
  if (node.op == "matmul") return "cublasLt matmul";
  if (node.op == "quantized_matmul") return generate_dequantize_kernel(graph, node_id).source + "\ncublasLt matmul";
  if (node.op == "flash_attention") {
    const ComputeGraph plain = flash_attention_as_plain_ops(graph, node_id);
    std::string source;
    for (const Node& step : plain.nodes()) source += node_source(plain, step.id);
    return source;
  }
  return generate_node_kernel(graph, node_id).source;
}

DeviceStep NativeRuntime::node_step(const ComputeGraph& graph, NodeId node_id, DeviceValues& values) {
  const Node& node = graph.node(node_id);
  if (node.op == "flash_attention") {
    // The law's definition as plain ops (cuBLASLt QKᵀ, scale, mask, softmax, PV) over values of its
    // own whose ends borrow this graph's buffers; refused (InputError) without a verified certificate.
    auto plain = std::make_shared<const ComputeGraph>(flash_attention_as_plain_ops(graph, node_id));
    ExternalValues ends = {{"q", values[node.inputs[0]].address()},
                           {"k", values[node.inputs[1]].address()},
                           {"v", values[node.inputs[2]].address()},
                           {"out", values[node.outputs[0]].address()}};
    if (node.inputs.size() == 4) ends["positions"] = values[node.inputs[3]].address();
    auto plain_values = std::make_shared<DeviceValues>(*plain, ends);
    auto steps = std::make_shared<std::vector<DeviceStep>>(graph_steps(*plain, *plain_values));
    return [plain, plain_values, steps](const CudaStream& stream) { run_steps(*steps, stream); };
  }
  if (node.op == "matmul" || node.op == "quantized_matmul") {
    if (!matmul_) matmul_ = std::make_shared<CublasLtMatmul>();
    const TensorSpec& a = graph.value(node.inputs[0]).spec;
    const TensorSpec& out = graph.value(node.outputs[0]).spec;
    MatmulProblem problem;
    problem.dtype = out.dtype;
    std::uint64_t left_address = values[node.inputs[0]].address();
    std::uint64_t right_address = 0;
    DeviceStep dequantize;
    if (node.op == "matmul") {
      const TensorSpec& b = graph.value(node.inputs[1]).spec;
      problem.transpose_right = node.attributes.has("transpose_right") && node.attributes.get_int("transpose_right") != 0;
      problem.k = a.row_length();
      problem.n = out.row_length();
      const std::int64_t m = a.rank() >= 2 ? a.shape[a.shape.size() - 2] : 1;
      const std::int64_t batches = m * problem.k == 0 ? 0 : a.element_count() / (m * problem.k);
      if (b.rank() <= 2) {
        problem.m = m * batches;  // one shared right matrix: the batch folds into the rows
      } else {
        problem.m = m;
        problem.batch = batches;
        problem.a_batch_stride = m * problem.k;
        problem.b_batch_stride = problem.k * problem.n;
        problem.c_batch_stride = m * problem.n;
      }
      right_address = values[node.inputs[1]].address();
    } else {
      // Bind through this graph's parameters: the cached kernel may come from another graph
      // (a region graph) whose value ids differ.
      const GeneratedKernel generated = generate_dequantize_kernel(graph, node_id);
      const LoadedKernel& kernel = kernel_for(generated);
      // The weights (and the doubled x where they are split in hi and lo): buffers shared by the
      // dequantize launch and the matmul that reads them, and by the other quantized_matmul steps.
      std::vector<std::shared_ptr<DeviceBuffer>> scratch;
      KernelArguments arguments;
      for (const KernelParameter& parameter : generated.parameters) {
        if (parameter.kind == KernelParameter::Kind::scratch) {
          scratch.push_back(shared_scratch(scratch.size(), static_cast<std::size_t>(parameter.scratch_bytes)));
          arguments.add_pointer(*scratch.back());
        } else {
          arguments.add_pointer(values[parameter.value].address());
        }
      }
      const KernelLaunchShape shape = kernel.generated.launch;
      dequantize = [compiled = kernel.compiled, arguments, scratch, shape](const CudaStream& stream) {
        launch(compiled, Dim3{shape.grid_x, shape.grid_y, shape.grid_z}, Dim3{shape.block_x, 1, 1},
               shape.shared_memory_bytes, stream, arguments);
      };
      const bool split = a.dtype != DType::f32;  // generate_dequantize_kernel's hi and lo
      problem.transpose_right = true;
      problem.k = (split ? 2 : 1) * a.row_length();
      problem.n = out.row_length();
      problem.m = a.row_length() == 0 ? 0 : a.element_count() / a.row_length();
      right_address = scratch[0]->address();
      if (split) left_address = scratch[1]->address();
    }
    const std::uint64_t out_address = values[node.outputs[0]].address();
    return [matmul = matmul_, problem, left_address, right_address, out_address, dequantize](const CudaStream& stream) {
      if (dequantize) dequantize(stream);
      matmul->run(problem, left_address, right_address, out_address, stream);
    };
  }
  // Aliased outputs (alias_of): a reshape or a transpose of size-1 axes moves no byte, and a cache
  // written in place needs only its new rows.
  const bool shares_input_buffer = node.outputs.size() == 1 && values.shares_buffer(node.outputs[0], node.inputs[0]);
  if (shares_input_buffer && (node.op == "reshape" || node.op == "transpose")) {
    return [](const CudaStream&) {};
  }
  // Kernels are shared by source, and the same source arises from other graphs (a region cut out for
  // gating keeps the names, not the value ids): bind with the ids of this graph's generation.
  const GeneratedKernel generated = node.op == "kv_cache_write" && shares_input_buffer
                                        ? generate_kv_cache_write_kernel(graph, node_id, /*in_place=*/true)
                                        : generate_node_kernel(graph, node_id);
  std::vector<ValueId> ids;
  for (const KernelParameter& parameter : generated.parameters) ids.push_back(parameter.value);
  return bind_kernel(kernel_for(generated), values, ids);
}

std::shared_ptr<DeviceBuffer> NativeRuntime::shared_scratch(std::size_t slot, std::size_t bytes) {
  if (scratch_.size() <= slot) scratch_.resize(slot + 1);
  if (!scratch_[slot] || scratch_[slot]->size_bytes() < bytes) scratch_[slot] = std::make_shared<DeviceBuffer>(bytes);
  return scratch_[slot];
}

std::vector<DeviceStep> NativeRuntime::graph_steps(const ComputeGraph& graph, DeviceValues& values) {
  std::vector<DeviceStep> steps;
  for (const Node& node : graph.nodes()) steps.push_back(node_step(graph, node.id, values));
  return steps;
}

void run_steps(const std::vector<DeviceStep>& steps, const CudaStream& stream) {
  for (const DeviceStep& step : steps) step(stream);
}

DeviceStep native_nodes_step(const std::shared_ptr<NativeRuntime>& runtime, DeviceValues& values,
                             const std::vector<NodeId>& nodes) {
  auto steps = std::make_shared<std::vector<DeviceStep>>();
  for (NodeId id : nodes) steps->push_back(runtime->node_step(values.graph(), id, values));
  return DeviceStep([runtime, steps](const CudaStream& stream) { run_steps(*steps, stream); });
}

}  // namespace metile
