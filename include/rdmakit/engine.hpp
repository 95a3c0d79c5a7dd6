// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rdmakit/connection.hpp"
#include "rdmakit/identity.hpp"
#include "rdmakit/lease.hpp"
#include "rdmakit/memory.hpp"
#include "rdmakit/metadata.hpp"

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// How the engine uses several NICs: the rails of a peer link (docs/engine.md, "Rails").
struct RailConfig {
  /// Most rails a peer link holds (QPs on distinct local ports). 0: every local port that reaches
  /// a port of the peer (same link layer, GIDs of one family on one subnet); 1: only the port
  /// its address is reached through.
  std::uint32_t max = 0;
  /// The local devices rails may use, and the only ones this engine offers its peers as rails
  /// (empty: all).
  std::vector<std::string> devices{};
  /// A read or write of at least this many bytes is cut into slices spread over the peer's rails
  /// (each slice to the rail with the fewest bytes outstanding, so a slower rail gets fewer);
  /// shorter ones go whole to one rail. 0: never sliced.
  std::uint64_t slice_threshold = 512 * 1024;
  /// The bytes of one slice (the last may be shorter); at least 4096.
  std::uint64_t slice_size = 256 * 1024;
  /// A rail that failed is probed (reconnected) after this, the wait doubling after each failed
  /// probe up to probe_max; it carries transfers again once it answers.
  std::chrono::milliseconds probe_first{500};
  std::chrono::milliseconds probe_max{4000};
};

/// How a peer link moves its data (EngineConfig::transports, docs/engine.md "Transports").
enum class Transport : std::uint8_t {
  rdma,  ///< RDMA on a NIC: one-sided, the NIC checks every access
  tcp,   ///< any peer: TCP streams, the target's worker serves and checks each request in software
  shm,   ///< a peer on the same host (proven, not guessed): memory to memory, no network (ShmCopy)
};
[[nodiscard]] const char* to_string(Transport t) noexcept;
/// "rdma", "tcp", "shm"; throws Error (EINVAL) for anything else.
[[nodiscard]] Transport parse_transport(std::string_view text);

/// How an shm link's data crosses between the two processes (EngineConfig::shm_copy).
enum class ShmCopy : std::uint8_t {
  /// Cross-memory attach where this kernel lets a process copy from another, the ring where it
  /// does not (Yama's ptrace_scope of 1 or more, Ubuntu's default).
  automatic,
  /// Cross-memory attach only (process_vm_readv/writev): one copy, by the target. Where the
  /// kernel forbids it, shm is not offered.
  attach,
  /// A ring of shared memory both processes map: two copies (the initiator's in, the target's
  /// out), each on its own process's CPU at once; no proof of the peer process needed.
  ring,
};
[[nodiscard]] const char* to_string(ShmCopy c) noexcept;
/// "auto", "attach", "ring"; throws Error (EINVAL) for anything else.
[[nodiscard]] ShmCopy parse_shm_copy(std::string_view text);

