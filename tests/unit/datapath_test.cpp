// SPDX-License-Identifier: Apache-2.0
// The data path's bookkeeping against the fake provider (fake_verbs.hpp): selective signaling,
// segmented requests and partial posts, the one break and one drain routine, settle before
// close, and the sleep on the completion channel. Deterministic and without a VM; what a real
// device does is tested in the lab (tests/rxe).
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "datapath/datapath.hpp"
#include "datapath/router.hpp"
#include "datapath_rig.hpp"
#include "fake_verbs.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"

namespace {

using namespace rdmakit::test;  // the rig, and the names it uses
using rdmakit::PostStatus;
using rdmakit::detail::BreakCause;

TEST(DataPathFake, UnsignaledRequestsRetireWithTheNextSignaledCompletion) {
  Rig r;
  const WorkRequest batch[] = {r.write(8, 1, false), r.write(8, 2, false), r.write(8, 3, true)};
  ASSERT_TRUE(r.dp.post_batch(batch).ok());
  EXPECT_EQ(r.dp.outstanding(), 3u);
  r.v.complete(r.qps[0], 3);
  EXPECT_EQ(r.v.cq_entries(r.scq), 1u);  // only the signaled one left a completion
  Completion c[4];
  ASSERT_EQ(r.dp.poll(c), 1u);
  EXPECT_EQ(c[0].wr_id, 3u);
  EXPECT_EQ(r.dp.outstanding(), 0u);  // and it retired the two before it
}

// The engine's path: a chain built in place, one doorbell, its last request signaled and news,
// every refusal leaving nothing behind, the queue's room respected.
TEST(DataPathFake, AChainBuiltInPlaceGoesInOneDoorbell) {
  Rig r({.depth = 8});
  rdmakit::detail::Lane& lane = r.dp.lane(0);
  ASSERT_EQ(r.dp.begin_chain(lane, 16), 8u);
  const std::uint32_t lkey = r.mem.local().lkey();
  const auto base = reinterpret_cast<std::uint64_t>(r.mem.local().addr());
  for (std::uint64_t i = 0; i < 3; ++i) {
    ASSERT_EQ((r.dp.chain_add<Opcode::write>(base + 8 * i, 8, lkey, true, r.peer, 8 * i, 0, 0, 100 + i)),
              PostStatus::ok);
  }
  // Refused, and nothing appended: out of the region, an access it lacks, misaligned atomics, a
  // READ into memory the NIC may not write.
  const RemoteRegion read_only{r.peer.addr, r.peer.length, r.peer.rkey, Access::remote_read};
  EXPECT_EQ((r.dp.chain_add<Opcode::write>(base, 16, lkey, true, r.peer, r.peer.length - 8, 0, 0, 7)),
            PostStatus::out_of_bounds);
  EXPECT_EQ((r.dp.chain_add<Opcode::write>(base, 8, lkey, true, read_only, 0, 0, 0, 7)), PostStatus::no_access);
  EXPECT_EQ((r.dp.chain_add<Opcode::fetch_add>(base, 8, lkey, true, r.peer, 4, 1, 0, 7)),
            PostStatus::misaligned);
  EXPECT_EQ((r.dp.chain_add<Opcode::read>(base, 8, lkey, false, r.peer, 0, 0, 0, 7)), PostStatus::no_access);
  EXPECT_EQ(r.dp.chain_size(), 3u);
  EXPECT_EQ(r.dp.outstanding(), 0u);  // nothing is in flight before the post
  ASSERT_TRUE(r.dp.post_chain_built().ok());
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(posted[i].remote_addr, r.peer.addr + 8 * i);
    EXPECT_EQ(posted[i].rkey, r.peer.rkey);
    EXPECT_EQ(posted[i].signaled(), i == 2) << i;
  }
  EXPECT_EQ(r.dp.outstanding(), 3u);
  EXPECT_EQ(r.dp.begin_chain(lane, 16), 5u);  // the room left
  (void)r.dp.post_chain_built();           // an empty chain posts nothing
  EXPECT_EQ(r.v.posted(r.qps[0]).size(), 3u);
  r.v.complete(r.qps[0], 3);
  Completion c[4];
  ASSERT_EQ(r.dp.poll(c), 1u);
  EXPECT_EQ(c[0].wr_id, 102u);  // the last one's completion retired all three
  EXPECT_EQ(r.dp.outstanding(), 0u);
  // The ring keeps the retired slots for a caller that walks them (the engine ends the
  // transfers posted before a completion from them).
  EXPECT_EQ(lane.sq.head(), 3u);
  EXPECT_EQ(lane.sq.at(0).wr_id, 100u);
  EXPECT_EQ(lane.sq.at(1).kind, rdmakit::detail::WrRing::silent);
}

