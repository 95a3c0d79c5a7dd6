// SPDX-License-Identifier: Apache-2.0
// Leases, the application's side (leases.hpp): grant, end, the ends' queue; and the holder's
// lease(), renew(), release(). The workers' side is worker_leases.cpp.
#include <algorithm>

#include <fmt/format.h>

#include "engine/admission.hpp"
#include "engine/impl.hpp"

namespace rdmakit {

using detail::LeaseState;

const char* to_string(LeaseCause cause) noexcept {
  switch (cause) {
    case LeaseCause::expired: return "expired";
    case LeaseCause::released: return "released";
    case LeaseCause::revoked: return "revoked";
    case LeaseCause::peer_lost: return "peer_lost";
    case LeaseCause::withdrawn: return "withdrawn";
    case LeaseCause::failed: return "failed";
  }
  return "?";
}

void Engine::expose_leased(std::string name, const Buffer& buffer, Access access, std::uint64_t offset,
                           std::uint64_t length) {
  impl_->expose(std::move(name), buffer, access, offset, length, {}, /*leased=*/true);
}

std::uint64_t Engine::grant(const std::string& peer, std::span<const LeaseRange> ranges, Access access,
                            std::chrono::milliseconds ttl) {
  detail::check_peer_entry(peer, "grant");
  if (!impl_->windows && impl_->rdma_count > 0) {
    throw Error("grant", ENOTSUP,
                fmt::format("device {} has no type-2 memory windows: a lease could not be taken back from the peer",
                            impl_->no_windows_device),
                "use a NIC with type-2 memory windows, or the tcp or shm transports");
  }
  if (ttl < std::chrono::milliseconds{1} || ttl > std::chrono::hours{1}) {
    throw Error("grant", EINVAL, fmt::format("a ttl of {} ms (1 ms .. 1 hour)", ttl.count()));
  }
  if (ranges.empty() || ranges.size() > 65536) {
    throw Error("grant", EINVAL, fmt::format("{} ranges (1..65536)", ranges.size()));
  }
  if (access == Access::none ||
      (static_cast<std::uint32_t>(access) & ~static_cast<std::uint32_t>(detail::kAllRemote)) != 0) {
    throw Error("grant", EINVAL, fmt::format("access {} (remote_read, remote_write, remote_atomic)", to_string(access)));
  }
  auto s = std::make_shared<LeaseState>();
  s->peer = peer;
  s->access = access;
  s->ttl = ttl;
  s->ranges.reserve(ranges.size());
  {
    std::lock_guard lock(impl_->mu);
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const LeaseRange& r = ranges[i];
      const auto it = impl_->segments.find(r.segment);
      if (it == impl_->segments.end()) {
        throw Error("grant", EINVAL, fmt::format("range {}: no segment '{}'", i, r.segment));
      }
      const detail::SegmentDef& d = it->second;
      if (!d.leased) {
        // Its standing windows would outlive the lease: taking it back would take nothing back.
        throw Error("grant", EINVAL, fmt::format("range {}: segment '{}' is exposed to peers for good, not for leases", i, r.segment),
                    "expose it with expose_leased()");
      }
      if (r.length == 0 || r.offset > d.length || r.length > d.length - r.offset) {
        throw Error("grant", EINVAL, fmt::format("range {}: [{}, +{}) is not inside segment '{}' of {} bytes", i,
                                                 r.offset, r.length, r.segment, d.length));
      }
      if ((static_cast<std::uint32_t>(access) & ~static_cast<std::uint32_t>(d.access)) != 0) {
        throw Error("grant", EINVAL, fmt::format("range {}: access {} where segment '{}' allows {}", i, to_string(access),
                                                 r.segment, to_string(d.access)));
      }
      s->ranges.push_back({r.segment, d.buffer, d.generation, d.offset + r.offset, r.offset, r.length});
    }
    // Adjacent or overlapping ranges of one segment are one window: a request's blocks are
    // often runs of neighbours (and a whole layer is one range).
    std::sort(s->ranges.begin(), s->ranges.end(), [](const LeaseState::Range& x, const LeaseState::Range& y) {
      return x.segment != y.segment ? x.segment < y.segment : x.in_segment < y.in_segment;
    });
    std::vector<LeaseState::Range> merged;
    for (LeaseState::Range& r : s->ranges) {
      if (!merged.empty() && merged.back().segment == r.segment &&
          r.in_segment <= merged.back().in_segment + merged.back().length) {
        LeaseState::Range& m = merged.back();
        const std::uint64_t end = std::max(m.in_segment + m.length, r.in_segment + r.length);
        m.length = end - m.in_segment;
        continue;
      }
      merged.push_back(std::move(r));
    }
    s->ranges = std::move(merged);
    // Ids start at a random point per process (Impl's constructor): a holder never takes a
    // lease of the engine's next process for one of this one's.
    s->id = ++impl_->leases_made;
    if (s->id == 0) s->id = ++impl_->leases_made;
    // What a holder takes on one link (worker_leases.cpp): more would break its link.
    auto& [leases_now, ranges_now] = impl_->leased_to[peer];
    if (leases_now + 1 > detail::kLinkLeases || ranges_now + s->ranges.size() > detail::kLinkRanges) {
      throw Error("grant", EBUSY,
                  fmt::format("'{}' holds {} leases of {} ranges here; one more of {} would pass what a link takes "
                              "({} leases, {} ranges)",
                              peer, leases_now, ranges_now, s->ranges.size(), detail::kLinkLeases, detail::kLinkRanges),
                  "end or let expire some of its leases first");
    }
    ++leases_now;
    ranges_now += s->ranges.size();
    s->deadline.store(LeaseState::now_ns() + std::chrono::duration_cast<std::chrono::nanoseconds>(ttl).count());
    impl_->leases[s->id] = s;
  }
  impl_->count.leases_granted.fetch_add(1, std::memory_order_relaxed);
  for (auto& w : impl_->workers) {
    detail::Command c(detail::Command::Kind::lease_grant);
    c.lease = s;
    w->post(std::move(c));
  }
  return s->id;
}

