// Grouped low-bit KV caches (grouped_kv.h): names, bytes by hand, the group
// code against an independent scalar implementation and the reference for
// every preset, the streaming store (hand-overs, the open tokens at their
// stored width, memory = counted bytes), the held state saved and restored,
// and every bad argument. The kernel's tests: grouped_kernel_test.cc.
#include "kvq/grouped_kv.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvq/attention.h"
#include "kvq/half.h"
#include "src/groups/attention.h"
#include "src/groups/encode.h"
#include "tests/grouped_util.h"
#include "tests/test_util.h"
#include "src/rows/row_store.h"
#include "src/groups/grouped_cache.h"

namespace kvq {
namespace {

using test::ErrorOf;

using test::F16;
using test::FromTileFrame;
using test::ToTileFrame;
using test::SyntheticRanges;

TEST(GroupedKvScheme, NamesRoundTripAndPresetsParse) {
  const GroupedKvScheme g = parse_grouped_kv_scheme("k4v3g64r16s4");
  EXPECT_EQ(g.k_bits, 4);
  EXPECT_EQ(g.v_bits, 3);
  EXPECT_EQ(g.group, 64);
  EXPECT_EQ(g.recent, 16);
  EXPECT_EQ(g.sinks, 4);
  EXPECT_EQ(g.name(), "k4v3g64r16s4");
  EXPECT_EQ(parse_grouped_kv_scheme("k2v2g128").name(), "k2v2g128");
  EXPECT_TRUE(is_grouped_kv_scheme("k8v2g16s1"));
  EXPECT_FALSE(is_grouped_kv_scheme("q4_0"));
  EXPECT_FALSE(is_grouped_kv_scheme("k4v3"));
  for (const auto& [name, s] : grouped_kv_presets()) {
    EXPECT_TRUE(is_grouped_kv_scheme(name)) << name;
    EXPECT_EQ(parse_grouped_kv_scheme(name).name(), s.name());
    EXPECT_EQ(parse_grouped_kv_scheme(s.name()).name(), s.name());
  }
  for (const char* bad : {"k4v3", "k4v3g64x", "k1v4g64", "k9v4g64", "k4v4g24", "k4v4g0", "k4v4g2048", "kv4g64",
                          "k4v4g64r", "k4v4g64r1234567", ""}) {
    const std::string e = ErrorOf([&] { parse_grouped_kv_scheme(bad, "--kv"); });
    EXPECT_NE(e.find("--kv"), std::string::npos) << bad << ": " << e;
  }
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g24"); }).find("multiple of 16"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k9v4g64"); }).find("2..8"), std::string::npos);
  // find: one parse for "is it grouped?" and "which scheme?".
  EXPECT_FALSE(find_grouped_kv_scheme("q8_0").has_value());
  EXPECT_FALSE(find_grouped_kv_scheme("k4v3").has_value());
  EXPECT_EQ(find_grouped_kv_scheme("kvq-4.5")->name(), parse_grouped_kv_scheme("kvq-4.5").name());
  EXPECT_EQ(find_grouped_kv_scheme("k4v3g64r16")->name(), "k4v3g64r16");
  EXPECT_NE(ErrorOf([] { find_grouped_kv_scheme("k9v4g64", "--kv"); }).find("--kv: grouped code bits must be 2..8"),
            std::string::npos);
  // The fixed-point digits: one for 2-bit K / up to 3-bit V, else two.
  EXPECT_EQ(g.k_digits(4), 2);
  EXPECT_EQ(g.v_digits(), 1);
  EXPECT_EQ(parse_grouped_kv_scheme("k2v4g64").k_digits(2), 1);
  EXPECT_EQ(parse_grouped_kv_scheme("k2v4g64").v_digits(), 2);
}

// One geometry by hand: k4v3g64r16s4, T = 200, 2 KV heads of 8 (E = 16),
// one layer. Sinks 4 tokens x 4E bytes (fp16 K and V); complete groups
// floor((200 - 4) / 64) = 3: their parameters (fp16 lo and step of K and V,
// 8E bytes each); coded groups: coded_end = 4 + 64 floor((200 - 16 - 4) /
// 64) = 132, 2 groups of 64 x E x (4 + 3) / 8 bytes; open tokens 132..199:
// 68 x 4E bytes.
TEST(GroupedKvScheme, BytesCountedByHand) {
  const GroupedKvScheme g = parse_grouped_kv_scheme("k4v3g64r16s4");
  const uint64_t E = 16;
  EXPECT_EQ(g.coded_end(200), 132);
  EXPECT_EQ(g.complete_end(200), 196);
  const uint64_t by_hand = 4 * 4 * E + 3 * 8 * E + 2 * 64 * E * 7 / 8 + 68 * 4 * E;
  EXPECT_EQ(g.layer_bytes(200, 2, 8), by_hand);
  EXPECT_DOUBLE_EQ(g.bits(200, 2, 8), 8.0 * static_cast<double>(by_hand) / (2.0 * 200 * 16));  // 8.48
  // Below the first completion everything is fp16; the parameters come at
  // completion, the codes at the hand-over R tokens later.
  EXPECT_DOUBLE_EQ(g.bits(67, 2, 8), 16.0);
  EXPECT_EQ(g.layer_bytes(68, 2, 8), 68 * 4 * E + 8 * E);
  EXPECT_EQ(g.coded_end(84), 68);
  EXPECT_EQ(g.layer_bytes(84, 2, 8), 4 * 4 * E + 8 * E + 64 * E * 7 / 8 + 16 * 4 * E);
  // Steady state: the mean over T = ctx - 127 .. ctx.
  double s = 0;
  for (int T = 385; T <= 512; ++T) s += g.bits(T, 2, 8);
  EXPECT_DOUBLE_EQ(g.steady_state_bits(512, 2, 8), s / 128);
  EXPECT_GT(g.steady_state_bits(512, 2, 8), g.bits(532, 2, 8));  // right after a hand-over is cheaper than the mean
  // The cache's bytes agree at every length.
  GroupedKvCache c(g, 1, 256, 2, 8);
  std::vector<float> k(16, 0.5f), v(16, -0.25f);
  for (int t = 0; t < 256; ++t) {
    c.write(0, t, k, v);
    ASSERT_EQ(c.layer_bytes(0), g.layer_bytes(t + 1, 2, 8)) << t;
  }
  // p8: per group and channel 8-bit a and b for K and for V (4E bytes, not
  // 8E), and the grid table (fp16 base and unit of K and V: 8 bytes a
  // channel) from the start.
  const GroupedKvScheme p8 = parse_grouped_kv_scheme("k4v3g64p8r16s4");
  EXPECT_TRUE(p8.params8);
  EXPECT_EQ(p8.name(), "k4v3g64p8r16s4");
  EXPECT_EQ(p8.layer_bytes(200, 2, 8), by_hand - 3 * 4 * E + 8 * E);
  EXPECT_EQ(p8.layer_bytes(1, 2, 8), 4 * E + 8 * E);  // one sink token and the table
  // Allocated K widths: their table, a byte per channel quad.
  EXPECT_EQ(parse_grouped_kv_scheme("k4av3g64r16s4").layer_bytes(200, 2, 8), by_hand + E / 4);
  // o<N>: the open tokens' flags (a bit per unit: 2 H = 4 bits -> 1 byte).
  const GroupedKvScheme o4 = parse_grouped_kv_scheme("k4v3g64o4r16s4");
  // Open 132..199; the first group is coded, so no fp16 group: 68 tokens in
  // 4 bits (2E x 4 / 8 bytes) plus a flag byte each.
  EXPECT_EQ(o4.layer_bytes(200, 2, 8), by_hand - 68 * 4 * E + 68 * (E + 1));
}

