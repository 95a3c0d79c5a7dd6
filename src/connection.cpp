// Connection: the verbs objects of one RC connection plus its TCP control channel, and the
// handshake that joins two of them.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "connection_impl.hpp"
#include "bootstrap/auth.hpp"
#include "rdmakit/error.hpp"
#include "trace.hpp"

namespace rdmakit {

using detail::Clock;
using detail::Deadline;

const char* to_string(Opcode op) noexcept {
  switch (op) {
    case Opcode::send: return "SEND";
    case Opcode::write: return "RDMA_WRITE";
    case Opcode::write_with_imm: return "RDMA_WRITE_WITH_IMM";
    case Opcode::read: return "RDMA_READ";
    case Opcode::recv: return "RECV";
    case Opcode::fetch_add: return "ATOMIC_FETCH_ADD";
    case Opcode::compare_swap: return "ATOMIC_CMP_SWAP";
  }
  return "?";
}

const char* Completion::status_name() const noexcept {
  return ibv_wc_status_str(static_cast<ibv_wc_status>(status));
}

namespace {

const char* likely_cause(int status) {
  switch (status) {
    case IBV_WC_RETRY_EXC_ERR:
      return "no ACK from the peer after every retry: the peer process or host is gone, or it is "
             "unreachable (wrong GID or route, RoCE v1/v2 mismatch, firewall on UDP 4791), or the "
             "path MTU is larger than the network carries";
    case IBV_WC_REM_ACCESS_ERR:
      return "the peer refused the access: wrong rkey, address or length outside its region, or "
             "the region was not registered with this access (remote read/write/atomic)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "the peer had no receive posted (receiver not ready) after every RNR retry";
    case IBV_WC_WR_FLUSH_ERR:
      return "flushed: the QP is in the error state (an earlier work request failed, or the "
             "connection is closing)";
    case IBV_WC_LOC_PROT_ERR:
      return "the local buffer is not inside a registered region with the needed access (a "
             "READ or RECV target needs local write)";
    case IBV_WC_LOC_LEN_ERR:
      return "the local receive buffer is smaller than the incoming message";
    case IBV_WC_REM_INV_REQ_ERR:
      return "the peer found the request invalid: longer than its receive buffer, or an "
             "operation its QP does not allow";
    case IBV_WC_REM_OP_ERR: return "the peer could not complete the operation";
    case IBV_WC_LOC_QP_OP_ERR: return "the local QP rejected the work request (bad opcode or SGE)";
    default: return "";
  }
}

}  // namespace

std::string Completion::describe() const {
  if (ok()) return fmt::format("{} wr_id={} ok", to_string(opcode), wr_id);
  const char* cause = likely_cause(status);
  return fmt::format("{} wr_id={} failed: {} (status {}, vendor_err {:#x}){}{}", to_string(opcode),
                     wr_id, status_name(), status, vendor_err, *cause ? ". Likely cause: " : "",
                     cause);
}

namespace {

std::uint32_t random_psn() {
  std::uint32_t v = 0;
  // A CSPRNG, so PSNs are not predictable by an off-path attacker injecting packets.
  if (::getrandom(&v, sizeof v, 0) != sizeof v) throw Error("getrandom", errno, "choosing a PSN");
  return v & 0xffffff;
}

}  // namespace

void detail::default_log(std::string_view msg) { fmt::print(stderr, "rdmakit: {}\n", msg); }

namespace {

using Fields = std::vector<std::pair<std::string, std::string>>;

// Everything one side told the other, for a trace. Remote keys stay out of traces: an (address,
// rkey) pair is a bearer token for the memory.
Fields endpoint_fields(const wire::EndpointInfo& e, const std::string& peer) {
  Fields f{{"peer", peer}, {"qpn", fmt::format("{:#x}", e.qpn)}, {"psn", fmt::format("{:#x}", e.psn)}};
  for (std::size_t k = 0; k < e.extra_qps.size(); ++k) {
    f.emplace_back(fmt::format("qp{}", k + 1), fmt::format("{:#x}/{:#x}", e.extra_qps[k].qpn, e.extra_qps[k].psn));
  }
  f.emplace_back("link_layer", to_string(e.link_layer));
  f.emplace_back("lid", std::to_string(e.lid));
  f.emplace_back("gid", GidEntry{e.gid_index, e.gid_type, e.gid, {}}.address());
  f.emplace_back("gid_index", std::to_string(e.gid_index));
  f.emplace_back("gid_type", to_string(e.gid_type));
  f.emplace_back("mtu", std::to_string(e.mtu));
  f.emplace_back("max_rd_atomic", std::to_string(e.max_rd_atomic));
  f.emplace_back("max_dest_rd_atomic", std::to_string(e.max_dest_rd_atomic));
  for (std::size_t k = 0; k < e.regions.size(); ++k) {
    const RemoteRegion& r = e.regions[k];
    f.emplace_back(fmt::format("region{}", k),
                   fmt::format("{:#x}+{} {}", r.addr, r.length, to_string(r.access)));
  }
  return f;
}

TraceEvent transition_event(std::uint32_t qpn, const char* transition,
                            const std::vector<detail::AttrLine>& attrs) {
  TraceEvent e{"qp_transition", {{"qp", fmt::format("{:#x}", qpn)}, {"transition", transition}}};
  for (const detail::AttrLine& a : attrs) {
    e.fields.emplace_back(a.name, a.origin.empty() ? a.value : fmt::format("{} ({})", a.value, a.origin));
  }
  return e;
}

}  // namespace

void Connection::Impl::trace_failure(const std::string& step, const std::exception& e) noexcept {
  detail::emit(cfg.trace, [&] {
    return TraceEvent{"handshake_failed", {{"peer", info.peer_address}, {"step", step}, {"error", e.what()}}};
  });
}

Connection::Impl::Impl(ConnectionConfig c) : cfg(std::move(c)) {
  if (!cfg.log) cfg.log = detail::default_log;
  if (!cfg.trace) cfg.trace = detail::trace_from_environment();
  timeouts = {cfg.ack_timeout, cfg.retry_count, cfg.rnr_timer, cfg.rnr_retry};
  detail::check_retries(timeouts);
  if (cfg.max_sge == 0) throw Error("connection config", EINVAL, "max_sge 0: at least 1 is needed");
  detail::check_key(cfg.psk);
}

// Opens the device and builds PD, CQs and the QP (in INIT), and fills in our EndpointInfo.
void Connection::Impl::open() {
  const auto devices = list_devices();
  const DeviceInfo& d = pick_device(devices, cfg.device);
  const PortInfo& p = pick_port(d, cfg.port);
  const GidChoice gid = choose_gid(p.gids, cfg.gid);

  dev = detail::open_pd(d.name);
  ibv_device_attr dattr{};
  if (const int rc = ibv_query_device(dev->ctx.get(), &dattr); rc != 0) {
    throw Error("ibv_query_device", rc, d.name);
  }
  if (cfg.qps == 0 || cfg.qps > wire::kMaxQps) {
    throw Error("connection config", EINVAL,
                fmt::format("qps {}: 1..{} QPs per connection", cfg.qps, wire::kMaxQps));
  }
  // One send CQ serves every QP and must hold one entry per work request of all of them, so a
  // depth is bounded by both limits: then the CQ can never overrun, whatever the signaling.
  for (auto [what, want, per_cq] : {std::tuple{"send_depth", cfg.send_depth, cfg.qps},
                                    std::tuple{"recv_depth", cfg.recv_depth, 1u}}) {
    const auto limit = std::min(d.max_qp_wr, d.max_cqe / per_cq);
    if (want == 0 || want > limit) {
      throw Error("connection config", EINVAL,
                  fmt::format("{} {} (device {} allows 1..{} with {} QPs: max_qp_wr {}, max_cqe {})",
                              what, want, d.name, limit, per_cq, d.max_qp_wr, d.max_cqe));
    }
  }
  // The context is this connection's own, so its async events (port down, QP fatal) are too;
  // non-blocking, so wait() can look at them without ever blocking.
  {
    const int fd = dev->ctx->async_fd;
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
      throw Error("fcntl(O_NONBLOCK)", errno, "async event fd");
    }
  }
  if (cfg.completion_events) {
    channel.reset(ibv_create_comp_channel(dev->ctx.get()));
    if (!channel) throw Error("ibv_create_comp_channel", errno, d.name);
    // Non-blocking, so a spurious wakeup can never leave ibv_get_cq_event blocked past a deadline.
    const int flags = ::fcntl(channel->fd, F_GETFL);
    if (flags < 0 || ::fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
      throw Error("fcntl(O_NONBLOCK)", errno, "completion channel");
    }
  }
  const std::uint32_t send_cqe = cfg.send_depth * cfg.qps;
  send_cq.reset(ibv_create_cq(dev->ctx.get(), static_cast<int>(send_cqe), nullptr, channel.get(), 0));
  if (!send_cq) throw Error("ibv_create_cq", errno, fmt::format("send CQ, {} entries", send_cqe));
  recv_cq.reset(ibv_create_cq(dev->ctx.get(), static_cast<int>(cfg.recv_depth), nullptr,
                              channel.get(), 0));
  if (!recv_cq) throw Error("ibv_create_cq", errno, fmt::format("receive CQ, {} entries", cfg.recv_depth));

