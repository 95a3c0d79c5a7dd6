// SPDX-License-Identifier: Apache-2.0
// Transports per link (issue 33): which one a link takes and why, never one that was not listed,
// an engine without RDMA that says how to run anyway, and a peer that dies or stops mid-batch
// over tcp and shm as over rdma. These run on the host (RDMAKIT_TEST_TRANSPORT=tcp or shm): the
// choice between tcp and shm needs no RDMA device, and the lab's suites run the rest over rdma.
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "bootstrap/socket.hpp"
#include "engine_helpers.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/wire.hpp"

using namespace std::chrono_literals;
using namespace lab;
using rdmakit::Batch;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::EngineConfig;
using rdmakit::Transfer;
using rdmakit::TransferOp;
using rdmakit::TransferStatus;
using rdmakit::Transport;

namespace {

EngineConfig over(const std::string& name, std::vector<Transport> t) {
  EngineConfig c = config(name);
  c.transports = std::move(t);
  return c;
}

rdmakit::PeerInfo peer_info(const Engine& e, const std::string& name) {
  for (const auto& p : e.peers()) {
    if (p.name == name) return p;
  }
  return {};
}

// Writes `len` bytes of `src` to peer "t"'s segment "kv" at 0, then reads them back into `dst`:
// neither batch has a failure.
void write_and_read_back(Engine& a, const Buffer& src, const Buffer& dst, std::uint64_t len) {
  const Transfer w = xfer(TransferOp::write, src, 0, len, a.segment("t", "kv"), 0);
  Batch b = a.submit({&w, 1});
  ASSERT_TRUE(lab::waited(b, 10s));
  EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
  const Transfer r = xfer(TransferOp::read, dst, 0, len, a.segment("t", "kv"), 0);
  Batch rb = a.submit({&r, 1});
  ASSERT_TRUE(lab::waited(rb, 10s));
  EXPECT_EQ(rb.failed(), 0u) << rb.describe_failures();
}

#define HOST_ONLY()                                                                              \
  do {                                                                                           \
    if (!lab::soft_transport()) GTEST_SKIP() << "runs on the host (RDMAKIT_TEST_TRANSPORT=tcp or shm)"; \
  } while (0)

}  // namespace

// The initiator's order wins among what both list; shm only when both are proven on one host.
TEST(EngineTransports, TheInitiatorsFirstChoiceThatBothOfferIsTaken) {
  HOST_ONLY();
  Target t("t", 1 << 16, over("t", {Transport::tcp, Transport::shm}));
  const auto link = [&](std::vector<Transport> mine) {
    Engine a(over("a", std::move(mine)));
    a.add_peer("t", at(t.engine));
    std::string why;
    EXPECT_TRUE(a.connect("t", 10s, &why)) << why;
    const Buffer src = a.allocate_memory(4096);
    fill(src.addr, src.length, 3);
    const Transfer w = xfer(TransferOp::write, src, 0, 4096, a.segment("t", "kv"), 0);
    Batch b = a.submit({&w, 1});
    EXPECT_TRUE(lab::waited(b, 10s));
    EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
    EXPECT_TRUE(same(t.buf.addr, src.addr, 4096));
    return peer_info(a, "t");
  };
  rdmakit::PeerInfo p = link({Transport::shm, Transport::tcp});
  EXPECT_EQ(p.transport, "shm");
  EXPECT_EQ(p.device, "shm");
  EXPECT_NE(p.transport_reason.find("first choice"), std::string::npos) << p.transport_reason;
  p = link({Transport::tcp, Transport::shm});
  EXPECT_EQ(p.transport, "tcp");
  // The target does not list shm: tcp, and the link says which was passed over.
  Target u("u", 1 << 16, over("u", {Transport::tcp}));
  Engine a(over("a", {Transport::shm, Transport::tcp}));
  a.add_peer("u", at(u.engine));
  std::string why;
  ASSERT_TRUE(a.connect("u", 10s, &why)) << why;
  p = peer_info(a, "u");
  EXPECT_EQ(p.transport, "tcp");
  EXPECT_NE(p.transport_reason.find("shm"), std::string::npos) << p.transport_reason;
}

