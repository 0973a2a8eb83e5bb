// `t0+<scheme>` caches (src/cache/token_family.cc): layer 0 held as token
// ids and read through a TokenTable (kvq/token_table.h), the other layers
// exactly as the inner scheme holds them. Layer 0 reads the table's fp16
// rows with K rotated to its position; attention on it is the fp16 kernel's
// on those rows; saved caches and token ranges restore bitwise against the
// same table and are refused against another, or with an id outside it.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvq/grouped_kv.h"
#include "kvq/half.h"
#include "kvq/kv_cache.h"
#include "kvq/rope.h"
#include "kvq/token_table.h"
#include "src/io/container.h"
#include "tests/kv_cache_util.h"
#include "tests/test_util.h"

namespace kvq {
namespace {

using test::ErrorOf;
using test::kD;
using test::kE;
using test::kH;
using test::kL;

constexpr int kVocab = 300;

std::shared_ptr<const TokenTable> Table(uint64_t seed, float scale = 1.0f) {
  test::Rng rng(seed);
  std::vector<float> k(static_cast<size_t>(kVocab) * kE), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = scale * static_cast<float>(rng.Gaussian());
    v[i] = scale * static_cast<float>(rng.Gaussian());
  }
  return std::make_shared<const TokenTable>(kVocab, kH, kD, k, v);
}

std::vector<int> Ids(int n, uint64_t seed) {
  test::Rng rng(seed);
  std::vector<int> ids;
  for (int i = 0; i < n; ++i) ids.push_back(static_cast<int>(rng.Next() % kVocab));
  return ids;
}

// Layer 0 as the table gives token `id` at position `pos`: K rotated, V.
void TableRow(const TokenTable& t, const RopeTable& rope, int id, int pos, std::vector<float>& k,
              std::vector<float>& v) {
  k.resize(kE), v.resize(kE);
  for (int i = 0; i < kE; ++i) {
    k[static_cast<size_t>(i)] = f16_to_f32_ref(t.k(id)[i]);
    v[static_cast<size_t>(i)] = f16_to_f32_ref(t.v(id)[i]);
  }
  rope.apply(k.data(), kH, pos);
}

// The calibrated ranges of layers 1.. alone (what the inner scheme gets).
StaticRanges Tail(const StaticRanges& r) {
  StaticRanges s = r;
  s.n_layers = r.n_layers - 1;
  for (std::vector<float>* x : {&s.k_lo, &s.k_hi, &s.v_lo, &s.v_hi, &s.k_weight}) {
    if (x->size() >= static_cast<size_t>(kE)) x->erase(x->begin(), x->begin() + kE);
  }
  return s;
}

TEST(TokenTable, ChecksItsInputAndNamesItsRows) {
  const std::vector<float> ok(static_cast<size_t>(4) * kE, 0.5f);
  EXPECT_NE(ErrorOf([&] { TokenTable(4, kH, kD, std::span(ok).first(10), ok); }).find("rows of"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { TokenTable(0, kH, kD, {}, {}); }).find("vocab"), std::string::npos);
  std::vector<float> bad = ok;
  bad[kE + 3] = 1e6f;  // not finite in fp16
  EXPECT_NE(ErrorOf([&] { TokenTable(4, kH, kD, bad, ok); }).find("token 1's K"), std::string::npos);
  const TokenTable a(4, kH, kD, ok, ok);
  std::vector<float> other = ok;
  other[7] = 0.25f;
  EXPECT_NE(a.digest(), TokenTable(4, kH, kD, ok, other).digest());
  EXPECT_EQ(a.digest(), TokenTable(4, kH, kD, ok, ok).digest());
  EXPECT_EQ(a.id_bytes(), 2);
  EXPECT_EQ(a.bytes(), 2u * 2u * 4u * kE);
}

TEST(TokenLayer, NamesWrapEverySchemeOnce) {
  const KvSchemeInfo a = describe_kv_scheme("t0+kvq-2.5", "kv", 64);
  EXPECT_TRUE(a.token_layer);
  EXPECT_EQ(a.family, "tokens");
  EXPECT_EQ(a.name, "t0+" + describe_kv_scheme("kvq-2.5", "kv", 64).name);  // the preset as it resolves at 64
  EXPECT_EQ(a.label, "t0+kvq-2.5");
  EXPECT_TRUE(a.needs_ranges);
  EXPECT_FALSE(describe_kv_scheme("t0+q4_0").needs_ranges);
  EXPECT_NE(ErrorOf([] { describe_kv_scheme("t0+t0+q8_0", "kv"); }).find("already holds layer 0"), std::string::npos);
  EXPECT_NE(ErrorOf([] { describe_kv_scheme("t0+nope", "kv"); }).find("nope"), std::string::npos);
  // Without a table, or with one of another geometry, or one layer: clear errors.
  EXPECT_NE(ErrorOf([] { KvCache("t0+q8_0", kL, 64, kH, kD); }).find("none was given"), std::string::npos);
  auto narrow = std::make_shared<const TokenTable>(2, 1, kD, std::vector<float>(2 * kD), std::vector<float>(2 * kD));
  EXPECT_NE(ErrorOf([&] { KvCache("t0+q8_0", kL, 64, kH, kD, nullptr, {}, narrow); }).find("token_table: rows of"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { KvCache("t0+q8_0", 1, 64, kH, kD, nullptr, {}, Table(1)); }).find("at least 2 layers"),
            std::string::npos);
}

// Layer 0 is the table's rows at their positions, K rounded to fp16 after
// RoPE (attention bitwise an fp16 cache's holding them); layers 1.. are
// the inner scheme's, bitwise.
TEST(TokenLayer, Layer0IsTheTableAndTheRestTheInnerScheme) {
  const StaticRanges r = test::Ranges(3), tail = Tail(r);
  const test::Rows rows = test::MakeRows(120, 9);
  const auto table = Table(4);
  const RopeTable rope(256, kD);
  const std::vector<int> ids = Ids(120, 5);
  for (const std::string inner : {"fp16", "q4_0", "k4v4g16", "kvq-4.5", "kvq-2.5"}) {
    SCOPED_TRACE(inner);
    KvCache c("t0+" + inner, kL, 256, kH, kD, &r, {}, table);
    KvCache in(inner, kL - 1, 256, kH, kD, &tail);
    KvCache f16("fp16", 1, 256, kH, kD);
    std::vector<float> k, v;
    std::vector<float> q(4 * kD), a(q.size()), b(q.size());
    test::Rng rng(6);
    for (int t = 0; t < 120; ++t) {
      const size_t ut = static_cast<size_t>(t);
      c.write(0, t, rows.k[ut], rows.v[ut], ids[ut]);  // k, v of layer 0 are not what it holds
      c.write(1, t, rows.k[ut], rows.v[ut]);
      in.write(0, t, rows.k[ut], rows.v[ut]);
      TableRow(*table, rope, ids[ut], t, k, v);
      f16.write(0, t, k, v);
      for (float& x : q) x = static_cast<float>(rng.Gaussian());
      c.attend(0, q, 4, a);
      f16.attend(0, q, 4, b);
      ASSERT_EQ(a, b) << "layer 0, t " << t;  // one block (up to 256 tokens): the kernel's own numbers
      c.attend_ref(0, q, 4, a);
      f16.attend_ref(0, q, 4, b);
      ASSERT_EQ(a, b) << "layer 0 ref, t " << t;
      c.attend(1, q, 4, a);
      in.attend(0, q, 4, b);
      ASSERT_EQ(a, b) << "layer 1, t " << t;
    }
    std::vector<float> rk(kE), rv(kE);
    c.read(0, 77, rk, rv);
    TableRow(*table, rope, ids[77], 77, k, v);
    std::vector<float> fk(kE), fv(kE);
    f16.read(0, 77, fk, fv);
    EXPECT_EQ(rk, fk);  // K rotated, then rounded to fp16 as an fp16 cache rounds it
    EXPECT_EQ(rv, v);   // V: the table's own fp16
    // Bytes: layer 0 holds 2 bytes a token and the table's digest.
    EXPECT_EQ(c.layer_bytes(0), 2u * 120u + 32u);
    EXPECT_EQ(c.layer_bytes(1), in.layer_bytes(0));
    EXPECT_EQ(c.bytes(), c.layer_bytes(0) + c.layer_bytes(1));
    // Resident: the inner scheme's and the ids (the RoPE and token tables
    // are shared, not per cache).
    EXPECT_LE(c.allocated_bytes(), in.allocated_bytes() + 4 * 2 * 120 + 32);
    EXPECT_LE(kv_scheme_layer_bytes("t0+" + inner, 120, kH, kD), static_cast<double>(c.layer_bytes(1)));
    if (c.any_length()) {  // a row inner scheme: parts as the fp16 kernel's
      const AttentionPart p = c.attend_part(0, q, 4, 10, 50), want = f16.attend_part(0, q, 4, 10, 50);
      EXPECT_EQ(p.value, want.value);
    }
  }
}

// Past one block (16 to 256 tokens by kv_dim), the blocks' parts merge to
// what one pass over the rows gives, for any thread count alike.
TEST(TokenLayer, LongLayersMergeTheirBlocksAlikeForAnyThreads) {
  const auto table = Table(21);
  const RopeTable rope(2000, kD);
  const std::vector<int> ids = Ids(1500, 22);
  KvCache c("t0+q8_0", kL, 2000, kH, kD, nullptr, {}, table), f16("fp16", 1, 2000, kH, kD);
  std::vector<float> k, v, zero(kE, 0.0f);
  for (int t = 0; t < 1500; ++t) {
    c.write(0, t, zero, zero, ids[static_cast<size_t>(t)]);
    TableRow(*table, rope, ids[static_cast<size_t>(t)], t, k, v);
    f16.write(0, t, k, v);
  }
  std::vector<float> q(4 * kD), a(q.size()), b(q.size()), one(q.size());
  test::Rng rng(23);
  for (float& x : q) x = static_cast<float>(rng.Gaussian());
  DecodeAttentionOptions o1, o2;
  o1.threads = 1, o2.threads = 2;
  c.attend(0, q, 4, a, o2);
  c.attend(0, q, 4, one, o1);
  EXPECT_EQ(a, one);
  f16.attend(0, q, 4, b);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5f) << i;
}

