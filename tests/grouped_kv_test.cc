// Grouped low-bit KV caches (grouped_kv.h): names, bits by hand, the group
// code against an independent scalar implementation, the open group and its
// hand-over to codes, RoPE at read time, the fused kernel on every target
// against the reference, and every bad argument.
#include "kvq/grouped_kv.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvq/attention.h"
#include "kvq/half.h"
#include "tests/test_util.h"

namespace kvq {
namespace {

using test::ErrorOf;

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
}

// One geometry by hand: k4v3g64r16s4, T = 200, 2 KV heads of 8 (E = 16).
// coded_end = 4 + 64 floor((200 - 16 - 4) / 64) = 132: 128 coded tokens in
// 2 groups, 72 exact. Per element of K and V: codes 128 (4 + 3), parameters
// 2 groups x 2 (K, V) x 32 bits, exact 72 x 2 x 16 bits; / (2 x 200).
TEST(GroupedKvScheme, BitsCountedByHand) {
  const GroupedKvScheme g = parse_grouped_kv_scheme("k4v3g64r16s4");
  EXPECT_EQ(g.coded_end(200), 132);
  EXPECT_DOUBLE_EQ(g.bits(200), (128.0 * 7 + 2 * 64 + 72 * 32) / 400.0);  // 8.32
  EXPECT_DOUBLE_EQ(g.bits(200), 8.32);
  // Below the first hand-over everything is exact fp16.
  EXPECT_EQ(g.coded_end(83), 4);
  EXPECT_DOUBLE_EQ(g.bits(83), 16.0);
  EXPECT_EQ(g.coded_end(84), 68);
  // Steady state: the mean over T = ctx - 127 .. ctx.
  double s = 0;
  for (int T = 385; T <= 512; ++T) s += g.bits(T);
  EXPECT_DOUBLE_EQ(g.steady_state_bits(512), s / 128);
  EXPECT_EQ(g.coded_end(532), 516);                   // a hand-over at T = 532
  EXPECT_GT(g.steady_state_bits(512), g.bits(532));  // right after a hand-over is cheaper than the mean
  EXPECT_LT(g.steady_state_bits(512), g.bits(531));  // right before, dearer
  // The cache's bytes agree: 1 layer, E = 16 elements per token.
  GroupedKvCache c(g, 1, 256, 2, 8);
  EXPECT_EQ(c.bytes(200), 128u * 16 * 7 / 8 + 2u * 16 * 8 + 72u * 16 * 4);
  EXPECT_DOUBLE_EQ(8.0 * static_cast<double>(c.bytes(200)) / (2.0 * 200 * 16), 8.32);
  EXPECT_EQ(c.group_bytes_k(), 4u * 8 + 64u * 8 * 4 / 8);
  EXPECT_EQ(c.group_bytes_v(), 4u * 8 + 64u * 8 * 3 / 8);
  // p8: per group and channel 8-bit a and b for K and for V (32 bits, not
  // 64), and the grid table once (fp16 base and unit of K and V: 64 bits).
  const GroupedKvScheme p8 = parse_grouped_kv_scheme("k4v3g64p8r16s4");
  EXPECT_TRUE(p8.params8);
  EXPECT_EQ(p8.name(), "k4v3g64p8r16s4");
  EXPECT_DOUBLE_EQ(p8.bits(200), (128.0 * 7 + 2 * 32 + 64 + 72 * 32) / 400.0);  // 8.32 - 0.16 + 0.16
  EXPECT_DOUBLE_EQ(p8.bits(1), (64 + 32) / 2.0);  // one sink token: the table is there from the start
  StaticRanges r;
  r.n_layers = 1, r.n_kv_heads = 2, r.head_dim = 8, r.samples = 1;
  r.k_lo.assign(16, -1.0f), r.k_hi.assign(16, 1.0f), r.v_lo = r.k_lo, r.v_hi = r.k_hi;
  GroupedKvCache cp(p8, 1, 256, 2, 8, &r);
  EXPECT_EQ(cp.bytes(200), (128u * 7 + 2u * 32 + 64 + 72u * 32) * 16 / 8);
  EXPECT_EQ(cp.group_bytes_k(), 2u * 8 + 64u * 8 * 4 / 8);
  EXPECT_EQ(cp.group_bytes_v(), 2u * 8 + 64u * 8 * 3 / 8);
}

// An independent scalar version of the channel code: directed fp16
// rounding by search over neighbours in double.
void NaiveChannelCode(const std::vector<float>& x, int bits, uint16_t* lo, uint16_t* step, std::vector<int>& q) {
  const double mn = *std::min_element(x.begin(), x.end()), mx = *std::max_element(x.begin(), x.end());
  auto f = [](uint16_t h) { return static_cast<double>(f16_to_f32_ref(h)); };
  // lo: the largest fp16 <= mn.
  uint16_t best = 0xFBFF;  // -65504
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
    q[t] = sf == 0.0f ? 0 : std::clamp(static_cast<int>(std::nearbyint((x[t] - lof) / sf)), 0, levels);
  }
}

