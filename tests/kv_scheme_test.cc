// KV schemes (SPEC §6): registry, per scheme round-trip bounds, exact byte
// accounting, and RowKvCache behaviour (ggml's blocks: ggml_quants_test.cc).
//
// Tolerances per value x in a row (derived from each format):
//   fp16: |e| <= |x| 2^-11 (normal range), 2^-25 below 2^-14; bf16: |e| <= |x| 2^-8
//   int8: |e| <= s/2 (1 + 2^-20), s = max|row| / 127 (see affine_test)
//   int8-head: same with s per head
//   fp8-e4m3 (scale 1): |e| <= |x| 2^-4 for |x| >= 2^-6, else <= 2^-10;
//     above 448 it saturates: |e| = |x| - 448 (likewise e5m2 above 57344)
//   fp8-e4m3-scaled: the same on x / s, times s (plus float rounding slack)
//   fp8-e5m2: |e| <= |x| 2^-3 for |x| >= 2^-14, else <= 2^-17
//   q8_0: |e| <= d/2 + |q| * (fp16 rounding of d: max(d 2^-11, 2^-25)), d = amax / 127
//   q4_0: |e| <= max(|d|/2, |x| - 7|d|) + 8 max(|d| 2^-11, 2^-25), d = max / -8
//     (codes are -8..7: the side opposite to max clamps at 7|d|)
#include "kvq/kv_scheme.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kvq/error.h"
#include "kvq/ggml_quants.h"
#include "kvq/half.h"
#include "src/rows/row_scheme.h"
#include "tests/test_util.h"
#include "src/rows/row_store.h"

