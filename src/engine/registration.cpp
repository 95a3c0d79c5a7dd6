// SPDX-License-Identifier: Apache-2.0
// How the engine registers memory: caller-owned host and GPU memory, another driver's dma-buf,
// memory it allocates, and how a buffer ranks the devices (include/rdmakit/engine.hpp).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "engine/impl.hpp"
#include "engine/locality.hpp"
#include "memory/cuda.hpp"
#include "rdmakit/error.hpp"
#include "transport/shm/memfd.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit {

namespace {

// Engine buffers: with windows, no remote access of their own (peers get windows only), and
// binding allowed; without, every remote access (the region's key is what peers get).
Access buffer_access(bool windows) {
  return windows ? Access::local_write | detail::kMwBind : Access::local_write | detail::kAllRemote;
}

}  // namespace

Buffer Engine::register_memory(void* addr, std::size_t length) {
  if (addr == nullptr || length == 0) throw Error("register_memory", EINVAL, "an empty buffer");
  auto rec = std::make_unique<detail::BufferRec>();
  const Access access = buffer_access(impl_->windows);
  // An address the CPU cannot reach is asked of the CUDA driver (loaded only then): GPU memory
  // goes by dma-buf where a device takes it, by its pointer elsewhere.
  const auto gpu = detail::cpu_reaches(addr, length) ? std::nullopt : detail::cuda_pointer(addr);
  if (gpu) {
    rec->kind = MemoryKind::cuda;
    if (!impl_->pds.empty()) {
      const detail::CudaRangeExport dmabuf(addr, length, *gpu);
      for (const auto& pd : impl_->pds) {
        rec->regions.emplace_back(MemoryRegion::Impl::wrap(detail::register_gpu(pd, addr, length, access, dmabuf, gpu->gpu)));
      }
    }
    rec->gpu_pci = detail::pci_path_of_bus(detail::cuda_pci_bus_id(gpu->gpu));
  } else {
    for (const auto& pd : impl_->pds) {
      rec->regions.emplace_back(MemoryRegion::Impl::wrap(detail::register_region(pd, addr, length, access)));
    }
  }
  rec->handle.addr = addr;
  rec->handle.length = length;
  return impl_->publish(std::move(rec));
}

Buffer Engine::register_dmabuf(int fd, std::uint64_t offset, std::size_t length) {
  if (length == 0) throw Error("register_dmabuf", EINVAL, "an empty buffer");
  if (::fcntl(fd, F_GETFD) < 0) throw Error("register_dmabuf", EBADF, fmt::format("fd {} is not open", fd));
  auto rec = std::make_unique<detail::BufferRec>();
  rec->kind = MemoryKind::dmabuf;
  auto reg = detail::register_dmabuf(impl_->pds, fd, offset, length, buffer_access(impl_->windows));
  for (auto& r : reg.regions) rec->regions.emplace_back(MemoryRegion::Impl::wrap(std::move(r)));
  rec->home = std::move(reg.source);
  rec->bounce = std::move(reg.bounce);
  // The address every device's region has (the bounce buffer, or the dma-buf's iova).
  rec->handle.addr = rec->bounce ? rec->bounce.get() : rec->regions[0]->local().addr();
  rec->handle.length = length;
  return impl_->publish(std::move(rec));
}

namespace {

void stage(detail::BufferRec* b, const Buffer& buffer, std::uint64_t offset, std::uint64_t length, bool in,
           const char* verb) {
  const std::uint64_t size = b->handle.length;
  if (length == 0) length = size - std::min(offset, size);
  if (offset > size || length > size - offset || length == 0) {
    throw Error(verb, EINVAL, fmt::format("[{}, +{}) is not inside buffer {} of {} bytes", offset, length, buffer.id, size));
  }
  std::lock_guard lock(b->stage_mu);
  if (b->released.load()) throw Error(verb, EINVAL, fmt::format("buffer {} was unregistered", buffer.id));
  if (b->bounce) {
    // A caller's dma-buf: one copy that every device registered.
    if (in) {
      b->home->to_bounce(b->bounce.get(), offset, length);
    } else {
      b->home->from_bounce(b->bounce.get(), offset, length);
    }
  } else if (!b->regions.empty() && b->regions[0]->path() == RegistrationPath::bounce) {
    // Memory the engine allocated on its one device, which only a bounce buffer reaches.
    if (in) {
      b->regions[0]->stage_in(offset, length);
    } else {
      b->regions[0]->stage_out(offset, length);
    }
  }  // else the NICs reach the memory itself
}

}  // namespace

void Engine::stage_in(const Buffer& buffer, std::uint64_t offset, std::uint64_t length) {
  stage(impl_->buffer_for(buffer, "stage_in").get(), buffer, offset, length, true, "stage_in");
}

void Engine::stage_out(const Buffer& buffer, std::uint64_t offset, std::uint64_t length) {
  stage(impl_->buffer_for(buffer, "stage_out").get(), buffer, offset, length, false, "stage_out");
}

std::vector<BufferPath> Engine::registration(const Buffer& buffer) const {
  const auto b = impl_->buffer_for(buffer, "registration");
  std::vector<BufferPath> out;
  std::lock_guard lock(impl_->mu);  // the regions go under it
  for (std::size_t d = 0; d < b->regions.size(); ++d) {
    out.push_back({impl_->rdma_devices[d]->name(), b->regions[d]->path(), b->regions[d]->path_detail()});
  }
  return out;
}