// Code j of an 8-code block (grouped_kv.h layout), bit by bit: the low
// plane (min(B, 4) bits per code) in the first bytes, the high plane
// (B - 4 bits per code) from byte 4.
uint32_t Block8Code(const uint8_t* p, int j, int b) {
  const int lb = std::min(b, 4);
  uint32_t v = 0;
  for (int k = 0; k < lb; ++k) {
    const int bit = j * lb + k;
    v |= static_cast<uint32_t>((p[bit / 8] >> (bit % 8)) & 1) << k;
  }
  for (int k = 0; k < b - 4; ++k) {
    const int bit = j * (b - 4) + k;
    v |= static_cast<uint32_t>((p[4 + bit / 8] >> (bit % 8)) & 1) << (4 + k);
  }
  return v;
}

TEST(GroupedKv, GroupCodesMatchAnIndependentScalarImplementationBitForBit) {
  test::Rng rng(7);
  const int H = 2, hd = 8, G = 32, E = H * hd;
  for (int bits : {2, 3, 4, 5, 6, 7, 8}) {
    SCOPED_TRACE(bits);
    GroupedKvScheme g{bits, bits == 8 ? 2 : bits + 1, G, 0, 0};
    GroupedKvCache c(g, 1, 2 * G, H, hd);
    std::vector<float> k(static_cast<size_t>(2 * G * E)), v(k.size());
    auto f16 = [](double x) { return f16_to_f32_ref(f32_to_f16_ref(static_cast<float>(x))); };
    for (size_t i = 0; i < k.size(); ++i) {  // fp16 values: what the store holds for an open group
      const int ch = static_cast<int>(i % E);
      k[i] = f16(rng.Gaussian() * (ch == 3 ? 30.0 : 1.0) + (ch == 5 ? 7.0 : 0.0));
      v[i] = ch == 9 ? 1.25f : f16(rng.Gaussian());  // channel 9: constant (step 0)
    }
    for (int t = 0; t < 2 * G; ++t) {
      c.write(0, t, {k.data() + static_cast<size_t>(t * E), static_cast<size_t>(E)},
              {v.data() + static_cast<size_t>(t * E), static_cast<size_t>(E)});
    }
    for (int grp = 0; grp < 2; ++grp) {
      for (int which = 0; which < 2; ++which) {
        const int b = which == 0 ? g.k_bits : g.v_bits;
        const std::vector<float>& x = which == 0 ? k : v;
        for (int h = 0; h < H; ++h) {
          const uint8_t* data = c.group_data(0, which, h, grp);
          uint16_t lo[hd], st[hd];
          std::memcpy(lo, data, sizeof lo);
          std::memcpy(st, data + 2 * hd, sizeof st);
          for (int i = 0; i < hd; ++i) {
            std::vector<float> ch(G);
            for (int t = 0; t < G; ++t) ch[static_cast<size_t>(t)] = x[static_cast<size_t>((grp * G + t) * E + h * hd + i)];
            uint16_t elo, est;
            std::vector<int> q;
            NaiveChannelCode(ch, b, &elo, &est, q);
            ASSERT_EQ(lo[i], elo);
            ASSERT_EQ(st[i], est);
            // The exported reference agrees too.
            uint16_t rlo, rst;
            std::vector<uint8_t> rq(G);
            encode_group_channel_ref(ch.data(), G, 1, b, &rlo, &rst, rq.data());
            ASSERT_EQ(rlo, elo);
            ASSERT_EQ(rst, est);
            const uint8_t* codes = data + 4 * hd;
            for (int t = 0; t < G; ++t) {
              ASSERT_EQ(rq[static_cast<size_t>(t)], q[static_cast<size_t>(t)]);
              const uint32_t stored = which == 0 ? Block8Code(codes + ((t / 16) * hd + i) * 2 * b + ((t % 16) / 8) * b, t % 8, b)
                                                 : Block8Code(codes + t * hd * b / 8 + (i / 8) * b, i % 8, b);
              ASSERT_EQ(stored, static_cast<uint32_t>(q[static_cast<size_t>(t)])) << "t " << t << " ch " << i;
              // Error bound of the uniform code: half a step inside the range.
              const float dec = f16_to_f32_ref(elo) + f16_to_f32_ref(est) * static_cast<float>(q[static_cast<size_t>(t)]);
              ASSERT_LE(std::fabs(dec - ch[static_cast<size_t>(t)]), 0.5f * f16_to_f32_ref(est) * (1 + 1e-5f) + 1e-6f);
            }
          }
        }
      }
    }
  }
}