// An independent scalar version of the channel code: directed fp16
// rounding by search over neighbours in double.
void NaiveChannelCode(const std::vector<float>& x, int bits, uint16_t* lo, uint16_t* step, std::vector<int>& q) {
  const double mn = *std::min_element(x.begin(), x.end()), mx = *std::max_element(x.begin(), x.end());
  auto f = [](uint16_t h) { return static_cast<double>(f16_to_f32_ref(h)); };
  uint16_t best = 0xFBFF;  // lo: the largest fp16 <= mn (from -65504)
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t u = static_cast<uint16_t>(h);
    if ((u & 0x7C00) == 0x7C00) continue;  // inf / NaN
    if (f(u) <= mn && f(u) > f(best)) best = u;
  }
  *lo = best;
  const float lof = f16_to_f32_ref(best);
  const int levels = (1 << bits) - 1;
  *step = 0;
  if (mx > lof) {
    const float st = (static_cast<float>(mx) - lof) / static_cast<float>(levels);
    uint16_t up = 0x7BFF;  // the smallest fp16 >= st
    for (uint32_t h = 1; h < 0x7C00; ++h) {
      if (f(static_cast<uint16_t>(h)) >= st) {
        up = static_cast<uint16_t>(h);
        break;
      }
    }
    *step = up;
  }
  const float sf = f16_to_f32_ref(*step);
  q.resize(x.size());
  for (size_t t = 0; t < x.size(); ++t) {
    q[t] = sf == 0.0f ? 0 : std::clamp(static_cast<int>(std::nearbyint((x[t] - lof) * (1.0f / sf))), 0, levels);
  }
}

// The codes of fp16 groups (open tokens in fp16: what the store encodes)
// against the naive code, through what the cache reads back: V directly, K
// in the tile frame (read() returns R(t0) k~^, the same rotation as here).
TEST(GroupedKv, GroupCodesMatchAnIndependentScalarImplementationBitForBit) {
  test::Rng rng(7);
  const int H = 2, hd = 8, G = 32, E = H * hd;
  for (int bits : {2, 3, 4, 5, 6, 7, 8}) {
    SCOPED_TRACE(bits);
    GroupedKvScheme g{bits, bits == 8 ? 2 : bits + 1, G, 0, 0};
    GroupedKvCache c(g, 1, 2 * G, H, hd);
    std::vector<std::vector<float>> kt(2 * G), vv(2 * G);  // tile frame K, V as held (fp16)
    for (int t = 0; t < 2 * G; ++t) {
      std::vector<float> k(E), v(E);
      for (int ch = 0; ch < E; ++ch) {
        k[static_cast<size_t>(ch)] = static_cast<float>(rng.Gaussian() * (ch == 3 ? 30.0 : 1.0) + (ch == 5 ? 7.0 : 0.0));
        v[static_cast<size_t>(ch)] = ch == 9 ? 1.25f : F16(rng.Gaussian());  // channel 9: constant (step 0)
      }
      c.write(0, t, k, v);
      kt[static_cast<size_t>(t)] = ToTileFrame(k, H, hd, t);
      vv[static_cast<size_t>(t)] = v;
    }
    ASSERT_EQ(c.coded_groups(0), 2);
    std::vector<float> rk(E), rv(E);
    for (int grp = 0; grp < 2; ++grp) {
      for (int which = 0; which < 2; ++which) {
        const int b = which == 0 ? g.k_bits : g.v_bits;
        const auto& x = which == 0 ? kt : vv;
        for (int ch = 0; ch < E; ++ch) {
          std::vector<float> col(G);
          for (int t = 0; t < G; ++t) col[static_cast<size_t>(t)] = x[static_cast<size_t>(grp * G + t)][static_cast<size_t>(ch)];
          uint16_t elo, est;
          std::vector<int> q;
          NaiveChannelCode(col, b, &elo, &est, q);
          uint16_t rlo, rst;  // the exported reference agrees
          std::vector<uint8_t> rq(G);
          encode_group_channel_ref(col.data(), G, 1, b, &rlo, &rst, rq.data());
          ASSERT_EQ(rlo, elo);
          ASSERT_EQ(rst, est);
          std::vector<float> plo(hd), pst(hd);
          c.group_params(0, grp, which, ch / hd, plo, pst);
          ASSERT_EQ(plo[static_cast<size_t>(ch % hd)], f16_to_f32_ref(elo));
          ASSERT_EQ(pst[static_cast<size_t>(ch % hd)], f16_to_f32_ref(est));
          for (int t = 0; t < G; ++t) {
            ASSERT_EQ(rq[static_cast<size_t>(t)], q[static_cast<size_t>(t)]);
            const float dec = f16_to_f32_ref(elo) + f16_to_f32_ref(est) * static_cast<float>(q[static_cast<size_t>(t)]);
            // Half a step inside the range.
            ASSERT_LE(std::fabs(dec - col[static_cast<size_t>(t)]), 0.5f * f16_to_f32_ref(est) * (1 + 1e-5f) + 1e-6f);
            // What attention reads: V as is, K rotated back from the tile frame.
            c.read(0, grp * G + t, rk, rv);
            if (which == 1) {
              ASSERT_EQ(rv[static_cast<size_t>(ch)], dec) << "t " << t << " ch " << ch;
            } else {
              std::vector<float> want(E);
              std::vector<float> plo2(hd), pst2(hd);
              for (int h = 0; h < H; ++h) {
                c.group_params(0, grp, 0, h, plo2, pst2);
                for (int i = 0; i < hd; ++i) {
                  const float xv = kt[static_cast<size_t>(grp * G + t)][static_cast<size_t>(h * hd + i)];
                  const float sf = pst2[static_cast<size_t>(i)];
                  const float qv = sf == 0.0f ? 0.0f : std::clamp(std::nearbyint((xv - plo2[static_cast<size_t>(i)]) * (1.0f / sf)), 0.0f,
                                                                  static_cast<float>((1 << b) - 1));
                  want[static_cast<size_t>(h * hd + i)] = plo2[static_cast<size_t>(i)] + sf * qv;
                }
              }
              ASSERT_EQ(rk, FromTileFrame(want, H, hd, grp * G + t)) << "t " << t;
            }
          }
        }
      }
    }
  }
}

