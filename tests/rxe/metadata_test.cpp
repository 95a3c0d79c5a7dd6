// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: engines that find each other through a real Redis or etcd (started by each
// case on this VM), move validated data, drop a SIGKILLed peer within its lease and find its
// restart by themselves, keep working through a store outage and re-publish into a store
// restarted empty; bad answers from a store get a clear error and no hang.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>

#include "lab_helpers.hpp"
#include "metadata/directory.hpp"
#include "metadata/record.hpp"
#include "metadata/store.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/metrics.hpp"
#include "servers.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Batch;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::EngineConfig;
using rdmakit::RemoteSegment;
using rdmakit::Transfer;
using rdmakit::TransferOp;
using rdmakit::TransferResult;
using rdmakit::TransferStatus;
using rdmakit::test::FakeServer;
using rdmakit::test::StoreServer;
using Clock = std::chrono::steady_clock;

constexpr auto kLease = 2s;
constexpr auto kPoll = 200ms;
constexpr auto kCall = 1s;
// How long an entry may be missing before its engine is gone.
constexpr auto kGrace = rdmakit::detail::metadata::gone_after(kLease, kPoll, kCall);

rdmakit::MetadataConfig metadata(const std::string& uri) {
  rdmakit::MetadataConfig m;
  m.uri = uri;
  m.cluster = "t";
  m.lease = kLease;
  m.poll = kPoll;
  m.call_timeout = kCall;
  return m;
}

EngineConfig config(const std::string& name, const std::string& uri) {
  EngineConfig c;
  c.name = name;
  c.listen = "127.0.0.1:0";
  c.link = lab::quiet();
  c.metadata = metadata(uri);
  if (const auto t = lab::test_transports(); !t.empty()) c.transports = t;  // on the host: tcp
  return c;
}

void fill(void* p, std::size_t n, std::uint8_t seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(seed + i * 7 + (i >> 9));
}

TransferResult move(Engine& e, TransferOp op, const Buffer& local, RemoteSegment seg, std::uint64_t len) {
  Transfer t;
  t.op = op;
  t.local = local;
  t.length = len;
  t.remote = seg;
  Batch b = e.submit({&t, 1});
  if (!b.wait(15s)) return {TransferStatus::pending, "no end within 15 s"};
  return b.result(0);
}

// Writes `len` bytes of a pattern to `seg` and reads them back: every byte compared.
void round_trip(Engine& e, RemoteSegment seg, std::uint64_t len, std::uint8_t seed) {
  const Buffer out = e.allocate_memory(len), in = e.allocate_memory(len);
  fill(out.addr, len, seed);
  const TransferResult w = move(e, TransferOp::write, out, seg, len);
  ASSERT_EQ(w.status, TransferStatus::ok) << w.reason;
  const TransferResult r = move(e, TransferOp::read, in, seg, len);
  ASSERT_EQ(r.status, TransferStatus::ok) << r.reason;
  EXPECT_EQ(std::memcmp(out.addr, in.addr, len), 0);
}

bool lists(const std::vector<rdmakit::PublishedEngine>& v, const std::string& name) {
  return std::any_of(v.begin(), v.end(), [&](const auto& e) { return e.name == name; });
}

// Polls `done` every 50 ms until it holds or `limit` passes; returns the time taken.
template <typename F>
std::chrono::milliseconds until(std::chrono::milliseconds limit, F done) {
  const auto t0 = Clock::now();
  while (!done() && Clock::now() - t0 < limit) std::this_thread::sleep_for(50ms);
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
}

// A target in a process of its own (the fault peer's engine mode), published in `uri`.
std::unique_ptr<lab::Child> target(const std::string& uri, const std::string& name) {
  ::setenv("RDMAKIT_PEER_METADATA", uri.c_str(), 1);
  auto c = std::make_unique<lab::Child>("engine", "0", name);
  ::unsetenv("RDMAKIT_PEER_METADATA");
  return c;
}

