// One KV cache for every scheme (kv_cache.h): names of every family, one
// attention call, saved caches restored bitwise and continued, their size,
// and every corrupted or mismatched container a clear error.
#include "kvq/kv_cache.h"
#include "kvq/grouped_kv.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "src/io/container.h"
#include "tests/kv_cache_util.h"
#include "tests/test_util.h"
#include "src/rows/row_store.h"

namespace kvq {
namespace {

using test::ErrorOf;

using test::kL;
using test::kH;
using test::kD;
using test::kE;
using test::Ranges;
using test::Rows;
using test::MakeRows;
using test::Schemes;

TEST(KvCache, OneTypeTakesEverySchemeAndAttendsThroughOneCall) {
  const StaticRanges r = Ranges(1);
  const Rows rows = MakeRows(100, 2);
  for (const std::string& name : Schemes()) {
    SCOPED_TRACE(name);
    const KvSchemeInfo info = describe_kv_scheme(name);
    KvCache c(name, kL, 128, kH, kD, &r);
    EXPECT_EQ(c.scheme(), info.name);
    EXPECT_EQ(c.info().family, info.family);
    EXPECT_NE(info.parsed, nullptr);  // parsed once, by describe_kv_scheme; the families read it
    for (int t = 0; t < 100; ++t) {
      for (int l = 0; l < kL; ++l) c.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    }
    EXPECT_EQ(c.tokens(), 100);
    std::vector<float> q(4 * kD, 0.3f), a(q.size()), b(q.size());
    decode_attention(q, 4, c, 1, a);
    c.attend_ref(1, q, 4, b);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 0.02) << i;
    EXPECT_GT(c.bytes(), 0u);
    EXPECT_DOUBLE_EQ(c.bits(), 8.0 * static_cast<double>(c.bytes()) / (2.0 * 100 * kE * kL));
    EXPECT_EQ(c.bytes(), c.layer_bytes(0) + c.layer_bytes(1));
    EXPECT_GE(c.allocated_bytes(), c.bytes());
    std::vector<float> k(kE), v(kE);
    c.read(1, 99, k, v);
    for (int i = 0; i < kE; ++i) EXPECT_NEAR(v[static_cast<size_t>(i)], rows.v[99][static_cast<size_t>(i)], 0.6f);
    // Row schemes read any earlier length and attend any token range; grouped ones their length.
    EXPECT_EQ(c.any_length(), info.family == "rows");
    // The scheme's count of a layer: what a row cache holds; a grouped one
    // holds that or more (units outside their grid kept in fp16).
    const double least = kv_scheme_layer_bytes(name, 100, kH, kD);
    EXPECT_GT(least, 0.0);
    if (info.family == "rows") {
      EXPECT_EQ(least, static_cast<double>(c.layer_bytes(0)));
    } else {
      EXPECT_LE(least, static_cast<double>(c.layer_bytes(0)));
    }
    if (info.family == "rows") {
      DecodeAttentionOptions o;
      o.length = 40;
      c.attend(1, q, 4, a, o);
      EXPECT_EQ(c.bytes(40) * 100, c.bytes() * 40);
      // Tokens [0, 40) as a part equal attention at length 40; [0, 40) and
      // [40, 100) merged equal attention at 100.
      const AttentionPart head = c.attend_part(1, q, 4, 0, 40), tail = c.attend_part(1, q, 4, 40, 100);
      for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(head.value[i], a[i], 1e-6f) << i;
      const AttentionPart both = merge_attention_parts({head, tail});
      std::vector<float> all(a.size());
      c.attend(1, q, 4, all);
      for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(both.value[i], all[i], 1e-5f) << i;
      EXPECT_NE(ErrorOf([&] { c.attend_part(1, q, 4, 40, 101); }).find("begin < end <= 100"), std::string::npos);
      EXPECT_EQ(c.range_alignment().unit, 1);
      EXPECT_EQ(c.range_alignment().offset, 0);
    } else {
      DecodeAttentionOptions o;
      o.length = 40;
      EXPECT_NE(ErrorOf([&] { c.attend(1, q, 4, a, o); }).find("current length"), std::string::npos);
      EXPECT_NE(ErrorOf([&] { c.attend_part(1, q, 4, 0, 40); }).find("whole length"), std::string::npos);
      const GroupedKvScheme s = parse_grouped_kv_scheme(info.name);
      EXPECT_EQ(c.range_alignment().unit, s.group);
      EXPECT_EQ(c.range_alignment().offset, s.sinks + (s.calibrated ? 0 : s.recent));
    }
  }
}

TEST(KvCache, SchemeLayerBytesCheckTheirArguments) {
  EXPECT_NE(ErrorOf([] { kv_scheme_layer_bytes("int3", 10, 2, 16); }).find("int3"), std::string::npos);
  EXPECT_NE(ErrorOf([] { kv_scheme_layer_bytes("q8_0", -1, 2, 32); }).find("tokens"), std::string::npos);
  EXPECT_NE(ErrorOf([] { kv_scheme_layer_bytes("kvq-4.5", 10, 0, 64); }).find("n_kv_heads"), std::string::npos);
  EXPECT_EQ(kv_scheme_layer_bytes("fp16", 10, 2, 16), 2.0 * 10 * 2 * 16 * 2);
}

TEST(KvCache, UnknownNamesListEveryFamilyAndEveryPreset) {
  const std::string e = ErrorOf([] { KvCache c("int3", 1, 8, 2, 16); });
  for (const char* want : {"int3", "fp16", "q4_0", "k<bits>[a]v<bits>g<G>", "kvq-6.5", "kvq-4.5", "kvq-3.5", "kvq-2.5"}) {
    EXPECT_NE(e.find(want), std::string::npos) << want << " in: " << e;
  }
  EXPECT_NE(ErrorOf([] { describe_kv_scheme("", "--kv"); }).find("--kv"), std::string::npos);
  EXPECT_NE(ErrorOf([] { KvCache c("q4_0", 1, 8, 1, 16); }).find("multiple of 32"), std::string::npos);
  EXPECT_NE(ErrorOf([] { KvCache c("kvq-4.5", 1, 8, 2, 16); }).find("ranges"), std::string::npos);
  EXPECT_NE(ErrorOf([] { KvCache c("fp16", 0, 8, 2, 16); }).find("n_layers"), std::string::npos);
  EXPECT_EQ(describe_kv_scheme("kvq-2.5").label, "kvq-2.5");
  // A preset's plain scheme named as itself prints as itself.
  EXPECT_EQ(describe_kv_scheme(describe_kv_scheme("kvq-2.5").name).label, describe_kv_scheme("kvq-2.5").name);
  EXPECT_TRUE(describe_kv_scheme("kvq-4.5").needs_ranges);
  EXPECT_FALSE(describe_kv_scheme("int8").needs_ranges);
}

// A preset resolves per head size (grouped_kv_preset): kvq-2.5 holds its
// open tokens in 3 bits from heads of 64 on; a cache, its bytes and
// describe_kv_scheme(head_dim) agree, the label stays the preset's.
TEST(KvCache, PresetsResolvePerHeadSize) {
  EXPECT_EQ(describe_kv_scheme("kvq-2.5", "kv", 8).name, "k2av2g96p8mo4w4r3");
  EXPECT_EQ(describe_kv_scheme("kvq-2.5", "kv", 32).name, "k2av2g96p8mo4w4r3");
  EXPECT_EQ(describe_kv_scheme("kvq-2.5", "kv", 64).name, "k2v2g96p8mo3w4r3");
  EXPECT_EQ(describe_kv_scheme("kvq-2.5", "kv", 128).label, "kvq-2.5");
  EXPECT_EQ(describe_kv_scheme("kvq-2.5").name, "k2av2g96p8mo4w4r3");  // no head size: the smallest heads'
  EXPECT_EQ(describe_kv_scheme("kvq-4.5", "kv", 64).name, describe_kv_scheme("kvq-4.5").name);
  EXPECT_EQ(describe_kv_scheme("k2av2g96p8mo4w4r3", "kv", 64).name, "k2av2g96p8mo4w4r3");  // a name is itself
  EXPECT_EQ(kv_scheme_layer_bytes("kvq-2.5", 512, 2, 64), kv_scheme_layer_bytes("k2v2g96p8mo3w4r3", 512, 2, 64));
  EXPECT_NE(kv_scheme_layer_bytes("kvq-2.5", 512, 2, 64), kv_scheme_layer_bytes("k2av2g96p8mo4w4r3", 512, 2, 64));
  std::vector<std::vector<float>> k(2), v(2);
  test::Rng rng(4);
  for (int l = 0; l < 2; ++l) {
    for (int i = 0; i < 64 * 64; ++i) {
      k[static_cast<size_t>(l)].push_back(static_cast<float>(rng.Gaussian()));
      v[static_cast<size_t>(l)].push_back(static_cast<float>(rng.Gaussian()));
    }
  }
  const StaticRanges r64 = StaticRanges::from_samples(k, v, 1, 64);
  KvCache wide("kvq-2.5", 2, 256, 1, 64, &r64);
  EXPECT_EQ(wide.scheme(), "k2v2g96p8mo3w4r3");
  EXPECT_EQ(wide.info().label, "kvq-2.5");
  const StaticRanges r = Ranges(2);
  KvCache narrow("kvq-2.5", kL, 256, kH, kD, &r);
  EXPECT_EQ(narrow.scheme(), describe_kv_scheme("kvq-2.5").name);
  // Saved, a resolved preset is its scheme: the file restores as that.
  std::vector<float> kk(64), vv(64);
  for (int t = 0; t < 130; ++t) {
    for (int i = 0; i < 64; ++i) kk[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian()), vv[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
    for (int l = 0; l < 2; ++l) wide.write(l, t, kk, vv);
  }
  const KvCache back = KvCache::from_bytes(wide.to_bytes());
  EXPECT_EQ(back.scheme(), "k2v2g96p8mo3w4r3");
  EXPECT_EQ(back.bytes(), wide.bytes());
  EXPECT_EQ(grouped_kv_preset("kvq-2.5", 63)->name(), "k2av2g96p8mo4w4r3");  // from heads of 64 on exactly
  EXPECT_FALSE(grouped_kv_preset("k2av2g96p8mo4w4r3", 64).has_value());       // not a preset
}

// Saved and restored: the same bytes held, bitwise the same attention now
// and after every further write, the same container again; its size is the
// held bytes plus a header of at most 4 KiB.
// n_kv_heads * head_dim past 2^20 is refused before the product is formed
// (2^11 x 2^20 overflowed int: undefined behaviour, caught by UBSan).
TEST(KvCache, HugeGeometriesAreClearErrorsNotOverflows) {
  for (const char* scheme : {"fp16", "q4_0", "k4v3g16"}) {
    SCOPED_TRACE(scheme);
    try {
      KvCache c(scheme, 1, 4, 1 << 11, 1 << 20);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("n_kv_heads * head_dim <= 2^20"), std::string::npos) << e.what();
    }
    EXPECT_THROW(KvCache(scheme, 1, 4, 1 << 16, 1 << 16), Error);
  }
  EXPECT_THROW(RowKvCache(KvScheme::Fp16, 1, 4, 1 << 11, 1 << 20), Error);
}

TEST(KvCache, SavedCachesRestoreBitwiseAndContinue) {
  const StaticRanges r = Ranges(3);
  const Rows rows = MakeRows(160, 4);
  KvCacheMeta meta;
  meta.model_fingerprint = std::array<uint8_t, 32>{};
  (*meta.model_fingerprint)[0] = 7;
  for (const std::string& name : Schemes()) {
    SCOPED_TRACE(name);
    for (int cut : {1, 37, 96}) {
      SCOPED_TRACE(cut);
      KvCache c(name, kL, 200, kH, kD, &r);
      for (int t = 0; t < cut; ++t) {
        for (int l = 0; l < kL; ++l) c.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
      }
      const std::vector<uint8_t> bytes = c.to_bytes(-1, meta);
      EXPECT_GT(bytes.size(), c.bytes());
      EXPECT_LE(bytes.size(), c.bytes() + 4096);
      KvCacheMeta got;
      KvCacheExpect expect;
      expect.scheme = name, expect.n_layers = kL, expect.n_kv_heads = kH, expect.head_dim = kD;
      expect.model_fingerprint = meta.model_fingerprint;
      expect.max_seq = 200;
      KvCache d = KvCache::from_bytes(bytes, expect, &got);
      EXPECT_EQ(got.model_fingerprint, meta.model_fingerprint);
      EXPECT_FALSE(got.tokens_digest.has_value());
      EXPECT_EQ(d.tokens(), cut);
      EXPECT_EQ(d.bytes(), c.bytes());
      std::vector<float> q(4 * kD), a(q.size()), b(q.size());
      test::Rng rng(5);
      for (float& x : q) x = static_cast<float>(rng.Gaussian());
      for (int t = cut; t < cut + 50; ++t) {
        for (int l = 0; l < kL; ++l) {
          c.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
          d.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
          c.attend(l, q, 4, a);
          d.attend(l, q, 4, b);
          ASSERT_EQ(a, b) << "t " << t << " layer " << l;
        }
      }
      EXPECT_EQ(c.to_bytes(-1, meta), d.to_bytes(-1, meta));
    }
  }
}

// A new sequence (pos 0) in a used cache holds exactly what a fresh cache
// holds for it (a grouped cache reuses its record chunks: no stale byte
// survives), and the reused memory is counted.
TEST(KvCache, ANewSequenceHoldsWhatAFreshCacheHolds) {
  const StaticRanges r = Ranges(21);
  const Rows rows = MakeRows(300, 22), other = MakeRows(120, 23);
  for (const std::string& name : Schemes()) {
    SCOPED_TRACE(name);
    KvCache used(name, kL, 300, kH, kD, &r), fresh(name, kL, 300, kH, kD, &r);
    for (int t = 0; t < 300; ++t) {
      for (int l = 0; l < kL; ++l) used.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    }
    for (int t = 0; t < 120; ++t) {
      for (int l = 0; l < kL; ++l) {
        used.write(l, t, other.k[static_cast<size_t>(t)], other.v[static_cast<size_t>(t)]);
        fresh.write(l, t, other.k[static_cast<size_t>(t)], other.v[static_cast<size_t>(t)]);
      }
    }
    EXPECT_EQ(used.to_bytes(), fresh.to_bytes());
    EXPECT_GE(used.allocated_bytes(), fresh.allocated_bytes());
    std::vector<float> q(4 * kD, 0.2f), a(q.size()), b(q.size());
    used.attend(1, q, 4, a);
    fresh.attend(1, q, 4, b);
    EXPECT_EQ(a, b);
  }
}

TEST(KvCache, RowSchemesSaveAnyEarlierLengthGroupedTheirOwn) {
  const Rows rows = MakeRows(60, 6);
  KvCache c("q8_0", kL, 64, kH, kD), g("k4v3g16r4", kL, 64, kH, kD);
  for (int t = 0; t < 60; ++t) {
    for (int l = 0; l < kL; ++l) c.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]), g.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
  }
  const KvCache d = KvCache::from_bytes(c.to_bytes(33));
  EXPECT_EQ(d.tokens(), 33);
  std::vector<float> q(4 * kD, 0.25f), a(q.size()), b(q.size());
  DecodeAttentionOptions o;
  o.length = 33;
  c.attend(0, q, 4, a, o);
  d.attend(0, q, 4, b);
  EXPECT_EQ(a, b);
  EXPECT_NE(ErrorOf([&] { g.to_bytes(33); }).find("current length"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.to_bytes(61); }).find("tokens"), std::string::npos);
  // Layers at different lengths: a row cache saves what every layer holds.
  c.write(0, 60, rows.k[0], rows.v[0]);
  EXPECT_EQ(KvCache::from_bytes(c.to_bytes()).tokens(), 60);
}

