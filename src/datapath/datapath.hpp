// SPDX-License-Identifier: Apache-2.0
#pragma once
// The data path: posting, the work-request rings, segmentation, completions, and the one break
// and one drain routine. Connection uses it, and so will the engine: there is no second copy.
//
// It owns no verbs handle. Whoever builds it (Connection::Impl) owns the QPs, CQs and completion
// channel, keeps them alive while it is used, and calls forget_qps() before destroying the QPs.
//
// post/poll go through the provider's inline calls (ibv_post_send, ibv_poll_cq,
// ibv_req_notify_cq dispatch through the context's ops table; ibv_wr_* and ibv_start_poll through
// the QP's and CQ's extended interfaces, use_extended()); the few verbs libibverbs does not
// dispatch that way go through VerbsOps. A fake provider for unit tests plugs in at exactly those
// places (tests/unit/fake_verbs.hpp), so the code under test is the code that runs.
//
// Not thread-safe: one thread at a time, like the Connection that holds it.

#include <infiniband/verbs.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/clock.hpp"
#include "datapath/ring.hpp"
#include "rdmakit/connection.hpp"

namespace rdmakit::detail {

/// The verbs the data path calls that are not inline dispatches through the context's ops.
struct VerbsOps {
  int (*to_error)(ibv_qp* qp) noexcept;  ///< ibv_modify_qp(qp, state = ERR)
  int (*get_cq_event)(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) noexcept;
  void (*ack_cq_events)(ibv_cq* cq, unsigned n) noexcept;
};
/// libibverbs' own.
const VerbsOps& real_verbs() noexcept;

inline constexpr int kPollBatch = 16;
// QPs per data path at most (a connection's, wire::kMaxQps).
inline constexpr std::size_t kMaxLanes = 16;

// A one-request post's outcome in one register: PostResult's first word (the status in the low
// byte, the errno in the upper half; a single request's index is 0). The one-request paths
// return this and the public call turns it into a PostResult: GCC merges a 16-byte PostResult
// that several paths build field by field (~10 instructions on every return), a word with none.
enum class PostCode : std::uint64_t { ok = 0 };
constexpr PostCode post_code(PostStatus status, int err = 0) noexcept {
  return PostCode{static_cast<std::uint64_t>(status) | std::uint64_t{static_cast<std::uint32_t>(err)} << 32};
}
constexpr PostCode post_code(const PostResult& r) noexcept { return post_code(r.status, r.sys_errno); }
inline PostResult to_result(PostCode c) noexcept {
  static_assert(std::endian::native == std::endian::little && offsetof(PostResult, status) == 0 &&
                offsetof(PostResult, sys_errno) == 4 && offsetof(PostResult, index) == 8 &&
                sizeof(PostResult) == 16 && sizeof(PostStatus) == 1);
  // Through a union: a bit_cast is assembled field by field (a mask on every return).
  union Words {
    std::uint64_t w[2];
    PostResult r;
  } u{{static_cast<std::uint64_t>(c), 0}};
  return u.r;
}

class DataPath;
class CqRouter;

// One QP and the bookkeeping of its send queue. A cache line's multiple in size: a completion
// finds its lane by index with a shift.
struct alignas(64) Lane {
  ibv_qp* qp = nullptr;
  ibv_qp_ex* qpx = nullptr;  // its extended interface (DataPath::use_extended); null: ibv_post_send only
  WrRing sq;
  std::uint32_t unsignaled_run = 0;  // WRs posted unsignaled since the last signaled one
  // unsignaled_run after a post the provider refused: long enough that the next request is
  // signaled, short enough not to overflow when counted on.
  static constexpr std::uint32_t kRunUnknown = 1u << 30;
  // The tag in its wr_ids (ring.hpp): its index in the data path's lanes when the data path
  // owns its CQs; its route in a shared CQ's router when it does not.
  std::uint32_t id = 0;
  std::uint64_t tag = 0;  // id << kTagShift, set with it (set_id)
  DataPath* owner = nullptr;
  std::uint32_t qpn = 0;             // kept for messages after the QP is gone
  bool in_error = false;             // moved to ERR by the drain routine
  bool needs_marker = false;         // a drain marker is owed (posted once there is room)