  lanes.resize(cfg.qps);
  lane_count = cfg.qps;
  for (std::uint32_t k = 0; k < cfg.qps; ++k) {
    ibv_qp_init_attr qattr{};
    qattr.send_cq = send_cq.get();
    qattr.recv_cq = recv_cq.get();
    qattr.qp_type = IBV_QPT_RC;
    qattr.sq_sig_all = 0;
    qattr.cap.max_send_wr = cfg.send_depth;
    // Only the first QP receives (SEND/RECV stay there, in order); the others keep one entry
    // because some providers refuse a receive queue of zero.
    qattr.cap.max_recv_wr = k == 0 ? cfg.recv_depth : 1;
    qattr.cap.max_send_sge = cfg.max_sge;
    qattr.cap.max_recv_sge = 1;
    qattr.cap.max_inline_data = cfg.max_inline;
    detail::Lane& lane = lanes[k];
    lane.id = k;
    lane.qp.reset(ibv_create_qp(dev->pd.get(), &qattr));
    if (!lane.qp) {
      throw Error("ibv_create_qp", errno,
                  fmt::format("RC QP {} of {}, send {} / recv {} entries, {} SGEs, {} inline bytes on {}",
                              k + 1, cfg.qps, cfg.send_depth, cfg.recv_depth, cfg.max_sge,
                              cfg.max_inline, d.name),
                  errno == ENOMEM ? "out of QPs or memory on the device; are QPs leaking?"
                  : errno == EINVAL
                      ? fmt::format("the device allows at most {} SGEs and {} work requests per queue",
                                    dattr.max_sge, dattr.max_qp_wr)
                      : "");
    }
    // ibv_create_qp writes back what the device actually granted; the data path trusts only
    // that (the smallest grant of all the QPs).
    info.max_inline = k == 0 ? qattr.cap.max_inline_data : std::min(info.max_inline, qattr.cap.max_inline_data);
    info.max_sge = k == 0 ? qattr.cap.max_send_sge : std::min(info.max_sge, qattr.cap.max_send_sge);
    lane.sq.init(cfg.send_depth);
    detail::to_init(lane.qp.get(), p.number);
    detail::emit(cfg.trace, [&] {
      return transition_event(lane.qp->qp_num, "RESET->INIT", detail::init_attr_lines(p.number));
    });
  }
  info.send_depth = cfg.send_depth;
  info.recv_depth = cfg.recv_depth;
  info.qps = cfg.qps;
  info.atomics = dattr.atomic_cap != IBV_ATOMIC_NONE;
  rq.init(cfg.recv_depth);
  forced_signal_interval = std::max<std::uint32_t>(1, cfg.send_depth / 2);
  send_wrs.resize(cfg.send_depth);
  send_sges.resize(static_cast<std::size_t>(cfg.send_depth) * info.max_sge);
  recv_wrs.resize(cfg.recv_depth);
  recv_sges.resize(cfg.recv_depth);
  part_reqs.resize(cfg.send_depth);
  part_slices.assign(cfg.send_depth, LocalSlice::empty());
  segmented.resize(static_cast<std::size_t>(cfg.send_depth) * cfg.qps);
  free_segmented.resize(segmented.size());
  for (std::size_t i = 0; i < free_segmented.size(); ++i) {
    free_segmented[i] = static_cast<std::uint32_t>(free_segmented.size() - 1 - i);
  }
  recv_allowed = true;

