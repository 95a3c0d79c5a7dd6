// SPDX-License-Identifier: Apache-2.0
// What serving systems' KV connectors do through the engine (runs in the lab over rxe, and on
// the host over tcp and shm): a pull-mode read whose notification tells the target its blocks
// may be reused, notifications on their own, request ids, per-batch telemetry, and cancel().
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine_helpers.hpp"
#include "lab_helpers.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Batch;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::EngineConfig;
using rdmakit::Transfer;
using rdmakit::TransferOp;
using rdmakit::TransferStatus;

using lab::at;
using lab::config;
using lab::fill;
using lab::same;
using lab::SilentListener;
using lab::Target;
using lab::xfer;

// The next notification `e` receives, woken by its descriptor; none within `limit`.
std::optional<rdmakit::Notification> next_note(Engine& e, std::chrono::milliseconds limit) {
  return lab::next_by_fd(e, [&] { return e.next_notification(); }, limit);
}

std::vector<std::uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

// Pull mode: the decode side READs blocks and its notification tells the prefill side it may
// free them. The target overwrites the blocks the moment the notification arrives: had it
// overtaken a read, the reader would hold the new bytes.
TEST(Serving, AReadsNotificationComesAfterItsReads) {
  constexpr std::uint64_t kBlock = 4096, kBlocks = 64, kRead = 8;
  Target b("b", kBlock * kBlocks);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer dst = a.allocate_memory(kBlock * kRead);
  std::vector<std::uint8_t> before(kBlock * kRead);
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  const int rounds = 200;  // what they check repeats from round to round; the plain build runs 1,000
#else
  const int rounds = 1000;
#endif
  for (int round = 0; round < rounds; ++round) {
    const auto seed = static_cast<std::uint8_t>(round * 13 + 1);
    fill(b.buf.addr, b.buf.length, seed);
    std::vector<Transfer> reads;
    for (std::uint64_t k = 0; k < kRead; ++k) {
      const std::uint64_t block = (static_cast<std::uint64_t>(round) * 7 + k * 5) % kBlocks;  // a selection
      reads.push_back(xfer(TransferOp::read, dst, k * kBlock, kBlock, seg, block * kBlock));
      std::memcpy(before.data() + k * kBlock, static_cast<const std::uint8_t*>(b.buf.addr) + block * kBlock, kBlock);
    }
    rdmakit::SubmitOptions o;
    o.notify = bytes("done " + std::to_string(round));
    o.request_id = "req-" + std::to_string(round);
    Batch r = a.submit(reads, o);
    const auto n = next_note(b.engine, 10s);
    ASSERT_TRUE(n.has_value()) << "round " << round << ": no notification; " << r.describe_failures();
    fill(b.buf.addr, b.buf.length, static_cast<std::uint8_t>(seed + 101));  // reused at once
    EXPECT_EQ(n->peer, "a");
    EXPECT_EQ(n->message, o.notify);
    EXPECT_EQ(n->request_id, o.request_id);
    ASSERT_TRUE(lab::waited(r, 10s));
    ASSERT_EQ(r.failed(), 0u) << r.describe_failures();
    ASSERT_TRUE(same(dst.addr, before.data(), before.size())) << "round " << round << ": the notification overtook a read";
  }
  EXPECT_EQ(a.counters().notifications_sent, static_cast<std::uint64_t>(rounds));
  EXPECT_EQ(b.engine.counters().notifications_received, static_cast<std::uint64_t>(rounds));
}

// A batch that reads from one peer and writes to another notifies each once its own transfers
// ended; a peer whose transfer failed gets none, and the batch says so by failing that transfer.
TEST(Serving, EachPeerIsNotifiedOnceItsTransfersEnded) {
  Target b("b"), c("c");
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  a.add_peer("c", at(c.engine));
  const Buffer buf = a.allocate_memory(1 << 16);
  fill(c.buf.addr, 4096, 9);
  fill(buf.addr, 4096, 4);
  std::vector<Transfer> t{xfer(TransferOp::write, buf, 0, 4096, a.segment("b", "kv"), 0),
                          xfer(TransferOp::read, buf, 8192, 4096, a.segment("c", "kv"), 0)};
  rdmakit::SubmitOptions o;
  o.notify = bytes("both");
  o.request_id = "r1";
  Batch x = a.submit(t, o);
  ASSERT_TRUE(lab::waited(x, 10s));
  EXPECT_EQ(x.failed(), 0u) << x.describe_failures();
  for (Target* to : {&b, &c}) {
    const auto n = next_note(to->engine, 10s);
    ASSERT_TRUE(n.has_value());
    EXPECT_EQ(n->message, o.notify);
    EXPECT_EQ(n->request_id, "r1");
  }
  EXPECT_TRUE(same(b.buf.addr, buf.addr, 4096));
  EXPECT_TRUE(same(static_cast<std::uint8_t*>(buf.addr) + 8192, c.buf.addr, 4096));
  // A read of a segment c does not have: c is not notified, b is.
  std::vector<Transfer> u{xfer(TransferOp::write, buf, 0, 64, a.segment("b", "kv"), 0),
                          xfer(TransferOp::read, buf, 0, 64, a.segment("c", "nope"), 0)};
  Batch y = a.submit(u, o);
  ASSERT_TRUE(lab::waited(y, 10s));
  EXPECT_EQ(y.failed(), 1u);
  EXPECT_TRUE(next_note(b.engine, 10s).has_value());
  EXPECT_FALSE(next_note(c.engine, 300ms).has_value()) << "notified although its read failed";
}

