// SIMD target selection (kvq/targets.h).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/base/targets.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace kvq {
namespace HWY_NAMESPACE {
int64_t ThisTarget() { return HWY_TARGET; }
}  // namespace HWY_NAMESPACE
}  // namespace kvq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "hwy/targets.h"
#include "kvq/error.h"
#include "kvq/targets.h"

namespace kvq {
HWY_EXPORT(ThisTarget);

namespace {
std::string Upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// The real supported targets (no mock), compiled ones only.
int64_t RealTargets() {
  static const int64_t real = [] {
    hwy::SetSupportedTargetsForTest(0);
    return hwy::SupportedTargets() & HWY_TARGETS;
  }();
  return real;
}

std::string Names(int64_t mask) {
  std::string out;
  for (int64_t bit = 1; bit != 0 && bit <= mask; bit <<= 1) {
    if (mask & bit) out += std::string(out.empty() ? "" : ", ") + hwy::TargetName(bit);
  }
  return out;
}
}  // namespace

namespace {
void Apply(const std::string& name, const char* what) {
  const int64_t real = RealTargets();
  if (name.empty()) {
    hwy::SetSupportedTargetsForTest(0);
    return;
  }
  const std::string want = Upper(name);
  int64_t bit = 0;
  for (int i = 0; i < 63; ++i) {
    const int64_t b = int64_t{1} << i;
    if ((HWY_TARGETS & b) && Upper(hwy::TargetName(b)) == want) bit = b;
  }
  KVQ_CHECK_ARG(bit != 0, what, ": unknown SIMD target '", name, "'; expected one of the compiled targets: ",
                Names(HWY_TARGETS));
  KVQ_CHECK_ARG((real & bit) != 0, what, ": this CPU cannot run the SIMD target '", name,
                "'; it supports: ", Names(real));
  // Targets are bits, better ones lower: keep `bit` and every bit above it.
  hwy::SetSupportedTargetsForTest(real & ~(bit - 1));
}

std::once_flag env_once;
}  // namespace

void apply_simd_targets_from_env() {
  std::call_once(env_once, [] {
    const char* env = std::getenv("KVQ_TARGETS");
    if (env != nullptr && *env != '\0') Apply(env, "KVQ_TARGETS");
  });
}

// The environment first, so that a later KvCache (which applies it) does not
// undo an explicit choice.
void set_simd_targets(const std::string& name, const char* what) {
  apply_simd_targets_from_env();
  Apply(name, what);
}

std::string dispatched_simd_target() { return hwy::TargetName(HWY_DYNAMIC_DISPATCH(ThisTarget)()); }

std::vector<std::string> supported_simd_targets() {
  std::vector<std::string> out;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) out.push_back(hwy::TargetName(t));
  return out;
}

std::string cpu_simd_flags() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    const bool x86 = line.rfind("flags", 0) == 0, arm = line.rfind("Features", 0) == 0;
    if (!x86 && !arm) continue;
    std::istringstream words(line.substr(line.find(':') == std::string::npos ? line.size() : line.find(':') + 1));
    std::set<std::string> keep;
    std::string w;
    while (words >> w) {
      const bool simd = w.rfind("avx", 0) == 0 || w.rfind("sse", 0) == 0 || w == "ssse3" || w == "fma" ||
                        w == "f16c" || w.find("vnni") != std::string::npos ||
                        w == "asimd" || w == "asimddp" || w == "asimdhp" || w.rfind("sve", 0) == 0 ||
                        w == "i8mm" || w == "bf16" || w == "fphp";
      if (simd) keep.insert(w);
    }
    std::string out;
    for (const std::string& k : keep) out += (out.empty() ? "" : " ") + k;
    return out;
  }
  return "";
}

}  // namespace kvq
#endif  // HWY_ONCE
