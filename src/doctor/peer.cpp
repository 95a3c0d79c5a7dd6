// SPDX-License-Identifier: Apache-2.0
// rdmakit doctor, two-sided: compare both sides of a connection, exercise it with a tiny WRITE,
// READ and SEND, and turn each failure class into a diagnosis with a fix.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "connection/impl.hpp"
#include "doctor/text.hpp"
#include "rdmakit/doctor.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::doctor {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

constexpr std::size_t kBuffer = 4096;


// The IPv4 address of a GID (::ffff:a.b.c.d) as a host-order integer.
std::uint32_t ipv4_of(const Gid& g) {
  return (std::uint32_t{g[12]} << 24) | (std::uint32_t{g[13]} << 16) | (std::uint32_t{g[14]} << 8) | g[15];
}

// The prefix length of `addr` among a netdev's "a.b.c.d/N" addresses, or -1.
int ipv4_prefix(const Netdev& nd, std::uint32_t addr) {
  for (const std::string& a : nd.addresses) {
    const auto slash = a.find('/');
    in_addr ia{};
    if (slash == std::string::npos || ::inet_pton(AF_INET, a.substr(0, slash).c_str(), &ia) != 1) continue;
    if (ntohl(ia.s_addr) == addr) return std::stoi(a.substr(slash + 1));
  }
  return -1;
}

std::string ipv4_text(std::uint32_t a) {
  return fmt::format("{}.{}.{}.{}", a >> 24, (a >> 16) & 0xff, (a >> 8) & 0xff, a & 0xff);
}

GidEntry entry_of(const wire::EndpointInfo& e) { return {e.gid_index, e.gid_type, e.gid, {}}; }

const char* kind_text(GidKind k) {
  switch (k) {
    case GidKind::ipv4_mapped: return "IPv4";
    case GidKind::ipv6_link_local: return "IPv6 link-local";
    case GidKind::ipv6: return "IPv6";
  }
  return "?";
}

}  // namespace

