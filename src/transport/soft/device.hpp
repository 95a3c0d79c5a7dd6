// SPDX-License-Identifier: Apache-2.0
#pragma once
// A software RC "device": the verbs objects a link that runs over a byte stream instead of a NIC
// is made of. The data path (src/datapath/) posts and polls through an ibv_context's ops table
// (ibv_post_send, ibv_poll_cq, ibv_req_notify_cq, ibv_alloc_mw ... are inline dispatches in
// verbs.h), and the engine binds memory windows the same way, so a link of the tcp or shm
// transport runs the engine's one data path unchanged: chains, rings, signaled completions,
// drains, windows bound per link. What a NIC does, the queue pairs here do in software
// (qp.hpp): they move the data over their streams and serve the peer's requests, checking each
// against the windows bound on that link, as a NIC checks an rkey.
//
// Only these objects exist here: a protection domain, completion queues with a channel whose
// descriptor is readable when there is something to poll, queue pairs, type-2 memory windows.
// No memory registration: a soft link reads and writes the engine's buffers by address (lkeys
// are 0), and a peer reaches nothing but what a window bound on its link covers. What the shm
// device has besides: the ranges of this process's memory it may hand to its links' peers to map
// (share()), so that those peers copy a request's data in one pass (src/transport/shm/crossing.hpp).
//
// Threads: a Device is shared (its objects are made and destroyed from any thread); a Cq and
// the Qps on it are touched by one thread at a time (the engine worker that owns them).

#include <infiniband/verbs.h>

#include <atomic>
#include <mutex>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bootstrap/socket.hpp"
#include "common/fifo.hpp"
#include "datapath/datapath.hpp"

namespace rdmakit::detail::soft {

class Qp;
class Cq;

/// What the channel's set wakes for: a stream, told that its descriptor is ready.
struct Watched {
  virtual void on_ready(std::uint32_t events) noexcept = 0;

 protected:
  ~Watched() = default;
};

/// A type-2 memory window of a soft device: bound to one queue pair at a time (its peer's
/// requests may use it, no one else's), invalidated by a bind elsewhere or by its deallocation.
struct Mw {
  ibv_mw mw{};  // first: an ibv_mw* is an Mw*
  Qp* bound = nullptr;
  std::uint64_t addr = 0, length = 0;
  unsigned access = 0;  // IBV_ACCESS_REMOTE_*
  std::uint32_t key = 0;  // the rkey it is bound under (0: none)
};

/// The largest range a requester shares, and a responder maps.
inline constexpr std::size_t kMaxShare = std::size_t{1} << 40;

/// What one device maps of its shm peers' memory at most: ranges (each a mapping against the
/// process's vm.max_map_count, 65530 by default) and bytes (address space).
inline constexpr std::uint64_t kMapsBudget = 16384;
inline constexpr std::uint64_t kMapBytesBudget = std::uint64_t{16} << 40;

/// Memory of this process held in a memfd (from its offset 0), which same-host peers may map:
/// a buffer an engine allocated while it offers shm. An shm link's requester names (id, offset)
/// in it rather than an address, and the peer's responder copies between its own mapping of it
/// and the window it checked: one copy, with the target's windows as the only access control on
/// the target's memory (docs/engine.md, "Transports").
struct SharedRange {
  std::uint64_t id = 0;  // per device, never reused
  std::uint64_t base = 0, length = 0;  // where it is in this process
  Fd fd;  // the memfd (this device's own descriptor of it)
};

class Device {
 public:
  /// `name` is what the link reports as its device ("tcp", "shm").
  explicit Device(std::string name);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] ibv_context* context() noexcept { return &context_.ctx; }
  [[nodiscard]] ibv_pd* pd() noexcept { return &pd_; }
  /// For DataPath::init: moving a queue pair to the error state, CQ events.
  [[nodiscard]] static const VerbsOps& ops() noexcept;
  /// A new window key's index (the rkey's upper 24 bits).
  std::uint32_t next_key_index() noexcept { return keys_.fetch_add(1, std::memory_order_relaxed) & 0xffffffu; }

  static Device& of(ibv_context* c) noexcept { return *reinterpret_cast<Context*>(c)->self; }

