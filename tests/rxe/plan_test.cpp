// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: the engine's prepared plans (Engine::prepare, submit(plan)) against rxe.
// A plan's requests are built once per link and posted as built; these cases change what they
// were built for (the bytes, the queue's room, the segment, the buffer, the peer's process) and
// check every byte, or the status and reason, after each change.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine_helpers.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"

namespace {

using namespace std::chrono_literals;
using lab::at;
using lab::config;
using lab::fill;
using lab::same;
using lab::Target;
using lab::xfer;
using rdmakit::Batch;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::EngineConfig;
using rdmakit::Transfer;
using rdmakit::TransferOp;
using rdmakit::TransferPlan;
using rdmakit::TransferStatus;

// Waits for a batch (driving progress() when the engine has no workers).
void settle(Engine& e, const Batch& b, bool workers = true) {
  if (workers) {
    ASSERT_TRUE(lab::waited(b, 20s));
    return;
  }
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (!b.done() && std::chrono::steady_clock::now() < until) (void)e.progress(std::chrono::milliseconds{10});
  ASSERT_TRUE(b.done());
}

// Submits `plan` until a batch of it succeeds (a peer's segment or link that is coming back).
Batch until_ok(Engine& a, const TransferPlan& plan) {
  for (int i = 0;; ++i) {
    Batch b = a.submit(plan);
    EXPECT_TRUE(lab::waited(b, 20s));
    if (b.failed() == 0 || i == 100) return b;
    std::this_thread::sleep_for(100ms);
  }
}

// Engine a connected to peer b (a Target), a source buffer filled, and `n` writes of `size` bytes
// from it to the same offsets of b's segment, prepared.
struct Writes {
  Writes(std::uint64_t n, std::uint64_t size, std::uint8_t seed, EngineConfig c = config("a"))
      : b(std::make_unique<Target>("b", 1 << 20)), a(std::move(c)) {
    a.add_peer("b", at(b->engine));
    std::string why;
    EXPECT_TRUE(a.connect("b", 10s, &why)) << why;
    seg = a.segment("b", "kv");
    src = a.allocate_memory(n * size);
    fill(src.addr, src.length, seed);
    for (std::uint64_t k = 0; k < n; ++k) t.push_back(xfer(TransferOp::write, src, k * size, size, seg, k * size));
    plan = a.prepare(t);
  }
  std::unique_ptr<Target> b;
  Engine a;
  rdmakit::RemoteSegment seg;
  Buffer src;
  std::vector<Transfer> t;
  TransferPlan plan;
};

}  // namespace

// The same ranges, submitted again and again, move the bytes as they are at each submit: writes
// of two sizes and then reads back, three rounds, with worker threads and without.
TEST(EnginePlan, MovesItsRangesWithTheBytesOfEachSubmit) {
  for (const bool workers : {true, false}) {
    SCOPED_TRACE(workers ? "worker threads" : "progress() on the caller");
    Target b("b", 2 << 20);
    EngineConfig c = config("a");
    c.link.send_depth = 256;  // the write plan's 190 fit the queue at once
    if (!workers) c.workers = 0;
    Engine a(c);
    a.add_peer("b", at(b.engine));
    const auto seg = a.segment("b", "kv");
    const Buffer src = a.allocate_memory(1 << 20);
    const Buffer dst = a.allocate_memory(1 << 20);
    std::vector<Transfer> writes, reads;
    for (std::uint64_t k = 0; k < 128; ++k) writes.push_back(xfer(TransferOp::write, src, k * 64, 64, seg, k * 64));
    for (std::uint64_t k = 0; k < 62; ++k) {
      writes.push_back(xfer(TransferOp::write, src, 8192 + k * 16384, 16384, seg, 8192 + k * 16384));
    }
    for (std::uint64_t k = 0; k < 64; ++k) reads.push_back(xfer(TransferOp::read, dst, k * 16384, 16384, seg, k * 16384));
    const TransferPlan w = a.prepare(writes);
    const TransferPlan r = a.prepare(reads);
    EXPECT_EQ(w.size(), writes.size());
    for (int round = 0; round < 3; ++round) {
      fill(src.addr, src.length, static_cast<std::uint8_t>(round * 41 + 1));
      std::memset(dst.addr, 0, dst.length);
      Batch bw = a.submit(w);
      settle(a, bw, workers);
      EXPECT_EQ(bw.failed(), 0u) << bw.describe_failures();
      ASSERT_TRUE(same(b.buf.addr, src.addr, 8192 + 62 * 16384)) << "round " << round;
      Batch br = a.submit(r);
      settle(a, br, workers);
      EXPECT_EQ(br.failed(), 0u) << br.describe_failures();
      ASSERT_TRUE(same(dst.addr, src.addr, 8192 + 62 * 16384)) << "round " << round;
      EXPECT_EQ(br.result(63).status, TransferStatus::ok);
    }
    const auto n = a.counters();
    EXPECT_EQ(n.batches, 6u);
    EXPECT_EQ(n.transfers, 3 * (writes.size() + reads.size()));
    EXPECT_EQ(n.bytes, 3u * (128 * 64 + 62 * 16384 + 64 * 16384));
    EXPECT_EQ(n.connects, 1u);
    // Every one posted as built but the first batch's, which found no link yet (the lazy
    // connect): one build per plan (each is one run), on the one link.
    EXPECT_EQ(n.plan_posted, n.transfers - writes.size());
    EXPECT_EQ(n.plan_builds, 2u);
  }
}