/// Everything an Engine is built from, passed by value.
struct EngineConfig {
  /// This engine's name, as its peers know it (1..64 bytes). Empty: "host:pid".
  std::string name{};
  /// Where peers connect to this engine ("[host]:port"; port 0: any free port, see
  /// Engine::port()). Empty: no listener (this engine only initiates). No host (":port"): every
  /// address, except for an engine without a key (link.psk empty), which then listens on
  /// 127.0.0.1 only: a keyless listener serves whoever reaches it, so it reaches no other host
  /// unless told an address here ("0.0.0.0:7600", "[::]:7600" or an interface's), which is the
  /// opt-in (and logged). EngineInfo::listen says where it listens.
  std::string listen = ":0";
  /// Listen from construction on. A peer that links before a segment is exposed learns of it
  /// when it is, but a transfer it submits before that ends as no_segment: a target that must
  /// offer its segments from the first link sets this false, exposes them, then calls
  /// Engine::start_listening().
  bool listen_at_start = true;
  /// The transports this engine's links may use, best first. A link takes the first in the list
  /// of the engine that opens it that the other engine also lists and can use: rdma where both
  /// have an RDMA device, shm only between processes proven to share the host (the target reads
  /// a secret from the initiator's memory by cross-memory attach), tcp to anyone. Nothing else
  /// is ever used: a peer RDMA cannot reach fails (connect_failed, saying why) unless tcp is
  /// listed. Empty: rdma only, and an engine on a host without an RDMA device is refused at
  /// construction, naming this setting. Every link says which it took and why (peers()).
  std::vector<Transport> transports{};
  /// tcp: data streams per link (1..16); transfers are cut into frames of at most 256 KiB
  /// spread over them.
  std::uint32_t tcp_streams = 2;
  /// shm: how the links this engine opens move their data (as a target it serves either, where
  /// it offers shm: with `attach` on a kernel that forbids it, it offers none). The ring
  /// costs a second copy and a 4 MiB shared mapping per link, and needs no permission to read
  /// another process's memory; docs/engine.md compares them.
  ShmCopy shm_copy = ShmCopy::automatic;
  /// shm: host memory this engine allocates (allocate_memory()) is a sealed memfd its shm peers
  /// map, so that each copy of it is one pass between their mapping and their window, whatever
  /// shm_copy and the kernel's ptrace rules say (engine protocol 8 on both sides). Such a peer
  /// may read and write those buffers at any time until they are unregistered (as one that may
  /// attach may read all of this process); its own windows still bound what reaches its memory.
  /// false: nothing is mapped, every copy goes as shm_copy says. Memory the application
  /// registers (register_memory()) is never mapped.
  bool shm_map = true;
  /// The RDMA devices this engine uses: it registers its memory, makes its protection domains
  /// and completion queues, and links only there (names, as `rdmakit devices` lists them; the
  /// process's device layer still opens every device once, whoever uses it). Empty: every
  /// device. A storage or management NIC left out pins none of the engine's memory: the
  /// locked-memory need is the registered bytes times the devices listed. A peer whose route
  /// goes through a device left out is refused (connect_failed, naming it), not linked through
  /// another. An unknown name is refused at construction, naming those there are; link.device
  /// and rails.devices, when set, must be among them.
  std::vector<std::string> devices{};
  /// Settings of every peer link: device, timeouts, keepalive, queue depths, the pre-shared key
  /// (psk: both ends of a link must hold the same). One QP per link and rail (the engine spreads
  /// over peers and NICs, not over QPs of one port). A link's depth is its send_depth.
  ConnectionConfig link{};
  /// Several NICs: which ports a peer link holds QPs on, slicing, failover.
  RailConfig rails{};
  /// Progress threads (at most 64). Each polls the CQs its links share while work is in flight
  /// and sleeps on the completion channel when idle. Unset: one per RDMA device. 0: the caller
  /// drives progress() (then nothing moves between calls).
  std::optional<std::uint32_t> workers{};
  /// The CPUs the worker threads run on: worker i on worker_cpus[i % size] (pinned, as
  /// `taskset` would, to the NIC's NUMA node say). Empty: wherever the scheduler puts them.
  /// A CPU this process may not run on (its cpuset, taskset) is refused at construction
  /// (Error, EINVAL), and so is a list with workers = 0 (no worker threads to pin).
  std::vector<int> worker_cpus{};
  /// How long Batch::wait() polls on the calling thread before it sleeps (latency against CPU).
  /// While the batch's worker thread is asleep, the waiter polls that worker's completions
  /// itself, so a small transfer costs the wire's round trip and no thread's wake-up. The spin
  /// adapts: up to four times what waits on this engine took of late, within this; none while
  /// they take longer than this (bulk batches: the waiter sleeps at once). 0: wait() sleeps at
  /// once, and the worker thread ends the batch and wakes it. At most 1 s. docs/engine.md
  /// (Threads) says which thread does what.
  std::chrono::microseconds wait_spin{2000};
  /// Each batch records when it was submitted, posted and ended (Batch::telemetry()): a read of
  /// the steady clock at each (tens of nanoseconds per batch). false: its times stay zero.
  bool telemetry = true;
  /// Most QPs this engine holds at once (links it initiated and links peers opened to it). When
  /// a new link would pass it, an idle link is closed (an eviction, which its peer's next
  /// transfer undoes by reconnecting): first a link this engine opened with nothing in flight or
  /// queued, the least recently used; else a link a peer opened that the peer has reported no
  /// transfers on for idle_after. With no idle link, the new link waits (up to 5 s, within its
  /// handshake) and is then refused as busy: a live link is never broken to make room.
  /// A link holds one QP, and over rdma_cm (link.method) two: its control channel is a QP too.
  std::uint32_t max_qps = 1024;
  /// How long a link a peer opened must have carried no transfers, as the peer reports (the
  /// accepting side sees no one-sided transfer: the side that opened a link says it is active
  /// every quarter of this while it moves data), before it may be evicted. At least 100 ms.
  std::chrono::milliseconds idle_after{2000};
  /// Notifications each peer link may have waiting in this engine for next_notification() at
  /// once (1..65536). The sender knows how many it may send (credits, returned as they are
  /// taken): one more is not sent, and its batch says so (Batch::notifications_failed), rather
  /// than queued without bound or dropped in silence.
  std::uint32_t notification_queue = 1024;
  /// Where a device has no type-2 memory windows (per-peer keys): false, expose() refuses, naming
  /// the device. true: segments are served with the buffer's own key to every peer that holds
  /// the link key (link.psk, required): access is then per buffer (a peer reaches the whole
  /// buffer with the buffer's access, whatever the segment says), and withdraw() and
  /// remove_peer() revoke nothing until the buffer is registered again. info().access_model and
  /// the log say so. rxe, mlx5 and most current NICs have type-2 windows.
  bool allow_region_keys = false;
  /// This engine's identity (none by default). With one, every link proves it: the engine's
  /// IDENT carries its public key and signs the link's session (its binding, both sides' roles,
  /// its name and epoch), so a peer that expects this engine's key (add_peer's public_key, the
  /// store's record, or pinned on first use) gets a link only from the holder of the secret.
  /// Requires link.psk (the signature binds the keyed session). Whether it has one or not, an
  /// engine checks every identity its peers prove: docs/security.md, "Engine identities".
  Identity identity{};
  /// Who may link to this engine: engine names ("kv-client-3"), public keys ("ed25519:..."), or
  /// both ("kv-client-3=ed25519:...": that name, proven by that key only). A link whose peer
  /// matches none is refused at its IDENT, before it is offered anything, and its peer's
  /// transfers end connect_failed with the reason. Empty: any member of the cluster key
  /// (link.psk; anyone without one). A bare name is only as good as what vouches for it: with
  /// identities the name is its key's, without it is what a key holder says.
  std::vector<std::string> allowed_peers{};
  /// A link's control messages (segments, notifications, credits, activity) wait in an outbox
  /// of its own while the peer does not read them, and its worker goes on serving every other
  /// link. When the outbox has taken nothing for this long (the peer is stopped, hung or
  /// swamped), or holds more than 16 MiB, the link is broken with that reason. At least 100 ms.
  std::chrono::milliseconds control_timeout{10'000};
  /// Where peers are found: "p2p" (the default; add_peer with host:port), or a Redis or etcd
  /// store in which the engine publishes itself (name, epoch, endpoints, rails, segments; never
  /// keys or addresses) under a lease, finds peers by name, and learns of their restarts and
  /// ends (docs/engine.md, "Metadata").
  MetadataConfig metadata{};
  /// Called on a worker thread once a lease this engine granted has ended and none of its
  /// windows works any more (as next_lease_end() would return it): it must not block, nor call
  /// the engine's waiting calls.
  std::function<void(const LeaseEnd&)> on_lease_end{};
};

/// A buffer registered with the engine: once per device, whatever the number of peers.
/// A handle; the engine owns the registration. Valid until unregister_memory(); after it, the
/// handle is refused (`invalid`) even once its id is given to another buffer.
struct Buffer {
  std::uint32_t id = 0;  ///< 0: none
  void* addr = nullptr;
  std::size_t length = 0;
  /// Tells this registration from another that reuses its id, and from another engine's
  /// handles (random per engine): a handle whose generation does not match is `invalid`.
  std::uint32_t generation = 0;
};

/// A peer's named segment, as this engine refers to it in transfers. Made by
/// Engine::segment(), without waiting for anything: the peer is connected (and the name
/// checked) when the first transfer needs it. Refused (`invalid`) once the peer is removed,
/// and in any other engine.
struct RemoteSegment {
  std::uint32_t peer = 0;  ///< 0: none
  std::uint32_t slot = 0;
  std::uint32_t generation = 0;  ///< the peer's, as Buffer::generation
};

enum class TransferOp : std::uint8_t {
  read,          ///< the segment's bytes into the local range
  write,         ///< the local range into the segment
  fetch_add,     ///< 8-byte atomic on an 8-byte aligned remote word; the old value to local
  compare_swap,  ///< 8-byte atomic compare-and-swap; the old value to local
};
[[nodiscard]] const char* to_string(TransferOp op) noexcept;

/// One transfer between a local buffer range and a range of a peer's segment.
struct Transfer {
  TransferOp op = TransferOp::write;
  Buffer local{};
  std::uint64_t local_offset = 0;
  std::uint64_t length = 0;  ///< atomics: 8
  RemoteSegment remote{};
  std::uint64_t remote_offset = 0;
  std::uint64_t compare_add = 0;  ///< fetch_add: the addend; compare_swap: the expected value
  std::uint64_t swap = 0;         ///< compare_swap: the value to store
};

/// How a transfer ended.
enum class TransferStatus : std::uint8_t {
  pending,
  ok,
  invalid,        ///< refused at submit (bounds, unknown buffer or peer, alignment); nothing moved
  no_segment,     ///< the peer has no such segment, or the range is outside it, or its access
                  ///< does not allow the operation
  connect_failed, ///< the peer could not be reached (the reason says why), or the metadata
                  ///< store says it is gone (the reason names the peer and the store)
  peer_lost,      ///< the link broke while the transfer was in flight (the peer died, closed,
                  ///< restarted, or was removed)
  failed,         ///< an error completion (remote access error, retries exceeded, ...)
  cancelled,      ///< Batch::cancel() ended it before any of it was posted: nothing of it moved
  lease_expired,  ///< the lease that gave access to the peer's range has ended (the reason says
                  ///< which and why): refused before posting (nothing moved), or by the peer's
                  ///< NIC or worker after its window went (nothing of that request moved; of a
                  ///< transfer cut into parts, parts before it may have; the link breaks on it)
};
[[nodiscard]] const char* to_string(TransferStatus status) noexcept;

struct TransferResult {
  TransferStatus status = TransferStatus::pending;
  std::string reason{};  ///< why, for every status but pending and ok
};

/// A message delivered to this engine: by a batch (SubmitOptions::notify), after all of that
/// batch's transfers with this engine completed (its writes are visible in this engine's
/// memory, its reads have taken their bytes: the memory they read may be reused); or by
/// Engine::notify, on its own.
struct Notification {
  std::string peer{};  ///< the sending engine's name
  std::vector<std::uint8_t> message{};
  std::string request_id{};  ///< the sender's SubmitOptions::request_id (empty: none)
};

/// What a batch moved over one path (BatchTelemetry::paths): a local RDMA device (the rail its
/// transfers took there), or a transport without one.
struct PathTelemetry {
  std::string transport{};  ///< "rdma", "tcp" or "shm"
  std::string device{};     ///< the local device ("mlx5_0"), or the transport's name for tcp and shm
  std::uint64_t bytes = 0;  ///< of its reads and writes that ended ok on this path
  /// Its transfers (atomics included) that ended ok here; a transfer sliced over several rails
  /// counts once on each path its slices took.
  std::uint32_t transfers = 0;
};

/// When a batch's stages happened and what it moved (Batch::telemetry()), for tying transfers
/// to requests (NIXL's transfer telemetry, per batch). The times cost a clock read at submit,
/// one per worker holding transfers of it, and one at its end (EngineConfig::telemetry); the
/// rest is counted when read. Readable in its on_done callback.
struct BatchTelemetry {
  std::string request_id{};  ///< SubmitOptions::request_id
  std::chrono::steady_clock::time_point submitted{};  ///< submit() was called
  /// The engine had posted its transfers (those waiting for a link: queued for it); the
  /// latest of its workers' (a batch on several). Zero until then.
  std::chrono::steady_clock::time_point posted{};
  std::chrono::steady_clock::time_point ended{};  ///< its last transfer ended (zero until then)
  std::uint64_t bytes = 0;     ///< moved by its reads and writes that ended ok
  std::uint32_t transfers = 0; ///< its transfers (descriptors; 0 for Engine::notify's)
  std::uint32_t failed = 0;    ///< of them, ended other than ok (when done())
  /// Per path (rail or transport) the transfers that ended ok took, busiest first: which NICs
  /// a request's bytes went through, and whether a rail failed over (its transfers re-posted
  /// on another: they count where they ended). Costs a store per transfer as it ends.
  std::vector<PathTelemetry> paths{};
  /// Time from submit() to posted, and to the end (0 until then).
  [[nodiscard]] std::chrono::nanoseconds post_time() const noexcept;
  [[nodiscard]] std::chrono::nanoseconds total_time() const noexcept;
};

/// A range of a registered buffer: one entry of a local descriptor list (Engine::prepare_local).
struct LocalDescriptor {
  Buffer buffer{};
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

/// A range of a peer's segment: one entry of a remote descriptor list (Engine::prepare_remote).
struct RemoteDescriptor {
  RemoteSegment segment{};
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

namespace detail {
struct [[gnu::visibility("hidden")]] BatchState;
struct [[gnu::visibility("hidden")]] PlanState;
struct [[gnu::visibility("hidden")]] ListState;
}

/// The transfers of one submit(), in flight or done. Move-only. Destroying it does not cancel
/// anything: the transfers run to their end, and the local buffers must stay registered (the
/// engine alive) until then.
///
/// Threads: done(), wait() and the result calls may be made from any thread, concurrently.
class Batch {
 public:
  Batch() = default;
  Batch(Batch&&) noexcept;
  Batch& operator=(Batch&&) noexcept;
  ~Batch();

