// E2 ClusterBank: online DP-means assignment, exact moment sums, merges,
// Gaussian-affine fits (Eigen) and per-cluster outliers. See cluster_bank.h.
#include "kvq/cluster_bank.h"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvq/affine.h"
#include "kvq/stats.h"
#include "src/base/names.h"

namespace kvq {
namespace {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VecD = Eigen::VectorXd;

void CheckChunk(const TensorView& x, const char* arg, int n_head, int d_head) {
  KVQ_CHECK_ARG(x.dtype() == DType::F32 || x.dtype() == DType::F16 || x.dtype() == DType::BF16,
                "birth_and_merge: ", arg, ": expected dtype F32, F16 or BF16, got ", dtype_name(x.dtype()));
  KVQ_CHECK_ARG(x.rank() == 3 && x.dim(1) == n_head && x.dim(2) == d_head, "birth_and_merge: ", arg,
                ": expected shape (T, ", n_head, ", ", d_head, "), got ", shape_str(x.shape()));
  KVQ_CHECK_ARG(x.dim(0) >= 1, "birth_and_merge: ", arg, ": expected at least one token (T >= 1), got T = 0");
}

// A first sigma_h^2 for a chunk, from the lower tail of pairwise squared
// key distances, which does not grow with the distance between groups:
// with C <= max_clusters groups, at least 1/C of all pairs lie within one
// group, and for Gaussian groups their squared distance in head h is
// 2 sigma_h^2 chi^2_d. So the p = 1/(4 max_clusters) quantile of all pairs,
// divided by 2 chi2_quantile(p, d), is sigma_h^2 for one Gaussian and over
// it by at most chi2_quantile(4p, d) / chi2_quantile(p, d) (1.3 for d = 8
// and 16 groups); the fixed point then refines it. At most 512 tokens
// (evenly strided) are paired; p is at least 16 pairs' worth (at most 1/2),
// so a tiny chunk reads a steadier quantile.
std::vector<double> PairwiseScale(const float* K, int64_t T, int n_head, int d, int max_clusters) {
  std::vector<double> out(static_cast<size_t>(n_head), 0.0);
  if (T < 2) return out;
  const int64_t n = std::min<int64_t>(T, 512), w = int64_t{n_head} * d;
  const int64_t pairs = n * (n - 1) / 2;
  // At least 16 pairs below the quantile: one extreme pair is too noisy.
  const double p = std::min(0.5, std::max(1.0 / (4.0 * max_clusters), 16.0 / static_cast<double>(pairs)));
  const size_t at = static_cast<size_t>(p * static_cast<double>(pairs - 1));
  std::vector<double> dist(static_cast<size_t>(pairs));
  for (int h = 0; h < n_head; ++h) {
    size_t i = 0;
    for (int64_t a = 0; a < n; ++a) {
      const float* ka = K + (a * T / n) * w + h * d;
      for (int64_t b = a + 1; b < n; ++b) {
        const float* kb = K + (b * T / n) * w + h * d;
        double s = 0.0;
        for (int j = 0; j < d; ++j) {
          const double dv = static_cast<double>(ka[j]) - kb[j];
          s += dv * dv;
        }
        dist[i++] = s;
      }
    }
    std::nth_element(dist.begin(), dist.begin() + static_cast<std::ptrdiff_t>(at), dist.end());
    out[static_cast<size_t>(h)] = dist[at] / (2.0 * chi_square_quantile(p, d));
  }
  return out;
}

// A usable per-head scale: false when no head has a positive finite
// variance; otherwise heads without one take the mean of those with one.
bool UsableScale(std::vector<double>& s) {
  double sum = 0.0;
  int n = 0;
  for (double v : s)
    if (v > 0 && std::isfinite(v)) sum += v, ++n;
  if (n == 0) return false;
  for (double& v : s)
    if (!(v > 0 && std::isfinite(v))) v = sum / n;
  return true;
}

// A cluster's keys as assignment and merges see them: count, mean key and,
// per head, the sum of squared key norms (for the within-cluster scatter).
struct KeySummary {
  double n = 0;
  std::vector<double> mean;  // (W)
  std::vector<double> ss;    // (n_head) sum ||k_h||^2
  bool alive = true;
};

// Steps 1 and 3 of birth_and_merge on summaries (see cluster_bank.h).
// Clusters [0, n_bank) are the bank's (ids ascending), later ones are born
// here in order; merges keep the smaller index.
struct Partition {
  std::vector<KeySummary> clusters;
  std::vector<int> assign;                   // (T) index into clusters, before merges
  std::vector<std::pair<int, int>> merged;   // (kept, absorbed) indices, in order
};

class Partitioner {
 public:
  Partitioner(int n_head, int d, const ClusterBankOptions& o, const std::vector<double>& scale)
      : n_head_(n_head), d_(d), w_(int64_t{n_head} * d), o_(o), inv_(scale.size()) {
    for (size_t h = 0; h < scale.size(); ++h) inv_[h] = 1.0 / scale[h];
  }

