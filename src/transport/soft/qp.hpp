// SPDX-License-Identifier: Apache-2.0
#pragma once
// A software RC queue pair: the requester and the responder a NIC would be, over byte streams.
//
// Requester: the send queue holds what was posted, in order. A WRITE or READ is cut into frames
// of at most kMaxChunk bytes (frame.hpp), spread over the streams (the stream with room next in
// turn), sent straight from the posted memory (no staging copy: the header and the data go out
// in one sendmsg), and answered frame by frame; a READ's answer is received straight into the
// posted memory. A request ends when every frame of it is answered, and requests complete in
// the order they were posted (RC's order), signaled ones and failures with a completion.
//
// Responder: each request is checked against the windows bound on this queue pair (a type-2
// window serves the one link it was bound on), its range and access, exactly as a NIC checks an
// rkey; a WRITE's data is received straight into the window, a READ answered from it, atomics
// done on the word with the CPU's atomics; anything else is refused with an access error, and
// the peer's link fails as it would on RC. A window that goes while a frame into it is half
// received stops taking its data; one whose READ answer is half sent has the rest copied first.
//
// Crossing (crossing.hpp): a same-host transport's queue pairs move WRITEs' and READs' data
// another way than in the stream; the transport gives its own with the streams.
//
// Failure: an error answer, a stream that breaks or closes, a frame that is not one, or an
// answer owed for longer than `stall_timeout`, moves the queue pair to the error state as on RC:
// what is outstanding completes flushed (the first with the error), what is posted after is
// flushed at once, the streams are shut (the peer's side fails too), and `on_fault` hears why.
//
// Threads: one at a time (the owner of its Cq).

#include <infiniband/verbs.h>

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bootstrap/socket.hpp"
#include "common/clock.hpp"
#include "common/fifo.hpp"
#include "transport/soft/device.hpp"
#include "transport/soft/crossing.hpp"
#include "transport/soft/frame.hpp"

namespace rdmakit::detail::soft {

struct QpConfig {
  std::uint32_t send_depth = 64;
  std::uint32_t qp_num = 1;
  /// An answer owed for this long on a stream that delivered nothing meanwhile: the peer is
  /// gone (as an RC QP's retries run out).
  std::chrono::milliseconds stall_timeout{4000};
  /// The queue pair failed on its own (not by to_error()): why, for the link's owner.
  std::function<void(const std::string&)> on_fault;
};

/// A posted work request in the send queue.
struct Request {
  std::uint64_t wr_id = 0;
  ibv_wc_opcode opcode = IBV_WC_RDMA_WRITE;
  FrameOp op = FrameOp::write;
  bool signaled = false;
  bool issued = false;
  bool done = false;
  std::uint32_t pending = 0;  // frames sent or queued, not answered
  std::uint64_t laddr = 0, raddr = 0;
  std::uint32_t length = 0, rkey = 0;
  std::uint64_t arg0 = 0, arg1 = 0;  // atomics' operands; a crossing's op's (crossing.hpp)
  ibv_wc_status status = IBV_WC_SUCCESS;
};

class Stream;

class Qp {
 public:
  /// Takes the connected streams (at least one, nonblocking or not: they are made nonblocking),
  /// and how data crosses besides the streams (none: in them). Built on any thread; start()
  /// joins them to `cq` on the thread that polls it.
  Qp(Device& dev, Cq& cq, QpConfig cfg, std::vector<Fd> streams, std::unique_ptr<Crossing> crossing = nullptr);
  ~Qp();
  Qp(const Qp&) = delete;
  Qp& operator=(const Qp&) = delete;

  /// On the Cq's thread, before anything is posted: the streams join its channel's set (what
  /// arrived before is read then).
  void start();
  [[nodiscard]] ibv_qp* qp() noexcept { return &qp_; }
  static Qp& of(ibv_qp* q) noexcept { return *static_cast<Qp*>(q->qp_context); }
  [[nodiscard]] bool in_error() const noexcept { return error_; }
  [[nodiscard]] const std::string& failure() const noexcept { return failure_; }
  [[nodiscard]] std::size_t streams() const noexcept { return streams_.size(); }
  /// Requests posted and not completed.
  [[nodiscard]] std::uint64_t outstanding() const noexcept { return tail_ - head_; }

