// rdmakit bench: perftest's measurements (ib_{write,read,send,atomic}_{bw,lat}) through the
// public library API only, so what it measures is what a user of the library gets.
//
// Protocol, per message size: the client sends the phase's parameters as a control message; the
// server prepares (fills its buffer, posts receives) and answers "ready"; both run the phase;
// the client sends its results, and the server answers with its own view (validation). Both
// sides must be given the same --size/--all/--tx-depth, as with perftest: they size the buffers
// before anything is exchanged.
#include "bench.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "memory_options.hpp"
#include "options.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::tools {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
using namespace std::chrono_literals;

constexpr std::size_t kMaxSweep = 8u << 20;           // --all: 2 B .. 8 MiB, as perftest -a
constexpr std::size_t kSlotBudget = 8u << 20;         // bytes of distinct slots per buffer
constexpr std::uint64_t kSignalEvery = 32;            // selective signaling interval (bw)

// A request's queue entry comes back only with a later signaled completion, so a sender that
// keeps at most tx_depth in flight must signal at least once per tx_depth requests, or it waits
// forever for room. Every half depth keeps the pipeline full while the completion travels.
std::uint64_t signal_interval(std::uint32_t tx_depth) {
  return std::clamp<std::uint64_t>(tx_depth / 2, 1, kSignalEvery);
}

struct BenchOptions {
  ConnectOptions net;
  MemOptions mem;
  std::string op;    // write | read | send | atomic
  std::string mode;  // bw | lat
  std::size_t size = 0;  // 0: the mode's default
  bool all = false;
  std::uint64_t iters = 0;  // 0: the mode's default
  double duration = 0;      // seconds; bandwidth runs for this long instead of --iters
  std::uint32_t tx_depth = 128;
  std::uint32_t post_list = 16;
  std::uint32_t inline_size = 64;
  std::uint32_t qps = 1;
  bool bidir = false;
  bool events = false;
  bool validate = false;
  bool json_out = false;

  [[nodiscard]] bool bw() const { return mode == "bw"; }
  [[nodiscard]] std::vector<std::size_t> sizes() const {
    if (op == "atomic") return {8};
    if (!all) return {size != 0 ? size : bw() ? 65536u : 2u};
    std::vector<std::size_t> v;
    for (std::size_t s = 2; s <= kMaxSweep; s *= 2) v.push_back(s);
    return v;
  }
  [[nodiscard]] std::size_t max_size() const {
    const auto v = sizes();
    return *std::max_element(v.begin(), v.end());
  }
  [[nodiscard]] std::uint64_t iterations() const { return iters != 0 ? iters : bw() ? 5000 : 1000; }
  // Distinct buffer slots for a size: up to kSlotBudget bytes of them, at most one per
  // outstanding request, at least one.
  [[nodiscard]] std::size_t slots(std::size_t sz) const {
    if (!bw()) return 1;  // latency uses two fixed halves
    return std::clamp<std::size_t>(kSlotBudget / std::max<std::size_t>(sz, 1), 1, tx_depth);
  }
  // Bytes of one half of the buffer: with --bidir each side sends from its first half into the
  // peer's second half, so the two directions never touch the same bytes.
  [[nodiscard]] std::size_t half_bytes() const {
    std::size_t most = max_size();
    for (std::size_t s : sizes()) most = std::max(most, s * slots(s));
    return most;
  }
  [[nodiscard]] std::size_t buffer_bytes() const { return 2 * half_bytes(); }
};

// The byte pattern of iteration `iter` (validation): cheap, and different for every iteration
// and position.
std::uint8_t pattern(std::uint64_t iter, std::size_t pos) {
  return static_cast<std::uint8_t>((iter * 131 + pos * 7 + 1) & 0xff);
}
void fill(std::uint8_t* p, std::size_t n, std::uint64_t iter) {
  for (std::size_t i = 0; i < n; ++i) p[i] = pattern(iter, i);
}
bool check(const std::uint8_t* p, std::size_t n, std::uint64_t iter) {
  for (std::size_t i = 0; i < n; ++i) {
    if (p[i] != pattern(iter, i)) return false;
  }
  return true;
}

