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

// Halves (their bits in 16-bit lanes) to float: one conversion instruction
// with F16C (x86 from AVX2) and on ARM (NEON fcvtl, SVE fcvt); elsewhere
// (SSE4, SSSE3, EMU128, SCALAR) the bits moved into place and rebiased by
// 2^112, exact for every finite half (block scales and fp16 rows are).
template <class D>
HWY_INLINE hn::Vec<D> HalvesToFloat(D d, hn::Vec<hn::Rebind<uint16_t, D>> h16) {
#if (HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2) || HWY_ARCH_ARM
  const hn::Rebind<hwy::float16_t, D> dh;
  return hn::PromoteTo(d, hn::BitCast(dh, h16));
#else
  const hn::RebindToSigned<D> di;
  const auto h = hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<D>(), h16));
  const auto mag = hn::Mul(hn::BitCast(d, hn::ShiftLeft<13>(hn::And(h, hn::Set(di, 0x7FFF)))), hn::Set(d, 0x1p112f));
  return hn::Or(mag, hn::BitCast(d, hn::ShiftLeft<16>(hn::And(h, hn::Set(di, 0x8000)))));
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
