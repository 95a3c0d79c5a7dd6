// SPDX-License-Identifier: Apache-2.0
// An engine worker's transfers: checking and routing submitted ones, chains on a link's data
// path, the transfers a completion ends, batches and their notifications. Runs on the worker's
// thread (or in progress()); the worker's loop and commands are in worker.cpp, its links in
// worker_links.cpp.
#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "engine/impl.hpp"
#include "engine/protocol.hpp"

namespace rdmakit::detail {

namespace ew = engine_wire;

namespace {

TransferStatus status_of(PostStatus s) {
  switch (s) {
    case PostStatus::out_of_bounds:
    case PostStatus::not_advertised:
    case PostStatus::no_access: return TransferStatus::no_segment;
    case PostStatus::not_ready: return TransferStatus::peer_lost;
    case PostStatus::misaligned:
    case PostStatus::bad_length: return TransferStatus::invalid;
    default: return TransferStatus::failed;
  }
}

}  // namespace

// Out of line and cold: the common case, that a transfer can move, stays out of the loops.
std::string invalid_reason(const Transfer& t, const BufferRec* b, const Peer* p) {
  if (b == nullptr) {
    return fmt::format("buffer {} (generation {:#x}) is not this engine's: another engine's handle, or one unregistered",
                       t.local.id, t.local.generation);
  }
  if (b->retired.load()) return fmt::format("buffer {} was unregistered", t.local.id);
  if (t.local_offset > b->handle.length || t.length > b->handle.length - t.local_offset) {
    return fmt::format("[{}, +{}) is outside the local buffer of {} bytes", t.local_offset, t.length, b->handle.length);
  }
  if (p == nullptr) {
    return fmt::format("peer {} (generation {:#x}) is unknown: a RemoteSegment of another engine, or of a peer "
                       "removed (use Engine::segment of this engine)", t.remote.peer, t.remote.generation);
  }
  if (p->removed.load()) return fmt::format("peer '{}' was removed", p->name);
  if (t.remote.slot >= p->slots.load()) {
    return fmt::format("segment slot {} of peer '{}' was never made by Engine::segment (a forged RemoteSegment)",
                       t.remote.slot, p->name);
  }
  if ((t.op == TransferOp::fetch_add || t.op == TransferOp::compare_swap) && t.length != 8) {
    return fmt::format("an atomic moves 8 bytes, not {}", t.length);
  }
  return "a transfer of 0 bytes";
}

// Each transfer is checked, and goes straight into the chain open on its peer's link when that
// link is ready with room and nothing queued before it; otherwise it queues (Link::backlog, or
// Peer::waiting until a link is up). The chains are posted at the end, one doorbell each.
void Worker::submit(const std::shared_ptr<BatchState>& b, const std::vector<std::uint32_t>& indexes) {
  if (b->plan != nullptr) return submit_plan(b);
  if (b->remote_list != nullptr && b->remote_list->peer != 0 && indexes.empty()) return submit_lists(b);
  const bool all = indexes.empty();  // the whole batch is this worker's
  const std::uint32_t n = all ? b->size : static_cast<std::uint32_t>(indexes.size());
  WorkerShare& live = list(b, n);
  if (b->cancelled.load(std::memory_order_relaxed)) [[unlikely]] {  // before it came here
    for (std::uint32_t k = 0; k < n; ++k) end(b->x[all ? k : indexes[k]], TransferStatus::cancelled, kCancelled);
    return;
  }
  if (b->note_only) [[unlikely]] {
    start_note(b->x[0]);
    if (e_.cfg.telemetry) b->stamp_posted();
    return;
  }
  if (!b->notify.empty()) {
    // Each peer's notification goes once all the batch's transfers with it have ended ok.
    for (std::uint32_t k = 0; k < n; ++k) {
      const RemoteSegment& s = b->remote_at(all ? k : indexes[k]);
      ++live.notify_left[{s.peer, s.generation}];
    }
  }
  // `live` may go from here on: the last transfer to end erases it.
  Route r;
  r.lone = all && n == 1;
  if (b->local_index != nullptr) [[unlikely]] {
    // Descriptor lists over several peers: each of this worker's positions built here, or
    // ended when its pair does not match.
    for (std::uint32_t k = 0; k < n; ++k) {
      Xfer& x = b->x[all ? k : indexes[k]];
      if (take_position(x)) route(x, r);
    }
  } else if (all) {
    if (n == 1) {
      admit_here(b->x[0], r);  // a batch of one (the latency path): route() would admit it, by a call
    } else {
      route_all(b->x, b->x + n, r);
    }
  } else {
    for (const std::uint32_t i : indexes) route(b->x[i], r);
  }
  post_open_chains();
  if (e_.cfg.telemetry) b->stamp_posted();
}

// A batch mostly moves between one buffer and one peer's segment: what a transfer needs (its
// link, the segment's window, the buffer's registration) is looked up when those change, or
// after anything that may have changed it (admit()); the rest take the short way.
[[gnu::always_inline]] inline void Worker::route(Xfer& x, Route& r) {
  const Transfer& t = *x.t_;  // built (a position of descriptor lists: by take_position())
  const bool same = r.ok & (t.local.id == r.buf_id) & (t.remote.peer == r.peer_id) & (t.remote.slot == r.slot) &
                    (t.local.generation == r.buf_gen) & (t.remote.generation == r.peer_gen);
  if (!same || r.link->chain_room == 0) [[unlikely]] return admit(x, r);
  // A transfer too long for one request goes the long way too (it is posted alone).
  if (bad_range(t, r.buf_len) | (t.length > r.max_msg)) [[unlikely]] return admit(x, r);
  if (!chain(*r.link, x, r.laddr + t.local_offset, r.lkey, r.writable, *r.seg)) r.ok = false;
}

void Worker::route_all(Xfer* x, Xfer* last, Route& r) {
  for (; x != last; ++x) route(*x, r);
}

void Worker::admit(Xfer& x, Route& r) { admit_here(x, r); }

[[gnu::always_inline]] inline void Worker::admit_here(Xfer& x, Route& r) {
  r.ok = false;  // whatever happens here may change the link
  const Transfer& t = *x.t_;  // built, as for route()
  // A handle of another engine, or of a buffer or peer that went (its id reused or not), or a
  // slot no Engine::segment() made, finds nothing here: `invalid`, with why.
  const BufferRec* buf = e_.buffer(t.local);
  Peer* peer = e_.peer(t.remote);
  const std::uint64_t buf_len = buf != nullptr ? buf->handle.length : 0;
  if (peer == nullptr || peer->removed.load(std::memory_order_relaxed) || bad_range(t, buf_len) ||
      (buf->retired_by.load(std::memory_order_relaxed) >> index_ & 1) != 0 ||
      t.remote.slot >= peer->slots.load(std::memory_order_acquire)) [[unlikely]] {
    return end(x, TransferStatus::invalid, invalid_reason(t, buf, peer));
  }
  Link* l = pick(*peer, buf);
  if (l == nullptr || !l->backlog.empty() || too_long(*l, t) || slices_for(*peer, x)) return start_transfer(*peer, x);
  const std::optional<RemoteRegion>* seg = t.remote.slot < l->by_slot.size() ? &l->by_slot[t.remote.slot] : nullptr;
  const LocalSlice& s = buf->slices[l->device];
  // A batch of one WRITE or READ: posted on its own, not as a chain of one (post_lone), where
  // the segment allows it (the chain path's test: post_one's own looks at the first region the
  // peer advertised with its key, another segment's where segments share the buffer's key).
  if (r.lone && t.op <= TransferOp::write && seg != nullptr && seg->has_value() && s.length() != 0 &&
      allows((*seg)->access, t.op == TransferOp::read ? Access::remote_read : Access::remote_write) && lone_room(*l) &&
      post_lone(*l, x, s, **seg)) {
    return;
  }
  if (!room_on(*l)) return start_transfer(*peer, x);
  if (seg == nullptr || !seg->has_value()) [[unlikely]] return (void)chain(*l, x);  // a lease's, or none
  if (s.length() == 0) [[unlikely]] return unreachable(*l, x);
  if (!chain(*l, x, reinterpret_cast<std::uint64_t>(s.addr()) + t.local_offset, s.lkey(), s.writable(), **seg)) return;
  // What the next transfers of the same buffer and segment reuse; valid while nothing but
  // chain() runs (which keeps the link as it is, or says it did not).
  // A transfer long enough to be sliced takes the long way too.
  const std::uint64_t threshold = e_.cfg.rails.slice_threshold;
  const std::uint64_t max_msg = threshold != 0 ? std::min<std::uint64_t>(l->impl.dp.limits().max_msg_size, threshold - 1)
                                               : l->impl.dp.limits().max_msg_size;
  r = {true, t.local.id, t.remote.peer, t.remote.slot, t.local.generation, t.remote.generation, buf_len, max_msg, l, &**seg,
       reinterpret_cast<std::uint64_t>(s.addr()), s.lkey(), s.writable()};
}

[[gnu::always_inline]] inline bool Worker::lone_room(const Link& l) const noexcept {
  // What open_chain() would find (ready, room in the queue, no slot overwritten before it is
  // walked), on a link of one QP (post_one spreads a request over several) with no chain open
  // (its requests go first).
  const DataPath& dp = l.impl.dp;
  if (l.chain_open || dp.mode() != DataPath::Mode::ready || dp.lanes().size() != 1) return false;
  return dp.lane(0).sq.free() != 0 && unwalked_room(l) != 0;
}

[[gnu::always_inline]] inline bool Worker::post_lone(Link& l, Xfer& x, const LocalSlice& buffer, const RemoteRegion& seg) {
  // One request through the data path's one-request post (the extended verbs where the device
  // has them): no chain to open, stage and post. Its ring slot is a chain's of one (the
  // caller's request, its wr_id the entry), so its completion is walked as any chain's.
  const PostResult r = post_single(l, x, buffer, seg);
  if (r.ok()) [[likely]] return true;
  // Refused by post_one's checks (nothing was posted): the chain path decides, as for any
  // transfer (its checks are the segment's own).
  if (r.status != PostStatus::failed) return false;
  // The provider refused it (lone_room() found room): as a chain it refused.
  const std::string why = fmt::format("peer '{}': {}", l.peer->name, r.describe());
  end(x, TransferStatus::failed, why);
  break_link(l, why);
  return true;
}

[[gnu::always_inline]] inline PostResult Worker::post_single(Link& l, Xfer& x, const LocalSlice& buffer, const RemoteRegion& to) {
  DataPath& dp = l.impl.dp;
  const Transfer& t = x.transfer();
  const LocalSlice src = buffer.subslice(t.local_offset, t.length);
  const auto id = reinterpret_cast<std::uint64_t>(&x);
  const PostResult r = t.op == TransferOp::read ? dp.post_one<Opcode::read>(src, to, t.remote_offset, 0, 0, 0, id)
                       : t.op == TransferOp::write
                           ? dp.post_one<Opcode::write>(src, to, t.remote_offset, 0, 0, 0, id)
                           : PostResult{PostStatus::bad_length, 0, 0};
  if (r.ok()) [[likely]] {
    ++l.in_flight;
    ++in_flight_;
    l.bytes_out += t.length;
  }
  return r;
}

void Worker::start_transfer(Peer& p, Xfer& x) {
  if (cancels(x)) [[unlikely]] return end(x, TransferStatus::cancelled, kCancelled);
  if (x.batch->note_only) [[unlikely]] return start_note(x);
  if (slices_for(p, x)) return slice(p, x);
  if (Link* l = pick(p, &buffer_of(x))) return queue_on(*l, x);
  wait_for_link(p, x);
}

void Worker::wait_for_link(Peer& p, Xfer& x) {
  if (p.removed.load(std::memory_order_relaxed)) {
    return end(x, TransferStatus::peer_lost, fmt::format("peer '{}' was removed", p.name));
  }
  if (p.gone.load(std::memory_order_relaxed)) return end(x, TransferStatus::connect_failed, e_.gone_reason(p));
  p.waiting.push_back(&x);
  if (p.link == nullptr && !p.connecting) {
    p.connecting = true;
    e_.request_connect(&p);
  }
}

void Worker::queue_flush(Link& l) {
  if (l.flush_queued) return;
  l.flush_queued = true;
  to_flush_.push_back(&l);
}

void Worker::flush_queued_links_now() {
  // flush() closes no link, but it may break one (a post refused, a data path found broken),
  // and that link's transfers are re-posted on another rail (lost()), which joins this list while
  // it runs: by index, to its end, so none is dropped with its flush_queued still set.
  for (std::size_t i = 0; i < to_flush_.size(); ++i) {
    Link* l = to_flush_[i];
    l->flush_queued = false;
    flush(*l);
  }
  to_flush_.clear();
  post_open_chains();
}

[[gnu::always_inline]] inline bool Worker::room_on(Link& l) {
  if (l.chain_room != 0) [[likely]] return true;
  if (l.chain_open) post_chain(l);
  return open_chain(l);
}

bool Worker::open_chain(Link& l) {
  DataPath& dp = l.impl.dp;
  Lane& lane = dp.lane(0);
  std::uint64_t room = dp.begin_chain(lane, kSignalEvery);
  if (dp.mode() != DataPath::Mode::ready) [[unlikely]] {
    break_link(l, dp.failure());
    return false;
  }
  room = std::min<std::uint64_t>(room, unwalked_room(l));
  if (room == 0) return false;  // a completion makes room, and flushes the backlog
  l.chain_open = true;
  l.chain_room = static_cast<std::uint32_t>(room);
  open_chains_.push_back(&l);
  return true;
}

void Worker::post_chain(Link& l) {
  l.chain_open = false;
  l.chain_room = 0;
  DataPath& dp = l.impl.dp;
  const std::uint32_t n = dp.chain_size();
  if (n == 0) return;
  const PostResult r = dp.post_chain_built();
  const std::size_t went = r.ok() ? n : r.index;
  l.in_flight += went;
  in_flight_ += went;
  if (r.ok()) [[likely]] return;
  // The provider refused part way: what it took is in flight, the rest failed (their slots are
  // still staged past the ring's newest), and the link breaks (what is in flight then
  // completes flushed).
  const std::string why = fmt::format("peer '{}': {}", l.peer->name, r.describe());
  WrRing& ring = dp.lane(0).sq;
  for (std::size_t k = 0; k < n - went; ++k) {
    end(*reinterpret_cast<Xfer*>(ring.staged(static_cast<std::uint32_t>(k)).wr_id), TransferStatus::failed, why);
  }
  break_link(l, why);
}

void Worker::post_open_chains_now() {
  // post_chain() may break a link, which neither closes it nor opens chains.
  for (std::size_t i = 0; i < open_chains_.size(); ++i) {
    if (open_chains_[i]->chain_open) post_chain(*open_chains_[i]);
  }
  open_chains_.clear();
}

void Worker::abandon_chain(Link& l, const std::string& why) noexcept {
  if (!l.chain_open) return;
  l.chain_open = false;
  l.chain_room = 0;
  DataPath& dp = l.impl.dp;
  const std::uint32_t n = dp.chain_size();
  (void)dp.begin_chain(dp.lane(0), kSignalEvery);  // forgets it
  WrRing& ring = dp.lane(0).sq;
  for (std::uint32_t k = 0; k < n; ++k) {
    lost(l, *reinterpret_cast<Xfer*>(ring.staged(k).wr_id), TransferStatus::peer_lost, why);
  }
}

[[gnu::always_inline]] inline bool Worker::chain(Link& l, Xfer& x, std::uint64_t laddr, std::uint32_t lkey,
                                                  bool writable, const RemoteRegion& seg) {
  const Transfer& t = *x.t_;  // built: every caller looked at it first
  DataPath& dp = l.impl.dp;
  const auto len = static_cast<std::uint32_t>(t.length);  // at most max_msg_sz (too_long)
  const auto id = reinterpret_cast<std::uint64_t>(&x);
  const PostStatus st = with_opcode(t.op, [&](auto op) __attribute__((always_inline)) {
    constexpr Opcode Op = decltype(op)::value;
    return dp.chain_add<Op>(laddr, len, lkey, writable, seg, t.remote_offset, compare_add_of<Op>(t), swap_of<Op>(t), id);
  });
  if (st != PostStatus::ok) [[unlikely]] {
    refused(l, x, st);
    return false;
  }
  --l.chain_room;
  l.bytes_out += len;
  return true;
}

bool Worker::chain(Link& l, Xfer& x) {
  const Transfer& t = x.transfer();
  const RemoteRegion* to = remote_of(l, x);
  if (to == nullptr) [[unlikely]] return false;
  const LocalSlice& s = buffer_of(x).slices[l.device];
  if (s.length() == 0) [[unlikely]] {
    unreachable(l, x);
    return false;
  }
  return chain(l, x, reinterpret_cast<std::uint64_t>(s.addr()) + t.local_offset, s.lkey(), s.writable(), *to);
}

const RemoteRegion* Worker::remote_of(Link& l, Xfer& x) {
  const std::uint32_t slot = x.transfer().remote.slot;
  if (slot < l.by_slot.size() && l.by_slot[slot].has_value()) [[likely]] return &*l.by_slot[slot];
  return lease_region(l, x);  // no standing window: a lease's range, or x ended with why
}

void Worker::unreachable(Link& l, Xfer& x) {
  end(x, TransferStatus::invalid,
      fmt::format("peer '{}': buffer {} is memory the CPU cannot reach (GPU memory), and its link is {}, which moves "
                  "bytes with the CPU",
                  l.peer->name, x.transfer().local.id, l.impl.info.transport));
}

void Worker::refused(Link& l, Xfer& x, PostStatus st) {
  if (st == PostStatus::not_advertised) {
    std::string name;
    {
      std::lock_guard lock(e_.mu);
      const auto& names = l.peer->slot_names;
      const std::uint32_t slot = x.transfer().remote.slot;
      name = slot < names.size() ? names[slot] : fmt::format("slot {}", slot);
    }
    std::string have;
    for (const auto& [nm, r] : l.remote) have += (have.empty() ? "" : ", ") + nm;
    return end(x, TransferStatus::no_segment,
               fmt::format("peer '{}' has no segment '{}' (it has: {})", l.peer->name, name, have.empty() ? "none" : have));
  }
  std::string why = fmt::format("peer '{}': {}", l.peer->name, PostResult{st, 0, 0}.describe());
  if (st == PostStatus::unsupported) why += " (the peer's device or this one has no atomics)";
  end(x, status_of(st), std::move(why));
}

void Worker::post_alone(Link& l, Xfer& x) {
  const Transfer& t = x.transfer();
  const RemoteRegion* to = remote_of(l, x);
  if (to == nullptr) return;  // ended, with why
  if (buffer_of(x).slices[l.device].length() == 0) return unreachable(l, x);
  const PostResult r = post_single(l, x, buffer_of(x).slices[l.device], *to);
  if (r.ok()) return l.alone.push_back(&x);
  if (r.status == PostStatus::queue_full) {
    l.backlog_bytes += t.length;
    return l.backlog.push_front(&x);
  }
  std::string why = fmt::format("peer '{}': {}", l.peer->name, r.describe());
  end(x, r.status == PostStatus::failed ? TransferStatus::failed : status_of(r.status), why);
  if (r.status == PostStatus::failed) break_link(l, why);
}

// The link's backlog into chains, as far as its send queue has room.
void Worker::flush(Link& l) {
  while (!l.backlog.empty() && l.state == Link::State::ready) {
    Xfer& x = *l.backlog.front();
    if (x.t_ == nullptr) [[unlikely]] {  // positions of descriptor lists (submit_lists)
      const ListsFlush f = flush_lists(l, x);
      if (f == ListsFlush::posted) continue;
      if (f == ListsFlush::full) return;  // a completion makes room, and flushes again
      const std::uint64_t len = x.batch->length_at(x.index);
      l.backlog.pop_front();  // (put back below when it goes on)
      if (!take_position(x)) {
        l.backlog_bytes -= len;
        continue;
      }
      if (l.initiated && l.peer != nullptr && slices_for(*l.peer, x)) {  // as admit() would have
        l.backlog_bytes -= len;
        slice(*l.peer, x);
        continue;
      }
      l.backlog.push_front(&x);
    }
    if (too_long(l, x.transfer())) [[unlikely]] {  // split by the data path: posted alone
      if (l.chain_open) post_chain(l);
      if (l.state != Link::State::ready) return;
      l.backlog.pop_front();
      l.backlog_bytes -= x.transfer().length;
      post_alone(l, x);
      if (!l.backlog.empty() && l.backlog.front() == &x) return;  // no room: back in front
      continue;
    }
    if (!room_on(l)) return;  // a completion makes room, and flushes again
    l.backlog.pop_front();
    l.backlog_bytes -= x.transfer().length;
    (void)chain(l, x);
  }
}

void Worker::walk(Link& l, std::uint64_t upto, TransferStatus s, const std::string& why) noexcept {
  const auto slots = l.impl.dp.lane(0).sq.view();
  const std::uint8_t path = path_of(l.device);  // what ends ok here ended on this link's device
  // Runs of transfers of one batch that ended ok (a chain of one batch's transfers, the common
  // case) are counted once; anything else ends one by one.
  BatchState* run = nullptr;
  bool plain = false;  // the run's transfers end by the count
  bool lists = false;  // the run's transfers are positions of descriptor lists (maybe not built)
  std::uint32_t run_ok = 0, slices = 0;
  std::uint64_t skipped = 0;  // slots that are not transfers
  // bytes: of the plain run's transfers (reads and writes only: a plain run has no atomics);
  // out: of every transfer walked; moved: read and written on this rail.
  std::uint64_t bytes = 0, out = 0, moved = 0;
  // Inlined at both uses: a closure called out of line costs a walk of one transfer (the
  // latency path) a tenth of its instructions.
  auto settle = [&]() __attribute__((always_inline)) {
    // The bytes first: a waiter that sees its batch done reads counters that include it.
    if (bytes != 0) e_.count.bytes.fetch_add(bytes, std::memory_order_relaxed);
    moved += bytes;
    out += bytes;
    bytes = 0;
    if (run_ok == 0) return;
    WorkerShare& live = run->share(index_);
    if (live.keep) {
      ended_ += run_ok;
      std::shared_ptr<BatchState> keep;  // the batch outlives finished_ok() below
      if ((live.left -= run_ok) == 0) keep = unlist(*run);
      run->finished_ok(run_ok, keep);
    }
    run_ok = 0;
  };
  for (std::uint64_t seq = l.ended; seq < upto; ++seq) {
    const WrRing::Slot& slot = slots[seq];
    // Not a transfer of a chain: a part of a split transfer (Link::alone), a drain marker, a
    // window bind.
    if (slot.kind >= WrRing::part || (slot.wr_id & 1) != 0) [[unlikely]] {
      ++skipped;
      continue;
    }
    Xfer& x = *reinterpret_cast<Xfer*>(slot.wr_id);
    if (x.batch != run) [[unlikely]] {
      settle();
      run = x.batch;
      lists = run->local_index != nullptr;
      // A batch with slices ends them one by one too: they end into their transfer's group.
      plain = s == TransferStatus::ok && run->notify.empty() && !run->atomics &&
              !run->sliced.load(std::memory_order_relaxed);
    }
    if (!plain) [[unlikely]] {
      out += x.transfer().length;
      if (s == TransferStatus::ok && x.transfer().op <= TransferOp::write) {
        moved += x.transfer().length;
        slices += x.group != nullptr;
      }
      if (s == TransferStatus::ok) x.set_path(path);
      end(x, s, why);
      continue;
    }
    if ((slot.run > 1) | lists) {
      // A plan's chain (Worker::post_run) or a lists' (post_lists_on): its next slots to the
      // chain's end are the batch's next entries (a lists' position posted on its own: just this one).
      const std::uint32_t left = slot.run_end ? slot.run - static_cast<std::uint32_t>(seq) : slot.run;
      const std::uint64_t m = std::min<std::uint64_t>(std::max(left, 1u), upto - seq);
      std::uint64_t sum = 0;
      if (run->local_index == nullptr) [[likely]] {
        for (Xfer *e = &x, *end = &x + m; e != end; ++e) {
          e->set_path(path);  // before its status (the batch's end publishes both)
          e->set_status(TransferStatus::ok, std::memory_order_relaxed);  // published by finished_ok
          sum += e->t_->length;
        }
      } else if (const std::uint64_t each = run->local_list->uniform; each != 0) {
        // Descriptor lists' chain (Worker::post_lists): its transfers were never built; the
        // lengths are the local descriptors' (here all alike).
        for (Xfer *e = &x, *end = &x + m; e != end; ++e) {
          e->set_path(path);
          e->set_status(TransferStatus::ok, std::memory_order_relaxed);
        }
        sum = m * each;
      } else {
        const LocalDescriptor* const ld = run->local_list->local.data();
        const std::uint32_t* const li = run->local_index;
        for (Xfer *e = &x, *end = &x + m; e != end; ++e) {
          e->set_path(path);
          e->set_status(TransferStatus::ok, std::memory_order_relaxed);
          sum += ld[li[e->index]].length;
        }
      }
      bytes += sum;
      run_ok += static_cast<std::uint32_t>(m);
      seq += m - 1;
      continue;
    }
    x.set_path(path);
    x.set_status(TransferStatus::ok, std::memory_order_relaxed);  // published by finished_ok
    ++run_ok;
    bytes += x.t_->length;
  }
  settle();
  const std::uint64_t walked = upto > l.ended ? upto - l.ended - skipped : 0;
  l.in_flight -= walked;
  in_flight_ -= walked;
  l.bytes_out -= std::min(l.bytes_out, out);
  if (s == TransferStatus::ok && path < figures_count_) figures_[path].add(moved, walked);
  l.moved += moved;
  if (l.rail != nullptr && moved != 0) {
    l.rail->bytes.fetch_add(moved, std::memory_order_relaxed);
    if (slices != 0) l.rail->slices.fetch_add(slices, std::memory_order_relaxed);
  }
  l.ended = std::max(l.ended, upto);
}

Link* Worker::notify_link(Peer& p) noexcept {
  if (ready(p.link) && p.link->notify_credits > 0) return p.link;
  for (const auto& r : p.rails) {
    if (ready(r->link) && r->link->notify_credits > 0) return r->link;
  }
  return ready(p.link) ? p.link : pick(p, nullptr);  // one without credits: the batch says so
}

bool Worker::send_note(Peer& p, Link* to, BatchState& b, std::string* why) noexcept {
  std::string failure;
  if (to == nullptr) {
    failure = fmt::format("peer '{}': no link to it was up to carry it", p.name);
  } else if (to->notify_credits == 0) {
    failure = fmt::format("peer '{}': not sent: its queue of {} notifications from this engine is full (it has not "
                          "taken them with next_notification())",
                          p.name, to->notify_queue);
  } else {
    --to->notify_credits;
    send(*to, ew::notify(b.notify, b.request_id));
    if (to->impl.out_taken < to->impl.out_queued) {
      try {
        to->notes_waiting.push_back(to->impl.out_queued);  // counted lost if its link goes first
      } catch (...) {
      }
    }
    if (to->state != Link::State::closing) {
      e_.count.notifications_sent.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    failure = fmt::format("peer '{}': its link broke sending it", p.name);
  }
  if (why != nullptr) *why = failure;
  b.notification_failed(std::move(failure));
  return false;
}

void Worker::start_note(Xfer& x) {
  Peer* p = e_.peer(x.transfer().remote);
  if (p == nullptr) return end(x, TransferStatus::peer_lost, "the peer was removed");
  if (Link* to = notify_link(*p); to != nullptr && !p->removed.load(std::memory_order_relaxed)) {
    std::string why;
    if (send_note(*p, to, *x.batch, &why)) return end(x, TransferStatus::ok, {});
    return end(x, TransferStatus::failed, std::move(why));
  }
  wait_for_link(*p, x);
}

void Worker::cancel(BatchState& b) noexcept {
  // Collected first: ending one runs its batch's callback, which may submit more here.
  std::vector<Xfer*> gone;
  const auto take = [&](Fifo<Xfer*>& q, std::uint64_t* bytes) {
    for (std::size_t n = q.size(); n > 0; --n) {
      Xfer* x = q.front();
      const bool mine = x->batch == &b && cancels(*x);
      if (mine) gone.push_back(x);  // may throw: x is still queued then
      q.pop_front();
      if (!mine) {
        q.push_back(x);  // one was taken off first: no allocation
      } else if (bytes != nullptr) {
        *bytes -= x->transfer().length;
      }
    }
  };
  try {
    for (auto& l : links_) take(l->backlog, &l->backlog_bytes);
    const std::uint32_t ids = e_.peer_ids_used.load(std::memory_order_acquire);
    for (std::uint32_t id = 1; id <= ids; ++id) {
      Peer* p = e_.peer(id);
      if (p != nullptr && p->worker == this) take(p->waiting, nullptr);
    }
  } catch (...) {
    // Out of memory for the list: what was not taken yet runs on.
  }
  for (Xfer* x : gone) end(*x, TransferStatus::cancelled, kCancelled);
}

void Worker::end(Xfer& x, TransferStatus s, std::string reason) noexcept {
  if (x.group != nullptr) [[unlikely]] return slice_ended(x, s, std::move(reason));
  // Ended once (as finish() would say): a second end must not count down the worker's share, whose
  // end lets go of the batch while other transfers of it may still be in flight.
  if (x.status(std::memory_order_relaxed) != TransferStatus::pending) [[unlikely]] return;
  BatchState& b = *x.batch;
  WorkerShare& live = b.share(index_);
  if (!live.keep) return;
  // A notification on its own that is not sent (no link, the peer gone): the batch says so as
  // when it is refused (send_note counted that one already).
  if (b.note_only && s != TransferStatus::ok && b.notify_failed.load(std::memory_order_relaxed) == 0) [[unlikely]] {
    b.notification_failed(fmt::format("{}: {}", to_string(s), reason));
  }
  const Transfer& t = x.transfer();
  if (s == TransferStatus::ok && (t.op == TransferOp::read || t.op == TransferOp::write)) {
    e_.count.bytes.fetch_add(t.length, std::memory_order_relaxed);
  }
  if (!b.notify.empty() && !b.note_only) {
    auto w = live.notify_left.find({t.remote.peer, t.remote.generation});
    if (w != live.notify_left.end()) {
      if (s != TransferStatus::ok) {
        live.notify_left.erase(w);  // a transfer failed: no notification for that peer
      } else if (--w->second == 0) {
        live.notify_left.erase(w);
        // Every transfer of the batch with this peer has completed: what was written is in its
        // memory, what was read has been taken. Sent within the credits the peer gave the
        // link; otherwise the batch says why, before it ends.
        if (Peer* p = e_.peer(t.remote); p == nullptr) {
          b.notification_failed(fmt::format("peer {}: removed before its transfers completed", t.remote.peer));
        } else {
          (void)send_note(*p, notify_link(*p), b, nullptr);
        }
      }
    }
  }
  ++ended_;
  const bool last = --live.left == 0;
  auto keep = last ? unlist(b) : nullptr;  // the batch outlives finish() below
  b.finish(x, s, std::move(reason), keep);
}

// Nothing may leave a completion handler (it runs inside the CQ poll): what throws here (out of
// memory formatting a reason) is logged, and the transfer ends failed with it.
void Worker::on_news(Link& l, const Completion& c, std::uint64_t seq, bool part) noexcept {
  DataPath& dp = l.impl.dp;
  if (!c.ok() && dp.mode() != DataPath::Mode::ready && l.state != Link::State::closing) [[unlikely]] {
    // The data path broke on it: the link goes after this poll, not at its next post or control
    // message. An idle link would otherwise look ready for as long as nothing is posted on it
    // (its peer's messages to it flushed, connect() and lease() answered from it).
    if (std::find(to_break_.begin(), to_break_.end(), &l) == to_break_.end()) {
      try {
        to_break_.push_back(&l);
      } catch (...) {
        // Out of memory: the next post or control message breaks it.
      }
    }
  }
  // Those before it completed; it is news of its own.
  walk(l, seq, TransferStatus::ok, {});
  l.ended = std::max(l.ended, seq + 1);
  if ((c.wr_id & 1) != 0) return bound(l, *reinterpret_cast<Window*>(c.wr_id & ~std::uint64_t{1}), c);
  auto* x = reinterpret_cast<Xfer*>(c.wr_id);
  if (part) std::erase(l.alone, x);
  --l.in_flight;
  --in_flight_;
  l.bytes_out -= std::min(l.bytes_out, x->transfer().length);
  l.last_used = Clock::now();
  bool ended = false;
  try {
    if (c.ok()) {
      if (l.rail != nullptr && x->transfer().op <= TransferOp::write) {
        l.rail->bytes.fetch_add(x->transfer().length, std::memory_order_relaxed);
        if (x->group != nullptr) l.rail->slices.fetch_add(1, std::memory_order_relaxed);
      }
      x->set_path(path_of(l.device));
      const std::uint64_t bytes = x->transfer().op <= TransferOp::write ? x->transfer().length : 0;
      if (l.device < figures_count_) figures_[l.device].add(bytes, 1);
      l.moved += bytes;
      end(*x, TransferStatus::ok, {});
    } else if (c.status == IBV_WC_WR_FLUSH_ERR) {
      lost(l, *x, TransferStatus::peer_lost,
           fmt::format("peer '{}': {}", l.peer->name, dp.failure().empty() ? "the link broke" : dp.failure()));
    } else if (const HeldRecord* h = c.status == IBV_WC_REM_ACCESS_ERR ? leased_refusal(l, *x) : nullptr) {
      // The peer's NIC refused a lease's range: the lease it went through ended there before the
      // request came (the link breaks on it, as on any access error). Nothing of it moved. Which
      // lease that was (another may cover the same range) the peer's LEASE_END says, or the next
      // link's SYNCED: none is ended here on a guess.
      end(*x, TransferStatus::lease_expired,
          fmt::format("peer '{}' refused it ({}): the lease it went through (lease {}, or another that covers the "
                      "range) had ended there",
                      l.peer->name, c.status_name(), h->info.lease));
    } else {
      // The link breaks on it (the data path's one break routine); ended when the link is reaped.
      // What the peer refused, or this side got wrong, would fail on any rail; the rest (retries
      // exceeded, a QP or port that failed under it) is the rail's, and another may do it.
      const bool rails_fault = c.status != IBV_WC_REM_ACCESS_ERR && c.status != IBV_WC_REM_INV_REQ_ERR &&
                               c.status != IBV_WC_LOC_PROT_ERR && c.status != IBV_WC_LOC_LEN_ERR &&
                               c.status != IBV_WC_LOC_ACCESS_ERR;
      // A tcp or shm link's queue pair says what failed in its own words (a NIC's likely
      // causes, UDP ports and MTUs, are not its).
      const bool soft = l.impl.soft_qp != nullptr && !l.impl.soft_qp->failure().empty();
      l.deferred.push_back({x,
                            soft ? fmt::format("peer '{}': {} ({}, {} link)", l.peer->name, l.impl.soft_qp->failure(),
                                               c.status_name(), l.impl.info.transport)
                                 : fmt::format("peer '{}': {}", l.peer->name, c.describe()),
                            rails_fault});
    }
    ended = true;
    if (!l.backlog.empty()) queue_flush(l);
  } catch (const std::exception& ex) {
    log(fmt::format("engine {}: handling a completion from {}: {}", e_.name, l.impl.info.peer_address, ex.what()));
    if (!ended) end(*x, TransferStatus::failed, ex.what());
  }
}

void Worker::bound(Link& l, Window& w, const Completion& c) noexcept {
  --l.binds_pending;
  if (binds_out_ != 0) --binds_out_;
  const bool withdrawn = w.segment.empty();  // while its bind was in flight: it goes, unannounced
  if (c.ok() && l.state != Link::State::closing && !withdrawn) {
    w.bound = true;
    e_.count.windows_bound.fetch_add(1, std::memory_order_relaxed);
    e_.count.window_bind_ns.fetch_add(
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - w.posted).count()),
        std::memory_order_relaxed);
    if (w.lease != 0) {
      lease_bound(l, w);
    } else {
      announce(l, w);
    }
  } else if (!c.ok() && l.state != Link::State::closing) {
    try {
      log(fmt::format("engine {}: binding the window of segment '{}' for {} failed: {}", e_.name,
                      withdrawn ? "(withdrawn)" : w.segment, l.impl.info.peer_address, c.describe()));
    } catch (...) {
    }
  }
  if (!c.ok() && !withdrawn && w.lease != 0) {
    // Flushed: the link is going (its loss is the lease's, as for any link that held it); any
    // other failure ends the lease.
    if (c.status == IBV_WC_WR_FLUSH_ERR || l.state == Link::State::closing) {
      lease_link_gone(l, w.lease, c.describe());
    } else {
      lease_unbound(l, w.lease, c.describe());
    }
  }
  if (withdrawn || !c.ok()) std::erase_if(l.windows, [&w](const auto& o) { return o.get() == &w; });
  bind_waiting(l);  // its completion made room for the next
}

}  // namespace rdmakit::detail
