// SPDX-License-Identifier: Apache-2.0
// Runs inside one lab VM: every operation with data validation, SGE lists, inline boundaries,
// atomics from racing clients, posting at depth 1 and at the device maximum, event deadlines.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include "forge.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Completion;
using rdmakit::Connection;
using rdmakit::ConnectionConfig;
using rdmakit::Listener;
using rdmakit::Opcode;
using rdmakit::PostStatus;
using rdmakit::WaitStatus;
using rdmakit::WorkRequest;

constexpr std::size_t kBuf = 64 * 1024;

ConnectionConfig quiet() {
  ConnectionConfig cfg;
  cfg.log = [](std::string_view) {};
  return cfg;
}

// Both sides: one 64 KiB buffer the peer may read, write and run atomics on.
void setup(Connection& c) {
  c.advertise(c.allocate_memory(kBuf, Access::local_write | Access::remote_read |
                                          Access::remote_write | Access::remote_atomic));
}

struct Pair {
  explicit Pair(ConnectionConfig cfg = quiet())
      : listener("127.0.0.1:0", cfg, setup),
        client(Connection::connect("127.0.0.1:" + std::to_string(listener.port()), cfg, setup)),
        server(*listener.accept(5s)) {}
  Listener listener;
  Connection client;
  Connection server;
};

void fill(void* p, std::size_t n, std::uint8_t seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(seed + i * 7);
}

Completion expect_done(Connection& c, std::uint64_t wr_id) {
  const auto w = c.wait(10s);
  EXPECT_EQ(w.status, WaitStatus::completed);
  EXPECT_TRUE(w.completion.ok()) << w.completion.describe();
  EXPECT_EQ(w.completion.wr_id, wr_id);
  return w.completion;
}


TEST(Datapath, ReportsQueueLimits) {
  Pair p;
  const auto& i = p.client.info();
  std::printf("max_inline %u, max_sge %u, send_depth %u, atomics %d\n", i.max_inline, i.max_sge,
              i.send_depth, i.atomics);
  EXPECT_GE(i.max_sge, 4u);
  EXPECT_TRUE(i.atomics);
}

TEST(Datapath, WriteReadSendAtBoundarySizesAndOffsets) {
  Pair p;
  const std::uint32_t inl = p.client.info().max_inline;
  const std::vector<std::size_t> sizes = {0, 1, 4095, 4096, inl, inl + 1, 8191, 20000};
  const auto& mine = p.client.memory(0);
  const auto& theirs_mem = p.server.memory(0);
  const auto theirs = p.client.remote_regions()[0];
  std::uint64_t id = 100;
  for (std::size_t size : sizes) {
    for (std::size_t off : {std::size_t{0}, std::size_t{3}, std::size_t{4096 + 1}}) {
      SCOPED_TRACE(::testing::Message() << "size " << size << " offset " << off);
      // WRITE: client bytes at [off, off+size) land at the server's [off, off+size).
      fill(static_cast<char*>(mine.data()) + off, size, static_cast<std::uint8_t>(size + off));
      std::memset(theirs_mem.data(), 0xee, kBuf);
      ASSERT_TRUE(p.client.post_write(mine.local().subslice(off, size), theirs, off, ++id).ok());
      expect_done(p.client, id);
      EXPECT_EQ(std::memcmp(static_cast<char*>(theirs_mem.data()) + off,
                            static_cast<char*>(mine.data()) + off, size), 0);
      // The byte after the range is untouched.
      EXPECT_EQ(static_cast<std::uint8_t*>(theirs_mem.data())[off + size], 0xee);

      // READ: the server's bytes come back into the client at another offset.
      fill(static_cast<char*>(theirs_mem.data()) + off, size, static_cast<std::uint8_t>(size * 3));
      ASSERT_TRUE(p.client.post_read(mine.local().subslice(off + 9, size), theirs, off, ++id).ok());
      expect_done(p.client, id);
      EXPECT_EQ(std::memcmp(static_cast<char*>(mine.data()) + off + 9,
                            static_cast<char*>(theirs_mem.data()) + off, size), 0);

      // SEND into a posted receive.
      ASSERT_TRUE(p.server.post_recv(theirs_mem.local().subslice(off, size + 16), ++id).ok());
      const std::uint64_t recv_id = id;
      fill(static_cast<char*>(mine.data()) + off, size, static_cast<std::uint8_t>(size + 1));
      ASSERT_TRUE(p.client.post_send(mine.local().subslice(off, size), ++id).ok());
      expect_done(p.client, id);
      const Completion r = expect_done(p.server, recv_id);
      EXPECT_EQ(r.byte_len, size);
      EXPECT_EQ(std::memcmp(static_cast<char*>(theirs_mem.data()) + off,
                            static_cast<char*>(mine.data()) + off, size), 0);
    }
  }
}

