// SPDX-License-Identifier: Apache-2.0
#pragma once
// rdmakit doctor: explain an RDMA setup before it fails. Local checks of this host, a comparison
// of both sides of a connection, and a specific diagnosis (with a fix) for each failure class.

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "rdmakit/connection.hpp"
#include "rdmakit/device.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/wire.hpp"

// Everything declared here is the shared library's API (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

namespace rdmakit::doctor {

/// How a check came out. `skip`: not applicable here (it says why); it never fails a run.
enum class Verdict : std::uint8_t { ok, skip, warn, fail };
/// "ok", "skip", "warn", "fail".
[[nodiscard]] const char* to_string(Verdict v) noexcept;

/// One check: what was looked at, what was found, and (unless ok) how to fix it.
struct Check {
  std::string id;     ///< stable name, e.g. "memlock", "gid", "peer.mtu"
  std::string title;  ///< human name, e.g. "locked-memory limit"
  Verdict verdict = Verdict::ok;
  std::string detail;  ///< what was found
  std::string fix;     ///< what to do about it (empty when ok or skip)
};

struct Report {
  std::vector<Check> checks;
  /// The worst verdict (ok for an empty report).
  [[nodiscard]] Verdict worst() const noexcept;
  /// 0 when nothing is worse than skip, 1 when the worst is a warning, 2 for a failure.
  [[nodiscard]] int exit_status() const noexcept;
};

/// An Ethernet netdev as the kernel sees it (the RoCE side of a port).
struct Netdev {
  std::string name;
  bool up = false;                     ///< IFF_UP and operstate up
  std::string operstate;               ///< "up", "down", ...
  std::uint32_t mtu = 0;               ///< bytes
  std::vector<std::string> addresses;  ///< "198.18.0.1/24", "fe80::1/64"
};
/// The netdev `name`, or nullopt when there is none.
[[nodiscard]] std::optional<Netdev> netdev_info(const std::string& name);

/// Facts about this host that RDMA depends on.
struct HostFacts {
  bool dev_infiniband = false;            ///< /dev/infiniband exists
  std::vector<std::string> uverbs;        ///< /dev/infiniband/uverbs* found
  std::vector<std::string> inaccessible;  ///< of those, the ones this process cannot open
  std::uint64_t memlock_soft = 0;         ///< bytes; UINT64_MAX: unlimited
  std::uint64_t memlock_hard = 0;
  bool cap_ipc_lock = false;  ///< the kernel does not enforce the limit on this process
  std::uint64_t hugepages_total = 0, hugepages_free = 0, hugepage_bytes = 0;
  std::string rdma_core;  ///< rdma-core version, from libibverbs' file name ("44.0")
  std::string kernel;     ///< uname -r
  bool nvidia_gpu = false;      ///< /proc/driver/nvidia/gpus has an entry
  bool nvidia_peermem = false;  ///< the nvidia_peermem module is loaded
  int numa_nodes = 1;
  /// What a fork() does to registered memory (ibv_is_fork_initialized): "unneeded" (the kernel
  /// copies pinned pages for the child: Linux 5.13+ with rdma-core 35+), "enabled"
  /// (ibv_fork_init or RDMAV_FORK_SAFE), or "disabled" (a child can take the parent's pages).
  std::string fork_mode;
};
[[nodiscard]] HostFacts host_facts();

struct Options {
  std::string device;  ///< empty: the one rdmakit would pick
  std::uint8_t port = 0;
  GidSelector gid;
  /// Locked memory a typical connection needs: rdmakit bench's default buffers (2 x 8 MiB) and
  /// queues. The memlock check registers this much to see whether it really can.
  std::uint64_t memlock_needed = 20u << 20;
  /// The fabric settings a connection would use (ConnectionConfig's): shown, with the time a
  /// dead peer takes to be noticed, and checked where the port shows a mismatch.
  std::uint8_t traffic_class = 0;
  std::uint8_t service_level = 0;
  std::uint16_t pkey_index = 0;
  std::chrono::milliseconds ack_timeout{ConnectionConfig{}.ack_timeout};
  std::uint8_t retry_count = ConnectionConfig{}.retry_count;
};

/// The local checks: /dev/infiniband, devices and ports, the GID, MTUs, the locked-memory limit
/// (with a real registration), huge pages, rdma-core and kernel, GPU memory (nvidia_peermem,
/// dma-buf MRs), the NIC's NUMA node.
[[nodiscard]] Report check_local(const Options& options);

/// What a peer tells a doctor about itself beyond its HELLO (the doctor listener sends it).
struct PeerFacts {
  std::string host;
  std::optional<std::uint64_t> memlock;  ///< bytes, UINT64_MAX unlimited
  bool cap_ipc_lock = false;
  std::optional<Netdev> netdev;
};

/// Compares both sides' parameters: link layer, RoCE version, whether the GIDs can reach each
/// other (address family, IPv4 subnet), MTUs and the path MTU, and the peer's memlock when known.
[[nodiscard]] Report compare_peers(const wire::EndpointInfo& local,
                                   const std::optional<Netdev>& local_netdev,
                                   const wire::EndpointInfo& remote, const PeerFacts& remote_facts);

/// A specific diagnosis for a failed completion (RETRY_EXC_ERR, REM_ACCESS_ERR, RNR, ...), using
/// what the comparison found when given.
[[nodiscard]] Check diagnose(const Completion& c, const Report* comparison = nullptr);
/// A specific diagnosis for a setup error (refused or timed-out bootstrap, version mismatch,
/// rejected handshake, QP transition, registration, device).
[[nodiscard]] Check diagnose(const Error& e);

struct PeerOptions {
  Options local;
  std::chrono::milliseconds timeout{10'000};
  /// Round trips for the latency measurement.
  std::uint32_t rtt_samples = 200;
  std::function<void(const TraceEvent&)> trace;
  std::vector<std::uint8_t> psk;  ///< the listener's pre-shared key, if it has one
  ConnectMethod method = ConnectMethod::tcp;  ///< the listener's: TCP bootstrap or rdma_cm
};

/// Two-sided doctor: connects to `host_port` (a doctor listener or any rdmakit listener),
/// compares both sides, runs a tiny WRITE, READ and SEND, measures the round trip, and turns any
/// failure into a diagnosis. Never throws for a problem of the peer or the network: that is a
/// failed check.
[[nodiscard]] Report check_peer(const std::string& host_port, const PeerOptions& options);

/// The listening side of `rdmakit doctor --listen`: what each client connection is set up with
/// (a small buffer the peer may read and write, one posted receive) ...
[[nodiscard]] Connection::Setup listener_setup();
/// ... and the service it gets: sends this host's facts, echoes what the peer's SEND carried,
/// and returns when the peer closes or `timeout` passes.
void serve(Connection& c, std::chrono::milliseconds timeout);

}  // namespace rdmakit::doctor
#pragma GCC visibility pop
