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

#if HWY_TARGET != HWY_SCALAR && !HWY_HAVE_SCALABLE
#undef KVQ_WIDE
#define KVQ_WIDE 1
// ---- wide integer dot products (every fixed-width target; AVX3_DL uses VNNI when it can) ----
// Codes unpacked to 16-bit lanes, weights as 16-bit integers (the digits'
// value 128 hi + lo, as the scalar loops above form it), multiplied by
// ReorderWidenMulAccumulate (vpmaddwd on x86, smull/smlal on NEON) and
// paired by RearrangeToOddPlusEven: the same exact integer sums as
// ScoresPortable / AccumulateVPortable, then the same float operations, so
// the same scores and outputs bit for bit (tested).
// Rounds a and b (in the int16 range) to the nearest integer, ties to even,
// and stores them as 2 N 16-bit integers in order: on x86 one cvtps2dq each
// (no overflow fix-up: the values are in range by construction) and one
// pack; elsewhere NearestInt and DemoteTo.
template <class D>
HWY_INLINE void StoreNearest16x2(D d, hn::Vec<D> a, hn::Vec<D> b, int16_t* HWY_RESTRICT out) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  if constexpr (hn::MaxLanes(D()) == 8) {
    const __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(a.raw), _mm256_cvtps_epi32(b.raw));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(p, 0xD8));
    return;
  }
#endif
  const hn::Rebind<int16_t, D> d16;
  hn::StoreU(hn::DemoteTo(d16, hn::NearestInt(a)), d16, out);
  hn::StoreU(hn::DemoteTo(d16, hn::NearestInt(b)), d16, out + hn::Lanes(d));
}