// The write path's SIMD channel coder (grouped_encode.h) against its scalar
// reference, bit for bit on every target: fp16 and p8 parameters, min / max
// and least-squares ranges, widths 2..8 per channel, channel counts that are
// not a multiple of the vector, constant channels (step 0), subnormal and
// large values, groups of 16..256 tokens.
TEST(GroupedKv, SimdCoderMatchesItsReferenceBitForBitOnEveryTarget) {
  test::ForEachTarget([](const char*) {
    test::Rng rng(41);
    for (int n_ch : {1, 7, 16, 37, 128}) {
      for (int n : {16, 96, 256}) {
        for (int mode = 0; mode < 4; ++mode) {
          SCOPED_TRACE(::testing::Message() << n_ch << " channels, " << n << " tokens, mode " << mode);
          const bool p8 = mode & 1, mse = mode & 2;
          const size_t stride = static_cast<size_t>(n_ch) + 3;
          std::vector<float> x(static_cast<size_t>(n) * stride);
          std::vector<uint8_t> bits(static_cast<size_t>(n_ch));
          std::vector<float> grid(3 * static_cast<size_t>(n_ch));
          for (int c = 0; c < n_ch; ++c) {
            bits[static_cast<size_t>(c)] = static_cast<uint8_t>(2 + rng.Next() % 7);
            const double scale = c % 5 == 0 ? 1e-6 : c % 5 == 1 ? 300.0 : 1.0;
            for (int t = 0; t < n; ++t) {
              x[static_cast<size_t>(t) * stride + static_cast<size_t>(c)] =
                  c % 11 == 3 ? 0.75f : F16(rng.Gaussian() * scale + (c % 3 == 0 ? 4.0 : 0.0));
            }
            if (c % 9 == 4) x[static_cast<size_t>(c)] = F16(40.0 * scale);  // an outlier
            const float lo = -5.0f * static_cast<float>(scale), w = 10.0f * static_cast<float>(scale);
            grid[static_cast<size_t>(c)] = F16(lo - w);
            grid[static_cast<size_t>(n_ch + c)] = F16(3 * w / 255 * 1.01);
            grid[static_cast<size_t>(2 * n_ch + c)] = grid[static_cast<size_t>(n_ch + c)] / static_cast<float>((1 << bits[static_cast<size_t>(c)]) - 1);
          }
          struct Out {
            std::vector<uint16_t> l16, s16;
            std::vector<uint8_t> a, b, codes;
            std::vector<float> lo, st;
          } r, v;
          for (Out* o : {&r, &v}) {
            o->l16.assign(static_cast<size_t>(n_ch), 0), o->s16 = o->l16;
            o->a.assign(static_cast<size_t>(n_ch), 0), o->b = o->a;
            o->lo.assign(static_cast<size_t>(n_ch), 0), o->st = o->lo;
            o->codes.assign(static_cast<size_t>(n_ch * n), 0);
            grouped::EncodeArgs g;
            g.x = x.data(), g.n = n, g.stride = stride, g.n_ch = n_ch, g.bits = bits.data();
            g.grid = p8 ? grid.data() : nullptr, g.clip = mse ? 4 : 0;
            g.lo16 = o->l16.data(), g.step16 = o->s16.data(), g.a = o->a.data(), g.b = o->b.data();
            g.lo = o->lo.data(), g.step = o->st.data(), g.codes = o->codes.data();
            if (o == &r) {
              grouped::EncodeChannelRef(g);
            } else {
              grouped::EncodeChannels(g);
            }
          }
          EXPECT_EQ(v.codes, r.codes);
          EXPECT_EQ(v.lo, r.lo);
          EXPECT_EQ(v.st, r.st);
          if (p8) {
            EXPECT_EQ(v.a, r.a);
            EXPECT_EQ(v.b, r.b);
          } else {
            EXPECT_EQ(v.l16, r.l16);
            EXPECT_EQ(v.s16, r.s16);
            for (int c = 0; c < n_ch; ++c) {  // the bits are the decoded values' fp16 form
              EXPECT_EQ(f16_to_f32_ref(r.l16[static_cast<size_t>(c)]), r.lo[static_cast<size_t>(c)]);
              EXPECT_EQ(f16_to_f32_ref(r.s16[static_cast<size_t>(c)]), r.st[static_cast<size_t>(c)]);
            }
          }
          std::vector<uint8_t> fixed(static_cast<size_t>(n_ch * n));
          grouped::CodeValues(x.data(), n, stride, n_ch, r.lo.data(), r.st.data(), bits.data(), fixed.data());
          EXPECT_EQ(fixed, r.codes);
        }
      }
    }
    // The open tokens' coder: N-bit codes, 8-bit codes and the fit per unit.
    for (int nbits : {3, 4, 8}) {
      for (bool wide : {false, true}) {
        const size_t units = 6, hd = 16, n = units * hd;
        std::vector<float> x(n), lo(n), st(n), st8(n);
        for (size_t c = 0; c < n; ++c) {
          lo[c] = F16(rng.Gaussian() - 2), st[c] = c % 13 == 0 ? 0.0f : static_cast<float>(rng.Uniform()) * 0.5f;
          st8[c] = st[c] * static_cast<float>((1 << nbits) - 1) / 255.0f;
          x[c] = lo[c] + static_cast<float>(rng.Uniform()) * st[c] * static_cast<float>((1 << nbits) - 1) * (c % 29 == 7 ? 3.0f : 1.0f);
        }
        std::vector<uint8_t> qa(n), qb(n), ca(n), cb(n), fa(units), fb(units);
        grouped::OpenCodesRef(x.data(), lo.data(), st.data(), st8.data(), units, hd, nbits, qa.data(), wide ? ca.data() : nullptr, fa.data());
        grouped::OpenCodes(x.data(), lo.data(), st.data(), st8.data(), units, hd, nbits, qb.data(), wide ? cb.data() : nullptr, fb.data());
        EXPECT_EQ(qa, qb);
        EXPECT_EQ(ca, cb);
        EXPECT_EQ(fa, fb);
        EXPECT_NE(std::count(fa.begin(), fa.end(), 1), 0);  // some fit, some do not
        EXPECT_NE(std::count(fa.begin(), fa.end(), 0), 0);
      }
    }
    // fp16 floor / ceil against fp16's own grid, subnormals included.
    for (uint32_t h = 0; h < 0x7C00; h += 7) {
      const float f = f16_to_f32_ref(static_cast<uint16_t>(h));
      for (float s : {1.0f, -1.0f}) {
        const float x = s * f;
        ASSERT_EQ(grouped::F16Floor(x), x);
        ASSERT_EQ(grouped::F16Bits(x) & 0x7FFF, h);
        const float above = std::nextafter(x, 1e9f), below = std::nextafter(x, -1e9f);
        ASSERT_LE(grouped::F16Floor(above), above);
        ASSERT_GE(grouped::F16Ceil(below), below);
        ASSERT_EQ(f32_to_f16_ref(grouped::F16Floor(above)), f32_to_f16_ref(grouped::F16Floor(above)));
      }
    }
  });
}


