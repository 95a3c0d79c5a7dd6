// SPDX-License-Identifier: Apache-2.0
#pragma once
// Connection's state, shared by its lifecycle (connection.cpp), control channel (control.cpp),
// housekeeping (events.cpp), the two handshakes (connect.cpp, accept.cpp) and the public
// data-path calls (calls.cpp), which forward to the data path (src/datapath/).

#include <infiniband/verbs.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bootstrap/channel.hpp"
#include "bootstrap/session.hpp"
#include "bootstrap/socket.hpp"
#include "datapath/datapath.hpp"
#include "rdmakit/connection.hpp"
#include "transport/shm/ring.hpp"
#include "transport/soft/qp.hpp"
#include "verbs/device_layer.hpp"
#include "verbs/handles.hpp"
#include "verbs/memory_impl.hpp"
#include "verbs/qp.hpp"

namespace rdmakit::detail {

/// Where setup diagnostics go when ConnectionConfig::log is not set.
void default_log(std::string_view msg);

// How long wait() keeps polling after the peer said BYE or its control channel closed, before it
// flushes what is outstanding. What the peer already did can still be on its way into our CQ:
// rxe acknowledges a SEND before it writes the receiver's completion, so a peer may see its SEND
// complete and say BYE before our receive completion exists, and an immediate flush would turn
// that delivered message into WR_FLUSH_ERR. Orders of magnitude above that lag; far below the
// retry bound a dead peer would otherwise cost.
inline constexpr std::chrono::milliseconds kPeerGoneGrace{100};
// Control messages after the handshake are short; a peer sending more than this unread is
// misbehaving and treated as gone.
inline constexpr std::size_t kControlBuffer = 2048;
static_assert(Connection::max_message_size + wire::kHeaderSize + kSealOverhead <= kControlBuffer,
              "a maximal application message, sealed, must fit the control buffer");

/// Bytes that connections still in their handshake may pin (a Listener's
/// max_handshake_memory), shared by the listener and those connections.
class PinBudget {
 public:
  explicit PinBudget(std::uint64_t limit) : limit_(limit) {}
  /// Takes `n` bytes, or throws Error ("busy: ...") when that would pass the limit.
  void take(std::uint64_t n);
  void give(std::uint64_t n) noexcept;

 private:
  std::mutex mu_;
  std::uint64_t used_ = 0;
  std::uint64_t limit_;
};

/// What a connection is built on when it is one of an engine's peer links: the engine's PD on
/// the device the route chose, and a worker's shared CQs (the data path is routed through them
/// by the worker, which then polls it); for a link of the tcp or shm transport, the engine's
/// software device and a worker's CQ of it instead.
struct Attachment {
  std::shared_ptr<DeviceResources> dev;
  soft::Device* soft_dev = nullptr;
  soft::Cq* soft_cq = nullptr;
  ibv_cq* send_cq = nullptr;
  ibv_cq* recv_cq = nullptr;
  /// What peers may do through the QP: access is then granted per segment by memory windows.
  Access qp_access = Access::none;
  void* owner = nullptr;         // the worker, for the engine to find again
  std::shared_ptr<void> keep;    // keeps the CQs alive while the QPs exist
};

/// Data streams of tcp and shm links that arrived at a listener (STREAM), waiting for the
/// handshake of the link whose token they present. Shared by the engine's listener and its
/// handshakes; thread-safe.
class StreamRegistry {
 public:
  using Token = std::array<std::uint8_t, wire::kTokenSize>;
  /// The server's handshake expects `n` streams presenting `token` (a fresh random one).
  void expect(const Token& token, std::uint32_t n);
  /// A stream arrived (from process `pid`, as a local socket's kernel says; 0 over TCP): taken
  /// (true) when a handshake expects it and has no stream of that index.
  bool deliver(const wire::StreamHello& hello, Fd& fd, int pid);
  /// The streams, in index order, once all `n` came; throws Error at the deadline. Forgets the
  /// token either way. `pid`: the first stream's peer process (0: not a local socket). A
  /// requested `stop` ends it within 100 ms (ECANCELED).
  std::vector<Fd> wait(const Token& token, Deadline deadline, const std::string& peer, int* pid = nullptr,
                       const Stop* stop = nullptr);
  void forget(const Token& token) noexcept;

