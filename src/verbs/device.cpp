// SPDX-License-Identifier: Apache-2.0
#include <infiniband/verbs.h>
#include <net/if.h>

#include <algorithm>
#include <fstream>
#include <cerrno>
#include <string>

#include <fmt/format.h>

#include "common/ipaddr.hpp"
#include "rdmakit/device.hpp"
#include "rdmakit/error.hpp"
#include "verbs/device_layer.hpp"
#include "verbs/netdev.hpp"

namespace rdmakit {
namespace detail {

std::uint32_t mtu_bytes(ibv_mtu mtu) noexcept {
  switch (mtu) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
  }
  return 0;
}

ibv_mtu mtu_enum(std::uint32_t bytes) noexcept {
  if (bytes >= 4096) return IBV_MTU_4096;
  if (bytes >= 2048) return IBV_MTU_2048;
  if (bytes >= 1024) return IBV_MTU_1024;
  if (bytes >= 512) return IBV_MTU_512;
  return IBV_MTU_256;
}

const char* port_state_name(ibv_port_state s);


const char* port_state_name(ibv_port_state s) {
  switch (s) {
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    default: return "NOP";
  }
}


}  // namespace detail

GidKind GidEntry::kind() const noexcept {
  const bool mapped = std::all_of(gid.begin(), gid.begin() + 10, [](auto b) { return b == 0; }) &&
                      gid[10] == 0xff && gid[11] == 0xff;
  if (mapped) return GidKind::ipv4_mapped;
  if (gid[0] == 0xfe && (gid[1] & 0xc0) == 0x80) return GidKind::ipv6_link_local;
  return GidKind::ipv6;
}

std::string GidEntry::address() const { return detail::format_ip16(gid); }

const char* to_string(GidType type) noexcept {
  switch (type) {
    case GidType::ib: return "IB";
    case GidType::roce_v1: return "RoCE v1";
    case GidType::roce_v2: return "RoCE v2";
  }
  return "?";
}

const char* to_string(LinkLayer layer) noexcept {
  return layer == LinkLayer::ethernet ? "Ethernet" : "InfiniBand";
}

namespace {

// ibv_query_gid_table returns the valid entries of every port of the device in one call.
std::vector<GidEntry> query_gids(ibv_context* ctx, std::uint8_t port, size_t max_entries) {
  std::vector<ibv_gid_entry> all(max_entries);
  const ssize_t n = ibv_query_gid_table(ctx, all.data(), all.size(), 0);
  if (n < 0) {
    throw Error("ibv_query_gid_table", static_cast<int>(-n),
                fmt::format("device {} port {}", ibv_get_device_name(ctx->device), port));
  }
  std::vector<GidEntry> out;
  for (ssize_t i = 0; i < n; ++i) {
    const ibv_gid_entry& e = all[static_cast<size_t>(i)];
    if (e.port_num != port) continue;
    GidEntry g;
    g.index = e.gid_index;
    g.type = e.gid_type == IBV_GID_TYPE_ROCE_V2   ? GidType::roce_v2
             : e.gid_type == IBV_GID_TYPE_ROCE_V1 ? GidType::roce_v1
                                                  : GidType::ib;
    std::copy(std::begin(e.gid.raw), std::end(e.gid.raw), g.gid.begin());
    char ifname[IF_NAMESIZE] = {};
    if (e.ndev_ifindex != 0 && if_indextoname(e.ndev_ifindex, ifname) != nullptr) g.netdev = ifname;
    if (std::any_of(g.gid.begin(), g.gid.end(), [](auto b) { return b != 0; })) out.push_back(g);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.index < b.index; });
  return out;
}

}  // namespace

namespace {

// IB speed codes (ibv_port_attr.active_speed) in Gb/s per lane.
double lane_gbps(std::uint32_t code) {
  switch (code) {
    case 1: return 2.5;       // SDR
    case 2: return 5.0;       // DDR
    case 4: return 10.0;      // QDR
    case 8: return 10.3125;   // FDR10
    case 16: return 14.0625;  // FDR
    case 32: return 25.78125; // EDR
    case 64: return 53.125;   // HDR
    case 128: return 106.25;  // NDR
    case 256: return 212.5;   // XDR
    default: return 0;
  }
}

std::uint32_t lanes(std::uint8_t code) {
  switch (code) {
    case 1: return 1;
    case 2: return 4;
    case 4: return 8;
    case 8: return 12;
    case 16: return 2;
    default: return 0;
  }
}

// The device's NUMA node from sysfs; -1 when it has none (a software device such as rxe has no
// PCI parent) or it cannot be read.
int numa_node_of(ibv_device* dev) {
  std::ifstream f(std::string(dev->ibdev_path) + "/device/numa_node");
  int node = -1;
  if (!(f >> node)) return -1;
  return node;
}

}  // namespace