  info.device = d.name;
  info.port = p.number;
  info.link_layer = p.link_layer;
  info.local_gid = gid.entry;
  info.gid_reason = gid.reason;
  info.local_mtu = p.active_mtu;
  info.max_msg_size = p.max_msg_size;
  segment_min_ordered = std::uint64_t{p.max_msg_size} + 1;
  segment_min_spread = cfg.qps > 1 ? std::min(cfg.stripe_min, segment_min_ordered) : segment_min_ordered;
  wire::EndpointInfo& l = info.local;
  l.qpn = lanes[0].qp->qp_num;
  l.psn = random_psn();
  for (std::size_t k = 1; k < lanes.size(); ++k) l.extra_qps.push_back({lanes[k].qp->qp_num, random_psn()});
  l.lid = p.lid;
  l.link_layer = p.link_layer;
  l.gid_type = gid.entry.type;
  l.gid = gid.entry.gid;
  l.gid_index = gid.entry.index;
  l.mtu = p.active_mtu;
  // As many READs/atomics in flight as the device allows (mlx5: 16, rxe: 128): reads are
  // latency-bound, so this depth is their bandwidth. The attribute is 8 bits wide.
  l.max_rd_atomic = static_cast<std::uint8_t>(std::clamp(dattr.max_qp_init_rd_atom, 0, 255));
  l.max_dest_rd_atomic = static_cast<std::uint8_t>(std::clamp(dattr.max_qp_rd_atom, 0, 255));
}

