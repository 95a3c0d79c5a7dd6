// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab and on the host (tcp): an idle engine's CPU use. A binary of its own: the
// plain build measures it (a sanitizer's threads and checks are not the engine's) and builds
// nothing else of the engine's tests, which the sanitizer builds run.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "engine_helpers.hpp"
#include "rdmakit/engine.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Engine;

using lab::at;
using lab::config;
using lab::Target;

}  // namespace

// Worker threads sleep while nothing moves: two linked, idle engines (four workers, connector
// and listener threads) use under 1% of a core over 10 s.
TEST(Engine, AnIdleEngineUsesNoCpu) {
  Target b("b", 4096);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  std::string why;
  ASSERT_TRUE(a.connect("b", 10s, &why)) << why;
  std::this_thread::sleep_for(200ms);
  auto cpu = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  };
  const double before = cpu();
  std::this_thread::sleep_for(10s);
  const double share = (cpu() - before) / 10.0;
  std::printf("idle: %.3f%% of a core\n", share * 100);
  EXPECT_LT(share, 0.01);
  EXPECT_EQ(a.counters().links, 1u);  // still linked: idle, not torn down
}
