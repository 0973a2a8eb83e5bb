// Shared by the benchmarks: attention geometries, deterministic K/V rows and
// calibrated ranges measured on them.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "kvq/grouped_kv.h"

namespace kvq_bench {

struct Geo {
  int heads, kv, hd;
};

// Deterministic, roughly Gaussian K and V rows (one large K channel a head):
// calls row(t, k, v) for t = 0 .. T - 1.
template <typename Fn>
inline void ForEachRow(int T, int E, int hd, const Fn& row) {
  std::vector<float> k(static_cast<size_t>(E)), v(k.size());
  uint64_t s = 99;
  auto next = [&s] {  // sum of uniforms
    float acc = 0;
    for (int i = 0; i < 4; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      acc += static_cast<float>(static_cast<int32_t>(s >> 32)) * 0x1p-31f;
    }
    return acc;
  };
  for (int t = 0; t < T; ++t) {
    for (size_t i = 0; i < k.size(); ++i) {
      const float big = (static_cast<int>(i) % hd == 17) ? 8.0f : 1.0f;
      k[i] = big * next();
      v[i] = next();
    }
    row(t, k, v);
  }
}

// Ranges for the schemes that need them: measured on the first 256 rows,
// with the channel weights of a model (one large channel per head, the rest
// in a geometric spread), so allocated widths vary as they would.
inline const kvq::StaticRanges& RangesFor(const Geo& g, int layers) {
  static std::map<std::tuple<int, int, int>, kvq::StaticRanges> cache;
  const auto key = std::make_tuple(g.kv, g.hd, layers);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int E = g.kv * g.hd;
  std::vector<std::vector<float>> k(static_cast<size_t>(layers)), v(k.size());
  ForEachRow(256, E, g.hd, [&](int, const std::vector<float>& kr, const std::vector<float>& vr) {
    for (int l = 0; l < layers; ++l) {
      k[static_cast<size_t>(l)].insert(k[static_cast<size_t>(l)].end(), kr.begin(), kr.end());
      v[static_cast<size_t>(l)].insert(v[static_cast<size_t>(l)].end(), vr.begin(), vr.end());
    }
  });
  kvq::StaticRanges r = kvq::StaticRanges::from_samples(k, v, g.kv, g.hd);
  for (size_t c = 0; c < r.k_lo.size(); ++c) {
    r.k_weight.push_back(static_cast<int>(c) % g.hd == 17 ? 1e4f : std::pow(1.05f, static_cast<float>(static_cast<int>(c) % g.hd)));
  }
  return cache.emplace(key, std::move(r)).first->second;
}

}  // namespace kvq_bench
