// SPDX-License-Identifier: Apache-2.0
#pragma once
// What a MemoryRegion owns. The device and PD are shared with the connection (or engine) that
// made the region, so the PD outlives every MR registered in it whatever order the user drops
// them in.

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "rdmakit/memory.hpp"
#include "verbs/device_layer.hpp"
#include "verbs/handles.hpp"

namespace rdmakit::detail {


/// How to raise RLIMIT_MEMLOCK, said the same way wherever a limit is the problem.
inline constexpr const char* kMemlockAdvice =
    "`ulimit -l unlimited` in the shell, `* - memlock unlimited` in /etc/security/limits.conf, "
    "LimitMEMLOCK=infinity for a systemd service, --ulimit memlock=-1 for a container";

/// The kernel's huge page counts (/proc/meminfo).
struct HugePages {
  std::uint64_t total = 0, free = 0, page_bytes = 0;
};
[[nodiscard]] HugePages huge_pages();

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
using OwnedMemory = std::unique_ptr<void, FreeDeleter>;

/// Memory that is not plain host memory (huge pages, a dma-buf, CUDA): owns it, and on the
/// bounce path copies between it and the registered buffer.
struct MemorySource {
  virtual ~MemorySource() = default;
  void* cpu = nullptr;  // the memory, when the CPU can reach it
  /// Copies `length` bytes at `offset` of the memory into `bounce` (at the same offset), or back.
  virtual void to_bounce(void* bounce, std::size_t offset, std::size_t length) = 0;
  virtual void from_bounce(const void* bounce, std::size_t offset, std::size_t length) = 0;
};

/// Not a public Access flag: memory windows may be bound to the region (the engine registers
/// its buffers so, without remote access of their own: peers reach them through windows only).
inline constexpr Access kMwBind = static_cast<Access>(1u << 8);

/// ibv_reg_mr flags for `access`: the least the use needs.
unsigned mr_access_flags(Access access) noexcept;

std::unique_ptr<MemoryRegion::Impl> register_region(std::shared_ptr<DeviceResources> dev, void* addr,
                                                    std::size_t length, Access access,
                                                    OwnedMemory owned = {});
/// A region around an MR registered some other way (ibv_reg_dmabuf_mr, a GPU pointer), owning
/// `source`; `cpu` is what data() returns (nullptr when the CPU cannot reach the bytes).
std::unique_ptr<MemoryRegion::Impl> adopt_mr(std::shared_ptr<DeviceResources> dev, MrPtr mr, Access access,
                                             std::size_t length, std::unique_ptr<MemorySource> source,
                                             RegistrationPath path, std::string why, void* cpu);
/// A registered host buffer standing in for `source`'s memory (the bounce path): the region's
/// NIC-visible bytes are the buffer's; stage_in/stage_out copy through `source`.
std::unique_ptr<MemoryRegion::Impl> bounce_region(std::shared_ptr<DeviceResources> dev, std::size_t length,
                                                  Access access, std::unique_ptr<MemorySource> source,
                                                  std::string why);
/// Allocates memory of spec.kind and registers it by the best path that works (src/memory/).
std::unique_ptr<MemoryRegion::Impl> allocate_region(std::shared_ptr<DeviceResources> dev,
                                                    std::size_t length, Access access,
                                                    const MemorySpec& spec);
/// Why ibv_reg_dmabuf_mr failed with `err`, as every dma-buf path says it:
/// "ibv_reg_dmabuf_mr[ on DEVICE]: EOPNOTSUPP (the device cannot register dma-buf MRs)".
[[nodiscard]] std::string dmabuf_mr_refusal(int err, std::string_view device = {});
/// A caller's dma-buf, [offset, +length) of fd, registered on every device of `devs`
/// (src/memory/): by ibv_reg_dmabuf_mr where all of them take it, else through one host bounce
/// buffer registered on each (the exporter must allow mmap: stage_in/stage_out copy through
/// the mapping). Throws Error naming the device that refused and why.
struct DmabufRegistration {
  std::unique_ptr<MemorySource> source;  // a dup of fd, and its CPU mapping when there is one
  OwnedMemory bounce;                    // the bounce path's buffer, else empty
  std::vector<std::unique_ptr<MemoryRegion::Impl>> regions;  // by device; declared last: go first
};
DmabufRegistration register_dmabuf(const std::vector<std::shared_ptr<DeviceResources>>& devs, int fd,
                                   std::uint64_t offset, std::size_t length, Access access);
/// Whether the CPU reaches [addr, +len): a GPU pointer (cudaMalloc memory) is no CPU address,
/// and copying it would fault. The kernel says so without a fault.
[[nodiscard]] bool cpu_reaches(const void* addr, std::size_t len) noexcept;
/// Page-aligned, zeroed memory.
OwnedMemory allocate_pages(std::size_t length);

}  // namespace rdmakit::detail

namespace rdmakit {
// Member order is release order reversed: the MR is deregistered before its memory is freed and
// before the PD it lives in can go.
struct MemoryRegion::Impl {
  std::shared_ptr<detail::DeviceResources> dev;
  detail::OwnedMemory memory;                    // host memory rdmakit allocated (or the bounce buffer)
  std::unique_ptr<detail::MemorySource> source;  // huge pages, dma-buf, CUDA: outlives the MR
  detail::MrPtr mr;  // null once deregistered (revoked); the fields below stay valid
  MemoryKind kind = MemoryKind::host;
  RegistrationPath path = RegistrationPath::host_mr;
  std::string path_detail;
  void* cpu = nullptr;  // data(): what the NIC sees, when the CPU can reach it
  Access access = Access::none;
  void* addr = nullptr;
  std::size_t length = 0;
  std::uint32_t lkey = 0, rkey = 0;

  /// A MemoryRegion around `impl` (only the library makes one).
  static MemoryRegion wrap(std::unique_ptr<Impl> impl) noexcept { return MemoryRegion(std::move(impl)); }
  /// The verbs MR (null once deregistered), for binding memory windows to it.
  static ibv_mr* raw(const MemoryRegion& r) noexcept { return r.impl_->mr.get(); }
  /// Deregisters now (revocation); the memory stays until the region is destroyed.
  static void deregister(MemoryRegion& r) noexcept { r.impl_->mr.reset(); }
};
}  // namespace rdmakit
