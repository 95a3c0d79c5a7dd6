// SPDX-License-Identifier: Apache-2.0
// Prepared requests (Connection::prepare, DataPath::prepare/post_prepared) against the fake
// provider: what is checked once and what every post still checks, the handles' lifetime,
// selective signaling, and a provider's refusal. What a real device does with them is tested in
// the lab (tests/rxe/datapath_test.cpp).
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "datapath_rig.hpp"

namespace {

using namespace rdmakit::test;
using rdmakit::PostStatus;
using rdmakit::PreparedRequest;
using rdmakit::detail::BreakCause;

WorkRequest request(const LocalSlice& local, Opcode op, const RemoteRegion& remote, std::uint64_t offset,
                    bool signaled = true) {
  WorkRequest w;
  w.opcode = op;
  w.local = {&local, 1};
  w.remote = remote;
  w.remote_offset = offset;
  w.signaled = signaled;
  return w;
}

PreparedRequest prepare(Rig& r, const WorkRequest& w) {
  PreparedRequest p;
  const auto res = r.dp.prepare(w, p);
  EXPECT_TRUE(res.ok()) << res.describe();
  return p;
}

// The fake NIC completes the first n requests: a poll then retires them all and reports none
// (the signaled ones among them were the library's forced completions).
void expect_retired_quietly(Rig& r, std::size_t n) {
  r.v.complete(r.qps[0], n);
  Completion c[4];
  EXPECT_EQ(r.dp.poll(c), 0u);
  EXPECT_EQ(r.dp.outstanding(), 0u);
}

TEST(Prepared, APreparedRequestIsPostedAsBuiltWithEachPostsWrId) {
  Rig r;
  const LocalSlice src = r.slice(64, 8);
  const PreparedRequest p = prepare(r, request(src, Opcode::write, r.peer, 4096));
  ASSERT_TRUE(r.dp.post_prepared(p, 7).ok());
  ASSERT_TRUE(r.dp.post_prepared(p, 8).ok());
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 2u);
  for (const auto& w : posted) {
    EXPECT_EQ(w.opcode, IBV_WR_RDMA_WRITE);
    EXPECT_EQ(w.remote_addr, r.peer.addr + 4096);
    EXPECT_EQ(w.rkey, r.peer.rkey);
    ASSERT_EQ(w.sges.size(), 1u);
    EXPECT_EQ(w.sges[0].addr, reinterpret_cast<std::uint64_t>(src.addr()));
    EXPECT_EQ(w.sges[0].length, 8u);
    EXPECT_TRUE(w.signaled());
    if (by_sge_through_extended()) {
      // A provider whose extended interface loses inline data (rxe): by the SGE, its lkey set.
      EXPECT_EQ(w.flags & IBV_SEND_INLINE, 0u);
      EXPECT_EQ(w.sges[0].lkey, src.lkey());
    } else {
      EXPECT_NE(w.flags & IBV_SEND_INLINE, 0u);  // 8 bytes fit in max_inline (64)
    }
  }
  EXPECT_EQ(r.v.extended_posts(), extended() ? 2u : 0u);
  EXPECT_NE(posted[0].wr_id, posted[1].wr_id);  // the ring's sequence numbers, not the caller's
  r.v.complete(r.qps[0], 2);
  Completion c[4];
  ASSERT_EQ(r.dp.poll(c), 2u);
  EXPECT_EQ(c[0].wr_id, 7u);
  EXPECT_EQ(c[1].wr_id, 8u);
  EXPECT_EQ(c[1].opcode, Opcode::write);
  EXPECT_EQ(r.dp.outstanding(), 0u);
}

