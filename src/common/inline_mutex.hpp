// SPDX-License-Identifier: Apache-2.0
#pragma once
// A mutex whose uncontended try_lock() and unlock() are one atomic instruction each, inline.

#include <atomic>
#include <cstdint>

namespace rdmakit::detail {

/// std::mutex's interface (lock, try_lock, unlock: std::lock_guard and std::unique_lock work
/// with it) whose uncontended paths are inline atomics. std::mutex's try_lock and unlock are
/// calls into libc (pthread_mutex_trylock; pthread_mutex_unlock and the call inside it), and on
/// the lab's emulator each call and return costs more than the atomic operation it wraps, and
/// slows the system call that follows (docs/performance.md): a path taken once per transfer
/// (the worker's run lock) pays for three of them. Contended, lock() sleeps in the kernel
/// (std::atomic's wait: a futex on Linux) and unlock() wakes one sleeper. Acquire on taking
/// it, release on letting go, as any mutex. Not recursive: a holder's try_lock() is false, and
/// its lock() never returns (undefined for std::mutex too).
class InlineMutex {
 public:
  InlineMutex() = default;
  InlineMutex(const InlineMutex&) = delete;
  InlineMutex& operator=(const InlineMutex&) = delete;

  [[nodiscard]] bool try_lock() noexcept {
    std::uint32_t expected = kFree;
    return state_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void lock() noexcept {
    if (!try_lock()) lock_contended();
  }
  void unlock() noexcept {
    // kContended: someone may sleep on it (or did, and took it so marked): wake one.
    if (state_.exchange(kFree, std::memory_order_release) == kContended) state_.notify_one();
  }

 private:
  static constexpr std::uint32_t kFree = 0, kHeld = 1, kContended = 2;
  [[gnu::noinline]] void lock_contended() noexcept {
    // Marked contended before each sleep, so the holder's unlock() wakes a sleeper. A thread that
    // takes it here leaves it marked: its unlock() may wake a thread that finds it taken again
    // and sleeps again, never a lost wake-up (U. Drepper, "Futexes Are Tricky", mutex 2).
    while (state_.exchange(kContended, std::memory_order_acquire) != kFree) {
      state_.wait(kContended, std::memory_order_relaxed);
    }
  }
  std::atomic<std::uint32_t> state_{kFree};
};

}  // namespace rdmakit::detail
