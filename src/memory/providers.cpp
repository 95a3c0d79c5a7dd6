// SPDX-License-Identifier: Apache-2.0
// Memory providers: host, huge pages, dma-buf and CUDA memory, each registered by the best path
// the device allows, falling back instead of failing, and saying which path it took and why.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <linux/dma-buf.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/vfs.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "memory/cuda.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit {

const char* to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::host: return "host";
    case MemoryKind::hugepage: return "hugepage";
    case MemoryKind::cuda: return "cuda";
    case MemoryKind::cuda_host: return "cuda-host";
    case MemoryKind::dmabuf: return "dmabuf";
  }
  return "?";
}

std::optional<MemoryKind> parse_memory_kind(std::string_view t) noexcept {
  for (MemoryKind k : {MemoryKind::host, MemoryKind::hugepage, MemoryKind::cuda, MemoryKind::cuda_host,
                       MemoryKind::dmabuf}) {
    if (t == to_string(k)) return k;
  }
  return std::nullopt;
}

const char* to_string(RegistrationPath path) noexcept {
  switch (path) {
    case RegistrationPath::host_mr: return "ibv_reg_mr on host memory";
    case RegistrationPath::dmabuf_mr: return "ibv_reg_dmabuf_mr (dma-buf)";
    case RegistrationPath::device_mr: return "ibv_reg_mr on the device pointer (peer memory)";
    case RegistrationPath::bounce: return "a registered host bounce buffer with staging copies";
  }
  return "?";
}

namespace detail {
namespace {

constexpr std::size_t kHugePage = 2u << 20;

struct HugepageSource final : MemorySource {
  std::size_t bytes = 0;
  HugepageSource(std::size_t length) : bytes((length + kHugePage - 1) / kHugePage * kHugePage) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      throw Error("mmap(MAP_HUGETLB)", err,
                  fmt::format("{} bytes on 2 MiB pages; {} huge pages free", bytes, huge_pages().free),
                  "reserve huge pages first: echo N > /proc/sys/vm/nr_hugepages (N x 2 MiB)");
    }
    cpu = p;
  }
  ~HugepageSource() override { ::munmap(cpu, bytes); }
  void to_bounce(void*, std::size_t, std::size_t) override {}
  void from_bounce(const void*, std::size_t, std::size_t) override {}
};

// A dma-buf from another driver: a dup of its fd, and a CPU mapping when the exporter allows one
// (bracketed by DMA_BUF_IOCTL_SYNC, as the dma-buf rules require).
struct DmabufSource final : MemorySource {
  int fd = -1;
  std::uint64_t offset = 0;
  std::size_t length = 0;
  void* map = nullptr;
  std::uint64_t map_start = 0;  // the page `offset` is in: mappings start there
  std::size_t map_len = 0;
  std::string map_error;
  void* reserved = nullptr;  // address space standing for the memory where it has no mapping
  // Maps the range for the CPU at once unless `map` is false (map_now() later, if needed).
  DmabufSource(int exporter_fd, std::uint64_t off, std::size_t len, bool map_it = true) : offset(off), length(len) {
    fd = ::fcntl(exporter_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) throw Error("dup(dma-buf fd)", errno, fmt::format("fd {}", exporter_fd), "is it an open dma-buf fd?");
    const auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    map_start = off / page * page;
    map_len = static_cast<std::size_t>(off - map_start + len);
    if (map_it) map_now();
  }
  ~DmabufSource() override {
    if (map != nullptr) ::munmap(map, map_len);
    if (reserved != nullptr) ::munmap(reserved, map_len);
    ::close(fd);
  }
  // The CPU's mapping of the range; false (map_error says why) when the exporter refuses one.
  bool map_now() {
    if (map != nullptr) return true;
    void* p = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(map_start));
    if (p == MAP_FAILED) {
      map_error = fmt::format("mmap of the dma-buf: {}", errno_name(errno));
      return false;
    }
    map = p;
    cpu = static_cast<char*>(p) + (offset - map_start);
    return true;
  }
  // An address of this process's that nothing else uses, for an iova that must tell this memory
  // from any other by address (inaccessible: no CPU touches the memory through it), with the
  // offset's place in its page, as ibv_reg_dmabuf_mr wants.
  std::uint64_t reserve() {
    void* p = ::mmap(nullptr, map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw Error("mmap(PROT_NONE)", errno, fmt::format("{} bytes of address space", map_len));
    reserved = p;
    return reinterpret_cast<std::uint64_t>(p) + (offset - map_start);
  }
  void sync(std::uint64_t flags) {
    dma_buf_sync s{flags};
    int r = 0;
    while ((r = ::ioctl(fd, DMA_BUF_IOCTL_SYNC, &s)) != 0 && errno == EINTR) {
    }
    if (r != 0) throw Error("DMA_BUF_IOCTL_SYNC", errno, "bracketing a copy through the dma-buf's mapping");
  }
  void to_bounce(void* bounce, std::size_t off, std::size_t len) override {
    sync(DMA_BUF_SYNC_START | DMA_BUF_SYNC_READ);
    std::memcpy(static_cast<char*>(bounce) + off, static_cast<char*>(cpu) + off, len);
    sync(DMA_BUF_SYNC_END | DMA_BUF_SYNC_READ);
  }
  void from_bounce(const void* bounce, std::size_t off, std::size_t len) override {
    sync(DMA_BUF_SYNC_START | DMA_BUF_SYNC_WRITE);
    std::memcpy(static_cast<char*>(cpu) + off, static_cast<const char*>(bounce) + off, len);
    sync(DMA_BUF_SYNC_END | DMA_BUF_SYNC_WRITE);
  }
};

