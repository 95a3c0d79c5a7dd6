// SPDX-License-Identifier: Apache-2.0
// Parsing of EngineConfig::metadata URIs.
#include <gtest/gtest.h>

#include "metadata/uri.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail::metadata {
namespace {

TEST(StoreUri, P2pIsTheDefault) {
  EXPECT_EQ(parse_store_uri("").kind, StoreUri::Kind::p2p);
  EXPECT_EQ(parse_store_uri("p2p").kind, StoreUri::Kind::p2p);
}

TEST(StoreUri, RedisWithCredentialsAndDatabase) {
  StoreUri u = parse_store_uri("redis://app:s3cret@10.0.0.5:6380/2");
  EXPECT_EQ(u.kind, StoreUri::Kind::redis);
  ASSERT_EQ(u.hosts.size(), 1u);
  EXPECT_EQ(u.hosts[0].host, "10.0.0.5");
  EXPECT_EQ(u.hosts[0].port, 6380);
  EXPECT_EQ(u.user, "app");
  EXPECT_EQ(u.password, "s3cret");
  EXPECT_EQ(u.db, 2);
  // The password never appears where the store is named.
  EXPECT_EQ(u.shown(), "redis://app:***@10.0.0.5:6380/2");
  EXPECT_EQ(parse_store_uri("redis://:pw@h").shown(), "redis://:***@h:6379");
  EXPECT_EQ(parse_store_uri("redis://localhost").hosts[0].port, 6379);
}

TEST(StoreUri, EtcdWithSeveralEndpoints) {
  StoreUri u = parse_store_uri("etcd://a:2379,b,[fd00::1]:12379");
  EXPECT_EQ(u.kind, StoreUri::Kind::etcd);
  ASSERT_EQ(u.hosts.size(), 3u);
  EXPECT_EQ(u.hosts[1].host, "b");
  EXPECT_EQ(u.hosts[1].port, 2379);
  EXPECT_EQ(u.hosts[2].host, "fd00::1");
  EXPECT_EQ(u.hosts[2].port, 12379);
}

TEST(StoreUri, MistakesAreNamed) {
  for (const char* bad : {"redis:/h", "consul://h", "redis://", "redis://h/x", "redis://h:99999",
                          "redis://user@h", "redis://u:@h", "etcd://a,,b", "etcd://:2379"}) {
    try {
      (void)parse_store_uri(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.op(), "metadata URI") << bad;
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
      EXPECT_FALSE(e.hint().empty());
    }
  }
}

}  // namespace
}  // namespace rdmakit::detail::metadata
