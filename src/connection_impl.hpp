#pragma once
// Connection's state, shared by the handshake and lifecycle code (connection.cpp) and the data
// path (datapath.cpp).

#include <infiniband/verbs.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string_view>
#include <memory>
#include <vector>

#include "bootstrap/socket.hpp"
#include "rdmakit/connection.hpp"
#include "verbs/handles.hpp"
#include "verbs/memory_impl.hpp"
#include "verbs/qp.hpp"

namespace rdmakit::detail {

// Work requests in flight on one queue, in post order. Each is posted with a sequence number as
// its verbs wr_id; the user's wr_id, the opcode and whether the user asked for a completion stay
// here. RC completes a queue in order, so the completion of sequence s also retires every
// unsignaled request posted before it, and an error completion (whose opcode field the verbs
// leave undefined) is still reported with its opcode. Sized once, at setup.
class WrRing {
 public:
  struct Slot {
    std::uint64_t wr_id = 0;  // the user's wr_id, or for a part of a segmented request its index
    Opcode op = Opcode::send;
    bool user_signaled = true;  // for a part: whether it is the one its completion counts on
    bool part = false;          // one part of a segmented (striped or split) request
  };

  /// Room for `capacity` requests; the storage is rounded up to a power of two so a slot is a
  /// mask away from its sequence number (no division on the hot path).
  void init(std::uint32_t capacity) {
    capacity_ = capacity;
    std::size_t n = 1;
    while (n < capacity) n *= 2;
    slots_.assign(n, {});
    mask_ = n - 1;
  }
  [[nodiscard]] std::uint32_t count() const noexcept {
    return static_cast<std::uint32_t>(tail_ - head_);
  }
  [[nodiscard]] std::uint32_t free() const noexcept { return capacity_ - count(); }
  [[nodiscard]] std::uint64_t next_seq() const noexcept { return tail_; }
  void push(const Slot& s) noexcept { slots_[tail_++ & mask_] = s; }
  /// Retires everything up to and including `seq`; returns the slot of `seq`. A sequence number
  /// that is not in flight (a bug or a stale completion) retires nothing.
  Slot retire(std::uint64_t seq) noexcept {
    if (seq < head_ || seq >= tail_) [[unlikely]] return {seq, Opcode::send, true, false};
    head_ = seq + 1;
    return slots_[seq & mask_];
  }

 private:
  std::vector<Slot> slots_;
  std::uint64_t mask_ = 0;
  std::uint32_t capacity_ = 0;
  std::uint64_t head_ = 0;
  std::uint64_t tail_ = 0;
};

/// Where setup diagnostics go when ConnectionConfig::log is not set.
void default_log(std::string_view msg);

// A send WR's verbs wr_id is its QP's index in the top byte and the ring sequence number below:
// one shared send CQ serves every QP of a connection.
inline constexpr int kLaneShift = 56;
inline constexpr std::uint64_t kSeqMask = (std::uint64_t{1} << kLaneShift) - 1;

// One QP of a connection and the bookkeeping of its send queue.
struct Lane {
  QpPtr qp;
  WrRing sq;
  std::uint32_t unsignaled_run = 0;  // unsignaled WRs posted since the last signaled one
  std::uint32_t id = 0;              // index in Connection::Impl::lanes
};

// A WRITE or READ posted as several parts (striped across QPs, or split at max_msg_sz): the
// user's completion is delivered once, when the last counted part has completed, with the first
// error any part had.
struct Segmented {
  std::uint64_t wr_id = 0;
  Opcode op = Opcode::write;
  std::uint32_t pending = 0;  // counted parts (one per QP used) not yet completed
  int status = 0;
  std::uint32_t vendor_err = 0;
  bool silent = false;  // only partly posted and already reported as a failed post
};

inline constexpr int kPollBatch = 16;
// How long wait() keeps polling after the peer said BYE or its control channel closed, before it
// flushes what is outstanding. What the peer already did can still be on its way into our CQ:
// rxe acknowledges a SEND before it writes the receiver's completion, so a peer may see its SEND
// complete and say BYE before our receive completion exists, and an immediate flush would turn
// that delivered message into WR_FLUSH_ERR. Orders of magnitude above that lag; far below the
// retry bound a dead peer would otherwise cost.
inline constexpr std::chrono::milliseconds kPeerGoneGrace{100};
// Control messages after the handshake are short; a peer sending more than this unread is
// misbehaving and treated as gone.
inline constexpr std::size_t kControlBuffer = 1024;
static_assert(Connection::max_message_size + wire::kHeaderSize <= kControlBuffer,
              "a maximal application message must fit the control buffer");

}  // namespace rdmakit::detail

