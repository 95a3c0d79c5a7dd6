// SPDX-License-Identifier: Apache-2.0
// The engine's cost per transfer, for callgrind: rounds of 8-byte RDMA WRITEs, once through raw
// verbs (a chain of B requests in one ibv_post_send, signaled as the engine signals its chains:
// every kSignalEvery-th (64) and the last, polled until
// all are back: the cheapest way verbs can do it) and once through Engine::submit with
// progress() on the calling thread (workers = 0, so every instruction of the engine's path runs
// inside the counted function). Each loop is an extern "C" function of its own
// (--toggle-collect=rdmakit_engine_*_loop). Between posting and reaping both sleep 1 ms, so what
// is counted is posting and completing, not polls of an empty CQ while the emulated NIC works.
//
//   rdmakit_engine_loop raw ROUNDS BATCH                (a connection of its own, in-process)
//   rdmakit_engine_loop engine ROUNDS BATCH HOST:PORT   (against `rdmakit serve --name t --expose kv:1M`)
//   rdmakit_engine_loop plan ROUNDS BATCH HOST:PORT     (the same transfers as a plan, Engine::prepare)
//   rdmakit_engine_loop lists ROUNDS BATCH HOST:PORT    (the same, by index into descriptor lists)
//   rdmakit_engine_loop wait|wait-read ROUNDS 1 HOST:PORT
//     the latency path instead (issue 34): one worker thread (the default), each transfer
//     submitted and waited for with Batch::wait(), no pause: the submitting thread posts, looks
//     at the CQ and (if it must) polls in wait(), so the counted thread runs the whole round
//     trip. On rxe an 8-byte WRITE or READ mostly completes inside its post. With
//     RDMAKIT_LOOP_TIMES set, timed instead (p50/p99 of submit() and of the round trip, who
//     posted and polled, each thread's context switches): the in-process view of engine-bench;
//     RDMAKIT_LOOP_PAUSE_US=N pauses N us between transfers (sparse traffic);
//     RDMAKIT_LOOP_ANCHOR=N times the raw verbs anchor (bench/loopback.hpp: a loopback
//     connection's QP, ibv_post_send + ibv_poll_cq) in this process too, in turns of N round
//     trips with the engine's N: on the lab's emulator one process's round trip differs from
//     another's running the same code by up to 50% (its layout in memory), so the two are
//     compared inside one process as well as across processes (bench/compare-latency).
//   rdmakit_engine_loop link|link-read ROUNDS 1 HOST:PORT
//     raw verbs on the engine's own link, timed as bench/latency_loop.cpp times its loop: one
//     8-byte WRITE or READ posted with ibv_post_send on the link's QP (the engine's buffer, the
//     peer's window of the segment) and polled off the worker's CQ, the engine's workers off
//     (workers = 0, nothing else polls): what the engine's QP, CQ, memory and window cost
//     against a connection's, apart from what the engine's own steps cost. With
//     RDMAKIT_LOOP_ANCHOR=N, in turns of N with the raw verbs anchor, as the wait modes.
// RDMAKIT_LOOP_NO_TELEMETRY set (any value): the engine without EngineConfig::telemetry (two
// clock reads per batch of one, of three, and the latency histogram), to measure what they cost.
// With RDMAKIT_LOOP_SCRAPE_MS=N, another thread reads Engine::metrics() every N ms meanwhile, as a
// Prometheus scraper would (callgrind counts the loop's thread only: what a scrape costs the
// data path, not what it costs itself).
#include <infiniband/verbs.h>
#include <dirent.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "connection/impl.hpp"
#include "engine/batch.hpp"
#include "engine/impl.hpp"
#include "loopback.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/engine.hpp"

namespace {

void pause_1ms() {
  timespec ts{0, 1'000'000};
  ::nanosleep(&ts, nullptr);
}

}  // namespace

extern "C" __attribute__((noinline)) unsigned long rdmakit_engine_raw_loop(ibv_qp* qp, ibv_cq* cq, ibv_send_wr* wrs,
                                                                           unsigned batch, unsigned long rounds) {
  unsigned long empty = 0;
  const unsigned signaled = (batch + rdmakit::detail::kSignalEvery - 1) / rdmakit::detail::kSignalEvery;
  for (unsigned long r = 0; r < rounds; ++r) {
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(qp, wrs, &bad) != 0) std::abort();
    pause_1ms();
    ibv_wc wc[16];
    for (unsigned got = 0; got < signaled;) {
      const int n = ibv_poll_cq(cq, 16, wc);
      if (n < 0) std::abort();
      if (n == 0) ++empty;
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) std::abort();
      }
      got += static_cast<unsigned>(n);
    }
  }
  return empty;
}

