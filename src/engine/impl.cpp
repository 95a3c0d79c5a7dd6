// SPDX-License-Identifier: Apache-2.0
// The engine's internals: its registries of buffers and peers, its workers and devices, and the
// threads that connect and accept links.
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <cerrno>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/thread_name.hpp"
#include "bootstrap/auth.hpp"
#include "engine/admission.hpp"
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

}  // namespace

Engine::Impl::Impl(EngineConfig c)
    : cfg(std::move(c)),
      buffer_table(new std::atomic<detail::BufferRec*>[kMaxBuffers]),
      peer_table(new std::atomic<detail::Peer*>[kMaxPeers]),
      peer_worker(new std::atomic<std::uint32_t>[kMaxPeers]) {
  for (std::uint32_t i = 0; i < kMaxBuffers; ++i) buffer_table[i].store(nullptr, std::memory_order_relaxed);
  for (std::uint32_t i = 0; i < kMaxPeers; ++i) peer_table[i].store(nullptr, std::memory_order_relaxed);
  for (std::uint32_t i = 0; i < kMaxPeers; ++i) peer_worker[i].store(0, std::memory_order_relaxed);
  salt = fresh_epoch();
  leases_made = fresh_epoch() >> 1;  // lease ids start at a random point (their own: they are shown to peers)
  name = cfg.name.empty() ? default_name() : cfg.name;
  if (!cfg.link.log) cfg.link.log = detail::default_log;  // before the first warning below
  detail::check_engine_name(name, "engine name");
  detail::check_key(cfg.link.psk);
  if (!cfg.identity.empty() && cfg.link.psk.empty()) {
    throw Error("engine config", EINVAL, "an identity without a pre-shared key (link.psk)",
                "an identity signs each link's keyed session: give the engine the cluster's key too "
                "(rdmakit keygen FILE; --psk-file)");
  }
  for (const std::string& p : cfg.allowed_peers) detail::check_peer_entry(p, "engine config: allowed_peers");
  allowed = cfg.allowed_peers;
  if (!allowed.empty() && cfg.link.psk.empty()) {
    cfg.link.log(fmt::format("engine {}: allowed_peers without a pre-shared key: a peer's name is whatever it says, "
                             "and anyone who reaches the port can say it (give link.psk, and identities)", name));
  }
  if (cfg.wait_spin < std::chrono::microseconds{0} || cfg.wait_spin > std::chrono::seconds{1}) {
    throw Error("engine config", EINVAL, fmt::format("wait_spin {} us (0 to 1000000)", cfg.wait_spin.count()));
  }
  // Waits spin their whole wait_spin until the engine has seen what they take.
  wait_avg_ns.store(std::chrono::nanoseconds(cfg.wait_spin).count() / 4, std::memory_order_relaxed);
  if (cfg.idle_after < std::chrono::milliseconds{100}) {
    throw Error("engine config", EINVAL, fmt::format("idle_after {} ms (at least 100)", cfg.idle_after.count()));
  }
  if (cfg.control_timeout < std::chrono::milliseconds{100}) {
    throw Error("engine config", EINVAL, fmt::format("control_timeout {} ms (at least 100)", cfg.control_timeout.count()));
  }
  if (cfg.notification_queue == 0 || cfg.notification_queue > 65536) {
    throw Error("engine config", EINVAL, fmt::format("notification_queue {} (1..65536)", cfg.notification_queue));
  }
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
  epoch = fresh_epoch();
  if (!cfg.link.psk.empty()) psk = std::make_shared<const detail::Secret>(cfg.link.psk);
  if (!psk && !cfg.listen.empty()) {
    // Protected by default (in the spirit of Redis's protected mode, though a remote peer here is
    // refused by the TCP stack, not told why): a keyless listener serves whoever reaches it, so
    // one given no address serves this host only. An address given is the opt-in.
    const detail::HostPort at = detail::parse_host_port(cfg.listen, 0);
    if (at.host.empty()) {
      if (cfg.link.method == ConnectMethod::rdma_cm) {
        // rdma_cm resolves a listener's address to an RDMA device, and none has 127.0.0.1.
        throw Error("engine config", EINVAL,
                    fmt::format("listen \"{}\" over rdma_cm without a key: a keyless engine serves whoever reaches "
                                "it, so it listens on loopback unless given an address, and rdma_cm has no loopback",
                                cfg.listen),
                    "give link.psk (rdmakit keygen FILE; --psk-file), name the address to serve without a key "
                    "(the host's or NIC's, or 0.0.0.0:PORT for every one), or listen = \"\" for an engine that only "
                    "initiates");
      }
      cfg.listen = detail::HostPort{"127.0.0.1", at.port}.to_string();
      listen_note = "127.0.0.1 only: the engine has no key (set link.psk, or name the address to serve other hosts "
                    "without one, e.g. 0.0.0.0:PORT)";
      if (store) {
        cfg.link.log(fmt::format("engine {}: publishes {} to the metadata store, but listens on 127.0.0.1 only, "
                                 "which only engines on this host reach: it has no key (set link.psk, or name the "
                                 "address in listen)",
                                 name, cfg.metadata.advertise.empty() ? std::string("127.0.0.1")
                                                                      : fmt::format("{}", fmt::join(cfg.metadata.advertise, ", "))));
      }
    }
    // An address named: the listener says, once it listens, who may reach it without a key.
  }

  choose_transports();
  for (std::uint32_t d = 0; d < device_count(); ++d) gate->device_names.push_back(device_name(d));
  gate->rdma_devices = rdma_count;
  std::string without;
  for (const auto& d : rdma_devices) {
    pds.push_back(detail::open_pd(d));
    if (without.empty() && (d->attr().device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) == 0 &&
        (d->attr().device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2A) == 0) {
      without = d->name();
    }
  }
  choose_access(without.empty(), without);
  event_fd = detail::Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!event_fd) throw Error("eventfd", errno, "the engine's descriptor");
  threads = cfg.workers.value_or(std::max<std::uint32_t>(rdma_count, 1));
  if (threads > 64) throw Error("engine config", EINVAL, fmt::format("{} workers (at most 64)", threads));
  if (!cfg.worker_cpus.empty() && threads == 0) {
    throw Error("engine config", EINVAL, "worker_cpus with workers = 0: there are no worker threads to pin",
                "pin the thread that calls progress() yourself, or give the engine workers");
  }
  for (const int cpu : cfg.worker_cpus) {
    // Whether the process may run there is the kernel's to say, as each worker is pinned.
    if (cpu < 0 || cpu >= CPU_SETSIZE) {
      throw Error("engine config", EINVAL, fmt::format("worker_cpus: CPU {} is not one this process may run on", cpu),
                  fmt::format("CPUs are numbered 0 to {}", CPU_SETSIZE - 1));
    }
  }
  const std::uint32_t n = std::max<std::uint32_t>(threads, 1);
  for (std::uint32_t i = 0; i < n; ++i) workers.push_back(std::make_unique<Worker>(*this, i));
  if (threads > 0) {
    for (auto& w : workers) w->start();
  }
  try {
    {
      std::lock_guard lock(connect_mu);
      for (int i = 0; i < 2; ++i) connectors.emplace_back([this] { connect_loop(); });
    }
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
      if (!src.empty()) return workers[device_index(pick_device(catalog(), cfg.link.device, src).name) % n].get();
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
  // A tcp link's data streams are handshakes of their own (one message each): room for a few
  // links of one host being set up at once.
  lc.max_handshakes_per_peer = std::max<std::uint32_t>(lc.max_handshakes_per_peer, 4 * (cfg.tcp_streams + 1));
  listener = detail::listen_with_hooks(cfg.listen, std::move(lc), hooks(nullptr),
                                      [this](Connection c) noexcept { adopt(std::move(c)); });
  listen_port.store(listener->port(), std::memory_order_release);
  listening.store(listener.get(), std::memory_order_release);
  if (meta) meta->changed(/*wait=*/true);  // its endpoints, now that there is a port
}