// The write path's codes for every preset: the first group (held in fp16)
// coded exactly as encode_group_channel_ref codes its values with the
// scheme's p8 grid and least-squares ranges; the channel widths of each
// quad as allocated.
TEST(GroupedKv, EveryPresetCodesItsGroupsAsTheReference) {
  const int H = 2, hd = 16, E = H * hd;
  for (const auto& [preset, g] : grouped_kv_presets()) {
    SCOPED_TRACE(preset);
    const StaticRanges ranges = SyntheticRanges(1, H, hd, 2.0f, 9);
    const int G = g.group, N = G + g.recent + 3;
    GroupedKvCache c(g, 1, N, H, hd, &ranges);
    test::Rng rng(13);
    std::vector<std::vector<float>> kt, vv;
    for (int t = 0; t < N; ++t) {
      std::vector<float> k(E), v(E);
      for (int i = 0; i < E; ++i) {
        k[static_cast<size_t>(i)] = ranges.k_lo[static_cast<size_t>(i)] + 2.0f + static_cast<float>(rng.Gaussian());
        v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
      }
      c.write(0, t, k, v);
      kt.push_back(ToTileFrame(k, H, hd, t));
      std::vector<float> v16(E);
      for (int i = 0; i < E; ++i) v16[static_cast<size_t>(i)] = F16(v[static_cast<size_t>(i)]);
      vv.push_back(v16);
    }
    ASSERT_GE(c.coded_groups(0), 1);
    std::vector<float> rk(E), rv(E), lo(hd), st(hd);
    for (int which = 0; which < 2; ++which) {
      for (int h = 0; h < H; ++h) {
        c.group_params(0, 0, which, h, lo, st);
        for (int i = 0; i < hd; ++i) {
          const int ch = h * hd + i;
          const int bits = which == 0 ? c.k_quad_bits(0, h, i / 4) : g.v_bits;
          std::vector<float> col(G);
          for (int t = 0; t < G; ++t) col[static_cast<size_t>(t)] = (which == 0 ? kt : vv)[static_cast<size_t>(t)][static_cast<size_t>(ch)];
          // p8's grid of this channel, as P8Grid makes it from the range.
          float grid[3];
          const float rlo = (which == 0 ? ranges.k_lo : ranges.v_lo)[static_cast<size_t>(ch)];
          const float rhi = (which == 0 ? ranges.k_hi : ranges.v_hi)[static_cast<size_t>(ch)];
          {
            const float w = rhi - rlo;
            uint16_t b16 = f32_to_f16_ref(rlo - w);
            if (f16_to_f32_ref(b16) > rlo - w) b16 = (b16 & 0x8000) ? static_cast<uint16_t>(b16 + 1) : static_cast<uint16_t>(b16 - 1);
            uint16_t u16 = f32_to_f16_ref(3.0f * w / 255.0f);
            if (f16_to_f32_ref(u16) < 3.0f * w / 255.0f) ++u16;
            grid[0] = f16_to_f32_ref(b16), grid[1] = f16_to_f32_ref(u16), grid[2] = grid[1] / static_cast<float>((1 << bits) - 1);
          }
          std::vector<uint8_t> q(G);
          const auto [elo, est] = encode_group_channel_ref(col.data(), G, 1, bits, g.params8 ? grid : nullptr, g.mse_ranges, q.data());
          ASSERT_EQ(lo[static_cast<size_t>(i)], elo) << which << " " << ch;
          ASSERT_EQ(st[static_cast<size_t>(i)], est) << which << " " << ch;
          for (int t = 0; t < G; ++t) {
            c.read(0, t, rk, rv);
            if (which == 1) ASSERT_EQ(rv[static_cast<size_t>(ch)], elo + est * static_cast<float>(q[static_cast<size_t>(t)])) << t;
          }
        }
      }
    }
    if (g.k_allocated) {  // each head keeps k_bits * head_dim bits, spread by quad weight
      for (int h = 0; h < H; ++h) {
        int sum = 0, mn = 8, mx = 0;
        for (int k = 0; k < hd / 4; ++k) sum += c.k_quad_bits(0, h, k), mn = std::min(mn, c.k_quad_bits(0, h, k)), mx = std::max(mx, c.k_quad_bits(0, h, k));
        EXPECT_EQ(sum, g.k_bits * hd / 4);
        EXPECT_GE(mn, 2);
      }
    }
  }
}

