// SPDX-License-Identifier: Apache-2.0
// An engine worker's links: connecting and breaking them, their windows and the segments
// announced on them, sending control messages, eviction under the QP budget. Runs on the
// worker's thread (or in progress()); the messages a peer sends are handled in
// worker_messages.cpp, who it is in worker_identity.cpp, the transfers in worker_transfers.cpp.
#include <sys/epoll.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "engine/admission.hpp"
#include "engine/impl.hpp"
#include "engine/protocol.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"
#include "verbs/qp.hpp"

namespace rdmakit::detail {

namespace ew = engine_wire;

void Worker::link_up(Command& c) {
  auto owned = std::make_unique<Link>(std::move(*c.conn));
  Link& l = *owned;
  l.device = c.device;
  l.initiated = c.peer != nullptr;
  l.peer = c.peer;
  l.last_used = Clock::now();
  l.impl.dp.route_through(cqs_[l.device]->router, cqs_[l.device]->router);
  if (l.impl.soft_qp) l.impl.soft_qp->start();  // its streams join this worker's CQ, on its thread
  l.impl.dp.context = &l;
  l.ended = l.impl.dp.lane(0).sq.next_seq();
  l.serial = ++link_serial_;
  links_.push_back(std::move(owned));
  e_.count.links.fetch_add(1, std::memory_order_relaxed);
  watch(l, true);
  send(l, my_ident(l));
  if (l.initiated && c.rail != nullptr) {  // a further rail of the peer's link
    Peer& p = *l.peer;
    l.rail = c.rail;
    c.rail->link = &l;
    c.rail->connecting = false;
    e_.count.rail_links.fetch_add(1, std::memory_order_relaxed);
    if (p.removed.load() || p.gone.load()) break_link(l, fmt::format("peer '{}' is gone", p.name));
    if (!c.rail->wanted) break_link(l, "the peer no longer offers this rail (it restarted or moved)");
    return;
  }
  if (l.initiated) {
    Peer& p = *l.peer;
    p.link = &l;
    l.rail = p.rails[0].get();
    {
      // The first rail is the port the connection chose for the peer's address.
      RailPort first;
      for (RailPort& r : local_rails(e_.catalog(), e_.cfg.link.gid)) {
        if (r.device == l.impl.info.device && r.port == l.impl.info.port) first = std::move(r);
      }
      first.device = l.impl.info.device;
      first.port = l.impl.info.port;
      first.link_layer = l.impl.info.link_layer;
      first.gid = l.impl.info.local_gid.gid;
      first.active = true;
      std::lock_guard lock(p.m);
      l.rail->local = std::move(first);
      l.rail->state = "connecting";
      p.transport = l.impl.info.transport;
      p.transport_reason = l.impl.info.transport_reason;
      p.wire_version = l.impl.info.wire_version;
    }
    p.connecting = false;
    p.device.store(static_cast<int>(l.device), std::memory_order_relaxed);
    e_.count.connects.fetch_add(1, std::memory_order_relaxed);
    if (p.ever_connected) e_.count.reconnects.fetch_add(1, std::memory_order_relaxed);
    p.ever_connected = true;
    if (p.removed.load()) break_link(l, fmt::format("peer '{}' was removed", p.name));
    return;
  }
  e_.count.accepts.fetch_add(1, std::memory_order_relaxed);
  // Its rails and windows wait for its IDENT (grant): nothing is offered before the peer has
  // said, and proved, who it is.
}

void Worker::grant(Link& l) {
  // Our ports, so that the peer opens its further rails (it uses them on the link it opened).
  try {
    send(l, rails_message(l));
  } catch (const std::exception& ex) {
    e_.cfg.link.log(fmt::format("engine {}: telling {} our rails: {}", e_.name, l.impl.info.peer_address, ex.what()));
  }
  std::vector<SegmentDef> defs;
  {
    std::lock_guard lock(e_.mu);
    for (const auto& [n, d] : e_.segments) defs.push_back(d);
  }
  for (const SegmentDef& d : defs) bind_window(l, d);
  // The leases its peer holds here get their windows on this link too.
  for (const auto& s : leases_) {
    if (!s->ended() && any_matches({s->peer}, l.peer_name, l.peer_key)) bind_lease(l, s);
  }
  bind_waiting(l);  // then SYNCED, once the last has been bound
}

void Worker::connect_failed(Peer& p, const std::string& why) {
  p.connecting = false;
  // Its leases' windows went with its last link, and no link comes back to carry them again.
  if (holds_leases(p)) forget_held(p, "no link to it: " + why);
  fail_waiting(p, TransferStatus::connect_failed, why);
  not_linked(p, why);
}

void Worker::not_linked(Peer& p, const std::string& why) {
  std::lock_guard lock(p.m);
  ++p.attempts;
  p.up = false;
  p.last_error = why;
  p.cv.notify_all();
}

void Worker::bind_window(Link& l, const SegmentDef& def) {
  // A segment exposed for some peers only: the others never get a window (their transfers to it
  // end no_segment, as for a segment that does not exist).
  if (!def.peers.empty() && !any_matches(def.peers, l.peer_name, l.peer_key)) return;
  if (def.leased) return;  // reached through leases only (bind_lease)
  // Once per segment and link: an expose() that lands after the link's grant took the segment
  // would bind a second window (and announce a second key) for it.
  if (std::any_of(l.windows.begin(), l.windows.end(), [&](const auto& w) { return w->segment == def.name && w->lease == 0; }) ||
      std::any_of(l.binds_waiting.begin(), l.binds_waiting.end(),
                  [&](const SegmentDef& d) { return d.name == def.name && d.lease == 0; })) {
    return;
  }
  if (!e_.windows && !e_.is_soft(l.device)) {
    const BufferRec* buf = e_.buffer(def.buffer);
    if (buf == nullptr || !e_.psk) return;  // no key, no windows: nothing is offered (EngineInfo::access_model)
    const MemoryRegion& mr = *buf->regions[l.device];
    auto w = std::make_unique<Window>();
    w->segment = def.name;
    w->buffer = def.buffer;
    w->link = &l;
    w->region = {reinterpret_cast<std::uint64_t>(mr.local().addr()) + def.offset, def.length, mr.remote().rkey, def.access};
    w->bound = true;
    announce(l, *w);
    l.windows.push_back(std::move(w));
    return;
  }
  l.binds_waiting.push_back(def);  // bound in order, as the send queue has room (bind_waiting)
}

bool Worker::post_bind(Link& l, const SegmentDef& def) {
  const BufferRec* buf = e_.buffer(def.buffer);
  if (buf == nullptr || buf->retired.load()) {
    // Unregistered since: nothing to bind (a lease of it ends).
    if (def.lease != 0) lease_unbound(l, def.lease, fmt::format("buffer {} was unregistered", def.buffer));
    return true;
  }
  if (l.impl.dp.mode() == DataPath::Mode::ready && l.impl.dp.lane(0).sq.free() == 0) return false;
  // On a software transport, the window covers the bytes as the CPU reaches them (none for
  // GPU memory: no window, and the peer's transfers to the segment end no_segment).
  const bool on_soft = e_.is_soft(l.device);
  if (on_soft && buf->slices[l.device].length() == 0) {
    log(fmt::format("engine {}: segment '{}' is not offered to {} over {}: its memory is not the CPU's", e_.name,
                    def.name, l.impl.info.peer_address, l.impl.info.transport));
    if (def.lease != 0) lease_unbound(l, def.lease, fmt::format("segment '{}' is not the CPU's memory", def.name));
    return true;
  }
  const MemoryRegion* mr = on_soft ? nullptr : &*buf->regions[l.device];
  const auto addr = reinterpret_cast<std::uint64_t>(buf->slices[l.device].addr()) + def.offset;
  auto w = std::make_unique<Window>();
  w->segment = def.name;
  w->buffer = def.buffer;
  w->link = &l;
  w->lease = def.lease;
  w->in_segment = def.in_segment;
  w->mw.reset(ibv_alloc_mw(e_.pd_of(l.device), IBV_MW_TYPE_2));
  if (!w->mw) {
    throw Error("ibv_alloc_mw", errno, fmt::format("a window on segment '{}' for {}", def.name, l.impl.info.peer_address),
                "the device's memory windows (max_mw) are used up: fewer segments or peers");
  }
  w->rkey = ibv_inc_rkey(w->mw->rkey);
  w->region = {addr, def.length, w->rkey, def.access};
  w->posted = Clock::now();
  const PostResult r = l.impl.dp.post_bind(w->mw.get(), w->rkey, mr != nullptr ? MemoryRegion::Impl::raw(*mr) : nullptr, addr, def.length,
                                           qp_access_flags(def.access), reinterpret_cast<std::uint64_t>(w.get()) | 1);
  if (r.status == PostStatus::queue_full) return false;
  if (!r.ok()) {
    throw Error("bind memory window", r.sys_errno,
                fmt::format("segment '{}' for {}: {}", def.name, l.impl.info.peer_address, r.describe()));
  }
  ++l.binds_pending;
  ++binds_out_;
  l.windows.push_back(std::move(w));
  return true;
}

void Worker::bind_waiting(Link& l) noexcept {
  while (!l.binds_waiting.empty() && l.state != Link::State::closing) {
    try {
      if (!post_bind(l, l.binds_waiting.front())) return;  // no room: the next bind's completion makes some
    } catch (const std::exception& ex) {
      // The peer will not have this segment (its transfers to it end no_segment); the others go on.
      log(fmt::format("engine {}: segment '{}' for {}: {}", e_.name, l.binds_waiting.front().name,
                      l.impl.info.peer_address, ex.what()));
      if (l.binds_waiting.front().lease != 0) lease_unbound(l, l.binds_waiting.front().lease, ex.what());
    }
    l.binds_waiting.pop_front();
  }
  synced_if_done(l);
}

void Worker::synced_if_done(Link& l) noexcept {
  // Never before the peer's IDENT was accepted (grant): a link not admitted yet is told nothing.
  if (l.ident_seen && l.binds_pending == 0 && l.binds_waiting.empty() && !l.synced_sent &&
      l.state != Link::State::closing) {
    l.synced_sent = true;
    send(l, ew::synced(e_.cfg.notification_queue));
  }
}

void Worker::announce(Link& l, const Window& w) noexcept { send(l, ew::segment(w.segment, w.region)); }

void Worker::log(const std::string& what) const noexcept {
  try {
    e_.cfg.link.log(what);
  } catch (...) {
  }
}

void Worker::withdraw(const std::string& name) {
  for (auto& l : links_) {
    if (l->initiated || !l->ident_seen) continue;  // not granted yet: it has nothing of the segment
    // Leases' windows go with their leases, which Engine::withdraw ended first.
    std::erase_if(l->binds_waiting, [&](const SegmentDef& d) { return d.name == name && d.lease == 0; });
    // Invalidated first, then the peer is told (one standing window per segment and link).
    if (revoke_windows(*l, [&](const Window& w) { return w.segment == name && w.lease == 0; }) != 0 &&
        l->state != Link::State::closing) {
      send(*l, ew::withdraw(name));
    }
    synced_if_done(*l);  // what it waited for may have been only that segment's bind
  }
}

std::size_t Worker::revoke_windows(Link& l, const std::function<bool(const Window&)>& match) {
  std::size_t revoked = 0;
  for (auto it = l.windows.begin(); it != l.windows.end();) {
    Window& w = **it;
    if (!match(w)) {
      ++it;
      continue;
    }
    if (!w.bound && w.mw) {
      // Its bind completes first (its key was never announced); then it goes, unannounced.
      w.segment.clear();
      w.lease = 0;
      // A software transport's bind took effect when posted: its key dies now, not when the
      // completion is taken (its peer's requests are served before that).
      if (e_.is_soft(l.device)) w.mw.reset();
      ++it;
      continue;
    }
    it = l.windows.erase(it);  // deallocating a window revokes its key, now
    ++revoked;
  }
  return revoked;
}

void Worker::send(Link& l, const ew::Message& m) noexcept {
  if (l.state == Link::State::closing) return;
  std::vector<std::uint8_t> bytes;
  try {
    bytes = ew::encode(m, l.impl.engine_protocol);
  } catch (const std::exception& e) {
    // A message this engine cannot encode is its own bug, not the peer's: said, and not sent.
    return log(fmt::format("engine {}: a message to {} could not be encoded: {}", e_.name, l.impl.info.peer_address, e.what()));
  }
  send(l, bytes);
}

// Control messages never wait for the peer: they go into the link's outbox, which the channel
// takes as it can (at once, nearly always); the rest goes as the peer reads, while this worker
// serves its other links. One that stops reading loses the link (outbox_stalled).
void Worker::send(Link& l, const std::vector<std::uint8_t>& msg) noexcept {
  if (l.state == Link::State::closing) return;
  try {
    l.impl.queue_control(wire::MessageType::user, msg);
    if (l.impl.control_waiting() > kMaxOutbox) {
      return break_link(l, fmt::format("{} bytes of control messages wait for it to read (at most {}): it reads "
                                       "far slower than this engine sends",
                                       l.impl.control_waiting(), kMaxOutbox));
    }
  } catch (const std::exception& e) {
    return break_link_anyway(l, [&] { return fmt::format("its control channel failed: {}", e.what()); });
  }
  flush_outbox(l);
}

namespace {

// The events a link's control channel is watched for: readable, and writable while its outbox
// waits for a socket's room.
epoll_event control_events(Link& l, bool writable) noexcept {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | (writable ? EPOLLOUT : 0U);
  ev.data.u64 = reinterpret_cast<std::uint64_t>(&l);
  return ev;
}

}  // namespace

void Worker::forget_sent_notes(Link& l) noexcept {
  while (!l.notes_waiting.empty() && l.notes_waiting.front() <= l.impl.out_taken) l.notes_waiting.pop_front();
}

void Worker::flush_outbox(Link& l) noexcept {
  Connection::Impl& c = l.impl;
  if (c.control_waiting() > 0) c.flush_control();
  forget_sent_notes(l);
  if (c.send_errno != 0 && l.state != Link::State::closing) {
    break_link_anyway(l, [&] { return fmt::format("sending on its control channel failed ({})", errno_name(c.send_errno)); });
  }
  // A socket's writability wakes the worker while something waits (and only then: a socket with
  // room is always writable); an rdma_cm channel's descriptor turns readable on its send
  // completions instead (EPOLLOUT is never reported for it, so asking costs nothing).
  const bool waiting = c.control_waiting() > 0;
  if (!l.watched || l.watched_out == waiting) return;
  epoll_event ev = control_events(l, waiting);
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.control->fd(), &ev) == 0) l.watched_out = waiting;
}

