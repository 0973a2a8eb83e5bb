// The grouped caches' fused kernel (src/groups/attention.cc): the tile frame
// read back as the keys rotated, the kernel on every target against the
// decode-then-attend reference within a derived bound, and the wide integer
// path against the scalar loops bit for bit (with the largest sums).
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

// The derived bound of the fused kernel against the decode-then-attend
// reference (grouped_kv.h): for a coded token t of group g, the score moves
// by at most sigma_g / 2 * sum_i (2^B_i - 1) (sigma_g = 1.0001 max_i step_i
// |q_pair(i)| / kMaxW with the score scale folded into q), plus float
// rounding (64 hd 2^-24 of sum_i |q_i k_i|); weights then move by at most a
// factor e^(2 dS) and, rounded to P^ = rne(p / sigma_p) with sigma_p =
// max_{g} p / kMaxP, by at most min(sigma_p / 2, p_t) each. So
//   |out - ref| <= 2 max|v| ((e^(2 dS) - 1) + e^(2 dS) sum_t min(sigma_p / 2, p_t) / sum_t p_t) + 1e-6.
double KernelBound(const GroupedKvCache& c, int layer, const std::vector<float>& q, int nq, int qh) {
  const int H = c.n_kv_heads(), hd = c.head_dim(), E = H * hd, rep = nq / H, h = qh / rep;
  const int64_t T = c.written(layer);
  const GroupedKvScheme& g = c.scheme();
  const int Gt = g.calibrated ? 16 : g.group;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const double maxw = c.k_digits() == 1 ? 127.0 : 16383.0, maxp = c.v_digits() == 1 ? 127.0 : 16383.0;
  const float* qv = q.data() + static_cast<size_t>(qh) * static_cast<size_t>(hd);
  std::vector<float> K(static_cast<size_t>(T) * E), V(K.size());
  for (int64_t t = 0; t < T; ++t) c.read(layer, t, {K.data() + t * E, static_cast<size_t>(E)}, {V.data() + t * E, static_cast<size_t>(E)});
  double vmax = 0;
  for (float x : V) vmax = std::max(vmax, static_cast<double>(std::fabs(x)));
  std::vector<double> s(static_cast<size_t>(T)), ds(static_cast<size_t>(T), 0.0);
  std::vector<float> lo(hd), st(hd);
  int levels = 0;
  for (int k = 0; k < hd / 4; ++k) levels += 4 * ((1 << c.k_quad_bits(layer, h, k)) - 1);
  // Groups the kernel reads (calibrated: whole tiles before coded_end).
  const int64_t coded = g.calibrated ? (std::max<int64_t>(g.sinks, g.coded_end(T)) - g.sinks) / 16 : c.coded_groups(layer);
  for (int64_t t = 0; t < T; ++t) {
    double d = 0, mag = 0;
    for (int i = 0; i < hd; ++i) {
      const double x = static_cast<double>(qv[i]) * K[static_cast<size_t>(t * E + h * hd + i)];
      d += x, mag += std::fabs(x);
    }
    s[static_cast<size_t>(t)] = d * scale;
    ds[static_cast<size_t>(t)] = 64.0 * hd * 0x1.0p-24 * mag * scale;
    const int64_t grp = t < g.sinks ? -1 : (t - g.sinks) / Gt;
    if (grp >= 0 && grp < coded) {
      c.group_params(layer, grp, 0, h, lo, st);
      double sigma = 0;
      for (int p = 0; p < hd / 2; ++p) {
        const double qn = std::hypot(static_cast<double>(qv[2 * p]), static_cast<double>(qv[2 * p + 1])) * scale;
        sigma = std::max(sigma, qn * std::max(st[static_cast<size_t>(2 * p)], st[static_cast<size_t>(2 * p + 1)]));
      }
      ds[static_cast<size_t>(t)] += 1.0001 * sigma / maxw / 2.0 * levels;
    }
  }
  const double m = *std::max_element(s.begin(), s.end());
  const double dmax = *std::max_element(ds.begin(), ds.end());
  double L = 0, round = 0;
  for (int64_t t0 = 0; t0 < T;) {  // weight rounding per coded group
    const int64_t grp = t0 < g.sinks ? -1 : (t0 - g.sinks) / Gt;
    const bool in_kernel = grp >= 0 && grp < coded;
    const int64_t t1 = in_kernel ? g.sinks + (grp + 1) * Gt : t0 + 1;
    double pmax = 0;
    for (int64_t t = t0; t < t1; ++t) pmax = std::max(pmax, std::exp(s[static_cast<size_t>(t)] - m));
    for (int64_t t = t0; t < t1; ++t) {
      const double p = std::exp(s[static_cast<size_t>(t)] - m);
      L += p;
      if (in_kernel) round += std::min(pmax / maxp / 2.0, p);
    }
    t0 = t1;
  }
  return 2.0 * vmax * ((std::exp(2 * dmax) - 1) + std::exp(2 * dmax) * round / L) + 1e-6;
}

