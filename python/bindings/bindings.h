// The pieces of the `_metile` extension, one file per metile module, and the few
// helpers they share. Each bind_* function adds its module's classes and functions
// to the extension; module.cpp calls them in data-flow order (graph first), so a
// later module's signatures can name an earlier module's classes.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl/filesystem.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "metile/graph.h"

namespace metile::python {

namespace py = pybind11;

void bind_graph(py::module_& module);
void bind_flow(py::module_& module);
void bind_fusion(py::module_& module);
void bind_runtime(py::module_& module);
void bind_model(py::module_& module);

// A GraphBuilder as Python holds it: the C++ builder plus the values whose names it
// invented (the Python layer renames those after the caller's variables at build()), oldest
// first, and the same by their current name (a name the caller gives moves one aside).
struct PythonGraphBuilder {
  GraphBuilder builder;
  std::vector<ValueRef> auto_named;
  std::unordered_map<std::string, ValueRef> auto_named_by_name;
};

// What a GraphBuilder method returns to Python: the C++ handle plus the builder it
// came from, kept alive so that `value.name` and `value.spec` work on their own.
struct BoundValue {
  ValueRef ref;
  std::shared_ptr<PythonGraphBuilder> owner;
};

// A graph value or node as Python sees it: the graph (kept alive) and an id.
struct GraphValueView {
  std::shared_ptr<const ComputeGraph> graph;
  ValueId id = -1;
};
struct GraphNodeView {
  std::shared_ptr<const ComputeGraph> graph;
  NodeId id = -1;
};

// A message as Python text (a new reference, nullptr only where Python is out of memory): control bytes
// spelled \xNN as the CLI prints them (an escape sequence quoted from a file would reach the terminal, a
// newline would forge a line), bytes that are not UTF-8 (a path, a file's bytes) as \xNN escapes.
PyObject* message_text(std::string_view message);
// A UserWarning (where warnings are errors it raises: py::error_already_set), attributed to the caller's line.
void warn_user(std::string_view message);

// Its type's name, for messages ("got bool").
std::string python_type_name(const py::handle& object);
// Python's bool or numpy's bool_: an int to Python, but never a count, a bit or a seed.
bool is_boolean(const py::handle& object);
// A yes or no argument: True or False (Python's or numpy's); 1 or "no" is a TypeError saying what it
// must be (`choices`: where None is taken too, the caller's, before it asks).
bool boolean_argument(const std::string& what, const py::handle& object, std::string_view choices = "True or False");

// numpy integer and floating scalars as the Python int and float they hold (numpy.float64 is a
// float already); anything else unchanged, for the caller's checks. numpy is only imported when
// the value is one of its objects.
py::object python_number(const py::object& value);

// One integer argument (`what` names it): an int or a numpy integer; bool (Python's or numpy's), an
// int to Python, is a TypeError (True is not 1 token or 1 bit), as is anything else; ValueError past
// 64 bits.
std::int64_t integer_argument(const std::string& what, const py::handle& object);
// The same for an unsigned 64-bit argument (a seed): ValueError below 0 or past 2^64 - 1.
std::uint64_t unsigned_argument(const std::string& what, const py::handle& object);
// One real argument as a double: a float, or an integer as integer_argument takes it (its ValueError
// past 64 bits); a TypeError for anything else, bool included ("WHAT must be a number, got bool").
double real_argument(const std::string& what, const py::handle& object);

// A text argument (`what` names it) as UTF-8: a TypeError unless it is a str, a ValueError when the
// str holds a lone surrogate (what Python makes of bytes that are not UTF-8, os.fsdecode's
// surrogateescape), which has no UTF-8 spelling; pybind11's own cast says only "Unable to cast".
std::string text_argument(const std::string& what, const py::handle& object);

// A str parameter of a bound function, as UTF-8. pybind11's std::string cast turns a str holding a lone
// surrogate into "incompatible function arguments", a TypeError listing the signatures, where every
// other bad value is a ValueError; this one raises text_argument's ValueError. bytes and bytearray are
// taken as they are, as pybind11's std::string cast takes them (`ComputeGraph.from_json(path.read_bytes())`);
// anything else fails to load (pybind11's TypeError).
struct Utf8Text {
  std::string value;
};

// A path parameter: str, bytes or os.PathLike, as pybind11's std::filesystem::path takes them. One
// holding a NUL byte is a ValueError, as Python's own os functions raise: the path caster's failure was
// a TypeError listing the signatures.
struct FilePath {
  std::filesystem::path value;
};

// Python lists of views of these values / nodes, in order.
py::list value_views(const std::shared_ptr<const ComputeGraph>& graph, const std::vector<ValueId>& ids);
py::list node_views(const std::shared_ptr<const ComputeGraph>& graph, const std::vector<NodeId>& ids);

}  // namespace metile::python

