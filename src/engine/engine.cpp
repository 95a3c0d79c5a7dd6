// SPDX-License-Identifier: Apache-2.0
// The engine's public calls (include/rdmakit/engine.hpp); its internals are in impl.cpp, the
// way of a batch to its workers in submit.cpp, its batches in batch.cpp.
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include <fmt/format.h>

#include "bootstrap/auth.hpp"
#include "engine/admission.hpp"
#include "engine/impl.hpp"
#include "engine/metadata.hpp"
#include "engine/protocol.hpp"
#include "engine/rails.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit {

using detail::BatchState;
using detail::Peer;
using detail::Worker;

const char* to_string(TransferOp op) noexcept {
  switch (op) {
    case TransferOp::read: return "read";
    case TransferOp::write: return "write";
    case TransferOp::fetch_add: return "fetch_add";
    case TransferOp::compare_swap: return "compare_swap";
  }
  return "?";
}

const char* to_string(TransferStatus s) noexcept {
  switch (s) {
    case TransferStatus::pending: return "pending";
    case TransferStatus::ok: return "ok";
    case TransferStatus::invalid: return "invalid";
    case TransferStatus::no_segment: return "no_segment";
    case TransferStatus::connect_failed: return "connect_failed";
    case TransferStatus::peer_lost: return "peer_lost";
    case TransferStatus::failed: return "failed";
    case TransferStatus::cancelled: return "cancelled";
    case TransferStatus::lease_expired: return "lease_expired";
  }
  return "?";
}

// --- Engine --------------------------------------------------------------------------------------

Engine::Engine(EngineConfig config) : impl_(std::make_unique<Impl>(std::move(config))) {}
Engine::~Engine() = default;

EngineInfo Engine::info() const {
  EngineInfo i;
  i.name = impl_->name;
  i.epoch = impl_->epoch;
  i.port = port();
  if (!impl_->cfg.listen.empty()) {
    // With the port it took (a listen of port 0 says which one once it listens).
    const detail::HostPort at = detail::parse_host_port(impl_->cfg.listen, 0);
    i.listen = detail::HostPort{at.host, i.port != 0 ? i.port : at.port}.to_string();
  }
  i.listen_note = impl_->listen_note;
  for (const auto& d : impl_->rdma_devices) i.devices.push_back(d->name());
  for (const wire::LinkTransport t : impl_->offer) i.transports.emplace_back(wire::to_string(t));
  i.transports_note = impl_->offer_note;
  i.memory_windows = impl_->windows;
  i.access_model = impl_->access_model;
  i.public_key = impl_->cfg.identity.public_key();
  i.metadata = impl_->meta ? impl_->meta->status() : "p2p: peers added by address, no store";
  for (const detail::RailPort& r : impl_->offered_rails()) {
    i.rails.push_back(r.describe() + (!r.endpoint.empty() ? ": peers open rails at " + r.endpoint
                                      : i.port == 0   ? ": not offered (no listener yet)"
                                      : !r.active     ? ": not offered (the port is not ACTIVE)"
                                                      : ": not offered (the listener is bound to " +
                                                            detail::parse_host_port(impl_->cfg.listen, 0).host + ")"));
  }
  return i;
}

EngineCounters Engine::counters() const noexcept {
  const auto& c = impl_->count;
  EngineCounters o;
  o.qps = c.qps.load();
  {
    std::lock_guard lock(impl_->mu);
    o.peers = impl_->peer_ids.size();
  }
  o.links = c.links.load();
  o.connects = c.connects.load();
  o.reconnects = c.reconnects.load();
  o.accepts = c.accepts.load();
  o.evictions = c.evictions.load();
  o.restarts = c.restarts.load();
  o.batches = c.batches.load();
  o.transfers = c.transfers.load();
  o.transfers_failed = c.transfers_failed.load();
  o.bytes = c.bytes.load();
  o.notifications_sent = c.notifications_sent.load();
  o.notifications_received = c.notifications_received.load();
  o.notifications_refused = c.notifications_refused.load();
  o.notifications_dropped = c.notifications_dropped.load();
  o.notifications_lost = c.notifications_lost.load();
  o.windows_bound = c.windows_bound.load();
  o.rail_links = c.rail_links.load();
  o.rail_failures = c.rail_failures.load();
  o.slices = c.slices.load();
  o.reposted = c.reposted.load();
  o.window_bind_ns = c.window_bind_ns.load();
  o.plan_posted = c.plan_posted.load();
  o.plan_builds = c.plan_builds.load();
  o.lists_posted = c.lists_posted.load();
  o.lists_builds = c.lists_builds.load();
  o.shm_mapped_bytes = impl_->shm_device().mapped_bytes();
  o.submits_inline = c.submits_inline.load();
  o.waits_spun = c.waits_spun.load();
  o.leases_granted = c.leases_granted.load();
  o.leases_ended = c.leases_ended.load();
  o.lease_renewals = c.lease_renewals.load();
  return o;
}