  /// Every transfer has ended (O(1)).
  [[nodiscard]] bool done() const noexcept;
  /// Waits until every transfer has ended and the on_done callback (if any) has returned, or
  /// until `timeout`; true when it has. Polls on the calling thread first (for up to
  /// EngineConfig::wait_spin, running the batch's worker while that worker's thread sleeps),
  /// then sleeps.
  bool wait(std::chrono::milliseconds timeout) const;
  [[nodiscard]] std::size_t size() const noexcept;
  /// Transfers that ended in a status other than ok (when done()).
  [[nodiscard]] std::size_t failed() const noexcept;
  /// Peers whose notification (SubmitOptions::notify) was not sent although their writes
  /// completed (when done()): the peer's queue of notifications from this engine was full (it
  /// has not taken them: EngineConfig::notification_queue), or no link to it was up.
  /// describe_failures() says which and why.
  [[nodiscard]] std::size_t notifications_failed() const noexcept;
  /// The result of transfer `i` (pending until it ends).
  [[nodiscard]] TransferResult result(std::size_t i) const;
  /// Every failed transfer's index, status and reason, one line each, and every notification
  /// not sent; empty when all succeeded.
  [[nodiscard]] std::string describe_failures() const;
  /// How far it got, in one line, for a wait() that timed out: how many of its transfers ended
  /// (how many of those failed), the paths (rails, transports) those that ended ok took, and
  /// which have not ended, e.g. "16379 of 16384 ended (0 failed; ended ok on path: rxe0 8190,
  /// rxe1 8189), 5 had not: transfers 16379-16383". A stall of the last few transfers on one
  /// rail then reads differently from a batch that never started. A transfer sliced over rails
  /// counts on each path its slices took, so the paths may add up to more than the ended.
  [[nodiscard]] std::string describe_progress() const;
  /// Its timings and size so far (BatchTelemetry).
  [[nodiscard]] BatchTelemetry telemetry() const;
  /// Ends every transfer of it not yet posted (waiting for a link to connect, or queued behind
  /// others for room on the send queue) as `cancelled`; those already posted run to their end
  /// (and are not posted again on another rail if theirs fails), as does a transfer cut into
  /// slices over rails. Returns once every worker holding transfers of it has done so (within
  /// 5 s; with workers == 0, at the next progress(); from a callback, without waiting);
  /// result(i) says which ended how. A peer with a cancelled transfer gets no notification.
  /// Once done(), its local buffers may be unregistered at once. Idempotent; a no-op on a batch
  /// that is done.
  void cancel() const;

