// The integer path over ggml's block types (kvq/ggml_weights.h: matvec_int):
// the activation rounded once per row to the 8-bit block format ggml pairs
// with the weight type (Q8_0, Q8_1 or Q8_K, as quantize_row_q8_*_ref rounds
// it), integer products summed exactly inside each block, float only at the
// block scales. The float steps of a block are scalar and in one order on
// every target, and integer sums are exact in any order, so every target and
// the scalar reference give the same bits.
//
// Kernels for Q4_0, Q8_0, Q4_K, Q5_K and Q6_K on x86 (AVX2, AVX3: pmaddubsw +
// pmaddwd; AVX3_DL: AVX-512 VNNI, 512-bit for Q4_0's and Q4_K's decode) and
// NEON (vmull_s8 + pairwise adds), all summing in the reference's 8 lanes;
// the other types, and SSE4 / SSSE3 / the scalar targets, run the reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kvq/error.h"
#include "kvq/ggml_weights.h"
#include "kvq/half.h"
#include "src/base/ggml_weight_blocks.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/base/ggml_int_dot.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#ifndef KVQ_BASE_GGML_INT_DOT_ONCE
#define KVQ_BASE_GGML_INT_DOT_ONCE
namespace kvq::ggml::idot {

using blocks::Half;
using blocks::kIq4Levels;
using blocks::ScaleMinK4;

constexpr int kQK = 32;
constexpr int kQKK = 256;
// The activation blocks: Q8_0 = d (fp16) | qs[32]; Q8_1 = d (fp16) | s (fp16,
// d times the sum of qs) | qs[32]; Q8_K = d (float32) | qs[256] | bsums[16]
// (int16: sums of 16 qs).
constexpr size_t kQ8_0Bytes = 34, kQ8_1Bytes = 36, kQ8_KBytes = 292;

inline float F32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
inline int16_t I16(const uint8_t* p) {
  int16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline const int8_t* S8(const uint8_t* p) { return reinterpret_cast<const int8_t*>(p); }

// ---- the scalar reference, one function per weight type -------------------
// Each returns the row's dot product over `nb` blocks at w (weight) and y
// (activation). The float expression of a block is ggml's generic one where
// that sums per block (the 32-value types, Q2_K, IQ4_XS); for Q3_K..Q6_K,
// whose generic code keeps 8 float lanes, the block's integer total is
// scaled once (kvq's order; within the bound kvq/ggml_weights.h states).

// The 8 float lanes of Q4_0, Q8_0 and the K-quants added at a row's end.
inline float Reduce8(const float* a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// Q4_0: each block's exact integer total times dw dy, as ggml's generic
// dot, added into float lane b mod 8 (block b), Reduce8 at the row's end:
// the kernels take 8 blocks' totals at once and scale and add them as one
// vector (a float step per block and row ran at 0.4-0.5 of the read rate).
float RefQ4_0(const uint8_t* w, const uint8_t* y, size_t nb) {
  float acc[8] = {};
  for (size_t b = 0; b < nb; ++b, w += 18, y += kQ8_0Bytes) {
    const int8_t* q8 = S8(y + 2);
    int t = 0;
    for (int e = 0; e < kQK; ++e) t += ((e < 16 ? (w[2 + e] & 0x0F) : (w[2 + e - 16] >> 4)) - 8) * q8[e];
    acc[b % 8] += static_cast<float>(t) * (Half(w) * Half(y));
  }
  return Reduce8(acc);
}

// Q8_0 as ggml's generic dot: a block's exact integer total times the two
// scales' product, added into one float in block order. The x86 kernel puts
// 8 weight rows in a vector's lanes (so that one float update serves 8
// rows); each lane follows this order.
float RefQ8_0(const uint8_t* w, const uint8_t* y, size_t nb) {
  float sumf = 0;
  for (size_t b = 0; b < nb; ++b, w += 34, y += kQ8_0Bytes) {
    const int8_t* qw = S8(w + 2);
    const int8_t* q8 = S8(y + 2);
    int sumi = 0;
    for (int j = 0; j < kQK; ++j) sumi += qw[j] * q8[j];
    sumf += static_cast<float>(sumi) * (Half(w) * Half(y));
  }
  return sumf;
}

float RefQ4_1(const uint8_t* w, const uint8_t* y, size_t nb) {
  float sumf = 0;
  for (size_t b = 0; b < nb; ++b, w += 20, y += kQ8_1Bytes) {
    const int8_t* q8 = S8(y + 4);
    int sumi = 0;
    for (int j = 0; j < kQK / 2; ++j) sumi += (w[4 + j] & 0x0F) * q8[j] + (w[4 + j] >> 4) * q8[j + kQK / 2];
    sumf += (Half(w) * Half(y)) * static_cast<float>(sumi) + Half(w + 2) * Half(y + 2);
  }
  return sumf;
}

float RefQ5_0(const uint8_t* w, const uint8_t* y, size_t nb) {
  float sumf = 0;
  for (size_t b = 0; b < nb; ++b, w += 22, y += kQ8_0Bytes) {
    int c[kQK];
    blocks::Codes5(w + 2, w + 6, c);
    const int8_t* q8 = S8(y + 2);
    int sumi = 0;
    for (int j = 0; j < kQK; ++j) sumi += (c[j] - 16) * q8[j];
    sumf += (Half(w) * Half(y)) * static_cast<float>(sumi);
  }
  return sumf;
}

float RefQ5_1(const uint8_t* w, const uint8_t* y, size_t nb) {
  float sumf = 0;
  for (size_t b = 0; b < nb; ++b, w += 24, y += kQ8_1Bytes) {
    int c[kQK];
    blocks::Codes5(w + 4, w + 8, c);
    const int8_t* q8 = S8(y + 4);
    int sumi = 0;
    for (int j = 0; j < kQK; ++j) sumi += c[j] * q8[j];
    sumf += (Half(w) * Half(y)) * static_cast<float>(sumi) + Half(w + 2) * Half(y + 2);
  }
  return sumf;
}

float RefIQ4_NL(const uint8_t* w, const uint8_t* y, size_t nb) {
  float sumf = 0;
  for (size_t b = 0; b < nb; ++b, w += 18, y += kQ8_0Bytes) {
    const int8_t* q8 = S8(y + 2);
    int s1 = 0, s2 = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      s1 += q8[j] * kIq4Levels[w[2 + j] & 0x0F];
      s2 += q8[j + kQK / 2] * kIq4Levels[w[2 + j] >> 4];
    }
    sumf += (Half(w) * Half(y)) * static_cast<float>(s1 + s2);
  }
  return sumf;
}

float RefQ2_K(const uint8_t* w, const uint8_t* y, size_t nb) {
  float sumf = 0;
  for (size_t b = 0; b < nb; ++b, w += 84, y += kQ8_KBytes) {
    const uint8_t* sc = w;
    const uint8_t* q2 = w + 16;
    const int8_t* q8 = S8(y + 4);
    int summs = 0;
    for (int j = 0; j < 16; ++j) summs += I16(y + 260 + 2 * j) * (sc[j] >> 4);
    const float dall = F32(y) * Half(w + 80), dmin = F32(y) * Half(w + 82);
    int isum = 0, is = 0;
    for (int k = 0; k < kQKK / 128; ++k, q2 += 32) {
      for (int shift = 0; shift < 8; shift += 2, q8 += 32) {
        for (int half = 0; half < 2; ++half) {
          const int d = sc[is++] & 0x0F;
          int isuml = 0;
          for (int l = 16 * half; l < 16 * half + 16; ++l) isuml += q8[l] * ((q2[l] >> shift) & 3);
          isum += d * isuml;
        }
      }
    }
    sumf += dall * static_cast<float>(isum) - dmin * static_cast<float>(summs);
  }
  return sumf;
}

float RefQ3_K(const uint8_t* w, const uint8_t* y, size_t nb) {
  float sumf = 0;
  for (size_t b = 0; b < nb; ++b, w += 110, y += kQ8_KBytes) {
    const uint8_t* hm = w;
    const uint8_t* q = w + 32;
    int8_t scales[16];
    blocks::ScalesQ3_K(w + 96, scales);
    const int8_t* q8 = S8(y + 4);
    int isum = 0, is = 0;
    uint8_t m = 1;
    for (int n = 0; n < kQKK; n += 128, q += 32) {
      for (int shift = 0; shift < 8; shift += 2, m = static_cast<uint8_t>(m << 1)) {
        for (int half = 0; half < 2; ++half, q8 += 16) {
          int s = 0;
          for (int l = 0; l < 16; ++l) {
            s += q8[l] * (((q[16 * half + l] >> shift) & 3) - ((hm[16 * half + l] & m) ? 0 : 4));
          }
          isum += (scales[is++] - 32) * s;
        }
      }
    }
    sumf += (Half(w + 108) * F32(y)) * static_cast<float>(isum);
  }
  return sumf;
}

// Q4_K, Q5_K and Q6_K sum in 8 lanes, as the x86 kernels' int32 lanes do:
// lane k of a super-block holds its values e with (e mod 32) / 4 == k (the
// 4 products pmaddubsw + pmaddwd add into one int32), exactly; each block
// adds d times its lane total (minus dmin times the lane's min term) into a
// float lane, and the 8 lanes are added at the row's end in a fixed tree.

// Q4_K and Q5_K (the fifth bit from qh). The min term of lane k: min of
// sub-block k times the sum of its 32 activations.
template <bool kQ5>
float RefQ45_K(const uint8_t* w, const uint8_t* y, size_t nb) {
  float acc[8] = {};
  const size_t bytes = kQ5 ? 176 : 144;
  for (size_t b = 0; b < nb; ++b, w += bytes, y += kQ8_KBytes) {
    const uint8_t* qh = w + 16;
    const uint8_t* q = kQ5 ? w + 48 : w + 16;
    const int8_t* q8 = S8(y + 4);
    uint8_t sc[8], mn[8];
    for (int c = 0; c < 8; ++c) ScaleMinK4(c, w + 4, &sc[c], &mn[c]);
    const float d = Half(w) * F32(y), dmin = Half(w + 2) * F32(y);
    for (int k = 0; k < 8; ++k) {
      int a = 0;
      for (int c = 0; c < 8; ++c) {
        int t = 0;
        for (int r = 0; r < 4; ++r) {
          const int l = 4 * k + r;
          int code = (c & 1) ? (q[32 * (c / 2) + l] >> 4) : (q[32 * (c / 2) + l] & 0x0F);
          if (kQ5) code |= ((qh[l] >> c) & 1) << 4;
          t += code * q8[32 * c + l];
        }
        a += sc[c] * t;
      }
      const int m = mn[k] * (I16(y + 260 + 4 * k) + I16(y + 262 + 4 * k));
      acc[k] += d * static_cast<float>(a) - dmin * static_cast<float>(m);
    }
  }
  return Reduce8(acc);
}

// Q6_K: codes summed as unsigned (q + 32), then 32 times each 16-value
// group's scale times its activation sum taken off (groups 2k and 2k + 1
// in lane k).
float RefQ6_K(const uint8_t* w, const uint8_t* y, size_t nb) {
  float acc[8] = {};
  for (size_t b = 0; b < nb; ++b, w += 210, y += kQ8_KBytes) {
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const int8_t* sc = S8(w + 192);
    const int8_t* q8 = S8(y + 4);
    const float d = Half(w + 208) * F32(y);
    for (int k = 0; k < 8; ++k) {
      int a = 0;
      for (int c = 0; c < 8; ++c) {
        const int n = c / 4, s = c % 4;
        int t = 0;
        for (int r = 0; r < 4; ++r) {
          const int l = 4 * k + r;
          const uint8_t lb = ql[64 * n + 32 * (s & 1) + l];
          const int u = (s < 2 ? (lb & 0x0F) : (lb >> 4)) | (((qh[32 * n + l] >> (2 * s)) & 3) << 4);
          t += u * q8[32 * c + l];
        }
        a += sc[8 * n + 2 * s + (k >= 4 ? 1 : 0)] * t;
      }
      const int corr = sc[2 * k] * I16(y + 260 + 4 * k) + sc[2 * k + 1] * I16(y + 262 + 4 * k);
      acc[k] += d * static_cast<float>(a - 32 * corr);
    }
  }
  return Reduce8(acc);
}

float RefIQ4_XS(const uint8_t* w, const uint8_t* y, size_t nb) {
  float sumf = 0;
  for (size_t b = 0; b < nb; ++b, w += 136, y += kQ8_KBytes) {
    const float d4d8 = Half(w) * F32(y);
    uint16_t h;
    std::memcpy(&h, w + 2, 2);
    const uint8_t* sl = w + 4;
    const uint8_t* qs = w + 8;
    const int8_t* q8 = S8(y + 4);
    for (int ib = 0; ib < kQKK / 32; ib += 2) {
      const int ls1 = (sl[ib / 2] & 0x0F) | ((h << 4) & 0x30), ls2 = (sl[ib / 2] >> 4) | ((h << 2) & 0x30);
      h = static_cast<uint16_t>(h >> 4);
      const float d1 = d4d8 * static_cast<float>(ls1 - 32), d2 = d4d8 * static_cast<float>(ls2 - 32);
      for (const float dl : {d1, d2}) {
        int s1 = 0, s2 = 0;
        for (int j = 0; j < 16; ++j) {
          s1 += q8[j] * kIq4Levels[qs[j] & 0x0F];
          s2 += q8[j + 16] * kIq4Levels[qs[j] >> 4];
        }
        sumf += dl * static_cast<float>(s1 + s2);
        qs += 16;
        q8 += 32;
      }
    }
  }
  return sumf;
}

using RefFn = float (*)(const uint8_t*, const uint8_t*, size_t);
inline RefFn Ref(uint32_t type) {
  switch (static_cast<WeightType>(type)) {
    case WeightType::kQ4_0: return RefQ4_0;
    case WeightType::kQ4_1: return RefQ4_1;
    case WeightType::kQ5_0: return RefQ5_0;
    case WeightType::kQ5_1: return RefQ5_1;
    case WeightType::kQ8_0: return RefQ8_0;
    case WeightType::kIQ4_NL: return RefIQ4_NL;
    case WeightType::kQ2_K: return RefQ2_K;
    case WeightType::kQ3_K: return RefQ3_K;
    case WeightType::kQ4_K: return RefQ45_K<false>;
    case WeightType::kQ5_K: return RefQ45_K<true>;
    case WeightType::kQ6_K: return RefQ6_K;
    case WeightType::kIQ4_XS: return RefIQ4_XS;
    default: return nullptr;
  }
}

inline float DotRef(const WeightMatrix& w, size_t i, const uint8_t* xq) {
  return Ref(w.type)(w.row(i), xq, w.cols / static_cast<size_t>(weight_block(w.type)));
}

}  // namespace kvq::ggml::idot
#endif

HWY_BEFORE_NAMESPACE();
namespace kvq::ggml {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;

// Q8_0 (or Q8_1, with_sum) blocks of x, the reference's bytes (QuantizeQ8_0
// below): amax of the block's non-NaN |x|, d = amax / 127, each code
// x / d rounded half away from zero as roundf (the truncation, plus one away
// from zero where the exact fraction reaches a half), NaN as 0, clamped to
// +-127. A vector a step where the reference's scalar loop (roundf) was 8%
// of a prompt's prefill on Q4_0 weights.
void QuantizeQ8_0Rows(const float* HWY_RESTRICT x, size_t n, uint8_t* HWY_RESTRICT y, bool with_sum) {
  const hn::CappedTag<float, 8> df;  // 1, 2, 4 or 8 lanes: a divisor of 32
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<int8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df), bytes = with_sum ? idot::kQ8_1Bytes : idot::kQ8_0Bytes;
  for (size_t b = 0; b < n / 32; ++b, x += 32, y += bytes) {
    auto vmax = hn::Zero(df);
    for (size_t j = 0; j < 32; j += N) {
      const auto v = hn::LoadU(df, x + j);
      vmax = hn::Max(vmax, hn::IfThenElseZero(hn::Eq(v, v), hn::Abs(v)));
    }
    const float amax = hn::GetLane(hn::MaxOfLanes(df, vmax));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t hd = f32_to_f16_ref(d);
    std::memcpy(y, &hd, 2);
    int8_t* qs = reinterpret_cast<int8_t*>(y + (with_sum ? 4 : 2));
    const auto vid = hn::Set(df, id), lo = hn::Set(df, -127.0f), hi = hn::Set(df, 127.0f);
    const auto half = hn::Set(df, 0.5f), mhalf = hn::Set(df, -0.5f);
    const auto one = hn::Set(di, 1);
    auto vsum = hn::Zero(di);
    for (size_t j = 0; j < 32; j += N) {
      auto v = hn::Mul(hn::LoadU(df, x + j), vid);
      v = hn::Min(hi, hn::Max(lo, hn::IfThenElseZero(hn::Eq(v, v), v)));
      const auto t = hn::ConvertTo(di, v);  // truncation
      const auto f = hn::Sub(v, hn::ConvertTo(df, t));
      auto q = hn::IfThenElse(hn::RebindMask(di, hn::Ge(f, half)), hn::Add(t, one), t);
      q = hn::IfThenElse(hn::RebindMask(di, hn::Le(f, mhalf)), hn::Sub(q, one), q);
      vsum = hn::Add(vsum, q);
      hn::StoreU(hn::DemoteTo(d8, q), d8, qs + j);
    }
    if (with_sum) {
      const int32_t sum = hn::GetLane(hn::SumOfLanes(di, vsum));
      const uint16_t hs = f32_to_f16_ref(static_cast<float>(sum) * d);
      std::memcpy(y + 2, &hs, 2);
    }
  }
}

#if HWY_HAVE_SCALABLE || HWY_TARGET == HWY_SCALAR

void MatMulInt(const WeightMatrix& w, const uint8_t* xq, size_t stride, size_t T, size_t r0, size_t r1, float* out,
               size_t ldo) {
  for (size_t t = 0; t < T; ++t) {
    for (size_t i = r0; i < r1; ++i) out[t * ldo + i - r0] = idot::DotRef(w, i, xq + t * stride);
  }
}

#else

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// ---- x86 (256-bit): bytes multiplied in pairs by pmaddubsw (unsigned code x
// signed activation -> int16, which no product here overflows), then pmaddwd
// by the sub-block scale (or by ones) into int32: two instructions for 32
// products where the portable kernels above take eight. Integer sums are
// exact, the float steps are the reference's, so the bits are the same.

HWY_INLINE __m256i Load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// acc + pmaddwd(a, b), and acc + the sums of 4 adjacent u8 x s8 products:
// one AVX-512 VNNI instruction each on AVX3_DL (vpdpwssd, vpdpbusd; no
// intermediate saturation, which no value here reaches), two or three on
// AVX2 / AVX3. Highway 1.0.3's AVX3_DL target string lacks avx512vnni
// (every AVX3_DL CPU has it): the functions that use it add it. That string
// names avxvnni instead, so GCC encodes the 256-bit intrinsics with VEX
// (AVX-VNNI: Alder Lake, Sapphire Rapids, Zen 5), an illegal instruction on
// Ice Lake and Zen 4, which have AVX-512 VNNI only: the EVEX forms are
// written out here (tests/no_vex_vnni.sh checks the binaries for VEX ones).
#if HWY_TARGET == HWY_AVX3_DL
#define KVQ_VNNI __attribute__((target("avx512vnni")))
KVQ_VNNI HWY_INLINE __m256i MulAddPairs(__m256i acc, __m256i a, __m256i b) {
  __asm__("%{evex%} vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
KVQ_VNNI HWY_INLINE __m256i AddQuads(__m256i acc, __m256i u, __m256i s) {
  __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
#else
#define KVQ_VNNI
HWY_INLINE __m256i MulAddPairs(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
HWY_INLINE __m256i AddQuads(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

HWY_INLINE int32_t Hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The sums of four vectors' lanes, lane k of the result for vector k.
HWY_INLINE __m128i Hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

// An fp16 field (F16C: the same value as the reference conversion).
HWY_INLINE float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
// The fp16 fields at p, p + stride, p + 2 stride, p + 3 stride.
HWY_INLINE __m128 Halves4(const uint8_t* p, size_t stride) {
  uint16_t h[4];
  for (int k = 0; k < 4; ++k) std::memcpy(h + k, p + k * stride, 2);
  uint64_t bits;
  std::memcpy(&bits, h, 8);
  return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(bits)));
}

// v's 16-bit lanes shifted left by n (right by -n), n a constant in -3..4.
HWY_INLINE __m256i ShiftLeft16(__m256i v, int n) {
  return n > 0 ? _mm256_slli_epi16(v, n) : (n < 0 ? _mm256_srli_epi16(v, -n) : v);
}

// The two fp16 fields at p (lanes 0 and 1; 2 and 3 are 0).
HWY_INLINE __m128 Halves2(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
}

// blocks::ScalesMinsK4 in a vector: the 12 packed bytes at q (16 read; a
// K-quant block has them) to the 8 scales (bytes 0..7) and 8 mins (8..15).
HWY_INLINE __m128i ScalesMinsK4(const uint8_t* q) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));  // a0 a1 a2 -
  // Lanes a0 & k6, a2 & k4, a1 & k6, (a2 >> 4) & k4 ...
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(a, _MM_SHUFFLE(2, 1, 2, 0)), _mm_set_epi32(4, 0, 0, 0)),
                                   _mm_set_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F));
  // ... with the top two bits of a0's and a1's bytes as bits 4..5 of lanes 1 and 3.
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(a, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                   _mm_set_epi32(0x30303030, 0, 0x30303030, 0));
  return _mm_or_si128(lo, hi);
}

