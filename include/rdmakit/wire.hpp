// SPDX-License-Identifier: Apache-2.0
#pragma once
// The bootstrap wire format, version 7 (and 6, the previous version, which this side still
// speaks to a peer that does: docs/compatibility.md). Every message is a 12-byte header followed
// by a payload; every field has a fixed width and network byte order, and the decoder checks
// each one. No C struct is ever copied onto the socket.
//
//   header:  magic u32 "RDKT" | version u16 | type u16 | payload length u32
//   HELLO:   qpn u32 | psn u32 | lid u16 | link layer u8 | gid type u8 | gid [16] |
//            gid index u32 | mtu u16 (bytes) | max_rd_atomic u8 | max_dest_rd_atomic u8 |
//            region count u16 | QP count u16 (1..16) | flags u16 | the QPs after the first:
//            qpn u32, psn u32 (each 8 bytes) | regions: addr u64, length u64, rkey u32,
//            access u32 (each 24 bytes) | with flag bit 1, a transport block: count u8 (1..8) |
//            transports u8 [count] (1 rdma, 2 tcp, 3 shm) | host [16] | pid u32 |
//            proof address u64 | proof [32] | token [32] | streams u8 | engine protocol u8
//            (version 7 only) | socket length u8 (0..100) | socket name
//
// Versions. A connection speaks one version, the client's, if the server speaks it too: the
// server answers in the version of the client's first message when it is its own or the one
// before, and refuses any other with a REJECT in its own version naming both. A client whose
// first message a server of the previous version refused that way connects again, once, in
// that version. After the first message, every message of the connection carries its version
// (sealed frames authenticate their header, so a version changed on the way fails to open).
// Version 7 adds the engine protocol byte to the transport block: a client's is the highest
// engine protocol it speaks, a server's the one the link speaks (a peer of version 6 speaks
// engine protocol 7). Version 6 added the transport block (engine links: the client's HELLO
// lists the transports it offers, best first, the server's names the one it chose; when rdma is
// not among them the HELLO's QP fields are zero and not read) and STREAM, the first message on
// a data stream of a tcp or shm link: token [32] | index u16 (the token is the server HELLO's,
// so a stream joins only the link whose sealed HELLO carried it). Version 5 added an ephemeral
// X25519 key to each side's nonce (forward secrecy; a session only its two ends can read, which
// engine identities sign); version 4 sealed everything after the key proof (SEALED below);
// version 3 added the flags (bit 0: the sender's device serves remote atomics; other bits are
// refused); version 2 the QP list (a connection may stripe over several QPs); version 1 had a
// reserved u16 where the QP count is.
//   READY, BYE: empty.   REJECT: a UTF-8 reason.   USER: application bytes.   STREAM: above.
//   With a pre-shared key K, before any HELLO (src/bootstrap/auth.cpp):
//   AUTH_CHALLENGE (client): hello_c = nonce_c [32] | X25519 public key e_c [32]
//   AUTH_RESPONSE (server):  hello_s = nonce_s [32] | e_s [32] |
//                            HMAC-SHA256(K, "rdmakit server" | hello_c | hello_s)
//   AUTH_PROOF (client):     HMAC-SHA256(K, "rdmakit client" | hello_c | hello_s)
//   After the proof, every message (HELLO, READY, BYE, REJECT, USER) travels as
//   SEALED: XChaCha20-Poly1305 of the whole inner message (its header and payload) | 16-byte tag,
//   with the outer header as associated data, the key of the sender's direction
//   (HKDF-SHA256 of K | X25519(e_c, e_s), salted with both hellos) and its sequence number as the
//   nonce (src/bootstrap/session.cpp). Without a key, messages travel as they are.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rdmakit/device.hpp"
#include "rdmakit/memory.hpp"

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit::wire {

inline constexpr std::uint32_t kMagic = 0x52444b54;  // "RDKT"
/// The version this side speaks first.
inline constexpr std::uint16_t kVersion = 7;
/// The previous version, which this side still speaks to a peer that does (and no other).
inline constexpr std::uint16_t kPreviousVersion = 6;
inline constexpr std::size_t kHeaderSize = 12;
inline constexpr std::size_t kHelloFixedSize = 42;
inline constexpr std::size_t kRegionSize = 24;
inline constexpr std::size_t kQpSize = 8;
/// Most QPs one connection may have.
inline constexpr std::size_t kMaxQps = 16;
/// Most regions one HELLO may advertise; more is refused as absurd.
inline constexpr std::size_t kMaxRegions = 1024;
/// Most transports a HELLO may list.
inline constexpr std::size_t kMaxTransports = 8;
inline constexpr std::size_t kTokenSize = 32;
inline constexpr std::size_t kMaxSocketName = 100;
// Without the transports (a byte each) and the socket's name; version 6's has no engine protocol byte.
inline constexpr std::size_t kTransportBlockSize = 1 + 16 + 4 + 8 + 32 + kTokenSize + 1 + 1 + 1;
[[nodiscard]] constexpr std::size_t transport_block_size(std::uint16_t version) noexcept {
  return version >= 7 ? kTransportBlockSize : kTransportBlockSize - 1;
}
inline constexpr std::size_t kStreamSize = kTokenSize + 2;
/// Largest payload accepted; checked from the header before any payload is read.
inline constexpr std::size_t kMaxPayload = kHelloFixedSize + (kMaxQps - 1) * kQpSize + kMaxRegions * kRegionSize +
                                           kTransportBlockSize + kMaxTransports + kMaxSocketName;
/// A SEALED frame carries a whole message (header and payload) and a 16-byte tag.
inline constexpr std::size_t kMaxSealedPayload = kHeaderSize + kMaxPayload + 16;

enum class MessageType : std::uint16_t {
  hello = 1,   ///< connection parameters (EndpointInfo)
  ready = 2,   ///< the sender's QP is in RTS: the peer may post
  bye = 3,     ///< orderly close: the sender will post nothing more
  reject = 4,  ///< the sender refuses the connection; the payload says why
  user = 5,    ///< an application message (Connection::send_message) on the control channel
  auth_challenge = 6,  ///< client's nonce (authenticated bootstrap)
  auth_response = 7,   ///< server's nonce and its proof of the key
  auth_proof = 8,      ///< client's proof of the key
  sealed = 9,          ///< any message after the key proof, encrypted and authenticated
  stream = 10,         ///< the first message on a data stream of a tcp or shm engine link
};
inline constexpr std::uint16_t kLastMessageType = 10;

struct Header {
  MessageType type = MessageType::hello;
  std::uint32_t length = 0;
  /// kVersion or kPreviousVersion (decode_header refuses others, but for a REJECT: any).
  std::uint16_t version = kVersion;
};

/// One QP's address: its number and the first packet sequence number it sends.
struct QpAddress {
  std::uint32_t qpn = 0;  ///< 24 bits, non-zero
  std::uint32_t psn = 0;  ///< 24 bits
  friend bool operator==(const QpAddress&, const QpAddress&) = default;
};

/// EndpointInfo::flags: the sender's device can serve remote atomics (as responder).
inline constexpr std::uint16_t kFlagAtomics = 1u << 0;
/// EndpointInfo::flags: a transport block follows the regions (EndpointInfo::transport).
inline constexpr std::uint16_t kFlagTransports = 1u << 1;
inline constexpr std::uint16_t kKnownFlags = kFlagAtomics | kFlagTransports;

/// How an engine link moves its data: RDMA on a NIC, or a software RC queue pair over TCP
/// streams, or over one stream with the data copied process to process on one host.
enum class LinkTransport : std::uint8_t { rdma = 1, tcp = 2, shm = 3 };

/// An engine link's transports, in its HELLO.
struct TransportBlock {
  /// The client's: what it offers, best first; the server's: the one it chose.
  std::vector<LinkTransport> kinds;
  /// shm, the client's: where it runs (a hash of its kernel's boot id, network and PID
  /// namespaces and user: equal only where a local socket reaches and a pid means the same
  /// process), and its pid (a claim: the server takes the kernel's word, the local socket's).
  std::array<std::uint8_t, 16> host{};
  std::uint32_t pid = 0;
  /// shm, the client's: 32 bytes at this address of its memory hash to `proof` (the server
  /// proves it shares the host, and may copy from this process, by reading them). 0: no proof,
  /// the client's data goes through a shared ring it sends after its stream's STREAM message.
  std::uint64_t proof_addr = 0;
  std::array<std::uint8_t, 32> proof{};
  /// The server's, for tcp and shm: what each data stream presents, and how many the client opens;
  /// for shm, the local socket (abstract namespace) its stream connects to.
  std::array<std::uint8_t, kTokenSize> token{};
  std::uint8_t streams = 0;
  std::string socket;
  /// Version 7: the client's, the highest engine protocol it speaks; the server's, the one the
  /// link speaks. A HELLO of version 6 has none (decoded as kEngineProtocolOfVersion6).
  std::uint8_t engine_protocol = 0;
  [[nodiscard]] bool has(LinkTransport t) const noexcept {
    for (LinkTransport k : kinds) {
      if (k == t) return true;
    }
    return false;
  }
  friend bool operator==(const TransportBlock&, const TransportBlock&) = default;
};
[[nodiscard]] const char* to_string(LinkTransport t) noexcept;

/// What one side of a connection tells the other.
struct EndpointInfo {
  std::uint32_t qpn = 0;  ///< the first (or only) QP: 24 bits, non-zero
  std::uint32_t psn = 0;  ///< 24 bits
  std::uint16_t lid = 0;
  LinkLayer link_layer = LinkLayer::ethernet;
  GidType gid_type = GidType::roce_v2;
  Gid gid{};
  std::uint32_t gid_index = 0;  ///< informational: the sender's own table index
  std::uint32_t mtu = 0;        ///< the sender port's active MTU in bytes
  std::uint8_t max_rd_atomic = 0;       ///< READs/atomics the sender will have in flight
  std::uint8_t max_dest_rd_atomic = 0;  ///< incoming READs/atomics the sender can serve
  std::uint16_t flags = 0;              ///< kFlag* capabilities
  /// The connection's other QPs, when it stripes over several (ConnectionConfig::qps).
  std::vector<QpAddress> extra_qps;
  std::vector<RemoteRegion> regions;
  /// Engine links (flags has kFlagTransports).
  std::optional<TransportBlock> transport;
  /// Whether the QP fields say anything: not when the transports offered (or chosen) leave rdma out.
  [[nodiscard]] bool carries_rdma() const noexcept { return !transport || transport->has(LinkTransport::rdma); }
  /// QP `k` of the connection (0: qpn/psn, then extra_qps).
  [[nodiscard]] QpAddress qp(std::size_t k) const noexcept {
    return k == 0 ? QpAddress{qpn, psn} : extra_qps[k - 1];
  }
  [[nodiscard]] std::size_t qp_count() const noexcept { return 1 + extra_qps.size(); }
  friend bool operator==(const EndpointInfo&, const EndpointInfo&) = default;
};

/// The engine protocol a peer of bootstrap version 6 speaks (its HELLO does not say).
inline constexpr std::uint8_t kEngineProtocolOfVersion6 = 7;

/// Whether this side speaks `version` (kVersion or kPreviousVersion).
[[nodiscard]] constexpr bool speaks(std::uint16_t version) noexcept {
  return version == kVersion || version == kPreviousVersion;
}

/// The 12-byte header of a message of `type` with `length` payload bytes, in `version`.
[[nodiscard]] std::vector<std::uint8_t> encode_header(MessageType type, std::uint32_t length,
                                                      std::uint16_t version = kVersion);
/// A whole HELLO message (header and payload) in `version`. Throws Error if `info` is not
/// encodable in it.
[[nodiscard]] std::vector<std::uint8_t> encode_hello(const EndpointInfo& info, std::uint16_t version = kVersion);
/// The longest reason a REJECT carries. A REJECT of at most this many bytes is read in any
/// version (decode_header), so every client can read every listener's refusal.
inline constexpr std::size_t kMaxRejectReason = 512;
/// A whole REJECT message; the reason is cut to kMaxRejectReason bytes.
[[nodiscard]] std::vector<std::uint8_t> encode_reject(std::string_view reason, std::uint16_t version = kVersion);

/// Validates and decodes a header: magic, a version this side speaks (a REJECT of at most
/// kMaxRejectReason bytes: any version), known type, payload length within limits. Throws Error
/// saying what was wrong (another version: naming both).
[[nodiscard]] Header decode_header(std::span<const std::uint8_t> bytes);
/// The version of a header with rdmakit's magic, whatever else it holds (nullopt: shorter than
/// kHeaderSize, or another magic).
[[nodiscard]] std::optional<std::uint16_t> header_version(std::span<const std::uint8_t> bytes) noexcept;
/// The same checks without an exception, and without decode_header's REJECT of any version (for
/// the data path, after the handshake): nullopt when the header is invalid
/// or shorter than kHeaderSize.
[[nodiscard]] std::optional<Header> try_decode_header(std::span<const std::uint8_t> bytes) noexcept;
/// Validates and decodes a HELLO payload of `version` (every field). Throws Error saying what
/// was wrong.
[[nodiscard]] EndpointInfo decode_hello(std::span<const std::uint8_t> payload, std::uint16_t version = kVersion);
/// Whether a REJECT (its header and reason) is a server's refusal of the version the client
/// spoke, from a server of the previous version: the client may connect again in that one.
[[nodiscard]] bool refused_version(const Header& reject, std::string_view reason, std::uint16_t spoken) noexcept;
/// A whole STREAM message: the link's token and the stream's index.
[[nodiscard]] std::vector<std::uint8_t> encode_stream(std::span<const std::uint8_t, kTokenSize> token, std::uint16_t index,
                                                      std::uint16_t version = kVersion);
struct StreamHello {
  std::array<std::uint8_t, kTokenSize> token{};
  std::uint16_t index = 0;
};
/// Validates and decodes a STREAM payload. Throws Error saying what was wrong.
[[nodiscard]] StreamHello decode_stream(std::span<const std::uint8_t> payload);
/// Decodes a REJECT payload (any bytes; non-printable ones are escaped).
[[nodiscard]] std::string decode_reject(std::span<const std::uint8_t> payload);

/// Throws Error if the two sides cannot talk: InfiniBand with Ethernet, RoCE v1 with v2, IB
/// without a LID.
void check_compatible(const EndpointInfo& local, const EndpointInfo& remote);

/// "HELLO", "READY", ...
[[nodiscard]] const char* to_string(MessageType type) noexcept;

}  // namespace rdmakit::wire
#pragma GCC visibility pop
