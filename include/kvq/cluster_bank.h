// E2 — ClusterBank and birth_and_merge (SPEC §4) with its far field.
//
// A bank summarises one layer's tokens. A token is its key and value, each of
// shape (n_head, d_head); W = n_head * d_head. Per chunk:
//  0. Scale: distances are measured in units of the spread of keys *within*
//     clusters, one variance per head, sigma_h^2, never the chunk's total
//     variance (which grows with the distance between clusters and made the
//     first version merge well-separated groups). sigma_h^2 is the bank's
//     pooled within-cluster variance, sum_c tr(S_kk,c,h) / (d_head sum_c (n_c - 1)).
//     A bank without one (fresh, or only singletons) finds it on the chunk
//     by a fixed point: start from the chunk's total variance, partition
//     (steps 1 and 3, on a copy), take the pooled within-cluster variance of
//     that partition, repeat while it shrinks (at most 16 times). Planted
//     well-separated groups are found in 2-3 rounds; one Gaussian stays one.
//     Every rule below is invariant to the data's units.
//  1. Assignment (online DP-means): tokens are visited in chunk order; each
//     goes to the cluster c (n_c tokens, mean mu_c) nearest in
//       dist(k, c) = sum_h ||k_h - mu_c,h||^2 / sigma_h^2 / W,
//     which is about 1 + 1/n_c for a member of c (chi^2_W / W). A token with
//     dist(k, c) > birth_distance * (1 + 1/n_c) for the nearest c, while
//     fewer than max_clusters exist, births a new cluster. Means move as
//     tokens join.
//  2. The chunk's tokens are added to their clusters' moments.
//  3. Merges (a unimodality rule): merging a and b gives a union whose
//     variance along the line joining their means exceeds the within-cluster
//     one by
//       cost(a, b) = n_a n_b / (n_a + n_b)^2 * (D2 - W (1/n_a + 1/n_b)),
//       D2 = sum_h ||mu_a,h - mu_b,h||^2 / sigma_h^2
//     (in units of sigma^2; the subtracted term is D2's expectation from the
//     means' sampling noise alone). Two equal Gaussians give a unimodal
//     union iff their means lie within 2 sigma, i.e. cost <= 1. Repeatedly,
//     the pair of least cost is merged while cost <= merge_distance, so
//     tail tokens of one Gaussian that birthed clusters of their own are
//     folded back and overlapping groups become one, whatever the number
//     of tokens. Merges also run during assignment when a birth finds no
//     room, and while more than max_clusters exist. Merges are exact moment
//     sums; the older (smaller) id survives.
//  4. Gaussian-affine fit per cluster and head:
//       A = S_vk (S_kk + ridge I)^-1,  v_hat = mu_v + A (k - mu_k),
//     with S_kk, S_vk the centred key and value-key scatters (sums over the
//     cluster's tokens, not averages). A token's residual is
//     sum_heads ||v - v_hat||^2.
//  5. Outliers: per cluster, the outlier_top_k tokens of this chunk with the
//     largest residual (ties: lower chunk position), never the cluster's last
//     token and never a token whose residual is 0. They are removed from the
//     cluster's moments and reported; the cluster is refitted, and the
//     receipt's residuals are those of the final fit.
//
// Far-field attention: for a query q (scale s), a cluster of n tokens with
// key mean mu, covariance Sigma = S_kk / n and per-coordinate key range
// [lo, hi] has score mean m = s q.mu and score spread sd = s sqrt(q'Sigma q).
// Its log-mass lies between log n + m (Jensen) and log n + s max_{lo<=k<=hi} q.k
// whatever its distribution; the estimate is always clipped into that
// interval, so a cluster can never claim more mass than its tokens could
// have. Two closures (FarFieldClosure):
//  - TwoPoint (default): the cluster read as two equal halves at
//    mu +- Sigma q / sqrt(q'Sigma q), which matches the mean and the score
//    variance along q: log-mass log n + m + log cosh(sd), value
//    mu_v + A (tanh(sd) / sd) s Sigma q. Exact for identical keys and for
//    two keys; it grows linearly, not quadratically, with the spread.
//  - Gaussian: log n + m + sd^2 / 2, value mu_v + s A Sigma q: exact in
//    expectation for Gaussian keys, but for two keys delta apart in score it
//    gives 2 e^{delta^2/2} where the truth is 2 cosh delta (the unclipped
//    form broke the model, +2662% PPL).
// The value's tilted key mean is clipped into [lo, hi] and the value into
// the cluster's per-coordinate value range, where every convex combination
// of its tokens' values lies. Clusters combine by log-sum-exp.
//
// Moments are kept as sums in double (count, sum k, sum k k^T, sum v,
// sum v k^T per head), so an update or a merge equals the moments of the
// union up to double rounding; the key and value ranges are float minima and
// maxima over every token the cluster ever held (outliers removed later
// stay inside them: the ranges stay valid bounds). State persists across
// chunks.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvq/attention_part.h"
#include "kvq/tensor.h"

