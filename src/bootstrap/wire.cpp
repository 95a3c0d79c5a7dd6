// SPDX-License-Identifier: Apache-2.0
#include "rdmakit/wire.hpp"

#include <cerrno>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::wire {
namespace {

constexpr std::uint32_t kQpnLimit = 1u << 24;
constexpr std::uint32_t kAccessMask = 0xf;

class Writer {
 public:
  explicit Writer(std::size_t reserve) { buf_.reserve(reserve); }
  void u8(std::uint8_t v) { buf_.push_back(v); }
  void u16(std::uint16_t v) { big_endian(v, 2); }
  void u32(std::uint32_t v) { big_endian(v, 4); }
  void u64(std::uint64_t v) { big_endian(v, 8); }
  void bytes(std::span<const std::uint8_t> b) { buf_.insert(buf_.end(), b.begin(), b.end()); }
  std::vector<std::uint8_t> take() { return std::move(buf_); }

 private:
  void big_endian(std::uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) buf_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  std::vector<std::uint8_t> buf_;
};

// Reads fixed-width big-endian fields; the caller checks the total length up front, so reads
// never run past the end.
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> b) : b_(b) {}
  std::uint8_t u8() { return b_[pos_++]; }
  std::uint16_t u16() { return static_cast<std::uint16_t>(big_endian(2)); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(big_endian(4)); }
  std::uint64_t u64() { return big_endian(8); }
  void bytes(std::span<std::uint8_t> out) {
    for (auto& o : out) o = b_[pos_++];
  }

 private:
  std::uint64_t big_endian(int n) {
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | b_[pos_++];
    return v;
  }
  std::span<const std::uint8_t> b_;
  std::size_t pos_ = 0;
};

[[noreturn]] void reject(std::string detail, std::string hint = {}) {
  throw Error("bootstrap decode", EBADMSG, std::move(detail), std::move(hint));
}

void check_qp(const QpAddress& q, std::size_t k) {
  if (q.qpn == 0 || q.qpn >= kQpnLimit) {
    reject(fmt::format("QP {}: QPN {:#x} out of range (1..0xffffff)", k, q.qpn),
           "the peer sent a corrupt or misaligned QPN");
  }
  if (q.psn >= kQpnLimit) reject(fmt::format("QP {}: PSN {:#x} does not fit in 24 bits", k, q.psn));
}

std::size_t max_payload(MessageType t) {
  return t == MessageType::sealed ? kMaxSealedPayload : kMaxPayload;
}

bool valid_mtu(std::uint32_t mtu) {
  return mtu == 256 || mtu == 512 || mtu == 1024 || mtu == 2048 || mtu == 4096;
}

}  // namespace

const char* to_string(MessageType type) noexcept {
  switch (type) {
    case MessageType::hello: return "HELLO";
    case MessageType::ready: return "READY";
    case MessageType::bye: return "BYE";
    case MessageType::reject: return "REJECT";
    case MessageType::user: return "USER";
    case MessageType::auth_challenge: return "AUTH_CHALLENGE";
    case MessageType::auth_response: return "AUTH_RESPONSE";
    case MessageType::auth_proof: return "AUTH_PROOF";
    case MessageType::sealed: return "SEALED";
    case MessageType::stream: return "STREAM";
  }
  return "?";
}

std::vector<std::uint8_t> encode_header(MessageType type, std::uint32_t length, std::uint16_t version) {
  Writer w(kHeaderSize);
  w.u32(kMagic);
  w.u16(version);
  w.u16(static_cast<std::uint16_t>(type));
  w.u32(length);
  return w.take();
}

