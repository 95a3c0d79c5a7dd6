// SPDX-License-Identifier: Apache-2.0
#pragma once
#include <functional>

#include "cli_fwd.hpp"

namespace rdmakit::tools {
/// `rdmakit devices`: every device, port, netdev and GID, and which GID rdmakit would use.
void add_devices(CLI::App& app, std::function<int()>& run);
/// `rdmakit doctor`: local checks, or both sides of a connection with --peer / --listen.
void add_doctor(CLI::App& app, std::function<int()>& run);
}  // namespace rdmakit::tools
