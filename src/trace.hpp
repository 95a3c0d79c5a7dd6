// SPDX-License-Identifier: Apache-2.0
#pragma once
// Tracing inside the library: events are built only when someone listens, and a tracer that
// throws never disturbs the connection.

#include <functional>
#include <string>
#include <utility>

#include "rdmakit/connection.hpp"

namespace rdmakit::detail {

/// RDMAKIT_TRACE=1: text lines on standard error; RDMAKIT_TRACE=json: JSON lines; else none.
std::function<void(const TraceEvent&)> trace_from_environment();

/// Calls `make` (which returns a TraceEvent) and hands the event to `sink`, only if there is a
/// sink; swallows whatever the sink or the formatting throws.
template <typename Make>
void emit(const std::function<void(const TraceEvent&)>& sink, Make make) noexcept {
  if (!sink) return;
  try {
    sink(make());
  } catch (...) {
  }
}

}  // namespace rdmakit::detail