// TileWeights for the wide path, for the RB query heads [qh0, qh0 + RB) of
// one KV head (the rotation and lo / step loaded once): the weights as
// 16-bit integers (w.w16; |W^| <= kMaxW by the choice of sigma, so the
// digits' value 128 hi + lo is W^ itself) and C, in one pass.
template <int RB, class D>
HWY_INLINE void TileWeightsWideBlock(D d, size_t h, size_t qh0, Work& w) {
  const hn::Rebind<int16_t, D> d16;
  const size_t N = hn::Lanes(d), hd = w.hd;
  // The arrays as restrict locals: the stores to w16 need not reload them.
  const float* HWY_RESTRICT lam = w.lam + h * hd;
  const float* HWY_RESTRICT cos2 = w.cos2;
  const float* HWY_RESTRICT sin2 = w.sin2;
  const float* HWY_RESTRICT wa = w.a + qh0 * hd;
  const float* HWY_RESTRICT wb = w.b + qh0 * hd;
  int16_t* HWY_RESTRICT w16 = w.w16 + qh0 * hd;
  hn::Vec<D> s[RB];
  for (int r = 0; r < RB; ++r) s[r] = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= hd; i += 2 * N) {  // two vectors at a time: one pack
    const auto c0 = hn::LoadU(d, cos2 + i), s0 = hn::LoadU(d, sin2 + i), l0 = hn::LoadU(d, lam + i);
    const auto c1 = hn::LoadU(d, cos2 + i + N), s1 = hn::LoadU(d, sin2 + i + N), l1 = hn::LoadU(d, lam + i + N);
    for (int r = 0; r < RB; ++r) {
      const float* a = wa + static_cast<size_t>(r) * hd + i;
      const float* b = wb + static_cast<size_t>(r) * hd + i;
      const auto w0 = hn::MulAdd(hn::LoadU(d, a), c0, hn::Mul(hn::LoadU(d, b), s0));
      const auto w1 = hn::MulAdd(hn::LoadU(d, a + N), c1, hn::Mul(hn::LoadU(d, b + N), s1));
      StoreNearest16x2(d, w0, w1, w16 + static_cast<size_t>(r) * hd + i);
      s[r] = hn::MulAdd(w1, l1, hn::MulAdd(w0, l0, s[r]));
    }
  }
  for (; i < hd; i += N) {
    const auto c2 = hn::LoadU(d, w.cos2 + i), s2 = hn::LoadU(d, w.sin2 + i), l = hn::LoadU(d, lam + i);
    for (int r = 0; r < RB; ++r) {
      const size_t qh = qh0 + static_cast<size_t>(r);
      const auto wf = hn::MulAdd(hn::LoadU(d, w.a + qh * hd + i), c2, hn::Mul(hn::LoadU(d, w.b + qh * hd + i), s2));
      hn::StoreU(hn::DemoteTo(d16, hn::NearestInt(wf)), d16, w.w16 + qh * hd + i);
      s[r] = hn::MulAdd(wf, l, s[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    const size_t qh = qh0 + static_cast<size_t>(r);
    w.cst[qh] = hn::GetLane(hn::SumOfLanes(d, s[r])) * w.sigma[qh];
  }
}

template <class D>
void TileWeightsWide(D d, size_t h, size_t rep, Work& w) {
  size_t r = 0;
  for (; r + 4 <= rep; r += 4) TileWeightsWideBlock<4>(d, h, h * rep + r, w);
  for (; r + 2 <= rep; r += 2) TileWeightsWideBlock<2>(d, h, h * rep + r, w);
  for (; r < rep; ++r) TileWeightsWideBlock<1>(d, h, h * rep + r, w);
}

// fn(r0, integral_constant<B>) for the query heads of one KV head in blocks
// of RB (B = RB), then one at a time (B = 1).
template <size_t RB, class Fn>
HWY_INLINE void ForHeadBlocks(size_t rep, const Fn& fn) {
  size_t r = 0;
  for (; r + RB <= rep; r += RB) fn(r, std::integral_constant<size_t, RB>());
  for (; r < rep; ++r) fn(r, std::integral_constant<size_t, 1>());
}

// The wide path's 16-bit vectors: WideOps<D16> holds every function whose
// vectors are D16's (16 lanes of 256 bits on x86's AVX2 / AVX3 and
// AVX3_DL's head sizes that are not a multiple of 16, 8 lanes on SSE4 and
// NEON; 32 lanes of 512 bits on AVX3 and AVX3_DL at head sizes that are).
template <class D16Tag>
struct WideOps {
using D16 = D16Tag;
using D32 = hn::Repartition<int32_t, D16>;
using DF2 = hn::Repartition<float, D16>;  // half as many lanes as D16
static constexpr size_t kN16 = hn::MaxLanes(D16());
using V32 = hn::Vec<D32>;

// Vector v of codes (16-bit lanes) of an operand run of `bits` bits packed
// from p on (whole operands back to back). A vector reads 16 bytes from its
// first source byte (and, with 32 lanes, 16 from that of its code 16): the
// last ones, within reach of `end` (the record's end), read from a copy (At
// checks; AtInPlace is for v < in_place).
class CodeVectors {
 public:
  HWY_INLINE CodeVectors(const uint8_t* p, int bits, const uint8_t* end)
      : p_(p), bits_(bits), step_(kN16 * static_cast<size_t>(bits) / 8) {
    const hn::Repartition<uint8_t, D16> du8;
    const hn::RebindToUnsigned<D16> du16;
    const size_t reach = 16 + (kN16 > 16 ? step_ / 2 : 0), avail = static_cast<size_t>(end - p);
    in_place = bits == 8 ? ~size_t{0} : avail >= reach ? (avail - reach) / step_ + 1 : 0;
    if (bits < 8) idx_ = hn::LoadU(du8, kWide.idx[bits]), mul_ = hn::LoadU(du16, kWide.mul[bits]);
  }
  HWY_INLINE hn::Vec<D16> AtInPlace(size_t v) const { return From(p_ + v * step_); }
  HWY_INLINE hn::Vec<D16> At(size_t v) const {
    if (HWY_LIKELY(v < in_place)) return AtInPlace(v);
    HWY_ALIGN uint8_t copy[64] = {};
    std::memcpy(copy, p_ + v * step_, step_);  // step <= 28 bytes are this vector's
    return From(copy);
  }
  size_t in_place;

 private:
  HWY_INLINE hn::Vec<D16> From(const uint8_t* src) const {
    const D16 d16;
    const hn::RebindToUnsigned<D16> du16;
    const hn::Repartition<uint8_t, D16> du8;
    if (bits_ == 8) return hn::BitCast(d16, hn::PromoteTo(du16, hn::LoadU(hn::Rebind<uint8_t, D16>(), src)));
    hn::Vec<decltype(du8)> bytes;
    if constexpr (kN16 > 16) {  // codes 0..15 and 16..31 from their own 16 bytes
      const hn::Half<decltype(du8)> dh;
      bytes = hn::Combine(du8, hn::LoadDup128(dh, src + step_ / 2), hn::LoadDup128(dh, src));
    } else {
      bytes = hn::LoadDup128(du8, src);
    }
    const auto x = hn::BitCast(du16, hn::TableLookupBytes(bytes, idx_));
    return hn::BitCast(d16, hn::ShiftRightSame(hn::Mul(x, mul_), 16 - bits_));
  }
  const uint8_t* p_;
  int bits_;
  size_t step_;
  hn::Vec<hn::Repartition<uint8_t, D16>> idx_;
  hn::Vec<hn::RebindToUnsigned<D16>> mul_;
};

// The n codes (a multiple of kN16) of `bits` bits packed from p on, one
// 16-bit lane each, to out (aligned).
static HWY_INLINE void UnpackWide(const uint8_t* p, size_t n, int bits, const uint8_t* end, int16_t* HWY_RESTRICT out) {
  const D16 d16;
  constexpr size_t N = kN16;
  const CodeVectors cv(p, bits, end);
  const size_t nv = n / N, fast = std::min(nv, cv.in_place);
  size_t v = 0;
  for (; v + 2 <= fast; v += 2) {
    const auto a = cv.AtInPlace(v), b = cv.AtInPlace(v + 1);
    hn::Store(a, d16, out + v * N), hn::Store(b, d16, out + (v + 1) * N);
  }
  for (; v < nv; ++v) hn::Store(cv.At(v), d16, out + v * N);
}

// Four 16-bit weights, repeated over the vector.
static HWY_INLINE hn::Vec<D16> Repeat4(const int16_t* p) {
  const D16 d16;
  const hn::Repartition<int64_t, D16> d64;
  int64_t bits;
  std::memcpy(&bits, p, 8);
  return hn::BitCast(d16, hn::Set(d64, bits));
}

// Vectors a, b of pair sums (lane m: codes 2m, 2m + 1) -> the sums of
// pairs (2i, 2i + 1): a's in the lower half, b's in the upper.
static HWY_INLINE V32 SumPairs(V32 a, V32 b) {
  const D32 d32;
  return hn::Add(hn::ConcatEven(d32, b, a), hn::ConcatOdd(d32, b, a));
}

// The tile's K codes of head h as 16-bit lanes into w.kc, a run of quads
// (back to back, one width) at a time.
static HWY_INLINE void UnpackTile(const Call& c, const uint8_t* tile, const uint8_t* end, size_t h, Work& w) {
  const uint32_t* ko = c.k_quad_off + h * (w.hd / 4);
  for (size_t ri = w.run_begin[h]; ri < w.run_begin[h + 1]; ++ri) {
    const Run& run = w.runs[ri];
    UnpackWide(tile + ko[run.k0], 64 * (run.k1 - run.k0), run.bits, end, w.kc + 64 * run.k0);
  }
}

// Query head qh's 16 scores of tile j from its NV pair-sum vectors (vector
// v: tokens 4v .. 4v + 3, each as the pair sums of its channels 0-1, 2-3).
template <size_t NV>
static HWY_INLINE void StoreScores(size_t qh, size_t j, const V32 (&s0)[NV], const V32 (&s1)[NV], Work& w) {
  const DF2 df;
  constexpr size_t N = kN16;
  // Token l of the tile: pairs 2l and 2l + 1 (its four channels).
  float* out = w.scores + qh * w.G + j * kTile;
  const auto sigma = hn::Set(df, w.sigma[qh]), cst = hn::Set(df, w.cst[qh]);
  for (size_t u = 0; u < NV / 2; ++u) {
    const V32 t = SumPairs(hn::RearrangeToOddPlusEven(s0[2 * u], s1[2 * u]), hn::RearrangeToOddPlusEven(s0[2 * u + 1], s1[2 * u + 1]));
    hn::StoreU(hn::Add(hn::Mul(hn::ConvertTo(df, t), sigma), cst), df, out + u * (N / 2));
  }
}

// NV vectors of codes per operand (64 / kN16).
template <size_t NV>
static void ScoresWide(const Call& c, const uint8_t* tile, const uint8_t* end, size_t h, size_t rep, size_t j, Work& w) {
  const D16 d16;
  const D32 d32;
  constexpr size_t N = kN16;
  const size_t hd = w.hd, nq = hd / 4;
  UnpackTile(c, tile, end, h, w);
  // RB query heads a pass over the codes (each code vector loaded once for
  // them): two when their accumulators and the codes fit the registers.
  constexpr size_t RB = NV <= 4 ? 2 : 1;
  const auto heads = [&](size_t r0, auto rb) {
    constexpr size_t B = decltype(rb)::value;
    V32 s0[B][NV], s1[B][NV];
    for (size_t b = 0; b < B; ++b) {
      for (size_t v = 0; v < NV; ++v) s0[b][v] = s1[b][v] = hn::Zero(d32);
    }
    const int16_t* wq = w.w16 + (h * rep + r0) * hd;
    for (size_t k = 0; k < nq; ++k) {
      const int16_t* codes = w.kc + 64 * k;
      hn::Vec<D16> cv[NV];
      for (size_t v = 0; v < NV; ++v) cv[v] = hn::Load(d16, codes + v * N);
      for (size_t b = 0; b < B; ++b) {
        const auto wv = Repeat4(wq + b * hd + 4 * k);
        for (size_t v = 0; v < NV; ++v) s0[b][v] = hn::ReorderWidenMulAccumulate(d32, cv[v], wv, s0[b][v], s1[b][v]);
      }
    }
    for (size_t b = 0; b < B; ++b) StoreScores<NV>(h * rep + r0 + b, j, s0[b], s1[b], w);
  };
  ForHeadBlocks<RB>(rep, heads);
}

// FinishV for the channels [c0, c0 + Lanes(DF2)) from a vector of sums (the
// same operations, lane by lane).
static HWY_INLINE void FinishVVec(size_t qh, size_t h, size_t c0, hn::Vec<DF2> sums, Work& w) {
  const DF2 d;
  float* HWY_RESTRICT acc = w.acc + qh * w.hd + c0;
  const auto al = hn::Set(d, w.al[qh]), sp = hn::Set(d, w.sp[qh]), ps = hn::Set(d, static_cast<float>(w.psumi[qh]));
  const auto t = hn::MulAdd(hn::LoadU(d, w.vst + h * w.hd + c0), sums, hn::Mul(hn::LoadU(d, w.vlo + h * w.hd + c0), ps));
  hn::StoreU(hn::MulAdd(hn::LoadU(d, acc), al, hn::Mul(sp, t)), d, acc);
}

// NV vectors of codes per operand (4 vw / kN16).
template <size_t NV>
static void AccumulateVWide(const Call& c, const uint8_t* rec, const uint8_t* end, size_t h, size_t rep, Work& w) {
  const D16 d16;
  const D32 d32;
  const DF2 df;
  constexpr size_t N = kN16, ncodes = NV * N, vw = ncodes / 4;
  const size_t hd = w.hd, G = w.G, nops = G / 4;
  // Quads per int32 pass: 64 quads of 255 x 16383 x 4 stay below 2^31.
  constexpr size_t kPass = 64;
  for (size_t x = 0; x < hd / vw; ++x) {
    UnpackWide(rec + c.layout.voperand(h, x, 0), nops * ncodes, c.v_bits, end, w.vc);  // the block's operands, back to back
    for (size_t r = 0; r < rep; ++r) {
      const size_t qh = h * rep + r;
      const int16_t* pq = w.p16 + qh * G;
      int64_t tot[16] = {};
      for (size_t q0 = 0; q0 < nops; q0 += kPass) {
        V32 s0[NV], s1[NV];
        for (size_t v = 0; v < NV; ++v) s0[v] = s1[v] = hn::Zero(d32);
        const size_t q1 = std::min(nops, q0 + kPass);
        for (size_t r4 = q0; r4 < q1; ++r4) {
          const auto pv = Repeat4(pq + 4 * r4);
          const int16_t* codes = w.vc + r4 * ncodes;
          for (size_t v = 0; v < NV; ++v) s0[v] = hn::ReorderWidenMulAccumulate(d32, hn::Load(d16, codes + v * N), pv, s0[v], s1[v]);
        }
        // Channel n of the block: pairs 2n and 2n + 1 (its four tokens).
        for (size_t u = 0; u < NV / 2; ++u) {
          const V32 ch = SumPairs(hn::RearrangeToOddPlusEven(s0[2 * u], s1[2 * u]), hn::RearrangeToOddPlusEven(s0[2 * u + 1], s1[2 * u + 1]));
          if (nops <= kPass) {  // one pass: the exact sums
            FinishVVec(qh, h, x * vw + u * (N / 2), hn::ConvertTo(df, ch), w);
          } else {
            HWY_ALIGN int32_t part[N / 2];
            hn::Store(ch, d32, part);
            for (size_t i = 0; i < N / 2; ++i) tot[u * (N / 2) + i] += part[i];
          }
        }
      }
      if (nops > kPass) {
        float sums[16];
        for (size_t n = 0; n < vw; ++n) sums[n] = static_cast<float>(tot[n]);
        FinishV(qh, h, x * vw, vw, sums, w);
      }
    }
  }
}

#undef KVQ_BYTES
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define KVQ_BYTES 1
// ---- the byte path of the V sums (x86: AVX2, AVX3) -----------------------------
// With one digit (P^ <= 127, codes of at most 3 bits) a V sum takes one
// vpmaddubsw (u8 codes x i8 weights -> i16 pair sums) and one i16 add per 32
// codes and query head, where the 16-bit path takes two vpmaddwd and two
// adds: the codes as bytes (unpacked once per block and head, shared by the
// query heads), pair sums accumulated in i16 for as many token quads as
// cannot overflow (a pair sum is at most 2 (2^B - 1) 127), then widened by
// vpmaddwd with ones into exact int32 channel sums. No product saturates
// (2 x 127 x 127 < 2^15). Same integers as AccumulateVPortable, same float
// operations after them (FinishVVec), so the same outputs bit for bit.

// The raw operations the byte path needs beyond Highway 1.0.3 (vpmaddubsw,
// vpackuswb), on the D16 vector width.
using DU8 = hn::Repartition<uint8_t, D16>;
static HWY_INLINE hn::Vec<D16> MaddUbs(hn::Vec<DU8> codes, hn::Vec<DU8> wts) {
#if HWY_TARGET <= HWY_AVX3
  if constexpr (kN16 == 32) return hn::Vec<D16>{_mm512_maddubs_epi16(codes.raw, wts.raw)};
#endif
  if constexpr (kN16 == 16) return hn::Vec<D16>{_mm256_maddubs_epi16(codes.raw, wts.raw)};
}
// a's codes then b's as bytes, in order (packus interleaves 128-bit blocks;
// a qword permute puts them back).
static HWY_INLINE hn::Vec<DU8> PackBytes(hn::Vec<D16> a, hn::Vec<D16> b) {
#if HWY_TARGET <= HWY_AVX3
  if constexpr (kN16 == 32) {
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    return hn::Vec<DU8>{_mm512_permutexvar_epi64(order, _mm512_packus_epi16(a.raw, b.raw))};
  }
#endif
  if constexpr (kN16 == 16) return hn::Vec<DU8>{_mm256_permute4x64_epi64(_mm256_packus_epi16(a.raw, b.raw), 0xD8)};
}

// Block x of head h's V codes as bytes (w.vc8), in code order.
static HWY_INLINE void UnpackVBytes(const Call& c, const uint8_t* rec, const uint8_t* end, size_t h, size_t x,
                                    size_t ncodes, Work& w) {
  const DU8 du8;
  const size_t nv = w.G / 4 * ncodes / kN16;  // vectors of kN16 codes, an even number
  const CodeVectors cv(rec + c.layout.voperand(h, x, 0), c.v_bits, end);
  const auto pack = [&](size_t v, hn::Vec<D16> a, hn::Vec<D16> b) { hn::Store(PackBytes(a, b), du8, w.vc8 + kN16 * v); };
  size_t v = 0;
  for (; v + 2 <= std::min(nv, cv.in_place); v += 2) pack(v, cv.AtInPlace(v), cv.AtInPlace(v + 1));
  for (; v < nv; v += 2) pack(v, cv.At(v), cv.At(v + 1));
}

// NB byte vectors (of 2 kN16 codes) per operand.
template <size_t NB>
static void AccumulateVBytes(const Call& c, const uint8_t* rec, const uint8_t* end, size_t h, size_t rep, Work& w) {
  const D16 d16;
  const D32 d32;
  const DU8 du8;
  const DF2 df;
  constexpr size_t kB = 2 * kN16;  // codes (bytes) a vector
  constexpr size_t ncodes = kB * NB, vw = ncodes / 4;
  const size_t hd = w.hd, G = w.G, nops = G / 4;
  const int maxc = (1 << c.v_bits) - 1;
  const size_t pass = static_cast<size_t>(32767 / (2 * maxc * 127));  // token quads per i16 pass (>= 18)
  const auto ones = hn::Set(d16, int16_t{1});
  for (size_t x = 0; x < hd / vw; ++x) {
    UnpackVBytes(c, rec, end, h, x, ncodes, w);
    // Two query heads a pass over the codes (each code vector loaded once for both).
    const auto heads = [&](size_t r0, auto rb) {
      constexpr size_t B = decltype(rb)::value;
      const int8_t* p8[B];  // P^ as bytes (SoftmaxStep)
      for (size_t b = 0; b < B; ++b) p8[b] = reinterpret_cast<const int8_t*>(w.pd + (h * rep + r0 + b) * 2 * (G / 4));
      V32 tot[B][NB];
      for (size_t b = 0; b < B; ++b) {
        for (size_t v = 0; v < NB; ++v) tot[b][v] = hn::Zero(d32);
      }
      for (size_t q0 = 0; q0 < nops; q0 += pass) {
        hn::Vec<D16> s[B][NB];
        for (size_t b = 0; b < B; ++b) {
          for (size_t v = 0; v < NB; ++v) s[b][v] = hn::Zero(d16);
        }
        const size_t q1 = std::min(nops, q0 + pass);
        for (size_t r4 = q0; r4 < q1; ++r4) {
          const uint8_t* codes = w.vc8 + r4 * ncodes;
          hn::Vec<DU8> cv[NB];
          for (size_t v = 0; v < NB; ++v) cv[v] = hn::Load(du8, codes + kB * v);
          for (size_t b = 0; b < B; ++b) {
            int32_t pw;
            std::memcpy(&pw, p8[b] + 4 * r4, 4);
            const auto pv = hn::BitCast(du8, hn::Set(d32, pw));  // the quad's 4 weights, repeated
            for (size_t v = 0; v < NB; ++v) s[b][v] = hn::Add(s[b][v], MaddUbs(cv[v], pv));
          }
        }
        // i16 lanes 2n, 2n + 1 hold channel n's two pairs: one vpmaddwd sums them.
        for (size_t b = 0; b < B; ++b) {
          for (size_t v = 0; v < NB; ++v) {
            V32 unused = hn::Zero(d32);
            tot[b][v] = hn::Add(tot[b][v], hn::ReorderWidenMulAccumulate(d32, s[b][v], ones, hn::Zero(d32), unused));
          }
        }
      }
      for (size_t b = 0; b < B; ++b) {
        for (size_t v = 0; v < NB; ++v) FinishVVec(h * rep + r0 + b, h, x * vw + v * (kB / 4), hn::ConvertTo(df, tot[b][v]), w);
      }
    };
    ForHeadBlocks<2>(rep, heads);
  }
}
#else
#define KVQ_BYTES 0
#endif

};  // WideOps

using W256 = WideOps<hn::CappedTag<int16_t, 16>>;
#undef KVQ_WIDE512
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// AVX3 and AVX3_DL (when its VNNI path does not run): 512-bit vectors at head
// sizes that are a multiple of 16 (V blocks of 16 channels: 64 codes an operand).
#define KVQ_WIDE512 1
using W512 = WideOps<hn::CappedTag<int16_t, 32>>;
#else
#define KVQ_WIDE512 0
#endif

// A tile's K scores of head h on the wide path W.
template <class W>
HWY_INLINE void WideScores(const Call& c, const uint8_t* tile, const uint8_t* end, size_t h, size_t rep, size_t j,
                           Work& w) {
  W::template ScoresWide<64 / W::kN16>(c, tile, end, h, rep, j, w);
}

// A group's V sums of head h on the wide path W (the byte path for one digit
// on x86).
template <class W>
HWY_INLINE void WideV(const Call& c, const uint8_t* rec, const uint8_t* end, size_t h, size_t rep, Work& w) {
  const bool vw16 = c.layout.vw == 16;  // W512 runs only there
#if KVQ_BYTES
  if (c.v_digits == 1) {
    if constexpr (W::kN16 == 32) {
      W::template AccumulateVBytes<1>(c, rec, end, h, rep, w);
    } else if (vw16) {
      W::template AccumulateVBytes<2>(c, rec, end, h, rep, w);
    } else {
      W::template AccumulateVBytes<1>(c, rec, end, h, rep, w);
    }
    return;
  }
#endif
  if constexpr (W::kN16 == 32) {
    W::template AccumulateVWide<2>(c, rec, end, h, rep, w);
  } else if (vw16) {
    W::template AccumulateVWide<64 / W::kN16>(c, rec, end, h, rep, w);
  } else {
    W::template AccumulateVWide<32 / W::kN16>(c, rec, end, h, rep, w);
  }
}

#else
#undef KVQ_WIDE
#define KVQ_WIDE 0
#undef KVQ_BYTES
#define KVQ_BYTES 0
#undef KVQ_WIDE512
#define KVQ_WIDE512 0
#endif  // wide path

#if HWY_TARGET == HWY_AVX3_DL
// ---- AVX-512 VNNI + VBMI ----
// Highway 1.0.3's AVX3_DL target string lacks avx512vnni and avx512vbmi (every
// AVX3_DL CPU has them); the functions that use them add them.
#define KVQ_DL_ATTR __attribute__((target("avx512vnni,avx512vbmi")))
#define KVQ_DL_ATTR_BASE
// TileWeights with native rounding (cvtps2dq: to nearest even, in range by
// construction) and narrowing stores (vpmovdb), for the RB query heads of
// KV head h at once (the rotation and lo / step loaded once).
template <int RB>
KVQ_DL_ATTR_BASE HWY_INLINE void TileWeightsDlBlock(const Call& c, size_t h, size_t qh0, Work& w) {
  const size_t hd = w.hd, nq = hd / 4;
  const float* lam = w.lam + h * hd;
  __m512 s[RB];
  for (int r = 0; r < RB; ++r) s[r] = _mm512_setzero_ps();
  const __m512i m7 = _mm512_set1_epi32(127);
  for (size_t i = 0; i < hd; i += 16) {
    const __m512 c2 = _mm512_loadu_ps(w.cos2 + i), s2 = _mm512_loadu_ps(w.sin2 + i), l = _mm512_loadu_ps(lam + i);
    for (int r = 0; r < RB; ++r) {
      const size_t qh = qh0 + static_cast<size_t>(r);
      const __m512 wf = _mm512_fmadd_ps(_mm512_loadu_ps(w.a + qh * hd + i), c2, _mm512_mul_ps(_mm512_loadu_ps(w.b + qh * hd + i), s2));
      const __m512i wi = _mm512_cvtps_epi32(wf);
      int8_t* lo = reinterpret_cast<int8_t*>(w.wd + qh * 2 * nq);
      if (c.k_digits == 1) {
        _mm512_mask_cvtepi32_storeu_epi8(lo + i, 0xFFFF, wi);
      } else {
        _mm512_mask_cvtepi32_storeu_epi8(lo + i, 0xFFFF, _mm512_and_si512(wi, m7));
        _mm512_mask_cvtepi32_storeu_epi8(lo + 4 * nq + i, 0xFFFF, _mm512_srai_epi32(wi, 7));
      }
      s[r] = _mm512_fmadd_ps(wf, l, s[r]);
    }
  }
  for (int r = 0; r < RB; ++r) w.cst[qh0 + static_cast<size_t>(r)] = _mm512_reduce_add_ps(s[r]) * w.sigma[qh0 + static_cast<size_t>(r)];
}

KVQ_DL_ATTR_BASE void TileWeightsDl(const Call& c, size_t h, size_t rep, Work& w) {
  size_t r = 0;
  for (; r + 4 <= rep; r += 4) TileWeightsDlBlock<4>(c, h, h * rep + r, w);
  for (; r + 2 <= rep; r += 2) TileWeightsDlBlock<2>(c, h, h * rep + r, w);
  for (; r < rep; ++r) TileWeightsDlBlock<1>(c, h, h * rep + r, w);
}

// acc += codes . broadcast(*w) with the broadcast folded into vpdpbusd's
// memory operand (GCC 12 does not fold _mm512_set1_epi32 into it).
HWY_INLINE __m512i DpBcast(__m512i acc, __m512i codes, const int32_t* w) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*w));
  return acc;
}

