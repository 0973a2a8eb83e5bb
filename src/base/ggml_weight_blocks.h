// Pieces of ggml's weight blocks shared by the reference decoders
// (ggml_weights.cc) and the fused kernel (ggml_dot.cc). Internal.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvq/half.h"

namespace kvq::ggml::blocks {

// IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl).
inline constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// An fp16 field at any alignment.
inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32_ref(h);
}

// The K-quants' 8 six-bit (scale, min) pairs packed in 12 bytes: pair j.
inline void ScaleMinK4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// All 8 pairs at once: scales to out[0..8), mins to out[8..16) (ScaleMinK4
// for j = 0..7, four bytes at a time).
inline void ScalesMinsK4(const uint8_t* q, uint8_t* out) {
  uint32_t a[3], o[4];
  std::memcpy(a, q, 12);
  const uint32_t k6 = 0x3F3F3F3Fu, k4 = 0x0F0F0F0Fu, k2 = 0x03030303u;
  o[0] = a[0] & k6;
  o[1] = (a[2] & k4) | (((a[0] >> 6) & k2) << 4);
  o[2] = a[1] & k6;
  o[3] = ((a[2] >> 4) & k4) | (((a[1] >> 6) & k2) << 4);
  std::memcpy(out, o, 16);
}

// Q5_0 / Q5_1's 32 five-bit codes (0..31): the nibbles of qs[16] (low:
// values 0..15, high: 16..31) with their fifth bits from the 32-bit mask at qh_at.
inline void Codes5(const uint8_t* qh_at, const uint8_t* qs, int* c) {
  uint32_t qh;
  std::memcpy(&qh, qh_at, 4);
  for (int j = 0; j < 16; ++j) {
    c[j] = (qs[j] & 0x0F) | static_cast<int>(((qh >> j) << 4) & 0x10);
    c[j + 16] = (qs[j] >> 4) | static_cast<int>((qh >> (j + 12)) & 0x10);
  }
}

// Q3_K's 16 six-bit scales packed in 12 bytes, unpacked (before the - 32).
inline void ScalesQ3_K(const uint8_t* packed, int8_t* scales) {
  uint32_t aux[4];
  std::memcpy(aux, packed, 12);
  const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  std::memcpy(scales, aux, 16);
}

}  // namespace kvq::ggml::blocks
