// Sampling the next token (kvq generate, calibration).
#pragma once

#include <cstdint>
#include <span>

namespace kvq::model {

// The next token from one position's logits: the argmax at temperature 0,
// else a draw from softmax(logits / temperature) with the xorshift64* state
// `rng` (kvq generate's sampler).
int sample_token(std::span<const float> logits, double temperature, uint64_t& rng);
// The same with nucleus sampling: the draw is from the fewest most probable
// tokens whose probabilities sum to at least top_p (0 < top_p <= 1; 1: all
// of them, the draw above).
int sample_token(std::span<const float> logits, double temperature, double top_p, uint64_t& rng);

}  // namespace kvq::model
