// SPDX-License-Identifier: Apache-2.0
// The store on etcd, through its v3 API's JSON gateway (POST /v3/...), with libcurl: keys and
// values travel base64-encoded, leases are etcd's own. With several endpoints, a call that cannot
// reach one tries the next before its deadline.
#include <curl/curl.h>
#include <sodium.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <memory>
#include <mutex>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "metadata/store.hpp"

namespace rdmakit::detail::metadata {
namespace {

using json = nlohmann::json;

std::string b64(const std::string& s) {
  std::string out(sodium_base64_ENCODED_LEN(s.size(), sodium_base64_VARIANT_ORIGINAL), '\0');
  sodium_bin2base64(out.data(), out.size(), reinterpret_cast<const unsigned char*>(s.data()),
                    s.size(), sodium_base64_VARIANT_ORIGINAL);
  out.resize(out.size() - 1);  // the terminating NUL
  return out;
}

std::optional<std::string> unb64(const std::string& s) {
  std::string out(s.size(), '\0');
  std::size_t len = 0;
  if (sodium_base642bin(reinterpret_cast<unsigned char*>(out.data()), out.size(), s.data(), s.size(),
                        nullptr, &len, nullptr, sodium_base64_VARIANT_ORIGINAL) != 0) {
    return std::nullopt;
  }
  out.resize(len);
  return out;
}

// The first key after every key that starts with `prefix` (etcd's range_end for a prefix).
std::string prefix_end(std::string prefix) {
  while (!prefix.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(prefix.back());
    if (last < 0xff) {
      ++last;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

// etcd's int64 fields arrive as JSON strings (and are left out when 0).
std::int64_t int_field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return 0;
  std::int64_t v = 0;
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (it->is_string()) {
    const std::string& t = it->get_ref<const std::string&>();
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (ec == std::errc() && end == t.data() + t.size()) return v;
  }
  throw Error("etcd answer", EPROTO, fmt::format("field \"{}\" is {}, not an integer", name, it->dump().substr(0, 40)),
              "is this etcd's v3 gateway (etcd 3.4 or later)?");
}

struct CurlFree {
  void operator()(CURL* c) const noexcept { curl_easy_cleanup(c); }
};
struct CurlMultiFree {
  void operator()(CURLM* m) const noexcept { curl_multi_cleanup(m); }
};

std::size_t collect(char* data, std::size_t size, std::size_t n, void* out) {
  auto* s = static_cast<std::string*>(out);
  // Answers of the calls used here are small; one that grows without end is not etcd.
  if (s->size() + size * n > (64u << 20)) return 0;
  s->append(data, size * n);
  return size * n;
}

class EtcdStore final : public Store {
 public:
  explicit EtcdStore(StoreUri uri) : uri_(std::move(uri)) {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  }

  [[nodiscard]] std::string shown() const override { return uri_.shown(); }

  LeaseId grant(std::chrono::milliseconds ttl, Deadline deadline) override {
    const auto secs = std::max<std::int64_t>(1, (ttl.count() + 999) / 1000);
    json r = call("/v3/lease/grant", {{"TTL", secs}}, deadline, "lease grant");
    const LeaseId id = int_field(r, "ID");
    if (id == 0) malformed("lease grant", r);
    return id;
  }

  void refresh(LeaseId lease, Deadline deadline) override {
    json r = call("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}, deadline,
                  "lease keepalive");
    const json& res = r.contains("result") ? r["result"] : r;
    if (int_field(res, "TTL") <= 0) {
      throw LeaseLost("etcd lease keepalive", 0,
                      fmt::format("{}: lease {:x} is gone", shown(), lease),
                      "the cluster lost it (restarted empty, or it expired while unreachable): "
                      "put the entries again under a new lease");
    }
  }

  void revoke(LeaseId lease, Deadline deadline) override {
    call("/v3/lease/revoke", {{"ID", std::to_string(lease)}}, deadline, "lease revoke",
         /*lease_gone_ok=*/true);
  }

  void put(const std::string& key, const std::string& value, LeaseId lease,
           Deadline deadline) override {
    json body{{"key", b64(key)}, {"value", b64(value)}};
    if (lease != no_lease) body["lease"] = std::to_string(lease);
    call("/v3/kv/put", body, deadline, "put");
  }

  std::optional<std::string> get(const std::string& key, Deadline deadline) override {
    json r = call("/v3/kv/range", {{"key", b64(key)}}, deadline, "get");
    auto kvs = r.find("kvs");
    if (kvs == r.end() || kvs->empty()) return std::nullopt;
    return decode((*kvs)[0], "value", "get");
  }

  std::vector<KeyValue> list(const std::string& prefix, Deadline deadline) override {
    json r = call("/v3/kv/range", {{"key", b64(prefix.empty() ? std::string(1, '\0') : prefix)},
                                   {"range_end", b64(prefix_end(prefix))}},
                  deadline, "list");
    std::vector<KeyValue> out;
    auto kvs = r.find("kvs");
    if (kvs == r.end()) return out;
    if (!kvs->is_array()) malformed("list", r);
    for (const json& kv : *kvs) out.push_back({decode(kv, "key", "list"), decode(kv, "value", "list")});
    return out;
  }

  std::optional<std::string> version(const std::string& prefix, Deadline deadline) override {
    // A count-only range answers with the header alone: the store's revision (bumped by every
    // put, delete and lease expiry) and its cluster's id (new when it restarts empty).
    json r = call("/v3/kv/range", {{"key", b64(prefix.empty() ? std::string(1, '\0') : prefix)},
                                   {"range_end", b64(prefix_end(prefix))}, {"count_only", true}},
                  deadline, "version");
    auto h = r.find("header");
    if (h == r.end() || !h->is_object()) malformed("version", r);
    const std::int64_t rev = int_field(*h, "revision");
    if (rev <= 0) malformed("version", r);
    // The cluster id is a uint64 (as a JSON string): kept as text.
    const auto id = h->find("cluster_id");
    return fmt::format("{}:{}", id == h->end() ? "" : id->is_string() ? id->get<std::string>() : id->dump(), rev);
  }

  void remove(const std::string& key, Deadline deadline) override {
    call("/v3/kv/deleterange", {{"key", b64(key)}}, deadline, "remove");
  }

 private:
  [[noreturn]] void malformed(const char* op, const json& j) {
    throw Error(fmt::format("etcd {}", op), EPROTO,
                fmt::format("{} answered {}", shown(), j.dump().substr(0, 200)),
                "is this etcd's v3 gateway (etcd 3.4 or later)?");
  }

  std::string decode(const json& kv, const char* field, const char* op) {
    auto it = kv.find(field);
    if (it == kv.end()) return {};  // etcd omits empty values
    if (!it->is_string()) malformed(op, kv);
    auto s = unb64(it->get<std::string>());
    if (!s) malformed(op, kv);
    return *s;
  }

  // POSTs `body` to each endpoint in turn (starting with the last that answered) until one
  // answers; returns its JSON. An etcd error (a JSON body with "error"/"message") is an Error of
  // its own; "lease not found" is LeaseLost.
  json call(const char* path, const json& body, Deadline deadline, const char* op,
            bool lease_gone_ok = false) {
    const std::string payload = body.dump();
    std::string last_failure;
    int last_errno = 0;
    for (std::size_t tried = 0; tried < uri_.hosts.size(); ++tried) {
      const std::size_t e = (current_ + tried) % uri_.hosts.size();
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) break;
      std::string answer;
      long status = 0;
      CURLcode rc = post(uri_.hosts[e], path, payload, left, answer, status);
      if (rc != CURLE_OK) {
        last_failure = fmt::format("{}: {}", uri_.hosts[e].to_string(), curl_easy_strerror(rc));
        last_errno = rc == CURLE_OPERATION_TIMEDOUT ? ETIMEDOUT
                     : rc == CURLE_COULDNT_CONNECT  ? ECONNREFUSED
                                                    : EIO;
        continue;
      }
      current_ = e;
      json j = json::parse(answer, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.is_object()) {
        throw Error(fmt::format("etcd {}", op), EPROTO,
                    fmt::format("{} (HTTP {}) answered something that is not JSON: \"{}\"",
                                uri_.hosts[e].to_string(), status, answer.substr(0, 120)),
                    "is this etcd's client port (2379 by default)?");
      }
      if (status != 200 || j.contains("error")) {
        const std::string msg = j.value("message", j.value("error", std::string("?")));
        if (msg.find("lease not found") != std::string::npos) {
          if (lease_gone_ok) return j;
          throw LeaseLost(fmt::format("etcd {}", op), 0, fmt::format("{}: {}", shown(), msg),
                          "put the entries again under a new lease");
        }
        throw Error(fmt::format("etcd {}", op), 0,
                    fmt::format("{} (HTTP {}): {}", shown(), status, msg));
      }
      return j;
    }
    if (last_failure.empty()) last_failure = "no time left";
    throw Error(fmt::format("etcd {}", op), last_errno == 0 ? ETIMEDOUT : last_errno,
                fmt::format("{}: no endpoint answered before the deadline (last: {})", shown(),
                            last_failure),
                "is etcd running there and reachable? (its client URL: --listen-client-urls)");
  }

  CURLcode post(const HostPort& to, const char* path, const std::string& payload,
                std::chrono::milliseconds left, std::string& answer, long& status) {
    if (!curl_) {
      curl_.reset(curl_easy_init());
      if (!curl_) throw Error("curl_easy_init", ENOMEM, shown());
    }
    CURL* c = curl_.get();
    curl_easy_reset(c);
    const std::string url = url_of(to, path);
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, payload.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(payload.size()));
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(left.count()));
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(left.count()));
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM from name resolution in threads
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &answer);
    curl_easy_setopt(c, CURLOPT_PROXY, "");  // a store is never reached through a proxy
    CURLcode rc = curl_easy_perform(c);
    if (rc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    return rc;
  }

