// SPDX-License-Identifier: Apache-2.0
// The exposition text of a MetricsSnapshot (metrics.hpp), and the submit tallies' counts.
#include "engine/metrics.hpp"

#include <algorithm>
#include <numeric>
#include <span>

#include <fmt/format.h>

#include "rdmakit/version.hpp"

namespace rdmakit::detail {

SubmitTally SubmitTally::of(std::span<const Transfer> t) {
  SubmitFigures f;  // counted as a batch of them would be, once
  f.add_batch(t.size(), [&](std::size_t i) { return OpLength{t[i].op, t[i].length}; });
  SubmitTally s;
  for (std::size_t i = 0; i < f.at.size(); ++i) {
    if (const std::uint64_t v = f.at[i].load(std::memory_order_relaxed); v != 0) s.nonzero.emplace_back(static_cast<std::uint16_t>(i), v);
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

// A peer's figure, and where it came from (its index in the snapshot's list).
struct Ranked {
  std::string_view name;
  std::uint64_t bytes = 0;
  std::size_t index = 0;
};

// `items` busiest first, ties by name, for the first `top` (the rest unordered); returns how
// many are named.
std::size_t rank(std::vector<Ranked>& items, std::size_t top) {
  const std::size_t named = std::min(top, items.size());
  std::partial_sort(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(named), items.end(),
                    [](const Ranked& a, const Ranked& b) { return a.bytes != b.bytes ? a.bytes > b.bytes : a.name < b.name; });
  return named;
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
  /// A histogram family: `per_bucket[i]` observations in bucket i (not cumulative; the last is
  /// above every bound), bucket i's bound as `le(i)`, and the sum as written.
  template <class Le>
  void histogram(std::string_view name, std::string_view help, std::span<const std::uint64_t> per_bucket, Le le,
                 const std::string& sum) {
    family(name, "histogram", help);
    const std::string bucket = std::string(name) + "_bucket";
    std::uint64_t cumulative = 0;
    for (std::size_t i = 0; i + 1 < per_bucket.size(); ++i) {
      cumulative += per_bucket[i];
      sample(bucket, {{"le", le(i)}}, cumulative);
    }
    cumulative += per_bucket.back();
    sample(bucket, {{"le", "+Inf"}}, cumulative);
    sample(std::string(name) + "_sum", {}, sum);
    sample(std::string(name) + "_count", {}, cumulative);
  }
  /// A per-peer counter bounded as the options say: `ranked`'s named entries by name, the rest
  /// (and `unnamed`: bytes of no name) in the series without a peer label, never below `floor`.
  void bounded(std::string_view name, std::string_view help, const std::vector<Ranked>& ranked, std::size_t named,
               std::uint64_t unnamed, std::uint64_t& floor) {
    family(name, "counter", help);
    for (std::size_t i = 0; i < named; ++i) sample(name, {{"peer", std::string(ranked[i].name)}}, ranked[i].bytes);
    std::uint64_t rest = unnamed;
    for (std::size_t i = named; i < ranked.size(); ++i) rest += ranked[i].bytes;
    floor = std::max(floor, rest);
    if (named < ranked.size() || floor != 0) sample(name, {}, floor);
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
  std::uint64_t asked = 0;
  for (std::size_t op = 0; op < kOps; ++op) asked += s.submitted[kOps + op];
  t.histogram("rdmakit_transfer_size_bytes", "Sizes of the transfers batches asked for.",
              std::span(s.submitted).subspan(2 * kOps), [](std::size_t b) { return std::to_string(std::uint64_t{1} << b); },
              std::to_string(asked));
  t.single("rdmakit_bytes_total", "counter", "Bytes moved by reads and writes that ended ok.", c.bytes);
  t.family("rdmakit_path_bytes_total", "counter",
           "Bytes of reads and writes that ended ok, by the local device or transport they took.");
  for (const auto& p : s.paths) t.sample("rdmakit_path_bytes_total", {{"path", p.name}, {"transport", p.transport}}, p.bytes);
  t.family("rdmakit_path_transfers_total", "counter", "Transfers that ended ok, by the local device or transport they took.");
  for (const auto& p : s.paths) {
    t.sample("rdmakit_path_transfers_total", {{"path", p.name}, {"transport", p.transport}}, p.transfers);
  }
  if (s.telemetry) {
    t.histogram("rdmakit_batch_duration_seconds", "Time from submit() to a batch's last transfer ending.", s.batch_buckets,
                [](std::size_t i) { return number(static_cast<double>(std::uint64_t{1} << i) * 1e-6); },
                number(static_cast<double>(s.batch_sum_ns) * 1e-9));
  }
  t.single("rdmakit_plan_transfers_posted_total", "counter", "Transfers of prepared plans posted as built.", c.plan_posted);
  t.single("rdmakit_plan_builds_total", "counter", "Runs of plans built for a link.", c.plan_builds);
  t.single("rdmakit_lists_transfers_posted_total", "counter", "Transfers of descriptor lists posted from the lists.",
           c.lists_posted);
  t.single("rdmakit_lists_builds_total", "counter", "Remote descriptor lists checked for a link.", c.lists_builds);
  t.single("rdmakit_shm_mapped_bytes_total", "counter", "Bytes over shm links copied once through memory the peer maps.",
           c.shm_mapped_bytes);
  t.single("rdmakit_submits_inline_total", "counter", "Batches started on the submitting thread.", c.submits_inline);
  t.single("rdmakit_waits_spun_total", "counter", "Batch waits that saw their batch end while polling.", c.waits_spun);
  t.single("rdmakit_submits_ended_total", "counter", "Batches that ended inside their submit (the submitter's look).",
           s.submits_ended);

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
  std::vector<Ranked> peers;
  peers.reserve(s.peers.size());
  for (std::size_t i = 0; i < s.peers.size(); ++i) {
    std::uint64_t b = 0;
    for (const auto& r : s.peers[i].rails) b += r.bytes;
    peers.push_back({s.peers[i].name, b, i});
  }
  const std::size_t named = rank(peers, options.top_peers);
  std::vector<const PeerInfo*> order;  // the named ones, busiest first
  for (std::size_t i = 0; i < named; ++i) order.push_back(&s.peers[peers[i].index]);
  t.bounded("rdmakit_peer_bytes_total",
            "Bytes this engine's reads and writes moved with a peer: the busiest by name, the rest summed in the "
            "series without a peer label.",
            peers, named, 0, floor.peers);
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
  std::vector<Ranked> served;
  std::uint64_t nameless = 0;  // names beyond the engine's bound
  for (std::size_t i = 0; i < s.served.size(); ++i) {
    if (s.served[i].first.empty()) {
      nameless += s.served[i].second;
    } else {
      served.push_back({s.served[i].first, s.served[i].second, i});
    }
  }
  t.bounded("rdmakit_peer_served_bytes_total",
            "Bytes peers' reads and writes moved on links they opened to this engine, as each peer reports them (at "
            "most a second behind): the busiest by name, the rest in the series without a peer label.",
            served, rank(served, options.top_peers), nameless, floor.served);

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
