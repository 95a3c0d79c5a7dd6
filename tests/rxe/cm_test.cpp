// SPDX-License-Identifier: Apache-2.0
// Runs inside one lab VM: connections set up through rdma_cm (ConnectionConfig::method) with the
// same guarantees as the TCP bootstrap: data on every QP, the pre-shared key, refusals with a
// reason, a listener that keeps serving through foreign, silent and excess clients, peer loss
// from the CM's DISCONNECTED, nothing leaked.
#include <arpa/inet.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "bootstrap/channel.hpp"
#include "bootstrap/socket.hpp"
#include "cm/cm.hpp"
#include "common/clock.hpp"
#include "engine_helpers.hpp"
#include "lab_helpers.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"

extern char** environ;

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using rdmakit::Access;
using rdmakit::ConnectMethod;
using rdmakit::Connection;
using rdmakit::ConnectionConfig;
using rdmakit::Listener;
using rdmakit::ListenerConfig;
using rdmakit::Opcode;
using rdmakit::WaitStatus;

// rdma_cm resolves addresses to RDMA devices: the VM's own address is on rxe0's netdev.
std::string lab_ip() {
  const char* ip = std::getenv("RDMAKIT_LAB_IP");
  return ip != nullptr ? ip : "127.0.0.1";
}

ConnectionConfig cm(std::vector<std::uint8_t> psk = {}) {
  ConnectionConfig cfg = lab::quiet();
  cfg.method = ConnectMethod::rdma_cm;
  cfg.psk = std::move(psk);
  return cfg;
}

std::vector<std::uint8_t> key(char fill) { return std::vector<std::uint8_t>(32, static_cast<std::uint8_t>(fill)); }

std::string target(const Listener& l) { return lab_ip() + ":" + std::to_string(l.port()); }

Connection::Setup buffer(std::size_t size = 1 << 20) {
  return [size](Connection& c) {
    const auto& m = c.allocate_memory(size, Access::local_write | Access::remote_read | Access::remote_write |
                                                Access::remote_atomic);
    c.advertise(m);
    (void)c.post_recv(m.local().subslice(0, 4096), 99);
  };
}

