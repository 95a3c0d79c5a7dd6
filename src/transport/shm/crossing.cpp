// SPDX-License-Identifier: Apache-2.0
// shm's crossing (crossing.hpp): the requester's side (which way each WRITE and READ goes, the
// ring's room, the ranges given to the peer and taken back) and the responder's (the copies,
// the peer's ranges mapped).
#include "transport/shm/crossing.hpp"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "rdmakit/error.hpp"
#include "transport/soft/qp.hpp"
#include "transport/soft/stream.hpp"

namespace rdmakit::detail::shm {

using soft::Expect;
using soft::Frame;
using soft::FrameOp;
using soft::FrameStatus;
using soft::Request;
using soft::SharedRange;
using soft::Stream;

Crossing::Crossing(soft::Device& dev, CrossingConfig cfg) : dev_(dev), cfg_(std::move(cfg)) {
  // A requester's ring holds two chunks at least: a frame that does not fit before the ring's
  // end always fits after it once the frames before it are answered.
  if (cfg_.ring && (cfg_.ring->size() < (cfg_.asks ? 2 : 1) * std::size_t{soft::kMaxChunk} || cfg_.ring->size() > kRingMax)) {
    throw Error("shm link", EINVAL, "an shm ring takes two frames' chunks to 64 MiB");
  }
}

Crossing::~Crossing() { drop(); }

void Crossing::drop() noexcept {  // (idempotent: a failed link's, then its queue pair's end)
  for (const auto& [id, m] : maps_) dev_.give_back_map(m.size());
  maps_.clear();
}

// --- the requester ---------------------------------------------------------------------------------

FrameOp Crossing::op(Request& r, bool write) noexcept {
  if (!cfg_.asks) return write ? FrameOp::write : FrameOp::read;
  if (cfg_.shares && r.length > 0) {
    if (const SharedRange* sr = shared_at(r.laddr, r.length)) {
      r.arg0 = sr->id;
      r.arg1 = r.laddr - sr->base;
      return write ? FrameOp::write_map : FrameOp::read_map;
    }
  }
  return cfg_.ring ? (write ? FrameOp::write_ring : FrameOp::read_ring) : (write ? FrameOp::write_cma : FrameOp::read_cma);
}

bool Crossing::look_again() noexcept {
  // The count first, then the ranges: a change between the two is seen again at the next look.
  const std::uint64_t g = dev_.shares_changed();
  if (g == shares_seen_) return true;
  try {
    shares_ = dev_.shares();
    shares_seen_ = g;
  } catch (...) {
    return false;
  }
  return true;
}

const SharedRange* Crossing::shared_at(std::uint64_t addr, std::uint64_t len) noexcept {
  if (!look_again()) return nullptr;  // (a mutex that failed): this request goes the other way
  const SharedRange* r = range_at(addr);
  if (r == nullptr || r->length > kMaxShare || addr - r->base > r->length || len > r->length - (addr - r->base)) {
    return nullptr;
  }
  // Past max_given ranges on this link, a range not given yet goes the other way (frame() looks
  // again: the requests of one chain are all taken before any is given).
  return given_.size() < cfg_.max_given || given_.contains(r->id) ? r : nullptr;
}

const std::shared_ptr<const SharedRange>* Crossing::entry_at(std::uint64_t addr) const noexcept {
  if (!shares_) return nullptr;
  const auto& v = *shares_;
  auto it = std::upper_bound(v.begin(), v.end(), addr, [](std::uint64_t a, const auto& e) { return a < e->base; });
  return it == v.begin() ? nullptr : &*--it;
}

const SharedRange* Crossing::range_at(std::uint64_t addr) const noexcept {
  const auto* e = entry_at(addr);
  return e != nullptr ? e->get() : nullptr;
}

bool Crossing::give(Stream& s, std::uint64_t id, std::uint64_t addr) noexcept {
  if (!take_back(s)) return false;
  if (given_.contains(id)) return true;
  if (!s.room_for_control(2)) return false;  // the SHARE and the request after it
  // The device's ranges as they are now: the list op() looked at may have been dropped since
  // (another range went while this link had given none: shares_changed()).
  if (!look_again()) return false;  // (a mutex that failed): tried again at the next issue
  // The range is found where the request's memory is (ranges do not overlap): the one of `id`
  // if the device still shares it.
  std::shared_ptr<const SharedRange> range;
  if (const auto* e = entry_at(addr); e != nullptr && (*e)->id == id) range = *e;
  // Unshared under a request of it (the application unregistered memory a transfer still
  // used): its frame names a range the peer never had, and is refused.
  if (!range) return true;
  try {
    given_.emplace(id, range);
  } catch (...) {
    return false;
  }
  Frame f;
  f.op = static_cast<std::uint8_t>(FrameOp::share);
  f.arg0 = id;
  f.arg1 = range->length;
  s.push_out(f, false).share = std::move(range);
  return true;
}

bool Crossing::take_back(Stream& s) noexcept {
  while (!ungiven_.empty()) {
    if (!s.room_for_control(1)) return false;
    Frame f;
    f.op = static_cast<std::uint8_t>(FrameOp::unshare);
    f.arg0 = ungiven_.back();
    (void)s.push_out(f, false);
    given_.erase(ungiven_.back());
    ungiven_.pop_back();
  }
  return true;
}

bool Crossing::shares_changed(Stream* s) noexcept {
  if (!cfg_.shares) return false;
  if (given_.empty() || s == nullptr) {
    // Nothing to tell the peer; the old list goes (it holds the ranges' descriptors, and with
    // them the memory of buffers unregistered since), read again at the next request.
    shares_.reset();
    shares_seen_ = ~std::uint64_t{0};
    return false;
  }
  if (!look_again()) return false;  // the peer keeps its mappings until the next change, or the link's end
  try {
    for (const auto& [id, range] : given_) {
      const SharedRange* now = range_at(range->base);
      const bool still = now != nullptr && now->id == id;
      if (!still && std::find(ungiven_.begin(), ungiven_.end(), id) == ungiven_.end()) ungiven_.push_back(id);
    }
  } catch (...) {
    return false;  // out of memory: the peer keeps its mapping until the next change, or the link's end
  }
  return take_back(*s);
}

Crossing::Framed Crossing::frame(Stream& s, Request& r, std::uint32_t offset, std::uint32_t len, Frame& f, Expect& e) noexcept {
  const bool mapped = r.op == FrameOp::write_map || r.op == FrameOp::read_map;
  if (mapped && offset == 0 && !given_.contains(r.arg0) && given_.size() >= cfg_.max_given) {
    // The link's ranges are all given (a chain named more than it had left): this one goes the
    // way of memory that is not shared.
    const bool write = r.op == FrameOp::write_map;
    r.op = cfg_.ring ? (write ? FrameOp::write_ring : FrameOp::read_ring) : (write ? FrameOp::write_cma : FrameOp::read_cma);
    r.arg0 = r.arg1 = 0;
  }
  f.op = static_cast<std::uint8_t>(r.op);
  switch (r.op) {
    case FrameOp::write_map:
    case FrameOp::read_map:
      if (!give(s, r.arg0, r.laddr)) return Framed::later;  // its range first, once per link
      f.arg0 = r.arg0;
      f.arg1 = r.arg1 + offset;
      return Framed::queued;
    case FrameOp::write_ring:
    case FrameOp::read_ring: {
      // Its room in the ring: contiguous (the end's remainder skipped when it is short), freed
      // as its answer comes. (A ring op only with a ring: op() and the conversion above.) The
      // ring's frames all go on its one stream, answered in order: their room is freed in order.
      const std::size_t size = cfg_.ring->size();
      std::uint64_t at = ring_tail_;
      std::size_t ring_off = 0;
      if (len > 0) {
        ring_off = static_cast<std::size_t>(at % size);
        if (ring_off + len > size) {
          at += size - ring_off;
          ring_off = 0;
        }
        if (at + len - ring_head_ > size) return Framed::later;  // answers free room
        at += len;
      }
      if (r.op == FrameOp::write_ring && len > 0) {
        std::memcpy(cfg_.ring->data() + ring_off, reinterpret_cast<const void*>(r.laddr + offset), len);
      }
      ring_tail_ = at;
      f.arg0 = ring_off;
      f.arg1 = 0;
      e.held_at = static_cast<std::uint32_t>(ring_off);
      e.held_to = at;
      // A large one goes at once: the peer copies it out while this side copies the next in (the
      // ring's two copies overlap, each on its own process's CPU).
      return len >= kRingEager ? Framed::send_now : Framed::queued;
    }
    default:  // attach: this process's address
      f.arg0 = r.laddr + offset;
      f.arg1 = 0;
      return Framed::queued;
  }
}

void Crossing::answered_ok(const Expect& e, Request& r) noexcept {
  if (e.op == FrameOp::read_ring && e.len > 0 && cfg_.ring) {
    std::memcpy(reinterpret_cast<void*>(r.laddr + e.offset), cfg_.ring->data() + e.held_at, e.len);
  }
}

void Crossing::release(const Expect& e) noexcept { ring_head_ = std::max(ring_head_, e.held_to); }

void Crossing::completed(const Request& r) noexcept {
  if (r.op == FrameOp::write_map || r.op == FrameOp::read_map) dev_.add_mapped(r.length);
}

// --- the responder ---------------------------------------------------------------------------------

bool Crossing::serve(soft::Qp& qp, Stream& s, const Frame& f, Frame& a) noexcept {
  const FrameOp op = f.request_op();
  const auto at = reinterpret_cast<std::uint8_t*>(f.raddr);
  const bool write = op == FrameOp::write_cma || op == FrameOp::write_ring || op == FrameOp::write_map;
  a.status = qp.check(f, write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ);
  if (op == FrameOp::write_cma || op == FrameOp::read_cma) {
    if (cfg_.peer_pid <= 0) a.status = FrameStatus::invalid;  // not a side that copies for its peer
    if (a.status == FrameStatus::ok && f.length != 0 && qp.gave_up(s)) a.status = FrameStatus::remote_op;
    if (a.status == FrameStatus::ok && f.length != 0) {
      iovec mine{at, f.length};
      iovec theirs{reinterpret_cast<void*>(f.arg0), f.length};
      const ssize_t n = write ? ::process_vm_readv(cfg_.peer_pid, &mine, 1, &theirs, 1, 0)
                              : ::process_vm_writev(cfg_.peer_pid, &mine, 1, &theirs, 1, 0);
      if (n != static_cast<ssize_t>(f.length)) a.status = FrameStatus::remote_op;
    }
    return false;
  }
  // Between the window and memory of the requester's that this side maps: its ring (at offset
  // arg0), or a range it shared (range arg0, at offset arg1). Never its other memory.
  const bool ring = op == FrameOp::write_ring || op == FrameOp::read_ring;
  std::uint8_t* base = nullptr;
  std::size_t size = 0;
  if (ring && cfg_.ring && !cfg_.asks) {
    base = cfg_.ring->data();
    size = cfg_.ring->size();
  } else if (const auto m = maps_.find(f.arg0); !ring && m != maps_.end()) {
    base = m->second.data();
    size = m->second.size();
  }
  const std::uint64_t off = ring ? f.arg0 : f.arg1;
  if (base == nullptr || off > size || f.length > size - off) a.status = FrameStatus::invalid;
  // A mapped READ's copy lands in the requester's memory: not once it gave up (as with attach).
  // A WRITE's reads it, which the peer may do at any time anyway: no system call for that.
  // (Through the ring the copy lands in the ring, never in its buffers.)
  if (a.status == FrameStatus::ok && f.length != 0 && !ring && !write && qp.gave_up(s)) a.status = FrameStatus::remote_op;
  if (a.status == FrameStatus::ok && f.length != 0) {
    if (write) {
      std::memcpy(at, base + off, f.length);
    } else {
      std::memcpy(base + off, at, f.length);
    }
  }
  // A large ring frame's answer goes at once: the requester frees its room and copies the next.
  // Mapped frames' answers go every kAnswerEvery bytes copied: the requester posts more while
  // this side copies the rest (at the end of the turn only, its queue would run dry meanwhile).
  if (!ring) s.copied += f.length;
  return (ring && f.length >= kRingEager) || s.copied >= kAnswerEvery;
}

bool Crossing::take(soft::Qp& qp, Stream& s, const Frame& f) noexcept {
  const auto refuse = [&](const std::string& why) {
    qp.fault(fmt::format("data stream {}: {} (the peer is not an rdmakit engine of this version, or lies)", s.index, why));
    return false;
  };
  if (!cfg_.takes_shares) {
    return refuse("the peer shares memory on a link that takes none (engine protocol below 8, not shm, or the side "
                  "that asks)");
  }
  if (f.request_op() == FrameOp::unshare) {
    const auto it = maps_.find(f.arg0);
    if (it == maps_.end()) return refuse(fmt::format("the peer took back memory {} it never shared", f.arg0));
    dev_.give_back_map(it->second.size());
    maps_.erase(it);
    return true;
  }
  if (s.fds.empty()) return refuse(fmt::format("memory {} was shared without its descriptor", f.arg0));
  Fd fd = std::move(s.fds.front());
  s.fds.erase(s.fds.begin());
  if (maps_.contains(f.arg0)) return refuse(fmt::format("memory {} was shared twice", f.arg0));
  if (maps_.size() >= kMaxGiven) return refuse(fmt::format("more than {} ranges of memory were shared", kMaxGiven));
  std::size_t size = 0;
  try {
    size = check_sealed_memfd(fd.get(), 1, kMaxShare, "the memory the peer shared");
  } catch (const std::exception& e) {
    return refuse(e.what());
  }
  if (size != f.arg1) return refuse(fmt::format("memory {} has {} bytes, and its SHARE says {}", f.arg0, size, f.arg1));
  // The device's budget, taken before the mapping (links on other workers take it too).
  if (!dev_.take_map(size)) {
    qp.fault(fmt::format("data stream {}: this engine maps {} ranges ({} bytes) of its shm peers' memory at most, and "
                         "has reached that (each is a mapping against vm.max_map_count, and address space): turn "
                         "EngineConfig::shm_map off on the peers with many buffers",
                         s.index, soft::kMapsBudget, soft::kMapBytesBudget));
    return false;
  }
  try {
    maps_.emplace(f.arg0, Mapping(fd.get(), size, "the memory the peer shared"));
  } catch (const std::exception& e) {
    dev_.give_back_map(size);
    return refuse(e.what());
  }
  return true;
}

}  // namespace rdmakit::detail::shm
