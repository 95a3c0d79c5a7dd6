// SPDX-License-Identifier: Apache-2.0
// The Directory (src/metadata/directory.hpp) against real Redis and etcd: engines find each
// other, a dead engine goes within its lease, a restarted one is seen with its new epoch, a store
// restarted empty gets every entry back within a refresh interval without anyone being dropped,
// a stopped store leaves the cache serving, and a bad entry is skipped with the reason.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>

#include "metadata/directory.hpp"
#include "servers.hpp"

namespace rdmakit::detail::metadata {
namespace {

using namespace std::chrono_literals;
using test::StoreServer;
using Kind = DirectoryChange::Kind;

EngineRecord engine(const std::string& name, std::uint64_t epoch) {
  return {name, epoch, {"10.0.0.1:7600"}, {{"rxe0", 1, "ethernet", "::ffff:10.0.0.1", "10.0.0.0/24"}},
          {{"kv", 4096, "host"}},
          {},
          {}};
}

class DirectoryTest : public ::testing::TestWithParam<StoreServer::Kind> {
 protected:
  DirectoryConfig config(std::chrono::milliseconds lease = 2s) {
    DirectoryConfig c;
    c.uri = parse_store_uri(server.uri());
    c.cluster = "test";
    c.lease = lease;
    c.poll = 200ms;
    c.call_timeout = 500ms;
    return c;
  }
  // Ticks the directories until `done` or `limit`; returns the time it took.
  std::chrono::milliseconds tick_until(std::vector<Directory*> dirs, std::chrono::milliseconds limit,
                                       const std::function<bool()>& done) {
    const auto t0 = Clock::now();
    while (!done() && Clock::now() - t0 < limit) {
      for (Directory* d : dirs) {
        for (auto& c : d->tick()) changes.push_back(c);
      }
      std::this_thread::sleep_for(20ms);
    }
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  }
  bool saw(Kind kind, const std::string& name, std::uint64_t epoch = 0) const {
    for (const auto& c : changes) {
      if (c.kind == kind && c.record.name == name && (epoch == 0 || c.record.epoch == epoch)) return true;
    }
    return false;
  }

