// Internal: the fused attention kernel over coded groups (grouped_kv.h),
// compiled for every Highway target in grouped_attention.cc.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq::grouped {

struct Call {
  const uint8_t* k = nullptr;  // the layer's K codes: head h, group g at (h * max_groups + g) * gbk
  const uint8_t* v = nullptr;  // V the same with gbv
  size_t gbk = 0, gbv = 0;
  int64_t max_groups = 0;
  int n_kv_heads = 0, head_dim = 0, n_heads = 0, k_bits = 0, v_bits = 0, group = 0;
  int64_t first = 0;           // position of group 0's first token (the sinks before it)
  int64_t g0 = 0, g1 = 0;      // groups [g0, g1) to attend
  const float* q = nullptr;    // n_heads * head_dim, already multiplied by the score scale
  const float* rope_cos = nullptr;  // RopeTable: (max_seq, head_dim / 2)
  const float* rope_sin = nullptr;
  double* log_mass = nullptr;  // n_heads outputs: log sum exp(score), -inf when no token
  float* value = nullptr;      // n_heads * head_dim outputs (normalised)
};

// One thread; never throws.
void Attend(const Call& c);

// Codes i = 0..7 at bits [b i, b i + b) of the little-endian bytes at p,
// which must be readable for 8 bytes.
inline void Unpack8(const uint8_t* p, int b, uint32_t* out) {
  uint64_t w = 0;
  for (int i = 0; i < 8; ++i) w |= static_cast<uint64_t>(p[i]) << (8 * i);
  const uint64_t mask = (uint64_t{1} << b) - 1;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint32_t>((w >> (b * i)) & mask);
}

}  // namespace kvq::grouped
