// A software RC queue pair (qp.hpp): its streams, the requester and the responder.
#include "transport/soft/qp.hpp"

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

namespace {

// Per stream: frames queued to send (requests and answers), answers owed to it, and how much of
// the peer's stream is read at once while looking for headers (a payload longer than a few
// hundred bytes is received straight into its memory instead).
constexpr std::size_t kOutFrames = 512;
constexpr std::uint32_t kRequestFrames = 192;  // request frames queued or unanswered, per stream
constexpr std::uint32_t kAnswerFrames = 192;   // answers queued, per stream (then reading waits)
constexpr std::size_t kStage = 4096;
constexpr std::size_t kDirect = 512;
constexpr int kIov = 64;
// What one turn takes of a stream before the others get theirs.
constexpr std::size_t kTurnBytes = 8u << 20;

ibv_wc_status wc_status(FrameStatus s) noexcept {
  switch (s) {
    case FrameStatus::ok: return IBV_WC_SUCCESS;
    case FrameStatus::access: return IBV_WC_REM_ACCESS_ERR;
    case FrameStatus::invalid: return IBV_WC_REM_INV_REQ_ERR;
    default: return IBV_WC_REM_OP_ERR;
  }
}

}  // namespace

struct Out {
  std::array<std::uint8_t, kFrameSize> head{};
  const std::uint8_t* data = nullptr;
  std::uint32_t len = 0;
  bool answer = false;
  std::uint32_t rkey = 0;  // an answer's data: the window it is read from
  std::unique_ptr<std::uint8_t[]> copy;  // its data, once that window went before it was sent
};

struct Expect {
  std::uint64_t req = 0;  // the request's sequence number
  std::uint64_t id = 0;
  std::uint32_t offset = 0, len = 0;
  FrameOp op = FrameOp::write;
};

class Stream final : public Watched {
 public:
  Stream(Qp& q, Fd f, std::uint32_t i) : qp(q), fd(std::move(f)), index(i), out(kOutFrames), expect(kRequestFrames) {}
  void on_ready(std::uint32_t events) noexcept override { qp.on_ready(*this, events); }

  Qp& qp;
  Fd fd;
  std::uint32_t index;
  // Frames to send, oldest first; out_sent bytes of the oldest have gone.
  std::vector<Out> out;
  std::uint64_t out_head = 0, out_tail = 0;
  std::size_t out_sent = 0;
  std::uint32_t answers_queued = 0;
  // Request frames sent or queued whose answers are owed, oldest first.
  std::vector<Expect> expect;
  std::uint64_t exp_head = 0, exp_tail = 0;
  std::uint64_t next_id = 1;
  // Reading: a header (staged), or a payload `left` bytes long into `dst` (null: discarded).
  std::array<std::uint8_t, kStage> stage{};
  std::size_t st_pos = 0, st_end = 0;
  bool in_payload = false;
  Frame cur{};
  std::uint8_t* dst = nullptr;
  std::uint32_t left = 0;
  FrameStatus verdict = FrameStatus::ok;  // a WRITE being received: its answer
  bool held = false;     // a request waits for room to answer it: not reading meanwhile
  bool closed = false;   // draining (fail(), shm): the peer closed its side
  bool watch_out = false;  // watched for room to send
  bool watch_in = true;
  Deadline last_in = Clock::now();

  [[nodiscard]] bool out_full() const noexcept { return out_tail - out_head == out.size(); }
  [[nodiscard]] bool out_empty() const noexcept { return out_tail == out_head; }
  [[nodiscard]] std::uint64_t owed() const noexcept { return exp_tail - exp_head; }
  Out& push_out() noexcept { return out[out_tail++ % out.size()]; }
};