  StoreServer server{GetParam()};
  std::vector<DirectoryChange> changes;
};

TEST_P(DirectoryTest, EnginesFindEachOtherAndSeeSegmentsChange) {
  Directory a(config()), b(config());
  ASSERT_TRUE(a.publish(engine("a", 1)));
  ASSERT_TRUE(b.publish(engine("b", 7)));
  tick_until({&b}, 3s, [&] { return saw(Kind::appeared, "a"); });
  ASSERT_TRUE(saw(Kind::appeared, "a")) << b.status();
  EXPECT_FALSE(saw(Kind::appeared, "b"));  // never itself
  EXPECT_EQ(b.lookup("a", deadline_in(1s)), engine("a", 1));
  // A lookup goes to the store for a name the cache does not know yet.
  Directory c(config());
  EXPECT_EQ(c.lookup("b", deadline_in(1s)).epoch, 7u);
  // A new segment is published again and seen without a change event.
  EngineRecord more = engine("a", 1);
  more.segments.push_back({"weights", 1 << 20, "host"});
  ASSERT_TRUE(a.publish(more));
  tick_until({&b}, 3s, [&] { return b.known().at("a").segments.size() == 2; });
  EXPECT_EQ(b.known().at("a").segments.size(), 2u);
}

TEST_P(DirectoryTest, ADeadEnginesEntryGoesWithinItsLeaseAndOthersDropIt) {
  Directory b(config());
  ASSERT_TRUE(b.publish(engine("b", 1)));
  {
    Directory a(config());  // "killed": it neither refreshes nor withdraws
    ASSERT_TRUE(a.publish(engine("a", 1)));
    tick_until({&b}, 3s, [&] { return saw(Kind::appeared, "a"); });
    ASSERT_TRUE(saw(Kind::appeared, "a"));
  }
  auto store = open_store(parse_store_uri(server.uri()));
  const auto t0 = Clock::now();
  while (store->get(engine_key("test", "a"), deadline_in(1s)) && Clock::now() - t0 < 10s) {
    std::this_thread::sleep_for(50ms);
  }
  // Within the lease (etcd: its 2 s minimum) plus one second.
  EXPECT_LT(Clock::now() - t0, 3s);
  tick_until({&b}, 5s, [&] { return saw(Kind::gone, "a"); });
  EXPECT_TRUE(saw(Kind::gone, "a")) << b.status();
  EXPECT_FALSE(b.known().contains("a"));
  // b kept its own entry alive all along.
  EXPECT_TRUE(store->get(engine_key("test", "b"), deadline_in(1s)));
}

TEST_P(DirectoryTest, ARestartedEngineIsSeenWithItsNewEpoch) {
  Directory b(config());
  ASSERT_TRUE(b.publish(engine("b", 1)));
  Directory a1(config());
  ASSERT_TRUE(a1.publish(engine("a", 100)));
  tick_until({&b}, 3s, [&] { return saw(Kind::appeared, "a"); });
  a1.withdraw();  // or killed: either way its successor publishes a new epoch
  Directory a2(config());
  ASSERT_TRUE(a2.publish(engine("a", 200)));
  tick_until({&b, &a2}, 3s, [&] { return saw(Kind::restarted, "a", 200); });
  EXPECT_TRUE(saw(Kind::restarted, "a", 200)) << b.status();
  EXPECT_FALSE(saw(Kind::gone, "a"));
  EXPECT_EQ(b.known().at("a").epoch, 200u);
}

TEST_P(DirectoryTest, AStoreRestartedEmptyGetsEveryEntryBackAndNobodyIsDropped) {
  Directory a(config()), b(config());
  ASSERT_TRUE(a.publish(engine("a", 1)));
  ASSERT_TRUE(b.publish(engine("b", 1)));
  tick_until({&a, &b}, 3s, [&] { return saw(Kind::appeared, "a") && saw(Kind::appeared, "b"); });
  server.restart_empty();
  auto store = open_store(parse_store_uri(server.uri()));
  auto both_back = [&] {
    return store->get(engine_key("test", "a"), deadline_in(1s)) &&
           store->get(engine_key("test", "b"), deadline_in(1s));
  };
  // Within one refresh interval (a third of the lease) and a little.
  const auto took = tick_until({&a, &b}, 5s, both_back);
  EXPECT_TRUE(both_back()) << a.status();
  EXPECT_LT(took, 2s);
  tick_until({&a, &b}, 1s, [] { return false; });
  EXPECT_FALSE(saw(Kind::gone, "a"));
  EXPECT_FALSE(saw(Kind::gone, "b"));
}

TEST_P(DirectoryTest, AStoppedStoreLeavesTheCacheServingAndNamesItselfForTheUnknown) {
  Directory a(config()), b(config());
  ASSERT_TRUE(a.publish(engine("a", 1)));
  ASSERT_TRUE(b.publish(engine("b", 1)));
  tick_until({&b}, 3s, [&] { return saw(Kind::appeared, "a"); });
  server.kill();
  tick_until({&a, &b}, 3s, [] { return false; });  // longer than the lease: still nobody gone
  EXPECT_FALSE(saw(Kind::gone, "a"));
  EXPECT_EQ(b.lookup("a", deadline_in(500ms)).epoch, 1u);  // from the cache
  const auto t0 = Clock::now();
  try {
    (void)b.lookup("nobody", deadline_in(500ms));
    FAIL() << "an unknown engine was found with the store down";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(server.uri()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("nobody"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, 1500ms);
  EXPECT_NE(b.status().find("last failure"), std::string::npos) << b.status();
  // Back, empty: both put themselves in again.
  server.restart_empty();
  auto store = open_store(parse_store_uri(server.uri()));
  tick_until({&a, &b}, 5s, [&] { return store->list(engines_prefix("test"), deadline_in(1s)).size() == 2; });
  EXPECT_EQ(store->list(engines_prefix("test"), deadline_in(1s)).size(), 2u);
}

TEST_P(DirectoryTest, AnEntryThatIsNotARecordIsSkippedWithTheReason) {
  auto store = open_store(parse_store_uri(server.uri()));
  store->put(engine_key("test", "junk"), "{not json", no_lease, deadline_in(1s));
  store->put(engine_key("test", "liar"), encode(engine("someone-else", 1)), no_lease, deadline_in(1s));
  Directory a(config()), b(config());
  ASSERT_TRUE(a.publish(engine("a", 1)));
  ASSERT_TRUE(b.publish(engine("b", 1)));
  tick_until({&b}, 3s, [&] { return saw(Kind::appeared, "a"); });
  EXPECT_TRUE(saw(Kind::appeared, "a"));
  EXPECT_FALSE(b.known().contains("junk"));
  EXPECT_FALSE(b.known().contains("liar"));
  EXPECT_NE(b.status().find("not a JSON object"), std::string::npos) << b.status();
  EXPECT_NE(b.status().find("is engine \"someone-else\"'s"), std::string::npos) << b.status();
  EXPECT_THROW((void)b.lookup("junk", deadline_in(1s)), Error);
}

// An engine's entry deleted behind its back (its lease still alive) is put back within a
// refresh interval: with etcd the watch shows the delete, with Redis the refresh finds the key
// gone.
TEST_P(DirectoryTest, AnEntryDeletedByHandIsPutBack) {
  Directory a(config());
  ASSERT_TRUE(a.publish(engine("a", 7)));
  (void)a.tick();  // lists, and with etcd starts the watch
  auto store = open_store(parse_store_uri(server.uri()));
  store->remove(engine_key("test", "a"), deadline_in(1s));
  const auto back = tick_until({&a}, 3s, [&] { return store->get(engine_key("test", "a"), deadline_in(1s)).has_value(); });
  EXPECT_LT(back, 2s) << a.status();
}

INSTANTIATE_TEST_SUITE_P(Stores, DirectoryTest,
                         ::testing::Values(StoreServer::Kind::redis, StoreServer::Kind::etcd),
                         [](const auto& param_info) {
                           return param_info.param == StoreServer::Kind::redis ? "redis" : "etcd";
                         });

}  // namespace
}  // namespace rdmakit::detail::metadata
