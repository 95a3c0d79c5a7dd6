// SPDX-License-Identifier: Apache-2.0
#pragma once
// The options that say where engines find each other (--metadata, --cluster, --lease), shared by
// serve, engine-bench and peers.

#include <functional>
#include <string>
#include <vector>

#include "cli_fwd.hpp"

#include "rdmakit/metadata.hpp"

namespace rdmakit::tools {

struct MetadataOptions {
  std::string uri = "p2p";
  std::string cluster = "default";
  double lease_s = 10;
  std::vector<std::string> advertise;

  /// `publishing`: the engine publishes itself (serve): --lease and --advertise too.
  void add_to(CLI::App& app, bool publishing);
  [[nodiscard]] MetadataConfig config() const;
  [[nodiscard]] bool store() const { return uri != "p2p" && !uri.empty(); }
};

/// `rdmakit peers`: the engines a store lists, with their epochs, endpoints, rails and segments.
void add_peers(CLI::App& app, std::function<int()>& run);

}  // namespace rdmakit::tools
