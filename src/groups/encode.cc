// The channel coder of grouped caches (see grouped_encode.h): the scalar
// reference and its Highway version, 16 channels a vector, bit for bit alike.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/groups/encode.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "src/groups/attention.h"
#include "src/groups/encode.h"

#ifndef KVQ_GROUPED_ENCODE_ONCE
#define KVQ_GROUPED_ENCODE_ONCE
namespace kvq::grouped {

namespace {
// 2^e as a float, e in -126..127.
inline float Pow2(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// The fp16 grid's exponent at x: the binade of |x|, at least -14 (fp16's
// subnormals share the spacing 2^-24).
inline int F16Exp(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return std::max(static_cast<int>((bits >> 23) & 0xFF) - 127, -14);
}
}  // namespace

// The fp16 bits of a float that is an fp16 value (F16Floor / F16Ceil's).
uint16_t F16Bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u, e = (bits >> 23) & 0xFF, m = bits & 0x7FFFFF;
  if (e == 0) return static_cast<uint16_t>(sign);  // +-0
  const int ue = static_cast<int>(e) - 127;
  if (ue < -14) return static_cast<uint16_t>(sign | ((m | 0x800000u) >> (-ue - 1)));  // subnormal: m 2^-24
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(ue + 15) << 10) | (m >> 13));
}

float F16Floor(float x) {
  const int e = F16Exp(x);
  return std::floor(x * Pow2(10 - e)) * Pow2(e - 10);
}

float F16Ceil(float x) {
  const int e = F16Exp(x);
  return std::ceil(x * Pow2(10 - e)) * Pow2(e - 10);
}

uint8_t CodeOf(float x, float lo, float step, int levels) {
  if (step == 0.0f) return 0;
  const float q = std::nearbyint((x - lo) * (1.0f / step));
  return static_cast<uint8_t>(std::clamp(q, 0.0f, static_cast<float>(levels)));
}

namespace {

// p8's codes of a range [lo_end, hi_end] on the grid (base, unit, ustep):
// a rounded down, b up, clamped to 0..255, and moved by one unit where
// float rounding left the decoded range short of the ends.
void CodeP8(float lo_end, float hi_end, float base, float unit, float ustep, int levels, int* a, int* b) {
  const float fa = std::floor((lo_end - base) / unit), fb = std::ceil((hi_end - base) / unit);
  float ia = std::clamp(fa, 0.0f, 255.0f);
  if (ia > 0.0f && base + unit * ia > lo_end) ia = ia - 1.0f;
  float ib = std::clamp(fb, ia, 255.0f);
  const float top = base + unit * ia + ustep * (ib - ia) * static_cast<float>(levels);
  if (ib < 255.0f && top < hi_end) ib = ib + 1.0f;
  *a = static_cast<int>(ia);
  *b = static_cast<int>(ib);
}

}  // namespace

void EncodeChannelRef(const EncodeArgs& g) {
  const size_t n = static_cast<size_t>(g.n);
  for (int c = 0; c < g.n_ch; ++c) {
    const float* x = g.x + c;
    float mn = x[0], mx = x[0];
    for (size_t t = 1; t < n; ++t) mn = std::min(mn, x[t * g.stride]), mx = std::max(mx, x[t * g.stride]);
    const float w = mx - mn;
    const int levels = (1 << g.bits[c]) - 1;
    const float lf = static_cast<float>(levels);
    float best = std::numeric_limits<float>::infinity(), best_lo = 0, best_st = 0;
    int best_a = 0, best_b = 0, best_ca = 0;
    // m: the low end first (high end at the max), then the high end.
    for (int pass = 0; pass < (g.clip > 0 ? 2 : 1); ++pass) {
      for (int k = pass; k <= g.clip; ++k) {
        const int ca = pass == 0 ? k : best_ca, cz = pass == 0 ? 0 : k;
        const float rlo = mn + w * static_cast<float>(ca) / 16.0f, rhi = mx - w * static_cast<float>(cz) / 16.0f;
        float lo, st;
        int ia = 0, ib = 0;
        if (g.grid) {
          const float base = g.grid[c], unit = g.grid[g.n_ch + c], ustep = g.grid[2 * g.n_ch + c];
          CodeP8(rlo, rhi, base, unit, ustep, levels, &ia, &ib);
          lo = base + unit * static_cast<float>(ia);
          st = ustep * static_cast<float>(ib - ia);
        } else {
          lo = F16Floor(rlo);
          st = rhi > lo ? F16Ceil((rhi - lo) / lf) : 0.0f;
        }
        float sse = 0;
        for (size_t t = 0; t < n; ++t) {
          const float xt = x[t * g.stride];
          const float e = xt - (lo + st * static_cast<float>(CodeOf(xt, lo, st, levels)));
          sse = sse + e * e;
        }
        if (sse < best) best = sse, best_lo = lo, best_st = st, best_a = ia, best_b = ib, best_ca = ca;
      }
    }
    if (g.grid) {
      g.a[c] = static_cast<uint8_t>(best_a), g.b[c] = static_cast<uint8_t>(best_b);
    } else {
      g.lo16[c] = F16Bits(best_lo), g.step16[c] = F16Bits(best_st);
    }
    if (g.lo) g.lo[c] = best_lo;
    if (g.step) g.step[c] = best_st;
    if (g.codes) {
      for (size_t t = 0; t < n; ++t) g.codes[static_cast<size_t>(c) * n + t] = CodeOf(x[t * g.stride], best_lo, best_st, levels);
    }
  }
}

