// SPDX-License-Identifier: Apache-2.0
// A batch of transfers: its shared state (ended by the workers, one transfer at a time) and the
// caller's Batch handle.
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include <fmt/format.h>

#include "bootstrap/auth.hpp"
#include "common/cpu.hpp"
#include "engine/impl.hpp"
#include "engine/locality.hpp"
#include "memory/cuda.hpp"
#include "engine/metadata.hpp"
#include "engine/protocol.hpp"
#include "engine/rails.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit {

using detail::BatchState;
using detail::Peer;
using detail::Worker;

detail::BatchState::BatchState(Engine::Impl* e, std::uint32_t n, bool lists) : size(n), engine(e) {
  allocate_entries(lists);  // the caller constructs each entry and its transfer (once, not twice)
  remaining.store(size, std::memory_order_relaxed);
  gate = e->gate;
}

void detail::DriveGate::close() noexcept {
  users_.fetch_or(kClosed, std::memory_order_acq_rel);
  // Whoever is inside sees it closing within one turn of its spin, and leaves.
  while ((users_.load(std::memory_order_acquire) & ~kClosed) != 0) std::this_thread::yield();
}

void detail::BatchState::finish(Xfer& t, TransferStatus s, std::string reason,
                                const std::shared_ptr<BatchState>& self) noexcept {
  if (t.status(std::memory_order_relaxed) != TransferStatus::pending) return;  // ended once
  if (s != TransferStatus::ok) {
    try {
      std::lock_guard lock(mu);
      if (!reasons) reasons = std::make_unique<Reasons>();
      (*reasons)[t.index] = std::move(reason);
    } catch (...) {
      // Out of memory for the reason: the status still says what happened.
    }
    failed.fetch_add(1, std::memory_order_relaxed);
    if (!note_only) {
      engine->count.transfers_failed.fetch_add(1, std::memory_order_relaxed);
      engine->failed_by_status[static_cast<std::size_t>(s) & 15].fetch_add(1, std::memory_order_relaxed);
    }
  }
  t.set_status(s, std::memory_order_release);
  if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) last_ended(self);
}

void detail::BatchState::notification_failed(std::string why) noexcept {
  try {
    std::lock_guard lock(mu);
    notify_failures.push_back(std::move(why));
  } catch (...) {
  }
  notify_failed.fetch_add(1, std::memory_order_relaxed);
  engine->count.notifications_refused.fetch_add(1, std::memory_order_relaxed);
}

void detail::BatchState::run_callback(const std::shared_ptr<BatchState>& self) noexcept {
  try {
    on_done(Batch(self));
  } catch (...) {
    // A callback that throws must not take the worker down.
  }
}

void detail::BatchState::wake_sleepers() noexcept {
  std::condition_variable* c = nullptr;
  {
    std::lock_guard lock(mu);
    if (cv) c = &*cv;  // made by the sleeper, under mu, before it counted itself
  }
  if (c != nullptr) c->notify_all();
}

bool detail::BatchState::spin(Deadline start, Deadline until) noexcept {
  // The engine is alive while we are inside its gate, not a moment longer.
  if (!gate->enter()) return callback_ran.load(std::memory_order_acquire);
  const std::chrono::nanoseconds spin = engine->spin_for();
  bool done = false;
  // A batch on several workers is ended by their threads; this one only watches.
  Worker* w = home != kSeveralWorkers ? engine->drivable(home) : nullptr;
  if (spin.count() > 0) {
    until = std::min(until, start + spin);
    if (w != nullptr) w->enter_drive();
    // After a while the spin lets whatever else is ready on this CPU run now and then: a
    // software device's protocol work (rxe's, in the kernel's softirq thread) that this very
    // transfer waits for. Not at first: on a NIC the round trip is shorter than a system call.
    const Deadline yield_from = start + std::chrono::microseconds{20};
    bool yielding = false;
    for (std::uint32_t turn = 0;; ++turn) {
      if (callback_ran.load(std::memory_order_acquire)) {
        done = true;
        break;
      }
      if (w != nullptr) (void)w->try_drive();
      cpu_relax();  // and room for the worker's thread to take its lock back between two looks
      // The clock every few turns (a turn that polled an empty CQ is shorter than a clock
      // read), and whether the engine is closing (its destructor waits for this loop to end).
      if ((turn & 7) == 7) {
        const Deadline now = Clock::now();
        if (now >= until || gate->closing()) break;
        yielding = now >= yield_from;
      }
      if (yielding && (turn & 31) == 31) sched_yield();
    }
    if (w != nullptr) w->leave_drive(done);
  }
  if (!done && !callback_ran.load(std::memory_order_acquire)) {
    // About to sleep: its worker's CQs armed, so that its completion wakes that worker's thread
    // (which ends it and wakes this one). Every worker's for a batch on several.
    if (w != nullptr) {
      w->request_arm();
    } else if (home == kSeveralWorkers) {
      for (std::uint32_t i = 0; engine->drivable(i) != nullptr; ++i) engine->drivable(i)->request_arm();
    }
  }
  if (done) {
    engine->waited(Clock::now() - start);
    engine->count.waits_spun.fetch_add(1, std::memory_order_relaxed);
  }
  gate->leave();
  return done;
}

