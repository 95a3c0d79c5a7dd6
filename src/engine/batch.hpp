// SPDX-License-Identifier: Apache-2.0
#pragma once
// A batch's state and its transfers' (BatchState, Xfer), a worker's share of it, a sliced
// transfer's group, and a prepared plan (PlanState): what Engine::submit builds and the workers
// end. BatchState is shared by the Batch handle and the workers; each transfer's result is
// written once, by the worker that ran it, before `remaining` is decremented (release).
#include <infiniband/verbs.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "common/clock.hpp"
#include "datapath/ring.hpp"
#include "engine/metrics.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/engine.hpp"

namespace rdmakit::detail {

struct BatchState;
struct BufferRec;
struct Peer;
struct SliceGroup;

// A chain signals every kSignalEvery-th request (fewer where the queue is shallow: at least
// every half queue) and its last, so the queue drains (and the backlog refills it) while the
// rest of the chain is still on the wire. Each signal is a completion to write and to poll:
// 64, as UCX's default send-completion moderation on RC (perftest's bandwidth tests: 100).
inline constexpr std::uint32_t kSignalEvery = 64;

/// Calls `f` with the data path's opcode for `op`, as a constant
/// (std::integral_constant<Opcode, ...>): the one place a transfer's operation becomes the data
/// path's, for its templates.
template <typename F>
[[gnu::always_inline]] inline decltype(auto) with_opcode(TransferOp op, F&& f) {
  switch (op) {
    case TransferOp::read: return f(std::integral_constant<Opcode, Opcode::read>{});
    case TransferOp::write: return f(std::integral_constant<Opcode, Opcode::write>{});
    case TransferOp::fetch_add: return f(std::integral_constant<Opcode, Opcode::fetch_add>{});
    default: return f(std::integral_constant<Opcode, Opcode::compare_swap>{});
  }
}

/// What a request of opcode Op takes of t's atomic operands (0 where it takes none).
template <Opcode Op>
constexpr std::uint64_t compare_add_of(const Transfer& t) {
  return Op == Opcode::fetch_add || Op == Opcode::compare_swap ? t.compare_add : 0;
}
template <Opcode Op>
constexpr std::uint64_t swap_of(const Transfer& t) {
  return Op == Opcode::compare_swap ? t.swap : 0;
}

/// Whether t's local range is outside a buffer of `len` bytes or empty, or t is an atomic of
/// other than 8 bytes: one branch for all of it (0 for `len` when there is no buffer).
[[gnu::always_inline]] inline bool bad_range(const Transfer& t, std::uint64_t len) {
  return (t.local_offset > len) | (t.length - 1 >= len - t.local_offset) |
         ((t.op >= TransferOp::fetch_add) & (t.length != 8));
}
/// Why transfer t cannot move at all with buffer `b` and peer `p` (either may be null).
[[gnu::cold]] std::string invalid_reason(const Transfer& t, const BufferRec* b, const Peer* p);

/// One transfer of a batch: the caller's description, and its result. A posted request's wr_id
/// is its address (8-byte aligned: bit 0 marks a window bind instead). Small and trivially
/// copyable (its status is stored atomically through atomic_ref): a plan's entries are copied
/// into each batch of it.
struct Xfer {
  Xfer(const Transfer& tr, BatchState* b, std::uint32_t i) noexcept : t_(&tr), batch(b), index(i) {}
  /// An entry of a batch of descriptor lists, its transfer not built yet.
  Xfer(BatchState* b, std::uint32_t i) noexcept : t_(nullptr), batch(b), index(i) {}
  /// The transfer. An entry of a batch of descriptor lists has none until something other than
  /// the lists' own path (Worker::post_lists) needs it: built then (BatchState::build), by the
  /// worker holding the entry, the only thread that calls this; any other thread reads a
  /// transfer through BatchState::transfer_at().
  const Transfer& transfer() noexcept;
  /// The transfer as transfer() gives it, without building it (a copy).
  [[nodiscard]] Transfer transfer_copy() const noexcept;
  /// The transfer, or null while an entry of descriptor lists has not built it: read it through
  /// transfer() (only the plan's and the lists' own paths look at it directly).
  const Transfer* t_;
  BatchState* batch = nullptr;
  SliceGroup* group = nullptr;  // a slice: the sliced transfer's group (its end goes there)
  std::uint32_t index = 0;
  std::uint8_t tries = 0;  // re-posts on another rail after its rail failed
  /// Stored once, when the transfer ends; a failure's reason is in BatchState::reasons first.
  [[nodiscard]] TransferStatus status(std::memory_order o) const noexcept {
    return std::atomic_ref<TransferStatus>(const_cast<TransferStatus&>(status_)).load(o);
  }
  void set_status(TransferStatus s, std::memory_order o) noexcept { std::atomic_ref<TransferStatus>(status_).store(s, o); }
  /// Ended ok: the device index (Engine::Impl's, tcp's and shm's too) of the link it ended on;
  /// kSlicedPath: its slices' (BatchState::sliced_paths); kNoPath otherwise. Stored before its
  /// status, read by Batch::telemetry() (another thread) after it: relaxed, as the status.
  [[nodiscard]] std::uint8_t path() const noexcept {
    return std::atomic_ref<std::uint8_t>(const_cast<std::uint8_t&>(path_)).load(std::memory_order_relaxed);
  }
  void set_path(std::uint8_t p) noexcept { std::atomic_ref<std::uint8_t>(path_).store(p, std::memory_order_relaxed); }

