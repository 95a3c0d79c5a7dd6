// SPDX-License-Identifier: Apache-2.0
// Wall time per batch through the C++ engine: submit a batch of B 8-byte WRITEs to a peer engine
// in the same process and wait for it, ROUNDS times (after a warm-up); with INFLIGHT, submit that
// many batches, then wait for them all, per round. The baseline that bench/python-overhead sets
// the Python binding's submit + wait and submit + await against.
//
//   rdmakit_engine_batch_time ROUNDS BATCH [INFLIGHT]     prints "us_per_batch <float>"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "rdmakit/engine.hpp"

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: %s ROUNDS BATCH [INFLIGHT]\n", argv[0]);
    return 2;
  }
  const long rounds = std::atol(argv[1]);
  const std::size_t batch = std::strtoul(argv[2], nullptr, 10);
  const std::size_t inflight = argc == 4 ? std::strtoul(argv[3], nullptr, 10) : 1;
  using namespace rdmakit;
  Engine target({.name = "target", .listen = ":0"});
  Buffer pool = target.allocate_memory(1 << 20);
  target.expose("pool", pool, Access::remote_write);
  Engine init({.name = "init", .listen = ""});
  init.add_peer("target", "127.0.0.1:" + std::to_string(target.port()));
  Buffer src = init.allocate_memory(1 << 20);
  RemoteSegment seg = init.segment("target", "pool");
  std::vector<Transfer> t(batch);
  for (std::size_t i = 0; i < batch; ++i) {
    t[i] = {.op = TransferOp::write, .local = src, .local_offset = i * 8, .length = 8,
            .remote = seg, .remote_offset = i * 8};
  }
  std::vector<Batch> flying(inflight);
  auto one = [&] {
    for (Batch& b : flying) b = init.submit(t);
    for (Batch& b : flying) {
      if (!b.wait(std::chrono::seconds{10}) || b.failed() != 0) {
        std::fprintf(stderr, "batch failed: %s\n", b.describe_failures().c_str());
        std::exit(1);
      }
    }
  };
  for (std::size_t i = 0; i < 200 / inflight + 1; ++i) one();
  auto t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < rounds; ++r) one();
  std::chrono::duration<double, std::micro> us = std::chrono::steady_clock::now() - t0;
  std::printf("us_per_batch %.2f\n", us.count() / static_cast<double>(rounds * static_cast<long>(inflight)));
  return 0;
}
