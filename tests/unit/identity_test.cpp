// SPDX-License-Identifier: Apache-2.0
// Engine identities: key pairs and their files, the public key's text, signatures, what an IDENT
// carries and what its signature covers, and the session binding both ends share.
#include "rdmakit/identity.hpp"

#include <sodium.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "bootstrap/auth.hpp"
#include "bootstrap/channel.hpp"

#include "bootstrap/identity.hpp"
#include "bootstrap/session.hpp"
#include "engine/protocol.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace {

namespace ew = rdmakit::detail::engine_wire;
using rdmakit::Identity;

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const rdmakit::Error& e) {
    return e.what();
  }
  return "";
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string temp_path(const char* what) {
  return "/tmp/rdmakit-identity-" + std::to_string(::getpid()) + "-" + what;
}

}  // namespace

TEST(Identity, SavedAndReadBackItIsTheSameKeyPair) {
  const std::string path = temp_path("saved");
  ::unlink(path.c_str());
  ::unlink((path + ".pub").c_str());
  const Identity id = Identity::generate();
  ASSERT_FALSE(id.empty());
  ASSERT_EQ(id.public_key().size(), 8u + 43u) << id.public_key();
  EXPECT_EQ(id.public_key().rfind("ed25519:", 0), 0u);
  id.save(path);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat((path + ".pub").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_EQ(slurp(path + ".pub"), id.public_key() + "\n");
  EXPECT_EQ(slurp(path).find(id.public_key().substr(8)), std::string::npos) << "the secret file holds the public key";
  const Identity back = Identity::from_file(path);
  EXPECT_EQ(back.public_key(), id.public_key());
  // Never overwritten.
  EXPECT_NE(error_of([&] { Identity::generate().save(path); }).find("exists already"), std::string::npos);
  // Open to others: refused, as a key file is.
  ::chmod(path.c_str(), 0640);
  EXPECT_NE(error_of([&] { (void)Identity::from_file(path); }).find("chmod 600"), std::string::npos);
  ::unlink(path.c_str());
  ::unlink((path + ".pub").c_str());
}

TEST(Identity, APreSharedKeyFileIsNotAnIdentity) {
  const std::string path = temp_path("psk");
  ::unlink(path.c_str());
  rdmakit::generate_key_file(path);
  EXPECT_NE(error_of([&] { (void)Identity::from_file(path); }).find("not an rdmakit identity file"), std::string::npos);
  ::unlink(path.c_str());
}

TEST(Identity, TheSameSeedIsTheSameIdentityAndSignaturesVerifyOnlyAsMade) {
  const std::vector<std::uint8_t> seed(32, 7);
  const Identity a = Identity::from_seed(seed);
  EXPECT_EQ(a.public_key(), Identity::from_seed(seed).public_key());
  EXPECT_NE(a.public_key(), Identity::from_seed(std::vector<std::uint8_t>(32, 8)).public_key());
  EXPECT_NE(error_of([] { (void)Identity::from_seed(std::vector<std::uint8_t>(31, 7)); }).find("31 bytes"), std::string::npos);
  const std::vector<std::uint8_t> msg = {1, 2, 3};
  const auto sig = a.sign(msg);
  ASSERT_EQ(sig.size(), 64u);
  const auto pub = rdmakit::detail::decode_public_key(a.public_key());
  ASSERT_TRUE(pub.has_value());
  EXPECT_TRUE(rdmakit::detail::verify_signature(*pub, msg, sig));
  EXPECT_FALSE(rdmakit::detail::verify_signature(*pub, std::vector<std::uint8_t>{1, 2, 4}, sig));
  auto bent = sig;
  bent[10] ^= 1;
  EXPECT_FALSE(rdmakit::detail::verify_signature(*pub, msg, bent));
  EXPECT_FALSE(rdmakit::detail::verify_signature(*pub, msg, std::span(sig).first(63)));
  // Copies and moves keep the pair; a moved-from one is empty.
  Identity c = a;
  EXPECT_EQ(c.public_key(), a.public_key());
  Identity d = std::move(c);
  EXPECT_TRUE(c.empty());  // NOLINT(bugprone-use-after-move): what a move leaves is specified
  EXPECT_EQ(d.sign(msg), sig);  // Ed25519 is deterministic
  EXPECT_THROW((void)Identity{}.sign(msg), rdmakit::Error);
}

TEST(Identity, OnlyAWellFormedPublicKeyIsOne) {
  const std::string good = Identity::generate().public_key();
  EXPECT_NO_THROW(rdmakit::check_public_key(good));
  for (const std::string& bad : {std::string(""), std::string("ed25519:"), good.substr(0, good.size() - 1),
                                 good + "A", "ed448:" + good.substr(8), good.substr(0, 20) + "+" + good.substr(21),
                                 std::string("ed25519:") + std::string(43, '='),
                                 // Zero: a point of small order, no one's key.
                                 std::string("ed25519:") + std::string(43, 'A')}) {
    EXPECT_NE(error_of([&] { rdmakit::check_public_key(bad); }).find("is not a public key"), std::string::npos) << bad;
  }
}

TEST(Identity, AnIdentRoundTripsWithItsKeyAndSignature) {
  const Identity id = Identity::generate();
  const auto pub = *rdmakit::detail::decode_public_key(id.public_key());
  ew::Message m = ew::ident("kv-0", 42);
  m.public_key.assign(pub.begin(), pub.end());
  const std::array<std::uint8_t, 32> binding{9, 9, 9};
  m.signature = id.sign(ew::ident_transcript(binding, true, "kv-0", 42, m.public_key));
  const ew::Message back = ew::decode(ew::encode(m));
  EXPECT_EQ(back.name, "kv-0");
  EXPECT_EQ(back.epoch, 42u);
  EXPECT_EQ(back.public_key, m.public_key);
  EXPECT_EQ(back.signature, m.signature);
  // An unsigned IDENT is two zero lengths longer than a bare name and epoch.
  EXPECT_EQ(ew::encode(ew::ident("kv-0", 42)).size(), 3u + 8u + 1u + 4u + 2u);
  // The signature covers the session, the side, the name, the epoch and the key: any other
  // value of any of them and it does not verify.
  const auto verify = [&](std::span<const std::uint8_t> b, bool initiator, const std::string& name, std::uint64_t epoch) {
    return rdmakit::detail::verify_signature(pub, ew::ident_transcript(b, initiator, name, epoch, m.public_key), m.signature);
  };
  EXPECT_TRUE(verify(binding, true, "kv-0", 42));
  const std::array<std::uint8_t, 32> other{9, 9, 8};
  EXPECT_FALSE(verify(other, true, "kv-0", 42));
  EXPECT_FALSE(verify(binding, false, "kv-0", 42));
  EXPECT_FALSE(verify(binding, true, "kv-1", 42));
  EXPECT_FALSE(verify(binding, true, "kv-0", 43));
  const auto other_key = *rdmakit::detail::decode_public_key(Identity::generate().public_key());
  EXPECT_FALSE(rdmakit::detail::verify_signature(
      other_key, ew::ident_transcript(binding, true, "kv-0", 42, std::vector<std::uint8_t>(other_key.begin(), other_key.end())),
      m.signature));
}

TEST(Identity, AMalformedIdentIsRefused) {
  ew::Message m = ew::ident("kv-0", 1);
  m.public_key.assign(32, 1);  // a key without a signature
  EXPECT_THROW((void)ew::encode(m), rdmakit::Error);
  auto bytes = ew::encode(ew::ident("kv-0", 1));
  bytes[bytes.size() - 2] = 31;  // a key length that is not 0 or 32
  bytes.insert(bytes.end() - 1, 31, 0);
  try {
    (void)ew::decode(bytes);
    ADD_FAILURE() << "a 31-byte key was decoded";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("public key of 31 bytes"), std::string::npos) << e.what();
  }
  bytes = ew::encode(ew::ident("kv-0", 1));
  bytes[bytes.size() - 2] = 32;  // a key, then the message ends
  EXPECT_THROW((void)ew::decode(bytes), rdmakit::Error);
}

