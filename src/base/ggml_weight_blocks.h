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

}  // namespace kvq::ggml::blocks
