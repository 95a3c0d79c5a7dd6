// SPDX-License-Identifier: Apache-2.0
#include "fake_verbs.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>
#include <utility>

namespace fake {

Verbs::Verbs() {
  context_.self = this;
  ibv_context_ops& o = context_.ctx.ops;
  o.post_send = post_send;
  o.post_recv = post_recv;
  o.poll_cq = poll_cq;
  o.req_notify_cq = req_notify_cq;
}

Verbs::~Verbs() {
  for (Channel& c : channels_) ::close(c.ch.fd);
}

const rdmakit::detail::VerbsOps& Verbs::ops() const {
  static constexpr rdmakit::detail::VerbsOps o{to_error, get_cq_event, ack_cq_events};
  return o;
}

ibv_comp_channel* Verbs::channel() {
  Channel& c = channels_.emplace_back();
  c.ch.context = &context_.ctx;
  c.ch.fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (c.ch.fd < 0) throw std::runtime_error("eventfd");
  return &c.ch;
}

ibv_cq* Verbs::cq(ibv_comp_channel* channel) {
  Cq& c = cqs_.emplace_back();
  c.cq.context = &context_.ctx;
  c.cq.channel = channel;
  c.cq.cq_context = &c;
  return &c.cq;
}

ibv_qp* Verbs::qp(ibv_cq* send_cq, ibv_cq* recv_cq, std::uint32_t qpn) {
  Qp& q = qps_.emplace_back();
  q.qp.context = &context_.ctx;
  q.qp.qp_context = &q;
  q.qp.send_cq = send_cq;
  q.qp.recv_cq = recv_cq;
  q.qp.qp_num = qpn;
  q.qp.state = IBV_QPS_RTS;
  q.qp.qp_type = IBV_QPT_RC;
  return &q.qp;
}

ibv_wc Verbs::wc_for(const Qp& q, std::uint64_t wr_id, ibv_wc_status status, ibv_wc_opcode op) {
  ibv_wc wc{};
  wc.wr_id = wr_id;
  wc.status = status;
  wc.opcode = op;
  wc.qp_num = q.qp.qp_num;
  return wc;
}

// A completion entering a CQ raises one event on its channel if the CQ is armed (and disarms it),
// as the verbs rule says; entries that were there before arming raise none.
void Verbs::push(ibv_cq* cq, const ibv_wc& wc) {
  Cq& c = cq_of(cq);
  c.entries.push_back(wc);
  if (c.armed && cq->channel != nullptr) {
    c.armed = false;
    for (Channel& ch : channels_) {
      if (&ch.ch == cq->channel) ch.pending.push_back(cq);
    }
    const std::uint64_t one = 1;
    if (::write(cq->channel->fd, &one, sizeof one) != sizeof one) throw std::runtime_error("eventfd write");
    ++events_;
  }
}

void Verbs::flush(Qp& q) {
  while (!q.sq.empty()) {
    push(q.qp.send_cq, wc_for(q, q.sq.front().wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_SEND));
    q.sq.pop_front();
  }
  while (!q.rq.empty()) {
    push(q.qp.recv_cq, wc_for(q, q.rq.front().wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV));
    q.rq.pop_front();
  }
}

void Verbs::complete(ibv_qp* qp, std::size_t n, ibv_wc_status status, std::uint32_t vendor_err) {
  Qp& q = qp_of(qp);
  for (std::size_t i = 0; i < n && !q.sq.empty(); ++i) {
    const Wr w = q.sq.front();
    q.sq.pop_front();
    if (status != IBV_WC_SUCCESS) {
      ibv_wc wc = wc_for(q, w.wr_id, status, IBV_WC_SEND);
      wc.vendor_err = vendor_err;
      push(qp->send_cq, wc);
      q.error = true;
      flush(q);
      return;
    }
    if (w.signaled()) push(qp->send_cq, wc_for(q, w.wr_id, IBV_WC_SUCCESS, IBV_WC_SEND));
  }
}

void Verbs::complete_recv(ibv_qp* qp, std::size_t n, std::uint32_t byte_len, ibv_wc_status status) {
  Qp& q = qp_of(qp);
  for (std::size_t i = 0; i < n && !q.rq.empty(); ++i) {
    ibv_wc wc = wc_for(q, q.rq.front().wr_id, status, IBV_WC_RECV);
    wc.byte_len = byte_len;
    q.rq.pop_front();
    push(qp->recv_cq, wc);
    if (status != IBV_WC_SUCCESS) {
      q.error = true;
      flush(q);
      return;
    }
  }
}

bool Verbs::failing_call() {
  if (fail_post_at_ < 0) return false;
  if (fail_after_calls_ > 0) {
    --fail_after_calls_;
    return false;
  }
  return true;
}

int Verbs::post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Verbs& v = of(qp->context);
  Qp& q = qp_of(qp);
  const int fail_at = v.failing_call() ? std::exchange(v.fail_post_at_, -1) : -1;
  int i = 0;
  for (ibv_send_wr* w = wr; w != nullptr; w = w->next, ++i) {
    if (i == fail_at) {
      *bad = w;
      return EINVAL;
    }
    const bool atomic = w->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || w->opcode == IBV_WR_ATOMIC_CMP_AND_SWP;
    Wr taken{w->wr_id, w->opcode, w->send_flags, w->num_sge, {w->sg_list, w->sg_list + w->num_sge},
             atomic ? w->wr.atomic.remote_addr : w->wr.rdma.remote_addr, atomic ? w->wr.atomic.rkey : w->wr.rdma.rkey,
             w->imm_data, atomic ? w->wr.atomic.compare_add : 0, atomic ? w->wr.atomic.swap : 0};
    q.history.push_back(taken);
    if (q.error) {
      // A QP in ERR completes every new request at once, flushed.
      v.push(qp->send_cq, wc_for(q, w->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_SEND));
    } else {
      q.sq.push_back(taken);
    }
  }
  return 0;
}

