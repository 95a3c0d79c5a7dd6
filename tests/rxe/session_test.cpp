// SPDX-License-Identifier: Apache-2.0
// Runs inside one lab VM: the pre-shared key protects the whole session. A relay that forwards
// the key proof gets nothing; a reader of the bootstrap traffic learns no address or rkey;
// replayed, reordered, truncated or altered frames end the connection and nothing else; an
// IPv6 host cannot dodge the per-peer caps by switching addresses in its /64; handshakes cannot
// pin memory beyond the listener's budget.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "lab_helpers.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/wire.hpp"
#include "relay.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using rdmakit::Access;
using rdmakit::Connection;
using rdmakit::ConnectionConfig;
using rdmakit::Listener;
using rdmakit::ListenerConfig;
using rdmakit::WaitStatus;

const std::vector<std::uint8_t> kKey(32, 0x6b);

ConnectionConfig quiet(std::vector<std::uint8_t> psk = {}) {
  ConnectionConfig cfg;
  cfg.log = [](std::string_view) {};
  cfg.psk = std::move(psk);
  cfg.handshake_timeout = 3s;
  return cfg;
}

Connection::Setup buffer() {
  return [](Connection& c) {
    c.advertise(c.allocate_memory(4096, Access::local_write | Access::remote_read | Access::remote_write));
  };
}

struct Log {
  std::mutex mu;
  std::string text;
  std::function<void(std::string_view)> sink() {
    return [this](std::string_view m) {
      std::lock_guard lock(mu);
      text += std::string(m) + "\n";
    };
  }
  std::string get() {
    std::lock_guard lock(mu);
    return text;
  }
};

std::string via(const lab::Relay& r) { return "127.0.0.1:" + std::to_string(r.port()); }

