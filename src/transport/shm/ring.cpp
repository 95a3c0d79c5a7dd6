// SPDX-License-Identifier: Apache-2.0
// shm's ring (ring.hpp): a sealed memfd, handed over the link's local socket and mapped by both.
#include "transport/shm/ring.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail::shm {

namespace {

constexpr char kTag = 'R';  // the byte the descriptor travels with

}  // namespace

std::shared_ptr<Ring> Ring::create(std::size_t bytes) {
  Fd fd = create_sealed_memfd("rdmakit-shm-ring", bytes, "the shm ring");
  auto ring = std::shared_ptr<Ring>(new Ring(Mapping(fd.get(), bytes, "this process's shm ring")));
  ring->fd_ = std::move(fd);  // kept to be sent
  return ring;
}

void require_own_user(int sock, const char* what) {
  uid_t uid = 0;
  if (peer_pid(sock, &uid) <= 0) {
    throw Error("shm", EACCES, fmt::format("{}: the link's stream is not a local socket with a process at its other end", what));
  }
  if (uid != ::geteuid()) {
    throw Error("shm", EACCES, fmt::format("{}: the process at the local socket's other end runs as user {}, this engine as {}",
                                           what, uid, ::geteuid()));
  }
}

void send_with_descriptor(int sock, char tag, int fd, Deadline deadline, const Stop* stop) {
  iovec iov{&tag, 1};
  OneDescriptor control;
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (fd >= 0) control.attach(m, fd);
  for (;;) {
    const ssize_t n = ::sendmsg(sock, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == 1) return;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!poll_until(sock, POLLOUT, deadline, stop, "sending the shm ring")) {
        throw Error("sendmsg", ETIMEDOUT, "sending the shm ring: the handshake's deadline passed");
      }
      continue;
    }
    throw Error("sendmsg", n < 0 ? errno : EIO, "sending the shm ring over the link's local socket");
  }
}

void Ring::send(int sock, Deadline deadline, const Stop* stop) {
  if (!fd_) throw Error("shm ring", EINVAL, "a ring is sent once");
  send_with_descriptor(sock, kTag, fd_.get(), deadline, stop);
  fd_.reset();  // the mapping keeps the memory, and the peer holds its own descriptor now
}

std::shared_ptr<Ring> Ring::receive(int sock, Deadline deadline, const Stop* stop) {
  char tag = 0;
  iovec iov{&tag, 1};
  // Room for more than one descriptor: a peer that sends several has each closed, not leaked.
  alignas(cmsghdr) char control[CMSG_SPACE(8 * sizeof(int))] = {};
  msghdr m{};
  ssize_t n = -1;
  for (;;) {
    m = msghdr{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    n = ::recvmsg(sock, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n >= 0) break;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) throw Error("recvmsg", errno, "receiving the initiator's shm ring");
    if (!poll_until(sock, POLLIN, deadline, stop, "receiving the shm ring")) {
      throw Error("recvmsg", ETIMEDOUT, "the initiator's shm ring did not come by the handshake's deadline");
    }
  }
  std::vector<Fd> fds = descriptors_of(m);
  const char* bad = nullptr;
  if (n == 0) {
    bad = "the initiator closed its stream before sending its shm ring";
  } else if (tag != kTag || fds.size() != 1 || (m.msg_flags & MSG_CTRUNC) != 0) {
    bad = "the initiator's stream did not start with its shm ring (one byte with one descriptor)";
  }
  if (bad != nullptr) throw Error("shm ring", EPROTO, bad, "run the same rdmakit version on both engines");
  Fd fd = std::move(fds[0]);
  const std::size_t size = check_sealed_memfd(fd.get(), kRingMin, kRingMax, "the initiator's shm ring");
  // The mapping keeps the memory: the descriptor goes.
  auto ring = std::shared_ptr<Ring>(new Ring(Mapping(fd.get(), size, "the initiator's shm ring")));
  return ring;
}

}  // namespace rdmakit::detail::shm
