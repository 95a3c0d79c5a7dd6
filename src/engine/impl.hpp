// SPDX-License-Identifier: Apache-2.0
#pragma once
// The engine's state. Who owns what, and on which thread it is touched:
//
//   Engine::Impl   registries (buffers, segments, peers) under `mu`; buffers and peers are also
//                  published in append-only tables the workers read without a lock. Counters are
//                  atomics. The connector threads run handshakes; the listener's handshake
//                  threads hand each link a peer opens to the worker whose CQs it was built on.
//   Worker         its CQs (one per device, shared by its links, polled through a CqRouter),
//                  its links, the transfers in flight on them: all touched by its own thread
//                  only (or by progress() when there are no threads). Other threads talk to it
//                  through its inbox (a mutex and an eventfd).
//   BatchState     shared by the Batch handle and the workers; each transfer's result is written
//                  once, by the worker that ran it, before `remaining` is decremented (release).

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bootstrap/socket.hpp"
#include "common/clock.hpp"
#include "common/fifo.hpp"
#include "common/inline_mutex.hpp"
#include "common/thread_self.hpp"
#include "connection/impl.hpp"
#include "datapath/router.hpp"
#include "engine/batch.hpp"
#include "engine/leases.hpp"
#include "engine/metrics.hpp"
#include "engine/protocol.hpp"
#include "engine/rails.hpp"
#include "rdmakit/engine.hpp"
#include "transport/soft/device.hpp"
#include "verbs/device_layer.hpp"
#include "verbs/handles.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit::detail {

class Worker;
class MetadataPlane;
struct Link;
struct Peer;


// What a link's QP must allow for the windows bound on it: everything a segment may allow.
// The most bytes of control messages a link's outbox holds (EngineConfig::control_timeout).
inline constexpr std::size_t kMaxOutbox = 16u << 20;
// How long a closing link waits for a peer that takes none of its last messages (and BYE).
inline constexpr std::chrono::milliseconds kByeWait{1000};

inline constexpr Access kAllRemote = Access::remote_read | Access::remote_write | Access::remote_atomic;

/// One rail of a peer link: a local port, the peer's port it reaches, the link on it. rails[0]
/// of a peer is its first (its address's, Peer::link); the others are opened once the first
/// link learns the peer's ports (RAILS). Never freed before the engine: the connect queue and the
/// links point at them. `local`, `peer`, `endpoint` are set before the rail is first connected
/// and fixed after (rails[0]'s: by the worker, read by peers() under Peer::m).
struct RailState {
  RailPort local, peer;
  // The worker's:
  Link* link = nullptr;
  bool connecting = false;
  bool wanted = true;  // false once evicted (idle) or dropped as the peer's old one (state "gone"): opened again by the peer's next RAILS
  Deadline probe_at{};
  std::chrono::milliseconds backoff{0};
  // Shown by peers(): under Peer::m.
  std::string state = "connecting", reason;
  std::atomic<std::uint64_t> bytes{0}, slices{0}, failures{0}, reposted{0};
};

/// A registered buffer: one region per RDMA device (index as in the device layer), and for the
/// tcp and shm transports its bytes by address.
/// A buffer's memory shared with same-host peers (soft::Device::share): taken back when this goes.
struct SharedBuffer {
  soft::Device* dev = nullptr;
  std::uint64_t id = 0;
  SharedBuffer(soft::Device* d, std::uint64_t i) noexcept : dev(d), id(i) {}
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;
  ~SharedBuffer() { dev->unshare(id); }
};

struct BufferRec {
  // What the regions stand for, declared before them so that it goes after them: a caller's
  // dma-buf (its dup and CPU mapping) and, on the bounce path, the host copy every device
  // registered. stage_mu keeps staging copies and their release apart (taken before mu, never
  // after it).
  std::unique_ptr<MemorySource> home;
  // Host memory the engine allocated while it offers shm: a memfd (home) that shm peers map; the
  // share goes before the memory (declared after it).
  std::optional<SharedBuffer> shared;
  OwnedMemory bounce;
  std::mutex stage_mu;
  Buffer handle;
  std::vector<std::optional<MemoryRegion>> regions;
  // The buffer as tcp and shm links reach it (no registration: lkey 0); the owner of the memory
  // when the engine allocated it without an RDMA device. Empty where the CPU cannot reach the
  // bytes (GPU memory): those links refuse transfers of it.
  std::optional<MemoryRegion> soft;
  MemoryKind kind = MemoryKind::host;
  // By device index (Engine::Impl::device_count()): regions[d].local(), then soft's once per
  // software transport; computed once (the post path reads it).
  std::vector<LocalSlice> slices;
  int numa_node = -1;                // of its pages (locality.hpp); -1: unknown
  std::string gpu_pci;               // GPU memory: the GPU's sysfs path (locality.hpp)
  std::vector<std::uint8_t> rank;    // by device index: a peer's rails on the best ranked carry it
  // Engine::unregister_memory: `retired` is set at the call (no more segments of it); each
  // worker sets its bit in `retired_by` when it takes the call's command, so what was submitted
  // before it still runs and what comes after is refused; the regions go once every worker has
  // no transfer of it left (`released`). The record stays (a tombstone: the workers read the
  // table without a lock).
  std::atomic<bool> retired{false};
  std::atomic<std::uint64_t> retired_by{0};  // one bit per worker
  std::atomic<bool> released{false};
};

/// An unregister_memory() waiting for the workers: each says when none of its transfers in
/// flight uses the buffer any more.
struct Retirement {
  std::uint32_t buffer = 0;
  std::uint32_t generation = 0;  // the buffer's: its id may be another buffer's by the time a worker looks
  std::mutex m;
  std::condition_variable cv;
  std::uint32_t workers_left = 0;  // under m
  void worker_done() {
    {
      std::lock_guard lock(m);
      --workers_left;
    }
    cv.notify_all();
  }
};

/// A named segment of a buffer.
struct SegmentDef {
  std::string name;
  std::uint32_t buffer = 0;
  std::uint32_t generation = 0;  // the buffer's (its id may be another buffer's later)
  std::uint64_t offset = 0, length = 0;
  Access access = Access::none;
  std::vector<std::string> peers;  // who gets a window on it (admission.hpp entries); empty: every peer
  bool leased = false;  // expose_leased: no standing windows, only leases' (Engine::grant)
  // A lease's window (Worker::bind_lease): its lease, and where it starts in the segment
  // (offset is then the range's in the buffer, length the range's).
  std::uint64_t lease = 0;
  std::uint64_t in_segment = 0;
};

/// A peer added by name. `name`, `worker`, `from_store` are fixed at add_peer; `address`, the
/// slot table and `gone_reason` are under Engine::Impl::mu; the rest belongs to the peer's worker.
/// Owned by the registry (Engine::Impl::peers) and by whoever outside its worker holds it for a
/// while (API calls, commands to the workers): removed, it lives until its worker has let go of
/// it (Worker::release_if_quiet) and the last of those drops it; then its id is reused.
struct Peer {
  std::uint32_t id = 0;
  std::uint32_t generation = 0;  // RemoteSegment::generation
  std::uint64_t order = 0;       // peers() lists in the order added
  std::string name, address;
  Worker* worker = nullptr;
  bool from_store = false;  // its address came from the metadata store (and follows its entry)
  // Under Engine::Impl::mu: the store's endpoint for it, held back while a live link said
  // another epoch than the store's record; the next connect (the link is down then) takes it.
  std::string held_address;
  // Under Engine::Impl::mu: the key its links must prove (Identity::public_key() text; empty:
  // none yet), where it came from (PeerInfo::key_source), and the store's key held back with
  // held_address.
  std::string public_key;
  std::string key_source;
  std::string held_key;
  // The metadata store says its engine is gone: what waits for it fails, and so does what is
  // submitted to it, until its entry is back (MetadataPlane).
  std::atomic<bool> gone{false};
  std::string gone_reason;
  std::map<std::string, std::uint32_t> slot_by_name;  // Engine::Impl::mu
  std::vector<std::string> slot_names;                // Engine::Impl::mu
  std::atomic<std::uint32_t> slots{0};                // slot_names.size(), for the workers
  std::atomic<bool> removed{false};
  std::atomic<int> device{-1};  // its last link's device index (for peers())
  // Its rails (RailState): [0] from add_peer on; grown by its worker under `m`.
  std::vector<std::unique_ptr<RailState>> rails;
  std::vector<RailUnused> unused_rails;  // local ports that carry none, and why; under `m`
  // The worker's:
  Link* link = nullptr;     // the link this engine initiated, once up
  bool connecting = false;
  std::uint64_t epoch = 0;  // of the last link's IDENT
  bool ever_connected = false;
  bool released = false;  // removed, and its worker let go of it (its id is free)
  Fifo<Xfer*> waiting;  // transfers waiting for the link to be ready
  std::size_t next_rail = 0;  // where Worker::pick starts (ties go round)
  // For Engine::connect(): the link's state, under `m`.
  std::mutex m;
  std::condition_variable cv;
  bool up = false;
  std::uint64_t up_epoch = 0;  // while up: the epoch its first link's IDENT said (what the store yields to)
  std::string last_error;
  std::uint64_t attempts = 0;
  std::string transport, transport_reason;  // its first rail's last link's (PeerInfo)
  std::uint16_t wire_version = 0;           // the same link's (PeerInfo)
  // Leases the peer granted this engine (the worker writes them under `m`; it alone reads them
  // without): live ones, and the last ended ones, whose transfers end lease_expired.
  std::map<std::uint64_t, HeldRecord> held;
  std::uint64_t held_ended = 0;  // ended records counted (HeldRecord::order)
};

