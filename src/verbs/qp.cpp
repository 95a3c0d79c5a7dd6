// SPDX-License-Identifier: Apache-2.0
#include "verbs/qp.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "common/ipaddr.hpp"
#include "rdmakit/error.hpp"
#include "verbs/handles.hpp"

namespace rdmakit::detail {
namespace {

// IB spec 9.7.5.2.8 / rdma-core's ibv_modify_qp(3): min_rnr_timer codes in units of 10 us.
// Code 0 means 655.36 ms, the longest; codes 1..31 increase.
constexpr std::uint32_t kRnrTable10us[32] = {
    65536, 1,   2,   3,   4,   6,   8,    12,   16,   24,   32,   48,   64,   96,   128,  192,
    256,   384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152};

std::string gid_text(const Gid& g) { return format_ip16(g); }

// One line per attribute in the mask: name, the value used, and where it came from on each side.
struct AttrLines {
  std::vector<AttrLine> lines;
  void add(const char* name, const std::string& value, const std::string& origin = {}) {
    lines.push_back({name, value, origin});
  }
};

[[noreturn]] void modify_failed(const char* transition, int rc, const std::vector<AttrLine>& attrs,
                                std::string hint) {
  std::string text;
  for (const AttrLine& a : attrs) {
    text += fmt::format("\n    {:<20} {}{}", a.name, a.value, a.origin.empty() ? "" : "  (" + a.origin + ")");
  }
  throw Error(fmt::format("ibv_modify_qp({})", transition), rc, "attributes in the mask:" + text,
              std::move(hint));
}

}  // namespace

std::uint8_t encode_ack_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    throw Error("QP configuration", EINVAL, "ACK timeout 0",
                "timeout 0 means 'never retransmit': a lost packet or a dead peer would hang the "
                "QP forever; use a real timeout (default 500 ms)");
  }
  const double us = static_cast<double>(timeout.count()) * 1000.0;
  const int t = static_cast<int>(std::ceil(std::log2(us / 4.096)));
  if (t > 31) {
    throw Error("QP configuration", EINVAL,
                fmt::format("ACK timeout {} ms exceeds the largest encodable (~2.4 h)", timeout.count()));
  }
  return static_cast<std::uint8_t>(std::max(t, 1));
}

std::chrono::microseconds ack_timeout_duration(std::uint8_t t) noexcept {
  return std::chrono::microseconds(static_cast<long long>(4.096 * std::ldexp(1.0, t)));
}

std::uint8_t encode_rnr_timer(std::chrono::microseconds delay) {
  const auto units = static_cast<std::uint64_t>((delay.count() + 9) / 10);
  for (std::uint8_t code = 1; code < 32; ++code) {
    if (kRnrTable10us[code] >= units) return code;
  }
  if (units <= kRnrTable10us[0]) return 0;
  throw Error("QP configuration", EINVAL,
              fmt::format("RNR timer {} us exceeds the largest (655.36 ms)", delay.count()));
}

void check_retries(const QpTimeouts& t) {
  if (t.rnr_retry >= 7) {
    throw Error("QP configuration", EINVAL, fmt::format("rnr_retry {}", t.rnr_retry),
                "rnr_retry 7 means 'retry forever': a peer that never posts a receive would hang "
                "the sender; use 0..6");
  }
  if (t.retry_count > 7) {
    throw Error("QP configuration", EINVAL, fmt::format("retry_count {} (0..7)", t.retry_count));
  }
  (void)encode_ack_timeout(t.ack_timeout);
  (void)encode_rnr_timer(t.rnr_timer);
}

void check_path(const QpPath& p) {
  if (p.service_level > 15) {
    throw Error("QP configuration", EINVAL, fmt::format("service_level {} (0..15)", p.service_level));
  }
}

std::string traffic_class_text(std::uint8_t traffic_class) {
  return traffic_class == 0 ? "the device's default"
                            : fmt::format("DSCP {}, ECN {}", traffic_class >> 2, traffic_class & 3);
}

RtrAttrs derive_rtr(const wire::EndpointInfo& local, const wire::EndpointInfo& remote,
                    std::uint8_t port, const QpTimeouts& timeouts, const QpPath& path) {
  RtrAttrs a;
  a.port = port;
  a.sl = path.service_level;
  a.traffic_class = path.traffic_class;
  a.path_mtu = mtu_enum(std::min(local.mtu, remote.mtu));
  a.dest_qpn = remote.qpn;
  a.rq_psn = remote.psn;
  a.max_dest_rd_atomic = local.max_dest_rd_atomic;
  a.min_rnr_timer = encode_rnr_timer(timeouts.rnr_timer);
  for (const RemoteRegion& r : local.regions) a.access = a.access | r.access;
  if (local.link_layer == LinkLayer::ethernet) {
    // RoCE has no LIDs: every packet carries a GRH built from the GIDs.
    a.is_global = true;
    a.dgid = remote.gid;
    a.sgid_index = static_cast<std::uint8_t>(local.gid_index);
    // RoCE v2 is routed IP; a hop limit of 1 (the seed's) dies at the first router.
    a.hop_limit = 64;
  } else {
    a.dlid = remote.lid;
    // Same subnet prefix: LID routing, no GRH. Different prefixes need a GRH to cross routers.
    const bool same_subnet = std::equal(local.gid.begin(), local.gid.begin() + 8, remote.gid.begin());
    // A traffic class travels in the GRH: asking for one gives every packet a GRH.
    if (!same_subnet || path.traffic_class != 0) {
      a.is_global = true;
      a.dgid = remote.gid;
      a.sgid_index = static_cast<std::uint8_t>(local.gid_index);
      a.hop_limit = 64;
    }
  }
  return a;
}

