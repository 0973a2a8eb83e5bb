// I2 part 1: the seed's affine int8 / fp8 quantizer (SPEC §2).
#include "kvq/affine.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include <omp.h>

#include "kvq/fp8.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/base/affine.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/cache_control.h"
#include "src/base/fp8-inl.h"
#include "src/base/names.h"

// Elements per OpenMP work item: large enough to amortise scheduling, a
// multiple of every vector length so aligned (streaming) stores stay aligned.
#ifndef KVQ_AFFINE_CHUNK
#define KVQ_AFFINE_CHUNK (size_t{1} << 16)
#endif

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// How far ahead of the current element the streaming kernels prefetch.
constexpr size_t kPrefetchFloats = 1024;  // 4 KiB
// The int8 max and quantize passes prefetch into L2 (prefetcht2), farther
// ahead: L2 tracks more outstanding misses than L1, and a single core's read
// rate is bound by them (measured: 128 MiB max pass 8.0 ms with L1 prefetch
// 4 KiB ahead, 7.0-7.5 ms with L2 prefetch 16-64 KiB ahead).
constexpr size_t kL2PrefetchFloats = 8192;  // 32 KiB
HWY_INLINE void PrefetchL2(const void* p) { __builtin_prefetch(p, 0, 1); }

// Runs body(c) for every chunk c in [0, chunks): on OpenMP threads when
// there is more than one chunk and the caller is not in a parallel region
// already, else on the calling thread without opening a region (a serial
// `omp parallel ... if (false)` still builds a team: ~250 ns a call, which
// every per-head or per-row call paid). MaxOverChunks: the max of body(c).
template <class Body>
HWY_INLINE void ForChunks(int64_t chunks, const Body& body) {
  if (chunks > 1 && !omp_in_parallel()) {
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) body(c);
  } else {
    for (int64_t c = 0; c < chunks; ++c) body(c);
  }
}
template <class Body>
HWY_INLINE int32_t MaxOverChunks(int64_t chunks, const Body& body) {
  int32_t result = 0;
  if (chunks > 1 && !omp_in_parallel()) {
#pragma omp parallel for schedule(static) reduction(max : result)
    for (int64_t c = 0; c < chunks; ++c) result = std::max(result, body(c));
  } else {
    for (int64_t c = 0; c < chunks; ++c) result = std::max(result, body(c));
  }
  return result;
}

// Largest |x| bit pattern (as int32) over x; >= 0x7F800000 means non-finite.
// Integer max of sign-cleared bits equals the float max for finite values.
int32_t MaxAbsBits(const float* HWY_RESTRICT x, size_t n) {
  const hn::ScalableTag<int32_t> di;
  const size_t N = hn::Lanes(di);
  const int64_t chunks = static_cast<int64_t>((n + KVQ_AFFINE_CHUNK - 1) / KVQ_AFFINE_CHUNK);
  return MaxOverChunks(chunks, [&](int64_t c) {
    const size_t begin = static_cast<size_t>(c) * KVQ_AFFINE_CHUNK;
    const size_t end = std::min(n, begin + KVQ_AFFINE_CHUNK);
    const int32_t* p = reinterpret_cast<const int32_t*>(x);
    const auto mask = hn::Set(di, 0x7FFFFFFF);
    auto m0 = hn::Zero(di), m1 = hn::Zero(di), m2 = hn::Zero(di), m3 = hn::Zero(di);
    size_t i = begin;
    for (; i + 4 * N <= end; i += 4 * N) {
      for (size_t k = 0; k < 4 * N * sizeof(float); k += 64) {
        PrefetchL2(reinterpret_cast<const char*>(p + i + kL2PrefetchFloats) + k);
      }
      m0 = hn::Max(m0, hn::And(hn::LoadU(di, p + i), mask));
      m1 = hn::Max(m1, hn::And(hn::LoadU(di, p + i + N), mask));
      m2 = hn::Max(m2, hn::And(hn::LoadU(di, p + i + 2 * N), mask));
      m3 = hn::Max(m3, hn::And(hn::LoadU(di, p + i + 3 * N), mask));
    }
    for (; i + N <= end; i += N) m0 = hn::Max(m0, hn::And(hn::LoadU(di, p + i), mask));
    int32_t local = hn::GetLane(hn::MaxOfLanes(di, hn::Max(hn::Max(m0, m1), hn::Max(m2, m3))));
    for (; i < end; ++i) local = std::max(local, p[i] & 0x7FFFFFFF);
    return local;
  });
}

