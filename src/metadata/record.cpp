// SPDX-License-Identifier: Apache-2.0
#include "metadata/record.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bootstrap/identity.hpp"
#include "rdmakit/error.hpp"

namespace rdmakit::detail::metadata {
namespace {

using json = nlohmann::json;

// Bounds on what a record may hold, so a corrupt or hostile entry cannot make a reader allocate
// without limit. Segments are many (a serving engine exposes one per layer for K and V, per
// model): up to 16,384, each a compact [name, length, memory] triple (10,000 segments with
// 20-byte names are about 450 KB, within etcd's default 1.5 MiB request).
constexpr std::size_t max_list = 1024;
constexpr std::size_t max_text = 256;

[[noreturn]] void bad(const std::string& where, const std::string& why) {
  throw Error("metadata record", EPROTO, fmt::format("{}: {}", where, why),
              "it was not written by an rdmakit engine of this or the previous format version, or was altered on the way");
}

std::string text(const json& j, const char* field, const std::string& where) {
  auto it = j.find(field);
  if (it == j.end() || !it->is_string()) bad(where, fmt::format("\"{}\" is missing or not a string", field));
  auto s = it->get<std::string>();
  if (s.size() > max_text) bad(where, fmt::format("\"{}\" is longer than {} bytes", field, max_text));
  return s;
}

std::uint64_t number(const json& j, const char* field, const std::string& where) {
  auto it = j.find(field);
  if (it == j.end() || !it->is_number_unsigned()) {
    bad(where, fmt::format("\"{}\" is missing or not a number >= 0", field));
  }
  return it->get<std::uint64_t>();
}

const json& list(const json& j, const char* field, const std::string& where, std::size_t max = max_list) {
  auto it = j.find(field);
  if (it == j.end() || !it->is_array()) bad(where, fmt::format("\"{}\" is missing or not a list", field));
  if (it->size() > max) bad(where, fmt::format("\"{}\" has more than {} entries", field, max));
  return *it;
}

}  // namespace

void check_cluster(const std::string& cluster) {
  const bool ok = !cluster.empty() && cluster.size() <= 64 &&
                  std::all_of(cluster.begin(), cluster.end(), [](char c) {
                    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '.' || c == '_' || c == '-';
                  });
  if (!ok) {
    throw Error("metadata config", EINVAL,
                fmt::format("cluster \"{}\": 1 to 64 letters, digits, '.', '_' or '-'", cluster));
  }
}

std::string engines_prefix(const std::string& cluster) {
  return fmt::format("rdmakit/{}/engines/", cluster);
}

std::string engine_key(const std::string& cluster, const std::string& name) {
  return engines_prefix(cluster) + name;
}

std::string encode(const EngineRecord& r) {
  json j{{"v", record_version}, {"name", r.name}, {"epoch", r.epoch}, {"endpoints", r.endpoints}};
  j["rails"] = json::array();
  for (const RailRecord& x : r.rails) {
    j["rails"].push_back({{"device", x.device}, {"port", x.port}, {"link_layer", x.link_layer},
                          {"gid", x.gid}, {"subnet", x.subnet}});
  }
  if (r.segments.size() > max_segments) {
    throw Error("metadata record", EMSGSIZE, fmt::format("{} segments; a record holds at most {}", r.segments.size(), max_segments));
  }
  j["segments"] = json::array();
  for (const SegmentRecord& s : r.segments) j["segments"].push_back(json::array({s.name, s.length, s.memory}));
  // Its public key as "identity" (a memory key is never in a record; this names the engine). Absent
  // without one; readers of before ignore it either way.
  if (!r.public_key.empty()) j["identity"] = r.public_key;
  // What it offers, best first; absent without a list (readers of before ignore it either way).
  if (!r.transports.empty()) j["transports"] = r.transports;
  return j.dump();
}

EngineRecord decode(std::string_view input, const std::string& where,
                    const std::string& expected_name) {
  json j = json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) bad(where, "not a JSON object");
  const std::uint64_t v = number(j, "v", where);
  if (v != record_version && v != 1) {
    bad(where, fmt::format("format version {}; this rdmakit reads versions 1 and {}", v, record_version));
  }
  EngineRecord r;
  r.name = text(j, "name", where);
  if (r.name != expected_name) {
    bad(where, fmt::format("is engine \"{}\"'s, not \"{}\"'s", r.name, expected_name));
  }
  r.epoch = number(j, "epoch", where);
  if (j.contains("identity")) {
    r.public_key = text(j, "identity", where);
    if (!detail::decode_public_key(r.public_key)) bad(where, "its \"identity\" is not a public key (\"ed25519:\" and 43 characters)");
  }
  // An optional hint (a link chooses in its handshake): what is not a transport's name is
  // dropped rather than the record, so an engine is still found by name whatever a newer
  // version or a careless writer put here. Names this version does not know (a newer engine's)
  // are kept: a reader shows them and a link never offers them. At most 8, each once, each 1..16
  // of [a-z0-9_-] (nothing a terminal would take for a control sequence).
  if (const auto it = j.find("transports"); it != j.end() && it->is_array()) {
    for (const json& t : *it) {
      if (r.transports.size() == 8) break;
      if (!t.is_string()) continue;
      const auto& name = t.get_ref<const std::string&>();
      const bool word = !name.empty() && name.size() <= 16 && std::all_of(name.begin(), name.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
      });
      if (word && std::find(r.transports.begin(), r.transports.end(), name) == r.transports.end()) r.transports.push_back(name);
    }
  }
  for (const json& e : list(j, "endpoints", where)) {
    if (!e.is_string() || e.get<std::string>().size() > max_text) bad(where, "an endpoint is not a short string");
    r.endpoints.push_back(e.get<std::string>());
  }
  for (const json& x : list(j, "rails", where)) {
    if (!x.is_object()) bad(where, "a rail is not an object");
    const std::uint64_t port = number(x, "port", where);
    if (port == 0 || port > 255) bad(where, fmt::format("rail port {} is not 1..255", port));
    r.rails.push_back({text(x, "device", where), static_cast<std::uint32_t>(port),
                       text(x, "link_layer", where), text(x, "gid", where), text(x, "subnet", where)});
  }
  r.segments.reserve(list(j, "segments", where, max_segments).size());
  for (const json& s : j["segments"]) {
    // Version 1 wrote {"name", "length", "memory"} objects: read too, so that a cluster upgraded
    // one engine at a time keeps seeing the engines not upgraded yet.
    if (v == 1 && s.is_object()) {
      r.segments.push_back({text(s, "name", where), number(s, "length", where), text(s, "memory", where)});
      continue;
    }
    if (!s.is_array() || s.size() != 3 || !s[0].is_string() || !s[1].is_number_unsigned() || !s[2].is_string() ||
        s[0].get_ref<const std::string&>().size() > max_text || s[2].get_ref<const std::string&>().size() > max_text) {
      bad(where, "a segment is not [name, length, memory]");
    }
    r.segments.push_back({s[0].get<std::string>(), s[1].get<std::uint64_t>(), s[2].get<std::string>()});
  }
  return r;
}

}  // namespace rdmakit::detail::metadata