TEST(TokenLayer, WritesNameTheirTokenAndPrefillEqualsDecoding) {
  const auto table = Table(8);
  const test::Rows rows = test::MakeRows(40, 2);
  KvCache c("t0+q8_0", kL, 64, kH, kD, nullptr, {}, table);
  EXPECT_NE(ErrorOf([&] { c.write(0, 0, rows.k[0], rows.v[0]); }).find("the id of the token written"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.write(0, 0, rows.k[0], rows.v[0], kVocab); }).find("0..299"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.write(0, 3, rows.k[0], rows.v[0], 1); }).find("written in order"), std::string::npos);
  EXPECT_EQ(c.written(0), 0);
  // Prefill of 40 tokens: each query as decoding gives it.
  const std::vector<int> ids = Ids(40, 3);
  std::vector<float> K, V, Q;
  test::Rng rng(4);
  for (int t = 0; t < 40; ++t) {
    K.insert(K.end(), rows.k[static_cast<size_t>(t)].begin(), rows.k[static_cast<size_t>(t)].end());
    V.insert(V.end(), rows.v[static_cast<size_t>(t)].begin(), rows.v[static_cast<size_t>(t)].end());
    for (int i = 0; i < 4 * kD; ++i) Q.push_back(static_cast<float>(rng.Gaussian()));
  }
  std::vector<float> out(Q.size());
  EXPECT_NE(ErrorOf([&] { c.prefill(0, 0, K, V, Q, 4, out); }).find("expected the 40 tokens' ids"), std::string::npos);
  std::vector<int> bad = ids;
  bad[7] = -1;
  EXPECT_NE(ErrorOf([&] { c.prefill(0, 0, K, V, Q, 4, out, {}, bad); }).find("ids 0..299"), std::string::npos);
  EXPECT_EQ(c.written(0), 0);
  c.prefill(0, 0, K, V, Q, 4, out, {}, ids);
  KvCache d("t0+q8_0", kL, 64, kH, kD, nullptr, {}, table);
  std::vector<float> one(4 * kD);
  for (int t = 0; t < 40; ++t) {
    d.write(0, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)], ids[static_cast<size_t>(t)]);
    d.attend(0, std::span(Q).subspan(static_cast<size_t>(t) * 4 * kD, 4 * kD), 4, one);
    for (int i = 0; i < 4 * kD; ++i) {
      ASSERT_NEAR(out[static_cast<size_t>(t) * 4 * kD + static_cast<size_t>(i)], one[static_cast<size_t>(i)], 1e-6f)
          << t;
    }
  }
  // A new sequence (pos 0) drops the old one's tokens.
  d.write(0, 0, rows.k[0], rows.v[0], 5);
  EXPECT_EQ(d.written(0), 1);
}