// A relay forwards the client's challenge and proof (so the server believes the client proved
// the key) and then sends its own HELLO in the clear. The server refuses it before building
// anything; the client fails with the server's reason.
TEST(Session, ARelayThatForwardsTheProofGetsNothing) {
  Log log;
  ConnectionConfig scfg = quiet(kKey);
  scfg.log = log.sink();
  Listener listener("127.0.0.1:0", scfg, buffer());
  const auto before = lab::rdma_resources();
  rdmakit::wire::EndpointInfo fake;
  fake.qpn = 0x77;
  fake.mtu = 1024;
  fake.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, 1};
  lab::Relay relay(listener.port(), [&](std::size_t i, const lab::Frame& f) -> std::vector<lab::Frame> {
    if (i < 2) return {f};  // AUTH_CHALLENGE, AUTH_PROOF
    return {rdmakit::wire::encode_hello(fake)};  // the client's sealed HELLO is swapped for its own
  });
  try {
    (void)Connection::connect(via(relay), quiet(kKey), buffer());
    ADD_FAILURE() << "connected through a relay that replaced the HELLO";
  } catch (const rdmakit::Error& e) {
    std::printf("the client: %s\n", e.what());
    EXPECT_NE(std::string(e.what()).find("HELLO in the clear where an encrypted frame was due"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(lab::rdma_resources(), before) << "the server built something for the injected HELLO";
  for (int i = 0; i < 50 && listener.rejected() == 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(listener.rejected(), 1u);
  EXPECT_NE(log.get().find("in the clear where an encrypted frame was due"), std::string::npos) << log.get();
  // What the relay saw of the server after the proof: sealed frames only.
  const auto seen = relay.captured();
  std::size_t at = 0, sealed = 0, plain_after_proof = 0, index = 0;
  while (seen.size() - at >= rdmakit::wire::kHeaderSize) {
    const auto h = rdmakit::wire::decode_header(std::span(seen).subspan(at));
    if (index >= 3) (h.type == rdmakit::wire::MessageType::sealed ? sealed : plain_after_proof) += 1;
    at += rdmakit::wire::kHeaderSize + h.length;
    ++index;
  }
  EXPECT_GE(sealed, 1u);
}

// Every byte of a keyed session's bootstrap and control traffic, recorded by a relay: none of the
// advertised addresses or rkeys appears, in either byte order. Without a key they do (which
// shows the search finds them).
TEST(Session, ACapturedKeyedSessionShowsNoAddressOrRkey) {
  for (bool keyed : {false, true}) {
    const auto psk = keyed ? kKey : std::vector<std::uint8_t>{};
    Listener listener("127.0.0.1:0", quiet(psk), buffer());
    lab::Relay relay(listener.port());
    std::vector<rdmakit::RemoteRegion> regions;
    {
      Connection c = Connection::connect(via(relay), quiet(psk), buffer());
      auto s = listener.accept(5s);
      ASSERT_TRUE(s.has_value());
      regions = c.remote_regions();
      regions.insert(regions.end(), s->remote_regions().begin(), s->remote_regions().end());
      std::memcpy(c.memory(0).data(), "data", 4);
      ASSERT_TRUE(c.post_write(c.memory(0).local().subslice(0, 4), c.remote_regions()[0], 0, 1).ok());
      ASSERT_TRUE(c.wait(5s).completion.ok());
      const std::vector<std::uint8_t> note = {'h', 'i'};
      c.send_message(note, 2s);
      ASSERT_TRUE(s->receive_message(5s).has_value());
      c.close();
    }
    const auto seen = relay.captured();
    auto contains = [&](std::uint64_t v, int width) {
      for (bool big : {true, false}) {
        std::vector<std::uint8_t> b;
        for (int i = 0; i < width; ++i) {
          const int shift = big ? 8 * (width - 1 - i) : 8 * i;
          b.push_back(static_cast<std::uint8_t>(v >> shift));
        }
        if (std::search(seen.begin(), seen.end(), b.begin(), b.end()) != seen.end()) return true;
      }
      return false;
    };
    int found = 0;
    for (const auto& r : regions) found += contains(r.addr, 8) + contains(r.rkey, 4);
    std::printf("%s session: %zu bytes captured, %d of %zu addresses and rkeys found in them\n",
                keyed ? "keyed" : "keyless", seen.size(), found, 2 * regions.size());
    ASSERT_EQ(regions.size(), 2u);
    if (keyed) {
      EXPECT_EQ(found, 0);
    } else {
      EXPECT_EQ(found, 4);
    }
  }
}

// A keyed connection through a relay that tampers with the client's frames after the handshake
// (two application messages follow it): each tampering ends the connection with a clear error
// on the server, nothing of the tampered frame is used, and a good client's connection beside it
// is unaffected.
TEST(Session, ReplayedReorderedTruncatedOrAlteredFramesEndTheConnection) {
  struct Case {
    const char* what;
    const char* reason;
    std::size_t delivered;  // messages the server gets before it stops trusting the connection
  };
  const Case cases[] = {
      {"replayed", "failed to authenticate", 1},
      {"reordered", "failed to authenticate", 0},
      {"altered", "failed to authenticate", 0},
      {"truncated", "in the middle of a frame", 0},
  };
  Log log;
  ConnectionConfig scfg = quiet(kKey);
  scfg.log = log.sink();
  Listener listener("127.0.0.1:0", scfg, buffer());
  Connection good = Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(kKey), buffer());
  auto good_server = listener.accept(5s);
  ASSERT_TRUE(good_server.has_value());
  for (const Case& k : cases) {
    std::optional<lab::Frame> held;
    std::optional<lab::Relay> relay;
    relay.emplace(listener.port(), [&](std::size_t i, const lab::Frame& f) -> std::vector<lab::Frame> {
      // 0 AUTH_CHALLENGE, 1 AUTH_PROOF, 2 HELLO, 3 READY, then the application messages.
      if (i < 4) return {f};
      const std::string what = k.what;
      if (what == "replayed") return i == 4 ? std::vector<lab::Frame>{f, f} : std::vector<lab::Frame>{f};
      if (what == "reordered") {
        if (i == 4) {
          held = f;
          return {};
        }
        return {f, *held};
      }
      if (what == "altered") {
        lab::Frame bad = f;
        bad[bad.size() / 2] ^= 0x01;
        return {bad};
      }
      // Truncated: half the first frame, then the relay gives up.
      if (i > 4) return {};
      relay->cut();
      return {lab::Frame(f.begin(), f.begin() + static_cast<long>(f.size() / 2))};
    });
    Connection c = Connection::connect(via(*relay), quiet(kKey), buffer());
    auto s = listener.accept(5s);
    ASSERT_TRUE(s.has_value()) << k.what;
    for (const std::string m : {"first", "second"}) {
      try {
        c.send_message(std::vector<std::uint8_t>(m.begin(), m.end()), 1s);
      } catch (const rdmakit::Error&) {
        // The truncating relay has hung up.
      }
    }
    WaitStatus st = WaitStatus::timeout;
    for (int i = 0; i < 50 && st != WaitStatus::peer_lost; ++i) st = s->wait(100ms).status;
    EXPECT_EQ(st, WaitStatus::peer_lost) << k.what;
    EXPECT_NE(s->failure().find(k.reason), std::string::npos) << k.what << ": " << s->failure();
    std::size_t delivered = 0;
    while (auto m = s->receive_message(0ms)) {
      EXPECT_EQ(std::string(m->begin(), m->end()), delivered == 0 ? "first" : "second") << k.what;
      ++delivered;
    }
    EXPECT_EQ(delivered, k.delivered) << k.what;
    std::printf("%s: %s\n", k.what, s->failure().c_str());
    // The good connection carries on.
    std::memcpy(good.memory(0).data(), k.what, 4);
    ASSERT_TRUE(good.post_write(good.memory(0).local().subslice(0, 4), good.remote_regions()[0], 0, 1).ok());
    const auto w = good.wait(5s);
    EXPECT_TRUE(w.status == WaitStatus::completed && w.completion.ok()) << k.what;
    EXPECT_EQ(std::memcmp(good_server->memory(0).data(), k.what, 4), 0) << k.what;
  }
  EXPECT_NE(log.get().find("failed to authenticate; the connection is closed"), std::string::npos) << log.get();
}

// Binds a socket to `source` (any address of a local prefix: AnyIP) and connects to `to`, both
// IPv6; -1 on failure.
int connect6_from(const std::string& source, const std::string& to, std::uint16_t port) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  const int on = 1;
  ::setsockopt(fd, IPPROTO_IPV6, IPV6_FREEBIND, &on, sizeof on);
  sockaddr_in6 s{};
  s.sin6_family = AF_INET6;
  ::inet_pton(AF_INET6, source.c_str(), &s.sin6_addr);
  sockaddr_in6 d{};
  d.sin6_family = AF_INET6;
  d.sin6_port = htons(port);
  ::inet_pton(AF_INET6, to.c_str(), &d.sin6_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&s), sizeof s) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&d), sizeof d) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// 500 silent connects from 500 addresses of one /64 count as one peer: beyond the per-peer
