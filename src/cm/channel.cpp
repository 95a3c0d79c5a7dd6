// SPDX-License-Identifier: Apache-2.0
#include "cm/channel.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "rdmakit/error.hpp"
#include "verbs/qp.hpp"

namespace rdmakit::detail {

namespace {

// How long receives may still complete after the CM said DISCONNECTED: the peer's last SENDs
// (its BYE) can reach our CQ after its DREQ reached the CM.
constexpr std::chrono::milliseconds kDisconnectGrace{50};

int errno_of(ibv_wc_status s) noexcept {
  switch (s) {
    case IBV_WC_RETRY_EXC_ERR: return ETIMEDOUT;  // the peer's NIC stopped acknowledging
    case IBV_WC_WR_FLUSH_ERR: return ECONNRESET;
    default: return EPROTO;
  }
}

}  // namespace

bool next_event(rdma_event_channel* events, Deadline deadline, CmEvent& out, const Stop* stop) {
  for (;;) {
    rdma_cm_event* e = nullptr;
    if (rdma_get_cm_event(events, &e) == 0) {
      out.type = e->event;
      out.status = e->status;
      out.id = e->id;
      const auto& conn = e->param.conn;
      out.data.assign(static_cast<const std::uint8_t*>(conn.private_data),
                      static_cast<const std::uint8_t*>(conn.private_data) +
                          (conn.private_data != nullptr ? conn.private_data_len : 0));
      (void)rdma_ack_cm_event(e);
      return true;
    }
    if (errno != EAGAIN && errno != EINTR) throw Error("rdma_get_cm_event", errno, "the CM's event channel");
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    (void)poll_until(events->fd, POLLIN, std::min(deadline, deadline_in(std::chrono::milliseconds{1000})), stop, "rdma_cm");
  }
}

CmChannel::CmChannel(EventChannelPtr events, CmIdPtr id, std::string peer, const CmOptions& options)
    : events_(std::move(events)), id_(std::move(id)), peer_(std::move(peer)), options_(options),
      epoll_(::epoll_create1(EPOLL_CLOEXEC)), ready_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      grace_(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)) {
  if (!epoll_) throw Error("epoll_create1", errno, "the rdma_cm control channel");
  if (!ready_) throw Error("eventfd", errno, "the rdma_cm control channel");
  if (!grace_) throw Error("timerfd_create", errno, "the rdma_cm control channel");
  set_nonblocking(events_->fd, "the CM's event channel");
  if (id_->verbs == nullptr) throw Error("rdma_cm", ENODEV, fmt::format("{}: the CM resolved no device", peer_));
  // Our own context of the device the CM chose (the CM's context is librdmacm's), with a PD
  // that holds nothing but this channel's buffers.
  dev_ = open_pd(DeviceLayer::acquire()->device(ibv_get_device_name(id_->verbs->device)));
  buffer_.resize((kSendSlots + kRecvSlots) * kSlot);
  mr_.reset(ibv_reg_mr(dev_->pd.get(), buffer_.data(), buffer_.size(), IBV_ACCESS_LOCAL_WRITE));
  if (!mr_) throw Error("ibv_reg_mr", errno, fmt::format("{} bytes for the rdma_cm control channel", buffer_.size()));
  comp_.reset(ibv_create_comp_channel(dev_->ctx()));
  if (!comp_) throw Error("ibv_create_comp_channel", errno, "the rdma_cm control channel");
  set_nonblocking(comp_->fd, "the control channel's completion channel");
  const int depth = static_cast<int>(kSendSlots + 1 + kRecvSlots);
  cq_.reset(ibv_create_cq(dev_->ctx(), depth, nullptr, comp_.get(), 0));
  if (!cq_) throw Error("ibv_create_cq", errno, fmt::format("the rdma_cm control channel's CQ, {} entries", depth));
  if (const int rc = ibv_req_notify_cq(cq_.get(), 0); rc != 0) throw Error("ibv_req_notify_cq", rc, "control channel");
  ibv_qp_init_attr qa{};
  qa.send_cq = cq_.get();
  qa.recv_cq = cq_.get();
  qa.qp_type = IBV_QPT_RC;
  qa.sq_sig_all = 1;
  qa.cap.max_send_wr = kSendSlots + 1;
  qa.cap.max_recv_wr = kRecvSlots;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qp_.reset(ibv_create_qp(dev_->pd.get(), &qa));
  if (!qp_) throw Error("ibv_create_qp", errno, "the rdma_cm control channel's QP");
  for (int fd : {comp_->fd, events_->fd, ready_.get(), grace_.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) throw Error("epoll_ctl", errno, "control channel");
  }
  transition(IBV_QPS_INIT, "RESET->INIT");
  for (std::size_t k = 0; k < kRecvSlots; ++k) post_recv(k);
}