// Steady-state bits (kvq eval's count: the mean over the last 128 cache
// lengths) of a cache holding layer 0 as ids and `inner` elsewhere.
double TokenLayerBits(const std::string& inner, int L, int max_seq, int H, int D) {
  double s = 0;
  const int lo = std::max(1, max_seq - 127);
  for (int T = lo; T <= max_seq; ++T) {
    s += 8.0 * ((L - 1) * kv_scheme_layer_bytes(inner, T, H, D) + 2.0 * T) / (2.0 * T * H * D * L);
  }
  return s / (max_seq - lo + 1);
}

// A preset given a token table holds layer 0 as ids and spends the bits
// they free on the other layers: the best inner scheme of its ladder whose
// bits fit the name (less the margin), every better one over it; without a
// table it is the plain preset. Its label stays the preset's, and a saved
// one restores under the preset's name (and not another's).
// From heads of 64, kvq-4.5 and kvq-3.5 first try their own steps (groups
// of 128, the last open tokens fp16); their plain schemes stay the same for
// every head size. stories260K's geometry (5 layers, 4 x 8) keeps the
// shared ladder; stories-hd64's (4 layers, 2 x 64) at ctx 512 takes the
// heads-of-64 step, at ctx 256 a shared one.
TEST(TokenLayer, PresetLaddersFromHeadsOf64) {
  const auto table = Table(22);
  for (const char* p : {"kvq-4.5", "kvq-3.5"}) {
    SCOPED_TRACE(p);
    EXPECT_EQ(grouped_kv_preset(p, 64)->name(), grouped_kv_preset(p, 8)->name());
    const GroupedKvPresetLadder narrow = *grouped_kv_preset_token_ladder(p, 32),
                                wide = *grouped_kv_preset_token_ladder(p, 64);
    EXPECT_EQ(wide.inner.size(), narrow.inner.size() + 1);
    for (size_t i = 0; i < narrow.inner.size(); ++i) EXPECT_EQ(wide.inner[i + 1].name(), narrow.inner[i].name());
    EXPECT_NE(*resolve_kv_preset(p, 5, 512, 4, 8, table.get()), "t0+" + wide.inner[0].name());
    EXPECT_EQ(*resolve_kv_preset(p, 4, 512, 2, 64, table.get()), "t0+" + wide.inner[0].name());
    EXPECT_NE(*resolve_kv_preset(p, 4, 256, 2, 64, table.get()), "t0+" + wide.inner[0].name());
  }
  // 32 layers of 8 x 128 at 16K (docs/schemes.md): the shared steps.
  EXPECT_EQ(*resolve_kv_preset("kvq-4.5", 32, 16384, 8, 128, table.get()), "t0+k4av4g64p8o8r16");
  EXPECT_EQ(*resolve_kv_preset("kvq-3.5", 32, 16384, 8, 128, table.get()), "t0+k3av3g64p8o8r8");
  EXPECT_EQ(grouped_kv_preset_token_ladder("kvq-4.5", 64)->inner[0].name(), "k5av5g128o8x8r8");
  EXPECT_EQ(grouped_kv_preset_token_ladder("kvq-3.5", 128)->inner[0].name(), "k4av3g128o8x4r8");
}

