// The Redis store (hiredis): one string per chunk under key_prefix + hex
// key, SET with an optional expiry, GET and STRLEN pipelined. Connect
// times out after timeout_ms, and each operation (a pipeline sent and its
// replies read) has one deadline: timeout_ms plus a second per MiB moved,
// so a server that trickles bytes cannot stall a run. A key of another
// type (WRONGTYPE) is an unusable entry, overwritten by SET. A refused
// connection, a timeout,
// a dropped connection or a refused AUTH is one warning, then the store is
// empty for the rest of the process (the run goes on without it). The
// password (from the URL or KVQ_REDIS_PASSWORD) is sent with AUTH and never
// printed: describe() shows it as ***, and any server text is scrubbed of it.
// Writing to a socket the server closed would raise SIGPIPE: a process that
// still has the default action for it gets SIG_IGN when a store opens.
#include <hiredis/hiredis.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <cctype>
#include <chrono>
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

// One command as its arguments (binary-safe).
using Command = std::vector<std::string>;

class RedisStore final : public StoreBackend {
 public:
  RedisStore(const std::string& url, const StoreOptions& o, WarnFn warn)
      : u_(ParseUrl(url)), prefix_(o.key_prefix), ttl_(o.ttl_seconds), timeout_ms_(o.timeout_ms), warn_(std::move(warn)) {
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
      const Command auth = u_.user.empty() ? Command{"AUTH", u_.password} : Command{"AUTH", u_.user, u_.password};
      if (!Ok(Run({auth}), "AUTH")) return;
    }
    if (u_.db != 0 && !Ok(Run({{"SELECT", std::to_string(u_.db)}}), "SELECT")) return;
  }
  ~RedisStore() override {
    if (c_) redisFree(c_);
  }
  std::string describe() const override { return describe_; }
  bool alive() const override { return c_ != nullptr; }

  // STRLEN: 0 for an absent key (a stored chunk is never empty), an error
  // (WRONGTYPE) for a key of another type.
  std::vector<std::optional<uint64_t>> sizes(std::span<const Key> keys) override {
    std::vector<std::optional<uint64_t>> out(keys.size());
    const std::vector<Reply> r = PerKey("STRLEN", keys);
    for (size_t i = 0; i < r.size(); ++i) {
      if (!r[i]) {
        out[i] = kNotAValue;
      } else if (r[i]->type == REDIS_REPLY_INTEGER && r[i]->integer > 0) {
        out[i] = static_cast<uint64_t>(r[i]->integer);
      }
    }
    return out;
  }

  std::vector<std::optional<std::vector<uint8_t>>> get(std::span<const Key> keys) override {
    std::vector<std::optional<std::vector<uint8_t>>> out(keys.size());
    const std::vector<Reply> r = PerKey("GET", keys);
    for (size_t i = 0; i < r.size(); ++i) {
      if (r[i] && r[i]->type == REDIS_REPLY_STRING) {
        out[i] = std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(r[i]->str),
                                      reinterpret_cast<const uint8_t*>(r[i]->str) + r[i]->len);
      }
    }
    return out;
  }

  // SET replaces a key of any type.
  bool put(std::span<const Key> chain, std::span<const uint8_t> value) override {
    if (!c_) return false;
    Command set = {"SET", prefix_ + key_hex(chain.back()), std::string(value.begin(), value.end())};
    if (ttl_ > 0) set.insert(set.end(), {"EX", std::to_string(ttl_)});
    return Ok(Run({std::move(set)}), "SET");
  }

 private:
  // One command per key, pipelined; a key's reply is null when the server
  // refused that key alone (WRONGTYPE: another type is stored there). Fewer
  // replies than keys: the store gave up.
  std::vector<Reply> PerKey(const char* cmd, std::span<const Key> keys) {
    std::vector<Command> cmds;
    for (const Key& k : keys) cmds.push_back({cmd, prefix_ + key_hex(k)});
    std::vector<Reply> r = Run(cmds);
    for (size_t i = 0; i < r.size(); ++i) {
      if (r[i]->type != REDIS_REPLY_ERROR) continue;
      const std::string text(r[i]->str, r[i]->len);
      if (text.rfind("WRONGTYPE", 0) == 0) {
        r[i].reset();
      } else {
        Ok(r[i], cmd);  // gives up, with the server's reason
        return {};
      }
    }
    return r;
  }

  // Sends the commands together and reads their replies, all within one
  // deadline: timeout_ms, plus a second for every MiB sent or received (a
  // server that trickles bytes cannot stall the run; a large value on a
  // slow link still arrives). Error replies are returned as replies; on a
  // timeout or a lost connection the store gives up and returns {}.
  std::vector<Reply> Run(const std::vector<Command>& cmds) {
    std::vector<Reply> out;
    if (!c_) return out;
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    uint64_t moved = 0;
    const auto left_ms = [&] {
      const auto allowed = std::chrono::milliseconds(timeout_ms_) + std::chrono::microseconds(moved);  // 1 s per MB
      return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(allowed - (Clock::now() - t0)).count());
    };
    const auto wait = [&](short events) {
      for (;;) {
        const int ms = left_ms();
        if (ms <= 0) return false;
        struct pollfd p = {c_->fd, events, 0};
        const int n = ::poll(&p, 1, ms);
        if (n > 0) return true;
        if (n == 0) return false;
        if (errno != EINTR) return false;
      }
    };
    const char* name = cmds.empty() ? "?" : cmds[0][0].c_str();
    for (const Command& c : cmds) {
      std::vector<const char*> argv;
      std::vector<size_t> lens;
      for (const std::string& a : c) argv.push_back(a.data()), lens.push_back(a.size()), moved += a.size();
      if (redisAppendCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()) != REDIS_OK) {
        GiveUp(std::string(name) + " failed (" + c_->errstr + ")");
        return {};
      }
    }
    for (int done = 0; !done;) {
      if (!wait(POLLOUT)) return Timeout(name), std::vector<Reply>{};
      if (redisBufferWrite(c_, &done) != REDIS_OK) return Lost(name), std::vector<Reply>{};
    }
    moved = 0;  // the allowance for what was sent is spent; replies earn their own
    while (out.size() < cmds.size()) {
      void* p = nullptr;
      if (redisGetReplyFromReader(c_, &p) != REDIS_OK) return Lost(name), std::vector<Reply>{};
      if (p) {
        out.emplace_back(static_cast<redisReply*>(p));
        continue;
      }
      if (!wait(POLLIN)) return Timeout(name), std::vector<Reply>{};
      char buf[1 << 16];
      const ssize_t n = ::recv(c_->fd, buf, sizeof buf, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) {
        GiveUp(std::string(name) + ": connection lost (" + (n == 0 ? "Server closed the connection" : std::strerror(errno)) + ")");
        return {};
      }
      if (redisReaderFeed(c_->reader, buf, static_cast<size_t>(n)) != REDIS_OK) return Lost(name), std::vector<Reply>{};
      moved += static_cast<uint64_t>(n);
    }
    return out;
  }

  // A reply that is not an error, or give up.
  bool Ok(const std::vector<Reply>& r, const char* cmd) { return !r.empty() && Ok(r[0], cmd); }
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

  void Timeout(const std::string& cmd) { GiveUp(cmd + ": no reply within the timeout"); }
  void Lost(const std::string& cmd) {
    const bool timeout = c_->err == REDIS_ERR_IO && (std::strstr(c_->errstr, "temporarily unavailable") || std::strstr(c_->errstr, "timed out"));
    GiveUp(cmd + ": " + (timeout ? "no reply within the timeout" : std::string("connection lost (") + c_->errstr + ")"));
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
  int ttl_, timeout_ms_;
  WarnFn warn_;
  redisContext* c_ = nullptr;
};

}  // namespace

std::unique_ptr<StoreBackend> open_redis_store(const std::string& url, const StoreOptions& o, WarnFn warn) {
  return std::make_unique<RedisStore>(url, o, std::move(warn));
}

}  // namespace kvq::store
