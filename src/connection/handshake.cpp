#include "connection/handshake.hpp"

#include <cerrno>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {

void send_reject(Channel& ch, Session* session, const std::string& reason) noexcept {
  try {
    const auto msg = wire::encode_reject(reason);
    send_control(ch, session, wire::MessageType::reject, std::span(msg).subspan(wire::kHeaderSize),
                 deadline_in(std::chrono::milliseconds{500}));
  } catch (const std::exception&) {
    // The peer is gone or stalled: it learns nothing more either way.
  }
}

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
