// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <functional>

#include "cli_fwd.hpp"

namespace rdmakit::tools {

/// Adds `rdmakit bench`; when it is chosen, its callback sets `run`.
void add_bench(CLI::App& app, std::function<int()>& run);

}  // namespace rdmakit::tools
