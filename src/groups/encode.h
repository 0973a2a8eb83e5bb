// Internal: a grouped cache's channel coder (grouped_kv.h): each channel of a
// group gets its range (of least squared error among the candidates with
// m) as fp16 lo / step or p8's a / b, and its codes. EncodeChannelRef is the
// scalar reference; EncodeChannels (grouped_encode.cc, Highway: 16 channels
// a vector on AVX-512) gives the same parameters and codes bit for bit on
// every target, by the same float operations in the same order.
//
// The rule, per channel with values x_t (t < n), mn / mx their extremes, w =
// mx - mn, B bits, L = 2^B - 1: the candidate ranges [mn + w a / 16, mx -
// w b / 16] (float: (w * a) / 16 then the sum) are tried with b = 0, a =
// 0..clip, then with a the best of those and b = 1..clip (clip 0: min / max
// alone), each as
//     fp16: lo = the largest fp16 <= its low end, step = the smallest fp16
//           >= (high end - lo) / L (0 when high end <= lo);
//     p8:   a' = floor((low - base) / unit), b' = ceil((high - base) /
//           unit), clamped to 0..255 and moved by one unit where float
//           rounding left the range short (see CodeP8), lo = base + unit a',
//           step = ustep (b' - a');
//   the codes q_t = clamp(rne((x_t - lo) * (1 / step)), 0, L) (0 when step
//   is 0), and their squared error sum_t (x_t - (lo + step q_t))^2 in float,
//   t in order; the first candidate of least error wins (ties: the wider).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq::grouped {

struct EncodeArgs {
  const float* x = nullptr;  // channel c's value of token t at x[t * stride + c]
  int n = 0;                 // tokens
  size_t stride = 0;
  int n_ch = 0;              // channels
  const uint8_t* bits = nullptr;  // per channel, 2..8
  // p8: per channel base, unit, ustep at grid[c], grid[n_ch + c], grid[2 n_ch + c];
  // null: fp16 parameters.
  const float* grid = nullptr;
  int clip = 0;  // m: 4; else 0 (min / max)
  // Outputs per channel: fp16 lo / step bits (grid null) or p8's a / b, and
  // the decoded lo / step; codes[c * n + t] (may be null).
  uint16_t* lo16 = nullptr;
  uint16_t* step16 = nullptr;
  uint8_t* a = nullptr;
  uint8_t* b = nullptr;
  float* lo = nullptr;
  float* step = nullptr;
  uint8_t* codes = nullptr;
};

// The scalar reference (every output of every channel).
void EncodeChannelRef(const EncodeArgs& args);
// The same, SIMD (dispatched once per call; never throws).
void EncodeChannels(const EncodeArgs& args);
// Codes on given parameters: codes[c * n + t] = CodeOf(x[t * stride + c],
// lo[c], step[c], 2^bits[c] - 1) (SIMD; the same bits as CodeOf).
void CodeValues(const float* x, int n, size_t stride, int n_ch, const float* lo, const float* step,
                const uint8_t* bits, uint8_t* codes);

// An open token's codes on its grid (grouped_kv.h, o<N>): per value c,
// with wide (w<W>): c8 = code on (lo, step8, 255), y = lo + step8 c8; else
// y = x; qn = code of y on (lo, step, 2^nbits - 1); the unit (hd values) fits
// when every value's held form (y with wide, else lo + step qn) is within
// half its step of x. n_units * hd values; c8 may be null (no w tier).
void OpenCodesRef(const float* x, const float* lo, const float* step, const float* step8, size_t n_units, size_t hd,
                  int nbits, uint8_t* qn, uint8_t* c8, uint8_t* fits);
void OpenCodes(const float* x, const float* lo, const float* step, const float* step8, size_t n_units, size_t hd,
               int nbits, uint8_t* qn, uint8_t* c8, uint8_t* fits);

// One code: clamp(rne((x - lo) * (1 / step)), 0, levels), 0 when step is 0.
uint8_t CodeOf(float x, float lo, float step, int levels);

// The fp16 value at or below / at or above x (|x| <= 65504), exactly, and
// the bits of a float that is an fp16 value.
float F16Floor(float x);
float F16Ceil(float x);
uint16_t F16Bits(float v);

}  // namespace kvq::grouped
