// The data path: posting and polling. Nothing here allocates, throws or logs: a refused post is a
// PostResult, a failed operation a Completion.
#include <endian.h>
#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "connection_impl.hpp"
#include "rdmakit/error.hpp"

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
    case PostStatus::failed:
      return fmt::format("ibv_post failed: {} ({}){}", errno_name(sys_errno),
                         std::system_category().message(sys_errno), where);
  }
  return "?";
}

namespace {

bool is_atomic(Opcode op) { return op == Opcode::fetch_add || op == Opcode::compare_swap; }

Access remote_access_for(Opcode op) {
  switch (op) {
    case Opcode::read: return Access::remote_read;
    case Opcode::write:
    case Opcode::write_with_imm: return Access::remote_write;
    case Opcode::fetch_add:
    case Opcode::compare_swap: return Access::remote_atomic;
    default: return Access::none;
  }
}

ibv_wr_opcode verbs_opcode(Opcode op) {
  switch (op) {
    case Opcode::write: return IBV_WR_RDMA_WRITE;
    case Opcode::write_with_imm: return IBV_WR_RDMA_WRITE_WITH_IMM;
    case Opcode::read: return IBV_WR_RDMA_READ;
    case Opcode::fetch_add: return IBV_WR_ATOMIC_FETCH_AND_ADD;
    case Opcode::compare_swap: return IBV_WR_ATOMIC_CMP_AND_SWP;
    default: return IBV_WR_SEND;
  }
}

ibv_sge to_sge(const LocalSlice& s) noexcept {
  return {reinterpret_cast<std::uint64_t>(s.addr()), static_cast<std::uint32_t>(s.length()), s.lkey()};
}

}  // namespace

// Everything a request must satisfy before it may be posted, given its payload size. Ordered so
// the common case (a write, read or send within bounds) takes the fewest branches.
[[gnu::always_inline]] inline PostResult Connection::Impl::check(Opcode op, std::span<const LocalSlice> local,
                                   const RemoteRegion& remote, std::uint64_t offset,
                                   std::uint64_t total) const noexcept {
  if (total > info.max_msg_size) [[unlikely]] return {PostStatus::too_large, 0};
  switch (op) {
    case Opcode::send: return {};
    case Opcode::write:
    case Opcode::write_with_imm: break;
    case Opcode::read: break;
    case Opcode::fetch_add:
    case Opcode::compare_swap:
      if (!info.atomics) return {PostStatus::unsupported, 0};
      if (local.size() != 1 || total != 8) return {PostStatus::bad_length, 0};
      if ((remote.addr + offset) % 8 != 0) return {PostStatus::misaligned, 0};
      break;
    default: return {PostStatus::unsupported, 0};
  }
  if (!remote.contains(offset, total)) [[unlikely]] return {PostStatus::out_of_bounds, 0};
  if (!allows(remote.access, remote_access_for(op))) [[unlikely]] return {PostStatus::no_access, 0};
  // READ and atomics write into local memory: the NIC needs local write access there, or the
  // operation would fail later as a LOC_PROT_ERR completion.
  if (op != Opcode::write && op != Opcode::write_with_imm) {
    for (const LocalSlice& s : local) {
      if (!s.writable()) return {PostStatus::no_access, 0};
    }
  }
  return {};
}

namespace {

bool may_inline(Opcode op, std::uint64_t total, std::uint32_t max_inline) {
  return total > 0 && total <= max_inline &&
         (op == Opcode::send || op == Opcode::write || op == Opcode::write_with_imm);
}

// The fields every send WR gets, from one request (the SGEs are already in place).
void fill_wr(ibv_send_wr& v, Opcode op, const RemoteRegion& remote, std::uint64_t offset,
             std::uint32_t imm, std::uint64_t compare_add, std::uint64_t swap) {
  v.opcode = verbs_opcode(op);
  v.imm_data = op == Opcode::write_with_imm ? htobe32(imm) : 0;
  if (is_atomic(op)) {
    v.wr.atomic.remote_addr = remote.addr + offset;
    v.wr.atomic.rkey = remote.rkey;
    v.wr.atomic.compare_add = compare_add;
    v.wr.atomic.swap = swap;
  } else {
    v.wr.rdma.remote_addr = remote.addr + offset;
    v.wr.rdma.rkey = remote.rkey;
  }
}

}  // namespace