class Metadata : public ::testing::TestWithParam<StoreServer::Kind> {
 protected:
  Clock::time_point began = Clock::now();
  StoreServer server{GetParam()};
  // Milliseconds since the case began (the store's start included), for the timeline printed.
  long long ms() const {
    return static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - began).count());
  }
};

// Two engines find each other by name alone, move data both ways, and each sees the other's
// published record: endpoint, rails with their subnet, segments. Nothing else is in it.
TEST_P(Metadata, EnginesFindEachOtherByNameAndMoveValidatedData) {
  std::printf("%lld ms: the store took a write\n", ms());
  Engine b(config("b", server.uri()));
  b.expose("kv", b.allocate_memory(1 << 20), Access::remote_read | Access::remote_write);
  std::printf("%lld ms: b started: %s\n", ms(), b.info().metadata.c_str());
  Engine a(config("a", server.uri()));
  std::printf("%lld ms: a started: %s\n", ms(), a.info().metadata.c_str());
  // b is in the store now, or back within a refresh and its calls: its 2 s lease can run out
  // while the lab's VM stalls (seen for tens of seconds under a loaded host), and b puts its
  // entry back by itself. (A lookup in between fails: the store is the authority.)
  const auto listed_b = until(kGrace + 2s, [&] {
    try {
      return lists(rdmakit::list_engines(metadata(server.uri())), "b");
    } catch (const rdmakit::Error&) {
      return false;  // a store slow to answer is asked again
    }
  });
  ASSERT_LT(listed_b, kGrace + 2s) << b.info().metadata;
  EXPECT_NE(a.info().metadata.find("published as \"a\""), std::string::npos) << a.info().metadata;
  round_trip(a, a.segment("b", "kv"), 1 << 20, 3);
  const auto peers = a.peers();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers[0].address, "127.0.0.1:" + std::to_string(b.port()));

  // The directory as `a` sees it, and as the store lists it: b with its segment (published after
  // the expose, by b's metadata thread) and its rails.
  const auto seen = until(5s, [&] {
    const auto d = a.directory();
    return lists(d, "b") && !d[0].segments.empty();
  });
  ASSERT_LT(seen, 5s) << a.info().metadata;
  const rdmakit::PublishedEngine rb = a.directory()[0];
  EXPECT_EQ(rb.epoch, b.info().epoch);
  ASSERT_EQ(rb.segments.size(), 1u);
  EXPECT_EQ(rb.segments[0].name, "kv");
  EXPECT_EQ(rb.segments[0].length, 1u << 20);
  EXPECT_EQ(rb.segments[0].memory, "host");
  ASSERT_FALSE(rb.rails.empty());
  EXPECT_EQ(rb.rails[0].device, "rxe0");
  EXPECT_EQ(rb.rails[0].link_layer, "ethernet");
  EXPECT_EQ(rb.rails[0].gid, "::ffff:198.18.0.1");
  EXPECT_EQ(rb.rails[0].subnet, "198.18.0.0/24");
  // etcd tells of changes as they happen; Redis is listed every poll.
  const bool etcd = GetParam() == StoreServer::Kind::etcd;
  EXPECT_NE(a.info().metadata.find(etcd ? "kept current by its watch" : "listed every 200 ms"), std::string::npos)
      << a.info().metadata;
  std::string skipped;
  const auto listed = rdmakit::list_engines(metadata(server.uri()), &skipped);
  EXPECT_TRUE(lists(listed, "a") && lists(listed, "b"));
  EXPECT_EQ(skipped, "");

  // A name the store does not have: an error naming the store, the cluster and the name.
  try {
    a.add_peer("nobody");
    ADD_FAILURE() << "a peer the store does not have was added";
  } catch (const rdmakit::Error& e) {
    EXPECT_EQ(e.sys_errno(), ENOENT);
    EXPECT_NE(std::string(e.what()).find(server.uri()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("nobody"), std::string::npos) << e.what();
  }
  // The engine that goes cleanly takes its entry with it.
  { Engine c(config("c", server.uri())); }
  EXPECT_FALSE(lists(rdmakit::list_engines(metadata(server.uri())), "c"));
}

