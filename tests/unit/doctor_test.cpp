// SPDX-License-Identifier: Apache-2.0
// The doctor's judgements that need no device: comparing two sides, diagnosing failures, the
// overall verdict.
#include "rdmakit/doctor.hpp"

#include <infiniband/verbs.h>

#include <cerrno>
#include <string>

#include <gtest/gtest.h>

namespace {

using namespace rdmakit;
using doctor::Verdict;

wire::EndpointInfo side(std::uint8_t last_octet) {
  wire::EndpointInfo e;
  e.qpn = 0x11;
  e.link_layer = LinkLayer::ethernet;
  e.gid_type = GidType::roce_v2;
  e.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, last_octet};
  e.gid_index = 1;
  e.mtu = 1024;
  return e;
}

doctor::Netdev eth0(const std::string& cidr) { return {"eth0", true, "up", 1500, {cidr, "fe80::1/64"}}; }

const doctor::Check& find(const doctor::Report& r, const std::string& id) {
  for (const auto& c : r.checks) {
    if (c.id == id) return c;
  }
  static const doctor::Check none{"(missing)", "", Verdict::fail, "", ""};
  ADD_FAILURE() << "no check " << id;
  return none;
}

TEST(Doctor, HealthyPairIsOk) {
  doctor::PeerFacts facts;
  facts.memlock = 64u << 20;
  const auto r = doctor::compare_peers(side(1), eth0("198.18.0.1/24"), side(2), facts);
  EXPECT_EQ(r.worst(), Verdict::ok);
  EXPECT_EQ(r.exit_status(), 0);
  EXPECT_NE(find(r, "peer.gid_reach").detail.find("same subnet 198.18.0.0/24"), std::string::npos);
  EXPECT_EQ(find(r, "peer.mtu").detail, "active MTU 1024 here, 1024 on the peer: path MTU 1024");
}

TEST(Doctor, UnknownPeerMemlockIsASkipNotAPass) {
  const auto r = doctor::compare_peers(side(1), eth0("198.18.0.1/24"), side(2), {});
  EXPECT_EQ(find(r, "peer.memlock").verdict, Verdict::skip);
  EXPECT_NE(find(r, "peer.memlock").detail.find("not a doctor listener"), std::string::npos);
  EXPECT_EQ(r.worst(), Verdict::ok);  // a skip makes nothing worse
}

TEST(Doctor, OtherSubnetWarnsAboutRouting) {
  auto far = side(2);
  far.gid[13] = 19;  // 198.19.0.2
  const auto w = doctor::compare_peers(side(1), eth0("198.18.0.1/24"), far, {});
  EXPECT_EQ(find(w, "peer.gid_reach").verdict, Verdict::warn);
  EXPECT_NE(find(w, "peer.gid_reach").fix.find("UDP 4791"), std::string::npos);
  EXPECT_EQ(w.exit_status(), 1);
  // A /8 holds both.
  EXPECT_EQ(find(doctor::compare_peers(side(1), eth0("198.18.0.1/8"), far, {}), "peer.gid_reach").verdict, Verdict::ok);
}

TEST(Doctor, Ipv4AgainstIpv6Fails) {
  auto v6 = side(2);
  v6.gid = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x50, 0x54, 0, 0xff, 0xfe, 0x4c, 0xab, 0x01};
  const auto r = doctor::compare_peers(side(1), eth0("198.18.0.1/24"), v6, {});
  const auto& c = find(r, "peer.gid_reach");
  EXPECT_EQ(c.verdict, Verdict::fail);
  EXPECT_NE(c.detail.find("(IPv4)"), std::string::npos) << c.detail;
  EXPECT_NE(c.detail.find("(IPv6 link-local)"), std::string::npos) << c.detail;
  EXPECT_EQ(r.exit_status(), 2);
}