// handshake cap they are refused at once, and a good client from another prefix connects about
// as fast as unloaded.
TEST(Session, FiveHundredAddressesOfOnePrefixAreOnePeer) {
  ASSERT_EQ(std::system("ip -6 route add local 2001:db8:77::/64 dev lo && ip -6 addr add 2001:db8:78::1/128 dev lo"), 0);
  struct Undo {
    ~Undo() {
      (void)std::system("ip -6 route del local 2001:db8:77::/64 dev lo; ip -6 addr del 2001:db8:78::1/128 dev lo");
    }
  } undo;
  Listener listener(":0", quiet(kKey), buffer());
  const std::string good = "[2001:db8:78::1]:" + std::to_string(listener.port());
  auto connect_time = [&] {
    const auto t0 = Clock::now();
    Connection c = Connection::connect(good, quiet(kKey), buffer());
    const auto took = Clock::now() - t0;
    EXPECT_TRUE(listener.accept(5s).has_value());
    return std::chrono::duration<double, std::milli>(took).count();
  };
  const double unloaded = connect_time();
  const auto before = lab::rdma_resources();
  std::vector<int> flood;
  for (int i = 1; i <= 500; ++i) {
    char src[64];
    std::snprintf(src, sizeof src, "2001:db8:77::%x", i);
    const int fd = connect6_from(src, "2001:db8:78::1", listener.port());
    if (fd >= 0) flood.push_back(fd);
  }
  ASSERT_EQ(flood.size(), 500u);
  std::this_thread::sleep_for(200ms);
  const double loaded = connect_time();
  std::printf("good client: %.1f ms unloaded, %.1f ms beside 500 silent connects from one /64 (%.2fx); "
              "%zu refused\n",
              unloaded, loaded, loaded / unloaded, listener.rejected());
  EXPECT_GE(listener.rejected(), 500u - 32u);  // all but the per-peer cap's worth
  EXPECT_LT(loaded, 2000.0);                    // generous: queued behind the flood it would wait 3 s
  const auto during = lab::rdma_resources();
  EXPECT_LE(during.at("qp"), before.at("qp"));  // nothing built for the flood (it never proved the key)
  for (int fd : flood) ::close(fd);
}

