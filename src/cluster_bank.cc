// E2 ClusterBank: online DP-means assignment, exact moment sums, merges,
// Gaussian-affine fits (Eigen) and per-cluster outliers. See cluster_bank.h.
#include "kvq/cluster_bank.h"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvq/affine.h"

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

// Mean over coordinates of the per-coordinate (population) variance across
// the T rows of a (T, width) array.
double MeanCoordinateVariance(const float* x, int64_t t, int64_t width) {
  if (t < 2) return 0.0;
  std::vector<double> mean(static_cast<size_t>(width), 0.0), m2(static_cast<size_t>(width), 0.0);
  for (int64_t i = 0; i < t; ++i) {  // Welford, per coordinate
    const float* row = x + i * width;
    const double inv = 1.0 / static_cast<double>(i + 1);
    for (int64_t j = 0; j < width; ++j) {
      const double d = row[j] - mean[static_cast<size_t>(j)];
      mean[static_cast<size_t>(j)] += d * inv;
      m2[static_cast<size_t>(j)] += d * (row[j] - mean[static_cast<size_t>(j)]);
    }
  }
  double s = 0.0;
  for (double v : m2) s += v;
  return s / (static_cast<double>(t) * static_cast<double>(width));
}

double SquaredDistance(const float* k, const double* mean, int64_t width) {
  double s = 0.0;
  for (int64_t j = 0; j < width; ++j) {
    const double d = k[j] - mean[j];
    s += d * d;
  }
  return s;
}

}  // namespace

ClusterMoments::ClusterMoments(int d)
    : sum_k(static_cast<size_t>(d), 0.0),
      sum_kk(static_cast<size_t>(d) * static_cast<size_t>(d), 0.0),
      sum_v(static_cast<size_t>(d), 0.0),
      sum_vk(static_cast<size_t>(d) * static_cast<size_t>(d), 0.0) {}

