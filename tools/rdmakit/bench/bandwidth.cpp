// SPDX-License-Identifier: Apache-2.0
// rdmakit bench: bandwidth, as perftest measures it (ib_*_bw), through the public API.
#include "bench/bench.hpp"

#include <unistd.h>

#include <cstdio>

namespace rdmakit::tools::bench {

using namespace std::chrono_literals;

Completion wait_ok(Connection& c, const char* what) {
  const WaitResult w = c.wait(10s);
  if (w.status == WaitStatus::timeout) throw Fail(fmt::format("{}: no completion within 10 s", what));
  if (w.status != WaitStatus::completed) throw Fail(fmt::format("{}: {}", what, c.failure()));
  if (!w.completion.ok()) throw Fail(fmt::format("{}: {}", what, w.completion.describe()));
  return w.completion;
}

// Reaps completions without waiting; returns how many requests completed (by the highest
// signaled wr_id seen + 1), failing on any error completion.
std::uint64_t reap(Connection& c, std::uint64_t completed, std::span<Completion> buf) {
  const std::size_t n = c.poll(buf);
  for (std::size_t i = 0; i < n; ++i) {
    if (!buf[i].ok()) throw Fail(buf[i].describe());
    if (buf[i].opcode != Opcode::recv) completed = std::max(completed, buf[i].wr_id + 1);
  }
  return completed;
}

// Posts one request; while the queue is full (unsignaled requests not yet retired), reaps.
void post_one(Connection& c, const WorkRequest& w, std::span<Completion> buf) {
  PostResult r = c.post_batch({&w, 1});
  if (r.ok()) [[likely]] return;
  const auto deadline = Clock::now() + 10s;
  while (r.status == PostStatus::queue_full && Clock::now() < deadline) {
    (void)reap(c, 0, buf);
    r = c.post_batch({&w, 1});
    if (r.ok()) return;
  }
  throw Fail(r.describe());
}

class Progress {
 public:
  Progress(bool on, std::size_t size, std::uint64_t total)
      : on_(on && ::isatty(STDERR_FILENO) != 0), size_(size), total_(total) {}
  void update(std::uint64_t done) {
    if (!on_ || (done & 0xfff) != 0) return;
    const auto now = Clock::now();
    if (now - start_ < 2s || now - last_ < 500ms) return;
    last_ = now;
    std::fprintf(stderr, "\r  %zu B: %3.0f%%", size_, 100.0 * static_cast<double>(done) / static_cast<double>(total_));
    shown_ = true;
  }
  ~Progress() {
    if (shown_) std::fprintf(stderr, "\r%30s\r", "");
  }

