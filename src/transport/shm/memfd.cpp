// SPDX-License-Identifier: Apache-2.0
// Sealed memfds (memfd.hpp).
#include "transport/shm/memfd.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail::shm {

Fd create_sealed_memfd(const char* name, std::size_t bytes, const char* what) {
  Fd fd(::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throw Error("memfd_create", errno, what);
  if (const int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); err != 0) {
    throw Error("fallocate", err, fmt::format("{}: {} bytes", what, bytes), "the host is short of memory (or of /dev/shm)");
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    throw Error("fcntl(F_ADD_SEALS)", errno, fmt::format("sealing {}", what));
  }
  return fd;
}

std::size_t check_sealed_memfd(int fd, std::size_t min, std::size_t max, const char* whose) {
  // The seal first: once it cannot shrink, the size read next is one it keeps (it may only grow).
  const int seals = ::fcntl(fd, F_GET_SEALS);
  struct statfs fs{};
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || ::fstatfs(fd, &fs) != 0 ||
      static_cast<unsigned long>(fs.f_type) != TMPFS_MAGIC) {
    throw Error("shm", EPROTO, fmt::format("{} is not a memfd sealed against shrinking (it could fault here)", whose));
  }
  struct stat st{};
  if (::fstat(fd, &st) != 0) throw Error("fstat", errno, whose);
  if (!S_ISREG(st.st_mode)) throw Error("shm", EPROTO, fmt::format("{} is not a regular file", whose));
  const auto size = static_cast<std::size_t>(st.st_size);
  if (st.st_size < 0 || size < min || size > max) {
    throw Error("shm", EPROTO, fmt::format("{} has {} bytes ({}..{})", whose, st.st_size, min, max));
  }
  return size;
}

Mapping::Mapping(int fd, std::size_t size, const char* whose) : size_(size) {
  void* at = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (at == MAP_FAILED) throw Error("mmap", errno, fmt::format("mapping {} ({} bytes)", whose, size));
  base_ = static_cast<std::uint8_t*>(at);
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) ::munmap(base_, size_);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

Mapping::~Mapping() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

}  // namespace rdmakit::detail::shm
