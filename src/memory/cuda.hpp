#pragma once
// CUDA memory, through the driver API loaded at run time (dlopen of libcuda.so.1): the library and
// the tool build and run on machines without CUDA, and say so clearly when asked for GPU memory.
//
// Every driver call is made with the device's primary context pushed for the call and popped
// after it, so the memory works from any thread (a listener's Setup allocates it, the
// application's thread stages copies) and the caller's own current context is never changed.

#include <cstddef>
#include <memory>
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

/// Throws Error (ENODEV) when there is no CUDA driver, or no device `gpu`.
void check_cuda(int gpu);

/// cuda: device memory registered via its dma-buf, else the device pointer (nvidia-peermem),
/// else a host bounce buffer with cuMemcpy staging; cuda_host: cuMemHostAlloc'd memory.
std::unique_ptr<MemoryRegion::Impl> allocate_cuda(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                  Access access, const MemorySpec& spec);

}  // namespace rdmakit::detail
