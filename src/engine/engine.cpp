// The engine's public calls, its registries, and the threads that connect and accept links.
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "bootstrap/auth.hpp"
#include "engine/impl.hpp"
#include "engine/locality.hpp"
#include "memory/cuda.hpp"
#include "engine/metadata.hpp"
#include "engine/protocol.hpp"
#include "engine/rails.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit {

using detail::BatchState;
using detail::Peer;
using detail::Worker;

const char* to_string(TransferOp op) noexcept {
  switch (op) {
    case TransferOp::read: return "read";
    case TransferOp::write: return "write";
    case TransferOp::fetch_add: return "fetch_add";
    case TransferOp::compare_swap: return "compare_swap";
  }
  return "?";
}

const char* to_string(TransferStatus s) noexcept {
  switch (s) {
    case TransferStatus::pending: return "pending";
    case TransferStatus::ok: return "ok";
    case TransferStatus::invalid: return "invalid";
    case TransferStatus::no_segment: return "no_segment";
    case TransferStatus::connect_failed: return "connect_failed";
    case TransferStatus::peer_lost: return "peer_lost";
    case TransferStatus::failed: return "failed";
  }
  return "?";
}

namespace {

std::uint64_t fresh_epoch() {
  std::uint64_t v = 0;
  if (::getrandom(&v, sizeof v, 0) != sizeof v) throw Error("getrandom", errno, "choosing the engine's epoch");
  return v | 1;  // never 0, which means "unknown"
}

std::string default_name() {
  char host[256] = {};
  (void)::gethostname(host, sizeof host - 1);
  return fmt::format("{}:{}", host, ::getpid());
}

// What a link's QP must allow for the windows bound on it: everything a segment may allow.
constexpr Access kAllRemote = Access::remote_read | Access::remote_write | Access::remote_atomic;

}  // namespace

// --- BatchState and Batch ------------------------------------------------------------------------

detail::BatchState::BatchState(Engine::Impl* e, std::span<const Transfer> t)
    : size(static_cast<std::uint32_t>(t.size())), engine(e) {
  // One allocation, each entry built once from its transfer (not default-built, then copied).
  x = static_cast<Xfer*>(::operator new(sizeof(Xfer) * std::max<std::size_t>(t.size(), 1)));
  for (std::uint32_t i = 0; i < size; ++i) new (x + i) Xfer(t[i], this, i);
  remaining.store(size, std::memory_order_relaxed);
}

detail::BatchState::~BatchState() {
  static_assert(std::is_trivially_destructible_v<Xfer>);
  ::operator delete(x);
}

void detail::BatchState::finish(Xfer& t, TransferStatus s, std::string reason) noexcept {
  if (t.status.load(std::memory_order_relaxed) != TransferStatus::pending) return;  // ended once
  if (s != TransferStatus::ok) {
    try {
      std::lock_guard lock(mu);
      reasons[t.index] = std::move(reason);
    } catch (...) {
      // Out of memory for the reason: the status still says what happened.
    }
    failed.fetch_add(1, std::memory_order_relaxed);
    engine->count.transfers_failed.fetch_add(1, std::memory_order_relaxed);
  }
  t.status.store(s, std::memory_order_release);
  if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) last_ended();
}

void detail::BatchState::finished_ok(std::uint32_t n) noexcept {
  if (remaining.fetch_sub(n, std::memory_order_acq_rel) == n) last_ended();
}

void detail::BatchState::last_ended() noexcept {
  // The callback first, so that wait() returning (and the descriptor) also means it has run.
  if (on_done) {
    try {
      on_done(Batch(shared_from_this()));
    } catch (...) {
      // A callback that throws must not take the worker down.
    }
  }
  {
    std::lock_guard lock(mu);  // a waiter between its check and its sleep would miss the notify
    callback_ran = true;
  }
  cv.notify_all();
  engine->signal();
}

Batch::Batch(std::shared_ptr<detail::BatchState> state) noexcept : state_(std::move(state)) {}
Batch::Batch(Batch&&) noexcept = default;
Batch& Batch::operator=(Batch&&) noexcept = default;
Batch::~Batch() = default;

bool Batch::done() const noexcept {
  return !state_ || state_->remaining.load(std::memory_order_acquire) == 0;
}

bool Batch::wait(std::chrono::milliseconds timeout) const {
  if (!state_) return true;
  std::unique_lock lock(state_->mu);
  return state_->cv.wait_for(lock, timeout, [this] { return state_->callback_ran; });
}

std::size_t Batch::size() const noexcept { return state_ ? state_->size : 0; }

std::size_t Batch::failed() const noexcept {
  return state_ ? state_->failed.load(std::memory_order_acquire) : 0;
}

TransferResult Batch::result(std::size_t i) const {
  if (i >= size()) throw Error("batch result", EINVAL, fmt::format("transfer {} of a batch of {}", i, size()));
  const TransferStatus st = state_->x[i].status.load(std::memory_order_acquire);
  if (st == TransferStatus::pending || st == TransferStatus::ok) return {st, {}};
  std::lock_guard lock(state_->mu);
  const auto it = state_->reasons.find(static_cast<std::uint32_t>(i));
  return {st, it != state_->reasons.end() ? it->second : std::string{}};
}

