// SPDX-License-Identifier: Apache-2.0
// The software RC queue pairs of the tcp and shm transports (src/transport/soft/), driven by the
// data path itself over real sockets: what the engine's links do with them, without a VM. A
// socketpair per stream (tcp's streams are TCP sockets; the frames are the same), and for shm the
// same process on both ends, so cross-memory attach reads and writes this very process.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "datapath/datapath.hpp"
#include "transport/soft/device.hpp"
#include "transport/soft/frame.hpp"
#include "transport/soft/qp.hpp"
#include "transport/shm/crossing.hpp"
#include "transport/shm/ring.hpp"
#include "verbs/memory_impl.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Completion;
using rdmakit::LocalSlice;
using rdmakit::MemoryRegion;
using rdmakit::Opcode;
using rdmakit::RemoteRegion;
using rdmakit::detail::DataPath;
using rdmakit::detail::Fd;
namespace soft = rdmakit::detail::soft;
namespace shm = rdmakit::detail::shm;

MemoryRegion unregistered(void* addr, std::size_t length) {
  auto impl = std::make_unique<MemoryRegion::Impl>();
  impl->addr = addr;
  impl->length = length;
  impl->access = Access::local_write;
  return MemoryRegion::Impl::wrap(std::move(impl));
}

// How the pair's data moves: tcp's frames, shm's cross-memory attach, shm's ring, or shm through
// memory A's device shares and B maps (A's whole memory is such).
enum class Mode { tcp, shm, ring, mapped };

// Two queue pairs joined by `streams` socketpairs, each with its data path; B serves a window.
// With the ring, one stream (what a ring takes), and the ring handed from A to B over it as the
// engine's link does.
struct Pair {
  explicit Pair(std::uint32_t streams = 2, Mode mode = Mode::tcp, std::chrono::milliseconds stall = 4000ms)
      : dev(mode == Mode::tcp ? "tcp" : "shm"), cqa(dev, 1024), cqb(dev, 1024), b_mem(4 << 20) {
    if (mode == Mode::ring || mode == Mode::mapped) streams = 1;
    if (mode == Mode::mapped) {
      a_fd = shm::create_sealed_memfd("test", 8 << 20, "A's memory");
      a_map.emplace(a_fd.get(), 8 << 20, "A's memory");
      a_mem = {a_map->data(), a_map->size()};
      a_share = dev.share(a_mem.data(), a_mem.size(), Fd(::fcntl(a_fd.get(), F_DUPFD_CLOEXEC, 0)));
    } else {
      a_vec.resize(8 << 20);
      a_mem = a_vec;
    }
    std::vector<Fd> fa, fb;
    for (std::uint32_t k = 0; k < streams; ++k) {
      int sv[2];
      EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
      fa.emplace_back(sv[0]);
      fb.emplace_back(sv[1]);
    }
    soft::QpConfig ca;
    ca.send_depth = 64;
    ca.qp_num = 1;
    ca.stall_timeout = stall;
    ca.on_fault = [this](const std::string& why) { a_fault = why; };
    soft::QpConfig cb = ca;
    cb.qp_num = 2;
    cb.on_fault = [this](const std::string& why) { b_fault = why; };
    // shm's crossing on both sides (A asks, B serves); tcp's data goes in the streams.
    shm::CrossingConfig xa;
    xa.peer_pid = mode == Mode::shm || mode == Mode::mapped ? ::getpid() : 0;
    xa.asks = true;
    xa.shares = mode == Mode::mapped;
    shm::CrossingConfig xb = xa;
    xb.shares = false;
    xb.takes_shares = mode == Mode::mapped;
    if (mode == Mode::ring) {
      const auto deadline = rdmakit::detail::deadline_in(2s);
      xa.ring = shm::Ring::create();
      xa.ring->send(fa[0].get(), deadline, nullptr);
      xb.ring = shm::Ring::receive(fb[0].get(), deadline, nullptr);
      xb.asks = false;  // it serves A's ring; its own requests (none here) would carry their data
    }
    const auto crossing = [&](shm::CrossingConfig x) -> std::unique_ptr<soft::Crossing> {
      if (mode == Mode::tcp) return nullptr;
      return std::make_unique<shm::Crossing>(dev, std::move(x));
    };
    qa = std::make_unique<soft::Qp>(dev, cqa, ca, std::move(fa), crossing(std::move(xa)));
    qb = std::make_unique<soft::Qp>(dev, cqb, cb, std::move(fb), crossing(std::move(xb)));
    qa->start();
    qb->start();
    const rdmakit::detail::DataPathLimits limits{64, 4, 1, 0, 1u << 30, 1u << 30};
    ibv_qp* a = qa->qp();
    ibv_qp* b = qb->qp();
    dpa.init(limits, {&a, 1}, cqa.cq(), cqa.cq(), cqa.channel(), soft::Device::ops());
    dpb.init(limits, {&b, 1}, cqb.cq(), cqb.cq(), cqb.channel(), soft::Device::ops());
    dpa.start();
    dpb.start();
    std::iota(a_mem.begin(), a_mem.end(), std::uint8_t{7});
    a_region = unregistered(a_mem.data(), a_mem.size());
  }
  ~Pair() {
    mw.reset();
    dpa.forget_qps();
    dpb.forget_qps();
  }

  // B binds a window on [offset, +length) of its memory for A, as an engine target does.
  RemoteRegion bind(std::size_t offset, std::size_t length, Access access) {
    mw.reset(ibv_alloc_mw(dev.pd(), IBV_MW_TYPE_2));
    EXPECT_NE(mw, nullptr);
    const std::uint32_t rkey = ibv_inc_rkey(mw->rkey);
    const auto addr = reinterpret_cast<std::uint64_t>(b_mem.data()) + offset;
    unsigned flags = 0;
    if (has(access, Access::remote_read)) flags |= IBV_ACCESS_REMOTE_READ;
    if (has(access, Access::remote_write)) flags |= IBV_ACCESS_REMOTE_WRITE;
    if (has(access, Access::remote_atomic)) flags |= IBV_ACCESS_REMOTE_ATOMIC;
    EXPECT_TRUE(dpb.post_bind(mw.get(), rkey, nullptr, addr, length, flags, 77).ok());
    const Completion c = next(dpb);
    EXPECT_TRUE(c.ok()) << c.describe();
    EXPECT_EQ(c.wr_id, 77u);
    return {addr, length, rkey, access};
  }
  static bool has(Access a, Access b) { return (static_cast<unsigned>(a) & static_cast<unsigned>(b)) != 0; }

