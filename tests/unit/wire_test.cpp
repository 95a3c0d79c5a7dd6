// SPDX-License-Identifier: Apache-2.0
#include "rdmakit/wire.hpp"

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "rdmakit/error.hpp"

namespace {

using rdmakit::Access;
using rdmakit::Error;
using namespace rdmakit::wire;

EndpointInfo sample() {
  EndpointInfo i;
  i.qpn = 0x000011;
  i.psn = 0xabcdef;
  i.lid = 0;
  i.link_layer = rdmakit::LinkLayer::ethernet;
  i.gid_type = rdmakit::GidType::roce_v2;
  i.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, 1};
  i.gid_index = 1;
  i.mtu = 1024;
  i.max_rd_atomic = 16;
  i.max_dest_rd_atomic = 16;
  i.flags = kFlagAtomics;
  i.regions = {{0x7f0000001000, 65536, 0x1234, Access::remote_read | Access::remote_write},
               {0x7f0000100000, 4096, 0x99, Access::remote_read}};
  return i;
}

std::vector<std::uint8_t> payload_of(const std::vector<std::uint8_t>& msg) {
  return {msg.begin() + kHeaderSize, msg.end()};
}

// Runs `f`, expecting an Error whose message contains `needle`.
template <typename F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
    return;
  }
  ADD_FAILURE() << "no error; expected one containing: " << needle;
}

TEST(Wire, RoundTrip) {
  const EndpointInfo in = sample();
  const auto msg = encode_hello(in);
  ASSERT_EQ(msg.size(), kHeaderSize + kHelloFixedSize + 2 * kRegionSize);
  const Header h = decode_header(msg);
  EXPECT_EQ(h.type, MessageType::hello);
  EXPECT_EQ(h.length, msg.size() - kHeaderSize);
  EXPECT_EQ(decode_hello(payload_of(msg)), in);
}

TEST(Wire, FieldsAreBigEndianAtFixedOffsets) {
  const auto msg = encode_hello(sample());
  // "RDKT", version 7, type HELLO, then the payload length.
  const std::vector<std::uint8_t> header = {'R', 'D', 'K', 'T', 0, 7, 0, 1, 0, 0, 0, 90};
  EXPECT_EQ(std::vector<std::uint8_t>(msg.begin(), msg.begin() + 12), header);
  const std::uint8_t* p = msg.data() + kHeaderSize;
  EXPECT_EQ((std::vector<std::uint8_t>{p, p + 8}),
            (std::vector<std::uint8_t>{0, 0, 0, 0x11, 0, 0xab, 0xcd, 0xef}));  // QPN, PSN
  EXPECT_EQ(p[10], 2);     // Ethernet
  EXPECT_EQ(p[11], 2);     // RoCE v2
  EXPECT_EQ(p[12 + 15], 1);  // last GID byte
  EXPECT_EQ(p[32], 0x04);  // MTU 1024, big-endian u16
  EXPECT_EQ(p[33], 0x00);
  EXPECT_EQ(p[37], 2);     // two regions
  EXPECT_EQ(p[39], 1);     // one QP
  EXPECT_EQ(p[40], 0x00);  // flags: atomics, big-endian u16
  EXPECT_EQ(p[41], 0x01);
  EXPECT_EQ(p[42 + 6], 0x10);  // first region's address 0x00007f0000001000
}

TEST(Wire, RejectAndReady) {
  const auto r = encode_reject("version mismatch");
  EXPECT_EQ(decode_header(r).type, MessageType::reject);
  EXPECT_EQ(decode_reject(payload_of(r)), "version mismatch");
  EXPECT_EQ(decode_reject(std::vector<std::uint8_t>{'a', 0x01}), "a\\x01");
  EXPECT_EQ(decode_header(encode_header(MessageType::ready, 0)).type, MessageType::ready);
}