std::string Batch::describe_failures() const {
  // Consecutive transfers that failed alike (a missing segment, a lost peer) are one line.
  std::string out;
  std::size_t first = 0;
  TransferResult run;
  auto flush = [&](std::size_t last) {
    if (run.status == TransferStatus::ok || run.status == TransferStatus::pending) return;
    const Transfer& t = state_->x[first].t;
    out += first == last ? fmt::format("transfer {} ({} of {} bytes)", first, to_string(t.op), t.length)
                         : fmt::format("transfers {}-{} (from {} of {} bytes)", first, last, to_string(t.op), t.length);
    out += fmt::format(": {}: {}\n", to_string(run.status), run.reason);
  };
  for (std::size_t i = 0; i < size(); ++i) {
    TransferResult r = result(i);
    if (i > 0 && (r.status != run.status || r.reason != run.reason)) {
      flush(i - 1);
      first = i;
    }
    if (i == 0 || first == i) run = std::move(r);
  }
  if (size() > 0) flush(size() - 1);
  return out;
}

// --- Engine::Impl --------------------------------------------------------------------------------

Engine::Impl::Impl(EngineConfig c)
    : cfg(std::move(c)),
      buffer_table(new std::atomic<detail::BufferRec*>[kMaxBuffers]),
      peer_table(new std::atomic<detail::Peer*>[kMaxPeers]) {
  for (std::uint32_t i = 0; i < kMaxBuffers; ++i) buffer_table[i].store(nullptr, std::memory_order_relaxed);
  for (std::uint32_t i = 0; i < kMaxPeers; ++i) peer_table[i].store(nullptr, std::memory_order_relaxed);
  name = cfg.name.empty() ? default_name() : cfg.name;
  detail::engine_wire::check_name(name, "engine name");
  detail::check_key(cfg.link.psk);
  if (cfg.max_qps < qps_per_link()) {
    throw Error("engine config", EINVAL,
                fmt::format("max_qps {}: a link holds {} QP(s){}", cfg.max_qps, qps_per_link(),
                            qps_per_link() > 1 ? " (its data QP and, over rdma_cm, its control QP)" : ""),
                fmt::format("at least {}", qps_per_link()));
  }
  if (cfg.rails.slice_size < 4096 || cfg.rails.probe_first.count() <= 0 || cfg.rails.probe_max < cfg.rails.probe_first) {
    throw Error("engine config", EINVAL,
                fmt::format("rails: slice_size {} (at least 4096), probe_first {} ms (above 0), probe_max {} ms "
                            "(at least probe_first)",
                            cfg.rails.slice_size, cfg.rails.probe_first.count(), cfg.rails.probe_max.count()));
  }
  const bool store = detail::uses_store(cfg.metadata);
  // One QP per link, no receives: the engine moves data by READ, WRITE and atomics, and its
  // messages travel on the control channel.
  cfg.link.qps = 1;
  cfg.link.recv_depth = 1;
  cfg.link.completion_events = false;
  if (!cfg.link.log) cfg.link.log = detail::default_log;
  epoch = fresh_epoch();
  if (!cfg.link.psk.empty()) psk = std::make_shared<const detail::Secret>(cfg.link.psk);

  layer = detail::DeviceLayer::acquire();
  if (layer->devices().empty()) {
    throw Error("engine", ENODEV, "no RDMA device on this host", "rdmakit doctor says why");
  }
  windows = true;
  for (const auto& d : layer->devices()) {
    pds.push_back(detail::open_pd(d));
    if ((d->attr().device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) == 0 &&
        (d->attr().device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2A) == 0) {
      windows = false;
    }
  }
  if (windows) {
    access_model = "type-2 memory windows: each peer gets its own key per segment, bound on its link's "
                   "QP (useless on any other QP) and revoked per peer";
  } else if (psk) {
    access_model = "region keys (a device has no type-2 memory windows): every authenticated peer gets "
                   "the buffer's own key; revocation deregisters the buffer";
  } else {
    access_model = "none: a device has no type-2 memory windows and the engine has no key, so no segment "
                   "is offered to peers (set EngineConfig::link.psk)";
  }
  event_fd = detail::Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!event_fd) throw Error("eventfd", errno, "the engine's descriptor");
  threads = cfg.workers.value_or(static_cast<std::uint32_t>(layer->devices().size()));
  if (threads > 64) throw Error("engine config", EINVAL, fmt::format("{} workers (at most 64)", threads));
  const std::uint32_t n = std::max<std::uint32_t>(threads, 1);
  for (std::uint32_t i = 0; i < n; ++i) workers.push_back(std::make_unique<Worker>(*this, i));
  if (threads > 0) {
    for (auto& w : workers) w->start();
  }
  try {
    for (int i = 0; i < 4; ++i) connectors.emplace_back([this] { connect_loop(); });
    if (!cfg.listen.empty() && cfg.listen_at_start) start_listening();
    // Published once the listener's port is known (or later, by start_listening()).
    if (store) meta = std::make_unique<detail::MetadataPlane>(*this);
  } catch (...) {
    shut_down();  // threads are running: a listen address in use must not end the process
    throw;
  }
}

