// SPDX-License-Identifier: Apache-2.0
#include "memory/cuda.hpp"

#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {

using namespace cuda;

// The driver API, loaded per use (dlopen counts references): no global state.
class CudaApi {
 public:
  CudaApi() {
    lib_ = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) {
      throw Error("CUDA", ENODEV,
                  fmt::format("no CUDA device: the NVIDIA driver (libcuda.so.1) is not installed ({})", ::dlerror()),
                  "GPU memory needs an NVIDIA GPU and its driver; use host memory here");
    }
    load(init, "cuInit");
    load(device_count, "cuDeviceGetCount");
    load(device_get, "cuDeviceGet");
    load(ctx_retain, "cuDevicePrimaryCtxRetain");
    load(ctx_release, "cuDevicePrimaryCtxRelease_v2");
    load(ctx_push, "cuCtxPushCurrent_v2");
    load(ctx_pop, "cuCtxPopCurrent_v2");
    load(ctx_synchronize, "cuCtxSynchronize");
    load(mem_alloc, "cuMemAlloc_v2");
    load(mem_free, "cuMemFree_v2");
    load(memset_d8, "cuMemsetD8_v2");
    load(host_alloc, "cuMemHostAlloc");
    load(host_free, "cuMemFreeHost");
    load(dtoh, "cuMemcpyDtoH_v2");
    load(htod, "cuMemcpyHtoD_v2");
    load(error_name, "cuGetErrorName");
    // CUDA 11.7+; older drivers lack it and the dma-buf path is skipped.
    handle_for_range = reinterpret_cast<decltype(handle_for_range)>(::dlsym(lib_, "cuMemGetHandleForAddressRange"));
    pci_bus_id = reinterpret_cast<decltype(pci_bus_id)>(::dlsym(lib_, "cuDeviceGetPCIBusId"));
    pointer_attribute = reinterpret_cast<decltype(pointer_attribute)>(::dlsym(lib_, "cuPointerGetAttribute"));
  }
  CudaApi(const CudaApi&) = delete;
  CudaApi& operator=(const CudaApi&) = delete;
  ~CudaApi() { ::dlclose(lib_); }

  std::string name(Result r) const {
    const char* s = nullptr;
    return error_name != nullptr && error_name(r, &s) == kSuccess && s != nullptr ? s : fmt::format("CUDA error {}", r);
  }
  void check(Result r, const char* what) const {
    if (r != kSuccess) throw Error(what, EIO, name(r));
  }
  void check_device(int gpu) const {
    if (const Result r = init(0); r != kSuccess) {
      throw Error("CUDA", ENODEV, fmt::format("no CUDA device: cuInit failed ({})", name(r)),
                  "is an NVIDIA GPU present and its driver loaded (nvidia-smi)?");
    }
    int n = 0;
    if (device_count(&n) != kSuccess || n == 0) {
      throw Error("CUDA", ENODEV, "no CUDA device: the driver sees no GPU", "use host memory here");
    }
    if (gpu < 0 || gpu >= n) {
      throw Error("CUDA", ENODEV, fmt::format("no CUDA device {}: there are {} (0..{})", gpu, n, n - 1));
    }
  }

  Result (*init)(unsigned) = nullptr;
  Result (*device_count)(int*) = nullptr;
  Result (*device_get)(cuda::Device*, int) = nullptr;
  Result (*ctx_retain)(Context*, cuda::Device) = nullptr;
  Result (*ctx_release)(cuda::Device) = nullptr;
  Result (*ctx_push)(Context) = nullptr;
  Result (*ctx_pop)(Context*) = nullptr;
  Result (*ctx_synchronize)() = nullptr;
  Result (*mem_alloc)(DevicePtr*, std::size_t) = nullptr;
  Result (*mem_free)(DevicePtr) = nullptr;
  Result (*memset_d8)(DevicePtr, unsigned char, std::size_t) = nullptr;
  Result (*host_alloc)(void**, std::size_t, unsigned) = nullptr;
  Result (*host_free)(void*) = nullptr;
  Result (*dtoh)(void*, DevicePtr, std::size_t) = nullptr;
  Result (*htod)(DevicePtr, const void*, std::size_t) = nullptr;
  Result (*error_name)(Result, const char**) = nullptr;
  Result (*handle_for_range)(void*, DevicePtr, std::size_t, int, unsigned long long) = nullptr;
  Result (*pci_bus_id)(char*, int, cuda::Device) = nullptr;  // optional: locality only
  Result (*pointer_attribute)(void*, int, DevicePtr) = nullptr;  // optional: caller-owned GPU memory

 private:
  template <typename F>
  void load(F& f, const char* sym) {
    f = reinterpret_cast<F>(::dlsym(lib_, sym));
    if (f == nullptr) throw Error("CUDA", ENOSYS, fmt::format("libcuda.so.1 has no {}", sym), "the driver is too old");
  }
  void* lib_ = nullptr;
};

