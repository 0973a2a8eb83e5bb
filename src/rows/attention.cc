// Fused decode attention over a quantized KV cache (SPEC §8).
// AVX3_DL (AVX-512 VNNI) is compiled too: K-tile scores use vpdpbusd against
// the query's fixed-point digits (exact mode) or its int8 codes (int8_query).
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif
#include "kvq/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvq/affine.h"
#include "kvq/error.h"
#include "kvq/ggml_quants.h"
#include "kvq/half.h"
#include "src/rows/row_scheme.h"
#include "src/rows/attention_call.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/rows/attention.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "src/rows/kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using attn::Call;
using attn::Item;

// A row's scale for KV head g (row_kernels: RowScale, kFold), given the
// headers array (touched only by schemes with row scales).
template <class S>
HWY_INLINE float RowScaleAt(const uint8_t* headers, size_t header_bytes, int64_t t, int g) {
  if constexpr (S::kRowScales) return S::RowScale(headers + static_cast<size_t>(t) * header_bytes, g);
  return S::RowScale(nullptr, g);
}

// kC vectors of row elements [x, x + kC * N): a whole block on the block
// path, else one vector.
template <class S, bool kBlocks, class D, size_t kC>
HWY_INLINE void LoadGroup(D d, const uint8_t* row, size_t x, hn::Vec<D> (&v)[kC]) {
  if constexpr (kBlocks) {
    S::LoadBlock(d, row + S::kBlockBytes * (x / ggml::kBlock), v);
  } else {
    v[0] = S::Load(d, row, x);
  }
}

// V tiles (kv_scheme.h): kC vectors of elements [x, x + kC * N) of lane
// `lane` of a V tile, as LoadGroup gives them from a row. A lane's codes
// are byte lane % 4 of each 4-byte word of its quad's units.
template <class S, class D, size_t kC>
HWY_INLINE void LoadVTileGroup(D d, const uint8_t* tile, size_t hd, int lane, size_t x, hn::Vec<D> (&v)[kC]) {
  constexpr size_t N = hn::MaxLanes(D());
  const hn::RebindToSigned<D> di;
  const size_t quad = static_cast<size_t>(lane / 4);
  const int shift = 8 * (lane % 4);
  constexpr bool kBlk = schemes::IsBlockTile(S::kTile);
  const size_t b = x / ggml::kBlock;
  const uint8_t* codes = tile + (kBlk ? 2 * kKTile * (hd / ggml::kBlock) : 0);
  // The lane's words of element unit u (4 tokens' codes per word), from element offset j % 16.
  const auto Words = [&](size_t u, size_t j) {
    return hn::LoadU(di, reinterpret_cast<const int32_t*>(codes + 64 * (4 * u + quad) + 4 * (j % 16)));
  };
  if constexpr (S::kTile == schemes::TileCodes::kQ4) {
    const auto vdb = BlockScaleVec(d, tile + 2 * kKTile * b + 2 * static_cast<size_t>(lane));
    for (size_t c = 0; c < kC; ++c) {
      const size_t j = c * N;  // element x + j of block b: low nibbles for j < 16
      v[c] = Q4Values(d, hn::ShiftRightSame(Words(b, j), shift + (j < 16 ? 0 : 4)), vdb);
    }
  } else {  // int8 (kC = 1) or q8_0: signed bytes, times the block scale
    hn::Vec<D> vdb = hn::Set(d, 1.0f);
    if constexpr (kBlk) vdb = BlockScaleVec(d, tile + 2 * kKTile * b + 2 * static_cast<size_t>(lane));
    for (size_t c = 0; c < kC; ++c) {
      const size_t e = x + c * N;
      v[c] = hn::ConvertTo(d, hn::ShiftRight<24>(hn::ShiftLeftSame(Words(e / 16, e), 24 - shift)));
      if constexpr (kBlk) v[c] = hn::Mul(v[c], vdb);
    }
  }
}

// K and V tiles exist for int8, int8-head and (block-aligned) q8_0 / q4_0
// (int8 V tiles: head_dim % 16 == 0 too, checked at run time).
template <class S, bool kBlocks>
constexpr bool kTileable = S::kTile == schemes::TileCodes::kInt8 || (schemes::IsBlockTile(S::kTile) && kBlocks);

// Tokens per online-softmax block: scores of the block, one max / rescale
// step, then its V rows. 128 rather than 32 amortises the per-block work
// (softmax reductions, the V pass set-up, accumulator loads and stores):
// 3-10% faster at 4K-16K tokens for every scheme in interleaved runs, while
// a block's V rows (fp32: 64 KiB per KV head) still come from L1 / L2.
constexpr int kBlockTokens = 128;

// Horizontal sums (kMax: maxima) of kG vectors, written to out[0..kG).
// Groups of four share one reduction tree: two interleave levels leave
// [a0 a1 a2 a3] partials in every 128-bit block, then the blocks are combined.
template <int kG, bool kMax = false, class D>
HWY_INLINE void ReduceLanes(D d, const hn::Vec<D> (&a)[kG], hn::TFromD<D>* HWY_RESTRICT out) {
  [[maybe_unused]] const auto op = [](auto x, auto y) {
    if constexpr (kMax) {
      return hn::Max(x, y);
    } else {
      return hn::Add(x, y);
    }
  };
#if HWY_TARGET != HWY_SCALAR
  constexpr size_t N = hn::MaxLanes(D());
  if constexpr (kG % 4 == 0 && N >= 4) {
    const hn::Repartition<uint64_t, D> d64;
    for (int h = 0; h < kG; h += 4) {
      const auto t01 = op(hn::InterleaveLower(d, a[h], a[h + 1]), hn::InterleaveUpper(d, a[h], a[h + 1]));
      const auto t23 = op(hn::InterleaveLower(d, a[h + 2], a[h + 3]), hn::InterleaveUpper(d, a[h + 2], a[h + 3]));
      const auto w01 = hn::BitCast(d64, t01), w23 = hn::BitCast(d64, t23);
      auto u = op(hn::BitCast(d, hn::InterleaveLower(d64, w01, w23)), hn::BitCast(d, hn::InterleaveUpper(d64, w01, w23)));
      if constexpr (N == 16) {
        const hn::Half<D> dh;
        const hn::Half<decltype(dh)> dq;
        const auto v8 = op(hn::LowerHalf(dh, u), hn::UpperHalf(dh, u));
        hn::StoreU(op(hn::LowerHalf(dq, v8), hn::UpperHalf(dq, v8)), dq, out + h);
      } else if constexpr (N == 8) {
        const hn::Half<D> dh;
        hn::StoreU(op(hn::LowerHalf(dh, u), hn::UpperHalf(dh, u)), dh, out + h);
      } else {
        hn::StoreU(u, d, out + h);
      }
    }
    return;
  }
#endif
  for (int h = 0; h < kG; ++h) {
    if constexpr (kMax) {
      out[h] = hn::GetLane(hn::MaxOfLanes(d, a[h]));
    } else {
      out[h] = hn::GetLane(hn::SumOfLanes(d, a[h]));
    }
  }
}

