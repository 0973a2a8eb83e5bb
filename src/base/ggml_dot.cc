// The token pass's fused dequantise-and-dot over ggml's block types
// (kvq/ggml_weights.h: matvec_fused). Every element's value is ggml's
// reference value (the same float operations as dequantize_ggml, lane by
// lane); element j of a row is added into partial sum j mod 16, in order of
// j; the 16 sums are added in a fixed tree. Products and sums are separate
// roundings (no fused multiply-add), so every target, and the scalar
// reference, give the same bits.
//
// Highway kernels decode Q4_0, Q8_0, Q4_K, Q5_K and Q6_K in vectors of up to
// 16 floats (x86, NEON), two rows at a time; on AVX-512 a 4- or 5-bit code's
// value is a lookup in a table of its sub-block's values. The other types,
// and the scalable and scalar targets, decode a block with the reference and
// accumulate its values.
#include <algorithm>
#include <cstring>

#include "kvq/error.h"
#include "kvq/half.h"
#include "kvq/ggml_weights.h"
#include "src/base/ggml_weight_blocks.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/base/ggml_dot.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/cache_control.h"
#include "hwy/highway.h"

#ifndef KVQ_BASE_GGML_DOT_ONCE
#define KVQ_BASE_GGML_DOT_ONCE
namespace kvq::ggml::fused {

constexpr int kLanes = 16;

using blocks::Half;

// The 16 partial sums added in a fixed tree.
inline float Reduce(float* s) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) s[k] += s[k + w];
  }
  return s[0];
}

// Elements [e, e + n) of a row (e a multiple of 16), values v, into s.
inline void AccumulateRef(float* s, const float* v, const float* x, size_t n) {
  for (size_t j = 0; j < n; ++j) s[j % kLanes] += v[j] * x[j];
}

// One row through the reference: each block decoded by dequantize_ggml.
inline float DotRef(const WeightMatrix& w, size_t i, const float* x) {
  const size_t block = static_cast<size_t>(weight_block(w.type)),
               bytes = static_cast<size_t>(weight_block_bytes(w.type));
  const uint8_t* r = w.row(i);
  float s[kLanes] = {};
  float v[256];
  for (size_t j = 0; j < w.cols; j += block, r += bytes) {
    dequantize(w.type, r, block, v);
    AccumulateRef(s, v, x + j, block);
  }
  return Reduce(s);
}

}  // namespace kvq::ggml::fused
#endif

