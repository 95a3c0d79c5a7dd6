// SPDX-License-Identifier: Apache-2.0
// The data path's setup and its completion bookkeeping off the hot path: segmented requests'
// parts, error completions (which break the connection), tracing.
#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "datapath/datapath.hpp"
#include "datapath/router.hpp"
#include "rdmakit/error.hpp"
#include "trace.hpp"
#include "verbs/qp.hpp"

namespace rdmakit::detail {

namespace {

int real_to_error(ibv_qp* qp) noexcept { return to_error(qp); }
int real_get_cq_event(ibv_comp_channel* ch, ibv_cq** cq, void** ctx) noexcept {
  return ibv_get_cq_event(ch, cq, ctx);
}
void real_ack_cq_events(ibv_cq* cq, unsigned n) noexcept { ibv_ack_cq_events(cq, n); }

}  // namespace

const VerbsOps& real_verbs() noexcept {
  static constexpr VerbsOps ops{real_to_error, real_get_cq_event, real_ack_cq_events};
  return ops;
}

void DataPath::init(const DataPathLimits& limits, std::span<ibv_qp* const> qps, ibv_cq* send_cq,
                    ibv_cq* recv_cq, ibv_comp_channel* channel, const VerbsOps& ops) {
  if (qps.empty() || limits.send_depth == 0 || limits.recv_depth == 0 || limits.max_sge == 0 ||
      limits.max_msg_size == 0) {
    throw Error("data path", EINVAL, "no QP, or a depth, SGE count or message size of 0");
  }
  limits_ = limits;
  ops_ = &ops;
  for (std::size_t op = 0; op < single_wrs_.size(); ++op) {
    ibv_send_wr& v = single_wrs_[op];
    v = ibv_send_wr{};
    v.opcode = dp::verbs_opcode(static_cast<Opcode>(op));
    v.sg_list = &single_sge_;
    v.num_sge = 1;
  }
  send_cq_ = send_cq;
  drop_extended();  // (use_extended() after, for QPs and CQs made for it)
  recv_cq_ = recv_cq;
  channel_ = channel;
  if (qps.size() > kMaxLanes) throw Error("data path", EINVAL, fmt::format("{} QPs: at most {}", qps.size(), kMaxLanes));
  lane_count_ = static_cast<std::uint32_t>(qps.size());
  for (std::uint32_t k = 0; k < lane_count_; ++k) {
    Lane& l = lanes_[k];
    l = Lane{};
    l.qp = qps[k];
    l.qpn = qps[k]->qp_num;
    l.set_id(k);
    l.owner = this;
    l.sq.init(limits.send_depth);
  }
  rq_.init(limits.recv_depth);
  forced_signal_interval_ = std::max<std::uint32_t>(1, limits.send_depth / 2);
  send_wrs_.resize(limits.send_depth);
  send_sges_.resize(static_cast<std::size_t>(limits.send_depth) * limits.max_sge);
  recv_wrs_.resize(limits.recv_depth);
  recv_sges_.resize(limits.recv_depth);
  part_reqs_.resize(limits.send_depth);
  part_slices_.assign(limits.send_depth, LocalSlice::empty());
  segmented_.resize(static_cast<std::size_t>(limits.send_depth) * lane_count_);
  free_segmented_.resize(segmented_.size());
  for (std::size_t i = 0; i < free_segmented_.size(); ++i) {
    free_segmented_[i] = static_cast<std::uint32_t>(free_segmented_.size() - 1 - i);
  }
  segment_min_ordered_ = std::uint64_t{limits.max_msg_size} + 1;
  segment_min_spread_ = lane_count_ > 1 ? std::min(limits.stripe_min, segment_min_ordered_) : segment_min_ordered_;
  set_mode(Mode::idle);
}

void DataPath::route_through(CqRouter& send, CqRouter& recv) {
  if (routed()) throw Error("data path", EINVAL, "already routed through shared CQs");
  std::uint32_t attached = 0;
  try {
    for (Lane& l : lanes()) {
      l.set_id(send.attach(this, &l));
      ++attached;
    }
    rq_tag_ = recv.attach(this, nullptr);
  } catch (...) {
    for (std::uint32_t k = 0; k < attached; ++k) send.detach(lanes_[k].id);
    throw;
  }
  send_router_ = &send;
  recv_router_ = &recv;
}

void DataPath::drop_extended() noexcept {
  for (Lane& l : lanes_) l.qpx = nullptr;
  send_cqx_ = nullptr;
  ext_inline_ = false;
  // (Requests prepared before, if any, were laid out for the lanes as they were.)
  for (Prepared& p : prepared_) p.ext = ext_kind::kNone;
}

void DataPath::use_extended(std::span<ibv_qp_ex* const> qps, bool inline_data, ibv_cq_ex* send_cq) noexcept {
  drop_extended();
  send_cqx_ = send_cq != nullptr && ibv_cq_ex_to_cq(send_cq) == send_cq_ ? send_cq : nullptr;
  // Every lane's, each with the calls the data path makes (a provider that takes the flags and
  // leaves a builder out would be called through null), or none.
  const auto usable = [](const ibv_qp_ex* x) {
    return x != nullptr && x->wr_start != nullptr && x->wr_complete != nullptr && x->wr_rdma_write != nullptr &&
           x->wr_rdma_read != nullptr && x->wr_set_sge != nullptr && x->wr_set_sge_list != nullptr &&
           x->wr_set_inline_data != nullptr;
  };
  if (!qps.empty() && qps.size() == lane_count_ && std::all_of(qps.begin(), qps.end(), usable)) {
    for (std::uint32_t k = 0; k < lane_count_; ++k) lanes_[k].qpx = qps[k];
    ext_inline_ = inline_data;
  }
  if (send_cqx_ != nullptr &&
      (send_cqx_->start_poll == nullptr || send_cqx_->end_poll == nullptr || send_cqx_->read_vendor_err == nullptr)) {
    send_cqx_ = nullptr;
  }
}

void DataPath::observe(std::function<void(const TraceEvent&)> trace, std::string peer) {
  trace_ = std::move(trace);
  peer_ = std::move(peer);
}

[[gnu::always_inline]] inline std::size_t DataPath::poll_one_taken() noexcept {
  // The tag is checked against the lanes' storage, not their count: a lane not in use has an
  // empty ring, which retires nothing (poll_one_other then checks the tag against the count).
  const std::uint64_t tag = wc_.wr_id >> kTagShift;
  if (tag >= kMaxLanes) [[unlikely]] return poll_one_recv(*poll_out_);  // not ours: nothing posts such an id
  WrRing& ring = lanes_[tag].sq;
  const std::uint64_t seq = ring.seq_of(wc_.wr_id);
  if (seq >= ring.next_seq()) [[unlikely]] return poll_one_other(nullptr);
  const WrRing::Slot& slot = ring.at(seq);
  ring.retire_through(seq);
  if (slot.kind != WrRing::user || wc_.status != IBV_WC_SUCCESS || markers_pending_) [[unlikely]] {
    return poll_one_other(&slot);
  }
  dp::fill_send(*poll_out_, slot.wr_id, slot.op, wc_);
  return 1;
}

std::size_t DataPath::poll_one(Completion& out) noexcept {
  // A queue with nothing in flight has nothing to report: skip its provider call (it costs real
  // time per spin in a latency loop). The receive queue is a function of its own.
  if (!sends_may_complete()) return poll_one_recv(out);
  // The work completion is a member and `out` waits in one across the provider's call: then
  // only `this` lives across it (one register saved per call instead of three). Not
  // reap_send({&out, 1}) or take_send(): GCC keeps the batch branch's array, or the work
  // completion's address, in the frame then (bench/callgrind-overhead).
  poll_out_ = &out;
  if (send_cqx_ != nullptr) return poll_one_extended();
  if (ibv_poll_cq(send_cq_, 1, &wc_) != 1) return poll_one_recv(*poll_out_);
  return poll_one_taken();
}

std::size_t DataPath::poll_one_extended() noexcept {
  ibv_cq_ex* const x = send_cqx_;
  ibv_poll_cq_attr attr{};
  if (ibv_start_poll(x, &attr) != 0) return poll_one_recv(*poll_out_);
  // The common case read off the CQ's current entry, as poll_one_taken() would take it: a
  // request of the caller's that succeeded.
  const std::uint64_t id = x->wr_id;
  const ibv_wc_status status = x->status;
  if (const std::uint64_t tag = id >> kTagShift; tag < kMaxLanes && status == IBV_WC_SUCCESS && !markers_pending_) [[likely]] {
    WrRing& ring = lanes_[tag].sq;
    const std::uint64_t seq = ring.seq_of(id);
    if (seq < ring.next_seq()) [[likely]] {
      const WrRing::Slot& slot = ring.at(seq);
      if (slot.kind == WrRing::user) [[likely]] {
        ring.retire_through(seq);
        ibv_end_poll(x);
        dp::fill_send_ok(*poll_out_, slot.wr_id, slot.op);
        return 1;
      }
    }
  }
  // Anything else as the classic poll's: its work completion (a send completion's byte_len says
  // nothing: 0, as the public Completion documents).
  wc_ = ibv_wc{};
  wc_.wr_id = id;
  wc_.status = status;
  wc_.vendor_err = status != IBV_WC_SUCCESS ? ibv_wc_read_vendor_err(x) : 0;
  ibv_end_poll(x);
  return poll_one_taken();
}

std::size_t DataPath::poll_one_other(const WrRing::Slot* slot) noexcept {
  Completion& out = *poll_out_;
  const std::uint64_t tag = wc_.wr_id >> kTagShift;
  if (tag >= lane_count_) return poll_one_recv(out);  // not ours: nothing posts such an id
  if (!take_retired(lanes_[tag], slot, wc_, out)) return poll_one_recv(out);
  if (markers_pending_) post_markers();
  return 1;
}

std::size_t DataPath::poll_one_recv(Completion& out) noexcept {
  std::size_t n = 0;
  if (rq_.count() != 0) {
    ibv_wc wc;
    n = ibv_poll_cq(recv_cq_, 1, &wc) == 1 && take_recv(wc, out) ? 1 : 0;
  }
  if (markers_pending_) [[unlikely]] post_markers();
  return n;
}

// poll() of more than one completion: out of line, so the one-completion path keeps a small
// frame (the batch's array of work completions lives here).
std::size_t DataPath::poll_many(std::span<Completion> out) noexcept {
  std::size_t n = sends_may_complete() ? reap_send(out) : 0;
  if (rq_.count() != 0 && n < out.size()) n += reap_recv(out.subspan(n));
  if (markers_pending_) [[unlikely]] post_markers();
  return n;
}

void DataPath::set_remote(std::vector<RemoteRegion> regions, bool atomics) {
  remote_ = std::move(regions);
  last_advertised_ = nullptr;
  checked_ = {};
  // Prepared requests were checked against the regions before: none survives a change.
  for (std::size_t i = 0; i < prepared_.size(); ++i) {
    if (prepared_[i].in_use) release({static_cast<std::uint32_t>(i), prepared_[i].generation});
  }
  atomics_ = atomics;
  // What settle() aims its zero-length marker at: a writable region, else a readable one.
  settle_target_ = nullptr;
  for (const RemoteRegion& r : remote_) {
    if (allows(r.access, Access::remote_write)) {
      settle_target_ = &r;
      settle_opcode_ = IBV_WR_RDMA_WRITE;
      break;
    }
    if (settle_target_ == nullptr && allows(r.access, Access::remote_read)) {
      settle_target_ = &r;
      settle_opcode_ = IBV_WR_RDMA_READ;
    }
  }
}

// What a completion of nothing in flight reads as: the library's own marker (never news when
// it succeeded), with the sequence bits of its wr_id.
static WrRing::Slot stale_slot(const ibv_wc& wc) noexcept {
  return {wc.wr_id & kSeqMask, Opcode::send, WrRing::marker, false};
}

bool DataPath::take_other(Lane& lane, const WrRing::Slot* in_flight, const ibv_wc& wc,
                          Completion& c) noexcept {
  const WrRing::Slot slot = in_flight != nullptr ? *in_flight : stale_slot(wc);
  if (slot.kind == WrRing::user && wc.status == IBV_WC_SUCCESS) {
    dp::fill_send(c, slot.wr_id, slot.op, wc);
    return true;
  }
  if (slot.kind == WrRing::part) return finish_part(slot, wc, c);
  // A completion the library forced (selective signaling) or its own marker is bookkeeping; a
  // failed request of the caller's is always news.
  if (wc.status == IBV_WC_SUCCESS) return false;
  dp::fill_send(c, slot.wr_id, slot.op, wc);
  on_error(c, lane.qpn);
  return slot.kind != WrRing::marker;
}

bool DataPath::take_recv_other(const WrRing::Slot* in_flight, const ibv_wc& wc, Completion& c) noexcept {
  const WrRing::Slot slot = in_flight != nullptr ? *in_flight : stale_slot(wc);
  dp::fill(c, slot.wr_id, slot.op, wc);
  if (wc.status != IBV_WC_SUCCESS) on_error(c, lanes_[0].qpn);
  return true;
}

// A completion of one part of a segmented request: records the first error; true (and `c`
// filled) when it was the last counted part. Off the hot path.
[[gnu::noinline]] bool DataPath::finish_part(const WrRing::Slot& slot, const ibv_wc& wc,
                                             Completion& c) noexcept {
  const auto index = static_cast<std::uint32_t>(slot.wr_id);
  if (index >= segmented_.size()) return false;
  Segmented& seg = segmented_[index];
  // A part of an earlier request that held this entry (only a partly posted one can outlive
  // its entry): nothing of it belongs to the current one, but its error still breaks the
  // connection, like any other.
  const bool current = seg.generation == static_cast<std::uint32_t>(slot.wr_id >> 32);
  if (wc.status != IBV_WC_SUCCESS) {
    if (current && seg.status == 0) {
      seg.status = wc.status;
      seg.vendor_err = wc.vendor_err;
    }
    Completion e{};
    e.wr_id = current ? seg.wr_id : 0;
    e.opcode = current ? seg.op : slot.op;
    e.status = wc.status;
    e.vendor_err = wc.vendor_err;
    on_error(e, 0);
  }
  if (!current || !slot.counted || seg.pending == 0 || --seg.pending > 0) return false;
  const bool silent = seg.silent;
  c = {};
  c.wr_id = seg.wr_id;
  c.opcode = seg.op;
  c.status = seg.status;
  c.vendor_err = seg.vendor_err;
  release_segmented(index);
  return !silent;
}

void DataPath::release_segmented(std::uint32_t index) noexcept {
  ++segmented_[index].generation;
  free_segmented_.push_back(index);  // within capacity: it was taken from this vector
}

// The first error completion on any QP breaks the whole connection: its QP is in ERR already,
// and leaving the others in RTS would let round robin half-succeed on a broken connection.
// The failed completion is the caller's report of it; failure() says the same.
[[gnu::noinline]] void DataPath::on_error(const Completion& c, std::uint32_t qpn) noexcept {
  if (c.status != IBV_WC_WR_FLUSH_ERR) {
    emit(trace_, [&] {
      return TraceEvent{"error_completion",
                        {{"peer", peer_},
                         {"qp", fmt::format("{:#x}", qpn != 0 ? qpn : lanes_[0].qpn)},
                         {"opcode", to_string(c.opcode)},
                         {"wr_id", std::to_string(c.wr_id)},
                         {"status", c.status_name()},
                         {"vendor_err", fmt::format("{:#x}", c.vendor_err)},
                         {"detail", c.describe()}}};
    });
  }
  if (mode_ != Mode::ready) return;
  std::string why;
  try {
    why = fmt::format("QP {:#x} failed: {}", qpn != 0 ? qpn : lanes_[0].qpn, c.describe());
  } catch (...) {
    // Out of memory while formatting: the break itself must still happen.
  }
  break_connection(std::move(why), BreakCause::completion);
  break_reported_ = true;  // the error completion is the report
}

}  // namespace rdmakit::detail

