// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// Where engines find each other (EngineConfig::metadata, `rdmakit peers`).
struct MetadataConfig {
  /// "p2p" (the default: no store; peers are added with host:port and everything is exchanged
  /// in the handshake), "redis://[user:password@]host[:port][/db]" or
  /// "etcd://host[:port][,host[:port]...]" (etcd's v3 JSON gateway).
  std::string uri = "p2p";
  /// The namespace in the store: engines see only those of their own cluster.
  std::string cluster = "default";
  /// An engine's entry outlives its process by at most this (a Redis TTL, an etcd lease); it is
  /// refreshed every third of it. etcd counts whole seconds.
  std::chrono::milliseconds lease{10'000};
  /// How often an engine lists the others to see who appeared, restarted or went.
  std::chrono::milliseconds poll{1'000};
  /// The deadline of each call to the store (a lookup of an unknown peer included).
  std::chrono::milliseconds call_timeout{2'000};
  /// The bootstrap endpoints ("host:port") to publish. Empty: the listener's address when it
  /// names one, else the IPv4 address of every RDMA port's GID, with the listener's port.
  std::vector<std::string> advertise{};

  /// The URI without its password, for messages and listings.
  [[nodiscard]] std::string shown_uri() const;
};

/// One RDMA port of a published engine: what a peer needs to tell whether it can reach it.
struct PublishedRail {
  std::string device;
  std::uint32_t port = 1;
  std::string link_layer;  ///< "ethernet" or "infiniband"
  std::string gid;         ///< the GID the engine uses on it, as an address
  std::string subnet;      ///< "198.18.1.0/24" (RoCE), "fe80::/64" (the IB subnet prefix)
  friend bool operator==(const PublishedRail&, const PublishedRail&) = default;
};

/// A named segment of a published engine. Never its address or key: those travel only in the
/// authenticated handshake, per peer.
struct PublishedSegment {
  std::string name;
  std::uint64_t length = 0;
  std::string memory;  ///< the memory kind ("host", "cuda", ...)
  friend bool operator==(const PublishedSegment&, const PublishedSegment&) = default;
};

/// What an engine publishes about itself (docs/engine.md, "Metadata").
struct PublishedEngine {
  std::string name;
  std::uint64_t epoch = 0;             ///< new at every start
  std::vector<std::string> endpoints;  ///< bootstrap addresses, "host:port"
  std::vector<PublishedRail> rails;
  std::vector<PublishedSegment> segments;
  /// Its Identity::public_key() (empty: it has none). A peer found through the store must
  /// prove it on every link.
  std::string public_key;
  /// The transports it offers, best first ("rdma", "tcp", "shm": EngineConfig::transports as
  /// it resolved them at its start). Empty in a record of an rdmakit from before transports:
  /// that engine offers rdma only.
  std::vector<std::string> transports;
  friend bool operator==(const PublishedEngine&, const PublishedEngine&) = default;
};

/// Every engine of `config.cluster` in the store, by name, read once (`rdmakit peers`). Entries
/// that are not valid records are skipped and named in `skipped` (when given). Throws Error
/// naming the store when it cannot be read within config.call_timeout, or for a p2p config.
[[nodiscard]] std::vector<PublishedEngine> list_engines(const MetadataConfig& config,
                                                        std::string* skipped = nullptr);

}  // namespace rdmakit
#pragma GCC visibility pop
