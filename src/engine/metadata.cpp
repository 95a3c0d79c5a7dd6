// SPDX-License-Identifier: Apache-2.0
#include "common/thread_name.hpp"
#include "engine/metadata.hpp"

#include <algorithm>
#include <cerrno>
#include <utility>

#include <fmt/format.h>

#include "common/ipaddr.hpp"
#include "engine/impl.hpp"
#include "engine/rails.hpp"
#include "metadata/uri.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail {

namespace md = metadata;

namespace {

md::DirectoryConfig directory_config(const MetadataConfig& c) {
  md::DirectoryConfig d;
  d.uri = md::parse_store_uri(c.uri);
  d.cluster = c.cluster;
  d.lease = c.lease;
  d.poll = c.poll;
  d.call_timeout = c.call_timeout;
  if (c.lease < std::chrono::milliseconds{1000} || c.poll <= std::chrono::milliseconds{0} ||
      c.call_timeout <= std::chrono::milliseconds{0}) {
    throw Error("engine config", EINVAL,
                fmt::format("metadata lease {} ms (at least 1000), poll {} ms and call_timeout {} ms (above 0)",
                            c.lease.count(), c.poll.count(), c.call_timeout.count()));
  }
  return d;
}

}  // namespace

bool uses_store(const MetadataConfig& config) {
  const md::DirectoryConfig d = directory_config(config);
  if (d.uri.kind == md::StoreUri::Kind::p2p) return false;
  md::check_cluster(d.cluster);
  return true;
}

MetadataPlane::MetadataPlane(Engine::Impl& engine)
    : e_(engine), dir_(directory_config(engine.cfg.metadata)) {
  shown_ = dir_.shown();
  {
    std::lock_guard lock(dir_mu_);
    // An engine that will listen (start_listening) is published then, with its endpoints: a
    // peer that found it earlier could not reach it.
    if (e_.cfg.listen.empty() || e_.listening.load() != nullptr) publish();
    copy_out();
  }
  thread_ = std::thread([this] {
    name_this_thread("rdmakit-meta");
    run();
  });
}

MetadataPlane::~MetadataPlane() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  std::lock_guard lock(dir_mu_);
  dir_.withdraw();
}

void MetadataPlane::changed(bool wait) noexcept {
  if (wait) {
    std::unique_lock lock(dir_mu_, std::defer_lock);
    if (lock.try_lock_for(e_.cfg.metadata.call_timeout)) {
      publish();
      copy_out();
      return;
    }
  }
  {
    std::lock_guard lock(mu_);
    dirty_ = true;
  }
  cv_.notify_all();
}

void MetadataPlane::publish() noexcept {
  try {
    if (!dir_.publish(self_record())) {
      e_.cfg.link.log(fmt::format("engine {}: not published in {} yet (retried): {}", e_.name, shown_, dir_.status()));
    }
  } catch (const std::exception& ex) {
    try {
      e_.cfg.link.log(fmt::format("engine {}: building its record for {}: {}", e_.name, shown_, ex.what()));
    } catch (...) {
    }
  }
}

void MetadataPlane::copy_out() {
  std::string s = dir_.status();
  Health h{dir_.published(), dir_.failure(), dir_.failures(), dir_.known().size()};
  std::lock_guard lock(mu_);
  known_ = dir_.known();
  status_ = std::move(s);
  health_ = std::move(h);
  due_ = dir_.next_due();
}

void MetadataPlane::run() noexcept {
  for (;;) {
    bool republish = false;
    {
      std::unique_lock lock(mu_);
      cv_.wait_until(lock, due_, [this] { return stop_ || dirty_; });
      if (stop_) return;
      republish = std::exchange(dirty_, false);
    }
    std::vector<md::DirectoryChange> changes;
    try {
      std::lock_guard lock(dir_mu_);
      if (republish) publish();
      changes = dir_.tick();
      copy_out();
    } catch (const std::exception& ex) {
      // Out of memory in a copy: the next round tries again.
      (void)ex;
    }
    for (const auto& c : changes) {
      try {
        apply(c);
      } catch (const std::exception& ex) {
        try {
          e_.cfg.link.log(fmt::format("engine {}: acting on {}'s news of '{}': {}", e_.name, shown_, c.record.name, ex.what()));
        } catch (...) {
        }
      }
    }
  }
}

md::EngineRecord MetadataPlane::lookup(const std::string& name, Deadline deadline) {
  {
    std::lock_guard lock(mu_);
    if (auto it = known_.find(name); it != known_.end()) return it->second;
  }
  std::unique_lock lock(dir_mu_, std::defer_lock);
  if (!lock.try_lock_until(deadline)) {
    throw Error("metadata lookup", ETIMEDOUT,
                fmt::format("engine \"{}\" is not known here and {} is busy answering another call", name, shown_),
                "the store is slow or unreachable: see EngineInfo::metadata");
  }
  md::EngineRecord r = dir_.lookup(name, deadline);
  copy_out();
  return r;
}

std::vector<md::EngineRecord> MetadataPlane::known() const {
  std::lock_guard lock(mu_);
  std::vector<md::EngineRecord> out;
  for (const auto& [n, r] : known_) out.push_back(r);
  return out;
}

std::string MetadataPlane::status() const {
  std::lock_guard lock(mu_);
  return status_;
}

MetadataPlane::Health MetadataPlane::health() const {
  std::lock_guard lock(mu_);
  return health_;
}