bool Engine::end_lease(std::uint64_t lease) {
  std::shared_ptr<LeaseState> s;
  {
    std::lock_guard lock(impl_->mu);
    const auto it = impl_->leases.find(lease);
    if (it == impl_->leases.end()) return false;
    s = it->second;
  }
  return impl_->end_lease(s, LeaseCause::revoked, "this engine ended it (end_lease)");
}

std::optional<LeaseEnd> Engine::next_lease_end() {
  std::lock_guard lock(impl_->notes_mu);
  if (impl_->lease_ends.empty()) return std::nullopt;
  LeaseEnd e = std::move(impl_->lease_ends.front());
  impl_->lease_ends.pop_front();
  return e;
}

bool Engine::Impl::end_lease(const std::shared_ptr<LeaseState>& s, LeaseCause cause, std::string reason) noexcept {
  if (!s->take_end()) return false;
  s->cause = cause;
  s->reason = std::move(reason);
  {
    std::lock_guard lock(mu);
    leases.erase(s->id);
  }
  // Every worker drops its windows of it (it has some only where the peer's links are); the last
  // to have done so tells the application.
  s->workers_left.store(static_cast<std::uint32_t>(workers.size()), std::memory_order_release);
  for (auto& w : workers) {
    try {
      detail::Command c(detail::Command::Kind::lease_end);
      c.lease = s;
      w->post(std::move(c));
    } catch (...) {
      lease_dropped(s);  // out of memory posting: its windows stay until the link goes
    }
  }
  return true;
}

void Engine::Impl::lease_dropped(const std::shared_ptr<LeaseState>& s) noexcept {
  if (s->workers_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  count.leases_ended.fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard lock(mu);
    if (const auto it = leased_to.find(s->peer); it != leased_to.end()) {
      it->second.first -= std::min<std::uint64_t>(it->second.first, 1);
      it->second.second -= std::min<std::uint64_t>(it->second.second, s->ranges.size());
      if (it->second.first == 0) leased_to.erase(it);
    }
  }
  try {
    LeaseEnd e{s->id, s->peer, s->cause, s->reason};
    if (cfg.on_lease_end) {
      try {
        cfg.on_lease_end(e);
      } catch (const std::exception& ex) {
        cfg.link.log(fmt::format("engine {}: on_lease_end threw: {}", name, ex.what()));
      }
    }
    {
      std::lock_guard lock(notes_mu);
      lease_ends.push_back(std::move(e));
    }
  } catch (...) {
  }
  signal();
}

std::optional<HeldLease> Engine::lease(const std::string& peer, std::uint64_t lease, std::chrono::milliseconds wait) {
  const auto p = impl_->named(peer, "lease");
  const auto until = detail::deadline_in(wait);
  auto next_kick = detail::Clock::now();
  std::unique_lock lock(p->m);
  for (;;) {
    const auto it = p->held.find(lease);
    if (it != p->held.end() && ((it->second.complete() && it->second.everywhere) || it->second.info.ended)) {
      return it->second.info;
    }
    const auto now = detail::Clock::now();
    if (now >= until) return std::nullopt;
    if (!p->up && now >= next_kick) {
      // The lease comes on a link: with none (a link broke, none opened yet), one is opened, as
      // connect() would.
      next_kick = now + std::chrono::milliseconds{100};
      lock.unlock();
      detail::Command c(detail::Command::Kind::kick, p.get());
      c.keep = p;
      p->worker->post(std::move(c));
      lock.lock();
    }
    const auto slice = std::min(until, detail::deadline_in(std::chrono::milliseconds{20}));
    if (impl_->threads == 0) {
      lock.unlock();
      (void)impl_->workers[0]->run(slice, false);
      lock.lock();
    } else {
      p->cv.wait_until(lock, slice);
    }
  }
}

void Engine::renew(const std::string& peer, std::uint64_t lease, std::chrono::milliseconds ttl) {
  if (ttl < std::chrono::milliseconds{1} || ttl > std::chrono::hours{1}) {
    throw Error("renew", EINVAL, fmt::format("a ttl of {} ms (1 ms .. 1 hour)", ttl.count()));
  }
  const auto p = impl_->named(peer, "renew");
  detail::Command c(detail::Command::Kind::renew, p.get());
  c.keep = p;
  c.lease_id = lease;
  c.epoch = static_cast<std::uint64_t>(ttl.count());
  p->worker->post(std::move(c));
}

void Engine::release(const std::string& peer, std::uint64_t lease) {
  const auto p = impl_->named(peer, "release");
  detail::Command c(detail::Command::Kind::renew, p.get());
  c.keep = p;
  c.lease_id = lease;
  c.epoch = 0;
  p->worker->post(std::move(c));
}

}  // namespace rdmakit
