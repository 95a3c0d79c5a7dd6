// SPDX-License-Identifier: Apache-2.0
#include "metadata/directory.hpp"

#include <cerrno>

#include <fmt/format.h>

namespace rdmakit::detail::metadata {

Directory::Directory(DirectoryConfig config, std::unique_ptr<Store> store)
    : config_(std::move(config)), store_(store ? std::move(store) : open_store(config_.uri)) {
  check_cluster(config_.cluster);
}

Directory::~Directory() = default;

bool Directory::publish(EngineRecord self) {
  self_ = std::move(self);
  published_ = false;
  try {
    put_self();
    return true;
  } catch (const Error& e) {
    fail(e.what());
    next_refresh_ = deadline_in(config_.lease / 3);
    return false;
  }
}

void Directory::withdraw() noexcept {
  if (!self_) return;
  try {
    store_->remove(engine_key(config_.cluster, self_->name), call_deadline());
    if (lease_ != no_lease) store_->revoke(lease_, call_deadline());
  } catch (const Error& e) {
    fail(e.what());  // the lease ends the entry anyway
  }
  lease_ = no_lease;
  published_ = false;
  self_.reset();
}

// Puts the record under the lease, granting a new lease first when there is none (or the store
// lost it).
void Directory::put_self() {
  if (lease_ == no_lease) lease_ = store_->grant(config_.lease, call_deadline());
  try {
    store_->put(engine_key(config_.cluster, self_->name), encode(*self_), lease_, call_deadline());
  } catch (const LeaseLost&) {
    lease_ = store_->grant(config_.lease, call_deadline());
    store_->put(engine_key(config_.cluster, self_->name), encode(*self_), lease_, call_deadline());
  }
  published_ = true;
  failure_.clear();
  next_refresh_ = deadline_in(config_.lease / 3);
}

void Directory::refresh() {
  next_refresh_ = deadline_in(config_.lease / 3);
  if (!self_) return;
  try {
    if (!published_) {
      put_self();
      return;
    }
    store_->refresh(lease_, call_deadline());
    failure_.clear();
  } catch (const LeaseLost&) {
    // The store restarted (even empty) or the lease ran out while it was unreachable.
    lease_ = no_lease;
    published_ = false;
    try {
      put_self();
    } catch (const Error& e) {
      fail(e.what());
    }
  } catch (const Error& e) {
    fail(e.what());
  }
}

ClusterListing read_cluster(Store& store, const std::string& cluster, Deadline deadline,
                            const std::string& self) {
  const std::string prefix = engines_prefix(cluster);
  ClusterListing out;
  for (const KeyValue& kv : store.list(prefix, deadline)) {
    const std::string name = kv.key.substr(prefix.size());
    if (name == self) continue;
    try {
      out.engines.emplace(name, decode(kv.value, fmt::format("{} key {}", store.shown(), kv.key), name));
    } catch (const Error& e) {
      out.skipped += (out.skipped.empty() ? "" : "; ") + e.detail();
    }
  }
  return out;
}

// A record seen (listed, or put under the watch): new, restarted, or the same engine updated.
void Directory::saw(EngineRecord rec, std::vector<DirectoryChange>& changes) {
  missing_since_.erase(rec.name);
  auto it = peers_.find(rec.name);
  if (it == peers_.end()) {
    changes.push_back({DirectoryChange::Kind::appeared, rec});
    peers_.emplace(rec.name, std::move(rec));
  } else if (it->second.epoch != rec.epoch) {
    changes.push_back({DirectoryChange::Kind::restarted, rec});
    it->second = std::move(rec);
  } else {
    it->second = std::move(rec);  // segments or endpoints may have changed
  }
}

// Engines missing for longer than a live one takes to put its entry back are gone. A live one
// learns at its next refresh (within a third of the lease) that the store lost its lease (a store
// restarted empty), then needs three calls: the keepalive that finds the lease gone, a grant and
// the put, each within call_timeout; this side sees the put within a poll. (Without the calls'
// time, a store answering slowly, as a just-restarted one does, dropped live peers.)
void Directory::expire_missing(std::vector<DirectoryChange>& changes) {
  const auto grace = gone_after(config_.lease, config_.poll, config_.call_timeout);
  for (auto it = missing_since_.begin(); it != missing_since_.end();) {
    const auto peer = peers_.find(it->first);
    if (peer == peers_.end()) {
      it = missing_since_.erase(it);
    } else if (Clock::now() - it->second > grace) {
      changes.push_back({DirectoryChange::Kind::gone, peer->second});
      peers_.erase(peer);
      it = missing_since_.erase(it);
    } else {
      ++it;
    }
  }
}

void Directory::on_event(const WatchEvent& ev, std::vector<DirectoryChange>& changes) {
  const std::string prefix = engines_prefix(config_.cluster);
  if (ev.key.rfind(prefix, 0) != 0) return;
  const std::string name = ev.key.substr(prefix.size());
  if (self_ && name == self_->name) {
    // Its own entry deleted while its lease lives (by hand, or by another process of the same
    // name): put it back at the next tick rather than stay invisible until the lease is lost.
    if (!ev.value && published_) {
      published_ = false;
      next_refresh_ = Clock::now();
    }
    return;
  }
  if (!ev.value) {
    if (peers_.contains(name)) missing_since_.try_emplace(name, Clock::now());
    return;
  }
  try {
    saw(decode(*ev.value, fmt::format("{} key {}", shown(), ev.key), name), changes);
  } catch (const Error& e) {
    bad_entries_ = e.detail();
  }
}

// With a store that watches (etcd), changes arrive as they happen and are applied one by one;
// a watch that breaks (the store went away or restarted) is followed by a listing and a new
// watch. Without one (Redis), every poll lists the cluster.
std::vector<DirectoryChange> Directory::poll() {
  next_poll_ = deadline_in(config_.poll);
  std::vector<DirectoryChange> changes;
  if (watching_) {
    try {
      for (const WatchEvent& ev : store_->watch_events()) on_event(ev, changes);
      expire_missing(changes);
      return changes;
    } catch (const Error& e) {
      fail(e.what());
      watching_ = false;  // list again, then watch from there
    }
  }
  ClusterListing listing;
  std::optional<std::string> version;
  try {
    version = store_->version(engines_prefix(config_.cluster), call_deadline());
    failure_.clear();  // the store answers again
    // Nothing changed since the last listing and nobody is missing: a listing would tell nothing.
    if (version && version == listed_version_ && missing_since_.empty()) return changes;
    listing = read_cluster(*store_, config_.cluster, call_deadline(), self_ ? self_->name : std::string{});
  } catch (const Error& e) {
    fail(e.what());
    return changes;  // a store that is down says nothing about who is gone
  }
  listed_version_ = version;
  bad_entries_ = std::move(listing.skipped);
  for (const auto& [name, rec] : peers_) {
    if (!listing.engines.contains(name)) missing_since_.try_emplace(name, Clock::now());
  }
  for (auto& [name, rec] : listing.engines) saw(std::move(rec), changes);
  expire_missing(changes);
  if (version) {
    try {
      watching_ = store_->watch(engines_prefix(config_.cluster), *version, call_deadline());
    } catch (const Error& e) {
      fail(e.what());  // polled until a watch can be made
    }
  }
  return changes;
}

std::vector<DirectoryChange> Directory::tick() {
  if (Clock::now() >= next_refresh_) refresh();
  if (Clock::now() >= next_poll_) return poll();
  return {};
}

Deadline Directory::next_due() const noexcept { return std::min(next_refresh_, next_poll_); }

EngineRecord Directory::lookup(const std::string& name, Deadline deadline) {
  if (auto it = peers_.find(name); it != peers_.end()) return it->second;
  const std::string key = engine_key(config_.cluster, name);
  std::optional<std::string> value;
  try {
    value = store_->get(key, deadline);
  } catch (const Error& e) {
    throw Error("metadata lookup", e.sys_errno(),
                fmt::format("engine \"{}\" is not known here and {} did not answer: {}", name,
                            shown(), e.detail()),
                e.hint());
  }
  if (!value) {
    throw Error("metadata lookup", ENOENT,
                fmt::format("{} has no engine \"{}\" in cluster \"{}\"", shown(), name,
                            config_.cluster),
                "is it running, with the same metadata URI and cluster? (rdmakit peers lists "
                "them)");
  }
  EngineRecord rec = decode(*value, fmt::format("{} key {}", shown(), key), name);
  peers_.emplace(name, rec);
  return rec;
}

std::string Directory::status() const {
  std::string s;
  if (!self_) {
    s = "nothing published";
  } else if (published_) {
    s = fmt::format("published as \"{}\" (epoch {}) under lease {:x}", self_->name, self_->epoch,
                    lease_);
  } else {
    s = fmt::format("\"{}\" not published yet", self_->name);
  }
  s += fmt::format(", {} other engines known in {}", peers_.size(), shown());
  s += watching_ ? ", kept current by its watch"
                 : fmt::format(", listed every {} ms", config_.poll.count());
  if (!failure_.empty()) s += "; last failure: " + failure_;
  if (!bad_entries_.empty()) s += "; skipped entries: " + bad_entries_;
  return s;
}

}  // namespace rdmakit::detail::metadata

namespace rdmakit {

std::vector<PublishedEngine> list_engines(const MetadataConfig& config, std::string* skipped) {
  using namespace detail::metadata;
  const StoreUri uri = parse_store_uri(config.uri);
  if (uri.kind == StoreUri::Kind::p2p) {
    throw Error("list engines", EINVAL, "metadata \"p2p\" has no store to list",
                "give a redis:// or etcd:// URI");
  }
  check_cluster(config.cluster);
  auto store = open_store(uri);
  ClusterListing l = read_cluster(*store, config.cluster, detail::deadline_in(config.call_timeout), {});
  if (skipped != nullptr) *skipped = std::move(l.skipped);
  std::vector<PublishedEngine> out;
  for (auto& [name, rec] : l.engines) out.push_back(std::move(rec));
  return out;
}

}  // namespace rdmakit
