#include "memory/cuda.hpp"

#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <string>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {
namespace {

using namespace cuda;

// The driver API, loaded per use (dlopen counts references): no global state.
class Api {
 public:
  Api() {
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
    load(ctx_set, "cuCtxSetCurrent");
    load(mem_alloc, "cuMemAlloc_v2");
    load(mem_free, "cuMemFree_v2");
    load(host_alloc, "cuMemHostAlloc");
    load(host_free, "cuMemFreeHost");
    load(dtoh, "cuMemcpyDtoH_v2");
    load(htod, "cuMemcpyHtoD_v2");
    load(error_name, "cuGetErrorName");
    // CUDA 11.7+; older drivers lack it and the dma-buf path is skipped.
    handle_for_range = reinterpret_cast<decltype(handle_for_range)>(::dlsym(lib_, "cuMemGetHandleForAddressRange"));
  }
  Api(const Api&) = delete;
  Api& operator=(const Api&) = delete;
  ~Api() { ::dlclose(lib_); }

  std::string name(Result r) const {
    const char* s = nullptr;
    return error_name != nullptr && error_name(r, &s) == kSuccess && s != nullptr ? s : fmt::format("CUDA error {}", r);
  }
  void check(Result r, const char* what) const {
    if (r != kSuccess) throw Error(what, EIO, name(r));
  }

  Result (*init)(unsigned) = nullptr;
  Result (*device_count)(int*) = nullptr;
  Result (*device_get)(Device*, int) = nullptr;
  Result (*ctx_retain)(Context*, Device) = nullptr;
  Result (*ctx_release)(Device) = nullptr;
  Result (*ctx_set)(Context) = nullptr;
  Result (*mem_alloc)(DevicePtr*, std::size_t) = nullptr;
  Result (*mem_free)(DevicePtr) = nullptr;
  Result (*host_alloc)(void**, std::size_t, unsigned) = nullptr;
  Result (*host_free)(void*) = nullptr;
  Result (*dtoh)(void*, DevicePtr, std::size_t) = nullptr;
  Result (*htod)(DevicePtr, const void*, std::size_t) = nullptr;
  Result (*error_name)(Result, const char**) = nullptr;
  Result (*handle_for_range)(void*, DevicePtr, std::size_t, int, unsigned long long) = nullptr;

 private:
  template <typename F>
  void load(F& f, const char* sym) {
    f = reinterpret_cast<F>(::dlsym(lib_, sym));
    if (f == nullptr) throw Error("CUDA", ENOSYS, fmt::format("libcuda.so.1 has no {}", sym), "the driver is too old");
  }
  void* lib_ = nullptr;
};

// A device's primary context, current on this thread while the memory lives.
struct CudaSource final : MemorySource {
  std::unique_ptr<Api> api = std::make_unique<Api>();
  Device device = 0;
  Context ctx = nullptr;
  DevicePtr dptr = 0;
  void* host = nullptr;
  int dmabuf_fd = -1;

  explicit CudaSource(int gpu) {
    check_cuda_with(*api, gpu);
    api->check(api->device_get(&device, gpu), "cuDeviceGet");
    api->check(api->ctx_retain(&ctx, device), "cuDevicePrimaryCtxRetain");
    api->check(api->ctx_set(ctx), "cuCtxSetCurrent");
  }
  ~CudaSource() override {
    if (dmabuf_fd >= 0) ::close(dmabuf_fd);
    if (dptr != 0) api->mem_free(dptr);
    if (host != nullptr) api->host_free(host);
    if (ctx != nullptr) api->ctx_release(device);
  }
  static void check_cuda_with(Api& api, int gpu) {
    if (const Result r = api.init(0); r != kSuccess) {
      throw Error("CUDA", ENODEV, fmt::format("no CUDA device: cuInit failed ({})", api.name(r)),
                  "is an NVIDIA GPU present and its driver loaded (nvidia-smi)?");
    }
    int n = 0;
    if (api.device_count(&n) != kSuccess || n == 0) {
      throw Error("CUDA", ENODEV, "no CUDA device: the driver sees no GPU", "use host memory here");
    }
    if (gpu < 0 || gpu >= n) {
      throw Error("CUDA", ENODEV, fmt::format("no CUDA device {}: there are {} (0..{})", gpu, n, n - 1));
    }
  }
  void to_bounce(void* bounce, std::size_t off, std::size_t len) override {
    api->check(api->dtoh(static_cast<char*>(bounce) + off, dptr + off, len), "cuMemcpyDtoH");
  }
  void from_bounce(const void* bounce, std::size_t off, std::size_t len) override {
    api->check(api->htod(dptr + off, static_cast<const char*>(bounce) + off, len), "cuMemcpyHtoD");
  }
};

std::unique_ptr<MemoryRegion::Impl> wrap(std::shared_ptr<DeviceResources> dev, MrPtr mr, Access access,
                                         std::size_t length, std::unique_ptr<CudaSource> src,
                                         RegistrationPath path, std::string why) {
  void* cpu = path == RegistrationPath::host_mr ? src->host : nullptr;
  return adopt_mr(std::move(dev), std::move(mr), access, length, std::move(src), path, std::move(why), cpu);
}

}  // namespace

