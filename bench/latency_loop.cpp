// SPDX-License-Identifier: Apache-2.0
// The raw verbs anchor of bench/compare-latency: one 8-byte RDMA WRITE or READ at a time, posted
// signaled with ibv_post_send and busy-polled to its completion with ibv_poll_cq, on a loopback
// connection's QP and CQ: the round trip a caller that posts and polls itself measures (what
// ib_write_lat cannot give: it times half a ping-pong of WRITEs). The p50 and p99 of the round
// trips after a tenth as warm-up, in microseconds, as one JSON line.
//
//   rdmakit_latency_loop write|read ROUND_TRIPS     (inside the lab)
// RDMAKIT_LOOP_PAUSE_US=N pauses N us between round trips (sparse traffic).
// RDMAKIT_LOOP_SGE set: a WRITE's 8 bytes by their SGE, not inline (what the kernel's side of
// each costs on rxe).
// RDMAKIT_LOOP_CALLS=N makes N calls of an empty function (through a pointer, as a call into a
// shared library goes) between round trips: what a path of many small calls costs on the lab's
// emulator, whose every return is a lookup (docs/performance.md).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "loopback.hpp"

namespace {
// What RDMAKIT_LOOP_CALLS calls: nothing, out of line.
__attribute__((noinline)) void nothing(int) { __asm__ volatile(""); }
void (*volatile call_me)(int) = nothing;
}  // namespace

int main(int argc, char** argv) {
  const std::string op = argc == 3 ? argv[1] : "";
  if (op != "write" && op != "read") {
    std::fprintf(stderr, "usage: %s write|read ROUND_TRIPS\n", argv[0]);
    return 2;
  }
  const long n = std::strtol(argv[2], nullptr, 10);
  bench::RawRoundTrip rt(op == "read", std::getenv("RDMAKIT_LOOP_SGE") != nullptr);
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(n));
  std::vector<double> called;  // how long the calls took (RDMAKIT_LOOP_CALLS)
  // RDMAKIT_LOOP_PAUSE_US: a pause between round trips (sparse traffic), as engine_loop's.
  const long pause_us = std::getenv("RDMAKIT_LOOP_PAUSE_US") != nullptr ? std::atol(std::getenv("RDMAKIT_LOOP_PAUSE_US")) : 0;
  const long calls = std::getenv("RDMAKIT_LOOP_CALLS") != nullptr ? std::atol(std::getenv("RDMAKIT_LOOP_CALLS")) : 0;
  for (long i = 0; i < n + n / 10; ++i) {
    if (pause_us > 0) std::this_thread::sleep_for(std::chrono::microseconds{pause_us});
    const auto c0 = std::chrono::steady_clock::now();
    for (long k = 0; k < calls; ++k) call_me(static_cast<int>(k));
    const auto c1 = std::chrono::steady_clock::now();
    if (calls > 0 && i >= n / 10) called.push_back(std::chrono::duration<double, std::micro>(c1 - c0).count());
    const auto t0 = std::chrono::steady_clock::now();
    if (const char* failed = rt.once(); failed != nullptr) {
      std::fprintf(stderr, "%s\n", failed);
      return 1;
    }
    if (i >= n / 10) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  std::sort(called.begin(), called.end());
  std::printf("{\"p50_us\": %.2f, \"p99_us\": %.2f, \"round_trips\": %zu, \"calls_p50_us\": %.2f}\n", us[us.size() / 2],
              us[std::min(us.size() - 1, us.size() * 99 / 100)], us.size(), called.empty() ? 0.0 : called[called.size() / 2]);
  return 0;
}
