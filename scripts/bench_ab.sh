#!/usr/bin/env bash
# Interleaved A/B of kvq_bench binaries: runs each binary in turn, ROUNDS
# times, so a busy minute on a shared machine hits every binary alike, then
# prints each benchmark's median real time per binary.
#
#   scripts/bench_ab.sh FILTER ROUNDS BINARY...
#   e.g. cp build/release/bench/kvq_bench /tmp/before   (build the change)
#        scripts/bench_ab.sh 'BM_decode_attention/q4_0/16384' 5 /tmp/before build/release/bench/kvq_bench
set -euo pipefail
if [[ $# -lt 3 ]]; then
  echo "usage: $0 FILTER ROUNDS BINARY..." >&2
  exit 2
fi
filter=$1 rounds=$2
shift 2
if ! [[ $rounds =~ ^[1-9][0-9]*$ ]]; then
  echo "ROUNDS must be a positive integer, got '$rounds'" >&2
  exit 2
fi
for b in "$@"; do
  [[ -x $b ]] || { echo "not an executable: $b" >&2; exit 2; }
done
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# One process per benchmark: Google Benchmark's CSV reporter aborts when a
# run's counters differ from the first run's (BM_weight_matvec_int8's
# weights/s beside BM_weight_matmul_int8's MAC/s).
mapfile -t names < <("$1" --benchmark_filter="$filter" --benchmark_list_tests 2>/dev/null)
for ((r = 0; r < rounds; ++r)); do
  for name in "${names[@]}"; do
    exact="^$(printf '%s' "$name" | sed 's/[][\.*^$()+?{}|]/\\&/g')\$"
    i=0
    for b in "$@"; do
      "$b" --benchmark_filter="$exact" --benchmark_min_time=0.5 --benchmark_format=csv 2>/dev/null |
        awk -F, -v b="$i" '$1 ~ /^"BM_/ {gsub(/"/, "", $1); print b, $1, $3, $5}' >>"$out"
      i=$((i + 1))
    done
  done
done
[[ -s $out ]] || { echo "no benchmark matched '$filter'" >&2; exit 1; }
printf '%-60s' benchmark
for b in "$@"; do printf ' %14s' "$(basename "$b")"; done
printf '\n'
sort -k2,2 -k1,1n -k3,3g "$out" | awk -v n=$# '
  { key = $2; if (!(key in seen)) { seen[key] = 1; order[++k] = key } v[key, $1, ++c[key, $1]] = $3; unit[key] = $4 }
  END {
    for (j = 1; j <= k; ++j) {
      key = order[j]; printf "%-60s", key
      for (b = 0; b < n; ++b) { m = c[key, b]; med = m ? v[key, b, int((m + 1) / 2)] : "-"; printf " %11s %2s", med, unit[key] }
      printf "\n"
    }
  }'