namespace {

// Host memory same-host peers may map: a sealed memfd, mapped here (transport/shm/memfd.hpp).
// Not inherited by a forked child (MADV_DONTFORK): a shared mapping would let the child's writes
// land in this process's buffer, where a private one gives it its own copy.
struct SharedPages final : detail::MemorySource {
  detail::Fd fd;  // handed to the shm device (it keeps the one descriptor while shared)
  detail::shm::Mapping map;
  explicit SharedPages(std::size_t length)
      : fd(detail::shm::create_sealed_memfd("rdmakit-buffer", length, "a buffer shm peers map")),
        map(fd.get(), length, "a buffer shm peers map") {
    cpu = map.data();
    if (::madvise(map.data(), map.size(), MADV_DONTFORK) != 0) {
      throw Error("madvise(MADV_DONTFORK)", errno, "a buffer shm peers map");
    }
  }
  // Never a bounce path's source: the NICs register the mapping itself.
  void to_bounce(void*, std::size_t, std::size_t) override {}
  void from_bounce(const void*, std::size_t, std::size_t) override {}
};

// Each shared buffer holds a descriptor while it lives: at most a quarter of the process's limit
// go to them, so that sockets, epoll sets and rings keep theirs (past it, memory no peer maps).
bool descriptors_to_spare(const detail::soft::Device& shm) {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return true;
  return shm.shared_count() < r.rlim_cur / 4;
}

}  // namespace

Buffer Engine::allocate_memory(std::size_t length, const MemorySpec& spec) {
  auto rec = std::make_unique<detail::BufferRec>();
  rec->kind = spec.kind;
  std::unique_ptr<SharedPages> pages;
  detail::soft::Device& shm = impl_->shm_device();
  if (impl_->shares(spec.kind) && length > 0 && length <= detail::soft::kMaxShare && descriptors_to_spare(shm)) {
    try {
      pages = std::make_unique<SharedPages>(length);
    } catch (const Error& e) {
      // (Out of descriptors, a memfd refused by a seccomp profile): memory no peer maps, whose
      // copies go as shm_copy says; the buffer works all the same.
      impl_->cfg.link.log(fmt::format("engine {}: allocate_memory: {}; this buffer is not shared with shm peers",
                                      impl_->name, e.what()));
    }
  }
  if (pages) {
    // Memory shm peers map (their copies one pass), registered on every device by its address
    // (tcp and shm reach it by address too: publish() makes its soft region).
    void* at = pages->cpu;
    detail::Fd fd = std::move(pages->fd);
    rec->home = std::move(pages);
    for (const auto& pd : impl_->pds) {
      rec->regions.emplace_back(MemoryRegion::Impl::wrap(detail::register_region(pd, at, length, buffer_access(impl_->windows))));
    }
    rec->shared.emplace(&shm, shm.share(at, length, std::move(fd)));
    rec->handle.addr = at;
    rec->handle.length = length;
    return impl_->publish(std::move(rec));
  }
  if (impl_->pds.empty()) {
    // No RDMA device (tcp and shm only): memory the CPU reaches, owned by the buffer's record.
    if (spec.kind != MemoryKind::host) {
      throw Error("allocate_memory", ENOTSUP,
                  fmt::format("{} memory without an RDMA device: this engine's transports (tcp, shm) copy with the "
                              "CPU, and allocate_memory() gives them host memory",
                              to_string(spec.kind)),
                  "allocate it yourself and register_memory() it, or use MemoryKind::host");
    }
    auto impl = std::make_unique<MemoryRegion::Impl>();
    impl->memory = detail::allocate_pages(length);
    impl->addr = impl->cpu = impl->memory.get();
    impl->length = length;
    impl->access = Access::local_write;
    rec->soft.emplace(MemoryRegion::Impl::wrap(std::move(impl)));
    rec->handle.addr = rec->soft->data();
    rec->handle.length = length;
    return impl_->publish(std::move(rec));
  }
  rec->regions.reserve(impl_->pds.size());  // `first` below stays valid
  // The first device allocates (and owns) the memory; the others register the same bytes by
  // their address (host memory, huge pages, CUDA host memory, and GPU memory where the first
  // took it by address too: what nvidia-peermem makes work).
  rec->regions.emplace_back(MemoryRegion::Impl::wrap(
      detail::allocate_region(impl_->pds[0], length, buffer_access(impl_->windows), spec)));
  const MemoryRegion& first = *rec->regions[0];
  if (impl_->pds.size() > 1 && first.path() != RegistrationPath::host_mr &&
      first.path() != RegistrationPath::device_mr) {
    throw Error("allocate_memory", ENOTSUP,
                fmt::format("{} memory took the {} path on {}, which the engine's other devices cannot share",
                            to_string(spec.kind), to_string(first.path()), impl_->rdma_devices[0]->name()),
                "allocate it yourself and register it on every device: register_memory() for host or GPU memory "
                "(GPU memory by one dma-buf export on each device that takes it), register_dmabuf() for a dma-buf; "
                "or list one device in EngineConfig::devices");
  }
  for (std::size_t d = 1; d < impl_->pds.size(); ++d) {
    rec->regions.emplace_back(MemoryRegion::Impl::wrap(
        detail::register_region(impl_->pds[d], first.local().addr(), length, buffer_access(impl_->windows))));
  }
  rec->handle.addr = first.data();
  rec->handle.length = length;
  if (spec.kind == MemoryKind::cuda) rec->gpu_pci = detail::pci_path_of_bus(detail::cuda_pci_bus_id(spec.gpu));
  return impl_->publish(std::move(rec));
}

std::vector<DeviceRank> Engine::locality(const Buffer& buffer) const {
  const auto b = impl_->buffer_for(buffer, "locality");
  if (b->retired.load()) throw Error("locality", EINVAL, fmt::format("buffer {} was unregistered", buffer.id));
  return detail::rank_devices(impl_->rdma_devices, b->numa_node, b->gpu_pci);
}

}  // namespace rdmakit