// Every corruption: a clear kvq::Error, never a crash or a cache.
TEST(KvCache, CorruptedContainersAreClearErrors) {
  const StaticRanges r = Ranges(9);
  const Rows rows = MakeRows(70, 10);
  for (const char* name : {"int8", "kvq-4.5", "k3v3g32o8x3r4"}) {
    SCOPED_TRACE(name);
    KvCache c(name, kL, 100, kH, kD, &r);
    for (int t = 0; t < 70; ++t) {
      for (int l = 0; l < kL; ++l) c.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    }
    const std::vector<uint8_t> good = c.to_bytes();
    // Any flipped bit: the CRC32C (or the header's own checks).
    test::Rng rng(1);
    for (int i = 0; i < 200; ++i) {
      std::vector<uint8_t> b = good;
      const size_t at = static_cast<size_t>(rng.Next() % b.size());
      b[at] ^= static_cast<uint8_t>(1u << (rng.Next() % 8));
      EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(b); }), "<no error>") << at;
    }
    // Truncated anywhere, extended, wrong magic or version.
    for (size_t n : {size_t{0}, size_t{3}, size_t{19}, size_t{20}, good.size() / 2, good.size() - 1}) {
      EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(std::span(good).first(n)); }), "<no error>") << n;
    }
    std::vector<uint8_t> longer = good;
    longer.push_back(0);
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(longer); }), "<no error>");
    std::vector<uint8_t> magic = good;
    magic[0] = 'X';
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(magic); }).find("magic"), std::string::npos);
    std::vector<uint8_t> version = good;
    version[4] = 9;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(version); }).find("version"), std::string::npos);
    // Crafted with a valid checksum: each field out of range.
    const size_t h = detail::kContainerHeaderBytes;
    const uint16_t name_len = static_cast<uint16_t>(c.scheme().size());
    const size_t geo = h + 2 + name_len, tokens_at = geo + 12 + 21;
    auto edit = [&](size_t at, const void* v, size_t n) { return test::EditedContainer(good, at, v, n); };
    const uint16_t huge_name = 60000;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(h, &huge_name, 2)); }).find("scheme name"), std::string::npos);
    const char unknown[4] = {'z', 'z', 'z', 'z'};
    // A name with a newline, an escape, a byte that is not UTF-8 and a NUL
    // reaches the message escaped, as one line of valid UTF-8.
    const char evil[4] = {'\n', '\x1b', '\xff', '\0'};
    const std::string said = ErrorOf([&] { KvCache::from_bytes(edit(h + 2, evil, std::min<size_t>(4, name_len))); });
    EXPECT_NE(said.find("\\x0a\\x1b\\xff\\x00"), std::string::npos) << said;
    for (char ch : said) EXPECT_TRUE(ch >= 0x20 && ch < 0x7f) << said;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(h + 2, unknown, std::min<size_t>(4, name_len))); }).find("unknown KV scheme"),
              std::string::npos);
    const uint32_t zero = 0, big = 1u << 31;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(geo, &zero, 4)); }).find("dimension"), std::string::npos);
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(geo + 8, &big, 4)); }).find("dimension"), std::string::npos);
    const uint32_t wide = 1u << 16;  // 2^16 heads x 32: past 2^20 values a row
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(geo + 4, &wide, 4)); }).find("geometry"), std::string::npos);
    // More layers than the bytes can hold is refused before anything is
    // allocated for them.
    const uint32_t three_layers = 3, many_layers = 60000;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(geo, &three_layers, 4)); }), "<no error>");
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(geo, &many_layers, 4)); }).find("at least"), std::string::npos);
    // ... also when the bytes they need pass 2^64 (65535 layers x 2^14 heads x 2^30 tokens): a clear
    // error, no float-to-integer overflow in its message (UBSan in the asan preset; found by fuzz_kvqs).
    {
      const uint32_t most_layers = 65535, most_heads = (1u << 20) / static_cast<uint32_t>(kD);
      const uint64_t most_tokens = uint64_t{1} << 30;
      const std::vector<uint8_t> a = edit(geo, &most_layers, 4);
      const std::vector<uint8_t> b = test::EditedContainer(a, geo + 4, &most_heads, 4);
      const std::vector<uint8_t> huge = test::EditedContainer(b, tokens_at, &most_tokens, 8);
      const std::string e = ErrorOf([&] { KvCache::from_bytes(huge); });
      EXPECT_NE(e.find("at least"), std::string::npos) << e;
      EXPECT_NE(e.find("e+"), std::string::npos) << e;  // the count past 2^63 as its magnitude
    }
    const float bad_theta = -5;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(geo + 12, &bad_theta, 4)); }).find("theta"), std::string::npos);
    const uint64_t absurd = uint64_t{1} << 60, none = 0;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(tokens_at, &absurd, 8)); }).find("tokens"), std::string::npos);
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(tokens_at, &none, 8)); }).find("0 tokens"), std::string::npos);
    const uint64_t fewer = 69;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(tokens_at, &fewer, 8)); }), "<no error>");
    const uint8_t flags = 9;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(tokens_at + 8, &flags, 1)); }).find("flags"), std::string::npos);
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(edit(tokens_at + 9, &absurd, 8)); }).find("tables"), std::string::npos);
  }
  // Spellings no writer makes (found by fuzz_kvqs): a scheme name that is
  // not canonical, RoPE fields the scaling does not read set off their
  // defaults, a RoPE original context past 2^30. A restore saves back to
  // the same bytes, so each is refused.
  {
    KvCache c("k4v4g16", 1, 100, kH, kD);
    for (int t = 0; t < 20; ++t) c.write(0, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    const std::vector<uint8_t> good = c.to_bytes();
    const size_t h = detail::kContainerHeaderBytes;
    std::vector<uint8_t> payload(good.begin() + static_cast<std::ptrdiff_t>(h), good.end());
    const std::string alias = "k4v4g16r0";
    payload[0] = static_cast<uint8_t>(alias.size());
    payload.erase(payload.begin() + 2, payload.begin() + 2 + 7);
    payload.insert(payload.begin() + 2, alias.begin(), alias.end());
    const char magic[4] = {'K', 'V', 'Q', 'S'};
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(detail::WrapContainer(magic, 1, payload)); }).find("canonical"),
              std::string::npos);
    const size_t rope_at = h + 2 + 7 + 12;  // theta, scaling, factor, low, high, original context
    const float factor = 2.0f;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(test::EditedContainer(good, rope_at + 5, &factor, 4)); })
                  .find("defaults"),
              std::string::npos);
    const uint32_t context = 0xFFFFE009u;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(test::EditedContainer(good, rope_at + 17, &context, 4)); })
                  .find("original context"),
              std::string::npos);
  }
  // Values no writer can have made: a NaN where fp16 values are held (an
  // fp16 row; a grouped cache's open token).
  for (const char* name : {"fp16", "k4v4g16"}) {
    KvCache c(name, 1, 100, kH, kD);
    for (int t = 0; t < 70; ++t) c.write(0, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    const std::vector<uint8_t> good = c.to_bytes();
    const uint16_t f16_nan = 0x7E00;
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(test::EditedContainer(good, good.size() - 2, &f16_nan, 2)); })
                  .find("non-finite"),
              std::string::npos)
        << name;
  }
}