TEST(DataPathFake, AChainTheProviderRefusesPartWayCountsWhatWent) {
  Rig r({.depth = 8});
  rdmakit::detail::Lane& lane = r.dp.lane(0);
  ASSERT_EQ(r.dp.begin_chain(lane, 16), 8u);
  const auto base = reinterpret_cast<std::uint64_t>(r.mem.local().addr());
  for (std::uint64_t i = 0; i < 4; ++i) {
    ASSERT_EQ((r.dp.chain_add<Opcode::write>(base, 8, r.mem.local().lkey(), true, r.peer, 0, 0, 0, i)),
              PostStatus::ok);
  }
  r.v.fail_post_at(2);
  const auto res = r.dp.post_chain_built();
  EXPECT_EQ(res.status, PostStatus::failed);
  EXPECT_EQ(res.index, 2u);
  EXPECT_EQ(r.dp.outstanding(), 2u);  // exactly what the provider took
  // The two it refused are still staged past the newest (what the engine ends as failed).
  EXPECT_EQ(lane.sq.staged(0).wr_id, 2u);
  EXPECT_EQ(lane.sq.staged(1).wr_id, 3u);
}

TEST(DataPathFake, AChainIsRefusedWhenTheDataPathIsNotReady) {
  Rig r;
  r.dp.break_connection("gone", BreakCause::peer);
  EXPECT_EQ(r.dp.begin_chain(r.dp.lane(0), 16), 0u);
}

TEST(DataPathFake, TheLibrarySignalsAtLeastEveryHalfQueue) {
  Rig r({.depth = 8});
  std::vector<WorkRequest> batch;
  for (std::uint64_t i = 0; i < 8; ++i) batch.push_back(r.write(8, i, false));
  ASSERT_TRUE(r.dp.post_batch(batch).ok());
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(posted[i].signaled(), i % 4 == 3) << i;
  r.v.complete(r.qps[0], 8);
  Completion c[4];
  EXPECT_EQ(r.dp.poll(c), 0u);  // forced completions are bookkeeping, not news
  EXPECT_EQ(r.dp.outstanding(), 0u);
}

// Defect: after a break, trailing unsignaled requests that had already succeeded left no
// completion, so outstanding() never reached zero and wait() never said `closed`.
TEST(DataPathFake, BreakAfterUnsignaledSuccessesStillReachesClosed) {
  Rig r;
  const WorkRequest batch[] = {r.write(8, 1, false), r.write(8, 2, false), r.write(8, 3, false)};
  ASSERT_TRUE(r.dp.post_batch(batch).ok());
  r.v.complete(r.qps[0], 3);  // all done, none signaled: no completion at all
  ASSERT_EQ(r.v.cq_entries(r.scq), 0u);
  r.dp.break_connection("the peer is gone", BreakCause::peer);
  EXPECT_TRUE(r.v.in_error(r.qps[0]));
  EXPECT_EQ(r.dp.post_batch(batch).status, PostStatus::not_ready);  // posts after a break
  EXPECT_EQ(r.dp.wait(1s, r.hk).status, WaitStatus::peer_lost);     // reported once
  EXPECT_EQ(r.dp.wait(1s, r.hk).status, WaitStatus::closed);
  EXPECT_EQ(r.dp.outstanding(), 0u);
  // The drain marker: a signaled request posted after the QP went to ERR.
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 4u);
  EXPECT_TRUE(posted.back().signaled());
  EXPECT_EQ(posted.back().num_sge, 0);
  EXPECT_EQ(r.dp.failure(), "the peer is gone");
}

