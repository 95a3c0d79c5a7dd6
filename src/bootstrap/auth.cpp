// SPDX-License-Identifier: Apache-2.0
#include "bootstrap/auth.hpp"
#include "bootstrap/secret_file.hpp"

#include <sodium.h>

#include <algorithm>
#include <array>
#include <vector>
#include <cerrno>
#include <string_view>

#include <fmt/format.h>

#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail {
namespace {

using Nonce = std::array<std::uint8_t, kNonceSize>;
using Mac = std::array<std::uint8_t, kMacSize>;
// What each side sends in the clear: its nonce, then its ephemeral X25519 public key.
using Hello = std::array<std::uint8_t, kHelloSize>;

// A side's ephemeral X25519 key pair, wiped when it goes: one per handshake.
struct Ephemeral {
  std::array<std::uint8_t, crypto_scalarmult_SCALARBYTES> secret{};
  std::array<std::uint8_t, crypto_scalarmult_BYTES> pub{};
  Ephemeral() {
    ::randombytes_buf(secret.data(), secret.size());
    ::crypto_scalarmult_base(pub.data(), secret.data());
  }
  Ephemeral(const Ephemeral&) = delete;
  Ephemeral& operator=(const Ephemeral&) = delete;
  ~Ephemeral() { ::sodium_memzero(secret.data(), secret.size()); }
};
static_assert(crypto_scalarmult_BYTES == kNonceSize);

// Each side's MAC covers a label naming its role, so a client's proof can never be replayed as
// a server's (or reflected back), and both hellos (nonces and ephemeral keys), so neither side
// can replay an old session and no relay can swap an ephemeral key for its own.
constexpr std::string_view kServerLabel = "rdmakit server";
constexpr std::string_view kClientLabel = "rdmakit client";

void init_sodium() {
  // Thread-safe and idempotent; fails only when the system has no usable random source.
  if (::sodium_init() < 0) throw Error("sodium_init", EIO, "libsodium could not initialise (no random source?)");
}

Mac mac(std::span<const std::uint8_t> key, std::string_view label, const Hello& client, const Hello& server) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, key.data(), key.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(label.data()), label.size());
  crypto_auth_hmacsha256_update(&st, client.data(), client.size());
  crypto_auth_hmacsha256_update(&st, server.data(), server.size());
  Mac out{};
  crypto_auth_hmacsha256_final(&st, out.data());
  ::sodium_memzero(&st, sizeof st);
  return out;
}

// Constant time: how many leading bytes matched must not show in the timing.
bool same(const Mac& a, std::span<const std::uint8_t> b) {
  return b.size() == a.size() && ::crypto_verify_32(a.data(), b.data()) == 0;
}

Hello fresh_hello(const Ephemeral& e) {
  Hello h{};
  ::randombytes_buf(h.data(), kNonceSize);
  std::copy(e.pub.begin(), e.pub.end(), h.begin() + kNonceSize);
  return h;
}

// The X25519 secret both sides share, wiped when it goes.
struct Shared {
  std::array<std::uint8_t, crypto_scalarmult_BYTES> bytes{};
  Shared() = default;
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;
  ~Shared() { ::sodium_memzero(bytes.data(), bytes.size()); }
};

// False for a public key of low order (an all-zero result), which a peer sends only to force a
// known secret.
bool shared_secret(const Ephemeral& mine, const Hello& theirs, Shared& out) {
  return ::crypto_scalarmult(out.bytes.data(), mine.secret.data(), theirs.data() + kNonceSize) == 0;
}

// The server's refusals are sent as REJECT by the handshake that catches them; the client sends
// its own, since nothing above it talks to the server again.
[[noreturn]] void refuse(const std::string& peer, const std::string& why, std::string hint = {}) {
  throw Error("bootstrap authentication", EACCES, fmt::format("{}: {}", peer, why), std::move(hint));
}

}  // namespace

void check_key(std::span<const std::uint8_t> key) {
  if (!key.empty() && key.size() < kMinKeySize) {
    throw Error("pre-shared key", EINVAL, fmt::format("{} bytes; at least {}", key.size(), kMinKeySize),
                "use 32 random bytes: `rdmakit keygen FILE` writes them with the right mode");
  }
}