bool Worker::outbox_stalled(Link& l, Deadline now) noexcept {
  if (l.impl.control_waiting() == 0 || now - l.impl.out_moved < e_.cfg.control_timeout) return false;
  break_link_anyway(l, [&] {
    std::string why = fmt::format("it has read none of the {} bytes of control messages waiting for it for {} ms "
                                  "(control_timeout): the peer's process is stopped, hung or swamped",
                                  l.impl.control_waiting(), e_.cfg.control_timeout.count());
    log(fmt::format("engine {}: the link to {} goes: {}", e_.name, l.initiated ? l.peer->name : l.peer_name, why));
    return why;
  });
  return true;
}

bool Worker::said_bye(Link& l, Deadline now) noexcept {
  Connection::Impl& c = l.impl;
  if (!c.control || c.control_gone || c.bye_received || c.send_errno != 0) {
    c.bye_queued = true;  // a peer that closed needs no BYE (nor close() to wait to send one)
    return true;
  }
  if (!c.bye_queued) {
    c.bye_queued = true;
    try {
      // What its transfers moved since the last report: the peer's per-peer figures are whole.
      if (l.initiated && l.moved != l.moved_told) {
        l.moved_told = l.moved;
        c.queue_control(wire::MessageType::user, ew::encode(ew::active(l.moved), l.impl.engine_protocol));
      }
      c.queue_control(wire::MessageType::bye, {});
    } catch (...) {
      return true;  // out of memory: the close tells the peer without it
    }
  }
  flush_outbox(l);
  if (c.send_errno != 0 || (c.control_waiting() == 0 && c.control->sent())) return true;
  // A peer that reads gets what waits; one that took nothing for a second is not waited for (the
  // closing link holds a QP of the budget meanwhile).
  return now - c.out_moved >= std::min<std::chrono::milliseconds>(e_.cfg.control_timeout, kByeWait);
}