namespace kvq {

// The largest |key| or |value| birth_and_merge takes: a residual, a float
// sum of W squared differences, stays finite up to W ~ 8e7.
inline constexpr float kMaxBankMagnitude = 1e15f;

// Append-only values.
enum class FarFieldClosure : int { kTwoPoint = 0, kGaussian = 1 };
const char* far_field_closure_name(FarFieldClosure c);
// "two-point" or "gaussian"; throws kvq::Error naming the argument otherwise.
FarFieldClosure parse_far_field_closure(const std::string& name);

struct ClusterBankOptions {
  // Clusters alive at once (>= 1); never exceeded.
  int max_clusters = 16;
  // dist(k, c) / (1 + 1/n_c) beyond which a token births a cluster (> 0).
  // 2 is about 3.5 standard deviations of chi^2_W / W for W = 32.
  double birth_distance = 2.0;
  // Merge cost (see step 3) up to which clusters merge (>= 0; 1: the union
  // of two equal clusters would be unimodal; 0 disables cost merges).
  double merge_distance = 2.0;
  // Outlier tokens flagged per cluster and chunk (>= 0).
  int outlier_top_k = 4;
  // Added to the key scatter's diagonal before inversion (> 0). The scatter
  // is a sum over tokens, so the ridge's pull fades as a cluster grows; it
  // makes a cluster of one token predict its own mean value (A = 0).
  double ridge = 1e-2;
  // How far_field reads a cluster (both bounded; see the top of this file).
  FarFieldClosure closure = FarFieldClosure::kTwoPoint;
};

// One cluster's outlier tokens from one chunk.
struct OutlierTokenSet {
  Tensor k;                      // F32 (n_out, n_head, d_head)
  Tensor v;                      // F32 (n_out, n_head, d_head)
  std::vector<int64_t> indices;  // flat chunk positions, ascending
};
using OutlierTokens = std::map<int, OutlierTokenSet>;

struct BirthMergeReceipt {
  std::vector<int> assignments;           // (T) final cluster id of every token
  std::vector<float> per_token_residual;  // (T) sum_heads ||v - v_hat||^2, final fit
  // Cluster id -> mean residual of its non-outlier tokens of this chunk
  // (clusters that received tokens of this chunk).
  std::map<int, double> per_cluster_misfit;
  int births = 0;
  int merges = 0;
  std::vector<int> born;                     // ids born in this chunk
  std::vector<std::pair<int, int>> merged;   // (kept, absorbed), in merge order
  OutlierTokens per_cluster_outlier_tokens;  // cluster id -> {k, v, indices}
};

// Moments of one cluster and head, as sums (double).
struct ClusterMoments {
  double count = 0;
  std::vector<double> sum_k;   // (d)
  std::vector<double> sum_kk;  // (d, d) row-major, sum k k^T
  std::vector<double> sum_v;   // (d)
  std::vector<double> sum_vk;  // (d, d) row-major, sum v k^T
  // Per-coordinate ranges of every key and value added (never shrunk).
  std::vector<float> k_lo, k_hi, v_lo, v_hi;  // (d) each

  explicit ClusterMoments(int d = 0);
  void add(const float* k, const float* v, double weight = 1.0);  // weight -1 removes
  void merge(const ClusterMoments& other);
};

// The Gaussian-affine fit of one cluster and head.
struct ClusterHeadFit {
  int64_t count = 0;
  std::vector<float> mean_k;  // (d)
  std::vector<float> mean_v;  // (d)
  std::vector<float> a;       // (d, d) row-major: v_hat = mean_v + a (k - mean_k)
};

class ClusterBank {
 public:
  // Throws kvq::Error on n_head/d_head < 1 or out-of-range options.
  ClusterBank(int n_head, int d_head, const ClusterBankOptions& options = {});

  // chunk_k, chunk_v: F32/F16/BF16 of shape (T, n_head, d_head), T >= 1,
  // finite, |values| <= kMaxBankMagnitude. Throws kvq::Error (and leaves the
  // bank unchanged) otherwise.
  BirthMergeReceipt birth_and_merge(const TensorView& chunk_k, const TensorView& chunk_v);

  int n_head() const { return n_head_; }
  int d_head() const { return d_head_; }
  const ClusterBankOptions& options() const { return opts_; }
  int num_clusters() const { return static_cast<int>(clusters_.size()); }
  std::vector<int> cluster_ids() const;  // ascending
  int64_t cluster_count(int id) const;   // tokens in the cluster's moments
  const ClusterMoments& moments(int id, int head) const;
  ClusterHeadFit fit(int id, int head) const;
  // Far-field attention of n_q_heads query heads (a positive multiple of
  // n_head, grouped like decode_attention: query head h reads bank head
  // h / (n_q_heads / n_head)); q: n_q_heads * d_head finite floats; scale 0
  // means 1 / sqrt(d_head). An empty bank gives log_mass -inf, value 0.
  AttentionPart far_field(std::span<const float> q, int n_q_heads, float scale = 0.0f) const;
  int64_t total_births() const { return total_births_; }
  int64_t total_merges() const { return total_merges_; }
  // sigma_h^2 of the last chunk (per head; empty before the first).
  const std::vector<double>& key_scale() const { return key_scale_; }

 private:
  struct Cluster {
    std::vector<ClusterMoments> heads;  // n_head
    std::vector<ClusterHeadFit> fits;   // n_head, refreshed by Refit()
  };
  const Cluster& at(int id, const char* fn) const;
  void Refit(Cluster& c) const;

  int n_head_, d_head_;
  ClusterBankOptions opts_;
  std::map<int, Cluster> clusters_;
  int next_id_ = 0;
  int64_t total_births_ = 0, total_merges_ = 0;
  std::vector<double> key_scale_;
};

}  // namespace kvq