namespace {

// The device's context, current on this thread for one scope; whatever was current before is
// current again afterwards.
class Pushed {
 public:
  Pushed(const CudaApi& api, Context ctx) : api_(api) { api_.check(api_.ctx_push(ctx), "cuCtxPushCurrent"); }
  ~Pushed() {
    Context popped = nullptr;
    (void)api_.ctx_pop(&popped);
  }
  Pushed(const Pushed&) = delete;
  Pushed& operator=(const Pushed&) = delete;

 private:
  const CudaApi& api_;
};

std::size_t whole_pages(std::size_t n) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

}  // namespace

std::string cuda_pci_bus_id(int gpu) noexcept {
  try {
    CudaApi api;
    api.check_device(gpu);
    cuda::Device dev = 0;
    char id[32] = {};
    if (api.pci_bus_id == nullptr || api.device_get(&dev, gpu) != kSuccess ||
        api.pci_bus_id(id, static_cast<int>(sizeof id), dev) != kSuccess) {
      return {};
    }
    std::string s(id);
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));  // as sysfs names it
    return s;
  } catch (...) {
    return {};
  }
}

std::optional<CudaPointer> cuda_pointer(const void* addr) noexcept {
  try {
    CudaApi api;
    if (api.pointer_attribute == nullptr || api.init(0) != kSuccess) return std::nullopt;
    const auto p = reinterpret_cast<DevicePtr>(addr);
    unsigned type = 0;
    CudaPointer where;
    if (api.pointer_attribute(&type, kPointerMemoryType, p) != kSuccess || type != kMemoryTypeDevice ||
        api.pointer_attribute(&where.gpu, kPointerDeviceOrdinal, p) != kSuccess) {
      return std::nullopt;
    }
    if (api.pointer_attribute(&where.base, kPointerRangeStart, p) != kSuccess ||
        api.pointer_attribute(&where.size, kPointerRangeSize, p) != kSuccess) {
      where.base = 0;
      where.size = 0;
    }
    return where;
  } catch (...) {
    return std::nullopt;  // no driver
  }
}

