// SPDX-License-Identifier: Apache-2.0
// The submit path: what every batch goes through before its transfers reach their workers
// (Engine::Impl::start), and a batch of transfers' way to them (Engine::submit(span),
// Engine::Impl::launch). One file, so that a batch of one (the latency path) runs it without
// calls between its steps: on the lab's emulator each call and return costs tens of
// nanoseconds, more than the steps themselves (docs/performance.md).
#include <cerrno>
#include <memory>

#include <fmt/format.h>

#include "engine/impl.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

using detail::BatchState;

// Here, where launch makes the handle of every batch of transfers (one call less on the way).
Batch::Batch(std::shared_ptr<detail::BatchState> state) noexcept : state_(std::move(state)) {}

namespace {

[[noreturn, gnu::cold]] void refuse(const SubmitOptions& options) {
  if (options.notify.size() > Engine::max_notification) {
    throw Error("submit", EMSGSIZE,
                fmt::format("a notification of {} bytes; at most {}", options.notify.size(), Engine::max_notification));
  }
  throw Error("submit", EMSGSIZE,
              fmt::format("a request id of {} bytes; at most {}", options.request_id.size(), Engine::max_request_id));
}

// A batch state destroyed in place made again, of `one` transfer (Engine::Impl::batch_of_one).
// Nothing is allocated for one transfer, so nothing throws; were it to, the process ends here
// (noexcept) rather than keep a destroyed state.
[[gnu::always_inline]] inline void remake_batch(BatchState* s, Engine::Impl* e, std::span<const Transfer> one) noexcept {
  std::shared_ptr<detail::DriveGate> gate = std::move(s->gate);  // the engine's: kept, not counted down and up
  s->~BatchState();
  ::new (static_cast<void*>(s)) BatchState(e, one, std::move(gate));
}

}  // namespace

[[gnu::always_inline]] inline bool Engine::Impl::start_here(const std::shared_ptr<BatchState>& state,
                                                            SubmitOptions&& options) {
  BatchState& b = *state;
  if (options.notify.size() > Engine::max_notification || options.request_id.size() > Engine::max_request_id) [[unlikely]] {
    refuse(options);
  }
  // Most batches carry none of these: nothing to move (the latency path counts each step).
  if (!options.notify.empty()) b.notify = std::move(options.notify);
  if (!options.request_id.empty()) b.request_id = std::move(options.request_id);
  if (options.on_done) b.on_done = std::move(options.on_done);
  if (cfg.telemetry) b.submitted = detail::Clock::now();
  if (!b.note_only) {
    count.batches.fetch_add(1, std::memory_order_relaxed);
    count.transfers.fetch_add(b.size, std::memory_order_relaxed);
    if (b.plan) {
      submitted.add_tally(b.plan->tally);  // counted once, at prepare()
    } else {
      if (b.local_index != nullptr && b.local_list->uniform != 0) {  // descriptor lists of blocks alike
        submitted.add_same(b.size, b.list_op, b.local_list->uniform);
      } else if (b.local_index != nullptr) {  // one operation, the local descriptors' lengths
        const LocalDescriptor* l = b.local_list->local.data();
        submitted.add_batch(b.size, [&](std::size_t i) { return detail::OpLength{b.list_op, l[b.local_index[i]].length}; });
      } else {
        submitted.add_batch(b.size, [&](std::size_t i) { return detail::OpLength{b.x[i].t_->op, b.x[i].t_->length}; });
      }
    }
  }
  if (b.size != 0) return true;
  // Done at once, like any batch.
  if (cfg.telemetry) b.ended_ns.store(b.submitted.time_since_epoch().count(), std::memory_order_release);
  if (b.on_done) {
    try {
      b.on_done(Batch(state));
    } catch (...) {
    }
  }
  b.ended();
  signal();
  return false;
}

bool Engine::Impl::start(const std::shared_ptr<BatchState>& b, SubmitOptions&& options) {
  return start_here(b, std::move(options));
}

// ThreadSanitizer models no fence (GCC warns at one, -Wtsan) and shared_ptr's use_count() is a
// relaxed load: the reuse below would read as a race on every batch. A TSan build makes every
// batch anew; the ASan and plain builds run the reuse (tests/rxe/engine_test.cpp). (GCC's
// macro, as the tests test it: the library's sanitized builds are GCC's, scripts/test.)
#if defined(__SANITIZE_THREAD__)
#define RDMAKIT_REUSE_BATCHES 0
#else
#define RDMAKIT_REUSE_BATCHES 1
#endif

