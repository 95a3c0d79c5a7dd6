// SPDX-License-Identifier: Apache-2.0
// A worker's rails: which of a peer's links a transfer goes on, slicing, failover to another
// rail, and probing a failed rail until it answers (docs/engine.md, "Rails"). Every rail of a
// peer is on the peer's worker (it has a CQ on every device), so a sliced transfer and its
// failover are handled on one thread.
#include <algorithm>

#include <fmt/format.h>

#include "bootstrap/socket.hpp"
#include "engine/impl.hpp"
#include "engine/protocol.hpp"

namespace rdmakit::detail {

namespace ew = engine_wire;

namespace {

// How often one read or write (or slice) is re-posted on another rail before it fails.
constexpr std::uint8_t kMaxTries = 3;

}  // namespace

Link* Worker::pick_rail(Peer& p, const BufferRec* buf, const Link* instead_of) noexcept {
  Link* best = nullptr;
  std::uint64_t least = ~std::uint64_t{0};
  unsigned best_rank = ~0u;
  auto consider = [&](Link* c) {
    if (!ready(c) || c == instead_of) return;
    // Another rail of the same process: a restarted peer's new links are not the old one's.
    if (instead_of != nullptr && c->peer_epoch != instead_of->peer_epoch) return;
    const unsigned rank = buf != nullptr && c->device < buf->rank.size() ? buf->rank[c->device] : 0;
    const std::uint64_t load = c->bytes_out + c->backlog_bytes;
    if (rank < best_rank || (rank == best_rank && load < least)) {
      best_rank = rank;
      least = load;
      best = c;
    }
  };
  // Ties (idle rails) go round: small transfers from one thread after another spread too.
  const std::size_t n = p.rails.size();
  const std::size_t from = p.next_rail++ % n;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t k = (from + i) % n;
    consider(rail_link(p, k));
  }
  return best;
}

bool Worker::slicing(const Peer& p) const noexcept {
  if (e_.cfg.rails.slice_threshold == 0) return false;
  int up = ready(p.link) ? 1 : 0;
  for (std::size_t k = 1; k < p.rails.size() && up < 2; ++k) up += ready(p.rails[k]->link) ? 1 : 0;
  return up >= 2;
}

void Worker::queue_on(Link& l, Xfer& x) {
  if (cancels(x)) [[unlikely]] return end(x, TransferStatus::cancelled, kCancelled);
  l.backlog.push_back(&x);
  l.backlog_bytes += x.transfer().length;
  queue_flush(l);
}

void Worker::slice(Peer& p, Xfer& x) {
  auto g = std::make_unique<SliceGroup>();
  g->parent = &x;
  x.batch->sliced.store(true, std::memory_order_relaxed);
  const std::uint64_t size = e_.cfg.rails.slice_size;
  for (std::uint64_t off = 0; off < x.transfer().length; off += size) {
    Transfer t = x.transfer();
    t.local_offset += off;
    t.remote_offset += off;
    t.length = std::min(size, x.transfer().length - off);
    Xfer& s = g->slices.emplace_back(g->transfers.emplace_back(t), x.batch, x.index);
    s.group = g.get();
  }
  g->left = static_cast<std::uint32_t>(g->slices.size());
  e_.count.slices.fetch_add(g->left, std::memory_order_relaxed);
  SliceGroup& group = *g;
  groups_.emplace(&x, std::move(g));
  // Each to the rail with the fewest bytes outstanding (counting the slices queued so far).
  for (Xfer& s : group.slices) {
    Link* l = pick(p, &buffer_of(x));
    if (l == nullptr) {  // cannot happen (slices_for saw two rails ready), but never lose one
      end(s, TransferStatus::peer_lost, fmt::format("peer '{}': no rail is up", p.name));
      continue;
    }
    queue_on(*l, s);
  }
}