void OpenCodesRef(const float* x, const float* lo, const float* st, const float* st8, size_t n_units, size_t hd,
                  int nbits, uint8_t* qn, uint8_t* c8, uint8_t* fits) {
  const int nlev = (1 << nbits) - 1;
  for (size_t un = 0; un < n_units; ++un) {
    bool ok = true;
    for (size_t i = 0; i < hd; ++i) {
      const size_t c = un * hd + i;
      const float xv = x[c];
      float y = xv, half;
      if (c8) {
        c8[c] = CodeOf(xv, lo[c], st8[c], 255);
        y = lo[c] + st8[c] * static_cast<float>(c8[c]);
        half = 0.5f * st8[c];
      }
      qn[c] = CodeOf(y, lo[c], st[c], nlev);
      if (!c8) y = lo[c] + st[c] * static_cast<float>(qn[c]), half = 0.5f * st[c];
      ok = ok && std::fabs(y - xv) <= half;  // else outside the grid (or a zero-width range)
    }
    fits[un] = ok ? 1 : 0;
  }
}

}  // namespace kvq::grouped
#endif  // KVQ_GROUPED_ENCODE_ONCE

HWY_BEFORE_NAMESPACE();
namespace kvq::grouped {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR
template <class D>
HWY_INLINE hn::Vec<D> Pow2V(D d, hn::Vec<hn::RebindToSigned<D>> e) {
  return hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(e, hn::Set(hn::RebindToSigned<D>(), 127))));
}
template <class D>
HWY_INLINE hn::Vec<hn::RebindToSigned<D>> F16ExpV(D d, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  const auto biased = hn::And(hn::ShiftRight<23>(hn::BitCast(di, x)), hn::Set(di, 0xFF));
  (void)d;
  return hn::Max(hn::Sub(biased, hn::Set(di, 127)), hn::Set(di, -14));
}
template <class D>
HWY_INLINE hn::Vec<D> F16FloorV(D d, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  const auto e = F16ExpV(d, x);
  return hn::Mul(hn::Floor(hn::Mul(x, Pow2V(d, hn::Sub(hn::Set(di, 10), e)))), Pow2V(d, hn::Sub(e, hn::Set(di, 10))));
}
template <class D>
HWY_INLINE hn::Vec<D> F16CeilV(D d, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  const auto e = F16ExpV(d, x);
  return hn::Mul(hn::Ceil(hn::Mul(x, Pow2V(d, hn::Sub(hn::Set(di, 10), e)))), Pow2V(d, hn::Sub(e, hn::Set(di, 10))));
}

// Codes of x on (lo, step, inv): clamp(rne((x - lo) inv), 0, levels).
template <class D>
HWY_INLINE hn::Vec<D> CodesV(D, hn::Vec<D> x, hn::Vec<D> lo, hn::Vec<D> inv, hn::Vec<D> levels) {
  return hn::Min(hn::Max(hn::Round(hn::Mul(hn::Sub(x, lo), inv)), hn::Zero(D())), levels);
}

