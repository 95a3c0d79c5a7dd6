// SPDX-License-Identifier: Apache-2.0
// 1,000 engines in one store, simulated by one process publishing their records under one lease
// (each as an engine's would be: two rails, four segments): all are listed and decoded, and a
// lookup by name is timed. Prints what an engine's listing costs (time, bytes) and the lookup
// latency's p50 and p99, the figures docs/engine.md ("Metadata: scale") extrapolates from.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "metadata/directory.hpp"
#include "servers.hpp"

namespace rdmakit::detail::metadata {
namespace {

using namespace std::chrono_literals;
using test::StoreServer;
using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

EngineRecord record(int i) {
  const std::string a = fmt::format("10.{}.{}.{}", i >> 16 & 255, i >> 8 & 255, i & 255);
  EngineRecord r;
  r.name = fmt::format("engine-{:04}", i);
  r.epoch = std::uint64_t{0x9e3779b97f4a7c15} * (static_cast<std::uint64_t>(i) + 1);
  r.endpoints = {a + ":7600"};
  for (int k = 0; k < 2; ++k) {
    r.rails.push_back({fmt::format("mlx5_{}", k), 1, "ethernet", "::ffff:" + a, fmt::format("10.{}.0.0/16", k)});
  }
  for (const char* s : {"kv", "weights", "scratch", "log"}) r.segments.push_back({s, 1ull << 30, "cuda"});
  return r;
}

class Scale : public ::testing::TestWithParam<StoreServer::Kind> {
 protected:
  StoreServer server{GetParam()};
};

TEST_P(Scale, AThousandEnginesArePublishedListedAndLookedUp) {
  constexpr int n = 1000;
  auto store = open_store(parse_store_uri(server.uri()));
  const LeaseId lease = store->grant(60s, deadline_in(5s));
  std::size_t bytes = 0;
  auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    const std::string v = encode(record(i));
    bytes += v.size();
    store->put(engine_key("scale", record(i).name), v, lease, deadline_in(5s));
  }
  const double put_us = us_since(t0) / n;

  t0 = Clock::now();
  ClusterListing l = read_cluster(*store, "scale", deadline_in(20s), "engine-0000");
  const double list_ms = us_since(t0) / 1000;
  EXPECT_EQ(l.engines.size(), static_cast<std::size_t>(n - 1));
  EXPECT_EQ(l.skipped, "");
  EXPECT_EQ(l.engines.at("engine-0999"), record(999));

  // Lookups of names not cached: what an engine pays to find a peer it has not seen listed.
  std::mt19937 rng(7);
  std::vector<double> lat;
  for (int k = 0; k < n; ++k) {
    const std::string name = record(static_cast<int>(rng() % n)).name;
    const auto s = Clock::now();
    const auto v = store->get(engine_key("scale", name), deadline_in(5s));
    ASSERT_TRUE(v.has_value());
    const EngineRecord r = decode(*v, "scale", name);
    lat.push_back(us_since(s));
    ASSERT_EQ(r.name, name);
  }
  std::sort(lat.begin(), lat.end());
  t0 = Clock::now();
  store->refresh(lease, deadline_in(5s));
  const double refresh_us = us_since(t0);
  std::printf("%s, %d engines (records of %zu bytes on average): put %.0f us each; one listing %.1f ms, "
              "%zu bytes; lookup p50 %.0f us, p99 %.0f us; one lease refresh %.0f us\n",
              GetParam() == StoreServer::Kind::redis ? "redis" : "etcd", n, bytes / n, put_us, list_ms, bytes,
              lat[lat.size() / 2], lat[lat.size() * 99 / 100], refresh_us);
  store->revoke(lease, deadline_in(5s));
  EXPECT_TRUE(store->list(engines_prefix("scale"), deadline_in(10s)).empty()) << "revoking the lease removes its entries";
}

INSTANTIATE_TEST_SUITE_P(Stores, Scale, ::testing::Values(StoreServer::Kind::redis, StoreServer::Kind::etcd),
                         [](const auto& p) { return p.param == StoreServer::Kind::redis ? "redis" : "etcd"; });

}  // namespace
}  // namespace rdmakit::detail::metadata