struct Unpacker {
  __m512i perm, shift, mask;
  __mmask64 load;
  int bits;
};

KVQ_DL_ATTR HWY_INLINE Unpacker MakeUnpacker(int bits) {
  Unpacker u;
  u.perm = _mm512_load_si512(kUnpack.perm[bits]);
  u.shift = _mm512_load_si512(kUnpack.shift[bits]);
  u.mask = _mm512_load_si512(kUnpack.mask[bits]);
  u.load = bits == 8 ? ~__mmask64{0} : ((__mmask64{1} << (8 * bits)) - 1);
  u.bits = bits;
  return u;
}

// The 64 codes of the operand at p, a byte each.
KVQ_DL_ATTR HWY_INLINE __m512i Unpack(const Unpacker& u, const uint8_t* p) {
  const __m512i src = _mm512_maskz_loadu_epi8(u.load, p);
  if (u.bits == 8) return src;
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(u.shift, _mm512_permutexvar_epi8(u.perm, src)), u.mask);
}

// Independent accumulator chains per (head, digit): about 8 in all, so the
// vpdpbusd latency (~4-5 cycles) is hidden behind throughput.
constexpr int Chains(int rb, int d) { return rb * d >= 8 ? 1 : (rb * d >= 4 ? 2 : 4); }

