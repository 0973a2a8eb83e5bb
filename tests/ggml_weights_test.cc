// GGUF weight types (kvq/ggml_weights.h): the fused dequantise-and-dot on
// every compiled target against its scalar reference, bit for bit, and
// against the exact sum within its bound. Exactness of the dequantisers
// against ggml itself is python/tests/test_ggml_weights.py (llama.cpp's
// libggml through ctypes).
#include "kvq/ggml_weights.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kvq/ggml_quants.h"
#include "kvq/half.h"
#include "tests/test_util.h"

namespace kvq {
namespace {

using ggml::WeightType;

// The block types (every type but F32 / F16 / BF16).
std::vector<WeightType> BlockTypes() {
  std::vector<WeightType> k;
  for (uint32_t t = 0; t < 64; ++t) {
    if (ggml::fused_type(t)) k.push_back(static_cast<WeightType>(t));
  }
  return k;
}

// rows x cols of random blocks (every code bit pattern) with finite scales.
std::vector<uint8_t> RandomMatrix(WeightType type, size_t rows, size_t cols, test::Rng& rng) {
  const uint32_t t = static_cast<uint32_t>(type);
  const size_t block = static_cast<size_t>(ggml::weight_block(t)), bytes = static_cast<size_t>(ggml::weight_block_bytes(t));
  std::vector<uint8_t> m(rows * cols / block * bytes);
  for (uint8_t& b : m) b = static_cast<uint8_t>(rng.Next());
  for (size_t b = 0; b < m.size() / bytes; ++b) {
    for (uint8_t off : ggml::scale_fields(t)) {
      const float s = static_cast<float>(rng.Uniform() * 0.05 + 1e-3) * (rng.Next() & 1 ? -1.0f : 1.0f);
      const uint16_t h = f32_to_f16_ref(s);
      std::memcpy(m.data() + b * bytes + off, &h, 2);
    }
  }
  return m;
}

ggml::WeightMatrix View(WeightType type, const std::vector<uint8_t>& m, size_t rows, size_t cols) {
  ggml::WeightMatrix w;
  w.type = static_cast<uint32_t>(type);
  w.data = m.data();
  w.rows = rows, w.cols = cols;
  w.row_bytes = m.size() / rows;
  return w;
}

TEST(GgmlWeights, FusedDotEqualsItsReferenceBitForBitOnEveryTarget) {
  test::Rng rng(11);
  test::ForEachTarget([&](const char*) {
    for (const WeightType type : BlockTypes()) {
      SCOPED_TRACE(static_cast<int>(type));
      for (size_t cols : {size_t{256}, size_t{1024}, size_t{96}}) {
        if (cols % static_cast<size_t>(ggml::weight_block(static_cast<uint32_t>(type))) != 0) continue;
        const size_t rows = 9;
        const std::vector<uint8_t> m = RandomMatrix(type, rows, cols, rng);
        const ggml::WeightMatrix w = View(type, m, rows, cols);
        std::vector<float> x(cols), got(rows);
        for (float& v : x) v = static_cast<float>(rng.Gaussian());
        ggml::matvec_fused(w, x.data(), 0, rows, got.data());
        std::vector<float> part(rows - 3);
        ggml::matvec_fused(w, x.data(), 3, rows, part.data());
        for (size_t i = 0; i < rows; ++i) {
          const float want = ggml::dot_row_fused_ref(w, i, x.data());
          ASSERT_TRUE(std::isfinite(want));
          uint32_t a, b;
          std::memcpy(&a, &got[i], 4), std::memcpy(&b, &want, 4);
          ASSERT_EQ(a, b) << "row " << i << " cols " << cols << ": " << got[i] << " vs " << want;
          if (i >= 3) {
            ASSERT_EQ(part[i - 3], got[i]);
          }
        }
      }
    }
  });
}

// Both orders (the fused 16 partial sums and the sequential sum) are within
// gamma_n sum |w x| of the exact sum, n the row length (Higham, Accuracy and
// Stability, 3.1, for any summation order; products add one rounding each).
TEST(GgmlWeights, FusedAndSequentialDotsAreWithinGammaNOfTheExactSum) {
  test::Rng rng(12);
  for (const WeightType type : BlockTypes()) {
    const size_t rows = 16, cols = 2048;
    const std::vector<uint8_t> m = RandomMatrix(type, rows, cols, rng);
    const ggml::WeightMatrix w = View(type, m, rows, cols);
    std::vector<float> x(cols), fused(rows), deq(cols);
    for (float& v : x) v = static_cast<float>(rng.Gaussian()) * (rng.Next() % 9 == 0 ? 30.0f : 1.0f);
    ggml::matvec_fused(w, x.data(), 0, rows, fused.data());
    const double u = std::ldexp(1.0, -24), gamma = (static_cast<double>(cols) + 1) * u / (1 - (cols + 1) * u);
    double worst = 0;
    for (size_t i = 0; i < rows; ++i) {
      ggml::dequantize_rows(w, i, i + 1, deq.data());
      double exact = 0, mag = 0;
      for (size_t j = 0; j < cols; ++j) exact += static_cast<double>(deq[j]) * x[j], mag += std::fabs(static_cast<double>(deq[j]) * x[j]);
      const double seq = ggml::dot_row(w, i, x.data());
      ASSERT_LE(std::fabs(fused[i] - exact), gamma * mag) << static_cast<int>(type) << " row " << i;
      ASSERT_LE(std::fabs(seq - exact), gamma * mag) << static_cast<int>(type) << " row " << i;
      worst = std::max(worst, std::fabs(fused[i] - exact) / mag);
    }
    EXPECT_GT(worst, 0.0);  // the check saw rounding, not identical sums by construction
  }
}

// The integer path (ggml's 8-bit activations, integer block sums): every
// compiled target equals the scalar reference bit for bit, on activations
// with outliers, a block of zeros and tiny values.
std::vector<float> Activation(size_t cols, test::Rng& rng) {
  std::vector<float> x(cols);
  for (size_t j = 0; j < cols; ++j) x[j] = static_cast<float>(rng.Gaussian()) * (j % 97 == 5 ? 40.0f : 1.0f);
  for (size_t j = 0; j < std::min<size_t>(cols, 256); ++j) x[j] = j < 32 ? 0.0f : x[j] * 1e-6f;
  return x;
}

// The vectorised Q8_0 / Q8_1 rounding gives the scalar reference's bytes on
// every target: codes at and beside every tie (x / d = k + 0.5 exactly, where
// roundf goes away from zero and a rint would go to even), blocks with NaN,
// +-Inf, -0, subnormals, all zeros and one huge value.
TEST(GgmlWeights, ActivationRoundingEqualsItsReferenceOnEveryTarget) {
  test::Rng rng(24);
  constexpr size_t kCols = 32 * 12;
  std::vector<float> x(kCols);
  for (size_t b = 0; b < 12; ++b) {
    float* v = x.data() + 32 * b;
    v[0] = 127.0f;  // d = 1: the codes are the values themselves
    for (int j = 1; j < 32; ++j) {
      const float k = static_cast<float>(static_cast<int>(rng.Uniform() * 252.0) - 126);
      const float u = static_cast<float>(rng.Uniform());
      v[j] = b % 3 == 0 ? k + 0.5f : (b % 3 == 1 ? std::nextafter(k + 0.5f, (j & 1) ? 1e9f : -1e9f) : k + u);
    }
  }
  float* odd = x.data() + 32 * 9;
  odd[3] = std::numeric_limits<float>::quiet_NaN(), odd[5] = -0.0f, odd[7] = 1e-42f;
  x[32 * 10 + 4] = std::numeric_limits<float>::infinity(), x[32 * 10 + 9] = -std::numeric_limits<float>::infinity();
  std::fill(x.begin() + 32 * 11, x.end(), 0.0f);
  x[32 * 11 + 17] = 3e38f;
  for (const WeightType type : {WeightType::kQ4_0, WeightType::kQ4_1}) {  // Q8_0, Q8_1 (with the sum)
    const uint32_t t = static_cast<uint32_t>(type);
    std::vector<uint8_t> want(ggml::activation_bytes(t, kCols));
    ggml::quantize_activation_ref(t, x.data(), kCols, want.data());
    test::ForEachTarget([&](const char* target) {
      std::vector<uint8_t> got(want.size(), 0xAA);
      ggml::quantize_activation(t, x.data(), kCols, got.data());
      for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], want[i]) << target << " byte " << i;
    });
  }
}

