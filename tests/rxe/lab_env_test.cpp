// SPDX-License-Identifier: Apache-2.0
// Runs inside the lab: checks the environment every rxe test relies on (an rxe device with an
// ACTIVE Ethernet port, RoCE v2 GIDs at the indexes the lab documents, the lab's variables).
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

struct DeviceListDeleter {
  void operator()(ibv_device** l) const { ibv_free_device_list(l); }
};
struct ContextDeleter {
  void operator()(ibv_context* c) const { ibv_close_device(c); }
};

class LabEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    if (env("RDMAKIT_LAB").empty()) GTEST_FAIL() << "not running inside rdmakit-lab";
    int n = 0;
    list_.reset(ibv_get_device_list(&n));
    ASSERT_NE(list_, nullptr) << "ibv_get_device_list: " << std::strerror(errno);
    for (int i = 0; i < n; ++i) {
      if (env("RDMAKIT_LAB_DEVICE") == ibv_get_device_name(list_.get()[i])) {
        ctx_.reset(ibv_open_device(list_.get()[i]));
      }
    }
    ASSERT_NE(ctx_, nullptr) << "device " << env("RDMAKIT_LAB_DEVICE") << " not found or not opened";
  }

  std::unique_ptr<ibv_device*, DeviceListDeleter> list_;
  std::unique_ptr<ibv_context, ContextDeleter> ctx_;
};

TEST_F(LabEnv, VariablesDescribeThisVm) {
  std::istringstream ips(env("RDMAKIT_LAB_IPS"));
  std::vector<std::string> all{std::istream_iterator<std::string>(ips), {}};
  const int index = std::atoi(env("RDMAKIT_LAB_INDEX").c_str());
  ASSERT_GE(index, 0);
  ASSERT_LT(static_cast<size_t>(index), all.size());
  EXPECT_EQ(all[static_cast<size_t>(index)], env("RDMAKIT_LAB_IP"));
}

TEST_F(LabEnv, PortIsActiveEthernetWithMtu1024) {
  ibv_port_attr attr{};
  ASSERT_EQ(ibv_query_port(ctx_.get(), 1, &attr), 0);
  EXPECT_EQ(attr.state, IBV_PORT_ACTIVE);
  EXPECT_EQ(attr.link_layer, IBV_LINK_LAYER_ETHERNET);
  // 1500-byte netdev: rxe's largest IB MTU that fits is 1024.
  EXPECT_EQ(attr.active_mtu, IBV_MTU_1024);
  EXPECT_EQ(attr.max_msg_sz, 8u << 20);
}

TEST_F(LabEnv, GidOneIsRoceV2OfTheLabAddress) {
  ibv_gid_entry entry{};
  ASSERT_EQ(ibv_query_gid_ex(ctx_.get(), 1, 1, &entry, 0), 0) << std::strerror(errno);
  EXPECT_EQ(entry.gid_type, IBV_GID_TYPE_ROCE_V2);
  char text[INET6_ADDRSTRLEN] = {};
  ASSERT_NE(inet_ntop(AF_INET6, entry.gid.raw, text, sizeof text), nullptr);
  EXPECT_EQ(std::string(text), "::ffff:" + env("RDMAKIT_LAB_IP"));

  ibv_gid_entry zero{};
  ASSERT_EQ(ibv_query_gid_ex(ctx_.get(), 1, 0, &zero, 0), 0);
  EXPECT_EQ(zero.gid_type, IBV_GID_TYPE_ROCE_V2);
  EXPECT_EQ(zero.gid.raw[0], 0xfe);  // fe80::/64, link-local
  EXPECT_EQ(zero.gid.raw[1] & 0xc0, 0x80);
}

}  // namespace
