// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: the engine against rxe. Engines in one process talk over loopback (each
// has its own listener, PD and workers, as separate processes would); every byte is checked.
#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "connection/impl.hpp"
#include "engine/impl.hpp"
#include "engine/protocol.hpp"
#include "engine_helpers.hpp"
#include "lab_helpers.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Batch;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::EngineConfig;
using rdmakit::Transfer;
using rdmakit::TransferOp;
using rdmakit::TransferStatus;

using lab::at;
using lab::config;
using lab::fill;
using lab::same;
using lab::Target;
using lab::TwoNics;
using lab::xfer;

}  // namespace

TEST(Engine, WritesAndReadsEveryByte) {
  Target b("b");
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(1 << 20);
  const Buffer dst = a.allocate_memory(1 << 20);
  fill(src.addr, src.length, 3);
  std::vector<Transfer> writes;
  for (std::uint64_t k = 0; k < 16; ++k) writes.push_back(xfer(TransferOp::write, src, k * 65536, 65536, seg, k * 65536));
  Batch w = a.submit(writes);
  ASSERT_TRUE(lab::waited(w, 10s));
  EXPECT_EQ(w.failed(), 0u) << w.describe_failures();
  EXPECT_TRUE(same(b.buf.addr, src.addr, src.length));
  std::vector<Transfer> reads;
  for (std::uint64_t k = 0; k < 64; ++k) reads.push_back(xfer(TransferOp::read, dst, k * 16384, 16384, seg, k * 16384));
  Batch r = a.submit(reads);
  ASSERT_TRUE(lab::waited(r, 10s));
  EXPECT_EQ(r.failed(), 0u) << r.describe_failures();
  EXPECT_TRUE(same(dst.addr, src.addr, src.length));
  // A worker never sleeps with work queued: 20 small batches one after another take far less
  // than the second each would if it did (the worker's longest sleep).
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) {
    const Transfer one = xfer(TransferOp::write, src, 0, 64, seg, 0);
    Batch x = a.submit({&one, 1});
    ASSERT_TRUE(lab::waited(x, 5s));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  const auto c = a.counters();
  EXPECT_EQ(c.connects, 1u);
  EXPECT_EQ(c.transfers, 100u);
  EXPECT_EQ(c.bytes, (2u << 20) + 20 * 64);
  EXPECT_EQ(b.engine.counters().accepts, 1u);
  EXPECT_EQ(b.engine.counters().windows_bound, 1u);
  EXPECT_TRUE(a.info().memory_windows) << a.info().access_model;
}

// Memory is registered once per device whatever the number of peers: MRs = buffers x devices.
TEST(Engine, MemoryIsRegisteredOncePerDeviceWhateverThePeers) {
  RDMAKIT_RDMA_ONLY("it counts the device's memory regions");
  std::vector<std::unique_ptr<Target>> targets;
  for (int i = 0; i < 3; ++i) targets.push_back(std::make_unique<Target>("t" + std::to_string(i), 4096));
  const auto before = lab::rdma_resources();
  Engine a(config("a"));
  const Buffer x = a.allocate_memory(8192);
  const Buffer y = a.allocate_memory(8192);
  const auto devices = static_cast<int>(a.info().devices.size());  // one, or two with lab --nics 2
  EXPECT_EQ(lab::rdma_resources().at("mr"), before.at("mr") + 2 * devices);
  std::vector<Transfer> t;
  for (int i = 0; i < 3; ++i) {
    const std::string name = "t" + std::to_string(i);
    a.add_peer(name, at(targets[static_cast<std::size_t>(i)]->engine));
    t.push_back(xfer(TransferOp::write, x, 0, 4096, a.segment(name, "kv"), 0));
    t.push_back(xfer(TransferOp::read, y, 0, 4096, a.segment(name, "kv"), 0));
  }
  Batch b = a.submit(t);
  ASSERT_TRUE(lab::waited(b, 10s));
  EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
  const auto during = lab::rdma_resources();
  EXPECT_EQ(during.at("mr"), before.at("mr") + 2 * devices) << "three peers, two buffers, " << devices << " device(s)";
  EXPECT_EQ(during.at("qp"), before.at("qp") + 6) << "a QP at each end of three links";
  EXPECT_EQ(a.counters().qps, 3u);
}

namespace {

// A raw connection playing an engine `name` linked to `target`: it says IDENT and reads the
// target's messages up to SYNCED; the segment "kv" as the target announced it to this link.
std::pair<std::unique_ptr<rdmakit::Connection>, rdmakit::RemoteRegion> raw_peer(const Engine& target, const std::string& name) {
  namespace ew = rdmakit::detail::engine_wire;
  auto c = std::make_unique<rdmakit::Connection>(rdmakit::Connection::connect(at(target), lab::quiet(), [](rdmakit::Connection& conn) {
    (void)conn.allocate_memory(4096, Access::local_write);
  }));
  c->send_message(ew::encode(ew::ident(name, 7)), 1s);
  rdmakit::RemoteRegion kv;
  for (int i = 0; i < 10; ++i) {
    auto m = c->receive_message(2s);
    if (!m) break;
    const auto msg = ew::decode(*m);
    if (msg.kind == ew::Kind::segment) kv = msg.region;
    if (msg.kind == ew::Kind::synced) break;
  }
  return {std::move(c), kv};
}

}  // namespace

