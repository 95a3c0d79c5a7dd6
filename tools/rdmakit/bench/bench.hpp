// SPDX-License-Identifier: Apache-2.0
#pragma once
// rdmakit bench's parts, shared by its files: the options, one measurement phase and its
// result, the data patterns and control messages (protocol.cpp), bandwidth (bandwidth.cpp),
// latency (latency.cpp), the report (report.cpp) and the client and server roles (roles.cpp).
//
// Protocol, per message size: the client sends the phase's parameters as a control message; the
// server prepares (fills its buffer, posts receives) and answers "ready"; both run the phase;
// the client sends its results, and the server answers with its own view (validation). Both
// sides must be given the same --size/--all/--tx-depth, as with perftest: they size the buffers
// before anything is exchanged.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "memory_options.hpp"
#include "options.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::tools::bench {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr std::size_t kMaxSweep = 8u << 20;           // --all: 2 B .. 8 MiB, as perftest -a
constexpr std::size_t kSlotBudget = 8u << 20;         // bytes of distinct slots per buffer
constexpr std::uint64_t kSignalEvery = 32;            // selective signaling interval (bw)

// A request's queue entry comes back only with a later signaled completion, so a sender that
// keeps at most tx_depth in flight must signal at least once per tx_depth requests, or it waits
// forever for room. Every half depth keeps the pipeline full while the completion travels.
inline std::uint64_t signal_interval(std::uint32_t tx_depth) {
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

// One measurement: what both sides run for one message size.
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
json to_json(const Phase& p);
Phase phase_from(const json& j);

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

// --- protocol.cpp: data patterns (validation) and control messages ------------------------------
std::uint8_t pattern(std::uint64_t iter, std::size_t pos);
void fill(std::uint8_t* p, std::size_t n, std::uint64_t iter);
bool check(const std::uint8_t* p, std::size_t n, std::uint64_t iter);
/// Where the CPU fills and checks a region's contents (see protocol.cpp).
std::uint8_t* cpu_view(const MemoryRegion& m);
/// Fills [off, off + n) with iteration `iter`'s pattern and stages it for the NIC.
void fill_region(const MemoryRegion& m, std::size_t off, std::size_t n, std::uint64_t iter);
/// Brings [off, off + n) back from the NIC and checks it holds iteration `iter`'s pattern.
bool check_region(const MemoryRegion& m, std::size_t off, std::size_t n, std::uint64_t iter);
void send_json(Connection& c, const json& j);
json recv_json(Connection& c, std::chrono::milliseconds timeout, const char* what);

// --- bandwidth.cpp -------------------------------------------------------------------------------
Completion wait_ok(Connection& c, const char* what);
/// Reaps completions without waiting; returns how many requests completed (by the highest
/// signaled wr_id seen + 1), failing on any error completion.
std::uint64_t reap(Connection& c, std::uint64_t completed, std::span<Completion> buf);
/// Posts one request; while the queue is full (unsignaled requests not yet retired), reaps.
void post_one(Connection& c, const WorkRequest& w, std::span<Completion> buf);

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

Result run_bw_initiator(Connection& c, const Phase& p, const MemoryRegion& mine, bool show,
                        Receiver* receiver);
bool check_written(const MemoryRegion& m, std::size_t base_off, const Phase& p, std::uint64_t iters);
bool run_bw_send_target(Connection& c, const Phase& p, const MemoryRegion& mine);

// --- latency.cpp ---------------------------------------------------------------------------------
Result run_lat(Connection& c, const Phase& p, const MemoryRegion& mine, bool initiator);

// --- report.cpp ----------------------------------------------------------------------------------
json result_json_bw(const Result& r);
json result_json(const BenchOptions& o, const Result& r);
void print_header(const BenchOptions& o, const ConnectionInfo& info, std::uint32_t signal_every);
void print_row(const BenchOptions& o, const json& j);

// --- roles.cpp -----------------------------------------------------------------------------------
int run_client(const BenchOptions& o);
int run_server(const BenchOptions& o);

}  // namespace rdmakit::tools::bench
