// SPDX-License-Identifier: Apache-2.0
#include "options.hpp"

#include <CLI/CLI.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace rdmakit::tools {

void ConnectOptions::add_to(CLI::App& app) {
  listen_opt = app.add_option("--listen", listen, "serve on [ADDR:]PORT (default port 12025)")
                   ->expected(0, 1);
  connect_opt = app.add_option("--connect", connect, "connect to HOST[:PORT] (default port 12025)");
  listen_opt->excludes(connect_opt);
  app.add_option("-d,--device", device,
                 "RDMA device (default: the route's: a port with a GID of the local address the route to the "
                 "peer takes, else the RDMA device of the netdev holding it (IPoIB too), else the first with an "
                 "ACTIVE port; the output says which)");
  app.add_option("--ib-port", ib_port, "device port (default: the one the route names, else the first ACTIVE one)");
  fabric.add_to(app);
  app.add_option("--timeout", timeout_ms,
                 "deadline in ms for the handshake (a refused connect is retried until then) and "
                 "for each operation")
      ->check(CLI::Range(1u, 3'600'000u))
      ->capture_default_str();
  app.add_option("--cm", method,
                 "how to connect: tcp (rdmakit's TCP bootstrap) or rdma_cm (the RDMA connection "
                 "manager resolves address, route, device and GID; ports are rdma_cm ports); both "
                 "sides the same")
      ->check(CLI::IsMember({"tcp", "rdma_cm", "cm"}))
      ->capture_default_str();
  app.add_option("--psk-file", psk_file,
                 "pre-shared key (a file of at least 16 bytes, mode 600): both sides prove they know "
                 "it before any connection parameter or key is exchanged");
  add_trace_flag(app, trace);
}

void FabricOptions::add_to(CLI::App& app) {
  app.add_option("-g,--gid", gid,
                 "source GID: a table index or an IP address (default: the route's local address, else RoCE v2 "
                 "IPv4 first)");
  app.add_option("--traffic-class", traffic_class,
                 "GRH traffic class of every packet (RoCE v2: the IP TOS byte, DSCP << 2 | ECN; e.g. 106 for DSCP 26 "
                 "with ECT(0)); 0: the device's default")
      ->check(CLI::Range(0u, 255u));
  app.add_option("--sl", service_level, "service level (InfiniBand SL; RoCE: the VLAN priority the driver maps it to)")
      ->check(CLI::Range(0u, 15u));
  app.add_option("--pkey-index", pkey_index, "P_Key table index (InfiniBand partition); 0: the default")
      ->check(CLI::Range(0u, 65535u));
  app.add_option("--ack-timeout", ack_timeout_ms,
                 "ms to wait for an ACK before retransmitting; with --retry-count it bounds how long a dead peer takes "
                 "to be noticed (ack timeout x (retries + 1))")
      ->check(CLI::Range(1u, 8'000'000u))
      ->capture_default_str();
  app.add_option("--retry-count", retry_count, "retransmissions before the link fails")
      ->check(CLI::Range(0u, 7u))
      ->capture_default_str();
}

void FabricOptions::apply(ConnectionConfig& cfg) const {
  cfg.gid = GidSelector::parse(gid);
  cfg.traffic_class = static_cast<std::uint8_t>(traffic_class);
  cfg.service_level = static_cast<std::uint8_t>(service_level);
  cfg.pkey_index = static_cast<std::uint16_t>(pkey_index);
  cfg.ack_timeout = std::chrono::milliseconds{ack_timeout_ms};
  cfg.retry_count = static_cast<std::uint8_t>(retry_count);
}

void add_trace_flag(CLI::App& app, bool& trace) {
  app.add_flag("--trace", trace,
               "log each connection event, QP transition (every attribute of both sides) and error "
               "completion to standard error (JSON lines with --json); RDMAKIT_TRACE=1 does the "
               "same for any program using the library");
}


namespace {

// "host" -> "host:12025", "fe80::1" -> "[fe80::1]:12025"; an address that has a port keeps it.
std::string with_default_port(const std::string& s) {
  const bool bracketed = !s.empty() && s.front() == '[';
  const bool has_port = bracketed ? s.find("]:") != std::string::npos
                                  : s.find(':') != std::string::npos && s.find(':') == s.rfind(':');
  if (has_port) return s;
  if (bracketed) return fmt::format("{}:{}", s, kDefaultPort);
  if (s.find(':') != std::string::npos) return fmt::format("[{}]:{}", s, kDefaultPort);
  return fmt::format("{}:{}", s, kDefaultPort);
}

}  // namespace

bool ConnectOptions::serving() const { return listen_opt != nullptr && listen_opt->count() > 0; }

std::string ConnectOptions::connect_target() const { return with_default_port(connect); }

std::string ConnectOptions::listen_address() const {
  if (listen.empty()) return std::to_string(kDefaultPort);
  if (listen.find_first_not_of("0123456789") == std::string::npos) return listen;  // a bare port
  return with_default_port(listen);
}

ConnectionConfig ConnectOptions::config() const {
  ConnectionConfig cfg;
  cfg.method = parse_connect_method(method);
  cfg.device = device;
  cfg.port = static_cast<std::uint8_t>(ib_port);
  fabric.apply(cfg);
  cfg.handshake_timeout = timeout();
  // A server started at the same moment (a script, a job launcher) may not listen yet.
  cfg.retry_refused = true;
  if (trace) cfg.trace = trace_to_stderr(trace_json);
  if (!psk_file.empty()) cfg.psk = read_key_file(psk_file);
  return cfg;
}

std::string describe(const ConnectionInfo& i) {
  const auto& l = i.local;
  const auto& r = i.remote;
  return fmt::format(
      "  peer        {} (over {})\n"
      "  device      {} port {} ({}): {}\n"
      "  local GID   [{}] {} {} ({})\n"
      "  remote GID  [{}] {} {}\n"
      "  path MTU    {} (local active {}, remote active {})\n"
      "  fabric      traffic class {}, SL {}, P_Key index {}, ACK timeout {:.1f} ms x {} tries\n"
      "  local QP    QPN {:#08x} PSN {:#08x}\n"
      "  remote QP   QPN {:#08x} PSN {:#08x}\n",
      i.peer_address, to_string(i.method), i.device, i.port, to_string(i.link_layer), i.device_reason, l.gid_index, i.local_gid.address(),
      to_string(l.gid_type), i.gid_reason, r.gid_index,
      GidEntry{r.gid_index, r.gid_type, r.gid, {}}.address(), to_string(r.gid_type), i.path_mtu,
      i.local_mtu, i.remote_mtu, i.traffic_class, i.service_level, i.pkey_index,
      static_cast<double>(i.ack_timeout.count()) / 1000.0, i.retry_count + 1, l.qpn, l.psn, r.qpn, r.psn);
}

void require_role(const ConnectOptions& net, const char* command) {
  if (!net.serving() && net.connect.empty()) {
    throw CLI::ValidationError(command, "give --listen [ADDR:]PORT or --connect HOST:PORT");
  }
}

std::function<int()> guarded(std::string name, std::function<int()> body) {
  return [name = std::move(name), body = std::move(body)] {
    try {
      return body();
    } catch (const Fail& e) {
      fmt::print(stderr, "rdmakit {}: {}\n", name, e.what());
      return 1;
    } catch (const nlohmann::json::exception& e) {
      fmt::print(stderr, "rdmakit {}: bad message from the peer: {}\n", name, e.what());
      return 1;
    }
  };
}

}  // namespace rdmakit::tools
