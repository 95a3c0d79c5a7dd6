// SPDX-License-Identifier: Apache-2.0
#pragma once
// A mutex whose lock can wait until a deadline (std::lock_guard, std::unique_lock and their
// try_lock_until/try_lock_for work with it), built on std::mutex and std::condition_variable.
// std::timed_mutex would do, but glibc implements its timed wait with pthread_mutex_clocklock,
// which GCC 12's ThreadSanitizer does not intercept: it then misses the lock and reports races
// on everything the mutex guards. Not for hot paths: every lock takes the inner mutex.

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace rdmakit::detail {

class DeadlineMutex {
 public:
  DeadlineMutex() = default;
  DeadlineMutex(const DeadlineMutex&) = delete;
  DeadlineMutex& operator=(const DeadlineMutex&) = delete;

  void lock() {
    std::unique_lock l(m_);
    cv_.wait(l, [this] { return !held_; });
    held_ = true;
  }
  bool try_lock() {
    std::lock_guard l(m_);
    if (held_) return false;
    held_ = true;
    return true;
  }
  template <class Clock, class Duration>
  bool try_lock_until(const std::chrono::time_point<Clock, Duration>& deadline) {
    std::unique_lock l(m_);
    if (!cv_.wait_until(l, deadline, [this] { return !held_; })) return false;
    held_ = true;
    return true;
  }
  template <class Rep, class Period>
  bool try_lock_for(const std::chrono::duration<Rep, Period>& d) {
    return try_lock_until(std::chrono::steady_clock::now() + d);
  }
  void unlock() {
    {
      std::lock_guard l(m_);
      held_ = false;
    }
    cv_.notify_one();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool held_ = false;
};

}  // namespace rdmakit::detail
