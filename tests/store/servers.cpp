// SPDX-License-Identifier: Apache-2.0
#include "servers.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <stdexcept>
#include <vector>

#include <fmt/chrono.h>
#include <fmt/format.h>

#include "metadata/store.hpp"

extern char** environ;

namespace rdmakit::test {
namespace {

// Two distinct free ports: both sockets stay bound until both are known, so the kernel cannot
// hand the first one out again as the second (etcd would then fail to bind its peer URL).
std::pair<std::uint16_t, std::uint16_t> free_ports() {
  int fds[2];
  std::uint16_t ports[2];
  for (int i = 0; i < 2; ++i) {
    fds[i] = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fds[i] < 0 || ::bind(fds[i], reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::getsockname(fds[i], reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      throw std::runtime_error("no free port");
    }
    ports[i] = ntohs(a.sin_port);
  }
  ::close(fds[0]);
  ::close(fds[1]);
  return {ports[0], ports[1]};
}

// The last lines of a server's log, for the error that says it did not come up.
std::string log_tail(const std::string& path) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string l; std::getline(in, l);) {
    lines.push_back(std::move(l));
    if (lines.size() > 30) lines.pop_front();
  }
  std::string out;
  for (const auto& l : lines) out += "\n  " + l;
  return out.empty() ? " (empty)" : out;
}

// How long a server may take to answer its first write. Not a claim about the store: in a lab
// VM short of memory a cold etcd (21 MB of binary, read over 9p) once wrote nothing for 30 s.
constexpr std::chrono::seconds kReadyWithin{90};

}  // namespace

StoreServer::StoreServer(Kind kind) : kind_(kind) {
  char tmpl[] = "/tmp/rdmakit-store-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp");
  dir_ = tmpl;
  std::tie(port_, peer_port_) = free_ports();
  start();
}

StoreServer::~StoreServer() {
  kill();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string StoreServer::uri() const {
  return fmt::format("{}://127.0.0.1:{}", kind_ == Kind::redis ? "redis" : "etcd", port_);
}

void StoreServer::kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

void StoreServer::restart_empty() {
  kill();
  std::error_code ec;
  std::filesystem::remove_all(dir_ + "/data", ec);
  start();
}

void StoreServer::start() {
  std::vector<std::string> args;
  if (kind_ == Kind::redis) {
    args = {"redis-server", "--port", std::to_string(port_), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", dir_};
  } else {
    const std::string client = fmt::format("http://127.0.0.1:{}", port_);
    const std::string peer = fmt::format("http://127.0.0.1:{}", peer_port_);
    args = {"etcd", "--name", "t", "--data-dir", dir_ + "/data", "--listen-client-urls", client,
            "--advertise-client-urls", client, "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer, "--initial-cluster", "t=" + peer};
  }
  const std::string log = dir_ + "/server.log";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = posix_spawnp(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw std::runtime_error(fmt::format("cannot start {}: errno {}", args[0], rc));
  // Ready when a write and a read answer (the store's own client, with a short deadline each
  // try): the tests publish at once, and a just-elected etcd can answer reads before its first
  // writes are quick. A server that exited (a port taken meanwhile, a bad flag) is reported at
  // once, with its log.
  auto store = detail::metadata::open_store(detail::metadata::parse_store_uri(uri()));
  const auto began = std::chrono::steady_clock::now();
  const auto until = began + kReadyWithin;
  std::string last_error;
  while (true) {
    try {
      const auto deadline = detail::deadline_in(std::chrono::milliseconds{500});
      store->put("ready?", "yes", detail::metadata::no_lease, deadline);
      store->remove("ready?", deadline);
      return;
    } catch (const Error& e) {
      last_error = e.what();
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error(fmt::format("{} exited (status {:#x}) before answering on port {}; its log:{}",
                                             args[0], status, port_, log_tail(log)));
      }
      if (std::chrono::steady_clock::now() > until) {
        throw std::runtime_error(
            fmt::format("{} did not answer on port {} within {} s (started at {:%T}; the last try: {}); its log:{}",
                        args[0], port_, kReadyWithin.count(), std::chrono::system_clock::now() - (std::chrono::steady_clock::now() - began),
                        last_error, log_tail(log)));
      }
      ::usleep(50'000);
    }
  }
}

FakeServer::FakeServer(std::string answer, bool close_after) {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 16) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    throw std::runtime_error("fake server: cannot listen");
  }
  port_ = ntohs(a.sin_port);
  thread_ = std::thread([this, answer = std::move(answer), close_after] {
    std::vector<int> open;
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      char buf[4096];
      pollfd q{c, POLLIN, 0};
      if (::poll(&q, 1, 2000) > 0) (void)::read(c, buf, sizeof buf);
      (void)::write(c, answer.data(), answer.size());
      if (close_after) {
        ::close(c);
      } else {
        open.push_back(c);
      }
    }
    for (int c : open) ::close(c);
  });
}

FakeServer::~FakeServer() {
  stop_ = true;
  thread_.join();
  ::close(fd_);
}

}  // namespace rdmakit::test
