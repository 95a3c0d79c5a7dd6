// SPDX-License-Identifier: Apache-2.0
// Rolling upgrades (docs/compatibility.md): this version's bootstrap against the previous
// version's, frozen in tests/compat/wire_v6.cpp, over a socket pair: the key exchange and sealed
// frames both ways in version 6, a previous-version server's refusal that makes this side's
// client fall back, and versions neither speaks refused naming both. Whole connections (a QP
// in RTS against a version-6 peer) run in the lab (tests/rxe/compat_test.cpp).
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <fmt/format.h>

#include "../compat/wire_v6.hpp"
#include "bootstrap/auth.hpp"
#include "bootstrap/channel.hpp"
#include "bootstrap/session.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/wire.hpp"

// Named, not anonymous: the unit tests are compiled in unity batches, where another file's
// anonymous Pair or kPsk would be this one's.
namespace compat_unit {

namespace d = rdmakit::detail;
namespace wire = rdmakit::wire;
using namespace std::chrono_literals;

const std::vector<std::uint8_t> kPsk(32, 0x5a);

// A connected pair: this version's channel, and the frozen peer's socket.
struct Pair {
  std::unique_ptr<d::TcpChannel> ours;
  int theirs = -1;
  Pair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    ours = std::make_unique<d::TcpChannel>(d::Fd(fds[0]));
    theirs = fds[1];
  }
  ~Pair() { ::close(theirs); }
};

wire::EndpointInfo sample(bool engine) {
  wire::EndpointInfo e;
  e.qpn = 0x1234;
  e.psn = 0x77;
  e.gid[10] = e.gid[11] = 0xff;
  e.gid[12] = 10;
  e.mtu = 1024;
  e.max_rd_atomic = e.max_dest_rd_atomic = 4;
  e.regions.push_back({0x10000, 4096, 0x99, rdmakit::Access::remote_write});
  if (engine) {
    e.flags = wire::kFlagTransports;  // as a decoded HELLO has it
    e.transport.emplace();
    e.transport->kinds = {wire::LinkTransport::rdma, wire::LinkTransport::tcp};
    e.transport->streams = 2;
    e.transport->engine_protocol = 7;
  }
  return e;
}

compat::v6::Hello frozen(const wire::EndpointInfo& e) {
  compat::v6::Hello h;
  h.qpn = e.qpn;
  h.psn = e.psn;
  h.gid = e.gid;
  h.mtu = static_cast<std::uint16_t>(e.mtu);
  h.max_rd_atomic = e.max_rd_atomic;
  h.max_dest_rd_atomic = e.max_dest_rd_atomic;
  for (const auto& r : e.regions) h.regions.push_back({r.addr, r.length, r.rkey, static_cast<std::uint32_t>(r.access)});
  if (e.transport) {
    h.has_block = true;
    for (const auto k : e.transport->kinds) h.kinds.push_back(static_cast<std::uint8_t>(k));
    h.streams = e.transport->streams;
  }
  return h;
}

TEST(Compat, HeadersOfEitherVersionDecodeAndOthersAreRefusedNamingBoth) {
  for (const std::uint16_t v : {wire::kPreviousVersion, wire::kVersion}) {
    EXPECT_EQ(wire::decode_header(wire::encode_header(wire::MessageType::ready, 0, v)).version, v);
    EXPECT_EQ(wire::try_decode_header(wire::encode_header(wire::MessageType::ready, 0, v))->version, v);
  }
  for (const std::uint16_t v : {std::uint16_t{5}, std::uint16_t{8}}) {
    const auto bytes = wire::encode_header(wire::MessageType::ready, 0, v);
    EXPECT_FALSE(wire::try_decode_header(bytes));
    try {
      (void)wire::decode_header(bytes);
      ADD_FAILURE() << v;
    } catch (const rdmakit::Error& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("peer speaks {}, this side speaks 6 and 7", v)), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(v < 6 ? "upgrade the peer" : "upgrade this side"), std::string::npos) << e.what();
    }
  }
  // Version 6's frozen encoder: every message it makes decodes here, in version 6.
  EXPECT_EQ(wire::decode_header(compat::v6::message(compat::v6::ready, {})).version, 6);
}

