// SPDX-License-Identifier: Apache-2.0
// The library's overhead per operation, for callgrind: the same 8-byte RDMA WRITE, posted and
// completed one at a time, once through raw verbs and once through rdmakit, on the same QP and
// CQ. Each loop is an extern "C" function of its own so callgrind can count it alone
// (--collect-atstart=no --toggle-collect=rdmakit_overhead_*_loop). Between post and poll both
// loops sleep 200 us, so the count is of posting and completing, not of how often an empty CQ
// was polled while the (emulated) NIC worked; the empty polls left are reported.
//
//   rdmakit_overhead_loop raw|rawsge|rawex|floor|lib|prep ITERATIONS     (inside the lab)
// raw: the classic calls, 8 bytes inline as the library sends them; rawsge: the same by SGE;
// rawex: the extended interfaces, by SGE (see below); floor: rawex plus the least bookkeeping a
// library that tracks its requests does, written into the loop (below); lib: post_write + poll;
// prep: the same write prepared once (Connection::prepare), posted with post(prepared, wr_id) +
// poll.
#include <infiniband/verbs.h>
#include <time.h>

#include <cerrno>
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

// An RC QP created for the extended interfaces, with an extended CQ, connected to itself on the
// port, path and GID of `like` (the loopback connection's QP, whose peer is this host): it writes
// into the connection's own memory (same protection domain).
struct ExtendedQp {
  ibv_cq_ex* cq = nullptr;
  ibv_qp* qp = nullptr;
};