std::unique_ptr<Session> authenticate_client(Channel& ch, std::span<const std::uint8_t> key, Deadline deadline,
                                             const std::string& peer) {
  init_sodium();
  const Ephemeral eph;
  const Hello mine = fresh_hello(eph);
  send_control(ch, nullptr, wire::MessageType::auth_challenge, mine, deadline);  // before any session
  const Message reply = recv_message(ch, deadline);
  check_version_refusal(ch, reply, peer);
  if (reply.header.type == wire::MessageType::reject) {
    throw Error("bootstrap authentication", ECONNREFUSED,
                fmt::format("{} refused: {}", peer, wire::decode_reject(reply.payload)),
                "the server does not use a pre-shared key (or another version): give both sides the same key");
  }
  if (reply.header.type != wire::MessageType::auth_response || reply.payload.size() != kHelloSize + kMacSize) {
    throw Error("bootstrap authentication", EPROTO,
                fmt::format("{} answered the challenge with {} ({} bytes)", peer, wire::to_string(reply.header.type),
                            reply.payload.size()));
  }
  Hello theirs{};
  std::copy_n(reply.payload.begin(), kHelloSize, theirs.begin());
  const std::span<const std::uint8_t> their_mac(reply.payload.data() + kHelloSize, kMacSize);
  if (!same(mac(key, kServerLabel, mine, theirs), their_mac)) {
    // Nothing more than that: the server is not the one we meant, or its key differs.
    send_reject(ch, nullptr, "the server failed to prove it knows the pre-shared key");
    refuse(peer, "the server failed to prove it knows the pre-shared key",
           "the server uses another key (or is not the intended server): give both sides the same key");
  }
  // This client speaks an older version only after a refusal of its own: a server that says (under
  // its MAC) that it speaks a newer one did not send that refusal.
  if (ch.send_version() < wire::kVersion &&
      std::equal(kDowngradeMarker.begin(), kDowngradeMarker.end(), theirs.begin() + kNonceSize - kDowngradeMarker.size())) {
    // Told, so the server's operator sees it too; the client may try once more in its own version.
    send_reject(ch, nullptr,
                "the client refused: this server speaks a newer wire version than it was asked in, after the "
                "client's own was refused (a downgrade, or a mixed fleet)");
    throw NewerServer(peer, ch.send_version());
  }
  Shared dh;
  if (!shared_secret(eph, theirs, dh)) {
    refuse(peer, "the server's ephemeral key is of low order (it would force a known shared secret)",
           "the server is not rdmakit, or tampers with the handshake");
  }
  send_control(ch, nullptr, wire::MessageType::auth_proof, mac(key, kClientLabel, mine, theirs), deadline);
  return std::make_unique<Session>(key, mine, theirs, Role::client, dh.bytes, ch.send_version());
}

std::unique_ptr<Session> authenticate_server(Channel& ch, std::span<const std::uint8_t> key, const Message& first,
                                             Deadline deadline, const std::string& peer) {
  init_sodium();
  if (first.header.type != wire::MessageType::auth_challenge) {
    refuse(peer, "this listener requires authentication with a pre-shared key",
           "the client connected without a key");
  }
  if (first.payload.size() != kHelloSize) {
    refuse(peer, fmt::format("malformed challenge ({} bytes; {} are a nonce and an ephemeral key)", first.payload.size(),
                             kHelloSize),
           "an rdmakit of another protocol version (before 5 a challenge was a bare nonce): run the same version");
  }
  Hello theirs{};
  std::copy(first.payload.begin(), first.payload.end(), theirs.begin());
  const Ephemeral eph;
  Shared dh;
  if (!shared_secret(eph, theirs, dh)) refuse(peer, "its ephemeral key is of low order (it would force a known shared secret)");
  Hello mine = fresh_hello(eph);
  if (ch.send_version() < wire::kVersion) {
    std::copy(kDowngradeMarker.begin(), kDowngradeMarker.end(), mine.begin() + kNonceSize - kDowngradeMarker.size());
  }
  std::array<std::uint8_t, kHelloSize + kMacSize> response{};
  const Mac proof = mac(key, kServerLabel, theirs, mine);
  std::copy(mine.begin(), mine.end(), response.begin());
  std::copy(proof.begin(), proof.end(), response.begin() + kHelloSize);
  send_control(ch, nullptr, wire::MessageType::auth_response, response, deadline);
  const Message answer = recv_message(ch, deadline);
  if (answer.header.type != wire::MessageType::auth_proof ||
      !same(mac(key, kClientLabel, theirs, mine), answer.payload)) {
    refuse(peer, "authentication failed", "the client does not know the pre-shared key");
  }
  return std::make_unique<Session>(key, theirs, mine, Role::server, dh.bytes, ch.send_version());
}

}  // namespace rdmakit::detail

namespace rdmakit {

// A key file holds the key's bytes, all of them and nothing else: no newline is trimmed, so a
// binary key reads back exactly (a key given programmatically is the same bytes).
std::vector<std::uint8_t> read_key_file(const std::string& path) {
  std::vector<std::uint8_t> key = detail::read_secret_file(path, "read key file", detail::kMaxKeySize);
  if (key.size() < detail::kMinKeySize) {
    const std::size_t n = key.size();
    detail::wipe(key);
    throw Error("read key file", EINVAL,
                fmt::format("{}: {} bytes; a key needs at least {}", path, n, detail::kMinKeySize),
                "`rdmakit keygen FILE` writes a fresh 32-byte key");
  }
  return key;
}

void generate_key_file(const std::string& path) {
  if (::sodium_init() < 0) throw Error("sodium_init", EIO, "libsodium could not initialise (no random source?)");
  std::array<std::uint8_t, 32> key{};
  ::randombytes_buf(key.data(), key.size());
  try {
    detail::write_new_file(path, key, 0600, "write key file");
  } catch (...) {
    ::sodium_memzero(key.data(), key.size());
    throw;
  }
  ::sodium_memzero(key.data(), key.size());
}

}  // namespace rdmakit
