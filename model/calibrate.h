// Static ranges for the calibrated grouped schemes (grouped_kv.h), measured
// on text the model generates itself: never on evaluation text.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvq/grouped_kv.h"
#include "model/llama2.h"

namespace kvq::model {

// The next token from one position's logits: the argmax at temperature 0,
// else a draw from softmax(logits / temperature) with the xorshift64* state
// `rng` (kvq generate's sampler).
int sample_token(std::span<const float> logits, double temperature, uint64_t& rng);

struct CalibrationOptions {
  int sequences = 16;        // generated sequences, each from BOS
  int length = 0;            // tokens per sequence (0: the model's seq_len)
  uint64_t seed = 1;         // sampler seed
  double temperature = 1.0;  // sampling temperature (> 0)
  double clip = 0.0;         // share of samples left outside each channel's range at each end
};

// Runs the fp32 model on the tokens it samples (sequences x length) and
// takes every layer's K (in a grouped cache's tile frame) and V per channel
// (StaticRanges::from_samples). Deterministic for given options. Throws
// kvq::Error on bad options.
StaticRanges calibrate_static_ranges(const Checkpoint& ckpt, const CalibrationOptions& o = {});

}  // namespace kvq::model
