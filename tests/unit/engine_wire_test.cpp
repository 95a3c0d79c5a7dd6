// SPDX-License-Identifier: Apache-2.0
// The engine's messages between linked engines (src/engine/protocol.hpp): every kind round-trips,
// and every malformed field is refused with a reason, never half-read.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/protocol.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace {

namespace ew = rdmakit::detail::engine_wire;
using rdmakit::Access;

std::string refusal(const std::vector<std::uint8_t>& bytes) {
  try {
    (void)ew::decode(bytes);
  } catch (const rdmakit::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(EngineWire, EveryKindRoundTrips) {
  const auto id = ew::decode(ew::encode(ew::ident("node-a", 0x0102030405060708)));
  EXPECT_EQ(id.kind, ew::Kind::ident);
  EXPECT_EQ(id.name, "node-a");
  EXPECT_EQ(id.epoch, 0x0102030405060708u);
  const rdmakit::RemoteRegion r{0x7f0000001000, 65536, 0x1234abcd, Access::remote_read | Access::remote_atomic};
  const auto seg = ew::decode(ew::encode(ew::segment("kv", r)));
  EXPECT_EQ(seg.kind, ew::Kind::segment);
  EXPECT_EQ(seg.name, "kv");
  EXPECT_EQ(seg.region, r);
  EXPECT_EQ(ew::decode(ew::encode(ew::withdraw("kv"))).name, "kv");
  const ew::Message sy = ew::decode(ew::encode(ew::synced(256)));
  EXPECT_EQ(sy.kind, ew::Kind::synced);
  EXPECT_EQ(sy.credits, 256u);
  const ew::Message cr = ew::decode(ew::encode(ew::credit(7)));
  EXPECT_EQ(cr.kind, ew::Kind::credit);
  EXPECT_EQ(cr.credits, 7u);
  const ew::Message ac = ew::decode(ew::encode(ew::active(0x0123456789abcdefull)));
  EXPECT_EQ(ac.kind, ew::Kind::active);
  EXPECT_EQ(ac.moved, 0x0123456789abcdefull);
  // An ACTIVE cut short (a peer of version 6 sent none) is refused, not read past its end.
  std::vector<std::uint8_t> short_active = ew::encode(ew::active(5));
  short_active.resize(short_active.size() - 1);
  EXPECT_THROW((void)ew::decode(short_active), rdmakit::Error);
  const std::vector<std::uint8_t> note(900, 0x5a);
  EXPECT_EQ(ew::decode(ew::encode(ew::notify(note))).bytes, note);
  EXPECT_TRUE(ew::decode(ew::encode(ew::notify({}))).bytes.empty());
  const ew::Message tagged = ew::decode(ew::encode(ew::notify(note, std::string(64, 'q'))));
  EXPECT_EQ(tagged.bytes, note);
  EXPECT_EQ(tagged.request_id, std::string(64, 'q'));
  EXPECT_TRUE(ew::encode(ew::notify(note, std::string(64, 'q'))).size() <= rdmakit::Connection::max_message_size);
  const ew::Message bare = ew::decode(ew::encode(ew::notify({7}, "req-1")));
  EXPECT_EQ(bare.bytes, std::vector<std::uint8_t>{7});
  EXPECT_EQ(bare.request_id, "req-1");
}

namespace {
ew::Message lease_message(std::size_t ranges) {
  ew::Message m;
  m.kind = ew::Kind::lease;
  m.lease = 0x0102030405060708;
  m.ttl_ms = 500;
  m.lease_ranges = 100;
  m.name = "kv-layer-31";
  m.region.addr = 0x7f0000000000;
  m.region.access = Access::remote_read;
  for (std::size_t i = 0; i < ranges; ++i) m.ranges.push_back({i * 4096, 4096, static_cast<std::uint32_t>(0x100 + i)});
  return m;
}
}  // namespace

// LEASE (its largest fits one control message), LEASE_END, RENEW, RENEWED.
TEST(EngineWire, LeaseMessagesRoundTrip) {
  const ew::Message m = lease_message(ew::kLeaseRangesPerMessage);
  const auto bytes = ew::encode(m);
  EXPECT_LE(bytes.size(), rdmakit::Connection::max_message_size);
  const ew::Message d = ew::decode(bytes);
  EXPECT_EQ(d.kind, ew::Kind::lease);
  EXPECT_EQ(d.lease, m.lease);
  EXPECT_EQ(d.ttl_ms, 500u);
  EXPECT_EQ(d.lease_ranges, 100u);
  EXPECT_EQ(d.name, "kv-layer-31");
  EXPECT_EQ(d.region.addr, m.region.addr);
  EXPECT_EQ(d.region.access, Access::remote_read);
  ASSERT_EQ(d.ranges.size(), ew::kLeaseRangesPerMessage);
  EXPECT_EQ(d.ranges[39].offset, 39u * 4096);
  EXPECT_EQ(d.ranges[39].rkey, 0x100u + 39);
  const ew::Message e = ew::decode(ew::encode(ew::lease_end(9, "expired: its time passed")));
  EXPECT_EQ(e.kind, ew::Kind::lease_end);
  EXPECT_EQ(e.lease, 9u);
  EXPECT_EQ(std::string(e.bytes.begin(), e.bytes.end()), "expired: its time passed");
  const ew::Message r = ew::decode(ew::encode(ew::renew(ew::Kind::renew, 9, 0)));
  EXPECT_EQ(r.kind, ew::Kind::renew);
  EXPECT_EQ(r.ttl_ms, 0u);
  const ew::Message rd = ew::decode(ew::encode(ew::renew(ew::Kind::renewed, 9, 300)));
  EXPECT_EQ(rd.kind, ew::Kind::renewed);
  EXPECT_EQ(rd.ttl_ms, 300u);
  EXPECT_THROW((void)ew::encode(lease_message(0)), rdmakit::Error);
  EXPECT_THROW((void)ew::encode(lease_message(ew::kLeaseRangesPerMessage + 1)), rdmakit::Error);
}

TEST(EngineWire, MalformedLeasesAreRefusedWithAReason) {
  const auto good = ew::encode(lease_message(2));
  for (std::size_t cut = 3; cut < good.size(); ++cut) {
    EXPECT_FALSE(refusal({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut)}).empty()) << cut;
  }
  auto bad = good;
  bad[3 + 8 + 4 + 3] = 0x80;  // access: a local bit
  EXPECT_NE(refusal(bad).find("access"), std::string::npos);
  ew::Message m = lease_message(2);
  m.lease_ranges = 1;  // more ranges in the message than in the lease
  EXPECT_NE(refusal(ew::encode(m)).find("2 ranges in a message of a lease of 1"), std::string::npos);
  m = lease_message(2);
  m.ranges[1].length = 0;
  EXPECT_NE(refusal(ew::encode(m)).find("range"), std::string::npos);
  m = lease_message(1);
  m.ranges[0] = {~std::uint64_t{0} - 10, 4096, 1};  // wraps
  EXPECT_NE(refusal(ew::encode(m)).find("range"), std::string::npos);
}

TEST(EngineWire, FieldsAreBigEndianAtFixedOffsets) {
  // Versions 7 and 8 (8 changed no message: shm links map memory) encode alike but for the byte.
  for (const std::uint8_t v : {std::uint8_t{7}, std::uint8_t{8}}) {
    const auto b = ew::encode(ew::segment("s", {0x1122334455667788, 0x10, 0xaabbccdd, Access::remote_write}), v);
    const std::vector<std::uint8_t> want = {0xE7, v, 2, 1, 's', 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,
                                            0, 0, 0, 0, 0, 0, 0, 0x10, 0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 0, 4};
    EXPECT_EQ(b, want);
    EXPECT_EQ(ew::decode(b, v).name, "s");
  }
  EXPECT_EQ(ew::kVersion, 8);
  EXPECT_EQ(ew::kMinVersion, 7);
}

TEST(EngineWire, MalformedMessagesAreRefusedWithAReason) {
  const auto good = ew::encode(ew::segment("kv", {0x1000, 4096, 7, Access::remote_read}));
  auto bad = good;
  bad[0] = 0;
  EXPECT_NE(refusal(bad).find("bad magic"), std::string::npos);
  bad = good;
  bad[1] = 6;  // before ACTIVE carried the bytes moved
  EXPECT_NE(refusal(bad).find("version 6 on a link that speaks 8"), std::string::npos);
  bad = good;
  bad[2] = 14;
  EXPECT_NE(refusal(bad).find("unknown kind 14"), std::string::npos);
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    EXPECT_FALSE(refusal({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut)}).empty()) << cut;
  }
  bad = good;
  bad.push_back(0);
  EXPECT_NE(refusal(bad).find("after the end"), std::string::npos);
  bad = good;
  bad[3] = 0;  // a name of 0 bytes
  EXPECT_NE(refusal(bad).find("name of 0 bytes"), std::string::npos);
  bad = good;
  bad[4] = '\n';
  EXPECT_NE(refusal(bad).find("control character"), std::string::npos);
  bad = good;
  bad.back() = 0x10;  // local_write is not something a peer is granted
  EXPECT_NE(refusal(bad).find("access 0x10"), std::string::npos);
  bad = good;
  for (int i = 14; i < 22; ++i) bad[static_cast<std::size_t>(i)] = 0;  // length 0
  EXPECT_NE(refusal(bad).find("range"), std::string::npos);
  auto note = ew::encode(ew::notify({1, 2, 3}));
  note[4] = 4;  // claims one byte more than there is
  EXPECT_NE(refusal(note).find("notification of 4 bytes"), std::string::npos);
  auto tagged = ew::encode(ew::notify({1, 2, 3}, "ab"));
  tagged[8] = 3;  // a request id one byte longer than what follows
  EXPECT_NE(refusal(tagged).find("request id of 3 bytes"), std::string::npos);
  tagged.resize(9);  // none of it
  tagged[8] = 65;
  EXPECT_NE(refusal(tagged).find("request id of 65 bytes"), std::string::npos);
  auto credit = ew::encode(ew::credit(1));
  credit.pop_back();
  EXPECT_NE(refusal(credit).find("credits"), std::string::npos);
}