  // The next completion of `dp`, both sides making progress meanwhile (each is its own NIC).
  Completion next(DataPath& dp, std::chrono::milliseconds within = 5000ms) {
    const auto until = std::chrono::steady_clock::now() + within;
    Completion c;
    while (std::chrono::steady_clock::now() < until) {
      cqa.progress();
      cqb.progress();
      if (dp.poll({&c, 1}) == 1) return c;
    }
    ADD_FAILURE() << "no completion within " << within.count() << " ms";
    return c;
  }
  void progress_for(std::chrono::milliseconds d) {
    const auto until = std::chrono::steady_clock::now() + d;
    while (std::chrono::steady_clock::now() < until) {
      cqa.progress();
      cqb.progress();
    }
  }

  soft::Device dev;
  soft::Cq cqa, cqb;
  std::unique_ptr<soft::Qp> qa, qb;
  DataPath dpa, dpb;
  Fd a_fd;
  std::optional<shm::Mapping> a_map;
  std::uint64_t a_share = 0;
  std::vector<std::uint8_t> a_vec;
  std::span<std::uint8_t> a_mem;
  std::vector<std::uint8_t> b_mem;
  std::optional<MemoryRegion> a_region;
  rdmakit::detail::MwPtr mw;
  std::string a_fault, b_fault;
};

// A queue pair on B's CQ whose peer is the test itself, writing raw bytes (`raw`). With a ring:
// the test's side created it and handed it over, as an initiator does, and the queue pair serves
// it (and has a data path of its own, to bind windows with).
struct Outsider {
  // `shm_link`: with shm's crossing even without a ring or shared memory (else a tcp link's queue pair).
  explicit Outsider(Pair& p, bool with_ring = false, bool shares = false, bool shm_link = false) {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    raw = Fd(sv[0]);
    std::vector<Fd> fc;
    fc.emplace_back(sv[1]);
    soft::QpConfig cc;
    cc.qp_num = 3;
    cc.on_fault = [this](const std::string& why) { fault = why; };
    shm::CrossingConfig xc;
    xc.takes_shares = shares;
    if (with_ring) {
      const auto deadline = rdmakit::detail::deadline_in(2s);
      ring = shm::Ring::create();
      ring->send(raw.get(), deadline, nullptr);
      xc.ring = shm::Ring::receive(fc[0].get(), deadline, nullptr);
    }
    qp = std::make_unique<soft::Qp>(p.dev, p.cqb, cc, std::move(fc),
                                    with_ring || shares || shm_link ? std::make_unique<shm::Crossing>(p.dev, std::move(xc)) : nullptr);
    qp->start();
    ibv_qp* q = qp->qp();
    dp.init({64, 4, 1, 0, 1u << 30, 1u << 30}, {&q, 1}, p.cqb.cq(), p.cqb.cq(), p.cqb.channel(), soft::Device::ops());
    dp.start();
  }
  ~Outsider() {
    mw.reset();
    dp.forget_qps();
  }
  // A window on [addr, +length) of B's memory, bound on this queue pair.
  RemoteRegion bind(Pair& p, std::uint8_t* addr, std::size_t length) {
    mw.reset(ibv_alloc_mw(p.dev.pd(), IBV_MW_TYPE_2));
    const std::uint32_t rkey = ibv_inc_rkey(mw->rkey);
    const auto at = reinterpret_cast<std::uint64_t>(addr);
    EXPECT_TRUE(dp.post_bind(mw.get(), rkey, nullptr, at, length, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE, 78).ok());
    const Completion c = p.next(dp);
    EXPECT_TRUE(c.ok()) << c.describe();
    return {at, length, rkey, Access::remote_read | Access::remote_write};
  }
  // Sends a request frame and returns its answer's status (nullopt: no answer within 1 s).
  std::optional<soft::FrameStatus> ask(Pair& p, const soft::Frame& f) {
    std::array<std::uint8_t, soft::kFrameSize> head{};
    soft::encode(f, head);
    EXPECT_EQ(::write(raw.get(), head.data(), head.size()), static_cast<ssize_t>(head.size()));
    const auto until = std::chrono::steady_clock::now() + 1s;
    std::array<std::uint8_t, soft::kFrameSize> answer{};
    while (std::chrono::steady_clock::now() < until) {
      p.cqa.progress();
      p.cqb.progress();
      if (::recv(raw.get(), answer.data(), answer.size(), MSG_DONTWAIT | MSG_PEEK) == static_cast<ssize_t>(answer.size())) {
        EXPECT_EQ(::recv(raw.get(), answer.data(), answer.size(), 0), static_cast<ssize_t>(answer.size()));
        const auto a = soft::decode(answer);
        if (!a) return std::nullopt;
        return a->status;
      }
    }
    return std::nullopt;
  }
  Fd raw;
  std::string fault;
  std::shared_ptr<shm::Ring> ring;
  std::unique_ptr<soft::Qp> qp;
  DataPath dp;
  rdmakit::detail::MwPtr mw;
};

class SoftTransport : public ::testing::TestWithParam<Mode> {};

TEST_P(SoftTransport, WritesReadsAndAtomicsLandWhereTheWindowSays) {
  Pair p(2, GetParam());
  const RemoteRegion seg = p.bind(4096, 2 << 20, Access::remote_read | Access::remote_write | Access::remote_atomic);
  p.dpa.set_remote({seg}, true);
  // A write of several frames spread over both streams, then one of 1 byte, then an empty one.
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 1 << 20), seg, 1000, 0, 0, 0, 1).ok()));
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(5, 1), seg, 0, 0, 0, 0, 2).ok()));
  Completion c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  EXPECT_EQ(c.wr_id, 1u);
  c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  EXPECT_EQ(c.wr_id, 2u);
  EXPECT_EQ(std::memcmp(p.b_mem.data() + 4096 + 1000, p.a_mem.data(), 1 << 20), 0);
  EXPECT_EQ(p.b_mem[4096], p.a_mem[5]);
  EXPECT_EQ(p.b_mem[4095], 0);  // outside the window: untouched
  EXPECT_EQ(p.b_mem[4096 + 1000 + (1 << 20)], 0);
  // Read it back elsewhere.
  ASSERT_TRUE((p.dpa.post_one<Opcode::read>(all.subslice(4 << 20, 1 << 20), seg, 1000, 0, 0, 0, 3).ok()));
  c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  EXPECT_EQ(std::memcmp(p.a_mem.data() + (4 << 20), p.a_mem.data(), 1 << 20), 0);
  // Atomics on an aligned word: the old value comes back, the word changes.
  std::uint64_t word = 40;
  std::memcpy(p.b_mem.data() + 4096 + 64, &word, 8);
  ASSERT_TRUE((p.dpa.post_one<Opcode::fetch_add>(all.subslice(6 << 20, 8), seg, 64, 0, 2, 0, 4).ok()));
  c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe() << p.qa->failure() << p.qb->failure();
  std::memcpy(&word, p.a_mem.data() + (6 << 20), 8);
  EXPECT_EQ(word, 40u);
  ASSERT_TRUE((p.dpa.post_one<Opcode::compare_swap>(all.subslice(6 << 20, 8), seg, 64, 0, 42, 9, 5).ok()));
  c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  std::memcpy(&word, p.b_mem.data() + 4096 + 64, 8);
  EXPECT_EQ(word, 9u);
  EXPECT_TRUE(p.a_fault.empty() && p.b_fault.empty()) << p.a_fault << p.b_fault;
}

