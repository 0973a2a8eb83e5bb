// ggml's weight blocks, decoded as ggml's reference dequantisation does
// (kvq/ggml_weights.h). The block layouts are ggml's (ggml-common.h);
// fields are read with memcpy, since a file need not align a block.
#include "kvq/ggml_weights.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "kvq/error.h"
#include "kvq/half.h"
#include "src/base/ggml_weight_blocks.h"

namespace kvq::ggml {

namespace {

constexpr int kQK = 32;    // the 32-value blocks
constexpr int kQKK = 256;  // the K-quants' super-blocks

using blocks::Half;
using blocks::kIq4Levels;
using blocks::Codes5;
using blocks::ScaleMinK4;
using blocks::ScalesQ3_K;

// Q4_0: d | qs[16]; value j = (low nibble - 8) d, value j + 16 = (high nibble - 8) d.
void Q4_0(const uint8_t* b, float* y) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + kQK / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// Q4_1: d | m | qs[16]; value = nibble d + m.
void Q4_1(const uint8_t* b, float* y) {
  const float d = Half(b), m = Half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + kQK / 2] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// Q5_0: d | qh (32 fifth bits) | qs[16]; value = (5-bit code - 16) d.
void Q5_0(const uint8_t* b, float* y) {
  const float d = Half(b);
  int c[kQK];
  Codes5(b + 2, b + 6, c);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(c[j] - 16) * d;
}

// Q5_1: d | m | qh | qs[16]; value = 5-bit code d + m.
void Q5_1(const uint8_t* b, float* y) {
  const float d = Half(b), m = Half(b + 2);
  int c[kQK];
  Codes5(b + 4, b + 8, c);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(c[j]) * d + m;
}

// Q8_0: d | qs[32] (int8); value = q d.
void Q8_0(const uint8_t* b, float* y) {
  const float d = Half(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// IQ4_NL: d | qs[16]; value = d level[nibble].
void IQ4_NL(const uint8_t* b, float* y) {
  const float d = Half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < kQK / 2; ++j) {
    y[j] = d * static_cast<float>(kIq4Levels[qs[j] & 0x0F]);
    y[j + kQK / 2] = d * static_cast<float>(kIq4Levels[qs[j] >> 4]);
  }
}

// Q2_K: scales[16] (low nibble scale, high nibble min) | qs[64] | d | dmin.
// 16 groups of 16 two-bit codes; value = d sc q - dmin m.
void Q2_K(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = Half(b + 80), dmin = Half(b + 82);
  int is = 0;
  for (int n = 0; n < kQKK; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = scales[is++];
        const float dl = d * static_cast<float>(sc & 0x0F), ml = dmin * static_cast<float>(sc >> 4);
        const uint8_t* qq = q + 16 * half;
        for (int l = 0; l < 16; ++l) *y++ = dl * static_cast<float>((qq[l] >> shift) & 3) - ml;
      }
    }
    q += 32;
  }
}

// Q3_K: hmask[32] | qs[64] | scales[12] (16 six-bit scales) | d. 16 groups
// of 16 three-bit codes (two low bits in qs, the high bit in hmask, set =
// no offset); value = d (scale - 32) (q - 4 if the high bit is clear).
void Q3_K(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d_all = Half(b + 108);
  int8_t scales[16];
  ScalesQ3_K(b + 96, scales);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < kQKK; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d_all * static_cast<float>(scales[is++] - 32);
        const uint8_t* qq = q + 16 * half;
        const uint8_t* hh = hm + 16 * half;
        for (int l = 0; l < 16; ++l) {
          *y++ = dl * static_cast<float>(((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4));
        }
      }
      m = static_cast<uint8_t>(m << 1);
    }
    q += 32;
  }
}

// Q4_K: d | dmin | scales[12] | qs[128]. 8 groups of 32 four-bit codes;
// value = (d sc) q - (dmin m).
void Q4_K(const uint8_t* b, float* y) {
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int is = 0; is < 8; is += 2) {
    uint8_t sc, mn;
    ScaleMinK4(is, scales, &sc, &mn);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(mn);
    ScaleMinK4(is + 1, scales, &sc, &mn);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(mn);
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
  }
}