TEST(Datapath, MessagesLongerThanMaxMsgSizeAreSplit) {
  // 8 MiB + 1 on rxe: one byte past the port's max_msg_sz.
  const std::size_t big = [] {
    const auto d = rdmakit::list_devices();
    return static_cast<std::size_t>(rdmakit::pick_port(rdmakit::pick_device(d, ""), 0).max_msg_size) + 1;
  }();
  auto setup_big = [big](Connection& c) {
    c.advertise(c.allocate_memory(big + 64, Access::local_write | Access::remote_read | Access::remote_write));
    ASSERT_TRUE(c.post_recv(c.memory(0).local().subslice(0, 0), 77).ok());
  };
  Listener listener("127.0.0.1:0", quiet(), setup_big);
  Connection client = Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(), setup_big);
  Connection server = *listener.accept(10s);
  auto* mine = static_cast<std::uint8_t*>(client.memory(0).data());
  auto* theirs = static_cast<std::uint8_t*>(server.memory(0).data());
  fill(mine, big, 5);
  // WRITE_WITH_IMM: the data lands in parts; the immediate comes with the last, after all of it.
  ASSERT_TRUE(client.post_write_with_imm(client.memory(0).local().subslice(0, big),
                                         client.remote_regions()[0], 64, 0xabc, 1).ok());
  expect_done(client, 1);  // exactly one completion for the whole message
  EXPECT_EQ(client.outstanding(), 1u);  // what remains is the client's own posted receive
  const Completion imm = expect_done(server, 77);
  EXPECT_TRUE(imm.has_imm);
  EXPECT_EQ(imm.imm, 0xabcu);
  EXPECT_EQ(std::memcmp(theirs + 64, mine, big), 0);
  // READ it back into the client, also split.
  std::memset(mine, 0, big + 64);
  ASSERT_TRUE(client.post_read(client.memory(0).local().subslice(0, big), client.remote_regions()[0], 64, 2).ok());
  expect_done(client, 2);
  EXPECT_EQ(std::memcmp(theirs + 64, mine, big), 0);
  // A SEND cannot be split: refused.
  EXPECT_EQ(client.post_send(client.memory(0).local().subslice(0, big), 3).status, PostStatus::too_large);
}

// A connection over several QPs: the listener follows the client's count; large WRITEs and
// READs are striped (one completion each, data intact), small ones spread round robin.
struct StripedPair {
  StripedPair(std::uint32_t qps, std::size_t bytes, std::uint32_t depth = 64, bool forge_rkey = false)
      : cfg(config(qps, depth)),
        listener("127.0.0.1:0", quiet(), buffer(bytes)),
        client(lab::connect_altered("127.0.0.1:" + std::to_string(listener.port()), cfg, buffer(bytes),
                                    forge_rkey ? lab::forged_rkey() : lab::Alter{})),
        server(*listener.accept(10s)) {}
  static ConnectionConfig config(std::uint32_t qps, std::uint32_t depth) {
    ConnectionConfig c = quiet();
    c.qps = qps;
    c.send_depth = depth;
    return c;
  }
  static Connection::Setup buffer(std::size_t bytes) {
    return [bytes](Connection& c) {
      c.advertise(c.allocate_memory(bytes, Access::local_write | Access::remote_read | Access::remote_write));
    };
  }
  ConnectionConfig cfg;
  Listener listener;
  Connection client;
  Connection server;
};

