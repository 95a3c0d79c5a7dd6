// SPDX-License-Identifier: Apache-2.0
#pragma once
// Netdevs and RDMA devices: which netdev has an address, and which RDMA device (and port) a
// netdev belongs to, read from sysfs. RoCE ports name their netdev in each GID entry; an
// InfiniBand port's IPoIB netdev (ib0, a P_Key child ib0.8001) appears in no GID, and is known
// only as a netdev of the same PCI function (/sys/class/net/IF/device/infiniband/DEV) whose
// dev_port is the port's number less one.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/ipaddr.hpp"

namespace rdmakit::detail {

/// The netdev that holds `address` (getifaddrs; an IPv4 address as ::ffff:a.b.c.d), or empty.
[[nodiscard]] std::string netdev_with_address(const Ip16& address);

/// An RDMA device a netdev belongs to, and the port (1-based) its dev_port names.
struct NetdevRdma {
  std::string device;
  std::uint8_t port = 1;
};

/// The RDMA devices of netdev `ifname`'s own PCI function, as `sysfs`/class/net/IF/device/
/// infiniband lists them (none for a netdev without a device, a virtual one, or a NIC without
/// RDMA), each with the port its dev_port names. (`sysfs`: "/sys", or a tree laid out as it.)
[[nodiscard]] std::vector<NetdevRdma> rdma_of_netdev(const std::string& ifname, const std::string& sysfs = "/sys");

/// The netdevs of an RDMA device's PCI function by port (its dev_port + 1), from
/// `ibdev_path`/device/net (ibv_device::ibdev_path, or a tree laid out as sysfs): an IB port's
/// IPoIB netdev. The lowest-named netdev per port (ib0 before ib0.8001).
[[nodiscard]] std::map<std::uint8_t, std::string> netdevs_by_port(const std::string& ibdev_path,
                                                                  const std::string& sysfs = "/sys");

}  // namespace rdmakit::detail
