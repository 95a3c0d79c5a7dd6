// SPDX-License-Identifier: Apache-2.0
#pragma once
// shm's second way to move data (docs/engine.md, "Transports"): where this kernel lets no process
// copy from another (Yama's ptrace_scope of 1 or more, the default of Ubuntu), or where an engine
// asks for it (EngineConfig::shm_copy), the initiator's WRITEs and READs go through a ring of
// shared memory the two processes both map: the initiator copies a WRITE's data in, the target
// copies it out into its window (a READ the other way round): two copies, each in one process
// with the CPU's memcpy, in parallel with each other.
//
// The initiator creates the ring (a memfd on tmpfs, sealed: neither side can shrink it under the
// other, so no access to it faults for want of a page) and hands it to the target over the link's
// local socket, after the socket's STREAM message (SCM_RIGHTS); the target takes it only from a
// process of its own user (SO_PEERCRED), checks it is such a file, of a size it takes, and maps it. Neither side's own memory is ever reachable through it: the initiator's requests
// name offsets in the ring, never addresses, and the target copies only between the ring and
// the window it checked, so this needs no proof of who the peer process is (cross-memory attach
// does, host.hpp).
//
// Threads: the mapping is read and written by the worker of each side that owns the link.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "bootstrap/socket.hpp"
#include "transport/shm/memfd.hpp"

namespace rdmakit::detail::shm {

/// The ring's size: 16 frames of soft::kMaxChunk in flight on the link.
inline constexpr std::size_t kRingBytes = 4u << 20;
/// What a target takes: at least one frame's chunk, at most 64 MiB.
inline constexpr std::size_t kRingMin = 256u << 10;
inline constexpr std::size_t kRingMax = 64u << 20;

/// That the process at the other end of the local socket `sock` runs as this process's user, as
/// the kernel names it (SO_PEERCRED): whoever is there gets, or gives, a link's ring. Throws Error
/// (EACCES) saying `what` would have been given otherwise.
void require_own_user(int sock, const char* what);

/// One byte `tag` with descriptor `fd` (none when negative) over the local socket `sock`, by the
/// deadline: how a ring travels.
void send_with_descriptor(int sock, char tag, int fd, Deadline deadline, const Stop* stop);

class Ring {
 public:
  /// A new ring of `bytes` (a sealed memfd, mapped here). Throws Error naming the step.
  static std::shared_ptr<Ring> create(std::size_t bytes = kRingBytes);
  /// Sends it over the local socket `sock` (one byte with the descriptor), by the deadline;
  /// once (this side's descriptor is closed then: the mapping stays).
  void send(int sock, Deadline deadline, const Stop* stop);
  /// Receives a ring the peer sent over `sock` by the deadline, checks it and maps it. Throws
  /// Error saying what was wrong (no descriptor, not a sealed memfd, a size out of range).
  static std::shared_ptr<Ring> receive(int sock, Deadline deadline, const Stop* stop);

  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() = default;
  [[nodiscard]] std::uint8_t* data() const noexcept { return map_.data(); }
  [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }

 private:
  explicit Ring(Mapping map) noexcept : map_(std::move(map)) {}
  Mapping map_;
  Fd fd_;  // the creator's, to send (the mapping keeps the memory either way)
};

}  // namespace rdmakit::detail::shm
