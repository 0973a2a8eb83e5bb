// The seed's cluster outlier quantizer (kvq/cluster_outliers.h): round
// trips, serialisation and hostile bytes, on planted clusters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include "kvq/affine.h"
#include "kvq/cluster_bank.h"
#include "kvq/cluster_outliers.h"
#include "tests/planted_clusters.h"
#include "tests/test_util.h"

namespace kvq {
namespace {
using test::ErrorOf;
using test::Planted;
using test::PlantedOptions;
using test::Rng;

// The tokens of cluster `id` (or all, without membership) less the excluded ones: K or V.
std::vector<float> Population(const Planted& p, const std::vector<int64_t>& excluded, const std::vector<int>* membership,
                              int id, bool value) {
  std::vector<float> out;
  const int64_t W = int64_t{p.H} * p.D;
  for (int64_t t = 0; t < p.T; ++t) {
    if (std::count(excluded.begin(), excluded.end(), t)) continue;
    if (membership && (*membership)[t] != id) continue;
    const auto& x = value ? p.v : p.k;
    out.insert(out.end(), x.begin() + t * W, x.begin() + (t + 1) * W);
  }
  return out;
}

TEST(ClusterOutliers, RoundTripFollowsTheSeedNote) {
  const Planted p(3, 2, 8, 3000, 11);
  ClusterBank bank(p.H, p.D, PlantedOptions());
  const auto r = bank.birth_and_merge(p.kv(0, p.T, false), p.kv(0, p.T, true));
  for (bool use_membership : {false, true}) {
    SCOPED_TRACE(use_membership ? "membership" : "seed rule");
    const auto q = use_membership ? quantize_cluster_outliers(r.per_cluster_outlier_tokens, p.kv(0, p.T, false),
                                                              p.kv(0, p.T, true), QuantMode::Int8, GaussianEstimator(),
                                                              0, std::span<const int>(r.assignments))
                                  : quantize_cluster_outliers(r.per_cluster_outlier_tokens, p.kv(0, p.T, false),
                                                              p.kv(0, p.T, true));
    ASSERT_EQ(q.size(), r.per_cluster_outlier_tokens.size());
    int64_t tails = 0;
    for (const auto& [id, c] : q) {
      const auto& set = r.per_cluster_outlier_tokens.at(id);
      EXPECT_EQ(c.cluster_id, id);
      EXPECT_EQ(c.outlier_indices, set.indices);
      const auto d = dequantize_cluster_outliers(c);
      ASSERT_TRUE(d.outlier_k && d.outlier_v && d.tail_k && d.tail_v);
      // Outliers: within the int8 bound of their own per-tensor scale.
      for (const auto& [x, y, qa] : {std::tuple{&set.k, &*d.outlier_k, &*c.outlier_k},
                                     std::tuple{&set.v, &*d.outlier_v, &*c.outlier_v}}) {
        ASSERT_EQ(y->shape(), x->shape());
        for (int64_t i = 0; i < x->numel(); ++i)
          EXPECT_LE(std::abs(x->data_as<float>()[i] - y->data_as<float>()[i]), qa->scale / 2 * (1 + 1e-6f));
      }
      // Tails: the population in chunk order, decoded as G4 decodes it.
      const auto pk = Population(p, set.indices, use_membership ? &r.assignments : nullptr, id, false);
      const auto pv = Population(p, set.indices, use_membership ? &r.assignments : nullptr, id, true);
      EXPECT_EQ(c.tail_tokens * p.H * p.D, static_cast<int64_t>(pk.size()));
      EXPECT_EQ(d.tail_k->shape(), (Shape{c.tail_tokens, p.H, p.D}));
      const auto gk = decode(fit_sorted_profile(std::span<const float>(pk), GaussianEstimator()));
      const auto gv = decode(fit_sorted_profile(std::span<const float>(pv), GaussianEstimator()));
      EXPECT_TRUE(std::equal(gk.begin(), gk.end(), d.tail_k->data_as<float>()));
      EXPECT_TRUE(std::equal(gv.begin(), gv.end(), d.tail_v->data_as<float>()));
      tails += c.tail_tokens;
      EXPECT_EQ(c.size_bytes(), serialize(c).size());
    }
    int64_t n_out = 0;
    for (const auto& [id, set] : r.per_cluster_outlier_tokens) n_out += static_cast<int64_t>(set.indices.size());
    // With membership the tails partition the non-outliers; the seed rule
    // gives each cluster the whole chunk minus its own outliers.
    if (use_membership) {
      EXPECT_EQ(tails, p.T - n_out);
    } else {
      EXPECT_EQ(tails, static_cast<int64_t>(q.size()) * p.T - n_out);
    }
  }
}

TEST(ClusterOutliers, Fp8ModeEmptyPartsAndTailTopK) {
  const Planted p(1, 1, 8, 64, 2, 0.0f);
  OutlierTokens o;
  o[3] = OutlierTokenSet{Tensor({0, 1, 8}, DType::F32), Tensor({0, 1, 8}, DType::F32), {}};
  OutlierTokenSet s{Tensor({2, 1, 8}, DType::F32), Tensor({2, 1, 8}, DType::F32), {5, 9}};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 8; ++j) {
      s.k.data_as<float>()[i * 8 + j] = p.k[s.indices[i] * 8 + j];
      s.v.data_as<float>()[i * 8 + j] = p.v[s.indices[i] * 8 + j];
    }
  o[7] = std::move(s);
  std::vector<int> membership(64, 3);
  membership[5] = membership[9] = 7;  // cluster 7 = its two outliers only
  const auto q = quantize_cluster_outliers(o, p.kv(0, 64, false), p.kv(0, 64, true), QuantMode::Fp8,
                                           LaplaceEstimator(), 5, std::span<const int>(membership));
  const auto& c3 = q.at(3);
  EXPECT_FALSE(c3.outlier_k || c3.outlier_v);
  EXPECT_TRUE(c3.outlier_indices.empty());
  ASSERT_TRUE(c3.tail_k);
  EXPECT_EQ(c3.tail_tokens, 62);
  EXPECT_EQ(c3.tail_k->family, "laplace");
  EXPECT_EQ(c3.tail_k->head_indices.size(), 5u);
  const auto& c7 = q.at(7);
  ASSERT_TRUE(c7.outlier_k);
  EXPECT_EQ(c7.outlier_k->codes.dtype(), DType::F8_E4M3);
  EXPECT_FALSE(c7.tail_k || c7.tail_v);
  EXPECT_EQ(c7.tail_tokens, 0);
  const auto d3 = dequantize_cluster_outliers(c3);
  EXPECT_FALSE(d3.outlier_k || d3.outlier_v);
  const auto d7 = dequantize_cluster_outliers(c7);
  EXPECT_FALSE(d7.tail_k || d7.tail_v);
  EXPECT_EQ(total_size_bytes(q), c3.size_bytes() + c7.size_bytes());
}

void ExpectSameDecode(const QuantizedClusterOutliers& a, const QuantizedClusterOutliers& b) {
  EXPECT_EQ(a.cluster_id, b.cluster_id);
  EXPECT_EQ(a.n_head, b.n_head);
  EXPECT_EQ(a.d_head, b.d_head);
  EXPECT_EQ(a.tail_tokens, b.tail_tokens);
  EXPECT_EQ(a.outlier_indices, b.outlier_indices);
  const auto da = dequantize_cluster_outliers(a), db = dequantize_cluster_outliers(b);
  for (const auto& [x, y] : {std::pair{&da.outlier_k, &db.outlier_k}, std::pair{&da.outlier_v, &db.outlier_v},
                             std::pair{&da.tail_k, &db.tail_k}, std::pair{&da.tail_v, &db.tail_v}}) {
    ASSERT_EQ(x->has_value(), y->has_value());
    if (!*x) continue;
    ASSERT_EQ((*x)->shape(), (*y)->shape());
    EXPECT_EQ(0, std::memcmp((*x)->data(), (*y)->data(), (*x)->nbytes()));
  }
}

// The persistence tests' chunk, clustered and quantized in `mode` with membership.
std::map<int, QuantizedClusterOutliers> PlantedQuantized(const Planted& p, QuantMode mode) {
  ClusterBank bank(p.H, p.D, PlantedOptions());
  const auto r = bank.birth_and_merge(p.kv(0, p.T, false), p.kv(0, p.T, true));
  return quantize_cluster_outliers(r.per_cluster_outlier_tokens, p.kv(0, p.T, false), p.kv(0, p.T, true), mode,
                                   GaussianEstimator(), 0, std::span<const int>(r.assignments));
}

TEST(ClusterOutliers, SerialisesAndRejectsTruncatedOrCorruptedBytes) {
  const Planted p(2, 2, 8, 400, 31);
  for (QuantMode mode : {QuantMode::Int8, QuantMode::Fp8}) {
    const auto q = PlantedQuantized(p, mode);
    for (const auto& [id, c] : q) {
      const std::vector<uint8_t> b = serialize(c);
      EXPECT_EQ(b.size(), c.size_bytes());
      ExpectSameDecode(deserialize_cluster_outliers(b), c);
      for (size_t n = 0; n < b.size(); ++n) {
        EXPECT_THROW(deserialize_cluster_outliers({b.data(), n}), Error) << "truncated to " << n;
      }
      for (size_t i = 0; i < b.size(); i += 7) {
        std::vector<uint8_t> bad = b;
        bad[i] ^= 0x20;
        EXPECT_THROW(deserialize_cluster_outliers(bad), Error) << "byte " << i;
      }
      std::vector<uint8_t> v2 = b;
      v2[4] = 2;
      EXPECT_NE(ErrorOf([&] { deserialize_cluster_outliers(v2); }).find("unsupported format version 2"),
                std::string::npos);
    }
  }
  // Empty parts round-trip too.
  QuantizedClusterOutliers empty;
  empty.cluster_id = 7;
  empty.n_head = 2;
  empty.d_head = 8;
  ExpectSameDecode(deserialize_cluster_outliers(serialize(empty)), empty);
  EXPECT_EQ(serialize(empty).size(), empty.size_bytes());
  QuantizedClusterOutliers broken = std::move(empty);
  broken.tail_tokens = 3;
  broken.tail_k = fit_sorted_profile(std::span<const float>(p.k.data(), 16), GaussianEstimator());
  EXPECT_NE(ErrorOf([&] { serialize(broken); }).find("expected 48 values"), std::string::npos);
}

// Crafted KVQC containers (issue 19: tail_tokens near 2^63 segfaulted
// dequantize_cluster_outliers).
TEST(ClusterOutliers, CraftedCountsScalesAndCodesAreRejected) {
  const Planted p(2, 2, 8, 400, 31);
  for (QuantMode mode : {QuantMode::Int8, QuantMode::Fp8}) {
    const auto q = PlantedQuantized(p, mode);
    const QuantizedClusterOutliers& c = q.begin()->second;
    ASSERT_TRUE(c.outlier_k.has_value());
    const std::vector<uint8_t> b = serialize(c);
    const size_t h = detail::kContainerHeaderBytes;
    for (int64_t tail : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() / 16 + 1,
                         kMaxProfileValues, c.tail_tokens + 1}) {
      const std::string err = ErrorOf([&] { dequantize_cluster_outliers(deserialize_cluster_outliers(test::EditedContainer(b, h + 12, &tail, 8))); });
      EXPECT_NE(err, "<no error>") << tail;
    }
    const int32_t huge_head = 1 << 30;
    EXPECT_NE(ErrorOf([&] { deserialize_cluster_outliers(test::EditedContainer(b, h + 4, &huge_head, 4)); }), "<no error>");
    const float big_scale = 3e38f;  // 127 or 448 times it is inf
    EXPECT_NE(ErrorOf([&] { deserialize_cluster_outliers(test::EditedContainer(b, h + 21 + 1, &big_scale, 4)); })
                  .find("outlier scale"),
              std::string::npos);
    const size_t codes_at = h + 21 + 1 + 4 + 4 + 4 + 4 * c.outlier_indices.size();
    const uint8_t bad_code = mode == QuantMode::Int8 ? 0x80 : 0x7F;
    EXPECT_NE(ErrorOf([&] { deserialize_cluster_outliers(test::EditedContainer(b, codes_at + 3, &bad_code, 1)); })
                  .find("outlier code"),
              std::string::npos);
    // Hand-built: the same bound.
    QuantizedClusterOutliers hand = deserialize_cluster_outliers(b);
    hand.tail_tokens = std::numeric_limits<int64_t>::max() / 3;
    EXPECT_NE(ErrorOf([&] { dequantize_cluster_outliers(hand); }).find("tail_tokens"), std::string::npos);
  }
  // dequantize_kv_cache: a scale whose product with the largest code
  // overflows is an error; fp8 NaN codes decode to NaN (E4M3FN's NaN).
  AffineQuantized a = quantize_kv_cache(p.kv(0, 4, false), QuantMode::Int8);
  a.scale = 3e38f;
  EXPECT_NE(ErrorOf([&] { dequantize_kv_cache(a); }).find("q.scale"), std::string::npos);
  AffineQuantized f = quantize_kv_cache(p.kv(0, 4, false), QuantMode::Fp8);
  f.codes.data_as<uint8_t>()[5] = 0xFF;
  EXPECT_TRUE(std::isnan(dequantize_kv_cache(f).data_as<float>()[5]));
  // birth_and_merge bounds magnitudes so residuals stay finite.
  std::vector<float> huge(p.k.begin(), p.k.begin() + 10 * 16);
  for (auto& x : huge) x *= 1e30f;
  ClusterBank b2(p.H, p.D);
  EXPECT_NE(ErrorOf([&] { b2.birth_and_merge(TensorView(huge.data(), {10, 2, 8}, DType::F32),
                                            p.kv(0, 10, true)); }).find("|values| <="),
            std::string::npos);
  EXPECT_EQ(b2.num_clusters(), 0);
}