// A link that is up wins over the store (issue 31): a record of b under an older epoch, written
// by hand, neither closes a's link to b nor moves b's address; a logs it and goes on. (It closed
// the link as b's restart, on every worker.)
TEST_P(Metadata, AStaleRecordDoesNotCloseALiveLink) {
  // b has an identity: its record publishes its key, and a's links to it must prove that key.
  EngineConfig bc = config("b", server.uri());
  bc.link.psk.assign(32, 0x33);
  bc.identity = rdmakit::Identity::generate();
  Engine b(bc);
  b.expose("kv", b.allocate_memory(1 << 16), Access::remote_read | Access::remote_write);
  EngineConfig ac = config("a", server.uri());
  ac.link.psk.assign(32, 0x33);
  struct Said {
    std::mutex m;
    std::string all;
  };
  auto said = std::make_shared<Said>();
  ac.link.log = [said](std::string_view line) {
    std::lock_guard lock(said->m);
    said->all.append(line).append("\n");
  };
  Engine a(ac);
  const auto listed_b = until(kGrace + 2s, [&] {
    try {
      return lists(rdmakit::list_engines(metadata(server.uri())), "b");
    } catch (const rdmakit::Error&) {
      return false;
    }
  });
  ASSERT_LT(listed_b, kGrace + 2s) << b.info().metadata;
  const RemoteSegment seg = a.segment("b", "kv");
  round_trip(a, seg, 4096, 1);
  EXPECT_EQ(a.peers()[0].public_key, b.info().public_key);
  EXPECT_EQ(a.peers()[0].key_source, "store");
  // And the directory lists it (as of a's next listing).
  std::string listed_key;
  (void)until(kGrace + 2s, [&] {
    for (const auto& e : a.directory()) {
      if (e.name == "b") listed_key = e.public_key;
    }
    return !listed_key.empty();
  });
  EXPECT_EQ(listed_key, b.info().public_key);
  namespace md = rdmakit::detail::metadata;
  auto store = md::open_store(md::parse_store_uri(server.uri()));
  const std::string key = md::engine_key("t", "b");
  const auto text = store->get(key, rdmakit::detail::deadline_in(kCall));
  ASSERT_TRUE(text.has_value());
  md::EngineRecord r = md::decode(*text, key, "b");
  const std::string address = a.peers()[0].address;
  r.epoch = b.info().epoch ^ 0x5a5a;  // another process's, as a stale record says
  r.endpoints = {"192.0.2.1:9"};       // and somewhere else
  r.public_key = rdmakit::Identity::generate().public_key();  // with another key
  store->put(key, md::encode(r), md::no_lease, rdmakit::detail::deadline_in(kCall));
  const auto ignored = until(5s, [&] {
    std::lock_guard lock(said->m);
    return said->all.find("the record is ignored while the link is up") != std::string::npos;
  });
  EXPECT_LT(ignored, 5s) << "a never saw the stale record";
  round_trip(a, seg, 4096, 2);
  EXPECT_EQ(a.counters().reconnects, 0u) << "the stale record closed the live link";
  EXPECT_EQ(a.counters().connects, 1u);
  EXPECT_EQ(a.peers()[0].address, address) << "the stale record moved the peer";
  EXPECT_EQ(a.peers()[0].public_key, b.info().public_key) << "the stale record changed the key the live link proved";
}

