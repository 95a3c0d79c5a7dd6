// SPDX-License-Identifier: Apache-2.0
#include "connection/handshake.hpp"

#include <cerrno>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {

void expect(const Message& m, wire::MessageType type, const std::string& peer) {
  if (m.header.type == wire::MessageType::reject) {
    throw Error("bootstrap handshake", ECONNREFUSED,
                fmt::format("{} rejected the connection: {}", peer, wire::decode_reject(m.payload)));
  }
  if (m.header.type != type) {
    throw Error("bootstrap handshake", EPROTO,
                fmt::format("{} sent {} where {} was expected", peer, wire::to_string(m.header.type),
                            wire::to_string(type)));
  }
}

}  // namespace rdmakit::detail
