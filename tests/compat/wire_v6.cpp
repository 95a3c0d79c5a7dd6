// SPDX-License-Identifier: Apache-2.0
// FROZEN: see wire_v6.hpp. Never change what this sends or accepts.
#include "wire_v6.hpp"

#include <sodium.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <string_view>

namespace compat::v6 {
namespace {

constexpr std::size_t kHelloFixedSize = 42;
constexpr std::size_t kBlockSize = 1 + 16 + 4 + 8 + 32 + 32 + 1 + 1;  // no engine protocol byte
constexpr std::size_t kNonceSize = 32;
constexpr std::size_t kHelloSize = 64;  // nonce and ephemeral X25519 public key
constexpr std::size_t kMacSize = 32;
constexpr std::size_t kTagSize = 16;
constexpr std::string_view kServerLabel = "rdmakit server";
constexpr std::string_view kClientLabel = "rdmakit client";
constexpr std::string_view kSalt = "rdmakit v5 session";
constexpr std::string_view kClientToServer = "rdmakit v5 client to server";
constexpr std::string_view kServerToClient = "rdmakit v5 server to client";

[[noreturn]] void fail(const std::string& why) { throw std::runtime_error("v6 peer: " + why); }

void put(std::vector<std::uint8_t>& out, std::uint64_t v, int n) {
  for (int i = n - 1; i >= 0; --i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

struct Reader {
  std::span<const std::uint8_t> b;
  std::size_t at = 0;
  std::uint64_t get(int n) {
    if (b.size() - at < static_cast<std::size_t>(n)) fail("truncated");
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | b[at++];
    return v;
  }
  template <std::size_t N>
  void bytes(std::array<std::uint8_t, N>& out) {
    for (auto& o : out) o = static_cast<std::uint8_t>(get(1));
  }
};

std::span<const std::uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

void hmac(std::span<const std::uint8_t> key, std::initializer_list<std::span<const std::uint8_t>> parts, std::uint8_t* out) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, key.data(), key.size());
  for (const auto& p : parts) crypto_auth_hmacsha256_update(&st, p.data(), p.size());
  crypto_auth_hmacsha256_final(&st, out);
}

std::array<std::uint8_t, crypto_aead_xchacha20poly1305_ietf_NPUBBYTES> nonce_of(std::uint64_t seq) {
  std::array<std::uint8_t, crypto_aead_xchacha20poly1305_ietf_NPUBBYTES> n{};
  for (int i = 0; i < 8; ++i) n[n.size() - 1 - static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(seq >> (8 * i));
  return n;
}

std::array<std::uint8_t, kMacSize> mac(std::span<const std::uint8_t> key, std::string_view label,
                                       std::span<const std::uint8_t> client, std::span<const std::uint8_t> server) {
  std::array<std::uint8_t, kMacSize> out{};
  hmac(key, {bytes_of(label), client, server}, out.data());
  return out;
}

// This side's hello (a nonce, then the X25519 public key of `secret`, drawn here).
std::array<std::uint8_t, kHelloSize> fresh_hello(std::array<std::uint8_t, crypto_scalarmult_SCALARBYTES>& secret) {
  ::randombytes_buf(secret.data(), secret.size());
  std::array<std::uint8_t, kHelloSize> hello{};
  ::randombytes_buf(hello.data(), kNonceSize);
  ::crypto_scalarmult_base(hello.data() + kNonceSize, secret.data());
  return hello;
}

}  // namespace

std::vector<std::uint8_t> message(std::uint16_t type, std::span<const std::uint8_t> payload) {
  std::vector<std::uint8_t> out;
  put(out, kMagic, 4);
  put(out, kVersion, 2);
  put(out, type, 2);
  put(out, payload.size(), 4);
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

std::vector<std::uint8_t> encode_hello(const Hello& h) {
  std::vector<std::uint8_t> out;
  put(out, h.qpn, 4);
  put(out, h.psn, 4);
  put(out, h.lid, 2);
  out.push_back(h.link_layer);
  out.push_back(h.gid_type);
  out.insert(out.end(), h.gid.begin(), h.gid.end());
  put(out, h.gid_index, 4);
  put(out, h.mtu, 2);
  out.push_back(h.max_rd_atomic);
  out.push_back(h.max_dest_rd_atomic);
  put(out, h.regions.size(), 2);
  put(out, 1 + h.extra_qps.size(), 2);
  put(out, (h.flags & 1u) | (h.has_block ? 2u : 0u), 2);
  for (const auto& [qpn, psn] : h.extra_qps) {
    put(out, qpn, 4);
    put(out, psn, 4);
  }
  for (const Region& r : h.regions) {
    put(out, r.addr, 8);
    put(out, r.length, 8);
    put(out, r.rkey, 4);
    put(out, r.access, 4);
  }
  if (h.has_block) {
    out.push_back(static_cast<std::uint8_t>(h.kinds.size()));
    out.insert(out.end(), h.kinds.begin(), h.kinds.end());
    out.insert(out.end(), h.host.begin(), h.host.end());
    put(out, h.pid, 4);
    put(out, h.proof_addr, 8);
    out.insert(out.end(), h.proof.begin(), h.proof.end());
    out.insert(out.end(), h.token.begin(), h.token.end());
    out.push_back(h.streams);
    out.push_back(static_cast<std::uint8_t>(h.socket.size()));
    out.insert(out.end(), h.socket.begin(), h.socket.end());
  }
  return out;
}

Hello decode_hello(std::span<const std::uint8_t> p) {
  if (p.size() < kHelloFixedSize) fail("truncated HELLO");
  Reader r{p};
  Hello h;
  h.qpn = static_cast<std::uint32_t>(r.get(4));
  h.psn = static_cast<std::uint32_t>(r.get(4));
  h.lid = static_cast<std::uint16_t>(r.get(2));
  h.link_layer = static_cast<std::uint8_t>(r.get(1));
  h.gid_type = static_cast<std::uint8_t>(r.get(1));
  r.bytes(h.gid);
  h.gid_index = static_cast<std::uint32_t>(r.get(4));
  h.mtu = static_cast<std::uint16_t>(r.get(2));
  h.max_rd_atomic = static_cast<std::uint8_t>(r.get(1));
  h.max_dest_rd_atomic = static_cast<std::uint8_t>(r.get(1));
  const auto regions = static_cast<std::size_t>(r.get(2));
  const auto qps = static_cast<std::size_t>(r.get(2));
  h.flags = static_cast<std::uint16_t>(r.get(2));
  if (regions > 1024 || qps == 0 || qps > 16) fail("absurd counts");
  if ((h.flags & ~3u) != 0) fail("unknown capability flags");
  h.has_block = (h.flags & 2u) != 0;
  std::size_t want = kHelloFixedSize + (qps - 1) * 8 + regions * 24;
  std::size_t kinds = 0, socket = 0;
  if (h.has_block) {
    if (p.size() <= want) fail("truncated HELLO: its transport block is missing");
    kinds = p[want];
    if (kinds == 0 || kinds > 8) fail("absurd transport count");
    want += kBlockSize + kinds;
    if (p.size() < want) fail("truncated transport block");
    socket = p[want - 1];
    if (socket > 100) fail("absurd socket name length");
    want += socket;
  }
  if (p.size() != want) fail("HELLO of " + std::to_string(p.size()) + " bytes where " + std::to_string(want) + " are due");
  for (std::size_t k = 1; k < qps; ++k) {
    const auto qpn = static_cast<std::uint32_t>(r.get(4));
    h.extra_qps.emplace_back(qpn, static_cast<std::uint32_t>(r.get(4)));
  }
  for (std::size_t k = 0; k < regions; ++k) {
    Region g;
    g.addr = r.get(8);
    g.length = r.get(8);
    g.rkey = static_cast<std::uint32_t>(r.get(4));
    g.access = static_cast<std::uint32_t>(r.get(4));
    h.regions.push_back(g);
  }
  if (h.has_block) {
    (void)r.get(1);
    for (std::size_t k = 0; k < kinds; ++k) {
      const auto v = static_cast<std::uint8_t>(r.get(1));
      if (v < 1 || v > 3) fail("unknown transport");
      h.kinds.push_back(v);
    }
    r.bytes(h.host);
    h.pid = static_cast<std::uint32_t>(r.get(4));
    h.proof_addr = r.get(8);
    r.bytes(h.proof);
    r.bytes(h.token);
    h.streams = static_cast<std::uint8_t>(r.get(1));
    (void)r.get(1);
    for (std::size_t k = 0; k < socket; ++k) h.socket.push_back(static_cast<char>(r.get(1)));
  }
  const bool rdma = !h.has_block || std::find(h.kinds.begin(), h.kinds.end(), std::uint8_t{1}) != h.kinds.end();
  if (rdma && (h.qpn == 0 || h.qpn >= (1u << 24) || h.psn >= (1u << 24))) fail("QPN or PSN out of range");
  if (rdma && h.mtu != 256 && h.mtu != 512 && h.mtu != 1024 && h.mtu != 2048 && h.mtu != 4096) fail("invalid MTU");
  return h;
}

Peer::Peer(int fd, std::vector<std::uint8_t> psk) : fd_(fd), psk_(std::move(psk)) {
  if (::sodium_init() < 0) fail("sodium_init");
}

Peer::~Peer() {
  ::sodium_memzero(tx_.data(), tx_.size());
  ::sodium_memzero(rx_.data(), rx_.size());
}

void Peer::send_raw(const std::vector<std::uint8_t>& bytes) {
  if (::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(bytes.size())) {
    fail(std::string("send: ") + std::strerror(errno));
  }
}

Received Peer::recv_raw() {
  auto fill = [&](std::uint8_t* p, std::size_t n) {
    for (std::size_t got = 0; got < n;) {
      const ssize_t k = ::recv(fd_, p + got, n - got, 0);
      if (k <= 0) fail(k == 0 ? "the peer closed" : std::string("recv: ") + std::strerror(errno));
      got += static_cast<std::size_t>(k);
    }
  };
  std::array<std::uint8_t, kHeaderSize> head{};
  fill(head.data(), head.size());
  Reader r{head};
  if (r.get(4) != kMagic) fail("bad magic");
  Received m;
  m.version = static_cast<std::uint16_t>(r.get(2));
  m.type = static_cast<std::uint16_t>(r.get(2));
  const auto length = static_cast<std::size_t>(r.get(4));
  if (length > 64 * 1024) fail("oversized");
  m.payload.resize(length);
  fill(m.payload.data(), length);
  return m;
}

bool Peer::serve_first(std::string* refused) {
  Received first = recv_raw();
  if (first.version != kVersion) {
    // As version 6's listener did: decode_header's Error, whole, in a REJECT of version 6.
    const std::string why = "bootstrap decode failed: EBADMSG (Bad message): protocol version mismatch: peer speaks " +
                            std::to_string(first.version) + ", this side speaks 6. Hint: run the same rdmakit "
                            "protocol version on both hosts";
    send_raw(message(reject, bytes_of(why)));
    if (refused != nullptr) *refused = why;
    return false;
  }
  if (!psk_.empty()) {
    authenticate_server(first);
  } else {
    first_ = std::move(first);
    have_first_ = true;
  }
  return true;
}

void Peer::authenticate_client() {
  if (psk_.empty()) return;
  std::array<std::uint8_t, crypto_scalarmult_SCALARBYTES> secret{};
  const auto mine = fresh_hello(secret);
  send_raw(message(auth_challenge, mine));
  const Received reply = recv_raw();
  if (reply.version != kVersion) fail("a reply in version " + std::to_string(reply.version));
  if (reply.type != auth_response || reply.payload.size() != kHelloSize + kMacSize) fail("no AUTH_RESPONSE");
  const std::span<const std::uint8_t> theirs(reply.payload.data(), kHelloSize);
  const auto want = mac(psk_, kServerLabel, mine, theirs);
  if (::crypto_verify_32(want.data(), reply.payload.data() + kHelloSize) != 0) fail("the server's proof is wrong");
  std::array<std::uint8_t, crypto_scalarmult_BYTES> dh{};
  if (::crypto_scalarmult(dh.data(), secret.data(), theirs.data() + kNonceSize) != 0) fail("low-order key");
  send_raw(message(auth_proof, mac(psk_, kClientLabel, mine, theirs)));
  derive_keys(mine, theirs, dh, /*client=*/true);
  ::sodium_memzero(secret.data(), secret.size());
  ::sodium_memzero(dh.data(), dh.size());
}

void Peer::authenticate_server(const Received& challenge) {
  if (challenge.type != auth_challenge || challenge.payload.size() != kHelloSize) fail("no AUTH_CHALLENGE");
  std::array<std::uint8_t, crypto_scalarmult_SCALARBYTES> secret{};
  const auto mine = fresh_hello(secret);
  const std::span<const std::uint8_t> theirs(challenge.payload);
  std::array<std::uint8_t, crypto_scalarmult_BYTES> dh{};
  if (::crypto_scalarmult(dh.data(), secret.data(), theirs.data() + kNonceSize) != 0) fail("low-order key");
  std::vector<std::uint8_t> response(mine.begin(), mine.end());
  const auto proof = mac(psk_, kServerLabel, theirs, mine);
  response.insert(response.end(), proof.begin(), proof.end());
  send_raw(message(auth_response, response));
  const Received answer = recv_raw();
  const auto want = mac(psk_, kClientLabel, theirs, mine);
  if (answer.version != kVersion || answer.type != auth_proof || answer.payload.size() != kMacSize ||
      ::crypto_verify_32(want.data(), answer.payload.data()) != 0) {
    fail("authentication failed");
  }
  derive_keys(theirs, mine, dh, /*client=*/false);
  ::sodium_memzero(secret.data(), secret.size());
  ::sodium_memzero(dh.data(), dh.size());
}

// HKDF-SHA256 with one output block: extract with the label and both hellos as salt over
// psk | dh, expand with a label per direction.
void Peer::derive_keys(std::span<const std::uint8_t> client_hello, std::span<const std::uint8_t> server_hello,
                       std::span<const std::uint8_t> dh, bool client) {
  std::vector<std::uint8_t> salt(kSalt.begin(), kSalt.end());
  salt.insert(salt.end(), client_hello.begin(), client_hello.end());
  salt.insert(salt.end(), server_hello.begin(), server_hello.end());
  std::array<std::uint8_t, 32> prk{};
  hmac(salt, {psk_, dh}, prk.data());
  const std::uint8_t one = 1;
  hmac(prk, {bytes_of(kClientToServer), {&one, 1}}, client ? tx_.data() : rx_.data());
  hmac(prk, {bytes_of(kServerToClient), {&one, 1}}, client ? rx_.data() : tx_.data());
  ::sodium_memzero(prk.data(), prk.size());
  sealed_ = true;
}

void Peer::send(std::uint16_t type, std::span<const std::uint8_t> payload) {
  if (!sealed_) return send_raw(message(type, payload));
  const std::vector<std::uint8_t> inner = message(type, payload);
  std::vector<std::uint8_t> frame = message(sealed, std::vector<std::uint8_t>(inner.size() + kTagSize));
  unsigned long long n = 0;
  const auto nonce = nonce_of(tx_seq_++);
  crypto_aead_xchacha20poly1305_ietf_encrypt(frame.data() + kHeaderSize, &n, inner.data(), inner.size(), frame.data(),
                                             kHeaderSize, nullptr, nonce.data(), tx_.data());
  send_raw(frame);
}

Received Peer::recv() {
  if (have_first_) {
    have_first_ = false;
    return std::move(first_);
  }
  Received m = recv_raw();
  if (m.version != kVersion) fail("a message in version " + std::to_string(m.version));
  if (!sealed_) return m;
  if (m.type != sealed || m.payload.size() < kHeaderSize + kTagSize) fail("a message in the clear after the key proof");
  const std::vector<std::uint8_t> header = message(sealed, std::vector<std::uint8_t>(m.payload.size()));
  std::vector<std::uint8_t> inner(m.payload.size() - kTagSize);
  unsigned long long n = 0;
  const auto nonce = nonce_of(rx_seq_);
  if (crypto_aead_xchacha20poly1305_ietf_decrypt(inner.data(), &n, nullptr, m.payload.data(), m.payload.size(),
                                                 header.data(), kHeaderSize, nonce.data(), rx_.data()) != 0) {
    fail("a sealed frame failed to open");
  }
  ++rx_seq_;
  Reader r{inner};
  if (r.get(4) != kMagic || r.get(2) != kVersion) fail("a sealed message of another version");
  Received out;
  out.version = kVersion;
  out.type = static_cast<std::uint16_t>(r.get(2));
  if (r.get(4) != inner.size() - kHeaderSize) fail("a sealed message's length");
  out.payload.assign(inner.begin() + kHeaderSize, inner.end());
  return out;
}

}  // namespace compat::v6
