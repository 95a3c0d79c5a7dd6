// SPDX-License-Identifier: Apache-2.0
#pragma once
// The keyed session: after the mutual proof of the pre-shared key, every control-channel message
// travels sealed in an AEAD frame (XChaCha20-Poly1305, libsodium) under a key of its direction,
// derived from the PSK, both sides' nonces and an ephemeral X25519 exchange (forward secrecy:
// a PSK that leaks later opens no recorded session), with a per-direction sequence number as the
// nonce.
// Confidentiality for addresses and rkeys, integrity, no replay, no reordering, no reflection: a
// frame that was altered, repeated, dropped, reordered or sent back the other way fails to open.
//
//   SEALED frame: header (type SEALED, length n) | ciphertext of the inner message (its own
//   12-byte header and payload) | 16-byte tag. The outer header is authenticated too.

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bootstrap/channel.hpp"

namespace rdmakit::detail {

inline constexpr std::size_t kSessionKeySize = 32;
inline constexpr std::size_t kSealTagSize = 16;
/// The most bytes sealing adds to a message.
inline constexpr std::size_t kSealOverhead = wire::kHeaderSize + kSealTagSize;

/// A copy of a secret that is wiped when it goes: keys, and the pre-shared key itself. The
/// library keeps one per listener and one per connection.
class Secret {
 public:
  Secret() = default;
  explicit Secret(std::span<const std::uint8_t> bytes);
  Secret(const Secret&) = delete;
  Secret& operator=(const Secret&) = delete;
  ~Secret();
  [[nodiscard]] std::span<const std::uint8_t> bytes() const noexcept { return bytes_; }
  [[nodiscard]] bool empty() const noexcept { return bytes_.empty(); }

 private:
  std::vector<std::uint8_t> bytes_;
};

/// Wipes `v` (sodium_memzero) and empties it.
void wipe(std::vector<std::uint8_t>& v) noexcept;

/// Which side of the session this is (each seals with its own direction's key).
enum class Role : std::uint8_t { client, server };

class Session {
 public:
  /// Keys for both directions from the PSK, the shared secret of both sides' ephemeral X25519
  /// keys (`dh`), and what each side sent in the clear (`client_hello`, `server_hello`: nonce and
  /// ephemeral public key): HKDF-SHA256, extract with the hellos as salt over psk | dh, expand
  /// with a label per direction, and once more for binding().
  /// `version`: the wire version of the connection, which every frame's headers carry (the
  /// outer one authenticated, the inner one sealed): a frame in another fails to open.
  Session(std::span<const std::uint8_t> psk, std::span<const std::uint8_t> client_hello,
          std::span<const std::uint8_t> server_hello, Role role, std::span<const std::uint8_t> dh,
          std::uint16_t version = wire::kVersion);
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session();

  /// A whole SEALED frame carrying a message of `type` with `payload`.
  [[nodiscard]] std::vector<std::uint8_t> seal(wire::MessageType type, std::span<const std::uint8_t> payload);
  /// Opens a SEALED frame's payload (`outer` is its header); the inner message, or nullopt when
  /// it fails to authenticate (tampered, replayed, reordered, reflected, truncated) or is
  /// malformed inside. Never throws. A failed frame consumes no sequence number.
  [[nodiscard]] std::optional<Message> open(const wire::Header& outer, std::span<const std::uint8_t> sealed) noexcept;
  /// What names this session and no other: the same on both sides, unknowable to anyone who
  /// does not hold the PSK and one side's ephemeral secret (a relay holding the PSK runs two
  /// sessions with two different bindings). Engine identities sign it (engine/identity.hpp), so
  /// a signature proves its holder is at the other end of this very session.
  [[nodiscard]] std::span<const std::uint8_t, kSessionKeySize> binding() const noexcept { return binding_; }
  [[nodiscard]] std::uint16_t version() const noexcept { return version_; }

 private:
  std::array<std::uint8_t, kSessionKeySize> tx_{};
  std::array<std::uint8_t, kSessionKeySize> rx_{};
  std::array<std::uint8_t, kSessionKeySize> binding_{};
  std::uint64_t tx_seq_ = 0;
  std::uint64_t rx_seq_ = 0;
  std::uint16_t version_;
};

/// A control message as it goes on the channel: sealed when there is a session (taking its
/// next sequence number: frames go out in the order they were made), plain otherwise.
/// Plain ones in `version`; sealed ones in the session's.
std::vector<std::uint8_t> frame_control(Session* session, wire::MessageType type, std::span<const std::uint8_t> payload,
                                        std::uint16_t version);
/// Sends a message on the control channel: sealed when there is a session, plain otherwise.
void send_control(Channel& ch, Session* session, wire::MessageType type, std::span<const std::uint8_t> payload,
                  Deadline deadline);
/// Sends a REJECT with `reason` (best effort, bounded to 500 ms; in the channel's version; sealed
/// when there is a session); never throws.
void send_reject(Channel& ch, Session* session, const std::string& reason) noexcept;
/// Receives one message: with a session it must be a SEALED frame that opens (else Error naming
/// what came: a message in the clear, or a frame that failed to authenticate).
Message recv_control(Channel& ch, Session* session, Deadline deadline, const std::string& peer);

}  // namespace rdmakit::detail
