// SPDX-License-Identifier: Apache-2.0
// Leases (Engine::grant): a peer reads ranges of a segment only while its lease lasts; when it
// ends (expiry, release, end_lease, the holder's death, a withdrawal) its windows go first and
// the granting engine is told after; a transfer on an ended lease ends lease_expired with none
// of the range's bytes. Runs in the lab over rxe, and on the host over tcp and shm.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine_helpers.hpp"
#include "lab_helpers.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Batch;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::EngineConfig;
using rdmakit::LeaseCause;
using rdmakit::LeaseRange;
using rdmakit::TransferOp;
using rdmakit::TransferStatus;

using lab::at;
using lab::config;
using lab::fill;
using lab::xfer;

constexpr std::uint64_t kBlock = 4096;

// The engine that grants: 16 blocks exposed for leases only.
struct Granter {
  explicit Granter(EngineConfig c = config("b")) : engine(std::move(c)) {
    buf = engine.allocate_memory(16 * kBlock);
    engine.expose_leased("kv", buf, Access::remote_read | Access::remote_write);
  }
  Engine engine;
  Buffer buf;
};

// An engine "a" linked to the granter "b".
struct Holder {
  explicit Holder(Engine& b) : a(config("a")) {
    a.add_peer("b", at(b));
    linked = a.connect("b", 10s);
    dst = a.allocate_memory(4 * kBlock);
  }
  Engine a;
  Buffer dst;
  bool linked = false;
};

// The next lease end `e` is told of, woken by its descriptor; none within `limit`.
std::optional<rdmakit::LeaseEnd> next_end(Engine& e, std::chrono::milliseconds limit) {
  return lab::next_by_fd(e, [&] { return e.next_lease_end(); }, limit);
}

// One read of `len` bytes at block `block` of b's "kv" into dst; its result.
rdmakit::TransferResult read_block(Engine& a, const Buffer& dst, std::uint64_t block, std::uint64_t len = kBlock) {
  const auto seg = a.segment("b", "kv");
  Batch r = a.submit(std::vector{xfer(TransferOp::read, dst, 0, len, seg, block * kBlock)});
  if (!r.wait(10s)) return {TransferStatus::pending, "did not end within 10 s"};
  return r.result(0);
}

bool holds(const Buffer& b, std::uint8_t v, std::uint64_t len = kBlock) {
  const auto* p = static_cast<const std::uint8_t*>(b.addr);
  for (std::uint64_t i = 0; i < len; ++i) {
    if (p[i] != v) return false;
  }
  return true;
}

}  // namespace

