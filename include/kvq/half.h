// IEEE binary16 (F16) and bfloat16 (BF16) conversions.
//
// Scalar references (*_ref) are plain bit manipulation; the bulk functions
// are Highway SIMD with runtime dispatch (F16C where available) and give the
// same bits as the references. float -> half rounds to nearest, ties to even;
// NaN stays NaN (quiet), overflow goes to infinity.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

namespace kvq {

uint16_t f32_to_f16_ref(float f);
// Inline: the weight kernels call it once per block.
inline float f16_to_f32_ref(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;  // 2^-24
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}
uint16_t f32_to_bf16_ref(float f);
float bf16_to_f32_ref(uint16_t b);

// Bulk conversions; spans must have equal sizes (asserted).
void f32_to_f16(std::span<const float> in, std::span<uint16_t> out);
void f16_to_f32(std::span<const uint16_t> in, std::span<float> out);
void f32_to_bf16(std::span<const float> in, std::span<uint16_t> out);
void bf16_to_f32(std::span<const uint16_t> in, std::span<float> out);

}  // namespace kvq