std::vector<std::uint8_t> encode_hello(const EndpointInfo& info, std::uint16_t version) {
  if (info.qp_count() > kMaxQps) {
    throw Error("bootstrap encode", E2BIG, fmt::format("{} QPs; at most {}", info.qp_count(), kMaxQps));
  }
  for (std::size_t k = 0; k < info.qp_count() && info.carries_rdma(); ++k) {
    const QpAddress q = info.qp(k);
    if (q.qpn == 0 || q.qpn >= kQpnLimit || q.psn >= kQpnLimit) {
      throw Error("bootstrap encode", EINVAL,
                  fmt::format("QP {}: QPN {:#x} / PSN {:#x} do not fit in 24 bits", k, q.qpn, q.psn));
    }
  }
  const std::uint16_t flags = static_cast<std::uint16_t>((info.flags & ~kFlagTransports) | (info.transport ? kFlagTransports : 0));
  if ((flags & ~kKnownFlags) != 0) {
    throw Error("bootstrap encode", EINVAL, fmt::format("unknown capability flags {:#x}", info.flags));
  }
  if (info.regions.size() > kMaxRegions) {
    throw Error("bootstrap encode", E2BIG,
                fmt::format("{} regions advertised; at most {}", info.regions.size(), kMaxRegions));
  }
  if (info.transport && (info.transport->kinds.empty() || info.transport->kinds.size() > kMaxTransports ||
                         info.transport->socket.size() > kMaxSocketName)) {
    throw Error("bootstrap encode", EINVAL,
                fmt::format("{} transports listed (1..{}), a socket name of {} bytes (at most {})",
                            info.transport->kinds.size(), kMaxTransports, info.transport->socket.size(), kMaxSocketName));
  }
  const auto payload = static_cast<std::uint32_t>(
      kHelloFixedSize + info.extra_qps.size() * kQpSize + info.regions.size() * kRegionSize +
      (info.transport ? transport_block_size(version) + info.transport->kinds.size() + info.transport->socket.size() : 0));
  Writer w(kHeaderSize + payload);
  w.bytes(encode_header(MessageType::hello, payload, version));
  w.u32(info.qpn);
  w.u32(info.psn);
  w.u16(info.lid);
  w.u8(static_cast<std::uint8_t>(info.link_layer));
  w.u8(static_cast<std::uint8_t>(info.gid_type));
  w.bytes(info.gid);
  w.u32(info.gid_index);
  w.u16(static_cast<std::uint16_t>(info.mtu));
  w.u8(info.max_rd_atomic);
  w.u8(info.max_dest_rd_atomic);
  w.u16(static_cast<std::uint16_t>(info.regions.size()));
  w.u16(static_cast<std::uint16_t>(info.qp_count()));
  w.u16(flags);
  for (const QpAddress& q : info.extra_qps) {
    w.u32(q.qpn);
    w.u32(q.psn);
  }
  for (const auto& r : info.regions) {
    w.u64(r.addr);
    w.u64(r.length);
    w.u32(r.rkey);
    w.u32(static_cast<std::uint32_t>(r.access));
  }
  if (info.transport) {
    const TransportBlock& t = *info.transport;
    w.u8(static_cast<std::uint8_t>(t.kinds.size()));
    for (LinkTransport k : t.kinds) w.u8(static_cast<std::uint8_t>(k));
    w.bytes(t.host);
    w.u32(t.pid);
    w.u64(t.proof_addr);
    w.bytes(t.proof);
    w.bytes(t.token);
    w.u8(t.streams);
    if (version >= 7) w.u8(t.engine_protocol);
    w.u8(static_cast<std::uint8_t>(t.socket.size()));
    w.bytes({reinterpret_cast<const std::uint8_t*>(t.socket.data()), t.socket.size()});
  }
  return w.take();
}

std::vector<std::uint8_t> encode_stream(std::span<const std::uint8_t, kTokenSize> token, std::uint16_t index,
                                        std::uint16_t version) {
  Writer w(kHeaderSize + kStreamSize);
  w.bytes(encode_header(MessageType::stream, static_cast<std::uint32_t>(kStreamSize), version));
  w.bytes(token);
  w.u16(index);
  return w.take();
}

StreamHello decode_stream(std::span<const std::uint8_t> payload) {
  if (payload.size() != kStreamSize) {
    reject(fmt::format("STREAM of {} bytes ({} expected)", payload.size(), kStreamSize));
  }
  Reader r(payload);
  StreamHello s;
  r.bytes(s.token);
  s.index = r.u16();
  return s;
}

