// SPDX-License-Identifier: Apache-2.0
// The store on Redis, through hiredis' blocking API with a socket timeout set from each call's
// deadline. Redis has no leases: a lease is the set of keys put under it, each with an expiry
// (SET ... PX ttl) that refresh() extends (PEXPIRE); a key that is gone when refreshed (the
// server restarted or the keys expired) is a lost lease.
#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>

#include "metadata/store.hpp"

namespace rdmakit::detail::metadata {
namespace {

struct ReplyFree {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

struct ContextFree {
  void operator()(redisContext* c) const noexcept { redisFree(c); }
};

timeval remaining(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
  // At least 1 ms: a zero timeout means "block forever" to hiredis.
  left = std::max(left, std::chrono::microseconds{1000});
  return timeval{static_cast<time_t>(left.count() / 1'000'000),
                 static_cast<suseconds_t>(left.count() % 1'000'000)};
}

// Glob characters in a prefix match literally in SCAN MATCH.
std::string glob_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

class RedisStore final : public Store {
 public:
  explicit RedisStore(StoreUri uri) : uri_(std::move(uri)) {}

  [[nodiscard]] std::string shown() const override { return uri_.shown(); }

  LeaseId grant(std::chrono::milliseconds ttl, Deadline) override {
    const LeaseId id = next_lease_++;
    leases_[id].ttl = std::max(ttl, std::chrono::milliseconds{1});
    return id;
  }

  void refresh(LeaseId lease, Deadline deadline) override {
    Lease& l = lease_of(lease, "refresh");
    if (l.keys.empty()) return;
    std::vector<std::vector<std::string>> cmds;
    for (const std::string& k : l.keys) cmds.push_back({"PEXPIRE", k, std::to_string(l.ttl.count())});
    std::vector<Reply> replies = pipeline(cmds, deadline, "refresh");
    std::size_t i = 0;
    for (const std::string& k : l.keys) {
      if (replies[i]->type != REDIS_REPLY_INTEGER) unexpected("refresh (PEXPIRE)", *replies[i]);
      if (replies[i]->integer == 0) {
        throw LeaseLost("redis refresh", 0,
                        fmt::format("{}: key \"{}\" of lease {} is gone", shown(), k, lease),
                        "the server restarted or the lease expired while it was unreachable: put "
                        "the entries again");
      }
      ++i;
    }
  }

  void revoke(LeaseId lease, Deadline deadline) override {
    auto it = leases_.find(lease);
    if (it == leases_.end()) return;
    std::set<std::string> keys = std::move(it->second.keys);
    leases_.erase(it);
    for (const std::string& k : keys) command({"DEL", k}, deadline, "revoke");
  }

  void put(const std::string& key, const std::string& value, LeaseId lease,
           Deadline deadline) override {
    Reply r;
    if (lease == no_lease) {
      r = command({"SET", key, value}, deadline, "put");
    } else {
      Lease& l = lease_of(lease, "put");
      r = command({"SET", key, value, "PX", std::to_string(l.ttl.count())}, deadline, "put");
      l.keys.insert(key);
    }
    if (r->type != REDIS_REPLY_STATUS) unexpected("put (SET)", *r);
  }

  std::optional<std::string> get(const std::string& key, Deadline deadline) override {
    Reply r = command({"GET", key}, deadline, "get");
    if (r->type == REDIS_REPLY_NIL) return std::nullopt;
    if (r->type != REDIS_REPLY_STRING) unexpected("get (GET)", *r);
    return std::string(r->str, r->len);
  }

  std::vector<KeyValue> list(const std::string& prefix, Deadline deadline) override {
    std::set<std::string> keys;
    std::string cursor = "0";
    const std::string match = glob_escape(prefix) + "*";
    do {
      Reply r = command({"SCAN", cursor, "MATCH", match, "COUNT", "1000"}, deadline, "list");
      if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
          r->element[0]->type != REDIS_REPLY_STRING || r->element[1]->type != REDIS_REPLY_ARRAY) {
        unexpected("list (SCAN)", *r);
      }
      cursor.assign(r->element[0]->str, r->element[0]->len);
      const redisReply& batch = *r->element[1];
      for (std::size_t i = 0; i < batch.elements; ++i) {
        if (batch.element[i]->type != REDIS_REPLY_STRING) unexpected("list (SCAN)", *r);
        keys.emplace(batch.element[i]->str, batch.element[i]->len);
      }
    } while (cursor != "0");
    std::vector<KeyValue> out;
    if (keys.empty()) return out;
    std::vector<std::string> mget{"MGET"};
    mget.insert(mget.end(), keys.begin(), keys.end());
    Reply r = command(mget, deadline, "list");
    if (r->type != REDIS_REPLY_ARRAY || r->elements != keys.size()) unexpected("list (MGET)", *r);
    std::size_t i = 0;
    for (const std::string& k : keys) {
      const redisReply& v = *r->element[i++];
      if (v.type == REDIS_REPLY_STRING) out.push_back({k, std::string(v.str, v.len)});
      // nil: the key expired between SCAN and MGET.
    }
    return out;
  }

  void remove(const std::string& key, Deadline deadline) override {
    command({"DEL", key}, deadline, "remove");
    for (auto& [id, l] : leases_) l.keys.erase(key);
  }