  // Normalised squared distance between a key (or mean) and a mean.
  template <typename T>
  double Dist(const T* k, const double* mean) const {
    double total = 0.0;
    for (int h = 0; h < n_head_; ++h) {
      double s = 0.0;
      for (int j = 0; j < d_; ++j) {
        const double dv = static_cast<double>(k[h * d_ + j]) - mean[h * d_ + j];
        s += dv * dv;
      }
      total += s * inv_[static_cast<size_t>(h)];
    }
    return total / static_cast<double>(w_);
  }

  // The union's between-cluster variance along the line joining the two
  // means, in units of sigma^2, with the means' sampling noise removed.
  double MergeCost(const KeySummary& x, const KeySummary& y) const {
    const double n = x.n + y.n, w = static_cast<double>(w_);
    const double delta2 = Dist(x.mean.data(), y.mean.data()) * w - w * (1.0 / x.n + 1.0 / y.n);
    return x.n * y.n / (n * n) * std::max(0.0, delta2);
  }

  // Merges the live pair of least cost when it is <= limit; returns whether
  // it did.
  bool MergeCheapest(Partition& p, double limit) const {
    double best = std::numeric_limits<double>::infinity();
    size_t ba = 0, bb = 0;
    for (size_t a = 0; a < p.clusters.size(); ++a) {
      if (!p.clusters[a].alive) continue;
      for (size_t b = a + 1; b < p.clusters.size(); ++b) {
        if (!p.clusters[b].alive) continue;
        const double cost = MergeCost(p.clusters[a], p.clusters[b]);
        if (cost < best) best = cost, ba = a, bb = b;
      }
    }
    if (!(best <= limit)) return false;
    KeySummary &x = p.clusters[ba], &y = p.clusters[bb];
    const double n = x.n + y.n;
    for (size_t j = 0; j < x.mean.size(); ++j) x.mean[j] = (x.n * x.mean[j] + y.n * y.mean[j]) / n;
    for (size_t h = 0; h < x.ss.size(); ++h) x.ss[h] += y.ss[h];
    x.n = n;
    y.alive = false;
    p.merged.emplace_back(static_cast<int>(ba), static_cast<int>(bb));
    return true;
  }