  void set_id(std::uint32_t i) noexcept {
    id = i;
    tag = std::uint64_t{i} << kTagShift;
  }
  // The verbs wr_id of the request with sequence number `seq` (ring.hpp).
  [[nodiscard]] std::uint64_t wr_id(std::uint64_t seq) const noexcept { return tag | (seq & kSeqMask); }
};

// A WRITE or READ posted as several parts (striped across QPs, or split at max_msg_sz): the
// user's completion is delivered once, when the last counted part has completed, with the first
// error any part had. A part's ring slot holds index | generation << 32, so a completion of a
// part of an earlier request that used the same entry is recognised and ignored.
struct Segmented {
  std::uint64_t wr_id = 0;
  Opcode op = Opcode::write;
  std::uint32_t pending = 0;  // counted parts (one per QP used) not yet completed
  std::uint32_t generation = 0;
  int status = 0;
  std::uint32_t vendor_err = 0;
  bool silent = false;  // only partly posted and already reported as a failed post
};

// A request checked once and posted many times (Connection::prepare): its work request is
// built, and a post only sets the wr_id and whether it is signaled.
struct alignas(256) Prepared {  // a power of two in size: found by index with a shift
  ibv_send_wr wr{};            // a signaled one's send_flags are final; an unsignaled one's are set per post
  std::vector<ibv_sge> sges;   // wr.sg_list (its storage stays put when the table grows)
  unsigned flags = 0;          // IBV_SEND_INLINE or 0
  std::uint32_t generation = 0;  // a handle must match it; even, bumped by 2 on release
  // The handle (as one word) that takes post_prepared's inline path: this entry's while the
  // request is in use and goes to the first QP; kNoFast (generation 1, odd: no handle carries
  // it) otherwise.
  static constexpr std::uint64_t kNoFast = std::uint64_t{1} << 32;
  std::uint64_t fast_handle = kNoFast;
  WrRing::Slot slot;           // its ring entry but the wr_id: the opcode, user or silent (unsignaled)
  bool any_lane = false;       // a WRITE or READ with several QPs: any of them may take it
  bool in_use = false;
  // A WRITE or READ of data posted through the lanes' extended interface (use_extended): how
  // (ext_kind), and its arguments laid out for the calls; kNone: by ibv_post_send.
  std::uint8_t ext = 0;
  std::uint32_t ext_rkey = 0;
  std::uint64_t ext_raddr = 0;
  ibv_sge ext_sge{};  // the first SGE
};

/// How a prepared request goes through the extended interface (Prepared::ext).
namespace ext_kind {
inline constexpr std::uint8_t kNone = 0, kWrite = 1, kRead = 2, kWriteInline = 3, kWriteList = 4, kReadList = 5;
}

/// Why the data path stopped accepting work.
enum class BreakCause : std::uint8_t {
  none,
  peer,        ///< the peer is gone (reported once by wait() as peer_lost)
  device,      ///< port down, QP/CQ/device fatal (reported once as device_error)
  completion,  ///< an error completion on any QP (that completion is the report)
};

/// The sizes and device limits the data path works within, fixed at setup.
struct DataPathLimits {
  std::uint32_t send_depth = 64;  ///< per QP
  std::uint32_t recv_depth = 64;
  std::uint32_t max_sge = 1;      ///< granted
  std::uint32_t max_inline = 0;   ///< granted
  std::uint32_t max_msg_size = 1u << 31;
  std::uint64_t stripe_min = 512 * 1024;
};

/// What the wait loop does besides polling, about once a millisecond (control channel, device
/// events); it may break the data path. Implemented by Connection.
class Housekeeping {
 public:
  virtual void tick(Deadline now) noexcept = 0;
  /// A descriptor whose readability should end a sleep on the completion channel (-1: none).
  [[nodiscard]] virtual int wake_fd() const noexcept = 0;