TEST(Datapath, SeveralQpsStripeLargeWritesAndReads) {
  constexpr std::size_t kLen = (1 << 20) + 12345;  // not a multiple of the 4 KiB share unit
  StripedPair p(4, kLen + 4096);
  EXPECT_EQ(p.client.info().qps, 4u);
  EXPECT_EQ(p.server.info().qps, 4u);  // the listener's own config says 1
  EXPECT_EQ(p.client.info().remote.qp_count(), 4u);
  auto* mine = static_cast<std::uint8_t*>(p.client.memory(0).data());
  auto* theirs = static_cast<std::uint8_t*>(p.server.memory(0).data());
  fill(mine, kLen, 9);
  ASSERT_TRUE(p.client.post_write(p.client.memory(0).local().subslice(0, kLen),
                                  p.client.remote_regions()[0], 100, 1).ok());
  // While it is in flight the request occupies all four QPs.
  EXPECT_GE(p.client.outstanding(), 4u);
  expect_done(p.client, 1);
  EXPECT_EQ(p.client.outstanding(), 0u);
  EXPECT_EQ(std::memcmp(theirs + 100, mine, kLen), 0);
  std::memset(mine, 0, kLen);
  ASSERT_TRUE(p.client.post_read(p.client.memory(0).local().subslice(0, kLen),
                                 p.client.remote_regions()[0], 100, 2).ok());
  expect_done(p.client, 2);
  EXPECT_EQ(std::memcmp(theirs + 100, mine, kLen), 0);
  // One completion per request, not per part: nothing else arrives (a wait that polls for a
  // while, not one poll that a late or bookkeeping entry could pass).
  EXPECT_EQ(p.client.wait(300ms).status, WaitStatus::timeout);
}

TEST(Datapath, StripedSharesLongerThanMaxMsgSizeAreSplitToo) {
  const std::size_t max_msg = [] {
    const auto d = rdmakit::list_devices();
    return static_cast<std::size_t>(rdmakit::pick_port(rdmakit::pick_device(d, ""), 0).max_msg_size);
  }();
  const std::size_t len = 2 * max_msg + 3 * 4096 + 7;  // two QPs, each share > max_msg_sz
  StripedPair p(2, len);
  auto* mine = static_cast<std::uint8_t*>(p.client.memory(0).data());
  auto* theirs = static_cast<std::uint8_t*>(p.server.memory(0).data());
  fill(mine, len, 3);
  ASSERT_TRUE(p.client.post_write(p.client.memory(0).local(), p.client.remote_regions()[0], 0, 5).ok());
  expect_done(p.client, 5);
  EXPECT_EQ(std::memcmp(theirs, mine, len), 0);
}

