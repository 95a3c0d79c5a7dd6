// SPDX-License-Identifier: Apache-2.0
#pragma once
// What a software queue pair (qp.hpp) keeps per stream, shared by its requester (qp.cpp) and
// its stream I/O and responder (streams.cpp). Internal to transport/soft.

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "transport/soft/qp.hpp"

namespace rdmakit::detail::soft {

// Per stream: frames queued to send (requests and answers), answers owed to it, and how much of
// the peer's stream is read at once while looking for headers (a payload longer than a few
// hundred bytes is received straight into its memory instead).
inline constexpr std::size_t kOutFrames = 512;
inline constexpr std::uint32_t kRequestFrames = 192;  // request frames queued or unanswered, per stream
inline constexpr std::uint32_t kAnswerFrames = 192;   // answers queued, per stream (then reading waits)
inline constexpr std::size_t kStage = 4096;
inline constexpr std::size_t kDirect = 512;
inline constexpr int kIov = 64;
// Shared ranges: a requester gives at most kMaxGiven per link (QpConfig::max_given; what else it
// moves goes by attach or the ring) and none past kMaxShare bytes; a responder takes no more (a
// peer that sends more lies), and its device no more than its budget (device.hpp: past that,
// the link fails saying so). At most kMaxWaitingFds descriptors may wait for their SHARE frames.
inline constexpr std::size_t kMaxGiven = 1024;
inline constexpr std::size_t kMaxWaitingFds = 16;
// A ring frame this long is sent (requester) or answered (responder) at once rather than with
// the others of its turn: the two sides' copies overlap.
inline constexpr std::uint32_t kRingEager = 64u << 10;
// Mapped frames' answers are sent after this many bytes copied, not only at the turn's end (the
// requester's queue would run dry meanwhile). Not after each: every send wakes the requester,
// which cost the target a fifth of its time at 512 KiB (a VM of 2 CPUs). 64 requests of 64 KiB
// are 4 MiB: half of that answered keeps the requester posting.
inline constexpr std::uint64_t kAnswerEvery = 2u << 20;
// What one turn takes of a stream before the others get theirs.
inline constexpr std::size_t kTurnBytes = 8u << 20;

inline ibv_wc_status wc_status(FrameStatus s) noexcept {
  switch (s) {
    case FrameStatus::ok: return IBV_WC_SUCCESS;
    case FrameStatus::access: return IBV_WC_REM_ACCESS_ERR;
    case FrameStatus::invalid: return IBV_WC_REM_INV_REQ_ERR;
    default: return IBV_WC_REM_OP_ERR;
  }
}

struct Out {
  std::array<std::uint8_t, kFrameSize> head{};
  const std::uint8_t* data = nullptr;
  std::uint32_t len = 0;
  bool answer = false;
  std::uint32_t rkey = 0;  // an answer's data: the window it is read from
  std::unique_ptr<std::uint8_t[]> copy;  // its data, once that window went before it was sent
  std::shared_ptr<const SharedRange> share;  // a SHARE: the range, whose descriptor goes with it
  bool share_sent = false;  // that descriptor went (with the first of its bytes)
};

struct Expect {
  std::uint64_t req = 0;  // the request's sequence number
  std::uint64_t id = 0;
  std::uint32_t offset = 0, len = 0;
  FrameOp op = FrameOp::write;
  std::uint32_t ring_off = 0;  // a ring frame's data in the ring (shm without cross-memory attach)
  std::uint64_t ring_end = 0;  // the ring's tail once this frame had its room: freed to here
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
  std::uint64_t copied = 0;  // mapped frames' bytes copied since answers were last sent
  std::vector<Fd> fds;  // descriptors received (cfg.shares), each for the next SHARE frame

  [[nodiscard]] bool out_full() const noexcept { return out_tail - out_head == out.size(); }
  [[nodiscard]] bool out_empty() const noexcept { return out_tail == out_head; }
  [[nodiscard]] std::uint64_t owed() const noexcept { return exp_tail - exp_head; }
  /// The next frame to send, `f` encoded, carrying `len` bytes at `data` (none: nullptr, 0).
  Out& push_out(const Frame& f, bool answer, const std::uint8_t* data = nullptr, std::uint32_t len = 0) noexcept {
    Out& o = out[out_tail++ % out.size()];
    encode(f, o.head);
    o.answer = answer;
    o.data = data;
    o.len = len;
    o.rkey = 0;
    o.copy.reset();
    o.share.reset();
    o.share_sent = false;
    if (answer) ++answers_queued;
    return o;
  }
};

}  // namespace rdmakit::detail::soft
