// src/base/names.h: one table per enum, read both ways.
#include "src/base/names.h"

#include <gtest/gtest.h>

#include "kvq/affine.h"
#include "kvq/tensor.h"
#include "tests/test_util.h"

namespace kvq {
namespace {

enum class Color { kRed, kGreen, kBlue, kNone };
constexpr NamedValue<Color> kColors[] = {{Color::kRed, "red"}, {Color::kGreen, "green"}, {Color::kBlue, "blue"}};

TEST(Names, ReadBothWaysAndListEveryNameInErrors) {
  EXPECT_STREQ(name_of(kColors, Color::kGreen), "green");
  EXPECT_STREQ(name_of(kColors, Color::kNone), "unknown");
  EXPECT_STREQ(name_of(kColors, Color::kNone, "?"), "?");
  for (const auto& [v, n] : kColors) EXPECT_EQ(parse_name(kColors, n, "color"), v);
  EXPECT_EQ(names_of(kColors), "'red', 'green' or 'blue'");
  EXPECT_EQ(test::ErrorOf([] { parse_name(kColors, "Red", "--color"); }),
            "--color: expected 'red', 'green' or 'blue', got 'Red'");
}

TEST(Names, TheLibrarysTablesRoundTrip) {
  for (QuantMode m : {QuantMode::Int8, QuantMode::Fp8}) EXPECT_EQ(parse_quant_mode(quant_mode_name(m), "mode"), m);
  EXPECT_NE(test::ErrorOf([] { parse_quant_mode("int4", "mode"); }).find("'int8' or 'fp8'"), std::string::npos);
  EXPECT_STREQ(dtype_name(DType::F8_E5M2), "f8_e5m2");
  EXPECT_STREQ(dtype_name(static_cast<DType>(250)), "unknown");
}

}  // namespace
}  // namespace kvq