TEST(Compat, HellosCrossBetweenTheVersionsFieldByField) {
  for (const bool engine : {false, true}) {
    const wire::EndpointInfo e = sample(engine);
    // The frozen encoder's HELLO reads here as version 6 (a transport block without an engine
    // protocol byte: a peer of version 6 speaks engine protocol 7).
    const auto v6 = compat::v6::encode_hello(frozen(e));
    const wire::EndpointInfo read = wire::decode_hello(v6, 6);
    EXPECT_EQ(read, e) << engine;
    // This side's HELLO in version 6 is byte for byte the frozen encoder's, and reads there.
    const auto ours = wire::encode_hello(e, 6);
    EXPECT_EQ(std::vector<std::uint8_t>(ours.begin() + wire::kHeaderSize, ours.end()), v6) << engine;
    EXPECT_EQ(wire::decode_header(ours).version, 6);
    EXPECT_NO_THROW((void)compat::v6::decode_hello(v6));
    // In version 7 the block has the engine protocol byte; version 6 refuses such a HELLO.
    const auto v7 = wire::encode_hello(e, 7);
    EXPECT_EQ(wire::decode_hello(std::span(v7).subspan(wire::kHeaderSize), 7), e);
    if (engine) {
      EXPECT_EQ(v7.size(), ours.size() + 1);
      EXPECT_THROW((void)compat::v6::decode_hello(std::span(v7).subspan(wire::kHeaderSize)), std::runtime_error);
    }
  }
}

// A client of version 6 (frozen) and this side's server: the key exchange in version 6, then
// sealed frames both ways in version 6.
TEST(Compat, APreviousVersionClientIsAuthenticatedAndSealedInItsVersion) {
  Pair p;
  std::string failed;
  std::thread client([&] {
    try {
      compat::v6::Peer peer(p.theirs, kPsk);
      peer.authenticate_client();
      peer.send(compat::v6::hello, compat::v6::encode_hello(frozen(sample(true))));
      const compat::v6::Received r = peer.recv();
      if (r.type != compat::v6::hello) throw std::runtime_error("no HELLO back");
      const compat::v6::Hello h = compat::v6::decode_hello(r.payload);
      if (h.qpn != 0x4321 || !h.has_block || h.kinds != std::vector<std::uint8_t>{1}) throw std::runtime_error("a wrong HELLO");
      peer.send(compat::v6::user, std::vector<std::uint8_t>{1, 2, 3});
    } catch (const std::exception& e) {
      failed = e.what();
    }
  });
  const auto deadline = d::deadline_in(5s);
  d::Message first = d::recv_message(*p.ours, deadline);
  EXPECT_EQ(p.ours->version(), 6);  // recv_message took the client's version from its header
  EXPECT_EQ(first.header.version, 6);
  auto session = d::authenticate_server(*p.ours, kPsk, first, deadline, "v6 client");
  ASSERT_EQ(session->version(), 6);
  d::Message hello = d::recv_control(*p.ours, session.get(), deadline, "v6 client");
  const wire::EndpointInfo theirs = wire::decode_hello(hello.payload, 6);
  EXPECT_EQ(theirs, sample(true));
  EXPECT_EQ(theirs.transport->engine_protocol, wire::kEngineProtocolOfVersion6);
  wire::EndpointInfo mine = sample(true);
  mine.qpn = 0x4321;
  mine.transport->kinds = {wire::LinkTransport::rdma};
  const auto reply = wire::encode_hello(mine, 6);
  d::send_control(*p.ours, session.get(), wire::MessageType::hello, std::span(reply).subspan(wire::kHeaderSize), deadline);
  const d::Message user = d::recv_control(*p.ours, session.get(), deadline, "v6 client");
  EXPECT_EQ(user.header.type, wire::MessageType::user);
  EXPECT_EQ(user.payload, (std::vector<std::uint8_t>{1, 2, 3}));
  client.join();
  EXPECT_EQ(failed, "");
}

