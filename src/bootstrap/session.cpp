// SPDX-License-Identifier: Apache-2.0
#include "bootstrap/session.hpp"

#include <sodium.h>

#include <cerrno>
#include <string_view>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {

namespace {

using Key = std::array<std::uint8_t, kSessionKeySize>;

// HKDF-SHA256 (RFC 5869) with one output block: extract with the nonces as salt, expand with a
// label naming the direction. The "v5" is the version that introduced this schedule: versions 6
// and 7 keep it (a session's version is in every frame's authenticated header instead).
constexpr std::string_view kSalt = "rdmakit v5 session";
constexpr std::string_view kClientToServer = "rdmakit v5 client to server";
constexpr std::string_view kServerToClient = "rdmakit v5 server to client";
constexpr std::string_view kBinding = "rdmakit v5 channel binding";

void hmac(std::span<const std::uint8_t> key, std::initializer_list<std::span<const std::uint8_t>> parts,
          std::uint8_t* out) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, key.data(), key.size());
  for (const auto& p : parts) crypto_auth_hmacsha256_update(&st, p.data(), p.size());
  crypto_auth_hmacsha256_final(&st, out);
  ::sodium_memzero(&st, sizeof st);
}

std::span<const std::uint8_t> bytes(std::string_view s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

Key expand(const Key& prk, std::string_view label) {
  Key out{};
  const std::uint8_t one = 1;
  hmac(prk, {bytes(label), {&one, 1}}, out.data());
  return out;
}

std::array<std::uint8_t, crypto_aead_xchacha20poly1305_ietf_NPUBBYTES> nonce_of(std::uint64_t seq) {
  std::array<std::uint8_t, crypto_aead_xchacha20poly1305_ietf_NPUBBYTES> n{};
  for (int i = 0; i < 8; ++i) n[n.size() - 1 - static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(seq >> (8 * i));
  return n;
}

static_assert(crypto_aead_xchacha20poly1305_ietf_ABYTES == kSealTagSize);
static_assert(crypto_aead_xchacha20poly1305_ietf_KEYBYTES == kSessionKeySize);

}  // namespace

Secret::Secret(std::span<const std::uint8_t> b) : bytes_(b.begin(), b.end()) {}
Secret::~Secret() { wipe(bytes_); }

void wipe(std::vector<std::uint8_t>& v) noexcept {
  if (!v.empty()) ::sodium_memzero(v.data(), v.size());
  v.clear();
}

Session::Session(std::span<const std::uint8_t> psk, std::span<const std::uint8_t> client_hello,
                 std::span<const std::uint8_t> server_hello, Role role, std::span<const std::uint8_t> dh,
                 std::uint16_t version)
    : version_(version) {
  if (::sodium_init() < 0) throw Error("sodium_init", EIO, "libsodium could not initialise");
  std::vector<std::uint8_t> salt(kSalt.begin(), kSalt.end());
  salt.insert(salt.end(), client_hello.begin(), client_hello.end());
  salt.insert(salt.end(), server_hello.begin(), server_hello.end());
  Key prk{};
  hmac(salt, {psk, dh}, prk.data());
  const Key c2s = expand(prk, kClientToServer);
  const Key s2c = expand(prk, kServerToClient);
  binding_ = expand(prk, kBinding);
  tx_ = role == Role::client ? c2s : s2c;
  rx_ = role == Role::client ? s2c : c2s;
  ::sodium_memzero(prk.data(), prk.size());
}

Session::~Session() {
  ::sodium_memzero(tx_.data(), tx_.size());
  ::sodium_memzero(rx_.data(), rx_.size());
  ::sodium_memzero(binding_.data(), binding_.size());
}

std::vector<std::uint8_t> Session::seal(wire::MessageType type, std::span<const std::uint8_t> payload) {
  std::vector<std::uint8_t> inner = wire::encode_header(type, static_cast<std::uint32_t>(payload.size()), version_);
  inner.insert(inner.end(), payload.begin(), payload.end());
  const auto header = wire::encode_header(wire::MessageType::sealed,
                                          static_cast<std::uint32_t>(inner.size() + kSealTagSize), version_);
  std::vector<std::uint8_t> frame(header.size() + inner.size() + kSealTagSize);
  std::copy(header.begin(), header.end(), frame.begin());
  unsigned long long n = 0;
  const auto nonce = nonce_of(tx_seq_++);
  crypto_aead_xchacha20poly1305_ietf_encrypt(frame.data() + header.size(), &n, inner.data(), inner.size(),
                                             header.data(), header.size(), nullptr, nonce.data(), tx_.data());
  ::sodium_memzero(inner.data(), inner.size());
  return frame;
}

std::optional<Message> Session::open(const wire::Header& outer, std::span<const std::uint8_t> sealed) noexcept {
  if (outer.type != wire::MessageType::sealed || outer.version != version_ || sealed.size() != outer.length ||
      sealed.size() < wire::kHeaderSize + kSealTagSize) {
    return std::nullopt;
  }
  try {
    const auto header = wire::encode_header(wire::MessageType::sealed, outer.length, version_);
    std::vector<std::uint8_t> inner(sealed.size() - kSealTagSize);
    unsigned long long n = 0;
    const auto nonce = nonce_of(rx_seq_);
    if (crypto_aead_xchacha20poly1305_ietf_decrypt(inner.data(), &n, nullptr, sealed.data(), sealed.size(),
                                                   header.data(), header.size(), nonce.data(), rx_.data()) != 0) {
      return std::nullopt;
    }
    const auto h = wire::try_decode_header(inner);
    if (!h || h->type == wire::MessageType::sealed || h->version != version_ || h->length != inner.size() - wire::kHeaderSize) {
      return std::nullopt;
    }
    ++rx_seq_;
    Message m{*h, {inner.begin() + static_cast<std::ptrdiff_t>(wire::kHeaderSize), inner.end()}};
    ::sodium_memzero(inner.data(), inner.size());
    return m;
  } catch (...) {
    return std::nullopt;
  }
}

std::vector<std::uint8_t> frame_control(Session* session, wire::MessageType type, std::span<const std::uint8_t> payload,
                                        std::uint16_t version) {
  if (session != nullptr) return session->seal(type, payload);
  auto msg = wire::encode_header(type, static_cast<std::uint32_t>(payload.size()), version);
  msg.insert(msg.end(), payload.begin(), payload.end());
  return msg;
}

void send_control(Channel& ch, Session* session, wire::MessageType type, std::span<const std::uint8_t> payload,
                  Deadline deadline) {
  ch.send_all(frame_control(session, type, payload, ch.send_version()), deadline);
}

void send_reject(Channel& ch, Session* session, const std::string& reason) noexcept {
  try {
    const auto msg = wire::encode_reject(reason);  // cut to its longest reason
    send_control(ch, session, wire::MessageType::reject, std::span(msg).subspan(wire::kHeaderSize),
                 deadline_in(std::chrono::milliseconds{500}));
  } catch (const std::exception&) {
    // The peer is gone or stalled: it learns nothing more either way.
  }
}

Message recv_control(Channel& ch, Session* session, Deadline deadline, const std::string& peer) {
  Message m = recv_message(ch, deadline);
  if (session == nullptr) return m;
  if (m.header.type != wire::MessageType::sealed) {
    throw Error("bootstrap session", EBADMSG,
                fmt::format("{} sent {} in the clear where an encrypted frame was due", peer,
                            wire::to_string(m.header.type)),
                "after authentication every message is sealed with the session key: this one was "
                "injected (a relay that does not hold the key) or the peer is not rdmakit");
  }
  auto opened = session->open(m.header, m.payload);
  if (!opened) {
    throw Error("bootstrap session", EBADMSG,
                fmt::format("a frame from {} failed to authenticate ({} bytes)", peer, m.payload.size()),
                "it was altered, replayed, reordered or truncated on the way, or not sealed with this "
                "session's key; nothing in it was used");
  }
  return std::move(*opened);
}

}  // namespace rdmakit::detail
