// SPDX-License-Identifier: Apache-2.0
// rdmakit.Engine: the engine's own calls (registration, resolving transfers, submitting) and
// its binding. Buffers, segments, transfers and plans are bound in transfers.cpp, batches and
// notifications in batch.cpp.
#include "engine.hpp"
#include "logs.hpp"

#include <pybind11/stl.h>

#include <cerrno>
#include <cmath>
#include <mutex>
#include <tuple>

#include <fmt/format.h>

#include "errors.hpp"
#include "options.hpp"

namespace rdmakit::python {

namespace {

// RegistrationPath as Python names it: the enumerator's own name.
const char* path_name(RegistrationPath p) {
  switch (p) {
    case RegistrationPath::host_mr: return "host_mr";
    case RegistrationPath::dmabuf_mr: return "dmabuf_mr";
    case RegistrationPath::device_mr: return "device_mr";
    case RegistrationPath::bounce: return "bounce";
  }
  return "?";
}

}  // namespace

Registration::~Registration() {
  if (held) {
    py::gil_scoped_acquire gil;
    held.reset();
  }
}

PyEngine::PyEngine(EngineConfig config) {
  if (!config.link.log) {
    start_log_pump();
    config.link.log = python_log();
  }
  py::gil_scoped_release nogil;
  engine_ = std::make_unique<Engine>(std::move(config));
}

PyEngine::~PyEngine() { close(); }

Engine& PyEngine::checked() {
  if (!engine_) throw Error("engine", EBADF, "the engine is closed", "make a new rdmakit.Engine");
  return *engine_;
}

void PyEngine::close() {
  {
    // What is in flight ends (completed or flushed) before the engine goes; then the memory it
    // registered may be given back to Python.
    py::gil_scoped_release nogil;
    std::unique_lock lock(mu_);
    metrics_.reset();
    engine_.reset();
  }
  regs_.clear();
}

std::string PyEngine::serve_metrics(const std::string& address, std::size_t top_peers) {
  py::gil_scoped_release nogil;
  std::unique_lock lock(mu_);
  Engine& e = checked();
  metrics_.reset();  // one endpoint per engine: a second call moves it
  metrics_ = std::make_unique<MetricsServer>(e, address, MetricsOptions{top_peers});
  return metrics_->address();
}

void PyEngine::stop_metrics() {
  py::gil_scoped_release nogil;
  std::unique_lock lock(mu_);
  metrics_.reset();
}

PyBuffer PyEngine::register_object(py::handle obj) {
  auto reg = std::make_shared<Registration>();
  reg->held = HeldMemory::take(obj, "register");
  const MemoryOf& m = reg->held->memory();
  if (m.nbytes == 0) throw_buffer_error("register", "the object has no bytes");
  reg->readonly = m.readonly;
  reg->place = m.place;
  return claimed(reg, m.addr, m.nbytes, "register",
                 [&](Engine& e) { return e.register_memory(m.addr, m.nbytes); });
}

PyBuffer PyEngine::register_dmabuf(int fd, std::uint64_t offset, std::uint64_t length) {
  auto reg = std::make_shared<Registration>();
  reg->place = MemoryPlace::dmabuf;
  Buffer b = call([&](Engine& e) { return e.register_dmabuf(fd, offset, length); });
  try {
    return claimed(reg, b.addr, b.length, "register_dmabuf", [&](Engine&) { return b; });
  } catch (...) {
    try {
      call([&](Engine& e) { e.unregister_memory(b); });
    } catch (const std::exception&) {
      // The engine closed meanwhile: the buffer went with it; the claim's error is the one to raise.
    }
    throw;
  }
}

PyBuffer PyEngine::claimed(const std::shared_ptr<Registration>& reg, void* addr, std::size_t nbytes,
                           const char* verb, const std::function<Buffer(Engine&)>& registering) {
  auto start = reinterpret_cast<std::uintptr_t>(addr);
  // Ranges registered with one engine must not overlap: a transfer's range is looked up by
  // address, and it must name one registration.
  auto next = regs_.lower_bound(start);
  bool overlaps = (next != regs_.end() && next->first < start + nbytes);
  if (next != regs_.begin()) {
    auto prev = std::prev(next);
    overlaps |= prev->first + prev->second->buffer.length > start;
  }
  if (overlaps) {
    throw_buffer_error(
        verb, fmt::format("[{:#x}, +{}) overlaps memory already registered with this engine", start, nbytes),
        "register the whole object once and pass views or slices of it in transfers");
  }
  // The range is claimed before the GIL is let go for the registration, so a second thread
  // registering the same memory meanwhile sees the overlap.
  reg->buffer.addr = addr;
  reg->buffer.length = nbytes;
  regs_.emplace(start, reg);
  // The claim goes again on failure, found anew: close() may have cleared the registrations while
  // the GIL was let go (an iterator kept across it would dangle).
  try {
    reg->buffer = call(registering);
  } catch (...) {
    if (auto it = regs_.find(start); it != regs_.end() && it->second == reg) regs_.erase(it);
    throw;
  }
  return PyBuffer{reg};
}

void PyEngine::unregister(const PyBuffer& b, double timeout) {
  const auto start = reinterpret_cast<std::uintptr_t>(b.reg->buffer.addr);
  auto registered = [&] {
    auto it = regs_.find(start);
    return it != regs_.end() && it->second == b.reg ? it : regs_.end();
  };
  if (registered() == regs_.end()) {
    throw_buffer_error("unregister", "the buffer is not registered with this engine (any more)");
  }
  const auto ms = to_ms(timeout, "timeout");
  call([&](Engine& e) { e.unregister_memory(b.reg->buffer, ms); });
  // Found again: the GIL was let go meanwhile.
  if (auto it = registered(); it != regs_.end()) regs_.erase(it);
}

Transfer PyEngine::resolve(const PyTransfer& t) const {
  Transfer out;
  out.op = t.op;
  out.remote = t.remote.seg;
  out.remote_offset = t.remote_offset;
  out.compare_add = t.compare_add;
  out.swap = t.swap;
  const Registration* reg = nullptr;
  std::uint64_t base = 0;  // the local object's offset in its registration
  std::uint64_t nbytes = 0;
  if (py::isinstance<PyBuffer>(t.local)) {
    reg = t.local.cast<const PyBuffer&>().reg.get();
    // A Buffer's id means something to the engine that made it only.
    auto it = regs_.find(reinterpret_cast<std::uintptr_t>(reg->buffer.addr));
    if (it == regs_.end() || it->second.get() != reg) {
      throw_buffer_error("submit", "the rdmakit.Buffer was registered with another engine (or "
                                   "one that was closed)",
                         "register the object with this engine, or pass the object itself");
    }
    nbytes = reg->buffer.length;
  } else {
    MemoryOf m = memory_of(t.local, "submit");
    auto start = reinterpret_cast<std::uintptr_t>(m.addr);
    auto it = regs_.upper_bound(start);
    if (it != regs_.begin()) {
      --it;
      if (start + m.nbytes <= it->first + it->second->buffer.length) {
        reg = it->second.get();
        base = start - it->first;
      }
    }
    if (reg == nullptr) {
      throw_buffer_error(
          "submit", fmt::format("a transfer's local memory [{:#x}, +{}) is not registered with this engine",
                      start, m.nbytes),
          "register it (or the object it is a view of) first: engine.register(obj)");
    }
    nbytes = m.nbytes;
  }
  const bool atomic = t.op == TransferOp::fetch_add || t.op == TransferOp::compare_swap;
  out.length = local_range("submit", nbytes, t.local_offset, t.length,
                           atomic ? std::optional<std::uint64_t>{8} : std::nullopt);
  out.local = reg->buffer;
  out.local_offset = base + t.local_offset;
  if (reg->readonly && t.op != TransferOp::write) {
    throw_buffer_error("submit", fmt::format("a {} writes its local memory, which is read-only",
                                   to_string(t.op)),
                       "use a writable object (a bytearray, a writable array or tensor)");
  }
  return out;
}

template <typename Start>
PyBatch PyEngine::submit_with(const std::optional<py::bytes>& notify, std::optional<std::string> request_id,
                              Start start) {
  SubmitOptions opts;
  if (notify) {
    std::string_view s = *notify;
    opts.notify.assign(s.begin(), s.end());
  }
  if (request_id) opts.request_id = std::move(*request_id);
  auto await = std::make_shared<AwaitState>();
  await->token = next_token_.fetch_add(1, std::memory_order_relaxed) + 1;
  await->queue = done_;
  // Runs before the engine signals its descriptor, so the reader that wakes finds the token.
  opts.on_done = [await](const Batch&) {
    // Pairs with the fence in Batch._watch: either it sees the batch done, or this sees it
    // watched (or both, and the token is one the reader no longer waits for).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!await->watched.load(std::memory_order_relaxed)) return;
    std::lock_guard lock(await->queue->mu);
    await->queue->tokens.push_back(await->token);
  };
  Batch b = call([&](Engine& e) { return start(e, std::move(opts)); });
  return PyBatch{std::move(b), shared_from_this(), std::move(await), py::object{}};
}

PyBatch PyEngine::submit(std::span<const Transfer> transfers, const std::optional<py::bytes>& notify,
                         std::optional<std::string> request_id) {
  return submit_with(notify, std::move(request_id),
                     [transfers](Engine& e, SubmitOptions o) { return e.submit(transfers, std::move(o)); });
}

PyBatch PyEngine::submit(const TransferPlan& plan, const std::optional<py::bytes>& notify,
                         std::optional<std::string> request_id) {
  return submit_with(notify, std::move(request_id),
                     [&plan](Engine& e, SubmitOptions o) { return e.submit(plan, std::move(o)); });
}

PyBatch PyEngine::submit(TransferOp op, const PyList& local, std::span<const std::uint32_t> local_indices,
                         const PyList& remote, std::span<const std::uint32_t> remote_indices,
                         const std::optional<py::bytes>& notify, std::optional<std::string> request_id) {
  return submit_with(notify, std::move(request_id), [&](Engine& e, SubmitOptions o) {
    return e.submit(op, local.list, local_indices, remote.list, remote_indices, std::move(o));
  });
}

bool PyEngine::readonly(const Buffer& b) const {
  const auto it = regs_.find(reinterpret_cast<std::uintptr_t>(b.addr));
  return it != regs_.end() && it->second->readonly;
}

PyBatch PyEngine::notify(const std::string& peer, const py::bytes& message, std::optional<std::string> request_id) {
  // Its completion reaches asyncio as a batch's does (the callback is the batch's).
  const std::string_view m = message;
  const std::vector<std::uint8_t> bytes(m.begin(), m.end());
  return submit_with(std::nullopt, std::move(request_id),
                     [&](Engine& e, SubmitOptions o) { return e.notify(peer, bytes, std::move(o)); });
}

std::vector<std::uint64_t> PyEngine::take_done() {
  std::vector<std::uint64_t> out;
  std::lock_guard lock(done_->mu);
  out.swap(done_->tokens);
  return out;
}

const py::object& aio(const char* name) {
  // Looked up once (every `await batch` calls one). Leaked on purpose: the interpreter may be
  // finalised before static destructors run.
  static auto* cache = new std::map<std::string, py::object>();
  auto it = cache->find(name);
  if (it == cache->end()) {
    it = cache->emplace(name, py::module_::import("rdmakit._aio").attr(name)).first;
  }
  return it->second;
}

namespace {

namespace {

// A non-negative integer that fits 64 bits (a float, a negative number: ValueError naming `what`).
std::uint64_t to_u64(py::handle v, const char* what) {
  if (!PyIndex_Check(v.ptr())) throw py::value_error(fmt::format("{}: an integer, not {}", what, std::string(py::str(py::type::of(v)))));
  const py::int_ i = py::reinterpret_steal<py::int_>(PyNumber_Index(v.ptr()));
  if (i.ptr() == nullptr) throw py::error_already_set();
  if (i < py::int_(0) || i > py::int_(UINT64_MAX)) throw py::value_error(fmt::format("{} {}: 0 .. 2**64-1", what, std::string(py::repr(i))));
  return i.cast<std::uint64_t>();
}

// The indices of one side, each a non-negative integer below 2**32: numpy's integers and Python's
// alike, never truncated or wrapped (a float, -1 or 2**32 is an error naming its position).
std::vector<std::uint32_t> indices_of(const py::iterable& it, const char* side) {
  std::vector<std::uint32_t> out;
  if (py::hasattr(it, "__len__")) out.reserve(py::len(it));
  for (const py::handle v : it) {
    const std::size_t k = out.size();
    if (!PyIndex_Check(v.ptr()) || PyBool_Check(v.ptr())) {
      throw Error("submit_indexed", EINVAL, fmt::format("position {}: a {} index is an integer, not {}", k, side,
                                                        std::string(py::str(py::type::of(v)))));
    }
    const py::int_ i = py::reinterpret_steal<py::int_>(PyNumber_Index(v.ptr()));
    if (i.ptr() == nullptr) throw py::error_already_set();
    if (i < py::int_(0) || i > py::int_(UINT32_MAX)) {
      throw Error("submit_indexed", EINVAL,
                  fmt::format("position {}: {} index {} is not one (0 .. 2**32-1)", k, side, std::string(py::repr(i))));
    }
    out.push_back(i.cast<std::uint32_t>());
  }
  return out;
}

// Runs f for entry `i` of a descriptor list; what it throws names the entry.
template <typename F>
void named_entry(const char* verb, std::size_t i, F&& f) {
  try {
    f();
  } catch (const KindedError& ex) {
    throw KindedError(ex.kind(), verb, ex.sys_errno(), fmt::format("descriptor {}: {}", i, ex.detail()), ex.hint());
  } catch (const Error& ex) {
    throw Error(verb, ex.sys_errno(), fmt::format("descriptor {}: {}", i, ex.detail()), ex.hint());
  } catch (const py::error_already_set& ex) {
    throw Error(verb, EINVAL, fmt::format("descriptor {}: {}", i, ex.what()));
  } catch (const std::exception& ex) {
    throw Error(verb, EINVAL, fmt::format("descriptor {}: {}", i, ex.what()));
  }
}

}  // namespace

std::vector<Transfer> resolve_all(const PyEngine& e, const py::iterable& transfers) {
  std::vector<Transfer> out;
  if (py::hasattr(transfers, "__len__")) out.reserve(py::len(transfers));
  for (py::handle h : transfers) out.push_back(e.resolve(h.cast<const PyTransfer&>()));
  return out;
}

py::dict to_dict(const EngineCounters& c) {
  py::dict d;
  d["qps"] = c.qps;
  d["peers"] = c.peers;
  d["links"] = c.links;
  d["connects"] = c.connects;
  d["reconnects"] = c.reconnects;
  d["accepts"] = c.accepts;
  d["evictions"] = c.evictions;
  d["restarts"] = c.restarts;
  d["batches"] = c.batches;
  d["transfers"] = c.transfers;
  d["transfers_failed"] = c.transfers_failed;
  d["bytes"] = c.bytes;
  d["notifications_sent"] = c.notifications_sent;
  d["notifications_received"] = c.notifications_received;
  d["notifications_refused"] = c.notifications_refused;
  d["notifications_dropped"] = c.notifications_dropped;
  d["notifications_lost"] = c.notifications_lost;
  d["windows_bound"] = c.windows_bound;
  d["window_bind_ns"] = c.window_bind_ns;
  d["rail_links"] = c.rail_links;
  d["rail_failures"] = c.rail_failures;
  d["slices"] = c.slices;
  d["reposted"] = c.reposted;
  d["plan_posted"] = c.plan_posted;
  d["plan_builds"] = c.plan_builds;
  d["lists_posted"] = c.lists_posted;
  d["lists_builds"] = c.lists_builds;
  d["shm_mapped_bytes"] = c.shm_mapped_bytes;
  d["submits_inline"] = c.submits_inline;
  d["waits_spun"] = c.waits_spun;
  return d;
}

void close_engine(const py::object& self) {
  self.cast<PyEngine&>().close();
  // Batches still awaited have ended now (completed or flushed): their futures are settled.
  if (py::hasattr(self, "_aio_reader")) aio("detach")(self);
}

}  // namespace

void bind_engine(py::module_& m) {
  bind_transfers(m);
  bind_batch(m);

  py::class_<PyEngine, std::shared_ptr<PyEngine>>(
      m, "Engine", py::dynamic_attr(),
      "Many peers, memory registered once, batched asynchronous transfers (docs/engine.md). "
      "Every method may be called from any thread; calls that can wait run without the GIL.")
      .def(py::init([](std::string name, std::string listen, std::optional<std::uint32_t> workers,
                       std::uint32_t max_qps, bool listen_at_start, const py::object& psk,
                       std::string device, double handshake_timeout, std::uint32_t send_depth,
                       std::string metadata, std::string cluster, double lease, std::uint32_t rails,
                       std::vector<std::string> rail_devices, std::uint64_t slice_size,
                       std::uint64_t slice_threshold, const std::string& method, std::uint32_t notification_queue,
                       bool allow_region_keys, const py::object& identity, std::vector<std::string> allowed_peers,
                       const std::vector<std::string>& transports, std::uint32_t tcp_streams,
                       const std::string& shm_copy, double wait_spin, bool telemetry,
                       std::vector<std::string> devices, const std::string& gid, unsigned traffic_class,
                       unsigned service_level, unsigned pkey_index, double ack_timeout, unsigned retry_count,
                       std::vector<int> worker_cpus, bool shm_map) {
             EngineConfig c;
             c.worker_cpus = std::move(worker_cpus);
             c.devices = std::move(devices);
             set_fabric(c.link, gid, traffic_class, service_level, pkey_index, ack_timeout, retry_count);
             c.telemetry = telemetry;
             if (!(wait_spin >= 0 && wait_spin <= 1)) {
               throw py::value_error(fmt::format("wait_spin={}: seconds, from 0 to 1", wait_spin));
             }
             c.wait_spin = std::chrono::microseconds{static_cast<std::int64_t>(wait_spin * 1e6 + 0.5)};
             for (const std::string& t : transports) c.transports.push_back(parse_transport(t));
             c.tcp_streams = tcp_streams;
             c.shm_copy = parse_shm_copy(shm_copy);
             c.shm_map = shm_map;
             c.identity = identity_from(identity);
             c.allowed_peers = std::move(allowed_peers);
             c.link.method = parse_connect_method(method);
             c.rails.max = rails;
             c.rails.devices = std::move(rail_devices);
             c.rails.slice_size = slice_size;
             c.rails.slice_threshold = slice_threshold;
             c.metadata.uri = std::move(metadata);
             c.metadata.cluster = std::move(cluster);
             c.metadata.lease = to_ms(lease, "lease");
             c.name = std::move(name);
             c.listen = std::move(listen);
             c.workers = workers;
             c.max_qps = max_qps;
             c.notification_queue = notification_queue;
             c.allow_region_keys = allow_region_keys;
             c.listen_at_start = listen_at_start;
             c.link.psk = key_from(psk);
             c.link.device = std::move(device);
             c.link.handshake_timeout = to_ms(handshake_timeout, "handshake_timeout");
             c.link.send_depth = send_depth;
             return std::make_shared<PyEngine>(std::move(c));
           }),
           py::kw_only(), py::arg("name") = "", py::arg("listen") = ":0",
           py::arg("workers") = py::none(), py::arg("max_qps") = 1024,
           py::arg("listen_at_start") = true, py::arg("psk") = py::none(),
           py::arg("device") = "", py::arg("handshake_timeout") = 10.0,
           py::arg("send_depth") = 64, py::arg("metadata") = "p2p", py::arg("cluster") = "default",
           py::arg("lease") = 10.0, py::arg("rails") = 0, py::arg("rail_devices") = std::vector<std::string>{},
           py::arg("slice_size") = RailConfig{}.slice_size, py::arg("slice_threshold") = RailConfig{}.slice_threshold,
           py::arg("method") = "tcp", py::arg("notification_queue") = EngineConfig{}.notification_queue,
           py::arg("allow_region_keys") = false, py::arg("identity") = py::none(),
           py::arg("allowed_peers") = std::vector<std::string>{},
           py::arg("transports") = std::vector<std::string>{}, py::arg("tcp_streams") = EngineConfig{}.tcp_streams,
           py::arg("shm_copy") = "auto",
           py::arg("wait_spin") = std::chrono::duration<double>(EngineConfig{}.wait_spin).count(),
           py::arg("telemetry") = EngineConfig{}.telemetry, py::arg("devices") = std::vector<std::string>{},
           py::arg("gid") = "", py::arg("traffic_class") = 0, py::arg("service_level") = 0, py::arg("pkey_index") = 0,
           py::arg("ack_timeout") = std::chrono::duration<double>(ConnectionConfig{}.ack_timeout).count(),
           py::arg("retry_count") = ConnectionConfig{}.retry_count, py::arg("worker_cpus") = std::vector<int>{},
           py::arg("shm_map") = EngineConfig{}.shm_map,
           "name: as peers know it (default host:pid). devices: the RDMA devices the engine uses (registers its "
           "memory on, makes its queues on, links through; default: every one). device: the one "
           "device every link takes (default: the route's, among `devices`). gid, traffic_class, service_level, "
           "pkey_index, ack_timeout (seconds), retry_count: every link's fabric settings (docs/hardware.md). listen: \"[host]:port\" (port 0: any; "
           "empty: no listener; no host: every address, or 127.0.0.1 only without a psk). workers: progress threads (default one per device). worker_cpus: the CPUs they "
           "run on (worker i on worker_cpus[i % len]; default: anywhere). psk: the "
           "pre-shared key, bytes or a key file's path (both ends of a link hold the same). "
           "metadata: \"p2p\" (peers by address), \"redis://host:port\" or \"etcd://host:port\": "
           "the engine publishes itself there (in `cluster`, under a lease of `lease` seconds) "
           "and finds peers by name. rails: most NIC ports a peer link uses (0: every port that "
           "reaches the peer); rail_devices: the devices rails may use (default all); reads and writes "
           "of at least slice_threshold bytes are cut into slices of slice_size over the rails. method: "
           "how links connect, \"tcp\" or \"rdma_cm\" (every engine the same). notification_queue: the "
           "notifications each peer link may have waiting here at once (a sender is told, per batch, of "
           "one more). allow_region_keys: on a device without type-2 memory windows, serve segments with "
           "the buffer's own key (access per buffer, no per-peer revocation); otherwise expose() refuses. "
           "identity: an identity file's path (rdmakit keygen --identity, or generate_identity()) or a "
           "32-byte seed: every link proves it (needs psk); info()['public_key'] is what peers pin. "
           "allowed_peers: who may link here (names, public keys, or NAME=KEY; empty: any holder of psk). "
           "transports: what links may use, best first: \"rdma\", \"tcp\" (any peer, no RDMA device needed), "
           "\"shm\" (a peer on this host); a link takes the first this engine lists that the peer lists too "
           "(default [\"rdma\"]; peers()[i]['transport'] says which, and why). tcp_streams: tcp's data streams per link. shm_copy: how shm links this engine opens copy: \"attach\" "
           "(cross-memory attach: one copy, by the target), \"ring\" (a shared ring: two copies, needs no permission "
           "to read another process), \"auto\" (attach where the kernel allows it, else the ring). shm_map: shm peers "
           "map the memory this engine allocates and copy it in one pass (False: every copy goes as shm_copy says; "
           "memory registered from Python is never mapped). wait_spin: seconds "
           "Batch.wait() polls on its own thread before it sleeps (adapting to what waits take, within it; 0: it "
           "sleeps at once): latency against CPU. telemetry: each batch records when it was submitted, posted "
           "and ended (Batch.telemetry(); a clock read at each).")
      .def("close", &close_engine,
           "Closes every link (what is in flight ends) and releases the registered objects.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](py::object self, py::args) { close_engine(self); })
      .def_property_readonly("port", [](PyEngine& e) {
        return e.call([](Engine& x) { return x.port(); });
      })
      .def_property_readonly("fd", [](PyEngine& e) {
        return e.call([](Engine& x) { return x.fd(); });
      }, "Readable when a batch ends or a notification arrives (read 8 bytes to re-arm).")
      .def("start_listening", [](PyEngine& e) { e.call([](Engine& x) { x.start_listening(); }); })
      .def("info",
           [](PyEngine& e) {
             EngineInfo i = e.call([](Engine& x) { return x.info(); });
             py::dict d;
             d["name"] = i.name;
             d["epoch"] = i.epoch;
             d["port"] = i.port;
             d["devices"] = i.devices;
             d["memory_windows"] = i.memory_windows;
             d["access_model"] = i.access_model;
             d["public_key"] = i.public_key;
             d["transports"] = i.transports;
             d["transports_note"] = i.transports_note;
             d["listen"] = i.listen;
             d["listen_note"] = i.listen_note;
             d["metadata"] = i.metadata;
             return d;
           })
      .def("counters",
           [](PyEngine& e) { return to_dict(e.call([](Engine& x) { return x.counters(); })); })
      .def(
          "metrics",
          [](PyEngine& e, std::size_t top_peers) {
            return e.call([&](Engine& x) { return x.metrics(MetricsOptions{top_peers}); });
          },
          py::kw_only(), py::arg("top_peers") = 64,
          "The engine's figures in Prometheus's text format (docs/observability.md): the top_peers "
          "busiest peers named, the rest summed.")
      .def(
          "health",
          [](PyEngine& e) {
            const EngineHealth h = e.call([](Engine& x) { return x.health(); });
            py::dict d;
            d["ok"] = h.ok;
            d["reason"] = h.reason;
            return d;
          },
          "{'ok': bool, 'reason': str}: listening, and its metadata store (if any) holds its record.")
      .def("serve_metrics", &PyEngine::serve_metrics, py::arg("address") = "127.0.0.1:0", py::kw_only(),
           py::arg("top_peers") = 64,
           "Serves GET /metrics and /health over HTTP at \"[HOST:]PORT\" (port 0: any free one); returns "
           "\"HOST:PORT\". Plain HTTP: bind it where only the scrapers reach. Stopped by stop_metrics() or close().")
      .def("stop_metrics", &PyEngine::stop_metrics)
      .def("unregister", &PyEngine::unregister, py::arg("buffer"), py::arg("timeout") = 30.0,
           "Deregisters a buffer (its transfers in flight end first; later ones are refused) and "
           "lets go of its object. Refused while a segment exposes it.")
      .def("register", &PyEngine::register_object, py::arg("obj"),
           "Registers the memory of obj (buffer protocol or __dlpack__: bytearray, memoryview, "
           "mmap, numpy array, torch tensor) once per device, and holds obj until close(). A CUDA "
           "tensor goes by one dma-buf export where a device takes it, by its device pointer "
           "(nvidia-peermem) elsewhere: registration() says which.")
      .def("register_dmabuf", &PyEngine::register_dmabuf, py::arg("fd"), py::arg("offset"), py::arg("length"),
           "Registers [offset, offset + length) of another driver's dma-buf fd (the engine keeps a dup): "
           "directly where every device takes dma-buf MRs, else through one host bounce buffer that "
           "stage_in()/stage_out() fill and copy back.")
      .def(
          "stage_in",
          [](PyEngine& e, const PyBuffer& b, std::uint64_t offset, std::uint64_t length) {
            e.call([&](Engine& x) { x.stage_in(b.reg->buffer, offset, length); });
          },
          py::arg("buffer"), py::arg("offset") = 0, py::arg("length") = 0,
          "Bounce path: copies the memory's bytes into what the NICs reach, before transfers send "
          "them or peers read them (length 0: to the end). A no-op on every other path.")
      .def(
          "stage_out",
          [](PyEngine& e, const PyBuffer& b, std::uint64_t offset, std::uint64_t length) {
            e.call([&](Engine& x) { x.stage_out(b.reg->buffer, offset, length); });
          },
          py::arg("buffer"), py::arg("offset") = 0, py::arg("length") = 0,
          "Bounce path: copies bytes that reads or peers' writes left back to the memory. A no-op "
          "on every other path.")
      .def(
          "registration",
          [](PyEngine& e, const PyBuffer& b) {
            py::list out;
            for (const BufferPath& p : e.call([&](Engine& x) { return x.registration(b.reg->buffer); })) {
              py::dict d;
              d["device"] = p.device;
              d["path"] = path_name(p.path);
              d["detail"] = p.detail;
              out.append(d);
            }
            return out;
          },
          py::arg("buffer"),
          "[{'device', 'path', 'detail'}]: how each RDMA device reaches the buffer's memory (path: "
          "host_mr, dmabuf_mr, device_mr or bounce), and what was tried before.")
      .def(
          "expose",
          [](PyEngine& e, std::string name, const PyBuffer& b, const std::string& access,
             std::uint64_t offset, std::uint64_t length, std::vector<std::string> peers) {
            Access a = parse_access(access, "expose");
            if (a == Access::none) throw Error("expose", EINVAL, "access is empty", "e.g. \"rw\"");
            refuse_remote_writes("expose", fmt::format("segment {}: its buffer", name),
                                 b.reg->readonly, a, access);
            e.call([&](Engine& x) { x.expose(std::move(name), b.reg->buffer, a, std::move(peers), offset, length); });
          },
          py::arg("name"), py::arg("buffer"), py::arg("access") = "rw", py::kw_only(),
          py::arg("offset") = 0, py::arg("length") = 0, py::arg("peers") = std::vector<std::string>{},
          "Makes a range of a registered buffer a segment peers reach by name. access: letters "
          "r (read), w (write), a (atomics). length 0: to the buffer's end. peers: only these "
          "(names, public keys, NAME=KEY) get a window on it; empty: every peer.")
      .def(
          "expose_leased",
          [](PyEngine& e, std::string name, const PyBuffer& b, const std::string& access, std::uint64_t offset,
             std::uint64_t length) {
            Access a = parse_access(access, "expose_leased");
            if (a == Access::none) throw Error("expose_leased", EINVAL, "access is empty", "e.g. \"r\"");
            refuse_remote_writes("expose_leased", fmt::format("segment {}: its buffer", name), b.reg->readonly, a, access);
            e.call([&](Engine& x) { x.expose_leased(std::move(name), b.reg->buffer, a, offset, length); });
          },
          py::arg("name"), py::arg("buffer"), py::arg("access") = "r", py::kw_only(), py::arg("offset") = 0,
          py::arg("length") = 0,
          "A segment no peer has standing access to: peers reach ranges of it only through the leases "
          "grant() gives them, while they last.")
      .def(
          "grant",
          [](PyEngine& e, const std::string& peer, const py::iterable& ranges, const std::string& access, double ttl) {
            std::vector<LeaseRange> r;
            for (const py::handle item : ranges) {
              named_entry("grant", r.size(), [&] {
                if (!py::isinstance<py::tuple>(item) || py::len(item) != 3) {
                  throw py::value_error("a range is (segment, offset, length)");
                }
                const auto tup = item.cast<py::tuple>();
                r.push_back({tup[0].cast<std::string>(), to_u64(tup[1], "offset"), to_u64(tup[2], "length")});
              });
            }
            const Access a = parse_access(access, "grant");
            const auto t = to_ms(ttl, "ttl");
            return e.call([&](Engine& x) { return x.grant(peer, r, a, t); });
          },
          py::arg("peer"), py::arg("ranges"), py::arg("access") = "r", py::kw_only(), py::arg("ttl"),
          "Grants peer access to ranges [(segment, offset, length), ...] of this engine's segments for "
          "ttl seconds: returns the lease id (int) the peer uses with lease(), renew(), release(). When "
          "the lease ends (expiry, release, end_lease(), the peer gone, a withdrawal) its windows are "
          "invalidated first; then next_lease_end() returns it and fd is signalled.")
      .def("end_lease", [](PyEngine& e, std::uint64_t lease) { return e.call([&](Engine& x) { return x.end_lease(lease); }); },
           py::arg("lease"), "Ends a lease this engine granted; False if it had ended.")
      .def(
          "next_lease_end",
          [](PyEngine& e) -> py::object {
            const auto end = e.call([](Engine& x) { return x.next_lease_end(); });
            if (!end) return py::none();
            py::dict d;
            d["lease"] = end->lease;
            d["peer"] = end->peer;
            d["cause"] = to_string(end->cause);
            d["reason"] = end->reason;
            return d;
          },
          "The next lease this engine granted that ended: {'lease', 'peer', 'cause', 'reason'} (cause: "
          "expired, released, revoked, peer_lost, withdrawn, failed), or None.")
      .def(
          "lease",
          [](PyEngine& e, const std::string& peer, std::uint64_t lease, double wait) -> py::object {
            const auto w = to_ms(wait, "wait");
            const auto h = e.call([&](Engine& x) { return x.lease(peer, lease, w); });
            if (!h) return py::none();
            py::dict d;
            d["lease"] = h->lease;
            py::list ranges;
            for (const LeaseRange& r : h->ranges) ranges.append(py::make_tuple(r.segment, r.offset, r.length));
            d["ranges"] = ranges;
            d["access"] = to_string(h->access);
            d["expires_in"] = std::chrono::duration<double>(h->expires - std::chrono::steady_clock::now()).count();
            d["ended"] = h->ended;
            d["reason"] = h->reason;
            return d;
          },
          py::arg("peer"), py::arg("lease"), py::kw_only(), py::arg("wait") = 0.0,
          "Lease `lease` that peer granted this engine, once known here (waiting up to `wait` seconds, "
          "linking to the peer if needed): {'lease', 'ranges', 'access', 'expires_in' (seconds, by this "
          "engine's reckoning), 'ended', 'reason'}, or None.")
      .def(
          "renew",
          [](PyEngine& e, const std::string& peer, std::uint64_t lease, double ttl) {
            const auto t = to_ms(ttl, "ttl");
            e.call([&](Engine& x) { x.renew(peer, lease, t); });
          },
          py::arg("peer"), py::arg("lease"), py::kw_only(), py::arg("ttl"),
          "Asks peer to extend the lease to ttl seconds from now (at most its granted ttl); returns at once.")
      .def(
          "release",
          [](PyEngine& e, const std::string& peer, std::uint64_t lease) { e.call([&](Engine& x) { x.release(peer, lease); }); },
          py::arg("peer"), py::arg("lease"),
          "Gives the lease back: transfers on it end lease_expired from now on, and the peer ends it.")
      .def("revoke", [](PyEngine& e, const std::string& peer) { e.call([&](Engine& x) { x.revoke(peer); }); },
           py::arg("peer"),
           "Revokes a peer (name, public key or NAME=KEY), added or not: its windows are invalidated at "
           "once, its links here close, and its next links are refused with the reason until allow().")
      .def("allow", [](PyEngine& e, const std::string& peer) { e.call([&](Engine& x) { x.allow(peer); }); },
           py::arg("peer"), "Undoes revoke(peer); with allowed_peers, also lets peer link from now on.")
      .def("withdraw", [](PyEngine& e, const std::string& name) {
        e.call([&](Engine& x) { x.withdraw(name); });
      })
      .def("local_info",
           [](PyEngine& e) {
             const std::vector<std::uint8_t> info = e.call([](Engine& x) { return x.local_info(); });
             return py::bytes(reinterpret_cast<const char*>(info.data()), info.size());
           },
           "What a peer needs to link to this engine, as bytes for a channel the application already "
           "has (ZMQ, HTTP, an RPC): the record it would publish in a metadata store, never a memory key. "
           "The other side passes them to add_peer(name, info).")
      .def("add_peer",
           [](PyEngine& e, std::string name, py::buffer info) {
             // Any bytes-like object (bytes, bytearray, memoryview, a ZMQ frame's buffer), copied:
             // the call runs without the GIL.
             const py::buffer_info b = info.request();
             if (b.ndim > 1 || (b.ndim == 1 && b.strides[0] != b.itemsize)) {
               throw Error("add_peer", EINVAL, "the info must be contiguous bytes (as local_info() returned them)");
             }
             const auto* p = static_cast<const std::uint8_t*>(b.ptr);
             const std::vector<std::uint8_t> bytes(p, p + b.size * b.itemsize);
             e.call([&](Engine& x) { x.add_peer(std::move(name), bytes); });
           },
           py::arg("name"), py::arg("info"),
           "Adds the engine whose local_info() `info` is, under its name, bound to the public key it names.")
      .def("add_peer",
           [](PyEngine& e, std::string name, std::optional<std::string> address, std::string public_key) {
             e.call([&](Engine& x) {
               if (address) {
                 x.add_peer(std::move(name), std::move(*address), std::move(public_key));
               } else if (!public_key.empty()) {
                 throw Error("add_peer", EINVAL, fmt::format("a public key for '{}' without an address", name),
                             "a peer found in the metadata store proves the key it publishes there");
               } else {
                 x.add_peer(std::move(name));
               }
             });
           },
           py::arg("name"), py::arg("address") = py::none(), py::kw_only(), py::arg("public_key") = "",
           "Adds a peer by name and \"host:port\", or by name alone from the metadata store; "
           "nothing connects until a transfer needs it. The name is the one the engine there runs "
           "under: another engine answering at the address is refused (connect_failed, naming both). "
           "public_key: the key its links must prove (its info()['public_key']); without, the first "
           "one a link proves is pinned.")
      .def("directory",
           [](PyEngine& e) {
             std::vector<PublishedEngine> es = e.call([](Engine& x) { return x.directory(); });
             py::list out;
             for (const PublishedEngine& p : es) {
               py::list rails, segs;
               for (const PublishedRail& r : p.rails) {
                 rails.append(py::dict(py::arg("device") = r.device, py::arg("port") = r.port,
                                       py::arg("link_layer") = r.link_layer, py::arg("gid") = r.gid,
                                       py::arg("subnet") = r.subnet));
               }
               for (const PublishedSegment& s : p.segments) {
                 segs.append(py::dict(py::arg("name") = s.name, py::arg("length") = s.length,
                                      py::arg("memory") = s.memory));
               }
               out.append(py::dict(py::arg("name") = p.name, py::arg("epoch") = p.epoch,
                                   py::arg("endpoints") = p.endpoints, py::arg("rails") = rails,
                                   py::arg("segments") = segs, py::arg("public_key") = p.public_key,
                                   py::arg("transports") = p.transports.empty() ? std::vector<std::string>{"rdma"} : p.transports));
             }
             return out;
           },
           "Every other engine of the cluster in the metadata store, as of the last listing.")
      .def("remove_peer", [](PyEngine& e, const std::string& name) {
        e.call([&](Engine& x) { x.remove_peer(name); });
      })
      .def("peers",
           [](PyEngine& e) {
             std::vector<PeerInfo> ps = e.call([](Engine& x) { return x.peers(); });
             py::list out;
             for (const PeerInfo& p : ps) {
               py::dict d;
               d["name"] = p.name;
               d["address"] = p.address;
               d["worker"] = p.worker;
               d["device"] = p.device;
               d["linked"] = p.linked;
               d["public_key"] = p.public_key;
               d["transport"] = p.transport;
               d["transport_reason"] = p.transport_reason;
               d["wire_version"] = p.wire_version;
               d["key_source"] = p.key_source;
               py::list rails;
               for (const RailInfo& r : p.rails) {
                 py::dict rd;
                 rd["local"] = r.local;
                 rd["peer"] = r.peer;
                 rd["state"] = r.state;
                 rd["reason"] = r.reason;
                 rd["bytes"] = r.bytes;
                 rd["slices"] = r.slices;
                 rd["failures"] = r.failures;
                 rd["reposted"] = r.reposted;
                 rails.append(rd);
               }
               d["rails"] = rails;
               out.append(d);
             }
             return out;
           })
      .def("segment",
           [](PyEngine& e, const std::string& peer, const std::string& name) {
             RemoteSegment s = e.call([&](Engine& x) { return x.segment(peer, name); });
             return PySegment{s, peer, name};
           },
           py::arg("peer"), py::arg("name"))
      .def(
          "connect",
          [](PyEngine& e, const std::string& peer, double timeout) {
            std::string why;
            bool ok = e.call([&](Engine& x) { return x.connect(peer, to_ms(timeout, "connect"), &why); });
            if (!ok) {
              throw KindedError(ErrorKind::peer_lost, "connect", 0,
                                fmt::format("peer {}: {}", peer, why));
            }
          },
          py::arg("peer"), py::arg("timeout") = 10.0,
          "Connects to a peer now and waits until its segments are known (PeerLostError).")
      .def(
          "prepare",
          [](PyEngine& e, const py::iterable& transfers) {
            const std::vector<Transfer> t = resolve_all(e, transfers);
            return PyPlan{e.call([&](Engine& x) { return x.prepare(t); })};
          },
          py::arg("transfers"),
          "Resolves transfers once (their local memory found in the registrations, then the "
          "engine's checks and work requests): submitting the plan then costs no per-transfer "
          "Python work, and a fraction of the engine's. A transfer that could never move raises "
          "rdmakit.Error naming it.")
      .def(
          "submit",
          [](const py::object& self, const py::object& transfers, std::optional<py::bytes> notify,
             std::optional<std::string> request_id) {
            PyEngine& e = self.cast<PyEngine&>();
            PyBatch b = py::isinstance<PyPlan>(transfers)
                            ? e.submit(transfers.cast<const PyPlan&>().plan, notify, std::move(request_id))
                            : e.submit(resolve_all(e, transfers), notify, std::move(request_id));
            b.owner = self;
            return b;
          },
          py::arg("transfers"), py::kw_only(), py::arg("notify") = py::none(), py::arg("request_id") = py::none(),
          "Starts the transfers (a list of rdmakit.Transfer, or a TransferPlan) and returns "
          "their Batch at once. notify: bytes delivered to each peer read from or written to, once "
          "its transfers in the batch completed (at most 900 bytes). request_id: carried in the "
          "notifications and the batch's telemetry (at most 64 bytes). A transfer whose local "
          "memory is not registered raises BufferError; one the engine refuses ends as \"invalid\" "
          "in the batch.")
      .def(
          "prepare_local",
          [](PyEngine& e, const py::iterable& descriptors) {
            PyList out;
            std::vector<LocalDescriptor> d;
            for (const py::handle item : descriptors) {
              named_entry("prepare_local", d.size(), [&] {
                // An object in registered memory (all of it), or (object, offset, length).
                PyTransfer t;
                if (py::isinstance<py::tuple>(item)) {
                  const auto tup = item.cast<py::tuple>();
                  if (tup.size() != 3) throw py::value_error("a tuple is (object, offset, length)");
                  t.local = py::reinterpret_borrow<py::object>(tup[0]);
                  t.local_offset = to_u64(tup[1], "offset");
                  t.length = to_u64(tup[2], "length");
                } else {
                  t.local = py::reinterpret_borrow<py::object>(item);
                }
                const Transfer r = e.resolve(t);  // as a write: read-only memory is noted instead
                out.readonly = out.readonly || e.readonly(r.local);
                d.push_back({r.local, r.local_offset, r.length});
              });
            }
            out.list = e.call([&](Engine& x) { return x.prepare_local(d); });
            return out;
          },
          py::arg("descriptors"),
          "A local descriptor list: each entry an object whose memory lies in a registered one "
          "(all of it), or (object, offset, length). rdmakit.Error names an entry that cannot be.")
      .def(
          "prepare_remote",
          [](PyEngine& e, const py::iterable& descriptors) {
            std::vector<RemoteDescriptor> d;
            for (const py::handle item : descriptors) {
              named_entry("prepare_remote", d.size(), [&] {
                if (!py::isinstance<py::tuple>(item) || py::len(item) != 3) {
                  throw py::value_error("an entry is (RemoteSegment, offset, length)");
                }
                const auto tup = item.cast<py::tuple>();
                d.push_back({tup[0].cast<const PySegment&>().seg, to_u64(tup[1], "offset"), to_u64(tup[2], "length")});
              });
            }
            return PyList{e.call([&](Engine& x) { return x.prepare_remote(d); }), false};
          },
          py::arg("descriptors"),
          "A remote descriptor list: each entry (RemoteSegment, offset, length); the ranges are "
          "checked against the segments by each transfer.")
      .def(
          "submit_indexed",
          [](const py::object& self, const py::object& op, const PyList& local, const py::iterable& local_indices,
             const PyList& remote, const py::iterable& remote_indices, std::optional<py::bytes> notify,
             std::optional<std::string> request_id) {
            PyEngine& e = self.cast<PyEngine&>();
            TransferOp o = TransferOp::read;
            if (!py::isinstance<py::str>(op)) {
              o = op.cast<TransferOp>();
            } else if (const std::string s = op.cast<std::string>(); s == "write") {
              o = TransferOp::write;
            } else if (s != "read") {
              throw py::value_error(fmt::format("op {:?}: \"read\" or \"write\"", s));
            }
            if (o == TransferOp::read && local.readonly) {
              throw_buffer_error("submit_indexed", "a read into a local list with read-only memory in it",
                                 "prepare the list from writable objects");
            }
            // Copied here, under the GIL: what the engine reads cannot change under it.
            const std::vector<std::uint32_t> li = indices_of(local_indices, "local");
            const std::vector<std::uint32_t> ri = indices_of(remote_indices, "remote");
            PyBatch b = e.submit(o, local, li, remote, ri, notify, std::move(request_id));
            b.owner = self;
            return b;
          },
          py::arg("op"), py::arg("local"), py::arg("local_indices"), py::arg("remote"), py::arg("remote_indices"),
          py::kw_only(), py::arg("notify") = py::none(), py::arg("request_id") = py::none(),
          "One transfer per position k, local[local_indices[k]] and remote[remote_indices[k]] "
          "(of one length), \"read\" or \"write\", in one Batch (indices: any iterable of ints, "
          "a numpy array of integers included). rdmakit.Error names the position and index of a "
          "bad one.")
      .def(
          "notify",
          [](const py::object& self, const std::string& peer, const py::bytes& message,
             std::optional<std::string> request_id) {
            PyBatch b = self.cast<PyEngine&>().notify(peer, message, std::move(request_id));
            b.owner = self;
            return b;
          },
          py::arg("peer"), py::arg("message"), py::kw_only(), py::arg("request_id") = py::none(),
          "Sends message (at most 900 bytes) to peer on its own, connecting first if needed: a "
          "Batch of one entry, ok once the message is on its way (or why not: connect_failed, "
          "peer_lost, failed when the peer's queue is full). It waits for no transfer.")
      .def("_take_done", &PyEngine::take_done,
           "For the asyncio reader: tokens of awaited batches that ended since the last call.")
      .def("next_notification",
           [](PyEngine& e) { return e.call([](Engine& x) { return x.next_notification(); }); },
           "The next notification, or None.")
      .def(
          "progress",
          [](PyEngine& e, double budget) {
            return e.call([&](Engine& x) { return x.progress(to_ms(budget, "progress")); });
          },
          py::arg("budget") = 0.0, "workers=0 only: drives the engine for up to budget seconds.")
      .def("notifications", [](py::object self) { return aio("notifications")(self); }, "An async iterator of notifications, driven by the engine's fd in the running loop.");
}

}  // namespace rdmakit::python
