// SPDX-License-Identifier: Apache-2.0
#pragma once
// What the library needs of identities beyond the public class: checking a signature against a
// public key's text.

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace rdmakit::detail {

inline constexpr std::size_t kPublicKeySize = 32;
inline constexpr std::size_t kSignatureSize = 64;
/// What every public key's text begins with.
inline constexpr std::string_view kPublicKeyPrefix = "ed25519:";

/// The 32 bytes of a public key's text, or nullopt when it is not one.
[[nodiscard]] std::optional<std::array<std::uint8_t, kPublicKeySize>> decode_public_key(const std::string& text) noexcept;
/// The text of 32 public key bytes ("ed25519:" | URL-safe base64).
[[nodiscard]] std::string encode_public_key(std::span<const std::uint8_t, kPublicKeySize> key);
/// Whether `signature` is `public_key`'s signature of `message`. Never throws.
[[nodiscard]] bool verify_signature(std::span<const std::uint8_t, kPublicKeySize> public_key,
                                    std::span<const std::uint8_t> message,
                                    std::span<const std::uint8_t> signature) noexcept;

}  // namespace rdmakit::detail
