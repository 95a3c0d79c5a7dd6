// The anchors of bench/compare-transports: an 8-byte ping-pong between two processes of this
// host, over loopback TCP (TCP_NODELAY, blocking reads) or through shared memory (each side spins
// on a word the other writes), one round trip at a time (the round trips' p50 and p99 in
// microseconds); and one thread copying a working set of BYTES with memcpy and with
// process_vm_readv (cross-memory attach, what the shm transport copies with), in GB/s. One JSON
// line each.
//   rdmakit_transport_anchors tcp|shm [ROUND_TRIPS]
//   rdmakit_transport_anchors copy BYTES SECONDS
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
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

int tcp(int n) {
  const int l = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (l < 0 || ::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(l, 1) != 0 ||
      ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    die("listen");
  }
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

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "tcp") return tcp(argc > 2 ? std::atoi(argv[2]) : 20000);
  if (mode == "shm") return shm(argc > 2 ? std::atoi(argv[2]) : 20000);
  if (mode == "copy" && argc > 3) return copy(std::strtoull(argv[2], nullptr, 10), std::atof(argv[3]));
  std::fprintf(stderr, "usage: rdmakit_transport_anchors tcp|shm [ROUND_TRIPS] | copy BYTES SECONDS\n");
  return 2;
}