void detail::BatchState::slept(std::chrono::nanoseconds took) noexcept {
  if (!gate->enter()) return;
  engine->waited(took);
  gate->leave();
}

Batch::Batch(Batch&&) noexcept = default;
Batch& Batch::operator=(Batch&&) noexcept = default;
Batch::~Batch() = default;

bool Batch::done() const noexcept {
  return !state_ || state_->remaining.load(std::memory_order_acquire) == 0;
}

bool Batch::wait(std::chrono::milliseconds timeout) const {
  if (!state_) return true;
  detail::BatchState& b = *state_;
  if (b.callback_ran.load(std::memory_order_acquire)) return true;
  const detail::Deadline start = detail::Clock::now();
  // Saturated: a timeout of milliseconds::max() waits for ever, not for a negative time.
  const detail::Deadline until =
      timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(detail::Deadline::max() - start)
          ? detail::Deadline::max()
          : start + timeout;
  // First a spin on this thread (EngineConfig::wait_spin: as long as such waits took of late,
  // within it): the wire's latency, and no thread's wake-up on top.
  if (b.spin(start, until)) return true;
  std::unique_lock lock(b.mu);
  if (!b.cv) b.cv.emplace();
  b.sleepers.fetch_add(1, std::memory_order_seq_cst);
  const bool done = b.cv->wait_until(lock, until, [&] { return b.callback_ran.load(std::memory_order_seq_cst); });
  b.sleepers.fetch_sub(1, std::memory_order_relaxed);
  lock.unlock();
  if (done) b.slept(detail::Clock::now() - start);
  return done;
}

std::size_t Batch::size() const noexcept { return state_ ? state_->size : 0; }

std::size_t Batch::failed() const noexcept {
  return state_ ? state_->failed.load(std::memory_order_acquire) : 0;
}

std::size_t Batch::notifications_failed() const noexcept {
  return state_ ? state_->notify_failed.load(std::memory_order_acquire) : 0;
}

TransferResult Batch::result(std::size_t i) const {
  if (i >= size()) throw Error("batch result", EINVAL, fmt::format("transfer {} of a batch of {}", i, size()));
  const TransferStatus st = state_->x[i].status(std::memory_order_acquire);
  if (st == TransferStatus::pending || st == TransferStatus::ok) return {st, {}};
  std::lock_guard lock(state_->mu);
  if (!state_->reasons) return {st, {}};
  const auto it = state_->reasons->find(static_cast<std::uint32_t>(i));
  return {st, it != state_->reasons->end() ? it->second : std::string{}};
}

std::string Batch::describe_failures() const {
  // Consecutive transfers that failed alike (a missing segment, a lost peer) are one line.
  std::string out;
  if (state_ && state_->note_only) {  // its entry is the notification
    const TransferResult r = result(0);
    if (r.status == TransferStatus::ok || r.status == TransferStatus::pending) return out;
    return fmt::format("notification: {}: {}\n", to_string(r.status), r.reason);
  }
  std::size_t first = 0;
  TransferResult run;
  auto flush = [&](std::size_t last) {
    if (run.status == TransferStatus::ok || run.status == TransferStatus::pending) return;
    const Transfer t = state_->transfer_at(static_cast<std::uint32_t>(first));
    out += first == last ? fmt::format("transfer {} ({} of {} bytes)", first, to_string(t.op), t.length)
                         : fmt::format("transfers {}-{} (from {} of {} bytes)", first, last, to_string(t.op), t.length);
    out += fmt::format(": {}: {}\n", to_string(run.status), run.reason);
  };
  for (std::size_t i = 0; i < size(); ++i) {
    TransferResult r = result(i);
    if (i > 0 && (r.status != run.status || r.reason != run.reason)) {
      flush(i - 1);
      first = i;
    }
    if (i == 0 || first == i) run = std::move(r);
  }
  if (size() > 0) flush(size() - 1);
  if (!state_) return out;
  std::lock_guard lock(state_->mu);
  for (const std::string& n : state_->notify_failures) out += fmt::format("notification: {}\n", n);
  return out;
}