// Both sides' parameters are known: check they can talk, then INIT -> RTR -> RTS.
void Connection::Impl::finish(wire::EndpointInfo remote) {
  if (cfg.testing_alter_peer) cfg.testing_alter_peer(remote);
  info.remote = std::move(remote);
  info.remote_mtu = info.remote.mtu;
  wire::check_compatible(info.local, info.remote);
  if (info.remote.qp_count() != lanes.size()) {
    throw Error("bootstrap handshake", EPROTO,
                fmt::format("the peer has {} QPs for this connection, this side {}",
                            info.remote.qp_count(), lanes.size()),
                "a listener creates as many QPs as its client asks for; is the peer an rdmakit "
                "listener?");
  }
  // QP k joins the peer's QP k. Each transition sees both sides' parameters with that QP's
  // number and PSN, so an error names exactly the pair that failed.
  for (std::size_t k = 0; k < lanes.size(); ++k) {
    wire::EndpointInfo mine = info.local;
    wire::EndpointInfo theirs = info.remote;
    mine.qpn = info.local.qp(k).qpn;
    mine.psn = info.local.qp(k).psn;
    theirs.qpn = info.remote.qp(k).qpn;
    theirs.psn = info.remote.qp(k).psn;
    const auto rtr = detail::derive_rtr(mine, theirs, info.port, timeouts);
    info.path_mtu = detail::mtu_bytes(rtr.path_mtu);
    detail::to_rtr(lanes[k].qp.get(), rtr, mine, theirs);
    detail::emit(cfg.trace, [&] {
      return transition_event(mine.qpn, "INIT->RTR", detail::rtr_attr_lines(rtr, mine, theirs));
    });
    const auto rts = detail::derive_rts(mine, theirs, timeouts);
    detail::to_rts(lanes[k].qp.get(), rts, mine, theirs);
    detail::emit(cfg.trace, [&] {
      return transition_event(mine.qpn, "RTR->RTS", detail::rts_attr_lines(rts, mine, theirs));
    });
  }
}