// Engine::notify: on its own, connecting first, with a request id; what it refuses.
TEST(Serving, ANotificationOnItsOwn) {
  Target b("b");
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  rdmakit::SubmitOptions tagged;
  tagged.request_id = "req-9";
  bool called = false;
  tagged.on_done = [&](const Batch& done) { called = done.done(); };
  Batch n = a.notify("b", bytes("free 3,4"), tagged);  // no link yet: it connects
  ASSERT_TRUE(lab::waited(n, 10s));
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n.result(0).status, TransferStatus::ok) << n.describe_failures();
  EXPECT_EQ(n.telemetry().transfers, 0u);
  EXPECT_EQ(n.telemetry().request_id, "req-9");
  EXPECT_TRUE(called);
  auto got = next_note(b.engine, 10s);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->peer, "a");
  EXPECT_EQ(got->message, bytes("free 3,4"));
  EXPECT_EQ(got->request_id, "req-9");
  // Empty, on the link now up; and many in a row, in order.
  ASSERT_TRUE(a.notify("b", {}).wait(10s));
  got = next_note(b.engine, 10s);
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(got->message.empty());
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(a.notify("b", bytes(std::to_string(i))).wait(10s));
  for (int i = 0; i < 50; ++i) {
    got = next_note(b.engine, 10s);  // sent is not yet delivered: it may still be on its way
    ASSERT_TRUE(got.has_value()) << i;
    EXPECT_EQ(got->message, bytes(std::to_string(i)));
    EXPECT_TRUE(got->request_id.empty());
  }
  EXPECT_EQ(a.counters().batches, 0u);  // notifications are not batches of transfers
  EXPECT_EQ(a.counters().notifications_sent, 52u);
  EXPECT_THROW((void)a.notify("nobody", bytes("x")), rdmakit::Error);
  EXPECT_THROW((void)a.notify("b", std::vector<std::uint8_t>(Engine::max_notification + 1)), rdmakit::Error);
  rdmakit::SubmitOptions o;
  o.notify = bytes("twice");
  EXPECT_THROW((void)a.notify("b", bytes("x"), o), rdmakit::Error);
  o = {};
  o.request_id.assign(Engine::max_request_id + 1, 'r');
  EXPECT_THROW((void)a.notify("b", {}, o), rdmakit::Error);
  const Transfer t = xfer(TransferOp::write, a.allocate_memory(64), 0, 64, a.segment("b", "kv"), 0);
  EXPECT_THROW((void)a.submit({&t, 1}, o), rdmakit::Error);
  // A peer nobody answers for: connect_failed, with why.
  SilentListener silent;
  rdmakit::EngineConfig cc = config("d");
  cc.link.handshake_timeout = 500ms;
  Engine d(cc);
  d.add_peer("s", "127.0.0.1:" + std::to_string(silent.port));
  Batch f = d.notify("s", bytes("hello?"));
  ASSERT_TRUE(lab::waited(f, 10s));
  EXPECT_EQ(f.result(0).status, TransferStatus::connect_failed);
  EXPECT_EQ(f.notifications_failed(), 1u);
  EXPECT_NE(f.describe_failures().find("notification: connect_failed"), std::string::npos) << f.describe_failures();
}

// A receiver that takes none: its queue fills, and the next notification ends failed, saying so.
TEST(Serving, ANotificationToAFullQueueFails) {
  rdmakit::EngineConfig c = config("b");
  c.notification_queue = 2;
  Target b("b", 4096, c);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  for (int i = 0; i < 2; ++i) {
    Batch n = a.notify("b", bytes("x"));
    ASSERT_TRUE(lab::waited(n, 10s));
    EXPECT_EQ(n.result(0).status, TransferStatus::ok) << n.describe_failures();
  }
  Batch full = a.notify("b", bytes("x"));
  ASSERT_TRUE(lab::waited(full, 10s));
  EXPECT_EQ(full.result(0).status, TransferStatus::failed);
  EXPECT_EQ(full.notifications_failed(), 1u);
  EXPECT_NE(full.describe_failures().find("is full"), std::string::npos) << full.describe_failures();
  EXPECT_EQ(a.counters().transfers_failed, 0u);  // not a transfer
}

