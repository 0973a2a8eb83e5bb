// The prefix store on Redis (store/redis_store.cc): real servers started on
// loopback (one, a three-master cluster), fake ones that stay silent,
// trickle or drop the connection, refused connections, keys of other types
// and passwords never printed.
#include "store/prefix_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include "store/backends.h"
#include "tests/kv_cache_util.h"
#include "tests/prefix_store_util.h"
#include "tests/test_util.h"

namespace kvq::store {
namespace {

// ---- Redis ----------------------------------------------------------------------

bool HaveRedis() { return std::system("command -v redis-server >/dev/null 2>&1") == 0; }

bool Required() {
  const char* req = std::getenv("KVQ_REQUIRE_DATA");
  const char* ci = std::getenv("CI");
  return (req && std::string(req) == "1") || (ci && std::string(ci) == "true");
}

#define KVQ_NEED_REDIS()                                                                              \
  do {                                                                                                \
    if (!HaveRedis()) {                                                                               \
      if (Required()) FAIL() << "redis-server is not installed (scripts/install_deps.sh installs it)"; \
      GTEST_SKIP() << "redis-server is not installed (scripts/install_deps.sh installs it)";          \
    }                                                                                                 \
  } while (0)

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

bool CanConnect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// redis-server on 127.0.0.1 at a free port, no persistence; killed at the end.
class RedisServer {
 public:
  explicit RedisServer(std::vector<std::string> extra = {}, int port = 0) : port_(port ? port : FreePort()) {
    pid_ = ::fork();
    if (pid_ == 0) {
      std::vector<std::string> args = {"redis-server", "--port", std::to_string(port_), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no", "--logfile", "/dev/null"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp("redis-server", argv.data());
      std::_Exit(127);
    }
    for (int i = 0; i < 200 && !CanConnect(port_); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ~RedisServer() { Kill(); }
  void Kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  bool up() const { return CanConnect(port_); }

 private:
  int port_;
  pid_t pid_ = -1;
};

TEST(PrefixStoreRedis, RoundTripsAndRefusesBadEntries) {
  KVQ_NEED_REDIS();
  RedisServer srv;
  ASSERT_TRUE(srv.up());
  Warnings w;
  for (const char* s : {"q8_0", "kvq-2.5"}) ExerciseStore(srv.url() + "/3", s, w);
  // Key prefix and expiry as configured.
  StoreOptions o = w.Options(64);
  o.key_prefix = "test:";
  o.ttl_seconds = 100;
  PrefixStore s(srv.url(), o);
  KvCache c("q8_0", kL, 4096, kH, kD);
  const test::Rows rows = test::MakeRows(64, 1);
  FillAndPut(s, c, rows, Tokens(64), 0, 64);
  const std::string key = "test:" + hex_digest(chunk_keys(c, Tokens(64), 64, std::nullopt)[0]);
  FILE* p = ::popen(("redis-cli -p " + std::to_string(srv.port()) + " TTL " + key).c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[64] = {0};
  ASSERT_NE(std::fgets(buf, sizeof buf, p), nullptr);
  ::pclose(p);
  const int ttl = std::atoi(buf);
  EXPECT_GT(ttl, 90);
  EXPECT_LE(ttl, 100);
}

std::string RedisCli(int port, const std::string& args) {
  FILE* p = ::popen(("redis-cli -p " + std::to_string(port) + " " + args + " 2>&1").c_str(), "r");
  std::string out;
  char buf[256];
  while (p && std::fgets(buf, sizeof buf, p)) out += buf;
  if (p) ::pclose(p);
  return out;
}

// A key of another type under a chunk's key is one unusable entry (a
// warning), overwritten by the next put; the store stays up.
TEST(PrefixStoreRedis, AKeyOfAnotherTypeIsOverwritten) {
  KVQ_NEED_REDIS();
  RedisServer srv;
  ASSERT_TRUE(srv.up());
  const test::Rows rows = test::MakeRows(70, 1);
  const std::vector<int> tok = Tokens(70);
  KvCache probe("q8_0", kL, 4096, kH, kD);
  const std::string key = "kvq:prefix:" + hex_digest(chunk_keys(probe, tok, 64, std::nullopt)[0]);
  for (const char* type : {"RPUSH %s a", "HSET %s f v", "SADD %s m", "ZADD %s 1 m", "XADD %s '*' f v"}) {
    SCOPED_TRACE(type);
    char cmd[256];
    std::snprintf(cmd, sizeof cmd, type, key.c_str());
    RedisCli(srv.port(), "DEL " + key);
    RedisCli(srv.port(), cmd);
    Warnings w;
    PrefixStore s(srv.url(), w.Options(64));
    KvCache c("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(s.longest_prefix(tok, c), 0);
    ASSERT_EQ(w.lines.size(), 1u);
    EXPECT_NE(w.lines[0].find("not a stored value"), std::string::npos) << w.lines[0];
    EXPECT_TRUE(s.backend().alive());
    FillAndPut(s, c, rows, tok, 0, 70);
    KvCache d("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(s.longest_prefix(tok, d), 64);
    EXPECT_EQ(w.lines.size(), 1u);
  }
}

// Redis's key slots (the cluster specification's examples).
TEST(PrefixStoreRedisCluster, KeySlotsAreRedisCrc16) {
  EXPECT_EQ(redis_key_slot("123456789"), 0x31C3 & 16383);  // CRC16-XMODEM check value
  EXPECT_EQ(redis_key_slot("foo"), 12182);
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("user1000"));
  EXPECT_EQ(redis_key_slot("foo{}{bar}"), redis_key_slot("foo{}{bar}"));  // empty tag: the whole key
  EXPECT_NE(redis_key_slot("foo{}{bar}"), redis_key_slot("bar"));
  EXPECT_EQ(redis_key_slot("foo{{bar}}zap"), redis_key_slot("{bar"));
}

// Three masters on loopback ports (their bus ports, +10000, free too),
// joined by redis-cli --cluster create.
class RedisCluster {
 public:
  RedisCluster() : dir_(fs::temp_directory_path() / ("kvq_cluster_" + std::to_string(::getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::string create = "redis-cli --cluster create";
    for (int i = 0; i < 3; ++i) {
      int port = 0;
      for (int tries = 0; tries < 100 && !port; ++tries) {
        const int p = FreePort();
        if (p <= 55535 && !CanConnect(p + 10000)) port = p;
      }
      nodes_.push_back(std::make_unique<RedisServer>(
          std::vector<std::string>{"--cluster-enabled", "yes", "--cluster-config-file",
                                   (dir_ / ("nodes-" + std::to_string(port) + ".conf")).string(),
                                   "--cluster-node-timeout", "2000", "--dir", dir_.string()},
          port));
      create += " 127.0.0.1:" + std::to_string(port);
    }
    create += " --cluster-replicas 0 --cluster-yes >/dev/null 2>&1";
    ok_ = up() && std::system(create.c_str()) == 0;
    for (int i = 0; ok_ && i < 200 && !Ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ok_ = ok_ && Ready();
  }
  ~RedisCluster() {
    nodes_.clear();
    fs::remove_all(dir_);
  }
  bool ok() const { return ok_; }
  bool up() const {
    for (const auto& n : nodes_) {
      if (!n->up()) return false;
    }
    return true;
  }
  RedisServer& node(int i) { return *nodes_[static_cast<size_t>(i)]; }
  std::string url() const { return nodes_[0]->url(); }

 private:
  bool Ready() const {
    for (const auto& n : nodes_) {
      if (RedisCli(n->port(), "CLUSTER INFO").find("cluster_state:ok") == std::string::npos) return false;
    }
    return true;
  }
  fs::path dir_;
  std::vector<std::unique_ptr<RedisServer>> nodes_;
  bool ok_ = false;
};

int DbSize(int port) { return std::atoi(RedisCli(port, "DBSIZE").c_str()); }

// Chunks spread over three masters: stored and restored exactly; a slot
// moved after the store read the map is followed (MOVED); a node killed
// mid-run is one warning and a miss.
TEST(PrefixStoreRedisCluster, ChunksSpreadOverThreeMastersAndSurviveAMovedSlotAndADeadNode) {
  KVQ_NEED_REDIS();
  RedisCluster cluster;
  ASSERT_TRUE(cluster.ok()) << "could not start a 3-master cluster";
  const test::Rows rows = test::MakeRows(200, 3);
  const std::vector<int> tok = Tokens(200);
  KvCache c("q8_0", kL, 4096, kH, kD);
  WriteRows(c, rows, 0, 192);
  const std::vector<Key> keys = chunk_keys(c, tok, 16, std::nullopt);  // 12 chunks of 16 tokens
  ASSERT_EQ(keys.size(), 12u);
  Warnings w;
  PrefixStore s(cluster.url(), w.Options(16));
  EXPECT_NE(s.backend().describe().find("(cluster)"), std::string::npos) << s.backend().describe();
  // Move chunk 0's slot (empty) to another master behind the store's back.
  const std::string key0 = "kvq:prefix:" + key_hex(keys[0]);
  const int slot = redis_key_slot(key0);
  int owner = -1;
  for (int i = 0; i < 3; ++i) {
    if (RedisCli(cluster.node(i).port(), "CLUSTER COUNTKEYSINSLOT " + std::to_string(slot)).find("0") == 0 &&
        RedisCli(cluster.node(i).port(), "GET " + key0).find("MOVED") == std::string::npos) {
      owner = i;
    }
  }
  ASSERT_GE(owner, 0);
  const int target = (owner + 1) % 3;
  std::string id = RedisCli(cluster.node(target).port(), "CLUSTER MYID");
  id.erase(id.find_last_not_of("\r\n") + 1);
  for (int i = 0; i < 3; ++i) {
    RedisCli(cluster.node(i).port(), "CLUSTER SETSLOT " + std::to_string(slot) + " NODE " + id);
  }
  EXPECT_NE(RedisCli(cluster.node(owner).port(), "GET " + key0).find("MOVED"), std::string::npos);
  EXPECT_EQ(s.put(tok, c), 12);
  EXPECT_TRUE(w.lines.empty()) << w.lines[0];
  for (int i = 0; i < 3; ++i) EXPECT_GT(DbSize(cluster.node(i).port()), 0) << "node " << i;
  EXPECT_EQ(DbSize(cluster.node(0).port()) + DbSize(cluster.node(1).port()) + DbSize(cluster.node(2).port()), 12);
  EXPECT_EQ(RedisCli(cluster.node(target).port(), "EXISTS " + key0).find("1"), 0u);
  // A fresh store (a fresh slot map) restores all twelve, bit for bit.
  {
    PrefixStore again(cluster.url(), w.Options(16));
    KvCache d("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(again.longest_prefix(tok, d), 192);
    EXPECT_TRUE(d.to_bytes() == c.to_bytes(192));
    EXPECT_TRUE(w.lines.empty());
  }
  // A master killed mid-run: one warning, a miss, and the store stays quiet.
  cluster.node(2).Kill();
  KvCache e("q8_0", kL, 4096, kH, kD);
  EXPECT_EQ(s.longest_prefix(tok, e), 0);
  EXPECT_EQ(e.tokens(), 0);
  ASSERT_EQ(w.lines.size(), 1u);
  EXPECT_NE(w.lines[0].find("continuing without the store"), std::string::npos) << w.lines[0];
  EXPECT_EQ(s.put(tok, c), 0);
  EXPECT_EQ(w.lines.size(), 1u);
}

TEST(PrefixStoreRedis, ARefusedConnectionIsAWarningAndAnEmptyStore) {
  Warnings w;
  const int port = FreePort();  // nothing listens there
  const auto t0 = std::chrono::steady_clock::now();
  PrefixStore s("redis://127.0.0.1:" + std::to_string(port), w.Options(64));
  EXPECT_FALSE(s.backend().alive());
  ASSERT_EQ(w.lines.size(), 1u);
  EXPECT_NE(w.lines[0].find("cannot connect"), std::string::npos) << w.lines[0];
  EXPECT_NE(w.lines[0].find("continuing without the store"), std::string::npos);
  KvCache c("q8_0", kL, 4096, kH, kD);
  FillAndPut(s, c, test::MakeRows(70, 1), Tokens(70), 0, 70);
  EXPECT_EQ(s.longest_prefix(Tokens(70), c), 0);
  EXPECT_EQ(w.lines.size(), 1u);  // once
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
}

// What a standalone server answers to the store's first command (CLUSTER SLOTS).
const std::string kNoCluster = "-ERR This instance has cluster support disabled\r\n";

// A fake server on a free port: accepts, reads a request, then does what
// `reply` says (nothing: a silent server; or writes bytes and closes).
class FakeServer {
 public:
  // trickle_ms > 0: after its first line, the reply goes out one byte at a
  // time, that far apart.
  explicit FakeServer(std::string reply, bool close_after, int trickle_ms = 0)
      : reply_(std::move(reply)), close_(close_after), trickle_ms_(trickle_ms) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t n = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &n);
    port_ = ntohs(a.sin_port);
    ::listen(fd_, 4);
    th_ = std::thread([this] {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      char buf[4096];
      (void)::read(c, buf, sizeof buf);
      if (trickle_ms_ > 0) {
        const size_t first = reply_.find("\r\n") + 2;  // the first reply at once
        (void)::write(c, reply_.data(), first);
        for (size_t i = first; i < reply_.size() && !stop_; ++i) {
          if (::send(c, reply_.data() + i, 1, MSG_NOSIGNAL) != 1) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(trickle_ms_));
        }
      } else if (!reply_.empty()) {
        (void)::write(c, reply_.data(), reply_.size());
      }
      if (close_) {
        ::close(c);
      } else {
        while (!stop_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        ::close(c);
      }
    });
  }
  ~FakeServer() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    th_.join();
  }
  int port() const { return port_; }

 private:
  std::string reply_;
  bool close_;
  int trickle_ms_;
  int fd_, port_;
  std::atomic<bool> stop_{false};
  std::thread th_;
};

TEST(PrefixStoreRedis, ASilentServerTimesOutWithinASecond) {
  Warnings w;
  FakeServer fake("", /*close_after=*/false);
  StoreOptions o = w.Options(64);
  PrefixStore s("redis://127.0.0.1:" + std::to_string(fake.port()), o);
  KvCache c("q8_0", kL, 4096, kH, kD);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(s.longest_prefix(Tokens(70), c), 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 2.0);
  ASSERT_EQ(w.lines.size(), 1u);
  EXPECT_NE(w.lines[0].find("no reply within the timeout"), std::string::npos) << w.lines[0];
  EXPECT_FALSE(s.backend().alive());
}

// A server that answers one byte every 40 ms never lets a single recv
// time out; the operation's deadline (timeout 300 ms) still ends it.
TEST(PrefixStoreRedis, ATricklingServerMeetsTheOperationsDeadline) {
  Warnings w;
  FakeServer fake(kNoCluster + ":100\r\n$100\r\n" + std::string(100, 'x') + "\r\n", /*close_after=*/false,
                  /*trickle_ms=*/40);
  StoreOptions o = w.Options(64);
  o.timeout_ms = 300;
  PrefixStore s("redis://127.0.0.1:" + std::to_string(fake.port()), o);
  KvCache c("q8_0", kL, 4096, kH, kD);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(s.longest_prefix(Tokens(70), c), 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 1.5) << "the whole reply takes 4.5 s to trickle";
  ASSERT_EQ(w.lines.size(), 1u);
  EXPECT_NE(w.lines[0].find("no reply within the timeout"), std::string::npos) << w.lines[0];
  EXPECT_FALSE(s.backend().alive());
}

TEST(PrefixStoreRedis, AConnectionDroppedMidTransferIsAMiss) {
  Warnings w;
  // STRLEN says 1 byte, then GET's reply announces 10^6 bytes and the server hangs up after 3.
  FakeServer fake(kNoCluster + ":1\r\n$1000000\r\nabc", /*close_after=*/true);
  PrefixStore s("redis://127.0.0.1:" + std::to_string(fake.port()), w.Options(64));
  KvCache c("q8_0", kL, 4096, kH, kD);
  EXPECT_EQ(s.longest_prefix(Tokens(70), c), 0);
  ASSERT_EQ(w.lines.size(), 1u);
  EXPECT_NE(w.lines[0].find("connection lost"), std::string::npos) << w.lines[0];
  EXPECT_EQ(c.tokens(), 0);
}

TEST(PrefixStoreRedis, AServerKilledMidRunIsAWarningAndTheRunGoesOn) {
  KVQ_NEED_REDIS();
  RedisServer srv;
  ASSERT_TRUE(srv.up());
  Warnings w;
  PrefixStore s(srv.url(), w.Options(64));
  const test::Rows rows = test::MakeRows(200, 1);
  KvCache c("q8_0", kL, 4096, kH, kD);
  const std::vector<int> tok = Tokens(200);
  FillAndPut(s, c, rows, tok, 0, 100);
  srv.Kill();
  FillAndPut(s, c, rows, tok, 100, 200);  // puts fail: one warning
  ASSERT_EQ(w.lines.size(), 1u);
  EXPECT_NE(w.lines[0].find("connection lost"), std::string::npos) << w.lines[0];
  KvCache d("q8_0", kL, 4096, kH, kD);
  EXPECT_EQ(s.longest_prefix(tok, d), 0);
  EXPECT_EQ(w.lines.size(), 1u);
}

// A Redis that goes away and comes back (a restart, a stall past the
// timeout) turns the store off for a while, not for the process's life:
// after the retry time (2 s after the first failure) the next operation
// reconnects, says so once, and the store serves again.
TEST(PrefixStoreRedis, AServerThatComesBackIsUsedAgain) {
  KVQ_NEED_REDIS();
  auto srv = std::make_unique<RedisServer>();
  ASSERT_TRUE(srv->up());
  const int port = srv->port();
  Warnings w;
  PrefixStore s(srv->url(), w.Options(64));
  const test::Rows rows = test::MakeRows(200, 1);
  const std::vector<int> tok = Tokens(200);
  KvCache c("q8_0", kL, 4096, kH, kD);
  FillAndPut(s, c, rows, tok, 0, 100);
  srv.reset();  // killed
  KvCache d("q8_0", kL, 4096, kH, kD);
  EXPECT_EQ(s.longest_prefix(tok, d), 0);
  EXPECT_FALSE(s.backend().alive());
  ASSERT_EQ(w.lines.size(), 1u);
  EXPECT_NE(w.lines[0].find("retrying"), std::string::npos) << w.lines[0];
  srv = std::make_unique<RedisServer>(std::vector<std::string>{}, port);  // back, empty
  ASSERT_TRUE(srv->up());
  KvCache e("q8_0", kL, 4096, kH, kD);
  EXPECT_EQ(s.longest_prefix(tok, e), 0);  // still within the retry time: a miss, no traffic
  std::this_thread::sleep_for(std::chrono::milliseconds(2300));
  EXPECT_TRUE(s.backend().alive());
  KvCache f("q8_0", kL, 4096, kH, kD);
  FillAndPut(s, f, rows, tok, 0, 200);  // reconnects and stores
  ASSERT_EQ(w.lines.size(), 2u);
  EXPECT_NE(w.lines[1].find("reconnected"), std::string::npos) << w.lines[1];
  KvCache g("q8_0", kL, 4096, kH, kD);
  EXPECT_EQ(s.longest_prefix(tok, g), 192);
  EXPECT_TRUE(s.backend().alive());
}

TEST(PrefixStoreRedis, PasswordsAreSentAndNeverPrinted) {
  KVQ_NEED_REDIS();
  RedisServer srv({"--requirepass", "s3cret-Pw"});
  ASSERT_TRUE(srv.up());
  const test::Rows rows = test::MakeRows(70, 1);
  {  // the right password in the URL
    Warnings w;
    PrefixStore s("redis://:s3cret-Pw@127.0.0.1:" + std::to_string(srv.port()), w.Options(64));
    EXPECT_TRUE(s.backend().alive());
    EXPECT_EQ(s.backend().describe().find("s3cret"), std::string::npos);
    KvCache c("q8_0", kL, 4096, kH, kD);
    FillAndPut(s, c, rows, Tokens(70), 0, 70);
    KvCache d("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(s.longest_prefix(Tokens(70), d), 64);
    EXPECT_TRUE(w.lines.empty());
  }
  {  // a wrong one: a clear warning without either password
    Warnings w;
    PrefixStore s("redis://default:wrong-Pw@127.0.0.1:" + std::to_string(srv.port()), w.Options(64));
    EXPECT_FALSE(s.backend().alive());
    ASSERT_EQ(w.lines.size(), 1u);
    EXPECT_NE(w.lines[0].find("AUTH refused"), std::string::npos) << w.lines[0];
    EXPECT_EQ(w.lines[0].find("wrong-Pw"), std::string::npos) << w.lines[0];
    EXPECT_EQ(w.lines[0].find("s3cret"), std::string::npos) << w.lines[0];
  }
  {  // none: NOAUTH on the first command
    Warnings w;
    ::unsetenv("KVQ_REDIS_PASSWORD");
    PrefixStore s(srv.url(), w.Options(64));
    KvCache d("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(s.longest_prefix(Tokens(70), d), 0);
    ASSERT_EQ(w.lines.size(), 1u);
    EXPECT_NE(w.lines[0].find("NOAUTH"), std::string::npos) << w.lines[0];
  }
  {  // from KVQ_REDIS_PASSWORD
    Warnings w;
    ::setenv("KVQ_REDIS_PASSWORD", "s3cret-Pw", 1);
    PrefixStore s(srv.url(), w.Options(64));
    ::unsetenv("KVQ_REDIS_PASSWORD");
    KvCache d("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(s.longest_prefix(Tokens(70), d), 64);
    EXPECT_TRUE(w.lines.empty());
    EXPECT_NE(s.backend().describe().find(":***@"), std::string::npos) << s.backend().describe();
  }
}

}  // namespace
}  // namespace kvq::store
