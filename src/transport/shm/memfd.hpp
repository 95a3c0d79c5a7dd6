// SPDX-License-Identifier: Apache-2.0
#pragma once
// Sealed memfds: memory one process creates and another maps (shm's ring, ring.hpp, and the
// buffers an engine shares with same-host peers, soft/device.hpp). Sealed against shrinking and
// growing before anyone else holds it, and on tmpfs (never hugetlbfs, where a punched hole can
// take a page back), no access through either side's mapping can fault for want of a page.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "bootstrap/socket.hpp"

namespace rdmakit::detail::shm {

/// A new memfd of `bytes`, its pages allocated now (a host short of memory fails here, not at a
/// fault later) and sealed. Throws Error naming the step and `what` it is for.
Fd create_sealed_memfd(const char* name, std::size_t bytes, const char* what);

/// That `fd`, from a peer, is a regular memfd on tmpfs sealed against shrinking, of `min` to
/// `max` bytes: its size, else throws Error (EPROTO) saying what `whose` is not.
std::size_t check_sealed_memfd(int fd, std::size_t min, std::size_t max, const char* whose);

/// A shared, writable mapping of a whole memfd; unmapped on destruction.
class Mapping {
 public:
  Mapping() = default;
  /// Maps `size` bytes of `fd` from offset 0. Throws Error (mmap) naming `whose`.
  Mapping(int fd, std::size_t size, const char* whose);
  Mapping(Mapping&& o) noexcept : base_(o.base_), size_(o.size_) { o.base_ = nullptr, o.size_ = 0; }
  Mapping& operator=(Mapping&& o) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();
  [[nodiscard]] std::uint8_t* data() const noexcept { return base_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  std::uint8_t* base_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace rdmakit::detail::shm
