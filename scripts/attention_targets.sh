#!/usr/bin/env bash
# docs/performance.md's per-target speed tables: BM_decode_attention (warm and cold, T =
# 16384, 32/8 heads, head_dim 128, 2 threads) and BM_attention_geometry (MHA
# 32/32, GQA 8 32/4, head_dim 64 and 128, T = 4096) for fp32, fp16, int8,
# q8_0, q4_0 and the presets, one kvq_bench run per SIMD target this CPU
# supports (or the ones named), repetitions interleaved, then the tables.
# Usage: scripts/attention_targets.sh [OUT_DIR] [TARGET...]
#   e.g. scripts/attention_targets.sh build/attn AVX3_DL AVX2
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${KVQ_BENCH:-build/release/bench/kvq_bench}
out=${1:-build/attn}
shift || true
[ -x "$BENCH" ] || { echo "attention_targets.sh: $BENCH not built (bash scripts/build.sh)" >&2; exit 2; }
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <("$BENCH" --kvq_list_targets)
S='(fp32|fp16|int8|q8_0|q4_0|kvq-6.5|kvq-4.5|kvq-3.5|kvq-2.5)'
filter="^BM_decode_attention(_cold)?/$S/16384/|^BM_attention_geometry/(fp32|q4_0|kvq-6.5|kvq-4.5|kvq-3.5|kvq-2.5)/q32kv(32|4)/hd(64|128)/4096/t2/"
mkdir -p "$out"
files=()
for t in "${targets[@]}"; do
  echo "== $t" >&2
  "$BENCH" --kvq_targets="$t" --benchmark_filter="$filter" --benchmark_repetitions="${REPS:-3}" \
    --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
    --benchmark_format=json >"$out/$t.json"
  [ -s "$out/$t.json" ] || { echo "attention_targets.sh: no benchmark ran for $t" >&2; exit 1; }
  files+=("$out/$t.json")
done
/usr/bin/python3 scripts/attention_table.py "${files[@]}"