// rne(x / scale) clamped to [-127, 127], bit-exact with the true division.
// Fast path (normal scale): y = x * (1/scale). |y - fl(x/scale)| <= 3 * 127 *
// 2^-24 < 2.5e-5 (|x / scale| <= 127 plus the roundings of 1/scale, the
// product and the quotient), so rounding y gives the same integer unless y
// lies within 2.5e-5 of a half-integer; such vectors (rare) are redone with
// Div. With a normal scale |x / scale| < 127.5, so no clamp is needed there.
// Rounding uses the magic-number add: for |z| < 2^22, z + 1.5 * 2^23 lies in
// [2^23, 2^24) where the float spacing is 1, so the add rounds to nearest even
// and the low mantissa bits are the integer.
template <class D>
HWY_INLINE hn::Vec<hn::RebindToSigned<D>> QuantizeInt8Vec(D d, hn::Vec<D> v, hn::Vec<D> vscale,
                                                        hn::Vec<D> vinv) {
  const hn::RebindToSigned<D> di;
  const auto magic = hn::Set(d, 12582912.0f);  // 1.5 * 2^23
  const auto y = hn::Mul(v, vinv);
  auto t = hn::Add(y, magic);
  const auto frac = hn::Abs(hn::Sub(y, hn::Sub(t, magic)));
  if (HWY_UNLIKELY(!hn::AllTrue(d, hn::Le(frac, hn::Set(d, 0.5f - 3.0e-5f))))) {  // NaN -> Div
    const auto z = hn::Min(hn::Max(hn::Div(v, vscale), hn::Set(d, -127.0f)), hn::Set(d, 127.0f));
    t = hn::Add(z, magic);
  }
  return hn::Sub(hn::BitCast(di, t), hn::BitCast(di, magic));
}