 private:
  struct Pending {
    std::vector<Fd> fds;
    std::vector<int> pids;
    std::uint32_t got = 0;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Token, Pending> pending_;
};

/// The library's own hooks into a handshake, for the doctor (which explains a failed connection
/// by comparing both sides' parameters), the engine (which builds its links on shared
/// resources) and the library's tests (which forge a peer's values). Not part of the public API.
struct HandshakeHooks {
  /// Sees (and may alter) the peer's decoded parameters before they are checked or used.
  std::function<void(wire::EndpointInfo&)> peer_hello;
  /// Given the device the route chose, what to build the QPs on (instead of a PD and CQs of the
  /// connection's own). May throw (an Error with detail::kBusyReason is a "busy" refusal).
  std::function<Attachment(const std::string& device)> attach;
  /// The devices the route may choose among (an engine's own, EngineConfig::devices); empty:
  /// every device.
  std::vector<std::string> devices;

  // Engine links (docs/engine.md, "Transports"); a plain Connection leaves these empty and is RDMA.
  /// The transports this side offers, best first (a client), or accepts (a server).
  std::vector<wire::LinkTransport> transports;
  /// Why each transport this side does not offer is not (for the server's refusal, the client's log).
  std::string transports_note;
  std::uint8_t tcp_streams = 2;
  /// This process, for shm: where it runs and its pid (shm::this_host()).
  wire::TransportBlock self;
  std::shared_ptr<StreamRegistry> streams;
  /// A server that offers shm: the local socket (abstract namespace) its shm streams connect to,
  /// so the kernel names the client's process (SO_PEERCRED) rather than the client itself.
  std::string shm_socket;
  /// shm, a client: its links' data goes through a shared ring (two copies) instead of the
  /// server's cross-memory attach (one), and why (EngineConfig::shm_copy, Yama's ptrace_scope).
  bool shm_ring = false;
  std::string shm_ring_why;
  /// shm, a server: why this process cannot copy from another by cross-memory attach (empty: it
  /// can). It then takes shm only from a client that sends a ring.
  std::string shm_no_attach;
  /// What a tcp or shm link's queue pair is built on: the engine's device and a worker's CQ.
  std::function<Attachment(wire::LinkTransport)> attach_soft;
  /// The engine protocols this side speaks (engine links): the lowest and the highest. A link
  /// speaks the highest both do (wire.hpp: version 7 carries each side's in its HELLO).
  std::uint8_t engine_protocol_min = 0, engine_protocol_max = 0;
  /// shm links agreeing this engine protocol or a later one copy the memory the engine shares
  /// (soft::Device::share) in one pass, the target mapping it (0: never).
  std::uint8_t shm_shares_from = 0;
  /// Whether this engine shares memory at all (EngineConfig::shm_map): what its links say.
  bool shm_shares = false;
  /// Requested when the engine shuts down: a handshake still waiting (a connect retried, a
  /// silent peer, streams that do not come) ends at once instead of at its deadline.
  std::shared_ptr<const Stop> stop;
};

/// A Listener whose handshakes use `hooks` (the engine's), set before any client can arrive,
/// and that hands each connection to `deliver` on its handshake thread (accept() then finds
/// none). `deliver` must not throw.
std::unique_ptr<Listener> listen_with_hooks(const std::string& address, ListenerConfig config,
                                            HandshakeHooks hooks, std::function<void(Connection)> deliver);

}  // namespace rdmakit::detail

namespace rdmakit {

struct Connection::Impl final : detail::Housekeeping, detail::DeviceSink {
  enum class State { setup, connected, closed };

  ConnectionConfig cfg;  // its psk is moved into `psk` and wiped
  std::shared_ptr<const detail::Secret> psk;  // null without a key; the listener's, on its side
  detail::HandshakeHooks hooks;
  std::shared_ptr<void> admission;  // a listener's per-peer slot, given back on destruction
  // A listener's budget for memory pinned during handshakes, and what this one holds of it.
  std::shared_ptr<detail::PinBudget> budget;
  std::uint64_t budget_held = 0;
  /// An engine link's engine protocol, agreed in the handshake (0: not an engine link).
  std::uint8_t engine_protocol = 0;
  ConnectionInfo info;
  detail::QpTimeouts timeouts;
  detail::QpPath path;  // the fabric settings its QPs get (cfg's traffic class, SL, P_Key index)

