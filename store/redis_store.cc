// The Redis store (hiredis): one string per chunk under key_prefix + hex
// key, SET with an optional expiry, GET and STRLEN pipelined. Connect
// times out after timeout_ms; sending a pipeline and reading its replies
// each have a deadline: timeout_ms plus a second per MiB moved, so a
// server that trickles bytes cannot stall a run. A key of another
// type (WRONGTYPE) is an unusable entry, overwritten by SET.
//
// Redis Cluster: when the server answers CLUSTER SLOTS, the store keeps
// the slot map (slot = CRC16-XMODEM of the key, or of its {hash tag}, mod
// 16384, as Redis defines it), sends each key to its slot's master (one
// pipeline per node), and follows MOVED (the map is updated) and ASK
// (ASKING, once) redirections. Debian's hiredis is not cluster-aware.
//
// A refused connection, a timeout, a dropped connection (any node's) or a
// refused AUTH is one warning, then the store is empty for the rest of the
// process (the run goes on without it). The password (from the URL or
// KVQ_REDIS_PASSWORD) is sent with AUTH to every node and never printed:
// describe() shows it as ***, and any server text is scrubbed of it.
// Writing to a socket the server closed would raise SIGPIPE: a process that
// still has the default action for it gets SIG_IGN when a store opens.
#include <hiredis/hiredis.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

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
    nodes_.push_back({u_.host, u_.port, nullptr});
    if (!Connect(0)) return;
    // A cluster node answers CLUSTER SLOTS; a standalone server refuses it.
    std::vector<Reply> r = Run(0, {{"CLUSTER", "SLOTS"}});
    if (r.empty()) return;
    if (r[0]->type == REDIS_REPLY_ARRAY) {
      if (u_.db != 0) {
        GiveUp("a Redis Cluster has only database 0");
        return;
      }
      cluster_ = true;
      if (!LoadSlots(*r[0])) return;
      describe_ += " (cluster)";
    } else if (u_.db != 0 && !Ok(Run(0, {{"SELECT", std::to_string(u_.db)}}), "SELECT")) {
      return;
    }
  }
  ~RedisStore() override { Close(); }
  std::string describe() const override { return describe_; }
  // Down after a failure until its retry time; then the next operation
  // reconnects.
  bool alive() const override { return !dead_ || std::chrono::steady_clock::now() >= retry_at_; }
  uint64_t epoch() const override { return epoch_; }

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
    if (Down()) return false;
    Command set = {"SET", prefix_ + key_hex(chain.back()), std::string(value.begin(), value.end())};
    if (ttl_ > 0) set.insert(set.end(), {"EX", std::to_string(ttl_)});
    const std::string key = set[1];
    return Ok(Routed(std::move(set), key), "SET");
  }

 private:
  struct Node {
    std::string host;
    int port;
    redisContext* c;
  };
  static constexpr int kSlots = 16384;
  static constexpr int kMaxRedirects = 5;

  // Connects nodes_[i] (AUTH too); false: the store gave up.
  bool Connect(size_t i) {
    if (Down()) return false;
    Node& n = nodes_[i];
    if (n.c) return true;
    const struct timeval tv = {timeout_ms_ / 1000, (timeout_ms_ % 1000) * 1000};
    n.c = redisConnectWithTimeout(n.host.c_str(), n.port, tv);
    const std::string where = i == 0 ? std::string() : " to " + n.host + ":" + std::to_string(n.port);
    if (!n.c || n.c->err) {
      GiveUp("cannot connect" + where + " (" + (n.c ? n.c->errstr : "out of memory") + ")");
      return false;
    }
    if (redisSetTimeout(n.c, tv) != REDIS_OK) {
      GiveUp("cannot set the timeout");
      return false;
    }
    if (u_.has_password) {
      const Command auth = u_.user.empty() ? Command{"AUTH", u_.password} : Command{"AUTH", u_.user, u_.password};
      if (!Ok(Run(i, {auth}), "AUTH")) return false;
    }
    if (retrying_) {  // back after a failure: say so once
      retrying_ = false;
      ++epoch_;
      backoff_ = kFirstRetry;
      warn_(describe_ + ": reconnected; the store is back");
    }
    return true;
  }

  size_t NodeFor(const std::string& host, int port) {
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (nodes_[i].host == host && nodes_[i].port == port) return i;
    }
    nodes_.push_back({host, port, nullptr});
    return nodes_.size() - 1;
  }

  // CLUSTER SLOTS: [[start, end, [host, port, ...], replicas...], ...]; an
  // empty host means the node that answered.
  bool LoadSlots(const redisReply& r) {
    slot_node_.assign(kSlots, 0);
    for (size_t i = 0; i < r.elements; ++i) {
      const redisReply* e = r.element[i];
      if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
          e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
          e->element[2]->elements < 2 || e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
          e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
        GiveUp("CLUSTER SLOTS: an unexpected reply");
        return false;
      }
      const long long lo = e->element[0]->integer, hi = e->element[1]->integer;
      const redisReply* m = e->element[2];
      std::string host(m->element[0]->str, m->element[0]->len);
      if (host.empty() || host == "?") host = nodes_[0].host;
      const long long port = m->element[1]->integer;
      if (lo < 0 || hi >= kSlots || lo > hi || port < 1 || port > 65535) {
        GiveUp("CLUSTER SLOTS: an unexpected reply");
        return false;
      }
      const size_t n = NodeFor(host, static_cast<int>(port));
      for (long long s = lo; s <= hi; ++s) slot_node_[static_cast<size_t>(s)] = n;
    }
    return true;
  }

  size_t NodeOf(const std::string& key) const {
    return cluster_ ? slot_node_[static_cast<size_t>(redis_key_slot(key))] : 0;
  }

  // A redirection's target: "MOVED <slot> <host>:<port>" / "ASK ...".
  bool Redirect(const redisReply& r, bool* ask, int* slot, size_t* node) {
    if (!cluster_ || r.type != REDIS_REPLY_ERROR) return false;
    const std::string text(r.str, r.len);
    *ask = text.rfind("ASK ", 0) == 0;
    if (!*ask && text.rfind("MOVED ", 0) != 0) return false;
    const size_t a = text.find(' '), b = text.find(' ', a + 1), colon = text.rfind(':');
    if (b == std::string::npos || colon == std::string::npos || colon < b) return false;
    *slot = std::atoi(text.c_str() + a + 1);
    std::string host = text.substr(b + 1, colon - b - 1);
    if (host.empty()) host = nodes_[0].host;
    const int port = std::atoi(text.c_str() + colon + 1);
    if (*slot < 0 || *slot >= kSlots || port < 1 || port > 65535) return false;
    *node = NodeFor(host, port);
    return true;
  }

  // One command on the key's node, following redirections. Null: gave up.
  Reply Routed(Command cmd, const std::string& key) {
    size_t node = NodeOf(key);
    bool asking = false;
    for (int hop = 0; hop <= kMaxRedirects; ++hop) {
      if (!Connect(node)) return nullptr;
      std::vector<Command> cmds;
      if (asking) cmds.push_back({"ASKING"});
      cmds.push_back(cmd);
      std::vector<Reply> r = Run(node, cmds);
      if (r.empty()) return nullptr;
      Reply got = std::move(r.back());
      int slot = 0;
      size_t to = 0;
      if (!Redirect(*got, &asking, &slot, &to)) return got;
      if (!asking) slot_node_[static_cast<size_t>(slot)] = to;  // MOVED: the slot lives there now
      node = to;
    }
    GiveUp(cmd[0] + ": more than " + std::to_string(kMaxRedirects) + " cluster redirections");
    return nullptr;
  }

  // One command per key, pipelined per node; a key's reply is null when the
  // server refused that key alone (WRONGTYPE: another type is stored there).
  // Fewer replies than keys: the store gave up.
  std::vector<Reply> PerKey(const char* cmd, std::span<const Key> keys) {
    if (Down()) return {};
    std::vector<std::string> ks;
    for (const Key& k : keys) ks.push_back(prefix_ + key_hex(k));
    std::vector<Reply> out(keys.size());
    std::vector<std::vector<size_t>> by_node(nodes_.size());
    for (size_t i = 0; i < ks.size(); ++i) by_node[NodeOf(ks[i])].push_back(i);
    for (size_t n = 0; n < by_node.size(); ++n) {
      if (by_node[n].empty()) continue;
      if (!Connect(n)) return {};
      std::vector<Command> cmds;
      for (size_t i : by_node[n]) cmds.push_back({cmd, ks[i]});
      std::vector<Reply> r = Run(n, cmds);
      if (r.empty()) return {};
      for (size_t j = 0; j < r.size(); ++j) out[by_node[n][j]] = std::move(r[j]);
    }
    for (size_t i = 0; i < out.size(); ++i) {
      bool ask = false;
      int slot = 0;
      size_t to = 0;
      if (Redirect(*out[i], &ask, &slot, &to)) {
        out[i] = Routed({cmd, ks[i]}, ks[i]);
        if (!out[i]) return {};
      }
      if (out[i]->type != REDIS_REPLY_ERROR) continue;
      const std::string text(out[i]->str, out[i]->len);
      if (text.rfind("WRONGTYPE", 0) == 0) {
        out[i].reset();
      } else {
        Ok(out[i], cmd);  // gives up, with the server's reason
        return {};
      }
    }
    return out;
  }

  // Sends the commands to node i together and reads their replies, each
  // within a deadline: timeout_ms, plus a second for every MiB sent (for
  // sending) or received so far (for the replies, counted from when the
  // last byte went out): a server that trickles bytes cannot stall the run,
  // a large value on a slow link still arrives. Error replies are returned as
  // replies; on a timeout or a lost connection the store gives up and
  // returns {}.
  std::vector<Reply> Run(size_t node, const std::vector<Command>& cmds) {
    std::vector<Reply> out;
    if (dead_ || !nodes_[node].c) return out;
    redisContext* c = nodes_[node].c;
    using Clock = std::chrono::steady_clock;
    auto t0 = Clock::now();
    uint64_t moved = 0;
    const auto left_ms = [&] {
      const auto allowed = std::chrono::milliseconds(timeout_ms_) + std::chrono::microseconds(moved);  // 1 s per MB
      return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(allowed - (Clock::now() - t0)).count());
    };
    const auto wait = [&](short events) {
      for (;;) {
        const int ms = left_ms();
        if (ms <= 0) return false;
        struct pollfd p = {c->fd, events, 0};
        const int n = ::poll(&p, 1, ms);
        if (n > 0) return true;
        if (n == 0 || errno != EINTR) return false;
      }
    };
    const std::string name = cmds.back()[0];
    for (const Command& cmd : cmds) {
      std::vector<const char*> argv;
      std::vector<size_t> lens;
      for (const std::string& a : cmd) argv.push_back(a.data()), lens.push_back(a.size()), moved += a.size();
      if (redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()) != REDIS_OK) {
        GiveUp(name + " failed (" + c->errstr + ")");
        return {};
      }
    }
    for (int done = 0; !done;) {
      if (!wait(POLLOUT)) return Timeout(name), std::vector<Reply>{};
      if (redisBufferWrite(c, &done) != REDIS_OK) return Lost(name, c->errstr), std::vector<Reply>{};
    }
    t0 = Clock::now(), moved = 0;  // the replies get their own deadline, from when the last byte went out
    while (out.size() < cmds.size()) {
      void* p = nullptr;
      if (redisGetReplyFromReader(c, &p) != REDIS_OK) return Lost(name, c->errstr), std::vector<Reply>{};
      if (p) {
        out.emplace_back(static_cast<redisReply*>(p));
        continue;
      }
      if (!wait(POLLIN)) return Timeout(name), std::vector<Reply>{};
      char buf[1 << 16];
      const ssize_t n = ::recv(c->fd, buf, sizeof buf, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) return Lost(name, n == 0 ? "Server closed the connection" : std::strerror(errno)), std::vector<Reply>{};
      if (redisReaderFeed(c->reader, buf, static_cast<size_t>(n)) != REDIS_OK) {
        return Lost(name, "a malformed reply"), std::vector<Reply>{};
      }
      moved += static_cast<uint64_t>(n);
    }
    return out;
  }

  // A reply that is not an error, or give up.
  bool Ok(const std::vector<Reply>& r, const char* cmd) { return !r.empty() && Ok(r[0], cmd); }
  bool Ok(const Reply& r, const char* cmd) {
    if (dead_ || !r) return false;
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
  void Lost(const std::string& cmd, const std::string& why) { GiveUp(cmd + ": connection lost (" + why + ")"); }

  // A failure turns the store off (every operation a miss) until a retry
  // time, 2 s after the first failure and doubling to 60 s while retries
  // fail; then the next operation reconnects. Warned once when it goes
  // down and once when it is back, not on each failed retry.
  void GiveUp(const std::string& why) {
    if (dead_) return;
    if (!retrying_) {
      std::string msg = describe_ + ": " + why + "; continuing without the store (retrying from " +
                        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(backoff_).count()) +
                        " s on)";
      if (u_.has_password && !u_.password.empty()) {
        for (size_t at; (at = msg.find(u_.password)) != std::string::npos;) msg.replace(at, u_.password.size(), "***");
      }
      warn_(msg);
    }
    Close();
    dead_ = true;
    retry_at_ = std::chrono::steady_clock::now() + backoff_;
    backoff_ = std::min(backoff_ * 2, kLastRetry);
  }

  // True while the store is off; past the retry time it is on again, to be
  // tried by the caller (a failure turns it off with a longer wait).
  bool Down() {
    if (!dead_) return false;
    if (std::chrono::steady_clock::now() < retry_at_) return true;
    dead_ = false;
    retrying_ = true;
    return false;
  }

  void Close() {
    for (Node& n : nodes_) {
      if (n.c) redisFree(n.c);
      n.c = nullptr;
    }
  }

  RedisUrl u_;
  std::string prefix_, describe_;
  int ttl_, timeout_ms_;
  WarnFn warn_;
  std::vector<Node> nodes_;       // [0]: the URL's server
  bool cluster_ = false, dead_ = false, retrying_ = false;
  static constexpr std::chrono::milliseconds kFirstRetry{2000}, kLastRetry{60000};
  std::chrono::milliseconds backoff_ = kFirstRetry;
  uint64_t epoch_ = 0;
  std::chrono::steady_clock::time_point retry_at_{};
  std::vector<size_t> slot_node_;  // cluster: slot -> node
};

}  // namespace

int redis_key_slot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  uint16_t crc = 0;  // CRC16-XMODEM: polynomial 0x1021, initial 0, not reflected
  for (const char ch : key) {
    crc = static_cast<uint16_t>(crc ^ (static_cast<uint8_t>(ch) << 8));
    for (int b = 0; b < 8; ++b) crc = static_cast<uint16_t>(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
  }
  return crc & 16383;
}

std::unique_ptr<StoreBackend> open_redis_store(const std::string& url, const StoreOptions& o, WarnFn warn) {
  return std::make_unique<RedisStore>(url, o, std::move(warn));
}

}  // namespace kvq::store