 protected:
  ~Housekeeping() = default;
};

class DataPath {
 public:
  DataPath() = default;
  // It points into itself (single_wrs_, the chain's lane, the advertised region used last).
  DataPath(const DataPath&) = delete;
  DataPath& operator=(const DataPath&) = delete;
  enum class Mode : std::uint8_t {
    idle,    ///< built: receives may be posted, nothing else (the QPs are not in RTS)
    ready,   ///< connected: everything may be posted
    broken,  ///< failed: the QPs are in ERR, what was outstanding completes flushed
    closed,  ///< closed: as broken, and by choice
  };

  /// Takes the QPs (in RTS order: lanes[0] first) and CQs; allocates everything posting needs.
  void init(const DataPathLimits& limits, std::span<ibv_qp* const> qps, ibv_cq* send_cq,
            ibv_cq* recv_cq, ibv_comp_channel* channel, const VerbsOps& ops);
  /// Tracing of error completions and breaks (off the hot path).
  void observe(std::function<void(const TraceEvent&)> trace, std::string peer);
  /// After init(), the extended interfaces: `qps`, each QP's (in init()'s order; all or none:
  /// created by ibv_create_qp_ex with every opcode posted among its send ops), so that a
  /// prepared or single WRITE or READ is posted through ibv_wr_* (the provider builds its entry
  /// from the calls, without parsing a classic work request); `inline_data`, the provider takes
  /// inline data that way (else those requests go by their SGE). `send_cq` (or null): the send
  /// CQ as created by ibv_create_cq_ex, polled one completion at a time through ibv_start_poll
  /// (batches and drains keep ibv_poll_cq).
  void use_extended(std::span<ibv_qp_ex* const> qps, bool inline_data, ibv_cq_ex* send_cq) noexcept;
  /// Makes the data path one of many on shared CQs: its completions are polled by the CQs'
  /// owner through the routers (CqRouter::poll), which hand each to this data path's
  /// bookkeeping. Then poll(), wait(), settle() and the reaping in shut() are not to be used:
  /// they would take other data paths' completions. Before anything is posted.
  void route_through(CqRouter& send, CqRouter& recv);
  [[nodiscard]] bool routed() const noexcept { return send_router_ != nullptr; }
  /// What the peer advertised, and whether atomics work end to end.
  void set_remote(std::vector<RemoteRegion> regions, bool atomics);
  /// The QPs are in RTS: everything may be posted.
  void start() noexcept {
    if (mode_ == Mode::idle) set_mode(Mode::ready);
  }

  // --- posting (noexcept, no allocation) ----------------------------------------------------
  template <Opcode Op>
  [[gnu::always_inline]] PostResult post_one(const LocalSlice& local, const RemoteRegion& remote,
                                             std::uint64_t offset, std::uint32_t imm, std::uint64_t compare_add,
                                             std::uint64_t swap, std::uint64_t wr_id) noexcept {
    return to_result(post_one_code<Op>(local, remote, offset, imm, compare_add, swap, wr_id));
  }
  template <Opcode Op>
  PostCode post_one_code(const LocalSlice& local, const RemoteRegion& remote, std::uint64_t offset,
                         std::uint32_t imm, std::uint64_t compare_add, std::uint64_t swap,
                         std::uint64_t wr_id) noexcept;
  PostResult post_batch(std::span<const WorkRequest> batch) noexcept;
  PostResult post_recvs(std::span<const LocalSlice> dsts, std::uint64_t first_wr_id) noexcept;

  // Prepared requests (Connection::prepare). prepare() checks `w` as post_batch would, except
  // that a request that would be segmented is too_large, and builds its work request; on a
  // refusal nothing is kept. It allocates (setup). post_prepared() is the shortest post there
  // is: a stale handle, the data path's mode and the queue's room are all it checks.
  PostResult prepare(const WorkRequest& w, PreparedRequest& out);
  [[gnu::always_inline]] PostResult post_prepared(PreparedRequest h, std::uint64_t wr_id) noexcept {
    return to_result(post_prepared_code(h, wr_id));
  }
  PostCode post_prepared_code(PreparedRequest h, std::uint64_t wr_id) noexcept;
  void release(PreparedRequest h) noexcept;

