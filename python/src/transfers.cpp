// SPDX-License-Identifier: Apache-2.0
// rdmakit.Buffer, RemoteSegment, Transfer (and the calls that make one), TransferOp and
// TransferPlan: what a transfer is made of, as Python describes it.
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include <fmt/format.h>

#include "engine.hpp"

namespace rdmakit::python {

namespace {

PyTransfer make(TransferOp op, py::object local, const PySegment& remote,
                std::optional<std::uint64_t> length, std::uint64_t local_offset,
                std::uint64_t remote_offset, std::uint64_t compare_add = 0,
                std::uint64_t swap = 0) {
  return PyTransfer{op, std::move(local), local_offset, length, remote, remote_offset,
                    compare_add, swap};
}

}  // namespace

void bind_transfers(py::module_& m) {
  py::enum_<TransferOp>(m, "TransferOp")
      .value("read", TransferOp::read)
      .value("write", TransferOp::write)
      .value("fetch_add", TransferOp::fetch_add)
      .value("compare_swap", TransferOp::compare_swap);


  py::class_<PyBuffer>(m, "Buffer",
                       "Memory registered with an engine (once per device). Holds the Python "
                       "object it came from until the engine is closed.")
      .def_property_readonly("address", [](const PyBuffer& b) {
        return reinterpret_cast<std::uintptr_t>(b.reg->buffer.addr);
      })
      .def_property_readonly("nbytes", [](const PyBuffer& b) { return b.reg->buffer.length; })
      .def("__len__", [](const PyBuffer& b) { return b.reg->buffer.length; })
      .def_property_readonly("readonly", [](const PyBuffer& b) { return b.reg->readonly; })
      .def_property_readonly("memory", [](const PyBuffer& b) { return to_string(b.reg->place); },
                             "Where the memory is: \"host\", \"cuda\", \"cuda-host\" or \"dmabuf\".")
      .def_property_readonly(
          "obj", [](const PyBuffer& b) { return b.reg->held ? b.reg->held->object() : py::object(py::none()); },
          "The object whose memory this is (None for a dma-buf).")
      .def("__repr__", [](const PyBuffer& b) {
        return fmt::format("<rdmakit.Buffer {} bytes of {} memory at {:#x}{}>",
                           b.reg->buffer.length, to_string(b.reg->place),
                           reinterpret_cast<std::uintptr_t>(b.reg->buffer.addr),
                           b.reg->readonly ? ", read-only" : "");
      });

  py::class_<PySegment>(m, "RemoteSegment", "A peer's named segment (Engine.segment).")
      .def_readonly("peer", &PySegment::peer)
      .def_readonly("name", &PySegment::name)
      .def("__repr__", [](const PySegment& s) {
        return fmt::format("<rdmakit.RemoteSegment {}/{}>", s.peer, s.name);
      });

  py::class_<PyTransfer>(m, "Transfer",
                         "One transfer; made by rdmakit.write, read, fetch_add, compare_swap.")
      .def_readonly("op", &PyTransfer::op)
      .def_readonly("local", &PyTransfer::local)
      .def_readonly("local_offset", &PyTransfer::local_offset)
      .def_readonly("length", &PyTransfer::length)
      .def_readonly("remote", &PyTransfer::remote)
      .def_readonly("remote_offset", &PyTransfer::remote_offset)
      .def("__repr__", [](const PyTransfer& t) {
        return fmt::format("<rdmakit.Transfer {} {}/{}+{}>", to_string(t.op), t.remote.peer,
                           t.remote.name, t.remote_offset);
      });

  const char* range_doc =
      "local: an rdmakit.Buffer, or an object (array, tensor, memoryview, slice) whose memory "
      "lies in one registered with the engine. length: bytes (default: the rest of local from "
      "local_offset).";
  for (auto [name, op, what] : {std::tuple{"write", TransferOp::write,
                                          "An RDMA WRITE of local memory into a peer's segment. "},
                                 std::tuple{"read", TransferOp::read,
                                          "An RDMA READ of a peer's segment into local memory. "}}) {
    m.def(
        name,
        [op = op](py::object local, const PySegment& remote, std::optional<std::uint64_t> length,
                  std::uint64_t local_offset, std::uint64_t remote_offset) {
          return make(op, std::move(local), remote, length, local_offset, remote_offset);
        },
        py::arg("local"), py::arg("remote"), py::kw_only(), py::arg("length") = py::none(),
        py::arg("local_offset") = 0, py::arg("remote_offset") = 0,
        (std::string(what) + range_doc).c_str());
  }
  m.def(
      "fetch_add",
      [](py::object local, const PySegment& remote, std::uint64_t add, std::uint64_t local_offset,
         std::uint64_t remote_offset) {
        return make(TransferOp::fetch_add, std::move(local), remote, 8, local_offset,
                    remote_offset, add);
      },
      py::arg("local"), py::arg("remote"), py::arg("add"), py::kw_only(),
      py::arg("local_offset") = 0, py::arg("remote_offset") = 0,
      "Adds `add` to the 8-byte aligned remote word; its old value goes to local (8 bytes).");
  m.def(
      "compare_swap",
      [](py::object local, const PySegment& remote, std::uint64_t expected, std::uint64_t desired,
         std::uint64_t local_offset, std::uint64_t remote_offset) {
        return make(TransferOp::compare_swap, std::move(local), remote, 8, local_offset,
                    remote_offset, expected, desired);
      },
      py::arg("local"), py::arg("remote"), py::arg("expected"), py::arg("desired"),
      py::kw_only(), py::arg("local_offset") = 0, py::arg("remote_offset") = 0,
      "Stores `desired` in the remote word if it equals `expected`; its old value goes to local.");

  py::class_<PyPlan>(m, "TransferPlan",
                     "Transfers resolved once (Engine.prepare), to submit many times cheaply.")
      .def("__len__", [](const PyPlan& p) { return p.plan.size(); });
  py::class_<PyList>(m, "DescriptorList",
                     "Descriptors prepared once (Engine.prepare_local, Engine.prepare_remote), whose "
                     "selections Engine.submit_indexed transfers by index.")
      .def("__len__", [](const PyList& l) { return l.list.size(); })
      .def_property_readonly("remote", [](const PyList& l) { return l.list.remote(); },
                             "Ranges of peers' segments (prepare_remote), not of local memory.");
}

}  // namespace rdmakit::python
