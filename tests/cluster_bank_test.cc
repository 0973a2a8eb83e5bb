// E2 ClusterBank: planted clusters found, moments merged exactly, the far field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "kvq/affine.h"
#include "kvq/cluster_bank.h"
#include "kvq/stats.h"
#include "tests/planted_clusters.h"
#include "tests/test_util.h"

namespace kvq {
namespace {
using test::ErrorOf;
using test::Rng;
using test::Planted;
using test::PlantedOptions;

// Clusters found versus planted labels: how many, and whether the
// clustering is the planted labelling up to a renaming.
struct Recovery {
  size_t clusters = 0;
  bool exact = false;
  double purity = 0;  // share of tokens in their cluster's majority label
};
Recovery Recover(const std::vector<int>& assignments, const std::vector<int>& label) {
  std::map<int, std::map<int, int64_t>> by_cluster;
  for (size_t t = 0; t < assignments.size(); ++t) ++by_cluster[assignments[t]][label[t]];
  std::set<int> labels(label.begin(), label.end());
  Recovery r;
  r.clusters = by_cluster.size();
  int64_t majority = 0;
  std::set<int> majority_labels;
  bool pure = true;
  for (const auto& [id, counts] : by_cluster) {
    int64_t best = 0;
    int best_label = -1;
    for (auto [l, n] : counts)
      if (n > best) best = n, best_label = l;
    majority += best;
    majority_labels.insert(best_label);
    pure = pure && counts.size() == 1;
  }
  r.purity = static_cast<double>(majority) / static_cast<double>(assignments.size());
  r.exact = pure && r.clusters == labels.size() && majority_labels.size() == labels.size();
  return r;
}

// Moments computed directly from a set of token positions.
std::vector<ClusterMoments> DirectMoments(const Planted& p, const std::vector<int64_t>& tokens) {
  std::vector<ClusterMoments> m(p.H, ClusterMoments(p.D));
  const int64_t W = int64_t{p.H} * p.D;
  for (int64_t t : tokens)
    for (int h = 0; h < p.H; ++h) m[h].add(&p.k[t * W + h * p.D], &p.v[t * W + h * p.D]);
  return m;
}

void ExpectMomentsNear(const ClusterMoments& got, const ClusterMoments& want, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_NEAR(got.count, want.count, 1e-9);
  auto near = [](const std::vector<double>& a, const std::vector<double>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-9 * (1.0 + std::abs(b[i]))) << i;
  };
  near(got.sum_k, want.sum_k);
  near(got.sum_kk, want.sum_kk);
  near(got.sum_v, want.sum_v);
  near(got.sum_vk, want.sum_vk);
}

TEST(ClusterBank, FindsPlantedClustersRecoversTheAffineMapsAndFlagsAnomalies) {
  const Planted p(3, 2, 8, 3000, 11);
  ClusterBank bank(p.H, p.D, PlantedOptions());
  const BirthMergeReceipt r = bank.birth_and_merge(p.kv(0, p.T, false), p.kv(0, p.T, true));
  // Tail tokens may birth clusters that the merge rule folds back.
  EXPECT_GE(r.births, 3);
  EXPECT_EQ(r.births - r.merges, 3);
  ASSERT_EQ(bank.num_clusters(), 3);
  ASSERT_EQ(r.assignments.size(), static_cast<size_t>(p.T));
  ASSERT_EQ(r.per_token_residual.size(), static_cast<size_t>(p.T));
  // The clustering is the planted labelling up to a renaming.
  std::map<int, int> label_to_id;
  for (int64_t t = 0; t < p.T; ++t) {
    auto [it, fresh] = label_to_id.emplace(p.label[t], r.assignments[t]);
    ASSERT_EQ(it->second, r.assignments[t]) << "token " << t << " split from its planted cluster";
  }
  ASSERT_EQ(label_to_id.size(), 3u);
  std::set<int> ids;
  for (auto [l, id] : label_to_id) ids.insert(id);
  ASSERT_EQ(ids.size(), 3u) << "two planted clusters share an id";

  // Every planted anomaly is flagged in its own cluster, and its residual
  // dwarfs the others (6 per element over 16 elements = 576).
  std::set<int64_t> flagged;
  for (const auto& [id, set] : r.per_cluster_outlier_tokens) {
    EXPECT_LE(set.indices.size(), 2u);
    ASSERT_EQ(set.k.shape(), (Shape{static_cast<int64_t>(set.indices.size()), p.H, p.D}));
    for (size_t i = 0; i < set.indices.size(); ++i) {
      const int64_t t = set.indices[i];
      EXPECT_EQ(r.assignments[t], id);
      flagged.insert(t);
      for (int64_t j = 0; j < p.H * p.D; ++j) {
        EXPECT_EQ(set.k.data_as<float>()[i * p.H * p.D + j], p.k[t * p.H * p.D + j]);
        EXPECT_EQ(set.v.data_as<float>()[i * p.H * p.D + j], p.v[t * p.H * p.D + j]);
      }
    }
  }
  for (int64_t t : p.anomalies) {
    EXPECT_TRUE(flagged.count(t)) << "planted anomaly " << t << " not flagged";
    EXPECT_GT(r.per_token_residual[t], 400.0f);
  }
  // With the anomalies removed each A is recovered: noise 0.01 over ~1000
  // tokens leaves errors ~1e-3.
  for (auto [l, id] : label_to_id) {
    for (int h = 0; h < p.H; ++h) {
      const ClusterHeadFit f = bank.fit(id, h);
      const auto& want = p.a[l * p.H + h];
      double worst = 0;
      for (int i = 0; i < p.D * p.D; ++i) worst = std::max(worst, std::abs(double(f.a[i]) - want[i]));
      EXPECT_LT(worst, 0.01) << "cluster " << id << " head " << h;
      for (int j = 0; j < p.D; ++j) EXPECT_NEAR(f.mean_k[j], p.mu_k[l * p.H + h][j], 0.15);
    }
    ASSERT_TRUE(r.per_cluster_misfit.count(id));
    // Non-outlier residual: noise only, 16 elements * 1e-4.
    EXPECT_LT(r.per_cluster_misfit.at(id), 3e-3);
  }
  // Moments: each cluster holds exactly its non-outlier tokens.
  for (auto [l, id] : label_to_id) {
    std::vector<int64_t> tokens;
    for (int64_t t = 0; t < p.T; ++t)
      if (r.assignments[t] == id && !flagged.count(t)) tokens.push_back(t);
    EXPECT_EQ(bank.cluster_count(id), static_cast<int64_t>(tokens.size()));
    const auto want = DirectMoments(p, tokens);
    for (int h = 0; h < p.H; ++h) ExpectMomentsNear(bank.moments(id, h), want[h], "cluster moments");
  }
}

TEST(ClusterBank, MergedMomentsEqualTheMomentsOfTheUnion) {
  // One blob, a tiny birth distance (many births) and a huge merge distance:
  // everything merges back into the oldest cluster.
  const Planted p(1, 2, 4, 400, 5, 0.0f);
  ClusterBankOptions o;
  o.max_clusters = 10;
  o.birth_distance = 0.3;
  o.merge_distance = 50.0;
  o.outlier_top_k = 3;
  ClusterBank bank(p.H, p.D, o);
  const BirthMergeReceipt r = bank.birth_and_merge(p.kv(0, p.T, false), p.kv(0, p.T, true));
  EXPECT_GT(r.births, 1);
  EXPECT_EQ(r.merges, r.births - 1);
  ASSERT_EQ(r.merged.size(), static_cast<size_t>(r.merges));
  for (auto [keep, gone] : r.merged) EXPECT_LT(keep, gone);
  ASSERT_EQ(bank.cluster_ids(), std::vector<int>{0});
  for (int a : r.assignments) EXPECT_EQ(a, 0);
  const auto& out = r.per_cluster_outlier_tokens.at(0);
  EXPECT_EQ(out.indices.size(), 3u);
  std::vector<int64_t> kept;
  for (int64_t t = 0; t < p.T; ++t)
    if (!std::count(out.indices.begin(), out.indices.end(), t)) kept.push_back(t);
  const auto want = DirectMoments(p, kept);
  for (int h = 0; h < p.H; ++h) ExpectMomentsNear(bank.moments(0, h), want[h], "merged");

  // ClusterMoments::merge of two halves equals the moments of the whole.
  std::vector<int64_t> first(kept.begin(), kept.begin() + 100), second(kept.begin() + 100, kept.end());
  auto m1 = DirectMoments(p, first);
  const auto m2 = DirectMoments(p, second);
  m1[1].merge(m2[1]);
  ExpectMomentsNear(m1[1], want[1], "ClusterMoments::merge");
}

TEST(ClusterBank, StatePersistsAcrossChunks) {
  const Planted p(3, 2, 8, 3000, 21);
  ClusterBank bank(p.H, p.D, PlantedOptions());
  const auto r1 = bank.birth_and_merge(p.kv(0, 1500, false), p.kv(0, 1500, true));
  const auto r2 = bank.birth_and_merge(p.kv(1500, 3000, false), p.kv(1500, 3000, true));
  EXPECT_EQ(r1.births - r1.merges, 3);
  const std::vector<int> ids = bank.cluster_ids();
  EXPECT_EQ(r2.births, r2.merges) << "the second chunk must reuse the clusters of the first";
  for (auto [keep, gone] : r2.merged) EXPECT_TRUE(std::count(r2.born.begin(), r2.born.end(), gone)) << gone;
  EXPECT_EQ(bank.total_births() - bank.total_merges(), 3);
  for (int id : bank.cluster_ids()) {
    std::vector<int64_t> tokens;
    auto collect = [&](const BirthMergeReceipt& r, int64_t offset) {
      std::set<int64_t> out;
      if (r.per_cluster_outlier_tokens.count(id))
        for (int64_t t : r.per_cluster_outlier_tokens.at(id).indices) out.insert(t);
      for (int64_t t = 0; t < static_cast<int64_t>(r.assignments.size()); ++t)
        if (r.assignments[t] == id && !out.count(t)) tokens.push_back(t + offset);
    };
    collect(r1, 0);
    collect(r2, 1500);
    const auto want = DirectMoments(p, tokens);
    for (int h = 0; h < p.H; ++h) ExpectMomentsNear(bank.moments(id, h), want[h], "two chunks");
  }
  // A third chunk: tokens of the planted clusters plus 50 from a new, far
  // blob, which births exactly one cluster.
  std::vector<float> k3(p.k.begin(), p.k.begin() + 200 * 16), v3(p.v.begin(), p.v.begin() + 200 * 16);
  Rng rng(99);
  for (int t = 0; t < 50; ++t)
    for (int j = 0; j < 16; ++j) k3[t * 16 + j] = 40.0f + static_cast<float>(rng.Gaussian());
  const auto r3 = bank.birth_and_merge(TensorView(k3.data(), {200, 2, 8}, DType::F32),
                                       TensorView(v3.data(), {200, 2, 8}, DType::F32));
  EXPECT_EQ(r3.births - r3.merges, 1);
  ASSERT_EQ(bank.num_clusters(), 4);
  const int fresh = r3.assignments[0];
  EXPECT_FALSE(std::count(ids.begin(), ids.end(), fresh));
  for (int t = 0; t < 50; ++t) EXPECT_EQ(r3.assignments[t], fresh);
  for (int t = 50; t < 200; ++t) EXPECT_NE(r3.assignments[t], fresh);
}

TEST(ClusterBank, NeverExceedsMaxClusters) {
  Rng rng(3);
  ClusterBankOptions o;
  o.max_clusters = 4;
  o.birth_distance = 1e-3;
  o.merge_distance = 0;
  ClusterBank bank(1, 8, o);
  int64_t births = 0;
  for (int chunk = 0; chunk < 5; ++chunk) {
    std::vector<float> k(64 * 8), v(64 * 8);
    for (auto& x : k) x = static_cast<float>(100.0 * rng.Gaussian());
    for (auto& x : v) x = static_cast<float>(rng.Gaussian());
    const auto r = bank.birth_and_merge(TensorView(k.data(), {64, 1, 8}, DType::F32),
                                        TensorView(v.data(), {64, 1, 8}, DType::F32));
    births += r.births;
    EXPECT_LE(bank.num_clusters(), 4);
    for (int a : r.assignments) EXPECT_TRUE(bank.cluster_count(a) > 0);
  }
  EXPECT_EQ(births, 4);
  EXPECT_EQ(bank.total_births(), 4);
}

TEST(ClusterBank, ChunkOfOneTokenAndZeroVarianceHeads) {
  ClusterBank bank(2, 4);
  const float k1[8] = {1, 2, 3, 4, 0, 0, 0, 0}, v1[8] = {5, 6, 7, 8, 0, 0, 0, 0};
  const auto r = bank.birth_and_merge(TensorView(k1, {1, 2, 4}, DType::F32), TensorView(v1, {1, 2, 4}, DType::F32));
  EXPECT_EQ(r.births, 1);
  EXPECT_EQ(r.assignments, std::vector<int>{0});
  EXPECT_EQ(r.per_token_residual, std::vector<float>{0.0f});  // a lone token predicts itself
  EXPECT_TRUE(r.per_cluster_outlier_tokens.empty());          // never the last token, never residual 0
  EXPECT_EQ(bank.cluster_count(0), 1);
  for (float x : bank.fit(0, 0).a) EXPECT_EQ(x, 0.0f);

  // Head 1 identically zero across a chunk: its scatter is 0, the ridge keeps
  // the fit finite (A = 0) and the residual only counts head 0.
  Rng rng(8);
  std::vector<float> k(300 * 8, 0.0f), v(300 * 8, 0.0f);
  for (int t = 0; t < 300; ++t)
    for (int j = 0; j < 4; ++j) {
      k[t * 8 + j] = static_cast<float>(rng.Gaussian());
      v[t * 8 + j] = 0.5f * k[t * 8 + j];
    }
  ClusterBank b2(2, 4);
  const auto r2 = b2.birth_and_merge(TensorView(k.data(), {300, 2, 4}, DType::F32),
                                     TensorView(v.data(), {300, 2, 4}, DType::F32));
  for (float x : r2.per_token_residual) EXPECT_TRUE(std::isfinite(x));
  for (int id : b2.cluster_ids()) {
    for (float x : b2.fit(id, 1).a) EXPECT_EQ(x, 0.0f);
    for (float x : b2.fit(id, 1).mean_v) EXPECT_EQ(x, 0.0f);
  }
}

TEST(ClusterBank, F16InputMatchesItsF32Widening) {
  const Planted p(2, 1, 8, 500, 4);
  const Tensor k16 = from_f32(p.kv(0, p.T, false), DType::F16), v16 = from_f32(p.kv(0, p.T, true), DType::F16);
  const Tensor k32 = to_f32(k16), v32 = to_f32(v16);
  ClusterBank a(1, 8, PlantedOptions()), b(1, 8, PlantedOptions());
  const auto ra = a.birth_and_merge(k16, v16);
  const auto rb = b.birth_and_merge(k32, v32);
  EXPECT_EQ(ra.assignments, rb.assignments);
  EXPECT_EQ(ra.per_token_residual, rb.per_token_residual);
}

TEST(ClusterBank, BadInputIsAClearErrorAndLeavesTheBankUnchanged) {
  const Planted p(2, 2, 4, 100, 6);
  ClusterBank bank(p.H, p.D, PlantedOptions());
  const auto ok = bank.birth_and_merge(p.kv(0, 50, false), p.kv(0, 50, true));
  const int clusters = bank.num_clusters();
  const ClusterMoments before = bank.moments(0, 0);

  std::vector<float> bad(p.k.begin(), p.k.begin() + 50 * 8);
  bad[17] = std::nanf("");
  const TensorView v = p.kv(0, 50, true);
  EXPECT_NE(ErrorOf([&] { bank.birth_and_merge(TensorView(bad.data(), {50, 2, 4}, DType::F32), v); })
                .find("chunk_k: expected finite values, element 17"),
            std::string::npos);
  bad[17] = INFINITY;
  EXPECT_NE(ErrorOf([&] { bank.birth_and_merge(v, TensorView(bad.data(), {50, 2, 4}, DType::F32)); })
                .find("chunk_v: expected finite values"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { bank.birth_and_merge(TensorView(p.k.data(), {25, 4, 4}, DType::F32), v); })
                .find("chunk_k: expected shape (T, 2, 4), got (25, 4, 4)"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { bank.birth_and_merge(TensorView(p.k.data(), {100, 4}, DType::F32), v); })
                .find("chunk_k: expected shape"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { bank.birth_and_merge(p.kv(0, 49, false), v); }).find("chunk_v: expected 49 tokens"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { bank.birth_and_merge(p.kv(0, 0, false), p.kv(0, 0, true)); }).find("T >= 1"),
            std::string::npos);
  std::vector<int8_t> codes(400);
  EXPECT_NE(ErrorOf([&] { bank.birth_and_merge(TensorView(codes.data(), {50, 2, 4}, DType::I8), v); })
                .find("chunk_k: expected dtype F32, F16 or BF16, got i8"),
            std::string::npos);
  EXPECT_EQ(bank.num_clusters(), clusters);
  ExpectMomentsNear(bank.moments(0, 0), before, "unchanged after errors");
  EXPECT_NE(ErrorOf([&] { bank.fit(77, 0); }).find("no live cluster 77"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { bank.moments(0, 2); }).find("head: expected [0, 2)"), std::string::npos);

  auto opt_error = [](auto mutate) {
    ClusterBankOptions o;
    mutate(o);
    return ErrorOf([&] { ClusterBank b(2, 4, o); });
  };
  EXPECT_NE(opt_error([](auto& o) { o.max_clusters = 0; }).find("max_clusters: expected >= 1"), std::string::npos);
  EXPECT_NE(opt_error([](auto& o) { o.birth_distance = 0; }).find("birth_distance"), std::string::npos);
  EXPECT_NE(opt_error([](auto& o) { o.birth_distance = NAN; }).find("birth_distance"), std::string::npos);
  EXPECT_NE(opt_error([](auto& o) { o.merge_distance = -1; }).find("merge_distance"), std::string::npos);
  EXPECT_NE(opt_error([](auto& o) { o.outlier_top_k = -1; }).find("outlier_top_k"), std::string::npos);
  EXPECT_NE(opt_error([](auto& o) { o.ridge = 0; }).find("ridge: expected a finite value > 0"), std::string::npos);
  EXPECT_NE(ErrorOf([] { ClusterBank b(0, 4); }).find("n_head: expected >= 1"), std::string::npos);
  EXPECT_NE(ErrorOf([] { ClusterBank b(2, 0); }).find("d_head: expected >= 1"), std::string::npos);
}

// SPEC §4: the default rules find planted structure without tuning, and
// do not depend on the data's units or on how many groups a chunk holds.
// Well separated (centre coordinates ~ N(0, sep^2) in units of the
// within-cluster sigma, so centres lie ~sep sqrt(2 W) sigma apart): found
// exactly; overlapping (sep <= 0.1: centres < 0.6 sigma apart in W = 16):
// one cluster. The first version normalised by the chunk's total variance
// and found 2 clusters of 4 at purity 0.50 here.
TEST(ClusterBank, DefaultsFindPlantedClustersAtAnyCountAndSeparation) {
  for (int c : {2, 4, 8}) {
    for (float sep : {4.0f, 8.0f, 32.0f}) {
      for (uint64_t seed : {1u, 2u, 3u}) {
        const Planted p(c, 2, 8, 800, 100 * c + seed, sep);
        ClusterBankOptions o;  // defaults
        ClusterBank bank(p.H, p.D, o);
        const BirthMergeReceipt r = bank.birth_and_merge(p.kv(0, p.T, false), p.kv(0, p.T, true));
        const Recovery rec = Recover(r.assignments, p.label);
        EXPECT_TRUE(rec.exact) << c << " clusters, separation " << sep << ", seed " << seed << ": found "
                               << rec.clusters << ", purity " << rec.purity;
        // Every planted anomaly (a value far off its cluster's map) is flagged.
        std::set<int64_t> flagged;
        for (const auto& [id, set] : r.per_cluster_outlier_tokens) flagged.insert(set.indices.begin(), set.indices.end());
        for (int64_t t : p.anomalies) EXPECT_TRUE(flagged.count(t)) << c << " clusters, sep " << sep << ": " << t;
      }
    }
  }
  // Separation 2: the closest of 28 pairs of centres may lie ~5 sigma
  // apart, where nearest-mean assignment has a Bayes error of ~0.6%: every
  // group found, a split at most, purity >= 0.98.
  for (int c : {2, 4, 8}) {
    for (uint64_t seed : {1u, 2u, 3u}) {
      const Planted p(c, 2, 8, 800, 100 * c + seed, 2.0f);
      ClusterBank bank(p.H, p.D);
      const BirthMergeReceipt r = bank.birth_and_merge(p.kv(0, p.T, false), p.kv(0, p.T, true));
      const Recovery rec = Recover(r.assignments, p.label);
      EXPECT_GE(rec.clusters, static_cast<size_t>(c)) << c << " clusters, separation 2, seed " << seed;
      EXPECT_LE(rec.clusters, static_cast<size_t>(c + 1)) << c << " clusters, separation 2, seed " << seed;
      EXPECT_GE(rec.purity, 0.98) << c << " clusters, separation 2, seed " << seed;
    }
  }
  for (int c : {2, 4, 8}) {
    for (float sep : {0.0f, 0.05f, 0.1f}) {
      const Planted p(c, 2, 8, 800, 7 * c, sep);
      ClusterBank bank(p.H, p.D);
      const BirthMergeReceipt r = bank.birth_and_merge(p.kv(0, p.T, false), p.kv(0, p.T, true));
      EXPECT_EQ(bank.num_clusters(), 1) << c << " overlapping clusters, separation " << sep;
    }
  }
}

TEST(ClusterBank, OneGaussianIsOneClusterAtEveryWidthAndLength) {
  for (auto [h, d] : {std::pair{1, 2}, std::pair{1, 4}, std::pair{2, 8}, std::pair{4, 8}, std::pair{1, 64}}) {
    for (int64_t t : {2, 3, 64, 128, 800, 3000}) {
      const Planted p(1, h, d, t, 1000 + t + d, 0.0f);
      ClusterBank bank(h, d);
      bank.birth_and_merge(p.kv(0, t, false), p.kv(0, t, true));
      EXPECT_EQ(bank.num_clusters(), 1) << h << " x " << d << ", T = " << t;
      // More chunks from the same Gaussian keep it one cluster.
      const Planted more(1, h, d, 256, 77 + t, 0.0f);
      for (int64_t t0 = 0; t0 < 256; t0 += 64) bank.birth_and_merge(more.kv(t0, t0 + 64, false), more.kv(t0, t0 + 64, true));
      EXPECT_EQ(bank.num_clusters(), 1) << h << " x " << d << ", T = " << t << ", later chunks";
    }
  }
}

TEST(ClusterBank, ClusteringIsInvariantToTheDataUnits) {
  for (int c : {2, 4, 8}) {
    const Planted p(c, 2, 8, 800, 300 + c, 8.0f);
    std::vector<int> want;
    for (float unit : {1.0f, 1e-3f, 1e3f, 1e-20f, 1e12f}) {
      std::vector<float> k(p.k), v(p.v);
      for (auto& x : k) x *= unit;
      for (auto& x : v) x *= unit;
      ClusterBank bank(p.H, p.D);
      const BirthMergeReceipt r = bank.birth_and_merge(TensorView(k.data(), {p.T, p.H, p.D}, DType::F32),
                                                       TensorView(v.data(), {p.T, p.H, p.D}, DType::F32));
      if (want.empty()) want = r.assignments;
      EXPECT_EQ(r.assignments, want) << c << " clusters, unit " << unit;
      ASSERT_EQ(bank.key_scale().size(), 2u);
      // sigma_h^2 is the within-cluster variance (1 in the planted units).
      for (double s : bank.key_scale()) EXPECT_NEAR(s / (double(unit) * unit), 1.0, 0.15) << unit;
    }
  }
}

TEST(ClusterBank, LaterChunksBirthNewGroupsOnTheWithinClusterScale) {
  // The first chunk holds 2 groups; a later chunk adds 2 more, 6 sigma per
  // coordinate from the others: found, not merged into the old ones.
  const Planted p(4, 2, 8, 1600, 17, 6.0f);
  std::vector<int64_t> first, second;
  for (int64_t t = 0; t < p.T; ++t) (p.label[t] < 2 ? first : second).push_back(t);
  auto gather = [&](const std::vector<int64_t>& idx, const std::vector<float>& x) {
    std::vector<float> out;
    for (int64_t t : idx) out.insert(out.end(), x.begin() + t * 16, x.begin() + (t + 1) * 16);
    return out;
  };
  ClusterBank bank(2, 8);
  std::vector<int> labels;
  std::vector<int> assignments;
  for (const auto* idx : {&first, &second}) {
    std::vector<float> k = gather(*idx, p.k), v = gather(*idx, p.v);
    const int64_t n = static_cast<int64_t>(idx->size());
    const auto r = bank.birth_and_merge(TensorView(k.data(), {n, 2, 8}, DType::F32),
                                        TensorView(v.data(), {n, 2, 8}, DType::F32));
    for (int64_t t : *idx) labels.push_back(p.label[t]);
    assignments.insert(assignments.end(), r.assignments.begin(), r.assignments.end());
  }
  EXPECT_EQ(bank.num_clusters(), 4);
  EXPECT_TRUE(Recover(assignments, labels).exact);
}

// ---- far-field attention (moment closure) ----------------------------------

// Exact attention of one query head over tokens [t0, t1) of (T, H, D) arrays,
// as an AttentionPart with one head: log sum_t exp(s q.k_t) and the softmax
// mean of v_t.
AttentionPart BruteForce(const std::vector<float>& k, const std::vector<float>& v, int H, int D, int head,
                         const float* q, double s, int64_t t0, int64_t t1) {
  std::vector<double> sc;
  double m = -INFINITY;
  for (int64_t t = t0; t < t1; ++t) {
    double x = 0;
    for (int e = 0; e < D; ++e) x += double(q[e]) * k[(t * H + head) * D + e];
    sc.push_back(s * x);
    m = std::max(m, s * x);
  }
  double l = 0;
  std::vector<double> acc(D, 0.0);
  for (int64_t t = t0; t < t1; ++t) {
    const double w = std::exp(sc[t - t0] - m);
    l += w;
    for (int e = 0; e < D; ++e) acc[e] += w * v[(t * H + head) * D + e];
  }
  AttentionPart p{{m + std::log(l)}, std::vector<float>(D)};
  for (int e = 0; e < D; ++e) p.value[e] = static_cast<float>(acc[e] / l);
  return p;
}

TEST(FarField, ExactForClustersOfIdenticalKeysAndMergesWithANearField) {
  // Two key points, each repeated; V arbitrary. Sigma = 0 and A = 0, so the
  // closure is exact: mass n exp(s q.k), value mean(v).
  const int H = 1, D = 4;
  Rng rng(41);
  std::vector<float> k(200 * D), v(200 * D);
  for (int t = 0; t < 200; ++t)
    for (int e = 0; e < D; ++e) {
      k[t * D + e] = t < 120 ? 1.0f + e : -2.0f * e;
      v[t * D + e] = static_cast<float>(rng.Gaussian());
    }
  ClusterBankOptions o;
  o.outlier_top_k = 0;
  ClusterBank bank(H, D, o);
  bank.birth_and_merge(TensorView(k.data(), {200, H, D}, DType::F32), TensorView(v.data(), {200, H, D}, DType::F32));
  ASSERT_EQ(bank.num_clusters(), 2);
  const float q[D] = {0.3f, -0.2f, 0.5f, 0.1f};
  const AttentionPart far = bank.far_field(q, 1);
  const AttentionPart want = BruteForce(k, v, H, D, 0, q, 0.5, 0, 200);
  EXPECT_NEAR(far.log_mass[0], want.log_mass[0], 1e-9);
  for (int e = 0; e < D; ++e) EXPECT_NEAR(far.value[e], want.value[e], 1e-5);
  // A near field (exact attention over extra tokens) merged by log-sum-exp
  // equals attention over the union.
  std::vector<float> k2(k), v2(v);
  for (int t = 0; t < 30; ++t)
    for (int e = 0; e < D; ++e) {
      k2.push_back(static_cast<float>(rng.Gaussian()));
      v2.push_back(static_cast<float>(rng.Gaussian()));
    }
  const AttentionPart near = BruteForce(k2, v2, H, D, 0, q, 0.5, 200, 230);
  const AttentionPart all = merge_attention_parts({far, near});
  const AttentionPart union_ = BruteForce(k2, v2, H, D, 0, q, 0.5, 0, 230);
  EXPECT_NEAR(all.log_mass[0], union_.log_mass[0], 1e-9);
  for (int e = 0; e < D; ++e) EXPECT_NEAR(all.value[e], union_.value[e], 1e-5);
}

TEST(FarField, MatchesExactAttentionOnGaussianClustersWithAffineValues) {
  // Keys ~ N(mu, I), V = mu_v + A (k - mu_k) exactly: the closure's error is
  // the sample's departure from Gaussian moments (tilted by exp(s q.k)),
  // about sqrt(e^{s^2 |q|^2} / n) in the mass.
  const Planted p(2, 2, 4, 40000, 51, 6.0f);
  std::vector<float> v = p.v;
  for (int64_t a : p.anomalies)  // remove the planted anomalies
    for (int j = 0; j < 8; ++j) v[a * 8 + j] -= 6.0f;
  // The two-point closure trades the Gaussian's exactness here for
  // exactness on two keys: log cosh(sd) = sd^2/2 - sd^4/12 + ..., and its
  // tilt is tanh(sd)/sd of the Gaussian's (sd = 0.5 |q| ~ 0.5 here: ~0.005
  // in log-mass, ~8% of s A Sigma q in value).
  for (FarFieldClosure closure : {FarFieldClosure::kGaussian, FarFieldClosure::kTwoPoint}) {
    const bool gauss = closure == FarFieldClosure::kGaussian;
    ClusterBankOptions o = PlantedOptions();
    o.outlier_top_k = 0;
    o.closure = closure;
    ClusterBank bank(2, 4, o);
    bank.birth_and_merge(p.kv(0, p.T, false), TensorView(v.data(), {p.T, 2, 4}, DType::F32));
    ASSERT_EQ(bank.num_clusters(), 2);
    Rng rng(52);
    std::vector<float> q(4 * 4);  // 4 query heads over 2 bank heads (GQA 2)
    for (auto& x : q) x = static_cast<float>(0.5 * rng.Gaussian());
    const AttentionPart far = bank.far_field(q, 4);
    for (int h = 0; h < 4; ++h) {
      const AttentionPart want = BruteForce(p.k, v, 2, 4, h / 2, q.data() + h * 4, 0.5, 0, p.T);
      EXPECT_NEAR(far.log_mass[h], want.log_mass[0], gauss ? 0.02 : 0.03) << "head " << h;
      for (int e = 0; e < 4; ++e) EXPECT_NEAR(far.value[h * 4 + e], want.value[e], gauss ? 0.05 : 0.12) << "head " << h;
    }
  }
}

// The far field's bounds (SPEC §4): a cluster's log-mass never below
// Jensen's log n + s q.mu nor above log n + s max over its key box, and its
// value inside its value box, whatever the keys. Clusters here are forced
// (max_clusters 1) to hold what a closure handles worst.
std::vector<float> RandomQuery(Rng& rng, int n, double sd) {
  std::vector<float> q(static_cast<size_t>(n));
  for (auto& x : q) x = static_cast<float>(sd * rng.Gaussian());
  return q;
}

TEST(FarField, BoundedOnAdversarialClustersForEveryClosure) {
  const int D = 8;
  Rng rng(61);
  for (FarFieldClosure closure : {FarFieldClosure::kTwoPoint, FarFieldClosure::kGaussian}) {
    for (int kind = 0; kind < 3; ++kind) {  // two far keys, heavy tails, one token
      const int T = kind == 2 ? 1 : 400;
      std::vector<float> k(static_cast<size_t>(T) * D), v(k.size());
      for (int t = 0; t < T; ++t)
        for (int e = 0; e < D; ++e) {
          double x;
          if (kind == 0) {
            x = (t % 2 ? 20.0 : -20.0) + e;
          } else {  // Cauchy: no moments, scores spread by thousands
            x = std::tan(3.14159265358979 * (rng.Uniform() - 0.5));
          }
          k[t * D + e] = static_cast<float>(x);
          v[t * D + e] = static_cast<float>(rng.Gaussian() + (kind == 0 ? 5.0 * (t % 2) : 0.0));
        }
      ClusterBankOptions o;
      o.max_clusters = 1;
      o.outlier_top_k = 0;
      o.closure = closure;
      ClusterBank bank(1, D, o);
      bank.birth_and_merge(TensorView(k.data(), {T, 1, D}, DType::F32), TensorView(v.data(), {T, 1, D}, DType::F32));
      ASSERT_EQ(bank.num_clusters(), 1);
      const ClusterMoments& m = bank.moments(0, 0);
      for (int trial = 0; trial < 50; ++trial) {
        const std::vector<float> q = RandomQuery(rng, D, trial < 25 ? 0.3 : 3.0);
        const double s = 1.0 / std::sqrt(double(D));
        const AttentionPart far = bank.far_field(q, 1);
        const AttentionPart truth = BruteForce(k, v, 1, D, 0, q.data(), s, 0, T);
        double qmu = 0, smax = 0;
        for (int e = 0; e < D; ++e) {
          qmu += double(q[e]) * m.sum_k[e] / m.count;
          smax += std::max(double(q[e]) * m.k_lo[e], double(q[e]) * m.k_hi[e]);
        }
        const double jensen = std::log(double(T)) + s * qmu, upper = std::log(double(T)) + s * smax;
        const double slack = 1e-9 * (1 + std::abs(upper));
        // The bounds hold for the truth (they are bounds) and for the estimate.
        EXPECT_GE(truth.log_mass[0], jensen - slack);
        EXPECT_LE(truth.log_mass[0], upper + slack);
        EXPECT_GE(far.log_mass[0], jensen - slack) << far_field_closure_name(closure) << " kind " << kind;
        EXPECT_LE(far.log_mass[0], upper + slack) << far_field_closure_name(closure) << " kind " << kind;
        for (int e = 0; e < D; ++e) {
          EXPECT_GE(far.value[e], m.v_lo[e]);
          EXPECT_LE(far.value[e], m.v_hi[e]);
        }
        if (kind == 2) {  // a cluster of one is exact
          EXPECT_NEAR(far.log_mass[0], truth.log_mass[0], 1e-9);
          for (int e = 0; e < D; ++e) EXPECT_NEAR(far.value[e], truth.value[e], 1e-5);
        }
        if (kind == 0 && closure == FarFieldClosure::kTwoPoint) {
          // Two keys, equally many: the two-point closure is their exact
          // mass; the value is exact up to the ridge's pull on A.
          EXPECT_NEAR(far.log_mass[0], truth.log_mass[0], 1e-9);
          for (int e = 0; e < D; ++e) EXPECT_NEAR(far.value[e], truth.value[e], 0.05);
        }
      }
    }
  }
  // The Gaussian closure alone would claim mass e^{sd^2/2}: far above the
  // upper bound for two keys 2 x 20 sqrt(8) apart; clipped, it stays at it.
  EXPECT_EQ(parse_far_field_closure("gaussian"), FarFieldClosure::kGaussian);
  EXPECT_EQ(parse_far_field_closure("two-point"), FarFieldClosure::kTwoPoint);
  EXPECT_NE(ErrorOf([] { parse_far_field_closure("gauss"); }).find("closure: expected"), std::string::npos);
}

TEST(FarField, EmptyBankAndBadArguments) {
  ClusterBank bank(2, 4);
  const std::vector<float> q(8, 0.1f);
  const AttentionPart e = bank.far_field(q, 2);
  EXPECT_TRUE(std::isinf(e.log_mass[0]) && e.log_mass[0] < 0);
  EXPECT_EQ(e.value, std::vector<float>(8, 0.0f));
  EXPECT_NE(ErrorOf([&] { bank.far_field(q, 3); }).find("n_q_heads: expected a positive multiple"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { bank.far_field(std::vector<float>(7), 2); }).find("q: expected n_q_heads * d_head = 8"),
            std::string::npos);
  std::vector<float> bad(q);
  bad[3] = NAN;
  EXPECT_NE(ErrorOf([&] { bank.far_field(bad, 2); }).find("q: expected finite values, element 3"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { merge_attention_parts({}); }).find("at least one part"), std::string::npos);
  AttentionPart a{{0.0}, {1, 2}}, b{{0.0, 1.0}, {1, 2}};
  EXPECT_NE(ErrorOf([&] { merge_attention_parts({a, b}); }).find("parts[1]"), std::string::npos);
}

}  // namespace
}  // namespace kvq