  // A chain built in place, for a caller that posts many one-range requests at a time and has
  // resolved each one's remote region already (the engine): chain_add() writes request after
  // request straight into the verbs arrays and the lane's ring, post_chain_built() hands them
  // to the provider with one doorbell. The checks are post_batch's, minus the scan of the
  // advertised list.
  /// Starts a chain on `lane` (dropping one built and not posted); returns how many requests it
  /// may hold (0 when the data path is not ready or the queue is full). Every `signal_every`-th
  /// request (a power of two; fewer when the queue is shallow) and the last are signaled, and
  /// their completions are news: each retires the requests before it.
  std::uint32_t begin_chain(Lane& lane, std::uint32_t signal_every) noexcept;
  /// Appends a request moving `length` bytes at local `laddr` (`lkey`; `writable`: registered
  /// for local write) to or from `offset` in `remote`, which must be a region the peer
  /// advertised. Not ok: nothing was appended. At most begin_chain()'s answer of them.
  template <Opcode Op>
  PostStatus chain_add(std::uint64_t laddr, std::uint32_t length, std::uint32_t lkey, bool writable,
                       const RemoteRegion& remote, std::uint64_t offset, std::uint64_t compare_add,
                       std::uint64_t swap, std::uint64_t wr_id) noexcept;
  [[nodiscard]] std::uint32_t chain_size() const noexcept { return chain_n_; }
  /// chain_add()'s checks and request, built into `v` and `sge` (`v.sg_list` points at it):
  /// everything but the wr_id, `next` and the signal flag. What a caller that posts the same
  /// requests many times keeps (the engine's plans, post_prebuilt()).
  template <Opcode Op>
  PostStatus build_request(ibv_send_wr& v, ibv_sge& sge, std::uint64_t laddr, std::uint32_t length,
                           std::uint32_t lkey, bool writable, const RemoteRegion& remote, std::uint64_t offset,
                           std::uint64_t compare_add, std::uint64_t swap) const noexcept;
  /// How many requests post_prebuilt() may post on `lane` now, for a chain signaled every
  /// `signal_every` requests at most: 0 when the data path is not ready, or when the lane's
  /// unsignaled run would make the first signal come later than the queue allows.
  [[nodiscard]] std::uint32_t prebuilt_room(const Lane& lane, std::uint32_t signal_every) const noexcept;
  /// Posts `n` requests (at most prebuilt_room()) the caller built with build_request() and
  /// linked, the last with `next` null and signaled, signaled every `signal_every` at most; sets
  /// their wr_ids and stages ring slots `slots_of[i]` with `id_base` added to each wr_id (a
  /// slot's kind `user` where its request is signaled, else `silent`). A request keeps nothing
  /// of the caller's arrays after the call: the same ones may be posted again at once.
  PostResult post_prebuilt(Lane& lane, ibv_send_wr* wrs, std::uint32_t n, const WrRing::Slot* slots_of,
                           std::uint64_t id_base) noexcept;
  /// Posts `n` requests (at most prebuilt_room()) the caller built and linked, the last with
  /// `next` null and signaled, signaled every prebuilt_room()'s `signal_every` at most, whose
  /// wr_ids it set to lane.wr_id(next_seq() + i) and whose ring slots it wrote at next_seq() + i
  /// (the engine's descriptor lists, which write each request in one pass).
  PostResult post_written(Lane& lane, ibv_send_wr* wrs, std::uint32_t n) noexcept { return post_linked(lane, wrs, n, 0); }
  /// Posts the chain (its last request signaled, so its completion retires all of it). On a
  /// provider failure the first `index` requests went.
  PostResult post_chain_built() noexcept;
  /// Binds type-2 memory window `mw` to [addr, addr + length) of `mr` with key `rkey` (the
  /// window's previous key, ibv_inc_rkey'd) and `mw_access` (IBV_ACCESS_REMOTE_*), on the first
  /// QP: the window then works for that QP's peer only. Signaled; its completion is the
  /// caller's news with `wr_id` (reported as a send).
  PostResult post_bind(ibv_mw* mw, std::uint32_t rkey, ibv_mr* mr, std::uint64_t addr,
                       std::uint64_t length, unsigned mw_access, std::uint64_t wr_id) noexcept;

