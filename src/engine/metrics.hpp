// SPDX-License-Identifier: Apache-2.0
// The engine's figures for a scraper (Engine::metrics): what the workers and batches count
// beside EngineCounters, a snapshot taken without touching the data path's locks, and its
// rendering in Prometheus's text exposition format (kept apart, so that its bounds and syntax
// are tested on snapshots of any size).
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rdmakit/engine.hpp"

namespace rdmakit::detail {

/// Durations in log2 buckets of microseconds (1 us .. 2^23 us, about 8.4 s, then +Inf): one
/// relaxed increment per observation, read by the scrape.
struct LatencyHistogram {
  static constexpr std::size_t kBuckets = 24;
  std::array<std::atomic<std::uint64_t>, kBuckets + 1> counts{};  // the last: above every bound
  // Two relaxed increments per batch that ends (with telemetry).
  std::atomic<std::uint64_t> sum_ns{0};
  void observe(std::int64_t ns) noexcept {
    // Rounded up: bucket i holds (2^(i-1), 2^i] microseconds (its le is inclusive), 0 and 1 us
    // go to bucket 0.
    const std::uint64_t us = ns <= 0 ? 0 : (static_cast<std::uint64_t>(ns) + 999) / 1000;
    const std::size_t i = us <= 1 ? 0 : static_cast<std::size_t>(std::bit_width(us - 1));
    counts[std::min(i, kBuckets)].fetch_add(1, std::memory_order_relaxed);
    sum_ns.fetch_add(ns <= 0 ? 0 : static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
  }
};

/// What batches asked for, by operation, and their transfers' sizes in log2 buckets of bytes
/// (le 1 B .. 2 GiB, then +Inf): counted as a batch starts, the whole batch at once.
inline constexpr std::size_t kOps = 4;  // TransferOp
inline constexpr std::size_t kSizeBuckets = 32;
/// The bytes a transfer asks for, as counted: an atomic's 8, and no more than 2^48 (a length
/// that large ends invalid, and must not wrap the counters).
[[nodiscard]] inline std::uint64_t counted_length(TransferOp op, std::uint64_t length) noexcept {
  return op >= TransferOp::fetch_add ? 8 : std::min<std::uint64_t>(length, std::uint64_t{1} << 48);
}
/// What the tally takes of a transfer.
struct OpLength {
  TransferOp op;
  std::uint64_t length;
};
[[nodiscard]] inline std::size_t size_bucket(std::uint64_t bytes) noexcept {
  return bytes <= 1 ? 0 : std::min<std::size_t>(static_cast<std::size_t>(std::bit_width(bytes - 1)), kSizeBuckets);
}
/// One batch's (or a plan's) tally: the entries that are not zero, as (index, amount); index
/// 0..3 transfers by op, 4..7 bytes by op, 8.. the size buckets.
struct SubmitTally {
  std::vector<std::pair<std::uint16_t, std::uint64_t>> nonzero;
  static SubmitTally of(std::span<const Transfer> t);
};
struct SubmitFigures {
  static constexpr std::size_t kEntries = 2 * kOps + kSizeBuckets + 1;
  std::array<std::atomic<std::uint64_t>, kEntries> at{};
  void add(std::uint16_t i, std::uint64_t v) noexcept { at[i].fetch_add(v, std::memory_order_relaxed); }
  /// `n` transfers of one operation and length.
  void add_same(std::size_t n, TransferOp op, std::uint64_t length) noexcept {
    if (n == 0) return;
    const auto o = static_cast<std::uint16_t>(static_cast<std::size_t>(op) & (kOps - 1));
    const std::uint64_t len = counted_length(op, length);
    add(o, n);
    if (len != 0) add(static_cast<std::uint16_t>(kOps + o), n * len);
    add(static_cast<std::uint16_t>(2 * kOps + size_bucket(len)), n);
  }
  /// One batch's `n` transfers (`transfer_at(i)`: the i-th's OpLength), counted on the stack, then added where not
  /// zero: a batch of one adds three numbers, one of many a few more. Counted by runs of one
  /// operation and length (a batch is mostly one run): a transfer like the one before costs two
  /// comparisons, its bucket and sums are taken once per run.
  template <class At>
  [[gnu::always_inline]] void add_batch(std::size_t n, At transfer_at) noexcept {
    if (n == 1) {  // the latency path's batch: its three additions, no arrays on the stack, no call
      const OpLength t = transfer_at(0);
      return add_same(1, t.op, t.length);
    }
    add_many(n, transfer_at);
  }
  template <class At>
  void add_many(std::size_t n, At transfer_at) noexcept {
    std::array<std::uint64_t, 2 * kOps> ops{};
    std::array<std::uint32_t, kSizeBuckets + 1> sizes{};
    std::uint64_t sizes_seen = 0;  // bit b: bucket b has some
    for (std::size_t i = 0; i < n;) {
      const OpLength first = transfer_at(i);
      const TransferOp op_of_run = first.op;
      const std::uint64_t length_of_run = first.length;
      std::size_t j = i + 1;
      for (; j < n; ++j) {
        const OpLength t = transfer_at(j);
        if ((t.op != op_of_run) | (t.length != length_of_run)) break;
      }
      const std::uint64_t k = j - i;
      i = j;
      const std::size_t op = static_cast<std::size_t>(op_of_run) & (kOps - 1);
      ops[op] += k;
      const std::uint64_t len = counted_length(first.op, first.length);
      ops[kOps + op] += k * len;  // as k additions would (modulo 2^64 alike)
      const std::size_t b = size_bucket(len);
      sizes[b] += static_cast<std::uint32_t>(k);
      sizes_seen |= std::uint64_t{1} << b;
    }
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i] != 0) add(static_cast<std::uint16_t>(i), ops[i]);
    }
    for (; sizes_seen != 0; sizes_seen &= sizes_seen - 1) {
      const auto b = static_cast<std::size_t>(std::countr_zero(sizes_seen));
      add(static_cast<std::uint16_t>(2 * kOps + b), sizes[b]);
    }
  }
  void add_tally(const SubmitTally& t) noexcept {
    for (const auto& [i, v] : t.nonzero) add(i, v);
  }
};

