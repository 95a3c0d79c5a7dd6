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
// are 0), and a peer reaches nothing but what a window bound on its link covers.
//
// Threads: a Device is shared (its objects are made and destroyed from any thread); a Cq and
// the Qps on it are touched by one thread at a time (the engine worker that owns them).

#include <infiniband/verbs.h>

#include <atomic>
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

 private:
  struct Context {
    ibv_context ctx;  // first: an ibv_context* is a Context*
    Device* self;
  };
  std::string name_;
  Context context_{};
  ibv_pd pd_{};
  std::atomic<std::uint32_t> keys_{1};
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

 private:
  /// The channel's descriptor reads as ready (until the next poll takes the wake-up).
  void wake() noexcept;
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
