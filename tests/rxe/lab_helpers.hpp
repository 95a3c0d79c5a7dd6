// SPDX-License-Identifier: Apache-2.0
#pragma once
// Helpers the lab's gtest binaries share: device resource counts, open fds, raw bootstrap
// sockets (to play a misbehaving peer byte by byte).
#include <arpa/inet.h>
#include <dirent.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "rdmakit/connection.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/device.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/wire.hpp"


namespace lab {

/// The peer program (tests/rxe/fault_peer.cpp, named by FAULT_PEER) as a child process, with a
/// pipe from its stdout; SIGKILLed and reaped when it goes. `ok()` is false when it could not
/// be started.
struct Child {
  pid_t pid = -1;
  FILE* out = nullptr;
  Child(const std::string& mode, const std::string& where, const std::string& option = {}) {
    int fds[2];
    if (::pipe(fds) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    const std::string bin = std::string(std::getenv("FAULT_PEER") ? std::getenv("FAULT_PEER") : "");
    char* argv[] = {const_cast<char*>(bin.c_str()), const_cast<char*>(mode.c_str()),
                    const_cast<char*>(where.c_str()), option.empty() ? nullptr : const_cast<char*>(option.c_str()),
                    nullptr};
    if (posix_spawn(&pid, bin.c_str(), &fa, nullptr, argv, environ) != 0) pid = -1;
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    out = ::fdopen(fds[0], "r");
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  [[nodiscard]] bool ok() const { return pid > 0; }
  /// Reads lines until one starts with `word` (true) or the child's stdout closes (false).
  bool await(const char* word) {
    if (out == nullptr) return false;
    char line[128];
    while (std::fgets(line, sizeof line, out) != nullptr) {
      if (std::strncmp(line, word, std::strlen(word)) == 0) return true;
    }
    return false;
  }
  void kill() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    int st = 0;
    ::waitpid(pid, &st, 0);
    pid = -1;
  }
  ~Child() {
    kill();
    if (out != nullptr) std::fclose(out);
  }
};

/// How many rounds a soak runs: `ci` by default, `full` with RDMAKIT_TEST_LONG=1 (what
/// scripts/test --long sets). CI runs the CI size every time; the full one is run by hand and
/// its figures are in docs/development.md.
inline int soak(int ci, int full) {
  const char* v = std::getenv("RDMAKIT_TEST_LONG");
  return v != nullptr && v[0] == '1' ? full : ci;
}

/// The connection method a suite case asks for: RDMAKIT_TEST_METHOD=rdma_cm runs a case that
/// uses quiet() (and the fault peer) through rdma_cm; the default is the TCP bootstrap.
inline rdmakit::ConnectMethod test_method() {
  const char* m = std::getenv("RDMAKIT_TEST_METHOD");
  return m != nullptr && *m != '\0' ? rdmakit::parse_connect_method(m) : rdmakit::ConnectMethod::tcp;
}

/// The transport the engine tests run over: RDMAKIT_TEST_TRANSPORT (rdma, tcp or shm; rdma by
/// default, in the lab). Over tcp and shm the same tests run on the host, without a VM.
inline std::vector<rdmakit::Transport> test_transports() {
  const char* t = std::getenv("RDMAKIT_TEST_TRANSPORT");
  if (t == nullptr || *t == '\0') return {};
  return {rdmakit::parse_transport(t)};
}
/// How shm links copy in these tests: RDMAKIT_TEST_SHM_COPY (auto, attach or ring; auto by
/// default). The same shm cases run once by cross-memory attach and once through the ring.
inline rdmakit::ShmCopy test_shm_copy() {
  const char* c = std::getenv("RDMAKIT_TEST_SHM_COPY");
  return c == nullptr || *c == '\0' ? rdmakit::ShmCopy::automatic : rdmakit::parse_shm_copy(c);
}
/// Whether shm peers map the memory the tests' engines allocate: RDMAKIT_TEST_SHM_MAP (1 by
/// default; 0: every copy goes by attach or the ring, which the suites then cover).
inline bool test_shm_map() {
  const char* m = std::getenv("RDMAKIT_TEST_SHM_MAP");
  return m == nullptr || *m != '0';
}
inline bool soft_transport() {
  const auto t = test_transports();
  return !t.empty() && t[0] != rdmakit::Transport::rdma;
}

/// The address a test connects to in its own VM: loopback over TCP; over rdma_cm the VM's own
/// address (the CM resolves addresses to RDMA devices, and no device has 127.0.0.1).
inline std::string here() {
  const char* ip = std::getenv("RDMAKIT_LAB_IP");
  return test_method() == rdmakit::ConnectMethod::rdma_cm && ip != nullptr ? ip : "127.0.0.1";
}
/// here() with a port: where a test in its own VM connects to a port.
inline std::string here(std::uint16_t port) { return here() + ":" + std::to_string(port); }

/// Over rdma_cm, librdmacm opens a context of each device the first time the process uses the
/// CM and keeps it until the process exits. A resource or fd count taken before that would see it
/// as a leak of whatever test came first, so each count first resolves a route once.
inline void settle_cm() {
  if (test_method() != rdmakit::ConnectMethod::rdma_cm) return;
  static const bool settled = [] {
    try {
      (void)rdmakit::resolve_route(here(), std::chrono::seconds(5));
    } catch (const rdmakit::Error&) {
      // The test that needs the CM reports the failure with its own context.
    }
    return true;
  }();
  (void)settled;
}

// `rdma resource show` summary for the device: pd, cq, qp, mr, ... counts (all processes).
inline std::map<std::string, long> rdma_resources() {
  settle_cm();
  std::map<std::string, long> out;
  FILE* p = ::popen("rdma resource show 2>&1", "r");
  if (p == nullptr) return out;
  char line[512];
  while (std::fgets(line, sizeof line, p) != nullptr) {
    std::istringstream in(line);
    std::string word, prev;
    while (in >> word) {
      if (!prev.empty() && word.find_first_not_of("0123456789") == std::string::npos) {
        out[prev] += std::stol(word);
      }
      prev = word;
    }
  }
  ::pclose(p);
  return out;
}

inline int open_fds() {
  settle_cm();
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

/// A TCP listening socket on IPv4 address `ip` at a free port (set in `port`), or -1.
inline int listen_tcp(const std::string& ip, std::uint16_t* port) {
  const int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
  socklen_t len = sizeof a;
  if (::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(l, 16) != 0 ||
      ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(l);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return l;
}

/// A blocking TCP connection to ip:port with a receive timeout; -1 on failure.
inline int raw_connect(const std::string& ip, std::uint16_t port, int recv_timeout_s = 5) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{recv_timeout_s, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/// Everything the peer sends until it closes (or the receive timeout), split into messages.
inline std::vector<std::pair<rdmakit::wire::Header, std::vector<std::uint8_t>>> read_messages(int fd) {
  std::vector<std::uint8_t> bytes;
  std::uint8_t buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    bytes.insert(bytes.end(), buf, buf + n);
  }
  std::vector<std::pair<rdmakit::wire::Header, std::vector<std::uint8_t>>> out;
  std::size_t at = 0;
  while (bytes.size() - at >= rdmakit::wire::kHeaderSize) {
    const auto h = rdmakit::wire::decode_header(std::span(bytes).subspan(at));
    if (bytes.size() - at - rdmakit::wire::kHeaderSize < h.length) break;
    out.emplace_back(h, std::vector<std::uint8_t>(bytes.begin() + static_cast<long>(at + rdmakit::wire::kHeaderSize),
                                                  bytes.begin() + static_cast<long>(at + rdmakit::wire::kHeaderSize + h.length)));
    at += rdmakit::wire::kHeaderSize + h.length;
  }
  return out;
}

/// A connection config that logs nothing and retries a refused connect until its deadline.
inline rdmakit::ConnectionConfig quiet() {
  rdmakit::ConnectionConfig cfg;
  cfg.log = [](std::string_view) {};
  cfg.retry_refused = true;
  cfg.method = test_method();
  return cfg;
}

/// A second IPv4 address on eth0 (a /24) for the scope of the object.
struct ExtraAddress {
  explicit ExtraAddress(std::string a) : address(std::move(a)) {
    ok = std::system(("ip addr add " + address + "/24 dev eth0").c_str()) == 0;
  }
  ExtraAddress(const ExtraAddress&) = delete;
  ExtraAddress& operator=(const ExtraAddress&) = delete;
  ~ExtraAddress() { remove(); }
  bool remove() {
    if (!ok) return true;
    ok = false;
    return std::system(("ip addr del " + address + "/24 dev eth0").c_str()) == 0;
  }
  std::string address;
  bool ok = false;
};

inline bool send_bytes(int fd, const std::vector<std::uint8_t>& b) {
  return ::send(fd, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size());
}

}  // namespace lab