// Every token as read at every length: exact (fp16) while its group is open
// or inside the recent window or a sink, then its codes, the same codes at
// every later length; hand-overs exactly when a group's last token is R old.
TEST(GroupedKv, OpenGroupHandsOverToCodesAtTheRightLength) {
  test::Rng rng(11);
  const int H = 1, hd = 8, E = H * hd;
  const GroupedKvScheme g = parse_grouped_kv_scheme("k3v2g16r5s3");
  const int N = 60;
  GroupedKvCache c(g, 2, N, H, hd);
  std::vector<std::vector<float>> K, V;
  std::vector<std::vector<float>> first_coded(N);
  for (int T = 1; T <= N; ++T) {
    const int t = T - 1;
    std::vector<float> k(E), v(E);
    for (float& x : k) x = static_cast<float>(rng.Gaussian());
    for (float& x : v) x = static_cast<float>(rng.Gaussian());
    K.push_back(k), V.push_back(v);
    c.write(1, t, k, v);
    EXPECT_EQ(c.written(1), T);
    EXPECT_EQ(c.written(0), 0);
    EXPECT_EQ(c.coded_groups(1), std::max<int64_t>(0, (g.coded_end(T) - 3) / 16));
    for (int pos = 0; pos < T; ++pos) {
      std::vector<float> rk(E), rv(E);
      c.read(1, pos, rk, rv);
      const bool coded = pos >= 3 && pos < g.coded_end(T);
      if (!coded) {
        // A sink: fp16 after RoPE; an open token: fp16 in the tile frame, rotated back.
        const std::vector<float> want = pos < 3 ? K[static_cast<size_t>(pos)] : FromTileFrame(ToTileFrame(K[static_cast<size_t>(pos)], H, hd, pos, 3), H, hd, pos, 3);
        for (int i = 0; i < E; ++i) {
          ASSERT_EQ(rk[static_cast<size_t>(i)], pos < 3 ? F16(want[static_cast<size_t>(i)]) : want[static_cast<size_t>(i)]) << "T " << T << " pos " << pos;
          ASSERT_EQ(rv[static_cast<size_t>(i)], F16(V[static_cast<size_t>(pos)][static_cast<size_t>(i)]));
        }
      } else {
        std::vector<float> both(rk);
        both.insert(both.end(), rv.begin(), rv.end());
        if (first_coded[static_cast<size_t>(pos)].empty()) {
          first_coded[static_cast<size_t>(pos)] = both;
          EXPECT_EQ(T, 3 + ((pos - 3) / 16 + 1) * 16 + 5) << pos;  // its group ended R tokens ago
        } else {
          ASSERT_EQ(both, first_coded[static_cast<size_t>(pos)]) << "T " << T << " pos " << pos;
        }
      }
    }
  }
  for (int pos = 3; pos < 3 + 48; ++pos) EXPECT_FALSE(first_coded[static_cast<size_t>(pos)].empty()) << pos;
  // A new sequence starts at 0 and drops everything; positions out of order are refused.
  std::vector<float> k(E, 0.5f), v(E, 0.25f);
  EXPECT_NE(ErrorOf([&] { c.write(1, 5, k, v); }).find("in order"), std::string::npos);
  c.write(1, 0, k, v);
  EXPECT_EQ(c.written(1), 1);
  EXPECT_EQ(c.coded_groups(1), 0);
  EXPECT_EQ(c.layer_bytes(1), g.layer_bytes(1, H, hd));
}

TEST(GroupedKv, AllocationsAreTheCountedBytesPlusAConstant) {
  const int H = 4, hd = 64, E = H * hd, N = 2000;
  for (const auto& [preset, g] : grouped_kv_presets()) {
    SCOPED_TRACE(preset);
    const StaticRanges ranges = SyntheticRanges(1, H, hd, 2.0f, 3);
    GroupedKvCache c(g, 1, N, H, hd, &ranges);
    test::Rng rng(1);
    // The constant: rings of G + R open slots at every stored width, the
    // tables' float forms (12 floats a channel for p8) and the rotations of
    // every tile start (hd floats), the record pointers.
    const uint64_t ring = static_cast<uint64_t>(g.group + g.recent) * (2 * E * (8 + 16 + 8) / 8 + 1) +
                          static_cast<uint64_t>(g.exact_recent + g.wide_recent) * 2 * E * 3;
    const uint64_t chunk = 256 * 1024;
    const uint64_t constant = ring + 24 * static_cast<uint64_t>(E) + 4 * static_cast<uint64_t>(hd) * (N / 16 + 2) +
                              64 * 1024 + chunk;
    for (int t = 0; t < N; ++t) {
      std::vector<float> k(E), v(E);
      for (int i = 0; i < E; ++i) k[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian()), v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
      c.write(0, t, k, v);
      if ((t + 1) % 250 != 0) continue;
      EXPECT_GE(c.allocated_bytes(), c.bytes()) << t;
      EXPECT_LE(c.allocated_bytes(), c.bytes() + constant) << t;
    }
    // At 2000 tokens the rest of the constant is a few percent of what is held.
    EXPECT_LE(static_cast<double>(c.allocated_bytes()), 1.25 * static_cast<double>(c.bytes()) + chunk);
  }
}

// The held state saved and loaded into a fresh cache of the same tables
// holds the same bytes, attends bitwise alike, and takes further writes as
// the original does (every later state the same), at any length.
TEST(GroupedKv, StateSavedAndLoadedContinuesBitwise) {
  const int H = 2, hd = 16, E = H * hd, N = 180;
  std::vector<std::string> names = {"k4v4g16", "k3v2g32r5s3", "k4av3c", "k3v3g32o8x3r4", "k2v2g16p8mo4x1w3r4"};
  for (const auto& [preset, g] : grouped_kv_presets()) names.push_back(preset);
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const GroupedKvScheme g = parse_grouped_kv_scheme(name);
    const StaticRanges ranges = SyntheticRanges(2, H, hd, 2.0f, 21);
    GroupedKvCache c(g, 2, N, H, hd, &ranges);
    test::Rng rng(77);
    std::vector<std::vector<float>> K, V;
    for (int t = 0; t < N; ++t) {
      std::vector<float> k(E), v(E);
      for (int i = 0; i < E; ++i) k[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian()), v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
      if (t % 37 == 5) k[7] = 25.0f;  // fallbacks to fp16
      K.push_back(k), V.push_back(v);
    }
    std::vector<float> q(4 * hd), a(q.size()), b(q.size());
    for (float& x : q) x = static_cast<float>(rng.Gaussian());
    for (int cut : {1, 17, 63, 100}) {
      GroupedKvCache src(g, 2, N, H, hd, &ranges);
      for (int t = 0; t < cut; ++t) src.write(0, t, K[static_cast<size_t>(t)], V[static_cast<size_t>(t)]), src.write(1, t, K[static_cast<size_t>(t)], V[static_cast<size_t>(t)]);
      std::vector<uint8_t> tables, state;
      src.save_tables(tables);
      src.save_state(state);
      EXPECT_EQ(tables.size() + state.size(), src.bytes()) << cut;
      GroupedKvCache dst(g, 2, N, H, hd, tables, RopeConfig{});
      dst.load_state(state, std::vector<int64_t>{cut, cut});
      for (int t = cut; t <= N; ++t) {
        ASSERT_EQ(dst.bytes(), src.bytes()) << cut << " " << t;
        src.attend(1, q, 4, a);
        dst.attend(1, q, 4, b);
        ASSERT_EQ(a, b) << cut << " " << t;
        if (t == N) break;
        src.write(0, t, K[static_cast<size_t>(t)], V[static_cast<size_t>(t)]), src.write(1, t, K[static_cast<size_t>(t)], V[static_cast<size_t>(t)]);
        dst.write(0, t, K[static_cast<size_t>(t)], V[static_cast<size_t>(t)]), dst.write(1, t, K[static_cast<size_t>(t)], V[static_cast<size_t>(t)]);
      }
      std::vector<uint8_t> s1, s2;
      src.save_state(s1);
      dst.save_state(s2);
      EXPECT_EQ(s1, s2);
    }
    // A state that does not fit is refused and leaves the cache empty.
    std::vector<uint8_t> tables, state;
    c.save_tables(tables);
    c.save_state(state);  // empty cache: just nothing
    GroupedKvCache dst(g, 2, N, H, hd, tables, RopeConfig{});
    EXPECT_NE(ErrorOf([&] { dst.load_state(state, std::vector<int64_t>{5, 5}); }).find("truncated"), std::string::npos);
    EXPECT_EQ(dst.written(0), 0);
  }
}

