// SPDX-License-Identifier: Apache-2.0
#include "verbs/netdev.hpp"

#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

namespace rdmakit::detail {

namespace fs = std::filesystem;

namespace {

// The port a netdev's dev_port names (dev_port + 1; 1 when it has none or it is unreadable).
std::uint8_t port_of(const fs::path& netdev) {
  std::ifstream f(netdev / "dev_port");
  unsigned v = 0;
  if (!(f >> v) || v > 254) return 1;
  return static_cast<std::uint8_t>(v + 1);
}

}  // namespace

std::string netdev_with_address(const Ip16& address) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return {};
  const std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> keep(list, freeifaddrs);
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_name == nullptr) continue;
    Ip16 mine{};
    if (a->ifa_addr->sa_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      mine[10] = mine[11] = 0xff;
      std::memcpy(mine.data() + 12, &in->sin_addr, 4);
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr);
      std::memcpy(mine.data(), &in6->sin6_addr, 16);
    } else {
      continue;
    }
    if (mine == address) return a->ifa_name;
  }
  return {};
}

std::vector<NetdevRdma> rdma_of_netdev(const std::string& ifname, const std::string& sysfs) {
  std::vector<NetdevRdma> out;
  if (ifname.empty() || ifname.find('/') != std::string::npos) return out;
  const fs::path netdev = fs::path(sysfs) / "class/net" / ifname;
  std::error_code ec;
  const fs::path ib = netdev / "device/infiniband";
  if (!fs::is_directory(ib, ec)) return out;
  const std::uint8_t port = port_of(netdev);
  for (const auto& e : fs::directory_iterator(ib, ec)) out.push_back({e.path().filename().string(), port});
  std::sort(out.begin(), out.end(), [](const NetdevRdma& a, const NetdevRdma& b) { return a.device < b.device; });
  return out;
}

std::map<std::uint8_t, std::string> netdevs_by_port(const std::string& ibdev_path, const std::string& sysfs) {
  std::map<std::uint8_t, std::string> out;
  std::error_code ec;
  const fs::path net = fs::path(ibdev_path) / "device/net";
  if (!fs::is_directory(net, ec)) return out;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(net, ec)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) {
    // The class entry has dev_port (the device's own directory has it too, but through the
    // class link it is the netdev's for certain).
    out.emplace(port_of(fs::path(sysfs) / "class/net" / n), n);
  }
  return out;
}

}  // namespace rdmakit::detail
