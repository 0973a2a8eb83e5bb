// Attention kernel traits of q8_0 and q4_0 (codecs: ggml_rows.cc): ggml's
// blocks of 32 values with an fp16 scale; tile codes kQ8 / kQ4. The block
// helpers here are also read by attention.cc's tile paths.

// Per-target include guard (Highway idiom).
#if defined(KVQ_SRC_SCHEMES_GGML_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVQ_SRC_SCHEMES_GGML_ROWS_INL_H_
#undef KVQ_SRC_SCHEMES_GGML_ROWS_INL_H_
#else
#define KVQ_SRC_SCHEMES_GGML_ROWS_INL_H_
#endif

#include "kvq/ggml_quants.h"
#include "src/rows/kernel_common-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {

HWY_INLINE float BlockScale(const uint8_t* blk) {
  uint16_t h;
  std::memcpy(&h, blk, 2);
  return HalfToFloat(h);
}

// Float values of the nibbles c in bits [3:0] of each 32-bit lane of idx (the
// bits above are ignored): tbl[c], where tbl holds fn(0..15). On 16-lane x86
// targets that is one vpermps from the table (it reads only those bits);
// elsewhere fn of the masked, converted nibbles, which gives the same values.
template <class D, class VI, class Fn>
HWY_INLINE hn::Vec<D> Nibbles(D d, VI idx, hn::Vec<D> tbl, const Fn& fn) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (hn::MaxLanes(D()) == 16) return hn::Vec<D>{_mm512_permutexvar_ps(idx.raw, tbl.raw)};
#endif
  (void)tbl;
  const hn::RebindToSigned<D> di;
  return fn(hn::ConvertTo(d, hn::And(hn::BitCast(di, idx), hn::Set(di, 0x0F))));
}

// BlockScale in every lane: a 16-bit broadcast and one vector conversion,
// with no scalar round trip.
template <class D>
HWY_INLINE hn::Vec<D> BlockScaleVec(D d, const uint8_t* blk) {
  uint16_t h;
  std::memcpy(&h, blk, 2);
  return HalvesToFloat(d, hn::Set(hn::Rebind<uint16_t, D>(), h));
}

// q4_0 values d (c - 8) of the nibbles in bits [3:0] of each 32-bit lane
// of idx, for a block scale d in every lane: each rounded once, as c d - 8 d
// is (Nibbles: a 16-entry table on 16-lane x86 targets).
template <class D, class VI>
HWY_INLINE hn::Vec<D> Q4Values(D d, VI idx, hn::Vec<D> vdb) {
  const auto value = [&](hn::Vec<D> c) { return hn::MulAdd(c, vdb, hn::Mul(vdb, hn::Set(d, -8.0f))); };
  return Nibbles(d, idx, hn::Mul(vdb, hn::Iota(d, -8.0f)), value);
}

// Load: values of payload elements [x, x + Lanes(d)) (x a multiple of
// Lanes(d), which divides 16, so a vector never straddles a block or a q4_0
// half-block). LoadBlock: a whole block (32 values, kC = 32 / N vectors)
// with its scale decoded once, used when heads are block-aligned.
struct Q8_0Kernel : RowKernelBase {
  static constexpr KvScheme kId = KvScheme::Q8_0;
  static constexpr schemes::TileCodes kTile = schemes::TileCodes::kQ8;
  static constexpr size_t kBlockBytes = sizeof(ggml::BlockQ8_0);
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const uint8_t* row, size_t x) {
    const hn::RebindToSigned<D> di;
    const hn::Rebind<int8_t, D> d8;
    const uint8_t* blk = row + kBlockBytes * (x / ggml::kBlock);
    const auto c = hn::LoadU(d8, reinterpret_cast<const int8_t*>(blk + 2) + x % ggml::kBlock);
    return hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, c)), hn::Set(d, BlockScale(blk)));
  }
  template <class D, size_t kC>
  static HWY_INLINE void LoadBlock(D d, const uint8_t* blk, hn::Vec<D> (&v)[kC]) {
    constexpr size_t N = hn::MaxLanes(D());
    const hn::RebindToSigned<D> di;
    const hn::Rebind<int8_t, D> d8;
    const auto vdb = BlockScaleVec(d, blk);
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    for (size_t c = 0; c < kC; ++c) {
      v[c] = hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, qs + c * N))), vdb);
    }
  }
};

struct Q4_0Kernel : RowKernelBase {
  static constexpr KvScheme kId = KvScheme::Q4_0;
  static constexpr schemes::TileCodes kTile = schemes::TileCodes::kQ4;
  static constexpr size_t kBlockBytes = sizeof(ggml::BlockQ4_0);
  template <class D>
  static HWY_INLINE hn::Vec<D> Load(D d, const uint8_t* row, size_t x) {
    const hn::RebindToSigned<D> di;
    const hn::Rebind<uint8_t, D> du8;
    const uint8_t* blk = row + kBlockBytes * (x / ggml::kBlock);
    const size_t o = x % ggml::kBlock;
    const auto bytes = hn::LoadU(du8, blk + 2 + (o & 15));
    const auto nib = o < 16 ? hn::And(bytes, hn::Set(du8, 0x0F)) : hn::ShiftRight<4>(bytes);
    const float db = BlockScale(blk);
    return hn::MulAdd(hn::ConvertTo(d, hn::PromoteTo(di, nib)), hn::Set(d, db), hn::Set(d, -8.0f * db));
  }
  template <class D, size_t kC>
  static HWY_INLINE void LoadBlock(D d, const uint8_t* blk, hn::Vec<D> (&v)[kC]) {
    constexpr size_t N = hn::MaxLanes(D());
    const hn::RebindToSigned<D> di;
    const hn::Rebind<uint8_t, D> du8;
    const auto vdb = BlockScaleVec(d, blk);
    for (size_t c = 0; c < kC / 2; ++c) {  // one load feeds a low- and a high-nibble vector
      const auto w = hn::PromoteTo(di, hn::LoadU(du8, blk + 2 + c * N));  // widen first: 32-bit shifts
      v[c] = Q4Values(d, w, vdb);
      v[c + kC / 2] = Q4Values(d, hn::ShiftRight<4>(w), vdb);
    }
  }
};

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
