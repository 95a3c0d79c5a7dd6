// SPDX-License-Identifier: Apache-2.0
#pragma once
// The bookkeeping of one work queue: what each posted work request was, in post order.

#include <cstdint>
#include <vector>

#include "rdmakit/connection.hpp"

namespace rdmakit::detail {

// A work request's verbs wr_id carries its queue's tag (which queue of which data path: the CQ
// may be shared) in the top 16 bits and the low 48 bits of its sequence number below. 2^48
// requests in flight at once is beyond any queue, so the low bits identify one.
inline constexpr int kTagShift = 48;
inline constexpr std::uint64_t kSeqMask = (std::uint64_t{1} << kTagShift) - 1;
inline constexpr std::uint32_t kMaxTags = 1u << (64 - kTagShift);

// Work requests in flight on one queue, in post order. Each is posted with a sequence number as
// its verbs wr_id; the user's wr_id, the opcode and what kind of request it was stay here. RC
// completes a queue in order, so the completion of sequence s also retires every unsignaled
// request posted before it, and an error completion (whose opcode field the verbs leave
// undefined) is still reported with its opcode. Sized once, at setup.
class WrRing {
 public:
  enum Kind : std::uint8_t {
    user = 0,    // the caller's request; its completion is the caller's news
    silent = 1,  // unsignaled by the caller: news only if it fails
    part = 2,    // one part of a segmented request (wr_id: the Segmented handle)
    marker = 3,  // the library's own (drain marker): never news
  };
  struct Slot {
    std::uint64_t wr_id = 0;  // the user's wr_id, or for a part its Segmented handle
    Opcode op = Opcode::send;
    Kind kind = user;
    bool counted = false;  // for a part: the one its request's completion counts on
    // (No padding: a slot copies as two words.)
    // For the caller: the engine marks the requests of a chain of consecutive entries of one
    // batch (its walk then ends them in one loop) with `run`: how many of the chain's requests,
    // from this one on, belong to it (a plan's); or, `run_end` set, the low 32 bits of the
    // sequence number after the chain's last (descriptor lists': the same in every slot of the
    // chain). 0: none said.
    bool run_end = false;
    std::uint32_t run = 0;
  };
  static_assert(sizeof(Slot) == 16);

  /// Room for `capacity` requests; the storage is rounded up to a power of two so a slot is a
  /// mask away from its sequence number (no division on the hot path).
  /// (`first`: the first sequence number, for tests of the wrap.)
  void init(std::uint32_t capacity, std::uint64_t first = 0) {
    capacity_ = capacity;
    std::size_t n = 1;
    while (n < capacity) n *= 2;
    slots_.assign(n, {});
    mask_ = n - 1;
    head_ = tail_ = first;
  }
  [[nodiscard]] std::uint32_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::uint32_t count() const noexcept {
    return static_cast<std::uint32_t>(tail_ - head_);
  }
  [[nodiscard]] std::uint32_t free() const noexcept { return capacity_ - count(); }
  [[nodiscard]] std::uint64_t next_seq() const noexcept { return tail_; }
  /// The newest request in flight (count() > 0).
  [[nodiscard]] const Slot& newest() const noexcept { return slots_[(tail_ - 1) & mask_]; }
  void push(const Slot& s) noexcept { slots_[tail_++ & mask_] = s; }
  /// Takes back the newest push (its request was not posted after all).
  void unpush() noexcept { --tail_; }
  /// Writes the slot of the request `i` places past the newest, not yet in flight (a chain
  /// being built); commit() puts the first `n` staged in flight.
  void stage(std::uint32_t i, const Slot& s) noexcept { slots_[(tail_ + i) & mask_] = s; }
  [[nodiscard]] Slot& staged(std::uint32_t i) noexcept { return slots_[(tail_ + i) & mask_]; }
  void commit(std::uint32_t n) noexcept { tail_ += n; }
  /// The oldest sequence number still in flight (everything before it was retired).
  [[nodiscard]] std::uint64_t head() const noexcept { return head_; }
  /// The slot of sequence number `seq`: in flight, or retired while no more than the ring's
  /// storage has been pushed since (what a caller walking retired requests relies on).
  [[nodiscard]] const Slot& at(std::uint64_t seq) const noexcept { return slots_[seq & mask_]; }
  /// The storage and its mask, for a loop over many slots that keeps both in registers (the
  /// compiler reloads members after every store it cannot prove apart).
  template <typename S>
  struct View {
    S* slots;
    std::uint64_t mask;
    S& operator[](std::uint64_t seq) const noexcept { return slots[seq & mask]; }
  };
  [[nodiscard]] View<Slot> view() noexcept { return {slots_.data(), mask_}; }
  [[nodiscard]] View<const Slot> view() const noexcept { return {slots_.data(), mask_}; }
  /// Entries of storage (a power of two, at least capacity()).
  [[nodiscard]] std::uint64_t storage() const noexcept { return mask_ + 1; }
  /// Retires everything up to and including the request whose sequence number has these low
  /// 48 bits (the rest of a wr_id is ignored); returns its slot (valid until the next push).
  /// One that is not in flight (a bug, or a stale completion of a queue that held the same tag
  /// before) retires nothing: nullptr.
  const Slot* retire(std::uint64_t low) noexcept {
    const std::uint64_t seq = seq_of(low);
    if (seq >= tail_) [[unlikely]] return nullptr;
    retire_through(seq);
    return &slots_[seq & mask_];
  }
  /// retire()'s parts, for a caller that tests the answer itself: the sequence number these low
  /// 48 bits name (in flight when below next_seq()), and retiring up to and including it.
  [[nodiscard]] std::uint64_t seq_of(std::uint64_t low) const noexcept { return head_ + ((low - head_) & kSeqMask); }
  void retire_through(std::uint64_t seq) noexcept { head_ = seq + 1; }
  /// Forgets everything in flight (the queue is gone).
  void clear() noexcept { head_ = tail_; }

 private:
  std::vector<Slot> slots_;
  std::uint64_t mask_ = 0;
  std::uint32_t capacity_ = 0;
  std::uint64_t head_ = 0;
  std::uint64_t tail_ = 0;
};

}  // namespace rdmakit::detail
