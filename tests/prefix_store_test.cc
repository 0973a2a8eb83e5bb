// The prefix store (store/prefix_store.h): token ranges restore exactly for
// every scheme; chained keys; the memory, directory and Redis backends; and
// every fault the issue names: corrupted, truncated and foreign entries,
// a full disk, a size cap, two writers at once, a refused, silent, dying or
// password-protected Redis (a real redis-server on 127.0.0.1, started here).
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
#include "tests/test_util.h"

namespace kvq::store {
namespace {

namespace fs = std::filesystem;
using test::kE;
using test::kL;
using test::kH;
using test::kD;

struct Filled {
  KvCache cache;
  std::vector<std::vector<uint8_t>> ranges;  // [iC, (i+1)C) saved as the cache reached (i+1)C
  std::vector<std::vector<uint8_t>> whole;   // to_bytes at (i+1)C
  std::vector<Key> ids;
};

Key Id(int i) {
  Key k{};
  k[0] = static_cast<uint8_t>(i + 1);
  return k;
}

Filled Fill(const std::string& scheme, const StaticRanges& r, const test::Rows& rows, int C, int chunks) {
  Filled f{KvCache(scheme, kL, 4096, kH, kD, &r), {}, {}, {}};
  for (int t = 0; t < C * chunks; ++t) {
    for (int l = 0; l < kL; ++l) f.cache.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    if ((t + 1) % C == 0) {
      const int i = (t + 1) / C - 1;
      f.ids.push_back(Id(i));
      f.ranges.push_back(f.cache.range_to_bytes(static_cast<int64_t>(i) * C, -1, f.ids.back()));
      f.whole.push_back(f.cache.to_bytes());
    }
  }
  return f;
}

std::vector<float> Attend(const KvCache& c, int layer, uint64_t seed) {
  test::Rng rng(seed);
  std::vector<float> q(2 * kE), out(2 * kE);
  for (float& x : q) x = static_cast<float>(rng.Gaussian());
  c.attend(layer, q, 2 * kH, out);
  return out;
}

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

struct Warnings {
  std::vector<std::string> lines;
  StoreOptions Options(int chunk = 64) {
    StoreOptions o;
    o.chunk_tokens = chunk;
    o.warn = [this](const std::string& s) { lines.push_back(s); };
    return o;
  }
};

std::vector<int> Tokens(int n, int salt = 0) {
  std::vector<int> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i * 13 + salt) % 97;
  return t;
}

// Writes tokens [from, to) of `rows` into every layer.
void WriteRows(KvCache& c, const test::Rows& rows, int from, int to) {
  for (int t = from; t < to; ++t) {
    for (int l = 0; l < kL; ++l) c.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
  }
}

// Writes tokens [from, to) of `rows` and puts each chunk as it fills.
void FillAndPut(PrefixStore& s, KvCache& c, const test::Rows& rows, std::span<const int> tokens, int from, int to) {
  for (int t = from; t < to; ++t) {
    WriteRows(c, rows, t, t + 1);
    s.put(tokens, c);
  }
}

// The store's whole contract on one backend: misses, hits, a diverging
// prompt, a corrupted, a truncated and a foreign entry (each one warning,
// recomputed, overwritten).
void ExerciseStore(const std::string& url, const std::string& scheme, Warnings& w) {
  SCOPED_TRACE(url + " " + scheme);
  w.lines.clear();
  const StaticRanges r = test::Ranges(3);
  const test::Rows rows = test::MakeRows(700, 5);
  PrefixStore s(url, w.Options(64));
  KvCache ref(scheme, kL, 4096, kH, kD, &r);
  const ChunkPlan plan = s.plan(ref);
  const int e0 = static_cast<int>(plan.end(0)), e1 = static_cast<int>(plan.end(1)), e2 = static_cast<int>(plan.end(2));
  const std::vector<int> tok = Tokens(e2 + 5);
  KvCache cold(scheme, kL, 4096, kH, kD, &r);
  EXPECT_EQ(s.longest_prefix(tok, cold), 0);
  FillAndPut(s, cold, rows, tok, 0, e2 + 5);
  const std::vector<Key> keys = chunk_keys(cold, tok, plan.tokens, std::nullopt);
  for (const auto& size : s.backend().sizes(keys)) EXPECT_TRUE(size.has_value() && *size > 0);
  // Warm: all three chunks; limit keeps one token to evaluate.
  KvCache warm(scheme, kL, 4096, kH, kD, &r);
  LookupReport rep;
  EXPECT_EQ(s.longest_prefix(tok, warm, e2, &rep), e2);
  EXPECT_EQ(rep.chunks, 3);
  EXPECT_GT(rep.bytes, 0u);
  KvCache at3(scheme, kL, 4096, kH, kD, &r);
  for (int t = 0; t < e2; ++t) {
    for (int l = 0; l < kL; ++l) at3.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
  }
  EXPECT_TRUE(warm.to_bytes() == at3.to_bytes());
  EXPECT_EQ(s.longest_prefix(tok, warm, e2 - 1), e1);
  // A prompt that leaves the stored one in chunk 1 reuses chunk 0.
  std::vector<int> other = tok;
  other[static_cast<size_t>(e0) + 3] += 1;
  KvCache o(scheme, kL, 4096, kH, kD, &r);
  EXPECT_EQ(s.longest_prefix(other, o), e0);
  EXPECT_TRUE(w.lines.empty());
  // Garbage, a truncated value and another chunk's value, each under chunk 1's key.
  const std::vector<uint8_t> good = *s.backend().get(std::span(keys).subspan(1, 1))[0];
  const std::vector<uint8_t> chunk2 = *s.backend().get(std::span(keys).subspan(2, 1))[0];
  const std::vector<std::pair<std::vector<uint8_t>, const char*>> bad = {
      {std::vector<uint8_t>(100, 0x5A), "magic"},
      {std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(good.size() / 2)), "truncated"},
      {chunk2, "another key"}};
  for (const auto& [value, why] : bad) {
    SCOPED_TRACE(why);
    s.backend().put(std::span(keys).first(2), value);
    w.lines.clear();
    KvCache m(scheme, kL, 4096, kH, kD, &r);
    EXPECT_EQ(s.longest_prefix(tok, m), e0);  // chunk 0 only
    ASSERT_EQ(w.lines.size(), 1u);
    EXPECT_NE(w.lines[0].find("chunk 1"), std::string::npos) << w.lines[0];
    EXPECT_NE(w.lines[0].find(why), std::string::npos) << w.lines[0];
    // Recomputed and overwritten by the next fill.
    FillAndPut(s, m, rows, tok, e0, e2);
    KvCache again(scheme, kL, 4096, kH, kD, &r);
    EXPECT_EQ(s.longest_prefix(tok, again), e2);
    EXPECT_TRUE(again.to_bytes() == at3.to_bytes());
  }
  // Another scheme's cache finds nothing (its keys differ).
  KvCache q("q4_0", kL, 4096, kH, kD);
  EXPECT_EQ(s.longest_prefix(tok, q), 0);
}

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
