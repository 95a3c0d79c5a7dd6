// SPDX-License-Identifier: Apache-2.0
#include "bootstrap/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstring>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {
namespace {

int remaining_ms(Deadline deadline) {
  // Rounded up: a wait that ends before the deadline would poll again at once, in a loop.
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<long long>(left.count(), 1 << 30));
}

// Waits for `events` on fd until the deadline; throws ETIMEDOUT naming `what` when it passes.
void wait_for(int fd, short events, Deadline deadline, const char* what, const Stop* stop) {
  if (!poll_until(fd, events, deadline, stop, what)) {
    throw Error(what, ETIMEDOUT, "the deadline passed",
                "the peer is unreachable, too slow, or not speaking the rdmakit protocol");
  }
}

}  // namespace

bool poll_until(int fd, short events, Deadline deadline, const Stop* stop, const char* what) {
  for (;;) {
    if (stop != nullptr && stop->requested()) throw stopped_error(what);
    pollfd p[2] = {{fd, events, 0}, {stop != nullptr ? stop->fd() : -1, POLLIN, 0}};
    int ms = remaining_ms(deadline);
    if (stop != nullptr && stop->fd() < 0) ms = std::min(ms, 100);  // no eventfd: check in slices
    const int rc = ::poll(p, 2, ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw Error("poll", errno, what);
    }
    if (p[1].revents != 0) throw stopped_error(what);
    if (p[0].revents != 0) return true;
    if (Clock::now() >= deadline) return false;
  }
}

void set_nonblocking(int fd, const char* what) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) throw Error("fcntl(O_NONBLOCK)", errno, what);
}

std::string sockaddr_text(const sockaddr* sa, bool with_port) {
  char host[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    return with_port ? fmt::format("{}:{}", host, ntohs(in->sin_port)) : std::string(host);
  }
  if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {  // an IPv4 client of a dual-stack listener
      ::inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], host, sizeof host);
      return with_port ? fmt::format("{}:{}", host, ntohs(in6->sin6_port)) : std::string(host);
    }
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    return with_port ? fmt::format("[{}]:{}", host, ntohs(in6->sin6_port)) : std::string(host);
  }
  return "?";
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

Fd::~Fd() { reset(); }

void Fd::reset() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string HostPort::to_string() const {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port)
                                             : fmt::format("{}:{}", host, port);
}

bool loopback_host(const std::string& host) noexcept {
  if (host == "localhost") return true;
  // Addresses only, parsed: a name that merely starts with "127." may resolve anywhere.
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (::inet_pton(AF_INET6, host.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

HostPort parse_host_port(const std::string& text, std::uint16_t default_port) {
  HostPort hp{"", default_port};
  std::string port_text;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos) throw Error("parse address", EINVAL, fmt::format("'{}': missing ']'", text));
    hp.host = text.substr(1, close - 1);
    if (close + 1 < text.size()) {
      if (text[close + 1] != ':') throw Error("parse address", EINVAL, fmt::format("'{}': expected ':' after ']'", text));
      port_text = text.substr(close + 2);
    }
  } else if (const auto colon = text.rfind(':'); colon == std::string::npos) {
    // A bare number is a port, anything else a host.
    if (!text.empty() && text.find_first_not_of("0123456789") == std::string::npos) {
      port_text = text;
    } else {
      hp.host = text;
    }
  } else if (text.find(':') != colon) {
    hp.host = text;  // a bare IPv6 address without a port
  } else {
    hp.host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  if (!port_text.empty()) {
    unsigned value = 0;
    const auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), value);
    if (ec != std::errc{} || end != port_text.data() + port_text.size() || value > 65535) {
      throw Error("parse address", EINVAL, fmt::format("'{}': port must be 0..65535", text));
    }
    hp.port = static_cast<std::uint16_t>(value);
  }
  return hp;
}

namespace {
Fd connect_once(const HostPort& to, Deadline deadline, const Stop* stop, int& last_errno);
}  // namespace

Fd tcp_connect(const HostPort& to, Deadline deadline, bool retry_refused, const Stop* stop) {
  int last_errno = 0;
  for (;;) {
    if (Fd fd = connect_once(to, deadline, stop, last_errno)) return fd;
    if (!retry_refused || last_errno != ECONNREFUSED || Clock::now() + std::chrono::milliseconds{100} >= deadline) {
      break;
    }
    (void)poll_until(-1, 0, deadline_in(std::chrono::milliseconds{100}), stop, "connect");
  }
  const char* hint = last_errno == ECONNREFUSED ? "is the server running and listening on that port?"
                     : last_errno == ETIMEDOUT  ? "is the host reachable (routing, firewall)?"
                                                : "";
  throw Error("connect", last_errno, fmt::format("to {}", to.to_string()), hint);
}

