// SPDX-License-Identifier: Apache-2.0
// The per-process device layer (see device_layer.hpp).
#include "verbs/device_layer.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <map>

#include <fmt/format.h>

#include "rdmakit/error.hpp"

namespace rdmakit::detail {

namespace {

// The one piece of process-wide state: which layer and which devices are open. Weak, so that
// when the last connection, engine or region lets go, every device is closed again.
struct Registry {
  std::mutex mu;
  std::weak_ptr<DeviceLayer> layer;
  std::map<std::string, std::weak_ptr<Device>> devices;
};
Registry& registry() {
  static Registry r;
  return r;
}

bool changes_tables(ibv_event_type t) {
  switch (t) {
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_GID_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER:
      return true;
    default:
      return false;
  }
}

}  // namespace

Device::Device(ibv_device* device, ContextPtr ctx) : ctx_(std::move(ctx)), device_(device) {
  // The context holds a reference to its device (the list it came from may be freed).
  if (ctx_->device != nullptr) device_ = ctx_->device;
  name_ = ibv_get_device_name(device);
  if (const int rc = ibv_query_device(ctx_.get(), &attr_); rc != 0) {
    throw Error("ibv_query_device", rc, fmt::format("device {}", name_));
  }
  // Non-blocking, so a pump never blocks whoever happens to run it.
  const int flags = ::fcntl(ctx_->async_fd, F_GETFL);
  if (flags < 0 || ::fcntl(ctx_->async_fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw Error("fcntl(O_NONBLOCK)", errno, fmt::format("async event fd of {}", name_));
  }
  info_ = query_device_info(device_, ctx_.get(), attr_);
}

DeviceInfo Device::info() {
  pump();
  std::lock_guard lock(mu_);
  if (stale_) {
    info_ = query_device_info(device_, ctx_.get(), attr_);
    stale_ = false;
  }
  return info_;
}

std::uint64_t Device::events_seen() const noexcept {
  std::lock_guard lock(mu_);
  return events_;
}

void Device::pump() noexcept {
  std::unique_lock lock(mu_, std::try_to_lock);
  if (!lock) return;
  ibv_async_event ev{};
  while (ibv_get_async_event(ctx_.get(), &ev) == 0) {
    DeviceEvent e;
    e.type = ev.event_type;
    switch (ev.event_type) {
      case IBV_EVENT_CQ_ERR: e.cq = ev.element.cq; break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_COMM_EST:
      case IBV_EVENT_SQ_DRAINED:
      case IBV_EVENT_PATH_MIG:
      case IBV_EVENT_PATH_MIG_ERR:
      case IBV_EVENT_QP_LAST_WQE_REACHED: e.qp = ev.element.qp; break;
      case IBV_EVENT_DEVICE_FATAL: break;
      case IBV_EVENT_SRQ_ERR:
      case IBV_EVENT_SRQ_LIMIT_REACHED:
      case IBV_EVENT_WQ_FATAL: break;
      default: e.port = static_cast<std::uint8_t>(ev.element.port_num); break;
    }
    ++events_;
    if (changes_tables(ev.event_type)) stale_ = true;
    deliver(e);
    // Acknowledged after delivery: ibv_destroy_qp/cq wait for their events' acknowledgements.
    ibv_ack_async_event(&ev);
  }
}

void Device::deliver(const DeviceEvent& e) noexcept {
  for (const Interest& i : interests_) {
    bool hit = false;
    if (e.qp != nullptr) {
      hit = i.qp == e.qp;
    } else if (e.cq != nullptr) {
      hit = i.cq == e.cq;
    } else if (i.subscription) {
      hit = e.type == IBV_EVENT_DEVICE_FATAL || i.port == 0 || i.port == e.port;
    }
    if (hit) i.sink->on_device_event(*this, e);
  }
}

void Device::subscribe(DeviceSink* sink, std::uint8_t port) {
  std::lock_guard lock(mu_);
  interests_.push_back({sink, port, nullptr, nullptr, true});
}
void Device::watch(DeviceSink* sink, ibv_qp* qp) {
  std::lock_guard lock(mu_);
  interests_.push_back({sink, 0, qp, nullptr, false});
}
void Device::watch(DeviceSink* sink, ibv_cq* cq) {
  std::lock_guard lock(mu_);
  interests_.push_back({sink, 0, nullptr, cq, false});
}
void Device::unsubscribe(DeviceSink* sink) noexcept {
  std::lock_guard lock(mu_);
  std::erase_if(interests_, [sink](const Interest& i) { return i.sink == sink; });
}

std::shared_ptr<DeviceLayer> DeviceLayer::acquire() {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  if (auto layer = r.layer.lock()) return layer;
  int n = 0;
  DeviceListPtr list(ibv_get_device_list(&n));
  if (!list) {
    throw Error("ibv_get_device_list", errno, "listing RDMA devices",
                "is rdma-core installed and the ib_uverbs module loaded? (/dev/infiniband)");
  }
  auto layer = std::make_shared<DeviceLayer>();
  for (int i = 0; i < n; ++i) {
    ibv_device* dev = list.get()[i];
    const std::string name = ibv_get_device_name(dev);
    // A region may still hold a device opened by an earlier layer: use that one, not a second.
    std::shared_ptr<Device> d = r.devices[name].lock();
    if (!d) {
      ContextPtr ctx(ibv_open_device(dev));
      if (!ctx) {
        throw Error("ibv_open_device", errno, fmt::format("device {}", name),
                    "check the permissions of /dev/infiniband/uverbs* (in a container, pass the "
                    "device through)");
      }
      d = std::make_shared<Device>(dev, std::move(ctx));
      r.devices[name] = d;
    }
    layer->devices_.push_back(std::move(d));
  }
  // The ibv_device pointers stay valid while a context of theirs is open (libibverbs keeps a
  // reference per open context), so the list itself can go.
  r.layer = layer;
  return layer;
}

std::shared_ptr<Device> DeviceLayer::device(const std::string& name) const {
  std::string names;
  for (const auto& d : devices_) {
    if (d->name() == name) return d;
    names += names.empty() ? d->name() : ", " + d->name();
  }
  throw Error("open device", ENODEV,
              fmt::format("no RDMA device named '{}'; available: {}", name, names.empty() ? "none" : names));
}

std::vector<DeviceInfo> DeviceLayer::catalog() {
  std::vector<DeviceInfo> out;
  out.reserve(devices_.size());
  for (const auto& d : devices_) out.push_back(d->info());
  return out;
}

void DeviceLayer::pump() noexcept {
  for (const auto& d : devices_) d->pump();
}

std::shared_ptr<DeviceResources> open_pd(std::shared_ptr<Device> device) {
  auto res = std::make_shared<DeviceResources>();
  res->device = std::move(device);
  res->pd.reset(ibv_alloc_pd(res->device->context()));
  if (!res->pd) throw Error("ibv_alloc_pd", errno, res->device->name());
  return res;
}

std::shared_ptr<DeviceResources> open_pd(const std::string& name) {
  return open_pd(DeviceLayer::acquire()->device(name));
}

}  // namespace rdmakit::detail

namespace rdmakit {
// Through the device layer: devices already open in this process are not opened again, and
// their tables are the cached ones (re-read after port and GID events).
std::vector<DeviceInfo> list_devices() { return detail::DeviceLayer::acquire()->catalog(); }
}  // namespace rdmakit
