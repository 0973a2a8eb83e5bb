// F16 / BF16 conversions: scalar references and Highway bulk kernels.
#include "kvq/half.h"

#include <bit>
#include <cmath>

#include "kvq/error.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/base/half.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Targets with hardware F16 conversions (F16C on x86 from AVX2). Highway
// 1.0's emulation on the others saturates overflow to 65504 and drops NaNs,
// so those targets use the scalar reference instead.
#undef KVQ_NATIVE_F16
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128 || (HWY_ARCH_X86 && HWY_TARGET > HWY_AVX2)
#define KVQ_NATIVE_F16 0
#else
#define KVQ_NATIVE_F16 1
#endif

void F32ToF16(const float* HWY_RESTRICT in, uint16_t* HWY_RESTRICT out, size_t n) {
#if !KVQ_NATIVE_F16
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_f16_ref(in[i]);
  return;
#endif
  const hn::ScalableTag<float> d;
  const hn::Rebind<hwy::float16_t, decltype(d)> dh;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::DemoteTo(dh, hn::LoadU(d, in + i)), dh,
               reinterpret_cast<hwy::float16_t*>(out + i));
  }
  for (; i < n; ++i) out[i] = f32_to_f16_ref(in[i]);
}

void F16ToF32(const uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT out, size_t n) {
#if !KVQ_NATIVE_F16
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32_ref(in[i]);
  return;
#endif
  size_t i = 0;
  // Whole vectors, then 8 and 4 lanes (short rows, e.g. one head of 8, take
  // no scalar calls), then the rest one by one.
  const auto run = [&](auto d) {
    const hn::Rebind<hwy::float16_t, decltype(d)> dh;
    const size_t N = hn::Lanes(d);
    for (; i + N <= n; i += N) {
      hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(in + i))), d, out + i);
    }
  };
  run(hn::ScalableTag<float>());
  run(hn::CappedTag<float, 8>());
  run(hn::CappedTag<float, 4>());
  for (; i < n; ++i) out[i] = f16_to_f32_ref(in[i]);
}

// Round to nearest even on the upper 16 bits; NaN is quietened.
void F32ToBF16(const float* HWY_RESTRICT in, uint16_t* HWY_RESTRICT out, size_t n) {
  const hn::ScalableTag<int32_t> di;
  const hn::Rebind<uint16_t, decltype(di)> du16;
  const size_t N = hn::Lanes(di);
  const auto k7fff = hn::Set(di, 0x7FFF);
  const auto kOne = hn::Set(di, 1);
  const auto kAbs = hn::Set(di, 0x7FFFFFFF);
  const auto kInf = hn::Set(di, 0x7F800000);
  const auto kQuiet = hn::Set(di, 0x40);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto bits = hn::LoadU(di, reinterpret_cast<const int32_t*>(in + i));
    const auto lsb = hn::And(hn::ShiftRight<16>(bits), kOne);  // arithmetic shift ok: masked
    const auto rounded = hn::Add(bits, hn::Add(k7fff, lsb));
    // Logical shift of a possibly negative int32: mask off the sign fill.
    auto hi = hn::And(hn::ShiftRight<16>(rounded), hn::Set(di, 0xFFFF));
    const auto nan_hi = hn::Or(hn::And(hn::ShiftRight<16>(bits), hn::Set(di, 0xFFFF)), kQuiet);
    const auto is_nan = hn::Gt(hn::And(bits, kAbs), kInf);
    hi = hn::IfThenElse(is_nan, nan_hi, hi);
    hn::StoreU(hn::DemoteTo(du16, hi), du16, out + i);
  }
  for (; i < n; ++i) out[i] = f32_to_bf16_ref(in[i]);
}

void BF16ToF32(const uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT out, size_t n) {
  const hn::ScalableTag<uint32_t> du;
  const hn::ScalableTag<float> d;
  const hn::Rebind<uint16_t, decltype(du)> du16;
  const size_t N = hn::Lanes(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto w = hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(du16, in + i)));
    hn::StoreU(hn::BitCast(d, w), d, out + i);
  }
  for (; i < n; ++i) out[i] = bf16_to_f32_ref(in[i]);
}

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq {

uint16_t f32_to_f16_ref(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t x = bits & 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((x >> 13) & 0x3FFu);
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (x >= 0x38800000u) {                        // >= 2^-14: normal half
    uint32_t r = x + 0xFFFu + ((x >> 13) & 1u);
    r -= 112u << 23;  // rebias 127 -> 15
    return sign | static_cast<uint16_t>(r >> 13);
  }
  // Subnormal half: units of 2^-24, rounded to nearest even. The product is
  // exact (power-of-two scaling of a value >= 2^-149 stays normal).
  const float units = std::bit_cast<float>(x) * 16777216.0f;
  return sign | static_cast<uint16_t>(std::nearbyint(units));
}

uint16_t f32_to_bf16_ref(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

float bf16_to_f32_ref(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

HWY_EXPORT(F32ToF16);
HWY_EXPORT(F16ToF32);
HWY_EXPORT(F32ToBF16);
HWY_EXPORT(BF16ToF32);

void f32_to_f16(std::span<const float> in, std::span<uint16_t> out) {
  KVQ_ASSERT(in.size() == out.size());
  HWY_DYNAMIC_DISPATCH(F32ToF16)(in.data(), out.data(), in.size());
}
void f16_to_f32(std::span<const uint16_t> in, std::span<float> out) {
  KVQ_ASSERT(in.size() == out.size());
  HWY_DYNAMIC_DISPATCH(F16ToF32)(in.data(), out.data(), in.size());
}
void f32_to_bf16(std::span<const float> in, std::span<uint16_t> out) {
  KVQ_ASSERT(in.size() == out.size());
  HWY_DYNAMIC_DISPATCH(F32ToBF16)(in.data(), out.data(), in.size());
}
void bf16_to_f32(std::span<const uint16_t> in, std::span<float> out) {
  KVQ_ASSERT(in.size() == out.size());
  HWY_DYNAMIC_DISPATCH(BF16ToF32)(in.data(), out.data(), in.size());
}

}  // namespace kvq
#endif  // HWY_ONCE
