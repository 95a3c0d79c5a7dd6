// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the bootstrap decoder: whatever bytes a peer sends, decoding either
// succeeds or throws rdmakit::Error, never crashes or reads out of bounds, and what decodes
// re-encodes to the same thing.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>

#include "rdmakit/error.hpp"
#include "rdmakit/wire.hpp"

using namespace rdmakit;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> in(data, size);
  const auto quick = wire::try_decode_header(in);
  std::optional<wire::Header> full;
  try {
    full = wire::decode_header(in);
  } catch (const Error&) {
  }
  // The exception-free check used on the data path (after the handshake) agrees with the full
  // one, except that the full one also reads a REJECT in a version this side does not speak (a
  // listener's refusal, readable by every client).
  const bool odd_reject = full && full->type == wire::MessageType::reject && !wire::speaks(full->version);
  if (quick.has_value() != (full.has_value() && !odd_reject)) std::abort();
  if (quick && (quick->type != full->type || quick->length != full->length || quick->version != full->version)) std::abort();
  if (odd_reject && full->length > wire::kMaxRejectReason) std::abort();
  try {
    if (!full) return 0;
    const wire::Header h = *full;
    const auto payload = in.subspan(wire::kHeaderSize);
    if (h.type == wire::MessageType::hello) {
      const wire::EndpointInfo e = wire::decode_hello(payload.first(std::min<std::size_t>(h.length, payload.size())), h.version);
      const auto again = wire::encode_hello(e, h.version);
      if (wire::decode_hello(std::span(again).subspan(wire::kHeaderSize), h.version) != e) std::abort();
    } else if (h.type == wire::MessageType::reject) {
      (void)wire::decode_reject(payload);
    }
  } catch (const Error&) {
  }
  for (const std::uint16_t v : {wire::kPreviousVersion, wire::kVersion}) {
    try {
      (void)wire::decode_hello(in, v);  // the payload decoder on its own, in each version
    } catch (const Error&) {
    }
  }
  return 0;
}
