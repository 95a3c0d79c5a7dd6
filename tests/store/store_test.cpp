// SPDX-License-Identifier: Apache-2.0
// The metadata stores' clients (src/metadata) against real servers started here: Redis and etcd
// each run every case. Leases expire, survive refreshes and are lost when the store restarts
// empty; a stopped store, one that answers garbage, closes mid-reply or never answers fails each
// call within its deadline with an error that names the store.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "metadata/store.hpp"
#include "servers.hpp"

namespace rdmakit::detail::metadata {
namespace {

using namespace std::chrono_literals;
using test::FakeServer;
using test::StoreServer;

Deadline in(std::chrono::milliseconds d) { return deadline_in(d); }

class StoreTest : public ::testing::TestWithParam<StoreServer::Kind> {
 protected:
  StoreServer server{GetParam()};
  std::unique_ptr<Store> store = open_store(parse_store_uri(server.uri()));
};

TEST_P(StoreTest, PutGetListRemove) {
  store->put("ns/engines/a", "alpha", no_lease, in(2s));
  store->put("ns/engines/b", std::string("b\0eta", 5), no_lease, in(2s));
  store->put("ns/enginesX", "not under the prefix", no_lease, in(2s));
  store->put("other/engines/c", "another namespace", no_lease, in(2s));
  EXPECT_EQ(store->get("ns/engines/a", in(2s)), "alpha");
  EXPECT_EQ(store->get("ns/engines/none", in(2s)), std::nullopt);
  auto all = store->list("ns/engines/", in(2s));
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0], (KeyValue{"ns/engines/a", "alpha"}));
  EXPECT_EQ(all[1], (KeyValue{"ns/engines/b", std::string("b\0eta", 5)}));
  store->remove("ns/engines/a", in(2s));
  EXPECT_EQ(store->list("ns/engines/", in(2s)).size(), 1u);
}

TEST_P(StoreTest, GlobCharactersInAPrefixMatchThemselves) {
  store->put("n*s/x", "1", no_lease, in(2s));
  store->put("nXs/y", "2", no_lease, in(2s));
  auto got = store->list("n*s/", in(2s));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].key, "n*s/x");
}

TEST_P(StoreTest, EntriesOfALeaseNotRefreshedVanish) {
  LeaseId lease = store->grant(1s, in(2s));
  store->put("ns/engines/mortal", "x", lease, in(2s));
  ASSERT_TRUE(store->get("ns/engines/mortal", in(2s)));
  // etcd rounds a lease up to its minimum (2 s with the default election timeout).
  const auto t0 = Clock::now();
  while (store->get("ns/engines/mortal", in(2s)) && Clock::now() - t0 < 10s) {
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_FALSE(store->get("ns/engines/mortal", in(2s)));
  EXPECT_LT(Clock::now() - t0, 4s);
  EXPECT_THROW(store->refresh(lease, in(2s)), LeaseLost);
}

TEST_P(StoreTest, RefreshedEntriesStay) {
  LeaseId lease = store->grant(1s, in(2s));
  store->put("ns/engines/kept", "x", lease, in(2s));
  const auto t0 = Clock::now();
  while (Clock::now() - t0 < 3500ms) {
    store->refresh(lease, in(2s));
    std::this_thread::sleep_for(250ms);
  }
  EXPECT_EQ(store->get("ns/engines/kept", in(2s)), "x");
  store->revoke(lease, in(2s));
  EXPECT_FALSE(store->get("ns/engines/kept", in(2s)));
}

TEST_P(StoreTest, AStoreRestartedEmptyLosesTheLeaseAndTakesTheEntriesAgain) {
  LeaseId lease = store->grant(5s, in(2s));
  store->put("ns/engines/me", "epoch 1", lease, in(2s));
  server.restart_empty();
  // The first call may find the old connection dead (and reconnect on the next): what matters
  // is that the lost lease is reported, and a new one takes the entry again.
  bool lost = false;
  for (int i = 0; i < 3 && !lost; ++i) {
    try {
      store->refresh(lease, in(2s));
    } catch (const LeaseLost& e) {
      lost = true;
      EXPECT_NE(std::string(e.what()).find(server.uri()), std::string::npos) << e.what();
    } catch (const Error&) {
    }
  }
  ASSERT_TRUE(lost);
  lease = store->grant(5s, in(2s));
  store->put("ns/engines/me", "epoch 1", lease, in(2s));
  EXPECT_EQ(store->get("ns/engines/me", in(2s)), "epoch 1");
}

TEST_P(StoreTest, AStoppedStoreFailsWithinTheDeadlineNamingIt) {
  store->put("ns/k", "v", no_lease, in(2s));
  server.kill();
  const auto t0 = Clock::now();
  try {
    (void)store->get("ns/k", in(500ms));
    FAIL() << "a stopped store answered";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(server.uri()), std::string::npos) << e.what();
    EXPECT_FALSE(e.hint().empty()) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, 1500ms);
}

