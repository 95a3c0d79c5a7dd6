// Listener: accepts on one thread, runs each client's handshake on a thread of its own with its
// own deadline, and hands out the connections whose handshake succeeded.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <algorithm>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "bootstrap/auth.hpp"
#include "bootstrap/socket.hpp"
#include "connection_impl.hpp"
#include "trace.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

namespace {

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

// "[::1]:5" -> "::1", "10.0.0.1:5" -> "10.0.0.1": limits are per address, not per source port.
std::string host_of(const std::string& peer) {
  const auto colon = peer.rfind(':');
  std::string h = colon == std::string::npos ? peer : peer.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  return h;
}

}  // namespace

struct Listener::Impl {
  ConnectionConfig cfg;
  std::shared_ptr<PeerCounts> established = std::make_shared<PeerCounts>();
  Connection::Setup setup;
  detail::Fd fd;
  std::uint16_t port = 0;
  std::mutex mu;
  std::condition_variable ready_cv;
  std::deque<Connection> ready;
  std::atomic<bool> stop{false};
  std::atomic<std::size_t> rejected{0};
  std::thread acceptor;  // last member: started last, joined first

  void accept_loop();
};

namespace {

struct Handshake {
  std::thread thread;
  std::string host;
  std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
};

}  // namespace

void Listener::Impl::accept_loop() {
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
    std::string peer;
    detail::Fd client = detail::tcp_accept(fd.get(), std::chrono::milliseconds{100}, &peer);
    reap(false);
    if (!client) continue;
    const std::string host = host_of(peer);
    const auto from_host = static_cast<std::uint32_t>(
        std::count_if(running.begin(), running.end(), [&](const Handshake& x) { return x.host == host; }));
    std::string busy;
    if (running.size() >= cfg.max_handshakes) {
      busy = fmt::format("{}{} handshakes in progress", detail::kBusyReason, running.size());
    } else if (from_host >= cfg.max_handshakes_per_peer) {
      busy = fmt::format("{}{} handshakes in progress from {}", detail::kBusyReason, from_host, host);
    } else if (cfg.max_connections_per_peer != 0 &&
               established->of(host) >= cfg.max_connections_per_peer) {
      busy = fmt::format("too many connections from {} (at most {})", host, cfg.max_connections_per_peer);
    }
    if (!busy.empty()) {
      // Refused at once, without a thread: a flood costs one accept and one short write each.
      try {
        detail::send_all(client.get(), wire::encode_reject(busy), detail::deadline_in(std::chrono::milliseconds{20}));
      } catch (const std::exception&) {
      }
      rejected.fetch_add(1);
      try {
        cfg.log(fmt::format("refused connection from {}: {}", peer, busy));
      } catch (...) {
      }
      continue;
    }
    Handshake& h = running.emplace_back();
    h.host = host;
    h.thread = std::thread([this, c = std::move(client), peer, done = h.done,
                            slot = PeerCounts::take(established, host)]() mutable {
      try {
        Connection conn = Connection::accept_on(c.release(), peer, cfg, setup, std::move(slot));
        {
          std::lock_guard lock(mu);
          ready.push_back(std::move(conn));
        }
        ready_cv.notify_one();
      } catch (const std::exception& e) {
        rejected.fetch_add(1);
        try {
          cfg.log(fmt::format("rejected connection from {}: {}", peer, e.what()));
        } catch (...) {
        }
        detail::emit(cfg.trace, [&] {
          return TraceEvent{"handshake_rejected", {{"peer", peer}, {"error", e.what()}}};
        });
      }
      done->store(true);
    });
  }
  // Every handshake has a deadline, so this join is bounded by handshake_timeout.
  reap(true);
}

Listener::Listener(const std::string& address, ConnectionConfig config, Connection::Setup setup)
    : impl_(std::make_unique<Impl>()) {
  if (!config.log) config.log = detail::default_log;
  if (!config.trace) config.trace = detail::trace_from_environment();
  detail::check_key(config.psk);
  impl_->cfg = std::move(config);
  impl_->setup = std::move(setup);
  impl_->fd = detail::tcp_listen(detail::parse_host_port(address, 0), 128);
  impl_->port = detail::local_port(impl_->fd.get());
  if (impl_->cfg.psk.empty()) {
    impl_->cfg.log(fmt::format(
        "listening on port {} without a pre-shared key: anyone who can reach this port can connect "
        "and use the memory it advertises (set a key: --psk-file, ConnectionConfig::psk)",
        impl_->port));
  }
  impl_->acceptor = std::thread([this] { impl_->accept_loop(); });
}

Listener::~Listener() {
  impl_->stop.store(true);
  impl_->acceptor.join();
}

std::uint16_t Listener::port() const noexcept { return impl_->port; }
std::size_t Listener::rejected() const noexcept { return impl_->rejected.load(); }

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