void Worker::tick_link(Link& l, Deadline now) noexcept {
  try {
    l.impl.tick(now);
    if (l.impl.control_waiting() > 0 || l.watched_out) flush_outbox(l);
    while (!l.impl.messages.empty()) {
      const std::vector<std::uint8_t> m = std::move(l.impl.messages.front());
      l.impl.messages.pop_front();
      on_message(l, m);
    }
  } catch (const std::exception& ex) {
    // What a peer sends never ends the process: the link goes, with why.
    break_link_anyway(l, [&] { return fmt::format("handling its control message: {}", ex.what()); });
  }
  if (l.impl.control_gone && l.watched) watch(l, false);  // EOF stays readable: stop looking
  if (l.state != Link::State::closing && (l.impl.dp.mode() == DataPath::Mode::broken || l.impl.dp.mode() == DataPath::Mode::closed)) {
    break_link(l, l.impl.dp.failure());
  }
}

void Worker::make_ready(Link& l) {
  Peer& p = *l.peer;
  const bool first = l.rail == p.rails[0].get();
  if (!first && !l.rail->wanted) {
    // Dropped while it connected (the peer restarted or moved and no longer offers it).
    return break_link(l, "the peer no longer offers this rail (it restarted or moved)");
  }
  l.state = Link::State::ready;
  {
    std::lock_guard lock(p.m);
    l.rail->state = "up";
    l.rail->reason.clear();
  }
  l.rail->backoff = std::chrono::milliseconds{0};
  if (first) held_after_sync(l);
  Fifo<Xfer*> waiting;
  std::swap(waiting, p.waiting);
  for (; !waiting.empty(); waiting.pop_front()) start_transfer(p, *waiting.front());
  if (!first) {
    std::lock_guard lock(p.m);
    p.cv.notify_all();  // Engine::connect() waits for the rails too
    return;
  }
  std::lock_guard lock(p.m);
  p.up = true;
  p.up_epoch = p.epoch;
  ++p.attempts;
  p.cv.notify_all();
}