Qp::Qp(Device& dev, Cq& cq, QpConfig cfg, std::vector<Fd> streams) : dev_(dev), cq_(cq), cfg_(std::move(cfg)) {
  if (streams.empty()) throw Error("soft QP", EINVAL, "no data stream");
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
      r.op = w.opcode == IBV_WR_RDMA_WRITE ? (cfg_.cma ? FrameOp::write_cma : FrameOp::write)
                                           : (cfg_.cma ? FrameOp::read_cma : FrameOp::read);
      r.opcode = w.opcode == IBV_WR_RDMA_WRITE ? IBV_WC_RDMA_WRITE : IBV_WC_RDMA_READ;
      r.raddr = w.wr.rdma.remote_addr;
      r.rkey = w.wr.rdma.rkey;
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

void Qp::issue() noexcept {
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
    const bool atomic = r.op == FrameOp::fetch_add || r.op == FrameOp::compare_swap;
    if (atomic) {
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
    f.id = s->next_id++;
    f.raddr = r.raddr + issue_off_;
    f.rkey = r.rkey;
    f.arg0 = r.op == FrameOp::write_cma || r.op == FrameOp::read_cma ? r.laddr + issue_off_ : r.arg0;
    f.arg1 = r.arg1;
    Out& o = s->push_out();
    encode(f, o.head);
    o.answer = false;
    o.copy.reset();
    o.data = r.op == FrameOp::write ? reinterpret_cast<const std::uint8_t*>(r.laddr + issue_off_) : nullptr;
    o.len = r.op == FrameOp::write ? len : 0;
    s->expect[s->exp_tail++ % s->expect.size()] = {issue_, f.id, issue_off_, len, r.op};
    if (s->owed() == 1) s->last_in = Clock::now();  // the answer's clock starts now
    ++r.pending;
    issue_off_ += len;
    if (issue_off_ >= r.length) {
      r.issued = true;
      ++issue_;
      issue_off_ = 0;
    }
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
    ++head_;
  }
  if (issue_ < head_) {
    issue_ = head_;
    issue_off_ = 0;
  }
}

void Qp::to_error() noexcept { fail("moved to the error state", nullptr, false); }

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
  // As on RC, the peer's side fails too: it reads the end of each stream. With shm, requests
  // the peer has not answered may still be served by it, and they copy into and out of this
  // process: their completions wait until the peer has closed every stream (it saw the end:
  // it serves nothing after that), or a second has passed (a peer that sleeps that long sees
  // the end before anything else when it wakes: responder(), below).
  const bool answers_owed = std::any_of(streams_.begin(), streams_.end(), [](const auto& o) { return o->owed() > 0; });
  draining_ = cfg_.cma && started_ && answers_owed;
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
  } else if (f.request_op() == FrameOp::fetch_add || f.request_op() == FrameOp::compare_swap) {
    std::memcpy(reinterpret_cast<void*>(r.laddr), &f.arg0, sizeof f.arg0);
  }
  return true;
}

void Qp::answered(Stream& s) noexcept {
  const Expect e = s.expect[s.exp_head++ % s.expect.size()];
  s.last_in = Clock::now();
  Req& r = req(e.req);
  --r.pending;
  if (r.status != IBV_WC_SUCCESS) {
    const auto st = r.status;
    return fail(fmt::format("the peer refused a request on data stream {}: {}", s.index, ibv_wc_status_str(st)), &r, false);
  }
  if (r.issued && r.pending == 0) r.done = true;
}

// --- the responder ---------------------------------------------------------------------------------

FrameStatus Qp::check(const Frame& f, unsigned need) const noexcept {
  if (f.length == 0) return FrameStatus::ok;  // as on RC: a zero-length request touches nothing
  const auto it = windows_.find(f.rkey);
  if (it == windows_.end()) return FrameStatus::access;
  const Mw& w = *it->second;
  if ((w.access & need) != need || f.raddr < w.addr || f.raddr - w.addr > w.length ||
      f.length > w.length - (f.raddr - w.addr)) {
    return FrameStatus::access;
  }
  return FrameStatus::ok;
}

