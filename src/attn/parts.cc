// Attention parts and their exact merge (kvq/attention_part.h).
#include "kvq/attention_part.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvq/error.h"

namespace kvq {

AttentionPart merge_attention_parts(const std::vector<AttentionPart>& parts) {
  KVQ_CHECK_ARG(!parts.empty(), "merge_attention_parts: parts: expected at least one part");
  const size_t H = parts[0].log_mass.size(), n = parts[0].value.size();
  KVQ_CHECK_ARG(H > 0 && n % H == 0, "merge_attention_parts: parts[0]: value size ", n, " is not a multiple of ",
                H, " heads");
  for (size_t i = 1; i < parts.size(); ++i) {
    KVQ_CHECK_ARG(parts[i].log_mass.size() == H && parts[i].value.size() == n, "merge_attention_parts: parts[", i,
                  "]: expected ", H, " heads and ", n, " values like parts[0]");
  }
  const size_t d = n / H;
  AttentionPart out{std::vector<double>(H, -std::numeric_limits<double>::infinity()), std::vector<float>(n, 0.0f)};
  std::vector<double> acc(d);
  for (size_t h = 0; h < H; ++h) {
    double m = -std::numeric_limits<double>::infinity();
    for (const auto& p : parts) m = std::max(m, p.log_mass[h]);
    if (m == -std::numeric_limits<double>::infinity()) continue;
    double total = 0.0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (const auto& p : parts) {
      const double w = std::exp(p.log_mass[h] - m);
      total += w;
      for (size_t e = 0; e < d; ++e) acc[e] += w * p.value[h * d + e];
    }
    out.log_mass[h] = m + std::log(total);
    for (size_t e = 0; e < d; ++e) out.value[h * d + e] = static_cast<float>(acc[e] / total);
  }
  return out;
}

}  // namespace kvq
