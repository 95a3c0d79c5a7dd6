// SPDX-License-Identifier: Apache-2.0
#pragma once
// Rails: the ports a peer link may hold QPs on. A local port can carry a rail to a peer's port
// when both have the same link layer and GIDs that reach each other (same address family and
// subnet; on InfiniBand the same subnet prefix). Each engine computes its own ports here; a peer
// learns them from the RAILS message on its link (protocol.hpp) and the metadata record carries
// them for people and tools.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/ipaddr.hpp"
#include "rdmakit/device.hpp"

namespace rdmakit::detail {

struct RailPort {
  std::string device;
  std::uint8_t port = 1;
  LinkLayer link_layer = LinkLayer::ethernet;
  Ip16 gid{};
  /// Subnet bits: of the IPv4 address for an IPv4-mapped GID, else of the 128-bit GID. 0: unknown
  /// (no interface holds the address), which reaches nothing.
  std::uint8_t prefix = 0;
  bool active = false;
  /// Where a link on this port is bootstrapped ("host:port"); empty when there is none (the
  /// listener is bound to another address, the port is down, or the GID has no routable address).
  std::string endpoint;

  [[nodiscard]] bool v4() const noexcept;
  /// "198.18.1.0/24", "fe80::/64"; "unknown" without a prefix.
  [[nodiscard]] std::string subnet() const;
  /// The GID as an address: "198.18.1.2" (IPv4-mapped), else IPv6 text.
  [[nodiscard]] std::string address() const;
  /// "rxe1 port 1 (198.18.1.2, 198.18.1.0/24)".
  [[nodiscard]] std::string describe() const;
};

/// Whether a rail can join `a` and `b` (see the file comment).
[[nodiscard]] bool reaches(const RailPort& a, const RailPort& b) noexcept;

/// This host's ports that have a usable GID (chosen by `gid` as a connection would), in device
/// order; `devices` empty: all, else only those named. A port with no usable GID is skipped.
/// With `listen_port` set, each active Ethernet port whose GID is a routable address gets an
/// endpoint on it, unless `listen_host` names another address.
[[nodiscard]] std::vector<RailPort> local_rails(const std::vector<DeviceInfo>& catalog, const GidSelector& gid,
                                                const std::vector<std::string>& devices = {},
                                                std::uint16_t listen_port = 0, const std::string& listen_host = {});

/// Whether a listen host accepts on every address ("", "0.0.0.0", "::", "*").
[[nodiscard]] bool wildcard_host(const std::string& host);
/// Whether a listener on wildcard `host` accepts on an address of the family (`v4`): "0.0.0.0"
/// binds IPv4 alone, no host and "::" both.
[[nodiscard]] bool wildcard_serves(const std::string& host, bool v4);

/// One rail a link to a peer should hold: a local port and the peer's port it reaches.
struct RailPlan {
  RailPort local;
  RailPort peer;
};

/// The rails beyond a link's first one (on local port `first_local` to the peer's
/// `first_peer`, an index into `peer`, or none): every other local port that reaches a port of
/// the peer with an endpoint, preferring a peer port not used yet, at most `max_extra` of them.
/// A local port that reaches none is listed in `unused` with the reason.
struct RailUnused {
  std::string local;   // RailPort::describe()
  std::string reason;
};
struct RailMatch {
  std::vector<RailPlan> rails;
  std::vector<RailUnused> unused;
};
[[nodiscard]] RailMatch match_rails(const std::vector<RailPort>& local, const std::vector<RailPort>& peer,
                                    const std::string& first_device, std::uint8_t first_port,
                                    std::optional<std::size_t> first_peer, std::size_t max_extra);

}  // namespace rdmakit::detail