// Each peer gets its own window per segment, bound on its own link's QP: its key is useless on
// another peer's QP, and withdrawing the segment revokes every peer's key. Two raw connections
// play the peers, so the test can aim one's key through the other.
TEST(Engine, APeersWindowKeyIsUselessOnAnotherPeersQp) {
  RDMAKIT_RDMA_ONLY("a plain Connection plays the other peer (tcp and shm: tests/unit/soft_transport_test.cpp)");
  Target b("b", 4096);
  fill(b.buf.addr, 4096, 9);
  auto peer = [&](const std::string& name) { return raw_peer(b.engine, name); };
  auto [c1, k1] = peer("p1");
  auto [c2, k2] = peer("p2");
  ASSERT_NE(k1.rkey, 0u);
  ASSERT_NE(k2.rkey, 0u);
  EXPECT_NE(k1.rkey, k2.rkey);
  EXPECT_EQ(k1.addr, k2.addr);
  // Its own key works for each.
  for (auto* c : {c1.get(), c2.get()}) {
    const rdmakit::RemoteRegion k = c == c1.get() ? k1 : k2;
    rdmakit::Connection::Impl::of(*c).dp.set_remote({k}, false);
    ASSERT_TRUE(c->post_read(c->memory(0).local().subslice(0, 64), k, 0, 1).ok());
    const auto w = c->wait(5s);
    ASSERT_EQ(w.status, rdmakit::WaitStatus::completed);
    EXPECT_TRUE(w.completion.ok()) << w.completion.describe();
    EXPECT_TRUE(same(c->memory(0).data(), b.buf.addr, 64));
  }
  // p1's key through p2's QP: a remote access error, and the target is unchanged.
  std::memset(c2->memory(0).data(), 0xab, 64);
  rdmakit::Connection::Impl::of(*c2).dp.set_remote({k1}, false);
  ASSERT_TRUE(c2->post_write(c2->memory(0).local().subslice(0, 64), k1, 0, 2).ok());
  const auto w = c2->wait(5s);
  ASSERT_EQ(w.status, rdmakit::WaitStatus::completed);
  EXPECT_EQ(w.completion.status, IBV_WC_REM_ACCESS_ERR) << w.completion.describe();
  std::vector<std::uint8_t> expect(64);
  fill(expect.data(), 64, 9);
  EXPECT_TRUE(same(b.buf.addr, expect.data(), 64)) << "the write through another peer's QP landed";
  // Withdrawn: p1 is told, and its key stops working.
  b.engine.withdraw("kv");
  bool told = false;
  for (int i = 0; i < 5 && !told; ++i) {
    auto m = c1->receive_message(2s);
    told = m && rdmakit::detail::engine_wire::decode(*m).kind == rdmakit::detail::engine_wire::Kind::withdraw;
  }
  EXPECT_TRUE(told);
  ASSERT_TRUE(c1->post_write(c1->memory(0).local().subslice(0, 64), k1, 0, 3).ok());
  const auto w1 = c1->wait(5s);
  ASSERT_EQ(w1.status, rdmakit::WaitStatus::completed);
  EXPECT_EQ(w1.completion.status, IBV_WC_REM_ACCESS_ERR) << w1.completion.describe();
  EXPECT_TRUE(same(b.buf.addr, expect.data(), 64));
}

TEST(Engine, EightThreadsSubmitAtOnce) {
  Target b("b", 8 << 20);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(8 << 20);
  fill(src.addr, src.length, 5);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const std::uint64_t base = static_cast<std::uint64_t>(t) << 20;  // 1 MiB each
      for (int round = 0; round < 4; ++round) {
        std::vector<Transfer> batch;
        for (std::uint64_t k = 0; k < 64; ++k) {
          const std::uint64_t off = base + static_cast<std::uint64_t>(round) * 262144 + k * 4096;
          batch.push_back(xfer(TransferOp::write, src, off, 4096, seg, off));
        }
        Batch bt = a.submit(batch);
        if (!bt.wait(20s) || bt.failed() != 0) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(same(b.buf.addr, src.addr, src.length));
  EXPECT_EQ(a.counters().batches, 32u);
}

// Its threads carry names (top -H, gdb, /proc): each worker its index, the connectors and the
// listener's acceptor theirs; a handshake thread is named while it runs.
TEST(Engine, ItsThreadsAreNamed) {
  EngineConfig c = config("a");
  c.workers = 2;
  Engine a(c);
  // A thread names itself as it starts: looked at until each has (or 5 s).
  const auto named = [] {
    std::map<std::string, int> names;
    for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
      std::ifstream comm(task.path() / "comm");
      std::string name;
      std::getline(comm, name);
      ++names[name];
    }
    return names;
  };
  std::map<std::string, int> names = named();
  for (int i = 0; i < 250 && (names["rdmakit-w0"] == 0 || names["rdmakit-w1"] == 0 || names["rdmakit-connect"] < 2 ||
                              names["rdmakit-accept"] == 0);
       ++i) {
    std::this_thread::sleep_for(20ms);
    names = named();
  }
  EXPECT_GE(names["rdmakit-w0"], 1);
  EXPECT_GE(names["rdmakit-w1"], 1);
  EXPECT_GE(names["rdmakit-connect"], 2);
  EXPECT_GE(names["rdmakit-accept"], 1);
}

// Workers run on the CPUs they are given (worker i on worker_cpus[i % n]), each pinned to one;
// a CPU the process may not use is refused at construction, naming it.
TEST(Engine, WorkersRunOnTheCpusTheyAreGiven) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(::sched_getaffinity(0, sizeof allowed, &allowed), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c) {
    if (CPU_ISSET(static_cast<std::size_t>(c), &allowed)) cpus.push_back(c);
  }
  if (cpus.size() < 2) GTEST_SKIP() << "needs two CPUs this process may run on";
  EngineConfig c = config("a");
  c.workers = 3;
  c.worker_cpus = {cpus[1], cpus[0]};
  Engine a(c);
  const std::map<std::string, int> want = {{"rdmakit-w0", cpus[1]}, {"rdmakit-w1", cpus[0]}, {"rdmakit-w2", cpus[1]}};
  std::map<std::string, std::vector<int>> got;
  for (int i = 0; i < 250 && got.size() < want.size(); ++i) {
    got.clear();
    for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
      std::ifstream comm(task.path() / "comm");
      std::string name;
      std::getline(comm, name);
      if (!want.contains(name)) continue;
      cpu_set_t set;
      CPU_ZERO(&set);
      if (::sched_getaffinity(std::stoi(task.path().filename().string()), sizeof set, &set) != 0) continue;
      std::vector<int> on;
      for (int k = 0; k < CPU_SETSIZE; ++k) {
        if (CPU_ISSET(static_cast<std::size_t>(k), &set)) on.push_back(k);
      }
      if (on.size() == 1) got[name] = on;  // pinned (a thread that just started may not be yet)
    }
    if (got.size() < want.size()) std::this_thread::sleep_for(20ms);
  }
  for (const auto& [name, cpu] : want) EXPECT_EQ(got[name], std::vector<int>{cpu}) << name;
  EngineConfig bad = config("bad");
  bad.worker_cpus = {CPU_SETSIZE + 5};
  try {
    Engine x(bad);
    ADD_FAILURE() << "a CPU past the set was taken";
  } catch (const rdmakit::Error& e) {
    EXPECT_EQ(e.sys_errno(), EINVAL);
    EXPECT_NE(std::string(e.what()).find("CPU 1029 is not one this process may run on"), std::string::npos) << e.what();
  }
}