 private:
  friend class Engine;
  friend struct detail::BatchState;
  [[gnu::visibility("hidden")]] explicit Batch(std::shared_ptr<detail::BatchState> state) noexcept;
  std::shared_ptr<detail::BatchState> state_;
};

/// Transfers checked and resolved once (Engine::prepare), to submit many times: the same ranges,
/// the bytes in them as they are at each submit, as NIXL's prepared transfer requests or MPI's
/// persistent requests. What each submit of a plan re-checks is what may have changed since:
/// the buffer still registered, the peer still there, its segment as it is now (exposed again
/// after a restart, withdrawn); a transfer that no longer fits ends in its batch as it would
/// from submit(span). Copyable (a shared handle); empty when default-built.
///
/// Threads: a plan may be submitted from any number of threads at once, and again while batches
/// of it are in flight.
class TransferPlan {
 public:
  TransferPlan() = default;
  [[nodiscard]] std::size_t size() const noexcept;
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }

 private:
  friend class Engine;
  [[gnu::visibility("hidden")]] explicit TransferPlan(std::shared_ptr<detail::PlanState> state) noexcept;
  std::shared_ptr<detail::PlanState> state_;
};

/// Descriptors prepared once (Engine::prepare_local, Engine::prepare_remote), whose selections
/// are transferred by index (Engine::submit(op, local, indices, remote, indices)): NIXL's
/// prepared descriptor lists, e.g. a KV cache's blocks per layer on each side. Copyable (a shared
/// handle); empty when default-built.
///
/// Threads: a list may be used by any number of threads at once.
class DescriptorList {
 public:
  DescriptorList() = default;
  [[nodiscard]] std::size_t size() const noexcept;
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }
  /// Its descriptors are ranges of peers' segments (prepare_remote), not of local buffers.
  [[nodiscard]] bool remote() const noexcept;

