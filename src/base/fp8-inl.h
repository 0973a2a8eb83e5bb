// Per-target fp8 (OCP E4M3FN / E5M2) vector codecs, shared by the bulk fp8
// functions, the affine quantizer and the attention kernels.
//
// Encoding works on int32 lanes holding float bits: the normal path rounds the
// mantissa to nearest-even with the add-half-minus-one-plus-lsb trick and
// re-biases the exponent; the subnormal path scales |x| by a power of two
// (exact) and rounds to an integer number of subnormal steps. Both are
// branch-free and match the scalar encoder bit for bit.

// Per-target include guard (Highway idiom).
#if defined(KVQ_SRC_FP8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVQ_SRC_FP8_INL_H_
#undef KVQ_SRC_FP8_INL_H_
#else
#define KVQ_SRC_FP8_INL_H_
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Format constants. kInfCode is the magnitude code of infinity (E5M2) or -1
// when the format has none (E4M3FN); magnitudes above kNanAbove are NaN.
struct E4M3Fmt {
  static constexpr int kMant = 3;
  static constexpr int kBias = 7;
  static constexpr int32_t kMaxCode = 0x7E;        // 448
  static constexpr int32_t kNoSatOverflow = 0x7F;  // NaN
  static constexpr int32_t kInfCode = -1;
  static constexpr int32_t kNanAbove = 0x7E;
  static constexpr float kSubScale = 512.0f;            // 2^9 = 1 / smallest subnormal
  static constexpr float kSubStep = 1.0f / 512.0f;      // 2^-9
};
struct E5M2Fmt {
  static constexpr int kMant = 2;
  static constexpr int kBias = 15;
  static constexpr int32_t kMaxCode = 0x7B;        // 57344
  static constexpr int32_t kNoSatOverflow = 0x7C;  // inf
  static constexpr int32_t kInfCode = 0x7C;
  static constexpr int32_t kNanAbove = 0x7C;
  static constexpr float kSubScale = 65536.0f;          // 2^16
  static constexpr float kSubStep = 1.0f / 65536.0f;    // 2^-16
};

// float lanes -> fp8 codes in int32 lanes (0..255).
template <class Fmt, class D>
HWY_INLINE hn::Vec<hn::RebindToSigned<D>> EncodeFp8(D d, hn::Vec<D> v, bool saturate) {
  const hn::RebindToSigned<D> di;
  constexpr int kShift = 23 - Fmt::kMant;
  const auto bits = hn::BitCast(di, v);
  const auto abs = hn::And(bits, hn::Set(di, 0x7FFFFFFF));
  const auto sign8 = hn::And(hn::ShiftRight<24>(bits), hn::Set(di, 0x80));
  // Clamp inf/NaN to FLT_MAX bits so the rounding add cannot overflow.
  const auto fin = hn::Min(abs, hn::Set(di, 0x7F7FFFFF));
  const auto lsb = hn::And(hn::ShiftRight<kShift>(fin), hn::Set(di, 1));
  const auto rounded = hn::Add(fin, hn::Add(hn::Set(di, (1 << (kShift - 1)) - 1), lsb));
  const auto normal =
      hn::Sub(hn::ShiftRight<kShift>(rounded), hn::Set(di, (127 - Fmt::kBias) << Fmt::kMant));
  const auto sub = hn::ConvertTo(di, hn::Round(hn::Mul(hn::BitCast(d, fin), hn::Set(d, Fmt::kSubScale))));
  const auto min_normal_bits = hn::Set(di, (128 - Fmt::kBias) << 23);
  auto code = hn::IfThenElse(hn::Lt(fin, min_normal_bits), sub, normal);
  const auto max_code = hn::Set(di, Fmt::kMaxCode);
  if (saturate) {
    code = hn::Min(code, max_code);
  } else {
    code = hn::IfThenElse(hn::Gt(code, max_code), hn::Set(di, Fmt::kNoSatOverflow), code);
  }
  code = hn::IfThenElse(hn::Gt(abs, hn::Set(di, 0x7F800000)), hn::Set(di, 0x7F), code);
  return hn::Or(code, sign8);
}

// fp8 codes in int32 lanes (0..255) -> float lanes.
template <class Fmt, class D>
HWY_INLINE hn::Vec<D> DecodeFp8(D d, hn::Vec<hn::RebindToSigned<D>> c) {
  const hn::RebindToSigned<D> di;
  const auto mag = hn::And(c, hn::Set(di, 0x7F));
  const auto mant = hn::And(mag, hn::Set(di, (1 << Fmt::kMant) - 1));
  const auto normal = hn::BitCast(
      d, hn::Add(hn::ShiftLeft<23 - Fmt::kMant>(mag), hn::Set(di, (127 - Fmt::kBias) << 23)));
  const auto sub = hn::Mul(hn::ConvertTo(d, mant), hn::Set(d, Fmt::kSubStep));
  const auto is_sub = hn::Lt(mag, hn::Set(di, 1 << Fmt::kMant));
  auto bits = hn::BitCast(di, hn::IfThenElse(hn::RebindMask(d, is_sub), sub, normal));
  if (Fmt::kInfCode >= 0) {
    bits = hn::IfThenElse(hn::Eq(mag, hn::Set(di, Fmt::kInfCode)), hn::Set(di, 0x7F800000), bits);
  }
  bits = hn::IfThenElse(hn::Gt(mag, hn::Set(di, Fmt::kNanAbove)), hn::Set(di, 0x7FC00000), bits);
  bits = hn::Or(bits, hn::ShiftLeft<24>(hn::And(c, hn::Set(di, 0x80))));
  return hn::BitCast(d, bits);
}

// Bulk encode of n floats; the tail goes through a padded vector so every
// element takes the same code path.
template <class Fmt>
HWY_INLINE void EncodeFp8Loop(const float* HWY_RESTRICT in, uint8_t* HWY_RESTRICT out,
                              size_t n, bool saturate) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(d)> d8;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::DemoteTo(d8, EncodeFp8<Fmt>(d, hn::LoadU(d, in + i), saturate)), d8, out + i);
  }
  if (i < n) {
    HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)] = {};
    HWY_ALIGN uint8_t obuf[HWY_MAX_BYTES / sizeof(float)] = {};
    std::memcpy(buf, in + i, (n - i) * sizeof(float));
    hn::Store(hn::DemoteTo(d8, EncodeFp8<Fmt>(d, hn::Load(d, buf), saturate)), d8, obuf);
    std::memcpy(out + i, obuf, n - i);
  }
  (void)di;
}

template <class Fmt>
HWY_INLINE void DecodeFp8Loop(const uint8_t* HWY_RESTRICT in, float* HWY_RESTRICT out, size_t n) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(d)> d8;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(DecodeFp8<Fmt>(d, hn::PromoteTo(di, hn::LoadU(d8, in + i))), d, out + i);
  }
  if (i < n) {
    HWY_ALIGN uint8_t buf[HWY_MAX_BYTES / sizeof(float)] = {};
    HWY_ALIGN float obuf[HWY_MAX_BYTES / sizeof(float)] = {};
    std::memcpy(buf, in + i, n - i);
    hn::Store(DecodeFp8<Fmt>(d, hn::PromoteTo(di, hn::Load(d8, buf))), d, obuf);
    std::memcpy(out + i, obuf, (n - i) * sizeof(float));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#endif  // KVQ_SRC_FP8_INL_H_ per-target guard
