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

}  // namespace

Worker::Worker(Engine::Impl& e, std::uint32_t index) : e_(e), index_(index) {
  wake_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_) throw Error("eventfd", errno, "an engine worker's wake-up");
  epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) throw Error("epoll_create1", errno, "an engine worker");
  add_fd(epoll_.get(), wake_.get(), kWake);
  chain_.resize(e.cfg.link.send_depth);
  chain_slices_.assign(e.cfg.link.send_depth, LocalSlice::empty());
  chain_recs_.resize(e.cfg.link.send_depth);
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
    for (Link::Deferred& d : l->deferred) end(*d.batch, d.index, TransferStatus::failed, std::move(d.reason));
    l->deferred.clear();
    while (l->in_flight > 0) {
      Record* r = take_posted(*l);
      end(*r->batch, r->index, TransferStatus::peer_lost, closed);
    }
    close_link(*l);
  }
  links_.clear();
  for (std::uint32_t id = 1; Peer* p = e_.peer(id); ++id) {
    if (p->worker != this) continue;
    while (!p->waiting.empty()) {
      const auto w = p->waiting.front();
      p->waiting.pop_front();
      end(*w.batch, w.index, TransferStatus::peer_lost, closed);
    }
  }
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
    const Deadline now = Clock::now();
    if (now >= next_tick_) {
      next_tick_ = now + std::chrono::milliseconds{1};
      sleep(now);  // a zero wait: the links' control channels, device events
      reap_links();
    }
    if (!forever && now >= until) break;
    if (got == 0 && in_flight_ == 0 && to_flush_.empty() && !has_mail_.load(std::memory_order_acquire)) {
      // A closing link is reaped once its peer's fate is known (Link::deferred): look again soon.
      const bool closing = std::any_of(links_.begin(), links_.end(),
                                       [](const auto& l) { return l->state == Link::State::closing; });
      const auto nap = closing ? std::chrono::milliseconds{5} : std::chrono::milliseconds{1000};
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
    case Command::Kind::connect_failed: connect_failed(*c.peer, c.text); break;
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
        if (p.link != nullptr) break_link(*p.link, fmt::format("peer '{}' was removed", p.name));
        while (!p.waiting.empty()) {
          const auto w = p.waiting.front();
          p.waiting.pop_front();
          end(*w.batch, w.index, TransferStatus::peer_lost, fmt::format("peer '{}' was removed", p.name));
        }
      }
      // Its access to our segments goes with the links it opened to us.
      for (auto& l : links_) {
        if (!l->initiated && l->peer_name == c.text) break_link(*l, fmt::format("peer '{}' was removed", c.text));
      }
      break;
    }
    case Command::Kind::evict: (void)evict_one(); break;
    case Command::Kind::restarted: close_stale(c.text, c.epoch, nullptr); break;
    case Command::Kind::kick: {
      Peer& p = *c.peer;
      if (p.link != nullptr && p.link->state == Link::State::ready) {
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

void Worker::submit(const std::shared_ptr<BatchState>& b, const std::vector<std::uint32_t>& indexes) {
  Live& live = live_[b.get()];
  live.batch = b;
  live.left += static_cast<std::uint32_t>(indexes.size());
  for (const std::uint32_t i : indexes) {
    const Transfer& t = b->transfers[i];
    if (writes(t.op) && !b->notify.empty()) ++live.writes_left[e_.peer(t.remote.peer)];
  }
  for (const std::uint32_t i : indexes) start_transfer(*e_.peer(b->transfers[i].remote.peer), *b, i);
}

void Worker::start_transfer(Peer& p, BatchState& b, std::uint32_t i) {
  if (p.removed.load(std::memory_order_relaxed)) {
    return end(b, i, TransferStatus::peer_lost, fmt::format("peer '{}' was removed", p.name));
  }
  Link* l = p.link;
  if (l != nullptr && l->state == Link::State::ready) {
    l->backlog.push_back({&b, i});
    queue_flush(*l);
    return;
  }
  p.waiting.push_back({&b, i});
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
  // flush() neither queues nor closes a link, so the list holds still while it runs.
  for (Link* l : to_flush_) {
    l->flush_queued = false;
    flush(*l);
  }
  to_flush_.clear();
}

void Worker::posted(Link& l, Record* r) {
  const auto cap = static_cast<std::uint32_t>(l.posted.size());
  l.posted[(l.posted_head + l.in_flight) % cap] = r;
  ++l.in_flight;
  ++in_flight_;
}

Record* Worker::take_posted(Link& l) {
  Record* r = l.posted[l.posted_head];
  l.posted_head = (l.posted_head + 1) % static_cast<std::uint32_t>(l.posted.size());
  --l.in_flight;
  --in_flight_;
  return r;
}

bool Worker::prepare(Link& l, BatchState& b, std::uint32_t i, std::size_t n) {
  const Transfer& t = b.transfers[i];
  const std::optional<RemoteRegion>* seg = t.remote.slot < l.by_slot.size() ? &l.by_slot[t.remote.slot] : nullptr;
  if (seg == nullptr || !seg->has_value()) {
    std::string name;
    {
      std::lock_guard lock(e_.mu);
      name = l.peer->slot_names.at(t.remote.slot);
    }
    std::string have;
    for (const auto& [nm, r] : l.remote) have += (have.empty() ? "" : ", ") + nm;
    end(b, i, TransferStatus::no_segment,
        fmt::format("peer '{}' has no segment '{}' (it has: {})", l.peer->name, name, have.empty() ? "none" : have));
    return false;
  }
  const BufferRec* buf = e_.buffer(t.local.id);
  Record& rec = b.records[i];
  rec.link = &l;
  chain_slices_[n] = buf->slices[l.device].subslice(t.local_offset, t.length);
  WorkRequest& w = chain_[n];
  w.opcode = t.op == TransferOp::read ? Opcode::read
             : t.op == TransferOp::write ? Opcode::write
             : t.op == TransferOp::fetch_add ? Opcode::fetch_add
                                              : Opcode::compare_swap;
  w.local = {&chain_slices_[n], 1};
  w.remote = **seg;
  w.remote_offset = t.remote_offset;
  w.compare_add = t.compare_add;
  w.swap = t.swap;
  w.wr_id = reinterpret_cast<std::uint64_t>(&rec);
  w.signaled = false;
  chain_recs_[n] = &rec;
  return true;
}

void Worker::flush(Link& l) {
  // A chain signals every kSignalEvery-th request and its last, so the queue drains (and the
  // backlog refills it) while the rest of the chain is still on the wire.
  constexpr std::size_t kSignalEvery = 16;
  DataPath& dp = l.impl.dp;
  const std::uint64_t max_msg = dp.limits().max_msg_size;
  while (!l.backlog.empty() && l.state == Link::State::ready) {
    const std::size_t room = std::min<std::size_t>(dp.lanes()[0].sq.free(), chain_.size());
    if (room == 0) return;  // a completion makes room, and queues the link again
    std::size_t n = 0;
    while (n < room && !l.backlog.empty()) {
      const auto w = l.backlog.front();
      const Transfer& t = w.batch->transfers[w.index];
      if (t.length > max_msg && n > 0) break;  // a transfer the data path splits goes alone
      l.backlog.pop_front();
      if (!prepare(l, *w.batch, w.index, n)) continue;
      ++n;
      if (t.length > max_msg) break;
    }
    if (n == 0) continue;
    for (std::size_t k = 0; k < n; ++k) chain_[k].signaled = (k + 1) % kSignalEvery == 0 || k + 1 == n;
    PostResult r;
    if (n == 1 && chain_slices_[0].length() > max_msg) {
      const WorkRequest& w = chain_[0];
      r = w.opcode == Opcode::read ? dp.post_one<Opcode::read>(chain_slices_[0], w.remote, w.remote_offset, 0, 0, 0, w.wr_id)
                                   : dp.post_one<Opcode::write>(chain_slices_[0], w.remote, w.remote_offset, 0, 0, 0, w.wr_id);
      r.index = 0;
    } else {
      r = dp.post_batch({chain_.data(), n});
    }
    if (r.ok()) {
      for (std::size_t k = 0; k < n; ++k) posted(l, chain_recs_[k]);
      continue;
    }
    // Nothing was posted (the data path refuses a chain whole), except when the provider
    // failed part way: those before r.index went.
    const std::size_t went = r.status == PostStatus::failed ? r.index : 0;
    for (std::size_t k = 0; k < went; ++k) posted(l, chain_recs_[k]);
    if (r.status == PostStatus::queue_full) {
      for (std::size_t k = n; k-- > 0;) l.backlog.push_front({chain_recs_[k]->batch, chain_recs_[k]->index});
      return;
    }
    const Record* bad = chain_recs_[std::min(r.index, n - 1)];
    std::string why = fmt::format("peer '{}': {}", l.peer->name, r.describe());
    if (r.status == PostStatus::unsupported) why += " (the peer's device or this one has no atomics)";
    if (r.status == PostStatus::not_ready) why += ": " + dp.failure();
    if (r.status == PostStatus::failed) {
      for (std::size_t k = went; k < n; ++k) end(*chain_recs_[k]->batch, chain_recs_[k]->index, TransferStatus::failed, why);
      return break_link(l, why);
    }
    // One request was refused: it ends with the reason; the rest go back to the front.
    for (std::size_t k = n; k-- > 0;) {
      if (chain_recs_[k] != bad) l.backlog.push_front({chain_recs_[k]->batch, chain_recs_[k]->index});
    }
    end(*bad->batch, bad->index, status_of(r.status), std::move(why));
  }
}

void Worker::end(BatchState& b, std::uint32_t i, TransferStatus s, std::string reason) noexcept {
  const auto it = live_.find(&b);
  if (it == live_.end()) return;
  Live& live = it->second;
  const Transfer& t = b.transfers[i];
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
        if (p->link != nullptr && p->link->state == Link::State::ready) {
          try {
            send(*p->link, ew::encode(ew::notify(b.notify)));
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
  b.finish(i, s, std::move(reason));
}

void Worker::on_completion(DataPath& dp, const Completion& c) {
  if ((c.wr_id & 1) != 0) {
    auto* w = reinterpret_cast<Window*>(c.wr_id & ~std::uint64_t{1});
    Link& l = *w->link;
    --l.binds_pending;
    if (c.ok() && l.state != Link::State::closing) {
      w->bound = true;
      e_.count.windows_bound.fetch_add(1, std::memory_order_relaxed);
      announce(l, *w);
    } else if (!c.ok() && l.state != Link::State::closing) {
      try {
        e_.cfg.link.log(fmt::format("engine {}: binding the window of segment '{}' for {} failed: {}", e_.name,
                                    w->segment, l.impl.info.peer_address, c.describe()));
      } catch (...) {
      }
    }
    if (w->segment.empty()) {  // withdrawn while its bind was in flight
      std::erase_if(l.windows, [w](const auto& x) { return x.get() == w; });
    }
    if (l.binds_pending == 0 && !l.synced_sent && l.state != Link::State::closing) {
      l.synced_sent = true;
      send(l, ew::encode(ew::synced()));
    }
    return;
  }
  auto* rec = reinterpret_cast<Record*>(c.wr_id);
  Link& l = *rec->link;
  // Every transfer posted on the link before this one has completed successfully (a failed one
  // would have been reported first, with a completion of its own).
  while (l.in_flight > 0) {
    Record* first = take_posted(l);
    if (first == rec) break;
    end(*first->batch, first->index, TransferStatus::ok, {});
  }
  l.last_used = Clock::now();
  if (c.ok()) {
    end(*rec->batch, rec->index, TransferStatus::ok, {});
  } else if (c.status == IBV_WC_WR_FLUSH_ERR) {
    end(*rec->batch, rec->index, TransferStatus::peer_lost,
        fmt::format("peer '{}': {}", l.peer->name, dp.failure().empty() ? "the link broke" : dp.failure()));
  } else {
    // The link breaks on it (the data path's one break routine); ended when the link is reaped.
    l.deferred.push_back({rec->batch, rec->index, fmt::format("peer '{}': {}", l.peer->name, c.describe())});
  }
  // Room in the queue: what waited for it goes after this poll.
  if (!l.backlog.empty()) queue_flush(l);
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
  l.posted.resize(l.impl.dp.limits().send_depth);  // never more in flight than the queue holds
  links_.push_back(std::move(owned));
  e_.count.links.fetch_add(1, std::memory_order_relaxed);
  watch(l, true);
  send(l, ew::encode(ew::ident(e_.name, e_.epoch)));
  if (l.initiated) {
    Peer& p = *l.peer;
    p.link = &l;
    p.connecting = false;
    e_.count.connects.fetch_add(1, std::memory_order_relaxed);
    if (p.ever_connected) e_.count.reconnects.fetch_add(1, std::memory_order_relaxed);
    p.ever_connected = true;
    if (p.removed.load()) break_link(l, fmt::format("peer '{}' was removed", p.name));
    return;
  }
  e_.count.accepts.fetch_add(1, std::memory_order_relaxed);
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
  while (!p.waiting.empty()) {
    const auto w = p.waiting.front();
    p.waiting.pop_front();
    end(*w.batch, w.index, TransferStatus::connect_failed, why);
  }
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
  std::deque<Peer::Waiting> waiting;
  waiting.swap(p.waiting);
  for (const auto& w : waiting) start_transfer(p, *w.batch, w.index);
  std::lock_guard lock(p.m);
  p.up = true;
  ++p.attempts;
  p.cv.notify_all();
}

void Worker::break_link(Link& l, const std::string& why) {
  if (l.state == Link::State::closing) return;
  l.state = Link::State::closing;
  l.broke_at = Clock::now();
  l.impl.dp.break_connection(why, BreakCause::peer);
  const std::string reason = fmt::format("peer '{}': {}", l.initiated ? l.peer->name : l.peer_name, why);
  while (!l.backlog.empty()) {
    const auto w = l.backlog.front();
    l.backlog.pop_front();
    end(*w.batch, w.index, TransferStatus::peer_lost, reason);
  }
  if (l.initiated && l.peer->link == &l) {
    Peer& p = *l.peer;
    p.link = nullptr;
    // Transfers that waited for this link to be ready: another attempt, unless the peer is gone.
    if (!p.waiting.empty() && !p.removed.load() && !p.connecting) {
      p.connecting = true;
      e_.request_connect(&p);
    }
    std::lock_guard lock(p.m);
    p.up = false;
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
        end(*d.batch, d.index, TransferStatus::peer_lost,
            fmt::format("{} (the peer's process went away: {})", d.reason, l.impl.control_gone_reason()));
      } else {
        end(*d.batch, d.index, TransferStatus::failed, std::move(d.reason));
      }
    }
    l.deferred.clear();
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
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, l.impl.control.get(), &ev) == 0) l.watched = true;
  } else {
    (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, l.impl.control.get(), nullptr);
    l.watched = false;
  }
}

}  // namespace rdmakit::detail