namespace rdmakit {

struct Connection::Impl {
  enum class State { setup, connected, closed };

  ConnectionConfig cfg;
  std::shared_ptr<void> admission;  // a listener's per-peer slot, given back on destruction
  ConnectionInfo info;
  detail::QpTimeouts timeouts;
  // Release order is the reverse of this order: regions, QP, CQs, channel, then (when the last
  // region lets go) PD and context.
  std::shared_ptr<detail::DeviceResources> dev;
  detail::CompChannelPtr channel;  // before the CQs: it must outlive them
  detail::CqPtr send_cq;
  detail::CqPtr recv_cq;
  // The QPs. lanes[0] carries SEND/RECV, WRITE_WITH_IMM and atomics, so those stay in order;
  // WRITEs and READs go to any lane. Never resized after open(), so references stay valid.
  std::vector<detail::Lane> lanes;
  std::uint32_t lane_count = 1;  // lanes.size(), kept apart: size() divides, and this is hot
  std::deque<MemoryRegion> regions;

  // Data path. The WR and SGE arrays are allocated once, so posting never allocates.
  detail::WrRing rq;  // lanes[0]'s receive queue
  std::vector<ibv_send_wr> send_wrs;
  ibv_send_wr single_wr{};  // post_one's WR: next and the unused unions stay zero
  std::vector<WorkRequest> part_reqs;  // one lane's parts of a segmented request (send_depth)
  std::vector<LocalSlice> part_slices;
  std::vector<detail::Segmented> segmented;   // qps * send_depth entries
  std::vector<std::uint32_t> free_segmented;  // indexes into `segmented` not in use
  std::vector<ibv_sge> send_sges;
  std::vector<ibv_recv_wr> recv_wrs;
  std::vector<ibv_sge> recv_sges;
  std::uint32_t forced_signal_interval = 1;  // max(1, send_depth / 2), set at open()
  std::uint32_t next_lane = 0;               // round robin for WRITE/READ
  // WRITE/READ of at least this many bytes are segmented: striped when there are several
  // lanes, split at max_msg_sz otherwise. WRITE_WITH_IMM only splits (its immediate must
  // arrive last, which only one QP guarantees).
  std::uint64_t segment_min_spread = 0;
  std::uint64_t segment_min_ordered = 0;

  // Control channel.
  detail::Fd control;
  State state = State::setup;
  bool recv_allowed = false;  // receives may be posted from INIT on
  bool bye_received = false;
  bool control_gone = false;
  // Set once when the connection breaks (peer lost, async device event); the QPs are in ERR
  // from then on. `broken_reported`: wait() has returned peer_lost/device_error for it.
  std::string failure;
  bool device_failed = false;
  bool broken_reported = false;
  detail::Deadline peer_gone_at{};  // when wait() first saw BYE or EOF; zero until then
  std::array<std::uint8_t, detail::kControlBuffer> cbuf{};
  std::size_t cfill = 0;
  std::deque<std::vector<std::uint8_t>> messages;  // application messages not yet received

  explicit Impl(ConnectionConfig c);
  ~Impl() { close(std::chrono::milliseconds{2000}); }

