// I2 part 1 (SPEC §2): quantize_kv_cache / dequantize_kv_cache /
// quantization_error_per_token.
//
// Tolerances. int8 round trip: q = rne(fl(x / s)) with fl(x / s) within
// 2^-24 relative of x / s, so |x / s - q| <= 1/2 + 127 * 2^-24; the
// dequantised fl(q * s) adds at most |q * s| * 2^-24. Hence
//   |x - x_hat| <= s / 2 + 127 * s * 2^-23   (kInt8Slack below).
// fp8 (E4M3, 3 mantissa bits): |x - x_hat| <= |x| * 2^-4 for normals and
// <= 2^-10 (half the smallest subnormal step) below 2^-6.
#include "kvq/affine.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvq/fp8.h"
#include "tests/test_util.h"

namespace kvq {
namespace {

constexpr double kInt8Slack = 127.0 * 0x1p-23;

Tensor MakeF32(const std::vector<float>& v, Shape shape) { return Tensor::FromF32(v, std::move(shape)); }

TEST(Affine, Int8TiesRoundHalfToEven) {
  // max = 127 -> scale = 1 exactly, so x / scale = x and ties are visible.
  Tensor x = MakeF32({127.0f, 2.5f, 3.5f, -2.5f, -3.5f, 0.5f, 1.5f, -0.5f, 126.5f}, {9});
  AffineQuantized q = quantize_kv_cache(x);
  EXPECT_EQ(q.scale, 1.0f);
  const std::vector<int8_t> want = {127, 2, 4, -2, -4, 0, 2, 0, 126};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(q.codes.data_as<int8_t>()[i], want[i]) << i;
}

TEST(Affine, Int8FormulaMatchesReferenceAndBound) {
  test::Rng rng(11);
  const std::vector<float> v = test::SyntheticKV(rng, 64, 128);
  Tensor x = MakeF32(v, {4, 16, 128});
  AffineQuantized q = quantize_kv_cache(x);
  EXPECT_EQ(q.mode, QuantMode::Int8);
  EXPECT_EQ(q.codes.dtype(), DType::I8);
  EXPECT_EQ(q.shape(), x.shape());
  // The note's formula, written out directly.
  float m = 0;
  for (float f : v) m = std::max(m, std::fabs(f));
  EXPECT_EQ(q.scale, m / 127.0f);
  Tensor xh = dequantize_kv_cache(q);
  const float* d = xh.data_as<float>();
  for (size_t i = 0; i < v.size(); ++i) {
    float want = std::nearbyint(v[i] / q.scale);
    want = std::min(127.0f, std::max(-127.0f, want));
    ASSERT_EQ(q.codes.data_as<int8_t>()[i], static_cast<int8_t>(want)) << i;
    ASSERT_EQ(d[i], static_cast<float>(q.codes.data_as<int8_t>()[i]) * q.scale);
    ASSERT_LE(std::fabs(v[i] - d[i]), q.scale * (0.5 + kInt8Slack)) << i;
  }
  // Distortion band for Gaussian data with 20x outlier channels (one in 37):
  // the grid step is set by the outliers, so the error is a fixed fraction of
  // scale; NMSE must be small but not suspiciously zero.
  const test::Distortion dist = test::Measure(v.data(), d, v.size());
  EXPECT_GT(dist.nmse, 1e-6);
  EXPECT_LT(dist.nmse, 1e-3);
  EXPECT_EQ(dist.sign_flips, 0);
}

TEST(Affine, KernelsBitExactWithReferenceOnEveryTarget) {
  test::Rng rng(5);
  std::vector<float> src(70000 + 16);
  for (auto& f : src) f = static_cast<float>(rng.Gaussian() * 3.0);
  // Exact ties at the scale implied by max = 127.
  src[3] = 127.0f;
  for (size_t i = 10; i < 200; ++i) src[i] = static_cast<float>(static_cast<int>(i) - 100) + 0.5f;
  test::ForEachTarget([&](const char*) {
    for (size_t len : {0, 1, 5, 15, 16, 17, 33, 255, 1000, 70000}) {
      for (size_t off : {0, 1, 3}) {
        std::span<const float> x(src.data() + off, len);
        const float m = max_abs(x);
        ASSERT_EQ(std::bit_cast<uint32_t>(m), std::bit_cast<uint32_t>(max_abs_ref(x)));
        const float s = int8_scale(m);
        std::vector<int8_t> a(len + 1, 99), b(len + 1, 99);
        quantize_int8(x, s, {a.data(), len});
        quantize_int8_ref(x, s, {b.data(), len});
        ASSERT_EQ(a, b) << "len=" << len << " off=" << off;
        // A 64-byte aligned output takes the streaming-store path on AVX-512.
        std::vector<int8_t> buf(len + 128, 99);
        int8_t* al = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
        quantize_int8(x, s, {al, len});
        ASSERT_EQ(0, std::memcmp(al, b.data(), len)) << "aligned, len=" << len << " off=" << off;
        ASSERT_EQ(al[len], 99) << "wrote past the end";
        std::vector<float> fa(len + 2, -1.0f), fb(len + 2, -1.0f);
        dequantize_int8({a.data(), len}, s, {fa.data() + off % 2, len});
        dequantize_int8_ref({a.data(), len}, s, {fb.data() + off % 2, len});
        ASSERT_EQ(fa, fb);
      }
    }
  });
}

TEST(Affine, OpenMPThreadCountDoesNotChangeCodes) {
  test::Rng rng(9);
  std::vector<float> v(1 << 20);
  for (auto& f : v) f = static_cast<float>(rng.Gaussian());
  v[777777] = 50.0f;
  Tensor x = MakeF32(v, {1024, 1024});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  AffineQuantized a = quantize_kv_cache(x);
  AffineQuantized fa = quantize_kv_cache(x, QuantMode::Fp8);
  omp_set_num_threads(2);
  AffineQuantized b = quantize_kv_cache(x);
  AffineQuantized fb = quantize_kv_cache(x, QuantMode::Fp8);
  omp_set_num_threads(saved);
  EXPECT_EQ(a.scale, 50.0f / 127.0f);
  EXPECT_EQ(a.scale, b.scale);
  EXPECT_EQ(0, std::memcmp(a.codes.data(), b.codes.data(), a.codes.nbytes()));
  EXPECT_EQ(0, std::memcmp(fa.codes.data(), fb.codes.data(), fa.codes.nbytes()));
  std::vector<int8_t> ref(v.size());
  quantize_int8_ref(v, a.scale, ref);
  EXPECT_EQ(0, std::memcmp(a.codes.data(), ref.data(), ref.size()));
  // Dequantizing (16 chunks on 1 or 2 threads) is the reference's too.
  std::vector<float> back_ref(v.size());
  dequantize_int8_ref(ref, a.scale, back_ref);
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    const Tensor back = dequantize_kv_cache(a);
    EXPECT_EQ(0, std::memcmp(back.data_as<float>(), back_ref.data(), back_ref.size() * sizeof(float))) << threads;
  }
  omp_set_num_threads(saved);
}

// first_non_finite: -1 for finite input (FLT_MAX included), else the first
// NaN / Inf, in short rows and in 1M-element inputs (several max_abs chunks).
TEST(Affine, FirstNonFiniteFindsTheFirstNanOrInf) {
  EXPECT_EQ(first_non_finite({}), -1);
  const float big = std::numeric_limits<float>::max();
  for (size_t n : {size_t{1}, size_t{7}, size_t{100}, size_t{1} << 20}) {
    std::vector<float> v(n, 1.0f);
    v[n / 2] = -big;
    v[0] = big;
    EXPECT_EQ(first_non_finite(v), -1) << n;
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<float> w = v;
      w[n - 1] = bad;
      EXPECT_EQ(first_non_finite(w), static_cast<int64_t>(n - 1)) << n;
      w[n / 3] = -bad;
      EXPECT_EQ(first_non_finite(w), static_cast<int64_t>(n / 3)) << n;
    }
  }
}