detail::Worker* Engine::Impl::worker_for(const std::string& address, std::uint32_t id) {
  const auto n = static_cast<std::uint32_t>(workers.size());
  if (!cfg.workers.has_value() && n > 1) {
    try {
      const std::string src = detail::route_source(detail::parse_host_port(address, 0));
      if (!src.empty()) return workers[device_index(pick_device(layer->catalog(), cfg.link.device, src).name) % n].get();
    } catch (const std::exception&) {
      // No device carries that route: the connect will say so; any worker will do.
    }
  }
  return workers[(id - 1) % n].get();
}

void Engine::Impl::start_listening() {
  std::lock_guard lock(listen_mu);
  if (listener || cfg.listen.empty()) return;
  ListenerConfig lc(cfg.link);
  lc.max_pending = std::max<std::uint32_t>(lc.max_pending, 256);
  listener = detail::listen_with_hooks(cfg.listen, std::move(lc), hooks(nullptr),
                                      [this](Connection c) noexcept { adopt(std::move(c)); });
  listening.store(listener.get(), std::memory_order_release);
  if (meta) meta->changed(/*wait=*/true);  // its endpoints, now that there is a port
}

Engine::Impl::~Impl() {
  shut_down();
  detail::wipe(cfg.link.psk);
}

void Engine::Impl::shut_down() noexcept {
  meta.reset();  // its entry goes first (a clean shutdown), and its thread stops posting
  stopping.store(true);
  connect_cv.notify_all();
  {
    std::lock_guard lock(listen_mu);
    listening.store(nullptr);
    listener.reset();  // its handshakes (which hand links to the workers) end first
  }  // its handshakes end (each bounded by its deadline) before the workers go
  for (auto& t : connectors) t.join();
  connectors.clear();
  for (auto& w : workers) w->stop();
  workers.clear();
}

void Engine::Impl::signal() noexcept {
  const std::uint64_t one = 1;
  (void)!::write(event_fd.get(), &one, sizeof one);
}

detail::BufferRec* Engine::Impl::buffer(std::uint32_t id) const noexcept {
  if (id == 0 || id > kMaxBuffers) return nullptr;
  return buffer_table[id - 1].load(std::memory_order_acquire);
}

detail::Peer* Engine::Impl::peer(std::uint32_t id) const noexcept {
  if (id == 0 || id > kMaxPeers) return nullptr;
  return peer_table[id - 1].load(std::memory_order_acquire);
}

std::uint32_t Engine::Impl::device_index(const std::string& device) const {
  const auto& ds = layer->devices();
  for (std::uint32_t i = 0; i < ds.size(); ++i) {
    if (ds[i]->name() == device) return i;
  }
  throw Error("engine", ENODEV, fmt::format("device {} is not in the device layer", device));
}

detail::HandshakeHooks Engine::Impl::hooks(Worker* preferred) {
  detail::HandshakeHooks h;
  h.attach = [this, preferred](const std::string& device) { return attach(device, preferred); };
  return h;
}

