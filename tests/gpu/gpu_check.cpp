// SPDX-License-Identifier: Apache-2.0
// Checks rdmakit's CUDA paths end to end on a machine with an NVIDIA GPU, and prints one verdict
// per path: PASS, FAIL (with what went wrong) or SKIP (with why it could not run here).
//   rdmakit_gpu_check [GPU]          (tests/gpu/run builds and runs it)
// Paths: the driver; device memory allocated zeroed; context handling across threads (the memory
// is used from a thread that did not allocate it, and no thread's current context changes);
// dma-buf export of a length that is not a whole number of pages; pinned host memory; staging
// copies byte-exact; caller-owned GPU memory (a framework's tensor) told from host memory, its
// allocation found, and the pages around a sub-range exported as one dma-buf; an engine
// registering caller-owned GPU memory (through each RDMA device where there is one, with the path
// each took); and, where an RDMA device exists, registration of GPU memory through it with an
// RDMA WRITE into it and a READ back.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "engine/locality.hpp"
#include "memory/cuda.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/device.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::detail::CudaMemory;

int failures = 0;

void verdict(const char* path, const char* v, const std::string& detail) {
  std::printf("%-26s %-4s %s\n", path, v, detail.c_str());
  std::fflush(stdout);
  if (std::strcmp(v, "FAIL") == 0) ++failures;
}

// Runs one check: PASS unless it throws or returns a complaint.
void check(const char* path, const std::function<std::string()>& f) {
  try {
    const std::string complaint = f();
    verdict(path, complaint.empty() ? "PASS" : "FAIL", complaint);
  } catch (const std::exception& e) {
    verdict(path, "FAIL", e.what());
  }
}

// The caller-side view of the driver's per-thread current context (cuCtxGetCurrent).
void* current_context() {
  static auto get = [] {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib == nullptr ? nullptr : reinterpret_cast<int (*)(void**)>(::dlsym(lib, "cuCtxGetCurrent"));
  }();
  void* ctx = reinterpret_cast<void*>(-1);
  if (get != nullptr) get(&ctx);
  return ctx;
}

std::vector<std::uint8_t> pattern(std::size_t n, std::uint8_t seed) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint8_t>(seed + i * 7 + (i >> 9));
  return v;
}

