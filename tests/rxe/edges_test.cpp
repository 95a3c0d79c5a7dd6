// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: the edges a review found (issue "Correct at every edge"), each against a
// real kernel RDMA stack. One VM for most; the keepalive case needs two (rxe.library.two_vms runs
// it, with netem silencing one of them).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include "connection/impl.hpp"
#include "forge.hpp"
#include "lab_helpers.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

extern char** environ;

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using rdmakit::Access;
using rdmakit::Completion;
using rdmakit::Connection;
using rdmakit::ConnectionConfig;
using rdmakit::Listener;
using rdmakit::ListenerConfig;
using rdmakit::Opcode;
using rdmakit::PostStatus;
using rdmakit::WaitStatus;
using rdmakit::WorkRequest;

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

ConnectionConfig quiet() { return lab::quiet(); }

std::string target(const Listener& l) { return "127.0.0.1:" + std::to_string(l.port()); }

Connection::Setup buffer(std::size_t bytes = 64 * 1024) {
  return [bytes](Connection& c) {
    c.advertise(c.allocate_memory(bytes, Access::local_write | Access::remote_read | Access::remote_write |
                                             Access::remote_atomic));
  };
}

void fill(void* p, std::size_t n, std::uint8_t seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(seed + i * 13 + (i >> 12));
}

struct Tracer {
  std::mutex mu;
  std::vector<rdmakit::TraceEvent> events;
  std::function<void(const rdmakit::TraceEvent&)> sink() {
    return [this](const rdmakit::TraceEvent& e) {
      std::lock_guard lock(mu);
      events.push_back(e);
    };
  }
  bool saw(const std::string& name) {
    std::lock_guard lock(mu);
    return std::any_of(events.begin(), events.end(), [&](const auto& e) { return e.event == name; });
  }
};

// 1. QP creation fails (here: an inline size the device refuses) with tracing on: an Error, not a
// crash in close() formatting a QP number that does not exist. On either side, and through
// RDMAKIT_TRACE as well as ConnectionConfig::trace.
TEST(Edges, QpCreationFailureWithTracingOnIsAnErrorNotACrash) {
  const auto before = lab::rdma_resources();
  {
    Listener good("127.0.0.1:0", quiet(), buffer());
    Tracer t;
    ConnectionConfig cfg = quiet();
    cfg.max_inline = 1 << 20;
    cfg.trace = t.sink();
    try {
      (void)Connection::connect(target(good), cfg, buffer());
      ADD_FAILURE() << "a QP with 1 MiB inline was created";
    } catch (const rdmakit::Error& e) {
      EXPECT_EQ(e.op(), "ibv_create_qp") << e.what();
    }
    EXPECT_TRUE(t.saw("handshake_failed"));
    EXPECT_FALSE(t.saw("closed"));  // nothing was ever built to close
  }
  {
    // The listener's side, with the environment's tracer: the client hears why, the listener
    // keeps serving.
    ::setenv("RDMAKIT_TRACE", "1", 1);
    ConnectionConfig scfg = quiet();
    scfg.max_inline = 1 << 20;
    Listener bad("127.0.0.1:0", scfg, buffer());
    ::unsetenv("RDMAKIT_TRACE");
    for (int i = 0; i < 2; ++i) {
      try {
        (void)Connection::connect(target(bad), quiet(), buffer());
        ADD_FAILURE() << "connected to a listener that cannot create QPs";
      } catch (const rdmakit::Error& e) {
        EXPECT_NE(std::string(e.what()).find("ibv_create_qp"), std::string::npos) << e.what();
      }
    }
    for (int i = 0; i < 50 && bad.rejected() < 2; ++i) std::this_thread::sleep_for(20ms);
    EXPECT_EQ(bad.rejected(), 2u);
  }
  EXPECT_EQ(lab::rdma_resources(), before);
}

struct Pair {
  explicit Pair(ConnectionConfig c = quiet(), ConnectionConfig s = quiet(), std::size_t bytes = 64 * 1024)
      : listener("127.0.0.1:0", s, buffer(bytes)),
        client(Connection::connect(target(listener), c, buffer(bytes))),
        server(*listener.accept(5s)) {}
  Listener listener;
  Connection client;
  Connection server;
};

