// SPDX-License-Identifier: Apache-2.0
#include <chrono>

#include <gtest/gtest.h>

#include "rdmakit/error.hpp"
#include "verbs/handles.hpp"
#include "verbs/qp.hpp"

namespace {

using namespace std::chrono_literals;
using rdmakit::detail::QpTimeouts;
using rdmakit::wire::EndpointInfo;

EndpointInfo roce(std::uint32_t qpn, std::uint32_t mtu, std::uint8_t last) {
  EndpointInfo e;
  e.qpn = qpn;
  e.psn = qpn * 3;
  e.link_layer = rdmakit::LinkLayer::ethernet;
  e.gid_type = rdmakit::GidType::roce_v2;
  e.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, last};
  e.gid_index = 1;
  e.mtu = mtu;
  e.max_rd_atomic = 16;
  e.max_dest_rd_atomic = 8;
  return e;
}

EndpointInfo ib(std::uint32_t qpn, std::uint16_t lid, std::uint8_t subnet) {
  EndpointInfo e = roce(qpn, 4096, 1);
  e.link_layer = rdmakit::LinkLayer::infiniband;
  e.gid_type = rdmakit::GidType::ib;
  e.gid = {0xfe, 0x80, 0, 0, 0, 0, 0, subnet, 0, 2, 0xc9, 0x03, 0, 0, 0, static_cast<std::uint8_t>(lid)};
  e.gid_index = 0;
  e.lid = lid;
  return e;
}

TEST(QpAttrs, PathMtuIsTheSmallerActiveMtu) {
  using rdmakit::detail::derive_rtr;
  EXPECT_EQ(derive_rtr(roce(1, 4096, 1), roce(2, 1024, 2), 1, {}).path_mtu, IBV_MTU_1024);
  EXPECT_EQ(derive_rtr(roce(1, 1024, 1), roce(2, 4096, 2), 1, {}).path_mtu, IBV_MTU_1024);
  EXPECT_EQ(derive_rtr(roce(1, 2048, 1), roce(2, 2048, 2), 1, {}).path_mtu, IBV_MTU_2048);
  EXPECT_EQ(derive_rtr(roce(1, 256, 1), roce(2, 4096, 2), 1, {}).path_mtu, IBV_MTU_256);
}

TEST(QpAttrs, RoceUsesGrhWithBothGids) {
  const auto local = roce(0x11, 1024, 1);
  const auto remote = roce(0x22, 1024, 2);
  const auto a = rdmakit::detail::derive_rtr(local, remote, 1, {});
  EXPECT_TRUE(a.is_global);
  EXPECT_EQ(a.dgid, remote.gid);
  EXPECT_EQ(a.sgid_index, 1);
  EXPECT_GT(a.hop_limit, 1);  // routable, unlike the seed's hop limit 1
  EXPECT_EQ(a.dlid, 0);
  EXPECT_EQ(a.dest_qpn, 0x22u);
  EXPECT_EQ(a.rq_psn, remote.psn);
  EXPECT_EQ(a.max_dest_rd_atomic, local.max_dest_rd_atomic);
}

TEST(QpAttrs, RemoteAccessIsTheUnionOfAdvertisedRegions) {
  using rdmakit::Access;
  auto local = roce(1, 1024, 1);
  EXPECT_EQ(rdmakit::detail::derive_rtr(local, roce(2, 1024, 2), 1, {}).access, Access::none);
  local.regions = {{0x1000, 64, 1, Access::remote_read}, {0x2000, 64, 2, Access::remote_atomic}};
  const auto a = rdmakit::detail::derive_rtr(local, roce(2, 1024, 2), 1, {});
  EXPECT_EQ(a.access, Access::remote_read | Access::remote_atomic);
  EXPECT_EQ(rdmakit::detail::qp_access_flags(a.access),
            static_cast<unsigned>(IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC));
}

TEST(QpAttrs, InfinibandUsesLidAndGrhOnlyAcrossSubnets) {
  const auto same = rdmakit::detail::derive_rtr(ib(1, 5, 0), ib(2, 9, 0), 1, {});
  EXPECT_FALSE(same.is_global);
  EXPECT_EQ(same.dlid, 9);
  const auto other = rdmakit::detail::derive_rtr(ib(1, 5, 0), ib(2, 9, 7), 1, {});
  EXPECT_TRUE(other.is_global);
  EXPECT_EQ(other.dlid, 9);
  EXPECT_EQ(other.dgid, ib(2, 9, 7).gid);
}

