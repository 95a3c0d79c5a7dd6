// SPDX-License-Identifier: Apache-2.0
#include "memory_options.hpp"

#include <CLI/CLI.hpp>

#include <memory>

#include "rdmakit/error.hpp"
#include "vgem.hpp"

namespace rdmakit::tools {

void MemOptions::add_to(CLI::App& app) {
  app.add_option("--mem", mem, "memory to move: host, hugepage, cuda, cuda-host or dmabuf")
      ->check(CLI::IsMember({"host", "hugepage", "cuda", "cuda-host", "dmabuf"}))
      ->capture_default_str();
  app.add_option("--gpu", gpu, "CUDA device for --mem cuda / cuda-host")->capture_default_str();
}

MemoryKind MemOptions::kind() const { return parse_memory_kind(mem).value_or(MemoryKind::host); }

void MemOptions::check(std::size_t bytes) const {
  if (kind() == MemoryKind::dmabuf) {
    VgemBuffer probe(4096);  // an exporter is there
    return;
  }
  check_memory({kind(), gpu, -1, 0}, bytes);
}

const MemoryRegion& MemOptions::allocate(Connection& c, std::size_t bytes, Access access) const {
  if (kind() != MemoryKind::dmabuf) return c.allocate_memory(bytes, access, {kind(), gpu, -1, 0});
  // The region keeps its own dup of the fd and its mapping; the buffer lives while either does.
  VgemBuffer buf(bytes);
  return c.allocate_memory(bytes, access, {MemoryKind::dmabuf, 0, buf.fd(), 0});
}

std::string describe_memory(const MemoryRegion& m) {
  return fmt::format("{} memory, registered by {}{}", to_string(m.kind()), to_string(m.path()),
                     m.path_detail().empty() ? "" : " (" + m.path_detail() + ")");
}

}  // namespace rdmakit::tools