// What the caller's model must match: each a clear error naming the field.
TEST(KvCache, RestoreChecksTheCallersModel) {
  const StaticRanges r = Ranges(11);
  KvCache c("kvq-4.5", kL, 100, kH, kD, &r);
  const Rows rows = MakeRows(20, 12);
  for (int t = 0; t < 20; ++t) {
    for (int l = 0; l < kL; ++l) c.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
  }
  KvCacheMeta meta;
  meta.model_fingerprint = std::array<uint8_t, 32>{1, 2, 3};
  meta.tokens_digest = std::array<uint8_t, 32>{9};
  const std::vector<uint8_t> b = c.to_bytes(-1, meta);
  auto expect_error = [&](const KvCacheExpect& e, const char* what) {
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(b, e); }).find(what), std::string::npos) << what;
  };
  KvCacheExpect e;
  e.scheme = "kvq-2.5";
  expect_error(e, "the scheme is k4av3g64p8o8r16");  // kvq-4.5's plain scheme, not one kvq-2.5 resolves to
  e = {}, e.n_layers = 3;
  expect_error(e, "n_layers");
  e = {}, e.n_kv_heads = 4;
  expect_error(e, "n_kv_heads");
  e = {}, e.head_dim = 64;
  expect_error(e, "head_dim");
  e = {}, e.rope = RopeConfig{500000.0f};
  expect_error(e, "RoPE");
  e = {}, e.model_fingerprint = std::array<uint8_t, 32>{};
  expect_error(e, "fingerprint");
  e = {}, e.max_seq = 10;
  expect_error(e, "max_seq");
  e = {}, e.max_seq = 4096, e.scheme = "k4av3g64p8o8r16";  // the preset's own name matches; the caller's capacity
  KvCacheMeta got;
  KvCache d = KvCache::from_bytes(b, e, &got);
  EXPECT_EQ(d.max_seq(), 4096);
  d.write(0, 20, rows.k[0], rows.v[0]);
  // Without one, the capacity is the tokens held: a full cache.
  KvCache full = KvCache::from_bytes(b);
  EXPECT_EQ(full.max_seq(), 20);
  EXPECT_NE(ErrorOf([&] { full.write(0, 20, rows.k[0], rows.v[0]); }).find("max_seq"), std::string::npos);
  EXPECT_EQ(got.tokens_digest, meta.tokens_digest);
  const KvCache no_fp = KvCache::from_bytes(c.to_bytes());
  e = {}, e.model_fingerprint = meta.model_fingerprint;
  EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(c.to_bytes(), e); }).find("no model fingerprint"), std::string::npos);
  (void)no_fp;
}