// A plan longer than the send queue goes as far as the queue has room and queues the rest, in
// order; two batches of one plan in flight at once both end, every transfer ok.
TEST(EnginePlan, LongerThanTheQueueGoesInPartsAndTwoBatchesOfItRunAtOnce) {
  Target b("b", 1 << 20);
  EngineConfig c = config("a");
  c.link.send_depth = 16;
  Engine a(c);
  a.add_peer("b", at(b.engine));
  std::string why;
  ASSERT_TRUE(a.connect("b", 10s, &why)) << why;
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(1 << 20);
  fill(src.addr, src.length, 77);
  std::vector<Transfer> t;
  for (std::uint64_t k = 0; k < 700; ++k) t.push_back(xfer(TransferOp::write, src, k * 256, 256, seg, k * 256));
  const TransferPlan plan = a.prepare(t);
  Batch one = a.submit(plan);
  Batch two = a.submit(plan);
  ASSERT_TRUE(lab::waited(one, 30s));
  ASSERT_TRUE(lab::waited(two, 30s));
  EXPECT_EQ(one.failed(), 0u) << one.describe_failures();
  EXPECT_EQ(two.failed(), 0u) << two.describe_failures();
  EXPECT_TRUE(same(b.buf.addr, src.addr, 700 * 256));
  const auto n = a.counters();
  EXPECT_GT(n.plan_posted, 0u);
  // Each batch posts as built at most what the queue has room for, and only while nothing waits
  // before it: the second may find the first's backlog drained already (tcp, a slow submit), so
  // two batches post at most two queues' worth, never all 1,400.
  EXPECT_LE(n.plan_posted, 32u) << "a queue of 16 took more at once";
  // Atomics in a plan: 64 fetch-adds of 1 on one word, submitted four times, see every old
  // value once.
  std::memset(b.buf.addr, 0, 8);
  const Buffer olds = a.allocate_memory(4 * 64 * 8);
  std::vector<TransferPlan> adds;
  for (std::uint64_t r = 0; r < 4; ++r) adds.push_back(a.prepare(lab::fetch_adds(olds, r * 64, 64, seg)));
  std::vector<Batch> batches;
  for (const TransferPlan& p : adds) batches.push_back(a.submit(p));
  for (Batch& bt : batches) {
    ASSERT_TRUE(lab::waited(bt, 20s));
    EXPECT_EQ(bt.failed(), 0u) << bt.describe_failures();
  }
  EXPECT_TRUE(lab::fetch_adds_exact(b.buf.addr, olds, 256));
}