/// An accepted link's notifications, as the application takes them (Engine::next_notification,
/// any thread) and its worker returns their credits to the sender.
struct NoteCredits {
  Worker* worker = nullptr;
  std::atomic<std::uint32_t> queued{0};  // waiting in Engine::Impl::notes
  std::atomic<std::uint64_t> taken{0};   // taken by the application, in all
};

/// A memory window bound for one peer on one link's QP.
struct Window {
  std::string segment;  // empty once withdrawn while its bind was in flight (it goes when that ends)
  std::uint32_t buffer = 0;  // the buffer it is bound to (unregister_memory waits for its bind)
  Link* link = nullptr;
  MwPtr mw;
  std::uint32_t rkey = 0;
  RemoteRegion region;  // as announced
  std::uint64_t lease = 0;       // a lease's window (0: the segment's standing one)
  std::uint64_t in_segment = 0;  // a lease's: where its range starts in the segment
  bool bound = false;
  Deadline posted{};  // its bind
};

/// One RC link to a peer engine, on a worker's shared CQs.
struct Link {
  Connection conn;
  Connection::Impl& impl;
  std::uint64_t serial = 0;  // unique in its worker (a plan's requests built for it know it by it)
  std::uint32_t device = 0;
  bool initiated = false;
  Peer* peer = nullptr;  // initiated links
  RailState* rail = nullptr;  // initiated links: the rail it is on
  std::string peer_name;  // from its IDENT
  std::string peer_key;   // the key its IDENT proved (Identity::public_key() text), or empty
  std::uint64_t peer_epoch = 0;
  enum class State { syncing, ready, closing } state = State::syncing;
  bool watched = false;  // its control fd is in the worker's epoll set
  bool watched_out = false;  // ... for writability too (its outbox waits for the channel)
  bool settled = false;  // closing: its transfers are ended; it goes once its outbox is sent
  bool evicted = false;  // closing to make room (Worker::evict_one waits for it to go)
  // Where each notification not yet taken by the channel ends in the control stream
  // (Connection::Impl::out_queued): those still waiting when the link goes are counted lost.
  Fifo<std::uint64_t> notes_waiting;
  bool rails_seen = false;  // initiated: the peer's RAILS came (once per link)
  bool ident_seen = false;  // its IDENT came (once per link: a link's peer never changes)
  // Initiated: the peer's segments (by the peer's slot numbers, and as the data path checks them).
  std::vector<std::optional<RemoteRegion>> by_slot;
  std::map<std::string, RemoteRegion> remote;
  // Accepted: our windows for the peer.
  std::vector<std::unique_ptr<Window>> windows;
  std::uint32_t binds_pending = 0;  // posted, not completed
  // Accepted: leases with windows on it, and how many of each are still to be bound (LEASE goes
  // once that is 0).
  struct LeaseBinding {
    std::shared_ptr<LeaseState> state;
    std::uint32_t pending = 0;
    bool announced = false;
  };
  std::map<std::uint64_t, LeaseBinding> leases;
  // Initiated: the leases' ranges the peer bound on it, by the peer's slot for the segment
  // (sorted by offset), and how many ranges of each lease came.
  std::vector<std::vector<LeasedRange>> leased;
  std::map<std::uint64_t, std::uint32_t> lease_ranges;
  // Accepted: its notifications queued here; the credits returned to the sender so far.
  std::shared_ptr<NoteCredits> notes;
  std::uint64_t credits_returned = 0;
  // Initiated: how many more notifications the peer takes now (SYNCED, then CREDIT).
  std::uint32_t notify_credits = 0;
  std::uint32_t notify_queue = 0;  // the peer's bound, as its SYNCED gave it
  // Segments to bind once the send queue has room (a bind completion frees it): any number of
  // segments, whatever the queue's depth. SYNCED goes once this is empty and nothing is pending.
  std::deque<SegmentDef> binds_waiting;
  bool synced_sent = false;
  std::uint64_t in_flight = 0;  // transfers posted and not ended
  Fifo<Xfer*> backlog;          // to be posted (in chains, as the send queue has room)
  // Bytes of reads and writes posted and not walked, and waiting in the backlog: the measure
  // by which a peer's rails share its transfers (Worker::pick).
  std::uint64_t bytes_out = 0, backlog_bytes = 0;
  // The chain being built on the link's data path (Worker::room_on), and how many more it takes.
  bool chain_open = false;
  std::uint32_t chain_room = 0;
  bool flush_queued = false;    // in the worker's list of links to post for
  // The transfers posted on the link are the slots of its send ring (their wr_id is the Xfer),
  // in post order. RC completes in order, so a completion also ends every transfer posted before
  // it (unsignaled, in chains): the ring's slots from `ended` up to the completion's are walked.
  std::uint64_t ended = 0;  // the first sequence number not walked yet
  std::uint64_t walk_to = 0;  // completed up to here, to be walked after the poll (0: nothing)
  std::vector<Xfer*> alone;  // split transfers in flight (their ring slots are parts)
  // Initiated: its last completion. Accepted: its peer's last ACTIVE (or its link-up).
  Deadline last_used{};
  Deadline active_sent{};  // initiated: the last ACTIVE sent (every idle_after / 4 while used)
  // Initiated: the bytes its reads and writes moved (ended ok), and as last told in an ACTIVE.
  // Accepted: the last the peer told (the target's only view of one-sided transfers).
  std::uint64_t moved = 0, moved_told = 0;
  // Error completions, ended only once the link is reaped: a peer whose process died answers
  // with access errors (its windows went before its QP) while its control channel closes, so
  // whether this was the peer's death or a real refusal is known a moment later.
  struct Deferred {
    Xfer* x;
    std::string reason;
    bool transport = false;  // the rail's fault (not the peer's refusal): another rail may do it
  };
  std::vector<Deferred> deferred;
  Deadline broke_at{};
  explicit Link(Connection c) : conn(std::move(c)), impl(Connection::Impl::of(conn)) {}
};

/// Whether transfers can go on `l` now.
inline bool ready(const Link* l) noexcept { return l != nullptr && l->state == Link::State::ready; }

/// The link `p` has on its rail `k` (the first rail's is Peer::link), or null.
inline Link* rail_link(const Peer& p, std::size_t k) noexcept { return k == 0 ? p.link : p.rails[k]->link; }

/// A worker's CQ on one device, shared by its links there (an RDMA device's, or a software
/// transport's: `soft`, whose channel is its own descriptor).
struct DeviceCqs {
  std::shared_ptr<DeviceResources> dev;
  CompChannelPtr channel;
  CqPtr cq;
  std::unique_ptr<soft::Cq> soft;
  CqRouter router;          // send and receive queues of every link on this CQ
  std::uint32_t links = 0;  // attached links (reserved at handshake), at most `capacity`
  std::uint32_t capacity = 0;
};

/// What other threads ask a worker to do.
/// Commands whose poster waits until every worker has handled its copy (Engine::withdraw).
struct Handled {
  explicit Handled(std::size_t n) : left(n) {}
  std::mutex mu;
  std::condition_variable cv;
  std::size_t left;  // under mu
  void one() noexcept {
    {
      std::lock_guard lock(mu);
      if (left > 0) --left;
    }
    cv.notify_all();
  }
  /// True when all were handled by `until`.
  bool wait(Deadline until) {
    std::unique_lock lock(mu);
    return cv.wait_until(lock, until, [this] { return left == 0; });
  }
};

struct Command {
  enum class Kind { submit, link_up, connect_failed, expose, withdraw, remove_peer, evict, kick, restarted, gone, retire, reclaim, credit, revoke, cancel,
                    lease_grant, lease_end, renew };
  explicit Command(Kind k, Peer* p = nullptr, std::string t = {}) : kind(k), peer(p), text(std::move(t)) {}
  Kind kind;
  std::shared_ptr<BatchState> batch;
  std::vector<std::uint32_t> indexes;
  std::optional<Connection> conn;
  Peer* peer;
  std::string text;  // a failure, a segment's name, a restarted peer's name, or a revoked peer
  std::uint32_t device = 0;
  std::uint64_t epoch = 0;  // restarted: the peer's new epoch
  RailState* rail = nullptr;  // link_up, connect_failed: of a further rail (null: the first)
  std::shared_ptr<Retirement> retirement;  // retire
  // The peer, for commands from threads that are not its worker's: alive until handled.
  std::shared_ptr<Peer> keep;
  // reclaim: a buffer's id, free once every worker has handled its copy (no worker can still
  // hold the record it looked up before the id went).
  std::shared_ptr<void> token;
  std::shared_ptr<NoteCredits> notes;  // credit: the link whose notifications were taken
  std::shared_ptr<Handled> handled;     // counted down once handled (Impl::post_and_wait)
  std::shared_ptr<LeaseState> lease;    // lease_grant, lease_end
  std::uint64_t lease_id = 0;           // renew (ttl in `epoch`, 0: release)
};