TEST(Serving, TelemetrySaysWhenAndHowMuch) {
  Target b("b", 1 << 20);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(1 << 20);
  std::vector<Transfer> t;
  for (std::uint64_t k = 0; k < 16; ++k) t.push_back(xfer(TransferOp::write, src, k * 65536, 65536, seg, k * 65536));
  t.push_back(xfer(TransferOp::write, src, 0, 64, a.segment("b", "missing"), 0));  // fails
  rdmakit::SubmitOptions o;
  o.request_id = "cmpl-42";
  rdmakit::BatchTelemetry in_callback;
  o.on_done = [&](const Batch& done) { in_callback = done.telemetry(); };
  const auto before = std::chrono::steady_clock::now();
  Batch x = a.submit(t, o);
  ASSERT_TRUE(lab::waited(x, 10s));
  const auto after = std::chrono::steady_clock::now();
  const rdmakit::BatchTelemetry m = x.telemetry();
  EXPECT_EQ(m.request_id, "cmpl-42");
  EXPECT_EQ(m.transfers, 17u);
  EXPECT_EQ(m.failed, 1u);
  EXPECT_EQ(m.bytes, 16u * 65536);
  EXPECT_LE(before, m.submitted);
  EXPECT_LE(m.submitted, m.posted);
  EXPECT_LE(m.posted, m.ended);
  EXPECT_LE(m.ended, after);
  EXPECT_GT(m.total_time().count(), 0);
  EXPECT_EQ(m.total_time(), m.ended - m.submitted);
  EXPECT_EQ(in_callback.ended, m.ended);  // complete in the batch's callback
  EXPECT_EQ(in_callback.failed, 1u);
  EXPECT_EQ(in_callback.bytes, m.bytes);
  // The path the 16 that moved took: the one link's device and transport (the failed one took none).
  const auto t0 = lab::test_transports();
  const std::string transport = t0.empty() ? "rdma" : std::string(rdmakit::to_string(t0[0]));
  ASSERT_EQ(m.paths.size(), 1u);
  EXPECT_EQ(m.paths[0].transport, transport);
  EXPECT_EQ(m.paths[0].bytes, 16u * 65536);
  EXPECT_EQ(m.paths[0].transfers, 16u);
  EXPECT_EQ(m.paths[0].device, transport == "rdma" ? a.peers().at(0).device : transport);
  ASSERT_EQ(in_callback.paths.size(), 1u);
  EXPECT_EQ(in_callback.paths[0].bytes, m.paths[0].bytes);
  // Off: sizes only.
  rdmakit::EngineConfig c = config("e");
  c.telemetry = false;
  Engine e(c);
  e.add_peer("b", at(b.engine));
  const Buffer s2 = e.allocate_memory(4096);
  const Transfer one = xfer(TransferOp::read, s2, 0, 4096, e.segment("b", "kv"), 0);
  Batch y = e.submit({&one, 1});
  ASSERT_TRUE(lab::waited(y, 10s));
  const rdmakit::BatchTelemetry q = y.telemetry();
  EXPECT_EQ(q.bytes, 4096u);
  ASSERT_EQ(q.paths.size(), 1u);  // counted as transfers end, whatever the clock reads do
  EXPECT_EQ(q.paths[0].bytes, 4096u);
  EXPECT_EQ(q.submitted, std::chrono::steady_clock::time_point{});
  EXPECT_EQ(q.ended, std::chrono::steady_clock::time_point{});
  EXPECT_EQ(q.total_time().count(), 0);
}

// cancel(): what waits for a peer that does not answer ends at once, and the buffer may go.
TEST(Serving, CancelEndsWhatWaitsForALink) {
  SilentListener silent;
  rdmakit::EngineConfig c = config("a");
  c.link.handshake_timeout = 20s;
  Engine a(c);
  a.add_peer("s", "127.0.0.1:" + std::to_string(silent.port));
  Buffer src = a.allocate_memory(1 << 16);
  std::vector<Transfer> t;
  for (std::uint64_t k = 0; k < 8; ++k) t.push_back(xfer(TransferOp::write, src, k * 4096, 4096, a.segment("s", "kv"), 0));
  Batch x = a.submit(t);
  EXPECT_FALSE(x.wait(200ms));
  const auto t0 = std::chrono::steady_clock::now();
  x.cancel();
  EXPECT_TRUE(x.done());
  for (std::size_t i = 0; i < t.size(); ++i) EXPECT_EQ(x.result(i).status, TransferStatus::cancelled) << i;
  EXPECT_NE(x.describe_failures().find("cancelled"), std::string::npos);
  a.unregister_memory(src, 1s);  // nothing of it in flight
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  x.cancel();  // done: nothing
  Batch none;
  none.cancel();
}

