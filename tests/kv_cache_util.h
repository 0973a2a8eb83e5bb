// Shared by the KV cache tests (kv_cache_test, prefix_store_test): a small
// geometry, calibrated ranges for it, token rows with fp16 fallbacks, and
// every scheme family's names.
#pragma once

#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "tests/test_util.h"

namespace kvq::test {

constexpr int kL = 2, kH = 2, kD = 32, kE = kH * kD;

inline StaticRanges Ranges(uint64_t seed) {
  test::Rng rng(seed);
  std::vector<std::vector<float>> k(kL), v(kL);
  for (int l = 0; l < kL; ++l) {
    for (int i = 0; i < 64 * kE; ++i) {
      k[static_cast<size_t>(l)].push_back(static_cast<float>(rng.Gaussian()));
      v[static_cast<size_t>(l)].push_back(static_cast<float>(rng.Gaussian()));
    }
  }
  StaticRanges r = StaticRanges::from_samples(k, v, kH, kD);
  for (size_t c = 0; c < r.k_lo.size(); ++c) r.k_weight.push_back(1.0f + static_cast<float>(c % 7));
  return r;
}

struct Rows {
  std::vector<std::vector<float>> k, v;
};
inline Rows MakeRows(int n, uint64_t seed) {
  test::Rng rng(seed);
  Rows r;
  for (int t = 0; t < n; ++t) {
    std::vector<float> k(kE), v(kE);
    for (int i = 0; i < kE; ++i) k[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian()), v[static_cast<size_t>(i)] = static_cast<float>(rng.Gaussian());
    if (t % 29 == 11) k[5] = 30.0f;  // open units held in fp16
    r.k.push_back(k), r.v.push_back(v);
  }
  return r;
}

inline std::vector<std::string> Schemes() {
  std::vector<std::string> s = all_kv_scheme_names();  // every row scheme and preset
  for (const char* g : {"k4v4g16", "k3v2g32r5s3", "k4av3c", "k3v3g32o8x3r4", "k2v2g16p8mo4x1w3r4", "k8v8g16s1"}) s.emplace_back(g);
  return s;
}

}  // namespace kvq::test
