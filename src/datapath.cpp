// The data path: posting and polling. Nothing here allocates, throws or logs: a refused post is a
// PostResult, a failed operation a Completion.
#include <endian.h>
#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <type_traits>

#include <fmt/format.h>

#include "connection_impl.hpp"
#include "rdmakit/error.hpp"
#include "trace.hpp"

namespace rdmakit {

using detail::Clock;
using detail::Deadline;

std::string PostResult::describe() const {
  const std::string where = index > 0 ? fmt::format(" (work request {} of the batch)", index) : "";
  switch (status) {
    case PostStatus::ok: return "ok";
    case PostStatus::not_ready: return "refused: the QP is not in RTS (not connected, or closing)" + where;
    case PostStatus::out_of_bounds: return "refused: the range lies outside the remote region" + where;
    case PostStatus::no_access:
      return "refused: the region does not allow this operation (remote access flags, or a local "
             "buffer the NIC may not write)" + where;
    case PostStatus::too_large: return "refused: longer than the port's max message size" + where;
    case PostStatus::queue_full: return "refused: the send or receive queue has no room for the batch";
    case PostStatus::too_many_sges: return "refused: more scatter-gather entries than max_sge" + where;
    case PostStatus::misaligned: return "refused: an atomic's remote address is not 8-byte aligned" + where;
    case PostStatus::bad_length: return "refused: an atomic needs exactly one 8-byte local slice" + where;
    case PostStatus::unsupported: return "refused: the device or QP does not support this operation" + where;
    case PostStatus::not_advertised:
      return "refused: the remote descriptor is not inside a region the peer advertised on this "
             "connection (wrong rkey or address, or taken from another connection)" + where;
    case PostStatus::failed:
      return fmt::format("ibv_post failed: {} ({}){}", errno_name(sys_errno),
                         std::system_category().message(sys_errno), where);
  }
  return "?";
}

namespace {

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

ibv_sge to_sge(const LocalSlice& s) noexcept {
  return {reinterpret_cast<std::uint64_t>(s.addr()), static_cast<std::uint32_t>(s.length()), s.lkey()};
}

template <Opcode Op>
constexpr bool may_inline(std::uint64_t total, std::uint32_t max_inline) {
  if constexpr (Op == Opcode::send || Op == Opcode::write || Op == Opcode::write_with_imm) {
    return total > 0 && total <= max_inline;
  } else {
    return false;
  }
}

// The fields every send WR gets, from one request (the SGEs are already in place).
template <Opcode Op>
[[gnu::always_inline]] inline void fill_wr(ibv_send_wr& v, const RemoteRegion& remote,
                                           std::uint64_t offset, std::uint32_t imm,
                                           std::uint64_t compare_add, std::uint64_t swap) {
  v.opcode = verbs_opcode(Op);
  v.imm_data = Op == Opcode::write_with_imm ? htobe32(imm) : 0;
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

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }

}  // namespace

// Everything a request must satisfy before it may be posted, apart from its size against
// max_msg_sz (which decides whether a WRITE or READ is split instead). Ordered so the common
// case (a write, read or send within bounds) takes the fewest branches.
template <Opcode Op>
[[gnu::always_inline]] inline PostResult Connection::Impl::check(std::span<const LocalSlice> local,
                                                                 const RemoteRegion& remote,
                                                                 std::uint64_t offset,
                                                                 std::uint64_t total) const noexcept {
  if constexpr (Op == Opcode::send) {
    return {};
  } else if constexpr (Op == Opcode::recv) {
    return {PostStatus::unsupported, 0};  // a receive is not a send-queue request
  } else {
    if constexpr (is_atomic(Op)) {
      if (!info.atomics) return {PostStatus::unsupported, 0};
      if (local.size() != 1 || total != 8) return {PostStatus::bad_length, 0};
      if ((remote.addr + offset) % 8 != 0) return {PostStatus::misaligned, 0};
    }
    if (!remote.contains(offset, total)) [[unlikely]] return {PostStatus::out_of_bounds, 0};
    // The descriptor must be one the peer advertised here (the access is the advertised one,
    // not what the caller's copy claims): a wrong rkey is refused now, not as a REM_ACCESS_ERR
    // that would also put the QP in the error state.
    const RemoteRegion* adv = advertised(remote, offset, total);
    if (adv == nullptr) [[unlikely]] return {PostStatus::not_advertised, 0};
    if (!allows(adv->access, remote_access_for(Op))) [[unlikely]] return {PostStatus::no_access, 0};
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

PostResult Connection::Impl::check(Opcode op, std::span<const LocalSlice> local,
                                   const RemoteRegion& remote, std::uint64_t offset,
                                   std::uint64_t total) const noexcept {
  return with_opcode(op, [&](auto o) { return check<decltype(o)::value>(local, remote, offset, total); });
}

// The next QP for a WRITE or READ: round robin, passing over QPs whose queue is full.
detail::Lane& Connection::Impl::pick_lane() noexcept {
  const std::uint32_t n = lane_count;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (++next_lane == n) next_lane = 0;
    if (lanes[next_lane].sq.free() > 0) break;
  }
  return lanes[next_lane];
}

// One signaled request with one SGE: post_write, post_read, post_send, the atomics. The same
// checks as a batch, without the batch machinery, and the opcode known at compile time (this is
// the path latency-bound code takes).
template <Opcode Op>
[[gnu::always_inline]] inline PostResult Connection::Impl::post_one(
    const LocalSlice& local, const RemoteRegion& remote, std::uint64_t offset, std::uint32_t imm,
    std::uint64_t compare_add, std::uint64_t swap, std::uint64_t wr_id) noexcept {
  if (state != State::connected) [[unlikely]] return {PostStatus::not_ready, 0};
  const std::uint64_t total = local.length();
  if constexpr (spreads(Op) || Op == Opcode::write_with_imm) {
    if (total >= (spreads(Op) ? segment_min_spread : segment_min_ordered)) [[unlikely]] {
      return post_segmented(Op, local, remote, offset, imm, wr_id);
    }
  } else {
    if (total > info.max_msg_size) [[unlikely]] return {PostStatus::too_large, 0};
  }
  if (const PostResult r = check<Op>({&local, 1}, remote, offset, total); !r.ok()) [[unlikely]] {
    return r;
  }
  detail::Lane& lane = spreads(Op) && lane_count > 1 ? pick_lane() : lanes[0];
  if (lane.sq.free() == 0) [[unlikely]] return {PostStatus::queue_full, 0};
  ibv_sge sge = to_sge(local);
  // Fields this path never sets stay zero from setup, so the WR is not cleared per call.
  ibv_send_wr& v = single_wr;
  v.wr_id = (std::uint64_t{lane.id} << detail::kLaneShift) | lane.sq.next_seq();
  v.sg_list = &sge;
  v.num_sge = total == 0 ? 0 : 1;
  v.send_flags = IBV_SEND_SIGNALED | (may_inline<Op>(total, info.max_inline) ? IBV_SEND_INLINE : 0);
  fill_wr<Op>(v, remote, offset, imm, compare_add, swap);
  ibv_send_wr* bad = nullptr;
  if (const int rc = ibv_post_send(lane.qp.get(), &v, &bad); rc != 0) [[unlikely]] {
    return {PostStatus::failed, rc, 0};
  }
  lane.unsignaled_run = 0;
  lane.sq.push({wr_id, Op, true, false});
  return {};
}

// A WRITE or READ of at least segment_min bytes: with several QPs, striped across all of them
// (QP k moves the k-th contiguous share), and each share split at max_msg_sz. RC keeps each QP's
// parts in order; the QPs finish in any order. Every QP's last part is signaled and counted; the
// caller gets one completion when all counted parts are in, with the first error any part had.
// A WRITE_WITH_IMM is only split, on the first QP, with the immediate on its last part, so the
// peer sees it after all the data. A SEND cannot be split: the receiver would see several
// messages.
PostResult Connection::Impl::post_segmented(Opcode op, const LocalSlice& local,
                                            const RemoteRegion& remote, std::uint64_t offset,
                                            std::uint32_t imm, std::uint64_t wr_id) noexcept {
  const std::uint64_t total = local.length();
  if (PostResult r = check(op, {&local, 1}, remote, offset, total); !r.ok()) return r;
  const bool stripe = spreads(op) && lane_count > 1;
  const std::uint64_t n = stripe ? lane_count : 1;
  // Each QP's share is a whole number of 4 KiB pages, so the parts of a page-aligned buffer
  // stay page-aligned.
  const std::uint64_t share = stripe ? ceil_div(ceil_div(total, n), 4096) * 4096 : total;
  const std::uint64_t chunk = info.max_msg_size;
  std::uint32_t used = 0;
  // Room on every QP first: a request that cannot be posted whole posts nothing.
  for (std::uint64_t k = 0; k < n && k * share < total; ++k, ++used) {
    const std::uint64_t parts = ceil_div(std::min(share, total - k * share), chunk);
    if (parts > lanes[k].sq.free() || parts > part_reqs.size()) return {PostStatus::queue_full, 0};
  }
  if (free_segmented.empty()) return {PostStatus::queue_full, 0};
  const std::uint32_t index = free_segmented.back();
  free_segmented.pop_back();  // never frees: the vector keeps its capacity
  detail::Segmented& seg = segmented[index];
  seg = {wr_id, op, used, 0, 0, false};

  for (std::uint32_t k = 0; k < used; ++k) {
    const std::uint64_t begin = k * share;
    const std::uint64_t len = std::min(share, total - begin);
    const std::uint64_t parts = ceil_div(len, chunk);
    for (std::uint64_t j = 0; j < parts; ++j) {
      const bool last = j + 1 == parts;
      part_slices[j] = local.subslice(begin + j * chunk, std::min(chunk, len - j * chunk));
      WorkRequest& w = part_reqs[j];
      w = {};
      w.opcode = op == Opcode::write_with_imm && !last ? Opcode::write : op;
      w.local = {&part_slices[j], 1};
      w.remote = remote;
      w.remote_offset = offset + begin + j * chunk;
      w.imm = imm;
      w.wr_id = index;
      w.signaled = last;
    }
    if (const PostResult r = post_chain(lanes[k], {part_reqs.data(), parts}, true); !r.ok()) {
      // The QPs before this one (and perhaps some parts on this one) are on the wire: their
      // completions are retired without a word, and the caller learns of it from this result.
      seg.silent = true;
      seg.pending = k;
      if (k == 0) free_segmented.push_back(index);
      return r;
    }
  }
  return {};
}

PostResult Connection::Impl::post_batch(std::span<const WorkRequest> batch) noexcept {
  if (state != State::connected) [[unlikely]] return {PostStatus::not_ready, 0};
  if (batch.empty()) return {};
  // A batch stays on one QP, chained. Only a batch of WRITEs and READs may go to any QP.
  detail::Lane* lane = &lanes[0];
  if (lane_count > 1 &&
      std::all_of(batch.begin(), batch.end(), [](const WorkRequest& w) { return spreads(w.opcode); })) {
    lane = &pick_lane();
  }
  return post_chain(*lane, batch, false);
}

// One pass: each request is checked and written into the preallocated WR/SGE arrays; only when
// all passed is the chain handed to ibv_post_send, so a refused batch posts nothing.
PostResult Connection::Impl::post_chain(detail::Lane& lane, std::span<const WorkRequest> batch,
                                        bool parts) noexcept {
  if (batch.size() > lane.sq.free()) [[unlikely]] return {PostStatus::queue_full, 0};
  const std::uint64_t seq0 = lane.sq.next_seq();
  const std::uint64_t lane_bits = std::uint64_t{lane.id} << detail::kLaneShift;
  std::uint32_t run = lane.unsignaled_run;
  ibv_sge* sge = send_sges.data();
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const WorkRequest& w = batch[i];
    if (w.local.size() > info.max_sge) [[unlikely]] return {PostStatus::too_many_sges, 0, i};
    ibv_send_wr& v = send_wrs[i];
    v.sg_list = sge;
    std::uint64_t total = 0;
    for (const LocalSlice& s : w.local) {
      *sge++ = to_sge(s);
      total += s.length();
    }
    if (total > info.max_msg_size) [[unlikely]] return {PostStatus::too_large, 0, i};
    // Signal when asked, and at least once every half queue: otherwise the queue could fill with
    // requests whose completion is never reported, and nothing could reclaim them. Half, not
    // all: the forced completion then arrives while the other half can still be posted.
    const bool signal = w.signaled || run + 1 >= forced_signal_interval;
    run = signal ? 0 : run + 1;
    v.wr_id = lane_bits | (seq0 + i);
    v.next = send_wrs.data() + i + 1;
    // Zero-length SGEs are dropped: a 0-byte operation carries no SGE at all.
    v.num_sge = total == 0 ? 0 : static_cast<int>(w.local.size());
    const PostResult r = with_opcode(w.opcode, [&](auto o) -> PostResult {
      constexpr Opcode op = decltype(o)::value;
      if (PostResult c = check<op>(w.local, w.remote, w.remote_offset, total); !c.ok()) return c;
      // Inline: the CPU copies the payload, so the NIC needs no DMA read and no lkey.
      v.send_flags = (signal ? IBV_SEND_SIGNALED : 0) |
                     (may_inline<op>(total, info.max_inline) ? IBV_SEND_INLINE : 0);
      fill_wr<op>(v, w.remote, w.remote_offset, w.imm, w.compare_add, w.swap);
      return {};
    });
    if (!r.ok()) [[unlikely]] return {r.status, r.sys_errno, i};
  }
  send_wrs[batch.size() - 1].next = nullptr;

  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(lane.qp.get(), send_wrs.data(), &bad);
  if (rc == 0) [[likely]] {
    lane.unsignaled_run = run;
    for (const WorkRequest& w : batch) lane.sq.push({w.wr_id, w.opcode, w.signaled, parts});
    return {};
  }
  // The provider may have posted the requests before `bad`: account for exactly those.
  const std::size_t posted = bad != nullptr ? static_cast<std::size_t>(bad - send_wrs.data()) : 0;
  for (std::size_t i = 0; i < posted; ++i) {
    lane.unsignaled_run = (send_wrs[i].send_flags & IBV_SEND_SIGNALED) != 0 ? 0 : lane.unsignaled_run + 1;
    lane.sq.push({batch[i].wr_id, batch[i].opcode, batch[i].signaled, parts});
  }
  return {PostStatus::failed, rc, posted};
}

PostResult Connection::Impl::post_recvs(std::span<const LocalSlice> dsts,
                                        std::uint64_t first_wr_id) noexcept {
  if (!recv_allowed || state == State::closed) return {PostStatus::not_ready, 0};
  if (dsts.empty()) return {};
  if (dsts.size() > rq.free()) return {PostStatus::queue_full, 0};
  for (std::size_t i = 0; i < dsts.size(); ++i) {
    if (!dsts[i].writable()) return {PostStatus::no_access, 0, i};
  }
  const std::uint64_t seq0 = rq.next_seq();
  for (std::size_t i = 0; i < dsts.size(); ++i) {
    recv_sges[i] = to_sge(dsts[i]);
    ibv_recv_wr& v = recv_wrs[i];
    v = ibv_recv_wr{};
    v.wr_id = seq0 + i;
    v.sg_list = &recv_sges[i];
    v.num_sge = dsts[i].length() > 0 ? 1 : 0;
    v.next = i + 1 < dsts.size() ? &recv_wrs[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_recv(lanes[0].qp.get(), recv_wrs.data(), &bad);
  const std::size_t posted =
      rc == 0 ? dsts.size() : bad != nullptr ? static_cast<std::size_t>(bad - recv_wrs.data()) : 0;
  for (std::size_t i = 0; i < posted; ++i) rq.push({first_wr_id + i, Opcode::recv, true});
  if (rc != 0) return {PostStatus::failed, rc, posted};
  return {};
}

namespace {

void fill(Completion& c, std::uint64_t wr_id, Opcode op, const ibv_wc& wc) noexcept {
  c.wr_id = wr_id;
  c.opcode = op;
  c.status = wc.status;
  c.vendor_err = wc.vendor_err;
  c.byte_len = wc.byte_len;
  c.has_imm = wc.status == IBV_WC_SUCCESS && (wc.wc_flags & IBV_WC_WITH_IMM) != 0;
  c.imm = c.has_imm ? be32toh(wc.imm_data) : 0;
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
  ibv_wc wc[detail::kPollBatch];
  while (n < out.size()) {
    const int want = static_cast<int>(std::min<std::size_t>(detail::kPollBatch, out.size() - n));
    const int got = ibv_poll_cq(cq, want, wc);
    for (int i = 0; i < got; ++i) {
      if (take(wc[i], out[n])) ++n;
    }
    if (got < want) break;
  }
  return n;
}

}  // namespace

// A completion of one part of a segmented request: records the first error; true (and `c`
// filled) when it was the last counted part. Off the hot path.
[[gnu::noinline]] bool Connection::Impl::finish_part(const detail::WrRing::Slot& slot, const ibv_wc& wc,
                                                     Completion& c) noexcept {
  detail::Segmented& seg = segmented[slot.wr_id];
  if (wc.status != IBV_WC_SUCCESS && seg.status == 0) {
    seg.status = wc.status;
    seg.vendor_err = wc.vendor_err;
  }
  if (!slot.user_signaled || --seg.pending > 0) return false;
  free_segmented.push_back(static_cast<std::uint32_t>(slot.wr_id));  // within capacity
  if (seg.silent) return false;
  c = {};
  c.wr_id = seg.wr_id;
  c.opcode = seg.op;
  c.status = seg.status;
  c.vendor_err = seg.vendor_err;
  if (!c.ok()) trace_error(c);
  return true;
}

[[gnu::noinline]] void Connection::Impl::trace_error(const Completion& c) noexcept {
  detail::emit(cfg.trace, [&] {
    return TraceEvent{"error_completion",
                      {{"peer", info.peer_address},
                       {"qp", fmt::format("{:#x}", lanes[0].qp->qp_num)},
                       {"opcode", to_string(c.opcode)},
                       {"wr_id", std::to_string(c.wr_id)},
                       {"status", c.status_name()},
                       {"vendor_err", fmt::format("{:#x}", c.vendor_err)},
                       {"detail", c.describe()}}};
  });
}

[[gnu::always_inline]] inline std::size_t Connection::Impl::reap_send(std::span<Completion> out) noexcept {
  return reap(send_cq.get(), out, [this](const ibv_wc& wc, Completion& c) __attribute__((always_inline)) {
    const std::uint64_t lane = wc.wr_id >> detail::kLaneShift;
    if (lane >= lane_count) [[unlikely]] return false;  // not ours: nothing posts such an id
    const detail::WrRing::Slot slot = lanes[lane].sq.retire(wc.wr_id & detail::kSeqMask);
    if (slot.part) [[unlikely]] return finish_part(slot, wc, c);
    // A completion the library forced (selective signaling) is bookkeeping, not news; an
    // error is always news.
    if (wc.status == IBV_WC_SUCCESS && !slot.user_signaled) return false;
    fill(c, slot.wr_id, slot.op, wc);
    if (wc.status != IBV_WC_SUCCESS) [[unlikely]] trace_error(c);
    return true;
  });
}

std::size_t Connection::Impl::reap_recv(std::span<Completion> out) noexcept {
  return reap(recv_cq.get(), out, [this](const ibv_wc& wc, Completion& c) __attribute__((always_inline)) {
    const detail::WrRing::Slot slot = rq.retire(wc.wr_id);
    fill(c, slot.wr_id, slot.op, wc);
    if (wc.status != IBV_WC_SUCCESS) [[unlikely]] trace_error(c);
    return true;
  });
}

[[gnu::always_inline]] inline std::size_t Connection::Impl::poll(std::span<Completion> out) noexcept {
  // A queue with nothing in flight has nothing to report: skip its provider call (it costs real
  // time per spin in a latency loop).
  std::size_t n = lane_count > 1 || lanes[0].sq.count() != 0 ? reap_send(out) : 0;
  if (rq.count() != 0 && n < out.size()) n += reap_recv(out.subspan(n));
  return n;
}

// Reaps completions until the send queues (and, with `receives`, the receive queue) are empty
// or the deadline passes.
void Connection::Impl::drain(Deadline deadline, bool receives) noexcept {
  std::array<Completion, detail::kPollBatch> sink;
  while (sends_in_flight() + (receives ? rq.count() : 0) > 0 && Clock::now() < deadline) {
    if (poll(sink) == 0) ::sched_yield();
  }
}

bool Connection::Impl::sleep_for_event(Deadline deadline, Completion& out) noexcept {
  if (ibv_req_notify_cq(send_cq.get(), 0) != 0 || ibv_req_notify_cq(recv_cq.get(), 0) != 0) {
    return false;
  }
  // A completion that landed between the last poll and the arming raised no event: look again.
  if (poll({&out, 1}) == 1) return true;
  pollfd fds[2] = {{channel->fd, POLLIN, 0}, {control ? control.get() : -1, POLLIN, 0}};
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  // +1 ms: poll() would otherwise wake just before the deadline and loop once more for nothing.
  const int ms = static_cast<int>(std::clamp<long long>(left.count(), 0, 1 << 30)) + 1;
  if (::poll(fds, 2, ms) > 0 && (fds[0].revents & POLLIN) != 0) {
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    while (ibv_get_cq_event(channel.get(), &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
  }
  return false;
}

// --- the public data-path calls ---------------------------------------------------------------

PostResult Connection::post_write(const LocalSlice& src, const RemoteRegion& dst,
                                  std::uint64_t offset, std::uint64_t wr_id) noexcept {
  return impl_->post_one<Opcode::write>(src, dst, offset, 0, 0, 0, wr_id);
}

PostResult Connection::post_write_with_imm(const LocalSlice& src, const RemoteRegion& dst,
                                           std::uint64_t offset, std::uint32_t imm,
                                           std::uint64_t wr_id) noexcept {
  return impl_->post_one<Opcode::write_with_imm>(src, dst, offset, imm, 0, 0, wr_id);
}

PostResult Connection::post_read(const LocalSlice& dst, const RemoteRegion& src,
                                 std::uint64_t offset, std::uint64_t wr_id) noexcept {
  return impl_->post_one<Opcode::read>(dst, src, offset, 0, 0, 0, wr_id);
}

PostResult Connection::post_send(const LocalSlice& src, std::uint64_t wr_id) noexcept {
  return impl_->post_one<Opcode::send>(src, {}, 0, 0, 0, 0, wr_id);
}

PostResult Connection::post_fetch_add(const LocalSlice& old_value, const RemoteRegion& dst,
                                      std::uint64_t offset, std::uint64_t add,
                                      std::uint64_t wr_id) noexcept {
  return impl_->post_one<Opcode::fetch_add>(old_value, dst, offset, 0, add, 0, wr_id);
}

PostResult Connection::post_compare_swap(const LocalSlice& old_value, const RemoteRegion& dst,
                                         std::uint64_t offset, std::uint64_t compare,
                                         std::uint64_t swap, std::uint64_t wr_id) noexcept {
  return impl_->post_one<Opcode::compare_swap>(old_value, dst, offset, 0, compare, swap, wr_id);
}

PostResult Connection::post_batch(std::span<const WorkRequest> batch) noexcept {
  return impl_->post_batch(batch);
}

PostResult Connection::post_recv(const LocalSlice& dst, std::uint64_t wr_id) noexcept {
  return impl_->post_recvs({&dst, 1}, wr_id);
}

PostResult Connection::post_recvs(std::span<const LocalSlice> dsts, std::uint64_t first_wr_id) noexcept {
  return impl_->post_recvs(dsts, first_wr_id);
}

std::size_t Connection::poll(std::span<Completion> out) noexcept { return impl_->poll(out); }

std::uint32_t Connection::outstanding() const noexcept {
  return impl_->sends_in_flight() + impl_->rq.count();
}

WaitResult Connection::wait(std::chrono::milliseconds timeout) noexcept {
  WaitResult r;
  Impl& m = *impl_;
  // A completion that arrives within the first 256 polls costs no clock read and no syscall
  // (the deadline starts counting after them, a few microseconds late). Busy waiting then spins
  // like perftest does (no sched_yield: a syscall on the spin path added microseconds to every
  // slow-ish completion); the clock is read every 256 empty polls, and the control channel and
  // the async events (syscalls) looked at about once a millisecond.
  Deadline deadline{};
  Deadline next_control{};
  for (std::uint32_t spin = 0;; ++spin) {
    if (m.poll({&r.completion, 1}) == 1) {
      r.status = WaitStatus::completed;
      return r;
    }
    if ((spin & 0xff) != 0xff) continue;
    const Deadline now = Clock::now();
    if (spin == 0xff) deadline = now + timeout;
    if (now >= next_control || m.channel) {
      next_control = now + std::chrono::milliseconds{1};
      m.pump_control();
      (void)m.pump_async();
      if ((m.control_gone || m.bye_received) && m.failure.empty() && m.state == Impl::State::connected) {
        if (m.peer_gone_at == Deadline{}) m.peer_gone_at = now;
        if (outstanding() == 0 || now - m.peer_gone_at >= detail::kPeerGoneGrace) {
          m.break_connection(m.bye_received ? "the peer closed the connection (BYE)"
                                            : "the peer is gone: its control channel closed (process "
                                              "exited or killed, or the host went down)",
                             false);
        }
      }
      if (!m.failure.empty() && !m.broken_reported) {
        // Reported once; what was outstanding is being flushed and comes in later waits.
        m.broken_reported = true;
        r.status = m.device_failed ? WaitStatus::device_error : WaitStatus::peer_lost;
        detail::emit(m.cfg.trace, [&] {
          return TraceEvent{m.device_failed ? "device_error" : "peer_lost",
                            {{"peer", m.info.peer_address},
                             {"outstanding", std::to_string(outstanding())},
                             {"why", m.failure}}};
        });
        return r;
      }
    }
    if ((!m.failure.empty() || m.state == Impl::State::closed) && outstanding() == 0) {
      r.status = WaitStatus::closed;
      return r;
    }
    if (now >= deadline) {
      r.status = WaitStatus::timeout;
      return r;
    }
    if (m.channel && m.failure.empty() && m.sleep_for_event(deadline, r.completion)) {
      r.status = WaitStatus::completed;
      return r;
    }
  }
}

}  // namespace rdmakit
