// SPDX-License-Identifier: Apache-2.0
#pragma once
// Who may be an shm peer, and what the kernel lets it do (docs/engine.md, "Transports"): where
// this process runs, as its HELLO says it; the proof a client offers that the process at a
// local socket's other end is the one holding the link's session (the server reads it by
// cross-memory attach before it copies anything from or to that process); and whether this
// process may copy from another at all.
//
// Threads: any.

#include <array>
#include <cstdint>
#include <string>

#include "rdmakit/wire.hpp"

namespace rdmakit::detail {
class Session;
}

namespace rdmakit::detail::shm {

/// This process: where it runs (a hash of the kernel's boot id, its network and PID namespaces
/// and its user: equal for two processes only where shm can join them) and its pid.
wire::TransportBlock this_host();

/// The client: its proof in `secret` (which must stay where it is, in this process's memory,
/// while the handshake runs), and in `t` where it lies and, without a session, its hash. With a
/// session the proof is derived from it, so no other process's memory can hold it.
void prove(std::array<std::uint8_t, 32>& secret, wire::TransportBlock& t, const Session* session);

/// The server: that process `pid` (the kernel's word, from the local socket its stream came on)
/// holds the proof its HELLO `t` points at. Throws Error saying why not.
void verify(const wire::TransportBlock& t, int pid, const Session* session);

/// Why this process cannot copy from another by cross-memory attach, as far as it can tell alone
/// (empty: it may): Yama's ptrace_scope, or the call refused even on its own memory (a seccomp
/// filter, as a container's).
std::string why_no_attach();

}  // namespace rdmakit::detail::shm
