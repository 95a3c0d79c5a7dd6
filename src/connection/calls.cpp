// SPDX-License-Identifier: Apache-2.0
// The public data-path calls: each forwards to the data path, whose hot path is inline, so a
// post or poll is one function from the caller's call to the provider's.
#include "connection/impl.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

PostResult Connection::post_write(const LocalSlice& src, const RemoteRegion& dst,
                                  std::uint64_t offset, std::uint64_t wr_id) noexcept {
  return impl_->dp.post_one<Opcode::write>(src, dst, offset, 0, 0, 0, wr_id);
}

PostResult Connection::post_write_with_imm(const LocalSlice& src, const RemoteRegion& dst,
                                           std::uint64_t offset, std::uint32_t imm,
                                           std::uint64_t wr_id) noexcept {
  return impl_->dp.post_one<Opcode::write_with_imm>(src, dst, offset, imm, 0, 0, wr_id);
}

PostResult Connection::post_read(const LocalSlice& dst, const RemoteRegion& src,
                                 std::uint64_t offset, std::uint64_t wr_id) noexcept {
  return impl_->dp.post_one<Opcode::read>(dst, src, offset, 0, 0, 0, wr_id);
}

PostResult Connection::post_send(const LocalSlice& src, std::uint64_t wr_id) noexcept {
  return impl_->dp.post_one<Opcode::send>(src, {}, 0, 0, 0, 0, wr_id);
}

PostResult Connection::post_fetch_add(const LocalSlice& old_value, const RemoteRegion& dst,
                                      std::uint64_t offset, std::uint64_t add,
                                      std::uint64_t wr_id) noexcept {
  return impl_->dp.post_one<Opcode::fetch_add>(old_value, dst, offset, 0, add, 0, wr_id);
}

PostResult Connection::post_compare_swap(const LocalSlice& old_value, const RemoteRegion& dst,
                                         std::uint64_t offset, std::uint64_t compare,
                                         std::uint64_t swap, std::uint64_t wr_id) noexcept {
  return impl_->dp.post_one<Opcode::compare_swap>(old_value, dst, offset, 0, compare, swap, wr_id);
}

PostResult Connection::post_batch(std::span<const WorkRequest> batch) noexcept {
  return impl_->dp.post_batch(batch);
}

PreparedRequest Connection::prepare(const WorkRequest& request) {
  PreparedRequest out;
  if (const PostResult r = impl_->dp.prepare(request, out); !r.ok()) {
    throw Error("prepare", 0, r.describe(),
                r.status == PostStatus::too_large
                    ? "a prepared request is one work request: at most the port's max message size, "
                      "and a WRITE or READ below the striping threshold (post longer ones with "
                      "post_write/post_read, which segment them)"
                    : std::string{});
  }
  return out;
}

PostResult Connection::post(PreparedRequest request, std::uint64_t wr_id) noexcept {
  return impl_->dp.post_prepared(request, wr_id);
}

void Connection::release(PreparedRequest request) noexcept { impl_->dp.release(request); }

PostResult Connection::post_recv(const LocalSlice& dst, std::uint64_t wr_id) noexcept {
  return impl_->dp.post_recvs({&dst, 1}, wr_id);
}

PostResult Connection::post_recvs(std::span<const LocalSlice> dsts, std::uint64_t first_wr_id) noexcept {
  return impl_->dp.post_recvs(dsts, first_wr_id);
}

std::size_t Connection::poll(std::span<Completion> out) noexcept { return impl_->dp.poll(out); }

std::uint32_t Connection::outstanding() const noexcept { return impl_->dp.outstanding(); }

WaitResult Connection::wait(std::chrono::milliseconds timeout) noexcept {
  return impl_->dp.wait(timeout, *impl_);
}

}  // namespace rdmakit
