// SPDX-License-Identifier: Apache-2.0
// An engine's figures for Prometheus (Engine::metrics, MetricsServer): what a batch moved shows
// under its peer and path, failures under their status, the text passes promtool, and the HTTP
// endpoint serves it and /health. Runs in the lab over rxe, and on the host over tcp and shm.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>

#include "engine_helpers.hpp"
#include "lab_helpers.hpp"
#include "../shared/promtool.hpp"
#include "rdmakit/engine.hpp"
#include "rdmakit/error.hpp"
#include "rdmakit/metrics.hpp"

namespace {

std::string promtool(const std::string& text) {
  return rdmakit::testing_support::promtool("check metrics", text, "metrics.txt");
}

using namespace std::chrono_literals;
using rdmakit::Buffer;
using rdmakit::Engine;
using rdmakit::Transfer;
using rdmakit::TransferOp;

using lab::at;
using lab::config;
using lab::Target;
using lab::xfer;

// The value of the sample `series` (name and labels as written, e.g. `x_total{engine="a"}`);
// -1 if the text has none.
double value_of(const std::string& text, const std::string& series) {
  const auto at_line = text.find("\n" + series + " ");
  if (at_line == std::string::npos) return -1;
  return std::stod(text.substr(at_line + 1 + series.size() + 1));
}

}  // namespace