void Worker::break_link(Link& l, const std::string& why) {
  if (l.state == Link::State::closing) return;
  l.state = Link::State::closing;
  l.broke_at = Clock::now();
  nudge();  // its reaping and the deferred transfers' ends are the worker's thread's
  abandon_chain(l, fmt::format("peer '{}': {}", l.initiated ? l.peer->name : l.peer_name, why));
  l.impl.dp.break_connection(why, BreakCause::peer);
  const std::string reason = fmt::format("peer '{}': {}", l.initiated ? l.peer->name : l.peer_name, why);
  while (!l.backlog.empty()) {
    Xfer* x = l.backlog.front();
    l.backlog.pop_front();
    lost(l, *x, TransferStatus::peer_lost, reason);
  }
  l.backlog_bytes = 0;
  if (l.initiated) {
    held_link_gone(l, why);
  } else {
    end_link_leases(l, why);
  }
  if (l.initiated && l.rail != nullptr && l.rail != l.peer->rails[0].get()) {
    if (l.rail->link == &l) rail_down(*l.peer, *l.rail, why, /*went_down=*/true);
  } else if (l.initiated && l.rail != nullptr) {
    std::lock_guard lock(l.peer->m);
    l.rail->state = "down";
    l.rail->reason = why;
  }
  if (l.initiated && l.peer->link == &l) {
    Peer& p = *l.peer;
    p.link = nullptr;
    // Transfers that waited for this link to be ready: another attempt, unless the peer is gone.
    if ((!p.waiting.empty() || holds_leases(p)) && !p.removed.load() && !p.gone.load() && !p.connecting) {
      p.connecting = true;
      e_.request_connect(&p);
    }
    std::lock_guard lock(p.m);
    p.up = false;
  }
}