 private:
  alignas(std::atomic_ref<TransferStatus>::required_alignment) TransferStatus status_ = TransferStatus::pending;
  std::uint8_t path_ = 0xff;
};
static_assert(std::is_trivially_copyable_v<Xfer> && sizeof(Xfer) == 32);

/// Xfer::path of a transfer not ended ok, and of one whose slices took the paths.
inline constexpr std::uint8_t kNoPath = 0xff;
inline constexpr std::uint8_t kSlicedPath = 0xfe;
/// The path a transfer ending on device `d` records (a device past the byte's range: none).
[[gnu::always_inline]] inline std::uint8_t path_of(std::uint32_t d) noexcept {
  return d < kSlicedPath ? static_cast<std::uint8_t>(d) : kNoPath;
}

/// The entry of `cache` for link `serial` (`match` tells the rest of the key), or a new one at
/// its end (the oldest dropped first when it holds `most`), and whether it was there: what
/// plans and descriptor lists keep per link, built again when their link or segment changes.
template <class T, class Match>
std::pair<T*, bool> per_link(std::vector<T>& cache, std::uint64_t serial, std::size_t most, Match match) {
  auto it = std::find_if(cache.begin(), cache.end(), [&](const T& c) { return c.link == serial && match(c); });
  if (it != cache.end()) return {&*it, true};
  // A link that went (a reconnect, an eviction) makes room.
  if (cache.size() >= std::max<std::size_t>(most, 1)) cache.erase(cache.begin());
  return {&cache.emplace_back(), false};
}

/// A prepared plan (Engine::prepare): its transfers, checked, as the first state of a batch's
/// (copied into each batch of it at submit), cut into runs of one operation between one buffer
/// and one peer's segment.
struct PlanState {
  Engine::Impl* engine = nullptr;
  std::uint64_t epoch = 0;  // the engine's (another engine at the same address is not it)
  std::vector<Transfer> transfers;
  std::vector<Xfer> x;  // of `transfers`; batch null
  /// A run's requests as built for one link (by its serial): posted as they are while that
  /// link is ready and the peer's segment is what they were built against.
  struct Built {
    std::uint64_t link = 0;  // Link::serial
    RemoteRegion seg{};
    bool fast = false;  // every request passed the data path's checks, and none is to be sliced
    std::uint32_t every = kSignalEvery;  // signaled every `every` requests, and the last
    std::uint64_t bytes = 0;  // of all of them
    std::vector<ibv_send_wr> wrs;
    std::vector<ibv_sge> sges;
    // Their ring slots, but that a slot's wr_id is its entry's offset in the batch's run (the
    // entry's address once added to the run's first).
    std::vector<WrRing::Slot> slots;
  };
  struct Run {
    std::uint32_t begin = 0, n = 0;
    std::uint32_t peer = 0, slot = 0;
    // The buffer, as its handle (looked up at each submit: it may have been unregistered, its id
    // given to another), and the generations the plan's transfers carry.
    std::uint32_t buf = 0, buf_gen = 0, peer_gen = 0;
    TransferOp op = TransferOp::write;
    std::vector<Built> built;  // the peer's worker's: one per link (rail) it was posted on
  };
  std::vector<Run> runs;
  bool atomics = false;  // some of its transfers are
  SubmitTally tally;     // what each batch of it asks for (metrics), counted once
  std::vector<std::vector<std::uint32_t>> runs_of;  // by worker index: its runs
  std::vector<std::uint32_t> transfers_of;         // by worker index: the transfers of its runs
};

/// Where a remote descriptor's request goes, as checked for one link and operation: the first
/// two words are verbs' `wr.rdma` (remote_addr, rkey), copied into a request as they are (what
/// lands in the union's padding is unused by reads and writes); `length` is the descriptor's,
/// or kNoTarget where the request cannot go this way (outside the segment, no access, no
/// segment on the link, too long for one request): a local length never equals it.
struct RemoteTarget {
  std::uint64_t addr = 0;
  std::uint32_t rkey = 0;
  std::uint32_t length = 0;
};
static_assert(sizeof(RemoteTarget) == 16);
inline constexpr std::uint32_t kNoTarget = ~0u;

/// Descriptors prepared once (Engine::prepare_local, prepare_remote), and what the lists' own
/// path (Worker::post_lists) needs of them: each position of a batch is then two lookups and
/// two 16-byte copies into its request.
struct ListState {
  Engine::Impl* engine = nullptr;
  std::uint64_t epoch = 0;  // the engine's
  bool remote = false;
  std::vector<LocalDescriptor> local;    // !remote
  std::vector<RemoteDescriptor> remotes; // remote

