// SPDX-License-Identifier: Apache-2.0
// Leases on the workers (leases.hpp): the granting side binds a window per range on each link
// the holder opened, announces them (LEASE) once bound, extends them (RENEW), and drops them when
// the lease ends; the holding side keeps the ranges per link and slot, uses them for transfers
// to segments it has no standing window on, and refuses transfers on an ended lease itself.
#include <fmt/format.h>

#include "engine/admission.hpp"
#include "engine/impl.hpp"

namespace rdmakit::detail {

namespace ew = engine_wire;

namespace {

constexpr std::size_t kHeldEnded = 256;       // ended leases a peer's record keeps (lease_expired's reasons)
constexpr std::size_t kEndedRanges = 4096;     // ... with their ranges, up to this many each


std::int64_t ns_of(Deadline t) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// Whether [offset, offset + length) of a segment holds all of transfer t's remote range.
bool covers(std::uint64_t offset, std::uint64_t length, const Transfer& t) noexcept {
  return offset <= t.remote_offset && t.remote_offset - offset <= length && t.length <= length - (t.remote_offset - offset);
}

}  // namespace

// --- the granting side ---------------------------------------------------------------------------

void Worker::lease_granted(const std::shared_ptr<LeaseState>& s) {
  if (s->ended()) return;  // its end is next in this worker's mail
  if (index_ == 0) next_lease_check_ = Deadline{};  // looked at on the next turn
  // Posted again to worker 0 when its last link closed (lease_link_gone): a wake-up.
  if (std::find(leases_.begin(), leases_.end(), s) != leases_.end()) return;
  leases_.push_back(s);
  for (auto& l : links_) {
    if (l->initiated || l->state == Link::State::closing || !l->ident_seen) continue;
    if (!any_matches({s->peer}, l->peer_name, l->peer_key)) continue;
    bind_lease(*l, s);
  }
}

void Worker::bind_lease(Link& l, const std::shared_ptr<LeaseState>& s) {
  if (l.leases.count(s->id) != 0) return;
  Link::LeaseBinding& b = l.leases[s->id];
  b.state = s;
  s->links.fetch_add(1, std::memory_order_acq_rel);
  s->orphaned.store(0, std::memory_order_release);
  for (const LeaseState::Range& r : s->ranges) {
    SegmentDef d;
    d.name = r.segment;
    d.buffer = r.buffer;
    d.generation = r.generation;
    d.offset = r.in_buffer;
    d.length = r.length;
    d.access = s->access;
    d.lease = s->id;
    d.in_segment = r.in_segment;
    l.binds_waiting.push_back(std::move(d));
    ++b.pending;
  }
  bind_waiting(l);
}

void Worker::lease_link_gone(Link& l, std::uint64_t lease, const std::string& why) noexcept {
  const auto it = l.leases.find(lease);
  if (it == l.leases.end()) return;
  const std::shared_ptr<LeaseState> s = it->second.state;
  l.leases.erase(it);
  if (s->links.fetch_sub(1, std::memory_order_acq_rel) != 1 || s->ended()) return;
  // Its last link: it ends unless the peer links again soon (check_leases, on worker 0).
  try {
    std::lock_guard lock(s->orphan_mu);
    s->orphan_reason = fmt::format("the last link from {} that held its windows closed ({}), and none came back within {} ms",
                                   l.peer_name, why, LeaseState::kOrphanGrace.count());
  } catch (...) {
  }
  s->orphaned.store(LeaseState::now_ns(), std::memory_order_release);
  try {
    Command c(Command::Kind::lease_grant);
    c.lease = s;
    e_.workers[0]->post(std::move(c));
  } catch (...) {
  }
}

void Worker::lease_unbound(Link& l, std::uint64_t lease, const std::string& why) noexcept {
  const auto it = l.leases.find(lease);
  if (it == l.leases.end()) return;
  const std::shared_ptr<LeaseState> s = it->second.state;
  try {
    log(fmt::format("engine {}: lease {} for {}: {}", e_.name, lease, l.impl.info.peer_address, why));
    (void)e_.end_lease(s, LeaseCause::failed, fmt::format("a window for {} could not be bound: {}", l.peer_name, why));
  } catch (...) {
    (void)e_.end_lease(s, LeaseCause::failed, {});
  }
}

void Worker::lease_bound(Link& l, const Window& w) noexcept {
  const auto it = l.leases.find(w.lease);
  if (it == l.leases.end()) return;
  Link::LeaseBinding& b = it->second;
  if (b.pending > 0) --b.pending;
  if (b.pending != 0 || b.announced) return;
  b.announced = true;
  const std::uint32_t ttl = b.state->left_ms();
  if (ttl == 0) return;  // it ends now: its end comes with the next turn
  try {
    // Its windows by segment, 40 to a message; the holder knows it has them all by the count.
    std::map<std::string, std::vector<const Window*>> by_segment;
    std::uint32_t total = 0;
    for (const auto& o : l.windows) {
      if (o->lease == w.lease && o->bound) {
        by_segment[o->segment].push_back(o.get());
        ++total;
      }
    }
    for (const auto& [segment, ws] : by_segment) {
      for (std::size_t i = 0; i < ws.size(); i += ew::kLeaseRangesPerMessage) {
        ew::Message m;
        m.kind = ew::Kind::lease;
        m.lease = w.lease;
        m.ttl_ms = ttl;
        m.lease_ranges = total;
        m.name = segment;
        m.region.addr = ws[i]->region.addr - ws[i]->in_segment;
        m.region.access = b.state->access;
        for (std::size_t k = i; k < std::min(ws.size(), i + ew::kLeaseRangesPerMessage); ++k) {
          m.ranges.push_back({ws[k]->in_segment, ws[k]->region.length, ws[k]->rkey});
        }
        send(l, m);
      }
    }
  } catch (const std::exception& ex) {
    lease_unbound(l, w.lease, ex.what());
  }
}

void Worker::lease_ended(const std::shared_ptr<LeaseState>& s) noexcept {
  std::erase(leases_, s);
  for (auto& l : links_) {
    const auto it = l->leases.find(s->id);
    if (it == l->leases.end()) continue;
    l->leases.erase(it);
    std::erase_if(l->binds_waiting, [&](const SegmentDef& d) { return d.lease == s->id; });
    (void)revoke_windows(*l, [&](const Window& w) { return w.lease == s->id; });
    try {
      send(*l, ew::lease_end(s->id, fmt::format("{}: {}", to_string(s->cause), s->reason)));
    } catch (...) {
    }
    synced_if_done(*l);
  }
  e_.lease_dropped(s);
}

Deadline Worker::check_leases(Deadline now) noexcept {
  const std::int64_t t = ns_of(now);
  std::int64_t next = t + 1'000'000'000;
  // end_lease posts to this worker too: leases_ changes only when that is handled.
  for (std::size_t i = 0; i < leases_.size(); ++i) {
    const std::shared_ptr<LeaseState> s = leases_[i];
    const std::int64_t d = s->deadline.load(std::memory_order_acquire);
    if (d == LeaseState::kEnded) continue;
    const std::int64_t orphaned = s->orphaned.load(std::memory_order_acquire);
    if (orphaned != 0 && s->links.load(std::memory_order_acquire) == 0) {
      const std::int64_t grace_end = orphaned + std::chrono::duration_cast<std::chrono::nanoseconds>(LeaseState::kOrphanGrace).count();
      if (grace_end <= t) {
        std::string why;
        try {
          std::lock_guard lock(s->orphan_mu);
          why = s->orphan_reason;
        } catch (...) {
        }
        (void)e_.end_lease(s, LeaseCause::peer_lost, std::move(why));
        continue;
      }
      next = std::min(next, grace_end);
    }
    if (d <= t) {
      try {
        (void)e_.end_lease(s, LeaseCause::expired,
                           fmt::format("its time ({} ms as granted or renewed) passed without a renewal", s->ttl.count()));
      } catch (...) {
        (void)e_.end_lease(s, LeaseCause::expired, {});
      }
      continue;
    }
    next = std::min(next, d);
  }
  return Deadline{std::chrono::duration_cast<Deadline::duration>(std::chrono::nanoseconds{next})};
}

void Worker::on_renew(Link& l, std::uint64_t lease, std::uint32_t ttl_ms) noexcept {
  try {
    const auto it = std::find_if(leases_.begin(), leases_.end(), [&](const auto& s) { return s->id == lease; });
    if (it == leases_.end() || (*it)->ended()) {
      return send(l, ew::lease_end(lease, fmt::format("no lease {} lasts here (it ended, or was never granted)", lease)));
    }
    const std::shared_ptr<LeaseState> s = *it;
    if (!any_matches({s->peer}, l.peer_name, l.peer_key)) {
      // Someone else's lease: not extended, not ended, and nothing said about it.
      return log(fmt::format("engine {}: {} asked to renew lease {}, which is {}'s", e_.name, l.peer_name, lease, s->peer));
    }
    if (ttl_ms == 0) {
      (void)e_.end_lease(s, LeaseCause::released, fmt::format("{} released it", l.peer_name));
      return;
    }
    const auto got = s->extend(std::chrono::milliseconds{ttl_ms});
    if (got.count() == 0) return;  // it ends now (check_leases): its end is sent then
    e_.count.lease_renewals.fetch_add(1, std::memory_order_relaxed);
    send(l, ew::renew(ew::Kind::renewed, lease, static_cast<std::uint32_t>(got.count())));
  } catch (const std::exception& ex) {
    log(fmt::format("engine {}: renewing lease {} for {}: {}", e_.name, lease, l.impl.info.peer_address, ex.what()));
  }
}

void Worker::end_link_leases(Link& l, const std::string& why) noexcept {
  while (!l.leases.empty()) lease_link_gone(l, l.leases.begin()->first, why);
}

// --- the holding side ----------------------------------------------------------------------------

void Worker::refresh_remote(Link& l) {
  std::vector<RemoteRegion> all;
  for (const auto& [n, r] : l.remote) all.push_back(r);  // standing windows first: found sooner
  for (const auto& ranges : l.leased) {
    for (const LeasedRange& r : ranges) all.push_back({r.region.addr + r.offset, r.length, r.region.rkey, r.region.access});
  }
  l.impl.dp.set_remote(std::move(all), l.impl.info.atomics);
}

void Worker::on_lease(Link& l, const ew::Message& m) {
  if (!l.initiated) return break_link(l, "it announced a lease on a link it opened (only the accepting side does)");
  Peer& p = *l.peer;
  {
    std::lock_guard lock(p.m);
    const auto it = p.held.find(m.lease);
    if (it != p.held.end() && it->second.info.ended) {
      // Ended here (released, or known gone) while the peer still binds it: it is given back.
      if (!it->second.release_pending) send(l, ew::renew(ew::Kind::renew, m.lease, 0));
      return;
    }
  }
  auto violation = [&](std::string why) {
    forget_held(p, "its peer broke the lease protocol: " + why);  // not relinked for them
    break_link(l, why);
  };
  if (l.lease_ranges.count(m.lease) == 0 && l.lease_ranges.size() >= kLinkLeases) {
    return violation(fmt::format("it announced more than {} leases on one link", kLinkLeases));
  }
  std::uint32_t& seen = l.lease_ranges[m.lease];
  std::size_t held_here = 0;
  for (const auto& v : l.leased) held_here += v.size();
  if (seen + m.ranges.size() > m.lease_ranges || held_here + m.ranges.size() > kLinkRanges || m.lease_ranges > 65536) {
    return violation(fmt::format("it announced {} more ranges of lease {} ({} came, of {}; {} on the link)",
                                 m.ranges.size(), m.lease, seen, m.lease_ranges, held_here));
  }
  const std::uint32_t slot = e_.slot_of(p, m.name);
  seen += static_cast<std::uint32_t>(m.ranges.size());
  if (l.leased.size() <= slot) l.leased.resize(slot + 1);
  auto& v = l.leased[slot];
  for (const ew::LeaseWire& w : m.ranges) {
    v.push_back({w.offset, w.length, m.lease, {m.region.addr, w.offset + w.length, w.rkey, m.region.access}});
  }
  // The data path learns the ranges once the lease has all of them here (one rebuild a lease).
  if (seen == m.lease_ranges) refresh_remote(l);
  const auto ttl = std::chrono::milliseconds{m.ttl_ms};
  std::lock_guard lock(p.m);
  HeldRecord& h = p.held[m.lease];
  if (h.from_link == 0) {
    h.from_link = l.serial;  // the first link to announce it, or the next after that one went
    h.info.ranges.clear();
    h.slots.clear();
  }
  if (seen == m.lease_ranges) h.everywhere = on_every_rail(p, m.lease, m.lease_ranges);
  if (h.from_link == l.serial) {
    h.info.lease = m.lease;
    h.info.access = m.region.access;
    h.info.expires = Clock::now() + ttl - lease_guard(ttl);
    h.total = m.lease_ranges;
    for (const ew::LeaseWire& w : m.ranges) {
      h.info.ranges.push_back({m.name, w.offset, w.length});
      h.slots.push_back(slot);
    }
  }
  p.cv.notify_all();
}

void Worker::on_lease_end(Link& l, std::uint64_t lease, const std::string& reason) {
  if (!l.initiated) return break_link(l, "it ended a lease on a link it opened (only the accepting side grants)");
  drop_held(*l.peer, lease, fmt::format("peer '{}' ended lease {}: {}", l.peer->name, lease, reason));
}

void Worker::on_renewed(Link& l, std::uint64_t lease, std::uint32_t ttl_ms) {
  if (!l.initiated) return break_link(l, "it renewed a lease on a link it opened (only the accepting side grants)");
  const auto ttl = std::chrono::milliseconds{ttl_ms};
  std::lock_guard lock(l.peer->m);
  const auto it = l.peer->held.find(lease);
  if (it == l.peer->held.end() || it->second.info.ended) return;
  it->second.info.expires = Clock::now() + ttl - lease_guard(ttl);
}

void Worker::drop_held(Peer& p, std::uint64_t id, const std::string& reason) {
  auto drop_on = [&](Link* l) {
    if (l == nullptr || l->lease_ranges.erase(id) == 0) return;
    for (auto& v : l->leased) std::erase_if(v, [&](const LeasedRange& r) { return r.lease == id; });
    refresh_remote(*l);
  };
  for (std::size_t k = 0; k < p.rails.size(); ++k) drop_on(rail_link(p, k));
  std::lock_guard lock(p.m);
  HeldRecord& h = p.held[id];
  if (h.info.ended) return;
  h.info.lease = id;
  h.info.ended = true;
  h.info.reason = reason;
  h.order = ++p.held_ended;
  if (h.info.ranges.size() > kEndedRanges) {
    // Kept small: transfers in its ranges then end no_segment rather than lease_expired.
    h.info.ranges.clear();
    h.slots.clear();
  }
  // The oldest ended records go beyond kHeldEnded (their transfers end no_segment then).
  std::size_t ended = 0;
  for (const auto& [k, o] : p.held) ended += o.info.ended ? 1 : 0;
  while (ended > kHeldEnded) {
    auto oldest = p.held.end();
    for (auto it = p.held.begin(); it != p.held.end(); ++it) {
      if (it->second.info.ended && !it->second.release_pending &&
          (oldest == p.held.end() || it->second.order < oldest->second.order)) {
        oldest = it;
      }
    }
    if (oldest == p.held.end()) break;  // all of them still to be released
    p.held.erase(oldest);
    --ended;
  }
  p.cv.notify_all();
}

void Worker::held_link_gone(Link& l, const std::string& /*why*/) noexcept {
  if (l.lease_ranges.empty()) return;
  // Its leases are not over: the peer keeps them for a moment (LeaseState::kOrphanGrace) and
  // binds them on the next link, whose SYNCED comes after their LEASE (held_after_sync ends
  // those it did not announce again). Here they only leave this link.
  Peer& p = *l.peer;
  l.lease_ranges.clear();
  l.leased.clear();
  std::lock_guard lock(p.m);
  for (auto& [id, h] : p.held) {
    if (h.from_link == l.serial) {
      h.from_link = 0;  // the next link's announcement fills it again
      h.everywhere = false;
    } else if (!h.info.ended && h.complete()) {
      h.everywhere = on_every_rail(p, id, h.total);  // this link no longer counts (it is closing)
    }
  }
  p.cv.notify_all();
}

bool Worker::on_every_rail(const Peer& p, std::uint64_t id, std::uint32_t total) const noexcept {
  auto has = [&](const Link* o) {
    if (o == nullptr || !ready(o)) return true;  // not carrying transfers: it gets the lease before it does
    const auto it = o->lease_ranges.find(id);
    return it != o->lease_ranges.end() && it->second >= total;
  };
  for (std::size_t k = 0; k < p.rails.size(); ++k) {
    if (!has(rail_link(p, k))) return false;
  }
  return true;
}

bool Worker::holds_leases(const Peer& p) const noexcept {
  return std::any_of(p.held.begin(), p.held.end(), [](const auto& kv) { return !kv.second.info.ended || kv.second.release_pending; });
}

void Worker::held_after_sync(Link& l) noexcept {
  Peer& p = *l.peer;
  if (p.held.empty()) return;
  try {
    std::vector<std::uint64_t> gone, releases;
    // Held on another rail's live link: announced there (it may come here after SYNCED).
    auto elsewhere = [&](std::uint64_t id) {
      for (std::size_t k = 0; k < p.rails.size(); ++k) {
        const Link* o = rail_link(p, k);
        if (o != &l && ready(o) && o->lease_ranges.count(id) != 0) return true;
      }
      return false;
    };
    for (const auto& [id, h] : p.held) {
      if (h.release_pending) releases.push_back(id);
      if (!h.info.ended && l.lease_ranges.count(id) == 0 && !elsewhere(id)) gone.push_back(id);
    }
    for (const std::uint64_t id : gone) {
      drop_held(p, id, fmt::format("peer '{}' no longer holds lease {}: it ended while no link to it was up", p.name, id));
    }
    for (const std::uint64_t id : releases) {
      send(l, ew::renew(ew::Kind::renew, id, 0));
      std::lock_guard lock(p.m);
      if (const auto it = p.held.find(id); it != p.held.end()) it->second.release_pending = false;
    }
  } catch (const std::exception& ex) {
    log(fmt::format("engine {}: leases of '{}' after a new link: {}", e_.name, p.name, ex.what()));
  }
}

void Worker::forget_held(Peer& p, const std::string& why) {
  std::vector<std::uint64_t> ids;
  for (const auto& [id, h] : p.held) {
    if (!h.info.ended) ids.push_back(id);
  }
  for (const std::uint64_t id : ids) drop_held(p, id, fmt::format("lease {} of peer '{}': {}", id, p.name, why));
}

void Worker::renew(Peer& p, std::uint64_t lease, std::uint32_t ttl_ms) {
  if (ttl_ms == 0) {
    drop_held(p, lease, fmt::format("lease {} was released by this engine", lease));
    if (!ready(p.link)) {
      // Said on the next link (held_after_sync), which is opened now: the peer would keep the
      // ranges until the lease's end otherwise.
      {
        std::lock_guard lock(p.m);
        p.held[lease].release_pending = true;
      }
      if (p.link == nullptr && !p.connecting && !p.removed.load() && !p.gone.load()) {
        p.connecting = true;
        e_.request_connect(&p);
      }
      return;
    }
  } else {
    const auto it = p.held.find(lease);
    if (it != p.held.end() && it->second.info.ended) return;  // nothing to renew
    if (!ready(p.link)) {
      return log(fmt::format("engine {}: no link to '{}' to renew lease {} on (it is renewed on none: the peer "
                             "keeps it while a link comes back within 3 s)",
                             e_.name, p.name, lease));
    }
  }
  send(*p.link, ew::renew(ew::Kind::renew, lease, ttl_ms));
}

const HeldRecord* Worker::covering(const Peer& p, const Xfer& x) const noexcept {
  // A live lease first, else the one that ended last (its reason is the news).
  const Transfer t = x.transfer_copy();
  const HeldRecord* best = nullptr;
  for (const auto& [id, h] : p.held) {
    for (std::size_t i = 0; i < h.info.ranges.size() && i < h.slots.size(); ++i) {
      const LeaseRange& r = h.info.ranges[i];
      if (h.slots[i] == t.remote.slot && covers(r.offset, r.length, t)) {
        if (!h.info.ended) return &h;
        if (best == nullptr || h.order > best->order) best = &h;
        break;
      }
    }
  }
  return best;
}

const HeldRecord* Worker::leased_refusal(const Link& l, const Xfer& x) const noexcept {
  if (!l.initiated || l.peer == nullptr) return nullptr;
  const Transfer t = x.transfer_copy();
  const std::uint32_t slot = t.remote.slot;
  if (slot < l.by_slot.size() && l.by_slot[slot].has_value()) return nullptr;  // a standing window's
  // The lease it was posted through: the first range lease_region would have taken.
  if (slot < l.leased.size()) {
    for (const LeasedRange& r : l.leased[slot]) {
      if (!covers(r.offset, r.length, t)) continue;
      const auto it = l.peer->held.find(r.lease);
      if (it != l.peer->held.end() && !it->second.info.ended) return &it->second;
    }
  }
  return covering(*l.peer, x);
}

const RemoteRegion* Worker::lease_region(Link& l, Xfer& x) {
  const Transfer& t = x.transfer();
  Peer& p = *l.peer;
  if (t.remote.slot < l.leased.size()) {
    for (const LeasedRange& r : l.leased[t.remote.slot]) {  // in the order announced
      if (!covers(r.offset, r.length, t)) continue;
      const auto it = p.held.find(r.lease);
      if (it == p.held.end() || it->second.info.ended) continue;
      if (Clock::now() >= it->second.info.expires) {
        drop_held(p, r.lease, fmt::format("lease {} of peer '{}' ran out (renew it sooner)", r.lease, p.name));
        break;  // the record now says why
      }
      return &r.region;
    }
  }
  if (const HeldRecord* h = covering(p, x); h != nullptr) {
    if (h->info.ended) {
      end(x, TransferStatus::lease_expired, h->info.reason);
    } else {
      end(x, TransferStatus::no_segment,
          fmt::format("lease {} of peer '{}' covers it, but its windows are not on this rail (it came up after the grant)",
                      h->info.lease, p.name));
    }
    return nullptr;
  }
  refused(l, x, PostStatus::not_advertised);
  return nullptr;
}

}  // namespace rdmakit::detail
