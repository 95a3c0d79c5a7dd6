// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <functional>

#include "cli_fwd.hpp"

namespace rdmakit::tools {

/// Adds `rdmakit hello`; when it is chosen, its callback sets `run`.
void add_hello(CLI::App& app, std::function<int()>& run);

}  // namespace rdmakit::tools