// Scores of kT consecutive tokens for kG query heads: each loaded query
// vector feeds kT FMAs, and the kT * kG accumulator chains are independent.
template <class S, bool kBlocks, int kG, int kT, class D>
HWY_INLINE void ScoreTokens(D d, const uint8_t* row0, size_t sb, size_t xbase, size_t hd,
                            const float* HWY_RESTRICT q, float* HWY_RESTRICT dots) {
  constexpr size_t N = hn::MaxLanes(D());
  constexpr size_t kC = kBlocks ? ggml::kBlock / N : 1;  // vectors per element group
  constexpr size_t kEG = kC * N;
  hn::Vec<D> a[kT * kG];
  for (int i = 0; i < kT * kG; ++i) a[i] = hn::Zero(d);
#pragma GCC unroll 4
  for (size_t e = 0; e < hd; e += kEG) {
    hn::Vec<D> kv[kT][kC];
    for (int t = 0; t < kT; ++t) LoadGroup<S, kBlocks>(d, row0 + static_cast<size_t>(t) * sb, xbase + e, kv[t]);
    for (size_t j = 0; j < kC; ++j) {
      for (int h = 0; h < kG; ++h) {
        const auto qv = hn::LoadU(d, q + h * hd + e + j * N);
        for (int t = 0; t < kT; ++t) a[t * kG + h] = hn::MulAdd(qv, kv[t][j], a[t * kG + h]);
      }
    }
  }
  ReduceLanes<kT * kG>(d, a, dots);  // dots[t * kG + h]
}

#if HWY_TARGET == HWY_AVX3_DL
// Highway 1.0.3's AVX3_DL target string lacks avx512vnni (every AVX3_DL CPU
// has it); the functions that use vpdpbusd add it.
#define KVQ_VNNI_ATTR __attribute__((target("avx512vnni")))
constexpr bool kVnni = true;
#else
#define KVQ_VNNI_ATTR
constexpr bool kVnni = false;
#endif

// acc[h][x, x + kVG * kEG) += sum_b w[h][b] * V_b[x, ...) for one block of
// tokens: kVG element groups per pass, so kG * kVG * kC accumulator chains
// stay in registers and each loaded V vector feeds kG FMAs. Rows: token b at
// row0 + b * sb. V tiles (kVT): token b at tile position pos0 + b of the
// slice at row0.
template <class S, bool kBlocks, bool kVT, int kG, size_t kVG, class D>
HWY_INLINE void AccumulateV(D d, const uint8_t* row0, size_t sb, int64_t pos0, int w0, int nb, size_t x, size_t hd,
                            const float (*HWY_RESTRICT w)[kBlockTokens], float* HWY_RESTRICT acc, size_t e) {
  constexpr size_t N = hn::MaxLanes(D());
  constexpr size_t kC = kBlocks ? ggml::kBlock / N : 1;
  constexpr size_t kEG = kC * N;
  hn::Vec<D> a[kG][kVG * kC];
  for (int h = 0; h < kG; ++h) {
    for (size_t j = 0; j < kVG * kC; ++j) a[h][j] = hn::LoadU(d, acc + h * hd + e + j * N);
  }
  for (int b = 0; b < nb; ++b) {
    hn::Vec<D> vv[kVG][kC];
    if constexpr (kVT) {
      const int64_t p = pos0 + b;
      const uint8_t* tile = row0 + static_cast<size_t>(p / kKTile) * kKTile * sb;
      for (size_t g = 0; g < kVG; ++g) LoadVTileGroup<S>(d, tile, hd, static_cast<int>(p % kKTile), x + g * kEG, vv[g]);
    } else {
      const uint8_t* row = row0 + static_cast<size_t>(b) * sb;
      for (size_t g = 0; g < kVG; ++g) LoadGroup<S, kBlocks>(d, row, x + g * kEG, vv[g]);
    }
    for (int h = 0; h < kG; ++h) {
      const auto wv = hn::Set(d, w[h][w0 + b]);
      for (size_t g = 0; g < kVG; ++g) {
        for (size_t j = 0; j < kC; ++j) a[h][g * kC + j] = hn::MulAdd(wv, vv[g][j], a[h][g * kC + j]);
      }
    }
  }
  for (int h = 0; h < kG; ++h) {
    for (size_t j = 0; j < kVG * kC; ++j) hn::StoreU(a[h][j], d, acc + h * hd + e + j * N);
  }
}

// ---- K tiles (kv_scheme.h): lanes are tokens, so a tile's scores need no
// horizontal sums. `tile` is the tile, `lane0` the first of the N lanes
// computed (a multiple of N); q and qfsum are the sub-group's.

