// Python bindings of the CPU reference backend: run(graph_or_plan, inputs) and
// random_inputs(graph, seed), speaking numpy arrays.
//
// dtypes cross the boundary exactly, without a silent cast: f16 <-> numpy float16,
// f32 <-> float32, i8/u8/i32/u32 <-> int8/uint8/int32/uint32 (bit-for-bit copies).
// numpy has no bfloat16, so a bf16 tensor travels as float32: inputs are rounded to
// bf16 (nearest even) on the way in, outputs are widened exactly on the way out.
// An array of another dtype is a TypeError, one of another shape a ValueError; both
// name the input and what was expected.
#include <pybind11/numpy.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "metile/cpu_runtime.h"
#include "metile/fusion.h"

namespace metile::python {
namespace {

// The numpy dtype a tensor of this dtype is handed over as.
py::dtype numpy_dtype(DType dtype) {
  switch (dtype) {
    case DType::f16:
      return py::dtype("float16");
    case DType::bf16:
      return py::dtype("float32");
    case DType::f32:
      return py::dtype("float32");
    case DType::i8:
      return py::dtype("int8");
    case DType::u8:
      return py::dtype("uint8");
    case DType::i32:
      return py::dtype("int32");
    case DType::u32:
      return py::dtype("uint32");
  }
  throw std::logic_error("numpy_dtype: unhandled dtype");
}

std::string shape_text(const py::array& array) {
  std::string text = "(";
  for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
    text += (axis > 0 ? ", " : "") + std::to_string(array.shape(axis));
  }
  if (array.ndim() == 1) text += ",";
  return text + ")";
}

HostTensor tensor_from_numpy(const std::string& name, const TensorSpec& spec, const py::handle& given_object) {
  const std::string where = "run: input '" + name + "' (" + spec.to_string() + ")";
  // A numpy scalar (np.float32(2.0)) is a value of its dtype: taken as the 0-d array it is, held to the
  // same dtype and shape rules (a Python float has no dtype of its own, and stays refused).
  py::object object = py::reinterpret_borrow<py::object>(given_object);
  const py::module_ numpy = py::module_::import("numpy");
  if (py::isinstance(object, numpy.attr("generic"))) object = numpy.attr("asarray")(object);
  if (!py::isinstance<py::array>(object)) {
    throw py::type_error(where + " must be a numpy array or numpy scalar, got " +
                         std::string(py::str(py::type::handle_of(object).attr("__name__"))));
  }
  // A masked array's mask says which values are not there; its data holds whatever lay under the mask,
  // which would be run as if given. The caller chooses: .filled(value) or .data.
  if (py::isinstance(object, py::module_::import("numpy.ma").attr("MaskedArray"))) {
    throw py::type_error(where + " is a masked array (numpy.ma): pass .filled(value), or .data for the values under "
                                 "its mask as they are");
  }
  const auto given = py::reinterpret_borrow<py::array>(object);
  const py::dtype expected = numpy_dtype(spec.dtype);
  if (!given.dtype().equal(expected)) {
    throw py::type_error(where + " must be a numpy " + std::string(py::str(py::object(expected))) + " array" +
                         (spec.dtype == DType::bf16 ? " (bf16 travels as float32, rounded to bf16)" : "") +
                         ", got " + std::string(py::str(py::object(given.dtype()))));
  }
  bool same_shape = given.ndim() == spec.rank();
  for (int axis = 0; same_shape && axis < spec.rank(); ++axis) {
    same_shape = given.shape(axis) == spec.shape[static_cast<std::size_t>(axis)];
  }
  if (!same_shape) throw py::value_error(where + " has shape " + shape_text(given));

  const py::array contiguous = py::array::ensure(given, py::array::c_style);
  HostTensor tensor(spec);
  std::span<std::byte> bytes = tensor.bytes();
  if (spec.dtype == DType::bf16) {
    const auto* values = static_cast<const float*>(contiguous.data());
    for (std::int64_t index = 0; index < spec.element_count(); ++index) {
      const std::uint16_t bits = f32_to_bf16_bits(values[index]);
      std::memcpy(bytes.data() + index * 2, &bits, sizeof bits);
    }
  } else {
    std::memcpy(bytes.data(), contiguous.data(), bytes.size());
  }
  return tensor;
}

py::array tensor_to_numpy(const HostTensor& tensor) {
  const TensorSpec& spec = tensor.spec();
  std::vector<py::ssize_t> shape(spec.shape.begin(), spec.shape.end());
  py::array array(numpy_dtype(spec.dtype), shape);
  std::span<const std::byte> bytes = tensor.bytes();
  if (spec.dtype == DType::bf16) {
    auto* values = static_cast<float*>(array.mutable_data());
    for (std::int64_t index = 0; index < spec.element_count(); ++index) {
      std::uint16_t bits = 0;
      std::memcpy(&bits, bytes.data() + index * 2, sizeof bits);
      values[index] = bf16_bits_to_f32(bits);
    }
  } else {
    std::memcpy(array.mutable_data(), bytes.data(), bytes.size());
  }
  return array;
}

py::dict tensors_to_numpy(const TensorMap& tensors) {
  py::dict arrays;
  for (const auto& [name, tensor] : tensors) arrays[py::str(name)] = tensor_to_numpy(tensor);
  return arrays;
}

// Converts the caller's arrays, checked against the graph's inputs. A name that is not
// an input is reported here (with the inputs there are); a missing input is reported by
// the C++ runtime, which owns that rule.
TensorMap tensors_from_numpy(const ComputeGraph& graph, const py::dict& inputs) {
  TensorMap tensors;
  for (const auto& [key, object] : inputs) {
    if (!py::isinstance<py::str>(key)) {
      throw py::type_error("run: inputs are keyed by input name (str), got " +
                           std::string(py::str(py::type::handle_of(key).attr("__name__"))) + " " +
                           std::string(py::repr(key)));
    }
    const std::string name = text_argument("run: an input name", key);
    try {
      check_is_graph_input(graph, name);
    } catch (const InputError& error) {
      throw py::value_error(std::string("run: ") + error.what());
    }
    tensors.emplace(name, tensor_from_numpy(name, graph.value(*graph.find_value(name)).spec, object));
  }
  return tensors;
}

// Refuses a graph whose tensors and the reference's working copies pass this machine's memory (as
// `metile run` does, naming the value or node: the reference asked for them and died of bad_alloc,
// or of the out-of-memory killer), converts the inputs, runs `execute` without the GIL (the arrays
// are copied by then) and converts the outputs back.
template <typename Execute>
py::dict run_on_cpu(const ComputeGraph& graph, const py::dict& inputs, Execute execute) {
  check_run_memory(graph, true);
  const TensorMap tensors = tensors_from_numpy(graph, inputs);
  TensorMap outputs;
  {
    py::gil_scoped_release release;
    outputs = execute(tensors);
  }
  return tensors_to_numpy(outputs);
}

}  // namespace

