// SPDX-License-Identifier: Apache-2.0
// Posting beyond the single-request fast path: batches, segmented (split or striped) requests
// and receives. Nothing here allocates, throws or logs: a refused post is a PostResult.
#include <algorithm>
#include <bit>
#include <cerrno>
#include <limits>
#include <type_traits>

#include "datapath/datapath.hpp"

namespace rdmakit::detail {

namespace {

// Calls f with the opcode as a compile-time constant, so the per-opcode code is generated once
// per opcode (the single-request calls name theirs statically and skip this switch).
template <typename F>
[[gnu::always_inline]] inline decltype(auto) with_opcode(Opcode op, F&& f) {
  switch (op) {
    case Opcode::write: return f(std::integral_constant<Opcode, Opcode::write>{});
    case Opcode::write_with_imm: return f(std::integral_constant<Opcode, Opcode::write_with_imm>{});
    case Opcode::read: return f(std::integral_constant<Opcode, Opcode::read>{});
    case Opcode::send: return f(std::integral_constant<Opcode, Opcode::send>{});
    case Opcode::fetch_add: return f(std::integral_constant<Opcode, Opcode::fetch_add>{});
    case Opcode::compare_swap: return f(std::integral_constant<Opcode, Opcode::compare_swap>{});
    case Opcode::recv: break;
  }
  return f(std::integral_constant<Opcode, Opcode::recv>{});
}

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }

constexpr std::uint64_t part_handle(std::uint32_t index, std::uint32_t generation) {
  return index | (std::uint64_t{generation} << 32);
}

}  // namespace

const RemoteRegion* DataPath::find_advertised(std::uint32_t rkey, std::uint64_t addr,
                                               std::uint64_t len) const noexcept {
  for (const RemoteRegion& a : remote_) {
    if (a.rkey == rkey && addr >= a.addr && a.contains(addr - a.addr, len)) {
      last_advertised_ = &a;
      return &a;
    }
  }
  return nullptr;
}

// The next QP for a WRITE or READ: round robin, passing over QPs whose queue is full.
Lane& DataPath::pick_lane() noexcept {
  const std::uint32_t n = lane_count_;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (++next_lane_ == n) next_lane_ = 0;
    if (lanes_[next_lane_].sq.free() > 0) break;
  }
  return lanes_[next_lane_];
}

PostCode DataPath::refused(Lane& lane, int rc) noexcept {
  lane.sq.unpush();
  lane.unsignaled_run = Lane::kRunUnknown;
  return post_code(PostStatus::failed, rc);
}

PostResult DataPath::post_gated(Opcode op, const LocalSlice& local, const RemoteRegion& remote,
                                std::uint64_t offset, std::uint32_t imm, std::uint64_t wr_id) noexcept {
  if (mode_ != Mode::ready) return {PostStatus::not_ready, 0};
  if (dp::spreads(op) || op == Opcode::write_with_imm) {
    return post_segmented(op, local, remote, offset, imm, wr_id);
  }
  return {PostStatus::too_large, 0};
}

PostResult DataPath::check(Opcode op, std::span<const LocalSlice> local, const RemoteRegion& remote,
                           std::uint64_t offset, std::uint64_t total) const noexcept {
  return with_opcode(op, [&](auto o) { return check<decltype(o)::value>(local, remote, offset, total); });
}