std::uint16_t Engine::port() const noexcept { return impl_->listen_port.load(std::memory_order_acquire); }

void Engine::start_listening() { impl_->start_listening(); }

void Engine::expose(std::string name, const Buffer& buffer, Access access, std::uint64_t offset, std::uint64_t length) {
  impl_->expose(std::move(name), buffer, access, offset, length, {});
}

void Engine::Impl::expose(std::string segment, const Buffer& buffer, Access access, std::uint64_t offset,
                          std::uint64_t length, std::vector<std::string> for_peers, bool leased) {
  detail::engine_wire::check_name(segment, "segment name");
  if (!windows && cfg.allow_region_keys && !psk) {
    throw Error("expose", EOPNOTSUPP,
                fmt::format("segment '{}': device {} has no type-2 memory windows, and region keys go only to "
                            "peers that hold the link key: this engine has none",
                            segment, no_windows_device),
                "set EngineConfig::link.psk (serve --psk-file)");
  }
  if (!windows && !cfg.allow_region_keys) {
    // Never a silent fallback: the buffer's own key would give every peer the whole buffer,
    // and nothing could be revoked from one peer.
    throw Error("expose", EOPNOTSUPP,
                fmt::format("segment '{}': device {} has no type-2 memory windows, so a peer could only get the "
                            "buffer's own key: to the whole buffer, for every peer with the link key, and "
                            "revocable only by registering the buffer again",
                            segment, no_windows_device),
                "set EngineConfig::allow_region_keys (rdmakit serve --allow-region-keys) to accept access per "
                "buffer, or use a NIC with type-2 memory windows");
  }
  const auto b = buffer_for(buffer, "expose");
  if (length == 0) length = b->handle.length - std::min<std::uint64_t>(offset, b->handle.length);
  if (offset > b->handle.length || length > b->handle.length - offset || length == 0) {
    throw Error("expose", EINVAL, fmt::format("segment '{}': [{}, +{}) is not inside the buffer of {} bytes", segment, offset, length, b->handle.length));
  }
  if (access == Access::none ||
      (static_cast<std::uint32_t>(access) & ~static_cast<std::uint32_t>(detail::kAllRemote)) != 0) {
    throw Error("expose", EINVAL, fmt::format("segment '{}': access {} (remote_read, remote_write, remote_atomic)", segment, to_string(access)));
  }
  {
    std::lock_guard lock(mu);  // unregister_memory() retires a buffer under it
    if (b->retired.load()) throw Error("expose", EINVAL, fmt::format("segment '{}': buffer {} was unregistered", segment, buffer.id));
    if (segments.count(segment) != 0) throw Error("expose", EEXIST, fmt::format("a segment '{}' exists", segment));
    segments[segment] = {segment, buffer.id, buffer.generation, offset, length, access, std::move(for_peers), leased};
  }
  for (auto& w : workers) w->post(detail::Command(detail::Command::Kind::expose, nullptr, segment));
  if (meta) meta->changed(/*wait=*/false);
}

