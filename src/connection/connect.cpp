// SPDX-License-Identifier: Apache-2.0
// The client's side of the handshake: TCP or rdma_cm connect -> (authenticate) -> open the device on the
// route the kernel chose -> Setup -> HELLO exchange -> RTS -> READY.
#include <sys/random.h>

#include <algorithm>
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
  const bool engine_link = !hooks.transports.empty();
  const bool offers_rdma = !engine_link || std::find(hooks.transports.begin(), hooks.transports.end(),
                                                     wire::LinkTransport::rdma) != hooks.transports.end();
  try {
    detail::Message reply;
    // This side speaks its version first; a server of the previous one refuses it and is
    // connected again, once, in that (wire.hpp, "Versions").
    std::uint16_t speak = wire::kVersion;
    // A refusal of this side's version is believed on the first try only, and a server that says
    // it is newer after that is tried once more in this side's version: two switches at most, so
    // a forged refusal costs a connection, never a downgrade, and a mixed fleet behind one
    // address still links.
    int switches = 0;
    // A listener at its limits answers "busy": like a refused connect, that is worth retrying
    // until the deadline when the caller asked for retries (the QPs and HELLO are reused).
    for (;;) {
      try {
        if (config.method == ConnectMethod::rdma_cm) {
          step = "rdma_cm connect";
          m.control = detail::cm_connect(to, {config.ack_timeout, config.retry_count, config.rnr_timer}, deadline, config.retry_refused, hooks.stop);
        } else {
          step = "TCP connect";
          m.control = std::make_unique<detail::TcpChannel>(detail::tcp_connect(to, deadline, config.retry_refused, hooks.stop.get()));
        }
        m.control->set_stop(hooks.stop);  // cleared once connected
        m.control->set_version(speak);
        m.info.wire_version = speak;
        m.set_keepalive();
        m.session.reset();
        if (m.psk) {
          step = "authentication";
          m.session = detail::authenticate_client(*m.control, m.psk->bytes(), deadline, m.info.peer_address);
        }
        if (m.qps.empty() && offers_rdma) {
          // The device, port and GID follow the route the kernel picked for the control
          // channel: the CM's resolution, or the TCP socket's own address (on that netdev).
          step = "setup";
          m.open(*m.control);
          if (setup) setup(conn);
        }
        step = "HELLO exchange";
        if (engine_link) {
          // An engine link: the transports this side offers, best first; the server chooses.
          m.info.local.transport.emplace();
          m.info.local.transport->kinds = hooks.transports;
          m.info.local.transport->engine_protocol = hooks.engine_protocol_max;
          // Where this process runs and its proof, only for a server that may take shm (none
          // when its data goes through a ring: the proof's address 0 says so).
          if (m.info.local.transport->has(wire::LinkTransport::shm)) {
            m.info.local.transport->host = hooks.self.host;
            m.info.local.transport->pid = hooks.self.pid;
            if (!hooks.shm_ring) m.prove_host(*m.info.local.transport);
          }
        }
        const auto hello = wire::encode_hello(m.info.local, speak);
        m.send_control(wire::MessageType::hello, std::span(hello).subspan(wire::kHeaderSize), deadline);
        m.trace_hello("hello_sent", m.info.local);
        reply = detail::recv_control(*m.control, m.session.get(), deadline, m.info.peer_address);
        if (!m.session) detail::check_version_refusal(*m.control, reply, m.info.peer_address);
        detail::expect(reply, wire::MessageType::hello, m.info.peer_address);
        break;
      } catch (const detail::VersionRefused& e) {
        if (switches != 0 || !wire::speaks(e.version)) throw;
        m.log(fmt::format("{} runs the previous rdmakit (wire version {}): connecting again in it", m.info.peer_address,
                          e.version));
        speak = e.version;
        ++switches;
        m.control.reset();
      } catch (const detail::NewerServer& e) {
        if (switches != 1) throw;
        m.log(fmt::format("{}; connecting again in wire version {}", e.what(), wire::kVersion));
        speak = wire::kVersion;
        ++switches;
        m.control.reset();
      } catch (const Error& e) {
        const bool busy = std::string_view(e.what()).find(detail::kBusyReason) != std::string_view::npos;
        if (!busy || !config.retry_refused || Clock::now() + std::chrono::milliseconds{100} >= deadline) throw;
        m.control.reset();
        std::this_thread::sleep_for(jitter(50, 100));
      }
    }
    step = "QP transitions";
    try {
      wire::EndpointInfo remote = wire::decode_hello(reply.payload, speak);
      m.trace_hello("hello_received", remote);
      const wire::LinkTransport chosen = engine_link ? m.chosen_transport(remote) : wire::LinkTransport::rdma;
      if (chosen == wire::LinkTransport::rdma) {
        m.finish(std::move(remote));
      } else {
        step = "data streams";
        m.open_streams(to, std::move(remote), chosen, deadline);
      }
    } catch (const std::exception& e) {
      detail::send_reject(*m.control, m.session.get(), e.what());
      throw;
    }
    step = "READY";
    if (m.soft_qp) {
      // A tcp or shm link: the server says when its side (its streams, its queue pair) is whole.
      detail::expect(detail::recv_control(*m.control, m.session.get(), deadline, m.info.peer_address),
                     wire::MessageType::ready, m.info.peer_address);
    } else {
      m.send_control(wire::MessageType::ready, {}, deadline);
    }
  } catch (const std::exception& e) {
    m.trace_failure(step, e);
    throw;
  }
  m.connected();
  return conn;
}

}  // namespace rdmakit