TEST(Datapath, SeveralQpsSpreadSmallWritesAndKeepSendsInOrder) {
  constexpr std::uint32_t kDepth = 8, kQps = 4;
  StripedPair p(kQps, 64 * 1024, kDepth);
  const auto& mine = p.client.memory(0);
  auto* b = static_cast<std::uint8_t*>(mine.data());
  for (std::uint32_t i = 0; i < 4096; ++i) b[i] = static_cast<std::uint8_t>(i * 13);
  // Without polling, the connection takes depth x QPs small writes: each QP's queue is used.
  std::uint32_t posted = 0;
  while (p.client.post_write(mine.local().subslice(posted * 64, 64), p.client.remote_regions()[0],
                             posted * 64, posted).ok()) {
    ++posted;
  }
  EXPECT_EQ(posted, kDepth * kQps);
  std::set<std::uint64_t> seen;
  for (std::uint32_t i = 0; i < posted; ++i) {
    const auto w = p.client.wait(10s);
    ASSERT_EQ(w.status, WaitStatus::completed);
    ASSERT_TRUE(w.completion.ok()) << w.completion.describe();
    seen.insert(w.completion.wr_id);
  }
  EXPECT_EQ(seen.size(), posted);  // every request completed exactly once (in any order)
  EXPECT_EQ(std::memcmp(p.server.memory(0).data(), b, posted * 64), 0);

  // SENDs stay on the first QP: the receiver's receives fill in posting order.
  constexpr std::uint32_t kSends = 40;
  const auto& theirs = p.server.memory(0);
  for (std::uint32_t i = 0; i < kSends; ++i) {
    ASSERT_TRUE(p.server.post_recv(theirs.local().subslice(8192 + i * 8, 8), 1000 + i).ok());
  }
  for (std::uint32_t i = 0; i < kSends; ++i) {
    std::memcpy(b + 8192 + i * 8, &i, 4);
    ASSERT_TRUE(p.client.post_send(mine.local().subslice(8192 + i * 8, 4), 2000 + i).ok());
    expect_done(p.client, 2000 + i);
  }
  for (std::uint32_t i = 0; i < kSends; ++i) {
    expect_done(p.server, 1000 + i);
    std::uint32_t got = 0;
    std::memcpy(&got, static_cast<std::uint8_t*>(theirs.data()) + 8192 + i * 8, 4);
    EXPECT_EQ(got, i);
  }
}

TEST(Datapath, StripedRequestFailsOnceWithTheFirstError) {
  StripedPair p(3, 1 << 20, 64, true);
  const rdmakit::RemoteRegion forged = p.client.remote_regions()[0];
  std::memset(p.server.memory(0).data(), 0x11, 1 << 20);
  ASSERT_TRUE(p.client.post_write(p.client.memory(0).local(), forged, 0, 7).ok());
  const auto w = p.client.wait(10s);
  ASSERT_EQ(w.status, WaitStatus::completed);
  EXPECT_EQ(w.completion.wr_id, 7u);
  EXPECT_EQ(w.completion.status, IBV_WC_REM_ACCESS_ERR) << w.completion.describe();
  EXPECT_EQ(p.client.outstanding(), 0u);
  // The other QPs' errors are folded into that one: the error broke the connection, and the next
  // wait says `closed` rather than delivering anything more.
  EXPECT_EQ(p.client.wait(2s).status, WaitStatus::closed);
  const auto* t = static_cast<const std::uint8_t*>(p.server.memory(0).data());
  EXPECT_TRUE(std::all_of(t, t + (1 << 20), [](std::uint8_t v) { return v == 0x11; }));
}

TEST(Datapath, QpCountIsBounded) {
  for (std::uint32_t qps : {0u, 17u}) {
    try {
      StripedPair p(qps, 4096);
      ADD_FAILURE() << "qps " << qps << " accepted";
    } catch (const rdmakit::Error& e) {
      EXPECT_NE(std::string(e.what()).find("1..16 QPs per connection"), std::string::npos) << e.what();
    }
  }
  // One send CQ holds every QP's queue: depth x QPs may not exceed max_cqe.
  const auto devices = rdmakit::list_devices();
  const auto& d = rdmakit::pick_device(devices, "");
  try {
    StripedPair p(4, 4096, d.max_cqe / 2);
    ADD_FAILURE() << "send_depth x qps beyond max_cqe accepted";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("with 4 QPs"), std::string::npos) << e.what();
  }
}