// The notification arrives after the data it announces: the target checks the bytes on receipt,
// woken by the engine's descriptor.
TEST(Engine, ANotificationArrivesAfterItsWrites) {
  Target b("b", 4 << 20);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(4 << 20);
  for (int round = 0; round < 5; ++round) {
    fill(src.addr, src.length, static_cast<std::uint8_t>(round * 31));
    std::vector<Transfer> t;
    for (std::uint64_t k = 0; k < 64; ++k) t.push_back(xfer(TransferOp::write, src, k * 65536, 65536, seg, k * 65536));
    rdmakit::SubmitOptions o;
    o.notify = {'r', static_cast<std::uint8_t>('0' + round)};
    Batch bt = a.submit(t, o);
    pollfd pfd{b.engine.fd(), POLLIN, 0};
    std::optional<rdmakit::Notification> n;
    for (int i = 0; i < 100 && !n; ++i) {
      if (::poll(&pfd, 1, 100) > 0) {
        std::uint64_t v = 0;
        (void)!::read(b.engine.fd(), &v, sizeof v);
      }
      n = b.engine.next_notification();
    }
    ASSERT_TRUE(n.has_value());
    EXPECT_EQ(n->peer, "a");
    EXPECT_EQ(n->message, o.notify);
    EXPECT_TRUE(same(b.buf.addr, src.addr, src.length)) << "round " << round << ": notified before the data was there";
    ASSERT_TRUE(lab::waited(bt, 5s));
    EXPECT_EQ(bt.failed(), 0u);
  }
  EXPECT_EQ(a.counters().notifications_sent, 5u);
  EXPECT_EQ(b.engine.counters().notifications_received, 5u);
}

TEST(Engine, AtomicsFromManyThreadsEndExact) {
  Target b("b", 4096);
  std::memset(b.buf.addr, 0, 8);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer olds = a.allocate_memory(4 * 64 * 8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Batch bt = a.submit(lab::fetch_adds(olds, static_cast<std::uint64_t>(t) * 64, 64, seg));
      EXPECT_TRUE(lab::waited(bt, 10s));
      EXPECT_EQ(bt.failed(), 0u) << bt.describe_failures();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_TRUE(lab::fetch_adds_exact(b.buf.addr, olds, 256));
}

TEST(Engine, FailuresSayWhy) {
  Target b("b", 4096);
  EngineConfig c = config("a");
  c.link.retry_refused = false;  // "nobody" refuses at once
  Engine a(c);
  a.add_peer("b", at(b.engine));
  a.add_peer("nobody", "127.0.0.1:1");
  const Buffer src = a.allocate_memory(8192);
  const std::vector<Transfer> t = {
      xfer(TransferOp::write, src, 0, 64, a.segment("b", "nope"), 0),
      xfer(TransferOp::write, src, 0, 64, a.segment("b", "kv"), 4090),     // past the segment
      xfer(TransferOp::write, src, 8190, 64, a.segment("b", "kv"), 0),     // past the local buffer
      xfer(TransferOp::write, src, 0, 64, a.segment("nobody", "kv"), 0),
      xfer(TransferOp::fetch_add, src, 0, 8, a.segment("b", "kv"), 3),     // misaligned
      xfer(TransferOp::write, src, 0, 64, a.segment("b", "kv"), 0),        // fine
  };
  Batch bt = a.submit(t);
  ASSERT_TRUE(lab::waited(bt, 15s));
  EXPECT_EQ(bt.result(0).status, TransferStatus::no_segment);
  EXPECT_NE(bt.result(0).reason.find("no segment 'nope'"), std::string::npos) << bt.result(0).reason;
  EXPECT_NE(bt.result(0).reason.find("it has: kv"), std::string::npos) << bt.result(0).reason;
  EXPECT_EQ(bt.result(1).status, TransferStatus::no_segment) << bt.result(1).reason;
  EXPECT_EQ(bt.result(2).status, TransferStatus::invalid);
  EXPECT_NE(bt.result(2).reason.find("outside the local buffer"), std::string::npos) << bt.result(2).reason;
  EXPECT_EQ(bt.result(3).status, TransferStatus::connect_failed);
  EXPECT_NE(bt.result(3).reason.find("127.0.0.1:1"), std::string::npos) << bt.result(3).reason;
  EXPECT_EQ(bt.result(4).status, TransferStatus::invalid) << bt.result(4).reason;
  EXPECT_EQ(bt.result(5).status, TransferStatus::ok) << bt.result(5).reason;
  EXPECT_EQ(bt.failed(), 5u);
  // The link survived the refusals: the next batch goes through.
  const Transfer ok = xfer(TransferOp::write, src, 0, 64, a.segment("b", "kv"), 0);
  Batch again = a.submit({&ok, 1});
  ASSERT_TRUE(lab::waited(again, 5s));
  EXPECT_EQ(again.failed(), 0u) << again.describe_failures();
}

// A batch of one transfer without options reuses the engine's last such batch once nobody holds
// it (Engine::Impl::batch_of_one): each comes out as new, whatever ended in the one before, a
// batch still held is never the one reused, and a callback's captures (a batch with options is
// never reused) go with the batch's last handle.
TEST(Engine, ABatchOfOneIsNewWhateverEndedBeforeIt) {
  Target b("b", 4096);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(4096);
  const Buffer dst = a.allocate_memory(4096);
  const Transfer bad = xfer(TransferOp::write, src, 0, 64, seg, 4090);  // past the segment
  const Transfer good = xfer(TransferOp::write, src, 0, 64, seg, 0);
  for (int round = 0; round < 3; ++round) {
    {
      Batch f = a.submit({&bad, 1});
      ASSERT_TRUE(lab::waited(f, 5s));
      ASSERT_EQ(f.failed(), 1u);
      EXPECT_EQ(f.result(0).status, TransferStatus::no_segment);
    }
    Batch ok = a.submit({&good, 1});
    ASSERT_TRUE(lab::waited(ok, 5s));
    EXPECT_EQ(ok.failed(), 0u) << ok.describe_failures();
    EXPECT_EQ(ok.result(0).status, TransferStatus::ok);
    EXPECT_EQ(ok.result(0).reason, "");
    EXPECT_EQ(ok.describe_failures(), "");
  }
  // Held handles keep their own batches: a failed one still says why after others ran.
  Batch held_bad = a.submit({&bad, 1});
  ASSERT_TRUE(lab::waited(held_bad, 5s));
  Batch held_ok = a.submit({&good, 1});
  ASSERT_TRUE(lab::waited(held_ok, 5s));
  for (std::uint8_t i = 1; i <= 50; ++i) {
    // Write a byte, read it back elsewhere: fresh batches each time, both ways.
    static_cast<std::uint8_t*>(src.addr)[100] = i;
    const Transfer w = xfer(TransferOp::write, src, 100, 1, seg, 100);
    Batch bw = a.submit({&w, 1});
    ASSERT_TRUE(lab::waited(bw, 5s));
    ASSERT_EQ(bw.failed(), 0u) << bw.describe_failures();
    const Transfer r = xfer(TransferOp::read, dst, 200, 1, seg, 100);
    Batch br = a.submit({&r, 1});
    ASSERT_TRUE(lab::waited(br, 5s));
    ASSERT_EQ(br.failed(), 0u) << br.describe_failures();
    ASSERT_EQ(static_cast<const std::uint8_t*>(dst.addr)[200], i);
  }
  EXPECT_EQ(held_bad.failed(), 1u);
  EXPECT_EQ(held_bad.result(0).status, TransferStatus::no_segment);
  EXPECT_NE(held_bad.result(0).reason, "");
  EXPECT_EQ(held_ok.failed(), 0u);
  EXPECT_EQ(held_ok.result(0).status, TransferStatus::ok);
  // A callback's captures live no longer than the batch.
  auto token = std::make_shared<int>(7);
  const std::weak_ptr<int> watch = token;
  {
    rdmakit::SubmitOptions o;
    o.on_done = [token](const Batch&) {};
    token.reset();
    Batch cb = a.submit({&good, 1}, std::move(o));
    ASSERT_TRUE(lab::waited(cb, 5s));
  }
  Batch after = a.submit({&good, 1});
  ASSERT_TRUE(lab::waited(after, 5s));
  // The worker lets go of its reference as the batch ends, maybe just after the waiter returned.
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (!watch.expired() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(watch.expired()) << "a batch with a callback was kept after its last handle went";
}

// A budget of 4 QPs and 8 peers: idle links are evicted to make room, counted, and every
// transfer still succeeds (evicted peers reconnect when used again).
TEST(Engine, TheQpBudgetHoldsWithMorePeersThanQps) {
  std::vector<std::unique_ptr<Target>> targets;
  for (int i = 0; i < 8; ++i) targets.push_back(std::make_unique<Target>("t" + std::to_string(i), 4096));
  EngineConfig c = config("a");
  c.max_qps = 4;
  Engine a(c);
  const Buffer src = a.allocate_memory(4096);
  fill(src.addr, 4096, 1);
  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> most{0};
  std::thread sampler([&] {
    while (!done.load()) {
      most.store(std::max(most.load(), a.counters().qps));
      std::this_thread::sleep_for(1ms);
    }
  });
  for (int i = 0; i < 8; ++i) a.add_peer("t" + std::to_string(i), at(targets[static_cast<std::size_t>(i)]->engine));
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 8; ++i) {
      const Transfer t = xfer(TransferOp::write, src, 0, 4096, a.segment("t" + std::to_string(i), "kv"), 0);
      Batch bt = a.submit({&t, 1});
      ASSERT_TRUE(lab::waited(bt, 20s));
      EXPECT_EQ(bt.failed(), 0u) << bt.describe_failures();
    }
  }
  done.store(true);
  sampler.join();
  for (auto& t : targets) EXPECT_TRUE(same(t->buf.addr, src.addr, 4096));
  EXPECT_LE(most.load(), 4u);
  EXPECT_GE(a.counters().evictions, 4u);
  EXPECT_GE(a.counters().reconnects, 1u);
}