TEST(Affine, AllZeroInputGivesZeroScaleAndZeros) {
  Tensor x({3, 4}, DType::F32);
  AffineQuantized q = quantize_kv_cache(x);
  EXPECT_EQ(q.scale, 0.0f);
  Tensor xh = dequantize_kv_cache(q);
  for (int64_t i = 0; i < 12; ++i) {
    EXPECT_EQ(q.codes.data_as<int8_t>()[i], 0);
    EXPECT_EQ(xh.data_as<float>()[i], 0.0f);
  }
  Tensor e = quantization_error_per_token(x);
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(e.data_as<float>()[i], 0.0f);
}

TEST(Affine, DenormalAndHugeInputs) {
  // max|x| < 63.5 * 2^-149: max/127 rounds to 0 -> zero codes, error
  // bounded by the (tiny) inputs themselves.
  const float tiny = std::numeric_limits<float>::denorm_min();
  Tensor t = MakeF32({tiny, -3 * tiny, 60 * tiny}, {3});
  AffineQuantized qt = quantize_kv_cache(t);
  EXPECT_EQ(qt.scale, 0.0f);
  Tensor th = dequantize_kv_cache(qt);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(th.data_as<float>()[i], 0.0f);
  // Denormal but non-zero scale: codes still follow the formula.
  Tensor d = MakeF32({1e-39f, -5e-40f, 2.5e-40f}, {3});
  AffineQuantized qd = quantize_kv_cache(d);
  EXPECT_GT(qd.scale, 0.0f);
  std::vector<int8_t> ref(3);
  quantize_int8_ref({d.data_as<float>(), 3}, qd.scale, ref);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(qd.codes.data_as<int8_t>()[i], ref[static_cast<size_t>(i)]);
  EXPECT_EQ(qd.codes.data_as<int8_t>()[0], 127);
  // Huge finite values: scale stays finite, reconstruction stays finite.
  Tensor h = MakeF32({3e38f, -1.5e38f, 1.0f}, {3});
  AffineQuantized qh = quantize_kv_cache(h);
  Tensor hh = dequantize_kv_cache(qh);
  EXPECT_TRUE(std::isfinite(qh.scale));
  EXPECT_EQ(qh.codes.data_as<int8_t>()[0], 127);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isfinite(hh.data_as<float>()[i]));
  EXPECT_LE(std::fabs(hh.data_as<float>()[1] + 1.5e38f), qh.scale * (0.5 + kInt8Slack));
  // fp8 saturates huge values to +-448.
  AffineQuantized fh = quantize_kv_cache(h, QuantMode::Fp8);
  EXPECT_EQ(fh.codes.data_as<uint8_t>()[0], 0x7E);
  EXPECT_EQ(fh.codes.data_as<uint8_t>()[1], 0xFE);
}

