// SPDX-License-Identifier: Apache-2.0
#pragma once
// The engine's messages between two linked engines, version 7. They travel as application
// messages on the link's control channel (sealed there when the link has a key), each at most
// Connection::max_message_size bytes, with fixed-width big-endian fields, every one checked:
//
//   header:   magic u8 0xE7 | version u8 | kind u8
//   IDENT:    epoch u64 | name length u8 (1..64) | name | key length u8 (0 or 32) | Ed25519 public
//             key | signature length u8 (0 or 64, as the key) | signature of ident_transcript():
//             the sender's name, epoch and key, its side of the link, and the session's binding
//   SEGMENT:  name length u8 (1..64) | name | addr u64 | length u64 | rkey u32 | access u32
//   WITHDRAW: name length u8 | name
//   SYNCED:   credits u32: every segment exposed when the link came up has been announced, and
//             the notifications the sender may have queued at the receiver at once
//   NOTIFY:   length u16 (0..900) | bytes | request id length u8 (0..64) | request id (one
//             credit): SubmitOptions::notify and ::request_id, or Engine::notify
//   CREDIT:   count u32: that many more notifications were taken by the application
//   ACTIVE:   (empty) the side that opened the link moved data on it lately: it is not idle,
//             whatever the accepting side (which sees no one-sided transfer) can tell
//   REFUSE:   length u16 (1..900) | UTF-8 reason: the accepting side will not serve this link
//             (its peer is revoked, not allowed, or not the key its name is bound to); it closes
//   RAILS:    listen port u16 | this link's rail u8 (0xff: none listed) | count u8 (0..16) |
//             count x { device length u8 (1..64) | device | port u8 | link layer u8 (1 IB, 2 Eth) |
//                       gid 16 bytes | prefix u8 | has endpoint u8 (0/1) }
//             the accepting side's ports that can carry rails (rails.hpp); a rail with an
//             endpoint is bootstrapped at its GID's address and the listen port.
//   LEASE:    lease u64 | ttl ms u32 | access u32 | ranges in the lease u32 | segment name |
//             segment addr u64 | count u8 (1..40) | count x { offset u64 | length u64 | rkey u32 }:
//             windows bound on this link for ranges of a segment (Engine::grant), in as many
//             messages as the lease has ranges / 40; the ttl counts from when it was granted
//   LEASE_END: lease u64 | length u16 (1..900) | UTF-8 reason: its windows on this link are gone
//   RENEW:    lease u64 | ttl ms u32 (0: release): from the holder (the side that opened the link)
//   RENEWED:  lease u64 | ttl ms u32: the lease now ends ttl from when this was sent
//
// The side that accepted a link binds a memory window per segment on the link's QP and
// announces it (SEGMENT); the side that initiated it is the only one that posts on it.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/rails.hpp"
#include "rdmakit/memory.hpp"