// 2. A peer lost after unsignaled work that had already succeeded: wait() still reaches `closed`
// (a drain marker retires what produced no completion), busy polling and with completion events.
TEST(Edges, PeerLossAfterUnsignaledWorkReachesClosed) {
  for (bool events : {false, true}) {
    ConnectionConfig cfg = quiet();
    cfg.completion_events = events;
    Pair p(cfg);
    std::vector<WorkRequest> batch(8);
    std::vector<rdmakit::LocalSlice> src;
    for (std::size_t i = 0; i < batch.size(); ++i) src.push_back(p.client.memory(0).local().subslice(i * 4096, 4096));
    for (std::size_t i = 0; i < batch.size(); ++i) {
      batch[i].local = {&src[i], 1};
      batch[i].remote = p.client.remote_regions()[0];
      batch[i].remote_offset = i * 4096;
      batch[i].wr_id = i;
      batch[i].signaled = false;
    }
    ASSERT_TRUE(p.client.post_batch(batch).ok());
    std::this_thread::sleep_for(50ms);  // they complete, silently
    EXPECT_EQ(p.client.outstanding(), 8u);
    p.server.close();
    const auto t0 = Clock::now();
    WaitStatus st = WaitStatus::timeout;
    int lost = 0;
    for (int i = 0; i < 20 && st != WaitStatus::closed; ++i) {
      st = p.client.wait(1s).status;
      lost += st == WaitStatus::peer_lost;
      EXPECT_NE(st, WaitStatus::timeout) << (events ? "events" : "busy");
      EXPECT_NE(st, WaitStatus::completed) << "a silent success is not news";
    }
    std::printf("%s: peer_lost then closed after %.1f ms\n", events ? "events" : "busy polling", ms(Clock::now() - t0));
    EXPECT_EQ(st, WaitStatus::closed);
    EXPECT_EQ(lost, 1);
    EXPECT_EQ(p.client.outstanding(), 0u);
    EXPECT_EQ(p.client.post_batch(batch).status, PostStatus::not_ready);
  }
}

// The server keeps calling wait() (so it hears BYE and breaks its side at once), like any
// serving loop, until its connection reports `closed`. Nothing else touches the connection
// meanwhile: a Connection is used by one thread at a time.
struct Serving {
  Connection& c;
  std::atomic<bool> stop{false};
  std::atomic<bool> ended{false};
  std::vector<Completion> got;
  std::thread t;
  explicit Serving(Connection& conn, std::chrono::milliseconds post_recv_after = -1ms) : c(conn) {
    t = std::thread([this, post_recv_after] {
      if (post_recv_after.count() >= 0) {
        std::this_thread::sleep_for(post_recv_after);
        // Into the buffer's last 4 KiB, clear of what the tests WRITE.
        EXPECT_TRUE(c.post_recv(c.memory(0).local().subslice(c.memory(0).size() - 4096, 4096), 77).ok());
      }
      while (!stop.load()) {
        const auto w = c.wait(20ms);
        if (w.status == WaitStatus::completed) got.push_back(w.completion);
        if (w.status == WaitStatus::closed) break;
      }
      ended.store(true);
    });
  }
  // Waits up to `within` for the loop to see `closed`; true if it did (else it is stopped).
  bool finish(std::chrono::milliseconds within) {
    const auto until = Clock::now() + within;
    while (!ended.load() && Clock::now() < until) std::this_thread::sleep_for(5ms);
    const bool by_itself = ended.load();
    stop.store(true);
    if (t.joinable()) t.join();
    return by_itself;
  }
  ~Serving() { finish(0ms); }
};

