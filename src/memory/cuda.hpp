#pragma once
// CUDA memory, through the driver API loaded at run time (dlopen of libcuda.so.1): the library and
// the tool build and run on machines without CUDA, and say so clearly when asked for GPU memory.

#include <cstddef>
#include <memory>

#include "verbs/memory_impl.hpp"

namespace rdmakit::detail {

/// Throws Error (ENODEV) when there is no CUDA driver, or no device `gpu`.
void check_cuda(int gpu);

/// cuda: device memory registered via its dma-buf, else the device pointer (nvidia-peermem),
/// else a host bounce buffer with cuMemcpy staging; cuda_host: cuMemHostAlloc'd memory.
std::unique_ptr<MemoryRegion::Impl> allocate_cuda(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                  Access access, const MemorySpec& spec);

// The driver API's types and constants as this file uses them; cuda_abi_check.cpp compares them
// with cuda.h wherever the toolkit is installed.
namespace cuda {
using Result = int;
using Device = int;
using Context = void*;
using DevicePtr = unsigned long long;
inline constexpr Result kSuccess = 0;
inline constexpr int kRangeHandleDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
inline constexpr unsigned kHostAllocPortable = 1;  // CU_MEMHOSTALLOC_PORTABLE
}  // namespace cuda

}  // namespace rdmakit::detail
