// SPDX-License-Identifier: Apache-2.0
#include "errors.hpp"

#include <cerrno>

namespace rdmakit::python {
namespace {

// Owned by the module object (m.attr), which outlives every call that could raise them.
PyObject* g_classes[6] = {};

PyObject* make_class(py::module_& m, const char* name, PyObject* bases, const char* doc) {
  std::string qualified = std::string("rdmakit.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.attr(name) = py::reinterpret_borrow<py::object>(cls);
  return cls;
}

ErrorKind kind_of_errno(int err) {
  switch (err) {
    case ETIMEDOUT:
      return ErrorKind::timeout;
    case ECONNRESET:
    case ECONNREFUSED:
    case ECONNABORTED:
    case EPIPE:
    case ENOTCONN:
    case EHOSTUNREACH:
      return ErrorKind::peer_lost;
    default:
      return ErrorKind::error;
  }
}

void raise(const Error& e, ErrorKind kind, const std::vector<Failure>* failures) {
  PyObject* cls = g_classes[static_cast<int>(kind)];
  py::object inst = py::reinterpret_borrow<py::object>(cls)(e.what());
  inst.attr("verb") = e.op();
  inst.attr("errno") = e.sys_errno();
  inst.attr("detail") = e.detail();
  inst.attr("hint") = e.hint();
  py::list fl;
  if (failures != nullptr) {
    for (const Failure& f : *failures) fl.append(py::make_tuple(f.index, f.status, f.reason));
  }
  inst.attr("failures") = fl;
  PyErr_SetObject(cls, inst.ptr());
}

}  // namespace

void register_errors(py::module_& m) {
  py::object builtins = py::module_::import("builtins");
  PyObject* base = make_class(
      m, "Error", PyExc_RuntimeError,
      "An rdmakit failure. Attributes: verb (the verb or step that failed), errno (0 when it was "
      "not a system error), detail (what was being done, with the values involved), hint (the "
      "likely cause and the fix; may be empty), failures (a batch's failed transfers as "
      "(index, status, reason); empty otherwise).");
  auto two = [&](const char* builtin) {
    return py::make_tuple(py::handle(base), builtins.attr(builtin));
  };
  g_classes[static_cast<int>(ErrorKind::error)] = base;
  g_classes[static_cast<int>(ErrorKind::buffer)] = make_class(
      m, "BufferError", two("BufferError").ptr(),
      "An object whose memory cannot be used as asked: not contiguous, read-only where it would "
      "be written, not registered with this engine, or without the buffer protocol or DLPack.");
  g_classes[static_cast<int>(ErrorKind::timeout)] = make_class(
      m, "TimeoutError", two("TimeoutError").ptr(), "A deadline passed before the work ended.");
  g_classes[static_cast<int>(ErrorKind::peer_lost)] = make_class(
      m, "PeerLostError", two("ConnectionError").ptr(),
      "The peer could not be reached, or was lost (it died, closed, restarted or was removed).");
  g_classes[static_cast<int>(ErrorKind::post)] = make_class(
      m, "PostError", base, "A post was refused; nothing was posted (the status says why).");
  g_classes[static_cast<int>(ErrorKind::transfer)] = make_class(
      m, "TransferError", base,
      "A batch ended with failed transfers: `failures` lists (index, status, reason).");

  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const KindedError& e) {
      raise(e, e.kind(), &e.failures());
    } catch (const Error& e) {
      raise(e, kind_of_errno(e.sys_errno()), nullptr);
    }
  });
}

}  // namespace rdmakit::python
