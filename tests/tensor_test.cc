// Tensor ownership/views and F16/BF16 conversions (scalar reference vs
// hardware conversions and bulk SIMD on every target).
#include "kvq/tensor.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>

#include "kvq/half.h"
#include "tests/test_util.h"

namespace kvq {
namespace {

// Messages are one line of valid UTF-8 whatever a file held: controls and
// malformed UTF-8 escaped, well-formed UTF-8 kept, escaping idempotent.
TEST(Error, MessagesAreEscaped) {
  EXPECT_EQ(escape_for_message("plain 'text' \\ 1.0"), "plain 'text' \\ 1.0");
  EXPECT_EQ(escape_for_message("caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x99\x82"), "caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x99\x82");
  EXPECT_EQ(escape_for_message(std::string("a\nb\x1b[31m\0\x7f", 10)), "a\\x0ab\\x1b[31m\\x00\\x7f");
  EXPECT_EQ(escape_for_message("\xc0\xaf"), "\\xc0\\xaf");              // overlong '/'
  EXPECT_EQ(escape_for_message("\xed\xa0\x80"), "\\xed\\xa0\\x80");      // a surrogate
  EXPECT_EQ(escape_for_message("\xc2\x85"), "\\xc2\\x85");              // C1 NEL
  EXPECT_EQ(escape_for_message("\xe6\x97"), "\\xe6\\x97");              // cut short
  EXPECT_EQ(escape_for_message("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // > U+10FFFF
  const std::string once = escape_for_message("x\n\xff");
  EXPECT_EQ(escape_for_message(once), once);
  EXPECT_EQ(std::string(Error("name '\n\x1b'").what()), "name '\\x0a\\x1b'");
}

TEST(Tensor, ShapeDtypeAndAlignment) {
  Tensor t({2, 3, 4}, DType::F32);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.data_as<float>()[i], 0.0f);
  EXPECT_EQ(shape_str(t.shape()), "(2, 3, 4)");
  EXPECT_EQ(shape_str({5}), "(5,)");
}

// Buffers of 2 MiB and more are 2 MiB aligned (huge-page candidates); smaller
// ones 64-byte aligned. Either way every element is there and zeroed.
TEST(Tensor, LargeBuffersAreHugePageAligned) {
  constexpr int64_t kHugeFloats = (int64_t{2} << 20) / 4;
  for (const int64_t n : {kHugeFloats - 1, kHugeFloats, kHugeFloats + 1, 3 * kHugeFloats + 5}) {
    Tensor t({n}, DType::F32);
    const uintptr_t align = n >= kHugeFloats ? (uintptr_t{2} << 20) : 64;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % align, 0u) << "n = " << n;
    float* p = t.data_as<float>();
    EXPECT_EQ(p[0], 0.0f);
    EXPECT_EQ(p[n - 1], 0.0f);
    p[n - 1] = 1.0f;
    Tensor u = t.Copy();
    EXPECT_EQ(u.data_as<float>()[n - 1], 1.0f);
  }
}

TEST(Tensor, CopyIsDeepAndViewIsNot) {
  Tensor a = Tensor::FromF32(std::vector<float>{1, 2, 3, 4}, {2, 2});
  Tensor b = a.Copy();
  a.data_as<float>()[0] = 9;
  EXPECT_EQ(b.data_as<float>()[0], 1);
  TensorView v = a;
  EXPECT_EQ(v.data_as<float>()[0], 9);
  EXPECT_EQ(v.shape(), (Shape{2, 2}));
}

TEST(Tensor, EmptyAndErrors) {
  Tensor e({0, 5}, DType::F16);
  EXPECT_EQ(e.numel(), 0);
  EXPECT_THROW(Tensor({-1, 2}, DType::F32), Error);
  EXPECT_THROW(Tensor::FromF32(std::vector<float>{1, 2, 3}, {2, 2}), Error);
  EXPECT_THROW(TensorView(nullptr, {3}, DType::F32), Error);
  EXPECT_THROW(Tensor({int64_t{1} << 40, int64_t{1} << 40}, DType::F32), Error);
  try {
    Tensor::FromF32(std::vector<float>{1, 2, 3}, {2, 2});
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("values"), std::string::npos) << err.what();
  }
}

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

TEST(Tensor, ToAndFromF32) {
  Tensor a = Tensor::FromF32(std::vector<float>{1.0f, -2.5f, 3.0e-3f}, {3});
  Tensor h = from_f32(a, DType::F16);
  EXPECT_EQ(h.dtype(), DType::F16);
  Tensor back = to_f32(h);
  EXPECT_EQ(back.data_as<float>()[1], -2.5f);
  EXPECT_NEAR(back.data_as<float>()[2], 3.0e-3f, 3.0e-3f * 1e-3);
  Tensor i8({3}, DType::I8);
  EXPECT_THROW(to_f32(i8), Error);
  EXPECT_THROW(from_f32(a, DType::I8), Error);
}

}  // namespace
}  // namespace kvq