/// Descriptor lists' requests as built for a post (Worker::post_lists_on): linked once, each
/// with its SGE at a fixed distance (one base register for both in the loop that writes them).
inline constexpr std::uint32_t kListChain = 256;  // requests per post at most
struct ListScratch {
  ibv_send_wr wrs[kListChain];
  ibv_sge sges[kListChain];
  TransferOp op = TransferOp::write;
};

class Worker {
 public:
  Worker(Engine::Impl& e, std::uint32_t index);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void start();
  /// Ends every link (in-flight transfers complete or fail) and joins the thread.
  void stop() noexcept;
  /// From any thread.
  void post(Command c);
  /// From a handshake thread: this worker's CQ on `device`, with a link's room reserved in it
  /// (given back when the returned keep goes). Nullopt when the CQ is full.
  /// (Any device index of Engine::Impl::device_count(), a software transport's too.)
  std::optional<Attachment> attach(std::uint32_t device);
  /// Runs until `until` (or, with `forever`, until stop()); returns the transfers that ended.
  std::size_t run(Deadline until, bool forever) noexcept;
  /// From a submitting thread (Engine::submit): starts batch b, whose transfers are all this
  /// worker's, on the calling thread, when the worker's thread is not running its loop (it
  /// sleeps: the latency case): no hand-off, no wake-up. What was posted to it before goes
  /// first. False, having done nothing, when the loop runs (post() it then), when this thread
  /// is already running it (a callback that submits), or without a worker thread.
  bool try_submit(const std::shared_ptr<BatchState>& b);
  /// From a waiter (BatchState::spin): polls this worker's completions once on the calling
  /// thread, and ends what completed, when the worker's thread is not running its loop; false
  /// when it is (it ends them), or when this thread already runs it.
  bool try_drive() noexcept;
  /// A waiter starts (enter_drive) and ends (leave_drive) a spin on this worker: while any
  /// does, its thread sleeps with its CQs unarmed; the last to leave arms them if transfers are
  /// still in flight. From any thread.
  void enter_drive() noexcept;
  /// `ended`: the waiter's batch ended while it polled (its thread's next submit needs no
  /// arming).
  void leave_drive(bool ended) noexcept;
  /// A wait about to sleep (or one that does not poll): the CQs armed if the worker sleeps
  /// with them unarmed and transfers are in flight, now or by whoever holds its lock.
  void request_arm() noexcept;
  [[nodiscard]] std::uint32_t index() const noexcept { return index_; }
  /// How often a busy initiated link tells its peer (ACTIVE): often enough that the peer never
  /// evicts it as idle, and that the peer's per-peer figures (metrics) lag at most a second.
  [[nodiscard]] std::chrono::milliseconds active_every() const noexcept;
  /// What ended ok on this worker's links, by path (device index; metrics()); null past them.
  [[nodiscard]] const PathFigures* figures(std::size_t path) const noexcept {
    return path < figures_count_ ? &figures_[path] : nullptr;
  }
  /// Whether thread `t` runs this worker now (its thread, or a submitter or waiter in it).
  [[nodiscard]] bool run_by(ThreadSelf t) const noexcept { return driver_.load(std::memory_order_relaxed) == t; }