template <class D>
void EncodeBlock(D d, const EncodeArgs& g, int c0) {
  const hn::RebindToSigned<D> di;
  const size_t n = static_cast<size_t>(g.n);
  const float* x = g.x + c0;
  auto mn = hn::LoadU(d, x), mx = mn;
  for (size_t t = 1; t < n; ++t) {
    const auto v = hn::LoadU(d, x + t * g.stride);
    mn = hn::Min(mn, v), mx = hn::Max(mx, v);
  }
  const auto w = hn::Sub(mx, mn);
  // levels = 2^bits - 1 per lane.
  HWY_ALIGN int32_t lv[hn::MaxLanes(D())];
  for (size_t i = 0; i < hn::Lanes(d); ++i) lv[i] = (1 << g.bits[static_cast<size_t>(c0) + i]) - 1;
  const auto lf = hn::ConvertTo(d, hn::Load(di, lv));
  auto best = hn::Set(d, std::numeric_limits<float>::infinity());
  auto best_lo = hn::Zero(d), best_st = hn::Zero(d), best_a = hn::Zero(d), best_b = hn::Zero(d);
  const auto zero = hn::Zero(d), f255 = hn::Set(d, 255.0f), one = hn::Set(d, 1.0f), sixteen = hn::Set(d, 16.0f);
  hn::Vec<D> base = zero, unit = zero, ustep = zero;
  if (g.grid) {
    base = hn::LoadU(d, g.grid + c0), unit = hn::LoadU(d, g.grid + g.n_ch + c0), ustep = hn::LoadU(d, g.grid + 2 * g.n_ch + c0);
  }
  auto best_ca = zero;
  for (int pass = 0; pass < (g.clip > 0 ? 2 : 1); ++pass) {  // m: the low end, then the high end
    for (int k = pass; k <= g.clip; ++k) {
      const auto ca = pass == 0 ? hn::Set(d, static_cast<float>(k)) : best_ca;
      const auto cz = hn::Set(d, pass == 0 ? 0.0f : static_cast<float>(k));
      const auto rlo = hn::Add(mn, hn::Div(hn::Mul(w, ca), sixteen));
      const auto rhi = hn::Sub(mx, hn::Div(hn::Mul(w, cz), sixteen));
      hn::Vec<D> lo, st, ia = zero, ib = zero;
      if (g.grid) {
        const auto fa = hn::Floor(hn::Div(hn::Sub(rlo, base), unit));
        const auto fb = hn::Ceil(hn::Div(hn::Sub(rhi, base), unit));
        ia = hn::Min(hn::Max(fa, zero), f255);
        ia = hn::IfThenElse(hn::And(hn::Gt(ia, zero), hn::Gt(hn::Add(base, hn::Mul(unit, ia)), rlo)), hn::Sub(ia, one), ia);
        ib = hn::Min(hn::Max(fb, ia), f255);
        const auto top = hn::Add(hn::Add(base, hn::Mul(unit, ia)), hn::Mul(hn::Mul(ustep, hn::Sub(ib, ia)), lf));
        ib = hn::IfThenElse(hn::And(hn::Lt(ib, f255), hn::Lt(top, rhi)), hn::Add(ib, one), ib);
        lo = hn::Add(base, hn::Mul(unit, ia));
        st = hn::Mul(ustep, hn::Sub(ib, ia));
      } else {
        lo = F16FloorV(d, rlo);
        st = hn::IfThenElseZero(hn::Gt(rhi, lo), F16CeilV(d, hn::Div(hn::Sub(rhi, lo), lf)));
      }
      const auto inv = hn::IfThenElseZero(hn::Gt(st, zero), hn::Div(one, st));
      auto sse = zero;
      for (size_t t = 0; t < n; ++t) {
        const auto xt = hn::LoadU(d, x + t * g.stride);
        const auto e = hn::Sub(xt, hn::Add(lo, hn::Mul(st, CodesV(d, xt, lo, inv, lf))));
        sse = hn::Add(sse, hn::Mul(e, e));
      }
      const auto better = hn::Lt(sse, best);
      best = hn::IfThenElse(better, sse, best);
      best_lo = hn::IfThenElse(better, lo, best_lo), best_st = hn::IfThenElse(better, st, best_st);
      best_a = hn::IfThenElse(better, ia, best_a), best_b = hn::IfThenElse(better, ib, best_b);
      best_ca = hn::IfThenElse(better, ca, best_ca);
    }
  }
  const size_t N = hn::Lanes(d);
  HWY_ALIGN float blo[hn::MaxLanes(D())], bst[hn::MaxLanes(D())], ba[hn::MaxLanes(D())], bb[hn::MaxLanes(D())];
  hn::Store(best_lo, d, blo), hn::Store(best_st, d, bst), hn::Store(best_a, d, ba), hn::Store(best_b, d, bb);
  for (size_t i = 0; i < N; ++i) {
    const int c = c0 + static_cast<int>(i);
    if (g.lo) g.lo[c] = blo[i];
    if (g.step) g.step[c] = bst[i];
    if (g.grid) g.a[c] = static_cast<uint8_t>(ba[i]), g.b[c] = static_cast<uint8_t>(bb[i]);
  }
  if (!g.grid) {  // the fp16 bits of the two (exact) values
    for (size_t i = 0; i < N; ++i) {
      g.lo16[static_cast<size_t>(c0) + i] = F16Bits(blo[i]), g.step16[static_cast<size_t>(c0) + i] = F16Bits(bst[i]);
    }
  }
  if (g.codes) {
    const auto inv = hn::IfThenElseZero(hn::Gt(best_st, zero), hn::Div(one, best_st));
    HWY_ALIGN float q[hn::MaxLanes(D())];
    for (size_t t = 0; t < n; ++t) {
      hn::Store(CodesV(d, hn::LoadU(d, x + t * g.stride), best_lo, inv, lf), d, q);
      for (size_t i = 0; i < N; ++i) g.codes[(static_cast<size_t>(c0) + i) * n + t] = static_cast<uint8_t>(q[i]);
    }
  }
}
#endif  // HWY_TARGET != HWY_SCALAR

