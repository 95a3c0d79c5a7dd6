// SPDX-License-Identifier: Apache-2.0
// Who may reach this engine's memory: revoke() and allow() (admission.hpp says how an entry
// matches a peer; Worker::check_identity admits links, Worker::revoke ends them).
#include <algorithm>
#include <cerrno>
#include <utility>

#include <fmt/format.h>

#include "engine/admission.hpp"
#include "engine/impl.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

void Engine::Impl::unpin(std::map<std::string, std::string>::iterator it) {
  if (const auto n = names_of_key.find(it->second); n != names_of_key.end() && --n->second == 0) names_of_key.erase(n);
  pinned_names.erase(it);
}

void Engine::revoke(const std::string& peer) {
  detail::check_peer_entry(peer, "revoke");
  {
    std::lock_guard lock(impl_->mu);
    if (std::find(impl_->revoked.begin(), impl_->revoked.end(), peer) == impl_->revoked.end()) {
      impl_->revoked.push_back(peer);
    }
    // A revoked key holds no name here any more: allowed again, it pins anew.
    const auto [name, key] = detail::split_entry(peer);
    const std::string& k = key.empty() ? name : key;
    for (auto it = impl_->pinned_names.begin(); it != impl_->pinned_names.end();) {
      const auto next = std::next(it);
      if (it->second == k && (key.empty() || it->first == name)) impl_->unpin(it);
      it = next;
    }
  }
  // After the entry is in: a link admitted meanwhile is ended by the command, one admitted
  // later meets the entry.
  for (auto& w : impl_->workers) w->post(detail::Command(detail::Command::Kind::revoke, nullptr, peer));
}

void Engine::allow(const std::string& peer) {
  detail::check_peer_entry(peer, "allow");
  std::lock_guard lock(impl_->mu);
  std::erase(impl_->revoked, peer);
  const auto [name, key] = detail::split_entry(peer);
  // NAME=KEY binds the name to that key from now on (a client that rotated its key).
  if (!key.empty()) {
    if (const auto it = impl_->pinned_names.find(name); it != impl_->pinned_names.end()) impl_->unpin(it);
    impl_->pinned_names.emplace(name, key);
    ++impl_->names_of_key[key];
  }
  // With an allow-list, the peer is let in, unless an entry already speaks of its name or key:
  // allow("kv-3") never widens "kv-3=KEY" to any holder of the name.
  if (impl_->allowed.empty()) return;
  const bool covered = std::any_of(impl_->allowed.begin(), impl_->allowed.end(), [&](const std::string& a) {
    const auto [an, ak] = detail::split_entry(a);
    return a == peer || an == name || (!key.empty() && (ak == key || an == key));
  });
  if (!covered) impl_->allowed.push_back(peer);
}

void Engine::expose(std::string name, const Buffer& buffer, Access access, std::vector<std::string> peers,
                    std::uint64_t offset, std::uint64_t length) {
  for (const std::string& p : peers) detail::check_peer_entry(p, "expose");
  if (!peers.empty() && !impl_->windows) {
    throw Error("expose", EOPNOTSUPP,
                fmt::format("segment '{}' for some peers only: device {} has no type-2 memory windows, so every peer "
                            "would get the buffer's own key, which reaches this segment too",
                            name, impl_->no_windows_device),
                "expose it for every peer, or use a NIC with type-2 memory windows");
  }
  impl_->expose(std::move(name), buffer, access, offset, length, std::move(peers));
}

}  // namespace rdmakit
