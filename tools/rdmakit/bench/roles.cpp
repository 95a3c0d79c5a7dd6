// SPDX-License-Identifier: Apache-2.0
// rdmakit bench: the client and the server, phase by phase.
#include "bench/bench.hpp"

#include <optional>

namespace rdmakit::tools::bench {

using namespace std::chrono_literals;

ConnectionConfig bench_config(const BenchOptions& o) {
  ConnectOptions net = o.net;
  net.trace_json = o.json_out;
  ConnectionConfig cfg = net.config();
  cfg.send_depth = std::max<std::uint32_t>(o.tx_depth, 16);
  // Send bandwidth needs receives ahead of the sender; twice its depth keeps RNR away.
  cfg.recv_depth = std::max<std::uint32_t>(2 * o.tx_depth, 64);
  cfg.max_inline = o.inline_size;
  cfg.completion_events = o.events;
  cfg.qps = o.qps;  // the server follows the client's count
  return cfg;
}

void bench_setup(const BenchOptions& o, Connection& c) {
  c.advertise(o.mem.allocate(c, o.buffer_bytes(), Access::local_write | Access::remote_read |
                                                      Access::remote_write | Access::remote_atomic));
}

// Latency tests and validation touch the bytes with the CPU; GPU memory registered directly has
// none to touch.
void require_cpu_view(const BenchOptions& o, const MemoryRegion& m) {
  if (m.data() == nullptr && (!o.bw() || o.validate || o.op == "atomic")) {
    throw Fail(fmt::format("{}: the CPU cannot reach this memory; only write/read/send bw without "
                           "--validate run on it", describe_memory(m)));
  }
}

int finish(const BenchOptions& o, const json& rows, bool failed) {
  if (o.json_out) fmt::print("{}\n", json{{"op", o.op}, {"mode", o.mode}, {"results", rows}}.dump(2));
  return failed ? 1 : 0;
}

// perftest reports a bidirectional run as the sum of both directions.
void add_peer(Result& r, const json& peer) {
  r.bw_avg += peer.at("bw_avg_MBps").get<double>();
  r.bw_peak += peer.at("bw_peak_MBps").get<double>();
  r.msg_rate += peer.at("msg_rate_Mpps").get<double>();
}

int run_client(const BenchOptions& o) {
  Connection c = Connection::connect(o.net.connect_target(), bench_config(o),
                                     [&](Connection& cc) { bench_setup(o, cc); });
  const MemoryRegion& mine = c.memory(0);
  require_cpu_view(o, mine);
  if (!o.json_out) {
    print_header(o, c.info(), static_cast<std::uint32_t>(signal_interval(o.tx_depth)));
    fmt::print(" memory: {}\n", describe_memory(mine));
  }
  json rows = json::array();
  bool failed = false;
  for (std::size_t size : o.sizes()) {
    // Without --validate every request uses the same buffer, as perftest does: spreading them
    // over 8 MiB of slots made the (software) NIC's copies miss caches at large sizes.
    Phase p{o.op,       o.mode,      size,
            o.iterations(), o.tx_depth, o.post_list,
            o.validate ? o.slots(size) : 1, o.validate, o.duration, o.bidir, o.half_bytes()};
    // Send with validation: at most one receive per slot is posted, so the sender keeps no more
    // than that in flight.
    if (o.validate && o.op == "send") p.tx_depth = static_cast<std::uint32_t>(std::min<std::size_t>(p.tx_depth, p.slots));
    // --bidir: the peer READs our first half and SENDs into our second; both are ready before
    // the peer hears the parameters.
    std::optional<Receiver> rx;
    if (p.bidir && p.op == "read") {
      for (std::size_t s = 0; s < p.slots; ++s) fill_region(mine, s * p.size, p.size, s);
    }
    if (p.bidir && p.op == "send") {
      rx.emplace(c, p, mine, p.half);
      rx->start();
    }
    send_json(c, to_json(p));
    (void)recv_json(c, 30s, "ready");
    Result r = o.bw() ? run_bw_initiator(c, p, mine, !o.json_out, rx ? &*rx : nullptr)
                      : run_lat(c, p, mine, true);
    if (p.duration > 0 && p.op == "send") send_json(c, {{"stop", r.iters}});
    send_json(c, {{"done", true}, {"iters", r.iters}});
    const json verdict = recv_json(c, 120s, "verdict");
    if (o.validate) r.validated = r.validated && verdict.value("validated", false);
    if (p.bidir) {
      if (o.validate && p.op == "write") {
        r.validated = r.validated && check_written(mine, p.half, p, verdict.at("peer").at("iterations"));
      }
      add_peer(r, verdict.at("peer"));
    }
    json row = result_json(o, r);
    if (o.validate && !r.validated) failed = true;
    if (!o.json_out) print_row(o, row);
    rows.push_back(std::move(row));
  }
  send_json(c, {{"finished", true}});
  if (!o.json_out) fmt::print("---------------------------------------------------------------------------------------\n");
  c.wait_peer_close(10s);
  return finish(o, rows, failed);
}

int run_server(const BenchOptions& o) {
  Listener listener(o.net.listen_address(), bench_config(o),
                    [&](Connection& cc) { bench_setup(o, cc); });
  if (!o.json_out) fmt::print("waiting for a bench client on port {}\n", listener.port());
  std::optional<Connection> conn;
  while (!(conn = listener.accept(1s))) {
  }
  Connection& c = *conn;
  const MemoryRegion& mine = c.memory(0);
  require_cpu_view(o, mine);
  auto* base = static_cast<std::uint8_t*>(mine.data());
  if (!o.json_out) {
    print_header(o, c.info(), static_cast<std::uint32_t>(signal_interval(o.tx_depth)));
    fmt::print(" memory: {}\n", describe_memory(mine));
  }
  for (;;) {
    const json j = recv_json(c, 600s, "phase parameters");
    if (j.contains("finished")) break;
    const Phase p = phase_from(j);
    if (p.op != o.op || p.mode != o.mode) {
      send_json(c, {{"error", fmt::format("the server runs {} {}, the client asked for {} {}", o.op,
                                          o.mode, p.op, p.mode)}});
      return 1;
    }
    if (p.half + p.size * p.slots > mine.size() || (p.mode == "lat" && 2 * p.size > mine.size())) {
      send_json(c, {{"error", fmt::format("{} B x {} slots exceeds the server's {} B buffer: give "
                                          "the server the same --size/--all/--tx-depth",
                                          p.size, p.slots, mine.size())}});
      return 1;
    }
    bool valid = true;
    if (p.op == "read") {
      for (std::size_t s = 0; s < p.slots; ++s) fill_region(mine, s * p.size, p.size, s);
    }
    if (p.op == "atomic") std::memset(base, 0, 8);
    std::optional<Result> mine_result;  // --bidir: this side's own direction
    if (p.mode == "bw" && p.bidir) {
      std::optional<Receiver> rx;
      if (p.op == "send") {
        rx.emplace(c, p, mine, p.half);
        rx->start();
      }
      send_json(c, {{"ready", true}});
      mine_result = run_bw_initiator(c, p, mine, false, rx ? &*rx : nullptr);
      valid = mine_result->validated;
    } else if (p.mode == "bw" && p.op == "send") {
      valid = run_bw_send_target(c, p, mine);
    } else if (p.mode == "lat") {
      if (p.op == "write" || p.op == "send") std::memset(base, 0, 2 * p.size);  // no stale tag
      if (p.op == "send") {
        // The client's first SEND must find a receive.
        if (const PostResult r = c.post_recv(mine.local().subslice(p.size, p.size), 0); !r.ok()) {
          throw Fail(r.describe());
        }
      }
      send_json(c, {{"ready", true}});
      (void)run_lat(c, p, mine, false);
    } else {
      send_json(c, {{"ready", true}});
    }
    const json done = recv_json(c, 600s, "end of phase");
    if (p.validate && p.mode == "bw" && p.op == "write") {
      valid &= check_written(mine, p.bidir ? p.half : 0, p, done.at("iters"));
    }
    if (p.validate && p.op == "atomic") {  // every fetch-and-add added one
      std::uint64_t v;
      std::memcpy(&v, base, 8);
      valid = v == done.at("iters").get<std::uint64_t>();
    }
    json verdict = {{"validated", valid}};
    if (mine_result) verdict["peer"] = result_json_bw(*mine_result);
    send_json(c, verdict);
    if (!o.json_out) fmt::print(" {} B: done{}\n", p.size, p.validate ? (valid ? ", validated" : ", VALIDATION FAILED") : "");
  }
  c.close(10s);
  return 0;
}

}  // namespace rdmakit::tools::bench
