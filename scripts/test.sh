#!/usr/bin/env bash
# Sets everything up and runs every test: gtest, the CLI contract and the
# Python module's pytest suite, all through ctest.
# Usage: scripts/test.sh [preset]   (default: release)
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
# The Python tests include torch in/out: install Debian's python3-torch too.
export KVQ_WITH_TORCH=${KVQ_WITH_TORCH:-1}
# ... and llama.cpp (node-llama-cpp from npm) as the oracle of eval's llama-perplexity protocol.
export KVQ_WITH_ORACLES=${KVQ_WITH_ORACLES:-1}
bash scripts/build.sh "$preset"
ctest --preset "$preset" -j "$(nproc)"
