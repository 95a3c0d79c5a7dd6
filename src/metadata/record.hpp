// SPDX-License-Identifier: Apache-2.0
#pragma once
// What an engine publishes about itself in a store, and where: one JSON record per engine under
// rdmakit/<cluster>/engines/<name>, tied to the engine's lease. Never a key or an address of
// memory: those travel only in the authenticated handshake, per peer.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rdmakit/metadata.hpp"

namespace rdmakit::detail::metadata {

using RailRecord = PublishedRail;
using SegmentRecord = PublishedSegment;
using EngineRecord = PublishedEngine;

/// The record's format version, written as "v"; a reader refuses others. 2: segments as
/// [name, length, memory] triples, up to 16,384 of them.
inline constexpr int record_version = 2;
/// The most segments a record lists (an engine with more lists the first ones).
inline constexpr std::size_t max_segments = 16384;
/// And at most about this many bytes of them (etcd takes 1.5 MiB in one request by default).
inline constexpr std::size_t max_segment_bytes = 1u << 20;

[[nodiscard]] std::string encode(const EngineRecord& r);
/// Throws Error (EPROTO) naming `where` (the store and key) for anything that is not a record
/// of this version: invalid JSON, missing or mistyped fields, a name that differs from the
/// key's, oversized lists. Bad input from a store never takes the process down.
[[nodiscard]] EngineRecord decode(std::string_view text, const std::string& where,
                                  const std::string& expected_name);

/// Throws Error (EINVAL) unless `cluster` is 1..64 of [A-Za-z0-9._-] (it is part of every key).
void check_cluster(const std::string& cluster);
/// rdmakit/<cluster>/engines/ and rdmakit/<cluster>/engines/<name>.
[[nodiscard]] std::string engines_prefix(const std::string& cluster);
[[nodiscard]] std::string engine_key(const std::string& cluster, const std::string& name);

}  // namespace rdmakit::detail::metadata
