// SPDX-License-Identifier: Apache-2.0
// What completions and refused posts say: status names, likely causes, one-line descriptions.
#include <infiniband/verbs.h>

#include <system_error>

#include <fmt/format.h>

#include "rdmakit/connection.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit {

const char* to_string(Opcode op) noexcept {
  switch (op) {
    case Opcode::send: return "SEND";
    case Opcode::write: return "RDMA_WRITE";
    case Opcode::write_with_imm: return "RDMA_WRITE_WITH_IMM";
    case Opcode::read: return "RDMA_READ";
    case Opcode::recv: return "RECV";
    case Opcode::fetch_add: return "ATOMIC_FETCH_ADD";
    case Opcode::compare_swap: return "ATOMIC_CMP_SWAP";
  }
  return "?";
}

const char* Completion::status_name() const noexcept {
  return ibv_wc_status_str(static_cast<ibv_wc_status>(status));
}

namespace {

const char* likely_cause(int status) {
  switch (status) {
    case IBV_WC_RETRY_EXC_ERR:
      return "no ACK from the peer after every retry: the peer process or host is gone, or it is "
             "unreachable (wrong GID or route, RoCE v1/v2 mismatch, firewall on UDP 4791), or the "
             "path MTU is larger than the network carries";
    case IBV_WC_REM_ACCESS_ERR:
      return "the peer refused the access: wrong rkey, address or length outside its region, or "
             "the region was not registered with this access (remote read/write/atomic)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "the peer had no receive posted (receiver not ready) after every RNR retry";
    case IBV_WC_WR_FLUSH_ERR:
      return "flushed: the QP is in the error state (an earlier work request failed, or the "
             "connection is closing)";
    case IBV_WC_LOC_PROT_ERR:
      return "the local buffer is not inside a registered region with the needed access (a "
             "READ or RECV target needs local write)";
    case IBV_WC_LOC_LEN_ERR:
      return "the local receive buffer is smaller than the incoming message";
    case IBV_WC_REM_INV_REQ_ERR:
      return "the peer found the request invalid: longer than its receive buffer, or an "
             "operation its QP does not allow";
    case IBV_WC_REM_OP_ERR: return "the peer could not complete the operation";
    case IBV_WC_LOC_QP_OP_ERR: return "the local QP rejected the work request (bad opcode or SGE)";
    default: return "";
  }
}

}  // namespace

std::string Completion::describe() const {
  if (ok()) return fmt::format("{} wr_id={} ok", to_string(opcode), wr_id);
  const char* cause = likely_cause(status);
  return fmt::format("{} wr_id={} failed: {} (status {}, vendor_err {:#x}){}{}", to_string(opcode),
                     wr_id, status_name(), status, vendor_err, *cause ? ". Likely cause: " : "",
                     cause);
}

std::string PostResult::describe() const {
  const std::string where = index > 0 ? fmt::format(" (work request {} of the batch)", index) : "";
  switch (status) {
    case PostStatus::ok: return "ok";
    case PostStatus::not_ready:
      return "refused: the QP is not in RTS (not connected yet, broken, or closed)" + where;
    case PostStatus::out_of_bounds: return "refused: the range lies outside the remote region" + where;
    case PostStatus::no_access:
      return "refused: the region does not allow this operation (remote access flags, or a local "
             "buffer the NIC may not write)" + where;
    case PostStatus::too_large:
      return "refused: longer than the port's max message size, or more work requests than the "
             "queue holds" + where;
    case PostStatus::queue_full: return "refused: the send or receive queue has no room for the batch";
    case PostStatus::too_many_sges: return "refused: more scatter-gather entries than max_sge" + where;
    case PostStatus::misaligned: return "refused: an atomic's remote address is not 8-byte aligned" + where;
    case PostStatus::bad_length: return "refused: an atomic needs exactly one 8-byte local slice" + where;
    case PostStatus::unsupported: return "refused: the device or QP does not support this operation" + where;
    case PostStatus::not_advertised:
      return "refused: the remote descriptor is not inside a region the peer advertised on this "
             "connection (wrong rkey or address, or taken from another connection)" + where;
    case PostStatus::stale:
      return "refused: the prepared request was released, or prepared before the peer's regions "
             "changed (prepare it again)";
    case PostStatus::failed:
      return fmt::format("ibv_post failed: {} ({}){}", errno_name(sys_errno),
                         std::system_category().message(sys_errno), where);
  }
  return "?";
}

}  // namespace rdmakit