std::string Batch::describe_progress() const {
  if (state_ && state_->note_only) {  // its entry is the notification
    const TransferStatus st = state_->x[0].status(std::memory_order_acquire);
    return st == TransferStatus::pending ? "its notification had not been sent"
                                         : fmt::format("its notification ended: {}", to_string(st));
  }
  const std::size_t n = size();
  std::size_t ended = 0, failed = 0;
  // The transfers not ended, as runs of indices: the first few, then how many more runs.
  constexpr std::size_t kRunsShown = 4;
  std::string open;
  std::size_t runs = 0;
  for (std::size_t i = 0; i < n;) {
    if (const TransferStatus st = state_->x[i].status(std::memory_order_acquire); st != TransferStatus::pending) {
      ++ended;
      failed += st != TransferStatus::ok ? 1u : 0u;
      ++i;
      continue;
    }
    std::size_t last = i;
    while (last + 1 < n && state_->x[last + 1].status(std::memory_order_acquire) == TransferStatus::pending) ++last;
    if (runs++ < kRunsShown) {
      open += fmt::format("{}{}", open.empty() ? "" : ", ", last == i ? fmt::format("{}", i) : fmt::format("{}-{}", i, last));
    }
    i = last + 1;
  }
  if (runs > kRunsShown) open += fmt::format(" and {} more run{}", runs - kRunsShown, runs - kRunsShown == 1 ? "" : "s");
  std::string paths;
  for (const PathTelemetry& p : telemetry().paths) {
    paths += fmt::format("{}{} {}", paths.empty() ? "" : ", ", p.device, p.transfers);
  }
  return fmt::format("{} of {} ended ({} failed{}), {} had not{}", ended, n, failed,
                     paths.empty() ? "" : fmt::format("; ended ok on path: {}", paths), n - ended,
                     open.empty() ? "" : fmt::format(": transfer{} {}", n - ended == 1 ? "" : "s", open));
}

BatchTelemetry Batch::telemetry() const {
  BatchTelemetry t;
  if (!state_) return t;
  const detail::BatchState& b = *state_;
  using TP = std::chrono::steady_clock::time_point;
  t.request_id = b.request_id;
  t.submitted = b.submitted;
  t.posted = TP(TP::duration(b.posted_ns.load(std::memory_order_relaxed)));
  // Stamped before its callback runs, so the callback reads it too.
  t.ended = TP(TP::duration(b.ended_ns.load(std::memory_order_acquire)));
  const bool done = t.ended != TP{};
  // A batch whose transfers all ended at once (refused, or a notification sent on a link that
  // was up) ended before its worker stamped it as posted.
  if (done && (t.posted == TP{} || t.posted > t.ended)) t.posted = t.ended;
  t.transfers = b.note_only ? 0 : b.size;
  // Per path, by device index: bytes and transfers.
  std::map<std::uint8_t, std::pair<std::uint64_t, std::uint32_t>> paths;
  for (std::uint32_t i = 0; i < t.transfers; ++i) {
    const detail::Xfer& x = b.x[i];
    const TransferStatus st = x.status(std::memory_order_acquire);
    if (st != TransferStatus::ok) continue;
    // (Of a batch of descriptor lists, reads and writes only: no transfer of it is built here.)
    const std::uint64_t moved =
        b.local_index != nullptr ? b.length_at(i) : x.t_->op <= TransferOp::write ? x.t_->length : 0;
    t.bytes += moved;
    const std::uint8_t path = x.path();
    if (path < detail::kSlicedPath) {
      auto& [bytes, n] = paths[path];
      bytes += moved;
      ++n;
    }
  }
  if (b.remaining.load(std::memory_order_acquire) == 0 && !b.note_only) {
    t.failed = static_cast<std::uint32_t>(b.failed.load(std::memory_order_acquire));
  }
  {
    std::lock_guard lock(b.mu);
    if (b.sliced_paths) {
      for (const auto& [path, v] : *b.sliced_paths) {
        paths[path].first += v.first;
        paths[path].second += v.second;
      }
    }
  }
  if (paths.empty()) return t;
  const detail::DriveGate& names = *b.gate;  // the engine's device names, fixed at its construction
  for (const auto& [path, v] : paths) {
    PathTelemetry p;
    p.bytes = v.first;
    p.transfers = v.second;
    p.device = path < names.device_names.size() ? names.device_names[path] : fmt::format("device {}", path);
    p.transport = path < names.rdma_devices ? "rdma" : p.device;
    t.paths.push_back(std::move(p));
  }
  std::stable_sort(t.paths.begin(), t.paths.end(),
                   [](const PathTelemetry& x, const PathTelemetry& y) { return x.bytes > y.bytes; });
  return t;
}

std::chrono::nanoseconds BatchTelemetry::post_time() const noexcept {
  return posted == std::chrono::steady_clock::time_point{} ? std::chrono::nanoseconds{0} : posted - submitted;
}

std::chrono::nanoseconds BatchTelemetry::total_time() const noexcept {
  return ended == std::chrono::steady_clock::time_point{} ? std::chrono::nanoseconds{0} : ended - submitted;
}

void Batch::cancel() const {
  if (!state_ || state_->remaining.load(std::memory_order_acquire) == 0) return;
  detail::BatchState& b = *state_;
  // The engine is alive while we are inside its gate: only for the posting (a shutdown waits
  // for whoever is inside). Closed: the engine is going, and ends every transfer itself.
  if (!b.gate->enter()) return;
  std::shared_ptr<detail::Handled> handled;
  try {
    handled = b.engine->cancel(state_);
  } catch (...) {
    b.gate->leave();
    throw;
  }
  b.gate->leave();
  // The workers count it down however they end (a shutdown drains their inboxes).
  if (handled) (void)handled->wait(detail::deadline_in(std::chrono::seconds{5}));
}

}  // namespace rdmakit