// In a lab VM (an RDMA device here): two engines that both list shm take it, proven on one host;
// the same pair with shm not listed by the initiator takes rdma. Every byte checked.
TEST(EngineTransports, InOneVmShmIsTakenUnlessUnlisted) {
  bool devices = false;
  try {
    devices = !rdmakit::list_devices().empty();
  } catch (const rdmakit::Error&) {
  }
  if (!devices || lab::soft_transport()) GTEST_SKIP() << "needs an RDMA device (a lab VM)";
  Target t("t", 1 << 16, over("t", {Transport::shm, Transport::rdma}));
  for (const auto& [mine, want] : {std::pair{std::vector<Transport>{Transport::shm, Transport::rdma}, "shm"},
                                   std::pair{std::vector<Transport>{Transport::rdma}, "rdma"}}) {
    Engine a(over("a", mine));
    a.add_peer("t", at(t.engine));
    const Buffer src = a.allocate_memory(1 << 16);
    fill(src.addr, src.length, want[0] == 's' ? 5 : 6);
    const Transfer w = xfer(TransferOp::write, src, 0, 1 << 16, a.segment("t", "kv"), 0);
    Batch b = a.submit({&w, 1});
    ASSERT_TRUE(lab::waited(b, 10s));
    EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
    EXPECT_TRUE(same(t.buf.addr, src.addr, 1 << 16));
    const rdmakit::PeerInfo p = peer_info(a, "t");
    EXPECT_EQ(p.transport, want) << p.transport_reason;
  }
}

// Where the kernel lets no process copy from another (Yama's ptrace_scope 1, Ubuntu's default),
// shm links go through the shared ring by themselves, and an engine that allows only cross-memory
// attach does not offer shm, saying why. Needs Yama and root, in a lab VM only: the setting is
// the kernel's, and on a host the other engine suites running beside this one (CI runs them side
// by side) would lose their cross-memory attach while it lasts. The scope is put back.
TEST(EngineTransports, WhereTheKernelForbidsAttachShmGoesThroughTheRing) {
  if (std::getenv("RDMAKIT_LAB_INDEX") == nullptr) GTEST_SKIP() << "changes a kernel setting: a lab VM only";
  const char* const scope_file = "/proc/sys/kernel/yama/ptrace_scope";
  std::string before;
  {
    std::ifstream in(scope_file);
    if (!(in >> before) || ::access(scope_file, W_OK) != 0) GTEST_SKIP() << "needs Yama and root (a lab VM)";
  }
  const auto set_scope = [&](const std::string& v) {
    std::ofstream out(scope_file);
    out << v << "\n";
    return static_cast<bool>(out.flush());
  };
  ASSERT_TRUE(set_scope("1"));
  struct Restore {
    std::function<void()> f;
    ~Restore() { f(); }
  } restore{[&] { (void)set_scope(before); }};
  Target t("t", 1 << 20, over("t", {Transport::shm, Transport::tcp}));
  EngineConfig ac = over("a", {Transport::shm});
  ac.shm_map = true;  // (the default; the suites' shm_ring run turns it off)
  Engine a(ac);
  a.add_peer("t", at(t.engine));
  const Buffer src = a.allocate_memory(1 << 20);
  const Buffer dst = a.allocate_memory(1 << 20);
  fill(src.addr, src.length, 9);
  ASSERT_NO_FATAL_FAILURE(write_and_read_back(a, src, dst, 1 << 20));
  EXPECT_TRUE(same(t.buf.addr, src.addr, 1 << 20));
  EXPECT_TRUE(same(dst.addr, src.addr, 1 << 20));
  const rdmakit::PeerInfo p = peer_info(a, "t");
  EXPECT_EQ(p.transport, "shm");
  EXPECT_NE(p.transport_reason.find("shared ring"), std::string::npos) << p.transport_reason;
  EXPECT_NE(p.transport_reason.find("ptrace_scope is 1"), std::string::npos) << p.transport_reason;
  // Memory the engine allocated is mapped by the target all the same (no ptrace permission is
  // involved), so its copies are one pass: the ring is for the rest.
  EXPECT_EQ(a.counters().shm_mapped_bytes, 2u << 20);
  // Cross-memory attach only: shm is not offered here, and the engine says why.
  EngineConfig only = over("b", {Transport::shm, Transport::tcp});
  only.shm_copy = rdmakit::ShmCopy::attach;
  Engine e(only);
  EXPECT_NE(e.info().transports_note.find("shm_copy is attach"), std::string::npos) << e.info().transports_note;
  EXPECT_EQ(e.info().transports, std::vector<std::string>{"tcp"});
}

namespace {

// This process's open descriptors.
std::size_t open_descriptors() {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

// Mappings of buffers an engine allocated to share (any engine's, this process's or its peer's).
std::size_t shared_buffer_mappings() {
  std::ifstream in("/proc/self/maps");
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) n += line.find("/memfd:rdmakit-buffer") != std::string::npos ? 1u : 0u;
  return n;
}

}  // namespace

