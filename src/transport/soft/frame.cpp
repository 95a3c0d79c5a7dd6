// SPDX-License-Identifier: Apache-2.0
#include "transport/soft/frame.hpp"

namespace rdmakit::detail::soft {

namespace {

template <typename T>
void put(std::uint8_t* p, T v) noexcept {
  for (std::size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
template <typename T>
T get(const std::uint8_t* p) noexcept {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<T>(p[i]) << (8 * i));
  return v;
}

}  // namespace

void encode(const Frame& f, std::span<std::uint8_t, kFrameSize> out) noexcept {
  std::uint8_t* p = out.data();
  p[0] = kFrameVersion;
  p[1] = f.op;
  p[2] = static_cast<std::uint8_t>(f.status);
  p[3] = 0;
  put<std::uint32_t>(p + 4, f.length);
  put<std::uint64_t>(p + 8, f.id);
  put<std::uint64_t>(p + 16, f.raddr);
  put<std::uint32_t>(p + 24, f.rkey);
  put<std::uint32_t>(p + 28, 0);
  put<std::uint64_t>(p + 32, f.arg0);
  put<std::uint64_t>(p + 40, f.arg1);
}

std::optional<Frame> decode(std::span<const std::uint8_t, kFrameSize> in) noexcept {
  const std::uint8_t* p = in.data();
  if (p[0] != kFrameVersion || p[3] != 0 || get<std::uint32_t>(p + 28) != 0) return std::nullopt;
  Frame f;
  f.op = p[1];
  const auto op = static_cast<std::uint8_t>(f.op & ~kResponse);
  if (op < static_cast<std::uint8_t>(FrameOp::write) || op > static_cast<std::uint8_t>(FrameOp::unshare)) return std::nullopt;
  if (p[2] > static_cast<std::uint8_t>(FrameStatus::remote_op)) return std::nullopt;
  f.status = static_cast<FrameStatus>(p[2]);
  if (!f.response() && f.status != FrameStatus::ok) return std::nullopt;
  f.length = get<std::uint32_t>(p + 4);
  f.id = get<std::uint64_t>(p + 8);
  f.raddr = get<std::uint64_t>(p + 16);
  f.rkey = get<std::uint32_t>(p + 24);
  f.arg0 = get<std::uint64_t>(p + 32);
  f.arg1 = get<std::uint64_t>(p + 40);
  if (f.length > kMaxChunk) return std::nullopt;
  const FrameOp o = f.request_op();
  if (!f.response() && (o == FrameOp::fetch_add || o == FrameOp::compare_swap) && f.length != 8) return std::nullopt;
  if ((o == FrameOp::share || o == FrameOp::unshare) && (f.response() || f.length != 0)) return std::nullopt;
  return f;
}

}  // namespace rdmakit::detail::soft
