// SPDX-License-Identifier: Apache-2.0
#pragma once
// A fake verbs provider for unit tests of the data path's bookkeeping (rings, segmentation,
// partial posts, drain markers, breaks, wake-ups). It plugs in where a real provider does: its
// ibv_context's ops table serves ibv_post_send / ibv_post_recv / ibv_poll_cq /
// ibv_req_notify_cq (inline dispatches in verbs.h), and ops() the calls libibverbs makes itself
// (modify to ERR, CQ events); and each QP's and CQ's extended interface (ibv_qp_ex's ibv_wr_*,
// ibv_cq_ex's start/end poll), which a data path given them by use_extended() calls through their
// own function pointers. The rest is a deterministic model of an RC QP: work requests are
// taken in order and complete in order when the test says so; unsignaled successes leave no
// completion; a QP in ERR flushes everything it holds and everything posted to it afterwards.
//
// Beside the rxe tests, never instead of them: what a real device does is tested in the lab.
#include <infiniband/verbs.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <vector>

#include "datapath/datapath.hpp"

namespace fake {

/// A send work request as the fake NIC took it.
struct Wr {
  std::uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_SEND;
  unsigned flags = 0;
  int num_sge = 0;
  std::vector<ibv_sge> sges;
  std::uint64_t remote_addr = 0;
  std::uint32_t rkey = 0;
  std::uint32_t imm_data = 0;  // as posted (network byte order)
  std::uint64_t compare_add = 0;  // atomics
  std::uint64_t swap = 0;
  [[nodiscard]] bool signaled() const { return (flags & IBV_SEND_SIGNALED) != 0; }
  [[nodiscard]] std::uint64_t bytes() const {
    std::uint64_t n = 0;
    for (const ibv_sge& s : sges) n += s.length;
    return n;
  }
};

struct Recv {
  std::uint64_t wr_id = 0;
  std::vector<ibv_sge> sges;
};

class Verbs {
 public:
  Verbs();
  ~Verbs();
  Verbs(const Verbs&) = delete;
  Verbs& operator=(const Verbs&) = delete;

  /// A completion channel backed by an eventfd, so poll() on its fd works as on a real one.
  ibv_comp_channel* channel();
  ibv_cq* cq(ibv_comp_channel* channel = nullptr);
  ibv_qp* qp(ibv_cq* send_cq, ibv_cq* recv_cq, std::uint32_t qpn);
  [[nodiscard]] const rdmakit::detail::VerbsOps& ops() const;
  /// The QP's and the CQ's extended interfaces (ibv_wr_*: WRITE, READ, their SGEs or inline
  /// data; start/end poll and the fields the data path reads).
  ibv_qp_ex* qp_ex(ibv_qp* qp);
  ibv_cq_ex* cq_ex(ibv_cq* cq);
  /// Requests taken through a QP's extended interface.
  [[nodiscard]] std::size_t extended_posts() const { return extended_posts_; }
  /// Completions taken through a CQ's extended interface.
  [[nodiscard]] std::size_t extended_polls() const { return extended_polls_; }

  // --- the NIC --------------------------------------------------------------------------------
  /// Completes the `n` oldest work requests the QP holds, in order, with `status` (a success
  /// leaves a completion only for a signaled request; an error always leaves one, and like a
  /// real QP this one then goes to ERR and flushes the rest).
  void complete(ibv_qp* qp, std::size_t n, ibv_wc_status status = IBV_WC_SUCCESS,
                std::uint32_t vendor_err = 0);
  /// Completes `n` posted receives with `byte_len` bytes each.
  void complete_recv(ibv_qp* qp, std::size_t n, std::uint32_t byte_len,
                     ibv_wc_status status = IBV_WC_SUCCESS);
  /// After `after_calls` more successful posts, the next ibv_post_send (or ibv_post_recv) takes
  /// the chain's requests before index `at`, then fails (EINVAL) with *bad pointing at request
  /// `at`, as a provider that refuses a malformed WR does.
  void fail_post_at(int at, int after_calls = 0) {
    fail_post_at_ = at;
    fail_after_calls_ = after_calls;
  }
  /// Runs once, the next time a CQ is armed, just before it is: what the NIC does then lands in
  /// the CQ between the caller's last poll and its arming (and so raises no event).
  std::function<void()> on_arm;

