// SPDX-License-Identifier: Apache-2.0
#pragma once
// The data path's hot path: posting one request, a prepared one or a chain, and taking
// completions; inline, so a public post_* or poll is one function from the caller's call to the
// provider's. Included by datapath.hpp (which declares everything here); not on its own.
#include <bit>

#include "datapath/datapath.hpp"

namespace rdmakit::detail {

// --- the hot path, inline so a public post_* or poll is one function ---------------------------

namespace dp {

constexpr bool is_atomic(Opcode op) { return op == Opcode::fetch_add || op == Opcode::compare_swap; }
// WRITE and READ may go to any QP of the connection; everything else stays on the first.
constexpr bool spreads(Opcode op) { return op == Opcode::write || op == Opcode::read; }

constexpr Access remote_access_for(Opcode op) {
  switch (op) {
    case Opcode::read: return Access::remote_read;
    case Opcode::write:
    case Opcode::write_with_imm: return Access::remote_write;
    case Opcode::fetch_add:
    case Opcode::compare_swap: return Access::remote_atomic;
    default: return Access::none;
  }
}

constexpr ibv_wr_opcode verbs_opcode(Opcode op) {
  switch (op) {
    case Opcode::write: return IBV_WR_RDMA_WRITE;
    case Opcode::write_with_imm: return IBV_WR_RDMA_WRITE_WITH_IMM;
    case Opcode::read: return IBV_WR_RDMA_READ;
    case Opcode::fetch_add: return IBV_WR_ATOMIC_FETCH_AND_ADD;
    case Opcode::compare_swap: return IBV_WR_ATOMIC_CMP_AND_SWP;
    default: return IBV_WR_SEND;
  }
}

// An SGE's length is 32 bits. Every caller has refused longer slices before (a send-queue
// request by its total against max_msg_sz, a receive explicitly), so nothing is cut here.
inline ibv_sge to_sge(const LocalSlice& s) noexcept {
  return {reinterpret_cast<std::uint64_t>(s.addr()), static_cast<std::uint32_t>(s.length()), s.lkey()};
}

template <Opcode Op>
constexpr bool may_inline(std::uint64_t total, std::uint32_t max_inline) {
  if constexpr (Op == Opcode::send || Op == Opcode::write || Op == Opcode::write_with_imm) {
    return total - 1 < max_inline;  // and not 0 (which wraps)
  } else {
    return false;
  }
}

// The fields of a send WR that depend on the request, not on its opcode: the immediate, the
// target (the SGEs are already in place).
template <Opcode Op>
[[gnu::always_inline]] inline void fill_target(ibv_send_wr& v, const RemoteRegion& remote,
                                               std::uint64_t offset, std::uint32_t imm,
                                               std::uint64_t compare_add, std::uint64_t swap) {
  if constexpr (Op == Opcode::write_with_imm) v.imm_data = htobe32(imm);
  if constexpr (is_atomic(Op)) {
    v.wr.atomic.remote_addr = remote.addr + offset;
    v.wr.atomic.rkey = remote.rkey;
    v.wr.atomic.compare_add = compare_add;
    v.wr.atomic.swap = swap;
  } else if constexpr (Op != Opcode::send) {
    v.wr.rdma.remote_addr = remote.addr + offset;
    v.wr.rdma.rkey = remote.rkey;
  }
}

// The fields every send WR gets, from one request (the SGEs are already in place).
template <Opcode Op>
[[gnu::always_inline]] inline void fill_wr(ibv_send_wr& v, const RemoteRegion& remote,
                                           std::uint64_t offset, std::uint32_t imm,
                                           std::uint64_t compare_add, std::uint64_t swap) {
  v.opcode = verbs_opcode(Op);
  v.imm_data = 0;
  fill_target<Op>(v, remote, offset, imm, compare_add, swap);
}

constexpr std::uint64_t wr_id(std::uint32_t tag, std::uint64_t seq) {
  return (std::uint64_t{tag} << kTagShift) | (seq & kSeqMask);
}

// Prepared WRITE or READ `p` (p.ext not kNone; its wr_id and flags set in p.wr) posted through
// the extended interface: the request ibv_post_send(p.wr) would post, built by the provider from
// the calls.
[[gnu::always_inline]] inline int post_extended(ibv_qp_ex* x, const Prepared& p) noexcept {
  ibv_wr_start(x);
  x->wr_id = p.wr.wr_id;
  x->wr_flags = p.wr.send_flags & ~unsigned{IBV_SEND_INLINE};  // inline is said by the setter
  const std::uint8_t kind = p.ext;
  if (kind == ext_kind::kRead || kind == ext_kind::kReadList) {
    ibv_wr_rdma_read(x, p.ext_rkey, p.ext_raddr);
  } else {
    ibv_wr_rdma_write(x, p.ext_rkey, p.ext_raddr);
  }
  if (kind <= ext_kind::kRead) [[likely]] {
    ibv_wr_set_sge(x, p.ext_sge.lkey, p.ext_sge.addr, p.ext_sge.length);
  } else if (kind == ext_kind::kWriteInline) {
    ibv_wr_set_inline_data(x, reinterpret_cast<void*>(p.ext_sge.addr), p.ext_sge.length);
  } else {
    ibv_wr_set_sge_list(x, static_cast<std::size_t>(p.wr.num_sge), p.wr.sg_list);
  }
  return ibv_wr_complete(x);
}

// A send queue's completion: never one with an immediate (only a receive's has one).
inline void fill_send(Completion& c, std::uint64_t wr_id, Opcode op, const ibv_wc& wc) noexcept {
  c.wr_id = wr_id;
  c.opcode = op;
  c.status = wc.status;
  c.vendor_err = wc.vendor_err;
  c.byte_len = 0;  // a receive's alone (fill()): the same whichever poll took a send's completion
  c.has_imm = false;
  c.imm = 0;
}

// A send completion of a request that succeeded (the extended poll: no work completion read).
inline void fill_send_ok(Completion& c, std::uint64_t wr_id, Opcode op) noexcept {
  c.wr_id = wr_id;
  c.opcode = op;
  c.status = IBV_WC_SUCCESS;
  c.vendor_err = 0;
  c.byte_len = 0;
  c.has_imm = false;
  c.imm = 0;
}

// Any completion (a receive's may carry an immediate).
inline void fill(Completion& c, std::uint64_t wr_id, Opcode op, const ibv_wc& wc) noexcept {
  fill_send(c, wr_id, op, wc);
  c.byte_len = wc.byte_len;
  c.has_imm = wc.status == IBV_WC_SUCCESS && (wc.wc_flags & IBV_WC_WITH_IMM) != 0;
  c.imm = c.has_imm ? be32toh(wc.imm_data) : 0;
}

}  // namespace dp

inline const RemoteRegion* DataPath::advertised(const RemoteRegion& r, std::uint64_t offset,
                                                std::uint64_t len) const noexcept {
  const std::uint64_t addr = r.addr + offset;
  const RemoteRegion* a = last_advertised_;
  if (a != nullptr && a->rkey == r.rkey && addr >= a->addr && a->contains(addr - a->addr, len)) [[likely]] {
    return a;
  }
  return find_advertised(r.rkey, addr, len);
}

// Everything a request must satisfy before it may be posted, apart from its size against
// max_msg_sz (which decides whether a WRITE or READ is split instead). Ordered so the common
// case (a write, read or send within bounds) takes the fewest branches.
template <Opcode Op>
[[gnu::always_inline]] inline PostResult DataPath::check(std::span<const LocalSlice> local,
                                                         const RemoteRegion& remote,
                                                         std::uint64_t offset,
                                                         std::uint64_t total) const noexcept {
  if constexpr (Op == Opcode::send) {
    return {};
  } else if constexpr (Op == Opcode::recv) {
    return {PostStatus::unsupported, 0};  // a receive is not a send-queue request
  } else {
    if constexpr (dp::is_atomic(Op)) {
      if (!atomics_) return {PostStatus::unsupported, 0};
      if (local.size() != 1 || total != 8) return {PostStatus::bad_length, 0};
      if ((remote.addr + offset) % 8 != 0) return {PostStatus::misaligned, 0};
    }
    if (!remote.contains(offset, total)) [[unlikely]] return {PostStatus::out_of_bounds, 0};
    // The descriptor must be one the peer advertised here (the access is the advertised one,
    // not what the caller's copy claims): a wrong rkey is refused now, not as a REM_ACCESS_ERR
    // that would also break the connection.
    const RemoteRegion* adv = advertised(remote, offset, total);
    if (adv == nullptr) [[unlikely]] return {PostStatus::not_advertised, 0};
    if (!allows(adv->access, dp::remote_access_for(Op))) [[unlikely]] return {PostStatus::no_access, 0};
    // READ and atomics write into local memory: the NIC needs local write access there, or the
    // operation would fail later as a LOC_PROT_ERR completion.
    if constexpr (Op != Opcode::write && Op != Opcode::write_with_imm) {
      for (const LocalSlice& s : local) {
        if (!s.writable()) return {PostStatus::no_access, 0};
      }
    }
    return {};
  }
}

// check()'s verdict for a request to the caller's region post_one checked last (checked_): the
// same caller's region (address, length, key), wholly inside a region the peer advertised with
// this access, so its bounds are all that is left to test. False is no verdict: check() decides.
template <Opcode Op>
[[gnu::always_inline]] inline bool DataPath::check_fast(const LocalSlice& local, const RemoteRegion& remote,
                                                        std::uint64_t offset, std::uint64_t total) const noexcept {
  if constexpr (Op == Opcode::send) {
    return true;
  } else if constexpr (Op == Opcode::recv) {
    return false;
  } else {
    if constexpr (dp::is_atomic(Op)) {
      if (!atomics_ || total != 8 || (remote.addr + offset) % 8 != 0) return false;
    }
    const CheckedRegion& k = checked_;
    if (remote.addr != k.addr || remote.length != k.length || remote.rkey != k.rkey ||
        !allows(k.access, dp::remote_access_for(Op)) || !remote.contains(offset, total)) {
      return false;
    }
    if constexpr (Op != Opcode::write && Op != Opcode::write_with_imm) {
      if (!local.writable()) return false;
    }
    return true;
  }
}

// One signaled request with one SGE: post_write, post_read, post_send, the atomics. The same
// checks as a batch, without the batch machinery, and the opcode known at compile time (this is
// the path latency-bound code takes). Inline, it is the fast case only: ready, one QP, not
// empty, below segmentation, to the caller's region checked last. Everything else leaves by one
// call (segmentation, another region, several QPs, a refusal), so nothing but the lane lives
// across the provider's call and the frame stays small.
template <Opcode Op>
[[gnu::always_inline]] inline PostCode DataPath::post_one_code(
    const LocalSlice& local, const RemoteRegion& remote, std::uint64_t offset, std::uint32_t imm,
    std::uint64_t compare_add, std::uint64_t swap, std::uint64_t wr_id) noexcept {
  const std::uint64_t total = local.length();
  if (total - 1 >= (dp::spreads(Op) ? gate_spread_ : gate_ordered_) || !check_fast<Op>(local, remote, offset, total))
      [[unlikely]] {
    return post_one_slow<Op>(local, remote, offset, imm, compare_add, swap, wr_id);
  }
  return post_one_on<Op>(lanes_[0], local, remote, offset, imm, compare_add, swap, wr_id);
}

template <Opcode Op>
PostCode DataPath::post_one_slow(const LocalSlice& local, const RemoteRegion& remote, std::uint64_t offset,
                                 std::uint32_t imm, std::uint64_t compare_add, std::uint64_t swap,
                                 std::uint64_t wr_id) noexcept {
  const std::uint64_t total = local.length();
  if (total >= (dp::spreads(Op) ? segment_min_spread_ : segment_min_ordered_) || mode_ != Mode::ready) {
    return post_code(post_gated(Op, local, remote, offset, imm, wr_id));
  }
  if (const PostResult r = check<Op>({&local, 1}, remote, offset, total); !r.ok()) return post_code(r);
  if constexpr (Op != Opcode::send && Op != Opcode::recv) {
    // The next request to the same region of the caller's takes the inline path, if the whole
    // region lies in one the peer advertised.
    if (const RemoteRegion* a = advertised(remote, 0, remote.length)) {
      checked_ = {remote.addr, remote.length, remote.rkey, a->access};
    }
  }
  Lane& lane = dp::spreads(Op) && lane_count_ > 1 ? pick_lane() : lanes_[0];
  const PostCode c = post_one_on<Op>(lane, local, remote, offset, imm, compare_add, swap, wr_id);
  // A request of 0 bytes has no SGE; the inline path's request always has one.
  single_wrs_[static_cast<std::size_t>(Op)].num_sge = 1;
  return c;
}

template <Opcode Op>
[[gnu::always_inline]] inline PostCode DataPath::post_one_on(
    Lane& lane, const LocalSlice& local, const RemoteRegion& remote, std::uint64_t offset, std::uint32_t imm,
    std::uint64_t compare_add, std::uint64_t swap, std::uint64_t wr_id) noexcept {
  if (lane.sq.free() == 0) [[unlikely]] return post_code(PostStatus::queue_full);
  const std::uint64_t total = local.length();
  if constexpr (Op == Opcode::write || Op == Opcode::read) {
    // Through the extended interface (use_extended): no work request to fill. Not data that
    // could go inline where that interface cannot take it inline (rxe): the classic call below
    // sends it inline, and rxe's kernel side moves inline data about 1 us sooner than data it
    // must fetch through the region (bench/latency_loop.cpp, RDMAKIT_LOOP_SGE), more than the
    // classic call's extra instructions cost.
    const bool may_inline = dp::may_inline<Op>(total, limits_.max_inline);
    if (ibv_qp_ex* x = lane.qpx; x != nullptr && total != 0 && (ext_inline_ || !may_inline)) [[likely]] {
      const bool inline_data = may_inline && ext_inline_;
      const std::uint64_t id = lane.wr_id(lane.sq.next_seq());
      lane.sq.push({wr_id, Op, WrRing::user, false});
      lane.unsignaled_run = 0;
      ibv_wr_start(x);
      x->wr_id = id;
      x->wr_flags = IBV_SEND_SIGNALED;
      if constexpr (Op == Opcode::write) {
        ibv_wr_rdma_write(x, remote.rkey, remote.addr + offset);
      } else {
        ibv_wr_rdma_read(x, remote.rkey, remote.addr + offset);
      }
      const ibv_sge s = dp::to_sge(local);
      if (inline_data) {
        ibv_wr_set_inline_data(x, reinterpret_cast<void*>(s.addr), s.length);
      } else {
        ibv_wr_set_sge(x, s.lkey, s.addr, s.length);
      }
      if (const int rc = ibv_wr_complete(x); rc != 0) [[unlikely]] return refused(lane, rc);
      return PostCode::ok;
    }
  }
  // The opcode's own WR: its opcode, its SGE (single_sge_) and one SGE are set once (init());
  // fields this path never sets stay zero, so the WR is not cleared per call.
  single_sge_ = dp::to_sge(local);
  ibv_send_wr& v = single_wrs_[static_cast<std::size_t>(Op)];
  v.wr_id = lane.wr_id(lane.sq.next_seq());
  if (total == 0) [[unlikely]] v.num_sge = 0;  // (post_one_slow puts the 1 back)
  v.send_flags = IBV_SEND_SIGNALED | (dp::may_inline<Op>(total, limits_.max_inline) ? IBV_SEND_INLINE : 0);
  dp::fill_target<Op>(v, remote, offset, imm, compare_add, swap);
  // The ring entry and the run go in first and are mended if the provider refuses: then only
  // the lane is live across the provider's call (fewer registers saved on every post).
  lane.sq.push({wr_id, Op, WrRing::user, false});
  lane.unsignaled_run = 0;
  if (const int rc = ibv_post_send(lane.qp, &v, &bad_wr_); rc != 0) [[unlikely]] return refused(lane, rc);
  return PostCode::ok;
}

[[gnu::always_inline]] inline PostCode DataPath::post_prepared_code(PreparedRequest h, std::uint64_t wr_id) noexcept {
  // Two tests: the gate (0 unless ready) and the entry's fast handle (none unless in use and
  // bound for the first QP). Everything else, refusals included, is decided out of line, so nothing
  // lives across a call but the provider's.
  const auto handle = std::bit_cast<std::uint64_t>(h);
  const auto index = static_cast<std::uint32_t>(handle);
  if (index >= prepared_gate_ || prepared_[index].fast_handle != handle) [[unlikely]] {
    return post_prepared_slow(handle, wr_id);
  }
  return post_prepared_on(lanes_[0], prepared_[index], wr_id);
}

[[gnu::always_inline]] inline PostCode DataPath::post_prepared_on(Lane& lane, Prepared& p,
                                                                  std::uint64_t wr_id) noexcept {
  if (lane.sq.free() == 0) [[unlikely]] return post_code(PostStatus::queue_full);
  // A signaled request's flags were set at prepare(). An unsignaled one is signaled anyway once
  // every forced_signal_interval_ (post_chain).
  std::uint32_t run = 0;
  WrRing::Slot slot = p.slot;
  if (p.slot.kind != WrRing::user) {  // unsignaled: silent
    run = lane.unsignaled_run + 1;
    unsigned signal = 0;
    if (run >= forced_signal_interval_) {
      run = 0;
      signal = IBV_SEND_SIGNALED;  // its kind stays silent: a forced completion is not news
    }
    p.wr.send_flags = p.flags | signal;
  }
  slot.wr_id = wr_id;
  p.wr.wr_id = lane.wr_id(lane.sq.next_seq());
  lane.sq.push(slot);
  // Both before the provider's call, so only the lane lives across it (fewer registers saved).
  lane.unsignaled_run = run;
  const int rc = p.ext != ext_kind::kNone ? dp::post_extended(lane.qpx, p) : ibv_post_send(lane.qp, &p.wr, &bad_wr_);
  if (rc != 0) [[unlikely]] return refused(lane, rc);
  return PostCode::ok;
}

inline std::uint32_t DataPath::begin_chain(Lane& lane, std::uint32_t signal_every) noexcept {
  chain_lane_ = &lane;
  chain_n_ = 0;
  if (mode_ != Mode::ready) [[unlikely]] return 0;
  // At least once every forced_signal_interval_ (see post_chain), counting the lane's
  // unsignaled run before the chain.
  const std::uint32_t every = std::bit_floor(std::max(1u, std::min(signal_every, forced_signal_interval_)));
  chain_mask_ = every - 1;
  chain_phase_ = lane.unsignaled_run + 1;
  if (lane.unsignaled_run + every > forced_signal_interval_) chain_mask_ = 0;  // every one: rare
  const std::uint64_t seq0 = lane.sq.next_seq();
  chain_wr_id_ = lane.wr_id(seq0);
  const std::uint64_t before_wrap = kSeqMask + 1 - (seq0 & kSeqMask);
  return static_cast<std::uint32_t>(std::min<std::uint64_t>({lane.sq.free(), limits_.send_depth, before_wrap}));
}

template <Opcode Op>
[[gnu::always_inline]] inline PostStatus DataPath::build_request(
    ibv_send_wr& v, ibv_sge& sge, std::uint64_t laddr, std::uint32_t length, std::uint32_t lkey, bool writable,
    const RemoteRegion& remote, std::uint64_t offset, std::uint64_t compare_add, std::uint64_t swap) const noexcept {
  static_assert(Op != Opcode::send && Op != Opcode::recv && Op != Opcode::write_with_imm);
  if constexpr (dp::is_atomic(Op)) {
    if (!atomics_) return PostStatus::unsupported;
    if (length != 8) return PostStatus::bad_length;
    if ((remote.addr + offset) % 8 != 0) return PostStatus::misaligned;
  }
  if (length > limits_.max_msg_size) [[unlikely]] return PostStatus::too_large;
  if (!remote.contains(offset, length)) [[unlikely]] return PostStatus::out_of_bounds;
  if (!allows(remote.access, dp::remote_access_for(Op))) [[unlikely]] return PostStatus::no_access;
  if constexpr (Op != Opcode::write) {
    if (!writable) [[unlikely]] return PostStatus::no_access;
  }
  sge = {laddr, length, lkey};
  v.sg_list = &sge;
  v.num_sge = length != 0 ? 1 : 0;
  v.send_flags = dp::may_inline<Op>(length, limits_.max_inline) ? IBV_SEND_INLINE : 0;
  dp::fill_wr<Op>(v, remote, offset, 0, compare_add, swap);
  return PostStatus::ok;
}

template <Opcode Op>
[[gnu::always_inline]] inline PostStatus DataPath::chain_add(
    std::uint64_t laddr, std::uint32_t length, std::uint32_t lkey, bool writable, const RemoteRegion& remote,
    std::uint64_t offset, std::uint64_t compare_add, std::uint64_t swap, std::uint64_t wr_id) noexcept {
  const std::uint32_t i = chain_n_;
  ibv_send_wr& v = send_wrs_[i];
  const PostStatus st = build_request<Op>(v, send_sges_[i], laddr, length, lkey, writable, remote, offset, compare_add, swap);
  if (st != PostStatus::ok) [[unlikely]] return st;
  ++chain_n_;
  const bool signal = ((i + chain_phase_) & chain_mask_) == 0;
  v.wr_id = chain_wr_id_ + i;
  v.next = &v + 1;
  v.send_flags |= signal ? IBV_SEND_SIGNALED : 0;
  chain_lane_->sq.stage(i, {wr_id, Op, signal ? WrRing::user : WrRing::silent, false});
  return PostStatus::ok;
}

inline std::uint32_t DataPath::prebuilt_room(const Lane& lane, std::uint32_t signal_every) const noexcept {
  if (mode_ != Mode::ready || lane.unsignaled_run + signal_every > forced_signal_interval_) [[unlikely]] return 0;
  const std::uint64_t before_wrap = kSeqMask + 1 - (lane.sq.next_seq() & kSeqMask);
  return static_cast<std::uint32_t>(std::min<std::uint64_t>({lane.sq.free(), limits_.send_depth, before_wrap}));
}

[[gnu::always_inline]] inline PostResult DataPath::post_prebuilt(Lane& lane, ibv_send_wr* wrs, std::uint32_t n,
                                                                 const WrRing::Slot* slots_of,
                                                                 std::uint64_t id_base) noexcept {
  // A slot is two words; the first (the wr_id) gets id_base added: one vector add per slot.
  using Words = std::uint64_t __attribute__((vector_size(16)));
  static_assert(sizeof(Words) == sizeof(WrRing::Slot) && std::is_trivially_copyable_v<WrRing::Slot>);
  const Words add = {id_base, 0};
  auto put = [slots_of, add](WrRing::Slot& dst, std::uint32_t i) {
    Words w;
    std::memcpy(&w, static_cast<const void*>(slots_of + i), sizeof w);
    w += add;
    std::memcpy(static_cast<void*>(&dst), &w, sizeof w);
  };
  const std::uint64_t tail = lane.sq.next_seq();
  const std::uint64_t base = lane.wr_id(tail);
  const auto slots = lane.sq.view();
  const std::uint64_t at = tail & slots.mask;
  if (at + n <= slots.mask + 1) [[likely]] {  // one stretch of the ring's storage
    WrRing::Slot* const d = slots.slots + at;
    for (std::uint32_t i = 0; i < n; ++i) {
      wrs[i].wr_id = base + i;
      put(d[i], i);
    }
  } else {
    for (std::uint32_t i = 0; i < n; ++i) {
      wrs[i].wr_id = base + i;
      put(slots[tail + i], i);
    }
  }
  return post_linked(lane, wrs, n, 0);
}

inline PostResult DataPath::post_chain_built() noexcept {
  const std::uint32_t n = chain_n_;
  chain_n_ = 0;
  if (n == 0) return {};
  // The last request is signaled and its completion is news: it retires the whole chain.
  send_wrs_[n - 1].send_flags |= IBV_SEND_SIGNALED;
  chain_lane_->sq.staged(n - 1).kind = WrRing::user;
  return post_staged(*chain_lane_, n, 0);
}

// Polls `cq` in batches until `out` is full or the CQ is empty; `take` turns each work
// completion into news for the caller (returns true) or bookkeeping (false). A caller asking
// for one completion (wait(), a latency loop) gets a single-entry poll without the batch loop.
template <typename Take>
[[gnu::always_inline]] inline std::size_t reap(ibv_cq* cq, std::span<Completion> out, Take take) noexcept {
  if (out.size() == 1) {
    ibv_wc wc;
    return ibv_poll_cq(cq, 1, &wc) == 1 && take(wc, out[0]) ? 1 : 0;
  }
  std::size_t n = 0;
  ibv_wc wc[kPollBatch];
  while (n < out.size()) {
    const int want = static_cast<int>(std::min<std::size_t>(kPollBatch, out.size() - n));
    const int got = ibv_poll_cq(cq, want, wc);
    for (int i = 0; i < got; ++i) {
      if (take(wc[i], out[n])) ++n;
    }
    if (got < want) break;
  }
  return n;
}

[[gnu::always_inline]] inline bool DataPath::take_send(const ibv_wc& wc, Completion& c) noexcept {
  const std::uint64_t lane = wc.wr_id >> kTagShift;
  if (lane >= lane_count_) [[unlikely]] return false;  // not ours: nothing posts such an id
  return take_lane(lanes_[lane], wc, c);
}

[[gnu::always_inline]] inline bool DataPath::take_lane(Lane& lane, const ibv_wc& wc, Completion& c) noexcept {
  return take_retired(lane, lane.sq.retire(wc.wr_id), wc, c);
}

[[gnu::always_inline]] inline bool DataPath::take_retired(Lane& lane, const WrRing::Slot* slot, const ibv_wc& wc,
                                                          Completion& c) noexcept {
  if (slot != nullptr && slot->kind == WrRing::user && wc.status == IBV_WC_SUCCESS) [[likely]] {
    dp::fill_send(c, slot->wr_id, slot->op, wc);
    return true;
  }
  return take_other(lane, slot, wc, c);
}

[[gnu::always_inline]] inline bool DataPath::take_recv(const ibv_wc& wc, Completion& c) noexcept {
  const WrRing::Slot* slot = rq_.retire(wc.wr_id);  // the tag is above the bits it reads
  if (slot == nullptr || wc.status != IBV_WC_SUCCESS) [[unlikely]] return take_recv_other(slot, wc, c);
  dp::fill(c, slot->wr_id, slot->op, wc);
  return true;
}

[[gnu::always_inline]] inline std::size_t DataPath::reap_send(std::span<Completion> out) noexcept {
  return reap(send_cq_, out, [this](const ibv_wc& wc, Completion& c)
                                 __attribute__((always_inline)) { return take_send(wc, c); });
}

[[gnu::always_inline]] inline std::size_t DataPath::reap_recv(std::span<Completion> out) noexcept {
  return reap(recv_cq_, out, [this](const ibv_wc& wc, Completion& c)
                                 __attribute__((always_inline)) { return take_recv(wc, c); });
}

[[gnu::always_inline]] inline std::size_t DataPath::poll(std::span<Completion> out) noexcept {
  return out.size() == 1 ? poll_one(out[0]) : poll_many(out);
}

}  // namespace rdmakit::detail