 private:
  void handle(Command& c);
  /// Handles what was posted (the inbox), in order. The look inline: on the latency path
  /// (try_submit) there is seldom any, and on the lab's emulator every call costs tens of
  /// nanoseconds (docs/performance.md), as for the other guards below.
  void take_mail() {
    if (has_mail_.load(std::memory_order_seq_cst)) take_mail_now();
  }
  void take_mail_now();
  /// A command's or a submit's failure, logged (it never takes the worker down).
  void log_failure(const std::exception& ex) noexcept;
  void submit(const std::shared_ptr<BatchState>& b, const std::vector<std::uint32_t>& indexes);
  /// A batch of a plan: each run posted from its requests built for the link (built at its
  /// first post there), or the long way (route()) when anything they were built for changed.
  void submit_plan(const std::shared_ptr<BatchState>& b);
  /// Lists batch b as live on this worker (once) with `n` more of its transfers.
  WorkerShare& list(const std::shared_ptr<BatchState>& b, std::uint32_t n) {
    WorkerShare& s = b->share(index_);
    if (!s.keep) {
      s.keep = b;
      s.pos = static_cast<std::uint32_t>(live_.size());
      live_.push_back(b.get());
    }
    s.left += n;
    return s;
  }
  /// Takes b off the list (its last transfer here ended); returns it, to outlive what follows.
  std::shared_ptr<BatchState> unlist(BatchState& b) noexcept {
    WorkerShare& s = b.share(index_);
    BatchState* moved = live_.back();
    live_[s.pos] = moved;
    moved->share(index_).pos = s.pos;
    live_.pop_back();
    return std::move(s.keep);
  }
  /// Posts what it can of `run` (its transfers in this batch from `x`) as built for the link
  /// pick() gives; returns how many went (or failed): the rest take the long way.
  std::uint32_t post_run(PlanState::Run& run, Xfer* x);
  /// `run`'s requests as built for `l` (of peer `p`), built now if they were not or the peer's
  /// segment changed; null when they cannot go as built (the long way then says why).
  PlanState::Built* built_for(PlanState::Run& run, const BufferRec& buf, Link& l, const Peer& p, const Xfer* x);
  /// A batch of descriptor lists on one peer: posted the lists' way (post_lists()) as far as it
  /// goes, each position it cannot post the long way (route()).
  void submit_lists(const std::shared_ptr<BatchState>& b);
  /// Posts b's positions from `from` on the link pick() gives (post_lists_on(), chain after
  /// chain while its queue has room); returns the first position not posted (or failed).
  /// `*full`: that link, when the rest must wait in its backlog (no room, or a backlog there
  /// already). `*usable`: false when the lists' way cannot be taken now at all (the peer, a
  /// buffer, the link); else the position returned takes the long way on its own.
  std::uint32_t post_lists(BatchState& b, std::uint32_t from, Link** full, bool* usable);
  /// Posts up to `most` of b's positions from `from` on `l` as one chain, each request from its
  /// local SGE and its remote target, up to the first whose lengths differ or whose target is
  /// not one, or the queue's room (then `*full` = &l); returns the first position it did not
  /// post (or fail). Nothing: anything the lists were prepared with changed (the peer, the
  /// buffers: looked at unless the caller just did, `checked`).
  std::uint32_t post_lists_on(Link& l, BatchState& b, std::uint32_t from, std::uint32_t most, Link** full,
                              bool checked);
  /// The lists' positions at the front of l's backlog (consecutive entries of one batch, queued
  /// by submit_lists()) posted the lists' way: posted (some went), full (no room: stop), or
  /// not (the front takes the long way).
  enum class ListsFlush { posted, full, not_posted };
  /// A position of descriptor lists about to take the long way: its transfer built, or (its
  /// pair's lengths differ) ended invalid with why (false).
  bool take_position(Xfer& x);
  static std::unique_ptr<ListScratch> make_list_scratch();
  ListsFlush flush_lists(Link& l, Xfer& front);
  /// A buffer of the local list when every one of them is still registered for this worker
  /// (looked at again only after a retirement reached it); null otherwise.
  const BufferRec* lists_registered(ListState& local) noexcept;
  /// The remote list's targets as checked for `l` and `op`, checked now if they were not or the
  /// peer's segments on `l` changed.
  const ListState::Targets* targets_for(ListState& remote, Link& l, TransferOp op);
  /// Queues transfer x for its peer's link (or the link to come).
  void start_transfer(Peer& p, Xfer& x);
  /// x waits for a link to `p` (connected now if none is coming), or ends at once when `p` was
  /// removed or is gone.
  void wait_for_link(Peer& p, Xfer& x);
  /// Whether the chain on `l` takes one more transfer now (opening one, or posting a full one
  /// and opening the next).
  bool room_on(Link& l);
  bool open_chain(Link& l);
  /// Posts the chain built on `l` (if any).
  void post_chain(Link& l);
  void post_open_chains() {
    if (!open_chains_.empty()) post_open_chains_now();
  }
  void post_open_chains_now();
  /// Ends the transfers of a chain built and not posted (the link broke meanwhile).
  void abandon_chain(Link& l, const std::string& why) noexcept;
  void queue_flush(Link& l);
  void flush_queued_links() {
    if (!to_flush_.empty()) return flush_queued_links_now();
    post_open_chains();
  }
  void flush_queued_links_now();
  /// Posts the link's backlog as chains of unsignaled requests (one doorbell each), as far as
  /// its send queue has room.
  void flush(Link& l);
  /// Appends transfer x to the chain open on `l` (room_on); false when it ended instead.
  bool chain(Link& l, Xfer& x);
  bool chain(Link& l, Xfer& x, std::uint64_t laddr, std::uint32_t lkey, bool writable, const RemoteRegion& seg);
  /// What consecutive transfers of one buffer and one peer's segment share (Worker::submit).
  struct Route {
    bool ok = false;
    std::uint32_t buf_id = 0, peer_id = 0, slot = 0;
    std::uint32_t buf_gen = 0, peer_gen = 0;
    std::uint64_t buf_len = 0;
    std::uint64_t max_msg = 0;  // the link's max_msg_sz (too_long)
    Link* link = nullptr;
    const RemoteRegion* seg = nullptr;
    std::uint64_t laddr = 0;  // the buffer's address as registered on the link's device
    std::uint32_t lkey = 0;
    bool writable = false;
    bool lone = false;  // the batch is this one transfer (a WRITE or READ of it goes by post_lone)
  };
  /// Transfer x into the chain of the route `r` holds when it is the same, else admit().
  void route(Xfer& x, Route& r);
  void route_all(Xfer* x, Xfer* last, Route& r);
  /// The record of x's buffer (checked by admit() before anything uses it).
  [[nodiscard]] const BufferRec& buffer_of(Xfer& x) const noexcept;
  /// The long way for transfer x: checks it, chains it or queues it, and sets `r` for the next.
  [[gnu::noinline]] void admit(Xfer& x, Route& r);
  /// admit()'s body, inline where a batch of one takes it (Worker::submit).
  void admit_here(Xfer& x, Route& r);
  [[gnu::noinline]] void refused(Link& l, Xfer& x, PostStatus st);
  /// x's buffer is memory the CPU cannot reach, and `l` is a tcp or shm link: it ends invalid.
  [[gnu::noinline, gnu::cold]] void unreachable(Link& l, Xfer& x);
  /// Longer than one request may be (max_msg_sz): the data path splits it, and it is posted alone.
  static bool too_long(const Link& l, const Transfer& t) noexcept { return t.length > l.impl.dp.limits().max_msg_size; }
  /// A transfer the data path splits (longer than max_msg_sz), posted alone.
  void post_alone(Link& l, Xfer& x);
  /// Whether a transfer alone in its batch may go on `l` by post_lone() now.
  [[nodiscard]] bool lone_room(const Link& l) const noexcept;
  /// A WRITE or READ alone in its batch, checked by admit(): posted by itself, signaled. False
  /// when the data path's checks refused it (nothing posted: it goes the chain's way).
  bool post_lone(Link& l, Xfer& x, const LocalSlice& buffer, const RemoteRegion& seg);
  /// post_alone's and post_lone's request: x's READ or WRITE of `buffer` (its link's slice) to
  /// `to` by the data path's one-request post, counted in flight when posted.
  PostResult post_single(Link& l, Xfer& x, const LocalSlice& buffer, const RemoteRegion& to);
  /// Requests `l`'s ring may take before a slot not walked yet (Link::ended) would be
  /// overwritten.
  static std::uint64_t unwalked_room(const Link& l) noexcept {
    const WrRing& ring = l.impl.dp.lane(0).sq;
    return ring.storage() - (ring.next_seq() - l.ended);
  }
  /// Ends the transfers whose slots of `l`'s ring lie in [l.ended, upto): ok, or with `s`.
  void walk(Link& l, std::uint64_t upto, TransferStatus s, const std::string& why) noexcept;
  void end(Xfer& x, TransferStatus s, std::string reason) noexcept;
  /// Ends every transfer waiting for `p`'s link with `s` and `why`.
  void fail_waiting(Peer& p, TransferStatus s, const std::string& why) noexcept;
  void bound(Link& l, Window& w, const Completion& c) noexcept;
  void on_completion(DataPath& dp, const Completion& c) noexcept {
    Link& l = *static_cast<Link*>(dp.context);
    const WrRing& ring = dp.lane(0).sq;
    const std::uint64_t seq = ring.head() - 1;  // the request this completion retired
    const bool part = ring.at(seq).kind == WrRing::part;
    if (c.ok() && !part && (c.wr_id & 1) == 0) [[likely]] {
      // It and every transfer posted before it on the link completed: walked when the poll is
      // done (poll_cqs), once for all the link's completions in it.
      if (l.walk_to == 0) to_walk_.push_back(&l);
      l.walk_to = seq + 1;
      return;
    }
    on_news(l, c, seq, part);
  }
  /// A completion that is news of its own (a failure, a part, a bind): out of the common path.
  [[gnu::noinline]] void on_news(Link& l, const Completion& c, std::uint64_t seq, bool part) noexcept;
  /// Polls every CQ and walks the links whose transfers completed; returns the completions.
  /// `soft`: the software transports' CQs too (each poll of one is a pass over its sockets).
  int poll_cqs(bool fresh_clock = false, bool soft = true) noexcept;
  /// Whether a soft CQ's streams had work within kSoftLinger (or wait_spin, if less: 0 never):
  /// the loop polls on rather than sleep.
  [[nodiscard]] bool soft_lingers(Deadline now) const noexcept;
  static constexpr std::chrono::microseconds kSoftLinger{200};
  void link_up(Command& c);
  void connect_failed(Peer& p, const std::string& why);
  /// Tells Engine::connect() waiting for `p` that this attempt ended without a link, and why.
  void not_linked(Peer& p, const std::string& why);
  // Rails.
  /// The ready link of `p` (its first or a further rail) with the fewest bytes outstanding;
  /// with `instead_of`, another of the same peer process (epoch). Null: none ready.
  /// Rails on devices that `buf` ranks first are taken while one is ready (null: any).
  Link* pick(Peer& p, const BufferRec* buf, const Link* instead_of = nullptr) noexcept {
    if (p.rails.size() == 1) [[likely]] {  // one rail: nothing to choose (the common case, kept short)
      return ready(p.link) && p.link != instead_of ? p.link : nullptr;
    }
    return pick_rail(p, buf, instead_of);
  }
  Link* pick_rail(Peer& p, const BufferRec* buf, const Link* instead_of) noexcept;
  /// Whether transfer x to `p` is cut into slices over its rails.
  bool slices_for(const Peer& p, Xfer& x) const noexcept;
  /// Whether transfers to `p` of slice_threshold bytes or more are cut into slices now (two of
  /// its rails up).
  bool slicing(const Peer& p) const noexcept;
  /// Cuts x into slices, each queued on the rail with the fewest bytes outstanding.
  void slice(Peer& p, Xfer& x);
  /// A slice ended: its transfer ends with the last.
  void slice_ended(Xfer& s, TransferStatus st, std::string reason) noexcept;
  /// Queues x on `l` (its backlog) and has it flushed.
  void queue_on(Link& l, Xfer& x);
  /// x did not complete on `l` because the link failed: re-posted on another rail of the peer
  /// when it is a read or write and one is ready, else ended with `s`.
  void lost(Link& l, Xfer& x, TransferStatus s, std::string why) noexcept;
  /// The peer's ports arrived on its first link: plans and opens the further rails.
  void on_rails(Link& l, const engine_wire::Message& m);
  /// A further rail is down (`went_down`: its link broke; else a connect to it failed): shown,
  /// and probed again after its backoff unless it was evicted or the peer is gone.
  void rail_down(Peer& p, RailState& r, const std::string& why, bool went_down);
  void probe_rails(Deadline now);
  /// What the accepting side tells a link about its ports.
  std::vector<std::uint8_t> rails_message(const Link& l) const;
  void tick_link(Link& l, Deadline now) noexcept;
  void on_message(Link& l, std::span<const std::uint8_t> bytes);
  void make_ready(Link& l);
  /// Tells the peers of links with transfers in flight that they are active (Link::active_sent),
  /// though nothing completed lately (one long transfer, a path in retries); breaks links whose
  /// peer stopped reading their control messages (outbox_stalled).
  void report_active(Deadline now) noexcept;
  void tell_active(Link& l, Deadline now) noexcept;
  /// A link a peer opened, once its IDENT is accepted: a window on every segment, then SYNCED.
  void grant(Link& l);
  /// This engine's IDENT for `l`: with an identity, its public key and its signature of the
  /// link's session (engine_wire::ident_transcript).
  [[nodiscard]] engine_wire::Message my_ident(const Link& l) const;
  /// Checks the identity `m` (`l`'s IDENT) proves against the one expected: on a link this
  /// engine opened, the peer's name and key (given, from the store, or pinned now, on its first
  /// link that proves one); on one a peer opened, the key its name was pinned to here. False
  /// when the link went (wrong_engine, or broken with why).
  bool check_identity(Link& l, const engine_wire::Message& m);
  /// Under Engine::Impl::mu: why engine `name`, proving `key` (empty: none), may not link from
  /// `from` (revoked, not allowed, or its name bound to another key), or empty (admitted, its
  /// name pinned to its key if nothing bound it). `note`: a line to log once the lock is let go.
  std::string admit(const std::string& name, const std::string& key, const std::string& from, std::string& note);
  /// Another engine than `l`'s peer answered on it (`why` says which, and how it differs): the
  /// link goes, and what waits for it fails as connect_failed, with why.
  void wrong_engine(Link& l, const std::string& why);
  /// Engine `name` opened a link with `epoch`: the links it opened to this engine with another
  /// epoch (on this worker) go, with the windows they held.
  void close_stale(const std::string& name, std::uint64_t epoch, const Link* except);
  /// Gives the peer of accepted link `l` a window on segment `s`: announced at once with region
  /// keys; with windows, queued for bind_waiting(), which the caller runs next.
  void bind_window(Link& l, const SegmentDef& s);
  /// Posts the bind of `s` on `l`; false when the send queue is full. Throws Error on a failure.
  bool post_bind(Link& l, const SegmentDef& s);
  /// Posts the queued binds of `l` as far as its send queue has room; then SYNCED when all ended.
  void bind_waiting(Link& l) noexcept;
  /// SYNCED on `l` once every bind queued or posted at link-up (and since) has ended.
  void synced_if_done(Link& l) noexcept;
  void announce(Link& l, const Window& w) noexcept;
  /// Sends a control message on `l`; a failure to encode or send breaks the link (never throws).
  void send(Link& l, const engine_wire::Message& m) noexcept;
  void send(Link& l, const std::vector<std::uint8_t>& msg) noexcept;
  /// Logs through the link config's logger; never throws.
  void log(const std::string& what) const noexcept;
  void withdraw(const std::string& name);
  /// Revokes `l`'s windows that `match`: deallocated now (their keys die at once), or, with a
  /// bind in flight, unannounced and gone when it completes. Returns those deallocated now.
  std::size_t revoke_windows(Link& l, const std::function<bool(const Window&)>& match);
  // Leases (worker_leases.cpp). The granting side:
  /// Binds the windows of lease `s` on every link its peer opened here (Command::lease_grant).
  void lease_granted(const std::shared_ptr<LeaseState>& s);
  void bind_lease(Link& l, const std::shared_ptr<LeaseState>& s);
  /// A window of a lease bound: LEASE to the peer once the lease's last on `l` is.
  void lease_bound(Link& l, const Window& w) noexcept;
  /// Drops lease `s`'s windows (they stop working now) and tells their links' peers.
  void lease_ended(const std::shared_ptr<LeaseState>& s) noexcept;
  /// `l` no longer holds lease `lease`'s windows (it goes, or its bind was flushed): the lease
  /// ends if no other link holds it within LeaseState::kOrphanGrace.
  void lease_link_gone(Link& l, std::uint64_t lease, const std::string& why) noexcept;
  /// A window of lease `lease` on `l` could not be bound: the lease ends (LeaseCause::failed).
  void lease_unbound(Link& l, std::uint64_t lease, const std::string& why) noexcept;
  /// Ends the leases whose deadline passed (worker 0); the time of the next one's end.
  Deadline check_leases(Deadline now) noexcept;
  /// The peer of `l` (accepted) renews or releases (`ttl_ms` 0) a lease.
  void on_renew(Link& l, std::uint64_t lease, std::uint32_t ttl_ms) noexcept;
  /// Accepted link `l` goes: the leases with windows on it end.
  void end_link_leases(Link& l, const std::string& why) noexcept;
  // The holding side:
  void on_lease(Link& l, const engine_wire::Message& m);
  void on_lease_end(Link& l, std::uint64_t lease, const std::string& reason);
  void on_renewed(Link& l, std::uint64_t lease, std::uint32_t ttl_ms);
  /// Ends held lease `id` of `p` here: its ranges leave every link, its record says why.
  void drop_held(Peer& p, std::uint64_t id, const std::string& reason);
  /// The regions the data path of initiated `l` checks against: standing windows, then leases'.
  void refresh_remote(Link& l);
  /// Initiated link `l` goes: what it held ends with it.
  void held_link_gone(Link& l, const std::string& why) noexcept;
  /// Whether every ready link of `p` has all `total` ranges of lease `id`.
  [[nodiscard]] bool on_every_rail(const Peer& p, std::uint64_t id, std::uint32_t total) const noexcept;
  /// Whether `p` holds leases (or has a release to send): its link is opened again when it breaks.
  [[nodiscard]] bool holds_leases(const Peer& p) const noexcept;
  /// `l` (the peer's first rail) is synced: the peer announced every lease it still holds for
  /// this engine before SYNCED, so the others ended; releases made meanwhile go now.
  void held_after_sync(Link& l) noexcept;
  /// Every live lease of `p` ends here (the peer restarted).
  void forget_held(Peer& p, const std::string& why);
  /// Command::renew.
  void renew(Peer& p, std::uint64_t lease, std::uint32_t ttl_ms);
  /// Where x goes on `l`: the peer's standing window on its segment, else a lease's range
  /// (lease_region); null with x ended when neither.
  const RemoteRegion* remote_of(Link& l, Xfer& x);
  /// A transfer to a slot with no standing window: the range of a lease the link holds that
  /// covers it, or null with the transfer ended (lease_expired: a lease that covered it ended;
  /// no_segment otherwise).
  const RemoteRegion* lease_region(Link& l, Xfer& x);
  /// The lease of `p` (live or ended) that covers x's range, if any.
  [[nodiscard]] const HeldRecord* covering(const Peer& p, const Xfer& x) const noexcept;
  /// An access error of initiated `l`'s: the lease x went to through, if it went through one.
  [[nodiscard]] const HeldRecord* leased_refusal(const Link& l, const Xfer& x) const noexcept;
  /// Engine::revoke(entry): every link a matching peer opened here loses its windows at once
  /// (their keys die with them), is refused with the reason, and closes.
  void revoke(const std::string& entry);
  /// Tells the peer of `l` (a link it opened) why it is not served (REFUSE), and closes the link.
  void refuse(Link& l, const std::string& why);
  void break_link(Link& l, const std::string& why);
  /// break_link with the reason `why()` makes, for paths that must not throw: out of memory
  /// saying why, the link goes all the same.
  template <typename Why>
  void break_link_anyway(Link& l, Why why) noexcept {
    try {
      break_link(l, why());
    } catch (...) {
      l.state = Link::State::closing;
    }
  }
  /// Breaks every link this engine opened to `p` (its first and its further rails).
  void break_links(Peer& p, const std::string& why);
  void reap_links();
  /// Ends what `l` (closing, nothing outstanding) still held: deferred failures, the ring's
  /// retired transfers, split transfers whose parts never all came back.
  void settle(Link& l, bool peer_gone);
  void close_link(Link& l) noexcept;
  bool evict_one();
  void watch(Link& l, bool on);
  /// Sends what waits in `l`'s outbox as far as its channel takes it now, and has the worker
  /// woken when the channel takes more (or not, once it is empty).
  void flush_outbox(Link& l) noexcept;
  /// Forgets the notifications of `l` its channel has taken (Link::notes_waiting); what is left
  /// has not left this engine.
  void forget_sent_notes(Link& l) noexcept;
  /// `l`'s outbox has taken nothing for control_timeout: the link is broken, and true.
  bool outbox_stalled(Link& l, Deadline now) noexcept;
  /// Closing `l`: BYE queued behind its outbox; true once all of it is sent (or cannot be: the
  /// peer is gone, or stopped reading for control_timeout).
  bool said_bye(Link& l, Deadline now) noexcept;
  void sleep(Deadline until) noexcept;
  /// Sends b's notification to `p` on `to` (notify_link(p)); false, with the batch told why
  /// (`*why` too), when it was not sent.
  bool send_note(Peer& p, Link* to, BatchState& b, std::string* why) noexcept;
  /// A notification on its own (BatchState::note_only): sent at once on a ready link, else
  /// waiting for one as transfers wait (Peer::waiting).
  void start_note(Xfer& x);
  /// Batch::cancel(): ends b's transfers that wait here for a link or for room as `cancelled`.
  void cancel(BatchState& b) noexcept;
  /// Whether x is not to be posted: its batch was cancelled, and nothing of it was posted yet
  /// (neither a slice of a sliced transfer nor a re-post, which may have moved bytes).
  static bool cancels(const Xfer& x) noexcept {
    return x.batch->cancelled.load(std::memory_order_relaxed) && x.group == nullptr && x.tries == 0;
  }
  static constexpr const char* kCancelled = "cancelled (Batch::cancel) before it was posted";
  /// The link a notification to `p` goes on: a ready one with credits left, else a ready one
  /// without (null: none is ready).
  Link* notify_link(Peer& p) noexcept;
  /// Tells each retirement whose buffer none of this worker's transfers in flight uses.
  void check_retiring() noexcept;
  /// A removed peer of this worker's with no link, connect, probe or transfer left: its id goes
  /// back to the engine (Engine::Impl::release_peer).
  void release_if_quiet(Peer& p) noexcept;