namespace {

rdmakit::detail::RailPort port(const std::string& device, const char* address, std::uint8_t prefix) {
  rdmakit::detail::RailPort p;
  p.device = device;
  p.gid = *rdmakit::detail::parse_ip16(address);
  p.prefix = prefix;
  p.active = true;
  return p;
}

}  // namespace

TEST(EngineWire, RailsRoundTripWithTheirEndpoints) {
  auto a = port("rxe0", "198.18.0.2", 24);
  a.endpoint = "x";  // any: the wire carries only whether there is one
  const auto b = port("mlx5_1", "fd00::7", 64);
  const auto m = ew::decode(ew::encode(ew::rails(7620, 1, {a, b})));
  ASSERT_EQ(m.kind, ew::Kind::rails);
  EXPECT_EQ(m.listen_port, 7620);
  EXPECT_EQ(m.this_rail, 1);
  ASSERT_EQ(m.rails.size(), 2u);
  EXPECT_EQ(m.rails[0].device, "rxe0");
  EXPECT_EQ(m.rails[0].subnet(), "198.18.0.0/24");
  EXPECT_EQ(m.rails[0].endpoint, "198.18.0.2:7620");
  EXPECT_EQ(m.rails[1].subnet(), "fd00::/64");
  EXPECT_TRUE(m.rails[1].endpoint.empty());
  EXPECT_TRUE(ew::decode(ew::encode(ew::rails(0, 0xff, {}))).rails.empty());
}

