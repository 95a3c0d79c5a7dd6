// SPDX-License-Identifier: Apache-2.0
// The raw verbs anchor of bench/compare-latency: one 8-byte RDMA WRITE or READ at a time, posted
// signaled with ibv_post_send and busy-polled to its completion with ibv_poll_cq, on a loopback
// connection's QP and CQ: the round trip a caller that posts and polls itself measures (what
// ib_write_lat cannot give: it times half a ping-pong of WRITEs). The p50 and p99 of the round
// trips after a tenth as warm-up, in microseconds, as one JSON line.
//
//   rdmakit_latency_loop write|read ROUND_TRIPS     (inside the lab)
// RDMAKIT_LOOP_PAUSE_US=N pauses N us between round trips (sparse traffic).
#include <infiniband/verbs.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "connection/impl.hpp"
#include "rdmakit/connection.hpp"

int main(int argc, char** argv) {
  const std::string op = argc == 3 ? argv[1] : "";
  if (op != "write" && op != "read") {
    std::fprintf(stderr, "usage: %s write|read ROUND_TRIPS\n", argv[0]);
    return 2;
  }
  const long n = std::strtol(argv[2], nullptr, 10);
  const rdmakit::ConnectionConfig cfg{};
  rdmakit::Listener listener("127.0.0.1:0", cfg, [](rdmakit::Connection& c) {
    c.advertise(c.allocate_memory(4096, rdmakit::Access::remote_read | rdmakit::Access::remote_write));
  });
  rdmakit::Connection conn = rdmakit::Connection::connect(
      "127.0.0.1:" + std::to_string(listener.port()), cfg,
      [](rdmakit::Connection& c) { c.allocate_memory(4096, rdmakit::Access::local_write); });  // a READ lands here
  const auto server = listener.accept(std::chrono::seconds{10});
  auto& m = rdmakit::Connection::Impl::of(conn);
  const rdmakit::LocalSlice src = conn.memory(0).local().subslice(0, 8);
  const rdmakit::RemoteRegion dst = conn.remote_regions().at(0);
  ibv_sge sge{reinterpret_cast<std::uint64_t>(src.addr()), 8, src.lkey()};
  ibv_send_wr wr{};
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op == "write" ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
  // 8 bytes inline for a WRITE where the QP takes them (as ib_write_lat and the library send them).
  const bool inl = op == "write" && m.info.max_inline >= 8;
  wr.send_flags = IBV_SEND_SIGNALED | (inl ? static_cast<unsigned>(IBV_SEND_INLINE) : 0u);
  wr.wr.rdma.remote_addr = dst.addr;
  wr.wr.rdma.rkey = dst.rkey;
  ibv_qp* qp = m.qps[0].get();
  ibv_cq* cq = m.send_cq.get();
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(n));
  // RDMAKIT_LOOP_PAUSE_US: a pause between round trips (sparse traffic), as engine_loop's.
  const long pause_us = std::getenv("RDMAKIT_LOOP_PAUSE_US") != nullptr ? std::atol(std::getenv("RDMAKIT_LOOP_PAUSE_US")) : 0;
  for (long i = 0; i < n + n / 10; ++i) {
    if (pause_us > 0) std::this_thread::sleep_for(std::chrono::microseconds{pause_us});
    ibv_send_wr* bad = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    if (ibv_post_send(qp, &wr, &bad) != 0) {
      std::perror("ibv_post_send");
      return 1;
    }
    ibv_wc wc{};
    int got = 0;
    while ((got = ibv_poll_cq(cq, 1, &wc)) == 0) {
    }
    if (got < 0 || wc.status != IBV_WC_SUCCESS) {
      std::fprintf(stderr, "completion: %s\n", got < 0 ? "ibv_poll_cq failed" : ibv_wc_status_str(wc.status));
      return 1;
    }
    if (i >= n / 10) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  std::printf("{\"p50_us\": %.2f, \"p99_us\": %.2f, \"round_trips\": %zu}\n", us[us.size() / 2],
              us[std::min(us.size() - 1, us.size() * 99 / 100)], us.size());
  return 0;
}