// A buffer unregistered while a batch of writes from it is in flight: the call returns once they
// have ended (all of them ok, every byte there), its regions are gone (the device holds fewer
// MRs), a later transfer with it is refused with the reason, and a buffer that backs a segment is
// refused until the segment is withdrawn.
TEST(Engine, UnregisterWaitsForTransfersInFlightThenReleasesTheRegions) {
  Target b("b", 8 << 20);
  Engine a(config("a"));
  ASSERT_EQ(lab::link_to(a, "b", b.engine), "");
  std::string why;
  std::vector<std::uint8_t> mem(8 << 20);
  fill(mem.data(), mem.size(), 9);
  const Buffer src = a.register_memory(mem.data(), mem.size());
  const long mrs = lab::soft_transport() ? 0 : lab::rdma_resources()["mr"];
  std::vector<Transfer> t;
  for (std::uint64_t k = 0; k < 128; ++k) t.push_back(xfer(TransferOp::write, src, k * 65536, 65536, a.segment("b", "kv"), k * 65536));
  Batch bt = a.submit(t);
  a.unregister_memory(src);
  EXPECT_TRUE(bt.done()) << "unregister_memory returned with transfers of the buffer in flight";
  EXPECT_EQ(bt.failed(), 0u) << bt.describe_failures();
  EXPECT_TRUE(same(b.buf.addr, mem.data(), mem.size()));
  if (!lab::soft_transport()) {
    EXPECT_LT(lab::rdma_resources()["mr"], mrs) << "its regions are still registered";
  }
  const Transfer late = xfer(TransferOp::write, src, 0, 64, a.segment("b", "kv"), 0);
  Batch lb = a.submit({&late, 1});
  ASSERT_TRUE(lab::waited(lb, 5s));
  EXPECT_EQ(lb.result(0).status, TransferStatus::invalid);
  EXPECT_NE(lb.result(0).reason.find("unregistered"), std::string::npos) << lb.result(0).reason;
  EXPECT_THROW(a.unregister_memory(src), rdmakit::Error);
  const Buffer seg = a.allocate_memory(4096);
  a.expose("mine", seg, Access::remote_read);
  try {
    a.unregister_memory(seg);
    ADD_FAILURE() << "a buffer that backs a segment was unregistered";
  } catch (const rdmakit::Error& e) {
    EXPECT_EQ(e.sys_errno(), EBUSY);
    EXPECT_NE(std::string(e.what()).find("'mine'"), std::string::npos) << e.what();
  }
  a.withdraw("mine");
  a.unregister_memory(seg);
  EXPECT_THROW(a.expose("again", seg, Access::remote_read), rdmakit::Error);
}

