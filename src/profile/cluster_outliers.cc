// I2 part 2: quantize_cluster_outliers / dequantize_cluster_outliers.
#include "kvq/cluster_outliers.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "src/io/container.h"

namespace kvq {
namespace {

void CheckFloat(const TensorView& x, const char* arg) {
  KVQ_CHECK_ARG(x.dtype() == DType::F32 || x.dtype() == DType::F16 || x.dtype() == DType::BF16,
                "quantize_cluster_outliers: ", arg, ": expected dtype F32, F16 or BF16, got ", dtype_name(x.dtype()));
}

// F32 data is checked in place; F16/BF16 through a float copy.
void CheckFinite(const TensorView& x, const char* arg, int id) {
  const Tensor copy = x.dtype() == DType::F32 ? Tensor() : to_f32(x);
  const float* p = x.dtype() == DType::F32 ? x.data_as<float>() : copy.data_as<float>();
  const int64_t bad = first_non_finite({p, static_cast<size_t>(x.numel())});
  if (bad < 0) return;
  if (id < 0) Fail("quantize_cluster_outliers: ", arg, ": expected finite values, element ", bad, " is non-finite");
  Fail("quantize_cluster_outliers: per_cluster_outlier_tokens[", id, "].", arg,
       ": expected finite values, element ", bad, " is non-finite");
}

// The largest code magnitude of a mode: int8 127, fp8 E4M3 448.
float MaxCode(QuantMode mode) { return mode == QuantMode::Int8 ? 127.0f : 448.0f; }

// The first code the quantizer never writes (int8 -128; fp8 NaN, S.1111.111),
// or -1.
int64_t FirstBadCode(std::span<const uint8_t> codes, QuantMode mode) {
  for (size_t i = 0; i < codes.size(); ++i) {
    if (mode == QuantMode::Int8 ? codes[i] == 0x80 : (codes[i] & 0x7F) == 0x7F) return static_cast<int64_t>(i);
  }
  return -1;
}

constexpr char kMagic[4] = {'K', 'V', 'Q', 'C'};
constexpr uint16_t kVersion = 1;
constexpr const char* kWhat = "cluster outliers";

}  // namespace

size_t QuantizedClusterOutliers::size_bytes() const {
  size_t s = detail::kContainerHeaderBytes + 4 + 4 + 4 + 8 + 1;
  if (outlier_k) s += 1 + 4 + 4 + 4 + outlier_indices.size() * sizeof(uint32_t) + outlier_k->codes.nbytes() +
                      (outlier_v ? outlier_v->codes.nbytes() : 0);
  if (tail_k) s += 8 + tail_k->size_bytes();
  if (tail_v) s += 8 + tail_v->size_bytes();
  return s;
}

std::vector<uint8_t> serialize(const QuantizedClusterOutliers& q) {
  const int64_t W = static_cast<int64_t>(q.n_head) * q.d_head;
  KVQ_CHECK_ARG(q.n_head >= 1 && q.d_head >= 1, "q: expected n_head, d_head >= 1, got ", q.n_head, ", ", q.d_head);
  KVQ_CHECK_ARG(q.outlier_k.has_value() == q.outlier_v.has_value(),
                "q.outlier_k, q.outlier_v: expected both or neither");
  const int64_t n_out = static_cast<int64_t>(q.outlier_indices.size());
  if (q.outlier_k) {
    const Shape want{n_out, q.n_head, q.d_head};
    KVQ_CHECK_ARG(q.outlier_k->shape() == want && q.outlier_v->shape() == want && q.outlier_k->mode == q.outlier_v->mode,
                  "q.outlier_k, q.outlier_v: expected shape ", shape_str(want), " and one mode");
    KVQ_CHECK_ARG(n_out > 0, "q.outlier_indices: expected at least one index with outlier codes");
  } else {
    KVQ_CHECK_ARG(n_out == 0, "q.outlier_indices: expected none without outlier codes");
  }
  for (const auto* t : {&q.tail_k, &q.tail_v}) {
    KVQ_CHECK_ARG(!*t || (*t)->n == q.tail_tokens * W, "q.tail_k / q.tail_v: expected ", q.tail_tokens * W,
                  " values (tail_tokens * n_head * d_head), got ", (*t)->n);
  }
  detail::ByteWriter w;
  w.put<int32_t>(q.cluster_id);
  w.put<int32_t>(q.n_head);
  w.put<int32_t>(q.d_head);
  w.put<int64_t>(q.tail_tokens);
  w.put<uint8_t>(static_cast<uint8_t>((q.outlier_k ? 1 : 0) | (q.tail_k ? 2 : 0) | (q.tail_v ? 4 : 0)));
  if (q.outlier_k) {
    w.put<uint8_t>(static_cast<uint8_t>(q.outlier_k->mode));
    w.put<float>(q.outlier_k->scale);
    w.put<float>(q.outlier_v->scale);
    w.put<uint32_t>(static_cast<uint32_t>(n_out));
    for (int64_t i : q.outlier_indices) {
      KVQ_CHECK_ARG(i >= 0 && i <= std::numeric_limits<uint32_t>::max(), "q.outlier_indices: ", i,
                    " does not fit u32");
      w.put<uint32_t>(static_cast<uint32_t>(i));
    }
    for (const auto* a : {&*q.outlier_k, &*q.outlier_v}) {
      w.put_array(std::span<const uint8_t>(static_cast<const uint8_t*>(a->codes.data()), a->codes.nbytes()));
    }
  }
  for (const auto* t : {&q.tail_k, &q.tail_v}) {
    if (!*t) continue;
    const std::vector<uint8_t> b = serialize(**t);
    w.put<uint64_t>(b.size());
    w.put_array(std::span<const uint8_t>(b));
  }
  return detail::WrapContainer(kMagic, kVersion, w.bytes());
}

QuantizedClusterOutliers deserialize_cluster_outliers(std::span<const uint8_t> bytes) {
  detail::ByteReader r(detail::OpenContainer(bytes, kMagic, kVersion, kWhat), kWhat);
  QuantizedClusterOutliers q;
  q.cluster_id = r.get<int32_t>();
  q.n_head = r.get<int32_t>();
  q.d_head = r.get<int32_t>();
  q.tail_tokens = r.get<int64_t>();
  const uint8_t flags = r.get<uint8_t>();
  if (q.n_head < 1 || q.d_head < 1) r.corrupt(detail::Concat("n_head ", q.n_head, ", d_head ", q.d_head));
  // Both factors are < 2^31, so W fits; every count below is bounded by
  // kMaxProfileValues before it is multiplied.
  const int64_t W = static_cast<int64_t>(q.n_head) * q.d_head;
  if (W > kMaxProfileValues) r.corrupt(detail::Concat("n_head * d_head = ", W, " above ", kMaxProfileValues));
  if (q.tail_tokens < 0 || q.tail_tokens > kMaxProfileValues / W) {
    r.corrupt(detail::Concat("tail_tokens ", q.tail_tokens, " outside 0..", kMaxProfileValues / W,
                             " (kMaxProfileValues / (n_head * d_head))"));
  }
  if (flags > 7) r.corrupt(detail::Concat("flags ", int{flags}));
  if (flags & 1) {
    const uint8_t mode = r.get<uint8_t>();
    if (mode > 1) r.corrupt(detail::Concat("mode ", int{mode}));
    const float sk = r.get<float>(), sv = r.get<float>();
    const uint32_t n_out = r.get<uint32_t>();
    if (n_out == 0) r.corrupt("outlier flag with no outliers");
    if (static_cast<int64_t>(n_out) > kMaxProfileValues / W) {
      r.corrupt(detail::Concat(n_out, " outlier tokens of ", W, " values, above ", kMaxProfileValues));
    }
    const auto idx = r.get_array<uint32_t>(n_out);
    for (size_t i = 0; i < idx.size(); ++i) {
      if (i > 0 && idx[i] <= idx[i - 1]) r.corrupt("outlier indices are not ascending and unique");
    }
    q.outlier_indices.assign(idx.begin(), idx.end());
    // Each code array needs n_out * W bytes; get_array checks before allocating.
    const uint64_t count = static_cast<uint64_t>(n_out) * static_cast<uint64_t>(W);
    const Shape shape{static_cast<int64_t>(n_out), q.n_head, q.d_head};
    for (auto [part, scale] : {std::pair{&q.outlier_k, sk}, std::pair{&q.outlier_v, sv}}) {
      if (!std::isfinite(scale) || scale < 0 || !std::isfinite(scale * MaxCode(static_cast<QuantMode>(mode)))) {
        r.corrupt(detail::Concat("outlier scale ", scale));
      }
      const auto codes = r.get_array<uint8_t>(count);
      if (const int64_t bad = FirstBadCode(codes, static_cast<QuantMode>(mode)); bad >= 0) {
        r.corrupt(detail::Concat("outlier code ", int{codes[static_cast<size_t>(bad)]}, " at ", bad,
                                 static_cast<QuantMode>(mode) == QuantMode::Int8 ? " (int8 -128)" : " (fp8 NaN)"));
      }
      AffineQuantized a;
      a.mode = static_cast<QuantMode>(mode);
      a.scale = scale;
      a.codes = Tensor(shape, a.mode == QuantMode::Int8 ? DType::I8 : DType::F8_E4M3);
      std::memcpy(a.codes.data(), codes.data(), codes.size());
      *part = std::move(a);
    }
  }
  for (auto [tail, bit] : {std::pair{&q.tail_k, 2}, std::pair{&q.tail_v, 4}}) {
    if (!(flags & bit)) continue;
    const uint64_t len = r.get<uint64_t>();
    const auto b = r.get_array<uint8_t>(len);
    *tail = deserialize_sorted_profile(b);
    if ((*tail)->n != q.tail_tokens * W) r.corrupt(detail::Concat("tail of ", (*tail)->n, " values for ", q.tail_tokens, " tokens"));
  }
  if (!(flags & 6) && q.tail_tokens != 0) r.corrupt("tail_tokens without tails");
  r.expect_end();
  return q;
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
    CheckFinite(set.k, "k", id);
    CheckFinite(set.v, "v", id);
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
  KVQ_CHECK_ARG(q.n_head >= 1 && q.d_head >= 1, "dequantize_cluster_outliers: q: expected n_head, d_head >= 1, got ",
                q.n_head, ", ", q.d_head);
  const int64_t W = static_cast<int64_t>(q.n_head) * q.d_head;
  KVQ_CHECK_ARG(W <= kMaxProfileValues && q.tail_tokens >= 0 && q.tail_tokens <= kMaxProfileValues / W,
                "dequantize_cluster_outliers: q.tail_tokens: expected 0..", kMaxProfileValues / W,
                " (kMaxProfileValues / (n_head * d_head)), got ", q.tail_tokens);
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