 private:
  bool on_;
  std::size_t size_;
  std::uint64_t total_;
  Clock::time_point start_ = Clock::now(), last_ = start_;
  bool shown_ = false;
};

// Where a side's bandwidth requests point: the local slot they send from (or READ into) and
// the remote offset. With --bidir a side sends from its first half into the peer's second half,
// and READs from the peer's first half into its own second half.
struct Targets {
  std::size_t local_base = 0, remote_base = 0;
};
Targets targets_for(const Phase& p, Opcode op) {
  if (!p.bidir) return {};
  return op == Opcode::read ? Targets{p.half, 0} : Targets{0, p.half};
}

// Bandwidth: keep up to tx_depth requests in flight per QP, post in chains of post_list. On one
// QP completions arrive in order: signal every signal_interval-th request (and the last) and
// count by the highest wr_id. On several QPs they do not: each chain (one QP) signals its last
// request, whose wr_id carries the chain's length, and striped messages go one per request.
Result run_bw_initiator(Connection& c, const Phase& p, const MemoryRegion& mine, bool show,
                        Receiver* receiver) {
  const RemoteRegion theirs = c.remote_regions().at(0);
  const Opcode op = p.op == "write" ? Opcode::write
                    : p.op == "read" ? Opcode::read
                    : p.op == "send" ? Opcode::send
                                     : Opcode::fetch_add;
  const Targets at = targets_for(p, op);
  const std::uint32_t qps = c.info().qps;
  const bool in_order = qps == 1;
  // A message that the library stripes across the QPs is one request: post it on its own.
  const bool striped = !in_order && p.size >= ConnectionConfig{}.stripe_min;
  const std::uint32_t post_list = striped ? 1 : p.post_list;
  // The peer's phase parameters ask for tx_depth; this side's queues may be shallower.
  const std::uint32_t depth = std::min(p.tx_depth, c.info().send_depth) * qps;
  constexpr int kCountShift = 40;  // several QPs: a signaled wr_id's chain length sits above this
  std::vector<WorkRequest> reqs(post_list);
  std::vector<LocalSlice> slices;
  slices.reserve(post_list);
  std::vector<Completion> comps(64);
  std::vector<std::pair<Clock::time_point, std::uint64_t>> marks;
  const std::uint64_t every = in_order ? signal_interval(p.tx_depth) : post_list;
  marks.reserve(p.iters / every + 2);
  Progress progress(show, p.size, p.iters);

  std::uint64_t posted = 0, completed = 0;
  auto reap_all = [&] {
    const std::size_t n = c.poll(comps);
    for (std::size_t i = 0; i < n; ++i) {
      const Completion& x = comps[i];
      if (!x.ok()) throw Fail(x.describe());
      if (x.opcode == Opcode::recv) {
        if (receiver != nullptr) receiver->on_completion(x);
      } else if (in_order) {
        completed = std::max(completed, x.wr_id + 1);
      } else {
        completed += x.wr_id >> kCountShift;
      }
    }
  };
  // With --duration the count is open until the time is up; then it ends at the next signaled
  // request, so the last one posted is always one whose completion we will see.
  std::uint64_t target = p.duration > 0 ? std::numeric_limits<std::uint64_t>::max() : p.iters;
  const auto t0 = Clock::now();
  const auto stop_at = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(p.duration));
  while (completed < target || (receiver != nullptr && !receiver->done())) {
    if (p.duration > 0 && target == std::numeric_limits<std::uint64_t>::max() && Clock::now() >= stop_at) {
      target = in_order ? std::max<std::uint64_t>((posted + every - 1) / every * every, every)
                        : std::max<std::uint64_t>(posted, 1);
    }
    // outstanding() counts posted receives too; only sends take room in the send queues.
    const std::uint32_t sends = c.outstanding() - (receiver != nullptr ? receiver->pending() : 0);
    std::uint32_t room = depth - std::min(depth, sends);
    // Validating over several QPs: a slot is not rewritten while an earlier request into it may
    // still be in flight on another QP (they complete out of order), so post in rounds.
    if (p.validate && !in_order && posted % p.slots == 0 && completed < posted) room = 0;
    if (p.validate && !in_order) room = static_cast<std::uint32_t>(std::min<std::uint64_t>(room, p.slots - posted % p.slots));
    const auto n = static_cast<std::uint32_t>(std::min<std::uint64_t>({post_list, room, target - std::min(target, posted)}));
    if (n > 0) {
      slices.clear();
      for (std::uint32_t k = 0; k < n; ++k) {
        const std::uint64_t i = posted + k;
        const std::size_t slot = (i % p.slots) * p.size;
        if (p.validate && op != Opcode::read) fill_region(mine, at.local_base + slot, p.size, i);
        slices.push_back(mine.local().subslice(at.local_base + slot, p.size));
        WorkRequest& w = reqs[k];
        w = {};
        w.opcode = op;
        w.local = {&slices.back(), 1};
        w.remote = theirs;
        w.remote_offset = op == Opcode::fetch_add ? 0 : at.remote_base + slot;
        w.compare_add = 1;
        w.wr_id = i;
        w.signaled = in_order ? (i + 1) % every == 0 || i + 1 == target : k + 1 == n;
        if (!in_order && w.signaled) w.wr_id |= std::uint64_t{n} << kCountShift;
      }
      PostResult r;
      if (striped) {
        r = op == Opcode::read ? c.post_read(reqs[0].local[0], theirs, reqs[0].remote_offset, reqs[0].wr_id)
                               : c.post_write(reqs[0].local[0], theirs, reqs[0].remote_offset, reqs[0].wr_id);
      } else {
        r = c.post_batch({reqs.data(), n});
      }
      // Several QPs: the QP whose turn it is may be full while the others are not.
      if (r.status == PostStatus::queue_full && !in_order) {
        reap_all();
        continue;
      }
      if (!r.ok()) throw Fail(fmt::format("post: {}", r.describe()));
      posted += n;
    }
    const std::uint64_t before = completed;
    reap_all();
    if (completed != before) {
      marks.emplace_back(Clock::now(), completed);
      if (p.duration == 0) progress.update(completed);
    }
  }
  const auto t1 = Clock::now();