namespace kvq {
namespace {

TEST(KvScheme, RegistryNamesRoundTrip) {
  EXPECT_EQ(all_kv_schemes().size(), 10u);
  for (KvScheme s : all_kv_schemes()) EXPECT_EQ(parse_kv_scheme(kv_scheme_name(s)), s);
  EXPECT_EQ(parse_kv_scheme_list("all").size(), 10u);
  const auto l = parse_kv_scheme_list("q4_0,int8,q4_0");
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[0], KvScheme::Q4_0);
  try {
    parse_kv_scheme_list("int8,int3", "--kv");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--kv"), std::string::npos) << m;
    EXPECT_NE(m.find("int3"), std::string::npos) << m;
    EXPECT_NE(m.find("fp8-e4m3-scaled"), std::string::npos) << m;
  }
  EXPECT_THROW(parse_kv_scheme_list(""), Error);
  EXPECT_THROW(parse_kv_scheme_list("int8,,fp16"), Error);
}

// The one table (src/schemes/registry.cc): every scheme once, in the order
// of its append-only format value, each with a codec; tile code formats as
// kv_scheme.h documents them. A value that names no scheme is a clear error.
TEST(KvScheme, RegistryHoldsEverySchemeOnceInFormatOrder) {
  const auto defs = schemes::row_schemes();
  ASSERT_EQ(defs.size(), all_kv_schemes().size());
  for (size_t i = 0; i < defs.size(); ++i) {
    SCOPED_TRACE(defs[i]->name);
    EXPECT_EQ(static_cast<size_t>(defs[i]->id), i);
    EXPECT_EQ(schemes::find_row_scheme(defs[i]->id), defs[i]);
    EXPECT_STREQ(kv_scheme_name(defs[i]->id), defs[i]->name);
    EXPECT_TRUE(defs[i]->row_bytes && defs[i]->header_bytes && defs[i]->encode && defs[i]->decode);
    for (size_t j = 0; j < i; ++j) EXPECT_STRNE(defs[i]->name, defs[j]->name);
  }
  using schemes::TileCodes;
  for (KvScheme s : all_kv_schemes()) {
    const TileCodes t = schemes::find_row_scheme(s)->tile;
    const TileCodes want = s == KvScheme::Int8 || s == KvScheme::Int8Head ? TileCodes::kInt8
                           : s == KvScheme::Q8_0                          ? TileCodes::kQ8
                           : s == KvScheme::Q4_0                          ? TileCodes::kQ4
                                                                          : TileCodes::kNone;
    EXPECT_EQ(t, want) << kv_scheme_name(s);
  }
  EXPECT_EQ(schemes::find_row_scheme(static_cast<KvScheme>(10)), nullptr);
  EXPECT_STREQ(kv_scheme_name(static_cast<KvScheme>(200)), "unknown");
  const std::string e = test::ErrorOf([] { KvRowCodec c(static_cast<KvScheme>(10), 64, 8); });
  EXPECT_NE(e.find("unknown KV scheme value 10"), std::string::npos) << e;
}

double Bound(KvScheme s, float x, const float* row, int n, int head_dim, int i) {
  const double ax = std::fabs(x);
  auto amax = [&](int b, int e) {
    double m = 0;
    for (int j = b; j < e; ++j) m = std::max(m, static_cast<double>(std::fabs(row[j])));
    return m;
  };
  switch (s) {
    case KvScheme::Fp32: return 0;
    case KvScheme::Fp16: return ax >= 0x1p-14 ? ax * 0x1p-11 : 0x1p-25;  // subnormal step 2^-24
    case KvScheme::Bf16: return ax * 0x1p-8;
    case KvScheme::Int8: return amax(0, n) / 127 * (0.5 + 0x1p-20);
    case KvScheme::Int8Head: {
      const int h = i / head_dim;
      return amax(h * head_dim, (h + 1) * head_dim) / 127 * (0.5 + 0x1p-20);
    }
    case KvScheme::Fp8E4M3:  // scale-free cast: saturates at 448
      return ax > 448 ? ax - 448 : (ax >= 0x1p-6 ? ax * 0x1p-4 : 0x1p-10);
    case KvScheme::Fp8E4M3Scaled: {
      const double sc = amax(0, n) / 448;
      const double xs = ax / sc;
      return (xs >= 0x1p-6 ? xs * 0x1p-4 : 0x1p-10) * sc * (1 + 1e-6) + ax * 0x1p-22;
    }
    case KvScheme::Fp8E5M2:
      return ax > 57344 ? ax - 57344 : (ax >= 0x1p-14 ? ax * 0x1p-3 : 0x1p-17);
    case KvScheme::Q8_0: {
      const int b = i / 32 * 32;
      const double d = amax(b, b + 32) / 127;
      return d / 2 + 127 * std::max(d * 0x1p-11, 0x1p-25) + ax * 1e-6;  // fp16 d may be subnormal
    }
    case KvScheme::Q4_0: {
      const int b = i / 32 * 32;
      const double d = amax(b, b + 32) / 8;
      // Codes span -8..7 times d: values of the sign opposite to max clamp at 7|d|.
      return std::max(d / 2, ax - 7 * d) + 8 * std::max(d * 0x1p-11, 0x1p-25) + ax * 1e-6;
    }
  }
  return 0;
}

TEST(KvScheme, EveryCodecRoundTripsWithinItsBound) {
  const int n = 128, head_dim = 32;
  test::Rng rng(21);
  for (KvScheme s : all_kv_schemes()) {
    SCOPED_TRACE(kv_scheme_name(s));
    KvRowCodec codec(s, n, head_dim);
    std::vector<uint8_t> bytes(codec.row_bytes());
    std::vector<float> row(n), back(n);
    for (int trial = 0; trial < 200; ++trial) {
      const double scale = std::pow(10.0, trial % 7 - 3);
      for (int i = 0; i < n; ++i) row[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian() * scale * ((i % 29 == 3) ? 15 : 1));
      codec.encode(row.data(), bytes.data());
      codec.decode(bytes.data(), back.data());
      for (int i = 0; i < n; ++i) {
        const float x = row[static_cast<size_t>(i)];
        ASSERT_LE(std::fabs(x - back[static_cast<size_t>(i)]), Bound(s, x, row.data(), n, head_dim, i))
            << "i=" << i << " x=" << x << " got " << back[static_cast<size_t>(i)];
      }
    }
    // All-zero rows decode to zeros (no NaN from a zero scale).
    std::fill(row.begin(), row.end(), 0.0f);
    codec.encode(row.data(), bytes.data());
    codec.decode(bytes.data(), back.data());
    for (float v : back) ASSERT_EQ(v, 0.0f);
  }
}

TEST(KvScheme, BytesAndBitsPerElementAreExact) {
  // row_len 32 (stories260K: 4 KV heads x 8).
  struct Want { KvScheme s; size_t bytes; double bits; };
  const Want want[] = {
      {KvScheme::Fp32, 128, 32}, {KvScheme::Fp16, 64, 16}, {KvScheme::Bf16, 64, 16},
      {KvScheme::Int8, 36, 9},   {KvScheme::Int8Head, 48, 12}, {KvScheme::Fp8E4M3, 32, 8},
      {KvScheme::Fp8E4M3Scaled, 36, 9}, {KvScheme::Fp8E5M2, 32, 8}, {KvScheme::Q8_0, 34, 8.5},
      {KvScheme::Q4_0, 18, 4.5},
  };
  for (const Want& w : want) {
    KvRowCodec c(w.s, 32, 8);
    EXPECT_EQ(c.row_bytes(), w.bytes) << kv_scheme_name(w.s);
    EXPECT_DOUBLE_EQ(c.bits_per_element(), w.bits) << kv_scheme_name(w.s);
    RowKvCache cache(w.s, 5, 512, 4, 8);
    EXPECT_EQ(cache.bytes(512), 2 * w.bytes * 5 * 512);
  }
  EXPECT_THROW(KvRowCodec(KvScheme::Q4_0, 48, 8), Error);  // not a multiple of 32
  EXPECT_THROW(KvRowCodec(KvScheme::Int8Head, 30, 8), Error);
  EXPECT_THROW(KvRowCodec(KvScheme::Int8, 0, 8), Error);
  EXPECT_THROW(KvRowCodec(static_cast<KvScheme>(77), 32, 8), Error);
}

TEST(RowKvCache, StoresHeadMajorSlicesWhereTheSchemeAllows) {
  // head_dim 16: every scheme splits per head except the ggml blocks (32).
  for (KvScheme s : all_kv_schemes()) {
    const KvRowCodec c16(s, 64, 16), c32(s, 64, 32);
    const bool blocks = s == KvScheme::Q8_0 || s == KvScheme::Q4_0;
    EXPECT_EQ(c16.slices(), blocks ? 1 : 4) << kv_scheme_name(s);
    EXPECT_EQ(c32.slices(), 2) << kv_scheme_name(s);
    const size_t want_header = s == KvScheme::Int8 || s == KvScheme::Fp8E4M3Scaled ? 4
                               : s == KvScheme::Int8Head                          ? 16
                                                                                  : 0;
    EXPECT_EQ(c16.header_bytes(), want_header) << kv_scheme_name(s);
  }
}

// The K (which = 0) and V (1) tile layouts of kv_scheme.h, element by
// element: `slice` is one head's codec payload, `tile` the tile holding lane
// `lane`.
void ExpectTileLane(int which, KvScheme s, int hd, const uint8_t* slice, const uint8_t* tile, int lane) {
  const bool q4 = s == KvScheme::Q4_0, blocks = s == KvScheme::Q8_0 || q4;
  const int nblk = blocks ? hd / 32 : 0, bb = q4 ? 18 : 34;
  const uint8_t* codes = tile + 32 * nblk;
  for (int b = 0; b < nblk; ++b) {
    ASSERT_EQ(0, std::memcmp(tile + 32 * b + 2 * lane, slice + bb * b, 2)) << "scale of block " << b;
  }
  const int quad = lane / 4, k = lane % 4;
  for (int e = 0; e < hd; ++e) {
    if (!q4) {
      const uint8_t want = blocks ? slice[bb * (e / 32) + 2 + e % 32] : slice[e];
      const int at = which == 0 ? 64 * (e / 4) + 4 * lane + e % 4 : 64 * (4 * (e / 16) + quad) + 4 * (e % 16) + k;
      ASSERT_EQ(codes[at], want) << "element " << e;
    } else {
      const uint8_t* qs = slice + bb * (e / 32) + 2;
      const int j = e % 32;
      const int want = j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4);
      const int at = which == 0 ? 64 * (e / 8) + 4 * lane + e % 4 : 64 * (4 * (e / 32) + quad) + 4 * (j % 16) + k;
      const bool low = which == 0 ? e % 8 < 4 : j < 16;
      ASSERT_EQ(low ? (codes[at] & 15) : (codes[at] >> 4), want) << "element " << e;
    }
  }
}

