// SPDX-License-Identifier: Apache-2.0
#pragma once
// The tcp transport (docs/engine.md, "Transports"): a link's data goes over `tcp_streams` TCP
// connections to the server's port, each opened by the client after the HELLO and presenting
// the link's token and its index (STREAM), which the server's listener hands to the link's
// handshake. The frames on them are the software queue pair's (src/transport/soft/), with the
// data in the stream (no crossing): what a NIC does, the queue pairs at both ends do in software.
//
// Threads: any.

#include <cstdint>
#include <span>
#include <vector>

#include "bootstrap/socket.hpp"
#include "common/clock.hpp"
#include "common/stop.hpp"
#include "rdmakit/wire.hpp"

namespace rdmakit::detail::tcp {

/// Most streams a link takes.
inline constexpr std::uint32_t kMaxStreams = 16;

/// The client: opens `count` streams to `to`, each presenting `token` and its index in wire
/// `version`, by the deadline. Throws Error naming the step.
std::vector<Fd> open_streams(const HostPort& to, std::span<const std::uint8_t, wire::kTokenSize> token, std::uint32_t count,
                             std::uint16_t version, Deadline deadline, const Stop* stop);

}  // namespace rdmakit::detail::tcp