// What could never move is refused at prepare, naming the transfer; a plan is its engine's.
TEST(EnginePlan, PrepareRefusesWhatCouldNeverMove) {
  Target b("b", 4096);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(8192);
  auto refused = [&](Transfer bad, const std::string& says) {
    const std::vector<Transfer> t = {xfer(TransferOp::write, src, 0, 64, seg, 0),
                                     xfer(TransferOp::write, src, 64, 64, seg, 64), bad};
    try {
      (void)a.prepare(t);
      ADD_FAILURE() << "prepared: " << says;
    } catch (const rdmakit::Error& e) {
      EXPECT_EQ(e.sys_errno(), EINVAL);
      EXPECT_NE(std::string(e.what()).find("transfer 2"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused(xfer(TransferOp::write, src, 8190, 64, seg, 0), "outside the local buffer");
  refused(xfer(TransferOp::write, Buffer{999, nullptr, 64}, 0, 64, seg, 0), "not this engine's");
  refused(xfer(TransferOp::write, src, 0, 64, rdmakit::RemoteSegment{4242, 0}, 0), "unknown");
  refused(xfer(TransferOp::fetch_add, src, 0, 4, seg, 0), "8 bytes, not 4");
  refused(xfer(TransferOp::write, src, 0, 0, seg, 0), "0 bytes");
  EXPECT_THROW((void)a.submit(TransferPlan{}), rdmakit::Error);
  Engine other(config("other"));
  const Transfer one = xfer(TransferOp::write, src, 0, 64, seg, 0);
  const TransferPlan mine = a.prepare({&one, 1});
  EXPECT_THROW((void)other.submit(mine), rdmakit::Error);
  // A misaligned atomic is the peer's segment's to judge: it ends invalid at submit.
  const Transfer odd = xfer(TransferOp::fetch_add, src, 0, 8, seg, 3);
  Batch bt = a.submit(a.prepare({&odd, 1}));
  ASSERT_TRUE(lab::waited(bt, 10s));
  EXPECT_EQ(bt.result(0).status, TransferStatus::invalid) << bt.result(0).reason;
  // An empty plan is a batch done at once.
  Batch none = a.submit(a.prepare({}));
  EXPECT_TRUE(none.done());
  EXPECT_EQ(none.size(), 0u);
}

// A plan follows what changes under it: a withdrawn segment ends its transfers as no_segment
// (naming it); the segment exposed again, on another buffer, takes the plan's writes there; an
// unregistered buffer ends them invalid.
TEST(EnginePlan, FollowsTheSegmentAndTheBuffer) {
  Writes w(64, 1024, 5);
  Target& b = *w.b;
  Engine& a = w.a;
  const Buffer src = w.src;
  const std::vector<Transfer>& t = w.t;
  const TransferPlan& plan = w.plan;
  const auto seg = w.seg;
  Batch first = a.submit(plan);
  ASSERT_TRUE(lab::waited(first, 10s));
  ASSERT_EQ(first.failed(), 0u) << first.describe_failures();
  EXPECT_TRUE(same(b.buf.addr, src.addr, src.length));

  // Until the withdrawal has reached a, a write may still be posted and refused by the peer (its
  // window is gone first): a remote access error, as from submit(span).
  b.engine.withdraw("kv");
  std::optional<Batch> gone;
  for (int i = 0; i < 100 && !gone; ++i) {
    Batch x = a.submit(plan);
    ASSERT_TRUE(lab::waited(x, 10s));
    EXPECT_NE(x.result(10).status, TransferStatus::ok) << "a write went after the segment was withdrawn";
    if (x.result(10).status == TransferStatus::no_segment) gone = std::move(x);
    else std::this_thread::sleep_for(50ms);
  }
  ASSERT_TRUE(gone.has_value()) << "the withdrawal never reached the plan's engine";
  EXPECT_EQ(gone->failed(), t.size());
  EXPECT_EQ(gone->result(10).status, TransferStatus::no_segment);
  EXPECT_NE(gone->result(10).reason.find("no segment 'kv'"), std::string::npos) << gone->result(10).reason;

  const Buffer fresh = b.engine.allocate_memory(1 << 20);
  std::memset(fresh.addr, 0, fresh.length);
  b.engine.expose("kv", fresh, rdmakit::Access::remote_write);
  fill(src.addr, src.length, 99);
  const std::uint64_t builds = a.counters().plan_builds;
  Batch back = until_ok(a, plan);
  EXPECT_EQ(back.failed(), 0u) << back.describe_failures();
  EXPECT_TRUE(same(fresh.addr, src.addr, src.length)) << "the plan wrote where the old segment was";
  EXPECT_GT(a.counters().plan_builds, builds) << "posted as built for the old segment";

  // A read is not what the new segment allows: refused, not posted.
  const Transfer rd = xfer(TransferOp::read, src, 0, 64, seg, 0);
  Batch no_read = a.submit(a.prepare({&rd, 1}));
  ASSERT_TRUE(lab::waited(no_read, 10s));
  EXPECT_EQ(no_read.result(0).status, TransferStatus::no_segment) << no_read.result(0).reason;

  a.unregister_memory(src);
  Batch late = a.submit(plan);
  ASSERT_TRUE(lab::waited(late, 10s));
  EXPECT_EQ(late.failed(), t.size());
  EXPECT_EQ(late.result(0).status, TransferStatus::invalid);
  EXPECT_NE(late.result(0).reason.find("unregistered"), std::string::npos) << late.result(0).reason;
}

// The peer's process goes and another takes its address: what the plan submits while it is
// gone fails with a reason, and once the new one listens the plan's writes reach it (its
// requests are built again for the new link).
TEST(EnginePlan, ReachesThePeersNextProcess) {
  EngineConfig ca = config("a");
  ca.link.retry_refused = false;  // the gone peer's port refuses at once
  Writes w(32, 2048, 1, ca);
  auto& b = w.b;
  const std::uint16_t port = b->engine.port();
  Engine& a = w.a;
  const Buffer src = w.src;
  const std::vector<Transfer>& t = w.t;
  const TransferPlan& plan = w.plan;
  Batch first = a.submit(plan);
  ASSERT_TRUE(lab::waited(first, 10s));
  ASSERT_EQ(first.failed(), 0u) << first.describe_failures();
  const std::uint64_t builds = a.counters().plan_builds;
  EXPECT_EQ(builds, 1u);

  b.reset();
  // Once a has seen the link go (its control channel closed), what the plan submits fails at
  // the refused connect, at once.
  const auto gone_by = std::chrono::steady_clock::now() + 15s;
  while (a.counters().links != 0 && std::chrono::steady_clock::now() < gone_by) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(a.counters().links, 0u);
  const auto t0 = std::chrono::steady_clock::now();
  Batch lost = a.submit(plan);
  ASSERT_TRUE(lab::waited(lost, 30s));
  EXPECT_EQ(lost.failed(), t.size());
  EXPECT_EQ(lost.result(31).status, TransferStatus::connect_failed) << lost.result(31).reason;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);

  EngineConfig c = config("b");
  c.listen = "127.0.0.1:" + std::to_string(port);
  Target again("b", 1 << 20, c);
  std::memset(again.buf.addr, 0, again.buf.length);
  fill(src.addr, src.length, 2);
  Batch back = until_ok(a, plan);
  EXPECT_EQ(back.failed(), 0u) << back.describe_failures();
  EXPECT_TRUE(same(again.buf.addr, src.addr, src.length));
  EXPECT_GE(a.counters().connects, 2u);
  // The next batch goes as built, for the new link.
  fill(src.addr, src.length, 3);
  const std::uint64_t posted = a.counters().plan_posted;
  Batch more = a.submit(plan);
  ASSERT_TRUE(lab::waited(more, 10s));
  EXPECT_EQ(more.failed(), 0u) << more.describe_failures();
  EXPECT_TRUE(same(again.buf.addr, src.addr, src.length));
  EXPECT_EQ(a.counters().plan_posted, posted + t.size());
  EXPECT_GT(a.counters().plan_builds, builds) << "posted as built for the link that went";
}

// One plan submitted from four threads at once, 25 times each, with a notification on some:
// every batch ends ok, and the target gets every notification after the data.
TEST(EnginePlan, ThreadsSubmitOnePlanAtOnce) {
  Writes w(128, 2048, 33);
  Target& b = *w.b;
  Engine& a = w.a;
  const Buffer src = w.src;
  const TransferPlan& plan = w.plan;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      for (int i = 0; i < 25; ++i) {
        rdmakit::SubmitOptions o;
        if (i % 5 == 0) o.notify = {static_cast<std::uint8_t>(th), static_cast<std::uint8_t>(i)};
        Batch bt = a.submit(plan, std::move(o));
        if (!bt.wait(20s) || bt.failed() != 0) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(same(b.buf.addr, src.addr, src.length));
  EXPECT_EQ(a.counters().batches, 100u);
  int notes = 0;
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (notes < 20 && std::chrono::steady_clock::now() < until) {
    if (b.engine.next_notification()) ++notes;
    else std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(notes, 20);
}