  Engine::Impl& e_;
  std::uint32_t index_;
  std::vector<std::unique_ptr<DeviceCqs>> cqs_;  // by device index
  std::mutex cq_mu_;                              // DeviceCqs::links (handshake threads)
  Fd wake_;
  Fd epoll_;
  // Whoever holds run_mu_ runs the worker, and everything below that is "the worker thread's
  // own" is under it: its thread (from turn to turn; released while it sleeps in epoll_wait),
  // or a submitter or waiter that found it asleep (try_submit, try_drive). driver_ is the
  // thread that holds it, so that one already inside (a callback) queues instead. An
  // InlineMutex: a transfer on the latency path takes and lets go of it once, without a call.
  InlineMutex run_mu_;
  std::atomic<ThreadSelf> driver_{nullptr};
  // Set while its thread is (about to be) in epoll_wait: only then does post() write wake_
  // (seq_cst with has_mail_: the loop looks at the mail after setting it).
  std::atomic<bool> asleep_{false};
  // Set while its thread, woken, takes run_mu_ back: others (try_submit, try_drive) leave it be.
  std::atomic<bool> wants_{false};
  static constexpr std::uint32_t kTakeBackSpins = 4096;
  // Waiters spinning on this worker now (enter_drive), and whether its thread went to sleep
  // without arming its CQs for them (seq_cst, both: one of the two sides sees the other).
  std::atomic<std::uint32_t> drivers_{0};
  std::atomic<bool> unarmed_{false};
  std::atomic<bool> driven_{false};  // a waiter polled it (or a submitter's look ended its batch) since its thread last slept
  std::atomic<bool> arm_wanted_{false};  // request_arm() not served yet
  std::uint64_t binds_out_ = 0;  // window binds posted and not completed (not in in_flight_)
  // in_flight_ (and binds_out_) as last seen by a thread that ran the worker: leave_drive()
  // asks for nothing when nothing was in flight (no lock per wait on the latency path).
  std::atomic<std::uint64_t> busy_seen_{0};
  /// What this worker expects completions for: transfers and window binds in flight.
  [[nodiscard]] std::uint64_t expecting() const noexcept { return in_flight_ + binds_out_; }
  std::atomic<ThreadSelf> spinner_{nullptr};  // the last waiter (or submitter) whose batch ended as it polled
  /// Arms every CQ for the next completion; arm_and_look() then polls once (under run_mu_).
  void arm() noexcept;
  void arm_and_look() noexcept;
  /// Serves arm_wanted_ if run_mu_ is free (after its holder let go: try_submit, try_drive).
  void serve_arm_requests() noexcept {
    if (arm_wanted_.load(std::memory_order_seq_cst)) serve_arm_requests_now();
  }
  void serve_arm_requests_now() noexcept;
  /// After another thread polled: the software transports' CQs readable again if completions
  /// wait in them.
  void keep_soft_readable() noexcept;
  /// Another thread runs the worker while its thread sleeps (try_submit, after its post;
  /// try_drive): one poll of the CQs (`soft`: the software transports' too), what completed
  /// ended, the backlog it made room for posted.
  void poll_while_asleep(bool fresh_clock, bool soft);
  /// From a thread running the worker in its thread's stead: wakes that thread for what only
  /// its loop does on time (a link broken, a rail to probe: sleep() naps again while others
  /// hold the lock).
  void nudge() noexcept;
  /// Writes the worker's eventfd: its thread, asleep in epoll, wakes.
  void wake_thread() noexcept;
  struct Driving;
  /// How long its thread sleeps unarmed at most (what a submit no waiter polls for waits).
  [[nodiscard]] std::chrono::milliseconds unarmed_nap() const noexcept;
  /// The worker's thread, woken from epoll_wait, takes run_mu_ back (take_back()).
  /// `locked`: run_mu_ is this thread's already (taken with try_lock: no step-aside to ask).
  void take_back(bool locked = false) noexcept;
  std::mutex mu_;
  std::vector<Command> inbox_;
  std::vector<Command> mail_;  // the worker's: the inbox as taken, handled one by one
  static constexpr std::size_t kMailKept = 1024;  // commands' storage kept between bursts
  std::atomic<bool> has_mail_{false};
  std::atomic<bool> stop_{false};
  bool threaded_ = false;  // set by start(), before any other thread can post
  std::thread thread_;
  // The worker thread's own:
  std::vector<std::unique_ptr<Link>> links_;
  std::uint64_t link_serial_ = 0;
  // The time as of the loop's last turn (or wake-up): what a completion stamps on its link
  // (Link::last_used, for eviction), without reading the clock for each.
  Deadline now_ = Clock::now();
  // The batches with transfers on this worker (each one's WorkerShare says where it is here).
  std::vector<BatchState*> live_;
  std::uint64_t in_flight_ = 0;
  std::size_t ended_ = 0;
  std::vector<Link*> to_flush_;
  std::vector<Link*> to_walk_;  // links with completions to walk (Link::walk_to)
  std::vector<Link*> to_report_;  // links to tell their peers they are active (Link::active_sent)
  std::vector<Link*> to_break_;  // links a failed completion broke, to break after the poll
  std::unique_ptr<PathFigures[]> figures_;  // by device index (Engine::Impl::device_count())
  std::size_t figures_count_ = 0;
  std::vector<Link*> open_chains_;  // links with a chain being built (empty between commands)
  Deadline next_tick_{};
  Deadline next_report_{};  // report_active()
  std::vector<std::shared_ptr<Retirement>> retiring_;  // waiting for transfers of their buffer
  std::uint64_t retired_seen_ = 0;  // retirements taken (ListState::checked)
  std::unique_ptr<ListScratch> lists_;  // post_lists_on()'s requests
  std::vector<std::shared_ptr<LeaseState>> leases_;  // granted and not ended (lease_granted)
  Deadline next_lease_check_{};
  std::unordered_map<Xfer*, std::unique_ptr<SliceGroup>> groups_;  // by sliced transfer
  std::vector<std::pair<Peer*, RailState*>> probes_;  // failed rails waiting for their probe
};

}  // namespace rdmakit::detail

