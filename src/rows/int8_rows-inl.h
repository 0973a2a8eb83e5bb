// Attention kernel traits of int8 and int8-head (codecs: int8_rows.cc):
// int8 codes times the row's (or the head's) f32 scale; tile codes kInt8.

// Per-target include guard (Highway idiom).
#if defined(KVQ_SRC_SCHEMES_INT8_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVQ_SRC_SCHEMES_INT8_ROWS_INL_H_
#undef KVQ_SRC_SCHEMES_INT8_ROWS_INL_H_
#else
#define KVQ_SRC_SCHEMES_INT8_ROWS_INL_H_
#endif

#include "src/rows/kernel_common-inl.h"
#include "src/rows/scale_io.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {

struct Int8Kernel : RowKernelBase {
  static constexpr KvScheme kId = KvScheme::Int8;
  static constexpr schemes::TileCodes kTile = schemes::TileCodes::kInt8;
  static constexpr bool kRowScales = true;
  static HWY_INLINE float RowScale(const uint8_t* header, int) { return schemes::GetF32(header); }
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const uint8_t* row, size_t x) {
    const hn::RebindToSigned<D> di;
    const hn::Rebind<int8_t, D> d8;
    return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, reinterpret_cast<const int8_t*>(row) + x)));
  }
};

struct Int8HeadKernel : Int8Kernel {
  static constexpr KvScheme kId = KvScheme::Int8Head;
  static HWY_INLINE float RowScale(const uint8_t* header, int g) { return schemes::GetF32(header + 4 * g); }
};

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