namespace rdmakit::detail::engine_wire {

inline constexpr std::uint8_t kMagic = 0xE7;
// 2: RAILS; 3: notification credits; 4: signed IDENT; 5: NOTIFY carries a request id; 6: leases
// 7: ACTIVE carries the bytes moved
inline constexpr std::uint8_t kVersion = 8;  // 8: shm links map the memory the initiator allocated
/// shm links of this version or later copy the initiator's allocated memory in one pass: the
/// target maps it (src/transport/soft/frame.hpp: SHARE, WRITE_MAP, READ_MAP). No message changed.
inline constexpr std::uint8_t kSharesFrom = 8;
/// The oldest this engine speaks. A link speaks the highest both engines do, agreed in its
/// bootstrap HELLOs (wire.hpp, version 7: the engine protocol byte; a peer of wire version 6
/// speaks 7); every message then carries it, and one in another version is refused.
inline constexpr std::uint8_t kMinVersion = 7;
inline constexpr std::size_t kMaxName = 64;
inline constexpr std::size_t kMaxNotify = 900;
inline constexpr std::size_t kMaxRequestId = 64;
inline constexpr std::size_t kMaxRails = 16;
inline constexpr std::size_t kLeaseRangesPerMessage = 40;

enum class Kind : std::uint8_t {
  ident = 1, segment = 2, withdraw = 3, synced = 4, notify = 5, rails = 6, credit = 7, active = 8, refuse = 9,
  lease = 10, lease_end = 11, renew = 12, renewed = 13
};

/// One range of a LEASE: an offset in the segment, its length, the window's key.
struct LeaseWire {
  std::uint64_t offset = 0, length = 0;
  std::uint32_t rkey = 0;
};

struct Message {
  Kind kind = Kind::ident;
  std::string name;            // ident, segment, withdraw
  std::uint64_t epoch = 0;     // ident
  std::vector<std::uint8_t> public_key;  // ident: empty (no identity) or 32 bytes
  std::vector<std::uint8_t> signature;   // ident: with the key, 64 bytes
  RemoteRegion region;         // segment
  std::vector<std::uint8_t> bytes;  // notify; refuse: the reason
  std::string request_id;           // notify
  std::uint32_t credits = 0;        // synced, credit
  std::uint16_t listen_port = 0;    // rails
  std::uint8_t this_rail = 0xff;    // rails
  std::vector<RailPort> rails;      // rails (endpoint: the address and listen_port, or empty)
  std::uint64_t lease = 0;          // lease, lease_end, renew, renewed
  std::uint32_t ttl_ms = 0;         // lease, renew, renewed
  std::uint32_t lease_ranges = 0;   // lease: how many ranges the whole lease has
  std::vector<LeaseWire> ranges;    // lease (name: the segment; region.addr and .access: its)
  std::uint64_t moved = 0;          // active: bytes the initiator's reads and writes moved on the link, in all
};

inline Message ident(std::string name, std::uint64_t epoch) {
  Message m;
  m.kind = Kind::ident;
  m.name = std::move(name);
  m.epoch = epoch;
  return m;
}

inline constexpr std::size_t kPublicKeySize = 32;
inline constexpr std::size_t kSignatureSize = 64;

/// What an IDENT's signature covers: a label, the link's session binding (Session::binding: no
/// other session has it, so a signature cannot be replayed on another link or relayed through a
/// key holder in the middle), the signer's side (`initiator`: it opened the link; so a
/// signature cannot be reflected), its epoch, name and public key.
[[nodiscard]] std::vector<std::uint8_t> ident_transcript(std::span<const std::uint8_t> binding, bool initiator,
                                                         const std::string& name, std::uint64_t epoch,
                                                         std::span<const std::uint8_t> public_key);
inline Message segment(std::string name, const RemoteRegion& r) {
  Message m;
  m.kind = Kind::segment;
  m.name = std::move(name);
  m.region = r;
  return m;
}
inline Message withdraw(std::string name) {
  Message m;
  m.kind = Kind::withdraw;
  m.name = std::move(name);
  return m;
}
inline Message synced(std::uint32_t credits) {
  Message m;
  m.kind = Kind::synced;
  m.credits = credits;
  return m;
}
inline Message active(std::uint64_t moved) {
  Message m;
  m.kind = Kind::active;
  m.moved = moved;
  return m;
}
/// Cut to kMaxNotify bytes.
inline Message refuse(const std::string& reason) {
  Message m;
  m.kind = Kind::refuse;
  m.bytes.assign(reason.begin(), reason.begin() + static_cast<std::ptrdiff_t>(std::min(reason.size(), kMaxNotify)));
  if (m.bytes.empty()) m.bytes.push_back('?');
  return m;
}
inline Message credit(std::uint32_t count) {
  Message m;
  m.kind = Kind::credit;
  m.credits = count;
  return m;
}
inline Message notify(std::vector<std::uint8_t> bytes, std::string request_id = {}) {
  Message m;
  m.kind = Kind::notify;
  m.bytes = std::move(bytes);
  m.request_id = std::move(request_id);
  return m;
}

inline Message rails(std::uint16_t listen_port, std::uint8_t this_rail, std::vector<RailPort> ports) {
  Message m;
  m.kind = Kind::rails;
  m.listen_port = listen_port;
  m.this_rail = this_rail;
  m.rails = std::move(ports);
  return m;
}

/// A peer's words (a refusal's, a lease end's reason) made printable: they end up in logs and in
/// TransferResult::reason.
[[nodiscard]] std::string printable(std::span<const std::uint8_t> bytes);

/// Cut to kMaxNotify bytes.
[[nodiscard]] Message lease_end(std::uint64_t lease, const std::string& reason);
inline Message renew(Kind kind, std::uint64_t lease, std::uint32_t ttl_ms) {
  Message m;
  m.kind = kind;
  m.lease = lease;
  m.ttl_ms = ttl_ms;
  return m;
}

/// In the link's `version` (kMinVersion..kVersion). Throws Error for a name or payload out of range.
[[nodiscard]] std::vector<std::uint8_t> encode(const Message& m, std::uint8_t version = kVersion);
/// Validates and decodes a message of a link that speaks `version`; throws Error saying what
/// was wrong (a message in another version: naming both).
[[nodiscard]] Message decode(std::span<const std::uint8_t> bytes, std::uint8_t version = kVersion);
/// Throws Error unless `name` is 1..64 bytes with no control characters.
void check_name(const std::string& name, const char* what);

}  // namespace rdmakit::detail::engine_wire
