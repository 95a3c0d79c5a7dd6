// SPDX-License-Identifier: Apache-2.0
// The listener's side of the handshake on an accepted socket: (authenticate) -> client HELLO ->
// build QPs on the route the client came in by -> Setup -> RTS -> server HELLO -> READY.
// Each side is in RTS before the other may post to it, and a malformed HELLO is refused before
// the server spends any device resource on it.
#include <sys/random.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "bootstrap/auth.hpp"
#include "connection/handshake.hpp"
#include "connection/impl.hpp"
#include "rdmakit/error.hpp"
#include "transport/shm/host.hpp"
#include "transport/shm/ring.hpp"
#include "transport/shm/stream.hpp"

namespace rdmakit {

using detail::Deadline;

std::optional<Connection> Connection::Impl::accept(std::unique_ptr<detail::Channel> channel, const std::string& peer, const ConnectionConfig& config,
                                    std::shared_ptr<const detail::Secret> key, const Setup& setup,
                                    std::shared_ptr<void> admission, std::shared_ptr<detail::PinBudget> budget,
                                    const detail::HandshakeHooks& hooks) {
  detail::Channel& ch = *channel;
  const Deadline deadline = detail::deadline_in(config.handshake_timeout);
  wire::EndpointInfo remote;
  std::unique_ptr<detail::Session> session;
  // Every failure, whatever threw it (an Error, a Setup's own exception, bad_alloc), ends in a
  // REJECT that says why: the client never sees a bare EOF.
  std::optional<wire::LinkTransport> soft;  // an engine link of the tcp or shm transport
  std::string why;
  std::uint8_t engine_protocol = 0;
  try {
    // From here on the channel speaks the client's version (recv_message took it from the first
    // header, if this side speaks it; a refusal of any other goes in this side's own).
    detail::Message first = detail::recv_message(ch, deadline);
    if (first.header.type == wire::MessageType::stream) {
      // A data stream of a tcp or shm link whose handshake runs on another thread: handed to
      // it by the token its sealed HELLO carried (a stream with any other goes).
      auto* tcp = dynamic_cast<detail::TcpChannel*>(&ch);
      if (!hooks.streams || tcp == nullptr) throw Error("bootstrap", EPROTO, "a data stream to a listener that is not an engine's");
      detail::Fd fd = tcp->take();
      const int pid = detail::peer_pid(fd.get());  // a local socket's (shm): the kernel's word
      if (!hooks.streams->deliver(wire::decode_stream(first.payload), fd, pid)) {
        throw Error("data stream", EACCES, "its token is no link's in its handshake here (stale, repeated or forged)");
      }
      return std::nullopt;
    }
    if (key) {
      // Nothing about this side crosses the wire before the client has proven the key, and
      // after that, nothing in the clear: a HELLO that is not sealed was not sent by the client
      // that proved it.
      session = detail::authenticate_server(ch, key->bytes(), first, deadline, peer);
      first = detail::recv_control(ch, session.get(), deadline, peer);
    } else if (first.header.type == wire::MessageType::auth_challenge) {
      throw Error("bootstrap authentication", EACCES,
                  fmt::format("{} asked to authenticate, but this listener has no pre-shared key", peer),
                  "give both sides the same key");
    }
    detail::expect(first, wire::MessageType::hello, peer);
    remote = wire::decode_hello(first.payload, ch.version());
    if (remote.transport) {
      if (hooks.transports.empty()) {
        throw Error("bootstrap handshake", EPROTO, "the peer offers transports (an engine's link) to a listener that is not an engine's");
      }
      engine_protocol = Impl::agree_engine_protocol(hooks, *remote.transport, /*server=*/true);
      const auto k = choose_transport(hooks, *remote.transport, why);
      if (!k) {
        throw Error("transport", EPROTONOSUPPORT, fmt::format("no transport both engines offer and can use: {}", why),
                    hooks.transports_note);
      }
      if (*k != wire::LinkTransport::rdma) soft = *k;
    } else if (!hooks.transports.empty() &&
               std::find(hooks.transports.begin(), hooks.transports.end(), wire::LinkTransport::rdma) == hooks.transports.end()) {
      // A HELLO without a transport block is RDMA's (a plain Connection, a tool).
      throw Error("transport", EPROTONOSUPPORT, "the peer offers rdma only (a plain connection), and this engine does not offer it",
                  hooks.transports_note);
    } else {
      engine_protocol = hooks.engine_protocol_max;  // an engine's listener: what its IDENT must be in
    }
  } catch (const std::exception& e) {
    detail::send_reject(ch, session.get(), e.what());
    throw;
  }
  if (soft) return accept_soft(std::move(channel), peer, config, std::move(key), std::move(session), std::move(admission),
                               std::move(budget), hooks, std::move(remote), *soft, why, deadline, engine_protocol);
  // The client chose how many QPs the connection has.
  ConnectionConfig mine = config;
  mine.qps = static_cast<std::uint32_t>(remote.qp_count());
  std::optional<Connection> conn;
  const char* step = "setup";
  try {
    conn.emplace(wrap(std::make_unique<Impl>(std::move(mine), std::move(key))));
    Impl& m = of(*conn);
    m.hooks = hooks;
    m.admission = std::move(admission);
    m.budget = std::move(budget);
    m.info.peer_address = peer;
    m.info.wire_version = ch.version();
    m.engine_protocol = engine_protocol;
    m.trace_hello("hello_received", remote);
    ch.keepalive(m.cfg.keepalive_interval, m.cfg.keepalive_timeout);
    m.open(ch);
    if (setup) {
      step = "Setup callback";
      setup(*conn);
    }
    step = "QP transitions";
    m.finish(std::move(remote));
  } catch (const std::exception& e) {
    if (conn) of(*conn).trace_failure(step, e);
    const std::string reason = std::string_view(step) == "Setup callback"
                                   ? fmt::format("the server's Setup failed: {}", e.what())
                                   : std::string(e.what());
    detail::send_reject(ch, session.get(), reason);
    throw;
  } catch (...) {
    detail::send_reject(ch, session.get(),
                        fmt::format("the server failed during {} (a non-standard exception)", step));
    throw;
  }
  Impl& m = of(*conn);
  m.control = std::move(channel);
  m.session = std::move(session);
  if (m.info.remote.transport) {  // an engine link over rdma: the server's HELLO says so
    m.info.local.transport.emplace();
    m.info.local.transport->kinds = {wire::LinkTransport::rdma};
    m.info.local.transport->engine_protocol = engine_protocol;
    m.info.transport_reason = why;
  }
  try {
    const auto hello = wire::encode_hello(m.info.local, m.info.wire_version);
    m.send_control(wire::MessageType::hello, std::span(hello).subspan(wire::kHeaderSize), deadline);
    m.trace_hello("hello_sent", m.info.local);
    detail::expect(detail::recv_control(*m.control, m.session.get(), deadline, peer),
                   wire::MessageType::ready, peer);
  } catch (const std::exception& e) {
    m.trace_failure("READY", e);
    throw;
  }
  m.connected();
  return std::move(*conn);
}

Connection Connection::Impl::accept_soft(std::unique_ptr<detail::Channel> channel, const std::string& peer,
                                         const ConnectionConfig& config, std::shared_ptr<const detail::Secret> key,
                                         std::unique_ptr<detail::Session> session, std::shared_ptr<void> admission,
                                         std::shared_ptr<detail::PinBudget> budget, const detail::HandshakeHooks& hooks,
                                         wire::EndpointInfo remote, wire::LinkTransport kind, const std::string& why,
                                         Deadline deadline, std::uint8_t engine_protocol) {
  Connection conn = wrap(std::make_unique<Impl>(config, std::move(key)));
  Impl& m = of(conn);
  m.hooks = hooks;
  m.admission = std::move(admission);
  m.budget = std::move(budget);
  m.info.peer_address = peer;
  m.info.wire_version = channel->version();
  m.engine_protocol = engine_protocol;
  m.trace_hello("hello_received", remote);
  channel->keepalive(m.cfg.keepalive_interval, m.cfg.keepalive_timeout);
  m.control = std::move(channel);
  m.session = std::move(session);
  // The streams present a token only the client's sealed HELLO reply tells (with a key).
  detail::StreamRegistry::Token token{};
  if (::getrandom(token.data(), token.size(), 0) != static_cast<ssize_t>(token.size())) {
    const int err = errno;
    detail::send_reject(*m.control, m.session.get(), "the server could not draw a stream token");
    throw Error("getrandom", err, "a data stream token");
  }
  const bool shm = kind == wire::LinkTransport::shm;
  const auto streams = static_cast<std::uint8_t>(shm ? 1 : hooks.tcp_streams);
  wire::EndpointInfo& mine = m.info.local;
  mine.transport.emplace();  // nothing of this process: the choice, and where the streams go
  mine.transport->kinds = {kind};
  mine.transport->engine_protocol = engine_protocol;
  mine.transport->token = token;
  mine.transport->streams = streams;
  if (shm) mine.transport->socket = hooks.shm_socket;
  const char* step = "link";
  try {
    // Its room in a worker's CQ and a QP of the budget first: a busy engine says so before the
    // client opens any stream.
    m.attached = hooks.attach_soft(kind);
    step = "HELLO";
    hooks.streams->expect(token, streams);
    m.info.transport = wire::to_string(kind);
    m.info.transport_reason = why;
    const auto hello = wire::encode_hello(mine, m.info.wire_version);
    m.send_control(wire::MessageType::hello, std::span(hello).subspan(wire::kHeaderSize), deadline);
    m.trace_hello("hello_sent", mine);
    step = "data streams";
    int pid = 0;
    std::vector<detail::Fd> fds = hooks.streams->wait(token, deadline, peer, &pid, hooks.stop.get());
    step = "link";
    m.info.remote = std::move(remote);
    // shm: the process the kernel names at the local socket's other end, proven to hold this
    // session, is the one this side copies from and to (never the pid the HELLO claims). A
    // client that offers no proof (its address 0) sends its ring instead, after its STREAM
    // message: this side then copies only between that ring and its windows.
    std::shared_ptr<detail::shm::Ring> ring;
    const bool by_ring = shm && m.info.remote.transport->proof_addr == 0;
    if (by_ring) {
      ring = detail::shm::take_ring(fds[0].get(), deadline, hooks.stop.get());
    } else if (shm) {
      detail::shm::verify(*m.info.remote.transport, pid, m.session.get());
    }
    m.open_soft(kind, std::move(fds), shm && !by_ring ? pid : 0, false, std::move(ring));
    m.info.transport_reason = why;
    if (shm) {
      m.info.transport_reason += by_ring ? "; through the initiator's shared ring (two copies)"
                                         : "; this side copies by cross-memory attach (one copy)";
      const bool shares = hooks.shm_shares_from != 0 && m.engine_protocol >= hooks.shm_shares_from;
      m.info.transport_reason += shares ? "; what memory the initiator shares (engine protocol 8), this side maps and copies once"
                                        : fmt::format("; no memory mapped (engine protocol {})", m.engine_protocol);
    }
    // The link is whole here: READY tells the client (which waits for it, not the other way
    // round as on RDMA, where the client's QP is the last to be ready).
    step = "READY";
    m.send_control(wire::MessageType::ready, {}, deadline);
  } catch (const std::exception& e) {
    hooks.streams->forget(token);
    m.trace_failure(step, e);
    if (std::string_view(step) != "READY") detail::send_reject(*m.control, m.session.get(), e.what());
    throw;
  }
  m.connected();
  return conn;
}

}  // namespace rdmakit