void Engine::unregister_memory(const Buffer& buffer, std::chrono::milliseconds timeout) {
  const auto b = impl_->buffer_for(buffer, "unregister_memory");
  if (b->released.load()) throw Error("unregister_memory", EINVAL, fmt::format("buffer {} was unregistered already", buffer.id));
  {
    std::lock_guard lock(impl_->mu);
    // Another call released it meanwhile (its id may be going to another buffer).
    if (b->released.load()) throw Error("unregister_memory", EINVAL, fmt::format("buffer {} was unregistered already", buffer.id));
    std::string users;
    for (const auto& [n, s] : impl_->segments) {
      if (s.buffer == buffer.id) users += (users.empty() ? "'" : ", '") + n + "'";
    }
    if (!users.empty()) {
      throw Error("unregister_memory", EBUSY, fmt::format("buffer {} backs segment(s) {}", buffer.id, users),
                  "withdraw them first: peers may be reading and writing it");
    }
    b->retired.store(true, std::memory_order_release);  // from here, its new transfers are refused
  }
  // Each worker says when none of its transfers in flight uses the buffer; then no request the
  // NIC may still process names its regions, and they go.
  auto r = std::make_shared<detail::Retirement>();
  r->buffer = buffer.id;
  r->generation = buffer.generation;
  r->workers_left = static_cast<std::uint32_t>(impl_->workers.size());
  for (auto& w : impl_->workers) {
    detail::Command c(detail::Command::Kind::retire);
    c.retirement = r;
    w->post(std::move(c));
  }
  const auto until = detail::deadline_in(timeout);
  std::unique_lock lock(r->m);
  while (r->workers_left > 0 && detail::Clock::now() < until) {
    if (impl_->threads == 0) {
      lock.unlock();  // no worker thread: this call drives them
      (void)impl_->workers[0]->run(std::min(until, detail::deadline_in(std::chrono::milliseconds{10})), false);
      lock.lock();
    } else {
      r->cv.wait_until(lock, until, [&] { return r->workers_left == 0; });
    }
  }
  if (r->workers_left > 0) {
    throw Error("unregister_memory", ETIMEDOUT,
                fmt::format("buffer {}: its transfers in flight did not end within {} ms", buffer.id, timeout.count()),
                "it stays registered (and refuses new transfers): call again once they have ended");
  }
  lock.unlock();
  {
    // No staging copy runs from here on (one on another thread holds stage_mu only: this waits
    // for it before taking the engine's lock, so nothing else waits meanwhile).
    std::lock_guard staging(b->stage_mu);
    std::lock_guard reg(impl_->mu);
    if (b->released.exchange(true)) return;  // another call released it meanwhile
    b->slices.clear();
    b->regions.clear();  // deregistered on every device, then what they stood for
    b->bounce.reset();
    b->shared.reset();  // shm peers unmap it (their links hear it at their next poll)
    b->home.reset();
  }
  impl_->reclaim_buffer(buffer.id);
}

void Engine::withdraw(const std::string& name) {
  std::vector<std::shared_ptr<detail::LeaseState>> covering;
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->segments.erase(name) == 0) throw Error("withdraw", ENOENT, fmt::format("no segment '{}'", name));
    for (const auto& [id, s] : impl_->leases) {
      if (std::any_of(s->ranges.begin(), s->ranges.end(), [&](const auto& r) { return r.segment == name; })) covering.push_back(s);
    }
  }
  // Its leases end first: each worker drops their windows before it handles the withdrawal.
  for (const auto& s : covering) {
    (void)impl_->end_lease(s, LeaseCause::withdrawn, fmt::format("segment '{}' was withdrawn", name));
  }
  // Each worker deallocates the segment's windows on its links (the keys die at once) and tells
  // the peers. This returns once they all have: a transfer a peer posts after it cannot land,
  // and the memory may be reused (a submit of this engine's own that races it is another matter).
  (void)impl_->post_and_wait([](std::uint32_t) { return true; },
                             [&](std::uint32_t) { return detail::Command(detail::Command::Kind::withdraw, nullptr, name); },
                             "withdraw");
  if (impl_->meta) impl_->meta->changed(/*wait=*/false);
}

bool Engine::Impl::post_and_wait(const std::function<bool(std::uint32_t)>& to,
                                 const std::function<detail::Command(std::uint32_t)>& make, const char* what) {
  const auto handled = post_to(to, make);
  if (!handled || handled->wait(detail::deadline_in(std::chrono::seconds{5}))) return true;
  cfg.link.log(fmt::format("engine {}: {}: not every worker had handled it within 5 s (a worker busy in a long "
                           "callback?); they will", name, what));
  return false;
}