  // --- completions ------------------------------------------------------------------------------
  std::size_t poll(std::span<Completion> out) noexcept;
  /// poll() for one completion (what a latency loop asks for): the same bookkeeping, in a frame
  /// of its own without the batch loop's array of work completions, and out of line so that
  /// the public poll() that calls it saves no registers.
  [[gnu::noinline]] std::size_t poll_one(Completion& out) noexcept;
  [[gnu::noinline]] std::size_t poll_one_recv(Completion& out) noexcept;
  // poll_one's completion off its inline path (not the caller's news, an error, a part, owed
  // markers, nothing in flight: `slot` null); the completion is in wc_, the caller's entry at
  // poll_out_.
  [[gnu::noinline]] std::size_t poll_one_other(const WrRing::Slot* slot) noexcept;
  // poll_one through the send CQ's extended interface (use_extended), and what follows a work
  // completion taken into wc_ either way.
  [[gnu::noinline]] std::size_t poll_one_extended() noexcept;
  inline std::size_t poll_one_taken() noexcept;
  // Whether the lanes post WRITEs and READs through ibv_wr_* (use_extended(): all or none).
  [[nodiscard]] bool extended() const noexcept { return lane_count_ > 0 && lanes_[0].qpx != nullptr; }
  // The extended interfaces forgotten: the lanes', the send CQ's, and the prepared requests'
  // layouts for them (init(), forget_qps(), use_extended() before it decides).
  void drop_extended() noexcept;
  // Whether the send CQ may hold a completion for this data path: with one QP, only while its
  // queue has something in flight (a latency loop then skips the provider's call). The first
  // queue is read before the QP count: fewer jumps when busy.
  [[nodiscard]] bool sends_may_complete() const noexcept { return lanes_[0].sq.count() != 0 || lane_count_ > 1; }
  /// Waits for the next completion (see Connection::wait), calling `hk.tick` about once a
  /// millisecond; a break is reported once, then `closed` once nothing is outstanding.
  WaitResult wait(std::chrono::milliseconds timeout, Housekeeping& hk) noexcept;
  [[nodiscard]] std::uint32_t outstanding() const noexcept { return sends_in_flight() + rq_.count(); }
  [[nodiscard]] std::uint32_t sends_in_flight() const noexcept {
    std::uint32_t n = 0;
    for (const Lane& l : lanes()) n += l.sq.count();
    return n;
  }

  // --- ending -------------------------------------------------------------------------------
  /// The one break routine: records why (the first reason wins), refuses posts from now on, and
  /// moves every QP to ERR with a drain marker, so everything outstanding completes (flushed)
  /// and outstanding() reaches zero. Safe to call from anywhere, repeatedly.
  void break_connection(std::string why, BreakCause cause) noexcept;
  /// Close, step 1 (before saying BYE): lets the sends in flight finish, until `deadline` or
  /// until the data path breaks (hk.tick sees the peer go). A QP whose newest request is
  /// unsignaled gets a signaled zero-length WRITE (or READ) into a region the peer advertised,
  /// so its completion shows when the earlier ones are done. Completions are discarded.
  void settle(Deadline deadline, Housekeeping& hk) noexcept;
  /// Close, step 2: refuses posts, flushes whatever is left (receives included) with the drain
  /// routine and reaps it until `deadline`. Returns how many requests never completed.
  std::uint32_t shut(Deadline deadline) noexcept;
  /// Posts the drain markers a break still owes (on shared CQs, where no poll() of its own does).
  void post_owed_markers() noexcept {
    if (markers_pending_) post_markers();
  }
  /// The QPs are about to be destroyed: nothing of theirs is in flight any more.
  void forget_qps() noexcept;

  [[nodiscard]] Mode mode() const noexcept { return mode_; }
  /// The longest run of unsignaled requests the send queue allows (half its depth, at least 1).
  [[nodiscard]] std::uint32_t signal_interval() const noexcept { return forced_signal_interval_; }
  [[nodiscard]] BreakCause cause() const noexcept { return cause_; }
  [[nodiscard]] const std::string& failure() const noexcept { return failure_; }
  [[nodiscard]] const std::vector<RemoteRegion>& remote() const noexcept { return remote_; }
  [[nodiscard]] const DataPathLimits& limits() const noexcept { return limits_; }
  [[nodiscard]] bool atomics() const noexcept { return atomics_; }
  /// QPs whose newest request was unsignaled with no advertised region to aim a marker at when
  /// the last settle() ran: their requests were flushed rather than waited for.
  [[nodiscard]] std::uint32_t unobservable() const noexcept { return unobservable_; }
  [[nodiscard]] std::span<Lane> lanes() noexcept { return {lanes_.data(), lane_count_}; }
  [[nodiscard]] std::span<const Lane> lanes() const noexcept { return {lanes_.data(), lane_count_}; }
  [[nodiscard]] Lane& lane(std::size_t i) noexcept { return lanes_[i]; }
  [[nodiscard]] const Lane& lane(std::size_t i) const noexcept { return lanes_[i]; }

