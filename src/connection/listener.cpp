// SPDX-License-Identifier: Apache-2.0
// Listener: accepts on one thread (TCP connections, or rdma_cm connect requests), runs each
// client's handshake on a thread of its own with its own deadline, and hands out the
// connections whose handshake succeeded.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "common/thread_name.hpp"
#include "bootstrap/auth.hpp"
#include "bootstrap/socket.hpp"
#include "cm/cm.hpp"
#include "connection/handshake.hpp"
#include "connection/impl.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"
#include "trace.hpp"

namespace rdmakit {

// Named, not anonymous: Listener::Impl holds these (a unity build puts it in one unit with them).
// Under detail: the shared library exports no detail symbol (src/rdmakit.map).
namespace detail::listener_parts {

// Established connections per peer address, shared with the connections themselves: each holds
// a token that gives its slot back when it is destroyed, even after the listener is gone.
struct PeerCounts {
  std::mutex mu;
  std::map<std::string, std::uint32_t> count;

  static std::shared_ptr<void> take(const std::shared_ptr<PeerCounts>& self, const std::string& host) {
    {
      std::lock_guard lock(self->mu);
      ++self->count[host];
    }
    return {nullptr, [self, host](void*) {
              std::lock_guard lock(self->mu);
              if (--self->count[host] == 0) self->count.erase(host);
            }};
  }
  std::uint32_t of(const std::string& host) {
    std::lock_guard lock(mu);
    const auto it = count.find(host);
    return it == count.end() ? 0 : it->second;
  }
};

// Who a peer is, for the per-peer limits: "10.0.0.1:5" -> "10.0.0.1" (an address, not a source
// port), and an IPv6 address -> its prefix ("[2001:db8::7]:5" -> "2001:db8::/64" with prefix 64),
// since a host typically holds a whole /64 and could otherwise dodge the limits by switching
// addresses.
std::string peer_group(const std::string& peer, std::uint32_t ipv6_prefix) {
  const auto colon = peer.rfind(':');
  std::string h = colon == std::string::npos ? peer : peer.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  in6_addr a{};
  if (ipv6_prefix >= 128 || ::inet_pton(AF_INET6, h.c_str(), &a) != 1 || IN6_IS_ADDR_V4MAPPED(&a)) return h;
  for (std::uint32_t bit = ipv6_prefix; bit < 128; ++bit) {
    a.s6_addr[bit / 8] = static_cast<std::uint8_t>(a.s6_addr[bit / 8] & ~(0x80u >> (bit % 8)));
  }
  char text[INET6_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET6, &a, text, sizeof text);
  return fmt::format("{}/{}", text, ipv6_prefix);
}

// A client that arrived: a TCP connection, or an rdma_cm connect request. Refused at once, or
// its control channel opened on its handshake thread.
struct Arrival {
  std::string peer;
  detail::Fd tcp;
  std::optional<detail::CmRequest> cm;