std::shared_ptr<detail::Handled> Engine::Impl::post_to(const std::function<bool(std::uint32_t)>& to,
                                                       const std::function<detail::Command(std::uint32_t)>& make) {
  std::size_t n = 0;
  for (std::uint32_t i = 0; i < workers.size(); ++i) n += to(i) ? 1u : 0u;
  auto handled = std::make_shared<detail::Handled>(n);
  // A thread that runs a worker (a callback) cannot wait for it: it only posts.
  const detail::ThreadSelf me = detail::thread_self();
  bool can_wait = threads != 0;
  for (std::uint32_t i = 0; i < workers.size(); ++i) {
    can_wait = can_wait && !workers[i]->run_by(me);
    if (!to(i)) continue;
    detail::Command c = make(i);
    c.handled = handled;
    workers[i]->post(std::move(c));
  }
  return can_wait ? handled : nullptr;
}

std::shared_ptr<detail::Handled> Engine::Impl::cancel(const std::shared_ptr<detail::BatchState>& b) {
  // From now on nothing of it that is not on the wire is posted, whatever queue it is in.
  b->cancelled.store(true, std::memory_order_relaxed);
  const std::uint32_t home = b->home;
  return post_to([home](std::uint32_t w) { return home == detail::kSeveralWorkers || w == home; },
                 [&](std::uint32_t) {
                   detail::Command c(detail::Command::Kind::cancel);
                   c.batch = b;
                   return c;
                 });
}

Batch Engine::notify(const std::string& peer, std::span<const std::uint8_t> message, SubmitOptions options) {
  if (!options.notify.empty()) {
    throw Error("notify", EINVAL, "options.notify is set: the message is notify()'s argument");
  }
  const auto p = impl_->named(peer, "notify");
  // Its one entry carries the peer: a transfer that moves nothing, never posted.
  Transfer t;
  t.remote = {p->id, 0, p->generation};
  auto state = detail::make_batch(impl_.get(), std::span<const Transfer>(&t, 1));
  state->note_only = true;
  options.notify.assign(message.begin(), message.end());
  Batch batch(state);
  (void)impl_->start(state, std::move(options));
  const std::uint32_t home = p->worker->index();
  state->set_home(home, impl_->workers.size());
  impl_->send_to(home, state);
  return batch;
}

std::shared_ptr<Peer> Engine::Impl::add_peer(std::string peer_name, std::string address, bool from_store,
                                             std::string public_key, std::string key_source) {
  detail::check_engine_name(peer_name, "peer name");
  (void)detail::parse_host_port(address, 0);
  if (!public_key.empty()) check_public_key(public_key);
  auto p = std::make_shared<Peer>();
  p->name = std::move(peer_name);
  p->address = std::move(address);
  p->from_store = from_store;
  p->key_source = public_key.empty() ? std::string{} : std::move(key_source);
  p->public_key = std::move(public_key);
  p->rails.push_back(std::make_unique<detail::RailState>());
  std::lock_guard lock(mu);
  if (peer_ids.count(p->name) != 0) throw Error("add_peer", EEXIST, fmt::format("a peer '{}' exists", p->name));
  const bool reused = !free_peer_ids.empty();
  if (reused) {
    p->id = free_peer_ids.back();
  } else if (peers.size() < kMaxPeers) {
    p->id = static_cast<std::uint32_t>(peers.size() + 1);
  } else {
    throw Error("add_peer", ENOSPC, fmt::format("{} peers at once (the most an engine holds)", kMaxPeers),
                "remove_peer() the ones no longer used: their ids are reused");
  }
  p->worker = worker_for(p->address, p->id);
  p->generation = next_generation();
  p->order = ++peers_added;
  peer_ids[p->name] = p->id;  // the last step that may throw: nothing below does
  if (reused) {
    free_peer_ids.pop_back();
  } else {
    peers.emplace_back();
  }
  peers[p->id - 1] = p;
  peer_worker[p->id - 1].store(p->worker->index(), std::memory_order_relaxed);
  if (p->id > peer_ids_used.load(std::memory_order_relaxed)) peer_ids_used.store(p->id, std::memory_order_release);
  peer_table[p->id - 1].store(p.get(), std::memory_order_release);
  return p;
}

