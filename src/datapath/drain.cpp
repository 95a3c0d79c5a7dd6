// SPDX-License-Identifier: Apache-2.0
// How work ends: the one break routine, the one drain routine (every QP to ERR, plus a marker
// that retires trailing unsignaled requests), close's settle-then-shut, and the wait loop with
// its sleep on the completion channel.
#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "datapath/datapath.hpp"
#include "datapath/router.hpp"
#include "trace.hpp"

namespace rdmakit::detail {

void DataPath::break_connection(std::string why, BreakCause cause) noexcept {
  if (cause_ != BreakCause::none || mode_ == Mode::closed || lane_count_ == 0) return;
  failure_ = std::move(why);
  if (failure_.empty()) failure_ = "the connection broke";
  cause_ = cause;
  set_mode(Mode::broken);
  flush_all();
}

// Moves every QP to ERR: each outstanding request then completes, flushed, in order. A request
// that had already succeeded unsignaled produces no completion at all, so where the newest
// request of a QP was unsignaled a signaled marker follows it; its flush retires the rest (the
// kernel's ib_drain_sq does the same). Markers are posted by the next poll (post_markers), after
// whatever completions are being taken: that also makes room in a full queue.
void DataPath::flush_all() noexcept {
  for (Lane& l : lanes()) {
    if (l.qp == nullptr || l.in_error) continue;
    if (ops_->to_error(l.qp) != 0) continue;  // never post a marker to a QP that is not in ERR
    l.in_error = true;
    if (l.sq.count() > 0 && l.unsignaled_run > 0) {
      l.needs_marker = true;
      markers_pending_ = true;
    }
  }
}

void DataPath::post_markers() noexcept {
  markers_pending_ = false;
  for (Lane& l : lanes()) {
    if (!l.needs_marker) continue;
    // Entries retired since the break may have taken every unsignaled one with them.
    if (l.sq.count() == 0 || l.unsignaled_run == 0) {
      l.needs_marker = false;
      continue;
    }
    // A full queue gets room once its signaled requests' flushes are polled (one is at most
    // half a queue back): try again after the next poll.
    if (l.sq.free() == 0) {
      markers_pending_ = true;
      continue;
    }
    // Never executed (the QP is in ERR): only its flush completion matters.
    (void)post_marker(l, IBV_WR_SEND, nullptr);
    l.needs_marker = false;
  }
}

// A signaled request with no SGE behind a QP's unsignaled ones: its completion retires them
// (the drain routine's, on a QP in ERR) or shows they are done (settle's, on a QP in RTS: a
// zero-length WRITE or READ into a region the peer advertised touches no memory).
bool DataPath::post_marker(Lane& lane, ibv_wr_opcode opcode, const RemoteRegion* target) noexcept {
  ibv_send_wr v{};
  v.wr_id = lane.wr_id(lane.sq.next_seq());
  v.opcode = opcode;
  v.send_flags = IBV_SEND_SIGNALED;
  if (target != nullptr) {
    v.wr.rdma.remote_addr = target->addr;
    v.wr.rdma.rkey = target->rkey;
  }
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(lane.qp, &v, &bad) != 0) return false;
  const Opcode op = opcode == IBV_WR_RDMA_WRITE ? Opcode::write : opcode == IBV_WR_RDMA_READ ? Opcode::read
                                                                                               : Opcode::send;
  lane.sq.push({0, op, WrRing::marker, false});
  lane.unsignaled_run = 0;
  return true;
}

void DataPath::settle(Deadline deadline, Housekeeping& hk) noexcept {
  unobservable_ = 0;
  if (routed()) return;  // the shared CQs' owner reaps; it settles by waiting for outstanding() == 0
  std::array<Completion, kPollBatch> sink;
  Deadline next_tick{};
  while (mode_ == Mode::ready && sends_in_flight() > 0) {
    bool observable = false;  // some QP has a signaled request left whose completion will show
    std::uint32_t blind = 0;
    for (Lane& l : lanes()) {
      if (l.sq.count() == 0) continue;
      if (l.unsignaled_run > 0 &&
          !(settle_target_ != nullptr && l.sq.free() > 0 && post_marker(l, settle_opcode_, settle_target_))) {
        // A full queue makes room as its signaled requests complete (one is at most half a
        // queue back); with nothing to aim a marker at, the QP's requests cannot be observed.
        if (l.sq.free() == 0) {
          observable = true;
        } else {
          ++blind;
        }
      }
      if (l.unsignaled_run == 0) observable = true;
    }
    unobservable_ = blind;
    if (!observable) return;
    if (poll(sink) > 0) continue;
    const Deadline now = Clock::now();
    if (now >= deadline) return;
    if (now >= next_tick) {
      next_tick = now + std::chrono::milliseconds{1};
      hk.tick(now);
    }
    ::sched_yield();
  }
}