void Connection::Impl::trace_hello(const char* event, const wire::EndpointInfo& e) noexcept {
  detail::emit(cfg.trace, [&] { return TraceEvent{event, endpoint_fields(e, info.peer_address)}; });
}

void Connection::Impl::trace_connected() noexcept {
  detail::emit(cfg.trace, [&] {
    return TraceEvent{"connected",
                      {{"peer", info.peer_address},
                       {"device", info.device},
                       {"port", std::to_string(info.port)},
                       {"qps", std::to_string(info.qps)},
                       {"path_mtu", std::to_string(info.path_mtu)},
                       {"max_inline", std::to_string(info.max_inline)},
                       {"send_depth", std::to_string(info.send_depth)},
                       {"recv_depth", std::to_string(info.recv_depth)}}};
  });
}

// Reads whatever the peer sent on the control channel without blocking: BYE, or EOF/reset (the
// peer is gone). Uses the non-throwing header check, so the data path never throws.
void Connection::Impl::pump_control() noexcept {
  if (!control || control_gone) return;
  for (;;) {
    const long n = detail::recv_nonblocking(control.get(), {cbuf.data() + cfill, cbuf.size() - cfill});
    if (n == detail::kRecvClosed) {
      control_gone = true;
      return;
    }
    if (n == detail::kRecvWouldBlock) break;
    cfill += static_cast<std::size_t>(n);
    while (cfill >= wire::kHeaderSize) {
      const auto h = wire::try_decode_header({cbuf.data(), cfill});
      if (!h || h->length > cbuf.size() - wire::kHeaderSize) {
        control_gone = true;  // a peer that garbles its control channel is treated as lost
        return;
      }
      const std::size_t len = h->length;
      if (cfill < wire::kHeaderSize + len) break;
      if (h->type == wire::MessageType::bye || h->type == wire::MessageType::reject) {
        bye_received = true;
      } else if (h->type == wire::MessageType::user) {
        // Only application messages allocate, and only when one arrives.
        try {
          messages.emplace_back(cbuf.begin() + static_cast<std::ptrdiff_t>(wire::kHeaderSize),
                                cbuf.begin() + static_cast<std::ptrdiff_t>(wire::kHeaderSize + len));
        } catch (...) {
          control_gone = true;
          return;
        }
      }
      std::copy(cbuf.begin() + static_cast<std::ptrdiff_t>(wire::kHeaderSize + len),
                cbuf.begin() + static_cast<std::ptrdiff_t>(cfill), cbuf.begin());
      cfill -= wire::kHeaderSize + len;
    }
    if (cfill == cbuf.size()) {
      control_gone = true;
      return;
    }
  }
}

bool Connection::Impl::pump_async() noexcept {
  if (!dev || !dev->ctx) return false;
  bool broke = false;
  ibv_async_event ev{};
  while (ibv_get_async_event(dev->ctx.get(), &ev) == 0) {
    std::string why;
    switch (ev.event_type) {
      case IBV_EVENT_PORT_ERR:
        if (ev.element.port_num == info.port) {
          why = fmt::format("port {} of {} went down (IBV_EVENT_PORT_ERR): the link or its netdev is "
                            "down; check `ip link` / the cable, then reconnect", info.port, info.device);
        }
        break;
      case IBV_EVENT_DEVICE_FATAL:
        why = fmt::format("device {} failed (IBV_EVENT_DEVICE_FATAL); it must be reset or reloaded", info.device);
        break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        for (const detail::Lane& l : lanes) {
          if (ev.element.qp == l.qp.get()) {
            why = fmt::format("QP {:#x} failed ({})", l.qp->qp_num, ibv_event_type_str(ev.event_type));
          }
        }
        break;
      default: break;
    }
    ibv_ack_async_event(&ev);
    if (!why.empty() && failure.empty()) {
      break_connection(std::move(why), true);
      broke = true;
    }
  }
  return broke;
}

void Connection::Impl::break_connection(std::string why, bool device) noexcept {
  if (!failure.empty()) return;
  failure = std::move(why);
  device_failed = device;
  for (detail::Lane& l : lanes) (void)detail::to_error(l.qp.get());
}

