// SPDX-License-Identifier: Apache-2.0
// One small transfer at a time (issue 34): a batch started on the submitting thread while its
// worker's thread sleeps, and a wait that polls for its end itself before it sleeps. What these
// check is that the shortcut is taken, that the bytes are right whoever posts and polls, and that
// the edges around it (callbacks that submit, peers lost and engines destroyed while a waiter
// polls) end every batch. Against rxe in the lab; over tcp, shm and the shm ring on the host,
// under both sanitizers.
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine_helpers.hpp"
#include "lab_helpers.hpp"
#include "rdmakit/engine.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Batch;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::EngineConfig;
using rdmakit::SubmitOptions;
using rdmakit::Transfer;
using rdmakit::TransferOp;

// A counter of the engine's scrape (`NAME{engine="..."} VALUE`); 0 when absent.
std::uint64_t metric(Engine& e, const std::string& name) {
  const std::string m = e.metrics();
  const std::size_t at = m.find("\n" + name + "{");
  if (at == std::string::npos) return 0;
  const std::size_t value = m.find("} ", at);
  return value == std::string::npos ? 0 : std::stoull(m.substr(value + 2, m.find('\n', value) - value - 2));
}
using rdmakit::TransferStatus;

using lab::at;
using lab::config;
using lab::Target;
using lab::xfer;

EngineConfig spinning(const std::string& name, std::chrono::microseconds spin) {
  EngineConfig c = config(name);
  c.wait_spin = spin;
  return c;
}

// `rounds` of one 8-byte write then one 8-byte read back of [off..) on `seg`, each waited on
// alone; false (with why) at the first that fails or reads back other bytes.
bool ping(Engine& a, const Buffer& local, std::uint64_t loff, const rdmakit::RemoteSegment& seg, std::uint64_t off,
          int rounds, std::string* why) {
  auto* p = static_cast<unsigned char*>(local.addr) + loff;
  for (int r = 0; r < rounds; ++r) {
    const std::uint64_t v = (off << 20) ^ (static_cast<std::uint64_t>(r) * std::uint64_t{0x9e3779b97f4a7c15});
    std::memcpy(p, &v, 8);
    Batch w = a.submit(std::vector<Transfer>{xfer(TransferOp::write, local, loff, 8, seg, off)});
    if (!w.wait(10s) || w.failed() != 0) {
      *why = "write " + std::to_string(r) + ": " + (w.done() ? w.describe_failures() : "did not end in 10 s");
      return false;
    }
    std::memset(p, 0, 8);
    Batch rd = a.submit(std::vector<Transfer>{xfer(TransferOp::read, local, loff, 8, seg, off)});
    if (!rd.wait(10s) || rd.failed() != 0) {
      *why = "read " + std::to_string(r) + ": " + (rd.done() ? rd.describe_failures() : "did not end in 10 s");
      return false;
    }
    std::uint64_t got = 0;
    std::memcpy(&got, p, 8);
    if (got != v) {
      *why = "round " + std::to_string(r) + " read back other bytes";
      return false;
    }
  }
  return true;
}

}  // namespace