void check_cuda(int gpu) {
  Api api;
  CudaSource::check_cuda_with(api, gpu);
}

std::unique_ptr<MemoryRegion::Impl> allocate_cuda(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                  Access access, const MemorySpec& spec) {
  auto src = std::make_unique<CudaSource>(spec.gpu);
  const unsigned flags = mr_access_flags(access);
  if (spec.kind == MemoryKind::cuda_host) {
    src->api->check(src->api->host_alloc(&src->host, length, kHostAllocPortable), "cuMemHostAlloc");
    src->cpu = src->host;
    MrPtr mr(ibv_reg_mr(dev->pd.get(), src->host, length, flags));
    if (!mr) throw Error("ibv_reg_mr", errno, fmt::format("{} bytes of CUDA pinned host memory", length));
    return wrap(std::move(dev), std::move(mr), access, length, std::move(src), RegistrationPath::host_mr,
                "pinned host memory from cuMemHostAlloc");
  }
  src->api->check(src->api->mem_alloc(&src->dptr, length), "cuMemAlloc");
  std::string why;
  // 1. dma-buf: the NIC reads GPU memory directly, no peermem module needed. The iova is the
  //    device pointer, so peers address the region by it.
  if (src->api->handle_for_range != nullptr) {
    int fd = -1;
    const Result r = src->api->handle_for_range(&fd, src->dptr, length, kRangeHandleDmaBufFd, 0);
    if (r == kSuccess && fd >= 0) {
      src->dmabuf_fd = fd;
      errno = 0;
      MrPtr mr(ibv_reg_dmabuf_mr(dev->pd.get(), 0, length, src->dptr, fd, static_cast<int>(flags)));
      if (mr) {
        return wrap(std::move(dev), std::move(mr), access, length, std::move(src), RegistrationPath::dmabuf_mr,
                    "GPU memory exported as a dma-buf (cuMemGetHandleForAddressRange)");
      }
      why = fmt::format("ibv_reg_dmabuf_mr: {}", errno_name(errno));
    } else {
      why = fmt::format("cuMemGetHandleForAddressRange: {}", src->api->name(r));
    }
  } else {
    why = "the driver has no cuMemGetHandleForAddressRange (CUDA < 11.7)";
  }
  // 2. The device pointer itself: works when nvidia-peermem lets the kernel pin GPU memory.
  errno = 0;
  MrPtr mr(ibv_reg_mr(dev->pd.get(), reinterpret_cast<void*>(src->dptr), length, flags));
  if (mr) {
    return wrap(std::move(dev), std::move(mr), access, length, std::move(src), RegistrationPath::device_mr,
                why + "; ibv_reg_mr on the device pointer worked (nvidia-peermem)");
  }
  why += fmt::format("; ibv_reg_mr on the device pointer: {} (is nvidia-peermem loaded?)", errno_name(errno));
  // 3. A host bounce buffer with explicit copies.
  return bounce_region(std::move(dev), length, access, std::move(src), why + "; fell back to a bounce buffer");
}

}  // namespace rdmakit::detail