void Connection::Impl::close(std::chrono::milliseconds timeout) noexcept {
  if (state == State::closed) return;
  const Deadline deadline = Clock::now() + timeout;
  if (state == State::connected && control && !control_gone) {
    try {
      detail::send_all(control.get(), wire::encode_header(wire::MessageType::bye, 0), deadline);
    } catch (const std::exception&) {
      // The peer is already gone; nothing to tell it.
    }
  }
  state = State::closed;
  if (!lanes.empty()) {
    // Sends, writes and reads in flight may still finish on their own, but that is observable
    // only when the newest of them on each QP was signaled; posted receives only wait for a
    // peer that has said goodbye. Whatever is left is flushed by moving the QPs to ERR, so no
    // buffer is released while the NIC may still touch it.
    const bool observable = std::all_of(lanes.begin(), lanes.end(),
                                        [](const detail::Lane& l) { return l.unsignaled_run == 0; });
    if (observable) drain(deadline, false);
    if (sends_in_flight() + rq.count() > 0) {
      for (detail::Lane& lane : lanes) {
        (void)detail::to_error(lane.qp.get());
        // Unsignaled requests that already succeeded produce no flush completion. A signaled
        // marker posted to the errored QP is flushed after all of them and retires them
        // (the kernel's ib_drain_sq does the same).
        if (lane.sq.count() > 0 && lane.sq.free() > 0) {
          ibv_send_wr marker{};
          marker.wr_id = (std::uint64_t{lane.id} << detail::kLaneShift) | lane.sq.next_seq();
          marker.opcode = IBV_WR_SEND;
          marker.send_flags = IBV_SEND_SIGNALED;
          ibv_send_wr* bad = nullptr;
          if (ibv_post_send(lane.qp.get(), &marker, &bad) == 0) {
            lane.sq.push({0, Opcode::send, false, false});
          }
        }
      }
      drain(Clock::now() + std::chrono::milliseconds{1000}, true);
    }
    if (const std::uint32_t left = sends_in_flight() + rq.count(); left > 0) {
      try {
        cfg.log(fmt::format("close: {} work requests never completed on QP {:#x}; releasing anyway",
                            left, lanes[0].qp->qp_num));
      } catch (...) {
      }
    }
    // Revocation: once nothing is in flight, no rkey of this connection may keep working.
    for (MemoryRegion& r : regions) r.deregister();
    detail::emit(cfg.trace, [&] {
      return TraceEvent{"closed",
                        {{"peer", info.peer_address},
                         {"qp", fmt::format("{:#x}", lanes[0].qp->qp_num)},
                         {"flushed", observable && sends_in_flight() + rq.count() == 0 ? "no" : "yes"},
                         {"never_completed", std::to_string(sends_in_flight() + rq.count())},
                         {"peer_said_bye", bye_received ? "yes" : "no"}}};
    });
  }
  control.reset();
}

Connection::Connection(std::unique_ptr<Impl> impl) noexcept : impl_(std::move(impl)) {}
Connection::Connection(Connection&&) noexcept = default;
Connection& Connection::operator=(Connection&&) noexcept = default;
Connection::~Connection() = default;

const MemoryRegion& Connection::register_memory(void* addr, std::size_t length, Access access) {
  impl_->regions.push_back(MemoryRegion(detail::register_region(impl_->dev, addr, length, access)));
  return impl_->regions.back();
}

const MemoryRegion& Connection::allocate_memory(std::size_t length, Access access) {
  return allocate_memory(length, access, MemorySpec{});
}

void Connection::revoke(const MemoryRegion& region) noexcept {
  for (MemoryRegion& r : impl_->regions) {
    if (&r == &region) r.deregister();
  }
  // The advertised list is the peer's view at the handshake; it stays as sent.
}

const MemoryRegion& Connection::allocate_memory(std::size_t length, Access access, const MemorySpec& spec) {
  impl_->regions.push_back(MemoryRegion(detail::allocate_region(impl_->dev, length, access, spec)));
  return impl_->regions.back();
}

