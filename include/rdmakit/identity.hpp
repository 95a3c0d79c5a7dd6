// SPDX-License-Identifier: Apache-2.0
#pragma once
// An engine's long-term identity: an Ed25519 key pair. Its public key names the engine to its
// peers (given to add_peer, published in the metadata store, pinned on first use); the secret
// half signs each link's session, so only its holder can be at the other end of a link that
// says it is that engine (docs/security.md, "Engine identities").

#include <cstdint>
#include <span>
#include <string>
#include <vector>

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// A key pair, or none (default). Copyable: a copy holds the secret too; every copy wipes it
/// when it goes. Thread-safe for concurrent const use.
class Identity {
 public:
  /// None: the engine proves no identity (keyless and PSK-only engines).
  Identity() noexcept = default;
  Identity(const Identity& other);
  Identity& operator=(const Identity& other);
  Identity(Identity&& other) noexcept;
  Identity& operator=(Identity&& other) noexcept;
  ~Identity();

  /// A fresh key pair from the system's random source.
  [[nodiscard]] static Identity generate();
  /// From a 32-byte seed (a secret manager's, or a test's): the same seed is the same identity.
  /// Throws Error for another length.
  [[nodiscard]] static Identity from_seed(std::span<const std::uint8_t> seed);
  /// Reads an identity file (`rdmakit keygen --identity FILE` writes one). The same checks as
  /// read_key_file (no symbolic link, a regular file of this process's user, mode 0600); throws
  /// Error when it fails them or is not an identity file (a pre-shared key file, say).
  [[nodiscard]] static Identity from_file(const std::string& path);
  /// Writes the secret to a new file `path` (mode 0600, never overwriting) and the public key
  /// to `path.pub` (mode 0644, one line). Throws Error when either exists or cannot be written.
  void save(const std::string& path) const;

  [[nodiscard]] bool empty() const noexcept { return secret_.empty(); }
  /// "ed25519:" and 43 characters of URL-safe base64: what add_peer, EngineConfig and the store
  /// take. Empty for none.
  [[nodiscard]] const std::string& public_key() const noexcept { return public_key_; }
  /// The 64-byte Ed25519 signature of `message`. Throws Error when empty().
  [[nodiscard]] std::vector<std::uint8_t> sign(std::span<const std::uint8_t> message) const;

 private:
  std::vector<std::uint8_t> secret_;  // libsodium's Ed25519 secret key: seed | public key
  std::string public_key_;
};

/// Throws Error (EINVAL, saying what is wrong) unless `public_key` is an Identity::public_key()
/// text: "ed25519:" and 43 characters of URL-safe base64 without padding.
void check_public_key(const std::string& public_key);

}  // namespace rdmakit
#pragma GCC visibility pop
