// SPDX-License-Identifier: Apache-2.0
#pragma once
// The instruction-count loops' connection: a client and a listener in the same process, the
// listener advertising 4 KiB the client may write, the client holding 4 KiB of its own as the
// source (no remote access).
#include <chrono>
#include <optional>
#include <string>

#include "rdmakit/connection.hpp"

namespace bench {

struct Loopback {
  explicit Loopback(const rdmakit::ConnectionConfig& cfg)
      : listener("127.0.0.1:0", cfg,
                 [](rdmakit::Connection& c) { c.advertise(c.allocate_memory(4096, rdmakit::Access::remote_write)); }),
        conn(rdmakit::Connection::connect("127.0.0.1:" + std::to_string(listener.port()), cfg,
                                          [](rdmakit::Connection& c) { c.allocate_memory(4096, rdmakit::Access::none); })),
        server(listener.accept(std::chrono::seconds{10})) {}
  rdmakit::Listener listener;
  rdmakit::Connection conn;
  std::optional<rdmakit::Connection> server;
};

}  // namespace bench
