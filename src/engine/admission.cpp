// SPDX-License-Identifier: Apache-2.0
#include "engine/admission.hpp"

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "bootstrap/identity.hpp"
#include "engine/protocol.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/identity.hpp"

namespace rdmakit::detail {

namespace {

bool is_key(std::string_view s) noexcept { return s.substr(0, kPublicKeyPrefix.size()) == kPublicKeyPrefix; }

}  // namespace

std::pair<std::string, std::string> split_entry(const std::string& entry) {
  const auto eq = entry.find('=');
  if (eq == std::string::npos) return {entry, {}};
  return {entry.substr(0, eq), entry.substr(eq + 1)};
}

void check_engine_name(const std::string& name, const char* what) {
  engine_wire::check_name(name, what);
  if (name.find('=') != std::string::npos || is_key(name)) {
    throw Error("engine", EINVAL, fmt::format("{} '{}' has '=' or begins with \"{}\"", what, name, kPublicKeyPrefix),
                "an engine's name cannot look like a peer entry's key (EngineConfig::allowed_peers)");
  }
}

void check_peer_entry(const std::string& entry, const char* what) {
  const auto eq = entry.find('=');
  try {
    if (eq != std::string::npos) {
      engine_wire::check_name(entry.substr(0, eq), "name");
      check_public_key(entry.substr(eq + 1));
    } else if (is_key(entry)) {
      check_public_key(entry);
    } else {
      engine_wire::check_name(entry, "name");
    }
  } catch (const Error& e) {
    throw Error(what, EINVAL, fmt::format("'{}' is not a peer: {}", entry.substr(0, 200), e.what()),
                "a peer is an engine name, a public key (\"ed25519:...\"), or NAME=KEY");
  }
}

bool matches(const std::string& entry, const std::string& name, const std::string& key) noexcept {
  const auto eq = entry.find('=');
  if (eq != std::string::npos) {
    return !key.empty() && entry.compare(0, eq, name) == 0 && eq == name.size() && entry.compare(eq + 1, std::string::npos, key) == 0;
  }
  return is_key(entry) ? !key.empty() && entry == key : entry == name;
}

bool any_matches(const std::vector<std::string>& entries, const std::string& name, const std::string& key) noexcept {
  return std::any_of(entries.begin(), entries.end(), [&](const std::string& e) { return matches(e, name, key); });
}

}  // namespace rdmakit::detail