// Signed int8 codes w times the activation x (32 each), summed in 8 int32 lanes.
HWY_INLINE __m256i DotSigned(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

// The 8 float lanes added in the reference's tree (Reduce8).
HWY_INLINE float Reduce8(__m256 a) {
  const __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// |w| and w (for the activation's sign) of one block: the row's int32 lanes.
KVQ_VNNI HWY_INLINE __m256i DotBlock(__m256i aw, __m256i wv, const uint8_t* x) {
  return AddQuads(_mm256_setzero_si256(), aw, _mm256_sign_epi8(Load32(x), wv));
}

// 8 fp16 fields `stride` apart (8 rows' or 8 blocks' scales) as floats (a
// vector built from scalar loads: scalar stores read back as a vector would
// stall).
HWY_INLINE __m256 Scales8(const uint8_t* p, size_t stride) {
  uint16_t h[8];
  for (int k = 0; k < 8; ++k) std::memcpy(h + k, p + static_cast<size_t>(k) * stride, 2);
  return _mm256_cvtph_ps(_mm_setr_epi16(static_cast<short>(h[0]), static_cast<short>(h[1]), static_cast<short>(h[2]),
                                        static_cast<short>(h[3]), static_cast<short>(h[4]), static_cast<short>(h[5]),
                                        static_cast<short>(h[6]), static_cast<short>(h[7])));
}

// The 8 int32 lanes of u x s (u unsigned bytes, s signed; pmaddubsw's
// pairs stay below 2^15 here): one vpdpbusd, or pmaddubsw + pmaddwd.
KVQ_VNNI HWY_INLINE __m256i Quads(__m256i u, __m256i s) {
#if HWY_TARGET == HWY_AVX3_DL
  return AddQuads(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Lane k: the sum of v[k]'s 8 lanes (a hadd tree, 9 shuffles for 8 vectors).
HWY_INLINE __m256i Totals8(const __m256i (&v)[8]) {
  const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

// Q4_0's blocks past the last 8 (nb mod 8), one at a time into float lane
// c mod 8 of accf: block c's activation codes at x + xstride c (the Q8_0
// row's bytes, or the repacked codes), its block sum -8 times at bs[c].
KVQ_VNNI HWY_INLINE __m256 Q4_0Tail(const uint8_t* w, const uint8_t* x, size_t xstride, const float* dy,
                                    const int32_t* bs, size_t b, size_t nb, __m256 accf) {
  constexpr size_t kW = 18;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, accf);
  for (size_t c = b; c < nb; ++c) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * kW + 2));
    const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
    const int32_t t = Hsum(Quads(u, Load32(x + xstride * c))) + bs[c];
    lanes[c % 8] += static_cast<float>(t) * (Half(w + c * kW) * dy[c]);
  }
  return _mm256_load_ps(lanes);
}

// Q4_0 with its Q8_0 activation in RefQ4_0's order: a block's total is the
// unsigned nibbles times the activation (Quads, summed) plus -8 times the
// activation block's sum (bs[r][b], made once per call by the caller); 8
// blocks' totals come out of one hadd tree, are scaled by their 8 dw dy in
// one vector and added into float lane b mod 8; the last nb mod 8 blocks
// go one at a time into their lanes (the same float operations). R
// activation rows share the nibbles' decoding; dys[r][b] is row r's block-b
// scale as float (the caller's). Row r's result goes to out[r], the same
// bits as a call with that row alone.
template <int R>
KVQ_VNNI void Avx2Q4_0(const uint8_t* w, const uint8_t* const* ys, const float* const* dys, const int32_t* const* bs,
                       size_t nb, float* out) {
  constexpr size_t kW = 18, kY = idot::kQ8_0Bytes;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const auto nibbles = [&](const uint8_t* blk) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
  };
  __m256 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps();
  size_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const uint8_t* wb = w + b * kW;
    __m256i nib[8];
    for (int k = 0; k < 8; ++k) nib[k] = nibbles(wb + static_cast<size_t>(k) * kW);
    const __m256 dw = Scales8(wb, kW);
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = ys[r] + b * kY + 2;
      __m256i v[8];
      for (int k = 0; k < 8; ++k) v[k] = Quads(nib[k], Load32(x + static_cast<size_t>(k) * kY));
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs[r] + b));
      const __m256i tot = _mm256_add_epi32(Totals8(v), sums);
      const __m256 d = _mm256_mul_ps(dw, _mm256_loadu_ps(dys[r] + b));
      accf[r] = _mm256_add_ps(accf[r], _mm256_mul_ps(_mm256_cvtepi32_ps(tot), d));
    }
  }
  for (int r = 0; r < R; ++r) {
    if (b < nb) accf[r] = Q4_0Tail(w, ys[r] + 2, kY, dys[r], bs[r], b, nb, accf[r]);
    out[r] = Reduce8(accf[r]);
  }
}