std::shared_ptr<Peer> Engine::Impl::named(const std::string& peer_name, const char* verb) {
  {
    std::lock_guard lock(mu);
    if (const auto it = peer_ids.find(peer_name); it != peer_ids.end()) return peers[it->second - 1];
  }
  if (!meta) {
    throw Error(verb, ENOENT, fmt::format("no peer '{}' (add_peer first: the engine has no metadata store)", peer_name));
  }
  const detail::metadata::EngineRecord r = meta->lookup(peer_name, detail::deadline_in(cfg.metadata.call_timeout));
  if (r.endpoints.empty()) {
    throw Error(verb, EADDRNOTAVAIL, fmt::format("engine '{}' in {} publishes no endpoint", peer_name, meta->shown()),
                "it does not listen (EngineConfig::listen), so only it can open links");
  }
  try {
    return add_peer(peer_name, r.endpoints.front(), /*from_store=*/true, r.public_key, "store");
  } catch (const Error& e) {
    if (e.sys_errno() != EEXIST) throw;
    std::lock_guard lock(mu);  // another thread added it meanwhile
    return peers[peer_ids.at(peer_name) - 1];
  }
}

std::string Engine::Impl::gone_reason(const Peer& p) const {
  std::lock_guard lock(mu);
  return p.gone_reason;
}

void Engine::add_peer(std::string name, std::string address, std::string public_key) {
  (void)impl_->add_peer(std::move(name), std::move(address), /*from_store=*/false, std::move(public_key), "given");
}

void Engine::add_peer(std::string name) {
  if (!impl_->meta) {
    throw Error("add_peer", EINVAL,
                fmt::format("peer '{}' has no address, and the engine has no metadata store to find it in", name),
                "add_peer(name, \"host:port\"), or EngineConfig::metadata = a redis:// or etcd:// store");
  }
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->peer_ids.count(name) != 0) throw Error("add_peer", EEXIST, fmt::format("a peer '{}' exists", name));
  }
  (void)impl_->named(name, "add_peer");
}

std::vector<PublishedEngine> Engine::directory() const {
  return impl_->meta ? impl_->meta->known() : std::vector<PublishedEngine>{};
}

void Engine::remove_peer(const std::string& name) {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard lock(impl_->mu);
    const auto it = impl_->peer_ids.find(name);
    if (it == impl_->peer_ids.end()) throw Error("remove_peer", ENOENT, fmt::format("no peer '{}'", name));
    p = impl_->peers[it->second - 1];
    impl_->peer_ids.erase(it);  // the name may be added again, as a new peer
    // Its handles find nothing from here on; the id is reused once its worker let go of it.
    impl_->peer_table[p->id - 1].store(nullptr, std::memory_order_release);
    p->removed.store(true);
  }
  // Its accepted links (found by the name in their IDENT) are on any worker.
  for (auto& w : impl_->workers) {
    detail::Command c(detail::Command::Kind::remove_peer, p.get(), name);
    c.keep = p;
    w->post(std::move(c));
  }
}

std::vector<PeerInfo> Engine::peers() const {
  std::vector<PeerInfo> out;
  std::lock_guard lock(impl_->mu);
  std::vector<Peer*> added;
  for (const auto& p : impl_->peers) {
    if (p && !p->removed.load()) added.push_back(p.get());
  }
  std::sort(added.begin(), added.end(), [](const Peer* a, const Peer* b) { return a->order < b->order; });
  for (Peer* p : added) {
    PeerInfo i{p->name, p->address, p->worker->index(), {}, false};
    i.public_key = p->public_key;
    i.key_source = p->key_source;
    const int d = p->device.load(std::memory_order_relaxed);
    if (d >= 0 && static_cast<std::uint32_t>(d) < impl_->device_count()) i.device = impl_->device_name(static_cast<std::uint32_t>(d));
    {
      std::lock_guard pl(p->m);
      i.linked = p->up;
      i.transport = p->transport;
      i.transport_reason = p->transport_reason;
      i.wire_version = p->wire_version;
      for (const auto& r : p->rails) {
        if (r->local.device.empty()) continue;  // the first, before its link came up
        i.rails.push_back({r->local.describe(), r->peer.device.empty() ? std::string{} : r->peer.describe(), r->state,
                           r->reason, r->bytes.load(), r->slices.load(), r->failures.load(), r->reposted.load()});
      }
      for (const auto& u : p->unused_rails) i.rails.push_back({u.local, {}, "unused", u.reason, 0, 0, 0, 0});
    }
    out.push_back(std::move(i));
  }
  return out;
}

