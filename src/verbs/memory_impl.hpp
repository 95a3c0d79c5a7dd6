#pragma once
// What a MemoryRegion owns. The device context and PD are shared with the connection that made
// the region, so the PD outlives every MR registered in it whatever order the user drops them in.

#include <cstdlib>
#include <memory>

#include "rdmakit/memory.hpp"
#include "verbs/handles.hpp"

namespace rdmakit::detail {

/// The device context and protection domain, in that member order (PD released first).
struct DeviceResources {
  ContextPtr ctx;
  PdPtr pd;
};

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
using OwnedMemory = std::unique_ptr<void, FreeDeleter>;

/// ibv_reg_mr flags for `access`: the least the use needs.
unsigned mr_access_flags(Access access) noexcept;

std::unique_ptr<MemoryRegion::Impl> register_region(std::shared_ptr<DeviceResources> dev, void* addr,
                                                    std::size_t length, Access access,
                                                    OwnedMemory owned = {});
/// Page-aligned, zeroed memory.
OwnedMemory allocate_pages(std::size_t length);

}  // namespace rdmakit::detail

namespace rdmakit {
// Member order is release order reversed: the MR is deregistered before its memory is freed and
// before the PD it lives in can go.
struct MemoryRegion::Impl {
  std::shared_ptr<detail::DeviceResources> dev;
  detail::OwnedMemory memory;
  detail::MrPtr mr;  // null once deregistered (revoked); the fields below stay valid
  Access access = Access::none;
  void* addr = nullptr;
  std::size_t length = 0;
  std::uint32_t lkey = 0, rkey = 0;
};
}  // namespace rdmakit