TEST(ClusterOutliers, BadInputIsAClearError) {
  const Planted p(1, 2, 4, 20, 2, 0.0f);
  const TensorView k = p.kv(0, 20, false), v = p.kv(0, 20, true);
  auto set = [](Shape shape, std::vector<int64_t> idx) {
    return OutlierTokenSet{Tensor(shape, DType::F32), Tensor(shape, DType::F32), std::move(idx)};
  };
  auto err = [&](OutlierTokens o, std::optional<std::span<const int>> m = std::nullopt, int top_k = 0) {
    return ErrorOf([&] { quantize_cluster_outliers(o, k, v, QuantMode::Int8, GaussianEstimator(), top_k, m); });
  };
  OutlierTokens o;
  o[1] = set({2, 2, 4}, {0, 1});
  EXPECT_EQ(err(std::move(o)), "<no error>");
  o.clear();
  o[1] = set({2, 4, 2}, {0, 1});
  EXPECT_NE(err(std::move(o)).find("per_cluster_outlier_tokens[1].k: expected shape (2, 2, 4)"), std::string::npos);
  o.clear();
  o[1] = set({2, 2, 4}, {0, 20});
  EXPECT_NE(err(std::move(o)).find("[1].indices: expected positions in [0, 20), got 20"), std::string::npos);
  o.clear();
  o[2] = set({2, 2, 4}, {3, 3});
  EXPECT_NE(err(std::move(o)).find("[2].indices: expected distinct positions"), std::string::npos);
  o.clear();
  o[2] = set({1, 2, 4}, {3});
  o[2].v.data_as<float>()[5] = NAN;
  EXPECT_NE(err(std::move(o)).find("[2].v: expected finite values, element 5"), std::string::npos);
  o.clear();
  o[2] = set({1, 2, 4}, {3});
  std::vector<int> m(19, 2);
  EXPECT_NE(err(std::move(o), std::span<const int>(m)).find("membership: expected 20 cluster ids"), std::string::npos);
  o.clear();
  o[2] = set({1, 2, 4}, {3});
  m.assign(20, 1);
  EXPECT_NE(err(std::move(o), std::span<const int>(m)).find("membership: outlier 3 of cluster 2 is assigned to cluster 1"),
            std::string::npos);
  EXPECT_NE(err({}, std::nullopt, -1).find("tail_top_k: expected >= 0"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { quantize_cluster_outliers({}, k, p.kv(0, 10, true)); }).find("flat_v: expected shape (20, 2, 4)"),
            std::string::npos);
  std::vector<float> bad(p.k.begin(), p.k.end());
  bad[9] = -INFINITY;
  EXPECT_NE(ErrorOf([&] { quantize_cluster_outliers({}, TensorView(bad.data(), {20, 2, 4}, DType::F32), v); })
                .find("flat_k: expected finite values, element 9"),
            std::string::npos);
  QuantizedClusterOutliers broken;
  EXPECT_NE(ErrorOf([&] { dequantize_cluster_outliers(broken); }).find("expected n_head, d_head >= 1"),
            std::string::npos);
}

}  // namespace
}  // namespace kvq