Report compare_peers(const wire::EndpointInfo& local, const std::optional<Netdev>& local_netdev,
                     const wire::EndpointInfo& remote, const PeerFacts& facts) {
  Report r;
  Check link{"peer.link_layer", "link layers", Verdict::ok, "", ""};
  link.detail = fmt::format("this side {}, the peer {}", to_string(local.link_layer), to_string(remote.link_layer));
  if (local.link_layer != remote.link_layer) {
    link.verdict = Verdict::fail;
    link.fix = "InfiniBand and Ethernet (RoCE) ports cannot talk to each other: use devices of the "
               "same kind on both hosts (--device)";
  }
  r.checks.push_back(link);
  if (link.verdict == Verdict::fail) return r;

  if (local.link_layer == LinkLayer::ethernet) {
    Check ver{"peer.roce_version", "RoCE versions", Verdict::ok, "", ""};
    ver.detail = fmt::format("this side {} (GID index {}), the peer {} (GID index {})", to_string(local.gid_type),
                             local.gid_index, to_string(remote.gid_type), remote.gid_index);
    if (local.gid_type != remote.gid_type) {
      ver.verdict = Verdict::fail;
      ver.fix = "RoCE v1 and v2 packets are different protocols: choose GIDs of the same type on both "
                "sides (--gid; RoCE v2 with an IPv4 address is the usual choice)";
    }
    r.checks.push_back(ver);

    Check reach{"peer.gid_reach", "GIDs reach each other", Verdict::ok, "", ""};
    const GidEntry l = entry_of(local), p = entry_of(remote);
    const GidKind lk = l.kind(), pk = p.kind();
    reach.detail = fmt::format("this side {} ({}), the peer {} ({})", l.address(), kind_text(lk), p.address(), kind_text(pk));
    const bool l4 = lk == GidKind::ipv4_mapped, p4 = pk == GidKind::ipv4_mapped;
    if (l4 != p4) {
      reach.verdict = Verdict::fail;
      reach.fix = "one side's GID is an IPv4 address and the other's IPv6: RoCE v2 packets of one "
                  "family never reach the other; choose GIDs of the same family (--gid with the "
                  "IPv4 address, or the index `rdmakit devices` shows, on both sides)";
    } else if (l4) {
      const std::uint32_t la = ipv4_of(l.gid), pa = ipv4_of(p.gid);
      const int prefix = local_netdev ? ipv4_prefix(*local_netdev, la) : -1;
      if (prefix < 0) {
        reach.detail += "; this side's subnet is unknown";
      } else {
        const std::uint32_t mask = prefix == 0 ? 0 : ~std::uint32_t{0} << (32 - prefix);
        const std::string net = fmt::format("{}/{}", ipv4_text(la & mask), prefix);
        if ((la & mask) == (pa & mask)) {
          reach.detail += fmt::format("; same subnet {}", net);
        } else {
          reach.verdict = Verdict::warn;
          reach.detail += fmt::format("; the peer is outside this side's subnet {}", net);
          reach.fix = "RoCE v2 is routed like any UDP traffic (port 4791): check the route to the peer "
                      "(ip route get ADDRESS), that routers and firewalls pass UDP 4791, and that the "
                      "fabric is lossless (PFC/ECN) across the hop";
        }
      }
    } else if ((lk == GidKind::ipv6_link_local) != (pk == GidKind::ipv6_link_local)) {
      reach.verdict = Verdict::warn;
      reach.fix = "a link-local GID reaches only its own Ethernet segment: use routable IPv6 GIDs on "
                  "both sides, or link-local on both when they share the segment";
    }
    r.checks.push_back(reach);
  } else {
    Check lid{"peer.lid", "InfiniBand LIDs", Verdict::ok,
              fmt::format("this side LID {}, the peer LID {}", local.lid, remote.lid), ""};
    if (local.lid == 0 || remote.lid == 0) {
      lid.verdict = Verdict::fail;
      lid.fix = "a port without a LID has not been configured by a subnet manager: run opensm on the fabric";
    }
    r.checks.push_back(lid);
  }

  Check mtu{"peer.mtu", "MTUs", Verdict::ok, "", ""};
  const std::uint32_t path = std::min(local.mtu, remote.mtu);
  mtu.detail = fmt::format("active MTU {} here, {} on the peer: path MTU {}", local.mtu, remote.mtu, path);
  if (local.mtu != remote.mtu) {
    mtu.verdict = Verdict::warn;
    const std::string peer_nd = facts.netdev ? fmt::format(" (peer netdev {} MTU {})", facts.netdev->name, facts.netdev->mtu) : "";
    const std::string our_nd = local_netdev ? fmt::format(" (this netdev {} MTU {})", local_netdev->name, local_netdev->mtu) : "";
    mtu.detail += our_nd + peer_nd;
    mtu.fix = fmt::format("the connection works at {} bytes, the smaller side's; set the same MTU on both "
                          "netdevs (ip link set DEV mtu N) so neither side is held back, and make sure "
                          "every switch on the path carries it", path);
  }
  r.checks.push_back(mtu);

  Check mem{"peer.memlock", "the peer's locked-memory limit", Verdict::skip, "", ""};
  if (!facts.memlock) {
    mem.detail = "unknown: the peer is not a doctor listener (rdmakit doctor --listen tells it)";
  } else {
    mem.verdict = Verdict::ok;
    mem.detail = fmt::format("{}{}", text::bytes_text(*facts.memlock), facts.cap_ipc_lock ? " (not enforced there: CAP_IPC_LOCK)" : "");
    if (*facts.memlock < Options{}.memlock_needed && !facts.cap_ipc_lock) {
      mem.verdict = Verdict::warn;
      mem.fix = "the peer will fail to register more than that; raise RLIMIT_MEMLOCK there (ulimit -l unlimited)";
    }
  }
  r.checks.push_back(mem);
  return r;
}

Check diagnose(const Completion& c, const Report* comparison) {
  Check d{"peer.operation", fmt::format("{} to the peer", to_string(c.opcode)), Verdict::fail, c.describe(), ""};
  std::string found;
  if (comparison != nullptr) {
    for (const Check& x : comparison->checks) {
      if (x.verdict == Verdict::fail || x.verdict == Verdict::warn) found += fmt::format(" The comparison found: {}: {}.", x.title, x.detail);
    }
  }
  switch (c.status) {
    case IBV_WC_RETRY_EXC_ERR:
      d.fix = "the peer never acknowledged: " +
              (found.empty() ? std::string("check that it is alive, that this host reaches its GID address "
                                           "(ping it over the RoCE netdev), that nothing drops UDP 4791, and that "
                                           "the path carries the MTU")
                             : "fix what the comparison found." + found);
      break;
    case IBV_WC_REM_ACCESS_ERR:
      d.fix = "the peer refused the access: the address, length or rkey is not that of a region it "
              "registered with this access, or the region is gone; re-read its advertised regions";
      break;
    case IBV_WC_RNR_RETRY_EXC_ERR:
      d.fix = "the peer had no receive posted for the SEND: it must post receives before the sender "
              "sends (or raise rnr_retry / rnr_timer to give it time)";
      break;
    case IBV_WC_REM_INV_REQ_ERR:
      d.fix = "the peer found the request invalid: a SEND longer than its receive buffer, or an "
              "operation its QP does not allow";
      break;
    case IBV_WC_WR_FLUSH_ERR:
      d.fix = "an earlier request failed and moved the QP to the error state; its diagnosis is the one to read";
      break;
    default:
      d.fix = "see the status above";
  }
  return d;
}

