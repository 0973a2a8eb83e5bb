// SIMD targets: which of Highway's compiled targets kvq's kernels dispatch
// to, and a run-time switch to limit them.
//
// KVQ_TARGETS (an environment variable, read once, on the first call of
// apply_simd_targets_from_env: the CLI, the benchmarks, the Python module and
// every KvCache constructor make that call) names one Highway target, e.g.
// KVQ_TARGETS=AVX2; dispatch is then limited to that target and the weaker
// ones below it, so a machine can measure and test every target it can run.
// Unset or empty: every target the CPU supports (Highway's choice).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvq {

// Reads KVQ_TARGETS once and limits dispatch to it. Throws kvq::Error naming
// KVQ_TARGETS when the name is not a compiled target or this CPU cannot run
// it (and then again on every later call).
void apply_simd_targets_from_env();

// Limits dispatch to `name` (as Highway names it: AVX3_DL, AVX3, AVX2, SSE4,
// SSSE3, EMU128, NEON, SVE, SVE2 ...; case-insensitive) and the targets below
// it; "" restores every supported target. Throws kvq::Error (argument `what`)
// for an unknown name or one this CPU cannot run.
void set_simd_targets(const std::string& name, const char* what = "targets");

// The target kvq's kernels dispatch to now (a function compiled for every
// target, called through Highway's dynamic dispatch, reports its own).
std::string dispatched_simd_target();

// Every compiled target this CPU supports, best first.
std::vector<std::string> supported_simd_targets();

// The CPU's SIMD feature flags as the kernel reports them (/proc/cpuinfo's
// flags or Features line, filtered to the SIMD ones; "" when unreadable).
std::string cpu_simd_flags();

}  // namespace kvq