detail::Attachment Engine::Impl::attach(const std::string& device, Worker* preferred) {
  const std::uint32_t d = device_index(device);
  // A QP of the budget: when there is none, idle links are evicted to make room.
  const auto deadline = detail::deadline_in(std::min(cfg.link.handshake_timeout, std::chrono::milliseconds{5000}));
  // Over rdma_cm a link's control channel is a QP too: it counts against the budget.
  const std::uint64_t per = qps_per_link();
  for (bool asked = false;;) {
    std::uint64_t have = count.qps.load();
    if (have + per <= cfg.max_qps && count.qps.compare_exchange_weak(have, have + per)) break;
    if (have + per <= cfg.max_qps) continue;
    if (!asked) {
      for (auto& w : workers) w->post(detail::Command(detail::Command::Kind::evict));
      asked = true;
    }
    if (stopping.load() || detail::Clock::now() >= deadline) {
      throw Error("engine QP budget", EBUSY,
                  fmt::format("{}all {} QPs of the budget are in use by links with work in flight",
                              detail::kBusyReason, cfg.max_qps),
                  "raise EngineConfig::max_qps, or the link waits for others to go idle");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  struct QpTicket {
    QpTicket(std::atomic<std::uint64_t>* q, std::uint64_t n) : qps(q), count(n) {}
    QpTicket(const QpTicket&) = delete;
    QpTicket& operator=(const QpTicket&) = delete;
    ~QpTicket() { qps->fetch_sub(count); }
    std::atomic<std::uint64_t>* qps;
    std::uint64_t count;
  };
  auto ticket = std::make_shared<QpTicket>(&count.qps, per);
  // A worker with room in its CQ there: the preferred one (a peer's own), else round robin.
  // A link this engine opens belongs to its peer's worker; one a peer opens, to any worker.
  const auto n = static_cast<std::uint32_t>(workers.size());
  // With one worker per device, a link a peer opens goes to its device's worker first.
  const std::uint32_t first = preferred != nullptr          ? preferred->index()
                              : !cfg.workers.has_value() ? d % n
                                                          : next_worker.fetch_add(1) % n;
  for (std::uint32_t k = 0; k < (preferred != nullptr ? 1u : n); ++k) {
    if (auto a = workers[(first + k) % n]->attach(d)) {
      a->qp_access = kAllRemote;
      // The link holds its room in the CQ and its QP of the budget, each given back when it goes.
      a->keep = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<QpTicket>>>(a->keep, ticket);
      return *a;
    }
  }
  throw Error("engine", EBUSY,
              fmt::format("{}every worker's CQ on {} is full of links", detail::kBusyReason, device),
              "add workers, or lower EngineConfig::link.send_depth");
}

void Engine::Impl::request_connect(Peer* p, detail::RailState* rail) {
  {
    std::lock_guard lock(connect_mu);
    to_connect.emplace_back(p, rail);
  }
  connect_cv.notify_one();
}

namespace {

// A copy of a link's settings, for one connect that changes some of them; its copy of the key is
// wiped when it goes.
struct LinkConfigCopy {
  explicit LinkConfigCopy(const ConnectionConfig& c) : cfg(c) {}
  LinkConfigCopy(const LinkConfigCopy&) = delete;
  LinkConfigCopy& operator=(const LinkConfigCopy&) = delete;
  ~LinkConfigCopy() { detail::wipe(cfg.psk); }
  ConnectionConfig cfg;
};

}  // namespace

void Engine::Impl::connect_loop() noexcept {
  for (;;) {
    Peer* p = nullptr;
    detail::RailState* rail = nullptr;
    {
      std::unique_lock lock(connect_mu);
      connect_cv.wait(lock, [this] { return stopping.load() || !to_connect.empty(); });
      if (stopping.load()) return;
      std::tie(p, rail) = to_connect.front();
      to_connect.pop_front();
    }
    detail::Command c(detail::Command::Kind::link_up);
    c.peer = p;
    if (rail != nullptr) {
      connect_rail(*p, *rail, c);
      p->worker->post(std::move(c));
      continue;
    }
    for (std::string address;;) {
      {
        std::lock_guard lock(mu);
        address = p->address;
      }
      try {
        if (p->gone.load()) throw Error("connect", EHOSTUNREACH, gone_reason(*p));
        if (p->from_store && cfg.link.retry_refused) {
          // The store says the engine listens there: a refusal means its entry is stale (it
          // died, or restarted elsewhere), which the next listing will tell; waiting out the
          // handshake deadline would only hold the transfers for it.
          LinkConfigCopy once(cfg.link);
          once.cfg.retry_refused = false;
          c.conn.emplace(Connection::Impl::connect(address, once.cfg, {}, hooks(p->worker)));
        } else {
          c.conn.emplace(Connection::Impl::connect(address, cfg.link, {}, hooks(p->worker)));
        }
        c.device = device_index(c.conn->info().device);
        break;
      } catch (const std::exception& e) {
        c.kind = detail::Command::Kind::connect_failed;
        c.conn.reset();
        c.text = fmt::format("connecting to peer '{}' at {}: {}", p->name, address, e.what());
      }
      // The store moved the peer (it restarted elsewhere) while this attempt ran: the transfers
      // waiting for it go to the new address rather than fail with the old one's error.
      std::lock_guard lock(mu);
      if (stopping.load() || p->gone.load() || p->address == address) break;
      c.kind = detail::Command::Kind::link_up;
    }
    try {
      p->worker->post(std::move(c));
    } catch (...) {
      // Out of memory queueing it: the peer's transfers wait for the next attempt.
    }
  }
}

std::vector<detail::RailPort> Engine::Impl::offered_rails() const {
  const Listener* l = listening.load(std::memory_order_acquire);
  const std::string host = cfg.listen.empty() ? std::string{} : detail::parse_host_port(cfg.listen, 0).host;
  return detail::local_rails(layer->catalog(), cfg.link.gid, cfg.rails.devices, l != nullptr ? l->port() : 0, host);
}

void Engine::Impl::connect_rail(Peer& p, detail::RailState& rail, detail::Command& c) noexcept {
  // A further rail: bootstrapped at the peer port's own address, from the local port's device.
  // A probe of a failed rail should not hold a connector for a whole handshake deadline.
  LinkConfigCopy copy(cfg.link);
  ConnectionConfig& rc = copy.cfg;
  rc.device = rail.local.device;
  rc.port = rail.local.port;
  rc.retry_refused = false;
  rc.handshake_timeout = std::min(rc.handshake_timeout, std::chrono::milliseconds{3000});
  c.rail = &rail;
  try {
    if (p.gone.load() || p.removed.load()) throw Error("connect", EHOSTUNREACH, "the peer is gone");
    c.conn.emplace(Connection::Impl::connect(rail.peer.endpoint, rc, {}, hooks(p.worker)));
    c.device = device_index(c.conn->info().device);
  } catch (const std::exception& e) {
    c.kind = detail::Command::Kind::connect_failed;
    c.conn.reset();
    c.text = fmt::format("rail {} to peer '{}' at {}: {}", rail.local.describe(), p.name, rail.peer.endpoint, e.what());
  }
}

void Engine::Impl::adopt(Connection conn) noexcept {
  try {
    auto* w = static_cast<Worker*>(Connection::Impl::of(conn).attached.owner);
    detail::Command c(detail::Command::Kind::link_up);
    c.device = device_index(conn.info().device);
    c.conn = std::move(conn);
    w->post(std::move(c));
  } catch (const std::exception& e) {
    try {
      cfg.link.log(fmt::format("engine {}: taking a link a peer opened: {}", name, e.what()));
    } catch (...) {
    }
  }
}

std::uint32_t Engine::Impl::slot_of(Peer& p, const std::string& segment) {
  std::lock_guard lock(mu);
  auto [it, added] = p.slot_by_name.emplace(segment, static_cast<std::uint32_t>(p.slot_names.size()));
  if (added) p.slot_names.push_back(segment);
  return it->second;
}

Buffer Engine::Impl::publish(std::unique_ptr<detail::BufferRec> rec) {
  for (const auto& r : rec->regions) rec->slices.push_back(r->local());
  rec->numa_node = rec->gpu_pci.empty() ? detail::memory_numa_node(rec->handle.addr) : -1;
  for (const DeviceRank& r : detail::rank_devices(layer->devices(), rec->numa_node, rec->gpu_pci)) {
    rec->rank.push_back(static_cast<std::uint8_t>(r.rank));
  }
  std::lock_guard lock(mu);
  if (buffers.size() >= kMaxBuffers) {
    throw Error("register memory", ENOSPC, fmt::format("{} buffers already (the most an engine holds)", kMaxBuffers));
  }
  rec->handle.id = static_cast<std::uint32_t>(buffers.size() + 1);
  buffers.push_back(std::move(rec));
  buffer_table[buffers.size() - 1].store(buffers.back().get(), std::memory_order_release);
  return buffers.back()->handle;
}

void Engine::Impl::deliver(Notification n) {
  {
    std::lock_guard lock(notes_mu);
    notes.push_back(std::move(n));
  }
  count.notifications_received.fetch_add(1, std::memory_order_relaxed);
  signal();
}

// --- Engine --------------------------------------------------------------------------------------

Engine::Engine(EngineConfig config) : impl_(std::make_unique<Impl>(std::move(config))) {}
Engine::~Engine() = default;

EngineInfo Engine::info() const {
  EngineInfo i;
  i.name = impl_->name;
  i.epoch = impl_->epoch;
  i.port = port();
  for (const auto& d : impl_->layer->devices()) i.devices.push_back(d->name());
  i.memory_windows = impl_->windows;
  i.access_model = impl_->access_model;
  i.metadata = impl_->meta ? impl_->meta->status() : "p2p: peers added by address, no store";
  for (const detail::RailPort& r : impl_->offered_rails()) {
    i.rails.push_back(r.describe() + (!r.endpoint.empty() ? ": peers open rails at " + r.endpoint
                                      : i.port == 0   ? ": not offered (no listener yet)"
                                      : !r.active     ? ": not offered (the port is not ACTIVE)"
                                                      : ": not offered (the listener is bound to " +
                                                            detail::parse_host_port(impl_->cfg.listen, 0).host + ")"));
  }
  return i;
}

EngineCounters Engine::counters() const noexcept {
  const auto& c = impl_->count;
  EngineCounters o;
  o.qps = c.qps.load();
  {
    std::lock_guard lock(impl_->mu);
    o.peers = static_cast<std::uint64_t>(std::count_if(impl_->peers.begin(), impl_->peers.end(),
                                                       [](const auto& p) { return !p->removed.load(); }));
  }
  o.links = c.links.load();
  o.connects = c.connects.load();
  o.reconnects = c.reconnects.load();
  o.accepts = c.accepts.load();
  o.evictions = c.evictions.load();
  o.restarts = c.restarts.load();
  o.batches = c.batches.load();
  o.transfers = c.transfers.load();
  o.transfers_failed = c.transfers_failed.load();
  o.bytes = c.bytes.load();
  o.notifications_sent = c.notifications_sent.load();
  o.notifications_received = c.notifications_received.load();
  o.windows_bound = c.windows_bound.load();
  o.rail_links = c.rail_links.load();
  o.rail_failures = c.rail_failures.load();
  o.slices = c.slices.load();
  o.reposted = c.reposted.load();
  o.window_bind_ns = c.window_bind_ns.load();
  return o;
}

std::uint16_t Engine::port() const noexcept {
  const Listener* l = impl_->listening.load(std::memory_order_acquire);
  return l != nullptr ? l->port() : 0;
}

void Engine::start_listening() { impl_->start_listening(); }

namespace {

// Engine buffers: with windows, no remote access of their own (peers get windows only), and
// binding allowed; without, every remote access (the region's key is what peers get).
Access buffer_access(bool windows) {
  return windows ? Access::local_write | detail::kMwBind : Access::local_write | kAllRemote;
}

}  // namespace

Buffer Engine::register_memory(void* addr, std::size_t length) {
  auto rec = std::make_unique<detail::BufferRec>();
  for (const auto& pd : impl_->pds) {
    rec->regions.emplace_back(MemoryRegion::Impl::wrap(detail::register_region(pd, addr, length, buffer_access(impl_->windows))));
  }
  rec->handle.addr = addr;
  rec->handle.length = length;
  return impl_->publish(std::move(rec));
}

Buffer Engine::allocate_memory(std::size_t length, const MemorySpec& spec) {
  auto rec = std::make_unique<detail::BufferRec>();
  rec->regions.reserve(impl_->pds.size());  // `first` below stays valid
  // The first device allocates (and owns) the memory; the others register the same bytes by
  // their address (host memory, huge pages, CUDA host memory, and GPU memory where the first
  // took it by address too: what nvidia-peermem makes work).
  rec->regions.emplace_back(MemoryRegion::Impl::wrap(
      detail::allocate_region(impl_->pds[0], length, buffer_access(impl_->windows), spec)));
  const MemoryRegion& first = *rec->regions[0];
  if (impl_->pds.size() > 1 && first.path() != RegistrationPath::host_mr &&
      first.path() != RegistrationPath::device_mr) {
    throw Error("allocate_memory", ENOTSUP,
                fmt::format("{} memory took the {} path on {}, which the engine's other devices cannot share",
                            to_string(spec.kind), to_string(first.path()), impl_->layer->devices()[0]->name()),
                "register_memory() registers a host or GPU address on every device; memory that only a "
                "dma-buf or a bounce buffer reaches is shared by one device only, today");
  }
  for (std::size_t d = 1; d < impl_->pds.size(); ++d) {
    rec->regions.emplace_back(MemoryRegion::Impl::wrap(
        detail::register_region(impl_->pds[d], first.local().addr(), length, buffer_access(impl_->windows))));
  }
  rec->handle.addr = first.data();
  rec->handle.length = length;
  if (spec.kind == MemoryKind::cuda) rec->gpu_pci = detail::pci_path_of_bus(detail::cuda_pci_bus_id(spec.gpu));
  return impl_->publish(std::move(rec));
}

std::vector<DeviceRank> Engine::locality(const Buffer& buffer) const {
  const detail::BufferRec* b = impl_->buffer(buffer.id);
  if (b == nullptr || b->retired.load()) throw Error("locality", EINVAL, fmt::format("buffer {} is not this engine's", buffer.id));
  return detail::rank_devices(impl_->layer->devices(), b->numa_node, b->gpu_pci);
}

void Engine::expose(std::string name, const Buffer& buffer, Access access, std::uint64_t offset, std::uint64_t length) {
  detail::engine_wire::check_name(name, "segment name");
  const detail::BufferRec* b = impl_->buffer(buffer.id);
  if (b == nullptr) throw Error("expose", EINVAL, fmt::format("segment '{}': buffer {} is not this engine's", name, buffer.id));
  if (length == 0) length = b->handle.length - std::min<std::uint64_t>(offset, b->handle.length);
  if (offset > b->handle.length || length > b->handle.length - offset || length == 0) {
    throw Error("expose", EINVAL, fmt::format("segment '{}': [{}, +{}) is not inside the buffer of {} bytes", name, offset, length, b->handle.length));
  }
  if (access == Access::none ||
      (static_cast<std::uint32_t>(access) & ~static_cast<std::uint32_t>(kAllRemote)) != 0) {
    throw Error("expose", EINVAL, fmt::format("segment '{}': access {} (remote_read, remote_write, remote_atomic)", name, to_string(access)));
  }
  {
    std::lock_guard lock(impl_->mu);  // unregister_memory() retires a buffer under it
    if (b->retired.load()) throw Error("expose", EINVAL, fmt::format("segment '{}': buffer {} was unregistered", name, buffer.id));
    if (impl_->segments.count(name) != 0) throw Error("expose", EEXIST, fmt::format("a segment '{}' exists", name));
    impl_->segments[name] = {name, buffer.id, offset, length, access};
  }
  for (auto& w : impl_->workers) w->post(detail::Command(detail::Command::Kind::expose, nullptr, name));
  if (impl_->meta) impl_->meta->changed(/*wait=*/false);
}

void Engine::unregister_memory(const Buffer& buffer, std::chrono::milliseconds timeout) {
  detail::BufferRec* b = impl_->buffer(buffer.id);
  if (b == nullptr) throw Error("unregister_memory", EINVAL, fmt::format("buffer {} is not this engine's", buffer.id));
  if (b->released.load()) throw Error("unregister_memory", EINVAL, fmt::format("buffer {} was unregistered already", buffer.id));
  {
    std::lock_guard lock(impl_->mu);
    std::string users;
    for (const auto& [n, s] : impl_->segments) {
      if (s.buffer == buffer.id) users += (users.empty() ? "'" : ", '") + n + "'";
    }
    if (!users.empty()) {
      throw Error("unregister_memory", EBUSY, fmt::format("buffer {} backs segment(s) {}", buffer.id, users),
                  "withdraw them first: peers may be reading and writing it");
    }
    b->retired.store(true, std::memory_order_release);  // from here, its new transfers are refused
  }
  // Each worker says when none of its transfers in flight uses the buffer; then no request the
  // NIC may still process names its regions, and they go.
  auto r = std::make_shared<detail::Retirement>();
  r->buffer = buffer.id;
  r->workers_left = static_cast<std::uint32_t>(impl_->workers.size());
  for (auto& w : impl_->workers) {
    detail::Command c(detail::Command::Kind::retire);
    c.retirement = r;
    w->post(std::move(c));
  }
  const auto until = detail::deadline_in(timeout);
  std::unique_lock lock(r->m);
  while (r->workers_left > 0 && detail::Clock::now() < until) {
    if (impl_->threads == 0) {
      lock.unlock();  // no worker thread: this call drives them
      (void)impl_->workers[0]->run(std::min(until, detail::deadline_in(std::chrono::milliseconds{10})), false);
      lock.lock();
    } else {
      r->cv.wait_until(lock, until, [&] { return r->workers_left == 0; });
    }
  }
  if (r->workers_left > 0) {
    throw Error("unregister_memory", ETIMEDOUT,
                fmt::format("buffer {}: its transfers in flight did not end within {} ms", buffer.id, timeout.count()),
                "it stays registered (and refuses new transfers): call again once they have ended");
  }
  lock.unlock();
  std::lock_guard reg(impl_->mu);
  if (b->released.exchange(true)) return;  // another call released it meanwhile
  b->slices.clear();
  b->regions.clear();  // deregistered on every device
}

void Engine::withdraw(const std::string& name) {
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->segments.erase(name) == 0) throw Error("withdraw", ENOENT, fmt::format("no segment '{}'", name));
  }
  for (auto& w : impl_->workers) w->post(detail::Command(detail::Command::Kind::withdraw, nullptr, name));
  if (impl_->meta) impl_->meta->changed(/*wait=*/false);
}