namespace {

// Rounds of submit() + progress(): of the transfers (a vector), a plan, or descriptor lists.
template <typename Submit>
[[gnu::always_inline]] inline unsigned long engine_rounds(rdmakit::Engine* e, Submit&& submit, unsigned long rounds) {
  unsigned long empty = 0;
  for (unsigned long r = 0; r < rounds; ++r) {
    rdmakit::Batch b = submit();
    (void)e->progress();  // posts
    pause_1ms();
    while (!b.done()) {
      if (e->progress() == 0) ++empty;
    }
    if (b.failed() != 0) std::abort();
  }
  return empty;
}

}  // namespace

extern "C" __attribute__((noinline)) unsigned long rdmakit_engine_engine_loop(rdmakit::Engine* e,
                                                                              const std::vector<rdmakit::Transfer>* t,
                                                                              unsigned long rounds) {
  return engine_rounds(e, [&] { return e->submit(*t); }, rounds);
}

extern "C" __attribute__((noinline)) unsigned long rdmakit_engine_wait_loop(rdmakit::Engine* e,
                                                                            const std::vector<rdmakit::Transfer>* t,
                                                                            unsigned long rounds) {
  for (unsigned long r = 0; r < rounds; ++r) {
    rdmakit::Batch b = e->submit(*t);
    if (!b.wait(std::chrono::seconds{10}) || b.failed() != 0) std::abort();
  }
  return 0;
}

extern "C" __attribute__((noinline)) unsigned long rdmakit_engine_lists_loop(rdmakit::Engine* e,
                                                                             const rdmakit::DescriptorList* local,
                                                                             const rdmakit::DescriptorList* remote,
                                                                             const std::vector<std::uint32_t>* indices,
                                                                             unsigned long rounds) {
  return engine_rounds(
      e, [&] { return e->submit(rdmakit::TransferOp::write, *local, *indices, *remote, *indices); }, rounds);
}

extern "C" __attribute__((noinline)) unsigned long rdmakit_engine_plan_loop(rdmakit::Engine* e,
                                                                            const rdmakit::TransferPlan* plan,
                                                                            unsigned long rounds) {
  return engine_rounds(e, [&] { return e->submit(*plan); }, rounds);
}