  Partition Run(std::vector<KeySummary> bank, const float* K, int64_t T) const {
    Partition p;
    p.clusters = std::move(bank);
    p.assign.resize(static_cast<size_t>(T));
    int alive = static_cast<int>(p.clusters.size());
    const double limit = o_.merge_distance > 0 ? o_.merge_distance : -1.0;
    for (int64_t t = 0; t < T; ++t) {
      const float* k = K + t * w_;
      double best = std::numeric_limits<double>::infinity();
      size_t bi = 0;
      for (size_t c = 0; c < p.clusters.size(); ++c) {
        const KeySummary& cs = p.clusters[c];
        if (!cs.alive) continue;
        const double dist = Dist(k, cs.mean.data()) / (1.0 + 1.0 / cs.n);
        if (dist < best) best = dist, bi = c;
      }
      const bool birth = alive == 0 || best > o_.birth_distance;
      // No room: make some by a merge the end of the chunk would do anyway.
      if (birth && alive >= o_.max_clusters && MergeCheapest(p, limit)) {
        --alive;
        if (!p.clusters[bi].alive) bi = static_cast<size_t>(p.merged.back().first);
      }
      if (birth && alive < o_.max_clusters) {
        KeySummary cs;
        cs.mean.assign(static_cast<size_t>(w_), 0.0);
        cs.ss.assign(static_cast<size_t>(n_head_), 0.0);
        p.clusters.push_back(std::move(cs));
        bi = p.clusters.size() - 1;
        ++alive;
      }
      KeySummary& cs = p.clusters[bi];
      cs.n += 1.0;
      for (int64_t j = 0; j < w_; ++j) {
        cs.mean[static_cast<size_t>(j)] += (k[j] - cs.mean[static_cast<size_t>(j)]) / cs.n;
        cs.ss[static_cast<size_t>(j / d_)] += static_cast<double>(k[j]) * k[j];
      }
      p.assign[static_cast<size_t>(t)] = static_cast<int>(bi);
    }
    while (alive >= 2 && MergeCheapest(p, alive > o_.max_clusters ? std::numeric_limits<double>::infinity() : limit))
      --alive;
    return p;
  }

