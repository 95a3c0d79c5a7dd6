// An engine worker: its shared CQs, its links, and the transfers in flight on them. Everything
// here runs on the worker's thread (or in progress()), except post(), attach() and stop().
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "engine/impl.hpp"
#include "engine/protocol.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"
#include "verbs/qp.hpp"

namespace rdmakit::detail {

namespace ew = engine_wire;

namespace {

// epoll data below this is one of the worker's own descriptors; above, a Link*.
constexpr std::uint64_t kWake = 1;
constexpr std::uint64_t kChannel = 16;    // + device index
constexpr std::uint64_t kAsync = 2048;    // + device index
constexpr std::uint64_t kOwnLimit = 4096;

void add_fd(int epfd, int fd, std::uint64_t data) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = data;
  if (::epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) != 0) throw Error("epoll_ctl(ADD)", errno, "an engine worker's descriptor");
}

TransferStatus status_of(PostStatus s) {
  switch (s) {
    case PostStatus::out_of_bounds:
    case PostStatus::not_advertised:
    case PostStatus::no_access: return TransferStatus::no_segment;
    case PostStatus::not_ready: return TransferStatus::peer_lost;
    case PostStatus::misaligned:
    case PostStatus::bad_length: return TransferStatus::invalid;
    default: return TransferStatus::failed;
  }
}

bool writes(TransferOp op) { return op != TransferOp::read; }

// A chain signals every kSignalEvery-th request and its last, so the queue drains (and the
// backlog refills it) while the rest of the chain is still on the wire.
constexpr std::uint32_t kSignalEvery = 16;

}  // namespace

Worker::Worker(Engine::Impl& e, std::uint32_t index) : e_(e), index_(index) {
  wake_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_) throw Error("eventfd", errno, "an engine worker's wake-up");
  epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) throw Error("epoll_create1", errno, "an engine worker");
  add_fd(epoll_.get(), wake_.get(), kWake);
  const auto& devices = e.layer->devices();
  const std::uint32_t depth = e.cfg.link.send_depth + e.cfg.link.recv_depth;
  for (std::uint32_t d = 0; d < devices.size(); ++d) {
    auto q = std::make_unique<DeviceCqs>();
    q->dev = e.pds[d];
    ibv_context* ctx = q->dev->ctx();
    const auto max_cqe = static_cast<std::uint32_t>(std::max(devices[d]->attr().max_cqe, 1));
    // Every link's queues fit in the CQ at once, so it can never overrun: that bounds the links
    // one worker holds on a device.
    q->capacity = std::max<std::uint32_t>(1, std::min(e.cfg.max_qps, max_cqe / std::max<std::uint32_t>(depth, 1)));
    q->channel.reset(ibv_create_comp_channel(ctx));
    if (!q->channel) throw Error("ibv_create_comp_channel", errno, devices[d]->name());
    const int flags = ::fcntl(q->channel->fd, F_GETFL);
    if (flags < 0 || ::fcntl(q->channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
      throw Error("fcntl(O_NONBLOCK)", errno, "completion channel");
    }
    const auto entries = static_cast<int>(q->capacity * depth);
    q->cq.reset(ibv_create_cq(ctx, entries, nullptr, q->channel.get(), 0));
    if (!q->cq) {
      throw Error("ibv_create_cq", errno, fmt::format("engine worker {} CQ of {} entries on {}", index, entries, devices[d]->name()));
    }
    q->router.init(q->cq.get(), 2 * q->capacity);  // a send lane and a receive queue per link
    add_fd(epoll_.get(), q->channel->fd, kChannel + d);
    add_fd(epoll_.get(), devices[d]->async_fd(), kAsync + d);
    cqs_.push_back(std::move(q));
  }
}

Worker::~Worker() { stop(); }

void Worker::start() {
  threaded_ = true;
  thread_ = std::thread([this] { (void)run(Deadline::max(), true); });
}