HWY_BEFORE_NAMESPACE();
namespace kvq::ggml {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_HAVE_SCALABLE || HWY_TARGET == HWY_SCALAR

void MatVecFused(const WeightMatrix& w, const float* x, size_t r0, size_t r1, float* out) {
  for (size_t i = r0; i < r1; ++i) out[i - r0] = fused::DotRef(w, i, x);
}

#else

using DF = hn::CappedTag<float, fused::kLanes>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;
constexpr size_t kN = hn::MaxLanes(DF());
constexpr size_t kK = fused::kLanes / kN;  // vectors of partial sums
static_assert(kN * kK == fused::kLanes, "16 partial sums in whole vectors");

// kR rows side by side, each with its own 16 partial sums: sum j mod 16 of
// row r lives in lane (j mod 16) mod N of v[r][(j mod 16) / N]; elements
// arrive in order, N at a time. The rows' add chains are independent, and
// everything here is inlined so that the sums stay in registers.
template <size_t kR>
struct Acc {
  VF v[kR][kK];
  HWY_INLINE Acc() {
    for (size_t r = 0; r < kR; ++r) {
      for (size_t k = 0; k < kK; ++k) v[r][k] = hn::Zero(DF());
    }
  }
  // values of row r's elements [e, e + N), xe = x[e, e + N), where e is
  // `off` past a multiple of 16. Callers pass the offset within their block
  // (a constant once their loops unroll), never e itself: with kK > 1
  // (AVX2, SSE4, NEON) an index the compiler cannot fold puts the sums in
  // memory, a load and a store on every add's chain.
  HWY_INLINE void Add(size_t r, size_t off, VF values, VF xe) {
    VF& a = v[r][(off % fused::kLanes) / kN];
    a = hn::Add(a, hn::Mul(values, xe));
  }
  HWY_INLINE float Reduce(size_t r) const {
    HWY_ALIGN float s[fused::kLanes];
    for (size_t k = 0; k < kK; ++k) hn::Store(v[r][k], DF(), s + k * kN);
    return fused::Reduce(s);
  }
};

// N bytes at p as int32 lanes.
HWY_INLINE VI Bytes(const uint8_t* p) { return hn::PromoteTo(DI(), hn::LoadU(hn::Rebind<uint8_t, DF>(), p)); }
HWY_INLINE VI SBytes(const uint8_t* p) {
  return hn::PromoteTo(DI(), hn::LoadU(hn::Rebind<int8_t, DF>(), reinterpret_cast<const int8_t*>(p)));
}
HWY_INLINE VF F(VI v) { return hn::ConvertTo(DF(), v); }
HWY_INLINE VF X(const float* x, size_t e) { return hn::LoadU(DF(), x + e); }

// With 16 lanes (AVX-512), a 4-bit code's value is one lookup in a table of
// its 16 values, each computed by the same float operations as the decode
// (so the same bits); vpermps reads only the index's low 4 bits, and
// vpermt2ps the low 5 of 32 values.
#if HWY_TARGET <= HWY_AVX3
constexpr bool kTables = true;
HWY_INLINE VF Lut16(VF table, VI idx) { return VF{_mm512_permutexvar_ps(idx.raw, table.raw)}; }
HWY_INLINE VF Lut32(VF lo, VF hi, VI idx) { return VF{_mm512_permutex2var_ps(lo.raw, idx.raw, hi.raw)}; }
#else
constexpr bool kTables = false;
#endif

// The reference decode of one block per row, then its values accumulated.
template <size_t kR>
HWY_INLINE void BlockRef(uint32_t type, const uint8_t* const* b, size_t block, size_t e, const float* x, Acc<kR>& acc) {
  HWY_ALIGN float v[kR][256];
  for (size_t r = 0; r < kR; ++r) dequantize(type, b[r], block, v[r]);
  for (size_t m = 0; m < block; m += fused::kLanes) {
    for (size_t k = 0; k < kK; ++k) {
      const VF xe = X(x, e + m + k * kN);
      for (size_t r = 0; r < kR; ++r) acc.Add(r, k * kN, hn::Load(DF(), v[r] + m + k * kN), xe);
    }
  }
}

// Q4_0: (nibble - 8) d.
template <size_t kR>
HWY_INLINE void BlockQ4_0(const uint8_t* const* b, size_t e, const float* x, Acc<kR>& acc) {
  VF d[kR];
  for (size_t r = 0; r < kR; ++r) d[r] = hn::Set(DF(), fused::Half(b[r]));
  if constexpr (kTables) {
    VF t[kR];
    const VF codes = hn::Sub(hn::Iota(DF(), 0), hn::Set(DF(), 8.0f));
    for (size_t r = 0; r < kR; ++r) t[r] = hn::Mul(codes, d[r]);
    const VF x0 = X(x, e), x1 = X(x, e + 16);
    for (size_t r = 0; r < kR; ++r) {
      const VI q = Bytes(b[r] + 2);
      acc.Add(r, 0, Lut16(t[r], q), x0);
      acc.Add(r, 16, Lut16(t[r], hn::ShiftRight<4>(q)), x1);
    }
  } else {
    const VI k15 = hn::Set(DI(), 15), k8 = hn::Set(DI(), 8);
    for (size_t m = 0; m < 16; m += kN) {
      const VF x0 = X(x, e + m), x1 = X(x, e + 16 + m);
      for (size_t r = 0; r < kR; ++r) {
        const VI q = Bytes(b[r] + 2 + m);
        acc.Add(r, m, hn::Mul(F(hn::Sub(hn::And(q, k15), k8)), d[r]), x0);
        acc.Add(r, 16 + m, hn::Mul(F(hn::Sub(hn::ShiftRight<4>(q), k8)), d[r]), x1);
      }
    }
  }
}

// Q8_0: q d.
template <size_t kR>
HWY_INLINE void BlockQ8_0(const uint8_t* const* b, size_t e, const float* x, Acc<kR>& acc) {
  VF d[kR];
  for (size_t r = 0; r < kR; ++r) d[r] = hn::Set(DF(), fused::Half(b[r]));
  for (size_t m = 0; m < 32; m += kN) {
    const VF xe = X(x, e + m);
    for (size_t r = 0; r < kR; ++r) acc.Add(r, m, hn::Mul(F(SBytes(b[r] + 2 + m)), d[r]), xe);
  }
}

// Q4_K / Q5_K: (d sc) q - (dmin m) per 32 values; Q5_K's fifth bit from qh.
template <bool kQ5, size_t kR>
HWY_INLINE void BlockQ45_K(const uint8_t* const* b, size_t e, const float* x, Acc<kR>& acc) {
  // Row r's sub-block j: d sc_j at dm[r][j], dmin m_j at dm[r][8 + j].
  HWY_ALIGN float dm[kR][16];
  for (size_t r = 0; r < kR; ++r) {
    HWY_ALIGN uint8_t sm[16];
    blocks::ScalesMinsK4(b[r] + 4, sm);
    const float d = fused::Half(b[r]), dmin = fused::Half(b[r] + 2);
    for (size_t k = 0; k < 16; k += kN) {
      const VF s = kN == 16 ? hn::IfThenElse(hn::FirstN(DF(), 8), hn::Set(DF(), d), hn::Set(DF(), dmin))
                            : hn::Set(DF(), k < 8 ? d : dmin);
      hn::Store(hn::Mul(s, F(Bytes(sm + k))), DF(), dm[r] + k);
    }
  }
  const VI k15 = hn::Set(DI(), 15), k1 = hn::Set(DI(), 1);
  const VF iota = hn::Iota(DF(), 0);
  for (size_t is = 0; is < 8; is += 2, e += 64) {
    VF d1[kR], m1[kR], d2[kR], m2[kR];
    for (size_t r = 0; r < kR; ++r) {
      d1[r] = hn::Set(DF(), dm[r][is]), m1[r] = hn::Set(DF(), dm[r][8 + is]);
      d2[r] = hn::Set(DF(), dm[r][is + 1]), m2[r] = hn::Set(DF(), dm[r][9 + is]);
    }
    const size_t qoff = (kQ5 ? 48 : 16) + is * 16;
    if constexpr (kTables) {
      // Values of codes 0..15 (and 16..31 for Q5_K) of both sub-blocks.
      VF t1[kR], t2[kR], u1[kR], u2[kR];
      for (size_t r = 0; r < kR; ++r) {
        t1[r] = hn::Sub(hn::Mul(d1[r], iota), m1[r]), t2[r] = hn::Sub(hn::Mul(d2[r], iota), m2[r]);
        if (kQ5) {
          const VF iota16 = hn::Add(iota, hn::Set(DF(), 16.0f));
          u1[r] = hn::Sub(hn::Mul(d1[r], iota16), m1[r]), u2[r] = hn::Sub(hn::Mul(d2[r], iota16), m2[r]);
        }
      }
      // Each partial sum takes its elements in order: the low nibbles' 32, then the high.
      for (size_t m = 0; m < 32; m += kN) {
        const VF xe = X(x, e + m);
        for (size_t r = 0; r < kR; ++r) {
          const VI q = Bytes(b[r] + qoff + m);
          if constexpr (kQ5) {
            const VI h = hn::ShiftRightSame(Bytes(b[r] + 16 + m), static_cast<int>(is));
            acc.Add(r, m, Lut32(t1[r], u1[r], hn::Or(hn::And(q, k15), hn::ShiftLeft<4>(hn::And(h, k1)))), xe);
          } else {
            acc.Add(r, m, Lut16(t1[r], q), xe);
          }
        }
      }
      for (size_t m = 0; m < 32; m += kN) {
        const VF xe = X(x, e + 32 + m);
        for (size_t r = 0; r < kR; ++r) {
          const VI q = hn::ShiftRight<4>(Bytes(b[r] + qoff + m));
          if constexpr (kQ5) {
            const VI h = hn::ShiftRightSame(Bytes(b[r] + 16 + m), static_cast<int>(is) + 1);
            acc.Add(r, 32 + m, Lut32(t2[r], u2[r], hn::Or(q, hn::ShiftLeft<4>(hn::And(h, k1)))), xe);
          } else {
            acc.Add(r, 32 + m, Lut16(t2[r], q), xe);
          }
        }
      }
    } else {
      for (size_t m = 0; m < 32; m += kN) {
        const VF xe = X(x, e + m);
        for (size_t r = 0; r < kR; ++r) {
          VI c = hn::And(Bytes(b[r] + qoff + m), k15);
          if (kQ5) c = hn::Or(c, hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(Bytes(b[r] + 16 + m), static_cast<int>(is)), k1)));
          acc.Add(r, m, hn::Sub(hn::Mul(d1[r], F(c)), m1[r]), xe);
        }
      }
      for (size_t m = 0; m < 32; m += kN) {
        const VF xe = X(x, e + 32 + m);
        for (size_t r = 0; r < kR; ++r) {
          VI c = hn::ShiftRight<4>(Bytes(b[r] + qoff + m));
          if (kQ5) c = hn::Or(c, hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(Bytes(b[r] + 16 + m), static_cast<int>(is) + 1), k1)));
          acc.Add(r, 32 + m, hn::Sub(hn::Mul(d2[r], F(c)), m2[r]), xe);
        }
      }
    }
  }
}

