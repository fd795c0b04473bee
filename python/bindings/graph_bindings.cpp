// Python bindings of the graph module: TensorSpec, GraphBuilder and the values it
// returns (ValueRef), ComputeGraph with read-only views of its values and nodes, and
// JSON/DOT graph files. Names mirror include/metile/graph.h; Python-only sugar (naming
// values after the caller's variables at build()) lives in python/metile/__init__.py.
//
// Every check of a graph's meaning (shapes, dtypes, names, values of another builder)
// is the C++ builder's: these bindings only translate Python types, so the messages a
// Python user sees are the ones the C++ API and the CLI print.
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstdint>
#include <filesystem>
#include <exception>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"

namespace metile::python {

py::list value_views(const std::shared_ptr<const ComputeGraph>& graph, const std::vector<ValueId>& ids) {
  py::list views;
  for (ValueId id : ids) views.append(GraphValueView{graph, id});
  return views;
}

py::list node_views(const std::shared_ptr<const ComputeGraph>& graph, const std::vector<NodeId>& ids) {
  py::list views;
  for (NodeId id : ids) views.append(GraphNodeView{graph, id});
  return views;
}

PyObject* message_text(std::string_view message) {
  const std::string spelled = control_bytes_spelled(message);
  return PyUnicode_DecodeUTF8(spelled.data(), static_cast<Py_ssize_t>(spelled.size()), "backslashreplace");
}

void warn_user(std::string_view message) {
  PyObject* text = message_text(message);
  if (text == nullptr) throw py::error_already_set();
  py::module_::import("warnings").attr("warn")(py::reinterpret_steal<py::str>(text), py::handle(PyExc_UserWarning), 1);
}

std::string python_type_name(const py::handle& object) {
  return py::str(py::type::handle_of(object).attr("__name__"));
}

std::string text_argument(const std::string& what, const py::handle& object) {
  if (!py::isinstance<py::str>(object)) {
    throw py::type_error(what + ": expected a str, got " + python_type_name(object));
  }
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(object.ptr(), &size);
  if (text == nullptr) {
    PyErr_Clear();
    throw py::value_error(what + ": " + std::string(py::str(py::repr(object))) +
                          " is not UTF-8 text (it holds a lone surrogate, as bytes decoded with surrogateescape do)");
  }
  return std::string(text, static_cast<std::size_t>(size));
}

bool is_boolean(const py::handle& object) {
  return py::isinstance<py::bool_>(object) || py::isinstance(object, py::module_::import("numpy").attr("bool_"));
}

bool boolean_argument(const std::string& what, const py::handle& object, std::string_view choices) {
  if (!is_boolean(object)) {
    throw py::type_error(what + " must be " + std::string(choices) + ", got " + python_type_name(object));
  }
  return PyObject_IsTrue(object.ptr()) == 1;
}

py::object python_number(const py::object& value) {
  const py::object module = py::type::handle_of(value).attr("__module__");
  if (!py::isinstance<py::str>(module) || module.cast<std::string>() != "numpy") return value;
  const py::module_ numpy = py::module_::import("numpy");
  if (py::isinstance(value, numpy.attr("integer"))) return py::int_(value.attr("__index__")());
  if (py::isinstance(value, numpy.attr("floating"))) return py::float_(value.attr("__float__")());
  return value;
}

namespace {

std::string python_repr(const py::handle& object) { return py::repr(object); }

// ---------------------------------------------------------------- attributes

// An int beyond int64 is a ValueError naming what it is for (pybind11 would say "Unable to cast").
std::int64_t attribute_integer(const std::string& what, const py::handle& object) {
  try {
    return object.cast<std::int64_t>();
  } catch (const py::cast_error&) {
    throw py::value_error(what + ": integer " + python_repr(object) + " does not fit in 64 bits");
  }
}

// An object with __index__ (an int, a numpy integer) as a Python int.
py::object python_index(const py::handle& object) {
  PyObject* index = PyNumber_Index(object.ptr());
  if (index == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(index);
}

// An object with __index__ as an int64 (attribute_integer's ValueError).
std::int64_t index_as_int64(const std::string& what, const py::handle& object) {
  return attribute_integer(what, python_index(object));
}

// A numpy array, even of one element: its __index__ exists (and raises "only integer scalar arrays can
// be converted to a scalar index" for a float array), so PyIndex_Check alone let it through.
bool is_numpy_array(const py::handle& object) {
  const py::handle type = py::type::handle_of(object);
  return py::str(type.attr("__module__")).cast<std::string>() == "numpy" &&
         py::str(type.attr("__name__")).cast<std::string>() == "ndarray";
}

void require_integer(const std::string& what, const py::handle& object) {
  if (is_boolean(object) || is_numpy_array(object) || !PyIndex_Check(object.ptr())) {
    throw py::type_error(what + " must be an integer, got " + python_type_name(object));
  }
}

}  // namespace

std::int64_t integer_argument(const std::string& what, const py::handle& object) {
  require_integer(what, object);
  return index_as_int64(what, object);
}

double real_argument(const std::string& what, const py::handle& object) {
  const py::object number = python_number(py::reinterpret_borrow<py::object>(object));
  if (py::isinstance<py::float_>(number)) return number.cast<double>();
  if (is_boolean(object) || is_numpy_array(object) || !PyIndex_Check(number.ptr())) {
    throw py::type_error(what + " must be a number, got " + python_type_name(object));
  }
  return static_cast<double>(integer_argument(what, number));
}

std::uint64_t unsigned_argument(const std::string& what, const py::handle& object) {
  require_integer(what, object);
  const py::object value = python_index(object);
  try {
    if (value < py::int_(0)) throw py::cast_error();
    return value.cast<std::uint64_t>();
  } catch (const py::cast_error&) {
    throw py::value_error(what + ": " + python_repr(value) + " is not an integer from 0 to 2^64 - 1");
  }
}

namespace {

// A flag as the JSON reader and add_node take it: True/False (numpy's too) or the integers 0 and 1.
// pybind11's bool took anything truthy (2, 0.5) and None as False.
bool flag_argument(const std::string& what, const py::handle& object) {
  if (is_boolean(object)) return object.cast<bool>();
  const std::int64_t value = integer_argument(what, object);
  if (value != 0 && value != 1) throw py::value_error(what + " must be 0 or 1, got " + std::to_string(value));
  return value == 1;
}

// A sequence of ints (a shape, a permutation, a list attribute) for `what` ("attribute 'perm'",
// "TensorSpec shape"): bool, an int to Python, is refused as the JSON reader refuses true; numpy
// integers are ints. TypeError for anything else, ValueError past 64 bits.
std::vector<std::int64_t> integer_list(const std::string& what, const py::handle& object) {
  // Any sequence (list, tuple, range, a numpy array) but text.
  if (!py::isinstance<py::sequence>(object) || py::isinstance<py::str>(object) || py::isinstance<py::bytes>(object) ||
      py::isinstance<py::bytearray>(object)) {
    throw py::type_error(what + ": expected a list or tuple of ints, got " + python_type_name(object));
  }
  std::vector<std::int64_t> integers;
  for (const py::handle& item : object) {
    // An array inside the list (a 2-D array's rows, np.array(2.0)) is refused as the scalar arguments refuse
    // one: numpy's own TypeError named neither the argument nor the item.
    if (is_boolean(item) || is_numpy_array(item) || !PyIndex_Check(item.ptr())) {
      throw py::type_error(what + ": a list of ints, got " + python_type_name(item) + " " + python_repr(item));
    }
    integers.push_back(index_as_int64(what, item));
  }
  return integers;
}

// Python values for attributes: int, and bool for the flag (is_flag_attribute; a bool elsewhere is a
// TypeError, as `"axis": true` is an error in a graph file) -> integer, float -> double, str -> string,
// a list or tuple of ints -> integer list; numpy's bool, integer and floating scalars as the Python
// bool, int and float they hold (as in a shape, or softmax's axis). Anything else is a TypeError
// naming the attribute.
AttributeValue attribute_from_python(const std::string& name, const py::handle& given) {
  if (is_boolean(given)) {
    if (!is_flag_attribute(name)) throw py::type_error("attribute " + flag_refusal(name));
    return static_cast<std::int64_t>(PyObject_IsTrue(given.ptr()) == 1);
  }
  const py::object object = python_number(py::reinterpret_borrow<py::object>(given));
  if (py::isinstance<py::int_>(object)) return attribute_integer("attribute '" + name + "'", object);
  if (py::isinstance<py::float_>(object)) return object.cast<double>();
  if (py::isinstance<py::str>(object)) return text_argument("attribute '" + name + "'", object);
  if (py::isinstance<py::list>(object) || py::isinstance<py::tuple>(object)) {
    return integer_list("attribute '" + name + "'", object);
  }
  throw py::type_error("attribute '" + name + "': expected int, float, str or a list of ints, got " +
                       python_type_name(object));
}

Attributes attributes_from_python(const py::dict& dictionary) {
  Attributes attributes;
  for (const auto& [key, value] : dictionary) {
    if (!py::isinstance<py::str>(key)) {
      throw py::type_error("attribute names are str, got " + python_type_name(key) + " " + python_repr(key));
    }
    const std::string name = text_argument("an attribute name", key);
    attributes.set(name, attribute_from_python(name, value));
  }
  return attributes;
}

py::object attribute_to_python(const AttributeValue& value) {
  return std::visit([](const auto& held) -> py::object { return py::cast(held); }, value);
}

py::dict attributes_to_python(const Attributes& attributes) {
  py::dict dictionary;
  for (const auto& [name, value] : attributes.entries())
    dictionary[py::str(name)] = attribute_to_python(value);
  return dictionary;
}

// ---------------------------------------------------------------- text forms

std::string shape_tuple_text(const std::vector<std::int64_t>& shape) {
  std::string text = "(";
  for (std::size_t index = 0; index < shape.size(); ++index) {
    if (index > 0) text += ", ";
    text += std::to_string(shape[index]);
  }
  if (shape.size() == 1) text += ",";
  return text + ")";
}

std::string tensor_spec_repr(const TensorSpec& spec) {
  return "TensorSpec(" + shape_tuple_text(spec.shape) + ", '" + std::string(dtype_name(spec.dtype)) + "')";
}

std::string attribute_text(const AttributeValue& value) {
  return std::visit(
      [](const auto& held) -> std::string {
        using Held = std::decay_t<decltype(held)>;
        if constexpr (std::is_same_v<Held, std::string>) {
          return "'" + held + "'";
        } else if constexpr (std::is_same_v<Held, std::vector<std::int64_t>>) {
          std::string text = "[";
          for (std::size_t index = 0; index < held.size(); ++index) {
            text += (index > 0 ? ", " : "") + std::to_string(held[index]);
          }
          return text + "]";
        } else if constexpr (std::is_same_v<Held, double>) {
          std::ostringstream stream;
          stream << held;
          return stream.str();
        } else {
          return std::to_string(held);
        }
      },
      value);
}

// "Node(normalized = rms_norm(summed, weight), eps=1e-05)"
std::string node_repr(const ComputeGraph& graph, const Node& node) {
  std::string text = "Node(";
  for (std::size_t index = 0; index < node.outputs.size(); ++index) {
    text += (index > 0 ? ", " : "") + graph.value(node.outputs[index]).name;
  }
  text += " = " + node.op + "(";
  for (std::size_t index = 0; index < node.inputs.size(); ++index) {
    text += (index > 0 ? ", " : "") + graph.value(node.inputs[index]).name;
  }
  text += ")";
  for (const auto& [name, value] : node.attributes.entries())
    text += ", " + name + "=" + attribute_text(value);
  return text + ")";
}

std::string graph_repr(const ComputeGraph& graph) {
  std::string text = "ComputeGraph(inputs=[";
  for (std::size_t index = 0; index < graph.inputs().size(); ++index) {
    text += (index > 0 ? ", " : "") + graph.value(graph.inputs()[index]).name;
  }
  text += "], nodes=" + std::to_string(graph.nodes().size()) + ", outputs=[";
  for (std::size_t index = 0; index < graph.outputs().size(); ++index) {
    text += (index > 0 ? ", " : "") + graph.value(graph.outputs()[index]).name;
  }
  return text + "])";
}

// ---------------------------------------------------------------- builder helpers

using BuilderPointer = std::shared_ptr<PythonGraphBuilder>;
using OptionalName = std::optional<Utf8Text>;

// Records what an op returned; values the builder named itself are remembered so
// that the Python layer may rename them after the caller's variables.
BoundValue record(const BuilderPointer& self, ValueRef ref, const OptionalName& name) {
  if (!name || name->value.empty()) {
    self->auto_named.push_back(ref);
    self->auto_named_by_name[self->builder.name(ref)] = ref;
  }
  return BoundValue{ref, self};
}

// Renames a value of the builder, keeping auto_named_by_name in step (an invented name renamed this
// way stays invented: auto_named still holds the value).
void rename_value(const BuilderPointer& self, ValueRef value, const std::string& name) {
  const std::string old_name = self->builder.name(value);
  self->builder.rename(value, name);
  const auto invented = self->auto_named_by_name.find(old_name);
  if (invented == self->auto_named_by_name.end() || invented->second.id != value.id) return;
  self->auto_named_by_name.erase(invented);
  self->auto_named_by_name[name] = value;
}

// A name the caller gives an op, an input or a rename. It takes precedence over a name the builder
// invented, a placeholder until build() names it after the caller's variable: the placeholder moves
// aside (to the name with "_N" appended), so that `b.exp(x)` then `b.silu(x, name="exp_0")` records
// both (it was refused as a duplicate of a name the caller never wrote, nor would find in the built
// graph). Should the call fail, the placeholder gets its name back when this temporary goes: it lives
// to the end of the call's full expression, and std::uncaught_exceptions tells the two apart.
class ClaimedName {
 public:
  ClaimedName(const BuilderPointer& self, std::string name) : self_(self), name_(std::move(name)) {
    const auto invented = name_.empty() ? self_->auto_named_by_name.end() : self_->auto_named_by_name.find(name_);
    if (invented == self_->auto_named_by_name.end()) return;
    const ValueRef placeholder = invented->second;
    for (int suffix = 0;; ++suffix) {
      try {
        rename_value(self_, placeholder, name_ + "_" + std::to_string(suffix));
        moved_ = placeholder;
        return;
      } catch (const InputError&) {
        // that name is taken too
      }
    }
  }
  ~ClaimedName() {
    if (!moved_ || std::uncaught_exceptions() <= exceptions_) return;
    try {
      rename_value(self_, *moved_, name_);
    } catch (...) {
      // the failed call kept the name: the placeholder keeps its new one
    }
  }
  ClaimedName(const ClaimedName&) = delete;
  ClaimedName& operator=(const ClaimedName&) = delete;
  operator std::string() const { return name_; }  // where the builder takes the name