// Defect (the same, with completion events): wait() spun to its deadline instead of sleeping.
TEST(DataPathFake, BreakInEventModeReachesClosedWithoutWaitingOutTheDeadline) {
  Rig r({.events = true});
  const WorkRequest batch[] = {r.write(8, 1, false), r.write(8, 2, false)};
  ASSERT_TRUE(r.dp.post_batch(batch).ok());
  r.v.complete(r.qps[0], 2);
  r.dp.break_connection("port down", BreakCause::device);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(r.dp.wait(5s, r.hk).status, WaitStatus::device_error);
  EXPECT_EQ(r.dp.wait(5s, r.hk).status, WaitStatus::closed);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
}

TEST(DataPathFake, BreakWithAFullQueuePostsTheMarkerOnceThereIsRoom) {
  Rig r({.depth = 5});  // forced signal every 2: u s u s u, the newest unsignaled
  std::vector<WorkRequest> batch;
  for (std::uint64_t i = 0; i < 5; ++i) batch.push_back(r.write(8, i, false));
  ASSERT_TRUE(r.dp.post_batch(batch).ok());
  r.v.complete(r.qps[0], 5);  // two forced completions wait in the CQ, unpolled
  r.dp.break_connection("gone", BreakCause::peer);
  EXPECT_EQ(r.v.posted(r.qps[0]).size(), 5u);  // no room for a marker yet
  WaitStatus last = WaitStatus::timeout;
  const auto delivered = r.drain_completions(&last);
  EXPECT_TRUE(delivered.empty());
  EXPECT_EQ(last, WaitStatus::peer_lost);
  EXPECT_EQ(r.dp.wait(1s, r.hk).status, WaitStatus::closed);
  EXPECT_EQ(r.v.posted(r.qps[0]).size(), 6u);  // the marker, once the forced ones were polled
}

// Defect: one QP's error left the others in RTS, so round robin half-succeeded.
TEST(DataPathFake, AnErrorOnOneQpBreaksEveryQp) {
  Rig r({.lanes = 3});
  for (std::uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 64), r.peer, 0, 0, 0, 0, i).ok());
  }
  for (ibv_qp* q : r.qps) ASSERT_EQ(r.v.held(q), 1u);  // one per QP
  r.v.complete(r.qps[1], 1, IBV_WC_REM_ACCESS_ERR);
  Completion c{};
  ASSERT_EQ(r.dp.poll({&c, 1}), 1u);
  EXPECT_EQ(c.status, IBV_WC_REM_ACCESS_ERR);
  for (ibv_qp* q : r.qps) EXPECT_TRUE(r.v.in_error(q));
  EXPECT_NE(r.dp.failure().find("QP 0x101 failed"), std::string::npos) << r.dp.failure();
  EXPECT_NE(r.dp.failure().find("remote access error"), std::string::npos) << r.dp.failure();
  EXPECT_EQ(r.dp.post_one<Opcode::write>(r.slice(0, 64), r.peer, 0, 0, 0, 0, 9).status, PostStatus::not_ready);
  WaitStatus last = WaitStatus::timeout;
  const auto rest = r.drain_completions(&last);
  ASSERT_EQ(rest.size(), 2u);  // the other QPs' requests, flushed
  for (const Completion& x : rest) EXPECT_EQ(x.status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(last, WaitStatus::closed);  // the error completion was the report: no peer_lost
}

