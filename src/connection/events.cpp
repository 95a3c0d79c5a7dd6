// SPDX-License-Identifier: Apache-2.0
// Housekeeping for the data path's wait loop: the peer's control channel and the device's
// async events, each of which may break the connection through the data path's one break
// routine.
#include <infiniband/verbs.h>

#include <fmt/format.h>

#include "connection/impl.hpp"

namespace rdmakit {

void Connection::Impl::tick(detail::Deadline now) noexcept {
  pump_control();
  pump_async();
  if ((control_gone || bye_received) && dp.mode() == detail::DataPath::Mode::ready) {
    if (peer_gone_at == detail::Deadline{}) peer_gone_at = now;
    // What the peer did before it went may still be arriving (see kPeerGoneGrace); with
    // nothing outstanding there is nothing to wait for.
    if (dp.outstanding() == 0 || now - peer_gone_at >= detail::kPeerGoneGrace) {
      std::string why;
      try {
        why = control_gone_reason();
      } catch (...) {
      }
      dp.break_connection(std::move(why), detail::BreakCause::peer);
    }
  }
}

void Connection::Impl::pump_async() noexcept {
  // A tcp or shm link has no device: its queue pair reports its failures here itself.
  if (dev) dev->device->pump();
  if (!device_failed.load(std::memory_order_acquire)) return;
  std::string why;
  {
    std::lock_guard lock(device_mu);
    why = std::move(device_failure);
  }
  device_failed.store(false, std::memory_order_relaxed);
  dp.break_connection(std::move(why), detail::BreakCause::device);
}

// Runs on whichever thread pumped the event: it only records why, for our own thread to act on.
void Connection::Impl::on_device_event(const detail::Device& device, const detail::DeviceEvent& e) noexcept {
  std::string why;
  try {
    switch (e.type) {
      case IBV_EVENT_PORT_ERR:
        why = fmt::format("port {} of {} went down (IBV_EVENT_PORT_ERR): the link or its netdev "
                          "is down; check `ip link` / the cable, then reconnect",
                          e.port, device.name());
        break;
      case IBV_EVENT_DEVICE_FATAL:
        why = fmt::format("device {} failed (IBV_EVENT_DEVICE_FATAL); it must be reset or reloaded",
                          device.name());
        break;
      case IBV_EVENT_CQ_ERR:
        // A CQ overrun: completions were lost, so nothing outstanding can be accounted for.
        why = fmt::format("the {} CQ of {} failed (IBV_EVENT_CQ_ERR, usually an overrun): "
                          "completions were lost",
                          e.cq == send_cq.get() ? "send" : "receive", device.name());
        break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        why = fmt::format("QP {:#x} failed ({})", e.qp->qp_num, ibv_event_type_str(e.type));
        break;
      default: return;
    }
  } catch (...) {
    why = "device event (no memory to describe it)";
  }
  std::lock_guard lock(device_mu);
  if (device_failure.empty()) device_failure = std::move(why);
  device_failed.store(true, std::memory_order_release);
}

}  // namespace rdmakit
