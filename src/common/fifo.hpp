// SPDX-License-Identifier: Apache-2.0
#pragma once
// A first-in first-out queue of small values on one growing power-of-two ring: push and pop are
// a store and an index (std::deque's are a dozen instructions and a block allocation every few
// hundred), and once it has grown to its working size it never allocates again.
//
// Not thread-safe.

#include <cstdint>
#include <vector>

namespace rdmakit::detail {

template <typename T>
class Fifo {
 public:
  [[nodiscard]] bool empty() const noexcept { return head_ == tail_; }
  [[nodiscard]] std::size_t size() const noexcept { return static_cast<std::size_t>(tail_ - head_); }
  [[nodiscard]] T& front() noexcept { return buf_[head_ & mask_]; }
  void pop_front() noexcept { ++head_; }
  /// Drops the first `n` (at most size()).
  void pop_front(std::size_t n) noexcept { head_ += n; }
  /// The i-th from the front (i < size()).
  [[nodiscard]] T& operator[](std::size_t i) noexcept { return buf_[(head_ + i) & mask_]; }
  void push_back(const T& v) {
    if (size() == buf_.size()) grow();
    buf_[tail_++ & mask_] = v;
  }
  void push_front(const T& v) {
    if (size() == buf_.size()) grow();
    buf_[--head_ & mask_] = v;
  }

 private:
  void grow() {
    std::vector<T> bigger(buf_.empty() ? 16 : 2 * buf_.size());
    for (std::uint64_t i = head_; i != tail_; ++i) bigger[i - head_] = buf_[i & mask_];
    tail_ -= head_;
    head_ = 0;
    buf_.swap(bigger);
    mask_ = buf_.size() - 1;
  }
  std::vector<T> buf_;
  std::uint64_t mask_ = 0;
  std::uint64_t head_ = 0, tail_ = 0;  // head_ may wrap below zero (push_front): masks still hold
};

}  // namespace rdmakit::detail