void CodeValuesImpl(const float* x, int n, size_t stride, int n_ch, const float* lo, const float* step,
                    const uint8_t* bits, uint8_t* codes) {
  const size_t un = static_cast<size_t>(n);
  int c0 = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::CappedTag<float, 16> d;
  const hn::RebindToSigned<decltype(d)> di;
  const int N = static_cast<int>(hn::Lanes(d));
  HWY_ALIGN int32_t lv[hn::MaxLanes(decltype(d)())];
  HWY_ALIGN float q[hn::MaxLanes(decltype(d)())];
  for (; c0 + N <= n_ch; c0 += N) {
    for (int i = 0; i < N; ++i) lv[i] = (1 << bits[c0 + i]) - 1;
    const auto lf = hn::ConvertTo(d, hn::Load(di, lv));
    const auto lov = hn::LoadU(d, lo + c0), st = hn::LoadU(d, step + c0);
    const auto inv = hn::IfThenElseZero(hn::Gt(st, hn::Zero(d)), hn::Div(hn::Set(d, 1.0f), st));
    for (size_t t = 0; t < un; ++t) {
      hn::Store(CodesV(d, hn::LoadU(d, x + t * stride + static_cast<size_t>(c0)), lov, inv, lf), d, q);
      for (int i = 0; i < N; ++i) codes[(static_cast<size_t>(c0) + static_cast<size_t>(i)) * un + t] = static_cast<uint8_t>(q[i]);
    }
  }
#endif
  for (; c0 < n_ch; ++c0) {
    for (size_t t = 0; t < un; ++t) {
      codes[static_cast<size_t>(c0) * un + t] = CodeOf(x[t * stride + static_cast<size_t>(c0)], lo[c0], step[c0], (1 << bits[c0]) - 1);
    }
  }
}