// Independent int32 accumulators per activation row in the K-quant and
// Q8_0 kernels.
// On AVX3_DL each product is added by vpdpwssd into its accumulator, a chain
// of 8 a super-block at 4-5 cycles each: with one row (decode) the chain, not
// the loads or the multiplies, set the speed. Integer sums are exact in any
// order, so splitting them changes no bit. With R rows the R chains already
// overlap; AVX2 adds with a 1-cycle vpaddd.
template <int R>
constexpr int Chains() {
#if HWY_TARGET == HWY_AVX3_DL
  return R == 1 ? 4 : (R <= 3 ? 2 : 1);
#else
  return R == 1 ? 2 : 1;
#endif
}

template <int R, int S>
HWY_INLINE __m256i SumChains(const __m256i (&acc)[R][S], int r) {
  __m256i a = acc[r][0];
  for (int s = 1; s < S; ++s) a = _mm256_add_epi32(a, acc[r][s]);
  return a;
}

// Q8_0 over 8 weight rows at once, a row in each int32 lane: the 8 rows'
// codes of a block transposed in 4-byte units (t[g], lane k: row k's codes
// 4g..4g+3), each 4 activation bytes broadcast, so that 8 multiply-adds give
// the 8 rows' exact block totals in one vector and one float update serves
// the 8 rows (the per-lane layout would convert, scale and add 8 lanes per
// row and block). Each lane follows RefQ8_0's order: total times (dw dy),
// added in block order. AVX3_DL multiplies the codes + 128 (unsigned) and
// adds -128 times the activation block's sum (xs); AVX2 / AVX3 take
// |code| and the activation's bytes signed by the code (pmaddubsw's pairs
// stay below 2^15). Out: out[8 r + k] for activation row r, weight row k.
HWY_INLINE void Transpose8x32(__m256i (&c)[8]) {
  __m256i t[8], u[8];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_epi32(c[k], c[k + 1]);
    t[k + 1] = _mm256_unpackhi_epi32(c[k], c[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm256_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm256_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm256_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int g = 0; g < 4; ++g) {
    c[g] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x20);
    c[g + 4] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x31);
  }
}

template <int R>
KVQ_VNNI void Avx2Q8_0Rows8(const uint8_t* w, size_t rb, const uint8_t* const* ys, const float* const* dys,
                            const int32_t* const* xs, size_t nb, float* out) {
  constexpr size_t kW = 34, kY = idot::kQ8_0Bytes;
  __m256 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps();
  for (size_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * kW;
    __m256i t[8];
    for (int k = 0; k < 8; ++k) t[k] = Load32(wb + static_cast<size_t>(k) * rb + 2);
    Transpose8x32(t);
    const __m256 dw = Scales8(wb, rb);
#if HWY_TARGET == HWY_AVX3_DL
    __m256i u[8];
    for (int g = 0; g < 8; ++g) u[g] = _mm256_xor_si256(t[g], _mm256_set1_epi8(static_cast<char>(0x80)));
#else
    __m256i u[8];
    for (int g = 0; g < 8; ++g) u[g] = _mm256_sign_epi8(t[g], t[g]);
#endif
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = ys[r] + b * kY + 2;
      constexpr int S = Chains<R>();  // independent int32 chains (exact in any order)
      __m256i a[S];
      for (int c = 0; c < S; ++c) a[c] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        int32_t q;
        std::memcpy(&q, x + 4 * g, 4);
        const __m256i xb = _mm256_set1_epi32(q);
#if HWY_TARGET == HWY_AVX3_DL
        a[g % S] = AddQuads(a[g % S], u[g], xb);
#else
        a[g % S] = AddQuads(a[g % S], u[g], _mm256_sign_epi8(xb, t[g]));
#endif
      }
      __m256i acc = a[0];
      for (int c = 1; c < S; ++c) acc = _mm256_add_epi32(acc, a[c]);
#if HWY_TARGET == HWY_AVX3_DL
      acc = _mm256_add_epi32(acc, _mm256_set1_epi32(xs[r][b]));
#else
      (void)xs;
#endif
      const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(dys[r][b]));
      accf[r] = _mm256_add_ps(accf[r], _mm256_mul_ps(_mm256_cvtepi32_ps(acc), d));
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, accf[r]);
}

