// SPDX-License-Identifier: Apache-2.0
// rdmakit stats: scrapes an engine's /metrics endpoint (rdmakit serve --metrics, engine-bench
// --metrics, a MetricsServer) twice an interval apart and shows what moved per second: in all,
// per path (NIC or transport), per peer (this engine's transfers, and what peers moved on links
// they opened here) and per rail, with its health. --json prints one such view as an object.
#include "stats.hpp"

#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "options.hpp"

namespace rdmakit::tools {

namespace {

struct StatsOptions {
  std::string endpoint;
  double interval = 1.0;
  unsigned count = 0;
  bool json = false;
};

// A label value up to its closing quote, unescaped; `i` ends past the quote.
std::string label_value(const std::string& line, std::size_t& i) {
  std::string v;
  for (; i < line.size(); ++i) {
    const char c = line[i];
    if (c == '"') {
      ++i;
      return v;
    }
    if (c == '\\' && i + 1 < line.size()) {
      const char n = line[++i];
      v += n == 'n' ? '\n' : n;
    } else {
      v += c;
    }
  }
  throw Fail(fmt::format("a label value without its closing quote: {}", line.substr(0, 200)));
}

struct Scrape {
  std::vector<MetricSample> samples;
  std::string health;  // /health's body
  int health_status = 0;
  std::chrono::steady_clock::time_point at;
};

Scrape scrape(httplib::Client& c, const std::string& shown) {
  Scrape s;
  s.at = std::chrono::steady_clock::now();
  auto r = c.Get("/metrics");
  if (!r) throw Fail(fmt::format("cannot scrape http://{}/metrics: {}", shown, httplib::to_string(r.error())));
  if (r->status != 200) throw Fail(fmt::format("http://{}/metrics answered {}", shown, r->status));
  s.samples = parse_exposition(r->body);
  if (auto h = c.Get("/health")) {
    s.health_status = h->status;
    s.health = h->body;
  }
  return s;
}

// Sum of a family's samples whose labels include `match`, grouped by the labels in `by`.
std::map<std::vector<std::string>, double> group(const Scrape& s, const std::string& name, const std::vector<std::string>& by) {
  std::map<std::vector<std::string>, double> out;
  for (const auto& m : s.samples) {
    if (m.name != name) continue;
    std::vector<std::string> key;
    for (const auto& b : by) {
      const auto it = m.labels.find(b);
      key.push_back(it == m.labels.end() ? std::string{} : it->second);
    }
    out[key] += m.value;
  }
  return out;
}

double total(const Scrape& s, const std::string& name) {
  double v = 0;
  for (const auto& m : s.samples) v += m.name == name ? m.value : 0;
  return v;
}

// Per second between two scrapes, per group (a counter that went down, a restart: its new
// value). A series the first scrape did not have (a peer that just joined the named ones) has
// no rate yet: left out, as Prometheus would.
std::map<std::vector<std::string>, double> rates(const Scrape& a, const Scrape& b, const std::string& name,
                                                 const std::vector<std::string>& by, double dt) {
  const auto before = group(a, name, by);
  std::map<std::vector<std::string>, double> out;
  for (const auto& [k, v] : group(b, name, by)) {
    const auto was = before.find(k);
    if (was == before.end()) continue;
    out[k] = (v >= was->second ? v - was->second : v) / dt;
  }
  return out;
}

std::string rate_text(double bytes_per_s) {
  if (bytes_per_s >= 1e9) return fmt::format("{:.2f} GB/s", bytes_per_s / 1e9);
  if (bytes_per_s >= 1e6) return fmt::format("{:.1f} MB/s", bytes_per_s / 1e6);
  if (bytes_per_s >= 1e3) return fmt::format("{:.1f} kB/s", bytes_per_s / 1e3);
  return fmt::format("{:.0f} B/s", bytes_per_s);
}

nlohmann::json view_json(const Scrape& a, const Scrape& b, double dt) {
  nlohmann::json j;
  std::string engine;
  for (const auto& m : b.samples) {
    if (m.name == "rdmakit_build_info") engine = m.labels.count("engine") != 0 ? m.labels.at("engine") : "";
  }
  j["engine"] = engine;
  j["interval_s"] = dt;
  std::string health = b.health;
  while (!health.empty() && (health.back() == '\n' || health.back() == '\r')) health.pop_back();
  j["health"] = b.health_status == 200 ? "ok" : fmt::format("{} {}", b.health_status, health);
  auto one = [&](const char* name) {
    const double was = total(a, name), now = total(b, name);
    return (now >= was ? now - was : now) / dt;
  };
  j["bytes_per_s"] = one("rdmakit_bytes_total");
  j["transfers_per_s"] = one("rdmakit_transfers_total");
  j["failed_per_s"] = one("rdmakit_transfers_failed_total");
  j["batches_per_s"] = one("rdmakit_batches_total");
  j["links"] = total(b, "rdmakit_links");
  j["peers_linked"] = total(b, "rdmakit_peers_linked");
  j["rail_failures"] = total(b, "rdmakit_rail_failures_total");
  j["reposted"] = total(b, "rdmakit_reposted_total");
  j["paths"] = nlohmann::json::array();
  const auto path_t = rates(a, b, "rdmakit_path_transfers_total", {"path", "transport"}, dt);
  for (const auto& [k, v] : rates(a, b, "rdmakit_path_bytes_total", {"path", "transport"}, dt)) {
    j["paths"].push_back({{"path", k[0]}, {"transport", k[1]}, {"bytes_per_s", v},
                          {"transfers_per_s", path_t.count(k) != 0 ? path_t.at(k) : 0.0}});
  }
  auto peers = [&](const char* family) {
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& [k, v] : rates(a, b, family, {"peer"}, dt)) arr.push_back({{"peer", k[0].empty() ? "(others)" : k[0]}, {"bytes_per_s", v}});
    std::sort(arr.begin(), arr.end(), [](const auto& x, const auto& y) {
      return x["bytes_per_s"].template get<double>() > y["bytes_per_s"].template get<double>();
    });
    return arr;
  };
  j["peers"] = peers("rdmakit_peer_bytes_total");
  j["served"] = peers("rdmakit_peer_served_bytes_total");
  j["rails"] = nlohmann::json::array();
  const auto up = group(b, "rdmakit_peer_rail_up", {"peer", "rail"});
  const auto failures = group(b, "rdmakit_peer_rail_failures_total", {"peer", "rail"});
  for (const auto& [k, v] : rates(a, b, "rdmakit_peer_rail_bytes_total", {"peer", "rail"}, dt)) {
    j["rails"].push_back({{"peer", k[0]}, {"rail", k[1]}, {"bytes_per_s", v},
                          {"up", up.count(k) != 0 && up.at(k) == 1}, {"failures", failures.count(k) != 0 ? failures.at(k) : 0.0}});
  }
  return j;
}

void print_view(const nlohmann::json& j, const std::string& endpoint) {
  fmt::print("rdmakit stats {}: engine {}, health {} (over {:.1f} s)\n", endpoint, j["engine"].get<std::string>(),
             j["health"].get<std::string>(), j["interval_s"].get<double>());
  fmt::print("  {}  {:.0f} transfers/s  {:.0f} failed/s  {:.0f} batches/s  links {}  peers linked {}  rail failures {}  re-posted {}\n",
             rate_text(j["bytes_per_s"]), j["transfers_per_s"].get<double>(), j["failed_per_s"].get<double>(),
             j["batches_per_s"].get<double>(), j["links"].get<double>(), j["peers_linked"].get<double>(),
             j["rail_failures"].get<double>(), j["reposted"].get<double>());
  fmt::print("  {:<24} {:<10} {:>14} {:>14}\n", "path", "transport", "rate", "transfers/s");
  for (const auto& p : j["paths"]) {
    fmt::print("  {:<24} {:<10} {:>14} {:>14.0f}\n", p["path"].get<std::string>(), p["transport"].get<std::string>(),
               rate_text(p["bytes_per_s"]), p["transfers_per_s"].get<double>());
  }
  for (const char* what : {"peers", "served"}) {
    if (j[what].empty()) continue;
    fmt::print("  {:<40} {:>14}\n", std::string(what) == "peers" ? "peer (this engine's transfers)" : "peer (theirs, on links to here)", "rate");
    for (const auto& p : j[what]) fmt::print("  {:<40} {:>14}\n", p["peer"].get<std::string>(), rate_text(p["bytes_per_s"]));
  }
  if (!j["rails"].empty()) {
    fmt::print("  {:<24} {:<16} {:>14} {:>5} {:>9}\n", "peer", "rail", "rate", "up", "failures");
    for (const auto& r : j["rails"]) {
      fmt::print("  {:<24} {:<16} {:>14} {:>5} {:>9.0f}\n", r["peer"].get<std::string>(), r["rail"].get<std::string>(),
                 rate_text(r["bytes_per_s"]), r["up"].get<bool>() ? "yes" : "no", r["failures"].get<double>());
    }
  }
}

int run_stats(const StatsOptions& o) {
  const auto colon = o.endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0) throw Fail(fmt::format("{}: give HOST:PORT of an engine's --metrics endpoint", o.endpoint));
  std::string host = o.endpoint.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  unsigned port = 0;
  const char* p = o.endpoint.c_str() + colon + 1;
  const char* end = o.endpoint.c_str() + o.endpoint.size();
  const auto [stop, ec] = std::from_chars(p, end, port);
  if (ec != std::errc{} || stop != end || port == 0 || port > 65535 || host.empty() || host.find(']') != std::string::npos) {
    throw Fail(fmt::format("{}: give HOST:PORT ([V6]:PORT), the port 1..65535", o.endpoint));
  }
  if (!(o.interval >= 0.1 && o.interval <= 3600)) throw Fail("--interval: 0.1 .. 3600 seconds");
  httplib::Client c(host, static_cast<int>(port));
  c.set_connection_timeout(5, 0);
  c.set_read_timeout(5, 0);
  const auto wait = std::chrono::duration<double>(o.interval);
  Scrape a = scrape(c, o.endpoint);
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  for (unsigned n = 0; o.count == 0 || n < o.count; ++n) {
    std::this_thread::sleep_for(wait);
    Scrape b = scrape(c, o.endpoint);
    const double dt = std::chrono::duration<double>(b.at - a.at).count();
    const nlohmann::json j = view_json(a, b, dt);
    if (o.json) {
      fmt::print("{}\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
      return 0;
    }
    if (tty) fmt::print("\x1b[H\x1b[2J");
    print_view(j, o.endpoint);
    std::fflush(stdout);
    a = std::move(b);
  }
  return 0;
}

}  // namespace

