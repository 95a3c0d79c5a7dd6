// SPDX-License-Identifier: Apache-2.0
#pragma once
// Locality: which devices a buffer's transfers prefer. GPU memory is ranked by PCIe distance
// between the GPU and each NIC (the bridges between them in sysfs: a NIC behind the GPU's own
// switch first); host memory by NUMA node (the devices on the node that holds its pages first).
// Where that is unknown (a software device, a one-node host) every device ranks the same.

#include <memory>
#include <string>
#include <vector>

#include "rdmakit/engine.hpp"
#include "verbs/device_layer.hpp"

namespace rdmakit::detail {

/// The NUMA node of the page at `addr` (faulting it in, as a read would); -1 when the kernel does
/// not say (no NUMA, not host memory).
[[nodiscard]] int memory_numa_node(const void* addr) noexcept;

/// Every device's rank, in device order: with `gpu_pci` (the GPU's resolved sysfs path) by PCIe
/// distance, else for memory on NUMA node `node` (-1: unknown).
[[nodiscard]] std::vector<DeviceRank> rank_devices(const std::vector<std::shared_ptr<Device>>& devices, int node,
                                                   const std::string& gpu_pci = {});

/// The resolved sysfs path of PCI device `bus_id` ("0000:3b:00.0"), or of an RDMA device's
/// parent (`ib_device`: "mlx5_0"); empty when there is none (rxe has no PCI parent).
[[nodiscard]] std::string pci_path_of_bus(const std::string& bus_id);
[[nodiscard]] std::string pci_path_of_nic(const std::string& ib_device);

/// Hops between two resolved sysfs device paths: the components of each below their deepest
/// common one (2: two functions on one bridge; more: farther apart); -1 when either is empty.
[[nodiscard]] int pcie_distance(const std::string& a, const std::string& b);

}  // namespace rdmakit::detail
