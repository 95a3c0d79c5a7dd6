// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the engine's lab tests share.
#include <arpa/inet.h>
#include <poll.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "lab_helpers.hpp"
#include "rdmakit/engine.hpp"

namespace lab {

/// For the cases that are RDMA's own (a device's resources, a forged peer's QP through a plain
/// Connection, region keys): skipped over tcp and shm, with why.
#define RDMAKIT_RDMA_ONLY(why)                                                   \
  do {                                                                         \
    if (lab::soft_transport()) GTEST_SKIP() << "RDMA's own: " << (why);        \
  } while (0)

/// A batch's wait() as an assertion: on a timeout it says how far the batch got
/// (Batch::describe_progress), where ASSERT_TRUE(b.wait(t)) says only that it was false.
inline ::testing::AssertionResult waited(const rdmakit::Batch& b, std::chrono::milliseconds t) {
  if (b.wait(t)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "the batch was not done within " << t.count() << " ms: " << b.describe_progress();
}

/// An engine `name` listening on loopback (over rdma_cm the VM's own address: here()), quiet.
inline rdmakit::EngineConfig config(const std::string& name) {
  rdmakit::EngineConfig c;
  c.name = name;
  c.listen = here() + ":0";
  c.link = quiet();
  c.transports = test_transports();
  c.shm_copy = test_shm_copy();
  c.shm_map = test_shm_map();
  return c;
}

inline std::string at(const rdmakit::Engine& e) { return here(e.port()); }

/// Adds `target` to `a` as peer `name` and connects to it now; empty, or why it did not.
inline std::string link_to(rdmakit::Engine& a, const std::string& name, const rdmakit::Engine& target) {
  a.add_peer(name, at(target));
  std::string why;
  if (!a.connect(name, std::chrono::seconds{10}, &why)) return why.empty() ? "connect failed" : why;
  return {};
}

/// Bytes that differ with the seed and the position.
inline void fill(void* p, std::size_t n, std::uint8_t seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(seed + i * 7 + (i >> 9));
}

inline bool same(const void* a, const void* b, std::size_t n) { return std::memcmp(a, b, n) == 0; }

/// A target engine with one segment "kv" of `bytes`, readable, writable and atomic.
struct Target {
  explicit Target(const std::string& name, std::size_t bytes = 1 << 20, rdmakit::EngineConfig c = {})
      : engine(c.name.empty() ? config(name) : std::move(c)) {
    buf = engine.allocate_memory(bytes);
    engine.expose("kv", buf, rdmakit::Access::remote_read | rdmakit::Access::remote_write | rdmakit::Access::remote_atomic);
  }
  rdmakit::Engine engine;
  rdmakit::Buffer buf;
};

/// What `take()` returns next (a notification, a lease's end: an optional), waiting on `e`'s
/// descriptor between looks; empty if nothing came within `limit`.
template <class Take>
auto next_by_fd(rdmakit::Engine& e, Take take, std::chrono::milliseconds limit) -> decltype(take()) {
  pollfd pfd{e.fd(), POLLIN, 0};
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    if (auto got = take()) return got;
    if (std::chrono::steady_clock::now() >= until) return {};
    if (::poll(&pfd, 1, 20) > 0) {
      std::uint64_t v = 0;
      (void)!::read(e.fd(), &v, sizeof v);
    }
  }
}

/// A transfer of `len` bytes between [loff..) of `local` and [roff..) of `seg`.
inline rdmakit::Transfer xfer(rdmakit::TransferOp op, rdmakit::Buffer local, std::uint64_t loff, std::uint64_t len,
                              rdmakit::RemoteSegment seg, std::uint64_t roff) {
  rdmakit::Transfer t;
  t.op = op;
  t.local = local;
  t.local_offset = loff;
  t.length = len;
  t.remote = seg;
  t.remote_offset = roff;
  return t;
}

/// `n` fetch-adds of 1 on the segment's first word, their old values to [first * 8..) of `olds`.
inline std::vector<rdmakit::Transfer> fetch_adds(rdmakit::Buffer olds, std::uint64_t first, std::uint64_t n,
                                                 rdmakit::RemoteSegment seg) {
  std::vector<rdmakit::Transfer> out;
  for (std::uint64_t k = 0; k < n; ++k) {
    rdmakit::Transfer x = xfer(rdmakit::TransferOp::fetch_add, olds, (first + k) * 8, 8, seg, 0);
    x.compare_add = 1;
    out.push_back(x);
  }
  return out;
}

/// Whether `n` fetch-adds of 1 on `word` (0 before) ended exact: the word is n, and the first `n`
/// words of `olds` are 0..n-1, each once, in any order.
inline bool fetch_adds_exact(const void* word, const rdmakit::Buffer& olds, std::uint64_t n) {
  std::uint64_t v = 0;
  std::memcpy(&v, word, 8);
  if (v != n) return false;
  std::vector<std::uint64_t> seen(n);
  std::memcpy(seen.data(), olds.addr, n * 8);
  std::sort(seen.begin(), seen.end());
  for (std::uint64_t i = 0; i < n; ++i) {
    if (seen[i] != i) return false;
  }
  return true;
}

// A TCP listener that takes connections (the kernel's backlog) and never answers: a host that is
// up and stalled, as a connect meets it.
struct SilentListener {
  SilentListener() {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof at;
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0 || ::listen(fd, 16) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
      ADD_FAILURE() << "a silent listener: " << std::strerror(errno);
    }
    port = ntohs(at.sin_port);
  }
  ~SilentListener() { ::close(fd); }
  SilentListener(const SilentListener&) = delete;
  SilentListener& operator=(const SilentListener&) = delete;
  int fd = -1;
  std::uint16_t port = 0;
};

