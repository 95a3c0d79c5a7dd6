// SPDX-License-Identifier: Apache-2.0
// The workers' side of descriptor lists (Engine::submit(op, lists, indices), lists.cpp): a batch
// on one peer posted the lists' way (each request written from its local SGE and its remote
// target as checked for the link, a chain per batch, as a plan's), what the queue has no room for
// queued in the link's backlog and posted the same way as completions make room, and what the
// lists' way cannot post taken the long way (route()), its transfer built then. Runs on the
// peer's worker (or whoever holds its run lock).
#include <algorithm>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "engine/impl.hpp"

namespace rdmakit::detail {

bool Worker::take_position(Xfer& x) {
  if (x.t_ != nullptr) return true;
  if (std::string why = x.batch->pair_mismatch(x.index); !why.empty()) {
    end(x, TransferStatus::invalid, std::move(why));
    return false;
  }
  (void)x.transfer();
  return true;
}

void Worker::submit_lists(const std::shared_ptr<BatchState>& b) {
  const std::uint32_t n = b->size;
  WorkerShare& live = list(b, n);
  if (b->cancelled.load(std::memory_order_relaxed)) [[unlikely]] {  // before it came here
    for (std::uint32_t k = 0; k < n; ++k) end(b->x[k], TransferStatus::cancelled, kCancelled);
    return;
  }
  if (!b->notify.empty()) live.notify_left[{b->remote_list->peer, b->remote_list->peer_gen}] += n;
  // `live` may go from here on: the last transfer to end erases it.
  Route r;
  Xfer* const x = b->x;
  Link* full = nullptr;
  bool usable = false;
  std::uint32_t k = post_lists(*b, 0, &full, &usable);
  // What the link's queue has no room for (or what comes behind a backlog there) waits in its
  // backlog, in order, and is posted the lists' way as completions make room (flush_lists). A
  // position the lists' way cannot post (a check failed) takes the long way, which says why or
  // queues it, and the lists' way goes on after it; when the lists' way cannot be taken at all
  // (the peer, a buffer or the link changed), all the rest take the long way.
  while (k < n) {
    if (full != nullptr) {
      // Checked before they queue: a position leaves a backlog by any way (posted the lists' way
      // or the long way, moved to another rail when the link breaks) with its pair matched.
      const LocalDescriptor* const ld = b->local_list->local.data();
      const RemoteDescriptor* const rd = b->remote_list->remotes.data();
      for (; k < n; ++k) {
        const std::uint64_t len = ld[b->local_index[k]].length;
        if (len != rd[b->remote_index[k]].length) [[unlikely]] {
          end(x[k], TransferStatus::invalid, b->pair_mismatch(k));
          continue;
        }
        full->backlog.push_back(x + k);
        full->backlog_bytes += len;
      }
      queue_flush(*full);
      break;
    }
    if (!usable) {
      for (; k < n; ++k) {
        if (take_position(x[k])) route_all(x + k, x + k + 1, r);  // (route() is inline to worker_transfers.cpp)
      }
      break;
    }
    if (take_position(x[k])) route_all(x + k, x + k + 1, r);
    if (++k == n) break;
    k = post_lists(*b, k, &full, &usable);
  }
  post_open_chains();
  if (e_.cfg.telemetry) b->stamp_posted();
}

std::uint32_t Worker::post_lists(BatchState& b, std::uint32_t from, Link** full, bool* usable) {
  *full = nullptr;
  *usable = false;
  Peer* p = e_.peer(b.remote_list->peer);
  if (p == nullptr || p->generation != b.remote_list->peer_gen || p->removed.load(std::memory_order_relaxed) ||
      p->worker != this) [[unlikely]] {
    return from;
  }
  const BufferRec* buf = lists_registered(*b.local_list);
  if (buf == nullptr) [[unlikely]] return from;
  Link* l = pick(*p, buf);
  if (l == nullptr) return from;
  if (!l->backlog.empty()) {  // behind what waits there, in order
    *usable = true;
    *full = l;
    return from;
  }
  if (l->chain_open) {  // transfers before these, chained the long way: they go first
    post_chain(*l);
    if (!ready(l)) return from;
  }
  if (l->impl.dp.mode() != DataPath::Mode::ready) [[unlikely]] {  // as open_chain() finds it
    break_link(*l, l->impl.dp.failure());
    return from;
  }
  *usable = true;
  for (std::uint32_t k = from;;) {
    Link* f = nullptr;
    const std::uint32_t next = post_lists_on(*l, b, k, b.size - k, &f, true);
    if (!ready(l)) return next;  // the provider refused part way: the link broke
    if (next == b.size || f == nullptr) return next;  // all posted, or one for the long way
    if (next == k) {  // no room: the rest waits for completions
      *full = l;
      return next;
    }
    k = next;  // a chain's most, or the ring's end: the next chain
  }
}

Worker::ListsFlush Worker::flush_lists(Link& l, Xfer& front) {
  BatchState& b = *front.batch;
  if (b.remote_list == nullptr || b.remote_list->peer == 0) [[unlikely]] return ListsFlush::not_posted;
  if (l.chain_open) {  // what the long way chained before them goes first
    post_chain(l);
    if (!ready(&l)) return ListsFlush::full;
  }
  // The run of the batch's consecutive positions at the front (at most one chain's), out of the
  // backlog while it is posted: a provider that refuses part way breaks the link, which empties
  // the backlog.
  // What may throw (allocations) before anything leaves the backlog.
  if (!lists_) lists_ = make_list_scratch();
  (void)targets_for(*b.remote_list, l, b.list_op);
  const std::size_t most = std::min<std::size_t>(l.backlog.size(), kListChain);
  std::uint32_t n = 1;
  while (n < most && front.index + n < b.size && l.backlog[n] == &front + n) ++n;
  Xfer* const first = &front;
  std::uint64_t bytes = 0;
  for (std::uint32_t i = 0; i < n; ++i) bytes += b.length_at(first->index + i);
  l.backlog.pop_front(n);
  l.backlog_bytes -= std::min(l.backlog_bytes, bytes);
  Link* full = nullptr;
  const std::uint32_t did = post_lists_on(l, b, first->index, n, &full, false) - first->index;
  if (!ready(&l)) {  // it broke: what was not posted goes another way, as its backlog did
    const std::string why = fmt::format("peer '{}': {}", l.peer->name, l.impl.dp.failure());
    for (std::uint32_t i = did; i < n; ++i) lost(l, first[i], TransferStatus::peer_lost, why);
    return ListsFlush::full;
  }
  for (std::uint32_t i = n; i-- > did;) {  // back in front, in order
    l.backlog.push_front(first + i);
    l.backlog_bytes += b.length_at(first->index + i);
  }
  if (did == 0) return full != nullptr ? ListsFlush::full : ListsFlush::not_posted;
  return ListsFlush::posted;
}

const BufferRec* Worker::lists_registered(ListState& local) noexcept {
  std::uint64_t& checked = local.checked[index_].retired;
  if (checked != retired_seen_ + 1) [[unlikely]] {
    // A buffer was retired since (on this worker): each of the list's is looked at again.
    for (const auto& [id, generation] : local.buffers) {
      const BufferRec* b = e_.buffer(id);
      if (b == nullptr || b->handle.generation != generation || (b->retired_by.load(std::memory_order_relaxed) >> index_ & 1) != 0) {
        return nullptr;
      }
    }
    checked = retired_seen_ + 1;
  }
  return e_.buffer(local.buffers.front().first);
}

const ListState::Targets* Worker::targets_for(ListState& remote, Link& l, TransferOp op) {
  // One per rail and operation.
  const auto [cached, found] = per_link(remote.targets, l.serial, 2 * l.peer->rails.size(),
                                        [op](const ListState::Targets& t) { return t.op == op; });
  const auto region = [&l](std::uint32_t slot) -> std::optional<RemoteRegion> {
    return slot < l.by_slot.size() ? l.by_slot[slot] : std::nullopt;
  };
  // Descriptors long enough to be sliced take the long way only while the peer has two rails up
  // (slices_for): with one, they go the lists' way whole.
  const bool sliced = slicing(*l.peer);
  if (found) {
    bool same = cached->slicing == sliced;
    for (std::size_t s = 0; s < remote.slots.size() && same; ++s) same = cached->regions[s] == region(remote.slots[s]);
    if (same) [[likely]] return cached;
  }
  // Checked again: for a new link, or a segment announced anew. What cannot go as one request of
  // this link the lists' way (no segment there: a lease's range, or none; outside it; no access;
  // longer than one request, or long enough to be sliced over rails) is marked to take the long
  // way, which says why.
  e_.count.lists_builds.fetch_add(1, std::memory_order_relaxed);
  ListState::Targets& t = *cached;
  t.link = l.serial;
  t.op = op;
  t.slicing = sliced;
  t.regions.clear();
  for (const std::uint32_t s : remote.slots) t.regions.push_back(region(s));
  const Access need = op == TransferOp::read ? Access::remote_read : Access::remote_write;
  const std::uint64_t threshold = e_.cfg.rails.slice_threshold;
  const std::uint64_t longest = std::min<std::uint64_t>(
      {l.impl.dp.limits().max_msg_size, sliced ? threshold - 1 : ~std::uint64_t{0}, kNoTarget - 1});
  t.at.assign(remote.remotes.size(), RemoteTarget{0, 0, kNoTarget});
  for (std::size_t j = 0; j < remote.remotes.size(); ++j) {
    const RemoteDescriptor& d = remote.remotes[j];
    if (d.segment.slot >= l.by_slot.size() || !l.by_slot[d.segment.slot].has_value()) continue;
    const RemoteRegion& seg = *l.by_slot[d.segment.slot];
    if (d.length > longest || !seg.contains(d.offset, d.length) || !allows(seg.access, need)) continue;
    t.at[j] = {seg.addr + d.offset, seg.rkey, static_cast<std::uint32_t>(d.length)};
  }
  return &t;
}

std::unique_ptr<ListScratch> Worker::make_list_scratch() {
  // The scratch requests, linked once, each with its SGE; only what a position changes is
  // written per post.
  auto s = std::make_unique<ListScratch>();
  for (std::uint32_t i = 0; i < kListChain; ++i) {
    ibv_send_wr& w = s->wrs[i];
    w = ibv_send_wr{};
    w.sg_list = &s->sges[i];
    w.num_sge = 1;
    w.next = i + 1 < kListChain ? &s->wrs[i + 1] : nullptr;
    w.opcode = dp::verbs_opcode(Opcode::write);
  }
  return s;
}

namespace {

// Positions' requests, each from its local SGE and its remote target (their lengths equal: else
// nothing more is built, and the caller ends the chain there), into the worker's scratch
// requests (linked, each with its SGE: Worker::ListScratch) and the ring's slots from `slot` on
// (one stretch of its storage), each slot marked with the count to the chain's end (walk()).
// `Uniform`: every local descriptor's length is `each` and has its SGE here (only the target's
// length is compared; the flags are one for all). Returns how many it built; their bytes in
// `bytes`.
template <Opcode Op, bool Uniform, unsigned UniformFlags>
[[gnu::always_inline]] inline std::uint32_t build_lists(const ibv_sge* ls, const RemoteTarget* rt, const std::uint32_t* li,
                                                        const std::uint32_t* ri, Xfer* x, std::uint32_t n,
                                                        ListScratch& scratch, WrRing::Slot* slot, std::uint64_t seq0,
                                                        std::uint64_t wr_id, std::uint32_t max_inline, std::uint32_t each,
                                                        std::uint64_t& bytes) noexcept {
  static_assert(sizeof(ibv_sge) == 16 && sizeof(RemoteTarget) == 16 && sizeof(WrRing::Slot) == 16);
  // A slot is two words: the entry's address, then (op, kind, 0, run_end, the chain's end) alike
  // for every position; each adds an entry's size to the first.
  const WrRing::Slot proto{0, Op, WrRing::silent, false, true, static_cast<std::uint32_t>(seq0 + n)};
  std::uint64_t w1 = 0;
  std::memcpy(&w1, reinterpret_cast<const char*>(&proto) + 8, sizeof w1);
  auto w0 = reinterpret_cast<std::uint64_t>(x);
  std::uint64_t sum = 0;
  std::size_t i = 0;
#pragma GCC unroll 2
  for (; i != n; ++i) {
    const ibv_sge& s = ls[li[i]];
    const RemoteTarget& t = rt[ri[i]];
    if constexpr (Uniform) {
      if (t.length != each) [[unlikely]] break;
    } else {
      if (s.length != t.length) [[unlikely]] break;
    }
    ibv_send_wr& v = scratch.wrs[i];
    std::memcpy(&scratch.sges[i], &s, sizeof s);
    std::memcpy(static_cast<void*>(&v.wr.rdma), &t, sizeof t);  // remote_addr, rkey; the rest is padding
    if constexpr (Uniform) {
      v.send_flags = UniformFlags;
    } else {
      v.send_flags = dp::may_inline<Op>(s.length, max_inline) ? unsigned{IBV_SEND_INLINE} : 0u;
      sum += s.length;
    }
    v.wr_id = wr_id + i;
    std::memcpy(static_cast<void*>(slot + i), &w0, sizeof w0);
    std::memcpy(reinterpret_cast<char*>(slot + i) + 8, &w1, sizeof w1);
    w0 += sizeof(Xfer);
  }
  bytes = Uniform ? std::uint64_t{i} * each : sum;
  return static_cast<std::uint32_t>(i);
}

}  // namespace

std::uint32_t Worker::post_lists_on(Link& link, BatchState& b, std::uint32_t from, std::uint32_t most, Link** full,
                                     bool checked) {
  ListState& local = *b.local_list;
  ListState& remote = *b.remote_list;
  Peer* const p = link.peer;
  if (!checked && (p == nullptr || p->id != remote.peer || p->generation != remote.peer_gen ||
                   p->removed.load(std::memory_order_relaxed) || lists_registered(local) == nullptr)) [[unlikely]] {
    return from;
  }
  Link* const l = &link;
  const std::uint32_t dev = l->device;
  if (dev >= local.writable.size() || (b.list_op == TransferOp::read && local.writable[dev] == 0)) return from;
  const ListState::Targets* tg = targets_for(remote, *l, b.list_op);
  DataPath& dp = l->impl.dp;
  Lane& lane = dp.lane(0);
  std::uint32_t every = kSignalEvery;
  while (every > dp.signal_interval()) every /= 2;
  // A slot not walked yet (Link::ended) is not overwritten.
  const std::uint64_t unwalked = lane.sq.storage() - (lane.sq.next_seq() - l->ended);
  // One stretch of the ring's storage (what does not fit before its end goes in the next post).
  const std::uint64_t seq0 = lane.sq.next_seq();
  const auto view = lane.sq.view();
  const std::uint64_t stretch = view.mask + 1 - (seq0 & view.mask);
  const auto room =
      static_cast<std::uint32_t>(std::min<std::uint64_t>({most, dp.prebuilt_room(lane, every), unwalked, stretch, kListChain}));
  if (room < most) *full = l;
  if (room == 0) return from;
  if (!lists_) lists_ = make_list_scratch();
  ibv_send_wr* const wrs = lists_->wrs;
  if (lists_->op != b.list_op) {
    const ibv_wr_opcode code = dp::verbs_opcode(b.list_op == TransferOp::read ? Opcode::read : Opcode::write);
    for (ibv_send_wr& w : lists_->wrs) w.opcode = code;
    lists_->op = b.list_op;
  }
  const ibv_sge* const ls = local.sges.data() + std::size_t{dev} * local.local.size();
  const bool uniform = local.uniform != 0 && local.uniform_on[dev] != 0;
  const auto each = static_cast<std::uint32_t>(uniform ? local.uniform : 0);
  WrRing::Slot* const slot = view.slots + (seq0 & view.mask);
  const std::uint64_t wr_id = lane.wr_id(seq0);
  const std::uint32_t max_inline = dp.limits().max_inline;
  std::uint64_t bytes = 0;
  const auto build = [&](auto op, auto same, auto flags) {
    return build_lists<decltype(op)::value, decltype(same)::value, decltype(flags)::value>(
        ls, tg->at.data(), b.local_index + from, b.remote_index + from, b.x + from, room, *lists_, slot, seq0, wr_id,
        max_inline, each, bytes);
  };
  using Read = std::integral_constant<Opcode, Opcode::read>;
  using Write = std::integral_constant<Opcode, Opcode::write>;
  using Same = std::true_type;
  using Mixed = std::false_type;
  using Plain = std::integral_constant<unsigned, 0u>;
  using Inline = std::integral_constant<unsigned, unsigned{IBV_SEND_INLINE}>;
  const bool inlined = dp::may_inline<Opcode::write>(each, max_inline);
  std::uint32_t built = 0;
  if (b.list_op == TransferOp::read) {
    built = uniform ? build(Read{}, Same{}, Plain{}) : build(Read{}, Mixed{}, Plain{});
  } else if (!uniform) {
    built = build(Write{}, Mixed{}, Plain{});
  } else {
    built = inlined ? build(Write{}, Same{}, Inline{}) : build(Write{}, Same{}, Plain{});
  }
  if (built < room) *full = nullptr;  // stopped at a position that takes the long way
  if (built == 0) return from;
  if (built < room) [[unlikely]] {  // each slot names the chain's end
    for (std::uint32_t i = 0; i < built; ++i) slot[i].run = static_cast<std::uint32_t>(seq0 + built);
  }
  // Signaled every `every` and the last (whose completion is news: it retires the chain).
  for (std::uint32_t i = every - 1; i < built; i += every) {
    wrs[i].send_flags |= IBV_SEND_SIGNALED;
    slot[i].kind = WrRing::user;
  }
  wrs[built - 1].send_flags |= IBV_SEND_SIGNALED;
  slot[built - 1].kind = WrRing::user;
  wrs[built - 1].next = nullptr;
  const PostResult res = dp.post_written(lane, wrs, built);
  wrs[built - 1].next = built < kListChain ? &wrs[built] : nullptr;
  const std::uint32_t went = res.ok() ? built : static_cast<std::uint32_t>(res.index);
  if (went < built) {
    bytes = 0;
    for (std::uint32_t i = 0; i < went; ++i) bytes += b.length_at(from + i);
    for (std::uint32_t i = 0; i < went; ++i) slot[i].run = static_cast<std::uint32_t>(seq0 + went);
  }
  l->in_flight += went;
  in_flight_ += went;
  l->bytes_out += bytes;
  e_.count.lists_posted.fetch_add(went, std::memory_order_relaxed);
  if (res.ok()) [[likely]] return from + built;
  // The provider refused part way: as for a chain (post_chain), the rest of these failed and the
  // link breaks; what comes after them takes the long way.
  *full = nullptr;
  const std::string why = fmt::format("peer '{}': {}", p->name, res.describe());
  for (std::uint32_t i = went; i < built; ++i) end(b.x[from + i], TransferStatus::failed, why);
  break_link(*l, why);
  return from + built;
}

}  // namespace rdmakit::detail
