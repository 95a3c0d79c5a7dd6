// SPDX-License-Identifier: Apache-2.0
// An engine link of the tcp or shm transport: the server's choice among the transports the
// client offers, the data streams a link's handshake waits for, and the link's software queue
// pair (src/transport/soft/) with the data path on it: its streams opened by its transport
// (src/transport/tcp/, src/transport/shm/), and shm's crossing.
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <sodium.h>

#include <fmt/format.h>

#include "connection/impl.hpp"
#include "rdmakit/error.hpp"
#include "transport/shm/crossing.hpp"
#include "transport/shm/host.hpp"
#include "transport/shm/ring.hpp"
#include "transport/shm/stream.hpp"
#include "transport/tcp/streams.hpp"
#include "transport/soft/device.hpp"

namespace rdmakit {

namespace detail {

void StreamRegistry::expect(const Token& token, std::uint32_t n) {
  std::lock_guard lock(mu_);
  Pending& p = pending_[token];
  p.fds.clear();
  p.fds.resize(n);
  p.pids.assign(n, 0);
  p.got = 0;
}

bool StreamRegistry::deliver(const wire::StreamHello& hello, Fd& fd, int pid) {
  {
    std::lock_guard lock(mu_);
    const auto it = pending_.find(hello.token);
    if (it == pending_.end() || hello.index >= it->second.fds.size() || it->second.fds[hello.index]) return false;
    it->second.fds[hello.index] = std::move(fd);
    it->second.pids[hello.index] = pid;
    ++it->second.got;
  }
  cv_.notify_all();
  return true;
}

std::vector<Fd> StreamRegistry::wait(const Token& token, Deadline deadline, const std::string& peer, int* pid,
                                      const Stop* stop) {
  std::unique_lock lock(mu_);
  const auto it = pending_.find(token);
  if (it == pending_.end()) throw Error("data streams", EINVAL, "no handshake waits for them");
  const auto whole = [&] { return it->second.got == it->second.fds.size(); };
  // In slices of 100 ms when a stop may end it (nothing notifies this condition of a stop).
  bool all = whole();
  while (!all && Clock::now() < deadline && (stop == nullptr || !stop->requested())) {
    all = cv_.wait_until(lock, stop == nullptr ? deadline : std::min(deadline, deadline_in(std::chrono::milliseconds{100})), whole);
  }
  if (!all && stop != nullptr && stop->requested()) {
    pending_.erase(it);
    throw stopped_error("data streams");
  }
  const std::size_t want = it->second.fds.size(), got = it->second.got;
  std::vector<Fd> fds = std::move(it->second.fds);
  if (pid != nullptr) *pid = it->second.pids.empty() ? 0 : it->second.pids[0];
  pending_.erase(it);
  if (!all) {
    throw Error("data streams", ETIMEDOUT,
                fmt::format("{} of the {} data streams {} was to open came by the handshake deadline", got, want, peer),
                "a firewall between the hosts that lets the control connection through but not more "
                "connections to the same port, or the peer is overloaded");
  }
  return fds;
}

void StreamRegistry::forget(const Token& token) noexcept {
  std::lock_guard lock(mu_);
  pending_.erase(token);
}

}  // namespace detail

std::optional<wire::LinkTransport> Connection::Impl::choose_transport(const detail::HandshakeHooks& hooks,
                                                                      const wire::TransportBlock& offer, std::string& why) {
  // The first the client prefers that this side offers and can use: the client's order wins.
  std::string passed;
  for (const wire::LinkTransport k : offer.kinds) {
    const char* name = wire::to_string(k);
    std::string no;
    if (std::find(hooks.transports.begin(), hooks.transports.end(), k) == hooks.transports.end()) {
      no = "this engine does not offer it";
    } else if (k == wire::LinkTransport::shm && (offer.host != hooks.self.host || hooks.shm_socket.empty())) {
      no = "not on this host as this engine sees it (another host, container, PID or network namespace, or user)";
    } else if (k == wire::LinkTransport::shm && offer.proof_addr != 0 && !hooks.shm_no_attach.empty()) {
      no = fmt::format("the initiator asks for cross-memory attach (its shm_copy), and here {}", hooks.shm_no_attach);
    }
    if (no.empty()) {
      why = passed.empty() ? fmt::format("{}: the initiator's first choice, offered here too", name)
                           : fmt::format("{}: the initiator's first choice this engine can take ({})", name, passed);
      return k;
    }
    passed += fmt::format("{}{} not: {}", passed.empty() ? "" : "; ", name, no);
  }
  why = passed;
  return std::nullopt;
}

void Connection::Impl::prove_host(wire::TransportBlock& t) { detail::shm::prove(shm_proof, t, session.get()); }

void Connection::Impl::open_soft(wire::LinkTransport kind, std::vector<detail::Fd> streams, int peer_pid, bool cma,
                                 std::shared_ptr<detail::shm::Ring> ring, bool give_shares) {
  if (!hooks.attach_soft) throw Error("link", EINVAL, "a tcp or shm link outside an engine");
  // QPs built in case the choice was rdma go (with their room in the worker's CQ).
  if (!qps.empty()) {
    dp.forget_qps();
    qps.clear();
    if (dev) dev->device->unsubscribe(this);
    for (MemoryRegion& r : regions) MemoryRegion::Impl::deregister(r);
    regions.clear();
  }
  if (attached.soft_cq == nullptr) {
    attached = detail::Attachment{};  // the RDMA attachment's CQ room and QP of the budget go first
    attached = hooks.attach_soft(kind);
  }
  dev.reset();
  detail::soft::QpConfig qc;
  qc.send_depth = cfg.send_depth;
  std::uint32_t qpn = 0;
  if (::getrandom(&qpn, sizeof qpn, GRND_NONBLOCK) != sizeof qpn) qpn = 0;
  qc.qp_num = (qpn & 0xffffffu) | 1u;  // a name for messages only
  // As an RC QP gives up on a peer that stops answering: its ACK timeout times its retries.
  qc.stall_timeout = std::max(std::chrono::milliseconds{500}, timeouts.ack_timeout * (timeouts.retry_count + 1));
  // What fails the queue pair on its own (a stream that broke, garbage) breaks the link, as a
  // device event does on RDMA: recorded here, acted on by the link's own thread (pump_async).
  qc.on_fault = [this](const std::string& why) {
    std::lock_guard lock(device_mu);
    if (device_failure.empty()) device_failure = fmt::format("its {} data stream failed: {}", info.transport, why);
    device_failed.store(true, std::memory_order_release);
  };
  std::unique_ptr<detail::soft::Crossing> crossing;
  if (kind == wire::LinkTransport::shm) {
    detail::shm::CrossingConfig cc;
    cc.asks = cma;
    cc.peer_pid = peer_pid;
    cc.ring = std::move(ring);
    // Engine protocol 8: the side that asks may hand the other its memory to map (only to a
    // process of its own user), the side that serves maps what it is handed.
    const bool maps = hooks.shm_shares_from != 0 && engine_protocol >= hooks.shm_shares_from;
    cc.shares = maps && cma && give_shares;
    cc.takes_shares = maps && !cma;
    crossing = std::make_unique<detail::shm::Crossing>(*attached.soft_dev, std::move(cc));
  }
  const std::string name = wire::to_string(kind);
  soft_qp = std::make_unique<detail::soft::Qp>(*attached.soft_dev, *attached.soft_cq, std::move(qc), std::move(streams),
                                               std::move(crossing));
  info.transport = name;
  info.device = name;
  info.port = 1;
  info.max_msg_size = 1u << 30;
  info.max_inline = 0;
  info.max_sge = 1;
  info.send_depth = cfg.send_depth;
  info.recv_depth = cfg.recv_depth;
  info.qps = 1;
  info.path_mtu = info.local_mtu = info.remote_mtu = 0;
  info.atomics = true;  // the target's CPU does them
  ibv_qp* raw = soft_qp->qp();
  dp.init({cfg.send_depth, cfg.recv_depth, 1, 0, info.max_msg_size, cfg.stripe_min}, {&raw, 1}, attached.soft_cq->cq(),
          attached.soft_cq->cq(), attached.soft_cq->channel(), detail::soft::Device::ops());
  dp.observe(cfg.trace, info.peer_address);
  dp.set_remote({}, true);
}

}  // namespace rdmakit