TEST_P(SoftTransport, AChainOfUnsignaledWritesEndsWithItsLastCompletion) {
  Pair p(3, GetParam());
  const RemoteRegion seg = p.bind(0, 4 << 20, Access::remote_write);
  p.dpa.set_remote({seg}, false);
  const LocalSlice all = p.a_region->local();
  // 60 requests of 64 KiB in one chain (one doorbell): only the last is signaled.
  ASSERT_EQ(p.dpa.begin_chain(p.dpa.lane(0), 64), 64u);
  for (std::uint64_t k = 0; k < 60; ++k) {
    ASSERT_EQ(p.dpa.chain_add<Opcode::write>(reinterpret_cast<std::uint64_t>(all.addr()) + k * 65536, 65536, 0, true, seg,
                                             k * 65536, 0, 0, 100 + k),
              rdmakit::PostStatus::ok);
  }
  ASSERT_TRUE(p.dpa.post_chain_built().ok());
  // Signaled: every half queue (the 32nd) and the last; the last completes once all did.
  Completion c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  EXPECT_EQ(c.wr_id, 131u);
  c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  EXPECT_EQ(c.wr_id, 159u);
  std::size_t first = 0;
  while (first < 60 * 65536 && p.b_mem[first] == p.a_mem[first]) ++first;
  EXPECT_EQ(first, 60u * 65536) << "the first byte that differs";
}

TEST_P(SoftTransport, TheTargetRefusesWhatNoWindowOnTheLinkCovers) {
  Pair p(2, GetParam());
  const RemoteRegion seg = p.bind(4096, 8192, Access::remote_read);
  // The requester believes in more than the target bound (a peer that lies, or a stale view):
  // the target checks each request itself, as a NIC checks an rkey.
  RemoteRegion wider = seg;
  wider.length = 1 << 20;
  wider.access = Access::remote_read | Access::remote_write;
  p.dpa.set_remote({wider}, false);
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 100), wider, 0, 0, 0, 0, 1).ok()));  // no write access
  Completion c = p.next(p.dpa);
  EXPECT_EQ(c.status, IBV_WC_REM_ACCESS_ERR) << c.describe();
  EXPECT_EQ(p.b_mem[4096], 0);  // not a byte landed
  // As on RC, the link is dead now on both sides: what follows is flushed.
  EXPECT_TRUE(p.qa->in_error());
  p.progress_for(50ms);
  EXPECT_TRUE(p.qb->in_error());
  EXPECT_NE(p.b_fault.find("closed data stream"), std::string::npos) << p.b_fault;
}

TEST_P(SoftTransport, AReadPastTheWindowIsRefused) {
  Pair p(1, GetParam());
  const RemoteRegion seg = p.bind(4096, 8192, Access::remote_read);
  RemoteRegion wider = seg;
  wider.length = 1 << 20;
  p.dpa.set_remote({wider}, false);
  const LocalSlice all = p.a_region->local();
  std::memset(p.a_mem.data(), 0xee, 100);
  ASSERT_TRUE((p.dpa.post_one<Opcode::read>(all.subslice(0, 100), wider, 8150, 0, 0, 0, 1).ok()));
  const Completion c = p.next(p.dpa);
  EXPECT_EQ(c.status, IBV_WC_REM_ACCESS_ERR) << c.describe();
  EXPECT_EQ(p.a_mem[0], 0xee);
}

TEST_P(SoftTransport, AWindowDeallocatedIsNoLongerServed) {
  Pair p(1, GetParam());
  const RemoteRegion seg = p.bind(0, 8192, Access::remote_write);
  p.dpa.set_remote({seg}, false);
  p.mw.reset();  // the target withdraws it
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 100), seg, 0, 0, 0, 0, 1).ok()));
  const Completion c = p.next(p.dpa);
  EXPECT_EQ(c.status, IBV_WC_REM_ACCESS_ERR) << c.describe();
  EXPECT_EQ(p.b_mem[0], 0);
}

TEST_P(SoftTransport, APeerThatClosesMidTransferEndsItAndWhatFollowsIsFlushed) {
  Pair p(2, GetParam());
  const RemoteRegion seg = p.bind(0, 4 << 20, Access::remote_write);
  p.dpa.set_remote({seg}, false);
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 4 << 20), seg, 0, 0, 0, 0, 1).ok()));
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 64), seg, 0, 0, 0, 0, 2).ok()));
  p.mw.reset();
  p.dpb.forget_qps();
  p.qb.reset();  // its process ends: its streams close
  Completion c = p.next(p.dpa);
  EXPECT_EQ(c.wr_id, 1u);
  EXPECT_EQ(c.status, IBV_WC_RETRY_EXC_ERR) << c.describe();
  c = p.next(p.dpa);
  EXPECT_EQ(c.wr_id, 2u);
  EXPECT_EQ(c.status, IBV_WC_WR_FLUSH_ERR) << c.describe();
  EXPECT_NE(p.a_fault.find("closed data stream"), std::string::npos) << p.a_fault;
  EXPECT_FALSE((p.dpa.post_one<Opcode::write>(all.subslice(0, 64), seg, 0, 0, 0, 0, 3).ok()));  // broken: refused
}

TEST_P(SoftTransport, APeerThatStopsAnsweringFailsTheLinkAtTheStallTimeout) {
  Pair p(1, GetParam(), 200ms);
  const RemoteRegion seg = p.bind(0, 8192, Access::remote_write);
  p.dpa.set_remote({seg}, false);
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 64), seg, 0, 0, 0, 0, 1).ok()));
  // B is stopped (SIGSTOP): nothing polls its queue pair.
  const auto t0 = std::chrono::steady_clock::now();
  Completion c;
  while (std::chrono::steady_clock::now() - t0 < 3s && p.dpa.poll({&c, 1}) == 0) p.cqa.progress();
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(c.status, IBV_WC_RETRY_EXC_ERR) << c.describe();
  EXPECT_GE(took, 190ms);
  EXPECT_LT(took, 1500ms);
  EXPECT_NE(p.a_fault.find("brought nothing for 200 ms"), std::string::npos) << p.a_fault;
}

