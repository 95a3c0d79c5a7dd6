// SPDX-License-Identifier: Apache-2.0
// rdmakit.Engine and what goes with it (Buffer, RemoteSegment, Transfer, TransferPlan, Batch,
// Notification), over rdmakit::Engine.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <vector>

#include "pymemory.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/metrics.hpp"

namespace rdmakit::python {

namespace py = pybind11;

/// A buffer registered with an engine, and the Python object whose memory it is (held until the
/// engine is closed or the buffer is unregistered).
struct Registration {
  Buffer buffer{};
  std::unique_ptr<HeldMemory> held;
  bool readonly = false;
  MemoryPlace place = MemoryPlace::host;
  ~Registration();  // releases `held` with the GIL
};

/// rdmakit.Buffer: what Engine.register returns.
struct PyBuffer {
  std::shared_ptr<Registration> reg;
};

/// rdmakit.RemoteSegment: a peer's named segment.
struct PySegment {
  RemoteSegment seg{};
  std::string peer;
  std::string name;
};

/// rdmakit.Transfer: one transfer as Python describes it; resolved against the engine's
/// registrations at submit (or prepare).
struct PyTransfer {
  TransferOp op = TransferOp::write;
  py::object local;  ///< an rdmakit.Buffer, or an object whose memory lies in a registration
  std::uint64_t local_offset = 0;
  std::optional<std::uint64_t> length;  ///< unset: the rest of `local` from local_offset
  PySegment remote;
  std::uint64_t remote_offset = 0;
  std::uint64_t compare_add = 0;
  std::uint64_t swap = 0;
};

/// rdmakit.TransferPlan: transfers resolved once (their local memory here, then the engine's
/// checks and work requests: Engine::prepare), submitted as often as wanted.
struct PyPlan {
  TransferPlan plan;
};

/// rdmakit.DescriptorList: descriptors prepared once (Engine.prepare_local / prepare_remote).
struct PyList {
  DescriptorList list;
  bool readonly = false;  ///< a local list with read-only memory in it: written by no read
};

class PyEngine;

/// Batches awaited in asyncio that have ended, by token: filled by the batches' on_done (on a
/// worker thread, without the GIL), emptied by the event loop's reader, which so settles exactly
/// the batches that ended instead of asking every waiting one.
struct DoneQueue {
  std::mutex mu;
  std::vector<std::uint64_t> tokens;
};

/// Whether a batch is awaited, and its token (Batch.__await__ sets `watched`).
struct AwaitState {
  std::atomic<bool> watched{false};
  std::uint64_t token = 0;
  std::shared_ptr<DoneQueue> queue;
};

/// rdmakit.Batch.
struct PyBatch {
  Batch batch;
  std::shared_ptr<PyEngine> engine;  // the engine lives while a batch of it is referenced
  std::shared_ptr<AwaitState> await;
  /// The rdmakit.Engine object it was submitted through: Batch._engine is that object (whose
  /// asyncio reader waits for it), never a new wrapper of the same engine made because the
  /// caller let go of the first (an awaited batch then waited on a reader nobody polled).
  py::object owner;
};

/// rdmakit.Engine. Every call may come from any Python thread; the engine's own calls run with
/// the GIL released, under a shared lock that close() takes exclusively.
class PyEngine : public std::enable_shared_from_this<PyEngine> {
 public:
  explicit PyEngine(EngineConfig config);
  ~PyEngine();

  /// Runs f(engine) with the GIL released and the engine kept from closing meanwhile.
  template <class F>
  auto call(F&& f) {
    py::gil_scoped_release nogil;
    std::shared_lock lock(mu_);
    return f(checked());
  }
  void close();
  /// The tokens of awaited batches that ended since the last call.
  std::vector<std::uint64_t> take_done();

  PyBuffer register_object(py::handle obj);
  PyBuffer register_dmabuf(int fd, std::uint64_t offset, std::uint64_t length);
  /// Engine::unregister_memory, then lets go of the object (BufferError when `b` is not
  /// registered with this engine any more).
  void unregister(const PyBuffer& b, double timeout);
  /// The transfer in engine terms: its local range found in a registration (BufferError when it
  /// is in none, or it is read-only and the transfer would write it).
  Transfer resolve(const PyTransfer& t) const;
  PyBatch submit(std::span<const Transfer> transfers, const std::optional<py::bytes>& notify,
                 std::optional<std::string> request_id);
  PyBatch submit(const TransferPlan& plan, const std::optional<py::bytes>& notify, std::optional<std::string> request_id);
  PyBatch notify(const std::string& peer, const py::bytes& message, std::optional<std::string> request_id);
  /// Engine::submit by descriptor lists and indices.
  PyBatch submit(TransferOp op, const PyList& local, std::span<const std::uint32_t> local_indices, const PyList& remote,
                 std::span<const std::uint32_t> remote_indices, const std::optional<py::bytes>& notify,
                 std::optional<std::string> request_id);
  /// Whether the registration of `b` holds read-only memory.
  [[nodiscard]] bool readonly(const Buffer& b) const;
  /// Starts (or moves) the engine's /metrics and /health endpoint; its "HOST:PORT". Stopped by
  /// stop_metrics() or close(), before the engine goes.
  std::string serve_metrics(const std::string& address, std::size_t top_peers);
  void stop_metrics();

 private:
  Engine& checked();
  std::shared_mutex mu_;
  /// A batch started by `start` (a submit of transfers or of a plan), with its asyncio token.
  template <typename Start>
  PyBatch submit_with(const std::optional<py::bytes>& notify, std::optional<std::string> request_id, Start start);
  std::shared_ptr<DoneQueue> done_ = std::make_shared<DoneQueue>();
  std::atomic<std::uint64_t> next_token_{0};
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<MetricsServer> metrics_;  // under mu_ (exclusive): it reads engine_
  // By start address, to find the registration a transfer's range lies in. Touched with the
  // GIL held only.
  std::map<std::uintptr_t, std::shared_ptr<Registration>> regs_;
  // Claims [addr, +nbytes) for reg (refusing an overlap), then registers it with `registering`
  // (the GIL let go); the claim goes again if that throws.
  PyBuffer claimed(const std::shared_ptr<Registration>& reg, void* addr, std::size_t nbytes, const char* verb,
                   const std::function<Buffer(Engine&)>& registering);
};

/// A function of rdmakit._aio (the asyncio glue), looked up once.
const py::object& aio(const char* name);

/// Buffer, RemoteSegment, Transfer and its makers, TransferOp, TransferPlan (transfers.cpp).
void bind_transfers(py::module_& m);
/// Batch and Notification (batch.cpp).
void bind_batch(py::module_& m);
/// All of the above, then Engine.
void bind_engine(py::module_& m);

}  // namespace rdmakit::python
