// SPDX-License-Identifier: Apache-2.0
// Rolling upgrades against rxe (docs/compatibility.md): whole connections between this version
// and a peer of the previous bootstrap wire, version 6, frozen in tests/compat/wire_v6.cpp. Its
// side has no QP of its own (its HELLO names a QPN no QP holds): what is tested is that this
// side's QPs reach RTS on parameters exchanged in version 6, and that the connection carries its
// messages there. The engines of both versions (old and new binaries) were run against each
// other by hand: docs/compatibility.md says how.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "../compat/wire_v6.hpp"
#include "lab_helpers.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Connection;

const std::vector<std::uint8_t> kPsk(32, 0x61);

// The version-6 peer's HELLO: a QP number no QP holds, on this VM's own address (IPv4-mapped).
compat::v6::Hello fake_hello() {
  compat::v6::Hello h;
  h.qpn = 0x123;
  h.psn = 0x456;
  h.gid[10] = h.gid[11] = 0xff;
  const char* env = std::getenv("RDMAKIT_LAB_IP");  // the VM's address: its rxe GID
  const std::string ip = env != nullptr ? env : "127.0.0.1";
  in_addr a{};
  ::inet_pton(AF_INET, ip.c_str(), &a);
  std::memcpy(h.gid.data() + 12, &a, 4);
  h.gid_index = 1;
  h.mtu = 1024;
  return h;
}

rdmakit::ConnectionConfig config(bool keyed) {
  rdmakit::ConnectionConfig c = lab::quiet();
  c.method = rdmakit::ConnectMethod::tcp;
  if (keyed) c.psk = kPsk;
  c.handshake_timeout = 10s;
  return c;
}

class Compat : public ::testing::TestWithParam<bool> {};

// A client of version 6 connects to this version's listener: served in version 6 throughout.
TEST_P(Compat, APreviousVersionClientIsServedInItsVersion) {
  const bool keyed = GetParam();
  rdmakit::Listener listener(lab::here(0), config(keyed));
  std::string failed;
  std::vector<std::uint8_t> got;
  std::thread client([&] {
    const int fd = lab::raw_connect(lab::here(), listener.port(), 10);
    try {
      if (fd < 0) throw std::runtime_error("no TCP connection");
      compat::v6::Peer peer(fd, keyed ? kPsk : std::vector<std::uint8_t>{});
      peer.authenticate_client();
      peer.send(compat::v6::hello, compat::v6::encode_hello(fake_hello()));
      const compat::v6::Received r = peer.recv();
      if (r.type != compat::v6::hello) {
        throw std::runtime_error("no HELLO but a message of type " + std::to_string(r.type) + ": " +
                                 std::string(r.payload.begin(), r.payload.end()));
      }
      (void)compat::v6::decode_hello(r.payload);
      peer.send(compat::v6::ready, {});
      const compat::v6::Received m = peer.recv();  // the server's message, in version 6
      if (m.type != compat::v6::user) throw std::runtime_error("no USER");
      got = m.payload;
      peer.send(compat::v6::user, std::vector<std::uint8_t>{'v', '6'});
      (void)peer.recv();  // the server's BYE when it closes
    } catch (const std::exception& e) {
      failed = e.what();
    }
    if (fd >= 0) ::close(fd);
  });
  std::optional<Connection> conn = listener.accept(15s);
  if (!conn) {
    client.join();
    const auto r = listener.refusals();
    FAIL() << "not accepted: " << failed << " (refusals: protocol " << r.protocol << ", auth " << r.auth << ", other "
           << r.other << ")";
  }
  EXPECT_EQ(conn->info().wire_version, 6);
  EXPECT_EQ(conn->info().remote.qpn, 0x123u);
  conn->send_message(std::vector<std::uint8_t>{'v', '7'}, 5s);
  const auto answer = conn->receive_message(5s);
  EXPECT_EQ(answer.value_or(std::vector<std::uint8_t>{}), (std::vector<std::uint8_t>{'v', '6'}));
  conn.reset();  // BYE
  client.join();
  EXPECT_EQ(failed, "");
  EXPECT_EQ(got, (std::vector<std::uint8_t>{'v', '7'}));
}