// This side's client and a server of version 6 (frozen): the first try, in version 7, is
// refused as version 6 refused it; the client then speaks version 6 and gets through.
TEST(Compat, AClientFallsBackOnceToAPreviousVersionServer) {
  for (const bool keyed : {false, true}) {
    const std::vector<std::uint8_t> psk = keyed ? kPsk : std::vector<std::uint8_t>{};
    std::string refused, failed;
    {
      Pair p;
      std::thread server([&] {
        try {
          compat::v6::Peer peer(p.theirs, psk);
          if (peer.serve_first(&refused)) failed = "version 7 was served";
        } catch (const std::exception& e) {
          failed = e.what();
        }
      });
      const auto deadline = d::deadline_in(5s);
      p.ours->set_version(wire::kVersion);
      try {
        if (keyed) {
          (void)d::authenticate_client(*p.ours, kPsk, deadline, "v6 server");
        } else {
          const auto hello = wire::encode_hello(sample(false));
          d::send_control(*p.ours, nullptr, wire::MessageType::hello, std::span(hello).subspan(wire::kHeaderSize), deadline);
          d::check_version_refusal(*p.ours, d::recv_control(*p.ours, nullptr, deadline, "v6 server"), "v6 server");
        }
        ADD_FAILURE() << "no refusal";
      } catch (const d::VersionRefused& e) {
        EXPECT_EQ(e.version, 6);
        EXPECT_NE(std::string(e.what()).find("speaks wire version 6 and refused 7"), std::string::npos) << e.what();
      }
      server.join();
      EXPECT_NE(refused.find("peer speaks 7, this side speaks 6"), std::string::npos) << refused;
      EXPECT_EQ(failed, "") << keyed;
    }
    Pair p;
    std::thread server([&] {
      try {
        compat::v6::Peer peer(p.theirs, psk);
        if (!peer.serve_first(&refused)) throw std::runtime_error("version 6 was refused: " + refused);
        const compat::v6::Received r = peer.recv();
        if (r.type != compat::v6::hello) throw std::runtime_error("no HELLO");
        (void)compat::v6::decode_hello(r.payload);
        compat::v6::Hello mine = frozen(sample(false));
        mine.qpn = 0x4321;
        peer.send(compat::v6::hello, compat::v6::encode_hello(mine));
        if (peer.recv().type != compat::v6::ready) throw std::runtime_error("no READY");
      } catch (const std::exception& e) {
        failed = e.what();
      }
    });
    const auto deadline = d::deadline_in(5s);
    p.ours->set_version(wire::kPreviousVersion);
    std::unique_ptr<d::Session> session;
    if (keyed) {
      session = d::authenticate_client(*p.ours, kPsk, deadline, "v6 server");
      EXPECT_EQ(session->version(), 6);
    }
    const auto hello = wire::encode_hello(sample(false), wire::kPreviousVersion);
    d::send_control(*p.ours, session.get(), wire::MessageType::hello, std::span(hello).subspan(wire::kHeaderSize), deadline);
    const d::Message reply = d::recv_control(*p.ours, session.get(), deadline, "v6 server");
    ASSERT_EQ(reply.header.type, wire::MessageType::hello);
    EXPECT_EQ(reply.header.version, 6);
    EXPECT_EQ(wire::decode_hello(reply.payload, 6).qpn, 0x4321u);
    d::send_control(*p.ours, session.get(), wire::MessageType::ready, {}, deadline);
    server.join();
    EXPECT_EQ(failed, "") << keyed;
  }
}

