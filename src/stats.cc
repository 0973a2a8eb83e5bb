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

}  // namespace kvq