// A WRITE or READ of at least segment_min bytes: with several QPs, striped across all of them
// (QP k moves the k-th contiguous share), and each share split at max_msg_sz. RC keeps each QP's
// parts in order; the QPs finish in any order. Every QP's last part is signaled and counted; the
// caller gets one completion when all counted parts are in, with the first error any part had.
// A WRITE_WITH_IMM is only split, on the first QP, with the immediate on its last part, so the
// peer sees it after all the data. A SEND cannot be split: the receiver would see several
// messages.
PostResult DataPath::post_segmented(Opcode op, const LocalSlice& local, const RemoteRegion& remote,
                                    std::uint64_t offset, std::uint32_t imm,
                                    std::uint64_t wr_id) noexcept {
  const std::uint64_t total = local.length();
  if (PostResult r = check(op, {&local, 1}, remote, offset, total); !r.ok()) return r;
  const bool stripe = dp::spreads(op) && lane_count_ > 1;
  const std::uint64_t n = stripe ? lane_count_ : 1;
  // Each QP's share is a whole number of 4 KiB pages, so the parts of a page-aligned buffer
  // stay page-aligned.
  const std::uint64_t share = stripe ? ceil_div(ceil_div(total, n), 4096) * 4096 : total;
  const std::uint64_t chunk = limits_.max_msg_size;
  std::uint32_t used = 0;
  // Room on every QP first: a request that cannot be posted whole posts nothing. One that could
  // never fit, even into empty queues, is too large rather than waiting for room forever.
  bool full = false;
  for (std::uint64_t k = 0; k < n && k * share < total; ++k, ++used) {
    const std::uint64_t parts = ceil_div(std::min(share, total - k * share), chunk);
    if (parts > lanes_[k].sq.capacity() || parts > part_reqs_.size()) return {PostStatus::too_large, 0};
    if (parts > lanes_[k].sq.free()) full = true;
  }
  if (full || free_segmented_.empty()) return {PostStatus::queue_full, 0};
  const std::uint32_t index = free_segmented_.back();
  free_segmented_.pop_back();  // never frees: the vector keeps its capacity
  Segmented& seg = segmented_[index];
  seg = {wr_id, op, used, seg.generation, 0, 0, false};
  const std::uint64_t handle = part_handle(index, seg.generation);

  for (std::uint32_t k = 0; k < used; ++k) {
    const std::uint64_t begin = k * share;
    const std::uint64_t len = std::min(share, total - begin);
    const std::uint64_t parts = ceil_div(len, chunk);
    for (std::uint64_t j = 0; j < parts; ++j) {
      const bool last = j + 1 == parts;
      part_slices_[j] = local.subslice(begin + j * chunk, std::min(chunk, len - j * chunk));
      WorkRequest& w = part_reqs_[j];
      w = {};
      w.opcode = op == Opcode::write_with_imm && !last ? Opcode::write : op;
      w.local = {&part_slices_[j], 1};
      w.remote = remote;
      w.remote_offset = offset + begin + j * chunk;
      w.imm = imm;
      w.signaled = last;  // the counted part
    }
    if (const PostResult r = post_chain(lanes_[k], {part_reqs_.data(), parts}, true, handle); !r.ok()) {
      // The QPs before this one are on the wire with their counted parts: those completions are
      // retired without a word, and the caller learns of the failure from this result. Parts of
      // this QP's chain that the provider took are never counted; if one of them completes after
      // the entry is reused, its generation no longer matches and it is ignored.
      seg.silent = true;
      seg.pending = k;
      if (k == 0) release_segmented(index);
      return r;
    }
  }
  return {};
}

PostResult DataPath::post_batch(std::span<const WorkRequest> batch) noexcept {
  if (mode_ != Mode::ready) [[unlikely]] return {PostStatus::not_ready, 0};
  if (batch.empty()) return {};
  // A batch stays on one QP, chained. Only a batch of WRITEs and READs may go to any QP.
  Lane* lane = &lanes_[0];
  if (lane_count_ > 1 &&
      std::all_of(batch.begin(), batch.end(), [](const WorkRequest& w) { return dp::spreads(w.opcode); })) {
    lane = &pick_lane();
  }
  return post_chain(*lane, batch, false, 0);
}

