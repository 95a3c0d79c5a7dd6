// SPDX-License-Identifier: Apache-2.0
// The worker's run lock (common/inline_mutex.hpp) and the thread identity beside it
// (common/thread_self.hpp): exclusion under contention, a contended lock() that sleeps until the
// holder lets go, try_lock() refused while held (by anyone, the holder too).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "common/inline_mutex.hpp"
#include "common/thread_self.hpp"

namespace {

using rdmakit::detail::InlineMutex;
using rdmakit::detail::thread_self;
using rdmakit::detail::ThreadSelf;

TEST(InlineMutex, TryLockIsRefusedWhileHeld) {
  InlineMutex m;
  ASSERT_TRUE(m.try_lock());
  EXPECT_FALSE(m.try_lock());  // the holder's own try too
  bool other = true;
  std::thread([&] { other = m.try_lock(); }).join();
  EXPECT_FALSE(other);
  m.unlock();
  EXPECT_TRUE(m.try_lock());
  m.unlock();
}

TEST(InlineMutex, ExcludesUnderContention) {
  // Four threads add to a plain counter under the lock, half by lock(), half by a try_lock()
  // loop (as the worker's thread and its submitters take it): a lost update shows in the sum.
  InlineMutex m;
  std::uint64_t counter = 0;
  constexpr int kThreads = 4, kRounds = 20000;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        if (t % 2 == 0) {
          std::lock_guard lock(m);
          ++counter;
        } else {
          std::unique_lock lock(m, std::try_to_lock);
          while (!lock.owns_lock()) lock.try_lock();
          ++counter;
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(counter, std::uint64_t{kThreads} * kRounds);
}

TEST(InlineMutex, AContendedLockSleepsUntilTheHolderLetsGo) {
  InlineMutex m;
  m.lock();
  std::atomic<bool> taken{false};
  std::thread t([&] {
    m.lock();  // held: sleeps (marks it contended, so the unlock below wakes it)
    taken.store(true);
    m.unlock();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds{50});
  EXPECT_FALSE(taken.load());
  m.unlock();
  t.join();
  EXPECT_TRUE(taken.load());
  EXPECT_TRUE(m.try_lock());  // free again, whatever mark the sleeper left
  m.unlock();
}

TEST(ThreadSelf, SameWithinAThreadDifferentAcrossLiveThreads) {
  const ThreadSelf me = thread_self();
  EXPECT_NE(me, nullptr);
  EXPECT_EQ(thread_self(), me);
  std::atomic<ThreadSelf> other{nullptr};
  std::atomic<bool> release{false};
  std::thread t([&] {
    other.store(thread_self());
    while (!release.load()) std::this_thread::yield();
  });
  while (other.load() == nullptr) std::this_thread::yield();
  EXPECT_NE(other.load(), me);
  release.store(true);
  t.join();
}

}  // namespace