TEST(Metrics, WhatMovedShowsUnderItsPeerAndPathAndPassesPromtool) {
  Target b("b", 1 << 20);
  Engine a(config("a"));
  a.add_peer("b", at(b.engine));
  const auto seg = a.segment("b", "kv");
  const Buffer src = a.allocate_memory(1 << 20);
  std::vector<Transfer> t;
  for (std::uint64_t k = 0; k < 8; ++k) t.push_back(xfer(TransferOp::write, src, k * 65536, 65536, seg, k * 65536));
  t.push_back(xfer(TransferOp::read, src, 0, 4096, seg, 0));
  t.push_back(xfer(TransferOp::write, src, 0, 64, a.segment("b", "missing"), 0));  // no_segment
  auto x = a.submit(t);
  ASSERT_TRUE(lab::waited(x, 10s));
  const std::uint64_t moved = 8 * 65536 + 4096;
  // The per-peer and per-path figures are added as the worker's walk of that poll ends, just
  // after the batch's end (the engine-wide bytes before it): a scrape may be one poll behind.
  std::string m = a.metrics();
  for (auto until = std::chrono::steady_clock::now() + 2s;
       value_of(m, "rdmakit_peer_bytes_total{engine=\"a\",peer=\"b\"}") != moved && std::chrono::steady_clock::now() < until;
       m = a.metrics()) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(promtool(m), "") << m;
  EXPECT_EQ(value_of(m, "rdmakit_bytes_total{engine=\"a\"}"), moved);
  EXPECT_EQ(value_of(m, "rdmakit_peer_bytes_total{engine=\"a\",peer=\"b\"}"), moved) << m;
  EXPECT_EQ(value_of(m, "rdmakit_transfers_total{engine=\"a\"}"), 10);
  EXPECT_EQ(value_of(m, "rdmakit_transfers_failed_total{engine=\"a\",status=\"no_segment\"}"), 1);
  EXPECT_EQ(value_of(m, "rdmakit_batches_total{engine=\"a\"}"), 1);
  // What the batch asked for, by operation and size (the failed one too).
  EXPECT_EQ(value_of(m, "rdmakit_submitted_transfers_total{engine=\"a\",op=\"write\"}"), 9);
  EXPECT_EQ(value_of(m, "rdmakit_submitted_transfers_total{engine=\"a\",op=\"read\"}"), 1);
  EXPECT_EQ(value_of(m, "rdmakit_submitted_bytes_total{engine=\"a\",op=\"write\"}"), 8 * 65536 + 64);
  EXPECT_EQ(value_of(m, "rdmakit_submitted_bytes_total{engine=\"a\",op=\"read\"}"), 4096);
  EXPECT_EQ(value_of(m, "rdmakit_transfer_size_bytes_bucket{engine=\"a\",le=\"32\"}"), 0);
  EXPECT_EQ(value_of(m, "rdmakit_transfer_size_bytes_bucket{engine=\"a\",le=\"64\"}"), 1);
  EXPECT_EQ(value_of(m, "rdmakit_transfer_size_bytes_bucket{engine=\"a\",le=\"4096\"}"), 2);
  EXPECT_EQ(value_of(m, "rdmakit_transfer_size_bytes_bucket{engine=\"a\",le=\"32768\"}"), 2);
  EXPECT_EQ(value_of(m, "rdmakit_transfer_size_bytes_bucket{engine=\"a\",le=\"65536\"}"), 10);
  EXPECT_EQ(value_of(m, "rdmakit_transfer_size_bytes_count{engine=\"a\"}"), 10);
  // A plan's batches count as theirs: two reads of 4 KiB, submitted twice.
  const auto plan = a.prepare(std::vector{xfer(TransferOp::read, src, 0, 4096, seg, 0), xfer(TransferOp::read, src, 4096, 4096, seg, 4096)});
  for (int k = 0; k < 2; ++k) ASSERT_TRUE(a.submit(plan).wait(10s));
  const std::string mp = a.metrics();
  EXPECT_EQ(value_of(mp, "rdmakit_submitted_transfers_total{engine=\"a\",op=\"read\"}"), 5);
  EXPECT_EQ(value_of(mp, "rdmakit_transfer_size_bytes_bucket{engine=\"a\",le=\"4096\"}"), 6);
  EXPECT_EQ(value_of(m, "rdmakit_batch_duration_seconds_count{engine=\"a\"}"), 1);
  EXPECT_EQ(value_of(m, "rdmakit_peer_linked{engine=\"a\",peer=\"b\"}"), 1);
  EXPECT_EQ(value_of(m, "rdmakit_registered_bytes{engine=\"a\",kind=\"host\"}"), 1 << 20);
  // The path: the link's device over rdma, else the transport.
  const auto t0 = lab::test_transports();
  const std::string transport = t0.empty() ? "rdma" : std::string(rdmakit::to_string(t0[0]));
  const std::string path = transport == "rdma" ? a.peers().at(0).device : transport;
  const std::string labels = "{engine=\"a\",path=\"" + path + "\",transport=\"" + transport + "\"}";
  EXPECT_EQ(value_of(m, "rdmakit_path_bytes_total" + labels), moved) << m;
  EXPECT_EQ(value_of(m, "rdmakit_path_transfers_total" + labels), 9) << m;
  // The target: an accepted link, a listener, and what a told it moved (its ACTIVE reports, at
  // most a second apart while bytes move).
  // (The batch's and the plan's two batches': everything a moved with b.)
  const std::uint64_t all = moved + 2 * 2 * 4096;
  std::string mb = b.engine.metrics();
  const std::string served = "rdmakit_peer_served_bytes_total{engine=\"b\",peer=\"a\"}";
  for (auto until = std::chrono::steady_clock::now() + 5s;
       value_of(mb, served) != all && std::chrono::steady_clock::now() < until; mb = b.engine.metrics()) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(value_of(mb, served), all) << mb;
  EXPECT_EQ(promtool(mb), "") << mb;
  EXPECT_EQ(value_of(mb, "rdmakit_accepts_total{engine=\"b\"}"), 1);
  EXPECT_EQ(value_of(mb, "rdmakit_listening{engine=\"b\"}"), 1);
  EXPECT_TRUE(b.engine.health().ok) << b.engine.health().reason;
}