void expect_refused(const std::string& to, const ConnectionConfig& cfg, const std::string& needle) {
  try {
    (void)Connection::connect(to, cfg, buffer(4096));
    ADD_FAILURE() << "connected; expected: " << needle;
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A bare librdmacm client (rping's way: the CM owns its QP), for what an rdmakit client never
// sends: a request without rdmakit's private data, or one that connects and then says nothing.
struct RawCmClient {
  rdma_event_channel* ch = rdma_create_event_channel();
  rdma_cm_id* id = nullptr;
  std::vector<std::uint8_t> reject_data;

  RawCmClient() { (void)rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP); }
  RawCmClient(const RawCmClient&) = delete;
  RawCmClient& operator=(const RawCmClient&) = delete;
  ~RawCmClient() {
    if (id != nullptr) {
      if (id->qp != nullptr) rdma_destroy_qp(id);
      rdma_destroy_id(id);
    }
    rdma_destroy_event_channel(ch);
  }
  // The next event within 10 s (RDMA_CM_EVENT_CONNECT_ERROR as "none").
  rdma_cm_event_type next() {
    pollfd p{ch->fd, POLLIN, 0};
    if (::poll(&p, 1, 10'000) <= 0) return RDMA_CM_EVENT_CONNECT_ERROR;
    rdma_cm_event* e = nullptr;
    if (rdma_get_cm_event(ch, &e) != 0) return RDMA_CM_EVENT_CONNECT_ERROR;
    const rdma_cm_event_type t = e->event;
    if (t == RDMA_CM_EVENT_REJECTED && e->param.conn.private_data != nullptr) {
      const auto* d = static_cast<const std::uint8_t*>(e->param.conn.private_data);
      reject_data.assign(d, d + e->param.conn.private_data_len);
    }
    rdma_ack_cm_event(e);
    return t;
  }
  // Resolves, builds a QP and connects with `data` as the request's private data; returns the
  // outcome (ESTABLISHED or REJECTED).
  rdma_cm_event_type connect(const std::string& ip, std::uint16_t port, const std::vector<std::uint8_t>& data,
                             const std::string& from = {}) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    ::inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    if (!from.empty()) ::inet_pton(AF_INET, from.c_str(), &src.sin_addr);
    if (rdma_resolve_addr(id, from.empty() ? nullptr : reinterpret_cast<sockaddr*>(&src),
                          reinterpret_cast<sockaddr*>(&a), 2000) != 0 ||
        next() != RDMA_CM_EVENT_ADDR_RESOLVED || rdma_resolve_route(id, 2000) != 0 ||
        next() != RDMA_CM_EVENT_ROUTE_RESOLVED) {
      return RDMA_CM_EVENT_ADDR_ERROR;
    }
    ibv_qp_init_attr qa{};
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = qa.cap.max_recv_wr = 4;
    qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
    qa.cap.max_inline_data = 64;
    if (rdma_create_qp(id, nullptr, &qa) != 0) return RDMA_CM_EVENT_ADDR_ERROR;
    rdma_conn_param p{};
    p.private_data = data.empty() ? nullptr : data.data();
    p.private_data_len = static_cast<std::uint8_t>(data.size());
    p.retry_count = 3;
    p.rnr_retry_count = 3;
    if (rdma_connect(id, &p) != 0) return RDMA_CM_EVENT_CONNECT_ERROR;
    return next();
  }
  // Sends `bytes` (at most 64) inline on the connected QP.
  bool send(const std::string& bytes) {
    ibv_sge sge{reinterpret_cast<std::uintptr_t>(bytes.data()), static_cast<std::uint32_t>(bytes.size()), 0};
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_INLINE;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(id->qp, &wr, &bad) == 0;
  }
  [[nodiscard]] std::string reason() const { return {reject_data.begin(), reject_data.end()}; }
};

const std::vector<std::uint8_t> kRdmakitRequest = {'R', 'D', 'M', 'K', 1, 0, 0, 0};

TEST(Cm, DataOnEveryQpWithAKey) {
  {
    Listener l(lab_ip() + ":0", cm(key('k')), buffer());
    ConnectionConfig c = cm(key('k'));
    c.qps = 4;
    c.stripe_min = 64 * 1024;
    Connection client = Connection::connect(target(l), c, buffer());
    auto server = l.accept(5s);
    ASSERT_TRUE(server.has_value());
    EXPECT_EQ(client.info().method, ConnectMethod::rdma_cm);
    EXPECT_EQ(server->info().method, ConnectMethod::rdma_cm);
    EXPECT_EQ(server->info().qps, 4u);
    EXPECT_EQ(client.info().local_gid.address(), "::ffff:" + lab_ip());

    // A striped WRITE of 1 MiB, read back, every byte compared.
    auto* mine = static_cast<std::uint8_t*>(client.memory(0).data());
    for (std::size_t i = 0; i < (1 << 19); ++i) mine[i] = static_cast<std::uint8_t>(i * 7);
    ASSERT_TRUE(client.post_write(client.memory(0).local().subslice(0, 1 << 19), client.remote_regions()[0], 0, 1).ok());
    auto w = client.wait(10s);
    ASSERT_EQ(w.status, WaitStatus::completed);
    ASSERT_TRUE(w.completion.ok()) << w.completion.describe();
    EXPECT_EQ(std::memcmp(server->memory(0).data(), mine, 1 << 19), 0);
    ASSERT_TRUE(client.post_read(client.memory(0).local().subslice(1 << 19, 1 << 19), client.remote_regions()[0], 0, 2).ok());
    w = client.wait(10s);
    ASSERT_TRUE(w.completion.ok()) << w.completion.describe();
    EXPECT_EQ(std::memcmp(mine, mine + (1 << 19), 1 << 19), 0);

    // SEND into the server's posted receive, and an atomic.
    std::memcpy(mine, "over rdma_cm", 12);
    ASSERT_TRUE(client.post_send(client.memory(0).local().subslice(0, 12), 3).ok());
    ASSERT_TRUE(client.wait(5s).completion.ok());
    w = server->wait(5s);
    ASSERT_EQ(w.status, WaitStatus::completed);
    EXPECT_EQ(w.completion.opcode, Opcode::recv);
    EXPECT_EQ(std::memcmp(server->memory(0).data(), "over rdma_cm", 12), 0);
    if (client.info().atomics) {
      ASSERT_TRUE(client.post_fetch_add(client.memory(0).local().subslice(4096, 8), client.remote_regions()[0], 8192, 5, 4).ok());
      ASSERT_TRUE(client.wait(5s).completion.ok());
    }

    // Messages on the control channel (the CM's QP), both ways, sealed under the key.
    const std::vector<std::uint8_t> hello(1000, 0x5a);
    client.send_message(hello, 5s);
    auto got = server->receive_message(5s);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(*got, hello);
    // 32 messages before the client reads any: the channel holds them (64 KiB, like a socket).
    for (int i = 0; i < 32; ++i) server->send_message(std::vector<std::uint8_t>(600, static_cast<std::uint8_t>(i)), 5s);
    for (int i = 0; i < 32; ++i) {
      got = client.receive_message(5s);
      ASSERT_TRUE(got.has_value()) << i;
      EXPECT_EQ(*got, std::vector<std::uint8_t>(600, static_cast<std::uint8_t>(i)));
    }

    client.close();
    EXPECT_TRUE(server->wait_peer_close(5s));
  }
}

TEST(Cm, WrongKeysAndWrongPortsAreRefusedWithTheReason) {
  Listener keyed(lab_ip() + ":0", cm(key('a')), buffer(4096));
  expect_refused(target(keyed), cm(key('b')), "pre-shared key");
  expect_refused(target(keyed), cm(), "requires authentication");
  Listener open(lab_ip() + ":0", cm(), buffer(4096));
  expect_refused(target(open), cm(key('a')), "no pre-shared key");
  // A TCP listener's port is not an rdma_cm port (the CM has a port space of its own).
  Listener tcp(":0", lab::quiet(), buffer(4096));
  ConnectionConfig once = cm();
  once.retry_refused = false;
  expect_refused(target(tcp), once, "nothing listens on that rdma_cm port");
  // The listeners still serve.
  ConnectionConfig good = cm(key('a'));
  EXPECT_NO_THROW((void)Connection::connect(target(keyed), good, buffer(4096)));
  EXPECT_GE(keyed.rejected(), 2u);
}

TEST(Cm, ForeignAndSilentClientsDoNotStopTheListener) {
  ListenerConfig lc = cm();
  lc.connection.handshake_timeout = 1500ms;
  Listener l(lab_ip() + ":0", lc, buffer(4096));
  // Not rdmakit: no private data. Refused at once, with the reason in the REJ.
  {
    RawCmClient foreign;
    EXPECT_EQ(foreign.connect(lab_ip(), l.port(), {}), RDMA_CM_EVENT_REJECTED);
    EXPECT_NE(foreign.reason().find("not an rdmakit client"), std::string::npos) << foreign.reason();
  }
  // rdmakit's mark, then silence: the handshake's deadline ends it; meanwhile others get in.
  RawCmClient silent;
  ASSERT_EQ(silent.connect(lab_ip(), l.port(), kRdmakitRequest), RDMA_CM_EVENT_ESTABLISHED);
  const auto t0 = Clock::now();
  EXPECT_NO_THROW((void)Connection::connect(target(l), cm(), buffer(4096)));
  EXPECT_LT(Clock::now() - t0, 1500ms) << "a silent client held up another";
  // The listener disconnects the silent one at its deadline.
  EXPECT_EQ(silent.next(), RDMA_CM_EVENT_DISCONNECTED);
  EXPECT_GE(Clock::now() - t0, 1000ms);
  auto rejected_reach = [&](std::size_t n) {
    for (int i = 0; i < 100 && l.rejected() < n; ++i) std::this_thread::sleep_for(10ms);
    return l.rejected();
  };
  EXPECT_EQ(rejected_reach(2), 2u);
  // Garbage on the channel of an otherwise well-formed client: refused at once (not at the
  // deadline), and the listener serves on.
  RawCmClient garbler;
  ASSERT_EQ(garbler.connect(lab_ip(), l.port(), kRdmakitRequest), RDMA_CM_EVENT_ESTABLISHED);
  const auto t1 = Clock::now();
  ASSERT_TRUE(garbler.send("GARBAGE!GARBAGE!GARBAGE!"));
  EXPECT_EQ(garbler.next(), RDMA_CM_EVENT_DISCONNECTED);
  EXPECT_LT(Clock::now() - t1, 1000ms);
  EXPECT_EQ(rejected_reach(3), 3u);
  EXPECT_NO_THROW((void)Connection::connect(target(l), cm(), buffer(4096)));
}

TEST(Cm, ABusyListenerRefusesAndRetryingClientsGetIn) {
  ListenerConfig lc = cm();
  lc.max_handshakes = 1;
  lc.connection.handshake_timeout = 1500ms;
  Listener l(lab_ip() + ":0", lc, buffer(4096));
  RawCmClient silent;
  ASSERT_EQ(silent.connect(lab_ip(), l.port(), kRdmakitRequest), RDMA_CM_EVENT_ESTABLISHED);
  ConnectionConfig once = cm();
  once.retry_refused = false;
  expect_refused(target(l), once, "busy: 1 handshakes in progress");
  // A client that retries gets in once the silent one's deadline has freed the slot.
  ConnectionConfig patient = cm();
  patient.handshake_timeout = 5s;
  EXPECT_NO_THROW((void)Connection::connect(target(l), patient, buffer(4096)));
}

// A flood of clients that get through the CM and then say nothing, all from one address: the
// per-peer handshake cap admits max_handshakes_per_peer of them (each holds a control QP until
// its deadline: under rdma_cm the channel itself is a QP), refuses the rest at once, and a client
// from elsewhere still gets in about as fast as unloaded.
TEST(Cm, AFloodOfSilentClientsIsCapped) {
  lab::ExtraAddress extra("198.18.0.201");
  ASSERT_TRUE(extra.ok);
  ListenerConfig lc = cm(key('f'));
  lc.max_handshakes_per_peer = 8;
  lc.connection.handshake_timeout = 5s;
  Listener l(":0", lc, buffer(4096));
  const auto t_unloaded = Clock::now();
  (void)Connection::connect(target(l), cm(key('f')), buffer(4096));
  const auto unloaded = Clock::now() - t_unloaded;
  const auto before = lab::rdma_resources();
  std::vector<std::unique_ptr<RawCmClient>> flood;
  int established = 0, rejected = 0;
  for (int i = 0; i < 40; ++i) {
    auto& c = *flood.emplace_back(std::make_unique<RawCmClient>());
    const auto e = c.connect(lab_ip(), l.port(), kRdmakitRequest, extra.address);
    established += e == RDMA_CM_EVENT_ESTABLISHED ? 1 : 0;
    if (e == RDMA_CM_EVENT_REJECTED) {
      ++rejected;
      EXPECT_NE(c.reason().find("busy: 8 handshakes in progress from 198.18.0.201"), std::string::npos) << c.reason();
    }
  }
  EXPECT_EQ(established, 8);
  EXPECT_EQ(rejected, 32);
  const auto t0 = Clock::now();
  EXPECT_NO_THROW((void)Connection::connect(target(l), cm(key('f')), buffer(4096)));
  const auto loaded = Clock::now() - t0;
  std::printf("rdma_cm connect: %.1f ms unloaded, %.1f ms with 40 silent clients\n",
              std::chrono::duration<double, std::milli>(unloaded).count(),
              std::chrono::duration<double, std::milli>(loaded).count());
  EXPECT_LT(loaded, 2s);
  // The flood's QPs: its own 40 and the listener's 8 control QPs; and the good client's
  // server side, waiting for accept() (its control and data QP). Nothing more.
  EXPECT_LE(lab::rdma_resources().at("qp"), before.at("qp") + 40 + 8 + 2);
}

// The peer process is killed: its kernel sends the CM's DREQ, so the loss is seen at once, long
// before the data QPs' retries (ack_timeout x retry_count, ~4 s) would give up.
TEST(Cm, AKilledPeerIsLostAtOnceThroughTheCm) {
  ::setenv("RDMAKIT_TEST_METHOD", "rdma_cm", 1);
  lab::Child victim("listen", "15300");
  ::unsetenv("RDMAKIT_TEST_METHOD");
  ASSERT_TRUE(victim.ok());
  ASSERT_TRUE(victim.await("listening"));
  Connection c = Connection::connect(lab_ip() + ":15300", cm(), buffer(64 * 1024));
  ASSERT_TRUE(victim.await("ready"));
  ASSERT_TRUE(c.post_write(c.memory(0).local().subslice(0, 4096), c.remote_regions()[0], 0, 1).ok());
  ASSERT_TRUE(c.wait(5s).completion.ok());
  victim.kill();
  const auto t0 = Clock::now();
  WaitStatus st = WaitStatus::timeout;
  while (st != WaitStatus::peer_lost && Clock::now() - t0 < 10s) st = c.wait(100ms).status;
  ASSERT_EQ(st, WaitStatus::peer_lost);
  EXPECT_LT(Clock::now() - t0, 2s) << "the CM's disconnect should be seen before the QP's retries end";
  EXPECT_NE(c.failure().find("the peer is gone"), std::string::npos) << c.failure();
}

// The control channel's descriptor behaves as a socket's: readable while received bytes wait to
// be read, and once the peer has closed. A send's own progress takes the CQ's completions (and
// their events) off the queue; a reader that waits on the descriptor (the engine's worker does)
// must still learn of what they brought. (Missed, it left an engine's link waiting for a
// message that had arrived.)
TEST(Cm, TheChannelIsReadableWhileBytesWaitAndOnceClosed) {
  using namespace rdmakit::detail;
  CmListener listener(HostPort{lab_ip(), 0}, 4);
  std::unique_ptr<Channel> server;
  std::thread accepting([&] {
    const Deadline until = deadline_in(10s);
    while (!server && Clock::now() < until) {
      pollfd p{listener.fd(), POLLIN, 0};
      (void)::poll(&p, 1, 100);
      if (auto r = listener.next()) server = r->accept(CmOptions{}, until);
    }
  });
  std::unique_ptr<Channel> client = cm_connect(HostPort{lab_ip(), listener.port()}, CmOptions{}, deadline_in(10s), false);
  accepting.join();
  ASSERT_TRUE(server);
  const std::vector<std::uint8_t> hello{1, 2, 3}, reply{4, 5};
  server->send_all(hello, deadline_in(5s));  // acknowledged: in the client's receive queue
  client->send_all(reply, deadline_in(5s));  // its progress reaps the server's bytes too
  pollfd p{client->fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 1) << "bytes wait, but the descriptor does not say so";
  std::vector<std::uint8_t> got(hello.size());
  client->recv_exact(got, deadline_in(1s));
  EXPECT_EQ(got, hello);
  EXPECT_EQ(::poll(&p, 1, 0), 0) << "nothing waits, yet the descriptor is readable (a reader would spin)";
  got.resize(reply.size());
  server->recv_exact(got, deadline_in(1s));
  EXPECT_EQ(got, reply);

  // The server goes (a DREQ): a reader that waits on the descriptor hears of it, without spinning.
  server.reset();
  const auto t0 = Clock::now();
  int wakeups = 0;
  long n = kRecvWouldBlock;
  while (n != kRecvClosed && wakeups < 100) {
    ASSERT_EQ(::poll(&p, 1, 2000), 1) << "the close never made the descriptor readable";
    ++wakeups;
    std::uint8_t b = 0;
    int err = -1;
    n = client->recv_nonblocking({&b, 1}, &err);
    if (n == kRecvClosed) {
      EXPECT_EQ(err, 0) << "an orderly close";
    }
  }
  EXPECT_EQ(n, kRecvClosed);
  EXPECT_LT(Clock::now() - t0, 1s);
  EXPECT_LE(wakeups, 5) << "the descriptor stayed readable with nothing to read";
  EXPECT_EQ(::poll(&p, 1, 0), 1) << "closed, as a socket at its end: readable";
}

TEST(Cm, ConnectCloseCyclesLeakNothing) {
  Listener l(lab_ip() + ":0", cm(key('c')), buffer(4096));
  // Warm up: the device layer and librdmacm open what they keep for the process (librdmacm
  // keeps a context of each device it used until the process exits).
  (void)Connection::connect(target(l), cm(key('c')), buffer(4096));
  (void)l.accept(5s);
  const auto before = lab::rdma_resources();
  const int fds = lab::open_fds();
  for (int i = 0; i < lab::soak(8, 200); ++i) {
    Connection c = Connection::connect(target(l), cm(key('c')), buffer(4096));
    auto s = l.accept(5s);
    ASSERT_TRUE(s.has_value()) << i;
  }
  EXPECT_EQ(lab::rdma_resources(), before);
  EXPECT_EQ(lab::open_fds(), fds);
}

// The engine's links over rdma_cm: the same batches, windows and notifications.
TEST(Cm, TheEngineLinksThroughTheCm) {
  auto config = [](const std::string& name) {
    rdmakit::EngineConfig c;
    c.name = name;
    c.listen = lab_ip() + ":0";
    c.link = cm(key('e'));
    return c;
  };
  rdmakit::Engine b(config("b"));
  const rdmakit::Buffer kv = b.allocate_memory(1 << 20);
  b.expose("kv", kv, Access::remote_read | Access::remote_write);
  rdmakit::Engine a(config("a"));
  a.add_peer("b", lab_ip() + ":" + std::to_string(b.port()));
  const auto seg = a.segment("b", "kv");
  const rdmakit::Buffer src = a.allocate_memory(1 << 20);
  const rdmakit::Buffer dst = a.allocate_memory(1 << 20);
  auto* p = static_cast<std::uint8_t*>(src.addr);
  for (std::size_t i = 0; i < src.length; ++i) p[i] = static_cast<std::uint8_t>(i * 13 + (i >> 10));
  std::vector<rdmakit::Transfer> writes;
  for (std::uint64_t k = 0; k < 16; ++k) {
    writes.push_back(lab::xfer(rdmakit::TransferOp::write, src, k * 65536, 65536, seg, k * 65536));
  }
  rdmakit::SubmitOptions o;
  o.notify = {'d', 'o', 'n', 'e'};
  rdmakit::Batch w = a.submit(writes, o);
  ASSERT_TRUE(lab::waited(w, 10s));
  EXPECT_EQ(w.failed(), 0u) << w.describe_failures();
  std::optional<rdmakit::Notification> n;
  for (int i = 0; i < 100 && !n; ++i) {
    pollfd pfd{b.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, 50) > 0) {
      std::uint64_t v = 0;
      (void)!::read(b.fd(), &v, sizeof v);
    }
    n = b.next_notification();
  }
  ASSERT_TRUE(n.has_value());
  EXPECT_EQ(n->message, o.notify);
  EXPECT_EQ(std::memcmp(kv.addr, src.addr, src.length), 0);
  const rdmakit::Transfer one = lab::xfer(rdmakit::TransferOp::read, dst, 0, 1 << 20, seg, 0);
  rdmakit::Batch r = a.submit({&one, 1});
  ASSERT_TRUE(lab::waited(r, 10s));
  EXPECT_EQ(r.failed(), 0u) << r.describe_failures();
  EXPECT_EQ(std::memcmp(dst.addr, src.addr, src.length), 0);
  EXPECT_EQ(a.counters().connects, 1u);
  EXPECT_EQ(b.counters().accepts, 1u);
  // A link through the CM holds two QPs of the budget: its data QP and its control QP.
  EXPECT_EQ(a.counters().qps, 2u);
}

// The QP budget counts the control QPs: with room for one link (3 QPs), a second peer's link
// evicts the first, idle one, and every transfer still succeeds.
TEST(Cm, TheEnginesQpBudgetCountsTheControlQps) {
  auto config = [](const std::string& name) {
    rdmakit::EngineConfig c;
    c.name = name;
    c.listen = lab_ip() + ":0";
    c.link = cm();
    return c;
  };
  rdmakit::Engine b(config("b")), c(config("c"));
  for (rdmakit::Engine* t : {&b, &c}) t->expose("kv", t->allocate_memory(4096), Access::remote_read | Access::remote_write);
  rdmakit::EngineConfig ac = config("a");
  ac.max_qps = 1;
  EXPECT_THROW(rdmakit::Engine{ac}, rdmakit::Error) << "one QP cannot hold a link over rdma_cm";
  ac.max_qps = 3;
  rdmakit::Engine a(ac);
  a.add_peer("b", lab_ip() + ":" + std::to_string(b.port()));
  a.add_peer("c", lab_ip() + ":" + std::to_string(c.port()));
  const rdmakit::Buffer buf = a.allocate_memory(4096);
  for (const char* peer : {"b", "c", "b"}) {
    const rdmakit::Transfer t = lab::xfer(rdmakit::TransferOp::write, buf, 0, 4096, a.segment(peer, "kv"), 0);
    rdmakit::Batch x = a.submit({&t, 1});
    ASSERT_TRUE(lab::waited(x, 10s)) << peer;
    EXPECT_EQ(x.failed(), 0u) << x.describe_failures();
    EXPECT_LE(a.counters().qps, 3u);
  }
  EXPECT_EQ(a.counters().evictions, 2u);
}

}  // namespace
