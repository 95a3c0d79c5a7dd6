// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: how the engine registers caller-owned memory that is not plain host
// memory, against rxe. Another driver's dma-buf (vgem, the lab's stand-in for an accelerator):
// rxe takes no dma-buf MR, so every device of the engine shares one registered bounce buffer
// that stage_in/stage_out fill from and copy back to the dma-buf. (A device that takes dma-buf
// MRs, and caller-owned GPU memory, need hardware the lab has not: tests/gpu/run.)
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_helpers.hpp"
#include "lab_helpers.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"
#include "vgem.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Batch;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::RegistrationPath;
using rdmakit::Transfer;
using rdmakit::TransferOp;
using lab::at;
using lab::config;
using lab::fill;
using lab::same;
using lab::Target;
using lab::xfer;

constexpr std::size_t kLen = 1 << 20;

// vgem's dma-buf and the test's own CPU mapping of it (what the exporter's user would see).
struct Vgem {
  rdmakit::tools::VgemBuffer buf{kLen};
  void* map = nullptr;
  Vgem() {
    map = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_SHARED, buf.fd(), 0);
    if (map == MAP_FAILED) throw rdmakit::Error("mmap(vgem dma-buf)", errno, "");
  }
  ~Vgem() { ::munmap(map, kLen); }
  Vgem(const Vgem&) = delete;
  Vgem& operator=(const Vgem&) = delete;
};

std::unique_ptr<Vgem> vgem_or_skip() {
  try {
    return std::make_unique<Vgem>();
  } catch (const rdmakit::Error&) {
    return nullptr;
  }
}

void run(Engine& e, const std::vector<Transfer>& t) {
  Batch b = e.submit(t);
  ASSERT_TRUE(lab::waited(b, 10s));
  EXPECT_EQ(b.failed(), 0u) << b.describe_failures();
}

}  // namespace

// On one device or every device of an engine (lab --nics 2): the path each took and why, then
// the dma-buf's bytes out (stage_in, a write), in (a read, stage_out) and read by a peer.
TEST(EngineMemory, ACallersDmabufReachesEveryDeviceThroughOneBounceBuffer) {
  RDMAKIT_RDMA_ONLY("rxe's refusal of dma-buf MRs is what sends it to the bounce path");
  auto v = vgem_or_skip();
  if (!v) GTEST_SKIP() << "no vgem in this VM (modprobe vgem)";
  Target b("b", kLen);
  Engine a(config("a"));
  const Buffer d = a.register_dmabuf(v->buf.fd(), 0, kLen);
  const auto paths = a.registration(d);
  ASSERT_EQ(paths.size(), a.info().devices.size());
  for (const auto& p : paths) {
    EXPECT_EQ(p.path, RegistrationPath::bounce) << p.device;
    EXPECT_NE(p.detail.find("ibv_reg_dmabuf_mr on rxe"), std::string::npos) << p.detail;
    EXPECT_NE(p.detail.find("EOPNOTSUPP"), std::string::npos) << p.detail;
    EXPECT_NE(p.detail.find("every device registers one host bounce buffer"), std::string::npos) << p.detail;
  }
  // Host memory, for contrast: by its address on every device.
  const Buffer h = a.allocate_memory(4096);
  for (const auto& p : a.registration(h)) EXPECT_EQ(p.path, RegistrationPath::host_mr) << p.device;

  // Out: what the exporter's user wrote, once staged in.
  fill(v->map, kLen, 11);
  a.stage_in(d);
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  run(a, {xfer(TransferOp::write, d, 0, kLen, seg, 0)});
  EXPECT_TRUE(same(b.buf.addr, v->map, kLen));
  // In: a read lands in the bounce buffer; stage_out of part of it reaches the dma-buf, and only
  // that part.
  fill(b.buf.addr, kLen, 29);
  run(a, {xfer(TransferOp::read, d, 0, kLen, seg, 0)});
  std::vector<unsigned char> before(static_cast<unsigned char*>(v->map), static_cast<unsigned char*>(v->map) + kLen);
  a.stage_out(d, 4096, 8192);
  EXPECT_TRUE(same(static_cast<char*>(v->map) + 4096, static_cast<char*>(b.buf.addr) + 4096, 8192));
  EXPECT_EQ(std::memcmp(v->map, before.data(), 4096), 0) << "stage_out copied outside its range";
  EXPECT_EQ(std::memcmp(static_cast<char*>(v->map) + 12288, before.data() + 12288, kLen - 12288), 0);
  a.stage_out(d);
  EXPECT_TRUE(same(v->map, b.buf.addr, kLen));
  // A peer reads it as a segment, after stage_in.
  a.expose("dm", d, rdmakit::Access::remote_read);
  fill(v->map, kLen, 47);
  a.stage_in(d, 0, kLen);
  b.engine.add_peer("a", at(a));
  const Buffer into = b.engine.allocate_memory(kLen);
  run(b.engine, {xfer(TransferOp::read, into, 0, kLen, b.engine.segment("a", "dm"), 0)});
  EXPECT_TRUE(same(into.addr, v->map, kLen));
  // An fd that is no dma-buf is refused by name.
  const int memfd = ::memfd_create("not-a-dmabuf", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(::ftruncate(memfd, kLen), 0);
  try {
    (void)a.register_dmabuf(memfd, 0, kLen);
    ADD_FAILURE() << "a memfd was taken for a dma-buf";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a dma-buf"), std::string::npos) << e.what();
  }
  ::close(memfd);
  // A range past the buffer is refused, and so is staging an unregistered buffer.
  EXPECT_THROW(a.stage_in(d, kLen - 10, 20), rdmakit::Error);
  a.withdraw("dm");
  a.unregister_memory(d);
  EXPECT_THROW(a.stage_out(d), rdmakit::Error);
}

// Lab --nics 2: one engine on both devices writes the dma-buf's bytes to a target behind each
// NIC, so each device's registration of the shared bounce buffer carries some; a closed fd is
// refused by name.
TEST(EngineMemory, ADmabufMovesThroughEveryDevice) {
  lab::TwoNics n;
  if (!n.present()) GTEST_SKIP() << "needs a lab VM with two NICs (--nics 2)";
  auto v = vgem_or_skip();
  if (!v) GTEST_SKIP() << "no vgem in this VM (modprobe vgem)";
  auto c = config("a");
  c.listen = "";
  Engine a(c);
  ASSERT_EQ(a.info().devices.size(), 2u);
  const Buffer d = a.register_dmabuf(v->buf.fd(), 0, kLen);
  ASSERT_EQ(a.registration(d).size(), 2u);
  fill(v->map, 1 << 16, 61);
  a.stage_in(d, 0, 1 << 16);
  a.add_peer("t0", n.at(0));
  a.add_peer("t1", n.at(1));
  ASSERT_NO_FATAL_FAILURE(n.write_to_both(a, d, 8, 8192));
  EXPECT_TRUE(same(d.addr, v->map, 1 << 16)) << "the bounce buffer holds what was staged in";
  std::vector<std::string> devices;
  for (const auto& p : a.peers()) devices.push_back(p.device);
  EXPECT_EQ(devices, (std::vector<std::string>{"rxe0", "rxe1"}));
  try {
    (void)a.register_dmabuf(-1, 0, kLen);
    ADD_FAILURE() << "a closed fd was taken";
  } catch (const rdmakit::Error& e) {
    EXPECT_EQ(e.sys_errno(), EBADF) << e.what();
  }
}