// A SIGKILLed engine's entry is gone within its lease plus a second; then a transfer to it fails
// at submit naming the peer and the store. Started again (a new epoch, a new port), it is found
// and used without anyone telling the other engine.
TEST_P(Metadata, AKilledEngineGoesWithinItsLeaseAndItsRestartIsFoundByItself) {
  auto child = target(server.uri(), "c");
  ASSERT_TRUE(child->ok() && child->await("ready")) << "FAULT_PEER is the peer program";
  Engine a(config("a", server.uri()));
  const RemoteSegment seg = a.segment("c", "kv");
  round_trip(a, seg, 64 << 10, 5);
  const std::string first_address = a.peers()[0].address;

  child->kill();
  const auto gone = until(kLease + 3s, [&] { return !lists(rdmakit::list_engines(metadata(server.uri())), "c"); });
  std::printf("entry gone %lld ms after SIGKILL (lease %lld ms)\n", static_cast<long long>(gone.count()),
              static_cast<long long>(std::chrono::milliseconds(kLease).count()));
  EXPECT_LE(gone, kLease + 1s);
  // The engine drops it once the entry has been missing longer than a live engine takes to put
  // it back (a store restart must not drop anyone): a third of the lease, three calls and a poll.
  // Then what is submitted to it fails at once, naming it and the store.
  const Buffer buf = a.allocate_memory(4096);
  TransferResult r;
  const auto dropped = until(kGrace + 2s, [&] {
    r = move(a, TransferOp::write, buf, seg, 4096);
    return r.status == TransferStatus::connect_failed && r.reason.find("is gone from") != std::string::npos;
  });
  ASSERT_LT(dropped, kGrace + 2s) << to_string(r.status) << ": " << r.reason;
  EXPECT_NE(r.reason.find("'c'"), std::string::npos) << r.reason;
  EXPECT_NE(r.reason.find(server.uri()), std::string::npos) << r.reason;

  auto again = target(server.uri(), "c");
  ASSERT_TRUE(again->ok() && again->await("ready"));
  const auto back = until(10s, [&] { return move(a, TransferOp::write, buf, seg, 4096).status == TransferStatus::ok; });
  std::printf("restarted engine used again after %lld ms\n", static_cast<long long>(back.count()));
  ASSERT_LT(back, 10s);
  EXPECT_NE(a.peers()[0].address, first_address) << "the restart listens on another port";
  round_trip(a, seg, 64 << 10, 9);
}

