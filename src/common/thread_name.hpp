// SPDX-License-Identifier: Apache-2.0
#pragma once
// Names the library's threads as `top -H`, gdb and /proc/PID/task/*/comm show them.

#include <pthread.h>

#include <cstdio>

namespace rdmakit::detail {

/// Names the calling thread (the kernel keeps 15 bytes: "rdmakit-w12" fits).
inline void name_this_thread(const char* name) noexcept { (void)::pthread_setname_np(::pthread_self(), name); }

/// "rdmakit-w<index>": a worker's.
inline void name_worker_thread(unsigned index) noexcept {
  char name[16];
  std::snprintf(name, sizeof name, "rdmakit-w%u", index);
  name_this_thread(name);
}

}  // namespace rdmakit::detail