TEST(GgmlWeights, IntDotEqualsItsReferenceBitForBitOnEveryTarget) {
  test::Rng rng(21);
  test::ForEachTarget([&](const char*) {
    for (const WeightType type : BlockTypes()) {
      const uint32_t t = static_cast<uint32_t>(type);
      SCOPED_TRACE(static_cast<int>(type));
      ASSERT_NE(ggml::activation_type(t), 0u);
      // 352: 11 blocks of 32, Q4_0's 8 at once and 3 alone in one row.
      for (size_t cols : {size_t{256}, size_t{1024}, size_t{96}, size_t{352}}) {
        if (cols % static_cast<size_t>(ggml::weight_block(t)) != 0) continue;
        const size_t rows = 9;
        const std::vector<uint8_t> m = RandomMatrix(type, rows, cols, rng);
        const ggml::WeightMatrix w = View(type, m, rows, cols);
        const std::vector<float> x = Activation(cols, rng);
        std::vector<uint8_t> xq(ggml::activation_bytes(t, cols));
        ggml::quantize_activation(t, x.data(), cols, xq.data());
        std::vector<float> got(rows), part(rows - 3);
        ggml::matvec_int(w, xq.data(), 0, rows, got.data());
        ggml::matvec_int(w, xq.data(), 3, rows, part.data());
        for (size_t i = 0; i < rows; ++i) {
          const float want = ggml::dot_row_int_ref(w, i, xq.data());
          ASSERT_TRUE(std::isfinite(want));
          uint32_t a, b;
          std::memcpy(&a, &got[i], 4), std::memcpy(&b, &want, 4);
          ASSERT_EQ(a, b) << "row " << i << " cols " << cols << ": " << got[i] << " vs " << want;
          if (i >= 3) {
            ASSERT_EQ(part[i - 3], got[i]);
          }
        }
      }
    }
  });
}

