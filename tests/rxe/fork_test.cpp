// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: a process holding an engine forks while its transfers are in flight, as a
// serving process does when it starts a subprocess. The children touch the registered memory
// (their copy of it) or exec a program at once; the parent's every byte, sent and received, is
// checked. On a kernel that leaves registered pages shared copy-on-write with a child (before
// Linux 5.13, without RDMAV_FORK_SAFE), the parent's writes after a fork move its pages away
// from the NIC and these checks fail; on the lab's kernel (6.1, which copies pinned pages for the
// child) it shows that nothing else in the engine minds a fork either.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
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
using rdmakit::Transfer;
using rdmakit::TransferOp;
using lab::at;
using lab::config;
using lab::fill;
using lab::same;
using lab::Target;
using lab::xfer;

}  // namespace

TEST(EngineFork, ChildrenForkedMidTransferChangeNothingInTheParent) {
  RDMAKIT_RDMA_ONLY("it is about pages the NIC has pinned; tcp and shm links pin none");
  constexpr std::size_t kLen = 1 << 20;
  constexpr std::uint64_t kBlock = 64 << 10;
  Target b("b", kLen);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(kLen);
  const Buffer dst = a.allocate_memory(kLen);
  std::atomic<bool> stop{false};
  std::atomic<int> forks{0};
  std::atomic<int> bad_children{0};
  std::atomic<int> fork_errno{0};
  // Forks in a loop: half the children overwrite their copy of both buffers and exit, half exec
  // a program at once (fork + exec, as a subprocess does). Only async-signal-safe calls in them.
  std::thread forker([&] {
    char true_path[] = "/bin/true";
    char* const argv[] = {true_path, nullptr};
    while (!stop.load()) {
      const bool exec = forks.load() % 2 == 1;
      const pid_t pid = ::fork();
      if (pid == 0) {
        if (exec) {
          ::execv(true_path, argv);
          ::_exit(127);
        }
        std::memset(src.addr, 0xEE, kLen);
        std::memset(dst.addr, 0xDD, kLen);
        ::_exit(0);
      }
      if (pid < 0) {
        fork_errno = errno;
        break;
      }
      int status = 0;
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) bad_children.fetch_add(1);
      forks.fetch_add(1);
    }
  });
  // However the loop below ends (an ASSERT returns), the forker stops and is joined first.
  struct Joined {
    std::atomic<bool>& stop;
    std::thread& t;
    ~Joined() {
      stop = true;
      if (t.joinable()) t.join();
    }
  } joined{stop, forker};
  const auto until = std::chrono::steady_clock::now() + 3s;
  int rounds = 0;
  while (std::chrono::steady_clock::now() < until || rounds < 20) {
    // The parent writes its pages after forks (what moves a shared page away from the NIC).
    fill(src.addr, kLen, static_cast<std::uint8_t>(rounds * 7 + 1));
    std::vector<Transfer> writes;
    std::vector<Transfer> reads;
    for (std::uint64_t k = 0; k < kLen / kBlock; ++k) {
      writes.push_back(xfer(TransferOp::write, src, k * kBlock, kBlock, seg, k * kBlock));
      reads.push_back(xfer(TransferOp::read, dst, k * kBlock, kBlock, seg, k * kBlock));
    }
    Batch w = a.submit(writes);
    ASSERT_TRUE(lab::waited(w, 10s));
    ASSERT_EQ(w.failed(), 0u) << w.describe_failures();
    ASSERT_TRUE(same(b.buf.addr, src.addr, kLen)) << "round " << rounds << ": the target got other bytes than sent";
    std::memset(dst.addr, 0, kLen);
    Batch r = a.submit(reads);
    ASSERT_TRUE(lab::waited(r, 10s));
    ASSERT_EQ(r.failed(), 0u) << r.describe_failures();
    ASSERT_TRUE(same(dst.addr, src.addr, kLen)) << "round " << rounds << ": the bytes read did not reach the parent";
    ++rounds;
  }
  stop = true;
  forker.join();
  EXPECT_EQ(fork_errno.load(), 0) << "fork() failed";
  EXPECT_EQ(bad_children.load(), 0);
  EXPECT_GT(forks.load(), 10) << "too few forks overlapped the transfers to show anything";
  std::printf("%d rounds of 1 MiB out and back, %d forks beside them (half of them exec'd /bin/true)\n", rounds,
              forks.load());
}