namespace rdmakit {

struct Engine::Impl {
  explicit Impl(EngineConfig c);
  ~Impl();
  /// The implementation behind an Engine (for the library's own tests).
  static Impl& of(Engine& e) noexcept { return *e.impl_; }
  /// How peers get access: per-peer windows, or region keys (`device` has no windows). Decided
  /// at construction; a test calls it before any buffer is registered to play a device without.
  void choose_access(bool with_windows, std::string device);

  // Fixed at construction.
  EngineConfig cfg;
  std::uint32_t threads = 0;  // worker threads (cfg.workers resolved; 0: the caller drives progress)
  std::string name;
  std::uint64_t epoch = 0;
  std::shared_ptr<detail::DeviceLayer> layer;  // empty (no device) on a host without RDMA
  /// The RDMA devices this engine uses (EngineConfig::devices, else every device of the layer,
  /// in the layer's order; none when it does not offer rdma): its device indexes 0..rdma_count.
  std::vector<std::shared_ptr<detail::Device>> rdma_devices;
  /// The layer's catalog of rdma_devices alone (ports, GIDs: refreshed as the layer's is).
  [[nodiscard]] std::vector<DeviceInfo> catalog() const;
  std::vector<std::shared_ptr<detail::DeviceResources>> pds;  // by device index
  // Transports (transports.cpp): what this engine offers its peers' links, best first, and why
  // a listed one is not offered; the software devices of tcp and shm, whose device indexes
  // follow the RDMA devices' (rdma_count + 0, + 1); this process's host and pid (shm); the data
  // streams that arrive at the listener for a link in its handshake.
  std::vector<wire::LinkTransport> offer;
  std::string offer_note;
  std::string listen_note;  // EngineInfo::listen_note
  std::uint32_t rdma_count = 0;
  /// The software transports, as devices after the RDMA ones (each a folder of src/transport/,
  /// its links' queue pairs those of src/transport/soft/): a new one is an entry here.
  static constexpr std::array kSoftTransports{wire::LinkTransport::tcp, wire::LinkTransport::shm};
  std::array<std::unique_ptr<detail::soft::Device>, kSoftTransports.size()> soft;
  wire::TransportBlock self;
  std::shared_ptr<detail::StreamRegistry> streams;
  std::string shm_socket;  // offering shm: the local socket its links' streams come to
  /// Whether allocate_memory() gives memory of `kind` that shm peers map (an engine offering shm,
  /// host memory): their copies are one pass whatever the kernel allows (docs/engine.md).
  [[nodiscard]] bool shares(MemoryKind kind) const noexcept {
    return cfg.shm_map && kind == MemoryKind::host && !shm_socket.empty();
  }
  std::string shm_ring_why;  // offering shm: why the links it opens copy through a ring (empty: they attach)
  std::string shm_no_attach;  // offering shm: why this process cannot copy by attach (empty: it can)
  /// Resolves cfg.transports into `offer` (constructor; after the device layer).
  void choose_transports();
  [[nodiscard]] std::uint32_t device_count() const noexcept {
    return rdma_count + static_cast<std::uint32_t>(kSoftTransports.size());
  }
  [[nodiscard]] bool is_soft(std::uint32_t d) const noexcept { return d >= rdma_count; }
  /// The device index of software transport `k` (one of kSoftTransports), and the transport of
  /// software device `d`.
  [[nodiscard]] std::uint32_t soft_index(wire::LinkTransport k) const noexcept {
    const auto at = std::find(kSoftTransports.begin(), kSoftTransports.end(), k) - kSoftTransports.begin();
    assert(at < static_cast<std::ptrdiff_t>(kSoftTransports.size()));
    return rdma_count + static_cast<std::uint32_t>(at);
  }
  [[nodiscard]] wire::LinkTransport soft_kind(std::uint32_t d) const noexcept {
    assert(is_soft(d) && d < device_count());
    return kSoftTransports[d - rdma_count];
  }
  [[nodiscard]] bool offers(wire::LinkTransport k) const noexcept {
    return std::find(offer.begin(), offer.end(), k) != offer.end();
  }
  /// The shm transport's software device (what the engine shares with its shm peers).
  [[nodiscard]] detail::soft::Device& shm_device() const noexcept {
    return *soft[soft_index(wire::LinkTransport::shm) - rdma_count];
  }
  /// The name of device index `d` ("mlx5_0", "tcp", "shm").
  [[nodiscard]] std::string device_name(std::uint32_t d) const;
  /// The PD windows are allocated in on device `d`, and `buf`'s MR there (null on a software one).
  [[nodiscard]] ibv_pd* pd_of(std::uint32_t d) const noexcept;
  /// `rec`'s slices for the software transports (its bytes as the CPU reaches them; none for GPU
  /// memory), after its RDMA regions' (publish()).
  void soft_slices(detail::BufferRec& rec) const;
  bool windows = false;
  std::string no_windows_device;  // the first device without type-2 windows (when !windows)
  std::string access_model;
  std::shared_ptr<const detail::Secret> psk;
  // Under mu: the key each engine that opened links here proved first, by name (unless
  // allowed_peers or add_peer bound the name to a key). A link that says the name and proves
  // another key (or none) is refused: the name is its key's.
  std::map<std::string, std::string> pinned_names;
  // Under mu: who may link (EngineConfig::allowed_peers, and allow()'s; empty: any member of the
  // cluster key), and who may not (revoke(), until allow()). Entries as in admission.hpp.
  std::vector<std::string> allowed;
  std::vector<std::string> revoked;
  std::map<std::string, std::uint32_t> names_of_key;  // under mu: how many names each key pinned
  static constexpr std::uint32_t kNamesPerKey = 16;
  /// Under mu: forgets a pin (and counts it off its key).
  void unpin(std::map<std::string, std::string>::iterator it);