// Every token as read at every length: exact (fp16, after RoPE) while its
// group is open or inside the recent window or a sink, then its codes, the
// same codes at every later length.
TEST(GroupedKv, OpenGroupHandsOverToCodesAtTheRightLength) {
  test::Rng rng(11);
  const int H = 1, hd = 8, E = H * hd;
  const GroupedKvScheme g = parse_grouped_kv_scheme("k3v2g16r5s3");
  const int N = 60;
  GroupedKvCache c(g, 2, N, H, hd);
  std::vector<float> k(static_cast<size_t>(N * E)), v(k.size());
  for (float& x : k) x = static_cast<float>(rng.Gaussian());
  for (float& x : v) x = static_cast<float>(rng.Gaussian());
  const RopeTable rope(N, hd);
  std::vector<std::vector<float>> first_coded(N);
  for (int T = 1; T <= N; ++T) {
    const int t = T - 1;
    c.write(1, t, {k.data() + t * E, static_cast<size_t>(E)}, {v.data() + t * E, static_cast<size_t>(E)});
    EXPECT_EQ(c.written(1), T);
    EXPECT_EQ(c.written(0), 0);
    for (int pos = 0; pos < T; ++pos) {
      std::vector<float> rk(E), rv(E);
      c.read(1, pos, T, rk, rv);
      const bool coded = pos >= 3 && pos < g.coded_end(T);
      if (!coded) {
        std::vector<float> want(k.begin() + pos * E, k.begin() + (pos + 1) * E);
        rope.apply(want.data(), H, pos);
        for (int i = 0; i < E; ++i) {
          ASSERT_EQ(rk[i], f16_to_f32_ref(f32_to_f16_ref(want[i]))) << "T " << T << " pos " << pos;
          ASSERT_EQ(rv[i], f16_to_f32_ref(f32_to_f16_ref(v[pos * E + i])));
        }
      } else {
        std::vector<float> both(rk);
        both.insert(both.end(), rv.begin(), rv.end());
        if (first_coded[pos].empty()) {
          first_coded[pos] = both;
          // Handed over exactly when its group ended R tokens ago.
          EXPECT_EQ(T, 3 + ((pos - 3) / 16 + 1) * 16 + 5) << pos;
        } else {
          ASSERT_EQ(both, first_coded[pos]) << "T " << T << " pos " << pos;
        }
      }
    }
  }
  for (int pos = 3; pos < 3 + 48; ++pos) EXPECT_FALSE(first_coded[pos].empty()) << pos;
  // A new sequence starts at 0; positions out of order are refused.
  EXPECT_NE(ErrorOf([&] { c.write(1, 5, {k.data(), 8}, {v.data(), 8}); }).find("in order"), std::string::npos);
  c.write(1, 0, {k.data(), 8}, {v.data(), 8});
  EXPECT_EQ(c.written(1), 1);
}

// Keys on the code grid (every group spans codes 0..2^B - 1 with an fp16
// step) decode exactly, so RoPE at read time must equal RoPE before storage:
// the grouped cache's attention against the fp32 kernel over rotated keys.
TEST(GroupedKv, RopeAtReadEqualsRopeBeforeStoreForExactCodes) {
  test::ForEachTarget([](const char*) {
    const int H = 2, hd = 16, E = H * hd, G = 32, N = 200, nq = 8;
    const GroupedKvScheme g{4, 4, G, 0, 0};
    GroupedKvCache c(g, 1, N, H, hd);
    KvCache ref(KvScheme::Fp32, 1, N, H, hd);
    test::Rng rng(3);
    const RopeTable rope(N, hd);
    for (int t = 0; t < N; ++t) {
      std::vector<float> k(E), v(E);
      for (int i = 0; i < E; ++i) {
        int q = static_cast<int>(rng.Next() % 16);
        if (t % G == 0) q = 0;   // every group holds codes 0 and 15
        if (t % G == 1) q = 15;
        k[static_cast<size_t>(i)] = -1.0f + 0.125f * static_cast<float>(q) * static_cast<float>(1 + i % 3);
        v[static_cast<size_t>(i)] = 0.5f + 0.25f * static_cast<float>(q);
      }
      c.write(0, t, k, v);
      rope.apply(k.data(), H, t);
      ref.write(0, t, k, v);
    }
    std::vector<float> q(nq * hd), a(q.size()), b(q.size());
    for (float& x : q) x = static_cast<float>(rng.Gaussian());
    for (int T : {32, 64, 160, 192}) {  // every token coded (no exact fp16 rows)
      SCOPED_TRACE(T);
      ASSERT_EQ(g.coded_end(T), T);
      c.attend(0, T, q, nq, a);
      decode_attention(q, nq, ref.view(0, T), b);
      // Only float rounding differs (the rotation built by angle addition).
      for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5f) << i;
    }
  });
}