TEST(Datapath, DescriptorsThePeerDidNotAdvertiseAreRefusedLocally) {
  Pair p;
  const auto theirs = p.client.remote_regions()[0];
  const auto src = p.client.memory(0).local().subslice(0, 64);
  auto wrong_key = theirs;
  wrong_key.rkey ^= 0x100;
  EXPECT_EQ(p.client.post_write(src, wrong_key, 0, 1).status, PostStatus::not_advertised);
  auto moved = theirs;
  moved.addr += kBuf;  // the right key, but past the region
  EXPECT_EQ(p.client.post_read(p.client.memory(0).local().subslice(0, 64), moved, 0, 2).status,
            PostStatus::not_advertised);
  auto bigger = theirs;
  bigger.length *= 2;  // a copy that claims more than was advertised
  EXPECT_EQ(p.client.post_write(src, bigger, kBuf, 3).status, PostStatus::not_advertised);
  auto sub = theirs;  // a sub-range of an advertised region is fine
  sub.addr += 4096;
  sub.length = 4096;
  EXPECT_TRUE(p.client.post_write(src, sub, 100, 4).ok());
  expect_done(p.client, 4);
  EXPECT_EQ(p.client.outstanding(), 0u);
}

TEST(Datapath, ScatterGatherWriteAndRead) {
  Pair p;
  const auto& mine = p.client.memory(0);
  auto* b = static_cast<char*>(mine.data());
  std::memcpy(b + 100, "alpha-", 6);
  std::memcpy(b + 5000, "beta-", 5);
  std::memcpy(b + 9000, "gamma", 5);
  const rdmakit::LocalSlice gather[] = {mine.local().subslice(100, 6), mine.local().subslice(5000, 5),
                                        mine.local().subslice(9000, 5)};
  WorkRequest w;
  w.opcode = Opcode::write;
  w.local = gather;
  w.remote = p.client.remote_regions()[0];
  w.remote_offset = 777;
  w.wr_id = 1;
  ASSERT_TRUE(p.client.post_batch({&w, 1}).ok());
  expect_done(p.client, 1);
  EXPECT_EQ(std::string(static_cast<char*>(p.server.memory(0).data()) + 777, 16), "alpha-beta-gamma");

  // READ scatters the same 16 bytes into three other places.
  const rdmakit::LocalSlice scatter[] = {mine.local().subslice(20000, 6), mine.local().subslice(30000, 5),
                                         mine.local().subslice(40000, 5)};
  w.opcode = Opcode::read;
  w.local = scatter;
  w.wr_id = 2;
  ASSERT_TRUE(p.client.post_batch({&w, 1}).ok());
  expect_done(p.client, 2);
  EXPECT_EQ(std::string(b + 20000, 6), "alpha-");
  EXPECT_EQ(std::string(b + 30000, 5), "beta-");
  EXPECT_EQ(std::string(b + 40000, 5), "gamma");

  std::vector<rdmakit::LocalSlice> too_many(p.client.info().max_sge + 1, mine.local().subslice(0, 1));
  w.local = too_many;
  EXPECT_EQ(p.client.post_batch({&w, 1}).status, PostStatus::too_many_sges);
  EXPECT_EQ(p.client.outstanding(), 0u);
}

TEST(Datapath, BatchRefusedWholeWhenOneRequestIsBad) {
  Pair p;
  const auto local = p.client.memory(0).local().subslice(0, 8);
  std::vector<WorkRequest> batch(3);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    batch[i].opcode = Opcode::write;
    batch[i].local = {&local, 1};
    batch[i].remote = p.client.remote_regions()[0];
    batch[i].remote_offset = i * 8;
    batch[i].wr_id = i;
  }
  batch[2].remote_offset = kBuf;  // out of bounds
  const auto r = p.client.post_batch(batch);
  EXPECT_EQ(r.status, PostStatus::out_of_bounds);
  EXPECT_EQ(r.index, 2u);
  EXPECT_EQ(p.client.outstanding(), 0u);  // nothing of the batch was posted
}