// cancel() on a batch deeper than the send queue: what was posted runs to its end (its bytes
// land), what was queued behind it is cancelled; nothing ends otherwise.
TEST(Serving, CancelLeavesWhatIsOnTheWire) {
  Target b("b", 1 << 20);
  Engine a(config("a"));
  ASSERT_EQ(lab::link_to(a, "b", b.engine), "");
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(1 << 20);
  fill(src.addr, src.length, 77);
  std::vector<Transfer> t;
  for (std::uint64_t k = 0; k < 4096; ++k) t.push_back(xfer(TransferOp::write, src, k * 256, 256, seg, k * 256));
  // Five rounds of `submit` (4,096 writes of 256 bytes, transfer k at k * 256 on both sides),
  // each cancelled at once: each ends ok with its bytes, or cancelled (counted in `cancelled`).
  const auto cancel_rounds = [&](auto submit, std::size_t& cancelled) {
    for (int round = 0; round < 5; ++round) {
      std::memset(b.buf.addr, 0, b.buf.length);
      Batch x = submit();
      x.cancel();
      ASSERT_TRUE(lab::waited(x, 10s));
      for (std::size_t i = 0; i < t.size(); ++i) {
        const auto st = x.result(i).status;
        ASSERT_TRUE(st == TransferStatus::ok || st == TransferStatus::cancelled) << i << ": " << x.describe_failures();
        if (st == TransferStatus::ok) {
          ASSERT_TRUE(same(static_cast<std::uint8_t*>(b.buf.addr) + i * 256, static_cast<std::uint8_t*>(src.addr) + i * 256, 256))
              << "transfer " << i << " ended ok without its bytes";
        } else {
          ++cancelled;
        }
      }
      EXPECT_EQ(x.telemetry().bytes, (t.size() - x.failed()) * 256);
    }
  };
  std::size_t cancelled = 0;
  cancel_rounds([&] { return a.submit(t); }, cancelled);
  if (HasFatalFailure()) return;
  std::printf("cancelled %zu of %zu transfers queued behind the send queue\n", cancelled, 5 * t.size());
  // The same through descriptor lists: what waits in the link's backlog, its transfers never
  // built, is cancelled; what was posted the lists' way ends ok with its bytes.
  std::vector<rdmakit::LocalDescriptor> ld;
  std::vector<rdmakit::RemoteDescriptor> rd;
  for (std::uint64_t k = 0; k < 4096; ++k) {
    ld.push_back({src, k * 256, 256});
    rd.push_back({seg, k * 256, 256});
  }
  const rdmakit::DescriptorList local = a.prepare_local(ld), remote = a.prepare_remote(rd);
  std::vector<std::uint32_t> all(4096);
  std::iota(all.begin(), all.end(), 0u);
  std::size_t lists_cancelled = 0;
  cancel_rounds([&] { return a.submit(TransferOp::write, local, all, remote, all); }, lists_cancelled);
  if (HasFatalFailure()) return;
  std::printf("cancelled %zu of %zu positions of descriptor lists queued behind the send queue\n", lists_cancelled,
              5 * all.size());
  EXPECT_GT(cancelled, 0u) << "4,096 transfers never wait behind a send queue of " << lab::quiet().send_depth << "?";
}