void Worker::slice_ended(Xfer& s, TransferStatus st, std::string reason) noexcept {
  SliceGroup& g = *s.group;
  if (st != TransferStatus::ok && g.status == TransferStatus::ok) {
    g.status = st;
    g.reason = std::move(reason);
  }
  if (st == TransferStatus::ok && s.path() != kNoPath) {
    try {
      g.bytes_by_path[s.path()] += s.transfer().length;
    } catch (...) {  // telemetry only: a slice's path unrecorded, the transfer unharmed
    }
  }
  if (--g.left != 0) return;
  Xfer& parent = *g.parent;
  const TransferStatus status = g.status;
  std::string why = std::move(g.reason);
  if (status == TransferStatus::ok && !g.bytes_by_path.empty()) {
    // Read by Batch::telemetry() from another thread: under the batch's lock (slices are few
    // and large: a lock per sliced transfer).
    try {
      std::lock_guard lock(parent.batch->mu);
      auto& sliced = parent.batch->sliced_paths;
      if (!sliced) sliced = std::make_unique<BatchState::SlicedPaths>();
      for (const auto& [path, bytes] : g.bytes_by_path) {
        auto& [b, n] = (*sliced)[path];
        b += bytes;
        ++n;
      }
      parent.set_path(kSlicedPath);
    } catch (...) {
    }
  }
  groups_.erase(&parent);  // the slices go with it
  end(parent, status, std::move(why));
}

void Worker::lost(Link& l, Xfer& x, TransferStatus s, std::string why) noexcept {
  // Reads and writes are idempotent: another rail does them again. An atomic never is: it may
  // have been applied before its rail failed.
  if (!stop_.load(std::memory_order_relaxed) && l.initiated && x.transfer().op <= TransferOp::write && x.tries < kMaxTries &&
      (s == TransferStatus::peer_lost || s == TransferStatus::failed)) {
    Peer& p = *l.peer;
    if (!p.removed.load(std::memory_order_relaxed) && !p.gone.load(std::memory_order_relaxed)) {
      if (x.batch->cancelled.load(std::memory_order_relaxed)) {
        return end(x, s, fmt::format("{} (not posted again on another rail: the batch was cancelled)", why));
      }
      if (Link* to = pick(p, &buffer_of(x), &l)) {
        ++x.tries;
        e_.count.reposted.fetch_add(1, std::memory_order_relaxed);
        if (l.rail != nullptr) l.rail->reposted.fetch_add(1, std::memory_order_relaxed);
        return queue_on(*to, x);
      }
    }
  }
  end(x, s, std::move(why));
}

std::vector<std::uint8_t> Worker::rails_message(const Link& l) const {
  const std::uint16_t port = e_.listen_port.load(std::memory_order_acquire);
  std::vector<RailPort> ports = e_.offered_rails();
  if (ports.size() > ew::kMaxRails) ports.resize(ew::kMaxRails);
  std::uint8_t here = 0xff;
  for (std::size_t i = 0; i < ports.size(); ++i) {
    if (ports[i].device == l.impl.info.device && ports[i].port == l.impl.info.port) here = static_cast<std::uint8_t>(i);
  }
  return ew::encode(ew::rails(port, here, std::move(ports)), l.impl.engine_protocol);
}

