// SPDX-License-Identifier: Apache-2.0
// Resolving, connecting and listening through the CM, and what each CM failure means.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "cm/channel.hpp"
#include "rdmakit/error.hpp"
#include "verbs/handles.hpp"

namespace rdmakit::detail {

namespace {

// IB CM reject reasons (IBA 12.6.7.2) that a connect sees most.
constexpr int kRejInvalidServiceId = 8;  // nothing listens on that port
constexpr int kRejConsumer = 28;         // the listener refused (ours carries why)
constexpr int kRejStaleConn = 10;
constexpr int kRejTimeout = 1;

std::string reject_text(int reason) {
  switch (reason) {
    case kRejInvalidServiceId: return "nothing listens on that rdma_cm port (IB CM reject: invalid service ID)";
    case kRejConsumer: return "the listener refused the connection";
    case kRejStaleConn: return "a stale connection with the same QP was still known to the peer (IB CM reject: stale connection)";
    case kRejTimeout: return "the peer's CM timed out (IB CM reject: no QP)";
    default: return fmt::format("IB CM reject reason {}", reason);
  }
}

// Our listener's REJ carries the magic and the reason; anything else is the peer's CM's own.
std::string our_reason(const std::vector<std::uint8_t>& data) {
  if (data.size() <= kCmMagic.size() || !std::equal(kCmMagic.begin(), kCmMagic.end(), data.begin())) return {};
  std::string s(data.begin() + static_cast<std::ptrdiff_t>(kCmMagic.size()), data.end());
  s.erase(std::find(s.begin(), s.end(), '\0'), s.end());
  return s;
}

std::chrono::milliseconds left_of(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds{1});
}

EventChannelPtr new_event_channel() {
  EventChannelPtr ch(rdma_create_event_channel());
  if (!ch) {
    throw Error("rdma_create_event_channel", errno, "opening /dev/infiniband/rdma_cm",
                errno == ENOENT || errno == ENODEV ? "the rdma_ucm module is not loaded (modprobe rdma_ucm)" : "");
  }
  return ch;
}

CmIdPtr new_id(rdma_event_channel* ch) {
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) throw Error("rdma_create_id", errno, "RDMA_PS_TCP");
  return CmIdPtr(id);
}

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const noexcept { ::freeaddrinfo(a); }
};

std::unique_ptr<addrinfo, AddrInfoDeleter> lookup(const std::string& host, std::uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    throw Error("getaddrinfo", EHOSTUNREACH, fmt::format("'{}': {}", host, ::gai_strerror(rc)));
  }
  return std::unique_ptr<addrinfo, AddrInfoDeleter>(res);
}

// Address and route resolution for a fresh id, each step bounded by the deadline.
void resolve(rdma_cm_id* id, rdma_event_channel* events, const sockaddr* to, const std::string& peer,
             Deadline deadline, const Stop* stop) {
  if (rdma_resolve_addr(id, nullptr, const_cast<sockaddr*>(to), static_cast<int>(left_of(deadline).count())) != 0) {
    throw Error("rdma_resolve_addr", errno, peer,
                errno == ENETUNREACH || errno == EHOSTUNREACH || errno == EADDRNOTAVAIL || errno == ENODEV
                    ? "no route to it, or the route leaves by a netdev with no RDMA device on it (`ip "
                      "route get` the address; `rdma link` shows which netdevs have one)"
                    : "");
  }
  CmEvent e;
  for (auto [want, step] : {std::pair{RDMA_CM_EVENT_ADDR_RESOLVED, "rdma_cm address resolution"},
                            std::pair{RDMA_CM_EVENT_ROUTE_RESOLVED, "rdma_cm route resolution"}}) {
    if (!next_event(events, deadline, e, stop)) {
      throw Error(step, ETIMEDOUT, fmt::format("{}: no answer before the deadline", peer),
                  "no neighbour (ARP/ND) reply, or no path record: is the peer up, and on a network "
                  "this host reaches through an RDMA device?");
    }
    if (e.type != want) throw cm_event_error(step, e, peer);
    if (want == RDMA_CM_EVENT_ADDR_RESOLVED &&
        rdma_resolve_route(id, static_cast<int>(left_of(deadline).count())) != 0) {
      throw Error("rdma_resolve_route", errno, peer);
    }
  }
}

}  // namespace