// Several activation rows at once (each weight row decoded once for up to
// 4 of them): the same bits as each row through matvec_int, on every target,
// for 1..9 rows (blocks of 4 and the remainders) and a sub-range of rows.
TEST(GgmlWeights, IntMatMulEqualsItsRowsBitForBitOnEveryTarget) {
  test::Rng rng(23);
  test::ForEachTarget([&](const char*) {
    for (const WeightType type : BlockTypes()) {
      const uint32_t t = static_cast<uint32_t>(type);
      SCOPED_TRACE(static_cast<int>(type));
      // 32-value blocks: 11 a row, so that Q4_0's last 3 go alone for every activation row; 34
      // rows from r0, so that the 8-row kernels leave 2 to the row kernels.
      const size_t rows = 39, cols = ggml::weight_block(t) == 32 ? 352 : 512, ab = ggml::activation_bytes(t, cols);
      const std::vector<uint8_t> m = RandomMatrix(type, rows, cols, rng);
      const ggml::WeightMatrix w = View(type, m, rows, cols);
      for (size_t T : {size_t{1}, size_t{2}, size_t{3}, size_t{4}, size_t{5}, size_t{6}, size_t{7}, size_t{9},
                       size_t{10}}) {
        std::vector<uint8_t> xq(T * ab);
        for (size_t r = 0; r < T; ++r) {
          const std::vector<float> x = Activation(cols, rng);
          ggml::quantize_activation(t, x.data(), cols, xq.data() + r * ab);
        }
        const size_t r0 = 5, r1 = rows, ldo = rows + 3;
        std::vector<float> got(T * ldo, -1.0f), one(r1 - r0);
        ggml::matmul_int(w, xq.data(), T, r0, r1, got.data(), ldo);
        for (size_t r = 0; r < T; ++r) {
          ggml::matvec_int(w, xq.data() + r * ab, r0, r1, one.data());
          for (size_t i = 0; i < r1 - r0; ++i) {
            uint32_t a, b;
            std::memcpy(&a, &got[r * ldo + i], 4), std::memcpy(&b, &one[i], 4);
            ASSERT_EQ(a, b) << "T " << T << " row " << r << " i " << i;
          }
          for (size_t i = r1 - r0; i < ldo; ++i) ASSERT_EQ(got[r * ldo + i], -1.0f);  // nothing past the rows
        }
      }
    }
  });
}

