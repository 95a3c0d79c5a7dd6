// SPDX-License-Identifier: Apache-2.0
#pragma once
// Who may link to an engine, and who a segment is for (EngineConfig::allowed_peers,
// Engine::revoke, Engine::expose's peers): lists of entries, each an engine name ("kv-3"), a
// public key ("ed25519:..."), or both ("kv-3=ed25519:...": that name, proven by that key).

#include <string>
#include <utility>
#include <vector>

namespace rdmakit::detail {

/// An entry's parts: NAME=KEY as {NAME, KEY}; a bare name or key as {entry, ""}.
[[nodiscard]] std::pair<std::string, std::string> split_entry(const std::string& entry);
/// Throws Error (EINVAL, naming `what`) unless `name` can name an engine: engine_wire::check_name,
/// and nothing an entry would read as a key ('=', or the prefix "ed25519:").
void check_engine_name(const std::string& name, const char* what);
/// Throws Error (EINVAL, naming `what`) unless `entry` is a name, a public key, or NAME=KEY.
void check_peer_entry(const std::string& entry, const char* what);
/// Whether `entry` names the engine called `name` that proved `key` (empty: it proved none).
[[nodiscard]] bool matches(const std::string& entry, const std::string& name, const std::string& key) noexcept;
/// Whether any of `entries` does.
[[nodiscard]] bool any_matches(const std::vector<std::string>& entries, const std::string& name,
                               const std::string& key) noexcept;

}  // namespace rdmakit::detail