Error cm_event_error(const char* step, const CmEvent& e, const std::string& peer) {
  const char* name = rdma_event_str(e.type);
  // Address, route and unreachable report a negative errno; a reject its reason code.
  const int err = e.status < 0 ? -e.status : 0;
  switch (e.type) {
    case RDMA_CM_EVENT_ADDR_ERROR:
      if (err == ETIMEDOUT || err == EHOSTUNREACH) {
        return Error(step, err,
                     fmt::format("{}: {} ({}): no neighbour answered for the peer or the route's next hop",
                                 peer, name, errno_name(err)),
                     "no ARP/ND reply: the peer (or the gateway the route names) is down or not on that "
                     "network; check `ip route get` the address and `ip neigh`");
      }
      return Error(step, err != 0 ? err : EADDRNOTAVAIL,
                   fmt::format("{}: {} ({}): the address is not reachable through any RDMA device", peer,
                               name, errno_name(err)),
                   "the route to it leaves by a netdev with no RDMA device on it (`ip route get` the "
                   "address, `rdma link` shows which netdevs have one), or the address is wrong");
    case RDMA_CM_EVENT_ROUTE_ERROR:
      return Error(step, err != 0 ? err : EHOSTUNREACH,
                   fmt::format("{}: {} ({}): no path to the peer", peer, name, errno_name(err)),
                   "no neighbour (ARP/ND) reply for the next hop, or on InfiniBand no path record "
                   "from the subnet manager: is the peer (or the router) up?");
    case RDMA_CM_EVENT_UNREACHABLE:
      return Error(step, err != 0 ? err : ETIMEDOUT,
                   fmt::format("{}: {} ({}): the peer's CM never answered the connect request", peer,
                               name, errno_name(err)),
                   "the host is down or partitioned, its rdma_cm is not loaded, or a firewall drops "
                   "RoCE (UDP 4791) on the way");
    case RDMA_CM_EVENT_REJECTED: {
      const std::string ours = our_reason(e.data);
      if (!ours.empty()) {
        return Error(step, ECONNREFUSED, fmt::format("{} rejected the connection: {}", peer, ours));
      }
      return Error(step, ECONNREFUSED,
                   fmt::format("{}: {}: {}", peer, name, reject_text(e.status)),
                   e.status == kRejInvalidServiceId ? "is the server started, on that port, with --cm rdma_cm?" : "");
    }
    case RDMA_CM_EVENT_CONNECT_ERROR:
      return Error(step, err != 0 ? err : ECONNABORTED,
                   fmt::format("{}: {} ({}): the connection could not be completed", peer, name, errno_name(err)),
                   "the peer's CM gave up on this connection (it timed out waiting for us, or its QP failed)");
    case RDMA_CM_EVENT_DISCONNECTED:
      return Error(step, ECONNRESET, fmt::format("{}: {}: the peer disconnected", peer, name),
                   "the peer exited or rejected this connection; see its log");
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      return Error(step, ENODEV, fmt::format("{}: {}: the RDMA device went away", peer, name),
                   "the device was unloaded or reset (rdma link delete, driver reload, hot unplug)");
    default:
      return Error(step, EPROTO, fmt::format("{}: unexpected CM event {} (status {})", peer, name, e.status));
  }
}

std::unique_ptr<Channel> cm_connect(const HostPort& to, const CmOptions& options, Deadline deadline,
                                    bool retry_refused, const std::shared_ptr<const Stop>& stop) {
  const std::string peer = to.to_string();
  // A retried refusal says more than the deadline cutting the last attempt short.
  std::optional<Error> refusal;
  for (;;) {
    const auto addrs = lookup(to.host, to.port);
    std::optional<Error> last;
    for (const addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
      try {
        EventChannelPtr events = new_event_channel();
        CmIdPtr id = new_id(events.get());
        const std::string at = sockaddr_text(a->ai_addr);
        resolve(id.get(), events.get(), a->ai_addr, at, deadline, stop.get());
        auto ch = std::make_unique<CmChannel>(std::move(events), std::move(id), at, options);
        ch->set_stop(stop);
        ch->connect(deadline);
        return ch;
      } catch (const Error& e) {
        if (e.sys_errno() == ECANCELED) throw;
        last = e;
      }
    }
    // A listener that is not up yet answers "invalid service ID": retried when asked to.
    const bool refused = last && last->sys_errno() == ECONNREFUSED &&
                         std::string_view(last->what()).find("invalid service ID") != std::string_view::npos;
    if (refused) refusal = last;
    if (!refused || !retry_refused || Clock::now() + std::chrono::milliseconds{100} >= deadline) {
      if (last && last->sys_errno() == ETIMEDOUT && refusal) throw *refusal;
      if (last) throw *last;
      throw Error("rdma_cm connect", EHOSTUNREACH, fmt::format("{}: no address", peer));
    }
    (void)poll_until(-1, 0, deadline_in(std::chrono::milliseconds{100}), stop.get(), "rdma_cm connect");
  }
}

void CmRequest::refuse(const std::string& why) noexcept {
  std::array<std::uint8_t, kCmRejectSize> data{};
  std::copy(kCmMagic.begin(), kCmMagic.end(), data.begin());
  const std::size_t n = std::min(why.size(), data.size() - kCmMagic.size());
  std::memcpy(data.data() + kCmMagic.size(), why.data(), n);
  (void)rdma_reject(id_.get(), data.data(), static_cast<std::uint8_t>(kCmMagic.size() + n));
  id_.reset();
}

std::unique_ptr<Channel> CmRequest::accept(const CmOptions& options, Deadline deadline,
                                           const std::shared_ptr<const Stop>& stop) {
  // The request's id moves to an event channel of its own: the listener's sees no more of it.
  EventChannelPtr events = new_event_channel();
  if (rdma_migrate_id(id_.get(), events.get()) != 0) throw Error("rdma_migrate_id", errno, peer_);
  // If building the QP fails, the id dies with the half-built channel: the client sees its
  // request rejected by the CM at once rather than waiting for a REP.
  auto ch = std::make_unique<CmChannel>(std::move(events), std::move(id_), peer_, options);
  ch->set_stop(stop);
  ch->accept(deadline);
  return ch;
}