std::unique_ptr<MemoryRegion::Impl> host_region(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                Access access) {
  auto mem = allocate_pages(length);
  void* p = mem.get();
  return register_region(std::move(dev), p, length, access, std::move(mem));
}

}  // namespace

std::unique_ptr<MemoryRegion::Impl> bounce_region(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                  Access access, std::unique_ptr<MemorySource> source,
                                                  std::string why) {
  auto impl = host_region(std::move(dev), length, access);
  impl->source = std::move(source);
  impl->path = RegistrationPath::bounce;
  impl->path_detail = std::move(why);
  return impl;
}

std::string dmabuf_mr_refusal(int err, std::string_view device) {
  return fmt::format("ibv_reg_dmabuf_mr{}{}: {} ({})", device.empty() ? "" : " on ", device, errno_name(err),
                     err == EOPNOTSUPP ? "the device cannot register dma-buf MRs" : std::system_category().message(err));
}

DmabufRegistration register_dmabuf(const std::vector<std::shared_ptr<DeviceResources>>& devs, int fd,
                                   std::uint64_t offset, std::size_t length, Access access) {
  DmabufRegistration r;
  struct statfs fs {};
  if (::fstatfs(fd, &fs) != 0 || fs.f_type != DMA_BUF_MAGIC) {
    throw Error("register_dmabuf", EINVAL, fmt::format("fd {} is not a dma-buf", fd),
                "pass the fd an exporter gave (a DRM PRIME export, cuMemGetHandleForAddressRange, udmabuf, ...)");
  }
  // Not mapped unless the bounce path needs it: the NICs reach the memory themselves, and a CPU
  // touching it (or a tcp link copying it) unbracketed could see stale bytes, or migrate it.
  auto src = std::make_unique<DmabufSource>(fd, offset, length, false);
  // One iova on every device (peers address the buffer by it), an address of this process's
  // that no other buffer has.
  const std::uint64_t iova = devs.empty() ? 0 : src->reserve();
  // Without an RDMA device, the software transports copy with the CPU: from the bounce buffer,
  // staged as the NICs' would be, never from the mapping unbracketed.
  std::string refused = devs.empty() ? "no RDMA device" : "";
  for (const auto& dev : devs) {
    errno = 0;
    MrPtr mr(ibv_reg_dmabuf_mr(dev->pd.get(), offset, length, iova, src->fd, static_cast<int>(mr_access_flags(access))));
    if (!mr) {
      refused = dmabuf_mr_refusal(errno, ibv_get_device_name(dev->ctx()->device));
      break;
    }
    r.regions.push_back(adopt_mr(dev, std::move(mr), access, length, nullptr, RegistrationPath::dmabuf_mr,
                                 "the device registered the dma-buf directly", nullptr));
  }
  if (!refused.empty()) {
    // One device that cannot take it: all of them share one copy, so every device (and every
    // peer, whichever rail it comes by) sees the same bytes.
    r.regions.clear();
    if (!src->map_now()) {
      throw Error("register_dmabuf", EOPNOTSUPP, refused + "; and no bounce buffer either: " + src->map_error,
                  "the exporter must allow mmap for the bounce path, or every device must take dma-buf MRs");
    }
    r.bounce = allocate_pages(length);
    for (const auto& dev : devs) {
      auto impl = register_region(dev, r.bounce.get(), length, access);
      impl->path = RegistrationPath::bounce;
      impl->path_detail = refused + "; every device registers one host bounce buffer (stage_in/stage_out copy "
                                    "through the dma-buf's CPU mapping)";
      r.regions.push_back(std::move(impl));
    }
  }
  for (auto& impl : r.regions) impl->kind = MemoryKind::dmabuf;
  r.source = std::move(src);
  return r;
}

