// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// A 128-bit GID, in network byte order as on the wire.
using Gid = std::array<std::uint8_t, 16>;

/// Link layer of a port.
enum class LinkLayer : std::uint8_t { infiniband = 1, ethernet = 2 };

/// What kind of GID a table entry is (ibv_gid_type).
enum class GidType : std::uint8_t { ib = 0, roce_v1 = 1, roce_v2 = 2 };

/// Address family of a GID's value.
enum class GidKind : std::uint8_t {
  ipv4_mapped,     ///< ::ffff:a.b.c.d, the IPv4 address of the netdev
  ipv6_link_local, ///< fe80::/10, not routable
  ipv6,            ///< any other (routable) IPv6 address, or an IB GID
};

/// One valid entry of a port's GID table.
struct GidEntry {
  std::uint32_t index = 0;
  GidType type = GidType::ib;
  Gid gid{};
  std::string netdev;  ///< the netdev it belongs to (RoCE), empty on IB

  [[nodiscard]] GidKind kind() const noexcept;
  /// "::ffff:198.18.0.1" or "fe80::5054:ff:fe4c:ab01".
  [[nodiscard]] std::string address() const;
};

/// Attributes of one port of a device.
struct PortInfo {
  std::uint8_t number = 1;
  bool active = false;             ///< IBV_PORT_ACTIVE
  std::string state;               ///< "ACTIVE", "DOWN", ...
  LinkLayer link_layer = LinkLayer::infiniband;
  std::uint32_t active_mtu = 0;    ///< bytes (256..4096)
  std::uint32_t max_mtu = 0;       ///< bytes
  std::uint16_t lid = 0;
  std::uint32_t max_msg_size = 0;
  double speed_gbps = 0;           ///< per lane x lanes, as the port reports it (0: unknown)
  std::uint32_t width = 0;         ///< lanes (1, 2, 4, 8, 12; 0: unknown)
  /// The port's netdev: its GIDs' on RoCE, its IPoIB interface on InfiniBand (a netdev of the
  /// device's PCI function whose dev_port is this port's); empty when it has none.
  std::string netdev;
  std::vector<GidEntry> gids;      ///< valid entries only, by index
};

/// One RDMA device and its ports.
struct DeviceInfo {
  std::string name;                ///< "mlx5_0", "rxe0"
  std::uint64_t node_guid = 0;     ///< host byte order
  std::uint32_t max_qp_wr = 0;     ///< work requests per queue
  std::uint32_t max_cqe = 0;       ///< entries per completion queue
  std::uint32_t max_sge = 0;       ///< scatter-gather entries per work request
  std::uint32_t max_qp_rd_atom = 0;  ///< incoming RDMA READ/atomic per QP
  bool atomics = false;            ///< remote atomics supported
  /// Type-2 memory windows: what the engine gives each peer its own revocable key with.
  bool memory_windows = false;
  std::string fw_ver;              ///< firmware version, as the driver reports it
  std::uint32_t vendor_id = 0;
  std::uint32_t vendor_part_id = 0;
  int numa_node = -1;              ///< the NIC's NUMA node; -1: none (software device) or unknown
  std::vector<PortInfo> ports;
};

/// Enumerates every RDMA device with its ports and GID tables. Throws Error when the verbs
/// library cannot list devices; an empty result means there are none.
[[nodiscard]] std::vector<DeviceInfo> list_devices();

/// What the RDMA connection manager resolves an address to: the device, port, source address and
/// GID that the kernel's route uses, and the path (rdma_resolve_addr, then rdma_resolve_route;
/// nothing reaches the peer but a neighbour lookup, or on InfiniBand a path query). What a
/// connection with ConnectMethod::rdma_cm would use (`rdmakit devices --to`).
struct RouteInfo {
  std::string address;     ///< the peer address resolved
  std::string device;
  std::uint8_t port = 0;
  std::string source;      ///< the local IP address the route leaves from
  int gid_index = -1;      ///< the source GID's index in the port's table
  std::string source_gid;
  std::string dest_gid;
  std::uint32_t path_mtu = 0;
  std::uint8_t hop_limit = 0;      ///< the GRH's hop limit (the route's TTL on RoCE)
  std::uint8_t traffic_class = 0;
};
/// Resolves `address` (an IP address or a host name). Throws Error naming the CM step that
/// failed (no RDMA device on the route, no neighbour reply) by `timeout`.
[[nodiscard]] RouteInfo resolve_route(const std::string& address, std::chrono::milliseconds timeout);

/// A device chosen (choose_device), the port the rule that chose it named (0: none), and which
/// rule that was, in words.
struct DeviceChoice {
  const DeviceInfo* device = nullptr;
  std::uint8_t port = 0;
  std::string reason;
  bool by_route = false;  ///< the route named it (rules 1 and 2), not the fallback or a name
};

/// Chooses a device: by name; or when `name` is empty, by the route to the peer
/// (`route_address`: the bootstrap socket's own address, the NIC the kernel sends through):
/// 1. the device with an ACTIVE port that has a GID with that address (RoCE);
/// 2. the device of the netdev that holds the address: a port whose netdev it is, or the RDMA
///    device of the netdev's own PCI function with the port its dev_port names (InfiniBand,
///    whose IPoIB addresses are in no GID);
/// 3. else the first device with an ACTIVE port (the reason says why the route named none).
/// Throws Error naming the available devices (and their port states) when none fits.
[[nodiscard]] DeviceChoice choose_device(const std::vector<DeviceInfo>& devices, const std::string& name,
                                         std::string_view route_address = {});

/// choose_device()'s device.
[[nodiscard]] const DeviceInfo& pick_device(const std::vector<DeviceInfo>& devices,
                                            const std::string& name,
                                            std::string_view route_address = {});

/// Picks a port: `number` if non-zero (it must exist), else the ACTIVE port with a GID of
/// `route_address`, else the device's first ACTIVE port.
[[nodiscard]] const PortInfo& pick_port(const DeviceInfo& device, std::uint8_t number,
                                        std::string_view route_address = {});

/// How to choose the source GID. By default the highest-priority entry wins: RoCE v2 with an
/// IPv4 address first, then routable RoCE v2 IPv6, then RoCE v1 (IPv4, then IPv6), then
/// link-local entries, then IB GIDs; lower index first within a rank.
struct GidSelector {
  std::optional<std::uint32_t> index;  ///< use exactly this table index
  std::string address;                 ///< or the entry whose address is this IPv4/IPv6 address

  /// Parses "3" (an index) or an IP address ("198.18.0.1", "fe80::1"); empty means automatic.
  static GidSelector parse(const std::string& text);
};

/// Chooses a GID from a port's table following `selector`, with the reason for the choice. An
/// automatic selector takes the entry whose address is `route_address` (the bootstrap socket's
/// own address, as rdma_cm takes the route's source address; RoCE v2 before v1) and falls back
/// to the priority order when none has it. Throws Error when the selector matches nothing or the
/// table has no usable entry.
struct GidChoice {
  GidEntry entry;
  std::string reason;
};
[[nodiscard]] GidChoice choose_gid(std::span<const GidEntry> table, const GidSelector& selector,
                                   std::string_view route_address = {});

/// "IB", "RoCE v1", "RoCE v2".
[[nodiscard]] const char* to_string(GidType type) noexcept;
/// "InfiniBand", "Ethernet".
[[nodiscard]] const char* to_string(LinkLayer layer) noexcept;

}  // namespace rdmakit
#pragma GCC visibility pop
