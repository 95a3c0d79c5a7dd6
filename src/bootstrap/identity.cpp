// SPDX-License-Identifier: Apache-2.0
#include "rdmakit/identity.hpp"

#include <sodium.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string_view>

#include <fmt/format.h>

#include "bootstrap/identity.hpp"
#include "bootstrap/secret_file.hpp"
#include "bootstrap/session.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {
namespace {

using detail::kPublicKeyPrefix;
// An identity file is one line of text, so that it is never mistaken for a pre-shared key file
// (raw bytes) nor one for it: this header, then the seed in URL-safe base64.
constexpr std::string_view kFileHeader = "rdmakit-identity-ed25519 ";
constexpr int kBase64 = sodium_base64_VARIANT_URLSAFE_NO_PADDING;

static_assert(crypto_sign_PUBLICKEYBYTES == detail::kPublicKeySize);
static_assert(crypto_sign_BYTES == detail::kSignatureSize);
static_assert(crypto_sign_SEEDBYTES == 32);

void init_sodium() {
  if (::sodium_init() < 0) throw Error("sodium_init", EIO, "libsodium could not initialise (no random source?)");
}

std::string base64(std::span<const std::uint8_t> bytes) {
  std::string out(sodium_base64_ENCODED_LEN(bytes.size(), kBase64), '\0');
  ::sodium_bin2base64(out.data(), out.size(), bytes.data(), bytes.size(), kBase64);
  out.resize(std::char_traits<char>::length(out.c_str()));
  return out;
}

// Exactly `want` bytes from `text`, or false (a wrong length, a character outside the alphabet,
// trailing bytes).
bool unbase64(std::string_view text, std::uint8_t* out, std::size_t want) {
  std::size_t n = 0;
  const char* end = nullptr;
  return ::sodium_base642bin(out, want, text.data(), text.size(), nullptr, &n, &end, kBase64) == 0 && n == want &&
         end == text.data() + text.size();
}

}  // namespace

Identity::Identity(const Identity& o) : secret_(o.secret_), public_key_(o.public_key_) {}

Identity& Identity::operator=(const Identity& o) {
  if (this != &o) {
    detail::wipe(secret_);
    secret_ = o.secret_;
    public_key_ = o.public_key_;
  }
  return *this;
}

Identity::Identity(Identity&& o) noexcept : secret_(std::move(o.secret_)), public_key_(std::move(o.public_key_)) {
  o.secret_.clear();
  o.public_key_.clear();
}

Identity& Identity::operator=(Identity&& o) noexcept {
  if (this != &o) {
    detail::wipe(secret_);
    secret_ = std::move(o.secret_);
    public_key_ = std::move(o.public_key_);
    o.secret_.clear();
    o.public_key_.clear();
  }
  return *this;
}

Identity::~Identity() { detail::wipe(secret_); }

Identity Identity::from_seed(std::span<const std::uint8_t> seed) {
  init_sodium();
  if (seed.size() != crypto_sign_SEEDBYTES) {
    throw Error("identity", EINVAL, fmt::format("a seed of {} bytes; an Ed25519 seed has {}", seed.size(),
                                                crypto_sign_SEEDBYTES));
  }
  Identity id;
  id.secret_.resize(crypto_sign_SECRETKEYBYTES);
  std::array<std::uint8_t, crypto_sign_PUBLICKEYBYTES> pub{};
  ::crypto_sign_seed_keypair(pub.data(), id.secret_.data(), seed.data());
  id.public_key_ = detail::encode_public_key(pub);
  return id;
}

Identity Identity::generate() {
  init_sodium();
  std::array<std::uint8_t, crypto_sign_SEEDBYTES> seed{};
  ::randombytes_buf(seed.data(), seed.size());
  Identity id = from_seed(seed);
  ::sodium_memzero(seed.data(), seed.size());
  return id;
}

