// SPDX-License-Identifier: Apache-2.0
// Descriptor lists (Engine::prepare_local, prepare_remote) and the submit that transfers
// selections of them by index: what a KV connector prepares once per peer (a descriptor per
// block and layer) and then moves a request's blocks by. Prepared once: each local descriptor's
// SGE per device, each remote descriptor's peer. Submitted: the indices checked and copied, no
// transfer built. Posted by the peer's worker (worker_lists.cpp): each position's request from
// its local SGE and its remote target as checked for the link, two lookups and two 16-byte
// copies, a chain per batch as a plan's. What the lists cannot say (a buffer unregistered, a
// peer removed, lists over several peers, a position that fails a check) takes the long way of
// submit(span), its transfer built then, which says why.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <new>
#include <unordered_set>

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

// A batch's positions taken in one pass, four at a time with no branch per position (submit's
// only pass over them): the indices copied into the batch and checked against their lists'
// sizes (`last_local`, `last_remote`: the largest index in range), and each position's entry
// written (no transfer yet, the batch, its index, pending). False: an index is out of range.
bool take_positions(const std::uint32_t* li, const std::uint32_t* ri, std::uint32_t n, std::uint32_t last_local,
                    std::uint32_t last_remote, detail::BatchState& b) noexcept {
  // Compared as signed after flipping the top bit (what SSE2 compares): v > last, one compare.
  using V = std::int32_t __attribute__((vector_size(16)));
  constexpr std::uint32_t kTop = 0x80000000u;
  const auto flip = static_cast<std::int32_t>(kTop);
  const V top = {flip, flip, flip, flip};
  const auto bl = static_cast<std::int32_t>(last_local ^ kTop), br = static_cast<std::int32_t>(last_remote ^ kTop);
  const V lim_l = {bl, bl, bl, bl}, lim_r = {br, br, br, br};
  auto* const to_l = const_cast<std::uint32_t*>(b.local_index);
  auto* const to_r = const_cast<std::uint32_t*>(b.remote_index);
  // An entry is four words: the first three alike, the last its index (with tries, pending and
  // no path above it).
  // (Built on zeroed storage: their padding is zero, not whatever the stack held.)
  alignas(detail::Xfer) unsigned char proto[sizeof(detail::Xfer)] = {}, one[sizeof(detail::Xfer)] = {};
  new (proto) detail::Xfer(&b, 0);
  new (one) detail::Xfer(&b, 1);
  std::uint64_t w[4], w1[4];
  static_assert(sizeof w == sizeof(detail::Xfer));
  std::memcpy(w, proto, sizeof w);
  std::memcpy(w1, one, sizeof w1);
  if (w1[3] != (w[3] | 1) || w1[0] != w[0] || w1[1] != w[1] || w1[2] != w[2]) [[unlikely]] {  // a layout not as assumed
    for (std::uint32_t k = 0; k < n; ++k) new (b.x + k) detail::Xfer(&b, k);
    std::memcpy(to_l, li, std::size_t{n} * sizeof *li);
    std::memcpy(to_r, ri, std::size_t{n} * sizeof *ri);
    return std::all_of(li, li + n, [&](std::uint32_t i) { return i <= last_local; }) &&
           std::all_of(ri, ri + n, [&](std::uint32_t j) { return j <= last_remote; });
  }
  using Q = std::uint64_t __attribute__((vector_size(16)));
  const Q head = {w[0], w[1]};  // the first half of every entry (in a register, not reloaded)
  const std::uint64_t w2 = w[2], w3 = w[3];
  // Entry k at `e` (a pointer that moves on: no multiply per entry).
  auto put = [=](unsigned char* e, std::uint32_t k) {
    const std::uint64_t last = w3 | k;
    std::memcpy(e, &head, sizeof head);
    std::memcpy(e + 16, &w2, sizeof w2);
    std::memcpy(e + 24, &last, sizeof last);
  };
  constexpr std::size_t kSize = sizeof(detail::Xfer);
  auto* e = reinterpret_cast<unsigned char*>(b.x);
  V bad = {0, 0, 0, 0};
  std::uint32_t k = 0;
  for (; k + 4 <= n; k += 4, e += 4 * kSize) {
    V v, u;
    std::memcpy(&v, li + k, sizeof v);
    std::memcpy(&u, ri + k, sizeof u);
    std::memcpy(to_l + k, &v, sizeof v);
    std::memcpy(to_r + k, &u, sizeof u);
    bad -= (v ^ top) > lim_l;  // a compare is -1 where true: counts them (one instruction)
    bad -= (u ^ top) > lim_r;
    put(e, k);
    put(e + kSize, k + 1);
    put(e + 2 * kSize, k + 2);
    put(e + 3 * kSize, k + 3);
  }
  bool ok = (bad[0] | bad[1] | bad[2] | bad[3]) == 0;
  for (; k < n; ++k, e += kSize) {
    to_l[k] = li[k];
    to_r[k] = ri[k];
    ok &= li[k] <= last_local && ri[k] <= last_remote;
    put(e, k);
  }
  return ok;
}

}  // namespace

