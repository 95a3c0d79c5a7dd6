// SPDX-License-Identifier: Apache-2.0
#pragma once
// The authenticated bootstrap: with a pre-shared key both sides prove they know it (mutual
// HMAC-SHA256 challenge-response over fresh nonces and ephemeral X25519 keys from both, whose
// shared secret goes into the session keys) before either sends a QPN, GID,
// address or rkey. A side that fails to prove it gets a REJECT that says only that, and nothing
// else crosses the wire. After the proof, everything travels sealed in the session it yields
// (session.hpp), so a relay that forwarded the proof can neither read nor inject anything.

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "bootstrap/session.hpp"
#include "bootstrap/socket.hpp"

namespace rdmakit::detail {

inline constexpr std::size_t kNonceSize = 32;
inline constexpr std::size_t kMacSize = 32;
/// A side's hello: its nonce and its ephemeral X25519 public key.
inline constexpr std::size_t kHelloSize = 2 * kNonceSize;
/// The last bytes of a server's nonce when it answers in a version older than its own (as TLS
/// 1.3 marks its random): the nonce is under the server's MAC, so a client that fell back to
/// that version because its own was refused learns that the refusal was forged (a downgrade).
/// Clients of the older version never look at it.
inline constexpr std::array<std::uint8_t, 8> kDowngradeMarker = {'R', 'D', 'K', 'T', 'D', 'O', 'W', 'N'};
/// Shorter keys are refused: 16 random bytes is the least that resists guessing.
inline constexpr std::size_t kMinKeySize = 16;
/// A key file larger than this is not a key.
inline constexpr std::size_t kMaxKeySize = 4096;

/// How a listener at its handshake caps begins its REJECT: a client may retry.
inline constexpr const char* kBusyReason = "busy: ";

/// Throws Error for a key that is too short to be one.
void check_key(std::span<const std::uint8_t> key);

/// The client's side, run right after the control channel connects: challenge, verify the server's proof
/// (throws if it does not know the key), send ours. Returns the session every later message
/// travels in. The server may still reject us afterwards: its sealed REJECT arrives instead of
/// its HELLO.
std::unique_ptr<Session> authenticate_client(Channel& ch, std::span<const std::uint8_t> key, Deadline deadline,
                                             const std::string& peer);

/// The server's side, given the client's first message: answers the challenge, checks the proof;
/// throws Error (after sending a REJECT) when the client sent no challenge or a wrong proof.
/// Returns the session every later message travels in.
std::unique_ptr<Session> authenticate_server(Channel& ch, std::span<const std::uint8_t> key, const Message& first,
                                             Deadline deadline, const std::string& peer);

}  // namespace rdmakit::detail
