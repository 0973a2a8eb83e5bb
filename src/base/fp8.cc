// fp8 codecs: scalar functions and the dispatched bulk kernels.
#include "kvq/fp8.h"

#include <bit>
#include <cmath>

#include "kvq/error.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/base/fp8.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "src/base/fp8-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {

void EncodeE4M3(const float* in, uint8_t* out, size_t n, bool saturate) {
  EncodeFp8Loop<E4M3Fmt>(in, out, n, saturate);
}
void EncodeE5M2(const float* in, uint8_t* out, size_t n, bool saturate) {
  EncodeFp8Loop<E5M2Fmt>(in, out, n, saturate);
}
void DecodeE4M3(const uint8_t* in, float* out, size_t n) { DecodeFp8Loop<E4M3Fmt>(in, out, n); }
void DecodeE5M2(const uint8_t* in, float* out, size_t n) { DecodeFp8Loop<E5M2Fmt>(in, out, n); }

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq::fp8 {
namespace {

// Scalar encoder shared by both formats: kMant mantissa bits, kBias bias.
template <int kMant, int kBias, uint32_t kMaxCode, uint32_t kNoSatOverflow>
uint8_t EncodeScalar(float x, Overflow overflow) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign8 = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint8_t>(0x7Fu | sign8);  // NaN
  uint32_t code;
  if (abs >= 0x7F800000u) {
    code = 0xFFFFu;  // inf: overflow in either policy
  } else if (abs < static_cast<uint32_t>(128 - kBias) << 23) {
    // Subnormal target: count steps of 2^(1 - kBias - kMant); exact scaling.
    const float steps = std::bit_cast<float>(abs) * std::ldexp(1.0f, kBias - 1 + kMant);
    code = static_cast<uint32_t>(std::nearbyint(steps));
  } else {
    constexpr int kShift = 23 - kMant;
    const uint32_t rounded = abs + ((1u << (kShift - 1)) - 1u) + ((abs >> kShift) & 1u);
    code = (rounded >> kShift) - (static_cast<uint32_t>(127 - kBias) << kMant);
  }
  if (code > kMaxCode) code = overflow == Overflow::Saturate ? kMaxCode : kNoSatOverflow;
  return static_cast<uint8_t>(code | sign8);
}

}  // namespace

uint8_t encode_e4m3(float x, Overflow overflow) {
  return EncodeScalar<3, 7, 0x7E, 0x7F>(x, overflow);
}
uint8_t encode_e5m2(float x, Overflow overflow) {
  return EncodeScalar<2, 15, 0x7B, 0x7C>(x, overflow);
}

float decode_e4m3(uint8_t code) {
  const bool neg = code & 0x80;
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  float v;
  if (e == 0xF && m == 0x7) {
    return std::bit_cast<float>(0x7FC00000u | (neg ? 0x80000000u : 0u));
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -9);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
  }
  return neg ? -v : v;
}

float decode_e5m2(uint8_t code) {
  const bool neg = code & 0x80;
  const int e = (code >> 2) & 0x1F;
  const int m = code & 0x3;
  float v;
  if (e == 0x1F) {
    if (m != 0) return std::bit_cast<float>(0x7FC00000u | (neg ? 0x80000000u : 0u));
    v = INFINITY;
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -16);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(m) / 4.0f, e - 15);
  }
  return neg ? -v : v;
}

HWY_EXPORT(EncodeE4M3);
HWY_EXPORT(EncodeE5M2);
HWY_EXPORT(DecodeE4M3);
HWY_EXPORT(DecodeE5M2);

void encode_e4m3(std::span<const float> in, std::span<uint8_t> out, Overflow overflow) {
  KVQ_ASSERT(in.size() == out.size());
  HWY_DYNAMIC_DISPATCH(EncodeE4M3)(in.data(), out.data(), in.size(), overflow == Overflow::Saturate);
}
void encode_e5m2(std::span<const float> in, std::span<uint8_t> out, Overflow overflow) {
  KVQ_ASSERT(in.size() == out.size());
  HWY_DYNAMIC_DISPATCH(EncodeE5M2)(in.data(), out.data(), in.size(), overflow == Overflow::Saturate);
}
void decode_e4m3(std::span<const uint8_t> in, std::span<float> out) {
  KVQ_ASSERT(in.size() == out.size());
  HWY_DYNAMIC_DISPATCH(DecodeE4M3)(in.data(), out.data(), in.size());
}
void decode_e5m2(std::span<const uint8_t> in, std::span<float> out) {
  KVQ_ASSERT(in.size() == out.size());
  HWY_DYNAMIC_DISPATCH(DecodeE5M2)(in.data(), out.data(), in.size());
}

}  // namespace kvq::fp8
#endif  // HWY_ONCE