TEST(EngineWire, MalformedRailsAreRefusedWithAReason) {
  const auto good = ew::encode(ew::rails(7620, 0, {port("rxe0", "198.18.0.2", 24)}));
  for (std::size_t cut = 0; cut < good.size(); ++cut) {
    EXPECT_FALSE(refusal({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut)}).empty()) << cut;
  }
  auto bad = good;
  bad[5] = 1;  // this link's rail 1 of 1
  EXPECT_NE(refusal(bad).find("this link's rail 1 of 1"), std::string::npos) << refusal(bad);
  bad = good;
  bad[6] = 17;
  EXPECT_NE(refusal(bad).find("17 rails"), std::string::npos) << refusal(bad);
  bad = good;
  bad[bad.size() - 2] = 33;  // an IPv4 prefix of 33 bits
  EXPECT_NE(refusal(bad).find("prefix /33"), std::string::npos) << refusal(bad);
  bad = good;
  bad.back() = 2;
  EXPECT_NE(refusal(bad).find("endpoint flag 2"), std::string::npos) << refusal(bad);
  bad = ew::encode(ew::rails(0, 0, {port("rxe0", "198.18.0.2", 24)}));
  bad.back() = 1;  // an endpoint, but no port to reach it at
  EXPECT_NE(refusal(bad).find("without a listen port"), std::string::npos) << refusal(bad);
  EXPECT_THROW((void)ew::encode(ew::rails(1, 0xff, std::vector<rdmakit::detail::RailPort>(17, port("r", "1.2.3.4", 8)))),
               rdmakit::Error);
}

