// SPDX-License-Identifier: Apache-2.0
// The keyed session: frames open only in order, only in their direction, only unaltered, and
// only with keys from the same PSK and nonces. The key file format and checks.
#include "bootstrap/session.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "bootstrap/auth.hpp"
#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace {

using rdmakit::detail::Role;
using rdmakit::detail::Session;
using rdmakit::wire::MessageType;

const std::vector<std::uint8_t> kPsk(32, 0x42);
const std::array<std::uint8_t, 32> kNc = {1, 2, 3};
const std::array<std::uint8_t, 32> kNs = {9, 8, 7};
const std::array<std::uint8_t, 32> kDh = {5, 5};

std::vector<std::uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// Splits a sealed frame into its header and payload, as a receiver reads them.
std::pair<rdmakit::wire::Header, std::vector<std::uint8_t>> split(const std::vector<std::uint8_t>& frame) {
  const auto h = rdmakit::wire::decode_header(frame);
  return {h, {frame.begin() + static_cast<long>(rdmakit::wire::kHeaderSize), frame.end()}};
}

struct Pair {
  Session client{kPsk, kNc, kNs, Role::client, kDh};
  Session server{kPsk, kNc, kNs, Role::server, kDh};
};

TEST(Session, FramesOpenInOrderAndCarryTheMessage) {
  Pair p;
  for (int i = 0; i < 3; ++i) {
    const auto frame = p.client.seal(MessageType::user, bytes("message " + std::to_string(i)));
    const auto [h, body] = split(frame);
    EXPECT_EQ(h.type, MessageType::sealed);
    const auto m = p.server.open(h, body);
    ASSERT_TRUE(m.has_value()) << i;
    EXPECT_EQ(m->header.type, MessageType::user);
    EXPECT_EQ(m->payload, bytes("message " + std::to_string(i)));
  }
  // And the other way, with the other key.
  const auto back = split(p.server.seal(MessageType::bye, {}));
  const auto m = p.client.open(back.first, back.second);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->header.type, MessageType::bye);
}

TEST(Session, TheSealedBytesHideThePayload) {
  Pair p;
  const auto secret = bytes("addr 0x7f0000001000 rkey 0x1234");
  const auto frame = p.client.seal(MessageType::hello, secret);
  EXPECT_EQ(std::search(frame.begin(), frame.end(), secret.begin(), secret.end()), frame.end());
  EXPECT_EQ(frame.size(), secret.size() + rdmakit::detail::kSealOverhead + rdmakit::wire::kHeaderSize);
}

TEST(Session, AlteredReplayedReorderedOrReflectedFramesFail) {
  Pair p;
  const auto f0 = split(p.client.seal(MessageType::user, bytes("zero")));
  const auto f1 = split(p.client.seal(MessageType::user, bytes("one")));
  // Reordered: the second before the first.
  EXPECT_FALSE(p.server.open(f1.first, f1.second).has_value());
  // Every single bit flipped in turn: none opens.
  for (std::size_t i = 0; i < f0.second.size(); ++i) {
    for (int bit = 0; bit < 8; bit += 3) {
      auto bad = f0.second;
      bad[i] ^= static_cast<std::uint8_t>(1u << bit);
      EXPECT_FALSE(p.server.open(f0.first, bad).has_value()) << "byte " << i << " bit " << bit;
    }
  }
  // Truncated.
  EXPECT_FALSE(p.server.open({MessageType::sealed, static_cast<std::uint32_t>(f0.second.size() - 1)},
                             {f0.second.data(), f0.second.size() - 1})
                   .has_value());
  // A failed frame consumed nothing: the right one still opens, in order.
  ASSERT_TRUE(p.server.open(f0.first, f0.second).has_value());
  // Replayed.
  EXPECT_FALSE(p.server.open(f0.first, f0.second).has_value());
  ASSERT_TRUE(p.server.open(f1.first, f1.second).has_value());
  // Reflected: the client's own frame sent back to it.
  const auto f2 = split(p.client.seal(MessageType::user, bytes("two")));
  EXPECT_FALSE(p.client.open(f2.first, f2.second).has_value());
  // A plain message is not a sealed one.
  EXPECT_FALSE(p.server.open({MessageType::user, 4}, bytes("abcd")).has_value());
}