// Q6_K: (d sc) (q - 32) per 16 values. Value l + 32 s of a 128-value half
// (l = 0..31, s = 0..3): ql's byte l (s = 0, 2) or 32 + l (s = 1, 3), its
// low nibble (s < 2) or high, with qh's byte l bits 2s, 2s + 1 as bits 4, 5.
// With 16 lanes (one vector of partial sums) the 6 byte vectors of 16
// values (16 later of every 32) are loaded once for the 8 vectors of values
// they hold, taken in s's order, so each partial sum still takes its
// elements in order (AVX-512: 1.39x the per-s loads).
template <int kS>
HWY_INLINE VI Q6High(VI qh) {  // bits 2 kS, 2 kS + 1 to bits 4, 5
  const VI k48 = hn::Set(DI(), 0x30);
  if constexpr (kS == 0) return hn::And(hn::ShiftLeft<4>(qh), k48);
  else if constexpr (kS == 1) return hn::And(hn::ShiftLeft<2>(qh), k48);
  else if constexpr (kS == 2) return hn::And(qh, k48);
  else return hn::And(hn::ShiftRight<2>(qh), k48);
}

template <int kS, size_t kR>
HWY_INLINE void Q6Step(const VI (&ql)[4], const VI (&qh)[2], const float* ds, size_t r, size_t e, size_t m0,
                       const float* x, Acc<kR>& acc) {
  const VI k15 = hn::Set(DI(), 15), k32 = hn::Set(DI(), 32);
  for (size_t h = 0; h < 2; ++h) {
    const size_t m = m0 + 16 * h;
    const VI l = ql[(kS & 1) * 2 + h];
    const VI low = kS < 2 ? hn::And(l, k15) : hn::ShiftRight<4>(l);
    const VI c = hn::Sub(hn::Or(low, Q6High<kS>(qh[h])), k32);
    acc.Add(r, m, hn::Mul(hn::Set(DF(), ds[h + 2 * kS]), F(c)), X(x, e + 32 * kS + m));
  }
}