namespace rdmakit {

std::uint8_t Connection::Impl::agree_engine_protocol(const detail::HandshakeHooks& hooks, const wire::TransportBlock& theirs,
                                                    bool server) {
  const std::uint8_t v = server ? std::min(theirs.engine_protocol, hooks.engine_protocol_max) : theirs.engine_protocol;
  if (v < hooks.engine_protocol_min || v > hooks.engine_protocol_max) {
    throw Error("engine protocol", EPROTONOSUPPORT,
                fmt::format("the peer's engine {} protocol {}; this engine speaks {} to {}",
                            server ? "speaks at most" : "chose", theirs.engine_protocol, hooks.engine_protocol_min,
                            hooks.engine_protocol_max),
                "engine links agree the highest engine protocol both speak (docs/compatibility.md): upgrade the "
                "older engine");
  }
  return v;
}

wire::LinkTransport Connection::Impl::chosen_transport(const wire::EndpointInfo& remote) {
  const auto& offered = hooks.transports;
  if (!remote.transport || remote.transport->kinds.size() != 1 ||
      std::find(offered.begin(), offered.end(), remote.transport->kinds[0]) == offered.end()) {
    throw Error("bootstrap handshake", EPROTO,
                remote.transport ? "the peer chose a transport this side did not offer"
                                 : "the peer's HELLO names no transport: it is not an rdmakit engine of this version",
                "run the same rdmakit version on both engines");
  }
  const wire::LinkTransport k = remote.transport->kinds[0];
  engine_protocol = agree_engine_protocol(hooks, *remote.transport, /*server=*/false);
  std::string before;
  for (const wire::LinkTransport o : offered) {
    if (o == k) break;
    before += fmt::format("{}{}", before.empty() ? "" : ", ", wire::to_string(o));
  }
  info.transport = wire::to_string(k);
  info.transport_reason = before.empty() ? fmt::format("{}: this engine's first choice, taken by the peer", info.transport)
                                         : fmt::format("{}: the peer took none of {} (offered first: it lacks them, or "
                                                       "does not offer them)",
                                                       info.transport, before);
  return k;
}

void Connection::Impl::open_streams(const detail::HostPort& to, wire::EndpointInfo remote, wire::LinkTransport chosen,
                                    detail::Deadline deadline) {
  const wire::TransportBlock& t = *remote.transport;
  if (cfg.method != ConnectMethod::tcp) {
    throw Error("data streams", EPROTONOSUPPORT, "a tcp or shm link bootstraps over TCP (link.method tcp)");
  }
  const bool shm = chosen == wire::LinkTransport::shm;
  if (shm && (t.streams != 1 || t.socket.empty())) {
    throw Error("bootstrap handshake", EPROTO, "the peer chose shm without naming its local socket");
  }
  std::vector<detail::Fd> fds;
  bool own_user = false;  // shm: the process at the stream's other end runs as this one's user
  // shm without cross-memory attach: the ring this side's data goes through, handed to the
  // server right after the stream's STREAM message (it reads one, then the other).
  std::shared_ptr<detail::shm::Ring> ring;
  if (shm && hooks.shm_ring) ring = detail::shm::Ring::create();
  if (shm) {
    detail::shm::OpenedStream s = detail::shm::open_stream(t.socket, t.token, info.wire_version, ring.get(), deadline, hooks.stop.get());
    own_user = s.own_user;
    fds.push_back(std::move(s.fd));
  } else {
    fds = detail::tcp::open_streams(to, t.token, t.streams, info.wire_version, deadline, hooks.stop.get());
  }
  info.remote = std::move(remote);
  std::string reason = std::move(info.transport_reason);
  if (shm) {
    reason += ring ? fmt::format("; through a shared ring (two copies): {}", hooks.shm_ring_why)
                   : std::string("; the peer copies by cross-memory attach (one copy)");
    reason += hooks.shm_shares_from == 0 || engine_protocol < hooks.shm_shares_from
                  ? fmt::format("; the peer maps no memory (engine protocol {})", engine_protocol)
              : !hooks.shm_shares ? "; the peer maps no memory (shm_map is off)"
              : !own_user         ? "; the peer maps no memory (it runs as another user)"
                                  : "; memory the engine allocated, the peer maps and copies once";
  }
  // This side only asks (its frames carry its addresses, or its ring's offsets); it never
  // copies for the peer.
  open_soft(chosen, std::move(fds), 0, shm, std::move(ring), own_user && hooks.shm_shares);
  info.transport_reason = reason;
}

}  // namespace rdmakit
