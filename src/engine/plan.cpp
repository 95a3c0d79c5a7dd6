// SPDX-License-Identifier: Apache-2.0
// Prepared plans (Engine::prepare, submit(plan)): transfers checked once, cut into runs of one
// operation between one buffer and one peer's segment; each run's verbs requests built once per
// link and posted as they are, a chain per run, while the link and the segment are those they
// were built for. Anything else takes the path of submit(span) (Worker::route), which also says
// why a transfer cannot move.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "engine/impl.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

using detail::BatchState;
using detail::PlanState;

TransferPlan::TransferPlan(std::shared_ptr<detail::PlanState> state) noexcept : state_(std::move(state)) {}

std::size_t TransferPlan::size() const noexcept { return state_ ? state_->x.size() : 0; }

namespace {

// allocate_shared's allocator for a batch of a plan: the batch's entries go in the same
// allocation, after the control block and the batch (one allocation per batch, not two).
template <typename T>
struct EntriesAfter {
  using value_type = T;
  std::size_t entries = 0;
  detail::Xfer** at = nullptr;
  EntriesAfter(std::size_t n, detail::Xfer** where) noexcept : entries(n), at(where) {}
  template <typename U>
  EntriesAfter(const EntriesAfter<U>& o) noexcept : entries(o.entries), at(o.at) {}  // NOLINT: rebinding
  static std::size_t head(std::size_t n) noexcept {
    return (n * sizeof(T) + alignof(detail::Xfer) - 1) / alignof(detail::Xfer) * alignof(detail::Xfer);
  }
  T* allocate(std::size_t n) {
    auto* p = static_cast<char*>(::operator new(head(n) + entries * sizeof(detail::Xfer)));
    *at = reinterpret_cast<detail::Xfer*>(p + head(n));
    return reinterpret_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p); }
  template <typename U>
  bool operator==(const EntriesAfter<U>&) const noexcept {
    return true;
  }
};

}  // namespace

detail::BatchState::BatchState(Engine::Impl* e, std::shared_ptr<PlanState> p, Xfer* const* entries)
    : size(static_cast<std::uint32_t>(p->x.size())), engine(e), plan(std::move(p)) {
  // The plan's entries (its checked transfers), each with its batch: 32 bytes each, copied one
  // by one in two moves (a memcpy of the block takes `rep movsb`, which callgrind counts byte
  // by byte).
  Xfer* const to = *entries;
  x_inline = true;
  const Xfer* from = plan->x.data();
  // Unrolled: the loop's own count and branch are a fifth of its instructions otherwise.
#pragma GCC unroll 4
  for (Xfer *at = to, *end = to + size; at != end; ++at, ++from) {  // locals: no reload per entry
    std::memcpy(static_cast<void*>(at), from, sizeof(Xfer));
    at->batch = this;
  }
  x = to;
  gate = e->gate;
  atomics = plan->atomics;
  remaining.store(size, std::memory_order_relaxed);
}

TransferPlan Engine::prepare(std::span<const Transfer> transfers) {
  if (transfers.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw Error("prepare", EINVAL, fmt::format("{} transfers in one plan", transfers.size()));
  }
  auto plan = std::make_shared<PlanState>();
  plan->engine = impl_.get();
  plan->epoch = impl_->epoch;
  plan->transfers.assign(transfers.begin(), transfers.end());  // the Xfers point at them: not resized after
  plan->x.reserve(transfers.size());
  const std::size_t workers = impl_->workers.size();
  plan->runs_of.resize(workers);
  plan->transfers_of.resize(workers);
  for (std::uint32_t i = 0; i < transfers.size(); ++i) {
    const Transfer& t = plan->transfers[i];
    // Under the registry's lock: neither record can go while it is looked at.
    std::lock_guard lock(impl_->mu);
    const detail::BufferRec* b = impl_->buffer(t.local);
    const detail::Peer* p = impl_->peer(t.remote);
    if (b == nullptr || b->retired.load(std::memory_order_relaxed) || p == nullptr ||
        p->removed.load(std::memory_order_relaxed) || detail::bad_range(t, b->handle.length) ||
        t.remote.slot >= p->slots.load(std::memory_order_relaxed)) {
      throw Error("prepare", EINVAL, fmt::format("transfer {} ({} of {} bytes): {}", i, to_string(t.op), t.length,
                                                 detail::invalid_reason(t, b, p)));
    }
    plan->x.emplace_back(t, nullptr, i);
    // A run: consecutive transfers of one operation between one buffer and one peer's segment.
    if (plan->runs.empty() || plan->runs.back().peer != t.remote.peer || plan->runs.back().slot != t.remote.slot ||
        plan->runs.back().buf != t.local.id || plan->runs.back().buf_gen != t.local.generation ||
        plan->runs.back().peer_gen != t.remote.generation || plan->runs.back().op != t.op) {
      const std::uint32_t w = p->worker->index();
      plan->runs_of[w].push_back(static_cast<std::uint32_t>(plan->runs.size()));
      plan->runs.push_back({i, 0, t.remote.peer, t.remote.slot, t.local.id, t.local.generation, t.remote.generation, t.op, {}});
    }
    plan->atomics |= t.op >= TransferOp::fetch_add;
    ++plan->runs.back().n;
    ++plan->transfers_of[p->worker->index()];
  }
  plan->tally = detail::SubmitTally::of(plan->transfers);
  return TransferPlan(std::move(plan));
}

