// I2 part 2: quantize_cluster_outliers / dequantize_cluster_outliers.
#include "kvq/cluster_outliers.h"

#include <algorithm>
#include <limits>

namespace kvq {
namespace {

void CheckFloat(const TensorView& x, const char* arg) {
  KVQ_CHECK_ARG(x.dtype() == DType::F32 || x.dtype() == DType::F16 || x.dtype() == DType::BF16,
                "quantize_cluster_outliers: ", arg, ": expected dtype F32, F16 or BF16, got ", dtype_name(x.dtype()));
}

void CheckFinite(const Tensor& x, const char* arg, int id) {
  const int64_t bad = first_non_finite({x.data_as<float>(), static_cast<size_t>(x.numel())});
  if (bad < 0) return;
  if (id < 0) Fail("quantize_cluster_outliers: ", arg, ": expected finite values, element ", bad, " is non-finite");
  Fail("quantize_cluster_outliers: per_cluster_outlier_tokens[", id, "].", arg,
       ": expected finite values, element ", bad, " is non-finite");
}

}  // namespace

size_t QuantizedClusterOutliers::size_bytes() const {
  size_t s = outlier_indices.size() * sizeof(uint32_t);
  if (outlier_k) s += outlier_k->size_bytes();
  if (outlier_v) s += outlier_v->size_bytes();
  if (tail_k) s += tail_k->size_bytes();
  if (tail_v) s += tail_v->size_bytes();
  return s;
}

size_t total_size_bytes(const std::map<int, QuantizedClusterOutliers>& q) {
  size_t s = 0;
  for (const auto& [id, c] : q) s += c.size_bytes();
  return s;
}

std::map<int, QuantizedClusterOutliers> quantize_cluster_outliers(const OutlierTokens& per_cluster,
                                                                  const TensorView& flat_k, const TensorView& flat_v,
                                                                  QuantMode mode, const Estimator& tail_family,
                                                                  int tail_top_k,
                                                                  std::optional<std::span<const int>> membership) {
  CheckFloat(flat_k, "flat_k");
  CheckFloat(flat_v, "flat_v");
  KVQ_CHECK_ARG(flat_k.rank() == 3, "quantize_cluster_outliers: flat_k: expected shape (T, n_head, d_head), got ",
                shape_str(flat_k.shape()));
  KVQ_CHECK_ARG(flat_v.shape() == flat_k.shape(), "quantize_cluster_outliers: flat_v: expected shape ",
                shape_str(flat_k.shape()), " like flat_k, got ", shape_str(flat_v.shape()));
  KVQ_CHECK_ARG(tail_top_k >= 0, "quantize_cluster_outliers: tail_top_k: expected >= 0, got ", tail_top_k);
  KVQ_CHECK_ARG(mode == QuantMode::Int8 || mode == QuantMode::Fp8, "quantize_cluster_outliers: mode: expected int8 or fp8");
  const int64_t T = flat_k.dim(0);
  KVQ_CHECK_ARG(T <= static_cast<int64_t>(std::numeric_limits<uint32_t>::max()),
                "quantize_cluster_outliers: flat_k: expected at most 2^32-1 tokens, got ", T);
  const int n_head = static_cast<int>(flat_k.dim(1)), d_head = static_cast<int>(flat_k.dim(2));
  const int64_t W = static_cast<int64_t>(n_head) * d_head;
  if (membership) {
    KVQ_CHECK_ARG(static_cast<int64_t>(membership->size()) == T, "quantize_cluster_outliers: membership: expected ",
                  T, " cluster ids (one per token), got ", membership->size());
  }
  const Tensor kt = to_f32(flat_k), vt = to_f32(flat_v);
  CheckFinite(kt, "flat_k", -1);
  CheckFinite(vt, "flat_v", -1);

  // Validate every cluster before encoding any.
  for (const auto& [id, set] : per_cluster) {
    const Shape want{static_cast<int64_t>(set.indices.size()), n_head, d_head};
    for (const auto& [x, arg] : {std::pair{&set.k, "k"}, std::pair{&set.v, "v"}}) {
      KVQ_CHECK_ARG(x->dtype() == DType::F32 || x->dtype() == DType::F16 || x->dtype() == DType::BF16,
                    "quantize_cluster_outliers: per_cluster_outlier_tokens[", id, "].", arg,
                    ": expected dtype F32, F16 or BF16, got ", dtype_name(x->dtype()));
      KVQ_CHECK_ARG(x->shape() == want, "quantize_cluster_outliers: per_cluster_outlier_tokens[", id, "].", arg,
                    ": expected shape ", shape_str(want), " (one row per index), got ", shape_str(x->shape()));
    }
    std::vector<int64_t> sorted = set.indices;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) {
      KVQ_CHECK_ARG(sorted[i] >= 0 && sorted[i] < T, "quantize_cluster_outliers: per_cluster_outlier_tokens[", id,
                    "].indices: expected positions in [0, ", T, "), got ", sorted[i]);
      KVQ_CHECK_ARG(i == 0 || sorted[i] != sorted[i - 1], "quantize_cluster_outliers: per_cluster_outlier_tokens[",
                    id, "].indices: expected distinct positions, ", sorted[i], " repeats");
      if (membership) {
        KVQ_CHECK_ARG((*membership)[static_cast<size_t>(sorted[i])] == id,
                      "quantize_cluster_outliers: membership: outlier ", sorted[i], " of cluster ", id,
                      " is assigned to cluster ", (*membership)[static_cast<size_t>(sorted[i])]);
      }
    }
  }