void Worker::break_links(Peer& p, const std::string& why) {
  if (p.link != nullptr) break_link(*p.link, why);
  for (std::size_t k = 1; k < p.rails.size(); ++k) {
    if (p.rails[k]->link != nullptr) break_link(*p.rails[k]->link, why);
  }
}

void Worker::reap_links() {
  for (auto it = links_.begin(); it != links_.end();) {
    Link& l = **it;
    if (l.state != Link::State::closing) {
      ++it;
      continue;
    }
    const bool peer_gone = l.impl.control_gone || l.impl.bye_received;
    if (!l.settled) {
      l.impl.dp.post_owed_markers();
      if (l.impl.dp.outstanding() > 0 ||
          (!l.deferred.empty() && !peer_gone && Clock::now() - l.broke_at < kPeerGoneGrace)) {
        ++it;
        continue;
      }
      settle(l, peer_gone);
    }
    // What was queued for the peer (a withdrawal, its last notifications), then BYE: sent
    // without waiting here, the link kept until the peer has it.
    if (!said_bye(l, Clock::now())) {
      ++it;
      continue;
    }
    close_link(l);
    Peer* p = l.initiated ? l.peer : nullptr;
    it = links_.erase(it);
    if (p != nullptr && p->removed.load()) release_if_quiet(*p);
  }
}

