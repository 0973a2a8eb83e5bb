// Internal: row scales are stored as raw little-endian float bits.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvq::schemes {
inline void PutF32(uint8_t* dst, float f) { std::memcpy(dst, &f, 4); }
inline float GetF32(const uint8_t* src) {
  float f;
  std::memcpy(&f, src, 4);
  return f;
}
}  // namespace kvq::schemes
