// SPDX-License-Identifier: Apache-2.0
// An engine worker: its shared CQs, its thread and loop, and the commands other threads send it.
// Everything here runs on the worker's thread (or in progress()), except post(), attach() and
// stop(). Its transfers are in worker_transfers.cpp, its links in worker_links.cpp, its rails in
// worker_rails.cpp.
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "common/thread_name.hpp"
#include "common/cpu.hpp"
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

}  // namespace

Worker::Worker(Engine::Impl& e, std::uint32_t index) : e_(e), index_(index) {
  wake_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_) throw Error("eventfd", errno, "an engine worker's wake-up");
  epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) throw Error("epoll_create1", errno, "an engine worker");
  add_fd(epoll_.get(), wake_.get(), kWake);
  figures_count_ = e.device_count();
  figures_ = std::make_unique<PathFigures[]>(figures_count_);
  const auto& devices = e.rdma_devices;
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
  // The software transports' CQs (tcp, shm), for those offered (none where the engine is RDMA's
  // alone): their links are bounded by the QP budget and the router's tags.
  for (std::uint32_t d = e.rdma_count; d < e.device_count(); ++d) {
    if (!e.offers(e.soft_kind(d))) {
      cqs_.push_back(nullptr);
      continue;
    }
    auto q = std::make_unique<DeviceCqs>();
    q->capacity = std::min<std::uint32_t>(e.cfg.max_qps, kMaxTags / 2);
    q->soft = std::make_unique<soft::Cq>(*e.soft[d - e.rdma_count], q->capacity * depth);
    q->router.init(q->soft->cq(), 2 * q->capacity);
    add_fd(epoll_.get(), q->soft->fd(), kChannel + d);
    cqs_.push_back(std::move(q));
  }
}

Worker::~Worker() { stop(); }

void Worker::start() {
  threaded_ = true;
  thread_ = std::thread([this] {
    name_worker_thread(index_);
    (void)run(Deadline::max(), true);
  });
  // Pinned from here, so that a CPU the process may not run on (its cpuset, taskset) fails the
  // engine's construction rather than leave the worker running anywhere.
  const std::vector<int>& cpus = e_.cfg.worker_cpus;
  if (cpus.empty()) return;
  const int cpu = cpus[index_ % cpus.size()];
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<std::size_t>(cpu), &set);
  if (const int rc = ::pthread_setaffinity_np(thread_.native_handle(), sizeof set, &set); rc != 0) {
    throw Error("engine config", EINVAL,
                fmt::format("worker_cpus: CPU {} is not one this process may run on (pthread_setaffinity_np: {})", cpu,
                            errno_name(rc)),
                fmt::format("taskset -p {} and /proc/self/status (Cpus_allowed_list) say which it may", ::getpid()));
  }
}

void Worker::post(Command c) {
  {
    std::lock_guard lock(mu_);
    inbox_.push_back(std::move(c));
    has_mail_.store(true, std::memory_order_seq_cst);
  }
  if (!threaded_) return;  // progress() on the caller's thread finds it; there is no one to wake
  // A loop that is running looks at has_mail_ before it sleeps (after setting asleep_): only
  // one that may be asleep is woken, which saves the busy path a write and its wake-up a read.
  if (!asleep_.load(std::memory_order_seq_cst)) return;
  wake_thread();
}

namespace {
const std::vector<std::uint32_t> kWholeBatch;  // Worker::submit's indexes: every transfer
}  // namespace

// Another thread runs the worker while this lives (run_mu_ held): driver_ says who (a callback
// that submits then queues), whatever leaves the scope.
struct Worker::Driving {
  Driving(Worker& w, ThreadSelf me) noexcept : w_(w) { w_.driver_.store(me, std::memory_order_relaxed); }
  ~Driving() { w_.driver_.store(nullptr, std::memory_order_relaxed); }
  Driving(const Driving&) = delete;
  Driving& operator=(const Driving&) = delete;

 private:
  Worker& w_;
};