void ClusterMoments::add(const float* k, const float* v, double weight) {
  const size_t d = sum_k.size();
  count += weight;
  for (size_t i = 0; i < d; ++i) {
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
  VecD qh(d), sq(d);
  for (const auto& [id, c] : clusters_) {
    AttentionPart part{std::vector<double>(static_cast<size_t>(n_q_heads)),
                       std::vector<float>(static_cast<size_t>(n_q_heads) * d)};
    for (int hk = 0; hk < n_head_; ++hk) {
      const ClusterMoments& m = c.heads[static_cast<size_t>(hk)];
      const ClusterHeadFit& f = c.fits[static_cast<size_t>(hk)];
      const double inv_n = 1.0 / m.count;
      const Eigen::Map<const VecD> sk(m.sum_k.data(), static_cast<Eigen::Index>(d));
      const Eigen::Map<const MatD> skk(m.sum_kk.data(), static_cast<Eigen::Index>(d), static_cast<Eigen::Index>(d));
      const VecD mu = sk * inv_n;
      const MatD sigma = skk * inv_n - mu * mu.transpose();  // population covariance
      for (int g = 0; g < G; ++g) {
        const int h = hk * G + g;
        for (size_t e = 0; e < d; ++e) qh[static_cast<Eigen::Index>(e)] = q[static_cast<size_t>(h) * d + e];
        sq = sigma * qh;
        part.log_mass[static_cast<size_t>(h)] = std::log(m.count) + s * qh.dot(mu) + 0.5 * s * s * qh.dot(sq);
        for (size_t i = 0; i < d; ++i) {
          double v = f.mean_v[i];
          for (size_t j = 0; j < d; ++j) v += s * f.a[i * d + j] * sq[static_cast<Eigen::Index>(j)];
          part.value[static_cast<size_t>(h) * d + i] = static_cast<float>(v);
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
    const int64_t bad = first_non_finite({x->data_as<float>(), static_cast<size_t>(x->numel())});
    KVQ_CHECK_ARG(bad < 0, "birth_and_merge: ", arg, ": expected finite values, element ", bad, " is ",
                  x->data_as<float>()[bad]);
  }
  // No throwing beyond this point: the bank is only modified below.

  const double chunk_var = MeanCoordinateVariance(K, T, W);
  if (chunk_var > 0) key_variance_ = chunk_var;
  const double norm = 1.0 / (static_cast<double>(W) * (key_variance_ > 0 ? key_variance_ : 1.0));

  // 1. Online DP-means assignment on working means (flattened keys).
  struct Working {
    int id;
    double n;
    std::vector<double> mean;  // (W)
  };
  std::vector<Working> work;
  for (const auto& [id, c] : clusters_) {
    Working w{id, c.heads[0].count, std::vector<double>(static_cast<size_t>(W))};
    for (int h = 0; h < n_head_; ++h)
      for (int j = 0; j < d; ++j)
        w.mean[static_cast<size_t>(h * d + j)] = c.heads[static_cast<size_t>(h)].sum_k[static_cast<size_t>(j)] / w.n;
    work.push_back(std::move(w));
  }
  BirthMergeReceipt r;
  std::vector<int> assign(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const float* k = K + t * W;
    double best = std::numeric_limits<double>::infinity();
    size_t bi = 0;
    for (size_t c = 0; c < work.size(); ++c) {
      const double dist = SquaredDistance(k, work[c].mean.data(), W) * norm;
      if (dist < best) best = dist, bi = c;
    }
    if ((work.empty() || best > opts_.birth_distance) &&
        static_cast<int>(work.size()) < opts_.max_clusters) {
      Working w{next_id_++, 1.0, std::vector<double>(k, k + W)};
      r.born.push_back(w.id);
      Cluster c;
      c.heads.assign(static_cast<size_t>(n_head_), ClusterMoments(d));
      clusters_.emplace(w.id, std::move(c));
      work.push_back(std::move(w));
      bi = work.size() - 1;
    } else {
      Working& w = work[bi];
      w.n += 1.0;
      for (int64_t j = 0; j < W; ++j) w.mean[static_cast<size_t>(j)] += (k[j] - w.mean[static_cast<size_t>(j)]) / w.n;
    }
    assign[static_cast<size_t>(t)] = work[bi].id;
  }
  r.births = static_cast<int>(r.born.size());

  // 2. Moments.
  for (int64_t t = 0; t < T; ++t) {
    Cluster& c = clusters_.at(assign[static_cast<size_t>(t)]);
    for (int h = 0; h < n_head_; ++h)
      c.heads[static_cast<size_t>(h)].add(K + t * W + h * d, V + t * W + h * d);
  }

  // 3. Merges: closest pair within merge_distance, then any pair needed to
  // respect max_clusters (births never exceed it, so this is a safeguard).
  auto mean_of = [&](const Cluster& c) {
    std::vector<double> m(static_cast<size_t>(W));
    for (int h = 0; h < n_head_; ++h)
      for (int j = 0; j < d; ++j)
        m[static_cast<size_t>(h * d + j)] = c.heads[static_cast<size_t>(h)].sum_k[static_cast<size_t>(j)] /
                                             c.heads[static_cast<size_t>(h)].count;
    return m;
  };
  std::map<int, int> absorbed_into;
  for (;;) {
    std::vector<std::pair<int, std::vector<double>>> means;
    for (const auto& [id, c] : clusters_) means.emplace_back(id, mean_of(c));
    if (means.size() < 2) break;
    double best = std::numeric_limits<double>::infinity();
    size_t ba = 0, bb = 0;
    for (size_t a = 0; a < means.size(); ++a)
      for (size_t b = a + 1; b < means.size(); ++b) {
        double s = 0.0;
        for (int64_t j = 0; j < W; ++j) {
          const double dd = means[a].second[static_cast<size_t>(j)] - means[b].second[static_cast<size_t>(j)];
          s += dd * dd;
        }
        s *= norm;
        if (s < best) best = s, ba = a, bb = b;
      }
    const bool by_distance = opts_.merge_distance > 0 && best <= opts_.merge_distance;
    if (!by_distance && static_cast<int>(means.size()) <= opts_.max_clusters) break;
    const int keep = means[ba].first, gone = means[bb].first;  // ids ascending: keep is older
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