// shm: a requester that gave up on a stopped peer (its stall timeout) reports its READ failed, and
// its buffer may be another's from then on: the peer, woken later, must not copy into it. As on
// RC, nothing touches a failed queue pair's memory.
TEST_P(SoftTransport, APeerWokenAfterTheRequesterGaveUpDoesNotTouchItsMemory) {
  Pair p(1, GetParam(), 200ms);
  const RemoteRegion seg = p.bind(0, 8192, Access::remote_read);
  std::memset(p.b_mem.data(), 0xab, 8192);
  p.dpa.set_remote({seg}, false);
  std::memset(p.a_mem.data(), 0, 64);
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::read>(all.subslice(0, 64), seg, 0, 0, 0, 0, 1).ok()));
  Completion c;
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < 3s && p.dpa.poll({&c, 1}) == 0) p.cqa.progress();  // B stopped
  EXPECT_EQ(c.status, IBV_WC_RETRY_EXC_ERR) << c.describe();
  p.progress_for(200ms);  // B wakes and reads what was sent before A gave up
  EXPECT_EQ(p.a_mem[0], 0) << "the peer wrote into the requester's memory after it reported the READ failed";
}

TEST_P(SoftTransport, GarbageOnOneLinksStreamFailsThatLinkOnlyAndTheOthersAreServed) {
  Pair p(1, GetParam());
  const RemoteRegion seg = p.bind(0, 8192, Access::remote_write);
  p.dpa.set_remote({seg}, false);
  Outsider o(p);  // a third queue pair on B's CQ, whose peer is not an engine
  soft::Qp& qc = *o.qp;
  Fd& raw = o.raw;
  const std::string& c_fault = o.fault;
  std::vector<std::uint8_t> junk(soft::kFrameSize + 7, 0x5a);
  ASSERT_EQ(::write(raw.get(), junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 64), seg, 0, 0, 0, 0, 1).ok()));
  const Completion c = p.next(p.dpa);
  EXPECT_TRUE(c.ok()) << c.describe();
  EXPECT_TRUE(qc.in_error());
  EXPECT_NE(c_fault.find("not one"), std::string::npos) << c_fault;
  EXPECT_FALSE(p.qb->in_error());
  EXPECT_EQ(std::memcmp(p.b_mem.data(), p.a_mem.data(), 64), 0);
}

// Half a header, then the end: the link fails saying the peer closed its stream (nothing waits
// for the rest of a frame that will never come), and the other links on the CQ are served.
TEST_P(SoftTransport, ATruncatedFrameThenTheEndFailsThatLinkOnly) {
  Pair p(1, GetParam());
  const RemoteRegion seg = p.bind(0, 8192, Access::remote_write);
  p.dpa.set_remote({seg}, false);
  Outsider o(p);
  soft::Qp& qc = *o.qp;
  Fd& raw = o.raw;
  const std::string& c_fault = o.fault;
  std::array<std::uint8_t, soft::kFrameSize> head{};
  soft::Frame f;
  f.op = static_cast<std::uint8_t>(soft::FrameOp::write);
  f.length = 4096;
  soft::encode(f, head);
  ASSERT_EQ(::write(raw.get(), head.data(), 20), 20);
  p.progress_for(20ms);
  EXPECT_FALSE(qc.in_error()) << "half a header is not yet anything";
  raw.reset();
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 64), seg, 0, 0, 0, 0, 1).ok()));
  const Completion c = p.next(p.dpa);
  EXPECT_TRUE(c.ok()) << c.describe();
  EXPECT_TRUE(qc.in_error());
  EXPECT_NE(c_fault.find("closed data stream"), std::string::npos) << c_fault;
}

INSTANTIATE_TEST_SUITE_P(TcpAndShm, SoftTransport, ::testing::Values(Mode::tcp, Mode::shm, Mode::ring, Mode::mapped),
                         [](const auto& param_info) {
                           switch (param_info.param) {
                             case Mode::tcp: return "tcp";
                             case Mode::shm: return "shm";
                             case Mode::ring: return "shm_ring";
                             default: return "shm_mapped";
                           }
                         });

// --- shared memory: what a target maps, and takes from a peer that lies ------------------------

// A's memory goes to B once (SHARE), its transfers are copied through B's mapping, and when A's
// device takes it back B unmaps it at its next poll; memory A does not share goes by attach.
TEST(ShmShared, TheTargetMapsSharedMemoryOnceAndUnmapsItWhenItIsTakenBack) {
  Pair p(1, Mode::mapped);
  const RemoteRegion seg = p.bind(0, 4 << 20, Access::remote_read | Access::remote_write);
  p.dpa.set_remote({seg}, true);
  const LocalSlice all = p.a_region->local();
  EXPECT_EQ(p.qb->crossing()->peer_shares(), 0u);
  for (std::uint64_t i = 0; i < 8; ++i) {
    ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(i << 18, 1 << 18), seg, i << 18, 0, 0, 0, i + 1).ok()));
  }
  for (std::uint64_t i = 0; i < 8; ++i) {
    const Completion c = p.next(p.dpa);
    ASSERT_TRUE(c.ok()) << c.describe();
  }
  EXPECT_EQ(std::memcmp(p.b_mem.data(), p.a_mem.data(), 2 << 20), 0);
  EXPECT_EQ(p.qb->crossing()->peer_shares(), 1u);  // once, not per request
  EXPECT_EQ(p.dev.mapped_bytes(), 2u << 20);
  // Read back elsewhere in A's memory (B copies into its mapping of it).
  ASSERT_TRUE((p.dpa.post_one<Opcode::read>(all.subslice(4 << 20, 1 << 20), seg, 12345, 0, 0, 0, 9).ok()));
  Completion c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  EXPECT_EQ(std::memcmp(p.a_mem.data() + (4 << 20), p.b_mem.data() + 12345, 1 << 20), 0);
  EXPECT_EQ(p.dev.mapped_bytes(), 3u << 20);
  // Memory outside what A shares: cross-memory attach, no more bytes counted as mapped.
  std::vector<std::uint8_t> other(4096, 0xab);
  MemoryRegion o = unregistered(other.data(), other.size());
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(o.local(), seg, 0, 0, 0, 0, 10).ok()));
  c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  EXPECT_EQ(p.b_mem[4095], 0xab);
  EXPECT_EQ(p.dev.mapped_bytes(), 3u << 20);
  // Taken back: B unmaps it once A's CQ is polled (the device woke it).
  p.dev.unshare(p.a_share);
  const auto until = std::chrono::steady_clock::now() + 2s;
  while (p.qb->crossing()->peer_shares() != 0 && std::chrono::steady_clock::now() < until) p.progress_for(1ms);
  EXPECT_EQ(p.qb->crossing()->peer_shares(), 0u);
  // Its memory then goes by attach, and still lands.
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 4096), seg, 8192, 0, 0, 0, 11).ok()));
  c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  EXPECT_EQ(std::memcmp(p.b_mem.data() + 8192, p.a_mem.data(), 4096), 0);
  EXPECT_EQ(p.dev.mapped_bytes(), 3u << 20);
  EXPECT_TRUE(p.a_fault.empty() && p.b_fault.empty()) << p.a_fault << p.b_fault;
}

