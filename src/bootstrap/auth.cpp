#include "bootstrap/auth.hpp"

#include <fcntl.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

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
  const Nonce mine = fresh_nonce();
  send_control(ch, nullptr, wire::MessageType::auth_challenge, mine, deadline);  // before any session
  const Message reply = recv_message(ch, deadline);
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
      ch.send_all(wire::encode_reject("the server failed to prove it knows the pre-shared key"),
               deadline_in(std::chrono::milliseconds{500}));
    } catch (const std::exception&) {
    }
    refuse(peer, "the server failed to prove it knows the pre-shared key",
           "the server uses another key (or is not the intended server): give both sides the same key");
  }
  send_control(ch, nullptr, wire::MessageType::auth_proof, mac(key, kClientLabel, mine, theirs), deadline);
  return std::make_unique<Session>(key, mine, theirs, Role::client);
}

std::unique_ptr<Session> authenticate_server(Channel& ch, std::span<const std::uint8_t> key, const Message& first,
                                             Deadline deadline, const std::string& peer) {
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
  send_control(ch, nullptr, wire::MessageType::auth_response, response, deadline);
  const Message answer = recv_message(ch, deadline);
  if (answer.header.type != wire::MessageType::auth_proof ||
      !same(mac(key, kClientLabel, theirs, mine), answer.payload)) {
    refuse(peer, "authentication failed", "the client does not know the pre-shared key");
  }
  return std::make_unique<Session>(key, theirs, mine, Role::server);
}

}  // namespace rdmakit::detail

namespace rdmakit {

// A key file holds the key's bytes, all of them and nothing else: no newline is trimmed, so a
// binary key reads back exactly (a key given programmatically is the same bytes). It is opened
// without following a symbolic link, and its owner and mode are checked on the open file, so no
// one can swap it between the check and the read.
std::vector<std::uint8_t> read_key_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    throw Error("read key file", err, path,
                err == ELOOP ? "it is a symbolic link: give the key file itself (a link could be "
                               "pointed elsewhere by whoever can change it)"
                             : "");
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error("read key file", errno, path);
  if (!S_ISREG(st.st_mode)) throw Error("read key file", EINVAL, fmt::format("{} is not a regular file", path));
  if (st.st_uid != ::geteuid()) {
    throw Error("read key file", EPERM,
                fmt::format("{} belongs to uid {}, not to this process's uid {}", path, st.st_uid, ::geteuid()),
                "a key file must belong to the user that reads it (whoever owns it can change it)");
  }
  if ((st.st_mode & 077) != 0) {
    throw Error("read key file", EPERM,
                fmt::format("{} can be read or written by other users (mode {:o})", path, st.st_mode & 0777),
                fmt::format("a key others can read is no secret: chmod 600 {}", path));
  }
  if (st.st_size > static_cast<off_t>(detail::kMaxKeySize)) {
    throw Error("read key file", EFBIG,
                fmt::format("{}: {} bytes; a key file holds at most {}", path, st.st_size, detail::kMaxKeySize),
                "is it the key? `rdmakit keygen FILE` writes one");
  }
  std::vector<std::uint8_t> key(static_cast<std::size_t>(st.st_size));
  std::size_t got = 0;
  while (got < key.size()) {
    const ssize_t n = ::read(fd, key.data() + got, key.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      detail::wipe(key);
      throw Error("read key file", n < 0 ? errno : EIO, path);
    }
    got += static_cast<std::size_t>(n);
  }
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
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    throw Error("write key file", err, path,
                err == EEXIST ? "it exists already; a key is not overwritten (remove it first)" : "");
  }
  std::array<std::uint8_t, 32> key{};
  ::randombytes_buf(key.data(), key.size());
  const bool ok = ::fchmod(fd, 0600) == 0 && ::write(fd, key.data(), key.size()) == static_cast<ssize_t>(key.size()) &&
                  ::fsync(fd) == 0;
  const int err = errno;
  ::sodium_memzero(key.data(), key.size());
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());
    throw Error("write key file", err, path);
  }
}

}  // namespace rdmakit
