// SPDX-License-Identifier: Apache-2.0
// TraceEvent formatting and the environment's default tracer (RDMAKIT_TRACE).
#include "trace.hpp"

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace rdmakit {

std::string TraceEvent::text() const {
  std::string s = event;
  for (const auto& [k, v] : fields) {
    const bool quote = v.empty() || v.find_first_of(" \t\"=") != std::string::npos;
    s += fmt::format(" {}={}", k, quote ? nlohmann::json(v).dump() : v);
  }
  return s;
}

std::string TraceEvent::json() const {
  // ordered_json keeps the fields in the order the event lists them.
  nlohmann::ordered_json j;
  j["event"] = event;
  for (const auto& [k, v] : fields) j[k] = v;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::function<void(const TraceEvent&)> trace_to_stderr(bool json) {
  if (json) return [](const TraceEvent& e) { fmt::print(stderr, "{}\n", e.json()); };
  return [](const TraceEvent& e) { fmt::print(stderr, "rdmakit trace: {}\n", e.text()); };
}

namespace detail {

std::function<void(const TraceEvent&)> trace_from_environment() {
  const char* v = std::getenv("RDMAKIT_TRACE");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0) return {};
  return trace_to_stderr(std::strcmp(v, "json") == 0);
}

}  // namespace detail
}  // namespace rdmakit