void signaled_stream(std::uint32_t depth, std::uint32_t total, std::uint32_t batch) {
  ConnectionConfig cfg = quiet();
  cfg.send_depth = depth;
  Pair p(cfg);
  const auto& mine = p.client.memory(0);
  const auto theirs = p.client.remote_regions()[0];
  std::vector<WorkRequest> reqs(batch);
  std::vector<rdmakit::LocalSlice> src(batch, mine.local().subslice(0, 8));
  std::uint32_t posted = 0;
  std::uint32_t signaled = 0, seen = 0;
  Completion comps[16];
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (posted < total || seen < signaled) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "posted " << posted << " seen " << seen;
    const std::uint32_t room = depth - p.client.outstanding();
    const std::uint32_t n = std::min({batch, room, total - posted});
    if (n > 0) {
      for (std::uint32_t i = 0; i < n; ++i) {
        std::memcpy(mine.data(), &posted, 4);
        reqs[i] = {};
        reqs[i].opcode = Opcode::write;
        reqs[i].local = {&src[i], 1};
        reqs[i].remote = theirs;
        reqs[i].remote_offset = ((posted + i) % 1024) * 8;
        reqs[i].wr_id = posted + i;
        // Only every 64th request and the very last ask for a completion.
        reqs[i].signaled = (posted + i) % 64 == 63 || posted + i + 1 == total;
        signaled += reqs[i].signaled ? 1u : 0u;
      }
      const auto r = p.client.post_batch({reqs.data(), n});
      ASSERT_TRUE(r.ok()) << r.describe();  // never ENOMEM: the library counts credits
      posted += n;
    }
    const std::size_t got = p.client.poll(comps);
    for (std::size_t i = 0; i < got; ++i) {
      ASSERT_TRUE(comps[i].ok()) << comps[i].describe();
      ASSERT_TRUE(comps[i].wr_id % 64 == 63 || comps[i].wr_id + 1 == total) << comps[i].wr_id;
    }
    seen += static_cast<std::uint32_t>(got);
  }
  EXPECT_EQ(seen, signaled);
  EXPECT_EQ(p.client.outstanding(), 0u);
}

TEST(Datapath, SelectiveSignalingAtDepthOne) { signaled_stream(1, 500, 1); }

TEST(Datapath, SelectiveSignalingAtDeviceMaximumDepth) {
  const auto devices = rdmakit::list_devices();
  const auto& d = rdmakit::pick_device(devices, "");
  const std::uint32_t depth = std::min(d.max_qp_wr, d.max_cqe);
  std::printf("device maximum depth: %u (max_qp_wr %u, max_cqe %u)\n", depth, d.max_qp_wr, d.max_cqe);
  signaled_stream(depth, 3 * depth, 4096);
}

TEST(Datapath, RacingFetchAddEndsAtExactTotal) {
  // One counter, registered in both connections' protection domains.
  alignas(64) static std::uint64_t counter[8] = {};
  Listener listener("127.0.0.1:0", quiet(), [](Connection& c) {
    c.advertise(c.register_memory(counter, sizeof counter, Access::remote_atomic));
  });
  constexpr int kPerClient = 500;
  auto client = [&](std::vector<std::uint64_t>& olds) {
    Connection c = Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(),
                                       [](Connection& cc) { cc.allocate_memory(8, Access::local_write); });
    for (int i = 0; i < kPerClient; ++i) {
      ASSERT_TRUE(c.post_fetch_add(c.memory(0).local(), c.remote_regions()[0], 0, 1, static_cast<std::uint64_t>(i)).ok());
      const auto w = c.wait(10s);
      ASSERT_EQ(w.status, WaitStatus::completed);
      ASSERT_TRUE(w.completion.ok()) << w.completion.describe();
      std::uint64_t v;
      std::memcpy(&v, c.memory(0).data(), 8);
      olds.push_back(v);
    }
  };
  std::vector<std::uint64_t> a, b;
  std::thread ta(client, std::ref(a)), tb(client, std::ref(b));
  std::vector<Connection> accepted;
  for (int i = 0; i < 2; ++i) {
    auto c = listener.accept(10s);
    ASSERT_TRUE(c.has_value());
    accepted.push_back(std::move(*c));
  }
  ta.join();
  tb.join();
  EXPECT_EQ(counter[0], 2u * kPerClient);
  // Every fetched value is distinct and together they are 0 .. 2N-1: no update was lost.
  std::set<std::uint64_t> all(a.begin(), a.end());
  all.insert(b.begin(), b.end());
  ASSERT_EQ(all.size(), 2u * kPerClient);
  EXPECT_EQ(*all.rbegin(), 2u * kPerClient - 1);
}

