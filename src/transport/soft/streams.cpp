// SPDX-License-Identifier: Apache-2.0
// A software RC queue pair's streams (qp.hpp): reading frames into registered memory, serving
// the peer's requests against the windows bound on this queue pair (a crossing's with it:
// crossing.hpp), sending in turns.
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
  bool send_now = false;
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
    case FrameOp::share:
    case FrameOp::unshare:
      return true;  // (pump_once takes them: never answered)
    default:
      // A crossing's (crossing.hpp); refused on a link without one, as any op it does not know.
      if (crossing_) {
        send_now = crossing_->serve(*this, s, f, a);
      } else {
        a.status = FrameStatus::invalid;
      }
  }
  s.push_out(a, true, data, data != nullptr ? a.length : 0).rkey = f.rkey;
  // (send() resumes nothing here: serve() runs only while the stream is not held.)
  if (send_now && !s.watch_out) (void)send(s);
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
  ssize_t n = 0;
  if (!crossing_ || !crossing_->takes_descriptors()) {
    n = ::recv(s.fd.get(), into, want, MSG_DONTWAIT);
  } else {
    // A SHARE's descriptor comes with its bytes (it is read before its frame is decoded).
    iovec iov{into, want};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    n = ::recvmsg(s.fd.get(), &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n > 0) {
      bool lost = (m.msg_flags & MSG_CTRUNC) != 0;  // also when none could be installed here
      if (m.msg_controllen > 0) {
        try {
          for (Fd& fd : descriptors_of(m)) s.fds.push_back(std::move(fd));
        } catch (...) {
          lost = true;  // out of memory: as if they never came
        }
      }
      if (lost || s.fds.size() > kMaxWaitingFds) {
        fail(fmt::format("data stream {}: {}", s.index,
                         lost ? "a descriptor the peer shared could not be taken (this process is at its limit of open "
                                "files, RLIMIT_NOFILE, or the peer sent several at once)"
                              : "it carried more descriptors than SHARE frames (the peer is not an rdmakit engine of "
                                "this version, or lies)"),
             nullptr, true);
        return 0;
      }
    }
  }
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
        (void)s.push_out(a, true);  // room was there when the request was taken (serve)
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
      if (unanswered(*f)) {
        if (!crossing_) {
          fail(fmt::format("data stream {}: the peer shares memory on a link that takes none (engine protocol below 8, "
                           "not shm, or the side that asks; the peer is not an rdmakit engine of this version, or lies)",
                           s.index),
               nullptr, true);
          return false;
        }
        if (!crossing_->take(*this, s, *f)) return false;
        s.st_pos += kFrameSize;
        continue;
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
      // What a request moves counts toward the turn, not only its 48 bytes: a link of cross-memory
      // or ring copies (or of READs) cannot keep the worker from its commands (a revocation) and
      // its other links. (A WRITE's data is counted as it is read.)
      if (f->request_op() != FrameOp::write) taken += f->length;
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
  s.copied = 0;
  // Whole frames, several per call, straight from their memory.
  while (!s.out_empty()) {
    iovec iov[kIov];
    int n = 0;
    std::size_t skip = s.out_sent;
    Out* with_fd = nullptr;  // a SHARE's: its descriptor goes with the first bytes of this call
    for (std::uint64_t i = s.out_head; i != s.out_tail && n + 2 <= kIov; ++i) {
      Out& o = s.out[i % s.out.size()];
      if (o.share && !o.share_sent) {
        if (n > 0) break;  // one descriptor per call, at its start
        with_fd = &o;
      }
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
    OneDescriptor control;
    if (with_fd != nullptr) control.attach(m, with_fd->share->fd.get());
    const ssize_t sent = ::sendmsg(s.fd.get(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent > 0 && with_fd != nullptr) with_fd->share_sent = true;
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
      o.share.reset();
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