  int post_send(ibv_send_wr* wr, ibv_send_wr** bad) noexcept;
  int post_recv(ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept;
  /// ibv_modify_qp(ERR): everything outstanding completes flushed.
  void to_error() noexcept;
  /// Window `mw` leaves this queue pair (its deallocation, or a bind elsewhere).
  void unbind(Mw& mw) noexcept;

  // For the streams and the Cq.
  void on_ready(Stream& s, std::uint32_t events) noexcept;
  void check_stalls(Deadline now) noexcept;
  /// The device's shared ranges changed (its CQ's poll): the peer is told of those that went.
  void shares_changed() noexcept;
  /// How data crosses besides the streams (null: it does not).
  [[nodiscard]] Crossing* crossing() const noexcept { return crossing_.get(); }

  // For its crossing.
  /// Whether request `f` may touch the window it names with access `need` (IBV_ACCESS_REMOTE_*).
  [[nodiscard]] FrameStatus check(const Frame& f, unsigned need) const noexcept;
  /// The requester at the other end of `s` shut its side (it gave up on what it asked).
  [[nodiscard]] bool gave_up(const Stream& s) const noexcept;
  /// The queue pair fails on its own, saying `why` (a peer that lies, a resource exhausted).
  void fault(std::string why) noexcept;

 private:
  friend class Stream;
  using Req = Request;
  Req& req(std::uint64_t seq) noexcept { return reqs_[seq & mask_]; }
  /// One posted work request into the send queue; an errno when it is refused.
  int take(const ibv_send_wr& w) noexcept;
  /// The oldest request an answer is owed for (null: none).
  Req* oldest_owed() noexcept;
  bool bind(const ibv_send_wr& w) noexcept;
  /// Cuts the posted requests into frames on the streams, as far as they have room.
  void issue() noexcept;
  void complete_ready() noexcept;
  /// The error state, with `why`; `first` (if not null) keeps its own error status, every other
  /// outstanding request is flushed.
  void fail(std::string why, Req* first, bool fault) noexcept;
  /// A request frame from the peer (responder). False: no room to answer it yet.
  bool serve(Stream& s, const Frame& f) noexcept;
  /// An answer from the peer (requester). False: it answers nothing outstanding (garbage).
  bool answer(Stream& s, const Frame& f) noexcept;
  void answered(Stream& s) noexcept;
  /// Reads what `s` has, serves and answers, and sends what waits, as far as it goes now.
  void pump(Stream& s) noexcept;
  bool pump_once(Stream& s) noexcept;
  /// Sends what waits on `s` as far as the socket takes it; true when a request held for room
  /// to answer it may be read now.
  bool send(Stream& s) noexcept;
  void peer_closed(Stream& s) noexcept;
  /// The peer is gone (a stream ended, or answered nothing for stall_timeout): the error state,
  /// the oldest request owed an answer failing as a retry-exhausted one.
  void lost_peer(std::string why) noexcept;
  /// Failed while the peer may reach this memory: reads `s` to its end (the peer's close), then ends the drain.
  void drain(Stream& s) noexcept;
  void end_drain() noexcept;
  /// recv() on `s`: the bytes taken; 0 when there are none now, or the peer closed (`eof`), or
  /// the stream failed (the queue pair did); -1 when interrupted.
  ssize_t read(Stream& s, void* into, std::size_t want, bool& eof) noexcept;

  Device& dev_;
  Cq& cq_;
  QpConfig cfg_;
  ibv_qp qp_{};
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<Req> reqs_;
  std::uint64_t mask_ = 0;
  std::uint64_t head_ = 0, issue_ = 0, tail_ = 0;  // completed up to head_, framed up to issue_
  std::uint32_t issue_off_ = 0;  // bytes of req(issue_) framed so far
  std::size_t next_stream_ = 0;
  Fifo<std::uint64_t> recvs_;  // posted receives (nothing is ever sent to them: flushed at the end)
  std::unordered_map<std::uint32_t, Mw*> windows_;  // by rkey: the windows bound here
  std::unique_ptr<Crossing> crossing_;
  bool error_ = false;
  bool started_ = false;
  bool draining_ = false;  // failed while the peer may reach this memory: completions wait (fail())
  Deadline drain_until_{};
  std::string failure_;
  Deadline next_stall_check_{};
};

}  // namespace rdmakit::detail::soft