// Keys whose tile-frame values sit on the code grid decode exactly, so the
// grouped cache must attend as the fp32 kernel over the same keys rotated:
// only the kernel's fixed point (two digits for 4-bit K and V: a score
// within sigma / 2 sum_i q_i, sigma = max step |q_pair| / 16383) and float
// rounding differ.
TEST(GroupedKv, TileFrameReadsAsTheKeysRotated) {
  test::ForEachTarget([](const char*) {
    const int H = 2, hd = 16, E = H * hd, G = 32, N = 200, nq = 8;
    const GroupedKvScheme g{4, 4, G, 0, 0};
    GroupedKvCache c(g, 1, N, H, hd);
    RowKvCache ref(KvScheme::Fp32, 1, N, H, hd);
    test::Rng rng(3);
    std::vector<float> q(nq * hd), a(q.size()), b(q.size());
    for (float& x : q) x = static_cast<float>(rng.Gaussian());
    for (int t = 0; t < N; ++t) {
      std::vector<float> kt(E), v(E);
      for (int i = 0; i < E; ++i) {
        int c4 = static_cast<int>(rng.Next() % 16);
        if (t % G == 0) c4 = 0;  // every group holds codes 0 and 15
        if (t % G == 1) c4 = 15;
        kt[static_cast<size_t>(i)] = -1.0f + 0.125f * static_cast<float>(c4) * static_cast<float>(1 + i % 3);
        v[static_cast<size_t>(i)] = 0.5f + 0.25f * static_cast<float>(c4);
      }
      const std::vector<float> k = FromTileFrame(kt, H, hd, t);
      c.write(0, t, k, v);
      ref.write(0, t, k, v);
      if ((t + 1) % G != 0) continue;  // every token coded: no open rows
      ASSERT_EQ(g.coded_end(t + 1), t + 1);
      c.attend(0, q, nq, a);
      decode_attention(q, nq, ref.view(0, t + 1), b);
      for (int qh = 0; qh < nq; ++qh) {
        const double tol = KernelBound(c, 0, q, nq, qh) + 1e-5;  // + the fp32 kernel's rounding
        for (int i = 0; i < hd; ++i) ASSERT_NEAR(a[static_cast<size_t>(qh * hd + i)], b[static_cast<size_t>(qh * hd + i)], tol) << t;
      }
    }
  });
}

