// SPDX-License-Identifier: Apache-2.0
// The engine's queues (common/fifo.hpp): order kept across growth, pushes at the front (a
// transfer put back when its queue was full) before and after wrapping.
#include <gtest/gtest.h>

#include <deque>
#include <random>

#include "common/fifo.hpp"

namespace {

using rdmakit::detail::Fifo;

TEST(Fifo, KeepsOrderAcrossGrowth) {
  Fifo<int> f;
  EXPECT_TRUE(f.empty());
  for (int i = 0; i < 100; ++i) f.push_back(i);
  EXPECT_EQ(f.size(), 100u);
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(f.front(), i);
    f.pop_front();
  }
  EXPECT_TRUE(f.empty());
}

TEST(Fifo, PushFrontBeforeTheFirstElementAndAfterWrapping) {
  Fifo<int> f;
  f.push_front(1);  // the head goes below zero
  f.push_front(0);
  for (int i = 2; i < 40; ++i) f.push_back(i);  // grows with the head wrapped
  for (int i = 0; i < 40; ++i) {
    ASSERT_EQ(f.front(), i);
    f.pop_front();
  }
}

// Against std::deque, random pushes at both ends and pops.
TEST(Fifo, MatchesADequeUnderRandomUse) {
  Fifo<unsigned> f;
  std::deque<unsigned> d;
  std::mt19937 rng(7);
  for (unsigned i = 0; i < 20000; ++i) {
    const unsigned op = rng() % 4;
    if (op == 0 && !d.empty()) {
      ASSERT_EQ(f.front(), d.front());
      f.pop_front();
      d.pop_front();
    } else if (op == 1) {
      f.push_front(i);
      d.push_front(i);
    } else {
      f.push_back(i);
      d.push_back(i);
    }
    ASSERT_EQ(f.size(), d.size());
  }
  while (!d.empty()) {
    ASSERT_EQ(f.front(), d.front());
    f.pop_front();
    d.pop_front();
  }
}

}  // namespace
