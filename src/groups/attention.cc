// The fused attention kernel over coded groups (grouped_attention.h),
// Highway SIMD for every compiled target (one dispatch per call).
//
// Per group and query head: the group's K steps and lo fold into the query
// (W_i = q'_i step_i, C = q' . lo with q' = R(t0)^T q rotated once per
// 16-token tile), W is written in fixed point (one or two base-128 digits,
// scale sigma = max_i step_i |q_pair(i)| / kMaxW, which bounds |W_i| for
// every tile because RoPE keeps a pair's norm), and a tile's 16 scores are
// sigma * sum_i W^_i q_ti + C: integer dot products of the codes with the
// digits (AVX-512 VNNI vpdpbusd on AVX3_DL, 4 codes per lane; exact int32
// sums elsewhere). One online-softmax step per group: the weights
// p_t = exp(s_t - m) are written as P^_t = rne(p_t / sigma_p) in 0..kMaxP
// (sigma_p = max_t p_t / kMaxP) and the group's V sum is
//   sum_t p^_t x^_t = sigma_p (lo sum_t P^_t + step (.) sum_t P^_t q_t),
// again integer dot products (4 tokens per lane). The softmax normaliser
// uses the same p^ = sigma_p P^, so the output is exact attention with the
// weights p^.
//
// Error against exact attention over the decoded cache (derived in
// grouped_kv.h, tested in grouped_kv_test.cc): a score moves by at most
// sigma / 2 * sum_i q_ti, a weight by at most sigma_p / 2.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/groups/attention.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "kvq/half.h"
#include "src/groups/attention.h"

#ifndef KVQ_GROUPED_ATTENTION_ONCE
#define KVQ_GROUPED_ATTENTION_ONCE
namespace kvq::grouped {
namespace {
// Unpacking tables of a 64-code operand of b bits (AVX3_DL): vpermb places
// the b source bytes of codes 8m..8m+7 in qword m, vpmultishiftqb takes
// code j of the qword from bit j b, the mask keeps b bits.
struct UnpackTables {
  alignas(64) uint8_t perm[9][64];
  alignas(64) uint8_t shift[9][64];
  alignas(64) uint8_t mask[9][64];
  constexpr UnpackTables() : perm(), shift(), mask() {
    for (int b = 1; b <= 8; ++b) {
      for (int m = 0; m < 8; ++m) {
        for (int j = 0; j < 8; ++j) {
          perm[b][8 * m + j] = static_cast<uint8_t>(m * b + (j < b ? j : 0));
          shift[b][8 * m + j] = static_cast<uint8_t>(j * b);
          mask[b][8 * m + j] = static_cast<uint8_t>((1u << b) - 1);
        }
      }
    }
  }
};
constexpr UnpackTables kUnpack;

// Unpacking tables of the wide path, per width b (1..7): 16-bit lane i (of
// up to 16; every 128-bit block of a 256-bit vector holds the same 16 source
// bytes, and lanes 16..31 of a 512-bit one the 16 bytes of codes 16..31)
// takes the two bytes from byte (i b) / 8; the product with 2^(16 - s - b),
// s = (i b) % 8, moves its code to the top bits and a shift by 16 - b brings
// it down.
struct WideTables {
  alignas(64) uint8_t idx[8][64];
  alignas(64) uint16_t mul[8][32];
  constexpr WideTables() : idx(), mul() {
    for (int b = 1; b <= 7; ++b) {
      for (int k = 0; k < 32; ++k) {  // lanes 16..31 (512-bit vectors) repeat 0..15 from their own 16 bytes
        const int i = k % 16;
        idx[b][2 * k] = static_cast<uint8_t>(i * b / 8);
        idx[b][2 * k + 1] = static_cast<uint8_t>(i * b / 8 + 1);
        mul[b][k] = static_cast<uint16_t>(1u << (16 - (i * b) % 8 - b));
      }
    }
  }
};
constexpr WideTables kWide;
}  // namespace
std::atomic<int> g_dot_path{0};  // DotPath, for tests
void SetDotPathForTest(DotPath p) { g_dot_path.store(static_cast<int>(p), std::memory_order_relaxed); }
}  // namespace kvq::grouped
#endif