// The fused kernel on every target against the reference, within the bound,
// at lengths around hand-overs, for every preset and for sinks, windows,
// calibrated tiles and GQA groups of 1..8.
TEST(GroupedKv, FusedKernelMatchesTheReferenceWithinItsBoundOnEveryTarget) {
  struct Case {
    const char* scheme;
    int H, hd, nq, N, threads;
  };
  std::vector<Case> cases = {{"k4v4g16", 1, 8, 1, 40, 1},          {"k3v2g32r5s3", 2, 8, 8, 150, 1},
                             {"k2v3g64r16", 4, 64, 16, 300, 2},     {"k8v8g16", 2, 128, 8, 100, 1},
                             {"k5v6g48s1", 1, 32, 4, 200, 3},       {"k4v3c", 2, 16, 8, 77, 1},
                             {"k4av4cr9s2", 1, 64, 4, 100, 2},      {"k2v2g16p8mo4x1w3r4", 2, 16, 4, 90, 2},
                             {"k3av2g32p8o4x2r5", 2, 16, 16, 150, 1}};
  for (const auto& [preset, g] : grouped_kv_presets()) cases.push_back({preset.c_str(), 2, 64, 8, g.group * 2 + 37, 2});
  test::ForEachTarget([&](const char*) {
    for (const Case& cs : cases) {
      SCOPED_TRACE(cs.scheme);
      const GroupedKvScheme g = parse_grouped_kv_scheme(cs.scheme);
      const StaticRanges ranges = SyntheticRanges(2, cs.H, cs.hd, 2.5f, 5);
      GroupedKvCache c(g, 2, cs.N, cs.H, cs.hd, &ranges);
      test::Rng rng(static_cast<uint64_t>(cs.N));
      const int E = cs.H * cs.hd;
      std::vector<float> q(static_cast<size_t>(cs.nq * cs.hd)), a(q.size()), b(q.size());
      for (float& x : q) x = static_cast<float>(rng.Gaussian()) * 2.0f;
      for (int t = 0; t < cs.N; ++t) {
        std::vector<float> k(static_cast<size_t>(E)), v(k.size());
        for (int i = 0; i < E; ++i) {
          k[static_cast<size_t>(i)] = ranges.k_lo[static_cast<size_t>(E + i)] + 2.5f + static_cast<float>(rng.Gaussian()) * (i % 7 == 2 ? 3.0f : 1.0f);
          v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
        }
        if (t == 40) k[3] = 40.0f;  // far outside: clamped (calibrated) or held in fp16 (o<N>)
        c.write(1, t, k, v);
        const int T = t + 1;
        if (!(T == 1 || T % 23 == 0 || T == cs.N || (T - g.recent - g.sinks) % g.group == 0)) continue;
        SCOPED_TRACE(T);
        c.attend(1, q, cs.nq, a, cs.threads);
        c.attend_ref(1, q, cs.nq, b);
        for (int qh = 0; qh < cs.nq; ++qh) {
          const double tol = KernelBound(c, 1, q, cs.nq, qh);
          for (int i = 0; i < cs.hd; ++i) {
            const size_t at = static_cast<size_t>(qh * cs.hd + i);
            ASSERT_NEAR(a[at], b[at], tol) << "head " << qh << " channel " << i;
          }
        }
        // The worst case is loose with one digit (every rounding aligned);
        // the typical error is far smaller, and a broken integer path (an
        // offset, a scale, a lane or quad out of place) moves the output by
        // the order of the output itself. Measured: at most 6% relative RMS
        // here (one-digit K at head_dim 64; the outputs are averages of ~100
        // Gaussian values, ten times smaller than the values), 0.1% with two
        // digits.
        double err2 = 0, ref2 = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          err2 += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
          ref2 += static_cast<double>(b[i]) * b[i];
        }
        EXPECT_LT(std::sqrt(err2 / ref2), 0.15);
      }
    }
  });
}