 private:
  BuilderPointer self_;
  std::string name_;
  std::optional<ValueRef> moved_;
  int exceptions_ = std::uncaught_exceptions();
};

ClaimedName name_or_empty(const BuilderPointer& self, const OptionalName& name) {
  return ClaimedName(self, name ? name->value : std::string());
}

// Records `op` with these attributes through add_node, as the C++ typed methods do, so that each
// attribute is checked by the op itself ("bits must be 4 or 8, got 4294967300"). The typed methods
// read their numbers with real_argument and integer_argument: pybind11's own casters gave a multi-line
// TypeError with a signature dump for an int past 64 bits, and narrowed bits = 2**32 + 4 to 4.
BoundValue record_op(const BuilderPointer& self, const char* op, std::vector<ValueRef> inputs,
                     std::initializer_list<std::pair<const char*, AttributeValue>> attributes, const OptionalName& name) {
  Attributes recorded;
  for (const auto& [attribute, value] : attributes) recorded.set(attribute, value);
  return record(self, self->builder.add_node(op, std::move(inputs), std::move(recorded), name_or_empty(self, name)).front(), name);
}

std::vector<ValueRef> refs_of(const std::vector<BoundValue>& values) {
  std::vector<ValueRef> refs;
  refs.reserve(values.size());
  for (const BoundValue& value : values) refs.push_back(value.ref);
  return refs;
}

std::vector<ValueId> all_ids(std::size_t count) {
  std::vector<ValueId> ids(count);
  for (std::size_t index = 0; index < count; ++index) ids[index] = static_cast<ValueId>(index);
  return ids;
}

void bind_tensor_spec(py::module_& module) {
  py::class_<TensorSpec>(module, "TensorSpec",
                         "A tensor's static shape and dtype: TensorSpec((1, 2048), \"f16\"). dtype is one of "
                         "f16, bf16, f32, i8, u8, i32, u32.")
      .def(py::init([](const py::object& shape, const Utf8Text& dtype) {
             TensorSpec spec(integer_list("TensorSpec shape", shape), parse_dtype(dtype.value));
             check_tensor_spec(spec, "TensorSpec");
             return spec;
           }),
           py::arg("shape"), py::arg("dtype"))
      .def_property_readonly("shape", [](const TensorSpec& spec) { return py::tuple(py::cast(spec.shape)); })
      .def_property_readonly("dtype",
                             [](const TensorSpec& spec) { return std::string(dtype_name(spec.dtype)); })
      .def_property_readonly("rank", &TensorSpec::rank)
      .def_property_readonly("element_count", &TensorSpec::element_count)
      .def_property_readonly("bytes", &TensorSpec::bytes)
      .def("__str__", &TensorSpec::to_string)
      .def("__repr__", &tensor_spec_repr)
      .def(
          "__eq__", [](const TensorSpec& spec, const TensorSpec& other) { return spec == other; },
          py::is_operator())
      .def("__hash__", [](const TensorSpec& spec) {
        return py::hash(py::make_tuple(py::tuple(py::cast(spec.shape)), std::string(dtype_name(spec.dtype))));
      });
}

void bind_value_ref(py::module_& module) {
  py::class_<BoundValue>(module, "ValueRef",
                         "A value recorded by a GraphBuilder; pass it to that builder's ops and build().")
      .def_property_readonly("name",
                             [](const BoundValue& value) { return value.owner->builder.name(value.ref); })
      .def_property_readonly("spec",
                             [](const BoundValue& value) { return value.owner->builder.spec(value.ref); })
      .def_property_readonly("id", [](const BoundValue& value) { return value.ref.id; })
      .def("__repr__",
           [](const BoundValue& value) {
             return "ValueRef('" + value.owner->builder.name(value.ref) + "', " +
                    value.owner->builder.spec(value.ref).to_string() + ")";
           })
      .def(
          "__eq__",
          [](const BoundValue& value, const BoundValue& other) {
            return value.owner == other.owner && value.ref == other.ref;
          },
          py::is_operator())
      .def("__hash__", [](const BoundValue& value) {
        return py::hash(py::make_tuple(reinterpret_cast<std::uintptr_t>(value.owner.get()), value.ref.id));
      });
}

// Every op of the op table without a hand-written method above gets one, so an op added to the
// table is recorded from Python too: builder.<op>(*inputs, name=None, **attributes), one output.
void bind_table_ops(py::class_<PythonGraphBuilder, BuilderPointer>& builder) {
  for (std::string_view op_name : registered_op_names()) {
    const std::string op(op_name);
    if (py::hasattr(builder, op.c_str())) continue;
    builder.def(
        op.c_str(),
        [op](const BuilderPointer& self, py::args inputs, py::kwargs keywords) {
          // Wrong types are TypeErrors naming the op and the argument, not pybind11's "Unable to cast".
          std::vector<ValueRef> refs;
          for (std::size_t position = 0; position < inputs.size(); ++position) {
            const py::handle input = inputs[position];
            if (!py::isinstance<BoundValue>(input)) {
              throw py::type_error(op + ": input " + std::to_string(position) + " must be a ValueRef, got " +
                                   python_type_name(input) + " " + python_repr(input));
            }
            refs.push_back(input.cast<BoundValue>().ref);
          }
          OptionalName name;
          py::dict attributes;
          for (const auto& [key, value] : keywords) {
            if (text_argument(op + ": a keyword", key) == "name") {
              if (!value.is_none() && !py::isinstance<py::str>(value)) {
                throw py::type_error(op + ": name must be a str or None, got " + python_type_name(value));
              }
              if (!value.is_none()) name = Utf8Text{text_argument(op + ": name", value)};
            } else {
              attributes[key] = value;
            }
          }
          const std::vector<ValueRef> outputs =
              self->builder.add_node(op, std::move(refs), attributes_from_python(attributes), name_or_empty(self, name));
          return record(self, outputs.front(), name);
        },
        ("Records a '" + op + "' node (the op table): inputs positionally, attributes as keywords.").c_str());
  }
}

void bind_graph_builder(py::module_& module) {
  const auto name_argument = py::arg("name") = py::none();
  py::class_<PythonGraphBuilder, BuilderPointer> builder(
      module, "GraphBuilder",
      "Records tensor ops without choosing kernel boundaries; build(outputs) returns a verified "
      "ComputeGraph. "
      "Every op checks its inputs and raises ValueError naming the node.");
  builder.def(py::init<>())
      .def(
          "input",
          [](const BuilderPointer& self, Utf8Text name, const TensorSpec& spec) {
            return BoundValue{self->builder.input(ClaimedName(self, std::move(name.value)), spec), self};
          },
          py::arg("name"), py::arg("spec"))
      .def(
          "add",
          [](const BuilderPointer& self, const BoundValue& a, const BoundValue& b, const OptionalName& name) {
            return record(self, self->builder.add(a.ref, b.ref, name_or_empty(self, name)), name);
          },
          py::arg("a"), py::arg("b"), name_argument)
      .def(
          "subtract",
          [](const BuilderPointer& self, const BoundValue& a, const BoundValue& b, const OptionalName& name) {
            return record(self, self->builder.subtract(a.ref, b.ref, name_or_empty(self, name)), name);
          },
          py::arg("a"), py::arg("b"), name_argument)
      .def(
          "multiply",
          [](const BuilderPointer& self, const BoundValue& a, const BoundValue& b, const OptionalName& name) {
            return record(self, self->builder.multiply(a.ref, b.ref, name_or_empty(self, name)), name);
          },
          py::arg("a"), py::arg("b"), name_argument)
      .def(
          "scale",
          [](const BuilderPointer& self, const BoundValue& x, const py::object& factor, const OptionalName& name) {
            return record_op(self, "scale", {x.ref}, {{"factor", real_argument("factor", factor)}}, name);
          },
          py::arg("x"), py::arg("factor"), name_argument)
      .def(
          "silu",
          [](const BuilderPointer& self, const BoundValue& x, const OptionalName& name) {
            return record(self, self->builder.silu(x.ref, name_or_empty(self, name)), name);
          },
          py::arg("x"), name_argument)
      .def(
          "gelu",
          [](const BuilderPointer& self, const BoundValue& x, Utf8Text approximate,
             const OptionalName& name) {
            return record(self, self->builder.gelu(x.ref, std::move(approximate.value), name_or_empty(self, name)), name);
          },
          py::arg("x"), py::arg("approximate") = "none", name_argument)
      .def(
          "exp",
          [](const BuilderPointer& self, const BoundValue& x, const OptionalName& name) {
            return record(self, self->builder.exp(x.ref, name_or_empty(self, name)), name);
          },
          py::arg("x"), name_argument)
      .def(
          "rms_norm",
          [](const BuilderPointer& self, const BoundValue& x, const BoundValue& weight, const py::object& eps,
             const OptionalName& name) {
            return record_op(self, "rms_norm", {x.ref, weight.ref}, {{"eps", real_argument("eps", eps)}}, name);
          },
          py::arg("x"), py::arg("weight"), py::arg("eps"), name_argument)
      .def(
          "layer_norm",
          [](const BuilderPointer& self, const BoundValue& x, const BoundValue& weight,
             const BoundValue& bias, const py::object& eps, const OptionalName& name) {
            return record_op(self, "layer_norm", {x.ref, weight.ref, bias.ref}, {{"eps", real_argument("eps", eps)}},
                             name);
          },
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"), name_argument)
      .def(
          "softmax",
          [](const BuilderPointer& self, const BoundValue& x, const py::object& axis, const OptionalName& name) {
            return record_op(self, "softmax", {x.ref}, {{"axis", integer_argument("axis", axis)}}, name);
          },
          py::arg("x"), py::arg("axis") = -1, name_argument)
      .def(
          "causal_mask",
          [](const BuilderPointer& self, const BoundValue& x, const py::object& offset, const OptionalName& name) {
            return record_op(self, "causal_mask", {x.ref}, {{"offset", integer_argument("offset", offset)}}, name);
          },
          py::arg("x"), py::arg("offset") = 0, name_argument)
      .def(
          "position_mask",
          [](const BuilderPointer& self, const BoundValue& x, const BoundValue& positions, const OptionalName& name) {
            return record(self, self->builder.position_mask(x.ref, positions.ref, name_or_empty(self, name)), name);
          },
          py::arg("x"), py::arg("positions"), name_argument)
      .def(
          "matmul",
          [](const BuilderPointer& self, const BoundValue& a, const BoundValue& b, const py::object& transpose_right,
             const OptionalName& name) {
            const bool transposed = flag_argument("transpose_right", transpose_right);
            return record(self, self->builder.matmul(a.ref, b.ref, transposed, name_or_empty(self, name)), name);
          },
          py::arg("a"), py::arg("b"), py::arg("transpose_right") = false, name_argument)
      .def(
          "quantized_matmul",
          [](const BuilderPointer& self, const BoundValue& x, const BoundValue& packed,
             const BoundValue& scales, const BoundValue& biases, const py::object& bits, const py::object& group_size,
             const OptionalName& name) {
            return record_op(self, "quantized_matmul", {x.ref, packed.ref, scales.ref, biases.ref},
                             {{"bits", integer_argument("bits", bits)},
                              {"group_size", integer_argument("group_size", group_size)}},
                             name);
          },
          py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("biases"), py::arg("bits"),
          py::arg("group_size"), name_argument)
      .def(
          "rope",
          [](const BuilderPointer& self, const BoundValue& x, const BoundValue& positions, const py::object& theta,
             const py::object& dims, const OptionalName& name) {
            return record_op(self, "rope", {x.ref, positions.ref},
                             {{"theta", real_argument("theta", theta)}, {"dims", integer_argument("dims", dims)}},
                             name);
          },
          py::arg("x"), py::arg("positions"), py::arg("theta"), py::arg("dims"), name_argument)
      .def(
          "reshape",
          [](const BuilderPointer& self, const BoundValue& x, const py::object& shape, const OptionalName& name) {
            return record(self, self->builder.reshape(x.ref, integer_list("reshape shape", shape), name_or_empty(self, name)), name);
          },
          py::arg("x"), py::arg("shape"), name_argument)
      .def(
          "transpose",
          [](const BuilderPointer& self, const BoundValue& x, const py::object& perm, const OptionalName& name) {
            return record(self, self->builder.transpose(x.ref, integer_list("transpose perm", perm), name_or_empty(self, name)), name);
          },
          py::arg("x"), py::arg("perm"), name_argument)
      .def(
          "cast",
          [](const BuilderPointer& self, const BoundValue& x, const Utf8Text& dtype,
             const OptionalName& name) {
            return record(self, self->builder.cast(x.ref, parse_dtype(dtype.value), name_or_empty(self, name)), name);
          },
          py::arg("x"), py::arg("dtype"), name_argument)
      .def(
          "add_node",
          [](const BuilderPointer& self, const Utf8Text& op, const std::vector<BoundValue>& inputs,
             const std::optional<py::dict>& attributes, const OptionalName& name) {
            const std::vector<ValueRef> outputs = self->builder.add_node(
                op.value, refs_of(inputs), attributes ? attributes_from_python(*attributes) : Attributes{},
                name_or_empty(self, name));
            py::list values;
            for (ValueRef output : outputs) values.append(record(self, output, name));
            return values;
          },
          py::arg("op"), py::arg("inputs"), py::arg("attributes") = py::none(), name_argument,
          "Records any registered op by name (the JSON graph vocabulary); returns the list of its output "
          "values.")
      .def(
          "rename",
          [](const BuilderPointer& self, const BoundValue& value, Utf8Text name) {
            rename_value(self, value.ref, ClaimedName(self, std::move(name.value)));
            self->auto_named_by_name.erase(self->builder.name(value.ref));
            std::erase(self->auto_named, value.ref);
          },
          py::arg("value"), py::arg("name"),
          "Renames a value (and its node, for single-output nodes) before build(); ValueError on a name "
          "taken by a value the caller named (one the builder invented moves aside).")
      .def(
          "spec",
          [](const BuilderPointer& self, const BoundValue& value) { return self->builder.spec(value.ref); },
          py::arg("value"))
      .def(
          "name",
          [](const BuilderPointer& self, const BoundValue& value) { return self->builder.name(value.ref); },
          py::arg("value"), "The value's current name (an invented one until build() or rename()).")
      .def(
          "_auto_named_values",
          [](const BuilderPointer& self) {
            py::list values;
            for (ValueRef ref : self->auto_named) values.append(BoundValue{ref, self});
            return values;
          },
          "The values whose names the builder invented (op name + counter), oldest first.")
      .def(
          "_build",
          [](const BuilderPointer& self, const std::vector<BoundValue>& outputs) {
            return std::make_shared<ComputeGraph>(self->builder.build(refs_of(outputs)));
          },
          py::arg("outputs"), "build() without naming values after the caller's variables.");
  bind_table_ops(builder);
}

void bind_graph_views(py::module_& module) {
  py::class_<GraphValueView>(module, "Value", "A value of a ComputeGraph (read-only): name, spec, producer.")
      .def_property_readonly("name",
                             [](const GraphValueView& view) { return view.graph->value(view.id).name; })
      .def_property_readonly("spec",
                             [](const GraphValueView& view) { return view.graph->value(view.id).spec; })
      .def_property_readonly("id", [](const GraphValueView& view) { return view.id; })
      .def_property_readonly(
          "producer",
          [](const GraphValueView& view) -> py::object {
            const NodeId producer = view.graph->value(view.id).producer;
            if (producer < 0) return py::none();
            return py::cast(GraphNodeView{view.graph, producer});
          },
          "The node that computes this value, or None for a graph input.")
      .def_property_readonly(
          "consumers",
          [](const GraphValueView& view) { return node_views(view.graph, view.graph->consumers(view.id)); })
      .def_property_readonly("is_output",
                             [](const GraphValueView& view) { return view.graph->is_output(view.id); })
      .def("__repr__",
           [](const GraphValueView& view) {
             const Value& value = view.graph->value(view.id);
             return "Value('" + value.name + "', " + value.spec.to_string() + ")";
           })
      .def(
          "__eq__",
          [](const GraphValueView& view, const GraphValueView& other) {
            return view.graph == other.graph && view.id == other.id;
          },
          py::is_operator())
      .def("__hash__", [](const GraphValueView& view) {
        return py::hash(py::make_tuple(reinterpret_cast<std::uintptr_t>(view.graph.get()), view.id));
      });

  py::class_<GraphNodeView>(module, "Node", "A node of a ComputeGraph (read-only): one op applied to values.")
      .def_property_readonly("name", [](const GraphNodeView& view) { return view.graph->node(view.id).name; })
      .def_property_readonly("op", [](const GraphNodeView& view) { return view.graph->node(view.id).op; })
      .def_property_readonly(
          "kind", [](const GraphNodeView& view) { return view.graph->node(view.id).kind; },
          "elementwise, row_reduction, contraction or layout: what the planner reasons about.")
      .def_property_readonly("id", [](const GraphNodeView& view) { return view.id; })
      .def_property_readonly(
          "inputs",
          [](const GraphNodeView& view) { return value_views(view.graph, view.graph->node(view.id).inputs); })
      .def_property_readonly("outputs",
                             [](const GraphNodeView& view) {
                               return value_views(view.graph, view.graph->node(view.id).outputs);
                             })
      .def_property_readonly("attributes",
                             [](const GraphNodeView& view) {
                               return attributes_to_python(view.graph->node(view.id).attributes);
                             })
      .def("__repr__",
           [](const GraphNodeView& view) { return node_repr(*view.graph, view.graph->node(view.id)); })
      .def(
          "__eq__",
          [](const GraphNodeView& view, const GraphNodeView& other) {
            return view.graph == other.graph && view.id == other.id;
          },
          py::is_operator())
      .def("__hash__", [](const GraphNodeView& view) {
        return py::hash(py::make_tuple(reinterpret_cast<std::uintptr_t>(view.graph.get()), view.id));
      });
}

void bind_compute_graph(py::module_& module) {
  using GraphPointer = std::shared_ptr<ComputeGraph>;
  py::class_<ComputeGraph, GraphPointer>(
      module, "ComputeGraph",
      "A verified, immutable tensor graph; nodes are in topological order. Build one with GraphBuilder or "
      "ComputeGraph.from_json.")
      .def_property_readonly("inputs",
                             [](const GraphPointer& graph) { return value_views(graph, graph->inputs()); })
      .def_property_readonly("outputs",
                             [](const GraphPointer& graph) { return value_views(graph, graph->outputs()); })
      .def_property_readonly(
          "nodes",
          [](const GraphPointer& graph) { return node_views(graph, all_ids(graph->nodes().size())); })
      .def_property_readonly(
          "values",
          [](const GraphPointer& graph) { return value_views(graph, all_ids(graph->values().size())); })
      .def(
          "find_value",
          [](const GraphPointer& graph, const Utf8Text& name) -> py::object {
            const std::optional<ValueId> id = graph->find_value(name.value);
            if (!id) return py::none();
            return py::cast(GraphValueView{graph, *id});
          },
          py::arg("name"), "The value with this name, or None.")
      .def(
          "find_node",
          [](const GraphPointer& graph, const Utf8Text& name) -> py::object {
            const std::optional<NodeId> id = graph->find_node(name.value);
            if (!id) return py::none();
            return py::cast(GraphNodeView{graph, *id});
          },
          py::arg("name"), "The node with this name, or None.")
      .def(
          "to_json", [](const ComputeGraph& graph) { return write_graph_json(graph); },
          "The graph as a JSON graph file (the format `metile plan` and `metile run` read).")
      .def_static(
          "from_json",
          [](const Utf8Text& text, const Utf8Text& source_name) {
            return std::make_shared<ComputeGraph>(parse_graph_json(text.value, source_name.value));
          },
          py::arg("text"), py::arg("source_name") = "<string>",
          "Parses a JSON graph; ValueError names the source and the JSON path of a mistake.")
      .def(
          "to_dot", [](const ComputeGraph& graph) { return graph_to_dot(graph); }, "Graphviz DOT text.")
      .def(
          "__eq__", [](const ComputeGraph& graph, const ComputeGraph& other) { return graph == other; },
          py::is_operator())
      .def("__repr__", &graph_repr);
  // Graphs are immutable but compare by content, so they are not hashable (like a frozen list would be).
  module.attr("ComputeGraph").attr("__hash__") = py::none();

  module.def(
      "read_graph",
      [](const FilePath& path) {
        // Read without the GIL: a FIFO blocks until its writer writes, and a writer that is a Python thread
        // of this process could not run while we held it (the read never ended).
        py::gil_scoped_release release;
        return std::make_shared<ComputeGraph>(read_graph(path.value));
      },
      py::arg("path"), "Reads a JSON graph file; ValueError names the file and the JSON path of a mistake.");
}

}  // namespace

void bind_graph(py::module_& module) {
  py::list dtype_names;
  for (int dtype = 0; dtype <= static_cast<int>(DType::u32); ++dtype) {
    dtype_names.append(std::string(dtype_name(static_cast<DType>(dtype))));
  }
  module.attr("DTYPES") = py::tuple(dtype_names);
  // Classes before the functions that return them, so signatures in docstrings and
  // TypeErrors read `ComputeGraph`, not the C++ name.
  bind_tensor_spec(module);
  bind_graph_views(module);
  bind_compute_graph(module);
  bind_value_ref(module);
  bind_graph_builder(module);
}

}  // namespace metile::python