// An engine link's HELLO: the transports offered (or chosen) after the regions, and the QP
// fields meaningless (zero) when rdma is not among them.
TEST(Wire, TransportBlockRoundTripsAndIsChecked) {
  EndpointInfo in = sample();
  TransportBlock& t = in.transport.emplace();
  t.kinds = {LinkTransport::shm, LinkTransport::tcp, LinkTransport::rdma};
  t.host.fill(7);
  t.pid = 4242;
  t.proof_addr = 0x7fff00001000;
  t.proof.fill(9);
  t.token.fill(3);
  t.streams = 4;
  auto msg = encode_hello(in);
  ASSERT_EQ(msg.size(), kHeaderSize + kHelloFixedSize + 2 * kRegionSize + kTransportBlockSize + 3);
  EndpointInfo out = decode_hello(payload_of(msg));
  EXPECT_EQ(out.flags, kFlagAtomics | kFlagTransports);  // the block's presence is a flag on the wire
  out.flags = in.flags;
  EXPECT_EQ(out, in);
  // Without rdma, a HELLO with no QP is a HELLO.
  EndpointInfo soft;
  soft.transport = TransportBlock{};
  soft.transport->kinds = {LinkTransport::tcp};
  msg = encode_hello(soft);
  out = decode_hello(payload_of(msg));
  EXPECT_EQ(out.qpn, 0u);
  EXPECT_FALSE(out.carries_rdma());
  // With rdma listed, QPN 0 is refused as ever.
  auto bad = encode_hello(in);
  for (std::size_t k = 0; k < 4; ++k) bad[kHeaderSize + k] = 0;
  expect_error([&] { (void)decode_hello(payload_of(bad)); }, "QPN 0x0 out of range");
  // The block's own checks: count, kinds, repeats, length.
  const std::size_t block = kHeaderSize + kHelloFixedSize + 2 * kRegionSize;
  bad = encode_hello(in);
  bad[block] = 0;
  expect_error([&] { (void)decode_hello(payload_of(bad)); }, "absurd transport count 0");
  bad = encode_hello(in);
  bad[block + 1] = 9;
  expect_error([&] { (void)decode_hello(payload_of(bad)); }, "unknown transport 9");
  bad = encode_hello(in);
  bad[block + 2] = 3;
  expect_error([&] { (void)decode_hello(payload_of(bad)); }, "listed twice");
  bad = encode_hello(in);
  bad.push_back(0);
  expect_error([&] { (void)decode_hello(payload_of(bad)); }, "trailing bytes");
  bad = encode_hello(in);
  bad.pop_back();
  expect_error([&] { (void)decode_hello(payload_of(bad)); }, "truncated HELLO");
}

TEST(Wire, StreamRoundTripsAndIsChecked) {
  std::array<std::uint8_t, kTokenSize> token{};
  for (std::size_t i = 0; i < token.size(); ++i) token[i] = static_cast<std::uint8_t>(i);
  const auto msg = encode_stream(token, 3);
  const Header h = decode_header(msg);
  EXPECT_EQ(h.type, MessageType::stream);
  const StreamHello s = decode_stream(payload_of(msg));
  EXPECT_EQ(s.token, token);
  EXPECT_EQ(s.index, 3u);
  expect_error([&] { (void)decode_stream(std::span(msg).subspan(kHeaderSize, 10)); }, "STREAM of 10 bytes");
}

TEST(Wire, HeaderRejections) {
  auto msg = encode_hello(sample());
  expect_error([&] { (void)decode_header(std::span(msg).first(11)); }, "truncated header");
  auto bad = msg;
  bad[0] = 'X';
  expect_error([&] { (void)decode_header(bad); }, "bad magic");
  bad = msg;
  bad[5] = 1;
  expect_error([&] { (void)decode_header(bad); }, "protocol version mismatch: peer speaks 1, this side speaks 6");
  bad = msg;
  bad[7] = 11;
  expect_error([&] { (void)decode_header(bad); }, "unknown message type 11");
  bad = msg;
  bad[8] = 0xff;  // length 0xff00005a
  expect_error([&] { (void)decode_header(bad); }, "oversized HELLO message");
}

