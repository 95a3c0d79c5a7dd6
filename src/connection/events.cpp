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
  if (!dev || !dev->ctx) return;
  ibv_async_event ev{};
  while (ibv_get_async_event(dev->ctx.get(), &ev) == 0) {
    std::string why;
    try {
      switch (ev.event_type) {
        case IBV_EVENT_PORT_ERR:
          if (ev.element.port_num == info.port) {
            why = fmt::format("port {} of {} went down (IBV_EVENT_PORT_ERR): the link or its netdev "
                              "is down; check `ip link` / the cable, then reconnect",
                              info.port, info.device);
          }
          break;
        case IBV_EVENT_DEVICE_FATAL:
          why = fmt::format("device {} failed (IBV_EVENT_DEVICE_FATAL); it must be reset or reloaded",
                            info.device);
          break;
        case IBV_EVENT_CQ_ERR:
          // A CQ overrun: completions were lost, so nothing outstanding can be accounted for.
          if (ev.element.cq == send_cq.get() || ev.element.cq == recv_cq.get()) {
            why = fmt::format("the {} CQ of {} failed (IBV_EVENT_CQ_ERR, usually an overrun): "
                              "completions were lost",
                              ev.element.cq == send_cq.get() ? "send" : "receive", info.device);
          }
          break;
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
          for (const detail::QpPtr& qp : qps) {
            if (ev.element.qp == qp.get()) {
              why = fmt::format("QP {:#x} failed ({})", qp->qp_num, ibv_event_type_str(ev.event_type));
            }
          }
          break;
        default: break;
      }
    } catch (...) {
      why = "device event (no memory to describe it)";
    }
    ibv_ack_async_event(&ev);
    if (!why.empty()) dp.break_connection(std::move(why), detail::BreakCause::device);
  }
}

}  // namespace rdmakit