TEST(GroupedKv, BadArgumentsAreClearErrors) {
  const GroupedKvScheme g = parse_grouped_kv_scheme("k4v4g16");
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 64, 2, 7); }).find("head_dim"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 64, 2, 12); }).find("multiple of 8"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 0, 64, 2, 8); }).find("n_layers"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 0, 2, 8); }).find("max_seq"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1000, 1 << 27, 64, 128); }).find("exceeds the limits"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 16, 1 << 20, 128); }).find("exceeds the limits"), std::string::npos);
  RopeConfig bad_rope;
  bad_rope.theta = -1;
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 16, 2, 8, nullptr, bad_rope); }).find("theta"), std::string::npos);
  GroupedKvScheme bad = g;
  bad.group = 40;
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(bad, 1, 64, 2, 8); }).find("multiple of 16"), std::string::npos);
  bad = g;
  bad.recent = -1;
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(bad, 1, 64, 2, 8); }).find("recent"), std::string::npos);
  EXPECT_NE(ErrorOf([] { RopeTable r(8, 5); }).find("even"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 16, 2, 8, std::vector<uint8_t>(3), RopeConfig{}); }).find("tables"),
            std::string::npos);

  GroupedKvCache c(g, 2, 40, 2, 8);
  std::vector<float> x(16, 0.5f), y(16, 0.25f);
  std::vector<float> q(4 * 8, 0.1f), out(q.size());
  EXPECT_NE(ErrorOf([&] { c.attend(0, q, 4, out); }).find("nothing written"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.write(2, 0, x, y); }).find("layer"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.write(0, 0, std::span<const float>(x).first(15), y); }).find("16 values"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.write(0, 1, x, y); }).find("in order"), std::string::npos);
  for (float badv : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 70000.0f}) {
    std::vector<float> z = x;
    z[3] = badv;
    EXPECT_NE(ErrorOf([&] { c.write(0, 0, z, y); }).find("fp16 range"), std::string::npos);
    EXPECT_NE(ErrorOf([&] { c.write(0, 0, x, z); }).find("fp16 range"), std::string::npos);
    EXPECT_EQ(c.written(0), 0);  // nothing stored
  }
  for (int t = 0; t < 20; ++t) c.write(0, t, x, y);
  EXPECT_NE(ErrorOf([&] { c.attend(0, q, 3, out); }).find("n_heads"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.attend(0, std::span<const float>(q).first(31), 4, out); }).find("q:"), std::string::npos);
  std::vector<float> qn = q;
  qn[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(ErrorOf([&] { c.attend(0, qn, 4, out); }).find("non-finite"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.attend(0, q, 4, out, -1); }).find("threads"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.coded_part(0, q, 4, -1); }).find("threads"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.read(0, 20, x, y); }).find("pos"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.group_params(0, 1, 0, 0, x, y); }).find("group_params"), std::string::npos);
  c.attend(0, q, 4, out);  // still usable
  for (float o : out) EXPECT_NEAR(o, 0.25f, 1e-6f);
}

// Greedy reverse water-filling by hand: weights 1, 16, 256, 4096, 3 bits on
// average (12 in all), from 1 bit each: the 8 extra bits go to channels 3,
// 3, 2, 3, 2, 3, 1, 2 (largest w 4^-b first, ties to the lowest index).
TEST(GroupedKv, ChannelBitsAllocatedByHand) {
  const std::vector<float> w = {1, 16, 256, 4096};
  EXPECT_EQ(allocate_channel_bits(w, 3), (std::vector<int>{1, 2, 4, 5}));
  EXPECT_EQ(allocate_channel_bits(w, 3, 3), (std::vector<int>{3, 3, 3, 3}));  // min = average: uniform
  EXPECT_EQ(allocate_channel_bits(w, 6, 1, 6), (std::vector<int>{6, 6, 6, 6}));
  const std::vector<float> zero = {0, 0, 0};
  EXPECT_EQ(allocate_channel_bits(zero, 2), (std::vector<int>{2, 2, 2}));  // ties: the fewest bits first (round robin)
  EXPECT_NE(ErrorOf([&] { allocate_channel_bits(std::vector<float>{1, -1}, 2); }).find("weights"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { allocate_channel_bits(std::vector<float>{1, NAN}, 2); }).find("weights"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { allocate_channel_bits(w, 9); }).find("bits"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { allocate_channel_bits(w, 2, 3); }).find("bits"), std::string::npos);
}

// Calibrated (static ranges, coded on arrival): every token read back as its
// code's value on the static grid (clamped to the range), K in the tile
// frame; the allocation per quad keeps each head's bits.
TEST(GroupedKv, CalibratedTokensReadAsTheirStaticCodes) {
  const int H = 2, hd = 8, E = H * hd, N = 77;
  for (const char* name : {"k4v3c", "k4av4cr9s2"}) {
    SCOPED_TRACE(name);
    const GroupedKvScheme g = parse_grouped_kv_scheme(name);
    const StaticRanges ranges = SyntheticRanges(1, H, hd, 2.5f, 5);
    GroupedKvCache c(g, 1, N, H, hd, &ranges);
    test::Rng rng(17);
    std::vector<std::vector<float>> KT;
    for (int t = 0; t < N; ++t) {
      std::vector<float> k(E), v(E);
      for (int i = 0; i < E; ++i) {
        k[static_cast<size_t>(i)] = ranges.k_lo[static_cast<size_t>(i)] + 2.5f + static_cast<float>(rng.Gaussian());
        v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
      }
      if (t == 40) k[3] = 40.0f;  // outside every range: clamped
      c.write(0, t, k, v);
      KT.push_back(ToTileFrame(k, H, hd, t, g.sinks));
    }
    std::vector<float> rk(E), rv(E);
    for (int t = g.sinks; t < N - g.recent; ++t) {
      c.read(0, t, rk, rv);
      std::vector<float> want(E);
      for (int i = 0; i < E; ++i) {
        uint16_t lo, st;
        std::vector<uint8_t> code(2);
        const int bits = c.k_quad_bits(0, i / hd, (i % hd) / 4);
        const float ends[2] = {ranges.k_lo[static_cast<size_t>(i)], ranges.k_hi[static_cast<size_t>(i)]};
        encode_group_channel_ref(ends, 2, 1, bits, &lo, &st, code.data());  // the grid of the range
        const float lof = f16_to_f32_ref(lo), sf = f16_to_f32_ref(st);
        const float x = KT[static_cast<size_t>(t)][static_cast<size_t>(i)];
        want[static_cast<size_t>(i)] = lof + sf * std::clamp(std::nearbyint((x - lof) * (1.0f / sf)), 0.0f, static_cast<float>((1 << bits) - 1));
      }
      ASSERT_EQ(rk, FromTileFrame(want, H, hd, t, g.sinks)) << t;
    }
  }
  const GroupedKvScheme cal = parse_grouped_kv_scheme("k4v4c");
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(cal, 1, 32, 2, 8); }).find("needs calibrated ranges"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(parse_grouped_kv_scheme("k4v4g16p8"), 1, 32, 2, 8); })
                .find("needs calibrated ranges"),
            std::string::npos);
  for (const char* bad : {"k4v4g16p4", "k4v4cp8", "k4v4g16p", "k4v4g16o8p8"}) {
    EXPECT_NE(ErrorOf([&] { parse_grouped_kv_scheme(bad); }).find("k<bits>"), std::string::npos) << bad;
  }
  StaticRanges wrong = SyntheticRanges(1, 2, 8, 1.0f, 1);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(cal, 2, 32, 2, 8, &wrong); }).find("ranges"), std::string::npos);
  wrong.k_lo[3] = wrong.k_hi[3] + 1;
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(cal, 1, 32, 2, 8, &wrong); }).find("lo <= hi"), std::string::npos);
  StaticRanges no_weights = SyntheticRanges(1, 2, 8, 1.0f, 1);
  no_weights.k_weight.clear();
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(parse_grouped_kv_scheme("k3av3g16"), 1, 32, 2, 8, &no_weights); })
                .find("weights"),
            std::string::npos);
}