// 3. close() lets what is in flight finish before it says BYE: a striped 8 MiB write over 4 QPs,
// unsignaled writes, a SEND delayed by RNR. All of it lands at the peer.
TEST(Edges, CloseLetsAStripedWriteFinishBeforeSayingBye) {
  constexpr std::size_t kLen = (8u << 20) + 12345;
  ConnectionConfig cfg = quiet();
  cfg.qps = 4;
  Pair p(cfg, quiet(), kLen);
  fill(p.client.memory(0).data(), kLen, 3);
  std::memset(p.server.memory(0).data(), 0, kLen);
  Serving s(p.server);
  ASSERT_TRUE(p.client.post_write(p.client.memory(0).local(), p.client.remote_regions()[0], 0, 1).ok());
  const auto t0 = Clock::now();
  p.client.close(10s);
  std::printf("close with a striped 8 MiB write in flight took %.1f ms\n", ms(Clock::now() - t0));
  EXPECT_TRUE(s.finish(5s)) << "the server did not see the close";
  EXPECT_EQ(std::memcmp(p.client.memory(0).data(), p.server.memory(0).data(), kLen), 0)
      << "the write was cut off by the close";
}

// Unsignaled work in flight at close: four 1 MiB WRITEs and, behind them, a SEND the peer cannot
// take for 150 ms (RNR). Nothing of it would ever complete visibly; close puts a signaled
// zero-length WRITE behind it and waits for that, so all of it lands.
TEST(Edges, CloseWaitsForUnsignaledWork) {
  constexpr std::size_t kLen = 4u << 20;
  ConnectionConfig scfg = quiet();
  scfg.rnr_timer = 40ms;  // the sender retries every 40 ms, 6 times
  Pair p(quiet(), scfg, kLen + 4096);
  fill(p.client.memory(0).data(), kLen, 5);
  std::memset(p.server.memory(0).data(), 0, kLen);
  std::memcpy(static_cast<char*>(p.client.memory(0).data()) + kLen, "unsignaled", 10);
  Serving s(p.server, 150ms);
  std::vector<WorkRequest> batch(5);
  std::vector<rdmakit::LocalSlice> src;
  for (std::size_t i = 0; i < 4; ++i) src.push_back(p.client.memory(0).local().subslice(i << 20, 1 << 20));
  src.push_back(p.client.memory(0).local().subslice(kLen, 10));
  for (std::size_t i = 0; i < 5; ++i) {
    batch[i].opcode = i < 4 ? Opcode::write : Opcode::send;
    batch[i].local = {&src[i], 1};
    batch[i].remote = p.client.remote_regions()[0];
    batch[i].remote_offset = i << 20;
    batch[i].signaled = false;
  }
  ASSERT_TRUE(p.client.post_batch(batch).ok());
  p.client.close(5s);
  EXPECT_TRUE(s.finish(5s));
  EXPECT_EQ(std::memcmp(p.client.memory(0).data(), p.server.memory(0).data(), kLen), 0)
      << "unsignaled writes were flushed instead of finished";
  ASSERT_FALSE(s.got.empty()) << "the unsignaled SEND was flushed instead of delivered";
  EXPECT_TRUE(s.got[0].ok()) << s.got[0].describe();
}

TEST(Edges, CloseWaitsForAnRnrDelayedSend) {
  ConnectionConfig scfg = quiet();
  scfg.rnr_timer = 40ms;  // the sender retries every 40 ms, 6 times
  Pair p(quiet(), scfg);
  std::memcpy(p.client.memory(0).data(), "delayed but delivered", 22);
  // The server posts its receive 150 ms after the SEND arrives, well after the client closed.
  Serving s(p.server, 150ms);
  ASSERT_TRUE(p.client.post_send(p.client.memory(0).local().subslice(0, 22), 9).ok());
  p.client.close(5s);
  EXPECT_TRUE(s.finish(5s));
  ASSERT_FALSE(s.got.empty()) << "the SEND was flushed instead of delivered";
  EXPECT_TRUE(s.got[0].ok()) << s.got[0].describe();
  const auto* tail = static_cast<const char*>(p.server.memory(0).data()) + p.server.memory(0).size() - 4096;
  EXPECT_EQ(std::memcmp(tail, "delayed but delivered", 22), 0);
}