Identity Identity::from_file(const std::string& path) {
  std::vector<std::uint8_t> text = detail::read_secret_file(path, "read identity file", 256);
  std::string_view s(reinterpret_cast<const char*>(text.data()), text.size());
  if (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  std::array<std::uint8_t, crypto_sign_SEEDBYTES> seed{};
  const bool ok = s.substr(0, kFileHeader.size()) == kFileHeader &&
                  unbase64(s.substr(kFileHeader.size()), seed.data(), seed.size());
  detail::wipe(text);
  if (!ok) {
    ::sodium_memzero(seed.data(), seed.size());
    throw Error("read identity file", EINVAL, fmt::format("{} is not an rdmakit identity file", path),
                "`rdmakit keygen --identity FILE` writes one (a pre-shared key file is another thing: "
                "ConnectionConfig::psk)");
  }
  Identity id = from_seed(seed);
  ::sodium_memzero(seed.data(), seed.size());
  return id;
}

void Identity::save(const std::string& path) const {
  if (empty()) throw Error("write identity file", EINVAL, path, "this Identity holds no key pair");
  // The seed is the secret key's first half (libsodium's layout).
  std::string text(kFileHeader);
  text += base64(std::span(secret_).first(crypto_sign_SEEDBYTES));
  text += '\n';
  const std::string pub = public_key_ + '\n';
  try {
    detail::write_new_file(path, {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()}, 0600,
                           "write identity file");
    ::sodium_memzero(text.data(), text.size());
  } catch (...) {
    ::sodium_memzero(text.data(), text.size());
    throw;
  }
  try {
    detail::write_new_file(path + ".pub", {reinterpret_cast<const std::uint8_t*>(pub.data()), pub.size()}, 0644,
                           "write public key file");
  } catch (...) {
    ::unlink(path.c_str());  // no half pair left behind (a retry would find the secret there)
    throw;
  }
}

std::vector<std::uint8_t> Identity::sign(std::span<const std::uint8_t> message) const {
  if (empty()) throw Error("identity", EINVAL, "signing with an empty Identity");
  std::vector<std::uint8_t> sig(crypto_sign_BYTES);
  ::crypto_sign_detached(sig.data(), nullptr, message.data(), message.size(), secret_.data());
  return sig;
}

void check_public_key(const std::string& public_key) {
  if (!detail::decode_public_key(public_key)) {
    throw Error("public key", EINVAL,
                fmt::format("'{}' is not a public key", public_key.substr(0, 80)),
                "a public key is \"ed25519:\" and 43 characters of URL-safe base64, as `rdmakit keygen "
                "--identity FILE` writes to FILE.pub");
  }
}

}  // namespace rdmakit

namespace rdmakit::detail {

std::optional<std::array<std::uint8_t, kPublicKeySize>> decode_public_key(const std::string& text) noexcept {
  if (::sodium_init() < 0) return std::nullopt;
  std::array<std::uint8_t, kPublicKeySize> key{};
  // A point off the curve, or of small order, is no one's public key (no signature verifies
  // with it): refused here rather than waited on.
  if (text.size() <= kPublicKeyPrefix.size() || std::string_view(text).substr(0, kPublicKeyPrefix.size()) != kPublicKeyPrefix ||
      !unbase64(std::string_view(text).substr(kPublicKeyPrefix.size()), key.data(), key.size()) ||
      ::crypto_core_ed25519_is_valid_point(key.data()) == 0) {
    return std::nullopt;
  }
  return key;
}

std::string encode_public_key(std::span<const std::uint8_t, kPublicKeySize> key) {
  return std::string(kPublicKeyPrefix) + base64(key);
}

bool verify_signature(std::span<const std::uint8_t, kPublicKeySize> public_key, std::span<const std::uint8_t> message,
                      std::span<const std::uint8_t> signature) noexcept {
  return signature.size() == kSignatureSize &&
         ::crypto_sign_verify_detached(signature.data(), message.data(), message.size(), public_key.data()) == 0;
}

}  // namespace rdmakit::detail