namespace detail {

DeviceInfo query_device_info(ibv_device* dev, ibv_context* ctx, const ibv_device_attr& attr) {
  DeviceInfo info;
  info.name = ibv_get_device_name(dev);
  info.node_guid = be64toh(ibv_get_device_guid(dev));
  info.max_qp_wr = static_cast<std::uint32_t>(attr.max_qp_wr);
  info.max_cqe = static_cast<std::uint32_t>(attr.max_cqe);
  info.max_sge = static_cast<std::uint32_t>(attr.max_sge);
  info.max_qp_rd_atom = static_cast<std::uint32_t>(attr.max_qp_rd_atom);
  info.atomics = attr.atomic_cap != IBV_ATOMIC_NONE;
  info.memory_windows = (attr.device_cap_flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
  info.fw_ver = attr.fw_ver;
  info.vendor_id = attr.vendor_id;
  info.vendor_part_id = attr.vendor_part_id;
  info.numa_node = numa_node_of(dev);
  for (std::uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
    ibv_port_attr pa{};
    if (const int rc = ibv_query_port(ctx, p, &pa); rc != 0) {
      throw Error("ibv_query_port", rc, fmt::format("device {} port {}", info.name, p));
    }
    PortInfo port;
    port.number = p;
    port.active = pa.state == IBV_PORT_ACTIVE;
    port.state = port_state_name(pa.state);
    port.link_layer =
        pa.link_layer == IBV_LINK_LAYER_ETHERNET ? LinkLayer::ethernet : LinkLayer::infiniband;
    port.active_mtu = mtu_bytes(pa.active_mtu);
    port.max_mtu = mtu_bytes(pa.max_mtu);
    port.lid = pa.lid;
    port.max_msg_size = pa.max_msg_sz;
    port.width = lanes(pa.active_width);
    port.speed_gbps = lane_gbps(pa.active_speed) * port.width;
    port.gids = query_gids(ctx, p, static_cast<size_t>(pa.gid_tbl_len) * attr.phys_port_cnt);
    for (const GidEntry& g : port.gids) {
      if (!g.netdev.empty()) {
        port.netdev = g.netdev;
        break;
      }
    }
    info.ports.push_back(std::move(port));
  }
  // InfiniBand ports: no GID names a netdev; IPoIB's is a netdev of the same PCI function.
  if (std::any_of(info.ports.begin(), info.ports.end(), [](const PortInfo& p) { return p.netdev.empty(); })) {
    const auto by_port = netdevs_by_port(dev->ibdev_path);
    for (PortInfo& p : info.ports) {
      if (const auto it = by_port.find(p.number); p.netdev.empty() && it != by_port.end()) p.netdev = it->second;
    }
  }
  return info;
}

}  // namespace detail


namespace {

std::string describe_ports(const std::vector<DeviceInfo>& devices) {
  std::string s;
  for (const auto& d : devices) {
    if (!s.empty()) s += ", ";
    s += d.name + " (";
    for (size_t i = 0; i < d.ports.size(); ++i) {
      s += fmt::format("{}port {} {}", i ? ", " : "", d.ports[i].number, d.ports[i].state);
    }
    s += ")";
  }
  return s.empty() ? "none" : s;
}

}  // namespace

namespace {

// Whether a port has a GID with the (bootstrap socket's) address `route`.
bool has_route_gid(const PortInfo& p, const std::optional<detail::Ip16>& route) {
  return route && std::any_of(p.gids.begin(), p.gids.end(), [&](const GidEntry& g) { return g.gid == *route; });
}

std::optional<detail::Ip16> route_ip(std::string_view route_address) {
  return route_address.empty() ? std::nullopt : detail::parse_ip16(std::string(route_address));
}

}  // namespace

DeviceChoice choose_device(const std::vector<DeviceInfo>& devices, const std::string& name,
                           std::string_view route_address) {
  if (devices.empty()) {
    throw Error("pick device", ENODEV, "no RDMA devices found",
                "load a NIC driver, or add a Soft-RoCE device: rdma link add rxe0 type rxe netdev "
                "eth0 (in a container, pass /dev/infiniband through)");
  }
  std::string route_note;  // why the route named no device (rule 3's reason)
  if (name.empty()) {
    const auto route = route_ip(route_address);
    // 1. The device whose ACTIVE port has a GID with the route's address: the NIC the kernel
    // sends the bootstrap traffic through (RoCE).
    for (const auto& d : devices) {
      for (const PortInfo& p : d.ports) {
        if (p.active && has_route_gid(p, route)) {
          return {&d, p.number,
                  fmt::format("port {} has a GID with the route's local address {}{}", p.number, route_address,
                              p.netdev.empty() ? "" : fmt::format(" ({})", p.netdev)),
                  true};
        }
      }
    }
    // 2. The netdev that holds the address, and its RDMA device: IPoIB (InfiniBand's addresses
    // are in no GID), or a NIC whose GID table has not caught up with a new address.
    if (route) {
      const std::string ifname = detail::netdev_with_address(*route);
      for (const auto& d : devices) {
        for (const PortInfo& p : d.ports) {
          if (p.active && !ifname.empty() && p.netdev == ifname) {
            return {&d, p.number,
                    fmt::format("the route's local address {} is on {}, port {}'s netdev", route_address, ifname,
                                p.number),
                    true};
          }
        }
      }
      for (const detail::NetdevRdma& r : detail::rdma_of_netdev(ifname)) {
        for (const auto& d : devices) {
          if (d.name != r.device) continue;
          for (const PortInfo& p : d.ports) {
            if (p.active && p.number == r.port) {
              return {&d, p.number,
                      fmt::format("the route's local address {} is on {}, a netdev of its PCI function (port {})",
                                  route_address, ifname, p.number),
                      true};
            }
          }
        }
      }
      route_note = ifname.empty() ? fmt::format("; no netdev here has the route's local address {}", route_address)
                                  : fmt::format("; the route's local address {} is on {}, which is no RDMA device's",
                                                route_address, ifname);
    }
  }
  for (const auto& d : devices) {
    if (!name.empty() && d.name == name) return {&d, 0, "named (the configuration's device)"};
    if (name.empty()) {
      for (const PortInfo& p : d.ports) {
        if (p.active) return {&d, p.number, "the first device with an ACTIVE port" + route_note};
      }
    }
  }
  if (!name.empty()) {
    throw Error("pick device", ENODEV,
                fmt::format("no RDMA device named '{}'; available: {}", name, describe_ports(devices)));
  }
  throw Error("pick device", ENETDOWN,
              fmt::format("no device has an ACTIVE port: {}", describe_ports(devices)),
              "bring the link up (ip link set DEV up) and check the cable or the switch port");
}

const DeviceInfo& pick_device(const std::vector<DeviceInfo>& devices, const std::string& name,
                              std::string_view route_address) {
  return *choose_device(devices, name, route_address).device;
}

const PortInfo& pick_port(const DeviceInfo& device, std::uint8_t number, std::string_view route_address) {
  if (number == 0) {
    const auto route = route_ip(route_address);
    for (const auto& p : device.ports) {
      if (p.active && has_route_gid(p, route)) return p;
    }
  }
  for (const auto& p : device.ports) {
    if (number != 0 ? p.number == number : p.active) {
      if (!p.active) {
        throw Error("pick port", ENETDOWN,
                    fmt::format("device {} port {} is {}, not ACTIVE", device.name, p.number, p.state),
                    "bring the link up (ip link set DEV up) and check the cable or the switch port");
      }
      return p;
    }
  }
  if (number != 0) {
    throw Error("pick port", ENODEV,
                fmt::format("device {} has no port {} (it has {})", device.name, number,
                            device.ports.size()));
  }
  throw Error("pick port", ENETDOWN, fmt::format("device {} has no ACTIVE port", device.name),
              "bring the link up (ip link set DEV up) and check the cable or the switch port");
}

GidSelector GidSelector::parse(const std::string& text) {
  GidSelector s;
  if (text.empty()) return s;
  if (std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
      text.size() <= 5) {
    s.index = static_cast<std::uint32_t>(std::stoul(text));
    return s;
  }
  if (!detail::parse_ip16(text)) {
    throw Error("parse --gid", EINVAL,
                fmt::format("'{}' is neither a GID index nor an IPv4/IPv6 address", text));
  }
  s.address = text;
  return s;
}

namespace {

// Lower is better. RoCE v2 is routable (UDP/IP) and what modern fabrics run; an IPv4 GID of it is
// what most RoCE networks are configured for, so it comes first. Link-local GIDs only work on one
// L2 segment, and RoCE v1 not across IP routers at all.
int rank(const GidEntry& e) {
  const GidKind k = e.kind();
  switch (e.type) {
    case GidType::roce_v2:
      return k == GidKind::ipv4_mapped ? 0 : k == GidKind::ipv6 ? 1 : 4;
    case GidType::roce_v1:
      return k == GidKind::ipv4_mapped ? 2 : k == GidKind::ipv6 ? 3 : 5;
    case GidType::ib:
      return 6;
  }
  return 7;
}

const char* rank_reason(int r) {
  switch (r) {
    case 0: return "RoCE v2 with an IPv4 address (first priority)";
    case 1: return "RoCE v2 with a routable IPv6 address (no RoCE v2 IPv4 GID)";
    case 2: return "RoCE v1 IPv4 (no RoCE v2 GID)";
    case 3: return "RoCE v1 IPv6 (no RoCE v2 GID)";
    case 4: return "RoCE v2 link-local (no routable GID; works on one L2 segment only)";
    case 5: return "RoCE v1 link-local (no routable GID; works on one L2 segment only)";
    default: return "InfiniBand GID";
  }
}

std::string table_text(std::span<const GidEntry> table) {
  std::string s;
  for (const auto& e : table) {
    s += fmt::format("{}[{}] {} {}", s.empty() ? "" : ", ", e.index, to_string(e.type), e.address());
  }
  return s.empty() ? "empty" : s;
}

}  // namespace

GidChoice choose_gid(std::span<const GidEntry> table, const GidSelector& selector,
                     std::string_view route_address) {
  if (selector.index) {
    for (const auto& e : table) {
      if (e.index == *selector.index) {
        return {e, fmt::format("index {} requested", e.index)};
      }
    }
    throw Error("choose GID", EINVAL,
                fmt::format("GID index {} is not a valid entry; the table has: {}", *selector.index,
                            table_text(table)));
  }
  if (!selector.address.empty()) {
    const auto want = detail::parse_ip16(selector.address);
    const GidEntry* best = nullptr;
    for (const auto& e : table) {
      if (want && e.gid == *want && (best == nullptr || rank(e) < rank(*best))) best = &e;
    }
    if (best == nullptr) {
      throw Error("choose GID", EADDRNOTAVAIL,
                  fmt::format("no GID has address {}; the table has: {}", selector.address,
                              table_text(table)),
                  "is the address configured on the RDMA device's netdev?");
    }
    return {*best, fmt::format("address {} requested ({})", selector.address, to_string(best->type))};
  }
  // The entry with the route's local address (the bootstrap socket's own address, or the source
  // address the CM resolved) is on the interface the kernel's route picked for the peer (rdma_cm
  // chooses the same way); RoCE v2 before v1.
  if (const auto route = route_ip(route_address)) {
    const GidEntry* best = nullptr;
    for (const auto& e : table) {
      if (e.gid == *route && (best == nullptr || rank(e) < rank(*best))) best = &e;
    }
    if (best != nullptr) {
      return {*best, fmt::format("the local address of the route to the peer, {} ({})",
                                 route_address, to_string(best->type))};
    }
  }
  const GidEntry* best = nullptr;
  for (const auto& e : table) {
    // An all-zero GID is an unused slot some providers still report.
    if (std::all_of(e.gid.begin(), e.gid.end(), [](auto b) { return b == 0; })) continue;
    if (best == nullptr || rank(e) < rank(*best)) best = &e;
  }
  if (best == nullptr) {
    throw Error("choose GID", EADDRNOTAVAIL, "the port's GID table has no valid entry",
                "on RoCE, give the netdev an IP address (GIDs follow the netdev's addresses)");
  }
  if (!route_address.empty()) {
    return {*best, fmt::format("{}; no GID has the route's local address {}",
                               rank_reason(rank(*best)), route_address)};
  }
  return {*best, rank_reason(rank(*best))};
}

}  // namespace rdmakit
