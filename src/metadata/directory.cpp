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
    failure_ = e.what();
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
    failure_ = e.what();  // the lease ends the entry anyway
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
      failure_ = e.what();
    }
  } catch (const Error& e) {
    failure_ = e.what();
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

std::vector<DirectoryChange> Directory::poll() {
  next_poll_ = deadline_in(config_.poll);
  std::vector<DirectoryChange> changes;
  ClusterListing listing;
  try {
    listing = read_cluster(*store_, config_.cluster, call_deadline(), self_ ? self_->name : std::string{});
  } catch (const Error& e) {
    failure_ = e.what();
    return changes;  // a store that is down says nothing about who is gone
  }
  bad_entries_ = std::move(listing.skipped);
  std::map<std::string, EngineRecord>& seen = listing.engines;
  for (auto& [name, rec] : seen) {
    missing_since_.erase(name);
    auto it = peers_.find(name);
    if (it == peers_.end()) {
      changes.push_back({DirectoryChange::Kind::appeared, rec});
      peers_.emplace(name, rec);
    } else if (it->second.epoch != rec.epoch) {
      changes.push_back({DirectoryChange::Kind::restarted, rec});
      it->second = rec;
    } else {
      it->second = rec;  // segments or endpoints may have changed
    }
  }
  const auto grace = config_.lease / 3 + config_.poll;
  for (auto it = peers_.begin(); it != peers_.end();) {
    if (seen.contains(it->first)) {
      ++it;
      continue;
    }
    auto [since, fresh] = missing_since_.try_emplace(it->first, Clock::now());
    if (!fresh && Clock::now() - since->second > grace) {
      changes.push_back({DirectoryChange::Kind::gone, it->second});
      missing_since_.erase(since);
      it = peers_.erase(it);
    } else {
      ++it;
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
