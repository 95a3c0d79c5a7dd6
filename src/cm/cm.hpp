// SPDX-License-Identifier: Apache-2.0
#pragma once
// Connecting through the RDMA connection manager (librdmacm). The kernel resolves the peer's IP
// address to a device, port and source GID, and a path (ARP and the routing table on RoCE, path
// records on IB), so routed RoCE v2 needs no GID guessing. What the CM connects is a small
// control QP of its own (CmChannel): the byte stream that the handshake, the authentication and
// the sealed control messages travel on, exactly as they do on the TCP bootstrap socket. The
// connection's data QPs are then built on the device, port and GID the CM resolved.
//
// The control QP lives in a protection domain of its own with no memory of the application's in
// it, and allows no remote access at all: a peer that connected through the CM but has not yet
// proven the pre-shared key can reach nothing but the control channel's receive buffers.
//
// The CM's private data (56 bytes in a REQ) carries only a magic, a version and flags, so a
// listener refuses a client that is not rdmakit before spending a QP on it; everything else
// goes over the channel.

#include <rdma/rdma_cma.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "bootstrap/channel.hpp"
#include "common/clock.hpp"
#include "rdmakit/device.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail {

struct EventChannelDeleter {
  void operator()(rdma_event_channel* ch) const noexcept { rdma_destroy_event_channel(ch); }
};
struct CmIdDeleter {
  void operator()(rdma_cm_id* id) const noexcept { (void)rdma_destroy_id(id); }
};
using EventChannelPtr = std::unique_ptr<rdma_event_channel, EventChannelDeleter>;
using CmIdPtr = std::unique_ptr<rdma_cm_id, CmIdDeleter>;

/// The control QP's transport settings (the connection's own, ConnectionConfig).
struct CmOptions {
  std::chrono::milliseconds ack_timeout{500};
  std::uint8_t retry_count = 6;
  /// How long a sender backs off when this side has no receive posted. The CM's own choice is
  /// the longest (655 ms), which on rxe outlasts the ACK timeout and turns a reader's short
  /// pause into the sender's RETRY_EXC_ERR.
  std::chrono::microseconds rnr_timer{1280};
};

/// A CM event's name and what it means for a connection attempt, with the likely cause: each
/// RDMA_CM_EVENT_* failure (ADDR_ERROR, ROUTE_ERROR, UNREACHABLE, REJECTED with its reason,
/// CONNECT_ERROR, DISCONNECTED, DEVICE_REMOVAL) as an Error.
struct CmEvent;
[[nodiscard]] Error cm_event_error(const char* step, const CmEvent& e, const std::string& peer);

/// Resolves `to` (a numeric address or a name) and connects a control channel to an rdmakit
/// listener on rdma_cm port `to.port`, all by `deadline`. With `retry_refused`, a peer where
/// nothing listens yet is retried until the deadline. Throws Error naming the CM step; ECANCELED
/// when `stop` is requested (the channel keeps it: cleared once connected).
std::unique_ptr<Channel> cm_connect(const HostPort& to, const CmOptions& options, Deadline deadline,
                                    bool retry_refused, const std::shared_ptr<const Stop>& stop = {});

/// A client's connect request, taken off a CmListener: refuse it, or accept it on a channel.
class CmRequest {
 public:
  CmRequest(CmIdPtr id, std::string peer, std::string invalid) noexcept
      : id_(std::move(id)), peer_(std::move(peer)), invalid_(std::move(invalid)) {}
  [[nodiscard]] const std::string& peer() const noexcept { return peer_; }
  /// Why the request is not an rdmakit client's (its private data); empty when it is.
  [[nodiscard]] const std::string& invalid() const noexcept { return invalid_; }
  /// Rejects it with `why` (as much as the CM's REJ private data holds). Never throws.
  void refuse(const std::string& why) noexcept;
  /// Builds the control QP on the device the request came in on, accepts, and waits for the
  /// client's RTU by `deadline`. Throws Error (the client is then rejected); ECANCELED when
  /// `stop` is requested (the channel keeps it: cleared once connected).
  std::unique_ptr<Channel> accept(const CmOptions& options, Deadline deadline, const std::shared_ptr<const Stop>& stop = {});

 private:
  CmIdPtr id_;
  std::string peer_;
  std::string invalid_;
};

/// Listens on an rdma_cm port. next() takes the connect requests off its event channel without
/// blocking; fd() becomes readable when there may be one.
class CmListener {
 public:
  /// "[host]:port" as for TCP (an empty host: every address; port 0: any free port).
  CmListener(const HostPort& at, int backlog);
  [[nodiscard]] int fd() const noexcept;
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  /// The next connect request, or nullopt when none is waiting. Other events (a request's id
  /// going away before it was taken) are consumed. Throws Error only if the channel fails.
  std::optional<CmRequest> next();

 private:
  EventChannelPtr events_;
  CmIdPtr id_;
  std::uint16_t port_ = 0;
};

/// Resolves address and route to `host` (no connection is made), by `deadline`.
RouteInfo cm_resolve(const std::string& host, Deadline deadline);

}  // namespace rdmakit::detail
