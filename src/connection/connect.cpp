// The client's side of the handshake: TCP or rdma_cm connect -> (authenticate) -> open the device on the
// route the kernel chose -> Setup -> HELLO exchange -> RTS -> READY.
#include <sys/random.h>

#include <cerrno>
#include <thread>

#include <fmt/format.h>

#include "bootstrap/auth.hpp"
#include "cm/cm.hpp"
#include "connection/handshake.hpp"
#include "connection/impl.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

using detail::Clock;
using detail::Deadline;

namespace {

std::chrono::milliseconds jitter(int base_ms, int spread_ms) {
  std::uint32_t v = 0;
  if (::getrandom(&v, sizeof v, GRND_NONBLOCK) != sizeof v) v = 0;
  return std::chrono::milliseconds{base_ms + static_cast<int>(v % static_cast<std::uint32_t>(spread_ms))};
}

}  // namespace

Connection Connection::connect(const std::string& host_port, const ConnectionConfig& config,
                               const Setup& setup) {
  return Impl::connect(host_port, config, setup, {});
}

Connection Connection::Impl::connect(const std::string& host_port, const ConnectionConfig& config,
                                     const Setup& setup, const detail::HandshakeHooks& hooks) {
  const Deadline deadline = detail::deadline_in(config.handshake_timeout);
  const detail::HostPort to = detail::parse_host_port(host_port, 0);
  if (to.port == 0) {
    throw Error("connect", EINVAL, fmt::format("'{}' has no port (host:port)", host_port));
  }
  Connection conn = wrap(std::make_unique<Impl>(config));
  Impl& m = of(conn);
  m.hooks = hooks;
  m.info.peer_address = to.to_string();
  const char* step = "setup";
  try {
    detail::Message reply;
    // A listener at its limits answers "busy": like a refused connect, that is worth retrying
    // until the deadline when the caller asked for retries (the QPs and HELLO are reused).
    for (;;) {
      try {
        if (config.method == ConnectMethod::rdma_cm) {
          step = "rdma_cm connect";
          m.control = detail::cm_connect(to, {config.ack_timeout, config.retry_count, config.rnr_timer}, deadline, config.retry_refused);
        } else {
          step = "TCP connect";
          m.control = std::make_unique<detail::TcpChannel>(detail::tcp_connect(to, deadline, config.retry_refused));
        }
        m.set_keepalive();
        m.session.reset();
        if (m.psk) {
          step = "authentication";
          m.session = detail::authenticate_client(*m.control, m.psk->bytes(), deadline, m.info.peer_address);
        }
        if (m.qps.empty()) {
          // The device, port and GID follow the route the kernel picked for the control
          // channel: the CM's resolution, or the TCP socket's own address (on that netdev).
          step = "setup";
          m.open(*m.control);
          if (setup) setup(conn);
        }
        step = "HELLO exchange";
        const auto hello = wire::encode_hello(m.info.local);
        m.send_control(wire::MessageType::hello, std::span(hello).subspan(wire::kHeaderSize), deadline);
        m.trace_hello("hello_sent", m.info.local);
        reply = detail::recv_control(*m.control, m.session.get(), deadline, m.info.peer_address);
        detail::expect(reply, wire::MessageType::hello, m.info.peer_address);
        break;
      } catch (const Error& e) {
        const bool busy = std::string_view(e.what()).find(detail::kBusyReason) != std::string_view::npos;
        if (!busy || !config.retry_refused || Clock::now() + std::chrono::milliseconds{100} >= deadline) throw;
        m.control.reset();
        std::this_thread::sleep_for(jitter(50, 100));
      }
    }
    step = "QP transitions";
    try {
      wire::EndpointInfo remote = wire::decode_hello(reply.payload);
      m.trace_hello("hello_received", remote);
      m.finish(std::move(remote));
    } catch (const std::exception& e) {
      detail::send_reject(*m.control, m.session.get(), e.what());
      throw;
    }
    step = "READY";
    m.send_control(wire::MessageType::ready, {}, deadline);
  } catch (const std::exception& e) {
    m.trace_failure(step, e);
    throw;
  }
  m.connected();
  return conn;
}

}  // namespace rdmakit