  /// The shared ranges, by base address.
  using Shares = std::vector<std::shared_ptr<const SharedRange>>;
  /// Shares [base, +length), held in memfd `fd` from its offset 0 (kept here while shared), with
  /// the peers of this device's links that take shared memory (shm::CrossingConfig::shares); its id. Any
  /// thread.
  std::uint64_t share(const void* base, std::size_t length, Fd fd);
  /// Takes range `id` back: each queue pair that gave it to its peer tells the peer to unmap it
  /// (at its CQ's next poll: the CQs are woken for it). Call once no request of the range is
  /// outstanding; the memory may go at once (a peer's mapping keeps its pages until then).
  void unshare(std::uint64_t id) noexcept;
  /// What is shared now, and a count that changes with it (one load: the queue pairs look at it
  /// on every poll of their CQ).
  [[nodiscard]] std::shared_ptr<const Shares> shares() const;
  [[nodiscard]] std::uint64_t shares_changed() const noexcept { return shares_gen_.load(std::memory_order_acquire); }
  /// A count that changes when a range goes (the CQs' polls look at it: links tell their peers).
  [[nodiscard]] std::uint64_t unshares() const noexcept { return unshares_.load(std::memory_order_acquire); }
  /// Ranges shared now.
  [[nodiscard]] std::size_t shared_count() const;
  /// Takes one range of `bytes` of the device's budget for mapping peers' memory (false: over
  /// it, nothing taken), or gives it back.
  bool take_map(std::size_t bytes) noexcept;
  void give_back_map(std::size_t bytes) noexcept;
  /// Bytes of this device's reads and writes that ended ok through shared ranges (the queue pairs
  /// count them as they complete).
  [[nodiscard]] std::uint64_t mapped_bytes() const noexcept { return mapped_bytes_.load(std::memory_order_relaxed); }
  void add_mapped(std::uint64_t n) noexcept { mapped_bytes_.fetch_add(n, std::memory_order_relaxed); }
  /// A CQ is made or goes (unshare() wakes each).
  void add_cq(Cq* cq);
  void remove_cq(Cq* cq) noexcept;

 private:
  struct Context {
    ibv_context ctx;  // first: an ibv_context* is a Context*
    Device* self;
  };
  std::string name_;
  Context context_{};
  ibv_pd pd_{};
  std::atomic<std::uint32_t> keys_{1};
  mutable std::mutex shares_mu_;
  std::shared_ptr<const Shares> shares_;  // under shares_mu_; replaced, never changed
  std::uint64_t next_share_ = 1;          // under shares_mu_
  std::vector<Cq*> cqs_;                  // under shares_mu_
  std::atomic<std::uint64_t> shares_gen_{0};
  std::atomic<std::uint64_t> unshares_{0};
  std::atomic<std::uint64_t> mapped_bytes_{0};
  std::atomic<std::uint64_t> maps_{0}, map_bytes_{0};
};

/// A completion queue and its channel. Polling it drives its queue pairs: their streams are
/// read and written as far as they go without blocking, the peer's requests served, and the
/// completions of what finished queued here (qp.hpp). Its channel's descriptor is an epoll set
/// of those streams (and of a wake-up for completions queued outside a poll): readable while
/// there is work for a poll, so a thread sleeps on it as on a NIC's completion channel.
class Cq {
 public:
  Cq(Device& dev, std::uint32_t entries);
  ~Cq();
  Cq(const Cq&) = delete;
  Cq& operator=(const Cq&) = delete;

  [[nodiscard]] ibv_cq* cq() noexcept { return &cq_; }
  [[nodiscard]] ibv_comp_channel* channel() noexcept { return &channel_; }
  [[nodiscard]] int fd() const noexcept { return epoll_.get(); }
  static Cq& of(ibv_cq* c) noexcept { return *static_cast<Cq*>(c->cq_context); }

  /// ibv_poll_cq: progress on every stream with something to do, then up to `n` completions.
  int poll(int n, ibv_wc* out) noexcept;
  /// ibv_req_notify_cq: the channel's descriptor is made readable if completions wait.
  int arm() noexcept;
  void push(const ibv_wc& wc) noexcept;
  /// A stream's descriptor joins the channel's set (watched for reading), is watched for
  /// reading and/or room to send, or leaves it.
  void watch(int fd, Watched* stream) noexcept;
  void rewatch(int fd, Watched* stream, bool in, bool out) noexcept;
  void unwatch(int fd) noexcept;
  /// `stream` has more to read than one turn took: it gets another at the next poll, and the
  /// channel reads as ready until then (an idle thread sleeps on the channel alone).
  void again(Watched* stream) noexcept;
  void forget(Watched* stream) noexcept;
  /// Runs what the streams can do now (without blocking).
  void progress() noexcept;
  void attach(Qp* qp);
  void detach(Qp* qp) noexcept;
  /// From any thread: the channel reads as ready, so that its owner polls (Device::unshare).
  void nudge() noexcept;
  /// When a poll last found a stream with something to read or send (a request served, an
  /// answer taken): its owner keeps polling a moment after that rather than sleep at once.
  [[nodiscard]] Deadline last_work() const noexcept { return last_work_; }

 private:
  /// The channel's descriptor reads as ready (until the next poll takes the wake-up).
  void wake() noexcept;
  Device& dev_;
  std::uint64_t unshares_seen_ = 0;  // Device::unshares() at the last poll
  Deadline last_work_{};
  ibv_cq cq_{};
  ibv_comp_channel channel_{};
  Fd epoll_;
  Fd wake_;  // an eventfd in the set: readable while completions wait after arm()
  bool woken_ = false;
  Fifo<ibv_wc> entries_;
  std::vector<Qp*> qps_;
  std::vector<Watched*> again_, turn_;  // streams owed another turn (turn_: the one being given)
};


}  // namespace rdmakit::detail::soft