Batch Engine::submit(const TransferPlan& plan, SubmitOptions options) {
  if (!plan.state_ || plan.state_->engine != impl_.get() || plan.state_->epoch != impl_->epoch) {
    throw Error("submit", EINVAL, plan.state_ ? "a TransferPlan prepared by another engine"
                                              : "an empty TransferPlan (default-built: use Engine::prepare)");
  }
  detail::Xfer* entries = nullptr;
  auto state = std::allocate_shared<BatchState>(EntriesAfter<BatchState>(plan.state_->x.size(), &entries), impl_.get(),
                                                plan.state_, &entries);
  Batch batch(state);
  if (!impl_->start(state, std::move(options))) return batch;
  const std::size_t workers = impl_->workers.size();
  std::uint32_t home = detail::kSeveralWorkers;
  std::size_t on = 0;  // workers with transfers of it
  for (std::uint32_t w = 0; w < workers; ++w) {
    if (plan.state_->transfers_of[w] != 0 && on++ == 0) home = w;
  }
  state->set_home(on == 1 ? home : detail::kSeveralWorkers, workers);
  if (on == 1) {
    impl_->send_to(home, state);
    return batch;
  }
  for (std::size_t w = 0; w < workers; ++w) {
    if (plan.state_->transfers_of[w] == 0) continue;
    detail::Command c(detail::Command::Kind::submit);
    c.batch = state;
    impl_->workers[w]->post(std::move(c));
  }
  return batch;
}

