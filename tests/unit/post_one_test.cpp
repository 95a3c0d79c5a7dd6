// SPDX-License-Identifier: Apache-2.0
// The one-request paths (post_write & co., post(prepared), poll of one) against the fake provider:
// what their inline cases remember between calls (the caller's region checked last, the opcode's
// WR, a prepared request's fast generation, the caller's completion entry) never lets a request
// through that the full checks would refuse, and never leaks into the next request. What a real
// device does with them is tested in the lab (tests/rxe/datapath_test.cpp).
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "datapath_rig.hpp"

namespace {

using namespace rdmakit::test;
using rdmakit::PostStatus;
using rdmakit::PreparedRequest;

PostStatus write(Rig& r, const LocalSlice& src, const RemoteRegion& dst, std::uint64_t offset, std::uint64_t id) {
  return r.dp.post_one<Opcode::write>(src, dst, offset, 0, 0, 0, id).status;
}

PostStatus read(Rig& r, const LocalSlice& dst, const RemoteRegion& src, std::uint64_t offset, std::uint64_t id) {
  return r.dp.post_one<Opcode::read>(dst, src, offset, 0, 0, 0, id).status;
}

// Completes everything in flight and polls one completion at a time (the one-completion poll).
std::vector<Completion> complete_all(Rig& r) {
  r.v.complete(r.qps[0], r.v.held(r.qps[0]));
  std::vector<Completion> out;
  Completion c;
  while (r.dp.poll({&c, 1}) == 1) out.push_back(c);
  return out;
}

TEST(PostOne, TheRegionCheckedLastLetsNoOtherRegionThrough) {
  Rig r;
  const LocalSlice src = r.slice(0, 64);
  ASSERT_EQ(write(r, src, r.peer, 0, 1), PostStatus::ok);  // checked in full, then remembered
  ASSERT_EQ(write(r, src, r.peer, 4096, 2), PostStatus::ok);
  // The same address and key, claiming more than was advertised: the request past the end is
  // refused, although its region starts where the remembered one does.
  RemoteRegion longer = r.peer;
  longer.length += 4096;
  EXPECT_EQ(write(r, src, longer, r.peer.length, 3), PostStatus::not_advertised);
  // Another key over the same range.
  RemoteRegion other_key = r.peer;
  other_key.rkey ^= 1;
  EXPECT_EQ(write(r, src, other_key, 0, 4), PostStatus::not_advertised);
  // Bounds are still the caller's region's.
  EXPECT_EQ(write(r, src, r.peer, r.peer.length - 8, 5), PostStatus::out_of_bounds);
  EXPECT_EQ(write(r, src, r.peer, ~std::uint64_t{0}, 6), PostStatus::out_of_bounds);
  // A region whose access the remembered one had is still checked for this operation's.
  r.dp.set_remote({RemoteRegion{r.peer.addr, r.peer.length, r.peer.rkey, Access::remote_write}}, true);
  RemoteRegion write_only{r.peer.addr, r.peer.length, r.peer.rkey, Access::remote_write};
  ASSERT_EQ(write(r, src, write_only, 0, 7), PostStatus::ok);
  EXPECT_EQ(read(r, r.slice(0, 64), write_only, 0, 8), PostStatus::no_access);
  // The peer advertises a shorter region: the caller's (old) region is no longer inside one, so
  // every request to it is checked in full, and only those inside the new one go.
  r.dp.set_remote({RemoteRegion{r.peer.addr, r.peer.length / 2, r.peer.rkey, r.peer.access}}, true);
  EXPECT_EQ(write(r, src, r.peer, r.peer.length / 2, 9), PostStatus::not_advertised);
  EXPECT_EQ(write(r, src, r.peer, 0, 10), PostStatus::ok);
  EXPECT_EQ(write(r, src, r.peer, r.peer.length / 2, 11), PostStatus::not_advertised);

  const auto done = complete_all(r);
  std::vector<std::uint64_t> ids;
  for (const Completion& c : done) ids.push_back(c.wr_id);
  EXPECT_EQ(ids, (std::vector<std::uint64_t>{1, 2, 7, 10}));
}

TEST(PostOne, AnEmptyWriteHasNoSgeAndTheNextOneHasItsOwn) {
  Rig r;
  ASSERT_EQ(write(r, r.slice(0, 16), r.peer, 0, 1), PostStatus::ok);
  ASSERT_EQ(write(r, r.slice(0, 0), r.peer, 0, 2), PostStatus::ok);
  ASSERT_EQ(write(r, r.slice(32, 24), r.peer, 64, 3), PostStatus::ok);
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 3u);
  EXPECT_EQ(posted[0].sges.size(), 1u);
  EXPECT_EQ(posted[1].sges.size(), 0u);
  ASSERT_EQ(posted[2].sges.size(), 1u);
  EXPECT_EQ(posted[2].sges[0].length, 24u);
  EXPECT_EQ(posted[2].remote_addr, r.peer.addr + 64);
  for (const auto& w : posted) {
    EXPECT_EQ(w.opcode, IBV_WR_RDMA_WRITE);
    EXPECT_TRUE(w.signaled());
  }
  EXPECT_EQ(complete_all(r).size(), 3u);
}