bool Qp::serve(Stream& s, const Frame& f) noexcept {
  if (s.answers_queued >= kAnswerFrames || s.out_full()) return false;
  Frame a;
  a.op = static_cast<std::uint8_t>(f.op | kResponse);
  a.id = f.id;
  const FrameOp op = f.request_op();
  const auto at = reinterpret_cast<std::uint8_t*>(f.raddr);
  const std::uint8_t* data = nullptr;
  switch (op) {
    case FrameOp::write:
      s.verdict = check(f, IBV_ACCESS_REMOTE_WRITE);
      s.in_payload = true;
      s.cur = f;
      s.left = f.length;
      s.dst = s.verdict == FrameStatus::ok ? at : nullptr;
      return true;  // answered once its data is in
    case FrameOp::read:
      a.status = check(f, IBV_ACCESS_REMOTE_READ);
      if (a.status == FrameStatus::ok) {
        a.length = f.length;
        data = at;
      }
      break;
    case FrameOp::fetch_add:
    case FrameOp::compare_swap:
      a.status = check(f, IBV_ACCESS_REMOTE_ATOMIC);
      if (a.status == FrameStatus::ok && f.raddr % 8 != 0) a.status = FrameStatus::invalid;
      if (a.status == FrameStatus::ok) {
        auto* word = reinterpret_cast<std::uint64_t*>(at);
        if (op == FrameOp::fetch_add) {
          a.arg0 = __atomic_fetch_add(word, f.arg0, __ATOMIC_SEQ_CST);
        } else {
          std::uint64_t expected = f.arg0;
          (void)__atomic_compare_exchange_n(word, &expected, f.arg1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
          a.arg0 = expected;
        }
      }
      break;
    case FrameOp::write_cma:
    case FrameOp::read_cma: {
      a.status = check(f, op == FrameOp::write_cma ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ);
      if (cfg_.peer_pid <= 0) a.status = FrameStatus::invalid;  // not a side that copies for its peer
      if (a.status == FrameStatus::ok && f.length != 0 && gave_up(s)) a.status = FrameStatus::remote_op;
      if (a.status == FrameStatus::ok && f.length != 0) {
        iovec mine{at, f.length};
        iovec theirs{reinterpret_cast<void*>(f.arg0), f.length};
        const ssize_t n = op == FrameOp::write_cma ? ::process_vm_readv(cfg_.peer_pid, &mine, 1, &theirs, 1, 0)
                                                   : ::process_vm_writev(cfg_.peer_pid, &mine, 1, &theirs, 1, 0);
        if (n != static_cast<ssize_t>(f.length)) a.status = FrameStatus::remote_op;
      }
      break;
    }
  }
  Out& o = s.push_out();
  encode(a, o.head);
  o.answer = true;
  o.copy.reset();
  o.data = data;
  o.len = data != nullptr ? a.length : 0;
  o.rkey = f.rkey;
  ++s.answers_queued;
  return true;
}

bool Qp::gave_up(const Stream& s) const noexcept {
  // The requester shut its side (it failed, and reported what was outstanding, or is about to):
  // its memory may be another buffer's by now. The end is seen here before the frames before it
  // are all read.
  pollfd p{s.fd.get(), POLLRDHUP, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// --- the streams -----------------------------------------------------------------------------------

void Qp::on_ready(Stream& s, std::uint32_t events) noexcept {
  (void)events;
  pump(s);
}

void Qp::pump(Stream& s) noexcept {
  // Another turn when its answers made room for a request that waited.
  while (pump_once(s)) {
  }
}

ssize_t Qp::read(Stream& s, void* into, std::size_t want, bool& eof) noexcept {
  const ssize_t n = ::recv(s.fd.get(), into, want, MSG_DONTWAIT);
  if (n > 0) {
    s.last_in = Clock::now();
    return n;
  }
  if (n < 0 && errno == EINTR) return -1;
  if (n == 0 || errno == ECONNRESET) {
    eof = true;
  } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
    fail(fmt::format("reading data stream {}: {}", s.index, errno_name(errno)), nullptr, true);
  }
  return 0;
}

bool Qp::pump_once(Stream& s) noexcept {
  if (error_) {
    if (draining_) drain(s);
    return false;
  }
  // Reading: headers from the stage; payloads straight into their memory.
  std::size_t taken = 0;
  bool eof = false;
  while (!s.held && taken < kTurnBytes && !error_) {
    if (s.in_payload) {
      if (s.left > 0 && s.st_pos < s.st_end) {
        const std::size_t k = std::min<std::size_t>(s.left, s.st_end - s.st_pos);
        if (s.dst != nullptr) {
          std::memcpy(s.dst, s.stage.data() + s.st_pos, k);
          s.dst += k;
        }
        s.st_pos += k;
        s.left -= static_cast<std::uint32_t>(k);
      }
      if (s.left > 0) {
        // A long payload straight into its memory; one discarded, or short, through the stage.
        const bool direct = s.dst != nullptr && s.left >= kDirect;
        if (!direct) s.st_pos = s.st_end = 0;
        std::uint8_t* into = direct ? s.dst : s.stage.data();
        const std::size_t want = direct ? s.left : std::min<std::size_t>(kStage, s.left);
        const ssize_t n = read(s, into, want, eof);
        if (n < 0) continue;  // interrupted
        if (n == 0) break;
        taken += static_cast<std::size_t>(n);
        if (direct) {
          s.dst += n;
          s.left -= static_cast<std::uint32_t>(n);
        } else {
          s.st_end = static_cast<std::size_t>(n);
        }
        continue;
      }
      // The payload is in.
      s.in_payload = false;
      if (s.cur.response()) {
        answered(s);
      } else {
        Frame a;
        a.op = static_cast<std::uint8_t>(s.cur.op | kResponse);
        a.id = s.cur.id;
        a.status = s.verdict;
        Out& o = s.push_out();  // room was there when the request was taken (serve)
        encode(a, o.head);
        o.answer = true;
        o.copy.reset();
        o.data = nullptr;
        o.len = 0;
        ++s.answers_queued;
      }
      continue;
    }
    if (s.st_end - s.st_pos >= kFrameSize) {
      const std::span<const std::uint8_t, kFrameSize> head(s.stage.data() + s.st_pos, kFrameSize);
      const std::optional<Frame> f = decode(head);
      if (!f) {
        fail(fmt::format("data stream {} carried a frame that is not one (the peer is not an rdmakit engine of this "
                         "version, or its stream was corrupted)",
                         s.index),
             nullptr, true);
        return false;
      }
      if (f->response()) {
        if (!answer(s, *f)) {
          fail(fmt::format("data stream {} carried an answer to no request of this link (id {}, op {})", s.index, f->id,
                           static_cast<int>(f->request_op())),
               nullptr, true);
          return false;
        }
        s.st_pos += kFrameSize;
        if (carries_payload(*f)) {
          s.in_payload = true;
          s.cur = *f;
          s.left = f->length;
        } else {
          answered(s);
        }
        continue;
      }
      if (!serve(s, *f)) {
        s.held = true;  // no room for its answer: reading waits for the peer to take some
        break;
      }
      s.st_pos += kFrameSize;
      continue;
    }
    // More of a header.
    if (s.st_pos > 0) {
      std::memmove(s.stage.data(), s.stage.data() + s.st_pos, s.st_end - s.st_pos);
      s.st_end -= s.st_pos;
      s.st_pos = 0;
    }
    const ssize_t n = read(s, s.stage.data() + s.st_end, kStage - s.st_end, eof);
    if (n < 0) continue;
    if (n == 0) break;
    taken += static_cast<std::size_t>(n);
    s.st_end += static_cast<std::size_t>(n);
  }
  if (error_) return false;
  if (eof) {
    peer_closed(s);
    return false;
  }
  // Its turn ended with bytes still to read: another turn at the next poll, whether or not its
  // descriptor wakes anyone (a sleeping worker waits on the channel, not on the stream).
  if (taken >= kTurnBytes && !s.held) cq_.again(&s);
  issue();
  // What issue() queued on the other streams goes now too (they may have nothing to read).
  for (auto& o : streams_) {
    if (o.get() != &s && !o->out_empty() && !o->watch_out && !error_ && send(*o)) cq_.again(o.get());
  }
  if (error_) return false;
  const bool resume = send(s);
  complete_ready();
  return resume;
}

Qp::Req* Qp::oldest_owed() noexcept {
  std::uint64_t oldest = tail_;
  for (auto& o : streams_) {
    if (o->owed() > 0) oldest = std::min(oldest, o->expect[o->exp_head % o->expect.size()].req);
  }
  return oldest < tail_ ? &req(oldest) : nullptr;
}

void Qp::peer_closed(Stream& s) noexcept {
  lost_peer(fmt::format("the peer closed data stream {} (its process ended, or it closed the link)", s.index));
}

void Qp::lost_peer(std::string why) noexcept {
  // As an RC QP whose retries ran out: the oldest request owed an answer fails with that.
  Req* first = oldest_owed();
  if (first != nullptr && first->status == IBV_WC_SUCCESS) first->status = IBV_WC_RETRY_EXC_ERR;
  fail(std::move(why), first, true);
}

bool Qp::send(Stream& s) noexcept {
  // Whole frames, several per call, straight from their memory.
  while (!s.out_empty()) {
    iovec iov[kIov];
    int n = 0;
    std::size_t skip = s.out_sent;
    for (std::uint64_t i = s.out_head; i != s.out_tail && n + 2 <= kIov; ++i) {
      const Out& o = s.out[i % s.out.size()];
      if (skip < kFrameSize) {
        iov[n++] = {const_cast<std::uint8_t*>(o.head.data()) + skip, kFrameSize - skip};
        skip = 0;
      } else {
        skip -= kFrameSize;
      }
      if (o.len > skip) iov[n++] = {const_cast<std::uint8_t*>(o.data) + skip, o.len - skip};
      skip = 0;
    }
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<std::size_t>(n);
    const ssize_t sent = ::sendmsg(s.fd.get(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET) {
        peer_closed(s);
        return false;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        fail(fmt::format("sending on data stream {}: {}", s.index, errno_name(errno)), nullptr, true);
        return false;
      }
      break;
    }
    std::size_t moved = static_cast<std::size_t>(sent) + s.out_sent;
    while (!s.out_empty()) {
      Out& o = s.out[s.out_head % s.out.size()];
      const std::size_t size = kFrameSize + o.len;
      if (moved < size) break;
      moved -= size;
      if (o.answer) --s.answers_queued;
      o.copy.reset();
      ++s.out_head;
    }
    s.out_sent = moved;
  }
  // Watched for room while something waits to go; for reading while not held.
  const bool want_out = !s.out_empty();
  bool resume = false;
  if (s.held && s.answers_queued < kAnswerFrames && !s.out_full()) {
    s.held = false;
    resume = true;
  }
  if (want_out != s.watch_out || s.held == s.watch_in) {
    s.watch_out = want_out;
    s.watch_in = !s.held;
    cq_.rewatch(s.fd.get(), &s, s.watch_in, s.watch_out);
  }
  return resume;
}

void Qp::check_stalls(Deadline now) noexcept {
  if (draining_ && now >= drain_until_) end_drain();
  if (error_ || now < next_stall_check_) return;
  next_stall_check_ = now + std::chrono::milliseconds{10};
  for (auto& s : streams_) {
    if (s->owed() == 0 || now - s->last_in < cfg_.stall_timeout) continue;
    return lost_peer(fmt::format("data stream {} brought nothing for {} ms while {} answers were owed (the peer is "
                                 "stopped, hung or unreachable; this side: {} frames to send, {} bytes of the first "
                                 "sent, {})",
                                 s->index, cfg_.stall_timeout.count(), s->owed(), s->out_tail - s->out_head, s->out_sent,
                                 s->watch_out ? "waiting for room" : "nothing waits for room"));
  }
}

}  // namespace rdmakit::detail::soft
