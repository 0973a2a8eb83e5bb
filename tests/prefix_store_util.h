// Helpers of the prefix store's tests (prefix_store_test.cc,
// prefix_store_redis_test.cc): filled caches, chunk ids, attention
// fingerprints, a warning sink and a store exercised end to end.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "store/backends.h"
#include "store/prefix_store.h"
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

}  // namespace
}  // namespace kvq::store
