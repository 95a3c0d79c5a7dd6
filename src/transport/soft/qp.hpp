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
#include "transport/soft/frame.hpp"
#include "transport/shm/ring.hpp"

namespace rdmakit::detail::soft {
/// The largest range a requester shares, and a responder maps.
inline constexpr std::size_t kMaxShare = std::size_t{1} << 40;
}  // namespace rdmakit::detail::soft

namespace rdmakit::detail::soft {

struct QpConfig {
  std::uint32_t send_depth = 64;
  std::uint32_t qp_num = 1;
  /// shm, the requester: its WRITEs and READs carry this process's addresses, not data (the
  /// responder copies them by cross-memory attach).
  bool cma = false;
  /// shm, the responder: the requester's process, which it copies from and to; 0: it serves no
  /// such request (tcp, or a side that only asks).
  int peer_pid = 0;
  /// shm without cross-memory attach (src/transport/shm/ring.hpp): the requester's shared ring.
  /// With `cma`, this side's WRITEs and READs stage their data in it (WRITE_RING, READ_RING);
  /// without, this side serves the peer's through it. Only on one stream (its answers, in
  /// order, free it in order).
  std::shared_ptr<shm::Ring> ring;
  /// shm, engine protocol 8 and later (one stream), the side that asks: its WRITEs and READs of
  /// memory its device shares (Device::share) name the range, which it hands to the peer first
  /// (SHARE) and takes back when the device no longer shares it (UNSHARE); at most kMaxGiven
  /// ranges per link (`max_given`), the rest going as `cma` and `ring` say. Only to a process
  /// of this user.
  bool shares = false;
  std::size_t max_given = 1024;
  /// The same, the side that serves: it maps what the peer shares and copies between that and
  /// its windows (WRITE_MAP, READ_MAP): one copy, whether or not this host allows cross-memory
  /// attach. A side that does not take them fails a link whose peer sends any.
  bool takes_shares = false;
  /// An answer owed for this long on a stream that delivered nothing meanwhile: the peer is
  /// gone (as an RC QP's retries run out).
  std::chrono::milliseconds stall_timeout{4000};
  /// The queue pair failed on its own (not by to_error()): why, for the link's owner.
  std::function<void(const std::string&)> on_fault;
};

class Stream;

class Qp {
 public:
  /// Takes the connected streams (at least one, nonblocking or not: they are made nonblocking).
  /// Built on any thread; start() joins them to `cq` on the thread that polls it.
  Qp(Device& dev, Cq& cq, QpConfig cfg, std::vector<Fd> streams);
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
  /// Ranges the peer shared and this side maps (a responder's), for tests and reports.
  [[nodiscard]] std::size_t peer_shares() const noexcept { return maps_.size(); }
  /// Ranges this side gave its peer (a requester's).
  [[nodiscard]] std::size_t given() const noexcept { return given_.size(); }

 private:
  friend class Stream;
  struct Req {
    std::uint64_t wr_id = 0;
    ibv_wc_opcode opcode = IBV_WC_RDMA_WRITE;
    FrameOp op = FrameOp::write;
    bool signaled = false;
    bool issued = false;
    bool done = false;
    std::uint32_t pending = 0;  // frames sent or queued, not answered
    std::uint64_t laddr = 0, raddr = 0;
    std::uint32_t length = 0, rkey = 0;
    std::uint64_t arg0 = 0, arg1 = 0;  // atomics' operands; WRITE_MAP, READ_MAP: the range, the offset in it
    ibv_wc_status status = IBV_WC_SUCCESS;
  };
  Req& req(std::uint64_t seq) noexcept { return reqs_[seq & mask_]; }
  /// One posted work request into the send queue; an errno when it is refused.
  int take(const ibv_send_wr& w) noexcept;
  /// The oldest request an answer is owed for (null: none).
  Req* oldest_owed() noexcept;
  bool bind(const ibv_send_wr& w) noexcept;
  /// The range the device shares that holds [addr, +len) (null: none, or not this link's way).
  const SharedRange* shared_at(std::uint64_t addr, std::uint64_t len) noexcept;
  /// The range of the last snapshot whose base is at or below `addr` (null: none).
  const SharedRange* range_at(std::uint64_t addr) const noexcept;
  /// Drops every mapping of the peer's memory (the link failed or goes).
  void unmap_all() noexcept;
  /// Queues on `s` the SHARE of range `id` if the peer does not have it yet, and the UNSHAREs
  /// owed; false when `s` has no room for them now.
  bool give(Stream& s, std::uint64_t id) noexcept;
  /// Whether `s` has room for `frames` unanswered frames beside every answer it may still owe.
  [[nodiscard]] bool room_for_control(const Stream& s, std::size_t frames) const noexcept;
  bool take_back(Stream& s) noexcept;
  /// A SHARE or UNSHARE from the peer (responder). False: the link failed (a lying peer).
  bool take_share(Stream& s, const Frame& f) noexcept;
  /// Cuts the posted requests into frames on the streams, as far as they have room.
  void issue() noexcept;
  void complete_ready() noexcept;
  /// The error state, with `why`; `first` (if not null) keeps its own error status, every other
  /// outstanding request is flushed.
  void fail(std::string why, Req* first, bool fault) noexcept;
  /// A request frame from the peer (responder). False: no room to answer it yet.
  bool serve(Stream& s, const Frame& f) noexcept;
  FrameStatus check(const Frame& f, unsigned need) const noexcept;
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
  /// Failed with shm answers owed: reads `s` to its end (the peer's close), then ends the drain.
  void drain(Stream& s) noexcept;
  void end_drain() noexcept;
  /// The requester at the other end of `s` shut its side (it gave up on what it asked).
  [[nodiscard]] bool gave_up(const Stream& s) const noexcept;
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
  // The ring (cfg_.ring, a requester's): bytes handed out up to ring_tail_, freed up to
  // ring_head_ (counts that only grow; a position is count % size).
  std::uint64_t ring_head_ = 0, ring_tail_ = 0;
  Fifo<std::uint64_t> recvs_;  // posted receives (nothing is ever sent to them: flushed at the end)
  std::unordered_map<std::uint32_t, Mw*> windows_;  // by rkey: the windows bound here
  // cfg_.shares, the requester: the device's ranges as last looked at (and the count they were
  // looked at under), those given to the peer, and those to take back from it.
  std::shared_ptr<const Device::Shares> shares_;
  std::uint64_t shares_seen_ = ~std::uint64_t{0};
  std::unordered_map<std::uint64_t, std::shared_ptr<const SharedRange>> given_;
  std::vector<std::uint64_t> ungiven_;
  // cfg_.shares, the responder: what the peer shared, mapped here, by its id.
  std::unordered_map<std::uint64_t, shm::Mapping> maps_;
  bool error_ = false;
  bool started_ = false;
  bool draining_ = false;  // failed with shm answers owed: completions wait (fail())
  Deadline drain_until_{};
  std::string failure_;
  Deadline next_stall_check_{};
};

}  // namespace rdmakit::detail::soft