// Each request is checked and written into the preallocated WR/SGE arrays; only when all passed
// is the chain handed to ibv_post_send, so a refused batch posts nothing. For the parts of a
// segmented request (`parts`), every slot holds `part_handle`, and a request's `signaled` marks
// the part its completion counts on.
PostResult DataPath::post_chain(Lane& lane, std::span<const WorkRequest> batch, bool parts,
                                std::uint64_t part_handle) noexcept {
  if (batch.size() > lane.sq.capacity()) [[unlikely]] return {PostStatus::too_large, 0};
  if (batch.size() > lane.sq.free()) [[unlikely]] return {PostStatus::queue_full, 0};
  const std::uint64_t seq0 = lane.sq.next_seq();
  std::uint32_t run = lane.unsignaled_run;
  ibv_sge* sge = send_sges_.data();
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const WorkRequest& w = batch[i];
    if (w.local.size() > limits_.max_sge) [[unlikely]] return {PostStatus::too_many_sges, 0, i};
    ibv_send_wr& v = send_wrs_[i];
    v.sg_list = sge;
    std::uint64_t total = 0;
    for (const LocalSlice& s : w.local) {
      *sge++ = dp::to_sge(s);
      total += s.length();
    }
    // Also what keeps every SGE within its 32 bits: max_msg_sz is a 32-bit value.
    if (total > limits_.max_msg_size) [[unlikely]] return {PostStatus::too_large, 0, i};
    // Signal when asked, and at least once every half queue: otherwise the queue could fill with
    // requests whose completion is never reported, and nothing could reclaim them. Half, not
    // all: the forced completion then arrives while the other half can still be posted.
    const bool signal = w.signaled || run + 1 >= forced_signal_interval_;
    run = signal ? 0 : run + 1;
    v.wr_id = lane.wr_id(seq0 + i);
    v.next = send_wrs_.data() + i + 1;
    // Zero-length SGEs are dropped: a 0-byte operation carries no SGE at all.
    v.num_sge = total == 0 ? 0 : static_cast<int>(w.local.size());
    const PostResult r = with_opcode(w.opcode, [&](auto o) -> PostResult {
      constexpr Opcode op = decltype(o)::value;
      if (PostResult c = check<op>(w.local, w.remote, w.remote_offset, total); !c.ok()) return c;
      // Inline: the CPU copies the payload, so the NIC needs no DMA read and no lkey.
      v.send_flags = (signal ? IBV_SEND_SIGNALED : 0) |
                     (dp::may_inline<op>(total, limits_.max_inline) ? IBV_SEND_INLINE : 0);
      dp::fill_wr<op>(v, w.remote, w.remote_offset, w.imm, w.compare_add, w.swap);
      return {};
    });
    if (!r.ok()) [[unlikely]] return {r.status, r.sys_errno, i};
  }
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const WorkRequest& w = batch[i];
    lane.sq.stage(static_cast<std::uint32_t>(i),
                  parts ? WrRing::Slot{part_handle, w.opcode, WrRing::part, w.signaled}
                        : WrRing::Slot{w.wr_id, w.opcode, w.signaled ? WrRing::user : WrRing::silent, false});
  }
  return post_staged(lane, static_cast<std::uint32_t>(batch.size()), run);
}

// The one posting tail of every chain: one doorbell, and the ring takes exactly what the
// provider took.
PostResult DataPath::post_staged(Lane& lane, std::uint32_t n, std::uint32_t run) noexcept {
  send_wrs_[n - 1].next = nullptr;
  return post_linked(lane, send_wrs_.data(), n, run);
}

PostResult DataPath::post_linked(Lane& lane, ibv_send_wr* wrs, std::uint32_t n, std::uint32_t run) noexcept {
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(lane.qp, wrs, &bad);
  if (rc == 0) [[likely]] {
    lane.unsignaled_run = run;
    lane.sq.commit(n);
    return {};
  }
  // The provider may have posted the requests before `bad`: account for exactly those.
  const std::size_t posted = bad != nullptr && bad >= wrs && bad < wrs + n ? static_cast<std::size_t>(bad - wrs) : 0;
  for (std::size_t i = 0; i < posted; ++i) {
    lane.unsignaled_run = (wrs[i].send_flags & IBV_SEND_SIGNALED) != 0 ? 0 : lane.unsignaled_run + 1;
  }
  lane.sq.commit(static_cast<std::uint32_t>(posted));
  return {PostStatus::failed, rc, posted};
}

