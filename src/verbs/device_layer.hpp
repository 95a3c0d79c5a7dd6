// SPDX-License-Identifier: Apache-2.0
#pragma once
// The per-process device layer: every RDMA device is opened once (one context, one async-event
// stream, a cached copy of its ports and GID tables), however many connections and engines use
// it. This is the one piece of process-wide state the library keeps.
//
// A context is shared; protection domains are not. Each Connection allocates its own PD on the
// shared context, because its guarantee that a region's rkey is useless on another connection
// rests on that; an Engine allocates one PD per device and isolates its peers with type-2 memory
// windows instead.
//
// Async events (port up/down, GID changes, QP/CQ/device failures) arrive on the context's one
// descriptor. Whoever pumps reads them all and hands each to the sinks it concerns (the owner of
// the QP or CQ, or everyone on the port), so a connection learns of its QP's failure even when
// another thread read the event. A port or GID event marks the cached tables stale; the next
// info() re-reads them.
//
// Threads: everything here is safe to call from any thread. Sinks are called on the pumping
// thread with the device's lock held: they record what happened and return, and never call back
// into the device layer.

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rdmakit/device.hpp"
#include "verbs/handles.hpp"

namespace rdmakit::detail {

class Device;

/// One async event, as the sinks see it (the verbs event itself is acknowledged by the pump).
struct DeviceEvent {
  ibv_event_type type = IBV_EVENT_DEVICE_FATAL;
  std::uint8_t port = 0;  ///< port events
  ibv_qp* qp = nullptr;   ///< QP events
  ibv_cq* cq = nullptr;   ///< CQ events
};

/// Receives the device events that concern it: those of its QPs and CQs, its port's, and a
/// device failure.
class DeviceSink {
 public:
  virtual void on_device_event(const Device& device, const DeviceEvent& event) noexcept = 0;

 protected:
  ~DeviceSink() = default;
};

/// One opened RDMA device.
class Device {
 public:
  Device(ibv_device* device, ContextPtr ctx);
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  [[nodiscard]] ibv_context* context() const noexcept { return ctx_.get(); }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] const ibv_device_attr& attr() const noexcept { return attr_; }
  [[nodiscard]] int async_fd() const noexcept { return ctx_->async_fd; }
  /// Its ports and GID tables, as of the last port or GID event (reads them again after one).
  [[nodiscard]] DeviceInfo info();

  /// Reads every pending async event (never blocks) and delivers each to the sinks it concerns.
  /// A thread that finds another one pumping returns at once.
  void pump() noexcept;
  /// Delivers events of `port` (0: of every port) and device failures to `sink`.
  void subscribe(DeviceSink* sink, std::uint8_t port);
  /// Delivers the events of this QP or CQ to `sink` (subscribe first).
  void watch(DeviceSink* sink, ibv_qp* qp);
  void watch(DeviceSink* sink, ibv_cq* cq);
  /// Stops all deliveries to `sink`; when it returns, none is in progress.
  void unsubscribe(DeviceSink* sink) noexcept;
  /// Async events read so far (for tests and diagnostics).
  [[nodiscard]] std::uint64_t events_seen() const noexcept;

 private:
  struct Interest {
    DeviceSink* sink = nullptr;
    std::uint8_t port = 0;  // for the subscription entry
    ibv_qp* qp = nullptr;
    ibv_cq* cq = nullptr;
    bool subscription = false;
  };
  void deliver(const DeviceEvent& e) noexcept;

  ContextPtr ctx_;
  ibv_device* device_ = nullptr;
  std::string name_;
  ibv_device_attr attr_{};
  mutable std::mutex mu_;  // everything below
  std::vector<Interest> interests_;
  DeviceInfo info_;
  bool stale_ = false;
  std::uint64_t events_ = 0;
};

/// Every RDMA device of the host, each opened once while anything in the process uses the layer.
class DeviceLayer {
 public:
  /// The process's layer: the one in use, or a new one (opening every device). Throws Error
  /// when devices cannot be listed or one cannot be opened.
  static std::shared_ptr<DeviceLayer> acquire();

  [[nodiscard]] const std::vector<std::shared_ptr<Device>>& devices() const noexcept { return devices_; }
  /// The device called `name`; throws Error naming the available ones when there is none.
  [[nodiscard]] std::shared_ptr<Device> device(const std::string& name) const;
  /// Every device's ports and GID tables (cached; refreshed after port and GID events).
  [[nodiscard]] std::vector<DeviceInfo> catalog();
  /// Pumps every device's async events.
  void pump() noexcept;

 private:
  std::vector<std::shared_ptr<Device>> devices_;
};

/// What a region lives in: a device (kept open while the region exists) and a protection domain
/// (released first: member order).
struct DeviceResources {
  std::shared_ptr<Device> device;
  PdPtr pd;
  [[nodiscard]] ibv_context* ctx() const noexcept { return device->context(); }
};

/// Allocates a protection domain of its own on device `name` (opened through the layer).
std::shared_ptr<DeviceResources> open_pd(const std::string& name);
std::shared_ptr<DeviceResources> open_pd(std::shared_ptr<Device> device);

/// A device's attributes, ports and GID tables, read from an open context.
DeviceInfo query_device_info(ibv_device* device, ibv_context* ctx, const ibv_device_attr& attr);

}  // namespace rdmakit::detail
