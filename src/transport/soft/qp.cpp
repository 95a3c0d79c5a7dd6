// SPDX-License-Identifier: Apache-2.0
// A software RC queue pair (qp.hpp): its life, the requester, and how it fails. Its streams'
// I/O and the responder are in streams.cpp.
#include "transport/soft/qp.hpp"

#include "transport/soft/stream.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail::soft {

Qp::Qp(Device& dev, Cq& cq, QpConfig cfg, std::vector<Fd> streams, std::unique_ptr<Crossing> crossing)
    : dev_(dev), cq_(cq), cfg_(std::move(cfg)), crossing_(std::move(crossing)) {
  if (streams.empty()) throw Error("soft QP", EINVAL, "no data stream");
  if (crossing_ && crossing_->one_stream() && streams.size() != 1) {
    throw Error("soft QP", EINVAL, "this link's crossing (a shared ring, shared memory) takes one stream");
  }
  std::size_t n = 1;
  while (n < 2 * std::max<std::uint32_t>(cfg_.send_depth, 1)) n *= 2;
  reqs_.resize(n);
  mask_ = n - 1;
  qp_.context = dev.context();
  qp_.qp_context = this;
  qp_.pd = dev.pd();
  qp_.send_cq = qp_.recv_cq = cq.cq();
  qp_.qp_num = cfg_.qp_num;
  qp_.state = IBV_QPS_RTS;
  qp_.qp_type = IBV_QPT_RC;
  for (auto& f : streams) {
    const int flags = ::fcntl(f.get(), F_GETFL);
    if (flags < 0 || ::fcntl(f.get(), F_SETFL, flags | O_NONBLOCK) < 0) throw Error("fcntl(O_NONBLOCK)", errno, "a data stream");
    streams_.push_back(std::make_unique<Stream>(*this, std::move(f), static_cast<std::uint32_t>(streams_.size())));
  }
}

void Qp::start() {
  if (started_) return;
  cq_.attach(this);
  started_ = true;
  if (error_) return;
  for (auto& s : streams_) cq_.watch(s->fd.get(), s.get());
  // What arrived before is read now (the channel's set reports it too: level-triggered).
}

Qp::~Qp() {
  // (The crossing lets go of the peer's memory as it goes: before the windows and streams.)
  for (auto& [key, mw] : windows_) {
    mw->bound = nullptr;
    mw->key = 0;
  }
  windows_.clear();
  if (!started_) return;
  for (auto& s : streams_) {
    cq_.unwatch(s->fd.get());
    cq_.forget(s.get());
  }
  cq_.detach(this);
}

// --- the requester ---------------------------------------------------------------------------------

int Qp::take(const ibv_send_wr& w) noexcept {
  if (tail_ - head_ == reqs_.size()) return ENOMEM;
  Req r;
  r.wr_id = w.wr_id;
  r.signaled = (w.send_flags & IBV_SEND_SIGNALED) != 0;
  const bool one_sge = w.num_sge == 1 && w.sg_list != nullptr;
  if (w.num_sge > 1 || (w.num_sge == 1 && w.sg_list == nullptr)) return EINVAL;  // one SGE (max_sge 1)
  r.laddr = one_sge ? w.sg_list->addr : 0;
  r.length = one_sge ? w.sg_list->length : 0;
  switch (w.opcode) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_READ:
      r.opcode = w.opcode == IBV_WR_RDMA_WRITE ? IBV_WC_RDMA_WRITE : IBV_WC_RDMA_READ;
      r.raddr = w.wr.rdma.remote_addr;
      r.rkey = w.wr.rdma.rkey;
      r.op = w.opcode == IBV_WR_RDMA_WRITE ? FrameOp::write : FrameOp::read;
      if (crossing_) r.op = crossing_->op(r, w.opcode == IBV_WR_RDMA_WRITE);
      break;
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
    case IBV_WR_ATOMIC_CMP_AND_SWP:
      if (r.length != 8 && !error_) return EINVAL;
      r.op = w.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ? FrameOp::fetch_add : FrameOp::compare_swap;
      r.opcode = w.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ? IBV_WC_FETCH_ADD : IBV_WC_COMP_SWAP;
      r.raddr = w.wr.atomic.remote_addr;
      r.rkey = w.wr.atomic.rkey;
      r.arg0 = w.wr.atomic.compare_add;
      r.arg1 = w.wr.atomic.swap;
      break;
    case IBV_WR_BIND_MW:
      r.opcode = IBV_WC_BIND_MW;
      r.issued = r.done = true;
      if (!error_ && !bind(w)) r.status = IBV_WC_MW_BIND_ERR;
      break;
    default:
      // SEND and WRITE_WITH_IMM have no receiver here; on a queue pair in error anything is
      // taken (and flushed), as the drain routine's markers are.
      if (!error_) return EOPNOTSUPP;
      r.opcode = IBV_WC_SEND;
  }
  if (error_) {
    r.issued = r.done = true;
    r.status = IBV_WC_WR_FLUSH_ERR;
  }
  req(tail_++) = r;
  return 0;
}

