// I2 part 2 — quantize_cluster_outliers (SPEC §5): E2's per-cluster outlier
// tokens stored as "quantized exact outliers + G4 parametric tails".
//
// For every cluster id of a birth_and_merge receipt:
//  - the outlier tokens' K and V go through quantize_kv_cache(mode), with
//    their flat chunk positions;
//  - the tail population, every chunk token not among that cluster's outlier
//    indices (the seed note's rule), or with `membership` (the receipt's
//    assignments) only the cluster's own non-outlier tokens, goes through
//    fit_sorted_profile(tail_family, top_k = tail_top_k) separately for K and
//    V, flattened in token order (token, head, dim).
// Empty parts are explicit (std::nullopt), never zero-size encodings.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "kvq/affine.h"
#include "kvq/cluster_bank.h"
#include "kvq/sorted_profile.h"
#include "kvq/tensor.h"

namespace kvq {

struct QuantizedClusterOutliers {
  int cluster_id = 0;
  int n_head = 0, d_head = 0;
  std::optional<AffineQuantized> outlier_k;  // (n_out, n_head, d_head)
  std::optional<AffineQuantized> outlier_v;
  std::vector<int64_t> outlier_indices;      // flat chunk positions (empty when no outliers)
  std::optional<SortedProfileEncoding> tail_k;  // n_tail * n_head * d_head values
  std::optional<SortedProfileEncoding> tail_v;
  int64_t tail_tokens = 0;

  // Exact size of serialize(*this) in bytes.
  size_t size_bytes() const;
};

struct DequantizedClusterOutliers {
  std::optional<Tensor> outlier_k, outlier_v;  // F32 (n_out, n_head, d_head)
  std::optional<Tensor> tail_k, tail_v;        // F32 (n_tail, n_head, d_head), token order
};

// per_cluster_outlier_tokens: cluster id -> {k, v (n_out, n_head, d_head),
// indices (n_out) in [0, T), distinct}. flat_k, flat_v: the chunk, F32/F16/
// BF16 (T, n_head, d_head). membership, when given: T cluster ids; every
// outlier index must belong to its own cluster. Throws kvq::Error naming the
// argument (and the cluster id) on any mismatch or non-finite value.
std::map<int, QuantizedClusterOutliers> quantize_cluster_outliers(
    const OutlierTokens& per_cluster_outlier_tokens, const TensorView& flat_k, const TensorView& flat_v,
    QuantMode mode = QuantMode::Int8, const Estimator& tail_family = GaussianEstimator(), int tail_top_k = 0,
    std::optional<std::span<const int>> membership = std::nullopt);

DequantizedClusterOutliers dequantize_cluster_outliers(const QuantizedClusterOutliers& q);

// Sum of size_bytes() over a result.
size_t total_size_bytes(const std::map<int, QuantizedClusterOutliers>& q);

// Versioned container (magic "KVQC", CRC32C payload, SPEC §9). Payload,
// little-endian:
//   i32 cluster_id, i32 n_head, i32 d_head, i64 tail_tokens, u8 flags
//   (bit 0 outliers, bit 1 tail_k, bit 2 tail_v);
//   outliers: u8 mode, f32 scale_k, f32 scale_v, u32 n_out,
//             u32 indices[n_out], codes_k[n_out * n_head * d_head],
//             codes_v[...] (int8, or E4M3 bytes);
//   each tail: u64 length, then serialize(SortedProfileEncoding).
std::vector<uint8_t> serialize(const QuantizedClusterOutliers& q);
// Throws kvq::Error on truncated, corrupted, wrong-version or inconsistent input.
QuantizedClusterOutliers deserialize_cluster_outliers(std::span<const uint8_t> bytes);

}  // namespace kvq