CmListener::CmListener(const HostPort& at, int backlog) : events_(new_event_channel()), id_(new_id(events_.get())) {
  set_nonblocking(events_->fd, "the CM listener's event channel");
  sockaddr_storage ss{};
  if (at.host.empty()) {
    // Every address, IPv6 and IPv4 (the CM's default is not IPv6-only).
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_any;
    in6->sin6_port = htons(at.port);
  } else {
    const auto addrs = lookup(at.host, at.port);
    std::memcpy(&ss, addrs->ai_addr, addrs->ai_addrlen);
  }
  if (rdma_bind_addr(id_.get(), reinterpret_cast<sockaddr*>(&ss)) != 0) {
    throw Error("rdma_bind_addr", errno, fmt::format("rdma_cm port {} on {}", at.port, at.host.empty() ? "*" : at.host),
                errno == EADDRINUSE ? "another rdma_cm listener has that port" : "");
  }
  if (rdma_listen(id_.get(), backlog) != 0) throw Error("rdma_listen", errno, fmt::format("rdma_cm port {}", at.port));
  port_ = ntohs(rdma_get_src_port(id_.get()));
}

int CmListener::fd() const noexcept { return events_->fd; }

std::optional<CmRequest> CmListener::next() {
  CmEvent e;
  while (next_event(events_.get(), Clock::now(), e)) {
    if (e.type != RDMA_CM_EVENT_CONNECT_REQUEST) {
      // Only requests reach the listening id's channel before they are taken; anything else
      // (a device going away) is the listener's to report.
      if (e.type == RDMA_CM_EVENT_DEVICE_REMOVAL) throw cm_event_error("rdma_cm listen", e, "the listener");
      continue;
    }
    CmIdPtr id(e.id);
    std::string peer = sockaddr_text(rdma_get_peer_addr(id.get()));
    std::string invalid;
    if (e.data.size() < kCmRequestSize || !std::equal(kCmMagic.begin(), kCmMagic.end(), e.data.begin())) {
      invalid = fmt::format("not an rdmakit client (its connect request carries {} bytes of private "
                            "data without rdmakit's mark)",
                            e.data.size());
    } else if (e.data[4] != kCmVersion) {
      invalid = fmt::format("rdma_cm request version {}; this listener speaks {}", e.data[4], kCmVersion);
    }
    return CmRequest(std::move(id), std::move(peer), std::move(invalid));
  }
  return std::nullopt;
}

RouteInfo cm_resolve(const std::string& host, Deadline deadline) {
  const auto addrs = lookup(host, 0);
  EventChannelPtr events = new_event_channel();
  CmIdPtr id = new_id(events.get());
  RouteInfo r;
  r.address = sockaddr_text(addrs->ai_addr, false);
  resolve(id.get(), events.get(), addrs->ai_addr, r.address, deadline, nullptr);
  r.device = ibv_get_device_name(id->verbs->device);
  r.port = id->port_num;
  r.source = sockaddr_text(rdma_get_local_addr(id.get()), false);
  // The resolved route: its GIDs, and the path record's hop limit, class and MTU.
  const ibv_gid& sgid = id->route.addr.addr.ibaddr.sgid;
  char text[INET6_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET6, sgid.raw, text, sizeof text);
  r.source_gid = text;
  ::inet_ntop(AF_INET6, id->route.addr.addr.ibaddr.dgid.raw, text, sizeof text);
  r.dest_gid = text;
  if (id->route.num_paths > 0 && id->route.path_rec != nullptr) {
    const ibv_sa_path_rec& p = id->route.path_rec[0];
    r.hop_limit = p.hop_limit;
    r.traffic_class = p.traffic_class;
    r.path_mtu = mtu_bytes(static_cast<ibv_mtu>(p.mtu));
  }
  // Its index in the port's table: RoCE lists each address twice (v1 and v2); the CM uses v2
  // unless configured otherwise (configfs default_roce_mode), so prefer that entry.
  ibv_port_attr pa{};
  if (ibv_query_port(id->verbs, id->port_num, &pa) == 0) {
    for (int k = 0; k < pa.gid_tbl_len; ++k) {
      ibv_gid_entry e{};
      if (ibv_query_gid_ex(id->verbs, id->port_num, static_cast<std::uint32_t>(k), &e, 0) != 0) continue;
      if (std::memcmp(e.gid.raw, sgid.raw, sizeof sgid.raw) != 0) continue;
      if (r.gid_index < 0 || e.gid_type == IBV_GID_TYPE_ROCE_V2) r.gid_index = k;
    }
  }
  return r;
}

}  // namespace rdmakit::detail

namespace rdmakit {

RouteInfo resolve_route(const std::string& address, std::chrono::milliseconds timeout) {
  return detail::cm_resolve(address, detail::deadline_in(timeout));
}

}  // namespace rdmakit