Check diagnose(const Error& e) {
  Check d{"peer.connect", "connection", Verdict::fail, e.what(), e.hint()};
  const std::string op = e.op();
  const int err = e.sys_errno();
  if (op == "connect" && err == ECONNREFUSED) {
    d.fix = "nothing listens at that address and port: start the peer (rdmakit doctor --listen), "
            "or check the address and port";
  } else if (op == "connect" || (op.rfind("bootstrap", 0) == 0 && err == ETIMEDOUT)) {
    d.fix = "no answer from the peer's bootstrap port: a wrong address, a firewall on the TCP port, "
            "or the peer is down or stalled";
  } else if (op == "bootstrap decode") {
    d.fix = e.hint().empty() ? "the peer is not an rdmakit endpoint of this protocol version" : e.hint();
  } else if (op == "bootstrap handshake" && d.detail.find("GID families differ") != std::string::npos) {
    // check_compatible's refusal, from either side: the GIDs' address families differ.
    d.id = "peer.gid_reach";
    d.title = "GIDs reach each other";
    d.fix = "one side's GID is an IPv4 address and the other's IPv6: RoCE v2 packets of one family "
            "never reach the other; choose GIDs of the same family (--gid with the IPv4 address, or "
            "the index `rdmakit devices` shows, on both sides)";
  } else if (op == "bootstrap authentication") {
    d.title = "authentication";
    if (d.fix.empty()) d.fix = "give both sides the same pre-shared key (--psk-file)";
  } else if (op == "bootstrap handshake" && err == ECONNREFUSED) {
    d.fix = "the peer refused the connection for the reason it gave above";
  } else if (op.rfind("rdma_", 0) == 0) {
    // The CM's steps: each error already names the event, its status and the likely cause.
    d.id = "peer.rdma_cm";
    d.title = "rdma_cm connection";
    if (op == "rdma_resolve_addr" || op == "rdma_cm address resolution") {
      d.title = "rdma_cm address resolution";
    } else if (op == "rdma_resolve_route" || op == "rdma_cm route resolution") {
      d.title = "rdma_cm route resolution";
    } else if (err == ECONNREFUSED && d.detail.find("invalid service ID") != std::string::npos) {
      d.fix = "nothing listens on that rdma_cm port: start the peer with --cm rdma_cm (rdma_cm "
              "ports are not TCP ports), or check the address and port";
    }
  } else if (op.rfind("ibv_modify_qp", 0) == 0) {
    d.title = "QP setup";
  } else if (op == "ibv_reg_mr") {
    d.title = "memory registration";
  } else if (op == "open device" || op == "pick device" || op == "ibv_get_device_list") {
    d.title = "device";
  }
  if (d.fix.empty()) d.fix = "see the error above";
  return d;
}

