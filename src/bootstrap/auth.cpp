#include "bootstrap/auth.hpp"

#include <sodium.h>
#include <sys/stat.h>

#include <array>
#include <fstream>
#include <iterator>
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

// Each side's MAC covers a label naming its role, so a client's proof can never be replayed as
// a server's (or reflected back), and both nonces, so neither side can replay an old session.
constexpr std::string_view kServerLabel = "rdmakit server";
constexpr std::string_view kClientLabel = "rdmakit client";

void init_sodium() {
  // Thread-safe and idempotent; fails only when the system has no usable random source.
  if (::sodium_init() < 0) throw Error("sodium_init", EIO, "libsodium could not initialise (no random source?)");
}

Mac mac(std::span<const std::uint8_t> key, std::string_view label, const Nonce& client, const Nonce& server) {
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

Nonce fresh_nonce() {
  Nonce n{};
  ::randombytes_buf(n.data(), n.size());
  return n;
}

void send_message(int fd, wire::MessageType type, std::span<const std::uint8_t> payload, Deadline deadline) {
  auto msg = wire::encode_header(type, static_cast<std::uint32_t>(payload.size()));
  msg.insert(msg.end(), payload.begin(), payload.end());
  send_all(fd, msg, deadline);
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
                "use 32 random bytes, e.g. `head -c 32 /dev/urandom > key; chmod 600 key`");
  }
}

void authenticate_client(int fd, std::span<const std::uint8_t> key, Deadline deadline, const std::string& peer) {
  init_sodium();
  const Nonce mine = fresh_nonce();
  send_message(fd, wire::MessageType::auth_challenge, mine, deadline);
  const Message reply = recv_message(fd, deadline);
  if (reply.header.type == wire::MessageType::reject) {
    throw Error("bootstrap authentication", ECONNREFUSED,
                fmt::format("{} refused: {}", peer, wire::decode_reject(reply.payload)),
                "the server does not use a pre-shared key (or another version): give both sides the same key");
  }
  if (reply.header.type != wire::MessageType::auth_response || reply.payload.size() != kNonceSize + kMacSize) {
    throw Error("bootstrap authentication", EPROTO,
                fmt::format("{} answered the challenge with {} ({} bytes)", peer, wire::to_string(reply.header.type),
                            reply.payload.size()));
  }
  Nonce theirs{};
  std::copy_n(reply.payload.begin(), kNonceSize, theirs.begin());
  const std::span<const std::uint8_t> their_mac(reply.payload.data() + kNonceSize, kMacSize);
  if (!same(mac(key, kServerLabel, mine, theirs), their_mac)) {
    // Nothing more than that: the server is not the one we meant, or its key differs.
    try {
      send_all(fd, wire::encode_reject("the server failed to prove it knows the pre-shared key"),
               deadline_in(std::chrono::milliseconds{500}));
    } catch (const std::exception&) {
    }
    refuse(peer, "the server failed to prove it knows the pre-shared key",
           "the server uses another key (or is not the intended server): give both sides the same key");
  }
  send_message(fd, wire::MessageType::auth_proof, mac(key, kClientLabel, mine, theirs), deadline);
}

void authenticate_server(int fd, std::span<const std::uint8_t> key, const Message& first, Deadline deadline,
                         const std::string& peer) {
  init_sodium();
  if (first.header.type != wire::MessageType::auth_challenge) {
    refuse(peer, "this listener requires authentication with a pre-shared key",
           "the client connected without a key");
  }
  if (first.payload.size() != kNonceSize) {
    refuse(peer, fmt::format("malformed challenge ({} bytes)", first.payload.size()));
  }
  Nonce theirs{};
  std::copy(first.payload.begin(), first.payload.end(), theirs.begin());
  const Nonce mine = fresh_nonce();
  std::array<std::uint8_t, kNonceSize + kMacSize> response{};
  const Mac proof = mac(key, kServerLabel, theirs, mine);
  std::copy(mine.begin(), mine.end(), response.begin());
  std::copy(proof.begin(), proof.end(), response.begin() + kNonceSize);
  send_message(fd, wire::MessageType::auth_response, response, deadline);
  const Message answer = recv_message(fd, deadline);
  if (answer.header.type != wire::MessageType::auth_proof ||
      !same(mac(key, kClientLabel, theirs, mine), answer.payload)) {
    refuse(peer, "authentication failed", "the client does not know the pre-shared key");
  }
}

}  // namespace rdmakit::detail

namespace rdmakit {

std::vector<std::uint8_t> read_key_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw Error("read key file", errno, path);
  if ((st.st_mode & 077) != 0) {
    throw Error("read key file", EPERM,
                fmt::format("{} can be read by other users (mode {:o})", path, st.st_mode & 0777),
                fmt::format("a key others can read is no secret: chmod 600 {}", path));
  }
  std::ifstream f(path, std::ios::binary);
  std::vector<std::uint8_t> key((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!f.good() && !f.eof()) throw Error("read key file", EIO, path);
  while (!key.empty() && (key.back() == '\n' || key.back() == '\r' || key.back() == ' ' || key.back() == '\t')) {
    key.pop_back();
  }
  if (key.size() < detail::kMinKeySize) {
    throw Error("read key file", EINVAL,
                fmt::format("{}: {} bytes; a key needs at least {}", path, key.size(), detail::kMinKeySize),
                "use 32 random bytes, e.g. `head -c 32 /dev/urandom > key; chmod 600 key`");
  }
  return key;
}

}  // namespace rdmakit
