// SPDX-License-Identifier: Apache-2.0
#pragma once
// A CQ shared by many data paths (an engine worker's, serving every peer link on it): each
// queue attached to it gets a tag, which its work requests carry in their wr_id (ring.hpp), and
// poll() hands every completion to the bookkeeping of the queue it belongs to, the same code a
// data path with CQs of its own runs.
//
// Not thread-safe: the CQ's owner attaches, detaches and polls on one thread.

#include <infiniband/verbs.h>

#include <cstdint>
#include <vector>

#include "datapath/datapath.hpp"

namespace rdmakit::detail {

class CqRouter {
 public:
  /// Routes completions of `cq` for up to `capacity` queues (at most kMaxTags).
  void init(ibv_cq* cq, std::uint32_t capacity);
  [[nodiscard]] ibv_cq* cq() const noexcept { return cq_; }
  /// A tag for `lane` of `owner` (a null lane: the owner's receive queue). Throws Error when
  /// every tag is in use.
  std::uint32_t attach(DataPath* owner, Lane* lane);
  /// The queue is gone. Its tag is reused last (first in, first out), so a completion of it that
  /// was still in the CQ finds no route, or a ring that does not hold its sequence number.
  void detach(std::uint32_t tag) noexcept;
  [[nodiscard]] std::uint32_t attached() const noexcept { return attached_; }

  /// Polls up to kPollBatch completions and runs each through its data path's bookkeeping;
  /// `on_news(DataPath&, const Completion&)` gets what that data path's caller would have got
  /// from its poll(): its requests' completions, failed or not (never the library's own). It
  /// must not detach or destroy data paths. Returns how many work completions were taken.
  template <typename OnNews>
  [[gnu::always_inline]] int poll(OnNews&& on_news) noexcept {
    ibv_wc wc[kPollBatch];
    const int got = ibv_poll_cq(cq_, kPollBatch, wc);
    for (int i = 0; i < got; ++i) {
      const std::uint64_t tag = wc[i].wr_id >> kTagShift;
      if (tag >= routes_.size()) [[unlikely]] continue;
      const Route r = routes_[tag];
      if (r.owner == nullptr) [[unlikely]] continue;  // a queue that is gone
      Completion c;
      const bool news = r.lane != nullptr ? r.owner->take_lane(*r.lane, wc[i], c) : r.owner->take_recv(wc[i], c);
      // A break (an error completion) owes drain markers; this completion may have made room.
      if (r.owner->markers_pending_) [[unlikely]] r.owner->post_markers();
      if (news) on_news(*r.owner, c);
    }
    return got < 0 ? 0 : got;
  }

 private:
  struct Route {
    DataPath* owner = nullptr;
    Lane* lane = nullptr;
  };
  ibv_cq* cq_ = nullptr;
  std::vector<Route> routes_;
  // Free tags, oldest first: a ring of capacity entries (never allocates after init).
  std::vector<std::uint32_t> free_;
  std::uint32_t free_head_ = 0;
  std::uint32_t attached_ = 0;
};

}  // namespace rdmakit::detail