 private:
  struct Lease {
    std::chrono::milliseconds ttl{0};
    std::set<std::string> keys;
  };

  Lease& lease_of(LeaseId lease, const char* op) {
    auto it = leases_.find(lease);
    if (it == leases_.end()) {
      throw LeaseLost(fmt::format("redis {}", op), 0,
                      fmt::format("{}: lease {} was never granted or was revoked", shown(), lease));
    }
    return it->second;
  }

  [[noreturn]] void unexpected(const char* op, const redisReply& r) {
    std::string what = r.type == REDIS_REPLY_ERROR ? std::string(r.str, r.len)
                                                   : fmt::format("a reply of type {}", r.type);
    throw Error(fmt::format("redis {}", op), r.type == REDIS_REPLY_ERROR ? 0 : EPROTO,
                fmt::format("{} answered {}", shown(), what),
                r.type == REDIS_REPLY_ERROR ? "" : "is this a Redis server?");
  }

  // The connection's failure as an Error, and the connection dropped (hiredis cannot go on
  // after one).
  [[noreturn]] void lost(const char* op) {
    const int type = ctx_->err;
    std::string why = ctx_->errstr;
    const int err = type == REDIS_ERR_IO ? errno : 0;
    ctx_.reset();
    std::string hint;
    switch (type) {
      case REDIS_ERR_EOF:
        why = "the server closed the connection (mid-reply, or it restarted)";
        hint = "it is retried on the next call";
        break;
      case REDIS_ERR_PROTOCOL:
        why = fmt::format("the answer is not the Redis protocol ({})", why);
        hint = "is this a Redis server, and the right port?";
        break;
      default:
        if (err == EAGAIN || err == EWOULDBLOCK || err == ETIMEDOUT) {
          throw Error(fmt::format("redis {}", op), ETIMEDOUT,
                      fmt::format("{}: no answer before the deadline", shown()),
                      "the server is overloaded, stopped or unreachable");
        }
        hint = "is redis-server running there and reachable?";
    }
    throw Error(fmt::format("redis {}", op), err, fmt::format("{}: {}", shown(), why), hint);
  }

  void connect(Deadline deadline) {
    const HostPort& hp = uri_.hosts.at(0);
    ctx_.reset(redisConnectWithTimeout(hp.host.c_str(), hp.port, remaining(deadline)));
    if (!ctx_) throw Error("redis connect", ENOMEM, shown());
    if (ctx_->err != 0) lost("connect");
    if (!uri_.password.empty()) {
      Reply r = uri_.user.empty() ? raw({"AUTH", uri_.password}, deadline, "AUTH")
                                  : raw({"AUTH", uri_.user, uri_.password}, deadline, "AUTH");
      if (r->type == REDIS_REPLY_ERROR) {
        std::string why(r->str, r->len);
        ctx_.reset();
        throw Error("redis AUTH", EACCES, fmt::format("{}: {}", shown(), why),
                    "check the user and password in the URI");
      }
    }
    if (uri_.db != 0) {
      Reply r = raw({"SELECT", std::to_string(uri_.db)}, deadline, "SELECT");
      if (r->type == REDIS_REPLY_ERROR) unexpected("SELECT", *r);
    }
  }

  // Queues one command on the connection (hiredis sends it at the next reply read).
  void append(const std::vector<std::string>& args, const char* op) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    if (redisAppendCommandArgv(ctx_.get(), static_cast<int>(argv.size()), argv.data(),
                               lens.data()) != REDIS_OK) {
      lost(op);
    }
  }

  Reply next_reply(const char* op) {
    void* r = nullptr;
    if (redisGetReply(ctx_.get(), &r) != REDIS_OK || r == nullptr) lost(op);
    return Reply(static_cast<redisReply*>(r));
  }

  Reply raw(const std::vector<std::string>& args, Deadline deadline, const char* op) {
    if (redisSetTimeout(ctx_.get(), remaining(deadline)) != REDIS_OK) lost(op);
    append(args, op);
    return next_reply(op);
  }

  Reply command(const std::vector<std::string>& args, Deadline deadline, const char* op) {
    if (!ctx_) connect(deadline);
    Reply r = raw(args, deadline, op);
    if (r->type == REDIS_REPLY_ERROR) unexpected(op, *r);
    return r;
  }

  std::vector<Reply> pipeline(const std::vector<std::vector<std::string>>& cmds,
                              Deadline deadline, const char* op) {
    if (!ctx_) connect(deadline);
    if (redisSetTimeout(ctx_.get(), remaining(deadline)) != REDIS_OK) lost(op);
    for (const auto& args : cmds) append(args, op);
    std::vector<Reply> out;
    for (std::size_t i = 0; i < cmds.size(); ++i) out.push_back(next_reply(op));
    return out;
  }

  StoreUri uri_;
  std::unique_ptr<redisContext, ContextFree> ctx_;
  std::map<LeaseId, Lease> leases_;
  LeaseId next_lease_ = 1;
};

}  // namespace

std::unique_ptr<Store> open_redis(const StoreUri& uri) { return std::make_unique<RedisStore>(uri); }

}  // namespace rdmakit::detail::metadata
