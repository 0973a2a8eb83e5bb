// E2 — ClusterBank and birth_and_merge (SPEC §4, without far-field attention).
//
// A bank summarises one layer's tokens. A token is its key and value, each of
// shape (n_head, d_head). Per chunk:
//  1. Assignment (online DP-means): tokens are visited in chunk order; each
//     goes to the cluster whose mean key is nearest in squared Euclidean
//     distance, normalised by the chunk's mean key variance,
//       dist(k, c) = ||k - mu_c||^2 / (n_head * d_head * var_chunk),
//     so a token drawn from one Gaussian blob lies about 1 from its mean and
//     about 2 from another token of the same blob. A chunk with no key
//     variance (one token, or identical keys) uses the last chunk's that had
//     some, or 1 for a fresh bank. A token farther than
//     birth_distance from every cluster, while fewer than max_clusters
//     exist, births a new cluster. Cluster means move as tokens join.
//  2. The chunk's tokens are added to their clusters' moments.
//  3. Merges: repeatedly, the closest pair of clusters whose means lie within
//     merge_distance (same normalisation) is merged; merges are exact moment
//     sums. The surviving id is the older (smaller) one.
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
//
// Far-field attention (moment closure): for a query q (scale s), a cluster of
// n tokens with key mean mu and covariance Sigma = S_kk / n contributes
// log-mass log n + s q.mu + 1/2 s^2 q'Sigma q and value mu_v + s A Sigma q
// (the mean of its affine V map under the exponentially tilted Gaussian);
// clusters combine by log-sum-exp. It is exact for a cluster of identical
// keys, and for Gaussian keys in expectation.
//
// Moments are kept as sums in double (count, sum k, sum k k^T, sum v,
// sum v k^T per head), so an update or a merge equals the moments of the
// union up to double rounding. State persists across chunks.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "kvq/attention.h"
#include "kvq/tensor.h"

namespace kvq {

struct ClusterBankOptions {
  // Clusters alive at once (>= 1); never exceeded.
  int max_clusters = 16;
  // Normalised distance beyond which a token births a cluster (> 0).
  double birth_distance = 2.0;
  // Clusters whose means lie within this normalised distance merge (>= 0;
  // 0 disables distance merges).
  double merge_distance = 0.25;
  // Outlier tokens flagged per cluster and chunk (>= 0).
  int outlier_top_k = 4;
  // Added to the key scatter's diagonal before inversion (> 0). The scatter
  // is a sum over tokens, so the ridge's pull fades as a cluster grows; it
  // makes a cluster of one token predict its own mean value (A = 0).
  double ridge = 1e-2;
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
  // finite. Throws kvq::Error (and leaves the bank unchanged) otherwise.
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
  // The normaliser var_chunk of the last chunk (0 before the first).
  double key_variance() const { return key_variance_; }

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
  double key_variance_ = 0.0;
};

}  // namespace kvq
