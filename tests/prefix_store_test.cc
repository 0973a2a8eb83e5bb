// The prefix store (store/prefix_store.h): token ranges restore exactly for
// every scheme; chained keys; the memory, directory and Redis backends; and
// every fault the issue names: corrupted, truncated and foreign entries,
// a full disk, a size cap, two writers at once. Redis: prefix_store_redis_test.cc.
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
#include <thread>

#include "store/backends.h"
#include "tests/kv_cache_util.h"
#include "tests/prefix_store_util.h"
#include "tests/test_util.h"

namespace kvq::store {
namespace {

TEST(PrefixRanges, RestoreExactlyAndContinueForEveryScheme) {
  const StaticRanges r = test::Ranges(3);
  const test::Rows rows = test::MakeRows(700, 5);
  for (const std::string& s : test::Schemes()) {
    SCOPED_TRACE(s);
    KvCache probe(s, kL, 4096, kH, kD, &r);
    const int C = chunk_tokens_for(probe, 40);
    ASSERT_LE(3 * C, 700);
    const Filled f = Fill(s, r, rows, C, 3);
    // Chunks 0 and 1 restore the cache of 2C tokens, bit for bit.
    KvCache b(s, kL, 4096, kH, kD, &r);
    const std::vector<std::span<const uint8_t>> two = {f.ranges[0], f.ranges[1]};
    const std::vector<int64_t> ends = {C, 2 * C};
    b.restore_ranges(two, ends, std::span(f.ids).first(2));
    EXPECT_EQ(b.tokens(), 2 * C);
    EXPECT_TRUE(b.to_bytes() == f.whole[1]);
    // ... and continued, equal the uninterrupted cache at 3C.
    for (int t = 2 * C; t < 3 * C; ++t) {
      for (int l = 0; l < kL; ++l) b.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    }
    EXPECT_TRUE(b.to_bytes() == f.whole[2]);
    EXPECT_EQ(Attend(b, 1, 7), Attend(f.cache, 1, 7));
    // One chunk alone.
    KvCache one(s, kL, 4096, kH, kD, &r);
    const std::vector<std::span<const uint8_t>> first = {f.ranges[0]};
    one.restore_ranges(first, std::span(ends).first(1), std::span(f.ids).first(1));
    EXPECT_TRUE(one.to_bytes() == f.whole[0]);
  }
}

TEST(PrefixRanges, RowSchemesSaveAnyRangeOfWhatTheyHold) {
  const test::Rows rows = test::MakeRows(100, 2);
  KvCache a("q8_0", kL, 256, kH, kD);
  for (int t = 0; t < 100; ++t) {
    for (int l = 0; l < kL; ++l) a.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
  }
  const std::vector<uint8_t> r0 = a.range_to_bytes(0, 32, Id(0)), r1 = a.range_to_bytes(32, 64, Id(1));
  KvCache b("q8_0", kL, 256, kH, kD);
  const std::vector<std::span<const uint8_t>> parts = {r0, r1};
  const std::vector<int64_t> ends = {32, 64};
  const std::vector<Key> ids = {Id(0), Id(1)};
  b.restore_ranges(parts, ends, ids);
  EXPECT_TRUE(b.to_bytes() == a.to_bytes(64));
  // A grouped cache gives only the range ending at its length.
  const StaticRanges r = test::Ranges(1);
  KvCache g("kvq-4.5", kL, 256, kH, kD, &r);
  for (int t = 0; t < 100; ++t) {
    for (int l = 0; l < kL; ++l) g.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
  }
  EXPECT_NE(test::ErrorOf([&] { (void)g.range_to_bytes(0, 64, Id(0)); }).find("current length"), std::string::npos);
}

TEST(PrefixRanges, RefusedChunksLeaveTheCacheAsItWas) {
  const StaticRanges r = test::Ranges(3);
  const test::Rows rows = test::MakeRows(300, 5);
  const Filled f = Fill("kvq-2.5", r, rows, 96, 2);
  const Filled other = Fill("kvq-4.5", r, rows, 96, 2);
  KvCache b("kvq-2.5", kL, 4096, kH, kD, &r);
  for (int t = 0; t < 10; ++t) {
    for (int l = 0; l < kL; ++l) b.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
  }
  const std::vector<uint8_t> before = b.to_bytes();
  const std::vector<int64_t> ends = {96, 192};
  auto refuse = [&](std::vector<uint8_t> c0, std::vector<uint8_t> c1, std::vector<Key> ids, const char* want) {
    SCOPED_TRACE(want);
    const std::vector<std::span<const uint8_t>> parts = {c0, c1};
    const std::string e = test::ErrorOf([&] { b.restore_ranges(parts, ends, ids); });
    EXPECT_NE(e.find(want), std::string::npos) << e;
    EXPECT_TRUE(b.to_bytes() == before);
  };
  const std::vector<Key> ids = {f.ids[0], f.ids[1]};
  std::vector<uint8_t> flipped = f.ranges[1];
  flipped[flipped.size() / 2] ^= 0x10;
  refuse(f.ranges[0], flipped, ids, "CRC");
  refuse(f.ranges[0], std::vector<uint8_t>(f.ranges[1].begin(), f.ranges[1].end() - 7), ids, "truncated");
  refuse(f.ranges[0], f.ranges[1], {f.ids[0], Id(9)}, "another key");
  refuse(f.ranges[1], f.ranges[0], ids, "another key");
  // A range under its own key but in the wrong place.
  KvCache early("kvq-2.5", kL, 4096, kH, kD, &r);
  const std::vector<std::span<const uint8_t>> swapped = {f.ranges[1]};
  const std::vector<int64_t> end0 = {96};
  const std::vector<Key> id1 = {f.ids[1]};
  EXPECT_NE(test::ErrorOf([&] { early.restore_ranges(swapped, end0, id1); }).find("holds tokens"), std::string::npos);
  refuse(other.ranges[0], other.ranges[1], ids, "this cache is");
  // Another cache's tables (other calibrated ranges) are refused too.
  const StaticRanges r2 = test::Ranges(4);
  KvCache c("kvq-2.5", kL, 4096, kH, kD, &r2);
  const std::vector<std::span<const uint8_t>> parts = {f.ranges[0], f.ranges[1]};
  EXPECT_NE(test::ErrorOf([&] { c.restore_ranges(parts, ends, ids); }).find("tables"), std::string::npos);
  EXPECT_EQ(c.tokens(), 0);
}

TEST(PrefixKeys, ChainedOverModelSchemeTablesAndTokens) {
  const StaticRanges r = test::Ranges(3), r2 = test::Ranges(4);
  KvCache a("kvq-4.5", kL, 4096, kH, kD, &r), a2("kvq-4.5", kL, 4096, kH, kD, &r2), q("q8_0", kL, 4096, kH, kD);
  EXPECT_EQ(chunk_tokens_for(a, 256), 256);
  EXPECT_EQ(chunk_tokens_for(KvCache("kvq-2.5", kL, 4096, kH, kD, &r), 256), 288);  // groups of 96
  EXPECT_EQ(chunk_tokens_for(q, 100), 100);
  EXPECT_EQ(chunk_plan(a, 256).offset, 16);  // kvq-4.5: r16
  EXPECT_EQ(chunk_plan(q, 256).offset, 0);
  EXPECT_EQ(chunk_plan(a, 64).end(2), 16 + 3 * 64);
  std::vector<int> t(200);
  for (int i = 0; i < 200; ++i) t[static_cast<size_t>(i)] = i * 7 % 31;
  const std::vector<Key> k = chunk_keys(a, t, 64, std::nullopt);
  ASSERT_EQ(k.size(), 2u);  // full chunks only: [0, 80), [80, 144)
  EXPECT_EQ(chunk_keys(a, std::span(t).first(143), 64, std::nullopt).size(), 1u);
  EXPECT_EQ(chunk_keys(a, std::span(t).first(144), 64, std::nullopt), k);
  std::vector<int> t2 = t;
  t2[90] += 1;  // chunk 1 differs: it changes, chunk 0 does not
  const std::vector<Key> k2 = chunk_keys(a, t2, 64, std::nullopt);
  EXPECT_EQ(k2[0], k[0]);
  EXPECT_NE(k2[1], k[1]);
  std::vector<int> t3 = t;
  t3[5] += 1;  // chunk 0 differs: every key changes (the chain)
  const std::vector<Key> k3 = chunk_keys(a, t3, 64, std::nullopt);
  EXPECT_NE(k3[0], k[0]);
  EXPECT_NE(k3[1], k[1]);
  Key model{};
  model[3] = 1;
  EXPECT_NE(chunk_keys(a, t, 64, model)[0], k[0]);
  EXPECT_NE(chunk_keys(a2, t, 64, std::nullopt)[0], k[0]);  // other tables
  EXPECT_NE(chunk_keys(q, t, 64, std::nullopt)[0], k[0]);   // other scheme
  EXPECT_EQ(chunk_keys(a, t, 40, std::nullopt)[0], k[0]);   // rounded up to the same chunk
  EXPECT_NE(chunk_keys(q, t, 32, std::nullopt)[0], chunk_keys(q, t, 64, std::nullopt)[0]);  // other chunking
  std::vector<int> neg = t;
  neg[3] = -1;
  EXPECT_NE(test::ErrorOf([&] { (void)chunk_keys(a, neg, 64, std::nullopt); }).find("ids >= 0"), std::string::npos);
}

// ---- PrefixStore over a backend ------------------------------------------------

TEST(PrefixStore, MemoryBackendForRowsAndGroups) {
  Warnings w;
  for (const char* s : {"q8_0", "kvq-4.5", "kvq-2.5", "k4v4g16r5s3"}) ExerciseStore(std::string("memory:") + s, s, w);
}

fs::path TempDir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("kvq_prefix_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d;
}

int CountFiles(const fs::path& d, bool temps) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(d)) {
    const std::string name = e.path().filename();
    n += temps ? name[0] == '.' : name.ends_with(".kvqr");
  }
  return n;
}