// One signaled request with one SGE: post_write, post_read, post_send, the atomics. The same
// checks as a batch, without the batch machinery (this is the path latency-bound code takes).
PostResult Connection::Impl::post_one(Opcode op, const LocalSlice& local, const RemoteRegion& remote,
                                      std::uint64_t offset, std::uint32_t imm,
                                      std::uint64_t compare_add, std::uint64_t swap,
                                      std::uint64_t wr_id) noexcept {
  if (state != State::connected) [[unlikely]] return {PostStatus::not_ready, 0};
  if (sq.free() == 0) [[unlikely]] return {PostStatus::queue_full, 0};
  const std::uint64_t total = local.length();
  if (total > info.max_msg_size && (op == Opcode::write || op == Opcode::write_with_imm || op == Opcode::read))
      [[unlikely]] {
    return post_split(op, local, remote, offset, imm, wr_id);
  }
  if (const PostResult r = check(op, {&local, 1}, remote, offset, total); !r.ok()) [[unlikely]] {
    return r;
  }
  ibv_sge sge = to_sge(local);
  // Fields this path never sets stay zero from setup, so the WR is not cleared per call.
  ibv_send_wr& v = single_wr;
  v.wr_id = sq.next_seq();
  v.sg_list = &sge;
  v.num_sge = total == 0 ? 0 : 1;
  v.send_flags = IBV_SEND_SIGNALED | (may_inline(op, total, info.max_inline) ? IBV_SEND_INLINE : 0);
  fill_wr(v, op, remote, offset, imm, compare_add, swap);
  ibv_send_wr* bad = nullptr;
  if (const int rc = ibv_post_send(qp.get(), &v, &bad); rc != 0) [[unlikely]] {
    return {PostStatus::failed, rc, 0};
  }
  unsignaled_run = 0;
  sq.push({wr_id, op, true});
  return {};
}

// A WRITE or READ longer than the port's max message size, as consecutive requests of at most
// that size (RC keeps them in order). Only the last carries the immediate and the completion the
// caller asked for; an error in any part (and the flushes after it) is reported with the
// caller's wr_id. A SEND cannot be split: the receiver would see several messages.
PostResult Connection::Impl::post_split(Opcode op, const LocalSlice& local, const RemoteRegion& remote,
                                        std::uint64_t offset, std::uint32_t imm,
                                        std::uint64_t wr_id) noexcept {
  const std::uint64_t chunk = info.max_msg_size;
  const std::uint64_t parts = (local.length() + chunk - 1) / chunk;
  if (parts > split_reqs.size() || parts > sq.free()) return {PostStatus::queue_full, 0};
  for (std::uint64_t k = 0; k < parts; ++k) {
    split_slices[k] = local.subslice(k * chunk, chunk);
    WorkRequest& w = split_reqs[k];
    const bool last = k + 1 == parts;
    w = {};
    w.opcode = op == Opcode::write_with_imm && !last ? Opcode::write : op;
    w.local = {&split_slices[k], 1};
    w.remote = remote;
    w.remote_offset = offset + k * chunk;
    w.imm = imm;
    w.wr_id = wr_id;
    w.signaled = last;
  }
  return post_batch({split_reqs.data(), parts});
}

