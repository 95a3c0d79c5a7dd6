// SPDX-License-Identifier: Apache-2.0
// The exposition text of an engine's figures (engine/metrics.hpp), on snapshots of any size:
// promtool accepts it, the per-peer series stay bounded with 1,000 peers, names with quotes
// and backslashes are escaped, and the latency histogram's buckets are where they belong.
#include "engine/metrics.hpp"

#include "../shared/promtool.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

std::string promtool(const std::string& text) {
  return rdmakit::testing_support::promtool("check metrics", text, "unit_metrics.txt");
}

using rdmakit::detail::LatencyHistogram;
using rdmakit::detail::MetricsSnapshot;
using rdmakit::detail::render_metrics;

std::size_t lines_starting(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  std::size_t n = 0;
  for (std::string l; std::getline(in, l);) n += l.rfind(prefix, 0) == 0;
  return n;
}

MetricsSnapshot thousand_peers() {
  MetricsSnapshot s;
  s.engine = "kv \"0\"\\x";
  s.telemetry = true;
  for (int i = 0; i < 1000; ++i) {
    rdmakit::PeerInfo p;
    p.name = "peer-" + std::to_string(i);
    p.linked = i % 2 == 0;
    // Two rails each; peer i moved 1000 + i bytes on each.
    for (int r = 0; r < 2; ++r) {
      rdmakit::RailInfo ri;
      ri.local = "rxe" + std::to_string(r) + " port 1 (198.18." + std::to_string(r) + ".1, 198.18." + std::to_string(r) + ".0/24)";
      ri.state = r == 0 ? "up" : "down";
      ri.bytes = 1000 + static_cast<std::uint64_t>(i);
      ri.failures = static_cast<std::uint64_t>(r);
      p.rails.push_back(ri);
    }
    s.peers.push_back(p);
  }
  s.paths.push_back({"rxe0", "rdma", 10, 1});
  s.paths.push_back({"tcp", "tcp", 0, 0});
  s.memory.push_back({"host", 2, 1 << 20});
  s.store = true;
  s.published = true;
  return s;
}

}  // namespace

