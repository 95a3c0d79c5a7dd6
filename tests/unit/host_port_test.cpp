// SPDX-License-Identifier: Apache-2.0
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "bootstrap/socket.hpp"
#include "rdmakit/error.hpp"

namespace {

using rdmakit::detail::parse_host_port;

TEST(HostPort, Forms) {
  auto hp = parse_host_port("198.18.0.1:12025", 1);
  EXPECT_EQ(hp.host, "198.18.0.1");
  EXPECT_EQ(hp.port, 12025);
  hp = parse_host_port("[fe80::1]:7", 1);
  EXPECT_EQ(hp.host, "fe80::1");
  EXPECT_EQ(hp.port, 7);
  hp = parse_host_port("fe80::1", 9);
  EXPECT_EQ(hp.host, "fe80::1");
  EXPECT_EQ(hp.port, 9);
  hp = parse_host_port("4791", 1);
  EXPECT_EQ(hp.host, "");
  EXPECT_EQ(hp.port, 4791);
  hp = parse_host_port(":80", 1);
  EXPECT_EQ(hp.host, "");
  EXPECT_EQ(hp.port, 80);
  hp = parse_host_port("server.example", 12025);
  EXPECT_EQ(hp.host, "server.example");
  EXPECT_EQ(hp.port, 12025);
  EXPECT_EQ(parse_host_port("[::1]:5", 0).to_string(), "[::1]:5");
  EXPECT_EQ(parse_host_port("127.0.0.1:0", 1).port, 0);  // listen on any free port
}

TEST(HostPort, LoopbackIsAnAddressNotAPrefix) {
  using rdmakit::detail::loopback_host;
  for (const char* yes : {"localhost", "127.0.0.1", "127.1.2.3", "::1", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(loopback_host(yes)) << yes;
  }
  for (const char* no : {"", "0.0.0.0", "::", "198.18.0.1", "127.0.0.1.nip.io", "127.example", "::ffff:10.0.0.1",
                         "fe80::1", "128.0.0.1"}) {
    EXPECT_FALSE(loopback_host(no)) << no;
  }
}

TEST(HostPort, Rejects) {
  EXPECT_THROW((void)parse_host_port("host:65536", 1), rdmakit::Error);
  EXPECT_THROW((void)parse_host_port("host:12x", 1), rdmakit::Error);
  EXPECT_THROW((void)parse_host_port("[::1", 1), rdmakit::Error);
}

// A peer that resets the connection is reported as ECONNRESET: the errno of the failed recv(),
// not that of the getpeername() that names the peer in the message (ENOTCONN on a reset socket).
TEST(BootstrapSocket, AResetConnectionIsReportedAsReset) {
  using namespace rdmakit::detail;
  Fd listener = tcp_listen(parse_host_port("127.0.0.1:0", 0), 4);
  sockaddr_in a{};
  socklen_t len = sizeof a;
  ASSERT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&a), &len), 0);
  const auto deadline = [] { return deadline_in(std::chrono::milliseconds{2000}); };
  Fd client = tcp_connect(parse_host_port("127.0.0.1:" + std::to_string(ntohs(a.sin_port)), 0), deadline());
  std::string peer;
  Fd served = tcp_accept(listener.get(), std::chrono::milliseconds{2000}, &peer);
  ASSERT_TRUE(served);
  const linger reset{1, 0};  // close() then sends a RST
  ASSERT_EQ(::setsockopt(served.get(), SOL_SOCKET, SO_LINGER, &reset, sizeof reset), 0);
  served = Fd();
  std::vector<std::uint8_t> buf(8);
  try {
    recv_exact(client.get(), buf, deadline());
    ADD_FAILURE() << "read from a reset connection";
  } catch (const rdmakit::Error& e) {
    EXPECT_EQ(e.sys_errno(), ECONNRESET) << e.what();
    EXPECT_NE(std::string(e.what()).find("reset the connection"), std::string::npos) << e.what();
  }
}

}  // namespace