// codes = clamp(rne(x / scale), -127, 127); scale > 0 and x finite.
void QuantizeInt8(const float* HWY_RESTRICT x, size_t n, float scale, int8_t* HWY_RESTRICT codes) {
  const hn::ScalableTag<float> d;
  const hn::Rebind<int8_t, decltype(d)> d8;
  const size_t N = hn::Lanes(d);
  const int64_t chunks = static_cast<int64_t>((n + KVQ_AFFINE_CHUNK - 1) / KVQ_AFFINE_CHUNK);
  // A subnormal scale is imprecise (and its reciprocal may be infinite): then
  // every vector takes the clamped division path (NaN fails the fast check).
  const float inv_ok = scale >= std::numeric_limits<float>::min()
                           ? 1.0f / scale
                           : std::numeric_limits<float>::quiet_NaN();
  ForChunks(chunks, [&](int64_t c) {
    const size_t begin = static_cast<size_t>(c) * KVQ_AFFINE_CHUNK;
    const size_t end = std::min(n, begin + KVQ_AFFINE_CHUNK);
    const auto vscale = hn::Set(d, scale);
    const auto vinv = hn::Set(d, inv_ok);
    size_t i = begin;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    // Four vectors of codes packed into one 64-byte streaming store: the codes
    // are not re-read soon, and a normal store would first read each output
    // line (read-for-ownership), a quarter more traffic than the input.
    // packs works within 128-bit blocks; the dword permutation restores order.
    const bool stream = reinterpret_cast<uintptr_t>(codes + i) % 64 == 0;
    if (stream) {
      const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
      for (; i + 4 * N <= end; i += 4 * N) {
        for (size_t j = 0; j < 4; ++j) PrefetchL2(x + i + kL2PrefetchFloats + j * N);
        const auto a = QuantizeInt8Vec(d, hn::LoadU(d, x + i), vscale, vinv);  // |code| <= 127: packs is exact
        const auto b = QuantizeInt8Vec(d, hn::LoadU(d, x + i + N), vscale, vinv);
        const auto c2 = QuantizeInt8Vec(d, hn::LoadU(d, x + i + 2 * N), vscale, vinv);
        const auto e = QuantizeInt8Vec(d, hn::LoadU(d, x + i + 3 * N), vscale, vinv);
        const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(a.raw, b.raw), _mm512_packs_epi32(c2.raw, e.raw));
        _mm512_stream_si512(reinterpret_cast<__m512i*>(codes + i), _mm512_permutexvar_epi32(order, bytes));
      }
    }
#endif
    for (; i + 2 * N <= end; i += 2 * N) {
      PrefetchL2(x + i + kL2PrefetchFloats);
      PrefetchL2(x + i + kL2PrefetchFloats + N);
      const auto a = QuantizeInt8Vec(d, hn::LoadU(d, x + i), vscale, vinv);
      const auto b = QuantizeInt8Vec(d, hn::LoadU(d, x + i + N), vscale, vinv);
      hn::StoreU(hn::DemoteTo(d8, a), d8, codes + i);
      hn::StoreU(hn::DemoteTo(d8, b), d8, codes + i + N);
    }
    for (; i + N <= end; i += N) {
      hn::StoreU(hn::DemoteTo(d8, QuantizeInt8Vec(d, hn::LoadU(d, x + i), vscale, vinv)), d8, codes + i);
    }
    if (i < end) {
      HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)] = {};
      HWY_ALIGN int8_t obuf[HWY_MAX_BYTES / sizeof(float)] = {};
      std::memcpy(buf, x + i, (end - i) * sizeof(float));
      hn::Store(hn::DemoteTo(d8, QuantizeInt8Vec(d, hn::Load(d, buf), vscale, vinv)), d8, obuf);
      std::memcpy(codes + i, obuf, end - i);
    }
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    if (stream) hwy::FlushStream();  // order the streaming stores before the codes are read
#endif
  });
}

// out = code * scale. Uses streaming stores when `out` is vector-aligned:
// the output is 4x the input and is not re-read soon.
void DequantizeInt8(const int8_t* HWY_RESTRICT codes, size_t n, float scale, float* HWY_RESTRICT out) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<int8_t, decltype(d)> d8;
  const size_t N = hn::Lanes(d);
  const bool aligned = (reinterpret_cast<uintptr_t>(out) % (N * sizeof(float))) == 0;
  const int64_t chunks = static_cast<int64_t>((n + KVQ_AFFINE_CHUNK - 1) / KVQ_AFFINE_CHUNK);
  ForChunks(chunks, [&](int64_t c) {
    const size_t begin = static_cast<size_t>(c) * KVQ_AFFINE_CHUNK;
    const size_t end = std::min(n, begin + KVQ_AFFINE_CHUNK);
    const auto vscale = hn::Set(d, scale);
    size_t i = begin;
    if (aligned) {
      for (; i + N <= end; i += N) {
        const auto v = hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, codes + i))), vscale);
        hn::Stream(v, d, out + i);
      }
    } else {
      for (; i + N <= end; i += N) {
        const auto v = hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, codes + i))), vscale);
        hn::StoreU(v, d, out + i);
      }
    }
    for (; i < end; ++i) out[i] = static_cast<float>(codes[i]) * scale;
  });
  if (aligned) hwy::FlushStream();
}