namespace {

Fd connect_once(const HostPort& to, Deadline deadline, const Stop* stop, int& last_errno) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(to.port);
  if (const int rc = ::getaddrinfo(to.host.empty() ? "localhost" : to.host.c_str(), port.c_str(),
                                   &hints, &res);
      rc != 0) {
    throw Error("getaddrinfo", 0, fmt::format("{}: {}", to.to_string(), ::gai_strerror(rc)),
                "check the host name");
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(res, &::freeaddrinfo);
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      last_errno = errno;
      continue;
    }
    set_nonblocking(fd.get(), "bootstrap socket");
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last_errno = errno;
        continue;
      }
      if (!poll_until(fd.get(), POLLOUT, deadline, stop, "connect")) {
        last_errno = ETIMEDOUT;
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last_errno = err;
        continue;
      }
    }
    int one = 1;  // small control messages must not wait for Nagle
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
  }
  return {};
}

}  // namespace

namespace {

sockaddr_un abstract(const std::string& name, socklen_t& len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof a.sun_path) {
    throw Error("socket", EINVAL, fmt::format("abstract socket name of {} bytes", name.size()));
  }
  a.sun_path[0] = '\0';  // the abstract namespace
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

}  // namespace

Fd unix_listen(const std::string& name, int backlog) {
  socklen_t len = 0;
  const sockaddr_un a = abstract(name, len);
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) throw Error("socket", errno, "a local listening socket");
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), len) != 0) {
    throw Error("bind", errno, fmt::format("local socket @{}", name));
  }
  if (::listen(fd.get(), backlog) != 0) throw Error("listen", errno, fmt::format("local socket @{}", name));
  return fd;
}

Fd unix_connect(const std::string& name, Deadline deadline) {
  socklen_t len = 0;
  const sockaddr_un a = abstract(name, len);
  for (;;) {
    Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw Error("socket", errno, "a local socket");
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a), len) == 0) return fd;
    // A full backlog answers EAGAIN: the listener takes it in a moment.
    if (errno != EAGAIN || Clock::now() >= deadline) {
      throw Error("connect", errno, fmt::format("to local socket @{}", name),
                  errno == ECONNREFUSED || errno == ENOENT
                      ? "the engine is not in this network namespace (a container of its own), or it has gone"
                      : "");
    }
    ::poll(nullptr, 0, 5);
  }
}

Fd unix_accept(int listen_fd) { return Fd(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK)); }

int peer_pid(int fd, uid_t* uid) noexcept {
  ucred c{};
  socklen_t len = sizeof c;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0 || len != sizeof c) return 0;
  if (uid != nullptr) *uid = c.uid;
  return c.pid;
}

Fd tcp_listen(const HostPort& at, int backlog) {
  addrinfo hints{};
  hints.ai_family = at.host.empty() ? AF_INET6 : AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(at.port);
  if (const int rc = ::getaddrinfo(at.host.empty() ? nullptr : at.host.c_str(), port.c_str(),
                                   &hints, &res);
      rc != 0) {
    throw Error("getaddrinfo", 0, fmt::format("{}: {}", at.to_string(), ::gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(res, &::freeaddrinfo);
  int last_errno = 0;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      last_errno = errno;
      continue;
    }
    int one = 1, zero = 0;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (ai->ai_family == AF_INET6) {
      // Any-address IPv6 also takes IPv4 clients (as ::ffff:a.b.c.d).
      ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    }
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), backlog) != 0) {
      last_errno = errno;
      continue;
    }
    set_nonblocking(fd.get(), "bootstrap socket");
    return fd;
  }
  throw Error("listen", last_errno, fmt::format("on {}", at.to_string()),
              last_errno == EADDRINUSE ? "another process listens on that port; choose another"
                                       : "");
}

Fd tcp_accept(int listen_fd, std::chrono::milliseconds timeout, std::string* peer) {
  if (!wait_readable(listen_fd, timeout)) return {};
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  Fd fd(::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (!fd) {
    // The client gave up between poll and accept (retry at once), or descriptors or memory ran
    // out: back off a little so the accept loop does not spin while the condition lasts.
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) ::poll(nullptr, 0, 50);
    return {};
  }
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (peer != nullptr) *peer = sockaddr_text(reinterpret_cast<sockaddr*>(&ss));
  return fd;
}

