// Tensor ownership/views, error messages, and tensors' F32 conversions
// (the F16/BF16 conversions themselves: half_test.cc).
#include "kvq/tensor.h"

#include <gtest/gtest.h>

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
