// SPDX-License-Identifier: Apache-2.0
// rdmakit devices and rdmakit doctor: thin fronts over list_devices() and rdmakit::doctor.
#include "devices.hpp"

#include <CLI/CLI.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "options.hpp"
#include "rdmakit/doctor.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::tools {
namespace {

using json = nlohmann::ordered_json;
using namespace std::chrono_literals;

struct DevicesOptions {
  bool json_out = false;
  bool trace = false;
  std::string gid;
  std::vector<std::string> to;  // --to: show the CM's route to these addresses instead
  unsigned timeout_ms = 3000;
};

// What rdma_cm resolves each address to: the device, port and GID the kernel's route uses.
int run_routes(const DevicesOptions& o) {
  json out = json::array();
  int status = 0;
  for (const std::string& a : o.to) {
    try {
      const RouteInfo r = resolve_route(a, std::chrono::milliseconds{o.timeout_ms});
      out.push_back({{"to", a},
                     {"address", r.address},
                     {"device", r.device},
                     {"port", r.port},
                     {"source", r.source},
                     {"gid_index", r.gid_index},
                     {"source_gid", r.source_gid},
                     {"dest_gid", r.dest_gid},
                     {"path_mtu", r.path_mtu},
                     {"hop_limit", r.hop_limit},
                     {"traffic_class", r.traffic_class}});
    } catch (const Error& e) {
      out.push_back({{"to", a}, {"error", e.what()}});
      status = 1;
    }
  }
  if (o.json_out) {
    fmt::print("{}\n", json{{"routes", out}}.dump(2));
    return status;
  }
  for (const auto& r : out) {
    if (r.contains("error")) {
      fmt::print("route to {}: {}\n", r["to"].get<std::string>(), r["error"].get<std::string>());
      continue;
    }
    fmt::print("route to {} ({}), as rdma_cm resolves it:\n", r["to"].get<std::string>(), r["address"].get<std::string>());
    fmt::print("  device      {} port {}\n", r["device"].get<std::string>(), r["port"].get<int>());
    fmt::print("  source      {}\n", r["source"].get<std::string>());
    fmt::print("  source GID  [{}] {}\n", r["gid_index"].get<int>(), r["source_gid"].get<std::string>());
    fmt::print("  dest GID    {}\n", r["dest_gid"].get<std::string>());
    fmt::print("  path MTU    {}, hop limit {}, traffic class {}\n", r["path_mtu"].get<unsigned>(),
               r["hop_limit"].get<unsigned>(), r["traffic_class"].get<unsigned>());
  }
  return status;
}

json netdev_json(const std::optional<doctor::Netdev>& nd) {
  if (!nd) return nullptr;
  return {{"name", nd->name}, {"up", nd->up}, {"operstate", nd->operstate}, {"mtu", nd->mtu},
          {"addresses", nd->addresses}};
}

int run_devices(const DevicesOptions& o) {
  const auto devices = list_devices();
  const GidSelector selector = GidSelector::parse(o.gid);
  json out = json::array();
  for (const DeviceInfo& d : devices) {
    json dj = {{"name", d.name},
               {"node_guid", fmt::format("{:016x}", d.node_guid)},
               {"fw_ver", d.fw_ver},
               {"vendor_id", d.vendor_id},
               {"vendor_part_id", d.vendor_part_id},
               {"numa_node", d.numa_node},
               {"max_qp_wr", d.max_qp_wr},
               {"max_cqe", d.max_cqe},
               {"max_sge", d.max_sge},
               {"atomics", d.atomics},
               {"memory_windows", d.memory_windows},
               {"ports", json::array()}};
    for (const PortInfo& p : d.ports) {
      json pj = {{"port", p.number},
                 {"state", p.state},
                 {"link_layer", to_string(p.link_layer)},
                 {"active_mtu", p.active_mtu},
                 {"max_mtu", p.max_mtu},
                 {"speed_gbps", p.speed_gbps},
                 {"width", p.width},
                 {"lid", p.lid},
                 {"max_msg_size", p.max_msg_size},
                 {"netdev", netdev_json(doctor::netdev_info(p.netdev))},
                 {"gids", json::array()}};
      for (const GidEntry& g : p.gids) {
        pj["gids"].push_back({{"index", g.index}, {"type", to_string(g.type)}, {"address", g.address()},
                              {"netdev", g.netdev}});
      }
      try {
        const GidChoice c = choose_gid(p.gids, selector);
        pj["chosen_gid"] = {{"index", c.entry.index}, {"address", c.entry.address()},
                            {"type", to_string(c.entry.type)}, {"reason", c.reason}};
      } catch (const Error& e) {
        pj["chosen_gid"] = {{"error", e.what()}};
      }
      dj["ports"].push_back(std::move(pj));
    }
    out.push_back(std::move(dj));
  }
  if (o.trace) {
    const auto sink = trace_to_stderr(o.json_out);
    for (const auto& d : out) sink({"device", {{"name", d["name"]}}});
  }
  if (o.json_out) {
    fmt::print("{}\n", json{{"devices", out}}.dump(2));
    return 0;
  }
  if (out.empty()) {
    fmt::print("no RDMA devices (load the NIC's RDMA driver, or for Soft-RoCE: rdma link add rxe0 "
               "type rxe netdev eth0)\n");
    return 0;
  }
  for (const auto& d : out) {
    fmt::print("{}  fw {}  vendor {:#x} part {}  NUMA node {}  (max_qp_wr {}, max_cqe {}, max_sge {}, atomics {}, "
               "memory windows {})\n",
               d["name"].get<std::string>(), d["fw_ver"].get<std::string>(), d["vendor_id"].get<unsigned>(),
               d["vendor_part_id"].get<unsigned>(),
               d["numa_node"].get<int>() < 0 ? std::string("none") : std::to_string(d["numa_node"].get<int>()),
               d["max_qp_wr"].get<unsigned>(), d["max_cqe"].get<unsigned>(), d["max_sge"].get<unsigned>(),
               d["atomics"].get<bool>() ? "yes" : "no", d["memory_windows"].get<bool>() ? "type 2" : "no");
    for (const auto& p : d["ports"]) {
      fmt::print("  port {}: {}  {}  active MTU {} (max {})  {:.1f} Gb/s ({}x)  LID {}\n", p["port"].get<int>(),
                 p["state"].get<std::string>(), p["link_layer"].get<std::string>(), p["active_mtu"].get<unsigned>(),
                 p["max_mtu"].get<unsigned>(), p["speed_gbps"].get<double>(), p["width"].get<unsigned>(),
                 p["lid"].get<unsigned>());
      if (!p["netdev"].is_null()) {
        const auto& n = p["netdev"];
        fmt::print("    netdev {}: {}, MTU {}, addresses {}\n", n["name"].get<std::string>(),
                   n["up"].get<bool>() ? "up" : n["operstate"].get<std::string>(), n["mtu"].get<unsigned>(),
                   n["addresses"].empty() ? std::string("none")
                                          : fmt::format("{}", fmt::join(n["addresses"].get<std::vector<std::string>>(), ", ")));
      }
      fmt::print("    GID table:\n");
      for (const auto& g : p["gids"]) {
        const bool chosen = p["chosen_gid"].contains("index") && p["chosen_gid"]["index"] == g["index"];
        fmt::print("    {} [{:>3}] {:<8} {:<40} {}\n", chosen ? "*" : " ", g["index"].get<unsigned>(),
                   g["type"].get<std::string>(), g["address"].get<std::string>(), g["netdev"].get<std::string>());
      }
      if (p["chosen_gid"].contains("index")) {
        fmt::print("    rdmakit uses GID {}: {}\n", p["chosen_gid"]["index"].get<unsigned>(),
                   p["chosen_gid"]["reason"].get<std::string>());
      } else {
        fmt::print("    no usable GID: {}\n", p["chosen_gid"]["error"].get<std::string>());
      }
    }
  }
  return 0;
}

struct DoctorOptions {
  ConnectOptions net;
  std::string peer;
  bool json_out = false;
};

json report_json(const doctor::Report& r) {
  json checks = json::array();
  for (const auto& c : r.checks) {
    checks.push_back({{"id", c.id}, {"title", c.title}, {"verdict", doctor::to_string(c.verdict)},
                      {"detail", c.detail}, {"fix", c.fix}});
  }
  return {{"verdict", doctor::to_string(r.worst())}, {"exit_status", r.exit_status()}, {"checks", checks}};
}

void print_report(const char* heading, const doctor::Report& r) {
  fmt::print("{}\n", heading);
  for (const auto& c : r.checks) {
    fmt::print("  [{:<4}] {}: {}\n", doctor::to_string(c.verdict), c.title, c.detail);
    if (!c.fix.empty()) fmt::print("         fix: {}\n", c.fix);
  }
  fmt::print("verdict: {}\n", doctor::to_string(r.worst()));
}

int run_doctor(const DoctorOptions& o) {
  doctor::Options local;
  local.device = o.net.device;
  local.port = static_cast<std::uint8_t>(o.net.ib_port);
  local.gid = GidSelector::parse(o.net.fabric.gid);
  {
    const ConnectionConfig c = o.net.config();
    local.traffic_class = c.traffic_class;
    local.service_level = c.service_level;
    local.pkey_index = c.pkey_index;
    local.ack_timeout = c.ack_timeout;
    local.retry_count = c.retry_count;
  }
  if (o.net.serving()) {
    // A doctor listener: every client gets a small buffer, a posted receive and this host's facts.
    ConnectOptions net = o.net;
    net.trace_json = o.json_out;
    Listener listener(net.listen_address(), net.config(), doctor::listener_setup());
    if (!o.json_out) fmt::print("doctor listening on port {}\n", listener.port());
    std::fflush(stdout);
    for (;;) {
      auto c = listener.accept(1s);
      if (!c) continue;
      if (!o.json_out) fmt::print("doctor: checking with {}\n", c->info().peer_address);
      std::fflush(stdout);
      doctor::serve(*c, 30s);
    }
  }
  doctor::Report r = doctor::check_local(local);
  std::optional<doctor::Report> peer;
  if (!o.peer.empty()) {
    doctor::PeerOptions po;
    po.local = local;
    po.timeout = o.net.timeout();
    po.method = parse_connect_method(o.net.method);
    if (o.net.trace) po.trace = trace_to_stderr(o.json_out);
    if (!o.net.psk_file.empty()) po.psk = read_key_file(o.net.psk_file);
    ConnectOptions target = o.net;
    target.connect = o.peer;
    peer = doctor::check_peer(target.connect_target(), po);
  }
  if (o.net.trace) {
    const auto sink = trace_to_stderr(o.json_out);
    for (const auto& c : r.checks) {
      sink({"check", {{"id", c.id}, {"verdict", doctor::to_string(c.verdict)}, {"detail", c.detail}}});
    }
  }
  int status = r.exit_status();
  if (peer) status = std::max(status, peer->exit_status());
  if (o.json_out) {
    json j = {{"local", report_json(r)}};
    if (peer) j["peer"] = report_json(*peer);
    j["exit_status"] = status;
    fmt::print("{}\n", j.dump(2));
  } else {
    print_report("this host:", r);
    if (peer) print_report(fmt::format("\nwith the peer {}:", o.peer).c_str(), *peer);
  }
  return status;
}

}  // namespace