namespace detail {

void Worker::submit_plan(const std::shared_ptr<BatchState>& b) {
  PlanState& plan = *b->plan;
  const std::vector<std::uint32_t>& mine = plan.runs_of[index_];
  WorkerShare& live = list(b, plan.transfers_of[index_]);
  if (b->cancelled.load(std::memory_order_relaxed)) [[unlikely]] {  // before it came here
    for (const std::uint32_t k : mine) {
      const PlanState::Run& run = plan.runs[k];
      for (std::uint32_t i = 0; i < run.n; ++i) end(b->x[run.begin + i], TransferStatus::cancelled, kCancelled);
    }
    return;
  }
  if (!b->notify.empty()) {
    for (const std::uint32_t k : mine) {
      const PlanState::Run& run = plan.runs[k];
      live.notify_left[{run.peer, run.peer_gen}] += run.n;
    }
  }
  // `live` may go from here on: the last transfer to end erases it.
  Route r;
  for (const std::uint32_t k : mine) {
    PlanState::Run& run = plan.runs[k];
    Xfer* x = b->x + run.begin;
    const std::uint32_t went = post_run(run, x);
    if (went < run.n) route_all(x + went, x + run.n, r);
  }
  post_open_chains();
  if (e_.cfg.telemetry) b->stamp_posted();
}

std::uint32_t Worker::post_run(PlanState::Run& run, Xfer* x) {
  // Anything gone since prepare() (the buffer, the peer; their ids maybe reused): the long way
  // ends each transfer with why.
  Peer* p = e_.peer(run.peer);
  const BufferRec* buf = e_.buffer(run.buf);
  if (p == nullptr || p->generation != run.peer_gen || p->removed.load(std::memory_order_relaxed) || buf == nullptr ||
      buf->handle.generation != run.buf_gen || (buf->retired_by.load(std::memory_order_relaxed) >> index_ & 1) != 0)
      [[unlikely]] {
    return 0;
  }
  Link* l = pick(*p, buf);
  if (l == nullptr || !l->backlog.empty()) return 0;
  if (l->chain_open) {  // transfers before the run, chained the long way: they go first
    post_chain(*l);
    if (!ready(l)) return 0;
  }
  PlanState::Built* bt = built_for(run, *buf, *l, *p, x);
  if (bt == nullptr) return 0;
  DataPath& dp = l->impl.dp;
  Lane& lane = dp.lane(0);
  // A slot not walked yet (Link::ended) is not overwritten.
  const std::uint64_t unwalked = lane.sq.storage() - (lane.sq.next_seq() - l->ended);
  const auto k = static_cast<std::uint32_t>(
      std::min<std::uint64_t>({run.n, dp.prebuilt_room(lane, bt->every), unwalked}));
  if (k == 0) return 0;
  // Fewer than all (the queue's room): the last of them signaled and the chain cut after it,
  // for this post only.
  ibv_send_wr& last = bt->wrs[k - 1];
  WrRing::Slot& last_slot = bt->slots[k - 1];
  const unsigned flags = last.send_flags;
  ibv_send_wr* const next = last.next;
  const WrRing::Slot slot = last_slot;
  last.send_flags |= IBV_SEND_SIGNALED;
  last.next = nullptr;
  last_slot.kind = WrRing::user;
  const std::uint64_t seq0 = lane.sq.next_seq();
  const PostResult res = dp.post_prebuilt(lane, bt->wrs.data(), k, bt->slots.data(), reinterpret_cast<std::uint64_t>(x));
  last.send_flags = flags;
  last.next = next;
  last_slot = slot;
  const std::uint32_t went = res.ok() ? k : static_cast<std::uint32_t>(res.index);
  if (went < run.n) {
    // A slot's run counts to the end of its chain: built as n - i, posted as went - i.
    const auto slots = lane.sq.view();
    for (std::uint32_t i = 0; i < went; ++i) slots[seq0 + i].run = went - i;
  }
  l->in_flight += went;
  in_flight_ += went;
  e_.count.plan_posted.fetch_add(went, std::memory_order_relaxed);
  if (went == run.n) {
    l->bytes_out += bt->bytes;
  } else {
    for (std::uint32_t i = 0; i < went; ++i) l->bytes_out += x[i].t_->length;
  }
  if (res.ok()) [[likely]] return k;
  // The provider refused part way: as for a chain (post_chain), the rest of these failed and the
  // link breaks; what comes after them takes the long way.
  const std::string why = fmt::format("peer '{}': {}", p->name, res.describe());
  for (std::uint32_t i = went; i < k; ++i) end(x[i], TransferStatus::failed, why);
  break_link(*l, why);
  return k;
}

PlanState::Built* Worker::built_for(PlanState::Run& run, const BufferRec& buf, Link& l, const Peer& p, const Xfer* x) {
  const std::optional<RemoteRegion>* seg = run.slot < l.by_slot.size() ? &l.by_slot[run.slot] : nullptr;
  if (seg == nullptr || !seg->has_value()) return nullptr;  // the long way says why
  const RemoteRegion& now = **seg;
  // One per rail the peer has.
  const auto [cached, found] = per_link(run.built, l.serial, p.rails.size(), [](const PlanState::Built&) { return true; });
  if (found && cached->seg == now) return cached->fast ? cached : nullptr;
  // Built again from the plan's transfers: for a new link, or the segment announced anew.
  e_.count.plan_builds.fetch_add(1, std::memory_order_relaxed);
  PlanState::Built& bt = *cached;
  bt.link = l.serial;
  bt.seg = now;
  bt.fast = false;
  bt.bytes = 0;
  bt.wrs.assign(run.n, ibv_send_wr{});
  bt.sges.assign(run.n, ibv_sge{});
  bt.slots.assign(run.n, WrRing::Slot{});
  DataPath& dp = l.impl.dp;
  bt.every = kSignalEvery;
  while (bt.every > dp.signal_interval()) bt.every /= 2;
  const LocalSlice& s = buf.slices[l.device];
  if (s.length() == 0) return nullptr;  // the long way says why (a tcp or shm link, GPU memory)
  const auto base = reinterpret_cast<std::uint64_t>(s.addr());
  const std::uint64_t threshold = e_.cfg.rails.slice_threshold;
  for (std::uint32_t i = 0; i < run.n; ++i) {
    const Transfer& t = *x[i].t_;
    // A transfer long enough to be sliced over rails goes the long way (slices_for decides).
    if (threshold != 0 && t.length >= threshold && t.op <= TransferOp::write) return nullptr;
    if (t.length > std::numeric_limits<std::uint32_t>::max()) return nullptr;
    const auto len = static_cast<std::uint32_t>(t.length);
    const std::uint64_t laddr = base + t.local_offset;
    ibv_send_wr& v = bt.wrs[i];
    const PostStatus st = with_opcode(run.op, [&](auto op) {
      constexpr Opcode Op = decltype(op)::value;
      return dp.build_request<Op>(v, bt.sges[i], laddr, len, s.lkey(), s.writable(), now, t.remote_offset,
                                  compare_add_of<Op>(t), swap_of<Op>(t));
    });
    if (st != PostStatus::ok) return nullptr;
    v.next = i + 1 < run.n ? &v + 1 : nullptr;
    const bool signaled = (i + 1) % bt.every == 0 || i + 1 == run.n;
    if (signaled) v.send_flags |= IBV_SEND_SIGNALED;
    bt.slots[i] = {i * sizeof(Xfer), with_opcode(run.op, [](auto op) { return decltype(op)::value; }), signaled ? WrRing::user : WrRing::silent, false, 0, run.n - i};
    bt.bytes += t.length;
  }
  bt.fast = true;
  return &bt;
}

}  // namespace detail

}  // namespace rdmakit
