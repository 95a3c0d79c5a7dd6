// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <string_view>

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// The library's version, "MAJOR.MINOR.PATCH", as built (not as the headers say).
[[nodiscard]] std::string_view version() noexcept;

}  // namespace rdmakit
#pragma GCC visibility pop