// Scales of block b for lanes [lane0, lane0 + N) of a q8_0 / q4_0 tile.
template <class D>
HWY_INLINE hn::Vec<D> TileBlockScales(D d, const uint8_t* tile, size_t b, size_t lane0) {
  const uint8_t* p = tile + 2 * kKTile * b + 2 * lane0;
  return HalvesToFloat(d, hn::LoadU(hn::Rebind<uint16_t, D>(), reinterpret_cast<const uint16_t*>(p)));
}

// ab[h] += sum over the 4 elements [4g, 4g+4) of q[h][e] * code, for int8
// codes packed 4 per lane (int32 words w).
template <int kG, class D, class VI>
HWY_INLINE void FmaGroupInt8(D d, VI w, const float* HWY_RESTRICT q, size_t hd, size_t e, hn::Vec<D> (&ab)[kG]) {
  const hn::Vec<D> x[4] = {hn::ConvertTo(d, hn::ShiftRight<24>(hn::ShiftLeft<24>(w))),
                           hn::ConvertTo(d, hn::ShiftRight<24>(hn::ShiftLeft<16>(w))),
                           hn::ConvertTo(d, hn::ShiftRight<24>(hn::ShiftLeft<8>(w))),
                           hn::ConvertTo(d, hn::ShiftRight<24>(w))};
  for (int j = 0; j < 4; ++j) {
    for (int h = 0; h < kG; ++h) ab[h] = hn::MulAdd(x[j], hn::Set(d, q[h * hd + e + j]), ab[h]);
  }
}

// Exact float scores of N tile lanes for kG heads into s[h][b0, b0 + N)
// (before the row scale). q4_0: sum q (c - 8) d = d (sum q c - 8 sum q).
template <class S, int kG, class D>
HWY_INLINE void ScoreTile(D d, const uint8_t* tile, size_t lane0, size_t hd, const float* HWY_RESTRICT q,
                          const float* HWY_RESTRICT qfsum, size_t nb32, float (*HWY_RESTRICT s)[kBlockTokens],
                          int b0) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  hn::Vec<D> a[kG];
  for (int h = 0; h < kG; ++h) a[h] = hn::Zero(d);
  if constexpr (S::kTile == schemes::TileCodes::kInt8) {
    const uint8_t* codes = tile + 4 * lane0;
    for (size_t g = 0; g < hd / 4; ++g) {
      FmaGroupInt8<kG>(d, hn::LoadU(di, reinterpret_cast<const int32_t*>(codes + 64 * g)), q, hd, 4 * g, a);
    }
  } else {
    const size_t blocks = hd / ggml::kBlock;
    const uint8_t* codes = tile + 2 * kKTile * blocks + 4 * lane0;
    for (size_t b = 0; b < blocks; ++b) {
      hn::Vec<D> ab[kG];
      for (int h = 0; h < kG; ++h) ab[h] = hn::Zero(d);
      if constexpr (S::kTile == schemes::TileCodes::kQ8) {
        for (size_t g = 8 * b; g < 8 * b + 8; ++g) {
          FmaGroupInt8<kG>(d, hn::LoadU(di, reinterpret_cast<const int32_t*>(codes + 64 * g)), q, hd, 4 * g, ab);
        }
      } else {
        static_assert(S::kTile == schemes::TileCodes::kQ4);
        const auto iota = hn::Iota(d, 0.0f);  // nibble -> float table
        const auto same = [](hn::Vec<D> c) { return c; };
        for (size_t u = 4 * b; u < 4 * b + 4; ++u) {
          const auto w = hn::LoadU(du, reinterpret_cast<const uint32_t*>(codes + 64 * u));
          const hn::Vec<D> x[8] = {Nibbles(d, w, iota, same),
                                   Nibbles(d, hn::ShiftRight<8>(w), iota, same),
                                   Nibbles(d, hn::ShiftRight<16>(w), iota, same),
                                   Nibbles(d, hn::ShiftRight<24>(w), iota, same),
                                   Nibbles(d, hn::ShiftRight<4>(w), iota, same),
                                   Nibbles(d, hn::ShiftRight<12>(w), iota, same),
                                   Nibbles(d, hn::ShiftRight<20>(w), iota, same),
                                   Nibbles(d, hn::ShiftRight<28>(w), iota, same)};
          for (int j = 0; j < 8; ++j) {
            for (int h = 0; h < kG; ++h) ab[h] = hn::MulAdd(x[j], hn::Set(d, q[h * hd + 8 * u + j]), ab[h]);
          }
        }
        for (int h = 0; h < kG; ++h) ab[h] = hn::Sub(ab[h], hn::Set(d, 8.0f * qfsum[h * nb32 + b]));
      }
      const auto dv = TileBlockScales(d, tile, b, lane0);
      for (int h = 0; h < kG; ++h) a[h] = hn::MulAdd(ab[h], dv, a[h]);
    }
  }
  for (int h = 0; h < kG; ++h) hn::Store(a[h], d, s[h] + b0);
}

