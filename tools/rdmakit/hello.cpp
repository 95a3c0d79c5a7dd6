// SPDX-License-Identifier: Apache-2.0
// rdmakit hello: the seed program, done right. The client RDMA-WRITEs its message into the
// server's buffer and signals with WRITE_WITH_IMM (the immediate carries the length, so the
// server knows the data is there: no race); the server prints it, RDMA-READs the client's buffer
// back, prints that, and SENDs it to the client, which checks it.
#include "hello.hpp"

#include <CLI/CLI.hpp>

#include <atomic>
#include <list>
#include <memory>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "memory_options.hpp"
#include "options.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::tools {
namespace {

enum : std::uint64_t { kWrWrite = 1, kWrRead, kWrSend, kWrRecv };

// Index of each region in registration order (Connection::memory).
enum : std::size_t { kServerInbox = 0, kServerReadback = 1 };
enum : std::size_t { kClientOutbox = 0, kClientReport = 1 };

struct HelloOptions {
  ConnectOptions net;
  MemOptions mem;
  std::string message = "Hello,World";
  std::size_t size = 64 * 1024;  // the seed's MSG_SIZE
  bool serve = false;
};

// Waits for the completion of `wr_id`; any failed completion, a timeout or a lost peer fails.
Completion await(Connection& conn, std::uint64_t wr_id, std::chrono::milliseconds timeout,
                 const char* what) {
  for (;;) {
    const WaitResult w = conn.wait(timeout);
    if (w.status == WaitStatus::timeout) {
      throw Fail(fmt::format("{}: no completion within {} ms", what, timeout.count()));
    }
    if (w.status != WaitStatus::completed) throw Fail(fmt::format("{}: {}", what, conn.failure()));
    if (!w.completion.ok()) throw Fail(fmt::format("{}: {}", what, w.completion.describe()));
    if (w.completion.wr_id == wr_id) return w.completion;
  }
}

void check_post(const PostResult& r, const char* what) {
  if (!r.ok()) throw Fail(fmt::format("{}: {}", what, r.describe()));
}

std::string quoted(const void* p, std::size_t n) {
  return fmt::format("\"{}\"", std::string_view(static_cast<const char*>(p), n));
}

std::mutex print_mu;  // whole blocks, so concurrent clients' lines do not interleave
void print_block(const std::string& s) {
  std::lock_guard lock(print_mu);
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

// One client, on the server side. Returns true when what was read back equals what was written.
bool serve_one(Connection& conn, const HelloOptions& o) {
  const std::string who = conn.info().peer_address;
  const MemoryRegion& inbox = conn.memory(kServerInbox);
  print_block(fmt::format("[{}] connected\n{}  memory      {}\n", who, describe(conn.info()), describe_memory(inbox)));
  const MemoryRegion& readback = conn.memory(kServerReadback);
  const Completion imm = await(conn, kWrRecv, o.net.timeout(), "waiting for the client's write");
  if (!imm.has_imm || imm.imm > inbox.size()) {
    throw Fail(fmt::format("bad WRITE_WITH_IMM from {}: immediate {} for a {}-byte buffer", who,
                           imm.imm, inbox.size()));
  }
  const std::size_t len = imm.imm;
  // On the bounce path the NIC wrote the bounce buffer: bring the bytes home first.
  inbox.stage_out(0, len);
  const void* got = inbox.home() != nullptr ? inbox.home() : inbox.data();
  if (got == nullptr) throw Fail("the inbox is GPU memory the CPU cannot read; hello needs host-reachable memory");
  print_block(fmt::format("[{}] received: {}\n", who, quoted(got, len)));

  if (conn.remote_regions().empty()) throw Fail(fmt::format("{} advertised no buffer to read", who));
  const RemoteRegion& theirs = conn.remote_regions().front();
  check_post(conn.post_read(readback.local().subslice(0, len), theirs, 0, kWrRead), "RDMA READ");
  await(conn, kWrRead, o.net.timeout(), "RDMA READ of the client's buffer");
  const bool same = std::memcmp(readback.data(), got, len) == 0;
  print_block(fmt::format("[{}] read back: {}{}\n", who, quoted(readback.data(), len),
                          same ? "" : "  (DIFFERENT from what was written)"));

  check_post(conn.post_send(readback.local().subslice(0, len), kWrSend), "SEND");
  await(conn, kWrSend, o.net.timeout(), "SEND of the read-back to the client");
  conn.close(o.net.timeout());
  return same;
}

int run_server(const HelloOptions& o) {
  const std::size_t size = o.size;
  Listener listener(o.net.listen_address(), o.net.config(), [size, &o](Connection& c) {
    const MemoryRegion& inbox = o.mem.allocate(c, size, Access::remote_write);
    c.allocate_memory(size, Access::local_write);
    c.advertise(inbox);
    // The client's WRITE_WITH_IMM consumes a receive: post it before the client can send.
    check_post(c.post_recv(inbox.local().subslice(0, 0), kWrRecv), "posting the receive");
  });
  print_block(fmt::format("listening on port {}{}\n", listener.port(),
                          o.serve ? " (serving until stopped)" : " (one client)"));
  if (!o.serve) {
    for (;;) {
      if (auto conn = listener.accept(std::chrono::milliseconds{1000})) {
        try {
          return serve_one(*conn, o) ? 0 : 1;
        } catch (const std::exception& e) {
          print_block(fmt::format("[{}] error: {}\n", conn->info().peer_address, e.what()));
          return 1;
        }
      }
    }
  }
  // One thread per client, so a slow client delays nobody; finished ones are reaped as we go.
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done = std::make_shared<std::atomic<bool>>(false);
  };
  std::list<Worker> workers;
  for (;;) {
    workers.remove_if([](Worker& w) {
      if (!w.done->load()) return false;
      w.thread.join();
      return true;
    });
    if (auto conn = listener.accept(std::chrono::milliseconds{1000})) {
      Worker& w = workers.emplace_back();
      w.thread = std::thread([c = std::move(*conn), &o, done = w.done]() mutable {
        try {
          serve_one(c, o);
        } catch (const std::exception& e) {
          print_block(fmt::format("[{}] error: {}\n", c.info().peer_address, e.what()));
        }
        c.close();
        done->store(true);
      });
    }
  }
}

int run_client(const HelloOptions& o) {
  if (o.message.size() > o.size) {
    throw Fail(fmt::format("the message ({} bytes) is larger than --size {}", o.message.size(), o.size));
  }
  const std::string& msg = o.message;
  const std::size_t size = o.size;
  Connection conn = Connection::connect(o.net.connect_target(), o.net.config(), [&](Connection& c) {
    const MemoryRegion& outbox = o.mem.allocate(c, size, Access::remote_read);
    const MemoryRegion& report = c.allocate_memory(size, Access::local_write);
    // Into the memory itself, then (bounce path) staged into what the NIC reads.
    void* home = outbox.home() != nullptr ? outbox.home() : outbox.data();
    if (home == nullptr) throw Fail("the outbox is GPU memory the CPU cannot write; hello needs host-reachable memory");
    std::memcpy(home, msg.data(), msg.size());
    outbox.stage_in(0, msg.size());
    c.advertise(outbox);
    check_post(c.post_recv(report.local(), kWrRecv), "posting the receive");
  });
  const MemoryRegion& outbox = conn.memory(kClientOutbox);
  print_block(fmt::format("connected\n{}  memory      {}\n", describe(conn.info()), describe_memory(outbox)));
  const MemoryRegion& report = conn.memory(kClientReport);
  if (conn.remote_regions().empty()) throw Fail("the server advertised no buffer");
  const RemoteRegion& theirs = conn.remote_regions().front();
  const auto w = conn.post_write_with_imm(outbox.local().subslice(0, msg.size()), theirs, 0,
                                          static_cast<std::uint32_t>(msg.size()), kWrWrite);
  check_post(w, fmt::format("RDMA WRITE_WITH_IMM of {} bytes into the server's {}-byte buffer",
                            msg.size(), theirs.length).c_str());
  await(conn, kWrWrite, o.net.timeout(), "RDMA WRITE_WITH_IMM");
  print_block(fmt::format("wrote: {}\n", quoted(msg.data(), msg.size())));
  const Completion got = await(conn, kWrRecv, o.net.timeout(), "waiting for the server's read-back");
  const bool same = got.byte_len == msg.size() && std::memcmp(report.data(), msg.data(), msg.size()) == 0;
  print_block(fmt::format("server read back: {}{}\n", quoted(report.data(), got.byte_len),
                          same ? "" : "  (DIFFERENT from what was written)"));
  conn.wait_peer_close(o.net.timeout());
  conn.close(o.net.timeout());
  return same ? 0 : 1;
}

}  // namespace

void add_hello(CLI::App& app, std::function<int()>& run) {
  auto opts = std::make_shared<HelloOptions>();
  CLI::App* sub = app.add_subcommand(
      "hello", "connect two processes over RDMA: WRITE a message, READ it back, SEND it home");
  opts->net.add_to(*sub);
  sub->add_option("-m,--message", opts->message, "the message the client writes")->capture_default_str();
  sub->add_option("-s,--size", opts->size, "buffer size in bytes on each side")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 30))
      ->capture_default_str();
  sub->add_flag("--serve", opts->serve, "with --listen: keep serving clients until stopped");
  opts->mem.add_to(*sub);
  sub->callback([opts, &run] {
    require_role(opts->net, "hello");
    if (opts->serve && !opts->net.serving()) {
      throw CLI::ValidationError("--serve", "--serve needs --listen");
    }
    run = guarded("hello", [opts] {
      opts->mem.check(opts->size);  // no CUDA device, no huge pages: said before connecting
      return opts->net.serving() ? run_server(*opts) : run_client(*opts);
    });
  });
}

}  // namespace rdmakit::tools