std::vector<MetricSample> parse_exposition(const std::string& text) {
  std::vector<MetricSample> out;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty() || line[0] == '#') continue;
    MetricSample m;
    std::size_t i = line.find_first_of("{ ");
    if (i == std::string::npos || i == 0) throw Fail(fmt::format("not a sample: {}", line.substr(0, 200)));
    m.name = line.substr(0, i);
    if (line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const auto eq = line.find("=\"", i);
        if (eq == std::string::npos) throw Fail(fmt::format("a label without =\"...\": {}", line.substr(0, 200)));
        std::string key = line.substr(i, eq - i);
        while (!key.empty() && key.front() == ' ') key.erase(0, 1);
        i = eq + 2;
        m.labels[std::move(key)] = label_value(line, i);
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) throw Fail(fmt::format("labels without their closing brace: {}", line.substr(0, 200)));
      ++i;
    }
    while (i < line.size() && line[i] == ' ') ++i;
    const std::string value = line.substr(i, line.find(' ', i) - i);
    char* stop = nullptr;
    m.value = std::strtod(value.c_str(), &stop);
    if (value.empty() || stop == value.c_str()) throw Fail(fmt::format("no value: {}", line.substr(0, 200)));
    out.push_back(std::move(m));
  }
  return out;
}

void add_stats(CLI::App& app, std::function<int()>& run) {
  auto o = std::make_shared<StatsOptions>();
  auto* sub = app.add_subcommand("stats", "a live view of an engine's /metrics endpoint (serve --metrics): rates per path, peer and rail");
  sub->add_option("endpoint", o->endpoint, "HOST:PORT of the endpoint")->required();
  sub->add_option("--interval", o->interval, "seconds between refreshes (the rates' window)")->capture_default_str();
  sub->add_option("--count", o->count, "stop after this many refreshes (0: until interrupted)")->capture_default_str();
  sub->add_flag("--json", o->json, "one view (two scrapes --interval apart) as a JSON object, then exit");
  sub->callback([o, &run] { run = guarded("stats", [o] { return run_stats(*o); }); });
}

}  // namespace rdmakit::tools
