#!/usr/bin/env bash
# Sets everything up and runs the main job: the synthetic K/V demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh release
./build/release/kvq demo "$@"