// The fused kernel on every target against the decode-then-attend reference.
// Both read the same codes; the kernel differs by float accumulation and by
// building each token's rotation from its tile's first position (angle
// addition, a few ulps of cos/sin): |error| <= 2 max|v| (dS + 1e-6) with
// dS = 64 hd 2^-24 max_t s sum_i |q_i k_ti| the score error.
TEST(GroupedKv, FusedKernelMatchesTheReferenceOnEveryTarget) {
  struct Case {
    const char* scheme;
    int H, hd, nq, N, threads;
  };
  const Case cases[] = {{"k4v4g16", 1, 8, 1, 40, 1},      {"k3v2g32r5s3", 2, 8, 8, 150, 1},
                        {"k2v3g64r16", 4, 64, 16, 300, 2}, {"k8v8g16", 2, 128, 8, 100, 1},
                        {"k5v6g48s1", 1, 32, 4, 200, 3}};
  test::ForEachTarget([&](const char*) {
    for (const Case& cs : cases) {
      SCOPED_TRACE(cs.scheme);
      const GroupedKvScheme g = parse_grouped_kv_scheme(cs.scheme);
      GroupedKvCache c(g, 2, cs.N, cs.H, cs.hd);
      test::Rng rng(static_cast<uint64_t>(cs.N));
      const int E = cs.H * cs.hd;
      float vmax = 0;
      for (int t = 0; t < cs.N; ++t) {
        std::vector<float> k(static_cast<size_t>(E)), v(k.size());
        for (int i = 0; i < E; ++i) {
          k[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian()) * (i % 7 == 2 ? 4.0f : 1.0f) + 0.3f * (i % 5);
          v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
          vmax = std::max(vmax, std::fabs(v[static_cast<size_t>(i)]));
        }
        c.write(1, t, k, v);
      }
      std::vector<float> q(static_cast<size_t>(cs.nq * cs.hd)), a(q.size()), b(q.size());
      for (float& x : q) x = static_cast<float>(rng.Gaussian()) * 2.0f;
      for (int T : {1, cs.N / 3, cs.N - 1, cs.N}) {
        SCOPED_TRACE(T);
        c.attend(1, T, q, cs.nq, a, cs.threads);
        c.attend_ref(1, T, q, cs.nq, b);
        double smax = 0;
        std::vector<float> kk(static_cast<size_t>(E)), vv(kk.size());
        for (int t = 0; t < T; ++t) {
          c.read(1, t, T, kk, vv);
          for (int h = 0; h < cs.nq; ++h) {
            double s = 0;
            const int kh = h / (cs.nq / cs.H);
            for (int i = 0; i < cs.hd; ++i) s += std::fabs(q[static_cast<size_t>(h * cs.hd + i)] * kk[static_cast<size_t>(kh * cs.hd + i)]);
            smax = std::max(smax, s / std::sqrt(static_cast<double>(cs.hd)));
          }
        }
        const double tol = 2.0 * (vmax + 1) * (64.0 * cs.hd * 0x1.0p-24 * smax + 1e-6);
        for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], tol) << i;
      }
    }
  });
}

TEST(GroupedKv, BadArgumentsAreClearErrors) {
  const GroupedKvScheme g = parse_grouped_kv_scheme("k4v4g16");
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 64, 2, 7); }).find("head_dim"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 64, 2, 12); }).find("multiple of 8"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 0, 64, 2, 8); }).find("n_layers"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 0, 2, 8); }).find("max_seq"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1000, 1 << 30, 64, 128); }).find("exceeds the limits"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(g, 1, 16, 1 << 20, 128); }).find("exceeds the limits"), std::string::npos);
  GroupedKvScheme bad = g;
  bad.group = 40;
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(bad, 1, 64, 2, 8); }).find("multiple of 16"), std::string::npos);
  bad = g;
  bad.recent = -1;
  EXPECT_NE(ErrorOf([&] { GroupedKvCache c(bad, 1, 64, 2, 8); }).find("recent"), std::string::npos);
  EXPECT_NE(ErrorOf([] { RopeTable r(8, 5); }).find("even"), std::string::npos);

  GroupedKvCache c(g, 2, 40, 2, 8);
  std::vector<float> x(16, 0.5f), y(16, 0.25f);
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
  std::vector<float> q(4 * 8, 0.1f), out(q.size());
  EXPECT_NE(ErrorOf([&] { c.attend(0, 21, q, 4, out); }).find("T: expected 1..20"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.attend(0, 0, q, 4, out); }).find("T:"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.attend(0, 10, q, 3, out); }).find("n_heads"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.attend(0, 10, std::span<const float>(q).first(31), 4, out); }).find("q:"),
            std::string::npos);
  std::vector<float> qn = q;
  qn[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(ErrorOf([&] { c.attend(0, 10, qn, 4, out); }).find("non-finite"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.coded_part(0, 20, q, 4, -1); }).find("threads"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { c.read(0, 20, 20, x, y); }).find("pos"), std::string::npos);
  c.attend(0, 20, q, 4, out);  // still usable
  for (float o : out) EXPECT_NEAR(o, 0.25f, 1e-6f);
}

}  // namespace
}  // namespace kvq

