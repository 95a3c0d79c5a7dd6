// SPDX-License-Identifier: Apache-2.0
#pragma once
// What a thread that polls does between two looks: tells the core it spins (x86 `pause`, Arm
// `yield`), which lets its hyperthread sibling run and saves the pipeline flush at the exit.

namespace rdmakit::detail {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace rdmakit::detail
