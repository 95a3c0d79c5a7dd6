// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: the order a Connection releases its verbs objects in. This binary
// interposes ibv_destroy_qp and ibv_dereg_mr (the library is linked statically into it, so its
// calls resolve here; these forward to libibverbs) and records each call: a QP must be destroyed
// before the memory it could reach is deregistered (and, after that, freed).
#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "rdmakit/connection.hpp"

namespace {

std::mutex calls_mu;
std::vector<std::string> calls;  // "qp" or "mr", in call order

void record(const char* what) {
  std::lock_guard lock(calls_mu);
  calls.emplace_back(what);
}

template <typename F>
F real(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

}  // namespace

extern "C" int ibv_destroy_qp(ibv_qp* qp) {
  record("qp");
  static const auto next = real<int (*)(ibv_qp*)>("ibv_destroy_qp");
  return next(qp);
}

extern "C" int ibv_dereg_mr(ibv_mr* mr) {
  record("mr");
  static const auto next = real<int (*)(ibv_mr*)>("ibv_dereg_mr");
  return next(mr);
}

namespace {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Connection;
using rdmakit::ConnectionConfig;
using rdmakit::Listener;

ConnectionConfig quiet(std::uint32_t qps = 1) {
  ConnectionConfig cfg;
  cfg.log = [](std::string_view) {};
  cfg.qps = qps;
  return cfg;
}

Connection::Setup two_regions() {
  return [](Connection& c) {
    c.advertise(c.allocate_memory(64 * 1024, Access::local_write | Access::remote_write));
    (void)c.allocate_memory(4096, Access::local_write);
  };
}

// What one connection's teardown recorded: every QP destroyed before any MR deregistered.
void expect_qps_first(const std::vector<std::string>& seen, std::size_t qps) {
  ASSERT_EQ(std::count(seen.begin(), seen.end(), "qp"), static_cast<long>(qps));
  ASSERT_EQ(std::count(seen.begin(), seen.end(), "mr"), 2);
  const auto last_qp = std::find(seen.rbegin(), seen.rend(), "qp").base();
  const auto first_mr = std::find(seen.begin(), seen.end(), "mr");
  EXPECT_LE(last_qp - seen.begin(), first_mr - seen.begin())
      << "an MR was deregistered while a QP that could reach it still existed";
}

std::vector<std::string> teardown_of(const std::function<void(Connection&)>& end, std::uint32_t qps) {
  Listener listener("127.0.0.1:0", quiet(), two_regions());
  std::optional<Connection> c(Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(qps),
                                                  two_regions()));
  auto s = listener.accept(5s);
  EXPECT_TRUE(s.has_value());
  {
    std::lock_guard lock(calls_mu);
    calls.clear();
  }
  end(*c);
  c.reset();
  std::lock_guard lock(calls_mu);
  return calls;
}

TEST(ReleaseOrder, DestructionDestroysQpsBeforeDeregistering) {
  for (std::uint32_t qps : {1u, 3u}) {
    expect_qps_first(teardown_of([](Connection&) {}, qps), qps);
  }
}

TEST(ReleaseOrder, CloseDestroysQpsBeforeDeregistering) {
  for (std::uint32_t qps : {1u, 3u}) {
    expect_qps_first(teardown_of([](Connection& c) { c.close(); }, qps), qps);
  }
}

TEST(ReleaseOrder, CloseWithWorkInFlightToo) {
  expect_qps_first(teardown_of(
                       [](Connection& c) {
                         ASSERT_TRUE(c.post_write(c.memory(0).local(), c.remote_regions()[0], 0, 1).ok());
                         c.close();
                       },
                       2),
                   2);
}

}  // namespace