 private:
  friend class Engine;
  [[gnu::visibility("hidden")]] explicit DescriptorList(std::shared_ptr<detail::ListState> state) noexcept;
  std::shared_ptr<detail::ListState> state_;
};

/// Options of one submit().
struct SubmitOptions {
  /// Sent to every peer the batch reads from or writes to, once that peer's transfers in the
  /// batch have all completed successfully (so written data is in its memory when the message
  /// arrives, and the memory read may be reused: the pull mode's "done with your blocks"); at
  /// most Engine::max_notification bytes. Empty: none.
  std::vector<std::uint8_t> notify{};
  /// Called once when the batch is done, on the thread that ends it: a worker thread, or one
  /// running a worker while that worker's thread sleeps (inside submit() or Batch::wait(), of
  /// this batch or another; or progress()). Keep it short, do not wait on batches in it, and do
  /// not take in it a lock held around submit(), wait() or cancel().
  std::function<void(const Batch&)> on_done{};
  /// Carried in its notifications (Notification::request_id) and telemetry (Batch::telemetry):
  /// the application's request this batch serves. At most Engine::max_request_id bytes.
  std::string request_id{};
};

/// Counters, readable at any time.
struct EngineCounters {
  std::uint64_t qps = 0;           ///< QPs now (over rdma_cm with each link's control QP)
  std::uint64_t peers = 0;         ///< peers added
  std::uint64_t links = 0;         ///< links up now (initiated and accepted)
  std::uint64_t connects = 0;      ///< links this engine initiated, in all
  std::uint64_t reconnects = 0;    ///< of those, to a peer it had been connected to before
  std::uint64_t accepts = 0;       ///< links peers opened to this engine
  std::uint64_t evictions = 0;     ///< idle links closed to stay within max_qps
  std::uint64_t restarts = 0;      ///< peers seen again with a new epoch
  std::uint64_t batches = 0;       ///< submitted
  std::uint64_t transfers = 0;     ///< submitted
  std::uint64_t transfers_failed = 0;
  std::uint64_t bytes = 0;         ///< moved by successful reads and writes
  std::uint64_t notifications_sent = 0;
  std::uint64_t notifications_received = 0;
  /// Notifications not sent: the peer's queue was full, or no link to it was up (each batch's
  /// notifications_failed() says which).
  std::uint64_t notifications_refused = 0;
  /// Notifications a peer sent beyond the credits this engine gave it (a peer that does not
  /// keep the protocol): not queued.
  std::uint64_t notifications_dropped = 0;
  /// Notifications counted in notifications_sent that never left this engine: their link broke
  /// while they waited in its outbox (the peer stopped reading; EngineConfig::control_timeout).
  std::uint64_t notifications_lost = 0;
  std::uint64_t windows_bound = 0; ///< memory windows bound (one per peer link per segment)
  /// Time the binds of windows_bound took, from posting to completion, in nanoseconds, summed:
  /// what giving one more peer access to a segment costs (it does not grow with the peers).
  std::uint64_t window_bind_ns = 0;
  std::uint64_t rail_links = 0;    ///< links opened on a peer's further rails, in all
  std::uint64_t rail_failures = 0; ///< rails that went down (error completion, port down, QP fatal)
  std::uint64_t slices = 0;        ///< slices that sliced transfers were cut into
  /// Reads and writes (or their slices) re-posted on another rail after theirs failed.
  std::uint64_t reposted = 0;
  /// Transfers of plans (submit(plan)) posted as their requests were built; the rest of a plan's
  /// took the way of submit(span) (a full queue, a link or segment not there yet).
  std::uint64_t plan_posted = 0;
  /// Times a run of a plan had its requests built for a link: once per link, and again when the
  /// peer's segment changed under it.
  std::uint64_t plan_builds = 0;
  /// Transfers of descriptor lists (submit(op, lists, indices)) posted from the lists as
  /// prepared; the rest took the way of submit(span) (a full queue, a link or segment not there
  /// yet, a pair of different lengths, a buffer of the list unregistered, lists over several peers).
  std::uint64_t lists_posted = 0;
  /// Times a remote list's targets were checked for a link and operation: once per link, and
  /// again when the peer's segment changed under it.
  std::uint64_t lists_builds = 0;
  /// Bytes of reads and writes over shm links (ended ok) that the peer copied in one pass from or
  /// into this engine's memory, which it maps: buffers from allocate_memory() on an engine that
  /// offers shm, on links of engine protocol 8 (docs/engine.md, "Transports"). Other memory goes
  /// by cross-memory attach or the ring.
  std::uint64_t shm_mapped_bytes = 0;
  /// Batches started on the submitting thread, their worker's thread being asleep (no hand-off
  /// to it): the latency path (EngineConfig::wait_spin).
  std::uint64_t submits_inline = 0;
  /// Batch::wait() calls that saw their batch end while they polled (no sleep, no wake-up).
  std::uint64_t waits_spun = 0;
  std::uint64_t leases_granted = 0;  ///< by this engine (grant)
  std::uint64_t leases_ended = 0;    ///< of those, ended (whatever the cause)
  std::uint64_t lease_renewals = 0;  ///< renewals this engine granted its holders
};

/// What Engine::metrics() writes.
struct MetricsOptions {
  /// Peers given a series of their own (peer="NAME"), the busiest by bytes; the rest are summed
  /// in the series without a peer label, so a scrape stays bounded however many peers there are.
  std::size_t top_peers = 64;
};

/// Whether the engine can serve (Engine::health(), a MetricsServer's /health).
struct EngineHealth {
  bool ok = false;
  std::string reason{};  ///< why not, one line (empty when ok)
};

/// What the engine is built on.
struct EngineInfo {
  std::string name{};
  std::uint64_t epoch = 0;  ///< new at every start; peers recognise a restart by it
  std::uint16_t port = 0;   ///< 0: no listener
  /// Where it listens ("host:port", EngineConfig::listen as it took effect; empty: nowhere), and
  /// why when that is loopback only (a keyless engine given no address).
  std::string listen{};
  std::string listen_note{};
  std::vector<std::string> devices{};
  /// The transports it offers, best first ("rdma", "tcp", "shm"), and one line on each listed
  /// one it cannot offer (no RDMA device).
  std::vector<std::string> transports{};
  std::string transports_note{};
  /// Peers get access through type-2 memory windows bound on their own link's QP (a key is
  /// useless on any other QP, and revoked per peer); false: the device has none, and expose()
  /// refuses unless EngineConfig::allow_region_keys (then peers holding the link key get the
  /// region's own key).
  bool memory_windows = false;
  std::string access_model{};  ///< one line saying which, and why
  /// Identity::public_key() of EngineConfig::identity (empty: none).
  std::string public_key{};
  /// This engine's ports that can carry rails, one line each: device, port, address, subnet, and
  /// where a peer bootstraps a rail on it (or why it cannot: the listener is bound elsewhere).
  std::vector<std::string> rails{};
  /// The metadata store's state in one line: published or not, under which lease, how many
  /// engines known, the last failure.
  std::string metadata{};
};

/// One rail of a peer link: a local port and the peer's port it reaches.
struct RailInfo {
  std::string local;   ///< "rxe1 port 1 (198.18.1.2, 198.18.1.0/24)"
  std::string peer;    ///< the peer's port it reaches (empty for an unused one)
  std::string state;   ///< "up", "connecting", "down" (failed: probed again), "unused"
  std::string reason;  ///< why it is down or unused
  std::uint64_t bytes = 0;     ///< moved by reads and writes that completed on it
  std::uint64_t slices = 0;    ///< slices that completed on it
  std::uint64_t failures = 0;  ///< times it went down
  std::uint64_t reposted = 0;  ///< transfers or slices of it re-posted on another rail
};

/// A device as a buffer's transfers rank it (Engine::locality()): a peer's rails on devices of
/// the best rank among those up carry the transfers; the others are used while none of those is.
struct DeviceRank {
  std::string device;
  int rank = 0;        ///< 0 first
  int numa_node = -1;  ///< the device's; -1: none or unknown
  std::string why;     ///< "on NUMA node 0, the buffer's", ...
};

/// How one RDMA device reaches a buffer's memory (Engine::registration()).
struct BufferPath {
  std::string device;
  RegistrationPath path = RegistrationPath::host_mr;
  std::string detail;  ///< what was tried before this path, and why it did not work
};

/// A peer as this engine sees it (Engine::peers()).
struct PeerInfo {
  std::string name{};
  std::string address{};
  /// The worker that serves it: with one worker per device (the default), the worker of the
  /// device its address is reached through, so its link's completions stay on one thread.
  std::uint32_t worker = 0;
  std::string device{};  ///< the local device of its link (empty until it was first linked)
  bool linked = false;   ///< a link to it is up now
  /// Its last link's transport ("rdma", "tcp", "shm"; empty until linked), and why that one
  /// (the first both engines list and can use, or which were passed over and why).
  std::string transport{};
  std::string transport_reason{};
  /// The bootstrap wire version its last link speaks: wire::kVersion, or wire::kPreviousVersion
  /// with an engine of the previous rdmakit (docs/compatibility.md); 0 until linked.
  std::uint16_t wire_version = 0;
  /// Its rails: the first is the port its address is reached through; then every other local
  /// port, used or not (with the reason). Learnt from the peer when the link first came up.
  std::vector<RailInfo> rails{};
  /// The key its links must prove (Identity::public_key() text), and where it came from:
  /// "given" (add_peer), "info" (add_peer with its local_info()), "store" (its record),
  /// "pinned" (the first link that proved one), or empty with no key (its links prove none: the cluster key is all that vouches for them).
  std::string public_key{};
  std::string key_source{};
};

/// Many peers, memory registered once, batched asynchronous transfers from any number of
/// threads (see docs/engine.md).
///
/// Threads: every member function may be called from any thread, concurrently, except that
/// with workers == 0, progress() and connect() (which then drives progress itself) are called
/// from one thread at a time, and the destructor must not race with anything else.
class Engine {
 public:
  explicit Engine(EngineConfig config);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  /// Closes every link (what is in flight ends: completed or flushed) and stops the workers.
  /// Handshakes in progress (connects to a peer that is down or silent, clients of its
  /// listener) end at once, their transfers `connect_failed` saying the engine is shutting
  /// down; it does not wait out their handshake deadline.
  ~Engine();