// The end of a batch is observable without polling: the callback runs once, on a worker, with
// the batch done, and the engine's descriptor becomes readable.
TEST(Engine, ABatchEndsWithItsCallbackAndTheDescriptor) {
  Target b("b", 1 << 20);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const Buffer src = a.allocate_memory(1 << 20);
  std::vector<Transfer> t;
  for (std::uint64_t k = 0; k < 8; ++k) t.push_back(xfer(TransferOp::write, src, k * 65536, 65536, a.segment("b", "kv"), k * 65536));
  std::atomic<int> calls{0};
  std::atomic<bool> done_inside{false};
  std::atomic<bool> other_thread{false};
  const auto me = std::this_thread::get_id();
  rdmakit::SubmitOptions o;
  o.on_done = [&](const Batch& bt) {
    done_inside = bt.done() && bt.failed() == 0;
    other_thread = std::this_thread::get_id() != me;
    ++calls;
  };
  std::uint64_t drained = 0;
  (void)!::read(a.fd(), &drained, sizeof drained);  // whatever came before
  Batch bt = a.submit(t, std::move(o));
  pollfd pfd{a.fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&pfd, 1, 10000), 1) << "the descriptor never became readable";
  ASSERT_TRUE(lab::waited(bt, 5s));
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(done_inside.load());
  EXPECT_TRUE(other_thread.load());
}

// workers = 0: nothing moves unless the caller drives progress(), which is all it takes.
TEST(Engine, WithoutWorkersTheCallerDrivesProgress) {
  Target b("b", 1 << 20);
  EngineConfig c = config("a");
  c.workers = 0;
  c.listen = "";
  Engine a(c);
  a.add_peer("b", at(b.engine));
  std::string why;
  ASSERT_TRUE(a.connect("b", 10s, &why)) << why;
  const Buffer src = a.allocate_memory(1 << 20);
  fill(src.addr, src.length, 77);
  std::vector<Transfer> t;
  for (std::uint64_t k = 0; k < 16; ++k) t.push_back(xfer(TransferOp::write, src, k * 65536, 65536, a.segment("b", "kv"), k * 65536));
  Batch bt = a.submit(t);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(bt.done()) << "something progressed without the caller";
  // How far it got, as a wait() that timed out would want it said: nowhere yet, then all of it.
  EXPECT_EQ(bt.describe_progress(), "0 of 16 ended (0 failed), 16 had not: transfers 0-15");
  std::size_t ended = 0;
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!bt.done() && std::chrono::steady_clock::now() < until) ended += a.progress(1ms);
  ASSERT_TRUE(bt.done());
  EXPECT_EQ(ended, 16u);
  EXPECT_EQ(bt.failed(), 0u) << bt.describe_failures();
  const std::string path = bt.telemetry().paths.empty() ? "?" : bt.telemetry().paths[0].device;
  EXPECT_EQ(bt.describe_progress(), "16 of 16 ended (0 failed; ended ok on path: " + path + " 16), 0 had not");
  // A notification on its own says whether it went.
  const std::uint8_t hello[] = {'h', 'i'};
  Batch note = a.notify("b", hello);
  EXPECT_EQ(note.describe_progress(), "its notification had not been sent");
  for (const auto by = std::chrono::steady_clock::now() + 10s; !note.done() && std::chrono::steady_clock::now() < by;) {
    (void)a.progress(1ms);
  }
  EXPECT_EQ(note.describe_progress(), "its notification ended: ok");
  EXPECT_TRUE(same(b.buf.addr, src.addr, src.length));
  EXPECT_THROW((void)b.engine.progress(), rdmakit::Error);  // it has workers
}

namespace {

long rss_kib() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  long pages = 0, resident = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

}  // namespace

