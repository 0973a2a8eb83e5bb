#!/usr/bin/env bash
# Sets everything up and runs the main job: `kvq eval` of every KV scheme on
# the shipped model and text (found through $KVQ_SHARED, default ../shared).
# Without the model files it runs the synthetic demo instead and says so.
# Extra arguments go to `kvq eval` (e.g. --max-windows 50 --json out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh release
export KVQ_SHARED=${KVQ_SHARED:-$(cd .. && pwd)/shared}
model=$KVQ_SHARED/models/stories260K/stories260K.bin
if [ -f "$model" ]; then
  ./build/release/kvq eval --kv all "$@"
else
  echo "kvq: model not found at $model (set KVQ_SHARED); running the synthetic demo instead." >&2
  ./build/release/kvq demo
fi