  // Without a thread: a flood costs one accept (or CM request) and one short write (or REJ).
  void refuse(const std::string& why) noexcept {
    if (cm) return cm->refuse(why);
    try {
      // In the previous version, which every client this side serves can read (the
      // reason is no version's refusal, so a newer client does not connect again for it).
      detail::send_all(tcp.get(), wire::encode_reject(why, wire::kPreviousVersion), detail::deadline_in(std::chrono::milliseconds{20}));
    } catch (...) {
    }
  }
  /// The channel, its handshake's waits ended by `stop` (cleared once connected).
  std::unique_ptr<detail::Channel> open(const ConnectionConfig& c, const std::shared_ptr<const detail::Stop>& stop) {
    if (!cm) {
      auto ch = std::make_unique<detail::TcpChannel>(std::move(tcp));
      ch->set_stop(stop);
      return ch;
    }
    return cm->accept({c.ack_timeout, c.retry_count, c.rnr_timer}, detail::deadline_in(c.handshake_timeout), stop);
  }
};

struct Handshake {
  std::thread thread;
  std::string host;
  std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace detail::listener_parts

using namespace detail::listener_parts;

struct Listener::Impl {
  // Held so the devices stay open between connections; a handshake acquires (and reports the
  // failure of) the layer itself when this is null.
  std::shared_ptr<detail::DeviceLayer> devices;
  ListenerConfig cfg;  // its connection.psk is moved into `psk` and wiped
  detail::HandshakeHooks hooks;  // the engine's: its links are built on its PD and CQs
  // The engine's: each connection goes straight to it from its handshake thread, instead of
  // waiting in `ready` for an accept() (so nothing has to poll accept()).
  std::function<void(Connection)> deliver;
  std::shared_ptr<const detail::Secret> psk;  // the one copy every handshake uses
  std::shared_ptr<detail::PinBudget> budget;
  std::shared_ptr<PeerCounts> established = std::make_shared<PeerCounts>();
  Connection::Setup setup;
  detail::Fd fd;                          // TCP: the listening socket
  detail::Fd local;                       // an engine's shm streams: its local socket (HandshakeHooks::shm_socket)
  std::unique_ptr<detail::CmListener> cm;  // rdma_cm: the listening id
  std::uint16_t port = 0;
  std::mutex mu;
  std::condition_variable ready_cv;
  std::deque<Connection> ready;  // bounded by cfg.max_pending (with the handshakes running)
  std::atomic<bool> stop{false};
  // Requested at destruction: a handshake waiting for a silent client ends at once, so the
  // destructor does not wait out handshake_timeout.
  std::shared_ptr<detail::Stop> stopping = std::make_shared<detail::Stop>();
  // Wakes the accept loop (which otherwise sleeps until a client comes): to stop, and when a
  // handshake thread ends, so it is joined at once.
  detail::Fd wake{::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)};
  void poke() noexcept {
    const std::uint64_t one = 1;
    (void)!::write(wake.get(), &one, sizeof one);
  }
  std::atomic<std::size_t> rejected{0};
  std::atomic<std::uint64_t> n_busy{0}, n_auth{0}, n_protocol{0}, n_other{0};  // rejected, by reason
  // Counts a handshake that failed with `err` (Error::sys_errno(), 0 for anything else).
  void count_failure(int err, std::string_view what) noexcept {
    if (what.find(detail::kBusyReason) != std::string_view::npos) {
      n_busy.fetch_add(1);  // the engine's QP or CQ budget, the pinned-memory budget: "busy: ..."
    } else if (err == EACCES) {
      n_auth.fetch_add(1);
    } else if (err == EPROTO || err == EPROTONOSUPPORT || err == EBADMSG) {
      n_protocol.fetch_add(1);
    } else {
      n_other.fetch_add(1);
    }
    rejected.fetch_add(1);
  }
  std::thread acceptor;  // last member: started last, joined first