#if HWY_TARGET == HWY_AVX3_DL
// Integer scores of a whole tile (16 lanes) against kP integer planes of the
// query: its int8 codes (kP = 1, int8_query) or the three base-256 digits of
// its fixed-point form (kP = 3, exact mode; see QueryDigits). vpdpbusd takes
// the codes as the unsigned operand (int8 codes + 128, q4_0 nibbles as they
// are) and 4 plane values broadcast per lane; the offsets (128 or 8 times the
// plane's block sums, precomputed by StartValues) are the accumulators' start
// values. Each plane's sum is exact in int32; the planes are combined as
// described at CombinePlanes.
// Results (before the row and query scales) to s[h][b0, b0 + 16).
template <class S, int kG, int kP, class D>
KVQ_VNNI_ATTR HWY_INLINE void ScoreTileInt(D d, const uint8_t* tile, size_t hd, const int8_t* HWY_RESTRICT qi,
                                           const int32_t* HWY_RESTRICT qstart, size_t nb32,
                                           float (*HWY_RESTRICT s)[kBlockTokens], int b0) {
  if constexpr (kG * kP > 12) {  // at most 12 integer accumulators in registers
    constexpr int kH = kG / 2;
    ScoreTileInt<S, kH, kP>(d, tile, hd, qi, qstart, nb32, s, b0);
    ScoreTileInt<S, kH, kP>(d, tile, hd, qi + kH * kP * hd, qstart + kH * kP * nb32, nb32, s + kH, b0);
    return;
  }
  const hn::RebindToSigned<D> di;
  const hn::Repartition<uint8_t, D> du8;
  using VI = hn::Vec<decltype(di)>;
  const auto QWord = [&](int h, int p, size_t e) {
    int32_t w;
    std::memcpy(&w, qi + (static_cast<size_t>(h) * kP + p) * hd + e, 4);
    return hn::Set(di, w);
  };
  // Read from memory, so the broadcast is a load, not a general-register move.
  const auto Start = [&](int h, int p, size_t b) { return hn::Set(di, qstart[(static_cast<size_t>(h) * kP + p) * nb32 + b]); };
  // Plane sums as floats: sum_p 256^p A_p, with the top two planes combined
  // in int32 first (each plane's sum, and 256 A_2 + A_1, stay below 2^31).
  const auto CombinePlanes = [&](const VI (&a)[kP]) {
    if constexpr (kP == 1) {
      return hn::ConvertTo(d, a[0]);
    } else {
      static_assert(kP == 3);
      return hn::MulAdd(hn::ConvertTo(d, hn::Add(hn::ShiftLeft<8>(a[2]), a[1])), hn::Set(d, 256.0f),
                        hn::ConvertTo(d, a[0]));
    }
  };
  if constexpr (S::kTile == schemes::TileCodes::kInt8) {
    VI a[kG][kP];
    for (int h = 0; h < kG; ++h) {
      for (int p = 0; p < kP; ++p) a[h][p] = Start(h, p, 0);
    }
    const auto flip = hn::Set(du8, 0x80);
    for (size_t g = 0; g < hd / 4; ++g) {
      const auto k = hn::Xor(hn::LoadU(du8, tile + 64 * g), flip);
      for (int h = 0; h < kG; ++h) {
        for (int p = 0; p < kP; ++p) a[h][p].raw = _mm512_dpbusd_epi32(a[h][p].raw, k.raw, QWord(h, p, 4 * g).raw);
      }
    }
    for (int h = 0; h < kG; ++h) hn::Store(CombinePlanes(a[h]), d, s[h] + b0);
  } else {
    const size_t blocks = hd / ggml::kBlock;
    const uint8_t* codes = tile + 2 * kKTile * blocks;
    hn::Vec<D> a[kG];
    for (int h = 0; h < kG; ++h) a[h] = hn::Zero(d);
    for (size_t b = 0; b < blocks; ++b) {
      VI ab[kG][kP];
      if constexpr (S::kTile == schemes::TileCodes::kQ8) {
        for (int h = 0; h < kG; ++h) {
          for (int p = 0; p < kP; ++p) ab[h][p] = Start(h, p, b);
        }
        const auto flip = hn::Set(du8, 0x80);
#pragma GCC unroll 8
        for (size_t j = 0; j < 8; ++j) {  // a constant trip count: unrolled, no accumulator copies
          const size_t g = 8 * b + j;
          const auto k = hn::Xor(hn::LoadU(du8, codes + 64 * g), flip);
          for (int h = 0; h < kG; ++h) {
            for (int p = 0; p < kP; ++p) {
              ab[h][p].raw = _mm512_dpbusd_epi32(ab[h][p].raw, k.raw, QWord(h, p, 4 * g).raw);
            }
          }
        }
      } else {
        static_assert(S::kTile == schemes::TileCodes::kQ4);
        for (int h = 0; h < kG; ++h) {
          for (int p = 0; p < kP; ++p) ab[h][p] = Start(h, p, b);
        }
        const auto m4 = hn::Set(du8, 0x0F);
        const hn::Repartition<uint16_t, D> du16;
#pragma GCC unroll 4
        for (size_t j = 0; j < 4; ++j) {  // a constant trip count: unrolled, no accumulator copies
          const size_t u = 4 * b + j;
          const auto w = hn::LoadU(du8, codes + 64 * u);
          const auto lo = hn::And(w, m4);
          const auto hi = hn::And(hn::BitCast(du8, hn::ShiftRight<4>(hn::BitCast(du16, w))), m4);
          for (int h = 0; h < kG; ++h) {
            for (int p = 0; p < kP; ++p) {
              ab[h][p].raw = _mm512_dpbusd_epi32(ab[h][p].raw, lo.raw, QWord(h, p, 8 * u).raw);
              ab[h][p].raw = _mm512_dpbusd_epi32(ab[h][p].raw, hi.raw, QWord(h, p, 8 * u + 4).raw);
            }
          }
        }
      }
      const auto dv = TileBlockScales(d, tile, b, 0);
      for (int h = 0; h < kG; ++h) a[h] = hn::MulAdd(CombinePlanes(ab[h]), dv, a[h]);
    }
    for (int h = 0; h < kG; ++h) hn::Store(a[h], d, s[h] + b0);
  }
}
#endif

