// SPDX-License-Identifier: Apache-2.0
#pragma once
// The engine's use of a metadata store (EngineConfig::metadata): it publishes the engine's record
// (name, epoch, endpoints, rails, segments) under a lease and keeps it there, finds peers by name,
// and acts on what the store says of the peers this engine added: a moved endpoint is followed
// (held back while a live link says another epoch than the record: the link wins until it
// breaks), an engine gone from the store fails what waits for it and everything submitted to it
// later, naming the peer and the store, until it is back.
//
// Threads: one thread of its own calls the directory's tick(); the engine's callers use lookup()
// and known() from any thread. The directory is used under `dir_mu_` (a lookup waits for it no
// longer than its deadline); what callers and the thread's wait read of it is copied out under
// `mu_`. Lock order: dir_mu_ before mu_ and before Engine::Impl::mu (publishing builds the record
// from the engine's registries under dir_mu_); nothing takes dir_mu_ holding either.

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/deadline_mutex.hpp"
#include "metadata/directory.hpp"
#include "rdmakit/engine.hpp"

namespace rdmakit::detail {

/// What `e` says about itself, in a store (MetadataPlane) or as Engine::local_info(): its name,
/// epoch, key, transports, rails, endpoints (MetadataConfig::advertise, else the listener's
/// addresses) and segments, as many as a record holds (`segments`, when given, is set to how many
/// the engine has). Takes Engine::Impl::mu.
[[nodiscard]] metadata::EngineRecord engine_record(const Engine::Impl& e, std::size_t* segments = nullptr);

class MetadataPlane {
 public:
  /// Opens a client for config.metadata (which is not p2p) and publishes the engine's record
  /// (waiting for the store at most one call's timeout: a store that is down is retried).
  explicit MetadataPlane(Engine::Impl& engine);
  MetadataPlane(const MetadataPlane&) = delete;
  MetadataPlane& operator=(const MetadataPlane&) = delete;
  /// Stops its thread and removes the entry (a clean shutdown).
  ~MetadataPlane();

  /// The engine's endpoints or segments changed: its record is put again, now (`wait`: in this
  /// thread, within one call's timeout) or by the plane's thread.
  void changed(bool wait) noexcept;
  /// Engine `name`'s record: from what the plane knows, else from the store until `deadline`.
  /// Throws Error naming the store and the engine.
  metadata::EngineRecord lookup(const std::string& name, Deadline deadline);
  /// Every engine of the cluster as of the last listing (itself excluded).
  [[nodiscard]] std::vector<metadata::EngineRecord> known() const;
  /// The directory's state in one line (EngineInfo::metadata).
  [[nodiscard]] std::string status() const;
  /// The store's URI without its password.
  [[nodiscard]] const std::string& shown() const noexcept { return shown_; }
  /// The directory's state as of its last turn (metrics, health).
  struct Health {
    bool published = false;
    std::string failure;  // the last call's (empty: it succeeded)
    std::uint64_t failures = 0;
    std::uint64_t known = 0;
  };
  [[nodiscard]] Health health() const;

 private:
  void run() noexcept;
  void publish() noexcept;  // under dir_mu_
  [[nodiscard]] metadata::EngineRecord self_record() const;
  void copy_out();  // under dir_mu_
  void apply(const metadata::DirectoryChange& change);

  Engine::Impl& e_;
  std::string shown_;
  DeadlineMutex dir_mu_;
  metadata::Directory dir_;
  mutable std::mutex mu_;  // below
  std::condition_variable cv_;
  bool dirty_ = false;
  bool stop_ = false;
  std::map<std::string, metadata::EngineRecord> known_;
  std::string status_;
  Health health_;
  Deadline due_{};  // when the directory next has something to do
  mutable std::atomic<bool> truncated_{false};  // the record could not list every segment (logged once)
  std::thread thread_;
};

/// Whether `config` names a store (false: p2p); throws Error (EINVAL) for a bad URI, cluster,
/// lease or timeout, so an engine refuses them before it starts anything.
[[nodiscard]] bool uses_store(const MetadataConfig& config);

}  // namespace rdmakit::detail