// 5. One QP's error completion breaks all of them: the others go to ERR too, posts are refused,
// and the connection reaches `closed`.
TEST(Edges, AnErrorOnOneQpBreaksTheWholeConnection) {
  Listener listener("127.0.0.1:0", quiet(), buffer());
  ConnectionConfig cfg = quiet();
  cfg.qps = 3;
  // A second "advertised" region: the first one with a forged rkey.
  Connection c = lab::connect_altered(target(listener), cfg, buffer(), [](rdmakit::wire::EndpointInfo& peer) {
    auto forged = peer.regions.at(0);
    forged.rkey ^= 0x5a5a00;
    peer.regions.push_back(forged);
  });
  auto s = listener.accept(5s);
  ASSERT_TRUE(s.has_value());
  const auto good = c.remote_regions()[0];
  const auto forged = c.remote_regions()[1];
  const auto src = c.memory(0).local().subslice(0, 64);
  // Round robin: QP 1, QP 2, QP 0.
  ASSERT_TRUE(c.post_write(src, good, 0, 1).ok());
  ASSERT_TRUE(c.post_write(src, forged, 0, 2).ok());
  std::vector<int> statuses;
  for (int i = 0; i < 2; ++i) {
    const auto w = c.wait(5s);
    ASSERT_EQ(w.status, WaitStatus::completed);
    statuses.push_back(w.completion.status);
  }
  EXPECT_NE(std::find(statuses.begin(), statuses.end(), IBV_WC_REM_ACCESS_ERR), statuses.end());
  auto& impl = rdmakit::Connection::Impl::of(c);
  for (const auto& qp : impl.qps) {
    EXPECT_EQ(rdmakit::detail::query_state(qp.get()), IBV_QPS_ERR) << "QP " << qp->qp_num << " left in RTS";
  }
  EXPECT_EQ(c.post_write(src, good, 0, 3).status, PostStatus::not_ready);
  EXPECT_NE(c.failure().find("remote access error"), std::string::npos) << c.failure();
  EXPECT_EQ(c.wait(2s).status, WaitStatus::closed);
}

// 10. Atomics need both devices: a peer that cannot serve them (its flag cleared here) makes
// atomics unsupported on this side, refused before posting.
TEST(Edges, AtomicsNeedThePeersCapabilityToo) {
  Listener listener("127.0.0.1:0", quiet(), buffer());
  Connection both = Connection::connect(target(listener), quiet(), buffer());
  ASSERT_TRUE(listener.accept(5s).has_value());
  EXPECT_TRUE(both.info().atomics);
  Connection c = lab::connect_altered(target(listener), quiet(), buffer(), [](rdmakit::wire::EndpointInfo& peer) {
    peer.flags &= static_cast<std::uint16_t>(~rdmakit::wire::kFlagAtomics);
  });
  ASSERT_TRUE(listener.accept(5s).has_value());
  EXPECT_FALSE(c.info().atomics);
  EXPECT_EQ(c.post_fetch_add(c.memory(0).local().subslice(0, 8), c.remote_regions()[0], 0, 1, 1).status,
            PostStatus::unsupported);
}

// 10. IBV_EVENT_CQ_ERR breaks the connection: the send CQ is overrun here by requests posted on
// the connection's QP behind the library's back (it sizes its CQs so it never overruns them).
TEST(Edges, ACqOverrunIsADeviceError) {
  ConnectionConfig cfg = quiet();
  cfg.send_depth = 16;
  Pair p(cfg);
  auto& impl = rdmakit::Connection::Impl::of(p.client);
  ibv_qp* qp = impl.qps[0].get();
  const auto src = p.client.memory(0).local().subslice(0, 8);
  const auto dst = p.client.remote_regions()[0];
  ibv_sge sge{reinterpret_cast<std::uint64_t>(src.addr()), 8, src.lkey()};
  int posted = 0;
  // Signaled requests, never polled, until the CQ has no room (rxe raises CQ_ERR and drops them).
  for (int round = 0; round < 64 && posted < 4096; ++round) {
    for (int i = 0; i < 16; ++i) {
      ibv_send_wr wr{};
      wr.wr_id = rdmakit::detail::kSeqMask;  // not a sequence the data path ever posted
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = dst.addr;
      wr.wr.rdma.rkey = dst.rkey;
      ibv_send_wr* bad = nullptr;
      if (ibv_post_send(qp, &wr, &bad) == 0) ++posted;
    }
    std::this_thread::sleep_for(5ms);
  }
  std::printf("posted %d signaled writes behind the library's back\n", posted);
  WaitStatus st = WaitStatus::timeout;
  for (int i = 0; i < 10 && st != WaitStatus::device_error; ++i) st = p.client.wait(500ms).status;
  EXPECT_EQ(st, WaitStatus::device_error);
  EXPECT_NE(p.client.failure().find("IBV_EVENT_CQ_ERR"), std::string::npos) << p.client.failure();
}