// Scores of query heads [qh0, qh0 + RB) of KV head h for one tile: kD digit
// accumulators per head, kU partial sums (independent chains) each. The
// quads come in runs of one width (runs), so each run's unpacker is loaded
// once.
template <int RB, int kD>
KVQ_DL_ATTR HWY_INLINE void ScoresVnniBlock(const uint8_t* tile, const uint32_t* ko, const Run* runs, size_t n_runs,
                                            size_t nq, size_t qh0, Work& w, size_t j) {
  constexpr int kU = Chains(RB, kD);
  __m512i acc[RB][kD][kU];
  for (int r = 0; r < RB; ++r)
    for (int dd = 0; dd < kD; ++dd)
      for (int uu = 0; uu < kU; ++uu) acc[r][dd][uu] = _mm512_setzero_si512();
  const int32_t* wd[RB];
  for (int r = 0; r < RB; ++r) wd[r] = w.wd + (qh0 + r) * 2 * nq;
  for (size_t ri = 0; ri < n_runs; ++ri) {
    const Unpacker up = MakeUnpacker(runs[ri].bits);
    size_t k = runs[ri].k0;
    const size_t k1 = runs[ri].k1;
    for (; k + kU <= k1; k += kU) {
      for (int uu = 0; uu < kU; ++uu) {
        const size_t kk = k + static_cast<size_t>(uu);
        const __m512i codes = Unpack(up, tile + ko[kk]);
        for (int r = 0; r < RB; ++r) {
          acc[r][0][uu] = DpBcast(acc[r][0][uu], codes, wd[r] + kk);
          if constexpr (kD == 2) acc[r][1][uu] = DpBcast(acc[r][1][uu], codes, wd[r] + nq + kk);
        }
      }
    }
    for (; k < k1; ++k) {
      const __m512i codes = Unpack(up, tile + ko[k]);
      for (int r = 0; r < RB; ++r) {
        acc[r][0][0] = DpBcast(acc[r][0][0], codes, wd[r] + k);
        if constexpr (kD == 2) acc[r][1][0] = DpBcast(acc[r][1][0], codes, wd[r] + nq + k);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    const size_t qh = qh0 + static_cast<size_t>(r);
    __m512i lo = acc[r][0][0], hi = kD == 2 ? acc[r][kD - 1][0] : _mm512_setzero_si512();
    for (int uu = 1; uu < kU; ++uu) {
      lo = _mm512_add_epi32(lo, acc[r][0][uu]);
      if constexpr (kD == 2) hi = _mm512_add_epi32(hi, acc[r][1][uu]);
    }
    const __m512i sum = kD == 2 ? _mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo) : lo;
    const __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(w.sigma[qh]), _mm512_set1_ps(w.cst[qh]));
    _mm512_storeu_ps(w.scores + qh * w.G + j * kTile, s);
  }
}