  [[nodiscard]] EngineInfo info() const;
  [[nodiscard]] EngineCounters counters() const noexcept;
  /// The engine's figures in Prometheus's text exposition format (docs/observability.md lists
  /// them): counters, per-path and per-peer bytes (the top_peers busiest named), rails,
  /// notifications, leases, refused handshakes, registered memory, the metadata store, and the
  /// batches' latency histogram (with EngineConfig::telemetry). Takes no lock the data path
  /// takes; costs O(peers). A batch's bytes are in the engine-wide figures when it ends, in the
  /// per-peer and per-path ones once its worker's completion poll ends (a moment later).
  [[nodiscard]] std::string metrics(const MetricsOptions& options = {}) const;
  /// Ok when the engine listens (unless EngineConfig::listen is empty: with listen_at_start
  /// false, not until start_listening()) and its metadata store, if any, holds its record and
  /// answered its last call; else why not.
  [[nodiscard]] EngineHealth health() const;
  /// The listener's port (0: none, or not listening yet).
  [[nodiscard]] std::uint16_t port() const noexcept;
  /// Starts the listener (EngineConfig::listen_at_start false); idempotent. Throws Error when it
  /// cannot listen.
  void start_listening();

  /// Registers caller-owned memory once on each device (it must outlive the engine). Host
  /// memory (pinned CUDA host memory too) by its address. GPU memory (a CUDA device pointer, a
  /// framework's tensor) from one dma-buf export of it on each device that takes dma-buf MRs
  /// (no nvidia-peermem needed), by its device pointer on the others (nvidia-peermem); its
  /// transfers then rank the NICs by their PCI distance to that GPU. registration() says which
  /// path each device took. Throws Error naming each refusal.
  Buffer register_memory(void* addr, std::size_t length);
  /// Registers [offset, offset + length) of another driver's dma-buf (an accelerator's memory)
  /// on each device: by ibv_reg_dmabuf_mr where every device takes it; else through one host
  /// bounce buffer that every device registers, which stage_in()/stage_out() fill from and
  /// copy back to the dma-buf (the exporter must allow mmap). The engine keeps its own dup of
  /// `fd`. Throws Error naming the device that refused and why.
  Buffer register_dmabuf(int fd, std::uint64_t offset, std::size_t length);
  /// Bounce path (registration() says "bounce"): copies [offset, offset + length) of the
  /// buffer's memory into what the NICs reach, before transfers send it or peers read it
  /// (length 0: to the end). A no-op on every other path. Not concurrent with transfers of
  /// that range. Throws Error for a bad range or an unknown buffer.
  void stage_in(const Buffer& buffer, std::uint64_t offset = 0, std::uint64_t length = 0);
  /// Bounce path: copies [offset, offset + length) back to the buffer's memory, after reads or
  /// peers' writes into it have completed. A no-op on every other path.
  void stage_out(const Buffer& buffer, std::uint64_t offset = 0, std::uint64_t length = 0);
  /// How each RDMA device reaches the buffer (in device order; empty without RDMA devices).
  [[nodiscard]] std::vector<BufferPath> registration(const Buffer& buffer) const;
  /// Allocates memory of spec.kind, owned by the engine, and registers it on every device (by
  /// its address: host memory, huge pages, CUDA host memory, GPU memory where nvidia-peermem
  /// lets it be registered so). With several devices, memory that only a dma-buf or a bounce
  /// buffer reaches is refused (Error, ENOTSUP) rather than shared by one device.
  Buffer allocate_memory(std::size_t length, const MemorySpec& spec = {});
  /// Deregisters a buffer on every device, so its memory may be freed: transfers submitted with
  /// it from now on end as `invalid`; this waits until those already in flight have ended (each
  /// ends within its link's failure bounds) and throws Error (ETIMEDOUT) if they have not within
  /// `timeout` (the buffer then stays registered and refuses new transfers: call again). Throws
  /// Error (EBUSY) while a segment exposes it (withdraw it first). Its id is reused by a later
  /// registration, never this handle (Buffer::generation): memory stays flat however many
  /// buffers come and go.
  void unregister_memory(const Buffer& buffer, std::chrono::milliseconds timeout = std::chrono::seconds{30});
  /// How `buffer`'s transfers rank the devices: by the NUMA node of its pages against each
  /// NIC's. Throws Error for an unknown buffer.
  [[nodiscard]] std::vector<DeviceRank> locality(const Buffer& buffer) const;
  /// Makes [offset, offset + length) of `buffer` a segment called `name` (1..64 bytes) that
  /// peers may access as `access` allows (remote_read, remote_write, remote_atomic). Peers
  /// already linked are told at once; nothing is frozen at the handshake. Throws Error for a
  /// name in use or a bad range.
  void expose(std::string name, const Buffer& buffer, Access access, std::uint64_t offset = 0,
              std::uint64_t length = 0);
  /// The same, for `peers` only (entries as in EngineConfig::allowed_peers): no other peer ever
  /// gets a window on it, and their transfers to it end no_segment. Empty: every peer.
  void expose(std::string name, const Buffer& buffer, Access access, std::vector<std::string> peers,
              std::uint64_t offset = 0, std::uint64_t length = 0);
  /// Withdraws a segment: every peer's key for it stops working (its window is invalidated),
  /// and linked peers are told. Returns once every worker has invalidated its windows (within
  /// 5 s; with workers == 0, at the next progress(); called from a callback, without waiting).
  void withdraw(const std::string& name);
  /// Revokes `peer` (an engine name, a public key, or NAME=KEY), whether it was added or not:
  /// its windows on every segment are invalidated at once (what it has in flight to them fails),
  /// the links it opened to this engine close, and its next links are refused, with a reason
  /// its transfers carry (connect_failed), until allow(peer). Links this engine opened to it
  /// (add_peer) stay: remove_peer() ends those. Throws Error for an entry that is not a peer.
  void revoke(const std::string& peer);
  /// Undoes revoke(peer); with EngineConfig::allowed_peers set, also lets `peer` link from now
  /// on. Throws Error for an entry that is not a peer.
  void allow(const std::string& peer);