TEST(PrefixStore, DirectoryBackend) {
  Warnings w;
  const fs::path d = TempDir("dir");
  for (const char* s : {"q8_0", "kvq-4.5"}) ExerciseStore((d / s).string(), s, w);
  EXPECT_EQ(CountFiles(d / "kvq-4.5", true), 0);  // no temporary file left
  fs::remove_all(d);
}

TEST(PrefixStore, DirectorySizeCapEvictsTheLeastRecentlyUsed) {
  Warnings w;
  const fs::path d = TempDir("cap");
  const StaticRanges r = test::Ranges(3);
  const test::Rows rows = test::MakeRows(700, 5);
  uint64_t chunk_bytes = 0;
  {
    PrefixStore probe((d / "probe").string(), w.Options(64));
    KvCache c("kvq-4.5", kL, 4096, kH, kD, &r);
    const std::vector<int> t = Tokens(80);
    for (int i = 0; i < 80; ++i) {
      for (int l = 0; l < kL; ++l) c.write(l, i, rows.k[static_cast<size_t>(i)], rows.v[static_cast<size_t>(i)]);
    }
    probe.put(t, c, &chunk_bytes);
  }
  ASSERT_GT(chunk_bytes, 0u);
  StoreOptions o = w.Options(64);
  o.max_bytes = chunk_bytes * 5 / 2;  // room for two chunk-0 entries of about that size
  PrefixStore s((d / "s").string(), o);
  // Four prompts, one chunk each; the first is read again before the last is put.
  std::vector<std::vector<int>> prompts;
  for (int p = 0; p < 4; ++p) prompts.push_back(Tokens(80, p + 1));
  auto put = [&](int p) {
    KvCache c("kvq-4.5", kL, 4096, kH, kD, &r);
    FillAndPut(s, c, rows, prompts[static_cast<size_t>(p)], 0, 80);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // distinct mtimes
  };
  put(0), put(1);
  KvCache c0("kvq-4.5", kL, 4096, kH, kD, &r);
  EXPECT_EQ(s.longest_prefix(prompts[0], c0), 80);  // chunk 0: the offset 16 (r16) and 64  // 0 is now more recent than 1
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  put(2);
  EXPECT_LE(CountFiles(d / "s", false), 2);
  auto has = [&](int p) {
    KvCache c("kvq-4.5", kL, 4096, kH, kD, &r);
    return s.longest_prefix(prompts[static_cast<size_t>(p)], c) == 80;
  };
  EXPECT_FALSE(has(1));  // the least recently used went first
  EXPECT_TRUE(has(2));
  EXPECT_TRUE(has(0));
  fs::remove_all(d);
}

