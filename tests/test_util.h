// Shared test helpers: per-target runs, a portable Gaussian generator,
// distortion statistics, and locating ../shared data.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "kvq/error.h"
#include "src/io/container.h"

namespace kvq::test {

// Runs fn once per SIMD target compiled in and supported by this CPU, with
// Highway's dispatch forced to that target. Restores normal dispatch after.
inline void ForEachTarget(const std::function<void(const char*)>& fn) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    fn(hwy::TargetName(target));
  }
  hwy::SetSupportedTargetsForTest(0);
}

// KVQ_TEST_QUICK=1 (scripts/arm_test.sh, under qemu): tests that loop over
// many cases keep a representative few.
inline bool Quick() {
  const char* e = std::getenv("KVQ_TEST_QUICK");
  return e != nullptr && e[0] == '1';
}

// SplitMix64: identical streams on every platform and standard library.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1): 53 random bits, never exactly 0.
  double Uniform() { return (static_cast<double>(Next() >> 11) + 0.5) * 0x1.0p-53; }
  // Standard normal by Box-Muller (std::normal_distribution differs across
  // standard libraries; this does not).
  double Gaussian() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = Uniform(), u2 = Uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * M_PI * u2);
  }
  float Bits32Float() {  // any float bit pattern
    const uint32_t b = static_cast<uint32_t>(Next());
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }

 private:
  uint64_t s_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

// LLM-like K/V: Gaussian tokens with a few outlier channels of large scale.
inline std::vector<float> SyntheticKV(Rng& rng, int64_t tokens, int64_t channels,
                                      float outlier_scale = 20.0f) {
  std::vector<float> x(static_cast<size_t>(tokens * channels));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < channels; ++c) {
      const float s = (c % 37 == 5) ? outlier_scale : 1.0f;
      x[static_cast<size_t>(t * channels + c)] = s * static_cast<float>(rng.Gaussian());
    }
  }
  return x;
}

// The message of the kvq::Error that fn throws, or "<no error>".
inline std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

struct Distortion {
  double max_abs = 0.0;
  double nmse = 0.0;  // sum (x - y)^2 / sum x^2
  double snr_db = 0.0;
  int64_t exact = 0;
  int64_t sign_flips = 0;
};

inline Distortion Measure(const float* x, const float* y, size_t n) {
  Distortion d;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(x[i]) - static_cast<double>(y[i]);
    d.max_abs = std::max(d.max_abs, std::fabs(e));
    num += e * e;
    den += static_cast<double>(x[i]) * x[i];
    d.exact += (x[i] == y[i]);
    d.sign_flips += (x[i] > 0 && y[i] < 0) || (x[i] < 0 && y[i] > 0);
  }
  d.nmse = den > 0 ? num / den : 0.0;
  d.snr_db = num > 0 ? 10.0 * std::log10(den / num) : INFINITY;
  return d;
}

// ../shared (or $KVQ_SHARED). Returns "" and skips the test when absent,
// unless KVQ_REQUIRE_DATA=1, in which case the test fails.
// A crafted container: `bytes` (a valid container) with `n` bytes of its
// payload at absolute offset `at` replaced by `value`, re-wrapped under the
// same magic with a valid CRC32C, so the parser gets past the checksum.
inline std::vector<uint8_t> EditedContainer(const std::vector<uint8_t>& bytes, size_t at, const void* value,
                                            size_t n) {
  std::vector<uint8_t> payload(bytes.begin() + detail::kContainerHeaderBytes, bytes.end());
  std::memcpy(payload.data() + (at - detail::kContainerHeaderBytes), value, n);
  const char magic[4] = {static_cast<char>(bytes[0]), static_cast<char>(bytes[1]), static_cast<char>(bytes[2]),
                         static_cast<char>(bytes[3])};
  return detail::WrapContainer(magic, 1, payload);
}

inline std::string SharedDir() {
  const char* env = std::getenv("KVQ_SHARED");
  return env && *env ? env : KVQ_DEFAULT_SHARED;
}
inline bool DataRequired() {
  const char* r = std::getenv("KVQ_REQUIRE_DATA");
  return r && std::string(r) == "1";
}

}  // namespace kvq::test

// Use at the top of a test: locates a file under the shared dir, or skips
// (fails when KVQ_REQUIRE_DATA=1) with a clear message.
#define KVQ_REQUIRE_SHARED_FILE(var, relpath)                                        \
  std::string var = ::kvq::test::SharedDir() + "/" + (relpath);                      \
  if (!std::filesystem::exists(var)) {                                               \
    if (::kvq::test::DataRequired()) {                                               \
      FAIL() << "required data file missing: " << var << " (KVQ_REQUIRE_DATA=1)";    \
    }                                                                                \
    GTEST_SKIP() << "data file " << var << " not found; set KVQ_SHARED to the shared dir"; \
  }