namespace {

json host_facts_json() {
  const HostFacts h = host_facts();
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return {{"rdmakit_doctor", 1}, {"host", host}, {"memlock", h.memlock_soft}, {"cap_ipc_lock", h.cap_ipc_lock}};
}

PeerFacts facts_from(const json& j) {
  PeerFacts f;
  f.host = j.value("host", "");
  if (j.contains("memlock")) f.memlock = j["memlock"].get<std::uint64_t>();
  f.cap_ipc_lock = j.value("cap_ipc_lock", false);
  if (j.contains("netdev") && j["netdev"].is_object()) {
    Netdev n;
    n.name = j["netdev"].value("name", "");
    n.mtu = j["netdev"].value("mtu", 0u);
    n.up = j["netdev"].value("up", false);
    f.netdev = n;
  }
  return f;
}

void send_json(Connection& c, const json& j) {
  const std::string s = j.dump();
  c.send_message({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()}, 5s);
}

std::optional<json> receive_json(Connection& c, std::chrono::milliseconds timeout) {
  auto m = c.receive_message(timeout);
  if (!m) return std::nullopt;
  json j = json::parse(m->begin(), m->end(), nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

std::optional<Completion> await(Connection& c, std::chrono::milliseconds timeout) {
  const WaitResult w = c.wait(timeout);
  if (w.status != WaitStatus::completed) return std::nullopt;
  return w.completion;
}

}  // namespace

Connection::Setup listener_setup() {
  return [](Connection& c) {
    const MemoryRegion& m = c.allocate_memory(kBuffer, Access::local_write | Access::remote_read | Access::remote_write);
    c.advertise(m);
    (void)c.post_recv(m.local().subslice(kBuffer / 2, kBuffer / 2), 1);
  };
}

void serve(Connection& c, std::chrono::milliseconds timeout) {
  json facts = host_facts_json();
  if (const auto nd = netdev_info(c.info().local_gid.netdev)) {
    facts["netdev"] = {{"name", nd->name}, {"mtu", nd->mtu}, {"up", nd->up}};
  }
  send_json(c, facts);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline && !c.peer_closed()) {
    const WaitResult w = c.wait(200ms);
    if (w.status == WaitStatus::peer_lost || w.status == WaitStatus::device_error ||
        w.status == WaitStatus::closed) {
      break;
    }
    if (w.status != WaitStatus::completed || w.completion.opcode != Opcode::recv) continue;
    // Echo what the SEND carried, so the doctor knows it arrived intact.
    json echo = {{"received", w.completion.ok() ? static_cast<int>(w.completion.byte_len) : -1}};
    if (w.completion.ok()) {
      const auto* p = static_cast<const std::uint8_t*>(c.memory(0).data()) + kBuffer / 2;
      echo["bytes"] = std::string(reinterpret_cast<const char*>(p), w.completion.byte_len);
    }
    send_json(c, echo);
  }
}

Report check_peer(const std::string& host_port, const PeerOptions& o) {
  Report r;
  ConnectionConfig cfg;
  cfg.method = o.method;
  cfg.device = o.local.device;
  cfg.port = o.local.port;
  cfg.gid = o.local.gid;
  // The packets' class, SL and partition as the listener's (doctor --listen takes the same
  // options): what the fabric check printed is what this connection tests.
  cfg.traffic_class = o.local.traffic_class;
  cfg.service_level = o.local.service_level;
  cfg.pkey_index = o.local.pkey_index;
  cfg.handshake_timeout = o.timeout;
  cfg.retry_refused = false;
  // Fail fast: 100 ms x 4 tries, so an unreachable peer is a diagnosis in about half a second.
  cfg.ack_timeout = 100ms;
  cfg.retry_count = 3;
  cfg.rnr_retry = 3;
  cfg.log = [](std::string_view) {};
  cfg.trace = o.trace;
  cfg.psk = o.psk;
  wire::EndpointInfo seen_local, seen_remote;
  std::string local_netdev;
  bool seen = false;
  // The hook sees the peer's parameters before they are checked or used, so a connection that
  // fails in its QP transitions can still be explained by comparing both sides.
  detail::HandshakeHooks hooks;
  hooks.peer_hello = [&](wire::EndpointInfo& remote) {
    seen_remote = remote;
    seen = true;
  };
  std::optional<Connection> conn;
  try {
    conn.emplace(Connection::Impl::connect(host_port, cfg, [&](Connection& c) {
      seen_local = c.info().local;
      local_netdev = c.info().local_gid.netdev;
      c.allocate_memory(kBuffer, Access::local_write);
    }, hooks));
  } catch (const Error& e) {
    if (seen) {
      // The HELLOs crossed: the comparison usually says why the transitions failed.
      Report cmp = compare_peers(seen_local, netdev_info(local_netdev), seen_remote, {});
      r.checks = std::move(cmp.checks);
    }
    r.checks.push_back(diagnose(e));
    return r;
  }
  Connection& c = *conn;
  const auto facts_msg = receive_json(c, 2s);
  PeerFacts facts;
  if (facts_msg && facts_msg->contains("rdmakit_doctor")) facts = facts_from(*facts_msg);
  const auto local_nd = netdev_info(c.info().local_gid.netdev);
  Report cmp = compare_peers(c.info().local, local_nd, c.info().remote, facts);
  r.checks = cmp.checks;

  const MemoryRegion& mine = c.memory(0);
  auto* buf = static_cast<std::uint8_t*>(mine.data());
  const auto& regions = c.remote_regions();
  const auto region = std::find_if(regions.begin(), regions.end(), [](const RemoteRegion& x) {
    return allows(x.access, Access::remote_write) && allows(x.access, Access::remote_read) && x.length >= 16;
  });
  auto op_check = [&](const char* id, const char* title) { return Check{id, title, Verdict::ok, "", ""}; };
  bool broken = false;
  if (region == regions.end()) {
    r.checks.push_back({"peer.write_read", "tiny WRITE and READ", Verdict::skip,
                        "the peer advertises no region this side may read and write", ""});
  } else {
    // WRITE 16 bytes, READ them back into another place, compare.
    const char pattern[] = "rdmakit-doctor!";
    std::memcpy(buf, pattern, 16);
    Check w = op_check("peer.write", "tiny WRITE");
    Check rd = op_check("peer.read", "tiny READ");
    const PostResult pw = c.post_write(mine.local().subslice(0, 16), *region, 0, 1);
    const auto cw = pw.ok() ? await(c, o.timeout) : std::nullopt;
    if (!pw.ok()) {
      w = {"peer.write", "tiny WRITE", Verdict::fail, pw.describe(), "see the refusal"};
    } else if (!cw) {
      w = {"peer.write", "tiny WRITE", Verdict::fail, "no completion within the timeout", "is the peer alive?"};
    } else if (!cw->ok()) {
      w = diagnose(*cw, &cmp);
      w.id = "peer.write";
    } else {
      w.detail = fmt::format("16 bytes to {:#x}", region->addr);
    }
    r.checks.push_back(w);
    broken = w.verdict == Verdict::fail;
    if (!broken) {
      const PostResult pr = c.post_read(mine.local().subslice(64, 16), *region, 0, 2);
      const auto cr = pr.ok() ? await(c, o.timeout) : std::nullopt;
      if (!pr.ok() || !cr) {
        rd = {"peer.read", "tiny READ", Verdict::fail, pr.ok() ? "no completion within the timeout" : pr.describe(), ""};
      } else if (!cr->ok()) {
        rd = diagnose(*cr, &cmp);
        rd.id = "peer.read";
      } else if (std::memcmp(buf + 64, pattern, 16) != 0) {
        rd.verdict = Verdict::fail;
        rd.detail = "the READ returned other bytes than the WRITE stored";
        rd.fix = "the peer's memory changed in between, or the NIC corrupts data: run `rdmakit bench write bw --validate`";
      } else {
        rd.detail = "read back what the WRITE stored";
      }
      r.checks.push_back(rd);
      broken = rd.verdict == Verdict::fail;
    }
  }

  Check s = op_check("peer.send", "tiny SEND");
  if (broken) {
    s = {"peer.send", "tiny SEND", Verdict::skip, "not tried: the connection is broken (see above)", ""};
  } else if (!facts_msg) {
    s = {"peer.send", "tiny SEND", Verdict::skip,
         "the peer is not a doctor listener, so no receive is known to be posted", ""};
  } else {
    std::memcpy(buf + 128, "doctor-send", 11);
    const PostResult ps = c.post_send(mine.local().subslice(128, 11), 3);
    const auto cs = ps.ok() ? await(c, o.timeout) : std::nullopt;
    const auto echo = cs && cs->ok() ? receive_json(c, o.timeout) : std::nullopt;
    if (!ps.ok() || !cs) {
      s = {"peer.send", "tiny SEND", Verdict::fail, ps.ok() ? "no completion within the timeout" : ps.describe(), ""};
    } else if (!cs->ok()) {
      s = diagnose(*cs, &cmp);
      s.id = "peer.send";
    } else if (!echo || echo->value("bytes", "") != "doctor-send") {
      s.verdict = Verdict::fail;
      s.detail = "the SEND completed but the peer did not report receiving those bytes";
      s.fix = "check the peer's log";
    } else {
      s.detail = "11 bytes received intact by the peer";
    }
    broken = s.verdict == Verdict::fail;
  }
  r.checks.push_back(s);

  if (!broken && region != regions.end() && o.rtt_samples > 0) {
    // Round trips of 8-byte READs: the NIC-to-NIC latency, with no software on the peer's side.
    std::vector<double> us;
    us.reserve(o.rtt_samples);
    for (std::uint32_t i = 0; i < o.rtt_samples; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!c.post_read(mine.local().subslice(256, 8), *region, 0, 10 + i).ok()) break;
      const auto x = await(c, o.timeout);
      if (!x || !x->ok()) break;
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    Check lat{"peer.rtt", "round trip (8-byte READ)", Verdict::ok, "", ""};
    if (us.size() < o.rtt_samples) {
      lat.verdict = Verdict::warn;
      lat.detail = fmt::format("only {} of {} READs completed", us.size(), o.rtt_samples);
      lat.fix = "the connection failed during the measurement: rerun, and check the peer's log";
    } else {
      lat.detail = fmt::format("median {:.1f} us, p99 {:.1f} us, min {:.1f} us over {} READs", us[us.size() / 2],
                               us[std::min(us.size() - 1, us.size() * 99 / 100)], us.front(), us.size());
    }
    r.checks.push_back(lat);
  }
  c.close(2s);
  return r;
}

}  // namespace rdmakit::doctor