  /// Leases (docs/engine.md, "Leases"). Makes [offset, offset + length) of `buffer` a segment
  /// called `name` that no peer has standing access to: a peer reaches ranges of it only
  /// through the leases grant() gives it, and only while they last.
  void expose_leased(std::string name, const Buffer& buffer, Access access, std::uint64_t offset = 0,
                     std::uint64_t length = 0);
  /// Grants `peer` (an entry as in EngineConfig::allowed_peers) `access` to `ranges` of this
  /// engine's segments for `ttl` (1 ms .. 1 hour): a memory window per range on every link the
  /// peer has opened here, and on those it opens while the lease lasts, announced to it with the
  /// lease's id, which this returns (adjacent or overlapping ranges of a segment are merged into
  /// one window, and the holder sees them merged). The lease ends when its time passes without a renewal, its
  /// holder releases it, end_lease() ends it, the last link that holds its windows closes and
  /// none comes back within 3 s (the holder died, or was revoked or removed), or a segment it covers is withdrawn; then its windows are invalidated, and only after that is this engine told
  /// (next_lease_end, EngineConfig::on_lease_end). With workers == 0, leases end and renewals
  /// are answered only while the application drives progress(). Throws Error (EINVAL) naming the
  /// range for an unknown segment, one not exposed with expose_leased() (its standing windows
  /// would outlive the lease), a range outside it, or access the segment does not allow;
  /// (EBUSY) for one that would give `peer` more than 4,096 leases or 262,144 ranges at once;
  /// (ENOTSUP) where the device has no memory windows (EngineInfo::memory_windows).
  std::uint64_t grant(const std::string& peer, std::span<const LeaseRange> ranges, Access access,
                      std::chrono::milliseconds ttl);
  /// Ends a lease this engine granted (LeaseCause::revoked); false if it had ended already. It
  /// returns at once: next_lease_end() says when its windows are gone.
  bool end_lease(std::uint64_t lease);
  /// The next lease this engine granted that ended, if any (the event descriptor fd() is
  /// signalled for each).
  std::optional<LeaseEnd> next_lease_end();
  /// Lease `lease` that `peer` (an added peer's name) granted this engine, once its windows are
  /// known here on every ready link to the peer (each rail: a transfer finds them whichever rail
  /// takes it), waiting up to `wait` for them, and opening a link if there is none, as connect()
  /// does: nullopt if it is not known by then. An ended lease is returned ended, with why, for a while (the last 256).
  [[nodiscard]] std::optional<HeldLease> lease(const std::string& peer, std::uint64_t lease,
                                               std::chrono::milliseconds wait = std::chrono::milliseconds{0});
  /// Asks `peer` to extend the lease it granted to `ttl` from now (at most the ttl it was granted
  /// with), on the link's control channel: it returns at once, and lease() says the new end once
  /// the peer's answer arrived. Renew well before the end (a third of the ttl is what the tests
  /// use). Throws Error for an unknown peer.
  void renew(const std::string& peer, std::uint64_t lease, std::chrono::milliseconds ttl);
  /// Gives the lease back: this engine's transfers on it end lease_expired from now on, and the
  /// peer ends it (LeaseCause::released). Throws Error for an unknown peer.
  void release(const std::string& peer, std::uint64_t lease);

