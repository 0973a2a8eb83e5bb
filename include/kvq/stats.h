// Small statistics: ranks and Spearman correlation (receipts), the
// chi-square distribution (E2's scale estimate).
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

// P(X <= x) for X ~ chi^2 with dof degrees of freedom (the regularised lower
// incomplete gamma P(dof/2, x/2); relative error ~1e-14). Throws kvq::Error
// unless dof > 0 and x is not NaN.
double chi_square_cdf(double x, double dof);
// The p-quantile of chi^2_dof (bisection on chi_square_cdf to ~1e-12
// relative). Throws kvq::Error unless 0 < p < 1 and dof > 0.
double chi_square_quantile(double p, double dof);

}  // namespace kvq
