// SPDX-License-Identifier: Apache-2.0
// Descriptor lists (Engine::prepare_local, prepare_remote) and the submit that transfers
// selections of them by index: what a KV connector prepares once per peer (a descriptor per
// block and layer) and then moves a request's blocks by. Each position becomes a transfer of the
// batch, as submit(span) would have it; only the indices and the pairs' lengths are checked here.
#include <cerrno>
#include <limits>
#include <new>

#include <fmt/format.h>

#include "engine/impl.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

DescriptorList::DescriptorList(std::shared_ptr<detail::ListState> state) noexcept : state_(std::move(state)) {}

std::size_t DescriptorList::size() const noexcept {
  if (!state_) return 0;
  return state_->remote ? state_->remotes.size() : state_->local.size();
}

bool DescriptorList::remote() const noexcept { return state_ && state_->remote; }

namespace {

void check_count(std::size_t n, const char* verb) {
  if (n > std::numeric_limits<std::uint32_t>::max()) {
    throw Error(verb, EINVAL, fmt::format("{} descriptors in one list", n));
  }
}

}  // namespace

DescriptorList Engine::prepare_local(std::span<const LocalDescriptor> descriptors) {
  check_count(descriptors.size(), "prepare_local");
  auto s = std::make_shared<detail::ListState>();
  s->engine = impl_.get();
  s->epoch = impl_->epoch;
  s->local.assign(descriptors.begin(), descriptors.end());
  std::lock_guard lock(impl_->mu);  // no record goes while it is looked at
  for (std::size_t i = 0; i < descriptors.size(); ++i) {
    const LocalDescriptor& d = descriptors[i];
    const detail::BufferRec* b = impl_->buffer(d.buffer);
    std::string why;
    if (b == nullptr || b->retired.load(std::memory_order_relaxed)) {
      why = fmt::format("buffer {} (generation {:#x}) is not registered with this engine", d.buffer.id, d.buffer.generation);
    } else if (d.length == 0) {
      why = "0 bytes";
    } else if (d.offset > b->handle.length || d.length > b->handle.length - d.offset) {
      why = fmt::format("[{}, +{}) is outside the buffer of {} bytes", d.offset, d.length, b->handle.length);
    }
    if (!why.empty()) throw Error("prepare_local", EINVAL, fmt::format("descriptor {}: {}", i, why));
  }
  return DescriptorList(std::move(s));
}

DescriptorList Engine::prepare_remote(std::span<const RemoteDescriptor> descriptors) {
  check_count(descriptors.size(), "prepare_remote");
  auto s = std::make_shared<detail::ListState>();
  s->engine = impl_.get();
  s->epoch = impl_->epoch;
  s->remote = true;
  s->remotes.assign(descriptors.begin(), descriptors.end());
  std::lock_guard lock(impl_->mu);
  for (std::size_t i = 0; i < descriptors.size(); ++i) {
    const RemoteDescriptor& d = descriptors[i];
    const detail::Peer* p = impl_->peer(d.segment);
    std::string why;
    if (p == nullptr || p->removed.load(std::memory_order_relaxed)) {
      why = fmt::format("peer {} (generation {:#x}) is not a peer of this engine (removed, or a handle of another)",
                        d.segment.peer, d.segment.generation);
    } else if (d.segment.slot >= p->slots.load(std::memory_order_relaxed)) {
      why = fmt::format("segment slot {} of peer '{}' was never made by Engine::segment", d.segment.slot, p->name);
    } else if (d.length == 0) {
      why = "0 bytes";
    } else if (d.offset + d.length < d.offset) {
      why = fmt::format("[{}, +{}) wraps around", d.offset, d.length);
    }
    if (!why.empty()) throw Error("prepare_remote", EINVAL, fmt::format("descriptor {}: {}", i, why));
  }
  return DescriptorList(std::move(s));
}

Batch Engine::submit(TransferOp op, const DescriptorList& local, std::span<const std::uint32_t> local_indices,
                     const DescriptorList& remote, std::span<const std::uint32_t> remote_indices, SubmitOptions options) {
  const auto mine = [&](const DescriptorList& l) {
    return l.state_ && l.state_->engine == impl_.get() && l.state_->epoch == impl_->epoch;
  };
  if (!mine(local) || !mine(remote)) {
    throw Error("submit", EINVAL, "a DescriptorList of another engine, or an empty one (use prepare_local/prepare_remote)");
  }
  if (local.state_->remote || !remote.state_->remote) {
    throw Error("submit", EINVAL, "the local list must come from prepare_local and the remote one from prepare_remote");
  }
  if (op != TransferOp::read && op != TransferOp::write) {
    throw Error("submit", EINVAL, fmt::format("{} through descriptor lists: they move bytes (read or write)", to_string(op)));
  }
  if (local_indices.size() != remote_indices.size()) {
    throw Error("submit", EINVAL, fmt::format("{} local indices and {} remote ones: one of each per transfer",
                                              local_indices.size(), remote_indices.size()));
  }
  check_count(local_indices.size(), "submit");
  const std::vector<LocalDescriptor>& l = local.state_->local;
  const std::vector<RemoteDescriptor>& r = remote.state_->remotes;
  const auto n = static_cast<std::uint32_t>(local_indices.size());
  auto state = std::make_shared<detail::BatchState>(impl_.get(), n);
  detail::BatchState* const batch = state.get();
  Transfer* const t = state->owned;
  detail::Xfer* const x = state->x;
  for (std::uint32_t k = 0; k < n; ++k) {
    const std::uint32_t i = local_indices[k], j = remote_indices[k];
    if (i >= l.size() || j >= r.size()) [[unlikely]] {
      const bool bad_local = i >= l.size();
      throw Error("submit", EINVAL,
                  fmt::format("position {}: {} index {} is outside its list of {} descriptors", k,
                              bad_local ? "local" : "remote", bad_local ? i : j, bad_local ? l.size() : r.size()));
    }
    const LocalDescriptor& a = l[i];
    const RemoteDescriptor& b = r[j];
    if (a.length != b.length) [[unlikely]] {
      throw Error("submit", EINVAL,
                  fmt::format("position {}: local descriptor {} is {} bytes, remote descriptor {} is {}", k, i, a.length, j,
                              b.length));
    }
    new (x + k) detail::Xfer(*new (t + k) Transfer{.op = op, .local = a.buffer, .local_offset = a.offset, .length = a.length,
                                                 .remote = b.segment, .remote_offset = b.offset},
                             batch, k);
  }
  return impl_->launch(std::move(state), std::move(options));
}

}  // namespace rdmakit