  Result res;
  res.bytes = p.size;
  res.iters = target;
  res.seconds = std::chrono::duration<double>(t1 - t0).count();
  const double mb = static_cast<double>(p.size) * static_cast<double>(target) / (1024.0 * 1024.0);
  res.bw_avg = mb / res.seconds;
  res.msg_rate = static_cast<double>(target) / res.seconds / 1e6;
  // Peak: the best of 10 equal stretches of the run (by completions).
  double peak = res.bw_avg;
  auto prev = std::pair{t0, std::uint64_t{0}};
  const std::uint64_t stride = std::max<std::uint64_t>(target / 10, every);
  for (std::size_t k = 0; k < marks.size(); ++k) {
    if (marks[k].second - prev.second >= stride) {
      const double dt = std::chrono::duration<double>(marks[k].first - prev.first).count();
      if (dt > 0) {
        peak = std::max(peak, static_cast<double>(marks[k].second - prev.second) *
                                  static_cast<double>(p.size) / (1024.0 * 1024.0) / dt);
      }
      prev = marks[k];
    }
  }
  res.bw_peak = peak;
  if (p.validate && op == Opcode::read) {
    // Every slot was last read from the peer's pattern for that slot.
    for (std::size_t s = 0; s < std::min<std::uint64_t>(p.slots, target); ++s) {
      res.validated &= check_region(mine, at.local_base + s * p.size, p.size, s);
    }
  }
  if (receiver != nullptr) res.validated &= receiver->valid();
  return res;
}

// After a WRITE bandwidth phase of `iters` requests: each slot (from `base_off`) holds what the
// last write into it carried.
bool check_written(const MemoryRegion& m, std::size_t base_off, const Phase& p, std::uint64_t iters) {
  bool valid = true;
  for (std::size_t s = 0; s < std::min<std::uint64_t>(p.slots, iters); ++s) {
    const std::uint64_t last = iters - 1 - ((iters - 1 - s) % p.slots);
    valid &= check_region(m, base_off + s * p.size, p.size, last);
  }
  return valid;
}

// The passive side of send bandwidth: keep receives posted, count (and check) what arrives.
bool run_bw_send_target(Connection& c, const Phase& p, const MemoryRegion& mine) {
  Receiver rx(c, p, mine, 0);
  rx.start();
  send_json(c, {{"ready", true}});
  std::vector<Completion> comps(64);
  auto deadline = Clock::now() + 120s + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(p.duration));
  std::uint32_t idle = 0;
  while (!rx.done()) {
    const std::size_t n = c.poll(comps);
    for (std::size_t k = 0; k < n; ++k) {
      if (!comps[k].ok()) throw Fail(comps[k].describe());
      rx.on_completion(comps[k]);
    }
    if (n > 0) {
      idle = 0;
      continue;
    }
    // Clock, control channel and peer checks cost syscalls: only when idle for a while.
    if ((++idle & 0xfff) != 0) continue;
    // With --duration the sender says how many it sent ("stop") once its time is up.
    if (!rx.target_known()) {
      if (auto m = c.receive_message(0ms)) {
        const json j = json::parse(m->begin(), m->end(), nullptr, false);
        if (j.is_discarded() || !j.contains("stop")) throw Fail("send bandwidth: expected the sender's count");
        rx.set_target(j["stop"].get<std::uint64_t>());
      }
    }
    if (Clock::now() > deadline) throw Fail("send bandwidth: the sender stalled");
    if (c.peer_closed()) throw Fail("send bandwidth: the peer is gone");
  }
  return rx.valid();
}

}  // namespace rdmakit::tools::bench
