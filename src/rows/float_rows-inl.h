// Attention kernel traits of fp32, fp16, bf16 (codecs: float_rows.cc).

// Per-target include guard (Highway idiom).
#if defined(KVQ_SRC_SCHEMES_FLOAT_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVQ_SRC_SCHEMES_FLOAT_ROWS_INL_H_
#undef KVQ_SRC_SCHEMES_FLOAT_ROWS_INL_H_
#else
#define KVQ_SRC_SCHEMES_FLOAT_ROWS_INL_H_
#endif

#include "src/rows/kernel_common-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {

struct Fp32Kernel : RowKernelBase {
  static constexpr KvScheme kId = KvScheme::Fp32;
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const uint8_t* row, size_t x) {
    return hn::LoadU(d, reinterpret_cast<const float*>(row) + x);
  }
};

struct Fp16Kernel : RowKernelBase {
  static constexpr KvScheme kId = KvScheme::Fp16;
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const uint8_t* row, size_t x) {
    return HalvesToFloat(d, hn::LoadU(hn::Rebind<uint16_t, D>(), reinterpret_cast<const uint16_t*>(row) + x));
  }
};

struct Bf16Kernel : RowKernelBase {
  static constexpr KvScheme kId = KvScheme::Bf16;
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const uint8_t* row, size_t x) {
    const hn::RebindToSigned<D> di;
    const hn::Rebind<uint16_t, D> du16;
    const auto h = hn::PromoteTo(di, hn::LoadU(du16, reinterpret_cast<const uint16_t*>(row) + x));
    return hn::BitCast(d, hn::ShiftLeft<16>(h));
  }
};

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
