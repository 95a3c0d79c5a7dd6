// SPDX-License-Identifier: Apache-2.0
// rdmakit bench: the data patterns that validation checks, the control messages, a phase on the
// wire.
#include "bench/bench.hpp"

namespace rdmakit::tools::bench {

using namespace std::chrono_literals;

// The byte pattern of iteration `iter` (validation): cheap, and different for every iteration
// and position.
std::uint8_t pattern(std::uint64_t iter, std::size_t pos) {
  return static_cast<std::uint8_t>((iter * 131 + pos * 7 + 1) & 0xff);
}
void fill(std::uint8_t* p, std::size_t n, std::uint64_t iter) {
  for (std::size_t i = 0; i < n; ++i) p[i] = pattern(iter, i);
}
bool check(const std::uint8_t* p, std::size_t n, std::uint64_t iter) {
  for (std::size_t i = 0; i < n; ++i) {
    if (p[i] != pattern(iter, i)) return false;
  }
  return true;
}

// Where the CPU fills and checks a region's contents: the memory itself when the CPU can reach
// it (on the bounce path the staging copies carry it to and from the registered buffer), else
// the registered bytes.
std::uint8_t* cpu_view(const MemoryRegion& m) {
  return static_cast<std::uint8_t*>(m.home() != nullptr ? m.home() : m.data());
}
// Fills [off, off + n) with iteration `iter`'s pattern and stages it for the NIC.
void fill_region(const MemoryRegion& m, std::size_t off, std::size_t n, std::uint64_t iter) {
  fill(cpu_view(m) + off, n, iter);
  m.stage_in(off, n);
}
// Brings [off, off + n) back from the NIC and checks it holds iteration `iter`'s pattern.
bool check_region(const MemoryRegion& m, std::size_t off, std::size_t n, std::uint64_t iter) {
  m.stage_out(off, n);
  return check(cpu_view(m) + off, n, iter);
}

// --- control messages ------------------------------------------------------------------------

void send_json(Connection& c, const json& j) {
  const std::string s = j.dump();
  c.send_message({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()}, 10s);
}

json recv_json(Connection& c, std::chrono::milliseconds timeout, const char* what) {
  auto m = c.receive_message(timeout);
  if (!m) throw Fail(fmt::format("no {} from the peer within {} ms (peer gone?)", what, timeout.count()));
  json j = json::parse(m->begin(), m->end(), nullptr, false);
  if (j.is_discarded()) throw Fail(fmt::format("malformed {} from the peer", what));
  if (j.contains("error")) throw Fail(fmt::format("the peer reports: {}", j["error"].get<std::string>()));
  return j;
}

json to_json(const Phase& p) {
  return {{"op", p.op},           {"mode", p.mode},   {"size", p.size},
          {"iters", p.iters},     {"tx_depth", p.tx_depth}, {"post_list", p.post_list},
          {"slots", p.slots},     {"validate", p.validate}, {"duration", p.duration},
          {"bidir", p.bidir},     {"half", p.half}};
}
Phase phase_from(const json& j) {
  Phase p;
  p.op = j.at("op");
  p.mode = j.at("mode");
  p.size = j.at("size");
  p.iters = j.at("iters");
  p.tx_depth = j.at("tx_depth");
  p.post_list = j.at("post_list");
  p.slots = j.at("slots");
  p.validate = j.at("validate");
  p.duration = j.value("duration", 0.0);
  p.bidir = j.value("bidir", false);
  p.half = j.value("half", std::size_t{0});
  return p;
}

}  // namespace rdmakit::tools::bench
