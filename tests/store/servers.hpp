// SPDX-License-Identifier: Apache-2.0
#pragma once
// Real store servers for the store tests (redis-server, etcd from Debian), started on free ports
// of 127.0.0.1 with their data in a scratch directory, and a fake server that answers garbage.

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

namespace rdmakit::test {

class StoreServer {
 public:
  enum class Kind { redis, etcd };
  explicit StoreServer(Kind kind);
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  ~StoreServer();

  [[nodiscard]] std::string uri() const;
  [[nodiscard]] Kind kind() const noexcept { return kind_; }
  /// SIGKILL, and reaped: the store is gone at once.
  void kill();
  /// Starts it again on the same port, empty (etcd's data directory is wiped; Redis keeps
  /// nothing on disk here), and waits until it answers.
  void restart_empty();

 private:
  void start();
  Kind kind_;
  std::string dir_;
  std::uint16_t port_ = 0;
  std::uint16_t peer_port_ = 0;  // etcd's peer URL
  pid_t pid_ = -1;
};

/// A TCP server on 127.0.0.1 that answers every connection by sending `answer` once it has read
/// something, then closing it (close_after) or keeping it open without another byte.
class FakeServer {
 public:
  FakeServer(std::string answer, bool close_after);
  FakeServer(const FakeServer&) = delete;
  FakeServer& operator=(const FakeServer&) = delete;
  ~FakeServer();
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

 private:
  int fd_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace rdmakit::test