#if HWY_TARGET == HWY_AVX3_DL
// V tiles on AVX-512 VNNI: acc[h] += sum_t w[h][t] V_t over the block's
// tiles [v0, v1) (lanes outside [lo, hi) carry weight 0) with integer dot
// products: 4 tokens' codes per lane against 4 weights per broadcast word.
// Each scale group (a ggml block; int8: the whole head) folds its fp16
// block scales into the weights, x_t = w_t d_t, and writes them in 23-bit
// fixed point, X_t ~ x_t 2^k with 2^k chosen so that |X_t| <= 2^22 (two
// roundings: each within 2^-21 of the group's max |x| of x_t), as balanced
// base-256 digits X = D0 + 256 D1 + 65536 D2 (D0, D1 in [-128, 127],
// |D2| <= 64: bytes of X + 0x808080, top bits flipped). The codes enter
// vpdpbusd unsigned (int8 and q8_0 codes + 128, q4_0 nibbles as they are);
// the offset times sum_t X_t is the accumulators' start value, split over
// the top and bottom planes. Per 128-token block every plane sum stays below
// 2^23 and A0 + 256 A1 below 2^31, so the sum is exact before one
// conversion (two roundings) to float.
template <class S, int kG, class D>
KVQ_VNNI_ATTR HWY_NOINLINE void AccumulateVInt(D d, const uint8_t* tile0, size_t sb, size_t hd, int v0, int v1, int lo,
                                              int hi, hn::Mask<D> first_in, hn::Mask<D> last_in,
                                              const float (*HWY_RESTRICT w)[kBlockTokens], float* HWY_RESTRICT acc) {
  if constexpr (kG > 4) {  // 24 integer accumulators per pass at most
    AccumulateVInt<S, kG / 2>(d, tile0, sb, hd, v0, v1, lo, hi, first_in, last_in, w, acc);
    AccumulateVInt<S, kG / 2>(d, tile0, sb, hd, v0, v1, lo, hi, first_in, last_in, w + kG / 2, acc + kG / 2 * hd);
    return;
  } else {
    constexpr bool kQ4 = S::kTile == schemes::TileCodes::kQ4;
    constexpr bool kBlk = schemes::IsBlockTile(S::kTile);
    constexpr int32_t kOff = kQ4 ? 8 : 128;  // stored code - value
    const hn::RebindToSigned<D> di;
    const hn::Repartition<uint8_t, D> du8;
    const hn::Repartition<uint16_t, D> du16;
    using VI = hn::Vec<decltype(di)>;
    const int nt = (v1 - v0) / 16;  // tiles in the block
    const size_t tile_bytes = kKTile * sb;
    const size_t codes = kBlk ? 2 * kKTile * (hd / ggml::kBlock) : 0;
    // Byte i of plane p (i < 16) <- byte p of lane i: the digits of 16 tokens, plane by plane.
    HWY_ALIGN static constexpr uint8_t kPerm[64] = {
        0,  4,  8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 1,  5,  9,  13, 17, 21,
        25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 2,  6,  10, 14, 18, 22, 26, 30, 34, 38, 42, 46,
        50, 54, 58, 62, 3,  7,  11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63};
    const __m512i perm = _mm512_load_si512(kPerm);
    const auto bias = hn::Set(di, 0x808080);
    const auto biasf = hn::Set(d, 8421504.0f);  // 0x808080, exact
    HWY_ALIGN int8_t dig[kG][kBlockTokens / 16][64];
    const size_t groups = kBlk ? hd / ggml::kBlock : 1;
    for (size_t sg = 0; sg < groups; ++sg) {
      // This group's block scales (int8: 1), zero in lanes outside [lo, hi)
      // (any bits there: unwritten or not attended), which only the first
      // and the last tile have (first_in, last_in: the lanes inside).
      hn::Vec<D> sc[kBlockTokens / 16];
      for (int i = 0; i < nt; ++i) sc[i] = kBlk ? TileBlockScales(d, tile0 + i * tile_bytes, sg, 0) : hn::Set(d, 1.0f);
      if constexpr (kBlk) {
        if (lo > v0) sc[0] = hn::IfThenElseZero(first_in, sc[0]);
        if (hi < v1) sc[nt - 1] = hn::IfThenElseZero(last_in, sc[nt - 1]);
      }
      // Each head's max |x| (kG independent chains, one reduction tree).
      hn::Vec<D> mx[kG];
      for (int h = 0; h < kG; ++h) mx[h] = hn::Zero(d);
      for (int i = 0; i < nt; ++i) {
        for (int h = 0; h < kG; ++h) {
          const auto wv = hn::Load(d, w[h] + v0 + 16 * i);  // >= 0: int8's weights need no Abs
          // vrangeps 0x0B: the larger magnitude, sign cleared (max |.| in one op).
          mx[h] = kBlk ? hn::Vec<D>{_mm512_range_ps(mx[h].raw, hn::Mul(wv, sc[i]).raw, 0x0B)} : hn::Max(mx[h], wv);
        }
      }
      HWY_ALIGN float m[kG];
      ReduceLanes<kG, true>(d, mx, m);
      float kf[kG], inv[kG];
      for (int h = 0; h < kG; ++h) {
        uint32_t bits;
        std::memcpy(&bits, &m[h], 4);
        // m < 2^(E - 126) for biased exponent E: the scale 2^(148 - E) leaves
        // |X| < 2^22; E >= 22 keeps it and its inverse normal floats.
        const uint32_t E = std::max<uint32_t>(22, bits >> 23);
        const uint32_t kbits = (275 - E) << 23, ibits = (E - 21) << 23;
        std::memcpy(&kf[h], &kbits, 4);
        std::memcpy(&inv[h], &ibits, 4);
      }
      // The digits, and each head's sum of X (for the start values).
      VI sum[kG];
      for (int h = 0; h < kG; ++h) sum[h] = hn::Zero(di);
      for (int i = 0; i < nt; ++i) {
        for (int h = 0; h < kG; ++h) {
          // w 2^k is exact; one rounding of w d 2^k + 0x808080 (< 2^24), then
          // to the nearest integer (in range: no fix-up needed).
          const auto wk = hn::Mul(hn::Load(d, w[h] + v0 + 16 * i), hn::Set(d, kf[h]));
          const VI j{_mm512_cvtps_epi32(hn::MulAdd(wk, sc[i], biasf).raw)};
          sum[h] = hn::Add(sum[h], j);
          const auto digits = hn::Xor(j, bias);  // bytes: balanced digits D0, D1, D2 of X = j - 0x808080
          _mm512_store_si512(dig[h][i], _mm512_permutexvar_epi8(perm, digits.raw));
        }
      }
      for (int h = 0; h < kG; ++h) sum[h] = hn::Sub(sum[h], hn::Set(di, nt * 0x808080));  // lanes: sum of X
      HWY_ALIGN int32_t total[kG];  // sum of X over the block, |.| <= 2^29
      ReduceLanes<kG>(di, sum, total);
      int32_t start0[kG], start2[kG];
      for (int h = 0; h < kG; ++h) {
        start0[h] = -kOff * (total[h] & 0xFFFF);
        start2[h] = -kOff * (total[h] >> 16);
      }
      // Element groups of 16 (two per pass): q4_0 block sg's low and high
      // nibbles; int8 / q8_0 units 2u and 2u + 1 (a q8_0 block, sg = u).
      const size_t units = kQ4 ? 2 : (kBlk ? 2 : hd / 16);
      for (size_t u0 = 0; u0 < units; u0 += 2) {
        const size_t x0 = kQ4 ? 0 : (kBlk ? 2 * sg : u0);  // first 16-element unit (int8 / q8_0)
        const bool two = kQ4 || x0 + 1 < hd / 16;
        VI a[kG][3][2];
        for (int h = 0; h < kG; ++h) {
          for (int j = 0; j < 2; ++j) {
            a[h][0][j] = hn::Set(di, start0[h]);
            a[h][1][j] = hn::Zero(di);
            a[h][2][j] = hn::Set(di, start2[h]);
          }
        }
        for (int i = 0; i < nt; ++i) {
          const uint8_t* c = tile0 + i * tile_bytes + codes;
#pragma GCC unroll 4
          for (size_t r = 0; r < 4; ++r) {  // quads: tokens 4r .. 4r + 3 of the tile
            hn::Vec<decltype(du8)> cv[2];
            if constexpr (kQ4) {
              const auto u = hn::LoadU(du8, c + 64 * (4 * sg + r));
              cv[0] = hn::And(u, hn::Set(du8, 0x0F));
              cv[1] = hn::And(hn::BitCast(du8, hn::ShiftRight<4>(hn::BitCast(du16, u))), hn::Set(du8, 0x0F));
            } else {
              cv[0] = hn::Xor(hn::LoadU(du8, c + 64 * (4 * x0 + r)), hn::Set(du8, 0x80));
              cv[1] = two ? hn::Xor(hn::LoadU(du8, c + 64 * (4 * (x0 + 1) + r)), hn::Set(du8, 0x80)) : cv[0];
            }
            for (int h = 0; h < kG; ++h) {
              for (int p = 0; p < 3; ++p) {
                int32_t word;
                std::memcpy(&word, &dig[h][i][16 * p + 4 * r], 4);
                const auto wd = hn::Set(di, word);
                a[h][p][0].raw = _mm512_dpbusd_epi32(a[h][p][0].raw, cv[0].raw, wd.raw);
                a[h][p][1].raw = _mm512_dpbusd_epi32(a[h][p][1].raw, cv[1].raw, wd.raw);
              }
            }
          }
        }
        for (int h = 0; h < kG; ++h) {
          for (int j = 0; j < (two ? 2 : 1); ++j) {
            const size_t e = kQ4 ? 32 * sg + 16 * static_cast<size_t>(j) : 16 * (x0 + static_cast<size_t>(j));
            const auto low = hn::Add(a[h][0][j], hn::ShiftLeft<8>(a[h][1][j]));
            const auto val = hn::MulAdd(hn::ConvertTo(d, a[h][2][j]), hn::Set(d, 65536.0f), hn::ConvertTo(d, low));
            float* o = acc + static_cast<size_t>(h) * hd + e;
            hn::StoreU(hn::MulAdd(val, hn::Set(d, inv[h]), hn::LoadU(d, o)), d, o);
          }
        }
      }
    }
  }
}
#endif

