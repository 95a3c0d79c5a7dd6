// SPDX-License-Identifier: Apache-2.0
#pragma once
// The control channel a connection's handshake and later messages travel on: a reliable, ordered
// byte stream with deadlines. Over TCP it is the bootstrap socket (TcpChannel); over rdma_cm it
// is a small QP of its own, connected by the CM (src/cm/). The framing, authentication and
// sealing above it (session.hpp, auth.hpp) are the same for both.

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "bootstrap/socket.hpp"
#include "common/clock.hpp"

namespace rdmakit::detail {

class Channel {
 public:
  Channel() = default;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  virtual ~Channel() = default;

  /// Sends every byte by the deadline, or throws Error (the peer closed, the deadline passed).
  virtual void send_all(std::span<const std::uint8_t> bytes, Deadline deadline) = 0;
  /// Takes what it can of `bytes` now, without blocking: the count taken (0: nothing fits now;
  /// fd() turns readable, or writable for a socket, when more may), or kSendFailed with `error`
  /// set when the channel is gone. What was taken is sent in order, after what was before.
  virtual long send_some(std::span<const std::uint8_t> bytes, int* error) noexcept = 0;
  /// Everything taken has reached the peer as far as this side can know (a socket: handed to
  /// the kernel, which delivers it even after a close; rdma_cm: acknowledged by the peer's NIC,
  /// since a disconnect drops what is not).
  [[nodiscard]] virtual bool sent() noexcept { return true; }
  /// Fills `bytes` by the deadline, or throws Error saying how far it got.
  virtual void recv_exact(std::span<std::uint8_t> bytes, Deadline deadline) = 0;
  /// What has arrived, without blocking: a byte count, kRecvWouldBlock, or kRecvClosed with
  /// `error` set to why (0 for an orderly close, ETIMEDOUT when keepalive gave up, else errno).
  virtual long recv_nonblocking(std::span<std::uint8_t> buf, int* error) noexcept = 0;
  /// A descriptor that becomes readable when recv_nonblocking may have something (data, a close).
  [[nodiscard]] virtual int fd() const noexcept = 0;
  /// Turns on liveness probes: after `interval` with nothing from the peer, probe; when none is
  /// answered within `timeout`, the channel reports ETIMEDOUT. Both 0: off.
  virtual void keepalive(std::chrono::milliseconds interval, std::chrono::milliseconds timeout) = 0;
  /// The channel's own address on this host (the route the peer is reached by), without port.
  [[nodiscard]] virtual std::string local_address() const = 0;
  /// The RDMA device the channel resolved the peer to (rdma_cm), or empty (TCP: the caller
  /// picks the device by local_address()).
  [[nodiscard]] virtual std::string device() const { return {}; }
  /// While set, send_all() and recv_exact() also end (ECANCELED) when `stop` is requested: a
  /// handshake's waits, so an engine or listener shutting down does not wait out its deadline.
  /// Cleared (nullptr) once the connection is handed over.
  void set_stop(std::shared_ptr<const Stop> stop) noexcept { stop_ = std::move(stop); }
  /// The wire version the connection speaks (wire.hpp, "Versions"): the client's from its first
  /// message on, the server's once it has read the client's first message; 0 before (a server's
  /// refusal of a first message it could not read goes in wire::kVersion).
  [[nodiscard]] std::uint16_t version() const noexcept { return version_; }
  void set_version(std::uint16_t v) noexcept { version_ = v; }
  /// The version a message sent now goes in.
  [[nodiscard]] std::uint16_t send_version() const noexcept { return version_ != 0 ? version_ : wire::kVersion; }

 protected:
  std::shared_ptr<const Stop> stop_;
  std::uint16_t version_ = 0;
};

/// The bootstrap socket as a channel.
class TcpChannel final : public Channel {
 public:
  explicit TcpChannel(Fd fd) noexcept : fd_(std::move(fd)) {}
  void send_all(std::span<const std::uint8_t> bytes, Deadline deadline) override;
  long send_some(std::span<const std::uint8_t> bytes, int* error) noexcept override;
  void recv_exact(std::span<std::uint8_t> bytes, Deadline deadline) override;
  long recv_nonblocking(std::span<std::uint8_t> buf, int* error) noexcept override;
  [[nodiscard]] int fd() const noexcept override { return fd_.get(); }
  void keepalive(std::chrono::milliseconds interval, std::chrono::milliseconds timeout) override;
  [[nodiscard]] std::string local_address() const override;
  /// The socket, out of the channel (a data stream handed to its link).
  [[nodiscard]] Fd take() noexcept { return std::move(fd_); }

 private:
  Fd fd_;
};

/// A server of the previous wire version refused the client's first message for its version
/// (wire::refused_version): the client may connect again, once, in `version`.
class VersionRefused : public Error {
 public:
  VersionRefused(const std::string& peer, std::uint16_t theirs, std::uint16_t spoken, const std::string& reason);
  std::uint16_t version;
};

/// A keyed server answered a client that had fallen back to an older version, and says (its
/// nonce's mark, under its MAC) that it speaks a newer one: the refusal that made the client fall
/// back was forged, or came from another process behind the same address (a mixed fleet behind a
/// load balancer, a node upgraded between the two tries). The client may connect again, once, in
/// its own version.
class NewerServer : public Error {
 public:
  NewerServer(const std::string& peer, std::uint16_t spoken);
};

/// Throws VersionRefused when `m`, the answer to the client's first message on `ch`, is a
/// previous-version server's refusal of its version.
void check_version_refusal(const Channel& ch, const Message& m, const std::string& peer);

/// One framed message: header validated, payload length checked before it is read. Once the
/// channel has a version, a message in another is refused, except a REJECT (a server of the
/// previous version refusing the client's first message: wire::refused_version).
Message recv_message(Channel& ch, Deadline deadline);

}  // namespace rdmakit::detail