detail::Peer* Engine::Impl::add_peer(std::string peer_name, std::string address, bool from_store) {
  detail::engine_wire::check_name(peer_name, "peer name");
  (void)detail::parse_host_port(address, 0);
  std::lock_guard lock(mu);
  if (peer_ids.count(peer_name) != 0) throw Error("add_peer", EEXIST, fmt::format("a peer '{}' exists", peer_name));
  if (peers.size() >= kMaxPeers) throw Error("add_peer", ENOSPC, fmt::format("{} peers already", kMaxPeers));
  auto p = std::make_unique<Peer>();
  p->id = static_cast<std::uint32_t>(peers.size() + 1);
  p->name = std::move(peer_name);
  p->address = std::move(address);
  p->from_store = from_store;
  p->worker = worker_for(p->address, p->id);
  p->rails.push_back(std::make_unique<detail::RailState>());
  peer_ids[p->name] = p->id;
  peers.push_back(std::move(p));
  peer_table[peers.size() - 1].store(peers.back().get(), std::memory_order_release);
  return peers.back().get();
}

detail::Peer* Engine::Impl::named(const std::string& peer_name, const char* verb) {
  {
    std::lock_guard lock(mu);
    if (const auto it = peer_ids.find(peer_name); it != peer_ids.end()) return peer(it->second);
  }
  if (!meta) {
    throw Error(verb, ENOENT, fmt::format("no peer '{}' (add_peer first: the engine has no metadata store)", peer_name));
  }
  const detail::metadata::EngineRecord r = meta->lookup(peer_name, detail::deadline_in(cfg.metadata.call_timeout));
  if (r.endpoints.empty()) {
    throw Error(verb, EADDRNOTAVAIL, fmt::format("engine '{}' in {} publishes no endpoint", peer_name, meta->shown()),
                "it does not listen (EngineConfig::listen), so only it can open links");
  }
  try {
    return add_peer(peer_name, r.endpoints.front(), /*from_store=*/true);
  } catch (const Error& e) {
    if (e.sys_errno() != EEXIST) throw;
    std::lock_guard lock(mu);  // another thread added it meanwhile
    return peer(peer_ids.at(peer_name));
  }
}

