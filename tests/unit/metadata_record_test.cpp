// SPDX-License-Identifier: Apache-2.0
// The engine record's format: it round-trips, and anything else from a store is refused clearly.
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "metadata/record.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/identity.hpp"

namespace rdmakit::detail::metadata {
namespace {

EngineRecord sample() {
  return {"kv-server",
          0x1234abcd5678ull,
          {"10.0.0.7:7600", "[fd00::7]:7600"},
          {{"rxe0", 1, "ethernet", "::ffff:198.18.0.1", "198.18.0.0/24"},
           {"rxe1", 1, "ethernet", "::ffff:198.18.1.1", "198.18.1.0/24"}},
          {{"kv", 1 << 30, "host"}, {"weights", 4096, "cuda"}},
          {},
          {}};
}

TEST(EngineRecord, RoundTrips) {
  const EngineRecord r = sample();
  EXPECT_EQ(decode(encode(r), "test", "kv-server"), r);
  EXPECT_EQ(engine_key("prod", "kv-server"), "rdmakit/prod/engines/kv-server");
  EXPECT_EQ(engine_key("prod", "x").rfind(engines_prefix("prod"), 0), 0u);
}

// An engine's public key (its identity) round-trips as "identity"; one that is not a key is
// refused with the reason.
TEST(EngineRecord, AnIdentityRoundTripsAndABadOneIsRefused) {
  EngineRecord r = sample();
  r.public_key = Identity::generate().public_key();
  EXPECT_EQ(decode(encode(r), "test", "kv-server"), r);
  EXPECT_NE(encode(r).find("\"identity\":\"ed25519:"), std::string::npos);
  std::string text = encode(r);
  text.replace(text.find("ed25519:"), 8, "ed448:xx");
  try {
    (void)decode(text, "test", "kv-server");
    ADD_FAILURE() << "a record with a bad identity was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"identity\" is not a public key"), std::string::npos) << e.what();
  }
}