  // The verbs objects, in creation order, so destruction (the reverse) releases the QPs first,
  // then the CQs and the channel, then the regions (each deregistered, then its memory freed),
  // and the PD and context last, when the last region lets go of them. close() already destroys
  // the QPs and deregisters the regions, in that order: no QP can reach memory being freed.
  std::shared_ptr<detail::DeviceLayer> layer;  // the process's devices, opened once
  std::shared_ptr<detail::DeviceResources> dev;  // our device, and a PD of our own on it
  detail::Attachment attached;  // an engine link's shared PD and CQs (dev is then the engine's)
  std::deque<MemoryRegion> regions;
  detail::CompChannelPtr channel;  // before the CQs: it must outlive them
  detail::CqPtr send_cq;  // null when attached: the worker's CQs are used
  detail::CqPtr recv_cq;
  std::vector<detail::QpPtr> qps;  // qps[0] carries SEND/RECV, WRITE_WITH_IMM and atomics
  std::unique_ptr<detail::soft::Qp> soft_qp;  // an engine link of the tcp or shm transport (no QPs then)
  std::array<std::uint8_t, 32> shm_proof{};   // shm, a client's: what the server reads here
  detail::DataPath dp;             // posts to and polls the objects above; owns none of them

  // Control channel, and with a key the session every message after the proof travels in.
  std::unique_ptr<detail::Channel> control;
  std::unique_ptr<detail::Session> session;
  State state = State::setup;
  bool bye_received = false;
  bool control_gone = false;
  int control_errno = 0;            // why it went: 0 for EOF, else the socket error
  std::size_t control_partial = 0;  // bytes of an unfinished frame when it went
  detail::Deadline peer_gone_at{};  // when housekeeping first saw BYE or EOF; zero until then
  std::array<std::uint8_t, detail::kControlBuffer> cbuf{};
  std::size_t cfill = 0;
  std::deque<std::vector<std::uint8_t>> messages;  // application messages not yet received
  // Messages queued by queue_control() that the channel has not taken yet (from out_head on):
  // an engine link's worker never waits for a peer to read. The blocking sends send these first.
  std::vector<std::uint8_t> outbox;
  std::size_t out_head = 0;
  detail::Deadline out_moved{};  // when the outbox was last empty, or last took bytes
  std::uint64_t out_queued = 0, out_taken = 0;  // bytes ever queued, and ever taken by the channel
  int send_errno = 0;            // a send failed (errno): nothing more is sent, the outbox dropped
  bool bye_queued = false;       // BYE went into the outbox: close() says nothing more

  // A device event that breaks this connection, left here by whichever thread pumped it
  // (on_device_event) and taken by this connection's own thread (pump_async).
  std::mutex device_mu;
  std::string device_failure;
  std::atomic<bool> device_failed{false};

  explicit Impl(ConnectionConfig c, std::shared_ptr<const detail::Secret> key = {});
  ~Impl() {
    close(std::chrono::milliseconds{2000});
    release_budget();
  }

  /// The implementation behind a Connection (for the library's own code and tests).
  static Impl& of(Connection& c) noexcept { return *c.impl_; }
  static Connection wrap(std::unique_ptr<Impl> impl) noexcept { return Connection(std::move(impl)); }
  /// Connection::connect, with the library's hooks (connect.cpp).
  static Connection connect(const std::string& host_port, const ConnectionConfig& config,
                            const Setup& setup, const detail::HandshakeHooks& hooks);
  /// The listener's side of the handshake on an accepted control channel (accept.cpp).
  /// `admission` is the listener's per-peer slot, held while the connection lives.
  /// Nullopt: the channel was a data stream of a tcp or shm link, handed to that link's handshake.
  static std::optional<Connection> accept(std::unique_ptr<detail::Channel> channel, const std::string& peer,
                                          const ConnectionConfig& config, std::shared_ptr<const detail::Secret> key,
                                          const Setup& setup, std::shared_ptr<void> admission,
                                          std::shared_ptr<detail::PinBudget> budget,
                                          const detail::HandshakeHooks& hooks = {});
  /// accept() for an engine link of the tcp or shm transport, once the client's HELLO chose it.
  static Connection accept_soft(std::unique_ptr<detail::Channel> channel, const std::string& peer,
                                const ConnectionConfig& config, std::shared_ptr<const detail::Secret> key,
                                std::unique_ptr<detail::Session> session, std::shared_ptr<void> admission,
                                std::shared_ptr<detail::PinBudget> budget, const detail::HandshakeHooks& hooks,
                                wire::EndpointInfo remote, wire::LinkTransport kind, const std::string& why,
                                detail::Deadline deadline, std::uint8_t engine_protocol);

