// SPDX-License-Identifier: Apache-2.0
#pragma once
// A connected data path over the fake provider (fake_verbs.hpp), shared by the data path's unit
// tests (datapath_test.cpp, prepared_test.cpp).
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "datapath/datapath.hpp"
#include "fake_verbs.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit::test {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Completion;
using rdmakit::LocalSlice;
using rdmakit::MemoryRegion;
using rdmakit::Opcode;
using rdmakit::RemoteRegion;
using rdmakit::WaitStatus;
using rdmakit::WorkRequest;
using rdmakit::detail::DataPath;

// Whether the rig's data path posts and polls through the extended interfaces (below), and
// inline-sized requests then by their SGE.
inline bool extended() {
  const char* e = std::getenv("RDMAKIT_TEST_EXTENDED");
  return e != nullptr && *e != '\0' && std::string_view(e) != "0";
}
inline bool by_sge_through_extended() { return extended() && std::string_view(std::getenv("RDMAKIT_TEST_EXTENDED")) == "sge"; }

// A region the fake never touches: only its address, length and keys matter.
inline MemoryRegion region(std::uintptr_t addr, std::size_t length, Access access) {
  auto impl = std::make_unique<MemoryRegion::Impl>();
  impl->addr = reinterpret_cast<void*>(addr);
  impl->length = length;
  impl->lkey = 0x10;
  impl->rkey = 0x11;
  impl->access = access;
  return MemoryRegion::Impl::wrap(std::move(impl));
}

struct Housekeeping final : rdmakit::detail::Housekeeping {
  std::function<void()> on_tick;
  int ticks = 0;
  void tick(rdmakit::detail::Deadline) noexcept override {
    ++ticks;
    if (on_tick) on_tick();
  }
  [[nodiscard]] int wake_fd() const noexcept override { return -1; }
};

struct Options {
  std::uint32_t lanes = 1;
  std::uint32_t depth = 8;
  std::uint32_t max_msg = 1 << 20;
  bool events = false;
};

// A connected data path over fake QPs, with one local buffer and a peer that advertised one
// region it may read, write and run atomics on.
struct Rig {
  explicit Rig(Options o = {}) {
    ch = o.events ? v.channel() : nullptr;
    scq = v.cq(ch);
    rcq = v.cq(ch);
    for (std::uint32_t k = 0; k < o.lanes; ++k) qps.push_back(v.qp(scq, rcq, 0x100 + k));
    dp.init({o.depth, o.depth, 4, 64, o.max_msg, 4 * 4096}, qps, scq, rcq, ch, v.ops());
    // RDMAKIT_TEST_EXTENDED (the unit.datapath_extended runs of these suites): the QPs' and the
    // send CQ's extended interfaces, as a connection on a provider that has them; "sge": one
    // that loses inline data through them (rxe), whose inline-sized requests go by their SGE.
    if (extended()) {
      std::vector<ibv_qp_ex*> x;
      for (ibv_qp* q : qps) x.push_back(v.qp_ex(q));
      dp.use_extended(x, !by_sge_through_extended(), v.cq_ex(scq));
    }
    dp.set_remote({peer}, true);
    dp.start();
  }
  LocalSlice slice(std::size_t offset, std::size_t len) const { return mem.local().subslice(offset, len); }
  WorkRequest write(std::size_t len, std::uint64_t wr_id, bool signaled) const {
    WorkRequest w;
    w.opcode = Opcode::write;
    slices.push_back(slice(0, len));
    w.local = {&slices.back(), 1};
    w.remote = peer;
    w.wr_id = wr_id;
    w.signaled = signaled;
    return w;
  }
  // Everything wait() delivers until it says something else.
  std::vector<Completion> drain_completions(WaitStatus* last = nullptr) {
    std::vector<Completion> out;
    for (int i = 0; i < 1000; ++i) {
      const auto r = dp.wait(200ms, hk);
      if (r.status != WaitStatus::completed) {
        if (last != nullptr) *last = r.status;
        break;
      }
      out.push_back(r.completion);
    }
    return out;
  }

  fake::Verbs v;
  ibv_comp_channel* ch = nullptr;
  ibv_cq* scq = nullptr;
  ibv_cq* rcq = nullptr;
  std::vector<ibv_qp*> qps;
  DataPath dp;
  Housekeeping hk;
  MemoryRegion mem = region(0x100000, 1 << 24, Access::local_write);
  RemoteRegion peer{0x7000'0000, 1 << 24, 0x99, Access::remote_read | Access::remote_write | Access::remote_atomic};
  mutable std::deque<LocalSlice> slices;
};

}  // namespace rdmakit::test