std::unique_ptr<MemoryRegion::Impl> allocate_region(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                    Access access, const MemorySpec& spec) {
  std::unique_ptr<MemoryRegion::Impl> impl;
  switch (spec.kind) {
    case MemoryKind::host:
      impl = host_region(std::move(dev), length, access);
      break;
    case MemoryKind::hugepage: {
      auto src = std::make_unique<HugepageSource>(length);
      void* p = src->cpu;
      impl = register_region(std::move(dev), p, length, access);
      impl->source = std::move(src);
      impl->path_detail = "2 MiB pages, registered as host memory";
      break;
    }
    case MemoryKind::dmabuf: {
      auto src = std::make_unique<DmabufSource>(spec.dmabuf_fd, spec.dmabuf_offset, length);
      // Direct: the NIC reads and writes the exporter's memory itself. The iova is the CPU
      // mapping's address when there is one, so data() and the MR's addresses agree.
      const std::uint64_t iova = src->cpu != nullptr ? reinterpret_cast<std::uint64_t>(src->cpu) : spec.dmabuf_offset;
      errno = 0;
      MrPtr mr(ibv_reg_dmabuf_mr(dev->pd.get(), spec.dmabuf_offset, length, iova, src->fd, static_cast<int>(mr_access_flags(access))));
      if (mr) {
        void* cpu = src->cpu;
        impl = adopt_mr(std::move(dev), std::move(mr), access, length, std::move(src), RegistrationPath::dmabuf_mr,
                        "the device registered the dma-buf directly", cpu);
        break;
      }
      const int err = errno;
      const std::string why = dmabuf_mr_refusal(err);
      if (src->cpu == nullptr) {
        throw Error("register dma-buf", err, why + "; and no bounce buffer either: " + src->map_error,
                    "the exporter must allow mmap for the bounce path, or the NIC must support dma-buf");
      }
      impl = bounce_region(std::move(dev), length, access, std::move(src), why + "; fell back to a bounce buffer");
      break;
    }
    case MemoryKind::cuda:
    case MemoryKind::cuda_host:
      impl = allocate_cuda(std::move(dev), length, access, spec);
      break;
  }
  impl->kind = spec.kind;
  return impl;
}

}  // namespace detail

void check_memory(const MemorySpec& spec, std::size_t length) {
  switch (spec.kind) {
    case MemoryKind::host: return;
    case MemoryKind::hugepage: {
      const std::uint64_t want = (length + detail::kHugePage - 1) / detail::kHugePage;
      const std::uint64_t have = detail::huge_pages().free;
      if (have < want) {
        throw Error("huge pages", ENOMEM,
                    fmt::format("{} bytes need {} free 2 MiB pages; {} are free", length, want, have),
                    fmt::format("reserve them first: echo {} > /proc/sys/vm/nr_hugepages", want));
      }
      return;
    }
    case MemoryKind::dmabuf:
      if (::fcntl(spec.dmabuf_fd, F_GETFD) < 0) {
        throw Error("dma-buf", EBADF, fmt::format("fd {} is not open", spec.dmabuf_fd));
      }
      return;
    case MemoryKind::cuda:
    case MemoryKind::cuda_host:
      detail::check_cuda(spec.gpu);
      return;
  }
}

}  // namespace rdmakit