PostResult DataPath::prepare(const WorkRequest& w, PreparedRequest& out) {
  if (mode_ != Mode::ready) return {PostStatus::not_ready, 0};
  if (w.opcode == Opcode::recv) return {PostStatus::unsupported, 0};
  if (w.local.size() > limits_.max_sge) return {PostStatus::too_many_sges, 0};
  std::uint64_t total = 0;
  for (const LocalSlice& s : w.local) total += s.length();
  // A request post_one would segment is several work requests: not one to prepare.
  if (total >= (dp::spreads(w.opcode) ? segment_min_spread_ : segment_min_ordered_)) {
    return {PostStatus::too_large, 0};
  }
  if (const PostResult r = check(w.opcode, w.local, w.remote, w.remote_offset, total); !r.ok()) return r;
  std::uint32_t index = 0;
  if (free_prepared_.empty()) {
    index = static_cast<std::uint32_t>(prepared_.size());
    prepared_.emplace_back();
    free_prepared_.reserve(prepared_.size());  // release() must not allocate
    prepared_count_ = index + 1;
    prepared_gate_ = prepared_count_;  // ready: prepare() refuses otherwise
  } else {
    index = free_prepared_.back();
    free_prepared_.pop_back();
  }
  Prepared& p = prepared_[index];
  p.sges.clear();
  for (const LocalSlice& s : w.local) p.sges.push_back(dp::to_sge(s));
  p.wr = ibv_send_wr{};
  p.wr.sg_list = p.sges.data();
  p.wr.num_sge = total == 0 ? 0 : static_cast<int>(p.sges.size());
  with_opcode(w.opcode, [&](auto o) {
    constexpr Opcode op = decltype(o)::value;
    p.flags = dp::may_inline<op>(total, limits_.max_inline) ? unsigned{IBV_SEND_INLINE} : 0u;
    dp::fill_wr<op>(p.wr, w.remote, w.remote_offset, w.imm, w.compare_add, w.swap);
  });
  p.slot = {0, w.opcode, w.signaled ? WrRing::user : WrRing::silent, false};
  p.wr.send_flags = p.flags | (w.signaled ? unsigned{IBV_SEND_SIGNALED} : 0u);
  p.any_lane = dp::spreads(w.opcode) && lane_count_ > 1;
  // Through the extended interface: WRITEs and READs of data (a zero-length one has no SGE to
  // set); inline data there only from one SGE (a list of inline pieces stays classic).
  const bool inline_data = (p.flags & IBV_SEND_INLINE) != 0;
  p.ext = ext_kind::kNone;
  if (extended() && (w.opcode == Opcode::write || w.opcode == Opcode::read) && p.wr.num_sge > 0 &&
      (!inline_data || !ext_inline_ || p.wr.num_sge == 1)) {
    const bool write = w.opcode == Opcode::write;
    p.ext = inline_data && ext_inline_ ? ext_kind::kWriteInline
            : p.wr.num_sge > 1         ? (write ? ext_kind::kWriteList : ext_kind::kReadList)
                                       : (write ? ext_kind::kWrite : ext_kind::kRead);
    p.ext_rkey = p.wr.wr.rdma.rkey;
    p.ext_raddr = p.wr.wr.rdma.remote_addr;
    p.ext_sge = p.sges[0];
  }
  p.in_use = true;
  p.fast_handle = p.any_lane ? Prepared::kNoFast : std::bit_cast<std::uint64_t>(PreparedRequest{index, p.generation});
  out = {index, p.generation};
  return {};
}

