// SPDX-License-Identifier: Apache-2.0
#pragma once
// A man in the middle for the bootstrap: listens on a port, and for the one client that connects
// opens its own connection to the real server and relays the bytes, frame by frame, in both
// directions. It records everything it sees, and a test may rewrite the client's frames on the
// way (drop, repeat, reorder, alter, inject). It never holds the key.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rdmakit/wire.hpp"

namespace lab {

using Frame = std::vector<std::uint8_t>;

class Relay {
 public:
  /// Given the client's `index`-th frame (0: its AUTH_CHALLENGE), returns the frames to pass on
  /// to the server instead (none, the same, several, altered). Default: the frame itself.
  using Rewrite = std::function<std::vector<Frame>(std::size_t index, const Frame& frame)>;

  Relay(std::uint16_t server_port, Rewrite rewrite = {}) : server_port_(server_port), rewrite_(std::move(rewrite)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    const int on = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(listen_fd_, 4);
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { run(); });
  }
  ~Relay() {
    stop_.store(true);
    thread_.join();
    ::close(listen_fd_);
  }
  [[nodiscard]] std::uint16_t port() const { return port_; }
  /// Every byte that went from the client to the server and back, in the order seen.
  [[nodiscard]] std::vector<std::uint8_t> captured() {
    std::lock_guard lock(mu_);
    return captured_;
  }
  /// Sends `frame` to the server as if from the client, right away.
  void inject(const Frame& frame) {
    std::lock_guard lock(mu_);
    injected_.push_back(frame);
  }
  /// Ends both connections (as a relay that gives up would).
  void cut() { cut_.store(true); }

 private:
  void record(const std::uint8_t* p, std::size_t n) {
    std::lock_guard lock(mu_);
    captured_.insert(captured_.end(), p, p + n);
  }
  static bool send_all(int fd, const std::uint8_t* p, std::size_t n) {
    while (n > 0) {
      const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
      if (k <= 0) return false;
      p += k;
      n -= static_cast<std::size_t>(k);
    }
    return true;
  }
  void run() {
    pollfd lp{listen_fd_, POLLIN, 0};
    while (!stop_.load() && ::poll(&lp, 1, 50) <= 0) {
    }
    if (stop_.load()) return;
    const int client = ::accept(listen_fd_, nullptr, nullptr);
    const int server = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(server_port_);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(client);
      ::close(server);
      return;
    }
    std::vector<std::uint8_t> from_client;
    std::size_t index = 0;
    pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
    std::uint8_t buf[65536];
    while (!stop_.load() && !cut_.load()) {
      {
        std::lock_guard lock(mu_);
        for (const Frame& f : injected_) {
          if (!send_all(server, f.data(), f.size())) break;
        }
        injected_.clear();
      }
      if (::poll(fds, 2, 20) <= 0) continue;
      if ((fds[1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const ssize_t n = ::recv(server, buf, sizeof buf, 0);
        if (n <= 0) break;
        record(buf, static_cast<std::size_t>(n));
        if (!send_all(client, buf, static_cast<std::size_t>(n))) break;
      }
      if ((fds[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const ssize_t n = ::recv(client, buf, sizeof buf, 0);
        if (n <= 0) break;
        record(buf, static_cast<std::size_t>(n));
        from_client.insert(from_client.end(), buf, buf + n);
        // Whole frames only: header, then the length it names.
        while (from_client.size() >= rdmakit::wire::kHeaderSize) {
          const std::size_t len = (std::size_t{from_client[8]} << 24) | (std::size_t{from_client[9]} << 16) |
                                  (std::size_t{from_client[10]} << 8) | from_client[11];
          if (from_client.size() < rdmakit::wire::kHeaderSize + len) break;
          const Frame f(from_client.begin(), from_client.begin() + static_cast<long>(rdmakit::wire::kHeaderSize + len));
          from_client.erase(from_client.begin(), from_client.begin() + static_cast<long>(f.size()));
          const std::vector<Frame> out = rewrite_ ? rewrite_(index++, f) : std::vector<Frame>{f};
          for (const Frame& o : out) send_all(server, o.data(), o.size());
        }
      }
    }
    ::close(client);
    ::close(server);
  }

  std::uint16_t server_port_;
  Rewrite rewrite_;
  int listen_fd_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cut_{false};
  std::mutex mu_;
  std::vector<std::uint8_t> captured_;
  std::vector<Frame> injected_;
  std::thread thread_;
};

}  // namespace lab