void Engine::Impl::choose_access(bool with_windows, std::string device) {
  windows = with_windows;
  no_windows_device = std::move(device);
  if (windows) {
    access_model = "type-2 memory windows: each peer gets its own key per segment, bound on its link's "
                   "QP (useless on any other QP) and revoked per peer";
  } else if (!cfg.allow_region_keys) {
    access_model = fmt::format("none: device {} has no type-2 memory windows, and region keys are not allowed "
                               "(EngineConfig::allow_region_keys): expose() refuses", no_windows_device);
  } else if (psk) {
    access_model = fmt::format("region keys, per buffer (device {} has no type-2 memory windows): every peer "
                               "holding the link key gets the buffer's own key, to the whole buffer with its "
                               "access; withdraw() and remove_peer() revoke nothing until the buffer is "
                               "registered again", no_windows_device);
    cfg.link.log(fmt::format("engine {}: access is per buffer: {}", name, access_model));
  } else {
    access_model = fmt::format("none: device {} has no type-2 memory windows and the engine has no key, so no "
                               "segment is offered to peers (set EngineConfig::link.psk)", no_windows_device);
  }
}

Engine::Impl::~Impl() {
  shut_down();
  detail::wipe(cfg.link.psk);
}

std::chrono::nanoseconds Engine::Impl::spin_for() const noexcept {
  if (threads == 0) return {};  // progress() moves transfers: a wait has nothing to poll
  const std::chrono::nanoseconds most = cfg.wait_spin;
  const std::chrono::nanoseconds avg{wait_avg_ns.load(std::memory_order_relaxed)};
  // Waits that take longer than the whole spin (bulk batches) would only burn it: they sleep.
  if (avg > most) return {};
  // Enough for a wait somewhat slower than the average (the wire's tail), no more.
  return std::clamp(4 * avg, std::min(most, std::chrono::nanoseconds{std::chrono::microseconds{20}}), most);
}

