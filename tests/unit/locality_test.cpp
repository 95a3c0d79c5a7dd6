// SPDX-License-Identifier: Apache-2.0
// Locality (src/engine/locality.hpp): PCIe distance between sysfs paths, and a host buffer's NUMA
// node as the kernel reports it.
#include <cstdlib>
#include <vector>

#include <gtest/gtest.h>

#include "engine/locality.hpp"

namespace {

using rdmakit::detail::pcie_distance;

constexpr const char* kRoot0 = "/sys/devices/pci0000:00";
constexpr const char* kRoot1 = "/sys/devices/pci0000:80";

std::string path(const char* root, std::initializer_list<const char*> hops) {
  std::string p = root;
  for (const char* h : hops) p += std::string("/") + h;
  return p;
}

}  // namespace

TEST(Locality, PcieDistanceCountsTheHopsBelowTheDeepestCommonBridge) {
  // A GPU and a NIC behind one PCIe switch (a downstream port each).
  const std::string gpu = path(kRoot0, {"0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"});
  const std::string near = path(kRoot0, {"0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"});
  // A NIC on another port of the same root complex, and one on another root complex (socket).
  const std::string same_root = path(kRoot0, {"0000:00:02.0", "0000:05:00.0"});
  const std::string other_root = path(kRoot1, {"0000:80:01.0", "0000:81:00.0"});
  EXPECT_EQ(pcie_distance(gpu, near), 4);
  EXPECT_EQ(pcie_distance(gpu, same_root), 6);
  EXPECT_EQ(pcie_distance(gpu, other_root), 8);
  EXPECT_LT(pcie_distance(gpu, near), pcie_distance(gpu, same_root));
  EXPECT_LT(pcie_distance(gpu, same_root), pcie_distance(gpu, other_root));
  EXPECT_EQ(pcie_distance(gpu, gpu), 0);
  EXPECT_EQ(pcie_distance(gpu, ""), -1);  // a NIC with no PCI parent (rxe)
  EXPECT_EQ(pcie_distance("", near), -1);
}

TEST(Locality, AHostBuffersNumaNodeIsTheKernels) {
  std::vector<char> mem(1 << 16, 1);
  const int node = rdmakit::detail::memory_numa_node(mem.data());
  EXPECT_GE(node, 0) << "get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR) on a touched page";
  EXPECT_EQ(rdmakit::detail::memory_numa_node(reinterpret_cast<void*>(8)), -1) << "an address with no page";
}
