// The row kernel's entry points (kvq/attention.h): validation of a
// KvRowsView, the query's integer planes, work items and their merge, and
// the double-precision reference. The SIMD kernel is attention.cc.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "hwy/base.h"
#include "kvq/affine.h"
#include "kvq/attention.h"
#include "kvq/error.h"
#include "kvq/ggml_quants.h"
#include "kvq/half.h"
#include "src/rows/attention_call.h"
#include "src/rows/row_scheme.h"

namespace kvq {

namespace {

struct Validated {
  int G = 0;
  int64_t T = 0;
  float scale = 0.0f;
  size_t row_bytes = 0;
};

// The view's own checks: every field against the scheme's codec (a view
// from the row store is valid by construction and skips them). Returns the
// codec's row bytes.
size_t ValidateView(const KvRowsView& kv) {
  KVQ_CHECK_ARG(kv.n_kv_heads > 0, "kv.n_kv_heads: expected > 0, got ", kv.n_kv_heads);
  KVQ_CHECK_ARG(kv.head_dim > 0 && kv.head_dim % 8 == 0,
                "kv.head_dim: expected a positive multiple of 8, got ", kv.head_dim);
  const KvRowCodec codec(kv.scheme, kv.n_kv_heads * kv.head_dim, kv.head_dim);  // validates the scheme
  KVQ_CHECK_ARG(kv.tokens >= 0, "kv.tokens: expected >= 0, got ", kv.tokens);
  KVQ_CHECK_ARG(kv.k != nullptr && kv.v != nullptr, "kv.k, kv.v: expected non-null payload pointers");
  KVQ_CHECK_ARG(kv.header_bytes == codec.header_bytes(), "kv.header_bytes: expected ", codec.header_bytes(),
                " for scheme ", kv_scheme_name(kv.scheme), ", got ", kv.header_bytes);
  KVQ_CHECK_ARG(kv.header_bytes == 0 || (kv.k_header != nullptr && kv.v_header != nullptr),
                "kv.k_header, kv.v_header: expected non-null header pointers for scheme ", kv_scheme_name(kv.scheme));
  KVQ_CHECK_ARG(kv.slices == 1 || kv.slices == kv.n_kv_heads, "kv.slices: expected 1 or kv.n_kv_heads = ",
                kv.n_kv_heads, ", got ", kv.slices);
  KVQ_CHECK_ARG(kv.slices == codec.slices() || kv.slices == 1, "kv.slices: scheme ", kv_scheme_name(kv.scheme),
                " with head_dim ", kv.head_dim, " cannot be split per head");
  KVQ_CHECK_ARG(kv.slice_bytes * static_cast<size_t>(kv.slices) + kv.header_bytes == codec.row_bytes(),
                "kv.slice_bytes: expected (row size ", codec.row_bytes(), " - header ", kv.header_bytes, ") / ",
                kv.slices, " slices, got ", kv.slice_bytes);
  KVQ_CHECK_ARG(kv.k_tile == 0 || (kv.k_tile == codec.k_tile() && kv.slices == kv.n_kv_heads),
                "kv.k_tile: expected 0 (rows) or ", codec.k_tile(), " with one slice per KV head for scheme ",
                kv_scheme_name(kv.scheme), " and head_dim ", kv.head_dim, ", got ", kv.k_tile, " with ", kv.slices,
                " slices");
  KVQ_CHECK_ARG(kv.v_tile == 0 || (kv.v_tile == codec.v_tile() && kv.slices == kv.n_kv_heads),
                "kv.v_tile: expected 0 (rows) or ", codec.v_tile(), " with one slice per KV head for scheme ",
                kv_scheme_name(kv.scheme), " and head_dim ", kv.head_dim, ", got ", kv.v_tile, " with ", kv.slices,
                " slices");
  const bool tiled = kv.k_tile != 0 || kv.v_tile != 0;
  KVQ_CHECK_ARG(kv.tile_first >= 0 && (tiled ? kv.tile_first < kKTile : kv.tile_first == 0), "kv.tile_first: expected 0..",
                tiled ? kKTile - 1 : 0, ", got ", kv.tile_first);
  // Positions the slices must hold: tiles are read whole.
  const size_t span = tiled ? static_cast<size_t>((kv.tile_first + kv.tokens + kKTile - 1) / kKTile * kKTile)
                            : static_cast<size_t>(kv.tokens);
  KVQ_CHECK_ARG(kv.slices == 1 || kv.slice_stride >= span * kv.slice_bytes,
                "kv.slice_stride: expected >= ", span, " positions * kv.slice_bytes = ", span * kv.slice_bytes,
                ", got ", kv.slice_stride);
  return codec.row_bytes();
}

// The call's checks (q, out, length, threads, scale), after the view's
// unless it comes from the row store (store_view).
Validated Validate(std::span<const float> q, int n_heads, const KvRowsView& kv, std::span<float> out,
                   const DecodeAttentionOptions& opts, bool store_view = false) {
  Validated r;
  r.row_bytes = store_view ? kv.slice_bytes * static_cast<size_t>(kv.slices) + kv.header_bytes : ValidateView(kv);
  KVQ_CHECK_ARG(n_heads > 0 && n_heads % kv.n_kv_heads == 0, "n_heads: expected a positive multiple of ",
                "kv.n_kv_heads = ", kv.n_kv_heads, ", got ", n_heads);
  const size_t want = static_cast<size_t>(n_heads) * static_cast<size_t>(kv.head_dim);
  KVQ_CHECK_ARG(q.size() == want, "q: expected n_heads * head_dim = ", want, " values, got ", q.size());
  KVQ_CHECK_ARG(out.size() == want, "out: expected ", want, " values, got ", out.size());
  KVQ_CHECK_ARG(opts.length >= -1 && opts.length <= kv.tokens, "length: expected -1 or 0..",
                kv.tokens, " (kv.tokens), got ", opts.length);
  r.T = opts.length < 0 ? kv.tokens : opts.length;
  KVQ_CHECK_ARG(r.T > 0, "kv: expected at least one token to attend to, got 0");
  KVQ_CHECK_ARG(opts.threads >= 0, "threads: expected >= 0, got ", opts.threads);
  KVQ_CHECK_ARG(std::isfinite(opts.scale), "scale: expected a finite value, got ", opts.scale);
  r.scale = opts.scale != 0.0f ? opts.scale : 1.0f / std::sqrt(static_cast<float>(kv.head_dim));
  if (const int64_t bad = first_non_finite(q); bad >= 0) {
    Fail("q: expected finite values, found ", q[static_cast<size_t>(bad)], " at index ", bad);
  }
  r.G = n_heads / kv.n_kv_heads;
  return r;
}

}  // namespace

namespace {
// out[b] = the sum of x[32 b, min(hd, 32 b + 32)) for every 32-element block
// b of one head, in 8 interleaved partial sums (element e into part e % 8,
// then the parts in order): the same rounding bound as one running sum, and
// the float adds no longer wait on each other (one chain cost ~5 us a call).
template <typename Acc, typename T>
void BlockSums(const T* x, size_t hd, Acc* out) {
  for (size_t b = 0; b * ggml::kBlock < hd; ++b) {
    const size_t e0 = b * ggml::kBlock, e1 = std::min(hd, e0 + ggml::kBlock);
    Acc part[8] = {};
    size_t e = e0;
    for (; e + 8 <= e1; e += 8) {
      for (size_t j = 0; j < 8; ++j) part[j] += x[e + j];
    }
    Acc sum = 0;
    for (const Acc p : part) sum += p;
    for (; e < e1; ++e) sum += x[e];
    out[b] = sum;
  }
}

// Start values of one integer query plane's accumulators (ScoreTileInt):
// the codes enter vpdpbusd unsigned, offset by 128 (int8, q8_0) or 8 (q4_0),
// so each accumulator starts at -offset times the plane's sum over its
// elements: per 32-element block for q8_0 / q4_0, entry 0 for the whole head
// for int8 / int8-head tiles (one accumulator per head).
void StartValues(schemes::TileCodes tile, const int8_t* plane, size_t hd, int32_t* out) {
  BlockSums(plane, hd, out);
  const size_t nb32 = (hd + ggml::kBlock - 1) / ggml::kBlock;
  if (tile == schemes::TileCodes::kInt8) {
    int32_t total = 0;
    for (size_t b = 0; b < nb32; ++b) total += out[b];
    out[0] = -128 * total;
    return;
  }
  const int32_t offset = tile == schemes::TileCodes::kQ4 ? 8 : 128;
  for (size_t b = 0; b < nb32; ++b) out[b] *= -offset;
}

// The exact mode's integer query (K tiles on AVX-512 VNNI): a scaled query
// head q as Q = rne(q 2^e) with e = 21 - ilogb(max|q|), so |Q| <= 2^22 (a
// 23-bit fixed point: each element within 2^-23 max|q| of its float, below
// what a 128-term float sum rounds away), split into balanced base-256
// digits Q = D0 + 256 D1 + 65536 D2 with D0, D1 in [-128, 127] and
// |D2| <= 64, so every vpdpbusd plane sum and 256 A_2 + A_1 stay below 2^31
// for head_dim <= 512. Writes the planes (D0 | D1 | D2, hd each) and the
// scale 2^-e; false (the float kernel runs) when max|q| < 2^-105, where
// 2^-e would not be a normal float.
bool QueryDigits(std::span<const float> q, int8_t* planes, float* scale) {
  const float m = max_abs(q);
  const size_t hd = q.size();
  int e = 0;
  if (m != 0.0f) {
    const int x = std::ilogb(m);
    if (x < -105) return false;
    e = 21 - x;
  }
  // q 2^e is exact in float (a power-of-two scaling that stays normal or
  // rounds far below 0.5), and |q 2^e| < 2^22, so the 1.5 * 2^23 add rounds
  // it to the nearest integer, ties to even.
  const float p2 = std::ldexp(1.0f, e), magic = 12582912.0f;
  int8_t* HWY_RESTRICT d0 = planes;
  int8_t* HWY_RESTRICT d1 = planes + hd;
  int8_t* HWY_RESTRICT d2 = planes + 2 * hd;
  for (size_t i = 0; i < hd; ++i) {  // a plain loop the compiler vectorises
    const auto v = static_cast<int32_t>((q[i] * p2 + magic) - magic);
    const int32_t lo = ((v + 128) & 255) - 128;
    const int32_t v1 = (v - lo) >> 8;  // exact: v - lo is a multiple of 256
    const int32_t mid = ((v1 + 128) & 255) - 128;
    d0[i] = static_cast<int8_t>(lo);
    d1[i] = static_cast<int8_t>(mid);
    d2[i] = static_cast<int8_t>((v1 - mid) >> 8);
  }
  *scale = std::ldexp(1.0f, -e);
  return true;
}

// decode_attention, optionally writing each head's log-mass to lse.
void DecodeAttention(std::span<const float> q, int n_heads, const KvRowsView& kv, std::span<float> out,
                     double* lse, const DecodeAttentionOptions& opts, bool store_view = false) {
  const Validated v = Validate(q, n_heads, kv, out, opts, store_view);
  const size_t hd = static_cast<size_t>(kv.head_dim);
  const size_t G = static_cast<size_t>(v.G);

  int threads = opts.threads > 0 ? opts.threads : omp_get_max_threads();
  // Small problems (and calls from inside a parallel region) stay on the
  // caller's thread: fork/join costs more than the work.
  const int64_t work = v.T * kv.n_kv_heads * kv.head_dim;
  if (omp_in_parallel() || work < (int64_t{1} << 16)) threads = 1;
  // Work items: each KV head, split into token segments of >= 256 tokens
  // when there are fewer heads than 2 x threads.
  int64_t segs = 1;
  if (threads > 1 && kv.n_kv_heads < 2 * threads) {
    segs = std::min<int64_t>((2 * threads + kv.n_kv_heads - 1) / kv.n_kv_heads,
                             std::max<int64_t>(1, v.T / 256));
  }
  const int64_t n_items = kv.n_kv_heads * segs;

  thread_local std::vector<float> qs, state, qscale, qfsum;
  thread_local std::vector<int8_t> qi;
  thread_local std::vector<int32_t> qstart;
  thread_local std::vector<attn::Item> items;
  const size_t nb32 = (hd + ggml::kBlock - 1) / ggml::kBlock;
  qs.resize(q.size());
  qfsum.resize(static_cast<size_t>(n_heads) * nb32);
  for (size_t i = 0; i < q.size(); ++i) qs[i] = q[i] * v.scale;
  const schemes::TileCodes tile = schemes::find_row_scheme(kv.scheme)->tile;  // validated
  if (tile == schemes::TileCodes::kQ4 && kv.k_tile != 0) {  // read only by q4_0's float K tiles
    for (size_t h = 0; h < static_cast<size_t>(n_heads); ++h) BlockSums(qs.data() + h * hd, hd, qfsum.data() + h * nb32);
  }
  // Integer query planes for K tiles (read by 16-lane VNNI code only; other
  // targets ignore them). int8_query: each scaled query head rounded to int8
  // by the seed's int8 rule (scale max|q_h| / 127). Otherwise the exact
  // mode's digits (QueryDigits), unless a head's magnitude is out of their
  // range, when the float kernel runs. Plus each plane's per-block sums.
  int planes = 0;
  if (kv.k_tile != 0 && hd % 16 == 0 && hd <= 512) {
    planes = opts.int8_query ? 1 : 3;
    qi.resize(q.size() * static_cast<size_t>(planes));
    qstart.resize(static_cast<size_t>(n_heads * planes) * nb32);
    qscale.resize(static_cast<size_t>(n_heads));
    for (int h = 0; h < n_heads && planes != 0; ++h) {
      const size_t o = static_cast<size_t>(h) * hd;
      const std::span<const float> qh(qs.data() + o, hd);
      int8_t* dst = qi.data() + o * static_cast<size_t>(planes);
      if (planes == 1) {
        const float sc = int8_scale(max_abs(qh));
        quantize_int8(qh, sc, std::span<int8_t>(dst, hd));
        qscale[static_cast<size_t>(h)] = sc;
      } else if (!QueryDigits(qh, dst, &qscale[static_cast<size_t>(h)])) {
        planes = 0;
      }
      for (int p = 0; p < planes; ++p) {
        StartValues(tile, dst + static_cast<size_t>(p) * hd, hd,
                    qstart.data() + static_cast<size_t>(h * planes + p) * nb32);
      }
    }
  }
  const size_t per_item = G * (hd + 2);
  state.assign(static_cast<size_t>(n_items) * per_item, 0.0f);
  items.resize(static_cast<size_t>(n_items));
  for (int64_t i = 0; i < n_items; ++i) {
    const int g = static_cast<int>(i / segs);
    const int64_t sgi = i % segs;
    float* st = state.data() + static_cast<size_t>(i) * per_item;
    std::fill(st, st + G, -std::numeric_limits<float>::infinity());
    const size_t qo = static_cast<size_t>(g) * G * hd, so = static_cast<size_t>(g) * G * nb32;
    const size_t np = static_cast<size_t>(planes);
    items[static_cast<size_t>(i)] = attn::Item{qs.data() + qo,
                                               planes ? qscale.data() + static_cast<size_t>(g) * G : nullptr,
                                               planes ? qi.data() + qo * np : nullptr,
                                               planes ? qstart.data() + so * np : nullptr,
                                               qfsum.data() + so,
                                               st, st + G, st + 2 * G, g, v.G,
                                               v.T * sgi / segs, v.T * (sgi + 1) / segs};
  }
  const attn::Call call{kv.scheme,     kv.n_kv_heads,   kv.head_dim,
                        kv.k,          kv.v,            kv.slice_bytes,
                        kv.slice_stride, kv.n_kv_heads / kv.slices, kv.k_header,
                        kv.v_header,   kv.header_bytes, kv.k_tile, kv.v_tile, kv.tile_first, items.data(),
                        n_items,       threads,         planes};
  attn::RunDecodeAttentionKernel(call);

  // Merge the segments of each KV head: rescale to the common max, sum, divide.
  for (int g = 0; g < kv.n_kv_heads; ++g) {
    for (size_t h = 0; h < G; ++h) {
      float mmax = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < segs; ++s) {
        const attn::Item& it = items[static_cast<size_t>(g * segs + s)];
        if (it.t1 > it.t0) mmax = std::max(mmax, it.m[h]);
      }
      float* o = out.data() + (static_cast<size_t>(g) * G + h) * hd;
      std::fill(o, o + hd, 0.0f);
      float lsum = 0.0f;
      for (int64_t s = 0; s < segs; ++s) {
        const attn::Item& it = items[static_cast<size_t>(g * segs + s)];
        if (it.t1 <= it.t0) continue;
        const float w = std::exp(it.m[h] - mmax);
        lsum += it.l[h] * w;
        for (size_t e = 0; e < hd; ++e) o[e] += it.acc[h * hd + e] * w;
      }
      const float inv = 1.0f / lsum;
      for (size_t e = 0; e < hd; ++e) o[e] *= inv;
      if (lse) lse[static_cast<size_t>(g) * G + h] = static_cast<double>(mmax) + std::log(static_cast<double>(lsum));
    }
  }
}
}  // namespace