// Lab --nics 2 (rxe0 on 198.18.0.0/24, rxe1 on 198.18.1.0/24): a target on each NIC's
// address, "t0" and "t1", with a 64 KiB segment "kv".
struct TwoNics {
  const char* ip[2] = {std::getenv("RDMAKIT_LAB_IP0"), std::getenv("RDMAKIT_LAB_IP1")};
  std::vector<std::unique_ptr<Target>> targets;
  [[nodiscard]] bool present() const { return ip[0] != nullptr && ip[1] != nullptr; }
  TwoNics() {
    for (std::size_t k = 0; k < 2 && present(); ++k) {
      rdmakit::EngineConfig tc = config("t" + std::to_string(k));
      tc.listen = std::string(ip[k]) + ":0";
      targets.push_back(std::make_unique<Target>(tc.name, 1 << 16, tc));
    }
  }
  [[nodiscard]] std::string at(std::size_t k) const { return std::string(ip[k]) + ":" + std::to_string(targets[k]->engine.port()); }
  // Writes `blocks` blocks of `src` (from 0) to t0 and t1 in turn, at the same offsets, and checks
  // every byte arrived.
  void write_to_both(rdmakit::Engine& a, const rdmakit::Buffer& src, std::uint64_t blocks, std::uint64_t block) const {
    std::vector<rdmakit::Transfer> t;
    for (std::uint64_t k = 0; k < blocks; ++k) {
      t.push_back(xfer(rdmakit::TransferOp::write, src, k * block, block, a.segment(k % 2 == 0 ? "t0" : "t1", "kv"), k * block));
    }
    rdmakit::Batch b = a.submit(t);
    ASSERT_TRUE(b.wait(std::chrono::seconds(10)));
    ASSERT_EQ(b.failed(), 0u) << b.describe_failures();
    for (std::uint64_t k = 0; k < blocks; ++k) {
      EXPECT_TRUE(same(static_cast<char*>(targets[k % 2]->buf.addr) + k * block, static_cast<char*>(src.addr) + k * block, block))
          << "transfer " << k;
    }
  }
};

}  // namespace lab