// etcd: a version token that a poller compares to skip a listing. Reading and keeping a lease
// alive change nothing; a put and a revoke (which deletes the lease's keys) do. Redis has none.
TEST_P(StoreTest, AVersionTellsWhetherAnythingChanged) {
  const auto v0 = store->version("ns/engines/", in(2s));
  if (GetParam() == StoreServer::Kind::redis) {
    EXPECT_EQ(v0, std::nullopt);
    return;
  }
  ASSERT_TRUE(v0.has_value());
  (void)store->list("ns/engines/", in(2s));
  EXPECT_EQ(store->version("ns/engines/", in(2s)), v0);
  store->put("ns/engines/a", "1", no_lease, in(2s));
  const auto v1 = store->version("ns/engines/", in(2s));
  EXPECT_NE(v1, v0);
  const LeaseId lease = store->grant(5s, in(2s));
  store->put("ns/engines/b", "2", lease, in(2s));
  const auto v2 = store->version("ns/engines/", in(2s));
  EXPECT_NE(v2, v1);
  store->refresh(lease, in(2s));
  EXPECT_EQ(store->version("ns/engines/", in(2s)), v2);
  store->revoke(lease, in(2s));
  EXPECT_NE(store->version("ns/engines/", in(2s)), v2);
}

// etcd's watch: every put and delete under the prefix after the version it starts from, in
// order (a revoked lease's keys as deletes), nothing from elsewhere; when the store goes, the
// watch says so. Redis cannot watch.
TEST_P(StoreTest, AWatchDeliversEveryChangeAfterItsVersion) {
  store->put("ns/engines/a", "before", no_lease, in(2s));
  const auto v = store->version("ns/engines/", in(2s));
  if (GetParam() == StoreServer::Kind::redis) {
    EXPECT_FALSE(store->watch("ns/engines/", "0:1", in(2s)));
    return;
  }
  ASSERT_TRUE(v.has_value());
  store->put("ns/engines/b", "two", no_lease, in(2s));  // after the version, before the watch
  ASSERT_TRUE(store->watch("ns/engines/", *v, in(2s)));
  const LeaseId lease = store->grant(5s, in(2s));
  store->put("ns/engines/c", "three", lease, in(2s));
  store->put("other/engines/x", "elsewhere", no_lease, in(2s));
  store->remove("ns/engines/b", in(2s));
  store->revoke(lease, in(2s));
  std::vector<WatchEvent> got;
  for (int i = 0; i < 100 && got.size() < 4; ++i) {
    for (auto& e : store->watch_events()) got.push_back(std::move(e));
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0].key, "ns/engines/b");
  EXPECT_EQ(got[0].value, "two");
  EXPECT_EQ(got[1].key, "ns/engines/c");
  EXPECT_EQ(got[1].value, "three");
  EXPECT_EQ(got[2].key, "ns/engines/b");
  EXPECT_EQ(got[2].value, std::nullopt);
  EXPECT_EQ(got[3].key, "ns/engines/c");
  EXPECT_EQ(got[3].value, std::nullopt);
  server.kill();
  bool ended = false;
  for (int i = 0; i < 100 && !ended; ++i) {
    try {
      (void)store->watch_events();
      std::this_thread::sleep_for(20ms);
    } catch (const Error& e) {
      ended = true;
      EXPECT_NE(std::string(e.what()).find(server.uri()), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(ended) << "the watch did not notice the store went";
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreTest,
                         ::testing::Values(StoreServer::Kind::redis, StoreServer::Kind::etcd),
                         [](const auto& param_info) {
                           return param_info.param == StoreServer::Kind::redis ? "redis" : "etcd";
                         });

// Servers that are not what the URI says: each call fails within its deadline, clearly.
struct Fake {
  const char* name;
  const char* scheme;
  const char* answer;
  bool close_after;
  const char* expect;  // in the message
};

class FakeStoreTest : public ::testing::TestWithParam<Fake> {};

TEST_P(FakeStoreTest, FailsClearlyWithinTheDeadline) {
  const Fake& f = GetParam();
  FakeServer fake(f.answer, f.close_after);
  auto store = open_store(parse_store_uri(fmt::format("{}://127.0.0.1:{}", f.scheme, fake.port())));
  for (int i = 0; i < 2; ++i) {  // and again, on a fresh connection
    const auto t0 = Clock::now();
    try {
      store->put("k", "v", no_lease, in(700ms));
      FAIL() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(f.expect), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(fake.port())), std::string::npos)
          << e.what();
    }
    EXPECT_LT(Clock::now() - t0, 1500ms);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Garbage, FakeStoreTest,
    ::testing::Values(
        Fake{"redis_garbage", "redis", "HTTP/1.1 400 Bad Request\r\n\r\n", true, "not the Redis protocol"},
        Fake{"redis_mid_reply", "redis", "$100\r\nonly part", true, "closed the connection"},
        Fake{"redis_silent", "redis", "", false, "deadline"},
        Fake{"etcd_not_json", "etcd",
             "HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!", true, "not JSON"},
        Fake{"etcd_mid_reply", "etcd", "HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{\"a\"", true,
             "no endpoint answered"},
        Fake{"etcd_silent", "etcd", "", false, "no endpoint answered"}),
    [](const auto& param_info) { return std::string(param_info.param.name); });

}  // namespace
}  // namespace rdmakit::detail::metadata