// E4M3 saturating encode fused with a finiteness check; returns false when
// any input is NaN/Inf (the output is then meaningless).
bool QuantizeFp8(const float* HWY_RESTRICT x, size_t n, uint8_t* HWY_RESTRICT codes) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(d)> d8;
  const size_t N = hn::Lanes(d);
  const int64_t chunks = static_cast<int64_t>((n + KVQ_AFFINE_CHUNK - 1) / KVQ_AFFINE_CHUNK);
  const int32_t max_bits = MaxOverChunks(chunks, [&](int64_t c) {
    const size_t begin = static_cast<size_t>(c) * KVQ_AFFINE_CHUNK;
    const size_t end = std::min(n, begin + KVQ_AFFINE_CHUNK);
    const auto mask = hn::Set(di, 0x7FFFFFFF);
    auto m = hn::Zero(di);
    size_t i = begin;
    for (; i + N <= end; i += N) {
      // Software prefetch keeps loads in flight while the ALU-heavy encode
      // runs (the hardware prefetcher alone left DRAM idle here).
      hwy::Prefetch(x + i + kPrefetchFloats);
      const auto v = hn::LoadU(d, x + i);
      m = hn::Max(m, hn::And(hn::BitCast(di, v), mask));
      hn::StoreU(hn::DemoteTo(d8, EncodeFp8<E4M3Fmt>(d, v, /*saturate=*/true)), d8, codes + i);
    }
    int32_t local = hn::GetLane(hn::MaxOfLanes(di, m));
    if (i < end) {
      HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)] = {};
      HWY_ALIGN uint8_t obuf[HWY_MAX_BYTES / sizeof(float)] = {};
      std::memcpy(buf, x + i, (end - i) * sizeof(float));
      const auto v = hn::Load(d, buf);
      local = std::max(local, hn::GetLane(hn::MaxOfLanes(di, hn::And(hn::BitCast(di, v), mask))));
      hn::Store(hn::DemoteTo(d8, EncodeFp8<E4M3Fmt>(d, v, true)), d8, obuf);
      std::memcpy(codes + i, obuf, end - i);
    }
    return local;
  });
  return max_bits < 0x7F800000;
}

