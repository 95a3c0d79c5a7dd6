// SPDX-License-Identifier: Apache-2.0
#pragma once
// CUDA memory, through the driver API loaded at run time (dlopen of libcuda.so.1): the library and
// the tool build and run on machines without CUDA, and say so clearly when asked for GPU memory.
//
// Every driver call is made with the device's primary context pushed for the call and popped
// after it, so the memory works from any thread (a listener's Setup allocates it, the
// application's thread stages copies) and the caller's own current context is never changed.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "verbs/memory_impl.hpp"

namespace rdmakit::detail {

// The driver API's types and constants as this layer uses them; cuda_abi_check.cpp compares them
// with cuda.h wherever the toolkit is installed.
namespace cuda {
using Result = int;
using Device = int;
using Context = void*;
using DevicePtr = unsigned long long;
inline constexpr Result kSuccess = 0;
inline constexpr int kRangeHandleDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
inline constexpr unsigned kHostAllocPortable = 1;  // CU_MEMHOSTALLOC_PORTABLE
inline constexpr int kPointerMemoryType = 2;        // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
inline constexpr int kPointerDeviceOrdinal = 9;     // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
inline constexpr int kPointerRangeStart = 11;       // CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
inline constexpr int kPointerRangeSize = 12;        // CU_POINTER_ATTRIBUTE_RANGE_SIZE
inline constexpr unsigned kMemoryTypeDevice = 2;    // CU_MEMORYTYPE_DEVICE
}  // namespace cuda

class CudaApi;

/// GPU memory (cuMemAlloc) or pinned host memory (cuMemHostAlloc) of one device, zeroed like
/// host memory is (a region peers may read must not show them stale GPU memory).
class CudaMemory {
 public:
  static CudaMemory device(int gpu, std::size_t length);
  static CudaMemory host(int gpu, std::size_t length);
  CudaMemory(CudaMemory&&) noexcept;
  CudaMemory& operator=(CudaMemory&&) = delete;
  ~CudaMemory();

  /// The device pointer (device memory) or the host pointer (pinned memory).
  [[nodiscard]] cuda::DevicePtr device_ptr() const noexcept { return dptr_; }
  [[nodiscard]] void* host_ptr() const noexcept { return host_; }
  [[nodiscard]] std::size_t length() const noexcept { return length_; }
  /// Exports the whole allocation as a dma-buf (its length rounded up to whole pages, as the
  /// driver requires; the allocation covers them). Returns the fd (owned by this object), or -1
  /// with the reason in `why`.
  int export_dmabuf(std::string& why);
  /// Copies between the memory and host memory at the same offsets. Throws Error.
  void to_host(void* dst, std::size_t offset, std::size_t length) const;
  void from_host(const void* src, std::size_t offset, std::size_t length);

 private:
  CudaMemory(int gpu, std::size_t length);
  std::unique_ptr<CudaApi> api_;
  cuda::Device device_ = 0;
  cuda::Context ctx_ = nullptr;
  cuda::DevicePtr dptr_ = 0;
  void* host_ = nullptr;
  std::size_t length_ = 0;
  std::size_t allocated_ = 0;  // length_ rounded up to whole pages
  int dmabuf_fd_ = -1;
};

/// CUDA device `gpu`'s PCI bus id ("0000:3b:00.0"), or empty when there is no driver, no such
/// device, or the driver cannot say (locality uses it; nothing fails without it).
[[nodiscard]] std::string cuda_pci_bus_id(int gpu) noexcept;

/// Caller-owned GPU memory, as the driver describes an address the CPU cannot reach.
struct CudaPointer {
  int gpu = -1;               // the CUDA device ordinal
  cuda::DevicePtr base = 0;   // the allocation that holds it (0, 0: the driver did not say)
  std::size_t size = 0;
};
/// What the driver says of `addr`: GPU memory, of which device and in which allocation; nullopt
/// when there is no driver or it is not device memory. Never throws.
[[nodiscard]] std::optional<CudaPointer> cuda_pointer(const void* addr) noexcept;

/// A dma-buf of the whole pages of caller-owned GPU memory around [addr, +length): one export,
/// which every device registers from. fd -1, and `why`, when the driver cannot export it.
class CudaRangeExport {
 public:
  CudaRangeExport(const void* addr, std::size_t length, const CudaPointer& where);
  CudaRangeExport(const CudaRangeExport&) = delete;
  CudaRangeExport& operator=(const CudaRangeExport&) = delete;
  ~CudaRangeExport();
  [[nodiscard]] int fd() const noexcept { return fd_; }
  /// Where addr lies in the dma-buf.
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] const std::string& why() const noexcept { return why_; }

 private:
  int fd_ = -1;
  std::uint64_t offset_ = 0;
  std::string why_;
};

/// Registers caller-owned GPU memory [addr, +length) of CUDA device `gpu` on `dev`: from
/// `dmabuf` where the device takes dma-buf MRs (no nvidia-peermem needed), else by its device
/// pointer (what nvidia-peermem makes work). Throws Error naming both refusals. No bounce path:
/// the memory is the caller's, and a copy would not be what the caller's kernels see.
std::unique_ptr<MemoryRegion::Impl> register_gpu(std::shared_ptr<DeviceResources> dev, void* addr, std::size_t length,
                                                 Access access, const CudaRangeExport& dmabuf, int gpu);

/// Throws Error (ENODEV) when there is no CUDA driver, or no device `gpu`.
void check_cuda(int gpu);

/// cuda: device memory registered via its dma-buf, else the device pointer (nvidia-peermem),
/// else a host bounce buffer with cuMemcpy staging; cuda_host: cuMemHostAlloc'd memory.
std::unique_ptr<MemoryRegion::Impl> allocate_cuda(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                  Access access, const MemorySpec& spec);

}  // namespace rdmakit::detail