// This version's client and a server of version 6: refused in version 7, connected again in 6.
TEST_P(Compat, AClientFallsBackToAPreviousVersionServer) {
  const bool keyed = GetParam();
  std::uint16_t port = 0;
  const int l = lab::listen_tcp(lab::here(), &port);
  ASSERT_GE(l, 0);
  std::string refused, failed;
  std::vector<std::uint8_t> got;
  std::thread server([&] {
    try {
      for (int attempt = 0; attempt < 2; ++attempt) {
        const int fd = ::accept(l, nullptr, nullptr);
        if (fd < 0) throw std::runtime_error("accept");
        timeval tv{10, 0};
        ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        compat::v6::Peer peer(fd, keyed ? kPsk : std::vector<std::uint8_t>{});
        if (!peer.serve_first(&refused)) {
          ::close(fd);
          continue;  // as version 6 did: refused, and the socket closed
        }
        const compat::v6::Received h = peer.recv();
        if (h.type != compat::v6::hello) throw std::runtime_error("no HELLO");
        (void)compat::v6::decode_hello(h.payload);
        peer.send(compat::v6::hello, compat::v6::encode_hello(fake_hello()));
        if (peer.recv().type != compat::v6::ready) throw std::runtime_error("no READY");
        const compat::v6::Received m = peer.recv();
        got = m.payload;
        peer.send(compat::v6::user, m.payload);  // echoed
        (void)peer.recv();  // BYE
        ::close(fd);
        return;
      }
      throw std::runtime_error("version 6 was never spoken");
    } catch (const std::exception& e) {
      failed = e.what();
    }
  });
  try {
    Connection conn = Connection::connect(lab::here(port), config(keyed));
    EXPECT_EQ(conn.info().wire_version, 6);
    EXPECT_EQ(conn.info().remote.qpn, 0x123u);
    conn.send_message(std::vector<std::uint8_t>{'h', 'i'}, 5s);
    const auto echo = conn.receive_message(5s);
    EXPECT_EQ(echo.value_or(std::vector<std::uint8_t>{}), (std::vector<std::uint8_t>{'h', 'i'}));
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
    ::shutdown(l, SHUT_RDWR);
  }
  server.join();
  ::close(l);
  EXPECT_EQ(failed, "");
  EXPECT_NE(refused.find("peer speaks 7, this side speaks 6"), std::string::npos) << refused;
}

// A server that refuses every version (a version-6 refusal of the client's 7, then the same
// refusal of its 6): the client connects again once, not more, and says why it failed.
TEST_P(Compat, AClientFallsBackOnlyOnce) {
  const bool keyed = GetParam();
  std::uint16_t port = 0;
  const int l = lab::listen_tcp(lab::here(), &port);
  ASSERT_GE(l, 0);
  timeval tv{1, 0};
  ::setsockopt(l, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);  // accept() gives up 1 s after the last
  int connections = 0;
  std::thread server([&] {
    for (int fd; (fd = ::accept(l, nullptr, nullptr)) >= 0; ::close(fd)) {
      ++connections;
      std::uint8_t head[12];
      if (::recv(fd, head, sizeof head, MSG_WAITALL) != 12) continue;
      const std::string why = "protocol version mismatch: peer speaks " + std::to_string((head[4] << 8) | head[5]) +
                              ", this side speaks 6";
      const auto reject = compat::v6::message(compat::v6::reject, std::vector<std::uint8_t>(why.begin(), why.end()));
      (void)::send(fd, reject.data(), reject.size(), MSG_NOSIGNAL);
    }
  });
  try {
    Connection conn = Connection::connect(lab::here(port), config(keyed));
    ADD_FAILURE() << "connected";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("peer speaks 6, this side speaks 6"), std::string::npos) << e.what();
  }
  server.join();
  ::close(l);
  EXPECT_EQ(connections, 2);
}

INSTANTIATE_TEST_SUITE_P(Keys, Compat, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "keyed" : "keyless"; });

}  // namespace
