// SPDX-License-Identifier: Apache-2.0
#pragma once
// The calling thread's identity in one word, read without a library call.

#include <pthread.h>

namespace rdmakit::detail {

/// Which thread this is, for comparisons only: unique among the process's live threads (the
/// address of its thread control block; a thread started after another ended may get the same,
/// as std::thread::id's). Null is no thread. Read from the thread pointer register on x86-64 and
/// Arm64 (one instruction); std::this_thread::get_id() calls pthread_self(), and on the lab's
/// emulator a call and its return cost more than that (docs/performance.md). Elsewhere
/// pthread_self(): __has_builtin says yes to __builtin_thread_pointer on targets where GCC then
/// refuses to expand it.
using ThreadSelf = const void*;

inline ThreadSelf thread_self() noexcept {
#if defined(__x86_64__) || defined(__aarch64__)
  return __builtin_thread_pointer();
#else
  return reinterpret_cast<ThreadSelf>(::pthread_self());
#endif
}

}  // namespace rdmakit::detail