// Which schemes tile K and V, and both tile layouts for every tiled scheme
// with block-aligned heads: positions written out of order, read back
// through unaligned subviews.
TEST(RowKvCache, KAndVTilesHoldTheCodecBytes) {
  for (KvScheme s : all_kv_schemes()) {
    const bool int8 = s == KvScheme::Int8 || s == KvScheme::Int8Head;
    const bool blocks = s == KvScheme::Q8_0 || s == KvScheme::Q4_0;
    EXPECT_EQ(KvRowCodec(s, 64, 32).k_tile(), int8 || blocks ? kKTile : 0) << kv_scheme_name(s);
    EXPECT_EQ(KvRowCodec(s, 64, 32).v_tile(), int8 || blocks ? kKTile : 0) << kv_scheme_name(s);
    if (blocks) {
      EXPECT_EQ(KvRowCodec(s, 64, 16).k_tile(), 0) << "blocks straddle heads";
      EXPECT_EQ(KvRowCodec(s, 64, 16).v_tile(), 0) << "blocks straddle heads";
    }
    if (int8) {
      EXPECT_EQ(KvRowCodec(s, 12, 6).k_tile(), 0) << "head_dim % 4 != 0";
      EXPECT_EQ(KvRowCodec(s, 16, 8).k_tile(), kKTile);
      EXPECT_EQ(KvRowCodec(s, 16, 8).v_tile(), 0) << "head_dim % 16 != 0";
    }
  }
  test::Rng rng(8);
  for (KvScheme s : {KvScheme::Int8, KvScheme::Int8Head, KvScheme::Q8_0, KvScheme::Q4_0}) {
    SCOPED_TRACE(kv_scheme_name(s));
    const int hd = 64, n_kv = 2, T = 37;
    RowKvCache cache(s, 1, T, n_kv, hd);
    const KvRowCodec& codec = cache.codec();
    std::vector<std::vector<uint8_t>> enc[2];
    for (auto& e : enc) e.assign(T, std::vector<uint8_t>(codec.row_bytes()));
    std::vector<float> k(n_kv * hd), v(k.size());
    for (int i = 0; i < T; ++i) {
      const int pos = (i * 11) % T;  // every position once, out of order
      for (auto& f : k) f = static_cast<float>(rng.Gaussian());
      for (auto& f : v) f = static_cast<float>(rng.Gaussian());
      cache.write(0, pos, k, v);
      codec.encode(k.data(), enc[0][pos].data());
      codec.encode(v.data(), enc[1][pos].data());
    }
    const KvRowsView view = cache.view(0, T);
    ASSERT_EQ(view.k_tile, kKTile);
    ASSERT_EQ(view.v_tile, kKTile);
    for (int which = 0; which < 2; ++which) {
      for (int pos = 0; pos < T; ++pos) {
        for (int sl = 0; sl < n_kv; ++sl) {
          ExpectTileLane(which, s, hd, enc[which][pos].data() + view.header_bytes + sl * view.slice_bytes,
                         (which ? view.v : view.k) + sl * view.slice_stride + pos / 16 * 16 * view.slice_bytes,
                         pos % 16);
        }
      }
    }
    std::vector<uint8_t> got(codec.row_bytes());
    for (int t0 : {0, 5, 16, 21}) {
      const KvRowsView sub = view.subview(t0, T);
      EXPECT_EQ(sub.tile_first, t0 % 16);
      for (int which = 0; which < 2; ++which) {
        for (int t = 0; t < T - t0; ++t) {
          sub.gather_row(which, t, got.data());
          ASSERT_EQ(got, enc[which][t0 + t]) << "subview at " << t0 << ", token " << t << ", which " << which;
        }
        const KvRowsView sub2 = sub.subview(3, T - t0);  // a subview of a subview
        sub2.gather_row(which, 0, got.data());
        ASSERT_EQ(got, enc[which][t0 + 3]);
      }
    }
  }
}

