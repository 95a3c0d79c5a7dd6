// SPDX-License-Identifier: Apache-2.0
// rdmakit bench: latency, as perftest measures it (ib_*_lat), through the public API.
#include "bench/bench.hpp"

#include <cstring>

namespace rdmakit::tools::bench {

using namespace std::chrono_literals;

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

}  // namespace rdmakit::tools::bench