HWY_BEFORE_NAMESPACE();
namespace kvq::grouped {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::CappedTag<float, 16>;

// A run of channel quads of one K width: quads [k0, k1) of `bits`.
struct Run {
  int bits;
  size_t k0, k1;
};

// Scratch of one call, sized once.
struct Work {
  std::vector<Run> runs;          // every KV head's runs, head h's at [run_begin[h], run_begin[h + 1])
  std::vector<size_t> run_begin;
  size_t hd = 0, G = 0, nh = 0, rep = 0;
  hwy::AlignedFreeUniquePtr<float[]> f;
  hwy::AlignedFreeUniquePtr<int32_t[]> i;
  // float views
  float *klo, *kst, *vlo, *vst;         // [kv head][hd]
  float *qbar;                          // [q head][hd]: the pair-swapped query (q1, -q0)
  float *a, *b, *sigma;                 // [q head][hd] x2, [q head]
  float *lam;                           // [kv head][hd]: lo / step (steps of 0 replaced, see PrepareGroup)
  float *cos2, *sin2, *cos1, *sin1;     // the tile's rotation: [hd], [hd], [hd/2], [hd/2]
  float *scores, *acc, *m, *l, *psum, *sp, *al, *cst;  // [q head][G], [q head][hd], [q head] ...
  // int views
  int32_t *wd;  // [q head][digit][hd/4] packed W digits (4 bytes a quad)
  int32_t *pd;  // [q head][digit][G/4] packed P digits (4 tokens a word)
  int32_t *psumi;  // [q head] sum of P^ of the group
  // The wide path: weights and codes as 16-bit integers.
  bool wide = false;
  hwy::AlignedFreeUniquePtr<int16_t[]> s16;
  int16_t* w16;  // [q head][hd]: W^ of the tile (128 hi + lo)
  int16_t* p16;  // [q head][G]: P^ of the group
  int16_t* kc;   // [hd / 4][64]: one tile's K codes of one head
  int16_t* vc;   // [G / 4][4 vw]: one V channel block's codes of one head
  uint8_t* vc8;  // the same codes as bytes (the byte path, x86)
  void InitWide(size_t vw) {
    wide = true;
    const size_t n = nh * hd + nh * G + hd * 16 + G * vw + G * vw / 2;
    s16 = hwy::AllocateAligned<int16_t>(n + 64);
    std::fill(s16.get(), s16.get() + n + 64, int16_t{0});
    w16 = s16.get(), p16 = w16 + nh * hd, kc = p16 + nh * G;
    kc = reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(kc) + 63) & ~uintptr_t{63});
    vc = kc + hd * 16;
    vc8 = reinterpret_cast<uint8_t*>(vc + G * vw);  // 32-byte aligned: G * vw is a multiple of 32 codes
  }
  void Init(size_t hd_, size_t G_, size_t nh_, size_t nkv) {
    hd = hd_, G = G_, nh = nh_;
    // Each array starts on a 64-byte boundary (16 floats).
    const size_t sizes[] = {nkv * hd, nkv * hd, nkv * hd, nkv * hd, nh * hd, nh * hd, nh * hd, nh, nkv * hd,
                            hd, hd, hd / 2, hd / 2, nh * G, nh * hd, nh, nh, nh, nh, nh, nh};
    size_t nf = 0;
    for (size_t n : sizes) nf += (n + 15) / 16 * 16;
    f = hwy::AllocateAligned<float>(nf);
    std::fill(f.get(), f.get() + nf, 0.0f);
    float* p = f.get();
    size_t at = 0;
    auto take = [&] { float* r = p; p += (sizes[at++] + 15) / 16 * 16; return r; };
    klo = take(), kst = take(), vlo = take(), vst = take();
    qbar = take(), a = take(), b = take(), sigma = take(), lam = take();
    cos2 = take(), sin2 = take(), cos1 = take(), sin1 = take();
    scores = take(), acc = take(), m = take(), l = take(), psum = take(), sp = take(), al = take(), cst = take();
    const size_t ni = nh * 2 * (hd / 4) + nh * 2 * (G / 4) + nh;
    i = hwy::AllocateAligned<int32_t>(ni);
    std::fill(i.get(), i.get() + ni, 0);
    wd = i.get(), pd = wd + nh * 2 * (hd / 4), psumi = pd + nh * 2 * (G / 4);
  }
};