// A cap smaller than one prompt's chunks keeps the chain's first chunks
// (usable: the next run restores them) and stops extending it, rather than
// keeping its tails (unusable) and rewriting every chunk on every run.
TEST(PrefixStore, ASizeCapKeepsAChainsHeadAndStopsWritingItsTail) {
  Warnings w;
  const fs::path d = TempDir("head");
  const test::Rows rows = test::MakeRows(400, 5);
  const std::vector<int> tok = Tokens(320);
  KvCache c("q8_0", kL, 4096, kH, kD);
  WriteRows(c, rows, 0, 320);
  uint64_t chunk_bytes = 0;
  {
    PrefixStore probe("memory:head-probe", w.Options(64));
    ASSERT_EQ(probe.put(tok, c, &chunk_bytes), 5);
    chunk_bytes /= 5;  // a row scheme's chunks are all one size
  }
  StoreOptions o = w.Options(64);
  o.max_bytes = chunk_bytes * 5 / 2;
  for (int run = 0; run < 3; ++run) {
    SCOPED_TRACE(run);
    PrefixStore s(d.string(), o);
    KvCache warm("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(s.longest_prefix(tok, warm), run == 0 ? 0 : 128);  // chunks 0 and 1
    // Run 0 keeps chunks 0 and 1; chunk 2 is evicted as soon as written
    // (the chain's oldest), and 3 and 4 are not written.
    EXPECT_EQ(s.put(tok, c), run == 0 ? 2 : 0);
    EXPECT_EQ(CountFiles(d, false), 2);
    EXPECT_EQ(s.put(tok, c), 0) << "the chain is not extended again";
  }
  EXPECT_TRUE(w.lines.empty());
  fs::remove_all(d);
}

// memory: (kvq serve's conversations) under --prompt-cache-max-mb: the
// directory's rules, least recently used first, a chain's head kept.
TEST(PrefixStore, MemorySizeCapEvictsTheLeastRecentlyUsedAndKeepsAChainsHead) {
  Warnings w;
  const StaticRanges r = test::Ranges(3);
  const test::Rows rows = test::MakeRows(700, 5);
  uint64_t chunk_bytes = 0;
  {
    PrefixStore probe("memory:cap-probe", w.Options(64));
    KvCache c("kvq-4.5", kL, 4096, kH, kD, &r);
    const std::vector<int> t = Tokens(80);
    for (int i = 0; i < 80; ++i) {
      for (int l = 0; l < kL; ++l) c.write(l, i, rows.k[static_cast<size_t>(i)], rows.v[static_cast<size_t>(i)]);
    }
    probe.put(t, c, &chunk_bytes);
  }
  ASSERT_GT(chunk_bytes, 0u);
  StoreOptions o = w.Options(64);
  o.max_bytes = chunk_bytes * 5 / 2;
  PrefixStore s("memory:cap-lru", o);
  std::vector<std::vector<int>> prompts;
  for (int p = 0; p < 4; ++p) prompts.push_back(Tokens(80, p + 1));
  auto put = [&](int p) {
    KvCache c("kvq-4.5", kL, 4096, kH, kD, &r);
    FillAndPut(s, c, rows, prompts[static_cast<size_t>(p)], 0, 80);
  };
  auto has = [&](int p) {
    KvCache c("kvq-4.5", kL, 4096, kH, kD, &r);
    return s.longest_prefix(prompts[static_cast<size_t>(p)], c) == 80;
  };
  put(0), put(1);
  EXPECT_TRUE(has(0));  // 0 is now more recent than 1
  put(2);
  EXPECT_FALSE(has(1));
  EXPECT_TRUE(has(2));
  EXPECT_TRUE(has(0));

  const std::vector<int> tok = Tokens(320, 9);
  KvCache c("q8_0", kL, 4096, kH, kD);
  WriteRows(c, rows, 0, 320);
  uint64_t all = 0;
  {
    PrefixStore probe("memory:cap-probe2", w.Options(64));
    ASSERT_EQ(probe.put(tok, c, &all), 5);
  }
  StoreOptions h = w.Options(64);
  h.max_bytes = all / 5 * 5 / 2;
  for (int run = 0; run < 3; ++run) {
    SCOPED_TRACE(run);
    PrefixStore m("memory:cap-head", h);
    KvCache warm("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(m.longest_prefix(tok, warm), run == 0 ? 0 : 128);  // chunks 0 and 1
    EXPECT_EQ(m.put(tok, c), run == 0 ? 2 : 0);
    EXPECT_EQ(m.put(tok, c), 0) << "the chain is not extended again";
  }
  // A chunk larger than the whole cap is not kept.
  StoreOptions tiny = w.Options(64);
  tiny.max_bytes = 16;
  PrefixStore t("memory:cap-tiny", tiny);
  EXPECT_EQ(t.put(tok, c), 0);
  KvCache none("q8_0", kL, 4096, kH, kD);
  EXPECT_EQ(t.longest_prefix(tok, none), 0);
  EXPECT_TRUE(w.lines.empty());
}

// A capped store does not rescan its directory on every write: 5 chunks
// into a directory of 3,000 entries scan it once.
TEST(PrefixStore, ASizeCapDoesNotRescanTheDirectoryPerWrite) {
  Warnings w;
  const fs::path d = TempDir("scan");
  fs::create_directories(d);
  for (int i = 0; i < 3000; ++i) std::ofstream(d / ("other" + std::to_string(i)));
  const test::Rows rows = test::MakeRows(400, 5);
  const std::vector<int> tok = Tokens(320);
  KvCache c("q8_0", kL, 4096, kH, kD);
  StoreOptions o = w.Options(64);
  o.max_bytes = uint64_t{1} << 30;
  PrefixStore s(d.string(), o);
  const uint64_t before = dir_store_scans.load();
  FillAndPut(s, c, rows, tok, 0, 320);
  EXPECT_EQ(CountFiles(d, false), 5);
  EXPECT_EQ(dir_store_scans.load() - before, 1u);
  EXPECT_TRUE(w.lines.empty());
  fs::remove_all(d);
}

// An entry larger than any chunk of the cache is refused by its size, never
// read; a smaller foreign one by its content.
TEST(PrefixStore, ForeignEntriesAreRefusedBySizeOrContent) {
  Warnings w;
  const fs::path d = TempDir("foreign");
  const test::Rows rows = test::MakeRows(100, 5);
  const std::vector<int> tok = Tokens(64);
  KvCache c("q8_0", kL, 4096, kH, kD);
  WriteRows(c, rows, 0, 64);
  PrefixStore s(d.string(), w.Options(64));
  ASSERT_EQ(s.put(tok, c), 1);
  const std::vector<Key> keys = chunk_keys(c, tok, 64, std::nullopt);
  const fs::path entry = d / (key_hex(keys[0]) + ".kvqr");
  // Larger than any chunk of this cache (a sparse 3 GiB file): refused by
  // its size, never read. Within that bound, zeros, or a KVQR header that
  // declares less than the file holds. Each a miss with one warning.
  std::vector<uint8_t> good_head = *s.backend().get(keys)[0];
  good_head.resize(20);
  const uint64_t most = max_chunk_bytes(c, 64);
  for (const auto& [size, why] : std::vector<std::pair<uint64_t, std::string>>{
           {uint64_t{3} << 30, "more than the " + std::to_string(most)}, {most / 2, "magic"}, {most / 2, "trailing bytes"}}) {
    SCOPED_TRACE(why);
    {
      std::vector<uint8_t> head = good_head;
      if (why == "magic") head.assign(20, 0);
      std::ofstream f(entry, std::ios::binary | std::ios::trunc);
      f.write(reinterpret_cast<const char*>(head.data()), 20);
    }
    fs::resize_file(entry, size);
    w.lines.clear();
    KvCache m("q8_0", kL, 4096, kH, kD);
    EXPECT_EQ(s.longest_prefix(tok, m), 0);
    ASSERT_EQ(w.lines.size(), 1u);
    EXPECT_NE(w.lines[0].find(why), std::string::npos) << w.lines[0];
  }
  fs::remove_all(d);
}

TEST(PrefixStore, AFullDiskLeavesNoPartialFile) {
  const fs::path d = TempDir("full");
  fs::create_directories(d);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // a file size limit: writes past 4 KiB fail as on a full disk
    ::signal(SIGXFSZ, SIG_IGN);
    const struct rlimit lim = {4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    int warned = 0;
    StoreOptions o;
    o.chunk_tokens = 64;
    o.warn = [&](const std::string& s) { warned += s.find("cannot store") != std::string::npos; };
    PrefixStore s(d.string(), o);
    const StaticRanges r = test::Ranges(3);
    const test::Rows rows = test::MakeRows(192, 5);
    KvCache c("q8_0", kL, 4096, kH, kD);
    FillAndPut(s, c, rows, Tokens(192), 0, 192);  // three chunks: one warning, then no more writes
    std::_Exit(warned == 1 && !s.backend().writable() ? 0 : 3);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "expected one 'cannot store' warning, then a store that does not write";
  EXPECT_EQ(CountFiles(d, false) + CountFiles(d, true), 0);
  fs::remove_all(d);
}

TEST(PrefixStore, TwoProcessesFillingOneDirectoryLoseNothing) {
  const fs::path d = TempDir("two");
  const StaticRanges r = test::Ranges(3);
  const test::Rows rows = test::MakeRows(700, 5);
  // Both fill the same six prompts (three chunks each), in opposite orders.
  std::vector<pid_t> pids;
  for (int who = 0; who < 2; ++who) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      StoreOptions o;
      o.chunk_tokens = 64;
      PrefixStore s(d.string(), o);
      for (int i = 0; i < 6; ++i) {
        const int p = who == 0 ? i : 5 - i;
        KvCache c("kvq-4.5", kL, 4096, kH, kD, &r);
        FillAndPut(s, c, rows, Tokens(208, p), 0, 208);
      }
      std::_Exit(0);
    }
    pids.push_back(pid);
  }
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  Warnings w;
  PrefixStore s(d.string(), w.Options(64));
  for (int p = 0; p < 6; ++p) {
    KvCache c("kvq-4.5", kL, 4096, kH, kD, &r), ref("kvq-4.5", kL, 4096, kH, kD, &r);
    EXPECT_EQ(s.longest_prefix(Tokens(208, p), c), 208);  // 16 + 3 x 64
    for (int t = 0; t < 208; ++t) {
      for (int l = 0; l < kL; ++l) ref.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    }
    EXPECT_TRUE(c.to_bytes() == ref.to_bytes());
  }
  EXPECT_TRUE(w.lines.empty());
  EXPECT_EQ(CountFiles(d, true), 0);
  fs::remove_all(d);
}

TEST(PrefixStore, BadUrlsAndOptionsAreErrors) {
  StoreOptions o;
  EXPECT_NE(test::ErrorOf([&] { PrefixStore("http://x", o); }).find("unsupported URL"), std::string::npos);
  EXPECT_NE(test::ErrorOf([&] { PrefixStore("redis://host:99999", o); }).find("port"), std::string::npos);
  EXPECT_NE(test::ErrorOf([&] { PrefixStore("redis://:6379", o); }).find("no host"), std::string::npos);
  EXPECT_NE(test::ErrorOf([&] { PrefixStore("redis://h/x", o); }).find("database"), std::string::npos);
  // No message holds a URL's password, whatever the URL's shape.
  for (const char* url : {"rediss://u:S3CRET@h:1", "REDIS://u:S3CRET@h:x", "redis+tls://u:S3CRET@h", "unix://u:S3CRET@/s",
                          "redis://:S3CRET", "redis://default:S3CRET", "Redis://u:S3CRET@h/S3CRET", "x://S3CRET"}) {
    const std::string said = test::ErrorOf([&] { PrefixStore(url, o); });
    EXPECT_NE(said, "<no error>") << url;
    EXPECT_EQ(said.find("S3CRET"), std::string::npos) << url << ": " << said;
  }
  o.chunk_tokens = 0;
  EXPECT_NE(test::ErrorOf([&] { PrefixStore("memory:", o); }).find("chunk_tokens"), std::string::npos);
}

}  // namespace
}  // namespace kvq::store
