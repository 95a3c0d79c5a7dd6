// SPDX-License-Identifier: Apache-2.0
// rdmakit bench: perftest's measurements (ib_{write,read,send,atomic}_{bw,lat}) through the
// public library API only, so what it measures is what a user of the library gets. Its options.
#include "bench.hpp"

#include <CLI/CLI.hpp>

#include "bench/bench.hpp"

namespace rdmakit::tools {

using bench::BenchOptions;
using bench::kMaxSweep;
using bench::run_client;
using bench::run_server;

void add_bench(CLI::App& app, std::function<int()>& run) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app.add_subcommand("bench", "measure bandwidth or latency like perftest, through the library");
  sub->add_option("op", o->op, "write, read, send or atomic")
      ->required()
      ->check(CLI::IsMember({"write", "read", "send", "atomic"}));
  sub->add_option("mode", o->mode, "bw or lat")->required()->check(CLI::IsMember({"bw", "lat"}));
  o->net.add_to(*sub);
  sub->add_option("-s,--size", o->size, "message size in bytes (default: 65536 for bw, 2 for lat)")
      ->check(CLI::Range(std::size_t{1}, kMaxSweep));
  sub->add_flag("-a,--all", o->all, "sweep sizes 2 B to 8 MiB by powers of two");
  sub->add_option("-n,--iters", o->iters, "iterations per size (default: 5000 for bw, 1000 for lat)");
  sub->add_option("-D,--duration", o->duration, "bw: run for this many seconds instead of --iters")
      ->check(CLI::Range(0.001, 3600.0));
  sub->add_option("-t,--tx-depth", o->tx_depth, "requests in flight (bw)")
      ->check(CLI::Range(1u, 32767u))
      ->capture_default_str();
  sub->add_option("-l,--post-list", o->post_list, "requests chained per ibv_post_send (bw)")
      ->check(CLI::Range(1u, 4096u))
      ->capture_default_str();
  sub->add_option("-I,--inline", o->inline_size, "inline bytes to ask the QP for")->capture_default_str();
  sub->add_option("-q,--qps", o->qps,
                  "QPs per connection (client; write/read bw): chains spread over them, "
                  "messages of 512 KiB or more striped across all")
      ->check(CLI::Range(1u, 16u))
      ->capture_default_str();
  sub->add_flag("-b,--bidir", o->bidir, "bw: both sides send at once (reported as the sum)");
  o->mem.add_to(*sub);
  sub->add_flag("-e,--events", o->events, "sleep on a completion channel instead of polling");
  sub->add_flag("--validate", o->validate, "check every transfer's data");
  sub->add_flag("--json", o->json_out, "print the results as JSON");
  sub->callback([o, &run] {
    require_role(o->net, "bench");
    if (o->op == "atomic" && o->size != 0 && o->size != 8) {
      throw CLI::ValidationError("--size", "atomics are 8 bytes");
    }
    if (o->duration > 0 && !o->bw()) throw CLI::ValidationError("--duration", "--duration is for bw tests");
    if (o->qps > 1 && (o->op == "send" || o->op == "atomic" || !o->bw())) {
      throw CLI::ValidationError("--qps", "--qps is for write and read bandwidth: SEND/RECV and "
                                          "atomics stay on one QP to keep their order");
    }
    if (o->bidir && (!o->bw() || o->op == "atomic")) {
      throw CLI::ValidationError("--bidir", "--bidir is for write, read and send bandwidth");
    }
    if (o->bidir && o->duration > 0 && o->op == "send") {
      throw CLI::ValidationError("--bidir", "send --bidir counts messages: give --iters, not --duration");
    }
    if (o->duration > 0 && o->iters != 0) throw CLI::ValidationError("--duration", "give --duration or --iters");
    // Receives posted ahead for one size would take the next size's messages.
    if (o->duration > 0 && o->op == "send" && o->all) {
      throw CLI::ValidationError("--duration", "send with --duration measures one size (no --all)");
    }
    run = guarded("bench", [o] {
      o->mem.check(o->buffer_bytes());  // no CUDA device, no huge pages: said before connecting
      return o->net.serving() ? run_server(*o) : run_client(*o);
    });
  });
}

}  // namespace rdmakit::tools