int Qp::post_send(ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
  int rc = 0;
  for (ibv_send_wr* w = wr; w != nullptr; w = w->next) {
    if ((rc = take(*w)) != 0) {
      *bad = w;  // those before it were taken, and go now
      break;
    }
  }
  issue();
  for (auto& s : streams_) {
    if (!s->out_empty() && !s->watch_out && !error_) {
      // Sent now (the latency of a small request is this call); a request that waited for
      // room to answer it is read again once there is some.
      if (send(*s)) pump(*s);
    }
  }
  complete_ready();
  return rc;
}

int Qp::post_recv(ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
  for (ibv_recv_wr* w = wr; w != nullptr; w = w->next) {
    try {
      recvs_.push_back(w->wr_id);
    } catch (...) {
      *bad = w;
      return ENOMEM;
    }
    if (error_) {
      ibv_wc wc{};
      wc.wr_id = w->wr_id;
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      wc.qp_num = qp_.qp_num;
      cq_.push(wc);
      recvs_.pop_front();
    }
  }
  return 0;
}

bool Qp::bind(const ibv_send_wr& w) noexcept {
  Mw& mw = *reinterpret_cast<Mw*>(w.bind_mw.mw);
  if (mw.mw.context != qp_.context || mw.mw.type != IBV_MW_TYPE_2) return false;
  if (mw.bound != nullptr) mw.bound->unbind(mw);
  try {
    windows_[w.bind_mw.rkey] = &mw;
  } catch (...) {
    return false;
  }
  mw.bound = this;
  mw.key = w.bind_mw.rkey;
  mw.mw.rkey = w.bind_mw.rkey;
  mw.addr = w.bind_mw.bind_info.addr;
  mw.length = w.bind_mw.bind_info.length;
  mw.access = w.bind_mw.bind_info.mw_access_flags;
  return true;
}

void Qp::unbind(Mw& mw) noexcept {
  if (mw.bound != this) return;
  windows_.erase(mw.key);
  for (auto& s : streams_) {
    // A WRITE into it, half received: the rest is discarded, and the request refused.
    if (s->in_payload && !s->cur.response() && s->cur.rkey == mw.key && s->dst != nullptr) {
      s->dst = nullptr;
      s->verdict = FrameStatus::access;
    }
    // READ answers from it not sent yet: their data is copied now (the memory may go next).
    for (std::uint64_t i = s->out_head; i != s->out_tail; ++i) {
      Out& o = s->out[i % s->out.size()];
      if (!o.answer || o.rkey != mw.key || o.data == nullptr || o.copy) continue;
      o.copy.reset(new (std::nothrow) std::uint8_t[o.len]);
      if (!o.copy) return fail("out of memory copying a READ's answer from a window that went", nullptr, true);
      std::memcpy(o.copy.get(), o.data, o.len);
      o.data = o.copy.get();
    }
  }
  mw.bound = nullptr;
  mw.key = 0;
}

void Qp::shares_changed() noexcept {
  if (!crossing_) return;
  Stream* s = error_ ? nullptr : streams_[0].get();
  if (crossing_->shares_changed(s) && s != nullptr && !s->watch_out && send(*s)) cq_.again(s);
}

