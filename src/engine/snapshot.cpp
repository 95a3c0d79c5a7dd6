// SPDX-License-Identifier: Apache-2.0
// Engine::metrics() and Engine::health(): a snapshot of the engine's figures (metrics.hpp),
// read from the counters, the workers' per-path figures and the registries, without any lock
// the data path takes (the registries' mutex is the one peers() and info() take).
#include <fmt/format.h>

#include "engine/impl.hpp"
#include "engine/metadata.hpp"
#include "engine/metrics.hpp"

namespace rdmakit {

std::string Engine::metrics(const MetricsOptions& options) const {
  detail::MetricsSnapshot s;
  s.engine = impl_->name;
  s.counters = counters();
  s.submits_ended = impl_->count.submits_ended.load(std::memory_order_relaxed);
  s.peers = peers();
  s.listening = port() != 0;
  s.telemetry = impl_->cfg.telemetry;
  // Per path: each worker's figures summed (a worker serves the links of its devices, but a
  // peer's rails may span devices of several).
  for (std::uint32_t d = 0; d < impl_->device_count(); ++d) {
    detail::MetricsSnapshot::Path p;
    p.name = impl_->device_name(d);
    p.transport = impl_->is_soft(d) ? p.name : "rdma";
    for (const auto& w : impl_->workers) {
      const detail::PathFigures* f = w->figures(d);
      if (f == nullptr) continue;
      p.bytes += f->bytes.load(std::memory_order_relaxed);
      p.transfers += f->transfers.load(std::memory_order_relaxed);
    }
    // A transport the engine does not offer has no links: left out rather than shown at zero.
    if (impl_->is_soft(d) && p.transfers == 0 && !impl_->offers(impl_->soft_kind(d))) {
      continue;
    }
    s.paths.push_back(std::move(p));
  }
  for (std::size_t i = 0; i < s.failed.size(); ++i) s.failed[i] = impl_->failed_by_status[i].load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < s.batch_buckets.size(); ++i) {
    s.batch_buckets[i] = impl_->batch_latency.counts[i].load(std::memory_order_relaxed);
  }
  s.batch_sum_ns = impl_->batch_latency.sum_ns.load(std::memory_order_relaxed);
  for (std::size_t i = 0; i < s.submitted.size(); ++i) s.submitted[i] = impl_->submitted.at[i].load(std::memory_order_relaxed);
  {
    std::lock_guard lock(impl_->listen_mu);
    if (const Listener* l = impl_->listener.get()) {
      const Listener::Refusals r = l->refusals();
      s.refusals.busy = r.busy;
      s.refusals.auth = r.auth;
      s.refusals.protocol = r.protocol;
      s.refusals.other = r.other;
    }
  }
  s.refusals.identity = impl_->refused_identity.load(std::memory_order_relaxed);
  if (impl_->meta) {
    const auto h = impl_->meta->health();
    s.store = true;
    s.published = h.published;
    s.store_failing = !h.failure.empty();
    s.store_errors = h.failures;
    s.store_known = h.known;
  }
  {
    std::lock_guard lock(impl_->mu);
    for (const auto& b : impl_->buffers) {
      if (!b || b->retired.load(std::memory_order_relaxed)) continue;
      const std::string kind = to_string(b->kind);
      auto it = std::find_if(s.memory.begin(), s.memory.end(), [&](const auto& m) { return m.kind == kind; });
      if (it == s.memory.end()) it = s.memory.insert(s.memory.end(), {kind, 0, 0});
      ++it->buffers;
      it->bytes += b->handle.length;
    }
  }
 {
    std::lock_guard lock(impl_->served_mu);
    s.served.assign(impl_->served.begin(), impl_->served.end());
  }
  s.leases_active = s.counters.leases_granted - std::min(s.counters.leases_granted, s.counters.leases_ended);
  std::lock_guard lock(impl_->metrics_mu);
  if (impl_->rest_floors.size() > 64) impl_->rest_floors.clear();  // callers that vary top_peers
  return detail::render_metrics(s, options, &impl_->rest_floors[options.top_peers]);
}

EngineHealth Engine::health() const {
  if (!impl_->cfg.listen.empty() && port() == 0) {
    return {false, impl_->cfg.listen_at_start ? "the listener is not up" : "not listening yet (start_listening())"};
  }
  if (impl_->meta) {
    const auto h = impl_->meta->health();
    if (!h.failure.empty()) return {false, fmt::format("metadata store {}: {}", impl_->meta->shown(), h.failure)};
    if (!h.published) return {false, fmt::format("metadata store {}: this engine's record is not published yet", impl_->meta->shown())};
  }
  return {true, {}};
}

}  // namespace rdmakit
