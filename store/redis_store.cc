// The Redis store (hiredis): one string per chunk under key_prefix + hex
// key, SET with an optional expiry, GET and EXISTS pipelined. Connect and
// every command time out after timeout_ms; a refused connection, a timeout,
// a dropped connection or a refused AUTH is one warning, then the store is
// empty for the rest of the process (the run goes on without it). The
// password (from the URL or KVQ_REDIS_PASSWORD) is sent with AUTH and never
// printed: describe() shows it as ***, and any server text is scrubbed of it.
// Writing to a socket the server closed would raise SIGPIPE: a process that
// still has the default action for it gets SIG_IGN when a store opens.
#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/time.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "kvq/error.h"
#include "store/backends.h"

namespace kvq::store {
namespace {

struct RedisUrl {
  std::string user, password, host;
  int port = 6379, db = 0;
  bool has_password = false;
};

std::string PercentDecode(const std::string& s, const char* what) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out.push_back(s[i]);
      continue;
    }
    KVQ_CHECK_ARG(i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
                      std::isxdigit(static_cast<unsigned char>(s[i + 2])),
                  "prompt cache: a bad %-escape in the Redis URL's ", what);
    out.push_back(static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16)));
    i += 2;
  }
  return out;
}

// The text is never echoed: in a URL typed without its host
// ("redis://:PASSWORD") the port is the password.
int ParseInt(const std::string& s, int lo, int hi, const char* what) {
  KVQ_CHECK_ARG(!s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos,
                "prompt cache: the Redis URL's ", what, " is not a number (expected ",
                "redis://[user[:password]@]host[:port][/db])");
  const int v = std::atoi(s.c_str());
  KVQ_CHECK_ARG(v >= lo && v <= hi, "prompt cache: the Redis URL's ", what, " is outside ", lo, "..", hi);
  return v;
}

// redis://[user[:password]@]host[:port][/db]; never echoes the part before '@'.
RedisUrl ParseUrl(const std::string& url) {
  RedisUrl u;
  std::string rest = url.substr(8);
  const size_t at = rest.rfind('@');
  if (at != std::string::npos) {
    const std::string cred = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = cred.find(':');
    u.user = PercentDecode(cred.substr(0, colon), "user");
    if (colon != std::string::npos) {
      u.password = PercentDecode(cred.substr(colon + 1), "password");
      u.has_password = true;
    }
  }
  const size_t slash = rest.find('/');
  if (slash != std::string::npos) {
    const std::string db = rest.substr(slash + 1);
    if (!db.empty()) u.db = ParseInt(db, 0, 1 << 20, "database");
    rest = rest.substr(0, slash);
  }
  const size_t colon = rest.rfind(':');
  if (colon != std::string::npos) {
    u.port = ParseInt(rest.substr(colon + 1), 1, 65535, "port");
    rest = rest.substr(0, colon);
  }
  KVQ_CHECK_ARG(!rest.empty(), "prompt cache: the Redis URL names no host (expected redis://host:port)");
  u.host = rest;
  if (!u.has_password) {
    if (const char* p = std::getenv("KVQ_REDIS_PASSWORD"); p && *p) u.password = p, u.has_password = true;
  }
  return u;
}

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

class RedisStore final : public StoreBackend {
 public:
  RedisStore(const std::string& url, const StoreOptions& o, WarnFn warn)
      : u_(ParseUrl(url)), prefix_(o.key_prefix), ttl_(o.ttl_seconds), warn_(std::move(warn)) {
    struct sigaction old {};
    if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
    describe_ = "redis://" + (u_.user.empty() && !u_.has_password ? "" : u_.user + (u_.has_password ? ":***" : "") + "@") +
                u_.host + ":" + std::to_string(u_.port) + "/" + std::to_string(u_.db);
    const struct timeval tv = {o.timeout_ms / 1000, (o.timeout_ms % 1000) * 1000};
    c_ = redisConnectWithTimeout(u_.host.c_str(), u_.port, tv);
    if (!c_ || c_->err) {
      GiveUp(std::string("cannot connect (") + (c_ ? c_->errstr : "out of memory") + ")");
      return;
    }
    if (redisSetTimeout(c_, tv) != REDIS_OK) {
      GiveUp("cannot set the timeout");
      return;
    }
    if (u_.has_password) {
      Reply r(static_cast<redisReply*>(u_.user.empty()
                                           ? redisCommand(c_, "AUTH %b", u_.password.data(), u_.password.size())
                                           : redisCommand(c_, "AUTH %b %b", u_.user.data(), u_.user.size(),
                                                          u_.password.data(), u_.password.size())));
      if (!Ok(r, "AUTH")) return;
    }
    if (u_.db != 0) {
      Reply r(static_cast<redisReply*>(redisCommand(c_, "SELECT %d", u_.db)));
      if (!Ok(r, "SELECT")) return;
    }
  }
  ~RedisStore() override {
    if (c_) redisFree(c_);
  }
  std::string describe() const override { return describe_; }
  bool alive() const override { return c_ != nullptr; }