template <int kD>
KVQ_DL_ATTR void ScoresVnni(const Call& c, const uint8_t* tile, size_t h, size_t rep, size_t j, Work& w) {
  const size_t nq = w.hd / 4;
  const uint32_t* ko = c.k_quad_off + h * nq;
  const Run* runs = w.runs.data() + w.run_begin[h];
  const size_t n = w.run_begin[h + 1] - w.run_begin[h];
  size_t r = 0;
  for (; r + 8 <= rep; r += 8) ScoresVnniBlock<8, kD>(tile, ko, runs, n, nq, h * rep + r, w, j);
  for (; r + 4 <= rep; r += 4) ScoresVnniBlock<4, kD>(tile, ko, runs, n, nq, h * rep + r, w, j);
  for (; r + 2 <= rep; r += 2) ScoresVnniBlock<2, kD>(tile, ko, runs, n, nq, h * rep + r, w, j);
  for (; r < rep; ++r) ScoresVnniBlock<1, kD>(tile, ko, runs, n, nq, h * rep + r, w, j);
}

// V of query heads [qh0, qh0 + RB) over channel blocks [x0, x0 + XB) of KV
// head h: every weight broadcast feeds XB blocks.
template <int RB, int kD, int XB>
KVQ_DL_ATTR HWY_INLINE void AccumulateVVnniBlock(const uint8_t* rec, const Call& c, const Unpacker& up, size_t x0,
                                                 size_t qh0, size_t h, Work& w) {
  constexpr int kU = RB * kD * XB >= 8 ? 1 : 2;  // independent chains per accumulator
  const size_t G = w.G, nw = G / 4, opb = c.layout.vop;
  __m512i acc[XB][RB][kD][kU];
  for (int x = 0; x < XB; ++x)
    for (int r = 0; r < RB; ++r)
      for (int dd = 0; dd < kD; ++dd)
        for (int uu = 0; uu < kU; ++uu) acc[x][r][dd][uu] = _mm512_setzero_si512();
  const int32_t* pd[RB];
  for (int r = 0; r < RB; ++r) pd[r] = w.pd + (qh0 + r) * 2 * nw;
  const uint8_t* base[XB];
  for (int x = 0; x < XB; ++x) base[x] = rec + c.layout.voperand(h, x0 + static_cast<size_t>(x), 0);
  for (size_t q4 = 0; q4 < nw; q4 += kU) {  // nw = G / 4 is a multiple of 4
    for (int uu = 0; uu < kU; ++uu) {
      const size_t qq = q4 + static_cast<size_t>(uu);
      __m512i codes[XB];
      for (int x = 0; x < XB; ++x) codes[x] = Unpack(up, base[x] + qq * opb);
      for (int r = 0; r < RB; ++r) {
        const __m512i b0 = _mm512_set1_epi32(pd[r][qq]);
        for (int x = 0; x < XB; ++x) acc[x][r][0][uu] = _mm512_dpbusd_epi32(acc[x][r][0][uu], codes[x], b0);
        if constexpr (kD == 2) {
          const __m512i b1 = _mm512_set1_epi32(pd[r][nw + qq]);
          for (int x = 0; x < XB; ++x) acc[x][r][1][uu] = _mm512_dpbusd_epi32(acc[x][r][1][uu], codes[x], b1);
        }
      }
    }
  }
  for (int x = 0; x < XB; ++x) {
    const size_t c0 = (x0 + static_cast<size_t>(x)) * 16;
    const __m512 vst = _mm512_loadu_ps(w.vst + h * w.hd + c0), vlo = _mm512_loadu_ps(w.vlo + h * w.hd + c0);
    for (int r = 0; r < RB; ++r) {
      const size_t qh = qh0 + static_cast<size_t>(r);
      __m512i lo = acc[x][r][0][0], hi = kD == 2 ? acc[x][r][kD - 1][0] : _mm512_setzero_si512();
      for (int uu = 1; uu < kU; ++uu) {
        lo = _mm512_add_epi32(lo, acc[x][r][0][uu]);
        if constexpr (kD == 2) hi = _mm512_add_epi32(hi, acc[x][r][1][uu]);
      }
      // Combined in float: 128 hi + lo can pass 2^31 for long groups of 8-bit codes.
      __m512 sums = _mm512_cvtepi32_ps(lo);
      if constexpr (kD == 2) sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(128.0f), sums);
      // acc = acc alpha + sigma_p (vlo sum P^ + vst (.) sums)
      float* out = w.acc + qh * w.hd + c0;
      const __m512 t = _mm512_fmadd_ps(vst, sums, _mm512_mul_ps(vlo, _mm512_set1_ps(static_cast<float>(w.psumi[qh]))));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), _mm512_set1_ps(w.al[qh]),
                                            _mm512_mul_ps(_mm512_set1_ps(w.sp[qh]), t)));
    }
  }
}