std::uint16_t local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) throw Error("getsockname", errno, "");
  return ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

std::string local_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return {};
  return sockaddr_text(reinterpret_cast<sockaddr*>(&ss), false);
}

std::string route_source(const HostPort& to) {
  // Numeric addresses only: a name would need a resolver, which may block.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(to.port == 0 ? 9 : to.port);
  if (to.host.empty() || ::getaddrinfo(to.host.c_str(), port.c_str(), &hints, &res) != 0) return {};
  std::string out;
  // connect() on a datagram socket only asks the kernel for the route: nothing is sent.
  if (Fd fd(::socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0)); fd && ::connect(fd.get(), res->ai_addr, res->ai_addrlen) == 0) {
    out = local_address(fd.get());
  }
  ::freeaddrinfo(res);
  return out;
}

std::string peer_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  return sockaddr_text(reinterpret_cast<sockaddr*>(&ss));
}

void send_all(int fd, std::span<const std::uint8_t> bytes, Deadline deadline, const Stop* stop) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n > 0) {
      bytes = bytes.subspan(static_cast<size_t>(n));
    } else if (errno == EAGAIN || errno == EINTR) {
      wait_for(fd, POLLOUT, deadline, "bootstrap send", stop);
    } else {
      // errno first: peer_address() calls getpeername(), which fails (ENOTCONN) on a reset socket.
      const int err = errno;
      throw Error("bootstrap send", err, peer_address(fd),
                  err == EPIPE || err == ECONNRESET ? "the peer closed the connection" : "");
    }
  }
}

void recv_exact(int fd, std::span<std::uint8_t> bytes, Deadline deadline, const Stop* stop) {
  const size_t want = bytes.size();
  while (!bytes.empty()) {
    const ssize_t n = ::recv(fd, bytes.data(), bytes.size(), 0);
    if (n > 0) {
      bytes = bytes.subspan(static_cast<size_t>(n));
    } else if (n == 0) {
      throw Error("bootstrap receive", ECONNRESET,
                  fmt::format("{} closed the connection after {} of {} bytes", peer_address(fd),
                              want - bytes.size(), want),
                  "the peer exited or rejected this connection; see its log");
    } else if (errno == EAGAIN || errno == EINTR) {
      if (Clock::now() >= deadline) {
        // Say how far it got: nothing at all is a silent client, part of a message a truncated
        // (or trickled) one.
        throw Error("bootstrap receive", ETIMEDOUT,
                    fmt::format("{}: {} of {} bytes arrived before the handshake deadline",
                                peer_address(fd), want - bytes.size(), want),
                    "a stalled or truncated message (a slow client, or not an rdmakit peer)");
      }
      try {
        wait_for(fd, POLLIN, deadline, "bootstrap receive", stop);
      } catch (const Error& e) {
        if (e.sys_errno() != ETIMEDOUT) throw;
      }
    } else {
      const int err = errno;  // before peer_address(), as in send_all()
      throw Error("bootstrap receive", err, peer_address(fd),
                  err == ECONNRESET ? "the peer reset the connection: it exited, or its listener refused this client" : "");
    }
  }
}

long recv_nonblocking(int fd, std::span<std::uint8_t> buf, int* error) noexcept {
  for (;;) {
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
    if (n > 0) return static_cast<long>(n);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return kRecvWouldBlock;
    if (error != nullptr) *error = n < 0 ? errno : 0;
    return kRecvClosed;
  }
}

long send_nonblocking(int fd, std::span<const std::uint8_t> bytes, int* error) noexcept {
  for (;;) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) return static_cast<long>(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    *error = errno;
    return kSendFailed;
  }
}

bool wait_readable(int fd, std::chrono::milliseconds timeout) noexcept {
  pollfd p{fd, POLLIN, 0};
  int rc;
  while ((rc = ::poll(&p, 1, static_cast<int>(timeout.count()))) < 0 && errno == EINTR) {
  }
  return rc > 0;
}

std::vector<Fd> descriptors_of(msghdr& m) {
  std::vector<Fd> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < k; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      fds.emplace_back(fd);
    }
  }
  return fds;
}

void OneDescriptor::attach(msghdr& m, int fd) noexcept {
  static_assert(sizeof control >= CMSG_SPACE(sizeof(int)) && alignof(OneDescriptor) >= alignof(cmsghdr));
  m.msg_control = control;
  m.msg_controllen = CMSG_SPACE(sizeof(int));
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
}

}  // namespace rdmakit::detail