// Q4_0 over 8 weight rows at once (prefill), a row in each int32 lane, as
// Avx2Q8_0Rows8: a block's 8 rows of 16 nibble bytes transposed as 8 x 4
// dwords (12 shuffles for the 8 rows, where the per-row kernel's hadd tree
// takes 9 per row and block), their low and high nibbles the 8 groups of 4
// codes (u[g], lane k: row k's codes 4g..4g+3, unsigned), each times 4
// activation bytes broadcast; the int32 sum starts at bs, -8 times the
// activation block's sum, so it ends at the 8 rows' exact block totals. Float lane
// j of RefQ4_0 (blocks j, j + 8, ...) is lanes[j] (in memory: 8 R vectors do
// not fit in registers; a pass per lane with them in registers ran at 0.9x);
// the 8 lanes are added at the end in Reduce8's tree across vectors:
// RefQ4_0's order for every row. Out: out[8 r + k] for
// activation row r, weight row k.
template <int R>
KVQ_VNNI void Avx2Q4_0Rows8(const uint8_t* w, size_t rb, const uint8_t* const* ys, const float* const* dys,
                            const int32_t* const* bs, size_t nb, float* out) {
  constexpr size_t kW = 18, kY = idot::kQ8_0Bytes;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  alignas(32) float lanes[8][R][8];
  for (size_t j = 0; j < 8; ++j) {
    for (int r = 0; r < R; ++r) _mm256_store_ps(lanes[j][r], _mm256_setzero_ps());
  }
  for (size_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * kW;
    const auto half_row = [&](int k) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + static_cast<size_t>(k) * rb + 2));
    };
    __m256i p[4], u[8];
    for (int k = 0; k < 4; ++k) p[k] = _mm256_set_m128i(half_row(k + 4), half_row(k));  // rows k | k + 4
    const __m256i t0 = _mm256_unpacklo_epi32(p[0], p[1]), t1 = _mm256_unpackhi_epi32(p[0], p[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(p[2], p[3]), t3 = _mm256_unpackhi_epi32(p[2], p[3]);
    const __m256i d[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    for (int g = 0; g < 4; ++g) {
      u[g] = _mm256_and_si256(d[g], m4);
      u[g + 4] = _mm256_and_si256(_mm256_srli_epi16(d[g], 4), m4);
    }
    const __m256 dw = Scales8(wb, rb);
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = ys[r] + b * kY + 2;
      const auto xg = [&](int g) {
        int32_t q;
        std::memcpy(&q, x + 4 * g, 4);
        return _mm256_set1_epi32(q);
      };
#if HWY_TARGET == HWY_AVX3_DL
      // Two chains of 4 (exact in any order): 8 vpdpbusd in one chain
      // waited on their latency (0.9x).
      __m256i a0 = _mm256_set1_epi32(bs[r][b]), a1 = _mm256_setzero_si256();
      for (int g = 0; g < 8; g += 2) a0 = AddQuads(a0, u[g], xg(g)), a1 = AddQuads(a1, u[g + 1], xg(g + 1));
      const __m256i tot = _mm256_add_epi32(a0, a1);
#else
      // pmaddubsw's pairs added in int16 across the 8 groups (16 products
      // of a nibble and a code: |sum| <= 16 * 15 * 128 < 2^15), one pmaddwd.
      __m256i h[8];
      for (int g = 0; g < 8; ++g) h[g] = _mm256_maddubs_epi16(u[g], xg(g));
      const __m256i h16 = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(h[0], h[1]), _mm256_add_epi16(h[2], h[3])),
                                           _mm256_add_epi16(_mm256_add_epi16(h[4], h[5]), _mm256_add_epi16(h[6], h[7])));
      const __m256i tot = _mm256_add_epi32(_mm256_madd_epi16(h16, _mm256_set1_epi16(1)), _mm256_set1_epi32(bs[r][b]));
#endif
      const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(dys[r][b]));
      float* acc = lanes[b % 8][r];
      _mm256_store_ps(acc, _mm256_add_ps(_mm256_load_ps(acc), _mm256_mul_ps(_mm256_cvtepi32_ps(tot), dd)));
    }
  }
  for (int r = 0; r < R; ++r) {
    const auto l = [&](int j) { return _mm256_load_ps(lanes[j][r]); };
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(l(0), l(4)), _mm256_add_ps(l(2), l(6))),
                                   _mm256_add_ps(_mm256_add_ps(l(1), l(5)), _mm256_add_ps(l(3), l(7))));
    _mm256_storeu_ps(out + 8 * r, s);
  }
}

// Q8_0 for one weight row against R activation rows: decode (one or two),
// and the rows a batched pass leaves past the last 8 (MatMulInt); the row
// read in one stream (Avx2Q8_0Rows8's 8 rows side by side read at 0.6x this
// rate from DRAM), 8 blocks at a time: each block's 8 lanes summed to its
// total by a hadd tree, the 8 totals times (dw dy) in one vector, then added
// into the row's float in block order: RefQ8_0's order, its bits.
template <int R>
KVQ_VNNI void Avx2Q8_0Row(const uint8_t* w, const uint8_t* const* ys, const float* const* dys, const int32_t* const*,
                          size_t nb, float* out) {
  constexpr size_t kW = 34, kY = idot::kQ8_0Bytes;
  float sumf[R] = {};
  size_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const uint8_t* wb = w + b * kW;
    const __m256 dw = Scales8(wb, kW);
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = ys[r] + b * kY + 2;
      __m256i h[4];
      for (int k = 0; k < 8; k += 2) {
        const __m256i w0 = Load32(wb + static_cast<size_t>(k) * kW + 2);
        const __m256i w1 = Load32(wb + static_cast<size_t>(k + 1) * kW + 2);
        h[k / 2] = _mm256_hadd_epi32(DotBlock(_mm256_sign_epi8(w0, w0), w0, x + static_cast<size_t>(k) * kY),
                                     DotBlock(_mm256_sign_epi8(w1, w1), w1, x + static_cast<size_t>(k + 1) * kY));
      }
      const __m256i s0 = _mm256_hadd_epi32(h[0], h[1]), s1 = _mm256_hadd_epi32(h[2], h[3]);
      const __m256i tot = _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20),
                                           _mm256_permute2x128_si256(s0, s1, 0x31));
      const __m256 d = _mm256_mul_ps(dw, _mm256_loadu_ps(dys[r] + b));
      alignas(32) float p[8];
      _mm256_store_ps(p, _mm256_mul_ps(_mm256_cvtepi32_ps(tot), d));
      float acc = sumf[r];
      for (int k = 0; k < 8; ++k) acc += p[k];
      sumf[r] = acc;
    }
  }
  for (; b < nb; ++b) {
    const uint8_t* wb = w + b * kW;
    const __m256i wv = Load32(wb + 2), aw = _mm256_sign_epi8(wv, wv);
    const float hw = Half(wb);
    for (int r = 0; r < R; ++r) {
      const int32_t isum = Hsum(DotBlock(aw, wv, ys[r] + b * kY + 2));
      sumf[r] += static_cast<float>(isum) * (hw * dys[r][b]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sumf[r];
}

// pshufb masks: mask c zero-extends byte c of a 128-bit half into every
// int16 lane, in both halves (the K-quants' scale c, unpacked); Q6_K's mask
// s takes int16 lane 2s in the low half and 2s + 1 in the high half.
struct ScaleMasks {
  alignas(32) uint8_t k4[8][32];
  alignas(32) uint8_t k6[4][32];
  ScaleMasks() {
    for (int c = 0; c < 8; ++c) {
      for (int i = 0; i < 32; ++i) k4[c][i] = (i & 1) ? 0x80 : static_cast<uint8_t>(c);
    }
    for (int s = 0; s < 4; ++s) {
      for (int i = 0; i < 32; ++i) k6[s][i] = static_cast<uint8_t>(2 * (2 * s + (i >= 16 ? 1 : 0)) + (i & 1));
    }
  }
};
const ScaleMasks kMasks;

HWY_INLINE __m256i Mask(const uint8_t* m) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(m)); }

template <bool kQ5, int R>
KVQ_VNNI void Avx2Q45_K(const uint8_t* w, const uint8_t* const* ys, const float* const*, const int32_t* const*, size_t nb,
                        float* out) {
  const size_t bytes = kQ5 ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
  __m256 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps();
  for (size_t b = 0; b < nb; ++b, w += bytes) {
    const __m128i sm = ScalesMinsK4(w + 4);
    const __m256i scales = _mm256_broadcastsi128_si256(sm);
    const uint8_t* q = kQ5 ? w + 48 : w + 16;
    const __m256i qh = kQ5 ? Load32(w + 16) : _mm256_setzero_si256();
    constexpr int S = Chains<R>();
    __m256i acc[R][S];
    for (int r = 0; r < R; ++r) {
      for (int s = 0; s < S; ++s) acc[r][s] = _mm256_setzero_si256();
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i c = Load32(q + 32 * j);
      __m256i lo = _mm256_and_si256(c, m4), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
      if (kQ5) {  // bits 2j and 2j + 1 of qh to bit 4 (one 16-bit shift each, then a mask)
        lo = _mm256_or_si256(lo, _mm256_and_si256(ShiftLeft16(qh, 4 - 2 * j), b4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(ShiftLeft16(qh, 3 - 2 * j), b4));
      }
      const __m256i slo = _mm256_shuffle_epi8(scales, Mask(kMasks.k4[2 * j]));
      const __m256i shi = _mm256_shuffle_epi8(scales, Mask(kMasks.k4[2 * j + 1]));
      for (int r = 0; r < R; ++r) {
        const uint8_t* x = ys[r] + b * idot::kQ8_KBytes + 4;
        __m256i& alo = acc[r][(2 * j) % S];
        __m256i& ahi = acc[r][(2 * j + 1) % S];
        alo = MulAddPairs(alo, _mm256_maddubs_epi16(lo, Load32(x + 64 * j)), slo);
        ahi = MulAddPairs(ahi, _mm256_maddubs_epi16(hi, Load32(x + 64 * j + 32)), shi);
      }
    }
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));  // min of each 16 values
    const __m128 hdd = Halves2(w);                                           // d, dmin
    for (int r = 0; r < R; ++r) {
      const uint8_t* y = ys[r] + b * idot::kQ8_KBytes;
      const __m256i summ = _mm256_madd_epi16(Load32(y + 260), mins);
      const __m128 ddm = _mm_mul_ps(hdd, _mm_broadcast_ss(reinterpret_cast<const float*>(y)));
      const __m256 d = _mm256_broadcastss_ps(ddm), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(ddm));
      accf[r] = _mm256_add_ps(accf[r], _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(SumChains(acc, r))),
                                                     _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(summ))));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = Reduce8(accf[r]);
}