  // connection.cpp
  void open();
  void finish(wire::EndpointInfo remote);
  void pump_control() noexcept;
  /// Reads the control channel until `done()` holds (true) or the deadline passes (false).
  template <typename Done>
  bool await_control(detail::Deadline deadline, Done done) noexcept {
    for (;;) {
      pump_control();
      if (done()) return true;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - detail::Clock::now());
      if (left.count() <= 0) return false;
      detail::wait_readable(control.get(), std::min(left, std::chrono::milliseconds{100}));
    }
  }
  void close(std::chrono::milliseconds timeout) noexcept;
  /// Reads the device's async events without blocking; true if one broke this connection.
  bool pump_async() noexcept;
  /// Records why the connection broke and moves every QP to ERR, so all outstanding work
  /// completes (flushed) now instead of after the retry timeouts.
  void break_connection(std::string why, bool device) noexcept;
  void trace_hello(const char* event, const wire::EndpointInfo& e) noexcept;
  void trace_connected() noexcept;
  void trace_failure(const std::string& step, const std::exception& e) noexcept;
  // Off the hot path: only error completions are traced.
  void trace_error(const Completion& c) noexcept;

  // datapath.cpp
  template <Opcode Op>
  PostResult check(std::span<const LocalSlice> local, const RemoteRegion& remote,
                   std::uint64_t offset, std::uint64_t total) const noexcept;
  PostResult check(Opcode op, std::span<const LocalSlice> local, const RemoteRegion& remote,
                   std::uint64_t offset, std::uint64_t total) const noexcept;
  template <Opcode Op>
  PostResult post_one(const LocalSlice& local, const RemoteRegion& remote, std::uint64_t offset,
                      std::uint32_t imm, std::uint64_t compare_add, std::uint64_t swap,
                      std::uint64_t wr_id) noexcept;
  detail::Lane& pick_lane() noexcept;
  PostResult post_batch(std::span<const WorkRequest> batch) noexcept;
  PostResult post_chain(detail::Lane& lane, std::span<const WorkRequest> batch, bool parts) noexcept;
  PostResult post_segmented(Opcode op, const LocalSlice& local, const RemoteRegion& remote,
                            std::uint64_t offset, std::uint32_t imm, std::uint64_t wr_id) noexcept;
  PostResult post_recvs(std::span<const LocalSlice> dsts, std::uint64_t first_wr_id) noexcept;
  std::size_t poll(std::span<Completion> out) noexcept;
  std::size_t reap_send(std::span<Completion> out) noexcept;
  bool finish_part(const detail::WrRing::Slot& slot, const ibv_wc& wc, Completion& c) noexcept;
  std::size_t reap_recv(std::span<Completion> out) noexcept;
  /// The advertised region with `r`'s rkey that holds [r.addr + offset, + len), or null.
  [[nodiscard]] const RemoteRegion* advertised(const RemoteRegion& r, std::uint64_t offset,
                                               std::uint64_t len) const noexcept {
    const std::uint64_t addr = r.addr + offset;
    for (const RemoteRegion& a : info.remote.regions) {
      if (a.rkey == r.rkey && addr >= a.addr && a.contains(addr - a.addr, len)) return &a;
    }
    return nullptr;
  }
  [[nodiscard]] std::uint32_t sends_in_flight() const noexcept {
    std::uint32_t n = 0;
    for (const detail::Lane& l : lanes) n += l.sq.count();
    return n;
  }
  void drain(detail::Deadline deadline, bool receives) noexcept;
  // Sleeps until a completion event, control traffic or the deadline; true if it polled a
  // completion into `out` on the way.
  bool sleep_for_event(detail::Deadline deadline, Completion& out) noexcept;
};

}  // namespace rdmakit

namespace rdmakit::detail {

/// For the library's own benchmarks: the verbs objects behind a Connection, so a raw-verbs loop
/// can run on exactly the QP and CQ the library uses.
struct ConnectionAccess {
  static Connection::Impl& impl(Connection& c) noexcept { return *c.impl_; }
};

}  // namespace rdmakit::detail
