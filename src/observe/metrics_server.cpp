// SPDX-License-Identifier: Apache-2.0
// MetricsServer: /metrics and /health over cpp-httplib (Debian's libcpp-httplib: a small,
// well-kept server with a bounded thread pool and per-connection timeouts, and a client the
// `stats` command uses too; libmicrohttpd would mean C callbacks and buffer management here,
// civetweb a larger embedded server than two read-only endpoints need).
#include "rdmakit/metrics.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "bootstrap/socket.hpp"
#include "common/thread_name.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

struct MetricsServer::Impl {
  httplib::Server server;
  std::string host;
  std::uint16_t port = 0;
  std::atomic<bool> done{false};  // the server's thread has left listen
  std::atomic<bool> stopping{false};
  std::thread thread;
};

MetricsServer::MetricsServer(const Engine& engine, const std::string& address, MetricsOptions options)
    : impl_(std::make_unique<Impl>()) {
  const detail::HostPort at = detail::parse_host_port(address, 0);
  impl_->host = at.host.empty() ? "0.0.0.0" : at.host;
  httplib::Server& s = impl_->server;
  // Scrapes are rare and cheap: two threads, a client that stalls is dropped, and a connection
  // serves one request (a kept-alive one would hold its thread: two scrapers would starve a
  // health probe, and stop() would wait for them).
  s.new_task_queue = [] { return new httplib::ThreadPool(2); };
  s.set_read_timeout(5, 0);
  s.set_write_timeout(5, 0);
  s.set_keep_alive_max_count(1);
  s.set_keep_alive_timeout(1);
  // httplib's default adds SO_REUSEPORT: a second server on the port would share it, scrapes
  // landing on either. One owner per port (SO_REUSEADDR only: a restart rebinds at once).
  s.set_socket_options([](socket_t sock) {
    const int yes = 1;
    (void)::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  s.Get("/metrics", [&engine, options](const httplib::Request&, httplib::Response& res) {
    try {
      res.set_content(engine.metrics(options), "text/plain; version=0.0.4; charset=utf-8");
    } catch (const std::exception& e) {
      res.status = 500;
      res.set_content(fmt::format("metrics: {}\n", e.what()), "text/plain");
    }
  });
  s.Get("/health", [&engine](const httplib::Request&, httplib::Response& res) {
    nlohmann::json j;
    try {
      const EngineHealth h = engine.health();
      const EngineInfo i = engine.info();
      j["status"] = h.ok ? "ok" : "unavailable";
      if (!h.ok) j["reason"] = h.reason;
      j["engine"] = i.name;
      j["epoch"] = fmt::format("{:#x}", i.epoch);
      j["port"] = i.port;
      res.status = h.ok ? 200 : 503;
    } catch (const std::exception& e) {
      j["status"] = "unavailable";
      j["reason"] = e.what();
      res.status = 503;
    }
    res.set_content(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", "application/json");
  });
  errno = 0;
  const int port = at.port == 0 ? s.bind_to_any_port(impl_->host) : (s.bind_to_port(impl_->host, at.port) ? at.port : -1);
  if (port <= 0) {
    throw Error("metrics server", errno != 0 ? errno : EADDRINUSE,
                fmt::format("cannot listen on {}:{}", impl_->host, at.port),
                "is the port taken, or the address not this host's? (another --metrics port, or :0 for any)");
  }
  impl_->port = static_cast<std::uint16_t>(port);
  impl_->thread = std::thread([this] {
    detail::name_this_thread("rdmakit-metrics");
    // No signal lands here (nor in the pool's threads, started from this one): an EINTR in its
    // accept() would end the server for good.
    sigset_t all;
    ::sigfillset(&all);
    (void)::pthread_sigmask(SIG_BLOCK, &all, nullptr);
    if (!impl_->server.listen_after_bind() && !impl_->stopping.load()) {
      fmt::print(stderr, "rdmakit: the metrics endpoint on {}:{} stopped accepting (errno {})\n", impl_->host, impl_->port,
                 errno);
    }
    impl_->done.store(true);
  });
  // stop() ends a server that runs, not one about to: the destructor may come at once.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!impl_->server.is_running() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

MetricsServer::~MetricsServer() {
  impl_->stopping.store(true);
  // stop() ends a server that runs: one that had not started yet is stopped once it has.
  while (!impl_->done.load()) {
    impl_->server.stop();
    if (impl_->server.is_running() || impl_->done.load()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::uint16_t MetricsServer::port() const noexcept { return impl_->port; }

std::string MetricsServer::address() const {
  return impl_->host.find(':') != std::string::npos ? fmt::format("[{}]:{}", impl_->host, impl_->port)
                                                     : fmt::format("{}:{}", impl_->host, impl_->port);
}

}  // namespace rdmakit