void Qp::issue() noexcept {
  if (crossing_ && !error_ && !crossing_->before_requests(*streams_[0])) return;  // in order: before any request
  while (issue_ < tail_ && !error_) {
    Req& r = req(issue_);
    if (r.issued) {
      ++issue_;
      issue_off_ = 0;
      continue;
    }
    // The next stream in turn with room for a frame and its answer; atomics all on the first,
    // so they stay in the order they were posted, as on one RC QP (WRITEs and READs of several
    // frames are spread, as a transfer is over rails: docs/engine.md).
    Stream* s = nullptr;
    if (r.op == FrameOp::fetch_add || r.op == FrameOp::compare_swap) {
      Stream& c = *streams_[0];
      if (c.out_full() || c.owed() >= kRequestFrames) return;
      s = &c;
    }
    for (std::size_t k = 0; k < streams_.size() && s == nullptr; ++k) {
      Stream& c = *streams_[(next_stream_ + k) % streams_.size()];
      if (!c.out_full() && c.owed() < kRequestFrames) {
        s = &c;
        next_stream_ = (next_stream_ + k + 1) % streams_.size();
        break;
      }
    }
    if (s == nullptr) return;  // an answer or a send makes room
    const std::uint32_t len = std::min(kMaxChunk, r.length - issue_off_);
    Frame f;
    f.op = static_cast<std::uint8_t>(r.op);
    f.length = len;
    f.raddr = r.raddr + issue_off_;
    f.rkey = r.rkey;
    f.arg0 = r.arg0;
    f.arg1 = r.arg1;
    Expect e{issue_, 0, issue_off_, len, r.op, 0, 0};
    auto framed = Crossing::Framed::queued;
    if (crossed(r.op)) {
      framed = crossing_ ? crossing_->frame(*s, r, issue_off_, len, f, e) : Crossing::Framed::queued;
      if (framed == Crossing::Framed::later) return;
      e.op = r.op;
    }
    f.id = e.id = s->next_id++;
    const bool inline_data = r.op == FrameOp::write;
    (void)s->push_out(f, false, inline_data ? reinterpret_cast<const std::uint8_t*>(r.laddr + issue_off_) : nullptr,
                      inline_data ? len : 0);
    s->expect[s->exp_tail++ % s->expect.size()] = e;
    if (s->owed() == 1) s->last_in = Clock::now();  // the answer's clock starts now
    ++r.pending;
    issue_off_ += len;
    if (issue_off_ >= r.length) {
      r.issued = true;
      ++issue_;
      issue_off_ = 0;
    }
    if (framed == Crossing::Framed::send_now && !s->watch_out && send(*s)) cq_.again(s);
  }
}

void Qp::drain(Stream& s) noexcept {
  for (;;) {
    const ssize_t n = ::recv(s.fd.get(), s.stage.data(), s.stage.size(), MSG_DONTWAIT);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
      s.closed = true;  // the peer closed its side: it serves nothing more
      cq_.unwatch(s.fd.get());
    }
    break;
  }
  if (std::all_of(streams_.begin(), streams_.end(), [](const auto& o) { return o->closed; })) end_drain();
}

void Qp::end_drain() noexcept {
  if (!draining_) return;
  draining_ = false;
  for (auto& o : streams_) {
    (void)::shutdown(o->fd.get(), SHUT_RDWR);
    if (!o->closed) cq_.unwatch(o->fd.get());
  }
  complete_ready();
}

void Qp::complete_ready() noexcept {
  if (draining_) return;  // fail(): not before the peer can no longer copy
  while (head_ < tail_) {
    Req& r = req(head_);
    if (!r.done) break;
    if (r.signaled || r.status != IBV_WC_SUCCESS) {
      ibv_wc wc{};
      wc.wr_id = r.wr_id;
      wc.status = r.status;
      wc.opcode = r.opcode;
      wc.qp_num = qp_.qp_num;
      wc.byte_len = r.opcode == IBV_WC_RDMA_READ ? r.length : 0;
      cq_.push(wc);
    }
    if (crossing_ && crossed(r.op) && r.status == IBV_WC_SUCCESS) crossing_->completed(r);
    ++head_;
  }
  if (issue_ < head_) {
    issue_ = head_;
    issue_off_ = 0;
  }
}

