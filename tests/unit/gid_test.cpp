// SPDX-License-Identifier: Apache-2.0
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/ipaddr.hpp"
#include "rdmakit/device.hpp"
#include "rdmakit/error.hpp"
#include "verbs/netdev.hpp"

namespace {

using rdmakit::GidEntry;
using rdmakit::GidKind;
using rdmakit::GidSelector;
using rdmakit::GidType;

GidEntry entry(std::uint32_t index, GidType type, const std::string& addr) {
  auto ip = rdmakit::detail::parse_ip16(addr);
  EXPECT_TRUE(ip.has_value()) << addr;
  return {index, type, ip.value_or(rdmakit::Gid{}), "eth0"};
}

GidEntry zero(std::uint32_t index) { return {index, GidType::roce_v2, {}, "eth0"}; }

std::uint32_t chosen(const std::vector<GidEntry>& t, const std::string& sel = "") {
  return rdmakit::choose_gid(t, GidSelector::parse(sel)).entry.index;
}

TEST(GidKind, Classifies) {
  EXPECT_EQ(entry(0, GidType::roce_v2, "198.18.0.1").kind(), GidKind::ipv4_mapped);
  EXPECT_EQ(entry(0, GidType::roce_v2, "fe80::1").kind(), GidKind::ipv6_link_local);
  EXPECT_EQ(entry(0, GidType::roce_v2, "2001:db8::1").kind(), GidKind::ipv6);
  EXPECT_EQ(entry(0, GidType::roce_v2, "198.18.0.1").address(), "::ffff:198.18.0.1");
}

TEST(ChooseGid, RxeTablePicksRoceV2Ipv4) {
  // What rxe shows in the lab: link-local RoCE v2 at 0, IPv4-mapped RoCE v2 at 1.
  const std::vector<GidEntry> t = {entry(0, GidType::roce_v2, "fe80::5054:ff:fe4c:ab01"),
                                   entry(1, GidType::roce_v2, "198.18.0.1")};
  const auto c = rdmakit::choose_gid(t, {});
  EXPECT_EQ(c.entry.index, 1u);
  EXPECT_NE(c.reason.find("RoCE v2 with an IPv4 address"), std::string::npos) << c.reason;
}

TEST(ChooseGid, Mlx5TableWithV1AndV2) {
  // mlx5 lists each address twice, RoCE v1 then v2, link-local first.
  const std::vector<GidEntry> t = {
      entry(0, GidType::roce_v1, "fe80::1"),      entry(1, GidType::roce_v2, "fe80::1"),
      entry(2, GidType::roce_v1, "2001:db8::5"),  entry(3, GidType::roce_v2, "2001:db8::5"),
      entry(4, GidType::roce_v1, "10.1.2.3"),     entry(5, GidType::roce_v2, "10.1.2.3")};
  EXPECT_EQ(chosen(t), 5u);
  // Without an IPv4 RoCE v2 GID, routable IPv6 RoCE v2 wins over everything else.
  EXPECT_EQ(chosen({t[0], t[1], t[2], t[3], t[4]}), 3u);
  // Only v1 and link-local left: RoCE v1 IPv4 before any link-local.
  EXPECT_EQ(chosen({t[0], t[1], t[4]}), 4u);
  // Only link-local: RoCE v2 before v1.
  EXPECT_EQ(chosen({t[0], t[1]}), 1u);
}

TEST(ChooseGid, SkipsZeroEntriesAndRefusesEmptyTables) {
  EXPECT_EQ(chosen({zero(0), entry(3, GidType::roce_v2, "fe80::2")}), 3u);
  EXPECT_THROW((void)rdmakit::choose_gid(std::vector<GidEntry>{zero(0)}, {}), rdmakit::Error);
  EXPECT_THROW((void)rdmakit::choose_gid(std::vector<GidEntry>{}, {}), rdmakit::Error);
}

TEST(ChooseGid, InfinibandTable) {
  const std::vector<GidEntry> t = {entry(0, GidType::ib, "fe80::2:c903:a:1234")};
  EXPECT_EQ(chosen(t), 0u);
}

TEST(ChooseGid, OverrideByIndexOrAddress) {
  const std::vector<GidEntry> t = {entry(0, GidType::roce_v2, "fe80::1"),
                                   entry(1, GidType::roce_v1, "10.1.2.3"),
                                   entry(2, GidType::roce_v2, "10.1.2.3")};
  EXPECT_EQ(chosen(t, "0"), 0u);
  EXPECT_EQ(chosen(t, "10.1.2.3"), 2u);  // the same address as v1 and v2: v2 preferred
  EXPECT_EQ(chosen(t, "fe80::1"), 0u);
  try {
    (void)chosen(t, "9");
    ADD_FAILURE() << "index 9 accepted";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[2] RoCE v2 ::ffff:10.1.2.3"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)chosen(t, "10.9.9.9"), rdmakit::Error);
  EXPECT_THROW((void)GidSelector::parse("not-an-address"), rdmakit::Error);
}

}  // namespace

namespace {

// The route: the entry with the bootstrap socket's own address wins over the priority order,
// RoCE v2 over v1 for the same address; an explicit selector still wins over the route.
TEST(ChooseGid, FollowsTheBootstrapRoute) {
  const std::vector<GidEntry> t = {entry(0, GidType::roce_v2, "fe80::1"), entry(1, GidType::roce_v2, "198.18.0.1"),
                                   entry(2, GidType::roce_v1, "10.0.0.5"), entry(3, GidType::roce_v2, "10.0.0.5"),
                                   entry(4, GidType::roce_v2, "2001:db8::5")};
  const auto c = rdmakit::choose_gid(t, {}, "10.0.0.5");
  EXPECT_EQ(c.entry.index, 3u);
  EXPECT_EQ(c.reason, "the local address of the route to the peer, 10.0.0.5 (RoCE v2)");
  EXPECT_EQ(rdmakit::choose_gid(t, {}, "2001:db8::5").entry.index, 4u);
  // An IPv4 client of a dual-stack listener shows as ::ffff:a.b.c.d; that is the same GID.
  EXPECT_EQ(rdmakit::choose_gid(t, {}, "::ffff:10.0.0.5").entry.index, 3u);
  // No GID has the address (loopback): the priority order, and the reason says why.
  const auto lo = rdmakit::choose_gid(t, {}, "127.0.0.1");
  EXPECT_EQ(lo.entry.index, 1u);
  EXPECT_NE(lo.reason.find("no GID has the route's local address 127.0.0.1"), std::string::npos)
      << lo.reason;
  // Configured beats routed.
  EXPECT_EQ(rdmakit::choose_gid(t, GidSelector::parse("1"), "10.0.0.5").entry.index, 1u);
  EXPECT_EQ(rdmakit::choose_gid(t, GidSelector::parse("198.18.0.1"), "10.0.0.5").entry.index, 1u);
}

// The device and port follow the route too, when none is configured.
TEST(PickDevice, FollowsTheBootstrapRoute) {
  rdmakit::PortInfo up1;
  up1.number = 1;
  up1.active = true;
  up1.gids = {entry(1, GidType::roce_v2, "198.18.0.1")};
  rdmakit::PortInfo up2 = up1;
  up2.number = 2;
  up2.gids = {entry(1, GidType::roce_v2, "198.18.1.1")};
  rdmakit::DeviceInfo a, b;
  a.name = "mlx5_0";
  b.name = "mlx5_1";
  a.ports = {up1};
  b.ports = {up1, up2};
  b.ports[0].gids = {entry(1, GidType::roce_v2, "198.18.2.1")};
  const std::vector<rdmakit::DeviceInfo> devices = {a, b};
  EXPECT_EQ(rdmakit::pick_device(devices, "").name, "mlx5_0");  // the first ACTIVE one
  EXPECT_EQ(rdmakit::pick_device(devices, "", "198.18.1.1").name, "mlx5_1");
  EXPECT_EQ(rdmakit::pick_port(devices[1], 0, "198.18.1.1").number, 2);
  EXPECT_EQ(rdmakit::pick_port(devices[1], 0).number, 1);
  EXPECT_EQ(rdmakit::pick_device(devices, "mlx5_0", "198.18.1.1").name, "mlx5_0");  // configured wins
  // Each choice says which rule made it.
  EXPECT_NE(rdmakit::choose_device(devices, "", "198.18.1.1").reason.find("port 2 has a GID with the route's local "
                                                                          "address 198.18.1.1"),
            std::string::npos);
  EXPECT_EQ(rdmakit::choose_device(devices, "", "198.18.1.1").port, 2);
  EXPECT_EQ(rdmakit::choose_device(devices, "mlx5_1", "198.18.1.1").reason, "named (the configuration's device)");
  // An address no netdev here has: the first ACTIVE device, and why the route named none.
  const auto none = rdmakit::choose_device(devices, "", "203.0.113.77");
  EXPECT_EQ(none.device->name, "mlx5_0");
  EXPECT_NE(none.reason.find("the first device with an ACTIVE port; no netdev here has the route's local address "
                             "203.0.113.77"),
            std::string::npos)
      << none.reason;
}

// InfiniBand: the route's address is on a netdev (IPoIB), in no GID. The port whose netdev that
// is wins over the first ACTIVE device; here the loopback netdev stands in for ib0 (every host
// has 127.0.0.1 on lo), the port being the second device's second.
TEST(PickDevice, AnAddressInNoGidFollowsItsNetdev) {
  rdmakit::PortInfo p1;
  p1.number = 1;
  p1.active = true;
  p1.link_layer = rdmakit::LinkLayer::infiniband;
  p1.gids = {{0, GidType::ib, rdmakit::Gid{0xfe, 0x80}, ""}};
  rdmakit::DeviceInfo a, b;
  a.name = "mlx5_0";
  a.ports = {p1};
  a.ports[0].netdev = "ib0";
  b.name = "mlx5_1";
  b.ports = {p1, p1};
  b.ports[0].netdev = "ib1";
  b.ports[1].number = 2;
  b.ports[1].netdev = "lo";
  std::vector<rdmakit::DeviceInfo> devices = {a, b};  // the choice points into it
  const auto c = rdmakit::choose_device(devices, "", "127.0.0.1");
  EXPECT_EQ(c.device->name, "mlx5_1");
  EXPECT_EQ(c.port, 2);
  EXPECT_EQ(c.reason, "the route's local address 127.0.0.1 is on lo, port 2's netdev");
  // No device's port is lo: the first ACTIVE one, naming the netdev the route took.
  devices[1].ports[1].netdev = "ib2";
  const auto d = rdmakit::choose_device(devices, "", "127.0.0.1");
  EXPECT_EQ(d.device->name, "mlx5_0");
  EXPECT_NE(d.reason.find("the route's local address 127.0.0.1 is on lo, which is no RDMA device's"),
            std::string::npos)
      << d.reason;
}

// sysfs as an IB host lays it out: ib0 and its P_Key child on port 1 of mlx5_0's PCI function,
// ib1 on port 2; eth0 (a NIC without RDMA) has no infiniband directory.
TEST(Netdev, SysfsMapsIpoibNetdevsToTheirDeviceAndPort) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / fmt::format("rdmakit-sysfs-{}", ::getpid());
  fs::remove_all(root);
  const fs::path pci = root / "devices/pci0000:00/0000:3b:00.0";
  fs::create_directories(pci / "infiniband/mlx5_0");
  fs::create_directories(root / "devices/pci0000:00/0000:01:00.0");
  fs::create_directories(root / "class/net");
  fs::create_directories(root / "class/infiniband");
  const auto netdev = [&](const std::string& name, const fs::path& dev, int dev_port) {
    const fs::path d = root / "devices/virtual-net" / name;
    fs::create_directories(d);
    fs::create_directory_symlink(dev, d / "device");
    std::ofstream(d / "dev_port") << dev_port << "\n";
    fs::create_directory_symlink(d, root / "class/net" / name);
    if (fs::exists(dev / "infiniband")) {
      fs::create_directories(dev / "net");
      fs::create_directory_symlink(d, dev / "net" / name);
    }
  };
  netdev("ib0", pci, 0);
  netdev("ib0.8001", pci, 0);
  netdev("ib1", pci, 1);
  netdev("eth0", root / "devices/pci0000:00/0000:01:00.0", 0);
  fs::create_directory_symlink(pci / "infiniband/mlx5_0", root / "class/infiniband/mlx5_0");
  fs::create_directory_symlink(pci, pci / "infiniband/mlx5_0/device");

  using rdmakit::detail::rdma_of_netdev;
  const auto ib1 = rdma_of_netdev("ib1", root.string());
  ASSERT_EQ(ib1.size(), 1u);
  EXPECT_EQ(ib1[0].device, "mlx5_0");
  EXPECT_EQ(ib1[0].port, 2);
  const auto child = rdma_of_netdev("ib0.8001", root.string());
  ASSERT_EQ(child.size(), 1u);
  EXPECT_EQ(child[0].port, 1);
  EXPECT_TRUE(rdma_of_netdev("eth0", root.string()).empty());
  EXPECT_TRUE(rdma_of_netdev("nosuch", root.string()).empty());
  EXPECT_TRUE(rdma_of_netdev("../../etc", root.string()).empty());
  const auto ports = rdmakit::detail::netdevs_by_port((root / "class/infiniband/mlx5_0").string(), root.string());
  ASSERT_EQ(ports.size(), 2u);
  EXPECT_EQ(ports.at(1), "ib0");  // before its child
  EXPECT_EQ(ports.at(2), "ib1");
  fs::remove_all(root);
}

}  // namespace