// Descriptor lists as a KV connector uses them: 20,000 blocks a side prepared once, selections
// read and written by index in random order, every byte checked; indices and pairs checked with
// the position and index named; the lists reach the peer's next process.
TEST(Serving, DescriptorListsMoveSelectionsByIndex) {
  constexpr std::uint32_t kDescs = 20000, kBlock = 128;  // 2.5 MiB a side
  auto owner = std::make_unique<Target>("b", std::size_t{kDescs} * kBlock);
  Target& b = *owner;
  const std::uint16_t port = b.engine.port();
  EngineConfig ca = config("a");
  ca.link.retry_refused = false;
  Engine a(ca);
  ASSERT_EQ(lab::link_to(a, "b", b.engine), "");
  const auto seg = a.segment("b", "kv");
  // The local cache in two buffers (K and V of one layer, say), interleaved in the list.
  const Buffer k = a.allocate_memory(std::size_t{kDescs} / 2 * kBlock);
  const Buffer v = a.allocate_memory(std::size_t{kDescs} / 2 * kBlock);
  std::vector<rdmakit::LocalDescriptor> ld;
  std::vector<rdmakit::RemoteDescriptor> rd;
  for (std::uint32_t i = 0; i < kDescs; ++i) {
    ld.push_back({i % 2 == 0 ? k : v, std::uint64_t{i / 2} * kBlock, kBlock});
    rd.push_back({seg, std::uint64_t{kDescs - 1 - i} * kBlock, kBlock});  // reversed: no position maps to itself
  }
  const rdmakit::DescriptorList local = a.prepare_local(ld);
  const rdmakit::DescriptorList remote = a.prepare_remote(rd);
  EXPECT_EQ(local.size(), kDescs);
  EXPECT_TRUE(remote.remote());
  const auto at_local = [&](std::uint32_t i) {
    return static_cast<std::uint8_t*>(ld[i].buffer.addr) + ld[i].offset;
  };
  const auto at_remote = [&](Target& t, std::uint32_t j) { return static_cast<std::uint8_t*>(t.buf.addr) + rd[j].offset; };
  std::mt19937 rng(35);
  std::uint64_t positions = 0;
  const auto selection = [&](std::size_t n) {
    positions += n;
    std::vector<std::uint32_t> li(kDescs), ri(kDescs);
    std::iota(li.begin(), li.end(), 0u);
    std::iota(ri.begin(), ri.end(), 0u);
    std::shuffle(li.begin(), li.end(), rng);
    std::shuffle(ri.begin(), ri.end(), rng);
    li.resize(n);
    ri.resize(n);
    return std::make_pair(li, ri);
  };
  // The target's memory is written only by transfers (its process, here the test's, filled it
  // once): what it holds is followed in `shadow`.
  fill(b.buf.addr, b.buf.length, 100);
  std::vector<std::uint8_t> shadow(static_cast<std::uint8_t*>(b.buf.addr), static_cast<std::uint8_t*>(b.buf.addr) + b.buf.length);
  for (int round = 0; round < 4; ++round) {
    fill(k.addr, k.length, static_cast<std::uint8_t>(round));
    fill(v.addr, v.length, static_cast<std::uint8_t>(round + 50));
    const auto [wl, wr] = selection(round == 0 ? kDescs : 2500);  // all of them once
    Batch w = a.submit(TransferOp::write, local, wl, remote, wr);
    ASSERT_TRUE(lab::waited(w, 30s));
    ASSERT_EQ(w.failed(), 0u) << w.describe_failures();
    for (std::size_t p = 0; p < wl.size(); ++p) {
      ASSERT_TRUE(same(at_remote(b, wr[p]), at_local(wl[p]), kBlock)) << "write, position " << p;
      std::memcpy(shadow.data() + rd[wr[p]].offset, at_local(wl[p]), kBlock);
    }
    const auto [rl, rr] = selection(1500);
    std::vector<std::vector<std::uint8_t>> want;
    for (std::size_t p = 0; p < rl.size(); ++p) {
      want.emplace_back(shadow.data() + rd[rr[p]].offset, shadow.data() + rd[rr[p]].offset + kBlock);
    }
    rdmakit::SubmitOptions o;
    o.request_id = "r" + std::to_string(round);
    Batch r = a.submit(TransferOp::read, local, rl, remote, rr, o);
    ASSERT_TRUE(lab::waited(r, 30s));
    ASSERT_EQ(r.failed(), 0u) << r.describe_failures();
    for (std::size_t p = 0; p < rl.size(); ++p) {
      ASSERT_TRUE(same(at_local(rl[p]), want[p].data(), kBlock)) << "read, position " << p;
    }
    EXPECT_EQ(r.telemetry().bytes, std::uint64_t{rl.size()} * kBlock);
    EXPECT_EQ(r.telemetry().request_id, o.request_id);
  }
  // They went the lists' own way (each request from the prepared SGE and target), not the long way.
  EXPECT_EQ(a.counters().lists_posted, positions) << "positions took the long way";
  // What is refused, naming the position and the index.
  const std::vector<std::uint32_t> ok{0, 1}, out{0, kDescs};
  const auto why = [&](auto&& f) {
    try {
      f();
    } catch (const rdmakit::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(why([&] { (void)a.submit(TransferOp::read, local, out, remote, ok); }).find("position 1: local index 20000"),
            std::string::npos);
  EXPECT_NE(why([&] { (void)a.submit(TransferOp::read, local, ok, remote, out); }).find("position 1: remote index 20000"),
            std::string::npos);
  EXPECT_NE(why([&] { (void)a.submit(TransferOp::read, local, ok, remote, std::vector<std::uint32_t>{0}); }).find("2 local indices and 1"),
            std::string::npos);
  EXPECT_NE(why([&] { (void)a.submit(TransferOp::fetch_add, local, ok, remote, ok); }).find("read or write"), std::string::npos);
  EXPECT_NE(why([&] { (void)a.submit(TransferOp::read, remote, ok, local, ok); }).find("prepare_local"), std::string::npos);
  // A pair of different lengths ends invalid in the batch, naming the position and both descriptors;
  // the positions around it move.
  const rdmakit::DescriptorList odd =
      a.prepare_remote(std::vector<rdmakit::RemoteDescriptor>{{seg, 0, kBlock}, {seg, kBlock, kBlock + 1}, {seg, 4 * kBlock, kBlock}});
  Batch mixed = a.submit(TransferOp::read, local, std::vector<std::uint32_t>{2, 3, 4}, odd, std::vector<std::uint32_t>{0, 1, 2});
  ASSERT_TRUE(lab::waited(mixed, 10s));
  EXPECT_EQ(mixed.result(0).status, TransferStatus::ok) << mixed.describe_failures();
  EXPECT_EQ(mixed.result(1).status, TransferStatus::invalid);
  EXPECT_NE(mixed.result(1).reason.find("position 1: local descriptor 3 is 128 bytes, remote descriptor 1 is 129"),
            std::string::npos)
      << mixed.result(1).reason;
  EXPECT_EQ(mixed.result(2).status, TransferStatus::ok) << mixed.describe_failures();
  EXPECT_TRUE(same(at_local(2), shadow.data(), kBlock));
  EXPECT_TRUE(same(at_local(4), shadow.data() + 4 * kBlock, kBlock));
  EXPECT_NE(why([&] { (void)a.prepare_local(std::vector<rdmakit::LocalDescriptor>{{k, 0, 64}, {k, k.length - 8, 64}}); })
                .find("descriptor 1: [" + std::to_string(k.length - 8) + ", +64) is outside"),
            std::string::npos);
  EXPECT_NE(why([&] { (void)a.prepare_remote(std::vector<rdmakit::RemoteDescriptor>{{seg, 0, 0}}); }).find("descriptor 0: 0 bytes"),
            std::string::npos);
  // A range past the segment's end ends no_segment in the batch (the segment is the peer's).
  const rdmakit::DescriptorList past = a.prepare_remote(std::vector<rdmakit::RemoteDescriptor>{{seg, b.buf.length - 64, kBlock}});
  Batch beyond = a.submit(TransferOp::read, local, std::vector<std::uint32_t>{0}, past, std::vector<std::uint32_t>{0});
  ASSERT_TRUE(lab::waited(beyond, 10s));
  EXPECT_EQ(beyond.result(0).status, TransferStatus::no_segment) << beyond.result(0).reason;
  // The peer's next process, at the same address: the same lists reach it once it is up.
  owner.reset();
  const auto gone_by = std::chrono::steady_clock::now() + 15s;
  while (a.counters().links != 0 && std::chrono::steady_clock::now() < gone_by) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(a.counters().links, 0u);
  EngineConfig c = config("b");
  c.listen = "127.0.0.1:" + std::to_string(port);
  Target again("b", std::size_t{kDescs} * kBlock, c);
  fill(again.buf.addr, again.buf.length, 200);
  const auto [al, ar] = selection(1000);
  for (int i = 0;; ++i) {  // until the new process's link and segment are up
    Batch r = a.submit(TransferOp::read, local, al, remote, ar);
    ASSERT_TRUE(lab::waited(r, 20s));
    if (r.failed() == 0) break;
    const TransferStatus st = r.result(0).status;
    ASSERT_TRUE(st == TransferStatus::connect_failed || st == TransferStatus::no_segment || st == TransferStatus::peer_lost)
        << r.describe_failures();
    ASSERT_LT(i, 100) << r.describe_failures();
    std::this_thread::sleep_for(100ms);
  }
  for (std::size_t p = 0; p < al.size(); ++p) {
    ASSERT_TRUE(same(at_local(al[p]), at_remote(again, ar[p]), kBlock)) << "after the restart, position " << p;
  }
  // What changed since the lists were prepared ends its transfers in the batch, with why: a
  // buffer unregistered, a peer removed; lists of another engine are refused.
  a.unregister_memory(v);
  Batch stale = a.submit(TransferOp::write, local, std::vector<std::uint32_t>{0, 1}, remote, std::vector<std::uint32_t>{0, 1});
  ASSERT_TRUE(lab::waited(stale, 10s));
  EXPECT_EQ(stale.result(0).status, TransferStatus::ok) << stale.describe_failures();  // k's
  EXPECT_EQ(stale.result(1).status, TransferStatus::invalid);                          // v's
  Engine other(config("o"));
  const rdmakit::DescriptorList theirs = other.prepare_local(std::vector<rdmakit::LocalDescriptor>{{other.allocate_memory(kBlock), 0, kBlock}});
  EXPECT_NE(why([&] { (void)a.submit(TransferOp::read, theirs, std::vector<std::uint32_t>{0}, remote, std::vector<std::uint32_t>{0}); })
                .find("another engine"),
            std::string::npos);
  a.remove_peer("b");
  Batch removed = a.submit(TransferOp::read, local, std::vector<std::uint32_t>{0}, remote, std::vector<std::uint32_t>{0});
  ASSERT_TRUE(lab::waited(removed, 10s));
  EXPECT_EQ(removed.result(0).status, TransferStatus::invalid) << removed.describe_failures();
}

// Positions the lists' own way cannot post take the long way one by one, in order, and the rest
// still go the lists' way: a range past the segment's end in the middle of a batch ends with
// why; a list over two peers goes the long way whole (each peer's
// worker builds its own positions), notifying each peer; every byte checked.
TEST(Serving, DescriptorListsMixWhatTheyCanPostWithTheLongWay) {
  constexpr std::uint64_t kBlock = 256;
  Target b("b"), c("c");
  Engine a(config("a"));
  ASSERT_EQ(lab::link_to(a, "b", b.engine), "");
  ASSERT_EQ(lab::link_to(a, "c", c.engine), "");
  const auto sb = a.segment("b", "kv"), sc = a.segment("c", "kv");
  const Buffer buf = a.allocate_memory(64 * kBlock);
  fill(buf.addr, buf.length, 7);
  fill(b.buf.addr, b.buf.length, 31);
  fill(c.buf.addr, c.buf.length, 63);
  const std::vector<std::uint8_t> was(static_cast<std::uint8_t*>(b.buf.addr), static_cast<std::uint8_t*>(b.buf.addr) + b.buf.length);
  std::vector<rdmakit::LocalDescriptor> ld;
  for (std::uint64_t i = 0; i < 64; ++i) ld.push_back({buf, i * kBlock, kBlock});
  std::vector<rdmakit::RemoteDescriptor> rd;
  for (std::uint64_t i = 0; i < 48; ++i) rd.push_back({sb, i * kBlock, kBlock});
  rd.push_back({sb, b.buf.length - kBlock / 2, kBlock});  // 48: past the segment's end
  const rdmakit::DescriptorList local = a.prepare_local(ld), remote = a.prepare_remote(rd);
  // Writes: positions 0..39 to blocks 39..0, but position 20 to descriptor 48.
  std::vector<std::uint32_t> li, ri;
  for (std::uint32_t k = 0; k < 40; ++k) {
    li.push_back(k);
    ri.push_back(k == 20 ? 48 : 39 - k);
  }
  const auto before = a.counters();
  Batch w = a.submit(TransferOp::write, local, li, remote, ri);
  ASSERT_TRUE(lab::waited(w, 10s));
  EXPECT_EQ(w.failed(), 1u) << w.describe_failures();
  EXPECT_EQ(w.result(20).status, TransferStatus::no_segment) << w.result(20).reason;
  for (std::uint32_t k = 0; k < 40; ++k) {
    if (k == 20) continue;
    ASSERT_EQ(w.result(k).status, TransferStatus::ok) << k << ": " << w.result(k).reason;
  }
  for (std::uint32_t k = 0; k < 40; ++k) {
    const auto* block = static_cast<std::uint8_t*>(b.buf.addr) + (39 - k) * kBlock;
    if (k == 20) {
      EXPECT_TRUE(same(block, was.data() + (39 - k) * kBlock, kBlock)) << "block 19 was written";
      continue;
    }
    ASSERT_TRUE(same(block, static_cast<std::uint8_t*>(buf.addr) + k * kBlock, kBlock)) << k;
  }
  EXPECT_EQ(a.counters().lists_posted - before.lists_posted, 39u) << "positions other than the bad one went the long way";
  EXPECT_EQ(w.telemetry().bytes, 39 * kBlock);
  // Lists of blocks of several sizes (their SGEs' lengths compared one by one): 100 writes of
  // 64..256 bytes, b notified once they are all there; then the same blocks read back into
  // another half of the buffer.
  std::vector<rdmakit::LocalDescriptor> vl;
  std::vector<rdmakit::RemoteDescriptor> vr;
  for (std::uint64_t i = 0; i < 100; ++i) {
    const std::uint64_t len = 64 + (i * 37) % 193;
    vl.push_back({buf, (i % 32) * kBlock, len});
    vr.push_back({sb, 48 * kBlock + i * kBlock, len});
  }
  fill(buf.addr, 32 * kBlock, 77);
  const rdmakit::DescriptorList vlocal = a.prepare_local(vl), vremote = a.prepare_remote(vr);
  std::vector<std::uint32_t> all(100);
  std::iota(all.begin(), all.end(), 0u);
  const auto sized = a.counters();
  rdmakit::SubmitOptions written;
  written.notify = {'v', 'w'};
  Batch vw = a.submit(TransferOp::write, vlocal, all, vremote, all, written);
  ASSERT_TRUE(lab::waited(vw, 10s));
  ASSERT_EQ(vw.failed(), 0u) << vw.describe_failures();
  std::uint64_t total = 0;
  for (std::uint32_t i = 0; i < 100; ++i) {
    ASSERT_TRUE(same(static_cast<std::uint8_t*>(b.buf.addr) + vr[i].offset, static_cast<std::uint8_t*>(buf.addr) + vl[i].offset, vl[i].length)) << i;
    total += vl[i].length;
  }
  EXPECT_EQ(vw.telemetry().bytes, total);
  EXPECT_EQ(a.counters().lists_posted - sized.lists_posted, 100u);
  const auto note = next_note(b.engine, 10s);
  ASSERT_TRUE(note.has_value()) << "no notification after the lists' writes";
  EXPECT_EQ(note->message, written.notify);
  std::vector<rdmakit::LocalDescriptor> back;
  for (std::uint64_t i = 0; i < 100; ++i) back.push_back({buf, 32 * kBlock + (i % 16) * kBlock, vl[i].length});
  const rdmakit::DescriptorList vback = a.prepare_local(back);
  for (std::uint32_t part = 0; part < 100; part += 16) {  // 16 at a time: each into a block of its own
    std::vector<std::uint32_t> idx;
    for (std::uint32_t i = part; i < std::min(part + 16, 100u); ++i) idx.push_back(i);
    Batch vr_read = a.submit(TransferOp::read, vback, idx, vremote, idx);
    ASSERT_TRUE(lab::waited(vr_read, 10s));
    ASSERT_EQ(vr_read.failed(), 0u) << vr_read.describe_failures();
    for (const std::uint32_t i : idx) {
      ASSERT_TRUE(same(static_cast<std::uint8_t*>(buf.addr) + back[i].offset, static_cast<std::uint8_t*>(b.buf.addr) + vr[i].offset, back[i].length)) << i;
    }
  }
  EXPECT_EQ(a.counters().lists_posted - sized.lists_posted, 200u);
  // A list over two peers: the long way, each position's transfer built by its peer's worker.
  std::vector<rdmakit::RemoteDescriptor> both;
  for (std::uint64_t i = 0; i < 16; ++i) both.push_back({i % 2 == 0 ? sb : sc, i * kBlock, kBlock});
  const rdmakit::DescriptorList two = a.prepare_remote(both);
  std::vector<std::uint32_t> pl, pr;
  for (std::uint32_t k = 0; k < 16; ++k) {
    pl.push_back(48 + k);
    pr.push_back(15 - k);
  }
  rdmakit::SubmitOptions o;
  o.notify = {'d', 'o', 'n', 'e'};
  const auto mid = a.counters();
  Batch r = a.submit(TransferOp::read, local, pl, two, pr, o);
  ASSERT_TRUE(lab::waited(r, 10s));
  ASSERT_EQ(r.failed(), 0u) << r.describe_failures();
  EXPECT_EQ(a.counters().lists_posted, mid.lists_posted);
  for (std::uint32_t k = 0; k < 16; ++k) {
    const std::uint32_t j = 15 - k;
    const auto* from = static_cast<std::uint8_t*>((j % 2 == 0 ? b : c).buf.addr) + j * kBlock;
    ASSERT_TRUE(same(static_cast<std::uint8_t*>(buf.addr) + (48 + k) * kBlock, from, kBlock)) << k;
  }
  EXPECT_EQ(r.telemetry().bytes, 16 * kBlock);
  for (Target* to : {&b, &c}) EXPECT_TRUE(next_note(to->engine, 10s).has_value());
  // Blocks as long as the slice threshold go the lists' way whole while the peer has one rail
  // (nothing to slice over).
  const std::uint64_t big = EngineConfig{}.rails.slice_threshold;
  ASSERT_GT(big, 0u);
  const Buffer large = a.allocate_memory(2 * big);
  fill(large.addr, large.length, 91);
  const rdmakit::DescriptorList bl = a.prepare_local(std::vector<rdmakit::LocalDescriptor>{{large, 0, big}, {large, big, big}});
  const rdmakit::DescriptorList br =
      a.prepare_remote(std::vector<rdmakit::RemoteDescriptor>{{sc, 0, big}, {sc, c.buf.length - big, big}});
  const auto whole = a.counters();
  Batch lw = a.submit(TransferOp::write, bl, std::vector<std::uint32_t>{1, 0}, br, std::vector<std::uint32_t>{0, 1});
  ASSERT_TRUE(lab::waited(lw, 10s));
  ASSERT_EQ(lw.failed(), 0u) << lw.describe_failures();
  EXPECT_TRUE(same(c.buf.addr, static_cast<std::uint8_t*>(large.addr) + big, big));
  EXPECT_TRUE(same(static_cast<std::uint8_t*>(c.buf.addr) + c.buf.length - big, large.addr, big));
  EXPECT_EQ(a.counters().lists_posted - whole.lists_posted, 2u);
}

// Batches of descriptor lists submitted without waiting, each longer than one chain and than the
// send queue, from two threads, on an engine with two workers and two peers: every position goes
// the lists' way (behind the backlog, as completions make room), every byte arrives, nothing is
// left in flight.
TEST(Serving, DescriptorListsPipelinedBatchesAllGoTheListsWay) {
  constexpr std::uint64_t kBlock = 64;
  constexpr std::uint32_t kDescs = 4096, kBatches = 6, kPerBatch = 700;
  Target b("b", kDescs * kBlock), c("c", kDescs * kBlock);
  EngineConfig ca = config("a");
  ca.workers = 2;
  Engine a(ca);
  ASSERT_EQ(lab::link_to(a, "b", b.engine), "");
  ASSERT_EQ(lab::link_to(a, "c", c.engine), "");
  const Buffer buf = a.allocate_memory(kDescs * kBlock);
  fill(buf.addr, buf.length, 5);
  std::vector<rdmakit::LocalDescriptor> ld;
  for (std::uint64_t i = 0; i < kDescs; ++i) ld.push_back({buf, i * kBlock, kBlock});
  const rdmakit::DescriptorList local = a.prepare_local(ld);
  const auto before = a.counters();
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (Target* to : {&b, &c}) {
    threads.emplace_back([&, to] {
      const std::string name = to == &b ? "b" : "c";
      std::vector<rdmakit::RemoteDescriptor> rd;
      for (std::uint64_t i = 0; i < kDescs; ++i) rd.push_back({a.segment(name, "kv"), i * kBlock, kBlock});
      const rdmakit::DescriptorList remote = a.prepare_remote(rd);
      std::vector<Batch> inflight;
      for (std::uint32_t k = 0; k < kBatches; ++k) {
        std::vector<std::uint32_t> idx(kPerBatch);
        for (std::uint32_t p = 0; p < kPerBatch; ++p) idx[p] = (k * kPerBatch + p) % kDescs;
        inflight.push_back(a.submit(TransferOp::write, local, idx, remote, idx));
      }
      for (Batch& x : inflight) {
        if (!x.wait(30s) || x.failed() != 0) ++bad;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(bad.load(), 0);
  EXPECT_TRUE(same(b.buf.addr, buf.addr, buf.length));
  EXPECT_TRUE(same(c.buf.addr, buf.addr, buf.length));
  const auto after = a.counters();
  EXPECT_EQ(after.lists_posted - before.lists_posted, 2u * kBatches * kPerBatch) << "positions took the long way";
  EXPECT_EQ(after.transfers_failed, before.transfers_failed);
}
