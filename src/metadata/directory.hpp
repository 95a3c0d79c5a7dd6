// SPDX-License-Identifier: Apache-2.0
#pragma once
// An engine's view of its cluster in a store. It publishes the engine's own record under a lease
// and keeps it there: refreshed every third of the lease, and put again by itself when the store
// lost it (a restart, even empty; an outage longer than the lease). It keeps a cache of the other
// engines' records, kept current by the store's watch of the cluster's prefix (etcd), or by
// listing it every poll (Redis, or while no watch can be made), and reports who appeared, who
// restarted (a new epoch) and who is gone.
//
// A store that is down changes nothing that is known: the cache keeps serving, and no engine is
// declared gone for a failed listing. An engine whose entry is missing is gone only once it has
// been missing longer than a live engine takes to put it back after a store restart: one refresh
// interval, three calls and one poll (so a restart does not drop anyone).
//
// Threads: one owner thread calls everything (the engine's metadata thread).

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.hpp"
#include "metadata/record.hpp"
#include "metadata/store.hpp"

namespace rdmakit::detail::metadata {

struct DirectoryConfig {
  StoreUri uri;
  std::string cluster = "default";          ///< the namespace: several clusters share a store
  std::chrono::milliseconds lease{10'000};  ///< an entry outlives its engine by at most this
  std::chrono::milliseconds poll{1'000};    ///< how often the others are listed
  std::chrono::milliseconds call_timeout{2'000};  ///< each call to the store
};

/// How long an engine's entry may be missing before the engine counts as gone: what a live one
/// takes to put it back after a store restart (directory.cpp, expire_missing).
constexpr std::chrono::milliseconds gone_after(std::chrono::milliseconds lease, std::chrono::milliseconds poll,
                                               std::chrono::milliseconds call_timeout) {
  return lease / 3 + 3 * call_timeout + poll;
}

struct DirectoryChange {
  enum class Kind : std::uint8_t { appeared, restarted, gone };
  Kind kind;
  EngineRecord record;  ///< gone: the last one seen
};

/// The engines of a cluster in `store` (but `self`), by name; entries that are not records are
/// skipped and named in `skipped`. Throws Error when the store cannot be read.
struct ClusterListing {
  std::map<std::string, EngineRecord> engines;
  std::string skipped;
};
ClusterListing read_cluster(Store& store, const std::string& cluster, Deadline deadline,
                            const std::string& self);

class Directory {
 public:
  /// `store`: a client for config.uri (made from it when null; tests pass their own).
  explicit Directory(DirectoryConfig config, std::unique_ptr<Store> store = {});
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;
  /// Leaves the entry to its lease (a crash does the same); withdraw() removes it at once.
  ~Directory();

  /// What to publish (again whenever it changes: a segment exposed or withdrawn). Puts it now;
  /// on failure it is kept and put by tick() when the store answers. Returns whether it got in.
  bool publish(EngineRecord self);
  /// Removes the entry and ends the lease (a clean shutdown); best effort, within one call's
  /// timeout.
  void withdraw() noexcept;

  /// Does what is due: refreshes the lease, puts the record again if the store lost it, lists
  /// the others. Never throws: a failure is kept in status(). Returns the changes seen.
  std::vector<DirectoryChange> tick();
  /// When tick() next has something to do.
  [[nodiscard]] Deadline next_due() const noexcept;

  /// A peer's record: from the cache, else from the store (until `deadline`). Throws Error
  /// naming the store and the peer when the store does not have it or cannot be reached.
  EngineRecord lookup(const std::string& name, Deadline deadline);
  /// Every engine the cache knows (itself excluded), by name.
  [[nodiscard]] const std::map<std::string, EngineRecord>& known() const noexcept { return peers_; }
  /// "published under lease ..., N engines known" or the last failure, for info and doctor.
  [[nodiscard]] std::string status() const;
  [[nodiscard]] std::string shown() const { return store_->shown(); }
  /// Whether the store holds this engine's current record; the last call's failure (empty once
  /// one succeeds); calls that failed, in all (metrics, health).
  [[nodiscard]] bool published() const noexcept { return published_; }
  [[nodiscard]] const std::string& failure() const noexcept { return failure_; }
  [[nodiscard]] std::uint64_t failures() const noexcept { return failures_; }

 private:
  Deadline call_deadline() const { return deadline_in(config_.call_timeout); }
  void put_self();
  void refresh();
  std::vector<DirectoryChange> poll();
  void saw(EngineRecord rec, std::vector<DirectoryChange>& changes);
  void expire_missing(std::vector<DirectoryChange>& changes);
  void on_event(const WatchEvent& ev, std::vector<DirectoryChange>& changes);

  DirectoryConfig config_;
  std::unique_ptr<Store> store_;
  std::optional<EngineRecord> self_;
  LeaseId lease_ = no_lease;
  bool published_ = false;  // the store has the current record under lease_
  Deadline next_refresh_{};
  Deadline next_poll_{};
  std::map<std::string, EngineRecord> peers_;
  std::map<std::string, Deadline> missing_since_;
  std::optional<std::string> listed_version_;  // the store's version() at the last listing
  bool watching_ = false;  // the store watches the cluster's prefix for us (etcd)
  std::string failure_;       // the last call that failed, empty once one succeeds
  std::uint64_t failures_ = 0;
  void fail(std::string why) {
    failure_ = std::move(why);
    ++failures_;
  }
  std::string bad_entries_;   // entries of the prefix that are not records (skipped)
};

}  // namespace rdmakit::detail::metadata
