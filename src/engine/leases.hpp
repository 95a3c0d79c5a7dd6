// SPDX-License-Identifier: Apache-2.0
#pragma once
// Leases (Engine::grant): a peer's access to ranges of this engine's segments for a time, held
// as memory windows on the peer's links, which go when the lease ends.
//
// The granting side: one LeaseState per lease, shared by the registry (Engine::Impl::leases,
// while it lasts) and every worker (each binds its links' windows and forgets them when told it
// ended). Its deadline is one atomic: renewals move it forward, the end swaps in kEnded once,
// and whoever does that posts the end to every worker; the last to drop its windows tells the
// application (Engine::Impl::lease_ended), so no window works by then.
//
// The holding side: what each link was told (Link::leased, by the peer's slot for the segment)
// and, per peer, each lease as the application sees it (Peer::held).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "rdmakit/engine.hpp"
#include "rdmakit/memory.hpp"

namespace rdmakit::detail {

struct LeaseState {
  static constexpr std::int64_t kEnded = -1;
  struct Range {
    std::string segment;
    std::uint32_t buffer = 0, generation = 0;
    std::uint64_t in_buffer = 0;   // where it starts in the buffer
    std::uint64_t in_segment = 0;  // ... and in the segment
    std::uint64_t length = 0;
  };
  std::uint64_t id = 0;
  std::string peer;  // the grant's entry (admission.hpp)
  Access access = Access::none;
  std::chrono::milliseconds ttl{};  // as granted: the most a renewal gives
  std::vector<Range> ranges;
  // steady_clock nanoseconds when it ends, or kEnded.
  std::atomic<std::int64_t> deadline{0};
  // Written once, by whoever swapped in kEnded, before it posts the end to the workers.
  LeaseCause cause = LeaseCause::expired;
  std::string reason;
  std::atomic<std::uint32_t> workers_left{0};
  // Links that hold its windows now (on every worker). One that has none yet (its peer not
  // linked) lasts, and gets them on the peer's next link; one whose last link closed ends
  // (peer_lost) unless another link of its peer holds it within kOrphanGrace (a link that broke
  // and came back: the holder lives).
  std::atomic<std::int32_t> links{0};
  std::atomic<std::int64_t> orphaned{0};  // steady ns when its last link closed; 0: it has one, or never had
  std::mutex orphan_mu;
  std::string orphan_reason;  // under orphan_mu: why that link closed
  static constexpr std::chrono::milliseconds kOrphanGrace{3000};

  [[nodiscard]] static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  /// Moves its end to now + `ttl` (at most the granted ttl): the ttl given, or 0 if it has ended
  /// (or ends before this could move it).
  std::chrono::milliseconds extend(std::chrono::milliseconds want) noexcept {
    const auto give = std::min(want, ttl);
    std::int64_t d = deadline.load(std::memory_order_acquire);
    for (;;) {
      const std::int64_t now = now_ns();
      if (d == kEnded || d <= now) return std::chrono::milliseconds{0};
      const std::int64_t to = now + std::chrono::duration_cast<std::chrono::nanoseconds>(give).count();
      if (deadline.compare_exchange_weak(d, std::max(d, to), std::memory_order_acq_rel)) return give;
    }
  }
  /// True for the one caller that ends it.
  bool take_end() noexcept { return deadline.exchange(kEnded, std::memory_order_acq_rel) != kEnded; }
  [[nodiscard]] bool ended() const noexcept { return deadline.load(std::memory_order_acquire) == kEnded; }
  /// Milliseconds left (at least 1 while it lasts; 0 once ended or past).
  [[nodiscard]] std::uint32_t left_ms() const noexcept {
    const std::int64_t d = deadline.load(std::memory_order_acquire);
    const std::int64_t now = now_ns();
    if (d == kEnded || d <= now) return 0;
    return static_cast<std::uint32_t>(std::max<std::int64_t>(1, (d - now) / 1'000'000));
  }
};

/// A range of a lease as a holder's link has it: its window's key, and a region for the data
/// path that starts at the segment's start (so a transfer's offset is the segment's) and ends
/// with the range; the start is checked here (Worker::lease_region).
struct LeasedRange {
  std::uint64_t offset = 0, length = 0;  // in the segment
  std::uint64_t lease = 0;
  RemoteRegion region;
};

/// A lease as a holder keeps it (Peer::held), with the peer's slots of its ranges' segments.
struct HeldRecord {
  HeldLease info;
  std::vector<std::uint32_t> slots;  // by range
  std::uint32_t total = 0;           // ranges the lease has
  std::uint64_t from_link = 0;       // the serial of the link whose LEASE messages filled it
  std::uint64_t order = 0;           // when it ended (the oldest ended go first)
  bool release_pending = false;      // released here with no link up: RENEW 0 goes on the next
  // Every ready link of the peer (each rail) has all its ranges: what Engine::lease waits for, so
  // that a transfer finds the lease's windows whichever rail takes it.
  bool everywhere = false;
  [[nodiscard]] bool complete() const noexcept { return info.ranges.size() >= total; }
};

// What a holder takes from its peer on one link (a peer that announces more loses the link), and
// what a granting engine gives one peer entry.
inline constexpr std::size_t kLinkLeases = 4096;
inline constexpr std::size_t kLinkRanges = 1u << 18;

/// How long before its granted end a holder stops using a lease: a twentieth, at most 100 ms.
[[nodiscard]] inline std::chrono::milliseconds lease_guard(std::chrono::milliseconds ttl) noexcept {
  return std::min(ttl / 20, std::chrono::milliseconds{100});
}

}  // namespace rdmakit::detail
