// SPDX-License-Identifier: Apache-2.0
// A software RC device's objects (device.hpp): the context's ops table, the PD, CQs and windows.
#include "transport/soft/device.hpp"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "rdmakit/error.hpp"
#include "transport/soft/qp.hpp"

namespace rdmakit::detail::soft {

namespace {

int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) { return Qp::of(qp).post_send(wr, bad); }
int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) { return Qp::of(qp).post_recv(wr, bad); }
int poll_cq(ibv_cq* cq, int n, ibv_wc* wc) { return Cq::of(cq).poll(n, wc); }
int req_notify_cq(ibv_cq* cq, int) { return Cq::of(cq).arm(); }

ibv_mw* alloc_mw(ibv_pd* pd, ibv_mw_type type) {
  if (type != IBV_MW_TYPE_2) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  auto* w = new (std::nothrow) Mw;
  if (w == nullptr) {
    errno = ENOMEM;
    return nullptr;
  }
  w->mw.context = pd->context;
  w->mw.pd = pd;
  w->mw.type = type;
  // The key's low byte is the part a bind changes (ibv_inc_rkey); the rest names the window.
  w->mw.rkey = Device::of(pd->context).next_key_index() << 8;
  w->mw.handle = w->mw.rkey >> 8;
  return &w->mw;
}

int dealloc_mw(ibv_mw* mw) {
  auto* w = reinterpret_cast<Mw*>(mw);
  if (w->bound != nullptr) w->bound->unbind(*w);
  delete w;
  return 0;
}

// A bind through ibv_bind_mw (type 1) is not offered: type-2 windows are bound by post_send.
int bind_mw(ibv_qp*, ibv_mw*, ibv_mw_bind*) { return EOPNOTSUPP; }

int to_error(ibv_qp* qp) noexcept {
  Qp::of(qp).to_error();
  return 0;
}

// The channel's descriptor is level-triggered (readable while there is work): an "event" is
// whatever made it readable, and there is nothing to acknowledge.
int get_cq_event(ibv_comp_channel* ch, ibv_cq** cq, void** ctx) noexcept {
  (void)ch;
  (void)cq;
  (void)ctx;
  errno = EAGAIN;
  return -1;
}
void ack_cq_events(ibv_cq*, unsigned) noexcept {}

}  // namespace

Device::Device(std::string name) : name_(std::move(name)) {
  context_.self = this;
  ibv_context_ops& o = context_.ctx.ops;
  o.post_send = post_send;
  o.post_recv = post_recv;
  o.poll_cq = poll_cq;
  o.req_notify_cq = req_notify_cq;
  o.alloc_mw = alloc_mw;
  o.dealloc_mw = dealloc_mw;
  o.bind_mw = bind_mw;
  context_.ctx.cmd_fd = -1;
  context_.ctx.async_fd = -1;
  context_.ctx.num_comp_vectors = 1;
  pd_.context = &context_.ctx;
  pd_.handle = 1;
}

Device::~Device() = default;

std::uint64_t Device::share(const void* base, std::size_t length, Fd fd) {
  auto r = std::make_shared<SharedRange>();
  r->base = reinterpret_cast<std::uint64_t>(base);
  r->length = length;
  r->fd = std::move(fd);
  // A copy per change (the queue pairs read the list without the lock): n ranges shared one by
  // one copy n^2/2 pointers in all, 50 million for 10,000 buffers.
  std::lock_guard lock(shares_mu_);
  r->id = next_share_++;
  auto next = std::make_shared<Shares>(shares_ ? *shares_ : Shares{});
  const auto at = std::upper_bound(next->begin(), next->end(), r->base, [](std::uint64_t b, const auto& e) { return b < e->base; });
  const std::uint64_t id = r->id;
  next->insert(at, std::move(r));
  shares_ = std::move(next);
  shares_gen_.fetch_add(1, std::memory_order_release);
  return id;
}

void Device::unshare(std::uint64_t id) noexcept {
  std::lock_guard lock(shares_mu_);
  if (!shares_) return;
  try {
    auto next = std::make_shared<Shares>(*shares_);
    if (std::erase_if(*next, [&](const auto& e) { return e->id == id; }) == 0) return;
    shares_ = std::move(next);
  } catch (...) {
    return;  // out of memory: the range stays shared (its peers keep a mapping of it)
  }
  shares_gen_.fetch_add(1, std::memory_order_release);
  unshares_.fetch_add(1, std::memory_order_release);
  for (Cq* c : cqs_) c->nudge();
}

std::size_t Device::shared_count() const {
  std::lock_guard lock(shares_mu_);
  return shares_ ? shares_->size() : 0;
}

bool Device::take_map(std::size_t bytes) noexcept {
  const std::uint64_t n = maps_.fetch_add(1, std::memory_order_relaxed) + 1;
  const std::uint64_t b = map_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (n <= kMapsBudget && b <= kMapBytesBudget) return true;
  give_back_map(bytes);
  return false;
}

void Device::give_back_map(std::size_t bytes) noexcept {
  maps_.fetch_sub(1, std::memory_order_relaxed);
  map_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
}