// Transfers one at a time to an idle engine: each starts on the submitting thread (no hand-off)
// and its wait sees it end while polling (no wake-up); with wait_spin 0 the waits sleep, and the
// worker's thread ends the same transfers.
TEST(EngineLatency, ASmallTransferStartsOnTheSubmittingThreadAndEndsInItsWait) {
  Target b("b", 1 << 16);
  // The longest spin: waits spin up to four times what they took of late, however loaded the
  // host (under a sanitizer a round trip over tcp may take longer than the default's 2 ms).
  for (const auto spin : {std::chrono::microseconds{1000000}, std::chrono::microseconds{0}}) {
    Engine a(spinning("a", spin));
    ASSERT_EQ(lab::link_to(a, "b", b.engine), "");
    std::string why;
    const auto seg = a.segment("b", "kv");
    const Buffer local = a.allocate_memory(4096);
    ASSERT_TRUE(ping(a, local, 0, seg, 64, 200, &why)) << why;
    const auto n = a.counters();
    const std::uint64_t ended_inside = metric(a, "rdmakit_submits_ended_total");
    std::printf("wait_spin %lld us: 400 transfers, %llu started on the submitting thread, %llu ended inside it, "
                "%llu waits ended polling\n",
                static_cast<long long>(spin.count()), static_cast<unsigned long long>(n.submits_inline),
                static_cast<unsigned long long>(ended_inside), static_cast<unsigned long long>(n.waits_spun));
    // Over tcp and shm a completion makes the worker's descriptor readable whatever is armed,
    // so its thread may be awake at every submit (and under a sanitizer often is).
    if (!lab::soft_transport() && spin.count() > 0) {
      EXPECT_GT(n.submits_inline, 0u) << "no batch started on the submitting thread";
    }
    // Ended without a sleep: in the submitter's look after its post (on rxe a small transfer
    // completes inside the post), or in a wait that polled.
    EXPECT_LE(ended_inside, n.submits_inline);
    if (spin.count() > 0) {
      EXPECT_GT(n.waits_spun + ended_inside, 0u) << "no batch ended without its waiter sleeping";
    } else {
      EXPECT_EQ(n.waits_spun, 0u) << "wait_spin 0 polled";
    }
    EXPECT_EQ(n.transfers_failed, 0u);
  }
}

// Threads that submit one transfer at a time to one peer at once (whoever finds the worker
// asleep posts; the rest hand theirs to it), waits that poll and waits that sleep (their spin,
// sized by the round trips of late, runs out while other threads hold the worker), and callbacks
// that submit from whichever thread ends their batch: every byte right, every batch ended once.
TEST(EngineLatency, ConcurrentSubmittersWaitersThatPollOrSleepAndCallbacksThatSubmit) {
  Target b("b", 1 << 16);
  Engine a(config("a"));
  ASSERT_EQ(lab::link_to(a, "b", b.engine), "");
  const auto seg = a.segment("b", "kv");
  constexpr unsigned kThreads = 6;
  const Buffer local = a.allocate_memory(4096 * (kThreads + 1));
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      if (!ping(a, local, 4096 * t, seg, 512 * t, 150, &errors[t])) return;
    });
  }
  // Callbacks that submit: each batch's callback submits the next (it runs on whichever thread
  // ends the batch: a worker's, or one polling it), until 100; the chain's batches are kept.
  std::mutex mu;
  std::vector<Batch> chain;
  std::atomic<int> ended{0};
  std::function<void(const Batch&)> next;
  const std::uint64_t coff = 4096 * kThreads;
  next = [&](const Batch& done) {
    if (done.failed() != 0) return;
    if (ended.fetch_add(1) + 1 >= 100) return;
    SubmitOptions o;
    o.on_done = next;
    Batch n = a.submit(std::vector<Transfer>{xfer(TransferOp::read, local, coff, 8, seg, 8192)}, std::move(o));
    std::lock_guard lock(mu);
    chain.push_back(std::move(n));
  };
  {
    SubmitOptions o;
    o.on_done = next;
    Batch first = a.submit(std::vector<Transfer>{xfer(TransferOp::read, local, coff, 8, seg, 8192)}, std::move(o));
    std::lock_guard lock(mu);
    chain.push_back(std::move(first));
  }
  for (auto& th : threads) th.join();
  for (unsigned t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (ended.load() < 100 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(ended.load(), 100) << "a chain of callbacks that submit stopped";
  // Waited on outside the lock the callbacks take (a wait may run one of them).
  std::vector<Batch> kept;
  {
    std::lock_guard lock(mu);
    kept.swap(chain);
  }
  for (const Batch& c : kept) EXPECT_TRUE(lab::waited(c, 10s));
  EXPECT_EQ(kept.size(), 100u);
  const auto n = a.counters();
  std::printf("%u threads x 300 transfers and a chain of 100: %llu started on the submitting thread, %llu waits "
              "ended polling\n",
              kThreads, static_cast<unsigned long long>(n.submits_inline), static_cast<unsigned long long>(n.waits_spun));
  EXPECT_EQ(n.transfers_failed, 0u);
  EXPECT_EQ(n.batches, std::uint64_t{kThreads} * 300 + 100);
}

// The peer goes (its engine destroyed) while threads poll for their transfers' ends: each
// thread's transfers end (ok before, failed after), none waits out its deadline.
TEST(EngineLatency, APeerLostWhileWaitersPollEndsTheirTransfers) {
  auto b = std::make_unique<Target>("b", 1 << 16);
  EngineConfig c = spinning("a", std::chrono::microseconds{1000000});
  c.link.retry_refused = false;  // reconnecting to the address nobody listens at any more fails at once
  Engine a(c);
  ASSERT_EQ(lab::link_to(a, "b", b->engine), "");
  const auto seg = a.segment("b", "kv");
  const Buffer local = a.allocate_memory(4096 * 4);
  std::atomic<int> ok{0}, failed{0}, hung{0};
  std::vector<std::thread> threads;
  for (std::uint64_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (;;) {
        Batch r = a.submit(std::vector<Transfer>{xfer(TransferOp::read, local, 4096 * t, 8, seg, 64 * t)});
        if (!r.wait(30s)) {
          ++hung;
          return;
        }
        if (r.failed() != 0) {
          ++failed;
          return;
        }
        ++ok;
      }
    });
  }
  std::this_thread::sleep_for(300ms);
  const int before = ok.load();
  b.reset();
  for (auto& th : threads) th.join();
  std::printf("peer lost after %d reads (%d more ended ok after): %d threads saw a failure\n", before,
              ok.load() - before, failed.load());
  EXPECT_GT(before, 0);
  EXPECT_EQ(hung.load(), 0);
  EXPECT_EQ(failed.load(), 4);
}