// A requester gives at most max_given ranges per link: past that, memory it shares goes by attach
// all the same (every byte lands, none counted as mapped), also when one chain names more ranges
// than are left (the cap is kept where the SHARE goes, not only where the request is taken).
TEST(ShmShared, PastItsLimitOfRangesALinkCopiesTheRestTheOtherWay) {
  Pair p(1, Mode::mapped);
  p.qa.reset();
  p.dpa.forget_qps();
  {
    // A's queue pair again, over a new stream pair, with a limit of 2 ranges.
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    std::vector<Fd> fa, fb;
    fa.emplace_back(sv[0]);
    fb.emplace_back(sv[1]);
    soft::QpConfig ca;
    ca.qp_num = 5;
    ca.on_fault = [&p](const std::string& why) { p.a_fault = why; };
    shm::CrossingConfig xa;
    xa.peer_pid = ::getpid();
    xa.asks = true;
    xa.shares = true;
    xa.max_given = 2;
    shm::CrossingConfig xb = xa;
    xb.asks = false;
    xb.shares = false;
    xb.takes_shares = true;
    soft::QpConfig cb = ca;
    cb.qp_num = 6;
    cb.on_fault = [&p](const std::string& why) { p.b_fault = why; };
    p.mw.reset();
    p.dpb.forget_qps();
    p.qb.reset();
    p.qa = std::make_unique<soft::Qp>(p.dev, p.cqa, ca, std::move(fa), std::make_unique<shm::Crossing>(p.dev, std::move(xa)));
    p.qb = std::make_unique<soft::Qp>(p.dev, p.cqb, cb, std::move(fb), std::make_unique<shm::Crossing>(p.dev, std::move(xb)));
    p.qa->start();
    p.qb->start();
    const rdmakit::detail::DataPathLimits limits{64, 4, 1, 0, 1u << 30, 1u << 30};
    ibv_qp* a = p.qa->qp();
    ibv_qp* b = p.qb->qp();
    p.dpa.init(limits, {&a, 1}, p.cqa.cq(), p.cqa.cq(), p.cqa.channel(), soft::Device::ops());
    p.dpb.init(limits, {&b, 1}, p.cqb.cq(), p.cqb.cq(), p.cqb.channel(), soft::Device::ops());
    p.dpa.start();
    p.dpb.start();
  }
  const RemoteRegion seg = p.bind(0, 4 << 20, Access::remote_write);
  p.dpa.set_remote({seg}, true);
  // Four more shared ranges beside A's 8 MiB (five in all): two are given, the rest go by attach.
  std::vector<Fd> fds;
  std::vector<shm::Mapping> maps;
  std::vector<MemoryRegion> regions;
  for (int i = 0; i < 4; ++i) {
    fds.push_back(shm::create_sealed_memfd("test", 65536, "a range"));
    maps.emplace_back(fds.back().get(), 65536, "a range");
    std::memset(maps.back().data(), 0x40 + i, 65536);
    (void)p.dev.share(maps.back().data(), 65536, Fd(::fcntl(fds.back().get(), F_DUPFD_CLOEXEC, 0)));
    regions.push_back(unregistered(maps.back().data(), 65536));
  }
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(regions[0].local(), seg, 0, 0, 0, 0, 1).ok()));
  const Completion c = p.next(p.dpa);
  ASSERT_TRUE(c.ok()) << c.describe();
  // The other three in one chain: each is taken while one range is given, fewer than the cap.
  std::array<ibv_sge, 3> sge{};
  std::array<ibv_send_wr, 3> wr{};
  for (std::size_t i = 0; i < 3; ++i) {
    sge[i] = {reinterpret_cast<std::uint64_t>(maps[i + 1].data()), 65536, 0};
    wr[i].wr_id = 100 + i;
    wr[i].sg_list = &sge[i];
    wr[i].num_sge = 1;
    wr[i].opcode = IBV_WR_RDMA_WRITE;
    wr[i].send_flags = IBV_SEND_SIGNALED;
    wr[i].wr.rdma.remote_addr = seg.addr + ((i + 1) << 16);
    wr[i].wr.rdma.rkey = seg.rkey;
    wr[i].next = i + 1 < 3 ? &wr[i + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p.qa->qp(), wr.data(), &bad), 0);
  int done = 0;
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (done < 3 && std::chrono::steady_clock::now() < until) {
    p.cqb.progress();
    ibv_wc wc{};
    if (ibv_poll_cq(p.cqa.cq(), 1, &wc) == 1) {
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
      ++done;
    }
  }
  ASSERT_EQ(done, 3);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(p.b_mem[(i << 16) + 65535], 0x40 + i) << i;
  EXPECT_EQ(p.qa->crossing()->given(), 2u);
  EXPECT_EQ(p.qb->crossing()->peer_shares(), 2u);
  EXPECT_EQ(p.dev.mapped_bytes(), 2u * 65536);
  EXPECT_TRUE(p.a_fault.empty() && p.b_fault.empty()) << p.a_fault << p.b_fault;
}

