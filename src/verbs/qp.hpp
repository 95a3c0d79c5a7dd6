// SPDX-License-Identifier: Apache-2.0
#pragma once
// The RC queue pair state machine: RESET -> INIT -> RTR -> RTS, one function per transition,
// each with its attribute mask next to the attributes it covers (as rc_pingpong does). The
// attributes are derived from both peers' EndpointInfo by pure functions, so the derivation is
// unit-tested without a device.

#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "rdmakit/memory.hpp"
#include "rdmakit/wire.hpp"

namespace rdmakit::detail {

/// Retransmission settings in real units; encoded only at the verbs boundary.
struct QpTimeouts {
  std::chrono::milliseconds ack_timeout{500};
  std::uint8_t retry_count = 6;
  std::chrono::microseconds rnr_timer{1280};
  std::uint8_t rnr_retry = 6;
};

/// Where a QP's packets go on the fabric: ConnectionConfig's traffic class, service level and
/// P_Key index.
struct QpPath {
  std::uint8_t traffic_class = 0;
  std::uint8_t service_level = 0;
  std::uint16_t pkey_index = 0;
};
/// Throws Error for a service level above 15.
void check_path(const QpPath& p);
/// A traffic class in words: "DSCP 26, ECN 2", or "the device's default" for 0.
std::string traffic_class_text(std::uint8_t traffic_class);

/// The IB "local ACK timeout" exponent t (4.096 us * 2^t) that is at least `timeout`.
/// Throws Error for 0 (t = 0 means "never retransmit": a dead peer would hang the QP forever)
/// and for more than the largest encodable value (~2.4 hours).
std::uint8_t encode_ack_timeout(std::chrono::milliseconds timeout);
/// The actual time an encoded ACK timeout stands for.
std::chrono::microseconds ack_timeout_duration(std::uint8_t t) noexcept;
/// The RNR NAK timer code (IB spec table, 0.01 ms .. 655.36 ms) that is at least `delay`.
std::uint8_t encode_rnr_timer(std::chrono::microseconds delay);
/// Throws Error for rnr_retry = 7 (infinite) and retry_count > 7.
void check_retries(const QpTimeouts& t);

struct RtrAttrs {
  std::uint8_t port = 1;
  ibv_mtu path_mtu = IBV_MTU_1024;
  std::uint32_t dest_qpn = 0;
  std::uint32_t rq_psn = 0;
  std::uint8_t max_dest_rd_atomic = 0;
  std::uint8_t min_rnr_timer = 0;
  bool is_global = false;
  Gid dgid{};
  std::uint8_t sgid_index = 0;
  std::uint8_t hop_limit = 0;
  std::uint8_t traffic_class = 0;
  std::uint8_t sl = 0;
  std::uint16_t dlid = 0;
  /// What the peer may do through this QP: exactly the union of what we advertised.
  Access access = Access::none;
};

struct RtsAttrs {
  std::uint32_t sq_psn = 0;
  std::uint8_t timeout = 0;
  std::uint8_t retry_cnt = 0;
  std::uint8_t rnr_retry = 0;
  std::uint8_t max_rd_atomic = 0;
};

/// RTR attributes from both sides: path MTU = the smaller active MTU; GRH with our GID index and
/// the peer's GID on Ethernet (and on IB across subnets); the peer's LID on IB; remote access =
/// the union of the regions we advertise (local.regions), nothing more.
RtrAttrs derive_rtr(const wire::EndpointInfo& local, const wire::EndpointInfo& remote,
                    std::uint8_t port, const QpTimeouts& timeouts, const QpPath& path = {});
RtsAttrs derive_rts(const wire::EndpointInfo& local, const wire::EndpointInfo& remote,
                    const QpTimeouts& timeouts);

/// One attribute of a transition: its verbs name, value, and where the value came from (which
/// side's parameter, which device cap). Errors and traces list the same lines.
struct AttrLine {
  std::string name, value, origin;
};
std::vector<AttrLine> init_attr_lines(std::uint8_t port, std::uint16_t pkey_index = 0);
std::vector<AttrLine> rtr_attr_lines(const RtrAttrs& a, const wire::EndpointInfo& local,
                                     const wire::EndpointInfo& remote);
std::vector<AttrLine> rts_attr_lines(const RtsAttrs& a, const wire::EndpointInfo& local,
                                     const wire::EndpointInfo& remote);

/// The ibv_access_flags a QP needs so peers may use regions with `access`.
unsigned qp_access_flags(Access access) noexcept;

/// INIT grants peers nothing yet; RTR grants what the advertised regions allow.
void to_init(ibv_qp* qp, std::uint8_t port, std::uint16_t pkey_index = 0);
void to_rtr(ibv_qp* qp, const RtrAttrs& a, const wire::EndpointInfo& local,
            const wire::EndpointInfo& remote);
void to_rts(ibv_qp* qp, const RtsAttrs& a, const wire::EndpointInfo& local,
            const wire::EndpointInfo& remote);
/// Moves the QP to ERR so every outstanding work request completes (flushed). Never throws.
int to_error(ibv_qp* qp) noexcept;
/// The QP's current state as the device reports it.
ibv_qp_state query_state(ibv_qp* qp) noexcept;
const char* state_name(ibv_qp_state s) noexcept;

}  // namespace rdmakit::detail
