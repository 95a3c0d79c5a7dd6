// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "rdmakit/memory.hpp"

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// A range of one of an engine's segments: what a lease grants (Engine::grant).
struct LeaseRange {
  std::string segment;
  std::uint64_t offset = 0;  ///< from the segment's start
  std::uint64_t length = 0;
};

/// Why a lease ended.
enum class LeaseCause : std::uint8_t {
  expired,    ///< its time passed without a renewal
  released,   ///< its holder released it (Engine::release)
  revoked,    ///< the granting engine ended it (Engine::end_lease)
  peer_lost,  ///< the last link that held its windows closed and none came back within 3 s: the
              ///< holder died, restarted, was revoked or removed (its windows went with the link)
  withdrawn,  ///< a segment it covers was withdrawn
  failed,     ///< a window could not be bound for it (the reason says why)
};
[[nodiscard]] const char* to_string(LeaseCause cause) noexcept;

/// A lease that ended, as the engine that granted it is told (Engine::next_lease_end,
/// EngineConfig::on_lease_end): by then no window of it works on any link, so its ranges may
/// be reused.
struct LeaseEnd {
  std::uint64_t lease = 0;
  std::string peer;  ///< the peer it was granted to, as given to grant()
  LeaseCause cause = LeaseCause::expired;
  std::string reason;
};

/// A lease as its holder knows it (Engine::lease).
struct HeldLease {
  std::uint64_t lease = 0;
  std::vector<LeaseRange> ranges;  ///< of the granting peer's segments
  Access access = Access::none;
  /// When the holder stops using it, on its own clock: when the grant (or the last renewal's
  /// answer) arrived, plus its time, less a twentieth of it (at most 100 ms) for the message's
  /// way here, so that the holder stops before the granting engine ends it (not so for a ttl
  /// of under 20 ms, or a message slower than the guard: the target's NIC refuses what comes
  /// late, as lease_expired).
  std::chrono::steady_clock::time_point expires{};
  bool ended = false;
  std::string reason;  ///< why it ended
};

}  // namespace rdmakit
#pragma GCC visibility pop
