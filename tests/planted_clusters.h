// Planted clusters for the cluster bank's and the outlier quantizer's
// tests: tokens drawn around a few centres with affine values and some
// anomalies, their labels and the bank options that find them.
#pragma once

#include <cmath>
#include <vector>

#include "kvq/cluster_bank.h"
#include "tests/test_util.h"

namespace kvq::test {

// Tokens from C well-separated Gaussian key clusters, each head's value an
// affine map of the key plus small noise; one planted anomaly per cluster
// (its value shifted far off the map).
struct Planted {
  int C, H, D;
  int64_t T;
  std::vector<float> k, v;
  std::vector<int> label;
  std::vector<std::vector<float>> mu_k, mu_v, a;  // [c * H + h]
  std::vector<int64_t> anomalies;

  Planted(int c, int h, int d, int64_t t, uint64_t seed, float separation = 8.0f) : C(c), H(h), D(d), T(t) {
    Rng rng(seed);
    for (int i = 0; i < C * H; ++i) {
      std::vector<float> mk(D), mv(D), am(D * D);
      for (auto& x : mk) x = separation * static_cast<float>(rng.Gaussian());
      for (auto& x : mv) x = 2.0f * static_cast<float>(rng.Gaussian());
      for (auto& x : am) x = static_cast<float>(rng.Gaussian() / std::sqrt(D));
      mu_k.push_back(mk), mu_v.push_back(mv), a.push_back(am);
    }
    const int64_t W = int64_t{H} * D;
    k.resize(T * W), v.resize(T * W), label.resize(T);
    for (int64_t i = 0; i < T; ++i) {
      const int cl = static_cast<int>(rng.Next() % C);
      label[i] = cl;
      for (int hh = 0; hh < H; ++hh) {
        const auto& mk = mu_k[cl * H + hh];
        const auto& mv = mu_v[cl * H + hh];
        const auto& am = a[cl * H + hh];
        float* kr = &k[i * W + hh * D];
        float* vr = &v[i * W + hh * D];
        for (int j = 0; j < D; ++j) kr[j] = mk[j] + static_cast<float>(rng.Gaussian());
        for (int r = 0; r < D; ++r) {
          double s = mv[r];
          for (int j = 0; j < D; ++j) s += am[r * D + j] * (kr[j] - mk[j]);
          vr[r] = static_cast<float>(s + 0.01 * rng.Gaussian());
        }
      }
    }
    // One anomaly per cluster: the first token of each label after T/3.
    for (int cl = 0; cl < C; ++cl) {
      for (int64_t i = T / 3; i < T; ++i) {
        if (label[i] == cl) {
          anomalies.push_back(i);
          for (int64_t j = 0; j < W; ++j) v[i * W + j] += 6.0f;
          break;
        }
      }
    }
    std::sort(anomalies.begin(), anomalies.end());
  }
  TensorView kv(int64_t t0, int64_t t1, bool value) const {
    const auto& x = value ? v : k;
    return TensorView(x.data() + t0 * H * D, {t1 - t0, H, D}, DType::F32);
  }
};

// The default birth and merge rules; fewer outliers, a smaller ridge.
ClusterBankOptions PlantedOptions() {
  ClusterBankOptions o;
  o.max_clusters = 8;
  o.outlier_top_k = 2;
  o.ridge = 1e-3;
  return o;
}

}  // namespace kvq::test
