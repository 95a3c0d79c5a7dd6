// SPDX-License-Identifier: Apache-2.0
// The bootstrap codec's cost: one HELLO per connection each way, so it bounds how fast a listener
// can accept; the decoder also runs on every hostile byte a peer sends.
#include <benchmark/benchmark.h>

#include "rdmakit/wire.hpp"

namespace {

rdmakit::wire::EndpointInfo sample(std::size_t regions) {
  rdmakit::wire::EndpointInfo i;
  i.qpn = 0x11;
  i.psn = 0x123456;
  i.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, 1};
  i.gid_index = 1;
  i.mtu = 1024;
  for (std::size_t r = 0; r < regions; ++r) {
    i.regions.push_back({0x7f0000000000 + r * 0x10000, 0x10000, static_cast<std::uint32_t>(r),
                         rdmakit::Access::remote_read});
  }
  return i;
}

void BM_EncodeHello(benchmark::State& state) {
  const auto info = sample(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(rdmakit::wire::encode_hello(info));
}
BENCHMARK(BM_EncodeHello)->Arg(1)->Arg(16)->Arg(1024);

void BM_DecodeHello(benchmark::State& state) {
  const auto msg = rdmakit::wire::encode_hello(sample(static_cast<std::size_t>(state.range(0))));
  const std::span<const std::uint8_t> all(msg);
  for (auto _ : state) {
    benchmark::DoNotOptimize(rdmakit::wire::decode_header(all));
    benchmark::DoNotOptimize(rdmakit::wire::decode_hello(all.subspan(rdmakit::wire::kHeaderSize)));
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(msg.size()));
}
BENCHMARK(BM_DecodeHello)->Arg(1)->Arg(16)->Arg(1024);

}  // namespace