  /// Whoever routes the data path through shared CQs may keep its own object here, to find it
  /// again from a routed completion.
  void* context = nullptr;

 private:
  friend class CqRouter;
  template <Opcode Op>
  PostResult check(std::span<const LocalSlice> local, const RemoteRegion& remote,
                   std::uint64_t offset, std::uint64_t total) const noexcept;
  template <Opcode Op>
  bool check_fast(const LocalSlice& local, const RemoteRegion& remote, std::uint64_t offset,
                  std::uint64_t total) const noexcept;
  // post_one's parts: the case it does not take inline (the full checks, the scan of the
  // advertised list, the choice among QPs), and the post itself on a chosen lane.
  template <Opcode Op>
  [[gnu::noinline]] PostCode post_one_slow(const LocalSlice& local, const RemoteRegion& remote,
                                           std::uint64_t offset, std::uint32_t imm, std::uint64_t compare_add,
                                           std::uint64_t swap, std::uint64_t wr_id) noexcept;
  template <Opcode Op>
  PostCode post_one_on(Lane& lane, const LocalSlice& local, const RemoteRegion& remote, std::uint64_t offset,
                       std::uint32_t imm, std::uint64_t compare_add, std::uint64_t swap,
                       std::uint64_t wr_id) noexcept;
  // The provider refused the request just pushed on `lane`: takes its ring entry back and
  // counts the lane's unsignaled run as unknown, so the next request is signaled (a drain then
  // treats the newest request as unsignaled: one marker too many at worst).
  [[gnu::noinline, gnu::cold]] static PostCode refused(Lane& lane, int rc) noexcept;
  PostResult check(Opcode op, std::span<const LocalSlice> local, const RemoteRegion& remote,
                   std::uint64_t offset, std::uint64_t total) const noexcept;
  [[gnu::noinline]] Lane& pick_lane() noexcept;
  PostCode post_prepared_on(Lane& lane, Prepared& p, std::uint64_t wr_id) noexcept;
  // post_prepared's case off the inline path: a refusal (stale, not ready), or a request any
  // QP may take. (The handle as one word: passed as a struct, GCC spills it to the stack on the
  // inline path.)
  [[gnu::noinline]] PostCode post_prepared_slow(std::uint64_t handle, std::uint64_t wr_id) noexcept;
  // Sets mode_ and the fast path's size gates (below) with it.
  void set_mode(Mode mode) noexcept {
    mode_ = mode;
    prepared_gate_ = mode == Mode::ready ? prepared_count_ : 0;
    gate_spread_ = mode == Mode::ready && lane_count_ == 1 ? segment_min_spread_ - 1 : 0;
    gate_ordered_ = mode == Mode::ready ? segment_min_ordered_ - 1 : 0;
  }
  // A request post_one sent aside because it is not ready, or to be segmented, or too large.
  [[gnu::noinline]] PostResult post_gated(Opcode op, const LocalSlice& local, const RemoteRegion& remote,
                                          std::uint64_t offset, std::uint32_t imm,
                                          std::uint64_t wr_id) noexcept;
  [[gnu::noinline]] const RemoteRegion* find_advertised(std::uint32_t rkey, std::uint64_t addr,
                                                        std::uint64_t len) const noexcept;
  PostResult post_chain(Lane& lane, std::span<const WorkRequest> batch, bool parts,
                        std::uint64_t part_handle) noexcept;
  // Posts the first n entries of send_wrs_ (their ring slots staged) on `lane`; `run` is the
  // lane's unsignaled run after the last of them.
  PostResult post_staged(Lane& lane, std::uint32_t n, std::uint32_t run) noexcept;
  // Posts the linked requests `wrs` (their slots staged), committing what the provider took;
  // `run`: the lane's unsignaled run after them.
  PostResult post_linked(Lane& lane, ibv_send_wr* wrs, std::uint32_t n, std::uint32_t run) noexcept;
  PostResult post_segmented(Opcode op, const LocalSlice& local, const RemoteRegion& remote,
                            std::uint64_t offset, std::uint32_t imm, std::uint64_t wr_id) noexcept;
  const RemoteRegion* advertised(const RemoteRegion& r, std::uint64_t offset,
                                 std::uint64_t len) const noexcept;
  // A region of the caller's post_one found wholly inside one the peer advertised, with that
  // one's access (check_fast()). Reset whenever remote_ changes.
  struct CheckedRegion {
    std::uint64_t addr = 0;
    std::uint64_t length = 0;
    std::uint32_t rkey = 0;
    Access access = Access::none;
  };