// 7. The listener: a Setup that throws something other than rdmakit::Error still sends a REJECT
// that says what; the queue of connections nobody accepts is bounded.
TEST(Edges, ASetupThatThrowsAnythingIsARejectWithItsReason) {
  Listener listener("127.0.0.1:0", quiet(), [](Connection&) { throw std::runtime_error("no buffers left"); });
  try {
    (void)Connection::connect(target(listener), quiet(), buffer());
    ADD_FAILURE() << "connected although the server's Setup threw";
  } catch (const rdmakit::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rejected the connection"), std::string::npos) << what;
    EXPECT_NE(what.find("the server's Setup failed: no buffers left"), std::string::npos) << what;
  }
  for (int i = 0; i < 50 && listener.rejected() == 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(listener.rejected(), 1u);
}

TEST(Edges, ConnectionsNobodyAcceptsAreBounded) {
  const auto before = lab::rdma_resources();
  {
    ListenerConfig lcfg = quiet();
    lcfg.max_pending = 2;
    Listener listener("127.0.0.1:0", lcfg, buffer());
    ConnectionConfig once = quiet();
    once.retry_refused = false;
    std::vector<Connection> clients;
    for (int i = 0; i < 2; ++i) clients.push_back(Connection::connect(target(listener), once, buffer()));
    // Both wait in the listener's queue (their handshakes are done); a third is refused at once.
    std::this_thread::sleep_for(100ms);
    try {
      (void)Connection::connect(target(listener), once, buffer());
      ADD_FAILURE() << "a third connection was queued beyond max_pending 2";
    } catch (const rdmakit::Error& e) {
      EXPECT_NE(std::string(e.what()).find("connections wait to be accepted"), std::string::npos) << e.what();
    }
    // Taking one makes room for one.
    ASSERT_TRUE(listener.accept(1s).has_value());
    clients.push_back(Connection::connect(target(listener), once, buffer()));
  }
  EXPECT_EQ(lab::rdma_resources(), before);
}

// A listener destroyed while clients are in their handshakes (connected, never a HELLO) ends
// them at once: its destructor waited out handshake_timeout (30 s here) for each.
TEST(Edges, DestroyingAListenerEndsItsHandshakesAtOnce) {
  ConnectionConfig c = quiet();
  c.handshake_timeout = 30s;
  auto listener = std::make_unique<Listener>("127.0.0.1:0", ListenerConfig(c), buffer());
  std::vector<int> mute;
  for (int i = 0; i < 3; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(listener->port());
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to), 0) << std::strerror(errno);
    mute.push_back(fd);
  }
  std::this_thread::sleep_for(500ms);  // their handshakes wait for a HELLO
  const auto t0 = Clock::now();
  listener.reset();
  EXPECT_LT(Clock::now() - t0, 5s) << "the destructor waited for the handshakes' deadline";
  for (const int fd : mute) ::close(fd);
}