// DecodeGroupParams (grouped_attention.h) in SIMD: the same values (unit * a
// is exact, so fused or not the sum rounds once).
template <class D>
HWY_INLINE void DecodeParams(D d, const uint8_t* p, size_t hd, const float* grid, float* lo, float* st) {
  if (grid == nullptr) {
    DecodeGroupParams(p, hd, nullptr, lo, st);
    return;
  }
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> d8;
  const size_t N = hn::Lanes(d);
  for (size_t i = 0; i < hd; i += N) {
    const auto a = hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<D>(), hn::LoadU(d8, p + i)));
    const auto b = hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<D>(), hn::LoadU(d8, p + hd + i)));
    hn::StoreU(hn::MulAdd(hn::LoadU(d, grid + hd + i), hn::ConvertTo(d, a), hn::LoadU(d, grid + i)), d, lo + i);
    hn::StoreU(hn::Mul(hn::LoadU(d, grid + 2 * hd + i), hn::ConvertTo(d, hn::Sub(b, a))), d, st + i);
  }
}

// Per KV head: the group's K and V lo / step; per query head: the folded
// query a, b (W = a cos2 + b sin2, in units of sigma), the lo terms A, B
// (C = sum_i A_i cos2_i + B_i sin2_i) and the fixed-point scale sigma.
// With q' = R(t0)^T q: q'_i = q_i cos2_i + qbar_i sin2_i (qbar = (q1, -q0)
// per pair), so W_i = q'_i step_i and C = q' . lo.
template <class D>
void PrepareGroup(D d, const Call& c, const uint8_t* rec, Work& w) {
  const size_t N = hn::Lanes(d);
  const size_t hd = w.hd, H = static_cast<size_t>(c.n_kv_heads), rep = w.nh / H;
  const float maxw = static_cast<float>(kMaxW[c.k_digits]);
  for (size_t h = 0; h < H; ++h) {
    float* klo = w.klo + h * hd;
    float* kst = w.kst + h * hd;
    float* vlo = w.vlo + h * hd;
    float* vst = w.vst + h * hd;
    if (c.params == Params::kStatic) {
      std::copy(c.k_static + h * 2 * hd, c.k_static + h * 2 * hd + hd, klo);
      std::copy(c.k_static + h * 2 * hd + hd, c.k_static + (h + 1) * 2 * hd, kst);
      std::copy(c.v_static + h * 2 * hd, c.v_static + h * 2 * hd + hd, vlo);
      std::copy(c.v_static + h * 2 * hd + hd, c.v_static + (h + 1) * 2 * hd, vst);
    } else {
      const bool p8 = c.params == Params::kP8;
      DecodeParams(d, rec + c.layout.kparams(h), hd, p8 ? c.k_grid + h * 3 * hd : nullptr, klo, kst);
      DecodeParams(d, rec + c.layout.vparams(h), hd, p8 ? c.v_grid + h * 3 * hd : nullptr, vlo, vst);
    }
    // C = q' . lo = sum_i W_i lo_i / step_i: a channel whose step is 0 (all
    // its codes 0) gets a step of 2^-16 max(1, |lo|) instead (its value lo
    // unchanged), so lo / step stays finite.
    {
      const auto tiny = hn::Set(d, 0x1p-16f), one = hn::Set(d, 1.0f), zero = hn::Zero(d);
      for (size_t i = 0; i < hd; i += N) {
        const auto lo = hn::LoadU(d, klo + i);
        auto st = hn::LoadU(d, kst + i);
        st = hn::IfThenElse(hn::Gt(st, zero), st, hn::Mul(hn::Max(one, hn::Abs(lo)), tiny));
        hn::StoreU(st, d, kst + i);
        hn::StoreU(hn::Div(lo, st), d, w.lam + h * hd + i);
      }
    }
    for (size_t r = 0; r < rep; ++r) {
      const size_t qh = h * rep + r;
      const float* q = c.q + qh * hd;
      const float* qb = w.qbar + qh * hd;
      float* a = w.a + qh * hd;
      float* b = w.b + qh * hd;
      // sigma: the largest step_i |q_pair(i)| over kMaxW bounds |W_i| in every
      // tile (a little margin for the rounding of a cos + b sin).
      auto vm = hn::Zero(d);
      for (size_t i = 0; i < hd; i += N) {
        const auto qv = hn::LoadU(d, q + i), qbv = hn::LoadU(d, qb + i), st = hn::LoadU(d, kst + i);
        vm = hn::Max(vm, hn::Mul(hn::Mul(st, st), hn::MulAdd(qv, qv, hn::Mul(qbv, qbv))));
      }
      const float mx = std::sqrt(hn::GetLane(hn::MaxOfLanes(d, vm)));
      const float sigma = mx > 0.0f ? mx * 1.0001f / maxw : 0.0f;
      w.sigma[qh] = sigma;
      const auto inv = hn::Set(d, sigma > 0.0f ? 1.0f / sigma : 0.0f);
      for (size_t i = 0; i < hd; i += N) {
        const auto st = hn::Mul(hn::LoadU(d, kst + i), inv);
        hn::StoreU(hn::Mul(hn::LoadU(d, q + i), st), d, a + i);
        hn::StoreU(hn::Mul(hn::LoadU(d, qb + i), st), d, b + i);
      }
    }
  }
}

