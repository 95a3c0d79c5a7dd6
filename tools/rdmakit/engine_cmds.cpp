// SPDX-License-Identifier: Apache-2.0
// rdmakit serve and rdmakit engine-bench: thin fronts over rdmakit::Engine. `serve` is a target
// that exposes named segments; `engine-bench` drives batches at one or more targets from several
// threads, shaped like Mooncake's transfer_engine_bench, and reports GB/s, transfers/s, batch
// latency percentiles and CPU use.
#include "engine_cmds.hpp"

#include <CLI/CLI.hpp>

#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "metadata_options.hpp"
#include "options.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/metrics.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::tools {

namespace {

using Clock = std::chrono::steady_clock;

// Options both share: how links are made.
struct EngineNet {
  std::string name;
  std::vector<std::string> devices;
  FabricOptions fabric;
  unsigned timeout_ms = 10'000;
  std::string psk_file;
  std::string method = "tcp";
  unsigned workers = 0;  // 0: the engine's default, one per device
  std::vector<int> worker_cpus;
  unsigned max_qps = 1024;
  unsigned rails = 0;  // 0: every port that reaches the peer
  std::vector<std::string> rail_devices;
  std::uint64_t slice_size = RailConfig{}.slice_size;
  std::uint64_t slice_threshold = RailConfig{}.slice_threshold;
  MetadataOptions metadata;
  bool allow_region_keys = false;
  std::string identity_file;
  std::vector<std::string> transports;
  unsigned tcp_streams = EngineConfig{}.tcp_streams;
  std::string shm_copy = "auto";
  bool shm_map = true;
  unsigned wait_spin_us = static_cast<unsigned>(EngineConfig{}.wait_spin.count());

