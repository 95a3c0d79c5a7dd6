// SPDX-License-Identifier: Apache-2.0
#pragma once
// TCP for the bootstrap and control channel. Every operation takes a deadline: nothing here can
// block past it, whatever the peer does (stalls, trickles bytes, never answers).

#include <sys/socket.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/clock.hpp"
#include "common/stop.hpp"
#include "rdmakit/wire.hpp"

namespace rdmakit::detail {

/// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept;
  /// Gives up ownership without closing.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

/// "host:port", "[v6]:port", ":port" or "port" (an empty host: any address when listening).
struct HostPort {
  std::string host;
  std::uint16_t port = 0;
  [[nodiscard]] std::string to_string() const;
};
HostPort parse_host_port(const std::string& text, std::uint16_t default_port);
/// "localhost", or an address in 127.0.0.0/8, ::1 or ::ffff:127.0.0.0/104 (a name is not resolved:
/// false).
[[nodiscard]] bool loopback_host(const std::string& host) noexcept;

/// Connects to any address of `to` (IPv4 or IPv6), each attempt bounded by the deadline. With
/// `retry_refused`, a refused connection is retried every 100 ms until the deadline. A requested
/// `stop` ends it at once (Error with ECANCELED).
Fd tcp_connect(const HostPort& to, Deadline deadline, bool retry_refused = false, const Stop* stop = nullptr);
/// Listens on `at` (an empty host listens on all IPv6 and IPv4 addresses). Non-blocking fd.
Fd tcp_listen(const HostPort& at, int backlog);
/// Accepts one connection if one is waiting within `timeout`, else returns an empty Fd.
Fd tcp_accept(int listen_fd, std::chrono::milliseconds timeout, std::string* peer);
std::uint16_t local_port(int fd);
/// A local stream socket in the abstract namespace (`name` without the leading NUL: no file, gone
/// with the process), listening, non-blocking. One network namespace reaches it.
Fd unix_listen(const std::string& name, int backlog);
/// Connects to it by the deadline, or throws Error.
Fd unix_connect(const std::string& name, Deadline deadline);
/// Accepts one waiting connection without blocking (empty when none).
Fd unix_accept(int listen_fd);
/// The pid of the process at the other end of a local socket, as the kernel knows it (in this
/// process's PID namespace; 0 when it is not a local socket or has no pid here), and its user
/// in `uid` when given.
int peer_pid(int fd, uid_t* uid = nullptr) noexcept;
/// The socket's own IP address, without port ("10.0.0.1", "fe80::1"); empty if unknown.
std::string local_address(int fd);
std::string peer_address(int fd);
/// Makes `fd` non-blocking; throws Error naming `what` when it cannot.
void set_nonblocking(int fd, const char* what);
/// "10.0.0.1:5", "[fe80::1]:5"; without the port when `with_port` is false ("10.0.0.1",
/// "fe80::1"). An IPv4-mapped IPv6 address reads as IPv4.
std::string sockaddr_text(const sockaddr* sa, bool with_port = true);
/// The local address the kernel would send from to reach `to` (a numeric host), found without
/// sending anything; empty for a name or when there is no route.
std::string route_source(const HostPort& to);

/// Polls fd for `events` (a negative fd: nothing, a sleep) until the deadline or a requested
/// `stop`: true when fd is ready, false when the deadline passed; a stop throws ECANCELED naming
/// `what`. The one stop-aware wait that the bootstrap's and rdma_cm's waits share.
bool poll_until(int fd, short events, Deadline deadline, const Stop* stop, const char* what);
/// Both end at the deadline (ETIMEDOUT) or, while they wait, at a requested `stop` (ECANCELED).
void send_all(int fd, std::span<const std::uint8_t> bytes, Deadline deadline, const Stop* stop = nullptr);
void recv_exact(int fd, std::span<std::uint8_t> bytes, Deadline deadline, const Stop* stop = nullptr);

/// One framed message (recv_message in channel.hpp reads one).
struct Message {
  wire::Header header;
  std::vector<std::uint8_t> payload;
};
/// Reads what is there without blocking: the byte count, kRecvWouldBlock when nothing is, or
/// kRecvClosed on EOF or a socket error (the peer is gone either way; `error` says which: 0 for
/// EOF, else the errno, e.g. ETIMEDOUT when keepalive gave up).
inline constexpr long kRecvWouldBlock = -1;
inline constexpr long kRecvClosed = 0;
long recv_nonblocking(int fd, std::span<std::uint8_t> buf, int* error = nullptr) noexcept;
/// Sends what the socket takes now, without blocking: the byte count (0 when its buffer is
/// full), or kSendFailed with `error` set (EPIPE, ECONNRESET, ETIMEDOUT, ...).
inline constexpr long kSendFailed = -1;
long send_nonblocking(int fd, std::span<const std::uint8_t> bytes, int* error) noexcept;

/// The descriptors a recvmsg() took (SCM_RIGHTS), each owned now (closed unless kept).
std::vector<Fd> descriptors_of(msghdr& m);

/// Room for one descriptor in a sendmsg()'s control data (SCM_RIGHTS).
struct OneDescriptor {
  alignas(8) char control[24] = {};  // CMSG_SPACE(sizeof(int)) on Linux
  /// Makes `m` carry `fd`.
  void attach(msghdr& m, int fd) noexcept;
};

/// Waits up to `timeout` for `fd` to become readable (data, EOF or error).
bool wait_readable(int fd, std::chrono::milliseconds timeout) noexcept;

}  // namespace rdmakit::detail