// A segment for leases only: nobody's before a grant; a read in the lease's ranges moves the
// block, one outside them, across a range's end, or a write on a read lease ends no_segment at
// the holder; other segments exposed and withdrawn meanwhile change nothing.
TEST(Leases, AReadWorksInItsRangesAndAccessOnly) {
  Granter b;
  Holder h(b.engine);
  ASSERT_TRUE(h.linked);
  Engine& a = h.a;
  const Buffer dst = h.dst;
  std::memset(b.buf.addr, 0x11, b.buf.length);
  // Not granted yet: the segment is nobody's.
  EXPECT_EQ(read_block(a, dst, 0).status, TransferStatus::no_segment);
  const std::vector<LeaseRange> ranges{{"kv", 0, 4 * kBlock}, {"kv", 8 * kBlock, kBlock}};
  // Long enough for every step below (segments exposed and withdrawn, reads refused) to run
  // within it on a loaded sanitizer build: what ends it is the next test's.
  const std::uint64_t id = b.engine.grant("a", ranges, Access::remote_read, 30s);
  const auto held = a.lease("b", id, 5s);
  ASSERT_TRUE(held.has_value());
  EXPECT_FALSE(held->ended);
  ASSERT_EQ(held->ranges.size(), 2u);
  EXPECT_EQ(held->ranges[1].offset, 8 * kBlock);
  EXPECT_EQ(held->access, Access::remote_read);
  auto r = read_block(a, dst, 2);
  EXPECT_EQ(r.status, TransferStatus::ok) << r.reason;
  EXPECT_TRUE(holds(dst, 0x11));
  EXPECT_EQ(read_block(a, dst, 8).status, TransferStatus::ok);
  // Segments coming and going meanwhile change nothing of the lease's.
  const Buffer other = b.engine.allocate_memory(kBlock);
  b.engine.expose("other", other, Access::remote_read);
  ASSERT_TRUE(a.connect("b", 10s));
  std::this_thread::sleep_for(50ms);  // its SEGMENT reached a
  r = read_block(a, dst, 3);
  EXPECT_EQ(r.status, TransferStatus::ok) << r.reason;
  b.engine.withdraw("other");
  std::this_thread::sleep_for(50ms);
  r = read_block(a, dst, 1);
  EXPECT_EQ(r.status, TransferStatus::ok) << r.reason;
  // Outside its ranges, across a range's end, and an access it does not grant.
  r = read_block(a, dst, 5);
  EXPECT_EQ(r.status, TransferStatus::no_segment) << r.reason;
  EXPECT_EQ(read_block(a, dst, 3, 2 * kBlock).status, TransferStatus::no_segment);
  Batch w = a.submit(std::vector{xfer(TransferOp::write, dst, 0, kBlock, a.segment("b", "kv"), 0)});
  ASSERT_TRUE(lab::waited(w, 10s));
  EXPECT_EQ(w.result(0).status, TransferStatus::no_segment) << w.result(0).reason;  // refused here, before the wire
  EXPECT_FALSE(b.engine.next_lease_end().has_value());
}

// The plain lifecycle on one link: expiry, the target told after the windows went, reuse.
TEST(Leases, ExpiryRevokesBeforeTheTargetReusesTheBlocks) {
  Granter b;
  Holder h(b.engine);
  ASSERT_TRUE(h.linked);
  Engine& a = h.a;
  const Buffer dst = h.dst;
  std::memset(b.buf.addr, 0x22, b.buf.length);
  const std::vector<LeaseRange> ranges{{"kv", 0, 16 * kBlock}};
  const auto granted = std::chrono::steady_clock::now();
  const std::uint64_t id = b.engine.grant("a", ranges, Access::remote_read, 500ms);
  ASSERT_TRUE(a.lease("b", id, 5s).has_value());
  std::this_thread::sleep_until(granted + 200ms);
  auto r = read_block(a, dst, 7);
  ASSERT_EQ(r.status, TransferStatus::ok) << r.reason;
  EXPECT_TRUE(holds(dst, 0x22));
  const auto end = next_end(b.engine, 5s);
  const auto told = std::chrono::steady_clock::now();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->lease, id);
  EXPECT_EQ(end->peer, "a");
  EXPECT_EQ(end->cause, LeaseCause::expired) << end->reason;
  EXPECT_GE(told - granted, 500ms);
  EXPECT_LT(told - granted, 1500ms);
  std::memset(b.buf.addr, 0x99, b.buf.length);  // reused the moment it is told
  std::memset(dst.addr, 0x01, kBlock);
  std::this_thread::sleep_until(granted + 700ms);
  r = read_block(a, dst, 7);
  EXPECT_EQ(r.status, TransferStatus::lease_expired) << r.reason;
  EXPECT_NE(r.reason.find(std::to_string(id)), std::string::npos) << r.reason;
  EXPECT_TRUE(holds(dst, 0x01)) << "a read on an ended lease returned bytes";
  const auto after = a.lease("b", id);
  ASSERT_TRUE(after.has_value());
  EXPECT_TRUE(after->ended);
  EXPECT_EQ(b.engine.counters().leases_granted, 1u);
  EXPECT_EQ(b.engine.counters().leases_ended, 1u);
}