  void add_to(CLI::App& app, bool publishing) {
    metadata.add_to(app, publishing);
    app.add_option("--name", name, "this engine's name (default: host:pid)");
    app.add_option("-d,--device", devices,
                   "an RDMA device the engine uses: registers its memory on, makes its queues on, links "
                   "through; repeatable or comma-separated (default: every device; each link takes the device of "
                   "the route to its peer among them)")
        ->delimiter(',');
    fabric.add_to(app);
    app.add_option("--timeout", timeout_ms, "handshake deadline in ms")->capture_default_str();
    app.add_option("--psk-file", psk_file, "pre-shared key file (both ends the same)");
    app.add_option("--identity", identity_file,
                   "this engine's identity file (rdmakit keygen --identity FILE): every link proves it; needs --psk-file");
    if (publishing) {
      app.add_flag("--allow-region-keys", allow_region_keys,
                   "on a device without type-2 memory windows, serve segments with the buffer's own key "
                   "(access per buffer, no per-peer revocation; needs --psk-file)");
    }
    app.add_option("--cm", method, "how links connect: tcp or rdma_cm (then ports are rdma_cm ports); every engine the same")
        ->check(CLI::IsMember({"tcp", "rdma_cm", "cm"}))
        ->capture_default_str();
    app.add_option("--transport", transports,
                   "a transport links may use, best first; repeatable: rdma (default), tcp (any peer, no RDMA needed), "
                   "shm (a peer on this host). A link takes the first this engine lists that the peer lists too")
        ->check(CLI::IsMember({"rdma", "tcp", "shm"}));
    app.add_option("--tcp-streams", tcp_streams, "tcp: data streams per link")->check(CLI::Range(1u, 16u))->capture_default_str();
    app.add_option("--shm-copy", shm_copy,
                   "shm: how the links this engine opens copy: attach (cross-memory attach, one copy), ring (shared "
                   "memory, two copies, no permission to read another process needed), auto (attach where the kernel "
                   "allows it)")
        ->check(CLI::IsMember({"auto", "attach", "ring"}))
        ->capture_default_str();
    app.add_flag("--shm-map,!--no-shm-map", shm_map,
                 "shm: peers map the memory this engine allocates and copy it in one pass (--no-shm-map: every copy "
                 "goes as --shm-copy says)")
        ->capture_default_str();
    app.add_option("--workers", workers, "progress threads (default: one per RDMA device)")->check(CLI::Range(1u, 64u));
    app.add_option("--worker-cpus", worker_cpus,
                   "the CPUs the workers run on, e.g. 2,3 (worker i on the i-th, round robin; default: anywhere)")
        ->delimiter(',')
        ->check(CLI::Range(0, CPU_SETSIZE - 1));
    app.add_option("--wait-spin", wait_spin_us,
                   "microseconds a wait for a batch polls on its own thread before it sleeps (adapts to what waits "
                   "take, within this); 0: it sleeps at once")
        ->check(CLI::Range(0u, 1000000u))
        ->capture_default_str();
    app.add_option("--max-qps", max_qps, "QP budget")->check(CLI::Range(1u, 1u << 20))->capture_default_str();
    app.add_option("--rails", rails, "most rails (NIC ports) per peer link; 0: every port that reaches the peer")
        ->check(CLI::Range(0u, 16u))->capture_default_str();
    app.add_option("--rail-device", rail_devices, "a device rails may use (and this engine offers); repeatable "
                                                   "(default: all)");
    app.add_option("--slice-size", slice_size, "bytes per slice of a transfer spread over rails (K, M suffixes)")
        ->transform(CLI::AsSizeValue(false))->check(CLI::Range(4096ull, 1ull << 30))->capture_default_str();
    app.add_option("--slice-threshold", slice_threshold, "transfers of at least this many bytes are sliced; 0: never")
        ->transform(CLI::AsSizeValue(false))->capture_default_str();
  }
  EngineConfig config(std::string listen) const {
    EngineConfig c;
    c.name = name;
    c.listen = std::move(listen);
    c.link.method = parse_connect_method(method);
    c.devices = devices;
    fabric.apply(c.link);
    c.link.handshake_timeout = std::chrono::milliseconds{timeout_ms};
    c.link.retry_refused = true;  // a target started at the same moment may not listen yet
    if (!psk_file.empty()) c.link.psk = read_key_file(psk_file);
    if (!identity_file.empty()) c.identity = Identity::from_file(identity_file);
    if (workers != 0) c.workers = workers;
    c.worker_cpus = worker_cpus;
    c.wait_spin = std::chrono::microseconds{wait_spin_us};
    c.max_qps = max_qps;
    c.rails.max = rails;
    c.rails.devices = rail_devices;
    c.rails.slice_size = slice_size;
    c.rails.slice_threshold = slice_threshold;
    c.metadata = metadata.config();
    c.allow_region_keys = allow_region_keys;
    for (const std::string& t : transports) c.transports.push_back(parse_transport(t));
    c.tcp_streams = tcp_streams;
    c.shm_copy = parse_shm_copy(shm_copy);
    c.shm_map = shm_map;
    return c;
  }
};

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

nlohmann::json counters_json(const EngineCounters& c) {
  return {{"qps", c.qps},
          {"links", c.links},
          {"connects", c.connects},
          {"reconnects", c.reconnects},
          {"accepts", c.accepts},
          {"evictions", c.evictions},
          {"restarts", c.restarts},
          {"batches", c.batches},
          {"transfers", c.transfers},
          {"transfers_failed", c.transfers_failed},
          {"bytes", c.bytes},
          {"notifications_sent", c.notifications_sent},
          {"notifications_received", c.notifications_received},
          {"notifications_refused", c.notifications_refused},
          {"notifications_dropped", c.notifications_dropped},
          {"notifications_lost", c.notifications_lost},
          {"windows_bound", c.windows_bound},
          {"window_bind_ns", c.window_bind_ns},
          {"rail_links", c.rail_links},
          {"rail_failures", c.rail_failures},
          {"slices", c.slices},
          {"reposted", c.reposted},
          {"plan_posted", c.plan_posted},
          {"plan_builds", c.plan_builds},
          {"lists_posted", c.lists_posted},
          {"lists_builds", c.lists_builds},
          {"shm_mapped_bytes", c.shm_mapped_bytes},
          {"submits_inline", c.submits_inline},
          {"waits_spun", c.waits_spun}};
}

// Each peer's link: its transport, and why that one.
nlohmann::json links_json(const std::vector<PeerInfo>& peers) {
  nlohmann::json out = nlohmann::json::array();
  for (const PeerInfo& p : peers) {
    out.push_back({{"peer", p.name}, {"linked", p.linked}, {"device", p.device}, {"transport", p.transport},
                   {"reason", p.transport_reason}, {"wire_version", p.wire_version}});
  }
  return out;
}

// Each peer's rails: the port pairs, their state and what each carried.
nlohmann::json rails_json(const std::vector<PeerInfo>& peers) {
  nlohmann::json out = nlohmann::json::array();
  for (const PeerInfo& p : peers) {
    for (const RailInfo& r : p.rails) {
      out.push_back({{"peer", p.name}, {"local", r.local}, {"remote", r.peer}, {"state", r.state}, {"reason", r.reason},
                     {"bytes", r.bytes}, {"slices", r.slices}, {"failures", r.failures}, {"reposted", r.reposted}});
    }
  }
  return out;
}

void print_rails(const std::vector<PeerInfo>& peers, std::uint64_t total) {
  for (const PeerInfo& p : peers) {
    if (p.transport.empty()) continue;
    // Only the previous version is worth a word: a link to an engine not upgraded yet.
    const std::string old = p.wire_version != 0 && p.wire_version != wire::kVersion
                                ? fmt::format("; wire version {}, the peer's (the previous rdmakit)", p.wire_version)
                                : std::string{};
    fmt::print("  link to {}: {} ({}{})\n", p.name, p.transport, p.transport_reason, old);
  }
  for (const PeerInfo& p : peers) {
    for (const RailInfo& r : p.rails) {
      if (r.state == "unused") {
        fmt::print("  rail {} of {}: unused: {}\n", r.local, p.name, r.reason);
        continue;
      }
      fmt::print("  rail {} -> {} of {}: {}, {} bytes ({:.1f}%), {} slices, {} failures{}\n", r.local, r.peer, p.name,
                 r.state, r.bytes, total == 0 ? 0.0 : 100.0 * static_cast<double>(r.bytes) / static_cast<double>(total),
                 r.slices, r.failures, r.reason.empty() ? "" : " (" + r.reason + ")");
    }
  }
}

// --- serve ---------------------------------------------------------------------------------------

struct ServeOptions {
  EngineNet net;
  std::string listen = "12026";
  std::vector<std::string> expose;
  double duration = 0;
  bool json = false;
  bool notifications = false;
  std::vector<std::string> allow;
  bool commands = false;
  std::string metrics;  // [ADDR:]PORT of the /metrics and /health endpoint (empty: none)
  std::size_t metrics_peers = 64;
};

struct Exposed {
  std::string name;
  std::uint64_t size = 0;
  MemorySpec spec;
};

// NAME:SIZE[:KIND], SIZE with K/M/G suffixes (binary).
Exposed parse_expose(const std::string& text) {
  const auto c1 = text.find(':');
  if (c1 == std::string::npos || c1 == 0) throw Fail(fmt::format("--expose {}: NAME:SIZE[:KIND]", text));
  const auto c2 = text.find(':', c1 + 1);
  Exposed e;
  e.name = text.substr(0, c1);
  std::string size = text.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
  std::uint64_t mult = 1;
  if (!size.empty()) {
    switch (size.back()) {
      case 'K': case 'k': mult = 1ull << 10; break;
      case 'M': case 'm': mult = 1ull << 20; break;
      case 'G': case 'g': mult = 1ull << 30; break;
      default: break;
    }
    if (mult != 1) size.pop_back();
  }
  try {
    std::size_t used = 0;
    e.size = std::stoull(size, &used) * mult;
    if (used != size.size() || e.size == 0) throw std::invalid_argument("size");
  } catch (const std::exception&) {
    throw Fail(fmt::format("--expose {}: the size '{}' is not a positive number (K, M, G allowed)", text, size));
  }
  if (c2 != std::string::npos) {
    const auto kind = parse_memory_kind(text.substr(c2 + 1));
    if (!kind) throw Fail(fmt::format("--expose {}: memory kind host, hugepage, cuda or cuda-host", text));
    e.spec.kind = *kind;
  }
  return e;
}

// --commands: one command per line on standard input ("revoke PEER", "allow PEER"), each
// answered on standard output. False once the input is closed.
bool serve_commands(Engine& engine, std::string& pending, bool as_json) {
  char buf[4096];
  const ssize_t n = ::read(0, buf, sizeof buf);
  if (n <= 0) return n < 0 && errno == EINTR;
  pending.append(buf, static_cast<std::size_t>(n));
  for (auto nl = pending.find('\n'); nl != std::string::npos; nl = pending.find('\n')) {
    const std::string line = pending.substr(0, nl);
    pending.erase(0, nl + 1);
    const auto sp = line.find(' ');
    const std::string verb = line.substr(0, sp), peer = sp == std::string::npos ? std::string{} : line.substr(sp + 1);
    std::string error;
    try {
      if (verb == "revoke") {
        engine.revoke(peer);
      } else if (verb == "allow") {
        engine.allow(peer);
      } else if (!line.empty()) {
        error = fmt::format("unknown command '{}' (revoke PEER, allow PEER)", line.substr(0, 100));
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (line.empty()) continue;
    if (as_json) {
      // Replace what is not UTF-8 (standard input says anything): dump() would throw.
      fmt::print("{}\n", nlohmann::json{{"event", "command"}, {"command", verb}, {"peer", peer}, {"ok", error.empty()},
                                        {"error", error}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    } else {
      fmt::print("{}\n", error.empty() ? fmt::format("{} {}: done", verb, peer) : fmt::format("{}: {}", line, error));
    }
    std::fflush(stdout);
  }
  if (pending.size() > 65536) pending.clear();  // no line that long is a command
  return true;
}

int run_serve(const ServeOptions& o) {
  std::vector<Exposed> segs;
  for (const auto& t : o.expose) segs.push_back(parse_expose(t));
  // "PORT" alone is a port on every address (127.0.0.1 without a key); "HOST" alone, the host on
  // serve's default port.
  std::string listen = o.listen;
  if (listen.find(':') == std::string::npos) {
    const bool port = !listen.empty() && std::all_of(listen.begin(), listen.end(), [](char c) { return c >= '0' && c <= '9'; });
    listen = port ? ":" + listen : listen + ":" + ServeOptions{}.listen;
  }
  EngineConfig cfg = o.net.config(listen);
  cfg.listen_at_start = false;  // every segment is offered from the first link on
  cfg.allowed_peers = o.allow;
  Engine engine(cfg);
  // Up before the listener: /health says 503 until every segment is offered.
  std::optional<rdmakit::MetricsServer> metrics;
  if (!o.metrics.empty()) metrics.emplace(engine, o.metrics, rdmakit::MetricsOptions{o.metrics_peers});
  for (const Exposed& s : segs) {
    check_memory(s.spec, s.size);
    const Buffer b = engine.allocate_memory(s.size, s.spec);
    engine.expose(s.name, b, Access::remote_read | Access::remote_write | Access::remote_atomic);
  }
  engine.start_listening();
  const EngineInfo info = engine.info();
  if (o.json) {
    nlohmann::json segj = nlohmann::json::array();
    for (const Exposed& s : segs) segj.push_back({{"name", s.name}, {"size", s.size}, {"kind", to_string(s.spec.kind)}});
    fmt::print("{}\n", nlohmann::json{{"event", "serving"}, {"name", info.name}, {"epoch", fmt::format("{:#x}", info.epoch)},
                                      {"port", info.port}, {"listen", info.listen}, {"listen_note", info.listen_note},
                                      {"segments", segj}, {"memory_windows", info.memory_windows},
                                      {"access_model", info.access_model}, {"metadata", info.metadata},
                                      {"rails", info.rails}, {"public_key", info.public_key},
                                      {"transports", info.transports}, {"transports_note", info.transports_note},
                                      {"metrics", metrics ? metrics->address() : std::string{}}}.dump());
  } else {
    fmt::print("rdmakit serve: engine {} (epoch {:#x}) listening on port {}\n", info.name, info.epoch, info.port);
    if (!info.listen_note.empty()) fmt::print("  listener: {}\n", info.listen_note);
    for (const Exposed& s : segs) fmt::print("  segment {}: {} bytes of {} memory\n", s.name, s.size, to_string(s.spec.kind));
    fmt::print("  transports: {}{}\n", fmt::join(info.transports, ", "),
               info.transports_note.empty() ? "" : " (" + info.transports_note + ")");
    fmt::print("  access: {}\n", info.access_model);
    fmt::print("  identity: {}\n", info.public_key.empty() ? std::string("none (peers know this engine by its name and the "
                                                                        "cluster key alone)")
                                                           : info.public_key);
    for (const std::string& r : info.rails) fmt::print("  rail: {}\n", r);
    fmt::print("  metadata: {}\n", info.metadata);
    if (metrics) fmt::print("  metrics: http://{}/metrics and /health\n", metrics->address());
  }
  std::fflush(stdout);
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  const auto until = o.duration > 0 ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration))
                                    : Clock::time_point::max();
  std::string pending;  // --commands: what standard input said after its last full line
  bool stdin_open = o.commands;
  while (g_stop == 0 && Clock::now() < until) {
    pollfd pfd[2] = {{engine.fd(), POLLIN, 0}, {stdin_open ? 0 : -1, POLLIN, 0}};
    if (::poll(pfd, 2, 200) > 0) {
      if ((pfd[0].revents & POLLIN) != 0) {
        std::uint64_t v = 0;
        (void)!::read(engine.fd(), &v, sizeof v);
      }
      if ((pfd[1].revents & (POLLIN | POLLHUP)) != 0) stdin_open = serve_commands(engine, pending, o.json);
    }
    while (auto n = engine.next_notification()) {
      if (!o.notifications) continue;
      const std::string text(n->message.begin(), n->message.end());
      if (o.json) {
        fmt::print("{}\n", nlohmann::json{{"event", "notification"}, {"peer", n->peer}, {"bytes", n->message.size()}}.dump());
      } else {
        fmt::print("notification from {}: {} bytes\n", n->peer, n->message.size());
      }
      std::fflush(stdout);
    }
  }
  const auto c = engine.counters();
  if (o.json) {
    fmt::print("{}\n", nlohmann::json{{"event", "stopped"}, {"counters", counters_json(c)}}.dump());
  } else {
    fmt::print("rdmakit serve: stopped; {} links accepted, {} windows bound, {} notifications received\n", c.accepts,
               c.windows_bound, c.notifications_received);
  }
  return 0;
}

// --- engine-bench --------------------------------------------------------------------------------

struct BenchOpts {
  EngineNet net;
  std::vector<std::string> peers;
  std::vector<std::string> peer_keys;  // NAME=KEY
  std::string segment = "kv";
  std::string op = "write";
  std::uint64_t block = 65536;
  unsigned batch = 128;
  unsigned threads = 1;
  double duration = 5;
  bool validate = false;
  bool json = false;
  bool idle = false;
  bool own_memory = false;
  std::string metrics;  // [ADDR:]PORT of the /metrics and /health endpoint (empty: none)
};

struct PeerArg {
  std::string name, address;
};

// NAME=HOST:PORT, or (with a metadata store) NAME alone: found in the store. NAME is the name
// the target runs under (serve --name): the engine links only to the engine it names.
PeerArg parse_peer(const std::string& text, bool store) {
  const auto eq = text.find('=');
  if (eq != std::string::npos) return {text.substr(0, eq), text.substr(eq + 1)};
  if (store && text.find(':') == std::string::npos) return {text, {}};
  throw Fail(fmt::format("--peer {}: give the target's name too, NAME={} (the name rdmakit serve --name gave it, "
                         "which it prints): a link is made only to the engine of that name",
                         text, text));
}

// The byte at `offset` of peer `p`'s segment, as the benchmark writes it.
std::uint8_t pattern(std::size_t p, std::uint64_t offset) {
  return static_cast<std::uint8_t>((offset * 131) ^ (offset >> 11) ^ (p * 29 + 7));
}

double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

int run_engine_bench(const BenchOpts& o) {
  if (o.peers.empty()) throw Fail("give at least one --peer NAME=HOST:PORT (or NAME, with --metadata)");
  Engine engine(o.net.config(""));
  std::optional<rdmakit::MetricsServer> metrics;
  if (!o.metrics.empty()) metrics.emplace(engine, o.metrics);
  std::vector<PeerArg> peers;
  std::vector<RemoteSegment> segs;
  for (std::size_t i = 0; i < o.peers.size(); ++i) {
    peers.push_back(parse_peer(o.peers[i], o.net.metadata.store()));
    std::string key;
    for (const std::string& k : o.peer_keys) {
      const auto eq = k.find('=');
      if (eq == std::string::npos) throw Fail(fmt::format("--peer-key {}: give NAME=KEY", k));
      if (k.substr(0, eq) == peers.back().name) key = k.substr(eq + 1);
    }
    if (peers.back().address.empty()) {
      if (!key.empty()) throw Fail(fmt::format("--peer-key {}: a peer found in the store proves the key it publishes there", peers.back().name));
      engine.add_peer(peers.back().name);  // found in the store
    } else {
      engine.add_peer(peers.back().name, peers.back().address, key);
    }
    segs.push_back(engine.segment(peers.back().name, o.segment));
  }
  // Lazy connect, timed: from nothing to a link whose segments are known, per peer.
  std::vector<double> connect_ms;
  for (const PeerArg& p : peers) {
    std::string why;
    const auto c0 = Clock::now();
    if (!engine.connect(p.name, std::chrono::milliseconds{o.net.timeout_ms}, &why)) throw Fail(why);
    connect_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - c0).count());
  }
  const double connect_avg = std::accumulate(connect_ms.begin(), connect_ms.end(), 0.0) / static_cast<double>(connect_ms.size());
  if (o.idle) {
    // Linked to every peer, nothing to do: what the engine's threads cost while it waits.
    const double c0 = cpu_seconds();
    const auto i0 = Clock::now();
    while (g_stop == 0 && Clock::now() - i0 < std::chrono::duration<double>(o.duration)) {
      std::this_thread::sleep_for(std::chrono::milliseconds{50});
    }
    const double secs = std::chrono::duration<double>(Clock::now() - i0).count();
    const double cores = (cpu_seconds() - c0) / secs;
    const EngineCounters n = engine.counters();
    if (o.json) {
      fmt::print("{}\n", nlohmann::json{{"idle", true}, {"peers", peers.size()}, {"seconds", secs}, {"cpu_cores", cores},
                                        {"links", n.links}, {"connect_ms", connect_avg}}.dump());
    } else {
      fmt::print("engine-bench idle: {} peer(s) linked ({} links), {:.2f} s: {:.3f}% of a core\n", peers.size(), n.links,
                 secs, cores * 100);
    }
    return 0;
  }
  const TransferOp op = o.op == "read" ? TransferOp::read : TransferOp::write;
  const std::uint64_t span = o.block * o.batch;  // one thread's remote range
  // The local buffers: one batch's worth per thread, the engine's own or this program's.
  struct Owned {
    Engine& e;
    std::vector<Buffer> bufs;
    std::vector<std::unique_ptr<std::uint8_t[]>> memory;
    ~Owned() {
      for (const Buffer& b : bufs) {
        try {
          e.unregister_memory(b);
        } catch (const std::exception&) {
          // (its transfers ended above; the engine goes next anyway)
        }
      }
    }
  } owned{engine, {}, {}};
  std::vector<Buffer> bufs;
  for (unsigned t = 0; t < o.threads; ++t) {
    if (o.own_memory) {
      owned.memory.emplace_back(new std::uint8_t[span]());
      owned.bufs.push_back(engine.register_memory(owned.memory.back().get(), span));
      bufs.push_back(owned.bufs.back());
    } else {
      bufs.push_back(engine.allocate_memory(span));
    }
  }
  auto fill_for = [&](const Buffer& b, std::size_t p, std::uint64_t remote_base) {
    auto* bytes = static_cast<std::uint8_t*>(b.addr);
    for (std::uint64_t i = 0; i < span; ++i) bytes[i] = pattern(p, remote_base + i);
  };
  auto batch_for = [&](unsigned t, std::size_t p, TransferOp what) {
    std::vector<Transfer> v(o.batch);
    for (unsigned k = 0; k < o.batch; ++k) {
      v[k].op = what;
      v[k].local = bufs[t];
      v[k].local_offset = k * o.block;
      v[k].length = o.block;
      v[k].remote = segs[p];
      v[k].remote_offset = t * span + k * o.block;
    }
    return v;
  };
  auto must = [](Batch& b, const char* what) {
    if (!b.wait(std::chrono::seconds{30})) throw Fail(fmt::format("{}: a batch did not end within 30 s", what));
    if (b.failed() != 0) throw Fail(fmt::format("{}: {}", what, b.describe_failures()));
  };
  // Reads are validated against what this run wrote there first.
  if (o.validate && op == TransferOp::read) {
    for (std::size_t p = 0; p < peers.size(); ++p) {
      for (unsigned t = 0; t < o.threads; ++t) {
        fill_for(bufs[t], p, t * span);
        Batch b = engine.submit(batch_for(t, p, TransferOp::write));
        must(b, "writing the pattern to validate reads against");
      }
    }
  }
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> bytes{0}, transfers{0}, mismatches{0};
  std::vector<std::vector<double>> lat(o.threads);
  std::vector<std::string> errors(o.threads);
  const double cpu0 = cpu_seconds();
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < o.threads; ++t) {
    threads.emplace_back([&, t] {
      try {
        std::vector<std::vector<Transfer>> batches;
        for (std::size_t p = 0; p < peers.size(); ++p) batches.push_back(batch_for(t, p, op));
        for (std::size_t round = 0; !stop.load(std::memory_order_relaxed); ++round) {
          const std::size_t p = (t + round) % peers.size();
          if (o.validate && op == TransferOp::write) fill_for(bufs[t], p, t * span);
          const auto s = Clock::now();
          Batch b = engine.submit(batches[p]);
          must(b, "benchmark batch");
          lat[t].push_back(std::chrono::duration<double, std::micro>(Clock::now() - s).count());
          bytes.fetch_add(span, std::memory_order_relaxed);
          transfers.fetch_add(o.batch, std::memory_order_relaxed);
          if (o.validate && op == TransferOp::read) {
            const auto* got = static_cast<const std::uint8_t*>(bufs[t].addr);
            for (std::uint64_t i = 0; i < span; ++i) {
              if (got[i] != pattern(p, t * span + i)) {
                mismatches.fetch_add(1);
                break;
              }
            }
          }
        }
      } catch (const std::exception& e) {
        errors[t] = e.what();
        stop.store(true);
      }
    });
  }
  while (!stop.load() && Clock::now() - t0 < std::chrono::duration<double>(o.duration)) {
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  stop.store(true);
  for (auto& th : threads) th.join();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu = cpu_seconds() - cpu0;
  for (const auto& e : errors) {
    if (!e.empty()) throw Fail(e);
  }
  // Writes are validated by reading every peer's range back.
  if (o.validate && op == TransferOp::write) {
    for (std::size_t p = 0; p < peers.size(); ++p) {
      for (unsigned t = 0; t < o.threads; ++t) {
        std::memset(bufs[t].addr, 0, span);
        Batch b = engine.submit(batch_for(t, p, TransferOp::read));
        must(b, "reading back to validate");
        const auto* got = static_cast<const std::uint8_t*>(bufs[t].addr);
        for (std::uint64_t i = 0; i < span; ++i) {
          if (got[i] != pattern(p, t * span + i)) {
            mismatches.fetch_add(1);
            break;
          }
        }
      }
    }
  }
  std::vector<double> all;
  for (const auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  auto pct = [&](double q) { return all.empty() ? 0.0 : all[std::min(all.size() - 1, static_cast<std::size_t>(q * static_cast<double>(all.size())))]; };
  const double gbps = static_cast<double>(bytes.load()) / secs / 1e9;
  const double tps = static_cast<double>(transfers.load()) / secs;
  if (o.json) {
    nlohmann::json j{{"op", o.op},
                     {"block_size", o.block},
                     {"batch_size", o.batch},
                     {"threads", o.threads},
                     {"peers", peers.size()},
                     {"seconds", secs},
                     {"bytes", bytes.load()},
                     {"transfers", transfers.load()},
                     {"gbytes_per_s", gbps},
                     {"transfers_per_s", tps},
                     {"batch_p50_us", pct(0.5)},
                     {"batch_p99_us", pct(0.99)},
                     {"cpu_cores", cpu / secs},
                     {"connect_ms", connect_avg},
                     {"validated", o.validate},
                     {"mismatches", mismatches.load()},
                     {"counters", counters_json(engine.counters())},
                     {"rails", rails_json(engine.peers())},
                     {"links", links_json(engine.peers())}};
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("engine-bench {} block {} B, batch {}, {} thread(s), {} peer(s), {:.2f} s\n", o.op, o.block, o.batch,
               o.threads, peers.size(), secs);
    fmt::print("  {:.3f} GB/s  {:.0f} transfers/s  batch latency p50 {:.1f} us  p99 {:.1f} us  CPU {:.2f} cores\n", gbps,
               tps, pct(0.5), pct(0.99), cpu / secs);
    fmt::print("  connecting took {:.1f} ms per peer (handshake, the peer's windows bound and announced)\n", connect_avg);
    if (o.validate) fmt::print("  validated: {}\n", mismatches.load() == 0 ? "every byte" : "MISMATCHES");
    print_rails(engine.peers(), engine.counters().bytes);
    for (const DeviceRank& r : engine.locality(bufs.front())) {
      fmt::print("  locality of the buffers: {} rank {}: {}\n", r.device, r.rank, r.why);
    }
  }
  if (mismatches.load() != 0) throw Fail(fmt::format("{} blocks had wrong bytes", mismatches.load()));
  return 0;
}

}  // namespace

void add_serve(CLI::App& app, std::function<int()>& run) {
  auto o = std::make_shared<ServeOptions>();
  auto* sub = app.add_subcommand("serve", "run an engine that exposes named segments to peers (a target)");
  o->net.add_to(*sub, /*publishing=*/true);
  sub->add_option("--listen", o->listen,
                  "[ADDR:]PORT (or ADDR alone) to accept links on; without ADDR every address, or 127.0.0.1 only "
                  "without --psk-file (give 0.0.0.0:PORT to serve other hosts without a key; with --cm rdma_cm, "
                  "which has no loopback, a keyless serve needs ADDR)")
      ->capture_default_str();
  sub->add_option("--expose", o->expose, "NAME:SIZE[:KIND] (K, M, G; host, hugepage, cuda, cuda-host); repeatable")
      ->required();
  sub->add_option("--duration", o->duration, "stop after this many seconds (default: at SIGINT/SIGTERM)");
  sub->add_flag("--notifications", o->notifications, "print each notification received");
  sub->add_option("--allow", o->allow,
                  "a peer that may link (a name, a public key, or NAME=KEY); repeatable; default: any holder of "
                  "the --psk-file key");
  sub->add_flag("--commands", o->commands,
                "read commands from standard input, one per line: \"revoke PEER\" (its windows invalidated, its "
                "links closed, its next ones refused) and \"allow PEER\"");
  sub->add_option("--metrics", o->metrics,
                  "[ADDR:]PORT: serve /metrics (Prometheus) and /health over HTTP there (plain HTTP: bind it where "
                  "only the scrapers reach)");
  sub->add_option("--metrics-peers", o->metrics_peers, "peers /metrics names, the busiest by bytes (the rest summed)")
      ->capture_default_str();
  sub->add_flag("--json", o->json, "JSON lines");
  sub->callback([o, &run] { run = guarded("serve", [o] { return run_serve(*o); }); });
}

void add_engine_bench(CLI::App& app, std::function<int()>& run) {
  auto o = std::make_shared<BenchOpts>();
  auto* sub = app.add_subcommand("engine-bench", "drive batched transfers at serve targets, like transfer_engine_bench");
  o->net.add_to(*sub, /*publishing=*/false);
  sub->add_option("--peer", o->peers,
                  "NAME=HOST:PORT of a target (rdmakit serve --name NAME), or its NAME with --metadata; repeatable")
      ->required();
  sub->add_option("--peer-key", o->peer_keys,
                  "NAME=KEY: the public key target NAME must prove (what its rdmakit serve --identity prints); "
                  "without, the key its first link proves is pinned; repeatable");
  sub->add_option("--segment", o->segment, "the targets' segment")->capture_default_str();
  sub->add_option("--op", o->op, "read or write")->check(CLI::IsMember({"read", "write"}))->capture_default_str();
  sub->add_option("--block-size", o->block, "bytes per transfer (K, M suffixes)")
      ->transform(CLI::AsSizeValue(false))
      ->check(CLI::Range(1ull, 1ull << 30))->capture_default_str();
  sub->add_option("--batch-size", o->batch, "transfers per batch")->check(CLI::Range(1u, 65536u))->capture_default_str();
  sub->add_option("--threads", o->threads, "submitting threads")->check(CLI::Range(1u, 256u))->capture_default_str();
  sub->add_option("--duration", o->duration, "seconds")->check(CLI::Range(0.01, 3600.0))->capture_default_str();
  sub->add_flag("--validate", o->validate, "check every byte (reads: against a pattern written first)");
  sub->add_flag("--own-memory", o->own_memory,
                "move this program's own memory, registered (register_memory), not the engine's (allocate_memory): "
                "over shm, the peer then copies by cross-memory attach or the ring rather than through its mapping");
  sub->add_flag("--idle", o->idle,
                "connect to every peer, then move nothing for --duration seconds: the CPU an engine with its links up "
                "uses while idle");
  sub->add_flag("--json", o->json, "one JSON object");
  sub->add_option("--metrics", o->metrics, "[ADDR:]PORT: serve /metrics and /health over HTTP there while it runs");
  sub->callback([o, &run] { run = guarded("engine-bench", [o] { return run_engine_bench(*o); }); });
}

}  // namespace rdmakit::tools
