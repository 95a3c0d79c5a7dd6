// SPDX-License-Identifier: Apache-2.0
#pragma once
// The library's log lines, on their way to Python's `logging` (logger "rdmakit"). Any thread
// queues a line without touching Python (an engine's worker must never wait for the GIL); a
// Python thread (rdmakit/__init__.py) drains the queue and logs each line.

#include <functional>
#include <string_view>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace rdmakit::python {

/// The ConnectionConfig::log the package gives every engine and connection it makes.
std::function<void(std::string_view)> python_log();

/// Starts the package's log pump thread if it is not running (in this process: a forked child
/// starts its own). Called, with the GIL, as the first engine or connection is made, so that
/// importing rdmakit starts no thread.
void start_log_pump();

/// _rdmakit._log_lines(timeout): the lines queued since the last call, waiting up to `timeout`
/// seconds (the GIL let go) for one.
void bind_logs(pybind11::module_& m);

}  // namespace rdmakit::python
