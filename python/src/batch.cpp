// SPDX-License-Identifier: Apache-2.0
// rdmakit.Batch and rdmakit.Notification: a submit's transfers as they end (waited on, awaited
// in asyncio, checked), and the messages that come with a peer's batches.
#include <pybind11/stl.h>

#include <atomic>
#include <cerrno>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine.hpp"
#include "errors.hpp"
#include "options.hpp"

namespace rdmakit::python {

namespace {

std::vector<Failure> failures_of(const Batch& b) {
  std::vector<Failure> out;
  for (std::size_t i = 0; i < b.size(); ++i) {
    TransferResult r = b.result(i);
    if (r.status != TransferStatus::ok && r.status != TransferStatus::pending) {
      out.push_back({i, to_string(r.status), r.reason});
    }
  }
  return out;
}

// Raises TransferError (PeerLostError when every failure is a lost or unreachable peer).
void check_batch(const Batch& b) {
  if (!b.done() || b.failed() == 0) return;
  std::vector<Failure> f = failures_of(b);
  bool lost = true;
  for (const Failure& x : f) {
    lost &= x.status == to_string(TransferStatus::peer_lost) ||
            x.status == to_string(TransferStatus::connect_failed);
  }
  std::string first = f.empty() ? "" : fmt::format("; first: #{} {}: {}", f[0].index, f[0].status,
                                                   f[0].reason);
  throw KindedError(lost ? ErrorKind::peer_lost : ErrorKind::transfer, "batch", 0,
                    fmt::format("{} of {} transfers failed{}", b.failed(), b.size(), first), {},
                    std::move(f));
}

}  // namespace

void bind_batch(py::module_& m) {
  py::class_<Notification>(m, "Notification",
                           "A message from a peer: with its batch (after its transfers with this engine "
                           "completed), or on its own (Engine.notify).")
      .def_readonly("peer", &Notification::peer)
      .def_property_readonly(
          "request_id",
          [](const Notification& n) {
            // Any bytes on the wire (a peer in another language may send them): never a decode error.
            return py::reinterpret_steal<py::str>(
                PyUnicode_DecodeUTF8(n.request_id.data(), static_cast<Py_ssize_t>(n.request_id.size()), "replace"));
          },
          "The sender's request_id (\"\": none).")
      .def_property_readonly("message",
                             [](const Notification& n) {
                               return py::bytes(reinterpret_cast<const char*>(n.message.data()),
                                                n.message.size());
                             })
      .def("__repr__", [](const Notification& n) {
        return fmt::format("<rdmakit.Notification from {}, {} bytes>", n.peer, n.message.size());
      });

  // A Batch holds its Engine object (PyBatch::owner), and an engine's asyncio reader holds the
  // batches it waits for: the collector must see that reference, or a cycle of an engine dropped
  // without close() and a batch its closed loop never settled would never be freed.
  auto gc = py::custom_type_setup([](PyHeapTypeObject* heap_type) {
    auto* type = &heap_type->ht_type;
    type->tp_flags |= Py_TPFLAGS_HAVE_GC;
    type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
      Py_VISIT(Py_TYPE(self));
      Py_VISIT(py::cast<PyBatch&>(py::handle(self)).owner.ptr());
      return 0;
    };
    type->tp_clear = [](PyObject* self) {
      py::cast<PyBatch&>(py::handle(self)).owner = py::object();
      return 0;
    };
  });
  py::class_<PyBatch>(m, "Batch",
                      "The transfers of one submit, in flight or done. `await batch` waits "
                      "in an asyncio loop; wait() blocks (without the GIL).", gc)
      .def("done", [](const PyBatch& b) { return b.batch.done(); },
           "Every transfer has ended.")
      .def(
          "wait",
          [](const PyBatch& b, double timeout, bool check) {
            bool ended;
            std::string so_far;
            {
              py::gil_scoped_release nogil;
              ended = b.batch.wait(to_ms(timeout, "wait"));
              if (!ended) so_far = b.batch.describe_progress();  // (a walk of the whole batch: no GIL)
            }
            if (!ended) {
              throw KindedError(ErrorKind::timeout, "Batch.wait", ETIMEDOUT,
                                fmt::format("the batch of {} transfers was not done within {} s: {}",
                                            b.batch.size(), timeout, so_far),
                                "a transfer to an unreachable peer ends within the link's "
                                "handshake and retry deadlines; give it longer");
            }
            if (check) check_batch(b.batch);
          },
          py::arg("timeout") = 30.0, py::arg("check") = true,
          "Waits until every transfer has ended (TimeoutError after `timeout` seconds); with "
          "check, raises TransferError (PeerLostError when the peer is gone) if any failed.")
      .def("check", [](const PyBatch& b) { check_batch(b.batch); },
           "Raises TransferError or PeerLostError if a transfer failed (when done).")
      .def("__len__", [](const PyBatch& b) { return b.batch.size(); })
      .def_property_readonly("failed", [](const PyBatch& b) { return b.batch.failed(); })
      .def_property_readonly("notifications_failed", [](const PyBatch& b) { return b.batch.notifications_failed(); },
                             "Peers whose notification was not sent (their queue was full, or no link was "
                             "up): describe_failures() says which.")
      .def(
          "result",
          [](const PyBatch& b, std::size_t i) {
            if (i >= b.batch.size()) throw py::index_error("no such transfer in the batch");
            TransferResult r = b.batch.result(i);
            return py::make_tuple(to_string(r.status), r.reason);
          },
          "Transfer i's (status, reason); status is \"pending\", \"ok\", \"invalid\", "
          "\"no_segment\", \"connect_failed\", \"peer_lost\", \"failed\", \"cancelled\" or \"lease_expired\".")
      .def(
          "cancel",
          [](const PyBatch& b) {
            py::gil_scoped_release nogil;
            b.batch.cancel();
          },
          "Ends every transfer not yet posted (waiting for a link, or queued for room) as "
          "\"cancelled\"; those on the wire run to their end. Returns once the engine has done so.")
      .def(
          "telemetry",
          [](const PyBatch& b) {
            const BatchTelemetry t = b.batch.telemetry();
            // Seconds on the steady clock: Linux's CLOCK_MONOTONIC, time.monotonic()'s.
            const auto secs = [](std::chrono::steady_clock::time_point p) -> py::object {
              if (p == std::chrono::steady_clock::time_point{}) return py::none();
              return py::float_(std::chrono::duration<double>(p.time_since_epoch()).count());
            };
            py::dict d;
            d["request_id"] = t.request_id;
            d["submitted"] = secs(t.submitted);
            d["posted"] = secs(t.posted);
            d["ended"] = secs(t.ended);
            d["post_time"] = std::chrono::duration<double>(t.post_time()).count();
            d["total_time"] = std::chrono::duration<double>(t.total_time()).count();
            d["bytes"] = t.bytes;
            d["transfers"] = t.transfers;
            d["failed"] = t.failed;
            py::list paths;
            for (const PathTelemetry& p : t.paths) {
              py::dict e;
              e["transport"] = p.transport;
              e["device"] = p.device;
              e["bytes"] = p.bytes;
              e["transfers"] = p.transfers;
              paths.append(std::move(e));
            }
            d["paths"] = std::move(paths);
            return d;
          },
          "When it was submitted, posted and ended (time.monotonic() seconds; None until then, or "
          "with telemetry=False), post_time and total_time (seconds from submit; 0 until then), "
          "bytes moved by its reads and writes that ended ok, transfers, failed, request_id, and paths: per rail "
          "or transport its transfers that ended ok took (dicts of transport, device, bytes, transfers; busiest "
          "first).")
      .def("results",
           [](const PyBatch& b) {
             py::list out;
             for (std::size_t i = 0; i < b.batch.size(); ++i) {
               TransferResult r = b.batch.result(i);
               out.append(py::make_tuple(to_string(r.status), r.reason));
             }
             return out;
           })
      .def("describe_failures", [](const PyBatch& b) { return b.batch.describe_failures(); })
      .def(
          "describe_progress",
          [](const PyBatch& b) {
            py::gil_scoped_release nogil;  // a walk of the whole batch
            return b.batch.describe_progress();
          },
          "How far it got, in one line: how many transfers ended (failed among them), the paths "
          "those that ended ok took, and which had not ended (what wait()'s TimeoutError says).")
      .def_property_readonly("_engine", [](const PyBatch& b) -> py::object {
        return b.owner ? b.owner : py::cast(b.engine);
      })
      .def(
          "_watch",
          [](const PyBatch& b) {
            b.await->watched.store(true, std::memory_order_relaxed);
            std::atomic_thread_fence(std::memory_order_seq_cst);
            return py::make_tuple(b.await->token, b.batch.done());
          },
          "For the asyncio reader: marks the batch awaited; (token, done).")
      .def("__await__", [](py::object self) { return aio("batch_await")(self); })
      .def("future", [](py::object self) { return aio("batch_future")(self); },
           "An asyncio future of the running loop that resolves to the batch (or raises as "
           "wait does). asyncio.gather wraps any other awaitable in a task: with many batches "
           "in flight, gather their futures.");
}

}  // namespace rdmakit::python