// Renewed every 150 ms, a 500 ms lease keeps reads working for seconds; released, the holder's
// next read ends lease_expired at once and the target hears "released".
TEST(Leases, RenewedItLastsAndReleasedItEnds) {
  Granter b;
  Holder h(b.engine);
  ASSERT_TRUE(h.linked);
  Engine& a = h.a;
  const Buffer dst = h.dst;
  std::memset(b.buf.addr, 0x33, b.buf.length);
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  const auto span = 2s;  // what it checks repeats every 150 ms; the plain build runs 5 s
  // A sanitizer build's worker runs several times slower, and a renewal's round trip on a
  // loaded CI machine may take a few hundred ms: the holder would stop at its own reckoning
  // before the answer came. The plain build keeps the 500 ms.
  const auto ttl = 1500ms;
#else
  const auto span = 5s;
  const auto ttl = 500ms;
#endif
  const std::vector<LeaseRange> ranges{{"kv", 0, 16 * kBlock}};
  const std::uint64_t id = b.engine.grant("a", ranges, Access::remote_read, ttl);
  ASSERT_TRUE(a.lease("b", id, 5s).has_value());
  const auto start = std::chrono::steady_clock::now();
  auto last_renew = start;
  int reads = 0;
  while (std::chrono::steady_clock::now() - start < span) {
    if (std::chrono::steady_clock::now() - last_renew >= 150ms) {
      a.renew("b", id, ttl);
      last_renew = std::chrono::steady_clock::now();
    }
    const auto r = read_block(a, dst, static_cast<std::uint64_t>(reads % 16));
    ASSERT_EQ(r.status, TransferStatus::ok) << "read " << reads << " at "
                                            << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count()
                                            << " ms: " << r.reason;
    ++reads;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_FALSE(b.engine.next_lease_end().has_value());
  EXPECT_GE(b.engine.counters().lease_renewals, static_cast<std::uint64_t>(span / 200ms));
  a.release("b", id);
  const auto r = read_block(a, dst, 0);
  EXPECT_EQ(r.status, TransferStatus::lease_expired) << r.reason;
  const auto end = next_end(b.engine, 5s);
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->cause, LeaseCause::released) << end->reason;
  // Renewing an ended lease changes nothing.
  a.renew("b", id, 500ms);
  EXPECT_EQ(read_block(a, dst, 0).status, TransferStatus::lease_expired);
}

