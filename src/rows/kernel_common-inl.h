// Per-target helpers of the row schemes' attention kernel traits
// (<family>_rows-inl.h; the traits are described in kernels-inl.h).

// Per-target include guard (Highway idiom).
#if defined(KVQ_SRC_SCHEMES_KERNEL_COMMON_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVQ_SRC_SCHEMES_KERNEL_COMMON_INL_H_
#undef KVQ_SRC_SCHEMES_KERNEL_COMMON_INL_H_
#else
#define KVQ_SRC_SCHEMES_KERNEL_COMMON_INL_H_
#endif

#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "kvq/half.h"
#include "src/rows/row_scheme.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
constexpr bool kF16C = true;  // hardware half <-> float (vcvtph2ps)
#else
constexpr bool kF16C = false;
#endif

// Finite codes c (in 32-bit lanes) of a kBits-bit float format with kMant
// mantissa bits and exponent bias kBias (fp16: 16, 10, 15; fp8 E4M3: 8, 3,
// 7; E5M2: 8, 2, 15): the exponent and mantissa bits placed under a float's,
// scaled by 2^(127 - kBias), and the sign moved to bit 31. Exact for every
// finite code: subnormal codes become float subnormals, scaled into normals.
// Seven operations where a full decoder also selects infinities and NaNs.
template <int kBits, int kMant, int kBias, class D>
HWY_INLINE hn::Vec<D> RebiasMinifloat(D d, hn::Vec<hn::RebindToSigned<D>> c) {
  const hn::RebindToSigned<D> di;
  constexpr int32_t kSign = 1 << (kBits - 1);
  constexpr float kRebias = [] {
    float r = 1.0f;
    for (int i = 0; i < 127 - kBias; ++i) r *= 2.0f;
    return r;
  }();
  const auto mag = hn::BitCast(d, hn::ShiftLeft<23 - kMant>(hn::And(c, hn::Set(di, kSign - 1))));
  const auto scaled = hn::Mul(mag, hn::Set(d, kRebias));
  return hn::Or(scaled, hn::BitCast(d, hn::ShiftLeft<32 - kBits>(hn::And(c, hn::Set(di, kSign)))));
}

// Halves (their bits in 16-bit lanes) to float: one conversion instruction
// with F16C (x86 from AVX2) and on ARM (NEON fcvtl, SVE fcvt); elsewhere
// (SSE4, SSSE3, EMU128, SCALAR) RebiasMinifloat, exact for every finite
// half (block scales and fp16 rows are).
template <class D>
HWY_INLINE hn::Vec<D> HalvesToFloat(D d, hn::Vec<hn::Rebind<uint16_t, D>> h16) {
#if (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2) || HWY_ARCH_ARM
  const hn::Rebind<hwy::float16_t, D> dh;
  return hn::PromoteTo(d, hn::BitCast(dh, h16));
#else
  const hn::RebindToSigned<D> di;
  return RebiasMinifloat<16, 10, 15>(d, hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<D>(), h16)));
#endif
}

// One half's value, as HalvesToFloat gives it (inline: no call per block).
HWY_INLINE float HalfToFloat(uint16_t h) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  return _cvtsh_ss(h);
#else
  const hn::CappedTag<float, 1> d1;
  return hn::GetLane(HalvesToFloat(d1, hn::Set(hn::Rebind<uint16_t, decltype(d1)>(), h)));
#endif
}

// The defaults of a scheme's kernel traits: no tiles, no row scales.
struct RowKernelBase {
  static constexpr schemes::TileCodes kTile = schemes::TileCodes::kNone;
  static constexpr bool kRowScales = false;  // f32 scales in the row header
  static constexpr float kFold = 1.0f;       // constant folded into every score / weight
  static HWY_INLINE float RowScale(const uint8_t*, int) { return 1.0f; }
};

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