// The endpoint: /metrics is metrics(), /health answers 200 and says so in JSON; an engine
// without its listener up answers 503 with why. Unknown paths are 404.
TEST(Metrics, TheServerServesMetricsAndHealth) {
  Target b("b", 1 << 16);
  rdmakit::MetricsServer server(b.engine, "127.0.0.1:0");
  ASSERT_NE(server.port(), 0);
  EXPECT_EQ(server.address(), "127.0.0.1:" + std::to_string(server.port()));
  httplib::Client c("127.0.0.1", server.port());
  c.set_connection_timeout(5, 0);
  c.set_read_timeout(5, 0);
  auto r = c.Get("/metrics");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("version=0.0.4"), std::string::npos);
  EXPECT_EQ(value_of(r->body, "rdmakit_listening{engine=\"b\"}"), 1);
  EXPECT_EQ(promtool(r->body), "");
  r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("\"status\":\"ok\""), std::string::npos) << r->body;
  const auto none = c.Get("/nothing");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 404);

  auto cfg = config("late");
  cfg.listen_at_start = false;
  Engine late(cfg);
  rdmakit::MetricsServer s2(late, ":0");
  httplib::Client c2("127.0.0.1", s2.port());
  r = c2.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_NE(r->body.find("not listening yet"), std::string::npos) << r->body;
  late.start_listening();
  const auto up = c2.Get("/health");
  ASSERT_TRUE(up);
  EXPECT_EQ(up->status, 200);
  // A port taken: refused saying so.
  try {
    rdmakit::MetricsServer taken(b.engine, "127.0.0.1:" + std::to_string(server.port()));
    ADD_FAILURE() << "a second server on one port";
  } catch (const rdmakit::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on 127.0.0.1"), std::string::npos) << e.what();
  }
}

// The per-peer series stay bounded with 1,000 peers: three targets moved different amounts, 997
// more are added and never linked. With top_peers 2 the two busiest are named, the third's
// bytes are the rest, and the text has three per-peer byte series whatever the peer count.
TEST(Metrics, AThousandPeersGiveBoundedSeries) {
  Target t0("t0", 1 << 20), t1("t1", 1 << 20), t2("t2", 1 << 20);
  Engine a(config("a"));
  const Buffer src = a.allocate_memory(1 << 20);
  std::uint64_t k = 1;
  for (Target* t : {&t0, &t1, &t2}) {
    a.add_peer(t->engine.info().name, at(t->engine));
    const auto seg = a.segment(t->engine.info().name, "kv");
    auto b = a.submit(std::vector{xfer(TransferOp::write, src, 0, 4096 * k, seg, 0)});
    ASSERT_TRUE(lab::waited(b, 10s));
    ASSERT_EQ(b.result(0).status, rdmakit::TransferStatus::ok) << b.result(0).reason;
    k *= 2;
  }
  for (int i = 0; i < 997; ++i) a.add_peer("idle-" + std::to_string(i), "127.0.0.1:9");  // never linked
  ASSERT_EQ(a.peers().size(), 1000u);
  rdmakit::MetricsOptions o;
  o.top_peers = 2;
  std::string m = a.metrics(o);
  for (auto until = std::chrono::steady_clock::now() + 2s;
       value_of(m, "rdmakit_peer_bytes_total{engine=\"a\"}") != 4096 && std::chrono::steady_clock::now() < until;
       m = a.metrics(o)) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(value_of(m, "rdmakit_peer_bytes_total{engine=\"a\",peer=\"t2\"}"), 4 * 4096) << m.substr(0, 4000);
  EXPECT_EQ(value_of(m, "rdmakit_peer_bytes_total{engine=\"a\",peer=\"t1\"}"), 2 * 4096);
  EXPECT_EQ(value_of(m, "rdmakit_peer_bytes_total{engine=\"a\"}"), 4096);  // t0 and the 997 idle ones
  std::size_t series = 0, linked = 0;
  for (std::size_t at_ = m.find("\nrdmakit_peer_bytes_total{"); at_ != std::string::npos;
       at_ = m.find("\nrdmakit_peer_bytes_total{", at_ + 1)) {
    ++series;
  }
  for (std::size_t at_ = m.find("\nrdmakit_peer_linked{"); at_ != std::string::npos; at_ = m.find("\nrdmakit_peer_linked{", at_ + 1)) {
    ++linked;
  }
  EXPECT_EQ(series, 3u);
  EXPECT_EQ(linked, 2u);
  EXPECT_EQ(value_of(m, "rdmakit_peers{engine=\"a\"}"), 1000);
  EXPECT_EQ(value_of(m, "rdmakit_peers_linked{engine=\"a\"}"), 3);
  EXPECT_EQ(promtool(m), "");
  // The default bound names all three linked ones and 61 idle ones (by name, at 0 bytes).
  const std::string all = a.metrics();
  EXPECT_EQ(value_of(all, "rdmakit_peer_bytes_total{engine=\"a\",peer=\"t0\"}"), 4096);
}