template <size_t kR>
HWY_INLINE void BlockQ6_K(const uint8_t* const* b, size_t e, const float* x, Acc<kR>& acc) {
  // Row r's 16 scales times d.
  HWY_ALIGN float ds[kR][16];
  for (size_t r = 0; r < kR; ++r) {
    const VF d = hn::Set(DF(), fused::Half(b[r] + 208));
    for (size_t k = 0; k < 16; k += kN) hn::Store(hn::Mul(d, F(SBytes(b[r] + 192 + k))), DF(), ds[r] + k);
  }
  if constexpr (kK > 1) {  // 8 or 4 lanes: the bytes again for each s (measured: AVX2 0.8x the other way)
    const VI k15 = hn::Set(DI(), 15), k3 = hn::Set(DI(), 3), k32 = hn::Set(DI(), 32);
    for (size_t n = 0; n < 2; ++n, e += 128) {
      for (int s = 0; s < 4; ++s) {
        for (size_t m = 0; m < 32; m += kN) {
          const VF xe = X(x, e + 32 * static_cast<size_t>(s) + m);
          for (size_t r = 0; r < kR; ++r) {
            const VI qlv = Bytes(b[r] + 64 * n + (s & 1) * 32 + m);
            const VI low = s < 2 ? hn::And(qlv, k15) : hn::ShiftRight<4>(qlv);
            const VI high = hn::And(hn::ShiftRightSame(Bytes(b[r] + 128 + 32 * n + m), 2 * s), k3);
            const VI c = hn::Sub(hn::Or(low, hn::ShiftLeft<4>(high)), k32);
            const VF dl = hn::Set(DF(), ds[r][8 * n + m / 16 + 2 * static_cast<size_t>(s)]);
            acc.Add(r, m, hn::Mul(dl, F(c)), xe);
          }
        }
      }
    }
    return;
  }
  for (size_t n = 0; n < 2; ++n, e += 128) {
    for (size_t m0 = 0; m0 < 16; m0 += kN) {
      for (size_t r = 0; r < kR; ++r) {
        const uint8_t* ql = b[r] + 64 * n + m0;
        const uint8_t* qh = b[r] + 128 + 32 * n + m0;
        const VI l[4] = {Bytes(ql), Bytes(ql + 16), Bytes(ql + 32), Bytes(ql + 48)};
        const VI hb[2] = {Bytes(qh), Bytes(qh + 16)};
        const float* dsn = ds[r] + 8 * n;
        Q6Step<0>(l, hb, dsn, r, e, m0, x, acc);
        Q6Step<1>(l, hb, dsn, r, e, m0, x, acc);
        Q6Step<2>(l, hb, dsn, r, e, m0, x, acc);
        Q6Step<3>(l, hb, dsn, r, e, m0, x, acc);
      }
    }
  }
}