// 200 peers (target engines, 50 per process in four processes): every one used by one engine,
// first with room for all of them (what a link costs: connect time, memory, descriptors), then
// under a budget of 32 QPs (never exceeded, every transfer still right).
TEST(Engine, TwoHundredPeers) {
  constexpr int kPerProcess = 50, kProcesses = 4, kPeers = kPerProcess * kProcesses;
  std::vector<std::unique_ptr<lab::Child>> hosts;
  for (int p = 0; p < kProcesses; ++p) {
    hosts.push_back(std::make_unique<lab::Child>("engines", std::to_string(7700 + p * kPerProcess), std::to_string(kPerProcess)));
    ASSERT_TRUE(hosts.back()->ok()) << "FAULT_PEER is the peer program";
  }
  for (auto& h : hosts) ASSERT_TRUE(h->await("ready"));
  auto run = [&](std::uint32_t budget, bool measure) {
    EngineConfig c = config("a");
    c.listen = "";
    c.max_qps = budget;
    Engine a(c);
    const Buffer src = a.allocate_memory(kPeers * 64);
    fill(src.addr, src.length, 11);
    for (int i = 0; i < kPeers; ++i) a.add_peer("s" + std::to_string(7700 + i), "127.0.0.1:" + std::to_string(7700 + i));
    const long rss0 = rss_kib();
    const int fds0 = lab::open_fds();
    const auto t0 = std::chrono::steady_clock::now();
    std::uint64_t most = 0;
    for (int i = 0; i < kPeers; ++i) {
      std::string why;
      const std::string name = "s" + std::to_string(7700 + i);
      if (measure) {
        ASSERT_TRUE(a.connect(name, 20s, &why)) << why;
      }
      const Transfer t = xfer(TransferOp::write, src, static_cast<std::uint64_t>(i) * 64, 64, a.segment(name, "kv"), 0);
      Batch b = a.submit({&t, 1});
      ASSERT_TRUE(lab::waited(b, 20s));
      ASSERT_EQ(b.failed(), 0u) << b.describe_failures();
      most = std::max(most, a.counters().qps);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto cnt = a.counters();
    EXPECT_LE(most, budget);
    EXPECT_EQ(cnt.transfers_failed, 0u);
    if (measure) {
      EXPECT_EQ(cnt.links, static_cast<std::uint64_t>(kPeers));
      std::printf("%d peers linked: %.1f ms per peer (connect, then the first write), %.1f KiB of memory and %.2f "
                  "descriptors per link in this process\n",
                  kPeers, secs * 1000 / kPeers, static_cast<double>(rss_kib() - rss0) / kPeers,
                  static_cast<double>(lab::open_fds() - fds0) / kPeers);
    } else {
      EXPECT_GE(cnt.evictions, static_cast<std::uint64_t>(kPeers - budget));
      std::printf("%d peers under a budget of %u QPs: at most %llu QPs, %llu evictions, %.1f ms per peer\n", kPeers,
                  budget, static_cast<unsigned long long>(most), static_cast<unsigned long long>(cnt.evictions),
                  secs * 1000 / kPeers);
    }
  };
  run(256, true);
  run(32, false);
}

namespace {

// A write of 4 KiB (a pattern of `seed`, in a buffer of its own) into `peer`'s "kv" at 0.
Transfer write_to(Engine& a, const std::string& peer, std::uint8_t seed) {
  const Buffer src = a.allocate_memory(4096);
  fill(src.addr, 4096, seed);
  return xfer(TransferOp::write, src, 0, 4096, a.segment(peer, "kv"), 0);
}

void write_ok(Engine& a, const Transfer& w) {
  Batch b = a.submit({&w, 1});
  ASSERT_TRUE(lab::waited(b, 10s));
  EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
}

}  // namespace

// No silent region-key fallback (issue 31): on a device without type-2 windows (played here:
// rxe has them) expose() refuses, naming the device; with region keys allowed it serves the
// buffer's own key to a peer holding the link key, and says access is per buffer.
TEST(Engine, WithoutWindowsExposeRefusesUnlessRegionKeysAreAllowed) {
  RDMAKIT_RDMA_ONLY("a device without memory windows");
  const std::vector<std::uint8_t> key(32, 0x42);
  {
    EngineConfig c = config("nw");
    c.link.psk = key;
    Engine e(c);
    Engine::Impl::of(e).choose_access(false, "rxe-without-windows");  // before any buffer
    const Buffer b = e.allocate_memory(4096);
    try {
      e.expose("kv", b, Access::remote_read | Access::remote_write);
      ADD_FAILURE() << "exposed without windows and without allow_region_keys";
    } catch (const rdmakit::Error& err) {
      EXPECT_EQ(err.sys_errno(), EOPNOTSUPP);
      EXPECT_NE(std::string(err.what()).find("rxe-without-windows"), std::string::npos) << err.what();
      EXPECT_NE(err.hint().find("allow_region_keys"), std::string::npos) << err.hint();
    }
    EXPECT_NE(e.info().access_model.find("expose() refuses"), std::string::npos) << e.info().access_model;
  }
  {
    EngineConfig c = config("nokey");
    c.allow_region_keys = true;  // but no key: nobody could be given one
    Engine e(c);
    Engine::Impl::of(e).choose_access(false, "rxe-without-windows");
    EXPECT_THROW(e.expose("kv", e.allocate_memory(4096), Access::remote_read), rdmakit::Error);
  }
  EngineConfig c = config("rk");
  c.link.psk = key;
  c.allow_region_keys = true;
  Engine t(c);
  Engine::Impl::of(t).choose_access(false, "rxe-without-windows");
  EXPECT_NE(t.info().access_model.find("per buffer"), std::string::npos) << t.info().access_model;
  const Buffer tb = t.allocate_memory(4096);
  t.expose("kv", tb, Access::remote_read | Access::remote_write);
  EngineConfig ac = config("a");
  ac.link.psk = key;
  Engine a(ac);
  a.add_peer("rk", at(t));
  const Transfer w = write_to(a, "rk", 5);
  write_ok(a, w);
  EXPECT_TRUE(same(w.local.addr, tb.addr, 4096));
  EXPECT_EQ(t.counters().windows_bound, 0u) << "region keys, not windows";
}

// The engine reaches only the peer it meant (issue 31): kv-0 goes and another engine, kv-3,
// comes up on its address and port exposing "kv" too. Every transfer to kv-0 ends connect_failed
// naming both, every try (five here), and not a byte lands in kv-3's segment. (It reconnected and
// wrote into kv-3, status ok.)
TEST(Engine, AnotherEngineAtThePeersAddressIsRefused) {
  auto kv0 = std::make_unique<Target>("kv-0", 4096);
  const std::uint16_t port = kv0->engine.port();
  Engine a(config("a"));
  a.add_peer("kv-0", at(kv0->engine));
  const Transfer w = write_to(a, "kv-0", 3);
  write_ok(a, w);
  kv0.reset();
  EngineConfig ic = config("kv-3");
  ic.listen = "127.0.0.1:" + std::to_string(port);
  Target kv3("kv-3", 4096, ic);
  std::memset(kv3.buf.addr, 0, 4096);
  const auto linked = [&a] {
    const auto ps = a.peers();
    return !ps.empty() && ps[0].linked;
  };
  for (const auto until = std::chrono::steady_clock::now() + 5s; linked() && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(10ms);
  }
  for (int i = 0; i < 5; ++i) {
    Batch b = a.submit({&w, 1});
    ASSERT_TRUE(lab::waited(b, 15s));
    const auto r = b.result(0);
    ASSERT_EQ(r.status, TransferStatus::connect_failed) << "try " << i << ": " << r.reason;
    EXPECT_NE(r.reason.find("engine 'kv-3' answered"), std::string::npos) << r.reason;
    EXPECT_NE(r.reason.find("peer 'kv-0' was expected"), std::string::npos) << r.reason;
  }
  std::string why;
  EXPECT_FALSE(a.connect("kv-0", 5s, &why));
  EXPECT_NE(why.find("kv-3"), std::string::npos) << why;
  const auto* bytes = static_cast<const std::uint8_t*>(kv3.buf.addr);
  EXPECT_TRUE(std::all_of(bytes, bytes + 4096, [](std::uint8_t v) { return v == 0; })) << "a write reached kv-3";
}

// IDENT comes once per link (issue 31): a peer that says it again, under another engine's name
// and epoch, loses its own link, and the engine it named keeps its links. (The second IDENT
// was taken as that engine's restart: its links were closed as stale, on every worker.)
TEST(Engine, ASecondIdentIsRefusedAndTheNamedEnginesLinksStay) {
  RDMAKIT_RDMA_ONLY("a plain Connection plays the lying peer");
  Target t("t", 4096);
  Engine victim(config("victim"));
  victim.add_peer("t", at(t.engine));
  const Buffer src = victim.allocate_memory(4096);
  const Transfer w = xfer(TransferOp::write, src, 0, 64, victim.segment("t", "kv"), 0);
  const auto write = [&] {
    Batch b = victim.submit({&w, 1});
    ASSERT_TRUE(lab::waited(b, 10s));
    EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
  };
  write();
  auto [c, kv] = raw_peer(t.engine, "x");
  ASSERT_NE(kv.rkey, 0u);
  namespace ew = rdmakit::detail::engine_wire;
  c->send_message(ew::encode(ew::ident("victim", 9)), 1s);
  EXPECT_TRUE(c->wait_peer_close(5s)) << "the link that said IDENT twice stayed up";
  write();
  EXPECT_EQ(victim.counters().reconnects, 0u) << "the named engine's link was closed";
}

// Giving one more peer access to a segment is one window bound on that peer's link: what it
// costs does not depend on how many peers have access already. One target, 60 links to it (raw
// connections, each saying it is another engine: each link gets a window of its own), the bind
// time of the first 10 against the last 10.
TEST(Engine, GivingOneMorePeerAccessCostsTheSame) {
  RDMAKIT_RDMA_ONLY("plain Connections are the peers");
  constexpr int kLinks = 60, kSample = 10;  // a listener takes at most 64 links from one address
  Target t("t", 4096);
  auto bind_ns = [&] { return t.engine.counters().window_bind_ns; };
  std::uint64_t first = 0, before_last = 0;
  std::vector<std::unique_ptr<rdmakit::Connection>> links;
  for (int i = 0; i < kLinks; ++i) {
    if (i == kSample) first = bind_ns();
    if (i == kLinks - kSample) before_last = bind_ns();
    auto [c, kv] = raw_peer(t.engine, "p" + std::to_string(i));
    ASSERT_NE(kv.rkey, 0u) << "link " << i << " got no window";
    links.push_back(std::move(c));
  }
  const auto cnt = t.engine.counters();
  EXPECT_EQ(cnt.windows_bound, static_cast<std::uint64_t>(kLinks));
  EXPECT_EQ(cnt.accepts, static_cast<std::uint64_t>(kLinks));
  const double early = static_cast<double>(first) / kSample / 1000;
  const double late = static_cast<double>(cnt.window_bind_ns - before_last) / kSample / 1000;
  std::printf("one more peer's window on a segment: %.1f us to bind for peers 1-%d, %.1f us for peers %d-%d "
              "(mean over all %d: %.1f us)\n",
              early, kSample, late, kLinks - kSample + 1, kLinks, kLinks,
              static_cast<double>(cnt.window_bind_ns) / kLinks / 1000);
}


// Two NICs (lab --nics 2: rxe0 on 198.18.0.0/24, rxe1 on 198.18.1.0/24): with one worker per
// device, a peer is served by the worker of the device its address is reached through, its link
// is on that device, and Engine::peers() says so. Every byte moved through both is checked.
TEST(Engine, APeerIsServedByTheWorkerOfItsDevice) {
  TwoNics n;
  if (!n.present()) GTEST_SKIP() << "needs a lab VM with two NICs (--nics 2)";
  EngineConfig c = config("a");
  c.listen = "";
  Engine a(c);
  ASSERT_EQ(a.info().devices.size(), 2u);
  // t1 first: round robin would give it worker 0, its device's worker is 1.
  a.add_peer("t1", n.at(1));
  a.add_peer("t0", n.at(0));
  const Buffer src = a.allocate_memory(1 << 16);
  fill(src.addr, src.length, 9);
  ASSERT_NO_FATAL_FAILURE(n.write_to_both(a, src, 16, 4096));
  const std::vector<rdmakit::PeerInfo> peers = a.peers();
  ASSERT_EQ(peers.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    const std::uint32_t d = 1 - static_cast<std::uint32_t>(i);  // added in the order t1, t0
    EXPECT_EQ(peers[i].name, "t" + std::to_string(d));
    EXPECT_TRUE(peers[i].linked);
    EXPECT_EQ(peers[i].device, "rxe" + std::to_string(d)) << peers[i].address;
    EXPECT_EQ(peers[i].worker, d) << "the worker of " << peers[i].device;
  }
}

namespace {
// Kilobytes of this process's memory pinned by registrations (VmPin: what ib_umem charges).
std::uint64_t pinned_kb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmPin:", 0) == 0) return std::stoull(line.substr(6));
  }
  return 0;
}
}  // namespace