bool Worker::try_submit(const std::shared_ptr<BatchState>& b) {
  const ThreadSelf me = thread_self();
  if (!threaded_ || driver_.load(std::memory_order_relaxed) == me || wants_.load(std::memory_order_relaxed)) return false;
  std::unique_lock lock(run_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (stop_.load(std::memory_order_relaxed)) return false;  // stop() ends what is posted
  bool wake = false;
  {
    Driving driving(*this, me);
    e_.count.submits_inline.fetch_add(1, std::memory_order_relaxed);
    // The batch's submit time where telemetry took it a moment ago (one clock read less).
    now_ = e_.cfg.telemetry ? b->submitted : Clock::now();
    bool open = false;  // the batch was still in flight when the look began
    try {
      take_mail();  // what this thread (or another) posted before goes first
      submit(b, kWholeBatch);
      flush_queued_links();
      open = !b->callback_ran.load(std::memory_order_acquire);  // (a batch refused at once is not the look's)
      // One look at the devices' CQs: what completed meanwhile (on rxe the whole round trip of
      // a WRITE or READ runs inside its post) ends before submit() returns, so that wait()
      // finds its batch done without a spin, and others' completions end no later. Not the
      // software transports' (their answers need the peer's process, and each look at one is
      // system calls). now_ was read as this call began: fresh enough for the links' clocks.
      poll_while_asleep(/*fresh_clock=*/false, /*soft=*/false);
    } catch (const std::exception& ex) {
      log_failure(ex);
    }
    if (open && b->callback_ran.load(std::memory_order_acquire)) {
      e_.count.submits_ended.fetch_add(1, std::memory_order_relaxed);
      // Ended here, as a waiter's spin would have ended it: this thread polls for its batches
      // (the worker's thread, next asleep, leaves the CQs unarmed, and this thread's next
      // submit needs no arming: as enter_drive and leave_drive(true)). Not with wait_spin 0
      // (CPU before latency: the worker's thread sleeps armed, waits never poll).
      if (e_.cfg.wait_spin.count() > 0) {
        driven_.store(true, std::memory_order_relaxed);
        spinner_.store(me, std::memory_order_relaxed);
      }
    }
    // Asleep unarmed (waiters have been polling it), the worker sees this batch's completion
    // only if someone polls for it: a thread that has just polled for its own (a loop of one
    // transfer at a time) will again, and a waiter polling now will; a batch anyone else
    // submits (its end seen by a callback, the engine's descriptor, done(), another thread's
    // wait) has the CQs armed, so that its completion wakes the worker's thread.
    busy_seen_.store(expecting(), std::memory_order_seq_cst);
    if (unarmed_.load(std::memory_order_seq_cst) && expecting() != 0 && drivers_.load(std::memory_order_seq_cst) == 0 &&
        (b->on_done || e_.fd_taken.load(std::memory_order_relaxed) != 0 ||
         spinner_.load(std::memory_order_relaxed) != me)) {
      arm_and_look();
    }
    // Only what the loop would do next without a completion (a backlog left to flush) needs
    // the worker's thread woken.
    wake = !to_flush_.empty();
  }
  lock.unlock();
  serve_arm_requests();
  if (wake) wake_thread();
  return true;
}

bool Worker::try_drive() noexcept {
  const ThreadSelf me = thread_self();
  if (driver_.load(std::memory_order_relaxed) == me || wants_.load(std::memory_order_relaxed)) return false;
  std::unique_lock lock(run_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  {
    Driving driving(*this, me);
    // The mail too: a waiter that keeps taking the lock must not hold back what was posted (the
    // link its batch waits for).
    if (has_mail_.load(std::memory_order_acquire)) {
      try {
        take_mail();
      } catch (...) {
        // Out of memory in a command's handling: the worker's thread meets the rest.
      }
    }
    try {
      poll_while_asleep(/*fresh_clock=*/true, /*soft=*/true);
    } catch (const std::exception& ex) {
      log_failure(ex);  // out of memory flushing a backlog: the worker's thread meets the rest
    }
    busy_seen_.store(expecting(), std::memory_order_relaxed);
  }
  lock.unlock();
  serve_arm_requests();
  return true;
}

[[gnu::always_inline]] inline void Worker::poll_while_asleep(bool fresh_clock, bool soft) {
  if (expecting() == 0) return;
  if (poll_cqs(fresh_clock, soft) > 0) {
    flush_queued_links();
    if (!retiring_.empty()) check_retiring();
  }
  if (soft) keep_soft_readable();
}

void Worker::arm() noexcept {
  unarmed_.store(false, std::memory_order_seq_cst);
  arm_wanted_.store(false, std::memory_order_relaxed);
  for (auto& q : cqs_) {
    if (q) (void)ibv_req_notify_cq(q->router.cq(), 0);
  }
}

void Worker::arm_and_look() noexcept {
  arm();
  // A completion that arrived before arming raises no event: looked at once more, here.
  if (poll_cqs(/*fresh_clock=*/true) > 0) flush_queued_links();
}

void Worker::keep_soft_readable() noexcept {
  // A software transport's CQ descriptor is readable while its sockets have data, not while
  // completions it already took wait in its queue (a poll takes at most a router's batch):
  // "arming" one makes it readable again if any wait, so the worker's thread sees them.
  for (auto& q : cqs_) {
    if (q && q->soft) (void)ibv_req_notify_cq(q->router.cq(), 0);
  }
}

std::chrono::milliseconds Worker::unarmed_nap() const noexcept {
  const auto spin = std::chrono::duration_cast<std::chrono::milliseconds>(e_.cfg.wait_spin);
  return std::clamp(8 * spin, std::chrono::milliseconds{5}, std::chrono::milliseconds{50});
}

void Worker::enter_drive() noexcept {
  drivers_.fetch_add(1, std::memory_order_seq_cst);
  // Its thread, next asleep, leaves the CQs to the waiters: also when it was awake for this
  // waiter's whole spin (it woke at an armed completion, took the lock, ended the batch), or
  // armed CQs would keep waking it at every transfer.
  driven_.store(true, std::memory_order_relaxed);
}

void Worker::leave_drive(bool ended) noexcept {
  // Whose submits need no arming (try_submit): a thread whose own wait just ended by polling.
  spinner_.store(ended ? thread_self() : nullptr, std::memory_order_relaxed);
  // The last to leave, the worker asleep unarmed: what is still in flight must wake it (what a
  // submit posts after this look arms for itself: try_submit publishes busy_seen_ first, then
  // looks at drivers_, seq_cst both).
  if (drivers_.fetch_sub(1, std::memory_order_seq_cst) == 1 && busy_seen_.load(std::memory_order_seq_cst) != 0) {
    request_arm();
  }
}

void Worker::request_arm() noexcept {
  // Armed: nothing to ask. Its thread goes to sleep unarmed only with nothing in flight (it
  // polls while anything is), so a request that sees it armed misses nothing; what is posted
  // after it sleeps goes through try_submit, which arms, or through a waiter that polls.
  if (!unarmed_.load(std::memory_order_seq_cst)) return;
  arm_wanted_.store(true, std::memory_order_seq_cst);
  serve_arm_requests();
}

void Worker::serve_arm_requests_now() noexcept {
  // Whoever holds the lock when a request comes serves it after letting go (here, again): the
  // worker's thread as it next sleeps, a submitter or a waiter right after.
  // A thread already running the worker (a callback that waits, inside submit() or wait()) holds
  // its lock: it serves the request as it lets go.
  if (driver_.load(std::memory_order_relaxed) == thread_self()) return;
  while (arm_wanted_.load(std::memory_order_seq_cst) && unarmed_.load(std::memory_order_seq_cst)) {
    std::unique_lock lock(run_mu_, std::try_to_lock);
    if (!lock.owns_lock()) return;  // its holder looks after it lets go
    Driving driving(*this, thread_self());
    if (!unarmed_.load(std::memory_order_relaxed)) break;
    if (expecting() == 0 && drivers_.load(std::memory_order_seq_cst) == 0) {
      // Nothing of it to complete: it arms as it next sleeps (or a submit does).
      arm_wanted_.store(false, std::memory_order_relaxed);
      break;
    }
    if (drivers_.load(std::memory_order_seq_cst) != 0) break;  // a waiter polls: its leaving asks again
    arm_and_look();
  }
}

void Worker::take_back(bool locked) noexcept {
  // Awake: mail posted from here on is seen by the loop (seq_cst with post()'s look).
  asleep_.store(false, std::memory_order_seq_cst);
  if (!locked) {
    // Others hold the lock only for a post or a poll, and take it no more once they see wants_:
    // a short spin gets it without a futex round trip (a waiter that keeps taking and releasing
    // it would otherwise wake this thread at each release, and be slowed by each wake-up).
    wants_.store(true, std::memory_order_seq_cst);
    for (std::uint32_t i = 0; !run_mu_.try_lock(); ++i) {
      if (i == kTakeBackSpins) {
        run_mu_.lock();  // one that runs long (a callback, a big batch): wait for it asleep
        break;
      }
      cpu_relax();
    }
    wants_.store(false, std::memory_order_relaxed);
  }
  driver_.store(thread_self(), std::memory_order_relaxed);
}

void Worker::wake_thread() noexcept {
  const std::uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof one);
}

void Worker::nudge() noexcept {
  if (threaded_ && std::this_thread::get_id() != thread_.get_id()) wake_thread();
}

void Worker::log_failure(const std::exception& ex) noexcept {
  try {
    e_.cfg.link.log(fmt::format("engine {}: worker {}: {}", e_.name, index_, ex.what()));
  } catch (...) {
    // Out of memory for the line: the failure itself was handled.
  }
}

void Worker::take_mail_now() {
  {
    // Swapped, not moved: both vectors keep their storage, so a post allocates nothing.
    std::lock_guard lock(mu_);
    mail_.swap(inbox_);
    has_mail_.store(false, std::memory_order_relaxed);
  }
  for (Command& c : mail_) {
    try {
      handle(c);
    } catch (const std::exception& ex) {
      log_failure(ex);
    }
  }
  mail_.clear();
  // A burst (thousands of commands posted faster than handled) leaves its storage behind:
  // given back past the size steady work needs, so memory follows the backlog down again.
  if (mail_.capacity() > kMailKept) std::vector<Command>().swap(mail_);
}

std::optional<Attachment> Worker::attach(std::uint32_t device) {
  if (cqs_.at(device) == nullptr) return std::nullopt;  // a transport this engine does not offer
  DeviceCqs& q = *cqs_[device];
  {
    std::lock_guard lock(cq_mu_);
    if (q.links >= q.capacity) return std::nullopt;
    ++q.links;
  }
  Attachment a;
  a.dev = q.dev;
  if (q.soft) {
    a.soft_dev = e_.soft[device - e_.rdma_count].get();
    a.soft_cq = q.soft.get();
  }
  a.send_cq = a.recv_cq = q.router.cq();
  a.owner = this;
  a.keep = std::shared_ptr<void>(this, [this, &q](Worker*) {
    std::lock_guard lock(cq_mu_);
    --q.links;
  });
  return a;
}

void Worker::stop() noexcept {
  if (stop_.exchange(true)) return;
  wake_thread();
  if (thread_.joinable()) thread_.join();
  // The thread has gone; the engine's gate is closed (no waiter polls) and no submit may race
  // with the destructor. Held, so that a callback that submits queues (driver_).
  std::lock_guard run_lock(run_mu_);
  driver_.store(thread_self(), std::memory_order_relaxed);
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
    (void)poll_cqs();
    for (auto& l : links_) l->impl.dp.post_owed_markers();
  }
  // What never completed ends now; only this worker's transfers (the others' workers end theirs,
  // maybe at this very moment).
  const std::string closed = "the engine closed before the transfer completed";
  // BYE behind what waits in each outbox, all of them sent together within one deadline: peers
  // that do not read are not waited for one after another.
  const Deadline bye_until = deadline_in(std::chrono::milliseconds{500});
  for (;;) {
    bool all = true;
    for (auto& l : links_) all = said_bye(*l, Clock::now()) && all;
    if (all || Clock::now() >= bye_until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
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
  const std::uint32_t ids = e_.peer_ids_used.load(std::memory_order_acquire);
  for (std::uint32_t id = 1; id <= ids; ++id) {
    Peer* p = e_.peer(id);
    if (p == nullptr || p->worker != this) continue;
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
  // Held while it runs, released only while it sleeps (sleep()). Already held by this thread
  // (progress() -> a callback -> connect(), which drives progress itself): run inside it.
  const ThreadSelf me = thread_self();
  const bool nested = driver_.load(std::memory_order_relaxed) == me;
  std::unique_lock lock(run_mu_, std::defer_lock);
  if (!nested) lock.lock();
  driver_.store(me, std::memory_order_relaxed);
  ended_ = 0;
  for (;;) {
    if (stop_.load(std::memory_order_relaxed) && forever) break;
    take_mail();
    const int got = poll_cqs();
    flush_queued_links();
    if (!retiring_.empty() && got > 0) check_retiring();
    const Deadline now = Clock::now();
    now_ = now;
    if (now >= next_tick_) {
      next_tick_ = now + std::chrono::milliseconds{1};
      sleep(now);  // a zero wait: the links' control channels, device events
      reap_links();
      if (!probes_.empty()) probe_rails(now);
      if (now >= next_report_) report_active(now);
      if (!retiring_.empty()) check_retiring();
    }
    if (index_ == 0 && !leases_.empty() && now >= next_lease_check_) next_lease_check_ = check_leases(now);
    if (!forever && now >= until) break;
    if (got == 0 && in_flight_ == 0 && to_flush_.empty() && !has_mail_.load(std::memory_order_acquire) &&
        !soft_lingers(now)) {
      // A closing link is reaped once its peer's fate is known (Link::deferred): look again soon.
      const bool closing = std::any_of(links_.begin(), links_.end(),
                                       [](const auto& l) { return l->state == Link::State::closing; });
      const auto nap = closing             ? std::chrono::milliseconds{5}
                       : !probes_.empty() ? std::chrono::milliseconds{50}
                                          : std::chrono::milliseconds{1000};
      Deadline wake = forever ? now + nap : std::min(until, now + nap);
      if (index_ == 0 && !leases_.empty()) wake = std::min(wake, next_lease_check_);  // a lease's end
      sleep(wake);
      reap_links();
      if (!forever && Clock::now() >= until) break;
    }
  }
  if (!nested) driver_.store(nullptr, std::memory_order_relaxed);
  return ended_;
}

bool Worker::soft_lingers(Deadline now) const noexcept {
  // A tcp or shm link served its peer a moment ago (this side its target): the peer's next
  // request is likely as near, and a sleep's wake-up costs more than polling until it comes (on
  // a VM, tens of microseconds per batch: a tenth of a bulk shm link's bandwidth).
  const auto linger = std::min<std::chrono::nanoseconds>(kSoftLinger, e_.cfg.wait_spin);
  if (linger.count() == 0) return false;  // wait_spin 0: CPU before latency
  for (const auto& q : cqs_) {
    if (q && q->soft && now - q->soft->last_work() < linger) return true;
  }
  return false;
}

int Worker::poll_cqs(bool fresh_clock, bool soft) noexcept {
  int got = 0;
  for (auto& q : cqs_) {
    if (q && (soft || !q->soft)) got += q->router.poll([this](DataPath& dp, const Completion& c) { on_completion(dp, c); });
  }
  // Another thread running the worker: its loop's clock may be a nap old (what the walk stamps
  // on each link), read here only when there is something to stamp.
  if (fresh_clock && !to_walk_.empty()) now_ = Clock::now();
  // The links' transfers that completed, each link walked once for all of this poll's
  // completions (on_completion).
  const auto report_every = active_every();
  for (Link* l : to_walk_) {
    walk(*l, l->walk_to, TransferStatus::ok, {});
    l->walk_to = 0;
    l->last_used = now_;
    if (now_ - l->active_sent >= report_every) to_report_.push_back(l);
    if (!l->backlog.empty()) queue_flush(*l);  // room in the queue: what waited for it goes next
  }
  to_walk_.clear();
  if (!to_report_.empty()) [[unlikely]] {
    // The peer sees none of these one-sided transfers: it hears that the link is busy from
    // here, so that it never evicts it as idle (Worker::evict_one).
    for (Link* l : to_report_) tell_active(*l, now_);
    to_report_.clear();
  }
  // One at a time, taken off first: breaking a link may run callbacks that drive this worker
  // again (no worker threads), and a link reaped meanwhile leaves the list (close_link).
  while (!to_break_.empty()) [[unlikely]] {
    Link* l = to_break_.back();
    to_break_.pop_back();
    if (l->state != Link::State::closing) break_link_anyway(*l, [l] { return l->impl.dp.failure(); });
  }
  return got;
}

std::chrono::milliseconds Worker::active_every() const noexcept {
  return std::min(e_.cfg.idle_after / 4, std::chrono::milliseconds{1000});
}

void Worker::report_active(Deadline now) noexcept {
  const auto every = active_every();
  next_report_ = now + every;
  for (auto& l : links_) {
    // Busy, or bytes moved since the last report (the peer's figures of this link catch up).
    if (l->initiated && ready(l.get()) && (l->in_flight > 0 || !l->backlog.empty() || l->moved != l->moved_told) &&
        now - l->active_sent >= every) {
      tell_active(*l, now);
    }
    // A peer that stopped reading its control channel: the link goes, on its own deadline.
    if (l->state != Link::State::closing && l->impl.control_waiting() > 0) {
      flush_outbox(*l);
      (void)outbox_stalled(*l, now);
    }
  }
}

void Worker::tell_active(Link& l, Deadline now) noexcept {
  l.active_sent = now;
  l.moved_told = l.moved;
  send(l, ew::active(l.moved));
}

// Waits on the worker's descriptors until `until` (not at all when it has passed): CQ events
// (armed first), the wake-up, links' control channels, device events.
namespace {
// epoll_wait's timeout for a sleep from `now` to `until` (rounded up, at most 1 s).
int epoll_ms(Deadline now, Deadline until) noexcept {
  return static_cast<int>(
      std::min<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count() + 1, 1000));
}
}  // namespace

void Worker::sleep(Deadline until) noexcept {
  const Deadline now = Clock::now();
  const Deadline loop_until = until;  // what the loop asked for (its timers)
  int ms = 0;
  if (until > now) {
    // While waiters poll this worker (now, or since its thread last slept), the completions
    // are theirs to find: the CQs stay unarmed, so that none wakes this thread (a wake-up per
    // transfer costs the waiter more than the wire), and the nap is short. Whoever needs them
    // armed asks (request_arm: the last waiter to leave, a wait about to sleep), and a submit
    // that no waiter will poll for arms them itself (try_submit).
    unarmed_.store(true, std::memory_order_seq_cst);
    const bool driven = driven_.exchange(false, std::memory_order_relaxed);
    busy_seen_.store(expecting(), std::memory_order_relaxed);
    if (arm_wanted_.load(std::memory_order_seq_cst) || binds_out_ != 0 ||
        (!driven && drivers_.load(std::memory_order_seq_cst) == 0)) {
      arm();
    } else {
      until = std::min(until, now + unarmed_nap());
    }
    // A completion that arrived before arming raises no event: look once more. Mail posted
    // from here on writes wake_ (asleep_ first, then the look at has_mail_).
    asleep_.store(true, std::memory_order_seq_cst);
    const int got = poll_cqs();
    if (got > 0 || !to_flush_.empty() || has_mail_.load(std::memory_order_seq_cst)) {
      asleep_.store(false, std::memory_order_relaxed);
      return;
    }
    ms = epoll_ms(now, until);
  }
  epoll_event events[64];
  int n = 0;
  if (ms > 0) {
    // Asleep, the worker is anyone's to run: a submitter posts its batch itself and a waiter
    // polls for its completions (try_submit, try_drive), with the CQs armed for this thread.
    driver_.store(nullptr, std::memory_order_relaxed);
    run_mu_.unlock();
    n = ::epoll_wait(epoll_.get(), events, 64, ms);
    // The unarmed nap ran out with nothing to tell this thread, while another thread runs the
    // worker (a submitter or waiter holds its lock, polling the CQs as this thread would): nap
    // again, up to the loop's own deadline, rather than make it step aside. Each time it does,
    // its next transfers go through this thread until the loop sleeps again (on the 2-CPU VM,
    // 1% of transfers one at a time, and their p99).
    // Never past the links' next activity report (report_active; this thread's own clock, not
    // touched by the threads that run the worker meanwhile), whose period may be shorter than
    // the loop's deadline. A link those threads break, or a rail probe they add, wakes this
    // thread (nudge()).
    const Deadline renap_until = std::min(loop_until, next_report_);
    bool held = false;
    while (n == 0 && until < loop_until && !(held = run_mu_.try_lock())) {
      const Deadline t = Clock::now();
      if (t >= renap_until) break;
      const Deadline next = std::min(renap_until, t + unarmed_nap());
      n = ::epoll_wait(epoll_.get(), events, 64, epoll_ms(t, next));
    }
    take_back(/*locked=*/held);  // a free lock, taken: no step-aside asked
  } else {
    n = ::epoll_wait(epoll_.get(), events, 64, 0);
  }
  const Deadline after = Clock::now();
  now_ = after;
  for (int i = 0; i < n; ++i) {
    const std::uint64_t tag = events[i].data.u64;
    if (tag == kWake) {
      std::uint64_t v = 0;
      (void)!::read(wake_.get(), &v, sizeof v);
    } else if (tag >= kChannel && tag < kAsync) {
      DeviceCqs& q = *cqs_[tag - kChannel];
      if (q.soft) continue;  // level-triggered: the next poll takes what made it readable
      ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      while (ibv_get_cq_event(q.channel.get(), &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
    } else if (tag >= kAsync && tag < kOwnLimit) {
      e_.rdma_devices[tag - kAsync]->pump();
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
  // Whoever waits for it (Impl::post_and_wait) is told, however it ends.
  struct Told {
    Command& c;
    ~Told() {
      if (c.handled) c.handled->one();
    }
  } told{c};
  switch (c.kind) {
    case Command::Kind::submit: submit(c.batch, c.indexes); break;
    case Command::Kind::cancel: cancel(*c.batch); break;
    case Command::Kind::link_up: link_up(c); break;
    case Command::Kind::connect_failed:
      if (c.rail != nullptr) {
        c.rail->connecting = false;
        rail_down(*c.peer, *c.rail, c.text, /*went_down=*/false);
      } else {
        connect_failed(*c.peer, c.text);
      }
      release_if_quiet(*c.peer);
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
        // A link whose peer has not proved who it is yet gets every segment at its IDENT (grant).
        if (l->initiated || l->state == Link::State::closing || !l->ident_seen) continue;
        bind_window(*l, def);
        bind_waiting(*l);
      }
      break;
    }
    case Command::Kind::withdraw:
      withdraw(c.text);
      break;
    case Command::Kind::revoke: revoke(c.text); break;
    case Command::Kind::lease_grant: lease_granted(c.lease); break;
    case Command::Kind::lease_end: lease_ended(c.lease); break;
    case Command::Kind::renew: renew(*c.peer, c.lease_id, static_cast<std::uint32_t>(c.epoch)); break;
    case Command::Kind::remove_peer: {
      Peer& p = *c.peer;
      if (p.worker == this) {
        break_links(p, fmt::format("peer '{}' was removed", p.name));
        fail_waiting(p, TransferStatus::peer_lost, fmt::format("peer '{}' was removed", p.name));
        not_linked(p, fmt::format("peer '{}' was removed", p.name));  // Engine::connect() ends now
        release_if_quiet(p);
      }
      // Its access to our segments goes with the links it opened to us.
      for (auto& l : links_) {
        if (!l->initiated && l->peer_name == c.text) break_link(*l, fmt::format("peer '{}' was removed", c.text));
      }
      break;
    }
    case Command::Kind::evict: (void)evict_one(); break;
    case Command::Kind::reclaim: break;  // handled: its token goes with the command
    case Command::Kind::credit:
      for (auto& l : links_) {
        if (l->notes == c.notes) {
          const std::uint64_t taken = l->notes->taken.load(std::memory_order_relaxed);
          if (taken > l->credits_returned && l->state != Link::State::closing) {
            send(*l, ew::credit(static_cast<std::uint32_t>(std::min<std::uint64_t>(taken - l->credits_returned, UINT32_MAX))));
            l->credits_returned = taken;
          }
          break;
        }
      }
      break;
    case Command::Kind::restarted: close_stale(c.text, c.epoch, nullptr); break;
    case Command::Kind::retire:
      // Transfers of it submitted before this command were admitted already: those after are not.
      if (BufferRec* b = e_.buffer(Buffer{c.retirement->buffer, nullptr, 0, c.retirement->generation})) {
        b->retired_by.fetch_or(std::uint64_t{1} << index_);
      }
      ++retired_seen_;
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
      if (p.removed.load()) {
        not_linked(p, fmt::format("peer '{}' was removed", p.name));
      } else if (ready(p.link)) {
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

}  // namespace rdmakit::detail
