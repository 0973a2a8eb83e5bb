// kvq/half.h: the F16/BF16 scalar references against the compiler's
// conversions, and the bulk SIMD conversions on every target.
#include "kvq/half.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "tests/test_util.h"

namespace kvq {
namespace {

// The compiler's IEEE binary16 type: _Float16 (x86 GCC 12), __fp16 (ARM).
#if defined(__aarch64__)
using CompilerHalf = __fp16;
#else
using CompilerHalf = _Float16;
#endif

// The F16 reference against the compiler's half conversion (hardware
// rounding), over every float bit pattern in strides plus edge values.
TEST(Half, F16ReferenceMatchesCompilerConversion) {
  auto check = [](float f) {
    const CompilerHalf h = static_cast<CompilerHalf>(f);
    uint16_t hb;
    std::memcpy(&hb, &h, 2);
    const uint16_t ref = f32_to_f16_ref(f);
    if (std::isnan(f)) {
      ASSERT_EQ(ref & 0x7C00, 0x7C00);
      ASSERT_NE(ref & 0x3FF, 0);
      return;
    }
    ASSERT_EQ(ref, hb) << "f=" << f << " bits=0x" << std::hex << std::bit_cast<uint32_t>(f);
  };
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 997) check(std::bit_cast<float>(static_cast<uint32_t>(b)));
  for (float f : {65504.0f, 65519.996f, 65520.0f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f, 0x1p-14f, 0x1.ffcp-15f})
    for (float s : {1.0f, -1.0f}) check(s * f);
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32_ref(static_cast<uint16_t>(h));
    CompilerHalf hh;
    const uint16_t h16 = static_cast<uint16_t>(h);
    std::memcpy(&hh, &h16, 2);
    const float want = static_cast<float>(hh);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f));
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(f), std::bit_cast<uint32_t>(want)) << h;
    }
  }
}

TEST(Half, BF16ReferenceRoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16_ref(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16_ref(std::bit_cast<float>(0x3F808000u)), 0x3F80);  // tie -> even
  EXPECT_EQ(f32_to_bf16_ref(std::bit_cast<float>(0x3F818000u)), 0x3F82);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16_ref(std::bit_cast<float>(0x3F808001u)), 0x3F81);
  EXPECT_EQ(f32_to_bf16_ref(std::bit_cast<float>(0x7F7FFFFFu)), 0x7F80);  // overflow -> inf
  EXPECT_EQ(f32_to_bf16_ref(-INFINITY), 0xFF80);
  EXPECT_TRUE(std::isnan(bf16_to_f32_ref(f32_to_bf16_ref(std::bit_cast<float>(0x7F800001u)))));
  EXPECT_EQ(bf16_to_f32_ref(0x3F80), 1.0f);
}

TEST(Half, BulkMatchesReferenceOnEveryTarget) {
  test::Rng rng(3);
  std::vector<float> f(2048 + 8);
  for (size_t i = 0; i < f.size(); ++i) {
    f[i] = (i % 3 == 0) ? rng.Bits32Float() : static_cast<float>(rng.Gaussian() * ((i % 3 == 1) ? 1e-5 : 1e4));
  }
  std::vector<uint16_t> h(f.size());
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(rng.Next());
  test::ForEachTarget([&](const char*) {
    for (size_t len : {0, 1, 7, 8, 9, 15, 16, 17, 33, 100, 2048}) {
      for (size_t off : {0, 1}) {
        std::vector<uint16_t> o16(len + 1, 0xBEEF);
        f32_to_f16({f.data() + off, len}, {o16.data(), len});
        for (size_t i = 0; i < len; ++i) {
          const uint16_t want = f32_to_f16_ref(f[off + i]);
          if ((want & 0x7C00) == 0x7C00 && (want & 0x3FF)) {
            ASSERT_TRUE((o16[i] & 0x7C00) == 0x7C00 && (o16[i] & 0x3FF));  // NaN stays NaN
          } else {
            ASSERT_EQ(o16[i], want) << "f16 i=" << i << " f=" << f[off + i];
          }
        }
        ASSERT_EQ(o16[len], 0xBEEF);
        f32_to_bf16({f.data() + off, len}, {o16.data(), len});
        for (size_t i = 0; i < len; ++i) ASSERT_EQ(o16[i], f32_to_bf16_ref(f[off + i])) << "bf16 i=" << i;
        ASSERT_EQ(o16[len], 0xBEEF);
        std::vector<float> o32(len + 1, -7.0f);
        f16_to_f32({h.data() + off, len}, {o32.data(), len});
        for (size_t i = 0; i < len; ++i) {
          const float want = f16_to_f32_ref(h[off + i]);
          if (std::isnan(want)) {
            ASSERT_TRUE(std::isnan(o32[i]));
          } else {
            ASSERT_EQ(std::bit_cast<uint32_t>(o32[i]), std::bit_cast<uint32_t>(want));
          }
        }
        ASSERT_EQ(o32[len], -7.0f);
        bf16_to_f32({h.data() + off, len}, {o32.data(), len});
        for (size_t i = 0; i < len; ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(o32[i]), std::bit_cast<uint32_t>(bf16_to_f32_ref(h[off + i])));
      }
    }
  });
}

}  // namespace
}  // namespace kvq