TEST(RowKvCache, WritesRowsAndReadsThemBack) {
  test::Rng rng(5);
  for (KvScheme s : all_kv_schemes()) {
    RowKvCache cache(s, 2, 16, 2, 16);
    std::vector<float> k(32), v(32), out(32), want(32);
    std::vector<uint8_t> enc(cache.codec().row_bytes());
    for (int pos = 0; pos < 16; ++pos) {
      for (auto& f : k) f = static_cast<float>(rng.Gaussian());
      for (auto& f : v) f = static_cast<float>(rng.Gaussian());
      cache.write(1, pos, k, v);
      const KvRowsView view = cache.view(1, pos + 1);
      ASSERT_EQ(view.tokens, pos + 1);
      ASSERT_EQ(view.scheme, s);
      const KvRowCodec& codec = cache.codec();
      ASSERT_EQ(view.header_bytes, codec.header_bytes());
      ASSERT_EQ(view.slices, codec.slices());
      ASSERT_EQ(view.slice_bytes * view.slices + view.header_bytes, codec.row_bytes());
      std::vector<uint8_t> got(enc.size());
      for (int which = 0; which < 2; ++which) {
        codec.encode(which == 0 ? k.data() : v.data(), enc.data());
        // The layout itself: the header at [pos], head slice s at s * slice_stride + pos * slice_bytes.
        const uint8_t* header = (which == 0 ? view.k_header : view.v_header) + pos * view.header_bytes;
        if (view.header_bytes) {
          ASSERT_EQ(0, std::memcmp(header, enc.data(), view.header_bytes));
        }
        for (int sl = 0; sl < view.slices; ++sl) {
          const uint8_t* piece = (which == 0 ? view.k : view.v) + sl * view.slice_stride + pos * view.slice_bytes;
          if (which == 0 ? view.k_tile : view.v_tile) {  // tiles: checked element by element
            ExpectTileLane(which, s, 16, enc.data() + view.header_bytes + sl * view.slice_bytes,
                           (which == 0 ? view.k : view.v) + sl * view.slice_stride + pos / 16 * 16 * view.slice_bytes,
                           pos % 16);
          } else {
            ASSERT_EQ(0, std::memcmp(piece, enc.data() + view.header_bytes + sl * view.slice_bytes, view.slice_bytes));
          }
          ASSERT_EQ(reinterpret_cast<uintptr_t>((which == 0 ? view.k : view.v) + sl * view.slice_stride) % 64, 0u);
        }
        view.gather_row(which, pos, got.data());
        ASSERT_EQ(got, enc);
        codec.decode(enc.data(), want.data());
        if (which == 0) {
          cache.read_k(1, pos, out);
        } else {
          cache.read_v(1, pos, out);
        }
        ASSERT_EQ(out, want);
      }
      if (s == KvScheme::Fp32) {
        ASSERT_EQ(0, std::memcmp(out.data(), v.data(), 128));
      }
    }
    std::vector<float> bad(32, 1.0f);
    bad[7] = NAN;
    try {
      cache.write(0, 0, k, bad);
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("v[7]"), std::string::npos) << e.what();
    }
    EXPECT_THROW(cache.write(2, 0, k, v), Error);
    EXPECT_THROW(cache.write(0, 16, k, v), Error);
    EXPECT_THROW(cache.write(0, 0, std::span<const float>(k).first(31), v), Error);
    EXPECT_THROW(cache.view(2, 1), Error);
    EXPECT_THROW(cache.view(-1, 1), Error);
    EXPECT_THROW(cache.view(0, 17), Error);
    EXPECT_THROW(cache.view(0, -1), Error);
    EXPECT_EQ(cache.view(0, 0).tokens, 0);
  }
}

}  // namespace
}  // namespace kvq