TEST(PostOne, EachOpcodeKeepsItsOwnRequestAndAWriteWithImmediateItsValue) {
  Rig r;
  const LocalSlice word = r.slice(0, 8);
  ASSERT_TRUE(r.dp.post_one<Opcode::write_with_imm>(word, r.peer, 0, 0x1234, 0, 0, 1).ok());
  ASSERT_TRUE(r.dp.post_one<Opcode::fetch_add>(word, r.peer, 8, 0, 5, 0, 2).ok());
  ASSERT_TRUE(write(r, word, r.peer, 16, 3) == PostStatus::ok);
  ASSERT_TRUE(r.dp.post_one<Opcode::compare_swap>(word, r.peer, 24, 0, 7, 9, 4).ok());
  ASSERT_TRUE(r.dp.post_one<Opcode::send>(word, {}, 0, 0, 0, 0, 5).ok());
  const auto& posted = r.v.posted(r.qps[0]);
  ASSERT_EQ(posted.size(), 5u);
  EXPECT_EQ(posted[0].opcode, IBV_WR_RDMA_WRITE_WITH_IMM);
  EXPECT_EQ(posted[1].opcode, IBV_WR_ATOMIC_FETCH_AND_ADD);
  EXPECT_EQ(posted[2].opcode, IBV_WR_RDMA_WRITE);
  EXPECT_EQ(posted[3].opcode, IBV_WR_ATOMIC_CMP_AND_SWP);
  EXPECT_EQ(posted[4].opcode, IBV_WR_SEND);
  EXPECT_EQ(posted[0].imm_data, htobe32(0x1234));
  EXPECT_EQ(posted[1].compare_add, 5u);
  EXPECT_EQ(posted[1].remote_addr, r.peer.addr + 8);
  EXPECT_EQ(posted[2].remote_addr, r.peer.addr + 16);
  EXPECT_EQ(posted[3].compare_add, 7u);
  EXPECT_EQ(posted[3].swap, 9u);
  EXPECT_EQ(posted[3].remote_addr, r.peer.addr + 24);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(posted[i].rkey, r.peer.rkey);
  const auto done = complete_all(r);
  ASSERT_EQ(done.size(), 5u);
  const Opcode want[] = {Opcode::write_with_imm, Opcode::fetch_add, Opcode::write, Opcode::compare_swap, Opcode::send};
  for (std::size_t i = 0; i < done.size(); ++i) {
    EXPECT_EQ(done[i].wr_id, i + 1);
    EXPECT_EQ(done[i].opcode, want[i]);
    EXPECT_FALSE(done[i].has_imm);  // a send queue's completion carries none
  }
}

TEST(PostOne, NotReadyAndBrokenAreNamedBeforeAnythingElse) {
  Rig r;
  ASSERT_EQ(write(r, r.slice(0, 8), r.peer, 0, 1), PostStatus::ok);
  r.dp.break_connection("test", rdmakit::detail::BreakCause::peer);
  EXPECT_EQ(write(r, r.slice(0, 8), r.peer, 0, 2), PostStatus::not_ready);
  RemoteRegion nowhere{1, 8, 1, Access::remote_write};
  EXPECT_EQ(write(r, r.slice(0, 8), nowhere, 0, 3), PostStatus::not_ready);
  EXPECT_EQ(r.dp.post_one<Opcode::send>(r.slice(0, 8), {}, 0, 0, 0, 0, 4).status, PostStatus::not_ready);
}