  // Registries, under mu; buffers and peers also in lock-free tables for the workers. Both are
  // indexed by id - 1; an id freed (an unregistered buffer, a removed peer) is reused, under a
  // new generation, once no worker can hold what had it before.
  mutable std::mutex mu;
  std::vector<std::shared_ptr<detail::BufferRec>> buffers;  // null: a free id
  std::vector<std::uint32_t> free_buffer_ids;
  std::map<std::string, detail::SegmentDef> segments;
  std::vector<std::shared_ptr<detail::Peer>> peers;  // null: a free id
  std::vector<std::uint32_t> free_peer_ids;
  std::uint64_t peers_added = 0;
  std::map<std::string, std::uint32_t> peer_ids;
  // Generations: random per engine (another engine's handles do not match), then a mix of a
  // count, so a reused id never repeats one.
  std::uint64_t salt = 0;
  std::uint64_t handles_made = 0;  // under mu
  std::uint32_t next_generation();  // under mu
  static constexpr std::uint32_t kMaxBuffers = 1u << 14;
  static constexpr std::uint32_t kMaxPeers = 1u << 16;
  std::unique_ptr<std::atomic<detail::BufferRec*>[]> buffer_table;
  std::unique_ptr<std::atomic<detail::Peer*>[]> peer_table;
  // A peer's worker by id, for submit() to route without touching a record that may be going.
  std::unique_ptr<std::atomic<std::uint32_t>[]> peer_worker;
  std::atomic<std::uint32_t> peer_ids_used{0};  // the highest id ever given

  // Counters.
  struct {
    std::atomic<std::uint64_t> qps{0}, links{0}, connects{0}, reconnects{0}, accepts{0}, evictions{0},
        restarts{0}, batches{0}, transfers{0}, transfers_failed{0}, bytes{0}, notifications_sent{0},
        notifications_received{0}, notifications_refused{0}, notifications_dropped{0}, notifications_lost{0}, windows_bound{0}, window_bind_ns{0}, rail_links{0}, rail_failures{0},
        slices{0}, reposted{0}, plan_posted{0}, plan_builds{0}, lists_posted{0}, lists_builds{0}, submits_inline{0}, waits_spun{0}, submits_ended{0}, leases_granted{0},
        leases_ended{0}, lease_renewals{0};
  } count;
  // For metrics(): transfers that ended other than ok, by status; batches' submit-to-end times
  // (telemetry on); peers' links refused by the engine's admission (identity.hpp).
  std::array<std::atomic<std::uint64_t>, 16> failed_by_status{};
  detail::LatencyHistogram batch_latency;
  detail::SubmitFigures submitted;
  std::atomic<std::uint64_t> refused_identity{0};
  // By peer name: the bytes peers said their reads and writes moved on links they opened here
  // (ACTIVE), summed over their links. Bounded: names beyond kServedNames count under "".
  std::mutex served_mu;
  std::map<std::string, std::uint64_t> served;
  static constexpr std::size_t kServedNames = 4096;
  void add_served(const std::string& peer, std::uint64_t bytes);
  std::mutex metrics_mu;
  std::map<std::size_t, detail::RestFloors> rest_floors;  // under metrics_mu, by top_peers

  detail::Fd event_fd;  // readable when a batch ends or a notification arrives
  std::atomic<int> fd_taken{0};  // Engine::fd() was called: signal() writes event_fd
  std::mutex notes_mu;
  struct Note {
    Notification n;
    std::shared_ptr<detail::NoteCredits> credits;  // of the link it came on
  };
  std::deque<Note> notes;
  std::deque<LeaseEnd> lease_ends;  // under notes_mu

  // Leases granted (Engine::grant), while they last; under mu.
  std::map<std::uint64_t, std::shared_ptr<detail::LeaseState>> leases;
  std::uint64_t leases_made = 0;  // under mu; from a random start
  // Under mu: live leases and their ranges, by the peer entry granted to (bounded as a link is).
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> leased_to;
  /// Ends lease `s` (once: false if it had ended) and tells every worker to drop its windows.
  bool end_lease(const std::shared_ptr<detail::LeaseState>& s, LeaseCause cause, std::string reason) noexcept;
  /// A worker dropped its windows of `s`: the last tells the application.
  void lease_dropped(const std::shared_ptr<detail::LeaseState>& s) noexcept;

  std::vector<std::unique_ptr<detail::Worker>> workers;
  std::atomic<std::uint32_t> next_worker{0};
  // Batch::wait's spin (EngineConfig::wait_spin): the gate its polling of a worker goes through
  // (closed first at shut-down), and a running average of how long waits took, which sizes it.
  std::shared_ptr<detail::DriveGate> gate = std::make_shared<detail::DriveGate>();
  std::atomic<std::int64_t> wait_avg_ns{0};
  // Engine::submit's batch of one transfer without options, made again in place when nobody
  // holds the last one any more (batch_of_one): no allocation, and no release through
  // shared_ptr's control block, per transfer on the latency path. Nothing of the caller's
  // (a callback, a notification) is ever kept in it. Under spare_mu, which a submitter only
  // tries: another one busy with it makes a batch of its own.
  detail::InlineMutex spare_mu;
  std::shared_ptr<detail::BatchState> spare;
  [[nodiscard]] std::shared_ptr<detail::BatchState> batch_of_one(const Transfer& t);
  /// How long a wait spins now (0: it sleeps at once).
  [[nodiscard]] std::chrono::nanoseconds spin_for() const noexcept;
  /// A wait ended after `took`: the average moves an eighth of the way.
  void waited(std::chrono::nanoseconds took) noexcept;
  /// Worker `w`, for a waiter to poll (null without worker threads: progress() moves them).
  [[nodiscard]] detail::Worker* drivable(std::uint32_t w) const noexcept {
    return threads != 0 && w < workers.size() ? workers[w].get() : nullptr;
  }

  // Connecting: a queue of peers and the threads that run their handshakes. A connect waits for
  // its peer's answer (up to a handshake deadline), so one to a dead host must not hold the rest:
  // a thread is added whenever none is idle, up to kMaxConnectors at once.
  static constexpr std::size_t kMaxConnectors = 32;
  std::mutex connect_mu;
  std::condition_variable connect_cv;
  std::deque<std::pair<detail::Peer*, detail::RailState*>> to_connect;  // rail null: the first
  std::atomic<bool> stopping{false};
  // Requested by shut_down() with `stopping`: the handshakes in progress (this side's connects,
  // the listener's) end at once rather than at their deadline (a peer down or silent).
  std::shared_ptr<detail::Stop> stop_handshakes = std::make_shared<detail::Stop>();
  std::vector<std::thread> connectors;  // under connect_mu
  std::size_t idle_connectors = 0;      // under connect_mu

  std::mutex listen_mu;  // starting the listener
  std::atomic<Listener*> listening{nullptr};
  // The listener's port, for the workers (RAILS, offered_rails): they read this, never the
  // Listener, which shut_down() destroys while they still run.
  std::atomic<std::uint16_t> listen_port{0};
  std::unique_ptr<Listener> listener;
  void start_listening();

  // The metadata store (null: p2p). Its thread posts to the workers: it goes first.
  std::unique_ptr<detail::MetadataPlane> meta;

