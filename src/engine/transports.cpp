// SPDX-License-Identifier: Apache-2.0
// The engine's transports (docs/engine.md, "Transports"): which it offers its peers' links, the
// software devices of tcp and shm and a worker's CQ on them, and its buffers as those links
// reach them. The choice per link is made in the handshake (src/connection/soft.cpp); the links
// then run the one data path whatever their transport.
#include <algorithm>
#include <cerrno>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bootstrap/auth.hpp"
#include "engine/impl.hpp"
#include "transport/shm/host.hpp"
#include "transport/tcp/streams.hpp"
#include "rdmakit/error.hpp"
#include "verbs/memory_impl.hpp"

namespace rdmakit {

const char* to_string(Transport t) noexcept {
  switch (t) {
    case Transport::rdma: return "rdma";
    case Transport::tcp: return "tcp";
    case Transport::shm: return "shm";
  }
  return "?";
}

Transport parse_transport(std::string_view text) {
  if (text == "rdma") return Transport::rdma;
  if (text == "tcp") return Transport::tcp;
  if (text == "shm") return Transport::shm;
  throw Error("transport", EINVAL, fmt::format("'{}': rdma, tcp or shm", text));
}

const char* to_string(ShmCopy c) noexcept {
  switch (c) {
    case ShmCopy::automatic: return "auto";
    case ShmCopy::attach: return "attach";
    case ShmCopy::ring: return "ring";
  }
  return "?";
}

ShmCopy parse_shm_copy(std::string_view text) {
  if (text == "auto") return ShmCopy::automatic;
  if (text == "attach") return ShmCopy::attach;
  if (text == "ring") return ShmCopy::ring;
  throw Error("shm copy", EINVAL, fmt::format("'{}': auto, attach or ring", text));
}

namespace {

wire::LinkTransport on_wire(Transport t) {
  switch (t) {
    case Transport::rdma: return wire::LinkTransport::rdma;
    case Transport::tcp: return wire::LinkTransport::tcp;
    default: return wire::LinkTransport::shm;
  }
}

}  // namespace

void Engine::Impl::choose_transports() {
  const std::vector<Transport> want = cfg.transports.empty() ? std::vector<Transport>{Transport::rdma} : cfg.transports;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::count(want.begin(), want.end(), want[i]) > 1) {
      throw Error("engine config", EINVAL, fmt::format("transports: {} is listed twice", to_string(want[i])));
    }
  }
  if (cfg.tcp_streams == 0 || cfg.tcp_streams > detail::tcp::kMaxStreams) {
    throw Error("engine config", EINVAL, fmt::format("tcp_streams {} (1..{})", cfg.tcp_streams, detail::tcp::kMaxStreams));
  }
  const bool rdma = std::find(want.begin(), want.end(), Transport::rdma) != want.end();
  // Why rdma cannot be offered, as the failing verb says it (an engine of rdma alone fails with it).
  std::optional<Error> no_device;
  try {
    layer = detail::DeviceLayer::acquire();
    if (layer->devices().empty()) no_device.emplace("ibv_get_device_list", ENODEV, "this host has no RDMA device");
  } catch (const Error& e) {
    // No RDMA subsystem at all (no ib_uverbs): an engine of other transports runs without it.
    layer = std::make_shared<detail::DeviceLayer>();
    no_device = e;
  }
  rdma_devices = layer->devices();
  if (!cfg.devices.empty() && !no_device) {
    // The engine's own devices, in the layer's order; every name must be one of them.
    std::vector<std::string> there;
    for (const auto& d : rdma_devices) there.push_back(d->name());
    const auto listed = [&](const std::string& device) {
      return std::find(cfg.devices.begin(), cfg.devices.end(), device) != cfg.devices.end();
    };
    for (std::size_t i = 0; i < cfg.devices.size(); ++i) {
      const std::string& want_d = cfg.devices[i];
      if (std::find(there.begin(), there.end(), want_d) == there.end()) {
        throw Error("engine config", ENODEV,
                    fmt::format("devices: no RDMA device '{}' (there are: {})", want_d, fmt::join(there, ", ")),
                    "rdmakit devices lists them");
      }
      if (std::find(cfg.devices.begin(), cfg.devices.begin() + static_cast<std::ptrdiff_t>(i), want_d) !=
          cfg.devices.begin() + static_cast<std::ptrdiff_t>(i)) {
        throw Error("engine config", EINVAL, fmt::format("devices: '{}' is listed twice", want_d));
      }
    }
    std::erase_if(rdma_devices, [&](const std::shared_ptr<detail::Device>& d) { return !listed(d->name()); });
    if (!cfg.link.device.empty() && !listed(cfg.link.device)) {
      throw Error("engine config", EINVAL,
                  fmt::format("link.device '{}' is not one of devices ({})", cfg.link.device, fmt::join(cfg.devices, ", ")));
    }
    for (const std::string& r : cfg.rails.devices) {
      if (!listed(r)) {
        throw Error("engine config", EINVAL,
                    fmt::format("rails.devices names '{}', which is not one of devices ({})", r, fmt::join(cfg.devices, ", ")));
      }
    }
  }
  rdma_count = static_cast<std::uint32_t>(rdma_devices.size());
  if (rdma && no_device && want.size() == 1) {
    throw Error(no_device->op(), no_device->sys_errno(), fmt::format("no RDMA device for the engine: {}", no_device->detail()),
                fmt::format("{}; {}", no_device->hint().empty() ? "rdmakit doctor says why" : no_device->hint(),
                            cfg.transports.empty()
                                ? "or run it without RDMA: EngineConfig::transports {tcp} (rdmakit serve --transport tcp, "
                                  "Python transports=[\"tcp\"])"
                                : "or list another transport too (EngineConfig::transports, --transport tcp)"));
  }
  const std::string no_rdma = no_device ? no_device->what() : std::string{};
  for (const Transport t : want) {
    std::string no;
    if (t == Transport::rdma && rdma_count == 0) {
      no = no_rdma;
    } else if (t != Transport::rdma && cfg.link.method != ConnectMethod::tcp) {
      no = "its links bootstrap over TCP, and link.method is rdma_cm";
    } else if (t == Transport::shm) {
      // Asked once: the links' choice of copy below depends on it too.
      shm_no_attach = detail::shm::why_no_attach();
      if (cfg.shm_copy == ShmCopy::attach && !shm_no_attach.empty()) {
        no = fmt::format("{}, and shm_copy is attach (the ring needs no such permission)", shm_no_attach);
      }
    }
    if (no.empty()) {
      offer.push_back(on_wire(t));
    } else {
      offer_note += fmt::format("{}{} not offered: {}", offer_note.empty() ? "" : "; ", to_string(t), no);
    }
  }
  if (offer.empty()) throw Error("engine", ENODEV, fmt::format("no transport to offer: {}", offer_note));
  if (!offers(wire::LinkTransport::rdma) && rdma_count > 0) {
    // Not offered: no PD, no registration, no worker's CQ on the NICs (memory is not pinned on
    // every NIC for transports that never use one).
    layer = std::make_shared<detail::DeviceLayer>();
    rdma_devices.clear();
    rdma_count = 0;
  }
  if (offers(wire::LinkTransport::shm)) {
    shm_socket = fmt::format("rdmakit-shm-{:016x}", epoch);
    // How the links this engine opens copy: its choice, or what the kernel allows.
    if (cfg.shm_copy == ShmCopy::ring) {
      shm_ring_why = "shm_copy is ring";
    } else if (cfg.shm_copy == ShmCopy::automatic) {
      shm_ring_why = shm_no_attach;
    }
  }
  if (!offer_note.empty()) cfg.link.log(fmt::format("engine {}: {}", name, offer_note));
  for (std::size_t k = 0; k < soft.size(); ++k) soft[k] = std::make_unique<detail::soft::Device>(wire::to_string(kSoftTransports[k]));
  self = detail::shm::this_host();
  streams = std::make_shared<detail::StreamRegistry>();
}