namespace kvq {
namespace {

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

StaticRanges SyntheticRanges(int L, int H, int hd, float width, uint64_t seed) {
  test::Rng rng(seed);
  StaticRanges r;
  r.n_layers = L, r.n_kv_heads = H, r.head_dim = hd, r.samples = 1;
  for (int i = 0; i < L * H * hd; ++i) {
    const float c = static_cast<float>(rng.Gaussian());
    r.k_lo.push_back(c - width), r.k_hi.push_back(c + width);
    r.v_lo.push_back(-width), r.v_hi.push_back(width);
    r.k_weight.push_back(static_cast<float>(std::exp(3.0 * rng.Gaussian())));
  }
  return r;
}

// Calibrated (static ranges, coded on arrival) and allocated (per-channel K
// bits) caches: the fused kernel against the reference on every target,
// and every token read back as its code's value (clamped to the range).
TEST(GroupedKv, CalibratedAndAllocatedSchemesMatchTheReference) {
  struct Case {
    const char* scheme;
    int H, hd, nq, N;
  };
  const Case cases[] = {{"k4v3c", 2, 8, 8, 77}, {"k3av2g32r5", 2, 16, 4, 150}, {"k4av4cr9s2", 1, 64, 4, 100},
                        {"k3av3g16o8x3", 2, 8, 4, 90},
                        {"k3av2g32o8r16", 2, 16, 4, 90},
                        {"k2v3g16p8r3", 2, 8, 8, 77},
                        {"k3av2g32p8o4x2r5", 2, 16, 4, 150},
                        {"k2v2g16p8mo4x1w3r4", 2, 8, 4, 90}};
  test::ForEachTarget([&](const char*) {
    for (const Case& cs : cases) {
      SCOPED_TRACE(cs.scheme);
      const GroupedKvScheme g = parse_grouped_kv_scheme(cs.scheme);
      const StaticRanges ranges = SyntheticRanges(1, cs.H, cs.hd, 2.5f, 5);
      GroupedKvCache c(g, 1, cs.N, cs.H, cs.hd, &ranges);
      if (g.k_allocated) {  // each head keeps k_bits * head_dim bits, spread by weight
        for (int h = 0; h < cs.H; ++h) {
          int sum = 0, lo = 8, hi = 0;
          for (int i = 0; i < cs.hd; ++i) {
            const int b = c.k_channel_bits(0, h * cs.hd + i);
            sum += b, lo = std::min(lo, b), hi = std::max(hi, b);
          }
          EXPECT_EQ(sum, g.k_bits * cs.hd);
          EXPECT_LT(lo, hi);
        }
      }
      test::Rng rng(17);
      const int E = cs.H * cs.hd;
      std::vector<std::vector<float>> K, V;
      for (int t = 0; t < cs.N; ++t) {
        std::vector<float> k(static_cast<size_t>(E)), v(k.size());
        for (int i = 0; i < E; ++i) {
          k[static_cast<size_t>(i)] = ranges.k_lo[static_cast<size_t>(i)] + 2.5f + static_cast<float>(rng.Gaussian());
          v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
        }
        if (t == 40) k[3] = 40.0f;  // outside every range: clamped (calibrated) or held in fp16 (o8)
        c.write(0, t, k, v);
        K.push_back(k), V.push_back(v);
      }
      std::vector<float> q(static_cast<size_t>(cs.nq * cs.hd)), a(q.size()), b(q.size());
      for (float& x : q) x = static_cast<float>(rng.Gaussian());
      for (int T : {1, 17, 40, cs.N / 2, cs.N}) {
        SCOPED_TRACE(T);
        c.attend(0, T, q, cs.nq, a, 2);
        c.attend_ref(0, T, q, cs.nq, b);
        for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 2e-4f) << i;
      }
      // p8 (groups coded from the written values, not from open codes): V of
      // coded groups within half a step of a range at most 2 grid units wider.
      if (g.params8 && !g.open_coded()) {
        std::vector<float> rk(static_cast<size_t>(E)), rv(rk.size());
        const int64_t ce = g.coded_end(cs.N);
        for (int64_t g0 = g.sinks; g0 < ce; g0 += g.group) {
          for (int i = 0; i < E; ++i) {
            float mn = V[static_cast<size_t>(g0)][static_cast<size_t>(i)], mx = mn;
            for (int64_t t = g0; t < g0 + g.group; ++t) {
              mn = std::min(mn, V[static_cast<size_t>(t)][static_cast<size_t>(i)]);
              mx = std::max(mx, V[static_cast<size_t>(t)][static_cast<size_t>(i)]);
            }
            // The grid of [-2.5, 2.5]: [-7.5, 7.5] in 255 units of 15 / 255
            // (fp16, rounded up), inside which every V value here lies.
            ASSERT_TRUE(mn > -7.5f && mx < 7.5f);
            const float unit = f16_to_f32_ref(f32_to_f16_ref(15.0f / 255.0f)) * (1 + 1e-3f);
            const float half_step = 0.5f * (mx - mn + 2 * unit) / static_cast<float>((1 << g.v_bits) - 1);
            for (int64_t t = g0; t < g0 + g.group; ++t) {
              c.read(0, t, cs.N, rk, rv);
              ASSERT_LE(std::fabs(rv[static_cast<size_t>(i)] - V[static_cast<size_t>(t)][static_cast<size_t>(i)]),
                        half_step * (1 + 1e-5f) + 1e-6f)
                  << t << " " << i;
            }
          }
        }
      }
      if (g.calibrated) {  // codes on the static grid, values clamped into it
        const RopeTable rope(cs.N, cs.hd);
        std::vector<float> rk(static_cast<size_t>(E)), rv(rk.size());
        for (int t = g.sinks; t < cs.N - g.recent; ++t) {
          c.read(0, t, cs.N, rk, rv);
          std::vector<float> want(rk.size());
          for (int i = 0; i < E; ++i) {
            uint16_t lo, st;
            std::vector<uint8_t> code(2);
            const int bits = c.k_channel_bits(0, i);
            // The grid of the range: encode its two ends, then the value.
            const float ends[2] = {ranges.k_lo[static_cast<size_t>(i)], ranges.k_hi[static_cast<size_t>(i)]};
            encode_group_channel_ref(ends, 2, 1, bits, &lo, &st, code.data());
            const float lof = f16_to_f32_ref(lo), sf = f16_to_f32_ref(st);
            const float x = K[static_cast<size_t>(t)][static_cast<size_t>(i)];
            const float qv = std::clamp(std::nearbyint((x - lof) / sf), 0.0f, static_cast<float>((1 << bits) - 1));
            want[static_cast<size_t>(i)] = lof + sf * qv;
          }
          rope.apply(want.data(), cs.H, t);
          for (int i = 0; i < E; ++i) ASSERT_NEAR(rk[static_cast<size_t>(i)], want[static_cast<size_t>(i)], 1e-5f) << t << " " << i;
        }
      }
    }
  });
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
// [mn + a w / 16, mx - b w / 16], a, b = 0..4 (w = mx - mn), stored as the
// fp16 lo / step of those ends: the values read back have exactly the least
// squared error of a brute-force search here, never more than min / max's,
// and less where an outlier stretches the range.
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
    for (int i = 0; i < E; ++i) {
      v[static_cast<size_t>(i)] = f16_to_f32_ref(f32_to_f16_ref(static_cast<float>(rng.Gaussian())));
      k[static_cast<size_t>(i)] = v[static_cast<size_t>(i)];
    }
    if (t == 5) v[0] = 12.0f;  // an outlier in channel 0
    cm.write(0, t, k, v);
    c0.write(0, t, k, v);
    V.push_back(v);
  }
  std::vector<float> rk(E), vm(E), v0(E);
  for (int i = 0; i < E; ++i) {
    double sm = 0, s0 = 0;
    for (int t = 0; t < G; ++t) {
      cm.read(0, t, G, rk, vm);
      c0.read(0, t, G, rk, v0);
      const double x = V[static_cast<size_t>(t)][static_cast<size_t>(i)];
      sm += (vm[static_cast<size_t>(i)] - x) * (vm[static_cast<size_t>(i)] - x);
      s0 += (v0[static_cast<size_t>(i)] - x) * (v0[static_cast<size_t>(i)] - x);
    }
    // Brute force: every candidate's fp16 lo / step (the ends encoded as a
    // two-value group), codes, squared error.
    float mn = V[0][static_cast<size_t>(i)], mx = mn;
    for (int t = 1; t < G; ++t) mn = std::min(mn, V[static_cast<size_t>(t)][static_cast<size_t>(i)]), mx = std::max(mx, V[static_cast<size_t>(t)][static_cast<size_t>(i)]);
    const float w = mx - mn;
    double best = std::numeric_limits<double>::infinity();
    for (int a = 0; a <= 4; ++a) {
      for (int b = 0; b <= 4; ++b) {
        const float ends[2] = {mn + w * static_cast<float>(a) / 16.0f, mx - w * static_cast<float>(b) / 16.0f};
        uint16_t lo, st;
        uint8_t unused[2];
        encode_group_channel_ref(ends, 2, 1, 2, &lo, &st, unused);
        const float lf = f16_to_f32_ref(lo), sf = f16_to_f32_ref(st);
        double sse = 0;
        for (int t = 0; t < G; ++t) {
          const float x = V[static_cast<size_t>(t)][static_cast<size_t>(i)];
          const float q = sf == 0.0f ? 0.0f : std::clamp(std::nearbyint((x - lf) / sf), 0.0f, 3.0f);
          sse += (lf + sf * q - x) * (lf + sf * q - static_cast<double>(x));
        }
        best = std::min(best, sse);
      }
    }
    EXPECT_NEAR(sm, best, 1e-9 + 1e-6 * best) << i;
    EXPECT_LE(sm, s0 * (1 + 1e-9)) << i;
    if (i == 0) EXPECT_LT(sm, 0.8 * s0);
  }
}