namespace {
// An AttentionPart of the view's tokens: the value and each head's log-mass.
AttentionPart Part(std::span<const float> q, int n_heads, const KvRowsView& kv, const DecodeAttentionOptions& opts,
                   bool store_view) {
  AttentionPart p{std::vector<double>(static_cast<size_t>(std::max(n_heads, 0))), std::vector<float>(q.size())};
  DecodeAttention(q, n_heads, kv, p.value, p.log_mass.data(), opts, store_view);
  return p;
}
}  // namespace

void attn::StoreAttention(std::span<const float> q, int n_heads, const KvRowsView& kv, std::span<float> out,
                          const DecodeAttentionOptions& opts) {
  DecodeAttention(q, n_heads, kv, out, nullptr, opts, /*store_view=*/true);
}

AttentionPart attn::StoreAttentionPart(std::span<const float> q, int n_heads, const KvRowsView& kv,
                                       const DecodeAttentionOptions& opts) {
  return Part(q, n_heads, kv, opts, /*store_view=*/true);
}

void decode_attention(std::span<const float> q, int n_heads, const KvRowsView& kv,
                      std::span<float> out, const DecodeAttentionOptions& opts) {
  DecodeAttention(q, n_heads, kv, out, nullptr, opts);
}

AttentionPart decode_attention_part(std::span<const float> q, int n_heads, const KvRowsView& kv,
                                    const DecodeAttentionOptions& opts) {
  return Part(q, n_heads, kv, opts, /*store_view=*/false);
}

