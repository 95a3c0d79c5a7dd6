// SPDX-License-Identifier: Apache-2.0
// The engine in one program: `engine_write_read --serve PORT` exposes a segment "inbox";
// `engine_write_read HOST:PORT` writes a greeting into it in one batch that carries a
// notification, then reads it back (a prepared plan, submitted three times). The server prints
// the greeting when the notification says it is there.
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include <rdmakit/engine.hpp>
#include <rdmakit/error.hpp>

using namespace std::chrono_literals;

int main(int argc, char** argv) try {
  if (argc == 3 && std::string(argv[1]) == "--serve") {
    // No key in this example: a keyless engine serves other hosts only on an address it is given
    // (every IPv4 address here); with EngineConfig::link.psk, ":PORT" would do.
    rdmakit::EngineConfig cfg{.name = "server", .listen = std::string("0.0.0.0:") + argv[2], .listen_at_start = false};
    rdmakit::Engine engine(cfg);
    const rdmakit::Buffer inbox = engine.allocate_memory(4096);
    engine.expose("inbox", inbox, rdmakit::Access::remote_read | rdmakit::Access::remote_write);
    engine.start_listening();  // the segment is there from the first link on
    // The engine's descriptor wakes us when a notification arrives: no polling loop.
    for (int waited = 0; waited < 60; ++waited) {
      pollfd pfd{engine.fd(), POLLIN, 0};
      if (::poll(&pfd, 1, 1000) > 0) {
        std::uint64_t n = 0;
        (void)!::read(engine.fd(), &n, sizeof n);
      }
      if (auto note = engine.next_notification()) {
        std::printf("from %s: %s\n", note->peer.c_str(), static_cast<const char*>(inbox.addr));
        std::fflush(stdout);
        // The client reads the greeting back after its notification: give it a moment.
        std::this_thread::sleep_for(1s);
        return 0;
      }
    }
    return 1;
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s --serve PORT | HOST:PORT\n", argv[0]);
    return 2;
  }
  rdmakit::EngineConfig cfg{.name = "client", .listen = ""};
  cfg.link.retry_refused = true;  // the server may be starting at the same moment
  rdmakit::Engine engine(cfg);
  engine.add_peer("server", argv[1]);
  const rdmakit::RemoteSegment inbox = engine.segment("server", "inbox");
  const rdmakit::Buffer mine = engine.allocate_memory(4096);
  const char greeting[] = "hello through the engine";
  std::memcpy(mine.addr, greeting, sizeof greeting);
  const rdmakit::Transfer write{.op = rdmakit::TransferOp::write, .local = mine, .length = sizeof greeting, .remote = inbox};
  rdmakit::Batch w = engine.submit({&write, 1}, {.notify = {'h', 'i'}});
  if (!w.wait(30s) || w.failed() != 0) {
    std::fprintf(stderr, "write: %s", w.describe_failures().c_str());
    return 1;
  }
  // Transfers made again and again are prepared once: the checks and the verbs requests are
  // done then, and each submit of the plan posts them as they are (with the bytes of the moment).
  const rdmakit::Transfer read{.op = rdmakit::TransferOp::read, .local = mine, .local_offset = 2048,
                               .length = sizeof greeting, .remote = inbox};
  const rdmakit::TransferPlan read_back = engine.prepare({&read, 1});
  for (int i = 0; i < 3; ++i) {
    std::memset(static_cast<char*>(mine.addr) + 2048, 0, sizeof greeting);
    rdmakit::Batch r = engine.submit(read_back);
    if (!r.wait(30s) || r.failed() != 0) {
      std::fprintf(stderr, "read: %s", r.describe_failures().c_str());
      return 1;
    }
  }
  std::printf("read back: %s\n", static_cast<const char*>(mine.addr) + 2048);
  return 0;
} catch (const rdmakit::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