void Engine::Impl::add_served(const std::string& peer, std::uint64_t bytes) {
  std::lock_guard lock(served_mu);
  auto it = served.find(peer);
  if (it == served.end()) it = served.emplace(served.size() < kServedNames ? peer : std::string{}, 0).first;
  it->second = bytes > ~it->second ? ~std::uint64_t{0} : it->second + bytes;  // a peer's figure: never wraps
}

void Engine::Impl::waited(std::chrono::nanoseconds took) noexcept {
  // Racing waiters may lose each other's updates: it is a hint, kept without a lock.
  const std::int64_t avg = wait_avg_ns.load(std::memory_order_relaxed);
  wait_avg_ns.store(avg + (took.count() - avg) / 8, std::memory_order_relaxed);
}

void Engine::Impl::shut_down() noexcept {
  gate->close();  // no waiter polls a worker from here on (they sleep until stop() ends theirs)
  meta.reset();  // its entry goes first (a clean shutdown), and its thread stops posting
  std::vector<std::thread> connecting;
  {
    std::lock_guard lock(connect_mu);  // no connector is added from here on
    stopping.store(true);
    connecting.swap(connectors);
  }
  stop_handshakes->request();
  connect_cv.notify_all();
  {
    std::lock_guard lock(listen_mu);
    listening.store(nullptr);
    listener.reset();  // its handshakes (which hand links to the workers) end first
  }  // its handshakes end (each bounded by its deadline) before the workers go
  for (auto& t : connecting) t.join();
  for (auto& w : workers) w->stop();
  workers.clear();
}

void Engine::Impl::signal_fd() noexcept {
  const std::uint64_t one = 1;
  (void)!::write(event_fd.get(), &one, sizeof one);
}

std::uint32_t Engine::Impl::device_index(const std::string& device) const {
  const auto& ds = rdma_devices;
  for (std::uint32_t i = 0; i < ds.size(); ++i) {
    if (ds[i]->name() == device) return i;
  }
  if (device == "tcp") return soft_index(wire::LinkTransport::tcp);
  if (device == "shm") return soft_index(wire::LinkTransport::shm);
  throw Error("engine", ENODEV, fmt::format("device {} is not one of the engine's devices", device));
}

detail::HandshakeHooks Engine::Impl::hooks(Worker* preferred) {
  detail::HandshakeHooks h;
  h.attach = [this, preferred](const std::string& device) { return attach(device, preferred); };
  if (!cfg.devices.empty()) {
    for (const auto& d : rdma_devices) h.devices.push_back(d->name());
  }
  h.transports = offer;
  h.transports_note = offer_note;
  h.engine_protocol_min = detail::engine_wire::kMinVersion;
  h.engine_protocol_max = detail::engine_wire::kVersion;
  h.shm_shares_from = detail::engine_wire::kSharesFrom;
  h.shm_shares = cfg.shm_map;
  h.tcp_streams = static_cast<std::uint8_t>(cfg.tcp_streams);
  h.self = self;
  h.streams = streams;
  h.shm_socket = shm_socket;
  h.shm_ring = !shm_ring_why.empty();
  h.shm_ring_why = shm_ring_why;
  h.shm_no_attach = shm_no_attach;
  h.attach_soft = [this, preferred](wire::LinkTransport k) { return attach_soft(k, preferred); };
  h.stop = stop_handshakes;
  return h;
}