  // A local list (set by prepare_local, then read-only but for `checked`):
  /// Descriptor i's SGE as registered on device d, at [d * size + i] (length 0: its memory is
  /// not reachable there, or it is over 4 GiB: the long way).
  std::vector<ibv_sge> sges;
  /// Per device: every descriptor's memory is registered writable there (a read's destination).
  std::vector<std::uint8_t> writable;
  /// Every descriptor's length when they are all alike (a KV cache's blocks), else 0; and per
  /// device, whether every descriptor has its SGE there (so a position's local side needs no
  /// look: only its remote target's length is compared with it).
  std::uint64_t uniform = 0;
  std::vector<std::uint8_t> uniform_on;
  /// Its buffers, (id, generation), each once.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> buffers;
  /// Per worker (written by that worker only): its count of buffer retirements
  /// (Worker::retired_seen_) + 1 when it last found every buffer of the list registered; 0: never.
  struct alignas(64) Seen {  // (a cache line each: workers write their own)
    std::uint64_t retired = 0;
  };
  std::unique_ptr<Seen[]> checked;

  // A remote list:
  /// The peer (id, generation) every descriptor is on; 0 when they are on several (such a
  /// list's batches take the long way: each peer's worker builds its own positions).
  std::uint32_t peer = 0, peer_gen = 0;
  /// The segment slots it names, each once.
  std::vector<std::uint32_t> slots;
  /// Its targets as checked for one link (Link::serial) and operation, against the segments
  /// (by `slots`) as the link had them then. Used and rebuilt by the peer's worker only.
  struct Targets {
    std::uint64_t link = 0;
    TransferOp op = TransferOp::write;
    bool slicing = false;  // descriptors long enough to be sliced over rails take the long way
    std::vector<std::optional<RemoteRegion>> regions;
    std::vector<RemoteTarget> at;  // by descriptor
  };
  std::vector<Targets> targets;
};

/// What one worker keeps of a batch while transfers of it are on that worker (in its list of
/// live batches): they are counted down as they end, and the last to end takes it off the list.
struct WorkerShare {
  std::shared_ptr<BatchState> keep;  // set while listed: the batch lives while its transfers run
  std::uint32_t left = 0;            // the worker's transfers of it that have not ended
  std::uint32_t pos = 0;             // its place in the worker's list
  // For the notification: the transfers (reads and writes) left per peer, by (id, generation) (a
  // peer removed meanwhile is told apart from one that took its id).
  std::map<std::pair<std::uint32_t, std::uint32_t>, std::uint32_t> notify_left;
};

/// Whether a thread other than a worker's may run an engine's workers (Batch::wait polling its
/// batch's worker): shared by the engine and its batches, so that a waiter finds it closed,
/// never freed, once the engine shuts down. Closed before the workers stop; close() waits for
/// the threads inside to leave (each is inside for one bounded spin).
class DriveGate {
 public:
  /// False once closed; else the caller is inside until leave().
  bool enter() noexcept {
    if ((users_.fetch_add(1, std::memory_order_acquire) & kClosed) == 0) return true;
    users_.fetch_sub(1, std::memory_order_release);
    return false;
  }
  void leave() noexcept { users_.fetch_sub(1, std::memory_order_release); }
  /// Being closed: whoever is inside leaves at its next look.
  [[nodiscard]] bool closing() const noexcept { return (users_.load(std::memory_order_relaxed) & kClosed) != 0; }
  void close() noexcept;
  /// The engine's device names by index (its RDMA devices', then "tcp" and "shm") and how many
  /// of them are RDMA devices: set once while the engine is built, before any batch holds the
  /// gate, and never changed, so a batch names the paths its transfers took (telemetry) whether
  /// or not its engine is still there.
  std::vector<std::string> device_names;
  std::uint32_t rdma_devices = 0;

