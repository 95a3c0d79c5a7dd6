// SPDX-License-Identifier: Apache-2.0
#pragma once
// The calling thread's identity in one word, read without a library call.

#include <pthread.h>

namespace rdmakit::detail {

/// Which thread this is, for comparisons only: unique among the process's live threads (the
/// address of its thread control block; a thread started after another ended may get the same,
/// as std::thread::id's). Null is no thread. Read from the thread pointer register where the
/// compiler can (x86-64 and Arm: one instruction); std::this_thread::get_id() calls
/// pthread_self(), and on the lab's emulator a call and its return cost more than that
/// (docs/performance.md).
using ThreadSelf = const void*;

inline ThreadSelf thread_self() noexcept {
#if __has_builtin(__builtin_thread_pointer)
  return __builtin_thread_pointer();
#else
  return reinterpret_cast<ThreadSelf>(::pthread_self());
#endif
}

}  // namespace rdmakit::detail
