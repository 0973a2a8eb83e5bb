// Fused decode attention vs the dequantize-then-attend reference.
#include "kvq/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "tests/test_util.h"
#include "src/rows/row_store.h"

namespace kvq {
namespace {

using test::ErrorOf;
using test::Rng;

constexpr double kU = 0x1p-24;  // float unit roundoff

struct Case {
  KvScheme scheme;
  int n_kv, ratio, d;
  int64_t T;
};

std::string Name(const Case& c) {
  return std::string(kv_scheme_name(c.scheme)) + " n_kv=" + std::to_string(c.n_kv) +
         " ratio=" + std::to_string(c.ratio) + " d=" + std::to_string(c.d) + " T=" + std::to_string(c.T);
}

// A one-layer cache of T rows of LLM-like K/V (a few large channels).
RowKvCache MakeCache(const Case& c, Rng& rng, float k_scale = 1.0f) {
  RowKvCache cache(c.scheme, 1, static_cast<int>(c.T), c.n_kv, c.d);
  const int row = c.n_kv * c.d;
  std::vector<float> k(static_cast<size_t>(row)), v(k.size());
  for (int64_t t = 0; t < c.T; ++t) {
    for (int i = 0; i < row; ++i) {
      const float big = (i % 13 == 3) ? 6.0f : 1.0f;
      k[static_cast<size_t>(i)] = k_scale * big * static_cast<float>(rng.Gaussian());
      v[static_cast<size_t>(i)] = big * static_cast<float>(rng.Gaussian());
    }
    cache.write(0, static_cast<int>(t), k, v);
  }
  return cache;
}

// Derived bound on |fused - reference| for one output head:
//  - a score's float error is at most (d + 4) u * S, S = max_t sum_e |q_e k_te| * scale
//    (d products summed, the query prescale, the folded row/block scale);
//  - the softmax weights then move by at most 2 * that (the max shift
//    cancels), plus a few ulps of the vector exp;
//  - the weighted V sum and the normaliser each accumulate T float terms.
// So |delta o| <= v_max * (4 (d + 4) u S + (2 T + 64) u).
// q4_0 K tiles compute sum q (c - 8) d as d (sum q c - 8 sum q): the terms
// then reach |q| (|k| + 8 |d|), and 8 |d| is the block's max |k|.
// With query digits (DigitsApply) each scaled query element is rounded to a
// multiple of 2^-e <= 2^-21 max|q_h|: a score moves by at most
// ds = 2^-22 max|q_h| sum_e |k_e| more, the weights by a factor exp(+-2 ds).
// With V digits (VDigitsApply) each weight times its block / row scale a_t
// is rounded to within 2^-21 of the largest such product in its softmax
// block (<= 128 consecutive tokens), and multiplies a code |c| <= a_t^-1
// max|v_t|: the output moves by at most
// 2^-21 v_max sum_t max_{|t' - t| <= 127} p_t' (p: the softmax weights;
// a small margin covers the fp16 scales and the weights' own error).
double Tolerance(const std::vector<float>& q, const std::vector<float>& K, const std::vector<float>& V,
                 int h, int G, int d, int row, int64_t T, float scale, bool q4_tiles = false,
                 bool digits = false, bool v_digits = false) {
  const int g = h / G;
  double S = 0.0, vmax = 0.0, ds = 0.0, qmax = 0.0;
  for (int e = 0; e < d; ++e) qmax = std::max(qmax, std::fabs(double(q[static_cast<size_t>(h * d + e)]) * scale));
  for (int64_t t = 0; t < T; ++t) {
    double s = 0.0, sk = 0.0;
    for (int e = 0; e < d; ++e) {
      const float* kt = K.data() + t * row + g * d;
      double off = 0.0;
      if (q4_tiles) {
        for (int j = e / 32 * 32; j < e / 32 * 32 + 32 && j < d; ++j) off = std::max(off, double(std::fabs(kt[j])));
      }
      s += std::fabs(q[static_cast<size_t>(h * d + e)]) * (std::fabs(kt[e]) + off);
      sk += std::fabs(kt[e]);
      vmax = std::max(vmax, static_cast<double>(std::fabs(V[static_cast<size_t>(t * row + g * d + e)])));
    }
    S = std::max(S, s * scale);
    if (digits) ds = std::max(ds, 0x1p-22 * qmax * sk * (1 + 1e-5));
  }
  double vd = 0.0;
  if (v_digits) {
    std::vector<double> p(static_cast<size_t>(T));
    double mx = -INFINITY, l = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      double sc = 0.0;
      for (int e = 0; e < d; ++e) sc += double(q[static_cast<size_t>(h * d + e)]) * K[static_cast<size_t>(t * row + g * d + e)];
      p[static_cast<size_t>(t)] = sc * scale;
      mx = std::max(mx, sc * scale);
    }
    for (auto& x : p) l += (x = std::exp(x - mx));
    for (int64_t t = 0; t < T; ++t) {
      double m = 0.0;
      for (int64_t u = std::max<int64_t>(0, t - 127); u < std::min<int64_t>(T, t + 128); ++u) m = std::max(m, p[static_cast<size_t>(u)]);
      vd += m / l;
    }
    vd *= 0x1p-21 * 1.01;
  }
  return vmax * (4.0 * (d + 4) * kU * S + (2.0 * static_cast<double>(T) + 64.0) * kU + std::expm1(2 * ds) + vd);
}

// Whether the exact kernel takes K-tile scores from query digits: AVX-512
// VNNI among the (test-selected) targets, K tiles, 16-lane vectors.
bool DigitsApply(const RowKvCache& cache, int d) {
  return (hwy::SupportedTargets() & HWY_AVX3_DL) != 0 && cache.codec().k_tile() != 0 && d % 16 == 0 && d <= 512;
}

// Whether V is accumulated from weight digits: AVX-512 VNNI and V tiles.
bool VDigitsApply(const RowKvCache& cache) {
  return (hwy::SupportedTargets() & HWY_AVX3_DL) != 0 && cache.codec().v_tile() != 0;
}

void CheckAgainstReference(const Case& c, int threads, Rng& rng, float q_scale = 1.0f) {
  SCOPED_TRACE(Name(c) + " threads=" + std::to_string(threads));
  const RowKvCache cache = MakeCache(c, rng);
  const int n_heads = c.n_kv * c.ratio, row = c.n_kv * c.d;
  std::vector<float> q(static_cast<size_t>(n_heads * c.d));
  for (auto& x : q) x = q_scale * static_cast<float>(rng.Gaussian());
  const KvRowsView view = cache.view(0, c.T);
  DecodeAttentionOptions o;
  o.threads = threads;
  std::vector<float> out(q.size()), ref(q.size());
  decode_attention(q, n_heads, view, out, o);
  decode_attention_ref(q, n_heads, view, ref, o);
  std::vector<float> K(static_cast<size_t>(c.T * row)), V(K.size());
  for (int64_t t = 0; t < c.T; ++t) {
    cache.read_k(0, static_cast<int>(t), {K.data() + t * row, static_cast<size_t>(row)});
    cache.read_v(0, static_cast<int>(t), {V.data() + t * row, static_cast<size_t>(row)});
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  const bool q4_tiles = c.scheme == KvScheme::Q4_0 && cache.codec().k_tile() != 0;
  for (int h = 0; h < n_heads; ++h) {
    const double tol =
        Tolerance(q, K, V, h, c.ratio, c.d, row, c.T, scale, q4_tiles, DigitsApply(cache, c.d), VDigitsApply(cache));
    for (int e = 0; e < c.d; ++e) {
      const size_t i = static_cast<size_t>(h * c.d + e);
      ASSERT_TRUE(std::isfinite(out[i]));
      ASSERT_NEAR(out[i], ref[i], tol) << "head " << h << " elem " << e;
    }
  }
}

// Row geometry every scheme accepts: ggml blocks need n_kv * d % 32 == 0.
int KvHeadsFor(int d) { return d == 8 ? 4 : 2; }

TEST(DecodeAttention, MatchesReferenceForEverySchemeShapeAndRatio) {
  Rng rng(1);
  for (KvScheme s : all_kv_schemes()) {
    for (int d : {8, 64, 128}) {
      for (int ratio : {1, 2, 4, 8}) {
        for (int64_t T : {1, 31, 32, 33, 100, 127, 128, 129, 1000, 2500}) {
          if (d == 128 && T > 1000 && ratio != 4) continue;  // keep the sweep quick
          CheckAgainstReference({s, KvHeadsFor(d), ratio, d, T}, ratio == 2 ? 2 : 1, rng);
        }
      }
    }
  }
}

TEST(DecodeAttention, OddGroupSizesAndSplitSegments) {
  Rng rng(2);
  // Groups of 3, 5, 6, 7 run as sub-groups of 4/2/1; one KV head with 2
  // threads splits the tokens into segments whose softmax states are merged.
  for (KvScheme s : {KvScheme::Fp32, KvScheme::Int8, KvScheme::Q4_0, KvScheme::Fp16}) {
    for (int ratio : {3, 5, 6, 7}) CheckAgainstReference({s, 2, ratio, 64, 777}, 1, rng);
    CheckAgainstReference({s, 1, 4, 64, 3000}, 2, rng);
    CheckAgainstReference({s, 1, 1, 128, 4097}, 2, rng);
  }
}

// V tiles hold head_dim / 16 element units (int8) or head_dim / 32 blocks:
// odd counts and a single unit, at partial and whole tiles.
TEST(DecodeAttention, VTilesOfEveryUnitCount) {
  Rng rng(9);
  for (KvScheme s : {KvScheme::Int8, KvScheme::Int8Head}) {
    for (int d : {16, 48, 80}) {
      for (int64_t T : {5, 200}) CheckAgainstReference({s, 2, 4, d, T}, 1, rng);
    }
  }
  for (KvScheme s : {KvScheme::Q8_0, KvScheme::Q4_0}) {
    for (int d : {32, 96}) {
      for (int64_t T : {5, 200}) CheckAgainstReference({s, 2, 4, d, T}, 1, rng);
    }
  }
}

TEST(DecodeAttention, EveryCompiledTargetMatchesTheReference) {
  test::ForEachTarget([&](const char*) {
    Rng rng(3);
    for (KvScheme s : all_kv_schemes()) {
      for (int d : {8, 128}) CheckAgainstReference({s, KvHeadsFor(d), 2, d, 65}, 1, rng);
      CheckAgainstReference({s, 2, 8, 128, 300}, 2, rng);  // groups of 8, partial tiles, 2 threads
    }
  });
}

// The exact kernel's query digits (AVX-512 VNNI, K tiles; DigitsApply).
// (a) They are used: the output differs from the float-FMA AVX3 target's,
// and both are within their derived bounds (the sweeps above check every
// shape). (b) Worst-case digits (|D2| = 64) against the largest codes, all
// products of one sign, at head_dim 512: the int32 plane sums and their
// combination must not overflow, or the scores (spread over ~4 units here)
// would pick the wrong tokens.
TEST(DecodeAttention, ExactQueryDigitsRunAndDoNotOverflow) {
  if ((hwy::SupportedTargets() & HWY_AVX3_DL) == 0) GTEST_SKIP() << "needs AVX-512 VNNI (Highway AVX3_DL)";
  Rng rng(8);
  const auto Attend = [](const std::vector<float>& q, int n_heads, const RowKvCache& cache, int64_t T, float scale,
                         int64_t targets) {
    hwy::SetSupportedTargetsForTest(targets);
    std::vector<float> out(q.size());
    DecodeAttentionOptions o;
    o.scale = scale;
    decode_attention(q, n_heads, cache.view(0, T), out, o);
    hwy::SetSupportedTargetsForTest(0);
    return out;
  };
  const auto Check = [&](const std::vector<float>& q, int n_heads, const RowKvCache& cache, const Case& c,
                         float scale) -> std::vector<float> {
    SCOPED_TRACE(Name(c));
    const int row = c.n_kv * c.d;
    const std::vector<float> out = Attend(q, n_heads, cache, c.T, scale, 0);
    std::vector<float> ref(q.size()), K(static_cast<size_t>(c.T * row)), V(K.size());
    DecodeAttentionOptions o;
    o.scale = scale;
    decode_attention_ref(q, n_heads, cache.view(0, c.T), ref, o);
    for (int64_t t = 0; t < c.T; ++t) {
      cache.read_k(0, static_cast<int>(t), {K.data() + t * row, static_cast<size_t>(row)});
      cache.read_v(0, static_cast<int>(t), {V.data() + t * row, static_cast<size_t>(row)});
    }
    EXPECT_TRUE(DigitsApply(cache, c.d));
    for (int h = 0; h < n_heads; ++h) {
      const double tol =
          Tolerance(q, K, V, h, c.ratio, c.d, row, c.T, scale, c.scheme == KvScheme::Q4_0, true, VDigitsApply(cache));
      for (int e = 0; e < c.d; ++e) {
        const size_t i = static_cast<size_t>(h * c.d + e);
        if (!(std::fabs(double(out[i]) - ref[i]) <= tol)) {
          ADD_FAILURE() << "head " << h << " elem " << e << ": " << out[i] << " vs " << ref[i] << ", tol " << tol;
          return out;
        }
      }
    }
    return out;
  };
  const KvScheme tiled[] = {KvScheme::Int8, KvScheme::Int8Head, KvScheme::Q8_0, KvScheme::Q4_0};
  for (KvScheme s : tiled) {  // (a)
    const Case c{s, 2, 4, 128, 700};
    const RowKvCache cache = MakeCache(c, rng);
    std::vector<float> q(static_cast<size_t>(8 * c.d));
    for (auto& x : q) x = static_cast<float>(rng.Gaussian());
    const float scale = 1.0f / std::sqrt(128.0f);
    const std::vector<float> digits = Check(q, 8, cache, c, scale);
    if ((HWY_TARGETS & HWY_AVX3) != 0) {
      EXPECT_NE(digits, Attend(q, 8, cache, c.T, scale, HWY_AVX3)) << kv_scheme_name(s) << ": digits did not run";
    }
  }
  for (KvScheme s : tiled) {  // (b)
    const Case c{s, 1, 4, 512, 300};
    RowKvCache cache(s, 1, static_cast<int>(c.T), 1, c.d);
    const auto sign = [](int e) { return e % 3 == 0 ? -1.0f : 1.0f; };
    std::vector<float> k(static_cast<size_t>(c.d)), v(k.size());
    for (int64_t t = 0; t < c.T; ++t) {
      // Keys of one sign per element (q4_0: all negative, so every code is
      // 0, i.e. c - 8 = -8) and a magnitude that sets the token's score.
      const float a = 1.0f + static_cast<float>((t * 37) % 101) / 100.0f;
      for (int e = 0; e < c.d; ++e) {
        k[static_cast<size_t>(e)] = (s == KvScheme::Q4_0 ? -1.0f : sign(e)) * a;
        v[static_cast<size_t>(e)] = static_cast<float>(rng.Gaussian());
      }
      cache.write(0, static_cast<int>(t), k, v);
    }
    // |scale q| just below 2: Q = 2^22 - 2 in magnitude, top digit +-64.
    std::vector<float> q(static_cast<size_t>(4 * c.d));
    for (size_t i = 0; i < q.size(); ++i) {
      q[i] = (s == KvScheme::Q4_0 ? -1.0f : sign(static_cast<int>(i % c.d))) * (2.0f - 0x1p-20f);
    }
    Check(q, 4, cache, c, 4.0f / (2.0f * static_cast<float>(c.d)));  // scores 4 a: spread over 4
  }
}

TEST(DecodeAttention, ExtremeScoresStayFiniteAndSelectTheRightToken) {
  Rng rng(4);
  for (KvScheme s : all_kv_schemes()) {
    // Scores of order 1e4: a naive exp overflows, the online softmax must not.
    CheckAgainstReference({s, 2, 4, 64, 300}, 1, rng, 2000.0f);
  }
  // One-hot attention: a single token's key aligned with q dominates, so the
  // output is that token's V row. Catches skipped tokens, blocks or segments.
  for (int64_t hot : {0, 31, 32, 777, 1999}) {
    const Case c{KvScheme::Fp32, 1, 2, 64, 2000};
    RowKvCache cache(c.scheme, 1, 2000, 1, 64);
    std::vector<float> k(64), v(64), q(128, 0.0f);
    for (int64_t t = 0; t < c.T; ++t) {
      for (int e = 0; e < 64; ++e) {
        k[static_cast<size_t>(e)] = (t == hot) ? 1.0f : 0.0f;
        v[static_cast<size_t>(e)] = static_cast<float>(t) + 0.01f * e;
      }
      cache.write(0, static_cast<int>(t), k, v);
    }
    for (int e = 0; e < 128; ++e) q[static_cast<size_t>(e)] = 100.0f;  // score 800 vs 0
    for (int threads : {1, 2}) {
      std::vector<float> out(128);
      DecodeAttentionOptions o;
      o.threads = threads;
      decode_attention(q, 2, cache.view(0, c.T), out, o);
      for (int h = 0; h < 2; ++h) {
        for (int e = 0; e < 64; ++e) {
          ASSERT_FLOAT_EQ(out[static_cast<size_t>(h * 64 + e)], static_cast<float>(hot) + 0.01f * e)
              << "hot " << hot << " threads " << threads;
        }
      }
    }
  }
}

TEST(DecodeAttention, LengthAndScaleOptions) {
  Rng rng(5);
  const Case c{KvScheme::Int8, 2, 2, 64, 500};
  const RowKvCache cache = MakeCache(c, rng);
  std::vector<float> q(256);
  for (auto& x : q) x = static_cast<float>(rng.Gaussian());
  std::vector<float> a(256), b(256);
  DecodeAttentionOptions o;
  o.length = 321;
  decode_attention(q, 4, cache.view(0, 500), a, o);
  decode_attention(q, 4, cache.view(0, 321), b, {});
  EXPECT_EQ(a, b);  // a causal length equals a shorter view
  o = {};
  o.scale = 0.25f;
  decode_attention(q, 4, cache.view(0, 500), a, o);
  decode_attention_ref(q, 4, cache.view(0, 500), b, o);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-4);
  // The tensor form.
  const Tensor qt = Tensor::FromF32(q, {4, 64});
  const Tensor ot = decode_attention(qt, cache.view(0, 500));
  decode_attention(q, 4, cache.view(0, 500), a, {});
  EXPECT_EQ(std::memcmp(ot.data(), a.data(), 256 * 4), 0);
}

// int8_query: the scores come from integer dot products against the query
// rounded to int8, so each score moves by at most
//   ds = (qscale_h / 2) * sum_e |K_te|,  qscale_h = max_e |scale * q_he| / 127,
// and the softmax weights by a factor within exp(+-2 ds): the output moves
// by at most v_max * (exp(2 ds) - 1) beyond the exact kernel's tolerance.
TEST(DecodeAttention, Int8QueryIsWithinItsDerivedBound) {
  Rng rng(21);
  const bool vnni = (hwy::SupportedTargets() & HWY_AVX3_DL) != 0;
  for (KvScheme s : {KvScheme::Int8, KvScheme::Int8Head, KvScheme::Q8_0, KvScheme::Q4_0, KvScheme::Fp16}) {
    for (int d : {8, 64, 128, 256}) {
      for (int ratio : {1, 3, 4, 8}) {
        for (int64_t T : {1, 33, 700}) {
          const Case c{s, KvHeadsFor(d), ratio, d, T};
          SCOPED_TRACE(Name(c));
          const RowKvCache cache = MakeCache(c, rng);
          const int n_heads = c.n_kv * ratio, row = c.n_kv * d;
          std::vector<float> q(static_cast<size_t>(n_heads * d));
          for (auto& x : q) x = static_cast<float>(rng.Gaussian());
          DecodeAttentionOptions exact_o, iq_o;
          iq_o.int8_query = true;
          std::vector<float> exact(q.size()), iq(q.size()), ref(q.size());
          decode_attention(q, n_heads, cache.view(0, T), exact, exact_o);
          decode_attention(q, n_heads, cache.view(0, T), iq, iq_o);
          decode_attention_ref(q, n_heads, cache.view(0, T), ref, exact_o);
          // The integer path runs on K tiles with 16-lane vectors (head_dim % 16 == 0).
          const bool applies = vnni && cache.codec().k_tile() != 0 && d % 16 == 0;
          if (!applies) {
            EXPECT_EQ(iq, exact) << "int8_query must not change other schemes or non-VNNI CPUs";
            continue;
          }
          std::vector<float> K(static_cast<size_t>(T * row)), V(K.size());
          for (int64_t t = 0; t < T; ++t) {
            cache.read_k(0, static_cast<int>(t), {K.data() + t * row, static_cast<size_t>(row)});
            cache.read_v(0, static_cast<int>(t), {V.data() + t * row, static_cast<size_t>(row)});
          }
          const float scale = 1.0f / std::sqrt(static_cast<float>(d));
          bool differs = false;
          for (int h = 0; h < n_heads; ++h) {
            const int g = h / ratio;
            double qmax = 0, ds = 0, vmax = 0;
            for (int e = 0; e < d; ++e) qmax = std::max(qmax, std::fabs(double(q[h * d + e]) * scale));
            for (int64_t t = 0; t < T; ++t) {
              double sk = 0;
              for (int e = 0; e < d; ++e) {
                sk += std::fabs(K[t * row + g * d + e]);
                vmax = std::max(vmax, std::fabs(double(V[t * row + g * d + e])));
              }
              ds = std::max(ds, qmax / 127 / 2 * sk * (1 + 1e-5));
            }
            const double tol = vmax * std::expm1(2 * ds) +
                               Tolerance(q, K, V, h, ratio, d, row, T, scale, s == KvScheme::Q4_0 && applies, false,
                                         VDigitsApply(cache));
            for (int e = 0; e < d; ++e) {
              const size_t i = static_cast<size_t>(h * d + e);
              ASSERT_NEAR(iq[i], ref[i], tol) << "head " << h << " elem " << e;
              differs |= iq[i] != exact[i];
            }
          }
          if (T > 1) {
            EXPECT_TRUE(differs) << "the integer path did not run";
          }
          // The worst case above is loose; the typical error is far smaller.
          // A broken integer path (offset, scale or lane order) moves the
          // output by the order of the output itself.
          double err2 = 0, ref2 = 0;
          for (size_t i = 0; i < iq.size(); ++i) {
            err2 += (double(iq[i]) - ref[i]) * (double(iq[i]) - ref[i]);
            ref2 += double(ref[i]) * ref[i];
          }
          // Measured: at most 1.5% relative RMS on these LLM-like caches.
          if (ref2 > 0) {
            EXPECT_LT(std::sqrt(err2 / ref2), 0.05);
          }
        }
      }
    }
  }
}

// decode_attention_part: the log-mass matches a double-precision reference,
// and parts over disjoint token ranges (subviews) merge into the whole.
TEST(DecodeAttention, PartsOfSubviewsMergeIntoTheWhole) {
  Rng rng(33);
  for (KvScheme s : {KvScheme::Fp32, KvScheme::Int8, KvScheme::Q4_0}) {
    SCOPED_TRACE(kv_scheme_name(s));
    const Case c{s, 2, 4, 64, 300};
    const RowKvCache cache = MakeCache(c, rng);
    const KvRowsView all = cache.view(0, c.T);
    std::vector<float> q(8 * 64);
    for (auto& x : q) x = static_cast<float>(rng.Gaussian());
    const AttentionPart whole = decode_attention_part(q, 8, all);
    // Reference log-mass in double from the decoded rows.
    std::vector<float> K(c.T * 128);
    for (int64_t t = 0; t < c.T; ++t) cache.read_k(0, static_cast<int>(t), {K.data() + t * 128, 128});
    for (int h = 0; h < 8; ++h) {
      double m = -INFINITY;
      std::vector<double> sc(c.T);
      for (int64_t t = 0; t < c.T; ++t) {
        double x = 0;
        for (int e = 0; e < 64; ++e) x += double(q[h * 64 + e]) * K[t * 128 + (h / 4) * 64 + e];
        sc[t] = x / 8.0;
        m = std::max(m, sc[t]);
      }
      double l = 0;
      for (double x : sc) l += std::exp(x - m);
      EXPECT_NEAR(whole.log_mass[h], m + std::log(l), 1e-4 * (1 + std::fabs(m)));
    }
    std::vector<float> out(q.size());
    decode_attention(q, 8, all, out);
    EXPECT_EQ(whole.value, out);
    const AttentionPart merged = merge_attention_parts(
        {decode_attention_part(q, 8, all.subview(0, 4)), decode_attention_part(q, 8, all.subview(4, 170)),
         decode_attention_part(q, 8, all.subview(170, 300))});
    for (int h = 0; h < 8; ++h) EXPECT_NEAR(merged.log_mass[h], whole.log_mass[h], 1e-5);
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(merged.value[i], out[i], 1e-4);
  }
  const RowKvCache cache = MakeCache({KvScheme::Fp32, 1, 1, 8, 10}, rng);
  EXPECT_NE(ErrorOf([&] { cache.view(0, 10).subview(3, 11); }).find("subview: expected 0 <= t0 <= t1 <= 10"),
            std::string::npos);
}

// A caller's own layout: whole token-major rows (one slice) and a separate
// header array. The kernel gives the same result as on RowKvCache's head-major
// slices (same per-lane arithmetic), for every scheme.
TEST(DecodeAttention, WholeRowLayoutMatchesHeadMajorSlices) {
  Rng rng(12);
  for (KvScheme s : all_kv_schemes()) {
    SCOPED_TRACE(kv_scheme_name(s));
    const Case c{s, 4, 2, 64, 77};
    const RowKvCache cache = MakeCache(c, rng);
    const KvRowsView hm = cache.view(0, c.T);
    const KvRowCodec& codec = cache.codec();
    const size_t rb = codec.row_bytes(), hb = codec.header_bytes();
    std::vector<uint8_t> rows_k(c.T * rb), rows_v(c.T * rb), head_k(c.T * hb + 1), head_v(c.T * hb + 1);
    std::vector<uint8_t> row(rb);
    for (int64_t t = 0; t < c.T; ++t) {
      for (int which = 0; which < 2; ++which) {
        hm.gather_row(which, t, row.data());
        std::memcpy((which ? head_v : head_k).data() + t * hb, row.data(), hb);
        std::memcpy((which ? rows_v : rows_k).data() + t * (rb - hb), row.data() + hb, rb - hb);
      }
    }
    KvRowsView whole = hm;
    whole.k_tile = whole.v_tile = whole.tile_first = 0;
    whole.k = rows_k.data();
    whole.v = rows_v.data();
    whole.slices = 1;
    whole.slice_bytes = rb - hb;
    whole.slice_stride = 0;
    whole.k_header = head_k.data();
    whole.v_header = head_v.data();
    std::vector<float> q(8 * 64), a(q.size()), b(q.size());
    for (auto& x : q) x = static_cast<float>(rng.Gaussian());
    decode_attention(q, 8, hm, a, {});
    decode_attention(q, 8, whole, b, {});
    DecodeAttentionOptions iq;
    iq.int8_query = true;  // reads K tiles only: on rows the exact kernel runs
    std::vector<float> b_iq(q.size());
    decode_attention(q, 8, whole, b_iq, iq);
    EXPECT_EQ(b, b_iq);
    if (!hm.k_tile) {
      EXPECT_EQ(a, b);
      continue;
    }
    // K tiles sum each score in another order: both within the derived bound.
    std::vector<float> ref(q.size()), K(c.T * 256), V(K.size());
    decode_attention_ref(q, 8, hm, ref, {});
    for (int64_t t = 0; t < c.T; ++t) {
      cache.read_k(0, static_cast<int>(t), {K.data() + t * 256, 256});
      cache.read_v(0, static_cast<int>(t), {V.data() + t * 256, 256});
    }
    for (int h = 0; h < 8; ++h) {
      const double tol = Tolerance(q, K, V, h, 2, 64, 256, c.T, 0.125f, s == KvScheme::Q4_0, DigitsApply(cache, 64),
                                   VDigitsApply(cache));
      for (int e = 0; e < 64; ++e) {
        ASSERT_NEAR(a[h * 64 + e], ref[h * 64 + e], tol);
        ASSERT_NEAR(b[h * 64 + e], ref[h * 64 + e], tol);
      }
    }
  }
}

TEST(DecodeAttention, BadArgumentsAreClearErrors) {
  Rng rng(6);
  const RowKvCache cache = MakeCache({KvScheme::Q8_0, 2, 2, 64, 10}, rng);
  const KvRowsView good = cache.view(0, 10);
  std::vector<float> q(256, 0.5f), out(256);
  const auto err = [&](KvRowsView kv, int n_heads = 4, DecodeAttentionOptions o = {}) {
    return ErrorOf([&] { decode_attention(q, n_heads, kv, out, o); });
  };
  EXPECT_EQ(err(good), "<no error>");
  EXPECT_NE(err(cache.view(0, 0)).find("at least one token"), std::string::npos);
  DecodeAttentionOptions zero_len;
  zero_len.length = 0;
  EXPECT_NE(err(good, 4, zero_len).find("at least one token"), std::string::npos);
  DecodeAttentionOptions long_len;
  long_len.length = 11;
  EXPECT_NE(err(good, 4, long_len).find("length: expected"), std::string::npos);
  EXPECT_NE(err(good, 3).find("n_heads: expected a positive multiple"), std::string::npos);
  EXPECT_NE(err(good, 8).find("q: expected n_heads * head_dim"), std::string::npos);
  KvRowsView bad = good;
  bad.head_dim = 12;
  EXPECT_NE(err(bad).find("kv.head_dim"), std::string::npos);
  bad = good;
  bad.slice_bytes = 10;
  EXPECT_NE(err(bad).find("kv.slice_bytes"), std::string::npos);
  bad = good;
  bad.slice_stride = 10;
  EXPECT_NE(err(bad).find("kv.slice_stride"), std::string::npos);
  bad = good;
  bad.slices = 3;
  EXPECT_NE(err(bad).find("kv.slices"), std::string::npos);
  bad = good;
  bad.header_bytes = 4;
  EXPECT_NE(err(bad).find("kv.header_bytes"), std::string::npos);
  bad = good;
  bad.k = nullptr;
  EXPECT_NE(err(bad).find("non-null"), std::string::npos);
  bad = good;
  bad.scheme = static_cast<KvScheme>(42);
  EXPECT_NE(err(bad).find("scheme"), std::string::npos);
  bad = good;
  bad.n_kv_heads = 0;
  EXPECT_NE(err(bad).find("kv.n_kv_heads"), std::string::npos);
  bad = good;
  bad.k_tile = 8;
  EXPECT_NE(err(bad).find("kv.k_tile: expected 0 (rows) or 16"), std::string::npos);
  bad = good;
  bad.v_tile = 8;
  EXPECT_NE(err(bad).find("kv.v_tile: expected 0 (rows) or 16"), std::string::npos);
  bad = good;
  bad.tile_first = 16;
  EXPECT_NE(err(bad).find("kv.tile_first: expected 0..15"), std::string::npos);
  bad = good;
  bad.k_tile = bad.v_tile = 0;
  bad.tile_first = 3;  // rows have no first lane
  EXPECT_NE(err(bad).find("kv.tile_first: expected 0..0"), std::string::npos);
  DecodeAttentionOptions o;
  o.threads = -1;
  EXPECT_NE(err(good, 4, o).find("threads"), std::string::npos);
  o = {};
  o.scale = INFINITY;
  EXPECT_NE(err(good, 4, o).find("scale"), std::string::npos);
  q[77] = NAN;
  EXPECT_NE(err(good).find("q: expected finite values, found nan at index 77"), std::string::npos);
  q[77] = 0;
  EXPECT_NE(ErrorOf([&] { decode_attention(Tensor({4, 32}, DType::F32), good); }).find("q: expected shape"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { decode_attention(Tensor({4, 64}, DType::F16), good); }).find("dtype F32"),
            std::string::npos);
}

}  // namespace
}  // namespace kvq
