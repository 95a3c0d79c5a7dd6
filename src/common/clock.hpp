// SPDX-License-Identifier: Apache-2.0
#pragma once
// The one clock every deadline in the library is measured on.

#include <time.h>

#include <chrono>

namespace rdmakit::detail {

/// std::chrono::steady_clock's time, read by clock_gettime(CLOCK_MONOTONIC) as libstdc++ reads
/// it, without its out-of-line now() in between: a data path reads the clock up to three times
/// per transfer (telemetry), and on the lab's emulator every call and return costs tens of
/// nanoseconds (docs/performance.md). Its time points are steady_clock's.
struct Clock {
  using duration = std::chrono::steady_clock::duration;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::steady_clock::time_point;
  static constexpr bool is_steady = true;
  static time_point now() noexcept {
    timespec ts;
    (void)::clock_gettime(CLOCK_MONOTONIC, &ts);
    return time_point(std::chrono::duration_cast<duration>(std::chrono::seconds{ts.tv_sec} +
                                                           std::chrono::nanoseconds{ts.tv_nsec}));
  }
};
using Deadline = Clock::time_point;

inline Deadline deadline_in(std::chrono::milliseconds d) { return Clock::now() + d; }

}  // namespace rdmakit::detail
