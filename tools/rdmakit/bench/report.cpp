// SPDX-License-Identifier: Apache-2.0
// rdmakit bench: the report, in perftest's columns, or JSON.
#include "bench/bench.hpp"

#include <cmath>
#include <cstdio>
#include <numeric>

namespace rdmakit::tools::bench {

using namespace std::chrono_literals;

double quantile(const std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const auto idx = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
  return v[std::min(idx, v.size() - 1)];
}

json result_json_bw(const Result& r) {
  return {{"bytes", r.bytes},         {"iterations", r.iters},
          {"seconds", r.seconds},     {"bw_peak_MBps", r.bw_peak},
          {"bw_avg_MBps", r.bw_avg},  {"bw_avg_Gbps", r.bw_avg * 1024 * 1024 * 8 / 1e9},
          {"msg_rate_Mpps", r.msg_rate}};
}

json result_json(const BenchOptions& o, const Result& r) {
  json j = {{"bytes", r.bytes}, {"iterations", r.iters}, {"seconds", r.seconds}};
  if (o.bw()) {
    j = result_json_bw(r);
  } else {
    const auto& v = r.lat_us;
    const double avg = v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
    double var = 0;
    for (double x : v) var += (x - avg) * (x - avg);
    j["t_min_us"] = v.empty() ? 0 : v.front();
    j["t_median_us"] = quantile(v, 0.5);
    j["t_avg_us"] = avg;
    j["t_stdev_us"] = v.empty() ? 0 : std::sqrt(var / static_cast<double>(v.size()));
    j["t_p99_us"] = quantile(v, 0.99);
    j["t_p999_us"] = quantile(v, 0.999);
    j["t_max_us"] = v.empty() ? 0 : v.back();
  }
  if (o.validate) j["validated"] = r.validated;
  return j;
}

void print_header(const BenchOptions& o, const ConnectionInfo& info, std::uint32_t signal_every) {
  fmt::print("---------------------------------------------------------------------------------------\n");
  fmt::print("                    RDMA {} {} (rdmakit bench)\n", o.op, o.bw() ? "bandwidth" : "latency");
  fmt::print(" device {} port {} ({}), GID [{}] {} {}, path MTU {}, connected over {}\n", info.device,
             info.port, to_string(info.link_layer), info.local.gid_index, info.local_gid.address(),
             to_string(info.local.gid_type), info.path_mtu, to_string(info.method));
  fmt::print(" local QPN {:#08x} PSN {:#08x}, remote QPN {:#08x} PSN {:#08x}{}\n", info.local.qpn,
             info.local.psn, info.remote.qpn, info.remote.psn,
             info.qps > 1 ? fmt::format(" (+{} more QPs; >= {} B striped)", info.qps - 1,
                                        ConnectionConfig{}.stripe_min)
                          : "");
  if (o.bidir) fmt::print(" bidirectional: both sides send; figures are the sum of both directions\n");
  fmt::print(" tx depth {}, post list {}, signal every {}, max inline {}, completions by {}\n",
             o.bw() ? o.tx_depth : 1u, o.bw() ? o.post_list : 1u, o.bw() ? signal_every : 1u,
             info.max_inline, o.events ? "events" : "polling");
  fmt::print("---------------------------------------------------------------------------------------\n");
  if (o.bw()) {
    fmt::print(" {:<10} {:<14} {:>16} {:>19} {:>14} {:>14}\n", "#bytes", "#iterations",
               "BW peak[MB/sec]", "BW average[MB/sec]", "BW avg[Gb/s]", "MsgRate[Mpps]");
  } else {
    fmt::print(" {:<8} {:<8} {:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "#bytes",
               "#iter", "t_min[us]", "t_median[us]", "t_avg[us]", "t_stdev", "99%[us]",
               "99.9%[us]", "t_max[us]");
  }
}

void print_row(const BenchOptions& o, const json& j) {
  if (o.bw()) {
    fmt::print(" {:<10} {:<14} {:>16.2f} {:>19.2f} {:>14.4f} {:>14.6f}{}\n", j["bytes"].get<std::size_t>(),
               j["iterations"].get<std::uint64_t>(), j["bw_peak_MBps"].get<double>(),
               j["bw_avg_MBps"].get<double>(), j["bw_avg_Gbps"].get<double>(),
               j["msg_rate_Mpps"].get<double>(),
               j.contains("validated") ? (j["validated"].get<bool>() ? "  validated" : "  VALIDATION FAILED") : "");
  } else {
    fmt::print(" {:<8} {:<8} {:>10.2f} {:>12.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f} {:>10.2f}{}\n",
               j["bytes"].get<std::size_t>(), j["iterations"].get<std::uint64_t>(),
               j["t_min_us"].get<double>(), j["t_median_us"].get<double>(), j["t_avg_us"].get<double>(),
               j["t_stdev_us"].get<double>(), j["t_p99_us"].get<double>(), j["t_p999_us"].get<double>(),
               j["t_max_us"].get<double>(),
               j.contains("validated") ? (j["validated"].get<bool>() ? "  validated" : "  VALIDATION FAILED") : "");
  }
  std::fflush(stdout);
}

}  // namespace rdmakit::tools::bench