 private:
  int n_head_, d_;
  int64_t w_;
  const ClusterBankOptions& o_;
  std::vector<double> inv_;
};

// Pooled within-cluster variance per head of the live clusters; all zero
// when no cluster holds two tokens.
std::vector<double> PooledWithin(const std::vector<KeySummary>& cs, int n_head, int d) {
  std::vector<double> scatter(static_cast<size_t>(n_head), 0.0);
  double dof = 0.0;
  for (const KeySummary& c : cs) {
    if (!c.alive || c.n < 2) continue;
    dof += c.n - 1;
    for (int h = 0; h < n_head; ++h) {
      double m2 = 0.0;
      for (int j = 0; j < d; ++j) m2 += c.mean[static_cast<size_t>(h * d + j)] * c.mean[static_cast<size_t>(h * d + j)];
      scatter[static_cast<size_t>(h)] += std::max(0.0, c.ss[static_cast<size_t>(h)] - c.n * m2);
    }
  }
  for (double& v : scatter) v = dof > 0 ? v / (dof * d) : 0.0;
  return scatter;
}

}  // namespace

constexpr NamedValue<FarFieldClosure> kClosures[] = {{FarFieldClosure::kTwoPoint, "two-point"},
                                                     {FarFieldClosure::kGaussian, "gaussian"}};
const char* far_field_closure_name(FarFieldClosure c) { return name_of(kClosures, c, "?"); }
FarFieldClosure parse_far_field_closure(const std::string& name) { return parse_name(kClosures, name, "closure"); }

ClusterMoments::ClusterMoments(int d)
    : sum_k(static_cast<size_t>(d), 0.0),
      sum_kk(static_cast<size_t>(d) * static_cast<size_t>(d), 0.0),
      sum_v(static_cast<size_t>(d), 0.0),
      sum_vk(static_cast<size_t>(d) * static_cast<size_t>(d), 0.0),
      k_lo(static_cast<size_t>(d), std::numeric_limits<float>::infinity()),
      k_hi(static_cast<size_t>(d), -std::numeric_limits<float>::infinity()),
      v_lo(static_cast<size_t>(d), std::numeric_limits<float>::infinity()),
      v_hi(static_cast<size_t>(d), -std::numeric_limits<float>::infinity()) {}

void ClusterMoments::add(const float* k, const float* v, double weight) {
  const size_t d = sum_k.size();
  count += weight;
  for (size_t i = 0; i < d; ++i) {
    if (weight > 0) {
      k_lo[i] = std::min(k_lo[i], k[i]), k_hi[i] = std::max(k_hi[i], k[i]);
      v_lo[i] = std::min(v_lo[i], v[i]), v_hi[i] = std::max(v_hi[i], v[i]);
    }
    const double wk = weight * k[i], wv = weight * v[i];
    sum_k[i] += wk;
    sum_v[i] += wv;
    double* kk = &sum_kk[i * d];
    double* vk = &sum_vk[i * d];
    for (size_t j = 0; j < d; ++j) {
      kk[j] += wk * k[j];
      vk[j] += wv * k[j];
    }
  }
}

void ClusterMoments::merge(const ClusterMoments& o) {
  KVQ_ASSERT(o.sum_k.size() == sum_k.size());
  count += o.count;
  for (size_t i = 0; i < sum_k.size(); ++i) {
    sum_k[i] += o.sum_k[i];
    sum_v[i] += o.sum_v[i];
    k_lo[i] = std::min(k_lo[i], o.k_lo[i]), k_hi[i] = std::max(k_hi[i], o.k_hi[i]);
    v_lo[i] = std::min(v_lo[i], o.v_lo[i]), v_hi[i] = std::max(v_hi[i], o.v_hi[i]);
  }
  for (size_t i = 0; i < sum_kk.size(); ++i) {
    sum_kk[i] += o.sum_kk[i];
    sum_vk[i] += o.sum_vk[i];
  }
}

ClusterBank::ClusterBank(int n_head, int d_head, const ClusterBankOptions& o)
    : n_head_(n_head), d_head_(d_head), opts_(o) {
  KVQ_CHECK_ARG(n_head >= 1, "ClusterBank: n_head: expected >= 1, got ", n_head);
  KVQ_CHECK_ARG(d_head >= 1, "ClusterBank: d_head: expected >= 1, got ", d_head);
  KVQ_CHECK_ARG(o.max_clusters >= 1, "ClusterBank: max_clusters: expected >= 1, got ", o.max_clusters);
  KVQ_CHECK_ARG(std::isfinite(o.birth_distance) && o.birth_distance > 0,
                "ClusterBank: birth_distance: expected a finite value > 0, got ", o.birth_distance);
  KVQ_CHECK_ARG(std::isfinite(o.merge_distance) && o.merge_distance >= 0,
                "ClusterBank: merge_distance: expected a finite value >= 0, got ", o.merge_distance);
  KVQ_CHECK_ARG(o.outlier_top_k >= 0, "ClusterBank: outlier_top_k: expected >= 0, got ", o.outlier_top_k);
  KVQ_CHECK_ARG(o.closure == FarFieldClosure::kTwoPoint || o.closure == FarFieldClosure::kGaussian,
                "ClusterBank: closure: expected two-point or gaussian, got ", static_cast<int>(o.closure));
  KVQ_CHECK_ARG(std::isfinite(o.ridge) && o.ridge > 0, "ClusterBank: ridge: expected a finite value > 0, got ",
                o.ridge);
}

std::vector<int> ClusterBank::cluster_ids() const {
  std::vector<int> ids;
  ids.reserve(clusters_.size());
  for (const auto& [id, c] : clusters_) ids.push_back(id);
  return ids;
}

const ClusterBank::Cluster& ClusterBank::at(int id, const char* fn) const {
  auto it = clusters_.find(id);
  KVQ_CHECK_ARG(it != clusters_.end(), "ClusterBank::", fn, ": id: no live cluster ", id);
  return it->second;
}

int64_t ClusterBank::cluster_count(int id) const {
  return static_cast<int64_t>(std::llround(at(id, "cluster_count").heads[0].count));
}

const ClusterMoments& ClusterBank::moments(int id, int head) const {
  const Cluster& c = at(id, "moments");
  KVQ_CHECK_ARG(head >= 0 && head < n_head_, "ClusterBank::moments: head: expected [0, ", n_head_, "), got ", head);
  return c.heads[static_cast<size_t>(head)];
}

ClusterHeadFit ClusterBank::fit(int id, int head) const {
  const Cluster& c = at(id, "fit");
  KVQ_CHECK_ARG(head >= 0 && head < n_head_, "ClusterBank::fit: head: expected [0, ", n_head_, "), got ", head);
  return c.fits[static_cast<size_t>(head)];
}

AttentionPart ClusterBank::far_field(std::span<const float> q, int n_q_heads, float scale) const {
  KVQ_CHECK_ARG(n_q_heads > 0 && n_q_heads % n_head_ == 0, "far_field: n_q_heads: expected a positive multiple of ",
                "n_head = ", n_head_, ", got ", n_q_heads);
  const size_t d = static_cast<size_t>(d_head_);
  KVQ_CHECK_ARG(q.size() == static_cast<size_t>(n_q_heads) * d, "far_field: q: expected n_q_heads * d_head = ",
                static_cast<size_t>(n_q_heads) * d, " values, got ", q.size());
  const int64_t bad = first_non_finite(q);
  KVQ_CHECK_ARG(bad < 0, "far_field: q: expected finite values, element ", bad, " is ", bad >= 0 ? q[bad] : 0.0f);
  KVQ_CHECK_ARG(std::isfinite(scale), "far_field: scale: expected a finite value, got ", scale);
  const double s = scale != 0.0f ? scale : 1.0 / std::sqrt(static_cast<double>(d));
  const int G = n_q_heads / n_head_;
  std::vector<AttentionPart> parts;
  parts.reserve(clusters_.size());
  VecD qh(d), sq(d), tilted(d);
  for (const auto& [id, c] : clusters_) {
    AttentionPart part{std::vector<double>(static_cast<size_t>(n_q_heads)),
                       std::vector<float>(static_cast<size_t>(n_q_heads) * d)};
    for (int hk = 0; hk < n_head_; ++hk) {
      const ClusterMoments& mom = c.heads[static_cast<size_t>(hk)];
      const ClusterHeadFit& f = c.fits[static_cast<size_t>(hk)];
      const double inv_n = 1.0 / mom.count;
      const Eigen::Map<const VecD> sk(mom.sum_k.data(), static_cast<Eigen::Index>(d));
      const Eigen::Map<const MatD> skk(mom.sum_kk.data(), static_cast<Eigen::Index>(d), static_cast<Eigen::Index>(d));
      const VecD mu = sk * inv_n;
      const MatD sigma = skk * inv_n - mu * mu.transpose();  // population covariance
      for (int g = 0; g < G; ++g) {
        const int h = hk * G + g;
        for (size_t e = 0; e < d; ++e) qh[static_cast<Eigen::Index>(e)] = q[static_cast<size_t>(h) * d + e];
        sq = sigma * qh;
        const double m = s * qh.dot(mu);
        const double sd = s * std::sqrt(std::max(0.0, qh.dot(sq)));
        // Score range over the key box: the log-mass can be no larger.
        double smax = 0.0;
        for (size_t e = 0; e < d; ++e) {
          const double qe = qh[static_cast<Eigen::Index>(e)];
          smax += std::max(qe * mom.k_lo[e], qe * mom.k_hi[e]);
        }
        const double log_n = std::log(mom.count), jensen = log_n + m;
        const double upper = std::max(jensen, log_n + s * smax);
        double lm, tilt;  // tilt: the tilted key mean is mu + tilt * Sigma q
        if (opts_.closure == FarFieldClosure::kGaussian) {
          lm = jensen + 0.5 * sd * sd;
          tilt = s;
        } else {  // log cosh, overflow-free
          lm = jensen + sd + std::log1p(std::exp(-2.0 * sd)) - std::log(2.0);
          tilt = sd > 1e-12 ? s * std::tanh(sd) / sd : s;
        }
        part.log_mass[static_cast<size_t>(h)] = std::clamp(lm, jensen, upper);
        for (size_t e = 0; e < d; ++e) {
          const Eigen::Index ei = static_cast<Eigen::Index>(e);
          tilted[ei] = std::clamp(mu[ei] + tilt * sq[ei], static_cast<double>(mom.k_lo[e]),
                                  static_cast<double>(mom.k_hi[e])) - mu[ei];
        }
        for (size_t i = 0; i < d; ++i) {
          double v = f.mean_v[i];
          for (size_t j = 0; j < d; ++j) v += f.a[i * d + j] * tilted[static_cast<Eigen::Index>(j)];
          part.value[static_cast<size_t>(h) * d + i] =
              static_cast<float>(std::clamp(v, static_cast<double>(mom.v_lo[i]), static_cast<double>(mom.v_hi[i])));
        }
      }
    }
    parts.push_back(std::move(part));
  }
  if (parts.empty()) {
    return AttentionPart{std::vector<double>(static_cast<size_t>(n_q_heads), -std::numeric_limits<double>::infinity()),
                         std::vector<float>(static_cast<size_t>(n_q_heads) * d, 0.0f)};
  }
  return merge_attention_parts(parts);
}

void ClusterBank::Refit(Cluster& c) const {
  const int d = d_head_;
  c.fits.resize(static_cast<size_t>(n_head_));
  for (int h = 0; h < n_head_; ++h) {
    const ClusterMoments& m = c.heads[static_cast<size_t>(h)];
    ClusterHeadFit& f = c.fits[static_cast<size_t>(h)];
    f.count = static_cast<int64_t>(std::llround(m.count));
    KVQ_ASSERT(m.count > 0.5);
    const double inv_n = 1.0 / m.count;
    const Eigen::Map<const VecD> sk(m.sum_k.data(), d), sv(m.sum_v.data(), d);
    const Eigen::Map<const MatD> skk(m.sum_kk.data(), d, d), svk(m.sum_vk.data(), d, d);
    const VecD mu_k = sk * inv_n, mu_v = sv * inv_n;
    MatD s_kk = skk - m.count * mu_k * mu_k.transpose();
    s_kk = 0.5 * (s_kk + s_kk.transpose()).eval();  // exact symmetry for the solver
    s_kk.diagonal().array() += opts_.ridge;
    const MatD s_vk = svk - m.count * mu_v * mu_k.transpose();
    // A (S_kk + rI) = S_vk  <=>  (S_kk + rI) A^T = S_vk^T (the matrix is symmetric).
    const MatD a = s_kk.ldlt().solve(s_vk.transpose()).transpose();
    f.mean_k.assign(mu_k.data(), mu_k.data() + d);
    f.mean_v.assign(mu_v.data(), mu_v.data() + d);
    f.a.resize(static_cast<size_t>(d) * static_cast<size_t>(d));
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) f.a[static_cast<size_t>(i * d + j)] = static_cast<float>(a(i, j));
  }
}

