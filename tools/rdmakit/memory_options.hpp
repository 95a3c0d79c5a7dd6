// SPDX-License-Identifier: Apache-2.0
#pragma once
// --mem and --gpu for the subcommands that move data: which memory rdmakit allocates, and for
// --mem dmabuf a dma-buf to allocate it from.

#include <cstddef>
#include <string>

#include "cli_fwd.hpp"

#include "rdmakit/connection.hpp"
#include "rdmakit/memory.hpp"

namespace rdmakit::tools {

struct MemOptions {
  std::string mem = "host";
  int gpu = 0;

  void add_to(CLI::App& app);
  [[nodiscard]] MemoryKind kind() const;
  /// Throws Error (before anything connects) when this host cannot provide the memory.
  void check(std::size_t bytes) const;
  /// Allocates and registers `bytes` of this memory in `c`. For dmabuf the exporter is vgem,
  /// the kernel's virtual GEM driver (a dumb buffer exported as a PRIME fd): the lab's stand-in
  /// for an accelerator's exporter.
  const MemoryRegion& allocate(Connection& c, std::size_t bytes, Access access) const;
};

/// "memory: dmabuf, a registered host bounce buffer with staging copies (ibv_reg_dmabuf_mr: ...)"
std::string describe_memory(const MemoryRegion& m);

}  // namespace rdmakit::tools
