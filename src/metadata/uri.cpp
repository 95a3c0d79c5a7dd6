// SPDX-License-Identifier: Apache-2.0
#include "metadata/uri.hpp"

#include <cerrno>
#include <charconv>

#include <fmt/format.h>

#include "rdmakit/error.hpp"
#include "rdmakit/metadata.hpp"

namespace rdmakit::detail::metadata {
namespace {

[[noreturn]] void bad_uri(const std::string& text, const std::string& why) {
  throw Error("metadata URI", EINVAL, fmt::format("\"{}\": {}", text, why),
              "use p2p, redis://[user:password@]host[:port][/db] or "
              "etcd://host[:port][,host[:port]...]");
}

// "host[:port]" or "[v6]:port", with the store's default port when none is given.
HostPort host_of(const std::string& uri, const std::string& part, std::uint16_t default_port) {
  if (part.empty()) bad_uri(uri, "a host is missing");
  HostPort hp;
  try {
    hp = parse_host_port(part, default_port);
  } catch (const Error& e) {
    bad_uri(uri, e.detail());
  }
  if (hp.host.empty()) bad_uri(uri, fmt::format("\"{}\" has no host", part));
  return hp;
}

}  // namespace

std::string StoreUri::shown() const {
  switch (kind) {
    case Kind::p2p:
      return "p2p";
    case Kind::redis: {
      std::string s = "redis://";
      if (!user.empty() || !password.empty()) s += (user.empty() ? "" : user) + ":***@";
      s += hosts.at(0).to_string();
      if (db != 0) s += fmt::format("/{}", db);
      return s;
    }
    case Kind::etcd: {
      std::string s = "etcd://";
      for (std::size_t i = 0; i < hosts.size(); ++i) s += (i ? "," : "") + hosts[i].to_string();
      return s;
    }
  }
  return "?";
}

StoreUri parse_store_uri(const std::string& text) {
  StoreUri u;
  if (text.empty() || text == "p2p") return u;
  const auto scheme_end = text.find("://");
  if (scheme_end == std::string::npos) bad_uri(text, "no scheme");
  const std::string scheme = text.substr(0, scheme_end);
  std::string rest = text.substr(scheme_end + 3);
  if (scheme == "redis") {
    u.kind = StoreUri::Kind::redis;
    if (auto at = rest.rfind('@'); at != std::string::npos) {
      std::string cred = rest.substr(0, at);
      rest = rest.substr(at + 1);
      auto colon = cred.find(':');
      if (colon == std::string::npos) bad_uri(text, "credentials must be user:password (or :password)");
      u.user = cred.substr(0, colon);
      u.password = cred.substr(colon + 1);
      if (u.password.empty()) bad_uri(text, "the password is empty");
    }
    if (auto slash = rest.find('/'); slash != std::string::npos) {
      std::string db = rest.substr(slash + 1);
      rest = rest.substr(0, slash);
      auto [p, ec] = std::from_chars(db.data(), db.data() + db.size(), u.db);
      if (db.empty() || ec != std::errc{} || p != db.data() + db.size() || u.db < 0) {
        bad_uri(text, fmt::format("database \"{}\" is not a number >= 0", db));
      }
    }
    u.hosts.push_back(host_of(text, rest, 6379));
  } else if (scheme == "etcd") {
    u.kind = StoreUri::Kind::etcd;
    std::size_t start = 0;
    while (start <= rest.size()) {
      auto comma = rest.find(',', start);
      if (comma == std::string::npos) comma = rest.size();
      u.hosts.push_back(host_of(text, rest.substr(start, comma - start), 2379));
      start = comma + 1;
    }
  } else {
    bad_uri(text, fmt::format("unknown scheme \"{}\"", scheme));
  }
  return u;
}

}  // namespace rdmakit::detail::metadata

namespace rdmakit {

std::string MetadataConfig::shown_uri() const {
  try {
    return detail::metadata::parse_store_uri(uri).shown();
  } catch (const Error&) {
    return "(an invalid metadata URI)";
  }
}

}  // namespace rdmakit