[[gnu::always_inline]] inline std::shared_ptr<BatchState> Engine::Impl::batch_of_one(const Transfer& t) {
  const std::span<const Transfer> one(&t, 1);
#if RDMAKIT_REUSE_BATCHES
  std::unique_lock lock(spare_mu, std::try_to_lock);
  if (!lock.owns_lock()) return detail::make_batch(this, one);
  // Held by nothing else (no weak reference to a batch is ever made): it ended, its handle is
  // gone and no worker lists it. (Ended is implied; tested too, so that a broken count could
  // never remake a batch in flight.) The fence pairs with the release of those last references.
  if (spare.use_count() == 1 && spare->remaining.load(std::memory_order_relaxed) == 0) {
    std::atomic_thread_fence(std::memory_order_acquire);
    remake_batch(spare.get(), this, one);
  } else {
    spare = detail::make_batch(this, one);  // the one before lives on with whoever holds it
  }
  return spare;
#else
  return detail::make_batch(this, one);
#endif
}

Batch Engine::submit(std::span<const Transfer> transfers, SubmitOptions options) {
  // A batch of one that keeps nothing of the caller's but its transfer reuses the engine's
  // spare state (Impl::spare): a callback's captures must not outlive the batch's last handle.
  const bool plain_one =
      transfers.size() == 1 && !options.on_done && options.notify.empty() && options.request_id.empty();
  return impl_->launch_here(plain_one ? impl_->batch_of_one(transfers[0]) : detail::make_batch(impl_.get(), transfers),
                            std::move(options));
}

Batch Engine::Impl::launch(std::shared_ptr<BatchState> state, SubmitOptions&& options) {
  return launch_here(std::move(state), std::move(options));
}

[[gnu::always_inline]] inline Batch Engine::Impl::launch_here(std::shared_ptr<BatchState> state, SubmitOptions&& options) {
  if (!start_here(state, std::move(options))) return Batch(std::move(state));
  // The workers check each transfer (and end a bad one at once); here they are only sent to
  // their peers' workers: with one worker, without looking at them.
  const std::size_t n = workers.size();
  // An unknown peer goes to worker 0, which says so; the worker checks the handle (this is
  // only where to send it, read without touching a peer record that may be going).
  auto worker_of = [&](std::uint32_t i) {
    const std::uint32_t id = state->remote_at(i).peer;
    const std::uint32_t w = id != 0 && id <= kMaxPeers ? peer_worker[id - 1].load(std::memory_order_relaxed) : 0;
    return w < n ? w : 0;
  };
  std::uint32_t home = 0;
  if (n > 1) {
    home = worker_of(0);
    // Descriptor lists on one peer: every position is that peer's.
    const bool one_peer = state->remote_list != nullptr && state->remote_list->peer != 0;
    for (std::uint32_t i = 1; i < state->size && home != detail::kSeveralWorkers && !one_peer; ++i) {
      if (worker_of(i) != home) home = detail::kSeveralWorkers;
    }
  }
  state->set_home(home, n);
  if (home != detail::kSeveralWorkers) {
    // The caller's handle takes this reference last: on the common path (started here) no
    // copy of it is made, or dropped, on the way.
    send_to(home, state);
    return Batch(std::move(state));
  }
  std::vector<std::vector<std::uint32_t>> per_worker(n);
  for (std::uint32_t i = 0; i < state->size; ++i) per_worker[worker_of(i)].push_back(i);
  for (std::size_t w = 0; w < n; ++w) {
    if (per_worker[w].empty()) continue;
    detail::Command c(detail::Command::Kind::submit);
    c.batch = state;
    c.indexes = std::move(per_worker[w]);
    workers[w]->post(std::move(c));
  }
  return Batch(std::move(state));
}

void Engine::Impl::hand_to(std::uint32_t home, std::shared_ptr<detail::BatchState> b) {
  detail::Command c(detail::Command::Kind::submit);
  c.batch = std::move(b);
  workers[home]->post(std::move(c));
}

}  // namespace rdmakit
