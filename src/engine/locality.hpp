#pragma once
// Locality: which devices a buffer's transfers prefer. Host memory is ranked by NUMA node: the
// devices on the node that holds the buffer's pages first, then the others; where either node is
// unknown (a software device, GPU memory, a one-node host) every device ranks the same.

#include <memory>
#include <vector>

#include "rdmakit/engine.hpp"
#include "verbs/device_layer.hpp"

namespace rdmakit::detail {

/// The NUMA node of the page at `addr` (faulting it in, as a read would); -1 when the kernel does
/// not say (no NUMA, not host memory).
[[nodiscard]] int memory_numa_node(const void* addr) noexcept;

/// Every device's rank for memory on NUMA node `node` (-1: unknown), in device order.
[[nodiscard]] std::vector<DeviceRank> rank_devices(const std::vector<std::shared_ptr<Device>>& devices, int node);

}  // namespace rdmakit::detail
