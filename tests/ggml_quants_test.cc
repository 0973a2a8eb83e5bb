// kvq/ggml_quants.h: ggml's q8_0 / q4_0 block layout and golden blocks
// (hand-checked against ggml's reference quantizers).
#include "kvq/ggml_quants.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvq {
namespace {

TEST(GgmlBlocks, LayoutMatchesGgml) {
  EXPECT_EQ(sizeof(ggml::BlockQ8_0), 34u);
  EXPECT_EQ(offsetof(ggml::BlockQ8_0, d), 0u);
  EXPECT_EQ(offsetof(ggml::BlockQ8_0, qs), 2u);
  EXPECT_EQ(sizeof(ggml::BlockQ4_0), 18u);
  EXPECT_EQ(offsetof(ggml::BlockQ4_0, qs), 2u);
}

// Hand-checked: amax = 127 -> d = 1 (fp16 0x3C00); roundf rounds halves away
// from zero (unlike the seed's int8 rule).
TEST(GgmlBlocks, GoldenQ8_0) {
  std::vector<float> x(32, 0.0f);
  const float vals[] = {127.0f, 2.5f, -2.5f, 0.5f, -0.5f, 1.4f, -1.6f, 126.5f, -127.0f};
  std::memcpy(x.data(), vals, sizeof vals);
  ggml::BlockQ8_0 b{};
  ggml::quantize_row_q8_0(x, {&b, 1});
  uint8_t bytes[34];
  std::memcpy(bytes, &b, 34);
  const uint8_t want_head[] = {0x00, 0x3C, 0x7F, 0x03, 0xFD, 0x01, 0xFF, 0x01, 0xFE, 0x7F, 0x81};
  for (size_t i = 0; i < sizeof want_head; ++i) EXPECT_EQ(bytes[i], want_head[i]) << "byte " << i;
  for (size_t i = sizeof want_head; i < 34; ++i) EXPECT_EQ(bytes[i], 0) << "byte " << i;
  std::vector<float> y(32);
  ggml::dequantize_row_q8_0({&b, 1}, y);
  EXPECT_EQ(y[1], 3.0f);
  EXPECT_EQ(y[2], -3.0f);
}

// Hand-checked: the value of largest |x| is -8 -> d = -8 / -8 = 1 (0x3C00),
// nibble = min(15, trunc(x + 8.5)); low nibble holds x[j], high x[j + 16].
TEST(GgmlBlocks, GoldenQ4_0) {
  std::vector<float> x(32);
  for (int j = 0; j < 16; ++j) x[static_cast<size_t>(j)] = static_cast<float>(j - 8);   // nibbles 0..15
  for (int j = 0; j < 16; ++j) x[static_cast<size_t>(16 + j)] = (j % 2) ? 0.5f : -0.5f;  // 9 / 8
  ggml::BlockQ4_0 b{};
  ggml::quantize_row_q4_0(x, {&b, 1});
  uint8_t bytes[18];
  std::memcpy(bytes, &b, 18);
  EXPECT_EQ(bytes[0], 0x00);
  EXPECT_EQ(bytes[1], 0x3C);
  for (int j = 0; j < 16; ++j) {
    const int hi = (j % 2) ? 9 : 8;
    EXPECT_EQ(bytes[2 + j], static_cast<uint8_t>(j | (hi << 4))) << "qs[" << j << "]";
  }
  // Positive max: d = max / -8 is negative, codes flip.
  std::vector<float> p(32, 0.0f);
  p[3] = 4.0f;  // d = -0.5 (fp16 0xB800): 4 / -0.5 = -8 -> nibble 0
  ggml::quantize_row_q4_0(p, {&b, 1});
  EXPECT_EQ(b.d, 0xB800);
  EXPECT_EQ(b.qs[3] & 0x0F, 0);
  EXPECT_EQ(b.qs[0], 0x88);
  std::vector<float> y(32);
  ggml::dequantize_row_q4_0({&b, 1}, y);
  EXPECT_EQ(y[3], 4.0f);
  EXPECT_EQ(y[0], 0.0f);
}

}  // namespace
}  // namespace kvq