// The rotation of tile `tile` (position first + 16 tile): cos / sin per
// pair and per channel.
void TileRotation(const Call& c, int64_t tile, Work& w) {
  const size_t P = w.hd / 2;
  const float* cs = c.tile_cos + static_cast<size_t>(tile) * P;
  const float* sn = c.tile_sin + static_cast<size_t>(tile) * P;
  for (size_t p = 0; p < P; ++p) {
    w.cos2[2 * p] = w.cos2[2 * p + 1] = cs[p];
    w.sin2[2 * p] = w.sin2[2 * p + 1] = sn[p];
  }
}

// Query head qh's W digits for the current tile (packed bytes, quad-major,
// into w.wd) and its constant C (into w.cst).
template <class D>
void TileWeights(D d, const Call& c, size_t qh, Work& w) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<int8_t, D> d8;
  const size_t N = hn::Lanes(d), hd = w.hd, nq = hd / 4;
  const float* a = w.a + qh * hd;
  const float* b = w.b + qh * hd;
  int8_t* lo = reinterpret_cast<int8_t*>(w.wd + qh * 2 * nq);
  int8_t* hi = lo + 4 * nq;
  const auto m7 = hn::Set(di, 127);
  for (size_t i = 0; i < hd; i += N) {
    const auto wf = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, w.cos2 + i), hn::Mul(hn::LoadU(d, b + i), hn::LoadU(d, w.sin2 + i)));
    const auto wi = hn::NearestInt(wf);
    if (c.k_digits == 1) {
      const auto d0 = hn::DemoteTo(d8, wi);
      hn::StoreU(d0, d8, lo + i);
    } else {
      const auto d0 = hn::DemoteTo(d8, hn::And(wi, m7)), d1 = hn::DemoteTo(d8, hn::ShiftRight<7>(wi));
      hn::StoreU(d0, d8, lo + i);
      hn::StoreU(d1, d8, hi + i);
    }
  }
  // C / sigma = sum_i (W_i / sigma) lo_i / step_i (the rotated query times lo).
  const float* lam = w.lam + (qh / (w.nh / static_cast<size_t>(c.n_kv_heads))) * hd;
  auto s0 = hn::Zero(d);
  for (size_t i = 0; i < hd; i += N) {
    const auto wf = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, w.cos2 + i), hn::Mul(hn::LoadU(d, b + i), hn::LoadU(d, w.sin2 + i)));
    s0 = hn::MulAdd(wf, hn::LoadU(d, lam + i), s0);
  }
  const float cst = hn::GetLane(hn::SumOfLanes(d, s0)) * w.sigma[qh];
  w.cst[qh] = cst;
}

