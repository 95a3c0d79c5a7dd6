// SPDX-License-Identifier: Apache-2.0
// The extension module rdmakit._rdmakit; the package rdmakit (python/rdmakit) re-exports it and
// adds the asyncio glue.
#include <pybind11/pybind11.h>

#include "connection.hpp"
#include "engine.hpp"
#include "logs.hpp"
#include "errors.hpp"
#include "pymemory.hpp"
#include "rdmakit/identity.hpp"
#include "rdmakit/version.hpp"

namespace py = pybind11;
using namespace rdmakit::python;

PYBIND11_MODULE(_rdmakit, m) {
  m.doc() = "rdmakit: correct, fast and debuggable RDMA (the compiled part of the package)";
  m.attr("__version__") = rdmakit::version();
  register_errors(m);
  bind_engine(m);
  bind_logs(m);
  bind_connection(m);
  m.def(
      "memory_of",
      [](py::handle obj) {
        MemoryOf mem = memory_of(obj, "memory_of");
        py::dict d;
        d["address"] = reinterpret_cast<std::uintptr_t>(mem.addr);
        d["nbytes"] = mem.nbytes;
        d["readonly"] = mem.readonly;
        d["memory"] = to_string(mem.place);
        d["device"] = mem.device;
        return d;
      },
      py::arg("obj"),
      "What rdmakit would register for obj: address, nbytes, readonly, memory (host, cuda, "
      "cuda-host) and device. BufferError when obj's memory cannot be used.");
  m.def(
      "generate_identity",
      [](const py::object& path) {
        const std::string p = py::module_::import("os").attr("fspath")(path).cast<std::string>();
        const rdmakit::Identity id = rdmakit::Identity::generate();
        id.save(p);
        return id.public_key();
      },
      py::arg("path"),
      "Writes a fresh engine identity to a new file `path` (mode 0600) and its public key to "
      "path + '.pub' (as `rdmakit keygen --identity`); returns the public key. Engine(identity=path) "
      "proves it.");
}