TEST(PostOne, APreparedRequestForAnyQpAndAReleasedOneTakeTheWayAside) {
  Rig r(Options{.lanes = 2});
  const LocalSlice src = r.slice(0, 8);
  WorkRequest w;
  w.opcode = Opcode::write;
  w.local = {&src, 1};
  w.remote = r.peer;
  PreparedRequest any;
  ASSERT_TRUE(r.dp.prepare(w, any).ok());
  w.opcode = Opcode::send;
  PreparedRequest first;
  ASSERT_TRUE(r.dp.prepare(w, first).ok());
  for (std::uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(r.dp.post_prepared(any, i).ok());
  ASSERT_TRUE(r.dp.post_prepared(first, 9).ok());
  EXPECT_EQ(r.v.posted(r.qps[0]).size() + r.v.posted(r.qps[1]).size(), 5u);
  EXPECT_EQ(r.v.posted(r.qps[1]).size(), 2u);  // round robin: the writes go to both
  r.dp.release(any);
  EXPECT_EQ(r.dp.post_prepared(any, 10).status, PostStatus::stale);
  // A handle that names an entry in use again, with the generation it had before.
  PreparedRequest again;
  ASSERT_TRUE(r.dp.prepare(w, again).ok());
  EXPECT_EQ(again.index, any.index);
  EXPECT_EQ(r.dp.post_prepared(any, 11).status, PostStatus::stale);
  EXPECT_EQ(r.dp.post_prepared(PreparedRequest{}, 12).status, PostStatus::stale);
  EXPECT_EQ(r.dp.post_prepared(PreparedRequest{again.index, again.generation + 1}, 13).status, PostStatus::stale);
  r.dp.break_connection("test", rdmakit::detail::BreakCause::peer);
  EXPECT_EQ(r.dp.post_prepared(first, 14).status, PostStatus::not_ready);
  EXPECT_EQ(r.dp.post_prepared(PreparedRequest{}, 15).status, PostStatus::stale);
}

TEST(PostOne, APollOfOneReportsAFailureWithItsOpcodeAndNothingOfTheRequestBefore) {
  Rig r;
  ASSERT_EQ(write(r, r.slice(0, 8), r.peer, 0, 1), PostStatus::ok);
  ASSERT_EQ(read(r, r.slice(8, 8), r.peer, 8, 2), PostStatus::ok);
  r.v.complete(r.qps[0], 1);
  Completion c{};
  ASSERT_EQ(r.dp.poll({&c, 1}), 1u);
  EXPECT_EQ(c.wr_id, 1u);
  EXPECT_TRUE(c.ok());
  r.v.complete(r.qps[0], 1, IBV_WC_REM_ACCESS_ERR, 0x42);
  c = Completion{};
  ASSERT_EQ(r.dp.poll({&c, 1}), 1u);
  EXPECT_EQ(c.wr_id, 2u);
  EXPECT_EQ(c.opcode, Opcode::read);
  EXPECT_EQ(c.status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(c.vendor_err, 0x42u);
  EXPECT_EQ(r.dp.mode(), DataPath::Mode::broken);
  // The drain marker the break owes completes as bookkeeping: nothing more for the caller.
  r.v.complete(r.qps[0], r.v.held(r.qps[0]));
  EXPECT_EQ(r.dp.poll({&c, 1}), 0u);
  EXPECT_EQ(r.dp.outstanding(), 0u);
  // Through the extended interfaces when the rig has them: both posts (not the WRITE where they
  // cannot take its data inline: it goes inline by the classic call), and the polls of one.
  EXPECT_EQ(r.v.extended_posts(), extended() ? (by_sge_through_extended() ? 1u : 2u) : 0u);
  EXPECT_EQ(r.v.extended_polls(), extended() ? 2u : 0u);
}

}  // namespace
