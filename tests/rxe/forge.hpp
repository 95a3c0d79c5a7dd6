// SPDX-License-Identifier: Apache-2.0
#pragma once
// The library's own handshake hook (connection/impl.hpp, not public API), for tests that play a
// peer whose parameters are corrupt or forged: the peer's HELLO is altered before it is used.
#include <functional>
#include <string>

#include "connection/impl.hpp"

namespace lab {

using Alter = std::function<void(rdmakit::wire::EndpointInfo&)>;

inline rdmakit::Connection connect_altered(const std::string& to, const rdmakit::ConnectionConfig& cfg,
                                           const rdmakit::Connection::Setup& setup, Alter alter) {
  rdmakit::detail::HandshakeHooks hooks;
  hooks.peer_hello = std::move(alter);
  return rdmakit::Connection::Impl::connect(to, cfg, setup, hooks);
}

/// The client believes the peer advertised another rkey for its first region, so its posts pass
/// every local check and the peer's NIC refuses them.
inline Alter forged_rkey() {
  return [](rdmakit::wire::EndpointInfo& peer) { peer.regions.at(0).rkey ^= 0x5a5a00; };
}

}  // namespace lab
