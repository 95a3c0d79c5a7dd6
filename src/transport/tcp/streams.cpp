// SPDX-License-Identifier: Apache-2.0
// tcp's data streams (streams.hpp).
#include "transport/tcp/streams.hpp"

#include <cerrno>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail::tcp {

std::vector<Fd> open_streams(const HostPort& to, std::span<const std::uint8_t, wire::kTokenSize> token, std::uint32_t count,
                             std::uint16_t version, Deadline deadline, const Stop* stop) {
  if (count == 0 || count > kMaxStreams) {
    throw Error("bootstrap handshake", EPROTO, fmt::format("the peer asks for {} data streams (1..{})", count, kMaxStreams));
  }
  std::vector<Fd> fds;
  for (std::uint32_t k = 0; k < count; ++k) {
    Fd fd = tcp_connect(to, deadline, false, stop);
    send_all(fd.get(), wire::encode_stream(token, static_cast<std::uint16_t>(k), version), deadline, stop);
    fds.push_back(std::move(fd));
  }
  return fds;
}

}  // namespace rdmakit::detail::tcp