RemoteSegment Engine::segment(const std::string& peer, const std::string& segment) {
  detail::engine_wire::check_name(segment, "segment name");
  const auto p = impl_->named(peer, "segment");
  return {p->id, impl_->slot_of(*p, segment), p->generation};
}

bool Engine::connect(const std::string& peer, std::chrono::milliseconds timeout, std::string* why) {
  const auto p = impl_->named(peer, "connect");
  std::unique_lock lock(p->m);
  const std::uint64_t before = p->attempts;
  lock.unlock();
  {
    detail::Command c(detail::Command::Kind::kick, p.get());
    c.keep = p;
    p->worker->post(std::move(c));
  }
  // Up, and its further rails tried (each up or down: a rail that fails does not fail this).
  const auto rails_tried = [&] {
    return std::none_of(p->rails.begin() + 1, p->rails.end(), [](const auto& r) { return r->state == "connecting"; });
  };
  const auto settled = [&] { return (p->up && rails_tried()) || (!p->up && p->attempts > before); };
  const auto until = detail::deadline_in(timeout);
  lock.lock();
  if (impl_->threads == 0) {
    // No worker thread: this call drives the progress that connects.
    while (!settled() && detail::Clock::now() < until) {
      lock.unlock();
      (void)impl_->workers[0]->run(std::min(until, detail::deadline_in(std::chrono::milliseconds{10})), false);
      lock.lock();
    }
  } else {
    p->cv.wait_until(lock, until, settled);
  }
  if (p->up) return true;
  if (why != nullptr) {
    *why = settled() ? p->last_error : fmt::format("no link to '{}' within {} ms", peer, timeout.count());
  }
  return false;
}

std::optional<Notification> Engine::next_notification() {
  std::shared_ptr<detail::NoteCredits> from;
  std::optional<Notification> n;
  bool tell = false;
  {
    std::lock_guard lock(impl_->notes_mu);
    if (impl_->notes.empty()) return std::nullopt;
    n = std::move(impl_->notes.front().n);
    from = std::move(impl_->notes.front().credits);
    impl_->notes.pop_front();
    const std::uint32_t left = from->queued.fetch_sub(1, std::memory_order_relaxed) - 1;
    const std::uint64_t taken = from->taken.fetch_add(1, std::memory_order_relaxed) + 1;
    // Its worker returns the credits: when the link's queue here is empty (its sender may be
    // waiting for them), and every quarter of the queue taken meanwhile.
    tell = left == 0 || taken % std::max<std::uint32_t>(1, impl_->cfg.notification_queue / 4) == 0;
  }
  if (tell) {
    detail::Command c(detail::Command::Kind::credit);
    c.notes = std::move(from);
    Worker* w = c.notes->worker;
    w->post(std::move(c));
  }
  return n;
}

int Engine::fd() const noexcept {
  // Signalled from now on (Impl::signal). Both sides read-modify-write the flag: a batch that
  // ended before this call did so before signal()'s RMW, which this one then reads from (and so
  // the caller's next check sees the batch done); one that ends after sees the flag and writes.
  (void)impl_->fd_taken.exchange(1, std::memory_order_acq_rel);
  return impl_->event_fd.get();
}

std::size_t Engine::progress(std::chrono::milliseconds budget) {
  if (impl_->threads != 0) {
    throw Error("progress", EINVAL, "the engine has worker threads (EngineConfig::workers > 0)");
  }
  return impl_->workers[0]->run(detail::deadline_in(budget), false);
}

}  // namespace rdmakit