CmChannel::~CmChannel() {
  // A DREQ: the peer learns at once that this side is gone. The QP is ours (not the CM's), so
  // the members' order destroys it next, before the memory it receives into.
  if (established_) (void)rdma_disconnect(id_.get());
}

void CmChannel::transition(ibv_qp_state state, const char* name) {
  ibv_qp_attr a{};
  int mask = 0;
  a.qp_state = state;
  if (rdma_init_qp_attr(id_.get(), &a, &mask) != 0) {
    throw Error("rdma_init_qp_attr", errno, fmt::format("{} of the control QP to {}", name, peer_));
  }
  if (state == IBV_QPS_INIT) {
    // SEND/RECV only: a peer that has not proven anything can write or read nothing.
    a.qp_access_flags = 0;
    mask |= IBV_QP_ACCESS_FLAGS;
  } else if (state == IBV_QPS_RTR) {
    a.min_rnr_timer = encode_rnr_timer(options_.rnr_timer);
    mask |= IBV_QP_MIN_RNR_TIMER;
  } else if (state == IBV_QPS_RTS) {
    a.timeout = encode_ack_timeout(options_.ack_timeout);
    a.retry_cnt = options_.retry_count;
    a.rnr_retry = 7;  // a peer that is slow to read is busy, not dead
    mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY;
  }
  if (const int rc = ibv_modify_qp(qp_.get(), &a, mask); rc != 0) {
    throw Error("ibv_modify_qp", rc, fmt::format("{} of the rdma_cm control QP {:#x} to {}", name, qp_->qp_num, peer_));
  }
}