// m: each group channel's range is the one of least squared error among
// [mn + a w / 16, mx - b w / 16] (w = mx - mn) tried with b = 0, a = 0..4,
// then with the best a and b = 1..4, stored as the fp16 lo / step of those
// ends: the values read back have exactly the least squared error of that
// search done by brute force here, never more than min / max's, and less
// where an outlier stretches the range.
TEST(GroupedKv, MseRangesHaveTheLeastSquaredErrorOfTheirCandidates) {
  const GroupedKvScheme m = parse_grouped_kv_scheme("k2v2g16m");
  EXPECT_TRUE(m.mse_ranges);
  EXPECT_EQ(m.name(), "k2v2g16m");
  EXPECT_EQ(parse_grouped_kv_scheme("k2av2g64p8mo4x4r8").name(), "k2av2g64p8mo4x4r8");
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k2v2cm"); }).find("k<bits>"), std::string::npos);
  const int H = 1, hd = 8, E = 8, G = 16;
  GroupedKvCache cm(m, 1, G, H, hd), c0(parse_grouped_kv_scheme("k2v2g16"), 1, G, H, hd);
  test::Rng rng(31);
  std::vector<std::vector<float>> V;
  for (int t = 0; t < G; ++t) {
    std::vector<float> k(E), v(E);
    for (int i = 0; i < E; ++i) v[static_cast<size_t>(i)] = k[static_cast<size_t>(i)] = F16(rng.Gaussian());
    if (t == 5) v[0] = 12.0f;  // an outlier in channel 0
    cm.write(0, t, k, v);
    c0.write(0, t, k, v);
    V.push_back(v);
  }
  std::vector<float> rk(E), vm(E), v0(E);
  for (int i = 0; i < E; ++i) {
    double sm = 0, s0 = 0;
    for (int t = 0; t < G; ++t) {
      cm.read(0, t, rk, vm);
      c0.read(0, t, rk, v0);
      const double x = V[static_cast<size_t>(t)][static_cast<size_t>(i)];
      sm += (vm[static_cast<size_t>(i)] - x) * (vm[static_cast<size_t>(i)] - x);
      s0 += (v0[static_cast<size_t>(i)] - x) * (v0[static_cast<size_t>(i)] - x);
    }
    float mn = V[0][static_cast<size_t>(i)], mx = mn;
    for (int t = 1; t < G; ++t) mn = std::min(mn, V[static_cast<size_t>(t)][static_cast<size_t>(i)]), mx = std::max(mx, V[static_cast<size_t>(t)][static_cast<size_t>(i)]);
    const float w = mx - mn;
    double best = std::numeric_limits<double>::infinity();
    int best_a = 0;
    for (int pass = 0; pass < 2; ++pass) {
      for (int k = pass; k <= 4; ++k) {
        const int a = pass == 0 ? k : best_a, b = pass == 0 ? 0 : k;
        const float ends[2] = {mn + w * static_cast<float>(a) / 16.0f, mx - w * static_cast<float>(b) / 16.0f};
        uint16_t lo, st;
        uint8_t unused[2];
        encode_group_channel_ref(ends, 2, 1, 2, &lo, &st, unused);
        const float lf = f16_to_f32_ref(lo), sf = f16_to_f32_ref(st);
        float sse = 0;  // in float, as the coder sums
        for (int t = 0; t < G; ++t) {
          const float x = V[static_cast<size_t>(t)][static_cast<size_t>(i)];
          const float q = sf == 0.0f ? 0.0f : std::clamp(std::nearbyint((x - lf) * (1.0f / sf)), 0.0f, 3.0f);
          const float e = x - (lf + sf * q);
          sse = sse + e * e;
        }
        if (sse < best) best = sse, best_a = a;
      }
    }
    EXPECT_NEAR(sm, best, 1e-9 + 1e-6 * best) << i;
    EXPECT_LE(sm, s0 * (1 + 1e-9)) << i;
    if (i == 0) EXPECT_LT(sm, 0.8 * s0);
  }
}

