#!/usr/bin/env bash
# docs/eval.md's table is what today's code measures: runs its command
# (`kvq eval --kv all --threads 2`, 3-4 minutes on 2 cores, OpenBLAS's Haswell kernel) and hands the
# JSON to docs_test.py, which compares every row to the digits printed.
# Usage: docs_eval_test.sh KVQ_BINARY DOCS_TEST_PY
set -euo pipefail
kvq=$1 docs_test=$2
shared=${KVQ_SHARED:-${KVQ_DEFAULT_SHARED:-}}
if [ -z "$shared" ] || [ ! -f "$shared/models/stories260K/stories260K.bin" ]; then
  if [ "${KVQ_REQUIRE_DATA:-0}" = 1 ]; then echo "FAIL: KVQ_REQUIRE_DATA=1 but no model under '$shared'"; exit 1; fi
  echo "SKIP: stories260K not found (set KVQ_SHARED)"; exit 77
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# OpenBLAS picks its sgemm kernel by CPU (Debian 12's 0.3.21: SkylakeX on
# Zen 4, Haswell on Zen 5), and the calibrated presets' ranges come from
# sequences generated through it: their figures move in the fifth digit.
# docs/eval.md's table is from the Haswell kernel, which every AVX2 CPU runs.
export OPENBLAS_CORETYPE=Haswell
KVQ_SHARED=$shared "$kvq" eval --kv all --threads 2 --json "$tmp/eval.json" >"$tmp/out" 2>"$tmp/err" || {
  echo "FAIL: kvq eval exited $?"; tail -20 "$tmp/err"; exit 1; }
/usr/bin/python3 "$docs_test" "$kvq" "$tmp/eval.json"