TEST(Affine, Fp8IsTheE4M3CastWithUnitScale) {
  test::Rng rng(2);
  std::vector<float> v(1000);
  for (auto& f : v) f = static_cast<float>(rng.Gaussian() * 10.0);
  v[0] = 1000.0f;  // saturates
  Tensor x = MakeF32(v, {10, 100});
  AffineQuantized q = quantize_kv_cache(x, QuantMode::Fp8);
  EXPECT_EQ(q.scale, 1.0f);
  EXPECT_EQ(q.codes.dtype(), DType::F8_E4M3);
  Tensor xh = dequantize_kv_cache(q);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint8_t c = q.codes.data_as<uint8_t>()[i];
    ASSERT_EQ(c, fp8::encode_e4m3(v[i]));
    ASSERT_EQ(xh.data_as<float>()[i], fp8::decode_e4m3(c));
    if (i > 0) {
      const double bound = std::fabs(v[i]) >= 0x1p-6 ? std::fabs(v[i]) * 0x1p-4 : 0x1p-10;
      ASSERT_LE(std::fabs(v[i] - xh.data_as<float>()[i]), bound);
    }
  }
  EXPECT_EQ(xh.data_as<float>()[0], 448.0f);
}

TEST(Affine, HalfInputsMatchTheirF32Conversion) {
  test::Rng rng(4);
  std::vector<float> v(777);
  for (auto& f : v) f = static_cast<float>(rng.Gaussian());
  Tensor x = MakeF32(v, {7, 111});
  for (DType dt : {DType::F16, DType::BF16}) {
    Tensor xh = from_f32(x, dt);
    Tensor xf = to_f32(xh);
    for (QuantMode m : {QuantMode::Int8, QuantMode::Fp8}) {
      AffineQuantized a = quantize_kv_cache(xh, m);
      AffineQuantized b = quantize_kv_cache(xf, m);
      EXPECT_EQ(a.scale, b.scale);
      EXPECT_EQ(0, std::memcmp(a.codes.data(), b.codes.data(), a.codes.nbytes()));
    }
  }
}