  std::size_t reap_send(std::span<Completion> out) noexcept;
  [[gnu::noinline]] std::size_t poll_many(std::span<Completion> out) noexcept;
  std::size_t reap_recv(std::span<Completion> out) noexcept;
  bool take_send(const ibv_wc& wc, Completion& c) noexcept;
  bool take_lane(Lane& lane, const ibv_wc& wc, Completion& c) noexcept;
  // take_lane() once the ring has retired the completion's request (`slot`; null: it was not in
  // flight): the caller's news, or the uncommon cases (take_other).
  bool take_retired(Lane& lane, const WrRing::Slot* slot, const ibv_wc& wc, Completion& c) noexcept;
  bool take_recv(const ibv_wc& wc, Completion& c) noexcept;
  bool finish_part(const WrRing::Slot& slot, const ibv_wc& wc, Completion& c) noexcept;
  // take_lane's and take_recv's uncommon cases (out of line): a part, a forced completion or a
  // marker, an error, a completion of nothing in flight (`slot` null: read as a marker).
  [[gnu::noinline]] bool take_other(Lane& lane, const WrRing::Slot* slot, const ibv_wc& wc,
                                    Completion& c) noexcept;
  [[gnu::noinline]] bool take_recv_other(const WrRing::Slot* slot, const ibv_wc& wc,
                                         Completion& c) noexcept;
  void on_error(const Completion& c, std::uint32_t qpn) noexcept;
  void release_segmented(std::uint32_t index) noexcept;

  // The drain routine: every QP to ERR, and a marker where trailing unsignaled requests would
  // otherwise never be retired.
  void flush_all() noexcept;
  void post_markers() noexcept;
  bool post_marker(Lane& lane, ibv_wr_opcode opcode, const RemoteRegion* target) noexcept;
  // Polls until a completion for the caller turns up (true) or both CQs are empty.
  bool poll_until_news(Completion& out) noexcept;
  bool sleep_until_event(Deadline deadline, int wake_fd, Completion& out) noexcept;
  void reap_until(Deadline deadline, bool receives) noexcept;

  DataPathLimits limits_;
  const VerbsOps* ops_ = nullptr;
  // The QPs: the first lane_count_ (init()). lanes_[0] carries SEND/RECV, WRITE_WITH_IMM and
  // atomics, so those stay in order; WRITEs and READs go to any lane. In the data path itself,
  // not behind a pointer: a post or poll finds its lane at a fixed offset.
  std::array<Lane, kMaxLanes> lanes_{};
  std::uint32_t lane_count_ = 0;
  ibv_cq* send_cq_ = nullptr;
  ibv_cq_ex* send_cqx_ = nullptr;  // the same, extended (use_extended); null: ibv_poll_cq only
  ibv_cq* recv_cq_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  WrRing rq_;  // lanes_[0]'s receive queue
  std::uint32_t rq_tag_ = 0;  // the tag in its wr_ids
  CqRouter* send_router_ = nullptr;  // shared CQs (route_through)
  CqRouter* recv_router_ = nullptr;
  Mode mode_ = Mode::idle;
  bool markers_pending_ = false;  // checked once per poll: a drain marker waits for room
  bool atomics_ = false;
  bool ext_inline_ = false;  // use_extended(): the lanes take inline data through ibv_wr_* too
  std::vector<RemoteRegion> remote_;
  const RemoteRegion* settle_target_ = nullptr;  // in remote_; null when none can take a marker
  ibv_wr_opcode settle_opcode_ = IBV_WR_RDMA_WRITE;