TEST(Identity, BothEndsOfASessionShareItsBindingAndNoOtherSessionHasIt) {
  using rdmakit::detail::Role;
  using rdmakit::detail::Session;
  const std::vector<std::uint8_t> psk(32, 0x42);
  const std::array<std::uint8_t, 64> hc{1}, hs{2};
  const std::array<std::uint8_t, 32> dh{3}, other_dh{4};
  const Session c(psk, hc, hs, Role::client, dh), s(psk, hc, hs, Role::server, dh);
  EXPECT_TRUE(std::equal(c.binding().begin(), c.binding().end(), s.binding().begin()));
  // Another shared secret (a relay that holds the PSK but not an end's ephemeral secret), or
  // other hellos: another binding.
  const Session relayed(psk, hc, hs, Role::client, other_dh);
  EXPECT_FALSE(std::equal(c.binding().begin(), c.binding().end(), relayed.binding().begin()));
  const Session other(psk, hs, hc, Role::client, dh);
  EXPECT_FALSE(std::equal(c.binding().begin(), c.binding().end(), other.binding().begin()));
}

// What a handshake yields: both ends share a binding (a real handshake over a socket pair), and
// a holder of the PSK who saw every byte of it (here: the client's side done by hand, with its
// ephemeral secret known) cannot open the session's frames without the X25519 secret: the keys
// are the PSK's and the ephemeral exchange's, not the PSK's alone. A low-order ephemeral key is
// refused.
TEST(Identity, ASessionsKeysNeedTheEphemeralSecretAsWellAsThePsk) {
  namespace d = rdmakit::detail;
  using rdmakit::wire::MessageType;
  ASSERT_GE(::sodium_init(), 0);
  const std::vector<std::uint8_t> psk(32, 0x42);
  const auto pair = [] {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    return std::make_pair(std::make_unique<d::TcpChannel>(d::Fd(sv[0])), std::make_unique<d::TcpChannel>(d::Fd(sv[1])));
  };
  const auto deadline = [] { return d::deadline_in(std::chrono::seconds{5}); };
  {
    auto [c, s] = pair();
    std::unique_ptr<d::Session> server;
    std::thread t([&, ch = s.get()] {
      server = d::authenticate_server(*ch, psk, d::recv_message(*ch, deadline()), deadline(), "client");
    });
    const auto client = d::authenticate_client(*c, psk, deadline(), "server");
    t.join();
    ASSERT_TRUE(server);
    EXPECT_TRUE(std::equal(client->binding().begin(), client->binding().end(), server->binding().begin()));
  }
  auto [c, s] = pair();
  std::thread t([&, ch = s.get()] {
    try {
      auto session = d::authenticate_server(*ch, psk, d::recv_message(*ch, deadline()), deadline(), "client");
      d::send_control(*ch, session.get(), MessageType::user, std::vector<std::uint8_t>{'h', 'i'}, deadline());
    } catch (const std::exception&) {
    }
  });
  // The client's hello by hand: a nonce and an ephemeral key whose secret this test holds.
  std::array<std::uint8_t, 32> eph_secret{}, eph_public{};
  ::randombytes_buf(eph_secret.data(), eph_secret.size());
  ::crypto_scalarmult_base(eph_public.data(), eph_secret.data());
  std::array<std::uint8_t, 64> hello_c{};
  ::randombytes_buf(hello_c.data(), 32);
  std::copy(eph_public.begin(), eph_public.end(), hello_c.begin() + 32);
  d::send_control(*c, nullptr, MessageType::auth_challenge, hello_c, deadline());
  const d::Message reply = d::recv_message(*c, deadline());
  ASSERT_EQ(reply.payload.size(), 96u);
  std::array<std::uint8_t, 64> hello_s{};
  std::copy_n(reply.payload.begin(), 64, hello_s.begin());
  std::array<std::uint8_t, 32> proof{};
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, psk.data(), psk.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>("rdmakit client"), 14);
  crypto_auth_hmacsha256_update(&st, hello_c.data(), hello_c.size());
  crypto_auth_hmacsha256_update(&st, hello_s.data(), hello_s.size());
  crypto_auth_hmacsha256_final(&st, proof.data());
  d::send_control(*c, nullptr, MessageType::auth_proof, proof, deadline());
  const d::Message sealed = d::recv_message(*c, deadline());
  t.join();
  std::array<std::uint8_t, 32> dh{};
  ASSERT_EQ(::crypto_scalarmult(dh.data(), eph_secret.data(), hello_s.data() + 32), 0);
  const std::array<std::uint8_t, 32> no_dh{};
  EXPECT_FALSE(d::Session(psk, hello_c, hello_s, d::Role::client, no_dh).open(sealed.header, sealed.payload).has_value())
      << "the PSK and the hellos alone opened the session";
  const auto opened = d::Session(psk, hello_c, hello_s, d::Role::client, dh).open(sealed.header, sealed.payload);
  ASSERT_TRUE(opened.has_value()) << "the PSK and the shared secret did not open it";
  EXPECT_EQ(opened->payload, (std::vector<std::uint8_t>{'h', 'i'}));

  // A low-order ephemeral key (zero) is refused before the server answers with anything else.
  auto [c2, s2] = pair();
  std::string refused;
  std::thread t2([&, ch = s2.get()] {
    try {
      (void)d::authenticate_server(*ch, psk, d::recv_message(*ch, deadline()), deadline(), "client");
    } catch (const rdmakit::Error& e) {
      refused = e.what();
    }
  });
  std::array<std::uint8_t, 64> low{};
  low[0] = 1;  // a nonce; the key (bytes 32..63) is zero, a point of low order
  d::send_control(*c2, nullptr, MessageType::auth_challenge, low, deadline());
  t2.join();
  EXPECT_NE(refused.find("low order"), std::string::npos) << refused;
}