const char* to_string(LinkTransport t) noexcept {
  switch (t) {
    case LinkTransport::rdma: return "rdma";
    case LinkTransport::tcp: return "tcp";
    case LinkTransport::shm: return "shm";
  }
  return "unknown";
}

std::vector<std::uint8_t> encode_reject(std::string_view reason, std::uint16_t version) {
  reason = reason.substr(0, kMaxRejectReason);
  Writer w(kHeaderSize + reason.size());
  w.bytes(encode_header(MessageType::reject, static_cast<std::uint32_t>(reason.size()), version));
  w.bytes({reinterpret_cast<const std::uint8_t*>(reason.data()), reason.size()});
  return w.take();
}

Header decode_header(std::span<const std::uint8_t> bytes) {
  if (bytes.size() < kHeaderSize) {
    reject(fmt::format("truncated header: {} of {} bytes", bytes.size(), kHeaderSize));
  }
  Reader r(bytes);
  const std::uint32_t magic = r.u32();
  if (magic != kMagic) {
    reject(fmt::format("bad magic {:#010x} (expected {:#010x}, \"RDKT\")", magic, kMagic),
           "the peer is not an rdmakit endpoint, or the port belongs to another service");
  }
  const std::uint16_t version = r.u16();
  const std::uint16_t type = r.u16();
  const std::uint32_t length = r.u32();
  // A REJECT is read whatever its version (its layout never changes): so a listener too busy to
  // read a client's first message can refuse it in the oldest version it speaks, and clients of
  // every version it serves, and of versions after them, learn why.
  const bool any_reject = type == static_cast<std::uint16_t>(MessageType::reject) && length <= kMaxRejectReason;
  if (!speaks(version) && !any_reject) {
    // "protocol version" as version 6 worded it: a client of a newer version that reads it in
    // this side's REJECT (refused_version) connects again in this side's version.
    reject(fmt::format("protocol version mismatch: peer speaks {}, this side speaks {} and {}", version,
                       kPreviousVersion, kVersion),
           version < kPreviousVersion
               ? "each rdmakit speaks its own wire version and the one before (docs/compatibility.md): upgrade the peer"
               : "each rdmakit speaks its own wire version and the one before (docs/compatibility.md): the peer is "
                 "more than one version newer; upgrade this side");
  }
  if (type < 1 || type > kLastMessageType) reject(fmt::format("unknown message type {}", type));
  Header h{static_cast<MessageType>(type), length, version};
  if (h.length > max_payload(h.type)) {
    reject(fmt::format("oversized {} message: {} bytes (at most {})", to_string(h.type), h.length,
                       max_payload(h.type)));
  }
  return h;
}

std::optional<std::uint16_t> header_version(std::span<const std::uint8_t> bytes) noexcept {
  if (bytes.size() < kHeaderSize) return std::nullopt;
  Reader r(bytes);
  if (r.u32() != kMagic) return std::nullopt;
  return r.u16();
}

std::optional<Header> try_decode_header(std::span<const std::uint8_t> bytes) noexcept {
  if (bytes.size() < kHeaderSize) return std::nullopt;
  Reader r(bytes);
  const std::uint32_t magic = r.u32();
  const std::uint16_t version = r.u16();
  const std::uint16_t type = r.u16();
  const std::uint32_t length = r.u32();
  if (magic != kMagic || !speaks(version) || type < 1 || type > kLastMessageType ||
      length > max_payload(static_cast<MessageType>(type))) {
    return std::nullopt;
  }
  return Header{static_cast<MessageType>(type), length, version};
}

bool refused_version(const Header& h, std::string_view reason, std::uint16_t spoken) noexcept {
  return h.type == MessageType::reject && h.version < spoken && speaks(h.version) &&
         reason.find("protocol version") != std::string_view::npos;
}