// One pass: each request is checked and written into the preallocated WR/SGE arrays; only when
// all passed is the chain handed to ibv_post_send, so a refused batch posts nothing.
PostResult Connection::Impl::post_batch(std::span<const WorkRequest> batch) noexcept {
  if (state != State::connected) [[unlikely]] return {PostStatus::not_ready, 0};
  if (batch.size() > sq.free()) [[unlikely]] return {PostStatus::queue_full, 0};
  if (batch.empty()) return {};

  const std::uint64_t seq0 = sq.next_seq();
  std::uint32_t run = unsignaled_run;
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
    if (PostResult r = check(w.opcode, w.local, w.remote, w.remote_offset, total); !r.ok()) [[unlikely]] {
      r.index = i;
      return r;
    }
    v.wr_id = seq0 + i;
    v.next = send_wrs.data() + i + 1;
    // Zero-length SGEs are dropped: a 0-byte operation carries no SGE at all.
    v.num_sge = total == 0 ? 0 : static_cast<int>(w.local.size());
    // Signal when asked, and at least once every half queue: otherwise the queue could fill with
    // requests whose completion is never reported, and nothing could reclaim them. Half, not
    // all: the forced completion then arrives while the other half can still be posted.
    const bool signal = w.signaled || run + 1 >= forced_signal_interval;
    run = signal ? 0 : run + 1;
    // Inline: the CPU copies the payload, so the NIC needs no DMA read and no lkey.
    v.send_flags = (signal ? IBV_SEND_SIGNALED : 0) |
                   (may_inline(w.opcode, total, info.max_inline) ? IBV_SEND_INLINE : 0);
    fill_wr(v, w.opcode, w.remote, w.remote_offset, w.imm, w.compare_add, w.swap);
  }
  send_wrs[batch.size() - 1].next = nullptr;

  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(qp.get(), send_wrs.data(), &bad);
  if (rc == 0) [[likely]] {
    unsignaled_run = run;
    for (const WorkRequest& w : batch) sq.push({w.wr_id, w.opcode, w.signaled});
    return {};
  }
  // The provider may have posted the requests before `bad`: account for exactly those.
  const std::size_t posted = bad != nullptr ? static_cast<std::size_t>(bad - send_wrs.data()) : 0;
  for (std::size_t i = 0; i < posted; ++i) {
    unsignaled_run = (send_wrs[i].send_flags & IBV_SEND_SIGNALED) != 0 ? 0 : unsignaled_run + 1;
    sq.push({batch[i].wr_id, batch[i].opcode, batch[i].signaled});
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
  const int rc = ibv_post_recv(qp.get(), recv_wrs.data(), &bad);
  const std::size_t posted =
      rc == 0 ? dsts.size() : bad != nullptr ? static_cast<std::size_t>(bad - recv_wrs.data()) : 0;
  for (std::size_t i = 0; i < posted; ++i) rq.push({first_wr_id + i, Opcode::recv, true});
  if (rc != 0) return {PostStatus::failed, rc, posted};
  return {};
}

namespace {

// Copies completions of one CQ into `out`; returns how many were news for the caller.
[[gnu::always_inline]] inline std::size_t reap_cq(ibv_cq* cq, detail::WrRing& ring,
                                                   std::span<Completion> out) noexcept {
  std::size_t n = 0;
  ibv_wc wc[detail::kPollBatch];
  while (n < out.size()) {
    const int want = static_cast<int>(std::min<std::size_t>(detail::kPollBatch, out.size() - n));
    const int got = ibv_poll_cq(cq, want, wc);
    for (int i = 0; i < got; ++i) {
      const detail::WrRing::Slot slot = ring.retire(wc[i].wr_id);
      // A completion the library forced (selective signaling) is bookkeeping, not news; an
      // error is always news.
      if (wc[i].status == IBV_WC_SUCCESS && !slot.user_signaled) continue;
      Completion& c = out[n++];
      c.wr_id = slot.wr_id;
      c.opcode = slot.op;
      c.status = wc[i].status;
      c.vendor_err = wc[i].vendor_err;
      c.byte_len = wc[i].byte_len;
      c.has_imm = wc[i].status == IBV_WC_SUCCESS && (wc[i].wc_flags & IBV_WC_WITH_IMM) != 0;
      c.imm = c.has_imm ? be32toh(wc[i].imm_data) : 0;
    }
    if (got < want) break;
  }
  return n;
}

}  // namespace