TEST(Wire, TryDecodeHeaderAgreesWithDecodeHeader) {
  const auto msg = encode_hello(sample());
  const auto h = try_decode_header(msg);
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->type, MessageType::hello);
  EXPECT_EQ(h->length, decode_header(msg).length);
  for (std::size_t byte : {0u, 5u, 7u, 8u}) {
    auto bad = msg;
    bad[byte] ^= 0xff;
    EXPECT_FALSE(try_decode_header(bad).has_value()) << "byte " << byte;
    EXPECT_THROW((void)decode_header(bad), Error) << "byte " << byte;
  }
  EXPECT_FALSE(try_decode_header(std::span(msg).first(11)).has_value());
}

TEST(Wire, HelloRejections) {
  const auto good = payload_of(encode_hello(sample()));
  auto with = [&](std::size_t off, std::uint8_t v) {
    auto p = good;
    p[off] = v;
    return p;
  };
  expect_error([&] { (void)decode_hello(std::span(good).first(41)); }, "truncated HELLO");
  expect_error([&] { (void)decode_hello(std::span(good).first(good.size() - 1)); },
               "truncated HELLO: QP count 1 and region count 2 need 90 bytes, got 89");
  auto longer = good;
  longer.push_back(0);
  expect_error([&] { (void)decode_hello(longer); }, "1 trailing bytes");
  expect_error([&] { (void)decode_hello(with(3, 0)); }, "QPN 0x0 out of range");
  expect_error([&] { (void)decode_hello(with(0, 1)); }, "QPN 0x1000011 out of range");
  expect_error([&] { (void)decode_hello(with(4, 1)); }, "PSN 0x1abcdef does not fit in 24 bits");
  expect_error([&] { (void)decode_hello(with(10, 3)); }, "unknown link layer 3");
  expect_error([&] { (void)decode_hello(with(11, 7)); }, "unknown GID type 7");
  expect_error([&] { (void)decode_hello(with(33, 1)); }, "invalid MTU 1025");
  expect_error([&] { (void)decode_hello(with(36, 0xff)); }, "absurd region count 65282");
  expect_error([&] { (void)decode_hello(with(39, 0)); }, "absurd QP count 0 (1..16)");
  expect_error([&] { (void)decode_hello(with(39, 17)); }, "absurd QP count 17");
  // A count of 2 without the second QP's 8 bytes.
  expect_error([&] { (void)decode_hello(with(39, 2)); },
               "truncated HELLO: QP count 2 and region count 2 need 98 bytes, got 90");
  expect_error([&] { (void)decode_hello(with(41, 0x81)); }, "unknown capability flags 0x80");
  expect_error([&] { (void)decode_hello(with(40, 0x02)); }, "unknown capability flags 0x200");
  // Region 0: address 0x7f0000001000 with a length that wraps past 2^64.
  auto wrap = good;
  for (int i = 0; i < 8; ++i) wrap[42 + 8 + static_cast<std::size_t>(i)] = 0xff;
  expect_error([&] { (void)decode_hello(wrap); }, "overflows");
  expect_error([&] { (void)decode_hello(with(42 + 23, 0x10)); }, "unknown access bits 0x10");
}

