// SPDX-License-Identifier: Apache-2.0
#include "bootstrap/channel.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {

namespace {

int whole_seconds(std::chrono::milliseconds d) {
  return static_cast<int>(std::max<long long>(1, (d.count() + 999) / 1000));
}

}  // namespace

void TcpChannel::send_all(std::span<const std::uint8_t> bytes, Deadline deadline) {
  detail::send_all(fd_.get(), bytes, deadline, stop_.get());
}

long TcpChannel::send_some(std::span<const std::uint8_t> bytes, int* error) noexcept {
  return detail::send_nonblocking(fd_.get(), bytes, error);
}

void TcpChannel::recv_exact(std::span<std::uint8_t> bytes, Deadline deadline) {
  detail::recv_exact(fd_.get(), bytes, deadline, stop_.get());
}

long TcpChannel::recv_nonblocking(std::span<std::uint8_t> buf, int* error) noexcept {
  return detail::recv_nonblocking(fd_.get(), buf, error);
}

std::string TcpChannel::local_address() const { return detail::local_address(fd_.get()); }

// TCP keepalive does the heartbeat: after `interval` with nothing from the peer's host, a probe
// every `interval`; TCP_USER_TIMEOUT ends the connection when nothing has been acknowledged for
// `timeout` (with probes out, or with data unacknowledged). The socket then reports ETIMEDOUT.
// The probes are answered by the peer's kernel: no thread and no call into rdmakit on either side.
void TcpChannel::keepalive(std::chrono::milliseconds interval_ms, std::chrono::milliseconds timeout) {
  if (interval_ms.count() == 0) return;
  const int fd = fd_.get();
  const int on = 1;
  const int interval = whole_seconds(interval_ms);
  const int probes = std::max(1, whole_seconds(timeout) / interval);
  const auto user_timeout = static_cast<unsigned>(timeout.count());
  if (::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &interval, sizeof interval) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout) != 0) {
    throw Error("setsockopt(keepalive)", errno,
                fmt::format("interval {} s, timeout {} ms", interval, timeout.count()));
  }
}

VersionRefused::VersionRefused(const std::string& peer, std::uint16_t theirs, std::uint16_t spoken,
                               const std::string& reason)
    : Error("bootstrap handshake", EPROTONOSUPPORT,
            fmt::format("{} speaks wire version {} and refused {}: {}", peer, theirs, spoken, reason),
            "it runs the previous rdmakit: this side connects again in its version"),
      version(theirs) {}

NewerServer::NewerServer(const std::string& peer, std::uint16_t spoken)
    : Error("bootstrap authentication", EACCES,
            fmt::format("{}: the server speaks a wire version newer than {}, yet this client's version {} was refused "
                        "before: the refusal was forged (a downgrade), or came from another process at the same address",
                        peer, spoken, wire::kVersion),
            "behind a load balancer or virtual IP whose backends run different rdmakit versions, finish the upgrade; "
            "otherwise something between the two hosts rewrites the handshake") {}

void check_version_refusal(const Channel& ch, const Message& m, const std::string& peer) {
  if (m.header.type != wire::MessageType::reject) return;
  const std::string reason = wire::decode_reject(m.payload);
  if (wire::refused_version(m.header, reason, ch.send_version())) throw VersionRefused(peer, m.header.version, ch.send_version(), reason);
}

Message recv_message(Channel& ch, Deadline deadline) {
  std::uint8_t head[wire::kHeaderSize];
  ch.recv_exact(head, deadline);
  // A server's first read: the client's version is the connection's from its header on, so a
  // refusal of what follows (an unknown type, an oversized or cut payload) is in a version the
  // client reads.
  if (const auto v = wire::header_version(head); ch.version() == 0 && v && wire::speaks(*v)) ch.set_version(*v);
  Message m{wire::decode_header(head), {}};
  if (ch.version() != 0 && m.header.version != ch.version() && m.header.type != wire::MessageType::reject) {
    throw Error("bootstrap decode", EBADMSG,
                fmt::format("a {} in wire version {} on a connection that speaks {}", wire::to_string(m.header.type),
                            m.header.version, ch.version()),
                "a connection keeps the version of its first message: the peer is not rdmakit, or is broken");
  }
  m.payload.resize(m.header.length);
  ch.recv_exact(m.payload, deadline);
  return m;
}

}  // namespace rdmakit::detail