/// What ended ok on one path (a local RDMA device, or tcp or shm), summed by a worker as it
/// walks its completions (once per walk, not per transfer). Written by the thread running the
/// worker, read by the scrape.
struct PathFigures {
  std::atomic<std::uint64_t> bytes{0};      // of reads and writes
  std::atomic<std::uint64_t> transfers{0};  // of every operation
  void add(std::uint64_t b, std::uint64_t t) noexcept {
    bytes.store(bytes.load(std::memory_order_relaxed) + b, std::memory_order_relaxed);
    transfers.store(transfers.load(std::memory_order_relaxed) + t, std::memory_order_relaxed);
  }
};

/// Handshakes the engine's listener (and its admission of peers) refused, by reason.
struct Refusals {
  std::uint64_t busy = 0;      // at a limit of handshakes or connections
  std::uint64_t auth = 0;      // the cluster key or a signature did not check out
  std::uint64_t protocol = 0;  // a version or message this engine does not speak, no transport in common
  std::uint64_t identity = 0;  // a peer not allowed, revoked, or another engine under a pinned name
  std::uint64_t other = 0;
};

/// One scrape's worth of an engine's state.
struct MetricsSnapshot {
  std::string engine;
  EngineCounters counters;
  /// Batches that ended inside their submit() (the submitter's look after its post). Not in
  /// EngineCounters, whose layout is the 0.1 ABI.
  std::uint64_t submits_ended = 0;
  std::vector<PeerInfo> peers;
  struct Path {
    std::string name;       // device ("mlx5_0") or transport ("tcp", "shm")
    std::string transport;  // "rdma", "tcp", "shm"
    std::uint64_t bytes = 0;
    std::uint64_t transfers = 0;
  };
  std::vector<Path> paths;
  /// Transfers that ended other than ok, by TransferStatus.
  std::array<std::uint64_t, 16> failed{};
  static_assert(static_cast<std::size_t>(TransferStatus::lease_expired) < 16, "a status past the array");
  /// What batches asked for (SubmitFigures::at).
  std::array<std::uint64_t, SubmitFigures::kEntries> submitted{};
  /// Batches' submit-to-end times (EngineConfig::telemetry): per bucket (not cumulative).
  std::array<std::uint64_t, LatencyHistogram::kBuckets + 1> batch_buckets{};
  std::uint64_t batch_sum_ns = 0;
  bool telemetry = false;
  Refusals refusals;
  bool listening = false;
  bool store = false;      // a metadata store is configured
  bool published = false;  // ... and has this engine's record
  bool store_failing = false;
  std::uint64_t store_errors = 0;
  std::uint64_t store_known = 0;
  struct Memory {
    std::string kind;
    std::uint64_t buffers = 0;
    std::uint64_t bytes = 0;
  };
  std::vector<Memory> memory;
  std::uint64_t leases_active = 0;
  /// By peer name: what peers said their reads and writes moved on links they opened here
  /// (a target's view of one-sided transfers); "" holds names beyond the engine's bound.
  std::vector<std::pair<std::string, std::uint64_t>> served;
};

/// The rest series' last values (per top_peers): a peer that joins the named ones takes its
/// bytes out of the rest, which as a counter must not go down; it stays at its last value
/// until the peers still in it pass that.
struct RestFloors {
  std::uint64_t peers = 0;
  std::uint64_t served = 0;
};

/// The snapshot in the text exposition format (version 0.0.4, which OpenMetrics scrapers also
/// read): HELP and TYPE per family, `_total` counters, units in names, label values escaped
/// (and made UTF-8); the `top_peers` busiest peers by bytes with their name, the rest summed in
/// the series without a peer label (never below `floors`, which it updates; null: none kept).
[[nodiscard]] std::string render_metrics(const MetricsSnapshot& s, const MetricsOptions& options,
                                         RestFloors* floors = nullptr);

}  // namespace rdmakit::detail