TEST(Wire, SeveralQps) {
  auto in = sample();
  in.extra_qps = {{0x12, 0x1}, {0xffffff, 0xfffffe}};
  const auto msg = encode_hello(in);
  ASSERT_EQ(msg.size(), kHeaderSize + kHelloFixedSize + 2 * kQpSize + 2 * kRegionSize);
  const auto p = payload_of(msg);
  EXPECT_EQ(p[39], 3);  // three QPs
  EXPECT_EQ((std::vector<std::uint8_t>{p.begin() + 42, p.begin() + 50}),
            (std::vector<std::uint8_t>{0, 0, 0, 0x12, 0, 0, 0, 1}));  // QP 1: QPN, PSN
  const EndpointInfo out = decode_hello(p);
  EXPECT_EQ(out, in);
  EXPECT_EQ(out.qp_count(), 3u);
  EXPECT_EQ(out.qp(2), (QpAddress{0xffffff, 0xfffffe}));
  auto bad = p;
  for (std::size_t i = 50; i < 54; ++i) bad[i] = 0;  // QP 2's QPN
  expect_error([&] { (void)decode_hello(bad); }, "QP 2: QPN 0x0 out of range");
  bad = p;
  bad[46] = 1;  // QP 1's PSN gets bit 24
  expect_error([&] { (void)decode_hello(bad); }, "QP 1: PSN 0x1000001 does not fit in 24 bits");
  in.extra_qps.resize(kMaxQps);
  expect_error([&] { (void)encode_hello(in); }, "17 QPs; at most 16");
}

TEST(Wire, EncodeRefusesWhatCannotBeDecoded) {
  auto i = sample();
  i.qpn = 1u << 24;
  expect_error([&] { (void)encode_hello(i); }, "24 bits");
  i = sample();
  i.regions.resize(kMaxRegions + 1);
  expect_error([&] { (void)encode_hello(i); }, "at most 1024");
  i = sample();
  i.flags = 0x8000;
  expect_error([&] { (void)encode_hello(i); }, "unknown capability flags 0x8000");
}

TEST(Wire, Compatibility) {
  auto local = sample();
  auto remote = sample();
  EXPECT_NO_THROW(check_compatible(local, remote));
  remote.link_layer = rdmakit::LinkLayer::infiniband;
  expect_error([&] { check_compatible(local, remote); },
               "link layers differ: this side is Ethernet, the peer is InfiniBand");
  remote = sample();
  remote.gid_type = rdmakit::GidType::roce_v1;
  expect_error([&] { check_compatible(local, remote); }, "RoCE versions differ");
  remote = sample();
  remote.gid = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  remote.gid_index = 0;
  expect_error([&] { check_compatible(local, remote); },
               "GID families differ: this side's GID [1] ::ffff:198.18.0.1 is IPv4, the peer's [0] fe80::1 is IPv6");
  local.gid = remote.gid;  // both IPv6: fine (reachability within the family is the network's)
  EXPECT_NO_THROW(check_compatible(local, remote));
  remote = sample();
  local = sample();
  local.link_layer = remote.link_layer = rdmakit::LinkLayer::infiniband;
  remote.lid = 0;
  expect_error([&] { check_compatible(local, remote); }, "subnet manager");
  remote.lid = 7;
  EXPECT_NO_THROW(check_compatible(local, remote));
}

}  // namespace

namespace {

// The fuzzer's seed corpus is in the current format (the "-v7" files) and the previous one, so
// the fuzzer starts from messages that decode rather than from ones the header check throws out.
TEST(Wire, FuzzSeedCorpusDecodes) {
  for (const char* name : {"hello", "hello-regions-qps", "hello-transports", "ready", "reject", "auth-challenge", "stream",
                           "hello-v7", "hello-regions-qps-v7", "hello-transports-v7", "ready-v7", "reject-v7",
                           "auth-challenge-v7", "stream-v7"}) {
    std::ifstream in(std::string(RDMAKIT_SOURCE_DIR) + "/fuzz/corpus/wire/" + name, std::ios::binary);
    ASSERT_TRUE(in) << name;
    const std::vector<std::uint8_t> msg{std::istreambuf_iterator<char>(in), {}};
    const Header h = decode_header(msg);
    ASSERT_EQ(h.length, msg.size() - kHeaderSize) << name;
    EXPECT_EQ(h.version, std::string_view(name).ends_with("-v7") ? 7 : 6) << name;
    if (h.type == MessageType::hello) {
      EXPECT_NO_THROW((void)decode_hello(payload_of(msg), h.version)) << name;
    }
  }
}

}  // namespace
