#!/usr/bin/env bash
# scripts/prefix_store_table.py end to end on two schemes, briefly: both
# tables print, kvq-4.5 stores >= 3x fewer bytes a token than fp16 on
# Llama-3-8B's geometry, and the warm run reuses a chunk with the same text.
set -u
SCRIPT=$1; BUILD=$2
SHARED=${KVQ_SHARED:-$KVQ_DEFAULT_SHARED}
if [ ! -f "$SHARED/models/stories260K/stories260K.bin" ]; then
  if [ "${KVQ_REQUIRE_DATA:-0}" = "1" ]; then echo "FAIL: model missing (KVQ_REQUIRE_DATA=1)"; exit 1; fi
  echo "SKIP: model not found; set KVQ_SHARED"; exit 0
fi
export KVQ_SHARED=$SHARED
out=$(/usr/bin/python3 "$SCRIPT" --build "$BUILD" --min-time 0.01 --repetitions 1 --schemes fp16,kvq-4.5) || { echo "FAIL: the script failed"; exit 1; }
echo "$out"
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
check "the geometry table has both rows" 'echo "$out" | grep -q "^| fp16 | 256 |" && echo "$out" | grep -q "^| kvq-4.5 | 256 |"'
check "kvq-4.5 stores >= 3x fewer bytes than fp16" '[ "$(echo "$out" | awk -F"|" "/^\| kvq-4.5 \| 256 \|/ {print (\$6 >= 3.0)}")" = 1 ]'
check "redis columns (redis-server installed)" 'echo "$out" | grep -q "redis put"'
check "the warm run reuses a chunk, same text" 'echo "$out" | grep -q "^| dir | kvq-4.5 | 480 | .* | 272 | .* | yes |"'
exit $fail
