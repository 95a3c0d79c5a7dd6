// SPDX-License-Identifier: Apache-2.0
// How long an engine link takes to come up (Engine::connect: the keyed handshake, the IDENTs, the
// window on the target's segment announced, SYNCED), with the cluster key alone and with
// identities on both sides (each IDENT signed, the other's verified and its key checked), taking
// turns, `n` links each; prints the medians (ms) as one JSON line for bench/keyed-overhead.
//   rdmakit_engine_handshake [N] [ADDRESS]   (ADDRESS: where the targets listen, default 127.0.0.1)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "rdmakit/engine.hpp"

namespace {

using namespace std::chrono_literals;

rdmakit::EngineConfig config(const std::string& name, const std::string& listen, bool identity) {
  rdmakit::EngineConfig c;
  c.name = name;
  c.listen = listen;
  c.link.psk.assign(32, 0x42);
  c.link.log = [](std::string_view) {};
  if (identity) c.identity = rdmakit::Identity::generate();
  return c;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 100;
  const std::string host = argc > 2 ? argv[2] : "127.0.0.1";
  struct Side {
    rdmakit::Engine target, client;
    std::string key;
    std::vector<double> ms;
  };
  Side psk{rdmakit::Engine(config("t-psk", host + ":0", false)), rdmakit::Engine(config("c-psk", "", false)), {}, {}};
  Side ids{rdmakit::Engine(config("t-id", host + ":0", true)), rdmakit::Engine(config("c-id", "", true)), {}, {}};
  ids.key = ids.target.info().public_key;
  for (Side* s : {&psk, &ids}) {
    s->target.expose("kv", s->target.allocate_memory(4096), rdmakit::Access::remote_read | rdmakit::Access::remote_write);
  }
  for (int i = 0; i < n; ++i) {
    for (Side* s : (i % 2 == 0 ? std::vector<Side*>{&psk, &ids} : std::vector<Side*>{&ids, &psk})) {
      const std::string name = s == &psk ? "t-psk" : "t-id";
      s->client.add_peer(name, host + ":" + std::to_string(s->target.port()), s->key);
      std::string why;
      const auto t0 = std::chrono::steady_clock::now();
      if (!s->client.connect(name, 10s, &why)) {
        std::fprintf(stderr, "connect %d to %s: %s\n", i, name.c_str(), why.c_str());
        return 1;
      }
      s->ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      s->client.remove_peer(name);
    }
  }
  std::printf("{\"links\": %d, \"psk_ms\": %.3f, \"identity_ms\": %.3f}\n", n, median(psk.ms), median(ids.ms));
  return 0;
}
