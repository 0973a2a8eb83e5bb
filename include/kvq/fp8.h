// OCP 8-bit floating point (OFP8) codecs: E4M3FN and E5M2.
//
// E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits. No infinities; the
//   only NaN codes are S.1111.111 (0x7F, 0xFF). Max finite 448 (0x7E).
//   Smallest subnormal 2^-9.
// E5M2:   1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like, with
//   ±inf (0x7C, 0xFC) and NaNs (exponent 11111, mantissa != 0). Max finite
//   57344 (0x7B). Smallest subnormal 2^-16.
//
// Encoding rounds to nearest, ties to even, subnormals exact. Overflow
// policy:
//   Saturate   — finite overflow and ±inf go to ±max (as __NV_SATFINITE).
//   NoSaturate — overflow gives NaN (E4M3) or ±inf (E5M2), as __NV_NOSAT.
// NaN input always gives NaN: 0x7F|sign for both formats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvq::fp8 {

enum class Overflow : uint8_t { Saturate = 0, NoSaturate = 1 };

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

uint8_t encode_e4m3(float x, Overflow overflow = Overflow::Saturate);
float decode_e4m3(uint8_t code);
uint8_t encode_e5m2(float x, Overflow overflow = Overflow::Saturate);
float decode_e5m2(uint8_t code);

// Bulk versions (Highway SIMD, runtime dispatch); bit-identical to the
// scalar functions on every target. Spans must have equal sizes (asserted).
void encode_e4m3(std::span<const float> in, std::span<uint8_t> out,
                 Overflow overflow = Overflow::Saturate);
void decode_e4m3(std::span<const uint8_t> in, std::span<float> out);
void encode_e5m2(std::span<const float> in, std::span<uint8_t> out,
                 Overflow overflow = Overflow::Saturate);
void decode_e5m2(std::span<const uint8_t> in, std::span<float> out);

}  // namespace kvq::fp8