TEST(TokenLayer, PresetsGivenATableHoldLayer0AsTokenIds) {
  const StaticRanges r = test::Ranges(21);
  const auto table = Table(22);
  const test::Rows rows = test::MakeRows(160, 23);
  const std::vector<int> ids = Ids(160, 24);
  struct Geometry {
    int L, max_seq, H, D;
  };
  for (const auto& [preset, plain] : grouped_kv_presets()) {
    SCOPED_TRACE(preset);
    for (const Geometry& g : {Geometry{2, 200, kH, kD}, Geometry{5, 512, 4, 8}, Geometry{4, 256, 2, 64},
                              Geometry{4, 512, 2, 64}, Geometry{32, 16384, 8, 128}, Geometry{32, 256, 8, 128}}) {
      SCOPED_TRACE(testing::Message() << g.L << " layers, max_seq " << g.max_seq << ", " << g.H << " x " << g.D);
      const std::string got = *resolve_kv_preset(preset, g.L, g.max_seq, g.H, g.D, table.get());
      ASSERT_EQ(got.rfind("t0+", 0), 0u) << got;
      EXPECT_TRUE(kv_preset_admits(preset, got, g.D));
      EXPECT_EQ(*resolve_kv_preset(preset, g.L, g.max_seq, g.H, g.D, nullptr), grouped_kv_preset(preset, g.D)->name());
      const GroupedKvPresetLadder ladder = *grouped_kv_preset_token_ladder(preset, g.D);
      size_t at = 0;
      while (at < ladder.inner.size() && "t0+" + ladder.inner[at].name() != got) ++at;
      ASSERT_LT(at, ladder.inner.size());
      const double fit = ladder.bits - kPresetBitsMargin;
      if (at + 1 < ladder.inner.size()) {  // not the last step: it fits
        EXPECT_LE(TokenLayerBits(ladder.inner[at].name(), g.L, g.max_seq, g.H, g.D), fit);
      }
      for (size_t i = 0; i < at; ++i) {
        EXPECT_GT(TokenLayerBits(ladder.inner[i].name(), g.L, g.max_seq, g.H, g.D), fit) << ladder.inner[i].name();
      }
    }
    // At long context on a 32-layer model every preset fits its name.
    const std::string big = *resolve_kv_preset(preset, 32, 16384, 8, 128, table.get());
    EXPECT_LE(TokenLayerBits(big.substr(3), 32, 16384, 8, 128), std::stod(preset.substr(4)) - kPresetBitsMargin);
    EXPECT_FALSE(kv_preset_admits(preset, "t0+q4_0", kD));
    EXPECT_FALSE(kv_preset_admits(preset, "k4v3g64r16", kD));
    // The cache: resolved, labelled, saved and restored under the name.
    KvCache c(preset, kL, 200, kH, kD, &r, {}, table);
    EXPECT_EQ(c.scheme(), *resolve_kv_preset(preset, kL, 200, kH, kD, table.get()));
    EXPECT_TRUE(c.info().token_layer);
    EXPECT_EQ(c.info().label, preset);
    EXPECT_EQ(KvCache(preset, kL, 200, kH, kD, &r).scheme(), plain.name());
    for (int t = 0; t < 160; ++t) {
      for (int l = 0; l < kL; ++l) {
        c.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)], ids[static_cast<size_t>(t)]);
      }
    }
    // Resident: no more than its inner scheme holds over every layer, plus
    // the ids (layer 0's ids take the place of a coded layer; the token and
    // RoPE tables are shared, not per cache).
    KvCache whole(c.scheme().substr(3), kL, 200, kH, kD, &r);
    for (int t = 0; t < 160; ++t) {
      for (int l = 0; l < kL; ++l) whole.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)]);
    }
    EXPECT_LE(c.allocated_bytes(), whole.allocated_bytes() + 4 * 160 + 32);
    EXPECT_LT(c.bytes(), whole.bytes());
    KvCacheExpect e;
    e.scheme = preset;
    e.max_seq = 200;
    e.token_table = [&] { return table; };
    const KvCache d = KvCache::from_bytes(c.to_bytes(), e);
    EXPECT_EQ(d.scheme(), c.scheme());
    EXPECT_EQ(d.info().label, preset);
    EXPECT_EQ(d.to_bytes(), c.to_bytes());
    e.scheme = preset == "kvq-6.5" ? "kvq-2.5" : "kvq-6.5";
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(c.to_bytes(), e); }).find("saved KV cache: the scheme is"),
              std::string::npos);
  }
}