// Where the CPU fills and checks a region's contents: the memory itself when the CPU can reach
// it (on the bounce path the staging copies carry it to and from the registered buffer), else
// the registered bytes.
std::uint8_t* cpu_view(const MemoryRegion& m) {
  return static_cast<std::uint8_t*>(m.home() != nullptr ? m.home() : m.data());
}
// Fills [off, off + n) with iteration `iter`'s pattern and stages it for the NIC.
void fill_region(const MemoryRegion& m, std::size_t off, std::size_t n, std::uint64_t iter) {
  fill(cpu_view(m) + off, n, iter);
  m.stage_in(off, n);
}
// Brings [off, off + n) back from the NIC and checks it holds iteration `iter`'s pattern.
bool check_region(const MemoryRegion& m, std::size_t off, std::size_t n, std::uint64_t iter) {
  m.stage_out(off, n);
  return check(cpu_view(m) + off, n, iter);
}

// --- control messages ------------------------------------------------------------------------

void send_json(Connection& c, const json& j) {
  const std::string s = j.dump();
  c.send_message({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()}, 10s);
}

json recv_json(Connection& c, std::chrono::milliseconds timeout, const char* what) {
  auto m = c.receive_message(timeout);
  if (!m) throw Fail(fmt::format("no {} from the peer within {} ms (peer gone?)", what, timeout.count()));
  json j = json::parse(m->begin(), m->end(), nullptr, false);
  if (j.is_discarded()) throw Fail(fmt::format("malformed {} from the peer", what));
  if (j.contains("error")) throw Fail(fmt::format("the peer reports: {}", j["error"].get<std::string>()));
  return j;
}

// --- measurement -----------------------------------------------------------------------------

struct Phase {
  std::string op, mode;
  std::size_t size = 0;
  std::uint64_t iters = 0;
  std::uint32_t tx_depth = 0;
  std::uint32_t post_list = 0;
  std::size_t slots = 1;
  bool validate = false;
  double duration = 0;  // > 0: post for this many seconds; the iteration count is the outcome
  bool bidir = false;
  std::size_t half = 0;  // offset of the buffer's second half (--bidir targets)
};

json to_json(const Phase& p) {
  return {{"op", p.op},           {"mode", p.mode},   {"size", p.size},
          {"iters", p.iters},     {"tx_depth", p.tx_depth}, {"post_list", p.post_list},
          {"slots", p.slots},     {"validate", p.validate}, {"duration", p.duration},
          {"bidir", p.bidir},     {"half", p.half}};
}
Phase phase_from(const json& j) {
  Phase p;
  p.op = j.at("op");
  p.mode = j.at("mode");
  p.size = j.at("size");
  p.iters = j.at("iters");
  p.tx_depth = j.at("tx_depth");
  p.post_list = j.at("post_list");
  p.slots = j.at("slots");
  p.validate = j.at("validate");
  p.duration = j.value("duration", 0.0);
  p.bidir = j.value("bidir", false);
  p.half = j.value("half", std::size_t{0});
  return p;
}

struct Result {
  std::size_t bytes = 0;
  std::uint64_t iters = 0;
  double seconds = 0;
  double bw_peak = 0;  // MB/s (2^20), as perftest
  double bw_avg = 0;
  double msg_rate = 0;  // Mpps
  std::vector<double> lat_us;  // sorted
  bool validated = true;  // what this side could check (the peer reports its own part)
};

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