namespace {

long involuntary_switches() {
  rusage u{};
  (void)::getrusage(RUSAGE_THREAD, &u);
  return u.ru_nivcsw;
}

// The latency path timed instead of counted (RDMAKIT_LOOP_TIMES): p50/p99 of submit() alone
// and of submit + wait, the engine's counters of who posted and who polled, and each thread's
// context switches (how often the engine's worker thread woke meanwhile).
int timed_rounds(rdmakit::Engine& e, const std::vector<rdmakit::Transfer>& t, const std::string& mode,
                 unsigned long rounds) {
  std::vector<double> sub, all;
  // RDMAKIT_LOOP_PAUSE_US: a pause between transfers (sparse traffic: a lease renewal, a flag).
  const long pause_us = std::getenv("RDMAKIT_LOOP_PAUSE_US") != nullptr ? std::atol(std::getenv("RDMAKIT_LOOP_PAUSE_US")) : 0;
  // RDMAKIT_LOOP_ANCHOR=N: the raw verbs anchor in this process too, in turns of N round trips
  // with the engine's N (see the top).
  const long turn = std::getenv("RDMAKIT_LOOP_ANCHOR") != nullptr ? std::atol(std::getenv("RDMAKIT_LOOP_ANCHOR")) : 0;
  std::optional<bench::RawRoundTrip> anchor;
  if (turn > 0) anchor.emplace(mode == "wait-read");
  std::vector<double> raw;
  // This thread's involuntary context switches in the raw turns and in the engine's, warm-up
  // included (another task took its CPU mid round trip: on rxe, the kernel's softirq thread
  // doing the protocol).
  long raw_preempted = 0, engine_preempted = 0, turn_began = 0;
  for (unsigned long r = 0; r < rounds; ++r) {
    if (anchor && r % static_cast<unsigned long>(turn) == 0) {
      const long before = involuntary_switches();
      if (r != 0) engine_preempted += before - turn_began;  // the engine's turn that just ended
      for (long k = 0; k < turn; ++k) {
        if (pause_us > 0) std::this_thread::sleep_for(std::chrono::microseconds{pause_us});
        const auto t0 = std::chrono::steady_clock::now();
        if (const char* failed = anchor->once(); failed != nullptr) {
          std::fprintf(stderr, "raw verbs: %s\n", failed);
          return 1;
        }
        if (r >= rounds / 10) raw.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      turn_began = involuntary_switches();
      raw_preempted += turn_began - before;
    }
    if (pause_us > 0) std::this_thread::sleep_for(std::chrono::microseconds{pause_us});
    const auto t0 = std::chrono::steady_clock::now();
    rdmakit::Batch b = e.submit(t);
    const auto t1 = std::chrono::steady_clock::now();
    if (!b.wait(std::chrono::seconds{10}) || b.failed() != 0) return 1;
    const auto t2 = std::chrono::steady_clock::now();
    if (r < rounds / 10) continue;  // warm-up
    sub.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    all.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  if (anchor) engine_preempted += involuntary_switches() - turn_began;  // the last turn's
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (const dirent* de = ::readdir(d)) {
      if (de->d_name[0] == '.') continue;
      const std::string dir = std::string("/proc/self/task/") + de->d_name;
      char name[64] = "";
      if (std::FILE* f = std::fopen((dir + "/comm").c_str(), "r")) {
        if (std::fgets(name, sizeof name, f) == nullptr) name[0] = 0;
        std::fclose(f);
      }
      name[std::strcspn(name, "\n")] = 0;
      unsigned long vol = 0, invol = 0;
      if (std::FILE* f = std::fopen((dir + "/status").c_str(), "r")) {
        char line[256];
        while (std::fgets(line, sizeof line, f) != nullptr) {
          (void)std::sscanf(line, "voluntary_ctxt_switches: %lu", &vol);
          (void)std::sscanf(line, "nonvoluntary_ctxt_switches: %lu", &invol);
        }
        std::fclose(f);
      }
      std::printf("  thread %s: %lu voluntary, %lu involuntary context switches\n", name, vol, invol);
    }
    ::closedir(d);
  }
  std::sort(sub.begin(), sub.end());
  std::sort(all.begin(), all.end());
  const rdmakit::EngineCounters c = e.counters();
  std::printf("%s: submit p50 %.1f p99 %.1f, round trip p50 %.1f p99 %.1f us; of %llu batches %llu posted by their "
              "submitter, %llu of them ended inside submit(), %llu waits spun\n",
              mode.c_str(), sub[sub.size() / 2], sub[sub.size() * 99 / 100], all[all.size() / 2],
              all[all.size() * 99 / 100], static_cast<unsigned long long>(c.batches),
              static_cast<unsigned long long>(c.submits_inline), static_cast<unsigned long long>(rdmakit::Engine::Impl::of(e).count.submits_ended.load()),
              static_cast<unsigned long long>(c.waits_spun));
  if (!raw.empty()) {
    std::sort(raw.begin(), raw.end());
    const double r50 = raw[raw.size() / 2], r99 = raw[raw.size() * 99 / 100];
    std::printf("%s: raw verbs in turns with it, this process: round trip p50 %.1f p99 %.1f us; engine/raw p50 %.2fx "
                "p99 %.2fx; this thread preempted %ld times in the raw turns, %ld in the engine's\n",
                mode.c_str(), r50, r99, all[all.size() / 2] / r50, all[all.size() * 99 / 100] / r99, raw_preempted,
                engine_preempted);
  }
  return 0;
}

// Mode link|link-read: raw verbs on the engine's link (see the top).
int link_rounds(rdmakit::Engine& e, const rdmakit::Transfer& t, bool read, unsigned long rounds) {
  auto& impl = rdmakit::Engine::Impl::of(e);
  rdmakit::detail::Peer* p = impl.peer(t.remote);
  const rdmakit::detail::BufferRec* buf = impl.buffer(t.local);
  if (rounds == 0 || p == nullptr || p->link == nullptr || buf == nullptr || t.remote.slot >= p->link->by_slot.size() ||
      !p->link->by_slot[t.remote.slot]) {
    std::fprintf(stderr, "link: no rounds, or no link with the segment's window\n");
    return 1;
  }
  rdmakit::detail::Link& l = *p->link;
  // wr_id 1 is none of the data path's: nothing but this loop polls the CQ meanwhile.
  ibv_qp* qp = l.impl.dp.lane(0).qp;
  bench::RawRequest request(qp, qp->send_cq, buf->slices[l.device].subslice(0, 8), *l.by_slot[t.remote.slot], read,
                            l.impl.dp.limits().max_inline >= 8);
  // RDMAKIT_LOOP_ANCHOR=N: in turns of N with the raw verbs anchor (a loopback connection's QP),
  // as timed_rounds does: what the link's QP, window and memory cost, inside one process.
  const long turn = std::getenv("RDMAKIT_LOOP_ANCHOR") != nullptr ? std::atol(std::getenv("RDMAKIT_LOOP_ANCHOR")) : 0;
  std::optional<bench::RawRoundTrip> anchor;
  if (turn > 0) anchor.emplace(read);
  std::vector<double> us, raw;
  for (unsigned long i = 0; i < rounds + rounds / 10; ++i) {
    if (anchor && i % static_cast<unsigned long>(turn) == 0) {
      for (long k = 0; k < turn; ++k) {
        const auto t0 = std::chrono::steady_clock::now();
        if (const char* failed = anchor->once(); failed != nullptr) {
          std::fprintf(stderr, "raw verbs: %s\n", failed);
          return 1;
        }
        if (i >= rounds / 10) raw.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (const char* failed = request.once(); failed != nullptr) {
      std::fprintf(stderr, "link: %s\n", failed);
      return 1;
    }
    if (i >= rounds / 10) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  std::printf("%s: raw verbs on the engine's link: round trip p50 %.1f p99 %.1f us\n", read ? "link-read" : "link",
              us[us.size() / 2], us[us.size() * 99 / 100]);
  if (!raw.empty()) {
    std::sort(raw.begin(), raw.end());
    std::printf("%s: raw verbs on a connection in turns with it: p50 %.1f p99 %.1f us; link/connection p50 %.2fx\n",
                read ? "link-read" : "link", raw[raw.size() / 2], raw[raw.size() * 99 / 100],
                us[us.size() / 2] / raw[raw.size() / 2]);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool wait = mode == "wait" || mode == "wait-read";
  const bool link = mode == "link" || mode == "link-read";
  if (argc < 4 || (mode != "raw" && mode != "engine" && mode != "plan" && mode != "lists" && !wait && !link) ||
      (mode != "raw" && argc != 5)) {
    std::fprintf(stderr, "usage: %s raw ROUNDS BATCH | engine|plan|lists|wait|wait-read|link|link-read ROUNDS BATCH HOST:PORT\n",
                 argv[0]);
    return 2;
  }
  const unsigned long rounds = std::strtoul(argv[2], nullptr, 10);
  const auto batch = static_cast<unsigned>(std::strtoul(argv[3], nullptr, 10));
  unsigned long empty = 0;
  if (mode == "raw") {
    rdmakit::ConnectionConfig cfg;
    cfg.send_depth = 256;
    bench::Loopback loop(cfg);
    rdmakit::Connection& conn = loop.conn;
    auto& m = rdmakit::Connection::Impl::of(conn);
    const rdmakit::LocalSlice src = conn.memory(0).local();
    const rdmakit::RemoteRegion dst = conn.remote_regions().at(0);
    std::vector<ibv_sge> sges(batch);
    std::vector<ibv_send_wr> wrs(batch);
    for (unsigned k = 0; k < batch; ++k) {
      sges[k] = {reinterpret_cast<std::uint64_t>(src.addr()) + 8 * (k % 512), 8, src.lkey()};
      ibv_send_wr& w = wrs[k];
      w.wr_id = k;
      w.sg_list = &sges[k];
      w.num_sge = 1;
      w.opcode = IBV_WR_RDMA_WRITE;
      w.send_flags = ((k + 1) % rdmakit::detail::kSignalEvery == 0 || k + 1 == batch ? IBV_SEND_SIGNALED : 0) |
                     (m.info.max_inline >= 8 ? IBV_SEND_INLINE : 0);
      w.wr.rdma.remote_addr = dst.addr + 8 * (k % 512);
      w.wr.rdma.rkey = dst.rkey;
      w.next = k + 1 < batch ? &wrs[k + 1] : nullptr;
    }
    empty = rdmakit_engine_raw_loop(m.qps[0].get(), m.send_cq.get(), wrs.data(), batch, rounds);
  } else {
    rdmakit::EngineConfig cfg;
    cfg.name = "loop";
    cfg.listen = "";
    cfg.workers = wait ? 1 : 0;
    cfg.link.send_depth = 256;
    if (std::getenv("RDMAKIT_LOOP_NO_TELEMETRY") != nullptr) cfg.telemetry = false;
    rdmakit::Engine e(cfg);
    e.add_peer("t", argv[4]);
    std::string why;
    if (!e.connect("t", 10s, &why)) {
      std::fprintf(stderr, "%s\n", why.c_str());
      return 1;
    }
    const rdmakit::Buffer src = e.allocate_memory(4096);
    std::vector<rdmakit::Transfer> t(batch);
    for (unsigned k = 0; k < batch; ++k) {
      t[k].local = src;
      t[k].local_offset = 8 * (k % 512);
      t[k].length = 8;
      t[k].remote = e.segment("t", "kv");
      t[k].remote_offset = 8 * (k % 512);
      if (mode == "wait-read" || mode == "link-read") t[k].op = rdmakit::TransferOp::read;
    }
    // One round outside the count (not through the counted function): the first one allocates
    // what later rounds reuse.
    const rdmakit::TransferPlan plan = e.prepare(t);
    // The descriptor lists: the same 512 words a side, the batch's transfers by index.
    std::vector<rdmakit::LocalDescriptor> ld;
    std::vector<rdmakit::RemoteDescriptor> rd;
    for (unsigned k = 0; k < 512; ++k) {
      ld.push_back({src, 8 * k, 8});
      rd.push_back({e.segment("t", "kv"), 8 * k, 8});
    }
    const rdmakit::DescriptorList local = e.prepare_local(ld), remote = e.prepare_remote(rd);
    std::vector<std::uint32_t> indices(batch);
    for (unsigned k = 0; k < batch; ++k) indices[k] = k % 512;
    rdmakit::Batch warm = mode == "plan"    ? e.submit(plan)
                          : mode == "lists" ? e.submit(rdmakit::TransferOp::write, local, indices, remote, indices)
                                            : e.submit(t);
    if (wait) {
      if (!warm.wait(10s)) return 1;
      if (std::getenv("RDMAKIT_LOOP_TIMES") != nullptr) return rounds < 10 ? 2 : timed_rounds(e, t, mode, rounds);
      (void)rdmakit_engine_wait_loop(&e, &t, rounds);
      std::printf("%s: %lu rounds of %u\n", mode.c_str(), rounds, batch);
      return 0;
    }
    while (!warm.done()) (void)e.progress(std::chrono::milliseconds{1});
    if (link) return link_rounds(e, t[0], mode == "link-read", rounds);
    std::atomic<bool> stop{false};
    unsigned long scrapes = 0;
    std::thread scraper;
    if (const char* ms = std::getenv("RDMAKIT_LOOP_SCRAPE_MS"); ms != nullptr && std::atoi(ms) > 0) {
      const auto every = std::chrono::milliseconds{std::atoi(ms)};
      scraper = std::thread([&] {
        while (!stop.load()) {
          if (!e.metrics().empty()) ++scrapes;
          std::this_thread::sleep_for(every);
        }
      });
    }
    empty = mode == "plan"    ? rdmakit_engine_plan_loop(&e, &plan, rounds)
            : mode == "lists" ? rdmakit_engine_lists_loop(&e, &local, &remote, &indices, rounds)
                              : rdmakit_engine_engine_loop(&e, &t, rounds);
    stop = true;
    if (scraper.joinable()) {
      scraper.join();
      std::printf("%lu scrapes of Engine::metrics() meanwhile\n", scrapes);
    }
  }
  std::printf("%s: %lu rounds of %u, %lu empty polls\n", mode.c_str(), rounds, batch, empty);
  return 0;
}
