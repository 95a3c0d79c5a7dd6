// SPDX-License-Identifier: Apache-2.0
// The engine's messages between linked engines (protocol.hpp).
#include "engine/protocol.hpp"

#include <algorithm>
#include <cerrno>
#include <string_view>

#include <fmt/format.h>

#include "bootstrap/socket.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail::engine_wire {

namespace {

constexpr Access kRemote = Access::remote_read | Access::remote_write | Access::remote_atomic;

void put(std::vector<std::uint8_t>& out, std::uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

struct Reader {
  std::span<const std::uint8_t> b;
  std::size_t at = 0;
  std::uint64_t get(int bytes, const char* field) {
    if (b.size() - at < static_cast<std::size_t>(bytes)) {
      throw Error("engine message", EPROTO, fmt::format("{} bytes end inside the {} field", b.size(), field));
    }
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v = (v << 8) | b[at++];
    return v;
  }
  // A length-prefixed field of one of `sizes` bytes.
  std::vector<std::uint8_t> bytes(std::initializer_list<std::size_t> sizes, const char* field) {
    const auto n = static_cast<std::size_t>(get(1, field));
    if (std::find(sizes.begin(), sizes.end(), n) == sizes.end()) {
      throw Error("engine message", EPROTO, fmt::format("{} of {} bytes", field, n));
    }
    if (b.size() - at < n) throw Error("engine message", EPROTO, fmt::format("the message ends inside the {}", field));
    std::vector<std::uint8_t> v(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
    return v;
  }
  std::string name() {
    const auto n = static_cast<std::size_t>(get(1, "name length"));
    if (n == 0 || n > kMaxName) throw Error("engine message", EPROTO, fmt::format("name of {} bytes (1..{})", n, kMaxName));
    if (b.size() - at < n) throw Error("engine message", EPROTO, "the message ends inside the name");
    std::string s(reinterpret_cast<const char*>(b.data() + at), n);
    at += n;
    check_name(s, "name");
    return s;
  }
};

void put_name(std::vector<std::uint8_t>& out, const std::string& name) {
  check_name(name, "name");
  out.push_back(static_cast<std::uint8_t>(name.size()));
  out.insert(out.end(), name.begin(), name.end());
}

}  // namespace

void check_name(const std::string& name, const char* what) {
  if (name.empty() || name.size() > kMaxName) {
    throw Error("engine", EINVAL, fmt::format("{} '{}' has {} bytes (1..{})", what, name, name.size(), kMaxName));
  }
  for (const char c : name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      throw Error("engine", EINVAL, fmt::format("{} has a control character", what));
    }
  }
}

std::string printable(std::span<const std::uint8_t> bytes) {
  std::string s(bytes.begin(), bytes.end());
  for (char& ch : s) {
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f) ch = '?';
  }
  return s;
}

Message lease_end(std::uint64_t lease, const std::string& reason) {
  Message m = refuse(reason);
  m.kind = Kind::lease_end;
  m.lease = lease;
  return m;
}