 private:
  static constexpr std::uint32_t kClosed = 1u << 31;
  std::atomic<std::uint32_t> users_{0};
};

/// BatchState::home of a batch whose transfers are on several workers.
inline constexpr std::uint32_t kSeveralWorkers = ~0u;

struct BatchState {
  BatchState(Engine::Impl* e, std::span<const Transfer> t);
  /// The same with the engine's gate given: moved out of the state this one is made in place
  /// of (Engine::Impl::batch_of_one), so that its count does not go down and up per transfer.
  BatchState(Engine::Impl* e, std::span<const Transfer> t, std::shared_ptr<DriveGate> gate);
  /// A batch of `plan` (which it keeps), its entries in `*entries` (the batch's own allocation:
  /// Engine::submit(plan)).
  BatchState(Engine::Impl* e, std::shared_ptr<PlanState> plan, Xfer* const* entries);
  /// Room for `n` entries and transfers, unconstructed, and (`lists`) for two arrays of n
  /// indices (local_index, remote_index, writable through the const by their owner at submit):
  /// the caller constructs entry k at x[k] (and transfer k at owned[k], or leaves it to build())
  /// before the batch is launched. A batch dropped part way (the caller threw) frees them
  /// unread: both are trivially destructible.
  BatchState(Engine::Impl* e, std::uint32_t n, bool lists = false);
  // Inline: Engine::Impl::batch_of_one destroys its spare state in place once per transfer.
  [[gnu::always_inline]] ~BatchState() {
    static_assert(std::is_trivially_destructible_v<Xfer> && std::is_trivially_destructible_v<Transfer>);
    if (!x_inline) ::operator delete(x);
  }
  BatchState(const BatchState&) = delete;
  BatchState& operator=(const BatchState&) = delete;
  std::uint32_t size = 0;
  Xfer* x = nullptr;  // size entries
  Transfer* owned = nullptr;  // submit(span): the batch's copy of its transfers (one allocation with x)
  bool x_inline = false;  // x lies in the batch's own allocation (a plan's batch, a batch of one)
  // A batch of one transfer: its entry and its copy, here (no allocation of their own).
  alignas(Xfer) unsigned char one_[sizeof(Xfer) + sizeof(Transfer)];
  std::atomic<std::uint32_t> remaining{0};
  std::atomic<std::uint32_t> failed{0};
  std::atomic<bool> sliced{false};  // a transfer of it was cut into slices (Worker::slice)
  bool atomics = false;  // it has atomic transfers (Worker::walk counts their bytes apart)
  mutable std::mutex mu;  // reasons, and a wait() that sleeps
  /// Made (under mu) by the first wait() that sleeps: most batches end before anyone sleeps on
  /// them, and a condition variable's construction and destruction are calls into the C++ and C
  /// libraries on the latency path.
  mutable std::optional<std::condition_variable> cv;
  /// The batch ended and its callback (if any) returned: what wait() waits for. Stored once
  /// (ended()); a waiter that sleeps counts itself in `sleepers` first, so that the common end
  /// (nobody asleep) takes no lock and makes no call to wake anyone.
  std::atomic<bool> callback_ran{false};
  std::atomic<std::uint32_t> sleepers{0};
  void ended() noexcept {
    callback_ran.store(true, std::memory_order_seq_cst);
    // A waiter counts itself asleep before it checks callback_ran (both seq_cst): it saw the
    // batch end, or it is counted here. Taking the lock it holds until it sleeps then means the
    // notify cannot fall between its check and its sleep.
    if (sleepers.load(std::memory_order_seq_cst) != 0) wake_sleepers();
  }
  /// Batch::wait's spin (from `start`, until `until` at the latest): polls for the batch's end
  /// on the calling thread, running its worker's completions here while that worker's thread
  /// is not (Worker::try_drive); true once ended. Through the engine's gate: false at once
  /// (unless ended) when the engine is shutting down.
  bool spin(Deadline start, Deadline until) noexcept;
  /// A wait that slept ended after `took` (the spin's measure of what waits take).
  void slept(std::chrono::nanoseconds took) noexcept;
  // The two maps below are made when first needed: most batches have no failure and no slice,
  // and an empty std::map's destruction is a call into the library at every batch's end (the
  // latency path counts calls: docs/performance.md).
  using Reasons = std::map<std::uint32_t, std::string>;
  /// Under mu: why each failed transfer failed (null: none did).
  std::unique_ptr<Reasons> reasons;
  std::vector<std::string> notify_failures;      // under mu: each notification not sent, why
  using SlicedPaths = std::map<std::uint8_t, std::pair<std::uint64_t, std::uint32_t>>;
  /// Under mu: what the slices of its sliced transfers that ended ok moved, per path (device
  /// index): bytes and transfers (a transfer counts once per path its slices took; null: none).
  std::unique_ptr<SlicedPaths> sliced_paths;
  std::atomic<std::uint32_t> notify_failed{0};
  /// A notification to a peer was not sent (before the transfer whose end decided it ends).
  void notification_failed(std::string why) noexcept;
  std::vector<std::uint8_t> notify;
  std::string request_id;
  /// A notification on its own (Engine::notify): its one entry is the notification, to the
  /// peer of its transfer (which moves nothing).
  bool note_only = false;
  /// Batch::cancel() was called: what of it is not on the wire yet is not posted from now on
  /// (Worker::cancels), nor re-posted after its rail failed.
  std::atomic<bool> cancelled{false};
  // Telemetry (EngineConfig::telemetry): submit() was called; the latest worker's end of
  // posting; its end (steady clock, nanoseconds since its epoch; 0: not yet).
  Deadline submitted{};
  std::atomic<std::int64_t> posted_ns{0};
  std::atomic<std::int64_t> ended_ns{0};
  /// Records that a worker has posted its share of the batch (the latest one counts).
  void stamp_posted() noexcept {
    const std::int64_t now = Clock::now().time_since_epoch().count();
    // A batch on one worker is stamped by that worker's runner alone (under its lock).
    if (home != kSeveralWorkers) return posted_ns.store(now, std::memory_order_relaxed);
    std::int64_t was = posted_ns.load(std::memory_order_relaxed);
    while (was < now && !posted_ns.compare_exchange_weak(was, now, std::memory_order_relaxed)) {
    }
  }
  std::function<void(const Batch&)> on_done;
  Engine::Impl* engine = nullptr;
  std::shared_ptr<PlanState> plan;  // a batch of a plan: posted from its requests
  // A batch of descriptor lists: its lists, operation and copy of the indices (in the entries'
  // allocation); its entries' transfers are built when needed (Xfer::transfer()).
  std::shared_ptr<ListState> local_list, remote_list;
  const std::uint32_t* local_index = nullptr;
  const std::uint32_t* remote_index = nullptr;
  TransferOp list_op = TransferOp::write;
  /// Builds entry x's transfer (owned[x.index]) from the lists: on the worker holding x.
  const Transfer& build(Xfer& x) noexcept;
  /// Of a batch of lists: why position k cannot move (its pair's lengths differ), or empty.
  [[nodiscard]] std::string pair_mismatch(std::uint32_t k) const;
  /// Transfer i: any thread (of a batch of lists, as build() makes it, without building it).
  [[nodiscard]] Transfer transfer_at(std::uint32_t i) const noexcept;
  /// Its length (of a batch of lists: the local descriptor's), its buffer and its peer's
  /// segment: any thread, without building it (no copy of the whole transfer).
  [[nodiscard]] std::uint64_t length_at(std::uint32_t i) const noexcept {
    return local_index != nullptr ? local_list->local[local_index[i]].length : x[i].t_->length;
  }
  [[nodiscard]] const Buffer& local_at(std::uint32_t i) const noexcept {
    return local_index != nullptr ? local_list->local[local_index[i]].buffer : x[i].t_->local;
  }
  [[nodiscard]] const RemoteSegment& remote_at(std::uint32_t i) const noexcept {
    return remote_index != nullptr ? remote_list->remotes[remote_index[i]].segment : x[i].t_->remote;
  }
  /// The worker all its transfers went to, or kSeveralWorkers (set before any is sent).
  std::uint32_t home = 0;
  /// Sends the batch to worker `w` alone, or (kSeveralWorkers) to several: their shares.
  void set_home(std::uint32_t w, std::size_t workers) {
    home = w;
    if (w == kSeveralWorkers) more = std::make_unique<WorkerShare[]>(workers);
  }
  /// Worker `w`'s share (the worker's alone): no lookup, and no allocation for a batch on one
  /// worker.
  WorkerShare& share(std::uint32_t w) noexcept { return w == home ? share0 : more[w]; }
  WorkerShare share0;
  std::unique_ptr<WorkerShare[]> more;  // by worker index, of a batch on several
  std::shared_ptr<DriveGate> gate;  // the engine's
  /// Records a transfer's end with its reason (a failure, or any end when the batch notifies).
  /// `self`: the caller's reference to this batch, which it holds when the transfer is the
  /// batch's last (the worker's, just taken off its list): what the callback gets.
  void finish(Xfer& t, TransferStatus s, std::string reason, const std::shared_ptr<BatchState>& self) noexcept;
  /// `n` transfers ended ok (their status stored already): one count for all of them (`self`
  /// as for finish()).
  void finished_ok(std::uint32_t n, const std::shared_ptr<BatchState>& self) noexcept {
    if (remaining.fetch_sub(n, std::memory_order_acq_rel) == n) last_ended(self);
  }