// out = decode_e4m3(code) * scale (the multiply is skipped for scale 1).
void DequantizeFp8(const uint8_t* HWY_RESTRICT codes, size_t n, float scale, float* HWY_RESTRICT out) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(d)> d8;
  const size_t N = hn::Lanes(d);
  const bool aligned = (reinterpret_cast<uintptr_t>(out) % (N * sizeof(float))) == 0;
  const int64_t chunks = static_cast<int64_t>((n + KVQ_AFFINE_CHUNK - 1) / KVQ_AFFINE_CHUNK);
  const bool unit = scale == 1.0f;
  ForChunks(chunks, [&](int64_t c) {
    const size_t begin = static_cast<size_t>(c) * KVQ_AFFINE_CHUNK;
    const size_t end = std::min(n, begin + KVQ_AFFINE_CHUNK);
    const auto vscale = hn::Set(d, scale);
    size_t i = begin;
    for (; i + N <= end; i += N) {
      auto v = DecodeFp8<E4M3Fmt>(d, hn::PromoteTo(di, hn::LoadU(d8, codes + i)));
      if (!unit) v = hn::Mul(v, vscale);
      if (aligned) {
        hn::Stream(v, d, out + i);
      } else {
        hn::StoreU(v, d, out + i);
      }
    }
    for (; i < end; ++i) out[i] = unit ? fp8::decode_e4m3(codes[i]) : fp8::decode_e4m3(codes[i]) * scale;
  });
  if (aligned) hwy::FlushStream();
}

}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvq {

HWY_EXPORT(MaxAbsBits);
HWY_EXPORT(QuantizeInt8);
HWY_EXPORT(DequantizeInt8);
HWY_EXPORT(QuantizeFp8);
HWY_EXPORT(DequantizeFp8);

constexpr NamedValue<QuantMode> kQuantModes[] = {{QuantMode::Int8, "int8"}, {QuantMode::Fp8, "fp8"}};
const char* quant_mode_name(QuantMode m) { return name_of(kQuantModes, m); }
QuantMode parse_quant_mode(const std::string& s, const char* arg) { return parse_name(kQuantModes, s, arg); }

float max_abs(std::span<const float> x) {
  return std::bit_cast<float>(HWY_DYNAMIC_DISPATCH(MaxAbsBits)(x.data(), x.size()));
}

float max_abs_ref(std::span<const float> x) {
  uint32_t m = 0;
  for (float v : x) m = std::max(m, std::bit_cast<uint32_t>(v) & 0x7FFFFFFFu);
  return std::bit_cast<float>(m);
}

void quantize_int8(std::span<const float> x, float scale, std::span<int8_t> codes) {
  KVQ_ASSERT(x.size() == codes.size());
  if (scale == 0.0f) {
    if (!codes.empty()) std::memset(codes.data(), 0, codes.size());
    return;
  }
  HWY_DYNAMIC_DISPATCH(QuantizeInt8)(x.data(), x.size(), scale, codes.data());
}

void quantize_int8_ref(std::span<const float> x, float scale, std::span<int8_t> codes) {
  KVQ_ASSERT(x.size() == codes.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (scale == 0.0f) {
      codes[i] = 0;
      continue;
    }
    float q = std::nearbyint(x[i] / scale);  // default rounding: nearest, ties to even
    q = std::min(std::max(q, -127.0f), 127.0f);
    codes[i] = static_cast<int8_t>(q);
  }
}

void dequantize_int8(std::span<const int8_t> codes, float scale, std::span<float> out) {
  KVQ_ASSERT(codes.size() == out.size());
  HWY_DYNAMIC_DISPATCH(DequantizeInt8)(codes.data(), codes.size(), scale, out.data());
}

void dequantize_int8_ref(std::span<const int8_t> codes, float scale, std::span<float> out) {
  KVQ_ASSERT(codes.size() == out.size());
  for (size_t i = 0; i < codes.size(); ++i) out[i] = static_cast<float>(codes[i]) * scale;
}

int64_t first_non_finite(std::span<const float> x) {
  // One vectorised pass over the |x| bit patterns (>= 0x7F800000: Inf or
  // NaN); the index is looked for only when there is one.
  if (std::bit_cast<uint32_t>(max_abs(x)) < 0x7F800000u) return -1;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

namespace {

[[noreturn]] void FailNonFinite(std::span<const float> x) {
  const int64_t i = first_non_finite(x);
  KVQ_ASSERT(i >= 0);
  Fail("x: expected finite values, found ", x[static_cast<size_t>(i)], " at flat index ", i);
}

void CheckInput(const TensorView& x) {
  KVQ_CHECK_ARG(x.rank() >= 1, "x: expected a tensor of rank >= 1, got rank 0");
  KVQ_CHECK_ARG(x.dtype() == DType::F32 || x.dtype() == DType::F16 || x.dtype() == DType::BF16,
                "x: expected dtype f32, f16 or bf16, got ", dtype_name(x.dtype()));
}

// F32 data of x, converting F16/BF16 into `storage` when needed.
std::span<const float> AsF32(const TensorView& x, Tensor& storage) {
  if (x.dtype() == DType::F32) return {x.data_as<float>(), static_cast<size_t>(x.numel())};
  storage = to_f32(x);
  return {storage.data_as<float>(), static_cast<size_t>(storage.numel())};
}

}  // namespace

namespace {
void EnsureShape(Tensor& t, const Shape& shape, DType dtype) {
  if (t.dtype() != dtype || t.shape() != shape || (t.data() == nullptr && shape_numel(shape) > 0)) {
    t = Tensor::Uninitialized(shape, dtype);
  }
}
}  // namespace

void quantize_kv_cache_into(const TensorView& x, QuantMode mode, AffineQuantized& out) {
  CheckInput(x);
  KVQ_CHECK_ARG(mode == QuantMode::Int8 || mode == QuantMode::Fp8,
                "mode: expected QuantMode::Int8 or QuantMode::Fp8, got ", static_cast<int>(mode));
  Tensor storage;
  const std::span<const float> xs = AsF32(x, storage);
  if (mode == QuantMode::Int8) {
    const float m = max_abs(xs);
    if (!std::isfinite(m)) {
      out = AffineQuantized{};
      FailNonFinite(xs);
    }
    EnsureShape(out.codes, x.shape(), DType::I8);
    out.mode = mode;
    out.scale = int8_scale(m);
    quantize_int8(xs, out.scale, {out.codes.data_as<int8_t>(), xs.size()});
    return;
  }
  EnsureShape(out.codes, x.shape(), DType::F8_E4M3);
  out.mode = mode;
  out.scale = 1.0f;
  if (!HWY_DYNAMIC_DISPATCH(QuantizeFp8)(xs.data(), xs.size(), out.codes.data_as<uint8_t>())) {
    out = AffineQuantized{};
    FailNonFinite(xs);
  }
}

AffineQuantized quantize_kv_cache(const TensorView& x, QuantMode mode) {
  AffineQuantized q;
  quantize_kv_cache_into(x, mode, q);
  return q;
}

void dequantize_kv_cache_into(const AffineQuantized& q, Tensor& out) {
  // The largest code times the scale must stay finite (int8 127, fp8 448):
  // a scale of 3e38 would turn codes into infinities. fp8 NaN codes (which
  // the quantizer never writes, its input being finite) decode to NaN, as
  // E4M3FN defines them; int8 -128 decodes to -128 * scale.
  KVQ_CHECK_ARG(std::isfinite(q.scale) && q.scale >= 0.0f &&
                    std::isfinite(q.scale * (q.mode == QuantMode::Int8 ? 127.0f : 448.0f)),
                "q.scale: expected a finite value >= 0 whose product with the largest code is finite, got ", q.scale);
  KVQ_CHECK_ARG(q.mode == QuantMode::Int8 || q.mode == QuantMode::Fp8,
                "q.mode: expected QuantMode::Int8 or QuantMode::Fp8, got ", static_cast<int>(q.mode));
  const DType want = q.mode == QuantMode::Int8 ? DType::I8 : DType::F8_E4M3;
  KVQ_CHECK_ARG(q.codes.dtype() == want, "q.codes: expected dtype ", dtype_name(want), " for mode ",
                quant_mode_name(q.mode), ", got ", dtype_name(q.codes.dtype()));
  EnsureShape(out, q.codes.shape(), DType::F32);
  const size_t n = static_cast<size_t>(q.codes.numel());
  if (q.mode == QuantMode::Int8) {
    dequantize_int8({q.codes.data_as<int8_t>(), n}, q.scale, {out.data_as<float>(), n});
  } else {
    HWY_DYNAMIC_DISPATCH(DequantizeFp8)(q.codes.data_as<uint8_t>(), n, q.scale, out.data_as<float>());
  }
}

Tensor dequantize_kv_cache(const AffineQuantized& q) {
  Tensor out;
  dequantize_kv_cache_into(q, out);
  return out;
}

Tensor quantization_error_per_token(const TensorView& x, QuantMode mode) {
  CheckInput(x);
  const AffineQuantized q = quantize_kv_cache(x, mode);
  const Tensor xhat = dequantize_kv_cache(q);
  Tensor storage;
  const std::span<const float> xs = AsF32(x, storage);
  const int64_t rows = x.dim(0);
  Tensor err(Shape{rows}, DType::F32);
  if (rows == 0) return err;
  const int64_t cols = x.numel() / rows;
  const float* xh = xhat.data_as<float>();
  float* e = err.data_as<float>();
  // Rows with no elements (a zero trailing dim) report 0, not NaN.
#pragma omp parallel for schedule(static) if (x.numel() > (int64_t{1} << 18))
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      s += std::fabs(static_cast<double>(xs[i]) - static_cast<double>(xh[i]));
    }
    e[r] = cols > 0 ? static_cast<float>(s / static_cast<double>(cols)) : 0.0f;
  }
  return err;
}

}  // namespace kvq
#endif  // HWY_ONCE
