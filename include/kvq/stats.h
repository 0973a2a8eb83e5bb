// Small statistics used by receipts: ranks and Spearman correlation.
#pragma once

#include <span>
#include <vector>

namespace kvq {

// 1-based ranks; tied values share the mean of their ranks.
std::vector<double> average_ranks(std::span<const float> x);
// Spearman's rho = Pearson correlation of the average ranks. Throws
// kvq::Error when the sizes differ, n < 2 or a value is NaN; returns NaN
// when either side is constant (rho is undefined).
double spearman(std::span<const float> a, std::span<const float> b);

}  // namespace kvq