DescriptorList Engine::prepare_local(std::span<const LocalDescriptor> descriptors) {
  check_count(descriptors.size(), "prepare_local");
  auto s = std::make_shared<detail::ListState>();
  s->engine = impl_.get();
  s->epoch = impl_->epoch;
  s->local.assign(descriptors.begin(), descriptors.end());
  const std::size_t n = descriptors.size(), devices = impl_->device_count();
  s->sges.assign(devices * n, ibv_sge{});
  s->writable.assign(devices, 1);
  s->uniform_on.assign(devices, 1);
  s->uniform = n != 0 ? descriptors[0].length : 0;
  s->checked = std::make_unique<detail::ListState::Seen[]>(std::max<std::size_t>(impl_->workers.size(), 1));
  std::unordered_set<std::uint64_t> seen;  // buffers, (id, generation)
  std::lock_guard lock(impl_->mu);  // no record goes while it is looked at
  for (std::size_t i = 0; i < n; ++i) {
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
    if (d.length != s->uniform) s->uniform = 0;
    if (seen.insert(std::uint64_t{d.buffer.id} << 32 | d.buffer.generation).second) {
      s->buffers.emplace_back(d.buffer.id, d.buffer.generation);
    }
    // Its SGE on each device, as the data path would build it: memory the device does not reach
    // (a GPU's, on tcp or shm), or more than one SGE's 4 GiB, stays length 0 (the long way).
    for (std::size_t dev = 0; dev < devices; ++dev) {
      const LocalSlice* slice = dev < b->slices.size() ? &b->slices[dev] : nullptr;
      if (slice == nullptr || slice->length() == 0) {
        s->writable[dev] = 0;
        s->uniform_on[dev] = 0;
        continue;
      }
      if (!slice->writable()) s->writable[dev] = 0;
      if (d.length >= detail::kNoTarget) {  // over one SGE's reach (and never kNoTarget itself)
        s->uniform_on[dev] = 0;
        continue;
      }
      s->sges[dev * n + i] = {reinterpret_cast<std::uint64_t>(slice->addr()) + d.offset,
                              static_cast<std::uint32_t>(d.length), slice->lkey()};
    }
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
  std::unordered_set<std::uint32_t> slots;
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
    if (slots.insert(d.segment.slot).second) s->slots.push_back(d.segment.slot);
  }
  // One peer (NIXL's remote lists are one agent's): its worker posts every position the lists'
  // own way. Lists over several peers take the long way.
  const bool one = std::all_of(descriptors.begin(), descriptors.end(), [&](const RemoteDescriptor& d) {
    return d.segment.peer == descriptors[0].segment.peer && d.segment.generation == descriptors[0].segment.generation;
  });
  if (!descriptors.empty() && one) {
    s->peer = descriptors[0].segment.peer;
    s->peer_gen = descriptors[0].segment.generation;
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
  const std::size_t nl = local.state_->local.size(), nr = remote.state_->remotes.size();
  const auto n = static_cast<std::uint32_t>(local_indices.size());
  auto state = detail::make_batch(impl_.get(), n, true);
  // The batch's own copy of the indices (the caller's spans are theirs once submit returns),
  // checked as they are copied; the pairs' lengths are compared as each request is built.
  const bool in_range = nl != 0 && nr != 0 &&
                        take_positions(local_indices.data(), remote_indices.data(), n, static_cast<std::uint32_t>(nl - 1),
                                       static_cast<std::uint32_t>(nr - 1), *state);
  if (!in_range && n != 0) [[unlikely]] {
    for (std::uint32_t k = 0; k < n; ++k) {
      const std::uint32_t i = local_indices[k], j = remote_indices[k];
      if (i < nl && j < nr) continue;
      const bool bad_local = i >= nl;
      throw Error("submit", EINVAL,
                  fmt::format("position {}: {} index {} is outside its list of {} descriptors", k,
                              bad_local ? "local" : "remote", bad_local ? i : j, bad_local ? nl : nr));
    }
  }
  state->local_list = local.state_;
  state->remote_list = remote.state_;
  state->list_op = op;
  return impl_->launch(std::move(state), std::move(options));
}

namespace detail {

const Transfer& BatchState::build(Xfer& e) noexcept {
  e.t_ = new (owned + e.index) Transfer(transfer_at(e.index));
  return *e.t_;
}

std::string BatchState::pair_mismatch(std::uint32_t k) const {
  const std::uint32_t i = local_index[k], j = remote_index[k];
  const std::uint64_t have = local_list->local[i].length, want = remote_list->remotes[j].length;
  if (have == want) return {};
  return fmt::format("position {}: local descriptor {} is {} bytes, remote descriptor {} is {}", k, i, have, j, want);
}

Transfer BatchState::transfer_at(std::uint32_t i) const noexcept {
  if (local_index == nullptr) return *x[i].t_;
  const LocalDescriptor& a = local_list->local[local_index[i]];
  const RemoteDescriptor& b = remote_list->remotes[remote_index[i]];
  return Transfer{.op = list_op, .local = a.buffer, .local_offset = a.offset, .length = a.length, .remote = b.segment,
                  .remote_offset = b.offset};
}

}  // namespace detail

}  // namespace rdmakit