namespace rdmakit::detail {

void CqRouter::init(ibv_cq* cq, std::uint32_t capacity) {
  if (capacity == 0 || capacity > kMaxTags) {
    throw Error("CQ router", EINVAL, fmt::format("{} queues: 1..{} per shared CQ", capacity, kMaxTags));
  }
  cq_ = cq;
  routes_.assign(capacity, {});
  free_.resize(capacity);
  for (std::uint32_t t = 0; t < capacity; ++t) free_[t] = t;
  free_head_ = 0;
  attached_ = 0;
}

std::uint32_t CqRouter::attach(DataPath* owner, Lane* lane) {
  if (attached_ == routes_.size()) {
    throw Error("CQ router", ENOSPC, fmt::format("all {} queues of the shared CQ are in use", routes_.size()),
                "raise the engine's QP budget only together with its CQ size");
  }
  const std::uint32_t tag = free_[free_head_];
  free_head_ = (free_head_ + 1) % static_cast<std::uint32_t>(free_.size());
  routes_[tag] = {owner, lane};
  ++attached_;
  return tag;
}

void CqRouter::detach(std::uint32_t tag) noexcept {
  if (tag >= routes_.size() || routes_[tag].owner == nullptr) return;
  routes_[tag] = {};
  // The free tags are the ring's entries from free_head_ on, attached_ of them taken before it.
  const auto n = static_cast<std::uint32_t>(free_.size());
  free_[(free_head_ + n - attached_) % n] = tag;
  --attached_;
}

}  // namespace rdmakit::detail
