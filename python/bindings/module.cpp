// Entry point of the `_metile` extension: registers every module's bindings and the
// one error mapping all of them rely on. metile::InputError (the user's mistake)
// becomes ValueError carrying the C++ message; wrong Python types are TypeErrors
// (pybind11's own argument casting, explicit checks in the bindings, and None passed
// for an object); metile::WriteError (a file the system would not take: a full
// disk) is an OSError; anything else that escapes C++ is an internal failure and
// surfaces as RuntimeError.
#include <exception>
#include <string>

#include "bindings.h"
#include "metile/error.h"

namespace {

// The message may quote the user's bytes (a file's invalid UTF-8): PyErr_SetString would fail to decode
// it and raise with no message at all (message_text escapes them).
void raise_with_message(PyObject* type, const char* message, const char* undecodable) {
  PyObject* text = metile::python::message_text(message);
  if (text) {
    PyErr_SetObject(type, text);
    Py_DECREF(text);
  } else {
    PyErr_SetString(type, undecodable);
  }
}

}  // namespace

PYBIND11_MODULE(_metile, module) {
  namespace py = pybind11;
  module.doc() = "metile: compute-graph fusion compiler and runtime (C++ extension; import `metile`)";
  module.attr("__version__") = METILE_VERSION;  // the project() version in CMakeLists.txt

  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const metile::InputError& input_error) {
      raise_with_message(PyExc_ValueError, input_error.what(), "invalid input (the message could not be decoded)");
    } catch (const metile::WriteError& write_error) {
      raise_with_message(PyExc_OSError, write_error.what(), "a write failed (the message could not be decoded)");
    } catch (const py::reference_cast_error&) {
      // None where a C++ object is needed: the caller's type mistake, not an internal failure.
      PyErr_SetString(PyExc_TypeError, "an argument is None where an object is required");
    } catch (const py::cast_error& cast_error) {
      PyErr_SetString(PyExc_TypeError, cast_error.what());
    }
  });

  metile::python::bind_graph(module);
  metile::python::bind_flow(module);
  metile::python::bind_fusion(module);
  metile::python::bind_runtime(module);
  metile::python::bind_model(module);
}