  static std::string url_of(const HostPort& to, const char* path) {
    const bool v6 = to.host.find(':') != std::string::npos;
    return fmt::format("http://{}{}{}:{}{}", v6 ? "[" : "", to.host, v6 ? "]" : "", to.port, path);
  }

  // The watch: one streaming POST to /v3/watch on the endpoint that last answered, driven by a
  // curl multi handle from watch_events() (never blocking), its answer a JSON object per line.
  struct WatchStream {
    std::unique_ptr<CURLM, CurlMultiFree> multi;
    std::unique_ptr<CURL, CurlFree> easy;
    std::string body;     // the create request (curl reads it from here)
    std::string pending;  // received, not yet a whole line
    std::string where;    // the endpoint, for messages
    bool created = false;
    ~WatchStream() {
      if (multi && easy) curl_multi_remove_handle(multi.get(), easy.get());
    }
  };

 public:
  bool watch(const std::string& prefix, const std::string& version, Deadline deadline) override {
    watch_.reset();
    const auto colon = version.find(':');
    std::int64_t rev = 0;
    if (colon == std::string::npos ||
        std::from_chars(version.data() + colon + 1, version.data() + version.size(), rev).ec != std::errc()) {
      throw Error("etcd watch", EINVAL, fmt::format("{}: version \"{}\" is not one of this store's", shown(), version));
    }
    auto w = std::make_unique<WatchStream>();
    w->multi.reset(curl_multi_init());
    w->easy.reset(curl_easy_init());
    if (!w->multi || !w->easy) throw Error("curl_multi_init", ENOMEM, shown());
    const HostPort& to = uri_.hosts[current_];
    w->where = to.to_string();
    w->body = json{{"create_request",
                    {{"key", b64(prefix.empty() ? std::string(1, '\0') : prefix)},
                     {"range_end", b64(prefix_end(prefix))},
                     {"start_revision", std::to_string(rev + 1)},
                     {"progress_notify", true}}}}
                  .dump();
    const std::string url = url_of(to, "/v3/watch");
    CURL* c = w->easy.get();
    const auto left = std::max<std::int64_t>(1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, w->body.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(w->body.size()));
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(left));
    // A store that vanishes without closing the connection (its host died) is found out by TCP
    // keepalives within ~10 s; one that closes it, at once.
    curl_easy_setopt(c, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(c, CURLOPT_TCP_KEEPIDLE, 5L);
    curl_easy_setopt(c, CURLOPT_TCP_KEEPINTVL, 2L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_PROXY, "");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &w->pending);
    if (curl_multi_add_handle(w->multi.get(), c) != CURLM_OK) throw Error("curl_multi_add_handle", ENOMEM, shown());
    watch_ = std::move(w);
    return true;
  }

  std::vector<WatchEvent> watch_events() override {
    if (!watch_) throw Error("etcd watch", EINVAL, fmt::format("{}: no watch was started", shown()));
    WatchStream& w = *watch_;
    int running = 0;
    curl_multi_perform(w.multi.get(), &running);
    std::string ended;
    int left = 0;
    while (CURLMsg* m = curl_multi_info_read(w.multi.get(), &left)) {
      if (m->msg == CURLMSG_DONE) {
        ended = m->data.result == CURLE_OK ? "the store closed the watch" : curl_easy_strerror(m->data.result);
      }
    }
    std::vector<WatchEvent> out;
    const std::string where = w.where;
    try {
      for (std::size_t nl; (nl = w.pending.find('\n')) != std::string::npos;) {
        const std::string line = w.pending.substr(0, nl);
        w.pending.erase(0, nl + 1);
        if (line.find_first_not_of(" \r") == std::string::npos) continue;
        read_watch_message(w, line, out);
      }
    } catch (...) {
      watch_.reset();  // a watch that said something wrong is over: the caller lists again
      throw;
    }
    if (!ended.empty()) {
      watch_.reset();
      throw Error("etcd watch", EPIPE, fmt::format("{}: the watch on {} ended: {}", shown(), where, ended),
                  "list again and watch from there");
    }
    return out;
  }

 private:
  void read_watch_message(WatchStream& w, const std::string& line, std::vector<WatchEvent>& out) {
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      throw Error("etcd watch", EPROTO, fmt::format("{} sent a line that is not JSON: \"{}\"", shown(), line.substr(0, 120)));
    }
    if (j.contains("error")) {
      const json& e = j["error"];
      const std::string msg = e.is_object() ? e.value("message", e.dump()) : e.dump();
      throw Error("etcd watch", EPROTO, fmt::format("{}: {}", shown(), msg.substr(0, 200)));
    }
    auto r = j.find("result");
    if (r == j.end() || !r->is_object()) malformed("watch", j);
    if (r->value("canceled", false)) {
      const std::string why = r->value("cancel_reason", std::string("canceled"));
      throw Error("etcd watch", ESTALE,
                  fmt::format("{}: the watch was canceled ({}; compacted at revision {})", shown(), why,
                              int_field(*r, "compact_revision")),
                  "list again and watch from there");
    }
    if (r->value("created", false)) w.created = true;
    auto events = r->find("events");
    if (events == r->end()) return;  // created, or a progress notification
    if (!events->is_array()) malformed("watch", j);
    for (const json& ev : *events) {
      auto kv = ev.find("kv");
      if (kv == ev.end() || !kv->is_object()) malformed("watch", j);
      WatchEvent e;
      e.key = decode(*kv, "key", "watch");
      if (ev.value("type", std::string("PUT")) != "DELETE") e.value = decode(*kv, "value", "watch");
      out.push_back(std::move(e));
    }
  }

  StoreUri uri_;
  std::unique_ptr<CURL, CurlFree> curl_;
  std::size_t current_ = 0;
  std::unique_ptr<WatchStream> watch_;  // after curl_: its handles go first
};

}  // namespace

std::unique_ptr<Store> open_etcd(const StoreUri& uri) { return std::make_unique<EtcdStore>(uri); }

}  // namespace rdmakit::detail::metadata
