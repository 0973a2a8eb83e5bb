// The token pass's fused dequantise-and-dot over ggml's block types
// (kvq/ggml_weights.h: matvec_fused). Every element's value is ggml's
// reference value (the same float operations as dequantize_ggml, lane by
// lane); element j of a row is added into partial sum j mod 16, in order of
// j; the 16 sums are added in a fixed tree. Products and sums are separate
// roundings (no fused multiply-add), so every target, and the scalar
// reference, give the same bits.
//
// Highway kernels decode Q4_0, Q8_0, Q4_K, Q5_K and Q6_K in vectors of up to
// 16 floats (x86, NEON); the other types, and the scalable and scalar
// targets, decode a block with the reference and accumulate its values.
#include <algorithm>
#include <cstring>

#include "kvq/error.h"
#include "kvq/half.h"
#include "kvq/ggml_weights.h"
#include "src/base/ggml_weight_blocks.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/base/ggml_dot.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
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

// Partial sum j mod 16 of the row lives in lane (j mod 16) mod N of
// acc[(j mod 16) / N]; elements arrive in order, N at a time.
struct Acc {
  VF v[kK];
  Acc() {
    for (size_t k = 0; k < kK; ++k) v[k] = hn::Zero(DF());
  }
  // values of elements [e, e + N), e a multiple of N.
  HWY_INLINE void Add(size_t e, VF values, const float* x) {
    VF& a = v[(e % fused::kLanes) / kN];
    a = hn::Add(a, hn::Mul(values, hn::LoadU(DF(), x + e)));
  }
  float Reduce() {
    HWY_ALIGN float s[fused::kLanes];
    for (size_t k = 0; k < kK; ++k) hn::Store(v[k], DF(), s + k * kN);
    return fused::Reduce(s);
  }
};

// N bytes at p as int32 lanes.
HWY_INLINE VI Bytes(const uint8_t* p) { return hn::PromoteTo(DI(), hn::LoadU(hn::Rebind<uint8_t, DF>(), p)); }
HWY_INLINE VI SBytes(const uint8_t* p) {
  return hn::PromoteTo(DI(), hn::LoadU(hn::Rebind<int8_t, DF>(), reinterpret_cast<const int8_t*>(p)));
}
HWY_INLINE VF F(VI v) { return hn::ConvertTo(DF(), v); }

// The reference decode of one block, then its values accumulated.
void BlockRef(uint32_t type, const uint8_t* b, size_t block, size_t e, const float* x, Acc& acc) {
  HWY_ALIGN float v[256];
  dequantize(type, b, block, v);
  for (size_t m = 0; m < block; m += kN) acc.Add(e + m, hn::Load(DF(), v + m), x);
}

// Q4_0: (nibble - 8) d.
void BlockQ4_0(const uint8_t* b, size_t e, const float* x, Acc& acc) {
  const VF d = hn::Set(DF(), fused::Half(b));
  const VI k15 = hn::Set(DI(), 15), k8 = hn::Set(DI(), 8);
  for (size_t m = 0; m < 16; m += kN) {
    const VI q = Bytes(b + 2 + m);
    acc.Add(e + m, hn::Mul(F(hn::Sub(hn::And(q, k15), k8)), d), x);
  }
  for (size_t m = 0; m < 16; m += kN) {
    const VI q = Bytes(b + 2 + m);
    acc.Add(e + 16 + m, hn::Mul(F(hn::Sub(hn::ShiftRight<4>(q), k8)), d), x);
  }
}

// Q8_0: q d.
void BlockQ8_0(const uint8_t* b, size_t e, const float* x, Acc& acc) {
  const VF d = hn::Set(DF(), fused::Half(b));
  for (size_t m = 0; m < 32; m += kN) acc.Add(e + m, hn::Mul(F(SBytes(b + 2 + m)), d), x);
}

using blocks::ScaleMinK4;

