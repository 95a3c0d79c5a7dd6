// SPDX-License-Identifier: Apache-2.0
#pragma once
// FROZEN: rdmakit's bootstrap wire, version 6, as the release before version 7 spoke it
// (include/rdmakit/wire.hpp and src/bootstrap/{wire,auth,session}.cpp at 6f8903f), written out
// on its own so that tests can talk to the previous version whatever the library becomes.
// Never change what this sends or accepts: a new version adds a new frozen copy beside it.
// It depends on nothing of rdmakit (libsodium for the key exchange and the seals).
//
// What a version-6 peer did, and this copy does:
// - Every header carries version 6; a header of any other version is refused with a REJECT in
//   version 6 whose reason says "protocol version mismatch: peer speaks N, this side speaks 6".
// - HELLO: the fixed 42 bytes, the QPs after the first, the regions, and with flag bit 1 a
//   transport block without an engine protocol byte (version 7 added it).
// - With a pre-shared key: AUTH_CHALLENGE / AUTH_RESPONSE / AUTH_PROOF with X25519 and
//   HMAC-SHA256, then every message SEALED (XChaCha20-Poly1305, keys by HKDF-SHA256 salted with
//   "rdmakit v5 session" and both hellos).
#include <array>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace compat::v6 {

inline constexpr std::uint32_t kMagic = 0x52444b54;  // "RDKT"
inline constexpr std::uint16_t kVersion = 6;
inline constexpr std::size_t kHeaderSize = 12;

enum Type : std::uint16_t {
  hello = 1, ready = 2, bye = 3, reject = 4, user = 5, auth_challenge = 6, auth_response = 7, auth_proof = 8,
  sealed = 9, stream = 10
};

struct Region {
  std::uint64_t addr = 0, length = 0;
  std::uint32_t rkey = 0, access = 0;
};

/// A HELLO's fields as version 6 laid them out.
struct Hello {
  std::uint32_t qpn = 0, psn = 0;
  std::uint16_t lid = 0;
  std::uint8_t link_layer = 2;  // 1 InfiniBand, 2 Ethernet
  std::uint8_t gid_type = 2;    // 0 IB, 1 RoCE v1, 2 RoCE v2
  std::array<std::uint8_t, 16> gid{};
  std::uint32_t gid_index = 0;
  std::uint16_t mtu = 1024;
  std::uint8_t max_rd_atomic = 1, max_dest_rd_atomic = 1;
  std::uint16_t flags = 0;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> extra_qps;
  std::vector<Region> regions;
  // The transport block (flag bit 1).
  bool has_block = false;
  std::vector<std::uint8_t> kinds;  // 1 rdma, 2 tcp, 3 shm
  std::array<std::uint8_t, 16> host{};
  std::uint32_t pid = 0;
  std::uint64_t proof_addr = 0;
  std::array<std::uint8_t, 32> proof{}, token{};
  std::uint8_t streams = 0;
  std::string socket;
};

/// Header and payload.
[[nodiscard]] std::vector<std::uint8_t> message(std::uint16_t type, std::span<const std::uint8_t> payload);
[[nodiscard]] std::vector<std::uint8_t> encode_hello(const Hello& h);  // the payload
/// Throws std::runtime_error for what version 6 refused.
[[nodiscard]] Hello decode_hello(std::span<const std::uint8_t> payload);

struct Received {
  std::uint16_t version = 0;
  std::uint16_t type = 0;
  std::vector<std::uint8_t> payload;
};

/// One end of a connection on a blocking TCP socket `fd` (not owned), as a version-6 peer.
/// Every call throws std::runtime_error on what version 6 refused, or a socket that fails.
class Peer {
 public:
  Peer(int fd, std::vector<std::uint8_t> psk);
  ~Peer();
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

  /// A server's first read: the client's first message. A header of another version is
  /// answered as version 6 did (a REJECT in version 6 naming both) and false is returned with
  /// what it was in `refused`; otherwise, with a key, the authentication runs; true.
  bool serve_first(std::string* refused);
  /// A client's key exchange (nothing without a key).
  void authenticate_client();
  /// Sends a message (sealed after the key proof).
  void send(std::uint16_t type, std::span<const std::uint8_t> payload);
  /// Receives one (opened after the key proof); its header must be version 6.
  Received recv();

 private:
  Received recv_raw();
  void send_raw(const std::vector<std::uint8_t>& bytes);
  void authenticate_server(const Received& challenge);
  /// Both directions' keys from the two hellos and the X25519 secret; sealed from here on.
  void derive_keys(std::span<const std::uint8_t> client_hello, std::span<const std::uint8_t> server_hello,
                   std::span<const std::uint8_t> dh, bool client);

  int fd_;
  std::vector<std::uint8_t> psk_;
  bool sealed_ = false;
  std::array<std::uint8_t, 32> tx_{}, rx_{};
  std::uint64_t tx_seq_ = 0, rx_seq_ = 0;
  Received first_;        // serve_first's HELLO when there is no key
  bool have_first_ = false;
};

}  // namespace compat::v6