// The transports an engine offers round-trip, best first; a record without them (an rdmakit of
// before) reads as none listed; a name this version does not know is kept; what is not a name
// is dropped and the record kept (the engine is still found by name).
TEST(EngineRecord, TransportsRoundTripAndWhatIsNotANameIsDropped) {
  EngineRecord r = sample();
  EXPECT_EQ(encode(r).find("transports"), std::string::npos);
  r.transports = {"shm", "rdma", "tcp"};
  EXPECT_EQ(decode(encode(r), "test", "kv-server"), r);
  EXPECT_NE(encode(r).find(R"("transports":["shm","rdma","tcp"])"), std::string::npos) << encode(r);
  std::string text = encode(r);
  text.replace(text.find("\"tcp\""), 5, "\"quic\"");
  EXPECT_EQ(decode(text, "test", "kv-server").transports.back(), "quic");
  const std::vector<std::pair<const char*, std::vector<std::string>>> cases = {
      {R"("transports":["shm","rdma",7])", {"shm", "rdma"}},
      {R"("transports":"rdma")", {}},
      {R"("transports":["shm","rdma",""])", {"shm", "rdma"}},
      {R"("transports":["tcp","tcp","shm"])", {"tcp", "shm"}},
      {R"("transports":["\u001b[31mrdma","UPPER","a-very-long-transport-name","tcp"])", {"tcp"}},
      {R"("transports":["a","b","c","d","e","f","g","h","i"])", {"a", "b", "c", "d", "e", "f", "g", "h"}},
      {R"("transports":[])", {}},
  };
  for (const auto& [bad, kept] : cases) {
    std::string t = encode(r);
    t.replace(t.find(R"("transports":["shm","rdma","tcp"])"), std::string_view(R"("transports":["shm","rdma","tcp"])").size(), bad);
    EngineRecord got;
    ASSERT_NO_THROW(got = decode(t, "test", "kv-server")) << t;
    EXPECT_EQ(got.transports, kept) << t;
    EXPECT_EQ(got.segments, r.segments) << t;
  }
}

TEST(EngineRecord, NeverCarriesKeysOrAddressesOfMemory) {
  const std::string text = encode(sample());
  for (const char* word : {"rkey", "lkey", "addr\"", "key\""}) {
    EXPECT_EQ(text.find(word), std::string::npos) << word << " in " << text;
  }
}

// A record of version 1 (an engine not upgraded yet) is read: its segments were objects.
TEST(EngineRecord, VersionOneIsReadDuringAnUpgrade) {
  const std::string v1 =
      R"({"v":1,"name":"kv-server","epoch":7,"endpoints":["10.0.0.7:7600"],"rails":[],)"
      R"("segments":[{"name":"kv","length":4096,"memory":"host"}]})";
  const EngineRecord r = decode(v1, "test", "kv-server");
  ASSERT_EQ(r.segments.size(), 1u);
  EXPECT_EQ(r.segments[0].name, "kv");
  EXPECT_EQ(r.segments[0].length, 4096u);
}

TEST(EngineRecord, BadInputIsRefusedWithTheReason) {
  const std::string good = encode(sample());
  struct Case {
    std::string text;
    const char* why;
  };
  std::string other_version = good;
  other_version.replace(other_version.find("\"v\":2"), 5, "\"v\":3");
  const Case cases[] = {
      {"", "not a JSON object"},
      {"[1,2]", "not a JSON object"},
      {"{\"v\":1", "not a JSON object"},
      {other_version, "format version 3"},
      {R"({"v":1,"name":"kv-server","epoch":1,"endpoints":[],"rails":[],"segments":[{"name":"s","length":1}]})", "\"memory\""},
      {R"({"v":2,"name":"kv-server","epoch":-1,"endpoints":[],"rails":[],"segments":[]})", "\"epoch\""},
      {R"({"v":2,"name":"other","epoch":1,"endpoints":[],"rails":[],"segments":[]})", "is engine \"other\"'s, not \"kv-server\"'s"},
      {R"({"v":2,"name":"kv-server","epoch":1,"endpoints":[3],"rails":[],"segments":[]})", "endpoint"},
      {R"({"v":2,"name":"kv-server","epoch":1,"endpoints":[],"rails":[{"device":"d"}],"segments":[]})", "\"port\""},
      {R"({"v":2,"name":"kv-server","epoch":1,"endpoints":[],"rails":[],"segments":{}})", "\"segments\""},
      {R"({"v":2,"name":"kv-server","epoch":1,"endpoints":[],"rails":[],"segments":[["s",1]]})", "[name, length, memory]"},
      {R"({"v":2,"name":"kv-server","epoch":1,"endpoints":[],"rails":[],"segments":[{"name":"s","length":1,"memory":"host"}]})", "[name, length, memory]"},
      {R"({"v":2,"name":")" + std::string(300, 'x') + R"(","epoch":1})", "longer than"},
  };
  for (const Case& c : cases) {
    try {
      (void)decode(c.text, "redis://h:1 key k", "kv-server");
      ADD_FAILURE() << "accepted: " << c.text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.why), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("redis://h:1 key k"), std::string::npos) << e.what();
    }
  }
}

// A serving engine's segments (one per layer for K and V, per model): 10,000 of them round-trip
// in a record that fits etcd's default request size, and more than a record holds is refused
// when written, never published unreadable.
TEST(EngineRecord, TenThousandSegmentsFitAndMoreAreRefusedWhenWritten) {
  EngineRecord r = sample();
  r.segments.clear();
  for (int i = 0; i < 10000; ++i) r.segments.push_back({"model-a/layer-" + std::to_string(i), 1u << 20, "cuda"});
  const std::string text = encode(r);
  EXPECT_LT(text.size(), 1'500'000u);
  EXPECT_EQ(decode(text, "test", "kv-server"), r);
  r.segments.resize(16385, r.segments.front());
  EXPECT_THROW((void)encode(r), Error);
  std::string more;
  for (int i = 0; i < 6400; ++i) more += R"(,["x",1,"host"])";
  std::string big = text;
  big.insert(big.rfind(']'), more);  // the segments list closes last (the keys are sorted)
  try {
    (void)decode(big, "etcd key k", "kv-server");
    ADD_FAILURE() << "a record of more than 16384 segments was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 16384"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rdmakit::detail::metadata