template <int R>
KVQ_VNNI void Avx2Q6_K(const uint8_t* w, const uint8_t* const* ys, const float* const*, const int32_t* const*, size_t nb,
                       float* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  __m256 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps();
  for (size_t b = 0; b < nb; ++b, w += 210) {
    constexpr int S = Chains<R>();
    __m256i acc[R][S];
    for (int r = 0; r < R; ++r) {
      for (int s = 0; s < S; ++s) acc[r][s] = _mm256_setzero_si256();
    }
    for (int n = 0; n < 2; ++n) {
      const uint8_t* ql = w + 64 * n;
      const __m256i scales =
          _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 192 + 8 * n))));
      const __m256i l0 = Load32(ql), l1 = Load32(ql + 32), qh = Load32(w + 128 + 32 * n);
      // Each code's two high bits moved to bits 4..5 by one 16-bit shift
      // (or none) and a mask: the bits a shift brings in from the
      // neighbouring byte fall outside it.
      __m256i c[4];
      c[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
      c[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
      c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
      c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
      for (int s = 0; s < 4; ++s) {
        const __m256i sv = _mm256_shuffle_epi8(scales, Mask(kMasks.k6[s]));
        for (int r = 0; r < R; ++r) {
          const uint8_t* x = ys[r] + b * idot::kQ8_KBytes + 4 + 128 * n + 32 * s;
          __m256i& a = acc[r][(4 * n + s) % S];
          a = MulAddPairs(a, _mm256_maddubs_epi16(c[s], Load32(x)), sv);
        }
      }
    }
    // The codes were q + 32: take off 32 sum_g scale_g bsum_g.
    const __m256i all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
    const __m256 hd = _mm256_set1_ps(Half(w + 208));
    for (int r = 0; r < R; ++r) {
      const uint8_t* y = ys[r] + b * idot::kQ8_KBytes;
      const __m256i corr = _mm256_madd_epi16(Load32(y + 260), all);
      const __m256i isum = _mm256_sub_epi32(SumChains(acc, r), _mm256_slli_epi32(corr, 5));
      const __m256 d = _mm256_mul_ps(hd, _mm256_broadcast_ss(reinterpret_cast<const float*>(y)));
      accf[r] = _mm256_add_ps(accf[r], _mm256_mul_ps(d, _mm256_cvtepi32_ps(isum)));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = Reduce8(accf[r]);
}

// ---- Q4_0 decode (one or two activation rows) on repacked activation codes.
// A Q8_0 activation row's codes as the kernels below read them
// (RepackQ4_0Codes, once per call): in each 8 blocks (256 bytes), blocks m
// and m + 4 side by side (m = 0..3): their first 16 codes at
// 128 (m / 2) + 32 (m % 2), their last 16 at that + 64, matching a weight
// vector that holds the nibble bytes of blocks m and m + 4 (low nibbles:
// codes 0..15, high: 16..31); the blocks past the last 8 as their 32 codes
// at 32 b. No scales (the caller's dys). Each pair's int32 lanes then
// hold one block's quad sums per 128-bit half, and the per-block totals
// come out of three hadds (AVX2) or two vpermt2d (AVX3_DL) in block order,
// where the kernel above loads, shifts and inserts every block and sums
// each one's 8 lanes through a 9-shuffle tree.
inline void RepackQ4_0Codes(const uint8_t* y, size_t nb, uint8_t* out) {
  constexpr size_t kY = idot::kQ8_0Bytes;
  size_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    for (size_t j = 0; j < 8; ++j) {
      const size_t m = j % 4;
      uint8_t* o = out + 32 * b + 128 * (m / 2) + 32 * (m % 2) + 16 * (j / 4);
      std::memcpy(o, y + (b + j) * kY + 2, 16);
      std::memcpy(o + 64, y + (b + j) * kY + 18, 16);
    }
  }
  for (; b < nb; ++b) std::memcpy(out + 32 * b, y + b * kY + 2, 32);
}

#if HWY_TARGET == HWY_AVX3_DL
// AVX3_DL, 512-bit: 8 blocks (144 bytes) read as 64-byte vectors; one
// vpermt2b gathers the nibble bytes of blocks 0, 4, 1, 5 (from bytes
// 0..127), another those of 2, 6, 3, 7 (bytes 32..159, the last 16 masked
// off: no read past the 8 blocks), one vpermt2w the 8 fp16 scales; four
// vpdpbusd give the products, two vpermt2d + a 64-bit shift the 8 block
// totals in block order.
struct Q4_0Perm {
  alignas(64) uint8_t n0[64], n1[64];  // nibble bytes: blocks 0,4,1,5 of (wb, wb + 64); 2,6,3,7 of (wb + 32, wb + 96)
  alignas(64) uint16_t scales[32];     // the 8 scale words of (wb, wb + 64)
  alignas(64) uint32_t pa[16], pb[16];  // lanes 2k, 2k + 1 of pa + pb: block k's two halves
  Q4_0Perm() {
    const int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // the block in each 16-byte quarter of the two vectors
    for (int q = 0; q < 4; ++q) {
      for (int i = 0; i < 16; ++i) {  // the byte in the 8 blocks, from the vectors' first byte
        n0[16 * q + i] = static_cast<uint8_t>(18 * order[q] + 2 + i);
        n1[16 * q + i] = static_cast<uint8_t>(18 * order[q + 4] + 2 + i - 32);
      }
    }
    for (int k = 0; k < 32; ++k) scales[k] = static_cast<uint16_t>(k < 8 ? 9 * k : 0);
    for (int q = 0; q < 8; ++q) {  // block order[q]'s 4 lanes: 4q..4q+3 of the concatenated (s0, s1)
      const int k = order[q];
      pa[2 * k] = static_cast<uint32_t>(4 * q), pb[2 * k] = static_cast<uint32_t>(4 * q + 1);
      pa[2 * k + 1] = static_cast<uint32_t>(4 * q + 2), pb[2 * k + 1] = static_cast<uint32_t>(4 * q + 3);
    }
  }
};
const Q4_0Perm kQ4_0Perm;

// The 8 blocks' codes decoded once (Load, which returns their 8 scales),
// then each activation row's 8 block totals in block order (Totals).
struct Q4_0Decoder {
  __m512i m4, p0, p1, psc, pa, pb;
  __m512i l0, h0, l1, h1;  // low and high nibbles of blocks 0, 4, 1, 5 and of 2, 6, 3, 7

  KVQ_VNNI Q4_0Decoder()
      : m4(_mm512_set1_epi8(0x0F)), p0(_mm512_load_si512(kQ4_0Perm.n0)), p1(_mm512_load_si512(kQ4_0Perm.n1)),
        psc(_mm512_load_si512(kQ4_0Perm.scales)), pa(_mm512_load_si512(kQ4_0Perm.pa)),
        pb(_mm512_load_si512(kQ4_0Perm.pb)) {}

  KVQ_VNNI __m256 Load(const uint8_t* wb) {
    const __m512i a = _mm512_loadu_si512(wb), c = _mm512_loadu_si512(wb + 64);
    const __m512i e = _mm512_loadu_si512(wb + 32), f = _mm512_maskz_loadu_epi8(0xFFFFFFFFFFFFull, wb + 96);
    const __m512i n0 = _mm512_permutex2var_epi8(a, p0, c), n1 = _mm512_permutex2var_epi8(e, p1, f);
    l0 = _mm512_and_si512(n0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(n0, 4), m4);
    l1 = _mm512_and_si512(n1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(n1, 4), m4);
    return _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(a, psc, c)));
  }
  KVQ_VNNI __m256i Totals(const uint8_t* x) const {
    const __m512i s0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l0, _mm512_load_si512(x)), h0,
                                           _mm512_load_si512(x + 64));
    const __m512i s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), l1, _mm512_load_si512(x + 128)),
                                           h1, _mm512_load_si512(x + 192));
    const __m512i p = _mm512_add_epi32(_mm512_permutex2var_epi32(s0, pa, s1), _mm512_permutex2var_epi32(s0, pb, s1));
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(p, _mm512_srli_epi64(p, 32)));
  }
};

// Q4_K for one weight row against one or two activation rows (decode) in
// 512-bit vectors, on a repacked activation (RepackQ8_KCodes): a 64-byte
// load of the codes holds sub-blocks 2j and 2j + 2 (low nibbles) or 2j + 1
// and 2j + 3 (high), their activation codes lie side by side in that
// order, and one vpshufb spreads the two sub-blocks' scales over the
// vector's halves: 4 pmaddubsw + 4 vpdpwssd a super-block where the 256-bit
// kernel takes 8 + 8 and 8 scale shuffles. int32 lane j of either half
// holds the reference's lane j (values e with (e mod 32) / 4 == j), so
// the two halves added are Avx2Q45_K's exact lane totals; the float steps
// are its own: RefQ45_K's bits.
struct Q4_KMasks {
  alignas(64) uint8_t m[4][64];  // scale a in bytes 0..31, b in 32..63, zero-extended to int16
  Q4_KMasks() {
    const int pairs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 64; ++i) m[j][i] = (i & 1) ? 0x80 : static_cast<uint8_t>(pairs[j][i / 32]);
    }
  }
};
const Q4_KMasks kQ4_KMasks;

// The Q8_K activation as RepackedQ4_K reads it, 320 bytes a super-block:
// the 256 codes as sub-blocks 0, 2, 1, 3, 4, 6, 5, 7 (32 each: the order
// of the weight vectors' nibbles), then the 16 int16 sums (bytes 256..287)
// and d (float, 288..291).
constexpr size_t kQ8_KRepacked = 320;
inline void RepackQ8_KCodes(const uint8_t* y, size_t nb, uint8_t* out) {
  static constexpr int kOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (size_t b = 0; b < nb; ++b, y += idot::kQ8_KBytes, out += kQ8_KRepacked) {
    for (int k = 0; k < 8; ++k) std::memcpy(out + 32 * k, y + 4 + 32 * kOrder[k], 32);
    std::memcpy(out + 256, y + 260, 32);
    std::memcpy(out + 288, y, 4);
  }
}