// Defect: a partly posted chain freed its entry at once, and a request that reused it took on
// the old parts' errors.
TEST(DataPathFake, APartlyPostedSplitRequestLeaksNothingIntoTheNext) {
  Rig r({.depth = 8, .max_msg = 4096});  // forced signal every 4
  r.v.fail_post_at(4);                  // parts 0..3 taken, the counted 5th refused
  const auto first = r.dp.post_one<Opcode::write>(r.slice(0, 5 * 4096), r.peer, 0, 0, 0, 0, 1);
  EXPECT_EQ(first.status, PostStatus::failed);
  EXPECT_EQ(r.v.held(r.qps[0]), 4u);
  EXPECT_EQ(r.dp.outstanding(), 4u);
  // The next split request (two parts) takes the freed entry.
  ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 2 * 4096), r.peer, 0, 0, 0, 0, 2).ok());
  // The first chain's first part fails at the peer; the QP flushes the rest.
  r.v.complete(r.qps[0], 1, IBV_WC_REM_ACCESS_ERR);
  WaitStatus last = WaitStatus::timeout;
  const auto got = r.drain_completions(&last);
  ASSERT_EQ(got.size(), 1u);  // the failed post was already reported: one completion, for wr_id 2
  EXPECT_EQ(got[0].wr_id, 2u);
  EXPECT_EQ(got[0].status, IBV_WC_WR_FLUSH_ERR) << "inherited the earlier request's error";
  EXPECT_EQ(last, WaitStatus::closed);
  EXPECT_EQ(r.dp.outstanding(), 0u);
}

// Striped over two QPs, the second QP's chain refused after two parts: the caller hears of it
// once, from the post; the first QP's counted part and the second's stray parts complete later
// without a word, and the entry is free again afterwards.
TEST(DataPathFake, APartlyPostedStripedRequestIsReportedOnceByItsPost) {
  Rig r({.lanes = 2, .depth = 8, .max_msg = 4096});  // 8 parts: 4 per QP
  r.v.fail_post_at(2, 1);                              // QP 0's chain goes in, QP 1's fails at 2
  EXPECT_EQ(r.dp.post_one<Opcode::write>(r.slice(0, 8 * 4096), r.peer, 0, 0, 0, 0, 8).status,
            PostStatus::failed);
  EXPECT_EQ(r.v.held(r.qps[0]), 4u);
  EXPECT_EQ(r.v.held(r.qps[1]), 2u);
  r.v.complete(r.qps[1], 2);  // stray parts, unsignaled: no completion
  r.v.complete(r.qps[0], 4);  // the counted part: the entry is released, silently
  Completion c[4];
  EXPECT_EQ(r.dp.poll(c), 0u);
  EXPECT_EQ(r.dp.outstanding(), 2u);  // QP 1's strays, retired by its next signaled completion
  ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 8 * 4096), r.peer, 0, 0, 0, 0, 9).ok());
  r.v.complete(r.qps[0], 4);
  r.v.complete(r.qps[1], 4);
  ASSERT_EQ(r.dp.poll(c), 1u);
  EXPECT_EQ(c[0].wr_id, 9u);
  EXPECT_TRUE(c[0].ok());
  EXPECT_EQ(r.dp.outstanding(), 0u);
}

TEST(DataPathFake, ARequestNeedingMorePartsThanTheQueueHoldsIsTooLarge) {
  Rig r({.depth = 4, .max_msg = 4096});
  EXPECT_EQ(r.dp.post_one<Opcode::write>(r.slice(0, 5 * 4096), r.peer, 0, 0, 0, 0, 1).status,
            PostStatus::too_large);
  // One that fits an empty queue but not the room left waits for room instead.
  ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 64), r.peer, 0, 0, 0, 0, 2).ok());
  ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 64), r.peer, 0, 0, 0, 0, 3).ok());
  EXPECT_EQ(r.dp.post_one<Opcode::write>(r.slice(0, 3 * 4096), r.peer, 0, 0, 0, 0, 4).status,
            PostStatus::queue_full);
  // A batch larger than the queue can never be posted either.
  std::vector<WorkRequest> batch;
  for (std::uint64_t i = 0; i < 5; ++i) batch.push_back(r.write(8, i, true));
  EXPECT_EQ(r.dp.post_batch(batch).status, PostStatus::too_large);
}

