// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: the per-process device layer. Each device is opened once whatever the
// number of connections (each still has a PD of its own), a device event reaches every
// connection it concerns whichever thread read it, and the cached GID tables follow the
// netdev's addresses through GID_CHANGE events, without the device being opened again.
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "lab_helpers.hpp"
#include "rdmakit/connection.hpp"
#include "verbs/device_layer.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::Access;
using rdmakit::Connection;
using rdmakit::Listener;
using rdmakit::WaitStatus;
using lab::quiet;

Connection::Setup buffer() {
  return [](Connection& c) { c.advertise(c.allocate_memory(4096, Access::local_write | Access::remote_write)); };
}

bool has_gid(const std::vector<rdmakit::DeviceInfo>& devices, const std::string& address) {
  for (const auto& d : devices) {
    for (const auto& p : d.ports) {
      for (const auto& g : p.gids) {
        if (g.address() == address) return true;
      }
    }
  }
  return false;
}

}  // namespace

TEST(DeviceLayer, ConnectionsShareOneContextEachWithItsOwnPd) {
  const auto before = lab::rdma_resources();
  {
    Listener listener("127.0.0.1:0", quiet(), buffer());
    std::vector<Connection> conns;
    for (int i = 0; i < 3; ++i) {
      conns.push_back(Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(), buffer()));
      auto s = listener.accept(5s);
      ASSERT_TRUE(s.has_value());
      conns.push_back(std::move(*s));
    }
    const auto during = lab::rdma_resources();
    EXPECT_EQ(during.at("ctx"), before.at("ctx") + 1) << "six connections, one process: one device context";
    // A PD each: a region's rkey is useless on another connection's QP.
    EXPECT_EQ(during.at("pd"), before.at("pd") + 6);
    EXPECT_EQ(during.at("qp"), before.at("qp") + 6);
  }
  EXPECT_EQ(lab::rdma_resources(), before) << "the last user closed the device";
}

// c1's wait reads the port-down event from the shared device; c2, which never saw it on its own
// descriptor, reports it too.
TEST(DeviceLayer, APortEventReachesEveryConnectionWhoeverReadsIt) {
  Listener listener("127.0.0.1:0", quiet(), buffer());
  Connection c1 = Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(), buffer());
  auto s1 = listener.accept(5s);
  Connection c2 = Connection::connect("127.0.0.1:" + std::to_string(listener.port()), quiet(), buffer());
  auto s2 = listener.accept(5s);
  ASSERT_TRUE(s1 && s2);
  const auto device = rdmakit::detail::DeviceLayer::acquire()->device(c1.info().device);
  const auto seen = device->events_seen();
  ASSERT_EQ(std::system("ip link set eth0 down"), 0);
  const auto w1 = c1.wait(5s);
  const auto read = device->events_seen() - seen;
  const auto w2 = c2.wait(1s);
  ASSERT_EQ(std::system("ip link set eth0 up"), 0);
  EXPECT_EQ(w1.status, WaitStatus::device_error);
  EXPECT_EQ(w2.status, WaitStatus::device_error);
  EXPECT_GE(read, 1u);
  for (const Connection* c : {&c1, &c2}) {
    EXPECT_NE(c->failure().find("IBV_EVENT_PORT_ERR"), std::string::npos) << c->failure();
  }
  for (int i = 0; i < 100 && std::system("grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state") != 0; ++i) {
    std::this_thread::sleep_for(100ms);
  }
}

TEST(DeviceLayer, CachedGidTablesFollowAddressChanges) {
  const auto layer = rdmakit::detail::DeviceLayer::acquire();  // held: list_devices() uses its cache
  const auto before = lab::rdma_resources();
  const std::string addr = "198.18.91.1";
  ASSERT_FALSE(has_gid(layer->catalog(), "::ffff:" + addr));
  lab::ExtraAddress extra(addr);
  ASSERT_TRUE(extra.ok);
  bool present = false;
  for (int i = 0; i < 100 && !present; ++i) {
    present = has_gid(rdmakit::list_devices(), "::ffff:" + addr);
    if (!present) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(present) << "the GID_CHANGE event did not refresh the cached table";
  ASSERT_TRUE(extra.remove());
  bool gone = false;
  for (int i = 0; i < 100 && !gone; ++i) {
    gone = !has_gid(layer->catalog(), "::ffff:" + addr);
    if (!gone) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(gone);
  EXPECT_EQ(lab::rdma_resources(), before) << "list_devices() opened a device again";
}