std::string Engine::Impl::gone_reason(const Peer& p) const {
  std::lock_guard lock(mu);
  return p.gone_reason;
}

void Engine::add_peer(std::string name, std::string address) {
  (void)impl_->add_peer(std::move(name), std::move(address), /*from_store=*/false);
}

void Engine::add_peer(std::string name) {
  if (!impl_->meta) {
    throw Error("add_peer", EINVAL,
                fmt::format("peer '{}' has no address, and the engine has no metadata store to find it in", name),
                "add_peer(name, \"host:port\"), or EngineConfig::metadata = a redis:// or etcd:// store");
  }
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->peer_ids.count(name) != 0) throw Error("add_peer", EEXIST, fmt::format("a peer '{}' exists", name));
  }
  (void)impl_->named(name, "add_peer");
}

std::vector<PublishedEngine> Engine::directory() const {
  return impl_->meta ? impl_->meta->known() : std::vector<PublishedEngine>{};
}

void Engine::remove_peer(const std::string& name) {
  Peer* p = nullptr;
  {
    std::lock_guard lock(impl_->mu);
    const auto it = impl_->peer_ids.find(name);
    if (it == impl_->peer_ids.end()) throw Error("remove_peer", ENOENT, fmt::format("no peer '{}'", name));
    p = impl_->peer(it->second);
    impl_->peer_ids.erase(it);  // the name may be added again, as a new peer
  }
  p->removed.store(true);
  // Its accepted links (found by the name in their IDENT) are on any worker.
  for (auto& w : impl_->workers) w->post(detail::Command(detail::Command::Kind::remove_peer, p, name));
}

