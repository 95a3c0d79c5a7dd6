// Listener: accepts on one thread, runs each client's handshake on a thread of its own with its
// own deadline, and hands out the connections whose handshake succeeded.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <list>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "bootstrap/socket.hpp"
#include "connection_impl.hpp"
#include "trace.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

struct Listener::Impl {
  ConnectionConfig cfg;
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
    Handshake& h = running.emplace_back();
    h.thread = std::thread([this, c = std::move(client), peer, done = h.done]() mutable {
      try {
        Connection conn = Connection::accept_on(c.release(), peer, cfg, setup);
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
  impl_->cfg = std::move(config);
  impl_->setup = std::move(setup);
  impl_->fd = detail::tcp_listen(detail::parse_host_port(address, 0), 128);
  impl_->port = detail::local_port(impl_->fd.get());
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
