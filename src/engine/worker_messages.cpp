// SPDX-License-Identifier: Apache-2.0
// An engine worker's handling of the messages a linked engine sends (protocol.hpp): each checked
// against the link's side and state before it is acted on, nothing before the peer's IDENT.
// Runs on the worker's thread (or in progress()).
#include <algorithm>

#include <fmt/format.h>

#include "engine/impl.hpp"
#include "engine/protocol.hpp"

namespace rdmakit::detail {

namespace ew = engine_wire;

void Worker::on_message(Link& l, std::span<const std::uint8_t> bytes) {
  ew::Message m;
  try {
    m = ew::decode(bytes, l.impl.engine_protocol);
  } catch (const std::exception& ex) {
    return break_link(l, fmt::format("it sent a malformed engine message: {}", ex.what()));
  }
  // Nothing a refused or closing link says is acted on (an impostor's RAILS would rewrite the
  // real peer's rails), and nothing comes before the peer says who it is.
  if (l.state == Link::State::closing) return;
  if (!l.ident_seen && m.kind != ew::Kind::ident) {
    return break_link(l, fmt::format("it sent {} before saying who it is (IDENT comes first)", static_cast<int>(m.kind)));
  }
  switch (m.kind) {
    case ew::Kind::ident: {
      // A link's peer is fixed when it says who it is: a second IDENT (another name, another
      // epoch) would rename it, close other engines' links as stale, and forge notifications.
      if (l.ident_seen) return break_link(l, "it sent IDENT a second time on one link (a link's peer never changes)");
      l.ident_seen = true;
      if (!check_identity(l, m)) return;
      if (l.initiated && l.rail != nullptr && l.rail != l.peer->rails[0].get() && l.peer->epoch != 0 &&
          m.epoch != l.peer->epoch) {
        // A further rail answered by another process than the peer's link (an old endpoint of
        // a peer that restarted or moved): not the peer, and not news of a restart.
        l.rail->wanted = false;  // not probed again: the peer's next RAILS says whether it is offered
        return break_link(l, fmt::format("its rail was answered by epoch {:#x}; the peer's link has {:#x}", m.epoch,
                                         l.peer->epoch));
      }
      const bool restarted = l.initiated && l.peer->epoch != 0 && l.peer->epoch != m.epoch;
      l.peer_name = m.name;
      l.peer_epoch = m.epoch;
      if (l.initiated) {
        if (restarted) {
          e_.count.restarts.fetch_add(1, std::memory_order_relaxed);
          // Its further rails were its old process's: their links go, none is probed again
          // until this link's RAILS says which the new process offers (Worker::on_rails).
          for (std::size_t k = 1; k < l.peer->rails.size(); ++k) {
            RailState& r = *l.peer->rails[k];
            if (&r == l.rail) continue;
            r.wanted = false;
            if (r.link != nullptr && r.link->peer_epoch != 0 && r.link->peer_epoch != m.epoch) {
              break_link(*r.link, fmt::format("peer '{}' restarted: this rail was its earlier process's", l.peer->name));
            }
          }
        }
        if (restarted) forget_held(*l.peer, "the peer restarted (its leases were its earlier process's)");
        l.peer->epoch = m.epoch;
      } else {
        // The same engine opened a link with a new epoch: it restarted, and its links of the old
        // one are stale here and on the other workers.
        close_stale(m.name, m.epoch, &l);
        for (auto& w : e_.workers) {
          if (w.get() == this) continue;
          Command c(Command::Kind::restarted, nullptr, m.name);
          c.epoch = m.epoch;
          w->post(std::move(c));
        }
        grant(l);
      }
      break;
    }
    case ew::Kind::segment:
    case ew::Kind::withdraw: {
      if (!l.initiated) return break_link(l, "it announced segments on a link it opened (only the accepting side does)");
      if (m.kind == ew::Kind::segment) {
        l.remote[m.name] = m.region;
      } else {
        l.remote.erase(m.name);
      }
      const std::uint32_t slot = e_.slot_of(*l.peer, m.name);
      if (l.by_slot.size() <= slot) l.by_slot.resize(slot + 1);
      l.by_slot[slot] = m.kind == ew::Kind::segment ? std::optional<RemoteRegion>(m.region) : std::nullopt;
      refresh_remote(l);  // the leases' ranges stay
      break;
    }
    case ew::Kind::synced:
      if (!l.initiated) return break_link(l, "it sent SYNCED on a link it opened (only the accepting side does)");
      l.notify_credits = l.notify_queue = m.credits;
      if (l.state == Link::State::syncing) make_ready(l);
      break;
    case ew::Kind::active:
      if (l.initiated) return break_link(l, "it reported activity on a link this engine opened");
      l.last_used = Clock::now();
      // What it says it moved: only its own accounting (a peer may say anything), counted
      // as it grows.
      if (m.moved > l.moved) {
        e_.add_served(l.peer_name, m.moved - l.moved);
        l.moved = m.moved;
      }
      break;
    case ew::Kind::credit:
      if (!l.initiated) return break_link(l, "it returned notification credits on a link it opened");
      l.notify_credits = static_cast<std::uint32_t>(std::min<std::uint64_t>(std::uint64_t{l.notify_credits} + m.credits, UINT32_MAX));
      break;
    case ew::Kind::notify:
      if (l.initiated) return break_link(l, "it sent a notification on a link this engine opened");
      if (!l.notes) {
        l.notes = std::make_shared<NoteCredits>();
        l.notes->worker = this;
      }
      e_.deliver(l.notes, {l.peer_name.empty() ? l.impl.info.peer_address : l.peer_name, std::move(m.bytes),
                           std::move(m.request_id)});
      break;
    case ew::Kind::refuse: {
      if (!l.initiated) return break_link(l, "it refused a link it opened (only the accepting side does)");
      return wrong_engine(l, fmt::format("peer '{}' at {} refused the link: {}", l.peer->name, l.impl.info.peer_address,
                                         ew::printable(m.bytes)));
    }
    case ew::Kind::lease: on_lease(l, m); break;
    case ew::Kind::lease_end: on_lease_end(l, m.lease, ew::printable(m.bytes)); break;
    case ew::Kind::renewed: on_renewed(l, m.lease, m.ttl_ms); break;
    case ew::Kind::renew:
      if (l.initiated) return break_link(l, "it renewed a lease on a link this engine opened (only its own are renewed)");
      on_renew(l, m.lease, m.ttl_ms);
      break;
    case ew::Kind::rails:
      if (!l.initiated) return break_link(l, "it sent its rails on a link it opened (only the accepting side does)");
      if (l.rails_seen) return break_link(l, "it sent its rails twice on one link");
      l.rails_seen = true;
      if (l.rail == l.peer->rails[0].get()) on_rails(l, m);  // a further rail's copy says nothing new
      break;
  }
}

void Worker::close_stale(const std::string& name, std::uint64_t epoch, const Link* except) {
  for (auto& o : links_) {
    if (o.get() == except || o->state == Link::State::closing || o->peer_epoch == 0 || o->peer_epoch == epoch) continue;
    // Links it opened to us (its windows are revoked with them). Not ours to it: each answered
    // with an IDENT of its own, and a link that is up wins over what another link says (a name
    // on a new link is only what that peer says: docs/security.md).
    if (o->initiated || o->peer_name != name) continue;
    e_.count.restarts.fetch_add(1, std::memory_order_relaxed);
    break_link(*o, fmt::format("peer '{}' restarted (epoch {:#x} -> {:#x})", name, o->peer_epoch, epoch));
  }
}

}  // namespace rdmakit::detail
