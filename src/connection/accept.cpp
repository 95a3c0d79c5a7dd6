// The listener's side of the handshake on an accepted socket: (authenticate) -> client HELLO ->
// build QPs on the route the client came in by -> Setup -> RTS -> server HELLO -> READY.
// Each side is in RTS before the other may post to it, and a malformed HELLO is refused before
// the server spends any device resource on it.
#include <cerrno>

#include <fmt/format.h>

#include "bootstrap/auth.hpp"
#include "connection/handshake.hpp"
#include "connection/impl.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

using detail::Deadline;

Connection Connection::Impl::accept(std::unique_ptr<detail::Channel> channel, const std::string& peer, const ConnectionConfig& config,
                                    std::shared_ptr<const detail::Secret> key, const Setup& setup,
                                    std::shared_ptr<void> admission, std::shared_ptr<detail::PinBudget> budget,
                                    const detail::HandshakeHooks& hooks) {
  detail::Channel& ch = *channel;
  const Deadline deadline = detail::deadline_in(config.handshake_timeout);
  wire::EndpointInfo remote;
  std::unique_ptr<detail::Session> session;
  // Every failure, whatever threw it (an Error, a Setup's own exception, bad_alloc), ends in a
  // REJECT that says why: the client never sees a bare EOF.
  try {
    detail::Message first = detail::recv_message(ch, deadline);
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
    remote = wire::decode_hello(first.payload);
  } catch (const std::exception& e) {
    detail::send_reject(ch, session.get(), e.what());
    throw;
  }
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
    const std::string why = std::string_view(step) == "Setup callback"
                                ? fmt::format("the server's Setup failed: {}", e.what())
                                : std::string(e.what());
    detail::send_reject(ch, session.get(), why);
    throw;
  } catch (...) {
    detail::send_reject(ch, session.get(),
                        fmt::format("the server failed during {} (a non-standard exception)", step));
    throw;
  }
  Impl& m = of(*conn);
  m.control = std::move(channel);
  m.session = std::move(session);
  try {
    const auto hello = wire::encode_hello(m.info.local);
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

}  // namespace rdmakit
