// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <functional>

#include "cli_fwd.hpp"

namespace rdmakit::tools {

/// Adds `rdmakit keygen FILE`: a fresh pre-shared key, written with mode 0600.
void add_keygen(CLI::App& app, std::function<int()>& run);

}  // namespace rdmakit::tools