// Which local ports carry rails to a peer, and why the others do not.
TEST(Rails, EveryLocalPortThatReachesAPeerPortWithAnEndpointIsARail) {
  using rdmakit::detail::match_rails;
  auto l0 = port("rxe0", "198.18.0.2", 24), l1 = port("rxe1", "198.18.1.2", 24), l2 = port("rxe2", "10.0.0.2", 8);
  auto p0 = port("rxe0", "198.18.0.3", 24), p1 = port("rxe1", "198.18.1.3", 24);
  p0.endpoint = "198.18.0.3:1";
  p1.endpoint = "198.18.1.3:1";
  const auto m = match_rails({l0, l1, l2}, {p0, p1}, "rxe0", 1, 0, 16);
  ASSERT_EQ(m.rails.size(), 1u);
  EXPECT_EQ(m.rails[0].local.device, "rxe1");
  EXPECT_EQ(m.rails[0].peer.endpoint, "198.18.1.3:1");
  ASSERT_EQ(m.unused.size(), 1u);
  EXPECT_NE(m.unused[0].reason.find("no port of the peer is on 10.0.0.0/8"), std::string::npos) << m.unused[0].reason;
  // The peer's port on that subnet has no endpoint (its listener is bound elsewhere).
  p1.endpoint.clear();
  const auto none = match_rails({l0, l1}, {p0, p1}, "rxe0", 1, 0, 16);
  EXPECT_TRUE(none.rails.empty());
  ASSERT_EQ(none.unused.size(), 1u);
  EXPECT_NE(none.unused[0].reason.find("has no endpoint"), std::string::npos);
  // Another family, or another prefix length, does not reach.
  EXPECT_FALSE(rdmakit::detail::reaches(port("a", "198.18.1.2", 24), port("b", "198.18.1.3", 16)));
  EXPECT_FALSE(rdmakit::detail::reaches(port("a", "198.18.1.2", 24), port("b", "fd00::2", 24)));
  EXPECT_TRUE(rdmakit::detail::reaches(port("a", "fd00::1", 64), port("b", "fd00::2", 64)));
  // Two local ports on one subnet, one peer port there: both use it; the limit is kept.
  p1.endpoint = "198.18.1.3:1";
  auto l1b = port("rxe3", "198.18.1.9", 24);
  EXPECT_EQ(match_rails({l0, l1, l1b}, {p0, p1}, "rxe0", 1, 0, 16).rails.size(), 2u);
  const auto capped = match_rails({l0, l1, l1b}, {p0, p1}, "rxe0", 1, 0, 1);
  EXPECT_EQ(capped.rails.size(), 1u);
  ASSERT_EQ(capped.unused.size(), 1u);
  EXPECT_NE(capped.unused[0].reason.find("rail limit"), std::string::npos);
}

TEST(EngineWire, EncodeRefusesWhatCannotBeDecoded) {
  EXPECT_THROW((void)ew::encode(ew::ident(std::string(65, 'x'), 1)), rdmakit::Error);
  EXPECT_THROW((void)ew::encode(ew::withdraw("")), rdmakit::Error);
  EXPECT_THROW((void)ew::encode(ew::notify(std::vector<std::uint8_t>(901))), rdmakit::Error);
  EXPECT_THROW((void)ew::encode(ew::notify({}, std::string(65, 'r'))), rdmakit::Error);
}