Tensor decode_attention(const TensorView& q, const KvRowsView& kv, const DecodeAttentionOptions& opts) {
  KVQ_CHECK_ARG(q.dtype() == DType::F32, "q: expected dtype F32, got ", dtype_name(q.dtype()));
  KVQ_CHECK_ARG(q.rank() == 2 && q.dim(1) == kv.head_dim, "q: expected shape (n_heads, ", kv.head_dim,
                "), got ", shape_str(q.shape()));
  Tensor out = Tensor::Uninitialized(q.shape(), DType::F32);
  decode_attention(std::span<const float>(q.data_as<float>(), static_cast<size_t>(q.numel())),
                   static_cast<int>(q.dim(0)), kv,
                   std::span<float>(out.data_as<float>(), static_cast<size_t>(out.numel())), opts);
  return out;
}

void decode_attention_ref(std::span<const float> q, int n_heads, const KvRowsView& kv,
                          std::span<float> out, const DecodeAttentionOptions& opts) {
  const Validated v = Validate(q, n_heads, kv, out, opts);
  const int row_len = kv.n_kv_heads * kv.head_dim;
  const KvRowCodec codec(kv.scheme, row_len, kv.head_dim);
  const size_t hd = static_cast<size_t>(kv.head_dim), T = static_cast<size_t>(v.T);
  std::vector<float> K(T * static_cast<size_t>(row_len)), V(K.size());
  std::vector<uint8_t> row(codec.row_bytes());
  for (size_t t = 0; t < T; ++t) {
    kv.gather_row(0, static_cast<int64_t>(t), row.data());
    codec.decode(row.data(), K.data() + t * static_cast<size_t>(row_len));
    kv.gather_row(1, static_cast<int64_t>(t), row.data());
    codec.decode(row.data(), V.data() + t * static_cast<size_t>(row_len));
  }
  std::vector<double> sc(T), o(hd);
  for (int h = 0; h < n_heads; ++h) {
    const size_t off = static_cast<size_t>(h / v.G) * hd;
    const float* qh = q.data() + static_cast<size_t>(h) * hd;
    double mx = -INFINITY;
    for (size_t t = 0; t < T; ++t) {
      double s = 0.0;
      for (size_t e = 0; e < hd; ++e) s += static_cast<double>(qh[e]) * K[t * static_cast<size_t>(row_len) + off + e];
      sc[t] = s * v.scale;
      mx = std::max(mx, sc[t]);
    }
    double l = 0.0;
    std::fill(o.begin(), o.end(), 0.0);
    for (size_t t = 0; t < T; ++t) {
      const double p = std::exp(sc[t] - mx);
      l += p;
      for (size_t e = 0; e < hd; ++e) o[e] += p * V[t * static_cast<size_t>(row_len) + off + e];
    }
    for (size_t e = 0; e < hd; ++e) out[static_cast<size_t>(h) * hd + e] = static_cast<float>(o[e] / l);
  }
}

}  // namespace kvq
