#!/usr/bin/env bash
# Cross-compiles the core library and its kernel, codec and cache tests for
# aarch64 (Debian's g++-aarch64-linux-gnu, arm64 multiarch packages) and runs
# them under qemu-user with -cpu max, so Highway's per-target loops run every
# ARM target qemu emulates (NEON, SVE, SVE2), each against the scalar
# references. Speed is not measured here (qemu is an emulator).
# Every test of the core runs (118; 4-6.5 minutes on 2 cores), the longest
# sweeps in their quick form (KVQ_TEST_QUICK=1).
# Usage: scripts/arm_test.sh [ctest -R regex]
set -euo pipefail
cd "$(dirname "$0")/.."
KVQ_WITH_ARM=1 bash scripts/install_deps.sh
B=build/aarch64
cmake -S . -B "$B" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_BUILD_TYPE=Release \
  -DKVQ_CORE_ONLY=ON >/dev/null
cmake --build "$B" -j "$(nproc)"
# libgomp's threads hang under qemu-user 7.2 (a two-thread parallel loop
# never returns, seen with every -cpu): one OpenMP thread there. The
# threaded paths are target-independent and run natively on x86.
export KVQ_TEST_QUICK=1 OMP_THREAD_LIMIT=1
qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu "$B/tests/targets_test" \
  --gtest_filter=Targets.EachNamedTargetIsTheOneDispatched | grep "^supported SIMD targets"
ctest --test-dir "$B" -j "$(nproc)" --output-on-failure --timeout 900 ${1:+-R "$1"}
