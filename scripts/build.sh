#!/usr/bin/env bash
# Installs dependencies (idempotent) and builds the given CMake preset
# (default: release). Usage: scripts/build.sh [preset]
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
bash scripts/install_deps.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)"
