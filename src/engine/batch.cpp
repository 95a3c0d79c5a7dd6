// A batch of transfers: its shared state (ended by the workers, one transfer at a time) and the
// caller's Batch handle.
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "bootstrap/auth.hpp"
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

detail::BatchState::BatchState(Engine::Impl* e, std::span<const Transfer> t)
    : size(static_cast<std::uint32_t>(t.size())), engine(e) {
  // One allocation: the entries, then the copy of the transfers they point at. One loop (not a
  // memcpy, whose `rep movsb` callgrind would count byte by byte).
  static_assert(alignof(Transfer) <= alignof(Xfer));
  const std::size_t n = std::max<std::size_t>(t.size(), 1);
  x = static_cast<Xfer*>(::operator new(n * (sizeof(Xfer) + sizeof(Transfer))));
  owned = reinterpret_cast<Transfer*>(x + n);
  for (std::uint32_t i = 0; i < size; ++i) {
    new (x + i) Xfer(*new (owned + i) Transfer(t[i]), this, i);
    atomics |= t[i].op >= TransferOp::fetch_add;
  }
  remaining.store(size, std::memory_order_relaxed);
  if (e->workers.size() > 1) more = std::make_unique<WorkerShare[]>(e->workers.size() - 1);
}

detail::BatchState::~BatchState() {
  static_assert(std::is_trivially_destructible_v<Xfer> && std::is_trivially_destructible_v<Transfer>);
  if (!x_inline) ::operator delete(x);
}

void detail::BatchState::finish(Xfer& t, TransferStatus s, std::string reason) noexcept {
  if (t.status(std::memory_order_relaxed) != TransferStatus::pending) return;  // ended once
  if (s != TransferStatus::ok) {
    try {
      std::lock_guard lock(mu);
      reasons[t.index] = std::move(reason);
    } catch (...) {
      // Out of memory for the reason: the status still says what happened.
    }
    failed.fetch_add(1, std::memory_order_relaxed);
    engine->count.transfers_failed.fetch_add(1, std::memory_order_relaxed);
  }
  t.set_status(s, std::memory_order_release);
  if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) last_ended();
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

void detail::BatchState::finished_ok(std::uint32_t n) noexcept {
  if (remaining.fetch_sub(n, std::memory_order_acq_rel) == n) last_ended();
}

void detail::BatchState::last_ended() noexcept {
  // The callback first, so that wait() returning (and the descriptor) also means it has run.
  if (on_done) {
    try {
      on_done(Batch(shared_from_this()));
    } catch (...) {
      // A callback that throws must not take the worker down.
    }
  }
  {
    std::lock_guard lock(mu);  // a waiter between its check and its sleep would miss the notify
    callback_ran = true;
  }
  cv.notify_all();
  engine->signal();
}

Batch::Batch(std::shared_ptr<detail::BatchState> state) noexcept : state_(std::move(state)) {}
Batch::Batch(Batch&&) noexcept = default;
Batch& Batch::operator=(Batch&&) noexcept = default;
Batch::~Batch() = default;

bool Batch::done() const noexcept {
  return !state_ || state_->remaining.load(std::memory_order_acquire) == 0;
}

bool Batch::wait(std::chrono::milliseconds timeout) const {
  if (!state_) return true;
  std::unique_lock lock(state_->mu);
  return state_->cv.wait_for(lock, timeout, [this] { return state_->callback_ran; });
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
  const auto it = state_->reasons.find(static_cast<std::uint32_t>(i));
  return {st, it != state_->reasons.end() ? it->second : std::string{}};
}

std::string Batch::describe_failures() const {
  // Consecutive transfers that failed alike (a missing segment, a lost peer) are one line.
  std::string out;
  std::size_t first = 0;
  TransferResult run;
  auto flush = [&](std::size_t last) {
    if (run.status == TransferStatus::ok || run.status == TransferStatus::pending) return;
    const Transfer& t = *state_->x[first].t;
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

}  // namespace rdmakit