// The receiving side of send bandwidth: keeps receives posted (into `base_off` + slot), counts
// and checks what arrives. Receive r takes the peer's message r, whose pattern is r's.
class Receiver {
 public:
  Receiver(Connection& c, const Phase& p, const MemoryRegion& mine, std::size_t base_off)
      : c_(c), p_(p), mine_(mine), base_off_(base_off),
        ahead_(std::min<std::uint32_t>(c.info().recv_depth,
                                       static_cast<std::uint32_t>(p.validate ? p.slots : c.info().recv_depth))),
        target_(p.duration > 0 ? std::numeric_limits<std::uint64_t>::max() : p.iters) {}
  void start() { post_upto(ahead_); }
  void on_completion(const Completion& x) {
    const std::uint64_t i = x.wr_id;
    if (p_.validate) {
      valid_ &= x.byte_len == p_.size && check_region(mine_, base_off_ + (i % p_.slots) * p_.size, p_.size, i);
    }
    ++received_;
    post_upto(received_ + ahead_);
  }
  void set_target(std::uint64_t t) { target_ = t; }
  [[nodiscard]] bool done() const { return received_ >= target_; }
  [[nodiscard]] bool target_known() const { return target_ != std::numeric_limits<std::uint64_t>::max(); }
  [[nodiscard]] bool valid() const { return valid_; }
  [[nodiscard]] std::uint32_t pending() const { return static_cast<std::uint32_t>(next_post_ - received_); }