BirthMergeReceipt ClusterBank::birth_and_merge(const TensorView& chunk_k, const TensorView& chunk_v) {
  CheckChunk(chunk_k, "chunk_k", n_head_, d_head_);
  CheckChunk(chunk_v, "chunk_v", n_head_, d_head_);
  KVQ_CHECK_ARG(chunk_k.dim(0) == chunk_v.dim(0), "birth_and_merge: chunk_v: expected ", chunk_k.dim(0),
                " tokens like chunk_k, got ", chunk_v.dim(0));
  const Tensor kt = to_f32(chunk_k), vt = to_f32(chunk_v);
  const float* K = kt.data_as<float>();
  const float* V = vt.data_as<float>();
  const int64_t T = chunk_k.dim(0);
  const int64_t W = static_cast<int64_t>(n_head_) * d_head_;  // floats per token
  const int d = d_head_;
  for (const auto& [x, arg] : {std::pair{&kt, "chunk_k"}, std::pair{&vt, "chunk_v"}}) {
    const std::span<const float> xs(x->data_as<float>(), static_cast<size_t>(x->numel()));
    const int64_t bad = first_non_finite(xs);
    KVQ_CHECK_ARG(bad < 0, "birth_and_merge: ", arg, ": expected finite values, element ", bad, " is ",
                  x->data_as<float>()[bad]);
    const float amax = max_abs(xs);
    KVQ_CHECK_ARG(amax <= kMaxBankMagnitude, "birth_and_merge: ", arg, ": expected |values| <= ", kMaxBankMagnitude,
                  " (residuals are float sums of squares), got ", amax);
  }
  // No throwing beyond this point: the bank is only modified below.

  // 0. Scale (see cluster_bank.h): the bank's pooled within-cluster key
  // variance, or a fixed point on the chunk.
  std::vector<KeySummary> summaries;
  std::vector<int> bank_ids;
  for (const auto& [id, c] : clusters_) {
    KeySummary ks;
    ks.n = c.heads[0].count;
    ks.mean.resize(static_cast<size_t>(W));
    ks.ss.resize(static_cast<size_t>(n_head_));
    for (int h = 0; h < n_head_; ++h) {
      const ClusterMoments& m = c.heads[static_cast<size_t>(h)];
      double tr = 0.0;
      for (int j = 0; j < d; ++j) {
        ks.mean[static_cast<size_t>(h * d + j)] = m.sum_k[static_cast<size_t>(j)] / m.count;
        tr += m.sum_kk[static_cast<size_t>(j * d + j)];
      }
      ks.ss[static_cast<size_t>(h)] = tr;
    }
    summaries.push_back(std::move(ks));
    bank_ids.push_back(id);
  }
  std::vector<double> scale = PooledWithin(summaries, n_head_, d);
  if (!UsableScale(scale)) {
    scale = PairwiseScale(K, T, n_head_, d, opts_.max_clusters);
    if (!UsableScale(scale)) {
      scale = key_scale_;
      if (!UsableScale(scale)) scale.assign(static_cast<size_t>(n_head_), 1.0);
    } else {
      for (int round = 0; round < 16; ++round) {
        std::vector<double> within =
            PooledWithin(Partitioner(n_head_, d, opts_, scale).Run(summaries, K, T).clusters, n_head_, d);
        if (!UsableScale(within)) break;
        double now = 0.0, next = 0.0;
        for (int h = 0; h < n_head_; ++h) now += scale[static_cast<size_t>(h)], next += within[static_cast<size_t>(h)];
        if (!(next < now * (1.0 - 1e-3))) break;
        scale = std::move(within);
      }
    }
  }
  key_scale_ = scale;

  // 1 + 3 on summaries, then applied to the moments (2) in the same order.
  const Partition part = Partitioner(n_head_, d, opts_, scale).Run(std::move(summaries), K, T);
  BirthMergeReceipt r;
  std::vector<int> id_of(part.clusters.size());
  for (size_t i = 0; i < part.clusters.size(); ++i) {
    if (i < bank_ids.size()) {
      id_of[i] = bank_ids[i];
    } else {
      id_of[i] = next_id_++;
      r.born.push_back(id_of[i]);
      Cluster c;
      c.heads.assign(static_cast<size_t>(n_head_), ClusterMoments(d));
      clusters_.emplace(id_of[i], std::move(c));
    }
  }
  r.births = static_cast<int>(r.born.size());
  std::vector<int> assign(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    assign[static_cast<size_t>(t)] = id_of[static_cast<size_t>(part.assign[static_cast<size_t>(t)])];
    Cluster& c = clusters_.at(assign[static_cast<size_t>(t)]);
    for (int h = 0; h < n_head_; ++h)
      c.heads[static_cast<size_t>(h)].add(K + t * W + h * d, V + t * W + h * d);
  }
  std::map<int, int> absorbed_into;
  for (const auto& [ka, ga] : part.merged) {
    const int keep = id_of[static_cast<size_t>(ka)], gone = id_of[static_cast<size_t>(ga)];
    Cluster& kc = clusters_.at(keep);
    const Cluster& gc = clusters_.at(gone);
    for (int h = 0; h < n_head_; ++h) kc.heads[static_cast<size_t>(h)].merge(gc.heads[static_cast<size_t>(h)]);
    clusters_.erase(gone);
    absorbed_into[gone] = keep;
    r.merged.emplace_back(keep, gone);
  }
  r.merges = static_cast<int>(r.merged.size());
  for (int& a : assign) {
    for (auto it = absorbed_into.find(a); it != absorbed_into.end(); it = absorbed_into.find(a)) a = it->second;
  }

  // 4. Fits and residuals.
  auto residuals = [&](std::vector<float>& out) {
    out.resize(static_cast<size_t>(T));
    std::vector<double> diff(static_cast<size_t>(d));
    for (int64_t t = 0; t < T; ++t) {
      const Cluster& c = clusters_.at(assign[static_cast<size_t>(t)]);
      double res = 0.0;
      for (int h = 0; h < n_head_; ++h) {
        const ClusterHeadFit& f = c.fits[static_cast<size_t>(h)];
        const float* k = K + t * W + h * d;
        const float* v = V + t * W + h * d;
        for (int j = 0; j < d; ++j) diff[static_cast<size_t>(j)] = k[j] - f.mean_k[static_cast<size_t>(j)];
        for (int i = 0; i < d; ++i) {
          double pred = f.mean_v[static_cast<size_t>(i)];
          const float* arow = &f.a[static_cast<size_t>(i * d)];
          for (int j = 0; j < d; ++j) pred += arow[j] * diff[static_cast<size_t>(j)];
          const double e = v[i] - pred;
          res += e * e;
        }
      }
      out[static_cast<size_t>(t)] = static_cast<float>(res);
    }
  };
  // Only clusters whose moments changed need a new fit.
  std::vector<int> touched(assign.begin(), assign.end());
  for (const auto& [keep, gone] : r.merged) touched.push_back(keep);
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (int id : touched) {
    if (auto it = clusters_.find(id); it != clusters_.end()) Refit(it->second);
  }
  std::vector<float> res;
  residuals(res);

  // 5. Outliers: per cluster, the top residuals of this chunk's members.
  std::map<int, std::vector<int64_t>> members;
  for (int64_t t = 0; t < T; ++t) members[assign[static_cast<size_t>(t)]].push_back(t);
  std::vector<uint8_t> is_outlier(static_cast<size_t>(T), 0);
  if (opts_.outlier_top_k > 0) {
    for (auto& [id, mem] : members) {
      Cluster& c = clusters_.at(id);
      std::vector<int64_t> cand;
      for (int64_t t : mem)
        if (res[static_cast<size_t>(t)] > 0.0f) cand.push_back(t);
      const int64_t room = std::llround(c.heads[0].count) - 1;  // keep at least one token
      const int64_t n_out = std::min<int64_t>({opts_.outlier_top_k, static_cast<int64_t>(cand.size()), room});
      if (n_out <= 0) continue;
      std::partial_sort(cand.begin(), cand.begin() + n_out, cand.end(), [&](int64_t a, int64_t b) {
        const float ra = res[static_cast<size_t>(a)], rb = res[static_cast<size_t>(b)];
        return ra != rb ? ra > rb : a < b;
      });
      cand.resize(static_cast<size_t>(n_out));
      std::sort(cand.begin(), cand.end());
      OutlierTokenSet set{Tensor({n_out, n_head_, d_head_}, DType::F32), Tensor({n_out, n_head_, d_head_}, DType::F32),
                          cand};
      for (int64_t i = 0; i < n_out; ++i) {
        const int64_t t = cand[static_cast<size_t>(i)];
        is_outlier[static_cast<size_t>(t)] = 1;
        std::copy_n(K + t * W, W, set.k.data_as<float>() + i * W);
        std::copy_n(V + t * W, W, set.v.data_as<float>() + i * W);
        for (int h = 0; h < n_head_; ++h)
          c.heads[static_cast<size_t>(h)].add(K + t * W + h * d, V + t * W + h * d, -1.0);
      }
      Refit(c);
      r.per_cluster_outlier_tokens.emplace(id, std::move(set));
    }
    if (!r.per_cluster_outlier_tokens.empty()) residuals(res);
  }

  for (const auto& [id, mem] : members) {
    double s = 0.0;
    int64_t n = 0;
    for (int64_t t : mem)
      if (!is_outlier[static_cast<size_t>(t)]) s += res[static_cast<size_t>(t)], ++n;
    if (n > 0) r.per_cluster_misfit[id] = s / static_cast<double>(n);
  }
  r.assignments = std::move(assign);
  r.per_token_residual = std::move(res);
  total_births_ += r.births;
  total_merges_ += r.merges;
  return r;
}

}  // namespace kvq