std::vector<PeerInfo> Engine::peers() const {
  std::vector<PeerInfo> out;
  std::lock_guard lock(impl_->mu);
  const auto& devices = impl_->layer->devices();
  for (const auto& p : impl_->peers) {
    if (impl_->peer_ids.count(p->name) == 0 || impl_->peer_ids.at(p->name) != p->id) continue;  // removed
    PeerInfo i{p->name, p->address, p->worker->index(), {}, false};
    const int d = p->device.load(std::memory_order_relaxed);
    if (d >= 0 && static_cast<std::size_t>(d) < devices.size()) i.device = devices[static_cast<std::size_t>(d)]->name();
    {
      std::lock_guard pl(p->m);
      i.linked = p->up;
      for (const auto& r : p->rails) {
        if (r->local.device.empty()) continue;  // the first, before its link came up
        i.rails.push_back({r->local.describe(), r->peer.device.empty() ? std::string{} : r->peer.describe(), r->state,
                           r->reason, r->bytes.load(), r->slices.load(), r->failures.load(), r->reposted.load()});
      }
      for (const auto& u : p->unused_rails) i.rails.push_back({u.local, {}, "unused", u.reason, 0, 0, 0, 0});
    }
    out.push_back(std::move(i));
  }
  return out;
}

RemoteSegment Engine::segment(const std::string& peer, const std::string& segment) {
  detail::engine_wire::check_name(segment, "segment name");
  Peer* p = impl_->named(peer, "segment");
  return {p->id, impl_->slot_of(*p, segment)};
}

