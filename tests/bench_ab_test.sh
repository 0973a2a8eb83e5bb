#!/usr/bin/env bash
# scripts/bench_ab.sh: one median row per benchmark and binary, and exit
# code 2 (with a message) on bad arguments.
set -u
AB=$1
BENCH=$2
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
pass=0; fail=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1"; fail=$((fail+1)); fi; }

bash "$AB" 'BM_decode_attention/fp32/1024/' 2 "$BENCH" "$BENCH" >"$T/out" 2>"$T/err"; rc=$?
check "runs" '[ $rc -eq 0 ]'
check "header names both binaries" 'head -1 "$T/out" | grep -q "kvq_bench.*kvq_bench"'
check "one row, two medians with units" '[ $(wc -l <"$T/out") -eq 2 ] && tail -1 "$T/out" | grep -Eq "^BM_decode_attention/fp32/1024/real_time +[0-9.]+ +us +[0-9.]+ +us$"'

# Benchmarks whose counters differ (weights/s, MAC/s): Google Benchmark's
# CSV reporter aborts on them in one process; the script runs each alone.
bash "$AB" 'BM_weight_(matvec_int8|matmul_int8)/Q4_0/threads:1/' 1 "$BENCH" >"$T/out" 2>"$T/err"; rc=$?
check "benchmarks with different counters: both rows" '[ $rc -eq 0 ] && [ $(wc -l <"$T/out") -eq 3 ] && grep -q "^BM_weight_matvec_int8/Q4_0/threads:1/real_time " "$T/out" && grep -q "^BM_weight_matmul_int8/Q4_0/threads:1/real_time " "$T/out"'

bash "$AB" x 0 "$BENCH" >/dev/null 2>"$T/err"; rc=$?
check "ROUNDS 0 exits 2" '[ $rc -eq 2 ] && grep -q "ROUNDS" "$T/err"'
bash "$AB" x 1 "$T/missing" >/dev/null 2>"$T/err"; rc=$?
check "missing binary exits 2" '[ $rc -eq 2 ] && grep -q "missing" "$T/err"'
bash "$AB" x >/dev/null 2>"$T/err"; rc=$?
check "too few arguments exits 2" '[ $rc -eq 2 ] && grep -q "usage" "$T/err"'
bash "$AB" 'BM_no_such_benchmark' 1 "$BENCH" >/dev/null 2>"$T/err"; rc=$?
check "no match exits 1" '[ $rc -eq 1 ] && grep -q "no benchmark matched" "$T/err"'

echo "bench_ab_test: $pass passed, $fail failed"
[ $fail -eq 0 ]