// One online-softmax step of query head qh over the group's G scores: the
// weights as P^ digits (w.pd), their integer sum, the rescale of what was
// accumulated (w.al) and sigma_p (w.sp).
void SoftmaxStep(const Call& c, size_t qh, Work& w) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<int8_t, DF> d8;
  const size_t N = hn::Lanes(d), G = w.G;
  const float* s = w.scores + qh * G;
  auto vm = hn::Set(d, -std::numeric_limits<float>::infinity());
  for (size_t t = 0; t < G; t += N) vm = hn::Max(vm, hn::LoadU(d, s + t));
  const float mg = hn::GetLane(hn::MaxOfLanes(d, vm));
  const float mn = std::max(w.m[qh], mg);
  const float alpha = mg <= w.m[qh] ? 1.0f : std::exp(w.m[qh] - mn);  // 0 when m was -inf
  w.m[qh] = mn;
  const float pmax = std::exp(mg - mn);
  const int maxp = kMaxP[c.v_digits];
  const float sp = pmax / static_cast<float>(maxp);
  const float inv = pmax > 0.0f ? static_cast<float>(maxp) / pmax : 0.0f;
  int8_t* lo = reinterpret_cast<int8_t*>(w.pd + qh * 2 * (G / 4));
  int8_t* hi = lo + G;
  auto vsum = hn::Zero(di);
  const auto vmn = hn::Set(d, mn), vinv = hn::Set(d, inv);
  const auto m7 = hn::Set(di, 127);
  const hn::Rebind<int16_t, DF> d16;
  int16_t* p16 = w.p16 + qh * G;
  for (size_t t = 0; t < G; t += N) {
    const auto e = hn::Exp(d, hn::Sub(hn::LoadU(d, s + t), vmn));
    // p <= pmax, so P^ <= kMaxP (both exps within a few ulp of exact).
    const auto pi = hn::NearestInt(hn::Mul(e, vinv));
    vsum = hn::Add(vsum, pi);
    if (w.wide) {  // P^ itself: the digits' value 128 hi + lo (P^ <= kMaxP)
      hn::StoreU(hn::DemoteTo(d16, pi), d16, p16 + t);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
      if (c.v_digits == 1) hn::StoreU(hn::DemoteTo(d8, pi), d8, lo + t);  // and as bytes (x86's byte path)
#endif
    } else if (c.v_digits == 1) {
      hn::StoreU(hn::DemoteTo(d8, pi), d8, lo + t);
    } else {
      hn::StoreU(hn::DemoteTo(d8, hn::And(pi, m7)), d8, lo + t);
      hn::StoreU(hn::DemoteTo(d8, hn::ShiftRight<7>(pi)), d8, hi + t);
    }
  }
  const int32_t psum = hn::GetLane(hn::SumOfLanes(di, vsum));
  w.psumi[qh] = psum;
  w.al[qh] = alpha;
  w.sp[qh] = sp;
  w.l[qh] = w.l[qh] * alpha + sp * static_cast<float>(psum);
}