// Raw scores of tokens [b, b + kT) of a block of K rows into s[h][b + t].
template <class S, bool kBlocks, int kG, int kT, class D>
HWY_INLINE void ScoreBlock(D d, const uint8_t* krow, size_t sb, size_t xbase, size_t hd,
                           const float* HWY_RESTRICT q, int b, float (*HWY_RESTRICT s)[kBlockTokens]) {
  float dots[kT * kG];
  ScoreTokens<S, kBlocks, kG, kT>(d, krow + static_cast<size_t>(b) * sb, sb, xbase, hd, q, dots);
  for (int t = 0; t < kT; ++t)
    for (int h = 0; h < kG; ++h) s[h][b + t] = dots[t * kG + h];
}

// kG query heads of one KV head over the item's tokens, in blocks of
// kBlockTokens:
// scores from the K codes, an online-softmax update, then V accumulated from
// the codes with every head's weight applied to the same loaded vector.
// Block lanes [lo, hi) hold tokens tb + lane of the item; with K tiles
// (kTiled) blocks start on a tile, so the first and last may be partial.
template <class S, bool kBlocks, bool kTiled, int kG, int kQP, class D>
KVQ_VNNI_ATTR HWY_NOINLINE void AttendGroup(D d, const Call& c, const Item& it, int h0) {
  constexpr size_t N = hn::MaxLanes(D());
  constexpr size_t kC = kBlocks ? ggml::kBlock / N : 1;  // vectors per element group
  constexpr size_t kEG = kC * N;
  // Element groups per V pass: about 16 accumulators (plus kG weights and
  // the loaded V vectors) fit the 32 vector registers.
  constexpr size_t kVG = std::max<size_t>(1, std::min<size_t>(8, 16 / (kG * kC)));
  const size_t hd = static_cast<size_t>(c.hd);
  const size_t nb32 = (hd + ggml::kBlock - 1) / ggml::kBlock;
  // The item's head: its payload slice, and its elements' offset in it.
  const size_t slice = static_cast<size_t>(it.g / c.heads_per_slice);
  const size_t xbase = static_cast<size_t>(it.g % c.heads_per_slice) * hd;
  const uint8_t* kbase = c.k + slice * c.slice_stride;
  const uint8_t* vbase = c.v + slice * c.slice_stride;
  const size_t sb = c.slice_bytes, hb = c.header_bytes;
  const float* q = it.q + static_cast<size_t>(h0) * hd;
  static_assert(kQP == 0 || kTiled, "integer query planes read K tiles");
  float* acc = it.acc + static_cast<size_t>(h0) * hd;
  float* m = it.m + h0;
  float* l = it.l + h0;
  HWY_ALIGN float s[kG][kBlockTokens] = {};
  HWY_ALIGN float ks[kBlockTokens], vs[kBlockTokens];
  hn::Vec<D> lv[kG];  // running softmax sums per lane, reduced once at the end
  for (int h = 0; h < kG; ++h) lv[h] = hn::Zero(d);

  // With K or V tiles, blocks start on a tile.
  int64_t tb = it.t0;
  if (kTiled || c.v_tile) tb -= (c.tile_first + it.t0) % kKTile;
  for (; tb < it.t1; tb += kBlockTokens) {
    const int lo = static_cast<int>(std::max<int64_t>(0, it.t0 - tb));
    const int hi = static_cast<int>(std::min<int64_t>(kBlockTokens, it.t1 - tb));
    // Raw scores (before the row scale) into s[h][lo, hi).
    if constexpr (kTiled) {
      for (int b0 = lo / static_cast<int>(N) * static_cast<int>(N); b0 < hi; b0 += static_cast<int>(N)) {
        const size_t p = static_cast<size_t>(c.tile_first + tb + b0);  // tile position of lane b0
        const uint8_t* tile = kbase + p / kKTile * kKTile * sb;
#if HWY_TARGET == HWY_AVX3_DL
        if constexpr (kQP > 0 && N == kKTile) {
          ScoreTileInt<S, kG, kQP>(d, tile, hd, it.qi + static_cast<size_t>(h0) * kQP * hd,
                                   it.qstart + static_cast<size_t>(h0) * kQP * nb32, nb32, s, b0);
          continue;
        }
#endif
        ScoreTile<S, kG>(d, tile, p % kKTile, hd, q, it.qfsum + static_cast<size_t>(h0) * nb32, nb32, s, b0);
      }
    } else {
      const uint8_t* krow = kbase + static_cast<size_t>(tb) * sb;
      int b = 0;
      for (; b + 2 <= hi; b += 2) ScoreBlock<S, kBlocks, kG, 2>(d, krow, sb, xbase, hd, q, b, s);
      if (b < hi) ScoreBlock<S, kBlocks, kG, 1>(d, krow, sb, xbase, hd, q, b, s);
    }
    // The vectors that hold lanes [lo, hi); the rest of the block is not touched.
    const int v0 = lo / static_cast<int>(N) * static_cast<int>(N);
    const int v1 = (hi + static_cast<int>(N) - 1) / static_cast<int>(N) * static_cast<int>(N);
    // Per-row scales (schemes with headers); the others fold a constant.
    constexpr bool kRowScales = S::kRowScales;
    if constexpr (kRowScales) {
      for (int bb = v0; bb < v1; ++bb) {
        const bool in = bb >= lo && bb < hi;
        ks[bb] = in ? RowScaleAt<S>(c.k_header, hb, tb + bb, it.g) : 0.0f;
        vs[bb] = in ? RowScaleAt<S>(c.v_header, hb, tb + bb, it.g) : 0.0f;
      }
    }
    const auto RowScales = [&](const float* r, int b0) {
      return kRowScales ? hn::Load(d, r + b0) : hn::Set(d, S::kFold);
    };

    // Online softmax, vectorised over the block; lanes outside [lo, hi)
    // (only in the first and the last vector) become the lowest float,
    // whose weight is exp(lowest - max) = 0.
    const auto lowest = hn::Set(d, -std::numeric_limits<float>::max());
    const int vlast = v1 - static_cast<int>(N);
    const auto first_in = hn::Not(hn::FirstN(d, static_cast<size_t>(lo - v0)));  // lanes >= lo
    const auto last_in = hn::FirstN(d, static_cast<size_t>(hi - vlast));         // lanes < hi
    for (int h = 0; h < kG; ++h) {
      float qf = 1.0f;
      if constexpr (kQP > 0) qf = it.qscale[h0 + h];
      const auto vqf = hn::Set(d, qf);
      auto vmax = lowest;
      for (int b0 = v0; b0 < v1; b0 += static_cast<int>(N)) {
        auto v = hn::Mul(hn::Load(d, s[h] + b0), hn::Mul(RowScales(ks, b0), vqf));
        if (b0 == v0 && lo > v0) v = hn::IfThenElse(first_in, v, lowest);
        if (b0 == vlast && hi < v1) v = hn::IfThenElse(last_in, v, lowest);
        hn::Store(v, d, s[h] + b0);
        vmax = hn::Max(vmax, v);
      }
      const float mn = std::max(m[h], hn::GetLane(hn::MaxOfLanes(d, vmax)));
      // 0 on the first block (m = -inf); no exp call while the max holds.
      const float corr = mn == m[h] ? 1.0f : std::exp(m[h] - mn);
      if (corr != 1.0f) {
        const auto vc = hn::Set(d, corr);
        lv[h] = hn::Mul(lv[h], vc);
        for (size_t e = 0; e < hd; e += N) {
          hn::StoreU(hn::Mul(hn::LoadU(d, acc + h * hd + e), vc), d, acc + h * hd + e);
        }
      }
      m[h] = mn;
      const auto vm = hn::Set(d, mn);
      auto vsum = hn::Zero(d);
      for (int b0 = v0; b0 < v1; b0 += static_cast<int>(N)) {
        const auto w = hn::Exp(d, hn::Sub(hn::Load(d, s[h] + b0), vm));
        vsum = hn::Add(vsum, w);
        // The weight of V row b's codes (exp(lowest - max) = 0 outside [lo, hi)).
        hn::Store(S::kFold == 1.0f && !kRowScales ? w : hn::Mul(w, RowScales(vs, b0)), d, s[h] + b0);
      }
      lv[h] = hn::Add(lv[h], vsum);
    }

    const int nb = hi - lo;
    if constexpr (kTileable<S, kBlocks>) {
      if (c.v_tile) {  // V tiles: one slice per head (xbase = 0)
        const int64_t pos0 = c.tile_first + tb;  // tile position of lane 0, a multiple of 16
#if HWY_TARGET == HWY_AVX3_DL
        if constexpr (N == kKTile) {
          AccumulateVInt<S, kG>(d, vbase + static_cast<size_t>(pos0 + v0) * sb, sb, hd, v0, v1, lo, hi, first_in,
                                last_in, s, acc);
        } else  // NOLINT: the float tile path below is not instantiated here
#endif
        {
          size_t e = 0;
          for (; e + kVG * kEG <= hd; e += kVG * kEG) {
            AccumulateV<S, kBlocks, true, kG, kVG>(d, vbase, sb, pos0 + lo, lo, nb, e, hd, s, acc, e);
          }
          for (; e < hd; e += kEG) {
            AccumulateV<S, kBlocks, true, kG, 1>(d, vbase, sb, pos0 + lo, lo, nb, e, hd, s, acc, e);
          }
        }
        continue;
      }
    }
    const uint8_t* vrow0 = vbase + static_cast<size_t>(tb + lo) * sb;
    size_t e = 0;
    for (; e + kVG * kEG <= hd; e += kVG * kEG) {
      AccumulateV<S, kBlocks, false, kG, kVG>(d, vrow0, sb, 0, lo, nb, xbase + e, hd, s, acc, e);
    }
    for (; e < hd; e += kEG) AccumulateV<S, kBlocks, false, kG, 1>(d, vrow0, sb, 0, lo, nb, xbase + e, hd, s, acc, e);
  }
  for (int h = 0; h < kG; ++h) l[h] = hn::GetLane(hn::SumOfLanes(d, lv[h]));  // the item's softmax sums
}

