// kvq/stats.h: Spearman's rank correlation with ties and the chi-square
// distribution against tables.
#include "kvq/stats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/test_util.h"

namespace kvq {
namespace {
using test::ErrorOf;

TEST(Stats, SpearmanWithTies) {
  const std::vector<float> a{1, 2, 2, 3}, b{1, 3, 2, 4};
  EXPECT_EQ(average_ranks(a), (std::vector<double>{1, 2.5, 2.5, 4}));
  EXPECT_NEAR(spearman(a, b), 4.5 / std::sqrt(22.5), 1e-12);
  const std::vector<float> up{0.1f, 5, 7, 100}, down{9, 3, 2, -1};
  EXPECT_DOUBLE_EQ(spearman(up, up), 1.0);
  EXPECT_DOUBLE_EQ(spearman(up, down), -1.0);
  EXPECT_TRUE(std::isnan(spearman(up, std::vector<float>{1, 1, 1, 1})));
  EXPECT_NE(ErrorOf([&] { spearman(up, std::vector<float>{1, 2, 3}); }).find("b: expected 4 values like a, got 3"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { spearman(std::vector<float>{1}, std::vector<float>{1}); }).find("at least 2"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { spearman(up, std::vector<float>{1, NAN, 2, 3}); }).find("b: expected no NaN, element 1"),
            std::string::npos);
}

TEST(Stats, ChiSquareAgainstTables) {
  // chi^2_2 is exponential: P(X <= x) = 1 - exp(-x / 2).
  for (double x : {0.01, 0.5, 2.0, 10.0, 60.0}) EXPECT_NEAR(chi_square_cdf(x, 2), -std::expm1(-x / 2), 1e-14) << x;
  // Table values (Abramowitz & Stegun 26.4): 95% of chi^2_1, 99% of
  // chi^2_10, medians of chi^2_16 and chi^2_100, 1% of chi^2_8.
  EXPECT_NEAR(chi_square_quantile(0.95, 1), 3.841459, 1e-6);
  EXPECT_NEAR(chi_square_quantile(0.99, 10), 23.20925, 1e-5);
  EXPECT_NEAR(chi_square_quantile(0.5, 16), 15.33849, 1e-5);
  EXPECT_NEAR(chi_square_quantile(0.5, 100), 99.33412, 1e-5);
  EXPECT_NEAR(chi_square_quantile(0.01, 8), 1.646497, 1e-6);
  EXPECT_NEAR(chi_square_cdf(chi_square_quantile(1e-6, 4), 4), 1e-6, 1e-15);
  EXPECT_EQ(chi_square_cdf(0, 3), 0.0);
  EXPECT_EQ(chi_square_cdf(INFINITY, 3), 1.0);
  EXPECT_NE(ErrorOf([] { chi_square_cdf(1, 0); }).find("dof"), std::string::npos);
  EXPECT_NE(ErrorOf([] { chi_square_cdf(NAN, 1); }).find("x"), std::string::npos);
  EXPECT_NE(ErrorOf([] { chi_square_quantile(1, 1); }).find("p: expected 0 < p < 1"), std::string::npos);
}

}  // namespace
}  // namespace kvq