TEST(DataPathFake, AReceiveBufferOver4GiBIsRefusedNotCut) {
  Rig r;
  const MemoryRegion huge = region(0x10'0000'0000, (std::size_t{5} << 30), Access::local_write);
  const LocalSlice all = huge.local();
  const auto res = r.dp.post_recvs({&all, 1}, 1);
  EXPECT_EQ(res.status, PostStatus::too_large);
  EXPECT_TRUE(r.v.recvs_posted(r.qps[0]).empty());
  // At exactly 4 GiB - 1 it fits an SGE.
  const MemoryRegion edge = region(0x10'0000'0000, 0xffffffffu, Access::local_write);
  const LocalSlice most = edge.local();
  ASSERT_TRUE(r.dp.post_recvs({&most, 1}, 2).ok());
  EXPECT_EQ(r.v.recvs_posted(r.qps[0]).back().sges.at(0).length, 0xffffffffu);
}

// Defect: after arming, the sleep polled one entry; when that was bookkeeping, the caller's
// completion behind it raised no event and wait() slept to its deadline.
TEST(DataPathFake, SleepPollsPastBookkeepingBeforeItSleeps) {
  Rig r({.depth = 4, .events = true});  // forced signal every 2
  const WorkRequest batch[] = {r.write(8, 1, false), r.write(8, 2, false)};  // u, forced s
  ASSERT_TRUE(r.dp.post_batch(batch).ok());
  ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 8), r.peer, 0, 0, 0, 0, 3).ok());
  // The NIC finishes all three between wait()'s last poll and its arming of the CQs: a
  // bookkeeping completion, then the caller's, and no event.
  r.v.on_arm = [&] { r.v.complete(r.qps[0], 3); };
  const auto t0 = std::chrono::steady_clock::now();
  const auto w = r.dp.wait(3s, r.hk);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_EQ(w.status, WaitStatus::completed);
  EXPECT_EQ(w.completion.wr_id, 3u);
  EXPECT_LT(took, 1s) << "slept although a completion was waiting";
  EXPECT_EQ(r.v.events(), 0);
}

TEST(DataPathFake, EventModeSleepsUntilACompletionArrives) {
  Rig r({.events = true});
  ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 8), r.peer, 0, 0, 0, 0, 5).ok());
  // Nothing completes: the wait sleeps (armed CQs) and times out.
  EXPECT_EQ(r.dp.wait(50ms, r.hk).status, WaitStatus::timeout);
  EXPECT_TRUE(r.v.armed(r.scq));
  r.v.complete(r.qps[0], 1);
  EXPECT_EQ(r.v.events(), 1);
  const auto w = r.dp.wait(1s, r.hk);
  ASSERT_EQ(w.status, WaitStatus::completed);
  EXPECT_EQ(w.completion.wr_id, 5u);
}

