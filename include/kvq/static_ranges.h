// Calibration: per-channel ranges of K and V measured before a sequence
// (static and p8 grouped schemes read them, kvq/grouped_kv.h; kvq eval
// measures them on text the model generates, model/calibrate.h), and the
// allocation of K bits over channels by their weights.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kvq {

// Calibrated ranges of K (in the tile frame, kvq/grouped_kv.h) and V: for layer l
// and channel c = head * head_dim + i, [lo, hi] at index l * n_kv_heads *
// head_dim + c.
struct StaticRanges {
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  std::vector<float> k_lo, k_hi, v_lo, v_hi;
  int64_t samples = 0;  // tokens the ranges were measured on
  // Per channel (same indexing), the weight of its quantization error in
  // the scores (K) for bit allocation; empty: none measured.
  std::vector<float> k_weight;

  // From samples: per layer, rows of n_kv_heads * head_dim values (K in the
  // tile frame and V, equal row counts). clip: the share of each channel's
  // samples left outside its range at each end (0: min and max). Throws
  // kvq::Error on no samples, ragged input, non-finite values or clip
  // outside [0, 0.25).
  static StaticRanges from_samples(const std::vector<std::vector<float>>& k, const std::vector<std::vector<float>>& v,
                                   int n_kv_heads, int head_dim, double clip = 0.0);
  // Throws kvq::Error naming `arg` unless the geometry matches and every
  // range is finite with lo <= hi.
  void validate(int n_layers, int n_kv_heads, int head_dim, const char* arg = "ranges") const;
};

// Bits per channel minimising sum_i w_i 4^-b_i (the quantization error of
// channel i at b_i bits, uniform levels) with sum_i b_i = avg_bits * n and
// min_bits <= b_i <= max_bits: greedy, one bit at a time to the channel
// whose error drops most (ties: the fewest bits, then the lowest index). Throws kvq::Error on
// non-finite or negative weights or an infeasible budget. (A grouped cache
// allocates per quad of channels: the quad's weight is the sum of its 4.)
std::vector<int> allocate_channel_bits(std::span<const float> weights, int avg_bits, int min_bits = 1,
                                       int max_bits = 8);

}  // namespace kvq