std::shared_ptr<void> Engine::Impl::take_qps() {
  // A QP of the budget: when there is none, idle links are evicted to make room.
  const auto deadline = detail::deadline_in(std::min(cfg.link.handshake_timeout, std::chrono::milliseconds{5000}));
  // Over rdma_cm a link's control channel is a QP too: it counts against the budget.
  const std::uint64_t per = qps_per_link();
  for (auto ask = detail::Clock::now();;) {
    std::uint64_t have = count.qps.load();
    if (have + per <= cfg.max_qps && count.qps.compare_exchange_weak(have, have + per)) break;
    if (have + per <= cfg.max_qps) continue;
    if (detail::Clock::now() >= ask) {
      // Again every 200 ms: a link may become idle (by evidence) while this one waits.
      for (auto& w : workers) w->post(detail::Command(detail::Command::Kind::evict));
      ask = detail::Clock::now() + std::chrono::milliseconds{200};
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
  return std::make_shared<QpTicket>(&count.qps, per);
}

std::optional<detail::Attachment> Engine::Impl::attach_to(std::uint32_t d, Worker* preferred, std::uint32_t first_choice) {
  std::shared_ptr<void> ticket = take_qps();
  // A worker with room in its CQ there: the preferred one (a peer's own), else from
  // `first_choice` round. A link this engine opens belongs to its peer's worker; one a peer
  // opens, to any worker.
  const auto n = static_cast<std::uint32_t>(workers.size());
  const std::uint32_t first = preferred != nullptr ? preferred->index() : first_choice % n;
  for (std::uint32_t k = 0; k < (preferred != nullptr ? 1u : n); ++k) {
    if (auto a = workers[(first + k) % n]->attach(d)) {
      // The link holds its room in the CQ and its QP of the budget, each given back when it goes.
      // The pair's second goes first: the CQ's room before the QP of the budget, so that a link
      // waiting for that QP (take_qps) then finds the room too.
      a->keep = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(ticket, a->keep);
      return a;
    }
  }
  return std::nullopt;
}

detail::Attachment Engine::Impl::attach(const std::string& device, Worker* preferred) {
  const std::uint32_t d = device_index(device);
  // With one worker per device, a link a peer opens goes to its device's worker first.
  auto a = attach_to(d, preferred, preferred != nullptr || !cfg.workers.has_value() ? d : next_worker.fetch_add(1));
  if (!a) {
    throw Error("engine", EBUSY, fmt::format("{}every worker's CQ on {} is full of links", detail::kBusyReason, device),
                "add workers, or lower EngineConfig::link.send_depth");
  }
  a->qp_access = detail::kAllRemote;
  return *a;
}

void Engine::Impl::request_connect(Peer* p, detail::RailState* rail) {
  {
    std::lock_guard lock(connect_mu);
    to_connect.emplace_back(p, rail);
    // Every connector is in a handshake (maybe with a host that never answers): one more, so
    // this one does not wait behind them.
    if (to_connect.size() > idle_connectors && connectors.size() < kMaxConnectors && !stopping.load()) {
      try {
        connectors.emplace_back([this] { connect_loop(); });
      } catch (const std::system_error&) {
        // No thread to be had: the ones there are take it in turn.
      }
    }
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
  detail::name_this_thread("rdmakit-connect");
  for (;;) {
    Peer* p = nullptr;
    detail::RailState* rail = nullptr;
    {
      std::unique_lock lock(connect_mu);
      ++idle_connectors;
      connect_cv.wait(lock, [this] { return stopping.load() || !to_connect.empty(); });
      --idle_connectors;
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
        // A record held back while a live link disagreed with it: that link is down now.
        if (!p->held_address.empty()) p->address = std::exchange(p->held_address, {});
        if (!p->held_key.empty()) {
          p->public_key = std::exchange(p->held_key, {});
          p->key_source = "store";
        }
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
  const std::string host = cfg.listen.empty() ? std::string{} : detail::parse_host_port(cfg.listen, 0).host;
  return detail::local_rails(catalog(), cfg.link.gid, cfg.rails.devices,
                             listen_port.load(std::memory_order_acquire), host);
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
  if (added) {
    p.slot_names.push_back(segment);
    p.slots.store(static_cast<std::uint32_t>(p.slot_names.size()), std::memory_order_release);
  }
  return it->second;
}

std::uint32_t Engine::Impl::next_generation() {
  // splitmix64 of the engine's salt and a count, 31 bits of it: a handle of a buffer or peer
  // that went matches the one that took its id with odds of 2^-31, another engine's likewise.
  std::uint64_t z = salt + ++handles_made * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<std::uint32_t>(z) | 1;  // never 0: a default-built handle matches nothing
}

Buffer Engine::Impl::publish(std::unique_ptr<detail::BufferRec> rec) {
  for (const auto& r : rec->regions) rec->slices.push_back(r->local());
  soft_slices(*rec);
  rec->numa_node = rec->gpu_pci.empty() ? detail::memory_numa_node(rec->handle.addr) : -1;
  for (const DeviceRank& r : detail::rank_devices(rdma_devices, rec->numa_node, rec->gpu_pci)) {
    rec->rank.push_back(static_cast<std::uint8_t>(r.rank));
  }
  std::lock_guard lock(mu);
  std::uint32_t id = 0;
  if (!free_buffer_ids.empty()) {
    id = free_buffer_ids.back();
    free_buffer_ids.pop_back();
  } else if (buffers.size() < kMaxBuffers) {
    buffers.emplace_back();
    id = static_cast<std::uint32_t>(buffers.size());
  } else {
    throw Error("register memory", ENOSPC,
                fmt::format("{} buffers registered (the most an engine holds at once)", kMaxBuffers),
                "unregister_memory() the ones no longer used: their ids are reused");
  }
  rec->handle.id = id;
  rec->handle.generation = next_generation();
  buffers[id - 1] = std::move(rec);
  buffer_table[id - 1].store(buffers[id - 1].get(), std::memory_order_release);
  return buffers[id - 1]->handle;
}

std::shared_ptr<detail::BufferRec> Engine::Impl::buffer_for(const Buffer& h, const char* verb) const {
  std::lock_guard lock(mu);  // the record cannot go while it is taken
  if (buffer(h) == nullptr) {
    throw Error(verb, EINVAL,
                fmt::format("buffer {} (generation {:#x}) is not a registered buffer of this engine", h.id, h.generation),
                "a handle of another engine, or of a buffer unregistered");
  }
  return buffers[h.id - 1];
}

void Engine::Impl::reclaim_buffer(std::uint32_t id) {
  std::shared_ptr<detail::BufferRec> rec;
  {
    std::lock_guard lock(mu);
    rec = std::move(buffers[id - 1]);
    buffer_table[id - 1].store(nullptr, std::memory_order_release);
  }
  // A worker may have looked the record up before it left the table: the id is reused (and the
  // record freed) once every worker has handled a command posted after that.
  auto token = std::shared_ptr<void>(nullptr, [this, id, rec = std::move(rec)](void*) mutable {
    std::lock_guard lock(mu);
    free_buffer_ids.push_back(id);
    rec.reset();
  });
  for (auto& w : workers) {
    detail::Command c(detail::Command::Kind::reclaim);
    c.token = token;
    w->post(std::move(c));
  }
}

void Engine::Impl::release_peer(detail::Peer& p) noexcept {
  std::shared_ptr<detail::Peer> last;  // freed outside the lock, unless a command still holds it
  try {
    std::lock_guard lock(mu);
    if (p.id == 0 || p.id > peers.size() || peers[p.id - 1].get() != &p) return;
    last = std::move(peers[p.id - 1]);
    free_peer_ids.push_back(p.id);
  } catch (...) {
    // Out of memory growing the free list: the id stays unused.
  }
}

void Engine::Impl::deliver(const std::shared_ptr<detail::NoteCredits>& from, Notification n) {
  {
    std::lock_guard lock(notes_mu);
    if (from->queued.load(std::memory_order_relaxed) >= cfg.notification_queue) {
      // Beyond the credits it was given: a peer that does not keep the protocol.
      count.notifications_dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    from->queued.fetch_add(1, std::memory_order_relaxed);
    notes.push_back({std::move(n), from});
  }
  count.notifications_received.fetch_add(1, std::memory_order_relaxed);
  signal();
}

}  // namespace rdmakit