// A cgroup whose pids.max stops this process from starting threads (root is not exempt from the
// pids controller, unlike RLIMIT_NPROC). Leaves it on destruction.
struct NoNewThreads {
  std::string dir = "/sys/fs/cgroup/rdmakit-edges";
  bool ok = false;
  NoNewThreads() {
    if (::access("/sys/fs/cgroup/cgroup.controllers", F_OK) != 0 &&
        std::system("mount -t cgroup2 none /sys/fs/cgroup") != 0) {
      return;
    }
    if (std::system("echo +pids > /sys/fs/cgroup/cgroup.subtree_control") != 0) return;
    ::mkdir(dir.c_str(), 0755);
    std::ofstream(dir + "/cgroup.procs") << ::getpid() << std::flush;
    // Exactly the threads there are now: not one more.
    std::ifstream cur(dir + "/pids.current");
    long n = 0;
    cur >> n;
    std::ofstream(dir + "/pids.max") << n << std::flush;
    ok = n > 0;
  }
  void lift() { std::ofstream(dir + "/pids.max") << "max" << std::flush; }
  ~NoNewThreads() {
    lift();
    std::ofstream("/sys/fs/cgroup/cgroup.procs") << ::getpid() << std::flush;
    ::rmdir(dir.c_str());
  }
};