  /// A listener whose handshakes use `hooks` (set before its first client can arrive).
  static std::unique_ptr<Listener> with_hooks(const std::string& address, ListenerConfig config,
                                              detail::HandshakeHooks hooks,
                                              std::function<void(Connection)> deliver);
  void accept_loop() noexcept;
  void serve(const std::shared_ptr<Arrival>& client, std::list<Handshake>& running);
  /// `at_limit`: a limit refused it (counted busy, as is any "busy: " reason).
  void refuse(Arrival& client, const std::string& why, bool at_limit = false) noexcept;
  /// The clients waiting on the listening socket or CM id, without blocking.
  std::vector<std::shared_ptr<Arrival>> arrivals();
  void log(const std::string& msg) noexcept {
    try {
      cfg.connection.log(msg);
    } catch (...) {
    }
  }
  std::size_t pending() {
    std::lock_guard lock(mu);
    return ready.size();
  }
};

// The log line comes before the count, here and in serve(): whoever sees the count (rejected())
// finds the reason in the log too.
void Listener::Impl::refuse(Arrival& client, const std::string& why, bool at_limit) noexcept {
  client.refuse(why);
  try {
    log(fmt::format("refused connection from {}: {}", client.peer, why));
  } catch (...) {
  }
  (at_limit || why.starts_with(detail::kBusyReason) ? n_busy : n_protocol).fetch_add(1);
  rejected.fetch_add(1);
}

// One accepted client: refused at a limit, else its handshake on a thread of its own. Throws
// (std::system_error when no thread can be started, bad_alloc) only before the thread owns the
// client; the caller then refuses it.
void Listener::Impl::serve(const std::shared_ptr<Arrival>& client, std::list<Handshake>& running) {
  const std::string& peer = client->peer;
  const std::string host = peer_group(peer, cfg.ipv6_peer_prefix);
  // A handshake whose thread has ended (its connection is in `ready`) but is not joined yet
  // counts no more: the acceptor joins it at its next wake.
  const auto live = [](const Handshake& x) { return !x.done->load(); };
  const auto from_host = static_cast<std::uint32_t>(
      std::count_if(running.begin(), running.end(), [&](const Handshake& x) { return live(x) && x.host == host; }));
  const auto in_progress = static_cast<std::size_t>(std::count_if(running.begin(), running.end(), live));
  std::string busy;
  if (in_progress >= cfg.max_handshakes) {
    busy = fmt::format("{}{} handshakes in progress", detail::kBusyReason, in_progress);
  } else if (from_host >= cfg.max_handshakes_per_peer) {
    busy = fmt::format("{}{} handshakes in progress from {}", detail::kBusyReason, from_host, host);
  } else if (const std::size_t waiting = pending(); waiting + in_progress >= cfg.max_pending) {
    busy = fmt::format("{}{} connections wait to be accepted and {} handshakes are in progress (at most "
                       "{} in all)",
                       detail::kBusyReason, waiting, in_progress, cfg.max_pending);
  } else if (cfg.max_connections_per_peer != 0 && established->of(host) >= cfg.max_connections_per_peer) {
    busy = fmt::format("too many connections from {} (at most {})", host, cfg.max_connections_per_peer);
  }
  if (!busy.empty()) return refuse(*client, busy, /*at_limit=*/true);

  Handshake& h = running.emplace_back();
  try {
    h.host = host;
    auto slot = PeerCounts::take(established, host);
    // The client is shared with the thread: if the thread cannot be started, it is still ours
    // to refuse.
    h.thread = std::thread([this, client, peer, done = h.done, slot = std::move(slot)]() mutable {
      detail::name_this_thread("rdmakit-hshake");
      try {
        std::optional<Connection> got =
            Connection::Impl::accept(client->open(cfg.connection, stopping), peer, cfg.connection, psk, setup, std::move(slot), budget, hooks);
        if (!got) {
          // A data stream, handed to the link whose handshake waits for it.
        } else if (deliver) {
          deliver(std::move(*got));
        } else {
          {
            std::lock_guard lock(mu);
            ready.push_back(std::move(*got));
          }
          ready_cv.notify_one();
        }
      } catch (const std::exception& e) {
        log(fmt::format("rejected connection from {}: {}", peer, e.what()));
        detail::emit(cfg.connection.trace, [&] {
          return TraceEvent{"handshake_rejected", {{"peer", peer}, {"error", e.what()}}};
        });
        const auto* err = dynamic_cast<const Error*>(&e);
        count_failure(err != nullptr ? err->sys_errno() : 0, e.what());
      } catch (...) {
        log(fmt::format("rejected connection from {}: a non-standard exception", peer));
        count_failure(0, {});
      }
      done->store(true);
      poke();
    });
  } catch (...) {
    running.pop_back();
    throw;
  }
}

void Listener::Impl::accept_loop() noexcept {
  detail::name_this_thread("rdmakit-accept");
  std::list<Handshake> running;
  auto reap = [&](bool all) {
    for (auto it = running.begin(); it != running.end();) {
      if (all || it->done->load()) {
        it->thread.join();
        it = running.erase(it);
      } else {
        ++it;
      }
    }
  };
  while (!stop.load()) {
    std::shared_ptr<Arrival> client;
    try {
      // No timeout: an idle listener does not wake (a client, a finished handshake or stop do).
      pollfd p[3] = {{cm ? cm->fd() : fd.get(), POLLIN, 0}, {wake.get(), POLLIN, 0}, {local ? local.get() : -1, POLLIN, 0}};
      if (::poll(p, 3, -1) < 0 && errno != EINTR) throw Error("poll", errno, "the listener's socket");
      if ((p[1].revents & POLLIN) != 0) {
        std::uint64_t n = 0;
        (void)!::read(wake.get(), &n, sizeof n);
      }
      reap(false);
      if ((p[0].revents & POLLIN) == 0 && (p[2].revents & POLLIN) == 0) continue;
      for (auto& a : arrivals()) {
        client = std::move(a);
        if (client->cm && !client->cm->invalid().empty()) {
          refuse(*client, client->cm->invalid());
        } else {
          serve(client, running);
        }
        client.reset();
      }
    } catch (const std::exception& e) {
      // A thread that cannot be started (EAGAIN), memory that runs out, an accept that fails:
      // this client is refused, the listener keeps serving the others.
      if (client) refuse(*client, fmt::format("{}the server cannot take it now ({})", detail::kBusyReason, e.what()));
      if (!client) {
        log(fmt::format("accept failed: {}", e.what()));
        std::this_thread::sleep_for(std::chrono::milliseconds{10});
      }
    } catch (...) {
      if (client) refuse(*client, fmt::format("{}the server cannot take it now", detail::kBusyReason));
    }
  }
  // Every handshake has a deadline, and the destructor's stop ends their waits: this join is quick.
  reap(true);
}

std::vector<std::shared_ptr<Arrival>> Listener::Impl::arrivals() {
  std::vector<std::shared_ptr<Arrival>> out;
  if (cm) {
    while (auto req = cm->next()) {
      auto a = std::make_shared<Arrival>();
      a->peer = req->peer();
      a->cm.emplace(std::move(*req));
      out.push_back(std::move(a));
    }
    return out;
  }
  auto a = std::make_shared<Arrival>();
  a->tcp = detail::tcp_accept(fd.get(), std::chrono::milliseconds{0}, &a->peer);
  if (a->tcp) out.push_back(std::move(a));
  if (local) {
    // A stream of a shm link: its handshake reads one STREAM message, as over TCP.
    auto u = std::make_shared<Arrival>();
    u->tcp = detail::unix_accept(local.get());
    if (u->tcp) {
      u->peer = fmt::format("local process {}", detail::peer_pid(u->tcp.get()));
      out.push_back(std::move(u));
    }
  }
  return out;
}

Listener::Listener(const std::string& address, ListenerConfig config, Connection::Setup setup)
    : Listener(std::make_unique<Impl>(), address, std::move(config), std::move(setup)) {}

std::unique_ptr<Listener> Listener::Impl::with_hooks(const std::string& address, ListenerConfig config,
                                                     detail::HandshakeHooks hooks,
                                                     std::function<void(Connection)> deliver) {
  auto impl = std::make_unique<Impl>();
  impl->hooks = std::move(hooks);
  impl->deliver = std::move(deliver);
  return std::unique_ptr<Listener>(new Listener(std::move(impl), address, std::move(config), {}));
}

std::unique_ptr<Listener> detail::listen_with_hooks(const std::string& address, ListenerConfig config,
                                                    HandshakeHooks hooks, std::function<void(Connection)> deliver) {
  return Listener::Impl::with_hooks(address, std::move(config), std::move(hooks), std::move(deliver));
}

Listener::Listener(std::unique_ptr<Impl> impl, const std::string& address, ListenerConfig config,
                   Connection::Setup setup)
    : impl_(std::move(impl)) {
  ConnectionConfig& c = config.connection;
  if (!c.log) c.log = detail::default_log;
  if (!c.trace) c.trace = detail::trace_from_environment();
  detail::check_key(c.psk);
  if (config.max_pending == 0 || config.max_handshakes == 0 || config.max_handshakes_per_peer == 0 ||
      config.ipv6_peer_prefix > 128) {
    throw Error("listener config", EINVAL,
                fmt::format("max_pending {}, max_handshakes {}, max_handshakes_per_peer {} (each at least 1), "
                            "ipv6_peer_prefix {} (at most 128)",
                            config.max_pending, config.max_handshakes, config.max_handshakes_per_peer,
                            config.ipv6_peer_prefix));
  }
  if (!c.psk.empty()) impl_->psk = std::make_shared<const detail::Secret>(c.psk);
  detail::wipe(c.psk);
  if (config.max_handshake_memory != 0) {
    impl_->budget = std::make_shared<detail::PinBudget>(config.max_handshake_memory);
  }
  impl_->cfg = std::move(config);
  impl_->setup = std::move(setup);
  const detail::HostPort at = detail::parse_host_port(address, 0);
  if (impl_->cfg.connection.method == ConnectMethod::rdma_cm) {
    impl_->cm = std::make_unique<detail::CmListener>(at, 128);
    impl_->port = impl_->cm->port();
  } else {
    impl_->fd = detail::tcp_listen(at, 128);
    impl_->port = detail::local_port(impl_->fd.get());
  }
  if (!impl_->hooks.shm_socket.empty()) impl_->local = detail::unix_listen(impl_->hooks.shm_socket, 128);
  try {
    impl_->devices = detail::DeviceLayer::acquire();
  } catch (const std::exception&) {
    // Each handshake will say why the devices cannot be opened.
  }
  if (!impl_->psk) {
    const bool loopback = detail::loopback_host(at.host);
    impl_->log(fmt::format("listening on port {} without a pre-shared key{}: {} can connect and use the memory it "
                           "advertises (set a key: --psk-file, ConnectionConfig::psk)",
                           impl_->port, loopback ? fmt::format(", on {} only", at.host) : std::string(),
                           loopback ? "any process of this host" : "anyone who can reach this port"));
  }
  if (!impl_->wake) throw Error("eventfd", errno, "the listener's wake-up");
  impl_->acceptor = std::thread([this] { impl_->accept_loop(); });
}

Listener::~Listener() {
  impl_->stop.store(true);
  impl_->stopping->request();
  impl_->poke();
  impl_->acceptor.join();
}

std::uint16_t Listener::port() const noexcept { return impl_->port; }
std::size_t Listener::rejected() const noexcept { return impl_->rejected.load(); }

Listener::Refusals Listener::refusals() const noexcept {
  return {impl_->n_busy.load(), impl_->n_auth.load(), impl_->n_protocol.load(), impl_->n_other.load()};
}

std::optional<Connection> Listener::accept(std::chrono::milliseconds timeout) {
  std::unique_lock lock(impl_->mu);
  if (!impl_->ready_cv.wait_for(lock, timeout, [&] { return !impl_->ready.empty(); })) {
    return std::nullopt;
  }
  Connection c = std::move(impl_->ready.front());
  impl_->ready.pop_front();
  return c;
}

}  // namespace rdmakit