// A connection keeps its first message's version: a later message in the other (plain, or a
// sealed frame whose headers say another) is refused, and a busy listener's refusal in the
// previous version is not taken for a version's.
TEST(Compat, AConnectionKeepsItsVersion) {
  Pair p;
  p.ours->set_version(6);
  const auto v7 = wire::encode_header(wire::MessageType::ready, 0, 7);
  ASSERT_EQ(::send(p.theirs, v7.data(), v7.size(), 0), static_cast<ssize_t>(v7.size()));
  try {
    (void)d::recv_message(*p.ours, d::deadline_in(2s));
    ADD_FAILURE();
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("a READY in wire version 7 on a connection that speaks 6"), std::string::npos) << e.what();
  }
  // A sealed frame's version is authenticated: the same keys, its header rewritten to the other
  // version (as a relay would), and it does not open, whichever version the receiver speaks.
  const std::array<std::uint8_t, 32> nc{1}, ns{2}, dh{3};
  d::Session six(kPsk, nc, ns, d::Role::client, dh, 6);
  auto frame = six.seal(wire::MessageType::user, std::vector<std::uint8_t>{9});
  {
    d::Session control(kPsk, nc, ns, d::Role::server, dh, 6);  // the frame as sent opens
    EXPECT_TRUE(control.open(wire::decode_header(frame), std::span(frame).subspan(wire::kHeaderSize)).has_value());
  }
  frame[5] = 7;
  for (const std::uint16_t v : {std::uint16_t{6}, std::uint16_t{7}}) {
    d::Session receiver(kPsk, nc, ns, d::Role::server, dh, v);
    // 6: the header says another version; 7: it says the receiver's, but the associated data
    // and the sealed inner header are the sender's, in 6 (either refuses it).
    EXPECT_FALSE(receiver.open(wire::decode_header(frame), std::span(frame).subspan(wire::kHeaderSize)).has_value()) << v;
  }
  const wire::Header busy{wire::MessageType::reject, 10, 6};
  EXPECT_FALSE(wire::refused_version(busy, "busy: 64 handshakes in progress", 7));
  EXPECT_TRUE(wire::refused_version(busy, "... protocol version mismatch: peer speaks 7, this side speaks 6", 7));
  EXPECT_FALSE(wire::refused_version(busy, "... protocol version mismatch", 6));  // no older version to fall to
  // A REJECT is read in any version (a busy listener refuses before it reads the client's);
  // nothing else is.
  EXPECT_EQ(wire::decode_header(wire::encode_reject("busy: later", 9)).version, 9);
  EXPECT_THROW((void)wire::decode_header(wire::encode_header(wire::MessageType::ready, 0, 9)), rdmakit::Error);
  EXPECT_THROW((void)wire::decode_header(wire::encode_header(wire::MessageType::reject, 4096, 9)), rdmakit::Error);
}

// A client that fell back to version 6 because its version 7 was refused, and a server that
// speaks 7: the server's nonce says so under its MAC, and the client refuses it (someone forged
// the refusal). Version 6 clients never look at that nonce's tail (the frozen client above was
// served by a marking server).
TEST(Compat, AForgedRefusalThatDowngradesAKeyedClientIsDetected) {
  Pair p;
  std::thread server([&] {
    try {
      const auto deadline = d::deadline_in(5s);
      d::TcpChannel ch{d::Fd(::dup(p.theirs))};
      const d::Message first = d::recv_message(ch, deadline);  // version 6: the channel's from here on
      (void)d::authenticate_server(ch, kPsk, first, deadline, "client");
    } catch (const std::exception&) {
      // The client refuses it: its proof never comes.
    }
  });
  p.ours->set_version(6);  // as after a VersionRefused
  try {
    (void)d::authenticate_client(*p.ours, kPsk, d::deadline_in(5s), "server");
    ADD_FAILURE() << "the downgrade went unnoticed";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the refusal was forged (a downgrade)"), std::string::npos) << e.what();
  }
  ::shutdown(p.theirs, SHUT_RDWR);
  server.join();
}

}  // namespace compat_unit
