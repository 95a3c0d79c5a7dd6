// The exposition text of a MetricsSnapshot (metrics.hpp), and the histogram the batches feed.
#include "engine/metrics.hpp"

#include <algorithm>
#include <bit>
#include <numeric>

#include <fmt/format.h>

#include "rdmakit/version.hpp"

namespace rdmakit::detail {

void LatencyHistogram::observe(std::int64_t ns) noexcept {
  // Rounded up: bucket i holds (2^(i-1), 2^i] microseconds (its le is inclusive), 0 and 1 us
  // go to bucket 0.
  const std::uint64_t us = ns <= 0 ? 0 : (static_cast<std::uint64_t>(ns) + 999) / 1000;
  const std::size_t i = us <= 1 ? 0 : static_cast<std::size_t>(std::bit_width(us - 1));
  counts[std::min(i, kBuckets)].fetch_add(1, std::memory_order_relaxed);
  sum_ns.fetch_add(ns <= 0 ? 0 : static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
}

SubmitTally SubmitTally::of(std::span<const Transfer> t) {
  std::array<std::uint64_t, SubmitFigures::kEntries> a{};
  for (const Transfer& x : t) {
    const std::size_t op = static_cast<std::size_t>(x.op) & (kOps - 1);
    ++a[op];
    const std::uint64_t len = counted_length(x);
    a[kOps + op] += len;
    ++a[2 * kOps + size_bucket(len)];
  }
  SubmitTally s;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] != 0) s.nonzero.emplace_back(static_cast<std::uint16_t>(i), a[i]);
  }
  return s;
}

namespace {

// The length of the valid UTF-8 sequence at s[i] (0: not one). Prometheus refuses a scrape with
// invalid UTF-8 in a label value, and peer names are any bytes but control characters.
std::size_t utf8_at(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
  }
  if (n == 2 && c < 0xc2) return 0;                                // overlong
  if (n == 3 && c == 0xe0 && b(i + 1) < 0xa0) return 0;             // overlong
  if (n == 3 && c == 0xed && b(i + 1) >= 0xa0) return 0;            // surrogates
  if (n == 4 && (c > 0xf4 || (c == 0xf0 && b(i + 1) < 0x90) || (c == 0xf4 && b(i + 1) >= 0x90))) return 0;
  return n;
}