  /// Adds a peer by name and bootstrap address ("host:port"); nothing is connected until a
  /// transfer needs it. `name` is the name the engine there runs under (its EngineConfig::name):
  /// a link is used only when the engine that answers says that name (and, on further rails,
  /// the first link's epoch); another engine at the address ends the transfers waiting for the
  /// link as connect_failed, naming both. `public_key` (Identity::public_key() text): only the
  /// holder of its secret is linked as this peer. Without it, the key the peer's first link
  /// proves (if any) is pinned: every later link and rail must prove the same one (remove_peer
  /// and add_peer again to accept another). A link that proves another key, or none where one
  /// is expected, is never used: its transfers end connect_failed naming both keys. Throws Error
  /// for a name in use, or a public key that is not one.
  void add_peer(std::string name, std::string address, std::string public_key = {});
  /// Adds a peer found by name in the metadata store (its first published endpoint, followed
  /// when it restarts elsewhere). Throws Error naming the store when it has no such engine or
  /// does not answer within MetadataConfig::call_timeout, or when the engine has no store.
  void add_peer(std::string name);
  /// What a peer needs to link to this engine, as bytes for a channel the application already
  /// has (a serving system's ZMQ, HTTP or RPC side channel): the record the engine would publish
  /// in a metadata store (versioned JSON, docs/compatibility.md), that is its name, epoch, public
  /// key, endpoints, transports, rails and segments. Never a memory key or address: those travel
  /// only in a link's authenticated handshake. Throws Error when the engine does not listen (yet):
  /// no peer could link to it.
  [[nodiscard]] std::vector<std::uint8_t> local_info() const;
  /// Adds the engine whose local_info() `info` is, under `name` (the name it says it runs under;
  /// another is refused, naming both), at the first endpoint it lists and bound to the public key
  /// it names: its links must prove that key, as with add_peer's `public_key` (and with none named,
  /// the first key a link proves is pinned). The bytes are as trustworthy as the channel that
  /// carried them: an engine with a pre-shared key still links only with holders of the key,
  /// whoever sent the info. Throws Error (EPROTO, naming what is wrong) for bytes that are not an
  /// engine's info of this or the previous version, and as add_peer does.
  void add_peer(std::string name, std::span<const std::uint8_t> info);
  /// Removes a peer: its links close (what is in flight fails as peer_lost), and its access to
  /// this engine's segments is revoked.
  void remove_peer(const std::string& name);
  /// Every peer added, in the order added.
  [[nodiscard]] std::vector<PeerInfo> peers() const;
  /// Every other engine of the cluster in the metadata store, as of the engine's last listing
  /// (every MetadataConfig::poll); empty without a store.
  [[nodiscard]] std::vector<PublishedEngine> directory() const;
  /// A handle for `segment` of `peer`. With a metadata store, a peer not added yet is added
  /// from it (add_peer(name)); without, an unknown peer is an Error.
  [[nodiscard]] RemoteSegment segment(const std::string& peer, const std::string& segment);
  /// Connects to `peer` now (instead of at its first transfer) and waits until its segments are
  /// known; false with `why` on failure or timeout. An unknown peer is found as segment() finds
  /// it. With workers == 0 it drives progress itself (Batch::wait does not: call progress()
  /// until Batch::done()).
  bool connect(const std::string& peer, std::chrono::milliseconds timeout, std::string* why = nullptr);

  /// Starts the transfers; never blocks on the network. Transfers that are invalid at once
  /// (unknown handles, ranges outside the local buffer) end as `invalid` in the returned batch.
  Batch submit(std::span<const Transfer> transfers, SubmitOptions options = {});
  /// Checks `transfers` against this engine's buffers and peers and keeps them, resolved, for
  /// submit(plan). Throws Error (EINVAL, naming the transfer and why) for a transfer that could
  /// never move: an unknown or unregistered buffer, a range outside it, an unknown or removed
  /// peer, an atomic of other than 8 bytes, 0 bytes. The peers' segments are checked when the
  /// plan is first submitted to them (they may not be connected yet).
  [[nodiscard]] TransferPlan prepare(std::span<const Transfer> transfers);
  /// Starts the plan's transfers, as submit(span) would start the same transfers; with the
  /// checks and the work requests already done, a transfer costs a fraction of what it does
  /// there. A plan of another engine is an Error.
  Batch submit(const TransferPlan& plan, SubmitOptions options = {});
  /// Checks each descriptor's range against its buffer once (Error, EINVAL, naming the
  /// descriptor: an unknown or unregistered buffer, a range outside it, 0 bytes).
  [[nodiscard]] DescriptorList prepare_local(std::span<const LocalDescriptor> descriptors);
  /// Checks each descriptor's peer once (Error, EINVAL, naming the descriptor: an unknown or
  /// removed peer, a handle no segment() made, 0 bytes); the range against the segment is checked
  /// by each transfer (the peer may not be connected yet, and may expose it again).
  [[nodiscard]] DescriptorList prepare_remote(std::span<const RemoteDescriptor> descriptors);
  /// One transfer per position k: local[local_indices[k]] and remote[remote_indices[k]] (of the
  /// same length), read (the remote range into the local one) or write, in one batch, as
  /// submit(span) would start them. Checks here only the indices; a pair of different lengths
  /// ends that position `invalid` (naming the position and both descriptors), and what may have
  /// changed since the lists were prepared (a buffer unregistered, a peer removed, its segment
  /// withdrawn or shorter) ends that transfer in the batch as submit(span) would. Throws Error
  /// (EINVAL) naming the position and the index for an index out of range, index spans of
  /// different sizes, an atomic operation, or lists of another engine or of the wrong side.
  Batch submit(TransferOp op, const DescriptorList& local, std::span<const std::uint32_t> local_indices,
               const DescriptorList& remote, std::span<const std::uint32_t> remote_indices,
               SubmitOptions options = {});
  static constexpr std::size_t max_notification = 900;
  static constexpr std::size_t max_request_id = 64;
  /// Sends `message` (at most max_notification bytes) to `peer` on its own, connecting first if
  /// needed: a batch of one entry that ends ok once the message is on its way to the peer, or
  /// with why not (connect_failed, peer_lost, or failed: the peer's queue of notifications from
  /// this engine is full). It waits for no transfer: to announce data moved, give the batch
  /// that moves it SubmitOptions::notify. `options`: request_id and on_done as for submit()
  /// (its notify stays empty). Throws Error for an unknown peer (one in the metadata store is
  /// added as segment() adds it), a message or id too long, or options.notify set.
  Batch notify(const std::string& peer, std::span<const std::uint8_t> message, SubmitOptions options = {});

  /// The next notification received, if any.
  std::optional<Notification> next_notification();
  /// A descriptor that becomes readable when a batch completes or a notification arrives (for
  /// epoll or an event loop). Reading it (8 bytes) re-arms it; check batches and notifications
  /// after every wake-up. It is signalled from the first call of fd() on (an engine whose
  /// descriptor nobody takes saves a system call per batch): take it, then check what it
  /// announces, then wait on it.
  [[nodiscard]] int fd() const noexcept;

  /// workers == 0: does the work a worker would (post, poll, links' control channels) for up to
  /// `budget`, returning early when nothing is in flight. Returns the transfers that ended.
  std::size_t progress(std::chrono::milliseconds budget = std::chrono::milliseconds{0});

  struct [[gnu::visibility("hidden")]] Impl;  // not exported: only the library sees it

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace rdmakit
#pragma GCC visibility pop