// A request of shared memory taken while its stream is full waits to be framed; another range
// going meanwhile (while this link has given none) drops the list of ranges the link looked at.
// When the request is framed its range is looked up again and given: it does not go naming a
// range the peer never had (which the peer refuses, failing the link).
TEST(ShmShared, ARequestWaitingForRoomStillGivesItsRangeAfterAnotherRangeGoes) {
  Pair p(1, Mode::mapped);
  const RemoteRegion seg = p.bind(0, 4 << 20, Access::remote_write);
  Fd fd = shm::create_sealed_memfd("test", 65536, "a range");
  shm::Mapping map(fd.get(), 65536, "a range");
  const std::uint64_t other_range = p.dev.share(map.data(), 65536, Fd(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0)));
  // 48 WRITEs of 1 MiB of memory A does not share: 192 frames by attach, the stream's most
  // unanswered (B is not polled meanwhile), then one of A's shared memory, taken and not framed.
  std::vector<std::uint8_t> plain(1 << 20, 0x11);
  std::array<ibv_sge, 49> sge{};
  std::array<ibv_send_wr, 49> wr{};
  for (std::size_t i = 0; i < wr.size(); ++i) {
    const bool last = i + 1 == wr.size();
    sge[i] = {reinterpret_cast<std::uint64_t>(last ? p.a_mem.data() : plain.data()), last ? 4096u : 1u << 20, 0};
    wr[i].wr_id = i;
    wr[i].sg_list = &sge[i];
    wr[i].num_sge = 1;
    wr[i].opcode = IBV_WR_RDMA_WRITE;
    wr[i].send_flags = IBV_SEND_SIGNALED;
    wr[i].wr.rdma.remote_addr = last ? seg.addr + (2 << 20) : seg.addr;
    wr[i].wr.rdma.rkey = seg.rkey;
    wr[i].next = last ? nullptr : &wr[i + 1];
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p.qa->qp(), wr.data(), &bad), 0);
  EXPECT_EQ(p.qa->crossing()->given(), 0u);
  // The other range goes; A's CQ, polled, looks at the device's ranges again.
  p.dev.unshare(other_range);
  p.cqa.progress();
  std::size_t done = 0;
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (done < wr.size() && std::chrono::steady_clock::now() < until) {
    p.cqb.progress();
    ibv_wc wc{};
    if (ibv_poll_cq(p.cqa.cq(), 1, &wc) == 1) {
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc.wr_id << ": " << ibv_wc_status_str(wc.status) << " " << p.a_fault;
      ++done;
    }
  }
  ASSERT_EQ(done, wr.size());
  EXPECT_EQ(std::memcmp(p.b_mem.data() + (2 << 20), p.a_mem.data(), 4096), 0);
  EXPECT_EQ(p.qb->crossing()->peer_shares(), 1u);
  EXPECT_EQ(p.dev.mapped_bytes(), 4096u);
  EXPECT_TRUE(p.a_fault.empty() && p.b_fault.empty()) << p.a_fault << p.b_fault;
}

// A peer that shares what it should not (no descriptor, a pipe, an unsealed memfd, a size its
// frame misstates, a range twice, one it never shared taken back, descriptors with no frame)
// fails its own link, saying what, and the target keeps serving its other links; a frame naming
// a range it never shared, or past one's end, is refused and touches nothing.
TEST(ShmShared, ATargetRefusesWhatAPeerSharesWrongAndServesTheOthers) {
  Pair p(1, Mode::tcp);
  const RemoteRegion seg = p.bind(0, 8192, Access::remote_write);
  p.dpa.set_remote({seg}, false);
  const auto outsider = [&](bool shares, bool shm_link = false) {
    auto o = std::make_unique<Outsider>(p, false, shares, shm_link);
    return o;
  };
  const auto share = [](Outsider& o, std::uint64_t id, std::uint64_t length, int fd) {
    std::array<std::uint8_t, soft::kFrameSize> head{};
    soft::Frame f;
    f.op = static_cast<std::uint8_t>(soft::FrameOp::share);
    f.arg0 = id;
    f.arg1 = length;
    soft::encode(f, head);
    iovec iov{head.data(), head.size()};
    rdmakit::detail::OneDescriptor control;
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (fd >= 0) control.attach(m, fd);
    EXPECT_EQ(::sendmsg(o.raw.get(), &m, MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  };
  const auto refused = [&](Outsider& o, const char* says) {
    const auto until = std::chrono::steady_clock::now() + 1s;
    while (!o.qp->in_error() && std::chrono::steady_clock::now() < until) p.progress_for(1ms);
    EXPECT_TRUE(o.qp->in_error()) << says;
    EXPECT_NE(o.fault.find(says), std::string::npos) << o.fault;
    // The pair's own link is served all along.
    const LocalSlice all = p.a_region->local();
    ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(0, 64), seg, 0, 0, 0, 0, 1).ok()));
    const Completion c = p.next(p.dpa);
    EXPECT_TRUE(c.ok()) << c.describe();
    EXPECT_FALSE(p.qb->in_error());
  };
  const std::size_t size = 1 << 20;
  Fd good = shm::create_sealed_memfd("test", size, "a peer's memory");
  {
    auto o = outsider(false);  // a tcp link: no crossing at all
    share(*o, 1, size, good.get());
    refused(*o, "takes none");
  }
  {
    auto o = outsider(false, true);  // an shm link that takes no shared memory (engine protocol 7)
    share(*o, 1, size, good.get());
    refused(*o, "takes none");
  }
  {
    auto o = outsider(true);
    share(*o, 1, size, -1);
    refused(*o, "without its descriptor");
  }
  {
    auto o = outsider(true);
    int pfd[2];
    ASSERT_EQ(::pipe2(pfd, O_CLOEXEC), 0);
    Fd r(pfd[0]), w(pfd[1]);
    share(*o, 1, size, r.get());
    refused(*o, "not a memfd sealed");
  }
  {
    auto o = outsider(true);
    Fd unsealed(::memfd_create("test", MFD_CLOEXEC));
    ASSERT_EQ(::ftruncate(unsealed.get(), size), 0);
    share(*o, 1, size, unsealed.get());
    refused(*o, "not a memfd sealed");
  }
  {
    auto o = outsider(true);
    share(*o, 1, size + 4096, good.get());
    refused(*o, "and its SHARE says");
  }
  {
    auto o = outsider(true);
    share(*o, 1, size, good.get());
    share(*o, 1, size, good.get());
    refused(*o, "shared twice");
  }
  {
    auto o = outsider(true);
    std::array<std::uint8_t, soft::kFrameSize> head{};
    soft::Frame f;
    f.op = static_cast<std::uint8_t>(soft::FrameOp::unshare);
    f.arg0 = 5;
    soft::encode(f, head);
    ASSERT_EQ(::write(o->raw.get(), head.data(), head.size()), static_cast<ssize_t>(head.size()));
    refused(*o, "never shared");
  }
  {
    // Descriptors with bytes that are no SHARE: past the few that may wait, the link fails.
    auto o = outsider(true);
    for (int i = 0; i < 20; ++i) {
      const std::uint8_t byte = 0;
      iovec iov{const_cast<std::uint8_t*>(&byte), 1};
      rdmakit::detail::OneDescriptor control;
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      control.attach(m, good.get());
      if (::sendmsg(o->raw.get(), &m, MSG_NOSIGNAL) != 1) break;  // (the link failed: its end is shut)
      p.progress_for(1ms);
    }
    refused(*o, "more descriptors than SHARE frames");
  }
  {
    // Shared properly: frames inside it are served, frames naming another range or past its end
    // are refused and touch nothing.
    auto o = outsider(true);
    shm::Mapping mine(good.get(), size, "the test's view");
    std::memset(mine.data(), 0x3c, size);
    share(*o, 7, size, good.get());
    std::vector<std::uint8_t> b(1 << 20, 0);
    const RemoteRegion w = o->bind(p, b.data(), b.size());
    soft::Frame f;
    f.op = static_cast<std::uint8_t>(soft::FrameOp::write_map);
    f.raddr = w.addr;
    f.rkey = w.rkey;
    f.id = 1;
    f.length = 4096;
    f.arg0 = 7;
    f.arg1 = 4096;
    EXPECT_EQ(o->ask(p, f), soft::FrameStatus::ok);
    EXPECT_EQ(b[0], 0x3c);
    EXPECT_EQ(o->qp->crossing()->peer_shares(), 1u);
    std::memset(b.data(), 0, 8192);
    f.id = 2;
    f.arg0 = 8;  // never shared
    EXPECT_EQ(o->ask(p, f), soft::FrameStatus::invalid);
    f.id = 3;
    f.arg0 = 7;
    f.arg1 = size - 4095;  // one byte past its end
    EXPECT_EQ(o->ask(p, f), soft::FrameStatus::invalid);
    f.id = 4;
    f.arg1 = ~std::uint64_t{0} - 100;  // an offset whose sum with the length wraps
    EXPECT_EQ(o->ask(p, f), soft::FrameStatus::invalid);
    EXPECT_EQ(b[0], 0);
    // READ_MAP past its end: nothing of the window is copied out.
    std::memset(b.data(), 0x11, 8192);
    f.op = static_cast<std::uint8_t>(soft::FrameOp::read_map);
    f.id = 5;
    f.arg1 = size - 100;
    EXPECT_EQ(o->ask(p, f), soft::FrameStatus::invalid);
    EXPECT_EQ(mine.data()[size - 1], 0x3c);
    f.id = 6;
    f.arg1 = 0;
    EXPECT_EQ(o->ask(p, f), soft::FrameStatus::ok);
    EXPECT_EQ(mine.data()[4095], 0x11);
    EXPECT_TRUE(o->fault.empty()) << o->fault;
  }
}

