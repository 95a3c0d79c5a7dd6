// SPDX-License-Identifier: Apache-2.0
// Locality (locality.hpp).
#include "engine/locality.hpp"

#include <limits.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

namespace rdmakit::detail {

namespace {

// <numaif.h> is libnuma's; the system call needs none of it.
constexpr int kMpolFNode = 1 << 0;
constexpr int kMpolFAddr = 1 << 1;

}  // namespace

int memory_numa_node(const void* addr) noexcept {
  int node = -1;
  if (::syscall(SYS_get_mempolicy, &node, nullptr, 0, addr, kMpolFNode | kMpolFAddr) != 0) return -1;
  return node;
}

namespace {

std::string resolved(const std::string& path) {
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) != nullptr ? std::string(buf) : std::string{};
}

std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at < path.size()) {
    const std::size_t next = path.find('/', at);
    const std::size_t end = next == std::string::npos ? path.size() : next;
    if (end > at) out.push_back(path.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

}  // namespace

std::string pci_path_of_bus(const std::string& bus_id) {
  return bus_id.empty() ? std::string{} : resolved("/sys/bus/pci/devices/" + bus_id);
}

std::string pci_path_of_nic(const std::string& ib_device) { return resolved("/sys/class/infiniband/" + ib_device + "/device"); }

int pcie_distance(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return -1;
  const auto ca = components(a), cb = components(b);
  std::size_t common = 0;
  while (common < ca.size() && common < cb.size() && ca[common] == cb[common]) ++common;
  return static_cast<int>((ca.size() - common) + (cb.size() - common));
}

std::vector<DeviceRank> rank_devices(const std::vector<std::shared_ptr<Device>>& devices, int node,
                                     const std::string& gpu_pci) {
  if (!gpu_pci.empty()) {
    // By PCIe distance from the GPU: rank 0 for the nearest, 1 for the next distance, ...; a NIC
    // with no PCI parent after all of them.
    std::vector<int> dist;
    for (const auto& d : devices) dist.push_back(pcie_distance(gpu_pci, pci_path_of_nic(d->name())));
    std::vector<int> known;
    for (int v : dist) {
      if (v >= 0 && std::find(known.begin(), known.end(), v) == known.end()) known.push_back(v);
    }
    std::sort(known.begin(), known.end());
    std::vector<DeviceRank> out;
    for (std::size_t i = 0; i < devices.size(); ++i) {
      DeviceRank r;
      r.device = devices[i]->name();
      r.numa_node = devices[i]->info().numa_node;
      if (dist[i] < 0) {
        r.rank = static_cast<int>(known.size());
        r.why = fmt::format("{} has no PCI parent: after every NIC the GPU reaches over PCIe", r.device);
      } else {
        r.rank = static_cast<int>(std::find(known.begin(), known.end(), dist[i]) - known.begin());
        r.why = fmt::format("{} hops over PCIe from the GPU at {}", dist[i], gpu_pci);
      }
      out.push_back(std::move(r));
    }
    return out;
  }
  std::vector<DeviceRank> out;
  for (const auto& d : devices) {
    const int dev_node = d->info().numa_node;
    DeviceRank r;
    r.device = d->name();
    r.numa_node = dev_node;
    if (node < 0) {
      r.why = "the buffer's NUMA node is not known (not host memory, or no NUMA)";
    } else if (dev_node < 0) {
      r.why = fmt::format("{} has no NUMA affinity (a software device, or none reported)", d->name());
    } else if (dev_node == node) {
      r.why = fmt::format("on NUMA node {}, the buffer's", node);
    } else {
      r.rank = 1;
      r.why = fmt::format("on NUMA node {}; the buffer's pages are on {}", dev_node, node);
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace rdmakit::detail
