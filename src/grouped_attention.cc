// The fused attention kernel over coded groups (grouped_kv.h), Highway
// SIMD for every compiled target (one dispatch per call). Vectors hold up to
// 16 lanes: 16 tokens of a K tile (AVX-512; two or four chunks on narrower
// targets) or 8-16 channels of a V row. Codes come out of an 8-code block
// (grouped_attention.h) by a 32-bit broadcast, a per-lane shift and a mask.
//
// Per group: for each 16-token tile the rotation of each RoPE pair is built
// once for all heads (angle addition from the tile's first position and the
// lane offsets: cos(a + b) = cos a cos b - sin a sin b), each KV head's key
// codes are dequantized (lo + step q) and rotated in registers, and every
// query head of the GQA group takes its 16 scores from them. Then per head
// one online-softmax step for the whole group, and the weighted V codes are
// summed as integers-times-weights per channel: sum_t p_t x^_t = lo P +
// step sum_t p_t q_t, with P = sum_t p_t (the group's scale folded once).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/grouped_attention.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/contrib/math/math-inl.h"
#include "kvq/half.h"
#include "src/grouped_attention.h"

HWY_BEFORE_NAMESPACE();
namespace kvq::grouped {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr int kL = 16;    // tokens per K tile

HWY_INLINE uint32_t Word(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// Shift tables of an 8-code block of b bits: lane l (0..15) -> the shift of
// code l % 8 in the low plane and in the high plane.
struct Shifts {
  HWY_ALIGN uint32_t lo[kL];
  HWY_ALIGN uint32_t hi[kL];
  uint32_t mlo, mhi;
  int b;
  explicit Shifts(int bits) : b(bits) {
    const int lb = bits < 4 ? bits : 4;
    for (int l = 0; l < kL; ++l) {
      lo[l] = static_cast<uint32_t>(lb * (l % 8));
      hi[l] = static_cast<uint32_t>(bits > 4 ? (bits - 4) * (l % 8) : 0);
    }
    mlo = (1u << lb) - 1;
    mhi = bits > 4 ? (1u << (bits - 4)) - 1 : 0;
  }
};

// Codes of lanes [c0, c0 + N) of two consecutive 8-code blocks at p (lanes
// 0-7 from the first, 8-15 from the second), as floats. N <= 16, c0 % N == 0.
template <class D>
HWY_INLINE hn::Vec<D> Codes(D d, const uint8_t* p, const Shifts& sh, size_t c0) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const size_t N = hn::Lanes(d);
  const size_t bb = static_cast<size_t>(sh.b);
  hn::Vec<decltype(du)> w, wh;
  if (N >= 16) {
    const auto first = hn::FirstN(du, 8);
    w = hn::IfThenElse(first, hn::Set(du, Word(p)), hn::Set(du, Word(p + bb)));
    if (sh.b > 4) wh = hn::IfThenElse(first, hn::Set(du, Word(p + 4)), hn::Set(du, Word(p + bb + 4)));
  } else {
    const uint8_t* blk = p + (c0 / 8) * bb;
    w = hn::Set(du, Word(blk));
    if (sh.b > 4) wh = hn::Set(du, Word(blk + 4));
  }
  auto c = hn::And(hn::Shr(w, hn::LoadU(du, sh.lo + c0)), hn::Set(du, sh.mlo));
  if (sh.b > 4) {
    c = hn::Or(c, hn::ShiftLeft<4>(hn::And(hn::Shr(wh, hn::LoadU(du, sh.hi + c0)), hn::Set(du, sh.mhi))));
  }
  return hn::ConvertTo(d, hn::BitCast(di, c));
}

// V of one group and KV head, query heads [r0, r0 + NR): acc[r] = acc[r]
// alpha_r + lo P_r + step sum_t p_rt q_t, channels in chunks of the tag's
// lanes (NR a constant, so the accumulators stay in registers).
template <int NR, class D>
HWY_INLINE void AccumulateVHeads(D d, const uint8_t* codes, size_t row_bytes, int G, int hd, int r0, const Shifts& sh,
                                 const float* HWY_RESTRICT p, const float* HWY_RESTRICT psum,
                                 const float* HWY_RESTRICT alpha, const float* HWY_RESTRICT vlo,
                                 const float* HWY_RESTRICT vst, float* HWY_RESTRICT acc) {
  const size_t N = hn::Lanes(d);
  const size_t uhd = static_cast<size_t>(hd), uG = static_cast<size_t>(G);
  for (size_t c0 = 0; c0 < uhd; c0 += N) {
    // The 16-lane window this chunk reads: blocks (c0 / 16) * 2 and the next.
    const size_t win = (c0 / 16) * 16, lane0 = c0 - win;
    hn::Vec<D> a[NR];
    for (int r = 0; r < NR; ++r) a[r] = hn::Zero(d);
    const uint8_t* blk = codes + (win / 8) * static_cast<size_t>(sh.b);
    const float* pr = p + static_cast<size_t>(r0) * uG;
    for (size_t t = 0; t < uG; ++t, blk += row_bytes) {
      const auto cf = Codes(d, blk, sh, lane0);
      for (int r = 0; r < NR; ++r) a[r] = hn::MulAdd(hn::Set(d, pr[static_cast<size_t>(r) * uG + t]), cf, a[r]);
    }
    const auto lo = hn::LoadU(d, vlo + c0), st = hn::LoadU(d, vst + c0);
    for (int r = 0; r < NR; ++r) {
      float* HWY_RESTRICT out = acc + static_cast<size_t>(r0 + r) * uhd + c0;
      const auto prev = hn::Mul(hn::LoadU(d, out), hn::Set(d, alpha[r0 + r]));
      hn::StoreU(hn::MulAdd(st, a[r], hn::MulAdd(lo, hn::Set(d, psum[r0 + r]), prev)), d, out);
    }
  }
}

template <class D>
HWY_INLINE void AccumulateV(D d, const uint8_t* codes, size_t row_bytes, int G, int hd, int rep, const Shifts& sh,
                            const float* HWY_RESTRICT p, const float* HWY_RESTRICT psum, const float* HWY_RESTRICT alpha,
                            const float* HWY_RESTRICT vlo, const float* HWY_RESTRICT vst, float* HWY_RESTRICT acc) {
  int r0 = 0;
  for (; r0 + 4 <= rep; r0 += 4) AccumulateVHeads<4>(d, codes, row_bytes, G, hd, r0, sh, p, psum, alpha, vlo, vst, acc);
  for (; r0 + 2 <= rep; r0 += 2) AccumulateVHeads<2>(d, codes, row_bytes, G, hd, r0, sh, p, psum, alpha, vlo, vst, acc);
  for (; r0 < rep; ++r0) AccumulateVHeads<1>(d, codes, row_bytes, G, hd, r0, sh, p, psum, alpha, vlo, vst, acc);
}

// Scores of query heads [r0, r0 + NR) of one KV head for one K tile, lanes
// [c0, c0 + N): the keys dequantized and rotated in registers, shared by
// the NR heads.
template <int NR, class D>
HWY_INLINE void ScoreTile(D d, const uint8_t* tile, const uint8_t* bits, const uint32_t* off, int P,
                          const Shifts* shifts, const float* HWY_RESTRICT kp,
                          size_t uhd, const float* HWY_RESTRICT cs, const float* HWY_RESTRICT sn,
                          const float* HWY_RESTRICT qb, size_t c0, float* HWY_RESTRICT out, size_t out_stride) {
  hn::Vec<D> a[NR];
  for (int r = 0; r < NR; ++r) a[r] = hn::Zero(d);
  for (int pp = 0; pp < P; ++pp) {
    const size_t i0 = static_cast<size_t>(2 * pp), i1 = i0 + 1;
    const auto q0 = Codes(d, tile + off[i0], shifts[bits[i0]], c0);
    const auto q1 = Codes(d, tile + off[i1], shifts[bits[i1]], c0);
    const auto k0 = hn::MulAdd(q0, hn::Set(d, kp[uhd + i0]), hn::Set(d, kp[i0]));
    const auto k1 = hn::MulAdd(q1, hn::Set(d, kp[uhd + i1]), hn::Set(d, kp[i1]));
    const auto vc = hn::Load(d, cs + pp * kL + c0), vs = hn::Load(d, sn + pp * kL + c0);
    const auto r0v = hn::NegMulAdd(k1, vs, hn::Mul(k0, vc));
    const auto r1v = hn::MulAdd(k0, vs, hn::Mul(k1, vc));
    for (int r = 0; r < NR; ++r) {
      const float* qr = qb + static_cast<size_t>(r) * uhd;
      a[r] = hn::MulAdd(hn::Set(d, qr[i0]), r0v, a[r]);
      a[r] = hn::MulAdd(hn::Set(d, qr[i1]), r1v, a[r]);
    }
  }
  for (int r = 0; r < NR; ++r) hn::StoreU(a[r], d, out + static_cast<size_t>(r) * out_stride + c0);
}

void AttendImpl(const Call& c) {
  const hn::CappedTag<float, kL> d;
  const size_t N = hn::Lanes(d);
  const int hd = c.head_dim, P = hd / 2, H = c.n_kv_heads, rep = c.n_heads / H, G = c.group;
  const int tiles = G / kL;
  const size_t uhd = static_cast<size_t>(hd), uG = static_cast<size_t>(G);
  const Shifts shifts[9] = {Shifts(1), Shifts(1), Shifts(2), Shifts(3), Shifts(4),
                            Shifts(5), Shifts(6), Shifts(7), Shifts(8)};  // by bits (0 unused)
  const Shifts& vsh = shifts[c.v_bits];
  const size_t vrow = uhd * static_cast<size_t>(c.v_bits) / 8;
  const size_t header = c.k_static ? 0 : GroupHeaderBytes(uhd, c.k_grid != nullptr);  // per-group lo | step
  // Rotation of each pair at lane offsets 0..15 (transposed: [pair][lane]),
  // and the tile's rotation (aligned: read with Load).
  const size_t pl = static_cast<size_t>(P) * kL;
  auto rot = hwy::AllocateAligned<float>(4 * pl);
  float* co = rot.get();
  float* so = co + pl;
  float* cs = so + pl;
  float* sn = cs + pl;
  const size_t nh = static_cast<size_t>(c.n_heads), ur = static_cast<size_t>(rep);
  std::vector<float> scores_v(nh * uG), acc_v(nh * uhd, 0.0f), pw_v(ur * uG), m_v(nh), l_v(nh, 0.0f);
  std::vector<float> vlo_v(uhd), vst_v(uhd), psum_v(ur), alpha_v(ur);
  float* scores = scores_v.data();  // [n_heads][G]
  float* acc = acc_v.data();        // [n_heads][hd]
  float* pw = pw_v.data();          // [rep][G]: one KV head's weights
  float* m = m_v.data();
  float* l = l_v.data();
  float* vlo = vlo_v.data();
  float* vst = vst_v.data();
  float* psum = psum_v.data();
  float* alpha = alpha_v.data();
  for (int pp = 0; pp < P; ++pp) {
    for (int ln = 0; ln < kL; ++ln) {
      co[pp * kL + ln] = c.rope_cos[ln * P + pp];
      so[pp * kL + ln] = c.rope_sin[ln * P + pp];
    }
  }
  std::fill(m, m + nh, -std::numeric_limits<float>::infinity());
  std::vector<float> kparams(static_cast<size_t>(H) * 2 * uhd);

  for (int64_t g = c.g0; g < c.g1; ++g) {
    for (int h = 0; h < H && !c.k_static; ++h) {
      const uint8_t* hdr = c.k + (static_cast<size_t>(h) * static_cast<size_t>(c.max_groups) + static_cast<size_t>(g)) * c.gbk;
      float* kp = kparams.data() + static_cast<size_t>(h) * 2 * uhd;
      DecodeGroupParams(hdr, uhd, c.k_grid ? c.k_grid + static_cast<size_t>(h) * 3 * uhd : nullptr, kp, kp + uhd);
    }
    for (int j = 0; j < tiles; ++j) {
      const int64_t t0 = c.first + g * G + j * kL;
      const float* cb = c.rope_cos + t0 * P;
      const float* sb = c.rope_sin + t0 * P;
      for (int pp = 0; pp < P; ++pp) {
        const auto vc = hn::Set(d, cb[pp]), vs = hn::Set(d, sb[pp]);
        for (size_t c0 = 0; c0 < static_cast<size_t>(kL); c0 += N) {
          const auto o_c = hn::Load(d, co + pp * kL + c0), o_s = hn::Load(d, so + pp * kL + c0);
          hn::Store(hn::NegMulAdd(vs, o_s, hn::Mul(vc, o_c)), d, cs + pp * kL + c0);  // cos(a + b)
          hn::Store(hn::MulAdd(vc, o_s, hn::Mul(vs, o_c)), d, sn + pp * kL + c0);     // sin(a + b)
        }
      }
      for (int h = 0; h < H; ++h) {
        const uint8_t* tile = c.k + (static_cast<size_t>(h) * static_cast<size_t>(c.max_groups) + static_cast<size_t>(g)) * c.gbk +
                              header + static_cast<size_t>(j) * c.ktile_bytes;
        const uint8_t* kb = c.k_bits_ch + static_cast<size_t>(h) * uhd;
        const uint32_t* ko = c.k_off_ch + static_cast<size_t>(h) * uhd;
        const float* kp = (c.k_static ? c.k_static : kparams.data()) + static_cast<size_t>(h) * 2 * uhd;
        for (size_t c0 = 0; c0 < static_cast<size_t>(kL); c0 += N) {
          float* out = scores + static_cast<size_t>(h * rep) * uG + static_cast<size_t>(j) * kL;
          const float* qb = c.q + static_cast<size_t>(h * rep) * uhd;
          int r0 = 0;
          for (; r0 + 4 <= rep; r0 += 4) {
            ScoreTile<4>(d, tile, kb, ko, P, shifts, kp, uhd, cs, sn, qb + static_cast<size_t>(r0) * uhd, c0,
                         out + static_cast<size_t>(r0) * uG, uG);
          }
          for (; r0 + 2 <= rep; r0 += 2) {
            ScoreTile<2>(d, tile, kb, ko, P, shifts, kp, uhd, cs, sn, qb + static_cast<size_t>(r0) * uhd, c0,
                         out + static_cast<size_t>(r0) * uG, uG);
          }
          for (; r0 < rep; ++r0) {
            ScoreTile<1>(d, tile, kb, ko, P, shifts, kp, uhd, cs, sn, qb + static_cast<size_t>(r0) * uhd, c0,
                         out + static_cast<size_t>(r0) * uG, uG);
          }
        }
      }
    }
    // One softmax step per head for the whole group, then V.
    for (int h = 0; h < H; ++h) {
      const uint8_t* grp = c.v + (static_cast<size_t>(h) * static_cast<size_t>(c.max_groups) + static_cast<size_t>(g)) * c.gbv;
      if (c.v_static) {
        std::copy(c.v_static + static_cast<size_t>(h) * 2 * uhd, c.v_static + static_cast<size_t>(h) * 2 * uhd + uhd, vlo);
        std::copy(c.v_static + static_cast<size_t>(h) * 2 * uhd + uhd, c.v_static + static_cast<size_t>(h) * 2 * uhd + 2 * uhd,
                  vst);
      } else {
        DecodeGroupParams(grp, uhd, c.v_grid ? c.v_grid + static_cast<size_t>(h) * 3 * uhd : nullptr, vlo, vst);
      }
      for (int r = 0; r < rep; ++r) {
        const size_t qh = static_cast<size_t>(h * rep + r);
        const float* HWY_RESTRICT s = scores + qh * uG;
        auto vm = hn::Set(d, -std::numeric_limits<float>::infinity());
        for (size_t t = 0; t < uG; t += N) vm = hn::Max(vm, hn::LoadU(d, s + t));
        const float mg = hn::GetLane(hn::MaxOfLanes(d, vm));
        const float mn = std::max(m[qh], mg);
        alpha[r] = std::exp(m[qh] - mn);  // 0 when m was -inf
        m[qh] = mn;
        float* HWY_RESTRICT pr = pw + static_cast<size_t>(r) * uG;
        auto vsum = hn::Zero(d);
        const auto vmn = hn::Set(d, mn);
        for (size_t t = 0; t < uG; t += N) {
          const auto e = hn::Exp(d, hn::Sub(hn::LoadU(d, s + t), vmn));
          hn::StoreU(e, d, pr + t);
          vsum = hn::Add(vsum, e);
        }
        psum[r] = hn::GetLane(hn::SumOfLanes(d, vsum));
        l[qh] = l[qh] * alpha[r] + psum[r];
      }
      float* a = acc + static_cast<size_t>(h * rep) * uhd;
      const uint8_t* codes = grp + header;
      if (hd % 16 == 0) {
        AccumulateV(d, codes, vrow, G, hd, rep, vsh, pw, psum, alpha, vlo, vst, a);
      } else {
        const hn::CappedTag<float, 8> d8;
        AccumulateV(d8, codes, vrow, G, hd, rep, vsh, pw, psum, alpha, vlo, vst, a);
      }
    }
  }
  for (int qh = 0; qh < c.n_heads; ++qh) {
    const size_t uq = static_cast<size_t>(qh);
    if (l[uq] > 0.0f) {
      c.log_mass[uq] = static_cast<double>(m[uq]) + std::log(static_cast<double>(l[uq]));
      const float inv = 1.0f / l[uq];
      for (size_t i = 0; i < uhd; ++i) c.value[uq * uhd + i] = acc[uq * uhd + i] * inv;
    } else {
      c.log_mass[uq] = -std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < uhd; ++i) c.value[uq * uhd + i] = 0.0f;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kvq::grouped
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq::grouped {
HWY_EXPORT(AttendImpl);
void Attend(const Call& c) { HWY_DYNAMIC_DISPATCH(AttendImpl)(c); }
}  // namespace kvq::grouped
#endif