PostCode DataPath::post_prepared_slow(std::uint64_t handle, std::uint64_t wr_id) noexcept {
  const auto h = std::bit_cast<PreparedRequest>(handle);
  if (h.index >= prepared_count_) return post_code(PostStatus::stale);
  Prepared& p = prepared_[h.index];
  if (!p.in_use || p.generation != h.generation) return post_code(PostStatus::stale);
  if (mode_ != Mode::ready) return post_code(PostStatus::not_ready);
  return post_prepared_on(p.any_lane ? pick_lane() : lanes_[0], p, wr_id);
}

void DataPath::release(PreparedRequest h) noexcept {
  if (h.index >= prepared_count_) return;
  Prepared& p = prepared_[h.index];
  if (!p.in_use || p.generation != h.generation) return;
  p.in_use = false;
  p.generation += 2;
  p.fast_handle = Prepared::kNoFast;
  free_prepared_.push_back(h.index);  // reserved by prepare()
}

PostResult DataPath::post_recvs(std::span<const LocalSlice> dsts, std::uint64_t first_wr_id) noexcept {
  if (mode_ != Mode::idle && mode_ != Mode::ready) return {PostStatus::not_ready, 0};
  if (dsts.empty()) return {};
  if (dsts.size() > rq_.capacity()) return {PostStatus::too_large, 0};
  if (dsts.size() > rq_.free()) return {PostStatus::queue_full, 0};
  for (std::size_t i = 0; i < dsts.size(); ++i) {
    if (!dsts[i].writable()) return {PostStatus::no_access, 0, i};
    // An SGE's length has 32 bits; a longer buffer would be cut silently.
    if (dsts[i].length() > std::numeric_limits<std::uint32_t>::max()) return {PostStatus::too_large, 0, i};
  }
  const std::uint64_t seq0 = rq_.next_seq();
  for (std::size_t i = 0; i < dsts.size(); ++i) {
    recv_sges_[i] = dp::to_sge(dsts[i]);
    ibv_recv_wr& v = recv_wrs_[i];
    v = ibv_recv_wr{};
    v.wr_id = dp::wr_id(rq_tag_, seq0 + i);
    v.sg_list = &recv_sges_[i];
    v.num_sge = dsts[i].length() > 0 ? 1 : 0;
    v.next = i + 1 < dsts.size() ? &recv_wrs_[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_recv(lanes_[0].qp, recv_wrs_.data(), &bad);
  const std::size_t posted =
      rc == 0 ? dsts.size()
      : bad != nullptr && bad >= recv_wrs_.data() && bad < recv_wrs_.data() + dsts.size()
          ? static_cast<std::size_t>(bad - recv_wrs_.data())
          : 0;
  for (std::size_t i = 0; i < posted; ++i) rq_.push({first_wr_id + i, Opcode::recv, WrRing::user, false});
  if (rc != 0) return {PostStatus::failed, rc, posted};
  return {};
}

PostResult DataPath::post_bind(ibv_mw* mw, std::uint32_t rkey, ibv_mr* mr, std::uint64_t addr,
                               std::uint64_t length, unsigned mw_access, std::uint64_t wr_id) noexcept {
  if (mode_ != Mode::ready) return {PostStatus::not_ready, 0};
  Lane& lane = lanes_[0];
  if (lane.sq.free() == 0) return {PostStatus::queue_full, 0};
  ibv_send_wr v{};
  v.wr_id = lane.wr_id(lane.sq.next_seq());
  v.opcode = IBV_WR_BIND_MW;
  v.send_flags = IBV_SEND_SIGNALED;
  v.bind_mw.mw = mw;
  v.bind_mw.rkey = rkey;
  v.bind_mw.bind_info.mr = mr;
  v.bind_mw.bind_info.addr = addr;
  v.bind_mw.bind_info.length = length;
  v.bind_mw.bind_info.mw_access_flags = mw_access;
  ibv_send_wr* bad = nullptr;
  if (const int rc = ibv_post_send(lane.qp, &v, &bad); rc != 0) return {PostStatus::failed, rc, 0};
  lane.unsignaled_run = 0;
  lane.sq.push({wr_id, Opcode::send, WrRing::user, false});
  return {};
}

}  // namespace rdmakit::detail