namespace pybind11::detail {

template <>
struct type_caster<metile::python::Utf8Text> {
  PYBIND11_TYPE_CASTER(metile::python::Utf8Text, const_name("str"));
  bool load(handle source, bool) {
    if (!source) return false;
    if (isinstance<str>(source)) {
      value.value = metile::python::text_argument("a str argument", source);
      return true;
    }
    // bytes as pybind11 takes them for a std::string, but only UTF-8: a name that is not (b"r\xff")
    // was recorded, then every str of it (value.name, repr, explain) raised UnicodeDecodeError.
    if (PyBytes_Check(source.ptr())) {
      return load_utf8(source, PyBytes_AS_STRING(source.ptr()), PyBytes_GET_SIZE(source.ptr()));
    }
    if (PyByteArray_Check(source.ptr())) {
      return load_utf8(source, PyByteArray_AS_STRING(source.ptr()), PyByteArray_GET_SIZE(source.ptr()));
    }
    return false;
  }
  bool load_utf8(handle source, const char* bytes, Py_ssize_t size) {
    PyObject* decoded = PyUnicode_DecodeUTF8(bytes, size, "strict");
    if (decoded == nullptr) {
      PyErr_Clear();
      throw value_error("a bytes argument: " + std::string(str(repr(source))) + " is not UTF-8 text");
    }
    Py_DECREF(decoded);
    value.value.assign(bytes, static_cast<std::size_t>(size));
    return true;
  }
  static handle cast(const metile::python::Utf8Text& text, return_value_policy, handle) {
    return str(text.value).release();
  }
};

template <>
struct type_caster<metile::python::FilePath> {
  PYBIND11_TYPE_CASTER(metile::python::FilePath, const_name("os.PathLike"));
  bool load(handle source, bool convert) {
    if (!source) return false;
    PyObject* native = PyOS_FSPath(source.ptr());  // str or bytes; NULL (and a TypeError set) for other types
    if (native == nullptr) {
      PyErr_Clear();
      return false;
    }
    const object path = reinterpret_steal<object>(native);
    const bool has_nul = PyUnicode_Check(native)
                             ? PyUnicode_FindChar(native, 0, 0, PyUnicode_GetLength(native), 1) >= 0
                             : PyBytes_Check(native) &&
                                   std::memchr(PyBytes_AS_STRING(native), 0, static_cast<std::size_t>(PyBytes_GET_SIZE(native))) != nullptr;
    if (has_nul) throw value_error("path: embedded null byte in " + std::string(str(repr(source))));
    type_caster<std::filesystem::path> inner;
    if (!inner.load(path, convert)) return false;
    value.value = static_cast<std::filesystem::path&>(inner);
    return true;
  }
};

// OpKind crosses as its name ("elementwise", "row_reduction", "contraction", "layout"),
// the same strings Node.kind, graph files and plans use; an unknown name is a ValueError.
template <>
struct type_caster<metile::OpKind> {
  PYBIND11_TYPE_CASTER(metile::OpKind, const_name("str"));

  bool load(handle source, bool /*convert*/) {
    if (!isinstance<str>(source)) return false;
    const std::string name = source.cast<std::string>();
    std::string known;
    for (int kind = 0; kind <= static_cast<int>(metile::OpKind::layout); ++kind) {
      const std::string_view kind_name = metile::op_kind_name(static_cast<metile::OpKind>(kind));
      if (kind_name == name) {
        value = static_cast<metile::OpKind>(kind);
        return true;
      }
      known += (known.empty() ? "" : ", ") + std::string(kind_name);
    }
    throw value_error("unknown op kind '" + name + "' (expected " + known + ")");
  }

  static handle cast(metile::OpKind kind, return_value_policy /*policy*/, handle /*parent*/) {
    return str(std::string(metile::op_kind_name(kind))).release();
  }
};

}  // namespace pybind11::detail
