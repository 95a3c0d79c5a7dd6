#pragma once
// What the engine's lab tests share.
#include <cstdint>

#include "rdmakit/engine.hpp"

namespace lab {

/// A transfer of `len` bytes between [loff..) of `local` and [roff..) of `seg`.
inline rdmakit::Transfer xfer(rdmakit::TransferOp op, rdmakit::Buffer local, std::uint64_t loff, std::uint64_t len,
                              rdmakit::RemoteSegment seg, std::uint64_t roff) {
  rdmakit::Transfer t;
  t.op = op;
  t.local = local;
  t.local_offset = loff;
  t.length = len;
  t.remote = seg;
  t.remote_offset = roff;
  return t;
}

}  // namespace lab