// o8: the open tokens in 8-bit codes on the previous group's range widened
// to twice its width; bits counted by hand for one run with one fp16
// fallback, and every open token within half an 8-bit step.
TEST(GroupedKv, OpenTokensInEightBitsCountedByHand) {
  const GroupedKvScheme g = parse_grouped_kv_scheme("k4v2g16o8x2");
  const int H = 1, hd = 8, E = 8, N = 60;
  GroupedKvCache c(g, 1, N, H, hd);
  test::Rng rng(23);
  std::vector<std::vector<float>> K;
  for (int t = 0; t < N; ++t) {
    std::vector<float> k(E), v(E);
    // Every group spans [-1, 1] in every channel (its first two tokens), the
    // rest inside (-0.5, 0.5): the widened grid [-2, 2] holds every value.
    for (int i = 0; i < E; ++i) {
      const float x = t % 16 == 0 ? 1.0f : t % 16 == 1 ? -1.0f : static_cast<float>(rng.Uniform() - 0.5);
      k[static_cast<size_t>(i)] = f16_to_f32_ref(f32_to_f16_ref(x));
      v[static_cast<size_t>(i)] = f16_to_f32_ref(f32_to_f16_ref(-x));
    }
    if (t == 37) k[2] = 50.0f;  // far outside group 1's range: held in fp16 (and widens group 2's)
    c.write(0, t, k, v);
    K.push_back(k);
  }
  // T = 45: groups 0, 1 coded ([0, 32)), open tokens 32..44: 43, 44 are the
  // x2 fp16 ones, 37's K fell back (its V stays in 8 bits: fallbacks are per
  // unit, a token's K or V of one KV head), the other 10 in 8 bits. Per
  // element of K and V: codes 32 x (4 + 2), parameters 2 groups x 2 x 32,
  // fp16 2 x 32, token 37 16 + 8, 8-bit 10 x 16; bits = that / (2 x 45).
  const double by_hand = (32.0 * 6 + 2 * 64 + 2 * 32 + 24 + 10 * 16) / 90.0;
  EXPECT_DOUBLE_EQ(c.bits(45), by_hand);
  EXPECT_EQ(c.bytes(45), static_cast<uint64_t>(by_hand * 90 * E / 8 + 0.5));
  // Without the fallback the scheme's formula would say one unit less in fp16.
  EXPECT_DOUBLE_EQ(g.bits(45), (32.0 * 6 + 2 * 64 + 2 * 32 + 11 * 16) / 90.0);
  {  // Two KV heads, one value of head 1's K outside: only that unit (8 values) in fp16.
    GroupedKvCache c2(g, 1, 40, 2, hd);
    for (int t = 0; t < 40; ++t) {
      std::vector<float> k(16, t % 16 == 0 ? 1.0f : t % 16 == 1 ? -1.0f : 0.25f), v(k);
      if (t == 37) k[8 + 3] = 50.0f;
      c2.write(0, t, k, v);
    }
    EXPECT_EQ(c2.bytes(40) * 8, static_cast<uint64_t>(g.stored_bits(40)) * 16 + 8 * (16 - 8));
    std::vector<float> rk(16), rv(16), want(16, 0.25f);
    c2.read(0, 37, 40, rk, rv);
    want[8 + 3] = 50.0f;
    RopeTable(40, hd).apply(want.data(), 2, 37);
    for (int i = 8; i < 16; ++i) EXPECT_EQ(rk[static_cast<size_t>(i)], f16_to_f32_ref(f32_to_f16_ref(want[static_cast<size_t>(i)])));
    for (int i = 0; i < 16; ++i) EXPECT_NEAR(rv[static_cast<size_t>(i)], 0.25f, 2.0f / 255);
  }
  // The first group has no previous range: all fp16 until it is coded.
  EXPECT_DOUBLE_EQ(c.bits(10), 16.0);
  // Without a fallback the cache counts what the scheme's formula says, at
  // every length (sinks, the first group, the last x, hand-overs).
  StaticRanges unit_ranges;  // for p8's grids
  unit_ranges.n_layers = 2, unit_ranges.n_kv_heads = H, unit_ranges.head_dim = hd, unit_ranges.samples = 1;
  unit_ranges.k_lo.assign(2 * E, -1.0f), unit_ranges.k_hi.assign(2 * E, 1.0f);
  unit_ranges.v_lo = unit_ranges.k_lo, unit_ranges.v_hi = unit_ranges.k_hi;
  for (const char* name : {"k4v2g16o8x2", "k3v3g16o8x4r8s3", "k2v4g32o8r5", "k2v2g32o4x2r5", "k3v2g16p8o3x1s2",
                           "k2v2g32p8mo4x2w3r5", "k3v2g16o4w4s2"}) {
    const GroupedKvScheme gs = parse_grouped_kv_scheme(name);
    GroupedKvCache cc(gs, 2, 80, H, hd, &unit_ranges);
    for (int t = 0; t < 80; ++t) {
      std::vector<float> k(E, (t % 16) == 0 ? 1.0f : (t % 16) == 1 ? -1.0f : 0.25f), v(k);
      cc.write(0, t, k, v);
      cc.write(1, t, k, v);
      ASSERT_EQ(cc.bytes(t + 1) * 8, static_cast<uint64_t>(gs.stored_bits(t + 1)) * E * 2) << name << " T " << t + 1;
      ASSERT_DOUBLE_EQ(cc.bits(t + 1), gs.bits(t + 1));
    }
  }
  const RopeTable rope(N, hd);
  std::vector<float> rk(E), rv(E);
  for (int T : {20, 45, 60}) {
    for (int t = static_cast<int>(g.coded_end(T)); t < T - 2; ++t) {
      c.read(0, t, T, rk, rv);
      std::vector<float> want = K[static_cast<size_t>(t)];
      rope.apply(want.data(), H, t);
      for (int i = 0; i < E; ++i) {
        if (t < 16 || t == 37) {
          ASSERT_EQ(rk[static_cast<size_t>(i)], f16_to_f32_ref(f32_to_f16_ref(want[static_cast<size_t>(i)])));
        } else {
          // Half an 8-bit step of the widened grid (x sqrt 2 for the rotation):
          // w ~ 2 -> 4 / 255 / 2; group 3's grid comes from group 2, whose
          // range reaches 50: w ~ 51.
          const float tol = (t < 48 ? 4.0f / 255 : 102.0f / 255) * 0.5f * 1.5f;
          ASSERT_NEAR(rk[static_cast<size_t>(i)], want[static_cast<size_t>(i)], tol) << t;
        }
      }
    }
  }
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16x4"); }).find("k<bits>"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16o2"); }).find("k<bits>"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16o8w2"); }).find("w<W>"), std::string::npos);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16w2"); }).find("k<bits>"), std::string::npos);
  // w<W>: the last W open tokens (before the last x) in 8 bits, the rest in N.
  {  // Read back: the w tier within half an 8-bit step of the widened grid
     // (w ~ 2: 4 / 255 / 2, x 1.5 for the rotation), older open tokens half a 4-bit one.
    const GroupedKvScheme gw = parse_grouped_kv_scheme("k4v2g16o4w3");
    GroupedKvCache cw(gw, 1, 48, 1, hd);
    test::Rng r2(5);
    std::vector<std::vector<float>> V2;
    for (int t = 0; t < 48; ++t) {
      std::vector<float> k(E), v(E);
      for (int i = 0; i < E; ++i) {
        const float x = t % 16 == 0 ? 1.0f : t % 16 == 1 ? -1.0f : static_cast<float>(r2.Uniform() - 0.5);
        k[static_cast<size_t>(i)] = v[static_cast<size_t>(i)] = f16_to_f32_ref(f32_to_f16_ref(x));
      }
      cw.write(0, t, k, v);
      V2.push_back(v);
    }
    std::vector<float> rk(E), rv(E);
    for (int t = 32; t < 45; ++t) {
      cw.read(0, t, 45, rk, rv);
      const float tol = (t >= gw.wide_start(45) ? 4.0f / 255 : 4.0f / 15) * 0.5f * 1.01f;
      for (int i = 0; i < E; ++i) ASSERT_NEAR(rv[static_cast<size_t>(i)], V2[static_cast<size_t>(t)][static_cast<size_t>(i)], tol) << t;
    }
    EXPECT_EQ(gw.wide_start(45), 42);
    EXPECT_EQ(cw.bytes(45) * 8, static_cast<uint64_t>(gw.stored_bits(45)) * E);
  }
  const GroupedKvScheme w3 = parse_grouped_kv_scheme("k4v2g16o4x2w3");
  EXPECT_EQ(w3.name(), "k4v2g16o4x2w3");
  EXPECT_EQ(w3.wide_start(45), 40);  // open 32..44: x 43, 44; w 40..42; 4 bits 32..39
  EXPECT_DOUBLE_EQ(w3.bits(45), (32.0 * 6 + 2 * 64 + 2 * 32 + 3 * 16 + 8 * 8) / 90.0);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4g16o9"); }).find("k<bits>"), std::string::npos);
  // o<N>, N = 3..8: the same grid in 2^N - 1 steps, counted at N bits.
  const GroupedKvScheme o4 = parse_grouped_kv_scheme("k4v2g16o4x2");
  EXPECT_EQ(o4.name(), "k4v2g16o4x2");
  EXPECT_DOUBLE_EQ(o4.bits(45), (32.0 * 6 + 2 * 64 + 2 * 32 + 11 * 8) / 90.0);
  EXPECT_NE(ErrorOf([] { parse_grouped_kv_scheme("k4v4co8"); }).find("k<bits>"), std::string::npos);
}

}  // namespace
}  // namespace kvq
