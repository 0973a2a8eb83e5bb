// Helpers of the grouped caches' tests: fp16 rounding, the tile frame
// (keys as the grouped store holds them) and synthetic calibrated ranges.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/grouped_kv.h"
#include "kvq/half.h"
#include "kvq/rope.h"
#include "tests/test_util.h"

namespace kvq::test {

inline float F16(double x) { return f16_to_f32_ref(f32_to_f16_ref(static_cast<float>(x))); }

// K after RoPE at pos from K in the tile frame (what the cache holds):
// k = R(t0) k~, t0 the start of pos's 16-token tile (S = 0 here).
inline std::vector<float> FromTileFrame(const std::vector<float>& kt, int H, int hd, int pos, int S = 0) {
  const RopeTable rope(pos + 1, hd);
  std::vector<float> k = kt;
  const int t0 = pos < S ? pos : S + (pos - S) / 16 * 16;
  rope_rotate(k.data(), H, hd, rope.cos(t0), rope.sin(t0), /*transpose=*/false);
  return k;
}

// K in the tile frame from K after RoPE, as the cache computes it, fp16-rounded
// (a sink, pos < S, is held as it is).
inline std::vector<float> ToTileFrame(const std::vector<float>& k, int H, int hd, int pos, int S = 0) {
  const RopeTable rope(pos + 1, hd);
  std::vector<float> kt = k;
  if (pos < S) {
    for (float& x : kt) x = F16(x);
    return kt;
  }
  const int t0 = S + (pos - S) / 16 * 16;
  rope_rotate(kt.data(), H, hd, rope.cos(t0), rope.sin(t0), /*transpose=*/true);
  for (float& x : kt) x = F16(x);
  return kt;
}

inline StaticRanges SyntheticRanges(int L, int H, int hd, float width, uint64_t seed) {
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

}  // namespace kvq::test