// --- the ring: what a target takes from a peer that lies ----------------------------------------

struct RingPair {
  RingPair() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    mine = Fd(sv[0]);
    theirs = Fd(sv[1]);
  }
  // Sends one byte with `fd` (or none), as a lying initiator would.
  void send_fd(int fd, char tag = 'R') const {
    shm::send_with_descriptor(mine.get(), tag, fd, rdmakit::detail::deadline_in(1s), nullptr);
  }
  std::string refusal() const {
    try {
      (void)shm::Ring::receive(theirs.get(), rdmakit::detail::deadline_in(300ms), nullptr);
    } catch (const rdmakit::Error& e) {
      return e.what();
    }
    return "";
  }
  Fd mine, theirs;
};

TEST(ShmRing, ATargetTakesOnlyASealedMemfdOfASizeItAccepts) {
  {
    RingPair p;
    auto ring = shm::Ring::create();
    ring->send(p.mine.get(), rdmakit::detail::deadline_in(1s), nullptr);
    auto got = shm::Ring::receive(p.theirs.get(), rdmakit::detail::deadline_in(1s), nullptr);
    ASSERT_EQ(got->size(), ring->size());
    ring->data()[12345] = 0x5c;  // one memory, two mappings
    EXPECT_EQ(got->data()[12345], 0x5c);
  }
  {
    RingPair p;  // not sealed: the initiator could shrink it under the target, which would fault
    Fd fd(::memfd_create("plain", MFD_CLOEXEC));
    ASSERT_EQ(::ftruncate(fd.get(), 4 << 20), 0);
    p.send_fd(fd.get());
    EXPECT_NE(p.refusal().find("not a memfd sealed"), std::string::npos) << p.refusal();
  }
  {
    RingPair p;  // a pipe is no ring
    int pipes[2];
    ASSERT_EQ(::pipe(pipes), 0);
    Fd r(pipes[0]), w(pipes[1]);
    p.send_fd(r.get());
    EXPECT_NE(p.refusal().find("not a memfd sealed"), std::string::npos);
  }
  {
    RingPair p;  // sealed, but larger than a target maps
    Fd fd(::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    ASSERT_EQ(::ftruncate(fd.get(), static_cast<off_t>(shm::kRingMax) + 4096), 0);
    ASSERT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
    p.send_fd(fd.get());
    EXPECT_NE(p.refusal().find("bytes"), std::string::npos) << p.refusal();
  }
  if (Fd fd(::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB)); fd) {
    // On hugetlbfs: sealed the same, but a punched hole gives its pages back to a pool another
    // process may drain, and the target's next touch would fault.
    RingPair p;
    if (::ftruncate(fd.get(), 4 << 20) == 0 && ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) == 0) {
      p.send_fd(fd.get());
      EXPECT_NE(p.refusal().find("not a memfd sealed"), std::string::npos) << p.refusal();
    }
  }
  {
    RingPair p;  // sealed, but smaller than one frame's chunk
    Fd fd(::memfd_create("small", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    ASSERT_EQ(::ftruncate(fd.get(), 4096), 0);
    ASSERT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
    p.send_fd(fd.get());
    EXPECT_NE(p.refusal().find("4096 bytes"), std::string::npos) << p.refusal();
  }
  {
    RingPair p;  // sealed against writes too: it cannot be mapped to write, and says so
    Fd fd(::memfd_create("ro", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    ASSERT_EQ(::ftruncate(fd.get(), 4 << 20), 0);
    ASSERT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_WRITE), 0);
    p.send_fd(fd.get());
    EXPECT_NE(p.refusal().find("mmap"), std::string::npos) << p.refusal();
  }
  {
    RingPair p;  // the byte without a descriptor, then nothing (the deadline is the handshake's)
    p.send_fd(-1);
    EXPECT_NE(p.refusal().find("did not start with its shm ring"), std::string::npos);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_NE(p.refusal().find("did not come by the handshake's deadline"), std::string::npos);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  }
}

// A ring frame that points outside the ring, or comes to a side that serves no ring, is refused
// as a malformed request and touches nothing; one inside it copies between ring and window.
TEST(ShmRing, AFrameOutsideTheRingIsRefusedAndTouchesNothing) {
  Pair p(1, Mode::tcp);
  Outsider o(p, true);
  std::vector<std::uint8_t> b(1 << 20, 0);
  const RemoteRegion seg = o.bind(p, b.data(), b.size());
  soft::Frame f;
  f.op = static_cast<std::uint8_t>(soft::FrameOp::write_ring);
  f.raddr = seg.addr;
  f.rkey = seg.rkey;
  const std::size_t size = o.ring->size();
  // Inside: the ring's bytes land in the window.
  std::memset(o.ring->data() + 4096, 0x3c, 4096);
  f.id = 1;
  f.length = 4096;
  f.arg0 = 4096;
  EXPECT_EQ(o.ask(p, f), soft::FrameStatus::ok);
  EXPECT_EQ(b[0], 0x3c);
  EXPECT_EQ(b[4095], 0x3c);
  // Past the ring's end, by one byte and by far (an offset whose sum with the length wraps): the
  // ring's bytes there are a pattern, and not one lands in the window.
  std::memset(b.data(), 0, 8192);
  std::memset(o.ring->data() + size - 8192, 0x77, 8192);
  f.id = 2;
  f.arg0 = size - 4095;
  EXPECT_EQ(o.ask(p, f), soft::FrameStatus::invalid);
  EXPECT_EQ(b[0], 0);
  EXPECT_EQ(b[4094], 0);
  f.id = 3;
  f.arg0 = ~std::uint64_t{0} - 100;
  EXPECT_EQ(o.ask(p, f), soft::FrameStatus::invalid);
  EXPECT_EQ(b[0], 0);
  // A READ_RING the same: nothing of the window is copied past the ring's end (the window's
  // bytes are a pattern, the ring's last page another, which stays).
  std::memset(b.data(), 0x11, 8192);
  f.op = static_cast<std::uint8_t>(soft::FrameOp::read_ring);
  f.id = 4;
  f.arg0 = size - 100;
  EXPECT_EQ(o.ask(p, f), soft::FrameStatus::invalid);
  EXPECT_EQ(o.ring->data()[size - 1], 0x77);
  // Inside, it is copied: the window's pattern into the ring.
  f.id = 5;
  f.arg0 = 0;
  EXPECT_EQ(o.ask(p, f), soft::FrameStatus::ok);
  EXPECT_EQ(o.ring->data()[4095], 0x11);
  EXPECT_TRUE(o.fault.empty()) << o.fault;
  // A side with no ring (a tcp link's) refuses ring frames whatever their offset.
  Outsider plain(p);
  const RemoteRegion seg2 = plain.bind(p, b.data(), b.size());
  std::memset(b.data(), 0, 8192);
  f.op = static_cast<std::uint8_t>(soft::FrameOp::write_ring);
  f.rkey = seg2.rkey;
  f.id = 1;
  f.arg0 = 0;
  EXPECT_EQ(plain.ask(p, f), soft::FrameStatus::invalid);
  EXPECT_EQ(b[0], 0);
}

// The ring's bookkeeping over many laps: 1-byte writes put its tail off any chunk boundary, then
// writes and reads of every size (frames skip the ring's end where they do not fit, and wait for
// room when it is full), atomics between them on the same stream; every byte checked.
TEST(ShmRing, ManyLapsOfMixedSizesAndAtomicsLandIntact) {
  Pair p(1, Mode::ring);
  const RemoteRegion seg = p.bind(0, 4 << 20, Access::remote_read | Access::remote_write | Access::remote_atomic);
  p.dpa.set_remote({seg}, true);
  const LocalSlice all = p.a_region->local();
  std::uint64_t id = 1;
  const auto done = [&](std::uint64_t want) {
    const Completion c = p.next(p.dpa);
    ASSERT_TRUE(c.ok()) << c.describe() << " " << p.a_fault << p.b_fault;
    EXPECT_EQ(c.wr_id, want);
  };
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(static_cast<std::size_t>(k), 1), seg, 3 << 20, 0, 0, 0, id).ok()));
    done(id++);
  }
  std::uint64_t word = 0;
  std::memcpy(p.b_mem.data() + (4 << 20) - 8, &word, 8);
  std::size_t moved = 0;
  for (std::uint32_t len : {1000000u, 3u << 20, 262144u, 262145u, 77777u, 2u << 20, 4096u}) {
    // A write of `len` from a moving place, an atomic, then the bytes read back elsewhere.
    const std::size_t from = (moved * 7) % (1 << 20);
    ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(from, len), seg, 0, 0, 0, 0, id).ok()));
    const std::uint64_t w = id++;
    const auto posted = p.dpa.post_one<Opcode::fetch_add>(all.subslice(7 << 20, 8), seg, (4 << 20) - 8, 0, 1, 0, id);
    ASSERT_TRUE(posted.ok()) << posted.describe();
    const std::uint64_t a = id++;
    done(w);
    done(a);
    EXPECT_EQ(std::memcmp(p.b_mem.data(), p.a_mem.data() + from, len), 0) << "write of " << len;
    std::memset(p.a_mem.data() + (4 << 20), 0, len);
    ASSERT_TRUE((p.dpa.post_one<Opcode::read>(all.subslice(4 << 20, len), seg, 0, 0, 0, 0, id).ok()));
    done(id++);
    EXPECT_EQ(std::memcmp(p.a_mem.data() + (4 << 20), p.b_mem.data(), len), 0) << "read of " << len;
    moved += len;
  }
  std::memcpy(&word, p.b_mem.data() + (4 << 20) - 8, 8);
  EXPECT_EQ(word, 7u);  // every atomic once
  // Two 3 MiB writes at once: more than the ring holds, so the second waits for the first's
  // answers to free room, then goes on.
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(1, 3 << 20), seg, 0, 0, 0, 0, id).ok()));
  ASSERT_TRUE((p.dpa.post_one<Opcode::write>(all.subslice(12345, 3 << 20), seg, 0, 0, 0, 0, id + 1).ok()));
  done(id);
  done(id + 1);
  EXPECT_EQ(std::memcmp(p.b_mem.data(), p.a_mem.data() + 12345, 3 << 20), 0);
  static_assert((6u << 20) > shm::kRingBytes, "the two writes must overfill the ring");
}

// Through the ring, a requester that gave up on a stopped peer has its completion at the stall
// bound: no wait for the peer to close (it reaches none of this process's buffers).
TEST(ShmRing, ARequesterThatGaveUpCompletesAtTheStallBound) {
  Pair p(1, Mode::ring, 200ms);
  const RemoteRegion seg = p.bind(0, 8192, Access::remote_read);
  p.dpa.set_remote({seg}, false);
  const LocalSlice all = p.a_region->local();
  ASSERT_TRUE((p.dpa.post_one<Opcode::read>(all.subslice(0, 64), seg, 0, 0, 0, 0, 1).ok()));
  const auto t0 = std::chrono::steady_clock::now();
  Completion c;
  while (std::chrono::steady_clock::now() - t0 < 3s && p.dpa.poll({&c, 1}) == 0) p.cqa.progress();  // B stopped
  EXPECT_EQ(c.status, IBV_WC_RETRY_EXC_ERR) << c.describe();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 800ms);
}

}  // namespace
