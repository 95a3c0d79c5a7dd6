// SPDX-License-Identifier: Apache-2.0
#pragma once
// The benchmarks' loopback connection: a client and a listener in the same process, the
// listener advertising 4 KiB (by default one the client may write), the client holding 4 KiB of
// its own (by default the source of writes: no access). And the raw verbs round trip the latency
// benchmarks anchor on, over such a connection.
#include <infiniband/verbs.h>

#include <chrono>
#include <optional>
#include <string>

#include "connection/impl.hpp"
#include "rdmakit/connection.hpp"

namespace bench {

struct Loopback {
  explicit Loopback(const rdmakit::ConnectionConfig& cfg, rdmakit::Access remote = rdmakit::Access::remote_write,
                    rdmakit::Access local = rdmakit::Access::none)
      : listener("127.0.0.1:0", cfg,
                 [remote](rdmakit::Connection& c) { c.advertise(c.allocate_memory(4096, remote)); }),
        conn(rdmakit::Connection::connect("127.0.0.1:" + std::to_string(listener.port()), cfg,
                                          [local](rdmakit::Connection& c) { c.allocate_memory(4096, local); })),
        server(listener.accept(std::chrono::seconds{10})) {}
  rdmakit::Listener listener;
  rdmakit::Connection conn;
  std::optional<rdmakit::Connection> server;
};

/// One 8-byte RDMA WRITE or READ, signaled, posted with ibv_post_send on `qp` and busy-polled
/// with ibv_poll_cq off `cq`: what a caller that posts and polls itself measures. Nothing else
/// may post to or poll that CQ meanwhile.
class RawRequest {
 public:
  /// (`inline_ok`: a WRITE's 8 bytes inline, where the QP takes them.)
  RawRequest(ibv_qp* qp, ibv_cq* cq, const rdmakit::LocalSlice& src, const rdmakit::RemoteRegion& dst, bool read,
             bool inline_ok)
      : qp_(qp), cq_(cq), sge_{reinterpret_cast<std::uint64_t>(src.addr()), 8, src.lkey()} {
    wr_.wr_id = 1;
    wr_.sg_list = &sge_;
    wr_.num_sge = 1;
    wr_.opcode = read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
    wr_.send_flags = IBV_SEND_SIGNALED | (!read && inline_ok ? static_cast<unsigned>(IBV_SEND_INLINE) : 0u);
    wr_.wr.rdma.remote_addr = dst.addr;
    wr_.wr.rdma.rkey = dst.rkey;
  }
  RawRequest(const RawRequest&) = delete;  // its request points at its own SGE
  RawRequest& operator=(const RawRequest&) = delete;
  /// One round trip; null when it succeeded, else what failed (a static string).
  const char* once() noexcept {
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qp_, &wr_, &bad) != 0) return "ibv_post_send refused the request";
    ibv_wc wc{};
    int got = 0;
    while ((got = ibv_poll_cq(cq_, 1, &wc)) == 0) {
    }
    if (got < 0) return "ibv_poll_cq failed";
    if (wc.wr_id != 1) return "another request's completion";
    return wc.status == IBV_WC_SUCCESS ? nullptr : ibv_wc_status_str(wc.status);
  }

 private:
  ibv_qp* qp_;
  ibv_cq* cq_;
  ibv_sge sge_;
  ibv_send_wr wr_{};
};

/// RawRequest over a loopback connection of its own (bench/latency_loop.cpp; bench/engine_loop.cpp
/// beside the engine).
class RawRoundTrip {
 public:
  /// (`by_sge`: a WRITE's 8 bytes by their SGE even where the QP takes them inline.)
  explicit RawRoundTrip(bool read, bool by_sge = false)
      : loop_(rdmakit::ConnectionConfig{}, rdmakit::Access::remote_read | rdmakit::Access::remote_write,
              rdmakit::Access::local_write),  // a READ lands in the client's memory
        request_(rdmakit::Connection::Impl::of(loop_.conn).qps[0].get(),
                 rdmakit::Connection::Impl::of(loop_.conn).send_cq.get(), loop_.conn.memory(0).local().subslice(0, 8),
                 loop_.conn.remote_regions().at(0), read,
                 // inline where the QP takes it (as ib_write_lat and the library send them)
                 !by_sge && rdmakit::Connection::Impl::of(loop_.conn).info.max_inline >= 8) {}
  const char* once() noexcept { return request_.once(); }

 private:
  Loopback loop_;
  RawRequest request_;
};

}  // namespace bench
