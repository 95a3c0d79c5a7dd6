// SPDX-License-Identifier: Apache-2.0
// rdmakit doctor's local checks. Each check says what it found and, unless all is well, one
// concrete fix; a check that does not apply here says why (skip) instead of passing silently.
#include <infiniband/verbs.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "rdmakit/doctor.hpp"
#include "doctor/text.hpp"
#include "rdmakit/error.hpp"
#include "verbs/handles.hpp"
#include "verbs/memory_impl.hpp"
#include "verbs/qp.hpp"

namespace rdmakit::doctor {

const char* to_string(Verdict v) noexcept {
  switch (v) {
    case Verdict::ok: return "ok";
    case Verdict::skip: return "skip";
    case Verdict::warn: return "warn";
    case Verdict::fail: return "fail";
  }
  return "?";
}

Verdict Report::worst() const noexcept {
  // A skipped check says why it did not apply; it makes nothing worse than ok.
  Verdict w = Verdict::ok;
  for (const Check& c : checks) {
    if (c.verdict != Verdict::skip) w = std::max(w, c.verdict);
  }
  return w;
}

int Report::exit_status() const noexcept {
  switch (worst()) {
    case Verdict::warn: return 1;
    case Verdict::fail: return 2;
    default: return 0;
  }
}

namespace {

using text::bytes_text;

const std::string kMemlockFix = std::string("raise RLIMIT_MEMLOCK: ") + detail::kMemlockAdvice;

Check dev_infiniband(const HostFacts& h) {
  Check c{"dev_infiniband", "/dev/infiniband", Verdict::ok, "", ""};
  if (!h.dev_infiniband || h.uverbs.empty()) {
    c.verdict = Verdict::fail;
    c.detail = h.dev_infiniband ? "/dev/infiniband has no uverbs device" : "/dev/infiniband does not exist";
    c.fix = "load the verbs module (modprobe ib_uverbs) and the NIC's driver (mlx5_ib, or rdma_rxe for "
            "Soft-RoCE); in a container pass the devices through (--device=/dev/infiniband/uverbs0 "
            "--device=/dev/infiniband/rdma_cm)";
  } else if (!h.inaccessible.empty()) {
    c.verdict = Verdict::fail;
    c.detail = fmt::format("this process cannot open {}", fmt::join(h.inaccessible, ", "));
    c.fix = "run as a user in the group that owns the devices (often 'rdma'), or adjust the udev "
            "rule's MODE; in a container pass the devices through";
  } else {
    c.detail = fmt::format("{} present and accessible", fmt::join(h.uverbs, ", "));
  }
  return c;
}

// Registers `bytes` for real: the kernel charges pinned pages against RLIMIT_MEMLOCK unless the
// process has CAP_IPC_LOCK, and this is the only way to know what it will allow.
int probe_registration(const std::string& device, std::uint64_t bytes) {
  try {
    const auto dev = detail::open_pd(device);
    auto mem = detail::allocate_pages(bytes);
    detail::MrPtr mr(ibv_reg_mr(dev->pd.get(), mem.get(), bytes, IBV_ACCESS_LOCAL_WRITE));
    return mr ? 0 : errno;
  } catch (const Error& e) {
    return e.sys_errno() != 0 ? e.sys_errno() : EIO;
  }
}

Check memlock(const HostFacts& h, const std::string& device, std::uint64_t needed, std::size_t devices) {
  Check c{"memlock", "locked-memory limit (RLIMIT_MEMLOCK)", Verdict::ok, "", ""};
  const std::string limit = fmt::format("soft {}, hard {}", bytes_text(h.memlock_soft), bytes_text(h.memlock_hard));
  const int err = device.empty() ? 0 : probe_registration(device, needed);
  if (err != 0) {
    c.verdict = Verdict::fail;
    c.detail = fmt::format("{}; registering {} (what a typical connection needs) failed: {}", limit,
                           bytes_text(needed), errno_name(err));
    c.fix = kMemlockFix;
  } else if (h.memlock_soft < needed && h.cap_ipc_lock) {
    c.detail = fmt::format("{}, below the {} a typical connection needs, but this process has "
                           "CAP_IPC_LOCK, so the kernel does not enforce it (programs run without it "
                           "will fail to register memory)", limit, bytes_text(needed));
  } else if (h.memlock_soft < needed) {
    c.verdict = Verdict::fail;
    c.detail = fmt::format("{}, below the {} a typical connection needs", limit, bytes_text(needed));
    c.fix = kMemlockFix;
  } else {
    c.detail = fmt::format("{}{}", limit, device.empty() ? "" : fmt::format("; registered {} to be sure", bytes_text(needed)));
  }
  if (devices > 1 && c.verdict != Verdict::fail) {
    // An engine registers each buffer on every device it uses: the limit counts each time.
    c.detail += fmt::format(
        "; an engine pins its registered memory once per device it uses ({} here): within the soft limit it "
        "registers {} on all of them, or list fewer (EngineConfig::devices, serve --device)",
        devices, h.memlock_soft == std::numeric_limits<std::uint64_t>::max() ? std::string("any amount")
                                                                               : bytes_text(h.memlock_soft / devices));
  }
  return c;
}

Check hugepages(const HostFacts& h) {
  Check c{"hugepages", "huge pages", Verdict::ok, "", ""};
  if (h.hugepages_total == 0) {
    c.verdict = Verdict::skip;
    c.detail = fmt::format("none reserved ({} pages); only --mem hugepage needs them",
                           bytes_text(h.hugepage_bytes));
  } else {
    c.detail = fmt::format("{} of {} {} pages free", h.hugepages_free, h.hugepages_total,
                           bytes_text(h.hugepage_bytes));
    if (h.hugepages_free == 0) {
      c.verdict = Verdict::warn;
      c.fix = "all reserved huge pages are in use: reserve more (echo N > /proc/sys/vm/nr_hugepages)";
    }
  }
  return c;
}

Check versions(const HostFacts& h, const DeviceInfo* d) {
  Check c{"versions", "rdma-core, kernel, device", Verdict::ok, "", ""};
  c.detail = fmt::format("rdma-core {}, kernel {}", h.rdma_core.empty() ? "(unknown)" : h.rdma_core, h.kernel);
  if (d != nullptr) {
    c.detail += fmt::format(", {} firmware {} (vendor {:#x}, part {})", d->name,
                            d->fw_ver.empty() ? "-" : d->fw_ver, d->vendor_id, d->vendor_part_id);
  }
  return c;
}

// ibv_reg_dmabuf_mr with an invalid fd: a provider without dma-buf support answers EOPNOTSUPP
// (or the symbol's stub ENOSYS) before looking at the fd; one with support gets to the fd and
// answers EBADF.
int dmabuf_probe(const std::string& device) {
  try {
    const auto dev = detail::open_pd(device);
    errno = 0;
    detail::MrPtr mr(ibv_reg_dmabuf_mr(dev->pd.get(), 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE));
    return mr ? 0 : errno;
  } catch (const Error& e) {
    return e.sys_errno();
  }
}

Check gpu(const HostFacts& h, const DeviceInfo* d) {
  Check c{"gpu_memory", "GPU memory registration", Verdict::ok, "", ""};
  const int probe = d != nullptr ? dmabuf_probe(d->name) : ENODEV;
  const bool dmabuf = probe != EOPNOTSUPP && probe != ENOSYS && probe != ENODEV && probe != EPROTONOSUPPORT;
  const std::string dmabuf_text =
      d == nullptr ? "no device to ask"
      : dmabuf     ? fmt::format("{} can register dma-buf MRs", d->name)
                   : fmt::format("{} cannot register dma-buf MRs ({})", d->name, errno_name(probe));
  if (!h.nvidia_gpu) {
    c.verdict = Verdict::skip;
    c.detail = fmt::format("no NVIDIA GPU on this host; {}", dmabuf_text);
    return c;
  }
  c.detail = fmt::format("NVIDIA GPU present; nvidia_peermem {}; {}", h.nvidia_peermem ? "loaded" : "not loaded",
                         dmabuf_text);
  if (!h.nvidia_peermem && !dmabuf) {
    c.verdict = Verdict::warn;
    c.fix = "caller-owned GPU memory (a framework's tensor) cannot be registered, and GPU memory the engine "
            "allocates moves through a host bounce buffer: load nvidia_peermem (modprobe nvidia_peermem), or use "
            "a NIC and kernel with dma-buf support (mlx5, Linux 5.12+, the open NVIDIA kernel modules)";
  }
  return c;
}

Check fork_safety(const HostFacts& h) {
  Check c{"fork", "fork() beside registered memory", Verdict::ok, "", ""};
  if (h.fork_mode == "unneeded") {
    c.detail = fmt::format("the kernel ({}) copies pinned pages for a child: a process may fork, or run a "
                           "subprocess, while it holds an engine",
                           h.kernel);
  } else if (h.fork_mode == "enabled") {
    c.detail = "ibv_fork_init is on (RDMAV_FORK_SAFE): registered memory is not shared with a child";
  } else {
    c.verdict = Verdict::warn;
    c.detail = fmt::format("this kernel ({}) and rdma-core ({}) leave registered pages shared copy-on-write with "
                           "a child: after a fork the parent's next write to one can move it away from the NIC",
                           h.kernel, h.rdma_core.empty() ? "unknown" : h.rdma_core);
    c.fix = "run processes that fork (a Python subprocess, a shell-out) with RDMAV_FORK_SAFE=1, or use "
            "Linux 5.13+ with rdma-core 35+";
  }
  return c;
}

Check numa(const HostFacts& h, const DeviceInfo* d) {
  Check c{"numa", "NIC NUMA node", Verdict::ok, "", ""};
  if (d == nullptr || d->numa_node < 0) {
    c.verdict = Verdict::skip;
    c.detail = d == nullptr ? "no device" : fmt::format("{} has no NUMA affinity (a software device, or none reported)", d->name);
    return c;
  }
  c.detail = fmt::format("{} is on NUMA node {} of {}", d->name, d->numa_node, h.numa_nodes);
  if (h.numa_nodes > 1) c.detail += fmt::format("; run on that node's CPUs and memory (numactl -N {} -m {})", d->numa_node, d->numa_node);
  return c;
}

// The port's P_Key at `index` as sysfs shows it ("0xffff"), or empty.
std::string pkey_at(const std::string& device, std::uint8_t port, std::uint16_t index) {
  std::ifstream f(fmt::format("/sys/class/infiniband/{}/ports/{}/pkeys/{}", device, port, index));
  std::string v;
  return (f >> v) ? v : std::string{};
}

// What a connection's packets carry and how long a dead peer takes, and where the port shows
// that a setting does nothing or cannot work.
Check fabric(const Options& o, const DeviceInfo& d, const PortInfo& p, const std::optional<GidEntry>& gid) {
  Check c{"fabric", "fabric settings", Verdict::ok, "", ""};
  std::chrono::microseconds ack{0};
  try {
    ack = detail::ack_timeout_duration(detail::encode_ack_timeout(o.ack_timeout));
  } catch (const Error& e) {
    c.verdict = Verdict::fail;
    c.detail = e.what();
    return c;
  }
  const auto dead = ack * (o.retry_count + 1);
  const std::string pkey = pkey_at(d.name, p.number, o.pkey_index);
  c.detail = fmt::format(
      "traffic class {}; SL {}; P_Key index {} ({}); ACK timeout {} ms asked, {:.1f} ms as encoded, x {} tries: a dead "
      "peer is noticed after {:.1f} s",
      fmt::format("{} ({})", o.traffic_class, detail::traffic_class_text(o.traffic_class)),
      o.service_level, o.pkey_index, pkey.empty() ? "no entry readable in the port's table" : "P_Key " + pkey,
      o.ack_timeout.count(),
      static_cast<double>(ack.count()) / 1000.0, o.retry_count + 1, static_cast<double>(dead.count()) / 1e6);
  std::vector<std::string> fixes;
  // As the connection checks it (ibv_query_pkey reads the same file): a missing entry, or one
  // whose key without the membership bit is 0. Index 0 unreadable (a provider without a table
  // in sysfs) is no finding: the connection asks for no index then.
  const bool invalid = pkey.empty() ? o.pkey_index != 0 : (std::strtoul(pkey.c_str(), nullptr, 16) & 0x7fff) == 0;
  if (invalid) {
    c.verdict = Verdict::fail;
    fixes.push_back(fmt::format("P_Key index {} is not a valid entry of {} port {}: use one the subnet manager gave "
                                "this port (cat /sys/class/infiniband/{}/ports/{}/pkeys/*)",
                                o.pkey_index, d.name, p.number, d.name, p.number));
  }
  // The netdev of the GID a connection would use (a VLAN's GIDs name the VLAN).
  const std::string netdev = gid && !gid->netdev.empty() ? gid->netdev : p.netdev;
  if (p.link_layer == LinkLayer::ethernet && o.service_level != 0) {
    std::ifstream vlan("/proc/net/vlan/" + netdev);
    if (!vlan) {
      c.verdict = std::max(c.verdict, Verdict::warn);
      fixes.push_back(fmt::format("on RoCE the SL becomes the 802.1p priority of VLAN-tagged frames only, and {} is "
                                  "not a VLAN: SL {} changes nothing on the wire; mark RDMA by DSCP (--traffic-class) "
                                  "with the NIC trusting DSCP",
                                  netdev.empty() ? "the port's netdev" : netdev, o.service_level));
    }
  }
  if (p.link_layer == LinkLayer::ethernet && o.traffic_class != 0 && gid && gid->type == GidType::roce_v1) {
    c.verdict = std::max(c.verdict, Verdict::warn);
    fixes.push_back("the GID is RoCE v1, which has no IP header: switches see no DSCP; use a RoCE v2 GID");
  }
  c.fix = fmt::format("{}", fmt::join(fixes, "; "));
  return c;
}

}  // namespace

Report check_local(const Options& o) {
  Report r;
  const HostFacts h = host_facts();
  r.checks.push_back(dev_infiniband(h));

  std::vector<DeviceInfo> devices;
  Check dev{"device", "RDMA device and port", Verdict::ok, "", ""};
  const DeviceInfo* d = nullptr;
  const PortInfo* p = nullptr;
  try {
    devices = list_devices();
  } catch (const Error& e) {
    dev.verdict = Verdict::fail;
    dev.detail = e.what();
    dev.fix = "is rdma-core installed (apt-get install rdma-core ibverbs-providers)?";
  }
  if (dev.verdict == Verdict::ok && devices.empty()) {
    dev.verdict = Verdict::fail;
    dev.detail = "no RDMA device";
    dev.fix = "load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re, ...), or for Soft-RoCE: "
              "`rdma link add rxe0 type rxe netdev eth0`";
  }
  if (dev.verdict == Verdict::ok) {
    const auto named = std::find_if(devices.begin(), devices.end(), [&](const DeviceInfo& x) { return x.name == o.device; });
    if (!o.device.empty() && named == devices.end()) {
      std::vector<std::string> names;
      for (const auto& x : devices) names.push_back(x.name);
      dev.verdict = Verdict::fail;
      dev.detail = fmt::format("no device named '{}'; available: {}", o.device, fmt::join(names, ", "));
      dev.fix = "pick one of the available devices (--device)";
    } else {
      d = !o.device.empty() ? &*named : &devices.front();
      // The device rdmakit would pick: the first with an ACTIVE port.
      if (o.device.empty()) {
        for (const auto& x : devices) {
          if (std::any_of(x.ports.begin(), x.ports.end(), [](const PortInfo& q) { return q.active; })) {
            d = &x;
            break;
          }
        }
      }
      const auto port = std::find_if(d->ports.begin(), d->ports.end(), [&](const PortInfo& q) {
        return o.port != 0 ? q.number == o.port : q.active;
      });
      p = port != d->ports.end() ? &*port : (d->ports.empty() ? nullptr : &d->ports.front());
      if (p == nullptr) {
        dev.verdict = Verdict::fail;
        dev.detail = fmt::format("{} has no port {}", d->name, o.port);
      } else if (!p->active) {
        const auto nd = netdev_info(p->netdev);
        dev.verdict = Verdict::fail;
        dev.detail = fmt::format("{} port {} is {}{}", d->name, p->number, p->state,
                                 nd ? fmt::format(" (netdev {} is {})", nd->name, nd->up ? "up" : nd->operstate) : "");
        dev.fix = nd && !nd->up ? fmt::format("bring the link up: ip link set {} up (and check the cable/switch port)", nd->name)
                : p->link_layer == LinkLayer::infiniband ? "is a subnet manager (opensm) running on the fabric?"
                                                         : "check the link (cable, switch port, `ip link`)";
      } else {
        dev.detail = fmt::format("{} port {}: ACTIVE, {}, {:g} Gb/s, active MTU {}", d->name, p->number,
                                 to_string(p->link_layer), p->speed_gbps, p->active_mtu);
      }
    }
  }
  r.checks.push_back(dev);

  if (p != nullptr) {
    Check g{"gid", "source GID", Verdict::ok, "", ""};
    std::optional<GidEntry> gid;  // the one a connection would use (none when it would fail)
    try {
      const GidChoice choice = choose_gid(p->gids, o.gid);
      gid = choice.entry;
      g.detail = fmt::format("index {}: {} {} ({})", choice.entry.index, to_string(choice.entry.type),
                             choice.entry.address(), choice.reason);
      if (p->link_layer == LinkLayer::ethernet) {
        if (choice.entry.kind() == GidKind::ipv6_link_local) {
          g.verdict = Verdict::warn;
          g.fix = fmt::format("the netdev {} has no IP address, so only a link-local GID exists: peers on "
                              "other subnets cannot be reached; assign an address (ip addr add A/N dev {})",
                              p->netdev, p->netdev);
        } else if (choice.entry.type == GidType::roce_v1) {
          g.verdict = Verdict::warn;
          g.fix = "RoCE v1 is not routable and both sides must use it; prefer a RoCE v2 GID (--gid)";
        }
      }
    } catch (const Error& e) {
      g.verdict = Verdict::fail;
      g.detail = e.what();
      g.fix = e.hint().empty() ? "assign an IP address to the port's netdev" : e.hint();
    }
    r.checks.push_back(g);
    r.checks.push_back(fabric(o, *d, *p, gid));

    Check m{"mtu", "MTU", Verdict::ok, "", ""};
    const auto nd = netdev_info(p->netdev);
    m.detail = fmt::format("active {} (max {}){}", p->active_mtu, p->max_mtu,
                           nd ? fmt::format(", netdev {} MTU {}", nd->name, nd->mtu) : "");
    if (nd && p->link_layer == LinkLayer::ethernet && p->active_mtu < p->max_mtu) {
      m.detail += " (an active MTU of 4096 takes a netdev MTU of 4200 or more: jumbo frames)";
    }
    r.checks.push_back(m);
  }

  if (d != nullptr) {
    Check w{"memory_windows", "per-peer keys (engine)", Verdict::ok, "", ""};
    if (d->memory_windows) {
      w.detail = fmt::format("{} has type-2 memory windows: an engine gives each peer its own key per segment, "
                             "bound on that peer's QP and revocable alone", d->name);
    } else {
      w.verdict = Verdict::warn;
      w.detail = fmt::format("{} has no type-2 memory windows: an engine refuses to expose segments unless "
                             "region keys are allowed, and then gives every peer holding the link key the "
                             "buffer's own key (the whole buffer, no per-peer revocation)", d->name);
      w.fix = "use a NIC with type-2 memory windows; or set EngineConfig::allow_region_keys (serve "
              "--allow-region-keys) with a pre-shared key, and separate engines for peers that must not reach "
              "each other's segments";
    }
    r.checks.push_back(w);
  }
  r.checks.push_back(memlock(h, d != nullptr ? d->name : "", o.memlock_needed, devices.size()));
  r.checks.push_back(hugepages(h));
  r.checks.push_back(versions(h, d));
  r.checks.push_back(gpu(h, d));
  r.checks.push_back(numa(h, d));
  r.checks.push_back(fork_safety(h));
  return r;
}

}  // namespace rdmakit::doctor