// Q4_K / Q5_K: (d sc) q - (dmin m) per 32 values; Q5_K's fifth bit from qh.
template <bool kQ5>
void BlockQ45_K(const uint8_t* b, size_t e, const float* x, Acc& acc) {
  const float d = fused::Half(b), dmin = fused::Half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* q = kQ5 ? b + 48 : b + 16;
  const VI k15 = hn::Set(DI(), 15), k1 = hn::Set(DI(), 1);
  for (int is = 0; is < 8; is += 2, q += 32, e += 64) {
    uint8_t sc, mn;
    ScaleMinK4(is, scales, &sc, &mn);
    const VF d1 = hn::Set(DF(), d * static_cast<float>(sc)), m1 = hn::Set(DF(), dmin * static_cast<float>(mn));
    ScaleMinK4(is + 1, scales, &sc, &mn);
    const VF d2 = hn::Set(DF(), d * static_cast<float>(sc)), m2 = hn::Set(DF(), dmin * static_cast<float>(mn));
    for (size_t m = 0; m < 32; m += kN) {
      VI c = hn::And(Bytes(q + m), k15);
      if (kQ5) c = hn::Or(c, hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(Bytes(qh + m), is), k1)));
      acc.Add(e + m, hn::Sub(hn::Mul(d1, F(c)), m1), x);
    }
    for (size_t m = 0; m < 32; m += kN) {
      VI c = hn::ShiftRight<4>(Bytes(q + m));
      if (kQ5) c = hn::Or(c, hn::ShiftLeft<4>(hn::And(hn::ShiftRightSame(Bytes(qh + m), is + 1), k1)));
      acc.Add(e + 32 + m, hn::Sub(hn::Mul(d2, F(c)), m2), x);
    }
  }
}

// Q6_K: (d sc) (q - 32) per 16 values.
void BlockQ6_K(const uint8_t* b, size_t e, const float* x, Acc& acc) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fused::Half(b + 208);
  const VI k15 = hn::Set(DI(), 15), k3 = hn::Set(DI(), 3), k32 = hn::Set(DI(), 32);
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, e += 128) {
    // values l (0..31) + 32 s for s = 0..3: ql nibble (s odd: high), qh bits 2s, 2s + 1.
    for (int s = 0; s < 4; ++s) {
      const uint8_t* lo = ql + (s & 1) * 32;
      for (size_t m = 0; m < 32; m += kN) {
        const VI qlv = Bytes(lo + m);
        const VI low = s < 2 ? hn::And(qlv, k15) : hn::ShiftRight<4>(qlv);
        const VI high = hn::And(hn::ShiftRightSame(Bytes(qh + m), 2 * s), k3);
        const VI c = hn::Sub(hn::Or(low, hn::ShiftLeft<4>(high)), k32);
        const VF dl = hn::Set(DF(), d * static_cast<float>(sc[static_cast<int>(m / 16) + 2 * s]));
        acc.Add(e + 32 * static_cast<size_t>(s) + m, hn::Mul(dl, F(c)), x);
      }
    }
  }
}

void MatVecFused(const WeightMatrix& w, const float* x, size_t r0, size_t r1, float* out) {
  const size_t block = static_cast<size_t>(weight_block(w.type)),
               bytes = static_cast<size_t>(weight_block_bytes(w.type));
  for (size_t i = r0; i < r1; ++i) {
    const uint8_t* r = w.row(i);
    Acc acc;
    for (size_t j = 0; j < w.cols; j += block, r += bytes) {
      switch (static_cast<WeightType>(w.type)) {
        case WeightType::kQ4_0: BlockQ4_0(r, j, x, acc); break;
        case WeightType::kQ8_0: BlockQ8_0(r, j, x, acc); break;
        case WeightType::kQ4_K: BlockQ45_K<false>(r, j, x, acc); break;
        case WeightType::kQ5_K: BlockQ45_K<true>(r, j, x, acc); break;
        case WeightType::kQ6_K: BlockQ6_K(r, j, x, acc); break;
        default: BlockRef(w.type, r, block, j, x, acc);
      }
    }
    out[i - r0] = acc.Reduce();
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
