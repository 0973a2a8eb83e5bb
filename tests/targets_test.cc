// kvq/targets.h: the run-time target switch (KVQ_TARGETS) and what it reports.
#include "kvq/targets.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kvq/error.h"
#include "kvq/kv_cache.h"

namespace kvq {
namespace {

// An explicit choice made before the first cache stays: constructing a
// KvCache reads KVQ_TARGETS once and must not reset it.
TEST(Targets, AnExplicitChoiceSurvivesTheFirstCache) {
  const std::vector<std::string> all = supported_simd_targets();
  set_simd_targets(all.back());
  KvCache c("fp16", 1, 4, 1, 16);
  EXPECT_EQ(dispatched_simd_target(), all.back());
  set_simd_targets("");
}

// Each supported target, named, is the one the kernels dispatch to; the
// weaker ones stay available below it; "" restores the best.
TEST(Targets, EachNamedTargetIsTheOneDispatched) {
  const std::vector<std::string> all = supported_simd_targets();
  ASSERT_FALSE(all.empty());
  std::string names;
  for (const std::string& t : all) names += " " + t;
  std::printf("supported SIMD targets:%s; CPU flags: %s\n", names.c_str(), cpu_simd_flags().c_str());
  EXPECT_EQ(dispatched_simd_target(), all.front());
  for (size_t i = 0; i < all.size(); ++i) {
    SCOPED_TRACE(all[i]);
    set_simd_targets(all[i]);
    EXPECT_EQ(dispatched_simd_target(), all[i]);
    const std::vector<std::string> now = supported_simd_targets();
    EXPECT_EQ(now, std::vector<std::string>(all.begin() + static_cast<std::ptrdiff_t>(i), all.end()));
    // A cache attends on it (the grouped kernel's dispatch follows).
    KvCache c("k4v3g16", 1, 64, 1, 16);
    std::vector<float> k(16, 0.5f), v(16, 0.25f), q(16, 1.0f), out(16);
    for (int t = 0; t < 64; ++t) c.write(0, t, k, v);
    c.attend(0, q, 1, out);
    EXPECT_NEAR(out[3], 0.25f, 1e-2f);
  }
  set_simd_targets("");
  EXPECT_EQ(dispatched_simd_target(), all.front());
  // Names are case-insensitive.
  std::string lower = all.back();
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  set_simd_targets(lower);
  EXPECT_EQ(dispatched_simd_target(), all.back());
  set_simd_targets("");
}

TEST(Targets, UnknownOrUnsupportedNamesAreClearErrors) {
  const std::string best = dispatched_simd_target();
  try {
    set_simd_targets("AVX9", "KVQ_TARGETS");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("KVQ_TARGETS: unknown SIMD target 'AVX9'"), std::string::npos) << m;
    EXPECT_NE(m.find(best), std::string::npos) << m;  // the compiled targets are listed
  }
  EXPECT_EQ(dispatched_simd_target(), best);  // nothing changed
#if HWY_ARCH_X86
  EXPECT_THROW(set_simd_targets("NEON"), Error);  // not compiled on x86
#endif
}

TEST(Targets, CpuFlagsNameTheSimdExtensions) {
  const std::string flags = cpu_simd_flags();
#if HWY_ARCH_X86
  EXPECT_NE(flags.find("sse2"), std::string::npos) << flags;
#endif
  EXPECT_EQ(flags.find("fpu"), std::string::npos) << flags;
}

}  // namespace
}  // namespace kvq