// EngineConfig::devices: an engine of rxe1 alone opens, pins and links only there (a storage or
// management NIC left out pins nothing), even to a peer whose address rxe0 carries; unknown
// names and a link.device outside the list are refused, naming what there is.
TEST(Engine, ListedDevicesAreUsedNotEveryDevice) {
  TwoNics n;
  if (!n.present()) GTEST_SKIP() << "needs a lab VM with two NICs (--nics 2)";
  constexpr std::uint64_t kSize = 16 << 20;
  std::uint64_t pinned[2] = {};
  for (const bool one : {false, true}) {
    EngineConfig c = config(one ? "one" : "all");
    c.listen = "";
    if (one) c.devices = {"rxe1"};
    Engine a(c);
    const std::vector<std::string> want = one ? std::vector<std::string>{"rxe1"} : std::vector<std::string>{"rxe0", "rxe1"};
    EXPECT_EQ(a.info().devices, want);
    const std::uint64_t before = pinned_kb();
    const Buffer src = a.allocate_memory(kSize);
    pinned[one] = (pinned_kb() - before) * 1024;
    fill(src.addr, 1 << 16, 7);
    a.add_peer("t0", n.at(0));
    a.add_peer("t1", n.at(1));
    if (!one) {
      ASSERT_NO_FATAL_FAILURE(n.write_to_both(a, src, 8, 8192));
      continue;
    }
    // rxe1 reaches t1; t0, whose route goes through rxe0, is refused naming it, not linked
    // through rxe1 behind the configuration's back.
    const Transfer w1 = xfer(TransferOp::write, src, 0, 8192, a.segment("t1", "kv"), 0);
    Batch b1 = a.submit({&w1, 1});
    ASSERT_TRUE(lab::waited(b1, 10s));
    EXPECT_EQ(b1.failed(), 0u) << b1.describe_failures();
    EXPECT_TRUE(same(n.targets[1]->buf.addr, src.addr, 8192));
    const Transfer w0 = xfer(TransferOp::write, src, 0, 8192, a.segment("t0", "kv"), 0);
    Batch b0 = a.submit({&w0, 1});
    ASSERT_TRUE(lab::waited(b0, 20s));
    EXPECT_EQ(b0.result(0).status, TransferStatus::connect_failed) << b0.describe_failures();
    EXPECT_NE(b0.result(0).reason.find("goes through rxe0"), std::string::npos) << b0.result(0).reason;
    EXPECT_NE(b0.result(0).reason.find("which is not one of the engine's devices (rxe1)"), std::string::npos)
        << b0.result(0).reason;
    for (const rdmakit::PeerInfo& p : a.peers()) {
      if (p.linked) {
        EXPECT_EQ(p.device, "rxe1") << p.name << " at " << p.address;
      }
    }
    EXPECT_EQ(a.peers().at(1).device, "rxe1");
  }
  std::printf("pinned for %llu MiB: every device %llu MiB, rxe1 alone %llu MiB\n",
              static_cast<unsigned long long>(kSize >> 20), static_cast<unsigned long long>(pinned[0] >> 20),
              static_cast<unsigned long long>(pinned[1] >> 20));
  EXPECT_GE(pinned[0], 2 * kSize);  // once per device
  EXPECT_GE(pinned[1], kSize);
  EXPECT_LT(pinned[1], 2 * kSize);
  EngineConfig bad = config("bad");
  bad.devices = {"rxe1", "mlx5_9"};
  try {
    Engine e(bad);
    ADD_FAILURE() << "an unknown device was taken";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no RDMA device 'mlx5_9' (there are: rxe0, rxe1)"), std::string::npos) << e.what();
  }
  bad.devices = {"rxe1"};
  bad.link.device = "rxe0";
  try {
    Engine e(bad);
    ADD_FAILURE() << "a link.device outside devices was taken";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("link.device 'rxe0' is not one of devices (rxe1)"), std::string::npos) << e.what();
  }
}