TEST(KvCache, FilesAreWrittenWholeOrNotAtAll) {
  const auto dir = std::filesystem::temp_directory_path() / ("kvq_cache_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const Rows rows = MakeRows(30, 14);
  KvCache c("q4_0", 1, 64, kH, kD);
  for (int t = 0; t < 30; ++t) c.write(0, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
  const std::string path = (dir / "c.kvqs").string();
  c.save(path);
  EXPECT_EQ(std::filesystem::file_size(path), c.to_bytes().size());
  const KvCache d = KvCache::load(path);
  EXPECT_EQ(d.tokens(), 30);
  size_t files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) files += f.is_regular_file();
  EXPECT_EQ(files, 1u);  // no temporary left
  EXPECT_NE(ErrorOf([&] { c.save(dir.string()); }).find("directory"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.save((dir / "missing" / "c.kvqs").string()); }).find("cannot create"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { KvCache::load((dir / "none").string()); }).find("cannot open"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { KvCache::load(dir.string()); }).find("regular file"), std::string::npos);
  // A FIFO (or a device node) is refused, not replaced by a file; so is a
  // symlink to one.
  const std::string fifo = (dir / "fifo").string(), link = (dir / "link").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::symlink(fifo.c_str(), link.c_str()), 0);
  for (const std::string& p : {fifo, link}) {
    EXPECT_NE(ErrorOf([&] { c.save(p); }).find("not a regular file"), std::string::npos) << p;
  }
  struct stat st {};
  ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  std::filesystem::remove_all(dir);
}

