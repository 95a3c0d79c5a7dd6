// SPDX-License-Identifier: Apache-2.0
#pragma once
// What both handshakes (connect.cpp, accept.cpp) and the listener share.

#include <string>

#include "bootstrap/session.hpp"
#include "bootstrap/socket.hpp"
#include "rdmakit/wire.hpp"

namespace rdmakit::detail {

/// Throws Error unless `m` is of `type`: the peer's reason when it is a REJECT, else what came.
void expect(const Message& m, wire::MessageType type, const std::string& peer);

}  // namespace rdmakit::detail