// A client in another process, started before this one enters the cgroup (starting a process
// needs a new task too): each line written to it is one connect attempt, its outcome one line.
struct Client {
  pid_t pid = -1;
  int to = -1;
  FILE* from = nullptr;
  explicit Client(std::uint16_t port) {
    const std::string bin = std::getenv("FAULT_PEER") ? std::getenv("FAULT_PEER") : "";
    int in[2], out[2];
    EXPECT_EQ(::pipe(in), 0);
    EXPECT_EQ(::pipe(out), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    const std::string where = "127.0.0.1:" + std::to_string(port);
    char* argv[] = {const_cast<char*>(bin.c_str()), const_cast<char*>("try-connect"),
                    const_cast<char*>(where.c_str()), nullptr};
    EXPECT_EQ(posix_spawn(&pid, bin.c_str(), &fa, nullptr, argv, environ), 0) << bin;
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    to = in[1];
    from = ::fdopen(out[0], "r");
  }
  std::string attempt() {
    EXPECT_EQ(::write(to, "go\n", 3), 3);
    char line[1024] = {};
    return std::fgets(line, sizeof line, from) != nullptr ? line : "(no answer)";
  }
  ~Client() {
    ::close(to);
    int st = 0;
    ::waitpid(pid, &st, 0);
    std::fclose(from);
  }
};

// 7. A handshake thread that cannot be started (EAGAIN) refuses that client as busy; the listener
// lives on and serves the next client once threads can be started again.
TEST(Edges, AListenerThatCannotStartAThreadRefusesAndLivesOn) {
  std::mutex mu;
  std::string log;
  ListenerConfig lcfg = quiet();
  lcfg.connection.log = [&](std::string_view m) {
    std::lock_guard lock(mu);
    log += std::string(m) + "\n";
  };
  Listener listener(":0", lcfg, buffer());
  Client client(listener.port());
  std::string refused, served;
  {
    NoNewThreads limit;
    if (!limit.ok) GTEST_SKIP() << "no cgroup pids controller in this kernel";
    refused = client.attempt();
    limit.lift();
    served = client.attempt();
  }
  std::printf("while no thread could start: %swhen threads could again: %s", refused.c_str(), served.c_str());
  EXPECT_NE(refused.find("refused"), std::string::npos) << refused;
  EXPECT_NE(refused.find("busy: the server cannot take it now"), std::string::npos) << refused;
  EXPECT_NE(served.find("connected"), std::string::npos) << served;
  EXPECT_TRUE(listener.accept(5s).has_value());
  std::lock_guard lock(mu);
  EXPECT_NE(log.find("Resource temporarily unavailable"), std::string::npos) << log;
}

// 12. The source GID follows the route: a listener on a second address of the netdev, reached
// at that address, makes both sides use that address's GID, not the first by priority.
TEST(Edges, TheGidFollowsTheBootstrapRoute) {
  const std::string addr = "198.18.77.1";
  lab::ExtraAddress extra(addr);
  ASSERT_TRUE(extra.ok);
  // The GID table follows the netdev's addresses, asynchronously.
  bool present = false;
  for (int i = 0; i < 100 && !present; ++i) {
    for (const auto& d : rdmakit::list_devices()) {
      for (const auto& p : d.ports) {
        for (const auto& g : p.gids) present |= g.address() == "::ffff:" + addr;
      }
    }
    if (!present) std::this_thread::sleep_for(50ms);
  }
  ASSERT_TRUE(present) << "rxe0 has no GID for " << addr;
  Listener listener(addr + ":0", quiet(), buffer());
  Connection c = Connection::connect(addr + ":" + std::to_string(listener.port()), quiet(), buffer());
  auto s = listener.accept(5s);
  ASSERT_TRUE(s.has_value());
  for (const Connection* x : {&c, &*s}) {
    EXPECT_EQ(x->info().local_gid.address(), "::ffff:" + addr);
    EXPECT_NE(x->info().gid_reason.find("the local address of the route to the peer, " + addr), std::string::npos)
        << x->info().gid_reason;
    EXPECT_EQ(x->info().device_reason, "port 1 has a GID with the route's local address " + addr + " (eth0)");
  }
  // And the data flows over it.
  std::memcpy(c.memory(0).data(), "routed", 6);
  ASSERT_TRUE(c.post_write(c.memory(0).local().subslice(0, 6), c.remote_regions()[0], 0, 1).ok());
  EXPECT_TRUE(c.wait(5s).completion.ok());
  EXPECT_EQ(std::memcmp(s->memory(0).data(), "routed", 6), 0);
  // Through loopback no GID has the address: the priority order, and the reason says so.
  Listener lo("127.0.0.1:0", quiet(), buffer());
  Connection l = Connection::connect(target(lo), quiet(), buffer());
  EXPECT_NE(l.info().gid_reason.find("no GID has the route's local address 127.0.0.1"),
            std::string::npos)
      << l.info().gid_reason;
  // Nor is lo any RDMA device's netdev (sysfs: no port names it, it has no PCI function): the
  // first ACTIVE device, saying where the route went.
  EXPECT_EQ(l.info().device_reason,
            "the first device with an ACTIVE port; the route's local address 127.0.0.1 is on lo, which is no RDMA "
            "device's");
}

// 13. Fabric settings reach the QP: the traffic class in its address vector (ibv_query_qp, as
// the NIC holds it), the P_Key index in its INIT state, the ACK timeout and
// retries as encoded; a P_Key index outside the port's table fails at RESET->INIT, naming it.
TEST(Edges, FabricSettingsAreTheQpsAttributes) {
  ConnectionConfig cfg = quiet();
  cfg.traffic_class = 106;  // DSCP 26, ECT(0)
  cfg.service_level = 3;
  cfg.ack_timeout = 1000ms;
  cfg.retry_count = 5;
  Listener listener("127.0.0.1:0", cfg, buffer());
  Connection c = Connection::connect(target(listener), cfg, buffer());
  auto s = listener.accept(5s);
  ASSERT_TRUE(s.has_value());
  for (Connection* x : {&c, &*s}) {
    ibv_qp_attr a{};
    ibv_qp_init_attr init{};
    ASSERT_EQ(ibv_query_qp(Connection::Impl::of(*x).qps[0].get(), &a,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PKEY_INDEX | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT, &init),
              0);
    EXPECT_EQ(a.qp_state, IBV_QPS_RTS);
    EXPECT_EQ(a.ah_attr.is_global, 1);
    EXPECT_EQ(a.ah_attr.grh.traffic_class, 106);
    // (rxe keeps no SL for RoCE and reports 0; the SL given to the verb is unit-tested.)
    EXPECT_EQ(a.pkey_index, 0);
    EXPECT_EQ(a.timeout, 18);  // 4.096 us x 2^18 = 1.07 s, the first at least 1 s
    EXPECT_EQ(a.retry_cnt, 5);
  }
  // And the bytes still flow (rxe puts the class in each packet's IP header).
  std::memcpy(c.memory(0).data(), "classy", 6);
  ASSERT_TRUE(c.post_write(c.memory(0).local().subslice(0, 6), c.remote_regions()[0], 0, 1).ok());
  EXPECT_TRUE(c.wait(5s).completion.ok());
  EXPECT_EQ(std::memcmp(s->memory(0).data(), "classy", 6), 0);
  // rxe's P_Key table has one entry, and rxe itself takes any index at RESET->INIT: refused
  // before that, naming it.
  ConnectionConfig bad = quiet();
  bad.pkey_index = 100;
  bad.handshake_timeout = 5s;
  try {
    Connection x = Connection::connect(target(listener), bad, buffer());
    ADD_FAILURE() << "P_Key index 100 was taken";
  } catch (const rdmakit::Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("ibv_query_pkey"), std::string::npos) << w;
    EXPECT_NE(w.find("P_Key index 100 of rxe0 port 1 is not a valid entry"), std::string::npos) << w;
  }
  bad.pkey_index = 0;
  bad.service_level = 16;
  try {
    Connection x = Connection::connect(target(listener), bad, buffer());
    ADD_FAILURE() << "service level 16 was taken";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("service_level 16 (0..15)"), std::string::npos) << e.what();
  }
}

