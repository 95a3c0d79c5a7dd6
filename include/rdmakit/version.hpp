// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <string_view>

namespace rdmakit {

/// The library's version, "MAJOR.MINOR.PATCH", as built (not as the headers say).
[[nodiscard]] std::string_view version() noexcept;

}  // namespace rdmakit