// The granting engine ends a lease, or withdraws its segment: the holder's transfers end
// lease_expired, whether the holder heard of it yet (refused here) or not (refused by the
// target's NIC or worker); nothing of the range comes back. Its on_lease_end is called.
TEST(Leases, EndedByTheTargetOrAWithdrawal) {
  std::atomic<int> called{0};
  EngineConfig bc = config("b");
  bc.on_lease_end = [&](const rdmakit::LeaseEnd&) { called.fetch_add(1); };
  Granter b(bc);
  Holder h(b.engine);
  ASSERT_TRUE(h.linked);
  Engine& a = h.a;
  const Buffer dst = h.dst;
  std::memset(b.buf.addr, 0x44, b.buf.length);
  const std::vector<LeaseRange> ranges{{"kv", 0, 16 * kBlock}};
  for (int round = 0; round < 20; ++round) {
    ASSERT_TRUE(a.connect("b", 10s));
    const std::uint64_t id = b.engine.grant("a", ranges, Access::remote_read, 60s);
    const auto held = a.lease("b", id, 10s);
    if (!held) {
      const auto end = b.engine.next_lease_end();
      FAIL() << "round " << round << ": lease " << id << " never reached the holder; the target says: "
             << (end ? std::string(rdmakit::to_string(end->cause)) + ": " + end->reason : "it lasts");
    }
    ASSERT_EQ(read_block(a, dst, 1).status, TransferStatus::ok) << round;
    EXPECT_TRUE(b.engine.end_lease(id));
    EXPECT_FALSE(b.engine.end_lease(id));
    const auto end = next_end(b.engine, 5s);
    ASSERT_TRUE(end.has_value());
    EXPECT_EQ(end->cause, LeaseCause::revoked);
    std::memset(b.buf.addr, 0x55, b.buf.length);
    std::memset(dst.addr, 0x02, kBlock);
    const std::uint64_t reconnects = a.counters().reconnects;
    const auto r = read_block(a, dst, 1);  // the holder may not have heard yet
    EXPECT_EQ(r.status, TransferStatus::lease_expired) << round << ": " << r.reason;
    EXPECT_TRUE(holds(dst, 0x02)) << round;
    if (r.reason.find("refused it (") != std::string::npos) {
      // The target's NIC refused it: the link broke on that completion, and goes now (linked
      // again at once while the holder holds a lease there), not at the next post on it. An idle
      // link that stays "up" answers connect() and lease() while the target's messages to it
      // flush.
      const auto until = std::chrono::steady_clock::now() + 3s;
      auto went = [&] {
        const auto ps = a.peers();
        return a.counters().reconnects > reconnects ||
               std::any_of(ps.begin(), ps.end(), [](const auto& p) { return p.name == "b" && !p.linked; });
      };
      while (!went() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
      EXPECT_TRUE(went()) << round << ": the link the NIC refused a read on still looks up 3 s later";
    }
    std::memset(b.buf.addr, 0x44, b.buf.length);
  }
  EXPECT_EQ(called.load(), 20);
  // A read the target refused broke the link (rdma; tcp and shm end theirs too): until the
  // holder links again, connect() may answer from the link that is going, and a lease granted
  // on it ends peer_lost if no link comes back in time. The holder's lease() links again.
  ASSERT_TRUE(a.connect("b", 10s));
  const std::uint64_t id = b.engine.grant("a", ranges, Access::remote_read, 60s);
  ASSERT_TRUE(a.lease("b", id, 10s).has_value());
  b.engine.withdraw("kv");
  const auto end = next_end(b.engine, 5s);
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->cause, LeaseCause::withdrawn) << end->reason;
}