// o8: the open tokens in 8-bit codes on the previous group's range widened
// to twice its width; bytes counted by hand for one run with one fp16
// fallback, and every open token within half an 8-bit step.
TEST(GroupedKv, OpenTokensInEightBitsCountedByHand) {
  const GroupedKvScheme g = parse_grouped_kv_scheme("k4v2g16o8x2");
  const int H = 1, hd = 8, E = 8, N = 45;
  GroupedKvCache c(g, 1, 60, H, hd);
  test::Rng rng(23);
  std::vector<std::vector<float>> KT, V;
  for (int t = 0; t < N; ++t) {
    std::vector<float> kt(E), v(E);
    // Every group spans [-1, 1] in every channel (its first two tokens) in
    // the tile frame, the rest inside (-0.5, 0.5): the widened grid [-2, 2]
    // holds every value.
    for (int i = 0; i < E; ++i) {
      const float x = t % 16 == 0 ? 1.0f : t % 16 == 1 ? -1.0f : static_cast<float>(rng.Uniform() - 0.5);
      kt[static_cast<size_t>(i)] = F16(x);
      v[static_cast<size_t>(i)] = F16(-x);
    }
    if (t == 37) kt[2] = 50.0f;  // far outside group 1's range: held in fp16 (and widens group 2's)
    c.write(0, t, FromTileFrame(kt, H, hd, t), v);
    KT.push_back(kt), V.push_back(v);
  }
  // T = 45: groups 0, 1 coded ([0, 32)), group 2 open;
  // open tokens 32..44: 43, 44 are the x2 fp16 ones, 37's K fell back (its V
  // stays in 8 bits: fallbacks are per unit), the other 10 in 8 bits, each
  // open coded token with a flag byte. Bytes: codes 32 x E x (4 + 2) / 8,
  // parameters of the 2 complete groups x 8E, fp16 2 x 4E, token 37 2E
  // (fp16 K unit) + E (8-bit V) + 1, the others 10 x (2E + 1).
  const uint64_t by_hand = 32 * E * 6 / 8 + 2 * 8 * E + 2 * 4 * E + (2 * E + E + 1) + 10 * (2 * E + 1);
  EXPECT_EQ(c.layer_bytes(0), by_hand);
  EXPECT_EQ(g.layer_bytes(45, H, hd), by_hand - E);  // the formula counts no fallback
  {  // Two KV heads, one value of head 1's K outside: only that unit (8 values) in fp16.
    GroupedKvCache c2(g, 1, 40, 2, hd);
    for (int t = 0; t < 40; ++t) {
      std::vector<float> kt(16, t % 16 == 0 ? 1.0f : t % 16 == 1 ? -1.0f : 0.25f), v(kt);
      if (t == 37) kt[8 + 3] = 50.0f;
      c2.write(0, t, FromTileFrame(kt, 2, hd, t), v);
    }
    EXPECT_EQ(c2.layer_bytes(0), g.layer_bytes(40, 2, hd) + 8);
    std::vector<float> rk(16), rv(16), want(16, 0.25f);
    c2.read(0, 37, rk, rv);
    want[8 + 3] = 50.0f;
    const std::vector<float> w = FromTileFrame(want, 2, hd, 37);
    for (int i = 8; i < 16; ++i) EXPECT_NEAR(rk[static_cast<size_t>(i)], w[static_cast<size_t>(i)], 1e-6f * 64);
    for (int i = 0; i < 16; ++i) EXPECT_NEAR(rv[static_cast<size_t>(i)], 0.25f, 2.0f / 255);
  }
  // Every open token within half an 8-bit step of the widened grid (rotated back).
  std::vector<float> rk(E), rv(E);
  for (int t = 32; t < N - 2; ++t) {
    c.read(0, t, rk, rv);
    for (int i = 0; i < E; ++i) {
      const float tol = (t < 48 ? 4.0f / 255 : 102.0f / 255) * 0.5f * 1.01f;
      if (t == 37 && i == 2) continue;
      ASSERT_NEAR(rv[static_cast<size_t>(i)], V[static_cast<size_t>(t)][static_cast<size_t>(i)], tol) << t;
    }
  }
  // Without a fallback the cache counts what the formula says, at every
  // length (sinks, the first group, the last x, the w tier, hand-overs).
  StaticRanges unit_ranges;  // for p8's grids
  unit_ranges.n_layers = 2, unit_ranges.n_kv_heads = H, unit_ranges.head_dim = hd, unit_ranges.samples = 1;
  unit_ranges.k_lo.assign(2 * E, -1.0f), unit_ranges.k_hi.assign(2 * E, 1.0f);
  unit_ranges.v_lo = unit_ranges.k_lo, unit_ranges.v_hi = unit_ranges.k_hi;
  for (const char* name : {"k4v2g16o8x2", "k3v3g16o8x4r8s3", "k2v4g32o8r5", "k2v2g32o4x2r5", "k3v2g16p8o3x1s2",
                           "k2v2g32p8mo4x2w3r5", "k3v2g16o4w4s2"}) {
    const GroupedKvScheme gs = parse_grouped_kv_scheme(name);
    GroupedKvCache cc(gs, 2, 80, H, hd, &unit_ranges);
    for (int t = 0; t < 80; ++t) {
      std::vector<float> kt(E, (t % 16) == 0 ? 1.0f : (t % 16) == 1 ? -1.0f : 0.25f), v(kt);
      const std::vector<float> k = FromTileFrame(kt, H, hd, t, gs.sinks);
      cc.write(0, t, k, v);
      cc.write(1, t, k, v);
      ASSERT_EQ(cc.layer_bytes(0), gs.layer_bytes(t + 1, H, hd)) << name << " T " << t + 1;
      ASSERT_EQ(cc.bytes(), 2 * gs.layer_bytes(t + 1, H, hd)) << name;
    }
  }
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16x4"); }).find("k<bits>"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16o2"); }).find("k<bits>"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16o8w2"); }).find("w<W>"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16w2"); }).find("k<bits>"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16o9"); }).find("k<bits>"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4co8"); }).find("k<bits>"), std::string::npos);
  // w<W>: the last W open tokens (before the last x) in 8 bits, the rest in N.
  const GroupedKvScheme w3 = parse_grouped_kv_scheme("k4v2g16o4x2w3");
  EXPECT_EQ(w3.name(), "k4v2g16o4x2w3");
  EXPECT_EQ(w3.wide_start(45), 40);  // open 32..44: x 43, 44; w 40..42; 4 bits 32..39
  {  // Read back: the w tier within half an 8-bit step of the widened grid,
     // older open tokens half a 4-bit one.
    const GroupedKvScheme gw = parse_grouped_kv_scheme("k4v2g16o4w3");
    GroupedKvCache cw(gw, 1, 48, 1, hd);
    test::Rng r2(5);
    std::vector<std::vector<float>> V2;
    for (int t = 0; t < 45; ++t) {
      std::vector<float> v(E);
      for (int i = 0; i < E; ++i) {
        const float x = t % 16 == 0 ? 1.0f : t % 16 == 1 ? -1.0f : static_cast<float>(r2.Uniform() - 0.5);
        v[static_cast<size_t>(i)] = F16(x);
      }
      cw.write(0, t, FromTileFrame(v, 1, hd, t), v);
      V2.push_back(v);
    }
    for (int t = 32; t < 45; ++t) {
      cw.read(0, t, rk, rv);
      const float tol = (t >= gw.wide_start(45) ? 4.0f / 255 : 4.0f / 15) * 0.5f * 1.01f;
      for (int i = 0; i < E; ++i) ASSERT_NEAR(rv[static_cast<size_t>(i)], V2[static_cast<size_t>(t)][static_cast<size_t>(i)], tol) << t;
    }
    EXPECT_EQ(gw.wide_start(45), 42);
    EXPECT_EQ(cw.layer_bytes(0), gw.layer_bytes(45, 1, hd));
  }
}

}  // namespace
}  // namespace kvq