void CmChannel::post_recv(std::size_t k) {
  ibv_sge sge{reinterpret_cast<std::uintptr_t>(slot(kSendSlots + k)), static_cast<std::uint32_t>(kSlot), mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = kRecvBase + k;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (const int rc = ibv_post_recv(qp_.get(), &wr, &bad); rc != 0) {
    throw Error("ibv_post_recv", rc, fmt::format("the rdma_cm control channel to {}", peer_));
  }
}

void CmChannel::connect(Deadline deadline) {
  std::array<std::uint8_t, kCmRequestSize> req{};
  std::copy(kCmMagic.begin(), kCmMagic.end(), req.begin());
  req[4] = kCmVersion;
  rdma_conn_param p{};
  p.private_data = req.data();
  p.private_data_len = static_cast<std::uint8_t>(req.size());
  p.retry_count = options_.retry_count;
  p.rnr_retry_count = 7;
  p.qp_num = qp_->qp_num;
  if (rdma_connect(id_.get(), &p) != 0) throw Error("rdma_connect", errno, peer_);
  CmEvent e;
  for (;;) {
    if (!next_event(events_.get(), deadline, e, stop_.get())) {
      throw Error("rdma_cm connect", ETIMEDOUT,
                  fmt::format("{} did not answer the connect request before the deadline", peer_),
                  "nothing answers rdma_cm at that address (a host without RDMA, a firewall, a "
                  "partition), or the listener is stalled");
    }
    if (e.type == RDMA_CM_EVENT_CONNECT_RESPONSE) break;
    throw cm_event_error("rdma_cm connect", e, peer_);
  }
  transition(IBV_QPS_RTR, "INIT->RTR");
  transition(IBV_QPS_RTS, "RTR->RTS");
  if (rdma_establish(id_.get()) != 0) throw Error("rdma_establish", errno, peer_);
  established_ = true;
  last_heard_ = Clock::now();
}

void CmChannel::accept(Deadline deadline) {
  transition(IBV_QPS_RTR, "INIT->RTR");
  transition(IBV_QPS_RTS, "RTR->RTS");
  rdma_conn_param p{};
  p.retry_count = options_.retry_count;
  p.rnr_retry_count = 7;
  p.qp_num = qp_->qp_num;
  if (rdma_accept(id_.get(), &p) != 0) throw Error("rdma_accept", errno, peer_);
  established_ = true;  // from here a DREQ on the way out is due
  CmEvent e;
  for (;;) {
    if (!next_event(events_.get(), deadline, e, stop_.get())) {
      throw Error("rdma_cm accept", ETIMEDOUT,
                  fmt::format("{} did not complete the connection (no RTU) before the deadline", peer_),
                  "the client gave up or was partitioned away");
    }
    if (e.type == RDMA_CM_EVENT_ESTABLISHED) break;
    throw cm_event_error("rdma_cm accept", e, peer_);
  }
  last_heard_ = Clock::now();
}

void CmChannel::fail(int err) noexcept {
  if (gone_) return;
  gone_ = true;
  gone_errno_ = err;
}

void CmChannel::update_ready() noexcept {
  const bool want = !rx_.empty() || gone_;
  if (want == ready_set_) return;
  std::uint64_t v = 1;
  // Writing 1 sets the eventfd's count (never near its limit); reading takes it back to 0.
  const ssize_t n = want ? ::write(ready_.get(), &v, sizeof v) : ::read(ready_.get(), &v, sizeof v);
  if (n == static_cast<ssize_t>(sizeof v)) ready_set_ = want;
}

void CmChannel::pump() noexcept {
  if (gone_ && rx_.empty()) return update_ready();
  try {
    CmEvent e;
    while (next_event(events_.get(), Clock::now(), e)) {
      switch (e.type) {
        case RDMA_CM_EVENT_DISCONNECTED:
          if (disconnected_at_ == Deadline{}) {
            disconnected_at_ = Clock::now();
            // A reader that waits on fd() hears of the close when the grace is over.
            itimerspec t{};
            t.it_value.tv_nsec = std::chrono::nanoseconds(kDisconnectGrace).count() + 1'000'000;
            (void)::timerfd_settime(grace_.get(), 0, &t, nullptr);
          }
          break;
        case RDMA_CM_EVENT_DEVICE_REMOVAL: fail(ENODEV); break;
        case RDMA_CM_EVENT_ADDR_CHANGE: fail(ENETDOWN); break;
        default: break;  // TIMEWAIT_EXIT and the like change nothing for the stream
      }
    }
  } catch (const std::exception&) {
    fail(EIO);
  }
  std::uint64_t expirations = 0;
  (void)!::read(grace_.get(), &expirations, sizeof expirations);
  // Arm first, then poll: a completion that lands in between raises an event we read next time.
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  while (ibv_get_cq_event(comp_.get(), &ev_cq, &ev_ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
  (void)ibv_req_notify_cq(cq_.get(), 0);
  const Deadline now = Clock::now();
  ibv_wc wc[8];
  int n;
  while ((n = ibv_poll_cq(cq_.get(), 8, wc)) > 0) {
    for (int i = 0; i < n; ++i) {
      const ibv_wc& c = wc[i];
      if (c.status != IBV_WC_SUCCESS) {
        // A flush after the peer's DREQ is its orderly close; anything else names the status.
        fail(c.status == IBV_WC_WR_FLUSH_ERR && disconnected_at_ != Deadline{} ? 0 : errno_of(c.status));
        if (gone_detail_.empty()) gone_detail_ = ibv_wc_status_str(c.status);
        continue;
      }
      if (c.wr_id == kProbe) {
        probe_out_ = false;
        last_heard_ = now;
      } else if (c.wr_id < kSendSlots) {
        send_busy_[c.wr_id] = false;
      } else {
        const std::size_t k = c.wr_id - kRecvBase;
        last_heard_ = now;
        const std::uint8_t* p = slot(kSendSlots + k);
        rx_.insert(rx_.end(), p, p + c.byte_len);  // a 0-byte SEND is the peer's keepalive probe
        try {
          if (rx_.size() < kRecvBacklog) {
            post_recv(k);
          } else {
            parked_.push_back(k);
          }
        } catch (const std::exception&) {
          fail(EIO);
        }
      }
    }
  }
  if (n < 0) fail(EIO);
  if (disconnected_at_ != Deadline{} && now - disconnected_at_ >= kDisconnectGrace) fail(0);
  if (!gone_ && established_ && keepalive_.count() > 0 && !probe_out_ && now - last_heard_ >= keepalive_) {
    // A zero-length SEND: the peer's NIC acknowledges it (or NAKs it RNR while its receives are
    // all taken, which the QP retries forever); only a host that stopped answering fails it,
    // once the retries (ack_timeout x retry_count) are spent.
    ibv_send_wr wr{};
    wr.wr_id = kProbe;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qp_.get(), &wr, &bad) == 0) probe_out_ = true;
  }
  update_ready();
}

bool CmChannel::wait(Deadline deadline) noexcept {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return false;
  epoll_event ev{};
  (void)::epoll_wait(epoll_.get(), &ev, 1, static_cast<int>(std::min<long long>(left.count() + 1, 50)));
  return true;
}

void CmChannel::throw_gone(const char* op) const {
  throw Error(op, gone_errno_ == 0 ? ECONNRESET : gone_errno_,
              fmt::format("{}: the rdma_cm control channel is closed{}", peer_,
                          gone_detail_.empty() ? "" : fmt::format(" ({})", gone_detail_)),
              gone_errno_ == 0 ? "the peer disconnected: it exited or rejected this connection; see its log"
                               : "");
}

long CmChannel::post_chunk(std::span<const std::uint8_t> bytes, int* rc) noexcept {
  const auto free = std::find(send_busy_.begin(), send_busy_.end(), false);
  if (free == send_busy_.end()) return 0;
  const auto k = static_cast<std::uint64_t>(free - send_busy_.begin());
  const std::size_t n = std::min(bytes.size(), kSlot);
  std::memcpy(slot(k), bytes.data(), n);
  ibv_sge sge{reinterpret_cast<std::uintptr_t>(slot(k)), static_cast<std::uint32_t>(n), mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = k;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_send_wr* bad = nullptr;
  if ((*rc = ibv_post_send(qp_.get(), &wr, &bad)) != 0) return -1;
  send_busy_[k] = true;
  return static_cast<long>(n);
}

bool CmChannel::sent() noexcept {
  pump();
  return std::none_of(send_busy_.begin(), send_busy_.end(), [](bool b) { return b; });
}

long CmChannel::send_some(std::span<const std::uint8_t> bytes, int* error) noexcept {
  pump();
  // After the peer's DREQ nothing more sent reaches a reader.
  if (gone_ || disconnected_at_ != Deadline{}) {
    *error = gone_errno_ == 0 ? ECONNRESET : gone_errno_;
    return kSendFailed;
  }
  long taken = 0;
  while (!bytes.empty()) {
    int rc = 0;
    const long n = post_chunk(bytes, &rc);
    if (n < 0) {
      *error = rc;
      fail(rc);
      return kSendFailed;
    }
    if (n == 0) break;
    taken += n;
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
  return taken;
}

void CmChannel::send_all(std::span<const std::uint8_t> bytes, Deadline deadline) {
  auto stalled = [&](const char* what) {
    throw Error("rdma_cm send", ETIMEDOUT,
                fmt::format("{}: {} before the deadline ({} bytes left to send)", peer_, what, bytes.size()),
                "the peer does not read its control channel (stalled), or the link is down");
  };
  // Every chunk is acknowledged by the peer's NIC before this returns: what was sent is there
  // even if this side closes right after (a BYE), as a TCP close would deliver it.
  for (;;) {
    // sent() pumps, and may reap the last acknowledgement: done, without sleeping on a channel
    // that has nothing more to say. First: every chunk acknowledged is delivered even if the
    // same pump saw the peer's DREQ (a server that read this message, answered with a REJECT
    // and disconnected): the caller reads that answer next.
    const bool idle = sent();
    if (bytes.empty() && idle) return;
    // After the peer's DREQ nothing more sent reaches a reader: fail now, not after the grace
    // that lets the peer's own last SENDs arrive (which is for receiving).
    if (gone_ || disconnected_at_ != Deadline{}) throw_gone("rdma_cm send");
    int rc = 0;
    const long n = bytes.empty() ? 0 : post_chunk(bytes, &rc);
    if (n < 0) throw Error("ibv_post_send", rc, fmt::format("the rdma_cm control channel to {}", peer_));
    if (n == 0) {
      // Not while only the last chunk's acknowledgement is awaited: that may carry a REJECT's
      // reason, which send_reject bounds itself.
      if (!bytes.empty() && stop_ && stop_->requested()) throw stopped_error("rdma_cm send");
      if (!wait(deadline)) stalled(bytes.empty() ? "the last chunk was not acknowledged" : "no send slot came free");
      continue;
    }
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
}

long CmChannel::recv_nonblocking(std::span<std::uint8_t> buf, int* error) noexcept {
  pump();
  if (!rx_.empty()) {
    const std::size_t n = std::min(buf.size(), rx_.size());
    std::copy_n(rx_.begin(), n, buf.begin());
    rx_.erase(rx_.begin(), rx_.begin() + static_cast<std::ptrdiff_t>(n));
    while (!parked_.empty() && rx_.size() < kRecvBacklog && !gone_) {
      try {
        post_recv(parked_.back());
      } catch (const std::exception&) {
        fail(EIO);
        break;
      }
      parked_.pop_back();
    }
    update_ready();
    return static_cast<long>(n);
  }
  if (!gone_) return kRecvWouldBlock;
  if (error != nullptr) *error = gone_errno_;
  return kRecvClosed;
}

void CmChannel::recv_exact(std::span<std::uint8_t> bytes, Deadline deadline) {
  const std::size_t want = bytes.size();
  while (!bytes.empty()) {
    int err = 0;
    const long n = recv_nonblocking(bytes, &err);
    if (n > 0) {
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    } else if (n == kRecvClosed) {
      throw Error("rdma_cm receive", err == 0 ? ECONNRESET : err,
                  fmt::format("{} closed the connection after {} of {} bytes", peer_, want - bytes.size(), want),
                  "the peer exited or rejected this connection; see its log");
    } else if (stop_ && stop_->requested()) {
      throw stopped_error("rdma_cm receive");
    } else if (!wait(deadline)) {
      throw Error("rdma_cm receive", ETIMEDOUT,
                  fmt::format("{}: {} of {} bytes arrived before the handshake deadline", peer_,
                              want - bytes.size(), want),
                  "a stalled or truncated message (a slow client, or not an rdmakit peer)");
    }
  }
}

void CmChannel::keepalive(std::chrono::milliseconds interval, std::chrono::milliseconds /*timeout*/) {
  // The probe's own retries bound how long an unanswered one takes (ack_timeout x retry_count).
  keepalive_ = interval;
}

std::string CmChannel::local_address() const { return sockaddr_text(rdma_get_local_addr(id_.get()), false); }

std::string CmChannel::device() const { return ibv_get_device_name(id_->verbs->device); }

}  // namespace rdmakit::detail