TEST(Datapath, CompareAndSwapSemantics) {
  Pair p;
  auto* word = static_cast<std::uint64_t*>(p.server.memory(0).data()) + 2;  // offset 16
  *word = 41;
  const auto result = p.client.memory(0).local().subslice(0, 8);
  const auto theirs = p.client.remote_regions()[0];
  ASSERT_TRUE(p.client.post_compare_swap(result, theirs, 16, 40, 99, 1).ok());  // mismatch
  expect_done(p.client, 1);
  std::uint64_t old;
  std::memcpy(&old, p.client.memory(0).data(), 8);
  EXPECT_EQ(old, 41u);
  EXPECT_EQ(*word, 41u);
  ASSERT_TRUE(p.client.post_compare_swap(result, theirs, 16, 41, 99, 2).ok());  // match
  expect_done(p.client, 2);
  std::memcpy(&old, p.client.memory(0).data(), 8);
  EXPECT_EQ(old, 41u);
  EXPECT_EQ(*word, 99u);
  // Misuse is refused before posting.
  EXPECT_EQ(p.client.post_compare_swap(result, theirs, 12, 0, 0, 3).status, PostStatus::misaligned);
  EXPECT_EQ(p.client.post_fetch_add(p.client.memory(0).local().subslice(0, 4), theirs, 0, 1, 4).status,
            PostStatus::bad_length);
  EXPECT_EQ(p.client.outstanding(), 0u);
}

TEST(Datapath, EventModeHonoursItsDeadline) {
  ConnectionConfig cfg = quiet();
  cfg.completion_events = true;
  Pair p(cfg);
  for (auto d : {50ms, 300ms}) {
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(p.client.wait(d).status, WaitStatus::timeout);
    const auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_GE(took, d);
    // Generous, so a loaded machine does not fail it; a wait that overslept would be far off.
    EXPECT_LT(took, d + 1s);
    std::printf("wait(%lld ms) in event mode returned after %.1f ms\n", static_cast<long long>(d.count()),
                std::chrono::duration<double, std::milli>(took).count());
  }
}

TEST(Datapath, ControlMessages) {
  Pair p;
  const std::vector<std::uint8_t> hello = {1, 2, 3, 4};
  p.client.send_message(hello, 1s);
  const auto got = p.server.receive_message(5s);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, hello);
  EXPECT_FALSE(p.server.receive_message(50ms).has_value());
  EXPECT_THROW(p.client.send_message(std::vector<std::uint8_t>(Connection::max_message_size + 1), 1s),
               rdmakit::Error);
}

}  // namespace

