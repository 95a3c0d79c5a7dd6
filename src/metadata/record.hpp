#pragma once
// What an engine publishes about itself in a store, and where: one JSON record per engine under
// rdmakit/<cluster>/engines/<name>, tied to the engine's lease. Never a key or an address of
// memory: those travel only in the authenticated handshake, per peer.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace rdmakit::detail::metadata {

struct RailRecord {
  std::string device;
  std::uint32_t port = 1;
  std::string link_layer;  ///< "ethernet" or "infiniband"
  std::string gid;         ///< the GID the engine would use, as an address
  std::string subnet;      ///< e.g. "198.18.1.0/24" (RoCE) or the IB subnet prefix
  friend bool operator==(const RailRecord&, const RailRecord&) = default;
};

struct SegmentRecord {
  std::string name;
  std::uint64_t length = 0;
  std::string memory;  ///< the memory kind ("host", "cuda", ...)
  friend bool operator==(const SegmentRecord&, const SegmentRecord&) = default;
};

struct EngineRecord {
  std::string name;
  std::uint64_t epoch = 0;             ///< new at every start
  std::vector<std::string> endpoints;  ///< bootstrap addresses, "host:port"
  std::vector<RailRecord> rails;
  std::vector<SegmentRecord> segments;
  friend bool operator==(const EngineRecord&, const EngineRecord&) = default;
};

/// The record's format version, written as "v"; a reader refuses others.
inline constexpr int record_version = 1;

[[nodiscard]] std::string encode(const EngineRecord& r);
/// Throws Error (EPROTO) naming `where` (the store and key) for anything that is not a record
/// of this version: invalid JSON, missing or mistyped fields, a name that differs from the
/// key's, oversized lists. Bad input from a store never takes the process down.
[[nodiscard]] EngineRecord decode(std::string_view text, const std::string& where,
                                  const std::string& expected_name);

/// rdmakit/<cluster>/engines/ and rdmakit/<cluster>/engines/<name>.
[[nodiscard]] std::string engines_prefix(const std::string& cluster);
[[nodiscard]] std::string engine_key(const std::string& cluster, const std::string& name);

}  // namespace rdmakit::detail::metadata