  /// Stops every thread (the metadata plane's, the listener's, the connectors, the workers);
  /// the destructor, and a constructor that fails once they run.
  void shut_down() noexcept;
  /// Makes the engine's descriptor (Engine::fd) readable, if anyone took it: a batch ended, a
  /// notification came, a lease ended.
  void signal() noexcept {
    if (fd_taken.fetch_add(0, std::memory_order_acq_rel) == 0) return;  // an RMW: see Engine::fd()
    signal_fd();
  }
  void signal_fd() noexcept;
  /// What every submit does before its transfers go to the workers: the options into `b`, the
  /// counters; an empty batch ends here (false: nothing to send).
  bool start(const std::shared_ptr<detail::BatchState>& b, SubmitOptions&& options);
  /// start() and launch() as submit.cpp runs them, inline (defined and used there only).
  bool start_here(const std::shared_ptr<detail::BatchState>& b, SubmitOptions&& options);
  Batch launch_here(std::shared_ptr<detail::BatchState> state, SubmitOptions&& options);
  /// Sends b to worker `home` (all its transfers are that worker's): started on this thread
  /// when that worker's thread sleeps, else handed to it.
  [[gnu::always_inline]] void send_to(std::uint32_t home, const std::shared_ptr<detail::BatchState>& b) {
    if (!workers[home]->try_submit(b)) hand_to(home, b);
  }
  /// send_to's way when try_submit did not start b on this thread (the worker's thread runs
  /// it, or no thread does, a callback submits, stop() began): through the worker's inbox.
  void hand_to(std::uint32_t home, std::shared_ptr<detail::BatchState> b);
  /// Starts a batch of transfers (its entries filled in) with `options`: a batch of descriptor
  /// lists' way (submit(span) runs the same, launch_here, in submit.cpp).
  Batch launch(std::shared_ptr<detail::BatchState> state, SubmitOptions&& options);
  /// Posts `make(i)` to each worker i that `to(i)` selects, and waits (at most 5 s) until each
  /// has handled it; not on a thread that runs a worker (a callback) nor without worker threads,
  /// where it only posts. False when some had not; `what` names the call in the log line.
  bool post_and_wait(const std::function<bool(std::uint32_t)>& to,
                     const std::function<detail::Command(std::uint32_t)>& make, const char* what);
  /// What post_and_wait posts: the countdown to wait on, null when the caller must not wait.
  std::shared_ptr<detail::Handled> post_to(const std::function<bool(std::uint32_t)>& to,
                                           const std::function<detail::Command(std::uint32_t)>& make);
  /// Batch::cancel(): asks each worker holding transfers of b to end those not posted yet;
  /// returns what to wait on (null: do not wait).
  std::shared_ptr<detail::Handled> cancel(const std::shared_ptr<detail::BatchState>& b);
  /// A BufferRec or Peer by id (0 or unknown: null). Lock-free.
  [[nodiscard]] detail::BufferRec* buffer(std::uint32_t id) const noexcept {
    if (id == 0 || id > kMaxBuffers) return nullptr;
    return buffer_table[id - 1].load(std::memory_order_acquire);
  }
  [[nodiscard]] detail::Peer* peer(std::uint32_t id) const noexcept {
    if (id == 0 || id > kMaxPeers) return nullptr;
    return peer_table[id - 1].load(std::memory_order_acquire);
  }
  /// The same, for a handle: null unless its generation is the record's (a handle of a buffer
  /// unregistered, of a peer removed, or of another engine).
  [[nodiscard]] detail::BufferRec* buffer(const Buffer& h) const noexcept {
    detail::BufferRec* b = buffer(h.id);
    return b != nullptr && b->handle.generation == h.generation ? b : nullptr;
  }
  [[nodiscard]] detail::Peer* peer(const RemoteSegment& s) const noexcept {
    detail::Peer* p = peer(s.peer);
    return p != nullptr && p->generation == s.generation ? p : nullptr;
  }
  /// The record of `h` for an API call, held while the caller uses it. Throws Error (EINVAL, for
  /// `verb`) for a handle that is not a registered buffer of this engine.
  [[nodiscard]] std::shared_ptr<detail::BufferRec> buffer_for(const Buffer& h, const char* verb) const;
  /// A released buffer's id goes: out of the table now, reusable once every worker has seen it go.
  void reclaim_buffer(std::uint32_t id);
  /// A removed peer's worker let go of it: its id is free (its record goes with its last holder).
  void release_peer(detail::Peer& p) noexcept;
  /// The worker for a new peer at `address`: with one worker per device, the one of the device
  /// the kernel routes the address through; else (or for a name, or no route) round robin.
  detail::Worker* worker_for(const std::string& address, std::uint32_t id);
  /// The device index of `name` in the layer.
  [[nodiscard]] std::uint32_t device_index(const std::string& name) const;
  /// QPs a link holds against max_qps: its data QP, and over rdma_cm its control channel's.
  [[nodiscard]] std::uint64_t qps_per_link() const noexcept {
    return cfg.link.method == ConnectMethod::rdma_cm ? 2 : 1;
  }
  /// The attach hook of every link: a worker's CQ on that device with room, and a QP of the
  /// budget. Throws a "busy" Error when there is neither.
  detail::Attachment attach(const std::string& device, detail::Worker* preferred);
  /// The same for a link of the tcp or shm transport: a worker's CQ on that software device.
  detail::Attachment attach_soft(wire::LinkTransport kind, detail::Worker* preferred);
  /// What both take: a QP of the budget, and room in the CQ on device index `d` of `preferred`
  /// (only), or of the first worker with room from `first_choice` (modulo the workers) on.
  std::optional<detail::Attachment> attach_to(std::uint32_t d, detail::Worker* preferred, std::uint32_t first_choice);
  /// A QP of the budget (max_qps: a tcp or shm link counts as one), held until the returned
  /// ticket goes; evicts idle links while it waits. Throws a "busy" Error at its deadline.
  std::shared_ptr<void> take_qps();
  void connect_loop() noexcept;
  /// This engine's ports that can carry rails, each with the endpoint where a peer opens one
  /// (none while there is no listener, or where the listener is bound to another address).
  [[nodiscard]] std::vector<detail::RailPort> offered_rails() const;
  /// A further rail's link, into `c` (link_up, or connect_failed with the reason).
  void connect_rail(detail::Peer& p, detail::RailState& rail, detail::Command& c) noexcept;
  /// A link a peer opened, from the listener's handshake thread: to the worker it was built on.
  void adopt(Connection conn) noexcept;
  void request_connect(detail::Peer* p, detail::RailState* rail = nullptr);
  std::uint32_t slot_of(detail::Peer& p, const std::string& segment);
  /// Engine::expose, for `peers` (empty: every peer).
  void expose(std::string segment, const Buffer& buffer, Access access, std::uint64_t offset, std::uint64_t length,
              std::vector<std::string> peers, bool leased = false);
  /// Adds a peer (Engine::add_peer); throws Error for a name in use or a key that is not one.
  /// `public_key` with `key_source` ("given", "store"), or empty.
  std::shared_ptr<detail::Peer> add_peer(std::string name, std::string address, bool from_store,
                                         std::string public_key = {}, std::string key_source = {});
  /// The peer called `name`; with a metadata store, one not added yet is added from its entry.
  /// Throws Error (for `verb`) naming why there is none.
  std::shared_ptr<detail::Peer> named(const std::string& name, const char* verb);
  /// Why transfers to a peer the store says is gone fail.
  std::string gone_reason(const detail::Peer& p) const;
  [[nodiscard]] detail::HandshakeHooks hooks(detail::Worker* preferred);
  /// Queues a notification that came on accepted link `from` (within its credits; beyond them
  /// it is dropped and counted).
  void deliver(const std::shared_ptr<detail::NoteCredits>& from, Notification n);
  /// Gives a registered buffer its id and publishes it to the workers.
  Buffer publish(std::unique_ptr<detail::BufferRec> rec);
};

inline const detail::BufferRec& detail::Worker::buffer_of(Xfer& x) const noexcept {
  return *e_.buffer(x.transfer().local.id);  // admitted: its generation was checked
}

inline void detail::BatchState::last_ended(const std::shared_ptr<BatchState>& self) noexcept {
  if (engine->cfg.telemetry) {
    const std::int64_t now = Clock::now().time_since_epoch().count();
    ended_ns.store(now, std::memory_order_release);
    if (!note_only) {
      engine->batch_latency.observe(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        Deadline{Clock::duration{now}} - submitted).count());
    }
  }
  // The callback first, so that wait() returning (and the descriptor) also means it has run.
  // (The worker that ends the last transfer holds the batch: it just took it off its list.)
  assert(self || !on_done);
  if (on_done) run_callback(self);
  ended();
  engine->signal();
}

// Inline: a batch of one is made on the latency path (Engine::submit).
[[gnu::always_inline]] inline detail::BatchState::BatchState(Engine::Impl* e, std::span<const Transfer> t,
                                                            std::shared_ptr<DriveGate> g)
    : size(static_cast<std::uint32_t>(t.size())), engine(e), gate(std::move(g)) {
  allocate_entries();
  // One loop (not a memcpy, whose `rep movsb` callgrind would count byte by byte).
  for (std::uint32_t i = 0; i < size; ++i) {
    new (x + i) Xfer(*new (owned + i) Transfer(t[i]), this, i);
    atomics |= t[i].op >= TransferOp::fetch_add;
  }
  remaining.store(size, std::memory_order_relaxed);
}

[[gnu::always_inline]] inline detail::BatchState::BatchState(Engine::Impl* e, std::span<const Transfer> t)
    : BatchState(e, t, e->gate) {}

inline bool detail::Worker::slices_for(const Peer& p, Xfer& x) const noexcept {
  const std::uint64_t threshold = e_.cfg.rails.slice_threshold;
  if (threshold == 0 || x.transfer().length < threshold || x.group != nullptr || x.transfer().op > TransferOp::write) {
    return false;
  }
  return slicing(p);
}

}  // namespace rdmakit