template <int R>
KVQ_VNNI void RepackedQ4_K(const uint8_t* w, const uint8_t* const* ys, const float* const*, const int32_t* const*,
                           size_t nb, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512i mask[4];
  for (int j = 0; j < 4; ++j) mask[j] = _mm512_load_si512(kQ4_KMasks.m[j]);
  __m256 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps();
  for (size_t b = 0; b < nb; ++b, w += 144) {
    const __m128i sm = ScalesMinsK4(w + 4);
    const __m512i scales = _mm512_broadcast_i32x4(sm);
    const __m512i q0 = _mm512_loadu_si512(w + 16), q1 = _mm512_loadu_si512(w + 80);
    const __m512i c[4] = {_mm512_and_si512(q0, m4), _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4),
                          _mm512_and_si512(q1, m4), _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4)};
    __m512i sv[4];
    for (int j = 0; j < 4; ++j) sv[j] = _mm512_shuffle_epi8(scales, mask[j]);
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));  // min of each 16 values
    const __m128 hdd = Halves2(w);                                           // d, dmin
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = ys[r] + kQ8_KRepacked * b;
      __m512i a0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(c[0], _mm512_load_si512(x)), sv[0]);
      __m512i a1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(c[1], _mm512_load_si512(x + 64)), sv[1]);
      a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(c[2], _mm512_load_si512(x + 128)), sv[2]);
      a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(c[3], _mm512_load_si512(x + 192)), sv[3]);
      const __m512i a = _mm512_add_epi32(a0, a1);
      const __m256i acc = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
      const __m256i summ = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(x + 256)), mins);
      const __m128 ddm = _mm_mul_ps(hdd, _mm_broadcast_ss(reinterpret_cast<const float*>(x + 288)));
      const __m256 d = _mm256_broadcastss_ps(ddm), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(ddm));
      accf[r] = _mm256_add_ps(accf[r], _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(acc)),
                                                     _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(summ))));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = Reduce8(accf[r]);
}

#else
// AVX2 / AVX3, 256-bit: blocks m and m + 4 in one vector (two 16-byte
// loads), pmaddubsw of its low and high nibbles added in int16 (4 products
// of a nibble and a code: below 2^15), one pmaddwd; three hadds give the 8
// block totals in block order.
struct Q4_0Decoder {
  __m256i m4, ones;
  __m256i lo[4], hi[4];  // low and high nibbles of blocks m and m + 4

  Q4_0Decoder() : m4(_mm256_set1_epi8(0x0F)), ones(_mm256_set1_epi16(1)) {}

  __m256 Load(const uint8_t* wb) {
    constexpr size_t kW = 18;
    const auto half = [&](size_t k) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + k * kW + 2)); };
    for (size_t m = 0; m < 4; ++m) {
      const __m256i n = _mm256_set_m128i(half(m + 4), half(m));
      lo[m] = _mm256_and_si256(n, m4);
      hi[m] = _mm256_and_si256(_mm256_srli_epi16(n, 4), m4);
    }
    return Scales8(wb, kW);
  }
  __m256i Totals(const uint8_t* x) const {
    __m256i v[4];
    for (int m = 0; m < 4; ++m) {
      const uint8_t* xm = x + 128 * (m / 2) + 32 * (m % 2);
      v[m] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[m], Load32(xm)),
                                                _mm256_maddubs_epi16(hi[m], Load32(xm + 64))),
                               ones);
    }
    return _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  }
};
#endif

template <int R>
KVQ_VNNI void RepackedQ4_0(const uint8_t* w, const uint8_t* const* ys, const float* const* dys,
                           const int32_t* const* bs, size_t nb, float* out) {
  constexpr size_t kW = 18;
  Q4_0Decoder dec;
  __m256 accf[R];
  for (int r = 0; r < R; ++r) accf[r] = _mm256_setzero_ps();
  size_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 dw = dec.Load(w + b * kW);
    for (int r = 0; r < R; ++r) {
      const __m256i tot = _mm256_add_epi32(dec.Totals(ys[r] + 32 * b),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs[r] + b)));
      const __m256 d = _mm256_mul_ps(dw, _mm256_loadu_ps(dys[r] + b));
      accf[r] = _mm256_add_ps(accf[r], _mm256_mul_ps(_mm256_cvtepi32_ps(tot), d));
    }
  }
  for (int r = 0; r < R; ++r) {
    if (b < nb) accf[r] = Q4_0Tail(w, ys[r], 32, dys[r], bs[r], b, nb, accf[r]);
    out[r] = Reduce8(accf[r]);
  }
}
#define KVQ_INT_DOT_X86 1
#endif

#if HWY_TARGET == HWY_NEON
// ---- NEON: the same lanes from vmull_s8 products (int16, which no product
// here overflows) added in pairs twice (vpaddlq_s16, vpaddq_s32): int32 lane
// k of a 32-value chunk holds values 4k..4k+3, as on x86; lanes 0-3 in one
// vector, 4-7 in the other. Integer sums exact, float steps the
// reference's: the same bits.

struct Lanes {
  int32x4_t lo, hi;
};

// The 8 quad sums of 32 codes (w0: values 0..15, w1: 16..31) times the
// activation bytes at x.
HWY_INLINE Lanes Quads(int8x16_t w0, int8x16_t w1, const uint8_t* x) {
  const int8x16_t x0 = vld1q_s8(idot::S8(x)), x1 = vld1q_s8(idot::S8(x + 16));
  const int32x4_t a = vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)));
  const int32x4_t b = vpaddlq_s16(vmull_high_s8(w0, x0));
  const int32x4_t c = vpaddlq_s16(vmull_s8(vget_low_s8(w1), vget_low_s8(x1)));
  const int32x4_t d = vpaddlq_s16(vmull_high_s8(w1, x1));
  return {vpaddq_s32(a, b), vpaddq_s32(c, d)};
}

HWY_INLINE float Reduce8(float32x4_t lo, float32x4_t hi) {
  const float32x4_t v = vaddq_f32(lo, hi);
  return (vgetq_lane_f32(v, 0) + vgetq_lane_f32(v, 2)) + (vgetq_lane_f32(v, 1) + vgetq_lane_f32(v, 3));
}