// acc[qh] = acc alpha + sigma_p (vlo sum P^ + vst (.) sums[ch]) for the
// channels [c0, c0 + n), sums the integer V sums as floats.
HWY_INLINE void FinishV(size_t qh, size_t h, size_t c0, size_t n, const float* HWY_RESTRICT sums, Work& w) {
  const hn::CappedTag<float, 8> d;
  const size_t N = hn::Lanes(d);
  float* HWY_RESTRICT acc = w.acc + qh * w.hd + c0;
  const float* HWY_RESTRICT vlo = w.vlo + h * w.hd + c0;
  const float* HWY_RESTRICT vst = w.vst + h * w.hd + c0;
  const auto al = hn::Set(d, w.al[qh]), sp = hn::Set(d, w.sp[qh]), ps = hn::Set(d, static_cast<float>(w.psumi[qh]));
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto t = hn::MulAdd(hn::LoadU(d, vst + i), hn::LoadU(d, sums + i), hn::Mul(hn::LoadU(d, vlo + i), ps));
    hn::StoreU(hn::MulAdd(hn::LoadU(d, acc + i), al, hn::Mul(sp, t)), d, acc + i);
  }
  for (; i < n; ++i) acc[i] = acc[i] * w.al[qh] + w.sp[qh] * (vst[i] * sums[i] + vlo[i] * static_cast<float>(w.psumi[qh]));
}

// ---- portable integer dot products (exact int32; every target) -----------------

void ScoresPortable(const Call& c, const uint8_t* tile, size_t h, size_t rep, size_t j, Work& w) {
  const size_t hd = w.hd, nq = hd / 4;
  const uint8_t* kb = c.k_quad_bits + h * nq;
  const uint32_t* ko = c.k_quad_off + h * nq;
  int32_t dots[64][kTile];
  uint8_t u[64];
  std::memset(dots, 0, sizeof(dots));
  for (size_t k = 0; k < nq; ++k) {
    UnpackCodes(tile + ko[k], 64, kb[k], u);
    for (size_t r = 0; r < rep; ++r) {
      const size_t qh = h * rep + r;
      const int8_t* lo = reinterpret_cast<const int8_t*>(w.wd + qh * 2 * nq) + 4 * k;
      const int8_t* hi = lo + 4 * nq;
      for (int l = 0; l < kTile; ++l) {
        int32_t s = 0;
        for (int jj = 0; jj < 4; ++jj) {
          const int32_t wq = c.k_digits == 1 ? lo[jj] : 128 * hi[jj] + lo[jj];
          s += wq * u[4 * l + jj];
        }
        dots[r][l] += s;
      }
    }
  }
  for (size_t r = 0; r < rep; ++r) {
    const size_t qh = h * rep + r;
    float* out = w.scores + qh * w.G + j * kTile;
    for (int l = 0; l < kTile; ++l) out[l] = static_cast<float>(dots[r][l]) * w.sigma[qh] + w.cst[qh];
  }
}

void AccumulateVPortable(const Call& c, const uint8_t* rec, size_t h, size_t rep, Work& w) {
  const size_t hd = w.hd, G = w.G;
  const int vb = c.v_bits;
  const size_t vw = c.layout.vw;
  uint8_t u[64];
  float sums[16];
  for (size_t x = 0; x < hd / vw; ++x) {
    for (size_t r = 0; r < rep; ++r) {
      const size_t qh = h * rep + r;
      const int8_t* lo = reinterpret_cast<const int8_t*>(w.pd + qh * 2 * (G / 4));
      const int8_t* hi = lo + G;
      int64_t s[16] = {};  // exact: a long group of 8-bit codes can pass 2^31
      for (size_t r4 = 0; r4 < G / 4; ++r4) {
        UnpackCodes(rec + c.layout.voperand(h, x, r4), 4 * vw, vb, u);
        for (size_t n = 0; n < vw; ++n) {
          for (int jj = 0; jj < 4; ++jj) {
            const int32_t pq = c.v_digits == 1 ? lo[4 * r4 + jj] : 128 * hi[4 * r4 + jj] + lo[4 * r4 + jj];
            s[n] += pq * u[4 * n + jj];
          }
        }
      }
      for (size_t n = 0; n < vw; ++n) sums[n] = static_cast<float>(s[n]);
      FinishV(qh, h, x * vw, vw, sums, w);
    }
  }
}