void OpenCodesImpl(const float* x, const float* lo, const float* st, const float* st8, size_t n_units, size_t hd,
                   int nbits, uint8_t* qn, uint8_t* c8, uint8_t* fits) {
#if HWY_TARGET == HWY_SCALAR
  OpenCodesRef(x, lo, st, st8, n_units, hd, nbits, qn, c8, fits);
#else
  const hn::CappedTag<float, 8> d;  // hd is a multiple of 8
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(d)> d8;
  const size_t N = hn::Lanes(d);
  const auto zero = hn::Zero(d), one = hn::Set(d, 1.0f), half = hn::Set(d, 0.5f);
  const auto nlev = hn::Set(d, static_cast<float>((1 << nbits) - 1)), l255 = hn::Set(d, 255.0f);
  for (size_t un = 0; un < n_units; ++un) {
    auto ok = hn::FirstN(d, N);
    for (size_t i = 0; i < hd; i += N) {
      const size_t c = un * hd + i;
      const auto xv = hn::LoadU(d, x + c), lov = hn::LoadU(d, lo + c), sv = hn::LoadU(d, st + c);
      auto y = xv;
      hn::Vec<decltype(d)> hw;
      if (c8) {
        const auto s8 = hn::LoadU(d, st8 + c);
        const auto inv8 = hn::IfThenElseZero(hn::Gt(s8, zero), hn::Div(one, s8));
        const auto q8 = CodesV(d, xv, lov, inv8, l255);
        hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, q8)), d8, c8 + c);
        y = hn::Add(lov, hn::Mul(s8, q8));
        hw = hn::Mul(half, s8);
      }
      const auto inv = hn::IfThenElseZero(hn::Gt(sv, zero), hn::Div(one, sv));
      const auto q = CodesV(d, y, lov, inv, nlev);
      hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, q)), d8, qn + c);
      if (!c8) y = hn::Add(lov, hn::Mul(sv, q)), hw = hn::Mul(half, sv);
      ok = hn::And(ok, hn::Le(hn::Abs(hn::Sub(y, xv)), hw));
    }
    fits[un] = hn::AllTrue(d, ok) ? 1 : 0;
  }
#endif
}

void EncodeChannelsImpl(const EncodeArgs& g) {
#if HWY_TARGET == HWY_SCALAR
  EncodeChannelRef(g);
#else
  const hn::CappedTag<float, 16> d;
  const int N = static_cast<int>(hn::Lanes(d));
  int c0 = 0;
  for (; c0 + N <= g.n_ch; c0 += N) EncodeBlock(d, g, c0);
  if (c0 < g.n_ch) {  // the last channels: the reference
    EncodeArgs rest = g;
    rest.x = g.x + c0, rest.n_ch = g.n_ch - c0, rest.bits = g.bits + c0;
    // The reference indexes the grid by its own channel count: give it a compact copy.
    float grid[3 * 16];
    if (g.grid) {
      for (int i = 0; i < rest.n_ch; ++i) {
        for (int k = 0; k < 3; ++k) grid[k * rest.n_ch + i] = g.grid[k * g.n_ch + c0 + i];
      }
      rest.grid = grid;
    }
    if (g.lo16) rest.lo16 = g.lo16 + c0, rest.step16 = g.step16 + c0;
    if (g.a) rest.a = g.a + c0, rest.b = g.b + c0;
    if (g.lo) rest.lo = g.lo + c0;
    if (g.step) rest.step = g.step + c0;
    if (g.codes) rest.codes = g.codes + static_cast<size_t>(c0) * static_cast<size_t>(g.n);
    EncodeChannelRef(rest);
  }
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace kvq::grouped
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq::grouped {
HWY_EXPORT(EncodeChannelsImpl);
HWY_EXPORT(CodeValuesImpl);
HWY_EXPORT(OpenCodesImpl);
void OpenCodes(const float* x, const float* lo, const float* st, const float* st8, size_t n_units, size_t hd,
               int nbits, uint8_t* qn, uint8_t* c8, uint8_t* fits) {
  HWY_DYNAMIC_DISPATCH(OpenCodesImpl)(x, lo, st, st8, n_units, hd, nbits, qn, c8, fits);
}
void EncodeChannels(const EncodeArgs& g) { HWY_DYNAMIC_DISPATCH(EncodeChannelsImpl)(g); }
void CodeValues(const float* x, int n, size_t stride, int n_ch, const float* lo, const float* step,
                const uint8_t* bits, uint8_t* codes) {
  HWY_DYNAMIC_DISPATCH(CodeValuesImpl)(x, n, stride, n_ch, lo, step, bits, codes);
}
}  // namespace kvq::grouped
#endif