void Worker::on_rails(Link& l, const ew::Message& m) {
  Peer& p = *l.peer;
  // Rails are RDMA ports: a tcp or shm link spreads over its own streams instead.
  if (e_.is_soft(l.device)) return;
  const RailConfig& rc = e_.cfg.rails;
  const std::vector<RailPort> local = local_rails(e_.catalog(), e_.cfg.link.gid, rc.devices);
  const std::optional<std::size_t> first_peer =
      m.this_rail != 0xff ? std::optional<std::size_t>(m.this_rail) : std::nullopt;
  const std::size_t extra = rc.max == 0 ? ew::kMaxRails : rc.max - 1;
  RailMatch match = match_rails(local, m.rails, l.impl.info.device, l.impl.info.port, first_peer, extra);
  std::vector<RailState*> open, stale;
  {
    std::lock_guard lock(p.m);
    if (first_peer) p.rails[0]->peer = m.rails[*first_peer];
    p.unused_rails = std::move(match.unused);
    std::vector<bool> planned(p.rails.size(), false);
    for (RailPlan& plan : match.rails) {
      RailState* r = nullptr;
      for (std::size_t k = 1; k < p.rails.size() && r == nullptr; ++k) {
        RailState& o = *p.rails[k];
        if (o.local.device == plan.local.device && o.local.port == plan.local.port && o.peer.endpoint == plan.peer.endpoint) {
          r = &o;
          planned[k] = true;
        }
      }
      if (r == nullptr) {
        // A rail the peer no longer offers, and that nothing refers to now, takes the new one;
        // else a new one (never freed before the engine: the connect queue may point at it).
        for (std::size_t k = 1; k < p.rails.size() && r == nullptr; ++k) {
          RailState& o = *p.rails[k];
          if (!planned[k] && o.state == "gone" && o.link == nullptr && !o.connecting) {
            r = &o;
            planned[k] = true;
          }
        }
        if (r == nullptr) {
          r = p.rails.emplace_back(std::make_unique<RailState>()).get();
          planned.push_back(true);
        }
        r->local = std::move(plan.local);
        r->peer = std::move(plan.peer);
        r->backoff = std::chrono::milliseconds{0};
      }
      r->wanted = true;
      if (r->link == nullptr && !r->connecting) {
        r->state = "connecting";
        open.push_back(r);
      }
    }
    // The rails of the peer's earlier process (it restarted or moved) that this one does not
    // offer: never probed again; a link still up on one goes.
    for (std::size_t k = 1; k < p.rails.size(); ++k) {
      RailState& o = *p.rails[k];
      if (planned[k] || o.state == "gone") continue;
      o.wanted = false;
      o.state = "gone";
      o.reason = "the peer no longer offers it (it restarted or moved)";
      if (o.link != nullptr) stale.push_back(&o);
    }
  }
  for (RailState* r : stale) {
    if (r->link != nullptr) break_link(*r->link, "the peer no longer offers this rail (it restarted or moved)");
  }
  for (RailState* r : open) {
    r->connecting = true;
    e_.request_connect(&p, r);
  }
}

void Worker::rail_down(Peer& p, RailState& r, const std::string& why, bool went_down) {
  if (went_down) {
    r.link = nullptr;
    if (r.wanted) {  // not an eviction
      r.failures.fetch_add(1, std::memory_order_relaxed);
      e_.count.rail_failures.fetch_add(1, std::memory_order_relaxed);
    }
  }
  const bool probe = r.wanted && !stop_.load() && !p.removed.load() && !p.gone.load();
  if (probe) {
    r.backoff = r.backoff.count() == 0 ? e_.cfg.rails.probe_first : std::min(2 * r.backoff, e_.cfg.rails.probe_max);
    r.probe_at = Clock::now() + r.backoff;
    probes_.emplace_back(&p, &r);
    nudge();
  }
  std::lock_guard lock(p.m);
  p.cv.notify_all();  // Engine::connect() waits for the rails too
  if (r.state == "gone") return;  // dropped: the peer no longer offers it
  r.state = "down";
  r.reason = probe ? fmt::format("{} (probed again in {} ms)", why, r.backoff.count())
                   : r.wanted ? why : fmt::format("{} (opened again with the peer's next link)", why);
}

void Worker::probe_rails(Deadline now) {
  for (auto it = probes_.begin(); it != probes_.end();) {
    auto [p, r] = *it;
    if (p->removed.load() || p->gone.load() || !r->wanted || r->link != nullptr || r->connecting) {
      it = probes_.erase(it);
      continue;
    }
    if (now < r->probe_at) {
      ++it;
      continue;
    }
    r->connecting = true;
    {
      std::lock_guard lock(p->m);
      r->state = "connecting";
    }
    e_.request_connect(p, r);
    it = probes_.erase(it);
  }
}

}  // namespace rdmakit::detail
