// SPDX-License-Identifier: Apache-2.0
#include "logs.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace rdmakit::python {
namespace {

// Bounded: a process that never drains it (no pump thread) keeps its memory flat.
constexpr std::size_t kMaxLines = 10000;

struct LogQueue {
  pid_t owner = ::getpid();
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::string> lines;
  std::size_t dropped = 0;
  bool stopping = false;  // the interpreter exits: a waiting call returns at once, new lines go to stderr
};

// One per process, as the interpreter is; never destroyed, so a worker thread that logs while
// the interpreter exits finds it still there. A forked child makes a fresh one the first time
// it logs (another thread may have held the parent's mutex at the fork, and its waiters are not
// in the child); the parent's stays behind, shared copy-on-write.
std::atomic<LogQueue*> the_queue{nullptr};

LogQueue& queue() {
  LogQueue* q = the_queue.load(std::memory_order_acquire);
  while (q == nullptr || q->owner != ::getpid()) {
    auto* fresh = new LogQueue();
    if (the_queue.compare_exchange_strong(q, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread made it first: q is that one
  }
  return *q;
}

}  // namespace

std::function<void(std::string_view)> python_log() {
  return [](std::string_view line) {
    LogQueue& q = queue();
    bool late = false;
    {
      std::lock_guard lock(q.m);
      if (q.stopping) {
        late = true;
      } else if (q.lines.size() >= kMaxLines) {
        ++q.dropped;
        return;
      } else {
        q.lines.emplace_back(line);
      }
    }
    if (late) {
      // After the exit hook drained the queue (an engine closed during finalization): as the
      // library says it without Python.
      std::fprintf(stderr, "rdmakit: %.*s\n", static_cast<int>(line.size()), line.data());
      return;
    }
    q.cv.notify_one();
  };
}

void start_log_pump() {
  try {
    pybind11::module_::import("rdmakit").attr("_start_log_pump")();
  } catch (const pybind11::error_already_set&) {
    // The package half-imported, imported under another name, or the interpreter exiting: the
    // lines queue, and reach stderr once the exit hook has run.
  }
}

void bind_logs(pybind11::module_& m) {
  m.def(
      "_log_lines",
      [](double timeout) -> std::optional<std::vector<std::string>> {
        std::vector<std::string> out;
        bool stopped = false;
        {
          pybind11::gil_scoped_release nogil;
          LogQueue& q = queue();
          std::unique_lock lock(q.m);
          q.cv.wait_for(lock, std::chrono::duration<double>(timeout),
                        [&] { return !q.lines.empty() || q.dropped > 0 || q.stopping; });
          if (q.dropped > 0) {
            out.push_back(fmt::format("{} log lines were dropped: nothing read them as they came", q.dropped));
            q.dropped = 0;
          }
          out.insert(out.end(), std::make_move_iterator(q.lines.begin()), std::make_move_iterator(q.lines.end()));
          q.lines.clear();
          stopped = q.stopping;
        }
        if (stopped && out.empty()) return std::nullopt;
        return out;
      },
      pybind11::arg("timeout"),
      "The library's log lines queued since the last call (waits up to timeout s); None once "
      "stopped and empty.");
  // At exit, before the interpreter finalizes: the pump thread must not be waiting in here then
  // (a daemon thread that takes the GIL back during finalization is ended by pthread_exit, whose
  // unwinding through a C++ destructor terminates the process).
  m.def(
      "_log_stop",
      [] {
        LogQueue& q = queue();
        {
          std::lock_guard lock(q.m);
          q.stopping = true;
        }
        q.cv.notify_all();
      },
      "Wakes and ends the log pump's wait (the package's atexit hook).");
}

}  // namespace rdmakit::python