// prepare() refuses what a post would refuse, and keeps nothing of a refused request.
TEST(Prepared, PrepareRefusesWhatAPostWouldRefuse) {
  Rig r({.lanes = 2});
  const LocalSlice src = r.slice(0, 8);
  const LocalSlice big = r.slice(0, 4 * 4096);  // the rig's striping threshold
  // The access that counts is the advertised one: the peer advertises a second, read-only region.
  const RemoteRegion read_only{0x9000'0000, 4096, 0x77, Access::remote_read};
  r.dp.set_remote({r.peer, read_only}, true);
  const RemoteRegion forged{r.peer.addr, r.peer.length, r.peer.rkey + 1, r.peer.access};
  const MemoryRegion ro = region(0x200000, 4096, Access::none);  // the NIC may not write it
  const LocalSlice ro_slice = ro.local().subslice(0, 8);
  PreparedRequest p;
  EXPECT_EQ(r.dp.prepare(request(src, Opcode::write, r.peer, r.peer.length - 4), p).status,
            PostStatus::out_of_bounds);
  EXPECT_EQ(r.dp.prepare(request(src, Opcode::write, read_only, 0), p).status, PostStatus::no_access);
  EXPECT_EQ(r.dp.prepare(request(src, Opcode::write, forged, 0), p).status, PostStatus::not_advertised);
  EXPECT_EQ(r.dp.prepare(request(ro_slice, Opcode::read, r.peer, 0), p).status, PostStatus::no_access);
  EXPECT_EQ(r.dp.prepare(request(src, Opcode::fetch_add, r.peer, 4), p).status, PostStatus::misaligned);
  EXPECT_EQ(r.dp.prepare(request(big, Opcode::write, r.peer, 0), p).status, PostStatus::too_large);
  EXPECT_EQ(r.dp.prepare(request(src, Opcode::recv, r.peer, 0), p).status, PostStatus::unsupported);
  const LocalSlice five[] = {src, src, src, src, src};  // the rig grants 4 SGEs
  WorkRequest many = request(src, Opcode::write, r.peer, 0);
  many.local = five;
  EXPECT_EQ(r.dp.prepare(many, p).status, PostStatus::too_many_sges);
  r.dp.break_connection("gone", BreakCause::peer);
  EXPECT_EQ(r.dp.prepare(request(src, Opcode::write, r.peer, 0), p).status, PostStatus::not_ready);
}

// A handle is refused once released, once its entry holds another request, and once the
// peer's regions changed; copies of it too.
TEST(Prepared, ReleasedOrOutdatedHandlesAreStale) {
  Rig r;
  const LocalSlice src = r.slice(0, 8);
  const PreparedRequest a = prepare(r, request(src, Opcode::write, r.peer, 0));
  const PreparedRequest copy = a;
  r.dp.release(a);
  EXPECT_EQ(r.dp.post_prepared(copy, 1).status, PostStatus::stale);
  const PreparedRequest b = prepare(r, request(src, Opcode::write, r.peer, 8));
  EXPECT_EQ(b.index, a.index);  // the entry is reused, under a new generation
  EXPECT_EQ(r.dp.post_prepared(a, 1).status, PostStatus::stale);
  EXPECT_TRUE(r.dp.post_prepared(b, 2).ok());
  r.dp.release(a);  // releasing a stale handle leaves the live one alone
  EXPECT_TRUE(r.dp.post_prepared(b, 3).ok());
  EXPECT_EQ(r.dp.post_prepared(PreparedRequest{}, 4).status, PostStatus::stale);
  EXPECT_EQ(r.dp.post_prepared(PreparedRequest{99, 0}, 4).status, PostStatus::stale);
  r.dp.set_remote({r.peer}, true);  // checked against the old regions: no longer valid
  EXPECT_EQ(r.dp.post_prepared(b, 5).status, PostStatus::stale);
  EXPECT_EQ(r.v.posted(r.qps[0]).size(), 2u);
}

// What can change after prepare() is still checked on every post: the state and the room.
TEST(Prepared, EveryPostStillChecksTheStateAndTheRoom) {
  Rig r({.depth = 4});
  const LocalSlice src = r.slice(0, 8);
  const PreparedRequest p = prepare(r, request(src, Opcode::write, r.peer, 0));
  for (std::uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(r.dp.post_prepared(p, i).ok());
  EXPECT_EQ(r.dp.post_prepared(p, 4).status, PostStatus::queue_full);
  EXPECT_EQ(r.dp.outstanding(), 4u);
  r.dp.break_connection("gone", BreakCause::peer);
  EXPECT_EQ(r.dp.post_prepared(p, 5).status, PostStatus::not_ready);
}

// Unsignaled prepared requests follow the library's rule: signaled at least every half queue,
// and those forced completions are bookkeeping, not news.
TEST(Prepared, UnsignaledOnesAreSignaledEveryHalfQueue) {
  Rig r({.depth = 8});
  const LocalSlice src = r.slice(0, 8);
  const PreparedRequest p = prepare(r, request(src, Opcode::write, r.peer, 0, false));
  for (std::uint64_t i = 0; i < 8; ++i) ASSERT_TRUE(r.dp.post_prepared(p, i).ok());
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 8u);
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(posted[i].signaled(), i % 4 == 3) << i;
  expect_retired_quietly(r, 8);
}

// A post the provider refuses leaves the queue as it was, and the next request is signaled
// (the run of unsignaled ones before it is no longer known).
TEST(Prepared, AProviderRefusalLeavesNothingInFlight) {
  Rig r({.depth = 8});
  const LocalSlice src = r.slice(0, 8);
  const PreparedRequest quiet = prepare(r, request(src, Opcode::write, r.peer, 0, false));
  ASSERT_TRUE(r.dp.post_prepared(quiet, 1).ok());
  r.v.fail_post_at(0);
  const auto res = r.dp.post_prepared(quiet, 2);
  EXPECT_EQ(res.status, PostStatus::failed);
  EXPECT_NE(res.sys_errno, 0);
  EXPECT_EQ(r.dp.outstanding(), 1u);
  ASSERT_TRUE(r.dp.post_prepared(quiet, 3).ok());
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 2u);
  EXPECT_FALSE(posted[0].signaled());
  EXPECT_TRUE(posted[1].signaled());
  expect_retired_quietly(r, 2);
}

// With several QPs a prepared WRITE or READ goes round robin like post_write's; a SEND stays
// on the first QP (ordered with the receives the peer matches it to).
TEST(Prepared, WritesSpreadOverTheQpsAndSendsStayOnTheFirst) {
  Rig r({.lanes = 2});
  const LocalSlice src = r.slice(0, 8);
  const PreparedRequest w = prepare(r, request(src, Opcode::write, r.peer, 0));
  const PreparedRequest s = prepare(r, request(src, Opcode::send, {}, 0));
  for (std::uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(r.dp.post_prepared(w, i).ok());
  ASSERT_TRUE(r.dp.post_prepared(s, 9).ok());
  EXPECT_EQ(r.v.posted(r.qps[0]).size(), 3u);
  EXPECT_EQ(r.v.posted(r.qps[1]).size(), 2u);
  EXPECT_EQ(r.v.posted(r.qps[0]).back().opcode, IBV_WR_SEND);
}

}  // namespace