// The engine is destroyed while another thread polls for a batch that waits for a link (its
// peer's listener accepts and never answers): the wait ends with the batch (the engine closed),
// and the destructor does not wait out the spin.
TEST(EngineLatency, DestroyingTheEngineWhileAThreadPollsEndsTheWait) {
  std::uint16_t silent_port = 0;
  const int silent = lab::listen_tcp("127.0.0.1", &silent_port);
  ASSERT_GE(silent, 0);
  const std::string address = "127.0.0.1:" + std::to_string(silent_port);
  std::optional<Batch> batch;
  std::atomic<bool> returned{false}, ended{false};
  std::thread waiter;
  std::chrono::steady_clock::duration destroying{};
  {
    EngineConfig c = spinning("a", std::chrono::microseconds{1000000});
    c.link.handshake_timeout = 20s;
    c.link.method = rdmakit::ConnectMethod::tcp;  // the silent listener is a TCP one
    std::optional<Engine> a(std::in_place, c);
    a->add_peer("z", address);
    const Buffer local = a->allocate_memory(4096);
    const rdmakit::RemoteSegment seg = a->segment("z", "kv");
    batch = a->submit(std::vector<Transfer>{xfer(TransferOp::read, local, 0, 8, seg, 0)});
    waiter = std::thread([&] {
      ended = batch->wait(30s);
      returned = true;
    });
    std::this_thread::sleep_for(100ms);
    EXPECT_FALSE(returned.load()) << "the batch ended before the engine was destroyed";
    const auto start = std::chrono::steady_clock::now();
    a.reset();  // the waiter polling (a spin of up to 1 s)
    destroying = std::chrono::steady_clock::now() - start;
  }
  waiter.join();
  ::close(silent);
  EXPECT_TRUE(ended.load());
  // It never had a link: its connect ended with the engine.
  EXPECT_EQ(batch->result(0).status, TransferStatus::connect_failed) << batch->result(0).reason;
  std::printf("destroyed in %.1f ms while a thread polled\n", std::chrono::duration<double, std::milli>(destroying).count());
  EXPECT_LT(destroying, 900ms) << "the destructor waited out the waiter's spin";
}