template <int kD>
KVQ_DL_ATTR void AccumulateVVnni(const Call& c, const uint8_t* rec, size_t h, size_t rep, Work& w) {
  const size_t nx = w.hd / 16;
  const Unpacker up = MakeUnpacker(c.v_bits);
  size_t x = 0;
  for (; x + 2 <= nx; x += 2) {
    size_t r = 0;
    for (; r + 4 <= rep; r += 4) AccumulateVVnniBlock<4, kD, 2>(rec, c, up, x, h * rep + r, h, w);
    for (; r + 2 <= rep; r += 2) AccumulateVVnniBlock<2, kD, 2>(rec, c, up, x, h * rep + r, h, w);
    for (; r < rep; ++r) AccumulateVVnniBlock<1, kD, 2>(rec, c, up, x, h * rep + r, h, w);
  }
  for (; x < nx; ++x) {
    size_t r = 0;
    for (; r + 4 <= rep; r += 4) AccumulateVVnniBlock<4, kD, 1>(rec, c, up, x, h * rep + r, h, w);
    for (; r + 2 <= rep; r += 2) AccumulateVVnniBlock<2, kD, 1>(rec, c, up, x, h * rep + r, h, w);
    for (; r < rep; ++r) AccumulateVVnniBlock<1, kD, 1>(rec, c, up, x, h * rep + r, h, w);
  }
}
#endif  // HWY_TARGET == HWY_AVX3_DL

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
