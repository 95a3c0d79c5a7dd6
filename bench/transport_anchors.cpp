// SPDX-License-Identifier: Apache-2.0
// The anchors of bench/compare-transports: an 8-byte ping-pong between two processes of this
// host, over loopback TCP (TCP_NODELAY, blocking reads) or through shared memory (each side spins
// on a word the other writes), one round trip at a time (the round trips' p50 and p99 in
// microseconds); and one thread copying a working set of BYTES with memcpy and with
// process_vm_readv (cross-memory attach, what the shm transport copies with), in GB/s; and one
// TCP stream over loopback sending a working set of BYTES in sends of CHUNK bytes, with plain
// send() or with MSG_ZEROCOPY (its completions reaped from the error queue as a sender must), in
// GB/s with the CPU seconds per GB of both processes: whether zero-copy sends pay here. One JSON
// line each.
//   rdmakit_transport_anchors tcp|shm [ROUND_TRIPS]
//   rdmakit_transport_anchors copy BYTES SECONDS
//   rdmakit_transport_anchors stream BYTES CHUNK SECONDS copy|zerocopy
#include <time.h>  // before errqueue.h, which uses timespec

#include <linux/errqueue.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

bool full(int fd, void* p, std::size_t n, bool send) {
  auto* b = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = send ? ::send(fd, b, n, MSG_NOSIGNAL) : ::recv(fd, b, n, 0);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

void report(std::vector<double>& us) {
  std::sort(us.begin(), us.end());
  std::printf("{\"p50_us\": %.2f, \"p99_us\": %.2f, \"round_trips\": %zu}\n", us[us.size() / 2],
              us[std::min(us.size() - 1, us.size() * 99 / 100)], us.size());
}

// A listening socket on a free loopback port; `a` is where to connect.
int listen_loopback(sockaddr_in& a) {
  const int l = ::socket(AF_INET, SOCK_STREAM, 0);
  a = sockaddr_in{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (l < 0 || ::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(l, 1) != 0 ||
      ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    die("listen");
  }
  return l;
}

int tcp(int n) {
  sockaddr_in a{};
  const int l = listen_loopback(a);
  const int one = 1;
  const pid_t child = ::fork();
  if (child == 0) {  // the echo side
    const int s = ::accept(l, nullptr, nullptr);
    (void)::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::uint64_t v = 0;
    while (full(s, &v, 8, false) && full(s, &v, 8, true)) {
    }
    std::_Exit(0);
  }
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("connect");
  (void)::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::vector<double> us;
  for (int i = 0; i < n + n / 10; ++i) {
    std::uint64_t v = static_cast<std::uint64_t>(i);
    const auto t0 = Clock::now();
    if (!full(s, &v, 8, true) || !full(s, &v, 8, false)) die("ping");
    if (i >= n / 10) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  ::close(s);
  ::waitpid(child, nullptr, 0);
  report(us);
  return 0;
}

int shm(int n) {
  // Two words, a cache line apart: the ping and the pong.
  void* m = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) die("mmap");
  auto* ping = new (m) std::atomic<std::uint64_t>(0);
  auto* pong = new (static_cast<char*>(m) + 64) std::atomic<std::uint64_t>(0);
  const auto total = static_cast<std::uint64_t>(n + n / 10);
  const pid_t child = ::fork();
  if (child == 0) {
    for (std::uint64_t i = 1; i <= total; ++i) {
      while (ping->load(std::memory_order_acquire) != i) {
      }
      pong->store(i, std::memory_order_release);
    }
    std::_Exit(0);
  }
  std::vector<double> us;
  for (std::uint64_t i = 1; i <= total; ++i) {
    const auto t0 = Clock::now();
    ping->store(i, std::memory_order_release);
    while (pong->load(std::memory_order_acquire) != i) {
    }
    if (i > total - static_cast<std::uint64_t>(n)) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  ::waitpid(child, nullptr, 0);
  report(us);
  return 0;
}

int copy(std::size_t bytes, double seconds) {
  std::vector<char> src(bytes, 1), dst(bytes, 2);
  const auto rate = [&](auto&& once) {
    once();  // pages touched, caches as they will be
    std::size_t moved = 0;
    const auto t0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) moved += once();
    return static_cast<double>(moved) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
  };
  const double mem = rate([&] {
    std::memcpy(dst.data(), src.data(), bytes);
    return bytes;
  });
  const double cma = rate([&] {
    iovec to{dst.data(), bytes}, from{src.data(), bytes};
    const ssize_t k = ::process_vm_readv(::getpid(), &to, 1, &from, 1, 0);
    if (k < 0) die("process_vm_readv");
    return static_cast<std::size_t>(k);
  });
  std::printf("{\"memcpy_gbps\": %.3f, \"cma_gbps\": %.3f, \"bytes\": %zu}\n", mem, cma, bytes);
  return 0;
}

double cpu_of(int who) {
  rusage u{};
  ::getrusage(who, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

int stream(std::size_t bytes, std::size_t chunk, double seconds, bool zerocopy) {
  sockaddr_in a{};
  const int l = listen_loopback(a);
  const pid_t child = ::fork();
  if (child == 0) {  // the receiver: into a working set of its own, as a target's memory
    const int s = ::accept(l, nullptr, nullptr);
    std::vector<char> into(bytes);
    std::size_t at = 0;
    for (;;) {
      const ssize_t k = ::recv(s, into.data() + at, std::min(chunk, bytes - at), 0);
      if (k <= 0) break;
      at = (at + static_cast<std::size_t>(k)) % bytes;
    }
    std::_Exit(0);
  }
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) die("connect");
  const int one = 1;
  if (zerocopy && ::setsockopt(s, SOL_SOCKET, SO_ZEROCOPY, &one, sizeof one) != 0) die("SO_ZEROCOPY");
  std::vector<char> from(bytes, 1);
  std::uint64_t sent_calls = 0, reaped = 0, copied = 0;
  // Reaps what completed: a zero-copy send's pages may be reused only after its notification.
  const auto reap = [&](bool wait) {
    for (;;) {
      if (wait) {
        pollfd p{s, 0, 100};
        (void)::poll(&p, 1, 100);
      }
      char control[256];
      msghdr m{};
      m.msg_control = control;
      m.msg_controllen = sizeof control;
      if (::recvmsg(s, &m, MSG_ERRQUEUE | MSG_DONTWAIT) < 0) return;
      for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
        sock_extended_err e{};
        std::memcpy(&e, CMSG_DATA(c), sizeof e);
        if (e.ee_origin != SO_EE_ORIGIN_ZEROCOPY) continue;
        const std::uint64_t n = e.ee_data - e.ee_info + 1;  // the sends [ee_info, ee_data] completed
        reaped += n;
        if ((e.ee_code & SO_EE_CODE_ZEROCOPY_COPIED) != 0) copied += n;
      }
    }
  };
  std::size_t moved = 0, at = 0;
  const double c0 = cpu_of(RUSAGE_SELF);
  const auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
    const ssize_t k = ::send(s, from.data() + at, std::min(chunk, bytes - at), zerocopy ? MSG_ZEROCOPY : 0);
    if (k < 0) {
      if (errno == ENOBUFS) {  // the optmem limit of outstanding zero-copy sends
        reap(true);
        continue;
      }
      die("send");
    }
    moved += static_cast<std::size_t>(k);
    at = (at + static_cast<std::size_t>(k)) % bytes;
    if (zerocopy) {
      ++sent_calls;
      // A sender must not write memory a send still references: at most 64 unreaped, as a
      // real one bounds what is in flight.
      reap(sent_calls - reaped > 64);
    }
  }
  while (zerocopy && reaped < sent_calls && std::chrono::duration<double>(Clock::now() - t0).count() < seconds + 5) reap(true);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  const double sender = cpu_of(RUSAGE_SELF) - c0;
  ::shutdown(s, SHUT_WR);
  ::close(s);
  ::waitpid(child, nullptr, 0);
  const double receiver = cpu_of(RUSAGE_CHILDREN);
  const double gb = static_cast<double>(moved) / 1e9;
  std::printf("{\"gbps\": %.3f, \"cpu_s_per_gb\": %.3f, \"zerocopy\": %s, \"copied_by_kernel\": %llu, \"sends\": %llu}\n",
              gb / took, (sender + receiver) / gb, zerocopy ? "true" : "false", static_cast<unsigned long long>(copied),
              static_cast<unsigned long long>(sent_calls));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "tcp") return tcp(argc > 2 ? std::atoi(argv[2]) : 20000);
  if (mode == "shm") return shm(argc > 2 ? std::atoi(argv[2]) : 20000);
  if (mode == "copy" && argc > 3) return copy(std::strtoull(argv[2], nullptr, 10), std::atof(argv[3]));
  if (mode == "stream" && argc > 5) {
    return stream(std::strtoull(argv[2], nullptr, 10), std::strtoull(argv[3], nullptr, 10), std::atof(argv[4]),
                  std::string(argv[5]) == "zerocopy");
  }
  std::fprintf(stderr,
               "usage: rdmakit_transport_anchors tcp|shm [ROUND_TRIPS] | copy BYTES SECONDS | "
               "stream BYTES CHUNK SECONDS copy|zerocopy\n");
  return 2;
}