void Worker::settle(Link& l, bool peer_gone) {
  l.settled = true;
  for (Link::Deferred& d : l.deferred) {
    if (peer_gone) {
      // The peer closed this link (its process died, or only this rail failed on its side and
      // its windows went with the link): another rail of a live peer does it.
      lost(l, *d.x, TransferStatus::peer_lost,
           fmt::format("{} (the peer's process went away: {})", d.reason, l.impl.control_gone_reason()));
    } else if (d.transport) {
      lost(l, *d.x, TransferStatus::failed, std::move(d.reason));
    } else {
      end(*d.x, TransferStatus::failed, std::move(d.reason));
    }
  }
  l.deferred.clear();
  // Nothing is outstanding: what was retired without news (behind a drain marker) completed;
  // a split transfer whose parts never all came back did not.
  walk(l, l.impl.dp.lane(0).sq.next_seq(), TransferStatus::ok, {});
  for (Xfer* x : l.alone) lost(l, *x, TransferStatus::peer_lost, fmt::format("peer '{}': the link broke", l.initiated ? l.peer->name : l.peer_name));
  l.alone.clear();
}

void Worker::release_if_quiet(Peer& p) noexcept {
  if (!p.removed.load() || p.released || p.connecting || !p.waiting.empty()) return;
  for (const auto& r : p.rails) {
    if (r->link != nullptr || r->connecting) return;
  }
  for (const auto& l : links_) {
    if (l->initiated && l->peer == &p) return;  // closing, not reaped yet
  }
  std::erase_if(probes_, [&p](const auto& pr) { return pr.first == &p; });
  p.released = true;
  e_.release_peer(p);  // may free it: the last use of `p` here
}

void Worker::close_link(Link& l) noexcept {
  binds_out_ -= std::min<std::uint64_t>(binds_out_, l.binds_pending);  // those that never completed
  l.binds_pending = 0;
  forget_sent_notes(l);
  if (!l.notes_waiting.empty()) {
    e_.count.notifications_lost.fetch_add(l.notes_waiting.size(), std::memory_order_relaxed);
    try {
      log(fmt::format("engine {}: {} notifications to {} were still waiting in the link's outbox when it went: "
                      "lost (notifications_lost)",
                      e_.name, l.notes_waiting.size(), l.initiated ? l.peer->name : l.peer_name));
    } catch (...) {
    }
  }
  watch(l, false);
  std::erase(to_flush_, &l);
  std::erase(to_break_, &l);
  l.windows.clear();  // revoked before the QP goes
  l.impl.close(std::chrono::milliseconds{500});
  if (l.initiated && l.peer->link == &l) l.peer->link = nullptr;
  if (l.rail != nullptr && l.rail->link == &l) l.rail->link = nullptr;
  e_.count.links.fetch_sub(1, std::memory_order_relaxed);
}