// What grant() refuses, and a lease for another peer gives this one nothing.
TEST(Leases, GrantChecksWhatItGives) {
  Granter b;
  Holder h(b.engine);
  ASSERT_TRUE(h.linked);
  Engine& a = h.a;
  const Buffer other = b.engine.allocate_memory(kBlock);
  b.engine.expose_leased("ro", other, Access::remote_read);
  b.engine.expose("standing", b.engine.allocate_memory(kBlock), Access::remote_read);
  auto refused = [&](std::vector<LeaseRange> r, Access acc, std::chrono::milliseconds ttl, const char* words) {
    try {
      (void)b.engine.grant("a", r, acc, ttl);
      ADD_FAILURE() << "granted: " << words;
    } catch (const rdmakit::Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused({{"nope", 0, 1}}, Access::remote_read, 1s, "no segment 'nope'");
  refused({{"kv", 0, 1}, {"kv", 15 * kBlock, 2 * kBlock}}, Access::remote_read, 1s, "range 1");
  refused({{"ro", 0, 8}}, Access::remote_write, 1s, "segment 'ro' allows");
  refused({{"kv", 0, 8}}, Access::remote_read, 0ms, "ttl");
  refused({{"standing", 0, 8}}, Access::remote_read, 1s, "for good, not for leases");
  refused({}, Access::remote_read, 1s, "0 ranges");
  // Neighbours and overlaps are one window.
  const std::uint64_t merged = b.engine.grant(
      "a", std::vector<LeaseRange>{{"kv", 2 * kBlock, kBlock}, {"kv", kBlock, kBlock}, {"kv", kBlock + 8, 16}},
      Access::remote_read, 60s);
  const auto held = a.lease("b", merged, 5s);
  ASSERT_TRUE(held.has_value());
  ASSERT_EQ(held->ranges.size(), 1u);
  EXPECT_EQ(held->ranges[0].offset, kBlock);
  EXPECT_EQ(held->ranges[0].length, 2 * kBlock);
  EXPECT_TRUE(b.engine.end_lease(merged));
  ASSERT_TRUE(next_end(b.engine, 5s).has_value());
  // Granted to "c": a's transfers find nothing.
  const Buffer dst = h.dst;
  const std::uint64_t id = b.engine.grant("c", std::vector<LeaseRange>{{"kv", 0, kBlock}}, Access::remote_read, 60s);
  EXPECT_FALSE(a.lease("b", id, 300ms).has_value());
  EXPECT_EQ(read_block(a, dst, 0).status, TransferStatus::no_segment);
  // A renewal of someone else's lease extends nothing and ends nothing.
  a.renew("b", id, 1s);
  a.release("b", id);
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(b.engine.next_lease_end().has_value());
  EXPECT_TRUE(b.engine.end_lease(id));
}

// The holder SIGKILLed: its link closes, the lease ends within the link's failure bound, and
// the target is told.
TEST(Leases, TheHolderKilledEndsItsLeases) {
  Granter b;
  lab::Child holder("holder", at(b.engine));
  ASSERT_TRUE(holder.ok());
  ASSERT_TRUE(holder.await("ready"));
  const std::uint64_t id = b.engine.grant("holder", std::vector<LeaseRange>{{"kv", 0, kBlock}}, Access::remote_read, 60s);
  std::this_thread::sleep_for(300ms);  // its windows bound and announced
  const auto killed = std::chrono::steady_clock::now();
  holder.kill();
  const auto end = next_end(b.engine, 15s);
  ASSERT_TRUE(end.has_value()) << "not told within 15 s";
  EXPECT_EQ(end->lease, id);
  EXPECT_EQ(end->cause, LeaseCause::peer_lost) << end->reason;
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 10s);
}

// A read in the moment between the target ending a lease and the holder hearing of it is
// refused by the target (its NIC, or its worker on tcp and shm), which breaks the link: the
// holder's other lease lasts, bound again on the next link, and reads on it go on.
TEST(Leases, ALinkBrokenByALateReadKeepsTheOtherLeases) {
  Granter b;
  Holder h(b.engine);
  ASSERT_TRUE(h.linked);
  Engine& a = h.a;
  const Buffer dst = h.dst;
  std::memset(b.buf.addr, 0x66, b.buf.length);
  const std::uint64_t keep = b.engine.grant("a", std::vector<LeaseRange>{{"kv", 8 * kBlock, 4 * kBlock}},
                                            Access::remote_read, 60s);
  ASSERT_TRUE(a.lease("b", keep, 5s).has_value());
  int refused = 0;
  for (int round = 0; round < 40 && refused < 3; ++round) {
    ASSERT_TRUE(a.connect("b", 10s));
    const std::uint64_t id = b.engine.grant("a", std::vector<LeaseRange>{{"kv", 0, kBlock}}, Access::remote_read, 60s);
    ASSERT_TRUE(a.lease("b", id, 5s).has_value()) << round;
    ASSERT_TRUE(b.engine.end_lease(id));
    const auto end = next_end(b.engine, 5s);
    ASSERT_TRUE(end.has_value());
    ASSERT_EQ(end->lease, id) << end->reason;
    const auto r = read_block(a, dst, 0);
    ASSERT_EQ(r.status, TransferStatus::lease_expired) << round << ": " << r.reason;
    if (r.reason.find("refused it") != std::string::npos) ++refused;
    // The other lease: a transfer that raced the link's end may end peer_lost; the next goes.
    rdmakit::TransferResult k;
    for (int attempt = 0; attempt < 3; ++attempt) {
      k = read_block(a, dst, 9);
      if (k.status != TransferStatus::peer_lost) break;
    }
    ASSERT_EQ(k.status, TransferStatus::ok) << round << ": " << k.reason;
    ASSERT_TRUE(holds(dst, 0x66));
  }
  EXPECT_FALSE(b.engine.next_lease_end().has_value()) << "the other lease ended";
  std::printf("late reads refused by the target: %d\n", refused);
}
