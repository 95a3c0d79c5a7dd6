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
#include <utility>
#include <vector>

#include "rdmakit/device.hpp"
#include "rdmakit/memory.hpp"
#include "rdmakit/wire.hpp"

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit {

/// One record of what a connection did, for debugging (ConnectionConfig::trace, RDMAKIT_TRACE):
/// each handshake step, each QP transition with every attribute and where its value came from on
/// either side, each error completion, the close.
struct TraceEvent {
  /// "hello_sent", "hello_received", "qp_transition", "connected", "handshake_failed",
  /// "handshake_rejected" (a listener's), "error_completion", "peer_lost", "closed"
  std::string event;
  std::vector<std::pair<std::string, std::string>> fields;  ///< in a fixed order per event
  /// One line: `qp_transition qp=0x11 transition=INIT->RTR path_mtu="1024 (local ...)" ...`
  [[nodiscard]] std::string text() const;
  /// One JSON object: {"event":"qp_transition","qp":"0x11",...}
  [[nodiscard]] std::string json() const;
};

/// A tracer (ConnectionConfig::trace) that writes each event to standard error as one line:
/// `rdmakit trace: <text>`, or the JSON object when `json`. RDMAKIT_TRACE uses the same.
[[nodiscard]] std::function<void(const TraceEvent&)> trace_to_stderr(bool json);

/// How a connection is set up. Either way the same versioned, validated exchange of parameters
/// and regions runs, with the same pre-shared-key authentication and sealed session, on a
/// control channel that stays open for the connection's life (BYE, messages, keepalive).
enum class ConnectMethod : std::uint8_t {
  /// rdmakit's own bootstrap over TCP (the peer's TCP port): works wherever TCP does; the
  /// device, port and GID follow the IP route the TCP connection took.
  tcp,
  /// The RDMA connection manager (librdmacm; the peer's rdma_cm port, a port space of its
  /// own): the kernel resolves the address and route (ARP and the routing table on RoCE, path
  /// records on InfiniBand) to a device, port and source GID, and the control channel is a
  /// small QP of its own connected by the CM. What rping, UCX's sockaddr endpoints and
  /// perftest -R use; routed RoCE v2 and IB without IPoIB-reachable TCP need it.
  rdma_cm,
};
[[nodiscard]] const char* to_string(ConnectMethod m) noexcept;
/// "tcp", or "rdma_cm" (also "cm"); throws Error for anything else.
[[nodiscard]] ConnectMethod parse_connect_method(std::string_view text);

/// Everything a connection is built from, passed by value. The defaults detect a dead peer within
/// about 4 s (500 ms ACK timeout x 7 tries) and never wait forever.
struct ConnectionConfig {
  /// TCP bootstrap or rdma_cm. Both sides must use the same (a listener serves one).
  ConnectMethod method = ConnectMethod::tcp;
  /// RDMA device; empty: the route's (choose_device: a port with a GID of the bootstrap
  /// socket's local address, else the RDMA device of the netdev holding it, IPoIB included,
  /// else the first device with an ACTIVE port). ConnectionInfo::device_reason says which.
  std::string device;
  /// Device port; 0: the one the route named, else the device's first ACTIVE port.
  std::uint8_t port = 0;
  GidSelector gid;          ///< source GID; default: by priority (RoCE v2 IPv4 first)
  /// The GRH traffic class of every packet (RoCE v2: the IP header's TOS byte, DSCP << 2 | ECN).
  /// 0: the device's default. A lossless RoCE fabric puts RDMA in its own class: with the
  /// common ConnectX setup (trust dscp, PFC on priority 3) DSCP 26, traffic_class 106 (26 << 2
  /// | ECT(0)); docs/hardware.md. Both sides should use the same.
  std::uint8_t traffic_class = 0;
  /// The service level (0..15): on InfiniBand the SL the subnet manager maps to a virtual lane;
  /// on RoCE the driver maps it to the 802.1p priority of VLAN-tagged frames.
  std::uint8_t service_level = 0;
  /// The port's P_Key table index (InfiniBand partitions); 0: the default partition.
  std::uint16_t pkey_index = 0;
  /// Bound on the whole handshake (TCP connect, parameter exchange, QP transitions).
  std::chrono::milliseconds handshake_timeout{10'000};
  /// Keep retrying a refused TCP connect, or a listener's "busy", until handshake_timeout (a
  /// server started at the same moment may not be listening yet). Off: either fails at once.
  bool retry_refused = false;
  /// Time to wait for an ACK before retransmitting (rounded up to the IB encoding, 4.096 us x
  /// 2^t: 500 ms is 536.9 ms). 0 is refused (it means forever). With retry_count, it bounds how
  /// long a dead peer takes to be declared lost: at least ack_timeout x (retry_count + 1), ~3.8 s
  /// by default, about the 4 s the keepalive takes (a NIC may run its timer longer, and raises
  /// values below its own ACK delay: docs/hardware.md). An incast fabric (many senders to one port)
  /// that drops or pauses for longer needs more: a larger ack_timeout, never a larger
  /// retry_count alone (7 at most).
  std::chrono::milliseconds ack_timeout{500};
  std::uint8_t retry_count = 6;  ///< retransmissions before RETRY_EXC_ERR (0..7)
  /// How long a sender backs off when this side has no receive posted (RNR NAK timer).
  std::chrono::microseconds rnr_timer{1280};
  std::uint8_t rnr_retry = 6;     ///< RNR retries before RNR_RETRY_EXC_ERR; 7 (forever) is refused
  /// Block in wait() on a completion channel (epoll-style, no CPU spent while idle) instead of
  /// busy polling the CQ (lowest latency, one core spinning).
  bool completion_events = false;
  std::uint32_t send_depth = 64;  ///< send queue entries per QP (outstanding sends, writes, reads)
  std::uint32_t recv_depth = 64;  ///< receive queue entries
  std::uint32_t max_sge = 4;       ///< scatter-gather entries per work request
  /// Inline payload bytes to ask the QP for; the device may grant less (ConnectionInfo says).
  std::uint32_t max_inline = 64;
  /// QPs per connection (1..16). With several, WRITEs and READs are spread over them round
  /// robin, and one of at least `stripe_min` bytes is striped across all of them (each QP moves
  /// one contiguous part; the caller gets one completion). SEND/RECV, WRITE_WITH_IMM and atomics
  /// stay on the first QP, in order. Requests on different QPs are not ordered with each other:
  /// wait for WRITEs' completions before telling the peer (by SEND or WRITE_WITH_IMM) that the
  /// data is there. A client chooses the count; a listener creates as many as each client asks
  /// for, and its own value is not used.
  std::uint32_t qps = 1;
  /// Smallest WRITE or READ striped across all QPs when qps > 1.
  std::uint64_t stripe_min = 512 * 1024;
  /// Where setup diagnostics go (rejected handshakes on a listener, close problems).
  /// Default: standard error.
  std::function<void(std::string_view)> log;
  /// Pre-shared key for the authenticated bootstrap (at least 16 bytes; see read_key_file). When
  /// set, both sides prove they know it (mutual HMAC-SHA256 challenge-response over fresh nonces)
  /// before any QPN, GID, address or rkey is sent; a peer without it, or with another, is refused
  /// and learns nothing. Every later control-channel message (HELLO, READY, BYE, application
  /// messages) travels sealed (XChaCha20-Poly1305) under per-direction keys derived from the key
  /// and both nonces: a relay or a reader of the bootstrap traffic learns no address or rkey and
  /// can inject nothing. The connection or listener keeps its own copy, wiped when it goes (the
  /// caller's is the caller's to wipe). Empty: no authentication, and a listener says once that
  /// anyone who can reach its port gets the memory it advertises.
  std::vector<std::uint8_t> psk;
  /// Keepalive on the control channel, so that a peer host that dies without a word (power
  /// loss, a partition, a paused VM) is noticed on an idle connection too: once nothing has come
  /// from the peer's host for `keepalive_interval`, a probe goes out every interval, and when
  /// none is answered for `keepalive_timeout` the peer is lost (wait() reports peer_lost). The
  /// probes are TCP keepalives, answered by the peer's kernel: they need no thread and no call
  /// into rdmakit on either side, and a peer application that is merely busy is never taken for
  /// dead. Whole seconds (rounded up); 0 turns keepalive off. Over rdma_cm the probe is a
  /// zero-length SEND on the control QP, sent from wait() (or the engine's worker) and answered
  /// by the peer's NIC; an unanswered one fails after the QP's retries (ack_timeout x
  /// (retry_count + 1)), which then stand for keepalive_timeout.
  std::chrono::milliseconds keepalive_interval{1000};
  std::chrono::milliseconds keepalive_timeout{3000};
  /// Receives a TraceEvent for every handshake step, QP transition, error completion and close
  /// (never for a successful completion: the data path stays untouched). Unset, the environment
  /// decides: RDMAKIT_TRACE=1 writes text lines to standard error, RDMAKIT_TRACE=json JSON lines.
  /// Called on the thread that runs the handshake (a listener's handshake threads, concurrently)
  /// or uses the connection.
  std::function<void(const TraceEvent&)> trace;
};

/// A Listener's settings: those of every connection it accepts, and its own limits.
struct ListenerConfig {
  /// Implicit, so a ConnectionConfig can be passed where a ListenerConfig is expected.
  ListenerConfig(ConnectionConfig c = {}) : connection(std::move(c)) {}  // NOLINT
  /// Each accepted connection's settings (its QP count is the client's choice, not `qps`).
  ConnectionConfig connection;
  /// Handshakes in progress at once (all peers / one peer); more are refused at once ("busy",
  /// which a client with retry_refused retries until its deadline), so a flood of connects
  /// cannot exhaust threads, QPs or memory.
  std::uint32_t max_handshakes = 128;
  std::uint32_t max_handshakes_per_peer = 32;
  /// Established connections from one peer (0: no limit).
  std::uint32_t max_connections_per_peer = 64;
  /// What counts as one peer for the limits above: an IPv4 address, or an IPv6 prefix of this
  /// many bits (a host usually holds a whole /64 and could otherwise dodge the limits by
  /// switching addresses; 128: each address alone).
  std::uint32_t ipv6_peer_prefix = 64;
  /// Bytes that the Setup callbacks of handshakes in progress may register in all: beyond it a
  /// handshake is refused as "busy", so a flood of HELLOs (on a listener without a key, anyone
  /// may send one) cannot pin memory without bound. A connection's memory stops counting once
  /// accept() could hand it out. 0: no limit.
  std::uint64_t max_handshake_memory = std::uint64_t{1} << 30;
  /// Connections whose handshake succeeded and that accept() has not taken yet, counted
  /// together with the handshakes in progress (which would join them): beyond this, new clients
  /// are refused as "busy". Each holds QPs, CQs and memory, so an application that stops
  /// calling accept() cannot make the listener pile them up.
  std::uint32_t max_pending = 128;
};

/// What a work request was.
enum class Opcode : std::uint8_t {
  send,
  write,
  write_with_imm,
  read,
  recv,
  fetch_add,     ///< 8-byte atomic fetch-and-add on an 8-byte aligned remote word
  compare_swap,  ///< 8-byte atomic compare-and-swap on an 8-byte aligned remote word
};
[[nodiscard]] const char* to_string(Opcode op) noexcept;

/// One work completion, copied out of the CQ. A failed operation is a completion with a status,
/// not an exception.
struct Completion {
  std::uint64_t wr_id = 0;
  Opcode opcode = Opcode::send;  ///< from the posted work request (valid for errors too)
  int status = 0;                ///< ibv_wc_status; 0 is success
  std::uint32_t vendor_err = 0;
  std::uint32_t byte_len = 0;    ///< bytes received (recv); 0 for the send queue's completions
  bool has_imm = false;
  std::uint32_t imm = 0;         ///< host byte order

  [[nodiscard]] bool ok() const noexcept { return status == 0; }
  /// ibv_wc_status_str of the status.
  [[nodiscard]] const char* status_name() const noexcept;
  /// Status, vendor error, wr_id, opcode and the likely cause, in one line.
  [[nodiscard]] std::string describe() const;
};

/// Why a post was refused. Posts never throw; a refused post (or batch) posted nothing.
enum class PostStatus : std::uint8_t {
  ok,
  not_ready,      ///< the QP is not in RTS: not connected yet, broken, or closed
  out_of_bounds,  ///< the range is outside the remote region
  no_access,      ///< the remote region does not allow this operation
  too_large,      ///< longer than the port's max message size (a SEND, or a request in a batch;
                  ///< single WRITEs and READs are split instead), more requests or parts than
                  ///< the queue holds at all (a batch, a split request), or a receive buffer
                  ///< over 4 GiB
  queue_full,     ///< not enough free entries in the queue for the whole batch
  too_many_sges,  ///< more scatter-gather entries than the QP was created with
  misaligned,     ///< an atomic's remote address is not 8-byte aligned
  bad_length,     ///< an atomic's local buffer is not exactly 8 bytes
  unsupported,    ///< the device cannot do this (e.g. no atomics)
  failed,         ///< ibv_post_* returned an error (see sys_errno)
  /// the remote descriptor is not (inside) a region the peer advertised on this connection:
  /// a wrong rkey or address, or a descriptor from another connection
  not_advertised,
  /// a prepared request that was released, or prepared before the peer's regions changed
  stale,
};
struct PostResult {
  PostStatus status = PostStatus::ok;
  int sys_errno = 0;
  std::size_t index = 0;  ///< in a batch, the work request that was refused
  [[nodiscard]] bool ok() const noexcept { return status == PostStatus::ok; }
  [[nodiscard]] std::string describe() const;
};

/// One send-queue work request, for post_batch().
struct WorkRequest {
  Opcode opcode = Opcode::write;
  /// Scatter-gather list (at most max_sge entries). For atomics: one 8-byte slice that receives
  /// the remote word's previous value. Payloads up to max_inline bytes are sent inline (on rxe
  /// a prepared or single WRITE's go by their SGE: its extended interface loses inline data).
  /// Either way the memory is the request's until its completion.
  std::span<const LocalSlice> local;
  RemoteRegion remote;              ///< target of write, read and atomics
  std::uint64_t remote_offset = 0;  ///< into `remote`
  std::uint32_t imm = 0;            ///< write_with_imm's immediate (host byte order)
  std::uint64_t compare_add = 0;    ///< fetch_add: the addend; compare_swap: the expected value
  std::uint64_t swap = 0;           ///< compare_swap: the value to store
  std::uint64_t wr_id = 0;
  /// false: no completion is delivered unless the request fails (selective signaling). Its
  /// queue entry is reclaimed when a later signaled completion is polled: a caller that limits
  /// its own requests in flight to N must signal at least once every N requests. The library
  /// itself signals at least every send_depth / 2 requests, so the queue never fills with
  /// entries nothing could reclaim; poll() (or wait()) retires them.
  bool signaled = true;
};

/// A work request checked once and posted any number of times: see Connection::prepare. A
/// handle (copyable); refused as PostStatus::stale once released.
struct PreparedRequest {
  std::uint32_t index = ~0u;
  std::uint32_t generation = 0;
};

enum class WaitStatus : std::uint8_t {
  completed,  ///< `completion` holds the next completion (which may itself be an error)
  timeout,    ///< nothing completed before the deadline
  /// The peer is gone (its process died, or it closed): reported once. Completions already on
  /// their way are given 100 ms to arrive, then the QPs are moved to the error state, so every
  /// request still outstanding completes, flushed; later waits deliver those completions, then
  /// report `closed`.
  peer_lost,
  /// The device reported an error that breaks the connection (its port went down, a QP, CQ or
  /// the device failed): reported once, with Connection::failure() saying what; outstanding
  /// requests are flushed as for peer_lost.
  device_error,
  /// The connection is closed or broken and nothing is outstanding any more. An error completion
  /// on any QP also breaks the whole connection (every QP is moved to the error state, so the
  /// rest are flushed, and later posts return not_ready): that completion is the report, and
  /// failure() says the same; then `closed`.
  closed,
};
struct WaitResult {
  WaitStatus status = WaitStatus::timeout;
  Completion completion;  ///< valid when status == completed (and may itself be an error)
};

/// What the handshake settled, for printing and diagnosis.
struct ConnectionInfo {
  std::string device;
  std::string device_reason;  ///< which rule chose it (choose_device), or that it was named
  std::uint8_t port = 0;
  LinkLayer link_layer = LinkLayer::ethernet;
  GidEntry local_gid;
  std::string gid_reason;  ///< why this GID was chosen
  /// The fabric settings its QPs were given (ConnectionConfig's; docs/hardware.md), and the
  /// ACK timeout as the IB encoding rounds it.
  std::uint8_t traffic_class = 0;
  std::uint8_t service_level = 0;
  std::uint16_t pkey_index = 0;
  std::chrono::microseconds ack_timeout{0};
  std::uint8_t retry_count = 0;
  std::uint32_t path_mtu = 0;
  std::uint32_t local_mtu = 0, remote_mtu = 0;
  std::uint32_t max_msg_size = 0;
  std::uint32_t max_inline = 0;   ///< inline bytes the QP actually has
  std::uint32_t max_sge = 0;
  std::uint32_t send_depth = 0;   ///< per QP
  std::uint32_t recv_depth = 0;
  std::uint32_t qps = 1;          ///< QPs the connection stripes over
  bool atomics = false;           ///< both devices support remote atomics
  std::string peer_address;  ///< the bootstrap peer, "host:port"
  ConnectMethod method = ConnectMethod::tcp;  ///< how the connection was set up
  /// How it moves data: "rdma" (always, for a Connection), or for an engine's link "tcp" or
  /// "shm" (docs/engine.md, "Transports"), and why that one.
  std::string transport = "rdma";
  std::string transport_reason;
  /// The bootstrap wire version the connection speaks: wire::kVersion, or wire::kPreviousVersion
  /// with a peer of the previous rdmakit (docs/compatibility.md).
  std::uint16_t wire_version = wire::kVersion;
  wire::EndpointInfo local;
  wire::EndpointInfo remote;
};

/// One reliable-connected RDMA connection to one peer, with its TCP control channel.
/// Move-only. Destroying it closes it: outstanding work completes (or is flushed) first, then
/// the QPs are destroyed, then the memory regions deregistered and their memory freed, then the
/// CQs, PD and device context released: no QP is left that could reach freed memory.
///
/// Threads: a Connection is used by one thread at a time (any thread, one after another, with
/// the hand-over synchronised by the caller); its calls are not safe to make concurrently. The
/// Setup callback, ConnectionConfig::log and ConnectionConfig::trace run on the thread that runs
/// the handshake: for a Listener, its handshake threads, several at once, so what they touch
/// must be thread-safe.
class Connection {
 public:
  /// Called during the handshake, after the QP exists and before parameters are exchanged:
  /// register memory, advertise() what the peer may access, post receives.
  using Setup = std::function<void(Connection&)>;

  /// Connects to a listener at "host:port" ("[v6addr]:port" for IPv6): its TCP port, or with
  /// ConnectionConfig::method rdma_cm, its rdma_cm port. Throws Error on failure, including the
  /// peer's reason when it rejected us.
  static Connection connect(const std::string& host_port, const ConnectionConfig& config,
                            const Setup& setup = {});

  Connection(Connection&&) noexcept;
  Connection& operator=(Connection&&) noexcept;
  ~Connection();

  /// Registers caller-owned memory in this connection's protection domain. The memory must
  /// outlive the connection. Throws Error (with RLIMIT_MEMLOCK advice where that is the cause).
  const MemoryRegion& register_memory(void* addr, std::size_t length, Access access);
  /// Allocates page-aligned, zeroed memory owned by the connection and registers it.
  const MemoryRegion& allocate_memory(std::size_t length, Access access);
  /// Allocates memory of `spec.kind` (host, huge pages, CUDA, a dma-buf) owned by the connection
  /// and registers it by the best path the device allows (MemoryRegion::path says which, and
  /// path_detail why the better ones failed), falling back to a bounce buffer rather than
  /// failing. Throws Error when the memory cannot be had at all (check_memory says why early).
  const MemoryRegion& allocate_memory(std::size_t length, Access access, const MemorySpec& spec);
  /// The regions registered or allocated through this connection, in that order.
  [[nodiscard]] const MemoryRegion& memory(std::size_t index) const;
  [[nodiscard]] std::size_t memory_count() const noexcept;
  /// Offers a region to the peer (only from Setup, before the parameters are exchanged).
  void advertise(const MemoryRegion& region);
  /// Deregisters `region` now: the peer's rkey for it stops working at once (a later access is
  /// its REM_ACCESS_ERR) and this side can no longer post with it; the memory stays readable.
  /// close() revokes every region of the connection once its work has completed or been flushed.
  void revoke(const MemoryRegion& region) noexcept;

  /// The regions the peer advertised to us.
  [[nodiscard]] const std::vector<RemoteRegion>& remote_regions() const noexcept;
  [[nodiscard]] const ConnectionInfo& info() const noexcept;

  /// RDMA WRITE of `src` to `dst` at `offset`. WRITEs and READs longer than the port's max
  /// message size are split into several requests (and with several QPs, those of at least
  /// stripe_min bytes are striped across them); either way the caller gets one completion, with
  /// `wr_id`, carrying the first error of any part.
  PostResult post_write(const LocalSlice& src, const RemoteRegion& dst, std::uint64_t offset,
                        std::uint64_t wr_id) noexcept;
  PostResult post_write_with_imm(const LocalSlice& src, const RemoteRegion& dst,
                                 std::uint64_t offset, std::uint32_t imm,
                                 std::uint64_t wr_id) noexcept;
  PostResult post_read(const LocalSlice& dst, const RemoteRegion& src, std::uint64_t offset,
                       std::uint64_t wr_id) noexcept;
  PostResult post_send(const LocalSlice& src, std::uint64_t wr_id) noexcept;
  /// Writes `old_value` (8 bytes, local write access) with the remote word, then adds `add`.
  PostResult post_fetch_add(const LocalSlice& old_value, const RemoteRegion& dst,
                            std::uint64_t offset, std::uint64_t add, std::uint64_t wr_id) noexcept;
  /// Writes `old_value` with the remote word, and stores `swap` if it equalled `compare`.
  PostResult post_compare_swap(const LocalSlice& old_value, const RemoteRegion& dst,
                               std::uint64_t offset, std::uint64_t compare, std::uint64_t swap,
                               std::uint64_t wr_id) noexcept;
  /// Posts the whole batch as one chained ibv_post_send, or nothing: every request is checked
  /// (state, bounds, access, SGE count, alignment, queue room) before anything is posted.
  PostResult post_batch(std::span<const WorkRequest> batch) noexcept;
  /// Checks `request` once, as post_batch() checks a request (state, bounds, the advertised
  /// region and its access, local write access, SGE count, size, alignment), and keeps its
  /// work request built; post(prepared, wr_id) then posts it checking only what can change:
  /// the connection's state and the queue's room. For a request posted again and again with
  /// the same buffers (a message-rate loop, a ring of fixed slots), like MPI's persistent
  /// requests or a benchmark's prebuilt work request. The local slices' data is read when each
  /// post happens, not now. A WRITE or READ long enough to be segmented cannot be prepared
  /// (post it with post_write/post_read). Throws Error (step "prepare") with the reason when
  /// the request would be refused; the connection keeps the request until release() or its
  /// end.
  PreparedRequest prepare(const WorkRequest& request);
  /// Posts a prepared request with `wr_id` (its completion carries it; `request.signaled` and
  /// the opcode are the prepared ones; the prepared wr_id is not used).
  PostResult post(PreparedRequest request, std::uint64_t wr_id) noexcept;
  /// Forgets a prepared request: its handle, and every copy of it, is refused from now on.
  /// Requests already posted with it complete as usual.
  void release(PreparedRequest request) noexcept;
  /// Allowed from Setup too, so a receive is ready before the peer can send.
  PostResult post_recv(const LocalSlice& dst, std::uint64_t wr_id) noexcept;
  /// Posts one receive per slice, chained, with wr_ids first_wr_id, first_wr_id + 1, ...
  PostResult post_recvs(std::span<const LocalSlice> dsts, std::uint64_t first_wr_id) noexcept;

  /// Sends a small application message (at most max_message_size bytes) on the control channel.
  /// Throws Error if the peer is gone or the deadline passes.
  void send_message(std::span<const std::uint8_t> payload, std::chrono::milliseconds timeout);
  /// The next application message from the peer, or nullopt on timeout or when the peer is gone.
  std::optional<std::vector<std::uint8_t>> receive_message(std::chrono::milliseconds timeout);
  static constexpr std::size_t max_message_size = 1000;

  /// Copies up to out.size() completions (send and receive side) into `out`; returns how many.
  std::size_t poll(std::span<Completion> out) noexcept;
  /// Waits for the next completion until `timeout`, busy polling or, with completion_events,
  /// sleeping on the completion channel. About once a millisecond it also looks at the control
  /// channel and the device's async events: a lost peer or a broken port is reported once
  /// (peer_lost, device_error) and flushes what is outstanding (see WaitStatus).
  WaitResult wait(std::chrono::milliseconds timeout) noexcept;
  /// Work requests posted and not yet completed.
  [[nodiscard]] std::uint32_t outstanding() const noexcept;
  /// Why the connection broke (peer lost, port down, QP fatal, ...), or empty while it is fine.
  [[nodiscard]] const std::string& failure() const noexcept;

  /// Whether the peer has said BYE or its control channel closed.
  [[nodiscard]] bool peer_closed() noexcept;
  /// Waits until the peer says BYE or disconnects; false on timeout.
  bool wait_peer_close(std::chrono::milliseconds timeout) noexcept;
  /// Orderly close: lets the sends, WRITEs and READs in flight finish within `timeout` (the
  /// peer's QP still answers), then tells the peer (BYE), flushes what remains (receives, and
  /// anything that did not finish), destroys the QPs and deregisters every memory region (their
  /// rkeys die with the connection; the memory stays readable until the Connection is
  /// destroyed). Completions that arrive meanwhile are not delivered. Idempotent; the
  /// destructor does it with 2 s.
  void close(std::chrono::milliseconds timeout = std::chrono::milliseconds{2000}) noexcept;

  struct [[gnu::visibility("hidden")]] Impl;  // not exported: only the library sees it

 private:
  [[gnu::visibility("hidden")]] explicit Connection(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> impl_;
};

/// Reads a pre-shared key file (ConnectionConfig::psk). The format is raw bytes: the file's
/// bytes, all of them, are the key (nothing is trimmed, so a binary key reads back exactly as
/// given programmatically). Throws Error when it cannot be read, is a symbolic link, is not a
/// regular file, belongs to another user, can be read or written by others (mode and owner are
/// checked on the open file), or holds fewer than 16 or more than 4096 bytes.
[[nodiscard]] std::vector<std::uint8_t> read_key_file(const std::string& path);

/// Writes a fresh 32-byte random key to a new file `path` with mode 0600 (`rdmakit keygen`).
/// Never overwrites: throws Error if the file exists, or cannot be written.
void generate_key_file(const std::string& path);

/// Accepts connections on a TCP port, or with config.connection.method rdma_cm, on an rdma_cm
/// port (the same limits, deadlines and refusals either way). Each client's handshake runs on its own thread with its
/// own deadline, so a stalled or malicious client delays nobody; rejected handshakes are logged
/// (config.connection.log) and counted, and the listener keeps serving, also when a thread
/// cannot be started or memory runs out (that client is refused as "busy").
///
/// Threads: accept(), port() and rejected() may be called from any thread, concurrently. The
/// Setup callback runs on the handshake threads, several at once.
class Listener {
 public:
  /// Listens on "[host]:port" (":port" or "port": all addresses, IPv6 and IPv4; port 0: any free
  /// port, see port()). Throws Error if it cannot listen.
  Listener(const std::string& address, ListenerConfig config, Connection::Setup setup = {});
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  /// Stops accepting and ends the handshakes in progress at once (their waits, not their
  /// deadline: a silent client does not hold it), then joins their threads.
  ~Listener();

  [[nodiscard]] std::uint16_t port() const noexcept;
  /// The next connection whose handshake succeeded, or nullopt after `timeout`.
  std::optional<Connection> accept(std::chrono::milliseconds timeout);
  /// Handshakes that failed or were rejected so far.
  [[nodiscard]] std::size_t rejected() const noexcept;
  /// rejected(), by reason.
  struct Refusals {
    std::uint64_t busy = 0;      ///< at a limit of handshakes, waiting or per-host connections
    std::uint64_t auth = 0;      ///< the pre-shared key, a signature or a data stream's token did not check out
    std::uint64_t protocol = 0;  ///< a version, message or transport this side does not speak
    std::uint64_t other = 0;     ///< anything else (the peer went, a device failed, a timeout)
  };
  [[nodiscard]] Refusals refusals() const noexcept;

  struct [[gnu::visibility("hidden")]] Impl;  // not exported: only the library sees it

 private:
  [[gnu::visibility("hidden")]] Listener(std::unique_ptr<Impl> impl, const std::string& address, ListenerConfig config,
           Connection::Setup setup);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rdmakit
#pragma GCC visibility pop