CudaRangeExport::CudaRangeExport(const void* addr, std::size_t length, const CudaPointer& where) {
  try {
    CudaApi api;
    if (api.handle_for_range == nullptr) {
      why_ = "the driver has no cuMemGetHandleForAddressRange (CUDA < 11.7)";
      return;
    }
    // The driver exports whole pages; those around the range must lie in its allocation.
    const auto page = static_cast<DevicePtr>(::sysconf(_SC_PAGESIZE));
    const auto p = reinterpret_cast<DevicePtr>(addr);
    const DevicePtr start = p / page * page;
    const DevicePtr end = (p + length + page - 1) / page * page;
    if (where.size != 0 && (start < where.base || end > where.base + where.size)) {
      why_ = fmt::format("the whole pages around it, [{:#x}, {:#x}), pass its allocation [{:#x}, +{})", start, end,
                         where.base, where.size);
      return;
    }
    cuda::Device dev = 0;
    Context ctx = nullptr;
    api.check(api.device_get(&dev, where.gpu), "cuDeviceGet");
    api.check(api.ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    // Released however this scope ends (a push that fails throws).
    const std::unique_ptr<void, std::function<void(void*)>> retained(ctx, [&](void*) { (void)api.ctx_release(dev); });
    Result r = kSuccess;
    {
      const Pushed on(api, ctx);
      r = api.handle_for_range(&fd_, start, static_cast<std::size_t>(end - start), kRangeHandleDmaBufFd, 0);
    }
    if (r != kSuccess || fd_ < 0) {
      fd_ = -1;
      why_ = fmt::format("cuMemGetHandleForAddressRange({} bytes): {}", end - start, api.name(r));
      return;
    }
    offset_ = p - start;
  } catch (const Error& e) {
    why_ = e.what();
  }
}

CudaRangeExport::~CudaRangeExport() {
  if (fd_ >= 0) ::close(fd_);
}

std::unique_ptr<MemoryRegion::Impl> register_gpu(std::shared_ptr<DeviceResources> dev, void* addr, std::size_t length,
                                                 Access access, const CudaRangeExport& dmabuf, int gpu) {
  const unsigned flags = mr_access_flags(access);
  const auto iova = reinterpret_cast<std::uint64_t>(addr);  // peers address it as the caller does
  std::string why = dmabuf.why();
  if (dmabuf.fd() >= 0) {
    errno = 0;
    MrPtr mr(ibv_reg_dmabuf_mr(dev->pd.get(), dmabuf.offset(), length, iova, dmabuf.fd(), static_cast<int>(flags)));
    if (mr) {
      return adopt_mr(std::move(dev), std::move(mr), access, length, nullptr, RegistrationPath::dmabuf_mr,
                      "the caller's GPU memory, exported as a dma-buf (cuMemGetHandleForAddressRange)", nullptr);
    }
    why = dmabuf_mr_refusal(errno);
  }
  errno = 0;
  MrPtr mr(ibv_reg_mr(dev->pd.get(), addr, length, flags));
  if (mr) {
    return adopt_mr(std::move(dev), std::move(mr), access, length, nullptr, RegistrationPath::device_mr,
                    why + "; ibv_reg_mr on the device pointer worked (nvidia-peermem)", nullptr);
  }
  const int err = errno;
  throw Error("register_memory", err,
              fmt::format("{} bytes of GPU memory of CUDA device {} at {} on {}: {}; ibv_reg_mr on the device pointer: {}",
                          length, gpu, addr, ibv_get_device_name(dev->ctx()->device), why, errno_name(err)),
              "the NIC reaches GPU memory through dma-buf (a NIC and kernel that take it: mlx5, Linux 5.12+, CUDA "
              "11.7+ with the open kernel modules) or nvidia-peermem (modprobe nvidia-peermem); rdmakit doctor "
              "checks both");
}

CudaMemory::CudaMemory(int gpu, std::size_t length)
    : api_(std::make_unique<CudaApi>()), length_(length), allocated_(whole_pages(length)) {
  api_->check_device(gpu);
  api_->check(api_->device_get(&device_, gpu), "cuDeviceGet");
  api_->check(api_->ctx_retain(&ctx_, device_), "cuDevicePrimaryCtxRetain");
}

CudaMemory CudaMemory::device(int gpu, std::size_t length) {
  CudaMemory m(gpu, length);
  const Pushed on(*m.api_, m.ctx_);
  m.api_->check(m.api_->mem_alloc(&m.dptr_, m.allocated_), "cuMemAlloc");
  m.api_->check(m.api_->memset_d8(m.dptr_, 0, m.allocated_), "cuMemsetD8");
  m.api_->check(m.api_->ctx_synchronize(), "cuCtxSynchronize");  // the memset is done before use
  return m;
}

CudaMemory CudaMemory::host(int gpu, std::size_t length) {
  CudaMemory m(gpu, length);
  const Pushed on(*m.api_, m.ctx_);
  m.api_->check(m.api_->host_alloc(&m.host_, m.allocated_, kHostAllocPortable), "cuMemHostAlloc");
  std::memset(m.host_, 0, m.allocated_);
  return m;
}

CudaMemory::CudaMemory(CudaMemory&& o) noexcept
    : api_(std::move(o.api_)),
      device_(o.device_),
      ctx_(std::exchange(o.ctx_, nullptr)),
      dptr_(std::exchange(o.dptr_, 0)),
      host_(std::exchange(o.host_, nullptr)),
      length_(o.length_),
      allocated_(o.allocated_),
      dmabuf_fd_(std::exchange(o.dmabuf_fd_, -1)) {}

CudaMemory::~CudaMemory() {
  if (dmabuf_fd_ >= 0) ::close(dmabuf_fd_);
  if (!api_ || ctx_ == nullptr) return;
  try {
    const Pushed on(*api_, ctx_);
    if (dptr_ != 0) (void)api_->mem_free(dptr_);
    if (host_ != nullptr) (void)api_->host_free(host_);
  } catch (const std::exception&) {
    // The context cannot be made current (the driver is failing): the memory goes with it.
  }
  (void)api_->ctx_release(device_);
}

int CudaMemory::export_dmabuf(std::string& why) {
  if (dmabuf_fd_ >= 0) return dmabuf_fd_;
  if (api_->handle_for_range == nullptr) {
    why = "the driver has no cuMemGetHandleForAddressRange (CUDA < 11.7)";
    return -1;
  }
  int fd = -1;
  const Pushed on(*api_, ctx_);
  // The range must be whole pages; the allocation was rounded up so that it is.
  const Result r = api_->handle_for_range(&fd, dptr_, allocated_, kRangeHandleDmaBufFd, 0);
  if (r != kSuccess || fd < 0) {
    why = fmt::format("cuMemGetHandleForAddressRange({} bytes): {}", allocated_, api_->name(r));
    return -1;
  }
  dmabuf_fd_ = fd;
  return fd;
}

void CudaMemory::to_host(void* dst, std::size_t off, std::size_t len) const {
  const Pushed on(*api_, ctx_);
  api_->check(api_->dtoh(static_cast<char*>(dst) + off, dptr_ + off, len), "cuMemcpyDtoH");
}

void CudaMemory::from_host(const void* src, std::size_t off, std::size_t len) {
  const Pushed on(*api_, ctx_);
  api_->check(api_->htod(dptr_ + off, static_cast<const char*>(src) + off, len), "cuMemcpyHtoD");
}

namespace {

// Staging for the bounce path: the registered host buffer <-> the GPU memory.
struct CudaSource final : MemorySource {
  CudaMemory mem;
  explicit CudaSource(CudaMemory m) : mem(std::move(m)) { cpu = mem.host_ptr(); }
  void to_bounce(void* bounce, std::size_t off, std::size_t len) override { mem.to_host(bounce, off, len); }
  void from_bounce(const void* bounce, std::size_t off, std::size_t len) override { mem.from_host(bounce, off, len); }
};

}  // namespace

void check_cuda(int gpu) {
  CudaApi api;
  api.check_device(gpu);
}

std::unique_ptr<MemoryRegion::Impl> allocate_cuda(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                  Access access, const MemorySpec& spec) {
  const unsigned flags = mr_access_flags(access);
  if (spec.kind == MemoryKind::cuda_host) {
    auto src = std::make_unique<CudaSource>(CudaMemory::host(spec.gpu, length));
    void* p = src->mem.host_ptr();
    MrPtr mr(ibv_reg_mr(dev->pd.get(), p, length, flags));
    if (!mr) throw Error("ibv_reg_mr", errno, fmt::format("{} bytes of CUDA pinned host memory", length));
    return adopt_mr(std::move(dev), std::move(mr), access, length, std::move(src), RegistrationPath::host_mr,
                    "pinned host memory from cuMemHostAlloc", p);
  }
  auto src = std::make_unique<CudaSource>(CudaMemory::device(spec.gpu, length));
  const DevicePtr dptr = src->mem.device_ptr();
  std::string why;
  // 1. dma-buf: the NIC reads GPU memory directly, no peermem module needed. The iova is the
  //    device pointer, so peers address the region by it.
  if (const int fd = src->mem.export_dmabuf(why); fd >= 0) {
    errno = 0;
    MrPtr mr(ibv_reg_dmabuf_mr(dev->pd.get(), 0, length, dptr, fd, static_cast<int>(flags)));
    if (mr) {
      return adopt_mr(std::move(dev), std::move(mr), access, length, std::move(src), RegistrationPath::dmabuf_mr,
                      "GPU memory exported as a dma-buf (cuMemGetHandleForAddressRange)", nullptr);
    }
    why = dmabuf_mr_refusal(errno);
  }
  // 2. The device pointer itself: works when nvidia-peermem lets the kernel pin GPU memory.
  errno = 0;
  MrPtr mr(ibv_reg_mr(dev->pd.get(), reinterpret_cast<void*>(dptr), length, flags));
  if (mr) {
    return adopt_mr(std::move(dev), std::move(mr), access, length, std::move(src), RegistrationPath::device_mr,
                    why + "; ibv_reg_mr on the device pointer worked (nvidia-peermem)", nullptr);
  }
  why += fmt::format("; ibv_reg_mr on the device pointer: {} (is nvidia-peermem loaded?)", errno_name(errno));
  // 3. A host bounce buffer with explicit copies.
  return bounce_region(std::move(dev), length, access, std::move(src), why + "; fell back to a bounce buffer");
}

}  // namespace rdmakit::detail
