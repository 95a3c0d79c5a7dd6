// SPDX-License-Identifier: Apache-2.0
// Rails: which ports a peer link may use (rails.hpp).
#include "engine/rails.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include <fmt/format.h>

#include "bootstrap/socket.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail {

namespace {

unsigned mask_bits(const sockaddr* mask) {
  if (mask == nullptr) return 0;
  if (mask->sa_family == AF_INET) {
    return static_cast<unsigned>(std::popcount(reinterpret_cast<const sockaddr_in*>(mask)->sin_addr.s_addr));
  }
  unsigned n = 0;
  for (const std::uint8_t b : reinterpret_cast<const sockaddr_in6*>(mask)->sin6_addr.s6_addr) n += static_cast<unsigned>(std::popcount(b));
  return n;
}

// The subnet bits of the interface address `want`; nullopt when no interface holds it.
std::optional<unsigned> prefix_of(const Ip16& want) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return std::nullopt;
  std::optional<unsigned> out;
  for (const ifaddrs* i = list; i != nullptr && !out; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    Ip16 have{};
    if (i->ifa_addr->sa_family == AF_INET) {
      have[10] = have[11] = 0xff;
      std::memcpy(have.data() + 12, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, 4);
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      std::memcpy(have.data(), &reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr, 16);
    } else {
      continue;
    }
    if (have == want) out = mask_bits(i->ifa_netmask);
  }
  ::freeifaddrs(list);
  return out;
}

bool mapped_v4(const Ip16& a) {
  static constexpr std::uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(a.data(), kPrefix, 12) == 0;
}

// `a` with every bit past `bits` (counted within the family) cleared.
Ip16 masked(Ip16 a, unsigned bits, bool v4) {
  const unsigned total = v4 ? 32 : 128;
  const unsigned from = v4 ? 12 : 0;
  for (unsigned i = std::min(bits, total); i < total; ++i) a[from + i / 8] &= static_cast<std::uint8_t>(~(0x80u >> (i % 8)));
  return a;
}

}  // namespace

bool wildcard_host(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "::" || host == "*"; }

bool wildcard_serves(const std::string& host, bool v4) { return wildcard_host(host) && (v4 || host != "0.0.0.0"); }

bool RailPort::v4() const noexcept { return mapped_v4(gid); }

std::string RailPort::address() const {
  std::string text = format_ip16(gid);
  if (v4() && text.rfind("::ffff:", 0) == 0) text.erase(0, 7);
  return text;
}

std::string RailPort::subnet() const {
  if (prefix == 0) return "unknown";
  std::string text = format_ip16(masked(gid, prefix, v4()));
  if (v4() && text.rfind("::ffff:", 0) == 0) text.erase(0, 7);
  return fmt::format("{}/{}", text, prefix);
}

std::string RailPort::describe() const {
  return fmt::format("{} port {} ({}, {})", device, port, address(), subnet());
}

bool reaches(const RailPort& a, const RailPort& b) noexcept {
  if (a.link_layer != b.link_layer || a.v4() != b.v4() || a.prefix == 0 || a.prefix != b.prefix) return false;
  return masked(a.gid, a.prefix, a.v4()) == masked(b.gid, b.prefix, b.v4());
}

std::vector<RailPort> local_rails(const std::vector<DeviceInfo>& catalog, const GidSelector& selector,
                                  const std::vector<std::string>& devices, std::uint16_t listen_port,
                                  const std::string& listen_host) {
  std::vector<RailPort> out;
  for (const DeviceInfo& d : catalog) {
    if (!devices.empty() && std::find(devices.begin(), devices.end(), d.name) == devices.end()) continue;
    for (const PortInfo& p : d.ports) {
      if (p.gids.empty()) continue;
      RailPort r;
      r.device = d.name;
      r.port = p.number;
      r.link_layer = p.link_layer;
      r.active = p.active;
      try {
        r.gid = choose_gid(p.gids, selector).entry.gid;
      } catch (const Error&) {
        continue;  // no usable GID on this port: not a rail
      }
      if (p.link_layer == LinkLayer::infiniband) {
        r.prefix = 64;  // the subnet prefix
      } else if (const auto bits = prefix_of(r.gid)) {
        r.prefix = static_cast<std::uint8_t>(*bits);
      }
      // A link on it is bootstrapped at its own address, which the listener must accept on.
      const bool link_local = r.gid[0] == 0xfe && (r.gid[1] & 0xc0) == 0x80;
      if (listen_port != 0 && r.active && p.link_layer == LinkLayer::ethernet && !link_local &&
          (wildcard_serves(listen_host, r.v4()) || parse_ip16(listen_host) == r.gid)) {
        r.endpoint = HostPort{r.address(), listen_port}.to_string();
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

RailMatch match_rails(const std::vector<RailPort>& local, const std::vector<RailPort>& peer,
                      const std::string& first_device, std::uint8_t first_port, std::optional<std::size_t> first_peer,
                      std::size_t max_extra) {
  RailMatch m;
  std::vector<int> used(peer.size(), 0);
  if (first_peer && *first_peer < peer.size()) ++used[*first_peer];
  std::string theirs;
  for (const RailPort& r : peer) theirs += fmt::format("{}{}{}", theirs.empty() ? "" : ", ", r.describe(), r.endpoint.empty() ? " without an endpoint" : "");
  for (const RailPort& l : local) {
    if (l.device == first_device && l.port == first_port) continue;  // the link's first rail
    if (!l.active) {
      m.unused.push_back({l.describe(), "the port is not ACTIVE"});
      continue;
    }
    std::optional<std::size_t> best;
    bool reachable = false;
    for (std::size_t i = 0; i < peer.size(); ++i) {
      if (!reaches(l, peer[i])) continue;
      reachable = true;
      if (peer[i].endpoint.empty()) continue;
      if (!best || used[i] < used[*best]) best = i;
    }
    if (!best) {
      m.unused.push_back({l.describe(), reachable ? fmt::format("the peer's port on {} has no endpoint (its listener is "
                                                                "bound to another address, or the port is down)", l.subnet())
                                                  : fmt::format("no port of the peer is on {} (its ports: {})", l.subnet(),
                                                                theirs.empty() ? "none" : theirs)});
      continue;
    }
    if (m.rails.size() >= max_extra) {
      m.unused.push_back({l.describe(), "past the engine's rail limit (RailConfig::max)"});
      continue;
    }
    ++used[*best];
    m.rails.push_back({l, peer[*best]});
  }
  return m;
}

}  // namespace rdmakit::detail
