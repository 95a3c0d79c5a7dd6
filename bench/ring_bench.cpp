// SPDX-License-Identifier: Apache-2.0
// The data path's own bookkeeping, without a device: recording a posted request in the WR ring
// and retiring it from a completion (one by one, and 32 at a time as selective signaling does).
// What ibv_post_send and ibv_poll_cq cost is the provider's; bench/callgrind-overhead measures
// the whole operation in the lab.
#include <benchmark/benchmark.h>

#include "datapath/ring.hpp"

namespace {

void BM_RingPushRetireEach(benchmark::State& state) {
  rdmakit::detail::WrRing ring;
  ring.init(128);
  std::uint64_t wr_id = 0;
  for (auto _ : state) {
    const std::uint64_t seq = ring.next_seq();
    ring.push({wr_id++, rdmakit::Opcode::write, rdmakit::detail::WrRing::user, false});
    benchmark::DoNotOptimize(ring.retire(seq));
  }
}
BENCHMARK(BM_RingPushRetireEach);

void BM_RingSelectiveSignaling32(benchmark::State& state) {
  rdmakit::detail::WrRing ring;
  ring.init(128);
  std::uint64_t wr_id = 0;
  for (auto _ : state) {
    for (int i = 0; i < 32; ++i) ring.push({wr_id++, rdmakit::Opcode::write,
                 i == 31 ? rdmakit::detail::WrRing::user : rdmakit::detail::WrRing::silent, false});
    benchmark::DoNotOptimize(ring.retire(ring.next_seq() - 1));
  }
  state.SetItemsProcessed(state.iterations() * 32);
}
BENCHMARK(BM_RingSelectiveSignaling32);

}  // namespace
