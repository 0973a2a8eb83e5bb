// The sampler of kvq generate and calibration (model/sampling.h).
#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvq::model {

int sample_token(std::span<const float> logits, double temperature, uint64_t& rng) {
  return sample_token(logits, temperature, 1.0, rng);
}

int sample_token(std::span<const float> logits, double temperature, double top_p, uint64_t& rng) {
  const int V = static_cast<int>(logits.size());
  // Greedy at 0, and at a temperature so small that it is 0 as the float the
  // softmax divides by (1e-46: 0/0 made every weight NaN): T -> 0 is argmax.
  if (temperature == 0.0 || !(static_cast<float>(temperature) > 0.0f)) {
    return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;  // xorshift64*
  const float u = static_cast<float>((rng * 0x2545F4914F6CDD1Dull) >> 40) / 16777216.0f;
  const float m = *std::max_element(logits.begin(), logits.end());
  std::vector<float> probs(static_cast<size_t>(V));
  double sum = 0;
  for (int i = 0; i < V; ++i) {
    sum += probs[static_cast<size_t>(i)] =
        std::exp((logits[static_cast<size_t>(i)] - m) / static_cast<float>(temperature));
  }
  if (top_p < 1.0) {  // the nucleus: most probable first, ties by id
    std::vector<int> order(static_cast<size_t>(V));
    for (int i = 0; i < V; ++i) order[static_cast<size_t>(i)] = i;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return probs[static_cast<size_t>(a)] > probs[static_cast<size_t>(b)];
    });
    double kept = 0;
    size_t n = 0;
    while (n < order.size() && (n == 0 || kept < top_p * sum)) kept += probs[static_cast<size_t>(order[n++])];
    const double r = u * kept;
    double c = 0;
    for (size_t i = 0; i < n; ++i) {
      c += probs[static_cast<size_t>(order[i])];
      if (r < c) return order[i];
    }
    return order[n - 1];
  }
  const double r = u * sum;
  double c = 0;
  for (int i = 0; i < V; ++i) {
    c += probs[static_cast<size_t>(i)];
    if (r < c) return i;
  }
  return V - 1;
}

}  // namespace kvq::model
