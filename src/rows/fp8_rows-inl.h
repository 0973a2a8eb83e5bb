// Attention kernel traits of fp8-e4m3, fp8-e4m3-scaled, fp8-e5m2 (codecs:
// fp8_rows.cc). With F16C, E4M3 codes are widened to halves worth 2^-8 of
// their value (E5M2 codes are the top byte of a half); the 2^8 is folded
// into the row scale (kFold). Elsewhere (SSE4, ARM, SCALAR) a code's bits are
// moved under a float's and rebiased (RebiasMinifloat). Both are exact for every
// finite code (the scalar decoder is the reference; the codecs write no NaN).

// Per-target include guard (Highway idiom).
#if defined(KVQ_SRC_SCHEMES_FP8_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVQ_SRC_SCHEMES_FP8_ROWS_INL_H_
#undef KVQ_SRC_SCHEMES_FP8_ROWS_INL_H_
#else
#define KVQ_SRC_SCHEMES_FP8_ROWS_INL_H_
#endif

#include "src/rows/kernel_common-inl.h"
#include "src/rows/scale_io.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {

struct Fp8E4M3Kernel : RowKernelBase {
  static constexpr KvScheme kId = KvScheme::Fp8E4M3;
  static constexpr float kFold = kF16C ? 256.0f : 1.0f;
  static HWY_INLINE float RowScale(const uint8_t*, int) { return kFold; }
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const uint8_t* row, size_t x) {
    const hn::Rebind<uint8_t, D> du8;
    if constexpr (kF16C) {
      const hn::Rebind<uint16_t, D> du16;
      const auto b = hn::PromoteTo(du16, hn::LoadU(du8, row + x));
      return HalvesToFloat(d, hn::Or(hn::ShiftLeft<7>(hn::And(b, hn::Set(du16, 0x7F))),
                                     hn::ShiftLeft<8>(hn::And(b, hn::Set(du16, 0x80)))));
    }
    const hn::RebindToSigned<D> di;
    return RebiasMinifloat<8, 3, 7>(d, hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<D>(), hn::LoadU(du8, row + x))));
  }
};

struct Fp8E4M3ScaledKernel : Fp8E4M3Kernel {
  static constexpr KvScheme kId = KvScheme::Fp8E4M3Scaled;
  static constexpr bool kRowScales = true;
  static HWY_INLINE float RowScale(const uint8_t* header, int) { return schemes::GetF32(header) * kFold; }
};

struct Fp8E5M2Kernel : RowKernelBase {
  static constexpr KvScheme kId = KvScheme::Fp8E5M2;
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const uint8_t* row, size_t x) {
    const hn::Rebind<uint8_t, D> du8;
    if constexpr (kF16C) {
      const hn::Rebind<uint16_t, D> du16;
      return HalvesToFloat(d, hn::ShiftLeft<8>(hn::PromoteTo(du16, hn::LoadU(du8, row + x))));
    }
    const hn::RebindToSigned<D> di;
    return RebiasMinifloat<8, 2, 15>(d, hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<D>(), hn::LoadU(du8, row + x))));
  }
};

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
