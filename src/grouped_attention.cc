// The fused attention kernel over coded groups (grouped_kv.h), one Highway
// target each: the loops below run across 16 tokens (K tiles) or across
// channels (V rows) and are vectorised by the compiler for each target's
// instruction set (AVX-512, AVX2, SSE4, baseline), selected at run time.
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
#include <limits>
#include <vector>

#include "kvq/half.h"
#include "src/grouped_attention.h"

HWY_BEFORE_NAMESPACE();
namespace kvq::grouped {
namespace HWY_NAMESPACE {

constexpr int kL = 16;  // tokens per tile

void AttendImpl(const Call& c) {
  const int hd = c.head_dim, P = hd / 2, H = c.n_kv_heads, rep = c.n_heads / H, G = c.group;
  const int tiles = G / kL;
  const size_t uhd = static_cast<size_t>(hd);
  std::vector<float> cs(static_cast<size_t>(P) * kL), sn(cs.size()), kr(uhd * kL);
  std::vector<float> scores(static_cast<size_t>(c.n_heads) * static_cast<size_t>(G));
  std::vector<float> m(static_cast<size_t>(c.n_heads), -std::numeric_limits<float>::infinity());
  std::vector<float> l(static_cast<size_t>(c.n_heads), 0.0f), acc(static_cast<size_t>(c.n_heads) * uhd, 0.0f);
  std::vector<float> klo(uhd), kst(uhd), vlo(uhd), vst(uhd), cacc(static_cast<size_t>(rep) * uhd);
  std::vector<float> p(static_cast<size_t>(rep) * static_cast<size_t>(G)), psum(static_cast<size_t>(rep));
  std::vector<float> code(uhd);
  const size_t ktile_bytes = uhd * 2 * static_cast<size_t>(c.k_bits);
  const size_t vrow_bytes = uhd * static_cast<size_t>(c.v_bits) / 8;

  for (int64_t g = c.g0; g < c.g1; ++g) {
    for (int j = 0; j < tiles; ++j) {
      const int64_t t0 = c.first + g * G + j * kL;
      const float* cb = c.rope_cos + t0 * P;
      const float* sb = c.rope_sin + t0 * P;
      for (int pp = 0; pp < P; ++pp) {
        float* HWY_RESTRICT cp = cs.data() + static_cast<size_t>(pp) * kL;
        float* HWY_RESTRICT sp = sn.data() + static_cast<size_t>(pp) * kL;
        for (int ln = 0; ln < kL; ++ln) {
          const float co = c.rope_cos[ln * P + pp], so = c.rope_sin[ln * P + pp];
          cp[ln] = cb[pp] * co - sb[pp] * so;
          sp[ln] = sb[pp] * co + cb[pp] * so;
        }
      }
      for (int h = 0; h < H; ++h) {
        const uint8_t* grp = c.k + (static_cast<size_t>(h) * static_cast<size_t>(c.max_groups) + static_cast<size_t>(g)) * c.gbk;
        const uint16_t* lo16 = reinterpret_cast<const uint16_t*>(grp);
        const uint8_t* codes = grp + 4 * uhd + static_cast<size_t>(j) * ktile_bytes;
        for (int pp = 0; pp < P; ++pp) {
          uint32_t q0[kL], q1[kL];
          const uint8_t* c0p = codes + static_cast<size_t>(2 * pp) * 2 * static_cast<size_t>(c.k_bits);
          const uint8_t* c1p = c0p + 2 * static_cast<size_t>(c.k_bits);
          Unpack8(c0p, c.k_bits, q0);
          Unpack8(c0p + c.k_bits, c.k_bits, q0 + 8);
          Unpack8(c1p, c.k_bits, q1);
          Unpack8(c1p + c.k_bits, c.k_bits, q1 + 8);
          const float lo0 = f16_to_f32_ref(lo16[2 * pp]), st0 = f16_to_f32_ref(lo16[hd + 2 * pp]);
          const float lo1 = f16_to_f32_ref(lo16[2 * pp + 1]), st1 = f16_to_f32_ref(lo16[hd + 2 * pp + 1]);
          const float* HWY_RESTRICT cp = cs.data() + static_cast<size_t>(pp) * kL;
          const float* HWY_RESTRICT sp = sn.data() + static_cast<size_t>(pp) * kL;
          float* HWY_RESTRICT r0 = kr.data() + static_cast<size_t>(2 * pp) * kL;
          float* HWY_RESTRICT r1 = r0 + kL;
          for (int ln = 0; ln < kL; ++ln) {
            const float k0 = lo0 + st0 * static_cast<float>(q0[ln]);
            const float k1 = lo1 + st1 * static_cast<float>(q1[ln]);
            r0[ln] = k0 * cp[ln] - k1 * sp[ln];
            r1[ln] = k0 * sp[ln] + k1 * cp[ln];
          }
        }
        for (int r = 0; r < rep; ++r) {
          const int qh = h * rep + r;
          const float* HWY_RESTRICT qv = c.q + static_cast<size_t>(qh) * uhd;
          float s[kL] = {};
          for (int i = 0; i < hd; ++i) {
            const float* HWY_RESTRICT ki = kr.data() + static_cast<size_t>(i) * kL;
            for (int ln = 0; ln < kL; ++ln) s[ln] += qv[i] * ki[ln];
          }
          std::copy(s, s + kL, scores.data() + static_cast<size_t>(qh) * G + static_cast<size_t>(j) * kL);
        }
      }
    }
    // One softmax step per head for the whole group, then V.
    for (int h = 0; h < H; ++h) {
      const uint8_t* grp = c.v + (static_cast<size_t>(h) * static_cast<size_t>(c.max_groups) + static_cast<size_t>(g)) * c.gbv;
      const uint16_t* p16 = reinterpret_cast<const uint16_t*>(grp);
      for (int i = 0; i < hd; ++i) vlo[static_cast<size_t>(i)] = f16_to_f32_ref(p16[i]), vst[static_cast<size_t>(i)] = f16_to_f32_ref(p16[hd + i]);
      float alpha[64];  // rep <= 64 (checked by the caller)
      for (int r = 0; r < rep; ++r) {
        const size_t qh = static_cast<size_t>(h * rep + r);
        const float* HWY_RESTRICT s = scores.data() + qh * G;
        float mg = s[0];
        for (int t = 1; t < G; ++t) mg = std::max(mg, s[t]);
        const float mn = std::max(m[qh], mg);
        alpha[r] = std::exp(m[qh] - mn);  // 0 when m was -inf
        m[qh] = mn;
        float* HWY_RESTRICT pr = p.data() + static_cast<size_t>(r) * G;
        float sum = 0.0f;
        for (int t = 0; t < G; ++t) {
          pr[t] = std::exp(s[t] - mn);
          sum += pr[t];
        }
        psum[static_cast<size_t>(r)] = sum;
      }
      std::fill(cacc.begin(), cacc.end(), 0.0f);
      const uint8_t* codes = grp + 4 * uhd;
      for (int t = 0; t < G; ++t) {
        const uint8_t* row = codes + static_cast<size_t>(t) * vrow_bytes;
        for (int i = 0; i < hd; i += 8) {
          uint32_t q8[8];
          Unpack8(row + static_cast<size_t>(i / 8) * static_cast<size_t>(c.v_bits), c.v_bits, q8);
          for (int e = 0; e < 8; ++e) code[static_cast<size_t>(i + e)] = static_cast<float>(q8[e]);
        }
        for (int r = 0; r < rep; ++r) {
          const float w = p[static_cast<size_t>(r) * G + static_cast<size_t>(t)];
          float* HWY_RESTRICT ca = cacc.data() + static_cast<size_t>(r) * uhd;
          const float* HWY_RESTRICT cd = code.data();
          for (int i = 0; i < hd; ++i) ca[i] += w * cd[i];
        }
      }
      for (int r = 0; r < rep; ++r) {
        const size_t qh = static_cast<size_t>(h * rep + r);
        const float P_ = psum[static_cast<size_t>(r)];
        l[qh] = l[qh] * alpha[r] + P_;
        float* HWY_RESTRICT a = acc.data() + qh * uhd;
        const float* HWY_RESTRICT ca = cacc.data() + static_cast<size_t>(r) * uhd;
        for (int i = 0; i < hd; ++i) a[i] = a[i] * alpha[r] + vlo[static_cast<size_t>(i)] * P_ + vst[static_cast<size_t>(i)] * ca[i];
      }
    }
  }
  for (int qh = 0; qh < c.n_heads; ++qh) {
    const size_t uq = static_cast<size_t>(qh);
    if (l[uq] > 0.0f) {
      c.log_mass[uq] = static_cast<double>(m[uq]) + std::log(static_cast<double>(l[uq]));
      const float inv = 1.0f / l[uq];
      for (int i = 0; i < hd; ++i) c.value[uq * uhd + static_cast<size_t>(i)] = acc[uq * uhd + static_cast<size_t>(i)] * inv;
    } else {
      c.log_mass[uq] = -std::numeric_limits<double>::infinity();
      for (int i = 0; i < hd; ++i) c.value[uq * uhd + static_cast<size_t>(i)] = 0.0f;
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
