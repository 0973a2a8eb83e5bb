// ggml-compatible block formats q8_0 and q4_0 (blocks of 32 values).
//
// Byte layout (little-endian, identical to ggml's block_q8_0 / block_q4_0):
//   BlockQ8_0 (34 bytes): uint16 d (IEEE fp16 scale) | int8 qs[32]
//                         value[j] = qs[j] * d
//   BlockQ4_0 (18 bytes): uint16 d (IEEE fp16 scale) | uint8 qs[16]
//                         low nibble of qs[j] -> value[j], high nibble ->
//                         value[j + 16]; value = (nibble - 8) * d
// Quantization follows ggml's reference rounding:
//   q8_0: d = amax / 127, q = roundf(x / d) (ties away from zero; x * (1/d))
//   q4_0: max = the signed value of largest |x| (first on ties), d = max / -8,
//         q = min(15, (int8)(x * (1/d) + 8.5))
// Quantization uses the float32 d; the stored d is its fp16 rounding, which
// dequantization uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvq::ggml {

inline constexpr int kBlock = 32;

struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kBlock];
};
static_assert(sizeof(BlockQ8_0) == 34, "block_q8_0 is 2 + 32 bytes");

struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kBlock / 2];
};
static_assert(sizeof(BlockQ4_0) == 18, "block_q4_0 is 2 + 16 bytes");

// x.size() must be a multiple of 32 and blocks.size() == x.size() / 32
// (asserted; the public scheme API validates first).
void quantize_row_q8_0(std::span<const float> x, std::span<BlockQ8_0> blocks);
void dequantize_row_q8_0(std::span<const BlockQ8_0> blocks, std::span<float> x);
void quantize_row_q4_0(std::span<const float> x, std::span<BlockQ4_0> blocks);
void dequantize_row_q4_0(std::span<const BlockQ4_0> blocks, std::span<float> x);

}  // namespace kvq::ggml
