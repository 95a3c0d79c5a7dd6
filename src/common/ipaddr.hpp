// SPDX-License-Identifier: Apache-2.0
#pragma once
// Text <-> binary IP addresses, kept apart so the verbs layer can format GIDs without including
// socket headers.

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace rdmakit::detail {

/// 16 bytes in network order: IPv6, or IPv4 as ::ffff:a.b.c.d.
using Ip16 = std::array<std::uint8_t, 16>;

/// Formats a 16-byte address: IPv4-mapped ones as "::ffff:a.b.c.d", others as RFC 5952 IPv6.
std::string format_ip16(const Ip16& addr);

/// Parses an IPv4 ("a.b.c.d", returned IPv4-mapped) or IPv6 address; nullopt if neither.
std::optional<Ip16> parse_ip16(const std::string& text);

}  // namespace rdmakit::detail