// The store stops: linked engines keep moving data, past the lease; a name nobody knows fails
// within its deadline naming the store. Restarted empty, the store gets every engine back within
// one refresh interval, and nobody was dropped.
TEST_P(Metadata, AStoreOutageLeavesLinksWorkingAndAnEmptyRestartGetsEveryoneBack) {
  Engine b(config("b", server.uri()));
  b.expose("kv", b.allocate_memory(256 << 10), Access::remote_read | Access::remote_write);
  Engine a(config("a", server.uri()));
  const RemoteSegment seg = a.segment("b", "kv");
  round_trip(a, seg, 256 << 10, 1);
  // b's /health: 200 while its store holds its record, 503 (saying the store) while the store
  // is down, 200 again once it is back.
  rdmakit::MetricsServer endpoint(b, "127.0.0.1:0");
  httplib::Client http("127.0.0.1", endpoint.port());
  http.set_read_timeout(5, 0);
  const auto health = [&] {
    const auto r = http.Get("/health");
    return r ? r->status : -1;
  };
  EXPECT_LT(until(5s, [&] { return health() == 200; }), 5s);

  server.kill();
  const auto t0 = Clock::now();
  try {
    (void)a.segment("nobody", "kv");
    ADD_FAILURE() << "a lookup succeeded with the store down";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find(server.uri()), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, 3s) << "the lookup's deadline is 1 s";
  for (int i = 0; Clock::now() - t0 < kLease + 1s; ++i) {
    round_trip(a, seg, 64 << 10, static_cast<std::uint8_t>(i));
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_NE(a.info().metadata.find("last failure"), std::string::npos) << a.info().metadata;
  EXPECT_EQ(health(), 503);
  const auto down = http.Get("/health");
  ASSERT_TRUE(down);
  EXPECT_NE(down->body.find(server.uri()), std::string::npos) << down->body;
  const std::string m = b.metrics();
  EXPECT_NE(m.find("rdmakit_metadata_up{engine=\"b\"} 0\n"), std::string::npos) << m;
  EXPECT_EQ(m.find("rdmakit_metadata_errors_total{engine=\"b\"} 0\n"), std::string::npos) << m;

  server.restart_empty();
  const auto back = until(5s, [&] {
    try {
      const auto l = rdmakit::list_engines(metadata(server.uri()));
      return lists(l, "a") && lists(l, "b");
    } catch (const rdmakit::Error&) {
      return false;
    }
  });
  std::printf("both engines back in the restarted store after %lld ms\n", static_cast<long long>(back.count()));
  EXPECT_LE(back, std::chrono::milliseconds(kLease) / 3 + 1s);
  EXPECT_LT(until(5s, [&] { return health() == 200; }), 5s);
  EXPECT_NE(b.metrics().find("rdmakit_metadata_published{engine=\"b\"} 1\n"), std::string::npos);
  round_trip(a, seg, 256 << 10, 2);
  EXPECT_EQ(a.counters().connects, 1u) << "the link was never dropped";
  EXPECT_EQ(b.counters().accepts, 1u);
}

INSTANTIATE_TEST_SUITE_P(Stores, Metadata, ::testing::Values(StoreServer::Kind::redis, StoreServer::Kind::etcd),
                         [](const auto& p) { return p.param == StoreServer::Kind::redis ? "redis" : "etcd"; });

// A store that answers garbage, or closes mid-reply: the engine starts (publishing is retried),
// says why in its info, and a lookup fails within its deadline naming the store.
TEST(MetadataStore, GarbageAndClosedConnectionsGetAClearErrorAndNoHang) {
  struct Case {
    const char* scheme;
    const char* answer;
    bool close_after;
  };
  for (const Case& c : {Case{"redis", "$9999\r\nnot that long", true}, Case{"redis", "*1\r\n", false},
                        Case{"etcd", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nnope!", true},
                        Case{"etcd", "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"header\":", false}}) {
    SCOPED_TRACE(std::string(c.scheme) + ": " + c.answer);
    FakeServer fake(c.answer, c.close_after);
    const std::string uri = std::string(c.scheme) + "://127.0.0.1:" + std::to_string(fake.port());
    const auto t0 = Clock::now();
    EngineConfig ec = config("a", uri);
    ec.metadata.call_timeout = 300ms;  // each call to a server that never finishes its answer
    Engine a(ec);
    // Calls have 300 ms; the rest is the engine's own start (a second under ASan in a VM).
    EXPECT_LT(Clock::now() - t0, 3s) << "a store that answers nonsense held up the start";
    EXPECT_NE(a.info().metadata.find("not published"), std::string::npos) << a.info().metadata;
    const auto t1 = Clock::now();
    try {
      (void)a.segment("b", "kv");
      ADD_FAILURE() << "a lookup succeeded against garbage";
    } catch (const rdmakit::Error& e) {
      EXPECT_NE(std::string(e.what()).find(uri), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - t1, 2s) << "the lookup's deadline is 300 ms";
  }
}

// A configuration that cannot work is refused before anything starts; so is a listen address in
// use (which used to end the process: the engine's threads were running when it threw).
TEST(MetadataStore, BadConfigurationsAreRefusedBeforeAnythingRuns) {
  auto refused = [](EngineConfig c, const char* what) {
    try {
      Engine e(std::move(c));
      ADD_FAILURE() << what << " was accepted";
    } catch (const rdmakit::Error& e) {
      EXPECT_EQ(e.sys_errno(), EINVAL) << what << ": " << e.what();
    }
  };
  refused(config("a", "zk://127.0.0.1:2181"), "a zk:// store");
  EngineConfig c = config("a", "redis://127.0.0.1:1");
  c.metadata.cluster = "a/b";
  refused(c, "a cluster with a slash");
  c = config("a", "redis://127.0.0.1:1");
  c.metadata.lease = 10ms;
  refused(c, "a 10 ms lease");

  Engine first(config("first", "p2p"));
  EngineConfig twin = config("twin", "p2p");
  twin.listen = "127.0.0.1:" + std::to_string(first.port());
  EXPECT_THROW(Engine e(twin), rdmakit::Error);
  EXPECT_EQ(first.info().metadata.rfind("p2p", 0), 0u) << first.info().metadata;
  EXPECT_THROW(first.add_peer("b"), rdmakit::Error) << "a name alone needs a store";
}

}  // namespace