EndpointInfo decode_hello(std::span<const std::uint8_t> payload, std::uint16_t version) {
  if (payload.size() < kHelloFixedSize) {
    reject(fmt::format("truncated HELLO: {} bytes, at least {} needed", payload.size(),
                       kHelloFixedSize));
  }
  // Read as it comes; the QP fields are checked once the transport block (last) says whether
  // they mean anything.
  Reader r(payload);
  EndpointInfo info;
  info.qpn = r.u32();
  info.psn = r.u32();
  info.lid = r.u16();
  const std::uint8_t link = r.u8();
  const std::uint8_t gid_type = r.u8();
  r.bytes(info.gid);
  info.gid_index = r.u32();
  info.mtu = r.u16();
  info.max_rd_atomic = r.u8();
  info.max_dest_rd_atomic = r.u8();
  const std::uint16_t count = r.u16();
  if (count > kMaxRegions) {
    reject(fmt::format("absurd region count {} (at most {})", count, kMaxRegions));
  }
  const std::uint16_t qps = r.u16();
  if (qps == 0 || qps > kMaxQps) reject(fmt::format("absurd QP count {} (1..{})", qps, kMaxQps));
  info.flags = r.u16();
  if ((info.flags & ~kKnownFlags) != 0) {
    reject(fmt::format("unknown capability flags {:#x}", info.flags & ~kKnownFlags),
           "the peer speaks a newer protocol revision");
  }
  const bool block = (info.flags & kFlagTransports) != 0;
  std::size_t want = kHelloFixedSize + (qps - 1u) * kQpSize + std::size_t{count} * kRegionSize;
  std::size_t kinds = 0, socket = 0;
  if (block) {
    if (payload.size() <= want) reject("truncated HELLO: its transport block is missing");
    kinds = payload[want];
    if (kinds == 0 || kinds > kMaxTransports) reject(fmt::format("absurd transport count {} (1..{})", kinds, kMaxTransports));
    want += transport_block_size(version) + kinds;
    if (payload.size() < want) reject(fmt::format("truncated HELLO: its transport block needs {} bytes, got {}", want, payload.size()));
    socket = payload[want - 1];
    if (socket > kMaxSocketName) reject(fmt::format("absurd socket name length {} (at most {})", socket, kMaxSocketName));
    want += socket;
  }
  if (payload.size() < want) {
    reject(fmt::format("truncated HELLO: QP count {} and region count {} need {} bytes, got {}", qps, count,
                       want, payload.size()));
  }
  if (payload.size() > want) {
    reject(fmt::format("HELLO has {} trailing bytes after QP count {} and region count {}",
                       payload.size() - want, qps, count));
  }
  std::vector<QpAddress> extra(qps - 1u);
  for (QpAddress& q : extra) {
    q.qpn = r.u32();
    q.psn = r.u32();
  }
  info.regions.reserve(count);
  for (std::uint16_t i = 0; i < count; ++i) {
    RemoteRegion reg;
    reg.addr = r.u64();
    reg.length = r.u64();
    reg.rkey = r.u32();
    const std::uint32_t access = r.u32();
    if (reg.addr + reg.length < reg.addr) {
      reject(fmt::format("region {}: address {:#x} + length {:#x} overflows", i, reg.addr, reg.length));
    }
    if ((access & ~kAccessMask) != 0) {
      reject(fmt::format("region {}: unknown access bits {:#x}", i, access & ~kAccessMask));
    }
    reg.access = static_cast<Access>(access);
    info.regions.push_back(reg);
  }
  if (block) {
    TransportBlock& t = info.transport.emplace();
    (void)r.u8();
    for (std::size_t k = 0; k < kinds; ++k) {
      const std::uint8_t v = r.u8();
      if (v < 1 || v > 3) reject(fmt::format("unknown transport {} (1 rdma, 2 tcp, 3 shm)", v), "the peer speaks a newer protocol revision");
      const auto kind = static_cast<LinkTransport>(v);
      if (t.has(kind)) reject(fmt::format("transport {} listed twice", to_string(kind)));
      t.kinds.push_back(kind);
    }
    r.bytes(t.host);
    t.pid = r.u32();
    t.proof_addr = r.u64();
    r.bytes(t.proof);
    r.bytes(t.token);
    t.streams = r.u8();
    t.engine_protocol = version >= 7 ? r.u8() : kEngineProtocolOfVersion6;
    (void)r.u8();
    t.socket.resize(socket);
    for (char& c : t.socket) {
      c = static_cast<char>(r.u8());
      if (c < 0x21 || c > 0x7e) reject("a socket name that is not printable ASCII");
    }
  }
  if (!info.carries_rdma()) {
    // No QP: the fields are zero, whatever the peer put there.
    info.qpn = info.psn = 0;
    info.link_layer = LinkLayer::ethernet;
    info.gid_type = GidType::roce_v2;
    return info;
  }
  if (link != 1 && link != 2) reject(fmt::format("unknown link layer {}", link));
  info.link_layer = static_cast<LinkLayer>(link);
  if (gid_type > 2) reject(fmt::format("unknown GID type {}", gid_type));
  info.gid_type = static_cast<GidType>(gid_type);
  if (!valid_mtu(info.mtu)) reject(fmt::format("invalid MTU {} (256, 512, 1024, 2048 or 4096)", info.mtu));
  check_qp({info.qpn, info.psn}, 0);
  for (std::size_t k = 0; k < extra.size(); ++k) check_qp(extra[k], k + 1);
  info.extra_qps = std::move(extra);
  return info;
}

