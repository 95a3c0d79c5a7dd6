// SPDX-License-Identifier: Apache-2.0
#pragma once
// Where an engine's metadata lives: nowhere (p2p: peers by host:port, everything in the
// handshake), a Redis server, or an etcd cluster. Parsed once from EngineConfig::metadata.

#include <cstdint>
#include <string>
#include <vector>

#include "bootstrap/socket.hpp"

namespace rdmakit::detail::metadata {

struct StoreUri {
  enum class Kind : std::uint8_t { p2p, redis, etcd };
  Kind kind = Kind::p2p;
  std::vector<HostPort> hosts;  ///< redis: one; etcd: one or more endpoints
  std::string user;             ///< redis ACL user (empty: none, or "default" with a password)
  std::string password;
  int db = 0;                   ///< redis database number
  /// The URI without its password, for every message that names the store.
  [[nodiscard]] std::string shown() const;
};

/// "p2p" (or empty), "redis://[user:password@]host[:port][/db]" (port 6379),
/// "etcd://host[:port][,host[:port]...]" (port 2379). Throws Error (EINVAL) naming what is wrong.
StoreUri parse_store_uri(const std::string& text);

}  // namespace rdmakit::detail::metadata
