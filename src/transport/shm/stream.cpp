// SPDX-License-Identifier: Apache-2.0
// shm's data stream (stream.hpp).
#include "transport/shm/stream.hpp"

#include <unistd.h>

namespace rdmakit::detail::shm {

OpenedStream open_stream(const std::string& socket, std::span<const std::uint8_t, wire::kTokenSize> token,
                         std::uint16_t version, Ring* ring, Deadline deadline, const Stop* stop) {
  OpenedStream s;
  s.fd = unix_connect(socket, deadline);
  send_all(s.fd.get(), wire::encode_stream(token, 0, version), deadline, stop);
  uid_t uid = 0;
  s.own_user = peer_pid(s.fd.get(), &uid) > 0 && uid == ::geteuid();
  if (ring != nullptr) {
    require_own_user(s.fd.get(), "this engine's shm ring goes to no other user");
    ring->send(s.fd.get(), deadline, stop);
  }
  return s;
}

std::shared_ptr<Ring> take_ring(int fd, Deadline deadline, const Stop* stop) {
  // No proof is read, so the kernel's word on the local socket stands for it: a process of this
  // user at the other end (an abstract socket has no permissions of its own).
  require_own_user(fd, "shm links only one user's processes");
  return Ring::receive(fd, deadline, stop);
}

}  // namespace rdmakit::detail::shm
