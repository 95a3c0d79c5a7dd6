// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "rdmakit/engine.hpp"

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// Serves an engine's figures over HTTP, for Prometheus and for health probes:
///   GET /metrics  Engine::metrics() (text format 0.0.4)
///   GET /health   200 with {"status":"ok",...} when Engine::health() is ok, else 503 with
///                 {"status":"unavailable","reason":"..."}; one line of JSON either way.
/// Off unless made; its threads (two) only call the engine's const members. Destroy it before
/// its engine. Plain HTTP without authentication: bind it to an address only the scrapers reach
/// (docs/observability.md).
class MetricsServer {
 public:
  /// Listens on `address`: "[HOST:]PORT" ("9464", ":9464", "10.0.0.5:9464"; no host: every
  /// address; port 0: any free port, see port()). Throws Error when it cannot bind.
  MetricsServer(const Engine& engine, const std::string& address, MetricsOptions options = {});
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept;
  /// "HOST:PORT" as bound ("0.0.0.0:9464").
  [[nodiscard]] std::string address() const;

 private:
  struct [[gnu::visibility("hidden")]] Impl;  // not exported: only the library sees it
  std::unique_ptr<Impl> impl_;
};

}  // namespace rdmakit
#pragma GCC visibility pop