// The integer path's result is the float dot product of the weights with the
// activation as rounded: within sum_j |w_j| |x_j - x^_j| plus float rounding
// of the exact sum. Each 8-bit code is within half a step of x_j / d (d =
// amax / 127 of its block), and the step is stored as fp16 for Q8_0 / Q8_1
// (relative 2^-11, times a code of at most 127). A code paired with the
// wrong activation, a wrong scale or a dropped min breaks it by orders of
// magnitude.
TEST(GgmlWeights, IntDotIsTheFloatDotUpToTheActivationsRounding) {
  test::Rng rng(22);
  for (const WeightType type : BlockTypes()) {
    const uint32_t t = static_cast<uint32_t>(type);
    const size_t rows = 16, cols = 2048, ab = ggml::activation_type(t) == 15 ? 256 : 32;
    const std::vector<uint8_t> m = RandomMatrix(type, rows, cols, rng);
    const ggml::WeightMatrix w = View(type, m, rows, cols);
    const std::vector<float> x = Activation(cols, rng);
    std::vector<uint8_t> xq(ggml::activation_bytes(t, cols));
    ggml::quantize_activation(t, x.data(), cols, xq.data());
    std::vector<float> got(rows), deq(cols);
    ggml::matvec_int(w, xq.data(), 0, rows, got.data());
    std::vector<double> step(cols / ab);
    for (size_t b = 0; b < step.size(); ++b) {
      double amax = 0;
      for (size_t j = b * ab; j < (b + 1) * ab; ++j) amax = std::max(amax, std::fabs(static_cast<double>(x[j])));
      step[b] = amax / 127.0;
    }
    double worst = 0;
    for (size_t i = 0; i < rows; ++i) {
      ggml::dequantize_rows(w, i, i + 1, deq.data());
      double exact = 0, mag = 0, quant = 0;
      for (size_t j = 0; j < cols; ++j) {
        exact += static_cast<double>(deq[j]) * x[j];
        mag += std::fabs(static_cast<double>(deq[j]) * x[j]);
        quant += std::fabs(static_cast<double>(deq[j])) * step[j / ab] * (0.5 + 127.0 * std::ldexp(1.0, -11));
      }
      const double tol = quant + 1e-5 * mag;
      ASSERT_LE(std::fabs(got[i] - exact), tol) << static_cast<int>(type) << " row " << i;
      worst = std::max(worst, std::fabs(got[i] - exact) / tol);
    }
    EXPECT_GT(worst, 1e-3) << static_cast<int>(type);  // the activation's rounding is seen, not a float path
  }
}

// The loader's check reads only the scale fields: a block is flagged exactly
// when its dequantised values hold a non-finite one (random bytes: every
// scale pattern, NaN / Inf / subnormal included).
TEST(GgmlWeights, AScaleCheckFindsExactlyTheBlocksWithNonFiniteValues) {
  test::Rng rng(14);
  for (uint32_t t = 0; t < 64; ++t) {
    if (!ggml::weight_type_read(t)) continue;
    SCOPED_TRACE(t);
    const size_t block = static_cast<size_t>(ggml::weight_block(t)), bytes = static_cast<size_t>(ggml::weight_block_bytes(t));
    std::vector<uint8_t> data(bytes);
    std::vector<float> v(block);
    int flagged = 0;
    for (int trial = 0; trial < 20000; ++trial) {
      for (uint8_t& b : data) b = static_cast<uint8_t>(rng.Next());
      ggml::dequantize(t, data.data(), block, v.data());
      bool nonfinite = false;
      for (float x : v) nonfinite = nonfinite || !std::isfinite(x);
      ASSERT_EQ(nonfinite, ggml::first_non_finite_block(t, data.data(), 1) == 0) << "trial " << trial;
      flagged += nonfinite;
    }
    EXPECT_GT(flagged, 0);
  }
}

TEST(GgmlWeights, Q8_0RowsDecodeAsTheKvCachesBlocks) {
  test::Rng rng(13);
  std::vector<float> x(256);
  for (float& v : x) v = static_cast<float>(rng.Gaussian());
  std::vector<ggml::BlockQ8_0> blocks(8);
  ggml::quantize_row_q8_0(x, blocks);
  std::vector<float> a(256), b(256);
  ggml::dequantize_row_q8_0(blocks, a);
  ggml::dequantize(static_cast<uint32_t>(WeightType::kQ8_0), reinterpret_cast<const uint8_t*>(blocks.data()), 256,
                   b.data());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), 256 * sizeof(float)));
  EXPECT_FALSE(ggml::weight_type_read(16));  // IQ2_XXS
  EXPECT_FALSE(ggml::fused_type(static_cast<uint32_t>(WeightType::kF16)));
  EXPECT_TRUE(ggml::fused_type(static_cast<uint32_t>(WeightType::kIQ4_XS)));
}

}  // namespace
}  // namespace kvq