std::vector<std::uint8_t> encode(const Message& m, std::uint8_t version) {
  std::vector<std::uint8_t> out{kMagic, version, static_cast<std::uint8_t>(m.kind)};
  switch (m.kind) {
    case Kind::ident:
      put(out, m.epoch, 8);
      put_name(out, m.name);
      if ((!m.public_key.empty() && m.public_key.size() != kPublicKeySize) ||
          (!m.signature.empty() && m.signature.size() != kSignatureSize) || m.public_key.empty() != m.signature.empty()) {
        throw Error("engine ident", EINVAL, fmt::format("a public key of {} bytes and a signature of {}",
                                                        m.public_key.size(), m.signature.size()));
      }
      out.push_back(static_cast<std::uint8_t>(m.public_key.size()));
      out.insert(out.end(), m.public_key.begin(), m.public_key.end());
      out.push_back(static_cast<std::uint8_t>(m.signature.size()));
      out.insert(out.end(), m.signature.begin(), m.signature.end());
      break;
    case Kind::segment:
      put_name(out, m.name);
      put(out, m.region.addr, 8);
      put(out, m.region.length, 8);
      put(out, m.region.rkey, 4);
      put(out, static_cast<std::uint32_t>(m.region.access), 4);
      break;
    case Kind::withdraw: put_name(out, m.name); break;
    case Kind::synced:
    case Kind::credit: put(out, m.credits, 4); break;
    case Kind::active: put(out, m.moved, 8); break;
    case Kind::lease:
      if (m.ranges.empty() || m.ranges.size() > kLeaseRangesPerMessage) {
        throw Error("engine lease", EMSGSIZE, fmt::format("{} ranges in one message (1..{})", m.ranges.size(), kLeaseRangesPerMessage));
      }
      put(out, m.lease, 8);
      put(out, m.ttl_ms, 4);
      put(out, static_cast<std::uint32_t>(m.region.access), 4);
      put(out, m.lease_ranges, 4);
      put_name(out, m.name);
      put(out, m.region.addr, 8);
      out.push_back(static_cast<std::uint8_t>(m.ranges.size()));
      for (const LeaseWire& w : m.ranges) {
        put(out, w.offset, 8);
        put(out, w.length, 8);
        put(out, w.rkey, 4);
      }
      break;
    case Kind::renew:
    case Kind::renewed:
      put(out, m.lease, 8);
      put(out, m.ttl_ms, 4);
      break;
    case Kind::lease_end:
      put(out, m.lease, 8);
      [[fallthrough]];
    case Kind::refuse:
      if (m.bytes.empty() || m.bytes.size() > kMaxNotify) {
        throw Error("engine refusal", EMSGSIZE, fmt::format("a reason of {} bytes (1..{})", m.bytes.size(), kMaxNotify));
      }
      put(out, m.bytes.size(), 2);
      out.insert(out.end(), m.bytes.begin(), m.bytes.end());
      break;
    case Kind::notify:
      if (m.bytes.size() > kMaxNotify) {
        throw Error("engine notification", EMSGSIZE, fmt::format("{} bytes; at most {}", m.bytes.size(), kMaxNotify));
      }
      if (m.request_id.size() > kMaxRequestId) {
        throw Error("engine notification", EMSGSIZE,
                    fmt::format("a request id of {} bytes; at most {}", m.request_id.size(), kMaxRequestId));
      }
      put(out, m.bytes.size(), 2);
      out.insert(out.end(), m.bytes.begin(), m.bytes.end());
      put(out, m.request_id.size(), 1);
      out.insert(out.end(), m.request_id.begin(), m.request_id.end());
      break;
    case Kind::rails:
      if (m.rails.size() > kMaxRails) {
        throw Error("engine rails", EMSGSIZE, fmt::format("{} ports; at most {}", m.rails.size(), kMaxRails));
      }
      put(out, m.listen_port, 2);
      out.push_back(m.this_rail);
      out.push_back(static_cast<std::uint8_t>(m.rails.size()));
      for (const RailPort& r : m.rails) {
        put_name(out, r.device);
        out.push_back(r.port);
        out.push_back(static_cast<std::uint8_t>(r.link_layer));
        out.insert(out.end(), r.gid.begin(), r.gid.end());
        out.push_back(r.prefix);
        out.push_back(r.endpoint.empty() ? 0 : 1);
      }
      break;
  }
  return out;
}

