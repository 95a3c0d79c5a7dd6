// SPDX-License-Identifier: Apache-2.0
// --metadata and friends, and `rdmakit peers`: a thin front over rdmakit::list_engines.
#include "metadata_options.hpp"

#include <CLI/CLI.hpp>

#include <chrono>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "options.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::tools {

void MetadataOptions::add_to(CLI::App& app, bool publishing) {
  app.add_option("--metadata", uri,
                 "where engines find each other: p2p (peers by HOST:PORT), redis://[USER:PASSWORD@]HOST[:PORT][/DB] "
                 "or etcd://HOST[:PORT][,HOST[:PORT]...]")
      ->capture_default_str();
  app.add_option("--cluster", cluster, "the namespace in the store")->capture_default_str();
  if (publishing) {
    app.add_option("--lease", lease_s, "seconds an entry outlives its engine")
        ->check(CLI::Range(1.0, 3600.0))
        ->capture_default_str();
    app.add_option("--advertise", advertise,
                   "HOST:PORT to publish as this engine's endpoint (default: the address of each RDMA port); "
                   "repeatable");
  }
}

MetadataConfig MetadataOptions::config() const {
  MetadataConfig c;
  c.uri = uri;
  c.cluster = cluster;
  c.lease = std::chrono::milliseconds{static_cast<std::int64_t>(lease_s * 1000)};
  c.advertise = advertise;
  return c;
}

namespace {

struct PeersOptions {
  MetadataOptions md;
  unsigned timeout_ms = 2000;
  bool json = false;
};

int run_peers(const PeersOptions& o) {
  if (!o.md.store()) throw Fail("rdmakit peers lists a store's engines: give --metadata redis://... or etcd://...");
  MetadataConfig c = o.md.config();
  c.call_timeout = std::chrono::milliseconds{o.timeout_ms};
  std::string skipped;
  const std::vector<PublishedEngine> engines = list_engines(c, &skipped);
  if (o.json) {
    nlohmann::json list = nlohmann::json::array();
    for (const PublishedEngine& e : engines) {
      nlohmann::json rails = nlohmann::json::array();
      for (const PublishedRail& r : e.rails) {
        rails.push_back({{"device", r.device}, {"port", r.port}, {"link_layer", r.link_layer}, {"gid", r.gid},
                         {"subnet", r.subnet}});
      }
      nlohmann::json segs = nlohmann::json::array();
      for (const PublishedSegment& s : e.segments) {
        segs.push_back({{"name", s.name}, {"length", s.length}, {"memory", s.memory}});
      }
      list.push_back({{"name", e.name}, {"epoch", fmt::format("{:#x}", e.epoch)}, {"endpoints", e.endpoints},
                      {"rails", rails}, {"segments", segs}, {"public_key", e.public_key},
                      {"transports", e.transports.empty() ? std::vector<std::string>{"rdma"} : e.transports}});
    }
    fmt::print("{}\n", nlohmann::json{{"metadata", c.shown_uri()},
                                      {"cluster", o.md.cluster}, {"engines", list}, {"skipped", skipped}}
                           .dump());
    return 0;
  }
  fmt::print("{} engine(s) in cluster \"{}\" of {}\n", engines.size(), o.md.cluster, c.shown_uri());
  for (const PublishedEngine& e : engines) {
    fmt::print("  {}  epoch {:#x}  endpoints {}\n", e.name, e.epoch, fmt::join(e.endpoints, ", "));
    if (!e.public_key.empty()) fmt::print("    identity {}\n", e.public_key);
    if (e.transports.empty()) {
      fmt::print("    transports rdma (a record of before transports)\n");
    } else {
      fmt::print("    transports {} (best first)\n", fmt::join(e.transports, ", "));
    }
    for (const PublishedRail& r : e.rails) {
      fmt::print("    rail {} port {}: {}, GID {}, subnet {}\n", r.device, r.port, r.link_layer, r.gid,
                 r.subnet.empty() ? "unknown" : r.subnet);
    }
    for (const PublishedSegment& s : e.segments) {
      fmt::print("    segment {}: {} bytes of {} memory\n", s.name, s.length, s.memory);
    }
  }
  if (!skipped.empty()) fmt::print("  skipped (not engine records): {}\n", skipped);
  return 0;
}

}  // namespace

void add_peers(CLI::App& app, std::function<int()>& run) {
  auto o = std::make_shared<PeersOptions>();
  auto* sub = app.add_subcommand("peers", "list the engines a metadata store holds (epochs, endpoints, rails, segments)");
  o->md.add_to(*sub, /*publishing=*/false);
  // Only a store can be listed: no p2p default that is then refused.
  sub->get_option("--metadata")
      ->required()
      ->default_str("")
      ->description("the store to list: redis://[USER:PASSWORD@]HOST[:PORT][/DB] or etcd://HOST[:PORT][,HOST[:PORT]...]");
  sub->add_option("--timeout", o->timeout_ms, "deadline of the store's answer in ms")->capture_default_str();
  sub->add_flag("--json", o->json, "one JSON object");
  sub->callback([o, &run] { run = guarded("peers", [o] { return run_peers(*o); }); });
}

}  // namespace rdmakit::tools