// A label value as the format wants it: backslash, double quote and newline escaped.
std::string escaped(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const char c = v[i];
    if (const std::size_t n = utf8_at(v, i); n != 1) {
      if (n == 0) {
        out += "\xEF\xBF\xBD";  // U+FFFD for a byte that is not UTF-8
      } else {
        out.append(v.substr(i, n));
        i += n - 1;
      }
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// "rxe1 port 1 (198.18.1.2, 198.18.1.0/24)" -> "rxe1 port 1": a rail's label.
std::string rail_label(const std::string& local) {
  const auto paren = local.find(" (");
  return paren == std::string::npos ? local : local.substr(0, paren);
}

std::string number(double v) {
  return fmt::format("{}", v);
}

class Text {
 public:
  explicit Text(const std::string& engine) : engine_(escaped(engine)) {}

  /// HELP and TYPE of a family (once, before its samples).
  void family(std::string_view name, std::string_view type, std::string_view help) {
    fmt::format_to(std::back_inserter(out_), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  /// One sample: labels are name/value pairs after the engine's.
  void sample(std::string_view name, std::initializer_list<std::pair<std::string_view, std::string>> labels,
              std::string_view value) {
    fmt::format_to(std::back_inserter(out_), "{}{{engine=\"{}\"", name, engine_);
    for (const auto& [k, v] : labels) fmt::format_to(std::back_inserter(out_), ",{}=\"{}\"", k, escaped(v));
    fmt::format_to(std::back_inserter(out_), "}} {}\n", value);
  }
  void sample(std::string_view name, std::initializer_list<std::pair<std::string_view, std::string>> labels,
              std::uint64_t value) {
    sample(name, labels, std::to_string(value));
  }
  /// A family of one unlabelled sample.
  void single(std::string_view name, std::string_view type, std::string_view help, std::uint64_t value) {
    family(name, type, help);
    sample(name, {}, value);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string engine_;
  std::string out_;
};

}  // namespace

std::string render_metrics(const MetricsSnapshot& s, const MetricsOptions& options, RestFloors* floors) {
  RestFloors none;
  RestFloors& floor = floors != nullptr ? *floors : none;
  Text t(s.engine);
  const EngineCounters& c = s.counters;
  t.family("rdmakit_build_info", "gauge", "The rdmakit library serving these figures (always 1).");
  t.sample("rdmakit_build_info", {{"version", std::string(version())}}, 1);
  t.single("rdmakit_listening", "gauge", "1 while the engine's listener accepts links.", s.listening ? 1 : 0);

  // Work.
  t.single("rdmakit_batches_total", "counter", "Batches submitted.", c.batches);
  t.single("rdmakit_transfers_total", "counter", "Transfers submitted (descriptors).", c.transfers);
  t.family("rdmakit_transfers_failed_total", "counter", "Transfers that ended other than ok, by status.");
  for (std::size_t i = 0; i < s.failed.size(); ++i) {
    const auto st = static_cast<TransferStatus>(i);
    if (st == TransferStatus::pending || st == TransferStatus::ok || i > static_cast<std::size_t>(TransferStatus::lease_expired)) {
      continue;  // (a status added after lease_expired: extend this bound)
    }
    t.sample("rdmakit_transfers_failed_total", {{"status", to_string(st)}}, s.failed[i]);
  }
  t.family("rdmakit_submitted_transfers_total", "counter", "Transfers batches asked for, by operation.");
  for (std::size_t op = 0; op < kOps; ++op) {
    t.sample("rdmakit_submitted_transfers_total", {{"op", to_string(static_cast<TransferOp>(op))}}, s.submitted[op]);
  }
  t.family("rdmakit_submitted_bytes_total", "counter", "Bytes batches asked to move, by operation (an atomic's: its 8).");
  for (std::size_t op = 0; op < kOps; ++op) {
    t.sample("rdmakit_submitted_bytes_total", {{"op", to_string(static_cast<TransferOp>(op))}}, s.submitted[kOps + op]);
  }
  t.family("rdmakit_transfer_size_bytes", "histogram", "Sizes of the transfers batches asked for.");
  {
    std::uint64_t cumulative = 0, sum = 0;
    for (std::size_t op = 0; op < kOps; ++op) sum += s.submitted[kOps + op];
    for (std::size_t b = 0; b < kSizeBuckets; ++b) {
      cumulative += s.submitted[2 * kOps + b];
      t.sample("rdmakit_transfer_size_bytes_bucket", {{"le", std::to_string(std::uint64_t{1} << b)}}, cumulative);
    }
    cumulative += s.submitted[2 * kOps + kSizeBuckets];
    t.sample("rdmakit_transfer_size_bytes_bucket", {{"le", "+Inf"}}, cumulative);
    t.sample("rdmakit_transfer_size_bytes_sum", {}, sum);
    t.sample("rdmakit_transfer_size_bytes_count", {}, cumulative);
  }
  t.single("rdmakit_bytes_total", "counter", "Bytes moved by reads and writes that ended ok.", c.bytes);
  t.family("rdmakit_path_bytes_total", "counter",
           "Bytes of reads and writes that ended ok, by the local device or transport they took.");
  for (const auto& p : s.paths) t.sample("rdmakit_path_bytes_total", {{"path", p.name}, {"transport", p.transport}}, p.bytes);
  t.family("rdmakit_path_transfers_total", "counter", "Transfers that ended ok, by the local device or transport they took.");
  for (const auto& p : s.paths) {
    t.sample("rdmakit_path_transfers_total", {{"path", p.name}, {"transport", p.transport}}, p.transfers);
  }
  if (s.telemetry) {
    t.family("rdmakit_batch_duration_seconds", "histogram", "Time from submit() to a batch's last transfer ending.");
    std::uint64_t cumulative = 0;
    for (std::size_t i = 0; i < LatencyHistogram::kBuckets; ++i) {
      cumulative += s.batch_buckets[i];
      t.sample("rdmakit_batch_duration_seconds_bucket", {{"le", number(static_cast<double>(std::uint64_t{1} << i) * 1e-6)}},
               cumulative);
    }
    cumulative += s.batch_buckets[LatencyHistogram::kBuckets];
    t.sample("rdmakit_batch_duration_seconds_bucket", {{"le", "+Inf"}}, cumulative);
    t.sample("rdmakit_batch_duration_seconds_sum", {}, number(static_cast<double>(s.batch_sum_ns) * 1e-9));
    t.sample("rdmakit_batch_duration_seconds_count", {}, cumulative);
  }
  t.single("rdmakit_plan_transfers_posted_total", "counter", "Transfers of prepared plans posted as built.", c.plan_posted);
  t.single("rdmakit_plan_builds_total", "counter", "Runs of plans built for a link.", c.plan_builds);
  t.single("rdmakit_submits_inline_total", "counter", "Batches started on the submitting thread.", c.submits_inline);
  t.single("rdmakit_waits_spun_total", "counter", "Batch waits that saw their batch end while polling.", c.waits_spun);

  // Links.
  t.single("rdmakit_peers", "gauge", "Peers added.", c.peers);
  t.single("rdmakit_links", "gauge", "Links up now, initiated and accepted.", c.links);
  t.single("rdmakit_qps", "gauge", "Queue pairs now.", c.qps);
  t.single("rdmakit_connects_total", "counter", "Links this engine initiated.", c.connects);
  t.single("rdmakit_reconnects_total", "counter", "Of those, to a peer linked before.", c.reconnects);
  t.single("rdmakit_accepts_total", "counter", "Links peers opened to this engine.", c.accepts);
  t.single("rdmakit_evictions_total", "counter", "Idle links closed to stay within max_qps.", c.evictions);
  t.single("rdmakit_restarts_total", "counter", "Peers seen again with a new epoch (restarted).", c.restarts);
  t.family("rdmakit_handshakes_refused_total", "counter", "Handshakes and links refused, by reason.");
  t.sample("rdmakit_handshakes_refused_total", {{"reason", "busy"}}, s.refusals.busy);
  t.sample("rdmakit_handshakes_refused_total", {{"reason", "auth"}}, s.refusals.auth);
  t.sample("rdmakit_handshakes_refused_total", {{"reason", "protocol"}}, s.refusals.protocol);
  t.sample("rdmakit_handshakes_refused_total", {{"reason", "identity"}}, s.refusals.identity);
  t.sample("rdmakit_handshakes_refused_total", {{"reason", "other"}}, s.refusals.other);

  // Rails.
  t.single("rdmakit_rail_links_total", "counter", "Links opened on peers' further rails.", c.rail_links);
  t.single("rdmakit_rail_failures_total", "counter", "Rails that went down (failovers).", c.rail_failures);
  t.single("rdmakit_reposted_total", "counter", "Reads and writes re-posted on another rail after theirs failed.", c.reposted);
  t.single("rdmakit_slices_total", "counter", "Slices that sliced transfers were cut into.", c.slices);

  // Per peer, bounded: the busiest by bytes named, the rest summed in the series without a peer.
  std::vector<const PeerInfo*> order;
  order.reserve(s.peers.size());
  std::vector<std::uint64_t> bytes_of(s.peers.size(), 0);
  for (std::size_t i = 0; i < s.peers.size(); ++i) {
    for (const auto& r : s.peers[i].rails) bytes_of[i] += r.bytes;
    order.push_back(&s.peers[i]);
  }
  auto bytes = [&](const PeerInfo* p) { return bytes_of[static_cast<std::size_t>(p - s.peers.data())]; };
  const std::size_t named = std::min(options.top_peers, order.size());
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(named), order.end(),
                    [&](const PeerInfo* a, const PeerInfo* b) {
                      return bytes(a) != bytes(b) ? bytes(a) > bytes(b) : a->name < b->name;
                    });
  t.family("rdmakit_peer_bytes_total", "counter",
           "Bytes this engine's reads and writes moved with a peer: the busiest by name, the rest "
           "summed in the series without a peer label.");
  for (std::size_t i = 0; i < named; ++i) t.sample("rdmakit_peer_bytes_total", {{"peer", order[i]->name}}, bytes(order[i]));
  std::uint64_t rest = 0;
  for (std::size_t i = named; i < order.size(); ++i) rest += bytes(order[i]);
  floor.peers = std::max(floor.peers, rest);
  if (named < order.size() || floor.peers != 0) t.sample("rdmakit_peer_bytes_total", {}, floor.peers);
  t.family("rdmakit_peer_linked", "gauge", "1 while a link to the peer is up (the peers named in rdmakit_peer_bytes_total).");
  for (std::size_t i = 0; i < named; ++i) t.sample("rdmakit_peer_linked", {{"peer", order[i]->name}}, order[i]->linked ? 1 : 0);
  t.single("rdmakit_peers_linked", "gauge", "Peers with a link up now.",
           static_cast<std::uint64_t>(std::count_if(s.peers.begin(), s.peers.end(), [](const PeerInfo& p) { return p.linked; })));
  // Their rails (the named peers' only).
  auto rails = [&](std::string_view name, std::string_view type, std::string_view help, auto value) {
    t.family(name, type, help);
    for (std::size_t i = 0; i < named; ++i) {
      std::vector<std::string> seen;  // a restarted peer's rail may be listed gone beside its new one
      for (const auto& r : order[i]->rails) {
        if (r.state == "unused" || r.state == "gone") continue;
        std::string label = rail_label(r.local);
        if (std::find(seen.begin(), seen.end(), label) != seen.end()) continue;
        t.sample(name, {{"peer", order[i]->name}, {"rail", label}}, value(r));
        seen.push_back(std::move(label));
      }
    }
  };
  rails("rdmakit_peer_rail_bytes_total", "counter", "Bytes moved on a named peer's rail.",
        [](const RailInfo& r) { return r.bytes; });
  rails("rdmakit_peer_rail_up", "gauge", "1 while a named peer's rail is up.",
        [](const RailInfo& r) -> std::uint64_t { return r.state == "up" ? 1 : 0; });
  rails("rdmakit_peer_rail_failures_total", "counter", "Times a named peer's rail went down.",
        [](const RailInfo& r) { return r.failures; });
  rails("rdmakit_peer_rail_reposted_total", "counter", "Transfers re-posted off a named peer's rail after it failed.",
        [](const RailInfo& r) { return r.reposted; });

  // Served: what peers said they moved on the links they opened here, bounded the same way.
  std::vector<const std::pair<std::string, std::uint64_t>*> by;
  std::uint64_t served_rest = 0;
  for (const auto& p : s.served) {
    if (p.first.empty()) {
      served_rest += p.second;  // names beyond the engine's bound
    } else {
      by.push_back(&p);
    }
  }
  const std::size_t served_named = std::min(options.top_peers, by.size());
  std::partial_sort(by.begin(), by.begin() + static_cast<std::ptrdiff_t>(served_named), by.end(), [](const auto* a, const auto* b) {
    return a->second != b->second ? a->second > b->second : a->first < b->first;
  });
  for (std::size_t i = served_named; i < by.size(); ++i) served_rest += by[i]->second;
  t.family("rdmakit_peer_served_bytes_total", "counter",
           "Bytes peers' reads and writes moved on links they opened to this engine, as each peer reports "
           "them (at most a second behind): the busiest by name, the rest in the series without a peer label.");
  for (std::size_t i = 0; i < served_named; ++i) t.sample("rdmakit_peer_served_bytes_total", {{"peer", by[i]->first}}, by[i]->second);
  floor.served = std::max(floor.served, served_rest);
  if (served_named < by.size() || floor.served != 0) t.sample("rdmakit_peer_served_bytes_total", {}, floor.served);

  // Notifications.
  t.single("rdmakit_notifications_sent_total", "counter", "Notifications sent.", c.notifications_sent);
  t.single("rdmakit_notifications_received_total", "counter", "Notifications received.", c.notifications_received);
  t.single("rdmakit_notifications_refused_total", "counter", "Notifications not sent (the peer's queue full, no link).",
           c.notifications_refused);
  t.single("rdmakit_notifications_dropped_total", "counter", "Notifications a peer sent beyond its credits (not queued).",
           c.notifications_dropped);
  t.single("rdmakit_notifications_lost_total", "counter", "Notifications whose link broke before they left.",
           c.notifications_lost);

  // Access.
  t.single("rdmakit_windows_bound_total", "counter", "Memory windows bound (one per peer link per segment).", c.windows_bound);
  t.family("rdmakit_window_bind_seconds_total", "counter", "Time the window binds took, posting to completion, summed.");
  t.sample("rdmakit_window_bind_seconds_total", {}, number(static_cast<double>(c.window_bind_ns) * 1e-9));
  t.single("rdmakit_leases_granted_total", "counter", "Leases this engine granted.", c.leases_granted);
  t.single("rdmakit_leases_ended_total", "counter", "Of those, ended (expired, released, revoked, withdrawn, lost).",
           c.leases_ended);
  t.single("rdmakit_lease_renewals_total", "counter", "Renewals granted to holders.", c.lease_renewals);
  t.single("rdmakit_leases_active", "gauge", "Leases granted and not ended.", s.leases_active);

  // Memory.
  t.family("rdmakit_registered_bytes", "gauge", "Bytes of registered buffers, by memory kind.");
  for (const auto& m : s.memory) t.sample("rdmakit_registered_bytes", {{"kind", m.kind}}, m.bytes);
  t.family("rdmakit_registered_buffers", "gauge", "Registered buffers, by memory kind.");
  for (const auto& m : s.memory) t.sample("rdmakit_registered_buffers", {{"kind", m.kind}}, m.buffers);

  // The metadata store.
  if (s.store) {
    t.single("rdmakit_metadata_published", "gauge", "1 while the store holds this engine's record under its lease.",
             s.published ? 1 : 0);
    t.single("rdmakit_metadata_up", "gauge", "1 while the store answers (the last call to it succeeded).",
             s.store_failing ? 0 : 1);
    t.single("rdmakit_metadata_errors_total", "counter", "Calls to the metadata store that failed.", s.store_errors);
    t.single("rdmakit_metadata_engines_known", "gauge", "Other engines the store lists.", s.store_known);
  }
  return t.take();
}

}  // namespace rdmakit::detail