int Verbs::post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Verbs& v = of(qp->context);
  Qp& q = qp_of(qp);
  const int fail_at = v.failing_call() ? std::exchange(v.fail_post_at_, -1) : -1;
  int i = 0;
  for (ibv_recv_wr* w = wr; w != nullptr; w = w->next, ++i) {
    if (i == fail_at) {
      *bad = w;
      return EINVAL;
    }
    Recv r{w->wr_id, {w->sg_list, w->sg_list + w->num_sge}};
    q.recv_history.push_back(r);
    if (q.error) {
      v.push(qp->recv_cq, wc_for(q, w->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV));
    } else {
      q.rq.push_back(r);
    }
  }
  return 0;
}

int Verbs::poll_cq(ibv_cq* cq, int n, ibv_wc* wc) {
  Cq& c = cq_of(cq);
  int got = 0;
  while (got < n && !c.entries.empty()) {
    wc[got++] = c.entries.front();
    c.entries.pop_front();
  }
  return got;
}

int Verbs::req_notify_cq(ibv_cq* cq, int) {
  Verbs& v = of(cq->context);
  if (v.on_arm) {
    auto f = std::move(v.on_arm);
    v.on_arm = nullptr;
    f();
  }
  cq_of(cq).armed = true;
  return 0;
}

int Verbs::to_error(ibv_qp* qp) noexcept {
  Verbs& v = of(qp->context);
  Qp& q = qp_of(qp);
  q.error = true;
  q.qp.state = IBV_QPS_ERR;
  v.flush(q);
  return 0;
}

int Verbs::get_cq_event(ibv_comp_channel* ch, ibv_cq** cq, void** ctx) noexcept {
  Verbs& v = of(ch->context);
  for (Channel& c : v.channels_) {
    if (&c.ch != ch || c.pending.empty()) continue;
    std::uint64_t count = 0;
    (void)::read(ch->fd, &count, sizeof count);  // drains the eventfd; events are counted below
    *cq = c.pending.front();
    *ctx = (*cq)->cq_context;
    c.pending.pop_front();
    return 0;
  }
  errno = EAGAIN;
  return -1;
}

void Verbs::ack_cq_events(ibv_cq*, unsigned) noexcept {}

std::size_t Verbs::held(ibv_qp* qp) const { return qp_of(qp).sq.size(); }
const std::vector<Wr>& Verbs::posted(ibv_qp* qp) const { return qp_of(qp).history; }
std::size_t Verbs::recvs_held(ibv_qp* qp) const { return qp_of(qp).rq.size(); }
const std::vector<Recv>& Verbs::recvs_posted(ibv_qp* qp) const { return qp_of(qp).recv_history; }
bool Verbs::in_error(ibv_qp* qp) const { return qp_of(qp).error; }
std::size_t Verbs::cq_entries(ibv_cq* cq) const { return cq_of(cq).entries.size(); }
bool Verbs::armed(ibv_cq* cq) const { return cq_of(cq).armed; }

}  // namespace fake