bool Engine::connect(const std::string& peer, std::chrono::milliseconds timeout, std::string* why) {
  Peer* p = impl_->named(peer, "connect");
  std::unique_lock lock(p->m);
  const std::uint64_t before = p->attempts;
  lock.unlock();
  p->worker->post(detail::Command(detail::Command::Kind::kick, p));
  // Up, and its further rails tried (each up or down: a rail that fails does not fail this).
  const auto rails_tried = [&] {
    return std::none_of(p->rails.begin() + 1, p->rails.end(), [](const auto& r) { return r->state == "connecting"; });
  };
  const auto settled = [&] { return (p->up && rails_tried()) || (!p->up && p->attempts > before); };
  const auto until = detail::deadline_in(timeout);
  lock.lock();
  if (impl_->threads == 0) {
    // No worker thread: this call drives the progress that connects.
    while (!settled() && detail::Clock::now() < until) {
      lock.unlock();
      (void)impl_->workers[0]->run(std::min(until, detail::deadline_in(std::chrono::milliseconds{10})), false);
      lock.lock();
    }
  } else {
    p->cv.wait_until(lock, until, settled);
  }
  if (p->up) return true;
  if (why != nullptr) {
    *why = settled() ? p->last_error : fmt::format("no link to '{}' within {} ms", peer, timeout.count());
  }
  return false;
}

Batch Engine::submit(std::span<const Transfer> transfers, SubmitOptions options) {
  if (options.notify.size() > max_notification) {
    throw Error("submit", EMSGSIZE, fmt::format("a notification of {} bytes; at most {}", options.notify.size(), max_notification));
  }
  auto state = std::make_shared<BatchState>(impl_.get(), transfers);
  state->notify = std::move(options.notify);
  state->on_done = std::move(options.on_done);
  impl_->count.batches.fetch_add(1, std::memory_order_relaxed);
  impl_->count.transfers.fetch_add(transfers.size(), std::memory_order_relaxed);
  Batch batch(state);
  if (transfers.empty()) {  // done at once, like any batch
    if (state->on_done) {
      try {
        state->on_done(batch);
      } catch (...) {
      }
    }
    {
      std::lock_guard lock(state->mu);
      state->callback_ran = true;
    }
    impl_->signal();
    return batch;
  }
  // The workers check each transfer (and end a bad one at once); here they are only sent to
  // their peers' workers: with one worker, without looking at them.
  const std::size_t workers = impl_->workers.size();
  if (workers == 1) {
    detail::Command c(detail::Command::Kind::submit);
    c.batch = std::move(state);
    impl_->workers[0]->post(std::move(c));
    return batch;
  }
  std::vector<std::vector<std::uint32_t>> per_worker(workers);
  for (std::uint32_t i = 0; i < transfers.size(); ++i) {
    // An unknown peer goes to worker 0, which says so.
    const Peer* p = impl_->peer(transfers[i].remote.peer);
    per_worker[p != nullptr ? p->worker->index() : 0].push_back(i);
  }
  for (std::size_t w = 0; w < workers; ++w) {
    if (per_worker[w].empty()) continue;
    detail::Command c(detail::Command::Kind::submit);
    c.batch = state;
    c.indexes = std::move(per_worker[w]);
    impl_->workers[w]->post(std::move(c));
  }
  return batch;
}

std::optional<Notification> Engine::next_notification() {
  std::lock_guard lock(impl_->notes_mu);
  if (impl_->notes.empty()) return std::nullopt;
  Notification n = std::move(impl_->notes.front());
  impl_->notes.pop_front();
  return n;
}

int Engine::fd() const noexcept { return impl_->event_fd.get(); }

std::size_t Engine::progress(std::chrono::milliseconds budget) {
  if (impl_->threads != 0) {
    throw Error("progress", EINVAL, "the engine has worker threads (EngineConfig::workers > 0)");
  }
  return impl_->workers[0]->run(detail::deadline_in(budget), false);
}

}  // namespace rdmakit
