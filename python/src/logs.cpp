#include "logs.hpp"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <new>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace rdmakit::python {
namespace {

// Bounded: a process that never drains it (no pump thread) keeps its memory flat.
constexpr std::size_t kMaxLines = 10000;

struct LogQueue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::string> lines;
  std::size_t dropped = 0;
  bool stopping = false;  // the interpreter exits: a waiting call returns at once
};

// One per process, as the interpreter is; never destroyed, so a worker thread that logs while
// the interpreter exits finds it still there. A forked child gets a fresh one: another thread
// may have held the old one's mutex at the fork, and its waiters are not in the child.
std::atomic<LogQueue*> the_queue{nullptr};

LogQueue& queue() {
  LogQueue* q = the_queue.load(std::memory_order_acquire);
  if (q == nullptr) {
    auto* fresh = new LogQueue();
    if (the_queue.compare_exchange_strong(q, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread made it first: q is that one
  }
  return *q;
}

void in_child() noexcept { the_queue.store(new (std::nothrow) LogQueue(), std::memory_order_release); }

}  // namespace

std::function<void(std::string_view)> python_log() {
  return [](std::string_view line) {
    LogQueue& q = queue();
    {
      std::lock_guard lock(q.m);
      if (q.stopping) {
        // After the exit hook drained the queue (an engine closed during finalization): as the
        // library says it without Python.
        std::fprintf(stderr, "rdmakit: %.*s\n", static_cast<int>(line.size()), line.data());
        return;
      }
      if (q.lines.size() >= kMaxLines) {
        ++q.dropped;
        return;
      }
      q.lines.emplace_back(line);
    }
    q.cv.notify_one();
  };
}

void start_log_pump() { pybind11::module_::import("rdmakit").attr("_start_log_pump")(); }

void bind_logs(pybind11::module_& m) {
  static const bool registered = ::pthread_atfork(nullptr, nullptr, in_child) == 0;
  (void)registered;
  m.def(
      "_log_lines",
      [](double timeout) {
        std::vector<std::string> out;
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
        }
        pybind11::list l;
        for (const auto& s : out) l.append(pybind11::str(s));
        return l;
      },
      pybind11::arg("timeout"), "The library's log lines queued since the last call (waits up to timeout s).");
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