  // connection.cpp
  /// Opens the device, builds CQs and QPs (in INIT) and the data path, and fills in our
  /// EndpointInfo. The control channel's own address is on the route the kernel uses to the
  /// peer (and over rdma_cm, its device is the one the CM resolved): the GID (and device) with
  /// that address is chosen unless configured.
  void open(const detail::Channel& control_channel);
  /// Both sides' parameters are known: check they can talk, then INIT -> RTR -> RTS.
  void finish(wire::EndpointInfo remote);
  /// An engine link of the tcp or shm transport (soft.cpp): its queue pair over `streams` on
  /// the engine's software device, and the data path on it. `peer_pid`: shm, the process whose
  /// memory this side copies from and to. Drops RDMA QPs built before the choice was known.
  /// `ring`: shm without cross-memory attach, the client's shared ring (src/transport/shm/).
  /// `give_shares`: the client, its engine's shared memory may go to the server (same user).
  void open_soft(wire::LinkTransport kind, std::vector<detail::Fd> streams, int peer_pid, bool cma,
                 std::shared_ptr<detail::shm::Ring> ring, bool give_shares = false);
  /// The client of an engine link: the transport the server's HELLO names (one this side
  /// offered, else Error), with why it is that one.
  wire::LinkTransport chosen_transport(const wire::EndpointInfo& remote);
  /// The client of a tcp or shm link: opens the data streams the server's HELLO asks for (each
  /// presenting its token), then the link's queue pair on them.
  void open_streams(const detail::HostPort& to, wire::EndpointInfo remote, wire::LinkTransport chosen, detail::Deadline deadline);
  /// Engine links: the server's choice among the transports the client offers (or why none),
  /// by `hooks`.
  [[nodiscard]] static std::optional<wire::LinkTransport> choose_transport(const detail::HandshakeHooks& hooks,
                                                                         const wire::TransportBlock& offer,
                                                                         std::string& why);
  /// Engine links: the engine protocol the link speaks, from the peer's transport block (a
  /// server: the client's highest; a client: the server's answer), or Error naming both sides'.
  [[nodiscard]] static std::uint8_t agree_engine_protocol(const detail::HandshakeHooks& hooks,
                                                          const wire::TransportBlock& theirs, bool server);
  /// shm, the client: what its HELLO says of its proof (shm::prove(), kept in shm_proof).
  void prove_host(wire::TransportBlock& t);
  void connected() noexcept;
  /// Counts `bytes` about to be pinned against the listener's handshake budget (Setup only).
  void charge(std::uint64_t bytes);
  void release_budget() noexcept;
  void close(std::chrono::milliseconds timeout) noexcept;
  void trace_hello(const char* event, const wire::EndpointInfo& e) noexcept;
  void trace_failure(const std::string& step, const std::exception& e) noexcept;
  void log(const std::string& msg) noexcept;

  // control.cpp
  /// Keepalive probes on the control channel (ConnectionConfig::keepalive_*).
  void set_keepalive() const { control->keepalive(cfg.keepalive_interval, cfg.keepalive_timeout); }
  /// One message on the control channel, sealed when there is a session.
  void send_control(wire::MessageType type, std::span<const std::uint8_t> payload, detail::Deadline deadline);
  /// One message into the outbox (framed and sealed now: its place in the queue is its place
  /// in the session's sequence), then flush_control(). Throws only what framing throws.
  void queue_control(wire::MessageType type, std::span<const std::uint8_t> payload);
  /// Gives the channel what it takes of the outbox now, without blocking; true when nothing is
  /// left. A send that fails sets send_errno and drops the outbox (reading goes on: the peer's
  /// last messages and its close still tell why).
  bool flush_control() noexcept;
  [[nodiscard]] std::size_t control_waiting() const noexcept { return outbox.size() - out_head; }
  void pump_control() noexcept;
  /// Reads the control channel until `done()` holds (true) or the deadline passes (false).
  template <typename Done>
  bool await_control(detail::Deadline deadline, Done done) noexcept {
    for (;;) {
      pump_control();
      if (done()) return true;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - detail::Clock::now());
      if (left.count() <= 0) return false;
      detail::wait_readable(control->fd(), std::min(left, std::chrono::milliseconds{100}));
    }
  }
  [[nodiscard]] std::string control_gone_reason() const;

  // events.cpp: the data path's housekeeping, about once a millisecond in wait().
  void tick(detail::Deadline now) noexcept override;
  [[nodiscard]] int wake_fd() const noexcept override { return control ? control->fd() : -1; }
  /// Pumps the device's async events without blocking; breaks the connection on one that
  /// concerns it (port down, QP, CQ or device fatal), whichever thread read it.
  void pump_async() noexcept;
  /// Called on the pumping thread (any thread) for an event of our port, QPs or CQs.
  void on_device_event(const detail::Device& device, const detail::DeviceEvent& e) noexcept override;
};

}  // namespace rdmakit