  std::map<int, QuantizedClusterOutliers> out;
  SortedProfileOptions so;
  so.top_k = tail_top_k;
  std::vector<uint8_t> excluded(static_cast<size_t>(T));
  std::vector<float> tk, tv;
  for (const auto& [id, set] : per_cluster) {
    QuantizedClusterOutliers q;
    q.cluster_id = id;
    q.n_head = n_head;
    q.d_head = d_head;
    if (!set.indices.empty()) {
      const Tensor k32 = to_f32(set.k), v32 = to_f32(set.v);
      CheckFinite(k32, "k", id);
      CheckFinite(v32, "v", id);
      q.outlier_k = quantize_kv_cache(set.k, mode);
      q.outlier_v = quantize_kv_cache(set.v, mode);
      q.outlier_indices = set.indices;
    }
    std::fill(excluded.begin(), excluded.end(), 0);
    for (int64_t t : set.indices) excluded[static_cast<size_t>(t)] = 1;
    tk.clear();
    tv.clear();
    for (int64_t t = 0; t < T; ++t) {
      if (excluded[static_cast<size_t>(t)]) continue;
      if (membership && (*membership)[static_cast<size_t>(t)] != id) continue;
      tk.insert(tk.end(), kt.data_as<float>() + t * W, kt.data_as<float>() + (t + 1) * W);
      tv.insert(tv.end(), vt.data_as<float>() + t * W, vt.data_as<float>() + (t + 1) * W);
      ++q.tail_tokens;
    }
    if (q.tail_tokens > 0) {
      q.tail_k = fit_sorted_profile(std::span<const float>(tk), tail_family, so);
      q.tail_v = fit_sorted_profile(std::span<const float>(tv), tail_family, so);
    }
    out.emplace(id, std::move(q));
  }
  return out;
}

DequantizedClusterOutliers dequantize_cluster_outliers(const QuantizedClusterOutliers& q) {
  const int64_t W = static_cast<int64_t>(q.n_head) * q.d_head;
  KVQ_CHECK_ARG(q.n_head >= 1 && q.d_head >= 1, "dequantize_cluster_outliers: q: expected n_head, d_head >= 1, got ",
                q.n_head, ", ", q.d_head);
  DequantizedClusterOutliers d;
  if (q.outlier_k) d.outlier_k = dequantize_kv_cache(*q.outlier_k);
  if (q.outlier_v) d.outlier_v = dequantize_kv_cache(*q.outlier_v);
  auto tail = [&](const std::optional<SortedProfileEncoding>& e, const char* arg) -> std::optional<Tensor> {
    if (!e) return std::nullopt;
    KVQ_CHECK_ARG(e->n == q.tail_tokens * W, "dequantize_cluster_outliers: q.", arg, ": expected ",
                  q.tail_tokens * W, " values (", q.tail_tokens, " tokens), got ", e->n);
    Tensor t = Tensor::Uninitialized({q.tail_tokens, q.n_head, q.d_head}, DType::F32);
    decode_into(*e, {t.data_as<float>(), static_cast<size_t>(t.numel())});
    return t;
  };
  d.tail_k = tail(q.tail_k, "tail_k");
  d.tail_v = tail(q.tail_v, "tail_v");
  return d;
}

}  // namespace kvq