RtsAttrs derive_rts(const wire::EndpointInfo& local, const wire::EndpointInfo& remote,
                    const QpTimeouts& timeouts) {
  check_retries(timeouts);
  RtsAttrs a;
  a.sq_psn = local.psn;
  a.timeout = encode_ack_timeout(timeouts.ack_timeout);
  a.retry_cnt = timeouts.retry_count;
  a.rnr_retry = timeouts.rnr_retry;
  // We may have in flight no more READs/atomics than the peer can serve.
  a.max_rd_atomic = std::min(local.max_rd_atomic, remote.max_dest_rd_atomic);
  return a;
}

unsigned qp_access_flags(Access access) noexcept {
  unsigned f = 0;
  if (allows(access, Access::remote_read)) f |= IBV_ACCESS_REMOTE_READ;
  if (allows(access, Access::remote_write)) f |= IBV_ACCESS_REMOTE_WRITE;
  if (allows(access, Access::remote_atomic)) f |= IBV_ACCESS_REMOTE_ATOMIC;
  return f;
}

std::vector<AttrLine> init_attr_lines(std::uint8_t port, std::uint16_t pkey_index) {
  AttrLines l;
  l.add("qp_state", "INIT");
  l.add("pkey_index", std::to_string(pkey_index), pkey_index == 0 ? "the default partition" : "ConnectionConfig::pkey_index");
  l.add("port_num", std::to_string(port));
  l.add("qp_access_flags", "0", "granted at RTR, from the advertised regions");
  return std::move(l.lines);
}

std::vector<AttrLine> rtr_attr_lines(const RtrAttrs& a, const wire::EndpointInfo& local,
                                     const wire::EndpointInfo& remote) {
  AttrLines l;
  l.add("qp_state", "RTR");
  l.add("path_mtu", std::to_string(mtu_bytes(a.path_mtu)),
        fmt::format("local active {}, remote active {}", local.mtu, remote.mtu));
  l.add("dest_qp_num", fmt::format("{:#x}", a.dest_qpn),
        fmt::format("remote QPN {:#x}; local QPN {:#x}", remote.qpn, local.qpn));
  l.add("rq_psn", fmt::format("{:#x}", a.rq_psn), "remote PSN");
  l.add("max_dest_rd_atomic", std::to_string(a.max_dest_rd_atomic), "local device cap");
  l.add("min_rnr_timer", std::to_string(a.min_rnr_timer));
  l.add("qp_access_flags", fmt::format("{:#x}", qp_access_flags(a.access)),
        fmt::format("{}, the union of the {} advertised regions", to_string(a.access),
                    local.regions.size()));
  l.add("ah.port_num", std::to_string(a.port));
  l.add("ah.sl", std::to_string(a.sl), "ConnectionConfig::service_level");
  l.add("ah.dlid", std::to_string(a.dlid), fmt::format("remote LID {}", remote.lid));
  l.add("ah.is_global", a.is_global ? "1" : "0", to_string(local.link_layer));
  if (a.is_global) {
    l.add("ah.grh.dgid", gid_text(a.dgid), fmt::format("remote GID, {}", to_string(remote.gid_type)));
    l.add("ah.grh.sgid_index", std::to_string(a.sgid_index),
          fmt::format("local GID {}, {}", gid_text(local.gid), to_string(local.gid_type)));
    l.add("ah.grh.hop_limit", std::to_string(a.hop_limit));
    l.add("ah.grh.traffic_class", std::to_string(a.traffic_class), traffic_class_text(a.traffic_class));
  }
  return std::move(l.lines);
}

std::vector<AttrLine> rts_attr_lines(const RtsAttrs& a, const wire::EndpointInfo& local,
                                     const wire::EndpointInfo& remote) {
  AttrLines l;
  l.add("qp_state", "RTS");
  l.add("sq_psn", fmt::format("{:#x}", a.sq_psn), "local PSN");
  l.add("timeout", std::to_string(a.timeout),
        fmt::format("{} us", ack_timeout_duration(a.timeout).count()));
  l.add("retry_cnt", std::to_string(a.retry_cnt));
  l.add("rnr_retry", std::to_string(a.rnr_retry));
  l.add("max_rd_atomic", std::to_string(a.max_rd_atomic),
        fmt::format("min(local {}, remote max_dest_rd_atomic {})", local.max_rd_atomic,
                    remote.max_dest_rd_atomic));
  return std::move(l.lines);
}