 private:
  /// x and owned for `size` entries (in one_ for a batch of one), unconstructed; and room for
  /// two arrays of `size` indices when `lists` (one_index_ for a batch of one).
  void allocate_entries(bool lists = false) {
    // One allocation: the entries, then the copies of the transfers they point at, then (a batch
    // of descriptor lists) the indices.
    static_assert(alignof(Transfer) <= alignof(Xfer));
    // A batch of one (a flag, a lease, a small block: what waits for the wire's latency) keeps
    // them in the state itself.
    static_assert(sizeof(Xfer) % alignof(Transfer) == 0 && sizeof(Transfer) % alignof(std::uint32_t) == 0);
    const std::size_t n = std::max<std::size_t>(size, 1);
    x_inline = n == 1;
    const std::size_t indices = lists && !x_inline ? 2 * n * sizeof(std::uint32_t) : 0;
    x = x_inline ? reinterpret_cast<Xfer*>(one_)
                 : static_cast<Xfer*>(::operator new(n * (sizeof(Xfer) + sizeof(Transfer)) + indices));
    owned = reinterpret_cast<Transfer*>(x + n);
    if (lists) {
      auto* at = x_inline ? one_index_ : reinterpret_cast<std::uint32_t*>(owned + n);
      local_index = at;
      remote_index = at + n;
    }
  }
  std::uint32_t one_index_[2] = {0, 0};
  /// The batch's end (its last transfer ended): telemetry, the callback, the waiters, the
  /// engine's descriptor. Inline (impl.hpp), as finished_ok(): the latency path's end.
  void last_ended(const std::shared_ptr<BatchState>& self) noexcept;
  /// on_done, run by last_ended (out of line: most batches have none).
  void run_callback(const std::shared_ptr<BatchState>& self) noexcept;
  /// ended()'s wake-up of the waiters asleep on the batch (out of the common path).
  void wake_sleepers() noexcept;
};

/// A batch's state, allocated by malloc and freed by free directly: std::make_shared's
/// operator new and sized operator delete are three more calls per batch into the C++ library,
/// which on the lab's emulator cost more than the round trip can spare (docs/performance.md).
template <class T>
struct MallocAllocator {
  static_assert(alignof(T) <= alignof(std::max_align_t));
  using value_type = T;
  MallocAllocator() noexcept = default;
  template <class U>
  MallocAllocator(const MallocAllocator<U>&) noexcept {}  // NOLINT: rebinding, as std::allocator
  T* allocate(std::size_t n) {
    if (n > std::size_t(-1) / sizeof(T)) throw std::bad_array_new_length();
    if (void* p = std::malloc(n * sizeof(T))) return static_cast<T*>(p);
    throw std::bad_alloc();
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }
  template <class U>
  bool operator==(const MallocAllocator<U>&) const noexcept {
    return true;
  }
};
template <class... Args>
std::shared_ptr<BatchState> make_batch(Args&&... args) {
  return std::allocate_shared<BatchState>(MallocAllocator<BatchState>{}, std::forward<Args>(args)...);
}

inline const Transfer& Xfer::transfer() noexcept {
  if (t_ != nullptr) [[likely]] return *t_;
  return batch->build(*this);
}
inline Transfer Xfer::transfer_copy() const noexcept { return t_ != nullptr ? *t_ : batch->transfer_at(index); }

/// The slices of one sliced transfer (Worker::slice): they end into it, and the transfer ends
/// when the last has, ok or with the first failure.
struct SliceGroup {
  Xfer* parent = nullptr;
  std::deque<Transfer> transfers;  // each slice's (deque: neither moves)
  std::deque<Xfer> slices;
  std::uint32_t left = 0;
  TransferStatus status = TransferStatus::ok;
  std::string reason;
  std::map<std::uint8_t, std::uint64_t> bytes_by_path;  // of its slices that ended ok (telemetry)
};

}  // namespace rdmakit::detail