const MemoryRegion& Connection::memory(std::size_t index) const {
  if (index >= impl_->regions.size()) {
    throw Error("memory", EINVAL, fmt::format("no region {} (this connection has {})", index,
                                              impl_->regions.size()));
  }
  return impl_->regions[index];
}

std::size_t Connection::memory_count() const noexcept { return impl_->regions.size(); }

void Connection::advertise(const MemoryRegion& region) {
  if (impl_->state != Impl::State::setup) {
    throw Error("advertise", EINVAL, "regions can only be advertised during setup",
                "call advertise() from the Setup callback");
  }
  impl_->info.local.regions.push_back(region.remote());
}

const std::vector<RemoteRegion>& Connection::remote_regions() const noexcept {
  return impl_->info.remote.regions;
}
const ConnectionInfo& Connection::info() const noexcept { return impl_->info; }
const std::string& Connection::failure() const noexcept { return impl_->failure; }

bool Connection::peer_closed() noexcept {
  impl_->pump_control();
  return impl_->bye_received || impl_->control_gone;
}

bool Connection::wait_peer_close(std::chrono::milliseconds timeout) noexcept {
  return impl_->await_control(detail::deadline_in(timeout),
                              [this] { return impl_->bye_received || impl_->control_gone; });
}

void Connection::send_message(std::span<const std::uint8_t> payload,
                              std::chrono::milliseconds timeout) {
  if (payload.size() > max_message_size) {
    throw Error("send_message", EMSGSIZE,
                fmt::format("{} bytes; at most {}", payload.size(), max_message_size));
  }
  if (impl_->state != Impl::State::connected || !impl_->control) {
    throw Error("send_message", ENOTCONN, "the connection is not established or already closed");
  }
  auto msg = wire::encode_header(wire::MessageType::user, static_cast<std::uint32_t>(payload.size()));
  msg.insert(msg.end(), payload.begin(), payload.end());
  detail::send_all(impl_->control.get(), msg, detail::deadline_in(timeout));
}

std::optional<std::vector<std::uint8_t>> Connection::receive_message(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  m.await_control(detail::deadline_in(timeout),
                  [&m] { return !m.messages.empty() || m.control_gone || m.bye_received; });
  if (m.messages.empty()) return std::nullopt;
  auto msg = std::move(m.messages.front());
  m.messages.pop_front();
  return msg;
}

void Connection::close(std::chrono::milliseconds timeout) noexcept {
  if (impl_) impl_->close(timeout);
}

// --- handshake ----------------------------------------------------------------------------------

namespace {

void send_reject(int fd, const std::string& reason) noexcept {
  try {
    detail::send_all(fd, wire::encode_reject(reason), detail::deadline_in(std::chrono::milliseconds{500}));
  } catch (const std::exception&) {
  }
}

[[noreturn]] void rejected_by_peer(const detail::Message& m, const std::string& peer) {
  throw Error("bootstrap handshake", ECONNREFUSED,
              fmt::format("{} rejected the connection: {}", peer, wire::decode_reject(m.payload)));
}

void expect(const detail::Message& m, wire::MessageType type, const std::string& peer) {
  if (m.header.type == wire::MessageType::reject) rejected_by_peer(m, peer);
  if (m.header.type != type) {
    throw Error("bootstrap handshake", EPROTO,
                fmt::format("{} sent {} where {} was expected", peer, wire::to_string(m.header.type),
                            wire::to_string(type)));
  }
}

}  // namespace

