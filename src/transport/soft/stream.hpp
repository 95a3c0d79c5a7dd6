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
// A ring frame this long is sent (requester) or answered (responder) at once rather than with
// the others of its turn: the two sides' copies overlap.
inline constexpr std::uint32_t kRingEager = 64u << 10;
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

  [[nodiscard]] bool out_full() const noexcept { return out_tail - out_head == out.size(); }
  [[nodiscard]] bool out_empty() const noexcept { return out_tail == out_head; }
  [[nodiscard]] std::uint64_t owed() const noexcept { return exp_tail - exp_head; }
  Out& push_out() noexcept { return out[out_tail++ % out.size()]; }
};

}  // namespace rdmakit::detail::soft