std::shared_ptr<const Device::Shares> Device::shares() const {
  std::lock_guard lock(shares_mu_);
  return shares_;
}

void Device::add_cq(Cq* cq) {
  std::lock_guard lock(shares_mu_);
  cqs_.push_back(cq);
}

void Device::remove_cq(Cq* cq) noexcept {
  std::lock_guard lock(shares_mu_);
  std::erase(cqs_, cq);
}

const VerbsOps& Device::ops() noexcept {
  static constexpr VerbsOps soft{to_error, get_cq_event, ack_cq_events};
  return soft;
}

Cq::Cq(Device& dev, std::uint32_t entries) : dev_(dev) {
  epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) throw Error("epoll_create1", errno, fmt::format("a {} completion queue", dev.name()));
  wake_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_) throw Error("eventfd", errno, fmt::format("a {} completion queue", dev.name()));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wake_.get(), &ev) != 0) {
    throw Error("epoll_ctl(ADD)", errno, fmt::format("a {} completion queue", dev.name()));
  }
  channel_.context = dev.context();
  channel_.fd = epoll_.get();
  channel_.refcnt = 0;
  cq_.context = dev.context();
  cq_.channel = &channel_;
  cq_.cq_context = this;
  cq_.cqe = static_cast<int>(entries);
  dev.add_cq(this);
}

Cq::~Cq() { dev_.remove_cq(this); }

void Cq::nudge() noexcept {
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void Cq::attach(Qp* qp) { qps_.push_back(qp); }

void Cq::detach(Qp* qp) noexcept { std::erase(qps_, qp); }

void Cq::watch(int fd, Watched* stream) noexcept {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = stream;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev);
}

void Cq::rewatch(int fd, Watched* stream, bool in, bool out) noexcept {
  epoll_event ev{};
  ev.events = (in ? EPOLLIN : 0u) | (out ? EPOLLOUT : 0u);
  ev.data.ptr = stream;
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, fd, &ev);
}

void Cq::unwatch(int fd) noexcept { (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr); }

void Cq::push(const ibv_wc& wc) noexcept {
  try {
    entries_.push_back(wc);
  } catch (...) {
    // Out of memory growing the queue: an overrun, as a full CQ on a NIC. Sized by the links'
    // depths, it never grows past its working size.
  }
}

void Cq::again(Watched* stream) noexcept {
  if (std::find(again_.begin(), again_.end(), stream) != again_.end()) return;
  try {
    again_.push_back(stream);
  } catch (...) {
    // Out of memory: its descriptor stays readable, and the next wake-up reads it.
  }
}

void Cq::forget(Watched* stream) noexcept {
  std::erase(again_, stream);
  std::replace(turn_.begin(), turn_.end(), stream, static_cast<Watched*>(nullptr));
}

void Cq::progress() noexcept {
  const bool turns = !again_.empty();
  if (!again_.empty()) {
    turn_.swap(again_);
    for (std::size_t i = 0; i < turn_.size(); ++i) {
      if (turn_[i] != nullptr) turn_[i]->on_ready(EPOLLIN);
    }
    turn_.clear();
  }
  epoll_event events[64];
  const int n = ::epoll_wait(epoll_.get(), events, 64, 0);
  for (int i = 0; i < n; ++i) {
    if (events[i].data.ptr == nullptr) {
      std::uint64_t v = 0;
      (void)!::read(wake_.get(), &v, sizeof v);
      woken_ = false;
      continue;
    }
    static_cast<Watched*>(events[i].data.ptr)->on_ready(events[i].events);
  }
  // A stream owed another turn keeps the channel readable, so a thread about to sleep on it
  // does not (it would wait for a descriptor that has nothing new to say).
  if (!again_.empty()) wake();
  if (const std::uint64_t g = dev_.unshares(); g != unshares_seen_) {
    // Ranges went: the queue pairs that gave them to their peers tell them.
    unshares_seen_ = g;
    for (Qp* q : qps_) q->shares_changed();
  }
  if (!qps_.empty()) {
    // Answers owed for too long mean the peer is gone (each queue pair looks every 10 ms).
    const Deadline now = Clock::now();
    if (turns || n > 1 || (n == 1 && events[0].data.ptr != nullptr)) last_work_ = now;
    for (Qp* q : qps_) {
      if (q->outstanding() > 0) q->check_stalls(now);
    }
  }
}

int Cq::poll(int n, ibv_wc* out) noexcept {
  if (entries_.size() < static_cast<std::size_t>(n)) progress();
  int got = 0;
  while (got < n && !entries_.empty()) {
    out[got++] = entries_.front();
    entries_.pop_front();
  }
  return got;
}

int Cq::arm() noexcept {
  if (!entries_.empty() || !again_.empty()) wake();
  return 0;
}

void Cq::wake() noexcept {
  if (woken_) return;
  const std::uint64_t one = 1;
  if (::write(wake_.get(), &one, sizeof one) == sizeof one) woken_ = true;
}

}  // namespace rdmakit::detail::soft