  // Prepared requests: the table, its free entries, and its size (kept apart: size() divides).
  std::vector<Prepared> prepared_;
  std::vector<std::uint32_t> free_prepared_;
  std::uint32_t prepared_count_ = 0;
  // post_prepared's one gate: prepared_count_ while ready, else 0 (every handle goes aside,
  // where the refusal is named).
  std::uint32_t prepared_gate_ = 0;

  // Preallocated so posting never allocates.
  std::vector<ibv_send_wr> send_wrs_;
  ibv_wc wc_{};  // poll_one's work completion
  Completion* poll_out_ = nullptr;  // poll_one's `out` during its provider call
  ibv_send_wr* bad_wr_ = nullptr;  // the provider's answer to a post (read by nobody: a refusal posts nothing)
  // post_one's WRs, one per opcode (its opcode set once): next and the unused fields stay zero.
  std::array<ibv_send_wr, static_cast<std::size_t>(Opcode::compare_swap) + 1> single_wrs_{};
  ibv_sge single_sge_{};     // their one SGE (sg_list from init() on)
  CheckedRegion checked_;    // post_one's caller's region checked last
  std::vector<WorkRequest> part_reqs_;  // one lane's parts of a segmented request (send_depth)
  std::vector<LocalSlice> part_slices_;
  std::vector<Segmented> segmented_;         // qps * send_depth entries
  std::vector<std::uint32_t> free_segmented_;  // indexes into segmented_ not in use
  std::vector<ibv_sge> send_sges_;
  std::vector<ibv_recv_wr> recv_wrs_;
  std::vector<ibv_sge> recv_sges_;
  std::uint32_t forced_signal_interval_ = 1;  // max(1, send_depth / 2)
  std::uint32_t next_lane_ = 0;               // round robin for WRITE/READ
  // The chain being built (begin_chain): its lane and length, its first verbs wr_id (the rest
  // follow by one: the chain never crosses a wrap of the sequence bits), and when to signal
  // (request i is signaled when ((i + phase) & mask) == 0).
  Lane* chain_lane_ = nullptr;
  std::uint32_t chain_n_ = 0;
  std::uint32_t chain_phase_ = 1;
  std::uint32_t chain_mask_ = 0;
  std::uint64_t chain_wr_id_ = 0;
  // WRITE/READ of at least this many bytes are segmented: striped when there are several
  // lanes, split at max_msg_sz otherwise. WRITE_WITH_IMM only splits (its immediate must arrive
  // last, which only one QP guarantees).
  std::uint64_t segment_min_spread_ = 0;
  std::uint64_t segment_min_ordered_ = 0;
  // post_one's one gate: a request whose size less one is at least this leaves the inline path
  // (to be segmented or too large; 0 bytes wrap). 0 while not ready, so every request does (and
  // post_gated says why). `spread`: WRITE and READ (also 0 with several QPs: the choice among
  // them is out of line); `ordered`: everything else (segment_min_ordered_ - 1 is max_msg_sz).
  std::uint64_t gate_spread_ = 0;
  std::uint64_t gate_ordered_ = 0;
  // The advertised region the last request fell in: tried first (requests tend to go to the
  // same region), before the scan of remote_. Reset whenever remote_ changes.
  mutable const RemoteRegion* last_advertised_ = nullptr;

  // Why it broke, and whether wait() has said so.
  std::string failure_;
  BreakCause cause_ = BreakCause::none;
  bool break_reported_ = false;
  std::uint32_t unobservable_ = 0;

  std::function<void(const TraceEvent&)> trace_;
  std::string peer_;
};

}  // namespace rdmakit::detail

// The hot path's definitions (inline, so a public post_* or poll is one function).
#include "datapath/hot_path.hpp"  // IWYU pragma: export
