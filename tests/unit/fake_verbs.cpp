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
    v.take(q, taken);
  }
  return 0;
}

void Verbs::take(Qp& q, const Wr& w) {
  q.history.push_back(w);
  if (q.error) {
    // A QP in ERR completes every new request at once, flushed.
    push(q.qp.send_cq, wc_for(q, w.wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_SEND));
  } else {
    q.sq.push_back(w);
  }
}

// --- the extended interfaces --------------------------------------------------------------------

ibv_qp_ex* Verbs::qp_ex(ibv_qp* qp) {
  ibv_qp_ex& x = qp_of(qp).x;
  x.wr_start = wr_start;
  x.wr_rdma_write = wr_rdma_write;
  x.wr_rdma_read = wr_rdma_read;
  x.wr_set_sge = wr_set_sge;
  x.wr_set_sge_list = wr_set_sge_list;
  x.wr_set_inline_data = wr_set_inline_data;
  x.wr_complete = wr_complete;
  x.wr_abort = wr_abort;
  return &x;
}

void Verbs::wr_start(ibv_qp_ex* x) {
  Qp& q = qp_of(x);
  if (q.in_wr) throw std::logic_error("wr_start inside wr_start");
  q.in_wr = true;
  q.building.clear();
}

void Verbs::wr_rdma_write(ibv_qp_ex* x, std::uint32_t rkey, std::uint64_t addr) {
  Qp& q = qp_of(x);
  if (!q.in_wr) throw std::logic_error("a WR builder outside wr_start");
  q.building.push_back({x->wr_id, IBV_WR_RDMA_WRITE, x->wr_flags, 0, {}, addr, rkey, 0, 0, 0});
}

void Verbs::wr_rdma_read(ibv_qp_ex* x, std::uint32_t rkey, std::uint64_t addr) {
  Qp& q = qp_of(x);
  if (!q.in_wr) throw std::logic_error("a WR builder outside wr_start");
  q.building.push_back({x->wr_id, IBV_WR_RDMA_READ, x->wr_flags, 0, {}, addr, rkey, 0, 0, 0});
}

void Verbs::wr_set_sge(ibv_qp_ex* x, std::uint32_t lkey, std::uint64_t addr, std::uint32_t length) {
  const ibv_sge s{addr, length, lkey};
  wr_set_sge_list(x, 1, &s);
}

void Verbs::wr_set_sge_list(ibv_qp_ex* x, std::size_t n, const ibv_sge* sges) {
  Qp& q = qp_of(x);
  if (q.building.empty()) throw std::logic_error("a WR setter before its builder");
  q.building.back().sges.assign(sges, sges + n);
  q.building.back().num_sge = static_cast<int>(n);
}

void Verbs::wr_set_inline_data(ibv_qp_ex* x, void* addr, std::size_t length) {
  Qp& q = qp_of(x);
  if (q.building.empty()) throw std::logic_error("a WR setter before its builder");
  // Recorded as the classic post records an inline request: its flag, and its data's place.
  Wr& w = q.building.back();
  w.flags |= IBV_SEND_INLINE;
  w.sges = {ibv_sge{reinterpret_cast<std::uint64_t>(addr), static_cast<std::uint32_t>(length), 0}};
  w.num_sge = 1;
}

int Verbs::wr_complete(ibv_qp_ex* x) {
  Verbs& v = of(x->qp_base.context);
  Qp& q = qp_of(x);
  if (!q.in_wr) throw std::logic_error("wr_complete outside wr_start");
  q.in_wr = false;
  // A refusal (fail_post_at, an index within the batch) takes none of it, as a provider's
  // wr_complete does.
  const int fail_at = v.failing_call() ? std::exchange(v.fail_post_at_, -1) : -1;
  if (fail_at >= 0 && static_cast<std::size_t>(fail_at) < q.building.size()) {
    q.building.clear();
    return EINVAL;
  }
  for (const Wr& w : q.building) v.take(q, w);
  v.extended_posts_ += q.building.size();
  q.building.clear();
  return 0;
}

void Verbs::wr_abort(ibv_qp_ex* x) {
  Qp& q = qp_of(x);
  q.in_wr = false;
  q.building.clear();
}

ibv_cq_ex* Verbs::cq_ex(ibv_cq* cq) {
  ibv_cq_ex& x = cq_of(cq).x;
  x.start_poll = start_poll;
  x.next_poll = next_poll;
  x.end_poll = end_poll;
  x.read_opcode = read_opcode;
  x.read_vendor_err = read_vendor_err;
  x.read_byte_len = read_byte_len;
  x.read_qp_num = read_qp_num;
  x.read_wc_flags = read_wc_flags;
  return &x;
}

int Verbs::start_poll(ibv_cq_ex* x, ibv_poll_cq_attr* attr) {
  Cq& c = cq_of(ibv_cq_ex_to_cq(x));
  if (c.polling) throw std::logic_error("start_poll without end_poll");
  if (attr == nullptr || attr->comp_mask != 0) return EINVAL;
  if (c.entries.empty()) return ENOENT;
  c.polling = true;
  ++of(x->context).extended_polls_;
  x->wr_id = c.entries.front().wr_id;
  x->status = c.entries.front().status;
  return 0;
}

int Verbs::next_poll(ibv_cq_ex* x) {
  Cq& c = cq_of(ibv_cq_ex_to_cq(x));
  if (!c.polling) throw std::logic_error("next_poll outside start_poll");
  c.entries.pop_front();
  if (c.entries.empty()) return ENOENT;
  x->wr_id = c.entries.front().wr_id;
  x->status = c.entries.front().status;
  return 0;
}

void Verbs::end_poll(ibv_cq_ex* x) {
  Cq& c = cq_of(ibv_cq_ex_to_cq(x));
  if (!c.polling) throw std::logic_error("end_poll outside start_poll");
  c.polling = false;
  if (!c.entries.empty()) c.entries.pop_front();
}

enum ibv_wc_opcode Verbs::read_opcode(ibv_cq_ex* x) { return cq_of(ibv_cq_ex_to_cq(x)).entries.front().opcode; }
std::uint32_t Verbs::read_vendor_err(ibv_cq_ex* x) { return cq_of(ibv_cq_ex_to_cq(x)).entries.front().vendor_err; }
std::uint32_t Verbs::read_byte_len(ibv_cq_ex* x) { return cq_of(ibv_cq_ex_to_cq(x)).entries.front().byte_len; }
std::uint32_t Verbs::read_qp_num(ibv_cq_ex* x) { return cq_of(ibv_cq_ex_to_cq(x)).entries.front().qp_num; }
unsigned int Verbs::read_wc_flags(ibv_cq_ex* x) { return cq_of(ibv_cq_ex_to_cq(x)).entries.front().wc_flags; }

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
  if (c.polling) throw std::logic_error("ibv_poll_cq inside start_poll");
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