std::string decode_reject(std::span<const std::uint8_t> payload) {
  std::string s;
  for (std::uint8_t c : payload) {
    if (c >= 0x20 && c < 0x7f) {
      s += static_cast<char>(c);
    } else {
      s += fmt::format("\\x{:02x}", c);
    }
  }
  return s;
}

void check_compatible(const EndpointInfo& local, const EndpointInfo& remote) {
  if (local.link_layer != remote.link_layer) {
    throw Error("bootstrap handshake", EPROTO,
                fmt::format("link layers differ: this side is {}, the peer is {}",
                            to_string(local.link_layer), to_string(remote.link_layer)),
                "InfiniBand and Ethernet (RoCE) ports cannot talk to each other; pick a device of "
                "the same kind on both hosts (--device)");
  }
  if (local.link_layer == LinkLayer::ethernet && local.gid_type != remote.gid_type) {
    throw Error("bootstrap handshake", EPROTO,
                fmt::format("RoCE versions differ: this side uses {}, the peer {}",
                            to_string(local.gid_type), to_string(remote.gid_type)),
                "choose GIDs of the same RoCE version on both hosts (--gid)");
  }
  // An IPv4 GID cannot reach an IPv6 one: refused here, with both addresses, instead of an
  // EINVAL from ibv_modify_qp (rxe) or a RETRY_EXC_ERR seconds after the first post (mlx5).
  if (local.link_layer == LinkLayer::ethernet) {
    const GidEntry l{local.gid_index, local.gid_type, local.gid, {}};
    const GidEntry r{remote.gid_index, remote.gid_type, remote.gid, {}};
    const bool l4 = l.kind() == GidKind::ipv4_mapped, r4 = r.kind() == GidKind::ipv4_mapped;
    if (l4 != r4) {
      throw Error("bootstrap handshake", EPROTO,
                  fmt::format("GID families differ: this side's GID [{}] {} is {}, the peer's [{}] {} is {}",
                              l.index, l.address(), l4 ? "IPv4" : "IPv6", r.index, r.address(),
                              r4 ? "IPv4" : "IPv6"),
                  "RoCE v2 packets of one address family never reach the other: choose GIDs of the "
                  "same family on both sides (--gid with the IPv4 address, or the index `rdmakit "
                  "devices` shows)");
    }
  }
  if (local.link_layer == LinkLayer::infiniband && remote.lid == 0) {
    throw Error("bootstrap handshake", EPROTO, "the InfiniBand peer has LID 0",
                "is a subnet manager (opensm) running on the fabric?");
  }
}

}  // namespace rdmakit::wire
