#!/usr/bin/env bash
# Sets everything up and runs every test (gtest via ctest).
# Usage: scripts/test.sh [preset]   (default: release)
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
bash scripts/build.sh "$preset"
ctest --preset "$preset" -j "$(nproc)"