void add_devices(CLI::App& app, std::function<int()>& run) {
  auto o = std::make_shared<DevicesOptions>();
  CLI::App* sub = app.add_subcommand("devices", "list RDMA devices, ports, netdevs and GIDs, and the GID rdmakit uses");
  sub->add_flag("--json", o->json_out, "print JSON");
  sub->add_option("-g,--gid", o->gid, "show the choice for this GID selector (index or IP) instead of the default");
  sub->add_option("--to", o->to,
                  "instead, show the device, port, source GID and path that rdma_cm resolves this "
                  "peer address to (what --cm rdma_cm uses); repeatable");
  sub->add_option("--timeout", o->timeout_ms, "deadline in ms for each --to resolution")
      ->check(CLI::Range(1u, 60'000u))
      ->capture_default_str();
  add_trace_flag(*sub, o->trace);
  sub->callback([o, &run] {
    run = guarded("devices", [o] { return o->to.empty() ? run_devices(*o) : run_routes(*o); });
  });
}

void add_doctor(CLI::App& app, std::function<int()>& run) {
  auto o = std::make_shared<DoctorOptions>();
  CLI::App* sub = app.add_subcommand(
      "doctor", "check this host's RDMA setup; with --peer HOST[:PORT] both sides of a connection "
                "(against `rdmakit doctor --listen` or any rdmakit listener). Exit status: 0 ok, "
                "1 warnings, 2 failures");
  sub->add_option("--peer", o->peer, "also check a connection to this rdmakit listener");
  o->net.add_to(*sub);
  o->net.connect_opt->excludes(sub->get_option("--peer"));
  o->net.connect_opt->group("");  // the doctor checks a peer with --peer: not listed in its help
  sub->add_flag("--json", o->json_out, "print the verdicts as JSON");
  sub->callback([o, &run] {
    if (!o->net.connect.empty()) throw CLI::ValidationError("--connect", "use --peer HOST[:PORT]");
    run = guarded("doctor", [o] { return run_doctor(*o); });
  });
}

}  // namespace rdmakit::tools