TEST(MetricsText, AThousandPeersStayBoundedAndPassPromtool) {
  const MetricsSnapshot s = thousand_peers();
  rdmakit::MetricsOptions o;
  o.top_peers = 64;
  const std::string text = render_metrics(s, o);
  EXPECT_EQ(promtool(text), "");
  // 64 named, and one series for the other 936.
  EXPECT_EQ(lines_starting(text, "rdmakit_peer_bytes_total{"), 65u);
  EXPECT_EQ(lines_starting(text, "rdmakit_peer_linked{"), 64u);
  EXPECT_EQ(lines_starting(text, "rdmakit_peer_rail_bytes_total{"), 128u);
  // The busiest first: peer-999 moved 2 x 1999.
  const std::string e = "engine=\"kv \\\"0\\\"\\\\x\"";
  EXPECT_NE(text.find("rdmakit_peer_bytes_total{" + e + ",peer=\"peer-999\"} 3998\n"), std::string::npos) << text.substr(0, 2000);
  EXPECT_EQ(text.find("peer=\"peer-935\""), std::string::npos);
  // The rest: peers 0..935, 2 x (1000 + i) each.
  std::uint64_t rest = 0;
  for (std::uint64_t i = 0; i < 936; ++i) rest += 2 * (1000 + i);
  EXPECT_NE(text.find("rdmakit_peer_bytes_total{" + e + "} " + std::to_string(rest) + "\n"), std::string::npos);
  EXPECT_NE(text.find("rdmakit_peer_rail_up{" + e + ",peer=\"peer-999\",rail=\"rxe1 port 1\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("rdmakit_peers_linked{" + e + "} 500\n"), std::string::npos);
  EXPECT_NE(text.find("rdmakit_metadata_published{" + e + "} 1\n"), std::string::npos);
  // Fewer peers than the bound: all named, no rest series.
  MetricsSnapshot few = s;
  few.peers.resize(3);
  const std::string t3 = render_metrics(few, o);
  EXPECT_EQ(lines_starting(t3, "rdmakit_peer_bytes_total{"), 3u);
  EXPECT_EQ(promtool(t3), "");
  // None named.
  o.top_peers = 0;
  const std::string t0 = render_metrics(s, o);
  EXPECT_EQ(lines_starting(t0, "rdmakit_peer_bytes_total{"), 1u);
  EXPECT_EQ(promtool(t0), "");
}

TEST(MetricsText, NamesAndLabelSetsAreStable) {
  // What dashboards and alerts are written against (docs/observability.md): a family renamed
  // or relabelled is a breaking change, made on purpose here.
  const std::string text = render_metrics(thousand_peers(), {});
  for (const char* family :
       {"rdmakit_build_info", "rdmakit_listening", "rdmakit_batches_total", "rdmakit_transfers_total",
        "rdmakit_transfers_failed_total", "rdmakit_submitted_transfers_total", "rdmakit_submitted_bytes_total",
        "rdmakit_transfer_size_bytes", "rdmakit_peer_served_bytes_total", "rdmakit_bytes_total", "rdmakit_path_bytes_total",
        "rdmakit_path_transfers_total", "rdmakit_batch_duration_seconds", "rdmakit_peers", "rdmakit_links",
        "rdmakit_qps", "rdmakit_connects_total", "rdmakit_reconnects_total", "rdmakit_accepts_total",
        "rdmakit_evictions_total", "rdmakit_restarts_total", "rdmakit_handshakes_refused_total",
        "rdmakit_rail_links_total", "rdmakit_rail_failures_total", "rdmakit_reposted_total",
        "rdmakit_peer_bytes_total", "rdmakit_peer_linked", "rdmakit_peer_rail_bytes_total",
        "rdmakit_peer_rail_up", "rdmakit_peer_rail_failures_total", "rdmakit_notifications_sent_total",
        "rdmakit_windows_bound_total", "rdmakit_leases_granted_total", "rdmakit_leases_active",
        "rdmakit_registered_bytes", "rdmakit_metadata_up", "rdmakit_metadata_errors_total",
        "rdmakit_submits_inline_total", "rdmakit_waits_spun_total", "rdmakit_submits_ended_total"}) {
    EXPECT_NE(text.find(std::string("# TYPE ") + family + " "), std::string::npos) << family;
  }
  EXPECT_NE(text.find(",path=\"rxe0\",transport=\"rdma\"} 10\n"), std::string::npos);
  EXPECT_NE(text.find(",status=\"lease_expired\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find(",reason=\"identity\"} 0\n"), std::string::npos);
  EXPECT_EQ(text.find(",status=\"pending\""), std::string::npos);
  EXPECT_EQ(text.find(",status=\"ok\""), std::string::npos);
}

TEST(MetricsText, LatencyBucketsHoldTheirRange) {
  LatencyHistogram h;
  h.observe(0);             // 0 us: the first bucket (le 1e-06)
  h.observe(1'000);         // 1 us: the first (le is inclusive)
  h.observe(1'001);         // just above 1 us: le 2e-06
  h.observe(2'500);         // 2.5 us: le 4e-06
  h.observe(4'000);         // 4 us: le 4e-06
  h.observe(1'000'000);     // 1 ms = 1000 us: le 1024e-06 (bucket 10)
  h.observe(60'000'000'000);  // a minute: +Inf
  EXPECT_EQ(h.counts[0].load(), 2u);
  EXPECT_EQ(h.counts[1].load(), 1u);
  EXPECT_EQ(h.counts[2].load(), 2u);
  EXPECT_EQ(h.counts[10].load(), 1u);
  EXPECT_EQ(h.counts[LatencyHistogram::kBuckets].load(), 1u);
  MetricsSnapshot s;
  s.engine = "a";
  s.telemetry = true;
  for (std::size_t i = 0; i < s.batch_buckets.size(); ++i) s.batch_buckets[i] = h.counts[i].load();
  s.batch_sum_ns = h.sum_ns.load();
  const std::string text = render_metrics(s, {});
  EXPECT_EQ(promtool(text), "");
  EXPECT_NE(text.find("rdmakit_batch_duration_seconds_bucket{engine=\"a\",le=\"1e-06\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("rdmakit_batch_duration_seconds_bucket{engine=\"a\",le=\"+Inf\"} 7\n"), std::string::npos);
  EXPECT_NE(text.find("rdmakit_batch_duration_seconds_count{engine=\"a\"} 7\n"), std::string::npos);
  // Without telemetry there are no times: no histogram.
  s.telemetry = false;
  EXPECT_EQ(render_metrics(s, {}).find("rdmakit_batch_duration_seconds"), std::string::npos);
}

// The dashboard in docs/grafana/rdmakit.json queries what the engine exports: every expression
// parses (promtool check rules, as recording rules) and names only families the text has.
TEST(MetricsText, TheDashboardsQueriesParseAndNameExportedFamilies) {
  std::ifstream in(std::string(RDMAKIT_SOURCE_DIR) + "/docs/grafana/rdmakit.json");
  ASSERT_TRUE(in) << "docs/grafana/rdmakit.json";
  const auto dash = nlohmann::json::parse(in);
  const std::string text = render_metrics(thousand_peers(), {});
  std::string rules = "groups:\n  - name: dashboard\n    rules:\n";
  int n = 0;
  for (const auto& p : dash.at("panels")) {
    for (const auto& t : p.at("targets")) {
      std::string expr = t.at("expr").get<std::string>();
      // Grafana's variable, as a query would have it substituted.
      for (std::size_t at; (at = expr.find("$engine")) != std::string::npos;) expr.replace(at, 7, ".*");
      rules += "      - record: dashboard:q" + std::to_string(n++) + "\n        expr: " + nlohmann::json(expr).dump() + "\n";
      for (std::size_t at = expr.find("rdmakit_"); at != std::string::npos; at = expr.find("rdmakit_", at + 1)) {
        std::size_t end = at;
        while (end < expr.size() && (std::isalnum(static_cast<unsigned char>(expr[end])) || expr[end] == '_')) ++end;
        std::string family = expr.substr(at, end - at);
        if (family.ends_with("_bucket")) family.resize(family.size() - 7);
        EXPECT_NE(text.find("# TYPE " + family + " "), std::string::npos) << family << " in " << expr;
        at = end;
      }
    }
  }
  EXPECT_GE(n, 8);
  EXPECT_EQ(rdmakit::testing_support::promtool("check rules", rules, "dashboard_rules.yml"), "") << rules;
}

// A peer that joins the named ones takes its bytes out of the rest: the rest, a counter, stays
// where it was rather than going down. Gone rails are not listed beside their successors, and
// a name that is not UTF-8 is made so (Prometheus refuses the whole scrape otherwise).
TEST(MetricsText, TheRestNeverGoesDownAndLabelsStayValid) {
  MetricsSnapshot s = thousand_peers();
  s.peers.resize(3);  // peer-0, -1, -2: 2 x (1000 + i) bytes each
  rdmakit::MetricsOptions o;
  o.top_peers = 1;
  rdmakit::detail::RestFloors floors;
  const std::string e = "engine=\"kv \\\"0\\\"\\\\x\"";
  std::string t = render_metrics(s, o, &floors);
  EXPECT_NE(t.find("rdmakit_peer_bytes_total{" + e + "} 4002\n"), std::string::npos) << t.substr(0, 3000);
  // peer-0 overtakes peer-2: the rest would be peer-1 + peer-2 = 2002 + 2004 = 4006; it grows.
  s.peers[0].rails[0].bytes += 10000;
  t = render_metrics(s, o, &floors);
  EXPECT_NE(t.find("rdmakit_peer_bytes_total{" + e + "} 4006\n"), std::string::npos);
  // peer-1 leaves the engine: the rest would drop to 2004; it stays at 4006.
  s.peers.erase(s.peers.begin() + 1);
  t = render_metrics(s, o, &floors);
  EXPECT_NE(t.find("rdmakit_peer_bytes_total{" + e + "} 4006\n"), std::string::npos);
  EXPECT_EQ(promtool(t), "");
  // A restarted peer's old rail, gone, beside its new one on the same port: one series.
  s.peers[0].rails[1].local = s.peers[0].rails[0].local;
  s.peers[0].rails[1].state = "gone";
  t = render_metrics(s, o, &floors);
  EXPECT_EQ(lines_starting(t, "rdmakit_peer_rail_up{"), 1u) << t;
  // Bytes that are not UTF-8 in a name: replaced, and promtool (which checks) accepts it.
  s.peers[0].name = std::string("bad\xff\xc3(") + "\xe2\x82\xac";
  t = render_metrics(s, o, &floors);
  EXPECT_NE(t.find("peer=\"bad\xEF\xBF\xBD\xEF\xBF\xBD(\xe2\x82\xac\""), std::string::npos) << t.substr(0, 3000);
  EXPECT_EQ(promtool(t), "");
}

namespace metrics_tally_test {

// A batch is counted by runs of one operation and length: the figures are those of counting each
// transfer on its own, whatever the runs (one, none longer than one, atomics, lengths past 2^48).
TEST(MetricsTally, ABatchCountedByRunsCountsEachTransfer) {
  using rdmakit::Transfer;
  using rdmakit::TransferOp;
  using rdmakit::detail::counted_length;
  using rdmakit::detail::kOps;
  using rdmakit::detail::size_bucket;
  using rdmakit::detail::SubmitFigures;
  std::uint64_t seed = 7;
  const auto next = [&seed] {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return seed >> 33;
  };
  for (int round = 0; round < 200; ++round) {
    std::vector<Transfer> t(round == 0 ? 0 : next() % 300);
    const std::uint64_t lengths[] = {1, 8, 4096, 65536, 65537, 0, std::uint64_t{1} << 50};
    for (Transfer& x : t) {
      // Some rounds one op; some with values past the last op (counted as masked, before checked).
      x.op = static_cast<TransferOp>(next() % (round % 3 == 0 ? 1 : round % 7 == 0 ? 2 * kOps : kOps));
      x.length = lengths[next() % (round % 5 == 0 ? 1 : std::size(lengths))];  // some one length
    }
    SubmitFigures runs;
    runs.add_batch(t.size(), [&](std::size_t i) { return rdmakit::detail::OpLength{t[i].op, t[i].length}; });
    std::array<std::uint64_t, SubmitFigures::kEntries> each{};
    for (const Transfer& x : t) {
      const std::size_t op = static_cast<std::size_t>(x.op) & (kOps - 1);
      ++each[op];
      each[kOps + op] += counted_length(x.op, x.length);
      ++each[2 * kOps + size_bucket(counted_length(x.op, x.length))];
    }
    for (std::size_t i = 0; i < each.size(); ++i) {
      ASSERT_EQ(runs.at[i].load(), each[i]) << "round " << round << ", entry " << i << ", " << t.size() << " transfers";
    }
    // A batch of one operation and length (descriptor lists of blocks alike) counts the same
    // through add_same.
    if (!t.empty() && std::all_of(t.begin(), t.end(), [&](const Transfer& x) { return x.op == t[0].op && x.length == t[0].length; })) {
      SubmitFigures same;
      same.add_same(t.size(), t[0].op, t[0].length);
      for (std::size_t i = 0; i < each.size(); ++i) ASSERT_EQ(same.at[i].load(), each[i]) << "add_same, entry " << i;
    }
  }
}

}  // namespace metrics_tally_test