// 11. Keepalive, across two VMs: VM 1 goes silent (netem drops everything it sends, as a host
// that lost power or was paused would) while its connections to VM 0 are idle. VM 0 reports
// peer_lost within the keepalive bound; with keepalive off, the silent peer is never noticed.
TEST(Edges, AnIdleConnectionToASilentHostIsLostWithinTheKeepaliveBound) {
  const char* ips_env = std::getenv("RDMAKIT_LAB_IPS");
  std::istringstream ips_in(ips_env != nullptr ? ips_env : "");
  std::vector<std::string> ips{std::istream_iterator<std::string>(ips_in), std::istream_iterator<std::string>()};
  if (ips.size() != 2) GTEST_SKIP() << "needs two lab VMs (rxe.library.two_vms runs it)";
  const bool server = std::string(std::getenv("RDMAKIT_LAB_INDEX")) == "0";
  ConnectionConfig on = quiet();  // the defaults: 1 s interval, 3 s timeout
  ConnectionConfig off = quiet();
  off.keepalive_interval = off.keepalive_timeout = 0ms;
  auto watch = [](Connection& c, std::chrono::milliseconds limit) {
    const auto t0 = Clock::now();
    WaitStatus st = WaitStatus::timeout;
    while (Clock::now() - t0 < limit && st != WaitStatus::peer_lost) st = c.wait(200ms).status;
    return std::pair{st, Clock::now() - t0};
  };
  if (server) {
    Listener listener(":15300", on, buffer());
    Listener quiet_listener(":15301", off, buffer());
    auto c = listener.accept(20s);
    auto q = quiet_listener.accept(20s);
    ASSERT_TRUE(c && q);
    // VM 1 turns silent right after connecting (see below); both connections stay idle.
    const auto [st, took] = watch(*c, 8s);
    std::printf("keepalive on, server side: %s after %.0f ms (bound 3000 ms + a probe interval)\n",
                st == WaitStatus::peer_lost ? "peer_lost" : "nothing", ms(took));
    EXPECT_EQ(st, WaitStatus::peer_lost);
    EXPECT_LT(took, 6s);
    EXPECT_NE(c->failure().find("stopped answering"), std::string::npos) << c->failure();
    EXPECT_EQ(watch(*q, 1s).first, WaitStatus::timeout) << "keepalive off still noticed";
    std::ofstream("edges-keepalive.done") << "done" << std::flush;
    return;
  }
  (void)watch;
  struct Heal {
    ~Heal() { (void)std::system("tc qdisc del dev eth0 root 2>/dev/null"); }
  } heal;
  Connection c = Connection::connect(ips[0] + ":15300", on, buffer());
  Connection q = Connection::connect(ips[0] + ":15301", off, buffer());
  // This host goes silent, as a powered-off or paused one would: nothing it sends arrives.
  ASSERT_EQ(std::system("modprobe sch_netem && tc qdisc add dev eth0 root netem loss 100%"), 0);
  for (int i = 0; i < 150 && ::access("edges-keepalive.done", F_OK) != 0; ++i) std::this_thread::sleep_for(100ms);
  std::remove("edges-keepalive.done");
}

}  // namespace