template <class S, bool kBlocks, bool kTiled, int kQP, class D>
void AttendSchemeWith(D d, const Call& c) {
  const auto attend = [&](const Item& it) {
    int h = 0;
    while (h < it.G) {  // the group in sub-groups of 8, 4, 2, 1 heads
      const int rem = it.G - h;
      if (rem >= 8) {
        AttendGroup<S, kBlocks, kTiled, 8, kQP>(d, c, it, h), h += 8;
      } else if (rem >= 4) {
        AttendGroup<S, kBlocks, kTiled, 4, kQP>(d, c, it, h), h += 4;
      } else if (rem >= 2) {
        AttendGroup<S, kBlocks, kTiled, 2, kQP>(d, c, it, h), h += 2;
      } else {
        AttendGroup<S, kBlocks, kTiled, 1, kQP>(d, c, it, h), h += 1;
      }
    }
  };
  const int64_t n = c.n_items;
  if (c.threads > 1 && n > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(c.threads)
    for (int64_t i = 0; i < n; ++i) attend(c.items[i]);
  } else {  // no OpenMP region at all: a serial one still costs ~250 ns
    for (int64_t i = 0; i < n; ++i) attend(c.items[i]);
  }
}

template <class S, bool kBlocks, class D>
void AttendScheme(D d, const Call& c) {
  if constexpr (kTileable<S, kBlocks>) {
    if (c.k_tile) {
      if constexpr (kVnni && hn::MaxLanes(D()) == kKTile) {
        if (c.query_planes == 1) return AttendSchemeWith<S, kBlocks, true, 1>(d, c);
        if (c.query_planes == 3) return AttendSchemeWith<S, kBlocks, true, 3>(d, c);
      }
      return AttendSchemeWith<S, kBlocks, true, 0>(d, c);
    }
  }
  AttendSchemeWith<S, kBlocks, false, 0>(d, c);
}

