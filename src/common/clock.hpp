// SPDX-License-Identifier: Apache-2.0
#pragma once
// The one clock every deadline in the library is measured on.

#include <chrono>

namespace rdmakit::detail {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_in(std::chrono::milliseconds d) { return Clock::now() + d; }

}  // namespace rdmakit::detail
