// SPDX-License-Identifier: Apache-2.0
// Engine links in the previous bootstrap wire version (docs/compatibility.md), on every CI run:
// a proxy in front of a target refuses an initiator's connection in version 7 as a listener of
// version 6 would, and forwards the rest to the target. Keyless, the initiator falls back and
// links in version 6 (a transport block without the engine protocol byte, tcp streams opened in
// 6): the link moves data. With a key, the target (of this version) marks its nonce when it
// answers in 6: the initiator sees that the refusal did not come from it and connects again in
// 7, so a forged refusal costs a connection, never a downgrade; and one that refuses every 7 is
// not followed down.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine_helpers.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/wire.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Engine;
using rdmakit::Transfer;
using rdmakit::TransferOp;

// On 127.0.0.1: a connection whose first message is in version 7 gets a version-6 listener's
// refusal (the first such one, or every one with `every`); the others are forwarded to `port`,
// both ways, until either side closes. Every socket has a deadline.
class ForgingProxy {
 public:
  ForgingProxy(std::uint16_t port, bool every) : target_(port), every_(every) {
    listener_ = lab::listen_tcp("127.0.0.1", &port_);
    EXPECT_GE(listener_, 0);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ForgingProxy(const ForgingProxy&) = delete;
  ForgingProxy& operator=(const ForgingProxy&) = delete;
  ~ForgingProxy() {
    stop_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    acceptor_.join();  // the only one that starts pumps: they are all there now
    for (auto& t : pumps_) t.join();
    ::close(listener_);
  }
  [[nodiscard]] std::uint16_t port() const { return port_; }
  [[nodiscard]] int refused() const { return refused_; }
  [[nodiscard]] int forwarded() const { return forwarded_; }

 private:
  static void deadlines(int fd) {
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  void accept_loop() {
    while (!stop_) {
      pollfd p{listener_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      deadlines(fd);
      std::uint8_t head[rdmakit::wire::kHeaderSize];
      if (::recv(fd, head, sizeof head, MSG_WAITALL) != static_cast<ssize_t>(sizeof head)) {
        ::close(fd);
        continue;
      }
      const bool seven = head[4] == 0 && head[5] == 7;
      if (seven && (every_ || refused_ == 0)) {
        // Counted before the REJECT goes: the client may end its batch on reading it, and the
        // test reads the count then.
        ++refused_;
        // What a version-6 listener sent: its decode_header's Error, whole, in a version-6 REJECT.
        const auto reject = rdmakit::wire::encode_reject(
            "bootstrap decode failed: EBADMSG (Bad message): protocol version mismatch: peer speaks 7, this side "
            "speaks 6. Hint: run the same rdmakit protocol version on both hosts",
            6);
        (void)::send(fd, reject.data(), reject.size(), MSG_NOSIGNAL);
        ::close(fd);
        continue;
      }
      const int up = lab::raw_connect("127.0.0.1", target_, 5);
      if (up < 0 || ::send(up, head, sizeof head, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof head)) {
        if (up >= 0) ::close(up);
        ::close(fd);
        continue;
      }
      deadlines(up);
      ++forwarded_;
      pumps_.emplace_back([this, fd, up] { pump(fd, up); });
    }
  }
  void pump(int a, int b) {
    std::vector<std::uint8_t> buf(64 * 1024);
    pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    while (!stop_) {
      if (::poll(p, 2, 50) <= 0) continue;
      bool closed = false;
      for (int k = 0; k < 2 && !closed; ++k) {
        if ((p[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t n = ::recv(p[k].fd, buf.data(), buf.size(), MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN)) {
          closed = true;
          break;
        }
        if (n > 0 && ::send(p[1 - k].fd, buf.data(), static_cast<std::size_t>(n), MSG_NOSIGNAL) != n) closed = true;
      }
      if (closed) break;
    }
    ::shutdown(a, SHUT_RDWR);
    ::shutdown(b, SHUT_RDWR);
    ::close(a);
    ::close(b);
  }

  std::uint16_t target_;
  bool every_;
  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> refused_{0}, forwarded_{0};
  std::thread acceptor_;
  std::vector<std::thread> pumps_;  // started, and touched, by the acceptor alone until it is joined
};

void skip_over_cm() {
  if (lab::test_method() == rdmakit::ConnectMethod::rdma_cm) GTEST_SKIP() << "a TCP proxy: the TCP bootstrap's";
}

TEST(EngineCompat, ALinkThroughAPreviousVersionRefusalFallsBackAndMovesData) {
  skip_over_cm();
  Engine target(lab::config("target"));
  const rdmakit::Buffer seg = target.allocate_memory(64 * 1024);
  std::memset(seg.addr, 0, 64 * 1024);
  target.expose("kv", seg, Access::remote_read | Access::remote_write);
  ForgingProxy proxy(target.port(), /*every=*/false);
  rdmakit::EngineConfig ic = lab::config("init");
  ic.listen = "";
  Engine init(ic);
  init.add_peer("target", "127.0.0.1:" + std::to_string(proxy.port()));
  const rdmakit::Buffer src = init.allocate_memory(64 * 1024);
  const rdmakit::Buffer back = init.allocate_memory(64 * 1024);
  lab::fill(src.addr, 64 * 1024, 0x31);
  const Transfer w{TransferOp::write, src, 0, 64 * 1024, init.segment("target", "kv"), 0};
  rdmakit::Batch b = init.submit({&w, 1});
  ASSERT_TRUE(lab::waited(b, 30s));
  ASSERT_EQ(b.failed(), 0u) << b.describe_failures();
  const Transfer r{TransferOp::read, back, 0, 64 * 1024, init.segment("target", "kv"), 0};
  rdmakit::Batch rb = init.submit({&r, 1});
  ASSERT_TRUE(lab::waited(rb, 30s));
  ASSERT_EQ(rb.failed(), 0u) << rb.describe_failures();
  EXPECT_TRUE(lab::same(seg.addr, src.addr, 64 * 1024));
  EXPECT_TRUE(lab::same(back.addr, src.addr, 64 * 1024));
  const rdmakit::PeerInfo p = init.peers().at(0);
  EXPECT_EQ(p.wire_version, 6) << p.transport << ": " << p.transport_reason;
  EXPECT_EQ(proxy.refused(), 1);
  EXPECT_GE(proxy.forwarded(), 1);
  if (p.transport == "shm") {
    // A peer of wire 6 speaks engine protocol 7: no memory is mapped, the copies go the old way.
    EXPECT_NE(p.transport_reason.find("maps no memory (engine protocol 7)"), std::string::npos) << p.transport_reason;
    EXPECT_EQ(init.counters().shm_mapped_bytes, 0u);
  }
}

// A keyed initiator whose version a proxy refuses (once, then every time) in front of a target
// of this version: the target's mark shows the refusal was not its own.
void keyed_through(bool every) {
  rdmakit::EngineConfig tc = lab::config("target");
  tc.link.psk.assign(32, 0x4e);
  Engine target(tc);
  const rdmakit::Buffer seg = target.allocate_memory(4096);
  std::memset(seg.addr, 0, 4096);
  target.expose("kv", seg, Access::remote_read | Access::remote_write);
  ForgingProxy proxy(target.port(), every);
  rdmakit::EngineConfig ic = lab::config("init");
  ic.listen = "";
  ic.link.psk.assign(32, 0x4e);
  ic.link.handshake_timeout = 5s;
  Engine init(ic);
  init.add_peer("target", "127.0.0.1:" + std::to_string(proxy.port()));
  const rdmakit::Buffer src = init.allocate_memory(4096);
  std::memset(src.addr, 0x7e, 4096);
  const Transfer w{TransferOp::write, src, 0, 4096, init.segment("target", "kv"), 0};
  rdmakit::Batch b = init.submit({&w, 1});
  ASSERT_TRUE(lab::waited(b, 30s));
  const auto result = b.result(0);
  const auto* m = static_cast<const std::uint8_t*>(seg.addr);
  if (!every) {
    // Refused once (forged), answered in 6 with the mark, then linked in 7: a connection lost.
    EXPECT_EQ(result.status, rdmakit::TransferStatus::ok) << result.reason;
    EXPECT_EQ(init.peers().at(0).wire_version, 7);
    EXPECT_EQ(proxy.refused(), 1);
    EXPECT_GE(proxy.forwarded(), 2);
    EXPECT_TRUE(std::all_of(m, m + 4096, [](std::uint8_t v) { return v == 0x7e; }));
    return;
  }
  // Refused every time in 7: 7, 6 (marked), 7 again refused, and no further.
  EXPECT_EQ(result.status, rdmakit::TransferStatus::connect_failed) << result.reason;
  EXPECT_NE(result.reason.find("refused 7"), std::string::npos) << result.reason;
  EXPECT_EQ(proxy.refused(), 2);
  EXPECT_EQ(proxy.forwarded(), 1);
  EXPECT_TRUE(std::all_of(m, m + 4096, [](std::uint8_t v) { return v == 0; }));
}

TEST(EngineCompat, AForgedRefusalOfAKeyedLinkCostsAConnectionNotADowngrade) {
  skip_over_cm();
  keyed_through(/*every=*/false);
}

TEST(EngineCompat, RefusalsOfEveryVersion7AreNotFollowedDown) {
  skip_over_cm();
  keyed_through(/*every=*/true);
}

}  // namespace
