// Static ranges for the calibrated grouped schemes (grouped_kv.h), measured
// on text the model generates itself: never on evaluation text.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvq/grouped_kv.h"
#include "model/checkpoint.h"
#include "model/sampling.h"  // calibration samples; its callers sample too

namespace kvq::model {

struct CalibrationOptions {
  int sequences = 16;        // generated sequences, each from BOS
  int length = 0;            // tokens per sequence (0: the model's seq_len)
  uint64_t seed = 1;         // sampler seed
  double temperature = 1.0;  // sampling temperature (> 0)
  double clip = 0.0;         // share of samples left outside each channel's range at each end
  // Generate up to 16 sequences side by side (Transformer::forward_many: one
  // sgemm per projection and step, each sequence sampled with its own
  // generator seeded from `seed`): on large models the weights are read
  // once per step instead of once per sequence and step. Other samples than
  // the sequential default (which draws every sequence from one generator
  // with matrix-vector products).
  bool batched = false;
};

// The calibration length when none is asked (CalibrationOptions::length 0
// at a caller that knows how far it will read): max(tokens, 512), at most the
// model's context (a long-context model's full length would be hours of
// generation). kvq eval passes its ctx; kvq generate 0 (512 tokens,
// whatever the prompt and steps).
int default_calibration_length(const Config& cfg, int tokens);

// Throws kvq::Error naming the option unless `o` is valid for a model of
// `cfg` (what calibrate_static_ranges checks before it generates anything).
void check_calibration_options(const Config& cfg, const CalibrationOptions& o);

// Runs the fp32 model on the tokens it samples (sequences x length) and
// takes every layer's K (in a grouped cache's tile frame) and V per channel
// (StaticRanges::from_samples). Deterministic for given options. Throws
// kvq::Error on bad options.
StaticRanges calibrate_static_ranges(const Checkpoint& ckpt, const CalibrationOptions& o = {});

}  // namespace kvq::model