 private:
  void post_upto(std::uint64_t upto) {
    for (; next_post_ < upto && next_post_ < target_; ++next_post_) {
      const LocalSlice dst = mine_.local().subslice(base_off_ + (next_post_ % p_.slots) * p_.size, p_.size);
      if (const PostResult r = c_.post_recv(dst, next_post_); !r.ok()) throw Fail(r.describe());
    }
  }
  Connection& c_;
  const Phase& p_;
  const MemoryRegion& mine_;
  std::size_t base_off_;
  std::uint32_t ahead_;
  std::uint64_t target_;
  std::uint64_t next_post_ = 0, received_ = 0;
  bool valid_ = true;
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

double elapsed_us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// Samples as perftest takes them: the time between consecutive posts is one round trip (one
// clock read per iteration); ping-pongs report half of it as the one-way latency, READ and
// atomics the whole. The last entry is stamped here, at the end.
void round_trips(std::vector<Clock::time_point>& posted_at, double factor, std::vector<double>& out) {
  posted_at.back() = Clock::now();
  for (std::size_t i = 0; i + 1 < posted_at.size(); ++i) {
    out.push_back(elapsed_us(posted_at[i], posted_at[i + 1]) * factor);
  }
}

// Latency. WRITE ping-pong: each side watches the last byte of its own buffer for the peer's tag
// (perftest's method), so no completion is on the critical path. SEND ping-pong: a receive
// completion is. READ and atomics: one request at a time, full round trip.
Result run_lat(Connection& c, const Phase& p, const MemoryRegion& mine, bool initiator) {
  const RemoteRegion theirs = c.remote_regions().at(0);
  auto* base = static_cast<std::uint8_t*>(mine.data());
  Result res;
  res.bytes = p.size;
  res.iters = p.iters;
  res.lat_us.reserve(p.iters);
  std::vector<Completion> comps(16);
  // With --validate, both sides send pattern 0 from their first half; the initiator checks what
  // arrived (write, send: in its second half; read: in its first half) after the run.
  if (p.validate && (p.op == "write" || p.op == "send")) fill(base, p.size, 0);
  const auto t_begin = Clock::now();
  if (p.op == "write") {
    // As perftest: write from the first half of the buffer into the peer's second half, and
    // watch the last byte of our own second half for the peer's reply.
    const LocalSlice src = mine.local().subslice(0, p.size);
    volatile std::uint8_t* last = base + 2 * p.size - 1;
    if (initiator) std::memset(base, 0, 2 * p.size);  // no stale tag from an earlier size
    // Spins on the tag byte, with a deadline: a dead peer must not hang the bench.
    auto await_tag = [&](std::uint8_t tag) {
      const auto deadline = Clock::now() + 10s;
      for (std::uint32_t spin = 1; *last != tag; ++spin) {
        if ((spin & 0xfff) == 0) {
          (void)reap(c, 0, comps);
          if (Clock::now() > deadline) throw Fail("write latency: no reply within 10 s (peer gone?)");
        }
      }
    };
    // As perftest: one timestamp per iteration, taken when the write is posted; a sample is the
    // time between two posts (one round trip), halved.
    std::vector<Clock::time_point> posted_at(initiator ? p.iters + 1 : 0);
    for (std::uint64_t i = 0; i < p.iters; ++i) {
      const auto tag = static_cast<std::uint8_t>(i % 255 + 1);
      if (!initiator) await_tag(tag);
      if (initiator) posted_at[i] = Clock::now();
      base[p.size - 1] = tag;
      WorkRequest w;
      w.opcode = Opcode::write;
      w.local = {&src, 1};
      w.remote = theirs;
      w.remote_offset = p.size;
      w.wr_id = i;
      w.signaled = false;
      post_one(c, w, comps);
      if (initiator) await_tag(tag);
      // Retire the library's periodic signaled write now and then, off the critical path.
      if (c.outstanding() >= 8) (void)reap(c, 0, comps);
    }
    if (initiator) round_trips(posted_at, 0.5, res.lat_us);
  } else if (p.op == "send") {
    const LocalSlice src = mine.local().subslice(0, p.size);
    const LocalSlice dst = mine.local().subslice(p.size, p.size);
    // The server posted its first receive before saying "ready"; ours only has to be there before
    // the server's first reply, which our first send triggers.
    if (initiator) {
      if (const PostResult r = c.post_recv(dst, 0); !r.ok()) throw Fail(r.describe());
    }
    std::vector<Clock::time_point> posted_at(initiator ? p.iters + 1 : 0);
    for (std::uint64_t i = 0; i < p.iters; ++i) {
      auto await_recv = [&] {
        for (;;) {
          const Completion x = wait_ok(c, "receive");
          if (x.opcode == Opcode::recv) return;
        }
      };
      if (!initiator) await_recv();
      if (initiator) posted_at[i] = Clock::now();
      if (const PostResult r = c.post_recv(dst, i + 1); !r.ok()) throw Fail(r.describe());
      WorkRequest w;
      w.opcode = Opcode::send;
      w.local = {&src, 1};
      w.wr_id = i;
      w.signaled = false;
      post_one(c, w, comps);
      if (initiator) await_recv();
    }
    if (initiator) round_trips(posted_at, 0.5, res.lat_us);
  } else if (initiator) {  // read, atomic: only the initiator works, one request at a time
    const LocalSlice dst = mine.local().subslice(0, p.size);
    std::vector<Clock::time_point> posted_at(p.iters + 1);
    for (std::uint64_t i = 0; i < p.iters; ++i) {
      posted_at[i] = Clock::now();
      const PostResult r = p.op == "read" ? c.post_read(dst, theirs, 0, i)
                                          : c.post_fetch_add(dst, theirs, 0, 1, i);
      if (!r.ok()) throw Fail(r.describe());
      (void)wait_ok(c, p.op.c_str());
    }
    round_trips(posted_at, 1.0, res.lat_us);
  }
  res.seconds = std::chrono::duration<double>(Clock::now() - t_begin).count();
  std::sort(res.lat_us.begin(), res.lat_us.end());
  if (p.validate && initiator) {
    if (p.op == "write") res.validated = check(base + p.size, p.size - 1, 0);  // the last byte is the tag
    if (p.op == "send") res.validated = check(base + p.size, p.size, 0);
    if (p.op == "read") res.validated = check(base, p.size, 0);
  }
  return res;
}

// --- reporting -------------------------------------------------------------------------------

double quantile(const std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const auto idx = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
  return v[std::min(idx, v.size() - 1)];
}

json result_json_bw(const Result& r) {
  return {{"bytes", r.bytes},         {"iterations", r.iters},
          {"seconds", r.seconds},     {"bw_peak_MBps", r.bw_peak},
          {"bw_avg_MBps", r.bw_avg},  {"bw_avg_Gbps", r.bw_avg * 1024 * 1024 * 8 / 1e9},
          {"msg_rate_Mpps", r.msg_rate}};
}

json result_json(const BenchOptions& o, const Result& r) {
  json j = {{"bytes", r.bytes}, {"iterations", r.iters}, {"seconds", r.seconds}};
  if (o.bw()) {
    j = result_json_bw(r);
  } else {
    const auto& v = r.lat_us;
    const double avg = v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
    double var = 0;
    for (double x : v) var += (x - avg) * (x - avg);
    j["t_min_us"] = v.empty() ? 0 : v.front();
    j["t_median_us"] = quantile(v, 0.5);
    j["t_avg_us"] = avg;
    j["t_stdev_us"] = v.empty() ? 0 : std::sqrt(var / static_cast<double>(v.size()));
    j["t_p99_us"] = quantile(v, 0.99);
    j["t_p999_us"] = quantile(v, 0.999);
    j["t_max_us"] = v.empty() ? 0 : v.back();
  }
  if (o.validate) j["validated"] = r.validated;
  return j;
}

void print_header(const BenchOptions& o, const ConnectionInfo& info, std::uint32_t signal_every) {
  fmt::print("---------------------------------------------------------------------------------------\n");
  fmt::print("                    RDMA {} {} (rdmakit bench)\n", o.op, o.bw() ? "bandwidth" : "latency");
  fmt::print(" device {} port {} ({}), GID [{}] {} {}, path MTU {}\n", info.device, info.port,
             to_string(info.link_layer), info.local.gid_index, info.local_gid.address(),
             to_string(info.local.gid_type), info.path_mtu);
  fmt::print(" local QPN {:#08x} PSN {:#08x}, remote QPN {:#08x} PSN {:#08x}{}\n", info.local.qpn,
             info.local.psn, info.remote.qpn, info.remote.psn,
             info.qps > 1 ? fmt::format(" (+{} more QPs; >= {} B striped)", info.qps - 1,
                                        ConnectionConfig{}.stripe_min)
                          : "");
  if (o.bidir) fmt::print(" bidirectional: both sides send; figures are the sum of both directions\n");
  fmt::print(" tx depth {}, post list {}, signal every {}, max inline {}, completions by {}\n",
             o.bw() ? o.tx_depth : 1u, o.bw() ? o.post_list : 1u, o.bw() ? signal_every : 1u,
             info.max_inline, o.events ? "events" : "polling");
  fmt::print("---------------------------------------------------------------------------------------\n");
  if (o.bw()) {
    fmt::print(" {:<10} {:<14} {:>16} {:>19} {:>14} {:>14}\n", "#bytes", "#iterations",
               "BW peak[MB/sec]", "BW average[MB/sec]", "BW avg[Gb/s]", "MsgRate[Mpps]");
  } else {
    fmt::print(" {:<8} {:<8} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "#bytes",
               "#iter", "t_min[us]", "t_median[us]", "t_avg[us]", "t_stdev", "99%[us]",
               "99.9%[us]", "t_max[us]");
  }
}

void print_row(const BenchOptions& o, const json& j) {
  if (o.bw()) {
    fmt::print(" {:<10} {:<14} {:>16.2f} {:>19.2f} {:>14.4f} {:>14.6f}{}\n", j["bytes"].get<std::size_t>(),
               j["iterations"].get<std::uint64_t>(), j["bw_peak_MBps"].get<double>(),
               j["bw_avg_MBps"].get<double>(), j["bw_avg_Gbps"].get<double>(),
               j["msg_rate_Mpps"].get<double>(),
               j.contains("validated") ? (j["validated"].get<bool>() ? "  validated" : "  VALIDATION FAILED") : "");
  } else {
    fmt::print(" {:<8} {:<8} {:>10.2f} {:>12.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f}{}\n",
               j["bytes"].get<std::size_t>(), j["iterations"].get<std::uint64_t>(),
               j["t_min_us"].get<double>(), j["t_median_us"].get<double>(), j["t_avg_us"].get<double>(),
               j["t_stdev_us"].get<double>(), j["t_p99_us"].get<double>(), j["t_p999_us"].get<double>(),
               j["t_max_us"].get<double>(),
               j.contains("validated") ? (j["validated"].get<bool>() ? "  validated" : "  VALIDATION FAILED") : "");
  }
  std::fflush(stdout);
}

// --- the two roles ---------------------------------------------------------------------------

ConnectionConfig bench_config(const BenchOptions& o) {
  ConnectOptions net = o.net;
  net.trace_json = o.json_out;
  ConnectionConfig cfg = net.config();
  cfg.send_depth = std::max<std::uint32_t>(o.tx_depth, 16);
  // Send bandwidth needs receives ahead of the sender; twice its depth keeps RNR away.
  cfg.recv_depth = std::max<std::uint32_t>(2 * o.tx_depth, 64);
  cfg.max_inline = o.inline_size;
  cfg.completion_events = o.events;
  cfg.qps = o.qps;  // the server follows the client's count
  return cfg;
}

void bench_setup(const BenchOptions& o, Connection& c) {
  c.advertise(o.mem.allocate(c, o.buffer_bytes(), Access::local_write | Access::remote_read |
                                                      Access::remote_write | Access::remote_atomic));
}

// Latency tests and validation touch the bytes with the CPU; GPU memory registered directly has
// none to touch.
void require_cpu_view(const BenchOptions& o, const MemoryRegion& m) {
  if (m.data() == nullptr && (!o.bw() || o.validate || o.op == "atomic")) {
    throw Fail(fmt::format("{}: the CPU cannot reach this memory; only write/read/send bw without "
                           "--validate run on it", describe_memory(m)));
  }
}

int finish(const BenchOptions& o, const json& rows, bool failed) {
  if (o.json_out) fmt::print("{}\n", json{{"op", o.op}, {"mode", o.mode}, {"results", rows}}.dump(2));
  return failed ? 1 : 0;
}

// perftest reports a bidirectional run as the sum of both directions.
void add_peer(Result& r, const json& peer) {
  r.bw_avg += peer.at("bw_avg_MBps").get<double>();
  r.bw_peak += peer.at("bw_peak_MBps").get<double>();
  r.msg_rate += peer.at("msg_rate_Mpps").get<double>();
}

int run_client(const BenchOptions& o) {
  Connection c = Connection::connect(o.net.connect_target(), bench_config(o),
                                     [&](Connection& cc) { bench_setup(o, cc); });
  const MemoryRegion& mine = c.memory(0);
  require_cpu_view(o, mine);
  if (!o.json_out) {
    print_header(o, c.info(), static_cast<std::uint32_t>(signal_interval(o.tx_depth)));
    fmt::print(" memory: {}\n", describe_memory(mine));
  }
  json rows = json::array();
  bool failed = false;
  for (std::size_t size : o.sizes()) {
    // Without --validate every request uses the same buffer, as perftest does: spreading them
    // over 8 MiB of slots made the (software) NIC's copies miss caches at large sizes.
    Phase p{o.op,       o.mode,      size,
            o.iterations(), o.tx_depth, o.post_list,
            o.validate ? o.slots(size) : 1, o.validate, o.duration, o.bidir, o.half_bytes()};
    // Send with validation: at most one receive per slot is posted, so the sender keeps no more
    // than that in flight.
    if (o.validate && o.op == "send") p.tx_depth = static_cast<std::uint32_t>(std::min<std::size_t>(p.tx_depth, p.slots));
    // --bidir: the peer READs our first half and SENDs into our second; both are ready before
    // the peer hears the parameters.
    std::optional<Receiver> rx;
    if (p.bidir && p.op == "read") {
      for (std::size_t s = 0; s < p.slots; ++s) fill_region(mine, s * p.size, p.size, s);
    }
    if (p.bidir && p.op == "send") {
      rx.emplace(c, p, mine, p.half);
      rx->start();
    }
    send_json(c, to_json(p));
    (void)recv_json(c, 30s, "ready");
    Result r = o.bw() ? run_bw_initiator(c, p, mine, !o.json_out, rx ? &*rx : nullptr)
                      : run_lat(c, p, mine, true);
    if (p.duration > 0 && p.op == "send") send_json(c, {{"stop", r.iters}});
    send_json(c, {{"done", true}, {"iters", r.iters}});
    const json verdict = recv_json(c, 120s, "verdict");
    if (o.validate) r.validated = r.validated && verdict.value("validated", false);
    if (p.bidir) {
      if (o.validate && p.op == "write") {
        r.validated = r.validated && check_written(mine, p.half, p, verdict.at("peer").at("iterations"));
      }
      add_peer(r, verdict.at("peer"));
    }
    json row = result_json(o, r);
    if (o.validate && !r.validated) failed = true;
    if (!o.json_out) print_row(o, row);
    rows.push_back(std::move(row));
  }
  send_json(c, {{"finished", true}});
  if (!o.json_out) fmt::print("---------------------------------------------------------------------------------------\n");
  c.wait_peer_close(10s);
  return finish(o, rows, failed);
}

int run_server(const BenchOptions& o) {
  Listener listener(o.net.listen_address(), bench_config(o),
                    [&](Connection& cc) { bench_setup(o, cc); });
  if (!o.json_out) fmt::print("waiting for a bench client on port {}\n", listener.port());
  std::optional<Connection> conn;
  while (!(conn = listener.accept(1s))) {
  }
  Connection& c = *conn;
  const MemoryRegion& mine = c.memory(0);
  require_cpu_view(o, mine);
  auto* base = static_cast<std::uint8_t*>(mine.data());
  if (!o.json_out) {
    print_header(o, c.info(), static_cast<std::uint32_t>(signal_interval(o.tx_depth)));
    fmt::print(" memory: {}\n", describe_memory(mine));
  }
  for (;;) {
    const json j = recv_json(c, 600s, "phase parameters");
    if (j.contains("finished")) break;
    const Phase p = phase_from(j);
    if (p.op != o.op || p.mode != o.mode) {
      send_json(c, {{"error", fmt::format("the server runs {} {}, the client asked for {} {}", o.op,
                                          o.mode, p.op, p.mode)}});
      return 1;
    }
    if (p.half + p.size * p.slots > mine.size() || (p.mode == "lat" && 2 * p.size > mine.size())) {
      send_json(c, {{"error", fmt::format("{} B x {} slots exceeds the server's {} B buffer: give "
                                          "the server the same --size/--all/--tx-depth",
                                          p.size, p.slots, mine.size())}});
      return 1;
    }
    bool valid = true;
    if (p.op == "read") {
      for (std::size_t s = 0; s < p.slots; ++s) fill_region(mine, s * p.size, p.size, s);
    }
    if (p.op == "atomic") std::memset(base, 0, 8);
    std::optional<Result> mine_result;  // --bidir: this side's own direction
    if (p.mode == "bw" && p.bidir) {
      std::optional<Receiver> rx;
      if (p.op == "send") {
        rx.emplace(c, p, mine, p.half);
        rx->start();
      }
      send_json(c, {{"ready", true}});
      mine_result = run_bw_initiator(c, p, mine, false, rx ? &*rx : nullptr);
      valid = mine_result->validated;
    } else if (p.mode == "bw" && p.op == "send") {
      valid = run_bw_send_target(c, p, mine);
    } else if (p.mode == "lat") {
      if (p.op == "write" || p.op == "send") std::memset(base, 0, 2 * p.size);  // no stale tag
      if (p.op == "send") {
        // The client's first SEND must find a receive.
        if (const PostResult r = c.post_recv(mine.local().subslice(p.size, p.size), 0); !r.ok()) {
          throw Fail(r.describe());
        }
      }
      send_json(c, {{"ready", true}});
      (void)run_lat(c, p, mine, false);
    } else {
      send_json(c, {{"ready", true}});
    }
    const json done = recv_json(c, 600s, "end of phase");
    if (p.validate && p.mode == "bw" && p.op == "write") {
      valid &= check_written(mine, p.bidir ? p.half : 0, p, done.at("iters"));
    }
    if (p.validate && p.op == "atomic") {  // every fetch-and-add added one
      std::uint64_t v;
      std::memcpy(&v, base, 8);
      valid = v == done.at("iters").get<std::uint64_t>();
    }
    json verdict = {{"validated", valid}};
    if (mine_result) verdict["peer"] = result_json_bw(*mine_result);
    send_json(c, verdict);
    if (!o.json_out) fmt::print(" {} B: done{}\n", p.size, p.validate ? (valid ? ", validated" : ", VALIDATION FAILED") : "");
  }
  c.close(10s);
  return 0;
}

}  // namespace