// Close, step 1: unsignaled work in flight is waited for (a zero-length signaled WRITE behind
// it shows when it is done), with the QP still in RTS; nothing is flushed.
TEST(DataPathFake, SettleWaitsForUnsignaledWorkBehindAZeroLengthMarker) {
  Rig r;
  const WorkRequest batch[] = {r.write(4096, 1, false), r.write(4096, 2, false), r.write(4096, 3, false)};
  ASSERT_TRUE(r.dp.post_batch(batch).ok());
  r.hk.on_tick = [&] {
    if (r.hk.ticks == 3) r.v.complete(r.qps[0], 4);  // the NIC gets there a little later
  };
  r.dp.settle(rdmakit::detail::deadline_in(2s), r.hk);
  EXPECT_EQ(r.dp.outstanding(), 0u);
  EXPECT_FALSE(r.v.in_error(r.qps[0]));
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 4u);
  EXPECT_EQ(posted[3].opcode, IBV_WR_RDMA_WRITE);
  EXPECT_EQ(posted[3].num_sge, 0);
  EXPECT_TRUE(posted[3].signaled());
  EXPECT_EQ(posted[3].rkey, r.peer.rkey);
  EXPECT_EQ(r.dp.unobservable(), 0u);
  EXPECT_EQ(r.dp.shut(rdmakit::detail::deadline_in(1s)), 0u);
}

TEST(DataPathFake, SettleStopsWhenThePeerGoesAndShutFlushesTheRest) {
  Rig r;
  ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 8), r.peer, 0, 0, 0, 0, 1).ok());
  const rdmakit::LocalSlice rx = r.slice(4096, 64);
  ASSERT_TRUE(r.dp.post_recvs({&rx, 1}, 9).ok());
  r.hk.on_tick = [&] { r.dp.break_connection("gone", BreakCause::peer); };
  const auto t0 = std::chrono::steady_clock::now();
  r.dp.settle(rdmakit::detail::deadline_in(5s), r.hk);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_EQ(r.dp.shut(rdmakit::detail::deadline_in(1s)), 0u);  // the write and the receive, flushed
  EXPECT_EQ(r.dp.outstanding(), 0u);
  EXPECT_EQ(r.dp.mode(), DataPath::Mode::closed);
}

TEST(DataPathFake, SettleCannotObserveSendsWithoutAnAdvertisedRegion) {
  Rig r;
  r.dp.set_remote({}, false);
  WorkRequest s;
  s.opcode = Opcode::send;
  const LocalSlice one = r.slice(0, 8);
  s.local = {&one, 1};
  s.signaled = false;
  ASSERT_TRUE(r.dp.post_batch({&s, 1}).ok());
  r.dp.settle(rdmakit::detail::deadline_in(2s), r.hk);
  EXPECT_EQ(r.dp.unobservable(), 1u);
  EXPECT_EQ(r.v.posted(r.qps[0]).size(), 1u);  // no marker: nothing to aim it at
  EXPECT_EQ(r.dp.shut(rdmakit::detail::deadline_in(1s)), 0u);
}

TEST(DataPathFake, ForgetQpsLeavesNothingOutstanding) {
  Rig r;
  ASSERT_TRUE(r.dp.post_one<Opcode::write>(r.slice(0, 8), r.peer, 0, 0, 0, 0, 1).ok());
  r.dp.forget_qps();
  EXPECT_EQ(r.dp.outstanding(), 0u);
  EXPECT_EQ(r.dp.post_one<Opcode::write>(r.slice(0, 8), r.peer, 0, 0, 0, 0, 2).status, PostStatus::not_ready);
  EXPECT_EQ(r.dp.wait(10ms, r.hk).status, WaitStatus::closed);
}

// --- shared CQs: many data paths on one CQ, each completion to its own bookkeeping ------------

