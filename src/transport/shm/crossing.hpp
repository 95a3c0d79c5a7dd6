// SPDX-License-Identifier: Apache-2.0
#pragma once
// How shm's data crosses between two processes of one host (soft/crossing.hpp: the queue pair
// sends only frames, the responder moves the bytes), in three ways (docs/engine.md, "Transports"):
//
// - by cross-memory attach (WRITE_CMA, READ_CMA): the request names the requester's address, and
//   the responder copies with process_vm_readv/writev from and to the process it proved holds
//   the link's session (src/transport/shm/host.hpp);
// - through the requester's shared ring (WRITE_RING, READ_RING; ring.hpp), where the kernel or
//   the engine rules attach out: the requester copies a WRITE's data in, the responder copies it
//   out into its window (a READ the other way round);
// - from memory the requester's device shares (WRITE_MAP, READ_MAP; soft::Device::share): the
//   requester hands the range's memfd to the peer once per link (SHARE, with SCM_RIGHTS), the
//   responder maps it and copies between that mapping and the window it checked: one copy
//   whatever the kernel allows. When the device stops sharing a range, the peer is told
//   (UNSHARE) and unmaps it.
//
// In every way the responder touches only the window it checked and memory the requester
// handed it (its ring, its shared ranges) or named by address in a process proven to be the
// link's; the requester's other memory is never reachable.
//
// Threads: its queue pair's.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "transport/shm/memfd.hpp"
#include "transport/shm/ring.hpp"
#include "transport/soft/crossing.hpp"
#include "transport/soft/device.hpp"

namespace rdmakit::detail::shm {

using soft::kMaxShare;
/// Ranges a requester gives one link at most (CrossingConfig::max_given; what else it moves goes
/// by attach or the ring); a responder takes no more (a peer that sends more lies), and its
/// device no more than its budget (soft/device.hpp: past that, the link fails saying so).
inline constexpr std::size_t kMaxGiven = 1024;
/// A ring frame this long is sent (requester) or answered (responder) at once rather than with
/// the others of its turn: the two sides' copies overlap.
inline constexpr std::uint32_t kRingEager = 64u << 10;
/// Mapped frames' answers are sent after this many bytes copied, not only at the turn's end (the
/// requester's queue would run dry meanwhile). Not after each: every send wakes the requester,
/// which cost the target a fifth of its time at 512 KiB (a VM of 2 CPUs). 64 requests of 64 KiB
/// are 4 MiB: half of that answered keeps the requester posting.
inline constexpr std::uint64_t kAnswerEvery = 2u << 20;

struct CrossingConfig {
  /// The side that asks: its WRITEs and READs carry this process's addresses (the peer copies
  /// them by cross-memory attach) or, with `ring`, go through it. The side that does not ask
  /// serves the peer's such requests, and its own go in the stream.
  bool asks = false;
  /// The side that serves: the requester's process, which it copies from and to by attach (0:
  /// it serves no such request).
  int peer_pid = 0;
  /// The requester's shared ring: the requester's WRITEs and READs stage their data in it (with
  /// `asks`), or this side serves the peer's through it (without).
  std::shared_ptr<Ring> ring;
  /// Engine protocol 8 and later, the side that asks: its WRITEs and READs of memory its device
  /// shares name the range, handed to the peer first; at most `max_given` ranges per link. Only
  /// to a process of this user.
  bool shares = false;
  std::size_t max_given = kMaxGiven;
  /// The same, the side that serves: it maps what the peer shares. A side that does not take
  /// them fails a link whose peer sends any.
  bool takes_shares = false;
};

class Crossing final : public soft::Crossing {
 public:
  /// Throws Error (EINVAL) for a ring of a size a link cannot use.
  Crossing(soft::Device& dev, CrossingConfig cfg);
  ~Crossing() override;

  [[nodiscard]] bool one_stream() const noexcept override { return cfg_.ring || cfg_.shares || cfg_.takes_shares; }
  soft::FrameOp op(soft::Request& r, bool write) noexcept override;
  bool before_requests(soft::Stream& s) noexcept override { return take_back(s); }
  Framed frame(soft::Stream& s, soft::Request& r, std::uint32_t offset, std::uint32_t len, soft::Frame& f,
               soft::Expect& e) noexcept override;
  void answered_ok(const soft::Expect& e, soft::Request& r) noexcept override;
  void release(const soft::Expect& e) noexcept override;
  void completed(const soft::Request& r) noexcept override;
  bool shares_changed(soft::Stream* s) noexcept override;
  [[nodiscard]] bool peer_reaches_memory() const noexcept override {
    // Through a ring the peer reaches none of this process's buffers, unless it maps some.
    return (cfg_.asks && !cfg_.ring) || !given_.empty();
  }
  bool serve(soft::Qp& qp, soft::Stream& s, const soft::Frame& f, soft::Frame& a) noexcept override;
  bool take(soft::Qp& qp, soft::Stream& s, const soft::Frame& f) noexcept override;
  [[nodiscard]] bool takes_descriptors() const noexcept override { return cfg_.takes_shares; }
  void drop() noexcept override;
  [[nodiscard]] std::size_t peer_shares() const noexcept override { return maps_.size(); }
  [[nodiscard]] std::size_t given() const noexcept override { return given_.size(); }

 private:
  /// The range the device shares that holds [addr, +len) (null: none, or not this link's way).
  const soft::SharedRange* shared_at(std::uint64_t addr, std::uint64_t len) noexcept;
  /// Reads the device's ranges again if they changed since last read. False: they could not be
  /// read (the snapshot stays as it was).
  bool look_again() noexcept;
  /// The range of the last snapshot whose base is at or below `addr` (null: none), and its entry.
  const soft::SharedRange* range_at(std::uint64_t addr) const noexcept;
  const std::shared_ptr<const soft::SharedRange>* entry_at(std::uint64_t addr) const noexcept;
  /// Queues on `s` the SHARE of range `id` (the one at `addr`) if the peer does not have it yet,
  /// and the UNSHAREs owed; false when `s` has no room for them now.
  bool give(soft::Stream& s, std::uint64_t id, std::uint64_t addr) noexcept;
  /// Queues the UNSHAREs owed; false when `s` has no room for them now.
  bool take_back(soft::Stream& s) noexcept;

  soft::Device& dev_;
  CrossingConfig cfg_;
  // The ring (a requester's): bytes handed out up to ring_tail_, freed up to ring_head_ (counts
  // that only grow; a position is count % size).
  std::uint64_t ring_head_ = 0, ring_tail_ = 0;
  // The requester: the device's ranges as last looked at (and the count they were looked at
  // under), those given to the peer, and those to take back from it.
  std::shared_ptr<const soft::Device::Shares> shares_;
  std::uint64_t shares_seen_ = ~std::uint64_t{0};
  std::unordered_map<std::uint64_t, std::shared_ptr<const soft::SharedRange>> given_;
  std::vector<std::uint64_t> ungiven_;
  // The responder: what the peer shared, mapped here, by its id.
  std::unordered_map<std::uint64_t, Mapping> maps_;
};

}  // namespace rdmakit::detail::shm
