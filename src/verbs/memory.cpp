// SPDX-License-Identifier: Apache-2.0
#include "verbs/memory_impl.hpp"

#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "rdmakit/error.hpp"
#include "verbs/qp.hpp"

namespace rdmakit {

std::string to_string(Access access) {
  std::string s;
  auto add = [&](Access f, const char* name) {
    if (allows(access, f) && f != Access::none) s += (s.empty() ? "" : "|") + std::string(name);
  };
  add(Access::local_write, "local_write");
  add(Access::remote_read, "remote_read");
  add(Access::remote_write, "remote_write");
  add(Access::remote_atomic, "remote_atomic");
  return s.empty() ? "none" : s;
}

LocalSlice LocalSlice::subslice(std::size_t offset, std::size_t length) const noexcept {
  if (offset > length_) return {static_cast<char*>(addr_) + length_, 0, lkey_, writable_};
  return {static_cast<char*>(addr_) + offset, std::min(length, length_ - offset), lkey_, writable_};
}

MemoryRegion::MemoryRegion(std::unique_ptr<Impl> impl) noexcept : impl_(std::move(impl)) {}
MemoryRegion::MemoryRegion(MemoryRegion&&) noexcept = default;
MemoryRegion& MemoryRegion::operator=(MemoryRegion&&) noexcept = default;
MemoryRegion::~MemoryRegion() = default;

void* MemoryRegion::data() const noexcept { return impl_->cpu; }
MemoryKind MemoryRegion::kind() const noexcept { return impl_->kind; }
RegistrationPath MemoryRegion::path() const noexcept { return impl_->path; }
const std::string& MemoryRegion::path_detail() const noexcept { return impl_->path_detail; }
void* MemoryRegion::home() const noexcept {
  return impl_->source ? impl_->source->cpu : impl_->cpu;
}
namespace {
// Whether a staging copy has anything to do; throws for a range outside the region.
bool must_stage(const MemoryRegion::Impl& m, const char* op, std::size_t offset, std::size_t length) {
  // A bounce region whose memory someone else stages (an engine's shared dma-buf copy) has no
  // source of its own.
  if (m.path != RegistrationPath::bounce || !m.source) return false;
  if (offset > m.length || length > m.length - offset) {
    throw Error(op, ERANGE, fmt::format("[{}, +{}) outside the region's {} bytes", offset, length, m.length));
  }
  return true;
}
}  // namespace
void MemoryRegion::stage_in(std::size_t offset, std::size_t length) const {
  if (must_stage(*impl_, "stage_in", offset, length)) impl_->source->to_bounce(impl_->cpu, offset, length);
}
void MemoryRegion::stage_out(std::size_t offset, std::size_t length) const {
  if (must_stage(*impl_, "stage_out", offset, length)) impl_->source->from_bounce(impl_->cpu, offset, length);
}
std::size_t MemoryRegion::size() const noexcept { return impl_->length; }
Access MemoryRegion::access() const noexcept { return impl_->access; }
bool MemoryRegion::registered() const noexcept { return impl_->mr != nullptr; }
LocalSlice MemoryRegion::local() const noexcept {
  // The NIC may write wherever the MR has local write, which mr_access_flags grants for these.
  const Access a = impl_->access;
  return {impl_->addr, impl_->length, impl_->lkey,
          allows(a, Access::local_write) || allows(a, Access::remote_write) || allows(a, Access::remote_atomic)};
}
RemoteRegion MemoryRegion::remote() const noexcept {
  return {reinterpret_cast<std::uint64_t>(impl_->addr), impl_->length, impl_->rkey, impl_->access};
}

namespace detail {

HugePages huge_pages() {
  HugePages h;
  std::ifstream f("/proc/meminfo");
  for (std::string line; std::getline(f, line);) {
    std::istringstream is(line);
    std::string key;
    std::uint64_t v = 0;
    is >> key >> v;
    if (key == "HugePages_Total:") h.total = v;
    if (key == "HugePages_Free:") h.free = v;
    if (key == "Hugepagesize:") h.page_bytes = v * 1024;
  }
  return h;
}

unsigned mr_access_flags(Access access) noexcept {
  unsigned f = qp_access_flags(access);
  // Remote write and atomics require local write (ibv_reg_mr(3)).
  if (allows(access, Access::local_write) || allows(access, Access::remote_write) ||
      allows(access, Access::remote_atomic)) {
    f |= IBV_ACCESS_LOCAL_WRITE;
  }
  if (allows(access, kMwBind)) f |= IBV_ACCESS_MW_BIND;
  return f;
}

std::unique_ptr<MemoryRegion::Impl> register_region(std::shared_ptr<DeviceResources> dev, void* addr,
                                                    std::size_t length, Access access,
                                                    OwnedMemory owned) {
  auto impl = std::make_unique<MemoryRegion::Impl>();
  impl->dev = std::move(dev);
  impl->memory = std::move(owned);
  impl->access = access;
  impl->mr.reset(ibv_reg_mr(impl->dev->pd.get(), addr, length, mr_access_flags(access)));
  if (!impl->mr) {
    const int err = errno;
    std::string hint;
    rlimit lim{};
    if ((err == ENOMEM || err == EPERM || err == EAGAIN) && ::getrlimit(RLIMIT_MEMLOCK, &lim) == 0 &&
        lim.rlim_cur != RLIM_INFINITY) {
      hint = fmt::format("RLIMIT_MEMLOCK is {} KiB and registering pins {} KiB more; raise it: {}",
                         lim.rlim_cur / 1024, (length + 1023) / 1024, kMemlockAdvice);
    } else if (err == EINVAL) {
      hint = "the address range or access flags are not valid for this device";
    } else if (err == EFAULT) {
      hint = "the range is not mapped memory of this process";
    }
    throw Error("ibv_reg_mr", err,
                fmt::format("{} bytes at {} with {}", length, addr, to_string(access)), hint);
  }
  impl->addr = impl->mr->addr;
  impl->cpu = impl->mr->addr;
  impl->length = impl->mr->length;
  impl->lkey = impl->mr->lkey;
  impl->rkey = impl->mr->rkey;
  return impl;
}

std::unique_ptr<MemoryRegion::Impl> adopt_mr(std::shared_ptr<DeviceResources> dev, MrPtr mr, Access access,
                                             std::size_t length, std::unique_ptr<MemorySource> source,
                                             RegistrationPath path, std::string why, void* cpu) {
  auto impl = std::make_unique<MemoryRegion::Impl>();
  impl->dev = std::move(dev);
  impl->access = access;
  impl->mr = std::move(mr);
  impl->addr = impl->mr->addr;
  impl->length = length;
  impl->lkey = impl->mr->lkey;
  impl->rkey = impl->mr->rkey;
  impl->cpu = cpu;
  impl->source = std::move(source);
  impl->path = path;
  impl->path_detail = std::move(why);
  return impl;
}

bool cpu_reaches(const void* addr, std::size_t len) noexcept {
  if (addr == nullptr || len == 0) return false;
  // A copy of its first and last byte into this process.
  char probe[2];
  for (std::size_t at : {std::size_t{0}, len - 1}) {
    iovec local{probe, 1};
    iovec remote{const_cast<char*>(static_cast<const char*>(addr)) + at, 1};
    if (::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) != 1) return false;
  }
  return true;
}

OwnedMemory allocate_pages(std::size_t length) {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t rounded = (std::max<std::size_t>(length, 1) + page - 1) / page * page;
  void* p = std::aligned_alloc(page, rounded);
  if (p == nullptr) throw Error("aligned_alloc", ENOMEM, fmt::format("{} bytes", rounded));
  std::memset(p, 0, rounded);
  return OwnedMemory(p);
}

}  // namespace detail
}  // namespace rdmakit