// Two peer links on one worker's CQs, as the engine builds them.
struct SharedRig {
  SharedRig() {
    scq = v.cq();
    rcq = v.cq();
    send.init(scq, 8);
    recv.init(rcq, 8);
    for (std::uint32_t k = 0; k < 2; ++k) a_qps.push_back(v.qp(scq, rcq, 0x200 + k));
    b_qps.push_back(v.qp(scq, rcq, 0x300));
    for (auto [dp, qps] : {std::pair{&a, &a_qps}, std::pair{&b, &b_qps}}) {
      dp->init({8, 8, 4, 64, 1 << 20, 1 << 20}, *qps, scq, rcq, nullptr, v.ops());
      dp->route_through(send, recv);
      dp->set_remote({peer}, true);
      dp->start();
    }
  }
  // Polls until the CQ is empty; what each data path's caller gets.
  void poll() {
    while (send.poll([&](DataPath& d, const Completion& c) { (&d == &a ? got_a : got_b).push_back(c); }) > 0) {
    }
  }
  fake::Verbs v;
  ibv_cq* scq = nullptr;
  ibv_cq* rcq = nullptr;
  rdmakit::detail::CqRouter send, recv;
  std::vector<ibv_qp*> a_qps, b_qps;
  DataPath a, b;
  MemoryRegion mem = region(0x100000, 1 << 24, Access::local_write);
  RemoteRegion peer{0x7000'0000, 1 << 24, 0x99, Access::remote_read | Access::remote_write};
  std::vector<Completion> got_a, got_b;
};

TEST(SharedCq, EachDataPathGetsItsOwnCompletions) {
  SharedRig r;
  const LocalSlice s = r.mem.local().subslice(0, 64);
  for (std::uint64_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(r.a.post_one<Opcode::write>(s, r.peer, 0, 0, 0, 0, 100 + i).ok());  // round robin
    ASSERT_TRUE(r.b.post_one<Opcode::read>(s.subslice(0, 8), r.peer, 0, 0, 0, 0, 200 + i).ok());
  }
  EXPECT_EQ(r.send.attached(), 3u);
  EXPECT_EQ(r.recv.attached(), 2u);
  r.v.complete(r.b_qps[0], 4);
  r.v.complete(r.a_qps[1], 2);
  r.v.complete(r.a_qps[0], 2);
  r.poll();
  ASSERT_EQ(r.got_a.size(), 4u);
  ASSERT_EQ(r.got_b.size(), 4u);
  for (const Completion& c : r.got_a) {
    EXPECT_TRUE(c.ok());
    EXPECT_EQ(c.opcode, Opcode::write);
    EXPECT_GE(c.wr_id, 100u);
    EXPECT_LT(c.wr_id, 104u);
  }
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(r.got_b[i].wr_id, 200 + i);
    EXPECT_EQ(r.got_b[i].opcode, Opcode::read);
  }
  EXPECT_EQ(r.a.outstanding(), 0u);
  EXPECT_EQ(r.b.outstanding(), 0u);
}

