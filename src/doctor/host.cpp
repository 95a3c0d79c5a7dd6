// SPDX-License-Identifier: Apache-2.0
// What the host itself says: netdevs and their addresses, limits, capabilities, huge pages,
// versions, GPU drivers. Everything here reads the kernel's files or asks libc; nothing throws
// for a missing file (a missing file is a finding).
#include <arpa/inet.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <infiniband/verbs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <vector>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "rdmakit/doctor.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit::doctor {
namespace {

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

int prefix_len(const sockaddr* mask) {
  if (mask == nullptr) return 0;
  const auto* b = mask->sa_family == AF_INET
                      ? reinterpret_cast<const std::uint8_t*>(&reinterpret_cast<const sockaddr_in*>(mask)->sin_addr)
                      : reinterpret_cast<const std::uint8_t*>(&reinterpret_cast<const sockaddr_in6*>(mask)->sin6_addr);
  const int n = mask->sa_family == AF_INET ? 4 : 16;
  int bits = 0;
  for (int i = 0; i < n; ++i) bits += __builtin_popcount(b[i]);
  return bits;
}

std::uint64_t limit_bytes(rlim_t v) {
  return v == RLIM_INFINITY ? std::numeric_limits<std::uint64_t>::max() : static_cast<std::uint64_t>(v);
}

}  // namespace

std::optional<Netdev> netdev_info(const std::string& name) {
  if (name.empty() || !std::filesystem::exists("/sys/class/net/" + name)) return std::nullopt;
  Netdev n;
  n.name = name;
  n.operstate = read_line("/sys/class/net/" + name + "/operstate");
  try {
    n.mtu = static_cast<std::uint32_t>(std::stoul(read_line("/sys/class/net/" + name + "/mtu")));
  } catch (const std::exception&) {
  }
  const unsigned flags = [&] {
    try {
      return static_cast<unsigned>(std::stoul(read_line("/sys/class/net/" + name + "/flags"), nullptr, 16));
    } catch (const std::exception&) {
      return 0u;
    }
  }();
  // Virtual NICs without carrier reporting say "unknown" while working.
  n.up = (flags & IFF_UP) != 0 && (n.operstate == "up" || n.operstate == "unknown");
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> guard(list, ::freeifaddrs);
    for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
      if (a->ifa_addr == nullptr || name != a->ifa_name) continue;
      char buf[INET6_ADDRSTRLEN] = {};
      if (a->ifa_addr->sa_family == AF_INET) {
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
      } else if (a->ifa_addr->sa_family == AF_INET6) {
        ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr, buf, sizeof buf);
      } else {
        continue;
      }
      n.addresses.push_back(fmt::format("{}/{}", buf, prefix_len(a->ifa_netmask)));
    }
  }
  return n;
}

HostFacts host_facts() {
  HostFacts h;
  namespace fs = std::filesystem;
  std::error_code ec;
  h.dev_infiniband = fs::is_directory("/dev/infiniband", ec);
  if (h.dev_infiniband) {
    for (const auto& e : fs::directory_iterator("/dev/infiniband", ec)) {
      const std::string p = e.path().string();
      if (e.path().filename().string().rfind("uverbs", 0) != 0) continue;
      h.uverbs.push_back(p);
      if (::access(p.c_str(), R_OK | W_OK) != 0) h.inaccessible.push_back(p);
    }
    std::sort(h.uverbs.begin(), h.uverbs.end());
  }
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
    h.memlock_soft = limit_bytes(rl.rlim_cur);
    h.memlock_hard = limit_bytes(rl.rlim_max);
  }
  // CapEff is a hex mask; CAP_IPC_LOCK is bit 14.
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("CapEff:", 0) == 0) {
      try {
        h.cap_ipc_lock = ((std::stoull(line.substr(7), nullptr, 16) >> 14) & 1) != 0;
      } catch (const std::exception&) {
      }
    }
  }
  const detail::HugePages hp = detail::huge_pages();
  h.hugepages_total = hp.total;
  h.hugepages_free = hp.free;
  h.hugepage_bytes = hp.page_bytes;
  // rdma-core ships libibverbs.so.1.<abi>.<rdma-core major>.<minor>: the version is in the name
  // of the file this process actually loaded.
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&ibv_get_device_list), &info) != 0 && info.dli_fname != nullptr) {
    // "libibverbs.so.1.14.44.0" -> fields after ".so.": 1, 14, 44, 0 -> rdma-core 44.0
    const std::string real = fs::canonical(info.dli_fname, ec).filename().string();
    const auto so = real.find(".so.");
    if (so != std::string::npos) {
      std::vector<std::string> parts;
      std::istringstream is(real.substr(so + 4));
      for (std::string part; std::getline(is, part, '.');) parts.push_back(part);
      if (parts.size() == 4) h.rdma_core = parts[2] + "." + parts[3];
    }
  }
  utsname u{};
  if (::uname(&u) == 0) h.kernel = u.release;
  h.nvidia_gpu = fs::is_directory("/proc/driver/nvidia/gpus", ec) &&
                 !fs::is_empty("/proc/driver/nvidia/gpus", ec);
  h.nvidia_peermem = fs::exists("/sys/module/nvidia_peermem", ec);
  switch (ibv_is_fork_initialized()) {
    case IBV_FORK_UNNEEDED: h.fork_mode = "unneeded"; break;
    case IBV_FORK_ENABLED: h.fork_mode = "enabled"; break;
    default: h.fork_mode = "disabled"; break;
  }
  int nodes = 0;
  for (const auto& e : fs::directory_iterator("/sys/devices/system/node", ec)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("node", 0) == 0 && f.size() > 4 && std::isdigit(static_cast<unsigned char>(f[4]))) ++nodes;
  }
  h.numa_nodes = std::max(nodes, 1);
  return h;
}

}  // namespace rdmakit::doctor
