// The engine's messages between linked engines (src/engine/protocol.hpp): every kind round-trips,
// and every malformed field is refused with a reason, never half-read.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/protocol.hpp"
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
  EXPECT_EQ(ew::decode(ew::encode(ew::synced())).kind, ew::Kind::synced);
  const std::vector<std::uint8_t> note(900, 0x5a);
  EXPECT_EQ(ew::decode(ew::encode(ew::notify(note))).bytes, note);
  EXPECT_TRUE(ew::decode(ew::encode(ew::notify({}))).bytes.empty());
}

TEST(EngineWire, FieldsAreBigEndianAtFixedOffsets) {
  const auto b = ew::encode(ew::segment("s", {0x1122334455667788, 0x10, 0xaabbccdd, Access::remote_write}));
  const std::vector<std::uint8_t> want = {0xE7, 1, 2, 1, 's', 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,
                                          0, 0, 0, 0, 0, 0, 0, 0x10, 0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 0, 4};
  EXPECT_EQ(b, want);
}

TEST(EngineWire, MalformedMessagesAreRefusedWithAReason) {
  const auto good = ew::encode(ew::segment("kv", {0x1000, 4096, 7, Access::remote_read}));
  auto bad = good;
  bad[0] = 0;
  EXPECT_NE(refusal(bad).find("bad magic"), std::string::npos);
  bad = good;
  bad[1] = 2;
  EXPECT_NE(refusal(bad).find("version 2"), std::string::npos);
  bad = good;
  bad[2] = 9;
  EXPECT_NE(refusal(bad).find("unknown kind 9"), std::string::npos);
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
}

TEST(EngineWire, EncodeRefusesWhatCannotBeDecoded) {
  EXPECT_THROW((void)ew::encode(ew::ident(std::string(65, 'x'), 1)), rdmakit::Error);
  EXPECT_THROW((void)ew::encode(ew::withdraw("")), rdmakit::Error);
  EXPECT_THROW((void)ew::encode(ew::notify(std::vector<std::uint8_t>(901))), rdmakit::Error);
}
