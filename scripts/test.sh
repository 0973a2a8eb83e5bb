#!/usr/bin/env bash
# Sets everything up and runs every test (gtest via ctest).
# Usage: scripts/test.sh [preset]   (default: release)
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
KVQ_WITH_TORCH=${KVQ_WITH_TORCH:-1} bash scripts/build.sh "$preset"
ctest --preset "$preset" -j "$(nproc)"