// On a listener without a key anyone may send a HELLO, and every HELLO runs Setup: the bytes
// Setup pins for handshakes in progress stay within the listener's budget, and the rest are
// refused as busy.
TEST(Session, HandshakesCannotPinMemoryBeyondTheBudget) {
  constexpr std::size_t kPerSetup = 8u << 20;
  ListenerConfig lcfg = quiet();
  lcfg.max_handshake_memory = 3 * kPerSetup;
  Listener listener("127.0.0.1:0", lcfg, [](Connection& c) {
    c.advertise(c.allocate_memory(kPerSetup, Access::remote_write));
  });
  const auto before = lab::rdma_resources();
  rdmakit::wire::EndpointInfo fake;
  fake.qpn = 0x99;
  fake.mtu = 1024;
  fake.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, 1};
  const auto hello = rdmakit::wire::encode_hello(fake);
  std::vector<int> stalled;
  for (int i = 0; i < 10; ++i) {
    // A served one's answer may take over a second under TSan: read until the listener closes
    // it at its handshake deadline, or 5 s.
    const int fd = lab::raw_connect("127.0.0.1", listener.port(), 5);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(lab::send_bytes(fd, hello));  // and then never READY
    stalled.push_back(fd);
  }
  std::this_thread::sleep_for(500ms);
  const auto during = lab::rdma_resources();
  int busy = 0, served = 0;
  for (int fd : stalled) {
    const auto got = lab::read_messages(fd);
    if (!got.empty() && got[0].first.type == rdmakit::wire::MessageType::reject) {
      const std::string why = rdmakit::wire::decode_reject(got[0].second);
      busy += why.find("busy: handshakes in progress have pinned") != std::string::npos;
    } else if (!got.empty()) {
      ++served;
    }
    ::close(fd);
  }
  std::printf("10 stalled HELLOs against a 24 MiB budget of 8 MiB each: %d served, %d refused as busy; "
              "MRs %ld -> %ld\n",
              served, busy, before.at("mr"), during.at("mr"));
  EXPECT_LE(during.at("mr") - before.at("mr"), 3);
  EXPECT_EQ(served, 3);
  EXPECT_EQ(busy, 7);
  // Once they are gone, the budget is free again: a real client connects.
  std::this_thread::sleep_for(3500ms);  // the stalled handshakes' deadline
  EXPECT_NO_THROW((void)Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(), buffer()));
}

// What the key costs: the handshake with and without it (medians of 15). The data path itself is
// the same either way; bench/compare-perftest and docs/performance.md have its figures.
TEST(Session, HandshakeTimeWithAndWithoutAKey) {
  double median[2] = {};
  for (int keyed = 0; keyed < 2; ++keyed) {
    const auto psk = keyed ? kKey : std::vector<std::uint8_t>{};
    Listener listener("127.0.0.1:0", quiet(psk), buffer());
    std::vector<double> ms;
    for (int i = 0; i < 15; ++i) {
      const auto t0 = Clock::now();
      Connection c = Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(psk), buffer());
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      ASSERT_TRUE(listener.accept(5s).has_value());
    }
    std::sort(ms.begin(), ms.end());
    median[keyed] = ms[ms.size() / 2];
  }
  std::printf("handshake median: %.2f ms without a key, %.2f ms with one (%.2fx)\n", median[0], median[1],
              median[1] / median[0]);
  EXPECT_LT(median[1], 10 * median[0] + 50);  // the key adds a round trip and a few MACs, no more
}

}  // namespace