std::string rdma_check(int gpu) {
  const auto devices = rdmakit::list_devices();
  if (devices.empty()) return "skip: no RDMA device (and rdma_rxe could not be loaded)";
  constexpr std::size_t kLen = (1u << 20) + 4096 * 3;
  rdmakit::ConnectionConfig cfg;
  cfg.log = [](std::string_view) {};
  const rdmakit::Access all = rdmakit::Access::local_write | rdmakit::Access::remote_read |
                              rdmakit::Access::remote_write;
  rdmakit::Listener listener("127.0.0.1:0", cfg, [&](rdmakit::Connection& c) {
    c.advertise(c.allocate_memory(kLen, all, {rdmakit::MemoryKind::cuda, gpu, -1, 0}));
  });
  rdmakit::Connection client = rdmakit::Connection::connect(
      "127.0.0.1:" + std::to_string(listener.port()), cfg,
      [&](rdmakit::Connection& c) { (void)c.allocate_memory(2 * kLen, all); });
  auto server = listener.accept(10s);
  if (!server) return "the server side did not connect";
  const rdmakit::MemoryRegion& gpu_region = server->memory(0);
  std::printf("  GPU region registered by: %s\n  why: %s\n", rdmakit::to_string(gpu_region.path()),
              gpu_region.path_detail().c_str());
  auto* mine = static_cast<std::uint8_t*>(client.memory(0).data());
  const auto bytes = pattern(kLen, 0x3c);
  std::memcpy(mine, bytes.data(), kLen);
  if (!client.post_write(client.memory(0).local().subslice(0, kLen), client.remote_regions()[0], 0, 1).ok()) {
    return "post_write refused";
  }
  const auto w = client.wait(10s);
  if (w.status != rdmakit::WaitStatus::completed || !w.completion.ok()) return "WRITE: " + w.completion.describe();
  // On the bounce path the bytes reach the GPU by stage_out; prove they did by clearing the
  // bounce buffer and staging them back in before the READ.
  gpu_region.stage_out(0, kLen);
  if (gpu_region.path() == rdmakit::RegistrationPath::bounce) std::memset(gpu_region.data(), 0, kLen);
  gpu_region.stage_in(0, kLen);
  if (!client.post_read(client.memory(0).local().subslice(kLen, kLen), client.remote_regions()[0], 0, 2).ok()) {
    return "post_read refused";
  }
  const auto r = client.wait(10s);
  if (r.status != rdmakit::WaitStatus::completed || !r.completion.ok()) return "READ: " + r.completion.describe();
  if (std::memcmp(mine + kLen, bytes.data(), kLen) != 0) return "the bytes read back differ from those written";
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  const int gpu = argc > 1 ? std::atoi(argv[1]) : 0;
  try {
    rdmakit::check_memory({rdmakit::MemoryKind::cuda, gpu, -1, 0}, 4096);
    verdict("driver", "PASS", "libcuda.so.1 loaded, device " + std::to_string(gpu) + " present");
  } catch (const rdmakit::Error& e) {
    verdict("driver", "SKIP", e.what());
    std::printf("verdict: no GPU here; nothing else can run\n");
    return 0;
  }

  constexpr std::size_t kOdd = (1u << 20) + 123;  // not a whole number of pages
  check("allocation zeroed", [&]() -> std::string {
    void* before = current_context();
    CudaMemory m = CudaMemory::device(gpu, kOdd);
    if (current_context() != before) return "allocating changed this thread's current context";
    std::vector<std::uint8_t> back(kOdd, 0xee);
    m.to_host(back.data(), 0, kOdd);
    if (std::any_of(back.begin(), back.end(), [](std::uint8_t b) { return b != 0; })) {
      return "fresh device memory is not zeroed";
    }
    return {};
  });

  check("context across threads", [&]() -> std::string {
    std::optional<CudaMemory> m;
    std::thread([&] { m.emplace(CudaMemory::device(gpu, kOdd)); }).join();  // allocated elsewhere
    std::string complaint;
    std::thread([&] {
      try {
        void* before = current_context();
        const auto bytes = pattern(kOdd, 0x11);
        m->from_host(bytes.data(), 0, kOdd);
        std::vector<std::uint8_t> back(kOdd);
        m->to_host(back.data(), 0, kOdd);
        if (back != bytes) complaint = "copies on another thread were not byte-exact";
        if (current_context() != before) complaint = "staging changed the staging thread's current context";
      } catch (const std::exception& e) {
        complaint = std::string("staging on another thread failed: ") + e.what();
      }
    }).join();
    return complaint;
  });

  check("dma-buf export", [&]() -> std::string {
    CudaMemory m = CudaMemory::device(gpu, kOdd);
    std::string why;
    const int fd = m.export_dmabuf(why);
    if (fd < 0) return why;
    std::printf("  exported %zu bytes (rounded up to whole pages) as fd %d\n", kOdd, fd);
    return {};
  });

  check("pinned host memory", [&]() -> std::string {
    CudaMemory m = CudaMemory::host(gpu, kOdd);
    auto* p = static_cast<std::uint8_t*>(m.host_ptr());
    if (p == nullptr) return "no host pointer";
    if (std::any_of(p, p + kOdd, [](std::uint8_t b) { return b != 0; })) return "pinned memory is not zeroed";
    std::memset(p, 0x5a, kOdd);
    return {};
  });

  check("staging byte-exact", [&]() -> std::string {
    CudaMemory m = CudaMemory::device(gpu, kOdd);
    const auto bytes = pattern(kOdd, 0x77);
    // Unaligned offsets and lengths, in pieces.
    for (std::size_t off = 0; off < kOdd; off += 65537) m.from_host(bytes.data(), off, std::min<std::size_t>(65537, kOdd - off));
    std::vector<std::uint8_t> back(kOdd);
    m.to_host(back.data(), 0, kOdd);
    return back == bytes ? std::string{} : "bytes differ after a round trip";
  });

  // Locality ranks GPU memory by the PCIe hops between the GPU and each NIC: it needs the GPU's
  // bus id and its sysfs path.
  check("PCIe locality", [&]() -> std::string {
    const std::string id = rdmakit::detail::cuda_pci_bus_id(gpu);
    if (id.empty()) return "cuDeviceGetPCIBusId gave nothing";
    const std::string path = rdmakit::detail::pci_path_of_bus(id);
    if (path.empty()) return "no /sys/bus/pci/devices/" + id;
    std::printf("  GPU %d is %s at %s\n", gpu, id.c_str(), path.c_str());
    return {};
  });

  // Caller-owned GPU memory: what the engine's register_memory() asks before registering it.
  check("caller memory told apart", [&]() -> std::string {
    CudaMemory m = CudaMemory::device(gpu, kOdd);
    CudaMemory pinned = CudaMemory::host(gpu, 4096);
    std::vector<std::uint8_t> host(4096);
    auto* p = reinterpret_cast<void*>(m.device_ptr() + 5000);
    if (rdmakit::detail::cpu_reaches(p, 4096)) return "the CPU reaches a device pointer";
    if (!rdmakit::detail::cpu_reaches(host.data(), 4096)) return "the CPU does not reach host memory";
    const auto where = rdmakit::detail::cuda_pointer(p);
    if (!where) return "cuPointerGetAttribute did not call a device pointer GPU memory";
    if (where->gpu != gpu) return "the pointer's device is " + std::to_string(where->gpu);
    if (where->base != m.device_ptr() || where->size < kOdd) {
      return fmt::format("its allocation is [{:#x}, +{}), allocated [{:#x}, +{})", where->base, where->size,
                         m.device_ptr(), kOdd);
    }
    if (rdmakit::detail::cuda_pointer(host.data())) return "host memory was called GPU memory";
    if (rdmakit::detail::cuda_pointer(pinned.host_ptr())) return "pinned host memory was called GPU memory";
    return {};
  });

  check("caller dma-buf export", [&]() -> std::string {
    CudaMemory m = CudaMemory::device(gpu, kOdd);
    auto* p = reinterpret_cast<void*>(m.device_ptr() + 3 * 4096 + 100);
    const auto where = rdmakit::detail::cuda_pointer(p);
    if (!where) return "not GPU memory";
    const rdmakit::detail::CudaRangeExport x(p, 65536, *where);
    if (x.fd() < 0) return "export failed: " + x.why();
    if (x.offset() != 100) return "the range starts at " + std::to_string(x.offset()) + " in its dma-buf, not 100";
    std::printf("  [ptr + 12388, +64 KiB) exported as fd %d, at offset %llu\n", x.fd(),
                static_cast<unsigned long long>(x.offset()));
    // Pages past the allocation's end are refused before the driver is asked.
    auto* end = reinterpret_cast<void*>(where->base + where->size - 100);
    const rdmakit::detail::CudaRangeExport past(end, 200, *where);
    if (past.fd() >= 0 || past.why().find("pass its allocation") == std::string::npos) {
      return "a range past the allocation was exported: " + past.why();
    }
    return {};
  });

  check("engine registers it", [&]() -> std::string {
    CudaMemory m = CudaMemory::device(gpu, kOdd);
    rdmakit::EngineConfig cfg;
    cfg.name = "gpu-check";
    cfg.listen = "";
    cfg.link.log = [](std::string_view) {};
    if (rdmakit::list_devices().empty()) cfg.transports = {rdmakit::Transport::tcp};
    rdmakit::Engine e(cfg);
    const rdmakit::Buffer b = e.register_memory(reinterpret_cast<void*>(m.device_ptr()), kOdd);
    for (const auto& path : e.registration(b)) {
      std::printf("  %s: %s (%s)\n", path.device.c_str(), rdmakit::to_string(path.path), path.detail.c_str());
      if (path.path != rdmakit::RegistrationPath::dmabuf_mr && path.path != rdmakit::RegistrationPath::device_mr) {
        return "a device took neither dma-buf nor the device pointer";
      }
    }
    if (e.registration(b).empty()) std::printf("  no RDMA device: registered for the software transports only\n");
    e.unregister_memory(b);
    return {};
  });

  try {
    const std::string r = rdma_check(gpu);
    if (r.rfind("skip: ", 0) == 0) {
      verdict("registration over RDMA", "SKIP", r.substr(6));
    } else {
      verdict("registration over RDMA", r.empty() ? "PASS" : "FAIL", r);
    }
  } catch (const std::exception& e) {
    verdict("registration over RDMA", "FAIL", e.what());
  }
  std::printf("verdict: %s\n", failures == 0 ? "all paths that could run passed" : "FAILURES");
  return failures == 0 ? 0 : 1;
}