[[gnu::always_inline]] inline std::size_t Connection::Impl::poll(std::span<Completion> out) noexcept {
  // A queue with nothing in flight has nothing to report: skip its provider call (it costs real
  // time per spin in a latency loop).
  std::size_t n = sq.count() != 0 ? reap_cq(send_cq.get(), sq, out) : 0;
  if (rq.count() != 0 && n < out.size()) n += reap_cq(recv_cq.get(), rq, out.subspan(n));
  return n;
}

// Reaps completions until the send queue (and, with `receives`, the receive queue) is empty or
// the deadline passes.
void Connection::Impl::drain(Deadline deadline, bool receives) noexcept {
  std::array<Completion, detail::kPollBatch> sink;
  while (sq.count() + (receives ? rq.count() : 0) > 0 && Clock::now() < deadline) {
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
  return impl_->post_one(Opcode::write, src, dst, offset, 0, 0, 0, wr_id);
}

PostResult Connection::post_write_with_imm(const LocalSlice& src, const RemoteRegion& dst,
                                           std::uint64_t offset, std::uint32_t imm,
                                           std::uint64_t wr_id) noexcept {
  return impl_->post_one(Opcode::write_with_imm, src, dst, offset, imm, 0, 0, wr_id);
}

PostResult Connection::post_read(const LocalSlice& dst, const RemoteRegion& src,
                                 std::uint64_t offset, std::uint64_t wr_id) noexcept {
  return impl_->post_one(Opcode::read, dst, src, offset, 0, 0, 0, wr_id);
}

PostResult Connection::post_send(const LocalSlice& src, std::uint64_t wr_id) noexcept {
  return impl_->post_one(Opcode::send, src, {}, 0, 0, 0, 0, wr_id);
}

PostResult Connection::post_fetch_add(const LocalSlice& old_value, const RemoteRegion& dst,
                                      std::uint64_t offset, std::uint64_t add,
                                      std::uint64_t wr_id) noexcept {
  return impl_->post_one(Opcode::fetch_add, old_value, dst, offset, 0, add, 0, wr_id);
}

PostResult Connection::post_compare_swap(const LocalSlice& old_value, const RemoteRegion& dst,
                                         std::uint64_t offset, std::uint64_t compare,
                                         std::uint64_t swap, std::uint64_t wr_id) noexcept {
  return impl_->post_one(Opcode::compare_swap, old_value, dst, offset, 0, compare, swap, wr_id);
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
  return impl_->sq.count() + impl_->rq.count();
}

WaitResult Connection::wait(std::chrono::milliseconds timeout) noexcept {
  WaitResult r;
  // A completion that is already there costs one poll and nothing else: no clock read, no
  // syscall. Busy waiting then spins like perftest does (no sched_yield: a syscall on the spin
  // path added microseconds to every slow-ish completion); the clock is read every 256 empty
  // polls, and the control channel (a syscall) looked at about once a millisecond.
  if (impl_->poll({&r.completion, 1}) == 1) {
    r.status = WaitStatus::completed;
    return r;
  }
  const Deadline start = Clock::now();
  const Deadline deadline = start + timeout;
  Deadline next_control = start;
  for (std::uint32_t spin = 1;; ++spin) {
    if (impl_->poll({&r.completion, 1}) == 1) {
      r.status = WaitStatus::completed;
      return r;
    }
    if ((spin & 0xff) != 0) continue;
    const Deadline now = Clock::now();
    if (now >= next_control || impl_->channel) {
      next_control = now + std::chrono::milliseconds{1};
      impl_->pump_control();
      if (impl_->control_gone) {
        // One last look: the completion may have arrived just before the peer went.
        r.status = impl_->poll({&r.completion, 1}) == 1 ? WaitStatus::completed : WaitStatus::peer_lost;
        return r;
      }
    }
    if (now >= deadline) {
      r.status = WaitStatus::timeout;
      return r;
    }
    if (impl_->channel && impl_->sleep_for_event(deadline, r.completion)) {
      r.status = WaitStatus::completed;
      return r;
    }
  }
}

}  // namespace rdmakit