ExtendedQp extended_qp_like(ibv_qp* like) {
  ibv_qp_attr a{};
  ibv_qp_init_attr ia{};
  if (ibv_query_qp(like, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_PORT, &ia) != 0) std::abort();
  ExtendedQp x;
  ibv_cq_init_attr_ex ca{};
  ca.cqe = 16;
  x.cq = ibv_create_cq_ex(like->context, &ca);
  if (x.cq == nullptr) {
    std::perror("ibv_create_cq_ex");
    std::exit(1);
  }
  ibv_qp_init_attr_ex qa{};
  qa.send_cq = qa.recv_cq = ibv_cq_ex_to_cq(x.cq);
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = 16;
  qa.cap.max_recv_wr = 1;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.cap.max_inline_data = 64;
  qa.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  qa.pd = like->pd;
  qa.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE;
  x.qp = ibv_create_qp_ex(like->context, &qa);
  if (x.qp == nullptr) {
    std::perror("ibv_create_qp_ex");
    std::exit(1);
  }
  ibv_qp_attr m{};
  m.qp_state = IBV_QPS_INIT;
  m.port_num = a.port_num;
  m.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
  if (ibv_modify_qp(x.qp, &m, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) std::abort();
  m = {};
  m.qp_state = IBV_QPS_RTR;
  m.path_mtu = a.path_mtu;
  m.dest_qp_num = x.qp->qp_num;
  m.max_dest_rd_atomic = 1;
  m.min_rnr_timer = 12;
  m.ah_attr = a.ah_attr;
  if (ibv_modify_qp(x.qp, &m, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
    std::abort();
  }
  m = {};
  m.qp_state = IBV_QPS_RTS;
  m.timeout = 14;
  m.retry_cnt = 7;
  m.rnr_retry = 7;
  m.max_rd_atomic = 1;
  if (ibv_modify_qp(x.qp, &m, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                  IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
    std::abort();
  }
  return x;
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

// The same loop through rdma-core's extended interfaces (ibv_qp_ex's ibv_wr_*, ibv_cq_ex's
// start/end poll), on a QP and CQ of its own created for them: the raw figure that a data path
// built on them would be compared with.
extern "C" __attribute__((noinline)) unsigned long rdmakit_overhead_rawex_loop(
    ibv_qp_ex* qx, ibv_cq_ex* cq, ibv_sge sge, std::uint64_t remote_addr, std::uint32_t rkey,
    unsigned inline_flag, unsigned long iters) {
  unsigned long empty = 0;
  for (unsigned long i = 0; i < iters; ++i) {
    ibv_wr_start(qx);
    qx->wr_id = i;
    qx->wr_flags = IBV_SEND_SIGNALED;  // inline is said by ibv_wr_set_inline_data
    ibv_wr_rdma_write(qx, rkey, remote_addr);
    if (inline_flag != 0) {
      ibv_wr_set_inline_data(qx, reinterpret_cast<void*>(sge.addr), sge.length);
    } else {
      ibv_wr_set_sge(qx, sge.lkey, sge.addr, sge.length);
    }
    if (const int rc = ibv_wr_complete(qx); rc != 0) {
      std::fprintf(stderr, "ibv_wr_complete: %s\n", std::strerror(rc));
      std::abort();
    }
    pause_200us();
    ibv_poll_cq_attr attr{};
    int rc;
    while ((rc = ibv_start_poll(cq, &attr)) == ENOENT) ++empty;
    if (rc != 0) {
      std::fprintf(stderr, "ibv_start_poll: %d (%s)\n", rc, std::strerror(rc));
      std::abort();
    }
    const ibv_wc_status status = cq->status;
    ibv_end_poll(cq);
    if (status != IBV_WC_SUCCESS) {
      std::fprintf(stderr, "WRITE %lu: %s\n", i, ibv_wc_status_str(status));
      std::abort();
    }
  }
  return empty;
}

// The rawex loop plus what any data path that keeps track of its requests does at the least,
// with no call between the caller and the provider and no test but the queue's room and the
// completion's own (tag, sequence, status): the request's entry in a ring (the caller's wr_id and
// opcode), its verbs wr_id made of a tag and the entry's sequence number; on the completion, its
// entry found from the wr_id and retired, and a completion of the caller's filled (wr_id and
// opcode from the ring, the status from the CQ, the rest zero as for a send that succeeded). What a library's prepared post and one-completion poll cannot go below (the floor
// against which issue 34 asks for 1.15x of rawex).
namespace {
struct FloorSlot {
  std::uint64_t wr_id;
  std::uint8_t op;
  std::uint8_t kind;
};
struct FloorCompletion {
  std::uint64_t wr_id;
  std::uint32_t op;
  std::uint32_t status;
  std::uint32_t vendor_err;
  std::uint32_t byte_len;
  std::uint32_t imm;
  bool has_imm;
};
constexpr std::uint64_t kFloorTag = std::uint64_t{1} << 48, kFloorSeq = kFloorTag - 1;
}  // namespace

extern "C" __attribute__((noinline)) unsigned long rdmakit_overhead_floor_loop(
    ibv_qp_ex* qx, ibv_cq_ex* cq, ibv_sge sge, std::uint64_t remote_addr, std::uint32_t rkey, unsigned long iters,
    FloorCompletion* out) {
  unsigned long empty = 0;
  FloorSlot ring[16];
  std::uint64_t head = 0, tail = 0;
  for (unsigned long i = 0; i < iters; ++i) {
    if (tail - head >= 16) std::abort();  // the queue's room
    ring[tail & 15] = {i, 1, 0};
    ibv_wr_start(qx);
    qx->wr_id = kFloorTag | (tail & kFloorSeq);
    qx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_rdma_write(qx, rkey, remote_addr);
    ibv_wr_set_sge(qx, sge.lkey, sge.addr, sge.length);
    if (ibv_wr_complete(qx) != 0) std::abort();
    ++tail;
    pause_200us();
    ibv_poll_cq_attr attr{};
    int rc;
    while ((rc = ibv_start_poll(cq, &attr)) == ENOENT) ++empty;
    if (rc != 0) std::abort();
    const std::uint64_t id = cq->wr_id;
    const ibv_wc_status status = cq->status;
    const std::uint64_t seq = head + ((id - head) & kFloorSeq);
    if ((id >> 48) != 1 || seq >= tail || status != IBV_WC_SUCCESS) std::abort();
    const FloorSlot slot = ring[seq & 15];
    head = seq + 1;
    ibv_end_poll(cq);
    *out = {slot.wr_id, slot.op, static_cast<std::uint32_t>(status), 0, 0, 0, false};
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

extern "C" __attribute__((noinline)) unsigned long rdmakit_overhead_prep_loop(
    rdmakit::Connection* conn, rdmakit::PreparedRequest write, unsigned long iters) {
  unsigned long empty = 0;
  rdmakit::Completion c;
  for (unsigned long i = 0; i < iters; ++i) {
    if (!conn->post(write, i).ok()) std::abort();
    pause_200us();
    while (conn->poll({&c, 1}) == 0) ++empty;
    if (!c.ok()) std::abort();
  }
  return empty;
}

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode != "raw" && mode != "rawsge" && mode != "rawex" && mode != "floor" && mode != "lib" && mode != "prep") {
    std::fprintf(stderr, "usage: %s raw|rawsge|rawex|floor|lib|prep ITERATIONS\n", argv[0]);
    return 2;
  }
  const unsigned long iters = std::strtoul(argv[2], nullptr, 10);
  using namespace std::chrono_literals;
  bench::Loopback loop(rdmakit::ConnectionConfig{});
  rdmakit::Connection& conn = loop.conn;
  const rdmakit::LocalSlice src = conn.memory(0).local().subslice(0, 8);
  const rdmakit::RemoteRegion dst = conn.remote_regions().at(0);
  unsigned long empty;
  if (mode == "prep") {
    rdmakit::WorkRequest w;
    w.opcode = rdmakit::Opcode::write;
    w.local = {&src, 1};
    w.remote = dst;
    const rdmakit::PreparedRequest write = conn.prepare(w);
    empty = rdmakit_overhead_prep_loop(&conn, write, iters);
  } else if (mode != "lib") {
    auto& m = rdmakit::Connection::Impl::of(conn);
    const ibv_sge sge{reinterpret_cast<std::uint64_t>(src.addr()), 8, src.lkey()};
    // The library sends 8 bytes inline (they fit in max_inline); so do the raw loops.
    const unsigned inl = m.info.max_inline >= 8 ? IBV_SEND_INLINE : 0;
    if (mode == "raw" || mode == "rawsge") {
      empty = rdmakit_overhead_raw_loop(m.qps[0].get(), m.send_cq.get(), sge, dst.addr, dst.rkey,
                                        mode == "raw" ? inl : 0, iters);
    } else {
      // Its QP writes to itself, into 64 bytes registered for it in the QP's protection domain.
      // By SGE, not inline: rxe (Debian 12's rdma-core 44) completes a WRITE whose data was
      // given by ibv_wr_set_inline_data with LOC_QP_OP_ERR.
      const ExtendedQp x = extended_qp_like(m.qps[0].get());
      static std::uint8_t target[64];
      ibv_mr* mr = ibv_reg_mr(x.qp->pd, target, sizeof target, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
      if (mr == nullptr) std::abort();
      if (mode == "floor") {
        FloorCompletion c{};
        empty = rdmakit_overhead_floor_loop(ibv_qp_to_qp_ex(x.qp), x.cq, sge, reinterpret_cast<std::uint64_t>(target),
                                            mr->rkey, iters, &c);
        if (c.wr_id != iters - 1) std::abort();
      } else {
        empty = rdmakit_overhead_rawex_loop(ibv_qp_to_qp_ex(x.qp), x.cq, sge, reinterpret_cast<std::uint64_t>(target),
                                            mr->rkey, 0, iters);
      }
      (void)ibv_dereg_mr(mr);
      (void)ibv_destroy_qp(x.qp);
      (void)ibv_destroy_cq(ibv_cq_ex_to_cq(x.cq));
    }
  } else {
    empty = rdmakit_overhead_lib_loop(&conn, &src, &dst, iters);
  }
  std::printf("%s: %lu iterations, %lu empty polls\n", mode.c_str(), iters, empty);
  return 0;
}
