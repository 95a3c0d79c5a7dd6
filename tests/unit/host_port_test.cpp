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

TEST(HostPort, Rejects) {
  EXPECT_THROW((void)parse_host_port("host:65536", 1), rdmakit::Error);
  EXPECT_THROW((void)parse_host_port("host:12x", 1), rdmakit::Error);
  EXPECT_THROW((void)parse_host_port("[::1", 1), rdmakit::Error);
}

}  // namespace
