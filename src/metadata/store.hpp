// SPDX-License-Identifier: Apache-2.0
#pragma once
// A key-value store that engines publish themselves in and find each other through: Redis
// (hiredis) or etcd (its v3 JSON gateway over libcurl). What the engine needs of either, and
// nothing more: entries tied to a lease that dies with the process, get, list by prefix, remove.
//
// Every call has a deadline and throws Error naming the store (its URI without password), the
// operation, and the cause: unreachable, closed mid-reply, an answer that is not the protocol, the
// store's own error. A connection that failed is dropped and made again on the next call.
//
// Threads: a Store is used by one thread at a time.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.hpp"
#include "metadata/uri.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail::metadata {

struct KeyValue {
  std::string key;
  std::string value;
  friend bool operator==(const KeyValue&, const KeyValue&) = default;
};

/// The store no longer has the lease (it restarted, or the lease expired while the store was
/// unreachable): grant a new one and put the entries again.
class LeaseLost : public Error {
 public:
  using Error::Error;
};

/// A change under a watched prefix: a key put (with its value) or deleted (removed, or its lease
/// expired or was revoked).
struct WatchEvent {
  std::string key;
  std::optional<std::string> value;  ///< nullopt: deleted
};

/// Entries put under a lease vanish when it is not refreshed within its time to live.
using LeaseId = std::int64_t;
inline constexpr LeaseId no_lease = 0;

class Store {
 public:
  virtual ~Store() = default;
  /// The store's URI without its password.
  [[nodiscard]] virtual std::string shown() const = 0;

  /// A new lease of `ttl` (etcd counts whole seconds: rounded up).
  virtual LeaseId grant(std::chrono::milliseconds ttl, Deadline deadline) = 0;
  /// Keeps the lease's entries alive for another ttl. Throws LeaseLost when the store no longer
  /// has it (or any of its entries).
  virtual void refresh(LeaseId lease, Deadline deadline) = 0;
  /// Ends the lease and removes its entries (a clean shutdown).
  virtual void revoke(LeaseId lease, Deadline deadline) = 0;

  /// Sets key to value, tied to `lease` (no_lease: until removed). Throws LeaseLost when the
  /// lease is gone.
  virtual void put(const std::string& key, const std::string& value, LeaseId lease,
                   Deadline deadline) = 0;
  virtual std::optional<std::string> get(const std::string& key, Deadline deadline) = 0;
  /// Every entry whose key starts with `prefix`, in key order.
  virtual std::vector<KeyValue> list(const std::string& prefix, Deadline deadline) = 0;
  virtual void remove(const std::string& key, Deadline deadline) = 0;
  /// A token that changes whenever an entry under `prefix` may have changed (put, removed,
  /// expired, the store restarted), read without listing them: a poller lists only when it
  /// changed. Nullopt: the store has none (Redis), so every poll lists.
  virtual std::optional<std::string> version(const std::string& prefix, Deadline deadline) {
    (void)prefix;
    (void)deadline;
    return std::nullopt;
  }
  /// Watches every key under `prefix` for the changes after `version` (what version() returned
  /// when the caller listed them): watch_events() hands them over. False: the store cannot
  /// watch (Redis), so the caller polls. Throws Error when the store cannot be reached.
  virtual bool watch(const std::string& prefix, const std::string& version, Deadline deadline) {
    (void)prefix;
    (void)version;
    (void)deadline;
    return false;
  }
  /// The changes received since the last call, in order, without waiting. Throws Error when the
  /// watch broke (the store went away or restarted, or no longer has that history): list
  /// again, then watch again from the listing's version.
  virtual std::vector<WatchEvent> watch_events() { return {}; }
};

/// A client for `uri` (redis or etcd); it connects at its first call.
std::unique_ptr<Store> open_store(const StoreUri& uri);

std::unique_ptr<Store> open_redis(const StoreUri& uri);
std::unique_ptr<Store> open_etcd(const StoreUri& uri);

}  // namespace rdmakit::detail::metadata