TEST(TokenLayer, SavedCachesAndRangesRestoreBitwiseAgainstTheirTable) {
  const StaticRanges r = test::Ranges(11);
  const test::Rows rows = test::MakeRows(320, 12);
  const auto table = Table(13), other = Table(14);
  const std::vector<int> ids = Ids(320, 15);
  for (const std::string name : {"t0+q4_0", "t0+kvq-3.5", "t0+k3v2g32r5s3"}) {
    SCOPED_TRACE(name);
    KvCache c(name, kL, 200, kH, kD, &r, {}, table);
    auto put = [&](KvCache& x, int t) {
      for (int l = 0; l < kL; ++l) {
        x.write(l, t, rows.k[static_cast<size_t>(t)], rows.v[static_cast<size_t>(t)], ids[static_cast<size_t>(t)]);
      }
    };
    for (int t = 0; t < 96; ++t) put(c, t);
    const std::vector<uint8_t> bytes = c.to_bytes();
    EXPECT_LE(bytes.size(), c.bytes() + 4096);
    KvCacheExpect e;
    e.max_seq = 200;
    int asked = 0;
    e.token_table = [&] { return ++asked, table; };
    KvCache d = KvCache::from_bytes(bytes, e);
    EXPECT_EQ(asked, 1);
    EXPECT_EQ(d.bytes(), c.bytes());
    EXPECT_EQ(d.token_table(), table);
    std::vector<float> q(4 * kD, 0.2f), a(q.size()), b(q.size());
    for (int t = 96; t < 140; ++t) {
      put(c, t), put(d, t);
      for (int l = 0; l < kL; ++l) {
        c.attend(l, q, 4, a);
        d.attend(l, q, 4, b);
        ASSERT_EQ(a, b) << "t " << t << " layer " << l;
      }
    }
    EXPECT_EQ(c.to_bytes(), d.to_bytes());
    // Another table, none, or an id outside the table: refused.
    KvCacheExpect wrong = e;
    wrong.token_table = [&] { return other; };
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(bytes, wrong); }).find("another token table"), std::string::npos);
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(bytes, KvCacheExpect{}); }).find("none was given"),
              std::string::npos);
    // The ids follow the header and the tables: find token 0's id and
    // replace it by one past the vocabulary.
    const std::vector<uint8_t> tables = c.tables();
    std::vector<uint8_t> bad = bytes;
    const auto at = std::search(bad.begin(), bad.end(), tables.begin(), tables.end());
    ASSERT_NE(at, bad.end());
    const size_t id0 = static_cast<size_t>(at - bad.begin()) + tables.size() + 8;
    ASSERT_EQ(bad[id0] | (bad[id0 + 1] << 8), ids[0]);
    bad[id0] = 0x2c, bad[id0 + 1] = 0x01;  // 300
    // Sealed again (a valid CRC): the id itself is what is refused.
    const std::vector<uint8_t> payload(bad.begin() + detail::kContainerHeaderBytes, bad.end());
    EXPECT_NE(ErrorOf([&] { KvCache::from_bytes(detail::WrapContainer("KVQS", 1, payload), e); })
                  .find("token 0 of layer 0 has id 300, outside the 300-token table"),
              std::string::npos);
    // Token ranges (the prefix store's chunks) restore the cache an
    // uninterrupted run holds.
    const KvRangeAlignment al = c.range_alignment();
    const int64_t e0 = al.offset + al.unit, e1 = e0 + 2 * al.unit;
    ASSERT_LE(e1, 320);
    KvCache u(name, kL, 320, kH, kD, &r, {}, table), w(name, kL, 320, kH, kD, &r, {}, table);
    std::array<uint8_t, 32> id_a{}, id_b{};
    id_a[0] = 1, id_b[0] = 2;
    for (int t = 0; t < e0; ++t) put(u, t);
    const std::vector<uint8_t> r0 = u.range_to_bytes(0, e0, id_a);
    for (int t = static_cast<int>(e0); t < e1; ++t) put(u, t);
    const std::vector<uint8_t> r1 = u.range_to_bytes(e0, e1, id_b);
    const std::vector<std::span<const uint8_t>> parts = {r0, r1};
    const std::vector<int64_t> ends = {e0, e1};
    const std::vector<std::array<uint8_t, 32>> keys = {id_a, id_b};
    w.restore_ranges(parts, ends, keys);
    EXPECT_EQ(w.to_bytes(), u.to_bytes());
    KvCache x(name, kL, 320, kH, kD, &r, {}, other);
    EXPECT_NE(ErrorOf([&] { x.restore_ranges(parts, ends, keys); }).find("tables"), std::string::npos);
    EXPECT_EQ(x.tokens(), 0);
  }
}

}  // namespace
}  // namespace kvq