TEST(QpAttrs, RtsTakesTheSmallerReadDepthAndEncodesTimeouts) {
  auto local = roce(1, 1024, 1);
  auto remote = roce(2, 1024, 2);
  local.max_rd_atomic = 16;
  remote.max_dest_rd_atomic = 4;
  const auto a = rdmakit::detail::derive_rts(local, remote, {});
  EXPECT_EQ(a.max_rd_atomic, 4);
  EXPECT_EQ(a.sq_psn, local.psn);
  EXPECT_EQ(a.timeout, 17);  // 4.096 us * 2^17 = 537 ms >= the default 500 ms
  EXPECT_EQ(a.retry_cnt, 6);
  EXPECT_EQ(a.rnr_retry, 6);
}

TEST(QpAttrs, AckTimeoutEncoding) {
  using rdmakit::detail::ack_timeout_duration;
  using rdmakit::detail::encode_ack_timeout;
  EXPECT_EQ(encode_ack_timeout(500ms), 17);
  EXPECT_EQ(encode_ack_timeout(1ms), 8);  // 1.05 ms
  EXPECT_GE(ack_timeout_duration(encode_ack_timeout(123ms)), 123ms);
  EXPECT_LT(ack_timeout_duration(encode_ack_timeout(123ms)), 246ms);
  EXPECT_THROW((void)encode_ack_timeout(0ms), rdmakit::Error);  // 0 = never retransmit
  EXPECT_THROW((void)encode_ack_timeout(std::chrono::hours(3)), rdmakit::Error);
}

TEST(QpAttrs, RnrTimerEncoding) {
  using rdmakit::detail::encode_rnr_timer;
  EXPECT_EQ(encode_rnr_timer(10us), 1);
  EXPECT_EQ(encode_rnr_timer(1280us), 14);
  EXPECT_EQ(encode_rnr_timer(1300us), 15);  // 1.92 ms: never shorter than asked
  EXPECT_EQ(encode_rnr_timer(491520us), 31);
  EXPECT_EQ(encode_rnr_timer(600ms), 0);  // 655.36 ms is code 0
  EXPECT_THROW((void)encode_rnr_timer(700ms), rdmakit::Error);
}

TEST(QpAttrs, RefusesForeverSettings) {
  QpTimeouts t;
  t.rnr_retry = 7;
  EXPECT_THROW(rdmakit::detail::check_retries(t), rdmakit::Error);
  t = {};
  t.ack_timeout = 0ms;
  EXPECT_THROW(rdmakit::detail::check_retries(t), rdmakit::Error);
  t = {};
  t.retry_count = 8;
  EXPECT_THROW(rdmakit::detail::check_retries(t), rdmakit::Error);
  EXPECT_NO_THROW(rdmakit::detail::check_retries({}));
}

TEST(QpAttrs, MtuConversions) {
  using rdmakit::detail::mtu_bytes;
  using rdmakit::detail::mtu_enum;
  for (std::uint32_t b : {256u, 512u, 1024u, 2048u, 4096u}) EXPECT_EQ(mtu_bytes(mtu_enum(b)), b);
  EXPECT_EQ(mtu_enum(1500), IBV_MTU_1024);
}

// The fabric settings go into the address vector: SL always, the traffic class in the GRH
// (RoCE has one anyway; on InfiniBand within a subnet, asking for a class adds one).
TEST(QpAttrs, FabricSettingsGoInTheAddressVector) {
  using rdmakit::detail::derive_rtr;
  const rdmakit::detail::QpPath path{106, 3, 0};
  const auto r = derive_rtr(roce(1, 1024, 1), roce(2, 1024, 2), 1, {}, path);
  EXPECT_EQ(r.sl, 3);
  EXPECT_EQ(r.traffic_class, 106);
  EXPECT_TRUE(r.is_global);
  EXPECT_FALSE(derive_rtr(ib(1, 5, 0), ib(2, 9, 0), 1, {}).is_global);
  const auto classed = derive_rtr(ib(1, 5, 0), ib(2, 9, 0), 1, {}, path);
  EXPECT_TRUE(classed.is_global);
  EXPECT_EQ(classed.sl, 3);
  bool listed = false;
  for (const auto& l : rdmakit::detail::rtr_attr_lines(classed, ib(1, 5, 0), ib(2, 9, 0))) {
    if (l.name == "ah.grh.traffic_class") listed = l.value == "106" && l.origin == "DSCP 26, ECN 2";
  }
  EXPECT_TRUE(listed) << "the RTR transition's attributes name the class";
  EXPECT_THROW(rdmakit::detail::check_path({0, 16, 0}), rdmakit::Error);
}

}  // namespace