// Q4_0 in RefQ4_0's order: each block's exact total (the quad sums added
// across lanes), times dw dy, into float lane b mod 8.
template <int R>
void NeonQ4_0(const uint8_t* w, const uint8_t* const* ys, const float* const* dys, const int32_t* const*, size_t nb,
              float* out) {
  constexpr size_t kW = 18, kY = idot::kQ8_0Bytes;
  float acc[R][8] = {};
  for (size_t b = 0; b < nb; ++b, w += kW) {
    const uint8x16_t q = vld1q_u8(w + 2);
    const int8x16_t k8 = vdupq_n_s8(8);
    const int8x16_t w0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F))), k8);
    const int8x16_t w1 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), k8);
    const float hw = idot::Half(w);
    for (int r = 0; r < R; ++r) {
      const Lanes l = Quads(w0, w1, ys[r] + b * kY + 2);
      acc[r][b % 8] += static_cast<float>(vaddvq_s32(vaddq_s32(l.lo, l.hi))) * (hw * dys[r][b]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = idot::Reduce8(acc[r]);
}

// Q8_0 in RefQ8_0's order: each block's exact total (the quad sums added
// across lanes), times (dw dy), added into one float per row.
template <int R>
void NeonQ8_0(const uint8_t* w, const uint8_t* const* ys, const float* const* dys, const int32_t* const*, size_t nb,
              float* out) {
  constexpr size_t kW = 34, kY = idot::kQ8_0Bytes;
  float sumf[R] = {};
  for (size_t b = 0; b < nb; ++b, w += kW) {
    const int8x16_t w0 = vld1q_s8(idot::S8(w + 2)), w1 = vld1q_s8(idot::S8(w + 18));
    const float hw = idot::Half(w);
    for (int r = 0; r < R; ++r) {
      const Lanes l = Quads(w0, w1, ys[r] + b * kY + 2);
      const int32_t isum = vaddvq_s32(vaddq_s32(l.lo, l.hi));
      sumf[r] += static_cast<float>(isum) * (hw * dys[r][b]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = sumf[r];
}

template <bool kQ5, int R>
void NeonQ45_K(const uint8_t* w, const uint8_t* const* ys, const float* const*, const int32_t* const*, size_t nb,
               float* out) {
  const size_t bytes = kQ5 ? 176 : 144;
  float32x4_t flo[R], fhi[R];
  for (int r = 0; r < R; ++r) flo[r] = fhi[r] = vdupq_n_f32(0.0f);
  const uint8x16_t m4 = vdupq_n_u8(0x0F), one = vdupq_n_u8(1);
  for (size_t b = 0; b < nb; ++b, w += bytes) {
    uint8_t sc[8], mn[8];
    for (int c = 0; c < 8; ++c) idot::ScaleMinK4(c, w + 4, &sc[c], &mn[c]);
    const uint8_t* q = kQ5 ? w + 48 : w + 16;
    const uint8x16_t h0 = vld1q_u8(w + 16), h1 = vld1q_u8(w + 32);
    int32x4_t alo[R], ahi[R];
    for (int r = 0; r < R; ++r) alo[r] = ahi[r] = vdupq_n_s32(0);
    for (int c = 0; c < 8; ++c) {
      const uint8x16_t q0 = vld1q_u8(q + 32 * (c / 2)), q1 = vld1q_u8(q + 32 * (c / 2) + 16);
      uint8x16_t c0 = (c & 1) ? vshrq_n_u8(q0, 4) : vandq_u8(q0, m4);
      uint8x16_t c1 = (c & 1) ? vshrq_n_u8(q1, 4) : vandq_u8(q1, m4);
      if (kQ5) {
        const int8x16_t sh = vdupq_n_s8(static_cast<int8_t>(-c));
        c0 = vorrq_u8(c0, vshlq_n_u8(vandq_u8(vshlq_u8(h0, sh), one), 4));
        c1 = vorrq_u8(c1, vshlq_n_u8(vandq_u8(vshlq_u8(h1, sh), one), 4));
      }
      for (int r = 0; r < R; ++r) {
        const Lanes l = Quads(vreinterpretq_s8_u8(c0), vreinterpretq_s8_u8(c1),
                              ys[r] + b * idot::kQ8_KBytes + 4 + 32 * static_cast<size_t>(c));
        alo[r] = vmlaq_n_s32(alo[r], l.lo, sc[c]);
        ahi[r] = vmlaq_n_s32(ahi[r], l.hi, sc[c]);
      }
    }
    const float hd = idot::Half(w), hdmin = idot::Half(w + 2);
    for (int r = 0; r < R; ++r) {
      const uint8_t* y = ys[r] + b * idot::kQ8_KBytes;
      int32_t m[8];
      for (int k = 0; k < 8; ++k) m[k] = mn[k] * (idot::I16(y + 260 + 4 * k) + idot::I16(y + 262 + 4 * k));
      const float32x4_t d = vdupq_n_f32(hd * idot::F32(y)), dmin = vdupq_n_f32(hdmin * idot::F32(y));
      flo[r] = vaddq_f32(flo[r], vsubq_f32(vmulq_f32(d, vcvtq_f32_s32(alo[r])), vmulq_f32(dmin, vcvtq_f32_s32(vld1q_s32(m)))));
      fhi[r] = vaddq_f32(fhi[r], vsubq_f32(vmulq_f32(d, vcvtq_f32_s32(ahi[r])), vmulq_f32(dmin, vcvtq_f32_s32(vld1q_s32(m + 4)))));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = Reduce8(flo[r], fhi[r]);
}

template <int R>
void NeonQ6_K(const uint8_t* w, const uint8_t* const* ys, const float* const*, const int32_t* const*, size_t nb,
              float* out) {
  float32x4_t flo[R], fhi[R];
  for (int r = 0; r < R; ++r) flo[r] = fhi[r] = vdupq_n_f32(0.0f);
  const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3);
  for (size_t b = 0; b < nb; ++b, w += 210) {
    const int8_t* sc = idot::S8(w + 192);
    int32x4_t alo[R], ahi[R];
    for (int r = 0; r < R; ++r) alo[r] = ahi[r] = vdupq_n_s32(0);
    for (int c = 0; c < 8; ++c) {
      const int n = c / 4, s = c % 4;
      const uint8_t* ql = w + 64 * n + 32 * (s & 1);
      const uint8_t* qh = w + 128 + 32 * n;
      const int8x16_t sh = vdupq_n_s8(static_cast<int8_t>(-2 * s));
      uint8x16_t u[2];
      for (int half = 0; half < 2; ++half) {
        const uint8x16_t l = vld1q_u8(ql + 16 * half);
        const uint8x16_t low = s < 2 ? vandq_u8(l, m4) : vshrq_n_u8(l, 4);
        const uint8x16_t high = vandq_u8(vshlq_u8(vld1q_u8(qh + 16 * half), sh), m3);
        u[half] = vorrq_u8(low, vshlq_n_u8(high, 4));
      }
      for (int r = 0; r < R; ++r) {
        const Lanes l = Quads(vreinterpretq_s8_u8(u[0]), vreinterpretq_s8_u8(u[1]),
                              ys[r] + b * idot::kQ8_KBytes + 4 + 32 * static_cast<size_t>(c));
        alo[r] = vmlaq_n_s32(alo[r], l.lo, sc[8 * n + 2 * s]);
        ahi[r] = vmlaq_n_s32(ahi[r], l.hi, sc[8 * n + 2 * s + 1]);
      }
    }
    const float hd = idot::Half(w + 208);
    for (int r = 0; r < R; ++r) {
      const uint8_t* y = ys[r] + b * idot::kQ8_KBytes;
      int32_t corr[8];
      for (int k = 0; k < 8; ++k) corr[k] = sc[2 * k] * idot::I16(y + 260 + 4 * k) + sc[2 * k + 1] * idot::I16(y + 262 + 4 * k);
      const float32x4_t d = vdupq_n_f32(hd * idot::F32(y));
      const int32x4_t ilo = vsubq_s32(alo[r], vshlq_n_s32(vld1q_s32(corr), 5));
      const int32x4_t ihi = vsubq_s32(ahi[r], vshlq_n_s32(vld1q_s32(corr + 4), 5));
      flo[r] = vaddq_f32(flo[r], vmulq_f32(d, vcvtq_f32_s32(ilo)));
      fhi[r] = vaddq_f32(fhi[r], vmulq_f32(d, vcvtq_f32_s32(ihi)));
    }
  }
  for (int r = 0; r < R; ++r) out[r] = Reduce8(flo[r], fhi[r]);
}
#define KVQ_INT_DOT_NEON 1
#endif

// Activation rows a weight row's decoding serves: 8 with AVX-512's 32
// registers (the accumulators stay in them), 4 with AVX2's 16 (and NEON,
// whose rows take four vectors each).
constexpr size_t kMaxRows = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL ? 8 : 4;

// A kernel over R activation rows at once (out[r] for ys[r]; the Q8_0
// activations' block scales as float in dys[r]; the activation block sums
// times -8 (Q4_0) or -128 (Q8_0's 8-row kernel on AVX3_DL) in xs[r] on x86).
using RowsFn = void (*)(const uint8_t*, const uint8_t* const*, const float* const*, const int32_t* const*, size_t,
                        float*);
template <int R>
RowsFn Rows(uint32_t type) {
  switch (static_cast<WeightType>(type)) {
#ifdef KVQ_INT_DOT_X86
    case WeightType::kQ4_0: return Avx2Q4_0<R>;
    case WeightType::kQ8_0: return Avx2Q8_0Row<R>;
    case WeightType::kQ4_K: return Avx2Q45_K<false, R>;
    case WeightType::kQ5_K: return Avx2Q45_K<true, R>;
    case WeightType::kQ6_K: return Avx2Q6_K<R>;
#elif defined(KVQ_INT_DOT_NEON)
    case WeightType::kQ4_0: return NeonQ4_0<R>;
    case WeightType::kQ8_0: return NeonQ8_0<R>;
    case WeightType::kQ4_K: return NeonQ45_K<false, R>;
    case WeightType::kQ5_K: return NeonQ45_K<true, R>;
    case WeightType::kQ6_K: return NeonQ6_K<R>;
#endif
    default: return nullptr;
  }
}


// A Q8_0 activation row's block scales as floats (dy[b]), converted once for
// every weight row of a call.
inline void Q8_0Scales(const uint8_t* y, size_t nb, float* dy) {
  for (size_t b = 0; b < nb; ++b) dy[b] = idot::Half(y + b * idot::kQ8_0Bytes);
}

// -shift times the sums of a Q8_0 activation row's blocks' 32 codes
// (sum[b]): the correction of kernels that multiply weight codes + shift
// (Q8_0's + 128 on AVX3_DL, Q4_0's unsigned nibbles, + 8), added.
inline void Q8_0BlockSums(const uint8_t* y, size_t nb, int32_t shift, int32_t* sum) {
  for (size_t b = 0; b < nb; ++b) {
    const int8_t* q = idot::S8(y + b * idot::kQ8_0Bytes + 2);
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += q[j];
    sum[b] = -shift * s;
  }
}

// A kernel over 8 weight rows (at w, rb bytes apart) and R activation rows
// at once: out[8 r + k] for activation row r, weight row k.
using Rows8Fn = void (*)(const uint8_t*, size_t, const uint8_t* const*, const float* const*, const int32_t* const*,
                         size_t, float*);
template <int R>
Rows8Fn Rows8(uint32_t type) {
  switch (static_cast<WeightType>(type)) {
#ifdef KVQ_INT_DOT_X86
    case WeightType::kQ4_0: return Avx2Q4_0Rows8<R>;
    case WeightType::kQ8_0: return Avx2Q8_0Rows8<R>;
#endif
    default: return nullptr;
  }
}

// out[t * ldo + i - r0] = row i . activation row t (at xq + t * stride) for
// rows [r0, r1) and T activation rows, up to kMaxRows activation rows at a
// time (decoded once for them). With one or two (decode) each weight row is
// read in one stream (8 rows side by side read at 0.6x that rate from DRAM),
// Q4_0 on x86 and Q4_K on AVX3_DL against the activation's codes repacked
// once per call into the order of their weight vectors; with three or more, the types that have an 8-row kernel (Q4_0, Q8_0 on
// x86) take weight rows 8 at a time and a block's last rows mod 8 one at a
// time. Every kernel has its reference's bits, so a row's numbers do not
// depend on T or on the split.
void MatMulInt(const WeightMatrix& w, const uint8_t* xq, size_t stride, size_t T, size_t r0, size_t r1, float* out,
               size_t ldo) {
  const size_t nb = w.cols / static_cast<size_t>(weight_block(w.type));
  const RowsFn fns[kMaxRows] = {Rows<1>(w.type), Rows<2>(w.type), Rows<3>(w.type), Rows<4>(w.type)
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
                                , Rows<5>(w.type), Rows<6>(w.type), Rows<7>(w.type), Rows<8>(w.type)
#endif
  };
  const Rows8Fn fns8[kMaxRows] = {nullptr, nullptr, Rows8<3>(w.type), Rows8<4>(w.type)
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
                                  , Rows8<5>(w.type), Rows8<6>(w.type), Rows8<7>(w.type), Rows8<8>(w.type)
#endif
  };
  if (fns[0] == nullptr) {
    const idot::RefFn fn = idot::Ref(w.type);
    for (size_t t = 0; t < T; ++t) {
      for (size_t i = r0; i < r1; ++i) out[t * ldo + i - r0] = fn(w.row(i), xq + t * stride, nb);
    }
    return;
  }
  const bool q8_0 = activation_type(w.type) == 8;
  // The activation block sums: Q4_0's unsigned nibbles on x86, and AVX3_DL's
  // Q8_0 8-row kernel (codes + 128).
#ifdef KVQ_INT_DOT_X86
  const bool q4_0_sums = static_cast<WeightType>(w.type) == WeightType::kQ4_0;
  const bool q8_0_sums = HWY_TARGET == HWY_AVX3_DL && static_cast<WeightType>(w.type) == WeightType::kQ8_0 && T > 2;
#else
  const bool q4_0_sums = false, q8_0_sums = false;
#endif
  const bool sums = q4_0_sums || q8_0_sums;
  // Every activation row's block scales as float (and block sums), made once
  // for every weight row of the call.
  thread_local std::vector<float> dy;  // no allocation per call once grown
  thread_local std::vector<int32_t> xs;
  if (q8_0 && dy.size() < T * nb) dy.resize(T * nb);
  if (sums && xs.size() < T * nb) xs.resize(T * nb);
  for (size_t t = 0; t < T && q8_0; ++t) {
    Q8_0Scales(xq + t * stride, nb, dy.data() + t * nb);
    if (sums) Q8_0BlockSums(xq + t * stride, nb, q4_0_sums ? 8 : 128, xs.data() + t * nb);
  }
  // Decode (one or two activation rows): Q4_0's kernels on x86, and Q4_K's
  // on AVX3_DL, read the activation codes repacked (made once per call;
  // each row's copy 64-byte aligned: the 512-bit kernels load it aligned).
  RowsFn repacked = nullptr;
  size_t repacked_bytes = 0;
#ifdef KVQ_INT_DOT_X86
  if (q4_0_sums && T <= 2) repacked = T == 1 ? RepackedQ4_0<1> : RepackedQ4_0<2>, repacked_bytes = 32 * nb;
#if HWY_TARGET == HWY_AVX3_DL
  if (static_cast<WeightType>(w.type) == WeightType::kQ4_K && T <= 2) {
    repacked = T == 1 ? RepackedQ4_K<1> : RepackedQ4_K<2>, repacked_bytes = kQ8_KRepacked * nb;
  }
#endif
#endif
  repacked_bytes = (repacked_bytes + 63) / 64 * 64;
  thread_local std::vector<uint8_t> repacked_mem;
  uint8_t* codes = nullptr;
  if (repacked != nullptr) {
    if (repacked_mem.size() < T * repacked_bytes + 64) repacked_mem.resize(T * repacked_bytes + 64);
    codes = repacked_mem.data() + (64 - reinterpret_cast<uintptr_t>(repacked_mem.data()) % 64) % 64;
    for (size_t t = 0; t < T; ++t) {
#ifdef KVQ_INT_DOT_X86
      if (q4_0_sums) RepackQ4_0Codes(xq + t * stride, nb, codes + t * repacked_bytes);
#if HWY_TARGET == HWY_AVX3_DL
      else RepackQ8_KCodes(xq + t * stride, nb, codes + t * repacked_bytes);
#endif
#endif
    }
  }
  // Blocks of kRowBlock weight rows (kept in cache) against every group of
  // up to kMaxRows activation rows in turn.
  constexpr size_t kRowBlock = 64;
  for (size_t i0 = r0; i0 < r1; i0 += kRowBlock) {
    const size_t i1 = std::min(r1, i0 + kRowBlock);
    for (size_t t0 = 0; t0 < T; t0 += kMaxRows) {
      const size_t R = std::min<size_t>(kMaxRows, T - t0);
      const uint8_t* ys[kMaxRows];
      const float* dys[kMaxRows] = {};
      const int32_t* xss[kMaxRows] = {};
      RowsFn fn = fns[R - 1];
      for (size_t r = 0; r < R; ++r) {
        ys[r] = xq + (t0 + r) * stride;
        if (q8_0) dys[r] = dy.data() + (t0 + r) * nb;
        if (sums) xss[r] = xs.data() + (t0 + r) * nb;
      }
      if (repacked != nullptr) {  // T <= 2: R == T
        fn = repacked;
        for (size_t r = 0; r < R; ++r) ys[r] = codes + (t0 + r) * repacked_bytes;
      }
      float* o0 = out + t0 * ldo;  // o0[r * ldo + i - r0]: row i against activation row t0 + r
      size_t i = i0;
      if (const Rows8Fn fn8 = fns8[R - 1]) {
        for (; i + 8 <= i1; i += 8) {
          float o[8 * kMaxRows];
          fn8(w.row(i), w.row_bytes, ys, dys, xss, nb, o);
          for (size_t r = 0; r < R; ++r) {
            for (size_t k = 0; k < 8; ++k) o0[r * ldo + i + k - r0] = o[8 * r + k];
          }
        }
      }
      for (; i < i1; ++i) {
        float o[kMaxRows];
        fn(w.row(i), ys, dys, xss, nb, o);
        for (size_t r = 0; r < R; ++r) o0[r * ldo + i - r0] = o[r];
      }
    }
  }
}

void MatVecInt(const WeightMatrix& w, const uint8_t* xq, size_t r0, size_t r1, float* out) {
  MatMulInt(w, xq, 0, 1, r0, r1, out, 0);
}
#undef KVQ_INT_DOT_X86
#undef KVQ_INT_DOT_NEON
#undef KVQ_VNNI

#endif

}  // namespace HWY_NAMESPACE
}  // namespace kvq::ggml
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq::ggml {

HWY_EXPORT(MatMulInt);
HWY_EXPORT(QuantizeQ8_0Rows);

namespace {

// ggml's nearest_int: round to nearest, ties to even, for |f| <= 2^22.
int NearestInt(float f) {
  const float v = f + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// roundf to an int8 code; a NaN (a non-finite activation) becomes 0.
int8_t Round8(float v) {
  if (!(std::fabs(v) <= 127.0f)) return v != v ? 0 : (v > 0 ? 127 : -127);
  return static_cast<int8_t>(std::round(v));
}

void QuantizeQ8_0(const float* x, size_t n, uint8_t* y, bool with_sum) {
  const size_t bytes = with_sum ? idot::kQ8_1Bytes : idot::kQ8_0Bytes;
  for (size_t b = 0; b < n / 32; ++b, x += 32, y += bytes) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t hd = f32_to_f16_ref(d);
    std::memcpy(y, &hd, 2);
    int8_t* qs = reinterpret_cast<int8_t*>(y + (with_sum ? 4 : 2));
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      qs[j] = Round8(x[j] * id);
      sum += qs[j];
    }
    if (with_sum) {
      const uint16_t hs = f32_to_f16_ref(static_cast<float>(sum) * d);
      std::memcpy(y + 2, &hs, 2);
    }
  }
}

void QuantizeQ8_K(const float* x, size_t n, uint8_t* y) {
  for (size_t b = 0; b < n / 256; ++b, x += 256, y += idot::kQ8_KBytes) {
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < 256; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) amax = ax, max = x[j];
    }
    int8_t* qs = reinterpret_cast<int8_t*>(y + 4);
    float d = 0.0f;
    if (amax == 0.0f || !std::isfinite(amax)) {
      std::memset(qs, 0, 256);
    } else {
      const float iscale = -127.0f / max;
      for (int j = 0; j < 256; ++j) qs[j] = static_cast<int8_t>(std::min(127, NearestInt(iscale * x[j])));
      d = 1.0f / iscale;
    }
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += qs[16 * g + j];
      const int16_t s = static_cast<int16_t>(sum);
      std::memcpy(y + 260 + 2 * g, &s, 2);
    }
    std::memcpy(y, &d, 4);
  }
}

}  // namespace