  // --- what happened ----------------------------------------------------------------------------
  [[nodiscard]] std::size_t held(ibv_qp* qp) const;  ///< taken and not completed
  [[nodiscard]] const std::vector<Wr>& posted(ibv_qp* qp) const;  ///< every request ever taken
  [[nodiscard]] std::size_t recvs_held(ibv_qp* qp) const;
  [[nodiscard]] const std::vector<Recv>& recvs_posted(ibv_qp* qp) const;
  [[nodiscard]] bool in_error(ibv_qp* qp) const;
  [[nodiscard]] std::size_t cq_entries(ibv_cq* cq) const;
  [[nodiscard]] bool armed(ibv_cq* cq) const;
  /// Events written to channels so far.
  [[nodiscard]] int events() const { return events_; }

 private:
  struct Context {
    ibv_context ctx;  // first: an ibv_context* is a Context*
    Verbs* self;
  };
  struct Cq {
    Cq() : x{} {}
    Cq(const Cq&) = delete;
    Cq& operator=(const Cq&) = delete;
    union {  // an ibv_cq_ex's leading fields are an ibv_cq's (ibv_cq_ex_to_cq), as in rdma-core
      ibv_cq cq;
      ibv_cq_ex x;
    };
    std::deque<ibv_wc> entries;
    bool armed = false;
    bool polling = false;  // between start_poll and end_poll
  };
  struct Qp {
    Qp() = default;
    Qp(const Qp&) = delete;
    Qp& operator=(const Qp&) = delete;
    ibv_qp_ex x{};
    ibv_qp& qp = x.qp_base;
    std::vector<Wr> building;  // between wr_start and wr_complete
    bool in_wr = false;
    std::deque<Wr> sq;
    std::deque<Recv> rq;
    std::vector<Wr> history;
    std::vector<Recv> recv_history;
    bool error = false;
  };
  struct Channel {
    ibv_comp_channel ch{};
    std::deque<ibv_cq*> pending;
  };

  static Verbs& of(ibv_context* c) { return *reinterpret_cast<Context*>(c)->self; }
  static Qp& qp_of(ibv_qp* q) { return *static_cast<Qp*>(q->qp_context); }
  static Cq& cq_of(ibv_cq* c) { return *static_cast<Cq*>(c->cq_context); }
  void push(ibv_cq* cq, const ibv_wc& wc);
  void flush(Qp& q);
  static ibv_wc wc_for(const Qp& q, std::uint64_t wr_id, ibv_wc_status status, ibv_wc_opcode op);

  static int post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);
  static int post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad);
  static int poll_cq(ibv_cq* cq, int n, ibv_wc* wc);
  static int req_notify_cq(ibv_cq* cq, int solicited_only);
  static int to_error(ibv_qp* qp) noexcept;
  // The extended interfaces.
  static Qp& qp_of(ibv_qp_ex* x) { return qp_of(&x->qp_base); }
  void take(Qp& q, const Wr& w);
  static void wr_start(ibv_qp_ex* x);
  static void wr_rdma_write(ibv_qp_ex* x, std::uint32_t rkey, std::uint64_t addr);
  static void wr_rdma_read(ibv_qp_ex* x, std::uint32_t rkey, std::uint64_t addr);
  static void wr_set_sge(ibv_qp_ex* x, std::uint32_t lkey, std::uint64_t addr, std::uint32_t length);
  static void wr_set_sge_list(ibv_qp_ex* x, std::size_t n, const ibv_sge* sges);
  static void wr_set_inline_data(ibv_qp_ex* x, void* addr, std::size_t length);
  static int wr_complete(ibv_qp_ex* x);
  static void wr_abort(ibv_qp_ex* x);
  static int start_poll(ibv_cq_ex* x, ibv_poll_cq_attr* attr);
  static int next_poll(ibv_cq_ex* x);
  static void end_poll(ibv_cq_ex* x);
  static enum ibv_wc_opcode read_opcode(ibv_cq_ex* x);
  static std::uint32_t read_vendor_err(ibv_cq_ex* x);
  static std::uint32_t read_byte_len(ibv_cq_ex* x);
  static std::uint32_t read_qp_num(ibv_cq_ex* x);
  static unsigned int read_wc_flags(ibv_cq_ex* x);
  static int get_cq_event(ibv_comp_channel* ch, ibv_cq** cq, void** ctx) noexcept;
  static void ack_cq_events(ibv_cq* cq, unsigned n) noexcept;

  Context context_{};
  std::list<Cq> cqs_;
  std::list<Qp> qps_;
  std::list<Channel> channels_;
  int fail_post_at_ = -1;
  int fail_after_calls_ = 0;
  int events_ = 0;
  std::size_t extended_posts_ = 0;
  std::size_t extended_polls_ = 0;
  // Whether this call is the one that fails; counts the calls before it.
  bool failing_call();
};

}  // namespace fake
