// IEEE binary16 (F16) and bfloat16 (BF16) conversions.
//
// Scalar references (*_ref) are plain bit manipulation; the bulk functions
// are Highway SIMD with runtime dispatch (F16C where available) and give the
// same bits as the references. float -> half rounds to nearest, ties to even;
// NaN stays NaN (quiet), overflow goes to infinity.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvq {

uint16_t f32_to_f16_ref(float f);
float f16_to_f32_ref(uint16_t h);
uint16_t f32_to_bf16_ref(float f);
float bf16_to_f32_ref(uint16_t b);

// Bulk conversions; spans must have equal sizes (asserted).
void f32_to_f16(std::span<const float> in, std::span<uint16_t> out);
void f16_to_f32(std::span<const uint16_t> in, std::span<float> out);
void f32_to_bf16(std::span<const float> in, std::span<uint16_t> out);
void bf16_to_f32(std::span<const uint16_t> in, std::span<float> out);

}  // namespace kvq
