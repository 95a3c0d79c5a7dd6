// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared wording of the doctor's findings.

#include <cstdint>
#include <limits>
#include <string>

#include <fmt/format.h>

namespace rdmakit::doctor::text {

/// "unlimited", "8 MiB", "64 KiB".
inline std::string bytes_text(std::uint64_t b) {
  if (b == std::numeric_limits<std::uint64_t>::max()) return "unlimited";
  if (b >= (1u << 30) && b % (1u << 30) == 0) return fmt::format("{} GiB", b >> 30);
  if (b >= (1u << 20) && b % (1u << 20) == 0) return fmt::format("{} MiB", b >> 20);
  return fmt::format("{} KiB", b >> 10);
}

}  // namespace rdmakit::doctor::text