TEST(Session, KeysDependOnTheKeyBothNoncesAndTheSharedSecret) {
  Session client(kPsk, kNc, kNs, Role::client, kDh);
  const auto f = split(client.seal(MessageType::user, bytes("x")));
  auto other_nonce = kNs;
  other_nonce[31] ^= 1;
  std::vector<std::uint8_t> other_key = kPsk;
  other_key[0] ^= 1;
  EXPECT_FALSE(Session(kPsk, kNc, other_nonce, Role::server, kDh).open(f.first, f.second).has_value());
  EXPECT_FALSE(Session(other_key, kNc, kNs, Role::server, kDh).open(f.first, f.second).has_value());
  auto other_dh = kDh;
  other_dh[0] ^= 1;
  EXPECT_FALSE(Session(kPsk, kNc, kNs, Role::server, other_dh).open(f.first, f.second).has_value());
  EXPECT_TRUE(Session(kPsk, kNc, kNs, Role::server, kDh).open(f.first, f.second).has_value());
}

// --- key files -------------------------------------------------------------------------------

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/rdmakit-keys-XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() { (void)std::system(("rm -rf " + path).c_str()); }
  std::string file(const std::string& name, const std::vector<std::uint8_t>& content, mode_t mode) const {
    const std::string p = path + "/" + name;
    const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    EXPECT_EQ(::write(fd, content.data(), content.size()), static_cast<ssize_t>(content.size()));
    ::fchmod(fd, mode);
    ::close(fd);
    return p;
  }
};

std::string error_of(const std::string& path) {
  try {
    (void)rdmakit::read_key_file(path);
  } catch (const rdmakit::Error& e) {
    return e.what();
  }
  return {};
}

TEST(KeyFile, IsItsRawBytesWithNothingTrimmed) {
  TempDir d;
  std::vector<std::uint8_t> key(32);
  for (std::size_t i = 0; i < key.size(); ++i) key[i] = static_cast<std::uint8_t>(i * 37);
  key[29] = ' ';
  key[30] = '\n';
  key[31] = 0x20;  // a binary key that ends in what looks like white space
  EXPECT_EQ(rdmakit::read_key_file(d.file("k", key, 0600)), key);
  key.back() = '\n';
  EXPECT_EQ(rdmakit::read_key_file(d.file("k2", key, 0400)), key);
}

TEST(KeyFile, RefusesWhatOthersCouldReadChangeOrRedirect) {
  TempDir d;
  const std::vector<std::uint8_t> key(32, 7);
  EXPECT_NE(error_of(d.file("group", key, 0640)).find("can be read or written by other users (mode 640)"),
            std::string::npos);
  EXPECT_NE(error_of(d.file("other", key, 0604)).find("chmod 600"), std::string::npos);
  const std::string target = d.file("target", key, 0600);
  const std::string link = d.path + "/link";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  EXPECT_NE(error_of(link).find("symbolic link"), std::string::npos) << error_of(link);
  EXPECT_NE(error_of(d.file("short", std::vector<std::uint8_t>(15, 1), 0600)).find("15 bytes; a key needs at least 16"),
            std::string::npos);
  EXPECT_NE(error_of(d.path).find("not a regular file"), std::string::npos) << error_of(d.path);
  if (::geteuid() == 0) {
    // Owned by someone else (only root can make such a file here).
    const std::string theirs = d.file("theirs", key, 0600);
    ASSERT_EQ(::chown(theirs.c_str(), 65534, 65534), 0);
    EXPECT_NE(error_of(theirs).find("belongs to uid 65534"), std::string::npos) << error_of(theirs);
  }
}

TEST(KeyFile, KeygenWritesAFreshKeyWithModeSixHundredAndNeverOverwrites) {
  TempDir d;
  const std::string p = d.path + "/new";
  rdmakit::generate_key_file(p);
  struct stat st {};
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const auto a = rdmakit::read_key_file(p);
  EXPECT_EQ(a.size(), 32u);
  try {
    rdmakit::generate_key_file(p);
    ADD_FAILURE() << "an existing key was overwritten";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("exists already"), std::string::npos) << e.what();
  }
  EXPECT_EQ(rdmakit::read_key_file(p), a);
  const std::string q = d.path + "/other";
  rdmakit::generate_key_file(q);
  EXPECT_NE(rdmakit::read_key_file(q), a);  // fresh randomness each time
}

}  // namespace
