// SPDX-License-Identifier: Apache-2.0
// What a lease costs (docs/performance.md, "Leases"): two engines in one process over the
// transport given (rdma in the lab, or tcp/shm), the target granting leases of N ranges to the
// holder (every other block, so each range is a window of its own), timed from grant() to the holder knowing the lease (its windows bound and announced),
// from renew() to the holder seeing the new end, and from end_lease() to the target being told
// (its windows gone). Medians and p99 of ROUNDS rounds, in microseconds.
//
//   rdmakit_lease_cost ROUNDS [rdma|tcp|shm]
//
// Under callgrind, --toggle-collect='*Worker::on_renew*' --toggle-collect='*Worker::renew*'
// --toggle-collect='*Worker::on_renewed*' counts a renewal's instructions on both workers
// (bench/callgrind-lease).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "rdmakit/engine.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

void report(const char* what, std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const double p50 = v[v.size() / 2];
  const double p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  std::printf("%-34s p50 %9.1f us   p99 %9.1f us   (%zu)\n", what, p50, p99, v.size());
}

rdmakit::EngineConfig config(const std::string& name, const std::string& transport) {
  rdmakit::EngineConfig c;
  c.name = name;
  c.listen = "127.0.0.1:0";
  c.link.log = [](std::string_view) {};
  if (!transport.empty() && transport != "rdma") c.transports = {rdmakit::parse_transport(transport)};
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s ROUNDS [rdma|tcp|shm]\n", argv[0]);
    return 2;
  }
  const int rounds = std::atoi(argv[1]);
  const std::string transport = argc > 2 ? argv[2] : "";
  rdmakit::Engine target(config("target", transport));
  rdmakit::Engine holder(config("holder", transport));
  constexpr std::uint64_t kBlock = 16 * 1024;
  const rdmakit::Buffer kv = target.allocate_memory(512 * kBlock);
  target.expose_leased("kv", kv, rdmakit::Access::remote_read);
  holder.add_peer("target", "127.0.0.1:" + std::to_string(target.port()));
  std::string why;
  if (!holder.connect("target", 10s, &why)) {
    std::fprintf(stderr, "connect: %s\n", why.c_str());
    return 1;
  }
  auto ended = [&](std::uint64_t id) {
    for (;;) {
      if (auto e = target.next_lease_end(); e && e->lease == id) return;
      std::this_thread::yield();
    }
  };
  for (const std::size_t n : {std::size_t{1}, std::size_t{16}, std::size_t{256}}) {
    std::vector<rdmakit::LeaseRange> ranges;
    // Every other block: ranges that are not neighbours stay one window each.
    for (std::size_t i = 0; i < n; ++i) ranges.push_back({"kv", 2 * i * kBlock, kBlock});
    std::vector<double> grant, end;
    for (int r = 0; r < rounds; ++r) {
      const auto t0 = Clock::now();
      const std::uint64_t id = target.grant("holder", ranges, rdmakit::Access::remote_read, 60s);
      if (!holder.lease("target", id, 10s)) {
        std::fprintf(stderr, "lease %llu did not arrive\n", static_cast<unsigned long long>(id));
        return 1;
      }
      grant.push_back(us(Clock::now() - t0));
      const auto t1 = Clock::now();
      target.end_lease(id);
      ended(id);
      end.push_back(us(Clock::now() - t1));
    }
    report(("grant, " + std::to_string(n) + " ranges: until known").c_str(), grant);
    report(("end_lease, " + std::to_string(n) + " ranges: until told").c_str(), end);
  }
  const std::uint64_t id = target.grant("holder", std::vector<rdmakit::LeaseRange>{{"kv", 0, kBlock}},
                                        rdmakit::Access::remote_read, 60s);
  if (!holder.lease("target", id, 10s)) return 1;
  std::vector<double> renew;
  for (int r = 0; r < rounds; ++r) {
    const auto before = holder.lease("target", id)->expires;
    const auto t0 = Clock::now();
    holder.renew("target", id, 60s);
    while (holder.lease("target", id)->expires == before) std::this_thread::yield();
    renew.push_back(us(Clock::now() - t0));
  }
  report("renew: until the holder sees it", renew);
  std::printf("renewals granted: %llu\n", static_cast<unsigned long long>(target.counters().lease_renewals));
  return 0;
}
