// fp8 (OCP E4M3FN / E5M2) codec tests: exhaustive codes, golden rounding
// edges for both signs, every representable value and neighbouring
// midpoints +-1 ulp against a brute-force nearest-value oracle, and bulk ==
// scalar on every compiled SIMD target.
#include "kvq/fp8.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <set>
#include <vector>

#include "tests/test_util.h"

namespace kvq::fp8 {
namespace {

using EncodeFn = uint8_t (*)(float, Overflow);
using DecodeFn = float (*)(uint8_t);

struct Format {
  const char* name;
  EncodeFn encode;
  DecodeFn decode;
  float max;
  uint8_t max_code;
  uint8_t nosat_overflow;  // NaN (E4M3) or inf (E5M2) magnitude code
  bool next_after_max_is_even;  // mantissa parity of the first value past max
  float next_after_max;
  void (*bulk_encode)(std::span<const float>, std::span<uint8_t>, Overflow);
  void (*bulk_decode)(std::span<const uint8_t>, std::span<float>);
};

const Format kE4M3{"e4m3", encode_e4m3, decode_e4m3, 448.0f, 0x7E, 0x7F, false, 480.0f,
                   encode_e4m3, decode_e4m3};
const Format kE5M2{"e5m2", encode_e5m2, decode_e5m2, 57344.0f, 0x7B, 0x7C, true, 65536.0f,
                   encode_e5m2, decode_e5m2};

bool IsNanCode(const Format& f, uint8_t c) { return std::isnan(f.decode(c)); }

// Brute force: nearest finite code of x's sign, ties to the even code; a tie
// or nearer hit on the value just past max means overflow.
uint8_t Oracle(const Format& f, float x, Overflow ov) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return 0x7F | sign;
  const double ax = std::fabs(static_cast<double>(x));
  int best = -1;
  double best_err = INFINITY;
  for (int c = 0; c <= f.max_code; ++c) {
    const double v = f.decode(static_cast<uint8_t>(c));
    const double err = std::fabs(v - ax);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  // Overflow: past the midpoint between max and the first value beyond it,
  // or on it when that value's code would be the even one.
  const double mid = (static_cast<double>(f.max) + f.next_after_max) / 2;
  const bool overflow = std::isinf(x) || ax > mid || (ax == mid && f.next_after_max_is_even);
  if (overflow) return (ov == Overflow::Saturate ? f.max_code : f.nosat_overflow) | sign;
  return static_cast<uint8_t>(best) | sign;
}

class Fp8Test : public ::testing::TestWithParam<const Format*> {};

TEST_P(Fp8Test, AllCodesDecodeEncodeIdentity) {
  const Format& f = *GetParam();
  std::set<uint32_t> finite_values;
  int nan_codes = 0;
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float v = f.decode(code);
    if (std::isnan(v)) {
      ++nan_codes;
      EXPECT_TRUE(std::isnan(f.decode(f.encode(v, Overflow::Saturate))));
      continue;
    }
    if (std::isinf(v)) {
      EXPECT_EQ(f.encode(v, Overflow::NoSaturate), code);
      EXPECT_EQ(f.encode(v, Overflow::Saturate), f.max_code | (code & 0x80));
      continue;
    }
    finite_values.insert(std::bit_cast<uint32_t>(v));
    EXPECT_EQ(f.encode(v, Overflow::Saturate), code) << "code " << c;
    EXPECT_EQ(f.encode(v, Overflow::NoSaturate), code) << "code " << c;
  }
  // Distinct finite values: every finite code (including -0) decodes uniquely.
  if (std::string(f.name) == "e4m3") {
    EXPECT_EQ(nan_codes, 2);
    EXPECT_EQ(finite_values.size(), 254u);
  } else {
    EXPECT_EQ(nan_codes, 6);
    EXPECT_EQ(finite_values.size(), 248u);
  }
  EXPECT_EQ(std::bit_cast<uint32_t>(f.decode(0x80)), 0x80000000u);  // -0
  EXPECT_EQ(f.decode(f.max_code), f.max);
  EXPECT_EQ(f.decode(f.max_code | 0x80), -f.max);
}

TEST_P(Fp8Test, RepresentableValuesAndMidpointsMatchOracle) {
  const Format& f = *GetParam();
  std::vector<float> probes;
  std::vector<double> pos;
  for (int c = 0; c <= f.max_code; ++c) pos.push_back(f.decode(static_cast<uint8_t>(c)));
  pos.push_back(f.next_after_max);
  for (size_t i = 0; i < pos.size(); ++i) {
    probes.push_back(static_cast<float>(pos[i]));
    if (i + 1 < pos.size()) {
      const float mid = static_cast<float>((pos[i] + pos[i + 1]) / 2);  // exact in float
      ASSERT_EQ(static_cast<double>(mid), (pos[i] + pos[i + 1]) / 2);
      probes.push_back(mid);
      probes.push_back(std::nextafter(mid, 0.0f));
      probes.push_back(std::nextafter(mid, INFINITY));
    }
  }
  probes.push_back(std::numeric_limits<float>::denorm_min());
  probes.push_back(std::numeric_limits<float>::min());
  probes.push_back(std::numeric_limits<float>::max());
  probes.push_back(INFINITY);
  const size_t n = probes.size();
  for (size_t i = 0; i < n; ++i) probes.push_back(-probes[i]);
  for (Overflow ov : {Overflow::Saturate, Overflow::NoSaturate}) {
    for (float x : probes) {
      ASSERT_EQ(f.encode(x, ov), Oracle(f, x, ov))
          << f.name << " x=" << x << " bits=0x" << std::hex << std::bit_cast<uint32_t>(x)
          << " ov=" << static_cast<int>(ov);
    }
  }
}

TEST_P(Fp8Test, RandomBitPatternsMatchOracle) {
  const Format& f = *GetParam();
  test::Rng rng(42);
  for (int i = 0; i < 20000; ++i) {
    // Half the probes in the format's range, half anywhere.
    float x = rng.Bits32Float();
    if (i & 1) x = static_cast<float>((rng.Uniform() * 2 - 1) * f.max * 1.2);
    for (Overflow ov : {Overflow::Saturate, Overflow::NoSaturate}) {
      ASSERT_EQ(f.encode(x, ov), Oracle(f, x, ov)) << f.name << " x=" << x;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Test, ::testing::Values(&kE4M3, &kE5M2),
                         [](const auto& info) { return std::string(info.param->name); });

struct Golden {
  float x;
  uint8_t sat;
  uint8_t nosat;
};

void CheckGolden(const Format& f, const std::vector<Golden>& table) {
  for (const Golden& g : table) {
    for (int s = 0; s < 2; ++s) {
      const float x = s ? -g.x : g.x;
      const uint8_t sign = s ? 0x80 : 0x00;
      EXPECT_EQ(f.encode(x, Overflow::Saturate), g.sat | sign) << f.name << " x=" << x;
      EXPECT_EQ(f.encode(x, Overflow::NoSaturate), g.nosat | sign) << f.name << " x=" << x;
    }
  }
}

TEST(Fp8Golden, E4M3RoundingEdges) {
  CheckGolden(kE4M3, {
      {0.0f, 0x00, 0x00},
      {1.0f, 0x38, 0x38},
      {1.0625f, 0x38, 0x38},             // tie 1.0 | 1.125 -> even (1.0)
      {std::nextafter(1.0625f, 2.0f), 0x39, 0x39},
      {1.1875f, 0x3A, 0x3A},             // tie 1.125 | 1.25 -> even (1.25)
      {1.9375f, 0x40, 0x40},             // tie 1.875 | 2.0 -> carry into exponent
      {0x1p-9f, 0x01, 0x01},             // smallest subnormal
      {0x1p-10f, 0x00, 0x00},            // half of it: tie -> 0
      {std::nextafter(0x1p-10f, 1.0f), 0x01, 0x01},
      {3 * 0x1p-10f, 0x02, 0x02},        // tie 1 | 2 steps -> 2
      {0x1p-6f, 0x08, 0x08},             // smallest normal
      {0x1p-6f - 0x1p-10f, 0x08, 0x08},  // tie 7 | 8 steps -> carry to normal
      {448.0f, 0x7E, 0x7E},
      {464.0f, 0x7E, 0x7E},              // tie 448 | (480) -> even (448)
      {std::nextafter(464.0f, 1e9f), 0x7E, 0x7F},
      {1e6f, 0x7E, 0x7F},
      {INFINITY, 0x7E, 0x7F},
  });
  EXPECT_EQ(encode_e4m3(NAN), 0x7F);
  EXPECT_EQ(encode_e4m3(-NAN), 0xFF);
  EXPECT_TRUE(std::isnan(decode_e4m3(0x7F)));
  EXPECT_TRUE(std::isnan(decode_e4m3(0xFF)));
  EXPECT_EQ(decode_e4m3(0x01), 0x1p-9f);
  EXPECT_EQ(decode_e4m3(0x7E), 448.0f);
}

TEST(Fp8Golden, E5M2RoundingEdges) {
  CheckGolden(kE5M2, {
      {0.0f, 0x00, 0x00},
      {1.0f, 0x3C, 0x3C},
      {1.125f, 0x3C, 0x3C},              // tie 1.0 | 1.25 -> even (1.0)
      {1.375f, 0x3E, 0x3E},              // tie 1.25 | 1.5 -> even (1.5)
      {1.875f, 0x40, 0x40},              // tie 1.75 | 2.0 -> carry into exponent
      {0x1p-16f, 0x01, 0x01},
      {0x1p-17f, 0x00, 0x00},
      {std::nextafter(0x1p-17f, 1.0f), 0x01, 0x01},
      {0x1p-14f, 0x04, 0x04},
      {57344.0f, 0x7B, 0x7B},
      {std::nextafter(61440.0f, 0.0f), 0x7B, 0x7B},
      {61440.0f, 0x7B, 0x7C},            // tie 57344 | 65536 -> even = overflow
      {INFINITY, 0x7B, 0x7C},
  });
  EXPECT_EQ(encode_e5m2(NAN), 0x7F);
  EXPECT_EQ(decode_e5m2(0x7C), INFINITY);
  EXPECT_EQ(decode_e5m2(0xFC), -INFINITY);
  for (int c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(decode_e5m2(static_cast<uint8_t>(c))));
  EXPECT_EQ(decode_e5m2(0x01), 0x1p-16f);
}

// Bulk == scalar on every compiled target; lengths 0..2N+, misaligned spans,
// sentinel-filled outputs (a lane never written would show up).
TEST(Fp8Bulk, MatchesScalarOnEveryTarget) {
  test::Rng rng(7);
  std::vector<float> src(4096 + 64);
  for (size_t i = 0; i < src.size(); ++i) {
    switch (i % 4) {
      case 0: src[i] = rng.Bits32Float(); break;  // anything, incl. NaN/Inf
      case 1: src[i] = static_cast<float>(rng.Gaussian() * 100); break;
      case 2: src[i] = static_cast<float>(rng.Gaussian() * 0.01); break;  // subnormals
      default: src[i] = static_cast<float>(rng.Gaussian() * 1e5); break;  // overflow
    }
  }
  std::vector<uint8_t> all_codes(256);
  for (int c = 0; c < 256; ++c) all_codes[static_cast<size_t>(c)] = static_cast<uint8_t>(c);

  test::ForEachTarget([&](const char*) {
    for (const Format* f : {&kE4M3, &kE5M2}) {
      for (Overflow ov : {Overflow::Saturate, Overflow::NoSaturate}) {
        for (size_t len : {0, 1, 3, 7, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 1000, 4096}) {
          for (size_t off : {0, 1, 3}) {
            std::vector<uint8_t> out(len + 2, 0xA5);
            f->bulk_encode({src.data() + off, len}, {out.data() + 1, len}, ov);
            ASSERT_EQ(out[0], 0xA5);
            ASSERT_EQ(out[len + 1], 0xA5);
            for (size_t i = 0; i < len; ++i) {
              ASSERT_EQ(out[i + 1], f->encode(src[off + i], ov)) << f->name << " i=" << i << " len=" << len;
            }
          }
        }
      }
      for (size_t off : {0, 1, 5}) {
        const size_t len = 256 - off;
        std::vector<float> out(len + 2, 12345.0f);
        f->bulk_decode({all_codes.data() + off, len}, {out.data() + 1, len});
        ASSERT_EQ(out[0], 12345.0f);
        ASSERT_EQ(out[len + 1], 12345.0f);
        for (size_t i = 0; i < len; ++i) {
          const float want = f->decode(all_codes[off + i]);
          ASSERT_EQ(std::bit_cast<uint32_t>(out[i + 1]), std::bit_cast<uint32_t>(want))
              << f->name << " code=" << int(all_codes[off + i]);
        }
      }
    }
  });
}

}  // namespace
}  // namespace kvq::fp8