void add_bench(CLI::App& app, std::function<int()>& run) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app.add_subcommand("bench", "measure bandwidth or latency like perftest, through the library");
  sub->add_option("op", o->op, "write, read, send or atomic")
      ->required()
      ->check(CLI::IsMember({"write", "read", "send", "atomic"}));
  sub->add_option("mode", o->mode, "bw or lat")->required()->check(CLI::IsMember({"bw", "lat"}));
  o->net.add_to(*sub);
  sub->add_option("-s,--size", o->size, "message size in bytes (default: 65536 for bw, 2 for lat)")
      ->check(CLI::Range(std::size_t{1}, kMaxSweep));
  sub->add_flag("-a,--all", o->all, "sweep sizes 2 B to 8 MiB by powers of two");
  sub->add_option("-n,--iters", o->iters, "iterations per size (default: 5000 for bw, 1000 for lat)");
  sub->add_option("-D,--duration", o->duration, "bw: run for this many seconds instead of --iters")
      ->check(CLI::Range(0.001, 3600.0));
  sub->add_option("-t,--tx-depth", o->tx_depth, "requests in flight (bw)")
      ->check(CLI::Range(1u, 32767u))
      ->capture_default_str();
  sub->add_option("-l,--post-list", o->post_list, "requests chained per ibv_post_send (bw)")
      ->check(CLI::Range(1u, 4096u))
      ->capture_default_str();
  sub->add_option("-I,--inline", o->inline_size, "inline bytes to ask the QP for")->capture_default_str();
  sub->add_option("-q,--qps", o->qps,
                  "QPs per connection (client; write/read bw): chains spread over them, "
                  "messages of 512 KiB or more striped across all")
      ->check(CLI::Range(1u, 16u))
      ->capture_default_str();
  sub->add_flag("-b,--bidir", o->bidir, "bw: both sides send at once (reported as the sum)");
  o->mem.add_to(*sub);
  sub->add_flag("-e,--events", o->events, "sleep on a completion channel instead of polling");
  sub->add_flag("--validate", o->validate, "check every transfer's data");
  sub->add_flag("--json", o->json_out, "print the results as JSON");
  sub->callback([o, &run] {
    require_role(o->net, "bench");
    if (o->op == "atomic" && o->size != 0 && o->size != 8) {
      throw CLI::ValidationError("--size", "atomics are 8 bytes");
    }
    if (o->duration > 0 && !o->bw()) throw CLI::ValidationError("--duration", "--duration is for bw tests");
    if (o->qps > 1 && (o->op == "send" || o->op == "atomic" || !o->bw())) {
      throw CLI::ValidationError("--qps", "--qps is for write and read bandwidth: SEND/RECV and "
                                          "atomics stay on one QP to keep their order");
    }
    if (o->bidir && (!o->bw() || o->op == "atomic")) {
      throw CLI::ValidationError("--bidir", "--bidir is for write, read and send bandwidth");
    }
    if (o->bidir && o->duration > 0 && o->op == "send") {
      throw CLI::ValidationError("--bidir", "send --bidir counts messages: give --iters, not --duration");
    }
    if (o->duration > 0 && o->iters != 0) throw CLI::ValidationError("--duration", "give --duration or --iters");
    // Receives posted ahead for one size would take the next size's messages.
    if (o->duration > 0 && o->op == "send" && o->all) {
      throw CLI::ValidationError("--duration", "send with --duration measures one size (no --all)");
    }
    run = guarded("bench", [o] {
      o->mem.check(o->buffer_bytes());  // no CUDA device, no huge pages: said before connecting
      return o->net.serving() ? run_server(*o) : run_client(*o);
    });
  });
}

}  // namespace rdmakit::tools