// Chunked prefill (KvCache::prefill) gives every query of a block exactly
// what decoding gives it: the same cache afterwards and, per query, the
// bits of write + attend at its length; blocks continue a sequence; bad
// input is refused before anything is written.
TEST(KvCache, PrefillGivesEachQueryWhatDecodingGivesIt) {
  const StaticRanges ranges = test::Ranges(5);
  const test::Rows rows = test::MakeRows(70, 9);
  constexpr int kHeads = 2 * test::kH, kQ = kHeads * test::kD;
  test::Rng rng(3);
  std::vector<float> q(70 * kQ);
  for (float& x : q) x = static_cast<float>(rng.Gaussian());
  for (const std::string& s : test::Schemes()) {
    SCOPED_TRACE(s);
    const StaticRanges* r = describe_kv_scheme(s).needs_ranges ? &ranges : nullptr;
    KvCache dec(s, test::kL, 80, test::kH, test::kD, r), pre(s, test::kL, 80, test::kH, test::kD, r);
    std::vector<float> want(q.size()), got(q.size());
    for (int t = 0; t < 70; ++t) {
      dec.write(0, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
      dec.attend(0, {q.data() + t * kQ, kQ}, kHeads, {want.data() + t * kQ, kQ});
      for (KvCache* c : {&dec, &pre}) c->write(1, t, rows.v[static_cast<size_t>(t)], rows.k[static_cast<size_t>(t)]);
    }
    for (const auto& [b0, b1] : {std::pair{0, 23}, std::pair{23, 24}, std::pair{24, 70}}) {
      std::vector<float> k, v;
      for (int t = b0; t < b1; ++t) {
        k.insert(k.end(), rows.k[static_cast<size_t>(t)].begin(), rows.k[static_cast<size_t>(t)].end());
        v.insert(v.end(), rows.v[static_cast<size_t>(t)].begin(), rows.v[static_cast<size_t>(t)].end());
      }
      DecodeAttentionOptions o;
      o.threads = 2;
      pre.prefill(0, b0, k, v, {q.data() + b0 * kQ, static_cast<size_t>((b1 - b0) * kQ)}, kHeads,
                  {got.data() + b0 * kQ, static_cast<size_t>((b1 - b0) * kQ)}, o);
    }
    EXPECT_EQ(want, got);
    EXPECT_EQ(dec.to_bytes(), pre.to_bytes());
    // Refused before anything is written: a NaN in the last K row, a q of the wrong size, a gap.
    const std::vector<uint8_t> before = pre.to_bytes();
    std::vector<float> k(2 * test::kE, 0.5f), v(2 * test::kE, 0.5f), qq(2 * kQ, 0.1f), out(2 * kQ);
    k.back() = std::nanf("");
    EXPECT_NE(test::ErrorOf([&] { pre.prefill(0, 70, k, v, qq, kHeads, out); }).find("k: expected finite"),
              std::string::npos);
    k.back() = 0.5f;
    EXPECT_NE(test::ErrorOf([&] { pre.prefill(0, 70, k, v, {qq.data(), kQ}, kHeads, out); }).find("q: expected 2 rows"),
              std::string::npos);
    EXPECT_NE(test::ErrorOf([&] { pre.prefill(0, 71, k, v, qq, kHeads, out); }).find("pos0: expected 0 or 70"),
              std::string::npos);
    std::vector<float> k22(22 * test::kE, 0.1f), q22(22 * kQ, 0.1f), o22(22 * kQ);
    EXPECT_NE(test::ErrorOf([&] { pre.prefill(0, 70, k22, k22, q22, kHeads, o22); })
                  .find("exceed the cache size 80"),
              std::string::npos);
    EXPECT_EQ(before, pre.to_bytes());
  }
}

}  // namespace
}  // namespace kvq