// The wide 16-bit dot products (every fixed-width target: vpmaddwd on x86,
// smull on NEON) against the scalar integer loops on every target: the same
// exact integer sums, then the same float operations, so the outputs are
// equal bit for bit. Widths 2..8 (per-channel K bits in runs), one and two
// digits, head_dim 8..512 (V blocks of 8 and 16 channels), groups of 16..512
// (long groups of 8-bit V codes: sums past 2^31 across passes), sinks,
// windows, calibrated and p8 parameters, GQA 1..8, lengths around hand-overs.
// On x86 (AVX2, AVX3) one-digit V sums take the byte path (vpmaddubsw, i16
// passes), so the same comparison covers it.
TEST(GroupedKv, WideDotsEqualTheScalarLoopsBitForBitOnEveryTarget) {
  struct Case {
    const char* scheme;
    int H, hd, nq, N;
  };
  std::vector<Case> cases = {{"k4v4g16", 1, 8, 1, 40},         {"k3v2g32r5s3", 2, 8, 8, 150},
                             {"k2v3g64r16", 4, 64, 16, 300},    {"k8v8g16", 2, 128, 8, 100},
                             {"k8v8g512", 1, 16, 2, 1100},      {"k5v6g48s1", 1, 32, 4, 200},
                             {"k7v7g32", 2, 24, 4, 99},         {"k4v3c", 2, 16, 8, 77},
                             {"k4av4cr9s2", 1, 64, 4, 100},     {"k2v2g16p8mo4x1w3r4", 2, 16, 4, 90},
                             {"k3av2g32p8o4x2r5", 2, 16, 16, 150}, {"k6v5g128", 1, 512, 1, 300},
                             // one-digit V over long groups: x86's byte path in several i16 passes
                             {"k4v3g256", 2, 32, 8, 600},       {"k3v2g512r7", 1, 16, 4, 1100}};
  for (const auto& [preset, g] : grouped_kv_presets()) cases.push_back({preset.c_str(), 2, 128, 8, g.group * 2 + 37});
  if (test::Quick()) {  // under qemu: the small cases, every width and both V blocks
    std::erase_if(cases, [](const Case& cs) { return cs.hd > 64 || cs.N > 300; });
    cases.push_back({"kvq-4.5", 2, 32, 8, 64 * 2 + 37});
  }
  test::ForEachTarget([&](const char* target) {
    for (const Case& cs : cases) {
      SCOPED_TRACE(cs.scheme);
      const GroupedKvScheme g = parse_grouped_kv_scheme(cs.scheme);
      const StaticRanges ranges = SyntheticRanges(1, cs.H, cs.hd, 2.5f, 5);
      GroupedKvCache c(g, 1, cs.N, cs.H, cs.hd, &ranges);
      test::Rng rng(static_cast<uint64_t>(cs.N) + 7);
      const int E = cs.H * cs.hd;
      std::vector<float> q(static_cast<size_t>(cs.nq * cs.hd)), a(q.size()), b(q.size());
      for (float& x : q) x = static_cast<float>(rng.Gaussian()) * 2.0f;
      int checked = 0;
      for (int t = 0; t < cs.N; ++t) {
        std::vector<float> k(static_cast<size_t>(E)), v(k.size());
        for (int i = 0; i < E; ++i) {
          k[static_cast<size_t>(i)] = ranges.k_lo[static_cast<size_t>(i)] + 2.5f + static_cast<float>(rng.Gaussian()) * (i % 7 == 2 ? 3.0f : 1.0f);
          v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian()) * (i % 5 == 1 ? 40.0f : 1.0f);
        }
        c.write(0, t, k, v);
        const int T = t + 1;
        if (!(T % 29 == 0 || T == cs.N || (T - g.recent - g.sinks) % g.group == 0)) continue;
        if (test::Quick() && T != cs.N && T % 87 != 0) continue;
        SCOPED_TRACE(T);
        grouped::SetDotPathForTest(grouped::DotPath::kWide);
        c.attend(0, q, cs.nq, a, 2);
        grouped::SetDotPathForTest(grouped::DotPath::kScalar);
        c.attend(0, q, cs.nq, b, 2);
        grouped::SetDotPathForTest(grouped::DotPath::kAuto);
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << target;
        ++checked;
      }
      EXPECT_GT(checked, 0);
    }
  });
}

// The largest sums the V paths can meet: a zero query (every weight P^ at
// kMaxP) and V codes at their maximum for every token but the first of each
// channel, over long groups. The byte path's i16 passes and the wide path's
// int32 passes must hold them exactly (a pass one quad too long wraps).
TEST(GroupedKv, WideDotsHoldTheLargestSums) {
  const int H = 1, hd = 16, nq = 2;
  for (const char* scheme : {"k4v3g256", "k3v2g512", "k2v2g96", "k8v8g512"}) {
    SCOPED_TRACE(scheme);
    const GroupedKvScheme g = parse_grouped_kv_scheme(scheme);
    const int N = g.group + 3;
    test::ForEachTarget([&](const char* target) {
      GroupedKvCache c(g, 1, N, H, hd, nullptr);
      std::vector<float> k(static_cast<size_t>(H * hd)), v(k.size());
      for (int t = 0; t < N; ++t) {
        for (int i = 0; i < H * hd; ++i) {
          k[static_cast<size_t>(i)] = static_cast<float>((t * 7 + i) % 5);
          v[static_cast<size_t>(i)] = t == 0 ? -1.0f : 1.0f;
        }
        c.write(0, t, k, v);
      }
      const std::vector<float> q(static_cast<size_t>(nq * hd), 0.0f);
      std::vector<float> a(q.size()), b(q.size());
      grouped::SetDotPathForTest(grouped::DotPath::kWide);
      c.attend(0, q, nq, a, 1);
      grouped::SetDotPathForTest(grouped::DotPath::kScalar);
      c.attend(0, q, nq, b, 1);
      grouped::SetDotPathForTest(grouped::DotPath::kAuto);
      ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << target;
      // Every token but one holds 1 (coded within the fp16 step's rounding): the average is (N - 2) / N.
      EXPECT_NEAR(a[0], static_cast<float>(N - 2) / static_cast<float>(N), 1e-2) << target;
    });
  }
}

// What the object holds is what it counts: its allocations equal bytes()
// plus a bounded constant (the open rings at capacity, float expansions of
// the tables, the tile rotations, and the records' chunk not yet filled:
// at most 256 KiB a layer), at every length, for every preset.

}  // namespace
}  // namespace kvq