// Memory an engine offering shm allocated is mapped by the shm target, which copies each request
// between it and its window in one pass, by attach or by the ring alike; memory the application
// registered goes the other way, every byte all the same; an unregistered buffer is unmapped by
// the target too, at once.
TEST(EngineTransports, AllocatedMemoryIsCopiedOnceThroughTheTargetsMapping) {
  HOST_ONLY();
  int scope = 0;
  std::ifstream("/proc/sys/kernel/yama/ptrace_scope") >> scope;
  for (const rdmakit::ShmCopy copy : {rdmakit::ShmCopy::attach, rdmakit::ShmCopy::ring}) {
    SCOPED_TRACE(rdmakit::to_string(copy));
    if (copy == rdmakit::ShmCopy::attach && scope > 0) continue;  // attach alone offers no shm here
    Target t("t", 4 << 20, over("t", {Transport::shm}));
    EngineConfig c = over("a", {Transport::shm});
    c.shm_copy = copy;
    c.shm_map = true;  // (the default; the suites' shm_ring run turns it off)
    Engine a(c);
    a.add_peer("t", at(t.engine));
    std::string why;
    ASSERT_TRUE(a.connect("t", 10s, &why)) << why;
    const std::size_t before = shared_buffer_mappings();
    const std::size_t fds = open_descriptors();
    const Buffer src = a.allocate_memory(4 << 20);
    const Buffer dst = a.allocate_memory(4 << 20);
    fill(src.addr, src.length, 21);
    ASSERT_NO_FATAL_FAILURE(write_and_read_back(a, src, dst, 4 << 20));
    EXPECT_TRUE(same(t.buf.addr, src.addr, 4 << 20));
    EXPECT_TRUE(same(dst.addr, src.addr, 4 << 20));
    EXPECT_EQ(a.counters().shm_mapped_bytes, 8u << 20);
    const rdmakit::PeerInfo p = peer_info(a, "t");
    EXPECT_NE(p.transport_reason.find("the peer maps and copies once"), std::string::npos) << p.transport_reason;
    // Both buffers, here and at the target.
    EXPECT_EQ(shared_buffer_mappings(), before + 4);
    // The application's own memory: the other way, every byte, not counted.
    std::vector<std::uint8_t> own(1 << 20);
    fill(own.data(), own.size(), 5);
    const Buffer mine = a.register_memory(own.data(), own.size());
    const Transfer w2 = xfer(TransferOp::write, mine, 0, 1 << 20, a.segment("t", "kv"), 1 << 20);
    Batch b2 = a.submit({&w2, 1});
    ASSERT_TRUE(lab::waited(b2, 10s));
    EXPECT_EQ(b2.failed(), 0u) << b2.describe_failures();
    EXPECT_TRUE(same(static_cast<std::uint8_t*>(t.buf.addr) + (1 << 20), own.data(), 1 << 20));
    EXPECT_EQ(a.counters().shm_mapped_bytes, 8u << 20);
    // Unregistered: the target unmaps them (told at once, not at the link's next transfer).
    a.unregister_memory(src);
    a.unregister_memory(dst);
    const auto until = std::chrono::steady_clock::now() + 3s;
    while (shared_buffer_mappings() != before && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
    EXPECT_EQ(shared_buffer_mappings(), before);
    // And their descriptors are closed: nothing holds their memory (the link, idle, included).
    EXPECT_EQ(open_descriptors(), fds);
    a.unregister_memory(mine);
  }
  // shm_map off: nothing mapped, every byte by the copy shm_copy names, and the link says so.
  Target t("t", 1 << 20, over("t", {Transport::shm}));
  EngineConfig c = over("a", {Transport::shm});
  c.shm_map = false;
  Engine a(c);
  a.add_peer("t", at(t.engine));
  const std::size_t before = shared_buffer_mappings();
  const Buffer src = a.allocate_memory(1 << 20);
  EXPECT_EQ(shared_buffer_mappings(), before);
  fill(src.addr, src.length, 33);
  const Transfer w = xfer(TransferOp::write, src, 0, 1 << 20, a.segment("t", "kv"), 0);
  Batch b = a.submit({&w, 1});
  ASSERT_TRUE(lab::waited(b, 10s));
  EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
  EXPECT_TRUE(same(t.buf.addr, src.addr, 1 << 20));
  EXPECT_EQ(a.counters().shm_mapped_bytes, 0u);
  EXPECT_NE(peer_info(a, "t").transport_reason.find("shm_map is off"), std::string::npos) << peer_info(a, "t").transport_reason;
}

// Nothing in common: the transfer ends connect_failed saying what each side offers; tcp is
// never taken by an engine that does not list it.
TEST(EngineTransports, NoTransportInCommonFailsSayingWhat) {
  HOST_ONLY();
  Target t("t", 4096, over("t", {Transport::shm}));
  Engine a(over("a", {Transport::tcp}));
  a.add_peer("t", at(t.engine));
  const Buffer src = a.allocate_memory(64);
  const Transfer w = xfer(TransferOp::write, src, 0, 64, a.segment("t", "kv"), 0);
  Batch b = a.submit({&w, 1});
  ASSERT_TRUE(lab::waited(b, 20s));
  EXPECT_EQ(b.result(0).status, TransferStatus::connect_failed);
  EXPECT_NE(b.result(0).reason.find("no transport both engines offer"), std::string::npos) << b.result(0).reason;
  EXPECT_NE(b.result(0).reason.find("tcp not: this engine does not offer it"), std::string::npos) << b.result(0).reason;
}

// A host without an RDMA device: an engine with no transports listed is refused, naming the
// setting that runs it anyway; one that lists rdma and tcp runs over tcp, and says why.
TEST(EngineTransports, AnEngineWithoutRdmaSaysHowToRunAnyway) {
  bool devices = true;
  try {
    devices = !rdmakit::list_devices().empty();
  } catch (const rdmakit::Error&) {
    devices = false;
  }
  if (devices) GTEST_SKIP() << "this host has an RDMA device";
  EngineConfig c = config("a");
  c.transports = {};
  try {
    Engine e(c);
    ADD_FAILURE() << "an engine without transports was built on a host without RDMA";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--transport tcp"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("EngineConfig::transports"), std::string::npos) << e.what();
  }
  c.transports = {Transport::rdma, Transport::tcp};
  Engine e(c);
  ASSERT_EQ(e.info().transports, std::vector<std::string>{"tcp"});
  EXPECT_NE(e.info().transports_note.find("rdma not offered"), std::string::npos) << e.info().transports_note;
}

// Memory the CPU cannot reach (a GPU pointer registered by address; a PROT_NONE mapping stands in
// for it on a host without a GPU) is not moved by tcp or shm, which copy with the CPU: a transfer
// of it ends invalid, saying why, and a segment of it is offered to no such peer; the process
// lives on.
TEST(EngineTransports, MemoryTheCpuCannotReachIsRefusedNotTouched) {
  HOST_ONLY();
  void* far = ::mmap(nullptr, 1 << 16, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(far, MAP_FAILED);
  {
    EngineConfig tc = config("t");
    Engine t(tc);
    t.expose("kv", t.allocate_memory(1 << 16), rdmakit::Access::remote_read | rdmakit::Access::remote_write);
    t.expose("far", t.register_memory(far, 1 << 16), rdmakit::Access::remote_read | rdmakit::Access::remote_write);
    Engine a(config("a"));
    a.add_peer("t", at(t));
    const Buffer mine = a.register_memory(far, 1 << 16);
    const Buffer ok = a.allocate_memory(64);
    const Transfer w[] = {xfer(TransferOp::write, mine, 0, 64, a.segment("t", "kv"), 0),
                          xfer(TransferOp::write, ok, 0, 64, a.segment("t", "far"), 0)};
    Batch b = a.submit(w);
    ASSERT_TRUE(lab::waited(b, 10s));
    EXPECT_EQ(b.result(0).status, TransferStatus::invalid) << b.result(0).reason;
    EXPECT_NE(b.result(0).reason.find("CPU cannot reach"), std::string::npos) << b.result(0).reason;
    EXPECT_EQ(b.result(1).status, TransferStatus::no_segment) << b.result(1).reason;
  }
  ::munmap(far, 1 << 16);
}

// A peer killed mid-batch: what was in flight ends peer_lost (or failed) within seconds, with
// the peer named; the client goes on with another peer.
TEST(EngineTransports, APeerKilledMidBatchEndsItAndTheOthersGoOn) {
  HOST_ONLY();
  lab::Child peer("engine", "7910", "p");
  ASSERT_TRUE(peer.ok() && peer.await("ready")) << "FAULT_PEER is the peer program";
  Target other("o", 1 << 20);
  Engine a(config("a"));
  a.add_peer("p", "127.0.0.1:7910");
  a.add_peer("o", at(other.engine));
  std::string why;
  ASSERT_TRUE(a.connect("p", 10s, &why)) << why;
  const Buffer src = a.allocate_memory(1 << 20);
  std::vector<Transfer> t;
  for (int k = 0; k < 2000; ++k) t.push_back(xfer(TransferOp::write, src, 0, 1 << 20, a.segment("p", "kv"), 0));
  Batch b = a.submit(t);
  std::this_thread::sleep_for(50ms);
  const auto t0 = std::chrono::steady_clock::now();
  peer.kill();
  ASSERT_TRUE(lab::waited(b, 10s)) << "a batch to a killed peer never ended";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_GT(b.failed(), 0u);
  for (std::uint32_t i = 0; i < t.size(); ++i) {
    const auto r = b.result(i);
    if (r.status == TransferStatus::ok) continue;
    EXPECT_TRUE(r.status == TransferStatus::peer_lost || r.status == TransferStatus::failed ||
                r.status == TransferStatus::connect_failed)
        << rdmakit::to_string(r.status) << ": " << r.reason;
    EXPECT_NE(r.reason.find("'p'"), std::string::npos) << r.reason;
    break;
  }
  const Transfer w = xfer(TransferOp::write, src, 0, 4096, a.segment("o", "kv"), 0);
  Batch ok = a.submit({&w, 1});
  ASSERT_TRUE(lab::waited(ok, 10s));
  EXPECT_EQ(ok.failed(), 0u) << ok.describe_failures();
}

// A peer stopped (SIGSTOP) with transfers in flight: they end within the link's stall bound
// (ack_timeout x (retry_count + 1), as an RC QP's retries), not never.
TEST(EngineTransports, AStoppedPeersTransfersEndAtTheStallBound) {
  HOST_ONLY();
  lab::Child peer("engine", "7911", "p");
  ASSERT_TRUE(peer.ok() && peer.await("ready")) << "FAULT_PEER is the peer program";
  EngineConfig c = config("a");
  c.link.ack_timeout = 100ms;
  c.link.retry_count = 2;  // 300 ms, raised to the floor of 500 ms
  Engine a(c);
  a.add_peer("p", "127.0.0.1:7911");
  std::string why;
  ASSERT_TRUE(a.connect("p", 10s, &why)) << why;
  const Buffer src = a.allocate_memory(1 << 20);
  std::vector<Transfer> t;
  for (int k = 0; k < 200; ++k) t.push_back(xfer(TransferOp::write, src, 0, 1 << 20, a.segment("p", "kv"), 0));
  ::kill(peer.pid, SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  Batch b = a.submit(t);
  const bool ended = b.wait(10s);
  const auto took = std::chrono::steady_clock::now() - t0;
  ::kill(peer.pid, SIGCONT);
  ASSERT_TRUE(ended) << "transfers to a stopped peer never ended";
  EXPECT_GE(took, 400ms);
  EXPECT_LT(took, 5s);
  EXPECT_GT(b.failed(), 0u);
  bool named = false;
  for (std::uint32_t i = 0; i < t.size() && !named; ++i) {
    named = b.result(i).reason.find("brought nothing for 500 ms") != std::string::npos &&
            b.result(i).reason.find("tcp link") + b.result(i).reason.find("shm link") != 2 * std::string::npos;
  }
  EXPECT_TRUE(named) << b.describe_failures();
}

// Data streams with a token no handshake waits for, and garbage where a stream's first message
// belongs: refused, and the engine serves its links as before.
TEST(EngineTransports, ForgedAndGarbageStreamsAreRefusedAndTheLinksServed) {
  HOST_ONLY();
  Target t("t", 1 << 16);
  Engine a(config("a"));
  a.add_peer("t", at(t.engine));
  std::string why;
  ASSERT_TRUE(a.connect("t", 10s, &why)) << why;
  const auto to = rdmakit::detail::parse_host_port(at(t.engine), 0);
  for (int k = 0; k < 3; ++k) {
    rdmakit::detail::Fd fd = rdmakit::detail::tcp_connect(to, rdmakit::detail::deadline_in(2s));
    std::array<std::uint8_t, rdmakit::wire::kTokenSize> token{};
    token.fill(static_cast<std::uint8_t>(k));
    const auto msg = k < 2 ? rdmakit::wire::encode_stream(token, static_cast<std::uint16_t>(k))
                           : std::vector<std::uint8_t>(100, 0x5a);
    rdmakit::detail::send_all(fd.get(), msg, rdmakit::detail::deadline_in(2s));
    char c = 0;
    // The listener answers (a REJECT) and closes: it never holds the stream.
    while (::recv(fd.get(), &c, 1, 0) > 0) {
    }
  }
  const Buffer src = a.allocate_memory(4096);
  const Transfer w = xfer(TransferOp::write, src, 0, 4096, a.segment("t", "kv"), 0);
  Batch b = a.submit({&w, 1});
  ASSERT_TRUE(lab::waited(b, 10s));
  EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
  EXPECT_EQ(a.counters().reconnects, 0u);
}
#undef HOST_ONLY  // (the binary compiles in unity batches: not into the next file)
