// SPDX-License-Identifier: Apache-2.0
#pragma once
// A one-way "stop now" for blocking setup steps (a connect being retried, a handshake waiting for
// a silent peer): once requested, every wait that was given it ends at once with ECANCELED
// instead of running to its deadline. An engine or listener being destroyed requests it, so its
// destructor does not wait out handshake_timeout for a peer that is down.
// Thread-safe: request() from any thread, while others wait on fd() or check requested().

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {

class Stop {
 public:
  Stop() noexcept : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  Stop(const Stop&) = delete;
  Stop& operator=(const Stop&) = delete;
  ~Stop() {
    if (fd_ >= 0) ::close(fd_);
  }
  /// Stays requested: the eventfd is never read, so it stays readable for every waiter.
  void request() noexcept {
    requested_.store(true, std::memory_order_release);
    const std::uint64_t one = 1;
    if (fd_ >= 0) (void)!::write(fd_, &one, sizeof one);
  }
  [[nodiscard]] bool requested() const noexcept { return requested_.load(std::memory_order_acquire); }
  /// Readable once requested; -1 when no eventfd could be made (waits then check requested()
  /// between slices of at most 100 ms).
  [[nodiscard]] int fd() const noexcept { return fd_; }

 private:
  int fd_;
  std::atomic<bool> requested_{false};
};

/// What a wait that a Stop ended throws: `what` is the step it was in.
inline Error stopped_error(const char* what) {
  return Error(what, ECANCELED, "stopped before the deadline", "the engine or listener doing it is shutting down");
}

}  // namespace rdmakit::detail