// Two devices: memory other than plain host memory (huge pages here) is registered on both, and
// transfers through a peer on each move its bytes right.
TEST(Engine, HugePagesAreRegisteredOnEveryDevice) {
  TwoNics n;
  if (!n.present()) GTEST_SKIP() << "needs a lab VM with two NICs (--nics 2)";
  EngineConfig c = config("a");
  c.listen = "";
  Engine a(c);
  rdmakit::MemorySpec huge;
  huge.kind = rdmakit::MemoryKind::hugepage;
  const Buffer src = a.allocate_memory(2 << 20, huge);
  fill(src.addr, 1 << 16, 5);
  a.add_peer("t0", n.at(0));
  a.add_peer("t1", n.at(1));
  ASSERT_NO_FATAL_FAILURE(n.write_to_both(a, src, 8, 8192));
  const auto peers = a.peers();
  ASSERT_EQ(peers.size(), 2u);
  EXPECT_NE(peers[0].device, peers[1].device);  // the buffer went out through both devices
}

// Several workers: peers are spread over them, and one batch that spans peers on different
// workers ends once, every transfer right, from several submitting threads at once.
TEST(Engine, BatchesSpanningWorkersEndOnce) {
  std::vector<std::unique_ptr<Target>> targets;
  for (int i = 0; i < 4; ++i) targets.push_back(std::make_unique<Target>("t" + std::to_string(i), 1 << 20));
  EngineConfig c = config("a");
  c.workers = 3;
  Engine a(c);
  for (int i = 0; i < 4; ++i) a.add_peer("t" + std::to_string(i), at(targets[static_cast<std::size_t>(i)]->engine));
  const Buffer src = a.allocate_memory(1 << 20);
  fill(src.addr, src.length, 42);
  std::atomic<int> callbacks{0};
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      for (int round = 0; round < 8; ++round) {
        std::vector<Transfer> t;
        for (int p = 0; p < 4; ++p) {
          for (std::uint64_t k = 0; k < 4; ++k) {
            const std::uint64_t off = (static_cast<std::uint64_t>(th) * 4 + k) * 16384;
            t.push_back(xfer(TransferOp::write, src, off, 16384, a.segment("t" + std::to_string(p), "kv"), off));
          }
        }
        rdmakit::SubmitOptions o;
        o.on_done = [&](const Batch&) { ++callbacks; };
        Batch b = a.submit(t, std::move(o));
        if (!b.wait(20s) || b.failed() != 0 || b.size() != 16) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(callbacks.load(), 32);
  for (auto& t : targets) EXPECT_TRUE(same(t->buf.addr, src.addr, 4 * 4 * 16384));
  EXPECT_EQ(a.counters().connects, 4u);
}

// Destroying an engine with a batch in flight ends the batch: what completed is ok, the rest
// ends as peer_lost saying the engine closed; the Batch handle outlives the engine.
TEST(Engine, DestroyingAnEngineEndsWhatIsInFlight) {
  Target b("b", 16 << 20);
  std::optional<Batch> bt;
  {
    Engine a(config("a"));
    a.add_peer("b", at(b.engine));
    std::string why;
    ASSERT_TRUE(a.connect("b", 10s, &why)) << why;
    const Buffer src = a.allocate_memory(16 << 20);
    std::vector<Transfer> t;
    for (std::uint64_t k = 0; k < 256; ++k) t.push_back(xfer(TransferOp::write, src, k * 65536, 65536, a.segment("b", "kv"), k * 65536));
    bt = a.submit(t);
  }
  ASSERT_TRUE(bt->done());
  EXPECT_TRUE(bt->wait(0ms));
  std::size_t lost = 0;
  for (std::size_t i = 0; i < bt->size(); ++i) {
    const auto r = bt->result(i);
    if (r.status == TransferStatus::ok) continue;
    EXPECT_EQ(r.status, TransferStatus::peer_lost) << r.reason;
    ++lost;
  }
  std::printf("engine destroyed with 256 writes submitted: %zu ended as peer_lost\n", lost);
}