md::EngineRecord engine_record(const Engine::Impl& e, std::size_t* segments) {
  md::EngineRecord r;
  r.name = e.name;
  r.epoch = e.epoch;
  r.public_key = e.cfg.identity.public_key();
  for (const wire::LinkTransport t : e.offer) r.transports.emplace_back(wire::to_string(t));
  for (const RailPort& p : local_rails(e.catalog(), e.cfg.link.gid, e.cfg.rails.devices)) {
    md::RailRecord rail;
    rail.device = p.device;
    rail.port = p.port;
    rail.link_layer = p.link_layer == LinkLayer::ethernet ? "ethernet" : "infiniband";
    rail.gid = format_ip16(p.gid);
    rail.subnet = p.prefix == 0 ? std::string{} : p.subnet();
    r.rails.push_back(std::move(rail));
  }
  const Listener* l = e.listening.load(std::memory_order_acquire);
  if (const auto& advertise = e.cfg.metadata.advertise; !advertise.empty()) {
    r.endpoints = advertise;
  } else if (l != nullptr) {
    const HostPort at = parse_host_port(e.cfg.listen, 0);
    auto add = [&](const std::string& host) {
      const std::string ep = HostPort{host, l->port()}.to_string();
      if (std::find(r.endpoints.begin(), r.endpoints.end(), ep) == r.endpoints.end()) r.endpoints.push_back(ep);
    };
    if (!wildcard_host(at.host)) {
      add(at.host);
    } else {
      for (const md::RailRecord& rail : r.rails) {
        const bool v4 = rail.gid.rfind("::ffff:", 0) == 0;
        if (rail.link_layer != "ethernet" || rail.gid.rfind("fe80:", 0) == 0 || !wildcard_serves(at.host, v4)) continue;
        add(v4 ? rail.gid.substr(7) : rail.gid);
      }
      if (r.endpoints.empty()) {
        char host[256] = {};
        (void)::gethostname(host, sizeof host - 1);
        add(host);
      }
    }
  }
  std::lock_guard lock(e.mu);
  if (segments != nullptr) *segments = e.segments.size();
  std::size_t bytes = 0;
  for (const auto& [name, s] : e.segments) {
    // More than a record holds (in entries, or in bytes within etcd's default 1.5 MiB request,
    // counting a name's escapes at their worst): the rest are served over the links all the
    // same, not listed.
    bytes += 2 * name.size() + 40;
    if (r.segments.size() == md::max_segments || bytes > md::max_segment_bytes) break;
    const BufferRec* b = e.buffer(s.buffer);
    r.segments.push_back({name, s.length, b != nullptr ? to_string(b->kind) : "host"});
  }
  return r;
}

md::EngineRecord MetadataPlane::self_record() const {
  std::size_t all = 0;
  md::EngineRecord r = engine_record(e_, &all);
  // Not under Engine::Impl::mu (the log may call back into the engine), and said once.
  if (r.segments.size() < all && !truncated_.exchange(true)) {
    e_.cfg.link.log(fmt::format("engine {}: its record in {} lists {} of its {} segments (a record holds at most "
                                "{} or about {} KiB of them); peers reach all of them over their links",
                                e_.name, shown_, r.segments.size(), all, md::max_segments,
                                md::max_segment_bytes / 1024));
  }
  return r;
}

void MetadataPlane::apply(const md::DirectoryChange& c) {
  using Kind = md::DirectoryChange::Kind;
  std::shared_ptr<Peer> p;
  {
    std::lock_guard lock(e_.mu);
    const auto it = e_.peer_ids.find(c.record.name);
    if (it == e_.peer_ids.end()) return;  // not one of this engine's peers: known, nothing to do
    p = e_.peers[it->second - 1];
  }
  if (c.kind != Kind::gone) {
    // A live link's peer said who it is on the link itself: a record of another epoch is stale
    // (written late, by hand, or flapping), not news. It is kept out, address and all, until
    // it agrees or the link breaks; a restart that is real breaks the old process's links on
    // its own (its sockets or its CM ids close with it).
    std::uint64_t live = 0;
    {
      std::lock_guard lock(p->m);
      if (p->up) live = p->up_epoch;
    }
    if (live != 0 && live != c.record.epoch) {
      {
        std::lock_guard lock(e_.mu);
        p->gone.store(false);  // listed: not gone, whatever its epoch
        if (p->from_store && !c.record.endpoints.empty()) p->held_address = c.record.endpoints.front();
        if (p->from_store && !c.record.public_key.empty()) p->held_key = c.record.public_key;
      }
      e_.cfg.link.log(fmt::format("engine {}: {} says peer '{}' runs with epoch {:#x} at {}; its live link says "
                                  "{:#x}: the record is ignored while the link is up (the next connect uses it)",
                                  e_.name, shown_, c.record.name, c.record.epoch,
                                  c.record.endpoints.empty() ? std::string("no endpoint") : c.record.endpoints.front(), live));
      return;
    }
  }
  std::string reason;
  {
    std::lock_guard lock(e_.mu);
    if (c.kind == Kind::gone) {
      reason = fmt::format("peer '{}' is gone from {}: its entry (epoch {:#x}) expired or was removed",
                           c.record.name, shown_, c.record.epoch);
      p->gone_reason = reason;
      p->gone.store(true);
    } else {
      p->gone.store(false);
      // A peer found through the store follows its entry (a restart on another port).
      if (p->from_store && !c.record.endpoints.empty()) p->address = c.record.endpoints.front();
      // And the key its links must prove: the record's (one without a key changes nothing; the
      // link in use, if any, proved the key it had when it came up).
      if (p->from_store && !c.record.public_key.empty()) {
        p->public_key = c.record.public_key;
        p->key_source = "store";
      }
      p->held_address.clear();
      p->held_key.clear();
    }
  }
  if (c.kind == Kind::gone) {
    Command cmd(Command::Kind::gone, p.get(), reason);
    cmd.keep = p;
    p->worker->post(std::move(cmd));
  }
}

}  // namespace rdmakit::detail
