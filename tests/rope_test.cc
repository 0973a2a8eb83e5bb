// RoPE (kvq/rope.h): frequencies against an independent double
// implementation of llama2.c's, linear and Llama 3.1's rule (Meta's
// apply_scaling, with its published parameters), the table and rotation
// against plain cos/sin, the transpose as the inverse, and bad configs.
#include "kvq/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/test_util.h"

namespace kvq {
namespace {

using test::ErrorOf;

// Meta's llama3 apply_scaling, in double.
double Llama3(double f, const RopeConfig& r) {
  const double wavelen = 2 * M_PI / f;
  const double low = r.original_context / static_cast<double>(r.low_freq_factor);
  const double high = r.original_context / static_cast<double>(r.high_freq_factor);
  if (wavelen < high) return f;
  if (wavelen > low) return f / r.factor;
  const double smooth = (r.original_context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  return (1 - smooth) * f / r.factor + smooth * f;
}

TEST(Rope, FrequenciesFollowEachScalingRule) {
  RopeConfig llama3;
  llama3.theta = 500000.0f, llama3.scaling = RopeConfig::Scaling::kLlama3, llama3.factor = 8.0f;
  RopeConfig linear;
  linear.scaling = RopeConfig::Scaling::kLinear, linear.factor = 4.0f;
  for (const int hd : {8, 64, 128}) {
    for (const RopeConfig& r : {RopeConfig{}, linear, llama3}) {
      SCOPED_TRACE(r.describe() + " hd " + std::to_string(hd));
      const std::vector<float> f = rope_frequencies(hd, r);
      ASSERT_EQ(f.size(), static_cast<size_t>(hd / 2));
      for (int p = 0; p < hd / 2; ++p) {
        double want = std::pow(static_cast<double>(r.theta), -2.0 * p / hd);
        if (r.scaling == RopeConfig::Scaling::kLinear) want /= r.factor;
        if (r.scaling == RopeConfig::Scaling::kLlama3) want = Llama3(want, r);
        EXPECT_NEAR(f[static_cast<size_t>(p)], want, 4e-7 * want) << p;
      }
    }
  }
  // Llama 3.1 at 128: the highest frequencies are kept, the lowest divided by 8.
  const std::vector<float> f = rope_frequencies(128, llama3);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_NEAR(f[63], std::pow(500000.0, -126.0 / 128) / 8, 1e-6 * f[63]);
}

TEST(Rope, TableRotatesPairsAndItsTransposeUndoesIt) {
  const int hd = 16, H = 3;
  const RopeTable t(40, hd);
  const std::vector<float> f = rope_frequencies(hd, {});
  std::vector<float> x(static_cast<size_t>(H * hd));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * static_cast<float>(i) + 0.3f);
  for (const int pos : {0, 1, 17, 39}) {
    std::vector<float> y = x;
    t.apply(y.data(), H, pos);
    for (int h = 0; h < H; ++h) {
      for (int p = 0; p < hd / 2; ++p) {
        const size_t i = static_cast<size_t>(h * hd + 2 * p);
        const float a = static_cast<float>(pos) * f[static_cast<size_t>(p)];
        EXPECT_EQ(y[i], x[i] * std::cos(a) - x[i + 1] * std::sin(a));
        EXPECT_EQ(y[i + 1], x[i] * std::sin(a) + x[i + 1] * std::cos(a));
      }
    }
    rope_rotate(y.data(), H, hd, t.cos(pos), t.sin(pos), /*transpose=*/true);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-6f) << pos << " " << i;
  }
}

TEST(Rope, ConfigsCanonicalDescribedAndChecked) {
  RopeConfig a, b;
  a.factor = 3.0f;  // read by no scaling: canonical drops it
  EXPECT_EQ(a.canonical(), b);
  RopeConfig l;
  l.scaling = RopeConfig::Scaling::kLinear, l.factor = 2.0f, l.low_freq_factor = 7.0f;
  EXPECT_EQ(l.canonical().low_freq_factor, RopeConfig{}.low_freq_factor);
  EXPECT_EQ(l.canonical().factor, 2.0f);
  EXPECT_NE(l.describe().find("linear scaling x2"), std::string::npos);
  RopeConfig bad;
  bad.theta = 1.0f;
  EXPECT_NE(ErrorOf([&] { bad.validate("rope"); }).find("theta"), std::string::npos);
  bad = {};
  bad.theta = std::nanf("");
  EXPECT_NE(ErrorOf([&] { bad.validate("rope"); }).find("theta"), std::string::npos);
  bad = {};
  bad.scaling = static_cast<RopeConfig::Scaling>(9);
  EXPECT_NE(ErrorOf([&] { bad.validate("r"); }).find("r:"), std::string::npos);
  EXPECT_NE(ErrorOf([] { RopeTable(0, 8); }).find("max_seq"), std::string::npos);
  EXPECT_NE(ErrorOf([] { RopeTable(4, 7); }).find("even"), std::string::npos);
}

}  // namespace
}  // namespace kvq

namespace kvq {
namespace {

// One table per rotation alive, the longest asked for: a shorter request
// gets it, a longer one a new table with the same entries, and another
// rotation its own.
TEST(Rope, SharedTablesServeEveryLengthWithTheSameEntries) {
  RopeConfig a;
  a.theta = 5000.0f;
  const auto t1 = shared_rope_table(100, 16, a);
  EXPECT_EQ(shared_rope_table(50, 16, a), t1);
  EXPECT_EQ(shared_rope_table(100, 16, a.canonical()), t1);
  const auto t2 = shared_rope_table(300, 16, a);
  EXPECT_NE(t2, t1);
  EXPECT_GE(t2->max_seq(), 300);
  EXPECT_EQ(shared_rope_table(120, 16, a), t2);
  const RopeTable fresh(300, 16, a);
  for (int pos : {0, 7, 99, 299}) {
    for (int p = 0; p < 8; ++p) {
      EXPECT_EQ(t2->cos(pos)[p], fresh.cos(pos)[p]);
      EXPECT_EQ(t2->sin(pos)[p], fresh.sin(pos)[p]);
    }
  }
  EXPECT_NE(shared_rope_table(100, 32, a), t2);  // another head size
  RopeConfig b = a;
  b.theta = 10000.0f;
  EXPECT_NE(shared_rope_table(100, 16, b), t2);  // another rotation
  EXPECT_EQ(t1.use_count(), 1);  // held by its callers only
}

}  // namespace
}  // namespace kvq
