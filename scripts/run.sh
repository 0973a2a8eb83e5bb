#!/usr/bin/env bash
# Sets everything up and runs the main job: `kvq eval` of every KV scheme on
# the shipped model and text (found through $KVQ_SHARED, default ../shared).
# Without the model files it runs the synthetic demo instead and says so.
# It writes the run's JSON to out/eval.json and the frontier plot to
# out/frontier.svg (docs/frontier.svg, shown in docs/eval.md, is a copy of it).
# Extra arguments go to `kvq eval` (e.g. --max-windows 50 --window 128).
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the job runs: the CLI (the tests and benchmarks are the test
# command's to build).
bash scripts/build.sh release kvq_cli
export KVQ_SHARED=${KVQ_SHARED:-$(cd .. && pwd)/shared}
model=$KVQ_SHARED/models/stories260K/stories260K.bin
if [ -f "$model" ]; then
  mkdir -p out
  ./build/release/kvq eval --kv all --json out/eval.json "$@"
  /usr/bin/python3 scripts/plot_frontier.py out/eval.json out/frontier.svg
  echo "wrote out/eval.json and out/frontier.svg (the frontier plot)" >&2
else
  echo "kvq: model not found at $model (set KVQ_SHARED); running the synthetic demo instead." >&2
  ./build/release/kvq demo
fi
