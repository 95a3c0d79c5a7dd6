// SPDX-License-Identifier: Apache-2.0
#pragma once
// One owner per verbs handle: a unique_ptr whose deleter is the matching destroy verb. Objects
// that hold several of them declare them in creation order, so destruction (reverse member order)
// is always QP -> CQ -> channel -> MR -> PD -> context, also when a constructor throws halfway.

#include <infiniband/verbs.h>

#include <memory>

namespace rdmakit::detail {

// Destroy verbs can fail (EBUSY when a dependent object still exists); a deleter cannot throw,
// and member order rules out the dependent-object case, so the result is deliberately ignored.
struct DeviceListDeleter {
  void operator()(ibv_device** list) const noexcept { ibv_free_device_list(list); }
};
struct ContextDeleter {
  void operator()(ibv_context* c) const noexcept { (void)ibv_close_device(c); }
};
struct PdDeleter {
  void operator()(ibv_pd* pd) const noexcept { (void)ibv_dealloc_pd(pd); }
};
struct CompChannelDeleter {
  void operator()(ibv_comp_channel* ch) const noexcept { (void)ibv_destroy_comp_channel(ch); }
};
struct CqDeleter {
  void operator()(ibv_cq* cq) const noexcept { (void)ibv_destroy_cq(cq); }
};
struct QpDeleter {
  void operator()(ibv_qp* qp) const noexcept { (void)ibv_destroy_qp(qp); }
};
struct MrDeleter {
  void operator()(ibv_mr* mr) const noexcept { (void)ibv_dereg_mr(mr); }
};

struct MwDeleter {
  void operator()(ibv_mw* mw) const noexcept { (void)ibv_dealloc_mw(mw); }
};

using DeviceListPtr = std::unique_ptr<ibv_device*, DeviceListDeleter>;
using ContextPtr = std::unique_ptr<ibv_context, ContextDeleter>;
using PdPtr = std::unique_ptr<ibv_pd, PdDeleter>;
using CompChannelPtr = std::unique_ptr<ibv_comp_channel, CompChannelDeleter>;
using CqPtr = std::unique_ptr<ibv_cq, CqDeleter>;
using QpPtr = std::unique_ptr<ibv_qp, QpDeleter>;
using MrPtr = std::unique_ptr<ibv_mr, MrDeleter>;
using MwPtr = std::unique_ptr<ibv_mw, MwDeleter>;


/// ibv_mtu <-> bytes. Unknown values map to 0 / IBV_MTU_256.
std::uint32_t mtu_bytes(ibv_mtu mtu) noexcept;
ibv_mtu mtu_enum(std::uint32_t bytes) noexcept;

}  // namespace rdmakit::detail
