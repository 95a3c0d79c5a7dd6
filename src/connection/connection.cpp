// SPDX-License-Identifier: Apache-2.0
// Connection's lifecycle: the verbs objects of one RC connection (open), joining them with the
// peer's (finish), close, and the memory and information calls.
#include <endian.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bootstrap/auth.hpp"
#include "connection/impl.hpp"
#include "rdmakit/error.hpp"
#include "trace.hpp"

namespace rdmakit {

using detail::Clock;
using detail::Deadline;

void detail::default_log(std::string_view msg) { fmt::print(stderr, "rdmakit: {}\n", msg); }

namespace {

std::uint32_t random_psn() {
  std::uint32_t v = 0;
  // A CSPRNG, so PSNs are not predictable by an off-path attacker injecting packets.
  if (::getrandom(&v, sizeof v, 0) != sizeof v) throw Error("getrandom", errno, "choosing a PSN");
  return v & 0xffffff;
}

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
  f.emplace_back("atomics", (e.flags & wire::kFlagAtomics) != 0 ? "yes" : "no");
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

void Connection::Impl::trace_hello(const char* event, const wire::EndpointInfo& e) noexcept {
  detail::emit(cfg.trace, [&] { return TraceEvent{event, endpoint_fields(e, info.peer_address)}; });
}

void Connection::Impl::log(const std::string& msg) noexcept {
  try {
    cfg.log(msg);
  } catch (...) {
    // A logger that throws must not take the connection down with it.
  }
}

Connection::Impl::Impl(ConnectionConfig c, std::shared_ptr<const detail::Secret> key)
    : cfg(std::move(c)), psk(std::move(key)) {
  // One copy of the key per connection (or the listener's, shared), wiped when it goes.
  detail::check_key(cfg.psk);
  if (!psk && !cfg.psk.empty()) psk = std::make_shared<const detail::Secret>(cfg.psk);
  detail::wipe(cfg.psk);
  if (!cfg.log) cfg.log = detail::default_log;
  if (!cfg.trace) cfg.trace = detail::trace_from_environment();
  timeouts = {cfg.ack_timeout, cfg.retry_count, cfg.rnr_timer, cfg.rnr_retry};
  detail::check_retries(timeouts);
  path = {cfg.traffic_class, cfg.service_level, cfg.pkey_index};
  detail::check_path(path);
  if (cfg.max_sge == 0) throw Error("connection config", EINVAL, "max_sge 0: at least 1 is needed");
  static_assert(wire::kMaxQps <= detail::kMaxLanes, "a data path holds every QP of a connection");
  if (cfg.qps == 0 || cfg.qps > wire::kMaxQps) {
    throw Error("connection config", EINVAL,
                fmt::format("qps {}: 1..{} QPs per connection", cfg.qps, wire::kMaxQps));
  }
  if (cfg.keepalive_interval.count() < 0 || cfg.keepalive_timeout.count() < 0 ||
      (cfg.keepalive_interval.count() > 0) != (cfg.keepalive_timeout.count() > 0)) {
    throw Error("connection config", EINVAL,
                fmt::format("keepalive interval {} ms, timeout {} ms", cfg.keepalive_interval.count(),
                            cfg.keepalive_timeout.count()),
                "both positive (keepalive on), or both 0 (off)");
  }
}

void detail::PinBudget::take(std::uint64_t n) {
  std::lock_guard lock(mu_);
  if (used_ + n > limit_) {
    throw Error("listener memory budget", ENOMEM,
                fmt::format("{}handshakes in progress have pinned {} bytes; {} more would pass the "
                            "listener's budget of {}",
                            detail::kBusyReason, used_, n, limit_),
                "raise ListenerConfig::max_handshake_memory, or the connections wait until others "
                "finish their handshakes");
  }
  used_ += n;
}

void detail::PinBudget::give(std::uint64_t n) noexcept {
  std::lock_guard lock(mu_);
  used_ -= std::min(used_, n);
}

void Connection::Impl::charge(std::uint64_t bytes) {
  if (!budget || state != State::setup) return;
  budget->take(bytes);
  budget_held += bytes;
}

void Connection::Impl::release_budget() noexcept {
  if (budget && budget_held > 0) budget->give(budget_held);
  budget_held = 0;
}

void Connection::Impl::open(const detail::Channel& control_channel) {
  if (!layer) layer = detail::DeviceLayer::acquire();
  auto devices = layer->catalog();
  const std::string local_address = control_channel.local_address();
  const std::string resolved = control_channel.device();
  // An engine's link takes only the engine's devices (empty: any).
  const auto mine = [&](const std::string& name) {
    return hooks.devices.empty() || std::find(hooks.devices.begin(), hooks.devices.end(), name) != hooks.devices.end();
  };
  if (!resolved.empty() && !mine(resolved)) {
    throw Error("rdma_cm", EINVAL,
                fmt::format("the CM resolved {} to device {}, which is not one of the engine's ({})",
                            info.peer_address, resolved, fmt::join(hooks.devices, ", ")),
                "list it in EngineConfig::devices (--device), or reach the peer at an address those devices carry");
  }
  if (!resolved.empty() && !cfg.device.empty() && resolved != cfg.device) {
    throw Error("rdma_cm", EINVAL,
                fmt::format("the CM resolved {} to device {}, but the configuration asks for {}",
                            info.peer_address, resolved, cfg.device),
                fmt::format("over rdma_cm the route decides the device: leave the device unset, or "
                            "connect to an address that {} reaches",
                            cfg.device));
  }
  DeviceChoice choice = choose_device(devices, resolved.empty() ? cfg.device : resolved, local_address);
  if (!mine(choice.device->name)) {
    // The route names a device the engine left out: refused, not linked through another of
    // its devices behind the configuration's back (on a routed fabric that would work, on the
    // wrong NIC). The fallback (no route named one) is taken among the engine's own.
    if (choice.by_route) {
      throw Error("choose device", ENODEV,
                  fmt::format("the route to {} goes through {} ({}), which is not one of the engine's devices ({})",
                              info.peer_address, choice.device->name, choice.reason, fmt::join(hooks.devices, ", ")),
                  "list it in EngineConfig::devices (--device), or reach the peer at an address one of them carries");
    }
    std::erase_if(devices, [&](const DeviceInfo& x) { return !mine(x.name); });
    choice = choose_device(devices, "", local_address);
  }
  const DeviceInfo& d = *choice.device;
  // The port the route named (IPoIB's netdev names one of two), unless one is configured.
  const PortInfo& p = pick_port(d, cfg.port != 0 ? cfg.port : choice.port, local_address);
  info.device_reason = !resolved.empty() ? fmt::format("rdma_cm resolved the route to {} to it", info.peer_address)
                                         : choice.reason;
  const GidChoice gid = choose_gid(p.gids, cfg.gid, local_address);

  if (hooks.attach) {
    attached = hooks.attach(d.name);
    dev = attached.dev;
  } else {
    dev = detail::open_pd(layer->device(d.name));
  }
  const ibv_device_attr& dattr = dev->device->attr();
  if (cfg.pkey_index != 0) {
    // Checked here: some providers (rxe) take any index at RESET->INIT, and the packets would
    // then carry no partition the subnet manager gave this port.
    __be16 pkey = 0;
    errno = 0;
    const int rc = ibv_query_pkey(dev->ctx(), p.number, cfg.pkey_index, &pkey);
    if (rc != 0 || (be16toh(pkey) & 0x7fff) == 0) {
      throw Error("ibv_query_pkey", rc != 0 && errno != 0 ? errno : EINVAL,
                  fmt::format("P_Key index {} of {} port {} is not a valid entry", cfg.pkey_index, d.name, p.number),
                  fmt::format("use an index the subnet manager gave this port (cat /sys/class/infiniband/{}/ports/{}/"
                              "pkeys/*; rdmakit doctor --pkey-index N checks one)",
                              d.name, p.number));
    }
  }
  // The device is shared; its events for our port, CQs and QPs come to on_device_event.
  dev->device->subscribe(this, p.number);
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
  if (cfg.completion_events && !attached.send_cq) {
    channel.reset(ibv_create_comp_channel(dev->ctx()));
    if (!channel) throw Error("ibv_create_comp_channel", errno, d.name);
    // Non-blocking, so a spurious wakeup can never leave ibv_get_cq_event blocked past a deadline.
    detail::set_nonblocking(channel->fd, "completion channel");
  }
  ibv_cq* scq = attached.send_cq;
  ibv_cq* rcq = attached.recv_cq;
  ibv_cq_ex* send_cqx = nullptr;  // the send CQ's extended interface, where the provider has it
  if (scq == nullptr) {
    const std::uint32_t send_cqe = cfg.send_depth * cfg.qps;
    // Polled one completion at a time through ibv_start_poll/ibv_end_poll (DataPath::poll_one),
    // in batches and by the drain through ibv_poll_cq, which takes it as well.
    ibv_cq_init_attr_ex ca{};
    ca.cqe = send_cqe;
    ca.channel = channel.get();
    ca.wc_flags = 0;  // wr_id, status and vendor_err are all the extended poll reads
    send_cqx = ibv_create_cq_ex(dev->ctx(), &ca);
    if (send_cqx != nullptr) send_cq.reset(ibv_cq_ex_to_cq(send_cqx));
    if (!send_cq) send_cq.reset(ibv_create_cq(dev->ctx(), static_cast<int>(send_cqe), nullptr, channel.get(), 0));
    if (!send_cq) throw Error("ibv_create_cq", errno, fmt::format("send CQ, {} entries", send_cqe));
    recv_cq.reset(ibv_create_cq(dev->ctx(), static_cast<int>(cfg.recv_depth), nullptr, channel.get(), 0));
    if (!recv_cq) throw Error("ibv_create_cq", errno, fmt::format("receive CQ, {} entries", cfg.recv_depth));
    dev->device->watch(this, send_cq.get());
    dev->device->watch(this, recv_cq.get());
    scq = send_cq.get();
    rcq = recv_cq.get();
  }

  qps.reserve(cfg.qps);
  std::vector<ibv_qp*> raw;
  // Through the extended interface where the provider has it: a prepared or single WRITE or
  // READ is posted by ibv_wr_* (DataPath::use_extended: the provider parses no classic work
  // request); everything else, and everything on a provider without it, by ibv_post_send.
  bool extended = true;  // every QP so far was (ibv_qp_to_qp_ex is for those alone)
  for (std::uint32_t k = 0; k < cfg.qps; ++k) {
    ibv_qp_init_attr qattr{};
    qattr.send_cq = scq;
    qattr.recv_cq = rcq;
    qattr.qp_type = IBV_QPT_RC;
    qattr.sq_sig_all = 0;
    qattr.cap.max_send_wr = cfg.send_depth;
    // Only the first QP receives (SEND/RECV stay there, in order); the others keep one entry
    // because some providers refuse a receive queue of zero.
    qattr.cap.max_recv_wr = k == 0 ? cfg.recv_depth : 1;
    qattr.cap.max_send_sge = cfg.max_sge;
    qattr.cap.max_recv_sge = 1;
    qattr.cap.max_inline_data = cfg.max_inline;
    detail::QpPtr qp;
    if (extended) {
      ibv_qp_init_attr_ex ex{};
      ex.send_cq = qattr.send_cq;
      ex.recv_cq = qattr.recv_cq;
      ex.qp_type = qattr.qp_type;
      ex.sq_sig_all = qattr.sq_sig_all;
      ex.cap = qattr.cap;
      ex.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
      ex.pd = dev->pd.get();
      // Every opcode any path posts on it, classic or not: a provider sizes its send queue's
      // entries by them (mlx5 does: a bind takes more room than a WRITE).
      ex.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND |
                          IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_BIND_MW;
      if (dattr.atomic_cap != IBV_ATOMIC_NONE) {
        ex.send_ops_flags |= IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;
      }
      qp.reset(ibv_create_qp_ex(dev->ctx(), &ex));
      if (qp && ibv_qp_to_qp_ex(qp.get()) == nullptr) qp.reset();
      if (qp) qattr.cap = ex.cap;
    }
    if (!qp) {
      // A provider without it, or refusing those flags: the classic call, and the classic post
      // on every lane (ibv_post_send takes any QP).
      extended = false;
      qp.reset(ibv_create_qp(dev->pd.get(), &qattr));
    }
    if (!qp) {
      throw Error("ibv_create_qp", errno,
                  fmt::format("RC QP {} of {}, send {} / recv {} entries, {} SGEs, {} inline bytes on {}",
                              k + 1, cfg.qps, cfg.send_depth, cfg.recv_depth, cfg.max_sge,
                              cfg.max_inline, d.name),
                  errno == ENOMEM ? "out of QPs or memory on the device; are QPs leaking?"
                  : errno == EINVAL
                      ? fmt::format("the device allows at most {} SGEs, {} work requests per queue "
                                    "(and its own limit of inline bytes)",
                                    dattr.max_sge, dattr.max_qp_wr)
                      : "");
    }
    // ibv_create_qp writes back what the device actually granted; the data path trusts only
    // that (the smallest grant of all the QPs).
    info.max_inline = k == 0 ? qattr.cap.max_inline_data : std::min(info.max_inline, qattr.cap.max_inline_data);
    info.max_sge = k == 0 ? qattr.cap.max_send_sge : std::min(info.max_sge, qattr.cap.max_send_sge);
    raw.push_back(qp.get());
    dev->device->watch(this, qp.get());
    qps.push_back(std::move(qp));
    detail::to_init(raw.back(), p.number, cfg.pkey_index);
    detail::emit(cfg.trace, [&] {
      return transition_event(raw.back()->qp_num, "RESET->INIT", detail::init_attr_lines(p.number, cfg.pkey_index));
    });
  }
  info.method = cfg.method;
  info.send_depth = cfg.send_depth;
  info.recv_depth = cfg.recv_depth;
  info.qps = cfg.qps;
  info.device = d.name;
  info.port = p.number;
  info.link_layer = p.link_layer;
  info.local_gid = gid.entry;
  info.gid_reason = gid.reason;
  info.traffic_class = cfg.traffic_class;
  info.service_level = cfg.service_level;
  info.pkey_index = cfg.pkey_index;
  info.ack_timeout = detail::ack_timeout_duration(detail::encode_ack_timeout(cfg.ack_timeout));
  info.retry_count = cfg.retry_count;
  info.local_mtu = p.active_mtu;
  info.max_msg_size = p.max_msg_size;
  wire::EndpointInfo& l = info.local;
  l.qpn = raw[0]->qp_num;
  l.psn = random_psn();
  for (std::size_t k = 1; k < raw.size(); ++k) l.extra_qps.push_back({raw[k]->qp_num, random_psn()});
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
  l.flags = dattr.atomic_cap != IBV_ATOMIC_NONE ? wire::kFlagAtomics : 0;

  dp.init({cfg.send_depth, cfg.recv_depth, info.max_sge, info.max_inline, p.max_msg_size, cfg.stripe_min},
          raw, scq, rcq, channel.get(), detail::real_verbs());
  // rxe (vendor id 0xffffff) completes a WRITE whose data came by ibv_wr_set_inline_data with a
  // local QP operation error (rdma-core 44): there a single WRITE small enough to be inline goes
  // by the classic call, inline (post_one_on), and a prepared one by its SGE.
  std::vector<ibv_qp_ex*> qpxs;
  if (extended) {
    for (ibv_qp* q : raw) qpxs.push_back(ibv_qp_to_qp_ex(q));
  }
  dp.use_extended(qpxs, dattr.vendor_id != 0xffffff, send_cqx);
  dp.observe(cfg.trace, info.peer_address);
}

void Connection::Impl::finish(wire::EndpointInfo remote) {
  if (hooks.peer_hello) hooks.peer_hello(remote);
  info.remote = std::move(remote);
  info.remote_mtu = info.remote.mtu;
  wire::check_compatible(info.local, info.remote);
  if (info.remote.qp_count() != qps.size()) {
    throw Error("bootstrap handshake", EPROTO,
                fmt::format("the peer has {} QPs for this connection, this side {}",
                            info.remote.qp_count(), qps.size()),
                "a listener creates as many QPs as its client asks for; is the peer an rdmakit "
                "listener?");
  }
  // Atomics need a requester here and a responder there that both support them.
  info.atomics = (info.local.flags & wire::kFlagAtomics) != 0 && (info.remote.flags & wire::kFlagAtomics) != 0;
  // QP k joins the peer's QP k. Each transition sees both sides' parameters with that QP's
  // number and PSN, so an error names exactly the pair that failed.
  for (std::size_t k = 0; k < qps.size(); ++k) {
    wire::EndpointInfo mine = info.local;
    wire::EndpointInfo theirs = info.remote;
    mine.qpn = info.local.qp(k).qpn;
    mine.psn = info.local.qp(k).psn;
    theirs.qpn = info.remote.qp(k).qpn;
    theirs.psn = info.remote.qp(k).psn;
    auto rtr = detail::derive_rtr(mine, theirs, info.port, timeouts, path);
    // An engine link grants what its memory windows may allow; each window says what it does.
    if (attached.dev) rtr.access = attached.qp_access;
    info.path_mtu = detail::mtu_bytes(rtr.path_mtu);
    detail::to_rtr(qps[k].get(), rtr, mine, theirs);
    detail::emit(cfg.trace, [&] {
      return transition_event(mine.qpn, "INIT->RTR", detail::rtr_attr_lines(rtr, mine, theirs));
    });
    const auto rts = detail::derive_rts(mine, theirs, timeouts);
    detail::to_rts(qps[k].get(), rts, mine, theirs);
    detail::emit(cfg.trace, [&] {
      return transition_event(mine.qpn, "RTR->RTS", detail::rts_attr_lines(rts, mine, theirs));
    });
  }
  dp.set_remote(info.remote.regions, info.atomics);
}

void Connection::Impl::connected() noexcept {
  state = State::connected;
  // The stop is for the handshake's waits: a connection's own sends (a BYE at close) have
  // their own deadlines, and its owner's shutdown must not cut them.
  if (control) control->set_stop(nullptr);
  // Handed out: what it pinned is its owner's now, not the listener's handshakes'.
  release_budget();
  dp.start();
  detail::emit(cfg.trace, [&] {
    return TraceEvent{"connected",
                      {{"peer", info.peer_address},
                       {"device", info.device},
                       {"port", std::to_string(info.port)},
                       {"qps", std::to_string(info.qps)},
                       {"path_mtu", std::to_string(info.path_mtu)},
                       {"max_inline", std::to_string(info.max_inline)},
                       {"send_depth", std::to_string(info.send_depth)},
                       {"recv_depth", std::to_string(info.recv_depth)},
                       {"gid", info.local_gid.address()},
                       {"gid_reason", info.gid_reason},
                       {"device_reason", info.device_reason}}};
  });
}

// Safe on every partially built state: whatever open() got to is released, nothing is assumed
// to exist (a QP, a context) that may not.
void Connection::Impl::close(std::chrono::milliseconds timeout) noexcept {
  if (state == State::closed) return;
  const bool was_connected = state == State::connected;
  state = State::closed;
  const Deadline deadline = Clock::now() + timeout;
  // 1. Let what is in flight finish while the peer's QPs still answer; 2. then say BYE (the
  // peer flushes its side on it); 3. flush whatever is left here.
  // An engine link's completions are its worker's to reap (the shared CQs serve other links
  // too): the worker closes a link once nothing of it is in flight, so there is nothing to
  // settle or reap here.
  const bool shared_cqs = attached.send_cq != nullptr;
  if (was_connected && !shared_cqs) dp.settle(deadline, *this);
  // After a BYE queued behind the outbox (an engine link), nothing more: a blocking send here
  // would wait on a peer that does not read.
  if (was_connected && control && !control_gone && !bye_queued && send_errno == 0) {
    try {
      send_control(wire::MessageType::bye, {}, std::max(deadline, Clock::now() + std::chrono::milliseconds{100}));
    } catch (const std::exception&) {
      // The peer is already gone; nothing to tell it.
    }
  }
  const std::uint32_t outstanding_at_close = dp.outstanding();
  const std::uint32_t left = dp.shut(shared_cqs ? Clock::now() : Clock::now() + std::chrono::milliseconds{1000});
  if (left > 0) {
    log(fmt::format("close: {} work requests never completed on QP {:#x}; releasing anyway", left,
                    info.local.qpn));
  }
  if (!qps.empty() || soft_qp) {
    detail::emit(cfg.trace, [&] {
      return TraceEvent{"closed",
                        {{"peer", info.peer_address},
                         {"qp", fmt::format("{:#x}", info.local.qpn)},
                         {"flushed", outstanding_at_close > 0 ? "yes" : "no"},
                         {"flushed_requests", std::to_string(outstanding_at_close)},
                         {"never_completed", std::to_string(left)},
                         {"unobservable_qps", std::to_string(dp.unobservable())},
                         {"peer_said_bye", bye_received ? "yes" : "no"}}};
    });
  }
  // Release order: the QPs first, so no QP is left that could touch the memory; then the
  // regions' registrations (revocation: no rkey of this connection works any more).
  dp.forget_qps();
  qps.clear();
  soft_qp.reset();  // its streams close: the peer's side fails as on RC
  // No event of ours can be delivered any more (and a new QP at a freed address is not ours).
  if (dev) dev->device->unsubscribe(this);
  for (MemoryRegion& r : regions) MemoryRegion::Impl::deregister(r);
  control.reset();
}

const char* to_string(ConnectMethod m) noexcept { return m == ConnectMethod::rdma_cm ? "rdma_cm" : "tcp"; }

ConnectMethod parse_connect_method(std::string_view text) {
  if (text == "tcp") return ConnectMethod::tcp;
  if (text == "rdma_cm" || text == "cm") return ConnectMethod::rdma_cm;
  throw Error("connection method", EINVAL, fmt::format("'{}': tcp or rdma_cm", text));
}

Connection::Connection(std::unique_ptr<Impl> impl) noexcept : impl_(std::move(impl)) {}
Connection::Connection(Connection&&) noexcept = default;
Connection& Connection::operator=(Connection&&) noexcept = default;
Connection::~Connection() = default;

const MemoryRegion& Connection::register_memory(void* addr, std::size_t length, Access access) {
  impl_->charge(length);
  impl_->regions.push_back(MemoryRegion::Impl::wrap(detail::register_region(impl_->dev, addr, length, access)));
  return impl_->regions.back();
}

const MemoryRegion& Connection::allocate_memory(std::size_t length, Access access) {
  return allocate_memory(length, access, MemorySpec{});
}

const MemoryRegion& Connection::allocate_memory(std::size_t length, Access access, const MemorySpec& spec) {
  impl_->charge(length);
  impl_->regions.push_back(MemoryRegion::Impl::wrap(detail::allocate_region(impl_->dev, length, access, spec)));
  return impl_->regions.back();
}

void Connection::revoke(const MemoryRegion& region) noexcept {
  for (MemoryRegion& r : impl_->regions) {
    if (&r == &region) MemoryRegion::Impl::deregister(r);
  }
  // The advertised list is the peer's view at the handshake; it stays as sent.
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
const std::string& Connection::failure() const noexcept { return impl_->dp.failure(); }

void Connection::close(std::chrono::milliseconds timeout) noexcept {
  if (impl_) impl_->close(timeout);
}

}  // namespace rdmakit
