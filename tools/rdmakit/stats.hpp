// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cli_fwd.hpp"

namespace rdmakit::tools {

/// One sample of the Prometheus text format: name, labels, value.
struct MetricSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

/// The samples of an exposition text (comments skipped); throws Fail on a malformed line.
std::vector<MetricSample> parse_exposition(const std::string& text);

/// Adds `rdmakit stats HOST:PORT`: a live view of an engine's /metrics (rates per second, per
/// path, peer and rail), or --json once.
void add_stats(CLI::App& app, std::function<int()>& run);

}  // namespace rdmakit::tools
