// SPDX-License-Identifier: Apache-2.0
#pragma once
// Files that hold secrets (pre-shared keys, identities): read only when no one else could have
// written or read them, written only as new files with the mode a secret needs.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace rdmakit::detail {

/// A secret file's bytes, all of them: opened without following a symbolic link; a regular file
/// of this process's user that no one else may read or write, at most `max` bytes (checked on
/// the open file). Throws Error naming `verb` and the path.
[[nodiscard]] std::vector<std::uint8_t> read_secret_file(const std::string& path, const char* verb, std::size_t max);
/// Writes `bytes` to a new file (O_EXCL, never following a link) with `mode`, fsynced; removes
/// it again when the write fails. Throws Error naming `verb`.
void write_new_file(const std::string& path, std::span<const std::uint8_t> bytes, unsigned mode, const char* verb);

}  // namespace rdmakit::detail
