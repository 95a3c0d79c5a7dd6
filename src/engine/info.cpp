// SPDX-License-Identifier: Apache-2.0
// An engine's details as bytes for the application's own control plane (Engine::local_info),
// and a peer added from them: the same record a metadata store holds, carried by whatever side
// channel a serving system already has (vLLM's connectors send theirs over ZMQ).
#include <cerrno>

#include <fmt/format.h>

#include "engine/impl.hpp"
#include "engine/metadata.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

std::vector<std::uint8_t> Engine::local_info() const {
  const Impl& e = *impl_;
  if (e.cfg.listen.empty() || e.listening.load(std::memory_order_acquire) == nullptr) {
    throw Error("local_info", EADDRNOTAVAIL,
                fmt::format("engine '{}' {}: no peer could link to it", e.name,
                            e.cfg.listen.empty() ? "has no listener" : "is not listening yet"),
                e.cfg.listen.empty() ? "set EngineConfig::listen" : "call start_listening() first");
  }
  // Past what a record holds, the segments are not listed (the peer learns every one on its
  // link all the same): docs/engine.md says so; no log line per call.
  const std::string text = detail::metadata::encode(detail::engine_record(e));
  return {text.begin(), text.end()};
}

void Engine::add_peer(std::string name, std::span<const std::uint8_t> info) {
  // A record is at most about a MiB of segments and a few KiB besides: anything much larger
  // is not one, and is refused before it is parsed.
  constexpr std::size_t kMaxInfo = 2u << 20;
  const std::string where = fmt::format("the info given for peer '{}'", name);
  if (info.size() > kMaxInfo) {
    throw Error("add_peer", EPROTO, fmt::format("{}: {} bytes (an engine's info is at most {})", where, info.size(), kMaxInfo),
                "pass the bytes another engine's local_info() returned, unchanged");
  }
  const detail::metadata::EngineRecord r = detail::metadata::decode(
      std::string_view(reinterpret_cast<const char*>(info.data()), info.size()), where, name);
  if (r.endpoints.empty()) {
    throw Error("add_peer", EADDRNOTAVAIL, fmt::format("{}: engine '{}' lists no endpoint", where, r.name),
                "its info was taken before it listened, or it advertises none (MetadataConfig::advertise)");
  }
  if (r.public_key.empty() && impl_->psk) {
    // Nothing to bind it to: its first link's key will be pinned (trust on first use).
    impl_->cfg.link.log(fmt::format("engine {}: the info given for peer '{}' names no public key: the key its first "
                                    "link proves is pinned", impl_->name, name));
  }
  (void)impl_->add_peer(std::move(name), r.endpoints.front(), /*from_store=*/false, r.public_key, "info");
}

}  // namespace rdmakit
