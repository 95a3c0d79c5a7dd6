// SPDX-License-Identifier: Apache-2.0
// The control channel after the handshake: BYE, application messages, keepalive, and noticing
// that the peer is gone. The data path never throws, so neither does reading it.
#include <algorithm>
#include <cerrno>
#include <optional>

#include <fmt/format.h>

#include "connection/impl.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

void Connection::Impl::send_control(wire::MessageType type, std::span<const std::uint8_t> payload,
                                    detail::Deadline deadline) {
  try {
    if (control_waiting() > 0) {
      control->send_all({outbox.data() + out_head, control_waiting()}, deadline);
      out_taken += control_waiting();
      outbox.clear();
      out_head = 0;
    }
    detail::send_control(*control, session.get(), type, payload, deadline);
  } catch (const std::exception&) {
    // Part of a frame may have gone: nothing may follow it on this channel.
    send_errno = ECOMM;
    outbox.clear();
    out_head = 0;
    throw;
  }
}

void Connection::Impl::queue_control(wire::MessageType type, std::span<const std::uint8_t> payload) {
  if (send_errno != 0) return;  // the channel failed: nothing more goes (the caller breaks the link)
  std::vector<std::uint8_t> frame = detail::frame_control(session.get(), type, payload, info.wire_version);
  out_queued += frame.size();
  if (control_waiting() == 0) {
    out_moved = detail::Clock::now();
    outbox.swap(frame);  // the common case: the channel takes it all at once, with no copy
    out_head = 0;
  } else {
    outbox.insert(outbox.end(), frame.begin(), frame.end());
  }
  flush_control();
}

bool Connection::Impl::flush_control() noexcept {
  if (control_waiting() == 0) return true;
  if (!control || send_errno != 0) return false;
  int err = 0;
  const long n = control->send_some({outbox.data() + out_head, control_waiting()}, &err);
  if (n == detail::kSendFailed) {
    send_errno = err != 0 ? err : EIO;
    outbox.clear();
    out_head = 0;
    return false;
  }
  if (n > 0) {
    out_head += static_cast<std::size_t>(n);
    out_taken += static_cast<std::uint64_t>(n);
    out_moved = detail::Clock::now();
  }
  if (out_head == outbox.size()) {
    outbox.clear();
    out_head = 0;
    return true;
  }
  if (out_head >= outbox.size() / 2) {  // the taken half goes, so the outbox never only grows
    outbox.erase(outbox.begin(), outbox.begin() + static_cast<std::ptrdiff_t>(out_head));
    out_head = 0;
  }
  return false;
}

std::string Connection::Impl::control_gone_reason() const {
  if (bye_received) return "the peer closed the connection (BYE)";
  switch (control_errno) {
    case 0:
      if (control_partial > 0) {
        return fmt::format("the peer is gone: its control channel closed in the middle of a frame "
                           "({} bytes of it had come; cut off on the way?)",
                           control_partial);
      }
      return "the peer is gone: its control channel closed (process exited or killed, or the "
             "host went down)";
    case ETIMEDOUT:
      if (cfg.method == ConnectMethod::rdma_cm) {
        // The probe is a SEND on the control QP: it fails once its retries are spent.
        return fmt::format("the peer's host stopped answering: the control QP's keepalive probe was "
                           "not acknowledged after {} tries of {} ms (the host is down, paused or "
                           "partitioned from this one)",
                           cfg.retry_count + 1, cfg.ack_timeout.count());
      }
      return fmt::format("the peer's host stopped answering: no keepalive reply for {} ms (the host "
                         "is down, paused or partitioned from this one)",
                         cfg.keepalive_timeout.count());
    case EPROTO:
      return "the peer is treated as gone: it sent garbage or more than the control channel "
             "holds on its control channel";
    case EBADMSG:
      return "the connection is not trusted any more: a control-channel frame failed to "
             "authenticate (altered, replayed, reordered or injected on the way, or sent in the "
             "clear); nothing in it was used";
    default:
      return fmt::format("the peer is gone: its control channel failed ({})", errno_name(control_errno));
  }
}

