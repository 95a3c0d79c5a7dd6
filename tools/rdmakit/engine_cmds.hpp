// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <functional>

#include "cli_fwd.hpp"

namespace rdmakit::tools {

/// Adds `rdmakit serve` (an engine exposing segments) and `rdmakit engine-bench` (batches at
/// serve targets); when one is chosen, its callback sets `run`.
void add_serve(CLI::App& app, std::function<int()>& run);
void add_engine_bench(CLI::App& app, std::function<int()>& run);

}  // namespace rdmakit::tools