bool Worker::evict_one() {
  // Idle by evidence only. A link this engine opened is idle when nothing of it is in flight or
  // queued (known here); one a peer opened, when the peer has not reported transfers on it for
  // idle_after (its one-sided transfers are invisible here). Those this engine opened go first.
  const Deadline now = Clock::now();
  Link* victim = nullptr;
  // One evicted link still saying BYE is room on its way: another is not taken for it.
  if (std::any_of(links_.begin(), links_.end(), [](const auto& l) { return l->evicted; })) return false;
  for (auto& l : links_) {
    if (l->state == Link::State::closing) continue;
    // A link this engine opened counts as idle after a twentieth of idle_after (100 ms by
    // default) without a completion: the gap between a client's batches is not idleness.
    const bool idle = l->initiated ? l->state == Link::State::ready && l->in_flight == 0 && l->backlog.empty() &&
                                         l->peer->waiting.empty() && now - l->last_used >= e_.cfg.idle_after / 20
                                   : l->binds_pending == 0 && l->binds_waiting.empty() &&
                                         now - l->last_used >= e_.cfg.idle_after;
    // A link that holds leases' windows (or uses them) is not idle: its lease would end with it.
    if (!idle || !l->leases.empty() || !l->lease_ranges.empty()) continue;
    if (victim == nullptr || (l->initiated && !victim->initiated) ||
        (l->initiated == victim->initiated && l->last_used < victim->last_used)) {
      victim = l.get();
    }
  }
  if (victim == nullptr) return false;
  e_.count.evictions.fetch_add(1, std::memory_order_relaxed);
  // An evicted further rail is not probed: it opens again with the peer's next first link.
  if (victim->rail != nullptr) victim->rail->wanted = false;
  victim->evicted = true;
  break_link(*victim, "evicted to stay within the engine's QP budget (idle)");
  reap_links();
  return true;
}

void Worker::watch(Link& l, bool on) {
  if (l.watched == on || !l.impl.control) return;
  if (on) {
    epoll_event ev = control_events(l, false);  // writability is asked for by flush_outbox
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, l.impl.control->fd(), &ev) == 0) l.watched = true;
  } else {
    (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, l.impl.control->fd(), nullptr);
    l.watched = false;
    l.watched_out = false;
  }
}

void Worker::fail_waiting(Peer& p, TransferStatus s, const std::string& why) noexcept {
  while (!p.waiting.empty()) {
    Xfer* x = p.waiting.front();
    p.waiting.pop_front();
    end(*x, s, why);
  }
}

void Worker::check_retiring() noexcept {
  for (auto it = retiring_.begin(); it != retiring_.end();) {
    const std::uint32_t id = (*it)->buffer, gen = (*it)->generation;
    bool used = false;
    for (const BatchState* b : live_) {
      for (std::uint32_t i = 0; i < b->size && !used; ++i) {
        // (A batch of descriptor lists: from its list, none of its transfers built here; the
        // entries of other workers' shares are read, whose builds are theirs.)
        const Buffer& local = b->local_at(i);
        used = local.id == id && local.generation == gen && b->x[i].status(std::memory_order_relaxed) == TransferStatus::pending;
      }
      if (used) break;
    }
    // A window on it (withdrawn with its bind still in flight) holds it too: deregistering under
    // a bound window fails, and the pages would stay pinned.
    for (auto l = links_.begin(); l != links_.end() && !used; ++l) {
      used = std::any_of((*l)->windows.begin(), (*l)->windows.end(), [id](const auto& w) { return w->buffer == id; });
    }
    if (used) {
      ++it;
    } else {
      (*it)->worker_done();
      it = retiring_.erase(it);
    }
  }
}

}  // namespace rdmakit::detail
