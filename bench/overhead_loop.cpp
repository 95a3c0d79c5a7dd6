// The library's overhead per operation, for callgrind: the same 8-byte RDMA WRITE, posted and
// completed one at a time, once through raw verbs and once through rdmakit, on the same QP and
// CQ. Each loop is an extern "C" function of its own so callgrind can count it alone
// (--collect-atstart=no --toggle-collect=rdmakit_overhead_*_loop). Between post and poll both
// loops sleep 200 us, so the count is of posting and completing, not of how often an empty CQ
// was polled while the (emulated) NIC worked; the empty polls left are reported.
//
//   rdmakit_overhead_loop raw|lib ITERATIONS     (inside the lab)
#include <infiniband/verbs.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "connection/impl.hpp"
#include "loopback.hpp"
#include "rdmakit/connection.hpp"

namespace {

void pause_200us() {
  timespec ts{0, 200'000};
  ::nanosleep(&ts, nullptr);
}

}  // namespace

extern "C" __attribute__((noinline)) unsigned long rdmakit_overhead_raw_loop(
    ibv_qp* qp, ibv_cq* cq, ibv_sge sge, std::uint64_t remote_addr, std::uint32_t rkey,
    unsigned inline_flag, unsigned long iters) {
  unsigned long empty = 0;
  for (unsigned long i = 0; i < iters; ++i) {
    ibv_send_wr wr{};
    wr.wr_id = i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED | inline_flag;
    wr.wr.rdma.remote_addr = remote_addr;
    wr.wr.rdma.rkey = rkey;
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qp, &wr, &bad) != 0) std::abort();
    pause_200us();
    ibv_wc wc;
    int n;
    while ((n = ibv_poll_cq(cq, 1, &wc)) == 0) ++empty;
    if (n < 0 || wc.status != IBV_WC_SUCCESS) std::abort();
  }
  return empty;
}

extern "C" __attribute__((noinline)) unsigned long rdmakit_overhead_lib_loop(
    rdmakit::Connection* conn, const rdmakit::LocalSlice* src, const rdmakit::RemoteRegion* dst,
    unsigned long iters) {
  unsigned long empty = 0;
  rdmakit::Completion c;
  for (unsigned long i = 0; i < iters; ++i) {
    if (!conn->post_write(*src, *dst, 0, i).ok()) std::abort();
    pause_200us();
    while (conn->poll({&c, 1}) == 0) ++empty;
    if (!c.ok()) std::abort();
  }
  return empty;
}

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[1]) != "raw" && std::string(argv[1]) != "lib")) {
    std::fprintf(stderr, "usage: %s raw|lib ITERATIONS\n", argv[0]);
    return 2;
  }
  const bool raw = std::string(argv[1]) == "raw";
  const unsigned long iters = std::strtoul(argv[2], nullptr, 10);
  using namespace std::chrono_literals;
  bench::Loopback loop(rdmakit::ConnectionConfig{});
  rdmakit::Connection& conn = loop.conn;
  const rdmakit::LocalSlice src = conn.memory(0).local().subslice(0, 8);
  const rdmakit::RemoteRegion dst = conn.remote_regions().at(0);
  unsigned long empty;
  if (raw) {
    auto& m = rdmakit::Connection::Impl::of(conn);
    const ibv_sge sge{reinterpret_cast<std::uint64_t>(src.addr()), 8, src.lkey()};
    // The library sends 8 bytes inline (they fit in max_inline); so does the raw loop.
    const unsigned inl = m.info.max_inline >= 8 ? IBV_SEND_INLINE : 0;
    empty = rdmakit_overhead_raw_loop(m.qps[0].get(), m.send_cq.get(), sge, dst.addr, dst.rkey, inl, iters);
  } else {
    empty = rdmakit_overhead_lib_loop(&conn, &src, &dst, iters);
  }
  std::printf("%s: %lu iterations, %lu empty polls\n", argv[1], iters, empty);
  return 0;
}
