// SPDX-License-Identifier: Apache-2.0
// The peer the fault tests kill: connects (or listens), advertises a 64 KiB buffer it lets the
// other side read and write, keeps receives posted for SENDs, says "ready" on stdout, and serves
// until it is killed (through rdma_cm with RDMAKIT_TEST_METHOD=rdma_cm). With try-connect, a client in a process of its own: one connect attempt
// per line on stdin, "connected" or "refused: WHY" on stdout for each.
// With engine, an rdmakit::Engine called NAME on PORT exposing a 1 MiB segment "kv", published in
// the metadata store RDMAKIT_PEER_METADATA names (if set; cluster "t", lease 2 s, poll 200 ms),
// taking the notifications sent to it.
//   rdmakit_rxe_fault_peer connect HOST:PORT | listen PORT | try-connect HOST:PORT [no-keepalive]
//                          | engine PORT NAME | engines PORT COUNT
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <memory>
#include <cstdlib>

#include "rdmakit/connection.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"
#include "lab_helpers.hpp"

using namespace std::chrono_literals;

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: %s connect HOST:PORT | listen PORT | try-connect HOST:PORT [no-keepalive] | engine PORT NAME | holder HOST:PORT\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  if (mode == "engines" && argc == 4) {
    // COUNT target engines on ports PORT, PORT + 1, ..., called s<port>, each exposing "kv".
    const int base = std::atoi(argv[2]);
    const int count = std::atoi(argv[3]);
    std::vector<std::unique_ptr<rdmakit::Engine>> engines;
    for (int i = 0; i < count; ++i) {
      rdmakit::EngineConfig ec;
      ec.name = "s" + std::to_string(base + i);
      ec.listen = "0.0.0.0:" + std::to_string(base + i);
      ec.listen_at_start = false;
      ec.max_qps = 8;  // a small CQ each: the host runs many of them
      ec.link.log = [](std::string_view) {};
      ec.link.method = lab::test_method();
      ec.transports = lab::test_transports();
      ec.shm_copy = lab::test_shm_copy();
      auto& e = *engines.emplace_back(std::make_unique<rdmakit::Engine>(ec));
      e.expose("kv", e.allocate_memory(4096), rdmakit::Access::remote_read | rdmakit::Access::remote_write);
      e.start_listening();
    }
    std::printf("ready\n");
    std::fflush(stdout);
    for (;;) std::this_thread::sleep_for(1s);
  }
  if (mode == "holder" && argc == 3) {
    // An engine called "holder" that links to the engine "b" at HOST:PORT (which grants it
    // leases), then idles until it is killed.
    rdmakit::EngineConfig ec;
    ec.name = "holder";
    ec.listen = "";  // it only initiates
    ec.link.log = [](std::string_view) {};
    ec.link.method = lab::test_method();
    ec.transports = lab::test_transports();
    ec.shm_copy = lab::test_shm_copy();
    rdmakit::Engine engine(ec);
    engine.add_peer("b", argv[2]);
    std::string why;
    if (!engine.connect("b", 10s, &why)) {
      std::fprintf(stderr, "holder: %s\n", why.c_str());
      return 1;
    }
    std::printf("ready\n");
    std::fflush(stdout);
    for (;;) std::this_thread::sleep_for(1s);
  }
  if (mode == "engine" && argc == 4) {
    rdmakit::EngineConfig ec;
    ec.name = argv[3];
    ec.listen = "0.0.0.0:" + std::string(argv[2]);
    ec.link.log = [](std::string_view) {};
    ec.link.method = lab::test_method();
    ec.transports = lab::test_transports();
    ec.shm_copy = lab::test_shm_copy();
    if (const char* uri = std::getenv("RDMAKIT_PEER_METADATA")) {
      ec.metadata.uri = uri;
      ec.metadata.cluster = "t";
      ec.metadata.lease = 2s;
      ec.metadata.poll = 200ms;
      ec.metadata.call_timeout = 1s;
    }
    rdmakit::Engine engine(ec);
    const rdmakit::Buffer b = engine.allocate_memory(1 << 20);
    engine.expose("kv", b, rdmakit::Access::remote_read | rdmakit::Access::remote_write);
    std::printf("ready\n");
    std::fflush(stdout);
    for (;;) {  // notifications are taken as they come, as a serving target's loop takes them
      while (engine.next_notification()) {
      }
      std::this_thread::sleep_for(5ms);
    }
  }
  rdmakit::ConnectionConfig cfg;
  cfg.log = [](std::string_view) {};
  cfg.retry_refused = true;
  cfg.recv_depth = 128;
  if (argc == 4 && std::string(argv[3]) == "no-keepalive") cfg.keepalive_interval = cfg.keepalive_timeout = 0ms;
  cfg.method = lab::test_method();
  auto setup = [](rdmakit::Connection& c) {
    const auto& m = c.allocate_memory(64 * 1024, rdmakit::Access::local_write | rdmakit::Access::remote_read |
                                                     rdmakit::Access::remote_write);
    c.advertise(m);
    for (std::uint64_t i = 0; i < 64; ++i) (void)c.post_recv(m.local().subslice(i * 1024, 1024), i);
  };
  std::optional<rdmakit::Listener> listener;
  std::optional<rdmakit::Connection> conn;
  if (mode == "try-connect") {
    cfg.retry_refused = false;
    cfg.handshake_timeout = 5s;
    for (std::string line; std::getline(std::cin, line);) {
      try {
        rdmakit::Connection c = rdmakit::Connection::connect(argv[2], cfg, setup);
        std::printf("connected\n");
      } catch (const rdmakit::Error& e) {
        std::printf("refused: %s\n", e.what());
      }
      std::fflush(stdout);
    }
    return 0;
  }
  if (mode == "listen") {
    listener.emplace(":" + std::string(argv[2]), cfg, setup);
    std::printf("listening\n");
    std::fflush(stdout);
    while (!(conn = listener->accept(1s))) {
    }
  } else {
    conn.emplace(rdmakit::Connection::connect(argv[2], cfg, setup));
  }
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) {
    const auto w = conn->wait(100ms);
    if (w.status == rdmakit::WaitStatus::completed && w.completion.ok() &&
        w.completion.opcode == rdmakit::Opcode::recv) {
      const std::uint64_t i = w.completion.wr_id % 64;
      (void)conn->post_recv(conn->memory(0).local().subslice(i * 1024, 1024), w.completion.wr_id + 64);
    }
    if (w.status == rdmakit::WaitStatus::peer_lost || w.status == rdmakit::WaitStatus::closed) return 0;
  }
}
