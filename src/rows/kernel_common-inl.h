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

template <class D>
HWY_INLINE hn::Vec<D> HalvesToFloat(D d, hn::Vec<hn::Rebind<uint16_t, D>> h16) {
  const hn::Rebind<hwy::float16_t, D> dh;
  return hn::PromoteTo(d, hn::BitCast(dh, h16));
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