uint32_t activation_type(uint32_t type) {
  switch (static_cast<WeightType>(type)) {
    case WeightType::kQ4_0: case WeightType::kQ5_0: case WeightType::kQ8_0: case WeightType::kIQ4_NL: return 8;
    case WeightType::kQ4_1: case WeightType::kQ5_1: return 9;
    case WeightType::kQ2_K: case WeightType::kQ3_K: case WeightType::kQ4_K: case WeightType::kQ5_K:
    case WeightType::kQ6_K: case WeightType::kIQ4_XS: return 15;
    default: return 0;
  }
}

size_t activation_bytes(uint32_t type, size_t n) {
  switch (activation_type(type)) {
    case 8: return n / 32 * idot::kQ8_0Bytes;
    case 9: return n / 32 * idot::kQ8_1Bytes;
    case 15: return n / 256 * idot::kQ8_KBytes;
    default: return 0;
  }
}

namespace {
// Q8_0 / Q8_1 through the vector code or the scalar reference; Q8_K scalar.
void QuantizeActivation(uint32_t type, const float* x, size_t n, uint8_t* out, bool vector) {
  const uint32_t a = activation_type(type);
  KVQ_ASSERT(a != 0 && n % static_cast<size_t>(weight_block(type)) == 0);
  if (a == 15) {
    QuantizeQ8_K(x, n, out);
  } else if (vector) {
    HWY_DYNAMIC_DISPATCH(QuantizeQ8_0Rows)(x, n, out, a == 9);
  } else {
    QuantizeQ8_0(x, n, out, a == 9);
  }
}
}  // namespace

void quantize_activation(uint32_t type, const float* x, size_t n, uint8_t* out) {
  QuantizeActivation(type, x, n, out, true);
}

void quantize_activation_ref(uint32_t type, const float* x, size_t n, uint8_t* out) {
  QuantizeActivation(type, x, n, out, false);
}

void matvec_int(const WeightMatrix& w, const uint8_t* xq, size_t r0, size_t r1, float* out) {
  KVQ_ASSERT(activation_type(w.type) != 0 && r0 <= r1 && r1 <= w.rows);
  HWY_DYNAMIC_DISPATCH(MatMulInt)(w, xq, 0, 1, r0, r1, out, 0);
}

void matmul_int(const WeightMatrix& w, const uint8_t* xq, size_t T, size_t r0, size_t r1, float* out, size_t ldo) {
  KVQ_ASSERT(activation_type(w.type) != 0 && r0 <= r1 && r1 <= w.rows && (T <= 1 || ldo >= r1 - r0));
  HWY_DYNAMIC_DISPATCH(MatMulInt)(w, xq, activation_bytes(w.type, w.cols), T, r0, r1, out, ldo);
}

float dot_row_int_ref(const WeightMatrix& w, size_t i, const uint8_t* xq) {
  KVQ_ASSERT(activation_type(w.type) != 0 && i < w.rows);
  return idot::DotRef(w, i, xq);
}

}  // namespace kvq::ggml
#endif