Connection Connection::connect(const std::string& host_port, const ConnectionConfig& config,
                               const Setup& setup) {
  const Deadline deadline = detail::deadline_in(config.handshake_timeout);
  const detail::HostPort to = detail::parse_host_port(host_port, 0);
  if (to.port == 0) {
    throw Error("connect", EINVAL, fmt::format("'{}' has no port (host:port)", host_port));
  }
  Connection conn(std::make_unique<Impl>(config));
  Impl& m = *conn.impl_;
  m.info.peer_address = to.to_string();
  const char* step = "setup";
  try {
    m.open();
    if (setup) setup(conn);
    detail::Message reply;
    // A listener at its handshake caps answers "busy": like a refused connect, that is worth
    // retrying until the deadline when the caller asked for retries (the QP and HELLO are reused).
    for (;;) {
      step = "TCP connect";
      m.control = detail::tcp_connect(to, deadline, config.retry_refused);
      const int fd = m.control.get();
      try {
        if (!config.psk.empty()) {
          step = "authentication";
          detail::authenticate_client(fd, config.psk, deadline, m.info.peer_address);
        }
        step = "HELLO exchange";
        detail::send_all(fd, wire::encode_hello(m.info.local), deadline);
        m.trace_hello("hello_sent", m.info.local);
        reply = detail::recv_message(fd, deadline);
        expect(reply, wire::MessageType::hello, m.info.peer_address);
        break;
      } catch (const Error& e) {
        const bool busy = std::string_view(e.what()).find(detail::kBusyReason) != std::string_view::npos;
        if (!busy || !config.retry_refused || Clock::now() + std::chrono::milliseconds{100} >= deadline) throw;
        m.control.reset();
        std::this_thread::sleep_for(std::chrono::milliseconds{50 + random_psn() % 100});
      }
    }
    const int fd = m.control.get();
    step = "QP transitions";
    try {
      wire::EndpointInfo remote = wire::decode_hello(reply.payload);
      m.trace_hello("hello_received", remote);
      m.finish(std::move(remote));
    } catch (const Error& e) {
      send_reject(fd, e.what());
      throw;
    }
    step = "READY";
    detail::send_all(fd, wire::encode_header(wire::MessageType::ready, 0), deadline);
  } catch (const std::exception& e) {
    m.trace_failure(step, e);
    throw;
  }
  m.state = Impl::State::connected;
  m.trace_connected();
  return conn;
}

// Client HELLO -> server builds its QP and goes to RTS -> server HELLO -> client goes to RTS ->
// client READY. Each side is in RTS before the other may post to it, and a malformed HELLO is
// refused before the server spends any device resource on it.
Connection Connection::accept_on(int raw_fd, const std::string& peer, const ConnectionConfig& config,
                                 const Setup& setup, std::shared_ptr<void> admission) {
  detail::Fd fd(raw_fd);
  const Deadline deadline = detail::deadline_in(config.handshake_timeout);
  wire::EndpointInfo remote;
  try {
    detail::Message first = detail::recv_message(fd.get(), deadline);
    if (!config.psk.empty()) {
      // Nothing about this side crosses the wire before the client has proven the key.
      detail::authenticate_server(fd.get(), config.psk, first, deadline, peer);
      first = detail::recv_message(fd.get(), deadline);
    } else if (first.header.type == wire::MessageType::auth_challenge) {
      throw Error("bootstrap authentication", EACCES,
                  fmt::format("{} asked to authenticate, but this listener has no pre-shared key", peer),
                  "give both sides the same key");
    }
    expect(first, wire::MessageType::hello, peer);
    remote = wire::decode_hello(first.payload);
  } catch (const Error& e) {
    send_reject(fd.get(), e.what());
    throw;
  }
  // The client chose how many QPs the connection has.
  ConnectionConfig mine = config;
  mine.qps = static_cast<std::uint32_t>(remote.qp_count());
  Connection conn(std::make_unique<Impl>(std::move(mine)));
  Impl& m = *conn.impl_;
  m.admission = std::move(admission);
  m.info.peer_address = peer;
  m.trace_hello("hello_received", remote);
  try {
    m.open();
    if (setup) setup(conn);
    m.finish(std::move(remote));
  } catch (const Error& e) {
    m.trace_failure("QP transitions", e);
    send_reject(fd.get(), e.what());
    throw;
  }
  m.control = std::move(fd);
  try {
    detail::send_all(m.control.get(), wire::encode_hello(m.info.local), deadline);
    m.trace_hello("hello_sent", m.info.local);
    expect(detail::recv_message(m.control.get(), deadline), wire::MessageType::ready, peer);
  } catch (const std::exception& e) {
    m.trace_failure("READY", e);
    throw;
  }
  m.state = Impl::State::connected;
  m.trace_connected();
  return conn;
}

}  // namespace rdmakit
