// SPDX-License-Identifier: Apache-2.0
#pragma once
// shm's data stream: one local socket (abstract namespace) from the client to the server's
// engine, presenting the link's token (STREAM), so that the server learns the client's process
// from the kernel (SO_PEERCRED), never from the HELLO. Without cross-memory attach the client's
// ring follows the STREAM message on it (ring.hpp); the frames after that are the software queue
// pair's (src/transport/soft/) with shm's crossing (crossing.hpp).
//
// Threads: any.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "bootstrap/socket.hpp"
#include "common/clock.hpp"
#include "common/stop.hpp"
#include "rdmakit/wire.hpp"
#include "transport/shm/ring.hpp"

namespace rdmakit::detail::shm {

struct OpenedStream {
  Fd fd;
  /// The process at the other end runs as this process's user (the kernel's word): only then
  /// may the engine's memory be shared with it.
  bool own_user = false;
};

/// The client: connects to the server's local socket `socket`, presents `token` in wire
/// `version` and, when given, hands over `ring` (only to a process of this user: whatever
/// listens at the abstract name gets every byte the link moves through it), by the deadline.
/// Throws Error naming the step.
OpenedStream open_stream(const std::string& socket, std::span<const std::uint8_t, wire::kTokenSize> token,
                         std::uint16_t version, Ring* ring, Deadline deadline, const Stop* stop);

/// The server, from a client that asks for no cross-memory attach: its ring, on stream `fd`
/// right after the STREAM message, from a process of this user. Throws Error saying why not.
std::shared_ptr<Ring> take_ring(int fd, Deadline deadline, const Stop* stop);

}  // namespace rdmakit::detail::shm