// Reads whatever the peer sent on the control channel without blocking: BYE, application
// messages, or EOF/reset/keepalive timeout (the peer is gone).
void Connection::Impl::pump_control() noexcept {
  if (!control || control_gone) return;
  auto gone = [this](int err) {
    control_gone = true;
    control_errno = err;
    control_partial = cfill;
  };
  for (;;) {
    int err = 0;
    const long n = control->recv_nonblocking({cbuf.data() + cfill, cbuf.size() - cfill}, &err);
    if (n == detail::kRecvClosed) return gone(err);
    if (n == detail::kRecvWouldBlock) break;
    cfill += static_cast<std::size_t>(n);
    while (cfill >= wire::kHeaderSize) {
      const auto h = wire::try_decode_header({cbuf.data(), cfill});
      // A peer that garbles its control channel is treated as lost.
      if (!h || h->version != info.wire_version || h->length > cbuf.size() - wire::kHeaderSize) return gone(EPROTO);
      const std::size_t len = h->length;
      if (cfill < wire::kHeaderSize + len) break;
      const std::span<const std::uint8_t> body(cbuf.data() + wire::kHeaderSize, len);
      wire::MessageType type = h->type;
      std::optional<detail::Message> opened;
      if (session) {
        // With a key, only sealed frames that open count; anything else ends the connection,
        // and nothing in it is acted on.
        opened = h->type == wire::MessageType::sealed ? session->open(*h, body) : std::nullopt;
        if (!opened) {
          try {
            log(fmt::format("connection with {}: a control frame ({}, {} bytes) failed to "
                            "authenticate; the connection is closed",
                            info.peer_address, wire::to_string(h->type), len));
          } catch (...) {
          }
          return gone(EBADMSG);
        }
        type = opened->header.type;
      }
      const std::span<const std::uint8_t> payload = opened ? std::span<const std::uint8_t>(opened->payload) : body;
      if (type == wire::MessageType::bye || type == wire::MessageType::reject) {
        bye_received = true;
      } else if (type == wire::MessageType::user) {
        // Only application messages allocate, and only when one arrives.
        try {
          messages.emplace_back(payload.begin(), payload.end());
        } catch (...) {
          return gone(ENOMEM);
        }
      }
      std::copy(cbuf.begin() + static_cast<std::ptrdiff_t>(wire::kHeaderSize + len),
                cbuf.begin() + static_cast<std::ptrdiff_t>(cfill), cbuf.begin());
      cfill -= wire::kHeaderSize + len;
    }
    if (cfill == cbuf.size()) return gone(EPROTO);
  }
}

bool Connection::peer_closed() noexcept {
  impl_->pump_control();
  return impl_->bye_received || impl_->control_gone;
}

bool Connection::wait_peer_close(std::chrono::milliseconds timeout) noexcept {
  return impl_->await_control(detail::deadline_in(timeout),
                              [this] { return impl_->bye_received || impl_->control_gone; });
}

void Connection::send_message(std::span<const std::uint8_t> payload,
                              std::chrono::milliseconds timeout) {
  if (payload.size() > max_message_size) {
    throw Error("send_message", EMSGSIZE,
                fmt::format("{} bytes; at most {}", payload.size(), max_message_size));
  }
  if (impl_->state != Impl::State::connected || !impl_->control) {
    throw Error("send_message", ENOTCONN, "the connection is not established or already closed");
  }
  impl_->send_control(wire::MessageType::user, payload, detail::deadline_in(timeout));
}

std::optional<std::vector<std::uint8_t>> Connection::receive_message(std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  m.await_control(detail::deadline_in(timeout),
                  [&m] { return !m.messages.empty() || m.control_gone || m.bye_received; });
  if (m.messages.empty()) return std::nullopt;
  auto msg = std::move(m.messages.front());
  m.messages.pop_front();
  return msg;
}

}  // namespace rdmakit