Message decode(std::span<const std::uint8_t> bytes, std::uint8_t version) {
  Reader r{bytes};
  if (r.get(1, "magic") != kMagic) throw Error("engine message", EPROTO, "not an engine message (bad magic)");
  if (const auto v = r.get(1, "version"); v != version) {
    throw Error("engine message", EPROTO, fmt::format("version {} on a link that speaks {}", v, version),
                "a link keeps the engine protocol its handshake agreed: the peer is not rdmakit, or is broken");
  }
  Message m;
  const auto kind = r.get(1, "kind");
  switch (kind) {
    case 1:
      m.kind = Kind::ident;
      m.epoch = r.get(8, "epoch");
      m.name = r.name();
      m.public_key = r.bytes({0, kPublicKeySize}, "public key");
      m.signature = r.bytes({0, kSignatureSize}, "signature");
      if (m.public_key.empty() != m.signature.empty()) {
        throw Error("engine message", EPROTO, "an IDENT with a public key and no signature, or a signature and no key");
      }
      break;
    case 2: {
      m.kind = Kind::segment;
      m.name = r.name();
      m.region.addr = r.get(8, "addr");
      m.region.length = r.get(8, "length");
      m.region.rkey = static_cast<std::uint32_t>(r.get(4, "rkey"));
      const auto access = static_cast<std::uint32_t>(r.get(4, "access"));
      if ((access & ~static_cast<std::uint32_t>(kRemote)) != 0 || access == 0) {
        throw Error("engine message", EPROTO, fmt::format("segment '{}' access {:#x} (remote read, write, atomic only)", m.name, access));
      }
      m.region.access = static_cast<Access>(access);
      if (m.region.length == 0 || m.region.addr + m.region.length < m.region.addr) {
        throw Error("engine message", EPROTO, fmt::format("segment '{}' range {:#x}+{}", m.name, m.region.addr, m.region.length));
      }
      break;
    }
    case 3:
      m.kind = Kind::withdraw;
      m.name = r.name();
      break;
    case 4:
    case 7:
      m.kind = kind == 4 ? Kind::synced : Kind::credit;
      m.credits = static_cast<std::uint32_t>(r.get(4, "credits"));
      break;
    case 8:
      m.kind = Kind::active;
      m.moved = r.get(8, "moved");
      break;
    case 5: {
      m.kind = Kind::notify;
      const auto n = static_cast<std::size_t>(r.get(2, "notification length"));
      if (n > kMaxNotify || bytes.size() - r.at < n + 1) {
        throw Error("engine message", EPROTO, fmt::format("notification of {} bytes in a message with {} left", n, bytes.size() - r.at));
      }
      m.bytes.assign(bytes.begin() + static_cast<std::ptrdiff_t>(r.at), bytes.begin() + static_cast<std::ptrdiff_t>(r.at + n));
      r.at += n;
      const auto k = static_cast<std::size_t>(r.get(1, "request id length"));
      if (k > kMaxRequestId || bytes.size() - r.at != k) {
        throw Error("engine message", EPROTO, fmt::format("a request id of {} bytes in a message with {} left", k, bytes.size() - r.at));
      }
      m.request_id.assign(bytes.begin() + static_cast<std::ptrdiff_t>(r.at), bytes.end());
      r.at = bytes.size();
      break;
    }
    case 10: {
      m.kind = Kind::lease;
      m.lease = r.get(8, "lease");
      m.ttl_ms = static_cast<std::uint32_t>(r.get(4, "ttl"));
      const auto access = static_cast<std::uint32_t>(r.get(4, "access"));
      if ((access & ~static_cast<std::uint32_t>(kRemote)) != 0 || access == 0) {
        throw Error("engine message", EPROTO, fmt::format("lease {} access {:#x} (remote read, write, atomic only)", m.lease, access));
      }
      m.region.access = static_cast<Access>(access);
      m.lease_ranges = static_cast<std::uint32_t>(r.get(4, "lease ranges"));
      m.name = r.name();
      m.region.addr = r.get(8, "segment addr");
      const auto n = static_cast<std::size_t>(r.get(1, "range count"));
      if (n == 0 || n > kLeaseRangesPerMessage || n > m.lease_ranges) {
        throw Error("engine message", EPROTO, fmt::format("lease {}: {} ranges in a message of a lease of {}", m.lease, n, m.lease_ranges));
      }
      for (std::size_t i = 0; i < n; ++i) {
        LeaseWire w;
        w.offset = r.get(8, "range offset");
        w.length = r.get(8, "range length");
        w.rkey = static_cast<std::uint32_t>(r.get(4, "range rkey"));
        if (w.length == 0 || w.offset + w.length < w.offset || m.region.addr + w.offset + w.length < m.region.addr) {
          throw Error("engine message", EPROTO, fmt::format("lease {} range {}+{}", m.lease, w.offset, w.length));
        }
        m.ranges.push_back(w);
      }
      break;
    }
    case 12:
    case 13:
      m.kind = kind == 12 ? Kind::renew : Kind::renewed;
      m.lease = r.get(8, "lease");
      m.ttl_ms = static_cast<std::uint32_t>(r.get(4, "ttl"));
      break;
    case 11:
    case 9: {
      m.kind = kind == 9 ? Kind::refuse : Kind::lease_end;
      if (m.kind == Kind::lease_end) m.lease = r.get(8, "lease");
      const auto n = static_cast<std::size_t>(r.get(2, "reason length"));
      if (n == 0 || n > kMaxNotify || bytes.size() - r.at != n) {
        throw Error("engine message", EPROTO, fmt::format("a refusal of {} bytes in a message with {} left", n, bytes.size() - r.at));
      }
      m.bytes.assign(bytes.begin() + static_cast<std::ptrdiff_t>(r.at), bytes.end());
      r.at = bytes.size();
      break;
    }
    case 6: {
      m.kind = Kind::rails;
      m.listen_port = static_cast<std::uint16_t>(r.get(2, "listen port"));
      m.this_rail = static_cast<std::uint8_t>(r.get(1, "this rail"));
      const auto n = static_cast<std::size_t>(r.get(1, "rail count"));
      if (n > kMaxRails) throw Error("engine message", EPROTO, fmt::format("{} rails (at most {})", n, kMaxRails));
      if (m.this_rail != 0xff && m.this_rail >= n) {
        throw Error("engine message", EPROTO, fmt::format("this link's rail {} of {}", m.this_rail, n));
      }
      for (std::size_t i = 0; i < n; ++i) {
        RailPort p;
        p.device = r.name();
        p.port = static_cast<std::uint8_t>(r.get(1, "port"));
        const auto ll = r.get(1, "link layer");
        if (ll != 1 && ll != 2) throw Error("engine message", EPROTO, fmt::format("rail {} link layer {}", i, ll));
        p.link_layer = static_cast<LinkLayer>(ll);
        for (auto& b : p.gid) b = static_cast<std::uint8_t>(r.get(1, "gid"));
        p.prefix = static_cast<std::uint8_t>(r.get(1, "prefix"));
        if (p.prefix > (p.v4() ? 32 : 128)) throw Error("engine message", EPROTO, fmt::format("rail {} prefix /{}", i, p.prefix));
        const auto has = r.get(1, "has endpoint");
        if (has > 1) throw Error("engine message", EPROTO, fmt::format("rail {} endpoint flag {}", i, has));
        p.active = true;
        if (has == 1) {
          if (m.listen_port == 0) throw Error("engine message", EPROTO, "a rail endpoint without a listen port");
          p.endpoint = HostPort{p.address(), m.listen_port}.to_string();
        }
        m.rails.push_back(std::move(p));
      }
      break;
    }
    default: throw Error("engine message", EPROTO, fmt::format("unknown kind {}", kind));
  }
  if (r.at != bytes.size()) {
    throw Error("engine message", EPROTO, fmt::format("{} bytes after the end of the message", bytes.size() - r.at));
  }
  return m;
}

std::vector<std::uint8_t> ident_transcript(std::span<const std::uint8_t> binding, bool initiator, const std::string& name,
                                           std::uint64_t epoch, std::span<const std::uint8_t> public_key) {
  static constexpr std::string_view kLabel = "rdmakit engine ident v4";
  std::vector<std::uint8_t> out(kLabel.begin(), kLabel.end());
  out.insert(out.end(), binding.begin(), binding.end());
  out.push_back(initiator ? 'i' : 'a');
  put(out, epoch, 8);
  put_name(out, name);
  out.insert(out.end(), public_key.begin(), public_key.end());
  return out;
}

}  // namespace rdmakit::detail::engine_wire