TEST(Doctor, RoceVersionsAndLinkLayers) {
  auto v1 = side(2);
  v1.gid_type = GidType::roce_v1;
  EXPECT_EQ(find(doctor::compare_peers(side(1), {}, v1, {}), "peer.roce_version").verdict, Verdict::fail);
  auto ib = side(2);
  ib.link_layer = LinkLayer::infiniband;
  const auto r = doctor::compare_peers(side(1), {}, ib, {});
  EXPECT_EQ(find(r, "peer.link_layer").verdict, Verdict::fail);
  EXPECT_EQ(r.checks.size(), 1u);  // nothing else is worth comparing
  auto a = side(1), b = side(2);
  a.link_layer = b.link_layer = LinkLayer::infiniband;
  a.lid = 3;
  EXPECT_EQ(find(doctor::compare_peers(a, {}, b, {}), "peer.lid").verdict, Verdict::fail);  // b has LID 0
}

TEST(Doctor, MtuMismatchWarnsWithThePathMtu) {
  auto big = side(2);
  big.mtu = 4096;
  doctor::PeerFacts facts;
  facts.netdev = doctor::Netdev{"eth0", true, "up", 9000, {}};
  const auto r = doctor::compare_peers(side(1), eth0("198.18.0.1/24"), big, facts);
  const auto& c = find(r, "peer.mtu");
  EXPECT_EQ(c.verdict, Verdict::warn);
  EXPECT_NE(c.detail.find("active MTU 1024 here, 4096 on the peer: path MTU 1024"), std::string::npos) << c.detail;
  EXPECT_NE(c.detail.find("peer netdev eth0 MTU 9000"), std::string::npos) << c.detail;
}

TEST(Doctor, PeerMemlockTooLowWarnsUnlessExempt) {
  doctor::PeerFacts facts;
  facts.memlock = 64 * 1024;
  EXPECT_EQ(find(doctor::compare_peers(side(1), {}, side(2), facts), "peer.memlock").verdict, Verdict::warn);
  facts.cap_ipc_lock = true;
  EXPECT_EQ(find(doctor::compare_peers(side(1), {}, side(2), facts), "peer.memlock").verdict, Verdict::ok);
}

TEST(Doctor, DiagnosesFailedCompletions) {
  Completion c;
  c.opcode = Opcode::write;
  c.status = IBV_WC_RETRY_EXC_ERR;
  auto v6 = side(2);
  v6.gid = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  const auto cmp = doctor::compare_peers(side(1), {}, v6, {});
  const auto d = doctor::diagnose(c, &cmp);
  EXPECT_EQ(d.verdict, Verdict::fail);
  EXPECT_NE(d.fix.find("never acknowledged"), std::string::npos);
  EXPECT_NE(d.fix.find("GIDs reach each other"), std::string::npos) << d.fix;  // the comparison's finding
  c.status = IBV_WC_RNR_RETRY_EXC_ERR;
  EXPECT_NE(doctor::diagnose(c).fix.find("no receive posted"), std::string::npos);
  c.status = IBV_WC_REM_ACCESS_ERR;
  EXPECT_NE(doctor::diagnose(c).fix.find("rkey"), std::string::npos);
}

TEST(Doctor, DiagnosesSetupErrors) {
  EXPECT_NE(doctor::diagnose(Error("connect", ECONNREFUSED, "to 10.0.0.1:1")).fix.find("nothing listens"),
            std::string::npos);
  EXPECT_NE(doctor::diagnose(Error("connect", ETIMEDOUT, "to 10.0.0.1:1")).fix.find("firewall"),
            std::string::npos);
  const auto g = doctor::diagnose(Error("bootstrap handshake", ECONNREFUSED,
                                        "peer rejected the connection: GID families differ: ..."));
  EXPECT_EQ(g.id, "peer.gid_reach");
  EXPECT_NE(g.fix.find("same family"), std::string::npos);
}

TEST(Doctor, VerdictOrderAndExitStatus) {
  doctor::Report r;
  EXPECT_EQ(r.exit_status(), 0);
  r.checks.push_back({"a", "", Verdict::skip, "", ""});
  EXPECT_EQ(r.worst(), Verdict::ok);
  r.checks.push_back({"b", "", Verdict::warn, "", ""});
  EXPECT_EQ(r.exit_status(), 1);
  r.checks.push_back({"c", "", Verdict::fail, "", ""});
  EXPECT_EQ(r.exit_status(), 2);
  EXPECT_STREQ(doctor::to_string(r.worst()), "fail");
}

}  // namespace
