#include "kvq/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvq/error.h"

namespace kvq {

std::vector<double> average_ranks(std::span<const float> x) {
  const size_t n = x.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return x[a] < x[b]; });
  std::vector<double> r(n);
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && x[order[j]] == x[order[i]]) ++j;
    const double rank = 0.5 * static_cast<double>(i + 1 + j);  // mean of ranks i+1 .. j
    for (size_t m = i; m < j; ++m) r[order[m]] = rank;
    i = j;
  }
  return r;
}

double spearman(std::span<const float> a, std::span<const float> b) {
  KVQ_CHECK_ARG(a.size() == b.size(), "spearman: b: expected ", a.size(), " values like a, got ", b.size());
  KVQ_CHECK_ARG(a.size() >= 2, "spearman: a: expected at least 2 values, got ", a.size());
  for (const auto& [x, arg] : {std::pair{a, "a"}, std::pair{b, "b"}}) {
    for (size_t i = 0; i < x.size(); ++i)
      KVQ_CHECK_ARG(!std::isnan(x[i]), "spearman: ", arg, ": expected no NaN, element ", i, " is NaN");
  }
  const std::vector<double> ra = average_ranks(a), rb = average_ranks(b);
  const double mean = 0.5 * static_cast<double>(a.size() + 1);  // both rank vectors
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double da = ra[i] - mean, db = rb[i] - mean;
    sab += da * db;
    saa += da * da;
    sbb += db * db;
  }
  if (saa == 0 || sbb == 0) return std::numeric_limits<double>::quiet_NaN();
  return sab / std::sqrt(saa * sbb);
}

namespace {

// Regularised lower incomplete gamma P(a, x), a > 0, x >= 0: the series for
// x < a + 1, else 1 - Q from Q's continued fraction (modified Lentz).
double GammaP(double a, double x) {
  if (x <= 0) return 0.0;
  if (std::isinf(x)) return 1.0;
  const double log_front = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1) {
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 100000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::abs(term) < std::abs(sum) * 1e-16) break;
    }
    return std::min(1.0, sum * std::exp(log_front));
  }
  const double tiny = 1e-300;
  double b = x + 1 - a, c = 1 / tiny, dd = 1 / b, h = dd;
  for (int i = 1; i < 100000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    dd = an * dd + b;
    if (std::abs(dd) < tiny) dd = tiny;
    c = b + an / c;
    if (std::abs(c) < tiny) c = tiny;
    dd = 1 / dd;
    const double delta = dd * c;
    h *= delta;
    if (std::abs(delta - 1) < 1e-16) break;
  }
  return std::max(0.0, 1.0 - std::exp(log_front) * h);
}

}  // namespace

double chi_square_cdf(double x, double dof) {
  KVQ_CHECK_ARG(dof > 0 && std::isfinite(dof), "chi_square_cdf: dof: expected a finite value > 0, got ", dof);
  KVQ_CHECK_ARG(!std::isnan(x), "chi_square_cdf: x: expected a number, got NaN");
  return GammaP(0.5 * dof, 0.5 * x);
}

double chi_square_quantile(double p, double dof) {
  KVQ_CHECK_ARG(p > 0 && p < 1, "chi_square_quantile: p: expected 0 < p < 1, got ", p);
  KVQ_CHECK_ARG(dof > 0 && std::isfinite(dof), "chi_square_quantile: dof: expected a finite value > 0, got ", dof);
  double lo = 0.0, hi = dof + 10.0;
  while (GammaP(0.5 * dof, 0.5 * hi) < p) hi *= 2;
  for (int i = 0; i < 200 && hi - lo > 1e-12 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    (GammaP(0.5 * dof, 0.5 * mid) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

}  // namespace kvq