std::string Engine::Impl::device_name(std::uint32_t d) const {
  if (d < rdma_count) return rdma_devices[d]->name();
  return wire::to_string(soft_kind(d));
}

std::vector<DeviceInfo> Engine::Impl::catalog() const {
  std::vector<DeviceInfo> all = layer->catalog();
  if (all.size() == rdma_devices.size()) return all;  // every device of the layer (or none)
  std::erase_if(all, [&](const DeviceInfo& i) {
    return std::none_of(rdma_devices.begin(), rdma_devices.end(), [&](const auto& d) { return d->name() == i.name; });
  });
  return all;
}

ibv_pd* Engine::Impl::pd_of(std::uint32_t d) const noexcept {
  return d < rdma_count ? pds[d]->pd.get() : soft[d - rdma_count]->pd();
}

void Engine::Impl::soft_slices(detail::BufferRec& rec) const {
  if (!rec.soft) {
    // The CPU's view of the bytes: none for GPU memory (those links then refuse its transfers).
    void* cpu = rec.regions.empty() ? rec.handle.addr : rec.regions[0]->data();
    if (!detail::cpu_reaches(cpu, rec.handle.length)) cpu = nullptr;
    auto impl = std::make_unique<MemoryRegion::Impl>();
    impl->addr = cpu;
    impl->cpu = cpu;
    impl->length = cpu != nullptr ? rec.handle.length : 0;
    impl->kind = rec.kind;
    impl->access = Access::local_write;
    rec.soft.emplace(MemoryRegion::Impl::wrap(std::move(impl)));
  }
  for (std::size_t k = 0; k < soft.size(); ++k) rec.slices.push_back(rec.soft->local());
}

detail::Attachment Engine::Impl::attach_soft(wire::LinkTransport kind, detail::Worker* preferred) {
  auto a = attach_to(soft_index(kind), preferred, preferred != nullptr ? 0 : next_worker.fetch_add(1));
  if (!a) {
    throw Error("engine", EBUSY,
                fmt::format("{}every worker holds all the {} links it can", detail::kBusyReason, wire::to_string(kind)),
                "raise EngineConfig::max_qps, or add workers");
  }
  return *a;
}

}  // namespace rdmakit