TEST(Affine, EmptyTensorsRoundTrip) {
  for (Shape s : {Shape{0}, Shape{3, 0}, Shape{0, 4, 8}}) {
    Tensor x(s, DType::F32);
    for (QuantMode m : {QuantMode::Int8, QuantMode::Fp8}) {
      AffineQuantized q = quantize_kv_cache(x, m);
      EXPECT_EQ(q.shape(), s);
      Tensor xh = dequantize_kv_cache(q);
      EXPECT_EQ(xh.shape(), s);
      EXPECT_EQ(xh.numel(), 0);
      Tensor e = quantization_error_per_token(x, m);
      EXPECT_EQ(e.shape(), Shape{s[0]});
    }
  }
}

TEST(Affine, ErrorsNameTheArgument) {
  std::vector<float> v(20, 1.0f);
  v[13] = NAN;
  Tensor xn = MakeF32(v, {4, 5});
  for (QuantMode m : {QuantMode::Int8, QuantMode::Fp8}) {
    const std::string msg = test::ErrorOf([&] { quantize_kv_cache(xn, m); });
    EXPECT_NE(msg.find("flat index 13"), std::string::npos) << msg;
    EXPECT_NE(msg.find("x:"), std::string::npos) << msg;
  }
  v[13] = 1.0f;
  v[7] = -INFINITY;
  v[19] = INFINITY;
  Tensor xi = MakeF32(v, {20});
  EXPECT_NE(test::ErrorOf([&] { quantize_kv_cache(xi); }).find("flat index 7"), std::string::npos);
  EXPECT_NE(test::ErrorOf([&] { quantization_error_per_token(xi); }).find("flat index 7"), std::string::npos);

  Tensor scalar({}, DType::F32);
  EXPECT_NE(test::ErrorOf([&] { quantize_kv_cache(scalar); }).find("rank >= 1"), std::string::npos);
  Tensor i8({4}, DType::I8);
  EXPECT_NE(test::ErrorOf([&] { quantize_kv_cache(i8); }).find("dtype"), std::string::npos);
  EXPECT_NE(test::ErrorOf([&] { quantize_kv_cache(MakeF32({1}, {1}), static_cast<QuantMode>(9)); }).find("mode"),
            std::string::npos);
  EXPECT_THROW(parse_quant_mode("int4"), Error);
  EXPECT_EQ(parse_quant_mode("fp8"), QuantMode::Fp8);

  AffineQuantized q = quantize_kv_cache(MakeF32({1, 2}, {2}));
  q.mode = QuantMode::Fp8;  // codes are i8: mismatch
  EXPECT_NE(test::ErrorOf([&] { dequantize_kv_cache(q); }).find("q.codes"), std::string::npos);
  q.mode = QuantMode::Int8;
  q.scale = NAN;
  EXPECT_NE(test::ErrorOf([&] { dequantize_kv_cache(q); }).find("q.scale"), std::string::npos);
}

TEST(Affine, PerTokenErrorIsRowMeanAbsRoundTrip) {
  test::Rng rng(8);
  const std::vector<float> v = test::SyntheticKV(rng, 32, 64);
  Tensor x = MakeF32(v, {32, 8, 8});
  for (QuantMode m : {QuantMode::Int8, QuantMode::Fp8}) {
    Tensor e = quantization_error_per_token(x, m);
    ASSERT_EQ(e.shape(), Shape{32});
    Tensor xh = dequantize_kv_cache(quantize_kv_cache(x, m));
    const float scale = quantize_kv_cache(x, m).scale;
    for (int r = 0; r < 32; ++r) {
      double s = 0;
      for (int c = 0; c < 64; ++c) s += std::fabs(v[r * 64 + c] - xh.data_as<float>()[r * 64 + c]);
      EXPECT_NEAR(e.data_as<float>()[r], s / 64, 1e-6 * (s / 64) + 1e-12);
      if (m == QuantMode::Int8) {
        EXPECT_LE(e.data_as<float>()[r], scale * 0.5);
      }
      EXPECT_GT(e.data_as<float>()[r], 0.0f);
    }
  }
}

}  // namespace
}  // namespace kvq
