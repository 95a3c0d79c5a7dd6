// SPDX-License-Identifier: Apache-2.0
#pragma once
// What a software queue pair (qp.hpp) keeps per stream, shared by its requester (qp.cpp), its
// stream I/O and responder (streams.cpp) and its crossing (crossing.hpp). Internal to
// transport/soft and the transports that give it a crossing.

#include <infiniband/verbs.h>

#include <algorithm>
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
// Descriptors that came with the peer's bytes (a crossing's: crossing.hpp) and wait for the
// frames that take them: at most this many.
inline constexpr std::size_t kMaxWaitingFds = 16;
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
  std::shared_ptr<const SharedRange> share;  // a range whose descriptor goes with the frame (shm's SHARE)
  bool share_sent = false;  // that descriptor went (with the first of its bytes)
};

struct Expect {
  std::uint64_t req = 0;  // the request's sequence number
  std::uint64_t id = 0;
  std::uint32_t offset = 0, len = 0;
  FrameOp op = FrameOp::write;
  // What a crossing's frame holds until its answer (shm's ring: where its data is in the ring,
  // and the ring's tail once it had its room, freed to there).
  std::uint32_t held_at = 0;
  std::uint64_t held_to = 0;
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
  bool closed = false;   // draining (fail(), a crossing's): the peer closed its side
  bool watch_out = false;  // watched for room to send
  bool watch_in = true;
  Deadline last_in = Clock::now();
  std::uint64_t copied = 0;  // bytes a crossing copied since answers were last sent
  std::vector<Fd> fds;  // descriptors received (a crossing's), each for the next frame that takes one

  [[nodiscard]] bool out_full() const noexcept { return out_tail - out_head == out.size(); }
  [[nodiscard]] bool out_empty() const noexcept { return out_tail == out_head; }
  [[nodiscard]] std::uint64_t owed() const noexcept { return exp_tail - exp_head; }
  /// Whether there is room for `frames` more unanswered frames beside every answer this side may
  /// still owe (a WRITE's is queued once its data is in, counted on the room serve() saw).
  [[nodiscard]] bool room_for_control(std::size_t frames) const noexcept {
    const std::size_t free = out.size() - (out_tail - out_head);
    return free >= frames + (kAnswerFrames - std::min<std::size_t>(kAnswerFrames, answers_queued));
  }
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