namespace {

// Prepared requests on a real device: every operation, the local bytes read at each post (not
// at prepare), unsignaled ones retired by a signaled one, refusals at prepare, stale handles.
TEST(Datapath, PreparedRequestsMoveEveryOperationAndReadTheirBytesAtEachPost) {
  Pair p;
  const auto& mine = p.client.memory(0);
  const auto& theirs_mem = p.server.memory(0);
  const auto theirs = p.client.remote_regions()[0];
  auto* local = static_cast<std::uint8_t*>(mine.data());
  auto* remote = static_cast<std::uint8_t*>(theirs_mem.data());
  auto req = [&](Opcode op, std::size_t local_off, std::size_t len, std::uint64_t remote_off) {
    const rdmakit::LocalSlice slice = mine.local().subslice(local_off, len);
    WorkRequest w;
    w.opcode = op;
    w.local = {&slice, 1};
    w.remote = theirs;
    w.remote_offset = remote_off;
    return p.client.prepare(w);  // keeps what it needs: `slice` goes out of scope after
  };
  const auto write = req(Opcode::write, 0, 4096, 8192);
  const auto read = req(Opcode::read, 32768, 1000, 16384);
  const auto send = req(Opcode::send, 0, 100, 0);
  const auto add = req(Opcode::fetch_add, 40000, 8, 40000);
  std::uint64_t id = 1000;
  for (std::uint8_t round = 1; round <= 3; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << int{round});
    fill(local, 4096, round);
    ASSERT_TRUE(p.client.post(write, ++id).ok());
    EXPECT_EQ(expect_done(p.client, id).opcode, Opcode::write);
    EXPECT_EQ(std::memcmp(remote + 8192, local, 4096), 0);
    fill(remote + 16384, 1000, static_cast<std::uint8_t>(round * 5));
    ASSERT_TRUE(p.client.post(read, ++id).ok());
    expect_done(p.client, id);
    EXPECT_EQ(std::memcmp(local + 32768, remote + 16384, 1000), 0);
    ASSERT_TRUE(p.server.post_recv(theirs_mem.local().subslice(50000, 100), ++id).ok());
    const std::uint64_t recv_id = id;
    ASSERT_TRUE(p.client.post(send, ++id).ok());
    expect_done(p.client, id);
    EXPECT_EQ(expect_done(p.server, recv_id).byte_len, 100u);
    EXPECT_EQ(std::memcmp(remote + 50000, local, 100), 0);
  }
  // fetch_add: the prepared addend (0: WorkRequest's default) leaves the word as it is and
  // returns it each time.
  std::uint64_t word = 0x1234'5678'9abc'def0;
  std::memcpy(remote + 40000, &word, 8);
  ASSERT_TRUE(p.client.post(add, ++id).ok());
  expect_done(p.client, id);
  EXPECT_EQ(std::memcmp(local + 40000, &word, 8), 0);

  // Unsignaled: 100 of them, retired by the signaled one after them.
  rdmakit::LocalSlice one = mine.local().subslice(0, 8);
  WorkRequest quiet_write;
  quiet_write.local = {&one, 1};
  quiet_write.remote = theirs;
  quiet_write.signaled = false;
  const auto quiet = p.client.prepare(quiet_write);
  for (int i = 0; i < 100; ++i) {
    const auto r = p.client.post(quiet, 1);
    if (r.status == PostStatus::queue_full) {
      Completion c[4];
      EXPECT_EQ(p.client.poll(c), 0u);  // forced completions retire requests, but are no news
      std::this_thread::sleep_for(1ms);
      --i;
      continue;
    }
    ASSERT_TRUE(r.ok()) << r.describe();
  }
  ASSERT_TRUE(p.client.post(write, ++id).ok());
  expect_done(p.client, id);
  EXPECT_EQ(p.client.outstanding(), 0u);

  // Refused at prepare, with the reason; a released handle is refused at post.
  WorkRequest outside = quiet_write;
  outside.remote_offset = kBuf - 4;
  try {
    (void)p.client.prepare(outside);
    ADD_FAILURE() << "prepare of an out-of-bounds write did not throw";
  } catch (const rdmakit::Error& e) {
    EXPECT_EQ(e.op(), "prepare");
    EXPECT_NE(std::string(e.what()).find("outside the remote region"), std::string::npos) << e.what();
  }
  p.client.release(quiet);
  EXPECT_EQ(p.client.post(quiet, 1).status, PostStatus::stale);
  p.client.close();
  EXPECT_EQ(p.client.post(write, 1).status, PostStatus::not_ready);
}

}  // namespace
