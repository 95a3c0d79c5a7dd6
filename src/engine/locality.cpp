// Locality (locality.hpp).
#include "engine/locality.hpp"

#include <sys/syscall.h>
#include <unistd.h>

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

std::vector<DeviceRank> rank_devices(const std::vector<std::shared_ptr<Device>>& devices, int node) {
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
