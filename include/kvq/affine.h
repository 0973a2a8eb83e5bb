// I2 part 1 — the seed note's affine KV quantizer (SPEC §2), bit-exact.
//
// int8: scale = max|x| / 127 (float32), code = clamp(round_half_even(x /
//   scale), -127, 127) with a true IEEE division, dequant code * scale.
//   When max|x| / 127 is 0 (all-zero input, or max|x| < 63.5 * 2^-149) the
//   stored scale is 0.0f, every code is 0, and dequantisation returns zeros.
// fp8:  codes = E4M3FN cast of x (saturating), stored scale 1.0.
//
// Inputs are F32, F16 or BF16 of any rank >= 1; NaN/Inf is a kvq::Error that
// names the first bad flat index. Kernels are Highway SIMD (one dispatch per
// tensor) with OpenMP over large tensors; codes equal the scalar reference.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kvq/tensor.h"

namespace kvq {

// Append-only values.
enum class QuantMode : uint8_t { Int8 = 0, Fp8 = 1 };

const char* quant_mode_name(QuantMode m);
// Parses "int8" / "fp8"; throws kvq::Error naming `arg` otherwise.
QuantMode parse_quant_mode(const std::string& s, const char* arg = "mode");

struct AffineQuantized {
  Tensor codes;  // I8 (Int8) or F8_E4M3 (Fp8); its shape is the input's
  float scale = 0.0f;
  QuantMode mode = QuantMode::Int8;

  const Shape& shape() const { return codes.shape(); }
  // Bytes stored: codes plus the float32 scale.
  size_t size_bytes() const { return codes.nbytes() + sizeof(float); }
};

AffineQuantized quantize_kv_cache(const TensorView& x,
                                  QuantMode mode = QuantMode::Int8);
Tensor dequantize_kv_cache(const AffineQuantized& q);
// In-place forms for callers that own their buffers: `out.codes` (or `out`)
// is reused when it already has the right shape and dtype, else reallocated.
// On error `out` is reset to an empty value, never left half-written.
void quantize_kv_cache_into(const TensorView& x, QuantMode mode, AffineQuantized& out);
void dequantize_kv_cache_into(const AffineQuantized& q, Tensor& out);
// Mean absolute round-trip error of each leading-axis row: shape (x.dim(0),).
Tensor quantization_error_per_token(const TensorView& x,
                                    QuantMode mode = QuantMode::Int8);

// ---- kernels on raw spans (no validation; never throw) --------------------

// max |x| over finite data, or +inf/NaN bits if any element is non-finite.
// Returns the largest |x| bit pattern as float (so NaN/Inf propagate).
float max_abs(std::span<const float> x);
// Scale of the int8 rule for a given max|x|.
inline float int8_scale(float max_abs_value) { return max_abs_value / 127.0f; }
// codes[i] = clamp(rne(x[i] / scale), -127, 127); all zero when scale == 0.
void quantize_int8(std::span<const float> x, float scale, std::span<int8_t> codes);
void dequantize_int8(std::span<const int8_t> codes, float scale, std::span<float> out);

// Scalar references of the above.
float max_abs_ref(std::span<const float> x);
void quantize_int8_ref(std::span<const float> x, float scale, std::span<int8_t> codes);
void dequantize_int8_ref(std::span<const int8_t> codes, float scale, std::span<float> out);

// Index of the first non-finite element, or -1.
int64_t first_non_finite(std::span<const float> x);

}  // namespace kvq
