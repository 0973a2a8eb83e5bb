// Internal: the fused attention kernel over coded groups (grouped_kv.h),
// compiled for every Highway target in grouped_attention.cc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/half.h"

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
  // Calibrated caches: per KV head lo[head_dim] | step[head_dim] (floats)
  // for K and for V, and groups without a parameter header. Null: each
  // group starts with its fp16 lo and step.
  const float* k_static = nullptr;
  const float* v_static = nullptr;
  // p8 caches: per KV head the 8-bit parameter grid (see DecodeGroupParams)
  // of K and of V, 3 * head_dim floats each; null: fp16 parameters.
  const float* k_grid = nullptr;
  const float* v_grid = nullptr;
  // K bits and byte offset in a tile of each channel (n_kv_heads * head_dim),
  // and one head's tile bytes.
  const uint8_t* k_bits_ch = nullptr;
  const uint32_t* k_off_ch = nullptr;
  size_t ktile_bytes = 0;
  double* log_mass = nullptr;  // n_heads outputs: log sum exp(score), -inf when no token
  float* value = nullptr;      // n_heads * head_dim outputs (normalised)
};

// One thread; never throws.
void Attend(const Call& c);

// Bytes of a group's parameter header for one head: fp16 lo | step (4 per
// channel), or with an 8-bit grid (p8) the codes a | b (2 per channel).
inline size_t GroupHeaderBytes(size_t hd, bool p8) { return (p8 ? 2 : 4) * hd; }

// One head's group parameters from its header at p: lo[hd] and step[hd].
// fp16 (grid null): lo[hd] | step[hd] as halves. p8: the codes a[hd] | b[hd]
// (u8) on the channel's grid, grid = base[hd] | unit[hd] | ustep[hd] with
// base and unit fp16 values and ustep = unit / (2^B - 1):
//   lo = base + unit a,  step = ustep (b - a).
// unit * a is exact in float (11 x 8 significant bits), so the result is
// the same with or without a fused multiply-add, on every target.
inline void DecodeGroupParams(const uint8_t* p, size_t hd, const float* grid, float* lo, float* step) {
  if (grid == nullptr) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);  // group headers are 2-byte aligned
    f16_to_f32({h, hd}, {lo, hd});
    f16_to_f32({h + hd, hd}, {step, hd});
    return;
  }
  for (size_t i = 0; i < hd; ++i) {
    lo[i] = grid[i] + grid[hd + i] * static_cast<float>(p[i]);
    step[i] = grid[2 * hd + i] * static_cast<float>(p[hd + i] - p[i]);
  }
}

// An 8-code block of B bits (2..8) takes B bytes: codes j = 0..7 at bits
// [lb j, lb j + lb) of its first 4 bytes' little-endian word, lb = min(B, 4)
// (the low plane); for B > 4 the high parts (code >> 4) follow at bits
// [(B - 4) j, ...) of the word at byte 4 (the high plane). So 8 lanes of
// codes come out of one or two 32-bit broadcasts, a per-lane shift and a
// mask, for every B. A K tile channel (16 tokens) is two blocks (tokens
// 0-7, 8-15); a V row (head_dim channels) is head_dim / 8 blocks. Readers
// may load 4 bytes past a block's end (buffers are padded).
inline void PackBlock8(const uint8_t* codes, int b, uint8_t* out) {
  const int lb = b < 4 ? b : 4;
  uint64_t lo = 0, hi = 0;
  for (int j = 0; j < 8; ++j) {
    lo |= static_cast<uint64_t>(codes[j] & ((1u << lb) - 1)) << (lb * j);
    if (b > 4) hi |= static_cast<uint64_t>(codes[j] >> 4) << ((b - 4) * j);
  }
  for (int i = 0; i < lb; ++i) out[i] = static_cast<uint8_t>(lo >> (8 * i));
  for (int i = 0; i < b - 4; ++i) out[4 + i] = static_cast<uint8_t>(hi >> (8 * i));
}

// Sets code j (0..7) of the block at p, leaving the other codes as they are.
inline void SetCodeInBlock8(uint8_t* p, int j, int b, uint32_t code) {
  auto set = [](uint8_t* q, int bit0, int nbits, uint32_t val) {
    for (int k = 0; k < nbits; ++k) {
      const int bit = bit0 + k;
      const uint8_t m = static_cast<uint8_t>(1u << (bit % 8));
      q[bit / 8] = ((val >> k) & 1) ? static_cast<uint8_t>(q[bit / 8] | m) : static_cast<uint8_t>(q[bit / 8] & ~m);
    }
  };
  const int lb = b < 4 ? b : 4;
  set(p, lb * j, lb, code & ((1u << lb) - 1));
  if (b > 4) set(p + 4, (b - 4) * j, b - 4, code >> 4);
}

// Code j (0..7) of the block at p (scalar reference).
inline uint32_t CodeInBlock8(const uint8_t* p, int j, int b) {
  const int lb = b < 4 ? b : 4;
  auto word = [](const uint8_t* q, int bytes) {
    uint32_t w = 0;
    for (int i = 0; i < bytes; ++i) w |= static_cast<uint32_t>(q[i]) << (8 * i);
    return w;
  };
  uint32_t c = (word(p, lb) >> (lb * j)) & ((1u << lb) - 1);
  if (b > 4) c |= ((word(p + 4, b - 4) >> ((b - 4) * j)) & ((1u << (b - 4)) - 1)) << 4;
  return c;
}

}  // namespace kvq::grouped