// Q5_K: d | dmin | scales[12] | qh[32] | qs[128]; Q4_K with a fifth bit.
void Q5_K(const uint8_t* b, float* y) {
  const float d = Half(b), dmin = Half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  uint8_t u1 = 1, u2 = 2;
  for (int is = 0; is < 8; is += 2) {
    uint8_t sc, mn;
    ScaleMinK4(is, scales, &sc, &mn);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(mn);
    ScaleMinK4(is + 1, scales, &sc, &mn);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(mn);
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>((ql[l] & 0x0F) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    ql += 32;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

// Q6_K: ql[128] | qh[64] | scales[16] (int8) | d. 16 groups of 16 six-bit
// codes; value = (d sc) (q - 32).
void Q6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = Half(b + 208);
  for (int n = 0; n < kQKK; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// IQ4_XS: d | scales_h (u16) | scales_l[4] | qs[128]. 8 groups of 32 IQ4_NL
// codes, each with a six-bit scale; value = d (ls - 32) level[nibble].
void IQ4_XS(const uint8_t* b, float* y) {
  const float d = Half(b);
  uint16_t scales_h;
  std::memcpy(&scales_h, b + 2, 2);
  const uint8_t* scales_l = b + 4;
  const uint8_t* qs = b + 8;
  for (int ib = 0; ib < kQKK / 32; ++ib) {
    const int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4);
    const float dl = d * static_cast<float>(ls - 32);
    for (int j = 0; j < 16; ++j) {
      y[j] = dl * static_cast<float>(kIq4Levels[qs[j] & 0x0F]);
      y[j + 16] = dl * static_cast<float>(kIq4Levels[qs[j] >> 4]);
    }
    y += 32;
    qs += 16;
  }
}

struct TypeCodec {
  WeightType type;
  int block, bytes;
  void (*decode)(const uint8_t*, float*);  // one block; null: F32 / F16 / BF16 (converted in bulk)
  uint8_t n_scales, scales[2];             // the block's fp16 scale fields (byte offsets)
};
constexpr TypeCodec kCodecs[] = {
    {WeightType::kF32, 1, 4, nullptr, 0, {}},         {WeightType::kF16, 1, 2, nullptr, 0, {}},
    {WeightType::kBF16, 1, 2, nullptr, 0, {}},        {WeightType::kQ4_0, kQK, 18, Q4_0, 1, {0}},
    {WeightType::kQ4_1, kQK, 20, Q4_1, 2, {0, 2}},    {WeightType::kQ5_0, kQK, 22, Q5_0, 1, {0}},
    {WeightType::kQ5_1, kQK, 24, Q5_1, 2, {0, 2}},    {WeightType::kQ8_0, kQK, 34, Q8_0, 1, {0}},
    {WeightType::kQ2_K, kQKK, 84, Q2_K, 2, {80, 82}}, {WeightType::kQ3_K, kQKK, 110, Q3_K, 1, {108}},
    {WeightType::kQ4_K, kQKK, 144, Q4_K, 2, {0, 2}},  {WeightType::kQ5_K, kQKK, 176, Q5_K, 2, {0, 2}},
    {WeightType::kQ6_K, kQKK, 210, Q6_K, 1, {208}},   {WeightType::kIQ4_NL, kQK, 18, IQ4_NL, 1, {0}},
    {WeightType::kIQ4_XS, kQKK, 136, IQ4_XS, 1, {0}},
};

const TypeCodec* Find(uint32_t type) {
  for (const TypeCodec& c : kCodecs) {
    if (static_cast<uint32_t>(c.type) == type) return &c;
  }
  return nullptr;
}

}  // namespace

bool weight_type_read(uint32_t type) { return Find(type) != nullptr; }

int weight_block(uint32_t type) {
  const TypeCodec* c = Find(type);
  KVQ_ASSERT(c != nullptr);
  return c->block;
}

int weight_block_bytes(uint32_t type) {
  const TypeCodec* c = Find(type);
  KVQ_ASSERT(c != nullptr);
  return c->bytes;
}

std::span<const uint8_t> scale_fields(uint32_t type) {
  const TypeCodec* c = Find(type);
  KVQ_ASSERT(c != nullptr);
  return {c->scales, c->n_scales};
}

int64_t first_non_finite_block(uint32_t type, const uint8_t* data, size_t blocks) {
  const TypeCodec* c = Find(type);
  KVQ_ASSERT(c != nullptr);
  const size_t bytes = static_cast<size_t>(c->bytes);
  for (size_t b = 0; b < blocks; ++b) {
    const uint8_t* p = data + b * bytes;
    bool bad = false;
    if (c->type == WeightType::kF32) {
      uint32_t u;
      std::memcpy(&u, p, 4);
      bad = (u & 0x7F800000u) == 0x7F800000u;
    } else if (c->type == WeightType::kF16 || c->type == WeightType::kBF16) {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint16_t e = c->type == WeightType::kF16 ? 0x7C00 : 0x7F80;
      bad = (h & e) == e;
    } else {
      for (int k = 0; k < c->n_scales; ++k) {
        uint16_t h;
        std::memcpy(&h, p + c->scales[k], 2);
        bad = bad || (h & 0x7C00) == 0x7C00;
      }
    }
    if (bad) return static_cast<int64_t>(b);
  }
  return -1;
}

void dequantize(uint32_t type, const uint8_t* in, size_t n, float* out) {
  const TypeCodec* c = Find(type);
  KVQ_ASSERT(c != nullptr && n % static_cast<size_t>(c->block) == 0);
  if (c->decode != nullptr) {
    const size_t blocks = n / static_cast<size_t>(c->block);
    for (size_t b = 0; b < blocks; ++b) c->decode(in + b * static_cast<size_t>(c->bytes), out + b * static_cast<size_t>(c->block));
    return;
  }
  if (c->type == WeightType::kF32) {
    std::memcpy(out, in, n * sizeof(float));
    return;
  }
  uint16_t h[1024];  // halves copied out in chunks: the file need not align them
  for (size_t i = 0; i < n; i += 1024) {
    const size_t m = std::min<size_t>(1024, n - i);
    std::memcpy(h, in + 2 * i, 2 * m);
    if (c->type == WeightType::kF16) {
      f16_to_f32({h, m}, {out + i, m});
    } else {
      bf16_to_f32({h, m}, {out + i, m});
    }
  }
}

const float* WeightMatrix::f32() const {
  return type == static_cast<uint32_t>(WeightType::kF32) && reinterpret_cast<uintptr_t>(data) % alignof(float) == 0
             ? reinterpret_cast<const float*>(data)
             : nullptr;
}

float dot_row(const WeightMatrix& w, size_t i, const float* x) {
  const uint8_t* r = w.row(i);
  float v = 0.0f;
  if (const float* f = w.f32()) {
    f += i * w.cols;
    for (size_t j = 0; j < w.cols; ++j) v += f[j] * x[j];
    return v;
  }
  const TypeCodec* c = Find(w.type);
  KVQ_ASSERT(c != nullptr);
  // A K-quant super-block or a chunk of 32-value blocks / halves at a time.
  constexpr size_t kChunk = 256;
  float buf[kChunk];
  const size_t per = c->decode != nullptr ? kChunk / static_cast<size_t>(c->block) * static_cast<size_t>(c->bytes)
                                          : kChunk * static_cast<size_t>(c->bytes);
  size_t j = 0;
  for (; j + kChunk <= w.cols; j += kChunk, r += per) {
    dequantize(w.type, r, kChunk, buf);
    for (size_t k = 0; k < kChunk; ++k) v += buf[k] * x[j + k];
  }
  if (j < w.cols) {  // a row of 32-value blocks (or halves) that is not a multiple of 256
    const size_t m = w.cols - j;
    dequantize(w.type, r, m, buf);
    for (size_t k = 0; k < m; ++k) v += buf[k] * x[j + k];
  }
  return v;
}

void dequantize_rows(const WeightMatrix& w, size_t r0, size_t r1, float* out) {
  if (r0 < r1) dequantize(w.type, w.row(r0), (r1 - r0) * w.cols, out);  // rows are contiguous
}

}  // namespace kvq::ggml
