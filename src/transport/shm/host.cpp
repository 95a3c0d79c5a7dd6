// SPDX-License-Identifier: Apache-2.0
// Who may be an shm peer (host.hpp).
#include "transport/shm/host.hpp"

#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <span>

#include <sodium.h>

#include <fmt/format.h>

#include "bootstrap/session.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail::shm {

wire::TransportBlock this_host() {
  wire::TransportBlock t;
  t.pid = static_cast<std::uint32_t>(::getpid());
  // Equal for two processes only on one kernel (its boot id), in one network namespace (a local
  // socket reaches), one PID namespace (a pid names the same process) and as one user (one may
  // copy from the other): a hash, so nothing of it is readable from the HELLO.
  std::string what;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, what);
  struct stat st{};
  for (const char* ns : {"/proc/self/ns/net", "/proc/self/ns/pid"}) {
    what += ::stat(ns, &st) == 0 ? fmt::format("|{}:{}", st.st_dev, st.st_ino) : std::string("|?");
  }
  what += fmt::format("|uid {}", ::geteuid());
  crypto_generichash(t.host.data(), t.host.size(), reinterpret_cast<const unsigned char*>(what.data()), what.size(), nullptr, 0);
  return t;
}

namespace {

// With a key, the proof is the session's own (a keyed hash of its binding): a value no process
// but the one holding this session can have in its memory, so a client cannot point the server's
// cross-memory copies at another process. Without one, a random secret whose hash the HELLO
// carries (no more than keyless mode gives anyway: anyone who reaches the port is served).
std::array<std::uint8_t, 32> hash_of(std::span<const std::uint8_t> bytes) {
  std::array<std::uint8_t, 32> out{};
  crypto_generichash(out.data(), out.size(), bytes.data(), bytes.size(), nullptr, 0);
  return out;
}

std::array<std::uint8_t, 32> session_proof(const Session& s) {
  static constexpr char kLabel[] = "rdmakit shm proof";
  std::array<std::uint8_t, 32> out{};
  crypto_generichash(out.data(), out.size(), reinterpret_cast<const unsigned char*>(kLabel), sizeof kLabel - 1,
                     s.binding().data(), s.binding().size());
  return out;
}

// /proc/sys/kernel/yama/ptrace_scope (0 without Yama): at 1 and above, cross-memory attach
// reaches only a process's descendants.
int yama_scope() {
  std::ifstream in("/proc/sys/kernel/yama/ptrace_scope");
  int v = 0;
  return in >> v ? v : 0;
}

}  // namespace

void prove(std::array<std::uint8_t, 32>& secret, wire::TransportBlock& t, const Session* session) {
  if (session != nullptr) {
    secret = session_proof(*session);
    t.proof = {};
  } else {
    randombytes_buf(secret.data(), secret.size());
    t.proof = hash_of(secret);
  }
  t.proof_addr = reinterpret_cast<std::uint64_t>(secret.data());
}

void verify(const wire::TransportBlock& t, int pid, const Session* session) {
  if (pid <= 0) {
    throw Error("shm", EACCES, "the link's stream did not come over this engine's local socket, so no process is known to "
                               "copy from");
  }
  std::array<std::uint8_t, 32> got{};
  iovec local{got.data(), got.size()};
  iovec remote{reinterpret_cast<void*>(t.proof_addr), got.size()};
  if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(got.size())) {
    const int err = errno;
    throw Error("process_vm_readv", err, fmt::format("reading the shm proof of process {}", pid),
                err == EPERM ? "this process may not read the peer's memory (another user, or Yama's ptrace_scope)" : "");
  }
  const std::array<std::uint8_t, 32> want = session != nullptr ? session_proof(*session) : t.proof;
  const std::array<std::uint8_t, 32> seen = session != nullptr ? got : hash_of(got);
  if (sodium_memcmp(want.data(), seen.data(), want.size()) != 0) {
    throw Error("shm", EACCES, fmt::format("process {} (at the local socket's other end) does not hold this link's session", pid));
  }
}

std::string why_no_attach() {
  if (const int scope = yama_scope(); scope > 0) {
    return fmt::format("Yama's ptrace_scope is {}, so no process may copy from another here", scope);
  }
  char from = 1, to = 0;
  iovec local{&to, 1}, remote{&from, 1};
  if (::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) != 1) {
    return fmt::format("process_vm_readv is refused here ({}: a seccomp filter, as a container's)", errno_name(errno));
  }
  return {};
}

}  // namespace rdmakit::detail::shm