std::uint32_t DataPath::shut(Deadline deadline) noexcept {
  if (lane_count_ == 0) return 0;
  if (mode_ != Mode::closed) {
    set_mode(Mode::closed);
    flush_all();
  }
  reap_until(deadline, true);
  return outstanding();
}

void DataPath::forget_qps() noexcept {
  if (routed()) {
    for (const Lane& l : lanes()) send_router_->detach(l.id);
    recv_router_->detach(rq_tag_);
    send_router_ = recv_router_ = nullptr;
  }
  for (Lane& l : lanes()) {
    l.qp = nullptr;
    l.sq.clear();
    l.needs_marker = false;
  }
  rq_.clear();
  markers_pending_ = false;
  drop_extended();  // (the send CQ is its owner's; nothing is polled through it now)
  set_mode(Mode::closed);
}

void DataPath::reap_until(Deadline deadline, bool receives) noexcept {
  if (routed()) return;  // the shared CQs' owner reaps
  std::array<Completion, kPollBatch> sink;
  while (sends_in_flight() + (receives ? rq_.count() : 0) > 0 && Clock::now() < deadline) {
    if (poll(sink) == 0) ::sched_yield();
  }
}

// After arming, a completion that was already in a CQ raises no event, and one bookkeeping entry
// (a forced signal, a non-final part) can sit in front of the caller's: poll until there is news
// or the CQs are empty, never just once.
bool DataPath::poll_until_news(Completion& out) noexcept {
  ibv_wc wc;
  while (ibv_poll_cq(send_cq_, 1, &wc) == 1) {
    if (take_send(wc, out)) return true;
  }
  while (ibv_poll_cq(recv_cq_, 1, &wc) == 1) {
    if (take_recv(wc, out)) return true;
  }
  if (markers_pending_) post_markers();
  return false;
}

bool DataPath::sleep_until_event(Deadline deadline, int wake_fd, Completion& out) noexcept {
  if (ibv_req_notify_cq(send_cq_, 0) != 0 || ibv_req_notify_cq(recv_cq_, 0) != 0) return false;
  if (poll_until_news(out)) return true;
  pollfd fds[2] = {{channel_->fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  // +1 ms: poll() would otherwise wake just before the deadline and loop once more for nothing.
  const int ms = static_cast<int>(std::clamp<long long>(left.count(), 0, 1 << 30)) + 1;
  if (::poll(fds, 2, ms) > 0 && (fds[0].revents & POLLIN) != 0) {
    ibv_cq* cq = nullptr;
    void* ctx = nullptr;
    while (ops_->get_cq_event(channel_, &cq, &ctx) == 0) ops_->ack_cq_events(cq, 1);
  }
  return false;
}

WaitResult DataPath::wait(std::chrono::milliseconds timeout, Housekeeping& hk) noexcept {
  WaitResult r;
  // A completion that arrives within the first 256 polls costs no clock read and no syscall
  // (the deadline starts counting after them, a few microseconds late). Busy waiting then spins
  // like perftest does (no sched_yield: a syscall on the spin path added microseconds to every
  // slow-ish completion); the clock is read every 256 empty polls, and housekeeping (syscalls)
  // runs about once a millisecond.
  Deadline deadline{};
  Deadline next_tick{};
  for (std::uint32_t spin = 0;; ++spin) {
    if (poll({&r.completion, 1}) == 1) {
      r.status = WaitStatus::completed;
      return r;
    }
    if ((spin & 0xff) != 0xff) continue;
    const Deadline now = Clock::now();
    if (spin == 0xff) deadline = now + timeout;
    if (now >= next_tick || channel_ != nullptr) {
      next_tick = now + std::chrono::milliseconds{1};
      hk.tick(now);
      if (cause_ != BreakCause::none && !break_reported_) {
        // Reported once; what was outstanding is being flushed and comes in later waits.
        break_reported_ = true;
        r.status = cause_ == BreakCause::device ? WaitStatus::device_error : WaitStatus::peer_lost;
        emit(trace_, [&] {
          return TraceEvent{cause_ == BreakCause::device ? "device_error" : "peer_lost",
                            {{"peer", peer_},
                             {"outstanding", std::to_string(outstanding())},
                             {"why", failure_}}};
        });
        return r;
      }
    }
    if ((mode_ == Mode::broken || mode_ == Mode::closed) && outstanding() == 0) {
      r.status = WaitStatus::closed;
      return r;
    }
    if (now >= deadline) {
      r.status = WaitStatus::timeout;
      return r;
    }
    // Flushed completions raise events too, so a broken connection sleeps as well.
    if (channel_ != nullptr && mode_ != Mode::closed && sleep_until_event(deadline, hk.wake_fd(), r.completion)) {
      r.status = WaitStatus::completed;
      return r;
    }
  }
}

}  // namespace rdmakit::detail