void Qp::to_error() noexcept { fail("moved to the error state", nullptr, false); }

void Qp::fault(std::string why) noexcept { fail(std::move(why), nullptr, true); }

void Qp::fail(std::string why, Req* first, bool fault) noexcept {
  if (error_) return;
  error_ = true;
  qp_.state = IBV_QPS_ERR;
  try {
    failure_ = std::move(why);
  } catch (...) {
  }
  for (std::uint64_t seq = head_; seq < tail_; ++seq) {
    Req& r = req(seq);
    if (&r == first) {
      r.done = r.issued = true;
      continue;
    }
    if (r.done) continue;
    r.done = r.issued = true;
    r.status = IBV_WC_WR_FLUSH_ERR;
  }
  while (!recvs_.empty()) {
    ibv_wc wc{};
    wc.wr_id = recvs_.front();
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = qp_.qp_num;
    cq_.push(wc);
    recvs_.pop_front();
  }
  // As on RC, the peer's side fails too: it reads the end of each stream. Through a crossing,
  // requests the peer has not answered may still be served by it, copying into and out of this
  // process: their completions wait until the peer has closed every stream (it saw the end:
  // it serves nothing after that), or a second has passed (a peer that sleeps that long sees
  // the end before anything else when it wakes: gave_up() in streams.cpp).
  const bool answers_owed = std::any_of(streams_.begin(), streams_.end(), [](const auto& o) { return o->owed() > 0; });
  draining_ = crossing_ && crossing_->peer_reaches_memory() && started_ && answers_owed;
  // What the peer shared is let go now: it serves nothing more (its pages are its own again).
  if (crossing_) crossing_->drop();
  if (draining_) drain_until_ = Clock::now() + std::chrono::milliseconds{1000};
  for (auto& s : streams_) {
    s->exp_head = s->exp_tail;
    if (draining_) {
      (void)::shutdown(s->fd.get(), SHUT_WR);
      s->held = false;
      cq_.rewatch(s->fd.get(), s.get(), true, false);
      continue;
    }
    (void)::shutdown(s->fd.get(), SHUT_RDWR);
    if (started_) cq_.unwatch(s->fd.get());
  }
  complete_ready();
  if (fault && cfg_.on_fault) {
    try {
      cfg_.on_fault(failure_);
    } catch (...) {
    }
  }
}

bool Qp::answer(Stream& s, const Frame& f) noexcept {
  if (s.owed() == 0) return false;
  const Expect& e = s.expect[s.exp_head % s.expect.size()];
  if (e.id != f.id || e.op != f.request_op()) return false;
  Req& r = req(e.req);
  const bool data = f.request_op() == FrameOp::read && f.status == FrameStatus::ok;
  if (f.length != (data ? e.len : 0)) return false;  // only a READ's answer carries data, all of it
  if (f.status != FrameStatus::ok) {
    if (r.status == IBV_WC_SUCCESS) r.status = wc_status(f.status);
  } else if (data) {
    s.dst = reinterpret_cast<std::uint8_t*>(r.laddr + e.offset);
  } else if (crossed(f.request_op())) {
    if (crossing_) crossing_->answered_ok(e, r);
  } else if (f.request_op() == FrameOp::fetch_add || f.request_op() == FrameOp::compare_swap) {
    std::memcpy(reinterpret_cast<void*>(r.laddr), &f.arg0, sizeof f.arg0);
  }
  return true;
}

void Qp::answered(Stream& s) noexcept {
  const Expect e = s.expect[s.exp_head++ % s.expect.size()];
  s.last_in = Clock::now();
  if (crossing_ && crossed(e.op)) crossing_->release(e);
  Req& r = req(e.req);
  --r.pending;
  if (r.status != IBV_WC_SUCCESS) {
    const auto st = r.status;
    return fail(fmt::format("the peer refused a request on data stream {}: {}", s.index, ibv_wc_status_str(st)), &r, false);
  }
  if (r.issued && r.pending == 0) r.done = true;
}

}  // namespace rdmakit::detail::soft