void bind_runtime(py::module_& module) {
  module.def(
      "run",
      [](const py::object& graph_or_plan, const py::object& given_inputs) {
        // A dict, or any mapping (MappingProxyType, a Mapping class) as one; anything else one line naming
        // the argument, not pybind11's dump of the overloads.
        py::dict inputs;
        if (py::isinstance<py::dict>(given_inputs)) {
          inputs = py::reinterpret_borrow<py::dict>(given_inputs);
        } else if (py::isinstance(given_inputs, py::module_::import("collections.abc").attr("Mapping"))) {
          inputs = py::dict(given_inputs);
        } else {
          throw py::type_error("run: inputs must be a dict of input name -> numpy array, got " +
                               python_type_name(given_inputs));
        }
        if (py::isinstance<FusionPlan>(graph_or_plan)) {
          const auto plan = graph_or_plan.cast<std::shared_ptr<FusionPlan>>();
          // Kernel by kernel as the plan groups the nodes, which also checks that the regions
          // can be scheduled with only their declared outputs visible.
          return run_on_cpu(*plan->graph, inputs,
                            [&](const TensorMap& tensors) { return run_plan_reference(*plan, tensors); });
        }
        if (py::isinstance<ComputeGraph>(graph_or_plan)) {
          const auto graph = graph_or_plan.cast<std::shared_ptr<ComputeGraph>>();
          return run_on_cpu(*graph, inputs,
                            [&](const TensorMap& tensors) { return run_reference(*graph, tensors); });
        }
        throw py::type_error("run: expected a ComputeGraph or a FusionPlan, got " +
                             std::string(py::str(py::type::handle_of(graph_or_plan).attr("__name__"))));
      },
      py::arg("graph_or_plan"), py::arg("inputs"),
      "Runs a ComputeGraph or a FusionPlan on the CPU reference backend. inputs maps every graph input's "
      "name to "
      "a numpy array of its shape and dtype (f16: float16, f32: float32, bf16: float32 rounded to bf16, "
      "integers: "
      "int8/uint8/int32/uint32); returns {output name: numpy array} in the same dtypes (bf16 as float32).");
  module.def(
      "random_inputs",
      [](const std::shared_ptr<ComputeGraph>& graph, const py::handle& seed) {
        return tensors_to_numpy(random_inputs(*graph, unsigned_argument("random_inputs: seed", seed)));  // True is not seed 1
      },
      py::arg("graph").none(false), py::arg("seed"),
      "Fresh seeded random inputs for every graph input (never zeros), as numpy arrays in run()'s dtypes. "
      "seed: an integer from 0 to 2^64 - 1 (as metile run --seed).");
}

}  // namespace metile::python
