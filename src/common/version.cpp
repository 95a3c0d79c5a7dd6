// SPDX-License-Identifier: Apache-2.0
#include "rdmakit/version.hpp"

namespace rdmakit {

// RDMAKIT_VERSION comes from CMake's project(VERSION) for this translation unit only, so a stale
// installed header can never disagree with the library that is actually loaded.
std::string_view version() noexcept { return RDMAKIT_VERSION; }

}  // namespace rdmakit