#include "src/groups/wide-inl.h"  // KVQ_WIDE, KVQ_WIDE512, KVQ_BYTES and the wide functions

#include "src/groups/vnni-inl.h"  // AVX3_DL only

HWY_INLINE void PrefetchRange(const uint8_t* p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) hwy::Prefetch(p + off);
}

void AttendImpl(const Call& c) {
  const size_t hd = static_cast<size_t>(c.head_dim), G = static_cast<size_t>(c.group);
  const size_t H = static_cast<size_t>(c.n_kv_heads), nh = static_cast<size_t>(c.n_heads), rep = nh / H;
  Work w;
  w.Init(hd, G, nh, H);
  std::fill(w.m, w.m + nh, -std::numeric_limits<float>::infinity());
  for (size_t i = 0; i < nh * hd; i += 2) w.qbar[i] = c.q[i + 1], w.qbar[i + 1] = -c.q[i];
  for (size_t h = 0; h < H; ++h) {
    w.run_begin.push_back(w.runs.size());
    const uint8_t* kb = c.k_quad_bits + h * (hd / 4);
    for (size_t k = 0; k < hd / 4; ++k) {
      if (w.runs.size() > w.run_begin.back() && w.runs.back().bits == kb[k]) {
        w.runs.back().k1 = k + 1;
      } else {
        w.runs.push_back({kb[k], k, k + 1});
      }
    }
  }
  w.run_begin.push_back(w.runs.size());
  // Which integer dot products: VNNI (AVX3_DL, head_dim % 16 == 0), else the
  // wide path; tests can force the wide or the scalar loops (SetDotPathForTest).
  const DotPath forced = static_cast<DotPath>(g_dot_path.load(std::memory_order_relaxed));
#if HWY_TARGET == HWY_AVX3_DL
  const bool vnni = hd % 16 == 0 && forced == DotPath::kAuto;
#else
  const bool vnni = false;
#endif
  const bool scalar = forced == DotPath::kScalar || !KVQ_WIDE;
  if (!vnni && !scalar) w.InitWide(c.layout.vw);
#if KVQ_WIDE512
  const bool wide512 = w.wide && hd % 16 == 0;
#endif
  // Software prefetches pay on the VNNI path (measured); the wide path leaves
  // the stream to the hardware prefetcher.
  const bool prefetch = !w.wide;
  for (int64_t g = c.g0; g < c.g1; ++g) {
    const uint8_t* rec = c.groups[g];
    const uint8_t* end = rec + c.layout.bytes();
    (void)end;  // the wide path reads within it
    // The next record's parameters (the rest streams in order).
    if (prefetch && g + 1 < c.g1) {
      const uint8_t* nx = c.groups[g + 1];
      for (size_t off = 0; off < c.layout.codes() + 256; off += 64) hwy::Prefetch(nx + off);
    }
    if (hd % 16 == 0) {
      PrepareGroup(DF(), c, rec, w);
    } else {
      PrepareGroup(hn::CappedTag<float, 8>(), c, rec, w);
    }
    const RecordLayout& L = c.layout;
    for (size_t j = 0; j < G / kTile; ++j) {
      TileRotation(c, g * static_cast<int64_t>(G / kTile) + static_cast<int64_t>(j), w);
#if HWY_TARGET == HWY_AVX3_DL
      if (vnni) {
        for (size_t h = 0; h < H; ++h) TileWeightsDl(c, h, rep, w);
      } else
#endif
#if KVQ_WIDE
      if (w.wide) {
        for (size_t h = 0; h < H; ++h) {
          if (hd % 16 == 0) {
            TileWeightsWide(DF(), h, rep, w);
          } else {
            TileWeightsWide(hn::CappedTag<float, 8>(), h, rep, w);
          }
        }
      } else
#endif
      if (hd % 16 == 0) {
        for (size_t qh = 0; qh < nh; ++qh) TileWeights(DF(), c, qh, w);
      } else {  // head_dim 8, 24, ...: vectors of at most 8 lanes
        for (size_t qh = 0; qh < nh; ++qh) TileWeights(hn::CappedTag<float, 8>(), c, qh, w);
      }
      for (size_t h = 0; h < H; ++h) {
        const uint8_t* tile = rec + c.layout.tile(j, h);
        // The next tile's codes of this head, a head at a time (a burst of
        // prefetches fills the miss buffers and stalls); after the last
        // tile, the V codes that follow.
        if (prefetch) PrefetchRange(tile + H * L.ktile, L.ktile);
#if HWY_TARGET == HWY_AVX3_DL
        if (vnni) {
          if (c.k_digits == 1) {
            ScoresVnni<1>(c, tile, h, rep, j, w);
          } else {
            ScoresVnni<2>(c, tile, h, rep, j, w);
          }
          continue;
        }
#endif
#if KVQ_WIDE512
        if (wide512) {
          WideScores<W512>(c, tile, end, h, rep, j, w);
          continue;
        }
#endif
#if KVQ_WIDE
        if (w.wide) {
          WideScores<W256>(c, tile, end, h, rep, j, w);
          continue;
        }
#endif
        ScoresPortable(c, tile, h, rep, j, w);
      }
    }
    for (size_t qh = 0; qh < nh; ++qh) SoftmaxStep(c, qh, w);
    const size_t vhead = L.vblocks() * L.vquads() * L.vop;
    for (size_t h = 0; h < H; ++h) {
      if (prefetch && h + 1 < H) PrefetchRange(rec + L.voperand(h + 1, 0, 0), vhead);
#if HWY_TARGET == HWY_AVX3_DL
      if (vnni) {
        if (c.v_digits == 1) {
          AccumulateVVnni<1>(c, rec, h, rep, w);
        } else {
          AccumulateVVnni<2>(c, rec, h, rep, w);
        }
        continue;
      }
#endif
#if KVQ_WIDE512
      if (wide512) {
        WideV<W512>(c, rec, end, h, rep, w);
        continue;
      }
#endif
#if KVQ_WIDE
      if (w.wide) {
        WideV<W256>(c, rec, end, h, rep, w);
        continue;
      }
#endif
      AccumulateVPortable(c, rec, h, rep, w);
    }
  }
  for (size_t qh = 0; qh < nh; ++qh) {
    if (w.l[qh] > 0.0f) {
      c.log_mass[qh] = static_cast<double>(w.m[qh]) + std::log(static_cast<double>(w.l[qh]));
      const float inv = 1.0f / w.l[qh];
      for (size_t i = 0; i < hd; ++i) c.value[qh * hd + i] = w.acc[qh * hd + i] * inv;
    } else {
      c.log_mass[qh] = -std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < hd; ++i) c.value[qh * hd + i] = 0.0f;
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

void UnpackCodes(const uint8_t* p, size_t n, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, p, n);
    return;
  }
  if (bits == 4) {
    for (size_t i = 0; i < n / 2; ++i) out[2 * i] = p[i] & 15, out[2 * i + 1] = static_cast<uint8_t>(p[i] >> 4);
    return;
  }
  if (bits == 2) {
    for (size_t i = 0; i < n / 4; ++i) {
      out[4 * i] = p[i] & 3, out[4 * i + 1] = (p[i] >> 2) & 3, out[4 * i + 2] = (p[i] >> 4) & 3;
      out[4 * i + 3] = static_cast<uint8_t>(p[i] >> 6);
    }
    return;
  }
  uint64_t acc = 0;
  int have = 0;
  const uint32_t mask = (1u << bits) - 1;
  for (size_t i = 0; i < n; ++i) {
    if (have < bits) {
      acc |= static_cast<uint64_t>(*p++) << have;
      have += 8;
    }
    out[i] = static_cast<uint8_t>(acc & mask);
    acc >>= bits;
    have -= bits;
  }
}
}  // namespace kvq::grouped
#endif