// Rows [i, i + kR) of one type.
template <WeightType kT, size_t kR>
HWY_INLINE void Rows(const WeightMatrix& w, const float* x, size_t i, size_t block, size_t bytes, float* out) {
  const uint8_t* b[kR];
  for (size_t r = 0; r < kR; ++r) b[r] = w.row(i + r);
  Acc<kR> acc;
  const size_t ahead = kR * w.row_bytes;
  for (size_t j = 0; j < w.cols; j += block) {
    if constexpr (kT == WeightType::kQ4_0) BlockQ4_0(b, j, x, acc);
    else if constexpr (kT == WeightType::kQ8_0) BlockQ8_0(b, j, x, acc);
    else if constexpr (kT == WeightType::kQ4_K) BlockQ45_K<false>(b, j, x, acc);
    else if constexpr (kT == WeightType::kQ5_K) BlockQ45_K<true>(b, j, x, acc);
    else if constexpr (kT == WeightType::kQ6_K) BlockQ6_K(b, j, x, acc);
    else BlockRef(w.type, b, block, j, x, acc);
    for (size_t r = 0; r < kR; ++r) {
      if (kR > 1) {
        for (size_t o = 0; o < bytes; o += 64) hwy::Prefetch(b[r] + ahead + o);
      }
      b[r] += bytes;
    }
  }
  for (size_t r = 0; r < kR; ++r) out[r] = acc.Reduce(r);
}

// Two rows at a time (independent add chains, one load of x for both), the
// next two rows prefetched as these are read: side by side, two rows are two
// short streams, which the hardware prefetcher alone followed at about 0.6x
// the speed of one (AMD Zen 4); with the prefetch, 1.0-1.3x one row at a time
// on AVX-512 and 1.4-1.6x on AVX2 there.
template <WeightType kT>
HWY_NOINLINE void MatVecType(const WeightMatrix& w, const float* x, size_t r0, size_t r1, float* out) {
  const size_t block = static_cast<size_t>(weight_block(w.type)),
               bytes = static_cast<size_t>(weight_block_bytes(w.type));
  size_t i = r0;
  for (; i + 2 <= r1; i += 2) Rows<kT, 2>(w, x, i, block, bytes, out + (i - r0));
  if (i < r1) Rows<kT, 1>(w, x, i, block, bytes, out + (i - r0));
}

void MatVecFused(const WeightMatrix& w, const float* x, size_t r0, size_t r1, float* out) {
  switch (static_cast<WeightType>(w.type)) {
    case WeightType::kQ4_0: return MatVecType<WeightType::kQ4_0>(w, x, r0, r1, out);
    case WeightType::kQ8_0: return MatVecType<WeightType::kQ8_0>(w, x, r0, r1, out);
    case WeightType::kQ4_K: return MatVecType<WeightType::kQ4_K>(w, x, r0, r1, out);
    case WeightType::kQ5_K: return MatVecType<WeightType::kQ5_K>(w, x, r0, r1, out);
    case WeightType::kQ6_K: return MatVecType<WeightType::kQ6_K>(w, x, r0, r1, out);
    default: return MatVecType<WeightType::kF32>(w, x, r0, r1, out);  // Rows: BlockRef
  }
}

#endif

}  // namespace HWY_NAMESPACE
}  // namespace kvq::ggml
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq::ggml {

HWY_EXPORT(MatVecFused);

bool fused_type(uint32_t type) { return weight_type_read(type) && weight_block(type) > 1; }

void matvec_fused(const WeightMatrix& w, const float* x, size_t r0, size_t r1, float* out) {
  KVQ_ASSERT(fused_type(w.type) && r0 <= r1 && r1 <= w.rows);
  HWY_DYNAMIC_DISPATCH(MatVecFused)(w, x, r0, r1, out);
}

float dot_row_fused_ref(const WeightMatrix& w, size_t i, const float* x) {
  KVQ_ASSERT(fused_type(w.type) && i < w.rows);
  return fused::DotRef(w, i, x);
}

}  // namespace kvq::ggml
#endif
