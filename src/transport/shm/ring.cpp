// SPDX-License-Identifier: Apache-2.0
// shm's ring (ring.hpp): a sealed memfd, handed over the link's local socket and mapped by both.
#include "transport/shm/ring.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail::shm {

namespace {

constexpr char kTag = 'R';  // the byte the descriptor travels with
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

}  // namespace

std::shared_ptr<Ring> Ring::map(int fd, std::size_t size, const char* whose) {
  void* at = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (at == MAP_FAILED) throw Error("mmap", errno, fmt::format("mapping {} shm ring of {} bytes", whose, size));
  try {
    return std::shared_ptr<Ring>(new Ring(static_cast<std::uint8_t*>(at), size));
  } catch (...) {
    ::munmap(at, size);
    throw;
  }
}

std::shared_ptr<Ring> Ring::create(std::size_t bytes) {
  Fd fd(::memfd_create("rdmakit-shm-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throw Error("memfd_create", errno, "the shm ring");
  // Its pages allocated now: a host short of memory fails the handshake here, rather than
  // either process faulting on a page the kernel cannot give later.
  if (const int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); err != 0) {
    throw Error("fallocate", err, fmt::format("the shm ring's {} bytes", bytes), "the host is short of memory (or of /dev/shm)");
  }
  // Sealed before anyone else has it: its size is fixed for both sides' mappings.
  if (::fcntl(fd.get(), F_ADD_SEALS, kSeals) != 0) throw Error("fcntl(F_ADD_SEALS)", errno, "sealing the shm ring");
  auto ring = map(fd.get(), bytes, "this process's");
  ring->fd_ = std::move(fd);  // kept to be sent
  return ring;
}

Ring::~Ring() {
  if (base_ != nullptr) ::munmap(base_, size_);
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
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (fd >= 0) {
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
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
  const char* bad = nullptr;
  if (n == 0) {
    bad = "the initiator closed its stream before sending its shm ring";
  } else if (tag != kTag || fds.size() != 1 || (m.msg_flags & MSG_CTRUNC) != 0) {
    bad = "the initiator's stream did not start with its shm ring (one byte with one descriptor)";
  }
  if (bad != nullptr) throw Error("shm ring", EPROTO, bad, "run the same rdmakit version on both engines");
  Fd fd = std::move(fds[0]);
  // The seal first: once it cannot shrink, the size read next is one it keeps (it may only grow).
  // On tmpfs only: a hugetlbfs memfd, sealed the same, can lose its pages to a punched hole.
  const int seals = ::fcntl(fd.get(), F_GET_SEALS);
  struct statfs fs{};
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || ::fstatfs(fd.get(), &fs) != 0 ||
      static_cast<unsigned long>(fs.f_type) != TMPFS_MAGIC) {
    throw Error("shm ring", EPROTO, "the initiator's shm ring is not a memfd sealed against shrinking (it could fault here)");
  }
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) throw Error("fstat", errno, "the initiator's shm ring");
  const auto size = static_cast<std::size_t>(st.st_size);
  if (!S_ISREG(st.st_mode)) throw Error("shm ring", EPROTO, "the initiator's shm ring is not a regular file");
  if (st.st_size < 0 || size < kRingMin || size > kRingMax) {
    throw Error("shm ring", EPROTO, fmt::format("the initiator's shm ring has {} bytes ({}..{})", st.st_size, kRingMin, kRingMax));
  }
  // The mapping keeps the memory: the descriptor goes.
  auto ring = map(fd.get(), size, "the initiator's");
  return ring;
}

}  // namespace rdmakit::detail::shm
