// SPDX-License-Identifier: Apache-2.0
#pragma once
// The control channel over rdma_cm: a small RC QP of its own, connected by the CM, carrying a
// byte stream in SENDs. Private to src/cm/ (cm.hpp is the layer's interface).

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "cm/cm.hpp"
#include "verbs/device_layer.hpp"
#include "verbs/handles.hpp"

namespace rdmakit::detail {

/// What a client puts in its connect request: the listener refuses anything else at once.
inline constexpr std::array<std::uint8_t, 4> kCmMagic{'R', 'D', 'M', 'K'};
inline constexpr std::uint8_t kCmVersion = 1;
inline constexpr std::size_t kCmRequestSize = 8;  // magic, version, flags, 2 reserved
/// A REJ's private data holds 148 bytes; ours is the magic and a reason cut to fit.
inline constexpr std::size_t kCmRejectSize = 144;

class CmChannel final : public Channel {
 public:
  // Stream chunks: one SEND each, one packet at the smallest common MTU. The receive side keeps
  // kRecvSlots posted (64 KiB: what a peer may send before this side reads, as a socket's
  // buffer would hold) and stops reposting once kRecvBacklog bytes wait to be read, so a peer
  // that floods the channel meets RNR backpressure (the control QP retries RNR forever: a busy
  // peer is never taken for dead, and the sender's deadline bounds its wait).
  static constexpr std::size_t kSlot = 1024;
  static constexpr std::size_t kSendSlots = 4;
  static constexpr std::size_t kRecvSlots = 64;
  static constexpr std::size_t kRecvBacklog = 64 * 1024;

  /// Builds the control QP (in INIT) on the device and port `id` resolved to, in a protection
  /// domain of its own. `events` is the channel `id` reports on, owned from now on.
  CmChannel(EventChannelPtr events, CmIdPtr id, std::string peer, const CmOptions& options);
  ~CmChannel() override;

  /// Active side, after route resolution: sends the REQ, and on the reply moves the QP to RTS
  /// and completes with an RTU. Throws Error (cm_event_error) when the peer rejects, does not
  /// answer by `deadline`, or the CM reports a failure.
  void connect(Deadline deadline);
  /// Passive side: RTS, then the REP; waits for the client's RTU by `deadline`.
  void accept(Deadline deadline);

  void send_all(std::span<const std::uint8_t> bytes, Deadline deadline) override;
  long send_some(std::span<const std::uint8_t> bytes, int* error) noexcept override;
  [[nodiscard]] bool sent() noexcept override;
  void recv_exact(std::span<std::uint8_t> bytes, Deadline deadline) override;
  long recv_nonblocking(std::span<std::uint8_t> buf, int* error) noexcept override;
  [[nodiscard]] int fd() const noexcept override { return epoll_.get(); }
  void keepalive(std::chrono::milliseconds interval, std::chrono::milliseconds timeout) override;
  [[nodiscard]] std::string local_address() const override;
  [[nodiscard]] std::string device() const override;

 private:
  // wr_ids: send slots are 0..kSendSlots-1, the probe kProbe, receive slots kRecvBase + k.
  static constexpr std::uint64_t kProbe = kSendSlots;
  static constexpr std::uint64_t kRecvBase = 1000;

  void transition(ibv_qp_state state, const char* name);
  void post_recv(std::size_t slot);
  /// Posts the first chunk of `bytes` in a free send slot: the bytes taken (0: no slot is free),
  /// or -1 when the post failed (errno-style code in `rc`).
  long post_chunk(std::span<const std::uint8_t> bytes, int* rc) noexcept;
  /// Reads the CM's events and the CQ without blocking; sends a keepalive probe when due.
  void pump() noexcept;
  /// Keeps `fd()` readable while received bytes wait in rx_ or the channel is closed, as a
  /// socket's is: a pump from send_all() takes completions (and their events) off the CQ, and
  /// a reader that waits on `fd()` must still learn of what they brought.
  void update_ready() noexcept;
  /// The channel is gone; `err` says why (0: the peer disconnected).
  void fail(int err) noexcept;
  /// Waits for `fd()` (at most 50 ms, so timed work in pump() runs) unless `deadline` passed.
  bool wait(Deadline deadline) noexcept;
  [[noreturn]] void throw_gone(const char* op) const;
  std::uint8_t* slot(std::uint64_t k) noexcept { return buffer_.data() + k * kSlot; }

  // Creation order; destruction (the reverse) releases the QP before the memory it receives
  // into, the memory before its PD, and the CM id (which waits for its events to be acked)
  // before its event channel.
  EventChannelPtr events_;
  CmIdPtr id_;
  std::string peer_;
  CmOptions options_;
  Fd epoll_;
  Fd ready_;  // an eventfd in epoll_, set while update_ready() says so
  bool ready_set_ = false;
  Fd grace_;  // a timerfd in epoll_: readable when the grace after a DISCONNECTED has passed
  std::shared_ptr<DeviceResources> dev_;
  std::vector<std::uint8_t> buffer_;
  MrPtr mr_;
  CompChannelPtr comp_;
  CqPtr cq_;
  QpPtr qp_;

  bool established_ = false;
  bool gone_ = false;
  int gone_errno_ = 0;
  std::string gone_detail_;
  Deadline disconnected_at_{};  // the CM said DISCONNECTED; receives in flight get a grace
  std::array<bool, kSendSlots> send_busy_{};
  bool probe_out_ = false;
  std::chrono::milliseconds keepalive_{0};
  Deadline last_heard_{};
  std::deque<std::uint8_t> rx_;
  std::vector<std::size_t> parked_;  // receive slots not reposted while the backlog is full
};

/// Takes one event off `events` by `deadline` (nullptr on timeout), copied out and acked.
struct CmEvent {
  rdma_cm_event_type type{};
  int status = 0;
  rdma_cm_id* id = nullptr;  // a connect request's new id (ours to destroy)
  std::vector<std::uint8_t> data;  // the private data
};
/// The next CM event by `deadline` (false: none came); a requested `stop` throws ECANCELED.
bool next_event(rdma_event_channel* events, Deadline deadline, CmEvent& out, const Stop* stop = nullptr);

}  // namespace rdmakit::detail
