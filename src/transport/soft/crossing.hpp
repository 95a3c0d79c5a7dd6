// SPDX-License-Identifier: Apache-2.0
#pragma once
// How a software queue pair's data crosses when it does not travel in its stream: the seam where
// a same-host transport plugs into the queue pair (qp.hpp). Without a crossing (tcp) a WRITE's
// data follows its frame and a READ's comes back in its answer. A crossing turns a WRITE or READ
// into frames of its own ops that carry no data (frame.hpp) and has the responder move the bytes
// another way: shm's (src/transport/shm/crossing.hpp) by cross-memory attach, through a shared
// ring, or between the window and memory the requester shared; a CUDA IPC transport would be a
// crossing of GPU memory handles (its own folder, its ops added to frame.hpp's wire format). The
// queue pair keeps everything else: the order of requests and answers, the windows' checks,
// stalls, the error state and its drain.
//
// Threads: those of its queue pair (the owner of its Cq).

#include <cstddef>
#include <cstdint>

#include "transport/soft/frame.hpp"

namespace rdmakit::detail::soft {

class Qp;
class Stream;
struct Expect;
struct Request;

class Crossing {
 public:
  virtual ~Crossing() = default;

  /// Whether its frames keep to one stream (a queue pair with it takes exactly one): its control
  /// frames come before the requests that depend on them, or its room is freed in order.
  [[nodiscard]] virtual bool one_stream() const noexcept = 0;

  // --- the requester (the side that posts) ---

  /// The op the WRITE (`write`) or READ `r` goes as: FrameOp::write or read keep its data in the
  /// stream; an op of this crossing may set r.arg0 and r.arg1.
  virtual FrameOp op(Request& r, bool write) noexcept = 0;
  /// Before any request is framed on `s`: control frames owed to the peer queued first. False:
  /// no room for them now (nothing is framed until an answer or a send makes some).
  virtual bool before_requests(Stream& s) noexcept = 0;
  enum class Framed { later, queued, send_now };
  /// The frame of `r` at `offset`, `len` bytes, of one of this crossing's ops, about to be queued
  /// on `s`: its op (the crossing may change r.op at offset 0), arguments and what its answer
  /// frees (`e`), with anything that must precede it queued. `later`: not now (no room), nothing
  /// of the frame queued (control frames owed may have been); `send_now`: worth sending at once.
  virtual Framed frame(Stream& s, Request& r, std::uint32_t offset, std::uint32_t len, Frame& f, Expect& e) noexcept = 0;
  /// Frame `e` of `r` was answered ok: its data lands where the request wants it.
  virtual void answered_ok(const Expect& e, Request& r) noexcept = 0;
  /// Frame `e` was answered, whatever the answer said: what it held is free.
  virtual void release(const Expect& e) noexcept = 0;
  /// Request `r` completed ok.
  virtual void completed(const Request& r) noexcept = 0;
  /// This process's device changed what it shares (its Cq's poll); `s` is the stream (null when
  /// the queue pair failed). True: frames may wait on it to be sent.
  virtual bool shares_changed(Stream* s) noexcept = 0;
  /// Whether the peer may copy into or out of this process's memory while an answer is owed: a
  /// queue pair that fails then completes nothing before the peer stopped (Qp::fail()).
  [[nodiscard]] virtual bool peer_reaches_memory() const noexcept = 0;

  // --- the responder (the side that serves) ---

  /// Serves request `f` (one of this crossing's ops) from `s`, checking it with qp.check(): the
  /// answer's status (and arguments) in `a`. True: the answers queued should go now.
  virtual bool serve(Qp& qp, Stream& s, const Frame& f, Frame& a) noexcept = 0;
  /// A frame that is never answered (SHARE, UNSHARE). False: the queue pair failed (qp.fault()).
  virtual bool take(Qp& qp, Stream& s, const Frame& f) noexcept = 0;
  /// Whether the peer's bytes come with descriptors (the stream is read with recvmsg, and they
  /// wait on it for take()).
  [[nodiscard]] virtual bool takes_descriptors() const noexcept = 0;
  /// The link failed or goes: what this side holds of the peer's (mappings) goes.
  virtual void drop() noexcept = 0;

  /// For tests and reports: ranges of the peer's memory held here, and of this side's given.
  [[nodiscard]] virtual std::size_t peer_shares() const noexcept { return 0; }
  [[nodiscard]] virtual std::size_t given() const noexcept { return 0; }
};

}  // namespace rdmakit::detail::soft
