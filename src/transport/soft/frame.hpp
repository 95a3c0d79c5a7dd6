// SPDX-License-Identifier: Apache-2.0
#pragma once
// The data streams' wire format, version 1: what one software RC queue pair (qp.hpp) sends the
// other over a byte stream (TCP) to do what a NIC does for RDMA: a WRITE, READ or atomic aimed
// at a memory window of the peer, and the peer's answer. Every frame starts with a 48-byte
// header, every field of fixed width in little-endian order (both ends are x86-64 or arm64 Linux
// hosts; the order is spelled out all the same, never a struct copied onto the wire):
//
//   version u8 (1) | op u8 | status u8 | reserved u8 (0) | length u32 | id u64 |
//   remote addr u64 | rkey u32 | reserved u32 (0) | arg0 u64 | arg1 u64
//
//   WRITE      request, followed by `length` bytes of data.
//   READ       request; its response carries `length` bytes.
//   FETCH_ADD  arg0 the addend; COMPARE_SWAP arg0 the expected value, arg1 the new one: length 8.
//   WRITE_CMA, READ_CMA  as WRITE and READ, but the data does not travel in the stream: the
//              responder copies it from (or to) the requester's address arg0 with cross-memory
//              attach (process_vm_readv/writev), both processes on one host (the shm transport).
//   WRITE_RING, READ_RING  as WRITE and READ, but the data is in the requester's shared ring
//              (src/transport/shm/ring.hpp) at offset arg0: the responder copies it from (or
//              to) there; shm where cross-memory attach is not used.
//   WRITE_MAP, READ_MAP  as WRITE and READ, but the data is in memory the requester shared with
//              the responder (SHARE): range arg0 at offset arg1; the responder copies between
//              its mapping of it and the window. Engine protocol 8 and later, shm only.
//   SHARE      range arg0 of arg1 bytes (soft/device.hpp, SharedRange): its memfd travels with
//              this frame's bytes (SCM_RIGHTS), the responder checks and maps it. Not answered.
//   UNSHARE    range arg0 goes: the responder unmaps it. Not answered.
//   RESPONSE   op | 0x80: the request's status (0 ok), the id it answers, an atomic's old value
//              in arg0, and a READ's data (`length` bytes, 0 on a refusal).
//
// A request's payload (and a response's) is at most kMaxChunk bytes: longer transfers travel as
// several requests (qp.hpp). The id is the requester's own; the responder echoes it, answering
// each stream's requests in order, and a response that does not answer the oldest outstanding
// request of its stream is a protocol error.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

namespace rdmakit::detail::soft {

inline constexpr std::uint8_t kFrameVersion = 1;
inline constexpr std::size_t kFrameSize = 48;
/// Most bytes one frame carries: longer requests are cut into chunks of this.
inline constexpr std::uint32_t kMaxChunk = 256u << 10;

enum class FrameOp : std::uint8_t {
  write = 1,
  read = 2,
  fetch_add = 3,
  compare_swap = 4,
  write_cma = 5,
  read_cma = 6,
  write_ring = 7,
  read_ring = 8,
  write_map = 9,
  read_map = 10,
  share = 11,
  unshare = 12,
};
inline constexpr std::uint8_t kResponse = 0x80;

/// What a response says of its request (as the NIC's completion status would).
enum class FrameStatus : std::uint8_t {
  ok = 0,
  access = 1,     ///< no window with that key on this link, outside it, or without the access
  invalid = 2,    ///< a malformed request (a misaligned atomic, a length over kMaxChunk)
  remote_op = 3,  ///< the responder could not do it (cross-memory attach failed)
};

struct Frame {
  std::uint8_t op = 0;  // FrameOp, or FrameOp | kResponse
  FrameStatus status = FrameStatus::ok;
  std::uint32_t length = 0;
  std::uint64_t id = 0;
  std::uint64_t raddr = 0;
  std::uint32_t rkey = 0;
  std::uint64_t arg0 = 0, arg1 = 0;
  [[nodiscard]] bool response() const noexcept { return (op & kResponse) != 0; }
  [[nodiscard]] FrameOp request_op() const noexcept { return static_cast<FrameOp>(op & ~kResponse); }
};

void encode(const Frame& f, std::span<std::uint8_t, kFrameSize> out) noexcept;
/// Nullopt for a header this version does not know: another version, an unknown op or status,
/// reserved bytes set, a length over kMaxChunk, an atomic request of other than 8 bytes.
[[nodiscard]] std::optional<Frame> decode(std::span<const std::uint8_t, kFrameSize> in) noexcept;

/// Whether `f` is a request that is never answered (SHARE, UNSHARE).
[[nodiscard]] inline bool unanswered(const Frame& f) noexcept {
  return !f.response() && (f.request_op() == FrameOp::share || f.request_op() == FrameOp::unshare);
}

/// Whether `op` is a crossing's WRITE or READ (crossing.hpp): its data is not in the stream.
static_assert(static_cast<int>(FrameOp::read_map) - static_cast<int>(FrameOp::write_cma) == 5,
              "a crossing's ops are numbered together (crossed())");
[[nodiscard]] inline bool crossed(FrameOp op) noexcept {
  return op >= FrameOp::write_cma && op <= FrameOp::read_map;
}

/// Whether the frame `f` is followed by `f.length` bytes of payload in the stream.
[[nodiscard]] inline bool carries_payload(const Frame& f) noexcept {
  const FrameOp op = f.request_op();
  return f.response() ? op == FrameOp::read && f.status == FrameStatus::ok : op == FrameOp::write;
}

}  // namespace rdmakit::detail::soft
