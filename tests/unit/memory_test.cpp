// SPDX-License-Identifier: Apache-2.0
// Memory providers that need no RDMA device to judge: what this host can provide.
#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "rdmakit/error.hpp"
#include "rdmakit/memory.hpp"

namespace {

using rdmakit::MemoryKind;

std::string error_of(const rdmakit::MemorySpec& spec, std::size_t bytes) {
  try {
    rdmakit::check_memory(spec, bytes);
  } catch (const rdmakit::Error& e) {
    return e.what();
  }
  return {};
}

TEST(Memory, KindsParseAndPrint) {
  for (auto k : {MemoryKind::host, MemoryKind::hugepage, MemoryKind::cuda, MemoryKind::cuda_host, MemoryKind::dmabuf}) {
    EXPECT_EQ(rdmakit::parse_memory_kind(rdmakit::to_string(k)), k);
  }
  EXPECT_EQ(rdmakit::to_string(MemoryKind::cuda_host), std::string("cuda-host"));
  EXPECT_FALSE(rdmakit::parse_memory_kind("gpu").has_value());
}

TEST(Memory, CudaWithoutAGpuSaysNoCudaDevice) {
  const std::string cuda = error_of({MemoryKind::cuda, 0, -1, 0}, 4096);
  if (cuda.empty()) GTEST_SKIP() << "a CUDA device is present here: the GPU paths run instead";
  EXPECT_NE(cuda.find("no CUDA device"), std::string::npos) << cuda;
  const std::string host = error_of({MemoryKind::cuda_host, 0, -1, 0}, 4096);
  EXPECT_NE(host.find("no CUDA device"), std::string::npos) << host;
}

TEST(Memory, HugePagesNotReservedIsSaid) {
  std::ifstream f("/proc/sys/vm/nr_hugepages");
  long reserved = 0;
  f >> reserved;
  const std::string e = error_of({MemoryKind::hugepage, 0, -1, 0}, 1u << 30);  // 512 pages
  if (reserved >= 512) GTEST_SKIP() << "this host has 512+ huge pages reserved";
  EXPECT_NE(e.find("free 2 MiB pages"), std::string::npos) << e;
  EXPECT_NE(e.find("nr_hugepages"), std::string::npos) << e;
}

TEST(Memory, ABadDmabufFdIsSaid) {
  EXPECT_NE(error_of({MemoryKind::dmabuf, 0, 9999, 0}, 4096).find("fd 9999 is not open"), std::string::npos);
  EXPECT_TRUE(error_of({MemoryKind::host, 0, -1, 0}, 4096).empty());
}

}  // namespace