void to_init(ibv_qp* qp, std::uint8_t port, std::uint16_t pkey_index) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = pkey_index;
  attr.port_num = port;
  attr.qp_access_flags = 0;
  const int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  if (const int rc = ibv_modify_qp(qp, &attr, mask); rc != 0) {
    // Some NICs (Intel E810) reject RESET->INIT unless the QP really is in RESET.
    modify_failed("RESET->INIT", rc, init_attr_lines(port, pkey_index),
                  fmt::format("is port {} valid, P_Key index {} in its table (ibv_devinfo -v lists it), and the QP "
                              "in RESET (it is {})?",
                              port, pkey_index, state_name(query_state(qp))));
  }
}

void to_rtr(ibv_qp* qp, const RtrAttrs& a, const wire::EndpointInfo& local,
            const wire::EndpointInfo& remote) {
  auto lines = [&] { return rtr_attr_lines(a, local, remote); };
  // QPNs and PSNs are 24-bit. Checked here rather than left to the provider: mlx5 answers EINVAL,
  // but rxe silently keeps the low 24 bits and would connect to whichever QP has that number.
  if (a.dest_qpn >= (1u << 24) || a.dest_qpn == 0 || a.rq_psn >= (1u << 24)) {
    modify_failed("INIT->RTR", EINVAL, lines(),
                  fmt::format("refused before calling the verb: dest_qp_num {:#x} / rq_psn {:#x} do "
                              "not fit in 24 bits (or the QPN is 0), so the remote QPN is corrupt",
                              a.dest_qpn, a.rq_psn));
  }
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = a.path_mtu;
  attr.dest_qp_num = a.dest_qpn;
  attr.rq_psn = a.rq_psn;
  attr.max_dest_rd_atomic = a.max_dest_rd_atomic;
  attr.min_rnr_timer = a.min_rnr_timer;
  attr.qp_access_flags = qp_access_flags(a.access);
  attr.ah_attr.port_num = a.port;
  attr.ah_attr.sl = a.sl;
  attr.ah_attr.dlid = a.dlid;
  attr.ah_attr.is_global = a.is_global ? 1 : 0;
  if (a.is_global) {
    std::copy(a.dgid.begin(), a.dgid.end(), attr.ah_attr.grh.dgid.raw);
    attr.ah_attr.grh.sgid_index = a.sgid_index;
    attr.ah_attr.grh.hop_limit = a.hop_limit;
    attr.ah_attr.grh.traffic_class = a.traffic_class;
  }
  const int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER | IBV_QP_ACCESS_FLAGS;
  if (const int rc = ibv_modify_qp(qp, &attr, mask); rc != 0) {
    modify_failed("INIT->RTR", rc, lines(),
                  "the usual causes: a remote QPN that is wrong, a path MTU above what the port "
                  "supports, a GID index that is not in the local table or whose type (RoCE v1/v2) "
                  "does not match the peer's");
  }
}

void to_rts(ibv_qp* qp, const RtsAttrs& a, const wire::EndpointInfo& local,
            const wire::EndpointInfo& remote) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.sq_psn = a.sq_psn;
  attr.timeout = a.timeout;
  attr.retry_cnt = a.retry_cnt;
  attr.rnr_retry = a.rnr_retry;
  attr.max_rd_atomic = a.max_rd_atomic;
  const int mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                   IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  if (const int rc = ibv_modify_qp(qp, &attr, mask); rc != 0) {
    modify_failed("RTR->RTS", rc, rts_attr_lines(a, local, remote),
                  "is max_rd_atomic within the device's max_qp_init_rd_atom?");
  }
}

int to_error(ibv_qp* qp) noexcept {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  return ibv_modify_qp(qp, &attr, IBV_QP_STATE);
}

ibv_qp_state query_state(ibv_qp* qp) noexcept {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (ibv_query_qp(qp, &attr, IBV_QP_STATE, &init) != 0) return IBV_QPS_UNKNOWN;
  return attr.qp_state;
}

const char* state_name(ibv_qp_state s) noexcept {
  switch (s) {
    case IBV_QPS_RESET: return "RESET";
    case IBV_QPS_INIT: return "INIT";
    case IBV_QPS_RTR: return "RTR";
    case IBV_QPS_RTS: return "RTS";
    case IBV_QPS_SQD: return "SQD";
    case IBV_QPS_SQE: return "SQE";
    case IBV_QPS_ERR: return "ERR";
    default: return "UNKNOWN";
  }
}

}  // namespace rdmakit::detail
