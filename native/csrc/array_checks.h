// The checks every binding makes on an array before a kernel reads it: dtype, number of
// dimensions, C layout, writability, and each dimension's size. A failed check is a
// ValueError that names the argument. Shared by module.cpp and decoder_bindings.cpp.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

namespace pyagent {
namespace bindings {

namespace py = pybind11;

template <typename T>
const T* checked(const py::array& arr, const std::string& name, py::ssize_t ndim, bool writable = false) {
  if (!py::isinstance<py::array_t<T>>(arr) || !arr.dtype().is(py::dtype::of<T>())) {
    throw py::value_error(name + ": expected dtype " + std::string(py::str(py::dtype::of<T>())) + ", got " +
                          std::string(py::str(arr.dtype())));
  }
  if (arr.ndim() != ndim) {
    throw py::value_error(name + ": expected " + std::to_string(ndim) + " dimensions, got " +
                          std::to_string(arr.ndim()));
  }
  if (!(arr.flags() & py::array::c_style)) throw py::value_error(name + ": must be C-contiguous");
  if (writable && !arr.writeable()) throw py::value_error(name + ": must be writable");
  return static_cast<const T*>(arr.data());
}

inline void expect_dim(const py::array& arr, const std::string& name, int axis, py::ssize_t size,
                       const std::string& what) {
  if (arr.shape(axis) != size) {
    throw py::value_error(name + ".shape[" + std::to_string(axis) + "] is " + std::to_string(arr.shape(axis)) +
                          ", expected " + std::to_string(size) + " (" + what + ")");
  }
}

}  // namespace bindings
}  // namespace pyagent