// One link's error breaks that link (both its QPs, drain marker included) and nothing else.
TEST(SharedCq, AnErrorBreaksOnlyItsOwnDataPath) {
  SharedRig r;
  const LocalSlice s = r.mem.local().subslice(0, 64);
  const WorkRequest quiet_writes[] = {
      {Opcode::write, {&s, 1}, r.peer, 0, 0, 0, 0, 1, false},
      {Opcode::write, {&s, 1}, r.peer, 0, 0, 0, 0, 2, false},
  };
  ASSERT_TRUE(r.a.post_batch(quiet_writes).ok());  // one lane, unsignaled: needs a marker on a break
  ASSERT_TRUE(r.a.post_one<Opcode::write>(s, r.peer, 0, 0, 0, 0, 3).ok());  // the other lane
  ASSERT_TRUE(r.b.post_one<Opcode::write>(s, r.peer, 0, 0, 0, 0, 9).ok());
  ibv_qp* quiet_qp = r.v.held(r.a_qps[0]) == 2 ? r.a_qps[0] : r.a_qps[1];
  ibv_qp* loud_qp = quiet_qp == r.a_qps[0] ? r.a_qps[1] : r.a_qps[0];
  ASSERT_EQ(r.v.held(loud_qp), 1u);
  r.v.complete(quiet_qp, 2);  // the unsignaled writes succeed: no completion of their own
  r.v.complete(loud_qp, 1, IBV_WC_REM_ACCESS_ERR);
  r.poll();
  EXPECT_EQ(r.a.mode(), DataPath::Mode::broken);
  EXPECT_NE(r.a.failure().find(fmt::format("QP {:#x}", loud_qp->qp_num)), std::string::npos) << r.a.failure();
  ASSERT_EQ(r.got_a.size(), 1u);
  EXPECT_EQ(r.got_a[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(r.got_a[0].wr_id, 3u);
  // The marker the break owed on the quiet lane was posted by the router's poll, and its flush retires
  // the unsignaled writes.
  r.poll();
  EXPECT_EQ(r.a.outstanding(), 0u);
  EXPECT_EQ(r.b.mode(), DataPath::Mode::ready);
  EXPECT_FALSE(r.v.in_error(r.b_qps[0]));
  r.v.complete(r.b_qps[0], 1);
  r.poll();
  ASSERT_EQ(r.got_b.size(), 1u);
  EXPECT_TRUE(r.got_b[0].ok());
}

// A link that goes with a completion still in the CQ: the completion finds no route, and the
// tag it carried is the last to be reused.
TEST(SharedCq, AGoneQueuesLateCompletionReachesNobody) {
  SharedRig r;
  const LocalSlice s = r.mem.local().subslice(0, 64);
  ASSERT_TRUE(r.b.post_one<Opcode::write>(s, r.peer, 0, 0, 0, 0, 7).ok());
  const std::uint32_t old_tag = r.b.lanes()[0].id;
  r.v.complete(r.b_qps[0], 1);  // in the CQ, not yet polled
  r.b.forget_qps();
  EXPECT_EQ(r.send.attached(), 2u);
  DataPath c;
  std::vector<ibv_qp*> c_qps{r.v.qp(r.scq, r.rcq, 0x400)};
  c.init({8, 8, 4, 64, 1 << 20, 1 << 20}, c_qps, r.scq, r.rcq, nullptr, r.v.ops());
  c.route_through(r.send, r.recv);
  EXPECT_NE(c.lanes()[0].id, old_tag);
  r.poll();
  EXPECT_TRUE(r.got_a.empty());
  EXPECT_TRUE(r.got_b.empty());
  EXPECT_EQ(c.outstanding(), 0u);
}

TEST(SharedCq, AttachRefusesMoreQueuesThanTheRouterHolds) {
  fake::Verbs v;
  rdmakit::detail::CqRouter send, recv;
  ibv_cq* cq = v.cq();
  send.init(cq, 2);
  recv.init(cq, 8);
  DataPath d;
  std::vector<ibv_qp*> qps{v.qp(cq, cq, 1), v.qp(cq, cq, 2), v.qp(cq, cq, 3)};
  d.init({8, 8, 4, 64, 1 << 20, 1 << 20}, qps, cq, cq, nullptr, v.ops());
  EXPECT_THROW(d.route_through(send, recv), rdmakit::Error);
  EXPECT_EQ(send.attached(), 0u);  // what it had taken is given back
}

// A queue's sequence numbers outgrow the 48 bits a wr_id carries: the ring still finds each.
TEST(WrRing, RetiresAcrossTheWrIdsSequenceWrap) {
  rdmakit::detail::WrRing ring;
  ring.init(8, rdmakit::detail::kSeqMask - 2);
  for (std::uint64_t i = 0; i < 6; ++i) ring.push({i, Opcode::write, rdmakit::detail::WrRing::user, false});
  const std::uint64_t seq4 = rdmakit::detail::kSeqMask - 2 + 4;  // past 2^48
  const auto wr = rdmakit::detail::dp::wr_id(5, seq4);
  EXPECT_EQ(wr >> rdmakit::detail::kTagShift, 5u);
  const auto* slot = ring.retire(wr);
  ASSERT_NE(slot, nullptr);
  EXPECT_EQ(slot->wr_id, 4u);
  EXPECT_EQ(ring.count(), 1u);
  EXPECT_EQ(ring.retire(rdmakit::detail::dp::wr_id(5, seq4)), nullptr);  // stale: not in flight
}

}  // namespace