void Worker::post(Command c) {
  {
    std::lock_guard lock(mu_);
    inbox_.push_back(std::move(c));
    has_mail_.store(true, std::memory_order_release);
  }
  if (!threaded_) return;  // progress() on the caller's thread finds it; there is no one to wake
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

std::optional<Attachment> Worker::attach(std::uint32_t device) {
  DeviceCqs& q = *cqs_.at(device);
  {
    std::lock_guard lock(cq_mu_);
    if (q.links >= q.capacity) return std::nullopt;
    ++q.links;
  }
  Attachment a;
  a.dev = q.dev;
  a.send_cq = a.recv_cq = q.cq.get();
  a.owner = this;
  a.keep = std::shared_ptr<void>(this, [this, &q](Worker*) {
    std::lock_guard lock(cq_mu_);
    --q.links;
  });
  return a;
}

void Worker::stop() noexcept {
  if (stop_.exchange(true)) return;
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  // What is queued still ends: commands are handled (transfers to links that are going fail).
  try {
    std::vector<Command> mail;
    {
      std::lock_guard lock(mu_);
      mail.swap(inbox_);
    }
    for (Command& c : mail) handle(c);
  } catch (...) {
  }
  for (auto& l : links_) break_link(*l, "the engine is closing");
  // The flushes come back through the CQs; then every link closes.
  const Deadline until = deadline_in(std::chrono::milliseconds{2000});
  while (Clock::now() < until &&
         std::any_of(links_.begin(), links_.end(), [](const auto& l) { return l->impl.dp.outstanding() > 0; })) {
    for (auto& q : cqs_) (void)q->router.poll([this](DataPath& dp, const Completion& c) { on_completion(dp, c); });
    for (auto& l : links_) l->impl.dp.post_owed_markers();
  }
  // What never completed ends now; only this worker's transfers (the others' workers end theirs,
  // maybe at this very moment).
  const std::string closed = "the engine closed before the transfer completed";
  for (auto& l : links_) {
    for (Link::Deferred& d : l->deferred) end(*d.x, TransferStatus::failed, std::move(d.reason));
    l->deferred.clear();
    const WrRing& ring = l->impl.dp.lane(0).sq;
    walk(*l, ring.head(), TransferStatus::ok, {});  // retired without news: they completed
    walk(*l, ring.next_seq(), TransferStatus::peer_lost, closed);
    for (Xfer* x : l->alone) end(*x, TransferStatus::peer_lost, closed);
    l->alone.clear();
    close_link(*l);
  }
  links_.clear();
  for (std::uint32_t id = 1; Peer* p = e_.peer(id); ++id) {
    if (p->worker != this) continue;
    while (!p->waiting.empty()) {
      Xfer* x = p->waiting.front();
      p->waiting.pop_front();
      end(*x, TransferStatus::peer_lost, closed);
    }
  }
  probes_.clear();
  groups_.clear();  // every slice ended above, and with it its group
}

// --- the loop ------------------------------------------------------------------------------------

std::size_t Worker::run(Deadline until, bool forever) noexcept {
  ended_ = 0;
  for (;;) {
    if (stop_.load(std::memory_order_relaxed) && forever) break;
    if (has_mail_.load(std::memory_order_acquire)) {
      std::vector<Command> mail;
      {
        std::lock_guard lock(mu_);
        mail.swap(inbox_);
        has_mail_.store(false, std::memory_order_relaxed);
      }
      for (Command& c : mail) {
        try {
          handle(c);
        } catch (const std::exception& ex) {
          try {
            e_.cfg.link.log(fmt::format("engine {}: worker {}: {}", e_.name, index_, ex.what()));
          } catch (...) {
          }
        }
      }
    }
    int got = 0;
    for (auto& q : cqs_) {
      got += q->router.poll([this](DataPath& dp, const Completion& c) { on_completion(dp, c); });
    }
    flush_queued_links();
    if (!retiring_.empty() && got > 0) check_retiring();
    const Deadline now = Clock::now();
    if (now >= next_tick_) {
      next_tick_ = now + std::chrono::milliseconds{1};
      sleep(now);  // a zero wait: the links' control channels, device events
      reap_links();
      if (!probes_.empty()) probe_rails(now);
      if (!retiring_.empty()) check_retiring();
    }
    if (!forever && now >= until) break;
    if (got == 0 && in_flight_ == 0 && to_flush_.empty() && !has_mail_.load(std::memory_order_acquire)) {
      // A closing link is reaped once its peer's fate is known (Link::deferred): look again soon.
      const bool closing = std::any_of(links_.begin(), links_.end(),
                                       [](const auto& l) { return l->state == Link::State::closing; });
      const auto nap = closing             ? std::chrono::milliseconds{5}
                       : !probes_.empty() ? std::chrono::milliseconds{50}
                                          : std::chrono::milliseconds{1000};
      sleep(forever ? now + nap : std::min(until, now + nap));
      reap_links();
      if (!forever && Clock::now() >= until) break;
    }
  }
  return ended_;
}

// Waits on the worker's descriptors until `until` (not at all when it has passed): CQ events
// (armed first), the wake-up, links' control channels, device events.
void Worker::sleep(Deadline until) noexcept {
  const Deadline now = Clock::now();
  int ms = 0;
  if (until > now) {
    for (auto& q : cqs_) (void)ibv_req_notify_cq(q->cq.get(), 0);
    // A completion that arrived before arming raises no event: look once more.
    int got = 0;
    for (auto& q : cqs_) got += q->router.poll([this](DataPath& dp, const Completion& c) { on_completion(dp, c); });
    if (got > 0 || !to_flush_.empty() || has_mail_.load(std::memory_order_acquire)) return;
    ms = static_cast<int>(std::min<long long>(
        std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count() + 1, 1000));
  }
  epoll_event events[64];
  const int n = ::epoll_wait(epoll_.get(), events, 64, ms);
  const Deadline after = Clock::now();
  for (int i = 0; i < n; ++i) {
    const std::uint64_t tag = events[i].data.u64;
    if (tag == kWake) {
      std::uint64_t v = 0;
      (void)!::read(wake_.get(), &v, sizeof v);
    } else if (tag >= kChannel && tag < kAsync) {
      DeviceCqs& q = *cqs_[tag - kChannel];
      ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      while (ibv_get_cq_event(q.channel.get(), &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
    } else if (tag >= kAsync && tag < kOwnLimit) {
      e_.layer->devices()[tag - kAsync]->pump();
    } else {
      tick_link(*reinterpret_cast<Link*>(tag), after);
    }
  }
  // Links whose peer has gone are ticked until the grace for its last completions has passed.
  for (auto& l : links_) {
    if (l->impl.control_gone || l->impl.bye_received || l->impl.device_failed.load(std::memory_order_relaxed) ||
        l->state == Link::State::closing) {
      tick_link(*l, after);
    }
  }
}

void Worker::handle(Command& c) {
  switch (c.kind) {
    case Command::Kind::submit: submit(c.batch, c.indexes); break;
    case Command::Kind::link_up: link_up(c); break;
    case Command::Kind::connect_failed:
      if (c.rail != nullptr) {
        c.rail->connecting = false;
        rail_down(*c.peer, *c.rail, c.text, /*went_down=*/false);
      } else {
        connect_failed(*c.peer, c.text);
      }
      break;
    case Command::Kind::expose: {
      SegmentDef def;
      {
        std::lock_guard lock(e_.mu);
        const auto it = e_.segments.find(c.text);
        if (it == e_.segments.end()) break;  // withdrawn meanwhile
        def = it->second;
      }
      for (auto& l : links_) {
        if (!l->initiated && l->state != Link::State::closing) bind_window(*l, def);
      }
      break;
    }
    case Command::Kind::withdraw: withdraw(c.text); break;
    case Command::Kind::remove_peer: {
      Peer& p = *c.peer;
      if (p.worker == this) {
        break_links(p, fmt::format("peer '{}' was removed", p.name));
        fail_waiting(p, TransferStatus::peer_lost, fmt::format("peer '{}' was removed", p.name));
      }
      // Its access to our segments goes with the links it opened to us.
      for (auto& l : links_) {
        if (!l->initiated && l->peer_name == c.text) break_link(*l, fmt::format("peer '{}' was removed", c.text));
      }
      break;
    }
    case Command::Kind::evict: (void)evict_one(); break;
    case Command::Kind::restarted: close_stale(c.text, c.epoch, nullptr); break;
    case Command::Kind::retire:
      // Transfers of it submitted before this command were admitted already: those after are not.
      if (BufferRec* b = e_.buffer(c.retirement->buffer)) b->retired_by.fetch_or(std::uint64_t{1} << index_);
      retiring_.push_back(std::move(c.retirement));
      check_retiring();
      break;
    case Command::Kind::gone: {
      // The store says its engine is gone: what waits for a link fails now, not at the connect
      // deadline, and the link (if the process is dead, about to fail anyway) goes.
      Peer& p = *c.peer;
      break_links(p, c.text);
      fail_waiting(p, TransferStatus::connect_failed, c.text);
      break;
    }
    case Command::Kind::kick: {
      Peer& p = *c.peer;
      if (ready(p.link)) {
        std::lock_guard lock(p.m);
        p.up = true;
        p.cv.notify_all();
      } else if (p.link == nullptr && !p.connecting) {
        p.connecting = true;
        e_.request_connect(&p);
      }
      break;
    }
  }
}

// --- transfers -----------------------------------------------------------------------------------

namespace {

// Why transfer t cannot be posted at all (the common case, that it can, stays out of the loop).
[[gnu::noinline, gnu::cold]] std::string invalid_reason(const Transfer& t, const BufferRec* b, const Peer* p) {
  if (b == nullptr) return fmt::format("buffer {} is not this engine's", t.local.id);
  if (b->retired.load()) return fmt::format("buffer {} was unregistered", t.local.id);
  if (t.local_offset > b->handle.length || t.length > b->handle.length - t.local_offset) {
    return fmt::format("[{}, +{}) is outside the local buffer of {} bytes", t.local_offset, t.length, b->handle.length);
  }
  if (p == nullptr) return fmt::format("peer {} is unknown (RemoteSegment from Engine::segment)", t.remote.peer);
  if (p->removed.load()) return fmt::format("peer '{}' was removed", p->name);
  if ((t.op == TransferOp::fetch_add || t.op == TransferOp::compare_swap) && t.length != 8) {
    return fmt::format("an atomic moves 8 bytes, not {}", t.length);
  }
  return "a transfer of 0 bytes";
}

// Whether t's local range is outside a buffer of `len` bytes or empty, or t is an atomic of
// other than 8 bytes: one branch for all of it (0 for `len` when there is no buffer).
[[gnu::always_inline]] inline bool bad_range(const Transfer& t, std::uint64_t len) {
  return (t.local_offset > len) | (t.length - 1 >= len - t.local_offset) |
         ((t.op >= TransferOp::fetch_add) & (t.length != 8));
}

}  // namespace

// Each transfer is checked, and goes straight into the chain open on its peer's link when that
// link is ready with room and nothing queued before it; otherwise it queues (Link::backlog, or
// Peer::waiting until a link is up). The chains are posted at the end, one doorbell each.
void Worker::submit(const std::shared_ptr<BatchState>& b, const std::vector<std::uint32_t>& indexes) {
  const bool all = indexes.empty();  // the whole batch is this worker's
  const std::uint32_t n = all ? b->size : static_cast<std::uint32_t>(indexes.size());
  Live& live = live_[b.get()];
  live.batch = b;
  live.left += n;
  if (!b->notify.empty()) {
    for (std::uint32_t k = 0; k < n; ++k) {
      const Transfer& t = b->x[all ? k : indexes[k]].t;
      if (writes(t.op)) {
        if (Peer* p = e_.peer(t.remote.peer); p != nullptr) ++live.writes_left[p];
      }
    }
  }
  // `live` may go from here on: the last transfer to end erases it.
  // A batch mostly moves between one buffer and one peer's segment: what a transfer needs (its
  // link, the segment's window, the buffer's registration) is looked up when those change, or
  // after anything that may have changed it (admit()); the rest take the short way.
  Route r;
  auto one = [&](Xfer& x) __attribute__((always_inline)) {
    const Transfer& t = x.t;
    const bool same = r.ok & (t.local.id == r.buf_id) & (t.remote.peer == r.peer_id) & (t.remote.slot == r.slot);
    if (!same || r.link->chain_room == 0) [[unlikely]] return admit(x, r);
    // A transfer too long for one request goes the long way too (it is posted alone).
    if (bad_range(t, r.buf_len) | (t.length > r.max_msg)) [[unlikely]] return admit(x, r);
    if (!chain(*r.link, x, r.laddr + t.local_offset, r.lkey, r.writable, *r.seg)) r.ok = false;
  };
  if (all) {
    for (Xfer *x = b->x, *last = b->x + n; x != last; ++x) one(*x);
  } else {
    for (const std::uint32_t i : indexes) one(b->x[i]);
  }
  post_open_chains();
}

void Worker::admit(Xfer& x, Route& r) {
  r.ok = false;  // whatever happens here may change the link
  const Transfer& t = x.t;
  const BufferRec* buf = e_.buffer(t.local.id);
  Peer* peer = e_.peer(t.remote.peer);
  const std::uint64_t buf_len = buf != nullptr ? buf->handle.length : 0;
  if (peer == nullptr || peer->removed.load(std::memory_order_relaxed) || bad_range(t, buf_len) ||
      (buf->retired_by.load(std::memory_order_relaxed) >> index_ & 1) != 0) {
    return end(x, TransferStatus::invalid, invalid_reason(t, buf, peer));
  }
  x.buf = buf;
  Link* l = pick(*peer, buf);
  if (l == nullptr || !l->backlog.empty() || too_long(*l, t) || slices_for(*peer, x) || !room_on(*l)) {
    return start_transfer(*peer, x);
  }
  const std::optional<RemoteRegion>* seg = t.remote.slot < l->by_slot.size() ? &l->by_slot[t.remote.slot] : nullptr;
  if (seg == nullptr || !seg->has_value()) return refused(*l, x, PostStatus::not_advertised);
  const LocalSlice& s = buf->slices[l->device];
  if (!chain(*l, x, reinterpret_cast<std::uint64_t>(s.addr()) + t.local_offset, s.lkey(), s.writable(), **seg)) return;
  // What the next transfers of the same buffer and segment reuse; valid while nothing but
  // chain() runs (which keeps the link as it is, or says it did not).
  // A transfer long enough to be sliced takes the long way too.
  const std::uint64_t threshold = e_.cfg.rails.slice_threshold;
  const std::uint64_t max_msg = threshold != 0 ? std::min<std::uint64_t>(l->impl.dp.limits().max_msg_size, threshold - 1)
                                               : l->impl.dp.limits().max_msg_size;
  r = {true, t.local.id, t.remote.peer, t.remote.slot, buf_len, max_msg, l, &**seg,
       reinterpret_cast<std::uint64_t>(s.addr()), s.lkey(), s.writable()};
}

void Worker::start_transfer(Peer& p, Xfer& x) {
  if (slices_for(p, x)) return slice(p, x);
  if (Link* l = pick(p, x.buf)) return queue_on(*l, x);
  Link* l = p.link;
  if (p.removed.load(std::memory_order_relaxed)) {
    return end(x, TransferStatus::peer_lost, fmt::format("peer '{}' was removed", p.name));
  }
  if (p.gone.load(std::memory_order_relaxed)) return end(x, TransferStatus::connect_failed, e_.gone_reason(p));
  p.waiting.push_back(&x);
  if (l == nullptr && !p.connecting) {
    p.connecting = true;
    e_.request_connect(&p);
  }
}

void Worker::queue_flush(Link& l) {
  if (l.flush_queued) return;
  l.flush_queued = true;
  to_flush_.push_back(&l);
}

void Worker::flush_queued_links() {
  // flush() closes no link, but it may break one (a post refused, a data path found broken),
  // and that link's transfers are re-posted on another rail (lost()), which joins this list while
  // it runs: by index, to its end, so none is dropped with its flush_queued still set.
  for (std::size_t i = 0; i < to_flush_.size(); ++i) {
    Link* l = to_flush_[i];
    l->flush_queued = false;
    flush(*l);
  }
  to_flush_.clear();
  post_open_chains();
}

[[gnu::always_inline]] inline bool Worker::room_on(Link& l) {
  if (l.chain_room != 0) [[likely]] return true;
  if (l.chain_open) post_chain(l);
  return open_chain(l);
}

bool Worker::open_chain(Link& l) {
  DataPath& dp = l.impl.dp;
  Lane& lane = dp.lane(0);
  std::uint64_t room = dp.begin_chain(lane, kSignalEvery);
  if (dp.mode() != DataPath::Mode::ready) [[unlikely]] {
    break_link(l, dp.failure());
    return false;
  }
  // A slot not walked yet (Link::ended) is not overwritten.
  room = std::min<std::uint64_t>(room, lane.sq.storage() - (lane.sq.next_seq() - l.ended));
  if (room == 0) return false;  // a completion makes room, and flushes the backlog
  l.chain_open = true;
  l.chain_room = static_cast<std::uint32_t>(room);
  open_chains_.push_back(&l);
  return true;
}

void Worker::post_chain(Link& l) {
  l.chain_open = false;
  l.chain_room = 0;
  DataPath& dp = l.impl.dp;
  const std::uint32_t n = dp.chain_size();
  if (n == 0) return;
  const PostResult r = dp.post_chain_built();
  const std::size_t went = r.ok() ? n : r.index;
  l.in_flight += went;
  in_flight_ += went;
  if (r.ok()) [[likely]] return;
  // The provider refused part way: what it took is in flight, the rest failed (their slots are
  // still staged past the ring's newest), and the link breaks (what is in flight then
  // completes flushed).
  const std::string why = fmt::format("peer '{}': {}", l.peer->name, r.describe());
  WrRing& ring = dp.lane(0).sq;
  for (std::size_t k = 0; k < n - went; ++k) {
    end(*reinterpret_cast<Xfer*>(ring.staged(static_cast<std::uint32_t>(k)).wr_id), TransferStatus::failed, why);
  }
  break_link(l, why);
}

void Worker::post_open_chains() {
  // post_chain() may break a link, which neither closes it nor opens chains.
  for (std::size_t i = 0; i < open_chains_.size(); ++i) {
    if (open_chains_[i]->chain_open) post_chain(*open_chains_[i]);
  }
  open_chains_.clear();
}

void Worker::abandon_chain(Link& l, const std::string& why) noexcept {
  if (!l.chain_open) return;
  l.chain_open = false;
  l.chain_room = 0;
  DataPath& dp = l.impl.dp;
  const std::uint32_t n = dp.chain_size();
  (void)dp.begin_chain(dp.lane(0), kSignalEvery);  // forgets it
  WrRing& ring = dp.lane(0).sq;
  for (std::uint32_t k = 0; k < n; ++k) {
    lost(l, *reinterpret_cast<Xfer*>(ring.staged(k).wr_id), TransferStatus::peer_lost, why);
  }
}

[[gnu::always_inline]] inline bool Worker::chain(Link& l, Xfer& x, std::uint64_t laddr, std::uint32_t lkey,
                                                  bool writable, const RemoteRegion& seg) {
  const Transfer& t = x.t;
  DataPath& dp = l.impl.dp;
  const auto len = static_cast<std::uint32_t>(t.length);  // at most max_msg_sz (too_long)
  const auto id = reinterpret_cast<std::uint64_t>(&x);
  PostStatus st;
  switch (t.op) {
    case TransferOp::write:
      st = dp.chain_add<Opcode::write>(laddr, len, lkey, writable, seg, t.remote_offset, 0, 0, id);
      break;
    case TransferOp::read:
      st = dp.chain_add<Opcode::read>(laddr, len, lkey, writable, seg, t.remote_offset, 0, 0, id);
      break;
    case TransferOp::fetch_add:
      st = dp.chain_add<Opcode::fetch_add>(laddr, len, lkey, writable, seg, t.remote_offset, t.compare_add, 0, id);
      break;
    default:
      st = dp.chain_add<Opcode::compare_swap>(laddr, len, lkey, writable, seg, t.remote_offset, t.compare_add, t.swap,
                                              id);
      break;
  }
  if (st != PostStatus::ok) [[unlikely]] {
    refused(l, x, st);
    return false;
  }
  --l.chain_room;
  l.bytes_out += len;
  return true;
}

bool Worker::chain(Link& l, Xfer& x) {
  const Transfer& t = x.t;
  const std::optional<RemoteRegion>* seg = t.remote.slot < l.by_slot.size() ? &l.by_slot[t.remote.slot] : nullptr;
  if (seg == nullptr || !seg->has_value()) [[unlikely]] {
    refused(l, x, PostStatus::not_advertised);
    return false;
  }
  const LocalSlice& s = x.buf->slices[l.device];
  return chain(l, x, reinterpret_cast<std::uint64_t>(s.addr()) + t.local_offset, s.lkey(), s.writable(), **seg);
}

void Worker::refused(Link& l, Xfer& x, PostStatus st) {
  if (st == PostStatus::not_advertised) {
    std::string name;
    {
      std::lock_guard lock(e_.mu);
      name = l.peer->slot_names.at(x.t.remote.slot);
    }
    std::string have;
    for (const auto& [nm, r] : l.remote) have += (have.empty() ? "" : ", ") + nm;
    return end(x, TransferStatus::no_segment,
               fmt::format("peer '{}' has no segment '{}' (it has: {})", l.peer->name, name, have.empty() ? "none" : have));
  }
  std::string why = fmt::format("peer '{}': {}", l.peer->name, PostResult{st, 0, 0}.describe());
  if (st == PostStatus::unsupported) why += " (the peer's device or this one has no atomics)";
  end(x, status_of(st), std::move(why));
}

void Worker::post_alone(Link& l, Xfer& x) {
  DataPath& dp = l.impl.dp;
  const Transfer& t = x.t;
  const std::optional<RemoteRegion>* seg = t.remote.slot < l.by_slot.size() ? &l.by_slot[t.remote.slot] : nullptr;
  if (seg == nullptr || !seg->has_value()) return refused(l, x, PostStatus::not_advertised);
  const LocalSlice s = x.buf->slices[l.device].subslice(t.local_offset, t.length);
  const auto id = reinterpret_cast<std::uint64_t>(&x);
  PostResult r = t.op == TransferOp::read ? dp.post_one<Opcode::read>(s, **seg, t.remote_offset, 0, 0, 0, id)
                 : t.op == TransferOp::write
                     ? dp.post_one<Opcode::write>(s, **seg, t.remote_offset, 0, 0, 0, id)
                     : PostResult{PostStatus::bad_length, 0, 0};
  if (r.ok()) {
    l.alone.push_back(&x);
    ++l.in_flight;
    ++in_flight_;
    l.bytes_out += t.length;
    return;
  }
  if (r.status == PostStatus::queue_full) {
    l.backlog_bytes += t.length;
    return l.backlog.push_front(&x);
  }
  std::string why = fmt::format("peer '{}': {}", l.peer->name, r.describe());
  end(x, r.status == PostStatus::failed ? TransferStatus::failed : status_of(r.status), why);
  if (r.status == PostStatus::failed) break_link(l, why);
}

// The link's backlog into chains, as far as its send queue has room.
void Worker::flush(Link& l) {
  while (!l.backlog.empty() && l.state == Link::State::ready) {
    Xfer& x = *l.backlog.front();
    if (too_long(l, x.t)) [[unlikely]] {  // split by the data path: posted alone
      if (l.chain_open) post_chain(l);
      if (l.state != Link::State::ready) return;
      l.backlog.pop_front();
      l.backlog_bytes -= x.t.length;
      post_alone(l, x);
      if (!l.backlog.empty() && l.backlog.front() == &x) return;  // no room: back in front
      continue;
    }
    if (!room_on(l)) return;  // a completion makes room, and flushes again
    l.backlog.pop_front();
    l.backlog_bytes -= x.t.length;
    (void)chain(l, x);
  }
}

void Worker::walk(Link& l, std::uint64_t upto, TransferStatus s, const std::string& why) noexcept {
  const WrRing& ring = l.impl.dp.lane(0).sq;
  // Runs of transfers of one batch that ended ok (a chain of one batch's transfers, the common
  // case) are counted once; anything else ends one by one.
  BatchState* run = nullptr;
  bool plain = false;  // the run's transfers end by the count
  std::uint32_t run_ok = 0, walked = 0, slices = 0;
  std::uint64_t bytes = 0, out = 0, moved = 0;  // moved: read and written on this rail
  auto settle = [&] {
    // The bytes first: a waiter that sees its batch done reads counters that include it.
    if (bytes != 0) e_.count.bytes.fetch_add(bytes, std::memory_order_relaxed);
    moved += bytes;
    bytes = 0;
    if (run_ok == 0) return;
    const auto it = live_.find(run);
    if (it != live_.end()) {
      ended_ += run_ok;
      std::shared_ptr<BatchState> keep;  // the batch outlives finished_ok() below
      if ((it->second.left -= run_ok) == 0) {
        keep = std::move(it->second.batch);
        live_.erase(it);
      }
      run->finished_ok(run_ok);
    }
    run_ok = 0;
  };
  for (std::uint64_t seq = l.ended; seq < upto; ++seq) {
    const WrRing::Slot& slot = ring.at(seq);
    // Not a transfer of a chain: a part of a split transfer (Link::alone), a drain marker, a
    // window bind.
    if (slot.kind >= WrRing::part || (slot.wr_id & 1) != 0) [[unlikely]] continue;
    Xfer& x = *reinterpret_cast<Xfer*>(slot.wr_id);
    ++walked;
    out += x.t.length;
    if (x.batch != run) [[unlikely]] {
      settle();
      run = x.batch;
      // A batch with slices ends them one by one too: they end into their transfer's group.
      plain = s == TransferStatus::ok && run->notify.empty() && !run->sliced.load(std::memory_order_relaxed);
    }
    if (!plain) [[unlikely]] {
      if (s == TransferStatus::ok && x.t.op <= TransferOp::write) {
        moved += x.t.length;
        slices += x.group != nullptr;
      }
      end(x, s, why);
      continue;
    }
    x.status.store(TransferStatus::ok, std::memory_order_relaxed);  // published by finished_ok
    ++run_ok;
    bytes += x.t.op <= TransferOp::write ? x.t.length : 0;
  }
  settle();
  l.in_flight -= walked;
  in_flight_ -= walked;
  l.bytes_out -= std::min(l.bytes_out, out);
  if (l.rail != nullptr && moved != 0) {
    l.rail->bytes.fetch_add(moved, std::memory_order_relaxed);
    if (slices != 0) l.rail->slices.fetch_add(slices, std::memory_order_relaxed);
  }
  l.ended = std::max(l.ended, upto);
}

void Worker::end(Xfer& x, TransferStatus s, std::string reason) noexcept {
  if (x.group != nullptr) [[unlikely]] return slice_ended(x, s, std::move(reason));
  BatchState& b = *x.batch;
  const auto it = live_.find(&b);
  if (it == live_.end()) return;
  Live& live = it->second;
  const Transfer& t = x.t;
  if (s == TransferStatus::ok && (t.op == TransferOp::read || t.op == TransferOp::write)) {
    e_.count.bytes.fetch_add(t.length, std::memory_order_relaxed);
  }
  if (writes(t.op) && !b.notify.empty()) {
    Peer* p = e_.peer(t.remote.peer);
    auto w = live.writes_left.find(p);
    if (w != live.writes_left.end()) {
      if (s != TransferStatus::ok) {
        live.writes_left.erase(w);  // a write failed: no notification for that peer
      } else if (--w->second == 0) {
        live.writes_left.erase(w);
        // Every write of the batch to this peer has completed: the data is in its memory.
        Link* to = ready(p->link) ? p->link : pick(*p, nullptr);
        if (to != nullptr) {
          try {
            send(*to, ew::encode(ew::notify(b.notify)));
            e_.count.notifications_sent.fetch_add(1, std::memory_order_relaxed);
          } catch (...) {
          }
        }
      }
    }
  }
  ++ended_;
  const bool last = --live.left == 0;
  auto keep = last ? std::move(live.batch) : nullptr;  // the batch outlives finish() below
  if (last) live_.erase(it);
  b.finish(x, s, std::move(reason));
}

void Worker::on_completion(DataPath& dp, const Completion& c) {
  Link& l = *static_cast<Link*>(dp.context);
  const WrRing& ring = dp.lane(0).sq;
  const std::uint64_t seq = ring.head() - 1;  // the request this completion retired
  const bool part = ring.at(seq).kind == WrRing::part;
  if (c.ok() && !part && (c.wr_id & 1) == 0) [[likely]] {
    // It and every transfer posted before it on the link completed.
    walk(l, seq + 1, TransferStatus::ok, {});
    l.last_used = Clock::now();
    if (!l.backlog.empty()) queue_flush(l);  // room in the queue: what waited for it goes next
    return;
  }
  // Those before it completed; it is news of its own.
  walk(l, seq, TransferStatus::ok, {});
  l.ended = std::max(l.ended, seq + 1);
  if ((c.wr_id & 1) != 0) return bound(l, *reinterpret_cast<Window*>(c.wr_id & ~std::uint64_t{1}), c);
  auto* x = reinterpret_cast<Xfer*>(c.wr_id);
  if (part) std::erase(l.alone, x);
  --l.in_flight;
  --in_flight_;
  l.bytes_out -= std::min(l.bytes_out, x->t.length);
  l.last_used = Clock::now();
  if (c.ok()) {
    if (l.rail != nullptr && x->t.op <= TransferOp::write) {
      l.rail->bytes.fetch_add(x->t.length, std::memory_order_relaxed);
      if (x->group != nullptr) l.rail->slices.fetch_add(1, std::memory_order_relaxed);
    }
    end(*x, TransferStatus::ok, {});
  } else if (c.status == IBV_WC_WR_FLUSH_ERR) {
    lost(l, *x, TransferStatus::peer_lost,
         fmt::format("peer '{}': {}", l.peer->name, dp.failure().empty() ? "the link broke" : dp.failure()));
  } else {
    // The link breaks on it (the data path's one break routine); ended when the link is reaped.
    // What the peer refused, or this side got wrong, would fail on any rail; the rest (retries
    // exceeded, a QP or port that failed under it) is the rail's, and another may do it.
    const bool rails_fault = c.status != IBV_WC_REM_ACCESS_ERR && c.status != IBV_WC_REM_INV_REQ_ERR &&
                             c.status != IBV_WC_LOC_PROT_ERR && c.status != IBV_WC_LOC_LEN_ERR &&
                             c.status != IBV_WC_LOC_ACCESS_ERR;
    l.deferred.push_back({x, fmt::format("peer '{}': {}", l.peer->name, c.describe()), rails_fault});
  }
  if (!l.backlog.empty()) queue_flush(l);
}

void Worker::bound(Link& l, Window& w, const Completion& c) {
  --l.binds_pending;
  if (c.ok() && l.state != Link::State::closing) {
    w.bound = true;
    e_.count.windows_bound.fetch_add(1, std::memory_order_relaxed);
    e_.count.window_bind_ns.fetch_add(
        static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - w.posted).count()),
        std::memory_order_relaxed);
    announce(l, w);
  } else if (!c.ok() && l.state != Link::State::closing) {
    try {
      e_.cfg.link.log(fmt::format("engine {}: binding the window of segment '{}' for {} failed: {}", e_.name,
                                  w.segment, l.impl.info.peer_address, c.describe()));
    } catch (...) {
    }
  }
  if (w.segment.empty()) {  // withdrawn while its bind was in flight
    std::erase_if(l.windows, [&w](const auto& o) { return o.get() == &w; });
  }
  if (l.binds_pending == 0 && !l.synced_sent && l.state != Link::State::closing) {
    l.synced_sent = true;
    send(l, ew::encode(ew::synced()));
  }
}

// --- links ---------------------------------------------------------------------------------------

void Worker::link_up(Command& c) {
  auto owned = std::make_unique<Link>(std::move(*c.conn));
  Link& l = *owned;
  l.device = c.device;
  l.initiated = c.peer != nullptr;
  l.peer = c.peer;
  l.last_used = Clock::now();
  l.impl.dp.route_through(cqs_[l.device]->router, cqs_[l.device]->router);
  l.impl.dp.context = &l;
  l.ended = l.impl.dp.lane(0).sq.next_seq();
  links_.push_back(std::move(owned));
  e_.count.links.fetch_add(1, std::memory_order_relaxed);
  watch(l, true);
  send(l, ew::encode(ew::ident(e_.name, e_.epoch)));
  if (l.initiated && c.rail != nullptr) {  // a further rail of the peer's link
    Peer& p = *l.peer;
    l.rail = c.rail;
    c.rail->link = &l;
    c.rail->connecting = false;
    e_.count.rail_links.fetch_add(1, std::memory_order_relaxed);
    if (p.removed.load() || p.gone.load()) break_link(l, fmt::format("peer '{}' is gone", p.name));
    return;
  }
  if (l.initiated) {
    Peer& p = *l.peer;
    p.link = &l;
    l.rail = p.rails[0].get();
    {
      // The first rail is the port the connection chose for the peer's address.
      RailPort first;
      for (RailPort& r : local_rails(e_.layer->catalog(), e_.cfg.link.gid)) {
        if (r.device == l.impl.info.device && r.port == l.impl.info.port) first = std::move(r);
      }
      first.device = l.impl.info.device;
      first.port = l.impl.info.port;
      first.link_layer = l.impl.info.link_layer;
      first.gid = l.impl.info.local_gid.gid;
      first.active = true;
      std::lock_guard lock(p.m);
      l.rail->local = std::move(first);
      l.rail->state = "connecting";
    }
    p.connecting = false;
    p.device.store(static_cast<int>(l.device), std::memory_order_relaxed);
    e_.count.connects.fetch_add(1, std::memory_order_relaxed);
    if (p.ever_connected) e_.count.reconnects.fetch_add(1, std::memory_order_relaxed);
    p.ever_connected = true;
    if (p.removed.load()) break_link(l, fmt::format("peer '{}' was removed", p.name));
    return;
  }
  e_.count.accepts.fetch_add(1, std::memory_order_relaxed);
  // Our ports, so that the peer opens its further rails (it uses them on the link it opened).
  try {
    send(l, rails_message(l));
  } catch (const std::exception& ex) {
    e_.cfg.link.log(fmt::format("engine {}: telling {} our rails: {}", e_.name, l.impl.info.peer_address, ex.what()));
  }
  std::vector<SegmentDef> defs;
  {
    std::lock_guard lock(e_.mu);
    for (const auto& [n, d] : e_.segments) defs.push_back(d);
  }
  for (const SegmentDef& d : defs) bind_window(l, d);
  if (l.binds_pending == 0 && !l.synced_sent) {
    l.synced_sent = true;
    send(l, ew::encode(ew::synced()));
  }
}

void Worker::connect_failed(Peer& p, const std::string& why) {
  p.connecting = false;
  fail_waiting(p, TransferStatus::connect_failed, why);
  std::lock_guard lock(p.m);
  ++p.attempts;
  p.up = false;
  p.last_error = why;
  p.cv.notify_all();
}

void Worker::bind_window(Link& l, const SegmentDef& def) {
  const BufferRec* buf = e_.buffer(def.buffer);
  if (buf == nullptr) return;
  const MemoryRegion& mr = *buf->regions[l.device];
  const auto addr = reinterpret_cast<std::uint64_t>(mr.local().addr()) + def.offset;
  auto w = std::make_unique<Window>();
  w->segment = def.name;
  w->link = &l;
  if (!e_.windows) {
    if (!e_.psk) return;  // no key, no windows: nothing is offered (EngineInfo::access_model)
    w->region = {addr, def.length, mr.remote().rkey, def.access};
    w->bound = true;
    announce(l, *w);
    l.windows.push_back(std::move(w));
    return;
  }
  w->mw.reset(ibv_alloc_mw(e_.pds[l.device]->pd.get(), IBV_MW_TYPE_2));
  if (!w->mw) {
    throw Error("ibv_alloc_mw", errno, fmt::format("a window on segment '{}' for {}", def.name, l.impl.info.peer_address));
  }
  w->rkey = ibv_inc_rkey(w->mw->rkey);
  w->region = {addr, def.length, w->rkey, def.access};
  w->posted = Clock::now();
  const PostResult r = l.impl.dp.post_bind(w->mw.get(), w->rkey, MemoryRegion::Impl::raw(mr), addr, def.length,
                                           qp_access_flags(def.access), reinterpret_cast<std::uint64_t>(w.get()) | 1);
  if (!r.ok()) {
    throw Error("bind memory window", r.sys_errno,
                fmt::format("segment '{}' for {}: {}", def.name, l.impl.info.peer_address, r.describe()));
  }
  ++l.binds_pending;
  l.windows.push_back(std::move(w));
}

void Worker::announce(Link& l, const Window& w) {
  send(l, ew::encode(ew::segment(w.segment, w.region)));
}

void Worker::withdraw(const std::string& name) {
  for (auto& l : links_) {
    if (l->initiated) continue;
    for (auto it = l->windows.begin(); it != l->windows.end();) {
      Window& w = **it;
      if (w.segment != name) {
        ++it;
        continue;
      }
      if (!w.bound && w.mw) {
        w.segment.clear();  // its bind completes first; then it goes
        ++it;
        continue;
      }
      // Invalidated first (deallocating a window revokes its key), then the peer is told.
      it = l->windows.erase(it);
      if (l->state != Link::State::closing) send(*l, ew::encode(ew::withdraw(name)));
    }
  }
}

void Worker::send(Link& l, const std::vector<std::uint8_t>& msg) {
  if (l.state == Link::State::closing) return;
  try {
    l.impl.send_control(wire::MessageType::user, msg, deadline_in(std::chrono::milliseconds{1000}));
  } catch (const std::exception& e) {
    break_link(l, fmt::format("its control channel failed: {}", e.what()));
  }
}

void Worker::tick_link(Link& l, Deadline now) {
  l.impl.tick(now);
  while (!l.impl.messages.empty()) {
    const std::vector<std::uint8_t> m = std::move(l.impl.messages.front());
    l.impl.messages.pop_front();
    on_message(l, m);
  }
  if (l.impl.control_gone && l.watched) watch(l, false);  // EOF stays readable: stop looking
  if (l.state != Link::State::closing && (l.impl.dp.mode() == DataPath::Mode::broken || l.impl.dp.mode() == DataPath::Mode::closed)) {
    break_link(l, l.impl.dp.failure());
  }
}

void Worker::on_message(Link& l, std::span<const std::uint8_t> bytes) {
  ew::Message m;
  try {
    m = ew::decode(bytes);
  } catch (const std::exception& ex) {
    return break_link(l, fmt::format("it sent a malformed engine message: {}", ex.what()));
  }
  switch (m.kind) {
    case ew::Kind::ident: {
      const bool restarted = l.initiated && l.peer->epoch != 0 && l.peer->epoch != m.epoch;
      l.peer_name = m.name;
      l.peer_epoch = m.epoch;
      if (l.initiated) {
        if (restarted) e_.count.restarts.fetch_add(1, std::memory_order_relaxed);
        l.peer->epoch = m.epoch;
      } else {
        // The same engine opened a link with a new epoch: it restarted, and its links of the old
        // one are stale here and on the other workers.
        close_stale(m.name, m.epoch, &l);
        for (auto& w : e_.workers) {
          if (w.get() == this) continue;
          Command c(Command::Kind::restarted, nullptr, m.name);
          c.epoch = m.epoch;
          w->post(std::move(c));
        }
      }
      break;
    }
    case ew::Kind::segment:
    case ew::Kind::withdraw: {
      if (!l.initiated) return break_link(l, "it announced segments on a link it opened (only the accepting side does)");
      if (m.kind == ew::Kind::segment) {
        l.remote[m.name] = m.region;
      } else {
        l.remote.erase(m.name);
      }
      const std::uint32_t slot = e_.slot_of(*l.peer, m.name);
      if (l.by_slot.size() <= slot) l.by_slot.resize(slot + 1);
      l.by_slot[slot] = m.kind == ew::Kind::segment ? std::optional<RemoteRegion>(m.region) : std::nullopt;
      std::vector<RemoteRegion> all;
      for (const auto& [n, r] : l.remote) all.push_back(r);
      l.impl.dp.set_remote(std::move(all), l.impl.info.atomics);
      break;
    }
    case ew::Kind::synced:
      if (l.initiated && l.state == Link::State::syncing) make_ready(l);
      break;
    case ew::Kind::notify:
      e_.deliver({l.peer_name.empty() ? l.impl.info.peer_address : l.peer_name, std::move(m.bytes)});
      break;
    case ew::Kind::rails:
      if (!l.initiated) return break_link(l, "it sent its rails on a link it opened (only the accepting side does)");
      if (l.rail == l.peer->rails[0].get()) on_rails(l, m);  // a further rail's copy says nothing new
      break;
  }
}

void Worker::close_stale(const std::string& name, std::uint64_t epoch, const Link* except) {
  for (auto& o : links_) {
    if (o.get() == except || o->state == Link::State::closing || o->peer_epoch == 0 || o->peer_epoch == epoch) continue;
    // Links it opened to us (its windows are revoked with them), and ours to its old process.
    const bool same = o->initiated ? o->peer->name == name : o->peer_name == name;
    if (!same) continue;
    e_.count.restarts.fetch_add(1, std::memory_order_relaxed);
    break_link(*o, fmt::format("peer '{}' restarted (epoch {:#x} -> {:#x})", name, o->peer_epoch, epoch));
  }
}

void Worker::make_ready(Link& l) {
  l.state = Link::State::ready;
  Peer& p = *l.peer;
  const bool first = l.rail == p.rails[0].get();
  {
    std::lock_guard lock(p.m);
    l.rail->state = "up";
    l.rail->reason.clear();
  }
  l.rail->backoff = std::chrono::milliseconds{0};
  Fifo<Xfer*> waiting;
  std::swap(waiting, p.waiting);
  for (; !waiting.empty(); waiting.pop_front()) start_transfer(p, *waiting.front());
  if (!first) {
    std::lock_guard lock(p.m);
    p.cv.notify_all();  // Engine::connect() waits for the rails too
    return;
  }
  std::lock_guard lock(p.m);
  p.up = true;
  ++p.attempts;
  p.cv.notify_all();
}

void Worker::break_link(Link& l, const std::string& why) {
  if (l.state == Link::State::closing) return;
  l.state = Link::State::closing;
  l.broke_at = Clock::now();
  abandon_chain(l, fmt::format("peer '{}': {}", l.initiated ? l.peer->name : l.peer_name, why));
  l.impl.dp.break_connection(why, BreakCause::peer);
  const std::string reason = fmt::format("peer '{}': {}", l.initiated ? l.peer->name : l.peer_name, why);
  while (!l.backlog.empty()) {
    Xfer* x = l.backlog.front();
    l.backlog.pop_front();
    lost(l, *x, TransferStatus::peer_lost, reason);
  }
  l.backlog_bytes = 0;
  if (l.initiated && l.rail != nullptr && l.rail != l.peer->rails[0].get()) {
    if (l.rail->link == &l) rail_down(*l.peer, *l.rail, why, /*went_down=*/true);
  } else if (l.initiated && l.rail != nullptr) {
    std::lock_guard lock(l.peer->m);
    l.rail->state = "down";
    l.rail->reason = why;
  }
  if (l.initiated && l.peer->link == &l) {
    Peer& p = *l.peer;
    p.link = nullptr;
    // Transfers that waited for this link to be ready: another attempt, unless the peer is gone.
    if (!p.waiting.empty() && !p.removed.load() && !p.gone.load() && !p.connecting) {
      p.connecting = true;
      e_.request_connect(&p);
    }
    std::lock_guard lock(p.m);
    p.up = false;
  }
}

void Worker::break_links(Peer& p, const std::string& why) {
  if (p.link != nullptr) break_link(*p.link, why);
  for (std::size_t k = 1; k < p.rails.size(); ++k) {
    if (p.rails[k]->link != nullptr) break_link(*p.rails[k]->link, why);
  }
}

void Worker::reap_links() {
  for (auto it = links_.begin(); it != links_.end();) {
    Link& l = **it;
    if (l.state != Link::State::closing) {
      ++it;
      continue;
    }
    l.impl.dp.post_owed_markers();
    const bool peer_gone = l.impl.control_gone || l.impl.bye_received;
    if (l.impl.dp.outstanding() > 0 ||
        (!l.deferred.empty() && !peer_gone && Clock::now() - l.broke_at < kPeerGoneGrace)) {
      ++it;
      continue;
    }
    for (Link::Deferred& d : l.deferred) {
      if (peer_gone) {
        // The peer closed this link (its process died, or only this rail failed on its side and
        // its windows went with the link): another rail of a live peer does it.
        lost(l, *d.x, TransferStatus::peer_lost,
             fmt::format("{} (the peer's process went away: {})", d.reason, l.impl.control_gone_reason()));
      } else if (d.transport) {
        lost(l, *d.x, TransferStatus::failed, std::move(d.reason));
      } else {
        end(*d.x, TransferStatus::failed, std::move(d.reason));
      }
    }
    l.deferred.clear();
    // Nothing is outstanding: what was retired without news (behind a drain marker) completed;
    // a split transfer whose parts never all came back did not.
    walk(l, l.impl.dp.lane(0).sq.next_seq(), TransferStatus::ok, {});
    for (Xfer* x : l.alone) lost(l, *x, TransferStatus::peer_lost, fmt::format("peer '{}': the link broke", l.initiated ? l.peer->name : l.peer_name));
    l.alone.clear();
    close_link(l);
    it = links_.erase(it);
  }
}

void Worker::close_link(Link& l) noexcept {
  watch(l, false);
  std::erase(to_flush_, &l);
  l.windows.clear();  // revoked before the QP goes
  l.impl.close(std::chrono::milliseconds{500});
  if (l.initiated && l.peer->link == &l) l.peer->link = nullptr;
  if (l.rail != nullptr && l.rail->link == &l) l.rail->link = nullptr;
  e_.count.links.fetch_sub(1, std::memory_order_relaxed);
}

bool Worker::evict_one() {
  Link* victim = nullptr;
  for (auto& l : links_) {
    const bool idle = l->state == Link::State::ready && l->in_flight == 0 && l->backlog.empty() &&
                      l->binds_pending == 0 && (!l->initiated || l->peer->waiting.empty());
    const bool accepted_idle = !l->initiated && l->state != Link::State::closing && l->in_flight == 0 && l->binds_pending == 0;
    if ((idle || accepted_idle) && (victim == nullptr || l->last_used < victim->last_used)) victim = l.get();
  }
  if (victim == nullptr) return false;
  e_.count.evictions.fetch_add(1, std::memory_order_relaxed);
  // An evicted further rail is not probed: it opens again with the peer's next first link.
  if (victim->rail != nullptr) victim->rail->wanted = false;
  break_link(*victim, "evicted to stay within the engine's QP budget (idle)");
  reap_links();
  return true;
}

void Worker::watch(Link& l, bool on) {
  if (l.watched == on || !l.impl.control) return;
  if (on) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = reinterpret_cast<std::uint64_t>(&l);
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, l.impl.control->fd(), &ev) == 0) l.watched = true;
  } else {
    (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, l.impl.control->fd(), nullptr);
    l.watched = false;
  }
}

void Worker::fail_waiting(Peer& p, TransferStatus s, const std::string& why) noexcept {
  while (!p.waiting.empty()) {
    Xfer* x = p.waiting.front();
    p.waiting.pop_front();
    end(*x, s, why);
  }
}

void Worker::check_retiring() noexcept {
  for (auto it = retiring_.begin(); it != retiring_.end();) {
    const std::uint32_t id = (*it)->buffer;
    bool used = false;
    for (const auto& [b, live] : live_) {
      for (std::uint32_t i = 0; i < b->size && !used; ++i) {
        used = b->x[i].t.local.id == id && b->x[i].status.load(std::memory_order_relaxed) == TransferStatus::pending;
      }
      if (used) break;
    }
    if (used) {
      ++it;
    } else {
      (*it)->worker_done();
      it = retiring_.erase(it);
    }
  }
}

}  // namespace rdmakit::detail