  std::vector<bool> contains(std::span<const Key> keys) override {
    std::vector<bool> out(keys.size(), false);
    std::vector<Reply> r = Pipeline("EXISTS", keys);
    for (size_t i = 0; i < r.size(); ++i) out[i] = r[i]->type == REDIS_REPLY_INTEGER && r[i]->integer == 1;
    return out;
  }

  std::vector<std::optional<std::vector<uint8_t>>> get(std::span<const Key> keys) override {
    std::vector<std::optional<std::vector<uint8_t>>> out(keys.size());
    std::vector<Reply> r = Pipeline("GET", keys);
    for (size_t i = 0; i < r.size(); ++i) {
      if (r[i]->type == REDIS_REPLY_STRING) {
        out[i] = std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(r[i]->str),
                                      reinterpret_cast<const uint8_t*>(r[i]->str) + r[i]->len);
      }
    }
    return out;
  }

  bool put(std::span<const Key> chain, std::span<const uint8_t> value) override {
    if (!c_) return false;
    const std::string k = prefix_ + key_hex(chain.back());
    Reply r(static_cast<redisReply*>(
        ttl_ > 0 ? redisCommand(c_, "SET %b %b EX %d", k.data(), k.size(), value.data(), value.size(), ttl_)
                 : redisCommand(c_, "SET %b %b", k.data(), k.size(), value.data(), value.size())));
    return Ok(r, "SET");
  }

 private:
  // One command per key, sent together; the replies in order (fewer when
  // the connection failed: the store gave up).
  std::vector<Reply> Pipeline(const char* cmd, std::span<const Key> keys) {
    std::vector<Reply> out;
    if (!c_) return out;
    std::vector<std::string> ks;
    for (const Key& k : keys) ks.push_back(prefix_ + key_hex(k));
    for (const std::string& k : ks) {
      if (redisAppendCommand(c_, "%s %b", cmd, k.data(), k.size()) != REDIS_OK) {
        GiveUp(std::string(cmd) + " failed (" + c_->errstr + ")");
        return {};
      }
    }
    for (size_t i = 0; i < ks.size(); ++i) {
      void* p = nullptr;
      if (redisGetReply(c_, &p) != REDIS_OK) {
        if (p) freeReplyObject(p);
        Lost(cmd);
        return {};
      }
      Reply r(static_cast<redisReply*>(p));
      if (r->type == REDIS_REPLY_ERROR) {
        GiveUp(std::string(cmd) + " refused: " + std::string(r->str, r->len));
        return {};
      }
      out.push_back(std::move(r));
    }
    return out;
  }

  // A reply that is not an error, or give up.
  bool Ok(const Reply& r, const char* cmd) {
    if (!c_) return false;
    if (!r) {
      Lost(cmd);
      return false;
    }
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string text(r->str, r->len);
      GiveUp(std::string(cmd) + " refused: " + text +
             (std::strcmp(cmd, "AUTH") == 0 || text.rfind("NOAUTH", 0) == 0 || text.rfind("WRONGPASS", 0) == 0
                  ? " (check the password in the URL or KVQ_REDIS_PASSWORD)"
                  : ""));
      return false;
    }
    return true;
  }

  void Lost(const char* cmd) {
    const bool timeout = c_->err == REDIS_ERR_IO && (std::strstr(c_->errstr, "temporarily unavailable") || std::strstr(c_->errstr, "timed out"));
    GiveUp(std::string(cmd) + ": " + (timeout ? "no reply within the timeout" : std::string("connection lost (") + c_->errstr + ")"));
  }

  void GiveUp(const std::string& why) {
    std::string msg = describe_ + ": " + why + "; continuing without the store";
    if (u_.has_password && !u_.password.empty()) {
      for (size_t at; (at = msg.find(u_.password)) != std::string::npos;) msg.replace(at, u_.password.size(), "***");
    }
    warn_(msg);
    if (c_) redisFree(c_);
    c_ = nullptr;
  }

  RedisUrl u_;
  std::string prefix_, describe_;
  int ttl_;
  WarnFn warn_;
  redisContext* c_ = nullptr;
};

}  // namespace

std::unique_ptr<StoreBackend> open_redis_store(const std::string& url, const StoreOptions& o, WarnFn warn) {
  return std::make_unique<RedisStore>(url, o, std::move(warn));
}

}  // namespace kvq::store