// The scheme's kernel traits from the list (kernels-inl.h); block schemes
// read whole blocks when `blocks`.
template <class D, class S, class... Rest>
void AttendListed(D d, const Call& c, bool blocks, RowKernelList<S, Rest...>) {
  if (c.scheme == S::kId) {
    if constexpr (schemes::IsBlockTile(S::kTile)) {
      if (blocks) return AttendScheme<S, true>(d, c);
    }
    return AttendScheme<S, false>(d, c);
  }
  if constexpr (sizeof...(Rest) > 0) AttendListed(d, c, blocks, RowKernelList<Rest...>());
}

template <class D>
void AttendAll(D d, const Call& c) {
  // ggml blocks are read whole when every head starts on a block and a
  // vector holds at most half a block.
  const bool blocks = c.hd % ggml::kBlock == 0 && hn::MaxLanes(d) <= 16;
  AttendListed(d, c, blocks, RowKernels());
}

// Vectors of up to 16 floats when head_dim allows, else 8 (head_dim % 8 == 0
// is validated), so a vector never crosses a head or a 16-value half-block.
void DecodeAttentionKernel(const Call& c) {
  if (c.hd % 16 == 0) {
    AttendAll(hn::CappedTag<float, 16>(), c);
  } else {
    AttendAll(hn::CappedTag<float, 8>(), c);
  }
}

#undef KVQ_VNNI_ATTR
}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq {
HWY_EXPORT(DecodeAttentionKernel);
void attn::RunDecodeAttentionKernel(const Call& c) { HWY_DYNAMIC_DISPATCH(DecodeAttentionKernel)(c); }
}  // namespace kvq
#endif  // HWY_ONCE
