// Calibrated ranges and per-channel bit allocation (kvq/static_ranges.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kvq/error.h"
#include "kvq/static_ranges.h"

namespace kvq {

namespace {
constexpr float kF16Max = 65504.0f;
constexpr int kMaxBits = 8;
}  // namespace

StaticRanges StaticRanges::from_samples(const std::vector<std::vector<float>>& k,
                                        const std::vector<std::vector<float>>& v, int n_kv_heads, int head_dim,
                                        double clip) {
  KVQ_CHECK_ARG(!k.empty() && k.size() == v.size(), "ranges: expected the same number (>= 1) of K and V layers, got ",
                k.size(), " and ", v.size());
  KVQ_CHECK_ARG(n_kv_heads >= 1 && head_dim >= 1, "ranges: expected n_kv_heads, head_dim >= 1");
  KVQ_CHECK_ARG(clip >= 0.0 && clip < 0.25, "ranges: clip must be in [0, 0.25), got ", clip);
  const size_t E = static_cast<size_t>(n_kv_heads) * static_cast<size_t>(head_dim);
  StaticRanges r;
  r.n_layers = static_cast<int>(k.size());
  r.n_kv_heads = n_kv_heads;
  r.head_dim = head_dim;
  const size_t rows = k[0].size() / E;
  KVQ_CHECK_ARG(rows >= 1, "ranges: expected at least one sample row");
  r.samples = static_cast<int64_t>(rows);
  std::vector<float> col(rows);
  for (int which = 0; which < 2; ++which) {
    const auto& src = which == 0 ? k : v;
    std::vector<float>& lo = which == 0 ? r.k_lo : r.v_lo;
    std::vector<float>& hi = which == 0 ? r.k_hi : r.v_hi;
    for (const auto& layer : src) {
      KVQ_CHECK_ARG(layer.size() == rows * E, "ranges: every layer needs ", rows, " rows of ", E, " values");
      for (size_t c = 0; c < E; ++c) {
        for (size_t t = 0; t < rows; ++t) {
          col[t] = layer[t * E + c];
          KVQ_CHECK_ARG(std::isfinite(col[t]), "ranges: non-finite sample");
        }
        const size_t cut = static_cast<size_t>(clip * static_cast<double>(rows));
        std::nth_element(col.begin(), col.begin() + static_cast<std::ptrdiff_t>(cut), col.end());
        lo.push_back(col[cut]);
        std::nth_element(col.begin(), col.begin() + static_cast<std::ptrdiff_t>(rows - 1 - cut), col.end());
        hi.push_back(col[rows - 1 - cut]);
      }
    }
  }
  return r;
}

void StaticRanges::validate(int layers, int heads, int hd, const char* arg) const {
  const size_t n = static_cast<size_t>(layers) * static_cast<size_t>(heads) * static_cast<size_t>(hd);
  KVQ_CHECK_ARG(n_layers == layers && n_kv_heads == heads && head_dim == hd && k_lo.size() == n && k_hi.size() == n &&
                    v_lo.size() == n && v_hi.size() == n,
                arg, ": ranges for ", layers, " layers x ", heads, " heads x ", hd, " expected, got ", n_layers, " x ",
                n_kv_heads, " x ", head_dim);
  for (size_t i = 0; i < n; ++i) {
    KVQ_CHECK_ARG(std::isfinite(k_lo[i]) && std::isfinite(k_hi[i]) && k_lo[i] <= k_hi[i] && std::isfinite(v_lo[i]) &&
                      std::isfinite(v_hi[i]) && v_lo[i] <= v_hi[i] && std::fabs(k_lo[i]) <= kF16Max &&
                      std::fabs(k_hi[i]) <= kF16Max && std::fabs(v_lo[i]) <= kF16Max && std::fabs(v_hi[i]) <= kF16Max,
                  arg, ": channel ", i, " needs finite lo <= hi within the fp16 range");
  }
}

std::vector<int> allocate_channel_bits(std::span<const float> weights, int avg_bits, int min_bits, int max_bits) {
  const int n = static_cast<int>(weights.size());
  KVQ_CHECK_ARG(n >= 1 && min_bits >= 1 && min_bits <= avg_bits && avg_bits <= max_bits && max_bits <= kMaxBits,
                "bits: expected 1 <= min ", min_bits, " <= average ", avg_bits, " <= max ", max_bits, " <= 8 over ", n,
                " channels");
  for (float w : weights) KVQ_CHECK_ARG(std::isfinite(w) && w >= 0.0f, "weights: expected finite values >= 0");
  std::vector<int> b(static_cast<size_t>(n), min_bits);
  std::vector<double> err(static_cast<size_t>(n));  // w_i 4^-b_i
  for (int i = 0; i < n; ++i) err[static_cast<size_t>(i)] = weights[static_cast<size_t>(i)] * std::ldexp(1.0, -2 * min_bits);
  for (int64_t left = static_cast<int64_t>(avg_bits - min_bits) * n; left > 0; --left) {
    int best = -1;
    for (int i = 0; i < n; ++i) {
      const size_t u = static_cast<size_t>(i);
      if (b[u] >= max_bits) continue;
      const size_t ub = static_cast<size_t>(best);
      if (best < 0 || err[u] > err[ub] || (err[u] == err[ub] && b[u] < b[ub])) best = i;
    }
    ++b[static_cast<size_t>(best)];
    err[static_cast<size_t>(best)] *= 0.25;
  }
  return b;
}
}  // namespace kvq
